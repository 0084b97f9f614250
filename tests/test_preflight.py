"""The driver's pre-flight: every bad input is one line and exit code 2 before hydra, ray or a worker starts.

Most cases run in this process through `verl_dmd.main.check_command_line` (what `verl-dmd` runs before
`hydra.main`) and assert one line on stderr naming the key or path, and that nothing was made under the
output directory. A few run the real command in a subprocess and also assert the time it took (printed)
and that it started nothing: no plan fingerprint line (printed just before the trainer starts ray), no
hydra run directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from verl_dmd import export_main, main, preflight
from verl_dmd.assets import resolve_model_path
from verl_dmd.main import compose_plan
from verl_dmd.plan import PlanError

ROOT = Path(__file__).resolve().parents[1]
TEACHER = Path(resolve_model_path("builtin:digits_teacher"))
FAST_S = 5.0
"""What a refusal that needs neither torch nor diffusers may take from the command line."""


def refused(capsys, *argv: str, entry=main) -> str:
    """The one stderr line of a command line `entry` refuses (exit code 2)."""
    assert entry.check_command_line(list(argv)) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    prog = "verl-dmd-export" if entry is export_main else "verl-dmd"
    assert lines[0].startswith(f"{prog}: error: "), err
    return lines[0]


def out(tmp_path: Path) -> str:
    return f"trainer.output_dir={tmp_path / 'out'}"


def model_dir(path: Path, class_name: str = "DiTTransformer2DModel", weights: bool = True) -> Path:
    """A model directory: the digits teacher's config.json (with `class_name`) and, with `weights`, a weight
    file (empty: the pre-flight never reads weights)."""
    path.mkdir(parents=True)
    config = json.loads((TEACHER / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "_class_name": class_name}))
    if weights:
        (path / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    return path


@pytest.fixture(autouse=True)
def _no_ray_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


@pytest.fixture(autouse=True)
def _nothing_made(tmp_path):
    """No refused (or passed) check makes the output directory: hydra's run directory comes later."""
    yield
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- 1 and 4: registry names


@pytest.mark.parametrize(
    ("override", "key", "registered"),
    [
        ("model.adapter=digits", "model.adapter", "dit, flux, qwen_image, sd3, wan"),
        ("data.name=digitz", "data.name", "digits, embeddings"),
        ("validation.name=digitz", "validation.name", "digits"),
        ("algorithm.name=dmd3", "algorithm.name", "dmd2"),
    ],
)
def test_an_unknown_registry_name_is_refused(override, key, registered, tmp_path, capsys):
    line = refused(capsys, override, out(tmp_path))
    value = override.split("=")[1]
    assert f"config key '{key}' = '{value}': no such " in line and "registered: " in line
    listed = line.split("registered: ", 1)[1].split(";", 1)[0].split(", ")
    assert set(registered.split(", ")) <= set(listed), line  # other tests may have registered more


def test_a_registry_refuses_a_name_without_importing_its_builtins():
    """`Registry.check_name` knows the built-in names: with no plugin installed, an unknown name is refused without
    importing the built-in modules (here a module that does not exist), a built-in one accepted."""
    from verl_dmd.registry import Registry, UnknownNameError

    registry = Registry("widget", key="x.widget", entry_point_group="verl_dmd.test_no_such_group",
                        builtin_modules=("verl_dmd_no_such_module",), builtin_names=("gear",))  # fmt: skip
    registry.check_name("gear")
    with pytest.raises(
        UnknownNameError, match=r"config key 'x.widget' = 'cog': no such widget; registered: gear;"
    ):
        registry.check_name("cog")


def test_builtin_names_are_what_the_builtin_modules_register():
    from verl_dmd.adapters.registry import ADAPTERS
    from verl_dmd.algorithms.registry import METHODS
    from verl_dmd.trainer.registry import DATA_PROVIDERS, VALIDATORS

    for registry in (ADAPTERS, METHODS, DATA_PROVIDERS, VALIDATORS):
        registry.names()  # loads the built-ins
        builtin = {
            name for name, entry in registry._entries.items() if entry.__module__ in registry.builtin_modules
        }
        assert builtin == set(registry.builtin_names), registry.kind


