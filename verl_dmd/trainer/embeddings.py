"""The `embeddings` data provider: precomputed text embeddings for SD3, Flux, Wan or Qwen-Image runs.

DMD2 needs conditions, not images. ``data.path`` is either

- a data set made by ``verl-dmd-prepare`` (a directory with a ``manifest.json``:
  `verl_dmd.data.prepared`): prompt shards (``cond.*``), the negative prompt
  (``uncond.*``), optional real-image shards (``real.x0``, ``real.cond.*``) and teacher
  pairs (``regression.noise``, ``regression.target``, row-aligned with the prompts).
  Before any worker starts (`EmbeddingsProvider.preflight`) the manifest is checked
  against the plan: the pipeline class, its text encoders' weights, the latent
  shape that the pipeline's VAE and transformer give at the prepared resolution,
  ``prepare.resolution`` / ``num_frames`` / ``max_sequence_length`` when the plan
  sets them, and, when the run uses them, the teacher pairs' teacher, guidance and
  shift and the real images' VAE. A data set made for something else is refused
  naming what differs; or
- hand-made safetensors (a file, or a directory of them read in name order as one
  data set) each holding ``cond.<name>`` rows, ``uncond.<name>`` (1 row, or one per
  prompt), optionally ``real.x0`` / ``real.cond.<name>`` per row, and the header
  metadata ``latent_shape`` (comma separated, e.g. ``16,128,128``). Nothing can be
  checked against the pipeline there.

Rows are read lazily (memory stays bounded by the batch). Sample p of the stream
is fully determined by (seed, p): its row is entry ``p mod N`` of epoch ``p // N``'s
permutation (identity with ``data.shuffle=false``), its noise comes from a generator
seeded from (seed, p), and its real image (GAN terms) is entry ``p mod R`` of the
real images' own permutation; the state is that one position, as for digits.
Ragged text (Qwen-Image: variable length with a mask) is padded or trimmed per batch
to the batch's longest prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from verl_dmd.seeding import generator
from verl_dmd.trainer.registry import register_data_provider

PREFIXES = ("cond.", "uncond.", "real.")


def _data_error(root: Path, text: str) -> ValueError:
    return ValueError(f"config key 'data.path' = {str(root)!r}: {text}")


class RowTable:
    """Rows of safetensors files with the same keys, read lazily (only headers until rows are asked for).

    `ragged` maps a key of variable length (dim 1) to its mask key; `read` pads or trims both to the
    longest real length among the rows read.
    """

    def __init__(self, files: Sequence[Path], ragged: dict[str, str] | None = None, *, what: str) -> None:
        from safetensors import safe_open

        self.files, self.ragged, self.what = list(files), dict(ragged or {}), what
        self._handles = [safe_open(str(f), framework="pt") for f in self.files]
        self.rows: list[tuple[int, int]] = []  # global row -> (file, row)
        self.keys: list[str] = sorted(self._handles[0].keys()) if self._handles else []
        for number, handle in enumerate(self._handles):
            names = sorted(handle.keys())
            if names != self.keys:
                raise ValueError(f"{what}: {self.files[number].name} holds {names}, {self.files[0].name} holds "
                                 f"{self.keys}; fix: write every shard with the same keys")  # fmt: skip
            # uncond.* of hand-made files may hold one row for all prompts: they do not count rows.
            counted = [k for k in names if not k.startswith("uncond.")] or names
            counts = {handle.get_slice(k).get_shape()[0] for k in counted}
            if len(counts) != 1:
                raise ValueError(f"{what}: {self.files[number].name}: its tensors disagree on the number of rows "
                                 f"{sorted(counts)}")  # fmt: skip
            self.rows += [(number, r) for r in range(counts.pop())]

    def __len__(self) -> int:
        return len(self.rows)

    def metadata(self, number: int = 0) -> dict[str, str]:
        return self._handles[number].metadata() or {}

    def shape(self, key: str) -> list[int]:
        return list(self._handles[0].get_slice(key).get_shape())

    def row_count(self, number: int, key: str) -> int:
        return int(self._handles[number].get_slice(key).get_shape()[0])

    def read_one_or_own(self, key: str, rows: Sequence[int]) -> torch.Tensor:
        """`key` for `rows`, where a file may hold one row of it for all its rows (hand-made uncond.*)."""
        pieces = []
        for row in rows:
            number, local = self.rows[row]
            piece = self._handles[number].get_slice(key)
            index = 0 if piece.get_shape()[0] == 1 else local
            pieces.append(piece[index : index + 1])
        return torch.cat(pieces)

    def read(self, keys: Sequence[str], rows: Sequence[int]) -> dict[str, torch.Tensor]:
        """The rows `rows` (global indices, repeats allowed) of `keys`, stacked."""
        out = {}
        for key in keys:
            pieces = []
            for row in rows:
                number, local = self.rows[row]
                pieces.append(self._handles[number].get_slice(key)[local : local + 1])
            out[key] = pieces
        for key, mask_key in self.ragged.items():
            if key in out and mask_key in out:
                length = max(1, max(int(m.sum()) for m in out[mask_key]))
                out[key] = [_fit_length(p, length) for p in out[key]]
                out[mask_key] = [_fit_length(m, length) for m in out[mask_key]]
        return {key: torch.cat(pieces) for key, pieces in out.items()}


def _fit_length(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Trim or zero-pad dim 1 to `length` (ragged text rows are left-aligned: the padding is at the end)."""
    if tensor.shape[1] >= length:
        return tensor[:, :length]
    pad = torch.zeros((tensor.shape[0], length - tensor.shape[1], *tensor.shape[2:]), dtype=tensor.dtype)
    return torch.cat([tensor, pad], dim=1)


