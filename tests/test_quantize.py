import dataclasses

import pytest
import torch

from hilt.errors import HiltError
from hilt.kernels import unpack_codes
from hilt.quant import QuantConfig, quantize_tensor, relative_error
from hilt.quant.quantize import expected_bits_per_weight, quantize_measured


def weight(n=96, k=256, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02


def bf16(t):
    return t.to(torch.bfloat16).float()


def test_int_symmetric_is_the_absmax_grid():
    w = weight()
    q = quantize_tensor(w, QuantConfig("int", 4))
    blocks = w.view(96, 4, 64)
    s = bf16(blocks.abs().amax(-1) / 7).unsqueeze(-1)
    expected = (blocks / s).round().clamp(-8, 7) * s
    assert torch.allclose(q.dequantize().view(96, 4, 64), expected, atol=1e-7)


def test_int_asymmetric_is_the_minmax_grid():
    w = weight(seed=1)
    q = quantize_tensor(w, QuantConfig("int-asym", 3))
    blocks = w.view(96, 4, 64)
    lo = bf16(blocks.amin(-1)).unsqueeze(-1)
    s = bf16((blocks.amax(-1) - blocks.amin(-1)) / 7).unsqueeze(-1)
    expected = ((blocks - lo) / s).round().clamp(0, 7) * s + lo
    assert torch.allclose(q.dequantize().view(96, 4, 64), expected, atol=1e-7)


def test_binary_is_sign_times_absmean():
    w = weight(seed=2)
    q = quantize_tensor(w, QuantConfig("binary", 1))
    blocks = w.view(96, 4, 64)
    s = bf16(blocks.abs().mean(-1)).unsqueeze(-1)
    expected = torch.where(blocks >= 0, s, -s)
    assert torch.allclose(q.dequantize().view(96, 4, 64), expected)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_kmeans_codes_are_nearest_centroid(bits):
    w = weight(seed=bits)
    q = quantize_tensor(w, QuantConfig("kmeans", bits))
    assert q.codebook.shape == (1 << bits,) and q.codebook.dtype == torch.float16
    scale_kind = "absmax" if bits > 2 else "absmean"
    blocks = w.view(96, 4, 64)
    s = bf16(blocks.abs().amax(-1) if scale_kind == "absmax" else blocks.abs().mean(-1)).unsqueeze(-1)
    u = (blocks / s).reshape(-1)
    book = q.codebook.double()
    nearest = (u.double()[:, None] - book[None]).abs().min(1).values
    codes = unpack_codes(q.codes, bits, 256).reshape(-1)
    chosen = (u.double() - book[codes]).abs()
    assert torch.allclose(chosen, nearest, atol=1e-6)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_kmeans_beats_int_at_equal_bits(bits):
    w = weight(n=192, seed=10)
    err_k = relative_error(w, quantize_tensor(w, QuantConfig("kmeans", bits)))
    err_i = relative_error(w, quantize_tensor(w, QuantConfig("int", bits)))
    assert err_k < err_i


def test_one_bit_kmeans_learns_asymmetric_levels():
    w = weight(seed=3).abs() * 0.5 + weight(seed=4)  # a skewed distribution
    q = quantize_tensor(w, QuantConfig("kmeans", 1))
    lo, hi = q.codebook.float().tolist()
    assert lo < 0 < hi and abs(abs(lo) - hi) > 0.05  # not sign x scale
    assert relative_error(w, q) <= relative_error(w, quantize_tensor(w, QuantConfig("binary", 1))) + 1e-6


@pytest.mark.parametrize("cfg", [QuantConfig("kmeans", 3), QuantConfig("kmeans", 2, codebook="block"),
                                 QuantConfig("int-asym", 4, block_size=32), QuantConfig("binary", 1)])
def test_bits_per_weight_is_honest(cfg):
    w = weight(n=40, k=320)
    q = quantize_tensor(w, cfg)
    assert q.bits_per_weight == pytest.approx(expected_bits_per_weight(w.shape, cfg))
    raw = q.codes.numel() * 8 + q.scales.numel() * 16 + q.codebook.numel() * 16
    raw += 0 if q.offsets is None else q.offsets.numel() * 16
    assert q.bits_per_weight == pytest.approx(raw / w.numel())


def test_kmeans_3bit_layer_codebook_costs_a_quarter_bit():
    q = quantize_tensor(weight(n=256, k=512), QuantConfig("kmeans", 3))
    assert q.bits_per_weight == pytest.approx(3 + 16 / 64 + 16 * 8 / (256 * 512))


def test_block_codebooks_beat_layer_codebook():
    w = weight(seed=5)
    e_layer = relative_error(w, quantize_tensor(w, QuantConfig("kmeans", 2)))
    e_block = relative_error(w, quantize_tensor(w, QuantConfig("kmeans", 2, codebook="block")))
    assert e_block < e_layer


def test_importance_weights_lower_weighted_error():
    w = weight(n=64, k=128, seed=6)
    imp = torch.ones(128)
    imp[:16] = 100.0  # the first input columns matter much more
    plain = quantize_tensor(w, QuantConfig("kmeans", 2)).dequantize()
    weighted = quantize_tensor(w, QuantConfig("kmeans", 2), importance=imp).dequantize()
    werr = lambda d: float(((w - d) ** 2 * imp).sum())  # noqa: E731
    assert werr(weighted) < werr(plain)


def test_zero_block_stays_zero():
    w = weight()
    w[5] = 0
    for cfg in (QuantConfig("kmeans", 2), QuantConfig("int", 4), QuantConfig("binary", 1)):
        d = quantize_tensor(w, cfg).dequantize()
        assert torch.isfinite(d).all() and torch.all(d[5] == 0)


def test_restores_dtype():
    w = weight().to(torch.bfloat16)
    assert quantize_tensor(w, QuantConfig("kmeans", 4)).dequantize().dtype == torch.bfloat16


@pytest.mark.parametrize("settings,match", [
    ({"bits": 9}, "between 1 and 8"),
    ({"bits": 0}, "between 1 and 8"),
    ({"method": "int", "bits": 1}, "at least 2 bits"),
    ({"method": "binary", "bits": 2}, "binary is 1 bit"),
    ({"method": "lloyd"}, "unknown method 'lloyd'"),
    ({"block_size": 0}, "block_size must be positive"),
    ({"method": "int", "codebook": "block"}, "codebook .block. applies to method kmeans only"),
    ({"solver": "fast"}, "unknown k-means solver"),
])
def test_a_bad_config_cannot_be_made(settings, match):
    with pytest.raises(HiltError, match=match):
        QuantConfig(**settings)
    with pytest.raises(HiltError, match=match):  # nor made by changing a good one
        dataclasses.replace(QuantConfig(), **settings)


def test_a_block_size_that_does_not_divide_the_weight_names_it():
    with pytest.raises(HiltError, match="'layer.w' has 256 input columns, not a multiple"):
        quantize_tensor(weight(), QuantConfig("kmeans", 4, block_size=48), name="layer.w")


def test_nan_names_the_tensor():
    w = weight()
    w[3, 7] = float("nan")
    with pytest.raises(HiltError, match="'blk.3.attn_q.weight' contains NaN or Inf"):
        quantize_tensor(w, QuantConfig("kmeans", 4), name="blk.3.attn_q.weight")


def test_block_codebooks_in_several_batches_match_one():
    # more blocks than one DP batch holds: the chunked path must agree with the per-row solver
    from hilt.quant.kmeans import clustering_cost, kmeans_optimal

    w = weight(n=1100, k=128, seed=8)
    q = quantize_tensor(w, QuantConfig("kmeans", 2, codebook="block"))
    u = w.view(1100, 2, 64) / w.view(1100, 2, 64).abs().mean(-1, keepdim=True).to(torch.bfloat16).float()
    for row, blk in [(0, 0), (700, 1), (1099, 1)]:
        opt = kmeans_optimal(u[row, blk], 4).cost
        got = clustering_cost(u[row, blk], q.codebook[row, blk].double())
        assert got == pytest.approx(opt, rel=1e-2, abs=1e-6)  # fp16 codebook rounding only


def test_relative_error_by_row_bands_equals_one_pass(monkeypatch):
    from hilt.quant import quantize as quantize_module

    w = weight(n=40, k=128, seed=3)
    for cfg in (QuantConfig("kmeans", 2, codebook="block"), QuantConfig("int-asym", 3)):
        q = quantize_tensor(w, cfg)
        whole = float((w - q.dequantize()).norm() / w.norm())
        with monkeypatch.context() as m:
            m.setattr(quantize_module, "_ROWS_BYTES", 128 * 8 * 7)  # bands of 7 rows, the last one short
            assert relative_error(w, q) == pytest.approx(whole, rel=1e-5)


@pytest.mark.parametrize("method,bits", [("kmeans", 4), ("int", 4), ("int", 3)])
def test_bytes_and_error_do_not_depend_on_the_thread_count(method, bits):
    """What --ray relies on (each task runs one thread, a local run several): the same codes, scales,
    codebook and relative error to the bit. One float64 sum over a whole band would round differently
    with 1 and 2 threads on some of these seeds."""
    threads = torch.get_num_threads()
    try:
        for seed in range(4):
            w = torch.randn(512, 8192, generator=torch.Generator().manual_seed(seed)) * 0.02
            made = []
            for t in (1, 2):
                torch.set_num_threads(t)
                q, err, _ = quantize_measured(w, QuantConfig(method=method, bits=bits), name="x")
                made.append((q.codes, q.scales, q.codebook, err))
            assert all(torch.equal(a, b) for a, b in zip(made[0][:3], made[1][:3]))
            assert made[0][3] == made[1][3]
    finally:
        torch.set_num_threads(threads)
