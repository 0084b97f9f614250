"""The seeds of every random stream: hashed from named parts, never computed by arithmetic.

A stream is named by its parts, e.g. ``(trainer.seed, "dmd2.local", rank)``; its seed
is the 64-bit BLAKE2b hash of the parts joined by "/". Hashing matters twice over:
torch's CPU generator keeps only the low 32 bits of a seed, so arithmetic that moves
the run seed into high bits (``seed * 1_000_003 + rank``) silently drops it, and
arithmetic seeds of different streams can coincide (``seed + 1`` of one run is
``seed`` of the next). Distinct parts give distinct streams in practice.

Layer 1: the standard library and torch only.
"""

from __future__ import annotations

import hashlib

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


def seed_global_torch(*parts: object) -> None:
    """Seed torch's global RNG for the stream named by `parts`; model construction draws from it
    (random init of configs, LoRA factors), so every rank seeds it alike before building."""
    torch.manual_seed(stream_seed(*parts))
