"""The Triton LUT matmul kernel itself (interpreter on the CPU) against its PyTorch reference."""

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hilt.errors import HiltError
from hilt.kernels.lut_matmul import choose_path, error_ratio, lut_matmul, lut_matmul_reference
from hilt.kernels.lut_matmul_triton import GEMM_CONFIGS, SPLIT_K_CONFIGS, lut_matmul_triton, split_k_fits
from hilt.quant import QuantConfig, quantize_tensor
from hilt.quant.formats import method_for_bits

def _weights(n, k, method, bits, block, scope, seed):
    """A quantized weight (``.packed``: the kernel's argument)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return quantize_tensor(w, QuantConfig(method, bits, block, codebook=scope))


def _check_against_reference(q, x, path, split_k=None):
    y = lut_matmul_triton(x, q.packed, path=path, split_k=split_k)
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], q.shape[0])
    assert torch.isfinite(y).all()
    ref = lut_matmul_reference(x.float(), q.packed).double()
    ratio = error_ratio(y, x, ref, q.dequantize().double().abs())
    assert ratio <= 1.0, ratio


@settings(max_examples=60, deadline=None)
@given(
    m=st.sampled_from([1, 3, 16, 17, 100]),
    n=st.integers(1, 80),
    blocks=st.integers(1, 4),
    block=st.sampled_from([32, 48, 64, 256]),  # 48, 256: blocks that do not tile BLOCK_K
    bits=st.sampled_from([1, 2, 3, 4]),
    fmt=st.sampled_from(["kmeans-layer", "kmeans-block", "int", "int-asym"]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    path=st.sampled_from(["gemv", "gemm"]),
    seed=st.integers(0, 2**20),
)
def test_kernel_matches_reference(m, n, blocks, block, bits, fmt, dtype, path, seed):
    method, scope = (fmt.split("-") + ["layer"])[:2] if fmt.startswith("kmeans") else (fmt, "layer")
    method = method_for_bits(method, bits)  # int at 1 bit is binary
    q = _weights(n, blocks * block, method, bits, block, scope, seed)
    x = torch.randn(m, blocks * block, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    _check_against_reference(q, x, path)


@pytest.mark.parametrize("bits", [5, 6, 7, 8])
def test_wide_codes(bits):
    q = _weights(33, 192, "kmeans", bits, 64, "layer", bits)
    _check_against_reference(q, torch.randn(5, 192).half(), "gemv")
    _check_against_reference(q, torch.randn(20, 192).half(), "gemm")


@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_poisoned_output_is_fully_written(split_k):
    q = _weights(70, 320, "kmeans", 3, 64, "layer", 0)
    x = torch.randn(3, 320).half()
    out = torch.full((3, 70), float("nan")).half()
    partial = torch.full((split_k, 3, 70), float("nan")) if split_k > 1 else None
    y = lut_matmul_triton(x, q.packed, path="gemv", split_k=split_k, out=out, partial=partial)
    assert y.data_ptr() == out.data_ptr() and torch.isfinite(out).all()
    assert partial is None or torch.isfinite(partial).all()


def test_split_k_configs_cover_every_decode_batch():
    for m in range(1, 17):
        fitting = [c for c in SPLIT_K_CONFIGS if split_k_fits(c, m)]
        assert any(not c.kwargs["USE_DOT"] for c in fitting), m  # CUDA-core tiles for every M
    assert not split_k_fits(SPLIT_K_CONFIGS[0], 2) and SPLIT_K_CONFIGS[0].kwargs["BLOCK_M"] == 1
    with pytest.raises(HiltError, match="does not serve 2 rows"):
        q = _weights(8, 128, "kmeans", 2, 64, "layer", 0)
        lut_matmul_triton(torch.randn(2, 128).half(), q.packed, path="gemv", config=SPLIT_K_CONFIGS[0])


def test_batched_input_and_bias():
    q = _weights(24, 128, "kmeans", 4, 64, "layer", 3)
    x = torch.randn(2, 3, 128).half()
    bias = torch.randn(24)
    y = lut_matmul_triton(x, q.packed, bias=bias)
    ref = lut_matmul_reference(x.float(), q.packed, bias=bias)
    assert y.shape == (2, 3, 24)
    assert torch.allclose(y.float(), ref, atol=0.05, rtol=0.01)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_byte_table_holds_the_levels_of_every_code_in_a_byte(bits):
    from hilt.kernels import byte_table, pack_codes

    book = torch.randn(1 << bits)
    table = byte_table(book, bits)
    per_byte = 8 // bits
    codes = torch.randint(0, 1 << bits, (256 * per_byte,))
    packed = pack_codes(codes.view(1, -1), bits).view(-1).long()  # the checkpoint's packing
    assert table.shape == (256, per_byte)
    assert torch.equal(table[packed].view(-1), book[codes])
    with pytest.raises(HiltError, match="1, 2 or 4 bits and one codebook per layer"):
        byte_table(torch.randn(8), 3)


def test_empty_input_and_bias_shape():
    q = _weights(24, 128, "kmeans", 2, 64, "layer", 4)
    for path in ("gemv", "gemm"):
        assert lut_matmul_triton(torch.randn(0, 128).half(), q.packed, path=path).shape == (0, 24)
    with pytest.raises(HiltError, match=r"bias has shape \(23,\), expected \(24,\)"):
        lut_matmul_triton(torch.randn(1, 128).half(), q.packed, bias=torch.zeros(23))


def test_path_choice_and_refusals():
    assert choose_path(1) == choose_path(16) == "gemv" and choose_path(17) == "gemm"
    q = _weights(8, 128, "kmeans", 2, 64, "layer", 0)
    with pytest.raises(HiltError, match="input has 100 features"):
        lut_matmul_triton(torch.randn(1, 100).half(), q.packed)
    with pytest.raises(HiltError, match="input has 100 features"):
        lut_matmul(torch.randn(1, 100), q.packed)
    with pytest.raises(HiltError, match="unknown kernel path"):
        lut_matmul_triton(torch.randn(1, 128).half(), q.packed, path="fast")
    # a PackedWeight that exists is consistent: the kernel never sees one that is not
    for change, match in (({"block_size": 48}, "not a multiple of block size"),
                          ({"in_features": 0}, "in_features must be at least 1, got 0"),
                          ({"codebook": torch.zeros(8)}, "codebook has 8 levels, 2 bits need 4"),
                          ({"codebook": torch.zeros(8, 3, 4)}, r"codebook has shape \(8, 3, 4\), expected"),
                          ({"in_features": 192}, r"codes must be uint8 \(8, 48\)"),
                          ({"offsets": torch.zeros(8, 1)}, r"offsets have shape \(8, 1\), expected \(8, 2\)"),
                          ({"bits": 9}, "bits must be between 1 and 8")):
        with pytest.raises(HiltError, match=match):
            dataclasses.replace(q.packed, **change)


def test_packed_weight_rows_and_bytes():
    q = _weights(8, 128, "kmeans", 2, 64, "block", 0)
    band = q.packed.rows(2, 5)
    assert band.out_features == 3 and torch.equal(band.codebook, q.codebook[2:5])
    assert torch.equal(lut_matmul_reference(torch.eye(128), band), q.dequantize()[2:5].T)
    assert q.packed.nbytes == 8 * 32 + 8 * 2 * 4 * 2 + 8 * 2 * 2  # codes, fp16 codebooks, bf16 scales
    assert q.packed.tensors().keys() == {"codes", "codebook", "scales"}


def test_error_bound_passes_the_reference_and_fails_a_wrong_output():
    q = _weights(16, 128, "kmeans", 3, 64, "layer", 2)
    x = torch.randn(4, 128).half()
    w_abs = q.dequantize().double().abs()
    ref = lut_matmul_reference(x.float(), q.packed).double()
    y = ref.half()  # rounded once to x's dtype: within the bound
    assert error_ratio(y, x, ref, w_abs) <= 0.5
    wrong = y.clone()
    wrong[1, 3] += 0.05 * (x[1].double().abs() @ w_abs[3]).item()  # 5% of |x| |w|: far beyond fp16 rounding
    assert error_ratio(wrong, x, ref, w_abs) > 1
    wrong[0, 0] = float("nan")
    assert error_ratio(wrong, x, ref, w_abs) == float("inf")


def test_float32_inputs_keep_full_precision():
    q = _weights(40, 256, "kmeans", 4, 64, "layer", 9)
    x = torch.randn(20, 256)
    ref = lut_matmul_reference(x, q.packed)
    for path in ("gemv", "gemm"):
        assert torch.allclose(lut_matmul_triton(x, q.packed, path=path), ref, rtol=1e-5, atol=1e-5)


def test_bench_kernels_check_passes_on_cpu(tmp_path):
    from helpers import read_json

    from hilt.cli import main

    assert main(["bench", "kernels", "--check", "--quick", "--json", str(tmp_path / "k.json")]) == 0
    result = read_json(tmp_path / "k.json")
    configs = len(SPLIT_K_CONFIGS) + len(GEMM_CONFIGS)
    assert result["check"]["configs_checked"] == configs and result["check"]["failures"] == []
    # 3 shapes x 4 bit widths (each in one dtype) x 3 formats x 2 paths, then every tuning configuration
    assert result["check"]["cases"] == 72 + 2 * len(SPLIT_K_CONFIGS) + len(GEMM_CONFIGS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the timings run")
def test_bench_kernels_timings_need_a_gpu():
    from helpers import run_hilt

    r = run_hilt("bench", "kernels", "--timings", "--quick")
    assert r.returncode != 0 and "timings need a CUDA GPU" in r.stderr


def test_check_records_a_kernel_that_raises_and_goes_on(monkeypatch):
    """On a GPU a configuration may fail to compile: it is a failure, and the other cases run."""
    from hilt.bench.perf import lut_kernels

    monkeypatch.setattr(lut_kernels, "CHECK_SHAPES", [(3, 40, 128)])
    kt = lut_kernels._kernels("cpu")
    real = kt.lut_matmul_triton

    def flaky(*args, config=None, **kw):
        if config is GEMM_CONFIGS[0] and kw.get("bias") is not None:
            raise RuntimeError("out of resources: shared memory\nmore detail")
        return real(*args, config=config, **kw)

    monkeypatch.setattr(kt, "lut_matmul_triton", flaky)
    result = lut_kernels.check(configs=[("gemv", SPLIT_K_CONFIGS[0]), ("gemm", GEMM_CONFIGS[0])])
    assert result["cases"] == 4 * 3 * 2 * 2 + 2 + 1
    assert [f["error"] for f in result["failures"]] == ["RuntimeError: out of resources: shared memory more detail"]


def test_bench_kernels_keeps_the_timings_when_decode_cannot_run(tmp_path, monkeypatch):
    """On a bare GPU machine without gguf or the SmolLM2 file: minutes of timings are saved, the
    decode check is named as not run, and the exit status is 1."""
    import sys

    from hilt import models as bench_models
    from hilt.bench.perf import lut_kernels

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(lut_kernels, "gpu_info", lambda: {"device": "fake GPU"})
    monkeypatch.setattr(lut_kernels, "check", lambda device, quick=False: {"cases": 1, "failures": []})
    monkeypatch.setattr(lut_kernels, "timings", lambda quick, graphs, progress: {"rows": [{"speedup": 4.0}]})
    monkeypatch.delattr(bench_models, "llama", raising=False)
    monkeypatch.delitem(sys.modules, "hilt.models.llama", raising=False)
    monkeypatch.setitem(sys.modules, "gguf", None)  # the GPU machine's python3 has no gguf
    with pytest.raises(HiltError, match="cannot import 'gguf'"):
        lut_kernels.decode()
    assert lut_kernels.run(everything=True, json_path=tmp_path / "k.json") == 1
    result = json.loads((tmp_path / "k.json").read_text())
    assert result["timings"] == {"rows": [{"speedup": 4.0}]} and "gguf" in result["decode_error"]


def test_bench_kernels_decode_alone_takes_the_given_gguf(tmp_path, monkeypatch, capsys):
    from hilt.bench.perf import lut_kernels
    from hilt.cli import main

    seen = []
    monkeypatch.setattr(lut_kernels, "decode", lambda path: seen.append(path) or {"4bit": {"same": True}})
    assert main(["bench", "kernels", "--decode", "--smollm2", "joined.gguf", "--json", str(tmp_path / "d.json")]) == 0
    assert seen == ["joined.gguf"] and json.loads((tmp_path / "d.json").read_text())["decode"]["4bit"]["same"]
    assert main(["bench", "kernels", "--check", "--smollm2", "joined.gguf"]) == 2  # the model of a check that does not run
    assert "add --all or --decode" in capsys.readouterr().err


def test_kernel_compiles_for_an_sm90_gpu_without_one(tmp_path):
    """The interpreter runs code Triton's GPU compiler rejects: compile for sm_90 with the ptxas
    Triton carries: each way of reading codes and the FP8 attention kernels, in their first
    configurations, without spilling registers."""
    from helpers import read_json, run_hilt

    from hilt.bench.perf import sass

    if not sass.available():
        pytest.skip("this Triton has no CUDA backend tools")
    r = run_hilt("bench", "kernels", "--sass", "--quick", "--json", tmp_path / "s.json")
    assert r.returncode == 0, r.stderr
    rows = read_json(tmp_path / "s.json")["rows"]
    assert {r["config"]["CODES"] for r in rows} == {"code", "unpack", "table"} and {r["path"] for r in rows} == {
        "gemv", "gemm"}
    assert all(r["stack"] == 0 and r["local"] == 0 and r["loop_instructions"] > 0 for r in rows)  # no spills
    attention = read_json(tmp_path / "s.json")["attention"]  # never compiled for a GPU before this tool
    assert {r["kernel"] for r in attention} == {"_quantize_kernel", "_attn_fwd_kernel"}
    assert all(r["stack"] == 0 for r in attention)
    table = [r for r in rows if r["config"]["CODES"] == "table" and r["bits"] == 4]
    code = [r for r in rows if r["config"]["CODES"] == "code" and r["m"] == 1 and r["bits"] == 4]
    assert table[0]["instructions_per_weight"] < code[0]["instructions_per_weight"]


def _fake_timings(graphs=True):
    """A results file as a GPU run writes it (numbers invented, shapes real)."""
    from hilt.bench.perf import lut_kernels

    rows = []
    for layer in ("llama7b.q_proj", "llama70b.q_proj"):
        n, k = lut_kernels.LAYER_SHAPES[layer]
        for bits in (1, 2, 3, 4):
            for m in lut_kernels.BATCHES:
                speed = (16 / (bits + 0.25)) * 0.8 / (1 + m / 64)
                row = {"layer": layer, "n": n, "k": k, "m": m, "bits": bits, "bits_per_weight": bits + 0.25,
                       "bf16_us": 30.0, "lut_us": 30.0 / speed, "speedup": speed, "lut_gb_s": 3000.0,
                       "share_of_copy_bw": 0.75}
                if graphs:
                    row["graph_speedup"] = speed * 1.1
                rows.append(row)
    return {"machine": {"gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6"},
            "timings": {"copy_gb_s": 4000.0, "rows": rows, "failures": []}}


def test_targets_table_and_plot_of_a_results_file(tmp_path, capsys):
    from hilt.bench.perf import lut_kernels
    from hilt.cli import main

    result = _fake_timings()
    met = {(t["m"], t["bits"]): t["met"] for t in lut_kernels.targets(result["timings"]["rows"])}
    # M=1: 4 bit 3.01x (graphs 3.31x) < 3.8; 1 bit 10.24x (graphs) >= 10; M=256: 0.12x (graphs 0.13x) < 0.9
    assert met[(1, 1)] and not met[(1, 4)] and not met[(256, 4)] and len(met) == 7
    table = lut_kernels.render_table(result)
    assert "NVIDIA H200" in table and table.count("\n| llama") == 32 and "CUDA graphs" in table
    assert "| llama70b.q_proj (8192 x 8192) | 1 | 1 | 1.25 |" in table
    (tmp_path / "k.json").write_text(json.dumps(result))
    assert main(["bench", "kernels", "--table", str(tmp_path / "k.json")]) == 0
    assert capsys.readouterr().out == table
    assert "graph" not in lut_kernels.render_table(_fake_timings(graphs=False))
    assert main(["bench", "kernels", "--table", str(tmp_path / "k.json"), "--plot", str(tmp_path / "k.png")]) == 0
    assert (tmp_path / "k.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "cpu.json").write_text(json.dumps({"machine": {"device": "cpu"}, "check": {}}))
    assert main(["bench", "kernels", "--table", str(tmp_path / "cpu.json")]) != 0
    assert "cpu.json: no timings in this results file" in capsys.readouterr().err
    assert main(["bench", "kernels", "--table", str(tmp_path / "gone.json")]) != 0
    assert capsys.readouterr().err.strip().endswith("gone.json: No such file or directory")


def test_report_section_shows_the_check_and_decode_and_fails_on_a_mismatch(tmp_path, monkeypatch):
    from hilt.bench.perf import lut_kernels
    from hilt.bench import report

    check = {"device": "cpu", "cases": 332, "configs_checked": 52, "failures": [], "max_error_ratio": 0.171}
    text = {"kernel": " Paris | Lyon\nx", "dequantized": " Paris | Lyon\nx", "kernel_seconds": 9.0,
            "dequantized_seconds": 3.0, "same": True}
    decode = {"device": "cpu", "through": "PyTorch reference", "4bit": text, "1bit": dict(text)}
    monkeypatch.setattr(lut_kernels, "check", lambda device, quick: check)
    monkeypatch.setattr(lut_kernels, "decode", lambda: decode)
    md = report.kernel_section(tmp_path)
    assert "332 cases (52 tuning configurations), 0 failures, worst error 0.171" in md
    assert "| 4-bit k-means | yes | 9.0 | 3.0 | ` Paris \\| Lyon\\nx` |" in md  # one table row, pipe escaped
    assert "need a GPU" in md and json.loads((tmp_path / "lut_kernels.json").read_text())["check"] == check
    decode["1bit"] = {**text, "kernel": "other", "same": False}
    with pytest.raises(HiltError, match="disagree with their reference"):
        report.kernel_section(tmp_path)
    assert json.loads((tmp_path / "lut_kernels.json").read_text())["decode"]["1bit"]["same"] is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quant_linear_on_gpu_runs_the_kernel():
    from hilt.quant import QuantLinear

    q = _weights(300, 512, "kmeans", 2, 64, "layer", 1)
    layer = QuantLinear(q).cuda()
    for m in (1, 16, 17, 100):
        x = torch.randn(m, 512, device="cuda", dtype=torch.float16)
        ref = lut_matmul_reference(x.cpu().float(), q.packed)
        assert torch.allclose(layer(x).float().cpu(), ref, rtol=1e-2, atol=1e-2)
