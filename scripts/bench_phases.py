"""DMD2 phase benchmark: wall time, peak memory and model-FLOP utilisation of an SD3-medium-shaped run.

One process, one device, no ray. For each layout (``shared_base_adapters``:
LoRA roles on one frozen base; ``independent``: three full copies, the same
LoRA roles on the student and fake-score copies), an SD3-shaped transformer
(random init, bf16 compute, fp32 shards) runs DMD2 phases on 1024x1024 latents
(128x128x16) with 333 text tokens of width 4096 and the teacher's CFG:

- wall time of a student phase, a fake-score phase and a full cycle (1 + K phases),
  median over --repeats after --warmup cycles;
- peak device memory over the timed cycles;
- the model FLOPs of each phase, counted by torch's FlopCounterMode on one phase,
  and the ideal time of those FLOPs at the bf16 matmul rate measured in the same
  run (8192^3 matmuls for 5 s, before and after the layouts; the higher sustained
  rate, at the GPU's power limit): MFU = FLOPs / time / rate. MFU against the
  burst rate (the fastest round, boost clocks) is reported beside it.

    python scripts/bench_phases.py --layouts shared_base_adapters independent --batch 2 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_offload import code_version, sd3_config

TEXT_TOKENS = 333


def matmul_rate(
    device: torch.device, size: int = 8192, repeats: int = 20, settle_s: float = 3.0, window_s: float = 2.0
) -> tuple[float, float]:
    """Measured bf16 matmul FLOP/s as (burst, sustained): size^3 products back to back, timed per round of
    `repeats` (one wait per round, so launch and wait overheads do not count), for `settle_s` + `window_s`.

    burst: the fastest round (boost clocks, before the power limit engages: the first rounds on a rested
    GPU). sustained: the median of the rounds in the last `window_s`, at the power limit, which is what
    the GPU delivers over seconds of work (an H200 at 700 W: ~663 TFLOP/s sustained vs ~780 in the first
    round, docs/benchmarks.md)."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    rates: list[tuple[float, float]] = []  # (seconds since the start, FLOP/s of the round)
    started = time.perf_counter()
    while not rates or rates[-1][0] < settle_s + window_s:
        torch.cuda.synchronize(device)
        begin = time.perf_counter()
        for _ in range(repeats):
            a @ b
        torch.cuda.synchronize(device)
        end = time.perf_counter()
        rates.append((end - started, 2 * size**3 * repeats / (end - begin)))
    burst = max(rate for _, rate in rates)
    sustained = statistics.median(rate for at, rate in rates if at >= settle_s)
    return burst, sustained


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far (0 without model.compile)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


def make_batch(batch: int, generator: torch.Generator, *, pin: bool = True) -> dict[str, torch.Tensor]:
    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    batch = {
        "noise": randn(batch, 16, 128, 128),
        "cond.encoder_hidden_states": randn(batch, TEXT_TOKENS, 4096),
        "cond.pooled_projections": randn(batch, 2048),
        "uncond.encoder_hidden_states": torch.zeros(batch, TEXT_TOKENS, 4096),
        "uncond.pooled_projections": torch.zeros(batch, 2048),
    }
    # Pinned, as a DataLoader(pin_memory=True) hands batches over: the runtime's copy to the device then
    # does not wait for the device (a pageable copy would, 87 MB at batch 8). Made outside the timing.
    return {k: v.pin_memory() for k, v in batch.items()} if pin and torch.cuda.is_available() else batch


