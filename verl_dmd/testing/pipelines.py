"""Build small but real diffusers pipeline directories offline, one per model family, with random weights.

Each directory holds the components the family's released pipeline ships (text encoders,
tokenizers, VAE, scheduler, transformer), of the same classes but at most a few hundred thousand
parameters each, sized so that the whole pipeline runs: prompt encoding, denoising and decoding.
Nothing is downloaded: the tokenizers are vocabularies of a few hundred entries built here, and
any UTF-8 prompt tokenizes (byte-level BPE for CLIP and Qwen; T5's unigram maps characters it
lacks to <unk>, as the released T5 tokenizers do).

    path = build_pipeline("flux", tmp_path / "flux")
    pipe = DiffusionPipeline.from_pretrained(path, local_files_only=True)
    height, width = TINY_RESOLUTION["flux"]
    image = pipe(prompt="a red cat", height=height, width=width, num_inference_steps=2).images[0]
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

FAMILIES = ("sd3", "flux", "qwen_image", "wan")

# Every VAE here compresses 8x spatially, as the released ones do, and every transformer works on
# 2x2 latent patches, so 16 is the smallest side a pipeline accepts; 32 gives a 2x2 token grid, the
# smallest on which token positions differ along both axes.
TINY_RESOLUTION = {"sd3": (32, 32), "flux": (32, 32), "qwen_image": (32, 32), "wan": (32, 32)}
# Wan's VAE keeps the first frame and compresses the rest 4x in time: 5 frames are 2 latent frames.
TINY_FRAMES = {"wan": 5}

# ---- SD3: StableDiffusion3Pipeline ----------------------------------------------------------------
# Two CLIP text encoders with projection (CLIP-L, CLIP-G) and a T5 encoder, as SD3 / SD3.5.
# 77 positions: the pipeline pads CLIP prompts to the tokenizer's 77.
_SD3_CLIP_L = {
    "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
    "max_position_embeddings": 77, "projection_dim": 8,
}  # fmt: skip
_SD3_CLIP_G = {
    "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
    "max_position_embeddings": 77, "projection_dim": 16,
}  # fmt: skip
# The pipeline concatenates both CLIPs' hidden states and zero-pads them to T5's width: d_model >= 8 + 16.
_SD3_T5 = {
    "d_model": 32, "d_kv": 8, "d_ff": 32, "num_layers": 1, "num_heads": 2, "relative_attention_num_buckets": 8,
    "feed_forward_proj": "gated-gelu",
}  # fmt: skip
# 4 levels (3 downsamplings) compress 8x like SD3's VAE; 16 latent channels as SD3's.
_SD3_VAE = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 16, "block_out_channels": [8, 8, 8, 8],
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "layers_per_block": 1, "norm_num_groups": 4, "sample_size": 32, "scaling_factor": 1.5305,
    "shift_factor": 0.0609, "use_quant_conv": False, "use_post_quant_conv": False,
}  # fmt: skip
_SD3_TRANSFORMER = {
    # The pipeline's default height is sample_size * 8: the tiny resolution.
    "sample_size": TINY_RESOLUTION["sd3"][0] // 8,
    "patch_size": 2,
    "in_channels": _SD3_VAE["latent_channels"],
    "out_channels": _SD3_VAE["latent_channels"],
    "num_layers": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 2,
    # Text tokens are T5 states and zero-padded CLIP states, all T5-wide.
    "joint_attention_dim": _SD3_T5["d_model"],
    # SD3 projects captions to its inner width (heads * head dim).
    "caption_projection_dim": 16,
    # The pooled embedding is both CLIPs' projected embeddings concatenated.
    "pooled_projection_dim": _SD3_CLIP_L["projection_dim"] + _SD3_CLIP_G["projection_dim"],
    # In patches per side: latents up to 16x16 (images up to 128x128).
    "pos_embed_max_size": 8,
}
_SD3_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0}

# ---- Flux: FluxPipeline ---------------------------------------------------------------------------
# A CLIP text encoder (pooled embedding only) and a T5 encoder (token embeddings), as FLUX.1.
_FLUX_CLIP = {
    "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
    "max_position_embeddings": 77,
}  # fmt: skip
_FLUX_T5 = {
    "d_model": 24, "d_kv": 8, "d_ff": 32, "num_layers": 1, "num_heads": 2, "relative_attention_num_buckets": 8,
    "feed_forward_proj": "gated-gelu",
}  # fmt: skip
_FLUX_VAE = {**_SD3_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159}
_FLUX_TRANSFORMER = {
    "patch_size": 1,
    # The pipeline packs 2x2 latent patches into tokens: 4 * the VAE's latent channels.
    "in_channels": 4 * _FLUX_VAE["latent_channels"],
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 8,
    "num_attention_heads": 2,
    "joint_attention_dim": _FLUX_T5["d_model"],
    # The pooled embedding is CLIPTextModel's pooler output: its hidden size.
    "pooled_projection_dim": _FLUX_CLIP["hidden_size"],
    # Rotary embedding over (text index, row, column): the parts sum to the head dim.
    "axes_dims_rope": [2, 2, 4],
}
# As FLUX.1-dev ships it: the shift grows with the image's token count.
_FLUX_SCHEDULER = {
    "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
    "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096,
}  # fmt: skip

# ---- Qwen-Image: QwenImagePipeline ----------------------------------------------------------------
# Qwen2.5-VL's language model encodes the prompt; its vision tower is unused by text-to-image but part
# of the class. head_dim = 24 / 3 = 8; multimodal rotary sections (time, row, column) sum to head_dim / 2.
_QWEN_TEXT = {
    "hidden_size": 24, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 3,
    "num_key_value_heads": 1, "max_position_embeddings": 2048, "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]},
}  # fmt: skip
# The merger projects image features into the language model: out_hidden_size = its hidden size.
_QWEN_VISION = {
    "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
    "out_hidden_size": _QWEN_TEXT["hidden_size"], "fullatt_block_indexes": [0],
}  # fmt: skip
# 4 levels compress 8x (the pipeline reads 2 ** len(temperal_downsample)); 16 latent channels, the
# length of the default latents_mean / latents_std.
_QWEN_VAE = {
    "base_dim": 4, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 1,
    "temperal_downsample": [False, True, True],
}  # fmt: skip
_QWEN_TRANSFORMER = {
    "patch_size": 2,
    # The pipeline packs 2x2 latent patches into tokens: 4 * z_dim in, z_dim per patch pixel out.
    "in_channels": 4 * _QWEN_VAE["z_dim"],
    "out_channels": _QWEN_VAE["z_dim"],
    "num_layers": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 2,
    "joint_attention_dim": _QWEN_TEXT["hidden_size"],
    # Rotary embedding over (frame, row, column): the parts sum to the head dim.
    "axes_dims_rope": [2, 2, 4],
}
# As Qwen-Image ships it.
_QWEN_SCHEDULER = {
    "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5,
    "max_shift": 0.9, "base_image_seq_len": 256, "max_image_seq_len": 8192, "shift_terminal": 0.02,
    "time_shift_type": "exponential",
}  # fmt: skip

# ---- Wan 2.1 text-to-video: WanPipeline ----------------------------------------------------------
_WAN_UMT5 = {
    "d_model": 24, "d_kv": 8, "d_ff": 32, "num_layers": 1, "num_heads": 2, "relative_attention_num_buckets": 8,
    "feed_forward_proj": "gated-gelu",
}  # fmt: skip
# 4 levels: 8x in space, 4x in time (two temporal downsamplings); z_dim 16, the length of the default
# latents_mean / latents_std. The pipeline reads the compression from scale_factor_*.
_WAN_VAE = {
    "base_dim": 4, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 1,
    "temperal_downsample": [False, True, True], "scale_factor_temporal": 4, "scale_factor_spatial": 8,
}  # fmt: skip
_WAN_TRANSFORMER = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 2,
    # Wan splits the rotary head dim into frame / row / column parts itself.
    "attention_head_dim": 8,
    "in_channels": _WAN_VAE["z_dim"],
    "out_channels": _WAN_VAE["z_dim"],
    "text_dim": _WAN_UMT5["d_model"],
    "freq_dim": 16,
    "ffn_dim": 32,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 32,
}
# As the diffusers conversion of Wan 2.1 text-to-video ships it: UniPC on flow sigmas, shift 3.
_WAN_SCHEDULER = {
    "num_train_timesteps": 1000, "prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0,
}  # fmt: skip

# ---- Tokenizers ----------------------------------------------------------------------------------
# Words the tokenizers learn whole; anything else falls back to bytes (BPE) or characters (T5).
_PROMPT_WORDS = ("a", "an", "the", "of", "in", "on", "with", "photo", "red", "blue", "cat", "dog")
# Qwen-Image's prompt template (diffusers' QwenImagePipeline). The pipeline drops the first 34 tokens of
# every encoded prompt: Qwen's tokenizer makes 34 of the part before "{}", one per word, special token,
# punctuation mark and newline, so the BPE below learns each of the template's words whole.
_QWEN_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
# Qwen2.5's special tokens in its own order; the Qwen2.5-VL config refers to the vision ones by id.
_QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip
# CLIP pipelines pad and truncate to 77; T5 prompts are tokenized to an explicit max_sequence_length.
_CLIP_MAX_LENGTH = 77
_T5_MAX_LENGTH = 512
_QWEN_MAX_LENGTH = 32768


# ---- Full size ---------------------------------------------------------------------------------------
# The released architectures' shapes (random weights): SD3-medium (2B MMDiT, CLIP-L, CLIP-G, T5-XXL),
# FLUX.1-dev (12B, CLIP-L, T5-XXL), Qwen-Image (20B MMDiT, Qwen2.5-VL-7B), Wan 2.1 T2V 1.3B (umT5-XXL).
# The tokenizers stay the small ones built here; the text encoders keep the released vocabulary sizes
# (ids past the small tokenizer's are never used), so every component has its released parameter count.
_FULL_CLIP_L = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
    "max_position_embeddings": 77, "projection_dim": 768, "hidden_act": "quick_gelu", "vocab_size": 49408,
}  # fmt: skip
_FULL_CLIP_G = {
    "hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 20,
    "max_position_embeddings": 77, "projection_dim": 1280, "hidden_act": "gelu", "vocab_size": 49408,
}  # fmt: skip
_FULL_T5_XXL = {
    "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
    "relative_attention_num_buckets": 32, "feed_forward_proj": "gated-gelu", "vocab_size": 32128,
}  # fmt: skip
_FULL_KL_VAE = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 16, "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "layers_per_block": 2, "norm_num_groups": 32, "sample_size": 1024, "use_quant_conv": False,
    "use_post_quant_conv": False,
}  # fmt: skip
_FULL_WAN_VAE = {
    "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
    "temperal_downsample": [False, True, True],
}  # fmt: skip
_FULL_QWEN_TEXT = {
    "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
    "num_key_value_heads": 4, "max_position_embeddings": 128000, "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 152064,
}  # fmt: skip
_FULL_QWEN_VISION = {
    "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 3584,
    "fullatt_block_indexes": [7, 15, 23, 31],
}  # fmt: skip
FULL_CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    "sd3": {
        "transformer": {
            "sample_size": 128, "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 24,
            "attention_head_dim": 64, "num_attention_heads": 24, "joint_attention_dim": 4096,
            "caption_projection_dim": 1536, "pooled_projection_dim": 2048, "pos_embed_max_size": 192,
        },
        "vae": {**_FULL_KL_VAE, "scaling_factor": 1.5305, "shift_factor": 0.0609},
        "clip_l": _FULL_CLIP_L, "clip_g": _FULL_CLIP_G, "t5": _FULL_T5_XXL,
    },
    "flux": {
        "transformer": {
            "patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38,
            "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
            "pooled_projection_dim": 768, "axes_dims_rope": [16, 56, 56],
        },
        "vae": {**_FULL_KL_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159},
        "clip_l": {k: v for k, v in _FULL_CLIP_L.items() if k != "projection_dim"}, "t5": _FULL_T5_XXL,
    },
    "qwen_image": {
        "transformer": {
            "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
            "num_attention_heads": 24, "joint_attention_dim": 3584, "axes_dims_rope": [16, 56, 56],
        },
        "vae": _FULL_WAN_VAE, "text": _FULL_QWEN_TEXT, "vision": _FULL_QWEN_VISION,
    },
    "wan": {
        "transformer": {
            "patch_size": [1, 2, 2], "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16,
            "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30,
            "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 1024,
        },
        "vae": {**_FULL_WAN_VAE, "scale_factor_temporal": 4, "scale_factor_spatial": 8},
        "t5": {**_FULL_T5_XXL, "vocab_size": 256384},
    },
}  # fmt: skip
TINY_CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    "sd3": {"transformer": _SD3_TRANSFORMER, "vae": _SD3_VAE, "clip_l": _SD3_CLIP_L, "clip_g": _SD3_CLIP_G,
            "t5": _SD3_T5},
    "flux": {"transformer": _FLUX_TRANSFORMER, "vae": _FLUX_VAE, "clip_l": _FLUX_CLIP, "t5": _FLUX_T5},
    "qwen_image": {"transformer": _QWEN_TRANSFORMER, "vae": _QWEN_VAE, "text": _QWEN_TEXT, "vision": _QWEN_VISION},
    "wan": {"transformer": _WAN_TRANSFORMER, "vae": _WAN_VAE, "t5": _WAN_UMT5},
}  # fmt: skip


def build_pipeline(
    family: str,
    directory: str | Path,
    *,
    seed: int = 0,
    guidance_embeds: bool = False,
    size: str = "tiny",
    layers: int | None = None,
    device: str = "cpu",
) -> Path:
    """Write a `family` pipeline, random weights drawn from `seed`, to `directory` and return it.

    `size` "tiny" (the default: each component a few hundred thousand parameters, built in seconds on a
    CPU) or "full" (the released architectures' shapes, `FULL_CONFIGS`: billions of parameters, saved in
    bfloat16 except the VAE; build with device="cuda" where there is one). `layers` replaces the
    transformer's block count (Flux: its double blocks, the single blocks scaled alike), for a full-size
    family that does not fit a machine. `guidance_embeds` (flux only) gives a FLUX.1-dev-like transformer
    that takes a guidance scale; without it, a FLUX.1-schnell-like one. The same arguments give
    byte-identical weight files on one device.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown pipeline family {family!r}; allowed: {', '.join(FAMILIES)}")
    if guidance_embeds and family != "flux":
        raise ValueError(f"guidance_embeds applies to flux only, not {family!r}")
    if size not in ("tiny", "full"):
        raise ValueError(f"pipeline size {size!r}: allowed tiny or full")
    if layers is not None and layers < 1:
        raise ValueError(f"layers {layers!r}: at least 1")
    import torch

    directory = Path(directory)
    configs = {k: dict(v) for k, v in (FULL_CONFIGS if size == "full" else TINY_CONFIGS)[family].items()}
    if layers is not None:
        transformer = configs["transformer"]
        if family == "flux":
            transformer["num_single_layers"] = max(
                1, round(layers * transformer["num_single_layers"] / transformer["num_layers"])
            )
        transformer["num_layers"] = layers
    # Modules draw their initial weights from torch's global RNG; forking it keeps the caller's stream
    # untouched, and seeding it makes every build of this family and seed identical.
    with torch.random.fork_rng(devices=[torch.device(device)] if device != "cpu" else []):
        torch.manual_seed(seed)
        with torch.device(device):
            if family == "sd3":
                pipe = _sd3(configs)
            elif family == "flux":
                pipe = _flux(configs, guidance_embeds)
            elif family == "qwen_image":
                pipe = _qwen_image(configs)
            else:
                pipe = _wan(configs)
    if size == "full":  # as the released pipelines ship: bf16 weights, the VAE in float32
        for name, component in pipe.components.items():
            if isinstance(component, torch.nn.Module) and name != "vae":
                component.to(torch.bfloat16)
    pipe.save_pretrained(directory, safe_serialization=True)
    return directory


