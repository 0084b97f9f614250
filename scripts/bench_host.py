"""Host time of the per-phase bookkeeping the GPU waits for: `verify_layout` and the AdamW step.

One process, CPU, gloo with one rank: the SD3 shape (layers, LoRA rank 64 on
to_q/k/v/out, so 192 LoRA tensors per role) at a tiny width, so that the
arithmetic is negligible and what is left is host work. Median of --repeats
calls each:

- `verify_layout`: the kept-tree check of every phase, and the full walk;
- the fake-score role's AdamW step, on the DTensors (`optimizer.step()`) and on
  their local shards (`LocalShardStep`, the default), and for comparison an AdamW
  of the same parameters with `foreach=False` (the single-tensor path, which the
  engine does not use) on the DTensors.

    python scripts/bench_host.py --layers 24 --hidden 64
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_offload import code_version, sd3_config


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=64, help="a multiple of 64 (the head dimension)")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    if args.hidden % 64:
        parser.error(f"--hidden {args.hidden}: must be a multiple of 64 (attention_head_dim)")
    from verl_dmd.adapters import get_adapter
    from verl_dmd.phases import Role
    from verl_dmd.plan import DistillationPlan
    from verl_dmd.runtime.engine import RoleEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    config = sd3_config(args.layers, args.hidden)
    config.update({"sample_size": 8, "joint_attention_dim": 32, "pooled_projection_dim": 16})
    lora = {"rank": 64, "alpha": 64.0}
    plan = DistillationPlan.from_config({
        "model": {"adapter": "sd3", "storage": "shared_base_adapters", "teacher": {"config": config},
                  "student": {"lora": lora}, "fake_score": {"lora": lora}},
        "data": {"name": "synthetic"},
        "export": {"formats": ["diffusers"]},
    })  # fmt: skip
    engine = RoleEngine(plan, get_adapter("sd3")(), device=torch.device("cpu"))
    role = Role.FAKE_SCORE
    params = engine.params[role]
    for p in params:
        p.grad = torch.zeros_like(p)
    engine.optimizers[role].step()  # AdamW makes its state at the first step

    def step(local: bool):
        engine.local_optimizer_step = local
        engine.optimizer_step(role)

    single = torch.optim.AdamW(params, lr=1e-4, foreach=False)
    single.step()  # its state, made at the first step

    engine.verify_layout()  # the full walk that keeps the tree
    rows = {
        "verify_layout, kept tree (every phase)": median_ms(engine.verify_layout, args.repeats),
        "verify_layout, full walk": median_ms(engine.guard.walk, args.repeats),
        "AdamW step on the DTensors": median_ms(lambda: step(False), args.repeats),
        "AdamW step on the local shards": median_ms(lambda: step(True), args.repeats),
        "AdamW step on the DTensors, foreach=False": median_ms(single.step, args.repeats),
    }
    modules = sum(1 for model in engine.models.values() for _ in model.modules())
    print(f"SD3 shape, {args.layers} layers x {args.hidden}, {modules} modules, {len(params)} LoRA tensors per role, "
          f"CPU, one thread, code {code_version()}")  # fmt: skip
    print("| host work | ms (median) |")
    print("|---|---|")
    for name, ms in rows.items():
        print(f"| {name} | {ms:.2f} |")
    engine = params = single = None  # the model's reference cycles hold the group: collected before it goes
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