def profile_cycle(run, out: Path, name: str) -> str:
    """Run `run()` under torch.profiler; write the operator tables (`profile_<name>.txt`), the chrome
    trace (`trace_<name>.json.gz`) and where the device waits (`gaps_<name>.txt`, scripts/trace_gaps.py)
    into `out`; returns the latter."""
    from torch.profiler import ProfilerActivity, profile
    from trace_gaps import analyse, load, report

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, with_flops=True) as prof:
        run()
    averages = prof.key_averages()
    table = averages.table(sort_by="cuda_time_total", row_limit=30)
    cpu_table = averages.table(sort_by="self_cpu_time_total", row_limit=20)
    # The matmuls' own rate inside the cycle (at the clocks the cycle runs at): their FLOPs by shape
    # over their kernels' time.
    matmuls = [e for e in averages if e.key in ("aten::mm", "aten::addmm", "aten::bmm")]
    flops = sum(e.flops for e in matmuls)
    seconds = sum(getattr(e, "device_time_total", 0.0) for e in matmuls) / 1e6
    rate = f"{flops / seconds / 1e12:.0f} TFLOP/s" if seconds else "no device time"
    matmul_line = (
        f"matmuls in the cycle: {flops / 1e12:.4g} TFLOP in {seconds * 1e3:.1f} ms of kernels: {rate}"
    )
    (out / f"profile_{name}.txt").write_text(matmul_line + "\n\n" + table + "\n\n" + cpu_table + "\n")
    plain, trace = out / f"trace_{name}.json", out / f"trace_{name}.json.gz"
    prof.export_chrome_trace(str(plain))  # compressed here: not every torch compresses on export
    with open(plain, "rb") as source, gzip.open(trace, "wb") as target:
        shutil.copyfileobj(source, target)
    plain.unlink()
    gaps = matmul_line + "\n\n" + report(analyse(load(trace)), top=30)
    (out / f"gaps_{name}.txt").write_text(gaps + "\n")
    return gaps


def trace_device_cycle(run, out: Path, name: str) -> tuple[float, str]:
    """Run `run()` under torch.profiler recording device activity alone (kernels, copies and the CUDA
    runtime calls; no operators, so the host runs at about its unprofiled speed); write the trace
    (`trace_device_<name>.json.gz`) and its gaps (`gaps_device_<name>.txt`, trace_gaps.py --device-only)
    into `out`. Returns the wall time of `run()` and the gap report."""
    from torch.profiler import ProfilerActivity, profile
    from trace_gaps import analyse_device_only, load, report_device_only

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        run()
        wall = time.perf_counter() - started
    plain, trace = out / f"trace_device_{name}.json", out / f"trace_device_{name}.json.gz"
    prof.export_chrome_trace(str(plain))
    with open(plain, "rb") as source, gzip.open(trace, "wb") as target:
        shutil.copyfileobj(source, target)
    plain.unlink()
    gaps = f"cycle under the device-only profiler: {wall:.3f} s\n\n"
    gaps += report_device_only(analyse_device_only(load(trace), min_us=20.0), top=40)
    (out / f"gaps_device_{name}.txt").write_text(gaps + "\n")
    return wall, gaps


