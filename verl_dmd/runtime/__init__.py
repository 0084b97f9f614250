"""Role runtime (layer 3): the role engine and phase execution on torch.distributed + FSDP2.

No ray here: tests and GPU benchmarks drive it under a plain process group or torchrun.
"""
