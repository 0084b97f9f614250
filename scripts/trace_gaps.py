"""Where a GPU waits: idle gaps in a torch.profiler chrome trace, and what the host was doing.

    python scripts/trace_gaps.py TRACE.json[.gz] [--top 20] [--min-us 20] [--device-only]

The device is busy while any kernel, copy or memset runs (on any stream). Inside
the window of the `phase:` annotations (scripts/bench_phases.py --trace adds one
per phase), every stretch with nothing running is a gap. Each gap is charged to
the host code that launched the work ending it: the innermost annotation
(`verl_dmd.*`, see `DistillationRoleRuntime.run_phase`) and the innermost operator
around that launch. Summaries: busy and idle time per phase, idle by annotation,
and the longest gaps.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CATEGORIES = {"cuda_runtime", "cuda_driver"}
HOST_CATEGORIES = {"cpu_op", "user_annotation", "python_function"}


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        document = json.load(handle)
    return document["traceEvents"] if isinstance(document, dict) else document


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals, sorted and disjoint."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def clip(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def enclosing_all(host: list[dict], queries: list[tuple]) -> dict[int, list[dict]]:
    """For each query (key, tid, ts): the host events of thread `tid` that contain `ts`, outermost
    first. One sweep per thread (events on one thread nest)."""
    by_thread: dict = defaultdict(list)
    for event in host:
        by_thread[event.get("tid")].append(event)
    asked: dict = defaultdict(list)
    for key, tid, ts in queries:
        asked[tid].append((ts, key))
    found: dict[int, list[dict]] = {}
    for tid, wanted in asked.items():
        events = sorted(by_thread.get(tid, []), key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack: list[dict] = []
        position = 0
        for ts, key in sorted(wanted):
            while position < len(events) and events[position]["ts"] <= ts:
                event = events[position]
                while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) < event["ts"]:
                    stack.pop()
                stack.append(event)
                position += 1
            while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) < ts:
                stack.pop()
            found[key] = [e for e in stack if e["ts"] + e.get("dur", 0) >= ts]
    return found


def analyse(events: list[dict], min_us: float = 20.0) -> dict:
    complete = [e for e in events if e.get("ph") == "X" and "ts" in e]
    device = [e for e in complete if e.get("cat") in DEVICE_CATEGORIES]
    launches = {
        e["args"]["correlation"]: e
        for e in complete
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }
    host = [e for e in complete if e.get("cat") in HOST_CATEGORIES]
    phases = sorted(
        (e for e in host if e.get("cat") == "user_annotation" and e["name"].startswith("phase:")),
        key=lambda e: e["ts"],
    )
    if not phases:
        raise SystemExit("no 'phase:' annotations in the trace (made by bench_phases.py --trace?)")
    busy = merge([(e["ts"], e["ts"] + e.get("dur", 0)) for e in device])
    starts = sorted((e["ts"], i) for i, e in enumerate(device))
    start_times = [s for s, _ in starts]
    per_phase = []
    gaps = []
    queries = []  # (gap number, thread, time) of the launch that ended each gap
    for phase in phases:
        lo, hi = phase["ts"], phase["ts"] + phase["dur"]
        inside = clip(busy, lo, hi)
        busy_us = sum(e - s for s, e in inside)
        edges = [lo, *[x for interval in inside for x in interval], hi]
        for gap_start, gap_end in zip(edges[::2], edges[1::2], strict=True):
            if gap_end - gap_start < min_us:
                continue
            gap = {"phase": phase["name"], "start_us": gap_start - phases[0]["ts"], "us": gap_end - gap_start,
                   "annotation": "(end of phase)", "op": ""}  # fmt: skip
            # the device work that ends the gap, and the host code that launched it
            index = bisect.bisect_left(start_times, gap_end - 1e-3)
            if index < len(starts) and gap_end < hi:
                kernel = device[starts[index][1]]
                launch = launches.get(kernel.get("args", {}).get("correlation"))
                if launch is None:
                    gap.update(annotation="(launch not in trace)", op=kernel["name"][:60])
                else:
                    gap["op"] = launch["name"]
                    queries.append((len(gaps), launch.get("tid"), launch["ts"]))
            gaps.append(gap)
        per_phase.append({"phase": phase["name"], "wall_us": hi - lo, "busy_us": busy_us})
    for number, around in enclosing_all(host, queries).items():
        notes = [e["name"] for e in around if e.get("cat") == "user_annotation"]
        ops = [e["name"] for e in around if e.get("cat") == "cpu_op"]
        gaps[number]["annotation"] = notes[-1] if notes else "(no annotation)"
        if ops:
            gaps[number]["op"] = ops[-1]
    by_annotation: dict[str, float] = defaultdict(float)
    for gap in gaps:
        by_annotation[gap["annotation"]] += gap["us"]
    return {"phases": per_phase, "gaps": gaps, "idle_by_annotation": dict(by_annotation)}


def analyse_device_only(events: list[dict], min_us: float = 20.0) -> dict:
    """Gaps of a trace recorded with device activity alone (`profile(activities=[CUDA])`: no operator
    recording, so the host runs at about its unprofiled speed). Phases are the stretches between the
    pairs of `cudaDeviceSynchronize` calls that bench_phases.py makes around each phase (the whole
    trace when there are none). Each gap is described by the device work before and after it and the
    CUDA runtime calls the host made during it (a `cudaStreamSynchronize` there is a read-back)."""
    complete = [e for e in events if e.get("ph") == "X" and "ts" in e]
    device = sorted((e for e in complete if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    runtime = sorted((e for e in complete if e.get("cat") in LAUNCH_CATEGORIES), key=lambda e: e["ts"])
    if not device:
        raise SystemExit("no device activity in the trace")
    syncs = [e["ts"] + e.get("dur", 0) for e in runtime if e["name"] == "cudaDeviceSynchronize"]
    if len(syncs) >= 2:
        windows = list(zip(syncs[0::2], syncs[1::2], strict=False))  # an odd last one has no pair
    else:
        windows = [(device[0]["ts"], max(e["ts"] + e.get("dur", 0) for e in device))]
    busy = merge([(e["ts"], e["ts"] + e.get("dur", 0)) for e in device])
    runtime_starts = [e["ts"] for e in runtime]
    device_starts = [e["ts"] for e in device]
    per_phase, gaps = [], []
    for number, (lo, hi) in enumerate(windows):
        inside = clip(busy, lo, hi)
        per_phase.append(
            {"phase": f"phase {number}", "wall_us": hi - lo, "busy_us": sum(e - s for s, e in inside)}
        )
        edges = [lo, *[x for interval in inside for x in interval], hi]
        for gap_start, gap_end in zip(edges[::2], edges[1::2], strict=True):
            if gap_end - gap_start < min_us:
                continue
            before_index = bisect.bisect_right(device_starts, gap_start) - 1  # the last work begun before
            after_index = bisect.bisect_left(device_starts, gap_end - 1e-3)
            calls: dict[str, float] = defaultdict(float)
            first = bisect.bisect_left(
                runtime_starts, gap_start - 10_000
            )  # calls that began up to 10 ms before
            for e in runtime[first:]:
                if e["ts"] >= gap_end:
                    break
                overlap = min(e["ts"] + e.get("dur", 0), gap_end) - max(e["ts"], gap_start)
                if overlap > 0:
                    calls[e["name"]] += overlap
            gaps.append({
                "phase": f"phase {number}", "start_us": gap_start - lo, "us": gap_end - gap_start,
                "before": device[before_index]["name"][:50] if before_index >= 0 else "(start)",
                "after": device[after_index]["name"][:50] if after_index < len(device) and gap_end < hi
                else "(end of phase)",
                "calls": dict(sorted(calls.items(), key=lambda kv: -kv[1])),
            })  # fmt: skip
    return {"phases": per_phase, "gaps": gaps}


def report_device_only(result: dict, top: int = 20) -> str:
    lines = ["| phase | wall ms | device busy ms | idle ms | gaps | idle in gaps after a read-back ms |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for p in result["phases"]:
        mine = [g for g in result["gaps"] if g["phase"] == p["phase"]]
        synced = sum(g["us"] for g in mine if "cudaStreamSynchronize" in g["calls"])
        lines.append(f"| {p['phase']} | {p['wall_us'] / 1e3:.1f} | {p['busy_us'] / 1e3:.1f} | "
                     f"{(p['wall_us'] - p['busy_us']) / 1e3:.1f} | {len(mine)} | {synced / 1e3:.1f} |")  # fmt: skip
    wall = sum(p["wall_us"] for p in result["phases"])
    busy = sum(p["busy_us"] for p in result["phases"])
    lines.append(
        f"| all | {wall / 1e3:.1f} | {busy / 1e3:.1f} | {(wall - busy) / 1e3:.1f} | {len(result['gaps'])} | |"
    )
    sizes = [g["us"] for g in result["gaps"]]
    for lo, hi in ((0, 100), (100, 1000), (1000, 5000), (5000, float("inf"))):
        inside = [s for s in sizes if lo <= s < hi]
        lines.append(f"gaps of {lo / 1e3:g} to {hi / 1e3:g} ms: {len(inside)}, {sum(inside) / 1e3:.1f} ms")
    lines += ["", f"longest {top} gaps (device work before -> after; the host's CUDA calls meanwhile, us):"]
    for gap in sorted(result["gaps"], key=lambda g: -g["us"])[:top]:
        calls = ", ".join(f"{name} {us:.0f}" for name, us in list(gap["calls"].items())[:4])
        lines.append(f"  {gap['us'] / 1e3:7.2f} ms at {gap['start_us'] / 1e3:8.1f} ms of {gap['phase']}: "
                     f"{gap['before']} -> {gap['after']}; {calls}")  # fmt: skip
    return "\n".join(lines)


def report(result: dict, top: int = 20) -> str:
    lines = ["| phase | wall ms | device busy ms | idle ms |", "|---|---|---|---|"]
    wall = busy = 0.0
    for p in result["phases"]:
        wall, busy = wall + p["wall_us"], busy + p["busy_us"]
        lines.append(f"| {p['phase']} | {p['wall_us'] / 1e3:.1f} | {p['busy_us'] / 1e3:.1f} | "
                     f"{(p['wall_us'] - p['busy_us']) / 1e3:.1f} |")  # fmt: skip
    lines.append(f"| all | {wall / 1e3:.1f} | {busy / 1e3:.1f} | {(wall - busy) / 1e3:.1f} |")
    lines += ["", "idle (gaps >= the threshold) by the annotation around the launch that ended it:"]
    for name, us in sorted(result["idle_by_annotation"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {us / 1e3:8.1f} ms  {name}")
    lines += ["", f"longest {top} gaps:"]
    for gap in sorted(result["gaps"], key=lambda g: -g["us"])[:top]:
        lines.append(f"  {gap['us'] / 1e3:7.2f} ms at {gap['start_us'] / 1e3:8.1f} ms  {gap['phase']}  "
                     f"{gap['annotation']}  {gap['op']}")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--min-us", type=float, default=20.0, help="shorter gaps are not listed")
    parser.add_argument("--device-only", action="store_true",
                        help="a trace of device activity alone (bench_phases.py --trace-device)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.device_only:
        print(report_device_only(analyse_device_only(load(args.trace), args.min_us), args.top))
    else:
        print(report(analyse(load(args.trace), args.min_us), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
