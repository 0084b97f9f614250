"""The DMD2 phase computer against a from-scratch float64 implementation of docs/dmd2.md.

The reference below uses none of verl_dmd.losses: noising, x0 recovery, CFG, the
shift, the per-sample normalizer and the surrogate loss are written out here.
It replays each rank's random draws from the computer's recorded generator
states, in the order the computer documents, and averages the per-rank
gradients as FSDP's reduction does.
"""

from __future__ import annotations

import math

import pytest
import torch
from dist_harness import run_ranks
from dmd2_scenarios import (
    GAN_GENERATOR_WEIGHT,
    GUIDANCE,
    PER_RANK,
    REGRESSION_WEIGHT,
    STUDENT_STEP,
    STUDENT_STEPS,
    dmd2_batch,
    dmd2_plan,
    per_exit_metrics_with_accumulation,
    probe_per_exit_heads,
    probe_student_gradient,
    run_heads_in_bf16_with_accumulation,
)
from peft import LoraConfig
from runtime_scenarios import default_dtype

from verl_dmd.adapters import get_adapter
from verl_dmd.adapters.base import DistributionMatchingModelAdapter, ModelSource
from verl_dmd.algorithms.dmd2 import DMD2Computer

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    return run_ranks(probe_student_gradient, WORLD_SIZE, tmp_path_factory.mktemp("dmd2"))


GAN_SIGMA_MAX = 0.3
REGRESSION_DECAY_STEPS = 4  # with the GAN's own levels, the regression weight decays: 0.5 of it at step 2


@pytest.fixture(scope="module")
def probed_gan_levels(tmp_path_factory):
    """The same phases with the GAN's own noise levels (algorithm.gan_sigma_max), the conv head and the
    regression weight decaying (algorithm.regression_decay_steps)."""
    return run_ranks(
        probe_student_gradient,
        WORLD_SIZE,
        tmp_path_factory.mktemp("dmd2_gan"),
        GAN_SIGMA_MAX,
        "conv",
        REGRESSION_DECAY_STEPS,
    )


def shift(sigma, s):
    return s * sigma / (1 + (s - 1) * sigma)


