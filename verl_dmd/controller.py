"""Decide which trainable role runs the next phase, from counters of successful optimizer steps.

The schedule is DMD2's two time-scale rule: `fake_warmup_steps` fake-score-only
phases, then cycles of one student phase followed by `fake_update_ratio` (K)
fake-score phases. Only successful optimizer steps advance the schedule; a skipped
phase (non-finite loss or gradient on any rank) is counted apart and retried, so
every cycle holds exactly one student step and K fake-score steps however many
skips happened in between. Pure Python: the standard library and `Role` only.
"""

from __future__ import annotations

from verl_dmd.phases import Role

STATE_VERSION = 1

# The order of state_dict() keys; also the exact key set load_state_dict() accepts.
_STATE_KEYS = (
    "version",
    "fake_update_ratio",
    "fake_warmup_steps",
    "student_steps",
    "fake_steps",
    "student_skips",
    "fake_skips",
    "consecutive_skips",
    "phase_index",
)


class TooManySkipsError(RuntimeError):
    """More consecutive phases were skipped than `max_consecutive_skips` allows."""


def _checked_int(name: str, value: object, *, minimum: int, fix: str) -> int:
    # bool is an int subclass; True as a ratio is almost certainly a config mistake.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"{name}={value!r} is invalid: expected an int >= {minimum} (not a bool); fix: {fix}"
        )
    return value


def _scheduled_role(*, ratio: int, warmup: int, student_steps: int, fake_steps: int) -> Role:
    if fake_steps < warmup:
        return Role.FAKE_SCORE
    # Each student step "pays for" K fake steps; the student runs once they are all done.
    # Invariant (kept by record, checked by load_state_dict): post-warmup fake <= K * student.
    if fake_steps - warmup >= ratio * student_steps:
        return Role.STUDENT
    return Role.FAKE_SCORE


def _role_name(role: object) -> str:
    return role.value if isinstance(role, Role) else repr(role)


