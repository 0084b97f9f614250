"""Shared set-ups of the prepare and family tests: tiny pipelines, prompt files, captioned images, overrides."""

from __future__ import annotations

import hashlib
from pathlib import Path

from verl_dmd.testing.pipelines import TINY_FRAMES, TINY_RESOLUTION

PROMPTS = [
    "a red cat",
    "a blue dog on a green hill at noon",
    "un café ☕ au soleil, très calme",
    "a tree",
    "the sea at night under a full moon",
    "a small house",
]
VALIDATION_PROMPTS = ["a red cat", "a green frog on a leaf"]


def recipe(family: str) -> str:
    return f"{family}_lora_dmd2"


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return path


def write_captioned_images(folder: Path, count: int, *, frames: int | None = None, size=(40, 36)) -> Path:
    """`count` flat-coloured images (animated GIFs of `frames` frames for video) with captions."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        colour = (40 * i % 256, 200 - 30 * i, 90)
        pictures = [
            Image.new("RGB", size, tuple(min(255, c + 25 * f) for c in colour)) for f in range(frames or 1)
        ]
        if frames:
            pictures[0].save(folder / f"img{i}.gif", save_all=True, append_images=pictures[1:], duration=100)
        else:
            pictures[0].save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(f"a picture number {i}\n")
    return folder


def prepare_overrides(family: str, pipeline: Path, data: Path, prompts: Path, **extra) -> list[str]:
    """A tiny CPU prepare of `family`: float32, batches of 2 in shards of 4, at the tiny pipeline's size."""
    height, width = TINY_RESOLUTION[family]
    overrides = [
        f"model.teacher.path={pipeline}", f"data.path={data}", f"prepare.prompts={prompts}",
        f"prepare.resolution=[{height},{width}]", "prepare.dtype=float32", "prepare.device=cpu",
        "prepare.batch_size=2", "prepare.shard_size=4", "prepare.pair_steps=2",
    ]  # fmt: skip
    if family in TINY_FRAMES:
        overrides.append(f"prepare.num_frames={TINY_FRAMES[family]}")
    overrides += [f"{k}={v}" for k, v in extra.items()]
    return overrides


def train_overrides(family: str, pipeline: Path, data: Path, out: Path, **extra) -> list[str]:
    """A tiny CPU run of `family`'s recipe: 2 student steps, K=1, LoRA rank 4, validation every step."""
    height, width = TINY_RESOLUTION[family]
    overrides = [
        f"model.teacher.path={pipeline}", f"data.path={data}", f"trainer.output_dir={out}",
        f"prepare.resolution=[{height},{width}]", "model.param_dtype=float32", "resources.device=cpu",
        "trainer.total_steps=2", "algorithm.fake_update_ratio=1", "model.activation_checkpointing=false",
        "model.student.lora.rank=4", "model.student.lora.alpha=4", "model.fake_score.lora.rank=4",
        "model.fake_score.lora.alpha=4", "batch.student.micro_batch_size=2", "batch.fake_score.micro_batch_size=2",
        "batch.student.accumulation_steps=1", "batch.fake_score.accumulation_steps=1", "validation.every=1",
        "validation.num_samples=2", "validation.teacher_steps=2", "trainer.loggers=[console,tensorboard]",
        "trainer.progress_bar=false",
    ]  # fmt: skip
    if family in TINY_FRAMES:
        overrides.append(f"prepare.num_frames={TINY_FRAMES[family]}")
    overrides += [f"{k}={v}" for k, v in extra.items()]
    return overrides


def digests(folder: Path) -> dict[str, str]:
    """SHA-256 of every file of a data set directory, by name."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()
    }
