"""Model FLOPs of a phase, counted once per call shape, and the rates they are set against.

`PhaseFlops` watches the forward calls of an engine's models during a phase (a forward hook that
records shapes, never touches a tensor's values) and prices each distinct call once: a copy of the
model on the meta device, built from its config, with the role's LoRA adapter when the role has one,
runs the same call under torch's `FlopCounterMode` (the forward, and the backward when the live
call's output required grad, with the same parameters and inputs requiring grad). Meta tensors
hold no data, so pricing costs no device memory and leaves the live model, its compiled graphs and
every random stream untouched: a run with the counter is bit for bit a run without it.

What is counted is the model's arithmetic as written (matmuls, convolutions, attention: the ops
`FlopCounterMode` knows), once per call: activation checkpointing's recomputed forwards and the
optimizer are not counted, as MFU conventionally does not. Calls of modules outside a model's own
forward (a method's extra modules, e.g. DMD2's GAN head) are not counted either.

`measure_matmul_rate` and `datasheet_rate` give the two denominators of MFU: the bf16 matmul rate the
device sustains, measured, and the dense bf16 peak of its datasheet.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from verl_dmd.phases import Role

# Dense bf16 tensor-core peaks from the vendors' datasheets (no sparsity), by a name part of
# torch.cuda.get_device_name, the first part that matches: 989.5 TFLOP/s is the H100 SXM's figure,
# which the H200 SXM shares (and what FastVideo divides by for both); the PCIe/NVL cards are lower;
# 312 is the A100's.
DATASHEET_BF16_FLOPS = {
    "H100 PCIe": 756e12, "H100 NVL": 835e12, "H200 NVL": 835e12,  # the PCIe cards, before the SXM names
    "H200": 989.5e12, "H100": 989.5e12, "A100": 312e12,
}  # fmt: skip


def datasheet_rate(device: torch.device | str) -> tuple[str, float] | None:
    """(name, dense bf16 FLOP/s) of a CUDA device from the table above; None for others."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for part, rate in DATASHEET_BF16_FLOPS.items():
        if part in name:
            return name, rate
    return None


def measure_matmul_rate(device: torch.device | str, seconds: float = 2.0, size: int = 8192) -> float | None:
    """The bf16 FLOP/s of size^3 matrix products run back to back for about `seconds` on a CUDA device
    (after a warm-up); None on other devices. Over seconds, a GPU at its power limit settles below the
    rate of its first products: the longer the probe, the closer to the sustained rate."""
    device = torch.device(device)
    if device.type != "cuda" or seconds <= 0:
        return None
    generator = torch.Generator(device).manual_seed(0)  # a private stream: the run's CUDA RNG is untouched
    try:
        a = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=generator)
        b = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=generator)
        for _ in range(3):
            torch.mm(a, b)
        torch.cuda.synchronize(device)
        count, started = 0, time.perf_counter()
        while True:
            for _ in range(10):
                torch.mm(a, b)
            torch.cuda.synchronize(device)
            count += 10
            elapsed = time.perf_counter() - started
            if elapsed >= seconds:
                break
    except torch.OutOfMemoryError:  # a nearly full device: no measured denominator
        return None
    finally:
        a = b = None
        torch.cuda.empty_cache()
    return 2.0 * size**3 * count / elapsed


def _tensor_signature(value: Any) -> Any:
    """What the price of a call depends on in one argument: a tensor's shape, dtype and grad flag, a
    plain scalar's value, or the same for each item of a tuple, list or dict (the type name for anything
    else, which prices as None)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), value.requires_grad)
    if isinstance(value, bool | int | float | str) or value is None:
        return ("value", value)
    if isinstance(value, tuple | list):  # the kind kept: models branch on isinstance(x, list)
        return ("list" if isinstance(value, list) else "tuple", tuple(_tensor_signature(v) for v in value))
    if isinstance(value, Mapping):
        return ("map", tuple((k, _tensor_signature(v)) for k, v in value.items()))
    return ("other", type(value).__name__)


def _meta_value(signature: Any) -> Any:
    """A meta tensor (or value) of a signature; floating tensors in float32, the meta copy's dtype (the
    count does not depend on it; the live call's inputs are in the compute dtype of mixed precision)."""
    kind = signature[0]
    if kind == "tensor":
        _, shape, dtype, requires_grad = signature
        dtype = getattr(torch, dtype.removeprefix("torch."))
        if dtype.is_floating_point:
            return torch.zeros(shape, dtype=torch.float32, device="meta").requires_grad_(requires_grad)
        return torch.zeros(shape, dtype=dtype, device="meta")
    if kind == "value":
        return signature[1]
    if kind in ("list", "tuple"):
        items = [_meta_value(v) for v in signature[1]]
        return items if kind == "list" else tuple(items)
    if kind == "map":
        return {k: _meta_value(v) for k, v in signature[1]}
    return None


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple | list):
        for item in output:
            found = _first_tensor(item)
            if found is not None:
                return found
    if hasattr(output, "to_tuple"):  # diffusers' BaseOutput
        return _first_tensor(output.to_tuple())
    return None


