"""DMD2 cycle scaling over ranks: per-GPU throughput at N ranks, weak or strong, and the collectives' time per phase.

One process per device, launched by torchrun (NCCL on CUDA, gloo on CPU); no ray. Every rank builds the
role engine of one family's transformer (random init, bf16 compute, the shared-base LoRA layout by default)
and runs DMD2 cycles (1 student + K fake-score phases) on its share of the batch:

- weak scaling (``--per-gpu-batch B``): every rank takes B samples per phase, the global batch grows with N;
- strong scaling (``--global-batch G``): the ranks split G samples per phase (G must divide by N).

A phase's time is the slowest rank's (each rank waits for the device, then one all-reduce of the maximum).
With ``--trace`` one more cycle runs under a device-only profiler on every rank (CPU activity on a CPU run),
one trace per phase. Per phase, the slowest rank's: wall time; busy time of the collectives (NCCL's
kernels; on a CPU, gloo's collective operators) and of all other device work (each the union over
streams); ``collective_alone_s``, the collectives' time with no other device work running (what they cost
the phase on the device: NCCL runs on its own streams and overlaps compute otherwise); and
``not_compute_s``, wall time minus the other work's busy time (collectives alone plus the device's idle
time: host launches, waits).

    torchrun --standalone --nproc-per-node 8 scripts/bench_scaling.py --compile --per-gpu-batch 2 --trace \\
        --json weak_8.json
    torchrun --standalone --nproc-per-node 4 scripts/bench_scaling.py --compile --global-batch 8 --json strong_4.json
    python scripts/bench_scaling.py --summarize weak_*.json   # one mode at a time

A smoke run without a GPU (gloo, the family's tiny shapes):

    torchrun --standalone --nproc-per-node 2 scripts/bench_scaling.py --device cpu --tiny --per-gpu-batch 1 \\
        --k 1 --repeats 1 --trace --json smoke.json

Rank 0 prints a line per timed cycle and writes the JSON; ``--summarize`` reads such files (one per rank
count, the same mode, family and batch) and prints per-GPU throughput and its efficiency against the fewest
ranks among them: weak, samples/s/GPU at N over at the fewest ranks; strong, the speed-up over the rank
ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_offload import code_version
from bench_phases import FAMILIES, built_on, make_batch, make_workload, synchronize

COLLECTIVE_MARKERS = ("nccl", "gloo", "c10d::")
"""Lower-case name fragments of the events that are collectives: NCCL's kernels on a GPU; on a CPU run, the
c10d operators (their gloo work runs inside them)."""


def fail(message: str) -> None:
    """One line on stderr (rank 0 only, the others say the same), exit 2."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"bench_scaling: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--summarize", nargs="+", type=Path, default=None, metavar="JSON",
                        help="print the scaling table of these result files and exit (no ranks needed)")  # fmt: skip
    parser.add_argument("--family", choices=FAMILIES, default="sd3")
    parser.add_argument(
        "--layout", choices=["shared_base_adapters", "independent"], default="shared_base_adapters"
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="transformer blocks (default: the family's; sd3 24)"
    )
    parser.add_argument("--hidden", type=int, default=None, help="sd3 only: its width (default 1536)")
    parser.add_argument("--tiny", action="store_true", help="the family's tiny shapes: a smoke run")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--lora-rank", type=int, default=64)
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--per-gpu-batch", type=int, default=None, help="weak scaling: samples per rank per phase"
    )
    group.add_argument("--global-batch", type=int, default=None,
                       help="strong scaling: samples per phase over all ranks (divisible by the rank count)")  # fmt: skip
    parser.add_argument("--k", type=int, default=5, help="fake-score phases per student phase")
    parser.add_argument("--warmup", type=int, default=2, help="untimed cycles (compilation happens here)")
    parser.add_argument("--repeats", type=int, default=3, help="timed cycles")
    parser.add_argument("--compile", action="store_true", help="model.compile=true")
    parser.add_argument("--keep-gathered", action="store_true", help="model.reshard_after_forward=false")
    parser.add_argument("--fsdp-mesh", default="shard",
                        help="model.fsdp_mesh: shard, hybrid (needs --nodes), replicate, or REPLICATExSHARD, e.g. 2x4")  # fmt: skip
    parser.add_argument("--nodes", type=int, default=1, help="resources.nnodes for --fsdp-mesh hybrid")
    parser.add_argument("--trace", action="store_true",
                        help="one more cycle under the profiler: collective and compute busy time per phase")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.summarize is not None:
        return args
    if args.per_gpu_batch is None and args.global_batch is None:
        fail("give --per-gpu-batch B (weak scaling) or --global-batch G (strong scaling)")
    for flag, value, least in [("--per-gpu-batch", args.per_gpu_batch, 1), ("--global-batch", args.global_batch, 1),
                               ("--k", args.k, 1), ("--warmup", args.warmup, 0), ("--repeats", args.repeats, 1),
                               ("--layers", args.layers, 1), ("--nodes", args.nodes, 1)]:  # fmt: skip
        if value is not None and value < least:
            fail(f"{flag} {value}: must be >= {least}")
    if args.hidden is not None and (args.family != "sd3" or args.tiny):
        fail(f"--hidden {args.hidden}: sets the width of the full-size sd3 shape only; fix: drop --hidden")
    if args.family == "sd3" and not args.tiny:
        args.layers = 24 if args.layers is None else args.layers
        args.hidden = 1536 if args.hidden is None else args.hidden
    return args


