"""A hybrid (replicate 2, shard 2) FSDP2 mesh on 4 gloo ranks (model.fsdp_mesh): the same math as the
single-process reference, and checkpoints that do not depend on the mesh.

The reference is test_runtime_equivalence's (plain PEFT or plain copies, one process, the whole global
batch at once) with the global batch of 4 ranks. What a hybrid mesh can get wrong silently: the gradient
norm summed over the replicas too (each square counted twice, so clipping scales wrongly: the norms and
the weights would differ), gradients averaged over the shard group only, or a checkpoint that keeps a
replica's copy twice or loads on one mesh shape only. The replicate mesh (model.fsdp_mesh=replicate: whole
models on each of 2 ranks, a (2, 1) mesh) is held to the same reference, with its gradient norm read
without a collective, and its checkpoints move to and from a plainly sharded run.
"""

from __future__ import annotations

import pytest
import torch
from checkpoint_scenarios import load_and_continue, save_then_continue
from dist_harness import run_ranks
from runtime_scenarios import (
    HYBRID,
    HYBRID_CASES,
    REPLICATE,
    default_dtype,
    hybrid_cases,
    probe_batch,
    replicate_cases,
)
from test_checkpoint_engine import assert_same
from test_runtime_equivalence import TOLERANCE_FP64, Reference, relative_error

from verl_dmd.phases import Role

pytestmark = pytest.mark.slow
WORLD_SIZE = 4
PHASES = 4  # as test_checkpoint_engine: both optimizers hold state at the save


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return run_ranks(hybrid_cases, WORLD_SIZE, tmp_path_factory.mktemp("hybrid"))


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    return run_ranks(replicate_cases, 2, tmp_path_factory.mktemp("replicate"))


def assert_trajectory_equals_reference(results, family, layout, world_size, placements):
    """5 phases: every role's weights (equal on every rank), the forwards, the gradient norms (clipping is
    exercised) and one more phase's gradients equal the single-process float64 reference of the same
    global batch; the parameters lie on the mesh `placements` names."""
    for result in results:
        assert result["placements"] == [placements]
    with default_dtype(torch.float64):
        reference = Reference(family, layout, torch.float64, world_size=world_size)
        ref_norms = reference.train()
        ref_forwards = reference.forwards()
        probe = probe_batch(reference.adapter, reference.models[Role.STUDENT], world_size)
        ref_grads = reference.student_grads(probe)
    rank0 = results[0]
    for rank, result in enumerate(results[1:], start=1):  # every rank clips by the same norm
        assert result["norms"] == rank0["norms"], f"rank {rank}"
    assert [r for r, _ in rank0["norms"]] == [r for r, _ in ref_norms]
    for (_, got), (_, want) in zip(rank0["norms"], ref_norms, strict=True):
        assert abs(got - want) / want < TOLERANCE_FP64, (got, want)
    clip = reference.plan.optim.student.grad_clip
    assert any(role == "student" and norm > clip for role, norm in ref_norms), ref_norms

    ref_weights = reference.weights()
    assert sorted(rank0["weights"]) == sorted(ref_weights)
    for name, want in ref_weights.items():
        for rank, result in enumerate(results[1:], start=1):
            assert torch.equal(result["weights"][name], rank0["weights"][name]), f"rank {rank}: {name}"
        assert relative_error(rank0["weights"][name], want) < TOLERANCE_FP64, name
    for role, want in ref_forwards.items():
        assert relative_error(rank0["forwards"][role], want) < TOLERANCE_FP64, role
    assert sorted(rank0["grads"]) == sorted(ref_grads)
    for name, want in ref_grads.items():
        assert relative_error(rank0["grads"][name], want) < TOLERANCE_FP64, name


@pytest.mark.parametrize(("family", "layout"), HYBRID_CASES, ids=[f"{f}-{lay}" for f, lay in HYBRID_CASES])
def test_hybrid_mesh_trajectory_equals_reference(hybrid, family, layout):
    """5 phases on a (2, 2) mesh: replicated over one dimension, sharded over the other."""
    results = [rank[f"{family}/{layout}"] for rank in hybrid]
    placements = (("replicate", "shard"), (2, 2), "(Replicate(), Shard(dim=0))")
    assert_trajectory_equals_reference(results, family, layout, WORLD_SIZE, placements)


