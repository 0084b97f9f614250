"""DistillationPlan: building, validation messages, immutability and the fingerprint."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from verl_dmd.plan import (
    LOCATION_KEYS,
    RESUME_MUTABLE_KEYS,
    TRACKING_BACKENDS,
    DistillationPlan,
    PlanError,
    _defaults_without_validation,
    flatten,
    plan_keys,
)

ROOT = Path(__file__).resolve().parents[1]


def base_config() -> dict:
    """The packaged base YAML as a plain dict."""
    return OmegaConf.to_container(OmegaConf.load(ROOT / "config" / "dmd2.yaml"))


def valid_config() -> dict:
    """The base config plus the few keys that have no usable default."""
    cfg = base_config()
    cfg["model"]["adapter"] = "dit"
    cfg["model"]["teacher"]["config"] = {"sample_size": 8, "num_layers": 2}
    cfg["model"]["student"]["lora"]["rank"] = 4
    cfg["model"]["fake_score"]["lora"]["rank"] = 4
    cfg["data"]["name"] = "digits"
    return cfg


def set_dotted(cfg: dict, dotted: str, value) -> None:
    node = cfg
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = value


def get_dotted(cfg: dict, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def with_overrides(overrides: dict) -> dict:
    cfg = valid_config()
    for key, value in overrides.items():
        set_dotted(cfg, key, value)
    return cfg


# --------------------------------------------------------------------------- building


def test_valid_config_builds_and_is_frozen():
    """A valid config builds; every spec is frozen and model configs are read-only."""
    plan = DistillationPlan.from_config(valid_config())
    assert plan.algorithm.fake_update_ratio == 5
    assert plan.optim.student.betas == (0.9, 0.999)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.algorithm.fake_update_ratio = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        plan.model.teacher.config["num_layers"] = 3  # type: ignore[index]


def test_omegaconf_input_with_interpolation_and_missing_value():
    """DictConfig input resolves interpolations; a ??? value is reported with its key."""
    cfg = OmegaConf.create(valid_config())
    cfg.trainer.experiment_name = "${model.adapter}_run"
    assert DistillationPlan.from_config(cfg).trainer.experiment_name == "dit_run"
    cfg.data.name = "???"
    with pytest.raises(PlanError, match=r"'data\.name' is missing"):
        DistillationPlan.from_config(cfg)


def test_an_interpolation_that_does_not_resolve_names_the_key_that_holds_it():
    """OmegaConf names the first key that fails to resolve (here one that refers to the broken one);
    the plan names the key whose own value holds the typo."""
    cfg = OmegaConf.create(valid_config())
    cfg.data.regression_pairs_path = "${trainer.output_dir}/pairs.safetensors"
    cfg.trainer.output_dir = "${trainer.outptu_dir}/x"
    with pytest.raises(PlanError) as caught:
        DistillationPlan.from_config(cfg)
    assert str(caught.value).startswith(
        "config key 'trainer.output_dir' = '${trainer.outptu_dir}/x': does not resolve: Interpolation key "
        "'trainer.outptu_dir' not found; fix: "
    )


def test_int_accepted_for_float_and_lists_become_tuples():
    """Integers are accepted where numbers are expected; lists are stored as tuples."""
    plan = DistillationPlan.from_config(
        with_overrides({"optim.student.lr": 1, "trainer.loggers": ["console"]})
    )
    assert plan.optim.student.lr == 1.0 and isinstance(plan.optim.student.lr, float)
    assert plan.trainer.loggers == ("console",)


def test_replace_revalidates():
    """dataclasses.replace on a plan runs validation again."""
    plan = DistillationPlan.from_config(valid_config())
    bad_algorithm = dataclasses.replace(plan.algorithm, fake_update_ratio=0)
    with pytest.raises(PlanError, match=r"algorithm\.fake_update_ratio"):
        dataclasses.replace(plan, algorithm=bad_algorithm)


def test_direct_construction_checks_types():
    """A plan built in code (not from a config) gets the same type checks."""
    plan = DistillationPlan.from_config(valid_config())
    with pytest.raises(PlanError, match=r"trainer\.seed"):
        dataclasses.replace(plan, trainer=dataclasses.replace(plan.trainer, seed="0"))


def test_base_yaml_matches_plan_defaults():
    """config/dmd2.yaml lists every plan key with exactly the dataclass default."""
    yaml_flat = flatten(base_config())
    default_flat = flatten(_defaults_without_validation().to_dict())
    assert sorted(yaml_flat) == sorted(default_flat)
    for key, value in default_flat.items():
        assert yaml_flat[key] == value, key


def test_every_key_is_documented():
    """docs/configuration.md mentions every plan key and its generated tables are current."""
    from verl_dmd.config_docs import updated

    text = (ROOT / "docs" / "configuration.md").read_text()
    missing = [key for key in plan_keys() if f"`{key}`" not in text]
    assert not missing, f"undocumented keys: {missing}"
    assert updated(text) == text, "docs/configuration.md is stale: run python -m verl_dmd.config_docs --write"


def test_digits_recipe_composes_with_hydra():
    """The default recipe composes through hydra (base config via the search path) and validates."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "recipes"), version_base=None):
        cfg = compose(config_name="digits_dmd2")
    plan = DistillationPlan.from_config(cfg)
    assert plan.model.adapter == "dit" and plan.data.name == "digits"
    assert plan.resources.world_size == 2


