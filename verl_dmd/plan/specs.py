"""The distillation plan's specs: every user-facing key, its default, its check, and the plan itself.

A `DistillationPlan` is built once from the hydra config (`DistillationPlan.from_config`)
and never changes. Every user-facing key is a field of a frozen dataclass below,
documented by the string that follows it (docs/configuration.md is generated from
these); unknown keys, wrong types and out-of-range values fail at build time with
one line naming the key, the value, what is allowed and the fix.

`plan.fingerprint()` hashes the fields that change what training computes. The
keys a resume may change (logging, cadences, total steps, resources, paths of
outputs, where the models lie) are listed once, in `RESUME_MUTABLE_KEYS`, and
excluded; a model named by path counts by its content instead (`model_content`).

Layer 1: no torch, no distribution, no ray, no verl.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from verl_dmd.plan.schema import (
    PlanError,
    build,
    check_float,
    check_int,
    check_types,
    error,
    flatten,
    show,
    to_plain,
    without_keys,
)

FINGERPRINT_SCHEMA = "verl_dmd.plan/1"
"""Prefixed to the canonical JSON before hashing: bump it when a field's meaning changes."""

# verl.utils.tracking.Tracking.supported_backend in verl 0.9.1 (a test keeps this in sync).
TRACKING_BACKENDS = (
    "console",
    "tensorboard",
    "wandb",
    "mlflow",
    "swanlab",
    "vemlp_wandb",
    "clearml",
    "trackio",
    "file",
    "rl_insight",
)

# Semantic keys added after checkpoints were first written, each with the value that does what verl_dmd did
# before the key existed. A checkpoint whose plan lacks such a key was trained under that value, so a plan
# holding it resumes the checkpoint (DistillationPlan.semantic_differences); any other value is a difference.
ADDED_KEYS: dict[str, Any] = {
    "algorithm.fake_score_weighting": "uniform",  # after commit 1018912: the loss was the velocity MSE
    "algorithm.gan_sigma_max": None,  # issue 21: the GAN read the phases' noise levels
    "algorithm.gan_head": "pooled",  # issue 21: the head pooled the tokens before its MLP
    "algorithm.first_exit_probability": None,  # issue 21: every exit of backward simulation equally likely
    "algorithm.regression_decay_steps": None,  # issue 21: the regression weight was constant
    "algorithm.gan_heads": "shared",  # issue 21: one discriminator head for every student step
}

GAN_ONLY_KEYS: tuple[str, ...] = ("algorithm.gan_head", "algorithm.gan_heads", "algorithm.gan_sigma_max")
"""Keys that change nothing while the GAN is off (``algorithm.gan_discriminator_weight`` 0, which the generator
term needs): between two plans that both have it off they are no difference (a checkpoint without the GAN
resumes whatever head and levels the plan names)."""

MULTI_STEP_ONLY_KEYS: tuple[str, ...] = ("algorithm.gan_heads", "algorithm.first_exit_probability")
"""Keys that change nothing for a 1-step student (``algorithm.student_steps`` 1): between two plans that both
train one step they are no difference (one GAN head, and every phase trains the only step)."""

MESH_NAMES = ("shard", "hybrid", "replicate")
"""The named FSDP2 meshes of ``model.fsdp_mesh`` (besides an explicit [replicate, shard] list)."""

MODEL_SOURCES = ("teacher", "student", "fake_score")
"""The roles whose model a plan names (``model.<role>``): by path, by config, or (student, fake score) not at
all (a copy of the teacher)."""

# A model named by path is identified by its content (model.<role>.content_sha256 in the semantic dict), not
# by where it lies. A checkpoint written before that holds no content_sha256 and was written under a plan whose
# path and subfolder were semantic: it resumes under the same path and subfolder, and only under them
# (DistillationPlan.semantic_differences).
LOCATION_KEYS: tuple[str, ...] = tuple(f"model.{role}.{name}" for role in MODEL_SOURCES
                                       for name in ("path", "subfolder"))  # fmt: skip

# Dotted keys (a key covers everything below it) that a resume may change. They
# shape logging, cadence, placement and outputs, never the sequence of updates.
# Changing the world size changes the global batch; the checkpoint manifest
# records it and a resume at another world size says so.
RESUME_MUTABLE_KEYS: tuple[str, ...] = (
    "trainer.total_steps",
    "trainer.output_dir",
    "trainer.project_name",
    "trainer.experiment_name",
    "trainer.loggers",
    "trainer.log_every",
    "trainer.max_consecutive_skips",
    "trainer.rpc_timeout_s",
    "trainer.progress_bar",
    "model.activation_checkpointing",
    "model.reshard_after_forward",
    "model.fsdp_units",
    "model.fsdp_mesh",
    "model.compile",
    "model.compile_backend",
    "model.teacher.cpu_offload",
    # Where the models lie, not what they are: the semantic dict holds their content (LOCATION_KEYS).
    *LOCATION_KEYS,
    "resources",
    "checkpoint",
    "validation",
    "export",
    # How the data set at data.path is made: the data set itself is what training reads, and the trainer
    # checks it against these keys before it starts.
    "prepare",
    # Where the teacher pairs are kept, not what they are: the file records what made it (teacher
    # content hash, steps, seed, guidance), checked on load, so a run moved to another output_dir resumes.
    "data.regression_pairs_path",
)


# --------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class LoraSpec:
    """LoRA settings of one trainable role."""

    rank: int = 0
    """LoRA rank; 0 trains the role's full weights (independent layout only)."""
    alpha: float | None = None
    """LoRA scaling numerator; None uses alpha = rank (scale 1), the common default."""
    dropout: float = 0.0
    """Dropout on the LoRA input; 0 keeps phases deterministic given the seed."""
    target_modules: tuple[str, ...] | None = None
    """Module names to adapt; None takes the model adapter's default (e.g. attention projections)."""
    init_path: str | None = None
    """A saved PEFT adapter directory to start from; its rank and alpha must match."""

    def validate(self, key: str) -> None:
        check_int(f"{key}.rank", self.rank, minimum=0)
        if self.alpha is not None:
            check_float(
                f"{key}.alpha", self.alpha, "a positive finite number or null (alpha = rank)", low=0.0
            )
        if not 0.0 <= self.dropout < 1.0:
            raise error(f"{key}.dropout", self.dropout, "must be in [0, 1)")
        if self.target_modules is not None:
            if not self.target_modules:
                raise error(
                    f"{key}.target_modules",
                    list(self.target_modules),
                    "must be a non-empty list of module names or null",
                    "set null to use the model adapter's default targets",
                )
            for i, name in enumerate(self.target_modules):
                if not name:
                    raise error(f"{key}.target_modules[{i}]", name, "must be a non-empty module name")
        if self.rank == 0 and (self.alpha is not None or self.target_modules is not None or self.init_path):
            raise error(
                f"{key}.rank",
                0,
                "LoRA options are set but rank 0 means full-weight training",
                "set a rank >= 1",
            )
        if self.init_path is not None and not self.init_path:
            raise error(f"{key}.init_path", self.init_path, "must be a PEFT adapter directory or null")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass(frozen=True)
