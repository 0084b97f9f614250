"""The layer of every module of verl_dmd, declared once (docs/architecture.md draws the same picture).

A module may import modules of its own layer and of the layers below it, never
above, and the imports (those inside functions included) must form no cycle;
`tests/test_layers.py` walks the package's source and enforces both. A module
belongs to the longest prefix listed here.

Layer 1: no torch.distributed, no ray, no verl.
"""

from __future__ import annotations

LAYERS: dict[str, int] = {
    # 1. the ground floor: contracts, math, the plan, seeding, batches, registries' machinery
    "verl_dmd": 1,
    "verl_dmd.registry": 1,
    "verl_dmd.layers": 1,
    "verl_dmd.seeding": 1,
    "verl_dmd.batch": 1,
    "verl_dmd.plan": 1,
    "verl_dmd.controller": 1,
    "verl_dmd.phases": 1,
    "verl_dmd.losses": 1,
    "verl_dmd.assets": 1,
    "verl_dmd.config_docs": 1,
    "verl_dmd.digests": 1,
    # 2. two independent axes (model families, methods), and data sets
    "verl_dmd.adapters": 2,
    "verl_dmd.algorithms": 2,
    "verl_dmd.data": 2,
    # 3. evaluation: scoring samples against data, writing them for people
    "verl_dmd.eval": 3,
    # 4. the role runtime: FSDP2, the engine, phase execution, sleep/wake
    "verl_dmd.runtime": 4,
    # 5. checkpoints and export
    "verl_dmd.checkpoint": 5,
    # 6. workers: one rank's session, the verl worker, the driver's worker groups
    "verl_dmd.workers": 6,
    # 7. the driver and the entry points
    "verl_dmd.trainer": 7,
    "verl_dmd.preflight": 7,
    "verl_dmd.command_line": 7,
    "verl_dmd.main": 7,
    "verl_dmd.export_main": 7,
    "verl_dmd.prepare": 7,
    "verl_dmd.prepare_main": 7,
    # tiny real pipelines built offline (tests, smoke runs, benchmarks): above everything it may be used with
    "verl_dmd.testing": 7,
}

NAMES = {1: "ground floor", 2: "models, methods, data", 3: "evaluation", 4: "role runtime", 5: "checkpoint",
         6: "workers", 7: "driver and entry points"}  # fmt: skip


def layer_of(module: str) -> int:
    """The layer of a verl_dmd module (by its longest listed prefix); KeyError for modules outside verl_dmd."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in LAYERS:
            return LAYERS[prefix]
    raise KeyError(f"{module} is not a verl_dmd module")
