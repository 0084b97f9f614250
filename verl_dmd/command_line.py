"""The config of an entry point's command line, composed as `hydra.main` will compose it, before it runs.

`hydra.main` creates the run directory (``trainer.output_dir``, with its ``main.log``)
before the task sees the config, and reports a broken recipe or override with a
traceback or its own "HYDRA_FULL_ERROR" text and exit code 1. The entry points
therefore compose the config themselves first, from the same arguments, the same
search path and hydra's own parser, check it, and call `hydra.main` only when it
passes: a refused run leaves nothing behind. Errors of a recipe file (with its
line), an override or a key are one-line `PlanError`s. Hydra's other flags
(``--cfg``, ``--hydra-help``, ``-m``, ``--info``, ...) are hydra's to handle.

Uses hydra's internal parser and composition (hydra-core is pinned to 1.3 in setup.py).
"""

from __future__ import annotations

import copy
import difflib
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verl_dmd.plan import PlanError, plan_keys

# Flags after which hydra.main does something other than one run: left to hydra untouched.
_HYDRA_ONLY = ("help", "hydra_help", "cfg", "resolve", "package", "multirun", "shell_completion", "info",
               "experimental_rerun")  # fmt: skip
_SYNTAX = "allowed: key=value, +key=value (a new key), ~key (remove it)"


def compose(argv: list[str], *, task_function: Callable, config_path: str, config_name: str) -> Any:
    """The task config (hydra node removed) that `task_function`'s hydra.main composes from `argv`, or None
    when `argv` asks hydra for something other than a run. `config_path` and `config_name` are the ones
    given to hydra.main. A broken recipe, override or key is a one-line PlanError."""
    from hydra._internal.utils import get_args_parser

    if "--version" in argv:
        return None
    # hydra's own parser: an unknown flag exits with its usage, as hydra.main would.
    args = get_args_parser().parse_args(argv)
    if any(getattr(args, name) for name in _HYDRA_ONLY):
        return None
    check_overrides(args.overrides)
    cfg = _compose(args, task_function, args.config_path or config_path, args.config_name or config_name)
    return _task_config(cfg)


def check_overrides(overrides: list[str]) -> None:
    """Each override parses as hydra's grammar and names a key (``trainer.total_steps``, ``=3`` and
    ``a.b=[1,`` do not)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except OverrideParseException as err:
            reason = [
                line for line in err.message.splitlines() if not line.startswith(("Error parsing", "See "))
            ]
            raise PlanError(f"override {text!r} does not parse ({'; '.join(reason) or 'syntax error'}); "
                            f"{_SYNTAX}; fix: write key=value, a list as key=[1,2], and quote the override "
                            "for the shell when it holds spaces, brackets or ${...}") from None  # fmt: skip
        if not override.key_or_group:
            raise PlanError(f"override {text!r} names no key; {_SYNTAX}; fix: write it as key=value, "
                            "e.g. trainer.total_steps=100")  # fmt: skip


def _compose(args, task_function: Callable, config_path: str, config_name: str):
    """hydra.main's composition (`hydra._internal.utils._run_hydra`): its search path, its config loader."""
    import yaml
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import (
        create_automatic_config_search_path,
        detect_calling_file_or_module_from_task_function,
        detect_task_name,
    )
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException
    from hydra.types import RunMode
    from omegaconf.errors import OmegaConfBaseException

    calling_file, calling_module = detect_calling_file_or_module_from_task_function(task_function)
    search_path = create_automatic_config_search_path(calling_file, calling_module, config_path)
    if args.config_dir is not None:
        folder = os.path.abspath(args.config_dir)
        if not os.path.isdir(folder):
            raise PlanError(
                f"--config-dir {args.config_dir!r}: no such directory; fix: name a folder of recipes"
            )
        search_path.prepend(provider="command-line", path=f"file://{folder}")
    try:
        hydra = Hydra.create_main_hydra2(detect_task_name(calling_file, calling_module), search_path)
        return hydra.compose_config(config_name, args.overrides, run_mode=RunMode.RUN, from_shell=True,
                                    with_log_configuration=False)  # fmt: skip
    except (HydraException, OmegaConfBaseException, yaml.YAMLError, ValueError) as err:
        marked = _find(err, yaml.MarkedYAMLError)
        if marked is not None:
            raise _yaml_error(marked) from None
        if isinstance(err, MissingConfigException) and str(err).startswith("Cannot find primary config"):
            raise _missing_recipe(config_path, config_name) from None
        unknown = re.match(r"Could not override '([^']+)'", str(err))
        if isinstance(err, ConfigCompositionException) and unknown and _find(err, (KeyError, AttributeError)):
            raise _unknown_key(unknown.group(1), args.overrides) from None
        raise PlanError(f"the config does not compose: {_first_line(err)}; fix: check --config-name and the "
                        "recipe's defaults list, and each override") from None  # fmt: skip
    finally:
        GlobalHydra.instance().clear()


