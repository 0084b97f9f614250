"""DMD2 phase benchmark: wall time, peak memory and model-FLOP utilisation of one model family's training shapes.

One process, one device, no ray. For each layout (``shared_base_adapters``:
LoRA roles on one frozen base; ``independent``: three full copies, the same
LoRA roles on the student and fake-score copies), a transformer of the chosen
family (``--family``; random init, bf16 compute, fp32 trainable shards) runs
DMD2 phases on a batch of that family's training shapes at its recipe's
resolution (recipes/<family>_lora_dmd2.yaml) with the recipe's teacher guidance:

- sd3 (the default): SD3-medium (``--layers``, ``--hidden``), 1024x1024 (latents
  16x128x128), 333 text tokens of width 4096 and pooled 2048, CFG 7;
- flux: FLUX.1-dev (19 double + 38 single blocks, head dim 128, guidance
  embedding), 1024x1024 (4096 packed tokens of 64), 512 T5 tokens of width 4096,
  pooled 768, guidance 3.5, no CFG (teacher_guidance_scale 1: no unconditional pass);
- qwen_image: Qwen-Image (60 layers, head dim 128), 1328x1328 (6889 packed tokens
  of 64), 256 text tokens of width 3584 with their mask, CFG 4;
- wan: Wan 2.1 T2V 1.3B (30 layers, head dim 128), 480x832 and ``--frames`` 81
  (latents 16x21x60x104: 32760 tokens), 512 umT5 tokens of width 4096, CFG 5.

The latent shape is the adapter's own (`latent_shape`, the one the data set is
prepared with); ``uncond.*`` is as long as ``cond.*``. It measures

- wall time of a student phase, a fake-score phase and a full cycle (1 + K phases),
  median over --repeats after --warmup cycles; peak device memory over the timed
  phases;
- the model FLOPs of each phase, counted by torch's FlopCounterMode on one phase
  (compiled blocks forced eager while counting), and the ideal time of those FLOPs
  at the bf16 matmul rate measured in the same run (8192^3 matmuls for 5 s, before
  and after the layouts; the higher sustained rate, at the GPU's power limit):
  MFU = FLOPs / time / rate. MFU against the burst rate (the fastest round, boost
  clocks) and against the datasheet's 989.5 TFLOP/s (H100/H200 dense bf16, what
  FastVideo reports against) is reported beside it;
- the practical ceiling (``--bare``, on by default): the same transformer as a plain
  module in bf16 with one LoRA adapter of the same rank on the same targets,
  compiled per block as the engine compiles, forward + backward of a mean squared
  error on the same batch, no optimizer (the LoRA gradients are dropped): median
  seconds per step over --bare-repeats, its FLOPs and TFLOP/s. Each layout's
  "cycle / bare" is its cycle's TFLOP/s over the bare loop's: what the DMD2 cycle
  keeps of what this model reaches on this device.

    python scripts/bench_phases.py --layouts shared_base_adapters independent --batch 2 --json out.json
    python scripts/bench_phases.py --family flux --layers 12 --batch 2 --compile --keep-gathered --json flux.json

A smoke run without a GPU (gloo, the family's tiny pipeline shapes of
verl_dmd.testing.pipelines, no matmul-rate probe: MFU is null):

    python scripts/bench_phases.py --device cpu --tiny --family wan --repeats 1 --bare-repeats 1 --json wan.json
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_offload import code_version, sd3_config

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("sd3", "flux", "qwen_image", "wan")
FAMILY_NAMES = {"sd3": "SD3", "flux": "FLUX.1-dev", "qwen_image": "Qwen-Image", "wan": "Wan 2.1 T2V 1.3B"}
TEXT_TOKENS = {"sd3": 333, "flux": 512, "qwen_image": 256, "wan": 512}
"""Text tokens per prompt as each family's prepared data set holds them: SD3 77 CLIP + 256 T5 positions (its
pipeline's default max_sequence_length), Flux and Wan their T5 / umT5 length padded to 512, Qwen-Image a
256-token prompt (its data set pads each batch to its longest prompt; a mask marks the real tokens)."""
TINY_TEXT_TOKENS = 6
DATASHEET_BF16_FLOPS = 989.5e12
"""Dense bf16 peak of an H100 / H200 SXM (the datasheet's 1979 TFLOP/s counts 2:4 sparsity): the denominator
FastVideo reports MFU against. The measured sustained matmul rate of the run is the other one."""


@dataclass(frozen=True)
class Workload:
    """One family's transformer and training batch as its recipe trains them: what every layout and the bare
    loop of a run compute."""

    family: str
    tiny: bool
    transformer: dict
    """The transformer's config (random init): FULL_CONFIGS' (sd3: sd3_config) or, with --tiny, TINY_CONFIGS'."""
    height: int
    width: int
    frames: int | None
    latent: tuple[int, ...]
    """One latent as the adapter's `predict` takes it (its `latent_shape`): (C, H, W), (C, F, H, W) or packed
    tokens (N, C)."""
    text_tokens: int
    text_width: int
    pooled_width: int | None
    mask_key: str | None
    """The cond key of the text mask of a family whose prompts differ in length (the adapter's ragged_cond)."""
    constant_cond: dict
    """Conditioning that is the same for every prompt (Flux-dev's guidance embedding, cond.guidance)."""
    guidance_scale: float
    """The recipe's teacher_guidance_scale: other than 1, the teacher also runs on uncond.* (CFG)."""
    sigma_shift: float

    def describe(self) -> str:
        """E.g. "FLUX.1-dev-shaped, 19 double + 38 single blocks x 3072"."""
        config = self.transformer
        width = config["num_attention_heads"] * config["attention_head_dim"]
        blocks = f"{config['num_layers']} layers"
        if "num_single_layers" in config:
            blocks = f"{config['num_layers']} double + {config['num_single_layers']} single blocks"
        return f"{'tiny ' if self.tiny else ''}{FAMILY_NAMES[self.family]}-shaped, {blocks} x {width}"


def recipe_settings(family: str) -> dict:
    """The teacher guidance, shift, resolution and frame count of recipes/<family>_lora_dmd2.yaml."""
    import yaml

    path = ROOT / "recipes" / f"{family}_lora_dmd2.yaml"
    recipe = yaml.safe_load(path.read_text())
    algorithm, prepare = recipe["algorithm"], recipe["prepare"]
    return {
        "guidance_scale": float(algorithm["teacher_guidance_scale"]),
        "sigma_shift": float(algorithm["sigma_shift"]),
        "resolution": tuple(prepare["resolution"]),
        "frames": prepare.get("num_frames"),
    }


def transformer_config(family: str, *, tiny: bool, layers: int | None, hidden: int | None) -> dict:
    """The family's transformer config; `layers` replaces the block count (Flux: its double blocks, the single
    blocks scaled alike, as verl_dmd.testing.pipelines.build_pipeline does). Full-size SD3 keeps this script's
    own --layers / --hidden shape (bench_offload.sd3_config)."""
    from verl_dmd.testing.pipelines import FULL_CONFIGS, TINY_CONFIGS

    if family == "sd3" and not tiny:
        return sd3_config(layers, hidden)
    config = dict((TINY_CONFIGS if tiny else FULL_CONFIGS)[family]["transformer"])
    if layers is not None:
        if family == "flux":
            config["num_single_layers"] = max(
                1, round(layers * config["num_single_layers"] / config["num_layers"])
            )
        config["num_layers"] = layers
    if family == "flux":
        config["guidance_embeds"] = True  # FLUX.1-dev, the recipe's teacher: guidance is an input, not CFG
    return config


def make_workload(
    family: str, *, tiny: bool, layers: int | None, hidden: int | None, frames: int | None
) -> Workload:
    """The family's model and batch shapes: the latent from the adapter's `latent_shape` (the VAE config of the
    family's pipeline, the recipe's resolution), checked against the transformer's input channels."""
    from verl_dmd.adapters import get_adapter
    from verl_dmd.testing.pipelines import FULL_CONFIGS, TINY_CONFIGS, TINY_FRAMES, TINY_RESOLUTION

    adapter = get_adapter(family)()
    recipe = recipe_settings(family)
    config = transformer_config(family, tiny=tiny, layers=layers, hidden=hidden)
    vae = (TINY_CONFIGS if tiny else FULL_CONFIGS)[family]["vae"]
    height, width = TINY_RESOLUTION[family] if tiny else recipe["resolution"]
    if recipe["frames"] is not None and frames is None:
        frames = TINY_FRAMES[family] if tiny else int(recipe["frames"])
    latent = tuple(int(n) for n in adapter.latent_shape(vae, config, height, width, frames))
    # Flux and Qwen-Image pack 2x2 latent patches into tokens (N, C); the others keep channels first.
    channels = latent[-1] if len(latent) == 2 else latent[0]
    if channels != config["in_channels"]:
        raise ValueError(
            f"{family}: the adapter's latent {latent} has {channels} channels but the transformer config's "
            f"in_channels is {config['in_channels']}; fix: pair the transformer config with its family's VAE"
        )
    tokens = TINY_TEXT_TOKENS if tiny else TEXT_TOKENS[family]
    if adapter.max_text_tokens is not None and tokens > adapter.max_text_tokens:
        raise ValueError(
            f"{family}: {tokens} text tokens, more than the pipeline serves ({adapter.max_text_tokens})"
        )
    return Workload(
        family=family,
        tiny=tiny,
        transformer=config,
        height=int(height),
        width=int(width),
        frames=frames,
        latent=latent,
        text_tokens=tokens,
        text_width=int(config.get("joint_attention_dim", config.get("text_dim", 0))),
        pooled_width=config.get("pooled_projection_dim"),
        mask_key=adapter.ragged_cond.get("encoder_hidden_states"),
        constant_cond=adapter.constant_cond(config, None),
        guidance_scale=recipe["guidance_scale"],
        sigma_shift=recipe["sigma_shift"],
    )


def matmul_rate(
    device: torch.device, size: int = 8192, repeats: int = 20, settle_s: float = 3.0, window_s: float = 2.0
) -> tuple[float, float]:
    """Measured bf16 matmul FLOP/s as (burst, sustained): size^3 products back to back, timed per round of
    `repeats` (one wait per round, so launch and wait overheads do not count), for `settle_s` + `window_s`.

    burst: the fastest round (boost clocks, before the power limit engages: the first rounds on a rested
    GPU). sustained: the median of the rounds in the last `window_s`, at the power limit, which is what
    the GPU delivers over seconds of work (an H200 at 700 W: ~663 TFLOP/s sustained vs ~780 in the first
    round, docs/benchmarks.md)."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    rates: list[tuple[float, float]] = []  # (seconds since the start, FLOP/s of the round)
    started = time.perf_counter()
    while not rates or rates[-1][0] < settle_s + window_s:
        torch.cuda.synchronize(device)
        begin = time.perf_counter()
        for _ in range(repeats):
            a @ b
        torch.cuda.synchronize(device)
        end = time.perf_counter()
        rates.append((end - started, 2 * size**3 * repeats / (end - begin)))
    burst = max(rate for _, rate in rates)
    sustained = statistics.median(rate for at, rate in rates if at >= settle_s)
    return burst, sustained


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far (0 without model.compile)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_batch(
    work: Workload, batch: int, generator: torch.Generator, *, pin: bool
) -> dict[str, torch.Tensor]:
    """A batch as the embeddings data provider hands it over: noise, cond.* and (with CFG) uncond.*, the
    unconditional text as long as the conditional one, in zeros (random draws: noise, text, pooled)."""

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    text = (batch, work.text_tokens, work.text_width)
    out = {"noise": randn(batch, *work.latent), "cond.encoder_hidden_states": randn(*text)}
    if work.pooled_width:
        out["cond.pooled_projections"] = randn(batch, work.pooled_width)
    if work.mask_key:
        out[f"cond.{work.mask_key}"] = torch.ones(batch, work.text_tokens, dtype=torch.long)
    for key, value in work.constant_cond.items():
        out[f"cond.{key}"] = torch.full((batch,), float(value))
    if work.guidance_scale != 1.0:
        out["uncond.encoder_hidden_states"] = torch.zeros(*text)
        if work.pooled_width:
            out["uncond.pooled_projections"] = torch.zeros(batch, work.pooled_width)
        if work.mask_key:
            out[f"uncond.{work.mask_key}"] = torch.ones(batch, work.text_tokens, dtype=torch.long)
    # Pinned, as a DataLoader(pin_memory=True) hands batches over: the runtime's copy to the device then
    # does not wait for the device (a pageable copy would, 87 MB at batch 8). Made outside the timing.
    return {k: v.pin_memory() for k, v in out.items()} if pin else out


def built_on(adapter, device: torch.device):
    """`adapter`, building its models (random init, float32, as the engine expects them) on `device` instead of
    the host: seconds instead of minutes for a 12-20B model, and no float32 host copy per model (three of
    Qwen-Image's would not fit the GPU machine's 128 GiB). The frozen weights end up in bf16 on the device
    either way (the engine stores them so)."""

    class BuiltOnDevice(type(adapter)):
        def build_model(self, source):
            with torch.device(device):
                return super().build_model(source)

    return BuiltOnDevice()


def profile_cycle(run, out: Path, name: str) -> str:
    """Run `run()` under torch.profiler; write the operator tables (`profile_<name>.txt`), the chrome
    trace (`trace_<name>.json.gz`) and where the device waits (`gaps_<name>.txt`, scripts/trace_gaps.py)
    into `out`; returns the latter."""
    from torch.profiler import ProfilerActivity, profile
    from trace_gaps import analyse, load, report

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, with_flops=True) as prof:
        run()
    averages = prof.key_averages()
    table = averages.table(sort_by="cuda_time_total", row_limit=30)
    cpu_table = averages.table(sort_by="self_cpu_time_total", row_limit=20)
    # The matmuls' own rate inside the cycle (at the clocks the cycle runs at): their FLOPs by shape
    # over their kernels' time.
    matmuls = [e for e in averages if e.key in ("aten::mm", "aten::addmm", "aten::bmm")]
    flops = sum(e.flops for e in matmuls)
    seconds = sum(getattr(e, "device_time_total", 0.0) for e in matmuls) / 1e6
    rate = f"{flops / seconds / 1e12:.0f} TFLOP/s" if seconds else "no device time"
    matmul_line = (
        f"matmuls in the cycle: {flops / 1e12:.4g} TFLOP in {seconds * 1e3:.1f} ms of kernels: {rate}"
    )
    (out / f"profile_{name}.txt").write_text(matmul_line + "\n\n" + table + "\n\n" + cpu_table + "\n")
    plain, trace = out / f"trace_{name}.json", out / f"trace_{name}.json.gz"
    prof.export_chrome_trace(str(plain))  # compressed here: not every torch compresses on export
    with open(plain, "rb") as source, gzip.open(trace, "wb") as target:
        shutil.copyfileobj(source, target)
    plain.unlink()
    gaps = matmul_line + "\n\n" + report(analyse(load(trace)), top=30)
    (out / f"gaps_{name}.txt").write_text(gaps + "\n")
    return gaps


def trace_device_cycle(run, out: Path, name: str) -> tuple[float, str]:
    """Run `run()` under torch.profiler recording device activity alone (kernels, copies and the CUDA
    runtime calls; no operators, so the host runs at about its unprofiled speed); write the trace
    (`trace_device_<name>.json.gz`) and its gaps (`gaps_device_<name>.txt`, trace_gaps.py --device-only)
    into `out`. Returns the wall time of `run()` and the gap report."""
    from torch.profiler import ProfilerActivity, profile
    from trace_gaps import analyse_device_only, load, report_device_only

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        run()
        wall = time.perf_counter() - started
    plain, trace = out / f"trace_device_{name}.json", out / f"trace_device_{name}.json.gz"
    prof.export_chrome_trace(str(plain))
    with open(plain, "rb") as source, gzip.open(trace, "wb") as target:
        shutil.copyfileobj(source, target)
    plain.unlink()
    gaps = f"cycle under the device-only profiler: {wall:.3f} s\n\n"
    gaps += report_device_only(analyse_device_only(load(trace), min_us=20.0), top=40)
    (out / f"gaps_device_{name}.txt").write_text(gaps + "\n")
    return wall, gaps


def run_layout(layout: str, work: Workload, args, device: torch.device) -> dict:
    from torch.utils.flop_counter import FlopCounterMode

    from verl_dmd.adapters import get_adapter
    from verl_dmd.controller import DistillationController
    from verl_dmd.phases import PhaseRequest, Role
    from verl_dmd.plan import DistillationPlan
    from verl_dmd.runtime.engine import RoleEngine
    from verl_dmd.runtime.runtime import DistillationRoleRuntime

    full = layout == "independent_full"
    layout = "independent" if full else layout
    name = "independent_full" if full else layout
    lora = {"rank": 0} if full else {"rank": args.lora_rank, "alpha": float(args.lora_rank)}
    plan = DistillationPlan.from_config({
        "algorithm": {"fake_update_ratio": args.k, "teacher_guidance_scale": work.guidance_scale,
                      "sigma_shift": work.sigma_shift},
        "model": {"adapter": work.family, "storage": layout, "param_dtype": "bfloat16",
                  "activation_checkpointing": args.activation_checkpointing, "compile": args.compile,
                  "compile_backend": args.compile_backend, "reshard_after_forward": not args.keep_gathered,
                  "teacher": {"config": work.transformer},
                  "student": {"lora": lora}, "fake_score": {"lora": lora}},
        "batch": {"student": {"micro_batch_size": args.batch}, "fake_score": {"micro_batch_size": args.batch}},
        "data": {"name": "synthetic"},
        "export": {"formats": ["diffusers"]},
    })  # fmt: skip
    built = time.perf_counter()
    adapter = get_adapter(work.family)()
    if args.init == "device":
        adapter = built_on(adapter, device)
    computer = adapter.build_distribution_matching_computer(plan.model, plan, rank=0)
    engine = RoleEngine(plan, adapter, device=device, extra_modules=computer.extra_modules())
    runtime = DistillationRoleRuntime(engine, computer)
    if args.init == "device" and device.type == "cuda":
        torch.cuda.empty_cache()  # the float32 builds' blocks, freed when the frozen weights went to bf16
    build_s = time.perf_counter() - built
    controller = DistillationController(fake_update_ratio=args.k, fake_warmup_steps=0)
    generator = torch.Generator().manual_seed(0)
    pin = device.type == "cuda" and not args.pageable_batch

    def phase(batch: dict | None = None) -> tuple[Role, float, dict]:
        role = controller.next_phase()
        request = PhaseRequest(role=role, global_step=controller.global_step, role_step=0,
                               phase_index=controller.phase_index)  # fmt: skip
        if batch is None:
            batch = make_batch(work, args.batch, generator, pin=pin)
        synchronize(device)
        start = time.perf_counter()
        with record_function(f"phase:{role.value}"):  # the window scripts/trace_gaps.py looks at
            metrics = runtime.run_phase(request, batch)
            synchronize(device)
        controller.record(role, stepped=metrics["stepped"])
        return role, time.perf_counter() - start, metrics

    warm = time.perf_counter()
    for _ in range(args.warmup * (args.k + 1)):
        phase()
    warmup_s = time.perf_counter() - warm
    flops = {}
    for _ in range(args.k + 1):
        counter = FlopCounterMode(display=False)
        role = controller.next_phase()
        # The FLOPs of the model as written: compiled blocks run eagerly while counting.
        with counter, torch.compiler.set_stance("force_eager"):
            request = PhaseRequest(role=role, global_step=controller.global_step, role_step=0,
                                   phase_index=controller.phase_index)  # fmt: skip
            metrics = runtime.run_phase(request, make_batch(work, args.batch, generator, pin=pin))
        controller.record(role, stepped=metrics["stepped"])
        flops.setdefault(role.value, counter.get_total_flops())
    # Files of the default family keep their names; other families' carry the family in front.
    files = name if work.family == "sd3" else f"{work.family}_{name}"
    if args.profile:
        # The batches are made first: the profile shows the phases only, as the timer does.
        batches = [make_batch(work, args.batch, generator, pin=pin) for _ in range(args.k + 1)]
        gaps = profile_cycle(lambda: [phase(batch) for batch in batches], args.profile, files)
        del batches
        print(f"where the device waits in the profiled cycle:\n{gaps}", flush=True)
    traced_s = None
    if args.trace_device:
        batches = [make_batch(work, args.batch, generator, pin=pin) for _ in range(args.k + 1)]
        traced_s, gaps = trace_device_cycle(lambda: [phase(b) for b in batches], args.trace_device, files)
        del batches
        print(f"device-only trace of one cycle:\n{gaps}", flush=True)
    # run_phase resets the device's peak at the start of every phase: the peak of the timed cycles is the
    # highest of the phases' own, read after each.
    peaks = {"student": 0, "fake_score": 0}
    times: dict[str, list[float]] = {"student": [], "fake_score": []}
    cycles = []
    for _ in range(args.repeats):
        cycle = 0.0
        for _ in range(args.k + 1):
            role, seconds, _ = phase()
            times[role.value].append(seconds)
            if device.type == "cuda":
                peaks[role.value] = max(peaks[role.value], torch.cuda.max_memory_allocated(device))
            cycle += seconds
        cycles.append(cycle)
    median = statistics.median
    student_s, fake_s, cycle_s = median(times["student"]), median(times["fake_score"]), median(cycles)
    cycle_flops = flops["student"] + args.k * flops["fake_score"]
    cuda = device.type == "cuda"
    result = {
        "layout": name,
        "build_s": build_s,
        "student_phase_s": student_s,
        "fake_phase_s": fake_s,
        "cycle_s": cycle_s,
        "student_flops": flops["student"],
        "fake_flops": flops["fake_score"],
        "cycle_flops": cycle_flops,
        "peak_bytes": max(peaks.values()) if cuda else None,
        "peak_student_bytes": peaks["student"] if cuda else None,
        "peak_fake_bytes": peaks["fake_score"] if cuda else None,
        "warmup_s": warmup_s,
        "compile": args.compile,
        "batch_pinned": pin,
        "reshard_after_forward": not args.keep_gathered,
        "compiled_graphs": compiled_graphs(),
        "parameter_bytes": engine.parameter_bytes(),
        "sdpa_backend": args.sdpa_backend,
        "cycles_s": cycles,
        "device_traced_cycle_s": traced_s,
        "cycle_flops_per_s": cycle_flops / cycle_s,
    }
    return result


def run_bare(work: Workload, args, device: torch.device) -> dict:
    """The practical ceiling of `work`'s model: the transformer alone, a plain module in bf16 (what the engine
    computes in) with one LoRA adapter of --lora-rank on the adapter's default targets (the trainable roles'),
    per-block activation checkpointing and compilation as the engine applies them, timed over forward +
    backward of a mean squared error on the layouts' batch shape. No optimizer: the LoRA gradients are dropped
    after each step (the phases' AdamW steps on the LoRA weights are a small part of theirs)."""
    from torch.utils.flop_counter import FlopCounterMode

    from verl_dmd.adapters import get_adapter
    from verl_dmd.adapters.base import ModelSource
    from verl_dmd.batch import prefixed
    from verl_dmd.plan import LoraSpec
    from verl_dmd.runtime import lora, sharding

    built = time.perf_counter()
    adapter = get_adapter(work.family)()
    torch.manual_seed(0)
    with torch.device(device if args.init == "device" else "cpu"):
        model = adapter.build_model(ModelSource(config=work.transformer))
    model.requires_grad_(False)
    spec = LoraSpec(rank=args.lora_rank, alpha=float(args.lora_rank))
    lora.add_adapter(model, lora.lora_config(spec, adapter.default_lora_targets), "student")
    # Every parameter in bf16, the LoRA factors too, buffers as built: what the engine's FSDP2 computes with
    # (it gathers parameters in model.param_dtype and leaves buffers alone, e.g. Wan's float32 rotary tables).
    model.to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    trainable = [p for name, p in model.named_parameters() if lora.adapter_of(name) is not None]
    for p in trainable:
        p.requires_grad_(True)
    if args.activation_checkpointing:  # as sharding.shard wraps the units
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        ids = set(map(id, adapter.fsdp_units(model)))
        apply_activation_checkpointing(model, check_fn=lambda m: id(m) in ids)
    if args.compile:
        sharding.compile_units(adapter.fsdp_units(model), args.compile_backend)
    model.train()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    build_s = time.perf_counter() - built

    generator = torch.Generator().manual_seed(1)
    batch = make_batch(work, args.batch, generator, pin=False)

    def model_input(t: torch.Tensor) -> torch.Tensor:  # floating inputs in bf16, as FSDP2 casts them
        return t.to(device, dtype=torch.bfloat16 if t.is_floating_point() else t.dtype)

    x_t = model_input(batch["noise"])
    sigma = model_input(torch.rand(args.batch, generator=generator))
    cond = {k: model_input(v) for k, v in prefixed(batch, "cond.").items()}
    target = torch.randn(batch["noise"].shape, generator=generator).to(device)

    def step() -> None:
        prediction = adapter.predict(model, x_t, sigma, cond)
        (prediction.float() - target).square().mean().backward()
        for p in trainable:
            p.grad = None

    warm = time.perf_counter()
    for _ in range(args.bare_warmup):
        step()
    synchronize(device)
    warmup_s = time.perf_counter() - warm
    counter = FlopCounterMode(display=False)
    with counter, torch.compiler.set_stance("force_eager"):  # the model as written, as the phases are counted
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    steps = []
    for _ in range(args.bare_repeats):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        steps.append(time.perf_counter() - start)
    step_s = statistics.median(steps)
    flops = counter.get_total_flops()
    return {
        "what": "forward + backward of the transformer with one LoRA adapter, bf16, no optimizer",
        "lora_rank": args.lora_rank,
        "trainable_parameters": sum(p.numel() for p in trainable),
        "build_s": build_s,
        "warmup_s": warmup_s,
        "step_s": step_s,
        "steps_s": steps,
        "flops": flops,
        "flops_per_s": flops / step_s,
        "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "compile": args.compile,
        "compiled_graphs": compiled_graphs(),
        "activation_checkpointing": args.activation_checkpointing,
    }


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, default="sd3",
                        help="the model family and its recipe's shapes (default sd3, SD3-medium at 1024 px)")  # fmt: skip
    parser.add_argument("--layouts", nargs="+", default=["shared_base_adapters", "independent"],
                        choices=["shared_base_adapters", "independent", "independent_full"],
                        help="independent_full: three full copies, student and fake score fully trained")  # fmt: skip
    parser.add_argument("--layers", type=int, default=None,
                        help="transformer blocks (default: the family's; sd3 24; flux: double blocks, the single "
                        "blocks scaled alike)")  # fmt: skip
    parser.add_argument("--hidden", type=int, default=None, help="sd3 only: its width (default 1536)")
    parser.add_argument("--frames", type=int, default=None,
                        help="wan only: video frames (default the recipe's 81, 21 latent frames)")  # fmt: skip
    parser.add_argument("--tiny", action="store_true",
                        help="the family's tiny pipeline shapes (verl_dmd.testing.pipelines): a smoke run")  # fmt: skip
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a smoke run (gloo, no matmul-rate probe, MFU null), with --tiny")  # fmt: skip
    parser.add_argument("--init", choices=["host", "device"], default=None,
                        help="where the models are built, random init in float32 (default: host, as the engine "
                        "does, for sd3; device for the other families, whose float32 copies the host cannot hold)")  # fmt: skip
    parser.add_argument("--lora-rank", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--k", type=int, default=5, help="fake-score phases per student phase")
    parser.add_argument("--warmup", type=int, default=1, help="untimed cycles")
    parser.add_argument("--repeats", type=int, default=3, help="timed cycles")
    parser.add_argument("--bare", action=argparse.BooleanOptionalAction, default=True,
                        help="time the bare model's forward + backward too (the practical ceiling)")  # fmt: skip
    parser.add_argument("--bare-warmup", type=int, default=2, help="untimed steps of the bare loop")
    parser.add_argument("--bare-repeats", type=int, default=5, help="timed steps of the bare loop")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--compile", action="store_true", help="model.compile=true: torch.compile each block")
    parser.add_argument("--compile-backend", choices=["inductor", "aot_eager", "eager"], default="inductor",
                        help="model.compile_backend (aot_eager, eager: no code generation, for smoke runs)")  # fmt: skip
    parser.add_argument("--keep-gathered", action="store_true",
                        help="model.reshard_after_forward=false: keep gathered weights until the phase ends")  # fmt: skip
    parser.add_argument(
        "--pageable-batch",
        action="store_true",
        help="hand batches over in pageable memory (default: pinned, as a DataLoader(pin_memory=True))",
    )
    parser.add_argument(
        "--sdpa-backend",
        choices=["default", "cudnn", "flash", "efficient"],
        default="default",
        help="allow only this scaled-dot-product-attention kernel (default: torch's choice, cuDNN on an H200)",
    )
    parser.add_argument(
        "--trace-device",
        type=Path,
        default=None,
        help="one more cycle under a device-only profiler (little host overhead): trace and gaps into this folder",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="profile one more cycle per layout: operator tables, chrome trace (.json.gz) and where the "
        "device waits (scripts/trace_gaps.py) into this folder",
    )
    args = parser.parse_args(argv)
    full_sd3 = args.family == "sd3" and not args.tiny
    if args.hidden is not None and not full_sd3:
        parser.error(f"--hidden {args.hidden}: sets the width of the full-size sd3 shape only; the other "
                     "families (and --tiny) keep their released (tiny) widths; fix: drop --hidden")  # fmt: skip
    if full_sd3:
        args.layers = 24 if args.layers is None else args.layers
        args.hidden = 1536 if args.hidden is None else args.hidden
    if args.frames is not None and args.family != "wan":
        parser.error(f"--frames {args.frames}: {args.family} makes images; fix: drop --frames (wan only)")
    if args.frames is not None and (args.frames < 1 or (args.frames - 1) % 4):
        parser.error(f"--frames {args.frames}: Wan's VAE keeps the first frame and compresses the rest 4x; "
                     "fix: 4k + 1 frames, e.g. 81")  # fmt: skip
    for flag, value, least in [("--layers", args.layers, 1), ("--batch", args.batch, 1), ("--k", args.k, 1),
                               ("--warmup", args.warmup, 0), ("--repeats", args.repeats, 1),
                               ("--bare-warmup", args.bare_warmup, 0), ("--bare-repeats", args.bare_repeats, 1)]:  # fmt: skip
        if value is not None and value < least:
            parser.error(f"{flag} {value}: must be >= {least}")
    if args.device == "cpu" and (args.sdpa_backend != "default" or args.trace_device):
        parser.error(
            "--sdpa-backend and --trace-device choose and trace CUDA kernels; fix: drop them with --device cpu"
        )
    if args.init is None:
        args.init = "host" if args.family == "sd3" else "device"
    for folder in (args.profile, args.trace_device):
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA device; fix: run on a GPU, or --device cpu --tiny for a smoke run")
    work = make_workload(
        args.family, tiny=args.tiny, layers=args.layers, hidden=args.hidden, frames=args.frames
    )
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    kernels_off: tuple[str, ...] = ()
    if cuda and args.sdpa_backend == "default":  # what the product's workers do for this family
        from verl_dmd.adapters import get_adapter
        from verl_dmd.runtime.attention import exclude_attention_kernels

        kernels_off = exclude_attention_kernels(get_adapter(args.family).excluded_attention_kernels)
    if args.sdpa_backend != "default":
        switches = {"cudnn": torch.backends.cuda.enable_cudnn_sdp, "flash": torch.backends.cuda.enable_flash_sdp,
                    "efficient": torch.backends.cuda.enable_mem_efficient_sdp}  # fmt: skip
        for backend, switch in switches.items():
            switch(backend == args.sdpa_backend)
        torch.backends.cuda.enable_math_sdp(False)  # fail rather than fall back silently
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    device_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    # The rate moves with clocks and power: a burst at boost clocks, then the power limit (measured before
    # and after the layouts). MFU is taken against the higher sustained rate; the burst one is reported too.
    # A CPU run measures no rate: its MFU is null.
    rate = burst = rate_before = burst_before = rate_after = burst_after = None
    if cuda:
        burst_before, rate_before = matmul_rate(device)
        print(f"{device_name}, torch {torch.__version__}: bf16 matmul "
              f"{rate_before / 1e12:.0f} TFLOP/s sustained, {burst_before / 1e12:.0f} burst, before")  # fmt: skip
    results = []
    for layout in args.layouts:
        results.append(run_layout(layout, work, args, device))
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()  # the layout's engine is gone; the next one starts from an empty device
    bare = None
    if args.bare:
        bare = run_bare(work, args, device)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    datasheet = DATASHEET_BF16_FLOPS if cuda else None
    if cuda:
        burst_after, rate_after = matmul_rate(device)
        rate, burst = max(rate_before, rate_after), max(burst_before, burst_after)
        print(f"bf16 matmul {rate_after / 1e12:.0f} TFLOP/s sustained, {burst_after / 1e12:.0f} burst, after; "
              f"MFU against {rate / 1e12:.0f} (sustained), {burst / 1e12:.0f} (burst), "
              f"{datasheet / 1e12:.1f} (datasheet)")  # fmt: skip

    def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
        return None if peak is None else flops / seconds / peak

    if bare is not None:
        bare.update({
            "ideal_step_s": None if rate is None else bare["flops"] / rate,
            "mfu": mfu(bare["flops"], bare["step_s"], rate),
            "mfu_burst": mfu(bare["flops"], bare["step_s"], burst),
            "mfu_datasheet": mfu(bare["flops"], bare["step_s"], datasheet),
        })  # fmt: skip
    for result in results:
        cycle_flops = result["cycle_flops"]
        result.update({
            "ideal_cycle_s": None if rate is None else cycle_flops / rate,
            "mfu_student": mfu(result["student_flops"], result["student_phase_s"], rate),
            "mfu_fake": mfu(result["fake_flops"], result["fake_phase_s"], rate),
            "mfu_cycle": mfu(cycle_flops, result["cycle_s"], rate),
            "mfu_cycle_burst": mfu(cycle_flops, result["cycle_s"], burst),
            "mfu_cycle_datasheet": mfu(cycle_flops, result["cycle_s"], datasheet),
            # What the DMD2 cycle keeps of the rate this model reaches alone on this device.
            "cycle_vs_bare": None if bare is None else result["cycle_flops_per_s"] / bare["flops_per_s"],
        })  # fmt: skip
        print(json.dumps(result), flush=True)
    if bare is not None:
        print(json.dumps({"bare": bare}), flush=True)
    frames = f"x{work.frames} frames" if work.frames else ""
    cfg = f"CFG {work.guidance_scale:g}" if work.guidance_scale != 1.0 else "no CFG"
    if work.constant_cond:
        cfg += " (" + ", ".join(f"{k} {v:g}" for k, v in work.constant_cond.items()) + ")"
    print(f"\n{work.describe()}, batch {args.batch}, {work.height}x{work.width}{frames} "
          f"(latent {'x'.join(map(str, work.latent))}, {work.text_tokens} text tokens), K={args.k}, "
          f"LoRA rank {args.lora_rank} (none for independent_full), {cfg}, compile {args.compile}, "
          f"reshard_after_forward {not args.keep_gathered}, attention kernel {args.sdpa_backend}"
          f"{' (off: ' + ', '.join(kernels_off) + ')' if kernels_off else ''}, "
          f"on {device_name}")  # fmt: skip

    def gib(value: int | None) -> str:
        return "n/a" if value is None else f"{value / 2**30:.1f}"

    print("| layout | student phase s | fake phase s | cycle s | ideal cycle s | MFU cycle | MFU vs burst | peak GiB "
          "| cycle TFLOP/s | MFU vs datasheet | cycle / bare |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ideal = "n/a" if r["ideal_cycle_s"] is None else f"{r['ideal_cycle_s']:.3f}"
        print(f"| {r['layout']} | {r['student_phase_s']:.3f} | {r['fake_phase_s']:.3f} | {r['cycle_s']:.3f} | "
              f"{ideal} | {percent(r['mfu_cycle'])} | {percent(r['mfu_cycle_burst'])} | {gib(r['peak_bytes'])} | "
              f"{r['cycle_flops_per_s'] / 1e12:.1f} | {percent(r['mfu_cycle_datasheet'])} | "
              f"{percent(r['cycle_vs_bare'])} |")  # fmt: skip
    if bare is not None:
        print(f"bare loop ({bare['what']}, compile {bare['compile']}): {bare['step_s']:.3f} s per step, "
              f"{bare['flops'] / 1e12:.4g} TFLOP, {bare['flops_per_s'] / 1e12:.1f} TFLOP/s, MFU "
              f"{percent(bare['mfu'])} (sustained) / {percent(bare['mfu_burst'])} (burst) / "
              f"{percent(bare['mfu_datasheet'])} (datasheet), peak {gib(bare['peak_bytes'])} GiB")  # fmt: skip
    if args.json:
        document = {"code": code_version(), "device": device_name, "torch": torch.__version__,
                    "family": work.family, "attention_kernels_off": list(kernels_off), "workload": asdict(work),
                    "matmul_flops_per_s": rate, "matmul_flops_per_s_before": rate_before,
                    "matmul_flops_per_s_after": rate_after, "matmul_burst_flops_per_s": burst,
                    "matmul_burst_flops_per_s_before": burst_before, "matmul_burst_flops_per_s_after": burst_after,
                    "datasheet_flops_per_s": datasheet, "results": results, "bare": bare}  # fmt: skip
        args.json.write_text(json.dumps(document, indent=1) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
