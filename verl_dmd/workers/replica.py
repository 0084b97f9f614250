"""An inference replica: a diffusers pipeline of the model family, built once, that receives declared roles'
weights (`verl_dmd.runtime.weight_sync.WeightSyncPlan`) and samples with them.

It keeps, per component (``transformer``, ``text_encoder``, ``vae`` ...), the version it holds and the role
that version came from, and the text encoders' outputs of the prompts it encoded, keyed by the prompt and
the versions of the text encoders that made them. A sync runs this lifecycle:

1. check, before anything moves: every component named exists in the pipeline; the incoming manifest
   (names, shapes, dtypes) is exactly that component's parameters (no missing, no unexpected name, equal
   shapes, floating dtypes); a failure is one line and the replica is untouched;
2. stop admitting requests (a request during a sync is refused with one line, never served half-updated);
3. transfer: each tensor is copied into the parameter in place (``copy_``: the same storage, so compiled
   graphs and hooks that hold the parameters stay valid), or blended (``decay * held + (1 - decay) * new``),
   rounded once to the replica's dtype (incoming weights are float32 or the training dtype);
4. bump the version of the synced components only, and drop the caches made from them only (a transformer
   sync keeps the prompts' encodings: their key names the text encoders' versions, which did not change);
5. admit again (also when the transfer failed half way: then the component's version is marked ``None``,
   its contents unknown, and sampling refuses until a sync completes).

Layer 6: it lives in the process of rank 0 (`RankSession.sync_replica`), where the transport is a copy.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from verl_dmd.runtime.sharding import cast_inputs_hook
from verl_dmd.runtime.weight_sync import WeightSyncPlan


class ReplicaError(ValueError):
    """A sync or request the replica refuses; the message is one line."""


class InferenceReplica:
    """A pipeline directory loaded once by diffusers (`pipeline_dir`), for the model adapter `adapter`."""

    def __init__(self, pipeline_dir: str | Path, adapter, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:  # fmt: skip
        from diffusers import DiffusionPipeline

        self.adapter = adapter
        self.device = torch.device(device)
        self.pipe = DiffusionPipeline.from_pretrained(
            str(pipeline_dir), torch_dtype=dtype, local_files_only=True
        )
        self.pipe.set_progress_bar_config(disable=True)
        self.components: dict[str, nn.Module] = {
            name: module for name, module in self.pipe.components.items() if isinstance(module, nn.Module)
        }
        for module in self.components.values():
            module.to(self.device).eval().requires_grad_(False)
            # float32 latents and levels in, as the training engine's roles take them: cast to the dtype the
            # component computes in, `dtype`, where it holds parameters of it (a component kept wholly in
            # float32 keeps float32 inputs). Not its first parameter's dtype: a transformer may keep some
            # modules in float32 (Wan's time embedder and norms) and register one of them first.
            computes_in = {p.dtype for p in module.parameters() if p.is_floating_point()}
            # the timestep stays float32, as in the engine
            if dtype != torch.float32 and dtype in computes_in:
                keep = getattr(adapter, "full_precision_inputs", ())
                module.register_forward_pre_hook(cast_inputs_hook(dtype, keep), with_kwargs=True)
        self._completed: dict[str, int] = dict.fromkeys(self.components, 0)
        self.versions: dict[str, int | None] = dict(self._completed)
        """Per component: the number of completed syncs, or None while a failed one left it incomplete."""
        self.sources: dict[str, str] = dict.fromkeys(self.components, "pipeline")
        """The role (or "pipeline": the files it was loaded from) each component's current version came from."""
        self.admitting = True
        self.text_cache: dict[
            tuple[str, int | None, tuple[tuple[str, int | None], ...]], dict[str, torch.Tensor]
        ] = {}
        self.counters = {"text_cache_hits": 0, "text_cache_misses": 0, "syncs": 0}

    # ------------------------------------------------------------------ syncs

    def manifest(self, component: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {name: (tuple(p.shape), p.dtype) for name, p in self.components[component].named_parameters()}

    def check(self, plan: WeightSyncPlan, manifests: Mapping[str, Mapping[str, tuple]]) -> None:
        """Step 1: ReplicaError (one line) unless every component of `plan` exists and `manifests[component]`
        (name -> (shape, dtype)) is exactly its parameters."""
        for component in plan.components:
            if component not in self.components:
                raise ReplicaError(f"weight sync {plan.describe()}: the replica has no component {component!r}; "
                                   f"it has {', '.join(sorted(self.components))}")  # fmt: skip
            if component not in manifests:
                raise ReplicaError(f"weight sync {plan.describe()}: the role {plan.role.value} holds no "
                                   f"{component} weights (it holds {', '.join(sorted(manifests)) or 'none'})")  # fmt: skip
            if plan.blend is not None and self.versions[component] is None:
                raise ReplicaError(f"weight sync {plan.describe()}: the replica's {component} is incomplete (a sync "
                                   "failed half way): a blend into it would be wrong; sync the role without blend first")  # fmt: skip
            mine, theirs = self.manifest(component), manifests[component]
            missing, unexpected = sorted(mine.keys() - theirs.keys()), sorted(theirs.keys() - mine.keys())
            if missing or unexpected:
                first = f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}"
                raise ReplicaError(f"weight sync {plan.describe()}: the {component} weights do not match the "
                                   f"replica's ({len(missing)} missing, {len(unexpected)} unexpected; {first})")  # fmt: skip
            for name, (shape, dtype) in theirs.items():
                if tuple(shape) != mine[name][0]:
                    raise ReplicaError(f"weight sync {plan.describe()}: {component}.{name} has shape {tuple(shape)}, "
                                       f"the replica's {mine[name][0]}")  # fmt: skip
                if not dtype.is_floating_point:
                    raise ReplicaError(
                        f"weight sync {plan.describe()}: {component}.{name} is {dtype}, not floating"
                    )

    def sync(self, plan: WeightSyncPlan, manifests: Mapping[str, Mapping[str, tuple]],
             tensors: Iterable[tuple[str, str, torch.Tensor]]) -> dict[str, Any]:  # fmt: skip
        """Steps 1-5 for `tensors` ((component, name, full tensor), each name of the manifests once); the
        new versions and the seconds the transfer took."""
        self.check(plan, manifests)
        self.admitting = False
        started = time.perf_counter()
        params = {c: dict(self.components[c].named_parameters()) for c in plan.components}
        seen: dict[str, set[str]] = {c: set() for c in plan.components}
        try:
            with torch.no_grad():
                for component, name, tensor in tensors:
                    target = params[component][name]
                    incoming = tensor.to(device=target.device, dtype=target.dtype)
                    if plan.blend is None:
                        target.copy_(incoming)
                    else:
                        target.mul_(plan.blend).add_(incoming, alpha=1.0 - plan.blend)
                    seen[component].add(name)
            short = [c for c in plan.components if seen[c] != params[c].keys()]
            if short:
                raise ReplicaError(f"weight sync {plan.describe()}: the transfer ended with {len(params[short[0]]) - len(seen[short[0]])} "
                                   f"{short[0]} weights not sent")  # fmt: skip
        except BaseException:
            for component in plan.components:  # contents unknown: refuse to sample until a sync completes
                self.versions[component] = None
            self.admitting = True
            raise
        for component in plan.components:
            self._completed[component] += 1
            self.versions[component] = self._completed[component]
            self.sources[component] = plan.role.value if plan.blend is None else f"blend({plan.role.value})"
        self._drop_caches(plan.components)
        self.counters["syncs"] += 1
        self.admitting = True
        return {"versions": {c: self.versions[c] for c in plan.components},
                "transfer_s": time.perf_counter() - started}  # fmt: skip

    def _drop_caches(self, components: Iterable[str]) -> None:
        """Drop what was computed with the old weights of `components`: the encodings of text encoders among
        them (the key names the versions, so they would miss anyway; dropped so they free their memory)."""
        changed = set(components)
        self.text_cache = {
            key: value for key, value in self.text_cache.items() if not changed & {c for c, _ in key[2]}
        }

    # ------------------------------------------------------------------ requests

    def _admit(self, what: str, needs: Iterable[str]) -> None:
        if not self.admitting:
            raise ReplicaError(f"replica {what}: a weight sync is in progress; try after it")
        unknown = [c for c in needs if self.versions.get(c, 0) is None]
        if unknown:
            raise ReplicaError(f"replica {what}: the {unknown[0]} weights are incomplete (a sync failed half way); "
                               "sync the role again")  # fmt: skip

    def version(self, component: str) -> str:
        """``<source>@<version>`` of a component (e.g. ``student_ema@3``)."""
        return f"{self.sources[component]}@{self.versions[component]}"

    def encode(
        self, prompts: list[str], *, max_sequence_length: int | None = None
    ) -> dict[str, torch.Tensor]:
        """The prompts' text conditioning by the pipeline's own encoders, each prompt cached under its text
        and the encoders' versions."""
        encoders = tuple(c for c in getattr(self.adapter, "text_encoders", ()) if c in self.components)
        self._admit("encode", encoders)
        versions = tuple((c, self.versions[c]) for c in encoders)
        rows: list[dict[str, torch.Tensor]] = []
        for prompt in prompts:
            key = (prompt, max_sequence_length, versions)
            if key not in self.text_cache:
                self.counters["text_cache_misses"] += 1
                with torch.no_grad():
                    encoded = self.adapter.encode_prompts(
                        self.pipe, [prompt], max_sequence_length=max_sequence_length
                    )
                self.text_cache[key] = {k: v.detach().cpu() for k, v in encoded.items()}
            else:
                self.counters["text_cache_hits"] += 1
            rows.append(self.text_cache[key])
        return {k: torch.cat([row[k] for row in rows]) for k in rows[0]}

    def few_step(
        self, noise: torch.Tensor, cond: Mapping[str, torch.Tensor], schedule, renoise
    ) -> torch.Tensor:
        """The few-step sampler (`verl_dmd.algorithms.sampling.few_step_sample`) with the transformer it holds."""
        from verl_dmd.algorithms.sampling import few_step_sample

        self._admit("few_step", ("transformer",))
        device = self.device
        return few_step_sample(
            self.adapter, self.components["transformer"], noise.to(device), {k: v.to(device) for k, v in cond.items()},
            torch.as_tensor(schedule, dtype=torch.float32), [r.to(device) for r in renoise],
        ).cpu()  # fmt: skip