def test_the_digits_recipe_turns_its_decayed_regression_term_off_with_one_override():
    """The recipe decays its regression term (algorithm.regression_decay_steps); `algorithm.regression_weight=0`
    alone turns the term off (the decay has nothing to decay), as it did before the recipe decayed it."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "recipes"), version_base=None):
        cfg = compose(config_name="digits_dmd2", overrides=["algorithm.regression_weight=0"])
    plan = DistillationPlan.from_config(cfg)
    assert plan.algorithm.regression_decay_steps == 600 and plan.algorithm.regression_weight == 0
    plan = DistillationPlan.from_config(with_overrides({"algorithm.regression_decay_steps": 300}))
    assert plan.algorithm.regression_weight == 0 and plan.algorithm.regression_decay_steps == 300


def test_tracking_backends_match_verl():
    """The logger names the plan accepts are the ones verl's Tracking supports."""
    from verl.utils.tracking import Tracking

    assert set(TRACKING_BACKENDS) == set(Tracking.supported_backend)


# --------------------------------------------------------------------------- errors

INVALID = [
    # (overrides, the key the message must name)
    ({"algorithm.name": ""}, "algorithm.name"),
    ({"algorithm.fake_score_weighting": "snr"}, "algorithm.fake_score_weighting"),
    ({"algorithm.fake_update_ratio": 0}, "algorithm.fake_update_ratio"),
    ({"algorithm.fake_update_ratio": -1}, "algorithm.fake_update_ratio"),
    ({"algorithm.fake_update_ratio": 1.5}, "algorithm.fake_update_ratio"),
    ({"algorithm.fake_update_ratio": True}, "algorithm.fake_update_ratio"),
    ({"algorithm.fake_update_ratio": "5"}, "algorithm.fake_update_ratio"),
    ({"algorithm.fake_update_ratio": None}, "algorithm.fake_update_ratio"),
    ({"algorithm.fake_warmup_steps": -1}, "algorithm.fake_warmup_steps"),
    ({"algorithm.teacher_guidance_scale": -1.0}, "algorithm.teacher_guidance_scale"),
    ({"algorithm.teacher_guidance_scale": float("nan")}, "algorithm.teacher_guidance_scale"),
    ({"algorithm.teacher_guidance_scale": float("inf")}, "algorithm.teacher_guidance_scale"),
    ({"algorithm.cfg_form": "std"}, "algorithm.cfg_form"),
    ({"algorithm.dmd_normalizer": "global"}, "algorithm.dmd_normalizer"),
    ({"algorithm.dmd_normalizer_eps": 0.0}, "algorithm.dmd_normalizer_eps"),
    ({"algorithm.dmd_normalizer_eps": -1e-6}, "algorithm.dmd_normalizer_eps"),
    ({"algorithm.sigma_min": -0.1}, "algorithm.sigma_min"),
    ({"algorithm.sigma_max": 1.5}, "algorithm.sigma_max"),
    ({"algorithm.sigma_min": 0.9, "algorithm.sigma_max": 0.5}, "algorithm.sigma_min"),
    ({"algorithm.fake_sigma_max": 2.0}, "algorithm.fake_sigma_max"),
    ({"algorithm.fake_sigma_min": 0.6, "algorithm.fake_sigma_max": 0.5}, "algorithm.fake_sigma_min"),
    ({"algorithm.sigma_shift": 0.0}, "algorithm.sigma_shift"),
    ({"algorithm.sigma_shift": -3.0}, "algorithm.sigma_shift"),
    ({"algorithm.student_steps": 0}, "algorithm.student_steps"),
    ({"algorithm.student_sigmas": [1.0, 0.5]}, "algorithm.student_sigmas"),
    ({"algorithm.student_steps": 2, "algorithm.student_sigmas": [0.5, 0.7]}, "algorithm.student_sigmas[1]"),
    ({"algorithm.student_steps": 2, "algorithm.student_sigmas": [0.5, 0.5]}, "algorithm.student_sigmas[1]"),
    ({"algorithm.student_sigmas": [1.5]}, "algorithm.student_sigmas[0]"),
    ({"algorithm.student_sigmas": [0.0]}, "algorithm.student_sigmas[0]"),
    ({"algorithm.student_sigmas": "1.0"}, "algorithm.student_sigmas"),
    ({"algorithm.backward_simulation": "yes"}, "algorithm.backward_simulation"),
    (
        {"algorithm.student_steps": 4, "algorithm.first_exit_probability": 1.5},
        "algorithm.first_exit_probability",
    ),
    (
        {"algorithm.student_steps": 4, "algorithm.first_exit_probability": -0.1},
        "algorithm.first_exit_probability",
    ),
    (
        {"algorithm.student_steps": 4, "algorithm.first_exit_probability": True},
        "algorithm.first_exit_probability",
    ),
    ({"algorithm.gan_generator_weight": 0.01}, "algorithm.gan_generator_weight"),
    ({"algorithm.gan_discriminator_weight": -1.0}, "algorithm.gan_discriminator_weight"),
    ({"algorithm.gan_sigma_max": 0.0}, "algorithm.gan_sigma_max"),
    ({"algorithm.gan_sigma_max": 1.5}, "algorithm.gan_sigma_max"),
    ({"algorithm.gan_head": "mlp"}, "algorithm.gan_head"),
    ({"algorithm.gan_heads": "per_step"}, "algorithm.gan_heads"),
    ({"algorithm.regression_weight": -0.5}, "algorithm.regression_weight"),
    ({"algorithm.regression_decay_steps": 0}, "algorithm.regression_decay_steps"),
    ({"algorithm.regression_decay_steps": 2.5}, "algorithm.regression_decay_steps"),
    ({"algorithm.regression_weight": 1.0}, "data.regression_pairs_path"),
    ({"algorithm": 5}, "algorithm"),
    ({"model.adapter": ""}, "model.adapter"),
    ({"model.storage": "shared"}, "model.storage"),
    ({"model.param_dtype": "fp16"}, "model.param_dtype"),
    ({"model.reduce_dtype": "float16"}, "model.reduce_dtype"),
    ({"model.activation_checkpointing": 1}, "model.activation_checkpointing"),
    ({"model.teacher.config": None}, "model.teacher.path"),
    ({"model.teacher.path": "/models/sd3"}, "model.teacher.config"),
    ({"model.teacher.config": None, "model.teacher.path": ""}, "model.teacher.path"),
    ({"model.teacher.subfolder": "transformer"}, "model.teacher.subfolder"),
    ({"model.teacher.config": 5}, "model.teacher.config"),
    ({"model.teacher.config": {"x": float("nan")}}, "model.teacher.config.x"),
    ({"model.teacher.cpu_offload": "no"}, "model.teacher.cpu_offload"),
    ({"model.student.path": "/models/student"}, "model.student.path"),
    ({"model.fake_score.config": {"a": 1}}, "model.fake_score.config"),
    ({"model.student.lora.rank": 0}, "model.student.lora.rank"),
    ({"model.fake_score.lora.rank": 0}, "model.fake_score.lora.rank"),
    ({"model.student.lora.rank": -4}, "model.student.lora.rank"),
    ({"model.student.lora.alpha": 0.0}, "model.student.lora.alpha"),
    ({"model.student.lora.dropout": 1.0}, "model.student.lora.dropout"),
    ({"model.student.lora.dropout": -0.1}, "model.student.lora.dropout"),
    ({"model.student.lora.target_modules": []}, "model.student.lora.target_modules"),
    ({"model.student.lora.target_modules": ["to_q", ""]}, "model.student.lora.target_modules[1]"),
    ({"model.student.lora.target_modules": "to_q"}, "model.student.lora.target_modules"),
    ({"model.student.lora.init_path": ""}, "model.student.lora.init_path"),
    (
        {"model.storage": "independent", "model.student.lora.rank": 0, "model.student.lora.alpha": 8.0},
        "model.student.lora.rank",
    ),
    ({"optim.student.lr": 0.0}, "optim.student.lr"),
    ({"optim.fake_score.lr": -1e-4}, "optim.fake_score.lr"),
    ({"optim.student.lr": "1e-4"}, "optim.student.lr"),
    ({"optim.student.betas": [0.9]}, "optim.student.betas"),
    ({"optim.student.betas": [1.0, 0.999]}, "optim.student.betas[0]"),
    ({"optim.student.betas": [0.9, -0.1]}, "optim.student.betas[1]"),
    ({"optim.student.eps": 0.0}, "optim.student.eps"),
    ({"optim.student.weight_decay": -0.01}, "optim.student.weight_decay"),
    ({"optim.student.grad_clip": -1.0}, "optim.student.grad_clip"),
    ({"optim.student.scheduler.name": "cosine"}, "optim.student.scheduler.name"),
    ({"optim.student.scheduler.warmup_steps": 10}, "optim.student.scheduler.warmup_steps"),
    ({"optim.student.scheduler.name": "warmup_constant"}, "optim.student.scheduler.warmup_steps"),
    ({"optim.student.scheduler.name": "warmup_cosine"}, "optim.student.scheduler.decay_steps"),
    ({"optim.student.scheduler.decay_steps": 100}, "optim.student.scheduler.name"),
    ({"optim.student.scheduler.min_lr_ratio": 2.0}, "optim.student.scheduler.min_lr_ratio"),
    ({"optim.student.scheduler.warmup_steps": -1}, "optim.student.scheduler.warmup_steps"),
    ({"batch.student.micro_batch_size": 0}, "batch.student.micro_batch_size"),
    ({"batch.fake_score.accumulation_steps": 0}, "batch.fake_score.accumulation_steps"),
    ({"ema.decay": 1.0}, "ema.decay"),
    ({"ema.decay": 0.0}, "ema.decay"),
    ({"ema.start_step": -1}, "ema.start_step"),
    ({"ema.enabled": "true"}, "ema.enabled"),
    ({"data.name": ""}, "data.name"),
    ({"data.shuffle": None}, "data.shuffle"),
    ({"trainer.total_steps": 0}, "trainer.total_steps"),
    ({"trainer.seed": -1}, "trainer.seed"),
    ({"trainer.log_every": 0}, "trainer.log_every"),
    ({"trainer.loggers": []}, "trainer.loggers"),
    ({"trainer.loggers": ["stdout"]}, "trainer.loggers[0]"),
    ({"trainer.loggers": "console"}, "trainer.loggers"),
    ({"trainer.rpc_timeout_s": 0.0}, "trainer.rpc_timeout_s"),
    ({"trainer.output_dir": ""}, "trainer.output_dir"),
    ({"trainer.max_consecutive_skips": -1}, "trainer.max_consecutive_skips"),
    ({"resources.device": "gpu"}, "resources.device"),
    ({"resources.nnodes": 0}, "resources.nnodes"),
    ({"resources.workers_per_node": 0}, "resources.workers_per_node"),
    ({"checkpoint.save_every": -1}, "checkpoint.save_every"),
    ({"checkpoint.keep_last": -1}, "checkpoint.keep_last"),
    ({"checkpoint.keep_every": -2}, "checkpoint.keep_every"),
    ({"checkpoint.resume": ""}, "checkpoint.resume"),
    ({"checkpoint.root": ""}, "checkpoint.root"),
    ({"validation.num_samples": 0}, "validation.num_samples"),
    ({"validation.every": -1}, "validation.every"),
    ({"validation.sampling_steps": []}, "validation.sampling_steps"),
    ({"validation.sampling_steps": [1, 0]}, "validation.sampling_steps[1]"),
    ({"validation.roles": ["fake_score"]}, "validation.roles[0]"),
    ({"validation.roles": []}, "validation.roles"),
    (
        {"validation.roles": ["student_ema"], "ema.enabled": False, "export.role": "student"},
        "validation.roles",
    ),
    ({"export.role": "teacher"}, "export.role"),
    ({"export.role": "student_ema", "ema.enabled": False, "validation.roles": ["student"]}, "export.role"),
    ({"export.formats": ["onnx"]}, "export.formats[0]"),
    ({"export.formats": []}, "export.formats"),
    (
        {
            "model.storage": "independent",
            "model.student.lora.rank": 0,
            "model.fake_score.lora.rank": 0,
            "export.formats": ["peft"],
        },
        "export.formats",
    ),
]


