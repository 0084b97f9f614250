"""The operations a driver asks of every rank, listed once: the verl worker and both worker groups follow it.

Each rank runs `RankSession`'s method of the same name. The dispatch says how one
call's arguments reach the ranks:

- ``all``: every rank gets the same arguments (verl's ``ONE_TO_ALL``);
- ``split``: tensors (also inside dicts and lists) are cut along dim 0 into one
  contiguous, equal part per rank (`verl_dmd.batch.split`); other arguments go to
  every rank whole. The driver sends batches whose size is a multiple of the world
  size (sampling calls pad to one first).

Every call returns one result per rank.
"""

from __future__ import annotations

from typing import Any, Literal

from verl_dmd.batch import split

Dispatch = Literal["all", "split"]

OPERATIONS: dict[str, Dispatch] = {
    "init_model": "all",
    "run_phase": "split",
    "save_checkpoint": "all",
    "load_checkpoint": "all",
    "euler": "split",
    "few_step": "split",
    "decode": "split",
    "sync_replica": "all",
    "replica_few_step": "all",
    "replica_state": "all",
    "sleep": "all",
    "wake": "all",
    "shutdown": "all",
}


def rank_arguments(dispatch: Dispatch, args: tuple, kwargs: dict[str, Any], world_size: int):
    """(args, kwargs) of each rank: lists of length `world_size` per argument, as verl's dispatch expects."""
    if dispatch == "all":
        return (
            tuple([a] * world_size for a in args),
            {k: [v] * world_size for k, v in kwargs.items()},
        )
    return (
        tuple(split(a, world_size, exact=True, what="parts (one per rank)") for a in args),
        {k: split(v, world_size, exact=True, what="parts (one per rank)") for k, v in kwargs.items()},
    )
