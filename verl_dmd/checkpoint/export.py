"""Export one role of a checkpoint for inference: a PEFT adapter, a merged diffusers model, a pipeline.

Runs in one process without a process group and without FSDP: the role's
tensors are read from the checkpoint's DCP files as full (unsharded) tensors,
whatever the world size that wrote them, and put into the model the adapter
builds from the plan's model source (the frozen base is not in the checkpoint;
it comes from ``model.teacher`` again, as it does on resume). Layout of
``<export dir>/global_step_<N>/<role>/``:

- ``peft/``: ``adapter_config.json`` and ``adapter_model.safetensors`` in PEFT's
  own layout (``PeftModel.from_pretrained``), plus ``pytorch_lora_weights.safetensors``
  in diffusers' layout with its adapter metadata (``pipe.load_lora_weights(dir)``,
  ``transformer.load_lora_adapter``);
- ``diffusers/``: the merged model through ``save_pretrained`` (safetensors);
- ``pipeline/``: a copy of ``export.pipeline_source`` (files hard-linked where
  possible) with the merged model as its transformer and a ``dmd2_config`` block in
  ``model_index.json`` (the sampling schedule the student was trained for);
- ``export.json``: where it came from (checkpoint, step, plan fingerprint, role)
  and the SHA-256 of every file written.

Every tensor is checked for completeness (exactly the role's parameters, no more,
no fewer) and finiteness before anything is written; the directory appears
atomically (written under a temporary name, then renamed).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from verl_dmd.checkpoint.composite import ENGINE_DIR, check_plan
from verl_dmd.checkpoint.store import CheckpointStore
from verl_dmd.phases import Role

PEFT_DIR, DIFFUSERS_DIR, PIPELINE_DIR = "peft", "diffusers", "pipeline"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
DIFFUSERS_LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
EXPORT_INFO = "export.json"
PEFT_PREFIX = "base_model.model."
"""Key prefix of PeftModel.save_pretrained's files (a PeftModel wraps the model twice)."""
_LORA_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector.")


class ExportError(ValueError):
    """A checkpoint or setting that cannot be exported; the message is one line."""


def export_root(plan) -> Path:
    """Where exports of this run go: export.output_dir, else <trainer.output_dir>/export."""
    return Path(plan.export.output_dir or Path(plan.trainer.output_dir) / "export")


def dmd2_config(plan) -> dict[str, Any]:
    """How to sample the exported student: its step count, timesteps (sigma x 1000), solver, guidance.

    The student re-noises its x0 prediction with fresh noise between steps (``sde``);
    the teacher's guidance is distilled into it, so it samples without CFG (scale 1).
    """
    from verl_dmd.losses import student_sigma_schedule

    algorithm = plan.algorithm
    schedule = student_sigma_schedule(
        algorithm.student_steps, shift=algorithm.sigma_shift, sigmas=algorithm.student_sigmas
    )
    return {
        "num_inference_steps": algorithm.student_steps,
        "denoising_timesteps": [round(float(s) * 1000.0, 4) for s in schedule[:-1]],
        "solver": "sde",
        "guidance_scale": 1.0,
    }


# --------------------------------------------------------------------------- reading the role


def _canonical(name: str) -> str:
    from verl_dmd.runtime.engine import canonical_name

    return canonical_name(name)


def _role_selection(plan, role: Role) -> tuple[str, str | None]:
    """(DCP key prefix, LoRA adapter name or None for full weights) of `role`'s tensors."""
    if plan.model.storage == "shared_base_adapters":
        return "param/base.", role.value
    lora = plan.model.student.lora.enabled
    prefix = "ema/student." if role is Role.STUDENT_EMA else "param/student."
    return prefix, (Role.STUDENT.value if lora else None)


def read_role_tensors(engine_dir: Path, plan, role: Role) -> tuple[str | None, dict[str, torch.Tensor]]:
    """The role's full tensors by parameter name, read from DCP without a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from verl_dmd.runtime.engine import _adapter_of

    prefix, adapter_name = _role_selection(plan, role)
    reader = dcp.FileSystemReader(str(engine_dir))
    metadata = reader.read_metadata().state_dict_metadata
    template: dict[str, torch.Tensor] = {}
    for key, meta in metadata.items():
        if not key.startswith(prefix) or not isinstance(meta, TensorStorageMetadata):
            continue
        name = key[len(prefix) :]
        if adapter_name is not None and _adapter_of(name) != adapter_name:
            continue
        template[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not template:
        raise ExportError(
            f"{engine_dir}: no tensors of role {role.value} (keys {prefix}*"
            f"{'' if adapter_name is None else f' of adapter {adapter_name}'}); fix: export a checkpoint "
            "written by this plan's layout"
        )
    with warnings.catch_warnings():  # one process on purpose, whatever the world size that saved it
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(template, storage_reader=reader, no_dist=True)
    return adapter_name, {_canonical(key[len(prefix) :]): tensor for key, tensor in template.items()}


def build_role_model(plan, adapter) -> nn.Module:
    """The model the role's tensors go into, built as the engine builds it (same seed, same order)."""
    from verl_dmd.adapters.base import ModelSource

    torch.manual_seed(plan.trainer.seed)  # config-built (random) bases must match the engine's
    model = adapter.build_model(ModelSource.of(plan.model.teacher))
    if plan.model.storage == "independent":
        source = ModelSource.of(plan.model.student)
        if not source.is_empty:
            model = adapter.build_model(source)
    return model