def _prefixed(ragged: dict[str, str], prefix: str) -> dict[str, str]:
    return {f"{prefix}{k}": f"{prefix}{v}" for k, v in ragged.items()}


@register_data_provider("embeddings")
class EmbeddingsProvider:
    """Global batches of precomputed embeddings (see the module docstring); `state_dict` is its position."""

    validator = "pipeline"
    """Decoded samples through the pipeline's VAE (`verl_dmd.trainer.pipeline_validation`), when the data set
    was prepared from a pipeline; hand-made embeddings have none."""

    @classmethod
    def from_plan(cls, plan, group, info, log=print) -> EmbeddingsProvider:
        return cls(plan)

    @classmethod
    def preflight(cls, plan) -> None:
        """Check data.path as `from_plan` will, and a prepared data set against the plan, before any worker
        starts (headers, configs and cached weight digests: no tensor is read)."""
        provider = cls(plan)
        if provider.dataset is not None:
            check_against_plan(provider.dataset, plan)

    def __init__(self, plan) -> None:
        from verl_dmd.data.prepared import DatasetError, PreparedDataset
        from verl_dmd.losses import standard_guidance_scale

        if not plan.data.path:
            raise ValueError("config key 'data.path' = None: the embeddings provider reads a safetensors file or "
                             "directory; fix: set data.path")  # fmt: skip
        root = Path(plan.data.path).expanduser()
        self.root = root
        self.seed, self.shuffle = plan.trainer.seed, plan.data.shuffle
        self.position = 0
        self.dataset = None
        self.uncond: RowTable | None = None  # the prepared data set's negative prompt (one row)
        self.legacy_uncond: list[str] = []  # hand-made files: uncond.* keys of the prompt table (1 or N rows)
        self.pairs: RowTable | None = None
        self.real: RowTable | None = None
        uses_pairs = plan.algorithm.regression_weight > 0
        uses_real = plan.algorithm.gan_discriminator_weight > 0
        if PreparedDataset.is_prepared(root):
            try:
                self.dataset = PreparedDataset.open(root)
                self._open_prepared(self.dataset, uses_pairs=uses_pairs, uses_real=uses_real)
            except DatasetError as err:
                raise _data_error(root, str(err)) from None
            if plan.data.regression_pairs_path:
                raise ValueError(f"config key 'data.regression_pairs_path' = {plan.data.regression_pairs_path!r}: a "
                                 "prepared data set holds its own teacher pairs (prepare.teacher_pairs); fix: "
                                 "data.regression_pairs_path=null")  # fmt: skip
        else:
            self._open_files(root, uses_pairs=uses_pairs)
        has_uncond = bool(self.legacy_uncond) or (self.uncond is not None and bool(self.uncond.keys))
        if (
            standard_guidance_scale(plan.algorithm.teacher_guidance_scale, plan.algorithm.cfg_form) != 1.0
            and not has_uncond
        ):
            raise ValueError("config key 'algorithm.teacher_guidance_scale' != 1 needs uncond.* tensors in data.path "
                             "(the empty prompt's embeddings); fix: add them, or set the scale to 1")  # fmt: skip
        if uses_real and self.real is None and not any(k.startswith("real.") for k in self.prompt_keys):
            raise _data_error(root, "algorithm.gan_discriminator_weight > 0 needs real images (real.x0); fix: "
                                    "prepare with prepare.real_images=<folder of captioned images>, or set the GAN "
                                    "weights to 0")  # fmt: skip
        self._order: tuple[int, torch.Tensor] | None = None
        self._real_order: tuple[int, torch.Tensor] | None = None

    def _open_prepared(self, dataset, *, uses_pairs: bool, uses_real: bool) -> None:
        from verl_dmd.data.prepared import DatasetError

        ragged, what = dataset.ragged, str(dataset.root)
        self.latent_shape = dataset.latent_shape
        self.prompts = RowTable(dataset.files("prompts"), _prefixed(ragged, "cond."), what=what)
        self.prompt_keys = self.prompts.keys
        self.uncond = RowTable(dataset.files("uncond"), _prefixed(ragged, "uncond."), what=what)
        if len(self.prompts) != dataset.manifest["prompt_count"]:
            raise DatasetError(f"{dataset.root}: {len(self.prompts)} prompt rows, the manifest says "
                             f"{dataset.manifest['prompt_count']}; fix: prepare the data set again")  # fmt: skip
        if uses_pairs:
            if not dataset.files("pairs"):
                raise DatasetError("algorithm.regression_weight > 0 needs teacher pairs, this data set has none; fix: "
                                 "run verl-dmd-prepare with prepare.teacher_pairs=true into a new data.path")  # fmt: skip
            self.pairs = RowTable(dataset.files("pairs"), what=what)
            if len(self.pairs) != len(self.prompts):
                raise DatasetError(
                    f"{dataset.root}: {len(self.pairs)} teacher pairs for {len(self.prompts)} prompts"
                )
        if uses_real and dataset.files("real"):
            self.real = RowTable(dataset.files("real"), _prefixed(ragged, "real.cond."), what=what)

    def _open_files(self, root: Path, *, uses_pairs: bool) -> None:
        files = sorted(root.glob("*.safetensors")) if root.is_dir() else [root]
        if not files or not all(f.is_file() for f in files):
            raise _data_error(root, "no .safetensors files there; fix: point it at prepared embeddings "
                                    "(docs/quickstart.md)")  # fmt: skip
        if uses_pairs:
            raise _data_error(root, "algorithm.regression_weight > 0 needs teacher pairs, which only a data set made "
                                    "by verl-dmd-prepare (prepare.teacher_pairs=true) holds; fix: prepare one, or "
                                    "set algorithm.regression_weight=0")  # fmt: skip
        table = RowTable(files, what="config key 'data.path'")
        if not any(k.startswith("cond.") for k in table.keys):
            raise _data_error(root, f"{files[0].name} has no cond.* tensors; fix: store the text embeddings as "
                                    "cond.<name>")  # fmt: skip
        shapes = set()
        for number, file in enumerate(files):
            meta = table.metadata(number).get("latent_shape")
            if meta is None:
                raise ValueError(f"config key 'data.path': {file.name} has no 'latent_shape' metadata; fix: write it "
                                 "(e.g. '16,128,128') when saving the embeddings")  # fmt: skip
            shapes.add(tuple(int(v) for v in meta.split(",")))
        if len(shapes) != 1:
            raise ValueError(f"config key 'data.path': the files disagree on latent_shape {sorted(shapes)}")
        self.latent_shape = shapes.pop()
        # One table holds every key; real.* rows travel with their prompt rows; uncond.* rows are 1 (one empty
        # prompt for all) or one per prompt.
        self.prompts = table
        self.prompt_keys = [k for k in table.keys if not k.startswith("uncond.")]
        self.legacy_uncond = [k for k in table.keys if k.startswith("uncond.")]
        for number, file in enumerate(files):
            mine = sum(1 for f, _ in table.rows if f == number)
            for key in self.legacy_uncond:
                rows = table.row_count(number, key)
                if rows not in (1, mine):
                    raise ValueError(f"config key 'data.path': {file.name}: {key} has {rows} rows; allowed: 1 "
                                     f"(one empty prompt for all) or {mine} (one per prompt)")  # fmt: skip

    def __len__(self) -> int:
        return len(self.prompts)

    def _row(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.prompts))
        if not self.shuffle:
            return offset
        if self._order is None or self._order[0] != epoch:
            self._order = (
                epoch,
                torch.randperm(len(self.prompts), generator=generator(self.seed, "embeddings", epoch)),
            )
        return int(self._order[1][offset])

    def _real_row(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.real))
        if not self.shuffle:
            return offset
        if self._real_order is None or self._real_order[0] != epoch:
            self._real_order = (
                epoch,
                torch.randperm(len(self.real), generator=generator(self.seed, "embeddings.real", epoch)),
            )
        return int(self._real_order[1][offset])

    def next_batch(self, size: int) -> dict[str, torch.Tensor]:
        positions = range(self.position, self.position + size)
        rows = [self._row(p) for p in positions]
        self.position += size
        batch = self.prompts.read(self.prompt_keys, rows)
        for key in self.legacy_uncond:  # hand-made files: row 0 for all, or the prompt's own row
            batch[key] = self.prompts.read_one_or_own(key, rows)
        if self.uncond is not None:
            batch.update(self.uncond.read(self.uncond.keys, [0] * size))
        if self.pairs is not None:
            batch.update(self.pairs.read(["regression.noise", "regression.target"], rows))
            batch.update({f"regression.{k}": v for k, v in batch.items() if k.startswith("cond.")})
        if self.real is not None:
            batch.update(self.real.read(self.real.keys, [self._real_row(p) for p in positions]))
        batch["noise"] = torch.stack(
            [torch.randn(self.latent_shape, generator=generator(self.seed, "noise", p)) for p in positions]
        )
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "seed": self.seed, "rows": len(self.prompts)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("seed", "rows"):
            if int(state[key]) != self.state_dict()[key]:
                raise ValueError(f"embeddings data state {key} = {state[key]!r} does not match this data set's "
                                 f"{self.state_dict()[key]!r}; fix: resume with the data the checkpoint was written with")  # fmt: skip
        self.position = int(state["position"])


