"""Sleep/wake benchmark: time and bandwidth of `StateOffloader` next to a raw pinned copy of the same bytes.

One process, one device, no ray: builds the role engine for an SD3-shaped
transformer of configurable size (random init), creates both optimizers' state
(AdamW's zero state, as after a first step), then measures in the same run

- a raw copy of the same number of bytes between one device tensor and one
  pinned host tensor, each way (the physical reference);
- `sleep()` and `wake()`: the first round (pinned allocation included) and the
  steady state (median of --repeats rounds), in seconds and GB/s of state moved;
- device memory allocated and reserved before and after sleep.

    python scripts/bench_offload.py --device cuda --layers 24 --hidden 1536 --repeats 5 --json out.json

On CPU (``--device cpu``) it runs the same steps with ordinary host memory (a
smoke run; the numbers mean nothing there). docs/benchmarks.md has the results.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GB = 1e9


def code_version() -> str:
    """The code a result comes from, for its JSON: $VERL_DMD_COMMIT (a copy without .git, as on the
    lent GPU machine), else git's short commit (+"-dirty" with uncommitted changes), else "unknown"."""
    if os.environ.get("VERL_DMD_COMMIT"):
        return os.environ["VERL_DMD_COMMIT"]
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                text=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def sd3_config(layers: int, hidden: int) -> dict:
    heads = hidden // 64
    return {
        "sample_size": 128, "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": layers,
        "attention_head_dim": 64, "num_attention_heads": heads, "joint_attention_dim": 4096,
        "caption_projection_dim": hidden, "pooled_projection_dim": 2048, "pos_embed_max_size": 192,
    }  # fmt: skip


def build_engine(args):
    from verl_dmd.adapters import get_adapter
    from verl_dmd.checkpoint.engine_state import engine_state
    from verl_dmd.plan import DistillationPlan
    from verl_dmd.runtime.engine import RoleEngine

    rank = 0 if args.layout == "independent" else args.lora_rank
    plan = DistillationPlan.from_config({
        "model": {"adapter": "sd3", "storage": args.layout, "param_dtype": "bfloat16",
                  "teacher": {"config": sd3_config(args.layers, args.hidden)},
                  "student": {"lora": {"rank": rank}}, "fake_score": {"lora": {"rank": rank}}},
        "data": {"name": "synthetic"},
        "export": {"formats": ["diffusers"]},
    })  # fmt: skip
    engine = RoleEngine(plan, get_adapter("sd3")(), device=args.device)
    engine_state(engine)  # creates both optimizers' AdamW state (zeros, as a first step would)
    return engine


def timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def raw_copies(nbytes: int, device: torch.device, repeats: int) -> tuple[list[float], list[float]]:
    """The physical reference: the same bytes, one device tensor <-> one pinned host tensor, each way."""
    cuda = device.type == "cuda"
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    d2h = [timed(lambda: host.copy_(source, non_blocking=cuda), device) for _ in range(repeats)]
    h2d = [timed(lambda: source.copy_(host, non_blocking=cuda), device) for _ in range(repeats)]
    return d2h, h2d


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layout", choices=["independent", "shared_base_adapters"], default="independent")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--lora-rank", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--keep-reserved", action="store_true",
                        help="sleep(release=False): freed blocks stay in this process's caching allocator")  # fmt: skip
    parser.add_argument("--no-pack", action="store_true",
                        help="StateOffloader(pack=False): wake allocates through the caching allocator as usual")  # fmt: skip
    parser.add_argument("--no-coalesce", action="store_true",
                        help="leave small storages where they are (StateOffloader(coalesce_below=0))")  # fmt: skip
    parser.add_argument("--chunk-mb", type=int, default=None,
                        help="packed wake: device memory reserved at a time (default: the offloader's, 64)")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    from verl_dmd.runtime.offload import StateOffloader

    engine = build_engine(args)
    options = {"coalesce_below": 0} if args.no_coalesce else {}
    if args.chunk_mb is not None:
        options["chunk_bytes"] = args.chunk_mb << 20
    offloader = StateOffloader(engine, pack=not args.no_pack, **options)

    def segments() -> int:
        return torch.cuda.memory_stats(device).get("segment.all.current", 0) if cuda else 0

    cuda = device.type == "cuda"
    probe = [t for t in offloader.state_tensors() if t.device.type == device.type]

    def checksums() -> list[int]:
        """An exact checksum of every byte of every state tensor (after the timed rounds, untimed)."""
        return torch.stack(
            [t.detach().reshape(-1).contiguous().view(torch.uint8).sum(dtype=torch.int64) for t in probe]
        ).tolist()

    checksum = checksums()
    allocated = torch.cuda.memory_allocated(device) if cuda else 0
    reserved = torch.cuda.memory_reserved(device) if cuda else 0
    segments_before = segments()

    release = not args.keep_reserved

    def sleep():
        offloader.sleep(release=release)

    first_sleep = timed(sleep, device)
    nbytes = offloader.nbytes
    if nbytes == 0:
        raise SystemExit("no state found on the device: nothing to measure")
    info = dict(offloader.last)
    allocated_asleep = torch.cuda.memory_allocated(device) if cuda else 0
    reserved_asleep = torch.cuda.memory_reserved(device) if cuda else 0
    first_wake = timed(offloader.wake, device)
    sleeps, wakes, sleep_copies, prepares, releases = [], [], [], [], []
    for _ in range(args.repeats):
        sleeps.append(timed(sleep, device))
        sleep_copies.append(offloader.last["sleep_copy_s"])
        prepares.append(offloader.last["sleep_prepare_s"])
        releases.append(offloader.last["sleep_release_s"])
        wakes.append(timed(offloader.wake, device))
    segments_awake = segments()
    reserved_awake_steady = torch.cuda.memory_reserved(device) if cuda else 0
    offloader.sleep(release=release)
    segments_asleep = segments()
    # After the steady rounds, not only after the first sleep: a pool that keeps its segments shows here.
    reserved_asleep_steady = torch.cuda.memory_reserved(device) if cuda else 0
    offloader.wake()
    assert checksums() == checksum, "state changed across sleep/wake"

    d2h, h2d = raw_copies(nbytes, device, args.repeats)

    median = statistics.median
    result = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "code": code_version(),
        "layout": args.layout,
        "release": release,
        "layers": args.layers,
        "hidden": args.hidden,
        "state_bytes": nbytes,
        "pinned_alloc_s": info["pinned_alloc_s"],
        "first_sleep_s": first_sleep,
        "first_wake_s": first_wake,
        "sleep_s": median(sleeps),
        "wake_s": median(wakes),
        "sleep_copy_s": median(sleep_copies),
        "sleep_prepare_s": median(prepares),
        "sleep_release_s": median(releases),
        "raw_d2h_s": median(d2h),
        "raw_h2d_s": median(h2d),
        "allocated_before": allocated,
        "reserved_before": reserved,
        "allocated_asleep": allocated_asleep,
        "reserved_asleep": reserved_asleep,
        "pack": offloader.pack,
        "chunk_bytes": offloader.chunk_bytes,
        "coalesce_below": offloader.coalesce_below,
        "coalesced_storages": int(info.get("coalesced_storages", 0)),
        "coalesce_rejected": int(info.get("coalesce_rejected", 0)),
        "storages": int(info.get("storages", 0)),
        "segments_before": segments_before,
        "segments_awake_steady": segments_awake,
        "reserved_awake_steady": reserved_awake_steady,
        "segments_asleep_steady": segments_asleep,
        "reserved_asleep_steady": reserved_asleep_steady,
    }
    gbs = {
        k: nbytes / GB / result[k]
        for k in ("sleep_s", "wake_s", "raw_d2h_s", "raw_h2d_s", "first_sleep_s", "first_wake_s")
    }
    print(
        f"state: {nbytes / 2**30:.2f} GiB ({args.layout}, {args.layers} layers x {args.hidden}) on {result['device']}"
    )
    print("| what | seconds | GB/s | vs raw pinned |")
    print("|---|---|---|---|")
    print(f"| raw copy device->host (pinned) | {result['raw_d2h_s']:.3f} | {gbs['raw_d2h_s']:.1f} | 1.00 |")
    print(f"| raw copy host->device (pinned) | {result['raw_h2d_s']:.3f} | {gbs['raw_h2d_s']:.1f} | 1.00 |")
    print(
        f"| sleep, first (pinned allocation {result['pinned_alloc_s']:.2f} s) | {first_sleep:.3f} | {gbs['first_sleep_s']:.1f} | {result['raw_d2h_s'] / first_sleep:.2f} |"
    )
    print(
        f"| wake, first | {first_wake:.3f} | {gbs['first_wake_s']:.1f} | {result['raw_h2d_s'] / first_wake:.2f} |"
    )
    print(
        f"| sleep, steady (median of {args.repeats}) | {result['sleep_s']:.3f} | {gbs['sleep_s']:.1f} | {result['raw_d2h_s'] / result['sleep_s']:.2f} |"
    )
    print(
        f"| wake, steady (median of {args.repeats}) | {result['wake_s']:.3f} | {gbs['wake_s']:.1f} | {result['raw_h2d_s'] / result['wake_s']:.2f} |"
    )
    print(f"sleep, steady: prepare {result['sleep_prepare_s'] * 1e3:.1f} ms, copy {result['sleep_copy_s'] * 1e3:.1f} ms, "
          f"release to the driver (empty_cache) {result['sleep_release_s'] * 1e3:.1f} ms")  # fmt: skip
    if cuda:
        print(f"device memory: allocated {allocated / 2**30:.2f} -> {allocated_asleep / 2**30:.3f} GiB asleep "
              f"({allocated_asleep / max(allocated, 1):.1%}); reserved {reserved / 2**30:.2f} -> "
              f"{reserved_asleep / 2**30:.3f} GiB")  # fmt: skip
        print(f"storages moved: {result['storages']} ({result['coalesced_storages']} small ones coalesced into "
              f"shared buffers at the first sleep, {result['coalesce_rejected']} left: a holder outside the state)")  # fmt: skip
        print(f"allocator segments: {segments_before} at the start, {segments_awake} awake after the steady "
              f"rounds, {segments_asleep} asleep; reserved asleep after the steady rounds "
              f"{reserved_asleep_steady / 2**30:.3f} GiB, awake {reserved_awake_steady / 2**30:.2f} GiB")  # fmt: skip
        if release and reserved_asleep_steady > 0.05 * reserved:
            print("WARNING: sleep(release=True) did not return the memory in the steady rounds")
        if reserved_awake_steady > 1.02 * reserved:
            print("WARNING: the steady rounds reserve more device memory than before the first sleep")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    offloader = engine = probe = None  # read by the closures above; dropped here for the collection
    gc.collect()  # the model's reference cycles hold the group: collected before it goes (architecture.md)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
