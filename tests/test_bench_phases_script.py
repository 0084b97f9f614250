"""scripts/bench_phases.py on CPU: each family's tiny shapes through both layouts and the bare loop."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

K = 2


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "scripts/bench_phases.py", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=240,
    )


@pytest.mark.parametrize(
    "family, extra",
    [
        ("sd3", []),
        # Flux also takes the compiled path (per-block torch.compile without code generation) kept gathered.
        ("flux", ["--compile", "--compile-backend", "eager", "--keep-gathered"]),
        ("qwen_image", []),
        ("wan", []),
    ],
)
def test_tiny_cpu_run_reports_layouts_and_the_bare_loop(tmp_path, family, extra):
    """One warm-up and one timed cycle per layout and the bare loop: the JSON holds both layouts, a cycle's
    FLOPs of 1 student + K fake-score phases, a bare loop cheaper than a fake-score phase (one forward +
    backward of one model, against a student forward and a fake-score forward + backward), and no MFU
    without a measured matmul rate."""
    out = tmp_path / f"{family}.json"
    result = run_script(
        "--device", "cpu", "--tiny", "--family", family, "--k", str(K), "--lora-rank", "4",
        "--repeats", "1", "--bare-warmup", "1", "--bare-repeats", "1", "--json", str(out), *extra,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads(out.read_text())
    assert document["family"] == family and document["workload"]["tiny"] is True
    assert document["matmul_flops_per_s"] is None and document["datasheet_flops_per_s"] is None
    results = {r["layout"]: r for r in document["results"]}
    assert set(results) == {"shared_base_adapters", "independent"}
    bare = document["bare"]
    assert bare["flops"] > 0 and bare["step_s"] > 0 and bare["trainable_parameters"] > 0
    for r in results.values():
        assert r["cycle_flops"] == r["student_flops"] + K * r["fake_flops"]
        assert r["student_flops"] > r["fake_flops"] > bare["flops"]
        assert r["cycle_s"] > 0 and len(r["cycles_s"]) == 1
        assert r["mfu_cycle"] is None and r["mfu_cycle_datasheet"] is None and r["peak_bytes"] is None
        assert r["cycle_vs_bare"] == pytest.approx(r["cycle_flops_per_s"] / bare["flops_per_s"])
    # Both layouts compute the same model on the same shapes: the same FLOPs.
    shared, independent = results["shared_base_adapters"], results["independent"]
    assert shared["cycle_flops"] == independent["cycle_flops"]
    if "--compile" in extra:
        assert shared["compiled_graphs"] > 0
    assert "| shared_base_adapters |" in result.stdout and "bare loop (" in result.stdout


def test_bad_arguments_are_one_line_errors():
    """Shapes that do not apply to the family fail before any model is built."""
    result = run_script("--family", "flux", "--hidden", "1024")
    assert (
        result.returncode == 2
        and "--hidden 1024: sets the width of the full-size sd3 shape only" in result.stderr
    )
    result = run_script("--family", "wan", "--frames", "80", "--device", "cpu", "--tiny")
    assert result.returncode == 2 and "--frames 80: " in result.stderr and "4k + 1 frames" in result.stderr
