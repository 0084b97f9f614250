"""`verl-dmd-export`: export a role of a run's checkpoint for inference (PEFT adapter, merged model, pipeline).

Takes the same recipe and overrides as the training run (``--config-name``, dotted
keys), so it finds the same checkpoint directory and checks the checkpoint was
written under the same plan. ``checkpoint.resume`` picks the checkpoint (``auto``:
the newest intact one; or a checkpoint directory); ``export.role``,
``export.formats``, ``export.output_dir`` and ``export.pipeline_source`` say what
to write (docs/checkpoint-format.md). One process, no GPU and no ray needed.
"""

from __future__ import annotations

import sys
from typing import Any

import hydra
from omegaconf import DictConfig

from verl_dmd.main import DEFAULT_RECIPE

PROG = "verl-dmd-export"


def run(cfg: Any) -> int:
    from verl_dmd.checkpoint.composite import checkpoint_root
    from verl_dmd.checkpoint.export import ExportError, export_checkpoint
    from verl_dmd.checkpoint.store import CheckpointError, CheckpointStore
    from verl_dmd.plan import DistillationPlan, PlanError

    try:
        plan = DistillationPlan.from_config(cfg)
        plan.check_local_paths()
        resume = plan.checkpoint.resume
        if resume == "disable":
            raise ExportError(
                "config key 'checkpoint.resume' = 'disable': export needs a checkpoint; fix: "
                "checkpoint.resume=auto (the newest) or checkpoint.resume=<checkpoint directory>"
            )
        root = checkpoint_root(plan)
        found = CheckpointStore(root).resolve(resume, hashes=True) if resume == "auto" else None
        if resume == "auto" and found is None:
            raise ExportError(
                f"no checkpoint under {root}; fix: train first, or set checkpoint.root / trainer.output_dir "
                "to the run's, or checkpoint.resume=<checkpoint directory>"
            )
        path = found.path if found is not None else resume
        out = export_checkpoint(plan, path, log=lambda line: print(line, flush=True))
    except (PlanError, ExportError, CheckpointError, ValueError) as err:  # ValueError: the model source
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    print(f"{PROG}: exported to {out}")
    return 0


@hydra.main(version_base=None, config_path="pkg://verl_dmd.recipes", config_name=DEFAULT_RECIPE)
def _hydra_main(cfg: DictConfig) -> None:
    code = run(cfg)
    if code:
        sys.exit(code)


def cli() -> None:
    """Console script `verl-dmd-export`."""
    _hydra_main()


if __name__ == "__main__":
    cli()
