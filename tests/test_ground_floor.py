"""The ground floor's shared pieces: batches as tensor trees, registries, seeding, LoRA names, the narrow
view computers get, and the registry check of a plan's names."""

from __future__ import annotations

import pytest
import torch

from verl_dmd import batch as batches
from verl_dmd import seeding
from verl_dmd.registry import Registry, UnknownNameError


def tree(size: int) -> dict:
    return {
        "noise": torch.arange(size * 2.0).reshape(size, 2),
        "cond": {"labels": torch.arange(size)},
        "renoise": [torch.ones(size, 3), torch.zeros(size, 3)],
        "schedule": [1.0, 0.5, 0.0],
        "role": "student",
    }


def test_split_cuts_every_tensor_and_hands_other_leaves_whole():
    parts = batches.split(tree(6), 3, exact=True)
    assert [p["noise"].shape[0] for p in parts] == [2, 2, 2]
    assert torch.equal(torch.cat([p["cond"]["labels"] for p in parts]), torch.arange(6))
    assert all(len(p["renoise"]) == 2 and p["renoise"][0].shape == (2, 3) for p in parts)
    assert all(p["schedule"] == [1.0, 0.5, 0.0] and p["role"] == "student" for p in parts)
    uneven = batches.split(tree(5), 2)  # micro-batches may differ by one sample
    assert [p["noise"].shape[0] for p in uneven] == [3, 2]


def test_split_errors_name_the_sizes():
    with pytest.raises(batches.BatchError, match="5 samples does not split into 2 equal ranks; fix: x"):
        batches.split(tree(5), 2, exact=True, what="ranks", fix="x")
    with pytest.raises(batches.BatchError, match="2 samples cannot fill 3 micro-batches"):
        batches.split(tree(2), 3, what="micro-batches")
    with pytest.raises(batches.BatchError, match="disagree on the batch size"):
        batches.split({"a": torch.zeros(2), "b": torch.zeros(3)}, 1)
    with pytest.raises(batches.BatchError, match="0-dim"):
        batches.batch_size({"a": torch.tensor(1.0)})
    assert batches.split({"x": 1}, 2) == [{"x": 1}, {"x": 1}]


def test_pad_then_trim_restores_the_samples():
    padded, pad = batches.pad_to_multiple(tree(5), 4)
    assert pad == 3 and padded["noise"].shape[0] == 8
    assert torch.equal(padded["noise"][5:], padded["noise"][4:5].expand(3, 2))  # the last sample repeated
    assert torch.equal(batches.trim(padded["noise"], pad), tree(5)["noise"])
    assert batches.pad_to_multiple(tree(4), 4)[1] == 0
    assert batches.prefixed({"cond.a": 1, "condx": 2, "cond.b.c": 3}, "cond.") == {"a": 1, "b.c": 3}


def test_seeds_are_hashed_from_named_parts():
    assert seeding.stream_seed(0, "dmd2.local", 1) == seeding.stream_seed("0", "dmd2.local", "1")
    assert seeding.stream_seed(0, "a", 1) != seeding.stream_seed(0, "a", 2) != seeding.stream_seed(1, "a", 1)
    assert seeding.stream_seed(1, 2) != seeding.stream_seed(12)  # the parts are separated
    assert seeding.stream_seed(7, "x") >= 2**32 or seeding.stream_seed(8, "x") >= 2**32  # 64-bit, not 32
    a, b = seeding.generator(3, "s"), seeding.generator(3, "s")
    assert torch.equal(torch.randn(4, generator=a), torch.randn(4, generator=b))
    with pytest.raises(ValueError, match="at least one part"):
        seeding.stream_seed()


