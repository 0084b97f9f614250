"""verl-dmd-prepare's inputs: prompt files (text, JSONL, parquet) and captioned image folders, with one-line errors."""

from __future__ import annotations

import numpy as np
import pytest

from verl_dmd.prepare.sources import (
    SourceError,
    list_captioned_images,
    load_pixels,
    read_prompts,
)


def test_text_prompts_keep_their_text_and_drop_only_line_endings(tmp_path):
    path = tmp_path / "p.txt"
    path.write_bytes("\ufeffa cat\r\n  leading spaces kept \nun café ☕\n".encode())
    assert read_prompts(path) == ["a cat", "  leading spaces kept ", "un café ☕"]
    path.write_text("no final newline")
    assert read_prompts(path) == ["no final newline"]


def test_jsonl_and_parquet_prompts_read_the_field(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "one", "id": 1}\n{"prompt": "two"}\n')
    assert read_prompts(path) == ["one", "two"]
    (tmp_path / "c.jsonl").write_text('{"caption": "x"}\n')
    assert read_prompts(tmp_path / "c.jsonl", "caption") == ["x"]
    pq.write_table(pa.table({"text": ["a", "b", "c"], "n": [1, 2, 3]}), tmp_path / "p.parquet")
    assert read_prompts(tmp_path / "p.parquet", "text") == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("missing.txt", None, r"'prepare.prompts' = '.*missing.txt': no such file"),
        ("p.csv", "a\n", r"unknown prompt file type '.csv'; allowed: .txt, .jsonl, .parquet"),
        ("empty.txt", "", r"holds no prompts"),
        ("blank.txt", "a\n\nb\n", r"line 2 is empty; fix: remove blank lines"),
        ("latin1.txt", b"ok\ncaf\xe9\n", r"line 2 is not UTF-8 \(byte 0xe9 at column 4\); fix: save the file as UTF-8"),
        ("nul.txt", "a\x00b\n", r"line 1 holds a NUL character"),
        ("bad.jsonl", '{"prompt": "a"}\n{"prompt": \n', r"line 2 is not valid JSON"),
        ("list.jsonl", '["a"]\n', r"line 1 is a JSON list, not an object"),
        ("field.jsonl", '{"text": "a", "id": 2}\n', r"line 1 has no 'prompt' field \(fields: id, text\); fix: set prepare.prompt_field"),
        ("null.jsonl", '{"prompt": null}\n', r"line 1: 'prompt' is null, not a non-empty string"),
    ],
)  # fmt: skip
def test_a_bad_prompt_file_is_one_line_naming_where(tmp_path, name, content, expected):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(SourceError, match=expected) as caught:
        read_prompts(path)
    assert "\n" not in str(caught.value)


def test_a_bad_parquet_column_names_the_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "p.parquet")
    with pytest.raises(
        SourceError, match=r"no column 'prompt' \(columns: text\); fix: set prepare.prompt_field"
    ):
        read_prompts(tmp_path / "p.parquet")
    with pytest.raises(SourceError, match=r"row 1 of column 'text' is None"):
        read_prompts(tmp_path / "p.parquet", "text")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(SourceError, match=r"not a readable parquet file"):
        read_prompts(tmp_path / "broken.parquet")


def _image(path, size=(12, 8), color=(200, 10, 10), frames=1):
    from PIL import Image

    pictures = [Image.new("RGB", size, tuple(min(255, c + 40 * i) for c in color)) for i in range(frames)]
    if frames == 1:
        pictures[0].save(path)
    else:
        pictures[0].save(path, save_all=True, append_images=pictures[1:], duration=100)


def test_captioned_images_are_listed_in_name_order_and_fitted(tmp_path):
    _image(tmp_path / "b.png", size=(12, 8))
    (tmp_path / "b.txt").write_text("a red thing\n")
    _image(tmp_path / "a.jpg", size=(8, 8), color=(0, 0, 250))
    (tmp_path / "a.txt").write_text("blue\n")
    items = list_captioned_images(tmp_path)
    assert [(i.path.name, i.caption) for i in items] == [("a.jpg", "blue"), ("b.png", "a red thing")]
    crop = load_pixels(items[1], 4, 4, transform="center_crop", num_frames=None)
    assert crop.shape == (3, 4, 4) and crop.min() >= -1 and crop.max() <= 1
    assert np.allclose(crop[0].numpy(), 200 / 127.5 - 1, atol=0.02)  # a flat colour stays that colour
    assert load_pixels(items[1], 4, 6, transform="resize", num_frames=None).shape == (3, 4, 6)


def test_animated_images_are_videos_of_their_first_frames(tmp_path):
    _image(tmp_path / "v.gif", size=(8, 8), frames=6)
    (tmp_path / "v.txt").write_text("a clip")
    (item,) = list_captioned_images(tmp_path)
    video = load_pixels(item, 8, 8, transform="center_crop", num_frames=5)
    assert video.shape == (3, 5, 8, 8)
    assert not np.allclose(video[:, 0].numpy(), video[:, 4].numpy())
    with pytest.raises(
        SourceError, match=r"v.gif has 6 frame\(s\), the data set's videos have prepare.num_frames = 9"
    ):
        load_pixels(item, 8, 8, transform="center_crop", num_frames=9)


def test_bad_image_folders_are_one_line(tmp_path):
    with pytest.raises(SourceError, match=r"'prepare.real_images' = .*: not a directory"):
        list_captioned_images(tmp_path / "nope")
    with pytest.raises(SourceError, match=r"no images"):
        list_captioned_images(tmp_path)
    _image(tmp_path / "x.png")
    with pytest.raises(SourceError, match=r"x.png has no caption file x.txt"):
        list_captioned_images(tmp_path)
    (tmp_path / "x.txt").write_text("  \n")
    with pytest.raises(SourceError, match=r"x.txt is empty"):
        list_captioned_images(tmp_path)
    (tmp_path / "x.txt").write_text("ok")
    (tmp_path / "y.png").write_bytes(b"not an image")
    (tmp_path / "y.txt").write_text("ok")
    bad = list_captioned_images(tmp_path)[1]
    with pytest.raises(SourceError, match=r"y.png is not a readable image"):
        load_pixels(bad, 4, 4, transform="resize", num_frames=None)
