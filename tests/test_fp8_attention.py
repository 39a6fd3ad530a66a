"""FP8 attention: the Triton kernel (interpreter on the CPU) and its emulated reference
against plain float32 attention, the kernel against the emulated reference, and refusals.

Inputs: q, k ~ N(0, 1) (logits of standard deviation ~1 after 1/sqrt(D)); v ~ N(0, 1) plus a
per-channel offset ~ N(0, 0.5) per kv head, as trained value projections have (on
SmolLM2-135M the channel means of v are 0.2-0.5 of mean |v|). Scales are per-head current
amax: 448 / amax. For such inputs cosine >= 0.999 and relative L1 <= 2e-2 hold (2.5e-2 for
causal short contexts with V in FP8, see there). They are not a property of FP8 attention
in general: with zero-mean i.i.d. values each E4M3 rounding alone (of Q and K, of V, of P)
costs ~2.5e-2 relative L1, larger logits amplify the Q/K rounding, and on real SmolLM2-135M
activations (512 tokens, all 30 layers, causal) the same scheme measured cosine 0.995-0.9998
and relative L1 2.6e-2 to 1.0e-1. Those harder cases are checked against the emulated
reference (same quantization) plus a bound on what the rounding costs.
"""

import math

import pytest
import torch

from hilt.errors import HiltError
from hilt.kernels import attention_reference, fp8_attention
from hilt.kernels.fp8_attention import E4M3_MAX, _e4m3, fp8_attention_reference
from hilt.kernels.fp8_attention_triton import fp8_attention_triton, quantize_inputs

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def _inputs(b, h, g, tq, tk, d, dtype=F16, seed=0, v_offset=0.5, outliers=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, tq, d, generator=gen)
    k = torch.randn(b, g, tk, d, generator=gen)
    v = torch.randn(b, g, tk, d, generator=gen) + v_offset * torch.randn(1, g, 1, d, generator=gen)
    for x in (q, k)[: 2 if outliers else 0]:  # a few entries per head x30-100, as LLM activations have
        flat = x.view(b * x.shape[1], -1)
        idx = torch.randint(0, flat.shape[1], (flat.shape[0], outliers), generator=gen)
        flat.scatter_(1, idx, flat.gather(1, idx) * (30 + 70 * torch.rand(idx.shape, generator=gen)))
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    q_scale = E4M3_MAX / q.float().abs().amax(dim=(0, 2, 3))
    k_scale = E4M3_MAX / k.float().abs().amax(dim=(0, 2, 3))
    v_scale = E4M3_MAX / v.float().abs().amax(dim=(0, 2))
    return q, k, v, q_scale, k_scale, v_scale


def _metrics(a, b):
    """(cosine similarity, relative L1 sum|a - b| / sum|b|) over all elements, in float64."""
    a, b = a.double().flatten(), b.double().flatten()
    cos = float(torch.dot(a, b) / (a.norm() * b.norm()))
    return cos, float((a - b).abs().sum() / b.abs().sum())


def _check_accuracy(q, k, v, qs, ks, vs, causal, min_cos=0.999, max_rel_l1=2e-2, vs_ref=(0.9999, 1e-2), **blocks):
    truth = attention_reference(q.float(), k.float(), v.float(), causal)
    ref = fp8_attention_reference(q, k, v, qs, ks, vs, causal)
    out = fp8_attention_triton(q, k, v, qs, ks, vs, causal, **blocks)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all() and torch.isfinite(ref).all()
    for name, y in (("kernel", out), ("reference", ref)):
        cos, rel = _metrics(y, truth)
        assert cos >= min_cos and rel <= max_rel_l1, f"{name} vs float32: cosine {cos:.6f}, rel L1 {rel:.3e}"
    # same quantization; P is rounded against the running row max in the kernel, the final one in the reference
    cos, rel = _metrics(out, ref)
    assert cos >= vs_ref[0] and rel <= vs_ref[1], f"kernel vs emulated reference: cosine {cos:.7f}, rel L1 {rel:.3e}"
    return out, ref, truth