def test_registry_registers_lists_and_names_what_is_missing():
    registry: Registry[type] = Registry("widget", key="x.widget", entry_point_group="verl_dmd.test_widgets")

    @registry.register("round")
    class Round:
        pass

    assert registry.names() == ["round"] and registry.get("round") is Round
    registry.register("round")(Round)  # the same class again: fine (a module imported twice)
    with pytest.raises(ValueError, match="registered twice"):
        registry.register("round")(type("Square", (), {}))
    with pytest.raises(UnknownNameError) as info:
        registry.get("rund")
    message = str(info.value)
    assert message == (
        "config key 'x.widget' = 'rund': no such widget; registered: round; fix: pick one, or install the "
        "package that registers it (entry-point group 'verl_dmd.test_widgets')"
    )


def test_lora_names_cover_embeddings_and_dora():
    from verl_dmd.runtime.lora import adapter_of

    assert adapter_of("blocks.0.attn.to_q.lora_A.student.weight") == "student"
    assert adapter_of("embed.lora_embedding_A.fake_score") == "fake_score"
    assert adapter_of("embed.lora_embedding_B.student_ema") == "student_ema"
    assert adapter_of("blocks.0.to_q.lora_magnitude_vector.student.weight") == "student"
    assert adapter_of("blocks.0.attn.to_q.base_layer.weight") is None


def test_a_computer_sees_only_the_phase_runtime_protocol():
    """The object handed to compute_phase has exactly the protocol's members: reaching for the engine (or
    anything else of the runtime) is an AttributeError."""
    from verl_dmd.phases import PhaseRuntime
    from verl_dmd.runtime.runtime import ComputerView

    members = {name for name in dir(PhaseRuntime) if not name.startswith("_")}
    assert members == {"adapter", "rank", "world_size", "use_role", "module_for", "extra_module"}
    view = ComputerView(runtime=None)
    assert {name for name in dir(view) if not name.startswith("_")} == members
    with pytest.raises(AttributeError):
        view.engine  # noqa: B018
    with pytest.raises(AttributeError):
        view.computer = None


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.adapter=ditt", "model.adapter"),
        ("algorithm.name=dmd3", "algorithm.name"),
        ("data.name=digit", "data.name"),
        ("validation.name=digit", "validation.name"),
    ],
)
def test_unknown_registry_names_are_one_line_errors_before_anything_starts(override, key, capsys):
    from verl_dmd.main import compose_plan, run

    cfg = compose_plan("digits_dmd2").to_dict()
    section, name = key.split(".")
    cfg[section][name] = override.split("=")[1]
    assert run(cfg, dry_run=True) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"verl-dmd: error: config key '{key}' = '{override.split('=')[1]}': no such ")
    assert "registered: " in line


def test_dmd2_streams_are_hashed_per_rank_and_shared_alike():
    """The per-rank stream differs across ranks and seeds, the shared one is equal on every rank, and no
    stream of one (seed, rank) repeats another's (arithmetic seeds could)."""
    from verl_dmd.adapters import get_adapter
    from verl_dmd.algorithms.dmd2 import DMD2Computer
    from verl_dmd.main import compose_plan

    algorithm = compose_plan("digits_dmd2").algorithm
    adapter = get_adapter("dit")()
    first = {}
    for seed in range(3):
        for rank in range(4):
            computer = DMD2Computer(adapter, algorithm, seed=seed, rank=rank)
            first[(seed, rank)] = torch.randn(4, generator=computer.local)
            shared = torch.randn(4, generator=computer.shared)
            if rank == 0:
                reference = shared
            assert torch.equal(shared, reference)
    draws = list(first.values())
    assert all(not torch.equal(a, b) for i, a in enumerate(draws) for b in draws[i + 1 :])


def test_the_digits_classifier_leaves_the_global_rng_alone():
    """Training the evaluation's classifier (on the driver, at every validation) draws its init from a
    stream of its own: torch's global RNG is where it was, and two trainings give the same classifier."""
    from verl_dmd.data.digits import load_digits_splits
    from verl_dmd.eval.digits_classifier import train_digits_classifier

    train, _ = load_digits_splits(seed=0)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = train_digits_classifier(train, epochs=1)
    assert torch.equal(torch.get_rng_state(), before)
    b = train_digits_classifier(train, epochs=1)
    assert all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
