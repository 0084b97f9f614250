"""verl-dmd-prepare's behaviour: bad inputs are one line, a stopped run resumes to the same bytes, ranks split the
work, a finished data set is left alone, and the trainer refuses a data set made for something else."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prepare_scenarios import (
    PROMPTS,
    digests,
    prepare_overrides,
    recipe,
    train_overrides,
    write_captioned_images,
    write_lines,
)

from verl_dmd.main import compose_config, compose_plan
from verl_dmd.testing.pipelines import build_pipeline

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sd3(tmp_path_factory) -> Path:
    return build_pipeline("sd3", tmp_path_factory.mktemp("pipe") / "sd3")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return write_lines(tmp_path_factory.mktemp("prompts") / "prompts.txt", PROMPTS)


def run_prepare(family: str, overrides: list[str], capsys=None, fault=None) -> tuple[int, str]:
    from verl_dmd import prepare_main

    code = prepare_main.run(compose_config(recipe(family), overrides), fault=fault)
    return code, capsys.readouterr().err if capsys is not None else ""


def one_line_error(capsys_err: str) -> str:
    lines = [line for line in capsys_err.strip().splitlines() if line]
    assert len(lines) == 1, capsys_err
    assert lines[0].startswith("verl-dmd-prepare: error: ") and "fix:" in lines[0], lines[0]
    return lines[0]


# --------------------------------------------------------------------------- bad inputs (before any weight loads)


def _copy_without(pipeline: Path, target: Path, component: str) -> Path:
    shutil.copytree(pipeline, target)
    shutil.rmtree(target / component)
    return target


BAD_INPUTS = {
    # name: (how to break the inputs, the message must contain)
    "missing pipeline folder": (lambda t, p, q: {"model.teacher.path": t / "nope"}, "'model.teacher.path' = '"),
    "not a pipeline": (lambda t, p, q: {"model.teacher.path": p / "transformer"}, "no model_index.json"),
    "no subfolder": (lambda t, p, q: {"model.teacher.subfolder": "null"}, "'model.teacher.subfolder' = None"),
    "pipeline without a text encoder": (
        lambda t, p, q: {"model.teacher.path": _copy_without(p, t / "cut", "text_encoder_3")},
        "the StableDiffusion3Pipeline has no text_encoder_3",
    ),
    "pipeline of another family": (lambda t, p, q: {"model.adapter": "flux"},
                                   "holds a StableDiffusion3Pipeline, model.adapter = 'flux' reads FluxPipeline"),
    "family without pipeline support": (lambda t, p, q: {"model.adapter": "dit"}, "no pipeline support"),
    "no prompts": (lambda t, p, q: {"prepare.prompts": "null"}, "'prepare.prompts' = None"),
    "missing prompt file": (lambda t, p, q: {"prepare.prompts": t / "missing.txt"}, "no such file"),
    "empty prompt file": (lambda t, p, q: {"prepare.prompts": write_lines(t / "empty.txt", [])}, "holds no prompts"),
    "non-UTF-8 line": (
        lambda t, p, q: {"prepare.prompts": _write_bytes(t / "latin.txt", b"a cat\ncaf\xe9 au lait\n")},
        "line 2 is not UTF-8",
    ),
    "blank line": (lambda t, p, q: {"prepare.prompts": write_lines(t / "b.txt", ["a", "", "b"])}, "line 2 is empty"),
    "unknown prompt column": (
        lambda t, p, q: {"prepare.prompts": _parquet(t / "p.parquet", caption=["a", "b"])},
        "no column 'prompt' (columns: caption)",
    ),
    "JSONL line without the field": (
        lambda t, p, q: {"prepare.prompts": _write_bytes(t / "p.jsonl", b'{"text": "a"}\n')},
        "line 1 has no 'prompt' field",
    ),
    "no resolution": (lambda t, p, q: {"prepare.resolution": "null"}, "'prepare.resolution' = None"),
    "resolution not divisible by the VAE factor": (
        lambda t, p, q: {"prepare.resolution": "[30,32]"},
        "divisible by 16 (VAE factor x patch size); fix: e.g. 32 instead of 30",
    ),
    "frames for an image family": (lambda t, p, q: {"prepare.num_frames": 5}, "'prepare.num_frames' = 5: sd3 makes images"),
    "no data.path": (lambda t, p, q: {"data.path": "null"}, "'data.path' = None"),
    "output holds other files": (lambda t, p, q: {"data.path": _write_bytes(t / "o" / "x.txt", b"x").parent},
                                 "holds files that are no verl_dmd data set"),
    "real image that is no image": (
        lambda t, p, q: {"prepare.real_images": _captioned(t / "imgs", b"not a png")},
        "x.png is not a readable image",
    ),
    "real image without caption": (
        lambda t, p, q: {"prepare.real_images": _image_without_caption(t / "imgs")},
        "x.png has no caption file x.txt",
    ),
}  # fmt: skip


def _write_bytes(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _parquet(path: Path, **columns) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


def _captioned(folder: Path, data: bytes) -> Path:
    _write_bytes(folder / "x.png", data)
    (folder / "x.txt").write_text("a caption")
    return folder


def _image_without_caption(folder: Path) -> Path:
    from PIL import Image

    folder.mkdir()
    Image.new("RGB", (8, 8)).save(folder / "x.png")
    return folder


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_a_bad_input_stops_prepare_with_one_line(case, sd3, prompts, tmp_path, capsys):
    breaks, expected = BAD_INPUTS[case]
    changed = {k: str(v) for k, v in breaks(tmp_path, sd3, prompts).items()}
    overrides = prepare_overrides("sd3", sd3, tmp_path / "data", prompts)
    overrides = [o for o in overrides if o.split("=")[0] not in changed] + [
        f"{k}={v}" for k, v in changed.items()
    ]
    if "model.adapter" in changed and changed["model.adapter"] == "dit":
        overrides += ["data.name=embeddings"]
    code, err = run_prepare("sd3", overrides, capsys)
    assert code == 2
    assert expected in one_line_error(err), err
    if case != "output holds other files":
        assert not (tmp_path / "data").exists()  # refused before anything is written


def test_more_text_tokens_than_serving_takes_are_refused(tmp_path, prompts, capsys):
    """Flux's pipeline serves at most 512 T5 tokens: embeddings of 600 would never match a request."""
    flux = build_pipeline("flux", tmp_path / "flux")
    code, err = run_prepare("flux", [*prepare_overrides("flux", flux, tmp_path / "d", prompts),
                                     "prepare.max_sequence_length=600"], capsys)  # fmt: skip
    assert code == 2
    assert (
        "'prepare.max_sequence_length' = 600: a FluxPipeline serves at most 512 text tokens"
        in one_line_error(err)
    )


