"""The float8 cache's key basis: orthonormal, and it cuts e4m3's error on q·k where keys
have outlier channels (the reason it exists)."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.key_rotation import key_rotation, to_key_basis


@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_rotation_is_orthonormal_and_keeps_scores(head_dim):
    rotation = key_rotation(head_dim, torch.device("cpu"), torch.float64)
    torch.testing.assert_close(rotation @ rotation.T, torch.eye(head_dim, dtype=torch.float64))
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(5, 3, head_dim, generator=generator, dtype=torch.float64)
    k = torch.randn(5, 3, head_dim, generator=generator, dtype=torch.float64)
    rq, rk = to_key_basis(q), to_key_basis(k)
    torch.testing.assert_close(rq @ rk.transpose(-1, -2), q @ k.transpose(-1, -2))


def _e4m3_round_trip(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax() / torch.finfo(torch.float8_e4m3fn).max
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


def test_rotation_reduces_e4m3_score_error_with_outlier_channels():
    """Keys and queries sharing a few large channels, as RoPE'd keys do: the rotated keys'
    round trip through e4m3 perturbs q·k less than the unrotated keys' round trip."""
    generator = torch.Generator().manual_seed(0)
    head_dim, outliers = 64, torch.tensor([3, 40])
    q = torch.randn(256, 1, head_dim, generator=generator)
    k = torch.randn(256, 1, head_dim, generator=generator)
    q[..., outliers] *= 20
    k[..., outliers] *= 20
    exact = q[:, 0] @ k[:, 0].T
    plain_error = (q[:, 0] @ _e4m3_round_trip(k[:, 0]).T - exact).pow(2).mean()
    rq, rk = to_key_basis(q), to_key_basis(k)
    rotated_error = (rq[:, 0] @ _e4m3_round_trip(rk[:, 0]).T - exact).pow(2).mean()
    assert rotated_error < 0.5 * plain_error, (rotated_error, plain_error)