class Float64DMD2:
    """Plain PEFT model in float64 with the runtime's trained adapters loaded."""

    def __init__(self, weights, gan_sigma_max=None, gan_head="pooled", regression_decay_steps=None):
        self.plan = dmd2_plan(gan_sigma_max, gan_head)
        # the regression weight at the probed student step, written out: linear to 0 at the decay's end
        decay = 1.0 if regression_decay_steps is None else 1.0 - STUDENT_STEP / regression_decay_steps
        self.regression_weight = REGRESSION_WEIGHT * decay
        self.adapter = get_adapter("sd3")()
        torch.manual_seed(self.plan.trainer.seed)
        model = self.adapter.build_model(ModelSource.of(self.plan.model.teacher))
        model.requires_grad_(False)
        for name in ("student", "fake_score", "student_ema"):
            config = LoraConfig(r=4, lora_alpha=4, target_modules=list(self.adapter.default_lora_targets))
            model.add_adapter(config, adapter_name=name)
        # The GAN head's parameters, held here by name (the ranks' trained weights are loaded into them
        # below); gan_logits writes its arithmetic out. pooled: LayerNorm, Linear-SiLU-Linear; conv:
        # LayerNorm, a projection, two stride-2 3x3 convolutions each with GroupNorm, a linear output.
        dim = model.config.num_attention_heads * model.config.attention_head_dim
        head = torch.nn.Module()
        head.norm = torch.nn.LayerNorm(dim)
        if gan_head == "pooled":
            head.mlp = torch.nn.Sequential(
                torch.nn.Linear(dim, dim), torch.nn.SiLU(), torch.nn.Linear(dim, 1)
            )
        else:
            head.proj = torch.nn.Linear(dim, dim)
            conv, norm = (lambda: torch.nn.Conv2d(dim, dim, 3)), (lambda: torch.nn.GroupNorm(8, dim))
            head.down = torch.nn.Sequential(conv(), norm(), torch.nn.SiLU(), conv(), norm(), torch.nn.SiLU())
            head.out = torch.nn.Linear(dim, 1)
        self.gan_head = gan_head
        model.add_module("dmd_gan_head", head)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for key, value in weights.items():
                params[key.split(":", 1)[1]].copy_(value)
        self.model = model.double()
        self.student_params = {n: p for n, p in self.model.named_parameters() if ".student." in n}

    def velocity(self, role, x_t, sigma, cond):
        if role == "teacher":
            self.model.disable_adapters()
        else:
            self.model.enable_adapters()
            self.model.set_adapter(role)
        for p in self.student_params.values():
            p.requires_grad_(True)
        return self.adapter.predict(self.model, x_t, sigma, cond)

    def gan_logits(self, x_t, sigma, cond):
        """D(x_t): the head on the last transformer block's image tokens, fake-score adapter on."""
        tokens = []
        hook = self.model.transformer_blocks[-1].register_forward_hook(
            lambda m, a, out: tokens.append(out[1])
        )
        try:
            self.velocity("fake_score", x_t, sigma, cond)
        finally:
            hook.remove()
        head, features = self.model.dmd_gan_head, tokens[0]
        if self.gan_head == "pooled":
            return head.mlp(head.norm(features.mean(dim=1)))
        # conv: the 16 image tokens of an 8x8 latent in 2x2 patches, row-major on a 4x4 grid
        b, _, d = features.shape
        f = torch.nn.functional
        x = f.layer_norm(features, (d,), head.norm.weight, head.norm.bias, 1e-5) @ head.proj.weight.T
        x = (x + head.proj.bias).reshape(b, 4, 4, d).permute(0, 3, 1, 2)
        for conv, norm in ((head.down[0], head.down[1]), (head.down[3], head.down[4])):
            x = f.conv2d(x, conv.weight, conv.bias, stride=2, padding=1)
            x = f.silu(f.group_norm(x, 8, norm.weight, norm.bias, 1e-5))
        return x.mean(dim=(2, 3)) @ head.out.weight.T + head.out.bias

    def rank_gradient(self, batch, state):
        alg = self.plan.algorithm
        local, shared = torch.Generator(), torch.Generator()
        local.set_state(state["local"])
        shared.set_state(state["shared"])
        cond = {k[5:]: v.double() for k, v in batch.items() if k.startswith("cond.")}
        uncond = {k[7:]: v.double() for k, v in batch.items() if k.startswith("uncond.")}
        x_t = batch["noise"].double()
        b = x_t.shape[0]
        levels = [shift(1 - i / STUDENT_STEPS, alg.sigma_shift) for i in range(STUDENT_STEPS + 1)]
        exit_index = int(torch.randint(STUDENT_STEPS, (1,), generator=shared).item())
        for step in range(exit_index + 1):
            sigma = torch.full(
                (b,), float(torch.tensor(levels[step], dtype=torch.float32)), dtype=torch.float64
            )
            with torch.set_grad_enabled(step == exit_index):
                x0 = x_t - sigma.view(-1, 1, 1, 1) * self.velocity("student", x_t, sigma, cond)
            if step < exit_index:
                nxt = float(torch.tensor(levels[step + 1], dtype=torch.float32))
                noise = torch.randn(x_t.shape, generator=local, dtype=torch.float32).double()
                x_t = (1 - nxt) * x0.detach() + nxt * noise
        x = x0
        u = torch.rand(b, generator=local, dtype=torch.float64)
        sigma = shift(alg.sigma_min + (alg.sigma_max - alg.sigma_min) * u, alg.sigma_shift)
        sigma = sigma.float().double()  # the computer hands the model float32 levels
        eps = torch.randn(x.shape, generator=local, dtype=torch.float32).double()
        s4 = sigma.view(-1, 1, 1, 1)
        with torch.no_grad():
            x_t = (1 - s4) * x.detach() + s4 * eps
            x0_fake = x_t - s4 * self.velocity("fake_score", x_t, sigma, cond)
            v_c = self.velocity("teacher", x_t, sigma, cond)
            v_u = self.velocity("teacher", x_t, sigma, uncond)
            x0_real = x_t - s4 * (v_u + GUIDANCE * (v_c - v_u))
            weight = torch.stack([(x[i] - x0_real[i]).abs().mean() for i in range(b)]).clamp_min(1e-6)
            grad = (x0_fake - x0_real) / weight.view(-1, 1, 1, 1)
        loss = 0.5 * ((x - (x - grad).detach()) ** 2).mean()
        # GAN generator term, gradient into x through the fake score: at the DMD term's level and eps, or
        # (gan_sigma_max) at its own level in [0, gan_sigma_max], shifted, and its own eps, drawn after them.
        if alg.gan_sigma_max is not None:
            u = torch.rand(b, generator=local, dtype=torch.float64)
            sigma = shift(alg.gan_sigma_max * u, alg.sigma_shift).float().double()
            s4 = sigma.view(-1, 1, 1, 1)
            eps = torch.randn(x.shape, generator=local, dtype=torch.float32).double()
        logits = self.gan_logits((1 - s4) * x + s4 * eps, sigma, cond)
        loss = loss + GAN_GENERATOR_WEIGHT * torch.nn.functional.softplus(-logits).mean()
        # DMD v1 regression: the student's first step (sigma = 1, any shift fixes it) from the paired noise.
        pair_noise = batch["regression.noise"].double()
        pair_cond = {k[16:]: v.double() for k, v in batch.items() if k.startswith("regression.cond.")}
        ones = torch.ones(b, dtype=torch.float64)
        x_pair = pair_noise - self.velocity("student", pair_noise, ones, pair_cond)
        regression = ((x_pair - batch["regression.target"].double()) ** 2).mean()
        loss = loss + self.regression_weight * regression
        grads = torch.autograd.grad(loss, list(self.student_params.values()))
        return exit_index, regression.item(), dict(zip(self.student_params, grads, strict=True))

    def fake_phase_losses(self, batch, state):
        """The fake-score phase's denoising and discriminator losses from the generator `state`, replaying
        its draws: exit index (shared); re-noising before the exit; the level and eps of the denoising
        term; with gan_sigma_max the fake input's GAN level and noise, then the real input's level; last
        the real input's noise."""
        alg = self.plan.algorithm
        local, shared = torch.Generator(), torch.Generator()
        local.set_state(state["local"])
        shared.set_state(state["shared"])
        cond = {k[5:]: v.double() for k, v in batch.items() if k.startswith("cond.")}
        real_cond = {k[10:]: v.double() for k, v in batch.items() if k.startswith("real.cond.")}
        x_t = batch["noise"].double()
        b = x_t.shape[0]
        levels = [shift(1 - i / STUDENT_STEPS, alg.sigma_shift) for i in range(STUDENT_STEPS + 1)]
        exit_index = int(torch.randint(STUDENT_STEPS, (1,), generator=shared).item())
        with torch.no_grad():
            for step in range(exit_index + 1):
                level = float(torch.tensor(levels[step], dtype=torch.float32))
                sigma = torch.full((b,), level, dtype=torch.float64)
                x = x_t - sigma.view(-1, 1, 1, 1) * self.velocity("student", x_t, sigma, cond)
                if step < exit_index:
                    nxt = float(torch.tensor(levels[step + 1], dtype=torch.float32))
                    noise = torch.randn(x_t.shape, generator=local, dtype=torch.float32).double()
                    x_t = (1 - nxt) * x + nxt * noise

            def level(low, high):
                u = torch.rand(b, generator=local, dtype=torch.float64)
                return shift(low + (high - low) * u, alg.sigma_shift).float().double()

            def noised(clean, sigma, noise):
                s4 = sigma.view(-1, 1, 1, 1)
                return (1 - s4) * clean + s4 * noise

            def normal():
                return torch.randn(x.shape, generator=local, dtype=torch.float32).double()

            sigma = level(alg.fake_sigma_min, alg.fake_sigma_max)
            eps = normal()
            velocity = self.velocity("fake_score", noised(x, sigma, eps), sigma, cond)
            denoise = ((velocity - (eps - x)) ** 2).mean()
            if alg.gan_sigma_max is None:
                fake_logits = self.gan_logits(noised(x, sigma, eps), sigma, cond)
                real_sigma = sigma
            else:
                gan_sigma = level(0.0, alg.gan_sigma_max)
                fake_logits = self.gan_logits(noised(x, gan_sigma, normal()), gan_sigma, cond)
                real_sigma = level(0.0, alg.gan_sigma_max)
            real_logits = self.gan_logits(
                noised(batch["real.x0"].double(), real_sigma, normal()), real_sigma, real_cond
            )
        softplus = torch.nn.functional.softplus
        return denoise.item(), (softplus(fake_logits).mean() + softplus(-real_logits).mean()).item()