INVALID.append(({"data.name": "digits", "validation.num_samples": 8}, "validation.num_samples"))
INVALID.append(({"model.compile": True, "model.compile_backend": "nope"}, "model.compile_backend"))
INVALID += [
    ({"prepare.resolution": [1024]}, "prepare.resolution"),
    ({"prepare.resolution": [0, 512]}, "prepare.resolution[0]"),
    ({"prepare.num_frames": 0}, "prepare.num_frames"),
    ({"prepare.batch_size": 0}, "prepare.batch_size"),
    ({"prepare.batch_size": 16, "prepare.shard_size": 100}, "prepare.shard_size"),
    ({"prepare.dtype": "fp8"}, "prepare.dtype"),
    ({"prepare.guidance_embedding": -1.0}, "prepare.guidance_embedding"),
    ({"prepare.prompt_field": ""}, "prepare.prompt_field"),
    ({"prepare.image_transform": "pad"}, "prepare.image_transform"),
    ({"validation.teacher_steps": 0}, "validation.teacher_steps"),
    ({"model.fsdp_mesh": "hybird"}, "model.fsdp_mesh"),
    ({"model.fsdp_mesh": "replicated"}, "model.fsdp_mesh"),
    ({"model.fsdp_mesh": [2, 2, 1]}, "model.fsdp_mesh"),
    ({"model.fsdp_mesh": [0, 4], "resources.workers_per_node": 4}, "model.fsdp_mesh[0]"),
    ({"model.fsdp_mesh": [2, 3], "resources.nnodes": 2, "resources.workers_per_node": 2}, "model.fsdp_mesh"),
]


