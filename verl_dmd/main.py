"""The hydra entry point: `python -m verl_dmd.main` and the `verl-dmd` console script.

Recipes live in the packaged `recipes/` folder and are chosen with
``--config-name``; every key can be overridden with dotted ``key=value``
arguments. The plan is built and validated before anything starts (a bad value
is one line naming the key and exit code 2); then `DistillationRayTrainer` runs
it on a ray worker group (``resources.nnodes`` x ``resources.workers_per_node``
workers). ``--dry-run`` prints the resolved plan, its fingerprint and the first
phases of the schedule, and stops; ``--local`` runs one rank in this process,
without ray.
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


def compose_plan(
    recipe: str = DEFAULT_RECIPE, overrides: list[str] | tuple[str, ...] = ()
) -> DistillationPlan:
    """The plan `verl-dmd --config-name <recipe> <overrides>` runs, composed without hydra's runtime
    (for scripts and tests): the base config, the recipe over it, then the dotted overrides."""
    from verl_dmd import config_dir

    recipe_config = OmegaConf.load(recipes_dir() / f"{recipe}.yaml")
    recipe_config.pop("defaults", None)
    recipe_config.pop("hydra", None)
    config = OmegaConf.merge(OmegaConf.load(config_dir() / "dmd2.yaml"), recipe_config)
    config.merge_with_dotlist(list(overrides))
    return DistillationPlan.from_config(config)


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


def check_registered(plan: DistillationPlan) -> None:
    """Every name the plan selects from a registry exists (model adapter, method, data provider,
    validator): one line naming the key and the registered names, before anything starts."""
    from verl_dmd.adapters.registry import ADAPTERS
    from verl_dmd.algorithms.registry import METHODS
    from verl_dmd.registry import UnknownNameError
    from verl_dmd.trainer.registry import DATA_PROVIDERS, VALIDATORS

    selections = [
        (ADAPTERS, plan.model.adapter),
        (METHODS, plan.algorithm.name),
        (DATA_PROVIDERS, plan.data.name),
    ]
    if plan.validation.name:
        selections.append((VALIDATORS, plan.validation.name))
    for registry, name in selections:
        try:
            registry.get(name)
        except UnknownNameError as err:
            raise PlanError(str(err)) from None


def run(cfg: Any, *, dry_run: bool = False, backend: str = "ray") -> int:
    """Build the plan from `cfg` and act on it; returns a process exit code."""
    try:
        plan = DistillationPlan.from_config(cfg)
        check_registered(plan)
        if not dry_run:
            plan.check_local_paths()
    except PlanError as err:
        print(f"verl-dmd: error: {err}", file=sys.stderr)
        return 2
    if dry_run:
        print(describe(plan))
        return 0
    print(f"plan fingerprint: {plan.fingerprint()}", flush=True)
    from verl_dmd.trainer.ray_trainer import DistillationRayTrainer

    return DistillationRayTrainer(plan, backend=backend).fit()


_FLAGS = {"--dry-run": False, "--local": False}


@hydra.main(version_base=None, config_path="pkg://verl_dmd.recipes", config_name=DEFAULT_RECIPE)
def _hydra_main(cfg: DictConfig) -> None:
    code = run(cfg, dry_run=_FLAGS["--dry-run"], backend="local" if _FLAGS["--local"] else "ray")
    if code:
        sys.exit(code)


def cli() -> None:
    """Console script `verl-dmd`: hydra's own flags plus ``--list-recipes``, ``--dry-run``, ``--local``."""
    if "--list-recipes" in sys.argv[1:]:
        print("recipes (use --config-name NAME):")
        for name in available_recipes():
            print(f"  {name}{'  (default)' if name == DEFAULT_RECIPE else ''}")
        return
    if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
        print(
            "verl-dmd: distribution-matching distillation (DMD2) of diffusion models on verl\n"
            "  verl-dmd [--config-name RECIPE] [key=value ...]   train (resumes from checkpoint.resume=auto)\n"
            "  verl-dmd --dry-run ...                            print the resolved plan and its schedule\n"
            "  verl-dmd --local ...                              one rank in this process, without ray\n"
            "  verl-dmd --list-recipes                           the packaged recipes\n"
            "  verl-dmd-export [--config-name RECIPE] [key=value ...]   export a checkpoint for inference\n"
            "recipes: " + ", ".join(available_recipes()) + f" (default {DEFAULT_RECIPE})\n"
            "every key: docs/configuration.md; hydra's own help: verl-dmd --hydra-help"
        )
        return
    for flag in _FLAGS:
        if flag in sys.argv[1:]:
            _FLAGS[flag] = True
            sys.argv.remove(flag)
    _hydra_main()


if __name__ == "__main__":
    cli()
