"""Tests of the phase schedule: pure Python, milliseconds."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_dmd.controller import STATE_VERSION, DistillationController, TooManySkipsError
from verl_dmd.phases import Role

ratios = st.integers(min_value=1, max_value=8)
warmups = st.integers(min_value=0, max_value=12)
outcome_lists = st.lists(st.booleans(), max_size=200)


def reference_schedule(ratio: int, warmup: int):
    """The successful phases DMD2 asks for, written out independently of the controller."""
    yield from [Role.FAKE_SCORE] * warmup
    while True:
        yield Role.STUDENT
        yield from [Role.FAKE_SCORE] * ratio


def drive(controller: DistillationController, outcomes: list[bool]) -> list[tuple[Role, bool]]:
    """Run phases as a trainer would: ask, run, report; return (role, stepped) per phase."""
    history = []
    for stepped in outcomes:
        role = controller.next_phase()
        controller.record(role, stepped=stepped)
        history.append((role, stepped))
    return history


def some_state() -> DistillationController:
    """A controller past warmup, mid-cycle, with skips of both roles and a pending skip run."""
    controller = DistillationController(fake_update_ratio=2, fake_warmup_steps=3)
    # warmup: F ok, F skip, F ok, F ok | S ok, F skip, F ok, F ok | S skip, S ok, F skip
    drive(controller, [True, False, True, True, True, False, True, True, False, True, False])
    assert controller.in_warmup is False and controller.consecutive_skips == 1
    return controller


@settings(deadline=None)
@given(ratio=ratios, warmup=warmups, outcomes=outcome_lists)
def test_successful_phases_follow_the_schedule_whatever_the_skips(ratio, warmup, outcomes):
    """Successes are a prefix of [fake]*warmup + ([student] + [fake]*K)*; skips are retried and counted apart."""
    controller = DistillationController(fake_update_ratio=ratio, fake_warmup_steps=warmup)
    history = drive(controller, outcomes)

    successes = [role for role, stepped in history if stepped]
    assert successes == list(itertools.islice(reference_schedule(ratio, warmup), len(successes)))
    assert controller.student_skips == sum(
        1 for role, stepped in history if role is Role.STUDENT and not stepped
    )
    assert controller.fake_skips == sum(
        1 for role, stepped in history if role is Role.FAKE_SCORE and not stepped
    )
    assert controller.phase_index == len(outcomes)
    assert controller.global_step == controller.student_steps == successes.count(Role.STUDENT)
    assert controller.fake_steps == successes.count(Role.FAKE_SCORE)
    assert controller.in_warmup == (controller.fake_steps < warmup)


@settings(deadline=None)
@given(ratio=ratios, warmup=warmups, outcomes=outcome_lists)
def test_cycle_position_counts_within_the_block(ratio, warmup, outcomes):
    """cycle_position is 0 for the student, else the 1-based index of the fake phase in warmup or in its cycle."""
    controller = DistillationController(fake_update_ratio=ratio, fake_warmup_steps=warmup)
    fakes_done_in_block = 0  # successful fake steps since the last successful student step (or the start)
    for stepped in outcomes:
        role, position = controller.next_phase(), controller.cycle_position
        if role is Role.STUDENT:
            assert position == 0
        else:
            assert position == fakes_done_in_block + 1
            assert position <= (warmup if controller.in_warmup else ratio)
        controller.record(role, stepped=stepped)
        if stepped:
            fakes_done_in_block = 0 if role is Role.STUDENT else fakes_done_in_block + 1


@settings(deadline=None)
@given(ratio=ratios, warmup=warmups, outcomes=outcome_lists, data=st.data())
def test_resume_from_state_dict_gives_the_same_future(ratio, warmup, outcomes, data):
    """A fresh controller loaded from state_dict() at any point schedules the same future as the original."""
    split = data.draw(st.integers(min_value=0, max_value=len(outcomes)), label="split")
    original = DistillationController(fake_update_ratio=ratio, fake_warmup_steps=warmup)
    drive(original, outcomes[:split])

    resumed = DistillationController(fake_update_ratio=ratio, fake_warmup_steps=warmup)
    resumed.load_state_dict(json.loads(json.dumps(original.state_dict())))
    assert resumed.state_dict() == original.state_dict()

    assert drive(resumed, outcomes[split:]) == drive(original, outcomes[split:])
    assert resumed.state_dict() == original.state_dict()


def test_state_dict_is_plain_ints_for_json_and_weights_only_torch_load(tmp_path):
    """state_dict() holds only ints (version included) and round-trips JSON and torch.load(weights_only=True)."""
    state = some_state().state_dict()
    assert state["version"] == STATE_VERSION
    assert {"fake_update_ratio", "fake_warmup_steps"} <= state.keys()
    assert all(type(value) is int for value in state.values())

    assert json.loads(json.dumps(state)) == state
    path = tmp_path / "trainer_state.pt"
    torch.save(state, path)
    loaded = torch.load(path, weights_only=True)
    assert loaded == state

    resumed = DistillationController(fake_update_ratio=2, fake_warmup_steps=3)
    resumed.load_state_dict(loaded)
    assert resumed.state_dict() == state


def test_next_phase_is_idempotent():
    """Asking twice without recording returns the same role and changes no counter."""
    controller = some_state()
    before = controller.state_dict()
    assert controller.next_phase() is controller.next_phase()
    assert controller.state_dict() == before


@pytest.mark.parametrize("wrong_role", [Role.STUDENT, Role.TEACHER, Role.STUDENT_EMA, "fake_score"])
def test_record_of_a_role_that_was_not_announced_raises(wrong_role):
    """The trainer may only report the phase the controller announced; the error names both roles."""
    controller = DistillationController(fake_update_ratio=1, fake_warmup_steps=1)
    assert controller.next_phase() is Role.FAKE_SCORE
    with pytest.raises(ValueError, match="announced fake_score") as excinfo:
        controller.record(wrong_role, stepped=True)
    assert "\n" not in str(excinfo.value)
    assert controller.phase_index == 0


@pytest.mark.parametrize("stepped", [1, 0, None, "True"])
def test_record_requires_a_real_bool(stepped):
    """`stepped` must be a bool; truthy look-alikes raise and advance nothing."""
    controller = DistillationController(fake_update_ratio=1)
    with pytest.raises(TypeError, match="stepped"):
        controller.record(Role.STUDENT, stepped=stepped)
    assert controller.phase_index == 0


def test_too_many_consecutive_skips_raises_after_the_limit_not_before():
    """max_consecutive_skips skips in a row are tolerated; one more raises a one-line error naming the fix."""
    controller = DistillationController(fake_update_ratio=2, max_consecutive_skips=3)
    drive(controller, [False, False, False])
    assert controller.consecutive_skips == 3
    with pytest.raises(TooManySkipsError) as excinfo:
        drive(controller, [False])
    message = str(excinfo.value)
    assert "\n" not in message
    for fragment in (
        "4 consecutive",
        "max_consecutive_skips=3",
        "student_skips=4",
        "trainer.max_consecutive_skips",
    ):
        assert fragment in message
    assert isinstance(excinfo.value, RuntimeError)


def test_a_success_resets_the_consecutive_skip_run():
    """Skips separated by a successful step never add up to the limit."""
    controller = DistillationController(fake_update_ratio=2, max_consecutive_skips=2)
    drive(controller, [False, False, True] * 10)
    assert controller.consecutive_skips == 0
    assert controller.student_skips + controller.fake_skips == 20


def test_zero_max_consecutive_skips_means_unlimited():
    """max_consecutive_skips=0 never raises, however long the run of skips."""
    controller = DistillationController(fake_update_ratio=2)
    drive(controller, [False] * 1000)
    assert controller.consecutive_skips == controller.student_skips == 1000
    assert controller.global_step == 0


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("fake_update_ratio", 0),
        ("fake_update_ratio", -1),
        ("fake_update_ratio", True),
        ("fake_update_ratio", 2.5),
        ("fake_update_ratio", "3"),
        ("fake_warmup_steps", -1),
        ("fake_warmup_steps", True),
        ("fake_warmup_steps", 2.5),
        ("fake_warmup_steps", "3"),
        ("max_consecutive_skips", -1),
        ("max_consecutive_skips", True),
        ("max_consecutive_skips", 2.5),
        ("max_consecutive_skips", "3"),
    ],
)
def test_invalid_constructor_arguments_raise_one_line_errors(argument, value):
    """Out-of-range, bool and non-int arguments raise one-line ValueErrors naming the argument and value."""
    kwargs = {"fake_update_ratio": 2, argument: value}
    with pytest.raises(ValueError) as excinfo:
        DistillationController(**kwargs)
    message = str(excinfo.value)
    assert "\n" not in message
    assert message.startswith(f"{argument}={value!r}")
    assert "fix:" in message


def test_zero_warmup_starts_with_the_student():
    """Without warmup the first phase is the student's, then K fake phases."""
    controller = DistillationController(fake_update_ratio=3)
    roles = [role for role, _ in drive(controller, [True] * 8)]
    assert roles == [Role.STUDENT, *[Role.FAKE_SCORE] * 3, Role.STUDENT, *[Role.FAKE_SCORE] * 3]


