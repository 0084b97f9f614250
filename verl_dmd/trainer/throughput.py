"""Throughput and model-FLOP utilisation from the workers' phase figures (driver side).

Each phase reports, for rank 0, its wall seconds, the samples it trained on and the model FLOPs it
ran (`perf/<role>/{seconds,samples,flops}`, counted by `verl_dmd.runtime.flops`; every rank runs the
same shapes). `Throughput` turns them into rates:

- `perf/<role>/samples_per_s`: the phase's samples on all workers / its seconds;
- `perf/<role>/tflop_per_s`: the phase's model FLOPs on one worker / its seconds / 1e12 (per device);
- `perf/<role>/mfu`: that rate / the bf16 matmul rate measured on the device when the workers started
  (the practical ceiling), and `perf/<role>/mfu_datasheet`: / the datasheet's dense bf16 peak
  (989.5 TFLOP/s for an H100 or H200, FastVideo's denominator);

and the same over a DMD2 cycle (the phases since the last student step, skipped ones included, and that
step) as `perf/cycle/*`, where samples/s counts the student's samples. Seconds are the phases' own (on
rank 0): the driver's time between phases (data, RPC, checkpoints, validation) is not in them, so these
are the training's rates, not the run's; the first cycle holds the fake-score warm-up phases, and the
first after a resume only the phases run since. The progress line shows the cycle's.
"""

from __future__ import annotations

from typing import Any


class Throughput:
    """Rates of each phase and of each cycle; `denominators` are FLOP/s per device (None: not known)."""

    def __init__(self, world_size: int, measured: float | None, datasheet: float | None) -> None:
        self.world_size = world_size
        self.denominators = {"mfu": measured, "mfu_datasheet": datasheet}
        self._cycle = {"seconds": 0.0, "flops": 0, "counted": True}

    def rates(self, prefix: str, seconds: float, samples: int, flops: int | None) -> dict[str, float]:
        if seconds <= 0:
            return {}
        rates = {f"{prefix}/samples_per_s": samples * self.world_size / seconds}
        if flops is not None:
            per_s = flops / seconds
            rates[f"{prefix}/tflop_per_s"] = per_s / 1e12
            for name, denominator in self.denominators.items():
                if denominator:
                    rates[f"{prefix}/{name}"] = per_s / denominator
        return rates

    def phase(self, role: str, metrics: dict[str, Any]) -> dict[str, float]:
        """The phase's rates; a student phase also closes the cycle and adds its rates."""
        seconds = metrics.get(f"perf/{role}/seconds")
        if seconds is None:
            return {}
        samples, flops = metrics[f"perf/{role}/samples"], metrics.get(f"perf/{role}/flops")
        out = self.rates(f"perf/{role}", seconds, samples, flops)
        cycle = self._cycle
        cycle["seconds"] += seconds
        cycle["counted"] = cycle["counted"] and flops is not None
        cycle["flops"] += flops or 0
        if role == "student" and metrics.get("stepped", True):  # a skipped student phase: the cycle goes on
            out.update(
                self.rates(
                    "perf/cycle", cycle["seconds"], samples, cycle["flops"] if cycle["counted"] else None
                )
            )
            self._cycle = {"seconds": 0.0, "flops": 0, "counted": True}
        return out


def describe(metrics: dict[str, Any]) -> str:
    """The cycle's rates for the progress line ('' when there are none)."""
    parts = []
    if "perf/cycle/samples_per_s" in metrics:
        parts.append(f"{metrics['perf/cycle/samples_per_s']:.3g} samples/s")
    if "perf/cycle/tflop_per_s" in metrics:
        parts.append(f"{metrics['perf/cycle/tflop_per_s']:.3g} TFLOP/s/device")
    if "perf/cycle/mfu" in metrics:
        parts.append(f"MFU {metrics['perf/cycle/mfu']:.1%} measured")
    if "perf/cycle/mfu_datasheet" in metrics:
        parts.append(f"{metrics['perf/cycle/mfu_datasheet']:.1%} datasheet")
    return "  ".join(parts)
