"""The digits data provider and validator, driver side: they ask the worker group to sample.

- `DigitsProvider`: class labels, starting noise, the regression term's teacher
  pairs (made by the teacher through the workers on first use, kept at
  ``data.regression_pairs_path``) and, for the GAN term, real digits; global
  batches by position (`DigitsConditionStream`), so the state is one integer and
  the batches do not depend on the world size.
- `DigitsValidator`: the quality table (digits-FID, class accuracy, k-NN precision
  and recall against the held-out split, and the memorisation ratio) of the teacher (Euler, 1 to 32 steps) and of the student
  roles (1 step and the trained step count), sample grids and .npz files.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from verl_dmd import losses, seeding
from verl_dmd.data.digits import IMAGE_SHAPE, DigitsConditionStream, check_pairs, load_digits_splits
from verl_dmd.trainer.registry import ValidationReport, register_data_provider, register_validator

PAIR_STEPS = 32
"""Euler steps of the teacher samples the regression term regresses on."""


def teacher_guidance(plan) -> float:
    """The teacher's CFG scale in the standard form (what the DMD term's teacher uses)."""
    return losses.standard_guidance_scale(plan.algorithm.teacher_guidance_scale, plan.algorithm.cfg_form)


def teacher_digest(plan) -> str:
    """SHA-256 over the teacher's weight files (what the pairs depend on), or its config when built from one."""
    from verl_dmd.digests import model_sha256

    source = plan.model.teacher
    return model_sha256(source.path, source.subfolder, source.config)


def regression_pairs(plan, group, labels: torch.Tensor, null_class: int, log: Callable[[str], None]):
    """The regression term's (noise, teacher sample) pairs: read from data.regression_pairs_path, or made
    there by the teacher (32 Euler steps, one pair per training label, split over the ranks) when the
    file does not exist yet. A file made for another teacher, seed or guidance is a one-line error."""
    path = Path(plan.data.regression_pairs_path)
    expected = {
        "teacher_sha256": teacher_digest(plan),
        "euler_steps": str(PAIR_STEPS),
        "seed": str(plan.trainer.seed),
        "guidance": str(teacher_guidance(plan)),
    }
    if path.is_file():
        try:
            with safetensors.safe_open(path, framework="pt") as handle:
                metadata = handle.metadata() or {}
            pairs = safetensors.torch.load_file(path)
        except Exception as err:  # safetensors raises several types for a damaged file
            raise ValueError(
                f"config key 'data.regression_pairs_path' = {str(path)!r}: not a readable safetensors file "
                f"({err}); fix: delete it to regenerate, or point the key at a digits pairs file"
            ) from None
        for key, want in expected.items():  # the pairs' identity: what made them, not where they lie
            if metadata.get(key) != want:
                made = f"was made with {key} = {metadata[key]!r}" if key in metadata else f"records no {key}"
                raise ValueError(
                    f"config key 'data.regression_pairs_path' = {str(path)!r} {made}, this run has {want!r}; "
                    "fix: delete the file to regenerate it, or use another path"
                )
        pairs = check_pairs(pairs, repr(str(path)))
        log(f"regression pairs: {path} ({pairs['noise'].shape[0]} pairs)")
        return pairs
    started = time.perf_counter()
    labels = labels.to(torch.int64)
    noise = torch.randn(
        labels.shape[0], *IMAGE_SHAPE, generator=seeding.generator(plan.trainer.seed, "digits.pairs")
    )
    guidance = teacher_guidance(plan)
    uncond = {"class_labels": torch.full_like(labels, null_class)} if guidance != 1.0 else None
    target = group.euler(
        "teacher", noise, {"class_labels": labels}, PAIR_STEPS, guidance=guidance, uncond=uncond
    )
    pairs = {"noise": noise, "target": target, "cond.class_labels": labels}
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    safetensors.torch.save_file(pairs, staging, metadata=expected)
    os.replace(staging, path)  # readers never see a half-written file
    log(
        f"regression pairs: {len(labels)} teacher samples ({PAIR_STEPS} Euler steps) in "
        f"{time.perf_counter() - started:.1f} s, saved to {path}"
    )
    return pairs