def test_the_command_line_refuses_with_one_line_and_exit_2(sd3, tmp_path):
    script = Path(sys.executable).parent / "verl-dmd-prepare"
    result = subprocess.run(
        [str(script), "--config-name", "sd3_lora_dmd2", f"model.teacher.path={tmp_path / 'nope'}",
         f"data.path={tmp_path / 'd'}", "prepare.prompts=/nope.txt", "prepare.resolution=[32,32]"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("verl-dmd-prepare: error: config key 'model.teacher.path' = ") and "fix:" in line
    assert not (tmp_path / "d").exists()
    typo = subprocess.run([str(script), "--config-name", "sd3_lora_dmd2", "prepare.prompt=x"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    multirun = subprocess.run([str(script), "--config-name", "sd3_lora_dmd2", "-m", "trainer.seed=1,2"],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
    assert multirun.returncode == 2 and "hydra's own flags are not taken here" in multirun.stderr, (
        multirun.stderr
    )
    assert typo.returncode == 2 and "did you mean 'prepare.prompts'" in typo.stderr, typo.stderr


# --------------------------------------------------------------------------- resume, ranks, re-runs


KILL = """
import os, sys
from verl_dmd import prepare_main
from verl_dmd.main import compose_config, compose_plan
point = sys.argv[1]
def fault(at):
    if at == point:
        os._exit(137)  # as SIGKILL: no cleanup, no finally
code = prepare_main.run(compose_plan("sd3_lora_dmd2", sys.argv[2:]).to_dict(), fault=fault)
sys.exit(code)
"""


@pytest.mark.slow
def test_a_killed_prepare_resumes_to_the_bytes_of_an_uninterrupted_one(sd3, prompts, tmp_path, capsys):
    images = write_captioned_images(tmp_path / "images", 3)
    extra = {"prepare.real_images": images, "prepare.teacher_pairs": "true"}
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    assert run_prepare("sd3", prepare_overrides("sd3", sd3, whole, prompts, **extra))[0] == 0
    overrides = prepare_overrides("sd3", sd3, stopped, prompts, **extra)
    # Killed with a shard fully written but not renamed, then again after the first pairs shard.
    runs = []
    for point in ("before-rename:prompts-00001.safetensors", "after-rename:pairs-00000.safetensors"):
        result = subprocess.run([sys.executable, "-c", KILL, point, *overrides], capture_output=True, text=True,
                                timeout=300, cwd=ROOT)  # fmt: skip
        assert result.returncode == 137, result.stderr[-2000:]
        assert not (stopped / "manifest.json").exists()
        runs.append(result.stdout)
        if not runs[1:]:  # the first kill left the half-made file behind
            assert list(stopped.glob(".prompts-00001.safetensors.*.tmp"))
    assert "removed .prompts-00001.safetensors" in runs[1] and "1 file(s) made before are kept" in runs[1]
    lines = []
    from verl_dmd import prepare_main

    assert prepare_main.run(compose_plan("sd3_lora_dmd2", overrides).to_dict(), log=lines.append) == 0
    assert any("continuing" in line and "file(s) made before are kept" in line for line in lines), lines
    assert digests(stopped) == digests(
        whole
    )  # every shard, uncond, real, pairs, prepare.json and the manifest
    # The same command on a finished data set does nothing.
    lines.clear()
    assert prepare_main.run(compose_plan("sd3_lora_dmd2", overrides).to_dict(), log=lines.append) == 0
    assert any("complete already" in line for line in lines) and digests(stopped) == digests(whole)
    # Another data set into the same directory is refused, naming what differs.
    other = write_lines(tmp_path / "other.txt", PROMPTS[:3])
    code, err = run_prepare("sd3", prepare_overrides("sd3", sd3, stopped, other, **extra), capsys)
    assert (
        code == 2
        and "holds another data set (differs in: prompts.count, prompts.sha256)" in one_line_error(err)
    )


def run_group(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`command` in its own process group, the whole group killed if it outlives `timeout` (torchrun's ranks
    would otherwise outlive a killed torchrun)."""
    import signal

    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                               start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"{command[:6]} ran past {timeout} s: {err[-2000:]}")
    return subprocess.CompletedProcess(command, process.returncode, out, err)


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "verl_dmd.prepare_main", "--config-name", "sd3_lora_dmd2"]  # fmt: skip


@pytest.mark.slow
def test_two_ranks_under_torchrun_make_the_same_data_set_and_name_a_failing_rank(sd3, prompts, tmp_path):
    single, split = tmp_path / "single", tmp_path / "split"
    assert run_prepare("sd3", prepare_overrides("sd3", sd3, single, prompts))[0] == 0
    result = run_group([*TORCHRUN, *prepare_overrides("sd3", sd3, split, prompts)], timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert digests(split) == digests(single)
    # A truncated image passes the header check and breaks only when rank 1 (which makes the real shard)
    # decodes it: rank 1 says what and where, rank 0 that rank 1 failed, both exit 2.
    images = write_captioned_images(tmp_path / "images", 3)
    (images / "img1.png").write_bytes((images / "img1.png").read_bytes()[:60])
    broken = run_group([*TORCHRUN, *prepare_overrides("sd3", sd3, tmp_path / "broken", prompts,
                                                      **{"prepare.real_images": images})], timeout=300)  # fmt: skip
    lines = [line for line in broken.stderr.splitlines() if line.startswith("verl-dmd-prepare: error")]
    assert broken.returncode != 0 and len(lines) == 2, broken.stderr[-3000:]
    assert any(line.startswith("verl-dmd-prepare: error (rank 1): ") and "img1.png is not a readable image" in line
               for line in lines), lines  # fmt: skip
    assert any(line.startswith("verl-dmd-prepare: error: rank 1 of 2: ") for line in lines), lines
    # torchrun prints its own traceback for a child that exited non-zero; none comes from verl_dmd.
    assert not [
        line for line in broken.stderr.splitlines() if line.strip().startswith("File") and "verl_dmd" in line
    ]


# --------------------------------------------------------------------------- the trainer checks the data set


@pytest.fixture(scope="module")
def prepared(sd3, prompts, tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("prepared") / "data"
    assert run_prepare("sd3", prepare_overrides("sd3", sd3, data, prompts))[0] == 0
    return data


def _refusal(sd3: Path, data: Path, tmp_path: Path, **extra) -> str:
    from verl_dmd.trainer.embeddings import EmbeddingsProvider

    plan = compose_plan("sd3_lora_dmd2", train_overrides("sd3", sd3, data, tmp_path / "out", **extra))
    with pytest.raises(ValueError) as caught:
        EmbeddingsProvider.preflight(plan)
    message = str(caught.value)
    assert "\n" not in message and "fix:" in message, message
    assert message.startswith(("config key 'data.path'", "config key 'data.regression_pairs_path'")), message
    return message


def test_the_trainer_refuses_a_data_set_made_for_something_else(sd3, prepared, tmp_path):
    from verl_dmd.trainer.embeddings import EmbeddingsProvider

    EmbeddingsProvider.preflight(
        compose_plan("sd3_lora_dmd2", train_overrides("sd3", sd3, prepared, tmp_path))
    )
    assert "prepared at prepare.resolution = [32, 32], this plan has [64, 64]" in _refusal(
        sd3, prepared, tmp_path, **{"prepare.resolution": "[64,64]"})  # fmt: skip
    assert "max_sequence_length = 256, this plan has prepare.max_sequence_length = 128" in _refusal(
        sd3, prepared, tmp_path, **{"prepare.max_sequence_length": 128})  # fmt: skip
    assert "needs real images (real.x0)" in _refusal(sd3, prepared, tmp_path,
                                                      **{"algorithm.gan_discriminator_weight": 0.01})  # fmt: skip
    assert "needs teacher pairs, this data set has none" in _refusal(sd3, prepared, tmp_path,
                                                                     **{"algorithm.regression_weight": 0.25})  # fmt: skip
    # Other encoder weights: the pipeline's T5 retrained (here: rebuilt from another seed).
    other = tmp_path / "other"
    shutil.copytree(sd3, other)
    shutil.rmtree(other / "text_encoder_3")
    shutil.copytree(
        build_pipeline("sd3", tmp_path / "seed1", seed=1) / "text_encoder_3", other / "text_encoder_3"
    )
    assert "encoded by other text_encoder_3 weights" in _refusal(other, prepared, tmp_path)
    # Another tokenizer (here: its stored length changed) encodes differently, weights unchanged.
    retokenized = tmp_path / "retokenized"
    shutil.copytree(sd3, retokenized)
    config = retokenized / "tokenizer" / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"model_max_length": 77', '"model_max_length": 60'))
    assert "encoded with other tokenizer files (config, tokenizer)" in _refusal(
        retokenized, prepared, tmp_path
    )
    # Another pipeline class at model.teacher.path.
    flux = build_pipeline("flux", tmp_path / "flux")
    message = _refusal(flux, prepared, tmp_path, **{"model.adapter": "flux"})
    assert "made from a StableDiffusion3Pipeline, model.adapter = 'flux' reads FluxPipeline" in message


def test_the_trainer_refuses_an_incomplete_or_damaged_data_set(sd3, prepared, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(prepared, broken)
    (broken / "manifest.json").unlink()
    assert "the data set is incomplete (no manifest.json" in _refusal(sd3, broken, tmp_path)
    shutil.copytree(prepared, broken, dirs_exist_ok=True)
    (broken / "prompts-00001.safetensors").unlink()
    assert "prompts-00001.safetensors: listed in the manifest but missing" in _refusal(sd3, broken, tmp_path)
    shutil.copytree(prepared, broken, dirs_exist_ok=True)
    with (broken / "prompts-00001.safetensors").open("ab") as handle:
        handle.write(b"x")
    assert "bytes, the manifest says" in _refusal(sd3, broken, tmp_path)
    manifest = json.loads((prepared / "manifest.json").read_text())
    manifest["format"] = "verl_dmd.prepared/0"
    (broken / "manifest.json").write_text(json.dumps(manifest))
    assert "format 'verl_dmd.prepared/0', this verl_dmd reads 'verl_dmd.prepared/1'" in _refusal(
        sd3, broken, tmp_path
    )
    assert "a prepared data set holds its own teacher pairs" in _refusal(
        sd3, prepared, tmp_path, **{"data.regression_pairs_path": tmp_path / "p.safetensors"})  # fmt: skip
