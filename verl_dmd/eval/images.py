"""Samples on disk, for people and for later scoring: an .npz of the images (no pickled objects) and a PNG grid."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch


def save_samples(path: str | Path, images: torch.Tensor, labels: torch.Tensor, **meta: Any) -> Path:
    """Write images (N, C, H, W) and labels (N,) to an .npz (no pickled objects), plus scalar metadata."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = {k: np.asarray(v) for k, v in meta.items()}
    for key, value in extra.items():
        if value.dtype == object:
            raise ValueError(f"metadata {key!r} = {meta[key]!r}: only numbers and strings can be stored")
    np.savez(path, images=images.detach().float().cpu().numpy(), labels=labels.cpu().numpy(), **extra)
    return path


def save_grid(
    path: str | Path, images: torch.Tensor, *, nrow: int, value_range: tuple[float, float] = (-1.0, 1.0)
) -> Path:
    """A PNG grid of images (N, C, H, W), C in {1, 3}, `nrow` images per row, 1-pixel gaps, upscaled 4x."""
    from PIL import Image

    images = images.detach().float().cpu()
    if images.ndim != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"images of shape {tuple(images.shape)}: expected (N, 1 or 3, H, W)")
    low, high = value_range
    pixels = ((images - low) / (high - low)).clamp(0, 1).mul(255).round().to(torch.uint8)
    n, c, h, w = pixels.shape
    rows = -(-n // nrow)
    canvas = torch.full((c, rows * (h + 1) + 1, nrow * (w + 1) + 1), 64, dtype=torch.uint8)
    for i in range(n):
        r, col = divmod(i, nrow)
        canvas[:, 1 + r * (h + 1) : 1 + r * (h + 1) + h, 1 + col * (w + 1) : 1 + col * (w + 1) + w] = pixels[
            i
        ]
    array = canvas.permute(1, 2, 0).numpy()
    picture = Image.fromarray(array[..., 0] if c == 1 else array, mode="L" if c == 1 else "RGB")
    picture = picture.resize((picture.width * 4, picture.height * 4), Image.NEAREST)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    picture.save(path)
    return path


def tile(images: np.ndarray, columns: int, *, gap: int = 2, fill: int = 32) -> np.ndarray:
    """One picture of RGB images (N, H, W, 3) uint8, `columns` per row, `gap` pixels of `fill` between them."""
    if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
        raise ValueError(
            f"images of shape {images.shape} and dtype {images.dtype}: expected (N, H, W, 3) uint8"
        )
    n, h, w, _ = images.shape
    columns = max(1, min(columns, n))
    rows = -(-n // columns)
    canvas = np.full((rows * (h + gap) + gap, columns * (w + gap) + gap, 3), fill, dtype=np.uint8)
    for i in range(n):
        r, c = divmod(i, columns)
        top, left = gap + r * (h + gap), gap + c * (w + gap)
        canvas[top : top + h, left : left + w] = images[i]
    return canvas


def save_png(path: str | Path, picture: np.ndarray) -> Path:
    """Write an (H, W, 3) uint8 array as a PNG (parents made)."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(picture, mode="RGB").save(path)
    return path


def save_gif(path: str | Path, frames: list[np.ndarray], *, fps: float = 8.0) -> Path:
    """An animated GIF of (H, W, 3) uint8 frames, looping (PIL's writer: nothing else to install)."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pictures = [Image.fromarray(f, mode="RGB") for f in frames]
    pictures[0].save(path, save_all=True, append_images=pictures[1:], duration=round(1000 / fps), loop=0)
    return path