@pytest.mark.parametrize("gan_sigma_max", [None, GAN_SIGMA_MAX])
def test_discriminator_phase_matches_float64_reference(gan_sigma_max, request):
    """The last fake-score phase's denoising and discriminator losses (averaged over the 2 ranks) equal a float64
    replay of its draws from the state it started in, with the weights it started from: the pooled head at
    the phase's levels, and the conv head at the GAN's own levels for the fake and the real input."""
    rank0, rank1 = request.getfixturevalue("probed" if gan_sigma_max is None else "probed_gan_levels")
    head = "pooled" if gan_sigma_max is None else "conv"
    reference = Float64DMD2(rank0["before_fake"]["weights"], gan_sigma_max, head)
    batch = dmd2_batch(reference.adapter, reference.model, PER_RANK * WORLD_SIZE, seed=103)
    with default_dtype(torch.float64):
        losses = [
            reference.fake_phase_losses(
                {k: v.float().chunk(WORLD_SIZE)[rank] for k, v in batch.items()},
                result["before_fake"]["state"],
            )
            for rank, result in enumerate((rank0, rank1))
        ]
    got, other = rank0["phase_metrics"][3], rank1["phase_metrics"][3]
    for key in ("fake_score/fake_loss", "fake_score/gan_discriminator_loss"):
        assert got[key] == other[key]  # averaged over the ranks
    want_denoise = sum(d for d, _ in losses) / WORLD_SIZE
    want_disc = sum(g for _, g in losses) / WORLD_SIZE
    assert got["fake_score/fake_loss"] == pytest.approx(want_denoise, rel=1e-4)
    assert got["fake_score/gan_discriminator_loss"] == pytest.approx(want_disc, rel=1e-4)
    assert abs(want_disc - 2 * math.log(2)) > 1e-3  # the head has trained: not the untrained value