@pytest.mark.parametrize(("overrides", "key"), INVALID, ids=[key for _, key in INVALID])
def test_invalid_value_is_one_line_error_naming_the_key(overrides, key):
    """Each invalid value fails at build time with one line naming the key and the value."""
    with pytest.raises(PlanError) as info:
        DistillationPlan.from_config(with_overrides(overrides))
    message = str(info.value)
    assert "\n" not in message
    assert f"'{key}'" in message, message


def test_invalid_table_covers_every_section():
    """The table above reaches every plan section, so a new section gets error tests too."""
    covered = {key.split(".")[0] for _, key in INVALID}
    assert set(DistillationPlan.SECTIONS) <= covered


@pytest.mark.parametrize(
    ("path", "close"),
    [
        ("algorithm.fake_update_ration", "fake_update_ratio"),
        ("optim.student.learning_rate", None),
        ("trainer.total_step", "total_steps"),
        ("modle", "model"),
    ],
)
def test_unknown_key_is_rejected_with_suggestion(path, close):
    """Unknown keys anywhere fail, naming the key and the closest allowed one when there is one."""
    cfg = valid_config()
    *parents, leaf = path.split(".")
    node = cfg
    for part in parents:
        node = node[part]
    node[leaf] = 1
    with pytest.raises(PlanError) as info:
        DistillationPlan.from_config(cfg)
    message = str(info.value)
    assert "\n" not in message and f"'{path}' is unknown" in message
    if close:
        assert f"'{close}'" in message
    else:
        assert "allowed keys here" in message