def run_layout(layout: str, args, device: torch.device) -> dict:
    from torch.utils.flop_counter import FlopCounterMode

    from verl_dmd.adapters import get_adapter
    from verl_dmd.controller import DistillationController
    from verl_dmd.phases import PhaseRequest, Role
    from verl_dmd.plan import DistillationPlan
    from verl_dmd.runtime.engine import RoleEngine
    from verl_dmd.runtime.runtime import DistillationRoleRuntime

    full = layout == "independent_full"
    layout = "independent" if full else layout
    lora = {"rank": 0} if full else {"rank": args.lora_rank, "alpha": float(args.lora_rank)}
    plan = DistillationPlan.from_config({
        "algorithm": {"fake_update_ratio": args.k, "teacher_guidance_scale": 7.0, "sigma_shift": 3.0},
        "model": {"adapter": "sd3", "storage": layout, "param_dtype": "bfloat16",
                  "activation_checkpointing": args.activation_checkpointing, "compile": args.compile,
                  "reshard_after_forward": not args.keep_gathered,
                  "teacher": {"config": sd3_config(args.layers, args.hidden)},
                  "student": {"lora": lora}, "fake_score": {"lora": lora}},
        "batch": {"student": {"micro_batch_size": args.batch}, "fake_score": {"micro_batch_size": args.batch}},
        "data": {"name": "synthetic"},
        "export": {"formats": ["diffusers"]},
    })  # fmt: skip
    built = time.perf_counter()
    adapter = get_adapter("sd3")()
    computer = adapter.build_distribution_matching_computer(plan.model, plan, rank=0)
    engine = RoleEngine(plan, adapter, device=device, extra_modules=computer.extra_modules())
    runtime = DistillationRoleRuntime(engine, computer)
    build_s = time.perf_counter() - built
    controller = DistillationController(fake_update_ratio=args.k, fake_warmup_steps=0)
    generator = torch.Generator().manual_seed(0)

    def phase(batch: dict | None = None) -> tuple[Role, float, dict]:
        role = controller.next_phase()
        request = PhaseRequest(role=role, global_step=controller.global_step, role_step=0,
                               phase_index=controller.phase_index)  # fmt: skip
        if batch is None:
            batch = make_batch(args.batch, generator, pin=not args.pageable_batch)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        with record_function(f"phase:{role.value}"):  # the window scripts/trace_gaps.py looks at
            metrics = runtime.run_phase(request, batch)
            torch.cuda.synchronize(device)
        controller.record(role, stepped=metrics["stepped"])
        return role, time.perf_counter() - start, metrics

    warm = time.perf_counter()
    for _ in range(args.warmup * (args.k + 1)):
        phase()
    warmup_s = time.perf_counter() - warm
    flops = {}
    for _ in range(args.k + 1):
        counter = FlopCounterMode(display=False)
        role = controller.next_phase()
        # The FLOPs of the model as written: compiled blocks run eagerly while counting.
        with counter, torch.compiler.set_stance("force_eager"):
            request = PhaseRequest(role=role, global_step=controller.global_step, role_step=0,
                                   phase_index=controller.phase_index)  # fmt: skip
            metrics = runtime.run_phase(
                request, make_batch(args.batch, generator, pin=not args.pageable_batch)
            )
        controller.record(role, stepped=metrics["stepped"])
        flops.setdefault(role.value, counter.get_total_flops())
    if args.profile:
        # The batches are made first: the profile shows the phases only, as the timer does.
        batches = [make_batch(args.batch, generator, pin=not args.pageable_batch) for _ in range(args.k + 1)]
        name = "independent_full" if full else layout
        gaps = profile_cycle(lambda: [phase(batch) for batch in batches], args.profile, name)
        del batches
        print(f"where the device waits in the profiled cycle:\n{gaps}", flush=True)
    traced_s = None
    if args.trace_device:
        batches = [make_batch(args.batch, generator, pin=not args.pageable_batch) for _ in range(args.k + 1)]
        name = "independent_full" if full else layout
        traced_s, gaps = trace_device_cycle(lambda: [phase(b) for b in batches], args.trace_device, name)
        del batches
        print(f"device-only trace of one cycle:\n{gaps}", flush=True)
    torch.cuda.reset_peak_memory_stats(device)
    times: dict[str, list[float]] = {"student": [], "fake_score": []}
    cycles = []
    for _ in range(args.repeats):
        cycle = 0.0
        for _ in range(args.k + 1):
            role, seconds, _ = phase()
            times[role.value].append(seconds)
            cycle += seconds
        cycles.append(cycle)
    peak = torch.cuda.max_memory_allocated(device)
    median = statistics.median
    student_s, fake_s, cycle_s = median(times["student"]), median(times["fake_score"]), median(cycles)
    cycle_flops = flops["student"] + args.k * flops["fake_score"]
    result = {
        "layout": "independent_full" if full else layout,
        "build_s": build_s,
        "student_phase_s": student_s,
        "fake_phase_s": fake_s,
        "cycle_s": cycle_s,
        "student_flops": flops["student"],
        "fake_flops": flops["fake_score"],
        "cycle_flops": cycle_flops,
        "peak_bytes": peak,
        "warmup_s": warmup_s,
        "compile": args.compile,
        "batch_pinned": torch.cuda.is_available() and not args.pageable_batch,
        "reshard_after_forward": not args.keep_gathered,
        "compiled_graphs": compiled_graphs(),
        "parameter_bytes": engine.parameter_bytes(),
        "sdpa_backend": args.sdpa_backend,
        "cycles_s": cycles,
        "device_traced_cycle_s": traced_s,
    }
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["shared_base_adapters", "independent"],
                        choices=["shared_base_adapters", "independent", "independent_full"],
                        help="independent_full: three full copies, student and fake score fully trained")  # fmt: skip
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--lora-rank", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--k", type=int, default=5, help="fake-score phases per student phase")
    parser.add_argument("--warmup", type=int, default=1, help="untimed cycles")
    parser.add_argument("--repeats", type=int, default=3, help="timed cycles")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--compile", action="store_true", help="model.compile=true: torch.compile each block")
    parser.add_argument("--keep-gathered", action="store_true",
                        help="model.reshard_after_forward=false: keep gathered weights until the phase ends")  # fmt: skip
    parser.add_argument(
        "--pageable-batch",
        action="store_true",
        help="hand batches over in pageable memory (default: pinned, as a DataLoader(pin_memory=True))",
    )
    parser.add_argument(
        "--sdpa-backend",
        choices=["default", "cudnn", "flash", "efficient"],
        default="default",
        help="allow only this scaled-dot-product-attention kernel (default: torch's choice, cuDNN on an H200)",
    )
    parser.add_argument(
        "--trace-device",
        type=Path,
        default=None,
        help="one more cycle under a device-only profiler (little host overhead): trace and gaps into this folder",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="profile one more cycle per layout: operator tables, chrome trace (.json.gz) and where the "
        "device waits (scripts/trace_gaps.py) into this folder",
    )
    args = parser.parse_args(argv)
    for folder in (args.profile, args.trace_device):
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    if args.sdpa_backend != "default":
        switches = {"cudnn": torch.backends.cuda.enable_cudnn_sdp, "flash": torch.backends.cuda.enable_flash_sdp,
                    "efficient": torch.backends.cuda.enable_mem_efficient_sdp}  # fmt: skip
        for backend, switch in switches.items():
            switch(backend == args.sdpa_backend)
        torch.backends.cuda.enable_math_sdp(False)  # fail rather than fall back silently
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    # The rate moves with clocks and power: a burst at boost clocks, then the power limit (measured before
    # and after the layouts). MFU is taken against the higher sustained rate; the burst one is reported too.
    burst_before, rate_before = matmul_rate(device)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}: bf16 matmul "
          f"{rate_before / 1e12:.0f} TFLOP/s sustained, {burst_before / 1e12:.0f} burst, before")  # fmt: skip
    results = []
    for layout in args.layouts:
        results.append(run_layout(layout, args, device))
        gc.collect()
        torch.cuda.empty_cache()  # the layout's engine is gone; the next one starts from an empty device
    burst_after, rate_after = matmul_rate(device)
    rate, burst = max(rate_before, rate_after), max(burst_before, burst_after)
    print(f"bf16 matmul {rate_after / 1e12:.0f} TFLOP/s sustained, {burst_after / 1e12:.0f} burst, after; "
          f"MFU against {rate / 1e12:.0f} (sustained), {burst / 1e12:.0f} (burst)")  # fmt: skip
    for result in results:
        cycle_flops = result["cycle_flops"]
        result.update({
            "ideal_cycle_s": cycle_flops / rate,
            "mfu_student": result["student_flops"] / result["student_phase_s"] / rate,
            "mfu_fake": result["fake_flops"] / result["fake_phase_s"] / rate,
            "mfu_cycle": cycle_flops / result["cycle_s"] / rate,
            "mfu_cycle_burst": cycle_flops / result["cycle_s"] / burst,
        })  # fmt: skip
        print(json.dumps(result), flush=True)
    print(f"\nSD3-shaped, {args.layers} layers x {args.hidden}, batch {args.batch}, 1024x1024, K={args.k}, "
          f"LoRA rank {args.lora_rank} (none for independent_full), CFG on, compile {args.compile}, "
          f"reshard_after_forward {not args.keep_gathered}, attention kernel {args.sdpa_backend}")  # fmt: skip
    print(
        "| layout | student phase s | fake phase s | cycle s | ideal cycle s | MFU cycle | MFU vs burst | peak GiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['layout']} | {r['student_phase_s']:.3f} | {r['fake_phase_s']:.3f} | {r['cycle_s']:.3f} | "
              f"{r['ideal_cycle_s']:.3f} | {r['mfu_cycle']:.1%} | {r['mfu_cycle_burst']:.1%} | "
              f"{r['peak_bytes'] / 2**30:.1f} |")  # fmt: skip
    if args.json:
        document = {"code": code_version(), "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                    "matmul_flops_per_s": rate, "matmul_flops_per_s_before": rate_before,
                    "matmul_flops_per_s_after": rate_after, "matmul_burst_flops_per_s": burst,
                    "matmul_burst_flops_per_s_before": burst_before, "matmul_burst_flops_per_s_after": burst_after,
                    "results": results}  # fmt: skip
        args.json.write_text(json.dumps(document, indent=1) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
