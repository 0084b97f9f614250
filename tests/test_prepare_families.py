"""Each model family end to end on a tiny real pipeline: prepare -> verl-dmd --local with decoded validation -> export.

The pipelines are real diffusers pipelines built offline (`verl_dmd.testing.pipelines`): real text
encoders, tokenizers, VAEs and transformers of the released classes, tiny. Per family: the prepared
embeddings equal the pipeline's own ``encode_prompt`` (called here as a serving request would call it)
bit for bit; a run with validation writes readable PNG grids of the expected size (and GIFs for
video) and logs the comparison picture to tensorboard, read back from its event file; the export is
written. SD3 runs the real command-line scripts and its GAN terms on real images; Wan trains with
teacher pairs and real video clips; Flux carries Flux-dev's guidance embedding; Qwen-Image's text is
ragged (variable length with a mask).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from prepare_scenarios import (
    PROMPTS,
    VALIDATION_PROMPTS,
    prepare_overrides,
    recipe,
    train_overrides,
    write_captioned_images,
    write_lines,
)

from verl_dmd.main import compose_plan
from verl_dmd.testing.pipelines import FAMILIES, TINY_FRAMES, TINY_RESOLUTION, build_pipeline

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# What each family adds to the basic path (prepare extras, train extras).
EXTRAS = {
    "sd3": ({"prepare.real_images": "{images}"},
            {"algorithm.gan_generator_weight": 0.01, "algorithm.gan_discriminator_weight": 0.01,
             "export.formats": "[peft,diffusers,pipeline,lora_pipeline]", "export.pipeline_source": "{pipeline}"}),
    "flux": ({"prepare.guidance_embedding": 2.5},
             {"export.formats": "[peft,diffusers,pipeline,vllm_omni]", "export.pipeline_source": "{pipeline}"}),
    # attention q, k, v alone: targets vllm-omni's Qwen-Image LoRA loader places (not to_out.0: serving.py)
    "qwen_image": ({}, {"export.formats": "[peft,diffusers,vllm_omni,lora_vllm_omni]",
                        "export.pipeline_source": "{pipeline}", "model.student.lora.target_modules": "[to_q,to_k,to_v]"}),
    "wan": ({"prepare.real_images": "{images}", "prepare.teacher_pairs": "true"},
            {"algorithm.regression_weight": 0.25, "algorithm.gan_discriminator_weight": 0.01,
             "export.formats": "[peft,diffusers,pipeline,vllm_omni]", "export.pipeline_source": "{pipeline}",
             "validation.replica": "false"}),  # the training engine's roles sampled directly
}  # fmt: skip


# The serving targets each family's run round-trips (the pipeline target always: exported for the check if the
# run did not).
SERVED = {"sd3": {"pipeline", "lora_pipeline"}, "flux": {"pipeline", "vllm_omni"},
          "qwen_image": {"pipeline", "vllm_omni", "lora_vllm_omni"}, "wan": {"pipeline", "vllm_omni"}}  # fmt: skip


def serving_embeddings(family: str, pipe, prompts: list[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """What the pipeline's own encode_prompt gives a request for `prompts` (its __call__'s defaults, which pass
    max_sequence_length on): the prompts' embeddings, and the negative (empty) prompt's."""
    import inspect

    length = inspect.signature(type(pipe).__call__).parameters["max_sequence_length"].default
    pipe.encode_prompt = functools.partial(pipe.encode_prompt, max_sequence_length=length)
    with torch.no_grad():
        if family == "sd3":  # prompt_2/prompt_3 default to prompt; the negative is encoded alongside
            embeds, negative, pooled, negative_pooled = pipe.encode_prompt(prompts, None, None)
            return ({"encoder_hidden_states": embeds, "pooled_projections": pooled},
                    {"encoder_hidden_states": negative[:1], "pooled_projections": negative_pooled[:1]})  # fmt: skip
        if family == "flux":  # no CFG: the empty prompt is encoded as a prompt (true CFG's negative)
            embeds, pooled, _ = pipe.encode_prompt(prompts, None)
            empty, empty_pooled, _ = pipe.encode_prompt([""], None)
            return ({"encoder_hidden_states": embeds, "pooled_projections": pooled},
                    {"encoder_hidden_states": empty, "pooled_projections": empty_pooled})  # fmt: skip
        if family == "qwen_image":
            embeds, mask = pipe.encode_prompt(prompts)
            empty, empty_mask = pipe.encode_prompt([""])
            ones = lambda e: torch.ones(e.shape[:2], dtype=torch.long)  # noqa: E731 (a mask the pipeline dropped)
            return ({"encoder_hidden_states": embeds, "encoder_hidden_states_mask": ones(embeds) if mask is None else mask},
                    {"encoder_hidden_states": empty, "encoder_hidden_states_mask": ones(empty) if empty_mask is None else empty_mask})  # fmt: skip
        embeds, negative = pipe.encode_prompt(prompts)  # wan: CFG on by default, negative ""
        return {"encoder_hidden_states": embeds}, {"encoder_hidden_states": negative[:1]}


def check_embeddings_equal_serving(family: str, pipeline: Path, data: Path) -> None:
    from diffusers import DiffusionPipeline

    from verl_dmd.data.prepared import PreparedDataset

    dataset = PreparedDataset.open(data)
    pipe = DiffusionPipeline.from_pretrained(str(pipeline), transformer=None, vae=None, local_files_only=True)
    batch = dataset.intent["encoding"]["batch_size"]
    for number, shard in enumerate(dataset.files("prompts")):
        stored = safetensors.torch.load_file(shard)
        rows = PROMPTS[number * 4 : (number + 1) * 4]
        for start in range(0, len(rows), batch):  # the same batches as prepare: batches never cross shards
            want, _ = serving_embeddings(family, pipe, rows[start : start + batch])
            for key, tensor in want.items():
                got = stored[f"cond.{key}"][start : start + batch, : tensor.shape[1]]
                assert torch.equal(got, tensor), (family, key, number, start)
                assert not stored[f"cond.{key}"][
                    start : start + batch, tensor.shape[1] :
                ].any()  # ragged: zeros
    _, negative = serving_embeddings(family, pipe, PROMPTS[:1])
    uncond = safetensors.torch.load_file(dataset.files("uncond")[0])
    for key, tensor in negative.items():
        assert torch.equal(uncond[f"uncond.{key}"], tensor), (family, key)
    if family == "flux":  # Flux-dev's guidance embedding travels with every prompt
        assert torch.equal(stored["cond.guidance"], torch.full((stored["cond.guidance"].shape[0],), 2.5))


def check_pictures(family: str, out: Path, steps: list[int]) -> None:
    from PIL import Image

    height, width = TINY_RESOLUTION[family]
    models = 1 + 2  # the teacher, student_ema at 1 and 4 steps (the recipes validate student_ema only)
    for step in steps:
        samples = out / "samples" / f"step_{step}"
        with Image.open(samples / "comparison.png") as picture:
            picture.verify()
        with Image.open(samples / "comparison.png") as picture:
            assert picture.mode == "RGB"
            assert picture.size == (
                2 * (width + 2) + 2,
                models * (height + 2) + 2,
            )  # prompts x models, 2 px gaps
        for name in ("teacher_2step", "student_ema_1step", "student_ema_4step"):
            with Image.open(samples / f"{name}.png") as picture:
                frames = TINY_FRAMES.get(family)
                want = (
                    (frames * (width + 2) + 2, 2 * (height + 2) + 2)
                    if frames
                    else (2 * (width + 2) + 2, height + 4)
                )
                assert picture.size == want, (name, picture.size)
            if family in TINY_FRAMES:
                with Image.open(samples / f"{name}.gif") as animation:
                    assert animation.n_frames == TINY_FRAMES[family]
        assert (samples / "prompts.txt").read_text().startswith("0\ta red cat\n1\ta green frog on a leaf\n")


def check_tensorboard(out: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator

    (events,) = (out / "tensorboard").glob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events), size_guidance={IMAGES: 0})
    accumulator.Reload()
    assert "samples/comparison" in accumulator.Tags()["images"]
    logged = accumulator.Images("samples/comparison")
    assert [event.step for event in logged] == [1, 2]
    assert all(event.encoded_image_string.startswith(b"\x89PNG") for event in logged)
    assert "val/student_ema_1step/psnr" in accumulator.Tags()["scalars"]


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipelines")
    return {
        family: build_pipeline(family, root / family, guidance_embeds=family == "flux") for family in FAMILIES
    }


def check_served(family: str, exported: Path, algorithm, guidance: float) -> None:
    """The vllm_omni directory read as vllm-omni reads it samples the trained schedule (`algorithm`'s
    student_steps, sigma_shift) with the student's sampler and the training guidance; the pipeline directory
    (Flux, Wan) keeps the teacher's class, which diffusers loads."""
    from verl_dmd.algorithms.sampling import trained_schedule
    from verl_dmd.checkpoint import serving

    index = json.loads((exported / "vllm_omni" / "model_index.json").read_text())
    served = serving.read_served(index)
    want = trained_schedule(algorithm).tolist()
    assert served["dmd2"] and served["fell_back"] is None and served["stochastic"], served
    assert served["class"] == {"flux": "FluxDMD2Pipeline", "qwen_image": "QwenImageDMD2Pipeline",
                               "wan": "WanT2VDMD2Pipeline"}[family]  # fmt: skip
    assert (
        max(abs(a - b) for a, b in zip(served["sigmas"], want, strict=True)) < 1e-6
        and served["guidance_scale"] == guidance
    )
    assert (exported / "pipeline").is_dir() == (family != "qwen_image")
    if family != "qwen_image":  # Wan's UniPC scheduler is replaced by the stochastic flow-matching one
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(str(exported / "pipeline"), local_files_only=True)
        assert type(pipe).__name__ == {"flux": "FluxPipeline", "wan": "WanPipeline"}[family]
        assert type(pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
        assert pipe.scheduler.config.stochastic_sampling and not pipe.scheduler.config.use_dynamic_shifting
        # The same files: the vllm-omni directory is hard links to the pipeline's, not a second copy.
        weights = sorted((exported / "pipeline" / "transformer").glob("*.safetensors"))[0]
        assert os.path.samefile(weights, exported / "vllm_omni" / "transformer" / weights.name)


def check_round_trip(family: str, exported: Path, plan, tmp_path: Path) -> None:
    """Each serving target, loaded by diffusers and called as docs/serving.md says (the vllm_omni directory
    as vllm-omni's DMD2 pipeline samples it: tests/serving_calls.py), from the same noise and prepared
    embeddings, reproduces the in-trainer few-step sampler of the exported role (student_ema) to 1e-5 in
    float32; a wrong role, a wrong schedule or a wrong guidance does not come near."""
    from diffusers import DiffusionPipeline
    from serving_calls import documented_call, fresh_noise, trainer_sample, vllm_omni_call

    from verl_dmd.algorithms.sampling import renoise_draws
    from verl_dmd.checkpoint.export import export_checkpoint
    from verl_dmd.data.prepared import PreparedDataset
    from verl_dmd.trainer.embeddings import RowTable, _prefixed

    dataset = PreparedDataset.open(Path(plan.data.path))
    table = RowTable(dataset.files("validation"), _prefixed(dataset.ragged, "cond."), what="validation rows")
    cond = {k.removeprefix("cond."): v for k, v in table.read(table.keys, [0, 1]).items()}
    generator = torch.Generator().manual_seed(11)
    noise = torch.randn((2, *dataset.latent_shape), generator=generator)
    steps = plan.algorithm.student_steps
    draws = renoise_draws(noise.shape, steps, generator)
    checkpoint = Path(json.loads((exported / "export.json").read_text())["checkpoint"])
    want = trainer_sample(plan, checkpoint, "student_ema", cond, noise, draws)
    size, frames = TINY_RESOLUTION[family], TINY_FRAMES.get(family)

    pipeline = exported / "pipeline"
    # Qwen-Image's run exported vllm_omni alone: the pipeline target of the same role, exported here
    if not pipeline.is_dir():
        pipeline = export_checkpoint(plan, checkpoint, formats=("pipeline",), output_dir=tmp_path / "served",
                                     log=lambda _: None) / "pipeline"  # fmt: skip
    block = json.loads((pipeline / "model_index.json").read_text())["dmd2_config"]
    pipe = DiffusionPipeline.from_pretrained(str(pipeline), local_files_only=True)
    served = {}
    with fresh_noise(draws) as drawn:
        served["pipeline"] = documented_call(family, pipe, block, cond, noise, size, frames)
    assert len(drawn) == steps, drawn
    if (exported / "vllm_omni").is_dir():
        with fresh_noise(draws) as drawn:
            served["vllm_omni"] = vllm_omni_call(family, exported / "vllm_omni", cond, noise, size, frames)
        assert len(drawn) == steps, drawn
    if (exported / "lora_pipeline").is_dir():  # the adapter served on the teacher's linked files
        teacher = sorted((exported / "lora_pipeline" / "transformer").glob("*.safetensors"))[0]
        assert os.path.samefile(teacher, Path(plan.model.teacher.path) / "transformer" / teacher.name)
        lora_pipe = DiffusionPipeline.from_pretrained(str(exported / "lora_pipeline"), local_files_only=True)
        lora_pipe.load_lora_weights(str(exported / "peft"))
        with fresh_noise(draws):
            served["lora_pipeline"] = documented_call(family, lora_pipe, block, cond, noise, size, frames)
    if (exported / "lora_vllm_omni").is_dir():
        with fresh_noise(draws):
            served["lora_vllm_omni"] = vllm_omni_call(family, exported / "lora_vllm_omni", cond, noise, size, frames,
                                                      lora=exported / "peft")  # fmt: skip
    assert set(served) == SERVED[family], served.keys()
    errors = {target: float((got - want).abs().max()) for target, got in served.items()}
    assert all(error < 1e-5 for error in errors.values()), errors

    # What a wrong export would serve instead is far outside the bound (the comparison can fail).
    got = served["pipeline"]
    wrong = {"the student (not the EMA)": trainer_sample(plan, checkpoint, "student", cond, noise, draws),
             "the teacher (no adapter)": trainer_sample(plan, checkpoint, "student_ema", cond, noise, draws,
                                                        teacher=True)}  # fmt: skip
    pipe = DiffusionPipeline.from_pretrained(str(pipeline), local_files_only=True)
    pipe.scheduler = type(pipe.scheduler).from_config({**pipe.scheduler.config, "shift": 1.0})
    with fresh_noise(draws):
        wrong["the unshifted schedule"] = documented_call(family, pipe, block, cond, noise, size, frames)
    if family == "flux":  # Flux-dev's guidance embedding: FluxPipeline's default 3.5, not the trained 2.5
        pipe = DiffusionPipeline.from_pretrained(str(pipeline), local_files_only=True)
        with fresh_noise(draws):
            wrong["guidance 3.5"] = documented_call(family, pipe, {**block, "guidance_scale": 3.5}, cond, noise,
                                                    size, frames)  # fmt: skip
    distances = {what: float((got - other).abs().max()) for what, other in wrong.items()}
    assert all(distance > 1e-3 for distance in distances.values()), distances


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_goes_from_prompts_to_samples_and_an_export(family, pipelines, tmp_path, capsys):
    from verl_dmd import main, prepare_main

    pipeline, data, out = pipelines[family], tmp_path / "data", tmp_path / "run"
    images = write_captioned_images(tmp_path / "images", 3, frames=TINY_FRAMES.get(family))
    fill = {"images": images, "pipeline": pipeline}
    prepare_extra, train_extra = ({k: str(v).format(**fill) for k, v in d.items()} for d in EXTRAS[family])
    prompts = write_lines(tmp_path / "prompts.txt", PROMPTS)
    validation = write_lines(tmp_path / "validation.txt", VALIDATION_PROMPTS)
    prepare = prepare_overrides(family, pipeline, data, prompts, **prepare_extra,
                                **{"prepare.validation_prompts": validation})  # fmt: skip
    # float32 export for the 1e-5 round trip; a student (and EMA) that moves in 2 steps, so that the round trip
    # tells the exported role from the raw student and from the teacher
    moving = {"export.dtype": "float32", "optim.student.lr": 0.03, "ema.decay": 0.5}
    train = train_overrides(family, pipeline, data, out, **train_extra, **moving)
    if family == "sd3":  # the command-line scripts themselves
        for script, args in (("verl-dmd-prepare", prepare), ("verl-dmd", ["--local", *train])):
            result = subprocess.run([str(Path(sys.executable).parent / script), "--config-name", recipe(family), *args],
                                    capture_output=True, text=True, timeout=600, cwd=ROOT)  # fmt: skip
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        log = result.stdout
    else:  # the same functions the scripts call, in this process (no second start-up of torch and diffusers)
        assert prepare_main.run(compose_plan(recipe(family), prepare).to_dict()) == 0
        assert main.run(compose_plan(recipe(family), train).to_dict(), backend="local") == 0
        log = capsys.readouterr().out
    check_embeddings_equal_serving(family, pipeline, data)
    assert "decoded samples at global step 1" in log and "decoded samples at global step 2" in log, log[
        -3000:
    ]
    check_pictures(family, out, [1, 2])
    # The student (validation.roles: student_ema in the recipes) was sampled through the inference replica after
    # a sync at each of the 2 validations (version 2 at step 2), and the record says which version (Wan: through
    # the engine, validation.replica=false).
    record = (out / "samples" / "step_2" / "prompts.txt").read_text()
    replica = "student_ema: sampled through the inference replica holding student_ema@2"
    assert (replica in record) == (family != "wan") and ("replica" in record) == (family != "wan"), record
    check_tensorboard(out)
    exported = out / "export" / "global_step_2" / "student_ema"
    assert (exported / "peft" / "adapter_model.safetensors").is_file()
    assert (exported / "diffusers" / "config.json").is_file()
    if family == "sd3":  # the exported pipeline is a diffusers pipeline that samples
        from diffusers import DiffusionPipeline

        served = DiffusionPipeline.from_pretrained(str(exported / "pipeline"), local_files_only=True)
        image = served(prompt="a red cat", num_inference_steps=1, height=32, width=32, guidance_scale=1.0,
                       output_type="pt").images  # fmt: skip
        assert image.shape == (1, 3, 32, 32) and torch.isfinite(image).all()
    if family != "sd3":  # vllm-omni's DMD2 class reads the trained sampler; Flux-dev's guidance
        check_served(
            family, exported, compose_plan(recipe(family), train).algorithm, 2.5 if family == "flux" else 1.0
        )
    check_round_trip(family, exported, compose_plan(recipe(family), train), tmp_path)
    if family == "qwen_image":  # ragged text: a batch is as long as its longest prompt, no longer
        from verl_dmd.trainer.embeddings import EmbeddingsProvider

        batch = EmbeddingsProvider(compose_plan(recipe(family), train)).next_batch(3)
        mask = batch["cond.encoder_hidden_states_mask"]
        assert mask.shape[1] == int(mask.sum(dim=1).max()) == batch["cond.encoder_hidden_states"].shape[1]