@register_data_provider("digits")
class DigitsProvider:
    """Global batches of the digits run; `state_dict` is its position (checkpointed)."""

    validator = "digits"

    @classmethod
    def from_plan(cls, plan, group, info, log: Callable[[str], None] = print) -> DigitsProvider:
        return cls(plan, group, info, log)

    def __init__(self, plan, group, info, log: Callable[[str], None] = print) -> None:
        train_split, _ = load_digits_splits(seed=0)
        null_class = info.null_class
        if null_class is None:
            raise ValueError(
                f"config key 'data.name' = 'digits': model adapter {plan.model.adapter!r} has no class "
                "conditioning; fix: model.adapter=dit"
            )
        pairs = (
            regression_pairs(plan, group, train_split.labels, null_class, log)
            if plan.algorithm.regression_weight > 0
            else None
        )
        self.stream = DigitsConditionStream(
            train_split.labels,
            null_class=null_class,
            seed=plan.trainer.seed,
            pairs=pairs,
            real=train_split if plan.algorithm.gan_discriminator_weight > 0 else None,
        )

    def next_batch(self, size: int) -> dict[str, torch.Tensor]:
        return self.stream.next_batch(size)

    def state_dict(self) -> dict[str, int]:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.stream.load_state_dict(state)


@register_validator("digits")
class DigitsValidator:
    """The digits quality table of the roles in validation.roles, sampled through the worker group."""

    @classmethod
    def from_plan(cls, plan, group, info) -> DigitsValidator:
        if info.null_class is None:
            raise ValueError(
                f"config key 'validation.name' = 'digits': the digits table samples class-conditional models, "
                f"model adapter {plan.model.adapter!r} has no class conditioning; fix: model.adapter=dit, or "
                "another validator"
            )
        return cls(plan, group, info)

    def __init__(self, plan, group, info) -> None:
        self.plan, self.group, self.info = plan, group, info

    @staticmethod
    @functools.cache
    def _parts(threads: int):
        """The classifier and the two splits, made once per process and CPU thread count (about 9 s of a
        2-core CPU): a second run in the same process (a notebook, the tests) scores with the same ones. Its
        training is deterministic at a given thread count; another count can move its weights by rounding,
        so a run under another count trains its own, as every run did before the cache."""
        from verl_dmd.eval.digits_classifier import train_digits_classifier

        train_split, holdout = load_digits_splits(seed=0)
        return train_digits_classifier(train_split, seed=0), holdout, train_split

    def run(self, out_dir: Path, global_step: int) -> ValidationReport:
        """Sample and score every row; write samples under `out_dir`; the table and its metrics."""
        from verl_dmd.algorithms.sampling import even_schedule, renoise_draws, trained_schedule
        from verl_dmd.eval.digits_report import TEACHER_STEPS, DigitsEvaluation, format_table

        classifier, holdout, train_split = self._parts(torch.get_num_threads())
        plan, info = self.plan, self.info
        evaluation = DigitsEvaluation(
            classifier, holdout, train_split, num_samples=plan.validation.num_samples, out_dir=out_dir
        )
        cond = {"class_labels": evaluation.labels}
        guidance = teacher_guidance(plan)
        uncond = {"class_labels": torch.full_like(evaluation.labels, info.null_class)}
        rows = []
        roles = plan.validation.roles
        if "teacher" in roles:
            for steps in TEACHER_STEPS:
                images = self.group.euler("teacher", evaluation.noise, cond, steps, guidance=guidance,
                                          uncond=uncond if guidance != 1.0 else None)  # fmt: skip
                rows.append(evaluation.row("teacher", "euler", steps, images))
        trained = plan.algorithm.student_steps
        for role in (r for r in ("student", "student_ema") if r in roles):
            for steps in sorted({1, trained, *plan.validation.sampling_steps}):
                if steps == trained:
                    schedule = trained_schedule(plan.algorithm, info.sigma_max).tolist()
                else:
                    schedule = even_schedule(steps, plan.algorithm.sigma_shift, info.sigma_max).tolist()
                renoise = renoise_draws(evaluation.noise.shape, steps, evaluation.renoise_generator())
                images = self.group.few_step(role, evaluation.noise, cond, schedule, renoise)
                rows.append(evaluation.row(role, "few-step", steps, images))
        metrics = {}
        for row in rows:
            metrics[f"val/{row.model}_{row.steps}step/fid"] = row.fid
            metrics[f"val/{row.model}_{row.steps}step/accuracy"] = row.accuracy
            metrics[f"val/{row.model}_{row.steps}step/precision"] = row.precision
            metrics[f"val/{row.model}_{row.steps}step/recall"] = row.recall
            metrics[f"val/{row.model}_{row.steps}step/memorisation"] = row.memorisation
        return ValidationReport(
            title="digits quality",
            scope=f"{plan.validation.num_samples} samples per row against the {len(holdout)} held-out digits",
            table=format_table(rows),
            metrics=metrics,
            samples=out_dir / "samples",
        )
