"""What verl-dmd-prepare reads: prompt files (text, JSONL, parquet) and folders of captioned images.

Every problem a user can cause is one line naming the key, the file (and line or
row), what is wrong and the fix (`SourceError`). Prompts are kept as written: only
the line ending is removed, so the text encoded is the text a user would send to
the served model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

PROMPT_SUFFIXES = (".txt", ".jsonl", ".parquet")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp")


class SourceError(ValueError):
    """A prompt file or image folder that cannot be read as it is; the message is one line."""


def _where(key: str, path: Path) -> str:
    return f"config key '{key}' = {str(path)!r}"


def read_prompts(path: str | Path, field: str = "prompt", *, key: str = "prepare.prompts") -> list[str]:
    """The prompts of a text file (one a line), a JSONL file (`field` of each object) or a parquet file
    (column `field`). Empty prompts, undecodable lines and missing fields are refused, naming where."""
    path = Path(path).expanduser()
    if not path.is_file():
        what = "a directory" if path.is_dir() else "no such file"
        raise SourceError(f"{_where(key, path)}: {what}; fix: point it at a prompt file "
                          f"({', '.join(PROMPT_SUFFIXES)})")  # fmt: skip
    suffix = path.suffix.lower()
    if suffix not in PROMPT_SUFFIXES:
        raise SourceError(f"{_where(key, path)}: unknown prompt file type {suffix or '(none)'!r}; allowed: "
                          f"{', '.join(PROMPT_SUFFIXES)}; fix: rename it or convert it")  # fmt: skip
    if suffix == ".parquet":
        prompts = _parquet_prompts(path, field, key)
    else:
        prompts = []
        for number, line in _lines(path, key):
            prompts.append(_text_prompt(line, number, path, key) if suffix == ".txt"
                           else _json_prompt(line, number, path, field, key))  # fmt: skip
    if not prompts:
        raise SourceError(f"{_where(key, path)}: holds no prompts; fix: one prompt per line (or a non-empty "
                          f"{field!r} column)")  # fmt: skip
    return prompts


def _lines(path: Path, key: str):
    """(line number, text) of each line, decoded as UTF-8 strictly, without its line ending."""
    data = path.read_bytes()
    if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark is no part of the first prompt
        data = data[3:]
    raw_lines = data.split(b"\n")
    if raw_lines and raw_lines[-1] == b"":  # the final newline ends the last line; it starts none
        raw_lines.pop()
    for number, raw in enumerate(raw_lines, start=1):
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise SourceError(f"{_where(key, path)}: line {number} is not UTF-8 (byte 0x{raw[err.start]:02x} at "
                              f"column {err.start + 1}); fix: save the file as UTF-8") from None  # fmt: skip
        yield number, text


def _text_prompt(line: str, number: int, path: Path, key: str) -> str:
    if not line.strip():
        raise SourceError(f"{_where(key, path)}: line {number} is empty; fix: remove blank lines (the empty "
                          "prompt for CFG is prepare.negative_prompt, encoded by itself)")  # fmt: skip
    if "\x00" in line:
        raise SourceError(f"{_where(key, path)}: line {number} holds a NUL character; fix: remove it")
    return line


def _json_prompt(line: str, number: int, path: Path, field: str, key: str) -> str:
    if not line.strip():
        raise SourceError(f"{_where(key, path)}: line {number} is empty; fix: one JSON object per line")
    try:
        record = json.loads(line)
    except ValueError as err:
        raise SourceError(f"{_where(key, path)}: line {number} is not valid JSON ({err.msg} at column "
                          f"{err.colno}); fix: one JSON object per line") from None  # fmt: skip
    if not isinstance(record, dict):
        raise SourceError(f"{_where(key, path)}: line {number} is a JSON {type(record).__name__}, not an "
                          f"object; fix: write {{{json.dumps(field)}: \"...\"}} per line")  # fmt: skip
    if field not in record:
        present = ", ".join(sorted(record)) or "none"
        raise SourceError(f"{_where(key, path)}: line {number} has no {field!r} field (fields: {present}); fix: "
                          "set prepare.prompt_field to the field that holds the prompt")  # fmt: skip
    value = record[field]
    if not isinstance(value, str) or not value.strip():
        raise SourceError(f"{_where(key, path)}: line {number}: {field!r} is {json.dumps(value)[:40]}, not a "
                          "non-empty string; fix: give every line a prompt")  # fmt: skip
    return value


def _parquet_prompts(path: Path, field: str, key: str) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise SourceError(
            f"{_where(key, path)}: reading parquet needs pyarrow; fix: pip install pyarrow"
        ) from None
    try:
        schema = pq.read_schema(path)
    except Exception as err:  # pyarrow raises its own error types for a damaged file
        raise SourceError(f"{_where(key, path)}: not a readable parquet file ({str(err).splitlines()[0]}); "
                          "fix: check the file") from None  # fmt: skip
    if field not in schema.names:
        raise SourceError(f"{_where(key, path)}: no column {field!r} (columns: {', '.join(schema.names)}); fix: "
                          "set prepare.prompt_field to the column that holds the prompt")  # fmt: skip
    values = pq.read_table(path, columns=[field]).column(field).to_pylist()
    for row, value in enumerate(values):
        if not isinstance(value, str) or not value.strip():
            raise SourceError(f"{_where(key, path)}: row {row} of column {field!r} is {value!r}, not a non-empty "
                              "string; fix: drop or fill that row")  # fmt: skip
    return values


# --------------------------------------------------------------------------- captioned images


@dataclass(frozen=True)
class CaptionedImage:
    """One real image (or animated image, a video) and its caption (the prompt it is conditioned on)."""

    path: Path
    caption: str


def list_captioned_images(folder: str | Path, *, key: str = "prepare.real_images") -> list[CaptionedImage]:
    """The images of `folder` (not recursive) in name order, each with the caption in the ``.txt`` file of the
    same stem. A folder without images, an image without a caption or an empty caption is refused."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise SourceError(f"{_where(key, folder)}: not a directory; fix: point it at a folder of images, each "
                          "with a caption file of the same name (x.png + x.txt)")  # fmt: skip
    images = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not images:
        raise SourceError(f"{_where(key, folder)}: no images ({', '.join(IMAGE_SUFFIXES)}); fix: put the real "
                          "images there")  # fmt: skip
    out = []
    for image in images:
        caption_file = image.with_suffix(".txt")
        if not caption_file.is_file():
            raise SourceError(f"{_where(key, folder)}: {image.name} has no caption file {caption_file.name}; fix: "
                              "write its prompt there (the GAN term conditions on it)")  # fmt: skip
        lines = [text for _, text in _lines(caption_file, key)]
        caption = " ".join(line.strip() for line in lines).strip()
        if not caption:
            raise SourceError(
                f"{_where(key, folder)}: {caption_file.name} is empty; fix: write the image's prompt"
            )
        out.append(CaptionedImage(image, caption))
    return out