def changed(state: dict, **updates) -> dict:
    return {**state, **updates}


def without(state: dict, key: str) -> dict:
    return {name: value for name, value in state.items() if name != key}


@pytest.mark.parametrize(
    ("make_state", "key"),
    [
        (lambda s: changed(s, fake_update_ratio=3), "fake_update_ratio"),
        (lambda s: changed(s, fake_warmup_steps=0), "fake_warmup_steps"),
        (lambda s: changed(s, student_skips=-1), "student_skips"),
        (lambda s: changed(s, fake_skips=True), "fake_skips"),
        (lambda s: changed(s, student_steps=2.0), "student_steps"),
        # After 2 student steps, K=2 and warmup 3, fake_steps must lie in [5, 7]: 8 and 3 are impossible.
        (
            lambda s: changed(s, fake_steps=s["fake_steps"] + 3, phase_index=s["phase_index"] + 3),
            "fake_steps",
        ),
        (lambda s: changed(s, fake_steps=3, phase_index=s["phase_index"] - 2), "fake_steps"),
        # Students cannot have stepped while warmup is unfinished.
        (lambda s: changed(s, fake_steps=2, phase_index=s["phase_index"] - 3), "student_steps"),
        (lambda s: changed(s, phase_index=s["phase_index"] + 1), "phase_index"),
        # The pending skip run belongs to the next role (fake_score here), which has only 3 skips.
        (lambda s: changed(s, consecutive_skips=4), "consecutive_skips"),
        (lambda s: without(s, "phase_index"), "phase_index"),
        (lambda s: changed(s, ema_steps=0), "ema_steps"),
        (lambda s: changed(s, version=STATE_VERSION + 1), "version"),
    ],
)
def test_load_state_dict_rejects_bad_state_naming_the_key(make_state, key):
    """Foreign, corrupt or inconsistent state raises a one-line ValueError naming the key and changes nothing."""
    controller = some_state()
    before = controller.state_dict()
    assert before["student_steps"] == 2 and before["fake_steps"] == 5 and before["fake_skips"] == 3
    with pytest.raises(ValueError) as excinfo:
        controller.load_state_dict(make_state(before))
    message = str(excinfo.value)
    assert key in message
    assert "\n" not in message
    assert controller.state_dict() == before


def test_load_state_dict_names_both_values_of_a_schedule_mismatch():
    """A different K is refused with both values, since the counters would change meaning."""
    state = DistillationController(fake_update_ratio=5).state_dict()
    with pytest.raises(ValueError, match=r"fake_update_ratio=5 differs from this run's fake_update_ratio=2"):
        DistillationController(fake_update_ratio=2).load_state_dict(state)


def test_is_done_compares_student_steps_to_the_total():
    """is_done(total) is True once global_step (successful student steps) reaches total."""
    controller = DistillationController(fake_update_ratio=1, fake_warmup_steps=2)
    assert controller.is_done(0)
    drive(controller, [True, True, False])
    assert not controller.is_done(1)
    drive(controller, [True])
    assert controller.global_step == 1
    assert controller.is_done(1) and not controller.is_done(2)
    with pytest.raises(ValueError, match="total_steps"):
        controller.is_done(-1)


def test_repr_shows_the_counters():
    """repr() carries the schedule and every counter, for logs."""
    text = repr(some_state())
    for fragment in (
        "fake_update_ratio=2",
        "student_steps=2",
        "fake_steps=5",
        "fake_skips=3",
        "phase_index=11",
    ):
        assert fragment in text
