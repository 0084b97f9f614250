"""The `pipeline` validator: samples of the flow-matching families decoded by their pipeline's VAE.

For a data set made by verl-dmd-prepare from the teacher's pipeline (SD3, Flux,
Qwen-Image, Wan): a fixed set of validation prompts (the data set's validation
prompts, else its first prompts; at most ``validation.num_samples``), each with
the same starting noise for every model, sampled by

- the teacher at ``validation.teacher_steps`` Euler steps with its CFG
  (``algorithm.teacher_guidance_scale``) and shift ``algorithm.sigma_shift``: the
  reference. The teacher is frozen, so it is sampled and decoded once per driver
  process and reused at every later validation;
- each role of ``validation.roles`` (student, student_ema) at 1 step, its trained
  step count and ``validation.sampling_steps``, with fixed re-noising draws: by
  default through the inference replica (``validation.replica``: a diffusers
  pipeline of the family on rank 0, to which a weight sync publishes the role
  first, `verl_dmd.workers.replica`; the table and prompts.txt name the version
  sampled), else by the training engine's role directly.

Sampling and decoding are split over the ranks (`group.euler`, `group.few_step`,
`group.decode`: the VAE is loaded on each worker from model.teacher.path). What is
written under ``<trainer.output_dir>/samples/step_<N>/``: ``comparison.png`` (rows:
the models, columns: the prompts), one grid per model (``<model>_<steps>step.png``;
for video, rows are samples and columns frames, plus an animated ``.gif``),
``prompts.txt`` and ``latents.safetensors``. The comparison goes to the Tracking
backends as an image (tensorboard, wandb).

The numbers, per model against the teacher's sample from the same noise and prompt:
the mean squared error of the latents, and the mean squared error and PSNR of the
decoded 8-bit pixels (scaled to [0, 1]). They say how close a student stays to its
teacher's own trajectory, which DMD does not ask of it (distribution matching lets a
sample drift from the ODE solution of its noise): use them to see a run diverge or
collapse (errors jumping, PSNR falling), not to rank runs; they are no measure of
image quality or of prompt alignment. The pictures are for that.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from verl_dmd import seeding
from verl_dmd.trainer.registry import ValidationReport, ValidatorUnavailable, register_validator


def _unavailable(plan) -> str | None:
    """Why decoded validation cannot run for this plan (None: it can)."""
    from verl_dmd.adapters import get_adapter
    from verl_dmd.data.prepared import PreparedDataset, teacher_pipeline

    if not get_adapter(plan.model.adapter).pipeline_classes:
        return f"model.adapter = {plan.model.adapter!r} has no pipeline support (no VAE decoding)"
    if teacher_pipeline(plan) is None:
        return ("the teacher is not a component of a pipeline directory (model.teacher.path with "
                "model.teacher.subfolder and a model_index.json), so there is no VAE to decode with")  # fmt: skip
    if not plan.data.path or not PreparedDataset.is_prepared(Path(plan.data.path).expanduser()):
        return "data.path is not a data set made by verl-dmd-prepare (no prompts or sizes to sample with)"
    return None


@register_validator("pipeline")
class PipelineValidator:
    """Decoded samples of the teacher and the student roles; see the module docstring."""

    @classmethod
    def preflight(cls, plan) -> None:
        """Asked for by name (validation.name=pipeline), it must have something to sample: checked before any
        worker starts. As the embeddings provider's default it steps aside instead (see from_plan)."""
        reason = _unavailable(plan)
        if reason is not None and plan.validation.name == "pipeline":
            raise ValueError(f"config key 'validation.name' = 'pipeline': {reason}; fix: prepare the data set with "
                             "verl-dmd-prepare from the teacher's pipeline, or another validator")  # fmt: skip

    @classmethod
    def from_plan(cls, plan, group, info) -> PipelineValidator:
        reason = _unavailable(plan)
        if reason is not None:
            if plan.validation.name == "pipeline":
                raise ValueError(f"config key 'validation.name' = 'pipeline': {reason}; fix: prepare the data set "
                                 "with verl-dmd-prepare from the teacher's pipeline, or another validator")  # fmt: skip
            raise ValidatorUnavailable(f"no decoded samples: {reason}")
        return cls(plan, group, info)

    def __init__(self, plan, group, info) -> None:
        from verl_dmd.adapters import get_adapter
        from verl_dmd.data.prepared import PreparedDataset
        from verl_dmd.trainer.embeddings import RowTable, _prefixed

        self.plan, self.group, self.info = plan, group, info
        self.adapter = get_adapter(plan.model.adapter)()
        self.dataset = PreparedDataset.open(Path(plan.data.path).expanduser())
        intent = self.dataset.intent
        self.height, self.width = intent["resolution"]
        self.num_frames = intent["num_frames"]
        ragged = self.dataset.ragged
        part = "validation" if self.dataset.files("validation") else "prompts"
        table = RowTable(self.dataset.files(part), _prefixed(ragged, "cond."), what=str(self.dataset.root))
        count = min(plan.validation.num_samples, len(table))
        rows = list(range(count))
        self.cond = {k.removeprefix("cond."): v for k, v in table.read(table.keys, rows).items()}
        uncond = RowTable(
            self.dataset.files("uncond"), _prefixed(ragged, "uncond."), what=str(self.dataset.root)
        )
        self.uncond = {k.removeprefix("uncond."): v for k, v in uncond.read(uncond.keys, [0] * count).items()}
        self.prompts = _prompts(self.dataset, part)[:count]
        shape = self.dataset.latent_shape
        self.noise = torch.stack(
            [
                torch.randn(shape, generator=seeding.generator(plan.trainer.seed, "validation.noise", i))
                for i in rows
            ]
        )
        self._teacher: tuple[torch.Tensor, torch.Tensor, float] | None = None
        self._synced: dict[str, str] = {}
        self._sync_seconds: dict[str, float] = {}

    # -- sampling

    def _guidance(self) -> float:
        from verl_dmd.losses import standard_guidance_scale

        return standard_guidance_scale(
            self.plan.algorithm.teacher_guidance_scale, self.plan.algorithm.cfg_form
        )

    def _teacher_sample(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """The teacher's latents and decoded pixels (made once: the teacher never changes) and their seconds."""
        if self._teacher is None:
            started = time.perf_counter()
            guidance = self._guidance()
            latents = self.group.euler(
                "teacher", self.noise, self.cond, self.plan.validation.teacher_steps, guidance=guidance,
                uncond=self.uncond if guidance != 1.0 else None, shift=self.plan.algorithm.sigma_shift,
            )  # fmt: skip
            pixels = self.group.decode(latents, height=self.height, width=self.width)
            self._teacher = (latents, pixels, time.perf_counter() - started)
        return self._teacher

    def _student_steps(self) -> list[int]:
        return sorted({1, self.plan.algorithm.student_steps, *self.plan.validation.sampling_steps})

    def _student_sample(self, role: str, steps: int) -> torch.Tensor:
        from verl_dmd.algorithms.sampling import even_schedule, renoise_draws, trained_schedule

        algorithm, sigma_max = self.plan.algorithm, self.info.sigma_max
        if steps == algorithm.student_steps:
            schedule = trained_schedule(algorithm, sigma_max).tolist()
        else:
            schedule = even_schedule(steps, algorithm.sigma_shift, sigma_max).tolist()
        draws = seeding.generator(self.plan.trainer.seed, "validation.renoise", steps)
        renoise = renoise_draws(self.noise.shape, steps, draws)
        if self.plan.validation.replica:
            latents, version = self.group.replica_few_step(self.noise, self.cond, schedule, renoise)
            if version != self._synced[role]:
                raise RuntimeError(
                    f"the replica sampled {version}, not the {self._synced[role]} synced for {role}"
                )
            return latents
        return self.group.few_step(role, self.noise, self.cond, schedule, renoise)

    def _sync(self, role: str) -> str:
        """Publish `role` to the replica (`verl_dmd.runtime.weight_sync`); the version it then holds."""
        synced = self.group.sync_replica(role)
        self._synced[role] = synced["version"]
        self._sync_seconds[role] = synced["seconds"]
        return synced["version"]

    def run(self, out_dir: Path, global_step: int) -> ValidationReport:
        """Sample every row, decode, compare with the teacher, write the pictures; the report."""
        from verl_dmd.eval.images import save_gif, save_png

        teacher_latents, teacher_pixels, teacher_seconds = self._teacher_sample()
        rows = [
            ("teacher", self.plan.validation.teacher_steps, teacher_latents, teacher_pixels, teacher_seconds)
        ]
        for role in (r for r in ("student", "student_ema") if r in self.plan.validation.roles):
            if self.plan.validation.replica:
                self._sync(role)
            for steps in self._student_steps():
                started = time.perf_counter()
                latents = self._student_sample(role, steps)
                pixels = self.group.decode(latents, height=self.height, width=self.width)
                rows.append((role, steps, latents, pixels, time.perf_counter() - started))
        samples = Path(self.plan.trainer.output_dir) / "samples" / f"step_{global_step}"
        samples.mkdir(parents=True, exist_ok=True)
        video = self.num_frames is not None
        table = ["| model | steps | latent MSE vs teacher | pixel MSE vs teacher | PSNR (dB) | seconds |",
                 "|---|---|---|---|---|---|"]  # fmt: skip
        metrics: dict[str, float] = {}
        for model, steps, latents, pixels, seconds in rows:
            name = f"{model}_{steps}step"
            picture = _model_picture(pixels.numpy(), video)
            save_png(samples / f"{name}.png", picture)
            if video:
                save_gif(samples / f"{name}.gif", _frames(pixels.numpy(), columns=len(self.prompts)))
            if model == "teacher":
                table.append(f"| teacher (reference, Euler) | {steps} | - | - | - | {seconds:.1f} |")
                continue
            latent_mse = float((latents.double() - teacher_latents.double()).pow(2).mean())
            pixel_mse = float(((pixels.double() - teacher_pixels.double()) / 255.0).pow(2).mean())
            psnr = 10.0 * math.log10(1.0 / pixel_mse) if pixel_mse > 0 else float("inf")
            metrics.update({f"val/{name}/latent_mse": latent_mse, f"val/{name}/pixel_mse": pixel_mse,
                            f"val/{name}/psnr": psnr})  # fmt: skip
            shown = f"{model} ({self._synced[model]} on the replica)" if model in self._synced else model
            table.append(
                f"| {shown} | {steps} | {latent_mse:.4g} | {pixel_mse:.4g} | {psnr:.2f} | {seconds:.1f} |"
            )
        for role, seconds in self._sync_seconds.items():
            metrics[f"val/sync/{role}/seconds"] = seconds
        comparison = _comparison([r[3].numpy() for r in rows], video)
        save_png(samples / "comparison.png", comparison)
        if video:
            frames = [
                _comparison([r[3].numpy()[:, f : f + 1] for r in rows], video)
                for f in range(rows[0][3].shape[1])
            ]
            save_gif(samples / "comparison.gif", frames)
        (samples / "prompts.txt").write_text(
            "".join(f"{i}\t{p}\n" for i, p in enumerate(self.prompts))
            + "\nrows of comparison.png: " + ", ".join(f"{m} {s}-step" for m, s, *_ in rows) + "\n"
            + "".join(f"{role}: sampled through the inference replica holding {version}\n"
                      for role, version in self._synced.items())
        )  # fmt: skip
        _save_latents(samples / "latents.safetensors", rows, self.prompts)
        scope = (f"{len(self.prompts)} prompt(s) at {self.height}x{self.width}"
                 + (f", {self.num_frames} frames" if video else "")
                 + f"; teacher {self.plan.validation.teacher_steps} Euler steps, guidance {self._guidance():g}")  # fmt: skip
        return ValidationReport(
            title="decoded samples", scope=scope, table="\n".join(table), metrics=metrics, samples=samples,
            images={"samples/comparison": comparison},
        )  # fmt: skip


def _prompts(dataset, part: str) -> list[str]:
    from verl_dmd.data.prepared import shard_prompts

    out: list[str] = []
    for path in dataset.files(part):
        out += shard_prompts(path)
    return out


def _model_picture(pixels: np.ndarray, video: bool) -> np.ndarray:
    """One model's samples side by side; for video, one row per sample with its frames along the row."""
    from verl_dmd.eval.images import tile

    if video:  # (N, F, H, W, 3)
        n, f = pixels.shape[:2]
        return tile(pixels.reshape(n * f, *pixels.shape[2:]), columns=f)
    return tile(pixels, columns=pixels.shape[0])


def _frames(pixels: np.ndarray, columns: int) -> list[np.ndarray]:
    from verl_dmd.eval.images import tile

    return [tile(pixels[:, f], columns=columns) for f in range(pixels.shape[1])]


def _comparison(per_model: list[np.ndarray], video: bool) -> np.ndarray:
    """Rows: models; columns: prompts (for video: the middle frame, or the frame given)."""
    from verl_dmd.eval.images import tile

    if video:
        per_model = [p[:, p.shape[1] // 2] for p in per_model]
    stacked = np.concatenate(per_model)
    return tile(stacked, columns=per_model[0].shape[0])


def _save_latents(path: Path, rows: list[tuple[Any, ...]], prompts: list[str]) -> None:
    import safetensors.torch

    tensors = {f"{model}_{steps}step": latents.float().contiguous() for model, steps, latents, *_ in rows}
    safetensors.torch.save_file(tensors, path, metadata={"prompts": json.dumps(prompts, ensure_ascii=False)})
