"""Adapters for diffusers' transformers: SD3/SD3.5, Flux, Qwen-Image, Wan, and class-conditional DiT.

Conditioning is precomputed (text encoders stay outside the training loop):
`cond` holds prompt embeddings and, where the family uses them, pooled
embeddings. Every family predicts the flow-matching velocity `eps - x0`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch
from diffusers import (
    DiTTransformer2DModel,
    FluxTransformer2DModel,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    WanTransformer3DModel,
)
from torch import nn

from verl_dmd.adapters.base import DistributionMatchingModelAdapter, ModelSource
from verl_dmd.adapters.registry import register_adapter


def _randn(shape: Sequence[int], generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator)


def _check_size(family: str, height: int, width: int, factor: int, *, square: bool = False) -> None:
    """One line naming prepare.resolution when the pipeline of `family` cannot make an image of that size."""
    shown = f"[{height}, {width}]"
    for value in (height, width):
        if value < factor or value % factor:
            near = max(factor, round(value / factor) * factor)
            raise ValueError(f"config key 'prepare.resolution' = {shown}: the {family} pipeline makes heights and "
                             f"widths divisible by {factor} (VAE factor x patch size); fix: e.g. {near} instead of {value}")  # fmt: skip
    if square and height != width:
        raise ValueError(f"config key 'prepare.resolution' = {shown}: the {family} adapter reads its packed latent "
                         "tokens as a square grid; fix: a square resolution, e.g. "
                         f"[{max(height, width)}, {max(height, width)}]")  # fmt: skip


def _no_frames(family: str, num_frames: int | None) -> None:
    if num_frames is not None:
        raise ValueError(f"config key 'prepare.num_frames' = {num_frames}: {family} makes images; fix: "
                         "prepare.num_frames=null")  # fmt: skip


def _kl_scale_factor(vae_config: Mapping) -> int:
    """The spatial factor of an AutoencoderKL, as the SD3 and Flux pipelines compute it."""
    return 2 ** (len(vae_config["block_out_channels"]) - 1)


def _shift_scale(vae) -> tuple[float, float]:
    return float(vae.config.shift_factor or 0.0), float(vae.config.scaling_factor)


def _mean_std(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel latent mean and std of a Wan / Qwen-Image VAE, shaped (1, z, 1, 1, 1) like `like`."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(like.device, like.dtype)
    std = torch.tensor(vae.config.latents_std).view(shape).to(like.device, like.dtype)
    return mean, std


def _max_length(value: int) -> dict:
    return {"max_sequence_length": int(value)}


@register_adapter("sd3")
class SD3Adapter(DistributionMatchingModelAdapter):
    """SD3 / SD3.5 MMDiT: latents (B, C, H, W); timestep = 1000 * sigma."""

    model_class = SD3Transformer2DModel
    tiny_config: ClassVar[dict] = {
        "sample_size": 8, "patch_size": 2, "in_channels": 4, "num_layers": 2, "attention_head_dim": 8,
        "num_attention_heads": 2, "joint_attention_dim": 16, "caption_projection_dim": 16,
        "pooled_projection_dim": 8, "out_channels": 4, "pos_embed_max_size": 16,
    }  # fmt: skip

    def fsdp_units(self, model: nn.Module) -> Sequence[nn.Module]:
        return list(model.transformer_blocks)

    def predict(self, model, x_t, sigma, cond: Mapping[str, torch.Tensor]):
        return model(
            hidden_states=x_t,
            encoder_hidden_states=cond["encoder_hidden_states"],
            pooled_projections=cond["pooled_projections"],
            timestep=sigma * 1000.0,
            return_dict=False,
        )[0]

    def example_batch(self, model, batch_size, generator):
        cfg = model.config
        x0 = _randn((batch_size, cfg.in_channels, cfg.sample_size, cfg.sample_size), generator)
        cond = {
            "encoder_hidden_states": _randn((batch_size, 4, cfg.joint_attention_dim), generator),
            "pooled_projections": _randn((batch_size, cfg.pooled_projection_dim), generator),
        }
        return x0, cond

    # -- the pipeline: StableDiffusion3Pipeline (two CLIPs and T5; latents (x - shift) * scale)

    pipeline_classes = ("StableDiffusion3Pipeline",)
    text_encoders = ("text_encoder", "text_encoder_2", "text_encoder_3")
    max_text_tokens = 512

    def encode_prompts(self, pipe, prompts, *, max_sequence_length):
        # prompt_2 and prompt_3 default to `prompt`, as a request without them is served.
        embeds, _, pooled, _ = pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, do_classifier_free_guidance=False,
            **_max_length(max_sequence_length),
        )  # fmt: skip
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled}

    def latent_shape(self, vae_config, transformer_config, height, width, num_frames):
        _no_frames("sd3", num_frames)
        factor = _kl_scale_factor(vae_config)
        _check_size("sd3", height, width, factor * int(transformer_config.get("patch_size", 2)))
        return (int(vae_config["latent_channels"]), height // factor, width // factor)

    def encode_images(self, vae, pixels):
        shift, scale = _shift_scale(vae)
        return (vae.encode(pixels).latent_dist.mode() - shift) * scale

    def decode_latents(self, vae, latents, height, width):
        shift, scale = _shift_scale(vae)
        return vae.decode(latents / scale + shift, return_dict=False)[0]


@register_adapter("flux")
class FluxAdapter(DistributionMatchingModelAdapter):
    """Flux: packed latent tokens (B, N, C) on a square grid; timestep = sigma.

    Position ids are derived from the token grid here, so `cond` holds only
    per-sample tensors (micro-batching splits every entry along dim 0).
    """

    model_class = FluxTransformer2DModel
    # cuDNN's attention backward gives Flux LoRA gradients millions of times too large on an H200 with
    # torch 2.11 (head dim 128 and 8; flash, memory-efficient and math agree with float32), and it ended
    # compiled Flux runs with an illegal memory access: docs/benchmarks.md, "bf16 gradients against float32".
    excluded_attention_kernels: ClassVar[tuple[str, ...]] = ("cudnn",)
    tiny_config: ClassVar[dict] = {
        "patch_size": 1, "in_channels": 8, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 8,
        "num_attention_heads": 2, "joint_attention_dim": 16, "pooled_projection_dim": 8,
        "axes_dims_rope": [2, 2, 4],
    }  # fmt: skip

    def fsdp_units(self, model: nn.Module) -> Sequence[nn.Module]:
        return [*model.transformer_blocks, *model.single_transformer_blocks]

    @staticmethod
    def _ids(num_tokens: int, num_text: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        side = math.isqrt(num_tokens)
        if side * side != num_tokens:
            raise ValueError(f"flux adapter: {num_tokens} latent tokens do not form a square grid")
        rows = torch.arange(side, device=like.device).repeat_interleave(side)
        cols = torch.arange(side, device=like.device).repeat(side)
        img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=1).to(like.dtype)
        txt_ids = torch.zeros(num_text, 3, device=like.device, dtype=like.dtype)
        return img_ids, txt_ids

    def predict(self, model, x_t, sigma, cond: Mapping[str, torch.Tensor]):
        text = cond["encoder_hidden_states"]
        img_ids, txt_ids = self._ids(x_t.shape[1], text.shape[1], x_t)
        return model(
            hidden_states=x_t,
            encoder_hidden_states=text,
            pooled_projections=cond["pooled_projections"],
            timestep=sigma,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=cond.get("guidance"),
            return_dict=False,
        )[0]

    def example_batch(self, model, batch_size, generator):
        cfg = model.config
        x0 = _randn((batch_size, 16, cfg.in_channels), generator)
        cond = {
            "encoder_hidden_states": _randn((batch_size, 4, cfg.joint_attention_dim), generator),
            "pooled_projections": _randn((batch_size, cfg.pooled_projection_dim), generator),
        }
        return x0, cond

    # -- the pipeline: FluxPipeline (CLIP pooled + T5; latents (x - shift) * scale, packed 2x2 into tokens)

    pipeline_classes = ("FluxPipeline",)
    text_encoders = ("text_encoder", "text_encoder_2")
    max_text_tokens = 512
    DEFAULT_GUIDANCE = 3.5
    """FluxPipeline's default guidance_scale: the guidance-embedding value a Flux-dev request gets."""

    def encode_prompts(self, pipe, prompts, *, max_sequence_length):
        embeds, pooled, _ = pipe.encode_prompt(
            prompt=prompts, prompt_2=None, **_max_length(max_sequence_length)
        )
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled}

    def constant_cond(self, transformer_config, guidance):
        if not transformer_config.get("guidance_embeds", False):
            return {}
        return {"guidance": float(self.DEFAULT_GUIDANCE if guidance is None else guidance)}

    def latent_shape(self, vae_config, transformer_config, height, width, num_frames):
        _no_frames("flux", num_frames)
        factor = _kl_scale_factor(vae_config)
        _check_size("flux", height, width, factor * 2, square=True)
        return ((height // factor // 2) * (width // factor // 2), int(vae_config["latent_channels"]) * 4)

    def encode_images(self, vae, pixels):
        from diffusers import FluxPipeline

        shift, scale = _shift_scale(vae)
        latents = (vae.encode(pixels).latent_dist.mode() - shift) * scale
        return FluxPipeline._pack_latents(latents, latents.shape[0], latents.shape[1], *latents.shape[2:])

    def decode_latents(self, vae, latents, height, width):
        from diffusers import FluxPipeline

        shift, scale = _shift_scale(vae)
        latents = FluxPipeline._unpack_latents(
            latents, height, width, 2 ** (len(vae.config.block_out_channels) - 1)
        )
        return vae.decode(latents / scale + shift, return_dict=False)[0]


@register_adapter("qwen_image")
class QwenImageAdapter(DistributionMatchingModelAdapter):
    """Qwen-Image MMDiT: packed latent tokens (B, N, C) on a square grid; timestep = sigma.

    The image grid (`img_shapes`) is derived from the token count; the text mask
    ``cond["encoder_hidden_states_mask"]`` (B, L) is optional (all tokens valid).
    """

    model_class = QwenImageTransformer2DModel
    tiny_config: ClassVar[dict] = {
        "patch_size": 2, "in_channels": 16, "out_channels": 4, "num_layers": 2, "attention_head_dim": 8,
        "num_attention_heads": 2, "joint_attention_dim": 16, "axes_dims_rope": [2, 2, 4],
    }  # fmt: skip

    def fsdp_units(self, model: nn.Module) -> Sequence[nn.Module]:
        return list(model.transformer_blocks)

    def predict(self, model, x_t, sigma, cond: Mapping[str, torch.Tensor]):
        batch, tokens = x_t.shape[:2]
        side = math.isqrt(tokens)
        if side * side != tokens:
            raise ValueError(f"qwen_image adapter: {tokens} latent tokens do not form a square grid")
        text = cond["encoder_hidden_states"]
        mask = cond.get("encoder_hidden_states_mask")
        if mask is None:
            mask = torch.ones(text.shape[:2], dtype=torch.long, device=text.device)
        return model(
            hidden_states=x_t,
            encoder_hidden_states=text,
            encoder_hidden_states_mask=mask,
            timestep=sigma,
            img_shapes=[[(1, side, side)]] * batch,
            return_dict=False,
        )[0]

    def example_batch(self, model, batch_size, generator):
        cfg = model.config
        x0 = _randn((batch_size, 16, cfg.in_channels), generator)
        cond = {"encoder_hidden_states": _randn((batch_size, 4, cfg.joint_attention_dim), generator)}
        return x0, cond

    # -- the pipeline: QwenImagePipeline (Qwen2.5-VL with its template; latents normalised by the VAE's
    # per-channel mean and std, packed 2x2 into tokens; text of variable length with a mask)

    pipeline_classes = ("QwenImagePipeline",)
    text_encoders = ("text_encoder",)
    max_text_tokens = 1024
    ragged_cond: ClassVar[dict[str, str]] = {"encoder_hidden_states": "encoder_hidden_states_mask"}

    def encode_prompts(self, pipe, prompts, *, max_sequence_length):
        embeds, mask = pipe.encode_prompt(prompt=prompts, **_max_length(max_sequence_length))
        if mask is None:  # the pipeline drops a mask with no padding in it: every token is real
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return {"encoder_hidden_states": embeds, "encoder_hidden_states_mask": mask}

    def latent_shape(self, vae_config, transformer_config, height, width, num_frames):
        _no_frames("qwen_image", num_frames)
        factor = 2 ** len(vae_config["temperal_downsample"])
        _check_size("qwen_image", height, width, factor * 2, square=True)
        return ((height // factor // 2) * (width // factor // 2), int(vae_config["z_dim"]) * 4)

    def encode_images(self, vae, pixels):
        from diffusers import QwenImagePipeline

        latents = vae.encode(pixels[:, :, None]).latent_dist.mode()  # one frame: (B, z, 1, h, w)
        mean, std = _mean_std(vae, latents)
        latents = (latents - mean) / std
        return QwenImagePipeline._pack_latents(
            latents, latents.shape[0], latents.shape[1], *latents.shape[3:]
        )

    def decode_latents(self, vae, latents, height, width):
        from diffusers import QwenImagePipeline

        latents = QwenImagePipeline._unpack_latents(latents, height, width, 2 ** len(vae.temperal_downsample))
        mean, std = _mean_std(vae, latents)
        return vae.decode(latents * std + mean, return_dict=False)[0][:, :, 0]


@register_adapter("wan")
class WanAdapter(DistributionMatchingModelAdapter):
    """Wan 2.x video DiT: latents (B, C, F, H, W); timestep = 1000 * sigma."""

    model_class = WanTransformer3DModel
    tiny_config: ClassVar[dict] = {
        "patch_size": [1, 2, 2], "num_attention_heads": 2, "attention_head_dim": 8, "in_channels": 4,
        "out_channels": 4, "text_dim": 16, "freq_dim": 16, "ffn_dim": 16, "num_layers": 2, "rope_max_seq_len": 32,
    }  # fmt: skip

    def fsdp_units(self, model: nn.Module) -> Sequence[nn.Module]:
        return list(model.blocks)

    def predict(self, model, x_t, sigma, cond: Mapping[str, torch.Tensor]):
        return model(
            hidden_states=x_t,
            timestep=sigma * 1000.0,
            encoder_hidden_states=cond["encoder_hidden_states"],
            return_dict=False,
        )[0]

    def example_batch(self, model, batch_size, generator):
        cfg = model.config
        x0 = _randn((batch_size, cfg.in_channels, 2, 8, 8), generator)
        cond = {"encoder_hidden_states": _randn((batch_size, 4, cfg.text_dim), generator)}
        return x0, cond

    # -- the pipeline: WanPipeline (UMT5; video latents normalised by the VAE's per-channel mean and std)

    pipeline_classes = ("WanPipeline",)
    text_encoders = ("text_encoder",)

    def encode_prompts(self, pipe, prompts, *, max_sequence_length):
        embeds, _ = pipe.encode_prompt(
            prompt=prompts, do_classifier_free_guidance=False, **_max_length(max_sequence_length)
        )
        return {"encoder_hidden_states": embeds}

    def latent_shape(self, vae_config, transformer_config, height, width, num_frames):
        temporal, spatial = int(vae_config["scale_factor_temporal"]), int(vae_config["scale_factor_spatial"])
        if num_frames is None or num_frames < 1 or (num_frames - 1) % temporal:
            raise ValueError(f"config key 'prepare.num_frames' = {num_frames}: the wan pipeline makes videos of "
                             f"{temporal} x k + 1 frames; fix: e.g. prepare.num_frames=81")  # fmt: skip
        patch = transformer_config.get("patch_size", (1, 2, 2))
        _check_size("wan", height, width, spatial * int(patch[-1]))
        return (
            int(vae_config["z_dim"]),
            (num_frames - 1) // temporal + 1,
            height // spatial,
            width // spatial,
        )

    def encode_images(self, vae, pixels):
        latents = vae.encode(pixels).latent_dist.mode()
        mean, std = _mean_std(vae, latents)
        return (latents - mean) / std

    def decode_latents(self, vae, latents, height, width):
        mean, std = _mean_std(vae, latents)
        return vae.decode(latents * std + mean, return_dict=False)[0]


def set_label_dropout(model: nn.Module, probability: float) -> None:
    """Set the label-dropout probability of every label embedder of a DiT (each block has its own)."""
    from diffusers.models.embeddings import LabelEmbedding

    embedders = [m for m in model.modules() if isinstance(m, LabelEmbedding)]
    if not embedders:
        raise ValueError(f"{type(model).__name__} has no label embedder: not a class-conditional DiT")
    for embedder in embedders:
        embedder.dropout_prob = probability


@register_adapter("dit")
class DiTAdapter(DistributionMatchingModelAdapter):
    """Class-conditional DiT trained as a flow-matching velocity model: latents (B, C, H, W),
    timestep = 1000 * sigma, ``cond["class_labels"]`` (B,) long; the null class for
    classifier-free guidance is ``num_embeds_ada_norm`` (the extra row of the label table).
    """

    model_class = DiTTransformer2DModel
    tiny_config: ClassVar[dict] = {
        "sample_size": 8, "patch_size": 2, "in_channels": 1, "out_channels": 1, "num_layers": 2,
        "num_attention_heads": 2, "attention_head_dim": 8, "num_embeds_ada_norm": 10,
        "norm_type": "ada_norm_zero",
    }  # fmt: skip

    def build_model(self, source: ModelSource) -> nn.Module:
        """As the base, with DiT's label dropout off: distillation conditions every forward explicitly.

        diffusers' DiT drops 10% of class labels to the null class in train mode, drawing
        from torch's global RNG. In a distillation that would give a trainable role
        unconditional inputs it never asked for and make training depend on the global
        RNG; a script that trains a DiT teacher for CFG re-enables it (see
        scripts/train_digits_teacher.py).
        """
        model = super().build_model(source)
        set_label_dropout(model, 0.0)
        return model

    def fsdp_units(self, model: nn.Module) -> Sequence[nn.Module]:
        # DiT's forward reads transformer_blocks[0].norm1.emb outside block 0; a block sharded as
        # its own unit would then mix plain tensors and DTensors (TRAPS). Block 0 stays in the root.
        return list(model.transformer_blocks)[1:]

    def predict(self, model, x_t, sigma, cond: Mapping[str, torch.Tensor]):
        return model(
            hidden_states=x_t, timestep=sigma * 1000.0, class_labels=cond["class_labels"], return_dict=False
        )[0]

    def null_class(self, model: nn.Module) -> int:
        """The extra row of the label table (``num_embeds_ada_norm``)."""
        return int(model.config.num_embeds_ada_norm)

    def example_batch(self, model, batch_size, generator):
        cfg = model.config
        x0 = _randn((batch_size, cfg.in_channels, cfg.sample_size, cfg.sample_size), generator)
        labels = torch.randint(cfg.num_embeds_ada_norm, (batch_size,), generator=generator)
        return x0, {"class_labels": labels}