def _sd3(c: dict[str, dict[str, Any]]):
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection

    tokenizer, tokenizer_2, tokenizer_3 = _clip_tokenizer(), _clip_tokenizer(), _t5_tokenizer()
    return StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(**c["transformer"]),
        scheduler=FlowMatchEulerDiscreteScheduler(**_SD3_SCHEDULER),
        vae=AutoencoderKL(**c["vae"]),
        text_encoder=CLIPTextModelWithProjection(_clip_config(c["clip_l"], tokenizer)),
        tokenizer=tokenizer,
        text_encoder_2=CLIPTextModelWithProjection(_clip_config(c["clip_g"], tokenizer_2)),
        tokenizer_2=tokenizer_2,
        text_encoder_3=_t5_encoder(c["t5"], tokenizer_3),
        tokenizer_3=tokenizer_3,
    )


def _flux(c: dict[str, dict[str, Any]], guidance_embeds: bool):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    tokenizer, tokenizer_2 = _clip_tokenizer(), _t5_tokenizer()
    return FluxPipeline(
        transformer=FluxTransformer2DModel(**c["transformer"], guidance_embeds=guidance_embeds),
        scheduler=FlowMatchEulerDiscreteScheduler(**_FLUX_SCHEDULER),
        vae=AutoencoderKL(**c["vae"]),
        text_encoder=CLIPTextModel(_clip_config(c["clip_l"], tokenizer)),
        tokenizer=tokenizer,
        text_encoder_2=_t5_encoder(c["t5"], tokenizer_2),
        tokenizer_2=tokenizer_2,
    )


