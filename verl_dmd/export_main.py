"""`verl-dmd-export`: export a role of a run's checkpoint for inference (PEFT adapter, merged model, pipeline).

Takes the same recipe and overrides as the training run (``--config-name``, dotted
keys), so it finds the same checkpoint directory and checks the checkpoint was
written under the same plan. ``checkpoint.resume`` picks the checkpoint (``auto``:
the newest intact one; or a checkpoint directory); ``export.role``,
``export.formats``, ``export.output_dir`` and ``export.pipeline_source`` say what
to write (docs/checkpoint-format.md). One process, no GPU and no ray needed. As
`verl-dmd` does, it composes the config and runs its checks (`preflight_export`)
before hydra makes its run directory: a refused export is one line and exit code 2.
"""

from __future__ import annotations

import sys
from typing import Any

import hydra
from omegaconf import DictConfig

from verl_dmd.main import DEFAULT_RECIPE, RECIPES

PROG = "verl-dmd-export"


def run(cfg: Any) -> int:
    from verl_dmd.checkpoint.composite import checkpoint_root
    from verl_dmd.checkpoint.export import ExportError, export_checkpoint
    from verl_dmd.checkpoint.store import CheckpointError, CheckpointStore
    from verl_dmd.plan import DistillationPlan, PlanError
    from verl_dmd.preflight import no_checkpoint, preflight_export

    try:
        plan = DistillationPlan.from_config(cfg)
        preflight_export(plan)
        root = checkpoint_root(plan)
        candidates = CheckpointStore(root).candidates(plan.checkpoint.resume)
        if not candidates.checkpoints:
            raise no_checkpoint(candidates.root or root)
        path = candidates.checkpoints[0].path  # the named checkpoint, or the newest whose manifest checks out
        out = export_checkpoint(plan, path, log=lambda line: print(line, flush=True))
    except (PlanError, ExportError, CheckpointError, ValueError) as err:  # ValueError: the model source
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    print(f"{PROG}: exported to {out}")
    return 0


@hydra.main(version_base=None, config_path=RECIPES, config_name=DEFAULT_RECIPE)
def _hydra_main(cfg: DictConfig) -> None:
    code = run(cfg)
    if code:
        sys.exit(code)


def check_command_line(argv: list[str]) -> int:
    """Compose the config of `argv` as hydra.main will and run `preflight_export` on its plan, before hydra
    makes its run directory: 2 (one line on stderr) when refused, else 0."""
    from verl_dmd.command_line import compose
    from verl_dmd.plan import DistillationPlan, PlanError
    from verl_dmd.preflight import preflight_export

    try:
        cfg = compose(argv, task_function=_hydra_main, config_path=RECIPES, config_name=DEFAULT_RECIPE)
        if cfg is not None:
            preflight_export(DistillationPlan.from_config(cfg))
    except PlanError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    return 0


def cli() -> None:
    """Console script `verl-dmd-export`."""
    code = check_command_line(sys.argv[1:])
    if code:
        sys.exit(code)
    _hydra_main()


if __name__ == "__main__":
    cli()