class PhaseFlops:
    """The model FLOPs of the calls made inside `recording()`; see the module docstring."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._calls: list[tuple] | None = None
        self._calls_done: list[tuple] = []
        self.unpriced: str | None = None
        """Why the last unpriced call could not be priced (None while every call could)."""
        self._prices: dict[tuple, int | None] = {}
        self._meta_models: dict[tuple, nn.Module | None] = {}
        self._handles = [
            model.register_forward_hook(self._hook(name), with_kwargs=True)
            for name, model in engine.models.items()
        ]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        self._calls = []
        try:
            yield
        finally:
            self._calls_done, self._calls = self._calls, None

    def _hook(self, model_name: str):
        def hook(module, args, kwargs, output):
            if self._calls is None:
                return None
            engine = self.engine
            active = engine.active_role
            out = _first_tensor(output)
            self._calls.append((
                model_name,
                active.value if active is not None else None,
                active is not None and active is engine.trainable_role and torch.is_grad_enabled(),
                bool(out is not None and out.requires_grad),
                _tensor_signature(tuple(args)),
                _tensor_signature(dict(kwargs)),
            ))  # fmt: skip
            return None

        return hook

    def phase_flops(self) -> int | None:
        """The FLOPs of the calls of the last `recording()`; None when any of them cannot be priced or the
        counter is closed."""
        if not self._handles:
            return None
        total = 0
        for call in self._calls_done:
            if call not in self._prices:
                self._prices[call] = self._price(call)
            price = self._prices[call]
            if price is None:
                return None
            total += price
        return total

    # ------------------------------------------------------------------ pricing on the meta device

    def _lora(self, role_name: str | None):
        """(adapter name, LoraSpec) of the role's LoRA adapter, or None (the teacher, a full-weight role)."""
        if role_name is None or Role(role_name) is Role.TEACHER:
            return None
        role = Role(role_name)
        selection = self.engine.layout.role_tensors(role)
        if selection.adapter is None:
            return None
        owner = Role.STUDENT if role is Role.STUDENT_EMA else role
        return selection.adapter, getattr(self.engine.plan.model, owner.value).lora

    def _meta_model(self, model_name: str, lora) -> nn.Module | None:
        key = (model_name, None if lora is None else lora[1])
        if key not in self._meta_models:
            self._meta_models[key] = self._build_meta(model_name, lora)
        return self._meta_models[key]

    def _build_meta(self, model_name: str, lora) -> nn.Module | None:
        adapter = self.engine.adapter
        live = self.engine.models[model_name]
        model_class = getattr(adapter, "model_class", None)
        config = getattr(live, "config", None)
        if model_class is None or config is None or not hasattr(model_class, "from_config"):
            self.unpriced = (
                f"adapter {adapter.name!r} has no model_class with from_config to build a meta copy from"
            )
            return None
        with torch.device("meta"):
            model = model_class.from_config(config).float()
            if lora is not None:
                from verl_dmd.runtime import lora as lora_tools

                lora_tools.add_adapter(
                    model, lora_tools.lora_config(lora[1], adapter.default_lora_targets), "counted"
                )
        model.requires_grad_(False)
        return model

    def _price(self, call: tuple) -> int | None:
        """The call's FLOPs, or None (the reason in `unpriced`): a model that cannot be built or run on the
        meta device costs the figure, never the phase. Counted outside any dispatch mode the caller runs
        (a profiler's or a FlopCounterMode around the phase sees none of the meta ops)."""
        from torch.utils._python_dispatch import _disable_current_modes
        from torch.utils.flop_counter import FlopCounterMode

        model_name, role_name, trainable, backward, args, kwargs = call
        try:
            with _disable_current_modes():
                lora = self._lora(role_name)
                model = self._meta_model(model_name, lora)
                if model is None:
                    return None
                for name, param in model.named_parameters():
                    is_lora = "lora_" in name
                    param.requires_grad_(trainable and (is_lora if lora is not None else True))
                counter = FlopCounterMode(display=False)
                try:
                    with counter:
                        output = _first_tensor(model(*_meta_value(args), **_meta_value(kwargs)))
                        if backward and output is not None and output.requires_grad:
                            output.sum().backward()
                finally:
                    model.zero_grad(set_to_none=True)
        except (
            Exception
        ) as err:  # a model whose forward needs values (not shapes): no figure, training goes on
            self.unpriced = f"{model_name} cannot be priced on the meta device ({type(err).__name__}: {err})"
            return None
        return int(counter.get_total_flops())
