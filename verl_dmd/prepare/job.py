"""verl-dmd-prepare's work: prompts (and captioned images, and teacher pairs) to the data set at data.path.

The pipeline is the teacher's (``model.teacher.path``, whose transformer is
``model.teacher.subfolder``); the model adapter of ``model.adapter`` knows how its
pipeline encodes (`encode_prompts`: the pipeline's own ``encode_prompt`` at its
serving defaults), lays out latents and uses its VAE. Three stages, each loading
only what it needs and freeing it before the next:

1. text (and VAE for real images): the prompt shards, the negative prompt
   (``uncond``), the validation prompts, and the real-image shards (captions
   through the same encoders, pixels through the VAE);
2. pairs (``prepare.teacher_pairs``): per prompt shard, the teacher's Euler sample
   from seeded noise with its CFG, read back from the shards just written;
3. the manifest: every file's rows, size and SHA-256, written last.

A shard is one unit of work: batches never cross shards, so a shard's bytes do
not depend on what ran before it, and a stopped run resumes at the missing
shards with the same result. Under torchrun each rank takes every WORLD_SIZE-th
shard of a stage (gloo barriers between stages; rank 0 checks the directory and
writes prepare.json and the manifest).
"""

from __future__ import annotations

import gc
import hashlib
import inspect
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from verl_dmd.data.prepared import (
    FORMAT,
    INTENT,
    MANIFEST,
    UNCOND_FILE,
    VALIDATION_FILE,
    DatasetError,
    canonical_json,
    dataset_id,
    read_json,
    remove_staging_files,
    shard_name,
    write_atomic_json,
    write_shard,
)
from verl_dmd.prepare.sources import (
    CaptionedImage,
    SourceError,
    check_image,
    list_captioned_images,
    load_pixels,
    read_prompts,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_PREFIX = "tokenizer"


class PrepareError(ValueError):
    """An input of verl-dmd-prepare that cannot be used; the message is one line naming it and the fix."""


class AgreedFailure(PrepareError):
    """A failure every rank knows of (they met after it): each leaves together, after saying what it knows."""


class RankFailure(AgreedFailure):
    """Raised on every rank when the ranks agree that one of them failed (the message names it); each rank's own
    failure was already reported where it happened."""


class OwnFailure(AgreedFailure):
    """This rank's own failure, after the ranks agreed on it."""


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Inputs:
    """What a prepare run reads, resolved and checked before any weight is loaded."""

    pipeline_dir: Path
    pipeline_class: str
    components: dict[str, Any]
    """model_index.json's component entries (name -> [library, class] or null)."""
    adapter: Any
    transformer_config: dict[str, Any]
    vae_config: dict[str, Any]
    height: int
    width: int
    num_frames: int | None
    latent_shape: tuple[int, ...]
    max_sequence_length: int
    prompts: list[str]
    validation_prompts: list[str] | None
    real: list[CaptionedImage] = field(default_factory=list)


def pipeline_dir_of(plan) -> Path:
    """The pipeline directory holding the teacher (model.teacher.path when model.teacher.subfolder is set)."""
    teacher = plan.model.teacher
    if teacher.path is None:
        raise PrepareError("config key 'model.teacher.path' = None: verl-dmd-prepare encodes with the teacher's "
                           "pipeline; fix: set model.teacher.path to the local diffusers pipeline directory")  # fmt: skip
    root = Path(teacher.path).expanduser()
    if not root.is_dir():
        raise PrepareError(f"config key 'model.teacher.path' = {teacher.path!r}: no such directory; fix: point it "
                           "at a local diffusers pipeline directory (nothing is downloaded)")  # fmt: skip
    if not (root / "model_index.json").is_file():
        raise PrepareError(f"config key 'model.teacher.path' = {teacher.path!r}: no model_index.json, so not a "
                           "diffusers pipeline directory; fix: point it at the pipeline (its text encoders and VAE "
                           "are read from there) and set model.teacher.subfolder=transformer")  # fmt: skip
    if not teacher.subfolder:
        raise PrepareError(f"config key 'model.teacher.subfolder' = {teacher.subfolder!r}: model.teacher.path is "
                           "a pipeline directory, the teacher is one of its components; fix: "
                           "model.teacher.subfolder=transformer")  # fmt: skip
    return root


def _component_dir(root: Path, components: dict[str, Any], name: str, why: str, cls: str) -> Path:
    entry = components.get(name)
    folder = root / name
    if not entry or entry[0] is None or not folder.is_dir():
        raise PrepareError(f"config key 'model.teacher.path' = {str(root)!r}: the {cls} has no {name} ({why}); "
                           "fix: use the complete pipeline directory")  # fmt: skip
    return folder


def _json_file(path: Path, what: str) -> dict[str, Any]:
    try:
        return read_json(path, what)
    except DatasetError as err:
        raise PrepareError(str(err)) from None


def default_max_sequence_length(pipeline_class: str) -> int:
    """The max_sequence_length a request to the pipeline is served with: the default of its ``__call__``
    (Wan's and Qwen-Image's encode_prompt default to other lengths, 226 and 1024, than their calls, 512)."""
    import diffusers

    parameter = inspect.signature(getattr(diffusers, pipeline_class).__call__).parameters.get(
        "max_sequence_length"
    )
    if parameter is None or not isinstance(parameter.default, int):
        raise PrepareError(f"{pipeline_class}.__call__ has no max_sequence_length default; fix: set "
                           "prepare.max_sequence_length")  # fmt: skip
    return parameter.default


def resolve_inputs(plan) -> Inputs:
    """Every input of a prepare run, checked without loading a weight: the pipeline, its components, the
    adapter's support for it, the sizes, the prompt sources and the image folder. PrepareError otherwise."""
    from verl_dmd.adapters import get_adapter
    from verl_dmd.plan import PlanError
    from verl_dmd.preflight import check_one_transformer

    prep = plan.prepare
    if not plan.data.path:
        raise PrepareError("config key 'data.path' = None: where verl-dmd-prepare writes the data set (and the "
                           "trainer reads it); fix: set data.path to a directory")  # fmt: skip
    try:
        adapter = get_adapter(plan.model.adapter)()
    except ValueError as err:
        raise PrepareError(str(err).splitlines()[0]) from None
    if not adapter.pipeline_classes:
        raise PrepareError(f"config key 'model.adapter' = {plan.model.adapter!r}: this model family has no "
                           "pipeline support in verl-dmd-prepare (its adapter lists no pipeline_classes); fix: "
                           "use sd3, flux, qwen_image or wan, or add encode_prompts to the adapter")  # fmt: skip
    root = pipeline_dir_of(plan)
    try:
        check_one_transformer(plan)  # the run on this data set would be refused: say so before encoding
    except PlanError as err:
        raise PrepareError(str(err)) from None
    index = _json_file(root / "model_index.json", "pipeline's model_index.json")
    cls = index.get("_class_name")
    if cls not in adapter.pipeline_classes:
        raise PrepareError(f"config key 'model.teacher.path' = {str(root)!r} holds a {cls}, model.adapter = "
                           f"{plan.model.adapter!r} reads {', '.join(adapter.pipeline_classes)}; fix: the adapter "
                           "of that family, or that family's pipeline")  # fmt: skip
    components = {k: v for k, v in index.items() if not k.startswith("_")}
    for name in adapter.text_encoders:
        _component_dir(
            root, components, name, f"the {plan.model.adapter} adapter encodes prompts with it", cls
        )
        tokenizer = name.replace("text_encoder", TOKENIZER_PREFIX)
        _component_dir(root, components, tokenizer, f"the tokenizer of {name}", cls)
    transformer_dir = _component_dir(
        root, components, plan.model.teacher.subfolder, "model.teacher.subfolder", cls
    )
    vae_dir = _component_dir(
        root, components, "vae", "the latents' layout and real images come from its VAE", cls
    )
    transformer_config = _json_file(transformer_dir / "config.json", "transformer config")
    vae_config = _json_file(vae_dir / "config.json", "VAE config")
    if prep.resolution is None:
        raise PrepareError("config key 'prepare.resolution' = None: the latents' size; fix: set "
                           "prepare.resolution=[height,width], e.g. [1024,1024]")  # fmt: skip
    height, width = prep.resolution
    try:
        shape = adapter.latent_shape(vae_config, transformer_config, height, width, prep.num_frames)
    except ValueError as err:
        raise PrepareError(str(err)) from None
    except KeyError as err:
        raise PrepareError(f"{vae_dir / 'config.json'}: no {err} entry the {plan.model.adapter} adapter needs; "
                           "fix: use the pipeline's own VAE") from None  # fmt: skip
    if prep.prompts is None:
        raise PrepareError("config key 'prepare.prompts' = None: the prompts to encode; fix: set prepare.prompts "
                           "to a .txt (one a line), .jsonl or .parquet file")  # fmt: skip
    try:
        prompts = read_prompts(prep.prompts, prep.prompt_field)
        validation = (
            read_prompts(prep.validation_prompts, prep.prompt_field, key="prepare.validation_prompts")
            if prep.validation_prompts
            else None
        )
        real = list_captioned_images(prep.real_images) if prep.real_images else []
        for item in real:
            check_image(item, prep.num_frames)
    except SourceError as err:
        raise PrepareError(str(err)) from None
    length = prep.max_sequence_length or default_max_sequence_length(cls)
    if adapter.max_text_tokens is not None and length > adapter.max_text_tokens:
        raise PrepareError(f"config key 'prepare.max_sequence_length' = {length}: a {cls} serves at most "
                           f"{adapter.max_text_tokens} text tokens (its check_inputs refuses more), so training "
                           f"on more would not match serving; fix: {adapter.max_text_tokens} or less")  # fmt: skip
    return Inputs(root, cls, components, adapter, transformer_config, vae_config, height, width, prep.num_frames,
                  tuple(int(v) for v in shape), int(length), prompts, validation, real)  # fmt: skip


# --------------------------------------------------------------------------- the intent


def _list_sha256(values: list[str]) -> str:
    return hashlib.sha256(canonical_json(values).encode()).hexdigest()


def text_components(adapter) -> list[str]:
    """The pipeline components prompts go through: the adapter's text encoders and their tokenizers."""
    encoders = list(adapter.text_encoders)
    return encoders + [name.replace("text_encoder", TOKENIZER_PREFIX) for name in encoders]


def build_intent(plan, inputs: Inputs, device: torch.device) -> dict[str, Any]:
    """What the data set is, as JSON: everything that changes a byte of it. Equal intents, equal data sets.

    Besides the settings: the weights' digests of the text encoders (and of the VAE and teacher when used),
    the digests of every other file of the components used (configs, tokenizer files: a VAE's scaling
    factor or a tokenizer's length changes the bytes as much as a weight does), and where and with what
    the encoding runs (device type, torch, diffusers, transformers), so that a stopped run is continued
    only where it makes the same bytes."""
    import diffusers
    import transformers

    from verl_dmd.digests import config_files_sha256, file_sha256, weights_sha256

    prep, root = plan.prepare, inputs.pipeline_dir
    encoders = {name: weights_sha256(root / name) for name in inputs.adapter.text_encoders}
    used = text_components(inputs.adapter)
    if inputs.real:
        used.append("vae")
    if prep.teacher_pairs:
        used.append(plan.model.teacher.subfolder)
    intent: dict[str, Any] = {
        "format": FORMAT,
        "adapter": plan.model.adapter,
        "pipeline_class": inputs.pipeline_class,
        "text_encoders": encoders,
        "component_files": {name: config_files_sha256(root / name) for name in used},
        "environment": {
            "device": device.type,
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "transformers": transformers.__version__,
        },
        "encoding": {
            "call": f"{inputs.pipeline_class}.encode_prompt",
            "max_sequence_length": inputs.max_sequence_length,
            "dtype": prep.dtype,
            "batch_size": prep.batch_size,
            "negative_prompt": prep.negative_prompt,
            "constant_cond": inputs.adapter.constant_cond(inputs.transformer_config, prep.guidance_embedding),
        },
        "resolution": [inputs.height, inputs.width],
        "num_frames": inputs.num_frames,
        "latent_shape": list(inputs.latent_shape),
        "shard_size": prep.shard_size,
        "prompts": {"count": len(inputs.prompts), "sha256": _list_sha256(inputs.prompts)},
        "validation": None,
        "real": None,
        "pairs": None,
        "ragged": dict(inputs.adapter.ragged_cond),
    }
    if inputs.validation_prompts is not None:
        intent["validation"] = {"count": len(inputs.validation_prompts),
                                "sha256": _list_sha256(inputs.validation_prompts)}  # fmt: skip
    if inputs.real:
        listing = [[item.path.name, file_sha256(item.path), item.caption] for item in inputs.real]
        intent["real"] = {"count": len(inputs.real), "sha256": hashlib.sha256(canonical_json(listing).encode()).hexdigest(),
                          "vae": weights_sha256(root / "vae"), "transform": prep.image_transform}  # fmt: skip
    if prep.teacher_pairs:
        intent["pairs"] = {
            "teacher": weights_sha256(root / plan.model.teacher.subfolder),
            **pair_settings(plan, inputs.adapter),
        }
    return intent


def differences(mine: dict[str, Any], theirs: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two intents."""
    out = []
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key)
        dotted = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(differences(a, b, dotted + "."))
        elif a != b:
            out.append(dotted)
    return out


# --------------------------------------------------------------------------- progress


class Progress:
    """Units done of a stage, with rate and ETA: a tqdm bar on a terminal, else a line every 5% (rank 0)."""

    def __init__(self, what: str, total: int, log: Callable[[str], None], *, enabled: bool) -> None:
        self.what, self.total, self.log, self.done = what, total, log, 0
        self.started = time.perf_counter()
        self.enabled = enabled and total > 0
        self.next_line = 0
        self.bar = None
        if self.enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=what, unit="item", dynamic_ncols=True)

    def update(self, count: int) -> None:
        self.done += count
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(count)
            return
        if self.done < self.next_line and self.done < self.total:
            return
        self.next_line = self.done + max(1, self.total // 20)
        elapsed = time.perf_counter() - self.started
        rate = self.done / elapsed if elapsed > 0 else float("nan")
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        self.log(f"prepare: {self.what} {self.done}/{self.total}  {rate:.1f}/s  elapsed {elapsed:.0f}s  "
                 f"eta {eta:.0f}s")  # fmt: skip

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------- the run


def _rank_and_world() -> tuple[int, int, int]:
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )


def _device(plan, local_rank: int) -> torch.device:
    wanted = plan.prepare.device
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    if wanted == "cuda":
        if not torch.cuda.is_available():
            raise PrepareError(
                "config key 'prepare.device' = 'cuda': torch sees no GPU; fix: prepare.device=cpu"
            )
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class Work:
    """One shard (or single file) to make: its part, index, file name and rows."""

    part: str
    index: int
    file: str
    rows: range


class PrepareJob:
    """One rank's part of a prepare run (the whole run with one process); `run()` returns the data set path."""

    def __init__(self, plan, *, log: Callable[[str], None] | None = None,
                 fault: Callable[[str], None] | None = None) -> None:  # fmt: skip
        self.plan = plan
        self.prep = plan.prepare
        self.rank, self.world_size, local_rank = _rank_and_world()
        self.log = log or (lambda line: print(line, flush=True))
        self.fault = fault or (lambda point: None)
        self.out = Path(plan.data.path).expanduser()
        self.inputs = resolve_inputs(plan)
        self.device = _device(plan, local_rank)
        self.dtype = DTYPES[self.prep.dtype]

    # -- the plan of work

    def _say(self, line: str) -> None:
        if self.rank == 0:
            self.log(line)

    def text_work(self) -> list[Work]:
        inputs, size = self.inputs, self.prep.shard_size
        work = [Work("prompts", k, shard_name("prompts", k), range(k * size, min(len(inputs.prompts), (k + 1) * size)))
                for k in range(math.ceil(len(inputs.prompts) / size))]  # fmt: skip
        work.append(Work("uncond", 0, UNCOND_FILE, range(1)))
        if inputs.validation_prompts is not None:
            work.append(Work("validation", 0, VALIDATION_FILE, range(len(inputs.validation_prompts))))
        work += [Work("real", k, shard_name("real", k), range(k * size, min(len(inputs.real), (k + 1) * size)))
                 for k in range(math.ceil(len(inputs.real) / size))]  # fmt: skip
        return work

    def pair_work(self) -> list[Work]:
        if not self.prep.teacher_pairs:
            return []
        return [Work("pairs", w.index, shard_name("pairs", w.index), w.rows) for w in self.text_work()
                if w.part == "prompts"]  # fmt: skip

    def mine(self, work: list[Work]) -> list[Work]:
        """This rank's share of `work` that is not on disk yet."""
        return [
            w
            for i, w in enumerate(work)
            if i % self.world_size == self.rank and not (self.out / w.file).is_file()
        ]

    # -- the run

    def run(self) -> Path:
        """Every stage of this rank's share; between stages the ranks agree that none failed (a failure on any
        rank is a PrepareError naming it on every rank, so no rank waits for one that left)."""
        started = time.perf_counter()
        intent = build_intent(self.plan, self.inputs, self.device)
        self.id = dataset_id(intent)
        complete = self._stage(self._open_directory, intent) if self.rank == 0 else None
        complete = self._agree(complete)
        if complete:
            self._say(f"prepare: {self.out} is complete already (the same data set); nothing to do")
            return self.out
        if self.rank != 0:  # rank 0 wrote or checked prepare.json: every rank must mean the same data set
            self._stage(self._same_intent, intent)
        self._agree()
        text, pairs = self.mine(self.text_work()), self.mine(self.pair_work())
        done_before = len(self.text_work()) + len(self.pair_work()) - self._missing_total()
        if done_before:
            self._say(f"prepare: continuing {self.out}: {done_before} file(s) made before are kept")
        if text:
            self._stage(self._text_stage, text)
        self._agree()
        if pairs:
            self._stage(self._pairs_stage, pairs)
        self._agree()
        if self.rank == 0:
            self._stage(self._write_manifest, intent)
        self._agree()
        self._say(f"prepare: done in {time.perf_counter() - started:.1f} s: {len(self.inputs.prompts)} prompt(s), "
                  f"latent shape {list(self.inputs.latent_shape)}, data set {self.out}")  # fmt: skip
        return self.out

    def _missing_total(self) -> int:
        return sum(not (self.out / w.file).is_file() for w in [*self.text_work(), *self.pair_work()])

    def _stage(self, work: Callable, *args):
        """Run one stage of this rank; a failure is kept (not raised) until the ranks next agree."""
        try:
            return work(*args)
        except (PrepareError, DatasetError, SourceError) as err:
            self._failure = str(err)
        except Exception as err:  # a bug or a broken file: its traceback on this rank, one line everywhere
            import traceback

            traceback.print_exc()
            self._failure = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        return None

    def _agree(self, value: Any = None) -> Any:
        """Wait for every rank; raise PrepareError if any rank failed since the last agreement (naming the first
        failed rank and its error), else return rank 0's `value`."""
        failure, self._failure = getattr(self, "_failure", None), None
        if self.world_size == 1:
            if failure is not None:
                raise PrepareError(failure)
            return value
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (failure, value))
        if failure is not None:  # this rank's own failure: it reports it itself
            raise OwnFailure(failure)
        for rank, (error, _) in enumerate(gathered):
            if error is not None:
                raise RankFailure(f"rank {rank} of {self.world_size}: {error}")
        return gathered[0][1]

    def _open_directory(self, intent: dict[str, Any]) -> bool:
        """Rank 0: check data.path and write prepare.json; True when the same data set is complete already."""
        out = self.out
        manifest, recorded = out / MANIFEST, out / INTENT
        if manifest.is_file() or recorded.is_file():
            theirs = _json_file(manifest if manifest.is_file() else recorded, "data set description")
            self._check_same(intent, theirs.get("intent", theirs))
            if manifest.is_file():
                return True
        elif out.exists() and (not out.is_dir() or any(p for p in out.iterdir() if not _is_staging(p))):
            what = "is a file" if not out.is_dir() else "holds files that are no verl_dmd data set"
            raise PrepareError(
                f"config key 'data.path' = {str(out)!r} {what}; fix: an empty or new directory"
            )
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise PrepareError(f"config key 'data.path' = {str(out)!r}: cannot create it ({err.strerror}); "
                               "fix: a writable location") from None  # fmt: skip
        if not os.access(out, os.W_OK):
            raise PrepareError(
                f"config key 'data.path' = {str(out)!r} is not writable; fix: a writable location"
            )
        for path in remove_staging_files(out):
            self.log(f"prepare: removed {path.name} (a file a stopped run left half-written)")
        if not recorded.is_file():
            write_atomic_json(recorded, intent)
        return False

    def _check_same(self, intent: dict[str, Any], theirs: dict[str, Any]) -> None:
        changed = differences(intent, theirs)
        if changed:
            raise PrepareError(f"config key 'data.path' = {str(self.out)!r} holds another data set (differs in: "
                               f"{', '.join(changed[:6])}{' ...' if len(changed) > 6 else ''}); fix: another "
                               "data.path, or delete that directory to replace it")  # fmt: skip

    def _same_intent(self, intent: dict[str, Any]) -> None:
        self._check_same(intent, _json_file(self.out / INTENT, "data set description"))

    def _publish(self, work: Work, tensors: dict[str, torch.Tensor], prompts: list[str] | None) -> None:
        metadata = {"dataset_id": self.id, "part": work.part, "index": work.index, "first_row": work.rows.start,
                    "rows": len(work.rows)}  # fmt: skip
        if prompts is not None:
            metadata["prompts"] = prompts
        path = self.out / work.file
        write_shard(path, tensors, metadata, before_rename=lambda: self.fault(f"before-rename:{work.file}"))
        self.fault(f"after-rename:{work.file}")

    # -- stage 1: text (and VAE for real images)

    def _loaded(self, what: str, load: Callable[[], Any]) -> Any:
        """`load()`, with a failure (a damaged or partly downloaded file, a git-LFS pointer, a class this
        diffusers lacks) as one line naming what and where."""
        try:
            return load()
        except Exception as err:
            first = str(err).splitlines()[0] if str(err) else ""
            raise PrepareError(f"config key 'model.teacher.path' = {str(self.inputs.pipeline_dir)!r}: its {what} could "
                               f"not be loaded ({type(err).__name__}: {first}); fix: a complete pipeline directory "
                               "(weights downloaded, not git-LFS pointers)") from None  # fmt: skip

    def _load_text_pipeline(self):
        import diffusers

        inputs = self.inputs
        keep = set(inputs.adapter.text_encoders) | {n.replace("text_encoder", TOKENIZER_PREFIX)
                                                    for n in inputs.adapter.text_encoders} | {"scheduler"}  # fmt: skip
        skipped = {name: None for name in inputs.components if name not in keep}
        pipe = self._loaded("text encoders", lambda: diffusers.DiffusionPipeline.from_pretrained(
            str(inputs.pipeline_dir), dtype=self.dtype, local_files_only=True, **skipped))  # fmt: skip
        return pipe.to(self.device)

    def _load_vae(self):
        import diffusers

        _library, cls = self.inputs.components["vae"]
        vae = self._loaded("VAE", lambda: getattr(diffusers, cls).from_pretrained(
            str(self.inputs.pipeline_dir), subfolder="vae", dtype=self.dtype, local_files_only=True))  # fmt: skip
        return vae.to(self.device).eval()

    def _encode(self, pipe, prompts: list[str]) -> dict[str, torch.Tensor]:
        """`cond` entries of `prompts`, encoded `prepare.batch_size` at a time; ragged entries padded to the
        longest row (masks mark the real tokens); constant entries (Flux-dev's guidance) appended."""
        inputs, batches = self.inputs, []
        for start in range(0, len(prompts), self.prep.batch_size):
            part = prompts[start : start + self.prep.batch_size]
            try:
                with torch.no_grad():
                    encoded = inputs.adapter.encode_prompts(
                        pipe, part, max_sequence_length=inputs.max_sequence_length
                    )
            except (
                ValueError
            ) as err:  # the pipeline's own argument checks (e.g. a too long max_sequence_length)
                raise PrepareError(f"{inputs.pipeline_class}.encode_prompt refused: {str(err).splitlines()[0]}; "
                                   "fix: check prepare.max_sequence_length") from None  # fmt: skip
            batches.append({k: v.detach().cpu() for k, v in encoded.items()})
            self._progress.update(len(part))
        out = {}
        for key in batches[0]:
            pieces = [b[key] for b in batches]
            longest = max(p.shape[1] for p in pieces) if pieces[0].ndim > 1 else None
            if key in inputs.adapter.ragged_cond or key in inputs.adapter.ragged_cond.values():
                pieces = [_pad_rows(p, longest) for p in pieces]
            out[key] = torch.cat(pieces)
        for key, value in inputs.adapter.constant_cond(
            inputs.transformer_config, self.prep.guidance_embedding
        ).items():
            out[key] = torch.full((len(prompts),), float(value), dtype=torch.float32)
        return out

    def _text_stage(self, work: list[Work]) -> None:
        inputs = self.inputs
        units = sum(len(w.rows) for w in work)
        self._progress = Progress("text", units, self.log, enabled=self.rank == 0)
        self._say(f"prepare: loading the text encoders of {inputs.pipeline_dir} ({', '.join(inputs.adapter.text_encoders)}) "
                  f"on {self.device} in {self.prep.dtype}")  # fmt: skip
        pipe = self._load_text_pipeline()
        vae = self._load_vae() if any(w.part == "real" for w in work) else None
        for item in work:
            if item.part == "prompts":
                prompts = inputs.prompts[item.rows.start : item.rows.stop]
                tensors = {f"cond.{k}": v for k, v in self._encode(pipe, prompts).items()}
            elif item.part == "uncond":
                prompts = [self.prep.negative_prompt]
                tensors = {f"uncond.{k}": v for k, v in self._encode(pipe, prompts).items()}
            elif item.part == "validation":
                prompts = inputs.validation_prompts
                tensors = {f"cond.{k}": v for k, v in self._encode(pipe, prompts).items()}
            else:  # real images: captions through the encoders, pixels through the VAE
                items = inputs.real[item.rows.start : item.rows.stop]
                prompts = [i.caption for i in items]
                tensors = {f"real.cond.{k}": v for k, v in self._encode(pipe, prompts).items()}
                tensors["real.x0"] = self._latents(vae, items)
            self._publish(item, tensors, prompts)
        self._progress.close()
        del pipe, vae
        _free(self.device)

    def _latents(self, vae, items: list[CaptionedImage]) -> torch.Tensor:
        inputs, out = self.inputs, []
        for start in range(0, len(items), self.prep.batch_size):
            try:
                pixels = torch.stack([load_pixels(i, inputs.height, inputs.width, transform=self.prep.image_transform,
                                                  num_frames=inputs.num_frames) for i in items[start : start + self.prep.batch_size]])  # fmt: skip
            except SourceError as err:
                raise PrepareError(str(err)) from None
            with torch.no_grad():
                latents = inputs.adapter.encode_images(vae, pixels.to(self.device, self.dtype))
            out.append(latents.float().cpu())
        latents = torch.cat(out)
        if (
            tuple(latents.shape[1:]) != inputs.latent_shape
        ):  # a mismatch of adapter and pipeline: a bug, not input
            raise RuntimeError(
                f"VAE latents of shape {tuple(latents.shape[1:])}, the data set's is {inputs.latent_shape}"
            )
        return latents

    # -- stage 2: teacher pairs

    def _pairs_stage(self, work: list[Work]) -> None:
        import safetensors.torch

        from verl_dmd.adapters.base import ModelSource
        from verl_dmd.algorithms.sampling import euler_sample
        from verl_dmd.seeding import generator

        inputs, intent_pairs = self.inputs, pair_settings(self.plan, self.inputs.adapter)
        self._say(f"prepare: teacher pairs ({self.prep.pair_steps} Euler steps, guidance {intent_pairs['guidance']}, "
                  f"shift {intent_pairs['shift']}) on {self.device} in {self.prep.dtype}")  # fmt: skip
        teacher = self._loaded(
            "teacher", lambda: inputs.adapter.build_model(ModelSource.of(self.plan.model.teacher))
        )
        teacher = teacher.to(self.device, self.dtype).eval()
        uncond = safetensors.torch.load_file(self.out / UNCOND_FILE)
        progress = Progress("teacher pairs", sum(len(w.rows) for w in work), self.log, enabled=self.rank == 0)
        for item in work:
            shard = safetensors.torch.load_file(self.out / shard_name("prompts", item.index))
            noise = torch.stack([torch.randn(inputs.latent_shape, generator=generator(self.plan.trainer.seed, "prepare.pairs", row))
                                 for row in item.rows])  # fmt: skip
            targets = []
            for start in range(0, len(item.rows), self.prep.batch_size):
                part = slice(start, start + self.prep.batch_size)
                cond = {k.removeprefix("cond."): v[part].to(self.device) for k, v in shard.items()}
                count = noise[part].shape[0]
                negative = {k.removeprefix("uncond."): v.to(self.device).expand(count, *v.shape[1:])
                            for k, v in uncond.items()}  # fmt: skip
                guidance = intent_pairs["guidance"]
                sample = euler_sample(inputs.adapter, teacher, noise[part].to(self.device, self.dtype), cond,
                                      self.prep.pair_steps, guidance=guidance,
                                      uncond=negative if guidance != 1.0 else None, shift=intent_pairs["shift"])  # fmt: skip
                targets.append(sample.float().cpu())
                progress.update(count)
            self._publish(item, {"regression.noise": noise, "regression.target": torch.cat(targets)}, None)
        progress.close()
        del teacher
        _free(self.device)

    # -- stage 3: the manifest

    def _write_manifest(self, intent: dict[str, Any]) -> None:
        from verl_dmd.digests import file_sha256

        files: dict[str, Any] = {}
        for item in [*self.text_work(), *self.pair_work()]:
            path = self.out / item.file
            entry = {"file": item.file, "rows": len(item.rows), "size": path.stat().st_size,
                     "sha256": file_sha256(path)}  # fmt: skip
            if item.part in ("uncond", "validation"):
                files[item.part] = entry
            else:
                files.setdefault(item.part, []).append(entry)
        manifest = {
            "format": FORMAT,
            "dataset_id": self.id,
            "intent": intent,
            "pipeline_path": str(self.inputs.pipeline_dir.resolve()),
            "latent_shape": list(self.inputs.latent_shape),
            "prompt_count": len(self.inputs.prompts),
            "ragged": intent["ragged"],
            "files": files,
        }
        write_atomic_json(self.out / MANIFEST, manifest)


def pair_settings(plan, adapter) -> dict[str, Any]:
    """What teacher pairs depend on besides the teacher's weights: steps, CFG (standard form), shift, seed and
    the level sampling starts from. Recorded in the intent; the trainer checks them against its plan."""
    from verl_dmd.losses import standard_guidance_scale

    algorithm = plan.algorithm
    return {
        "steps": plan.prepare.pair_steps,
        "guidance": standard_guidance_scale(algorithm.teacher_guidance_scale, algorithm.cfg_form),
        "shift": algorithm.sigma_shift,
        "seed": plan.trainer.seed,
        "sigma_max": float(adapter.sigma_max),
    }


def _is_staging(path: Path) -> bool:
    """A temporary file of a writer that stopped (removed when the run continues)."""
    return path.name.startswith(".") and path.name.endswith(".tmp")


def _pad_rows(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad dim 1 of (N, L, ...) to `length` (ragged text and its mask)."""
    if tensor.shape[1] == length:
        return tensor
    pad = torch.zeros((tensor.shape[0], length - tensor.shape[1], *tensor.shape[2:]), dtype=tensor.dtype)
    return torch.cat([tensor, pad], dim=1)
