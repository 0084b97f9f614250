"""`verl-dmd-prepare`: prompts (and images, and teacher pairs) to the data set a run trains on.

Configured like the trainer: the same recipe (``--config-name``) and dotted
overrides, so one set of keys describes both the data set and the run on it:
``model.adapter`` and ``model.teacher.path`` (the pipeline directory) say how to
encode, ``data.path`` is where the data set goes, ``prepare.*`` says what goes
in it (docs/configuration.md). The config is composed with hydra's composition
(`verl_dmd.command_line`) and run directly: no hydra run directory is made. A bad
input is one line naming it and the fix, exit code 2. Running the same command
again after a stop continues at the first missing shard; on a finished data set
it does nothing.

Several GPUs: ``torchrun --nproc-per-node N -m verl_dmd.prepare_main ...`` (each
rank takes every N-th shard; gloo barriers between stages; rank 0 writes the
manifest).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

PROG = "verl-dmd-prepare"
PROCESS_GROUP_TIMEOUT_H = 48
"""How long a rank waits for the others at a stage boundary (torchrun runs): a rank that resumed with its
shards done waits for a whole stage of the others; a rank that fails makes the others leave at once."""
USAGE = (
    f"{PROG}: encode prompts with a pipeline's own text encoders into the data set a verl-dmd run trains on\n"
    f"  {PROG} --config-name RECIPE model.teacher.path=PIPELINE data.path=OUT prepare.prompts=FILE [key=value ...]\n"
    "  optional: prepare.validation_prompts=FILE prepare.real_images=DIR prepare.teacher_pairs=true\n"
    f"  several GPUs: torchrun --nproc-per-node N -m verl_dmd.prepare_main --config-name RECIPE ...\n"
    "every prepare.* key: docs/configuration.md; the walk-through: docs/quickstart.md section 5"
)


def run(
    cfg,
    *,
    log: Callable[[str], None] | None = None,
    fault: Callable[[str], None] | None = None,
    teardown: bool = True,
) -> int:
    """Prepare the data set of `cfg` (a composed config or mapping); returns a process exit code.

    Under torchrun the ranks' process group is destroyed at the end unless `teardown` is false (the console
    script ends such ranks with os._exit instead: see `cli`)."""
    import os

    from verl_dmd.data.prepared import DatasetError
    from verl_dmd.plan import DistillationPlan, PlanError
    from verl_dmd.prepare.job import AgreedFailure, PrepareError, PrepareJob, RankFailure

    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world_size > 1:
        import datetime

        import torch.distributed as dist

        # Ranks wait for each other between stages; one whose shards were made before waits a whole stage.
        dist.init_process_group("gloo", timeout=datetime.timedelta(hours=PROCESS_GROUP_TIMEOUT_H))
    _quiet_libraries()
    try:
        plan = DistillationPlan.from_config(cfg)
        PrepareJob(plan, log=log, fault=fault).run()
    except (PlanError, PrepareError, DatasetError, ValueError, OSError) as err:
        # With several ranks, a rank's own error is printed by that rank (tagged), another's by rank 0.
        others = isinstance(err, RankFailure)
        if world_size == 1 or rank == 0 or not others:
            tag = f" (rank {rank})" if world_size > 1 and not others else ""
            text = str(err).splitlines()[0] if str(err) else type(err).__name__
            sys.stderr.write(f"{PROG}: error{tag}: {text}\n")  # one write: the ranks' lines do not interleave
            sys.stderr.flush()
        if world_size > 1 and isinstance(err, AgreedFailure):
            import torch.distributed as dist

            dist.barrier()  # every rank has said its line before any exits (torchrun stops the rest at the first exit)
        return 2
    else:
        if world_size > 1:
            import torch.distributed as dist

            # No rank tears its connections down while another still reads the last stage's exchange: gloo
            # aborts the process ("terminate called without an active exception") when a peer closes under it.
            dist.barrier()
    finally:
        if world_size > 1 and teardown:
            import torch.distributed as dist

            dist.destroy_process_group()
    return 0


def _quiet_libraries() -> None:
    """diffusers' and transformers' loading bars and notices would bury prepare's own progress lines."""
    import diffusers
    import transformers

    for library in (diffusers, transformers):
        library.utils.logging.set_verbosity_error()
        library.utils.logging.disable_progress_bar()


def cli() -> None:
    """Console script `verl-dmd-prepare`."""
    from verl_dmd.command_line import compose
    from verl_dmd.main import DEFAULT_RECIPE, RECIPES, _hydra_main
    from verl_dmd.plan import PlanError

    argv = sys.argv[1:]
    if "--help" in argv or "-h" in argv:
        print(USAGE)
        return
    try:
        cfg = compose(argv, task_function=_hydra_main, config_path=RECIPES, config_name=DEFAULT_RECIPE)
    except PlanError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        sys.exit(2)
    if cfg is None:  # hydra's own flags (--cfg, --info, -m, ...): they would run hydra's app, the trainer
        print(f"{PROG}: error: hydra's own flags are not taken here; fix: `{PROG} --help`, or "
              "`verl-dmd --cfg job ...` with the same overrides to see the composed config", file=sys.stderr)  # fmt: skip
        sys.exit(2)
    import os

    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        # Past the last barrier every rank's work is on disk. Tearing gloo down (destroy_process_group, or
        # the destructors at interpreter exit) while a peer does the same aborted a rank now and then
        # ("terminate called without an active exception", exit -6) on a loaded 2-core machine; a rank that
        # leaves with os._exit runs no teardown, so none can.
        code = run(cfg, teardown=False)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    code = run(cfg)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    cli()