class TeacherSpec:
    """Where the teacher (and, in the shared layout, the base carrying the adapters) comes from."""

    path: str | None = None
    """Local diffusers model directory (nothing is ever downloaded); the run counts the model by its content
    (content_sha256), not by where it lies."""
    subfolder: str | None = None
    """Subfolder of `path` holding the denoiser, e.g. "transformer" in a pipeline directory."""
    config: Mapping[str, Any] | None = None
    """A model config to build a randomly initialised model (tests and benchmarks)."""
    content_sha256: str | None = None
    """With path: the model's identity by content (SHA-256 of its weights and config.json), which the plan's
    fingerprint holds instead of path and subfolder, so a teacher moved elsewhere resumes and a changed one
    does not. null: read from path when first needed; set: the model there must have it (checked before
    the run starts). The driver sets it for the workers, so none of them hashes the model again."""
    cpu_offload: bool = False
    """Keep the frozen weights on the host with FSDP2 CPU offload (saves device memory, costs copies)."""

    def validate(self, key: str) -> None:
        _check_source(key, self.path, self.subfolder, self.config, self.content_sha256, required=True)


@dataclass(frozen=True)
class TrainableModelSpec:
    """Where a trainable role (student, fake score) comes from and how it is adapted."""

    path: str | None = None
    """Independent layout: local diffusers directory to start from; null starts from the teacher's weights."""
    subfolder: str | None = None
    """Subfolder of `path` holding the denoiser."""
    config: Mapping[str, Any] | None = None
    """Independent layout: a model config to build this role from (random init); null copies the teacher."""
    content_sha256: str | None = None
    """With path: the starting model's identity by content, as model.teacher.content_sha256."""
    lora: LoraSpec = field(default_factory=LoraSpec)
    """LoRA settings; required (rank >= 1) in the shared-base layout."""

    def validate(self, key: str) -> None:
        _check_source(key, self.path, self.subfolder, self.config, self.content_sha256, required=False)
        self.lora.validate(f"{key}.lora")


@dataclass(frozen=True)
class ModelSpec:
    """The model family, the storage layout of the roles, and numerics."""

    adapter: str = ""
    """Registered model-adapter name (e.g. dit, sd3, flux, qwen_image, wan); see `verl_dmd.adapters`."""
    storage: Literal["shared_base_adapters", "independent"] = "shared_base_adapters"
    """shared_base_adapters: LoRA roles on one frozen base (teacher = adapters off); independent: own copies."""
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """FSDP2 compute dtype of parameters; bfloat16 on GPUs, float32 for exact CPU tests. Frozen weights are
    stored in it (they enter compute rounded to it anyway); trainable ones keep float32 masters."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Gradient reduction dtype; float32 keeps small LoRA gradients from rounding away."""
    activation_checkpointing: bool = False
    """Recompute block activations in backward to save memory (same math)."""
    fsdp_units: Literal["blocks", "model"] = "blocks"
    """FSDP2 units: blocks (each transformer block, as the adapter lists them) or model (one per model:
    fewer, larger all-gathers; for small models and slow interconnects). Same math."""
    fsdp_mesh: str | tuple[int, ...] = "shard"
    """The FSDP2 device mesh: shard (every parameter sharded over all ranks); hybrid (HSDP: sharded within
    a node over resources.workers_per_node ranks, replicated across the resources.nnodes nodes, so the
    gathers stay on a node's fast links); replicate (every rank holds whole models and the gradients are
    all-reduced, as DDP does: no gathers at all, for models whose gathers cost more than the memory they
    save); or [replicate, shard], whose product is the world size. Every rank is data-parallel either
    way: same math. Checkpoints do not depend on it (a run saved with one mesh resumes with another)."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered block weights after each forward (the root keeps its own until backward); false
    keeps every unit's until the phase ends (same math, fewer all-gathers, more memory: in the independent
    layout every model a phase uses stays gathered, the CPU-offloaded teacher's weights included)."""
    compile: bool = False
    """torch.compile each FSDP2 unit's forward (the transformer blocks; not the hooks around them): fuses
    the elementwise work between matmuls and cuts kernel launches. Numerics change by rounding only; the
    first phases of each role pay the compilation (about a minute for SD3-medium on an H200)."""
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """The torch.compile backend when model.compile is on (aot_eager, eager: no code generation; for tests
    and debugging)."""
    teacher: TeacherSpec = field(default_factory=TeacherSpec)
    student: TrainableModelSpec = field(default_factory=TrainableModelSpec)
    fake_score: TrainableModelSpec = field(default_factory=TrainableModelSpec)

    def validate(self, key: str) -> None:
        if not self.adapter:
            raise error(
                f"{key}.adapter",
                self.adapter,
                "must name a registered model adapter",
                "set model.adapter (e.g. dit, sd3, flux, qwen_image, wan)",
            )
        self.teacher.validate(f"{key}.teacher")
        mesh = self.fsdp_mesh
        fix = f"set {key}.fsdp_mesh to shard, hybrid, replicate or [replicate, shard], e.g. [2, 4]"
        if isinstance(mesh, str) and mesh not in MESH_NAMES:
            close = difflib.get_close_matches(mesh.lower(), MESH_NAMES, n=1)
            raise error(f"{key}.fsdp_mesh", mesh, "allowed: shard, hybrid, replicate, or [replicate, shard] ranks",
                        f"did you mean {close[0]!r}?" if close else fix)  # fmt: skip
        if isinstance(mesh, tuple):
            if len(mesh) != 2:
                raise error(
                    f"{key}.fsdp_mesh", list(mesh), "a list must hold 2 sizes: [replicate, shard]", fix
                )
            for i, size in enumerate(mesh):
                if size < 1:
                    raise error(
                        f"{key}.fsdp_mesh[{i}]",
                        size,
                        "must be >= 1 ([replicate, shard] ranks)",
                        f"give positive sizes whose product is the world size, or set {key}.fsdp_mesh=shard",
                    )
        for role in ("student", "fake_score"):
            spec: TrainableModelSpec = getattr(self, role)
            spec.validate(f"{key}.{role}")
            if self.storage == "shared_base_adapters":
                for name in ("path", "subfolder", "config"):
                    if getattr(spec, name) is not None:
                        raise error(
                            f"{key}.{role}.{name}",
                            getattr(spec, name),
                            "the shared_base_adapters layout keeps every role on the teacher's base",
                            f"remove {key}.{role}.{name} or set {key}.storage=independent",
                        )
                if not spec.lora.enabled:
                    raise error(
                        f"{key}.{role}.lora.rank",
                        spec.lora.rank,
                        "the shared_base_adapters layout trains LoRA adapters, so rank must be >= 1",
                        f"set {key}.{role}.lora.rank (e.g. 32) or {key}.storage=independent",
                    )


