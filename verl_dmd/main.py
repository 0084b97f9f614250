"""The hydra entry point: `python -m verl_dmd.main` and the `verl-dmd` console script.

Recipes live in the packaged `recipes/` folder and are chosen with
``--config-name``; every key can be overridden with dotted ``key=value``
arguments. Today the entry point resolves and validates the plan, prints it with
its fingerprint and the first phases of the DMD2 schedule; training (the ray
trainer) arrives with a later issue and is not faked here.
"""

from __future__ import annotations

import sys
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from verl_dmd import recipes_dir
from verl_dmd.controller import DistillationController
from verl_dmd.plan import DistillationPlan, PlanError

DEFAULT_RECIPE = "digits_dmd2"
PREVIEW_PHASES = 16


def available_recipes() -> list[str]:
    """Names accepted by ``--config-name`` from the packaged recipes."""
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def schedule_preview(plan: DistillationPlan, num_phases: int) -> list[str]:
    """The roles of the first `num_phases` phases if every phase steps successfully."""
    controller = DistillationController(
        fake_update_ratio=plan.algorithm.fake_update_ratio,
        fake_warmup_steps=plan.algorithm.fake_warmup_steps,
    )
    roles = []
    for _ in range(num_phases):
        role = controller.next_phase()
        roles.append(role.value)
        controller.record(role, stepped=True)
    return roles


def describe(plan: DistillationPlan) -> str:
    """A human-readable summary: the resolved plan, its fingerprint and the schedule."""
    lines = [
        "verl_dmd resolved plan:",
        OmegaConf.to_yaml(OmegaConf.create(plan.to_dict())).rstrip(),
        f"plan fingerprint: {plan.fingerprint()}",
        f"world size: {plan.resources.world_size} worker(s) on {plan.resources.device}",
        f"first {PREVIEW_PHASES} phases (all succeeding): "
        + " ".join(schedule_preview(plan, PREVIEW_PHASES)),
    ]
    return "\n".join(lines)


def run(cfg: Any) -> int:
    """Build the plan from `cfg` and act on it; returns a process exit code."""
    try:
        plan = DistillationPlan.from_config(cfg)
    except PlanError as err:
        print(f"verl-dmd: error: {err}", file=sys.stderr)
        return 2
    print(describe(plan))
    print(
        "verl-dmd: training through ray is not implemented yet (the ray trainer is an open issue); this "
        "run validated the plan and printed its schedule. The digits recipe trains without ray: "
        "python scripts/distill_digits.py",
        flush=True,
    )
    return 0


@hydra.main(version_base=None, config_path="pkg://verl_dmd.recipes", config_name=DEFAULT_RECIPE)
def _hydra_main(cfg: DictConfig) -> None:
    code = run(cfg)
    if code:
        sys.exit(code)


def cli() -> None:
    """Console script `verl-dmd`: hydra's own flags plus ``--list-recipes``."""
    if "--list-recipes" in sys.argv[1:]:
        print("recipes (use --config-name NAME):")
        for name in available_recipes():
            print(f"  {name}{'  (default)' if name == DEFAULT_RECIPE else ''}")
        return
    _hydra_main()


if __name__ == "__main__":
    cli()
