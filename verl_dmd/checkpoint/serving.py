"""What a serving stack needs to sample an exported student as it was trained: the `dmd2_config` block,
the vllm-omni class, the diffusers scheduler, the guidance; and a reader of the block with vllm-omni's
semantics, to check our exports against.

vllm-omni's DMD2 pipelines (docs/serving.md, ../shared/REAL_MODELS.md section 1) read
``model_index.json["dmd2_config"]`` when ``_class_name`` names one of their DMD2 classes; a missing or
malformed block silently gives their defaults (4 steps, timesteps [999, 749, 499, 249], "ode", guidance 1).
The block holds the schedule on the 0-1000 scale already shifted (their scheduler's shift is fixed at 1),
so the trained shift is baked into `denoising_timesteps`. Versions between their PR #2749 and #2974 read
flat top-level keys instead; an export writes both forms, saying the same.

Plain diffusers ignores the block: there the pipeline's own ``scheduler/scheduler_config.json`` is
rewritten so that the family's pipeline call reproduces the trained schedule
(FlowMatchEulerDiscreteScheduler with the trained shift, no dynamic shifting, stochastic sampling:
x0 = x - sigma * v, re-noised with fresh noise to the next level, the student's own sampler).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

VLLM_OMNI_CLASSES = {
    "FluxPipeline": "FluxDMD2Pipeline",
    "QwenImagePipeline": "QwenImageDMD2Pipeline",
    "WanPipeline": "WanT2VDMD2Pipeline",
    "WanImageToVideoPipeline": "WanI2VDMD2Pipeline",
}
"""The teacher's pipeline class -> the vllm-omni DMD2 pipeline class that serves its student (their
mixin's classes; none exists for StableDiffusion3Pipeline, SDXL, FLUX.2 or DiT)."""

VLLM_OMNI_DEFAULTS = {
    "num_inference_steps": 4,
    "denoising_timesteps": [999, 749, 499, 249],
    "solver": "ode",
    "guidance_scale": 1.0,
}
"""What vllm-omni samples with when the block is missing or does not read."""

FLAT_KEYS = {
    "num_inference_steps": "dmd2_num_inference_steps",
    "denoising_timesteps": "dmd2_denoising_timesteps",
    "guidance_scale": "dmd2_guidance_scale",
}
"""The nested keys' flat (top-level) names read by vllm-omni versions before its PR #2974; those
versions also read `dmd2_scheduler_shift` (written as 1.0: the shift is in the timesteps) and have no
solver key."""

FLAT_SHIFT = "dmd2_scheduler_shift"


class ServingError(ValueError):
    """An export that would not serve as trained; the message is one line."""


def dmd2_block(schedule: list[float], guidance_scale: float) -> dict[str, Any]:
    """The nested `dmd2_config` block of a student sampled at `schedule` (its levels, highest first,
    ending in 0) with guidance (embedding) `guidance_scale`."""
    if len(schedule) < 2 or schedule[-1] != 0.0:
        raise ValueError(f"schedule = {schedule}: must have at least 2 levels and end in 0")
    return {
        "num_inference_steps": len(schedule) - 1,
        "denoising_timesteps": [round(float(s) * 1000.0, 4) for s in schedule[:-1]],
        "solver": "sde",
        "guidance_scale": float(guidance_scale),
    }


def flat_keys(block: Mapping[str, Any]) -> dict[str, Any]:
    """The same block in the flat top-level form of older vllm-omni versions."""
    return {**{flat: block[key] for key, flat in FLAT_KEYS.items()}, FLAT_SHIFT: 1.0}


def index_with_block(
    index: Mapping[str, Any], block: Mapping[str, Any], class_name: str | None = None
) -> dict:
    """A pipeline's `model_index.json` carrying `block` in both forms, optionally under another class."""
    out = {k: v for k, v in index.items() if k != "dmd2_config" and not k.startswith("dmd2_")}
    out["dmd2_config"] = dict(block)
    out.update(flat_keys(block))
    if class_name is not None:
        out["_class_name"] = class_name
    return out


def vllm_omni_class(pipeline_class: str, target: str = "vllm_omni") -> str:
    """The vllm-omni DMD2 class serving a student of `pipeline_class`; ServingError (one line) if none."""
    try:
        return VLLM_OMNI_CLASSES[pipeline_class]
    except KeyError:
        raise ServingError(
            f"config key 'export.formats' lists {target}: vllm-omni has no DMD2 pipeline for a "
            f"{pipeline_class} (it has {', '.join(sorted(VLLM_OMNI_CLASSES.values()))}); fix: drop {target} and "
            "serve the pipeline format with diffusers (docs/serving.md)"
        ) from None


