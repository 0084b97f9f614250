"""Distil the digits teacher with DMD2 in one process (no ray) and print the digits quality table.

The embedded default end to end without ray: the digits recipe (plus dotted
overrides) becomes a plan; the controller, the role runtime, the DMD2 computer
and the digits condition stream train the student; then the teacher (Euler, 1 to
32 steps) and the student and its EMA (1 step and the recipe's step count) are
sampled from the same noise, scored, and written to the output directory:

    python scripts/distill_digits.py [trainer.output_dir=outputs/digits_dmd2] [other.dotted=overrides]

``<trainer.output_dir>/table.md`` holds the table, ``<trainer.output_dir>/samples/``
one .npz and one PNG grid per row (one class per column); the recipe keeps the
regression pairs there too. The ray trainer (a later issue) will run
the same recipe on a worker group.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import safetensors
import safetensors.torch
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from verl_dmd import config_dir, recipes_dir
from verl_dmd.adapters import get_adapter
from verl_dmd.adapters.base import plain
from verl_dmd.assets import resolve_model_path
from verl_dmd.controller import DistillationController
from verl_dmd.data.digits import DigitsConditionStream, check_pairs, load_digits_splits, teacher_pairs
from verl_dmd.eval.digits_classifier import train_digits_classifier
from verl_dmd.eval.digits_report import TEACHER_STEPS, DigitsEvaluation, format_table
from verl_dmd.eval.sampling import euler_sample, even_schedule, few_step_sample
from verl_dmd.phases import PhaseRequest, Role
from verl_dmd.plan import DistillationPlan, PlanError
from verl_dmd.runtime.engine import RoleEngine
from verl_dmd.runtime.runtime import DistillationRoleRuntime

PAIR_STEPS = 32


def build_plan(overrides: list[str]) -> DistillationPlan:
    """The digits recipe over the base config, then the overrides (as `verl-dmd` composes it)."""
    recipe = OmegaConf.load(recipes_dir() / "digits_dmd2.yaml")
    recipe.pop("defaults")
    recipe.pop("hydra")
    config = OmegaConf.merge(OmegaConf.load(config_dir() / "dmd2.yaml"), recipe)
    config.merge_with_dotlist(overrides)
    return DistillationPlan.from_config(config)


def _euler_guidance(plan: DistillationPlan) -> float:
    """The teacher's CFG scale in the standard form (what the DMD term's teacher uses)."""
    alg = plan.algorithm
    return alg.teacher_guidance_scale + (1.0 if alg.cfg_form == "conditional_offset" else 0.0)


def teacher_digest(plan: DistillationPlan) -> str:
    """SHA-256 over the teacher's weight files (what the pairs depend on), or its config when built from one."""
    source = plan.model.teacher
    if source.path is None:
        return (
            "config:" + hashlib.sha256(json.dumps(plain(source.config), sort_keys=True).encode()).hexdigest()
        )
    folder = Path(resolve_model_path(source.path)) / (source.subfolder or "")
    digest = hashlib.sha256()
    for file in sorted([*folder.glob("*.safetensors"), *folder.glob("*.bin")]):
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def regression_pairs(
    plan: DistillationPlan, engine, adapter, labels: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The regression term's (noise, teacher sample) pairs: read from data.regression_pairs_path, or made
    there by the teacher (32 Euler steps, one pair per training label) when the file does not exist yet.

    A file this script made records the teacher's digest, the step count and the seed; reading one made
    for another teacher or seed is an error (delete it and it is made again)."""
    path = Path(plan.data.regression_pairs_path)
    expected = {
        "teacher_sha256": teacher_digest(plan),
        "euler_steps": str(PAIR_STEPS),
        "seed": str(plan.trainer.seed),
        "guidance": str(_euler_guidance(plan)),
    }
    if path.is_file():
        try:
            with safetensors.safe_open(path, framework="pt") as handle:
                metadata = handle.metadata() or {}
            pairs = safetensors.torch.load_file(path)
        except Exception as err:  # safetensors raises several types for a damaged file
            raise ValueError(
                f"data.regression_pairs_path = {str(path)!r}: not a readable safetensors file ({err}); "
                "fix: delete it to regenerate, or point the key at a digits pairs file"
            ) from None
        for key, want in expected.items():
            if key in metadata and metadata[key] != want:
                raise ValueError(
                    f"data.regression_pairs_path = {str(path)!r} was made with {key} = {metadata[key]!r}, this "
                    f"run has {want!r}; fix: delete the file to regenerate it, or use another path"
                )
        pairs = check_pairs(pairs, repr(str(path)))
        print(f"regression pairs: {path} ({pairs['noise'].shape[0]} pairs)")
        return pairs
    started = time.perf_counter()
    with engine.use_role(Role.TEACHER) as teacher:
        null = adapter.null_class(teacher)
        pairs = teacher_pairs(
            adapter, teacher, labels, seed=plan.trainer.seed + 7919, steps=PAIR_STEPS,
            guidance=_euler_guidance(plan), null_class=null,
        )  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    safetensors.torch.save_file(pairs, staging, metadata=expected)
    os.replace(staging, path)  # readers never see a half-written file
    print(
        f"regression pairs: {len(labels)} teacher samples ({PAIR_STEPS} Euler steps) in "
        f"{time.perf_counter() - started:.1f} s, saved to {path}"
    )
    return pairs


def train(plan: DistillationPlan, engine, computer, stream, cycles: int) -> None:
    runtime = DistillationRoleRuntime(engine, computer)
    controller = DistillationController(
        fake_update_ratio=plan.algorithm.fake_update_ratio,
        fake_warmup_steps=plan.algorithm.fake_warmup_steps,
        max_consecutive_skips=plan.trainer.max_consecutive_skips,
    )
    started = time.perf_counter()
    every = max(1, cycles // 20)
    fake_loss = float("nan")
    while not controller.is_done(cycles):
        role = controller.next_phase()
        spec = getattr(plan.batch, role.value)
        step = controller.student_steps if role is Role.STUDENT else controller.fake_steps
        request = PhaseRequest(
            role=role, global_step=controller.global_step, role_step=step, phase_index=controller.phase_index
        )
        metrics = runtime.run_phase(
            request, stream.next_batch(spec.micro_batch_size * spec.accumulation_steps)
        )
        controller.record(role, stepped=metrics["stepped"])
        if role is Role.FAKE_SCORE:
            fake_loss = metrics["fake_score/fake_loss"]
        elif controller.global_step % every == 0 or controller.global_step == cycles:
            elapsed = time.perf_counter() - started
            done = controller.global_step
            print(
                f"step {done:5d}/{cycles}  dmd_loss {metrics['student/dmd_loss']:.4f}  fake_loss "
                f"{fake_loss:.4f}  grad_norm {metrics['student/grad_norm']:.3f}  skips {controller.student_skips + controller.fake_skips}  "
                f"{elapsed:6.1f}s  eta {elapsed / done * (cycles - done):6.1f}s",
                flush=True,
            )


def evaluate(plan: DistillationPlan, engine, computer, *, samples: int, out: Path):
    """The quality rows of the teacher, the student and its EMA; returns (markdown table, rows)."""
    adapter = computer.adapter
    train_split, holdout = load_digits_splits(seed=0)
    evaluation = DigitsEvaluation(
        train_digits_classifier(train_split, seed=0), holdout, num_samples=samples, out_dir=out
    )
    cond = {"class_labels": evaluation.labels}
    null = {
        "class_labels": torch.full_like(
            evaluation.labels, adapter.null_class(engine.module_for(Role.TEACHER))
        )
    }
    guidance = _euler_guidance(plan)
    rows = []
    with engine.use_role(Role.TEACHER) as teacher:
        for steps in TEACHER_STEPS:
            images = euler_sample(
                adapter, teacher, evaluation.noise, cond, steps, guidance=guidance, uncond=null
            )
            rows.append(evaluation.row("teacher", "euler", steps, images))
    student_steps = sorted({1, plan.algorithm.student_steps, *plan.validation.sampling_steps})
    for role in (Role.STUDENT, Role.STUDENT_EMA) if plan.ema.enabled else (Role.STUDENT,):
        with engine.use_role(role) as module:
            for steps in student_steps:
                schedule = (
                    computer.schedule
                    if steps == plan.algorithm.student_steps
                    else even_schedule(steps, plan.algorithm.sigma_shift)
                )
                images = few_step_sample(
                    adapter, module, evaluation.noise, cond, schedule, evaluation.renoise_generator()
                )
                rows.append(evaluation.row(role.value, "few-step", steps, images))
    return format_table(rows), rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cycles", type=int, default=None, help="student steps (default: the recipe's trainer.total_steps)"
    )
    parser.add_argument("--eval-samples", type=int, default=500, help="samples per table row")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("overrides", nargs="*", help="dotted plan overrides, e.g. optim.student.lr=1e-4")
    args = parser.parse_args(argv)
    try:
        plan = build_plan(args.overrides)
    except PlanError as err:
        parser.error(str(err))
    cycles = plan.trainer.total_steps if args.cycles is None else args.cycles
    args.out = Path(plan.trainer.output_dir)
    if cycles < 1 or args.eval_samples < 10:
        parser.error(f"--cycles {cycles} / --eval-samples {args.eval_samples}: need >= 1 and >= 10")
    torch.set_num_threads(args.threads)
    # A 1-rank group on an in-process store: no port, so concurrent runs never collide.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        adapter = get_adapter(plan.model.adapter)()
        train_split, _ = load_digits_splits(seed=0)
        try:  # user input (teacher path, pairs file) is checked here: one-line errors
            engine = RoleEngine(plan, adapter)
            computer = adapter.build_distribution_matching_computer(plan.model, plan, rank=0)
            pairs = (
                regression_pairs(plan, engine, adapter, train_split.labels)
                if plan.algorithm.regression_weight
                else None
            )
        except ValueError as err:
            parser.error(str(err).splitlines()[0])
        stream = DigitsConditionStream(
            train_split.labels,
            null_class=adapter.null_class(engine.module_for(Role.TEACHER)),
            seed=plan.trainer.seed,
            pairs=pairs,
            real=train_split if plan.algorithm.gan_discriminator_weight > 0 else None,
        )
        started = time.perf_counter()
        train(plan, engine, computer, stream, cycles)
        trained = time.perf_counter() - started
        table, _ = evaluate(plan, engine, computer, samples=args.eval_samples, out=args.out)
    finally:
        dist.destroy_process_group()
    header = (
        f"digits DMD2: {cycles} student steps (K={plan.algorithm.fake_update_ratio}) in {trained:.0f} s; "
        f"{args.eval_samples} samples per row against the 360 held-out digits"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(f"{header}\n\n{table}\n")
    print(f"\n{header}\n\n{table}\n\nsamples and grids: {args.out / 'samples'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