def test_independent_layout_allows_full_training_and_own_sources():
    """The independent layout accepts rank 0 (full weights) and per-role sources."""
    plan = DistillationPlan.from_config(
        with_overrides(
            {
                "model.storage": "independent",
                "model.student.lora.rank": 0,
                "model.fake_score.config": {"sample_size": 8, "num_layers": 1},
                "export.formats": ["diffusers"],
            }
        )
    )
    assert not plan.model.student.lora.enabled
    assert plan.model.fake_score.config["num_layers"] == 1


# --------------------------------------------------------------------------- fingerprint

# One alternative valid value for every key: semantic keys must change the
# fingerprint, resume-mutable keys must not. The coverage test below fails when
# a plan key is added without an entry here.
ALTERNATIVES = {
    "algorithm.name": "sid",  # any name: the registry, not the plan, knows the registered methods
    "algorithm.fake_update_ratio": 2,
    "algorithm.fake_warmup_steps": 7,
    "algorithm.teacher_guidance_scale": 4.5,
    "algorithm.cfg_form": "conditional_offset",
    "algorithm.dmd_normalizer": "batch_global",
    "algorithm.dmd_normalizer_eps": 1e-5,
    "algorithm.sigma_min": 0.03,
    "algorithm.sigma_max": 0.97,
    "algorithm.fake_sigma_min": 0.01,
    "algorithm.fake_sigma_max": 0.99,
    "algorithm.sigma_shift": 3.0,
    "algorithm.student_steps": 1,  # changed together with student_sigmas below
    "algorithm.student_sigmas": [0.9],
    "algorithm.backward_simulation": False,
    "algorithm.first_exit_probability": 0.75,
    "algorithm.gan_generator_weight": 0.0,  # needs the discriminator weight: see test below
    "algorithm.gan_discriminator_weight": 0.01,
    "algorithm.gan_sigma_max": 0.3,
    "algorithm.gan_head": "pooled",
    "algorithm.gan_heads": "per_exit_group",
    "algorithm.regression_weight": 0.0,  # needs a data path: see test below
    "algorithm.regression_decay_steps": 300,
    "algorithm.fake_score_weighting": "edm",
    "model.adapter": "sd3",
    "model.storage": "independent",
    "model.param_dtype": "bfloat16",
    "model.reduce_dtype": "bfloat16",
    "model.activation_checkpointing": True,
    "model.fsdp_units": "model",
    "model.fsdp_mesh": "hybrid",
    "model.reshard_after_forward": False,
    "model.compile": True,
    "model.compile_backend": "aot_eager",
    "model.teacher.path": None,  # changed as a whole source below
    "model.teacher.subfolder": None,
    "model.teacher.config": {"sample_size": 8, "num_layers": 3},
    "model.teacher.content_sha256": "a" * 64,  # needs a path: see COMPOSITE_CHANGES
    "model.teacher.cpu_offload": True,
    "model.student.path": None,
    "model.student.subfolder": None,
    "model.student.config": None,
    "model.student.content_sha256": "b" * 64,
    "model.student.lora.rank": 8,
    "model.student.lora.alpha": 16.0,
    "model.student.lora.dropout": 0.1,
    "model.student.lora.target_modules": ["to_q", "to_v"],
    "model.student.lora.init_path": "/adapters/student",
    "model.fake_score.path": None,
    "model.fake_score.subfolder": None,
    "model.fake_score.config": None,
    "model.fake_score.content_sha256": "c" * 64,
    "model.fake_score.lora.rank": 8,
    "model.fake_score.lora.alpha": 2.0,
    "model.fake_score.lora.dropout": 0.05,
    "model.fake_score.lora.target_modules": ["to_k"],
    "model.fake_score.lora.init_path": "/adapters/fake",
    "data.name": "embeddings",
    "data.path": "/data/emb",
    "data.shuffle": False,
    "data.regression_pairs_path": "/data/pairs",
    "ema.enabled": False,
    "ema.decay": 0.99,
    "ema.start_step": 200,
    "trainer.seed": 1,
    "trainer.total_steps": 5,
    "trainer.output_dir": "elsewhere",
    "trainer.project_name": "p",
    "trainer.experiment_name": "e",
    "trainer.loggers": ["console", "tensorboard"],
    "trainer.log_every": 10,
    "trainer.max_consecutive_skips": 0,
    "trainer.rpc_timeout_s": 60.0,
    "trainer.progress_bar": False,
    "resources.device": "cuda",
    "resources.nnodes": 2,
    "resources.workers_per_node": 8,
    "resources.sleep_between_phases": True,
    "resources.offload_packing": False,
    "resources.deterministic": True,
    "checkpoint.root": "/ckpt",
    "checkpoint.save_every": 50,
    "checkpoint.keep_last": 0,
    "checkpoint.keep_every": 1000,
    "checkpoint.resume": "disable",
    "checkpoint.verify_hashes": False,
    "validation.name": "digits",
    "validation.every": 100,
    "validation.num_samples": 16,
    "validation.sampling_steps": [1, 2, 4],
    "validation.roles": ["teacher"],
    "validation.teacher_steps": 50,
    "validation.replica": False,
    "prepare.prompts": "/data/prompts.txt",
    "prepare.prompt_field": "caption",
    "prepare.validation_prompts": "/data/val.txt",
    "prepare.negative_prompt": "blurry",
    "prepare.resolution": [1024, 1024],
    "prepare.num_frames": 81,
    "prepare.max_sequence_length": 128,
    "prepare.guidance_embedding": 3.5,
    "prepare.dtype": "float32",
    "prepare.device": "cpu",
    "prepare.batch_size": 8,
    "prepare.shard_size": 2048,
    "prepare.real_images": "/data/images",
    "prepare.image_transform": "resize",
    "prepare.teacher_pairs": True,
    "prepare.pair_steps": 50,
    "export.role": "student",
    "export.formats": ["diffusers"],
    "export.output_dir": "/export",
    "export.pipeline_source": "/models/pipeline",
    "export.at_end": False,
    "export.dtype": "float32",
}
for _role in ("student", "fake_score"):
    for _name in ("micro_batch_size", "accumulation_steps"):
        ALTERNATIVES[f"batch.{_role}.{_name}"] = 3
    for _name, _value in (
        ("lr", 1e-4),
        ("betas", [0.0, 0.999]),
        ("eps", 1e-6),
        ("weight_decay", 0.0),
        ("grad_clip", 1.0),
    ):
        ALTERNATIVES[f"optim.{_role}.{_name}"] = _value
    ALTERNATIVES[f"optim.{_role}.scheduler.name"] = "warmup_cosine"  # with the two below
    ALTERNATIVES[f"optim.{_role}.scheduler.warmup_steps"] = 5
    ALTERNATIVES[f"optim.{_role}.scheduler.decay_steps"] = 100
    ALTERNATIVES[f"optim.{_role}.scheduler.min_lr_ratio"] = 0.1

