"""The digits scripts run end to end at toy sizes (the real runs and their numbers: docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from verl_dmd.adapters import get_adapter
from verl_dmd.adapters.base import ModelSource

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def local_run(*overrides: str) -> subprocess.CompletedProcess:
    """`verl-dmd --local` (the trainer with one rank in one process, no ray) on the digits recipe."""
    return run("-m", "verl_dmd.main", "--local", *overrides)


def table_rows(stdout: str, first_column: set[str]) -> list[list[str]]:
    return [
        line.split() for line in stdout.splitlines() if line.split()[:1] and line.split()[0] in first_column
    ]


def test_train_digits_teacher_writes_a_loadable_model_and_its_table(tmp_path):
    """A few training steps save a diffusers directory and print FID/accuracy for 5 step counts."""
    result = run("scripts/train_digits_teacher.py", "--out", str(tmp_path / "t"), "--steps", "3",
                 "--eval-samples", "20", "--guidance", "1.0")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = table_rows(result.stdout, {"1.0"})
    assert [int(r[1]) for r in rows] == [1, 2, 4, 8, 32]
    assert all(float(r[2]) > 0 and 0 <= float(r[3]) <= 1 for r in rows)
    get_adapter("dit")().build_model(ModelSource(path=str(tmp_path / "t")))


def test_local_trainer_runs_dmd2_cycles_and_writes_the_table(tmp_path):
    """Two DMD2 cycles of the recipe (its GAN terms on real digits included) on a (random) teacher,
    without ray, sleeping and waking the role state around every phase, then the teacher/student/EMA
    table, samples, grids, checkpoint and export. (The recipe without sleep/wake runs under --local in
    tests/test_reproducible_runs.py and on ray workers in tests/test_ray_trainer.py.)"""
    torch.manual_seed(0)
    adapter = get_adapter("dit")()
    teacher = adapter.build_model(ModelSource(config=adapter.tiny_config))
    teacher.save_pretrained(tmp_path / "teacher")
    out = tmp_path / "out"
    result = local_run("trainer.total_steps=2", "validation.num_samples=20", f"trainer.output_dir={out}",
                 f"model.teacher.path={tmp_path / 'teacher'}", "algorithm.fake_warmup_steps=1",
                 "resources.sleep_between_phases=true")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "student/gan_generator_loss:" in result.stdout
        and "fake_score/gan_discriminator_loss:" in result.stdout
    )
    rows = [line.strip("|").split("|") for line in result.stdout.splitlines() if line.startswith("| ")]
    keys = [(r[0].strip(), int(r[2])) for r in rows[1:]]
    assert keys == [("teacher", s) for s in (1, 2, 4, 8, 32)] + [
        (role, s) for role in ("student", "student_ema") for s in (1, 4)
    ]
    assert all(float(r[3]) > 0 and 0 <= float(r[4]) <= 1 for r in rows[1:])
    assert (out / "table.md").read_text().count("\n| ") == len(rows)
    for model, steps in keys:
        with np.load(out / "samples" / f"{model}_{steps}step.npz", allow_pickle=False) as data:
            assert data["images"].shape == (20, 1, 8, 8) and data["labels"].tolist() == [
                i % 10 for i in range(20)
            ]
        assert (out / "samples" / f"{model}_{steps}step.png").is_file()
    assert (out / "checkpoints" / "global_step_2" / "manifest.json").is_file()
    assert (out / "export" / "global_step_2" / "student_ema" / "diffusers" / "config.json").is_file()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.teacher.path=/no/such/teacher", "no such local directory"),
        ("model.teacher.path=builtin:nope", "no shipped model named 'nope'"),
        ("algorithm.fake_update_ratio=0", "algorithm.fake_update_ratio"),
    ],
)
def test_local_trainer_bad_input_is_one_line(tmp_path, override, message):
    """A missing teacher or a bad key is a one-line usage error, not a traceback."""
    result = local_run(f"trainer.output_dir={tmp_path}", override)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_local_trainer_rejects_a_damaged_pairs_file(tmp_path):
    bad = tmp_path / "pairs.safetensors"
    bad.write_bytes(b"not a safetensors file")
    result = local_run(f"trainer.output_dir={tmp_path}", "algorithm.regression_weight=1",
                       f"data.regression_pairs_path={bad}")  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        "data.regression_pairs_path" in result.stderr and "not a readable safetensors file" in result.stderr
    )


def test_local_trainer_rejects_pairs_made_for_another_teacher(tmp_path):
    """A pairs file records the teacher it was made with; another teacher's file is not used."""
    import safetensors.torch

    pairs = {"noise": torch.zeros(3, 1, 8, 8), "target": torch.zeros(3, 1, 8, 8),
             "cond.class_labels": torch.zeros(3, dtype=torch.int64)}  # fmt: skip
    path = tmp_path / "pairs.safetensors"
    safetensors.torch.save_file(pairs, path, metadata={"teacher_sha256": "0" * 64})
    result = local_run(f"trainer.output_dir={tmp_path}", "algorithm.regression_weight=1",
                       f"data.regression_pairs_path={path}")  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "teacher_sha256 = '0000" in result.stderr and "delete the file to regenerate" in result.stderr


