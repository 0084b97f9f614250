"""`DistillationRayTrainer`: the driver loop of a distillation run.

`fit()` reads as the algorithm: the controller decides the phase, the data
provider yields the global batch, the worker group runs the phase on every
rank, the controller records whether it stepped. Around that: metrics to verl's
`Tracking` (console, tensorboard, wandb, ... as `trainer.loggers` says),
progress with throughput and ETA, checkpoints every `checkpoint.save_every`
global steps, at the end and on SIGTERM/SIGINT (the phase in flight finishes,
a checkpoint is published, the process exits with 128 + the signal number),
resume from `checkpoint.resume`, validation every `validation.every` steps and
at the end, and the export of the final checkpoint (`export.at_end`).

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
from pathlib import Path
from typing import Any

from verl_dmd.controller import DistillationController
from verl_dmd.phases import PhaseRequest, Role

EXIT_SIGNALLED = 128
"""A run stopped by a signal exits with 128 + the signal number (SIGTERM: 143), after its checkpoint."""


class TrainerError(RuntimeError):
    """A run that cannot go on; the message is one line."""


def build_data_provider(plan, group, info: dict[str, Any], log: Callable[[str], None]):
    """The driver-side data provider named by `data.name`."""
    if plan.data.name == "digits":
        from verl_dmd.trainer.digits import DigitsProvider

        return DigitsProvider(plan, group, info, log)
    if plan.data.name == "embeddings":
        from verl_dmd.trainer.embeddings import EmbeddingsProvider

        return EmbeddingsProvider(plan, info)
    raise TrainerError(
        f"config key 'data.name' = {plan.data.name!r}: allowed: digits, embeddings; fix: set data.name"
    )


def build_validator(plan, group, info: dict[str, Any]):
    if plan.data.name == "digits":
        from verl_dmd.trainer.digits import DigitsValidator

        return DigitsValidator(plan, group, info)
    return None


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
            self.bar.set_postfix(phase=phase, **{k: f"{v:.4f}" for k, v in losses.items()}, refresh=False)
            self.bar.refresh()
            return
        if step % self.every and step != self.total:
            return
        elapsed = time.perf_counter() - self.started
        done = step - self.start
        rate = done / elapsed if elapsed > 0 and done > 0 else float("nan")
        eta = (self.total - step) / rate if rate == rate and rate > 0 else float("nan")
        shown = "  ".join(f"{k} {v:.4f}" for k, v in losses.items())
        self.log(
            f"step {step:6d}/{self.total}  {shown}  {rate:6.2f} steps/s  elapsed {elapsed:6.1f}s  eta {eta:6.1f}s"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


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
        self._saved: tuple[int, int, str] | None = (
            None  # (phase index, global step, path) of the newest checkpoint
        )
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
        from verl_dmd.controller import TooManySkipsError

        try:
            return self._fit()
        except TrainerError as err:  # user input (data files, settings): exit 2, as plan errors
            print(f"verl-dmd: error: {err}", file=sys.stderr, flush=True)
            return 2
        except (WorkerError, TooManySkipsError) as err:
            print(f"verl-dmd: error: {err}", file=sys.stderr, flush=True)
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
        from verl.utils.tracking import Tracking

        plan = self.plan
        total = plan.trainer.total_steps
        self.output_dir.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        self.log(
            f"verl-dmd: {plan.model.adapter} / {plan.data.name}, {plan.resources.world_size} worker(s) "
            f"({self.backend}), {total} student steps, outputs in {self.output_dir}"
        )
        self.group = self._start_group()
        info = self.group.init_model()[0]
        self.log(f"workers ready on {info['device']} in {time.perf_counter() - started:.1f} s")
        try:
            provider = build_data_provider(plan, self.group, info, self.log)
        except ValueError as err:  # user input the provider reads (data files, pairs): one line
            raise TrainerError(str(err).splitlines()[0]) from None
        controller = DistillationController(
            fake_update_ratio=plan.algorithm.fake_update_ratio,
            fake_warmup_steps=plan.algorithm.fake_warmup_steps,
            max_consecutive_skips=plan.trainer.max_consecutive_skips,
        )
        loaded = self.group.load_checkpoint()
        if loaded is not None:
            controller.load_state_dict(loaded["trainer_state"]["controller"])
            try:
                provider.load_state_dict(loaded["trainer_state"]["data"])
            except ValueError as err:
                raise TrainerError(f"{loaded['path']}: {err}") from None
            self._saved = (controller.phase_index, loaded["global_step"], loaded["path"])
            note = ""
            if loaded["saved_world_size"] != plan.resources.world_size:
                note = f" (saved by {loaded['saved_world_size']} worker(s): random streams re-seeded)"
            self.log(f"resumed from {loaded['path']} at global step {loaded['global_step']}{note}")
        tracking = Tracking(
            project_name=plan.trainer.project_name,
            experiment_name=plan.trainer.experiment_name,
            default_backend=list(plan.trainer.loggers),
            config=plan.to_dict(),
        )
        validator = build_validator(plan, self.group, info)
        progress = _Progress(total, controller.global_step, plan.trainer.progress_bar, self.log)
        code = 1  # until the run ends normally or by a signal
        try:
            fake_metrics: dict[str, Any] = {}
            while not controller.is_done(total):
                role = controller.next_phase()
                spec = getattr(plan.batch, role.value)
                size = spec.micro_batch_size * spec.accumulation_steps * self.group.world_size
                step = controller.student_steps if role is Role.STUDENT else controller.fake_steps
                request = PhaseRequest(role=role, global_step=controller.global_step, role_step=step,
                                       phase_index=controller.phase_index)  # fmt: skip
                metrics = self.group.run_phase(request, provider.next_batch(size))[0]
                controller.record(role, stepped=metrics["stepped"])
                if role is Role.FAKE_SCORE:
                    fake_metrics = metrics
                elif metrics["stepped"]:
                    global_step = controller.global_step
                    progress.update(global_step, role.value, {**fake_metrics, **metrics})
                    if global_step % plan.trainer.log_every == 0 or global_step == total:
                        tracking.log(data=_loggable({**fake_metrics, **metrics}), step=global_step)
                    if plan.checkpoint.save_every and global_step % plan.checkpoint.save_every == 0:
                        self._save(controller, provider)
                    if (
                        plan.validation.every
                        and global_step % plan.validation.every == 0
                        and global_step < total
                    ):
                        self._validate(validator, tracking, global_step, final=False)
                if self._stop_signal is not None:
                    self._save(controller, provider)
                    self.log(f"stopped by {signal.Signals(self._stop_signal).name} at global step "
                             f"{controller.global_step}; relaunch the same command to resume")  # fmt: skip
                    code = EXIT_SIGNALLED + self._stop_signal
                    self._clean_exit = True
                    return code
            progress.close()
            trained = time.perf_counter() - started
            path = self._save(controller, provider)
            self._validate(validator, tracking, controller.global_step, final=True, trained_seconds=trained)
            if plan.export.at_end:
                self._export(path)
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

    # ------------------------------------------------------------------ around the loop

    def _save(self, controller, provider) -> str:
        """Publish a checkpoint of the current state, unless the newest one is of the same global step.

        Checkpoints are named by global step; after one at step N, only fake-score phases can have
        run before the next student step. Such a stop keeps the checkpoint of step N: the resume
        repeats those phases and, being deterministic, reaches the same state.
        """
        if self._saved is not None and self._saved[1] == controller.global_step:
            if self._saved[0] != controller.phase_index:
                self.log(f"checkpoint: keeping {self._saved[2]} (same global step; the "
                         f"{controller.phase_index - self._saved[0]} fake-score phase(s) since are repeated on resume)")  # fmt: skip
            return self._saved[2]
        started = time.perf_counter()
        state = {"controller": controller.state_dict(), "data": provider.state_dict()}
        path = self.group.save_checkpoint(controller.global_step, state)
        self._saved = (controller.phase_index, controller.global_step, path)
        self.log(f"checkpoint: {path} ({time.perf_counter() - started:.1f} s)")
        return path

    def _validate(self, validator, tracking, global_step: int, *, final: bool, trained_seconds=None) -> None:
        if validator is None:
            if final:
                self.log(f"validation: no validator for data.name = {self.plan.data.name!r} (digits only)")
            return
        started = time.perf_counter()
        out = self.output_dir if final else self.output_dir / "validation" / f"global_step_{global_step}"
        table, metrics, _ = validator.run(out)
        tracking.log(data=metrics, step=global_step)
        header = (
            f"digits quality at global step {global_step} ({self.plan.validation.num_samples} samples per row "
            f"against the 360 held-out digits; validation {time.perf_counter() - started:.0f} s"
            + (f"; training {trained_seconds:.0f} s" if trained_seconds is not None else "")
            + ")"
        )
        out.mkdir(parents=True, exist_ok=True)
        (out / "table.md").write_text(f"{header}\n\n{table}\n")
        self.log(f"\n{header}\n\n{table}\n\nsamples and grids: {out / 'samples'}")

    def _export(self, checkpoint_path: str) -> None:
        import json
        import shutil

        from verl_dmd.checkpoint.export import ExportError, export_checkpoint, export_root
        from verl_dmd.checkpoint.store import CheckpointError, CheckpointStore

        target = export_root(self.plan) / Path(checkpoint_path).name / self.plan.export.role
        try:
            if target.exists():
                manifest = CheckpointStore.verify(checkpoint_path).manifest
                info_file = target / "export.json"
                info = json.loads(info_file.read_text()) if info_file.is_file() else {}
                if info.get("manifest_sha256") == manifest.get("manifest_sha256"):
                    self.log(f"export: {target} holds this checkpoint's export already")
                    return
                self.log(f"export: {target} holds another run's export (checkpoint {info.get('checkpoint')}); "
                         "replacing it")  # fmt: skip
                shutil.rmtree(target)
            export_checkpoint(self.plan, checkpoint_path, log=self.log)
        except (ExportError, CheckpointError, ValueError) as err:
            raise TrainerError(f"export: {str(err).splitlines()[0]}") from None


def _loggable(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(float(v))
    }