@pytest.mark.parametrize("gan_sigma_max", [None, GAN_SIGMA_MAX])
def test_student_gradient_matches_float64_reference(gan_sigma_max, request):
    """The reduced student gradient of a guided, 3-step, backward-simulated DMD2 phase with the GAN
    generator and regression terms on 2 ranks equals the rank-averaged float64 reference gradient
    (relative error < 1e-4); the fake-score phases before it trained the GAN head on real data. With
    algorithm.gan_sigma_max the GAN term reads its own noise levels (and the conv head reads them)."""
    rank0, rank1 = request.getfixturevalue("probed" if gan_sigma_max is None else "probed_gan_levels")
    # Built in float32 (the ranks' init and draws), then converted: float64 from here on.
    if gan_sigma_max is None:
        reference = Float64DMD2(rank0["weights"], gan_sigma_max, "pooled")
    else:
        reference = Float64DMD2(rank0["weights"], gan_sigma_max, "conv", REGRESSION_DECAY_STEPS)
        assert reference.regression_weight == REGRESSION_WEIGHT / 2
    probe = dmd2_batch(reference.adapter, reference.model, PER_RANK * WORLD_SIZE, seed=999)
    with default_dtype(torch.float64):
        per_rank = []
        exits = []
        for rank, result in enumerate((rank0, rank1)):
            part = {k: v.float().chunk(WORLD_SIZE)[rank] for k, v in probe.items()}
            exit_index, regression, grads = reference.rank_gradient(part, result["state"])
            exits.append(exit_index)
            per_rank.append(grads)
            assert result["metrics"]["regression_loss"] == pytest.approx(regression, rel=1e-5)
    assert exits[0] == exits[1] == rank0["metrics"]["exit_index"] == rank1["metrics"]["exit_index"]
    checked = 0
    for name, g0 in per_rank[0].items():
        want = (g0 + per_rank[1][name]) / 2
        got = rank0["grads"][f"student:{name}"]
        assert torch.equal(got, rank1["grads"][f"student:{name}"])
        if want.norm() == 0:
            assert got.norm() == 0
            continue
        error = float((got.double() - want).norm() / want.norm())
        assert error < 1e-4, (name, error)
        checked += 1
    assert checked == len(per_rank[0])