# Keys whose alternative must be set together with others to stay valid.
COMPANIONS = {
    "data.name": {"data.path": "/data/emb"},  # the embeddings provider needs a path
    # the GAN's head and levels are no difference while the GAN is off (GAN_ONLY_KEYS)
    "algorithm.gan_head": {"algorithm.gan_discriminator_weight": 0.01},
    # and gan_heads and first_exit_probability none while the student takes 1 step (MULTI_STEP_ONLY_KEYS)
    "algorithm.gan_heads": {"algorithm.gan_discriminator_weight": 0.01, "algorithm.student_steps": 2},
    "algorithm.first_exit_probability": {"algorithm.student_steps": 2},
    "algorithm.gan_sigma_max": {"algorithm.gan_discriminator_weight": 0.01},
    "algorithm.regression_decay_steps": {
        "algorithm.regression_weight": 1.0,
        "data.regression_pairs_path": "/data/pairs.safetensors",
    },
    "export.pipeline_source": {"export.formats": ["diffusers", "pipeline"]},
    "optim.student.scheduler.name": {"optim.student.scheduler.decay_steps": 100},
    "optim.student.scheduler.warmup_steps": {
        "optim.student.scheduler.name": "warmup_cosine",
        "optim.student.scheduler.decay_steps": 10,
    },
    "optim.student.scheduler.decay_steps": {"optim.student.scheduler.name": "warmup_cosine"},
    "optim.student.scheduler.min_lr_ratio": {
        "optim.student.scheduler.name": "warmup_cosine",
        "optim.student.scheduler.decay_steps": 10,
    },
    "optim.fake_score.scheduler.name": {"optim.fake_score.scheduler.decay_steps": 100},
    "optim.fake_score.scheduler.warmup_steps": {
        "optim.fake_score.scheduler.name": "warmup_cosine",
        "optim.fake_score.scheduler.decay_steps": 10,
    },
    "optim.fake_score.scheduler.decay_steps": {"optim.fake_score.scheduler.name": "warmup_cosine"},
    "optim.fake_score.scheduler.min_lr_ratio": {
        "optim.fake_score.scheduler.name": "warmup_cosine",
        "optim.fake_score.scheduler.decay_steps": 10,
    },
    "ema.enabled": {"export.role": "student", "validation.roles": ["student"]},
}
# Changes that need several keys at once, checked for semantic keys whose
# single alternative above is a no-op.
COMPOSITE_CHANGES = {
    "algorithm.student_steps": {"algorithm.student_steps": 4},
    "algorithm.gan_generator_weight": {
        "algorithm.gan_generator_weight": 0.002,
        "algorithm.gan_discriminator_weight": 0.01,
    },
    "algorithm.regression_weight": {
        "algorithm.regression_weight": 0.25,
        "data.regression_pairs_path": "/data/pairs",
    },
    # A model named by path counts by its content: pinned here, so that no model needs to exist.
    "model.teacher.content_sha256": {
        "model.teacher.path": "/models/sd3",
        "model.teacher.config": None,
        "model.teacher.content_sha256": "a" * 64,
    },
    "model.student.content_sha256": {
        "model.storage": "independent",
        "model.student.path": "/models/s",
        "model.student.content_sha256": "b" * 64,
    },
    "model.student.config": {"model.storage": "independent", "model.student.config": {"n": 1}},
    "model.fake_score.content_sha256": {
        "model.storage": "independent",
        "model.fake_score.path": "/models/f",
        "model.fake_score.content_sha256": "c" * 64,
    },
    "model.fake_score.config": {"model.storage": "independent", "model.fake_score.config": {"n": 1}},
}
# Every model named by path, its content pinned: the reference for moving one (LOCATION_KEYS).
PINNED_MODELS = {
    "model.storage": "independent",
    "model.teacher.config": None,
    **COMPOSITE_CHANGES["model.teacher.content_sha256"],
    **COMPOSITE_CHANGES["model.student.content_sha256"],
    **COMPOSITE_CHANGES["model.fake_score.content_sha256"],
}


