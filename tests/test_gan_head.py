"""DMD2's discriminator heads: the conv head lays the feature tokens on their grid (every family's adapter
finds the grid), sees where things are (the pooled head cannot), and refuses features it cannot lay out."""

from __future__ import annotations

import pytest
import torch

from verl_dmd.adapters import get_adapter
from verl_dmd.adapters.base import ModelSource
from verl_dmd.algorithms.dmd2 import GAN_HEADS, ConvGanHead, GanHead

FAMILIES = ("sd3", "flux", "qwen_image", "wan", "dit")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_lays_its_gan_features_on_a_grid(family):
    """The tiny model of each family: the features its GAN feature module yields are N image tokens, and the
    adapter's grid holds exactly N (square patches of the input, or the square grid of packed tokens); the
    conv head turns them into one logit per sample, with gradients into the features."""
    adapter = get_adapter(family)()
    torch.manual_seed(0)
    model = adapter.build_model(ModelSource(config=adapter.tiny_config))
    x0, cond = adapter.example_batch(model, 3, torch.Generator().manual_seed(1))
    sigma = torch.full((3,), 0.4)
    _, features = adapter.predict_with_features(model, x0, sigma, cond)
    grid = adapter.gan_feature_grid(x0, features)
    assert grid is not None and features.ndim == 3
    assert torch.Size(grid).numel() == features.shape[1]
    if x0.ndim == 5:
        assert grid[0] == x0.shape[2]  # frames are not patched
    head = ConvGanHead(adapter.gan_feature_dim(model))
    features = features.detach().requires_grad_(True)
    logits = head(features, grid)
    assert logits.shape == (3, 1) and torch.isfinite(logits).all()
    (grad,) = torch.autograd.grad(logits.sum(), features)
    assert grad.abs().sum() > 0


def test_a_non_square_latent_gives_its_rows_and_columns():
    """SD3's tiny model on an 8x12 latent (2x2 patches): 24 image tokens on 4 rows of 6, not 6 of 4."""
    adapter = get_adapter("sd3")()
    torch.manual_seed(0)
    model = adapter.build_model(ModelSource(config=adapter.tiny_config))
    x0, cond = adapter.example_batch(model, 2, torch.Generator().manual_seed(1))
    x_t = torch.randn(2, x0.shape[1], 8, 12)
    _, features = adapter.predict_with_features(model, x_t, torch.full((2,), 0.4), cond)
    assert features.shape[1] == 24 and adapter.gan_feature_grid(x_t, features) == (4, 6)
    assert ConvGanHead(adapter.gan_feature_dim(model))(features, (4, 6)).shape == (2, 1)


def test_grid_of_latents_and_packed_tokens():
    adapter = get_adapter("dit")()
    tokens = lambda n: torch.zeros(2, n, 8)  # noqa: E731
    assert adapter.gan_feature_grid(torch.zeros(2, 1, 8, 8), tokens(16)) == (4, 4)  # 2x2 patches
    assert adapter.gan_feature_grid(torch.zeros(2, 4, 8, 12), tokens(24)) == (4, 6)  # not square
    assert adapter.gan_feature_grid(torch.zeros(2, 4, 3, 8, 8), tokens(48)) == (3, 4, 4)  # frames
    assert adapter.gan_feature_grid(torch.zeros(2, 64, 16), tokens(64)) == (8, 8)  # packed tokens
    # what does not account for the tokens: None (the head then refuses)
    assert adapter.gan_feature_grid(torch.zeros(2, 1, 8, 8), tokens(15)) is None
    assert adapter.gan_feature_grid(torch.zeros(2, 1, 8, 8), tokens(20)) is None  # text tokens mixed in
    assert adapter.gan_feature_grid(torch.zeros(2, 60, 16), tokens(60)) is None
    assert adapter.gan_feature_grid(torch.zeros(2, 1, 8, 8), torch.zeros(2, 8)) is None


def test_the_conv_head_sees_the_layout_and_the_pooled_head_does_not():
    """Swap two tokens of the grid: the pooled head's logit is the same up to rounding (a mean over tokens),
    the conv head's changes; a 3-d grid is its frames' logits averaged (frames folded into the batch)."""
    torch.manual_seed(0)
    features = torch.randn(4, 16, 32)
    swapped = features.clone()
    swapped[:, [0, 15]] = features[:, [15, 0]]
    pooled, conv = GanHead(32), ConvGanHead(32)
    torch.testing.assert_close(pooled(features, (4, 4)), pooled(swapped, (4, 4)), rtol=1e-6, atol=1e-7)
    assert (conv(features, (4, 4)) - conv(swapped, (4, 4))).abs().max() > 1e-4
    frames = torch.randn(2, 3 * 16, 32)
    per_frame = conv(frames.reshape(6, 16, 32), (4, 4)).reshape(2, 3)
    expected = per_frame.mean(dim=1, keepdim=True)
    # the linear output commutes with the mean over frames
    torch.testing.assert_close(conv(frames, (3, 4, 4)), expected, rtol=1e-5, atol=1e-6)
    assert {"pooled": GanHead, "conv": ConvGanHead} == GAN_HEADS


def test_the_conv_head_refuses_features_it_cannot_lay_out():
    head = ConvGanHead(16)
    with pytest.raises(ValueError, match=r"algorithm\.gan_head=pooled") as info:
        head(torch.zeros(2, 20, 16), (4, 4))
    assert "\n" not in str(info.value) and "(2, 20, 16)" in str(info.value)
    with pytest.raises(ValueError, match="gan_feature_grid"):
        head(torch.zeros(2, 16, 16), None)
