"""The driver's pre-flight: every check of a run that can fail before ray or any worker starts.

A worker reaches a bad model directory, a LoRA target that is not in the model or
an unusable resume path 10 to 50 seconds into a run, and reports it from inside a
rank; here each one is a single line naming the key, the value, what is allowed
and the fix (`PlanError`, exit code 2 in the entry points), before anything
starts. `preflight` runs the checks cheapest first: paths, model directories,
resources and the resume path need no torch; registry names (a misspelt one is
refused without importing the registered modules) and the resumed checkpoint's
plan import torch; the data checks and the models import the registered modules
(diffusers): models are read from their ``config.json`` and built on the meta
device, so no weight is loaded. `preflight_export` is the part that applies to `verl-dmd-export`.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
import sys
from pathlib import Path

from verl_dmd.plan import DistillationPlan, PlanError
from verl_dmd.plan.schema import error

MODEL_ROLES = ("teacher", "student", "fake_score")
SECOND_EXPERT = "transformer_2"
"""The component of a pipeline's model_index.json that holds Wan 2.2's second (low-noise) expert."""
LORA_ROLES = ("student", "fake_score")
# diffusers' weight file names (diffusers.utils.constants): what `from_pretrained` reads without a variant.
WEIGHT_FILES = (
    "diffusion_pytorch_model.safetensors",
    "diffusion_pytorch_model.safetensors.index.json",
    "diffusion_pytorch_model.bin",
    "diffusion_pytorch_model.bin.index.json",
)


def preflight(plan: DistillationPlan, *, backend: str) -> None:
    """Every check of a training run on `backend` (ray or local), cheapest first; PlanError with one line."""
    plan.check_local_paths()
    check_model_dirs(plan)
    check_one_transformer(plan)
    check_output_paths(plan)
    check_export_targets(plan)
    check_resources(plan, backend=backend)
    check_resume_path(plan)
    check_names_early(plan)  # no torch: a misspelt name is refused in a second
    from_headers = check_models_from_headers(plan)  # no torch, no diffusers: before the imports below
    check_registered(plan)
    check_export_lora(plan)
    check_model_contents(plan)  # a first read hashes the weights (seconds per GB), then cached by file stats
    check_resume(plan)
    check_data(plan)
    if not from_headers:
        check_models_on_meta(plan)


def preflight_export(plan: DistillationPlan) -> None:
    """The checks of `verl-dmd-export`: its inputs, its output directory and the checkpoint it reads."""
    plan.check_local_paths()
    check_model_dirs(plan)
    check_one_transformer(plan)
    if plan.checkpoint.resume == "disable":
        raise error("checkpoint.resume", "disable", "export needs a checkpoint",
                    "checkpoint.resume=auto (the newest) or checkpoint.resume=<checkpoint directory>")  # fmt: skip
    check_directory("export.output_dir", plan.export.output_dir, export_root(plan))
    check_export_targets(plan)
    check_resume_path(plan)
    if plan.checkpoint.resume == "auto":
        from verl_dmd.checkpoint.store import CheckpointStore

        found = CheckpointStore(checkpoint_root(plan)).candidates("auto")
        if not found.checkpoints and not found.damaged:  # damaged ones: check_resume names them
            raise no_checkpoint(checkpoint_root(plan))
    check_export_lora(plan)
    check_model_contents(plan)
    check_resume(plan)


def no_checkpoint(root: Path) -> PlanError:
    """The error of an export that finds nothing to export under `root`."""
    return PlanError(
        f"no checkpoint under {root}; fix: train first, or set checkpoint.root / trainer.output_dir "
        "to the run's, or checkpoint.resume=<checkpoint directory>"
    )


# --------------------------------------------------------------------------- outputs


def checkpoint_root(plan: DistillationPlan) -> Path:
    """`verl_dmd.checkpoint.composite.checkpoint_root` (a test keeps them equal), here without importing torch."""
    return Path(plan.checkpoint.root or Path(plan.trainer.output_dir) / "checkpoints")


def export_root(plan: DistillationPlan) -> Path:
    """`verl_dmd.checkpoint.export.export_root` (a test keeps them equal), here without importing torch."""
    return Path(plan.export.output_dir or Path(plan.trainer.output_dir) / "export")


def check_output_paths(plan: DistillationPlan) -> None:
    """Every directory a run writes is one or can be made, and can be written; the checkpoint root has room
    for one more checkpoint of the size of its newest (a save writes before retention deletes)."""
    check_directory("trainer.output_dir", plan.trainer.output_dir, Path(plan.trainer.output_dir))
    root = checkpoint_root(plan)
    check_directory("checkpoint.root", plan.checkpoint.root, root)
    if plan.export.at_end:
        check_directory("export.output_dir", plan.export.output_dir, export_root(plan))
    # The embeddings provider reads its pairs from the prepared data set at data.path instead.
    if plan.algorithm.regression_weight > 0 and plan.data.regression_pairs_path is not None:
        check_pairs_path(plan.data.regression_pairs_path)
    check_free_space(root)


def check_export_targets(plan: DistillationPlan) -> None:
    """A vllm_omni export needs a pipeline class vllm-omni has a DMD2 pipeline for (refused before training,
    not after it); read from export.pipeline_source's model_index.json, without torch."""
    import json

    from verl_dmd.checkpoint.serving import VLLM_OMNI_CLASSES

    source = plan.export.pipeline_source
    served = {"pipeline", "vllm_omni", "lora_pipeline", "lora_vllm_omni"} & set(plan.export.formats)
    vllm_omni = {"vllm_omni", "lora_vllm_omni"} & served
    if not served or not source:
        return
    try:
        index = json.loads((Path(source) / "model_index.json").read_text())
        class_name = index.get("_class_name")
    except (OSError, ValueError, AttributeError):
        raise error("export.pipeline_source", source, "has no readable model_index.json",
                    "point it at a local diffusers pipeline directory (the teacher's)") from None  # fmt: skip
    named = second_expert(index)
    if named:  # the export would ship the teacher's second expert, undistilled, beside the student
        raise error("export.pipeline_source", source,
                    f"its model_index.json lists a second transformer, {SECOND_EXPERT} ({named[-1]}): a Wan 2.2 "
                    "pipeline of two experts; verl_dmd distils one transformer, and serving a student beside the "
                    "teacher's other expert is not supported", "export peft or diffusers only")  # fmt: skip
    if not vllm_omni:
        return
    if class_name not in VLLM_OMNI_CLASSES:
        raise error("export.formats", list(plan.export.formats),
                    f"vllm-omni has no DMD2 pipeline for a {class_name} (it serves students of "
                    f"{', '.join(sorted(VLLM_OMNI_CLASSES))})",
                    f"drop {', '.join(sorted(vllm_omni))}; the pipeline format serves with diffusers "
                    "(docs/serving.md)")  # fmt: skip