# --------------------------------------------------------------------------- the data set against the plan


def check_against_plan(dataset, plan) -> None:
    """Refuse (ValueError, one line naming what differs) a prepared data set made for another pipeline, other
    encoder weights or tokenizer files, another size or other text settings than this plan's, or teacher
    pairs / real images made with another teacher, guidance, shift or VAE than the run would use. The
    `prepare.*` keys are compared where the plan sets them (resolution with num_frames, max_sequence_length,
    guidance_embedding, a non-empty negative_prompt)."""
    from verl_dmd.adapters import get_adapter
    from verl_dmd.data.prepared import teacher_pipeline
    from verl_dmd.digests import config_files_sha256, model_sha256, weights_sha256
    from verl_dmd.prepare.job import pair_settings

    intent, root = dataset.intent, dataset.root
    adapter = get_adapter(plan.model.adapter)()
    fix = "fix: prepare a data set for this run (verl-dmd-prepare with the same recipe and overrides)"

    def refuse(what: str) -> ValueError:
        return _data_error(root, f"{what}; {fix}")

    if intent.get("pipeline_class") not in adapter.pipeline_classes:
        raise refuse(f"made from a {intent.get('pipeline_class')}, model.adapter = {plan.model.adapter!r} reads "
                     f"{', '.join(adapter.pipeline_classes) or 'no pipeline'}")  # fmt: skip
    pipeline = teacher_pipeline(plan)
    if pipeline is not None:
        _check_pipeline(pipeline, plan, adapter, dataset, refuse)
    prep, encoding = plan.prepare, intent["encoding"]
    if prep.resolution is not None and list(prep.resolution) != intent["resolution"]:
        raise refuse(
            f"prepared at prepare.resolution = {intent['resolution']}, this plan has {list(prep.resolution)}"
        )
    if prep.resolution is not None and prep.num_frames != intent["num_frames"]:
        raise refuse(
            f"prepared with prepare.num_frames = {intent['num_frames']}, this plan has {prep.num_frames}"
        )
    if prep.max_sequence_length is not None and prep.max_sequence_length != encoding["max_sequence_length"]:
        raise refuse(f"prepared with max_sequence_length = {encoding['max_sequence_length']}, this plan has "
                     f"prepare.max_sequence_length = {prep.max_sequence_length}")  # fmt: skip
    if prep.negative_prompt and prep.negative_prompt != encoding["negative_prompt"]:
        raise refuse(f"its negative prompt is {encoding['negative_prompt']!r}, this plan has prepare.negative_prompt "
                     f"= {prep.negative_prompt!r}")  # fmt: skip
    constant = encoding.get("constant_cond", {})
    if (
        prep.guidance_embedding is not None
        and "guidance" in constant
        and constant["guidance"] != prep.guidance_embedding
    ):
        raise refuse(f"its guidance embedding (cond.guidance) is {constant['guidance']}, this plan has "
                     f"prepare.guidance_embedding = {prep.guidance_embedding}")  # fmt: skip
    pairs = intent.get("pairs")
    if plan.algorithm.regression_weight > 0 and pairs is not None:
        teacher = plan.model.teacher
        if model_sha256(teacher.path, teacher.subfolder, teacher.config) != pairs["teacher"]:
            raise refuse("its teacher pairs were sampled by another teacher (weights) than model.teacher")
        wanted = pair_settings(plan, adapter)
        for key in ("guidance", "shift", "sigma_max"):
            if pairs.get(key) != wanted[key]:
                raise refuse(f"its teacher pairs were sampled with {key} = {pairs.get(key)}, this run's teacher uses "
                             f"{wanted[key]}")  # fmt: skip
    real = intent.get("real")
    uses_real = plan.algorithm.gan_discriminator_weight > 0 and real is not None and pipeline is not None
    if uses_real and (weights_sha256(pipeline / "vae") != real["vae"]
                      or config_files_sha256(pipeline / "vae") != intent["component_files"].get("vae")):  # fmt: skip
        raise refuse("its real images were encoded by another VAE (weights or config) than the one in "
                     "model.teacher.path")  # fmt: skip


