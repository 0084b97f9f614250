"""Batches as tensor trees: split, pad, trim and move them, one set of rules for every boundary.

A batch is a tree of dicts, lists and tuples whose tensors share their first
dimension (the samples); other leaves (numbers, strings, a list of noise levels)
ride along unchanged. The same rules serve the three places batches are cut:
the driver splitting a global batch over ranks (`split(..., exact=True)`), the
runtime cutting a rank's batch into micro-batches (`split`), and sampling calls
padded to a multiple of the world size (`pad_to_multiple`, then `trim`).

A list or tuple is a branch when one of its elements holds a tensor (then each
element is split); without tensors it is a leaf (a schedule, say) and every part
gets it whole.

Not verl's `DataProto`: phase batches are flat ``str -> tensor`` maps and sampling
calls carry nested dicts and lists of tensors, which `DataProto`'s one-level
`TensorDict` plus numpy side arrays does not hold without conversions at every
boundary; its `chunk` needs divisible sizes where micro-batches may be uneven
(`torch.tensor_split`); and this module sits on the ground floor, which a verl
import would pull up a layer.

Layer 1: torch only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


class BatchError(ValueError):
    """A batch that cannot be cut as asked; the message names the sizes and the fix."""


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_holds_tensor(v) for v in value)
    return False


def _map(value: Any, leaf: Callable[[torch.Tensor], Any]) -> Any:
    """`value` with `leaf` applied to every tensor (containers rebuilt, other leaves kept)."""
    if isinstance(value, torch.Tensor):
        return leaf(value)
    if isinstance(value, Mapping):
        return {k: _map(v, leaf) for k, v in value.items()}
    if isinstance(value, list | tuple) and _holds_tensor(value):
        return type(value)(_map(v, leaf) for v in value)
    return value


def tensors(value: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a tree by its path (``a.b[0]``), in order."""
    if isinstance(value, torch.Tensor):
        return {prefix or "<batch>": value}
    out: dict[str, torch.Tensor] = {}
    if isinstance(value, Mapping):
        for k, v in value.items():
            out.update(tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(value, list | tuple) and _holds_tensor(value):
        for i, v in enumerate(value):
            out.update(tensors(v, f"{prefix}[{i}]"))
    return out


def prefixed(batch: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The entries of a flat batch whose keys start with `prefix`, keyed without it
    (``prefixed(batch, "cond.")`` is the conditioning a model adapter reads)."""
    return {k[len(prefix) :]: v for k, v in batch.items() if k.startswith(prefix)}


def batch_size(value: Any) -> int | None:
    """The samples in a tree: the first dimension every tensor shares; None without tensors."""
    found = tensors(value)
    if not found:
        return None
    scalar = [name for name, t in found.items() if t.ndim == 0]
    if scalar:
        raise BatchError(f"batch tensor {scalar[0]} is 0-dim: every tensor needs a batch dimension")
    sizes = {name: t.shape[0] for name, t in found.items()}
    if len(set(sizes.values())) != 1:
        raise BatchError(f"batch tensors disagree on the batch size: {sizes}")
    return next(iter(sizes.values()))


def split(
    value: Any, parts: int, *, exact: bool = False, what: str = "parts", fix: str | None = None
) -> list[Any]:
    """`value` cut into `parts` consecutive pieces along dim 0 (`torch.tensor_split`: sizes differ
    by at most one). `exact` requires equal pieces (ranks); otherwise every piece must hold a sample.
    `what` names the pieces and `fix` the remedy in errors."""
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise BatchError(f"parts = {parts!r}: must be an integer >= 1")
    size = batch_size(value)
    if size is None:
        return [value] * parts
    problem = None
    if exact and size % parts:
        problem = f"a batch of {size} samples does not split into {parts} equal {what}"
    elif not exact and size < parts:
        problem = f"a batch of {size} samples cannot fill {parts} {what}"
    if problem:
        raise BatchError(problem + (f"; fix: {fix}" if fix else ""))
    return _split(value, parts)


def _split(value: Any, parts: int) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return list(torch.tensor_split(value, parts))
    if isinstance(value, Mapping):
        pieces = {k: _split(v, parts) for k, v in value.items()}
        return [{k: pieces[k][r] for k in value} for r in range(parts)]
    if isinstance(value, list | tuple) and _holds_tensor(value):
        pieces = [_split(v, parts) for v in value]
        return [type(value)(p[r] for p in pieces) for r in range(parts)]
    return [value] * parts


def pad_to_multiple(value: Any, multiple: int) -> tuple[Any, int]:
    """`value` with every tensor padded along dim 0 to a multiple of `multiple` (its last sample
    repeated), and the number of samples added (`trim` takes them off again)."""
    size = batch_size(value)
    if size is None:
        return value, 0
    pad = -size % multiple
    if not pad:
        return value, 0
    return _map(value, lambda t: torch.cat([t, t[-1:].expand(pad, *t.shape[1:])])), pad


def trim(tensor: torch.Tensor, pad: int) -> torch.Tensor:
    """`tensor` without the `pad` samples `pad_to_multiple` added at its end."""
    return tensor[: tensor.shape[0] - pad] if pad else tensor


def to_device(value: Any, device: torch.device | str, *, non_blocking: bool = True) -> Any:
    """Every tensor of `value` on `device` (a no-op for tensors already there)."""
    return _map(value, lambda t: t.to(device, non_blocking=non_blocking))
