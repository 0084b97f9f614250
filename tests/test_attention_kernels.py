"""Attention kernels a family must not run on CUDA (adapter.excluded_attention_kernels): the switch and the
declarations. Flux excludes cuDNN's kernel (its backward gave wrong gradients on an H200: docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch

from verl_dmd.adapters import available_adapters, get_adapter
from verl_dmd.runtime.attention import SWITCHES, exclude_attention_kernels


@pytest.fixture
def restore_switches():
    before = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
              torch.backends.cuda.mem_efficient_sdp_enabled())  # fmt: skip
    yield
    for switch, value in zip(SWITCHES.values(), before, strict=True):
        switch(value)


def test_the_excluded_kernels_are_switched_off_and_the_others_left(restore_switches):
    assert exclude_attention_kernels(("cudnn",)) == ("cudnn",)
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert exclude_attention_kernels(()) == ()


def test_an_unknown_kernel_is_refused_in_one_line(restore_switches):
    with pytest.raises(
        ValueError, match=r"unknown kernel\(s\) \['flash3'\]; allowed: \['cudnn', 'efficient', 'flash'\]"
    ):
        exclude_attention_kernels(("cudnn", "flash3"))
    assert torch.backends.cuda.cudnn_sdp_enabled()  # nothing switched before the refusal


def test_every_adapter_declares_known_kernels_and_flux_excludes_cudnn():
    for name in available_adapters():
        assert set(get_adapter(name).excluded_attention_kernels) <= set(SWITCHES), name
    assert get_adapter("flux").excluded_attention_kernels == ("cudnn",)
    for name in ("sd3", "qwen_image", "wan", "dit"):
        assert get_adapter(name).excluded_attention_kernels == (), name