def check_export_lora(plan: DistillationPlan) -> None:
    """A lora_vllm_omni export's adapter (rank, targets: the model adapter's defaults unless set) is one
    vllm-omni's LoRA loader places (`serving.vllm_omni_lora_problem`); after check_registered in a training run
    (it imports the model adapter; an unknown one is a one-line error here too)."""
    if "lora_vllm_omni" not in plan.export.formats or not plan.export.pipeline_source:
        return
    from verl_dmd.adapters import get_adapter
    from verl_dmd.checkpoint import serving
    from verl_dmd.registry import UnknownNameError

    index = json.loads((Path(plan.export.pipeline_source) / "model_index.json").read_text())
    try:
        targets = get_adapter(plan.model.adapter).default_lora_targets
        serving.check_vllm_omni_lora(plan, index.get("_class_name"), targets)
    except (serving.ServingError, UnknownNameError) as err:
        raise PlanError(str(err)) from None


def check_directory(key: str, value: str | None, path: Path) -> None:
    """`path` (the value of `key`, or derived from another key when `value` is None) is a writable directory,
    or the first of its ancestors that exists is one, so that it can be made."""
    path = path.expanduser()
    named = f"{path} (derived from trainer.output_dir)" if value is None else str(path)
    existing = _first_existing(path)
    if existing == path and not path.is_dir():
        raise error(key, value, f"{named} is a file, not a directory",
                    f"point {key} at a directory, or move the file away")  # fmt: skip
    if not existing.is_dir():
        raise error(key, value, f"{named} cannot be made: {existing} is a file",
                    f"point {key} at a path under a directory")  # fmt: skip
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "it" if existing == path else f"its nearest existing parent {existing}"
        raise error(key, value, f"{named} cannot be written: {where} is not writable by this user",
                    f"change the permissions of {existing}, or point {key} at a writable place")  # fmt: skip


