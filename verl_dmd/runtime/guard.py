"""The sharding guard: fail closed if the role engine's models gained parameters after sharding.

An adapter (or any parameter) added after `fully_shard` is a plain replicated
parameter whose gradients are never synchronised: ranks silently diverge (TRAPS).
`ShardingGuard.verify()` runs at every phase. Walking `named_parameters` costs
milliseconds of host time for an SD3-sized model, and the GPU idles meanwhile at a
phase start; so after a full walk has passed, the modules it saw are kept, and
later calls check only that no kept module has a child module or a parameter that
was not there (any new parameter reachable from a model hangs below such a child or
is such a parameter). Anything new sends the call back to the full walk, which
raises with the parameter's name, or passes and keeps the new tree; so does a model
that is not the one the walk saw, and a child module removed (the count of child
links drops: the kept list must not hold the removed module's parameters on the
device).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


class ShardingGuard:
    """Checks `models` (the engine's dict, read at every call) against the parameters named at sharding."""

    def __init__(self, models: dict[str, nn.Module], param_names: dict[int, str]) -> None:
        self.models = models
        self.param_names = param_names
        # the kept tree: roots, modules, their ids, the number of child links among them
        self.known: tuple[list[nn.Module], list[nn.Module], set[int], int] | None = None

    def verify(self) -> None:
        """Raise (naming the parameter) if a parameter appeared after sharding or is not sharded."""
        roots = list(self.models.values())
        known = self.known
        if (
            known is not None
            and len(roots) == len(known[0])
            and all(a is b for a, b in zip(roots, known[0], strict=True))
            and self._links(known[1], known[2]) == known[3]
        ):
            return
        self.walk()
        modules = [m for model in roots for m in model.modules()]
        module_ids = {id(m) for m in modules}
        self.known = (roots, modules, module_ids, self._links(modules, module_ids))  # the lists keep the ids

    def _links(self, modules: list[nn.Module], module_ids: set[int]) -> int:
        """The number of child links among `modules`; -1 when one has a new child or a new parameter."""
        names, sharded = self.param_names, dist.is_initialized()
        links = 0
        for module in modules:  # plain loops: this runs at every phase
            for child in module._modules.values():
                if child is not None:
                    if id(child) not in module_ids:
                        return -1
                    links += 1
            for param in module._parameters.values():
                if param is not None and (
                    id(param) not in names or (sharded and not isinstance(param, DTensor))
                ):
                    return -1
        return links

    def walk(self) -> None:
        """The full check: every parameter of every model was named at sharding and is a DTensor."""
        sharded = dist.is_initialized()
        for model_name, model in self.models.items():
            for name, param in model.named_parameters():
                full = f"{model_name}.{name}"
                if id(param) not in self.param_names:
                    raise RuntimeError(
                        f"parameter {full} appeared after the engine sharded the model; "
                        "add every adapter before fully_shard (RoleEngine does this at construction)"
                    )
                if sharded and not isinstance(param, DTensor):
                    raise RuntimeError(
                        f"parameter {full} is not sharded (not a DTensor); it would never sync"
                    )