def _qwen_image(c: dict[str, dict[str, Any]]):
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = _qwen_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config={
            **c["text"],
            "vocab_size": max(len(tokenizer), c["text"].get("vocab_size", 0)),
            "bos_token_id": ids("<|endoftext|>"),
            "eos_token_id": ids("<|im_end|>"),
        },
        vision_config=c["vision"],
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    pipe = QwenImagePipeline(
        transformer=QwenImageTransformer2DModel(**c["transformer"]),
        scheduler=FlowMatchEulerDiscreteScheduler(**_QWEN_SCHEDULER),
        vae=AutoencoderKLQwenImage(**c["vae"]),
        text_encoder=Qwen2_5_VLForConditionalGeneration(config),
        tokenizer=tokenizer,
    )
    # The pipeline slices the template's tokens off by count: a tokenizer that splits the template
    # differently would leave template states in, or cut prompt states off, without any error.
    template_tokens = len(tokenizer(pipe.prompt_template_encode.split("{}")[0]).input_ids)
    if (
        template_tokens != pipe.prompt_template_encode_start_idx
        or pipe.prompt_template_encode != _QWEN_TEMPLATE
    ):
        raise RuntimeError(
            f"qwen_image: the tiny tokenizer makes {template_tokens} tokens of the pipeline's prompt template, "
            f"which drops {pipe.prompt_template_encode_start_idx}; update _QWEN_TEMPLATE to diffusers' template"
        )
    return pipe


