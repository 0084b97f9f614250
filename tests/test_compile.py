"""model.compile: torch.compile of every FSDP2 unit's forward trains and samples like eager (2 gloo ranks).

The role switches inside and outside phases (PEFT's active adapter, adapters off for the teacher,
requires_grad per phase, train/eval) are guards of the compiled graphs: a graph compiled for one
role and replayed for another would train the wrong weights, which the comparison with eager
catches. The backend is aot_eager (capture, guards and AOTAutograd's joint graphs, no code
generation, which would take minutes on CPU); the H200 numbers with inductor are in
docs/benchmarks.md.
"""

from __future__ import annotations

import pytest
from dist_harness import run_ranks
from runtime_scenarios import compiled_and_eager

pytestmark = pytest.mark.slow

# float64 trajectories through Adam (as in test_runtime_equivalence): a graph that reorders
# float64 arithmetic moves results by ~1e-16 relative, a wrong role by O(1).
TOLERANCE_FP64 = 1e-9


def relative_error(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@pytest.mark.parametrize("layout", ["shared_base_adapters", "independent"])
def test_compiled_blocks_train_and_sample_like_eager(tmp_path, layout):
    results = run_ranks(compiled_and_eager, 2, tmp_path, layout)
    for rank, got in enumerate(results):
        assert got["graphs"] > 0, "model.compile made no graph: the blocks ran eagerly"
        eager, compiled = got["eager"], got["compiled"]
        for part in ("weights", "forwards", "grads"):
            assert set(compiled[part]) == set(eager[part])
            for name, value in eager[part].items():
                error = relative_error(compiled[part][name], value)
                assert error < TOLERANCE_FP64, (rank, part, name, error)
        assert [role for role, _ in compiled["norms"]] == [role for role, _ in eager["norms"]]
    forwards = results[0]["compiled"]["forwards"]
    # The roles really differ, so a graph replayed for the wrong role could not pass above.
    assert relative_error(forwards["student"], forwards["teacher"]) > 1e-6
    assert relative_error(forwards["fake_score"], forwards["student"]) > 1e-6