def _check_pipeline(pipeline: Path, plan, adapter, dataset, refuse) -> None:
    """The data set against the teacher's pipeline directory: its class, its text encoders' weights and files,
    and the latent shape its VAE and transformer make at the prepared size."""
    import json

    from verl_dmd.digests import config_files_sha256, weights_sha256
    from verl_dmd.prepare.job import text_components

    intent = dataset.intent

    def read(relative: str) -> dict:
        try:
            return json.loads((pipeline / relative).read_text())
        except (OSError, ValueError) as err:
            raise refuse(f"model.teacher.path has no readable {relative} ({type(err).__name__}) to check it "
                         "against") from None  # fmt: skip

    index = read("model_index.json")
    if index.get("_class_name") != intent["pipeline_class"]:
        raise refuse(
            f"made from a {intent['pipeline_class']}, model.teacher.path holds a {index.get('_class_name')}"
        )
    recorded = intent.get("component_files", {})
    for name in text_components(adapter):
        folder = pipeline / name
        if name in intent["text_encoders"]:
            try:
                same = folder.is_dir() and weights_sha256(folder) == intent["text_encoders"][name]
            except ValueError:
                same = False
            if not same:
                raise refuse(
                    f"its prompts were encoded by other {name} weights than those in model.teacher.path"
                )
        if name in recorded and (not folder.is_dir() or config_files_sha256(folder) != recorded[name]):
            raise refuse(f"its prompts were encoded with other {name} files (config, tokenizer) than those in "
                         "model.teacher.path")  # fmt: skip
    vae = read("vae/config.json")
    transformer = read(f"{plan.model.teacher.subfolder}/config.json")
    height, width = intent["resolution"]
    try:
        shape = list(adapter.latent_shape(vae, transformer, height, width, intent["num_frames"]))
    except (ValueError, KeyError) as err:
        raise refuse(f"its resolution does not fit the teacher's pipeline ({err})") from None
    if shape != list(dataset.latent_shape):
        raise refuse(f"latent shape {list(dataset.latent_shape)}, the teacher's pipeline makes {shape} at "
                     f"{height}x{width}")  # fmt: skip