def reference_values(line: str) -> dict[str, float]:
    """`  <name>: fid F accuracy A ...` -> {metric: value}."""
    tail = line.split(":", 1)[1].split()
    return dict(zip(tail[0::2], map(float, tail[1::2]), strict=True))


def test_digits_reference_scores_real_draws_and_model_seeds(tmp_path):
    """Real training digits score as copies (memorisation 0) with full class accuracy; seed 1 of the teacher
    and of an exported student (found under the export's role folder, sampled at its trained levels) is the
    table's own draw (the FID of `DigitsEvaluation`'s default noise and re-noising); seed 2 is another draw."""
    import json
    import shutil

    from verl_dmd.algorithms.sampling import euler_sample, few_step_sample, renoise_draws
    from verl_dmd.assets import resolve_model_path
    from verl_dmd.data.digits import load_digits_splits
    from verl_dmd.eval.digits_classifier import train_digits_classifier
    from verl_dmd.eval.digits_report import DigitsEvaluation
    from verl_dmd.seeding import fixed_generator

    teacher_dir = resolve_model_path("builtin:digits_teacher")
    role = tmp_path / "export" / "global_step_2" / "student_ema"  # the teacher posing as a 2-step student
    shutil.copytree(teacher_dir, role / "diffusers")
    levels = [1.0, 0.4]  # not evenly spaced: the script must take them from export.json
    (role / "export.json").write_text(json.dumps({"dmd2_config": {"denoising_timesteps": [1000.0, 400.0]}}))
    result = run("scripts/digits_reference.py", "--subsets", "2", "--teacher", "builtin:digits_teacher",
                 "--teacher-steps", "2", "--student", str(tmp_path / "export"), "--student-steps", "2",
                 "--seeds", "2", "--num-samples", "30")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    real = [reference_values(line) for line in lines if line.strip().startswith("real subset")]
    assert len(real) == 2
    assert all(values["memorisation"] == 0.0 and values["accuracy"] == 1.0 for values in real), real
    teacher = [reference_values(line) for line in lines if line.strip().startswith("teacher 2-step seed")]
    student = [reference_values(line) for line in lines if line.strip().startswith("student 2-step seed")]
    assert len(teacher) == len(student) == 2
    assert any(line.startswith("teacher builtin:digits_teacher at 2 steps (2 draws)") for line in lines)

    torch.set_num_threads(2)
    train, holdout = load_digits_splits(seed=0)
    evaluation = DigitsEvaluation(train_digits_classifier(train, seed=0), holdout, train, num_samples=30)
    adapter = get_adapter("dit")()
    model = adapter.build_model(ModelSource(path=teacher_dir)).eval()
    cond = {"class_labels": evaluation.labels}
    with torch.no_grad():
        euler = euler_sample(adapter, model, evaluation.noise, cond, 2)
        draws = renoise_draws(evaluation.noise.shape, 2, fixed_generator(2))
        few = few_step_sample(adapter, model, evaluation.noise, cond, torch.tensor([*levels, 0.0]), draws)
    assert teacher[0]["fid"] == pytest.approx(evaluation.row("teacher", "euler", 2, euler).fid, abs=1e-3)
    assert student[0]["fid"] == pytest.approx(evaluation.row("student", "few-step", 2, few).fid, abs=1e-3)
    assert teacher[1]["fid"] != teacher[0]["fid"] and student[1]["fid"] != student[0]["fid"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--student", "{tmp}/nowhere"], "does not exist"),
        (["--student", "{tmp}"], "no diffusers/config.json under it"),
        (["--teacher", "builtin:nope"], "no shipped model named 'nope'"),
        (["--num-samples", "5000"], "--num-samples 5000: must be in [10, "),
        (["--seeds", "0", "--teacher", "builtin:digits_teacher"], "--seeds 0: must be 1 or more"),
        ([], "nothing to measure"),
    ],
    ids=["missing", "no-diffusers", "builtin", "samples", "seeds", "nothing"],
)
def test_digits_reference_refuses_bad_input_in_one_line(tmp_path, args, message):
    """Bad paths and arguments end in one line naming the value and a fix, before any scoring."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    result = run(
        "scripts/digits_reference.py", "--subsets", "0" if "--num-samples" not in argv else "1", *argv
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("digits_reference: ") and message in last, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_digits_reference_real_subset_draws_each_class_without_repeats(monkeypatch):
    """Each slot gets a training digit of its label; no digit repeats within a draw; draws differ by seed."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from digits_reference import real_subset

    from verl_dmd.data.digits import load_digits_splits

    train, _ = load_digits_splits(seed=0)
    labels = torch.arange(100) % 10
    a, b = real_subset(train, labels, 0), real_subset(train, labels, 1)
    flat = train.images.flatten(1)
    index = [int(((flat - img.flatten()).abs().sum(1) == 0).nonzero()[0]) for img in a]
    assert [int(train.labels[i]) for i in index] == labels.tolist()
    assert len(set(index)) == len(index)
    assert not torch.equal(a, b)
    with pytest.raises(ValueError, match="class 0: 500 samples asked"):
        real_subset(train, torch.zeros(500, dtype=torch.int64), 0)


