"""The CPU C kernel of the lookup-table matmul (kernels/lut_cpu.c) against its PyTorch reference, on
each vector path this CPU has and on the portable path."""

import concurrent.futures
import copy
import ctypes
import dataclasses
import pickle
import sys
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hilt.errors import HiltError
from hilt.kernels import lut_cpu
from hilt.kernels.lut_matmul import dequantize_lut, error_ratio, lut_matmul, lut_matmul_reference
from hilt.quant import QuantConfig, QuantLinear, quantize_tensor
from hilt.quant.formats import method_for_bits

pytestmark = pytest.mark.skipif(not lut_cpu.available(), reason="no C compiler builds the CPU kernel here")

# every path this machine runs, the portable one always
PATHS = [name for name, level in lut_cpu.ISAS.items() if level <= max(0, lut_cpu.machine_isa())]
FORMATS = ["kmeans-layer", "kmeans-block", "int", "int-asym"]


def _weights(n, k, fmt, bits, block, seed):
    method, scope = (fmt.split("-") + ["layer"])[:2] if fmt.startswith("kmeans") else (fmt, "layer")
    method = method_for_bits(method, bits)  # int at 1 bit is binary
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return quantize_tensor(w, QuantConfig(method, bits, block, codebook=scope))


def _check(q, x, isa, bias=None):
    """The kernel against the reference on the stored order and, where the weight takes the pair-table
    path, interleaved (every path then reads the interleaved rows); the stored bytes come back."""
    ref = lut_matmul_reference(x.double(), q.packed, None if bias is None else bias.double()).double()
    w_abs = q.dequantize().double().abs()
    y = lut_cpu.lut_matmul_cpu(x, q.packed, bias, isa=isa)
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], q.shape[0])
    if x.dtype == torch.bfloat16 and x.numel() // x.shape[-1] <= lut_cpu.INT8_ROWS and lut_cpu.int8_path(q.packed, isa):
        # x and the levels rounded to int8 (decode on AVX2): its own bound, which the float bound is far below
        assert lut_cpu.int8_error_ratio(y, x, q.packed, ref) <= 1.0, (isa, lut_cpu.int8_error_ratio(y, x, q.packed, ref))
        return
    assert error_ratio(y, x, ref, w_abs) <= 1.0, (isa, error_ratio(y, x, ref, w_abs))
    if lut_cpu.pair_path(q.packed, isa):
        w = dataclasses.replace(q.packed, codes=q.packed.codes.clone(), scales=q.packed.scales.clone())
        kernel = lut_cpu.prepare(w, isa, interleave=True)
        assert kernel.interleaved
        y = kernel(x, bias)
        assert error_ratio(y, x, ref, w_abs) <= 1.0, (isa, "interleaved", error_ratio(y, x, ref, w_abs))
        kernel.restore()
        assert torch.equal(w.codes, q.packed.codes) and torch.equal(w.scales, q.packed.scales)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_width_and_format_on_every_path(isa, bits, fmt):
    if fmt == "int-asym" and bits == 1:
        pytest.skip("no asymmetric 1-bit format")
    for block, k in ((64, 256), (128, 256), (32, 96)):  # 16 lanes, 8 lanes or the portable loop by width
        q = _weights(19, k, fmt, bits, block, bits * 7 + block)
        for m in (1, 2, 5, 16, 17):  # the kernel's row tiles, and the dequantize-then-BLAS path
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
                _check(q, x, isa)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 17), n=st.integers(1, 40), blocks=st.integers(1, 3),
       block=st.sampled_from([8, 16, 32, 48, 64, 128]), bits=st.sampled_from([1, 2, 3, 4, 5, 8]),
       fmt=st.sampled_from(FORMATS), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       isa=st.sampled_from(PATHS), seed=st.integers(0, 2**20))