def check_image(item: CaptionedImage, num_frames: int | None, *, key: str = "prepare.real_images") -> None:
    """The image opens (its header only) and, for video, has at least `num_frames` frames: checked before any
    encoding starts, so a broken file does not stop a run hours in."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(item.path) as image:
            frames = getattr(image, "n_frames", 1)
    except (UnidentifiedImageError, OSError) as err:
        raise SourceError(f"config key '{key}': {item.path.name} is not a readable image ({err}); fix: remove or "
                          "replace it") from None  # fmt: skip
    if num_frames is not None and frames < num_frames:
        raise SourceError(f"config key '{key}': {item.path.name} has {frames} frame(s), the data set's videos have "
                          f"prepare.num_frames = {num_frames}; fix: use longer clips or fewer frames")  # fmt: skip


def load_pixels(item: CaptionedImage, height: int, width: int, *, transform: str, num_frames: int | None,
                key: str = "prepare.real_images") -> torch.Tensor:  # fmt: skip
    """Pixels in [-1, 1]: (3, H, W) for an image, (3, F, H, W) for the first `num_frames` frames of an animated
    image (a video). `transform` is center_crop (scale the short side, crop the middle) or resize."""
    import numpy as np
    from PIL import Image, ImageSequence, UnidentifiedImageError

    try:
        with Image.open(item.path) as image:
            if num_frames is None:
                frames = [_fit(image.convert("RGB"), height, width, transform)]
            else:
                frames = [
                    _fit(f.convert("RGB"), height, width, transform) for f in ImageSequence.Iterator(image)
                ]
                if len(frames) < num_frames:
                    raise SourceError(f"config key '{key}': {item.path.name} has {len(frames)} frame(s), the data "
                                      f"set's videos have prepare.num_frames = {num_frames}; fix: use longer clips "
                                      "or fewer frames")  # fmt: skip
                frames = frames[:num_frames]
    except (UnidentifiedImageError, OSError) as err:
        raise SourceError(f"config key '{key}': {item.path.name} is not a readable image ({err}); fix: remove or "
                          "replace it") from None  # fmt: skip
    array = np.stack([np.asarray(f, dtype=np.uint8) for f in frames])  # (F, H, W, 3)
    pixels = torch.from_numpy(array).float().div(127.5).sub(1.0).permute(3, 0, 1, 2)  # (3, F, H, W)
    return pixels[:, 0] if num_frames is None else pixels


def _fit(image, height: int, width: int, transform: str):
    from PIL import Image

    if transform == "resize":
        return image.resize((width, height), Image.Resampling.LANCZOS)
    scale = max(height / image.height, width / image.width)
    scaled = (max(width, round(image.width * scale)), max(height, round(image.height * scale)))
    image = image.resize(scaled, Image.Resampling.LANCZOS)
    left, top = (scaled[0] - width) // 2, (scaled[1] - height) // 2
    return image.crop((left, top, left + width, top + height))
