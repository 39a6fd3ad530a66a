"""llama.cpp reads hilt's GGUF exports: its tokenizer gives hilt's token ids, llama-perplexity gives hilt's
number for the same statistic, and its greedy text starts as hilt's. Needs the tools that
scripts/build_llama_cpp.sh builds (scripts/test.sh runs it); skips without them. The full matrix
of formats is bench/studies/exports.py."""

import json

import pytest

from hilt.quant import QuantConfig, quantize_checkpoint
from hilt.quant.gguf_export import export_gguf
from hilt.tasks import llama_cpp

pytestmark = pytest.mark.skipif(bool(llama_cpp.missing_tools()),
                                reason=f"llama.cpp tools not built (run scripts/build_llama_cpp.sh; looked in "
                                       f"{llama_cpp.tools_dir()})")


def test_llama_cpp_reads_an_int4_export_of_smollm2(smollm2_gguf, tmp_path):
    from hilt.data.text import shakespeare_text

    q = tmp_path / "q"
    # the first two blocks in int4 and the embedding in 8 bits: Q4_0 and Q8_0 blocks, the rest as stored
    quantize_checkpoint(smollm2_gguf, q, QuantConfig("int", 4, 64), only=r"^blk\.[01]\.", embeddings=8)
    out = tmp_path / "q.gguf"
    types = export_gguf(q, out)["types"]
    assert types["Q4_0"] == 14 and types["Q8_0"] == 1
    text = shakespeare_text("hamlet")[:6000]
    r = llama_cpp.check_gguf(out, text, context=128, chunks=2, new_tokens=8)
    assert r["tokens_identical"] and r["tokens_hilt"] > 1000
    assert abs(r["ppl_rel_diff"]) < 0.01, r
    assert r["generated_tokens_agreeing"] >= 4, r  # llama.cpp's dot products round activations to 8 bits


def test_llama_cpp_reads_an_export_from_a_hugging_face_folder(tmp_path):
    """A tiny Llama with a byte-level BPE vocabulary, as a Hugging Face folder: the GGUF built from its config
    and tokenizer loads in llama.cpp, which tokenizes and scores text as hilt does."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    import torch

    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("o", "u")]
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))} | {a + b: 256 + i for i, (a, b) in enumerate(merges)}
    config = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    src = tmp_path / "src"
    transformers.LlamaForCausalLM(config).save_pretrained(src)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps({"bos_token": "!", "eos_token": "."}))
    q = tmp_path / "q"
    quantize_checkpoint(src, q, QuantConfig("int", 4, 32))
    out = tmp_path / "q.gguf"
    assert export_gguf(q, out)["types"]["Q4_0"] == 14
    text = "Who's there? Nay, answer me: stand, and unfold yourself. The other is out. " * 12
    r = llama_cpp.check_gguf(out, text, context=64, chunks=2, new_tokens=4)
    assert r["tokens_identical"] and r["tokens_hilt"] < len(text)  # the merges were applied
    assert abs(r["ppl_rel_diff"]) < 0.01, r