def test_no_text_suggests_the_adapter_name_digits():
    """The digits recipe's adapter is registered as `dit`; no doc, recipe, hint or test says otherwise."""
    from verl_dmd.adapters.registry import ADAPTERS

    assert "dit" in ADAPTERS.names() and "digits" not in ADAPTERS.names()
    files = [*ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *ROOT.glob("recipes/*.yaml"), *ROOT.glob("verl_dmd/**/*.py"),
             *ROOT.glob("tests/*.py")]  # fmt: skip
    bad = ["model.adapter=digits", "adapter: digits", 'adapter"] = "digits"']
    found = [
        f"{f.name}: {b}" for f in files if f.name != "test_preflight.py" for b in bad if b in f.read_text()
    ]
    assert not found


# --------------------------------------------------------------------------- 2: model directories


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda p: p.mkdir(), "holds no model (no config.json)"),
        (lambda p: model_dir(p, weights=False), "holds a config.json but no weights"),
        (
            lambda p: model_dir(p, class_name="FluxTransformer2DModel"),
            "holds a FluxTransformer2DModel, and model.adapter=dit loads DiTTransformer2DModel; fix: set model.adapter=flux",
        ),
    ],
    ids=["empty", "no-weights", "other-class"],
)
def test_a_model_directory_that_holds_no_model_of_the_adapter_is_refused(make, needle, tmp_path, capsys):
    make(tmp_path / "teacher")
    line = refused(capsys, f"model.teacher.path={tmp_path / 'teacher'}", out(tmp_path))
    assert f"config key 'model.teacher.path' = '{tmp_path / 'teacher'}'" in line and needle in line


def test_a_pipeline_directory_names_its_subfolders_and_its_subfolder_passes(tmp_path, capsys):
    model_dir(tmp_path / "pipe" / "transformer")
    (tmp_path / "pipe" / "model_index.json").write_text("{}")
    line = refused(capsys, f"model.teacher.path={tmp_path / 'pipe'}", out(tmp_path))
    assert "is a diffusers pipeline (model_index.json)" in line
    assert "set model.teacher.subfolder to its denoiser's folder (with a config.json: transformer)" in line
    passing = [
        f"model.teacher.path={tmp_path / 'pipe'}",
        "model.teacher.subfolder=transformer",
        out(tmp_path),
    ]
    assert main.check_command_line(passing) == 0


def test_an_independent_students_own_directory_is_checked(tmp_path, capsys):
    (tmp_path / "student").mkdir()
    line = refused(capsys, f"model.student.path={tmp_path / 'student'}", out(tmp_path))
    assert "config key 'model.student.path'" in line and "holds no model" in line


# --------------------------------------------------------------------------- 3: LoRA targets

SHARED = ["model.storage=shared_base_adapters", "model.student.lora.rank=4", "model.fake_score.lora.rank=4"]


@pytest.mark.parametrize(
    ("overrides", "key", "needle"),
    [
        (
            [*SHARED, "model.student.lora.target_modules=[to_qq]"],
            "model.student.lora.target_modules",
            "'to_qq' matches no module of the teacher model",
        ),
        (
            [*SHARED, "model.fake_score.lora.target_modules=[to_q,to_qq]"],
            "model.fake_score.lora.target_modules",
            "'to_qq' matches no module",
        ),
        (
            [*SHARED, "model.student.lora.target_modules=[attn1]"],
            "model.student.lora.target_modules",
            "'attn1' names a block, not a layer, of the teacher model",
        ),
        (
            ["model.fake_score.lora.rank=4", "model.fake_score.lora.target_modules=[to_kk]"],
            "model.fake_score.lora.target_modules",
            "'to_kk' matches no module of the teacher model",
        ),
    ],
    ids=["shared-student", "shared-fake-score-one-of-two", "not-a-layer", "independent-copy-of-teacher"],
)
def test_a_lora_target_that_is_not_in_the_model_is_refused(overrides, key, needle, tmp_path, capsys):
    line = refused(capsys, *overrides, out(tmp_path))
    assert f"config key '{key}' = " in line and needle in line
    if "to_qq" in needle:
        assert "did you mean 'to_q'?" in line