@dataclass(frozen=True)
class AlgorithmSpec:
    """The distillation method and its hyper-parameters (DMD2's; conventions in docs/dmd2.md)."""

    name: str = "dmd2"
    """Registered distillation method (`verl_dmd.algorithms`): dmd2 is built in; a package adds others
    through the verl_dmd.algorithms entry-point group."""
    fake_update_ratio: int = 5
    """K: fake-score phases per student phase (two time-scale rule); DMD2 runs 5 or 10."""
    fake_warmup_steps: int = 0
    """Fake-score-only optimizer steps before the first student phase."""
    teacher_guidance_scale: float = 1.0
    """CFG scale s of the teacher; 1 disables guidance (DMD2 SDXL: 8)."""
    cfg_form: Literal["standard", "conditional_offset"] = "standard"
    """standard: u + s(c - u). conditional_offset: c + s(c - u), which equals standard at s + 1."""
    dmd_normalizer: Literal["per_sample", "batch_global"] = "per_sample"
    """Scope of the mean |x - x0_real| that divides the DMD gradient."""
    dmd_normalizer_eps: float = 1e-6
    """Floor of that mean, so identical samples do not divide by zero."""
    sigma_min: float = 0.02
    """Lower end of the uniform noise level for the student phase's DMD term."""
    sigma_max: float = 0.98
    """Upper end of that range."""
    fake_sigma_min: float = 0.0
    """Lower end of the noise level of the fake-score denoising loss."""
    fake_sigma_max: float = 1.0
    """Upper end of that range."""
    sigma_shift: float = 1.0
    """Timestep shift s applied to sampled noise levels and the default student schedule (SD3: 3)."""
    student_steps: int = 1
    """Sampling steps of the distilled student (1 to 4 in published work)."""
    student_sigmas: tuple[float, ...] | None = None
    """Explicit student noise levels, strictly decreasing in (0, 1]; null: evenly spaced from 1, then shifted."""
    backward_simulation: bool = True
    """Multi-step students: train on states the student itself reaches (DMD2), not on noised data."""
    first_exit_probability: float | None = None
    """Multi-step students (backward simulation): the chance that a phase trains the first step (the 1-step
    output: its DMD term, the fake score and GAN on its samples); the later steps share the rest evenly.
    null: every step equally likely (DMD2). A 1-step student trains its only step in every phase, whatever
    this says (so a recipe may set it and still be run with student_steps=1)."""
    gan_generator_weight: float = 0.0
    """Weight of the GAN generator term (DMD2: 1e-3 to 5e-3); needs gan_discriminator_weight > 0."""
    gan_discriminator_weight: float = 0.0
    """Weight of the GAN discriminator term in fake-score phases (DMD2: 1e-2); > 0 adds a head on fake-score
    features, trained with the fake score, and needs real data from the data provider (batch keys real.*)."""
    gan_sigma_max: float | None = None
    """The GAN's own noise levels (diffusion GAN): uniform in [0, gan_sigma_max] (then sigma_shift), drawn
    afresh for the discriminator's fake and real inputs and for the generator term; null: the discriminator
    reads the fake-score phase's levels and the generator term the DMD term's."""
    gan_head: Literal["conv", "pooled"] = "conv"
    """The discriminator head: conv (the features' tokens on their grid, stride-2 convolutions, so it sees where
    things are, as DMD2's convolutional heads) or pooled (mean over tokens first, then an MLP: the head before
    issue 21, which measured near chance on digits; docs/dmd2.md)."""
    gan_heads: Literal["shared", "per_exit_group"] = "shared"
    """shared: one discriminator head for the samples of every student step; per_exit_group (multi-step
    students): one head for the first step's samples (the 1-step output) and another for the later steps',
    each trained and read only by the micro-batches that draw its steps (the fake score under them is shared; the
    second head is the fake score's submodule dmd_gan_head_later). A 1-step student has the one head either
    way."""
    regression_weight: float = 0.0
    """Weight of the DMD v1 regression term on paired teacher data; needs data.regression_pairs_path."""
    regression_decay_steps: int | None = None
    """The regression weight falls linearly to 0 over this many student steps (regression_weight x
    max(0, 1 - step / N), steps counted from 1; the term is not computed once it is 0, so 1 turns it off);
    with regression_weight 0 it does nothing (the term is off); null: constant."""
    fake_score_weighting: Literal["uniform", "dmd2_sd", "edm"] = "uniform"
    """The fake-score denoising loss: uniform (MSE of the model's own prediction, velocity for the flow
    families); dmd2_sd (MSE of the predicted noise, as DMD2's SD/SDXL code); edm (DMD2's ImageNet/EDM
    code: error of the x0 estimate weighted 1/sigma_ve^2 + 1/0.5^2); docs/dmd2.md has the formulas."""

    def validate(self, key: str) -> None:
        if not self.name:
            raise error(f"{key}.name", self.name, "must name a registered distillation method",
                        f"set {key}.name (e.g. dmd2)")  # fmt: skip
        check_int(
            f"{key}.fake_update_ratio",
            self.fake_update_ratio,
            minimum=1,
            fix=f"set {key}.fake_update_ratio to a positive integer (DMD2: 5)",
        )
        check_int(f"{key}.fake_warmup_steps", self.fake_warmup_steps, minimum=0)
        check_float(
            f"{key}.teacher_guidance_scale",
            self.teacher_guidance_scale,
            "a finite number >= 0",
            low=0.0,
            closed=True,
        )
        check_float(f"{key}.dmd_normalizer_eps", self.dmd_normalizer_eps, "a positive finite number", low=0.0)
        for lo_name, hi_name in (("sigma_min", "sigma_max"), ("fake_sigma_min", "fake_sigma_max")):
            lo, hi = getattr(self, lo_name), getattr(self, hi_name)
            for name, value in ((lo_name, lo), (hi_name, hi)):
                if not (math.isfinite(value) and 0.0 <= value <= 1.0):
                    raise error(f"{key}.{name}", value, "must be a noise level in [0, 1]")
            if lo > hi:
                raise error(f"{key}.{lo_name}", lo, f"must be <= {key}.{hi_name} = {hi}")
        check_float(
            f"{key}.sigma_shift", self.sigma_shift, "a positive finite number (1 = no shift)", low=0.0
        )
        check_int(f"{key}.student_steps", self.student_steps, minimum=1)
        if self.student_sigmas is not None:
            sigmas = self.student_sigmas
            if len(sigmas) != self.student_steps:
                raise error(
                    f"{key}.student_sigmas",
                    list(sigmas),
                    f"must hold exactly {key}.student_steps = {self.student_steps} values",
                    "give one noise level per student step, or null for the default schedule",
                )
            for i, value in enumerate(sigmas):
                if not (math.isfinite(value) and 0.0 < value <= 1.0):
                    raise error(f"{key}.student_sigmas[{i}]", value, "must be a noise level in (0, 1]")
                if i and value >= sigmas[i - 1]:
                    raise error(
                        f"{key}.student_sigmas[{i}]",
                        value,
                        f"must be < the previous value {sigmas[i - 1]} (strictly decreasing)",
                    )
        if self.first_exit_probability is not None:
            p = self.first_exit_probability
            if isinstance(p, bool) or not (
                isinstance(p, (int, float)) and math.isfinite(p) and 0.0 <= p <= 1.0
            ):
                raise error(
                    f"{key}.first_exit_probability", p, "must be a probability in [0, 1] or null",
                    "e.g. 0.75, or null for every step equally likely",
                )  # fmt: skip
        if self.regression_decay_steps is not None:
            check_int(
                f"{key}.regression_decay_steps",
                self.regression_decay_steps,
                minimum=1,
                fix=f"give a number of student steps, or null for a constant {key}.regression_weight",
            )
            # with regression_weight 0 the decay has nothing to decay: allowed, so that turning the term off in
            # a recipe that decays it (the digits default) is one override
        for name in ("gan_generator_weight", "gan_discriminator_weight", "regression_weight"):
            check_float(
                f"{key}.{name}",
                getattr(self, name),
                "a finite number >= 0 (0 disables)",
                low=0.0,
                closed=True,
            )
        if self.gan_sigma_max is not None and not (
            math.isfinite(self.gan_sigma_max) and 0.0 < self.gan_sigma_max <= 1.0
        ):
            raise error(f"{key}.gan_sigma_max", self.gan_sigma_max, "must be a noise level in (0, 1] or null")
        if self.gan_generator_weight > 0 and self.gan_discriminator_weight == 0:
            raise error(
                f"{key}.gan_generator_weight",
                self.gan_generator_weight,
                "the GAN generator term needs a trained discriminator",
                f"set {key}.gan_discriminator_weight > 0 (DMD2: 1e-2) or the generator weight to 0",
            )


