"""`hilt export compressed-tensors`: hilt's int checkpoints as the pack-quantized folders vLLM reads,
loaded back by transformers through compressed-tensors; what the format cannot hold refused."""

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

import hilt  # noqa: E402,F401  (registers hilt's quantizer with transformers)
from hilt.errors import HiltError  # noqa: E402
from hilt.quant import QuantConfig, quantize_checkpoint  # noqa: E402
from hilt.quant.ct_export import export_compressed_tensors  # noqa: E402

from test_hf import hilt, load_hf, tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("ct") / "src")


def _logits(folder, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(ids).logits


@pytest.mark.parametrize("config,embeddings,tol", [(QuantConfig("int", 4, 32), None, 1e-5),
                                                   (QuantConfig("int", 8, 64), None, 1e-5),
                                                   (QuantConfig("int", 4, 32), 8, 8e-3)])  # table in bf16
def test_transformers_reads_the_same_model(src, tmp_path, config, embeddings, tol):
    from compressed_tensors.quantization import QuantizationConfig

    q = tmp_path / "q"
    quantize_checkpoint(src, q, config, embeddings=embeddings)
    out = tmp_path / "ct"
    r = export_compressed_tensors(q, out)
    assert r["quantized_modules"] == 14 and r["ignore"] == ["lm_head"]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)  # the package's own schema
    weights = parsed.config_groups["group_0"].weights
    assert (qc["quant_method"], qc["format"], weights.num_bits, weights.group_size, weights.symmetric) == \
        ("compressed-tensors", "pack-quantized", config.bits, config.block_size, True)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        packed = f.get_tensor("model.layers.0.mlp.down_proj.weight_packed")
        assert packed.dtype == torch.int32 and packed.shape == (64, 128 * config.bits // 32)
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight_shape").tolist() == [64, 128]
        assert "model.layers.0.mlp.down_proj.weight" not in f.keys()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    theirs = _logits(out, ids)
    with torch.inference_mode():
        ours = load_hf(q)(ids).logits
    assert torch.isfinite(theirs).all()
    assert float((theirs - ours).abs().max() / ours.abs().max()) <= tol


def test_what_the_format_cannot_hold_is_refused(src, tmp_path, capsys):
    for config, msg in ((QuantConfig("kmeans", 4, 32), "kmeans has no such grid"),
                        (QuantConfig("binary", 1, 32), "binary has no such grid"),
                        (QuantConfig("int-asym", 4, 32), "not whole numbers of steps")):
        q = tmp_path / f"q-{config.method}"
        quantize_checkpoint(src, q, config)
        with pytest.raises(HiltError, match=msg):
            export_compressed_tensors(q, tmp_path / "x")
        assert not (tmp_path / "x").exists() and not (tmp_path / "x.partial").exists()
    q = tmp_path / "ok"
    quantize_checkpoint(src, q, QuantConfig("int", 4, 32))
    code, err = hilt(capsys, "export", "compressed-tensors", q, tmp_path / "ok-ct")
    assert code == 0, err
    code, err = hilt(capsys, "export", "compressed-tensors", q, tmp_path / "ok-ct")
    assert code == 1 and "already exists" in err and len(err.strip().splitlines()) == 1
    code, err = hilt(capsys, "export", "compressed-tensors", tmp_path / "q-kmeans", tmp_path / "k")
    assert code == 1 and "kmeans" in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "k").exists()
    if os.geteuid() == 0:  # root writes anywhere: the read-only case cannot be made
        return
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o500)
    try:
        code, err = hilt(capsys, "export", "compressed-tensors", q, tmp_path / "ro" / "ct")
        assert code == 1 and "not writable" in err and len(err.strip().splitlines()) == 1
    finally:
        (tmp_path / "ro").chmod(0o700)