def test_gan_head_belongs_to_the_fake_score_and_learns_only_in_its_phases(probed):
    """The head's parameters are the fake score's; fake-score phases move them (the discriminator term
    on real vs student samples), the student phase does not; both GAN metrics are reported."""
    rank0, _ = probed
    assert rank0["head_role"] == ["fake_score"]
    assert rank0["head_moves"] == [
        ("fake_score", True),
        ("student", False),
        ("fake_score", True),
        ("fake_score", True),
    ]
    fake_metrics = [m for m in rank0["phase_metrics"] if "fake_score/fake_loss" in m]
    assert len(fake_metrics) == 3 and all(
        math.isfinite(m["fake_score/gan_discriminator_loss"]) for m in fake_metrics
    )
    # an untrained head outputs logits near 0: softplus(0) + softplus(0) = 2 log 2
    assert fake_metrics[0]["fake_score/gan_discriminator_loss"] == pytest.approx(2 * math.log(2), abs=0.3)
    assert math.isfinite(rank0["metrics"]["gan_generator_loss"])


def test_per_exit_group_heads_each_learn_and_judge_only_their_own_steps(tmp_path):
    """algorithm.gan_heads=per_exit_group: a fake-score phase trains only the head of the step it drew (the
    first step's head, or the later steps'), a student phase trains neither, and a student phase's GAN
    generator term reads only its step's head, and each head's loss is logged under its group's name; both
    ranks agree."""
    rank0, rank1 = run_ranks(probe_per_exit_heads, WORLD_SIZE, tmp_path)
    assert rank0 == rank1
    fake = [(exit_index, moved) for role, exit_index, moved in rank0["phases"] if role == "fake_score"]
    assert {e == 0 for e, _ in fake} == {True, False}  # both exit groups were drawn
    for exit_index, moved in fake:
        assert moved == ["dmd_gan_head" if exit_index == 0 else "dmd_gan_head_later"], (exit_index, moved)
    assert all(moved == [] for role, _, moved in rank0["phases"] if role == "student")
    assert rank0["reads"] == {
        "first": {"dmd_gan_head": True, "dmd_gan_head_later": False},
        "later": {"dmd_gan_head": False, "dmd_gan_head_later": True},
    }
    # each head's loss is also logged under its own name (one micro-batch per phase: the plain name's value)
    for role, exit_index, metrics in rank0["gan_metrics"]:
        name = f"{role}/gan_{'discriminator' if role == 'fake_score' else 'generator'}_loss"
        group = "first_step" if exit_index == 0 else "later_steps"
        assert metrics == {name: metrics[name], f"{name}_{group}": metrics[name]}, (role, exit_index, metrics)


def test_each_heads_logged_loss_is_the_mean_over_the_micro_batches_that_drew_it(tmp_path):
    """gan_heads=per_exit_group, 2 ranks x 2 micro-batches: a phase logs each head's loss only when one of its
    micro-batches drew that head's steps; where both heads ran, the plain name is their mean."""
    rank0, rank1 = run_ranks(per_exit_metrics_with_accumulation, WORLD_SIZE, tmp_path)
    assert rank0 == rank1
    mixed = set()
    for role, exits, metrics in rank0:
        name = f"{role}/gan_{'discriminator' if role == 'fake_score' else 'generator'}_loss"
        groups = {"first_step" if e == 0 else "later_steps" for e in exits}
        assert set(metrics) == {name} | {f"{name}_{g}" for g in groups}, (role, exits, metrics)
        if len(groups) == 2:
            mixed.add(role)
            mean = (metrics[f"{name}_first_step"] + metrics[f"{name}_later_steps"]) / 2
            assert metrics[name] == pytest.approx(mean, rel=1e-12), (role, exits, metrics)
        else:
            assert metrics[f"{name}_{groups.pop()}"] == metrics[name], (role, exits, metrics)
    assert mixed == {"fake_score", "student"}  # both kinds of phase mixed the heads at least once


