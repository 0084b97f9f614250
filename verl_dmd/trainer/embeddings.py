"""The `embeddings` data provider: precomputed text embeddings for SD3, Flux, Wan or Qwen-Image runs.

DMD2 needs conditions, not images: ``data.path`` is a safetensors file, or a
directory of them (read in name order as one data set), each holding

- ``cond.<name>``: one row per prompt, named as the model adapter's `predict`
  reads them (SD3: ``cond.encoder_hidden_states`` (N, L, D) and
  ``cond.pooled_projections`` (N, D); Flux the same; Wan and Qwen-Image
  ``cond.encoder_hidden_states``);
- ``uncond.<name>`` (needed when the teacher uses CFG, i.e. its standard-form scale is not 1): one
  row for all prompts (the empty prompt) or one per prompt;
- optionally ``real.x0`` and ``real.cond.<name>`` (one per prompt) for the GAN term;
- the header metadata ``latent_shape``: the shape of one latent, comma separated
  (``16,128,128`` for SD3 at 1024 px; ``4096,64`` for Flux's packed tokens).

Rows are read lazily (memory stays bounded by the batch). Sample p of the
stream is fully determined by (seed, p): its row is entry ``p mod N`` of epoch
``p // N``'s permutation (identity with ``data.shuffle=false``) and its noise
comes from a generator seeded from (seed, p); the state is that one position,
as for digits.
"""

from __future__ import annotations

from pathlib import Path

import torch

from verl_dmd.seeding import generator
from verl_dmd.trainer.registry import register_data_provider

PREFIXES = ("cond.", "uncond.", "real.")


@register_data_provider("embeddings")
class EmbeddingsProvider:
    """Global batches of precomputed embeddings (see the module docstring); `state_dict` is its position."""

    validator = None  # no built-in validator decodes these samples yet

    @classmethod
    def from_plan(cls, plan, group, info, log=print) -> EmbeddingsProvider:
        return cls(plan)

    @classmethod
    def preflight(cls, plan) -> None:
        """Check data.path as `from_plan` will, before any worker starts (headers only: no tensor is read)."""
        cls(plan)

    def __init__(self, plan) -> None:
        from safetensors import safe_open

        if not plan.data.path:
            raise ValueError("config key 'data.path' = None: the embeddings provider reads a safetensors file or "
                             "directory; fix: set data.path")  # fmt: skip
        root = Path(plan.data.path).expanduser()
        files = sorted(root.glob("*.safetensors")) if root.is_dir() else [root]
        if not files or not all(f.is_file() for f in files):
            raise ValueError(f"config key 'data.path' = {str(root)!r}: no .safetensors files there; fix: point it "
                             "at prepared embeddings (docs/quickstart.md)")  # fmt: skip
        self.seed, self.shuffle = plan.trainer.seed, plan.data.shuffle
        self.position = 0
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._rows: list[tuple[int, int]] = []  # global row -> (file, row)
        keys: set[str] | None = None
        shape = None
        for number, handle in enumerate(self._handles):
            names = set(handle.keys())
            per_row = {k for k in names if k.startswith(("cond.", "real."))}
            if keys is None:
                keys = names
            elif names != keys:
                raise ValueError(f"config key 'data.path': {files[number].name} holds {sorted(names)}, "
                                 f"{files[0].name} holds {sorted(keys)}; fix: write every shard with the same keys")  # fmt: skip
            if not any(k.startswith("cond.") for k in names):
                raise ValueError(f"config key 'data.path': {files[number].name} has no cond.* tensors; fix: store "
                                 "the text embeddings as cond.<name>")  # fmt: skip
            counts = {handle.get_slice(k).get_shape()[0] for k in per_row}
            if len(counts) != 1:
                raise ValueError(f"config key 'data.path': {files[number].name}: cond.*/real.* tensors disagree on "
                                 f"the number of rows {sorted(counts)}")  # fmt: skip
            meta = (handle.metadata() or {}).get("latent_shape")
            if meta is None:
                raise ValueError(f"config key 'data.path': {files[number].name} has no 'latent_shape' metadata; "
                                 "fix: write it (e.g. '16,128,128') when saving the embeddings")  # fmt: skip
            file_shape = tuple(int(v) for v in meta.split(","))
            if shape is not None and file_shape != shape:
                raise ValueError(f"config key 'data.path': latent_shape {file_shape} in {files[number].name}, "
                                 f"{shape} before")  # fmt: skip
            shape = file_shape
            self._rows += [(number, r) for r in range(counts.pop())]
        self.keys = sorted(keys)
        self.latent_shape = shape
        from verl_dmd.losses import standard_guidance_scale

        for number, handle in enumerate(self._handles):
            mine = sum(1 for f, _ in self._rows if f == number)
            for key in (k for k in self.keys if k.startswith("uncond.")):
                rows = handle.get_slice(key).get_shape()[0]
                if rows not in (1, mine):
                    raise ValueError(f"config key 'data.path': {files[number].name}: {key} has {rows} rows; "
                                     f"allowed: 1 (one empty prompt for all) or {mine} (one per prompt)")  # fmt: skip
        if standard_guidance_scale(
            plan.algorithm.teacher_guidance_scale, plan.algorithm.cfg_form
        ) != 1.0 and not any(k.startswith("uncond.") for k in self.keys):
            raise ValueError("config key 'algorithm.teacher_guidance_scale' != 1 needs uncond.* tensors in data.path "
                             "(the empty prompt's embeddings); fix: add them, or set the scale to 1")  # fmt: skip
        self._order: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self._rows)

    def _row(self, position: int) -> int:
        epoch, offset = divmod(position, len(self._rows))
        if not self.shuffle:
            return offset
        if self._order is None or self._order[0] != epoch:
            self._order = (
                epoch,
                torch.randperm(len(self._rows), generator=generator(self.seed, "embeddings", epoch)),
            )
        return int(self._order[1][offset])

    def _read(self, key: str, row: int) -> torch.Tensor:
        number, local = self._rows[row]
        piece = self._handles[number].get_slice(key)
        if key.startswith("uncond.") and piece.get_shape()[0] == 1:
            local = 0
        return piece[local : local + 1]

    def next_batch(self, size: int) -> dict[str, torch.Tensor]:
        positions = range(self.position, self.position + size)
        rows = [self._row(p) for p in positions]
        self.position += size
        batch = {key: torch.cat([self._read(key, r) for r in rows]) for key in self.keys}
        noise = []
        for p in positions:
            noise.append(torch.randn(self.latent_shape, generator=generator(self.seed, "noise", p)))
        batch["noise"] = torch.stack(noise)
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "seed": self.seed, "rows": len(self._rows)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("seed", "rows"):
            if int(state[key]) != self.state_dict()[key]:
                raise ValueError(f"embeddings data state {key} = {state[key]!r} does not match this data set's "
                                 f"{self.state_dict()[key]!r}; fix: resume with the data the checkpoint was written with")  # fmt: skip
        self.position = int(state["position"])
