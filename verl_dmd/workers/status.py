"""Where each rank stood when a worker call timed out: per-rank status files and their reading.

A ray actor runs one call at a time, so a rank stuck in an operation cannot be
asked where it is. Instead every rank keeps one file, ``<output_dir>/.ranks/rank_<r>.txt``
(`status_file`), and around each operation (`RankStatus.watch`, applied by the
worker's `operation` decorator):

- it truncates the file and writes a header (rank, pid, host, the thread running
  the operation, the operation, the request it serves, e.g. ``phase 2, fake_score``,
  the start time);
- it arms ``faulthandler.dump_traceback_later`` to append every thread's Python
  stack to that file at `dump_delay` (a little before ``trainer.rpc_timeout_s``),
  from faulthandler's own watchdog thread, which needs neither the GIL nor the
  actor's attention;
- when the operation returns it cancels the dump and appends ``finished: ...``.

On a timeout the driver (`verl_dmd.workers.group`) waits at most `REPORT_WAIT_S`
for the late ranks' dumps (`read_reports`), sorts each rank by its stack
(`RankReport.state`): a rank whose operation thread is not inside torch.distributed
stopped on its own; one blocked in a collective (frames under ``torch/distributed``)
waits for it. `timeout_message` is the one-line error; `write_log` puts every
rank's header and stack into ``<output_dir>/hang-<time>.txt``.

The reading is of Python stacks: on CUDA a rank can wait for an NCCL collective at
a later host synchronisation (``.item()``, ``.tolist()``) instead of inside
torch.distributed, and is then reported as stopped there; its stack in the log
says where.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

STATUS_DIRNAME = ".ranks"
REPORT_WAIT_S = 3.0
"""How long the driver waits past its deadline for the late ranks' stack dumps."""
DUMP_LEAD_S = 2.0
"""A rank dumps its stacks this long before the deadline (at most 10% of the timeout for short ones),
so the dump exists when the driver's deadline passes even if the call reached the rank a little late."""
POLL_S = 0.05
MAX_DUMP_DELAY_S = 365 * 24 * 3600.0
"""The latest a stack dump is scheduled (faulthandler cannot schedule past time_t)."""

State = Literal["stopped", "waiting", "late", "idle", "unknown"]


def status_dir(output_dir: str | os.PathLike) -> Path:
    """The folder of the per-rank status files of a run whose trainer.output_dir is `output_dir`."""
    return Path(output_dir) / STATUS_DIRNAME


