"""Named LoRA adapters with PEFT: inject, load, copy, switch, recognise and merge them.

Everything verl_dmd does with LoRA goes through this module: the role engine adds one
adapter per LoRA role before sharding and switches between them; checkpoints and
export recognise an adapter's parameters by name (`adapter_of`); export merges the
student's adapter into its base (`merge_and_unload`).

PEFT's own `set_adapter` / `enable_adapters` also set `requires_grad` on adapter
weights, and on gathered FSDP2 copies those flags are lost at the next reshard
(TRAPS), so `switch_adapter` writes only the two attributes PEFT's layers read in
forward; the role engine alone owns `requires_grad`.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from verl_dmd.plan import LoraSpec

LORA_CONTAINERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
"""Submodule / parameter-dict names under which PEFT keeps an adapter's weights (``<container>.<adapter>``):
linear and convolution factors, embedding factors, DoRA magnitudes."""


def adapter_of(param_name: str) -> str | None:
    """The LoRA adapter a parameter belongs to (``...lora_A.<adapter>.weight``, ``...lora_embedding_A.<adapter>``),
    else None."""
    parts = param_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in LORA_CONTAINERS:
            return parts[i + 1]
    return None


def lora_config(spec: LoraSpec, default_targets: Sequence[str]):
    """PEFT's `LoraConfig` for a plan's LoRA spec (alpha defaults to the rank: scale 1)."""
    from peft import LoraConfig

    return LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha if spec.alpha is not None else spec.rank,
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules or default_targets),
        init_lora_weights=True,
    )


def add_adapter(model: nn.Module, config, name: str) -> None:
    """Inject a named LoRA adapter with PEFT itself, so any nn.Module works (not only diffusers models
    with the PEFT mixin). The role engine adds every adapter before sharding (TRAPS)."""
    from peft import inject_adapter_in_model

    with warnings.catch_warnings():
        # PEFT warns that a second adapter joins an existing peft_config: that is the point here.
        warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
        inject_adapter_in_model(config, model, adapter_name=name)


def rename_adapter(param_name: str, source: str, target: str) -> str:
    """The name of the parameter of adapter `target` that corresponds to `param_name` of adapter `source`
    (the segment after the LoRA container is the adapter's name, wherever it stands)."""
    parts = param_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in LORA_CONTAINERS and parts[i + 1] == source:
            return ".".join([*parts[: i + 1], target, *parts[i + 2 :]])
    raise ValueError(f"{param_name} is not a parameter of LoRA adapter {source!r}")


def copy_adapter(model: nn.Module, source: str, target: str) -> None:
    """Copy adapter `source`'s weights into adapter `target` (same targets and shapes)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            if adapter_of(name) == source:
                params[rename_adapter(name, source, target)].copy_(param)


def load_peft_adapter_dir(model: nn.Module, path: str, adapter_name: str, spec: LoraSpec, key: str) -> None:
    """Load a saved PEFT adapter directory into `adapter_name` (before sharding).

    Rank and alpha must match the plan's, since the plan defines the shapes and
    the scale; a mismatch is a one-line error naming the key.
    """
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    directory = Path(path)
    config_file, weights_file = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise ValueError(
                f"config key '{key}.init_path' = {path!r}: {needed.name} not found; "
                "fix: point it at a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)"
            )
    saved = json.loads(config_file.read_text())
    want_alpha = spec.alpha if spec.alpha is not None else float(spec.rank)
    if saved.get("r") != spec.rank or float(saved.get("lora_alpha", -1)) != float(want_alpha):
        raise ValueError(
            f"config key '{key}.init_path' = {path!r}: the adapter has rank {saved.get('r')} and alpha "
            f"{saved.get('lora_alpha')} but {key}.rank = {spec.rank} and alpha = {want_alpha}; "
            "fix: set the plan's rank and alpha to the adapter's"
        )
    state = load_file(str(weights_file))
    # PeftModel.save_pretrained (and verl-dmd-export) prefix keys with its wrappers' names.
    prefix = "base_model.model."
    state = {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in state.items()}
    result = set_peft_model_state_dict(model, state, adapter_name=adapter_name)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise ValueError(
            f"config key '{key}.init_path' = {path!r}: {len(unexpected)} adapter weights match no module "
            f"(first: {unexpected[0]}); fix: use an adapter trained for this model and target_modules"
        )


def tuner_layers(model: nn.Module) -> list[nn.Module]:
    """Every PEFT layer of `model` (the modules `switch_adapter` points at an adapter)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def switch_adapter(layers: Sequence[nn.Module], adapter: str, *, enabled: bool = True) -> None:
    """Point every LoRA layer at `adapter`, or (``enabled=False``) turn adapters off (the base alone),
    touching no parameter.

    The two attributes PEFT's layers read in forward are written to the instance dict, what
    nn.Module.__setattr__ does for them after its checks (a few us per write otherwise, for each of an
    SD3-sized model's LoRA layers at every switch). Both are always written, so the layers' state (which
    torch.compile guards on) is a function of the arguments alone.
    """
    for module in layers:
        state = module.__dict__
        state["_disable_adapters"] = not enabled
        state["_active_adapter"] = [adapter]  # a list per layer, as set_adapter leaves it


def merge_and_unload(model: nn.Module, adapter_name: str) -> None:
    """Fold the adapter into its base layers (PEFT's own merge) and put the base layers back."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    tuners = [(name, module) for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)]
    for name, module in tuners:
        module.merge(safe_merge=True, adapter_names=[adapter_name])
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, module.get_base_layer())
    if hasattr(model, "peft_config"):
        del model.peft_config