def check_pairs_path(value: str) -> None:
    """The regression pairs file: a ``.safetensors`` path that is a file where it exists, and whose folder can
    be made and written where it does not (the provider writes it on first use)."""
    key = "data.regression_pairs_path"
    path = Path(value).expanduser()
    if path.suffix != ".safetensors":
        raise error(key, value, "must be a .safetensors file path (the pairs are a safetensors file)",
                    f"name it e.g. {path.with_suffix('.safetensors').name}")  # fmt: skip
    if path.exists():
        if not path.is_file():
            raise error(key, value, f"{path} is a directory, not a file",
                        "name a file path, e.g. <dir>/pairs.safetensors")  # fmt: skip
        if not os.access(path, os.R_OK):
            raise error(key, value, f"{path} cannot be read by this user", "change its permissions")
        return
    existing = _first_existing(path.parent)
    if not existing.is_dir():
        raise error(key, value, f"{path} cannot be made: {existing} is a file",
                    "name a file path under a directory")  # fmt: skip
    check_directory(key, value, path.parent)


def check_free_space(root: Path, estimate: int | None = None) -> None:
    """The file system of the checkpoint root has room for a checkpoint as large as the newest one there
    (its manifest lists every file's size) or, with none yet, as `estimate` (bytes; None: not known)."""
    newest = _newest_manifest(root.expanduser())
    if newest is None and estimate is None:
        return
    size, source = (
        (newest[1], f"as {newest[0].parent.name}") if newest else (estimate, "estimated from the models")
    )
    free = shutil.disk_usage(_first_existing(root.expanduser())).free
    if free < size:
        raise PlanError(
            f"checkpoint root {root}: {_gib(free)} free on its file system, and a checkpoint of this run takes "
            f"about {_gib(size)} ({source}); fix: free space there, lower checkpoint.keep_last, "
            "or set checkpoint.root to a larger file system"
        )