def status_file(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"rank_{rank}.txt"


def dump_delay(timeout: float) -> float:
    """Seconds after an operation starts at which its rank dumps its stacks: `DUMP_LEAD_S` before the
    timeout, or 10% of the timeout before it when that is shorter."""
    return max(0.0, timeout - min(DUMP_LEAD_S, 0.1 * timeout))


def describe_request(operation: str, args: tuple, kwargs: dict[str, Any]) -> str:
    """What the call asks, in a few words: ``phase 2, fake_score`` for a phase, the global step of a
    checkpoint, the role of a sampling call; '' when there is nothing to add to the operation's name."""
    for value in (*args, *kwargs.values()):
        if hasattr(value, "phase_index") and hasattr(value, "role"):
            role = getattr(value.role, "value", value.role)
            return f"phase {value.phase_index}, {role}"
    if operation == "save_checkpoint":
        step = args[0] if args else kwargs.get("global_step")
        return f"global step {step}"
    if "role" in kwargs:
        return f"role {getattr(kwargs['role'], 'value', kwargs['role'])}"
    return ""


def _torch_dir() -> str:
    """Where this process's torch lives ('' before it is imported): the driver tells torch's frames by it."""
    torch = sys.modules.get("torch")
    return os.path.dirname(getattr(torch, "__file__", None) or "")


def _stamp(unix: float) -> str:
    return datetime.datetime.fromtimestamp(unix, datetime.UTC).isoformat(timespec="milliseconds")


class RankStatus:
    """One rank's status file, open for the life of the worker (faulthandler writes to its descriptor)."""

    def __init__(self, path: str | os.PathLike, *, rank: int, timeout: float) -> None:
        self.path = Path(path)
        self.rank, self.timeout = rank, float(timeout)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._depth = 0
        self._started = 0.0

    @classmethod
    def open(cls, path: str | os.PathLike, *, rank: int, timeout: float) -> RankStatus | None:
        """The status file, or None (with a note on stderr) where it cannot be created: a timeout then
        still ends the run, without this rank's stack."""
        try:
            return cls(path, rank=rank, timeout=timeout)
        except OSError as err:
            print(f"verl_dmd rank {rank}: no status file ({err}); a timeout will not show this rank's stack",
                  file=sys.stderr, flush=True)  # fmt: skip
            return None

    @contextlib.contextmanager
    def watch(self, operation: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> Iterator[None]:
        """Header, armed dump, the operation, cancelled dump. Nested operations (a subclass's override
        calling ``super()``) belong to the outermost one."""
        self._depth += 1
        if self._depth == 1:
            try:  # neither a full disk nor a timeout faulthandler cannot schedule may fail the operation
                self._begin(operation, describe_request(operation, args, kwargs or {}))
            except (OSError, OverflowError, ValueError) as err:
                print(f"verl_dmd rank {self.rank}: no stack dump armed for {operation} ({err})",
                      file=sys.stderr, flush=True)  # fmt: skip
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._end()

    def _begin(self, operation: str, request: str) -> None:
        self._started = time.time()
        delay = dump_delay(self.timeout)
        header = [
            "# verl_dmd rank status (verl_dmd.workers.status)",
            f"rank: {self.rank}",
            f"pid: {os.getpid()}",
            f"host: {socket.gethostname()}",
            f"thread: 0x{threading.get_ident():016x}",
            f"operation: {operation}",
            f"request: {request}",
            f"started: {_stamp(self._started)}",
            f"started_unix: {self._started:.3f}",
            f"stack dump after: {delay:.3f} s (trainer.rpc_timeout_s = {self.timeout:g} s)",
            f"torch: {_torch_dir()}",
        ]
        # A fresh file per operation: a dump of an earlier call can never be read as this one's.
        os.ftruncate(self._fd, 0)
        os.lseek(self._fd, 0, os.SEEK_SET)
        os.write(self._fd, ("\n".join(header) + "\n").encode())
        # faulthandler's deadline is a time_t: a huge rpc_timeout_s (1e10, "never") cannot be scheduled; no
        # driver waits that long, so a dump after a year is as good as none.
        faulthandler.dump_traceback_later(
            min(delay, MAX_DUMP_DELAY_S), repeat=False, file=self._fd, exit=False
        )

    def _end(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        now = time.time()
        with contextlib.suppress(OSError):
            os.write(
                self._fd, f"finished: {_stamp(now)} (unix {now:.3f}; {now - self._started:.3f} s)\n".encode()
            )


# ---------------------------------------------------------------------- the driver's reading


@dataclass(frozen=True)
class Frame:
    path: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{Path(self.path).name}:{self.line} in {self.function}"


_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def _in_torch(frame: Frame, part: str = "", torch_dir: str = "") -> bool:
    """Whether `frame` is in torch (under its subpackage `part`): below `torch_dir`, the folder the rank
    recorded, or, without one, anywhere in a folder named torch."""
    path = frame.path.replace("\\", "/")
    if torch_dir:
        root = torch_dir.replace("\\", "/").rstrip("/")
        return path.startswith(f"{root}/{part}")
    return f"/torch/{part}" in path


def in_collective(frames: tuple[Frame, ...], torch_dir: str = "") -> bool:
    """Whether a stack (innermost frame first) waits inside torch.distributed: among the innermost run of
    frames inside torch itself, one is under ``torch/distributed`` (a c10d collective, an FSDP2
    all-gather or reduce-scatter, a functional collective's wait, a rendezvous)."""
    for frame in frames:
        if not _in_torch(frame, torch_dir=torch_dir):
            return False
        if _in_torch(frame, "distributed/checkpoint/", torch_dir):
            return False  # DCP's file I/O (a save stuck on storage) is no collective
        if _in_torch(frame, "distributed/", torch_dir):
            return True
    return False


@dataclass(frozen=True)
class RankReport:
    """One rank's status file as the driver read it."""

    rank: int
    text: str
    """The file as read ('' when it was missing)."""
    fields: dict[str, str] = field(default_factory=dict)
    threads: dict[int, tuple[Frame, ...]] = field(default_factory=dict)
    """Thread id -> its Python frames, innermost first (empty before a dump)."""
    finished_unix: float | None = None
    """When the operation returned (None while it runs)."""
    missing: str | None = None
    """Why there is no file to read, if there is none."""

    @property
    def dumped(self) -> bool:
        return bool(self.threads)

    @property
    def operation(self) -> str:
        return self.fields.get("operation", "")

    @property
    def request(self) -> str:
        return self.fields.get("request", "")

    @property
    def started_unix(self) -> float | None:
        with contextlib.suppress(KeyError, ValueError):
            return float(self.fields["started_unix"])
        return None

    def operation_stack(self) -> tuple[Frame, ...]:
        """The frames of the thread that runs the operation (the first thread dumped if it is unknown)."""
        with contextlib.suppress(KeyError, ValueError):
            return self.threads[int(self.fields["thread"], 16)]
        return next(iter(self.threads.values()), ())

    def waits_in_collective(self) -> bool:
        stack, torch_dir = self.operation_stack(), self.fields.get("torch", "")
        if in_collective(stack, torch_dir):
            return True
        # A backward on a GPU runs in autograd's device threads: FSDP2's reduce-scatter waits there.
        if stack and _in_torch(stack[0], "autograd/", torch_dir):
            return any(in_collective(frames, torch_dir) for frames in self.threads.values())
        return False

    def state(self, method: str, sent: float | None = None) -> State:
        """For a rank that did not answer the call of `method` sent at unix time `sent`: ``stopped`` (its
        stack is not in a collective), ``waiting`` (in a collective), ``late`` (it finished the call after
        all, past the deadline), ``idle`` (its last operation finished before the call: it never started
        this one), ``unknown`` (no file or no dump)."""
        if self.fields and self.finished_unix is not None:
            after = sent is not None and self.operation == method and self.finished_unix > sent
            return "late" if after else "idle"
        if self.fields and self.operation != method:
            return "idle"
        if not self.dumped:
            return "unknown"
        return "waiting" if self.waits_in_collective() else "stopped"

    def where(self) -> Frame | None:
        """The innermost Python frame of the operation's thread."""
        stack = self.operation_stack()
        return stack[0] if stack else None


def parse_report(rank: int, text: str) -> RankReport:
    """A status file's text: header fields, the dumped threads' frames, whether the operation finished."""
    fields: dict[str, str] = {}
    threads: dict[int, tuple[Frame, ...]] = {}
    frames: list[Frame] | None = None
    finished: float | None = None
    in_header = True
    for line in text.splitlines():
        if line.startswith("finished: "):
            unix = re.search(r"\(unix ([0-9.]+)", line)
            finished = float(unix.group(1)) if unix else 0.0
            continue
        thread = _THREAD.match(line)
        if thread:
            in_header = False
            ident, frames = int(thread.group(1), 16), []
            threads[ident] = ()
            continue
        if line.startswith("Timeout ("):
            in_header = False
            continue
        if in_header:
            key, sep, value = line.partition(": ")
            if sep and not key.startswith("#"):
                fields[key] = value
            continue
        frame = _FRAME.match(line)
        if frame and frames is not None:
            frames.append(Frame(frame.group(1), int(frame.group(2)), frame.group(3)))
            threads[ident] = tuple(frames)
    return RankReport(rank=rank, text=text, fields=fields, threads=threads, finished_unix=finished)


def read_report(directory: str | os.PathLike, rank: int) -> RankReport:
    path = status_file(directory, rank)
    try:
        text = path.read_text(errors="replace")
    except OSError as err:
        return RankReport(rank=rank, text="", missing=f"{path}: {err.strerror or err}")
    return parse_report(rank, text)


def read_reports(
    directory: str | os.PathLike,
    ranks: Iterable[int],
    late: Iterable[int],
    *,
    method: str,
    sent: float,
    until: float,
) -> dict[int, RankReport]:
    """Every rank's report; waits (until the monotonic time `until`) for each late rank that is still in
    `method` to dump its stacks."""
    ranks, late = list(ranks), list(late)
    while True:
        reports = {rank: read_report(directory, rank) for rank in ranks}
        pending = [
            r for r in late if reports[r].state(method, sent) == "unknown" and reports[r].missing is None
        ]
        if not pending or time.monotonic() >= until:
            break
        time.sleep(POLL_S)
    if any(reports[r].dumped for r in late):
        time.sleep(POLL_S)  # a dump takes microseconds; read again so that none is cut mid-write
        reports = {rank: read_report(directory, rank) for rank in ranks}
    return reports


def classify(
    method: str, late: Iterable[int], reports: dict[int, RankReport], sent: float | None
) -> dict[State, list[int]]:
    """The late ranks by `RankReport.state`."""
    states: dict[State, list[int]] = {"stopped": [], "waiting": [], "late": [], "idle": [], "unknown": []}
    for rank in sorted(late):
        states[reports[rank].state(method, sent)].append(rank)
    return states


def _per_rank(ranks: list[int], describe) -> str:
    """`` (what)`` for one rank, `` (rank 0: what; rank 1: what)`` for several; '' when nothing is known."""
    texts = [describe(rank) for rank in ranks]
    if len(ranks) == 1:
        return f" ({texts[0]})" if texts[0] else ""
    return (
        " (" + "; ".join(f"rank {rank}: {text or '?'}" for rank, text in zip(ranks, texts, strict=True)) + ")"
    )


def _doing(report: RankReport) -> str:
    """What a rank was doing: ``phase 2, fake_score; at ray_workers.py:31 in run_phase``."""
    where = report.where()
    return "; ".join(part for part in (report.request, f"at {where}" if where else "") if part)


def _lateness(report: RankReport, sent: float | None) -> str:
    started, finished = report.started_unix, report.finished_unix
    if started is None or finished is None or sent is None:
        return ""
    return f"started {started - sent:.1f} s after the call was sent, ran {finished - started:.1f} s"


def timeout_message(
    method: str,
    timeout: float,
    late: list[int],
    reports: dict[int, RankReport],
    log: str,
    *,
    sent: float | None = None,
) -> str:
    """The one-line error of a call (sent at unix time `sent`) that `late` did not answer within
    `timeout`; `log` says where the stacks are (a path, or why there is none)."""
    states = classify(method, late, reports, sent)
    stopped, waiting = states["stopped"], states["waiting"]
    within = f"within trainer.rpc_timeout_s = {timeout:g} s"
    parts = []
    if stopped:
        parts.append(
            f"rank(s) {stopped} stopped answering{_per_rank(stopped, lambda r: _doing(reports[r]))} {within}"
        )
        if waiting:
            parts.append(f"rank(s) {waiting} were waiting for them in a collective")
    elif waiting and waiting == sorted(late):
        doing = _per_rank(waiting, lambda r: _doing(reports[r]))
        parts.append(
            f"rank(s) {waiting} did not answer {within}, every one waiting in a collective{doing} (no rank "
            "stopped on its own: the ranks called different collectives, or one left it)"
        )
    elif waiting:
        parts.append(f"rank(s) {waiting} did not answer {within}, waiting in a collective")
    if states["late"]:
        lateness = _per_rank(states["late"], lambda r: _lateness(reports[r], sent))
        parts.append(
            f"rank(s) {states['late']} answered only after trainer.rpc_timeout_s = {timeout:g} s{lateness} "
            "(fix: raise trainer.rpc_timeout_s if that is the time the call needs here)"
        )
    if states["idle"]:
        parts.append(f"rank(s) {states['idle']} were not in the call (their last operation had finished)")
    if states["unknown"]:
        parts.append(f"rank(s) {states['unknown']} did not answer {within} and left no stack")
    return (
        f"worker call {method}: "
        + "; ".join(parts)
        + f"; every rank's stack: {log}; the workers were stopped"
    )


def _verdict(report: RankReport, method: str, sent: float) -> str:
    """A late rank's state, in words, for the log."""
    state = report.state(method, sent)
    if state == "stopped":
        return f"stopped answering, not in a collective (at {report.where()})"
    if state == "waiting":
        return f"waiting in a collective (at {report.where()})"
    if state == "late":
        return f"answered after the deadline ({_lateness(report, sent)})"
    if state == "idle":
        return "not in this call (its last operation had finished)"
    return "did not answer and left no stack dump"


def write_log(
    path: Path,
    message: str,
    reports: dict[int, RankReport],
    late: list[int],
    *,
    method: str,
    sent: float,
    directory: str | os.PathLike,
) -> None:
    """Every rank's header and stack after the verdict, with the times (unix seconds) of the call."""
    now = time.time()
    lines = [
        f"verl_dmd: {message}",
        "",
        f"call sent: {_stamp(sent)} (unix {sent:.3f})",
        f"report written: {_stamp(now)} (unix {now:.3f}, {now - sent:.3f} s after the call was sent)",
        f"status files: {directory}",
        "",
    ]
    for rank, report in sorted(reports.items()):
        verdict = _verdict(report, method, sent) if rank in late else "answered in time"
        started = report.started_unix
        since = (
            f"; its operation started {now - started:.3f} s before this report" if started is not None else ""
        )
        body = report.text.rstrip() or f"(no status file: {report.missing})"
        lines += [f"== rank {rank}: {verdict}{since}", body, ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