def write_samples(path: Path, images: np.ndarray, labels: np.ndarray) -> str:
    np.savez(path, images=images, labels=labels)
    return str(path)


def spread_rows(stdout: str) -> dict[str, list[float]]:
    rows = {}
    for line in stdout.splitlines()[1:]:
        *name, value, ratio, background = line.split()
        rows[" ".join(name)] = [float(value), float(ratio), float(background)]
    return rows


def reference_spread(pixels: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """float64 numpy: pixels on 0..16 clamped, unbiased within-class variance summed over pixels,
    averaged over classes; share below 0.5."""
    pixels = np.clip(pixels.reshape(len(labels), -1).astype(np.float64), 0.0, 16.0)
    per_class = [pixels[labels == d].var(axis=0, ddof=1).sum() for d in range(10)]
    return float(np.mean(per_class)), float((pixels < 0.5).mean())


@pytest.mark.parametrize("shrink", [1.0, 0.5, 1.7])
def test_digits_spread_measures_within_class_variance_against_the_held_out_digits(tmp_path, shrink):
    """The held-out digits scored as samples spread exactly as the reference row (ratio 1); moved away
    from or toward their class means by `shrink` in pixel space (1.7 pushes many pixels outside 0..16,
    which the script clamps as the table's classifier does), spread and blank share as float64 numpy."""
    from verl_dmd.data.digits import load_digits_splits

    _, holdout = load_digits_splits(seed=0)
    labels = holdout.labels.numpy()
    pixels = ((holdout.images.numpy().astype(np.float64) + 1.0) * 8.0).reshape(len(labels), -1)
    means = np.stack([pixels[labels == d].mean(axis=0) for d in range(10)])[labels]
    moved = means + shrink * (pixels - means) + 0.3  # off the integers, so the 0.5 threshold matters
    images = (moved / 8.0 - 1.0).reshape(-1, 1, 8, 8)  # float64 in the file, as a user's may be
    result = run("scripts/digits_spread.py", write_samples(tmp_path / "s.npz", images, labels))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = spread_rows(result.stdout)
    held_out, held_out_blank = reference_spread(pixels, labels)
    value, blank = reference_spread(moved, labels)
    assert rows["held-out digits"][0] == pytest.approx(held_out, abs=0.05)
    assert rows["held-out digits"][2] == pytest.approx(held_out_blank, abs=5e-4)
    assert rows[str(tmp_path / "s.npz")][0] == pytest.approx(value, abs=0.06)
    assert rows[str(tmp_path / "s.npz")][1] == pytest.approx(value / held_out, abs=6e-4)
    assert rows[str(tmp_path / "s.npz")][2] == pytest.approx(blank, abs=5e-4)
    if shrink == 0.5:  # inside 0..16 the variance scales exactly with shrink^2
        assert rows[str(tmp_path / "s.npz")][1] == pytest.approx(0.25, abs=6e-4)


def good(n: int = 20) -> dict[str, np.ndarray]:
    return {"images": np.zeros((n, 1, 8, 8), dtype=np.float32), "labels": np.arange(n) % 10}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not a zip", "is not a readable .npz"),
        ("", "is not a readable .npz"),
        (np.zeros((20, 1, 8, 8)), "a .npy"),
        ({"pictures": np.zeros((10, 1, 8, 8))}, "not images and labels"),
        ({"images": np.zeros((10, 1, 4, 4)), "labels": np.arange(10)}, "expected (N, 1, 8, 8)"),
        ({"images": np.zeros((0, 1, 8, 8)), "labels": np.zeros(0, dtype=np.int64)}, "0 samples"),
        ({**good(), "labels": np.arange(20) % 10 + 1}, "labels must be integers in [0, 10)"),
        ({**good(), "labels": np.arange(20) % 10 - 1}, "labels must be integers in [0, 10)"),
        ({**good(), "labels": (np.arange(20) % 10).astype(np.float32)}, "expected integers"),
        ({**good(), "labels": np.array([str(i % 10) for i in range(20)])}, "expected integers"),
        ({**good(), "images": np.zeros((20, 1, 8, 8), dtype="U1")}, "expected floating point"),
        ({**good(), "images": np.full((20, 1, 8, 8), np.nan)}, "non-finite"),
        (good(19), "class(es) [9] have fewer than 2 samples"),
        (good(10), "class(es) [0, 1, 2, 3, 4, 5, 6, 7, 8, 9] have fewer than 2 samples"),
        ({**good(), "images": np.array([None] * 20, dtype=object)}, "is not a readable .npz"),
    ],
    ids=["text", "empty", "npy", "keys", "shape", "no-samples", "label-10", "label-neg", "float-labels",
         "string-labels", "string-images", "nan", "one-class-short", "one-per-class", "object"],
)  # fmt: skip
def test_digits_spread_refuses_bad_input_in_one_line(tmp_path, content, message):
    path = tmp_path / ("bad.npy" if isinstance(content, np.ndarray) else "bad.npz")
    if isinstance(content, str):
        path.write_text(content)
    elif isinstance(content, np.ndarray):
        np.save(path, content)
    else:
        np.savez(path, **content)
    result = run("scripts/digits_spread.py", str(path))
    assert result.returncode != 0
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert str(path) in result.stderr and "fix:" in result.stderr and "Traceback" not in result.stderr
