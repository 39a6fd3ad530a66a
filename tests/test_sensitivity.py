"""TPV sensitivity, the budget knapsack, mixed-precision checkpoints, and their command lines."""

import itertools
import json
import math
import re

import pytest
import torch
from torch import nn

from helpers import make_checkpoint, read_json, run_hilt
from hilt.errors import HiltError
from hilt.quant import QuantConfig, QuantLinear, load_checkpoint, load_quantized_, quantize_checkpoint
from hilt.quant.allocate import allocate
from hilt.quant.sensitivity import (ROW, estimate_tpv, format_label, parse_candidates, quantization_variance,
                                    resolve, spearman, weight_params)


def _linear_model(seed=0, d_in=32, d_out=8):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, d_out, bias=False))


def test_trace_and_tpv_match_the_exact_values_of_a_linear_map():
    """f(x) = W x: diag(H_eff)[o, i] = E[x_i²], Tr = d_out Σ_i E[x_i²], eᵀ H e = E||e x||²."""
    model = _linear_model()
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(16, 32, generator=g) * torch.linspace(0.2, 3, 32) for _ in range(64)]
    x = torch.cat(xs)
    w = model[0].weight
    cfg = QuantConfig(method="int", bits=3, block_size=16)
    var = quantization_variance(w, cfg, "w", keep_error=True)
    out = estimate_tpv(model, [(b,) for b in xs], weight_params(model), {"0.weight": {"int3": var}}, probes=4)
    layer = out["0.weight"]
    second = (x * x).mean(0)  # E[x_i²]
    exact_trace = 8 * float(second.sum())
    assert abs(layer.trace - exact_trace) < 4 * layer.trace_se
    assert layer.samples == 64 * 4
    diag = second.expand(8, 32)
    exact_blocks = float((diag.reshape(8, 2, 16).sum(-1) * var.var).sum())
    assert abs(layer.tpv["int3"] - exact_blocks) < 4 * layer.tpv_se["int3"]
    e = var.error.float()
    exact_full = float((x @ e.T).square().sum(-1).mean())
    assert abs(layer.tpv_full["int3"] - exact_full) < 4 * layer.tpv_full_se["int3"]
    assert all(math.isfinite(v) for v in (layer.trace_se, layer.tpv_se["int3"]))


def test_output_tpv_of_a_perturbed_layer_equals_the_weight_form():
    """Perturbing a linear layer's output by E x is the weight error E: the same eᵀ H e, draws averaged."""
    from hilt.quant.sensitivity import estimate_output_tpv

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))
    x = torch.randn(2048, 16)
    errors = torch.randn(3, 8, 16) * 0.05  # three "chips"
    perturbed = {"0": lambda inp: torch.stack([inp @ (model[0].weight + e).T + model[0].bias for e in errors])}
    got = estimate_output_tpv(model, [(x[i:i + 64],) for i in range(0, 2048, 64)], {"0": model[0]}, perturbed,
                              probes=4)["0"]
    with torch.no_grad():
        h = torch.tanh(model[0](x))
        d = 1 - h * h  # tanh'
        exact = sum(float(((d * (x @ e.T)) @ model[2].weight.T).square().sum(-1).mean()) for e in errors) / 3
    assert abs(got[0] - exact) < 4 * got[1] + 0.02 * exact


