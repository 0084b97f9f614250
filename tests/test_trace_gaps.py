"""scripts/trace_gaps.py: device idle inside phase annotations, charged to the host code that ended it."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from trace_gaps import analyse, analyse_device_only, report, report_device_only  # noqa: E402


def event(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "args": args}


def synthetic() -> list[dict]:
    """One phase 0-1000 us: kernels [100, 300) and [250, 400) on two streams, [600, 900); a copy at 1300
    in a second phase 1200-1500 launched by an operator with no annotation around it."""
    return [
        event("user_annotation", "phase:student", 0, 1000),
        event("user_annotation", "verl_dmd.compute", 10, 400),
        event("cpu_op", "aten::mm", 40, 20),
        event("cuda_runtime", "cudaLaunchKernel", 50, 5, correlation=1),
        event("cpu_op", "aten::add", 70, 10),
        event("cuda_runtime", "cudaLaunchKernel", 75, 3, correlation=2),
        event("user_annotation", "verl_dmd.optimizer_step", 500, 80),
        event("cpu_op", "aten::_foreach_add_", 540, 30),
        event("cuda_runtime", "cudaLaunchKernel", 550, 5, correlation=3),
        event("kernel", "gemm", 100, 200, tid=7, correlation=1),
        event("kernel", "add", 250, 150, tid=8, correlation=2),
        event("kernel", "adam", 600, 300, tid=7, correlation=3),
        event("user_annotation", "phase:fake_score", 1200, 300),
        event("cpu_op", "aten::copy_", 1250, 10),
        event("cuda_runtime", "cudaMemcpyAsync", 1255, 2, correlation=4),
        event("gpu_memcpy", "Memcpy HtoD", 1300, 100, tid=7, correlation=4),
        event("kernel", "outside any phase", 1100, 50, tid=7, correlation=9),
    ]


def test_gaps_busy_time_and_attribution(tmp_path):
    result = analyse(synthetic(), min_us=20)
    assert result["phases"] == [
        {"phase": "phase:student", "wall_us": 1000, "busy_us": 600},
        {"phase": "phase:fake_score", "wall_us": 300, "busy_us": 100},
    ]
    gaps = [(g["phase"], g["start_us"], g["us"], g["annotation"], g["op"]) for g in result["gaps"]]
    assert gaps == [
        ("phase:student", 0, 100, "verl_dmd.compute", "aten::mm"),
        ("phase:student", 400, 200, "verl_dmd.optimizer_step", "aten::_foreach_add_"),
        ("phase:student", 900, 100, "(end of phase)", ""),
        ("phase:fake_score", 1200, 100, "phase:fake_score", "aten::copy_"),
        ("phase:fake_score", 1400, 100, "(end of phase)", ""),
    ]
    assert result["idle_by_annotation"]["(end of phase)"] == 200
    # a threshold above a gap drops it from the list, not from the phase's idle time
    assert [g["us"] for g in analyse(synthetic(), min_us=150)["gaps"]] == [200]
    text = report(result)
    assert "| all | 1.3 | 0.7 | 0.6 |" in text  # milliseconds
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump({"traceEvents": synthetic()}, handle)
    out = subprocess.run([sys.executable, str(SCRIPTS / "trace_gaps.py"), str(path)], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    assert "0.20 ms at      0.4 ms  phase:student  verl_dmd.optimizer_step  aten::_foreach_add_" in out


def test_device_only_gaps_between_the_benchmarks_synchronizes():
    """A device-only trace: phases between pairs of cudaDeviceSynchronize, each gap described by the
    work around it and the runtime calls during it (a read-back counted as such)."""
    events = [
        event("cuda_runtime", "cudaDeviceSynchronize", 0, 10),  # phase 0: 10-1000
        event("cuda_runtime", "cudaLaunchKernel", 20, 5),
        event("kernel", "gemm", 100, 300, tid=7),
        event("cuda_runtime", "cudaHostAlloc", 420, 150),
        event("gpu_memcpy", "Memcpy HtoD", 600, 100, tid=7),
        event("cuda_runtime", "cudaStreamSynchronize", 650, 100),
        event("kernel", "adam", 800, 150, tid=7),
        event("cuda_runtime", "cudaDeviceSynchronize", 960, 40),
        event("cuda_runtime", "cudaDeviceSynchronize", 1100, 10),  # phase 1: 1110-1300
        event("kernel", "mm", 1150, 100, tid=7),
        event("cuda_runtime", "cudaDeviceSynchronize", 1250, 50),
        event("kernel", "between phases", 1050, 20, tid=7),
    ]
    result = analyse_device_only(events, min_us=20)
    assert result["phases"] == [
        {"phase": "phase 0", "wall_us": 990, "busy_us": 550},
        {"phase": "phase 1", "wall_us": 190, "busy_us": 100},
    ]
    described = [
        (g["phase"], g["start_us"], g["us"], g["before"], g["after"], g["calls"]) for g in result["gaps"]
    ]
    assert described == [
        ("phase 0", 0, 90, "(start)", "gemm", {"cudaLaunchKernel": 5}),
        ("phase 0", 390, 200, "gemm", "Memcpy HtoD", {"cudaHostAlloc": 150}),
        ("phase 0", 690, 100, "Memcpy HtoD", "adam", {"cudaStreamSynchronize": 50}),
        ("phase 0", 940, 50, "adam", "(end of phase)", {"cudaDeviceSynchronize": 40}),
        ("phase 1", 0, 40, "between phases", "mm", {}),
        ("phase 1", 140, 50, "mm", "(end of phase)", {"cudaDeviceSynchronize": 50}),
    ]
    text = report_device_only(result)
    assert "| phase 0 | 1.0 | 0.6 | 0.4 | 4 | 0.1 |" in text  # ms; the 100 us gap holds a read-back
    assert "0.20 ms at      0.4 ms of phase 0: gemm -> Memcpy HtoD; cudaHostAlloc 150" in text


def test_bench_phases_profile_cycle_writes_tables_trace_and_gaps(tmp_path):
    """The --profile path of bench_phases.py (GPU-only as a whole) on CPU: two annotated 'phases' of
    CPU work give the three files, and the report covers both phases (no device: all idle)."""
    import torch
    from bench_phases import profile_cycle
    from torch.profiler import record_function

    def run():
        for role in ("student", "fake_score"):
            with record_function(f"phase:{role}"):
                torch.mm(torch.randn(1024, 1024), torch.randn(1024, 1024))

    text = profile_cycle(run, tmp_path, "shared_base_adapters")
    assert {p.name for p in tmp_path.iterdir()} == {
        "profile_shared_base_adapters.txt", "trace_shared_base_adapters.json.gz", "gaps_shared_base_adapters.txt",
    }  # fmt: skip
    assert "| phase:student |" in text and "| phase:fake_score |" in text
    assert text.startswith("matmuls in the cycle: 0.004295 TFLOP")  # 2 x 2 x 1024^3, counted by shape
    assert (tmp_path / "gaps_shared_base_adapters.txt").read_text().strip() == text.strip()


def test_benchmark_results_name_their_code(monkeypatch, tmp_path):
    """The benchmark JSONs record the code: $VERL_DMD_COMMIT first (a copy without .git), else git,
    else "unknown"; bench_offload on CPU writes it."""
    import subprocess as sp

    import bench_offload

    monkeypatch.setenv("VERL_DMD_COMMIT", "0123abc")
    assert bench_offload.code_version() == "0123abc"
    out = tmp_path / "offload.json"
    sp.run([sys.executable, str(SCRIPTS / "bench_offload.py"), "--device", "cpu", "--layers", "1", "--hidden", "64",
            "--repeats", "1", "--json", str(out)], check=True, capture_output=True)  # fmt: skip
    assert json.loads(out.read_text())["code"] == "0123abc"
    monkeypatch.delenv("VERL_DMD_COMMIT")

    def no_git(*args, **kwargs):
        raise OSError("no git here")

    monkeypatch.setattr(bench_offload.subprocess, "run", no_git)
    assert bench_offload.code_version() == "unknown"


def test_bench_host_runs_and_reports_both_steps():
    """scripts/bench_host.py (host time of verify_layout and the AdamW step) runs at a toy size."""
    out = subprocess.run([sys.executable, str(SCRIPTS / "bench_host.py"), "--layers", "2", "--repeats", "2"],
                         capture_output=True, text=True, check=True, timeout=300).stdout  # fmt: skip
    for row in ("verify_layout, kept tree", "verify_layout, full walk", "AdamW step on the DTensors",
                "AdamW step on the local shards"):  # fmt: skip
        assert f"| {row}" in out, out
