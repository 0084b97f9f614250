"""`DistillationRayTrainer`: the driver loop of a distillation run.

`fit()` reads as the algorithm: the controller decides the phase, the data
provider yields the global batch, the worker group runs the phase on every
rank, the controller records whether it stepped. Around that: metrics to verl's
`Tracking` (console, tensorboard, wandb, ... as `trainer.loggers` says),
progress with throughput and ETA, and three components that each decide their
own cadence: `Checkpoints` (every `checkpoint.save_every` global steps, at the
end and on SIGTERM/SIGINT: the phase in flight finishes, a checkpoint is
published, the process exits with 128 + the signal number; resume from
`checkpoint.resume`), `Validation` (every `validation.every` steps and at the end,
through the validator the registry names) and `Export` (the final checkpoint,
`export.at_end`). Data providers and validators come from
`verl_dmd.trainer.registry`.

The worker group is ray's (`DiffusionDistillationWorkerGroup`, the default) or
the in-process one (`LocalWorkerGroup`, ``backend="local"``: no ray, one rank).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_dmd.batch import BatchError
from verl_dmd.controller import DistillationController, TooManySkipsError
from verl_dmd.phases import PhaseRequest, Role
from verl_dmd.trainer import throughput
from verl_dmd.trainer.registry import DATA_PROVIDERS, VALIDATORS, ValidatorUnavailable, validator_name

EXIT_SIGNALLED = 128
"""A run stopped by a signal exits with 128 + the signal number (SIGTERM: 143), after its checkpoint."""


class TrainerError(RuntimeError):
    """A run that cannot go on; the message is one line."""


def build_data_provider(plan, group, info, log: Callable[[str], None]):
    """The driver-side data provider `data.name` registers (one-line error for an unknown name)."""
    try:
        provider = DATA_PROVIDERS.get(plan.data.name)
    except ValueError as err:
        raise TrainerError(str(err)) from None
    return provider.from_plan(plan, group, info, log)


def build_validator(plan, group, info):
    """The validator of the run (validation.name, else the data provider's own), or None."""
    name = validator_name(plan)
    if name is None:
        return None
    try:
        return VALIDATORS.get(name).from_plan(plan, group, info)
    except ValueError as err:
        raise TrainerError(str(err).splitlines()[0]) from None


def _loss(value: float) -> str:
    """Four decimals, or four significant digits below 1e-3 (a DMD loss of 1.4e-05 is not 0.0000)."""
    return f"{value:.4f}" if value == 0 or abs(value) >= 1e-3 else f"{value:.3e}"


class _Progress:
    """A tqdm bar on a terminal; otherwise a line every 5% of the run (and at the end)."""

    def __init__(self, total: int, start: int, enabled: bool, log: Callable[[str], None]) -> None:
        self.total, self.start, self.log = total, start, log
        self.started = time.perf_counter()
        self.every = max(1, total // 20)
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)
        self.enabled = enabled

    def update(self, step: int, phase: str, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        losses = {
            k.split("/")[-1]: v for k, v in metrics.items() if k.endswith("loss") and isinstance(v, float)
        }
        if self.bar is not None:
            self.bar.n = step
            extra = (
                {"TFLOP/s": f"{metrics['perf/cycle/tflop_per_s']:.3g}"}
                if "perf/cycle/tflop_per_s" in metrics
                else {}
            )
            if "perf/cycle/mfu" in metrics:
                extra["MFU"] = f"{metrics['perf/cycle/mfu']:.1%}"
            self.bar.set_postfix(
                phase=phase, **{k: _loss(v) for k, v in losses.items()}, **extra, refresh=False
            )
            self.bar.refresh()
            return
        if step % self.every and step != self.total:
            return
        elapsed = time.perf_counter() - self.started
        done = step - self.start
        rate = done / elapsed if elapsed > 0 and done > 0 else float("nan")
        eta = (self.total - step) / rate if rate == rate and rate > 0 else float("nan")
        shown = "  ".join(f"{k} {_loss(v)}" for k, v in losses.items())
        perf = throughput.describe(metrics)
        self.log(
            f"step {step:6d}/{self.total}  {shown}  {rate:6.2f} steps/s  elapsed {elapsed:6.1f}s  eta {eta:6.1f}s"
            + (f"  {perf}" if perf else "")
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass(frozen=True)
class SavedCheckpoint:
    """The newest checkpoint of this run: where the controller stood and where it went."""

    phase_index: int
    global_step: int
    path: str


class Checkpoints:
    """When and how the driver saves: every `checkpoint.save_every` global steps, at the end, on a signal."""

    def __init__(self, plan, group, log: Callable[[str], None]) -> None:
        self.plan, self.group, self.log = plan, group, log
        self.newest: SavedCheckpoint | None = None

    def due(self, global_step: int) -> bool:
        every = self.plan.checkpoint.save_every
        return bool(every) and global_step % every == 0

    def resume(self, controller, provider) -> None:
        """Load `checkpoint.resume` into the workers and the driver's controller and provider (if any)."""
        started = time.perf_counter()
        loaded = self.group.load_checkpoint()
        if loaded is None:
            return
        controller.load_state_dict(loaded["trainer_state"]["controller"])
        try:
            provider.load_state_dict(loaded["trainer_state"]["data"])
        except ValueError as err:
            raise TrainerError(f"{loaded['path']}: {err}") from None
        self.newest = SavedCheckpoint(controller.phase_index, loaded["global_step"], loaded["path"])
        note = ""
        if loaded["saved_world_size"] != self.group.world_size:  # the ranks that run (one with --local)
            note = f" (saved by {loaded['saved_world_size']} worker(s): random streams re-seeded)"
        self.log(f"resumed from {loaded['path']} at global step {loaded['global_step']}{note} "
                 f"({time.perf_counter() - started:.1f} s)")  # fmt: skip

    def save(self, controller, provider) -> str:
        """Publish a checkpoint of the current state, unless the newest one is of the same global step.

        Checkpoints are named by global step; after one at step N, only fake-score phases can have
        run before the next student step. Such a stop keeps the checkpoint of step N: the resume
        repeats those phases and, being deterministic, reaches the same state.
        """
        newest = self.newest
        if newest is not None and newest.global_step == controller.global_step:
            if newest.phase_index != controller.phase_index:
                self.log(f"checkpoint: keeping {newest.path} (same global step; the "
                         f"{controller.phase_index - newest.phase_index} fake-score phase(s) since are repeated on resume)")  # fmt: skip
            return newest.path
        started = time.perf_counter()
        state = {"controller": controller.state_dict(), "data": provider.state_dict()}
        path = self.group.save_checkpoint(controller.global_step, state)
        self.newest = SavedCheckpoint(controller.phase_index, controller.global_step, path)
        self.log(f"checkpoint: {path} ({time.perf_counter() - started:.1f} s)")
        return path


class Validation:
    """Samples and scores through the run's validator every `validation.every` steps and at the end."""

    def __init__(self, plan, group, info, tracking, output_dir: Path, log: Callable[[str], None]) -> None:
        self.plan, self.tracking, self.output_dir, self.log = plan, tracking, output_dir, log
        self.unavailable: str | None = None
        try:
            self.validator = build_validator(plan, group, info)
        except ValidatorUnavailable as note:
            self.validator, self.unavailable = None, str(note)
            log(f"validation: off ({note})")

    def due(self, global_step: int) -> bool:
        every = self.plan.validation.every
        return bool(every) and global_step % every == 0 and global_step < self.plan.trainer.total_steps

    def run(self, global_step: int, *, final: bool, trained_seconds: float | None = None) -> None:
        if self.validator is None:
            if final and self.unavailable is None:
                registered = ", ".join(VALIDATORS.names())
                self.log(f"validation: no validator for data.name = {self.plan.data.name!r} (validation.name "
                         f"selects one; registered: {registered})")  # fmt: skip
            return
        started = time.perf_counter()
        out = self.output_dir if final else self.output_dir / "validation" / f"global_step_{global_step}"
        report = self.validator.run(out, global_step)
        self.tracking.log(data=report.metrics, step=global_step)
        log_images(self.tracking, report.images, global_step)
        header = (
            f"{report.title} at global step {global_step} ({report.scope}; validation "
            f"{time.perf_counter() - started:.0f} s"
            + (f"; training {trained_seconds:.0f} s" if trained_seconds is not None else "")
            + ")"
        )
        out.mkdir(parents=True, exist_ok=True)
        (out / "table.md").write_text(f"{header}\n\n{report.table}\n")
        where = f"\n\nsamples and grids: {report.samples}" if report.samples is not None else ""
        self.log(f"\n{header}\n\n{report.table}{where}")


class Export:
    """Exports the final checkpoint when `export.at_end` is on (kept if it holds that checkpoint already)."""

    def __init__(self, plan, log: Callable[[str], None]) -> None:
        self.plan, self.log = plan, log

    def at_end(self, checkpoint_path: str) -> None:
        if not self.plan.export.at_end:
            return
        from verl_dmd.checkpoint.export import ExportError, export_checkpoint
        from verl_dmd.checkpoint.store import CheckpointError

        try:
            export_checkpoint(self.plan, checkpoint_path, if_exists="reuse", log=self.log)
        except (ExportError, CheckpointError, ValueError) as err:
            raise TrainerError(f"export: {str(err).splitlines()[0]}") from None


class DistillationRayTrainer:
    """Drives one distillation run described by a `DistillationPlan`."""

    def __init__(
        self, plan, *, backend: str = "ray", worker_cls=None, log: Callable[[str], None] | None = None
    ):
        if backend not in ("ray", "local"):
            raise ValueError(f"backend = {backend!r}: allowed: ray, local")
        self.plan = plan
        self.backend = backend
        self.worker_cls = worker_cls
        self.log = log or (lambda line: print(line, flush=True))
        self.output_dir = Path(plan.trainer.output_dir)
        self.group = None
        self._stop_signal: int | None = None
        self._ray_started = False
        self._clean_exit = False

    # ------------------------------------------------------------------ set-up

    def _device(self) -> str:
        wanted = self.plan.resources.device
        if wanted != "auto":
            return wanted
        if self.backend == "local":
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        import ray

        return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"

    def _start_ray(self) -> None:
        import ray

        if ray.is_initialized():
            return
        kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": "WARNING"}
        if not os.environ.get("RAY_ADDRESS"):
            # A local cluster sized for the workers (each takes one CPU bundle) plus the driver.
            kwargs["num_cpus"] = max(os.cpu_count() or 1, self.plan.resources.world_size)
        ray.init(**kwargs)
        self._ray_started = True
        self._install_signal_handlers()  # ray.init replaces them with handlers that abort the driver

    def _start_group(self):
        if self.backend == "local":
            from verl_dmd.workers.group import LocalWorkerGroup

            if self.plan.resources.world_size != 1:
                self.log(
                    f"note: the local backend runs 1 rank (resources asks for {self.plan.resources.world_size}); "
                    "per-rank batch sizes are unchanged, so the global batch is smaller"
                )
            return LocalWorkerGroup(self.plan, device=self._device())
        from verl_dmd.workers.group import DiffusionDistillationWorkerGroup

        self._start_ray()
        return DiffusionDistillationWorkerGroup(self.plan, worker_cls=self.worker_cls, device=self._device())

    def _on_signal(self, signum, frame) -> None:
        if self._stop_signal is not None:  # a second signal: stop without waiting for the checkpoint
            raise KeyboardInterrupt
        self._stop_signal = signum
        self.log(
            f"received {signal.Signals(signum).name}: finishing this phase, saving a checkpoint, then exiting"
        )

    # ------------------------------------------------------------------ the loop

    def fit(self) -> int:
        """Run (or resume) to trainer.total_steps; returns the process exit code."""
        from verl_dmd.workers.group import WorkerError

        handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
        self._install_signal_handlers()
        try:
            return self._fit()
        except TrainerError as err:  # user input (data files, settings): exit 2, as plan errors
            print(f"verl-dmd: error: {err}", file=sys.stderr, flush=True)
            return 2
        except (WorkerError, TooManySkipsError) as err:
            print(f"verl-dmd: error: {err}", file=sys.stderr, flush=True)
            print(f"verl-dmd: {self._resume_note(err)}", file=sys.stderr, flush=True)
            return 1
        except KeyboardInterrupt:  # a second signal: stop now, without the checkpoint
            print(
                "verl-dmd: interrupted by a second signal; no checkpoint of the last phases", file=sys.stderr
            )
            return EXIT_SIGNALLED + (self._stop_signal or signal.SIGINT)
        finally:
            self._shutdown()
            for signum, previous in handlers.items():
                with contextlib.suppress(ValueError, TypeError):
                    signal.signal(signum, previous)

    def _resume_note(self, error: Exception) -> str:
        """After a failed run: what relaunching the same command starts from (never an exception of its
        own in place of the run's error)."""
        try:
            return self._relaunch_line(skips=isinstance(error, TooManySkipsError))
        except Exception as err:  # a note: the run's own error is printed already
            return f"what a relaunch would resume from could not be read ({type(err).__name__}: {err})"

    def _relaunch_line(self, *, skips: bool) -> str:
        """Read from the checkpoint root as the resume reads it (manifests and file sizes; the files'
        hashes are checked only as a resume loads them), so a checkpoint published just before a rank
        failed counts; with a newer checkpoint in this run's root that the resume would set aside."""
        from verl_dmd.checkpoint.composite import checkpoint_root
        from verl_dmd.checkpoint.store import CheckpointError, CheckpointStore

        plan = self.plan
        ckpt, total = plan.checkpoint, plan.trainer.total_steps
        store = CheckpointStore(checkpoint_root(plan))
        try:
            found = store.candidates(ckpt.resume)
        except CheckpointError as err:
            return f"relaunching the same command fails: {err}"
        newest = store.candidates("auto").checkpoints
        first = found.checkpoints[0] if found.checkpoints else None
        if first is None and found.damaged:
            return (f"relaunching the same command fails: no intact checkpoint to resume from "
                    f"({len(found.damaged)} damaged; the first: {found.damaged[0]})")  # fmt: skip
        if first is None:
            line = (
                f"with checkpoint.resume = {ckpt.resume!r}, relaunching the same command starts from step 0"
            )
            if newest:
                return (
                    f"{line}; the newest checkpoint is {newest[0].path} (global step {newest[0].global_step})"
                )
            when = "" if ckpt.save_every else ": only at the end and on a signal"
            return f"{line} (no checkpoint yet; checkpoint.save_every = {ckpt.save_every}{when})"
        if first.global_step >= total:
            left = "validation and export" if plan.export.at_end else "validation"
            line = (f"{first.path} is of the last step ({first.global_step}): relaunching the same command "
                    f"repeats only the final {left}")  # fmt: skip
        else:
            line = f"relaunching the same command resumes from {first.path} (global step {first.global_step} of {total})"
            if skips:
                line += " and, the run being deterministic, meets the same non-finite steps again"
        if newest and newest[0].global_step > first.global_step:
            line += (f"; it sets aside the newer {newest[0].path} (global step {newest[0].global_step}): to continue "
                     f"from that one, relaunch with checkpoint.resume={newest[0].path}")  # fmt: skip
        return line

    def _install_signal_handlers(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread: no signal handling
                signal.signal(signum, self._on_signal)

    def _shutdown(self) -> None:
        if self.group is not None:
            try:
                if self._clean_exit:
                    self.group.close()
                else:  # a worker may be stuck in a phase or a collective: do not wait for it
                    self.group.kill()
            except BaseException as err:  # the run's outcome is already decided; report and go on
                self.log(f"note: stopping the workers failed: {err!r}")
            self.group = None
        if self._ray_started:
            import ray

            ray.shutdown()
            self._ray_started = False

    def _fit(self) -> int:
        plan, started = self.plan, time.perf_counter()
        info, provider, controller, checkpoints = self._set_up(started)
        tracking = _tracking(plan, self.output_dir)
        validation = Validation(plan, self.group, info, tracking, self.output_dir, self.log)
        progress = _Progress(
            plan.trainer.total_steps, controller.global_step, plan.trainer.progress_bar, self.log
        )
        code = 1  # until the run ends normally or by a signal
        try:
            signalled = self._train(controller, provider, checkpoints, validation, tracking, progress)
            if signalled is not None:
                code = signalled
                return code
            progress.close()
            trained = time.perf_counter() - started
            path = checkpoints.save(controller, provider)
            validation.run(controller.global_step, final=True, trained_seconds=trained)
            Export(plan, self.log).at_end(path)
            self.log(f"done: {controller.global_step} student steps in {time.perf_counter() - started:.0f} s; "
                     f"outputs in {self.output_dir}")  # fmt: skip
            code = 0
            self._clean_exit = True
            if self._stop_signal is not None:  # arrived after the last phase: the run is complete anyway
                self.log(
                    f"note: {signal.Signals(self._stop_signal).name} arrived after the last phase; the run completed"
                )
            return code
        finally:
            progress.close()
            tracking.finish(exit_code=code)

    def _set_up(self, started: float):
        """The workers, the data provider, the controller and the checkpoints, resumed if there is one."""
        plan = self.plan
        self.output_dir.mkdir(parents=True, exist_ok=True)
        workers = 1 if self.backend == "local" else plan.resources.world_size
        mesh, resources = plan.model.fsdp_mesh, plan.resources
        shape = {"shard": (1, workers), "replicate": (workers, 1),
                 "hybrid": (resources.nnodes, resources.workers_per_node)}.get(mesh, mesh)  # fmt: skip
        self.log(
            f"verl-dmd: {plan.model.adapter} / {plan.data.name}, {workers} worker(s) ({self.backend})"
            + (f", FSDP2 mesh {shape[0]} x {shape[1]} (replicate x shard)" if shape[0] > 1 else "")
            + f", {plan.trainer.total_steps} student steps, outputs in {self.output_dir}"
        )
        self.group = self._start_group()
        info = self.group.init_model()[0]
        ready = time.perf_counter() - started
        parts = info.init_seconds or {}
        where = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in parts.items())
        rest = (
            f"; the rest ({ready - sum(parts.values()):.1f} s): worker start, imports, ray" if parts else ""
        )
        self.log(
            f"workers ready on {info.device} in {ready:.1f} s"
            + (f" (rank 0: {where}{rest})" if parts else "")
        )
        if info.attention_kernels_off:
            self.log(f"attention kernels off for {plan.model.adapter}: {', '.join(info.attention_kernels_off)} "
                     "(the adapter's excluded_attention_kernels; docs/architecture.md says why)")  # fmt: skip
        self._unpriced_noted = False
        self.throughput = throughput.Throughput(
            self.group.world_size, info.matmul_flops_per_s, info.datasheet[1] if info.datasheet else None
        )
        if info.matmul_flops_per_s or info.datasheet:
            named = (
                [f"measured bf16 matmul rate {info.matmul_flops_per_s / 1e12:.0f} TFLOP/s"]
                if (info.matmul_flops_per_s)
                else []
            )
            if info.datasheet:
                named.append(
                    f"{info.datasheet[0]} datasheet dense bf16 {info.datasheet[1] / 1e12:.1f} TFLOP/s"
                )
            self.log("MFU (perf/*/mfu, perf/*/mfu_datasheet) against: " + "; ".join(named))
        try:
            provider = build_data_provider(plan, self.group, info, self.log)
        except ValueError as err:  # user input the provider reads (data files, pairs): one line
            raise TrainerError(str(err).splitlines()[0]) from None
        controller = DistillationController(
            fake_update_ratio=plan.algorithm.fake_update_ratio,
            fake_warmup_steps=plan.algorithm.fake_warmup_steps,
            max_consecutive_skips=plan.trainer.max_consecutive_skips,
        )
        checkpoints = Checkpoints(plan, self.group, self.log)
        checkpoints.resume(controller, provider)
        return info, provider, controller, checkpoints

    def _train(self, controller, provider, checkpoints, validation, tracking, progress) -> int | None:
        """Phases until trainer.total_steps; the exit code when a signal stopped it (after its checkpoint)."""
        plan, total = self.plan, self.plan.trainer.total_steps
        fake_metrics: dict[str, Any] = {}
        while not controller.is_done(total):
            role = controller.next_phase()
            metrics = self._run_phase(controller, role, provider)
            if role is Role.FAKE_SCORE:
                fake_metrics = metrics
            elif metrics["stepped"]:
                global_step = controller.global_step
                progress.update(global_step, role.value, {**fake_metrics, **metrics})
                if global_step % plan.trainer.log_every == 0 or global_step == total:
                    tracking.log(data=_loggable({**fake_metrics, **metrics}), step=global_step)
                if checkpoints.due(global_step):
                    checkpoints.save(controller, provider)
                if validation.due(global_step):
                    validation.run(global_step, final=False)
            if self._stop_signal is not None:
                checkpoints.save(controller, provider)
                self.log(f"stopped by {signal.Signals(self._stop_signal).name} at global step "
                         f"{controller.global_step}; relaunch the same command to resume")  # fmt: skip
                self._clean_exit = True
                return EXIT_SIGNALLED + self._stop_signal
        return None

    def _run_phase(self, controller, role: Role, provider) -> dict[str, Any]:
        """One phase of `role` on every rank with the provider's next global batch; recorded in the controller."""
        spec = getattr(self.plan.batch, role.value)
        size = spec.micro_batch_size * spec.accumulation_steps * self.group.world_size
        step = controller.student_steps if role is Role.STUDENT else controller.fake_steps
        request = PhaseRequest(role=role, global_step=controller.global_step, role_step=step,
                               phase_index=controller.phase_index)  # fmt: skip
        try:
            metrics = self.group.run_phase(request, provider.next_batch(size))[0]
        except BatchError as err:  # the provider's batch does not split over the ranks: user data
            raise TrainerError(f"data provider {self.plan.data.name!r}: {err}") from None
        controller.record(role, stepped=metrics["stepped"])
        metrics.update(self.throughput.phase(role.value, metrics))
        if metrics.get("perf/unpriced") and not self._unpriced_noted:
            self._unpriced_noted = True
            self.log(f"note: model FLOPs are not counted (no TFLOP/s, no MFU): {metrics['perf/unpriced']}")
        return metrics


def _tracking(plan, output_dir: Path):
    """verl's Tracking for the run; its tensorboard logs go to <output_dir>/tensorboard unless $TENSORBOARD_DIR
    says otherwise (verl's own default is tensorboard_log/ under the working directory)."""
    from verl.utils.tracking import Tracking

    chosen = "TENSORBOARD_DIR" in os.environ
    if not chosen:
        os.environ["TENSORBOARD_DIR"] = str(output_dir / "tensorboard")
    try:
        return Tracking(
            project_name=plan.trainer.project_name,
            experiment_name=plan.trainer.experiment_name,
            default_backend=list(plan.trainer.loggers),
            config=plan.to_dict(),
        )
    finally:
        if not chosen:
            del os.environ["TENSORBOARD_DIR"]


def log_images(tracking, images: dict[str, Any], step: int) -> None:
    """Send (H, W, 3) uint8 pictures to the Tracking backends that take images (tensorboard, wandb)."""
    if not images:
        return
    backends = getattr(tracking, "logger", {})
    board = backends.get("tensorboard")
    if board is not None:
        for tag, picture in images.items():
            board.writer.add_image(tag, picture, step, dataformats="HWC")
        board.writer.flush()
    wandb = backends.get("wandb")
    if wandb is not None:
        wandb.log({tag: wandb.Image(picture) for tag, picture in images.items()}, step=step)


def _loggable(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(float(v))
    }