@dataclass(frozen=True)
class SchedulerSpec:
    """Learning-rate schedule of one optimizer, in that optimizer's own steps."""

    name: Literal["constant", "warmup_constant", "warmup_cosine"] = "constant"
    """constant; warmup_constant (linear warmup then flat); warmup_cosine (then cosine to min_lr_ratio)."""
    warmup_steps: int = 0
    """Linear warmup length in optimizer steps."""
    decay_steps: int = 0
    """warmup_cosine only: cosine length after warmup (fixed here so that total_steps may change on resume)."""
    min_lr_ratio: float = 0.0
    """warmup_cosine only: final lr as a fraction of lr."""

    def validate(self, key: str) -> None:
        check_int(f"{key}.warmup_steps", self.warmup_steps, minimum=0)
        check_int(f"{key}.decay_steps", self.decay_steps, minimum=0)
        if not (math.isfinite(self.min_lr_ratio) and 0.0 <= self.min_lr_ratio <= 1.0):
            raise error(f"{key}.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        if self.name == "constant" and self.warmup_steps:
            raise error(
                f"{key}.warmup_steps",
                self.warmup_steps,
                "the constant schedule has no warmup",
                f"set {key}.name=warmup_constant or {key}.warmup_steps=0",
            )
        if self.name == "warmup_constant" and not self.warmup_steps:
            raise error(
                f"{key}.warmup_steps",
                0,
                "warmup_constant needs warmup_steps >= 1",
                f"set it, or {key}.name=constant",
            )
        if self.name == "warmup_cosine" and not self.decay_steps:
            raise error(
                f"{key}.decay_steps",
                0,
                "warmup_cosine needs decay_steps >= 1 (the cosine length after warmup)",
                f"set {key}.decay_steps",
            )
        if self.name != "warmup_cosine" and (self.decay_steps or self.min_lr_ratio):
            raise error(
                f"{key}.name",
                self.name,
                "decay_steps and min_lr_ratio apply only to warmup_cosine",
                f"set {key}.name=warmup_cosine or remove them",
            )


@dataclass(frozen=True)
class OptimSpec:
    """AdamW of one trainable role (a GAN head, if any, joins the fake-score optimizer)."""

    lr: float = 5e-5
    """Peak learning rate; DMD2's LoRA runs use 5e-5 for both roles."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas; Self-Forcing uses (0, 0.999)."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay (DMD2: 0.01)."""
    grad_clip: float = 10.0
    """Max global gradient norm (DMD2: 10); 0 disables clipping (the norm is still computed and checked)."""
    scheduler: SchedulerSpec = field(default_factory=SchedulerSpec)

    def validate(self, key: str) -> None:
        check_float(f"{key}.lr", self.lr, "a positive finite number", low=0.0)
        for i, beta in enumerate(self.betas):
            if not (math.isfinite(beta) and 0.0 <= beta < 1.0):
                raise error(f"{key}.betas[{i}]", beta, "must be in [0, 1)")
        check_float(f"{key}.eps", self.eps, "a positive finite number", low=0.0)
        check_float(f"{key}.weight_decay", self.weight_decay, "a finite number >= 0", low=0.0, closed=True)
        check_float(
            f"{key}.grad_clip", self.grad_clip, "a finite number >= 0 (0 disables)", low=0.0, closed=True
        )
        self.scheduler.validate(f"{key}.scheduler")


@dataclass(frozen=True)
class RoleOptimSpecs:
    student: OptimSpec = field(default_factory=OptimSpec)
    fake_score: OptimSpec = field(default_factory=OptimSpec)


@dataclass(frozen=True)
class BatchSpec:
    """Per-rank batch of one phase: micro_batch_size x accumulation_steps samples."""

    micro_batch_size: int = 8
    """Samples per forward/backward on one rank."""
    accumulation_steps: int = 1
    """Micro-batches accumulated into one optimizer step."""

    def validate(self, key: str) -> None:
        check_int(f"{key}.micro_batch_size", self.micro_batch_size, minimum=1)
        check_int(f"{key}.accumulation_steps", self.accumulation_steps, minimum=1)


@dataclass(frozen=True)
class RoleBatchSpecs:
    student: BatchSpec = field(default_factory=BatchSpec)
    fake_score: BatchSpec = field(default_factory=BatchSpec)


@dataclass(frozen=True)
class EmaSpec:
    """Exponential moving average of the student (the `student_ema` role)."""

    enabled: bool = True
    """Keep an EMA of the student; published runs sample from it."""
    decay: float = 0.999
    """EMA decay per successful student step (published: 0.99 to 0.999)."""
    start_step: int = 0
    """First global step (student optimizer steps) that updates the EMA; before it the EMA copies the student."""

    def validate(self, key: str) -> None:
        if not (math.isfinite(self.decay) and 0.0 < self.decay < 1.0):
            raise error(f"{key}.decay", self.decay, "must be in (0, 1)", "use 0.99 to 0.999")
        check_int(f"{key}.start_step", self.start_step, minimum=0)


@dataclass(frozen=True)
class DataSpec:
    """The conditioning (and real-data) source."""

    name: str = ""
    """Registered data provider (e.g. digits, embeddings)."""
    path: str | None = None
    """Local data location for providers that read files (precomputed embeddings)."""
    shuffle: bool = True
    """Reshuffle each epoch with a seed derived from trainer.seed and the epoch."""
    regression_pairs_path: str | None = None
    """Paired (noise, teacher sample) data for the regression term."""

    def validate(self, key: str) -> None:
        if not self.name:
            raise error(f"{key}.name", self.name, "must name a data provider", "set data.name (e.g. digits)")
        if self.name == "embeddings" and not self.path:
            raise error(
                f"{key}.path",
                self.path,
                "the embeddings provider reads precomputed embeddings",
                "set data.path to a safetensors file or directory (docs/quickstart.md)",
            )


@dataclass(frozen=True)
class TrainerSpec:
    """The driver loop."""

    total_steps: int = 1000
    """Stop after this many successful student optimizer steps (global steps)."""
    seed: int = 0
    """Seed of every random stream (data order, noise, init); part of the fingerprint."""
    output_dir: str = "outputs"
    """Where logs, samples, checkpoints (unless checkpoint.root) and exports go."""
    project_name: str = "verl_dmd"
    """Tracking project name."""
    experiment_name: str = "dmd2"
    """Tracking run name."""
    loggers: tuple[str, ...] = ("console",)
    """verl Tracking backends (console, tensorboard, wandb, ...)."""
    log_every: int = 1
    """Log metrics every N global steps."""
    max_consecutive_skips: int = 20
    """Stop with an error after this many consecutive non-finite phases; 0 never stops."""
    rpc_timeout_s: float = 1800.0
    """A worker call not answered within this many seconds ends the run with an error."""
    progress_bar: bool = True
    """Show a progress bar (step, phase, losses, throughput)."""

    def validate(self, key: str) -> None:
        check_int(f"{key}.total_steps", self.total_steps, minimum=1)
        check_int(f"{key}.seed", self.seed, minimum=0)
        check_int(f"{key}.log_every", self.log_every, minimum=1)
        check_int(f"{key}.max_consecutive_skips", self.max_consecutive_skips, minimum=0)
        check_float(
            f"{key}.rpc_timeout_s", self.rpc_timeout_s, "a positive finite number of seconds", low=0.0
        )
        if not self.output_dir:
            raise error(f"{key}.output_dir", self.output_dir, "must be a directory path")
        if not self.loggers:
            raise error(f"{key}.loggers", [], "must list at least one backend", "use [console]")
        for i, backend in enumerate(self.loggers):
            if backend not in TRACKING_BACKENDS:
                raise error(f"{key}.loggers[{i}]", backend, f"allowed: {', '.join(TRACKING_BACKENDS)}")


@dataclass(frozen=True)
class ResourceSpec:
    """Where workers run."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: cuda when torch sees a GPU, else cpu."""
    nnodes: int = 1
    """Nodes in the ray cluster used."""
    workers_per_node: int = 1
    """Workers (ranks) per node; one per GPU on GPU machines."""
    sleep_between_phases: bool = False
    """Move every role's state to (pinned) host memory after each phase and back before the next,
    freeing device memory for colocated work between phases (same math)."""
    offload_packing: bool = True
    """How sleep/wake lays the state out on a GPU: true packs it into few device segments (wake in
    64 MB runs from a private pool; small tensors coalesced into shared buffers at the first sleep),
    so a sleep returns memory to the driver fast; false leaves the caching allocator's own layout
    (slower release, no tensor re-pointed). Same math either way."""
    deterministic: bool = False
    """Deterministic kernels on the workers: torch.use_deterministic_algorithms (ops with a deterministic
    variant use it, the attention backward included; an op without one stops the run with an error naming
    it), cuDNN deterministic without autotuning, and CUBLAS_WORKSPACE_CONFIG=:4096:8 where unset. Costs
    speed; meant to make two runs of a GPU plan (and a resumed run against an uninterrupted one) equal bit
    for bit."""

    def validate(self, key: str) -> None:
        check_int(f"{key}.nnodes", self.nnodes, minimum=1)
        check_int(f"{key}.workers_per_node", self.workers_per_node, minimum=1)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.workers_per_node


@dataclass(frozen=True)
class CheckpointSpec:
    """Composite checkpoints and resume."""

    root: str | None = None
    """Checkpoint directory; null means <trainer.output_dir>/checkpoints."""
    save_every: int = 0
    """Save every N global steps; 0 saves only at the end and on SIGTERM/SIGINT."""
    keep_last: int = 3
    """Keep the newest N checkpoints; 0 keeps all."""
    keep_every: int = 0
    """Also keep every checkpoint whose global step is a multiple of N; 0 disables."""
    resume: str = "auto"
    """auto (the newest intact checkpoint, if any; an error when checkpoints exist and none is intact),
    disable (start afresh), a checkpoint directory, or a checkpoint root (its newest intact one)."""
    verify_hashes: bool = True
    """Check every file's SHA-256 while it is read on load (no second pass; sizes are always checked)."""

    def validate(self, key: str) -> None:
        check_int(f"{key}.save_every", self.save_every, minimum=0)
        check_int(f"{key}.keep_last", self.keep_last, minimum=0)
        check_int(f"{key}.keep_every", self.keep_every, minimum=0)
        if not self.resume:
            raise error(
                f"{key}.resume", self.resume, "allowed: auto, disable, or a checkpoint directory path"
            )
        if self.root is not None and not self.root:
            raise error(f"{key}.root", self.root, "must be a directory path or null")


@dataclass(frozen=True)
class ValidationSpec:
    """Sampling and quality metrics during training."""

    name: str = ""
    """Registered validator; empty: the data provider's own (digits: the quality table; embeddings: none)."""
    every: int = 0
    """Validate every N global steps; 0 only at the end."""
    num_samples: int = 64
    """Samples per validated role and step count."""
    sampling_steps: tuple[int, ...] = (1,)
    """Student step counts to sample with."""
    roles: tuple[Literal["student", "student_ema", "teacher"], ...] = ("student", "student_ema")
    """Roles to sample from."""
    teacher_steps: int = 28
    """Euler steps of the teacher's samples in the decoded (pipeline) validation, with its CFG and shift
    algorithm.sigma_shift: the reference the students' samples are compared with (the digits table has
    its own fixed 1 to 32)."""
    replica: bool = True
    """Decoded (pipeline) validation samples each student role through the inference replica, a diffusers
    pipeline of the family on rank 0 that a weight sync of the role updates first (the record names the
    version sampled); false samples the training engine's roles directly, split over the ranks."""

    def validate(self, key: str) -> None:
        check_int(f"{key}.every", self.every, minimum=0)
        check_int(f"{key}.num_samples", self.num_samples, minimum=1)
        if not self.sampling_steps:
            raise error(f"{key}.sampling_steps", [], "must list at least one step count")
        for i, steps in enumerate(self.sampling_steps):
            check_int(f"{key}.sampling_steps[{i}]", steps, minimum=1)
        if not self.roles:
            raise error(f"{key}.roles", [], "must list at least one role")
        check_int(f"{key}.teacher_steps", self.teacher_steps, minimum=1)


@dataclass(frozen=True)
class ExportSpec:
    """What `verl-dmd export` writes from a checkpoint."""

    role: Literal["student", "student_ema"] = "student_ema"
    """The role to export; the EMA is what published runs ship."""
    formats: tuple[
        Literal["peft", "diffusers", "pipeline", "vllm_omni", "lora_pipeline", "lora_vllm_omni"], ...
    ] = ("peft", "diffusers")
    """peft: adapter directory; diffusers: merged model via save_pretrained; pipeline: the teacher's pipeline
    with the student, served by diffusers at the trained schedule; vllm_omni: the same under vllm-omni's DMD2
    class (Flux, Qwen-Image, Wan); lora_pipeline, lora_vllm_omni: the teacher's pipeline (linked) with the
    trained schedule, to serve the peft adapter on; docs/serving.md."""
    output_dir: str | None = None
    """null means <trainer.output_dir>/export."""
    pipeline_source: str | None = None
    """Local diffusers pipeline directory (the teacher's) that the pipeline format copies, student merged in."""
    at_end: bool = True
    """Export the final checkpoint when training completes (verl-dmd-export does it later otherwise)."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """The merged model's weights (diffusers, pipeline, vllm_omni): bfloat16, as released distilled models
    ship (half the disk and IO), or float32; each weight is merged in float32, then rounded once. The
    peft adapter keeps the trained dtype."""

    def validate(self, key: str) -> None:
        if self.dtype not in ("bfloat16", "float32"):
            raise error(
                f"{key}.dtype", self.dtype, "must be bfloat16 or float32", f"set {key}.dtype=bfloat16"
            )
        if not self.formats:
            raise error(
                f"{key}.formats",
                [],
                "must list at least one of: peft, diffusers, pipeline, vllm_omni, "
                "lora_pipeline, lora_vllm_omni",
            )
        if len(set(self.formats)) != len(self.formats):
            raise error(f"{key}.formats", list(self.formats), "lists a format twice", "list each format once")
        for needs in ("pipeline", "vllm_omni", "lora_pipeline", "lora_vllm_omni"):
            if needs in self.formats and not self.pipeline_source:
                raise error(
                    f"{key}.pipeline_source",
                    self.pipeline_source,
                    f"the {needs} format copies a local diffusers pipeline directory",
                    f"set {key}.pipeline_source to the teacher's pipeline directory, or drop {needs} from "
                    f"{key}.formats",
                )


@dataclass(frozen=True)
class PrepareSpec:
    """How `verl-dmd-prepare` makes the data set at data.path; a run checks its data set against these.

    Prompts (and optionally captioned images and teacher pairs) are encoded with the pipeline at
    model.teacher.path (docs/quickstart.md section 5). Before any worker starts, the trainer checks
    the data set at data.path against these keys and the pipeline (class, encoder weights,
    resolution, frames, text settings)."""

    prompts: str | None = None
    """The prompt source: a text file (one prompt a line), JSONL (a prompt_field per line) or parquet (the
    prompt_field column)."""
    prompt_field: str = "prompt"
    """The JSONL field or parquet column that holds the prompt."""
    validation_prompts: str | None = None
    """Prompts of the validation samples (same formats); null: the first validation.num_samples prompts."""
    negative_prompt: str = ""
    """The unconditional (negative) prompt encoded for classifier-free guidance; "" as pipelines default."""
    resolution: tuple[int, int] | None = None
    """[height, width] of the images (video frames) the latents are for; required by prepare."""
    num_frames: int | None = None
    """Frames per video (Wan: 4k + 1, e.g. 81); null for image families."""
    max_sequence_length: int | None = None
    """Text tokens kept per prompt; null: what a request to the pipeline gets, its __call__'s default
    (SD3 256, Flux 512, Qwen-Image 512, Wan 512)."""
    guidance_embedding: float | None = None
    """Flux-dev's guidance-embedding value, written as cond.guidance; null: FluxPipeline's default 3.5.
    Ignored by families without a guidance embedding."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """The encoders' (and VAE's, teacher's) dtype, hence the stored embeddings' dtype; bf16 as served."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: cuda when torch sees a GPU (under torchrun: the rank's GPU), else cpu."""
    batch_size: int = 16
    """Prompts (images) per encoder call."""
    shard_size: int = 1024
    """Prompts per shard file (a multiple of batch_size); a stopped run resumes at the first missing shard."""
    real_images: str | None = None
    """A folder of captioned images (x.png + x.txt, or .jpg/.jpeg/.webp; videos as animated .gif/.webp)
    encoded by the VAE to real.x0 for the GAN terms; null: none."""
    image_transform: Literal["center_crop", "resize"] = "center_crop"
    """center_crop: scale the short side to the resolution, crop the middle; resize: stretch to it."""
    teacher_pairs: bool = False
    """Also sample the regression term's pairs: per prompt, noise -> the teacher's pair_steps Euler sample
    with its CFG (algorithm.teacher_guidance_scale, shift algorithm.sigma_shift)."""
    pair_steps: int = 28
    """Euler steps of the teacher samples (teacher_pairs)."""

    def validate(self, key: str) -> None:
        if self.resolution is not None:
            for i, value in enumerate(self.resolution):
                check_int(f"{key}.resolution[{i}]", value, minimum=1)
        if self.num_frames is not None:
            check_int(f"{key}.num_frames", self.num_frames, minimum=1)
        if self.max_sequence_length is not None:
            check_int(f"{key}.max_sequence_length", self.max_sequence_length, minimum=1)
        if self.guidance_embedding is not None:
            check_float(f"{key}.guidance_embedding", self.guidance_embedding, "a finite number >= 0", low=0.0,
                        closed=True)  # fmt: skip
        check_int(f"{key}.batch_size", self.batch_size, minimum=1)
        check_int(f"{key}.shard_size", self.shard_size, minimum=1)
        if self.shard_size % self.batch_size:
            raise error(f"{key}.shard_size", self.shard_size, f"must be a multiple of {key}.batch_size "
                        f"({self.batch_size}): batches never cross shards, so a resumed run encodes alike",
                        f"e.g. {key}.shard_size={self.batch_size * max(1, round(self.shard_size / self.batch_size))}")  # fmt: skip
        check_int(f"{key}.pair_steps", self.pair_steps, minimum=1)
        if not self.prompt_field:
            raise error(f"{key}.prompt_field", self.prompt_field, "must name a JSONL field or parquet column")


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class DistillationPlan:
    """Everything one distillation run needs to know, validated and frozen."""

    algorithm: AlgorithmSpec = field(default_factory=AlgorithmSpec)
    model: ModelSpec = field(default_factory=ModelSpec)
    optim: RoleOptimSpecs = field(default_factory=RoleOptimSpecs)
    batch: RoleBatchSpecs = field(default_factory=RoleBatchSpecs)
    ema: EmaSpec = field(default_factory=EmaSpec)
    data: DataSpec = field(default_factory=DataSpec)
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    resources: ResourceSpec = field(default_factory=ResourceSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    validation: ValidationSpec = field(default_factory=ValidationSpec)
    export: ExportSpec = field(default_factory=ExportSpec)
    prepare: PrepareSpec = field(default_factory=PrepareSpec)

    SECTIONS: ClassVar[tuple[str, ...]] = (
        "algorithm",
        "model",
        "optim",
        "batch",
        "ema",
        "data",
        "trainer",
        "resources",
        "checkpoint",
        "validation",
        "export",
        "prepare",
    )

    def __post_init__(self) -> None:
        check_types(self, "")
        self.algorithm.validate("algorithm")
        self.model.validate("model")
        for role in ("student", "fake_score"):
            getattr(self.optim, role).validate(f"optim.{role}")
            getattr(self.batch, role).validate(f"batch.{role}")
        self.ema.validate("ema")
        self.data.validate("data")
        self.trainer.validate("trainer")
        self.resources.validate("resources")
        self.checkpoint.validate("checkpoint")
        self.validation.validate("validation")
        self.export.validate("export")
        self.prepare.validate("prepare")
        self._validate_across_sections()

    def _validate_across_sections(self) -> None:
        mesh = self.model.fsdp_mesh
        if isinstance(mesh, tuple) and mesh[0] * mesh[1] != self.resources.world_size:
            raise error(
                "model.fsdp_mesh",
                list(mesh),
                f"[replicate, shard] must multiply to the world size, resources.nnodes x "
                f"resources.workers_per_node = {self.resources.world_size}",
                "change the sizes or the resources, or set model.fsdp_mesh=hybrid (shard within a node) or replicate",
            )
        # The embeddings provider reads its pairs from the prepared data set (prepare.teacher_pairs) and
        # checks that they are there itself.
        pairs_in_data = self.data.name == "embeddings"
        if self.algorithm.regression_weight > 0 and not self.data.regression_pairs_path and not pairs_in_data:
            raise error(
                "data.regression_pairs_path",
                self.data.regression_pairs_path,
                "algorithm.regression_weight > 0 needs paired (noise, teacher sample) data",
                "set data.regression_pairs_path or algorithm.regression_weight=0",
            )
        if self.export.role == "student_ema" and not self.ema.enabled:
            raise error(
                "export.role",
                self.export.role,
                "ema.enabled is false, so there is no student_ema to export",
                "set export.role=student or ema.enabled=true",
            )
        if "student_ema" in self.validation.roles and not self.ema.enabled:
            raise error(
                "validation.roles",
                list(self.validation.roles),
                "ema.enabled is false, so student_ema cannot be sampled",
                "remove student_ema from validation.roles or set ema.enabled=true",
            )
        digits_table = self.validation.name == "digits" or (
            not self.validation.name and self.data.name == "digits"
        )
        if digits_table and self.validation.num_samples < 10:
            raise error(
                "validation.num_samples",
                self.validation.num_samples,
                "the digits quality table needs at least one sample per class (10)",
                "set validation.num_samples to 10 or more (64 is the default)",
            )
        for lora_format in ("peft", "lora_pipeline", "lora_vllm_omni"):
            if lora_format in self.export.formats and not self.model.student.lora.enabled:
                raise error(
                    "export.formats",
                    list(self.export.formats),
                    f"the {lora_format} format needs a LoRA student but model.student.lora.rank is 0",
                    "export the diffusers format only, or train the student with LoRA",
                )
        served_lora = [f for f in ("lora_pipeline", "lora_vllm_omni") if f in self.export.formats]
        if served_lora and "peft" not in self.export.formats:
            raise error(
                "export.formats",
                list(self.export.formats),
                f"{served_lora[0]} serves the adapter of the peft format beside it",
                "list peft too",
            )

    # -- construction

    @classmethod
    def from_config(cls, config: Any) -> DistillationPlan:
        """Build and validate a plan from an OmegaConf config or a plain mapping.

        Interpolations are resolved; a missing mandatory value (``???``) is
        reported with its key, an interpolation that does not resolve with the key
        whose value holds it. The hydra node, if present, is ignored.
        """
        from omegaconf import DictConfig, OmegaConf
        from omegaconf.errors import GrammarParseError, InterpolationResolutionError, MissingMandatoryValue

        # DictConfig registers as a Mapping, so test for it first.
        if isinstance(config, DictConfig):
            try:
                config = OmegaConf.to_container(config, resolve=True, throw_on_missing=True)
            except MissingMandatoryValue as err:
                key = getattr(err, "full_key", None) or "?"
                raise PlanError(
                    f"config key '{key}' is missing (???): it has no default; fix: set {key}=..."
                ) from None
            except (InterpolationResolutionError, GrammarParseError) as err:
                raise _interpolation_error(config, err) from None
        elif isinstance(config, Mapping):
            config = dict(config)
        else:
            raise PlanError(
                f"config is a {type(config).__name__}: must be a mapping or an OmegaConf DictConfig"
            )
        config.pop("hydra", None)
        return build(cls, config, "")

    # -- views

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable nested dict of every key (tuples as lists)."""
        return to_plain(self)

    def semantic_dict(self) -> dict[str, Any]:
        """The nested dict of the keys that define training: RESUME_MUTABLE_KEYS removed (the models' paths
        among them), each model's ``content_sha256`` as `model_content` gives it (reading the models named by
        path unless the plan pins their content: PlanError when one cannot be read)."""
        semantic = without_keys(self.to_dict(), RESUME_MUTABLE_KEYS)
        for role in MODEL_SOURCES:
            semantic["model"][role]["content_sha256"] = self.model_content(role)
        return semantic

    def model_content(self, role: str) -> str | None:
        """The identity by content of ``model.<role>`` that the fingerprint holds: its pinned
        ``content_sha256``, else `model_identity`'s; None for a student or fake score copied from the teacher.
        """
        pinned = getattr(self.model, role).content_sha256
        if pinned is not None:
            return pinned
        identity = self.model_identity(role)
        return None if identity is None else identity["content_sha256"]

    def model_identity(self, role: str) -> dict[str, Any] | None:
        """Where ``model.<role>`` comes from and what it is, read from disk (a pin is not consulted).

        ``{"path", "subfolder", "content_sha256", "weights_sha256", "config_sha256"}``: for a model named by
        path, the digests of `verl_dmd.digests.model_digests` (the first read in a process hashes its weights
        unless the digest cache knows them by file stats); for one built from ``model.<role>.config``,
        ``"config:"`` + the SHA-256 of the config's canonical JSON and no weights. None for a student or fake
        score copied from the teacher. A model that cannot be read is a one-line PlanError naming its path.
        """
        from pathlib import Path

        from verl_dmd.assets import resolve_model_path
        from verl_dmd.digests import model_digests, model_sha256

        spec = getattr(self.model, role)
        if spec.path is None and spec.config is None:
            return None
        if spec.path is None:
            content = model_sha256(None, None, spec.config)
            return {"path": None, "subfolder": None, "content_sha256": content, "weights_sha256": None,
                    "config_sha256": content.removeprefix("config:")}  # fmt: skip
        try:
            folder = Path(resolve_model_path(spec.path)).expanduser() / (spec.subfolder or "")
            digests = model_digests(folder)
        except (ValueError, OSError) as err:
            raise error(f"model.{role}.path", spec.path,
                        f"cannot identify the model by content ({err}); the plan's fingerprint holds it",
                        "point it at the local diffusers model directory (with its subfolder), or pin "
                        f"model.{role}.content_sha256 where the model is not at hand") from None  # fmt: skip
        return {"path": spec.path, "subfolder": spec.subfolder, **digests}

    def teacher_identity(self) -> dict[str, Any]:
        """`model_identity` of the teacher (what an export records as where its teacher came from)."""
        return self.model_identity("teacher")

    def with_model_contents(self) -> DistillationPlan:
        """This plan with ``content_sha256`` set for every model named by path (`model_content`): the plan the
        driver hands to the workers, whose fingerprint then reads no model."""
        roles = {}
        for role in MODEL_SOURCES:
            spec = getattr(self.model, role)
            if spec.path is not None and spec.content_sha256 is None:
                roles[role] = dataclasses.replace(spec, content_sha256=self.model_content(role))
        return dataclasses.replace(self, model=dataclasses.replace(self.model, **roles)) if roles else self

    def check_local_paths(self) -> None:
        """Fail (one line naming the key) if a local input the run reads at start-up is missing.

        Kept out of validation so a plan can be built where its files do not exist
        (tests, a driver that only inspects it); the entry points call it before
        starting any worker. Paths made by the run (pairs, outputs) are not checked.
        """
        from pathlib import Path

        from verl_dmd.assets import resolve_model_path

        fix_model = "point it at a local diffusers model directory (nothing is downloaded)"
        for role in ("teacher", "student", "fake_score"):
            spec = getattr(self.model, role)
            if spec.path is None:
                continue
            key = f"model.{role}.path"
            try:
                folder = Path(resolve_model_path(spec.path)).expanduser()
            except ValueError as err:
                raise PlanError(f"config key '{key}' = {show(spec.path)}: {err}") from None
            if not folder.is_dir():
                raise error(key, spec.path, "no such local directory", fix_model)
            if spec.subfolder and not (folder / spec.subfolder).is_dir():
                raise error(f"model.{role}.subfolder", spec.subfolder, f"no such folder in {spec.path}",
                             "name the folder that holds the denoiser's config.json (e.g. transformer)")  # fmt: skip
        for role in ("student", "fake_score"):
            init = getattr(self.model, role).lora.init_path
            if init and not (Path(init).expanduser() / "adapter_config.json").is_file():
                raise error(f"model.{role}.lora.init_path", init, "no adapter_config.json there",
                             "point it at a PEFT adapter directory (e.g. an export's peft/ folder)")  # fmt: skip
        if self.data.path and not Path(self.data.path).expanduser().exists():
            raise error(
                "data.path", self.data.path, "no such file or directory", "point it at the prepared data"
            )
        if (
            "pipeline" in self.export.formats
            and not (Path(self.export.pipeline_source) / "model_index.json").is_file()
        ):
            raise error("export.pipeline_source", self.export.pipeline_source, "no model_index.json there",
                         "point it at the teacher's local diffusers pipeline directory")  # fmt: skip

    def fingerprint(self) -> str:
        """SHA-256 hex digest of canonical JSON (sorted keys) of `semantic_dict()`."""
        return fingerprint_of(self.semantic_dict())

    def semantic_differences(self, other_semantic: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
        """(dotted key, other's value, this plan's value) for every semantic key that differs.

        `other_semantic` is another plan's `semantic_dict()` (e.g. from a
        checkpoint manifest); a key present on one side only shows as `<absent>`, except a key of
        `ADDED_KEYS` that the other side lacks: it holds the value listed there (the behaviour before the key
        existed), so it is no difference where this plan holds that value and shows it where not. The keys of
        `GAN_ONLY_KEYS` are no difference when both plans have the GAN off, those of `MULTI_STEP_ONLY_KEYS` when
        both train a 1-step student. Keys that were semantic when
        `other_semantic` was written and are resume-mutable now (`RESUME_MUTABLE_KEYS`) are no difference, except a model's path and subfolder
        where `other_semantic` has no ``content_sha256`` for it (written before models were identified by
        content, `LOCATION_KEYS`): they are compared as written, and the content is not.
        """
        mine = flatten(self.semantic_dict())
        written = flatten(dict(other_semantic))
        theirs = flatten(without_keys(dict(other_semantic), RESUME_MUTABLE_KEYS))
        absent = "<absent>"
        for role in MODEL_SOURCES:
            if f"model.{role}.content_sha256" not in written:
                del mine[f"model.{role}.content_sha256"]
                spec = getattr(self.model, role)
                for name in ("path", "subfolder"):
                    key = f"model.{role}.{name}"
                    mine[key], theirs[key] = getattr(spec, name), written.get(key, absent)
        for key, before in ADDED_KEYS.items():  # written before the key existed: the behaviour it had
            if key not in theirs and key in mine:
                theirs[key] = before
        if all(side.get("algorithm.gan_discriminator_weight", 0) == 0 for side in (mine, theirs)):
            for key in GAN_ONLY_KEYS:
                mine.pop(key, None)
                theirs.pop(key, None)
        if all(side.get("algorithm.student_steps", 1) == 1 for side in (mine, theirs)):
            for key in MULTI_STEP_ONLY_KEYS:  # a 1-step student builds and trains the same under every value
                mine.pop(key, None)
                theirs.pop(key, None)
        return [
            (key, theirs.get(key, absent), mine.get(key, absent))
            for key in sorted(set(mine) | set(theirs))
            if theirs.get(key, absent) != mine.get(key, absent)
        ]


def fingerprint_of(semantic: Mapping[str, Any]) -> str:
    """SHA-256 of the canonical JSON of a semantic dict, under FINGERPRINT_SCHEMA."""
    canonical = json.dumps(
        semantic, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    )
    return hashlib.sha256(f"{FINGERPRINT_SCHEMA}\n{canonical}".encode()).hexdigest()


def plan_keys() -> list[str]:
    """Every dotted key a config may set (for docs and tests)."""
    return sorted(flatten(to_plain(_defaults_without_validation())))


def _check_source(
    key: str, path: str | None, subfolder: str | None, config: Any, content: str | None, *, required: bool
) -> None:
    """A model source: a path or a config, not both (the teacher needs one); a subfolder and a content digest
    only with a path."""
    if required and not path and config is None:
        raise error(
            f"{key}.path",
            path,
            "the teacher needs a source",
            f"set {key}.path to a local diffusers model directory, or {key}.config to build one",
        )
    if path is not None and not path:
        raise error(f"{key}.path", path, "must be a local model directory or null")
    if path is not None and config is not None:
        raise error(
            f"{key}.config", "<config>", f"give {key}.path or {key}.config, not both", "remove one of the two"
        )
    if subfolder is not None and path is None:
        raise error(
            f"{key}.subfolder", subfolder, f"only applies with {key}.path", f"set {key}.path or remove it"
        )
    if content is not None and path is None:
        raise error(f"{key}.content_sha256", content,
                    f"only applies with {key}.path (a model built from {key}.config is identified by it)",
                    f"set {key}.path or remove it")  # fmt: skip
    if content is not None and not re.fullmatch("[0-9a-f]{64}", content):
        raise error(f"{key}.content_sha256", content, "must be a SHA-256 digest (64 lowercase hex digits)",
                    f"copy it from a checkpoint's manifest.json (plan.{key}.content_sha256), or set null to "
                    f"read it from {key}.path")  # fmt: skip


def _interpolation_error(config: Any, err: Exception) -> PlanError:
    """The one line for an interpolation that does not resolve (``${trainer.outptu_dir}``), naming the key
    whose own value holds it rather than the first key that refers to that one (OmegaConf names that)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    failing: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        for name, value in node.items():
            key = f"{prefix}.{name}" if prefix else str(name)
            if isinstance(value, Mapping):
                walk(value, key)
            elif isinstance(value, str) and "${" in value:
                try:
                    OmegaConf.select(config, key)
                except OmegaConfBaseException:
                    failing[key] = value

    walk(OmegaConf.to_container(config, resolve=False), "")
    # The key whose value holds the typo refers to no other failing key (the keys that refer to it do).
    roots = [k for k, v in failing.items() if not any(f"${{{o}}}" in v for o in failing if o != k)]
    key = roots[0] if roots else getattr(err, "full_key", None) or "?"
    reason = str(err).splitlines()[0]
    return error(key, failing.get(key, "?"), f"does not resolve: {reason}",
                 "correct the interpolation (${section.key}, a dotted key from the top) or give a plain value")  # fmt: skip


def _defaults_without_validation() -> DistillationPlan:
    """A plan of pure defaults, bypassing validation (the defaults alone are not runnable)."""
    plan = object.__new__(DistillationPlan)
    for f in dataclasses.fields(DistillationPlan):
        object.__setattr__(plan, f.name, f.default_factory())  # type: ignore[misc]
    return plan
