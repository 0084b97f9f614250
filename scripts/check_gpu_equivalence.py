"""bf16 LoRA gradients of each family's transformer against a float32 reference, per attention kernel.

For each family, a transformer with the released block shapes (head dim 128 for Flux, Qwen-Image and
Wan; 64 for SD3) and few blocks (`--layers`) gets a LoRA adapter on the family's default targets (both
factors random, so every LoRA gradient is non-zero), and one flow-matching loss on a batch of `--tokens`
latent tokens and `--text` text tokens. Its LoRA gradients are taken:

- reference: float32 weights and inputs, TF32 off, the math attention kernel (no fused kernel);
- bf16: the weights rounded to bf16 and every floating input cast at the model's forward, as FSDP2's
  mixed precision casts a root module's floating inputs to its param dtype (the timestep too: the
  engine before ba7b92c), the loss and gradients read back in float32, once per
  scaled-dot-product-attention kernel: torch's default choice and each kernel the device allows
  (flash, efficient, cudnn, math); and again with the timestep and guidance kept in float32, as
  diffusers' pipelines call a bf16 transformer and the engine now does ("bfloat16+fp32-time");
- float32 with the default kernel (TF32 off): a check of the fused kernels themselves in float32.

A model that rounds its level to its own dtype itself (Flux, Qwen-Image: probed) is judged against the
float32 model fed the rounded level; one that also scales it by 1000 in its own dtype before its time
embedder (Flux: a bf16 product, probed) against the float32 model fed those rounded products too. Both
are the bf16 model as served, not errors of the engine; the report keeps the figure against the exact
level beside them. The attention op alone is checked first, per kernel, with a contiguous and with a
sliced output gradient.

Tolerance, fixed before any run: bf16 keeps 8 significant bits (unit roundoff u = 2^-8 = 3.9e-3). A
gradient after a few blocks of bf16 matmuls (inner dimensions 3072-18944, accumulated in float32 by the
kernels) and a bf16 attention carries relative errors of a few u; the bound is 0.05 = 13 u on the
relative L2 error ||g - g_ref|| / ||g_ref|| of the LoRA gradients taken together, and 10 u (0.039) on
the worst single tensor would be too tight for tensors near zero, so the worst tensor is reported, not
bounded. The failure this looks for is the one seen at head dim 8 on the H200 (LoRA gradients ~150 times
too large from the default SDPA backward: a relative error of ~150). float32 fused kernels against the
math kernel: 1e-3 (TF32 is off; the fused kernels reorder sums).

    python scripts/check_gpu_equivalence.py --json out.json                    # all four families, CUDA
    python scripts/check_gpu_equivalence.py --device cpu --tiny --json out.json  # the same checks, tiny
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_offload import code_version

BF16_BOUND = 0.05
FP32_BOUND = 1e-3
# cuDNN last, then torch's own choice (cuDNN on an H200): on Flux its backward ended a run with an illegal
# memory access, which no later check in the process survives.
KERNELS = ("flash", "efficient", "math", "cudnn", "default")
# The inputs diffusers' pipelines hand a bf16 transformer in float32 (its embeddings compute in float32
# and cast after): "bfloat16+fp32-time" keeps them, as the engine does since ba7b92c
# (adapter.full_precision_inputs); "bfloat16" casts them, as FSDP2's own input cast did before.
FULL_PRECISION_INPUTS = ("timestep", "guidance")
# The transformers' time embedders (the first of these a model has): where a model that rounds its level
# hands on level x 1000 (Flux: `timestep.to(hidden_states.dtype) * 1000`, a product rounded in bf16).
EMBEDDERS = ("time_text_embed", "condition_embedder")


def time_embedder(model):
    for name in EMBEDDERS:
        if hasattr(model, name):
            return getattr(model, name)
    return None


def _per_sample(value) -> bool:
    """The embedder's per-sample level and guidance (1-d floats), not its pooled text or hidden states."""
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.ndim == 1


