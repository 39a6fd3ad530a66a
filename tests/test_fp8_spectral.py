"""Per-head spectral norms of W_Q,h^T W_K,g by batched power iteration, against torch.linalg."""

import pytest
import torch

from fp8.spectral import head_norms
from kernels import HiltError


def _reference(w_q, w_k, n_heads, n_kv):
    q = w_q.double().reshape(n_heads, -1, w_q.shape[1])
    k = w_k.double().reshape(n_kv, -1, w_k.shape[1])
    group = n_heads // n_kv
    return torch.stack([torch.linalg.matrix_norm(q[h].T @ k[h // group], ord=2) for h in range(n_heads)])


@pytest.mark.parametrize("n_heads, n_kv, d_h, d", [(4, 4, 8, 32), (6, 2, 16, 48), (9, 3, 64, 576), (3, 1, 5, 7)])
def test_matches_matrix_norm_with_grouped_keys(n_heads, n_kv, d_h, d):
    torch.manual_seed(n_heads + d)
    w_q, w_k = torch.randn(n_heads * d_h, d), torch.randn(n_kv * d_h, d) * torch.rand(n_kv * d_h, 1)
    r = head_norms(w_q, w_k, n_heads, n_kv)
    assert r.converged
    torch.testing.assert_close(r.sigma, _reference(w_q, w_k, n_heads, n_kv), rtol=1e-6, atol=0)


def test_warm_start_converges_faster_after_a_small_change():
    torch.manual_seed(0)
    w_q, w_k = torch.randn(8 * 16, 64), torch.randn(2 * 16, 64)
    cold = head_norms(w_q, w_k, 8, 2)
    w_q2 = w_q + 1e-3 * torch.randn_like(w_q)
    warm = head_norms(w_q2, w_k, 8, 2, v0=cold.directions)
    again = head_norms(w_q2, w_k, 8, 2)
    assert warm.converged and warm.iterations < again.iterations
    torch.testing.assert_close(warm.sigma, again.sigma, rtol=1e-6, atol=0)


def test_zero_head_gives_zero_not_nan_and_bad_shapes_are_named():
    w_q, w_k = torch.randn(4 * 8, 16), torch.randn(2 * 8, 16)
    w_q[8:16] = 0  # head 1 is all zero
    r = head_norms(w_q, w_k, 4, 2)
    assert r.sigma[1] == 0 and torch.isfinite(r.sigma).all() and (r.sigma[[0, 2, 3]] > 0).all()
    with pytest.raises(HiltError, match="cannot share"):
        head_norms(w_q, w_k, 4, 3)
    with pytest.raises(HiltError, match="does not split into 5 heads"):
        head_norms(w_q, w_k, 5, 1)
    w_k[0, 0] = float("nan")
    with pytest.raises(HiltError, match="NaN"):
        head_norms(w_q, w_k, 4, 2)
