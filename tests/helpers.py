"""What several test modules share (imported as ``from helpers import ...``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file


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


def run_hilt(*args, cwd=None, timeout=300):
    """Run the real command line in a subprocess, as a user would (the commands choose Triton's
    interpreter themselves where they need it); returns CompletedProcess."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONWARNINGS"] = "ignore"
    return subprocess.run([sys.executable, "-m", "hilt", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env=env)


def read_json(path) -> dict:
    return json.loads(Path(path).read_text())


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Where a module imports it: hilt's side on one thread, as llama.cpp's tools run: correctness checks,
    and on shared cores a second thread mostly waits (a 64-token forward took 1.9 s on two busy cores, 0.55 s
    on one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
