"""LR schedules (pure) and the model-adapter registry."""

from __future__ import annotations

import math

import pytest
import torch

from verl_dmd.adapters import (
    DistributionMatchingModelAdapter,
    available_adapters,
    get_adapter,
    register_adapter,
)
from verl_dmd.plan import OptimSpec, SchedulerSpec
from verl_dmd.runtime.optim import build_adamw, build_scheduler, lr_multiplier


def test_constant_schedule():
    """constant: the peak lr at every step."""
    assert [lr_multiplier(SchedulerSpec(), s) for s in range(3)] == [1.0, 1.0, 1.0]


def test_warmup_constant_schedule():
    """warmup_constant: linear from 1/W to 1 over W steps, then flat."""
    spec = SchedulerSpec(name="warmup_constant", warmup_steps=4)
    assert [lr_multiplier(spec, s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_warmup_cosine_schedule_against_formula():
    """warmup_cosine: warmup, then half a cosine from 1 to min_lr_ratio over decay_steps, then flat."""
    spec = SchedulerSpec(name="warmup_cosine", warmup_steps=2, decay_steps=10, min_lr_ratio=0.1)
    assert lr_multiplier(spec, 0) == 0.5 and lr_multiplier(spec, 1) == 1.0
    for step in range(2, 15):
        progress = min(1.0, (step - 2) / 10)
        want = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        assert abs(lr_multiplier(spec, step) - want) < 1e-15
    assert lr_multiplier(spec, 12) == pytest.approx(0.1) and lr_multiplier(spec, 100) == pytest.approx(0.1)


def test_scheduler_drives_the_optimizer_lr():
    """The LambdaLR built from the plan sets the optimizer's lr step by step."""
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = build_adamw([param], OptimSpec(lr=1e-3))
    scheduler = build_scheduler(optimizer, SchedulerSpec(name="warmup_constant", warmup_steps=2))
    lrs = []
    for _ in range(3):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3])


def test_optimizer_needs_parameters():
    """An empty parameter list is an error, not a silent no-op optimizer."""
    with pytest.raises(ValueError, match="at least one parameter"):
        build_adamw([], OptimSpec())


def test_builtin_adapters_are_registered():
    """SD3, Flux and Wan adapters ship with the package."""
    assert {"sd3", "flux", "qwen_image", "wan", "dit"} <= set(available_adapters())


def test_unknown_adapter_lists_the_registered_ones():
    """An unknown name is a one-line error naming the key and the registered adapters."""
    with pytest.raises(ValueError) as info:
        get_adapter("sdxl-turbo")
    message = str(info.value)
    assert "config key 'model.adapter' = 'sdxl-turbo'" in message and "sd3" in message and "\n" not in message


def test_register_adapter_decorator_and_duplicates():
    """Third-party adapters register by decorator; a second class under a taken name is refused."""

    @register_adapter("test_only_family")
    class Family(DistributionMatchingModelAdapter):
        pass

    assert get_adapter("test_only_family") is Family and Family.name == "test_only_family"
    with pytest.raises(ValueError, match="registered twice"):

        @register_adapter("test_only_family")
        class Other(DistributionMatchingModelAdapter):
            pass

    with pytest.raises(TypeError):
        register_adapter("not_an_adapter")(object)
