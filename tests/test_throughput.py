"""Throughput and MFU: the phase FLOPs priced on the meta device against a direct count of the live phase,
the run untouched by the counter, and the driver's rates computed from those FLOPs and the elapsed time."""

from __future__ import annotations

import math

import pytest
import throughput_scenarios
from dist_harness import run_ranks

from verl_dmd.runtime.flops import datasheet_rate, measure_matmul_rate
from verl_dmd.trainer.throughput import Throughput, describe


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,layout",
    [("sd3", "shared_base_adapters"), ("qwen_image", "shared_base_adapters"), ("dit", "independent")],
)
def test_phase_flops_equal_a_direct_count_and_leave_the_run_untouched(tmp_path, family, layout):
    """Each phase's `perf/<role>/flops` (hook + meta-device pricing) equals torch's FlopCounterMode run
    around the live phase of a twin runtime whose counter is closed; both twins end bit for bit alike."""
    result = run_ranks(throughput_scenarios.count_phases, 1, tmp_path, family, layout)[0]
    assert result["unpriced"] is None
    phases = result["phases"]
    for phase in phases:
        assert phase["ours"] == phase["direct"] > 0, phase
        assert phase["samples"] == 4 and phase["seconds"] > 0 and not phase["twin_has_flops"]
    assert phases[0]["ours"] != phases[1]["ours"]  # a fake-score and a student phase differ
    assert result["tensors"] > 0 and result["differing"] == []


def test_rates_come_from_the_counted_flops_and_the_elapsed_time():
    meter = Throughput(world_size=2, measured=500e12, datasheet=989.5e12)
    fake = {"perf/fake_score/seconds": 0.5, "perf/fake_score/samples": 4, "perf/fake_score/flops": 100e12}
    rates = meter.phase("fake_score", fake)
    assert rates["perf/fake_score/samples_per_s"] == pytest.approx(4 * 2 / 0.5)
    assert rates["perf/fake_score/tflop_per_s"] == pytest.approx(200.0)
    assert rates["perf/fake_score/mfu"] == pytest.approx(200e12 / 500e12)
    assert rates["perf/fake_score/mfu_datasheet"] == pytest.approx(200e12 / 989.5e12)
    assert not any(k.startswith("perf/cycle") for k in rates)
    student = {"perf/student/seconds": 1.5, "perf/student/samples": 3, "perf/student/flops": 250e12}
    rates = meter.phase("student", student)
    assert rates["perf/student/tflop_per_s"] == pytest.approx(250 / 1.5)
    # The cycle: both phases' FLOPs over both phases' seconds; the student's samples on both workers.
    assert rates["perf/cycle/tflop_per_s"] == pytest.approx(350 / 2.0)
    assert rates["perf/cycle/samples_per_s"] == pytest.approx(3 * 2 / 2.0)
    assert rates["perf/cycle/mfu"] == pytest.approx(175e12 / 500e12)
    line = describe(rates)
    assert "175 TFLOP/s/device" in line and "MFU 35.0% measured" in line and "17.7% datasheet" in line
    # The next cycle starts afresh.
    rates = meter.phase("student", student)
    assert rates["perf/cycle/tflop_per_s"] == pytest.approx(250 / 1.5)


def test_rates_without_flops_or_denominators():
    meter = Throughput(world_size=1, measured=None, datasheet=None)
    rates = meter.phase("fake_score", {"perf/fake_score/seconds": 2.0, "perf/fake_score/samples": 4})
    assert rates == {"perf/fake_score/samples_per_s": 2.0}
    student = {"perf/student/seconds": 1.0, "perf/student/samples": 2, "perf/student/flops": 10**12}
    rates = meter.phase("student", student)
    assert rates["perf/student/tflop_per_s"] == pytest.approx(1.0)
    assert not any("mfu" in k for k in rates)
    assert "perf/cycle/tflop_per_s" not in rates  # one phase of the cycle was not counted
    assert math.isclose(rates["perf/cycle/samples_per_s"], 2 / 3.0)
    assert describe(rates) == "0.667 samples/s"
    assert meter.phase("student", {}) == {}


def test_a_skipped_student_phase_does_not_close_the_cycle():
    meter = Throughput(world_size=1, measured=None, datasheet=None)
    phase = {"perf/student/seconds": 1.0, "perf/student/samples": 2, "perf/student/flops": 10**12}
    rates = meter.phase("student", {**phase, "stepped": False})
    assert not any(k.startswith("perf/cycle") for k in rates)
    rates = meter.phase("student", {**phase, "stepped": True})
    assert rates["perf/cycle/tflop_per_s"] == pytest.approx(2 / 2.0)  # both phases' FLOPs over both seconds


def test_denominators_on_a_cpu():
    assert datasheet_rate("cpu") is None
    assert measure_matmul_rate("cpu") is None


def test_the_progress_line_shows_small_losses_with_four_significant_digits(monkeypatch):
    # A fake score that starts at the teacher gives DMD losses of ~1e-5 (the H200 Qwen-Image run): at four
    # decimals the line read 0.0000, as if nothing were trained.
    import io

    from verl_dmd.trainer.ray_trainer import _Progress

    monkeypatch.setattr("sys.stderr", io.StringIO())  # not a terminal, also under `pytest -s`: the line form

    lines = []
    progress = _Progress(total=3, start=0, enabled=True, log=lines.append)
    progress.update(
        3, "student", {"student/dmd_loss": 1.3836373e-05, "fake_score/fake_loss": 1.9774309, "x": 0.5}
    )
    assert len(lines) == 1
    assert "dmd_loss 1.384e-05" in lines[0] and "fake_loss 1.9774" in lines[0], lines[0]
