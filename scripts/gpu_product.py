"""The product path of one model family, as a user walks it, timed: build -> prepare -> train (ray) ->
SIGTERM and resume -> decoded validation -> export -> serve few-step with diffusers.

    python scripts/gpu_product.py --family sd3 --size full --work /root/work --report $OUT/sd3.json
    python scripts/gpu_product.py --family sd3 --size tiny --device cpu --work /tmp/w   # the same path on a CPU

Stages (`--stages`, in this order; each reads what the earlier ones left in --work, so a long family can
be split over several invocations):

- build: a random-init pipeline directory of the family (`verl_dmd.testing.pipelines.build_pipeline`,
  size tiny or full: the released architectures' shapes; `--layers` only where a machine cannot hold
  the family, and the report says so);
- prepare: `python -m verl_dmd.prepare_main` on a prompt file (the recipe, the pipeline's own encoders);
- train: `python -m verl_dmd.main` with ray (one worker per GPU) twice: straight to --steps, and again
  into another directory, stopped by SIGTERM after the step following the first periodic checkpoint,
  then relaunched with the same command; the two final checkpoints are compared file by file;
- resume: that second half alone (the SIGTERM pair and the comparison), against the straight run an earlier
  `--stages train --no-resume-check` left in --work and the report (refused unless that run finished with
  the same command and code): a large family's training in two device calls;
- export: `python -m verl_dmd.export_main` of the straight run's final checkpoint (timed);
- serve: the exported `pipeline` directory loaded with `DiffusionPipeline.from_pretrained` and called
  as docs/serving.md says for the family (prompt text, the block's steps and guidance); a PNG per prompt.

The report (JSON, merged with an existing one) holds every stage's seconds, the log's figures (per-phase
seconds, peak memory, samples/s, TFLOP/s and MFU from the file logger; checkpoint save and load seconds;
validation seconds), the checkpoint sizes, the comparison, and the commands run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_offload import code_version  # noqa: E402

PROMPTS = [
    "a red cat", "a blue dog", "the sea at night", "a photo of a cat", "a dog on the hill", "a red house",
    "a blue cat with a hat", "the moon over the sea", "a photo of a red dog", "a cat in the snow",
    "a blue house on a hill", "a dog with a ball", "the sun over a field", "a red car", "a blue bird",
    "a cat and a dog",
]  # fmt: skip
VALIDATION_PROMPTS = ["a red cat on a hill", "a photo of a blue dog"]

# Per family: (height, width, frames) of the run, and the export targets. The recipes' resolutions, except
# Wan's frames (81 in the recipe; 17 here: 5 latent frames, so a step takes seconds, not minutes).
SHAPES = {"sd3": (1024, 1024, None), "flux": (1024, 1024, None), "qwen_image": (1328, 1328, None),
          "wan": (480, 832, 17)}  # fmt: skip
TINY_SHAPES = {
    "sd3": (32, 32, None),
    "flux": (32, 32, None),
    "qwen_image": (32, 32, None),
    "wan": (32, 32, 5),
}
FORMATS = {"sd3": "[peft,pipeline]", "flux": "[peft,pipeline,vllm_omni]",
           "qwen_image": "[peft,pipeline,vllm_omni]", "wan": "[peft,pipeline,vllm_omni]"}  # fmt: skip


def log(message: str) -> None:
    print(f"[gpu_product {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(command: list[str], log_path: Path, env: dict[str, str]) -> tuple[int, float, str]:
    """Run a command to completion, its output teed to `log_path`; (exit code, seconds, output)."""
    log(" ".join(command))
    started = time.perf_counter()
    with open(log_path, "w") as sink:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        lines = []
        for line in process.stdout:
            sink.write(line)
            lines.append(line)
            if _worth_showing(line):
                print("    " + line.rstrip()[:300], flush=True)
        process.wait()
    return process.returncode, time.perf_counter() - started, "".join(lines)


def _worth_showing(line: str) -> bool:
    return bool(re.match(r"^(step |checkpoint|resumed|verl-dmd|workers|MFU|done|stopped|export|prepare|"
                         r"validation|Traceback|\w*Error)", line.strip())) or "error" in line.lower()[:40]  # fmt: skip


def run_until_stopped(command: list[str], log_path: Path, env: dict[str, str], stop_step: int, total: int):
    """Run the training command and send SIGTERM once the progress line of `stop_step` appears."""
    log(" ".join(command) + f"   (SIGTERM after step {stop_step})")
    started = time.perf_counter()
    with open(log_path, "w") as sink:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        lines, sent = [], False
        for line in process.stdout:
            sink.write(line)
            lines.append(line)
            if _worth_showing(line):
                print("    " + line.rstrip()[:300], flush=True)
            if not sent and line.startswith(f"step {stop_step:6d}/{total}"):
                process.send_signal(signal.SIGTERM)
                sent = True
        process.wait()
    return process.returncode, time.perf_counter() - started, "".join(lines)


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def metrics_of(jsonl: Path) -> list[dict]:
    if not jsonl.exists():
        return []
    return [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]


def summarise_metrics(rows: list[dict]) -> dict:
    """Medians over the logged steps (the first step's phases excluded when there are more: warm-up)."""
    values: dict[str, list[float]] = {}
    for row in rows[1:] if len(rows) > 1 else rows:
        for key, value in row["data"].items():
            if key.startswith("perf/") and isinstance(value, int | float):
                values.setdefault(key, []).append(float(value))
    out = {key: statistics.median(v) for key, v in sorted(values.items())}
    peaks = [row["data"][k] for row in rows for k in row["data"] if k.endswith("/peak_gib")]
    if peaks:
        out["peak_gib_max"] = max(peaks)
    return out


def log_figures(output: str) -> dict:
    figures: dict = {}
    saves = [float(m) for m in re.findall(r"^checkpoint: \S+ \(([\d.]+) s\)", output, re.M)]
    if saves:
        figures["checkpoint_save_s"] = saves
    loads = [float(m) for m in re.findall(r"^resumed from .*\(([\d.]+) s\)$", output, re.M)]
    if loads:
        figures["checkpoint_load_s"] = loads
    validations = [float(m) for m in re.findall(r"validation (\d+) s", output)]
    if validations:
        figures["validation_s"] = validations
    ready = re.findall(r"^workers ready on (\S+) in ([\d.]+) s", output, re.M)
    if ready:
        figures["workers_ready_s"] = float(ready[0][1])
        figures["worker_device"] = ready[0][0]
        parts = re.findall(r"^workers ready on .*\(rank 0: (.*)\)$", output, re.M)
        if parts:  # "process group 1.2 s, model build 12.0 s, ...; the rest (9.1 s): ..."
            where = {
                name: float(sec)
                for name, sec in re.findall(r"([a-z][a-z0-9 ]*?) ([\d.]+) s(?:,|;|$)", parts[0])
            }
            rest = re.findall(r"the rest \(([\d.]+) s\)", parts[0])
            figures["workers_ready_parts_s"] = {**where, **({"the rest": float(rest[0])} if rest else {})}
    mfu = re.findall(r"^MFU .*against: (.*)$", output, re.M)
    if mfu:
        figures["mfu_denominators"] = mfu[0]
    done = re.findall(r"^done: (\d+) student steps in (\d+) s", output, re.M)
    if done:
        figures["run_s"] = float(done[0][1])
    return figures


def compare_checkpoints(a: Path, b: Path) -> dict:
    names_a = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    names_b = sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    differing = [n for n in names_a if n in names_b and (a / n).read_bytes() != (b / n).read_bytes()]
    result = {"files": len(names_a), "same_names": names_a == names_b, "differing": differing,
              "bitwise_equal": names_a == names_b and not differing}  # fmt: skip
    if any(n.startswith("engine/") for n in differing):  # which tensors differ, and by how much
        from verl_dmd.checkpoint.export import read_role_tensors
        from verl_dmd.runtime.naming import RoleTensors

        every = RoleTensors(prefix="", adapter=None, model_name="")
        ta, tb = read_role_tensors(a / "engine", every), read_role_tensors(b / "engine", every)
        diffs = {}
        for key in sorted(ta):
            x, y = ta[key], tb.get(key)
            if y is None or not x.is_floating_point() or x.shape != y.shape:
                continue
            if not (x == y).all():
                err = (x.double() - y.double()).abs().max().item()
                scale = x.double().abs().max().item()
                diffs[key] = {"max_abs": err, "max_rel": err / scale if scale else float("inf"),
                              "elements_differing": int((x != y).sum())}  # fmt: skip
        result["tensors"] = len(ta)
        result["tensors_differing"] = len(diffs)
        result["largest"] = dict(sorted(diffs.items(), key=lambda kv: -kv[1]["max_rel"])[:8])
    return result


def serve(
    family: str, export_dir: Path, device: str, height: int, width: int, frames: int | None, out: Path
) -> dict:
    """Load the `pipeline` target as docs/serving.md says and sample the validation prompts few-step."""
    import functools

    import numpy as np
    import torch
    from diffusers import DiffusionPipeline

    pipeline = export_dir / "pipeline"
    block = json.loads((pipeline / "model_index.json").read_text())["dmd2_config"]
    steps, guidance = block["num_inference_steps"], block["guidance_scale"]
    started = time.perf_counter()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    pipe = DiffusionPipeline.from_pretrained(str(pipeline), dtype=dtype, local_files_only=True).to(device)
    pipe.set_progress_bar_config(disable=True)
    load_s = time.perf_counter() - started
    unshifted = list(np.linspace(1.0, 1.0 / steps, steps))
    common = {"num_inference_steps": steps, "height": height, "width": width,
              "generator": torch.Generator(device="cpu").manual_seed(0)}  # fmt: skip
    started = time.perf_counter()
    with torch.no_grad():
        if family == "sd3":
            result = pipe(VALIDATION_PROMPTS, sigmas=unshifted, guidance_scale=guidance, **common)
        elif family == "flux":
            result = pipe(VALIDATION_PROMPTS, guidance_scale=guidance, **common)
        elif family == "qwen_image":
            result = pipe(VALIDATION_PROMPTS, true_cfg_scale=1.0, **common)
        else:
            pipe.scheduler.set_timesteps = functools.partial(pipe.scheduler.set_timesteps, sigmas=unshifted)
            result = pipe(VALIDATION_PROMPTS, guidance_scale=guidance, num_frames=frames, **common)
    if device == "cuda":
        torch.cuda.synchronize()
    sample_s = time.perf_counter() - started
    pictures = result.frames if family == "wan" else result.images
    saved = []
    for index, picture in enumerate(pictures):
        if family == "wan":  # (frames, H, W, 3) floats in [0, 1]: the first frame
            from PIL import Image

            picture = Image.fromarray((np.asarray(picture[0]) * 255).round().astype("uint8"))
        path = out / f"{family}_served_{index}.png"
        picture.save(path)
        saved.append(str(path))
    return {"class": type(pipe).__name__, "steps": steps, "guidance": guidance, "load_s": load_s,
            "sample_s": sample_s, "prompts": len(VALIDATION_PROMPTS), "pictures": saved}  # fmt: skip


def gpu_name() -> str | None:
    """The device's name from nvidia-smi: this process starts no CUDA context (it would hold GPU memory
    beside the workers' for the whole run)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.splitlines()[0].strip() if done.stdout.strip() else None


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--family", required=True, choices=["sd3", "flux", "qwen_image", "wan"])
    parser.add_argument("--size", default="full", choices=["tiny", "full"])
    parser.add_argument(
        "--layers", type=int, default=None, help="transformer blocks, where a machine forces fewer"
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--work", type=Path, required=True, help="working directory (pipelines, data, runs)")
    parser.add_argument(
        "--report", type=Path, required=True, help="JSON report (merged with an existing one)"
    )
    parser.add_argument(
        "--pictures", type=Path, default=None, help="where served PNGs go (default: beside the report)"
    )
    parser.add_argument("--stages", default="build,prepare,train,export,serve")
    parser.add_argument("--steps", type=int, default=4, help="student steps of each run")
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument(
        "--overrides", nargs="*", default=[], help="more overrides for prepare, train and export"
    )
    parser.add_argument("--light", action="store_true",
                        help="one sample per phase and K=1 (batch.*.micro_batch_size=1, "
                             "batch.*.accumulation_steps=1, algorithm.fake_update_ratio=1): the same path at "
                             "a fraction of the device time; "
                             "per-phase figures stay comparable per sample")  # fmt: skip
    parser.add_argument("--no-resume-check", dest="resume_check", action="store_false",
                        help="train: the straight run only (no SIGTERM, relaunch and comparison)")  # fmt: skip
    args = parser.parse_args()
    stages = args.stages.split(",")
    unknown = sorted(set(stages) - {"build", "prepare", "train", "resume", "export", "serve"})
    if unknown:
        parser.error(f"--stages: unknown {unknown}; allowed build, prepare, train, resume, export, serve")
    if "resume" in stages and not args.resume_check:
        parser.error("--stages resume is the SIGTERM/resume check; it cannot go with --no-resume-check")
    if args.steps < 1 or args.save_every < 1:
        parser.error(f"--steps {args.steps} and --save-every {args.save_every} must be at least 1")
    if {"train", "resume"} & set(stages) and args.resume_check and not 2 <= args.save_every < args.steps - 1:
        parser.error(f"--save-every {args.save_every} with --steps {args.steps}: the SIGTERM comes one step after "
                     "the first periodic checkpoint, and that step must be neither a checkpoint step (the signal's "
                     "own save would be skipped as a duplicate, untested) nor the last: --save-every at least 2 "
                     "and --steps above it by 2 (e.g. --steps 4 --save-every 2), or --no-resume-check")  # fmt: skip
    family, work = args.family, args.work / args.family
    work.mkdir(parents=True, exist_ok=True)
    report = json.loads(args.report.read_text()) if args.report.exists() else {}
    report.update({"family": family, "size": args.size, "layers": args.layers, "device": args.device,
                   "light": args.light, "overrides": args.overrides,
                   "code": code_version(), "torch": torch.__version__,
                   "gpu": gpu_name() if args.device == "cuda" else None})  # fmt: skip
    pictures = args.pictures or args.report.parent
    pictures.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (the resume comparison)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    python = sys.executable
    pipeline, data = work / "pipeline", work / "data"
    height, width, frames = (SHAPES if args.size == "full" else TINY_SHAPES)[family]
    recipe = f"{family}_lora_dmd2"
    common = [f"model.teacher.path={pipeline}", f"data.path={data}", f"prepare.resolution=[{height},{width}]"]
    if frames:
        common.append(f"prepare.num_frames={frames}")
    if args.device == "cpu":
        common += [
            "resources.device=cpu",
            "prepare.device=cpu",
            "model.param_dtype=float32",
            "prepare.dtype=float32",
        ]
    if args.light:
        common += ["batch.student.micro_batch_size=1", "batch.fake_score.micro_batch_size=1",
                   "batch.student.accumulation_steps=1", "batch.fake_score.accumulation_steps=1",
                   "algorithm.fake_update_ratio=1"]  # fmt: skip
    common += args.overrides

    def save() -> None:
        args.report.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")

    try:
        if "build" in stages:
            from verl_dmd.testing.pipelines import build_pipeline

            if pipeline.exists():
                shutil.rmtree(pipeline)
            started = time.perf_counter()
            build_pipeline(family, pipeline, size=args.size, layers=args.layers, device=args.device,
                           guidance_embeds=family == "flux")  # fmt: skip
            report["build"] = {"seconds": time.perf_counter() - started, "bytes": du(pipeline),
                               "components": {p.name: du(p) for p in sorted(pipeline.iterdir()) if p.is_dir()}}  # fmt: skip
            log(f"built {pipeline} ({du(pipeline) / 1e9:.2f} GB) in {report['build']['seconds']:.0f} s")
            save()

        if "prepare" in stages:
            prompts = work / "prompts.txt"
            prompts.write_text("".join(f"{p}\n" for p in PROMPTS))
            validation = work / "validation.txt"
            validation.write_text("".join(f"{p}\n" for p in VALIDATION_PROMPTS))
            if data.exists():
                shutil.rmtree(data)
            command = [python, "-m", "verl_dmd.prepare_main", "--config-name", recipe, *common,
                       f"prepare.prompts={prompts}", f"prepare.validation_prompts={validation}",
                       "prepare.batch_size=4"]  # fmt: skip
            code, seconds, output = run(command, work / "prepare.log", env)
            report["prepare"] = {"seconds": seconds, "exit": code, "bytes": du(data), "command": command}
            save()
            if code != 0:
                log(f"prepare failed ({code}); log: {work / 'prepare.log'}")
                return 1

        train = [f"trainer.total_steps={args.steps}", f"checkpoint.save_every={args.save_every}",
                 "validation.every=0", "validation.num_samples=2", "validation.teacher_steps=4",
                 "resources.workers_per_node=1", "trainer.log_every=1", "trainer.loggers=[console,file]",
                 "export.at_end=false", "checkpoint.keep_last=1"]  # fmt: skip
        # keep_last=1: a full-size run's disk (64 GiB on the lent machine) holds the pipeline, both runs' newest
        # checkpoints and later the merged export (Flux: about 34 + 2 x 2 + 24 GB).
        straight, stopped = work / "run_straight", work / "run_stopped"
        if "train" in stages:
            for run_dir in (straight, stopped):
                if run_dir.exists():
                    shutil.rmtree(run_dir)
            base = [python, "-m", "verl_dmd.main", "--config-name", recipe, *common, *train]
            figures = {}
            command = [*base, f"trainer.output_dir={straight}"]
            code, seconds, output = run(command, work / "train_straight.log",
                                        {**env, "VERL_FILE_LOGGER_PATH": str(work / "metrics_straight.jsonl")})  # fmt: skip
            figures["straight"] = {"seconds": seconds, "exit": code, "code": code_version(), **log_figures(output),
                                   "metrics": summarise_metrics(metrics_of(work / "metrics_straight.jsonl")),
                                   "command": command}  # fmt: skip
            report["train"] = figures
            save()
            if code != 0:
                log(f"training failed ({code}); log: {work / 'train_straight.log'}")
                return 1
            if not args.resume_check:
                figures["comparison"] = "not run (--no-resume-check)"
                save()
                log("train: the straight run only (--no-resume-check)")
        if ("train" in stages and args.resume_check) or "resume" in stages:
            figures = report.setdefault("train", {})
            base = [python, "-m", "verl_dmd.main", "--config-name", recipe, *common, *train]
            if "train" not in stages:  # the straight run of an earlier invocation: the same run, finished
                earlier = figures.get("straight", {})
                problem = None
                if not (straight / "checkpoints" / f"global_step_{args.steps}").is_dir():
                    problem = f"{straight} has no checkpoint global_step_{args.steps}"
                elif earlier.get("exit") != 0:
                    problem = f"the report's straight run exited {earlier.get('exit')}"
                elif earlier.get("command") != [*base, f"trainer.output_dir={straight}"]:
                    problem = (
                        "the report's straight run used another command (steps, overrides, --light or paths)"
                    )
                elif earlier.get("code") != code_version():
                    problem = f"the straight run ran code {earlier.get('code')}, this is {code_version()}"
                if problem:
                    log(f"--stages resume compares against the straight run of an earlier --stages train, but "
                        f"{problem}: run --stages train --no-resume-check with these arguments first")  # fmt: skip
                    return 1
            for stale in (
                "stopped",
                "resumed",
                "comparison",
                "checkpoints",
                "checkpoint_bytes",
                "sigterm_exit",
            ):
                figures.pop(stale, None)
            if stopped.exists():
                shutil.rmtree(stopped)
            command = [*base, f"trainer.output_dir={stopped}"]
            stop_env = {**env, "VERL_FILE_LOGGER_PATH": str(work / "metrics_stopped.jsonl")}
            code, seconds, output = run_until_stopped(command, work / "train_stopped.log", stop_env,
                                                      args.save_every + 1, args.steps)  # fmt: skip
            figures["stopped"] = {
                "seconds": seconds,
                "exit": code,
                "code": code_version(),
                **log_figures(output),
            }
            if code != 128 + signal.SIGTERM or "stopped by SIGTERM" not in output:
                log(
                    f"the stopped run did not stop on SIGTERM (exit {code}); log: {work / 'train_stopped.log'}"
                )
                save()
                return 1
            stop_env["VERL_FILE_LOGGER_PATH"] = str(work / "metrics_resumed.jsonl")
            code2, seconds, output = run(command, work / "train_resumed.log", stop_env)
            figures["resumed"] = {
                "seconds": seconds,
                "exit": code2,
                "code": code_version(),
                **log_figures(output),
            }
            if code2 == 0 and "resumed from" not in output:
                log("the relaunch did not resume from a checkpoint")
                code2 = 1
            final = f"global_step_{args.steps}"
            checkpoints = sorted((straight / "checkpoints").glob("global_step_*"))
            figures["checkpoint_bytes"] = du(straight / "checkpoints" / final)
            figures["checkpoints"] = [c.name for c in checkpoints]
            figures["sigterm_exit"] = code
            if code2 == 0:
                figures["comparison"] = compare_checkpoints(straight / "checkpoints" / final,
                                                            stopped / "checkpoints" / final)  # fmt: skip
                log(f"resume comparison: {figures['comparison']}")
            save()
            if code2 != 0:
                log(f"the resumed run failed ({code2}); log: {work / 'train_resumed.log'}")
                return 1
            if figures.get("comparison", {}).get("bitwise_equal"):  # disk: compared, no longer needed
                shutil.rmtree(stopped / "checkpoints", ignore_errors=True)

        export_dir = work / "export"
        if "export" in stages:
            if export_dir.exists():
                shutil.rmtree(export_dir)
            checkpoint = straight / "checkpoints" / f"global_step_{args.steps}"
            command = [python, "-m", "verl_dmd.export_main", "--config-name", recipe, *common, *train,
                       f"trainer.output_dir={straight}", f"export.formats={FORMATS[family]}",
                       f"export.pipeline_source={pipeline}", f"export.output_dir={export_dir}",
                       f"checkpoint.resume={checkpoint}"]  # fmt: skip
            code, seconds, output = run(command, work / "export.log", env)
            report["export"] = {"seconds": seconds, "exit": code, "bytes": du(export_dir), "command": command}
            save()
            if code != 0:
                log(f"export failed ({code}); log: {work / 'export.log'}")
                return 1

        if "serve" in stages:
            exported = sorted(export_dir.rglob("model_index.json"))
            target = next(p.parent.parent for p in exported if p.parent.name == "pipeline")
            report["serve"] = serve(family, target, args.device, height, width, frames, pictures)
            log(f"served: {report['serve']}")
            save()
    finally:
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
