"""Attention kernels a family must not run on CUDA (adapter.excluded_attention_kernels): the switch and the
declarations. Flux excludes cuDNN's kernel (its backward gave wrong gradients on an H200: docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch

from verl_dmd.adapters import available_adapters, get_adapter, register_adapter
from verl_dmd.runtime.attention import (
    SWITCHES,
    attention_kernel_state,
    exclude_attention_kernels,
    restore_attention_kernels,
    switch_off_for,
)


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


def test_a_rank_switches_off_on_cuda_only_and_gives_the_switches_back(restore_switches):
    """What RankSession does: nothing on CPU; on CUDA the kernels off, and close() restores the state before."""
    assert switch_off_for(("cudnn",), "cpu") == (None, ())
    assert torch.backends.cuda.cudnn_sdp_enabled()
    before, off = switch_off_for(("cudnn",), "cuda:0")  # the switches are flags: no GPU needed to set them
    assert off == ("cudnn",) and before == {"cudnn": True}
    assert attention_kernel_state() == {"cudnn": False, "flash": True, "efficient": True}
    torch.backends.cuda.enable_flash_sdp(False)  # someone else's switch, changed during the session
    restore_attention_kernels(before)
    assert attention_kernel_state() == {"cudnn": True, "flash": False, "efficient": True}


def test_a_session_that_fails_to_build_gives_the_switches_back(restore_switches, monkeypatch):
    from runtime_scenarios import make_plan

    from verl_dmd.workers.session import RankSession

    flux = get_adapter("flux")

    def fail(self, *args, **kwargs):
        raise MemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(flux, "build_distribution_matching_computer", fail)
    with pytest.raises(MemoryError, match="simulated"):
        RankSession(make_plan("flux", "shared_base_adapters"), rank=0, world_size=1, device="cuda:0")
    assert attention_kernel_state() == {"cudnn": True, "flash": True, "efficient": True}


def test_registering_an_adapter_with_an_unknown_kernel_fails_in_one_line():
    base = get_adapter("dit")
    with pytest.raises(TypeError, match=r"@register_adapter\('bad_kernels'\): excluded_attention_kernels = "
                                        r"\('flash3',\); allowed: a tuple of cudnn, efficient, flash"):  # fmt: skip
        register_adapter("bad_kernels")(
            type("BadKernels", (base,), {"excluded_attention_kernels": ("flash3",)})
        )
    with pytest.raises(TypeError, match="excluded_attention_kernels = 'cudnn'"):  # a string, not a tuple
        register_adapter("bad_kernels")(type("BadKernels", (base,), {"excluded_attention_kernels": "cudnn"}))
    assert "bad_kernels" not in available_adapters()
