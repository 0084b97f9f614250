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
- ``diffusers/``: the merged model through ``save_pretrained`` (safetensors), merged in float32 and
  written in ``export.dtype`` (bfloat16 by default);
- ``pipeline/``: a copy of ``export.pipeline_source`` (files hard-linked where
  possible) with the merged model as its transformer, a scheduler config that makes
  the family's diffusers call sample the trained schedule, and a ``dmd2_config``
  block in ``model_index.json`` (the sampling schedule the student was trained for);
- ``vllm_omni/``: the same directory (hard links to ``pipeline/``'s files) under
  vllm-omni's DMD2 class name, which reads the block (`verl_dmd.checkpoint.serving`);
- ``lora_pipeline/``, ``lora_vllm_omni/``: the teacher's pipeline with every file linked
  (its transformer too), the scheduler and the block as above: where ``peft/`` is served;
  the vllm-omni one only for adapters its LoRA loader places (`check_vllm_omni_lora`);
- ``export.json``: where it came from (checkpoint, step, plan fingerprint, role)
  and the SHA-256 of every file written.

Every tensor is checked for completeness (exactly the role's parameters, no more,
no fewer) and finiteness before anything is written; the directory appears
atomically (written under a temporary name, then renamed). Which keys hold the
role and which model they go into is the storage layout's answer
(`verl_dmd.runtime.layouts`), not re-derived here.

An export directory that exists already is refused (`if_exists="fail"`, the
default), or, for the trainer's export at the end of a run (`if_exists="reuse"`),
kept when it holds this very checkpoint's export (its `export.json` names the
checkpoint's manifest digest) and replaced otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from verl_dmd.checkpoint import serving
from verl_dmd.checkpoint.composite import ENGINE_DIR, check_plan
from verl_dmd.checkpoint.store import Checkpoint, CheckpointError, CheckpointStore, file_sha256
from verl_dmd.phases import Role
from verl_dmd.runtime import lora
from verl_dmd.runtime.layouts import StorageLayout, layout_for
from verl_dmd.runtime.naming import RoleTensors, canonical_name

PEFT_DIR, DIFFUSERS_DIR, PIPELINE_DIR, VLLM_OMNI_DIR = "peft", "diffusers", "pipeline", "vllm_omni"
LORA_PIPELINE_DIR, LORA_VLLM_OMNI_DIR = "lora_pipeline", "lora_vllm_omni"
MERGED_FORMATS = {"diffusers", "pipeline", "vllm_omni"}
LORA_SERVING_FORMATS = {"lora_pipeline", "lora_vllm_omni"}
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
DIFFUSERS_LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
EXPORT_INFO = "export.json"
MERGED_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
"""export.dtype -> the dtype the merged model's weights are written in."""
PEFT_PREFIX = "base_model.model."
"""Key prefix of PeftModel.save_pretrained's files (a PeftModel wraps the model twice)."""


class ExportError(ValueError):
    """A checkpoint or setting that cannot be exported; the message is one line."""


def export_root(plan) -> Path:
    """Where exports of this run go: export.output_dir, else <trainer.output_dir>/export."""
    return Path(plan.export.output_dir or Path(plan.trainer.output_dir) / "export")


def dmd2_config(plan, sigma_max: float = 1.0, guidance_scale: float = 1.0) -> dict[str, Any]:
    """How to sample the exported student: its step count, timesteps (sigma x 1000), solver, guidance.

    The student re-noises its x0 prediction with fresh noise between steps (``sde``);
    the teacher's guidance is distilled into it, so it samples without CFG (scale 1), except that a
    guidance-embedding student (Flux-dev) gets the embedding value it trained with.
    `sigma_max` is the model adapter's highest noise level (the schedule starts there).
    """
    from verl_dmd.algorithms.sampling import trained_schedule

    return serving.dmd2_block(trained_schedule(plan.algorithm, sigma_max).tolist(), guidance_scale)


# --------------------------------------------------------------------------- reading the role


def read_role_tensors(
    engine_dir: Path, selection: RoleTensors, expected: Mapping[str, str] | None = None
) -> dict[str, torch.Tensor]:
    """The tensors `selection` names, full size, by parameter name, read from DCP without a process group.

    Through `VerifiedReader`: nothing in the files runs as code, and each file read is checked against
    `expected` (file name in the DCP directory -> SHA-256) as it is read; CheckpointError names a
    damaged one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from verl_dmd.checkpoint.safe_io import VerifiedReader

    prefix, adapter_name = selection.prefix, selection.adapter
    reader = VerifiedReader(engine_dir, expected)
    metadata = reader.read_metadata().state_dict_metadata
    template: dict[str, torch.Tensor] = {}
    for key, meta in metadata.items():
        if not key.startswith(prefix) or not isinstance(meta, TensorStorageMetadata):
            continue
        name = key[len(prefix) :]
        if adapter_name is not None and lora.adapter_of(name) != adapter_name:
            continue
        template[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not template:
        raise ExportError(
            f"{engine_dir}: no tensors under {prefix}*"
            f"{'' if adapter_name is None else f' of adapter {adapter_name}'}; fix: export a checkpoint "
            "written by this plan's layout"
        )
    with warnings.catch_warnings():  # one process on purpose, whatever the world size that saved it
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(template, storage_reader=reader, no_dist=True)
        except CheckpointException as err:  # DCP's own error derives from BaseException
            failures = "; ".join(f"{type(e).__name__}: {e}" for e, _ in err.failures.values())
            raise CheckpointError(f"{engine_dir}: does not load ({failures.splitlines()[0]})") from None
    if reader.damaged:
        raise CheckpointError("; ".join(reader.damaged))
    return {canonical_name(key[len(prefix) :]): tensor for key, tensor in template.items()}


def _load_exactly(
    model: nn.Module, tensors: dict[str, torch.Tensor], adapter_name: str | None, where
) -> None:
    expected = {
        name
        for name, _ in model.named_parameters()
        if adapter_name is None or lora.adapter_of(name) == adapter_name
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


@dataclass
class LoadedRole:
    """A role read from a checkpoint into its model (LoRA adapter injected, not merged)."""

    model: nn.Module
    base_keys: set[str]
    """The state-dict keys of the bare model (what a merged model must have)."""
    selection: RoleTensors
    tensor_count: int


def load_role(layout: StorageLayout, found: Checkpoint, role: Role) -> LoadedRole:
    """The model holding `role`'s trained weights, built as the engine builds it and filled exactly."""
    where = f"{found.path} ({role.value})"
    selection = layout.role_tensors(role)
    prefix = f"{ENGINE_DIR}/"
    expected = {
        k[len(prefix) :]: v["sha256"] for k, v in found.manifest["files"].items() if k.startswith(prefix)
    }
    tensors = read_role_tensors(found.path / ENGINE_DIR, selection, expected)
    check_finite(tensors, where)
    layout.seed()  # a config-built base must draw what the engine drew
    model = layout.build_role_model(role)
    base_keys = set(model.state_dict())
    layout.add_role_adapter(model, role)
    _load_exactly(model, tensors, selection.adapter, where)
    model.eval()
    return LoadedRole(model, base_keys, selection, len(tensors))


# --------------------------------------------------------------------------- writing


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


def _merge(model: nn.Module, base_keys: set[str], adapter_name: str | None, formats, role: Role) -> None:
    """Fold the adapter (if any) into the model in place, and check the result is the bare model."""
    if not hasattr(model, "save_pretrained"):
        raise ExportError(
            f"config key 'export.formats' = {list(formats)}: {type(model).__name__} has no diffusers "
            "save_pretrained; fix: export peft only"
        )
    if adapter_name is not None:
        lora.merge_and_unload(model, adapter_name)
    state = model.state_dict()
    if set(state) != base_keys:
        odd = sorted(set(state) ^ base_keys)
        raise ExportError(f"merged {type(model).__name__} does not have its own parameter names ({odd[0]})")
    check_finite(state, f"merged {role.value}")


def _link_or_copy_tree(source: Path, target: Path, skip: str | None) -> None:
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


SCHEDULER_CONFIG = Path("scheduler") / "scheduler_config.json"


def _write_json(path: Path, value: dict[str, Any]) -> None:
    """A fresh file at `path` (a hard link to the teacher's file there is replaced, never written through)."""
    if path.exists():
        path.unlink()
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def _write_pipeline(model: nn.Module | None, pipeline: tuple[Path, dict[str, Any]], component: str, config,
                    shift: float, parameterization: str, out: Path) -> None:  # fmt: skip
    """The teacher's pipeline directory with the student as `component` (None: the teacher's own, linked: a
    LoRA is loaded on it), its scheduler set to the trained schedule's sampler and the `dmd2_config` block
    (nested and flat) in model_index.json."""
    source, index = pipeline
    out.mkdir()
    _link_or_copy_tree(source, out, skip=component if model is not None else None)
    if model is not None:
        model.save_pretrained(str(out / component), safe_serialization=True)
    if (source / SCHEDULER_CONFIG).is_file() and "scheduler" in index:
        scheduler = json.loads((source / SCHEDULER_CONFIG).read_text())
        _write_json(
            out / SCHEDULER_CONFIG, serving.diffusers_scheduler_config(scheduler, shift, parameterization)
        )
        index = {**index, "scheduler": [index["scheduler"][0], serving.SCHEDULER_CLASS]}
    _write_json(out / "model_index.json", serving.index_with_block(index, config))


def _write_vllm_omni(pipeline_dir: Path, out: Path) -> None:
    """`pipeline_dir` again (hard links) under vllm-omni's DMD2 class name for its pipeline class."""
    index = json.loads((pipeline_dir / "model_index.json").read_text())
    class_name = serving.vllm_omni_class(index["_class_name"])
    shutil.copytree(pipeline_dir, out, copy_function=_link_or_copy)
    _write_json(out / "model_index.json", {**index, "_class_name": class_name})


def _check_request(plan, role: Role, formats: tuple[str, ...]) -> None:
    unknown = sorted(set(formats) - MERGED_FORMATS - LORA_SERVING_FORMATS - {"peft"})
    if unknown:
        raise ExportError(f"config key 'export.formats' lists {unknown[0]!r}: allowed: peft, diffusers, pipeline, "
                          "vllm_omni, lora_pipeline, lora_vllm_omni")  # fmt: skip
    if role not in (Role.STUDENT, Role.STUDENT_EMA):
        raise ExportError(f"config key 'export.role' = {role.value!r}: allowed: student, student_ema")
    if role is Role.STUDENT_EMA and not plan.ema.enabled:
        raise ExportError(
            "config key 'export.role' = 'student_ema': ema.enabled is false; fix: export.role=student"
        )
    for lora_format in ("peft", *sorted(LORA_SERVING_FORMATS & set(formats))):
        if lora_format in formats and not plan.model.student.lora.enabled:
            raise ExportError(
                f"config key 'export.formats' = {list(formats)}: the {lora_format} format needs a LoRA student; "
                "fix: export diffusers (and pipeline) only"
            )
    if LORA_SERVING_FORMATS & set(formats) and "peft" not in formats:
        raise ExportError(f"config key 'export.formats' = {list(formats)}: a lora_* directory serves the adapter "
                          "of the peft format beside it; fix: list peft too")  # fmt: skip
    for needs in ("pipeline", "vllm_omni", *sorted(LORA_SERVING_FORMATS)):
        if needs in formats and not plan.export.pipeline_source:
            raise ExportError(f"config key 'export.pipeline_source' = None: the {needs} format needs it")


def _existing_export(
    target: Path,
    found: Checkpoint,
    formats,
    if_exists: str,
    log: Callable[[str], None],
    dtype: str = "bfloat16",
) -> bool:
    """True when `target` already holds this checkpoint's export in these formats (reuse); clears or refuses
    it otherwise."""
    if not target.exists():
        return False
    if if_exists == "fail":
        raise ExportError(
            f"{target} already exists; fix: remove it, or set export.output_dir to another directory"
        )
    info_file = target / EXPORT_INFO
    try:
        info = json.loads(info_file.read_text()) if info_file.is_file() else {}
    except (OSError, ValueError):
        info = {}
    same_checkpoint = info.get("manifest_sha256") == found.manifest.get("manifest_sha256")
    merged = bool(MERGED_FORMATS & set(formats))  # an export.json from before export.dtype: float32
    same_dtype = info.get("merged_dtype", "float32" if merged else None) == (dtype if merged else None)
    if same_checkpoint and info.get("formats") == list(formats) and same_dtype:
        log(f"export: {target} holds this checkpoint's export already")
        return True
    what = (
        "other formats or another dtype"
        if same_checkpoint
        else f"another run's export (checkpoint {info.get('checkpoint')})"
    )
    log(f"export: {target} holds {what} of this step; replacing it")
    shutil.rmtree(target)
    return False


def export_checkpoint(
    plan,
    checkpoint: str | Path,
    *,
    role: str | Role | None = None,
    formats: tuple[str, ...] | None = None,
    output_dir: str | Path | None = None,
    if_exists: Literal["fail", "reuse"] = "fail",
    log: Callable[[str], None] = print,
) -> Path:
    """Export `role` (default export.role) of `checkpoint` in `formats` (default export.formats).

    The checkpoint is verified (sizes and SHA-256) and its plan compared with `plan` before anything is
    read. An existing target is refused, or with ``if_exists="reuse"`` kept when it holds this
    checkpoint's export and replaced otherwise. Returns the written (or kept) directory.
    """
    from verl_dmd.adapters import get_adapter

    role = Role(role or plan.export.role)
    formats = tuple(formats or plan.export.formats)
    _check_request(plan, role, formats)
    started = time.monotonic()
    found = CheckpointStore.verify(checkpoint)  # sizes: enough to name it and to see whether it is exported
    target = (
        Path(output_dir)
        if output_dir is not None
        else export_root(plan) / f"global_step_{found.global_step}" / role.value
    )
    if _existing_export(target, found, formats, if_exists, log, plan.export.dtype):
        return target
    found = CheckpointStore.verify(checkpoint, hashes=True)  # every file checked before anything is read
    check_plan(found, plan)
    adapter = get_adapter(plan.model.adapter)()
    component = getattr(adapter, "pipeline_component", "transformer")
    serves = bool({"pipeline", "vllm_omni"} & set(formats) or LORA_SERVING_FORMATS & set(formats))
    pipeline = _pipeline_source(plan, component) if serves else None
    for served in ("vllm_omni", "lora_vllm_omni"):
        if served in formats:  # refused before anything is read
            serving.vllm_omni_class(pipeline[1].get("_class_name"), served)
    if "lora_vllm_omni" in formats:
        serving.check_vllm_omni_lora(plan, pipeline[1].get("_class_name"), adapter.default_lora_targets)
    if serves:
        _check_served_schedule(plan, adapter)
    if LORA_SERVING_FORMATS & set(formats):
        _check_lora_base(plan, layout_for(plan, adapter), pipeline[0], component)
    log(f"export: reading role {role.value} from {found.path}")
    layout = layout_for(plan, adapter)
    loaded = load_role(layout, found, role)
    guidance = serving.constant_guidance(plan, dict(getattr(loaded.model, "config", {}))) if serves else 1.0
    config = dmd2_config(plan, adapter.sigma_max, guidance)

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.partial-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    try:
        _write_formats(staging, loaded, formats, role, layout, component, pipeline, config, plan, log)
        info = _provenance(staging, found, plan, role, formats, config)
        (staging / EXPORT_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(f"export: {target} ({', '.join(formats)}; {time.monotonic() - started:.1f} s)")
    return target


def _provenance(staging: Path, found: Checkpoint, plan, role: Role, formats, config) -> dict[str, Any]:
    """export.json: where the export came from, how to sample it, and the SHA-256 of every file written."""
    return {
        "checkpoint": str(found.path),
        "global_step": found.global_step,
        "plan_fingerprint": found.manifest["plan_fingerprint"],
        "manifest_sha256": found.manifest.get("manifest_sha256"),
        "role": role.value,
        "formats": list(formats),
        "model_adapter": plan.model.adapter,
        "teacher": _teacher_identity(plan),
        "merged_dtype": plan.export.dtype if MERGED_FORMATS & set(formats) else None,
        "dmd2_config": config,
        "files": {
            str(p.relative_to(staging)): file_sha256(p) for p in sorted(staging.rglob("*")) if p.is_file()
        },
    }


def _write_formats(staging: Path, loaded: LoadedRole, formats, role: Role, layout: StorageLayout, component: str,
                   pipeline, config, plan, log: Callable[[str], None]) -> None:  # fmt: skip
    """Every asked-for format of the loaded role into `staging`: the adapter first, then the merged model."""
    model, adapter_name = loaded.model, loaded.selection.adapter
    if "peft" in formats:
        base, note = layout.student_base()
        if note:
            log(f"export: note: {note}")
        _write_peft(model, adapter_name, component, base, staging / PEFT_DIR)
        log(f"export: wrote the PEFT adapter ({loaded.tensor_count} tensors)")
    if LORA_SERVING_FORMATS & set(formats):
        _write_lora_serving(
            pipeline, component, config, _scheduler_shift(plan), layout, formats, staging, log
        )
    if MERGED_FORMATS & set(formats):
        _merge(model, loaded.base_keys, adapter_name, formats, role)
        _to_export_dtype(model, MERGED_DTYPES[plan.export.dtype])
        if "diffusers" in formats:
            model.save_pretrained(str(staging / DIFFUSERS_DIR), safe_serialization=True)
            log("export: wrote the merged diffusers model")
        if pipeline is not None:
            shift = _scheduler_shift(plan)
            served = staging / (PIPELINE_DIR if "pipeline" in formats else f".{PIPELINE_DIR}")
            _write_pipeline(
                model, pipeline, component, config, shift, layout.adapter.parameterization, served
            )
            log(f"export: wrote the pipeline from {pipeline[0]} with the student as {component}")
            if "vllm_omni" in formats:
                _write_vllm_omni(served, staging / VLLM_OMNI_DIR)
                log("export: wrote the vllm-omni directory (its DMD2 class reads dmd2_config)")
            if "pipeline" not in formats:
                shutil.rmtree(served)


def _scheduler_shift(plan) -> float:
    """The shift of the exported diffusers scheduler: the trained one, or 1 for explicit levels (passed as
    they are)."""
    return 1.0 if plan.algorithm.student_sigmas else plan.algorithm.sigma_shift


def _write_lora_serving(pipeline, component: str, config, shift: float, layout: StorageLayout, formats, staging: Path,
                        log: Callable[[str], None]) -> None:  # fmt: skip
    """The teacher's pipeline, every file linked (its transformer too), with the trained scheduler and block:
    the directory a LoRA is served on (`lora_pipeline`, diffusers), and under vllm-omni's DMD2 class
    (`lora_vllm_omni`); the adapter is the peft format's, beside them."""
    served = staging / (LORA_PIPELINE_DIR if "lora_pipeline" in formats else f".{LORA_PIPELINE_DIR}")
    _write_pipeline(None, pipeline, component, config, shift, layout.adapter.parameterization, served)
    log(f"export: wrote the LoRA serving pipeline (the teacher's files linked from {pipeline[0]})")
    if "lora_vllm_omni" in formats:
        _write_vllm_omni(served, staging / LORA_VLLM_OMNI_DIR)
        log("export: wrote the LoRA serving directory for vllm-omni (--lora-path <export>/peft)")
    if "lora_pipeline" not in formats:
        shutil.rmtree(served)


def _to_export_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Round the merged weights (merged in float32) once to `dtype`, except those the model class keeps in
    float32 (diffusers' ``_keep_in_fp32_modules``, e.g. Wan's time embedder and norms: its loader upcasts
    them again, so their float32 values are what a bf16 load computes with)."""
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and not any(part in name.split(".") for part in keep):
                tensor.data = tensor.data.to(dtype)


def _check_served_schedule(plan, adapter) -> None:
    """The diffusers calls of docs/serving.md pass levels from 1 (linspace(1, 1/N, N)): a schedule that
    starts lower (an adapter with sigma_max < 1) is only served as trained with explicit levels."""
    if adapter.sigma_max != 1.0 and not plan.algorithm.student_sigmas:
        raise ExportError(
            f"config key 'export.formats' = {list(plan.export.formats)}: the {plan.model.adapter} adapter's "
            f"schedule starts at sigma {adapter.sigma_max}, the served pipelines' at 1; fix: train on explicit "
            "levels (algorithm.student_sigmas) and pass them as sigmas=, or export peft or diffusers only"
        )


def _check_lora_base(plan, layout: StorageLayout, source: Path, component: str) -> None:
    """A lora_* directory serves the adapter on `source`'s `component`: that must be the base the adapter was
    trained on (the teacher's weights and config, by content)."""
    from verl_dmd.digests import model_digests

    _, note = layout.student_base()
    if note:
        raise ExportError(
            f"config key 'export.formats' = {list(plan.export.formats)}: a lora_* directory serves the adapter "
            f"on the teacher's {component}, but {note}; fix: export the merged pipeline instead"
        )
    teacher = plan.teacher_identity()
    try:
        served = model_digests(source / component)["content_sha256"]
    except ValueError as err:
        raise ExportError(f"config key 'export.pipeline_source' = {str(source)!r}: {err}") from None
    if served != teacher["content_sha256"]:
        raise ExportError(
            f"config key 'export.pipeline_source' = {str(source)!r}: its {component} is not the teacher the "
            f"adapter was trained on (content {served[:12]}..., the teacher's {str(teacher['content_sha256'])[:12]}...); "
            "fix: point export.pipeline_source at the teacher's pipeline directory"
        )


def _teacher_identity(plan) -> dict[str, Any]:
    """The teacher by content (SHA-256 of its weights and config.json) besides its path, and the class of the
    pipeline it belongs to (None for a bare model directory or a config-built teacher)."""
    from verl_dmd.data.prepared import teacher_pipeline

    identity = dict(plan.teacher_identity())
    root = teacher_pipeline(plan)
    identity["pipeline_class"] = (
        json.loads((root / "model_index.json").read_text()).get("_class_name") if root is not None else None
    )
    return identity