def fsdp_mesh(text: str):
    """--fsdp-mesh as the plan key's value: shard, hybrid, replicate, or [replicate, shard] from 'RxS'."""
    if text in ("shard", "hybrid", "replicate"):
        return text
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        fail(
            f"--fsdp-mesh {text}: allowed: shard, hybrid, replicate, or REPLICATExSHARD with positive sizes, e.g. 2x4"
        )
    return [int(parts[0]), int(parts[1])]


def _is_collective(name: str) -> bool:
    return any(marker in name.lower() for marker in COLLECTIVE_MARKERS)


def kernel_split(trace: Path) -> tuple[float, float, int, float]:
    """(collective busy seconds, other busy seconds, collective count, collective seconds with nothing else
    running) of a device-only chrome trace of one phase: NCCL's kernels against every other kernel, copy
    and memset, each the union of its intervals over all streams."""
    from trace_gaps import DEVICE_CATEGORIES, clip, load, merge

    device = [
        e for e in load(trace) if e.get("ph") == "X" and "ts" in e and e.get("cat") in DEVICE_CATEGORIES
    ]
    names = [_is_collective(e["name"]) for e in device]
    collective = merge(
        [(e["ts"], e["ts"] + e.get("dur", 0)) for e, c in zip(device, names, strict=True) if c]
    )
    other = merge([(e["ts"], e["ts"] + e.get("dur", 0)) for e, c in zip(device, names, strict=True) if not c])
    exposed = sum((hi - lo) - sum(b - a for a, b in clip(other, lo, hi)) for lo, hi in collective)
    return (
        sum(hi - lo for lo, hi in collective) / 1e6,
        sum(hi - lo for lo, hi in other) / 1e6,
        sum(names),
        exposed / 1e6,
    )


def collective_split(events) -> tuple[float, float, int]:
    """(collective busy seconds, other busy seconds, collective count) of one phase profiled on a CPU: the
    outermost collective operators against the rest of the phase's range (``phase:<role>``), on the
    phase's thread."""
    collective = 0.0
    count = 0
    phases = [
        e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("phase:")
    ]
    threads = {e.thread for e in phases}  # gloo's own threads record the same work again: not counted
    phase_s = sum(e.time_range.elapsed_us() for e in phases) / 1e6
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU or event.thread not in threads:
            continue
        if not _is_collective(event.name):
            continue
        parent, nested = event.cpu_parent, False
        while parent is not None:
            nested = nested or _is_collective(parent.name)
            parent = parent.cpu_parent
        if not nested:
            collective += event.time_range.elapsed_us() / 1e6
            count += 1
    return collective, max(0.0, phase_s - collective), count