def _is_mutable(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in RESUME_MUTABLE_KEYS)


def test_alternatives_cover_every_key():
    """Every plan key has an alternative value above, so no new key escapes the fingerprint tests."""
    assert sorted(ALTERNATIVES) == plan_keys()


def test_resume_mutable_keys_exist():
    """Every entry of RESUME_MUTABLE_KEYS names a real key or section (no typo silently excludes nothing)."""
    keys = plan_keys()
    for entry in RESUME_MUTABLE_KEYS:
        assert any(k == entry or k.startswith(entry + ".") for k in keys), entry


@pytest.mark.parametrize("key", sorted(k for k in ALTERNATIVES if not _is_mutable(k)))
def test_fingerprint_changes_with_every_semantic_key(key):
    """Changing any semantic key (alone, or with the companions it needs) changes the fingerprint."""
    reference = DistillationPlan.from_config(valid_config())
    change = COMPOSITE_CHANGES.get(key) or {key: ALTERNATIVES[key], **COMPANIONS.get(key, {})}
    changed = DistillationPlan.from_config(with_overrides(change))
    assert get_dotted(changed.to_dict(), key) != get_dotted(reference.to_dict(), key)
    assert changed.fingerprint() != reference.fingerprint()
    assert any(k == key for k, _, _ in changed.semantic_differences(reference.semantic_dict()))


@pytest.mark.parametrize("key", sorted(k for k in ALTERNATIVES if _is_mutable(k) and k not in LOCATION_KEYS))
def test_fingerprint_ignores_resume_mutable_keys(key):
    """Changing a resume-mutable key leaves the fingerprint and the semantic diff unchanged."""
    reference = DistillationPlan.from_config(valid_config())
    changed = DistillationPlan.from_config(
        with_overrides({key: ALTERNATIVES[key], **COMPANIONS.get(key, {})})
    )
    assert get_dotted(changed.to_dict(), key) != get_dotted(reference.to_dict(), key)
    assert changed.fingerprint() == reference.fingerprint()
    assert changed.semantic_differences(reference.semantic_dict()) == []


@pytest.mark.parametrize("key", LOCATION_KEYS)
def test_where_a_model_lies_is_no_semantic_key(key):
    """A model moved elsewhere (another path or subfolder, the same content) leaves the fingerprint as it was;
    tests/test_teacher_identity.py reads real model folders."""
    reference = DistillationPlan.from_config(with_overrides(PINNED_MODELS))
    moved = DistillationPlan.from_config(with_overrides({**PINNED_MODELS, key: "/elsewhere/t"}))
    assert get_dotted(moved.to_dict(), key) != get_dotted(reference.to_dict(), key)
    assert moved.fingerprint() == reference.fingerprint()
    assert moved.semantic_differences(reference.semantic_dict()) == []


def _shuffled(tree, rng):
    if isinstance(tree, dict):
        items = list(tree.items())
        rng.shuffle(items)
        return {k: _shuffled(v, rng) for k, v in items}
    return tree


def test_fingerprint_is_stable_across_key_order():
    """Key order in the config does not matter."""
    reference = DistillationPlan.from_config(valid_config()).fingerprint()
    for seed in range(5):
        shuffled = _shuffled(copy.deepcopy(valid_config()), random.Random(seed))
        assert DistillationPlan.from_config(shuffled).fingerprint() == reference


def test_fingerprint_is_stable_across_processes():
    """The fingerprint is the same in a new interpreter with a different hash seed."""
    reference = DistillationPlan.from_config(valid_config()).fingerprint()
    code = (
        "import json,sys; from verl_dmd.plan import DistillationPlan; "
        "print(DistillationPlan.from_config(json.loads(sys.stdin.read())).fingerprint())"
    )
    for hash_seed in ("1", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            input=json.dumps(valid_config()),
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": hash_seed, "PATH": "/usr/bin:/bin"},
            cwd=ROOT,
        )
        assert out.stdout.strip() == reference


def test_fingerprint_is_sha256_hex():
    """The fingerprint is a 64-character lowercase hex digest."""
    fp = DistillationPlan.from_config(valid_config()).fingerprint()
    assert len(fp) == 64 and int(fp, 16) >= 0 and fp == fp.lower()


def test_semantic_differences_name_both_values():
    """semantic_differences lists (key, old, new) for a checkpoint's semantic dict."""
    old = DistillationPlan.from_config(valid_config())
    new = DistillationPlan.from_config(with_overrides({"algorithm.fake_update_ratio": 2, "trainer.seed": 3}))
    assert new.semantic_differences(old.semantic_dict()) == [
        ("algorithm.fake_update_ratio", 5, 2),
        ("trainer.seed", 0, 3),
    ]
    stored = old.semantic_dict()
    del stored["ema"]["decay"]
    assert ("ema.decay", "<absent>", 0.999) in new.semantic_differences(stored)