def _wan(c: dict[str, dict[str, Any]]):
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = _t5_tokenizer()
    return WanPipeline(
        transformer=WanTransformer3DModel(**c["transformer"]),
        scheduler=UniPCMultistepScheduler(**_WAN_SCHEDULER),
        vae=AutoencoderKLWan(**c["vae"]),
        text_encoder=UMT5EncoderModel(UMT5Config(**_t5_settings(c["t5"], tokenizer))),
        tokenizer=tokenizer,
    )


# ---- Text encoders -------------------------------------------------------------------------------


def _clip_config(config: dict[str, Any], tokenizer: Any) -> Any:
    from transformers import CLIPTextConfig

    # CLIP pools at the end-of-text token, which it finds by id.
    return CLIPTextConfig(
        **{k: v for k, v in config.items() if k != "vocab_size"},
        vocab_size=max(len(tokenizer), config.get("vocab_size", 0)),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _t5_token_ids(tokenizer: Any) -> dict[str, int]:
    return {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "decoder_start_token_id": tokenizer.pad_token_id,
    }


def _t5_settings(config: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """The T5 config's settings with the tokenizer's special ids; the vocabulary at least the tokenizer's."""
    ids = _t5_token_ids(tokenizer)
    ids["vocab_size"] = max(ids["vocab_size"], config.get("vocab_size", 0))
    return {**{k: v for k, v in config.items() if k != "vocab_size"}, **ids}


def _t5_encoder(config: dict[str, Any], tokenizer: Any) -> Any:
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(**_t5_settings(config, tokenizer)))


# ---- Tokenizers ----------------------------------------------------------------------------------
# Each is built by its transformers class from a vocabulary made here, so what is saved is exactly
# what that class reads back (transformers 5 rebuilds the normalizer and pre-tokenizer itself).


def _byte_alphabet() -> list[str]:
    """The 256 characters byte-level BPE writes bytes as: with all of them, any UTF-8 text encodes."""
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


def _as_bytes(text: str) -> str:
    """`text` in byte-level BPE's characters (a space becomes 'Ġ')."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)[0][0]


def _chain_merges(words: list[list[str]]) -> list[tuple[str, str]]:
    """Merges that join each word's symbols left to right into one token (shared prefixes merged once)."""
    merges: dict[tuple[str, str], None] = {}
    for symbols in words:
        joined = symbols[0]
        for symbol in symbols[1:]:
            merges[(joined, symbol)] = None
            joined += symbol
    return list(merges)


def _bpe_vocab(alphabet: list[str], merges: list[tuple[str, str]], specials: list[str]) -> dict[str, int]:
    tokens = [*alphabet, *(left + right for left, right in merges), *specials]
    return {token: index for index, token in enumerate(dict.fromkeys(tokens))}


def _clip_tokenizer() -> Any:
    from transformers import CLIPTokenizer

    # CLIP's BPE marks a word's last symbol with '</w>', so every byte appears plain and word-final.
    suffix = "</w>"
    alphabet = _byte_alphabet()
    alphabet = alphabet + [char + suffix for char in alphabet]
    words = [[*_as_bytes(word)[:-1], _as_bytes(word)[-1] + suffix] for word in _PROMPT_WORDS if len(word) > 1]
    merges = _chain_merges(words)
    vocab = _bpe_vocab(alphabet, merges, ["<|startoftext|>", "<|endoftext|>"])
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=_CLIP_MAX_LENGTH)


