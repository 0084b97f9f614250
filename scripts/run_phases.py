"""Run N DMD2-schedule phases of the role runtime with the reference computer, without ray.

Launch one process per device with torchrun; gloo on CPU, NCCL on CUDA:

    torchrun --nproc-per-node 2 scripts/run_phases.py --family sd3 --layout shared_base_adapters --phases 12
    torchrun --nproc-per-node 8 scripts/run_phases.py --device cuda --param-dtype bfloat16 --config my_sd3.json

The model is built from a config (a tiny one per family by default, or a JSON file
given with --config), so nothing is downloaded. Rank 0 prints one line of metrics
per phase and a summary with parameter bytes per rank.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from verl_dmd.adapters import available_adapters, get_adapter
from verl_dmd.algorithms.reference import ReferenceRegressionComputer, regression_batch
from verl_dmd.controller import DistillationController
from verl_dmd.phases import PhaseRequest, Role
from verl_dmd.plan import DistillationPlan, PlanError
from verl_dmd.runtime.engine import RoleEngine
from verl_dmd.runtime.runtime import DistillationRoleRuntime


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=available_adapters(), default="sd3")
    parser.add_argument(
        "--layout", choices=["shared_base_adapters", "independent"], default="shared_base_adapters"
    )
    parser.add_argument("--phases", type=int, default=12)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--param-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--config", type=Path, help="JSON model config (default: the adapter's tiny_config)")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--fake-update-ratio", type=int, default=2)
    args = parser.parse_args(argv)
    if args.phases < 1:
        parser.error(f"--phases {args.phases}: must be >= 1")
    if args.config is not None and not args.config.is_file():
        parser.error(f"--config {args.config}: no such file")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("run_phases: --device cuda but torch sees no GPU", file=sys.stderr)
            return 2
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "RANK" not in os.environ:  # plain `python scripts/run_phases.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29512")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model_config = (
        json.loads(args.config.read_text()) if args.config else get_adapter(args.family).tiny_config
    )
    try:
        plan = DistillationPlan.from_config(
            {
                "model": {
                    "adapter": args.family,
                    "storage": args.layout,
                    "param_dtype": args.param_dtype,
                    "teacher": {"config": model_config},
                    "student": {"lora": {"rank": args.lora_rank}},
                    "fake_score": {"lora": {"rank": args.lora_rank}},
                },
                "data": {"name": "synthetic"},
                "algorithm": {"fake_update_ratio": args.fake_update_ratio},
                "batch": {
                    role: {"micro_batch_size": args.micro_batch, "accumulation_steps": args.accumulation}
                    for role in ("student", "fake_score")
                },
                "resources": {"device": args.device, "workers_per_node": world},
            }
        )
    except PlanError as err:
        print(f"run_phases: error: {err}", file=sys.stderr)
        return 2
    run(args, plan, rank, world)
    # The models sit in reference cycles and hold the group through their device mesh: collected before
    # the group is destroyed, or their late destruction can abort a rank (docs/architecture.md).
    gc.collect()
    dist.destroy_process_group()
    return 0


def run(args, plan: DistillationPlan, rank: int, world: int) -> None:
    adapter = get_adapter(args.family)()
    started = time.perf_counter()
    engine = RoleEngine(plan, adapter, device=args.device)
    runtime = DistillationRoleRuntime(engine, ReferenceRegressionComputer(adapter))
    controller = DistillationController(fake_update_ratio=args.fake_update_ratio)
    if rank == 0:
        print(
            f"run_phases: built {args.layout} {args.family} on {world} rank(s) in {time.perf_counter() - started:.1f}s"
        )
    per_rank = args.micro_batch * args.accumulation
    for phase in range(args.phases):
        role = controller.next_phase()
        step = controller.student_steps if role is Role.STUDENT else controller.fake_steps
        request = PhaseRequest(
            role=role, global_step=controller.global_step, role_step=step, phase_index=controller.phase_index
        )
        batch = regression_batch(adapter, engine.module_for(role), per_rank * world, seed=phase)
        local = {k: v.chunk(world)[rank] for k, v in batch.items()}
        metrics = runtime.run_phase(request, local)
        controller.record(role, stepped=metrics["stepped"])
        if rank == 0:
            print(
                f"phase {phase:3d} {role.value:10s} loss {metrics[f'{role.value}/loss']:.5f} "
                f"grad_norm {metrics[f'{role.value}/grad_norm']:.4f} stepped {metrics['stepped']} "
                f"{metrics['phase_seconds'] * 1000:.0f} ms",
                flush=True,
            )
    if rank == 0:
        print(f"run_phases: done; {controller!r}")
        print(f"run_phases: parameter bytes on rank 0: {engine.parameter_bytes()}")


if __name__ == "__main__":
    sys.exit(main())