def _newest_manifest(root: Path) -> tuple[Path, int] | None:
    """The newest ``global_step_<N>/manifest.json`` under `root` and the total of the sizes it lists."""
    steps = []
    if root.is_dir():
        for path in root.iterdir():
            match = re.fullmatch(r"global_step_(\d+)", path.name)
            if match and (path / "manifest.json").is_file():
                steps.append((int(match.group(1)), path / "manifest.json"))
    if not steps:
        return None
    manifest = max(steps)[1]
    try:
        files = json.loads(manifest.read_text())["files"]
        return manifest, sum(int(entry["size"]) for entry in files.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # a damaged manifest: the resume check names it


def _first_existing(path: Path) -> Path:
    """`path` or its nearest ancestor that exists."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


# --------------------------------------------------------------------------- resources and resume


def check_resources(plan: DistillationPlan, *, backend: str) -> None:
    """A cuda run has GPUs here, and without an external ray cluster (RAY_ADDRESS unset) the GPU workers
    asked for fit this machine.

    On CPU there is nothing to compare: the driver starts its local cluster with at least one CPU per
    worker (`DistillationRayTrainer._start_ray`). The local backend runs one rank, so only the device counts.
    """
    resources = plan.resources
    mesh = plan.model.fsdp_mesh
    # replicate is every rank's own copy: one rank is a mesh of one
    replicas = resources.nnodes if mesh == "hybrid" else (mesh[0] if isinstance(mesh, tuple) else 1)
    if backend == "local" and replicas > 1:
        raise error("model.fsdp_mesh", mesh if isinstance(mesh, str) else list(mesh),
                    "a hybrid mesh needs several ranks, and the local backend runs one",
                    "drop --local (the ray workers run it), or set model.fsdp_mesh=shard")  # fmt: skip
    cluster = backend == "ray" and bool(os.environ.get("RAY_ADDRESS"))
    if resources.device == "cpu" or cluster:
        return
    import torch

    gpus = torch.cuda.device_count()
    if resources.device == "auto" and gpus == 0:
        return  # runs on CPU
    if gpus == 0:
        raise error("resources.device", resources.device, "this machine has no GPU that torch can use",
                    "set resources.device=cpu (or auto)" + ("" if backend == "local" else
                    ", or RAY_ADDRESS to a ray cluster with GPUs"))  # fmt: skip
    if backend == "ray" and resources.world_size > gpus:
        raise PlanError(
            f"config keys 'resources.nnodes' = {resources.nnodes} x 'resources.workers_per_node' = "
            f"{resources.workers_per_node}: {resources.world_size} GPU workers, and this machine has {gpus} "
            f"GPU(s) (RAY_ADDRESS names no ray cluster); fix: set resources.workers_per_node to at most {gpus} "
            "with resources.nnodes=1, or RAY_ADDRESS to a ray cluster that has the GPUs"
        )


def check_resume_path(plan: DistillationPlan) -> None:
    """`checkpoint.resume` is auto, disable, a checkpoint or a checkpoint root (the store's resolution, which
    needs no torch: such a mistake is refused before anything heavy is imported)."""
    from verl_dmd.checkpoint.store import CheckpointError, CheckpointStore

    try:
        CheckpointStore(checkpoint_root(plan)).candidates(plan.checkpoint.resume)
    except CheckpointError as err:
        raise PlanError(" ".join(str(err).split())) from None


def check_resume(plan: DistillationPlan) -> None:
    """What `checkpoint.resume` finds can be resumed under this plan (the checkpoint layer's own
    `preflight_resume`: the newest candidate's plan is this one)."""
    from verl_dmd.checkpoint.composite import preflight_resume
    from verl_dmd.checkpoint.store import CheckpointError

    try:
        preflight_resume(plan)
    except CheckpointError as err:
        raise PlanError(" ".join(str(err).split())) from None


# --------------------------------------------------------------------------- registries and data


# The registries' declarations (kind, entry-point group, built-in names), known without importing their
# modules, which import torch (a test keeps them equal to the registries').
REGISTRY_DECLARATIONS = {
    "model.adapter": ("model adapter", "verl_dmd.adapters", ("dit", "flux", "qwen_image", "sd3", "wan")),
    "algorithm.name": ("distillation method", "verl_dmd.algorithms", ("dmd2",)),
    "data.name": ("data provider", "verl_dmd.data_providers", ("digits", "embeddings")),
    "validation.name": ("validator", "verl_dmd.validators", ("digits", "pipeline")),
}


REGISTRY_MODULES = {
    "model.adapter": "verl_dmd.adapters.registry",
    "algorithm.name": "verl_dmd.algorithms.registry",
    "data.name": "verl_dmd.trainer.registry",
    "validation.name": "verl_dmd.trainer.registry",
}


def check_names_early(plan: DistillationPlan) -> None:
    """A name that is no built-in one is unknown when no installed package extends its registry: refused
    here without importing torch, with the registries' own message. With plugins installed, or for a built-in
    name, `check_registered` decides."""
    import importlib.metadata

    from verl_dmd.registry import Registry, UnknownNameError

    chosen = {"model.adapter": plan.model.adapter, "algorithm.name": plan.algorithm.name,
              "data.name": plan.data.name, "validation.name": plan.validation.name}  # fmt: skip
    for key, (kind, group, builtins) in REGISTRY_DECLARATIONS.items():
        name = chosen[key]
        if not name or name in builtins or importlib.metadata.entry_points(group=group):
            continue
        if REGISTRY_MODULES[key] in sys.modules:  # imported already: it may hold in-process registrations
            continue
        try:
            Registry(kind, key=key, entry_point_group=group, builtin_names=builtins).check_name(name)
        except UnknownNameError as err:
            raise PlanError(str(err)) from None


def check_registered(plan: DistillationPlan) -> None:
    """Every name the plan selects from a registry exists (model adapter, method, data provider,
    validator): one line naming the key and the registered names."""
    from verl_dmd.adapters.registry import ADAPTERS
    from verl_dmd.algorithms.registry import METHODS
    from verl_dmd.registry import UnknownNameError
    from verl_dmd.trainer.registry import DATA_PROVIDERS, VALIDATORS

    selections = [
        (ADAPTERS, plan.model.adapter),
        (METHODS, plan.algorithm.name),
        (DATA_PROVIDERS, plan.data.name),
    ]
    if plan.validation.name:
        selections.append((VALIDATORS, plan.validation.name))
    for registry, name in selections:
        try:
            registry.check_name(name)
        except UnknownNameError as err:
            raise PlanError(str(err)) from None


def check_data(plan: DistillationPlan) -> None:
    """The data provider's and the validator's own checks, where they have one (an optional classmethod
    ``preflight(plan)``, e.g. the embeddings provider reading its files' headers); a ValueError of theirs
    becomes the one-line PlanError."""
    from verl_dmd.trainer.registry import DATA_PROVIDERS, VALIDATORS, validator_name

    try:
        entries = [DATA_PROVIDERS.get(plan.data.name)]
        name = validator_name(plan)
        if name:
            entries.append(VALIDATORS.get(name))
        for entry in entries:
            check = getattr(entry, "preflight", None)
            if check is not None:
                check(plan)
    except ValueError as err:
        raise PlanError(" ".join(str(err).split())) from None


# --------------------------------------------------------------------------- models


# The built-in adapters' model classes and default LoRA targets, known without importing diffusers (a test
# keeps them equal to the adapters'): with them, a model directory's class and the LoRA targets are checked
# from config.json and the safetensors headers in well under a second.
BUILTIN_MODEL_CLASSES = {
    "dit": "DiTTransformer2DModel",
    "flux": "FluxTransformer2DModel",
    "qwen_image": "QwenImageTransformer2DModel",
    "sd3": "SD3Transformer2DModel",
    "wan": "WanTransformer3DModel",
}
BUILTIN_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


def check_models(plan: DistillationPlan) -> None:
    """Each model directory holds a model of the adapter's class, each model builds from its config, and
    each LoRA target names modules of the model it adapts, matched as PEFT matches them.

    For a built-in adapter whose models all come from directories with safetensors weights, this is read
    from config.json and the weights' headers (`check_models_from_headers`); otherwise the models are built
    on the meta device from their configs (diffusers is imported; no weight is read)."""
    if check_models_from_headers(plan):
        return
    check_models_on_meta(plan)


def check_models_on_meta(plan: DistillationPlan) -> None:
    """The model checks on models built on the meta device from their configs."""
    from verl_dmd.adapters import get_adapter

    adapter = get_adapter(plan.model.adapter)()
    models = {}
    for role in MODEL_ROLES:
        spec = getattr(plan.model, role)
        if spec.path is not None:
            config = read_model_config(f"model.{role}", spec)
            check_model_class(f"model.{role}.path", spec.path, config, adapter)
            models[role] = meta_model(f"model.{role}.path", spec.path, adapter, config=config)
        elif spec.config is not None:
            models[role] = meta_model(f"model.{role}.config", "<config>", adapter, source=spec)
    for role in LORA_ROLES:
        spec = getattr(plan.model, role)
        owner = role if plan.model.storage == "independent" and role in models else "teacher"
        if spec.lora.enabled and models[owner] is not None:
            check_lora_targets(f"model.{role}.lora", spec.lora, adapter, models[owner], owner)


def check_model_dirs(plan: DistillationPlan) -> None:
    """Each model directory (`model.<role>.path` and subfolder) holds a model: a config.json and its weights."""
    for role in MODEL_ROLES:
        spec = getattr(plan.model, role)
        if spec.path is not None:
            read_model_config(f"model.{role}", spec)


def second_expert(index) -> list:
    """The named parts of a pipeline's ``transformer_2`` entry (empty: it has one transformer; diffusers
    writes ``[null, null]`` for Wan pipelines without a second expert)."""
    entry = index.get(SECOND_EXPERT) if isinstance(index, dict) else None
    if entry is None:
        return []
    return [part for part in entry if part is not None] if isinstance(entry, list) else [entry]


def check_one_transformer(plan: DistillationPlan) -> None:
    """The teacher's pipeline (`verl_dmd.data.prepared.teacher_pipeline`) has one transformer. Wan 2.2's
    A14B pipelines list a second, ``transformer_2``: two experts, one denoising the high noise levels and one
    the low. A run distils one transformer, so it would learn from one expert as if it were the teacher."""
    from verl_dmd.data.prepared import teacher_pipeline

    root = teacher_pipeline(plan)
    if root is None:
        return
    try:
        components = json.loads((root / "model_index.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise error("model.teacher.path", plan.model.teacher.path, f"{root / 'model_index.json'} is not "
                    f"readable JSON ({err})", "restore the pipeline's model_index.json") from None  # fmt: skip
    named = second_expert(components)
    if named:
        raise error("model.teacher.path", plan.model.teacher.path,
                    f"its model_index.json lists a second transformer, {SECOND_EXPERT} ({named[-1]}): a Wan 2.2 "
                    "teacher of two experts (high and low noise levels); verl_dmd distils one transformer, and "
                    "distilling both experts is not supported",
                    "use a pipeline with one transformer (Wan 2.1, or Wan 2.2 TI2V-5B)")  # fmt: skip


def check_model_contents(plan: DistillationPlan) -> None:
    """Each model named by path is identified by content here, on the driver, before the workers start
    (`DistillationPlan.model_identity`: the plan's fingerprint holds it), and a pinned
    ``model.<role>.content_sha256`` is that model's."""
    for role in MODEL_ROLES:
        spec = getattr(plan.model, role)
        if spec.path is None:
            continue
        found = plan.model_identity(role)["content_sha256"]
        if spec.content_sha256 is not None and spec.content_sha256 != found:
            raise error(f"model.{role}.content_sha256", spec.content_sha256,
                        f"the model at model.{role}.path = {spec.path!r} has content {found} (its weights or "
                        "config.json differ)", f"point model.{role}.path at the model the digest names, or set "
                        f"model.{role}.content_sha256=null to take the model there")  # fmt: skip


def read_model_config(prefix: str, spec) -> dict:
    """The ``config.json`` of the model at ``<prefix>.path`` (and subfolder), next to its weights; read
    without loading anything (the path itself exists: `DistillationPlan.check_local_paths`)."""
    from verl_dmd.assets import resolve_model_path

    key, value = f"{prefix}.path", spec.path
    folder = Path(resolve_model_path(spec.path)).expanduser() / (spec.subfolder or "")
    file = folder / "config.json"
    if not file.is_file():
        if (folder / "model_index.json").is_file():
            parts = sorted(d.name for d in folder.iterdir() if (d / "config.json").is_file())
            raise error(key, value, f"{folder} is a diffusers pipeline (model_index.json), not a model",
                        f"set {prefix}.subfolder to its denoiser's folder (with a config.json: "
                        f"{', '.join(parts) or 'none'})")  # fmt: skip
        raise error(key, value, f"{folder} holds no model (no config.json)",
                    "point it at a local diffusers model directory (config.json and its weights)")  # fmt: skip
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise error(key, value, f"{file} is not readable JSON ({err})",
                    "restore the model's config.json") from None  # fmt: skip
    if not isinstance(config, dict):
        raise error(key, value, f"{file} is not a model config (a JSON object)",
                    "restore the model's config.json")  # fmt: skip
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise error(key, value, f"{folder} holds a config.json but no weights ({WEIGHT_FILES[0]} or .bin)",
                    "point it at a complete model directory")  # fmt: skip
    return config


def check_model_class(key: str, value: str, config: dict, adapter) -> None:
    """A model directory's class (diffusers writes ``_class_name`` into config.json) is the adapter's."""
    from verl_dmd.adapters.registry import ADAPTERS

    found, wanted = config.get("_class_name"), adapter.model_class.__name__
    if found is not None and found != wanted:
        others = [n for n in ADAPTERS.names() if ADAPTERS.get(n).model_class.__name__ == found]
        fix = f"set model.adapter={others[0]}" if others else f"point it at a {wanted} directory"
        raise error(key, value, f"holds a {found}, and model.adapter={adapter.name} loads {wanted}", fix)


def meta_model(key: str, value: str, adapter, *, config: dict | None = None, source=None):
    """The model on the meta device: from a directory's config (`config`), or as the adapter builds a
    config-built role (`source`, a plan spec). A config the model class rejects is a one-line PlanError;
    None when the class cannot be built on the meta device (its constructor reads values): not the user's
    to fix, and the workers build it for real."""
    import torch

    from verl_dmd.adapters.base import ModelSource

    try:
        with torch.device("meta"):
            if config is not None:
                return adapter.model_class.from_config(config)
            return adapter.build_model(ModelSource.of(source))
    except (TypeError, ValueError, KeyError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise error(key, value, f"does not build a {adapter.model_class.__name__}: {first}",
                    "give a config of that model class") from None  # fmt: skip
    except (RuntimeError, NotImplementedError):
        return None


def check_lora_targets(key: str, lora, adapter, model, owner: str) -> None:
    """LoRA's `target_modules` (or the adapter's default) against `model`'s module names, matched by PEFT's
    own rule (a name or a dotted suffix of one). Every target named in the plan must match; of the adapter's
    defaults at least one, as PEFT asks. A matched module must be a layer LoRA adapts."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists
    from torch import nn

    targets = lora.target_modules or adapter.default_lora_targets
    modules = dict(model.named_modules())
    matched = {}
    for target in targets:
        config = LoraConfig(target_modules=[target])
        matched[target] = [name for name in modules if check_target_module_exists(config, name)]
    missing = [target for target, names in matched.items() if not names]
    where = f"the {owner} model ({type(model).__name__})"
    if lora.target_modules is None and len(missing) == len(targets):
        raise error(f"{key}.target_modules", None,
                    f"the adapter's default targets {list(targets)} match no module of {where}",
                    f"set {key}.target_modules to names of its linear layers")  # fmt: skip
    if lora.target_modules is not None and missing:
        layers = {n.rsplit(".", 1)[-1] for n, m in modules.items() if isinstance(m, nn.Linear)}
        close = difflib.get_close_matches(missing[0], sorted(layers), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise error(f"{key}.target_modules", list(targets),
                    f"{missing[0]!r} matches no module of {where} (a module name or the end of one)",
                    f"{hint}name its layers, e.g. {', '.join(adapter.default_lora_targets)}")  # fmt: skip
    supported = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention)
    for target, names in matched.items():
        for name in names:
            if not isinstance(modules[name], supported):
                raise error(f"{key}.target_modules", list(targets),
                            f"{target!r} matches {name} ({type(modules[name]).__name__}), which LoRA cannot "
                            "adapt: it adapts linear, convolution, embedding and nn.MultiheadAttention layers",
                            f"name its layers instead, e.g. {', '.join(adapter.default_lora_targets)}")  # fmt: skip


# --------------------------------------------------------------------------- models, from their files


def check_models_from_headers(plan: DistillationPlan) -> bool:
    """The model checks from files alone: True when every model was checked this way (a built-in adapter,
    every role's model a directory with safetensors weights), False to leave it to the meta-device build."""
    wanted = BUILTIN_MODEL_CLASSES.get(plan.model.adapter)
    if wanted is None:
        return False
    layers = {}
    for role in MODEL_ROLES:
        spec = getattr(plan.model, role)
        if spec.path is None:
            if spec.config is not None:
                return False
            continue
        config = read_model_config(f"model.{role}", spec)
        found = config.get("_class_name")
        if found is not None and found != wanted:
            others = [name for name, cls in BUILTIN_MODEL_CLASSES.items() if cls == found]
            fix = f"set model.adapter={others[0]}" if others else f"point it at a {wanted} directory"
            raise error(f"model.{role}.path", spec.path,
                        f"holds a {found}, and model.adapter={plan.model.adapter} loads {wanted}", fix)  # fmt: skip
        shapes = weight_shapes(Path(_model_folder(spec)))
        if shapes is None:
            return False
        layers[role] = shapes
    for role in LORA_ROLES:
        spec = getattr(plan.model, role)
        owner = role if plan.model.storage == "independent" and role in layers else "teacher"
        if spec.lora.enabled and owner in layers:
            check_lora_names(f"model.{role}.lora", spec.lora.target_modules, layers[owner], owner)
    if "teacher" in layers:
        check_free_space(checkpoint_root(plan), estimate_checkpoint_bytes(plan, layers))
    return True


def estimate_checkpoint_bytes(plan: DistillationPlan, layers: dict[str, dict[str, list[int]]]) -> int:
    """About what one checkpoint of this plan takes: float32 weights and two AdamW moments of what the student
    and the fake score train (their LoRA factors on the 2-D layers they target, or all weights), and the EMA's
    copy of the student's; the frozen base is not saved. Biases and the GAN head are left out (small)."""
    import math

    trained = {}
    for role in LORA_ROLES:
        spec = getattr(plan.model, role)
        shapes = layers.get(role if plan.model.storage == "independent" else "teacher", layers["teacher"])
        if spec.lora.enabled:
            targets = spec.lora.target_modules or BUILTIN_LORA_TARGETS
            trained[role] = sum(spec.lora.rank * (shape[0] + shape[1]) for name, shape in shapes.items()
                                if len(shape) == 2 and any(peft_matches(t, name) for t in targets))  # fmt: skip
        else:
            trained[role] = sum(math.prod(shape) for shape in shapes.values())
    ema = trained["student"] if plan.ema.enabled else 0
    return 4 * (3 * (trained["student"] + trained["fake_score"]) + ema)


def _model_folder(spec) -> str:
    from verl_dmd.assets import resolve_model_path

    return str(Path(resolve_model_path(spec.path)).expanduser() / (spec.subfolder or ""))


def weight_shapes(folder: Path) -> dict[str, list[int]] | None:
    """Every ``<module>.weight``'s shape, by module name, from the safetensors headers (8 bytes of length,
    then JSON: nothing else is read); None when the weights are not safetensors."""
    single = folder / "diffusion_pytorch_model.safetensors"
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    try:
        if single.is_file():
            files = [single]
        elif index.is_file():
            files = sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()})
        else:
            return None
        shapes = {}
        for file in files:
            with file.open("rb") as handle:
                length = int.from_bytes(handle.read(8), "little")
                if not 0 < length < 1 << 28:
                    return None
                header = json.loads(handle.read(length))
            for key, entry in header.items():
                if key.endswith(".weight") and isinstance(entry, dict):
                    shapes[key[: -len(".weight")]] = list(entry.get("shape", []))
        return shapes
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # unreadable: the meta-device build (or the worker) reports it


def peft_matches(target: str, name: str) -> bool:
    """PEFT's rule for a list of target names: the module's name is the target, or ends with "." + target."""
    return name == target or name.endswith("." + target)


def check_lora_names(key: str, targets, shapes: dict[str, list[int]], owner: str) -> None:
    """LoRA targets against the layers of a model's weight file: every named target matches a layer (of the
    adapter's defaults, at least one, as PEFT asks), and every match is a layer LoRA adapts (a weight of 2 to
    5 dimensions: linear, embedding, convolution; a 1-dimensional one is a norm's)."""
    named = targets is not None
    targets = tuple(targets or BUILTIN_LORA_TARGETS)
    prefixes = {name.rsplit(".", depth)[0] for name in shapes for depth in range(1, name.count(".") + 1)}
    where = f"the {owner} model (read from its weight files)"
    matched = {t: [n for n in shapes if peft_matches(t, n)] for t in targets}
    missing = [t for t, names in matched.items() if not names]
    if not named and len(missing) == len(targets):
        raise error(f"{key}.target_modules", None, f"the adapter's default targets {list(targets)} match no "
                    f"layer of {where}", f"set {key}.target_modules to names of its linear layers")  # fmt: skip
    if named and missing:
        target = missing[0]
        if any(peft_matches(target, p) for p in prefixes):
            problem = f"{target!r} names a block, not a layer, of {where}"
        else:
            problem = f"{target!r} matches no module of {where} (a module name or the end of one)"
        leaves = sorted({n.rsplit(".", 1)[-1] for n, shape in shapes.items() if len(shape) == 2})
        close = difflib.get_close_matches(target.rsplit(".", 1)[-1], leaves, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise error(f"{key}.target_modules", list(targets), problem,
                    f"{hint}name its layers, e.g. {', '.join(BUILTIN_LORA_TARGETS)}")  # fmt: skip
    for target, names in matched.items():
        for name in names:
            if not 2 <= len(shapes[name]) <= 5:
                raise error(f"{key}.target_modules", list(targets),
                            f"{target!r} matches {name}, a weight of shape {shapes[name]}, which LoRA cannot adapt "
                            "(a norm's); it adapts linear, convolution and embedding layers",
                            f"name its layers instead, e.g. {', '.join(BUILTIN_LORA_TARGETS)}")  # fmt: skip
