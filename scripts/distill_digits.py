"""Distil the digits teacher with DMD2 in one process (no ray) and report the student's digits quality.

A first, single-process runner for the embedded default (the ray trainer comes
later). It builds the plan from the digits recipe plus overrides, drives the
controller, the role runtime and the DMD2 computer, and prints the 1-step and
multi-step quality of the student and its EMA at the end:

    python scripts/distill_digits.py --teacher outputs/digits_teacher --cycles 300
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from verl_dmd import config_dir, recipes_dir
from verl_dmd.adapters import get_adapter
from verl_dmd.algorithms.dmd2 import DMD2Computer
from verl_dmd.controller import DistillationController
from verl_dmd.data.digits import NUM_CLASSES, load_digits_splits
from verl_dmd.eval.digits_classifier import digits_quality, train_digits_classifier
from verl_dmd.phases import PhaseRequest, Role
from verl_dmd.plan import DistillationPlan
from verl_dmd.runtime.engine import RoleEngine
from verl_dmd.runtime.runtime import DistillationRoleRuntime


def digits_batch(size: int, generator: torch.Generator, null_class: int) -> dict[str, torch.Tensor]:
    labels = torch.randint(NUM_CLASSES, (size,), generator=generator)
    return {
        "noise": torch.randn(size, 1, 8, 8, generator=generator),
        "cond.class_labels": labels,
        "uncond.class_labels": torch.full_like(labels, null_class),
    }


def build_plan(teacher: Path, overrides: list[str]) -> DistillationPlan:
    recipe = OmegaConf.load(recipes_dir() / "digits_dmd2.yaml")
    recipe.pop("defaults")
    recipe.pop("hydra")
    config = OmegaConf.merge(OmegaConf.load(config_dir() / "dmd2.yaml"), recipe)
    config.model.teacher.config = None
    config.model.teacher.path = str(teacher)
    config.merge_with_dotlist(overrides)
    return DistillationPlan.from_config(config)


@torch.no_grad()
def sample_student(engine, computer, role: Role, labels: torch.Tensor, steps: int, generator) -> torch.Tensor:
    """Few-step sampling along the student's schedule (x0 prediction, re-noise, repeat)."""
    adapter = computer.adapter
    x_t = torch.randn(labels.shape[0], 1, 8, 8, generator=generator)
    schedule = torch.linspace(1.0, 0.0, steps + 1)
    with engine.use_role(role) as module:
        for i in range(steps):
            sigma = schedule[i].expand(labels.shape[0])
            x0 = x_t - sigma.view(-1, 1, 1, 1) * adapter.predict(module, x_t, sigma, {"class_labels": labels})
            if i + 1 < steps:
                x_t = (1 - schedule[i + 1]) * x0 + schedule[i + 1] * torch.randn(
                    x0.shape, generator=generator
                )
    return x0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--teacher", type=Path, required=True, help="diffusers directory from train_digits_teacher.py"
    )
    parser.add_argument(
        "--cycles", type=int, default=300, help="student steps (each with K fake-score steps)"
    )
    parser.add_argument("--eval-samples", type=int, default=500)
    parser.add_argument("overrides", nargs="*", help="dotted plan overrides, e.g. optim.student.lr=1e-4")
    args = parser.parse_args(argv)
    if not (args.teacher / "config.json").is_file():
        parser.error(
            f"--teacher {args.teacher}: no config.json (train one with scripts/train_digits_teacher.py)"
        )
    torch.set_num_threads(2)
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    dist.init_process_group("gloo")
    plan = build_plan(args.teacher, args.overrides)
    adapter = get_adapter(plan.model.adapter)()
    engine = RoleEngine(plan, adapter)
    computer = DMD2Computer(adapter, plan.algorithm, seed=plan.trainer.seed, rank=0)
    runtime = DistillationRoleRuntime(engine, computer)
    controller = DistillationController(
        fake_update_ratio=plan.algorithm.fake_update_ratio,
        fake_warmup_steps=plan.algorithm.fake_warmup_steps,
        max_consecutive_skips=plan.trainer.max_consecutive_skips,
    )
    null = adapter.null_class(engine.module_for(Role.TEACHER))
    data = torch.Generator().manual_seed(plan.trainer.seed)
    started = time.perf_counter()
    while not controller.is_done(args.cycles):
        role = controller.next_phase()
        spec = getattr(plan.batch, role.value)
        step = controller.student_steps if role is Role.STUDENT else controller.fake_steps
        request = PhaseRequest(
            role=role, global_step=controller.global_step, role_step=step, phase_index=controller.phase_index
        )
        metrics = runtime.run_phase(
            request, digits_batch(spec.micro_batch_size * spec.accumulation_steps, data, null)
        )
        controller.record(role, stepped=metrics["stepped"])
        if role is Role.STUDENT and controller.global_step % max(1, args.cycles // 10) == 0:
            print(
                f"step {controller.global_step:4d} dmd_loss {metrics['student/dmd_loss']:.4f} "
                f"grad_norm {metrics['student/grad_norm']:.3f} {time.perf_counter() - started:6.1f}s",
                flush=True,
            )
    train, holdout = load_digits_splits(seed=0)
    classifier = train_digits_classifier(train, seed=0)
    labels = torch.arange(args.eval_samples) % NUM_CLASSES
    print("role         steps  digits-FID  accuracy")
    for role in (Role.STUDENT, Role.STUDENT_EMA):
        for steps in (1, 4):
            samples = sample_student(engine, computer, role, labels, steps, torch.Generator().manual_seed(1))
            quality = digits_quality(classifier, samples, labels, holdout)
            print(
                f"{role.value:12s} {steps:5d} {quality['fid']:11.2f} {quality['accuracy']:9.3f}", flush=True
            )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