def _load_exactly(
    model: nn.Module, tensors: dict[str, torch.Tensor], adapter_name: str | None, where
) -> None:
    from verl_dmd.runtime.engine import _adapter_of

    expected = {
        name
        for name, _ in model.named_parameters()
        if adapter_name is None or _adapter_of(name) == adapter_name
    }
    missing, unexpected = sorted(expected - tensors.keys()), sorted(tensors.keys() - expected)
    if missing or unexpected:
        first = f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}"
        raise ExportError(
            f"{where}: the checkpoint's tensors do not match the model built from the plan "
            f"({len(missing)} missing, {len(unexpected)} unexpected; {first}); fix: export with the plan "
            "that trained the checkpoint"
        )
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in tensors.items():
            if params[name].shape != tensor.shape:
                raise ExportError(
                    f"{where}: {name} has shape {tuple(tensor.shape)} in the checkpoint but "
                    f"{tuple(params[name].shape)} in the model built from the plan; fix: export with the "
                    "plan that trained the checkpoint"
                )
            params[name].copy_(tensor)


def check_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    """Fail, naming the first tensor, if any exported value is NaN or infinite."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise ExportError(
                f"{where}: tensor {name} has {bad} non-finite values; nothing was exported; fix: export an "
                "earlier checkpoint (checkpoint.resume=<path>)"
            )


# --------------------------------------------------------------------------- writing


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _json_ready(config: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in config.items():
        if isinstance(value, set):
            value = sorted(value)
        elif hasattr(value, "value") and type(value).__module__.startswith("peft"):
            value = value.value  # enums such as PeftType
        out[key] = value
    return out


def _write_peft(
    model: nn.Module, adapter_name: str, component: str, base_path: str | None, out: Path
) -> None:
    from diffusers.loaders.lora_base import LoraBaseMixin
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    state = {
        k: v.detach().contiguous()
        for k, v in get_peft_model_state_dict(model, adapter_name=adapter_name).items()
    }
    config = _json_ready(model.peft_config[adapter_name].to_dict())
    config["base_model_name_or_path"] = base_path
    out.mkdir(parents=True)
    save_file(
        {PEFT_PREFIX + k: v for k, v in state.items()}, str(out / PEFT_WEIGHTS), metadata={"format": "pt"}
    )
    (out / PEFT_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    LoraBaseMixin.write_lora_layers(
        state_dict={f"{component}.{k}": v for k, v in state.items()},
        save_directory=str(out),
        is_main_process=True,
        weight_name=DIFFUSERS_LORA_WEIGHTS,
        save_function=None,
        safe_serialization=True,
        lora_adapter_metadata={f"{component}.{k}": v for k, v in config.items()},
    )


def _merge_and_unload(model: nn.Module, adapter_name: str) -> None:
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


def _link_or_copy_tree(source: Path, target: Path, skip: str) -> None:
    """Copy a pipeline directory, hard-linking files where the file system allows; skip one component."""
    for entry in sorted(source.iterdir()):
        if entry.name in (skip, "model_index.json"):
            continue
        destination = target / entry.name
        if entry.is_dir():
            shutil.copytree(entry, destination, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(entry), str(destination))


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def _pipeline_source(plan, component: str) -> tuple[Path, dict[str, Any]]:
    source = Path(plan.export.pipeline_source)
    index_file = source / "model_index.json"
    if not index_file.is_file():
        raise ExportError(
            f"config key 'export.pipeline_source' = {str(source)!r}: no model_index.json there; fix: point it "
            "at a local diffusers pipeline directory (the teacher's)"
        )
    index = json.loads(index_file.read_text())
    if component not in index:
        raise ExportError(
            f"config key 'export.pipeline_source' = {str(source)!r}: its model_index.json has no "
            f"{component!r} component; fix: use the pipeline this model family belongs to"
        )
    return source, index


def export_checkpoint(
    plan,
    checkpoint: str | Path,
    *,
    role: str | Role | None = None,
    formats: tuple[str, ...] | None = None,
    output_dir: str | Path | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Export `role` (default export.role) of `checkpoint` in `formats` (default export.formats).

    The checkpoint is verified (sizes and SHA-256) and its plan compared with
    `plan` before anything is read. Returns the written directory.
    """
    from verl_dmd.adapters import get_adapter

    role = Role(role or plan.export.role)
    formats = tuple(formats or plan.export.formats)
    if role not in (Role.STUDENT, Role.STUDENT_EMA):
        raise ExportError(f"config key 'export.role' = {role.value!r}: allowed: student, student_ema")
    if role is Role.STUDENT_EMA and not plan.ema.enabled:
        raise ExportError(
            "config key 'export.role' = 'student_ema': ema.enabled is false; fix: export.role=student"
        )
    lora = plan.model.student.lora.enabled
    if "peft" in formats and not lora:
        raise ExportError(
            f"config key 'export.formats' = {list(formats)}: the peft format needs a LoRA student; fix: export "
            "diffusers (and pipeline) only"
        )
    if "pipeline" in formats and not plan.export.pipeline_source:
        raise ExportError("config key 'export.pipeline_source' = None: the pipeline format needs it")

    started = time.monotonic()
    found = CheckpointStore.verify(checkpoint, hashes=True)
    check_plan(found, plan)
    adapter = get_adapter(plan.model.adapter)()
    component = getattr(adapter, "pipeline_component", "transformer")
    pipeline = _pipeline_source(plan, component) if "pipeline" in formats else None
    target = (
        Path(output_dir)
        if output_dir is not None
        else export_root(plan) / f"global_step_{found.global_step}" / role.value
    )
    if target.exists():
        raise ExportError(
            f"{target} already exists; fix: remove it, or set export.output_dir to another directory"
        )
    log(f"export: reading role {role.value} from {found.path}")
    adapter_name, tensors = read_role_tensors(found.path / ENGINE_DIR, plan, role)
    check_finite(tensors, f"{found.path} ({role.value})")
    model = build_role_model(plan, adapter)
    model_class, base_keys = type(model), set(model.state_dict())
    if adapter_name is not None:
        from verl_dmd.runtime.engine import _add_adapter, _lora_config

        _add_adapter(model, _lora_config(plan.model.student.lora, adapter.default_lora_targets), adapter_name)
    _load_exactly(model, tensors, adapter_name, f"{found.path} ({role.value})")
    model.eval()

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.partial-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    try:
        if "peft" in formats:
            base = plan.model.teacher.path
            if plan.model.storage == "independent" and plan.model.student.path:
                base = plan.model.student.path
            elif plan.model.storage == "independent" and plan.model.student.config is not None:
                base = None  # a config-built base: no directory to name
                log("export: note: the student's base was built from model.student.config, not the teacher; "
                    "load the adapter onto that model")  # fmt: skip
            _write_peft(model, adapter_name, component, base, staging / PEFT_DIR)
            log(f"export: wrote the PEFT adapter ({len(tensors)} tensors)")
        if "diffusers" in formats or "pipeline" in formats:
            if not hasattr(model, "save_pretrained"):
                raise ExportError(
                    f"config key 'export.formats' = {list(formats)}: {model_class.__name__} has no diffusers "
                    "save_pretrained; fix: export peft only"
                )
            if adapter_name is not None:
                _merge_and_unload(model, adapter_name)
            state = model.state_dict()
            if set(state) != base_keys:
                odd = sorted(set(state) ^ base_keys)
                raise ExportError(
                    f"merged {model_class.__name__} does not have its own parameter names ({odd[0]})"
                )
            check_finite(state, f"merged {role.value}")
            if "diffusers" in formats:
                model.save_pretrained(str(staging / DIFFUSERS_DIR), safe_serialization=True)
                log("export: wrote the merged diffusers model")
            if pipeline is not None:
                source, index = pipeline
                out = staging / PIPELINE_DIR
                out.mkdir()
                _link_or_copy_tree(source, out, skip=component)
                model.save_pretrained(str(out / component), safe_serialization=True)
                index["dmd2_config"] = dmd2_config(plan)
                (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
                log(f"export: wrote the pipeline from {source} with the student as {component}")
        files = {
            str(path.relative_to(staging)): _sha256(path)
            for path in sorted(staging.rglob("*"))
            if path.is_file()
        }
        info = {
            "checkpoint": str(found.path),
            "global_step": found.global_step,
            "plan_fingerprint": found.manifest["plan_fingerprint"],
            "manifest_sha256": found.manifest.get("manifest_sha256"),
            "role": role.value,
            "formats": list(formats),
            "model_adapter": plan.model.adapter,
            "dmd2_config": dmd2_config(plan),
            "files": files,
        }
        (staging / EXPORT_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(f"export: {target} ({', '.join(formats)}; {time.monotonic() - started:.1f} s)")
    return target
