import torch
from safetensors.torch import save_file
from torch import nn

from hilt.tasks.calibrate import collect_importance
from helpers import read_json, run_hilt


def test_importance_is_mean_squared_input_per_column():
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    xs = [torch.randn(5, 3, 8, generator=g) for _ in range(3)]
    imp = collect_importance(model, [(x,) for x in xs])
    allx = torch.cat([x.reshape(-1, 8) for x in xs])
    assert torch.allclose(imp["0.weight"], (allx**2).mean(0))
    hidden = torch.relu(model[0](allx))
    assert torch.allclose(imp["2.weight"], (hidden**2).mean(0), atol=1e-6)
    assert not model[0]._forward_hooks  # hooks removed


def test_calibrated_quantization_of_minilm(minilm_dir, tmp_path):
    imp = tmp_path / "imp.safetensors"
    r = run_hilt("calibrate", "minilm", "--out", imp, "--sentences", "32")
    assert r.returncode == 0, r.stderr
    r = run_hilt("quantize", minilm_dir, tmp_path / "q", "--bits", "2", "--importance", imp, "--quiet",
                 "--only", r"encoder\.layer\.0\.|pooler")
    assert r.returncode == 0, r.stderr
    header = read_json(tmp_path / "q" / "hilt.json")
    entries = header["tensors"]
    assert entries["encoder.layer.0.attention.self.query.weight"]["importance_weighted"] is True
    assert entries["pooler.dense.weight"]["importance_weighted"] is False  # unused by the forward: no importance
    # calibrating again into the same file needs --overwrite
    r = run_hilt("calibrate", "minilm", "--out", imp, "--sentences", "32")
    assert r.returncode == 1 and "--overwrite" in r.stderr


def test_importance_errors(minilm_dir, tmp_path):
    bad = tmp_path / "bad.safetensors"
    save_file({"encoder.layer.0.attention.self.query.weight": torch.ones(7)}, str(bad))
    r = run_hilt("quantize", minilm_dir, tmp_path / "q", "--importance", bad)
    assert r.returncode == 1 and "encoder.layer.0.attention.self.query.weight" in r.stderr
    assert "does not match" in r.stderr and not (tmp_path / "q").exists()
    other = tmp_path / "other.safetensors"
    save_file({"some.other.weight": torch.ones(384)}, str(other))
    r = run_hilt("quantize", minilm_dir, tmp_path / "q", "--importance", other)
    assert r.returncode == 1 and "another model" in r.stderr
    r = run_hilt("quantize", minilm_dir, tmp_path / "q", "--method", "int", "--importance", other)
    assert r.returncode == 1 and "kmeans only" in r.stderr
    negative = tmp_path / "neg.safetensors"
    save_file({"encoder.layer.0.attention.self.query.weight": -torch.ones(384)}, str(negative))
    r = run_hilt("quantize", minilm_dir, tmp_path / "q", "--importance", negative)
    assert r.returncode == 1 and "non-negative" in r.stderr