def test_a_head_no_micro_batch_runs_does_not_break_a_backward_without_gradient_sync(tmp_path):
    """bf16, two micro-batches per phase, every exit the first: the later steps' head never runs forward,
    and FSDP2's backward of the first micro-batch (no gradient sync) used to fail on it (the engine now
    gathers every declared module once at start)."""
    for rank in run_ranks(run_heads_in_bf16_with_accumulation, WORLD_SIZE, tmp_path):
        assert rank == ["fake_score:True", "student:True", "fake_score:True"]


def test_per_exit_group_heads_are_declared_only_for_a_multi_step_student():
    """A 1-step student has the one head whatever algorithm.gan_heads says; shared declares one head."""
    adapter = get_adapter("sd3")()

    def declared(**changes):
        algorithm = dmd2_plan(gan_heads=changes.pop("gan_heads")).algorithm
        algorithm = algorithm.__class__(**{**algorithm.__dict__, **changes})
        return [m.name for m in DMD2Computer(adapter, algorithm, seed=0, rank=0).extra_modules()]

    assert declared(gan_heads="per_exit_group") == ["dmd_gan_head", "dmd_gan_head_later"]
    assert declared(gan_heads="per_exit_group", student_steps=1) == ["dmd_gan_head"]
    assert declared(gan_heads="shared") == ["dmd_gan_head"]
    assert declared(gan_heads="per_exit_group", gan_discriminator_weight=0.0, gan_generator_weight=0.0) == []


def test_exit_index_is_shared_across_ranks(probed):
    """The backward-simulation exit index comes from a generator seeded alike on every rank."""
    rank0, rank1 = probed
    assert rank0["exits"] == rank1["exits"]
    assert len(set(rank0["exits"])) == STUDENT_STEPS  # and it does vary over the schedule


class _RecordingAdapter(DistributionMatchingModelAdapter):
    """Stands in for a model adapter: records grad mode per call; velocity = w * x_t."""

    def __init__(self):
        self.grad_modes = []

    def predict(self, module, x_t, sigma, cond):
        self.grad_modes.append(torch.is_grad_enabled())
        return module * x_t


@pytest.mark.parametrize("exit_index", [0, 1, 3])
def test_backward_simulation_runs_grad_only_at_the_exit(exit_index):
    """Steps before the exit run without grad; the exit step with grad; re-noising happens between."""
    plan = dmd2_plan()
    algorithm = plan.algorithm.__class__(**{**plan.algorithm.__dict__, "student_steps": 4})
    recorder = _RecordingAdapter()
    computer = DMD2Computer(recorder, algorithm, seed=0, rank=0)
    w = torch.tensor(0.5, requires_grad=True)
    x = computer.student_sample(w, torch.randn(2, 3), {}, exit_index=exit_index, grad=True)
    assert recorder.grad_modes == [False] * exit_index + [True]
    assert x.requires_grad
    (dx,) = torch.autograd.grad(x.sum(), w)
    assert math.isfinite(float(dx))


def test_unsupported_options_fail_at_construction():
    """Multi-step without backward simulation is refused with the key named."""
    plan = dmd2_plan()
    base = plan.algorithm.__dict__
    cases = {"algorithm.backward_simulation": {"backward_simulation": False}}
    for key, change in cases.items():
        algorithm = plan.algorithm.__class__(**{**base, **change})
        with pytest.raises(ValueError, match=f"config key '{key}'"):
            DMD2Computer(_RecordingAdapter(), algorithm, seed=0, rank=0)


@pytest.mark.parametrize("first_exit", [None, 0.75])
def test_state_dict_round_trip_reproduces_draws(first_exit):
    """Restoring the generator states reproduces the exit indices (and every later draw), uniform or with
    algorithm.first_exit_probability."""
    import dataclasses

    plan = dmd2_plan()
    plan = dataclasses.replace(
        plan, algorithm=dataclasses.replace(plan.algorithm, first_exit_probability=first_exit)
    )
    first = DMD2Computer(_RecordingAdapter(), plan.algorithm, seed=5, rank=1)
    first.exit_index()
    state = {k: v.clone() for k, v in first.state_dict().items()}
    expected = [first.exit_index() for _ in range(10)]
    second = DMD2Computer(_RecordingAdapter(), plan.algorithm, seed=99, rank=0)
    second.load_state_dict(state)
    assert [second.exit_index() for _ in range(10)] == expected