@pytest.mark.parametrize(("family", "layout"), HYBRID_CASES, ids=[f"{f}-{lay}" for f, lay in HYBRID_CASES])
def test_replicate_mesh_trajectory_equals_reference(replicated, family, layout):
    """5 phases on model.fsdp_mesh=replicate over 2 ranks: each rank holds whole models (a (2, 1) mesh), the
    gradient norm is read without a collective (one would raise on the ranks), and the trajectory is the
    reference's."""
    results = [rank[f"{family}/{layout}"] for rank in replicated]
    placements = (("replicate", "shard"), (2, 1), "(Replicate(), Shard(dim=0))")
    assert_trajectory_equals_reference(results, family, layout, 2, placements)


@pytest.mark.parametrize("load_world", [1, 2])
def test_checkpoint_saved_on_a_hybrid_mesh_loads_on_plain_meshes(tmp_path, load_world):
    """Saved on the (2, 2) mesh of 4 ranks, loaded on 1 and on 2 ranks sharded plainly: parameters, the
    EMA and both optimizers' state equal, tensor for tensor."""
    directory = str(tmp_path / "dcp")
    straight = run_ranks(
        save_then_continue, WORLD_SIZE, tmp_path / "a", "sd3", "independent", directory, PHASES, HYBRID
    )
    saved = straight[0]["saved"]
    for rank, result in enumerate(straight[1:], start=1):
        assert_same(result["saved"], saved, f"rank {rank} of the hybrid run")
    resumed = run_ranks(
        load_and_continue, load_world, tmp_path / "b", "sd3", "independent", directory, PHASES, saved
    )
    for rank in range(load_world):
        assert_same(resumed[rank]["loaded"], saved, f"loaded on rank {rank} of {load_world}")


def test_checkpoint_saved_on_a_plain_mesh_loads_on_a_hybrid_mesh(tmp_path):
    """The other way: saved by 2 ranks sharded plainly, loaded on the (2, 2) mesh of 4 ranks."""
    directory = str(tmp_path / "dcp")
    straight = run_ranks(save_then_continue, 2, tmp_path / "a", "sd3", "independent", directory, PHASES)
    saved = straight[0]["saved"]
    resumed = run_ranks(
        load_and_continue, WORLD_SIZE, tmp_path / "b", "sd3", "independent", directory, PHASES, saved, HYBRID
    )
    for rank in range(WORLD_SIZE):
        assert_same(resumed[rank]["loaded"], saved, f"loaded on rank {rank} of the hybrid mesh")


def test_checkpoint_saved_on_a_replicate_mesh_loads_sharded_and_back(tmp_path):
    """Saved by 2 ranks holding whole models (model.fsdp_mesh=replicate), loaded by 2 ranks sharded plainly;
    and saved sharded, loaded replicated: parameters, the EMA and both optimizers' state equal. (That the
    replicate plan builds the (2, 1) mesh is the trajectory test's placements check.)"""
    for saver, loader, name in (
        (REPLICATE, None, "replicate to shard"),
        (None, REPLICATE, "shard to replicate"),
    ):
        directory = str(tmp_path / name / "dcp")
        straight = run_ranks(
            save_then_continue, 2, tmp_path / name / "a", "sd3", "independent", directory, PHASES, saver
        )
        saved = straight[0]["saved"]
        assert_same(straight[1]["saved"], saved, f"{name}: rank 1 of the saving run")
        resumed = run_ranks(
            load_and_continue,
            2,
            tmp_path / name / "b",
            "sd3",
            "independent",
            directory,
            PHASES,
            saved,
            loader,
        )
        for rank in range(2):
            assert_same(resumed[rank]["loaded"], saved, f"{name}: loaded on rank {rank}")
