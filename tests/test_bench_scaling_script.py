"""scripts/bench_scaling.py on CPU: torchrun with gloo ranks, weak and strong modes, the trace split, the
summary table, and the refusals (one line each, exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_scaling import kernel_split  # noqa: E402

SMOKE = ["--device", "cpu", "--tiny", "--k", "1", "--lora-rank", "4", "--warmup", "1", "--repeats", "1"]


def torchrun(ranks: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
         "scripts/bench_scaling.py", *args],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip


def script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "scripts/bench_scaling.py", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )


@pytest.mark.slow
def test_weak_and_strong_runs_with_the_collective_split_and_the_summary(tmp_path):
    """2 gloo ranks: the JSON counts both ranks' samples; the traced phases hold collectives (FSDP2's gathers
    and reduce-scatters) whose busy time fits inside the phase; --summarize reads a 1- and a 2-rank file."""
    one, two, strong = tmp_path / "w1.json", tmp_path / "w2.json", tmp_path / "s2.json"
    result = torchrun(2, *SMOKE, "--per-gpu-batch", "1", "--trace", "--json", str(two))
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads(two.read_text())
    assert (document["mode"], document["world_size"], document["per_rank_batch"], document["global_batch"]) == (
        "weak", 2, 1, 2,
    )  # fmt: skip
    assert document["samples_per_s"] == pytest.approx(2 * 2 / document["cycle_s"])
    assert document["samples_per_s_per_gpu"] == pytest.approx(document["samples_per_s"] / 2)
    for role in ("student", "fake_score"):
        phase = document["trace"][role]
        assert phase["collectives"] > 0, phase
        assert 0 < phase["collective_busy_s"] <= phase["wall_s"] * 1.05, phase

    result = torchrun(1, *SMOKE, "--per-gpu-batch", "1", "--json", str(one))
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(one.read_text())["trace"] is None
    table = script("--summarize", str(two), str(one))
    assert table.returncode == 0, table.stderr
    rows = [
        line for line in table.stdout.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")
    ]
    assert len(rows) == 2 and rows[0].endswith("| 100.0% |"), table.stdout

    result = torchrun(2, *SMOKE, "--global-batch", "2", "--fsdp-mesh", "2x1", "--json", str(strong))
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads(strong.read_text())
    assert (document["mode"], document["per_rank_batch"], document["fsdp_mesh"]) == ("strong", 1, [2, 1])
    assert document["mesh_shape"] == [2, 1] and json.loads(two.read_text())["mesh_shape"] is None
    mixed = script("--summarize", str(one), str(strong))
    assert mixed.returncode == 2 and "mix settings" in mixed.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "ranks, args, message",
    [
        (2, ["--global-batch", "3"], "--global-batch 3: not divisible by the 2 ranks; fix: a multiple of 2"),
        (2, ["--per-gpu-batch", "1", "--fsdp-mesh", "2x2"], "'model.fsdp_mesh' = [2, 2]"),
        (1, ["--per-gpu-batch", "1", "--fsdp-mesh", "2by2"], "--fsdp-mesh 2by2: allowed"),
        (1, [], "give --per-gpu-batch B"),
        (2, ["--per-gpu-batch", "1", "--nodes", "3"], "--nodes 3: does not divide the 2 ranks"),
        (0, ["--per-gpu-batch", "1"], "launch it with torchrun"),
    ],
)
def test_refusals(ranks, args, message):
    result = torchrun(ranks, *SMOKE, *args) if ranks else script(*SMOKE, *args)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("bench_scaling: ")]
    assert lines and message in lines[0], result.stderr[-2000:]
    assert len(set(lines)) == 1  # one line, whichever rank printed it


def test_kernel_split_of_a_device_trace(tmp_path):
    """NCCL kernels against the other device work, each the union over streams; the collectives' time with
    nothing else running is what lies outside the other work (a hand-made trace, in microseconds)."""
    kernel = {"ph": "X", "cat": "kernel"}
    events = [
        {**kernel, "name": "ampere_bf16_gemm", "ts": 0, "dur": 100},  # compute 0-100 on stream 7
        {**kernel, "name": "triton_poi_fused", "ts": 50, "dur": 100},  # 50-150 on another: union 0-150
        {**kernel, "name": "ncclDevKernel_AllGather_RING_LL", "ts": 120, "dur": 60},  # 120-180: 30 alone
        {**kernel, "name": "ncclDevKernel_ReduceScatter_RING_LL", "ts": 200, "dur": 20},  # 200-220: alone
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 230, "dur": 10},  # other work
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 500},  # host: ignored
    ]
    trace = tmp_path / "phase.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    collective, other, count, alone = kernel_split(trace)
    assert count == 2
    assert collective == pytest.approx(80e-6) and other == pytest.approx(160e-6)
    assert alone == pytest.approx(50e-6)