def test_kernel_matches_reference(m, n, blocks, block, bits, fmt, dtype, isa, seed):
    if fmt == "int-asym" and bits == 1:
        fmt = "int"
    q = _weights(n, blocks * block, fmt, bits, block, seed)
    x = torch.randn(m, blocks * block, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    _check(q, x, isa, bias=torch.randn(n, generator=torch.Generator().manual_seed(seed + 2)))


@pytest.mark.parametrize("isa", PATHS)
def test_smallest_shapes(isa):
    for bits in (1, 2, 3, 4, 8):
        # one output row; the smallest K the format allows (a block of one code): the portable loop
        q = _weights(1, 1, "kmeans-layer", bits, 1, bits)
        _check(q, torch.randn(3, 1), isa)
        q = _weights(1, 8, "kmeans-layer", bits, 8, bits)
        _check(q, torch.randn(1, 8), isa)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("m", [1, 4, 17])
def test_nan_and_inf_in_x_propagate(isa, m):
    q = _weights(9, 128, "kmeans-layer", 4, 64, 0)
    x = torch.randn(m, 128)
    x[0, 3] = float("nan")
    x[-1, 100] = float("inf")
    y = lut_cpu.lut_matmul_cpu(x, q.packed, isa=isa)
    ref = lut_matmul_reference(x, q.packed)
    assert torch.isnan(y[0]).all() and torch.isnan(ref[0]).all()
    assert torch.equal(torch.isfinite(y), torch.isfinite(ref))
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    finite = torch.isfinite(ref)
    assert torch.allclose(y[finite], ref[finite], rtol=1e-4, atol=1e-4)


def test_each_path_is_what_it_claims():
    """The layout (lanes) each path gives a weight: a vector path really runs where forced."""
    q = _weights(8, 256, "kmeans-layer", 4, 64, 0)
    assert lut_cpu.layout(q.packed, "scalar") == (1, 1)
    if "avx2" in PATHS:
        assert lut_cpu.layout(q.packed, "avx2") == (8, 2)
    if "avx512" in PATHS:
        assert lut_cpu.layout(q.packed, "avx512") == (16, 2)
        assert lut_cpu.layout(_weights(8, 256, "kmeans-layer", 2, 32, 0).packed, "avx512") == (8, 4)  # 64-code chunks
    assert lut_cpu.layout(_weights(8, 256, "kmeans-layer", 5, 64, 0).packed) == (1, 1)  # 5 bits: portable


@pytest.mark.parametrize("isa", PATHS)
def test_dequantize_in_the_paths_column_order(isa):
    q = _weights(5, 256, "kmeans-block", 2, 64, 3)
    lanes, cpb = lut_cpu.layout(q.packed, isa)
    d = lut_cpu.dequantize(q.packed, isa=isa)
    # column j * lanes + i of a chunk is weight i * cpb + j
    order = torch.arange(256).view(-1, lanes, cpb).transpose(1, 2).reshape(-1)
    assert torch.allclose(d, q.dequantize().float()[:, order], rtol=1e-6, atol=1e-7)
    assert torch.equal(lut_cpu.dequantize(q.packed, rows=(1, 3), isa=isa), d[1:3])


def test_the_path_is_capped_by_the_cpu_and_named(monkeypatch):
    assert lut_cpu.resolve_isa("avx512") <= lut_cpu.machine_isa()
    monkeypatch.setenv("HILT_LUT_ISA", "scalar")
    assert lut_cpu.resolve_isa() == 0
    with pytest.raises(HiltError, match="unknown CPU kernel path 'sse'"):
        lut_cpu.resolve_isa("sse")


def test_refusals_are_one_line_errors():
    q = _weights(8, 128, "kmeans-layer", 2, 64, 0)
    with pytest.raises(HiltError, match="input has 100 features, the weight expects 128"):
        lut_cpu.lut_matmul_cpu(torch.randn(1, 100), q.packed)
    with pytest.raises(HiltError, match=r"bias has shape \(7,\), expected \(8,\)"):
        lut_cpu.lut_matmul_cpu(torch.randn(1, 128), q.packed, torch.zeros(7))


def test_batched_input_empty_input_and_other_dtypes():
    q = _weights(24, 128, "kmeans-layer", 4, 64, 3)
    x = torch.randn(2, 3, 128)
    y = lut_cpu.lut_matmul_cpu(x, q.packed)
    assert y.shape == (2, 3, 24) and torch.allclose(y, lut_matmul_reference(x, q.packed), atol=1e-5)
    assert lut_cpu.lut_matmul_cpu(torch.randn(0, 128), q.packed).shape == (0, 24)
    y = lut_cpu.lut_matmul_cpu(x.double(), q.packed)
    assert y.dtype == torch.float64 and torch.allclose(y, lut_matmul_reference(x.double(), q.packed), atol=1e-5)
    # a float32 codebook and scales (hand-made PackedWeight), read as they are
    w = dataclasses.replace(q.packed, codebook=q.codebook.float(), scales=q.scales.float())
    assert torch.allclose(lut_cpu.lut_matmul_cpu(x, w), lut_matmul_reference(x, w), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bfloat16: bfloat16 bands where the CPU has BF16
def test_prefill_bands_cover_every_row(monkeypatch, dtype):
    monkeypatch.setattr(lut_cpu, "BAND_FLOATS", 3 * 256)  # 3 rows a band: 24 rows in 8 bands
    layouts = set()
    # 16 lanes of 2, 4 and 8 codes per lane unit (bits 4, 2, 1 and 3 at block 128), 8 lanes (3 at 64; 4 at
    # 16, whose 16-column chunks bfloat16 bands put back in column order one value at a time)
    for fmt, bits, block in (("kmeans-layer", 3, 64), ("kmeans-block", 4, 64), ("int-asym", 2, 64),
                             ("kmeans-layer", 1, 128), ("kmeans-layer", 3, 128), ("kmeans-layer", 4, 16)):
        q = _weights(24, 256, fmt, bits, block, 5)
        _check(q, torch.randn(40, 256).to(dtype), None, bias=torch.randn(24))
        layouts.add(lut_cpu.layout(q.packed))
    if lut_cpu.machine_isa() >= 2:
        assert {(16, 2), (16, 4), (16, 8), (8, 8), (8, 2)} <= layouts


def test_dispatch_runs_the_kernel_and_without_one_the_reference_with_one_warning(monkeypatch):
    q = _weights(16, 128, "kmeans-layer", 4, 64, 1)
    x = torch.randn(2, 128)
    calls = []
    real = lut_cpu.lut_matmul_cpu
    monkeypatch.setattr(lut_cpu, "lut_matmul_cpu", lambda *a, **k: calls.append(1) or real(*a, **k))
    lut_matmul(x, q.packed)
    assert calls == [1]
    monkeypatch.setattr(lut_cpu, "lut_matmul_cpu", lambda *a, **k: None)  # as where nothing builds it
    monkeypatch.setattr(sys.modules["hilt.kernels.lut_matmul"], "_warned_no_compiler", False)
    with pytest.warns(RuntimeWarning, match="no C compiler built the CPU lookup-table kernel"):
        y = lut_matmul(x, q.packed)
    assert torch.equal(y, lut_matmul_reference(x, q.packed))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lut_matmul(x, q.packed)  # once per process


def test_quant_linear_without_a_kernel_runs_the_reference_with_the_warning(monkeypatch):
    q = _weights(16, 128, "kmeans-layer", 4, 64, 3)
    monkeypatch.setattr(lut_cpu, "library", lambda: None)  # as where nothing builds it
    monkeypatch.setattr(sys.modules["hilt.kernels.lut_matmul"], "_warned_no_compiler", False)
    x = torch.randn(2, 128).to(torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="no C compiler built the CPU lookup-table kernel"):
        y = QuantLinear(q)(x)
    assert torch.equal(y, lut_matmul_reference(x, q.packed))


def test_no_compiler_means_no_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert lut_cpu.library.__wrapped__() is None
    assert not list(tmp_path.rglob("*.so"))


@pytest.mark.parametrize("method,bits", [("kmeans", 4), ("binary", 1)])
def test_quant_linear_keeps_no_second_copy(method, bits):
    """k-means and binary layers run the kernel on the stored buffers (int4/int8 with bfloat16 inputs keep
    PyTorch's packed copy, which is faster: kernels.lut_matmul)."""
    q = _weights(64, 256, method, bits, 64, 2)
    layer = QuantLinear(q)
    before = {k: v.data_ptr() for k, v in layer.state_dict().items()}
    x = torch.randn(1, 256).to(torch.bfloat16)
    y = layer(x)
    assert error_ratio(y, x, lut_matmul_reference(x.double(), q.packed).double(), q.dequantize().double().abs()) <= 1
    kept = [v for v in vars(layer).values() if isinstance(v, torch.Tensor)]
    assert kept == [] and {k: v.data_ptr() for k, v in layer.state_dict().items()} == before
    # the readied kernel follows the buffers when they change in place (a load_state_dict)
    with torch.no_grad():
        layer.codes.copy_(torch.roll(layer.codes, 1, dims=0))
        layer.scales.mul_(2)
    q2 = layer.qweight
    y2 = layer(x)
    assert error_ratio(y2, x, lut_matmul_reference(x.double(), q2.packed).double(), q2.dequantize().double().abs()) <= 1
    assert not torch.equal(y2, y)


def test_struct_matches_the_c_side():
    assert lut_cpu.library().hilt_lut_struct_size() == ctypes.sizeof(lut_cpu.LutWeight)


@pytest.mark.skipif(lut_cpu.machine_isa() < 1, reason="no AVX2 on this CPU")
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_int8_path_rounds_x_within_its_bound_at_the_bound(bits):
    """Levels exact on the int8 grid, every weight positive, and x in each 64-column chunk one value of 127
    steps and the others halfway between two steps (rounded to the even one, always down): every product errs
    the same way by the most the rounding of x allows, so the error is the bound's x term less one weight in
    64. A factor of 2 off in the bound (or in the kernel's step) fails this."""
    from hilt.kernels.lut_matmul import PackedWeight

    n, k = 37, 576
    # the largest level 127 int8 steps, the others whole steps: exact on the grid
    book = torch.tensor([127, 100, 80, 64, 50, 40, 32, 25, 20, 16, 12, 10, 8, 5, 3, 1], dtype=torch.float32) / 128
    book = book[:: 16 >> bits] if bits < 4 else book  # 2 bits: 127, 50, 20, 8
    low = 0
    if bits == 8:  # symmetric integers, codes of positive levels only
        book, low = torch.arange(-128, 128, dtype=torch.float32) / 128, 129
    codes = torch.randint(low, 256, (n, k * bits // 8), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    w = PackedWeight(codes, book, torch.rand(n, k // 64, generator=torch.Generator().manual_seed(1)).to(torch.float16) + 0.5,
                     None, bits, 64, k)
    assert lut_cpu.int8_path(w, "avx2") and not lut_cpu.int8_path(w, "scalar")
    unit = 2.0**-4
    halves = (2 * torch.randint(0, 2, (k,), generator=torch.Generator().manual_seed(2)) + 0.5) * unit  # 0.5, 2.5
    halves[::64] = 127 * unit
    for m in (1, lut_cpu.INT8_ROWS):
        x = halves.repeat(m, 1).to(torch.bfloat16)
        assert torch.equal(x.double(), halves.repeat(m, 1).double())  # exact in bfloat16
        ref = lut_matmul_reference(x.double(), w).double()
        y = lut_cpu.lut_matmul_cpu(x, w, isa="avx2")
        ratio = lut_cpu.int8_error_ratio(y, x, w, ref)
        assert 0.9 < ratio <= 1.0, ratio
        assert (y.double() < ref).all()  # every x rounded down
        # more rows than the path takes, or float32 x: the float32 path, far inside the float bound
        wide = x[:1].repeat(lut_cpu.INT8_ROWS + 1, 1)
        assert error_ratio(lut_cpu.lut_matmul_cpu(wide, w, isa="avx2"), wide, ref[:1].repeat(lut_cpu.INT8_ROWS + 1, 1),
                           dequantize_lut(w).double().abs()) <= 1.0
        assert error_ratio(lut_cpu.lut_matmul_cpu(x.float(), w, isa="avx2"), x.float(), ref,
                           dequantize_lut(w).double().abs()) < 0.01


@pytest.mark.skipif(lut_cpu.machine_isa() < 1, reason="no AVX2 on this CPU")
def test_int8_path_takes_the_formats_it_claims_and_leaves_nan_to_the_float_path():
    assert lut_cpu.int8_path(_weights(8, 256, "kmeans-layer", 4, 64, 0).packed, "avx2")
    assert lut_cpu.int8_path(_weights(8, 256, "int", 4, 128, 0).packed, "avx2")
    assert lut_cpu.int8_path(_weights(8, 256, "kmeans-layer", 2, 64, 0).packed, "avx2")
    assert lut_cpu.int8_path(_weights(8, 256, "int", 8, 256, 0).packed, "avx2")  # --embeddings 8: rows
    for fmt, bits, block in (("kmeans-block", 4, 64), ("int-asym", 4, 64), ("kmeans-layer", 3, 64),
                             ("kmeans-layer", 1, 64), ("kmeans-layer", 4, 32), ("kmeans-layer", 8, 64),
                             ("int-asym", 8, 64)):
        assert not lut_cpu.int8_path(_weights(8, 256, fmt, bits, block, 0).packed, "avx2"), (fmt, bits, block)
    q = _weights(9, 128, "kmeans-layer", 4, 64, 0)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(2, 128).to(torch.bfloat16)
        x[1, 70] = bad
        y = lut_cpu.lut_matmul_cpu(x, q.packed, isa="avx2")
        ref = lut_matmul_reference(x.double(), q.packed)
        assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.equal(torch.isfinite(y), torch.isfinite(ref))


@pytest.mark.skipif(lut_cpu.machine_isa() < 3, reason="no AVX-512 BF16 on this CPU")
def test_bf16_path_rounds_the_codebook_to_bfloat16_within_the_bound_near_its_edge():
    """Levels halfway between two bfloat16 values (2^e (1 + 2^-8), rounded to 2^e), all positive, x all
    ones: every weight's rounding error has the same sign, the largest the path can make (2^-8 relative),
    half the bound's 2^-7 for bfloat16 x. The result is the sum of the rounded weights, rounded once."""
    from hilt.kernels.lut_matmul import PackedWeight

    n, k = 33, 576  # 576: a partial last chunk at 2 bits
    for bits in (2, 4):
        book = 2.0 ** (torch.arange(1 << bits) % 4 - 2.0) * (1 + 2**-8)
        codes = torch.randint(0, 256, (n, k * bits // 8), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
        w = PackedWeight(codes, book, torch.ones(n, k // 64, dtype=torch.bfloat16), None, bits, 64, k)
        assert lut_cpu.bf16_path(w) and not lut_cpu.bf16_path(w, isa="avx512")
        x = torch.ones(3, k, dtype=torch.bfloat16)
        ref = lut_matmul_reference(x.double(), w).double()
        y = lut_cpu.lut_matmul_cpu(x, w)
        ratio = error_ratio(y, x, ref, dequantize_lut(w).double().abs())
        assert 0.2 < ratio <= 1.0, ratio
        rounded = dataclasses.replace(w, codebook=book.to(torch.bfloat16).float())
        assert torch.equal(y, lut_matmul_reference(x.float(), rounded).to(torch.bfloat16))
        # float32 x is never rounded so: the float32 path, exact weights
        assert error_ratio(lut_cpu.lut_matmul_cpu(x.float(), w), x.float(), ref, dequantize_lut(w).double().abs()) < 0.01


@pytest.mark.skipif(lut_cpu.machine_isa() < 3, reason="no AVX-512 BF16 on this CPU")
def test_pair_tables_round_within_the_bound_near_its_edge():
    """Every code 0 and x all ones: each table entry the kernel looks up is the sum of 4 / bits equal
    weights, a little over halfway between two bfloat16 values, so each rounds up by almost 2^-8
    relative, all the same way: the largest error the pair tables make. The bound for bfloat16 x,
    2^-7 (|x| |W| + |ref|), is 2^-6 of the sum here: a ratio just under 1/4."""
    from hilt.kernels.lut_matmul import PackedWeight

    n, k = 35, 512  # two whole tiles of 16 rows and 3 rows on the bfloat16 path
    for bits in (1, 2):
        g = 4 // bits
        book = torch.full((1 << bits,), (1 + 2**-8 + 2**-12) / g)  # a sum of g: 1 + 2^-8 + 2^-12, rounded to 1 + 2^-7
        w = PackedWeight(torch.zeros(n, k * bits // 8, dtype=torch.uint8), book,
                         torch.ones(n, k // 64, dtype=torch.bfloat16), None, bits, 64, k)
        kernel = lut_cpu.prepare(w, interleave=True)
        assert kernel.interleaved
        x = torch.ones(1, k, dtype=torch.bfloat16)
        ref = lut_matmul_reference(x.double(), w).double()
        y = kernel(x)
        ratio = error_ratio(y[:, :32], x, ref[:, :32], dequantize_lut(w).double().abs()[:32])
        assert 0.23 < ratio <= 0.25, ratio
        assert torch.equal(y[:, :32], torch.full((1, 32), k / g * (1 + 2**-7)).to(torch.bfloat16))


@pytest.mark.skipif(lut_cpu.machine_isa() < 3, reason="no AVX-512 BF16 on this CPU")
@pytest.mark.parametrize("n", [16, 48, 83, 112])  # tiles of 16 rows taken 4, 2 and 1 at a time, and rows after them
def test_pair_tables_in_every_grouping_of_tiles(n):
    for bits, fmt, block in ((2, "kmeans-layer", 64), (1, "int", 32), (2, "int", 8)):
        q = _weights(n, 192, fmt, bits, block, n + bits)
        for m in (1, 3, 16):
            _check(q, torch.randn(m, 192, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16), "avx512bf16",
                   bias=torch.randn(n))


@pytest.mark.skipif(lut_cpu.machine_isa() < 3, reason="no AVX-512 BF16 on this CPU")
@pytest.mark.parametrize("bits", [1, 2])
def test_nan_and_inf_in_x_propagate_through_the_pair_tables(bits):
    q = _weights(35, 128, "kmeans-layer", bits, 64, 0)
    x = torch.randn(3, 128).to(torch.bfloat16)
    x[0, 3] = float("nan")
    x[-1, 100] = float("inf")
    kernel = lut_cpu.prepare(q.packed, interleave=True)
    assert kernel.interleaved
    y = kernel(x).float()
    kernel.restore()
    ref = lut_matmul_reference(x.float(), q.packed)
    assert torch.isnan(y[0]).all() and torch.isnan(ref[0]).all()
    assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.equal(torch.isinf(y), torch.isinf(ref))
    assert torch.equal(torch.sign(y[-1]), torch.sign(ref[-1]))


@pytest.mark.skipif(lut_cpu.machine_isa() < 3, reason="no AVX-512 BF16 on this CPU")
def test_pair_path_takes_the_formats_it_claims():
    assert lut_cpu.pair_path(_weights(16, 256, "kmeans-layer", 2, 64, 0).packed)
    assert lut_cpu.pair_path(_weights(16, 256, "binary", 1, 64, 0).packed)
    assert lut_cpu.pair_path(_weights(16, 256, "int", 2, 16, 0).packed)
    assert not lut_cpu.pair_path(_weights(15, 256, "kmeans-layer", 2, 64, 0).packed)  # no whole tile of rows
    assert not lut_cpu.pair_path(_weights(16, 256, "kmeans-layer", 4, 64, 0).packed)  # a nibble is one weight
    assert not lut_cpu.pair_path(_weights(16, 256, "int-asym", 2, 64, 0).packed)  # offsets
    assert not lut_cpu.pair_path(_weights(16, 256, "kmeans-block", 2, 64, 0).packed)
    assert not lut_cpu.pair_path(_weights(16, 256, "kmeans-layer", 2, 64, 0).packed, isa="avx512")


@pytest.mark.skipif(lut_cpu.machine_isa() < 3, reason="no AVX-512 BF16 on this CPU")
def test_quant_linear_interleaves_in_place_and_gives_the_stored_order_back():
    """A 2-bit layer's CPU calls permute its own codes and scales in place (no second copy, the caller's
    QuantizedWeight untouched); state_dict, load_state_dict, qweight and moves see the stored order."""
    q = _weights(40, 256, "kmeans-layer", 2, 64, 3)
    stored = {k: v.clone() for k, v in QuantLinear(q).state_dict().items()}
    layer = QuantLinear(q)
    ptrs = {k: v.data_ptr() for k, v in layer.state_dict().items()}
    x = torch.randn(2, 256).to(torch.bfloat16)
    y = layer(x)
    assert layer._cpu_lut.interleaved and not torch.equal(layer.codes, stored["codes"])
    assert torch.equal(q.codes, stored["codes"])
    state = layer.state_dict()
    assert all(torch.equal(state[k], v) for k, v in stored.items())
    assert {k: v.data_ptr() for k, v in state.items()} == ptrs
    assert torch.equal(layer(x), y) and layer._cpu_lut.interleaved  # permuted again by the next call
    assert torch.equal(layer.qweight.codes, stored["codes"]) and torch.equal(layer(x), y)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # threads running a layer for the first time
        for _ in range(20):  # permute it once (without the lock, about one try in seven came out wrong)
            fresh = QuantLinear(q)
            assert all(torch.equal(r, y) for r in pool.map(lambda _: fresh(x), range(8)))
    copied = copy.deepcopy(layer)  # a copy (and a pickle) carries the stored order, not the kernel's C view
    assert torch.equal(copied.codes, stored["codes"]) and torch.equal(copied(x), y)
    assert torch.equal(pickle.loads(pickle.dumps(layer)).codes, stored["codes"]) and torch.equal(layer(x), y)
    other = _weights(40, 256, "kmeans-layer", 2, 64, 4)
    layer.load_state_dict(QuantLinear(other).state_dict())
    ref = lut_matmul_reference(x.double(), other.packed).double()
    assert error_ratio(layer(x), x, ref, other.dequantize().double().abs()) <= 1
    layer.to(torch.float32)
    assert torch.equal(layer.codes, QuantLinear(other).codes)


@pytest.mark.skipif(lut_cpu.machine_isa() < 3, reason="no AVX-512 BF16 on this CPU")
def test_bf16_path_takes_the_formats_it_claims():
    assert lut_cpu.bf16_path(_weights(8, 256, "kmeans-layer", 4, 64, 0).packed)
    assert lut_cpu.bf16_path(_weights(8, 576, "kmeans-layer", 2, 64, 0).packed)  # a partial last chunk
    assert lut_cpu.bf16_path(_weights(8, 256, "int-asym", 4, 64, 0).packed)  # integer levels: exact in bfloat16
    assert not lut_cpu.bf16_path(_weights(8, 256, "kmeans-block", 4, 64, 0).packed)  # per-block codebooks
    assert not lut_cpu.bf16_path(_weights(8, 256, "kmeans-layer", 8, 64, 0).packed)
    assert not lut_cpu.bf16_path(_weights(8, 96, "kmeans-layer", 4, 32, 0).packed, isa="avx512")
