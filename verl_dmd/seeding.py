"""The seeds of every random stream: hashed from named parts, never computed by arithmetic.

A stream is named by its parts, e.g. ``(trainer.seed, "dmd2.local", rank)``; its seed
is the 64-bit BLAKE2b hash of the parts joined by "/". Hashing matters twice over:
torch's CPU generator keeps only the low 32 bits of a seed, so arithmetic that moves
the run seed into high bits (``seed * 1_000_003 + rank``) silently drops it, and
arithmetic seeds of different streams can coincide (``seed + 1`` of one run is
``seed`` of the next). Distinct parts give distinct streams in practice.

Layer 1: the standard library, torch and numpy only.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch


def stream_seed(*parts: object) -> int:
    """A 64-bit seed hashed from `parts` (each turned into text with `str`)."""
    if not parts:
        raise ValueError("stream_seed needs at least one part naming the stream")
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def generator(*parts: object) -> torch.Generator:
    """A new CPU generator seeded for the stream named by `parts`."""
    return torch.Generator().manual_seed(stream_seed(*parts))


def seed_models(seed: int) -> None:
    """Seed torch's global RNG, which model construction draws from (random init of a config-built model,
    LoRA factors), alike on every rank and in export.

    Seeded with the run seed itself, not a hash: the frozen base of a config-built model is not in a
    checkpoint but rebuilt from this seed, so its value is part of every checkpoint written so far.
    """
    torch.manual_seed(seed)


def seed_host_generators(seed: int, rank: int) -> None:
    """Seed this process's global numpy and python generators for rank `rank` of the run.

    verl_dmd draws from neither; they are seeded anyway (at session start) because they are saved in
    every checkpoint's RNG file and a user's computer may draw from them: unseeded, each process starts
    them from OS entropy and two identical runs would save different files.
    """
    import random

    import numpy as np

    np.random.seed(stream_seed(seed, "numpy", rank) % 2**32)
    random.seed(stream_seed(seed, "python", rank))


def fixed_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with the plain constant `seed`: only for the draws of a measuring instrument
    whose recorded results rest on them (the digits evaluation's noise and its classifier: every digits
    table in docs/benchmarks.md was measured with exactly these). Training streams use `generator`."""
    return torch.Generator().manual_seed(seed)


@contextlib.contextmanager
def fixed_global_torch(seed: int) -> Iterator[None]:
    """Run a block with torch's global RNG seeded with the constant `seed` (module init and dropout draw
    from it) and give the caller's RNG state back afterwards: nothing outside the block sees the draws.
    For measuring instruments, as `fixed_generator`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def use_deterministic_kernels() -> None:
    """Deterministic kernels for this process (`resources.deterministic`): cuBLAS's fixed workspace (set
    before its first handle: workers call this before building any model), torch's deterministic algorithms
    (strict: ops with a deterministic variant use it, e.g. the flash and memory-efficient attention
    backward; an op without one raises, naming itself), cuDNN without autotuning."""
    import os

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