@pytest.mark.parametrize("v_fp8", [True, False], ids=["v8", "v16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("tk", [127, 128, 129, 1000])
def test_against_float32(tk, causal, d, v_fp8):
    dtype = (F16, BF16)[(tk + d + causal + v_fp8) % 2]
    if tk == 1000:  # long keys: a few queries (Tq < Tk: bottom-right causal alignment), one kv head
        shape = (1, 2, 1, 24, tk, d)
    else:  # grouped queries: 4 query heads on 2 kv heads
        shape = (1, 4, 2, tk, tk, d)
    q, k, v, qs, ks, vs = _inputs(*shape, dtype=dtype, seed=tk * 8 + d + 2 * causal + v_fp8)
    # Causal with V in FP8 and short contexts: the first rows average only a few rows of V8,
    # each off by E4M3's mean relative error of ~2.2 %, so the scheme itself (the emulated
    # reference) measures 2.0-2.1e-2 here; 2e-2 holds for every other case.
    max_rel_l1 = 2.5e-2 if causal and v_fp8 and tk < 1000 else 2e-2
    _check_accuracy(q, k, v, qs, ks, vs if v_fp8 else None, causal, max_rel_l1=max_rel_l1)


@pytest.mark.parametrize(("shape", "causal", "dtype", "v_fp8"), [
    ((2, 6, 2, 129, 129, 64), True, BF16, True),  # batch 2, 3 query heads per kv head
    ((1, 6, 2, 100, 127, 128), True, F16, True),  # causal with Tq < Tk: the diagonal is offset by 27
    ((1, 3, 3, 1, 129, 64), True, F16, False),  # decode: one query sees every key
    ((1, 2, 1, 70, 128, 64), False, F32, True),  # float32 in and out
    ((1, 2, 1, 70, 128, 64), True, F32, False),  # float32 V: P V in float32
])
def test_other_shapes_and_dtypes(shape, causal, dtype, v_fp8):
    q, k, v, qs, ks, vs = _inputs(*shape, dtype=dtype, seed=sum(shape))
    _check_accuracy(q, k, v, qs, ks, vs if v_fp8 else None, causal, max_rel_l1=2.5e-2 if causal and v_fp8 else 2e-2)


@pytest.mark.parametrize(("tq", "tk", "block_m", "block_n"), [(97, 97, 32, 32), (100, 127, 16, 32), (33, 200, 32, 64)])
def test_tile_sizes_and_diagonal_offsets(tq, tk, block_m, block_n):
    """Smaller tiles: more full/diagonal tile splits, diagonal offsets that are not tile multiples."""
    q, k, v, qs, ks, vs = _inputs(1, 2, 1, tq, tk, 64, seed=tq + tk)
    for causal in (False, True):
        _check_accuracy(q, k, v, qs, ks, vs, causal, max_rel_l1=2.5e-2, block_m=block_m, block_n=block_n)


@pytest.mark.parametrize("tk", [128, 1000])
def test_outliers_in_q_and_k(tk):
    """A few entries per head x30-100. Rounding the outliers themselves (3 mantissa bits on a
    value that dominates its logits) moves peaked rows: the scheme's error grows (measured
    worst over seeds: cosine 0.9928, rel L1 5.3e-2 at Tk 1000), and the kernel must follow
    the emulated reference, not exceed it."""
    tq = tk if tk <= 128 else 16
    q, k, v, qs, ks, vs = _inputs(1, 4, 2, tq, tk, 64, seed=tk, outliers=4)
    assert q.float().abs().amax() > 30 and k.float().abs().amax() > 30
    out, ref, truth = _check_accuracy(q, k, v, qs, ks, vs, True, min_cos=0.99, max_rel_l1=8e-2)
    assert _metrics(out, truth)[1] <= 1.05 * _metrics(ref, truth)[1] + 2e-3


@pytest.mark.parametrize("v_fp8", [False, True], ids=["v16", "v8"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("tk", [127, 128, 129, 1000])
def test_split_qk_holds_the_targets_with_outliers(tk, causal, v_fp8):
    """split_qk (Q and K as two E4M3 terms): with the same outliers, cosine >= 0.999 and rel L1
    <= 2e-2 with V 16-bit (measured 0.05-0.2e-2). With V in E4M3 the error is V's own rounding
    (~2 % on a row that one key dominates; measured 1.5-2.1e-2), as in the causal cases above."""
    tq = tk if tk <= 129 else 16
    dtype = (F16, BF16)[(tk + causal) % 2]
    q, k, v, qs, ks, vs = _inputs(1, 4, 2, tq, tk, 64, dtype=dtype, seed=3 * tk + causal, outliers=4)
    assert q.float().abs().amax() > 30 and k.float().abs().amax() > 30
    truth = attention_reference(q.float(), k.float(), v.float(), causal)
    out = fp8_attention_triton(q, k, v, qs, ks, vs if v_fp8 else None, causal, split_qk=True)
    ref = fp8_attention_reference(q, k, v, qs, ks, vs if v_fp8 else None, causal, split_qk=True)
    assert torch.isfinite(out).all()
    cos, rel = _metrics(out, truth)
    assert cos >= 0.999 and rel <= (2.5e-2 if v_fp8 else 2e-2), f"cosine {cos:.6f}, rel L1 {rel:.3e}"
    assert _metrics(out, ref)[1] <= (3e-3 if v_fp8 else 1e-4)  # the kernel computes the reference's definition
    unsplit = _metrics(fp8_attention_reference(q, k, v, qs, ks, vs if v_fp8 else None, causal), truth)[1]
    assert rel < unsplit  # and the second terms are what helps


def test_zero_mean_values_cost_the_rounding_floor():
    """i.i.d. zero-mean values: FP8 rounding of Q, K, V and P is the whole error (each alone
    ~2.5e-2 rel L1); the kernel adds nothing beyond the emulated reference. (Kernel and
    reference round P against different maxima: two draws of P's ~2.4e-2 rounding noise.)"""
    q, k, v, qs, ks, vs = _inputs(1, 4, 2, 128, 128, 64, seed=5, v_offset=0.0)
    out, ref, truth = _check_accuracy(q, k, v, qs, ks, vs, False, min_cos=0.997, max_rel_l1=7e-2,
                                      vs_ref=(0.9995, 2e-2))
    assert _metrics(out, truth)[1] <= 1.05 * _metrics(ref, truth)[1] + 2e-3


def test_huge_logits_give_no_nan():
    """A query along a key scaled so that its logits reach ~1e4 before 1/sqrt(D) (and -1e4 for
    another query): softmax is one-hot, the output is that key's value."""
    q, k, v, _, _, vs = _inputs(1, 2, 1, 64, 128, 64, seed=1)
    q[0, 0, 5] = 160 * k[0, 0, 77]
    q[0, 1, 9] = -160 * k[0, 0, 77]
    assert q.float()[0, 0, 5] @ k.float()[0, 0, 77] > 5e3
    qs = E4M3_MAX / q.float().abs().amax(dim=(0, 2, 3))
    ks = E4M3_MAX / k.float().abs().amax(dim=(0, 2, 3))
    truth = attention_reference(q.float(), k.float(), v.float())
    for y in (fp8_attention_triton(q, k, v, qs, ks, vs), fp8_attention_reference(q, k, v, qs, ks, vs)):
        assert torch.isfinite(y).all()
        assert torch.allclose(y[0, 0, 5].float(), v[0, 0, 77].float(), rtol=0.07, atol=0.05)
        assert _metrics(y[0, 1, 9], truth[0, 1, 9])[0] > 0.99


def test_in_kernel_quantization_is_exact_e4m3():
    """The quantize kernel (under the interpreter: integer round-to-nearest-even) equals torch's
    E4M3 cast bit for bit: ties, mantissa carries into the exponent, subnormals, clamping."""
    tricky = torch.tensor([1.0625, 1.1875, 126.4, 127.9, 0.0029296875, 0.0009765625, 0.00146484375,
                           2.0**-10, 447.0, 448.0, 460.0, 1e4, 1e-12, 0.0, 0.015625, 0.0151])
    x = torch.cat([tricky, -tricky, torch.randn(64 * 64 - 32) * torch.logspace(-4, 2.7, 64 * 64 - 32)])
    q = x.view(1, 1, 64, 64)
    k = torch.randn(1, 1, 10, 64)
    v = torch.randn(1, 1, 10, 64) * 100
    ones, vs = torch.ones(1), torch.full((1, 64), 3.0)
    q8, k8, v8 = quantize_inputs(q, k, v, ones, ones, vs)
    assert q8.dtype == torch.float8_e4m3fn and v8.shape == v.shape
    assert torch.equal(q8.float(), _e4m3(q)) and torch.equal(k8.float(), _e4m3(k))
    assert torch.equal(v8.float(), _e4m3(v * 3.0))


def test_strided_inputs_give_the_same_output():
    """q, k, v as a model makes them: (B, T, H, D) projections viewed as (B, H, T, D)."""
    q, k, v, qs, ks, vs = _inputs(1, 4, 2, 50, 70, 64, seed=11)
    qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    assert not qt.is_contiguous()
    for v_scale in (vs, None):
        assert torch.equal(fp8_attention_triton(qt, kt, vt, qs, ks, v_scale, True),
                           fp8_attention_triton(q, k, v, qs, ks, v_scale, True))


def test_output_buffer_is_fully_written():
    q, k, v, qs, ks, vs = _inputs(1, 2, 1, 70, 100, 64, seed=3)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    y = fp8_attention_triton(q, k, v, qs, ks, vs, True, out=out)
    assert y is out and torch.isfinite(out).all()


def test_dispatch_on_cpu_is_the_reference_for_any_head_dim():
    for d in (64, 96):
        q, k, v, qs, ks, vs = _inputs(1, 4, 2, 30, 40, d, seed=d)
        assert torch.equal(fp8_attention(q, k, v, qs, ks, vs, True), fp8_attention_reference(q, k, v, qs, ks, vs, True))
    y = fp8_attention(q, k, v, qs, ks, None, False, sm_scale=0.5)
    assert torch.equal(y, fp8_attention_reference(q, k, v, qs, ks, None, False, sm_scale=0.5))
    truth = attention_reference(q, k, v, sm_scale=1 / math.sqrt(96))
    assert _metrics(fp8_attention(q, k, v, qs, ks, vs), truth)[0] > 0.999


def _bad(**change):
    q, k, v, qs, ks, vs = _inputs(1, 4, 2, 16, 20, 64)
    args = {"q": q, "k": k, "v": v, "q_scale": qs, "k_scale": ks, "v_scale": vs, "causal": False}
    args.update(change)
    return args


@pytest.mark.parametrize("fn", [fp8_attention, fp8_attention_triton])
@pytest.mark.parametrize(("change", "message"), [
    ({"k": torch.randn(1, 3, 20, 64), "v": torch.randn(1, 3, 20, 64), "k_scale": torch.ones(3)},
     r"query heads \(4\) must be a multiple of kv heads \(3\)"),
    ({"v": torch.randn(1, 2, 21, 64)}, "k has 20 tokens"),
    ({"q": torch.randn(4, 16, 64)}, "q must be 4-D"),
    ({"q_scale": torch.ones(2)}, r"q_scale has shape \(2,\), expected \(4,\)"),
    ({"v_scale": torch.ones(2)}, r"v_scale has shape \(2,\), expected \(2, 64\)"),
    ({"q_scale": torch.tensor([1.0, 0.0, 1.0, 1.0])}, "q_scale has a zero"),
    ({"k_scale": torch.tensor([1.0, float("nan")])}, "k_scale has a zero, negative, NaN"),
    ({"v_scale": torch.full((2, 64), float("inf"))}, "v_scale has a zero, negative, NaN or Inf"),
    ({"v": torch.full((1, 2, 20, 64), float("nan"))}, "v contains NaN or Inf"),
    ({"q": torch.full((1, 4, 16, 64), float("-inf"))}, "q contains NaN or Inf"),
    ({"causal": True, "q": torch.randn(1, 4, 30, 64)}, r"causal attention needs Tq <= Tk \(Tq 30, Tk 20\)"),
])
def test_bad_inputs_are_refused(fn, change, message):
    with pytest.raises(HiltError, match=message):
        fn(**_bad(**change))


def test_triton_path_refuses_other_head_dims():
    q, k, v, qs, ks, vs = _inputs(1, 4, 2, 16, 20, 96)
    with pytest.raises(HiltError, match="head_dim 96 is not supported by the Triton"):
        fp8_attention_triton(q, k, v, qs, ks, vs)
    with pytest.raises(HiltError, match="head_dim differs: q 64, k 96"):
        fp8_attention(torch.randn(1, 4, 16, 64), k, v, torch.ones(4), ks, vs)
