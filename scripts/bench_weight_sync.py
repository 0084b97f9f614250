"""Time and memory of one weight sync: a LoRA role gathered from sharded gloo ranks into rank 0's replica.

Builds a pipeline directory (the tiny SD3 pipeline of `verl_dmd.testing.pipelines` with an SD3-shaped
transformer of --layers x --hidden in place of its own), starts each of --world-sizes gloo ranks in turn (CPU) that each
build a `RankSession` on it (shared LoRA roles, rank 64 on to_q/k/v/out), sets the student_ema adapter to
random values, syncs once untimed (building the replica: diffusers maps its weight files, and the first
copy makes them resident), then times `sync_replica("student_ema")` --repeats times. Reported: the median
seconds, the largest full tensors alive at once on a rank (`gathered_peak_bytes`) against the
transformer's float32 bytes, and rank 0's peak resident memory growth (ru_maxrss, which only rises) during
the first sync and during the timed ones. JSON to --out, a line to stdout.

    python scripts/bench_weight_sync.py --layers 8 --hidden 1536 --world-sizes 1,2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_offload import code_version, sd3_config


def build_pipeline_dir(root: Path, layers: int, hidden: int) -> Path:
    import shutil

    from diffusers import SD3Transformer2DModel

    from verl_dmd.testing.pipelines import build_pipeline

    pipeline = build_pipeline("sd3", root / "pipeline")
    shutil.rmtree(pipeline / "transformer")
    torch.manual_seed(0)
    SD3Transformer2DModel.from_config(sd3_config(layers, hidden)).save_pretrained(
        str(pipeline / "transformer")
    )
    return pipeline


def plan_for(pipeline: Path, output_dir: Path):
    from verl_dmd.plan import DistillationPlan

    lora = {"rank": 64, "alpha": 64}
    return DistillationPlan.from_config({
        "model": {"adapter": "sd3", "storage": "shared_base_adapters",
                  "teacher": {"path": str(pipeline), "subfolder": "transformer"},
                  "student": {"lora": lora}, "fake_score": {"lora": lora}},
        "data": {"name": "synthetic"}, "trainer": {"output_dir": str(output_dir), "seed": 0},
    })  # fmt: skip


def rank_main(rank: int, world_size: int, pipeline: str, output_dir: str, store_path: str, repeats: int,
              out: str) -> None:  # fmt: skip
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size
    )
    from verl_dmd.runtime import lora
    from verl_dmd.workers.session import RankSession

    session = RankSession(plan_for(Path(pipeline), Path(output_dir)), rank=rank, world_size=world_size)
    generator = torch.Generator().manual_seed(1 + rank)
    with torch.no_grad():  # any values: each rank's shards of the EMA adapter
        for name, param in session.engine.models["base"].named_parameters():
            if lora.adapter_of(name) == "student_ema":
                shard = param.to_local()
                shard.copy_(torch.randn(shard.shape, generator=generator) * 0.02)
    rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    session.sync_replica("student_ema")  # untimed: builds the replica and makes its weights resident
    dist.barrier()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds, results = [], []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        result = session.sync_replica("student_ema")
        dist.barrier()
        seconds.append(time.perf_counter() - started)
        results.append(result)
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if rank == 0:
        transformer = session._replica().components["transformer"]
        model_bytes = sum(p.numel() * p.element_size() for p in transformer.parameters())
        Path(out).write_text(json.dumps({
            "world_size": world_size, "repeats": repeats, "median_s": statistics.median(seconds),
            "seconds": seconds, "gathered_peak_bytes": results[-1]["gathered_peak_bytes"],
            "transformer_bytes": model_bytes, "rss_growth_bytes": (rss_after - rss_before) * 1024,
            "first_sync_rss_growth_bytes": (rss_before - rss_start) * 1024,
            "version": results[-1]["version"],
        }))  # fmt: skip
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512, help="a multiple of 64 (the head dimension)")
    parser.add_argument(
        "--world-sizes", default="1,2", help="comma-separated; each runs on the same pipeline"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="weight_sync.json")
    args = parser.parse_args(argv)
    if args.hidden % 64:
        parser.error(f"--hidden {args.hidden}: must be a multiple of 64 (attention_head_dim)")
    sizes = [int(w) for w in args.world_sizes.split(",")]
    import torch.multiprocessing as mp

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        pipeline = build_pipeline_dir(root, args.layers, args.hidden)
        for world_size in sizes:
            result_file = root / f"result-{world_size}.json"
            mp.spawn(rank_main, args=(world_size, str(pipeline), str(root / f"run-{world_size}"),
                                      str(root / f"store-{world_size}"), args.repeats, str(result_file)),
                     nprocs=world_size)  # fmt: skip
            runs.append(json.loads(result_file.read_text()))
    base = runs[0]["median_s"]
    for run in runs:
        run["vs_first"] = run["median_s"] / base
    result = {"layers": args.layers, "hidden": args.hidden, "commit": code_version(), "threads_per_rank": 1,
              "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPUs, gloo", "runs": runs}  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for run in runs:
        print(
            f"sync of student_ema over {run['world_size']} gloo rank(s): median {run['median_s']:.2f} s "
            f"({run['vs_first']:.2f}x the first); transformer {run['transformer_bytes'] / 2**20:.0f} MiB, largest "
            f"gathered at once {run['gathered_peak_bytes'] / 2**20:.1f} MiB, rank 0 RSS growth "
            f"{run['rss_growth_bytes'] / 2**20:.0f} MiB (first sync {run['first_sync_rss_growth_bytes'] / 2**20:.0f} MiB)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
