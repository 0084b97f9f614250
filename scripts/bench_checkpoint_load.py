"""Load time of a checkpoint's engine state with and without SHA-256 verification.

Writes one published checkpoint (DCP engine directory + manifest, through the same
`DeterministicWriter` and `CheckpointStore.publish` a run uses) of about --gib GiB
of float32 tensors, one rank, then times filling a same-shaped state dict from it:

- ``dcp-reader``: torch's own `FileSystemReader` (no verification; unpickles the metadata
  with the standard unpickler: what verl_dmd did before issue 17);
- ``sizes-only``: `VerifiedReader` without hashes (``checkpoint.verify_hashes=false``);
- ``verified``: `VerifiedReader` hashing every byte as it reads (the default);
- ``two-pass``: a SHA-256 pass over every file, then `FileSystemReader` (what
  ``verify_hashes=true`` cost before: the files read twice).

The files are in the page cache after the write (and after each pass): these are warm-cache
times, where hashing is the largest share; from a cold disk the read itself dominates. Each
mode runs --repeats times, interleaved, and the median is printed with its ratio to
``sizes-only`` measured in the same run.

    python scripts/bench_checkpoint_load.py --gib 1.1 --repeats 5
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verl_dmd.checkpoint.safe_io import DeterministicWriter, VerifiedReader
from verl_dmd.checkpoint.store import CheckpointStore, file_sha256


def state_of(gib: float) -> dict[str, torch.Tensor]:
    """Tensors of a transformer's shapes (3072-wide, as SD3/Flux) adding up to `gib` GiB."""
    shapes = [(3072, 3072), (3072,), (12288, 3072), (3072, 12288), (64, 3072), (3072, 64)]
    state, total, index = {}, 0, 0
    generator = torch.Generator().manual_seed(0)
    while total < gib * 2**30:
        shape = shapes[index % len(shapes)]
        state[f"param/block{index // len(shapes)}.{index % len(shapes)}"] = torch.randn(
            *shape, generator=generator
        )
        total += state[next(reversed(state))].numel() * 4
        index += 1
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    import torch.distributed.checkpoint as dcp

    work = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        state = state_of(args.gib)
        store = CheckpointStore(work / "checkpoints")
        staging = store.begin(1)
        dcp.save(state, storage_writer=DeterministicWriter(str(staging / "engine")), no_dist=True)
        checkpoint = store.publish(staging, global_step=1, fingerprint="bench", world_size=1)
        files = checkpoint.manifest["files"]
        size = sum(entry["size"] for entry in files.values())
        expected = {k.removeprefix("engine/"): v["sha256"] for k, v in files.items()}
        engine = checkpoint.path / "engine"
        target = {k: torch.empty_like(v) for k, v in state.items()}

        def dcp_reader():
            dcp.load(target, storage_reader=dcp.FileSystemReader(str(engine)), no_dist=True)

        def sizes_only():
            reader = VerifiedReader(engine, None)
            dcp.load(target, storage_reader=reader, no_dist=True)
            assert not reader.damaged

        def verified():
            reader = VerifiedReader(engine, expected)
            dcp.load(target, storage_reader=reader, no_dist=True)
            assert not reader.damaged, reader.damaged

        def two_pass():
            for relative, entry in files.items():
                assert file_sha256(checkpoint.path / relative) == entry["sha256"]
            dcp_reader()

        modes = {
            "dcp-reader": dcp_reader,
            "sizes-only": sizes_only,
            "verified": verified,
            "two-pass": two_pass,
        }
        times: dict[str, list[float]] = {name: [] for name in modes}
        for fn in modes.values():  # warm-up: page cache, allocator
            fn()
        for _ in range(args.repeats):
            for name, fn in modes.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        assert all(torch.equal(target[k], state[k]) for k in state)
        base = statistics.median(times["sizes-only"])
        print(f"checkpoint: {size / 2**30:.2f} GiB in {len(files)} files, {len(state)} tensors; "
              f"torch {torch.__version__}; median of {args.repeats}")  # fmt: skip
        print("| mode | load (s) | GiB/s | vs sizes-only |")
        print("|---|---|---|---|")
        for name, values in times.items():
            median = statistics.median(values)
            print(f"| {name} | {median:.3f} | {size / 2**30 / median:.2f} | {median / base:.2f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