def slowest(values: list[float], device: torch.device) -> list[float]:
    """Element-wise maximum over ranks."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def run(args) -> int:
    from verl_dmd.adapters import get_adapter
    from verl_dmd.controller import DistillationController
    from verl_dmd.phases import PhaseRequest
    from verl_dmd.plan import DistillationPlan, PlanError
    from verl_dmd.runtime.engine import RoleEngine
    from verl_dmd.runtime.runtime import DistillationRoleRuntime

    if "RANK" not in os.environ:
        fail(
            "launch it with torchrun (e.g. torchrun --standalone --nproc-per-node 2 scripts/bench_scaling.py ...)"
        )
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        fail("needs CUDA devices; fix: run on GPUs, or --device cpu --tiny for a smoke run")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    per_rank = args.per_gpu_batch
    if args.global_batch is not None:
        if args.global_batch % world:
            fail(
                f"--global-batch {args.global_batch}: not divisible by the {world} ranks; fix: a multiple of {world}"
            )
        per_rank = args.global_batch // world
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    work = make_workload(args.family, tiny=args.tiny, layers=args.layers, hidden=args.hidden, frames=None)
    lora = {"rank": args.lora_rank, "alpha": float(args.lora_rank)}
    if world % args.nodes:
        fail(f"--nodes {args.nodes}: does not divide the {world} ranks; fix: a divisor of {world}")
    per_node = world // args.nodes
    try:
        plan = DistillationPlan.from_config({
            "algorithm": {"fake_update_ratio": args.k, "teacher_guidance_scale": work.guidance_scale,
                          "sigma_shift": work.sigma_shift},
            "model": {"adapter": work.family, "storage": args.layout, "param_dtype": "bfloat16",
                      "compile": args.compile, "reshard_after_forward": not args.keep_gathered,
                      "fsdp_mesh": fsdp_mesh(args.fsdp_mesh), "teacher": {"config": work.transformer},
                      "student": {"lora": lora}, "fake_score": {"lora": lora}},
            "batch": {"student": {"micro_batch_size": per_rank}, "fake_score": {"micro_batch_size": per_rank}},
            "resources": {"nnodes": args.nodes, "workers_per_node": per_node},
            "data": {"name": "synthetic"},
            "export": {"formats": ["diffusers"]},
        })  # fmt: skip
    except PlanError as err:
        fail(str(err))
    started = time.perf_counter()
    adapter = get_adapter(work.family)()
    if cuda and args.family != "sd3":
        adapter = built_on(adapter, device)  # the host cannot hold float32 copies of the larger families
    computer = adapter.build_distribution_matching_computer(plan.model, plan, rank=rank)
    try:
        engine = RoleEngine(plan, adapter, device=device, extra_modules=computer.extra_modules())
    except ValueError as err:  # the mesh against the launched ranks
        fail(str(err).splitlines()[0])
    runtime = DistillationRoleRuntime(engine, computer)
    build_s = time.perf_counter() - started
    controller = DistillationController(fake_update_ratio=args.k, fake_warmup_steps=0)
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own samples

    def phase(activities=None):
        """One phase; with `activities`, under a profiler started after the barrier (so the barrier's own
        collective is not counted): (role, seconds, the profiler or None)."""
        role = controller.next_phase()
        request = PhaseRequest(role=role, global_step=controller.global_step, role_step=0,
                               phase_index=controller.phase_index)  # fmt: skip
        batch = make_batch(work, per_rank, generator, pin=cuda)
        synchronize(device)
        dist.barrier()
        synchronize(device)
        prof = None
        if activities is not None:
            from torch.profiler import profile

            prof = profile(activities=activities)
            prof.start()
        begin = time.perf_counter()
        with record_function(f"phase:{role.value}"):
            metrics = runtime.run_phase(request, batch)
            synchronize(device)
        seconds = time.perf_counter() - begin
        if prof is not None:
            prof.stop()
        controller.record(role, stepped=metrics["stepped"])
        return role, seconds, prof

    warm = time.perf_counter()
    for _ in range(args.warmup * (args.k + 1)):
        phase()
    warmup_s = time.perf_counter() - warm
    times: dict[str, list[float]] = {"student": [], "fake_score": []}
    cycles = []
    for repeat in range(args.repeats):
        own = [phase()[:2] for _ in range(args.k + 1)]
        worst = slowest([seconds for _, seconds in own], device)
        for (role, _), seconds in zip(own, worst, strict=True):
            times[role.value].append(seconds)
        cycles.append(sum(worst))
        if rank == 0:
            print(
                f"cycle {repeat + 1}/{args.repeats}: {cycles[-1]:.3f} s (slowest rank per phase)", flush=True
            )
    traced = None
    if args.trace:
        from torch.profiler import ProfilerActivity

        activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        traced = {}
        with tempfile.TemporaryDirectory() as scratch:
            for number in range(args.k + 1):
                role, seconds, prof = phase(activities)
                if cuda:  # the kernels' intervals, from the trace (device events per stream)
                    trace = Path(scratch) / f"phase_{number}.json"
                    prof.export_chrome_trace(str(trace))
                    collective, other, count, alone = kernel_split(trace)
                else:  # gloo's collectives run on the calling thread: all of their time is exposed
                    collective, other, count = collective_split(prof.events())
                    alone = collective
                idle = max(0.0, seconds - other)  # this rank's: its wall minus its own compute
                traced.setdefault(role.value, []).append((seconds, collective, other, count, alone, idle))
        summary = {}
        for role, rows in traced.items():
            columns = [statistics.median(c) for c in zip(*rows, strict=True)]
            wall, collective, other, alone, idle = slowest([columns[i] for i in (0, 1, 2, 4, 5)], device)
            summary[role] = {"wall_s": wall, "collective_busy_s": collective, "other_busy_s": other,
                             "collectives": int(columns[3]), "collective_alone_s": alone,
                             "not_compute_s": idle}  # fmt: skip
        traced = summary
    median = statistics.median
    cycle_s = median(cycles)
    samples = per_rank * world * (args.k + 1)  # every phase draws a batch
    result = {
        "script": "bench_scaling.py",
        "code": code_version(),
        "date": date.today().isoformat(),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "family": work.family,
        "model": work.describe(),
        "layout": args.layout,
        "compile": args.compile,
        "fsdp_mesh": plan.model.fsdp_mesh
        if isinstance(plan.model.fsdp_mesh, str)
        else list(plan.model.fsdp_mesh),
        "mesh_shape": None if engine.mesh is None else list(engine.mesh.shape),  # what ran: None = 1-D
        "keep_gathered": args.keep_gathered,
        "lora_rank": args.lora_rank,
        "mode": "weak" if args.global_batch is None else "strong",
        "world_size": world,
        "per_rank_batch": per_rank,
        "global_batch": per_rank * world,
        "k": args.k,
        "build_s": build_s,
        "warmup_s": warmup_s,
        "student_phase_s": median(times["student"]),
        "fake_phase_s": median(times["fake_score"]),
        "cycle_s": cycle_s,
        "cycles_s": cycles,
        "samples_per_s": samples / cycle_s,
        "samples_per_s_per_gpu": samples / cycle_s / world,
        "parameter_bytes_per_rank": engine.parameter_bytes(),
        "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "trace": traced,
    }
    if rank == 0:
        print(json.dumps({k: v for k, v in result.items() if k != "cycles_s"}, indent=1), flush=True)
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1) + "\n")
    dist.barrier()
    runtime = engine = None  # free the sharded models before the process group (TRAPS)
    dist.destroy_process_group()
    return 0


def summarize(paths: list[Path]) -> int:
    """The scaling table of result files of one mode, family and batch setting."""
    results = []
    for path in paths:
        try:
            results.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as err:
            fail(f"{path}: not a bench_scaling result ({err}); fix: give the files its --json wrote")
    keys = {(r["mode"], r["model"], r["layout"], r["compile"], r["k"], r["device"], str(r.get("mesh_shape")),
             r.get("keep_gathered"), r.get("lora_rank"),
             r["per_rank_batch"] if r["mode"] == "weak" else r["global_batch"]) for r in results}  # fmt: skip
    if len(keys) != 1:
        fail(
            f"the files mix settings {sorted(keys)}; fix: summarize one mode, model, layout, K, device, mesh and batch at a time"
        )
    results.sort(key=lambda r: r["world_size"])
    base = results[0]
    mode = base["mode"]
    print(f"{mode} scaling, {base['model']}, {base['layout']}, compile {base['compile']}; "
          f"efficiency against {base['world_size']} rank(s)")  # fmt: skip
    print("| GPUs | per-GPU batch | global batch | cycle s | samples/s | samples/s/GPU | efficiency |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if mode == "weak":
            efficiency = r["samples_per_s_per_gpu"] / base["samples_per_s_per_gpu"]
        else:
            efficiency = (base["cycle_s"] / r["cycle_s"]) / (r["world_size"] / base["world_size"])
        print(f"| {r['world_size']} | {r['per_rank_batch']} | {r['global_batch']} | {r['cycle_s']:.3f} | "
              f"{r['samples_per_s']:.2f} | {r['samples_per_s_per_gpu']:.2f} | {efficiency:.1%} |")  # fmt: skip
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.summarize is not None:
        return summarize(args.summarize)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
