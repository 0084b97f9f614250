"""Attention kernels a family must not run: switched off process-wide, as torch's SDPA dispatch reads them."""

from __future__ import annotations

from collections.abc import Iterable

import torch

SWITCHES = {
    "cudnn": torch.backends.cuda.enable_cudnn_sdp,
    "flash": torch.backends.cuda.enable_flash_sdp,
    "efficient": torch.backends.cuda.enable_mem_efficient_sdp,
}


def exclude_attention_kernels(kernels: Iterable[str]) -> tuple[str, ...]:
    """Switch `kernels` off for this process's scaled-dot-product attention; the kernels switched off.
    ValueError for a name torch has no switch for (an adapter's `excluded_attention_kernels`)."""
    kernels = tuple(kernels)
    unknown = [k for k in kernels if k not in SWITCHES]
    if unknown:
        raise ValueError(f"excluded_attention_kernels {list(kernels)}: unknown kernel(s) {unknown}; "
                         f"allowed: {sorted(SWITCHES)}")  # fmt: skip
    for kernel in kernels:
        SWITCHES[kernel](False)
    return kernels