class DistillationController:
    """The phase schedule: fake-score warmup, then cycles of 1 student and K fake-score phases.

    Drive it with `next_phase()` -> run that phase -> `record(role, stepped=...)`.
    """

    def __init__(self, *, fake_update_ratio: int, fake_warmup_steps: int = 0, max_consecutive_skips: int = 0):
        self._fake_update_ratio = _checked_int(
            "fake_update_ratio",
            fake_update_ratio,
            minimum=1,
            fix="set the number of fake-score phases per student phase, e.g. 2 (DMD2 uses 5 or 10)",
        )
        self._fake_warmup_steps = _checked_int(
            "fake_warmup_steps",
            fake_warmup_steps,
            minimum=0,
            fix="set the number of fake-score-only steps before the first student step, or 0 for none",
        )
        self._max_consecutive_skips = _checked_int(
            "max_consecutive_skips",
            max_consecutive_skips,
            minimum=0,
            fix="set how many phases in a row may be skipped before training stops, or 0 for unlimited",
        )
        self._student_steps = 0
        self._fake_steps = 0
        self._student_skips = 0
        self._fake_skips = 0
        self._consecutive_skips = 0

    # ------------------------------------------------------------------ counters

    @property
    def fake_update_ratio(self) -> int:
        return self._fake_update_ratio

    @property
    def fake_warmup_steps(self) -> int:
        return self._fake_warmup_steps

    @property
    def max_consecutive_skips(self) -> int:
        return self._max_consecutive_skips

    @property
    def global_step(self) -> int:
        """Successful student optimizer steps: the step count users and checkpoints see."""
        return self._student_steps

    @property
    def student_steps(self) -> int:
        return self._student_steps

    @property
    def fake_steps(self) -> int:
        """Successful fake-score optimizer steps, warmup steps included."""
        return self._fake_steps

    @property
    def student_skips(self) -> int:
        return self._student_skips

    @property
    def fake_skips(self) -> int:
        return self._fake_skips

    @property
    def consecutive_skips(self) -> int:
        """Skips since the last successful step (all of the role next_phase() announces)."""
        return self._consecutive_skips

    @property
    def in_warmup(self) -> bool:
        return self._fake_steps < self._fake_warmup_steps

    @property
    def phase_index(self) -> int:
        """Phases recorded so far, successes and skips: unique per phase attempt within a run."""
        return self._student_steps + self._fake_steps + self._student_skips + self._fake_skips

    @property
    def cycle_position(self) -> int:
        """Where the phase next_phase() announces sits in its block; for logs.

        0 means the student phase. A positive n means the n-th fake-score phase
        (1-based) of the current block: of the cycle after the student phase
        (1..K), or, during warmup, of the warmup block (1..fake_warmup_steps).
        A skip does not move it, because the skipped phase is retried.
        """
        if self.in_warmup:
            return self._fake_steps + 1
        if self.next_phase() is Role.STUDENT:
            return 0
        post_warmup_fake = self._fake_steps - self._fake_warmup_steps
        return post_warmup_fake - self._fake_update_ratio * (self._student_steps - 1) + 1

    # ------------------------------------------------------------------ schedule

    def next_phase(self) -> Role:
        """The role whose phase runs next; a pure function of the successful-step counters."""
        return _scheduled_role(
            ratio=self._fake_update_ratio,
            warmup=self._fake_warmup_steps,
            student_steps=self._student_steps,
            fake_steps=self._fake_steps,
        )

    def record(self, role: Role, *, stepped: bool) -> None:
        """Record the outcome of the phase next_phase() announced: stepped or skipped."""
        expected = self.next_phase()
        if role is not expected:
            # Running a phase the controller did not ask for would silently break the K:1 ratio.
            raise ValueError(
                f"record(role={_role_name(role)}) but the controller announced {expected.value}; "
                "fix: run exactly the phase returned by next_phase()"
            )
        if not isinstance(stepped, bool):
            raise TypeError(
                f"stepped={stepped!r} is invalid: expected a bool; fix: pass the phase result's `stepped` as bool"
            )
        if stepped:
            if role is Role.STUDENT:
                self._student_steps += 1
            else:
                self._fake_steps += 1
            self._consecutive_skips = 0
            return
        if role is Role.STUDENT:
            self._student_skips += 1
        else:
            self._fake_skips += 1
        self._consecutive_skips += 1
        if 0 < self._max_consecutive_skips < self._consecutive_skips:
            raise TooManySkipsError(
                f"{self._consecutive_skips} consecutive skipped phases exceed max_consecutive_skips="
                f"{self._max_consecutive_skips} ({self._counters_text()}); fix: lower the learning rate, "
                "check the data for non-finite values, or raise trainer.max_consecutive_skips"
            )

    def is_done(self, total_steps: int) -> bool:
        """Whether `total_steps` successful student steps have been taken."""
        _checked_int("total_steps", total_steps, minimum=0, fix="pass the number of student steps to train")
        return self._student_steps >= total_steps

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, int]:
        """Plain ints only, so it loads with torch.load(weights_only=True) and round-trips JSON.

        K and the warmup length are saved so a resume with a different schedule is
        caught; max_consecutive_skips is not, so a resume may raise it (the fix the
        TooManySkipsError message suggests).
        """
        return {
            "version": STATE_VERSION,
            "fake_update_ratio": self._fake_update_ratio,
            "fake_warmup_steps": self._fake_warmup_steps,
            "student_steps": self._student_steps,
            "fake_steps": self._fake_steps,
            "student_skips": self._student_skips,
            "fake_skips": self._fake_skips,
            "consecutive_skips": self._consecutive_skips,
            "phase_index": self.phase_index,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore counters after checking them all; nothing changes if any check fails."""
        missing = [key for key in _STATE_KEYS if key not in state]
        unknown = sorted(str(key) for key in state if key not in _STATE_KEYS)
        if missing or unknown:
            raise ValueError(
                f"controller state has missing keys {missing} and unknown keys {unknown}; "
                "fix: load a state produced by DistillationController.state_dict()"
            )
        for key in _STATE_KEYS:
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"controller state {key}={value!r} is invalid: expected a non-negative int; "
                    "fix: load a state produced by DistillationController.state_dict()"
                )
        if state["version"] != STATE_VERSION:
            raise ValueError(
                f"controller state version={state['version']} is unsupported: expected {STATE_VERSION}; "
                "fix: resume with the verl_dmd version that wrote the checkpoint"
            )
        for key, ours in (
            ("fake_update_ratio", self._fake_update_ratio),
            ("fake_warmup_steps", self._fake_warmup_steps),
        ):
            # The counters only mean something under the schedule that produced them.
            if state[key] != ours:
                raise ValueError(
                    f"controller state {key}={state[key]} differs from this run's {key}={ours}: the schedule "
                    f"would change meaning; fix: resume with {key}={state[key]} or start a fresh run"
                )
        _check_consistent(state)
        self._student_steps = state["student_steps"]
        self._fake_steps = state["fake_steps"]
        self._student_skips = state["student_skips"]
        self._fake_skips = state["fake_skips"]
        self._consecutive_skips = state["consecutive_skips"]

    def __repr__(self) -> str:
        return (
            f"DistillationController(fake_update_ratio={self._fake_update_ratio}, "
            f"fake_warmup_steps={self._fake_warmup_steps}, "
            f"max_consecutive_skips={self._max_consecutive_skips}, {self._counters_text()})"
        )

    def _counters_text(self) -> str:
        return (
            f"student_steps={self._student_steps}, fake_steps={self._fake_steps}, "
            f"student_skips={self._student_skips}, fake_skips={self._fake_skips}, "
            f"consecutive_skips={self._consecutive_skips}, phase_index={self.phase_index}"
        )


def _check_consistent(state: dict[str, int]) -> None:
    """Raise if the counters could not have been produced by this schedule (types already checked)."""

    def inconsistent(key: str, why: str) -> ValueError:
        return ValueError(
            f"controller state {key}={state[key]} is inconsistent: {why}; "
            "fix: load an unmodified state produced by DistillationController.state_dict()"
        )

    ratio, warmup = state["fake_update_ratio"], state["fake_warmup_steps"]
    student, fake = state["student_steps"], state["fake_steps"]
    if fake < warmup:
        if student != 0:
            raise inconsistent(
                "student_steps", f"expected 0 while fake_steps={fake} < fake_warmup_steps={warmup}"
            )
    else:
        # Between two student steps exactly K fake steps run, so after s student steps the
        # post-warmup fake count lies in [K*(s-1), K*s] (just 0 when s == 0).
        low, high = max(0, ratio * (student - 1)), ratio * student
        if not low <= fake - warmup <= high:
            raise inconsistent(
                "fake_steps",
                f"with student_steps={student}, fake_update_ratio={ratio} and fake_warmup_steps={warmup} "
                f"expected fake_steps in [{warmup + low}, {warmup + high}]",
            )
    total = student + fake + state["student_skips"] + state["fake_skips"]
    if state["phase_index"] != total:
        raise inconsistent(
            "phase_index", f"expected student_steps + fake_steps + student_skips + fake_skips = {total}"
        )
    # A skip is retried, so a run of consecutive skips all belong to the role that runs next.
    next_role = _scheduled_role(ratio=ratio, warmup=warmup, student_steps=student, fake_steps=fake)
    next_skips = state["student_skips"] if next_role is Role.STUDENT else state["fake_skips"]
    if state["consecutive_skips"] > next_skips:
        raise inconsistent(
            "consecutive_skips",
            f"the next phase is {next_role.value} and only {next_skips} of its phases were skipped",
        )
