"""What returning freed device memory to the CUDA driver costs, and whether it waits for running copies.

1. `torch.cuda.empty_cache()` after freeing 15 GB held in 1 to 3,840 segments of the caching
   allocator (and in one segment reserved first and cut into the same tensors);
2. `empty_cache()` issued while a 4 GB device-to-host copy runs on another stream (and on the
   current one): does it return before the copy is done?

    python scripts/bench_release.py        # writes $OUT/release.json (or /tmp/release.json)

It needs a CUDA device with about 20 GB free. docs/benchmarks.md has the H200 results; they were
taken with this code run from a scratch copy (same statements) on 2026-12-01.
"""

import json
import os
import time
from pathlib import Path

import torch

dev = torch.device("cuda", 0)
GB = 1 << 30
TOTAL = 15 * GB
out = {}


def t():
    torch.cuda.synchronize()
    return time.perf_counter()


def release_cost(sizes, label, reserve=False):
    torch.cuda.empty_cache()
    if reserve:
        # one segment first, freed to the cache; the tensors below are carved from it
        big = torch.empty(sum(-(-s // 512) * 512 for s in sizes), dtype=torch.uint8, device=dev)
        del big
    xs = [torch.empty(s, dtype=torch.uint8, device=dev) for s in sizes]
    stats = torch.cuda.memory_stats()
    segs = stats["segment.all.current"]
    torch.cuda.synchronize()
    del xs
    t0 = t()
    torch.cuda.empty_cache()
    t1 = t()
    out[label] = {"segments": segs, "release_ms": (t1 - t0) * 1e3}
    print(label, out[label], flush=True)


for rep in range(2):
    release_cost([TOTAL], f"1x15GB r{rep}")
    release_cost([GB] * 15, f"15x1GB r{rep}")
    release_cost([100 * 2**20] * 153, f"153x100MB r{rep}")
    release_cost([12 * 2**20] * 1280, f"1280x12MB r{rep}")
    release_cost([4 * 2**20] * 3840, f"3840x4MB r{rep}")
    release_cost([12 * 2**20] * 1280, f"1280x12MB reserved r{rep}", reserve=True)
    release_cost([4 * 2**20] * 3840, f"3840x4MB reserved r{rep}", reserve=True)
    release_cost([600 * 1024] * 2000 + [12 * 2**20] * 1180, f"mixed small+12MB reserved r{rep}", reserve=True)

# Does cudaFree wait for a copy running on another stream?
a = torch.empty(4 * GB, dtype=torch.uint8, device=dev)
host = torch.empty(4 * GB, dtype=torch.uint8, pin_memory=True)
s = torch.cuda.Stream()
t0 = t()
with torch.cuda.stream(s):
    host.copy_(a, non_blocking=True)
torch.cuda.synchronize()
copy_ms = (time.perf_counter() - t0) * 1e3
for rep in range(3):
    b = torch.empty(GB, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        host.copy_(a, non_blocking=True)
    q = time.perf_counter()
    del b
    torch.cuda.empty_cache()
    r = time.perf_counter()
    done = s.query()
    torch.cuda.synchronize()
    e = time.perf_counter()
    res = {
        "copy_ms": copy_ms,
        "empty_cache_returned_ms": (r - q) * 1e3,
        "copy_done_when_returned": done,
        "all_done_ms": (e - q) * 1e3,
    }
    out[f"overlap r{rep}"] = res
    print("overlap", res, flush=True)

# Same with the copy on the current stream
for rep in range(2):
    b = torch.empty(GB, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()
    host.copy_(a, non_blocking=True)
    q = time.perf_counter()
    del b
    torch.cuda.empty_cache()
    r = time.perf_counter()
    torch.cuda.synchronize()
    e = time.perf_counter()
    out[f"overlap same stream r{rep}"] = {
        "empty_cache_returned_ms": (r - q) * 1e3,
        "all_done_ms": (e - q) * 1e3,
    }
    print("same stream", out[f"overlap same stream r{rep}"], flush=True)

Path(os.environ.get("OUT", "/tmp"), "release.json").write_text(json.dumps(out, indent=1))