def test_a_key_added_later_is_no_difference_at_the_value_it_replaced():
    """A checkpoint written before algorithm.fake_score_weighting existed resumes under the plan that holds
    the behaviour it had (uniform), and only under that; every other absent key is still a difference."""
    from verl_dmd.plan import ADDED_KEYS

    plan = DistillationPlan.from_config(with_overrides(ADDED_KEYS))
    stored = plan.semantic_dict()
    for dotted in ADDED_KEYS:
        section, key = dotted.split(".")
        del stored[section][key]
    assert plan.semantic_differences(stored) == []
    other = DistillationPlan.from_config(
        with_overrides({**ADDED_KEYS, "algorithm.fake_score_weighting": "edm"})
    )
    # the difference names the value the checkpoint was written with, not <absent>
    assert other.semantic_differences(stored) == [("algorithm.fake_score_weighting", "uniform", "edm")]
    # the conv GAN head is the default now: a checkpoint without the GAN resumes under it, one with it does not
    today = DistillationPlan.from_config(valid_config())
    assert today.algorithm.gan_discriminator_weight == 0 and today.semantic_differences(stored) == []
    gan = {"algorithm.gan_discriminator_weight": 0.01}
    stored = DistillationPlan.from_config(with_overrides({**ADDED_KEYS, **gan})).semantic_dict()
    for dotted in ADDED_KEYS:
        section, key = dotted.split(".")
        del stored[section][key]
    today = DistillationPlan.from_config(with_overrides(gan))
    assert today.semantic_differences(stored) == [("algorithm.gan_head", "pooled", "conv")]
    at_old = DistillationPlan.from_config(with_overrides({**gan, "algorithm.gan_head": "pooled"}))
    assert at_old.semantic_differences(stored) == []
    assert set(ADDED_KEYS) <= set(plan_keys()) and not any(_is_mutable(k) for k in ADDED_KEYS)


def test_keys_of_multi_step_students_are_no_difference_for_a_1_step_student():
    """A 1-step student builds one GAN head and trains its only step whatever algorithm.gan_heads and
    algorithm.first_exit_probability say: a checkpoint of one resumes under the other; with more steps it
    does not."""
    gan = {"algorithm.gan_discriminator_weight": 0.01}
    one = {**gan, "algorithm.gan_heads": "shared", "algorithm.first_exit_probability": None}
    other = {**gan, "algorithm.gan_heads": "per_exit_group", "algorithm.first_exit_probability": 0.5}
    stored = DistillationPlan.from_config(with_overrides(one)).semantic_dict()
    assert DistillationPlan.from_config(with_overrides(other)).semantic_differences(stored) == []
    steps = {"algorithm.student_steps": 4}
    stored = DistillationPlan.from_config(with_overrides({**one, **steps})).semantic_dict()
    assert DistillationPlan.from_config(with_overrides({**other, **steps})).semantic_differences(stored) == [
        ("algorithm.first_exit_probability", None, 0.5),
        ("algorithm.gan_heads", "shared", "per_exit_group"),
    ]


@pytest.mark.parametrize(
    ("mesh", "nnodes", "per_node", "world_size", "shape"),
    [
        ("shard", 2, 4, 8, None),
        ("hybrid", 2, 4, 8, (2, 4)),
        ("hybrid", 1, 4, 4, None),  # one replica: plain sharding
        ([4, 2], 2, 4, 8, (4, 2)),
        ([1, 8], 2, 4, 8, None),
        ([8, 1], 2, 4, 8, (8, 1)),  # every rank a whole replica
        ("replicate", 2, 4, 8, (8, 1)),  # the same, at any rank count
        ("replicate", 1, 2, 2, (2, 1)),
        ("replicate", 1, 2, 1, None),  # one rank (the local backend): nothing to replicate over
    ],
)
def test_fsdp_mesh_shape(mesh, nnodes, per_node, world_size, shape):
    """model.fsdp_mesh resolves to the (replicate, shard) sizes of the mesh the engine builds."""
    from verl_dmd.runtime.sharding import mesh_shape

    plan = DistillationPlan.from_config(with_overrides({
        "model.fsdp_mesh": mesh, "resources.nnodes": nnodes, "resources.workers_per_node": per_node,
    }))  # fmt: skip
    assert mesh_shape(plan, world_size) == shape


@pytest.mark.parametrize("mesh", ["hybrid", [2, 4]])
def test_fsdp_mesh_that_does_not_match_the_process_group_is_refused(mesh):
    """A launch with another rank count than the plan's resources: one line naming the key and the fix."""
    from verl_dmd.runtime.sharding import mesh_shape

    plan = DistillationPlan.from_config(with_overrides({
        "model.fsdp_mesh": mesh, "resources.nnodes": 2, "resources.workers_per_node": 4,
    }))  # fmt: skip
    with pytest.raises(ValueError, match=r"^model.fsdp_mesh = .*6 ranks.*fix: ") as info:
        mesh_shape(plan, 6)
    assert "\n" not in str(info.value)