def _t5_tokenizer() -> Any:
    from transformers import T5Tokenizer

    # A unigram model over single characters and a few whole words; T5's class fixes <unk> at id 2 and
    # maps characters outside the vocabulary (emoji, most scripts) to it.
    characters = [chr(code) for code in range(0x21, 0x7F)]
    characters += [chr(code) for code in range(0xC0, 0x100) if chr(code).isalpha()]
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -3.0)]
    pieces += [(char, -8.0) for char in characters]
    pieces += [("\u2581" + word, -5.0) for word in _PROMPT_WORDS]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=_T5_MAX_LENGTH)


def _qwen_tokenizer() -> Any:
    from transformers import Qwen2Tokenizer

    alphabet = _byte_alphabet()
    # Qwen's own pre-tokenizer splits the template into the words its BPE must learn whole.
    probe = Qwen2Tokenizer(vocab=_bpe_vocab(alphabet, [], []), merges=[])
    split = probe.backend_tokenizer.pre_tokenizer.pre_tokenize_str
    specials = "|".join(re.escape(token) for token in _QWEN_SPECIAL_TOKENS)
    texts = [text for text in re.split(f"{specials}|{re.escape('{}')}", _QWEN_TEMPLATE) if text]
    texts += [" " + word for word in _PROMPT_WORDS]
    words = [list(piece) for text in texts for piece, _ in split(text) if len(piece) > 1]
    merges = _chain_merges(words)
    return Qwen2Tokenizer(
        vocab=_bpe_vocab(alphabet, merges, list(_QWEN_SPECIAL_TOKENS)),
        merges=merges,
        extra_special_tokens=[token for token in _QWEN_SPECIAL_TOKENS if token != "<|endoftext|>"],
        model_max_length=_QWEN_MAX_LENGTH,
    )
