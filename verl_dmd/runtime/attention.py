"""Attention kernels a family must not run: switched off process-wide, as torch's SDPA dispatch reads them,
and switched back when the rank's session closes (a process that goes on, as the local backend's driver)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from verl_dmd.adapters.base import ATTENTION_KERNELS

SWITCHES = {
    "cudnn": torch.backends.cuda.enable_cudnn_sdp,
    "flash": torch.backends.cuda.enable_flash_sdp,
    "efficient": torch.backends.cuda.enable_mem_efficient_sdp,
}
assert sorted(SWITCHES) == sorted(ATTENTION_KERNELS), (
    "verl_dmd.adapters.base.ATTENTION_KERNELS names the switches"
)

ENABLED = {
    "cudnn": torch.backends.cuda.cudnn_sdp_enabled,
    "flash": torch.backends.cuda.flash_sdp_enabled,
    "efficient": torch.backends.cuda.mem_efficient_sdp_enabled,
}


def check_kernel_names(kernels: Iterable[str], owner: str) -> None:
    """ValueError naming `owner` for a kernel name torch has no switch for."""
    kernels = tuple(kernels)
    unknown = [k for k in kernels if k not in SWITCHES]
    if unknown:
        raise ValueError(f"{owner}.excluded_attention_kernels {list(kernels)}: unknown kernel(s) {unknown}; "
                         f"allowed: {sorted(SWITCHES)}")  # fmt: skip


def attention_kernel_state() -> dict[str, bool]:
    """Which of the switchable kernels are on now."""
    return {kernel: bool(enabled()) for kernel, enabled in ENABLED.items()}


def restore_attention_kernels(state: dict[str, bool]) -> None:
    """Set the switches back to `state` (from `attention_kernel_state`)."""
    for kernel, on in state.items():
        SWITCHES[kernel](on)


def exclude_attention_kernels(kernels: Iterable[str]) -> tuple[str, ...]:
    """Switch `kernels` off for this process's scaled-dot-product attention; the kernels switched off.
    ValueError for a name torch has no switch for (an adapter's `excluded_attention_kernels`)."""
    kernels = tuple(kernels)
    check_kernel_names(kernels, "adapter")
    for kernel in kernels:
        SWITCHES[kernel](False)
    return kernels


def switch_off_for(
    kernels: Iterable[str], device: torch.device | str
) -> tuple[dict[str, bool] | None, tuple[str, ...]]:
    """A rank's exclusions: on CUDA, the excluded kernels' switches as they were and the kernels now off
    (restoring the first touches those switches only); elsewhere (None, ())."""
    if torch.device(device).type != "cuda":
        return None, ()
    kernels = tuple(kernels)
    check_kernel_names(kernels, "adapter")
    before = {kernel: on for kernel, on in attention_kernel_state().items() if kernel in kernels}
    return before, exclude_attention_kernels(kernels)