def test_lora_targets_are_matched_against_the_roles_own_model(tmp_path, capsys):
    """Independent layout: a student built from its own config is the model its LoRA adapts."""
    from verl_dmd.adapters.diffusers_transformers import DiTAdapter

    config = "{" + ",".join(f"{k}:{v}" for k, v in {**DiTAdapter.tiny_config, "num_layers": 1}.items()) + "}"
    line = refused(capsys, f"model.student.config={config}", "model.student.lora.rank=4",
                   "model.student.lora.target_modules=[transformer_blocks.1.attn1.to_q]", out(tmp_path))  # fmt: skip
    assert "matches no module of the student model" in line
    ok = [f"model.student.config={config}", "model.student.lora.rank=4",
          "model.student.lora.target_modules=[transformer_blocks.0.attn1.to_q]", out(tmp_path)]  # fmt: skip
    assert main.check_command_line(ok) == 0


@pytest.mark.parametrize("family", ["dit", "sd3", "flux", "qwen_image", "wan"])
def test_every_builtin_familys_default_targets_pass(family):
    from verl_dmd.adapters import get_adapter
    from verl_dmd.plan import LoraSpec

    adapter = get_adapter(family)()
    source = SimpleNamespace(path=None, subfolder=None, config=adapter.tiny_config)
    model = preflight.meta_model("model.teacher.config", "<config>", adapter, source=source)
    assert all(p.device.type == "meta" for p in model.parameters())
    preflight.check_lora_targets("model.student.lora", LoraSpec(rank=4), adapter, model, "teacher")


def test_the_models_are_checked_without_random_draws():
    import torch

    state = torch.get_rng_state()
    plan = compose_plan("digits_dmd2", [*SHARED])
    preflight.check_models(plan)
    assert torch.equal(state, torch.get_rng_state())


# --------------------------------------------------------------------------- 5: output paths


@pytest.mark.parametrize(
    ("override", "key", "needle"),
    [
        ("trainer.output_dir={file}", "trainer.output_dir", "{file} is a file, not a directory"),
        (
            "trainer.output_dir={file}/run",
            "trainer.output_dir",
            "{file}/run cannot be made: {file} is a file",
        ),
        ("checkpoint.root={file}", "checkpoint.root", "{file} is a file, not a directory"),
        ("export.output_dir={file}/export", "export.output_dir", "cannot be made: {file} is a file"),
        (
            "data.regression_pairs_path={file}/pairs.safetensors",
            "data.regression_pairs_path",
            "cannot be made",
        ),
        (
            "data.regression_pairs_path={tmp}/pairs.npz",
            "data.regression_pairs_path",
            "must be a .safetensors file path",
        ),
        (
            "data.regression_pairs_path={tmp}",
            "data.regression_pairs_path",
            "must be a .safetensors file path",
        ),
    ],
)
def test_an_output_path_that_cannot_be_a_directory_is_refused(override, key, needle, tmp_path, capsys):
    (tmp_path / "file").write_text("not a directory")
    fill = {"file": tmp_path / "file", "tmp": tmp_path}
    argv = [override.format(**fill)]
    if key != "trainer.output_dir":
        argv.append(out(tmp_path))
    line = refused(capsys, *argv)
    assert f"config key '{key}' = " in line and needle.format(**fill) in line