def _task_config(cfg):
    """What hydra.main hands the task: the config without its hydra node, with ``${hydra:...}`` resolvable
    (runtime.output_dir set from hydra.run.dir as hydra's run_job sets it)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict, read_write
    from omegaconf.errors import OmegaConfBaseException

    try:  # a run dir that does not resolve is reported by the plan, at the key that holds the typo
        with read_write(cfg.hydra.runtime), open_dict(cfg.hydra.runtime):
            cfg.hydra.runtime.output_dir = os.path.abspath(str(OmegaConf.select(cfg, "hydra.run.dir")))
    except OmegaConfBaseException:
        pass
    HydraConfig.instance().set_config(cfg)
    task = copy.deepcopy(cfg)
    with read_write(task), open_dict(task):
        del task["hydra"]
    return task


def _find(err: BaseException, kind: type | tuple[type, ...]) -> Any:
    """The first exception of `kind` in `err`'s chain of causes (itself included)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, kind):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _yaml_error(err) -> PlanError:
    """A YAML syntax error, at its file, line and column."""
    mark = err.problem_mark or err.context_mark
    where = f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}" if mark else "a recipe file"
    problem = err.problem or _first_line(err)
    context = f" ({err.context})" if err.context else ""
    return PlanError(f"{where}: not valid YAML: {problem}{context}; fix: correct the YAML there (indentation, "
                     "a closing bracket or quote, 'key: value' with a space after the colon)")  # fmt: skip


def _missing_recipe(config_path: str, config_name: str) -> PlanError:
    """--config-name names no recipe in the search path."""
    from verl_dmd import recipes_dir

    folder = Path(config_path) if os.path.isabs(config_path) else None
    if folder is not None and not folder.is_dir():
        return PlanError(f"--config-path {config_path!r}: no such directory; fix: name the folder that holds "
                         "your recipe (an absolute path)")  # fmt: skip
    if config_path == "pkg://verl_dmd.recipes":
        folder = recipes_dir()
    names = sorted(p.stem for p in folder.glob("*.yaml")) if folder is not None else []
    allowed = f"allowed: {', '.join(names) or 'none there'}; " if folder is not None else ""
    return PlanError(f"--config-name {config_name!r}: no such recipe in {config_path}; {allowed}fix: name a "
                     "recipe there (without .yaml), or set --config-path to the folder of yours")  # fmt: skip


def _unknown_key(key: str, overrides: list[str]) -> PlanError:
    """An override of a key the config does not have (hydra: "Could not override")."""
    text = next((o for o in overrides if o.lstrip("+~").split("=", 1)[0] == key), key)
    keys = plan_keys()
    if key in keys:
        return PlanError(f"override {text!r}: config key '{key}' is not in this recipe's config; fix: add it "
                         f"with +{text.lstrip('+')}, or start the recipe from the dmd2 defaults")  # fmt: skip
    close = difflib.get_close_matches(key, keys, n=1)
    hint = f"did you mean '{close[0]}'?" if close else "fix: see docs/configuration.md for every key"
    return PlanError(f"config key '{key}' is unknown (override {text!r}); {hint}")
