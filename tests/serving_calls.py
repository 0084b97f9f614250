"""The serving calls of docs/serving.md, per family, and the in-trainer few-step sampler they must reproduce.

A round trip: an exported directory is loaded by diffusers and called as the docs say, from the same
starting noise (`latents=`) and the same conditioning (the prepared data set's embeddings as
`prompt_embeds`), returning latents (`output_type="latent"`); the in-trainer sampler
(`verl_dmd.algorithms.sampling.few_step_sample`, what validation and evaluation sample with) runs the
exported role read from the checkpoint on the same inputs.

Fresh noise. Both re-noise between steps with fresh noise: ours comes from `renoise_draws`, diffusers'
stochastic FlowMatchEulerDiscreteScheduler.step draws it with ``randn_tensor(sample.shape,
generator=None, ...)`` in its own module (the pipelines pass it no generator). `fresh_noise` puts our
draws there, in order, and counts the calls; the last step's draw is multiplied by the final level 0,
so it gets zeros. Nothing else in the call is replaced: the starting noise goes in as `latents`.

vllm-omni cannot run here (it needs a CUDA build of vllm). Its DMD2 pipelines run the family's diffusers
pipeline logic with the scheduler swapped for a FlowMatchEuler one at shift 1 whose levels are the
block's timesteps / 1000 (stochastic for "sde"), every request forced to the block's step count and
guidance (../shared/REAL_MODELS.md section 1). `vllm_omni_call` does exactly that with diffusers, from
what `serving.read_served` reads in the directory; it is an emulation of their sampler, not their code.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from unittest import mock

import numpy as np
import torch

FRESH_NOISE_SITE = "diffusers.schedulers.scheduling_flow_match_euler_discrete.randn_tensor"

DIFFUSERS_CLASS = {"sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline",
                   "qwen_image": "QwenImagePipeline", "wan": "WanPipeline"}  # fmt: skip


@contextlib.contextmanager
def fresh_noise(draws: list[torch.Tensor]) -> Iterator[list[tuple[int, ...]]]:
    """diffusers' stochastic steps re-noise with `draws` (in order), then zeros; yields the shapes drawn."""
    queue, drawn = list(draws), []

    def randn_tensor(shape, generator=None, device=None, dtype=None, layout=None):
        drawn.append(tuple(shape))
        tensor = queue.pop(0) if queue else torch.zeros(tuple(shape))
        assert tuple(tensor.shape) == tuple(shape), (tensor.shape, shape)
        return tensor.to(device=device, dtype=dtype)

    with mock.patch(FRESH_NOISE_SITE, randn_tensor):
        yield drawn
    assert not queue, f"{len(queue)} re-noising draws were not used"


def _unshifted(steps: int) -> list[float]:
    return list(np.linspace(1.0, 1.0 / steps, steps))


def documented_call(family: str, pipe, block: Mapping, cond: Mapping[str, torch.Tensor], noise: torch.Tensor,
                    size: tuple[int, int], num_frames: int | None = None) -> torch.Tensor:  # fmt: skip
    """The `pipeline` target's call of docs/serving.md's per-family table, with N and G from `block`."""
    steps, guidance = block["num_inference_steps"], block["guidance_scale"]
    common = {"num_inference_steps": steps, "latents": noise.clone(), "output_type": "latent",
              "height": size[0], "width": size[1], "return_dict": False}  # fmt: skip
    text = cond["encoder_hidden_states"]
    with torch.no_grad():
        if family == "sd3":
            return pipe(prompt_embeds=text, pooled_prompt_embeds=cond["pooled_projections"],
                        sigmas=_unshifted(steps), guidance_scale=guidance, **common)[0]  # fmt: skip
        if family == "flux":
            return pipe(prompt_embeds=text, pooled_prompt_embeds=cond["pooled_projections"],
                        guidance_scale=guidance, **common)[0]  # fmt: skip
        if family == "qwen_image":
            return pipe(prompt_embeds=text, prompt_embeds_mask=cond.get("encoder_hidden_states_mask"),
                        true_cfg_scale=1.0, **common)[0]  # fmt: skip
        if family == "wan":
            pipe.scheduler.set_timesteps = functools.partial(
                pipe.scheduler.set_timesteps, sigmas=_unshifted(steps)
            )
            return pipe(prompt_embeds=text, guidance_scale=guidance, num_frames=num_frames, **common)[0]
    raise ValueError(f"no documented call for {family!r}")


def vllm_omni_call(family: str, directory: Path, cond: Mapping[str, torch.Tensor], noise: torch.Tensor,
                   size: tuple[int, int], num_frames: int | None = None, lora: Path | None = None) -> torch.Tensor:  # fmt: skip
    """The `vllm_omni` directory sampled as vllm-omni's DMD2 pipeline samples it (see the module docstring);
    with `lora` (a peft export), the adapter loaded on it (``--lora-path``; placed here by diffusers)."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    from verl_dmd.checkpoint import serving

    served = serving.read_served(json.loads((directory / "model_index.json").read_text()))
    assert served["dmd2"] and served["fell_back"] is None, served
    assert served["class"] == serving.VLLM_OMNI_CLASSES[DIFFUSERS_CLASS[family]], served["class"]
    pipe = getattr(diffusers, DIFFUSERS_CLASS[family]).from_pretrained(str(directory), local_files_only=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0,
                                                stochastic_sampling=served["stochastic"])  # fmt: skip
    own = scheduler.set_timesteps

    def set_timesteps(num_inference_steps=None, device=None, sigmas=None, mu=None, timesteps=None):
        # the block's levels whatever the pipeline passes (vllm-omni ignores sigmas and mu)
        own(device=device, sigmas=served["sigmas"][:-1])

    scheduler.set_timesteps = set_timesteps
    pipe.scheduler = scheduler
    block = {"num_inference_steps": len(served["sigmas"]) - 1, "guidance_scale": served["guidance_scale"]}
    return documented_call(family, pipe, block, cond, noise, size, num_frames)


def trainer_sample(
    plan, checkpoint: Path, role: str, cond, noise, draws, *, teacher: bool = False
) -> torch.Tensor:
    """The in-trainer few-step sampler of `role` as the checkpoint holds it (LoRA unmerged, float32), at the
    trained schedule; `teacher` samples the base with the role's adapter disabled instead (a wrong role)."""
    from verl_dmd.adapters import get_adapter
    from verl_dmd.algorithms.sampling import few_step_sample, trained_schedule
    from verl_dmd.checkpoint.export import load_role
    from verl_dmd.checkpoint.store import CheckpointStore
    from verl_dmd.phases import Role
    from verl_dmd.runtime.layouts import layout_for
    from verl_dmd.runtime.lora import switch_adapter, tuner_layers

    adapter = get_adapter(plan.model.adapter)()
    loaded = load_role(layout_for(plan, adapter), CheckpointStore.verify(checkpoint), Role(role))
    schedule = trained_schedule(plan.algorithm, adapter.sigma_max)
    if teacher:
        switch_adapter(tuner_layers(loaded.model), loaded.selection.adapter, enabled=False)
    return few_step_sample(adapter, loaded.model, noise, cond, schedule, draws)