def test_softmax_metric_predicts_twice_the_kl():
    """A small perturbation of a softmax classifier: TPV / 2 is the mean KL divergence."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 6))
    x = torch.randn(4096, 12)
    w = model[2].weight
    e = torch.randn_like(w) * 0.02
    from hilt.quant.sensitivity import Variance

    v = Variance(torch.zeros(6, 1), 24, error=e.half())
    out = estimate_tpv(model, [(x[i:i + 64],) for i in range(0, 4096, 64)], {"2.weight": w}, {"2.weight": {"e": v}},
                       metric="softmax", probes=8)
    with torch.no_grad():
        p = torch.log_softmax(model(x), -1)
        w += e.half().float()
        q = torch.log_softmax(model(x), -1)
        w -= e.half().float()
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    got = out["2.weight"].tpv_full["e"] / 2
    assert abs(got - kl) < 4 * out["2.weight"].tpv_full_se["e"] / 2 + 0.05 * kl


def test_tpv_refuses_what_it_cannot_measure():
    model = _linear_model()
    with pytest.raises(HiltError, match="no layer"):
        estimate_tpv(model, [(torch.randn(2, 32),)], {})
    with pytest.raises(HiltError, match="metric"):
        estimate_tpv(model, [(torch.randn(2, 32),)], weight_params(model), metric="cosine")
    from hilt.quant.sensitivity import Variance

    bad = {"0.weight": {"x": Variance(torch.zeros(8, 3), 16)}}
    with pytest.raises(HiltError, match="does not fit the weight"):
        estimate_tpv(model, [(torch.randn(2, 32),)], weight_params(model), bad)
    with pytest.raises(HiltError, match="no calibration batch"):
        estimate_tpv(model, [], weight_params(model))
    x = torch.full((2, 32), float("inf"))
    with pytest.raises(HiltError, match="not finite"):
        estimate_tpv(model, [(x,)], weight_params(model))
    assert model[0].weight.requires_grad  # put back as it was


def test_candidates_parse_and_resolve():
    got = [format_label(c) for c in parse_candidates("kmeans1-3,int1-3@128,int8@row", block_size=32)]
    assert got == ["kmeans1@32", "kmeans2@32", "kmeans3@32", "int2@128", "int3@128", "int8@row"]
    c = parse_candidates("int4@row")[0]
    assert c.block_size == ROW and resolve(c, (5, 3, 3)).block_size == 9
    assert resolve(parse_candidates("int4@64")[0], (8, 100)) is None
    for bad, msg in (("fp4", "bad candidate"), ("kmeans9", "bad candidate"), ("int4,int4@64", "repeat"), ("", "no candidate")):
        with pytest.raises(HiltError, match=msg):
            parse_candidates(bad)


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2], [5, 5, 9]) == pytest.approx(1.0)
    assert math.isnan(spearman([1], [2]))


@pytest.mark.parametrize("seed", range(6))
def test_allocation_is_within_its_certified_gap_of_the_brute_force_optimum(seed):
    g = torch.Generator().manual_seed(seed)
    options = {}
    for t in range(5):
        size = int(torch.randint(50, 400, (1,), generator=g))
        opts = {}
        for b in (1, 2, 3, 4, 6, 8):
            cost = float(torch.rand(1, generator=g) * 2 + 0.1) * size * 4.0 ** -b
            opts[f"k{b}"] = (cost, size * b + 16 * 2 ** b)
        options[f"t{t}"] = opts
    total_min = sum(min(b for _, b in o.values()) for o in options.values())
    total_max = sum(max(b for _, b in o.values()) for o in options.values())
    for budget in torch.linspace(total_min, total_max, 7, dtype=torch.float64).tolist():
        plan = allocate(options, budget)
        best = min((sum(options[t][c][0] for t, c in zip(options, combo)), combo)
                   for combo in itertools.product(*[list(o) for o in options.values()])
                   if sum(options[t][c][1] for t, c in zip(options, combo)) <= budget)
        assert plan.bits <= budget
        assert plan.lower_bound <= best[0] + 1e-12
        assert plan.cost - best[0] <= plan.gap + 1e-12
        assert plan.cost == pytest.approx(sum(options[t][plan.choice[t]][0] for t in options))
    with pytest.raises(HiltError, match="below the smallest"):
        allocate(options, total_min - 1)


def test_mixed_checkpoint_loads_per_tensor_formats(tmp_path):
    src = tmp_path / "m.safetensors"
    tensors = make_checkpoint(src)
    formats = {"model.layers.0.mlp.up_proj.weight": QuantConfig(method="int", bits=8, block_size=128),
               "model.layers.1.mlp.down_proj.weight": QuantConfig(method="kmeans", bits=2, block_size=32)}
    header = quantize_checkpoint(src, tmp_path / "q", QuantConfig(bits=4), formats=formats,
                                 mixed={"budget": 3.0}).header
    assert header["mixed"]["budget"] == 3.0 and set(header["mixed"]["formats"]) == set(formats)
    e = header["tensors"]
    assert (e["model.layers.0.mlp.up_proj.weight"]["bits"], e["model.layers.0.mlp.up_proj.weight"]["method"]) == (8, "int")
    assert e["model.layers.1.mlp.down_proj.weight"]["block_size"] == 32
    assert e["model.layers.0.self_attn.q_proj.weight"]["bits"] == 4
    loaded = load_checkpoint(tmp_path / "q")
    assert loaded["model.layers.1.mlp.down_proj.weight"].bits == 2

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(128, 256, bias=False)
            self.down = nn.Linear(256, 128, bias=False)
    m = Two()
    w = {"up.weight": tensors["model.layers.0.mlp.up_proj.weight"],
         "down.weight": tensors["model.layers.1.mlp.down_proj.weight"]}
    quantize_checkpoint_src = tmp_path / "two.safetensors"
    from safetensors.torch import save_file
    save_file(w, str(quantize_checkpoint_src))
    quantize_checkpoint(quantize_checkpoint_src, tmp_path / "q2", QuantConfig(bits=4),
                        formats={"up.weight": QuantConfig(method="int", bits=8, block_size=128),
                                 "down.weight": QuantConfig(method="kmeans", bits=3, block_size=32)})
    load_quantized_(m, tmp_path / "q2")
    assert isinstance(m.up, QuantLinear) and m.up.bits == 8 and m.down.bits == 3 and m.down.block_size == 32
    x = torch.randn(3, 128)
    ref = (x @ load_checkpoint(tmp_path / "q2")["up.weight"].dequantize().T)
    torch.testing.assert_close(m.up(x), ref, rtol=1e-4, atol=1e-4)
    from hilt.kernels.lut_matmul import lut_matmul_reference
    from hilt.kernels.lut_matmul_triton import lut_matmul_triton

    for layer in (m.up, m.down):  # the Triton kernel (interpreted here) takes each tensor's own width
        xk = torch.randn(3, layer.in_features)
        y = lut_matmul_triton(xk, layer.packed)
        assert torch.isfinite(y).all()
        torch.testing.assert_close(y, lut_matmul_reference(xk, layer.packed), rtol=1e-3, atol=1e-3)
    with pytest.raises(HiltError, match="exclude --importance and --compensate"):
        quantize_checkpoint(src, tmp_path / "q3", QuantConfig(bits=4), formats=formats, compensate=lambda n: None)
    with pytest.raises(HiltError, match="not among the tensors to quantize"):
        quantize_checkpoint(src, tmp_path / "q4", QuantConfig(bits=4), formats={"lm_head.weight": QuantConfig()})


def _sensitivity_file(path, src_tensors, targets):
    """A sensitivity file as `hilt sensitivity --json` writes it, for a checkpoint hilt cannot run:
    TPV from a linear surrogate (each layer alone on unit inputs)."""
    layers = []
    for name in targets:
        w = src_tensors[name]
        row = {"name": name, "shape": list(w.shape), "tpv": {}, "tpv_full": {}, "bits": {}, "trace": 1.0,
               "trace_se": 0.0}
        for c in parse_candidates("kmeans1-4,int8@128"):
            fitted = resolve(c, w.shape)
            v = quantization_variance(w, fitted, name)
            label = format_label(c)
            row["tpv"][label] = float(v.var.sum()) * v.block
            row["tpv_full"][label] = row["tpv"][label]
            row["bits"][label] = v.bits
        layers.append(row)
    path.write_text(json.dumps({"model": "tiny", "metric": "euclidean", "candidates": [], "layers": layers}))


def test_quantize_budget_from_a_sensitivity_file(tmp_path):
    src = tmp_path / "tiny.safetensors"
    tensors = make_checkpoint(src)
    targets = [n for n in tensors if n.endswith(("q_proj.weight", "up_proj.weight", "down_proj.weight"))]
    sens = tmp_path / "sens.json"
    _sensitivity_file(sens, tensors, targets)
    dst, js = tmp_path / "q", tmp_path / "out.json"
    r = run_hilt("quantize", src, dst, "--budget", "2.6", "--sensitivity", sens, "--dry-run", "--json", js)
    assert r.returncode == 0, r.stderr
    assert "budget 2.6 bits/weight" in r.stdout and "nothing written" in r.stdout and not dst.exists()
    plan = read_json(js)["mixed"]
    assert plan["bits_per_weight"] <= 2.6 and plan["gap"] >= 0
    r = run_hilt("quantize", src, dst, "--budget", "2.6", "--sensitivity", sens)
    assert r.returncode == 0, r.stderr
    header = json.loads((dst / "hilt.json").read_text())
    assert header["totals"]["bits_per_weight"] <= 2.6 + 1e-9
    assert len({e["bits"] for e in header["tensors"].values() if e["kind"] == "quantized"}) > 1  # mixed
    r = run_hilt("inspect", dst)
    assert r.returncode == 0 and "mixed per tensor (budget 2.6 bits/weight)" in r.stdout

    for args, msg in ((("--budget", "0.5"), "outside what the candidate formats reach"),
                      (("--budget", "9"), "outside what the candidate formats reach")):
        r = run_hilt("quantize", src, tmp_path / "x", *args, "--sensitivity", sens)
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and msg in r.stderr, r.stderr
        assert not (tmp_path / "x").exists()
    r = run_hilt("quantize", src, tmp_path / "x", "--budget", "3", "--sensitivity", sens, "--bits", "4")
    assert r.returncode == 2 and "--bits does not go with --budget" in r.stderr
    r = run_hilt("quantize", src, tmp_path / "x", "--sensitivity", sens)
    assert r.returncode == 2 and "--sensitivity applies with --budget only" in r.stderr
    other = tmp_path / "other.json"
    _sensitivity_file(other, tensors, targets[:1])
    r = run_hilt("quantize", src, tmp_path / "x", "--budget", "3", "--sensitivity", other)
    assert r.returncode == 1 and "no sensitivity for tensor" in r.stderr
    r = run_hilt("quantize", src, tmp_path / "x", "--budget", "3")  # nothing to measure it on
    assert r.returncode == 1 and "no config.json" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_sensitivity_command_on_the_cnn(tmp_path, capsys):
    js, png = tmp_path / "cnn.json", tmp_path / "cnn.png"
    r = run_hilt("sensitivity", "cnn", "--images", "256", "--candidates", "int2-4@row", "--json", js, "--plot", png)
    assert r.returncode == 0, r.stderr
    assert "conv1.weight" in r.stdout and "TPV predicts" in r.stdout
    out = read_json(js)
    assert [x["name"] for x in out["layers"]] == ["conv1.weight", "conv2.weight", "fc1.weight", "fc2.weight"]
    for row in out["layers"]:  # fewer bits, more predicted change
        assert row["tpv_full"]["int2@row"] > row["tpv_full"]["int4@row"] > 0
        assert row["trace"] > 0 and row["trace_se"] > 0
    assert png.stat().st_size > 10_000
    r = run_hilt("sensitivity", "cnn", "--preset", "pcm", "--time", "1d", "--chips", "2", "--images", "64",
                 "--json", js)
    assert r.returncode == 0, r.stderr
    for row in read_json(js)["layers"]:  # the weights' error alone, and the whole analog layer at its output
        assert row["tpv_full"]["pcm@1d"] > 0 and row["tpv_chip"]["pcm@1d"] > 0
    from hilt.cli import main

    for argv, code, message in ((["cnn", "--time", "1y"], 2, "--time applies with --preset only"),
                                (["cnn", "--candidates", "fp4"], 1, "bad candidate format"),
                                ([str(tmp_path / "nothing.gguf")], 1, "no such file")):
        capsys.readouterr()
        assert main(["sensitivity", *argv]) == code
        assert message in capsys.readouterr().err


def test_budget_on_minilm_through_eval_and_onnx(minilm_dir, tmp_path, capsys):
    """A real model: sensitivity, a --budget checkpoint, then `hilt eval embed` and `hilt export onnx` take it."""
    pytest.importorskip("onnxruntime")
    from hilt.cli import main
    from hilt.tasks.sensitivity import sensitivity_run

    sens = tmp_path / "minilm-tpv.json"
    # the block-diagonal estimate (the default): the full one is checked against exact values above
    r = sensitivity_run(str(minilm_dir), candidates="kmeans2,int4,int8", sentences=16, probes=1)
    sens.write_text(json.dumps(r))
    used = [x for x in r["layers"] if not x.get("unused")]
    assert len(used) == 36 and all(x["tpv"]["kmeans2@64"] > x["tpv"]["int4@64"] > x["tpv"]["int8@64"] for x in used)
    assert [x["name"] for x in r["layers"] if x.get("unused")] == ["pooler.dense.weight"]  # not in the embedding
    dst = tmp_path / "q"
    assert main(["quantize", str(minilm_dir), str(dst), "--budget", "4", "--sensitivity", str(sens)]) == 0
    header = json.loads((dst / "hilt.json").read_text())
    widths = {e["bits"] for e in header["tensors"].values() if e["kind"] == "quantized"}
    assert len(widths) > 1 and header["totals"]["bits_per_weight"] <= 4
    capsys.readouterr()
    assert main(["eval", "embed", str(minilm_dir), "--quantized", str(dst), "--sentences", "16"]) == 0
    cos = float(re.search(r"similarity to fp32 embeddings ([0-9.]+)", capsys.readouterr().out)[1])
    assert 0.8 < cos < 1.0  # between 2 and 4 bits per weight, most of the embedding survives
    assert main(["export", "onnx", str(dst), str(tmp_path / "m.onnx")]) == 0


def test_bench_mixed_quick_on_minilm(minilm_dir, tmp_path):
    from hilt.bench.studies import mixed

    assert [i for i in range(30) if mixed.promoted(f"blk.{i}.attn_v.weight", 30)] == \
        [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]  # llama.cpp's use_more_bits on 30 layers
    assert not mixed.promoted("blk.0.attn_q.weight", 30)
    assert mixed.promoted("encoder.layer.5.output.dense.weight", 6)
    assert not mixed.promoted("encoder.layer.5.attention.output.dense.weight", 6)
    r = mixed.run(out=tmp_path / "mixed.json", quick=True, models=("minilm",), budgets=(3.0,),
                  candidates="kmeans2,kmeans4,int8")
    rows = r["models"]["minilm"]["rows"]
    assert {x["allocator"] for x in rows} == {"unquantized", *mixed.ALLOCATORS}
    for x in rows:
        if x["budget"] is not None:
            assert x["bits_per_weight"] <= 3.0 and 0 < x["cosine"] < 1
    assert next(x for x in rows if x["allocator"] == "uniform")["formats"] == {"kmeans2@64": 36}
    assert (tmp_path / "mixed.png").stat().st_size > 10_000 and "| 3.0 |" in (tmp_path / "mixed.md").read_text()
