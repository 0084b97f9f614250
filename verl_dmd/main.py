"""The hydra entry point: `python -m verl_dmd.main` and the `verl-dmd` console script.

Recipes live in the packaged `recipes/` folder and are chosen with
``--config-name``; every key can be overridden with dotted ``key=value``
arguments. Before hydra runs, `cli` composes the same config itself
(`verl_dmd.command_line`), builds the plan and runs the pre-flight
(`verl_dmd.preflight`): a broken recipe or override, a bad value, a missing or
wrong model, a LoRA target that is not in the model, an unwritable output, an
unusable resume target or too many workers is one line naming the key and exit
code 2, with nothing started and no run directory made. Then
`DistillationRayTrainer` runs the plan on a ray worker group
(``resources.nnodes`` x ``resources.workers_per_node`` workers). ``--dry-run``
prints the resolved plan, its fingerprint and the first phases of the schedule,
and stops; ``--local`` runs one rank in this process, without ray.
"""

from __future__ import annotations

import sys
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from verl_dmd import recipes_dir
from verl_dmd.command_line import compose
from verl_dmd.plan import DistillationPlan, PlanError
from verl_dmd.preflight import check_registered, preflight

DEFAULT_RECIPE = "digits_dmd2"
PREVIEW_PHASES = 16


def available_recipes() -> list[str]:
    """Names accepted by ``--config-name`` from the packaged recipes."""
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def compose_config(recipe: str = DEFAULT_RECIPE, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The config of `verl-dmd --config-name <recipe> <overrides>`, composed without hydra's runtime and not
    yet checked (for scripts and tests): the base config, the recipe over it, then the dotted overrides."""
    from verl_dmd import config_dir

    recipe_config = OmegaConf.load(recipes_dir() / f"{recipe}.yaml")
    recipe_config.pop("defaults", None)
    recipe_config.pop("hydra", None)
    config = OmegaConf.merge(OmegaConf.load(config_dir() / "dmd2.yaml"), recipe_config)
    config.merge_with_dotlist(list(overrides))
    return config


def compose_plan(
    recipe: str = DEFAULT_RECIPE, overrides: list[str] | tuple[str, ...] = ()
) -> DistillationPlan:
    """The plan `verl-dmd --config-name <recipe> <overrides>` runs (`compose_config`, then built and checked)."""
    return DistillationPlan.from_config(compose_config(recipe, overrides))


def schedule_preview(plan: DistillationPlan, num_phases: int) -> list[str]:
    """The roles of the first `num_phases` phases if every phase steps successfully."""
    # Imported here: it imports torch, which a refused command line never needs.
    from verl_dmd.controller import DistillationController

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


def describe(plan: DistillationPlan, backend: str = "ray") -> str:
    """A human-readable summary: the resolved plan, its fingerprint, the ranks `backend` runs and the
    schedule. The fingerprint holds the content of the models named by path (read here, cached afterwards);
    where one is not at hand (a plan looked at on another machine) the line says why instead."""
    try:
        fingerprint = plan.fingerprint()
    except PlanError as err:
        fingerprint = f"not computed here ({err})"
    lines = [
        "verl_dmd resolved plan:",
        OmegaConf.to_yaml(OmegaConf.create(plan.to_dict())).rstrip(),
        f"plan fingerprint: {fingerprint}",
        world_size_line(plan, backend),
        f"first {PREVIEW_PHASES} phases (all succeeding): "
        + " ".join(schedule_preview(plan, PREVIEW_PHASES)),
    ]
    return "\n".join(lines)


def world_size_line(plan: DistillationPlan, backend: str) -> str:
    """How many ranks the run would have: the plan's workers, or one under the local backend (which says
    so, as the run itself does)."""
    asked, device = plan.resources.world_size, plan.resources.device
    if backend != "local" or asked == 1:
        return f"world size: {asked} worker(s) on {device}"
    return (
        f"world size: 1 rank on {device} (--local; resources asks for {asked} workers: per-rank batch sizes "
        "are unchanged, so the global batch is smaller)"
    )


def check(plan: DistillationPlan, *, dry_run: bool, backend: str) -> None:
    """What must hold before anything starts: the registry names for a dry run (which reads no file), the
    whole pre-flight for a run; PlanError with one line."""
    if dry_run:
        check_registered(plan)
    else:
        preflight(plan, backend=backend)


# The (plan, dry_run, backend) that cli's check passed before hydra ran: run() does not check it again.
_CHECKED: list[tuple[dict[str, Any], bool, str]] = []


def run(cfg: Any, *, dry_run: bool = False, backend: str = "ray") -> int:
    """Build the plan from `cfg`, check it (unless cli checked the same one) and act on it; returns a
    process exit code."""
    try:
        plan = DistillationPlan.from_config(cfg)
        if (plan.to_dict(), dry_run, backend) not in _CHECKED:
            check(plan, dry_run=dry_run, backend=backend)
    except PlanError as err:
        print(f"verl-dmd: error: {err}", file=sys.stderr)
        return 2
    if dry_run:
        print(describe(plan, backend))
        return 0
    print(f"plan fingerprint: {plan.fingerprint()}", flush=True)
    from verl_dmd.trainer.ray_trainer import DistillationRayTrainer

    return DistillationRayTrainer(plan, backend=backend).fit()


_FLAGS = {"--dry-run": False, "--local": False}
RECIPES = "pkg://verl_dmd.recipes"


@hydra.main(version_base=None, config_path=RECIPES, config_name=DEFAULT_RECIPE)
def _hydra_main(cfg: DictConfig) -> None:
    code = run(cfg, dry_run=_FLAGS["--dry-run"], backend=_backend())
    if code:
        sys.exit(code)


def _backend() -> str:
    return "local" if _FLAGS["--local"] else "ray"


def check_command_line(argv: list[str]) -> int:
    """Compose the config of `argv` as hydra.main will and check its plan, before hydra makes its run
    directory: 2 (one line on stderr) when refused, else 0 (hydra's own flags, e.g. --cfg, go to hydra)."""
    try:
        cfg = compose(argv, task_function=_hydra_main, config_path=RECIPES, config_name=DEFAULT_RECIPE)
        if cfg is None:
            return 0
        plan = DistillationPlan.from_config(cfg)
        check(plan, dry_run=_FLAGS["--dry-run"], backend=_backend())
    except PlanError as err:
        print(f"verl-dmd: error: {err}", file=sys.stderr)
        return 2
    _CHECKED[:] = [(plan.to_dict(), _FLAGS["--dry-run"], _backend())]
    return 0


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
    code = check_command_line(sys.argv[1:])
    if code:
        sys.exit(code)
    _hydra_main()


if __name__ == "__main__":
    cli()