def test_a_derived_checkpoint_root_that_is_a_file_names_where_it_comes_from(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("")
    line = refused(capsys, f"trainer.output_dir={tmp_path / 'run'}")
    assert (
        "config key 'checkpoint.root' = None: " in line
        and "(derived from trainer.output_dir) is a file" in line
    )


def test_a_pairs_path_that_is_a_directory_is_refused(tmp_path, capsys):
    (tmp_path / "pairs.safetensors").mkdir()
    line = refused(capsys, f"data.regression_pairs_path={tmp_path / 'pairs.safetensors'}", out(tmp_path))
    assert "is a directory, not a file" in line


def test_an_unwritable_parent_is_refused(tmp_path, capsys, monkeypatch):
    """As the check sees it (os.access); root may write anywhere, so the permission bits are simulated."""
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(preflight.os, "access", lambda p, mode: Path(p) != locked and real(p, mode))
    line = refused(capsys, f"trainer.output_dir={locked / 'run'}")
    assert f"config key 'trainer.output_dir' = '{locked / 'run'}'" in line
    assert f"cannot be written: its nearest existing parent {locked} is not writable by this user" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0o500 directory")
def test_a_read_only_parent_is_refused(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        line = refused(capsys, f"trainer.output_dir={locked / 'run'}")
    finally:
        locked.chmod(0o700)
    assert "not writable by this user" in line


def test_too_little_free_space_for_a_checkpoint_is_refused(tmp_path, capsys):
    step = tmp_path / "ckpt" / "global_step_3"
    step.mkdir(parents=True)
    huge = {"engine/__0_0.distcp": {"size": 2**60, "sha256": "0"}}
    (step / "manifest.json").write_text(json.dumps({"files": huge}))
    line = refused(capsys, f"checkpoint.root={tmp_path / 'ckpt'}", out(tmp_path))
    assert f"checkpoint root {tmp_path / 'ckpt'}: " in line and "free on its file system" in line
    assert "1073741824.00 GiB (as global_step_3)" in line


def test_without_a_checkpoint_the_free_space_is_checked_against_an_estimate(tmp_path, capsys, monkeypatch):
    """A fresh run: the size of one checkpoint is estimated from the models' weight headers (the digits
    teacher in the independent layout: student and fake score trained in full, with AdamW and the EMA)."""
    from types import SimpleNamespace

    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: SimpleNamespace(free=1 << 20))
    line = refused(capsys, out(tmp_path))
    assert "free on its file system" in line and "(estimated from the models)" in line and "0.01 GiB" in line


def test_the_roots_are_the_checkpoint_layers():
    from verl_dmd.checkpoint.composite import checkpoint_root
    from verl_dmd.checkpoint.export import export_root

    for overrides in ([], ["checkpoint.root=/c", "export.output_dir=/e"]):
        plan = compose_plan("digits_dmd2", overrides)
        assert preflight.checkpoint_root(plan) == checkpoint_root(plan)
        assert preflight.export_root(plan) == export_root(plan)


# --------------------------------------------------------------------------- 6: checkpoint.resume


@pytest.mark.parametrize("kind", ["latest", "missing", "file", "not-a-checkpoint"])
def test_a_resume_target_that_is_no_checkpoint_is_refused(kind, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    (tmp_path / "folder").mkdir()
    value = {"latest": "latest", "missing": str(tmp_path / "nosuch"), "file": str(tmp_path / "file"),
             "not-a-checkpoint": str(tmp_path / "folder")}[kind]  # fmt: skip
    line = refused(capsys, f"checkpoint.resume={value}", out(tmp_path))
    assert f"config key 'checkpoint.resume' = '{value}'" in line


def test_a_checkpoint_of_another_plan_is_refused_before_anything_starts(tmp_path, capsys):
    """checkpoint.resume=auto finds a checkpoint written under another plan: the checkpoint layer's
    `preflight_resume` names the differing key, in one line."""
    from verl_dmd.checkpoint.store import CheckpointStore

    store = CheckpointStore(tmp_path / "ckpt")
    staging = store.begin(1)
    (staging / "trainer_state.json").write_text("{}")
    other = compose_plan("digits_dmd2", ["algorithm.fake_update_ratio=3"])
    store.publish(staging, global_step=1, fingerprint=other.fingerprint(), world_size=2,
                  extra={"plan": other.semantic_dict()})  # fmt: skip
    line = refused(capsys, f"checkpoint.root={tmp_path / 'ckpt'}", out(tmp_path))
    assert "different plan" in line and "algorithm.fake_update_ratio" in line


# --------------------------------------------------------------------------- 7: resources


def test_a_cuda_run_without_gpus_is_refused(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    line = refused(capsys, "resources.device=cuda", out(tmp_path))
    assert "config key 'resources.device' = 'cuda': this machine has no GPU that torch can use" in line


def test_more_gpu_workers_than_this_machine_has_are_refused(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    argv = ["resources.device=cuda", "resources.workers_per_node=2", out(tmp_path)]
    line = refused(capsys, *argv)
    assert "'resources.nnodes' = 1 x 'resources.workers_per_node' = 2: 2 GPU workers" in line
    assert "this machine has 1 GPU(s)" in line
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # an external cluster: ray counts its GPUs
    assert main.check_command_line(argv) == 0
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setitem(main._FLAGS, "--local", True)  # one rank, in this process
    assert main.check_command_line(argv) == 0


def test_a_hybrid_mesh_is_refused_by_the_local_backend():
    """The local backend runs one rank: a mesh with replicas cannot be built there (one line, before any
    worker starts); the ray backend takes it, and plain sharding runs locally."""
    plan = compose_plan("digits_dmd2", ["resources.workers_per_node=4", "model.fsdp_mesh=[2,2]"])
    preflight.check_resources(plan, backend="ray")
    with pytest.raises(
        PlanError, match=r"^config key 'model.fsdp_mesh' = \[2, 2\]: .*local.*; fix: "
    ) as info:
        preflight.check_resources(plan, backend="local")
    assert "\n" not in str(info.value)
    preflight.check_resources(compose_plan("digits_dmd2", ["model.fsdp_mesh=hybrid"]), backend="local")


def test_cpu_workers_are_not_limited_by_the_cores():
    """The local cluster is started with a CPU per worker (DistillationRayTrainer._start_ray)."""
    plan = compose_plan("digits_dmd2", ["resources.workers_per_node=64"])
    preflight.check_resources(plan, backend="ray")


# --------------------------------------------------------------------------- 8: the command line itself


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["trainer.total_steps"], "override 'trainer.total_steps' does not parse (missing EQUAL at '<EOF>')"),
        (["=3"], "override '=3' names no key"),
        (["a.b=[1,"], "override 'a.b=[1,' does not parse"),
        (
            ["trainer.totl_steps=3"],
            "config key 'trainer.totl_steps' is unknown (override 'trainer.totl_steps=3'); "
            "did you mean 'trainer.total_steps'?",
        ),
        (["a.b=3"], "config key 'a.b' is unknown (override 'a.b=3')"),
        (
            ["trainer.output_dir=${trainer.outptu_dir}/x"],
            "config key 'trainer.output_dir' = '${trainer.outptu_dir}/x': does not resolve: Interpolation key "
            "'trainer.outptu_dir' not found",
        ),
        (
            ["--config-name", "nosuch"],
            "--config-name 'nosuch': no such recipe in pkg://verl_dmd.recipes; allowed: digits_dmd2,",
        ),
    ],
    ids=[
        "no-equals",
        "no-key",
        "unclosed-list",
        "unknown-key",
        "unknown-section",
        "interpolation",
        "no-recipe",
    ],
)
def test_a_broken_override_or_recipe_name_is_one_line(argv, needle, capsys):
    line = refused(capsys, *argv)
    assert needle in line
    assert "HYDRA_FULL_ERROR" not in line


def write_recipe(folder: Path, body: str) -> Path:
    folder.mkdir(exist_ok=True)
    head = "defaults:\n  - dmd2\n  - _self_\nhydra:\n  searchpath: [pkg://verl_dmd.config]\n"
    (folder / "mine.yaml").write_text(head + body)
    return folder / "mine.yaml"


def test_a_recipe_with_a_yaml_error_names_its_file_and_line(tmp_path, capsys):
    recipe = write_recipe(tmp_path / "recipes", "model:\n  adapter: dit\n  teacher: {path: builtin:digits_teacher\n"
                                                "data:\n  name: digits\n")  # fmt: skip
    line = refused(capsys, "--config-path", str(recipe.parent), "--config-name", "mine")
    assert f"{recipe}, line 9, column 5: not valid YAML: expected ',' or '}}', but got ':'" in line


def test_a_users_recipe_with_an_unknown_key_is_refused(tmp_path, capsys):
    write_recipe(tmp_path / "recipes", "model:\n  adapter: dit\n  teacher:\n    path: builtin:digits_teacher\n"
                                       "data:\n  name: digits\ntrainer:\n  totl_steps: 3\n")  # fmt: skip
    line = refused(capsys, "-cp", str(tmp_path / "recipes"), "-cn", "mine", out(tmp_path))
    assert "config key 'trainer.totl_steps' is unknown; did you mean 'total_steps'?" in line


def test_hydras_own_flags_are_left_to_hydra():
    for argv in (["--cfg", "job"], ["--hydra-help"], ["-m", "trainer.seed=1,2"], ["--info"]):
        assert main.check_command_line(argv) == 0, argv


def test_a_plan_the_command_line_passed_is_not_checked_again_in_run(tmp_path, monkeypatch):
    """hydra.main's task (`run`) skips the pre-flight for the plan `cli` checked, and runs it for another."""
    calls = []
    monkeypatch.setattr(main, "preflight", lambda plan, backend: calls.append(plan.trainer.output_dir))
    monkeypatch.setattr(main, "_CHECKED", [])
    assert main.check_command_line([out(tmp_path)]) == 0
    cfg = compose_plan("digits_dmd2", [out(tmp_path)]).to_dict()
    monkeypatch.setattr("verl_dmd.trainer.ray_trainer.DistillationRayTrainer.fit", lambda self: 0)
    assert main.run(cfg) == 0
    assert calls == [str(tmp_path / "out")]
    cfg["trainer"]["output_dir"] = str(tmp_path / "other")
    assert main.run(cfg) == 0
    assert calls == [str(tmp_path / "out"), str(tmp_path / "other")]


def test_the_embeddings_provider_checks_its_files_before_the_workers(tmp_path):
    import safetensors.torch
    import torch

    safetensors.torch.save_file({"cond.x": torch.zeros(2, 3)}, tmp_path / "nometa.safetensors")
    plan = compose_plan(
        "sd3_lora_dmd2", ["model.teacher.path=/m", f"data.path={tmp_path / 'nometa.safetensors'}"]
    )
    with pytest.raises(
        PlanError, match=r"config key 'data.path': nometa.safetensors has no 'latent_shape' metadata"
    ):
        preflight.check_data(plan)


# --------------------------------------------------------------------------- verl-dmd-export


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            ["checkpoint.resume=disable"],
            "config key 'checkpoint.resume' = 'disable': export needs a checkpoint",
        ),
        (["checkpoint.resume=latest"], "config key 'checkpoint.resume' = 'latest': not a checkpoint"),
        (["export.output_dir={file}/e"], "config key 'export.output_dir' = "),
        (["trainer.total_steps"], "override 'trainer.total_steps' does not parse"),
        (["checkpoint.resume=auto"], "no checkpoint under "),
    ],
)
def test_the_export_command_checks_before_hydra(argv, needle, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    argv = [a.format(file=tmp_path / "file") for a in argv]
    assert needle in refused(capsys, *argv, out(tmp_path), entry=export_main)


# --------------------------------------------------------------------------- the real command line


def command(*args: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "HYDRA_FULL_ERROR")}
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "verl_dmd.main", *args], capture_output=True, text=True,
                            cwd=tmp_path, timeout=120, env=env)  # fmt: skip
    return result, time.perf_counter() - started


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["trainer.total_steps"], "override 'trainer.total_steps' does not parse"),
        (["=3"], "override '=3' names no key"),
        (["a.b=[1,"], "override 'a.b=[1,' does not parse"),
        (["trainer.totl_steps=3"], "config key 'trainer.totl_steps' is unknown"),
        (["trainer.output_dir=${trainer.outptu_dir}/x"], "config key 'trainer.output_dir' = "),
        (["--config-path", "{recipes}", "--config-name", "mine"], "mine.yaml, line "),
        (["trainer.output_dir={file}"], "config key 'trainer.output_dir' = "),
        (["model.teacher.path={tmp}"], "config key 'model.teacher.path' = "),
        (["checkpoint.resume=latest"], "config key 'checkpoint.resume' = 'latest'"),
    ],
    ids=[
        "no-equals",
        "no-key",
        "unclosed-list",
        "unknown-key",
        "interpolation",
        "yaml",
        "output-file",
        "no-model",
        "resume",
    ],
)
def test_the_command_refuses_in_seconds_with_one_line_and_starts_nothing(args, needle, tmp_path):
    (tmp_path / "file").write_text("")
    write_recipe(tmp_path / "recipes", "model: [\n")
    fill = {"recipes": tmp_path / "recipes", "file": tmp_path / "file", "tmp": tmp_path}
    args = [a.format(**fill) if "{" in a and "${" not in a else a for a in args]
    if not any(a.startswith("trainer.output_dir=") for a in args):
        args.append(out(tmp_path))
    result, elapsed = command(*args, tmp_path=tmp_path)
    print(f"verl-dmd {' '.join(args)}: exit {result.returncode} in {elapsed:.2f} s")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0 and result.stderr.startswith("verl-dmd: error: "), (
        result.stderr
    )
    assert needle.format(**fill) in result.stderr
    assert "plan fingerprint" not in result.stdout  # printed just before the trainer starts ray
    assert not (tmp_path / "out").exists() and not (tmp_path / "outputs").exists()
    assert not list(tmp_path.rglob("main.log")) and not list(tmp_path.rglob(".hydra"))
    assert elapsed < FAST_S


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["model.adapter=digits"], "config key 'model.adapter' = 'digits': no such model adapter"),
        (
            [*SHARED, "model.student.lora.target_modules=[to_qq]"],
            "config key 'model.student.lora.target_modules'",
        ),
    ],
    ids=["adapter", "lora-target"],
)
def test_the_command_refuses_the_checks_that_import_torch_before_ray(args, needle, tmp_path):
    """These import torch (and the LoRA check diffusers), so their time is printed, not bounded here."""
    result, elapsed = command(*args, out(tmp_path), tmp_path=tmp_path)
    print(f"verl-dmd {' '.join(args)}: exit {result.returncode} in {elapsed:.2f} s")
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert needle in result.stderr and "plan fingerprint" not in result.stdout
    assert not (tmp_path / "out").exists()