# --------------------------------------------------------------------------- LoRA served by vllm-omni

VLLM_OMNI_MAX_LORA_RANK = 512
"""The largest adapter rank vllm-omni's LoRA manager takes (it rounds ranks up to vllm's sizes, to 512)."""

VLLM_OMNI_LORA_UNLOADABLE = {
    "FluxPipeline": {
        "to_q": "fused into to_qkv", "to_k": "fused into to_qkv", "to_v": "fused into to_qkv",
        "add_q_proj": "fused into add_kv_proj", "add_k_proj": "fused into add_kv_proj",
        "add_v_proj": "fused into add_kv_proj",
    },
    "QwenImagePipeline": {"to_out.0": "named to_out"},
    "WanPipeline": {"to_out.0": "named to_out", "ffn.net.0.proj": "named ffn.net_0.proj",
                    "ffn.net.2": "named ffn.net_2"},
    "WanImageToVideoPipeline": {"to_out.0": "named to_out", "ffn.net.0.proj": "named ffn.net_0.proj",
                                "ffn.net.2": "named ffn.net_2"},
}  # fmt: skip
"""Per teacher pipeline class, LoRA target names (diffusers' module names, as the adapter is trained) that
vllm-omni's peft LoRA backend cannot put on its own transformer, and why: its Flux fuses q, k and v
without the mapping that splits an adapter onto the fused layer (loading fails); its Qwen-Image and Wan
rename modules, and the peft backend maps no names (those weights are dropped without a word). Read
from its code (a fork carrying the upstream merges, 2026-08-18), not run: vllm-omni cannot be installed
here."""


def _matches(target: str, name: str) -> bool:
    """Whether a PEFT target (a module name or its tail) puts an adapter on modules named `name` (a name's
    tail), or on modules `name` ends with: either way vllm-omni's loader would meet a weight it misses."""
    return target == name or target.endswith("." + name) or name.endswith("." + target)


def check_vllm_omni_lora(plan, pipeline_class: str | None, default_targets) -> None:
    """The student's LoRA (rank, targets) is one vllm-omni's loader serves as trained; ServingError (one line)
    otherwise."""
    spec = plan.model.student.lora
    targets = tuple(spec.target_modules or default_targets)
    problem = vllm_omni_lora_problem(str(pipeline_class), spec.rank, targets)
    if problem:
        raise ServingError(
            f"config key 'export.formats' lists lora_vllm_omni: {problem}; fix: serve the merged student "
            "(vllm_omni), or train on targets it places (docs/serving.md, LoRA)"
        )


def vllm_omni_lora_problem(pipeline_class: str, rank: int, targets, use_dora: bool = False) -> str | None:
    """Why vllm-omni would not serve a LoRA of `rank` on `targets` (diffusers module names) as trained on a
    `pipeline_class` student (None: it would)."""
    if rank > VLLM_OMNI_MAX_LORA_RANK:
        return f"rank {rank} is above vllm-omni's largest, {VLLM_OMNI_MAX_LORA_RANK}"
    if use_dora:
        return "vllm-omni does not load DoRA adapters"
    unloadable = VLLM_OMNI_LORA_UNLOADABLE.get(pipeline_class, {})
    missed = [name for name in unloadable if any(_matches(t, name) for t in targets)]
    if missed:
        why = ", ".join(f"{name} ({unloadable[name]})" for name in missed)
        return f"vllm-omni's {pipeline_class} LoRA loader cannot place targets {why}"
    return None


# --------------------------------------------------------------------------- reading, as vllm-omni does


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def block_problem(block: Any) -> str | None:
    """Why vllm-omni would not read `block` as we mean it (None: it reads). Stricter than their reader
    where theirs would sample something other than what the block says: a step count other than the
    timesteps' length (they do not check it) or timesteps out of order."""
    if not isinstance(block, Mapping):
        return f"dmd2_config is a {type(block).__name__}, not an object"
    unknown = sorted(set(block) - set(VLLM_OMNI_DEFAULTS))
    if unknown:
        return f"unknown key {unknown[0]!r}"
    steps = block.get("num_inference_steps", VLLM_OMNI_DEFAULTS["num_inference_steps"])
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        return f"num_inference_steps = {steps!r}: not a positive integer"
    timesteps = block.get("denoising_timesteps")
    if timesteps is None:
        return "no denoising_timesteps (vllm-omni would space its own)"
    if not isinstance(timesteps, list) or not all(_number(t) for t in timesteps):
        return f"denoising_timesteps = {timesteps!r}: not a list of numbers"
    if len(timesteps) != steps:
        return f"{len(timesteps)} denoising_timesteps for num_inference_steps = {steps}"
    if not all(0 < t <= 1000 for t in timesteps) or any(a <= b for a, b in itertools.pairwise(timesteps)):
        return f"denoising_timesteps = {timesteps}: not strictly decreasing within (0, 1000]"
    if block.get("solver", "ode") not in ("ode", "sde"):
        return f"solver = {block.get('solver')!r}: not 'ode' or 'sde'"
    guidance = block.get("guidance_scale", 1.0)
    if not _number(guidance) or guidance <= 0:
        return f"guidance_scale = {guidance!r}: not a positive number"
    return None


