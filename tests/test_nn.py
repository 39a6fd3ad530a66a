import pytest
import torch
from torch import nn

from helpers import make_checkpoint, run_hilt
from hilt.errors import HiltError
from hilt.kernels import lut_matmul
from hilt.kernels.lut_matmul import error_ratio, lut_matmul_reference
from hilt.quant import QuantConfig, QuantLinear, load_quantized_, quantize_model_, quantize_tensor


def test_quant_linear_matches_dense_matmul_on_dequantized_weight():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 128, generator=g), torch.randn(48, generator=g)
    for cfg in (QuantConfig("kmeans", 3), QuantConfig("int-asym", 4), QuantConfig("kmeans", 2, codebook="block")):
        q = quantize_tensor(w, cfg)
        layer = QuantLinear(q, b)
        for m in (1, 3, 17):
            x = torch.randn(m, 128, generator=g)
            expected = x.double() @ q.dequantize().double().T + b.double()
            assert torch.allclose(layer(x).double(), expected, atol=1e-4)


def test_dispatch_equals_reference_and_keeps_dtype():
    q = quantize_tensor(torch.randn(32, 64), QuantConfig("kmeans", 4))
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    y = lut_matmul(x, q.packed)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 5, 32)
    ref = lut_matmul_reference(x.double(), q.packed).double()  # the CPU kernel: within the kernels' bound
    assert error_ratio(y, x, ref, q.dequantize().double().abs()) <= 1
    with pytest.raises(HiltError, match="input has 63 features"):
        lut_matmul(torch.randn(1, 63), q.packed)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 64)
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64, bias=False)
        self.odd = nn.Linear(50, 8)  # 50 is not a multiple of 64: left alone
        self.lm_head = nn.Linear(64, 10, bias=False)


def test_quantize_model_swaps_eligible_linears():
    model = Tiny()
    quantize_model_(model, QuantConfig("kmeans", 2))
    assert isinstance(model.up, QuantLinear) and isinstance(model.down, QuantLinear)
    assert isinstance(model.odd, nn.Linear) and isinstance(model.lm_head, nn.Linear)
    assert model.up.bias is not None


def test_load_quantized_reproduces_the_checkpoint(tmp_path):
    src = tmp_path / "m.safetensors"
    tensors = make_checkpoint(src, n_layers=1, hidden=64)
    r = run_hilt("quantize", src, tmp_path / "q", "--bits", "3")
    assert r.returncode == 0, r.stderr

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = nn.Module()
            self.self_attn.q_proj = nn.Linear(64, 64, bias=False)
            self.mlp = nn.Module()
            self.mlp.up_proj = nn.Linear(64, 128, bias=False)
            self.mlp.down_proj = nn.Linear(128, 64, bias=False)
            self.input_layernorm = nn.Module()
            self.input_layernorm.weight = nn.Parameter(torch.zeros(64))

    model = nn.Module()
    model.model = nn.Module()
    model.model.embed_tokens = nn.Embedding(64, 64)
    model.model.layers = nn.ModuleList([Layer()])
    model.lm_head = nn.Linear(64, 64, bias=False)
    load_quantized_(model, tmp_path / "q")
    up = model.model.layers[0].mlp.up_proj
    assert isinstance(up, QuantLinear) and up.bits == 3
    expected = quantize_tensor(tensors["model.layers.0.mlp.up_proj.weight"], QuantConfig("kmeans", 3)).dequantize()
    assert torch.equal(up.qweight.dequantize(), expected)
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])
    assert torch.equal(model.model.layers[0].input_layernorm.weight, tensors["model.layers.0.input_layernorm.weight"])

    with pytest.raises(HiltError, match="'model.layers.0.mlp.down_proj.weight' has no matching nn.Linear"):
        load_quantized_(Tiny(), tmp_path / "q")
    with pytest.raises(HiltError, match="no tensor name matches"):
        load_quantized_(nn.Sequential(nn.Linear(64, 64)), tmp_path / "q")


def test_quant_linear_keeps_its_byte_table_until_the_codebook_changes():
    from types import SimpleNamespace

    from hilt.kernels import byte_table

    layer = QuantLinear(quantize_tensor(torch.randn(8, 64), QuantConfig("kmeans", 2, 32)))
    on_gpu = SimpleNamespace(is_cuda=True)  # only the device matters to the table
    assert layer._byte_table(torch.zeros(1, 64), layer.packed) is None  # the CPU reference has no use for it
    first = layer._byte_table(on_gpu, layer.packed)
    assert layer._byte_table(on_gpu, layer.packed) is first and torch.equal(first, byte_table(layer.codebook, 2))
    with torch.no_grad():
        layer.codebook.mul_(2)  # e.g. a checkpoint loaded into the buffers
    assert torch.equal(layer._byte_table(on_gpu, layer.packed), 2 * first)
    per_block = QuantLinear(quantize_tensor(torch.randn(8, 64), QuantConfig("kmeans", 2, 32, codebook="block")))
    assert per_block._byte_table(on_gpu, per_block.packed) is None
    with torch.inference_mode():  # a model moved under inference_mode has codebooks without versions
        layer.codebook = layer.codebook.clone()
        assert torch.equal(layer._byte_table(on_gpu, layer.packed), 2 * first)