@pytest.mark.parametrize("first", [None, 0.0, 0.75, 1.0])
def test_first_exit_probability_sets_how_often_the_first_step_trains(first):
    """algorithm.first_exit_probability: the exit is the first step with that chance and a later step evenly
    otherwise, drawn alike on every rank; null is the uniform draw (one integer from the shared stream)."""
    import dataclasses

    from verl_dmd.seeding import generator

    algorithm = dataclasses.replace(dmd2_plan().algorithm, first_exit_probability=first)
    assert algorithm.student_steps == STUDENT_STEPS > 2
    draws = 4000
    ranks = [DMD2Computer(_RecordingAdapter(), algorithm, seed=3, rank=r) for r in (0, 1)]
    exits = [[c.exit_index() for _ in range(draws)] for c in ranks]
    assert exits[0] == exits[1]
    # the stream as documented: a uniform number, then (not the first step) an integer for the later steps
    shared = generator(3, "dmd2.shared")
    expected = []
    for _ in range(draws):
        if first is None:
            expected.append(int(torch.randint(STUDENT_STEPS, (1,), generator=shared)))
        elif float(torch.rand(1, generator=shared)) < first:
            expected.append(0)
        else:
            expected.append(1 + int(torch.randint(STUDENT_STEPS - 1, (1,), generator=shared)))
    assert exits[0] == expected
    share = [exits[0].count(i) / draws for i in range(STUDENT_STEPS)]
    p0 = 1.0 / STUDENT_STEPS if first is None else first
    later = (1.0 - p0) / (STUDENT_STEPS - 1)
    # binomial standard deviations at 4000 draws are <= 0.008: 0.035 is over 4 of them
    assert abs(share[0] - p0) < 0.035, share
    assert all(abs(s - later) < 0.035 for s in share[1:]), share
    if first in (0.0, 1.0):
        assert share[0] == first
    # a 1-step student trains its only step whatever the key says, and draws nothing for it
    one_step = dataclasses.replace(algorithm, student_steps=1)
    computer = DMD2Computer(_RecordingAdapter(), one_step, seed=3, rank=0)
    before = computer.shared.get_state()
    assert {computer.exit_index() for _ in range(50)} == {0}
    assert torch.equal(computer.shared.get_state(), before)


def test_regression_weight_decays_linearly_to_zero():
    """algorithm.regression_decay_steps N: the weight at student step s (from 1) is w * max(0, 1 - s / N);
    null keeps it constant."""
    import dataclasses

    constant = DMD2Computer(_RecordingAdapter(), dmd2_plan().algorithm, seed=0, rank=0)
    assert [constant.regression_weight_at(s) for s in (1, 50, 10**6)] == [REGRESSION_WEIGHT] * 3
    algorithm = dataclasses.replace(dmd2_plan().algorithm, regression_decay_steps=4)
    decaying = DMD2Computer(_RecordingAdapter(), algorithm, seed=0, rank=0)
    got = [decaying.regression_weight_at(s) for s in range(1, 7)]
    assert got == pytest.approx([REGRESSION_WEIGHT * f for f in (0.75, 0.5, 0.25, 0.0, 0.0, 0.0)], abs=1e-15)


def test_regression_term_needs_paired_data_in_the_batch():
    """regression_weight > 0 with a provider that sends no pairs is a one-line error naming the keys."""
    plan = dmd2_plan()
    computer = DMD2Computer(_RecordingAdapter(), plan.algorithm, seed=0, rank=0)
    with pytest.raises(
        ValueError, match=r"no regression\.noise, regression\.target; fix: .*regression_pairs"
    ):
        computer._regression_loss({"noise": torch.zeros(2, 3)}, None)


def test_adapter_builds_the_dmd2_computer_for_its_family():
    """`build_distribution_matching_computer(model_config, plan)` gives the plan's DMD2 computer."""
    plan = dmd2_plan()
    adapter = get_adapter("sd3")()
    computer = adapter.build_distribution_matching_computer(plan.model, plan, rank=1)
    assert isinstance(computer, DMD2Computer)
    assert computer.adapter is adapter and computer.algorithm is plan.algorithm and computer.rank == 1
    assert computer.seed == plan.trainer.seed