def read_served(index: Mapping[str, Any]) -> dict[str, Any]:
    """How vllm-omni serves the pipeline directory whose `model_index.json` is `index`:
    ``{"class": ..., "dmd2": bool, "sigmas": [...ending in 0], "stochastic": bool, "guidance_scale": ...,
    "fell_back": reason or None}``. A plain class ignores the block (dmd2 False); a DMD2 class reads the
    nested block, falling back to the defaults (with the reason) when it is missing or malformed."""
    class_name = index.get("_class_name")
    if class_name not in VLLM_OMNI_CLASSES.values():
        return {"class": class_name, "dmd2": False, "fell_back": None}
    block = index.get("dmd2_config")
    problem = "no dmd2_config" if block is None else block_problem(block)
    used = dict(VLLM_OMNI_DEFAULTS) if problem else {**VLLM_OMNI_DEFAULTS, **block}
    return {
        "class": class_name,
        "dmd2": True,
        "sigmas": [float(t) / 1000.0 for t in used["denoising_timesteps"]] + [0.0],
        "stochastic": used["solver"] == "sde",
        "guidance_scale": float(used["guidance_scale"]),
        "fell_back": problem,
    }


# --------------------------------------------------------------------------- diffusers


SCHEDULER_CLASS = "FlowMatchEulerDiscreteScheduler"


def diffusers_scheduler_config(
    source: Mapping[str, Any], shift: float, parameterization: str = "velocity"
) -> dict:
    """The teacher's scheduler config rewritten so that a pipeline call given the unshifted levels
    (Flux and Qwen-Image pass ``linspace(1, 1/N, N)`` themselves) samples the trained schedule with the
    student's re-noising sampler: static `shift`, no dynamic shifting, stochastic sampling, no other
    spacing (Karras, exponential, beta) or terminal stretch. A teacher scheduler of another class (Wan's
    UniPC) is replaced by a FlowMatchEulerDiscreteScheduler of the same training length; the pipeline's
    model_index.json must then name that class (`SCHEDULER_CLASS`)."""
    if parameterization != "velocity":
        raise ServingError(
            f"the student predicts {parameterization}, the diffusers scheduler that re-noises as it samples "
            f"({SCHEDULER_CLASS} with stochastic_sampling) reads velocity; fix: export peft or diffusers only"
        )
    base = (
        dict(source)
        if source.get("_class_name") == SCHEDULER_CLASS
        else {
            "_class_name": SCHEDULER_CLASS,
            "_diffusers_version": source.get("_diffusers_version"),
            "num_train_timesteps": int(source.get("num_train_timesteps", 1000)),
        }
    )
    return {
        **base,
        "shift": float(shift),
        "use_dynamic_shifting": False,
        "stochastic_sampling": True,
        "shift_terminal": None,
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
        "invert_sigmas": False,
    }


def constant_guidance(plan, transformer_config: Mapping[str, Any]) -> float:
    """The guidance a student serves with: 1 (no CFG: the teacher's guidance is distilled into it), or,
    for a transformer with a guidance embedding (Flux-dev), the constant `cond.guidance` it trained
    with, read from the prepared data set's manifest."""
    if not transformer_config.get("guidance_embeds", False):
        return 1.0
    from pathlib import Path

    from verl_dmd.data.prepared import DatasetError, PreparedDataset

    data = Path(plan.data.path) if getattr(plan.data, "path", None) else None
    if data is None or not PreparedDataset.is_prepared(data):
        raise ServingError(
            f"config key 'data.path' = {str(data) if data else None!r}: the student has a guidance embedding and "
            "its training guidance is read from the prepared data set's manifest; fix: export with the run's "
            "data.path (a verl-dmd-prepare data set)"
        )
    try:
        constant = PreparedDataset.open(data).intent["encoding"].get("constant_cond", {})
    except DatasetError as err:
        raise ServingError(str(err)) from None
    guidance = constant.get("guidance")
    if not _number(guidance):
        raise ServingError(
            f"{data}: the data set has no constant cond.guidance (got {guidance!r}); a guidance that varies per "
            "sample has no single serving value; fix: prepare with one prepare.guidance_embedding"
        )
    return float(guidance)
