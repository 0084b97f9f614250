"""Check on one device that training with sleep/wake before every phase equals training without, bit for bit.

The CPU tests check this on 2 gloo ranks; this script checks the GPU-only paths
(pinned host buffer, packed wake from a private memory pool in runs, coalescing,
non-blocking transfers of the DMD2 computer's host-drawn noise) on a small
SD3-shaped model with LoRA roles: four runs of the same DMD2 phases from the
same seeds, (a) plain, (b) plain again, (c) with sleep/wake before every phase,
(d) plain with AdamW stepped on the DTensors instead of their local shards
(`RoleEngine.local_optimizer_step = False`). (a) == (b) shows the run is
deterministic on this device; (a) == (c) and (a) == (d) are the checks. Attention runs on PyTorch's math kernel, cuDNN and cuBLAS in their
deterministic modes, so that (a) == (b) can hold.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python scripts/check_sleep_training.py --device cuda

Exit status 0 when every tensor of the state (weights, EMA, both AdamW states)
matches, 1 otherwise (the first mismatches are printed).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def sd3_config(layers: int, hidden: int) -> dict:
    return {
        "sample_size": 32, "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": layers,
        "attention_head_dim": 64, "num_attention_heads": hidden // 64, "joint_attention_dim": 256,
        "caption_projection_dim": hidden, "pooled_projection_dim": 128, "pos_embed_max_size": 32,
    }  # fmt: skip


def run(
    args, device: torch.device, sleep: bool, local_step: bool = True
) -> tuple[dict[str, torch.Tensor], dict]:
    from verl_dmd.adapters import get_adapter
    from verl_dmd.checkpoint.engine_state import engine_state
    from verl_dmd.controller import DistillationController
    from verl_dmd.phases import PhaseRequest
    from verl_dmd.plan import DistillationPlan
    from verl_dmd.runtime.engine import RoleEngine, local_tensor
    from verl_dmd.runtime.offload import StateOffloader
    from verl_dmd.runtime.runtime import DistillationRoleRuntime

    torch.manual_seed(0)
    lora = {"rank": 8, "alpha": 8.0}
    plan = DistillationPlan.from_config({
        "algorithm": {"fake_update_ratio": 2, "teacher_guidance_scale": 4.0, "student_steps": 2},
        "model": {"adapter": "sd3", "storage": args.layout, "param_dtype": "bfloat16",
                  "teacher": {"config": sd3_config(args.layers, args.hidden)},
                  "student": {"lora": lora}, "fake_score": {"lora": lora}},
        "batch": {"student": {"micro_batch_size": 2}, "fake_score": {"micro_batch_size": 2}},
        "data": {"name": "synthetic"},
        "export": {"formats": ["diffusers"]},
    })  # fmt: skip
    adapter = get_adapter("sd3")()
    computer = adapter.build_distribution_matching_computer(plan.model, plan, rank=0)
    engine = RoleEngine(plan, adapter, device=device, extra_modules=computer.extra_modules())
    engine.local_optimizer_step = local_step
    runtime = DistillationRoleRuntime(engine, computer)
    offloader = StateOffloader(engine)
    controller = DistillationController(fake_update_ratio=2, fake_warmup_steps=0)
    generator = torch.Generator().manual_seed(1)
    info = {"storages": 0, "coalesced_storages": 0, "coalesce_rejected": 0}
    for _ in range(args.phases):
        if sleep:
            last = offloader.sleep()
            offloader.wake()
            info["storages"] = int(last["storages"])
            info["coalesced_storages"] += int(last["coalesced_storages"])
            info["coalesce_rejected"] += int(last["coalesce_rejected"])
        role = controller.next_phase()
        request = PhaseRequest(role=role, global_step=controller.global_step, role_step=0,
                               phase_index=controller.phase_index)  # fmt: skip
        batch = {
            "noise": torch.randn(2, 16, 32, 32, generator=generator),
            "cond.encoder_hidden_states": torch.randn(2, 7, 256, generator=generator),
            "cond.pooled_projections": torch.randn(2, 128, generator=generator),
            "uncond.encoder_hidden_states": torch.zeros(2, 7, 256),
            "uncond.pooled_projections": torch.zeros(2, 128),
        }
        metrics = runtime.run_phase(request, batch)
        controller.record(role, stepped=metrics["stepped"])
    state = {k: local_tensor(v).detach().to("cpu", copy=True) for k, v in engine_state(engine).items()}
    return state, info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--layout", default="shared_base_adapters", choices=["shared_base_adapters", "independent"]
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--phases", type=int, default=7)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no GPU")
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if device.index is None:  # "cuda": the current device, named by index (set_device needs one)
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False  # the patch conv
        torch.use_deterministic_algorithms(True, warn_only=True)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    plain, _ = run(args, device, sleep=False)
    again, _ = run(args, device, sleep=False)
    slept, info = run(args, device, sleep=True)
    dtensor_step, _ = run(args, device, sleep=False, local_step=False)
    gc.collect()  # the models' reference cycles hold the group: collected before it goes (architecture.md)
    dist.destroy_process_group()

    def differing(other: dict[str, torch.Tensor]) -> list[str]:
        return [k for k in plain if not torch.equal(plain[k], other[k])]

    nondeterministic, mismatched, step_mismatched = (
        differing(again),
        differing(slept),
        differing(dtensor_step),
    )
    print(f"{len(plain)} state tensors on {device}; {info['storages']} storages moved per sleep; "
          f"{info['coalesced_storages']} coalesced over the run, {info['coalesce_rejected']} left in place")  # fmt: skip
    if nondeterministic:
        print(f"NOT DETERMINISTIC: two plain runs differ in {len(nondeterministic)} tensors, e.g. "
              f"{nondeterministic[:3]}; the comparison below means nothing")  # fmt: skip
        return 1
    if mismatched:
        print(f"FAIL: sleep/wake before every phase changed {len(mismatched)} tensors, e.g. {mismatched[:3]}")
        return 1
    if step_mismatched:
        print(f"FAIL: AdamW on the DTensors differs from AdamW on their local shards in {len(step_mismatched)} "
              f"tensors, e.g. {step_mismatched[:3]}")  # fmt: skip
        return 1
    print(f"PASS: {args.phases} phases with sleep/wake before each, and with AdamW on the DTensors, equal "
          "the plain run bit for bit")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
