"""ONNX lowering of quantized weights, and the `hilt export onnx` models."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from hilt.quant import QuantConfig, quantize_tensor
from hilt.quant.onnx_export import dequantize_subgraph


def _run_subgraph(q):
    inits, nodes = dequantize_subgraph("w", q)
    graph = helper.make_graph(nodes, "dequant", [], [helper.make_tensor_value_info("w", TensorProto.FLOAT, list(q.shape))],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {})[0]


@pytest.mark.parametrize("method, bits, codebook", [
    ("kmeans", 1, "layer"), ("kmeans", 2, "layer"), ("kmeans", 3, "layer"), ("kmeans", 4, "layer"),
    ("kmeans", 3, "block"), ("int", 4, "layer"), ("int-asym", 3, "layer"), ("binary", 1, "layer"),
    ("int", 8, "layer"),
])
def test_subgraph_rebuilds_the_weight_exactly(method, bits, codebook):
    torch.manual_seed(bits)
    w = torch.randn(37, 96) * torch.rand(37, 1)  # rows of different scale; 96 is not a byte multiple at 3 bits
    q = quantize_tensor(w, QuantConfig(method=method, bits=bits, block_size=32, codebook=codebook, solver="lloyd"))
    got = _run_subgraph(q)
    want = q.dequantize().float().numpy()
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("preset_name,ahead", [("pcm", False), ("pcm", True), ("pcm-hwa", False), ("ideal", False)])
def test_frozen_model_is_the_simulator_without_its_noise(preset_name, ahead):
    import dataclasses

    from hilt.cim_sim import convert_to_analog, drift_to, preset, program
    from hilt.cim_sim.frozen import freeze

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 6, 3, padding=1, stride=2), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(6 * 5 * 5, 700), torch.nn.ReLU(), torch.nn.Linear(700, 4))
    with torch.no_grad():  # positive-leaning weights on positive inputs: the ADC saturates, bound management retries
        model[5].weight.copy_(torch.randn(4, 700) + 1.5)
    quiet = dataclasses.replace(preset(preset_name), out_noise=0.0, w_noise=0.0, gdc_before_adc=ahead)
    analog = convert_to_analog(model, quiet)
    program(analog, seed=3)
    drift_to(analog, 86400.0, seed=4)
    x = torch.randn(16, 2, 10, 10)
    frozen = freeze(analog)
    with torch.no_grad():
        want, got = analog(x), frozen(x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if preset_name != "ideal":  # the retries mattered: without bound management the outputs differ
        clipped = convert_to_analog(model, dataclasses.replace(quiet, bound_management=False))
        program(clipped, seed=3)
        drift_to(clipped, 86400.0, seed=4)  # the same chip and read-out
        assert torch.equal(clipped[5].w_eff, analog[5].w_eff)
        assert not torch.allclose(freeze(clipped)(x), got, rtol=1e-3, atol=1e-3)


def test_quantized_minilm_export_is_compact_and_matches(minilm_dir, tmp_path):
    from hilt.tasks.export import export_quantized
    from hilt.quant import quantize_checkpoint

    import shutil

    import transformers

    import hilt  # noqa: F401  (transformers loads hilt folders through it)

    ckpt = tmp_path / "minilm-3bit"
    quantize_checkpoint(minilm_dir, ckpt, QuantConfig(method="kmeans", bits=3, block_size=64))
    # the folder as transformers' save_pretrained writes it again: no hilt.json, no dense weights
    resaved = tmp_path / "resaved"
    transformers.AutoModel.from_pretrained(str(ckpt)).save_pretrained(str(resaved))
    shutil.copy(ckpt / "tokenizer.json", resaved)
    result = export_quantized(resaved, tmp_path / "m.onnx", sentences=16)
    assert result["quantized_weights"] == 36  # every Linear of the encoder (the unused pooler is left out)
    assert result["max_rel_error"] <= 1e-3 and result["size_ratio"] <= 1.3
    model = onnx.load(str(tmp_path / "m.onnx"))
    packed = [i for i in model.graph.initializer if i.name.endswith(".codes")]
    assert len(packed) == 36 and all(i.data_type == TensorProto.UINT8 for i in packed)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_integer_weights_run_packed_as_matmulnbits(bits, tmp_path):
    """Transpose + MatMul of a symmetric integer weight becomes one MatMulNBits reading the packed
    codes; ONNX Runtime then matches PyTorch. A k-means weight in the same model keeps the subgraph."""
    import logging
    import warnings

    from hilt.quant import QuantLinear
    from hilt.quant.onnx_export import replace_initializers, use_matmulnbits

    torch.manual_seed(bits)
    big = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 40), torch.nn.GELU(),
                              torch.nn.Linear(40, 32, bias=False))  # the last stays a plain weight
    weights = {"0.weight": quantize_tensor(big[0].weight.detach(), QuantConfig("kmeans", 3, 32)),
               "2.weight": quantize_tensor(big[2].weight.detach(), QuantConfig("int", bits, 32))}
    x = torch.randn(2, 7, 64)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proto = torch.onnx.export(big, (x,), dynamo=True, optimize=False, opset_version=20, input_names=["x"],
                                  output_names=["y"]).model_proto
    assert use_matmulnbits(proto, weights) == ["2.weight"]
    replace_initializers(proto, {"0.weight": weights["0.weight"]})
    onnx.checker.check_model(proto)
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("MatMulNBits") == 1 and "GatherElements" not in ops and "Gather" in ops
    packed = next(i for i in proto.graph.initializer if i.name == "2.weight.codes")
    assert packed.data_type == TensorProto.UINT8 and list(packed.dims) == [40, 3, 32 * bits // 8]
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"x": x.numpy()})[0]
    big[0] = QuantLinear(weights["0.weight"], big[0].bias)
    big[2] = QuantLinear(weights["2.weight"], big[2].bias)
    with torch.no_grad():
        want = big(x).numpy()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