def test_the_builtin_model_table_is_the_adapters():
    """The pre-flight's table of built-in adapters (read without importing diffusers) is what they load."""
    from verl_dmd.adapters import get_adapter
    from verl_dmd.adapters.registry import ADAPTERS
    from verl_dmd.preflight import BUILTIN_LORA_TARGETS, BUILTIN_MODEL_CLASSES

    assert tuple(BUILTIN_MODEL_CLASSES) == ADAPTERS.builtin_names  # other tests may register more
    for name, class_name in BUILTIN_MODEL_CLASSES.items():
        adapter = get_adapter(name)
        assert adapter.model_class.__name__ == class_name, name
        assert tuple(adapter.default_lora_targets) == BUILTIN_LORA_TARGETS, name


def test_the_early_name_check_declares_what_the_registries_do():
    """The torch-free copy of the registries' declarations is theirs."""
    from verl_dmd.adapters.registry import ADAPTERS
    from verl_dmd.algorithms.registry import METHODS
    from verl_dmd.preflight import BUILTIN_MODEL_CLASSES, REGISTRY_DECLARATIONS
    from verl_dmd.trainer.registry import DATA_PROVIDERS, VALIDATORS

    for registry in (ADAPTERS, METHODS, DATA_PROVIDERS, VALIDATORS):
        kind, group, builtins = REGISTRY_DECLARATIONS[registry.key]
        assert (kind, group, builtins) == (registry.kind, registry.entry_point_group, registry.builtin_names)
    assert REGISTRY_DECLARATIONS["model.adapter"][2] == tuple(BUILTIN_MODEL_CLASSES)
