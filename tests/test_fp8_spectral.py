"""Per-head spectral norms of W_Q,h^T W_K,g by batched power iteration, against torch.linalg."""

import pytest
import torch

from hilt.fp8.spectral import head_norms
from hilt.errors import HiltError


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


def _layers(path, q_name, k_name, bias: bool, every: int):
    from hilt.quant.sources import open_source

    with open_source(path) as src:
        names = set(src.names())
        for i in range(0, 1000, every):
            if q_name.format(i) not in names:
                return
            w_q, w_k = src.get(q_name.format(i)).float(), src.get(k_name.format(i)).float()
            if bias:  # [W | b]: the bias enters as a constant input 1
                b_q = src.get(q_name.format(i).replace("weight", "bias")).float()
                b_k = src.get(k_name.format(i).replace("weight", "bias")).float()
                w_q, w_k = torch.cat([w_q, b_q[:, None]], 1), torch.cat([w_k, b_k[:, None]], 1)
            yield w_q, w_k


def test_real_checkpoints_every_head(minilm_dir, smollm2_gguf):
    """1e-3 relative on every head of MiniLM (12 heads, biases) and of every 7th SmolLM2 layer (9 query
    heads, 3 kv; all 30 layers pass too, but the float64 reference SVDs take a minute)."""
    checked = 0
    for path, q, k, heads, kv, bias, every in (
        (minilm_dir, "encoder.layer.{}.attention.self.query.weight", "encoder.layer.{}.attention.self.key.weight",
         12, 12, True, 1),
        (smollm2_gguf, "blk.{}.attn_q.weight", "blk.{}.attn_k.weight", 9, 3, False, 7),
    ):
        for w_q, w_k in _layers(path, q, k, bias, every):
            got = head_norms(w_q, w_k, heads, kv).sigma
            torch.testing.assert_close(got, _reference(w_q, w_k, heads, kv), rtol=1e-3, atol=0)
            checked += heads
    assert checked == 6 * 12 + 5 * 9


def test_logit_bound_holds_and_is_tight_on_a_layer_norm_input():
    from hilt.fp8.bounds import logit_bounds, norm_radius

    torch.manual_seed(1)
    d, heads, d_h = 32, 4, 8
    norm = torch.nn.LayerNorm(d)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0)
        norm.bias.uniform_(-0.3, 0.3)
    w_q, w_k, b_q, b_k = torch.randn(heads * d_h, d), torch.randn(heads * d_h, d), torch.randn(heads * d_h), torch.randn(heads * d_h)
    x = norm(torch.randn(500, d) * 5).detach().double()
    assert float(x.norm(dim=1).max()) <= norm_radius(norm.weight, norm.bias) + 1e-9
    b = logit_bounds(w_q, w_k, heads, heads, norm_radius(norm.weight, norm.bias), b_q.double(), b_k.double())
    q = (x @ w_q.double().T + b_q.double()).view(500, heads, d_h).transpose(0, 1)
    k = (x @ w_k.double().T + b_k.double()).view(500, heads, d_h).transpose(0, 1)
    observed = (q @ k.transpose(1, 2)).abs().amax(dim=(1, 2)) / d_h**0.5
    assert (observed <= b["bound"]).all() and (b["bound"] <= b["product_bound"] + 1e-9).all()


def test_rank_aware_prediction_holds_on_isotropic_inputs_and_burn_in_fits_gamma():
    import math

    from hilt.fp8.bounds import burn_in_gamma, tail_alpha

    torch.manual_seed(2)
    d, r, n = 256, 8, 400
    m = torch.randn(d, r, dtype=torch.float64) @ torch.randn(r, d, dtype=torch.float64)
    sigma = torch.linalg.matrix_norm(m, ord=2)
    u = torch.nn.functional.normalize(torch.randn(n, d, dtype=torch.float64), dim=1)
    worst = float((u @ m @ u.T).abs().max() / sigma)
    alpha = tail_alpha(d, r, n, delta=1e-3)
    assert worst <= alpha < 1  # the prediction covers a real sample of n^2 pairs...
    assert worst > alpha / 4  # ...without being vacuous
    assert tail_alpha(d, d, n, 1e-3) / alpha == pytest.approx(math.sqrt(d / r))  # rank-agnostic: sqrt(d/r) looser
    assert tail_alpha(8, 8, 10**6) == 1.0  # never above the worst case
    observed, bound = torch.tensor([3.0 * alpha, 0.5 * alpha], dtype=torch.float64), torch.ones(2)
    gamma = burn_in_gamma(observed, bound, d, r, n, 1e-3)
    assert gamma == pytest.approx(9.0, rel=1e-6) and tail_alpha(d, r, n, 1e-3, gamma) >= 3.0 * alpha - 1e-12
    assert burn_in_gamma(observed / 10, bound, d, r, n, 1e-3) == 1.0
    with pytest.raises(HiltError, match="delta"):
        tail_alpha(d, r, n, delta=0)


def test_fp8_scales_on_minilm(minilm_dir):
    from helpers import read_json, run_hilt

    import tempfile
    from pathlib import Path

    js = Path(tempfile.mkdtemp()) / "fp8.json"
    r = run_hilt("fp8", "scales", minilm_dir, "--json", js)  # the checkpoint by path (as `minilm` names it)
    assert r.returncode == 0, r.stderr
    rows = read_json(js)["rows"]
    assert len(rows) == 6 and not any(row["exceeded"] for row in rows)
    assert all(0 < row["max_observed_over_bound"] <= 1 and len(row["scale"]) == 12 for row in rows)
    assert all(row["max_observed_over_rank_aware"] <= 1 and row["agnostic_over_aware"] > 3 for row in rows)
    bad = run_hilt("fp8", "scales", "gpt5")
    assert bad.returncode == 1 and "not minilm, smollm2 or gemma3" in bad.stderr


def test_fp8_scales_names_a_checkpoint_without_attention_weights(tmp_path):
    from helpers import run_hilt
    from safetensors.torch import save_file

    from hilt.bench.studies.fp8_scales import checkpoint_family

    ckpt = tmp_path / "mlp.safetensors"
    save_file({"fc1.weight": torch.randn(8, 4)}, ckpt)
    r = run_hilt("fp8", "scales", ckpt)
    assert r.returncode == 1 and f"{ckpt}: no attention weights" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "model.pt").write_bytes(b"not read")
    with pytest.raises(HiltError, match="pickle"):
        checkpoint_family(tmp_path / "model.pt")