def transformer_config(family: str, layers: int, tiny: bool) -> dict:
    from verl_dmd.adapters import get_adapter
    from verl_dmd.testing.pipelines import FULL_CONFIGS

    if tiny:
        return dict(get_adapter(family).tiny_config)
    config = dict(FULL_CONFIGS[family]["transformer"])
    if family == "flux":
        config["num_single_layers"] = max(1, layers)
        config["num_layers"] = max(1, layers // 2)
        config["guidance_embeds"] = True
    else:
        config["num_layers"] = layers
    return config


def make_inputs(family: str, model, batch: int, tokens: int, text: int, generator) -> tuple:
    """(x0, noise, sigma, cond) in float32 on the CPU, laid out as the family's adapter takes them."""
    cfg = model.config

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    side = round(tokens**0.5)
    if family == "sd3":
        x0 = randn(batch, cfg.in_channels, 2 * side, 2 * side)  # 2x2 patches: side^2 tokens
        cond = {"encoder_hidden_states": randn(batch, text, cfg.joint_attention_dim),
                "pooled_projections": randn(batch, cfg.pooled_projection_dim)}  # fmt: skip
    elif family == "flux":
        x0 = randn(batch, side * side, cfg.in_channels)
        cond = {"encoder_hidden_states": randn(batch, text, cfg.joint_attention_dim),
                "pooled_projections": randn(batch, cfg.pooled_projection_dim)}  # fmt: skip
        if cfg.guidance_embeds:
            cond["guidance"] = torch.full((batch,), 3.5)
    elif family == "qwen_image":
        x0 = randn(batch, side * side, cfg.in_channels)
        cond = {"encoder_hidden_states": randn(batch, text, cfg.joint_attention_dim),
                "encoder_hidden_states_mask": torch.ones(batch, text, dtype=torch.long)}  # fmt: skip
    else:  # wan: (B, C, F, H, W) with 1x2x2 patches; 4 latent frames
        frames = 4
        width = max(1, tokens // (frames * side))
        x0 = randn(batch, cfg.in_channels, frames, 2 * side, 2 * width)
        cond = {"encoder_hidden_states": randn(batch, text, cfg.text_dim)}
    noise = randn(*x0.shape)
    sigma = torch.rand(batch, generator=generator) * 0.8 + 0.1
    return x0, noise, sigma, cond


def lora_model(family: str, config: dict, rank: int, device: torch.device):
    from peft import LoraConfig

    from verl_dmd.adapters import get_adapter
    from verl_dmd.runtime import lora

    adapter = get_adapter(family)()
    torch.manual_seed(0)
    model = adapter.model_class.from_config(config).float()
    targets = list(adapter.default_lora_targets)
    lora.add_adapter(model, LoraConfig(r=rank, lora_alpha=rank, target_modules=targets), "student")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.requires_grad_("lora_" in name)
            if "lora_B" in name:  # PEFT starts B at 0: A's gradient would be 0 too
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return adapter, model.to(device)


def model_inputs(inputs, round_time: torch.dtype | None) -> tuple:
    """`inputs` with the level the model is called with (and the FULL_PRECISION_INPUTS in cond) rounded
    through `round_time`: what a transformer that casts its timestep to its own dtype computes with. The
    noisy latent is made from the exact level either way."""
    sigma, cond = inputs[2], inputs[3]
    if round_time is None:
        return sigma, cond
    rounded = {k: v.to(round_time).float() if k in FULL_PRECISION_INPUTS else v for k, v in cond.items()}
    return sigma.to(round_time).float(), rounded


def lora_gradients(adapter, model, inputs, dtype: torch.dtype, device: torch.device, kernel: str,
                   keep: tuple[str, ...] = (), round_time: torch.dtype | None = None,
                   backward: bool = True, round_embedder: torch.dtype | None = None,
                   capture: list | None = None) -> dict:  # fmt: skip
    """The LoRA gradients of one loss. In bf16 the model's floating inputs are cast to bf16 at its forward, as
    FSDP2's mixed precision casts a root module's inputs, except the keyword inputs named in `keep`.
    `round_time`: the model is called with the level and guidance rounded through that dtype (the reference
    of a model that rounds them itself). `round_embedder`: the per-sample floats its time embedder receives
    (level x 1000, guidance x 1000) rounded through that dtype too, as a model that scales them in its own
    dtype computes them; `capture` collects those floats (float32, CPU). backward=False: the prediction only
    (float32, CPU)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    x0, noise, sigma, _ = inputs
    model_sigma, cond = model_inputs(inputs, round_time)
    work = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
    for name, param in work.named_parameters():
        param.requires_grad_("lora_" in name)
        param.grad = None
    s = sigma.to(device).view(-1, *([1] * (x0.ndim - 1)))
    x_t = (1 - s) * x0.to(device) + s * noise.to(device)
    target = noise.to(device) - x0.to(device)
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}  # fmt: skip
    chosen = sdpa_kernel(backends[kernel]) if kernel != "default" else contextlib.nullcontext()
    # the hooks go on last, right before the try that takes them off (the float32 model is shared)
    handle = None
    if dtype != torch.float32:

        def cast(value, name=None):
            if isinstance(value, torch.Tensor) and value.is_floating_point() and name not in keep:
                return value.to(dtype)
            return value

        handle = work.register_forward_pre_hook(
            lambda module, args, kwargs: (
                tuple(cast(a) for a in args),
                {k: cast(v, k) for k, v in kwargs.items()},
            ),
            with_kwargs=True,
        )
    embedder = time_embedder(work)
    if embedder is not None and (round_embedder is not None or capture is not None):

        def at_embedder(module, args, kwargs):
            if capture is not None:
                capture.append(
                    [v.detach().float().cpu() for v in (*args, *kwargs.values()) if _per_sample(v)]
                )
            if round_embedder is None:
                return None

            def rounded(v):
                return v.to(round_embedder).to(v.dtype) if _per_sample(v) else v

            return tuple(rounded(a) for a in args), {k: rounded(v) for k, v in kwargs.items()}

        embedder_handle = embedder.register_forward_pre_hook(at_embedder, with_kwargs=True)
    else:
        embedder_handle = None
    try:
        with chosen, torch.set_grad_enabled(backward):
            v = adapter.predict(work, x_t, model_sigma.to(device), {k: t.to(device) for k, t in cond.items()})
            if not backward:
                return {"prediction": v.detach().float().cpu()}
            loss = (v.float() - target).square().mean()
            loss.backward()
    finally:
        if handle is not None:
            handle.remove()
        if embedder_handle is not None:
            embedder_handle.remove()
    return {n: p.grad.detach().float().cpu() for n, p in work.named_parameters() if "lora_" in n}


def sdpa_ops(heads: int, head_dim: int, seq: int, batch: int, device: torch.device) -> dict:
    """The attention op alone, in the layout diffusers' processors call it ((B, S, H, D) transposed): dq, dk
    and dv of each kernel in bf16 against the float32 math kernel, with the output's gradient (a) contiguous,
    (b) a column slice of a wider tensor, as a Flux single block hands it back (its attention output is
    concatenated with the MLP's before one projection, so the gradient is a strided view)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}  # fmt: skip
    generator = torch.Generator().manual_seed(5)
    width = heads * head_dim
    q, k, v = (torch.randn(batch, seq, heads, head_dim, generator=generator) for _ in range(3))
    upstream = torch.randn(batch, seq, 5 * width, generator=generator)

    def grads(dtype, kernel, pattern):
        leaves = [t.detach().to(device, dtype).requires_grad_() for t in (q, k, v)]
        chosen = sdpa_kernel(backends[kernel]) if kernel != "default" else contextlib.nullcontext()
        with chosen:
            out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves))
        out = out.transpose(1, 2).flatten(2)
        if pattern == "contiguous":
            (out.float() * upstream[..., :width].to(device)).sum().backward()
        else:
            joined = torch.cat([out, torch.zeros(batch, seq, 4 * width, device=device, dtype=dtype)], dim=2)
            (joined.float() * upstream.to(device)).sum().backward()
        return {name: t.grad.float().cpu() for name, t in zip(("dq", "dk", "dv"), leaves, strict=True)}

    out = {}
    for pattern in ("contiguous", "sliced"):
        want = grads(torch.float32, "math", pattern)
        for kernel in KERNELS if device.type == "cuda" else ("default", "math"):
            try:
                got = grads(torch.bfloat16, kernel, pattern)
            except RuntimeError as err:
                out[f"{pattern}/{kernel}"] = {"unsupported": str(err).splitlines()[0][:200]}
                continue
            entry = compare(got, want)
            entry["bound"], entry["ok"] = BF16_BOUND, entry["relative_l2"] <= BF16_BOUND
            out[f"{pattern}/{kernel}"] = entry
    return out


def compare(got: dict, want: dict) -> dict:
    num = sum(float((got[k] - want[k]).square().sum()) for k in want)
    den = sum(float(want[k].square().sum()) for k in want)
    worst = max(want, key=lambda k: float((got[k] - want[k]).norm() / (want[k].norm() + 1e-30)))
    return {"relative_l2": (num / den) ** 0.5 if den else float("inf"),
            "worst_tensor": worst, "worst_relative_l2": float((got[worst] - want[worst]).norm() / want[worst].norm()),
            "norm_ratio": (sum(float(got[k].square().sum()) for k in want) / den) ** 0.5 if den else float("inf")}  # fmt: skip


def check_family(family: str, args, device: torch.device) -> dict:
    config = transformer_config(family, args.layers, args.tiny)
    adapter, model = lora_model(family, config, args.rank, device)
    inputs = make_inputs(family, model, args.batch, args.tokens, args.text, torch.Generator().manual_seed(2))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    reference = lora_gradients(adapter, model, inputs, torch.float32, device, "math")
    # Does the transformer round its timestep (and guidance) to its own dtype itself (Flux and Qwen-Image:
    # `timestep.to(hidden_states.dtype)`)? Then bf16 rounding of the level is the model's definition in bf16,
    # as served, not an error of the engine, and the like-for-like reference is the float32 model called with
    # the rounded level. Probed, not assumed: the bf16 prediction from the exact level (kept float32 up to the
    # model) equals the one from the rounded level bit for bit.
    probe = [lora_gradients(adapter, model, inputs, torch.bfloat16, device, "math", FULL_PRECISION_INPUTS,
                            round_time=r, backward=False)["prediction"] for r in (None, torch.bfloat16)]  # fmt: skip
    rounds_time = bool(torch.equal(probe[0], probe[1]))
    # A model that rounds its level may also scale it in its own dtype before its time embedder (Flux:
    # level x 1000 in bf16, where neighbouring values lie 2 apart near 300 and 16 apart near 3500: guidance
    # 3.5 reaches the embedder as 3504). Probed: the per-sample floats the bf16 model's embedder receives equal
    # the float32 model's (fed the rounded level) rounded to bf16, and differ from them unrounded.
    scaled_in_dtype = False
    if rounds_time:
        seen_bf16, seen_fp32 = [], []
        lora_gradients(adapter, model, inputs, torch.bfloat16, device, "math", FULL_PRECISION_INPUTS,
                       round_time=torch.bfloat16, backward=False, capture=seen_bf16)  # fmt: skip
        lora_gradients(adapter, model, inputs, torch.float32, device, "math", round_time=torch.bfloat16,
                       backward=False, capture=seen_fp32)  # fmt: skip
        if seen_bf16 and seen_fp32 and len(seen_bf16[0]) == len(seen_fp32[0]) > 0:
            pairs = list(zip(seen_bf16[0], seen_fp32[0], strict=True))
            scaled_in_dtype = all(torch.equal(b, f.to(torch.bfloat16).float()) for b, f in pairs) and any(
                not torch.equal(b, f) for b, f in pairs
            )
    like, like_name = reference, None
    if rounds_time:
        like = lora_gradients(adapter, model, inputs, torch.float32, device, "math", round_time=torch.bfloat16,
                              round_embedder=torch.bfloat16 if scaled_in_dtype else None)  # fmt: skip
        like_name = "float32 with the level rounded to bf16, as the model rounds it" + (
            ", and level x 1000 and guidance x 1000 rounded to bf16 at the time embedder, as the model scales them"
            if scaled_in_dtype
            else ""
        )
    head_dim = config.get("attention_head_dim")
    result = {"family": family, "config": config, "head_dim": head_dim, "tokens": args.tokens, "text": args.text,
              "batch": args.batch, "rank": args.rank, "lora_tensors": len(reference), "checks": {},
              "model_rounds_time": rounds_time, "model_scales_time_in_its_dtype": scaled_in_dtype}  # fmt: skip
    heads = config.get("num_attention_heads")
    if heads and head_dim:  # the op alone first (a kernel that faults ends the process)
        result["sdpa_ops"] = sdpa_ops(heads, head_dim, args.tokens + args.text, args.batch, device)
    kernels = KERNELS if device.type == "cuda" else ("default", "math")
    variants = [("bfloat16", torch.bfloat16, BF16_BOUND, ()), ("bfloat16+fp32-time", torch.bfloat16, BF16_BOUND,
                FULL_PRECISION_INPUTS), ("float32", torch.float32, FP32_BOUND, ())]  # fmt: skip
    for kernel in kernels:
        for label, dtype, bound, keep in variants:
            if dtype == torch.float32 and kernel == "math":
                continue  # the reference itself
            name = f"{label}/{kernel}"
            try:
                got = lora_gradients(adapter, model, inputs, dtype, device, kernel, keep)
            except RuntimeError as err:  # a kernel the device or the shape does not support
                result["checks"][name] = {"unsupported": str(err).splitlines()[0][:200]}
                continue
            entry = compare(got, reference)
            if dtype != torch.float32 and rounds_time:
                # judged against the float32 model fed the level this model rounds to; the plain figure kept
                entry = {**compare(got, like), "against_exact_level": compare(got, reference),
                         "reference": like_name}  # fmt: skip
            entry["bound"], entry["ok"] = bound, entry["relative_l2"] <= bound
            result["checks"][name] = entry
    result["ok"] = all(c.get("ok", True) for c in result["checks"].values())
    # What the engine runs: the timestep and guidance handed over in float32, and on CUDA not the kernels the
    # adapter excludes (torch's "default" here may pick cuDNN, which the engine switches off for such a family).
    excluded = set(adapter.excluded_attention_kernels) if device.type == "cuda" else set()
    if excluded:
        excluded.add("default")
    engine = {name: c for name, c in result["checks"].items()
              if name.startswith("bfloat16+fp32-time/") and name.split("/")[1] not in excluded}  # fmt: skip
    result["engine_checks"] = sorted(engine)
    result["engine_ok"] = bool(engine) and all(c.get("ok", True) for c in engine.values())
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=["sd3", "flux", "qwen_image", "wan"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="the adapters' tiny configs (a CPU smoke run)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024, help="latent tokens per sample")
    parser.add_argument("--text", type=int, default=128, help="text tokens per sample")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device (or use --device cpu --tiny)")
    device = torch.device(args.device)
    results = []

    def write() -> None:
        if args.json:
            args.json.write_text(json.dumps({"code": code_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                                             "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                                             "torch": torch.__version__, "bf16_bound": BF16_BOUND,
                                             "fp32_bound": FP32_BOUND, "results": results}, indent=1) + "\n")  # fmt: skip

    for family in args.families:
        result = check_family(family, args, device)
        results.append(result)
        write()  # after each family: what a later fault ends is kept
        print(f"{family} (head dim {result['head_dim']}): " + "; ".join(
            f"{name} {c['relative_l2']:.2e}{'' if c['ok'] else ' FAIL'}" if "relative_l2" in c else f"{name} n/a"
            for name, c in result["checks"].items()), flush=True)  # fmt: skip
        print(f"  {family} rounds its timestep itself: {result['model_rounds_time']}, scales it in its dtype: "
              f"{result['model_scales_time_in_its_dtype']}; the attention op alone: "
              + "; ".join(f"{name} {c['relative_l2']:.2e}{'' if c['ok'] else ' FAIL'}" if "relative_l2" in c
                          else f"{name} n/a" for name, c in result.get("sdpa_ops", {}).items()), flush=True)  # fmt: skip
    print("as the engine runs each family (bf16, float32 timestep, its kernels): "
          + ", ".join(f"{r['family']} {'ok' if r['engine_ok'] else 'FAIL'}" for r in results), flush=True)  # fmt: skip
    return 0 if all(r["engine_ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
