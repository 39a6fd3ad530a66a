"""The plain-PyTorch models in hilt.models: SmolLM2 (llama), all-MiniLM-L6-v2 (BERT), text.

Real-model checks compare with outside references: SmolLM2's known answer
(" Paris"), its known perplexity range on Hamlet, and the similarities that the
sentence-transformers README publishes for all-MiniLM-L6-v2. The llama forward is
also compared with a per-head reference written here on a tiny random config.
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from hilt.models.bert import embed, embedding_similarity, load_minilm, minilm_path
from hilt.models.llama import Llama, LlamaConfig, generate, load_llama, perplexity, smollm2_path
from hilt.data.text import available_works, sentences, shakespeare_text
from hilt.errors import HiltError
from hilt.quant.checkpoint import open_source

# ------------------------------------------------------------------------------ text


def test_shakespeare_text_and_unknown_work():
    text = shakespeare_text("hamlet")
    assert "To be, or not to be" in text
    assert "hamlet" in available_works() and "macbeth" in available_works()
    with pytest.raises(HiltError, match="hamlett.*available:.*hamlet"):
        shakespeare_text("hamlett")


def test_sentences_are_real_deterministic_and_sized():
    s = sentences(64)
    assert s == sentences(64) and len(s) == 64 and len(set(s)) == 64
    text = " ".join(shakespeare_text("hamlet").split())
    for x in s:
        assert 6 <= len(x.split()) <= 40
        assert "[" not in x
    # Short sentences lie on one line of the play: they must be found verbatim.
    one_line = [x for x in s if len(x.split()) <= 8]
    assert one_line and all(x in text for x in one_line)


# ------------------------------------------------------------- llama, tiny reference


def _tiny_cfg():
    return LlamaConfig(vocab_size=61, dim=48, n_layers=2, n_heads=6, n_kv_heads=2,
                       ffn_dim=80, rope_base=10000.0, norm_eps=1e-5, max_seq_len=64)


def _reference_llama(model: Llama, tokens: torch.Tensor) -> torch.Tensor:
    """Per-head, per-position Llama forward written independently of hilt.models.llama:
    complex-number RoPE on adjacent pairs, explicit causal mask and softmax."""
    cfg = model.cfg
    hd, group = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
    T = tokens.shape[0]

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * w

    def rope(x):  # x [T, hd]; pair (2i, 2i+1) is one complex number, rotated by pos * theta_i
        theta = cfg.rope_base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        rot = torch.polar(torch.ones(T, hd // 2, dtype=torch.float64),
                          torch.arange(T, dtype=torch.float64)[:, None] * theta)
        z = torch.view_as_complex(x.double().reshape(T, hd // 2, 2).contiguous()) * rot
        return torch.view_as_real(z).reshape(T, hd)

    sd = {k: v.double() for k, v in model.state_dict().items()}
    x = sd["token_embd.weight"][tokens]
    mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        h = rms(x, sd[p + "attn_norm.weight"])
        q, k, v = h @ sd[p + "attn_q.weight"].T, h @ sd[p + "attn_k.weight"].T, h @ sd[p + "attn_v.weight"].T
        heads = []
        for j in range(cfg.n_heads):
            kv = j // group  # query heads 0..group-1 share kv head 0, and so on
            qj = rope(q[:, j * hd:(j + 1) * hd])
            kj = rope(k[:, kv * hd:(kv + 1) * hd])
            vj = v[:, kv * hd:(kv + 1) * hd]
            att = torch.softmax(qj @ kj.T / math.sqrt(hd) + mask, dim=-1)
            heads.append(att @ vj)
        x = x + torch.cat(heads, dim=-1) @ sd[p + "attn_output.weight"].T
        h = rms(x, sd[p + "ffn_norm.weight"])
        gate, up = h @ sd[p + "ffn_gate.weight"].T, h @ sd[p + "ffn_up.weight"].T
        x = x + (F.silu(gate) * up) @ sd[p + "ffn_down.weight"].T
    return rms(x, sd["output_norm.weight"]) @ sd["token_embd.weight"].T


@pytest.fixture(scope="module")
def tiny_llama():
    torch.manual_seed(0)
    model = Llama(_tiny_cfg()).eval()
    with torch.no_grad():  # non-trivial norm weights so that they are exercised too
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def test_llama_forward_matches_per_head_reference(tiny_llama):
    tokens = torch.randint(0, 61, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = tiny_llama(tokens)
    for b in range(2):
        want = _reference_llama(tiny_llama, tokens[b])
        torch.testing.assert_close(got[b].double(), want, rtol=1e-4, atol=1e-4)


def test_llama_runs_in_bfloat16_with_a_cache(tiny_llama):
    """A bfloat16 model stays bfloat16 (the rotary tables follow the activations' dtype: float32 ones
    made queries float32 beside bfloat16 values, which attention refuses) and decodes as float32 does."""
    model = copy.deepcopy(tiny_llama).to(torch.bfloat16)
    tokens = torch.randint(0, 61, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        whole = model(tokens)
        cache = model.new_cache()
        steps = torch.cat([model(tokens[:, :5], cache)] + [model(tokens[:, t:t + 1], cache) for t in range(5, 9)], 1)
        want = tiny_llama(tokens)
    assert whole.dtype == steps.dtype == torch.bfloat16

    def rel(a, b):  # bfloat16 rounds each value by up to 2^-9: a few times that through two blocks
        return float((a.float() - b.float()).norm() / b.float().norm())

    assert rel(steps, whole) < 0.02 and rel(whole, want) < 0.02


def test_adjacent_pair_rope_on_gguf_rows_equals_half_rope_on_hf_rows():
    """llama.cpp stores Q/K rows of each head in the order [0, d/2, 1, d/2+1, ...] of the
    Hugging Face rows; rotating adjacent pairs on those equals rotate-half on the HF ones,
    so attention scores agree. This is why the stored weights can be used unchanged."""
    from hilt.models.llama import apply_rope, rope_cos_sin

    cfg = _tiny_cfg()
    hd, T = cfg.head_dim, 9
    g = torch.Generator().manual_seed(2)
    q_hf, k_hf = torch.randn(T, hd, generator=g), torch.randn(T, hd, generator=g)
    order = torch.arange(hd).view(2, hd // 2).T.flatten()  # 0, d/2, 1, d/2+1, ...
    cos, sin = rope_cos_sin(cfg, T)
    scores_gguf = apply_rope(q_hf[:, order], cos, sin) @ apply_rope(k_hf[:, order], cos, sin).T

    def rope_half(x):
        c, s = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        x1, x2 = x[:, : hd // 2], x[:, hd // 2:]
        return x * c + torch.cat([-x2, x1], -1) * s

    torch.testing.assert_close(scores_gguf, rope_half(q_hf) @ rope_half(k_hf).T, rtol=1e-5, atol=1e-5)


def test_perplexity_windows_match_manual_nll(tiny_llama):
    ids = torch.randint(0, 61, (11,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        nll, n = 0.0, 0
        for w in (ids[0:4], ids[4:8], ids[8:11]):  # non-overlapping windows of 4
            logp = torch.log_softmax(tiny_llama(w[None])[0].double(), -1)
            nll -= logp[torch.arange(len(w) - 1), w[1:]].sum().item()
            n += len(w) - 1
    assert perplexity(tiny_llama, ids, context=4) == pytest.approx(math.exp(nll / n), rel=1e-5)
    with pytest.raises(HiltError):
        perplexity(tiny_llama, ids[:1], context=4)


# ------------------------------------------------------------------ SmolLM2 (real)


@pytest.fixture(scope="module")
def smollm2():
    return load_llama()


def test_llama_state_dict_keys_are_the_gguf_names(smollm2):
    model, _ = smollm2
    with open_source(smollm2_path()) as src:
        names = set(src.names())
    assert set(model.state_dict()) == names
    assert model.blk[0].attn_k.weight.shape == (192, 576)  # 3 kv heads of 64
    assert isinstance(model.blk[29].ffn_down, torch.nn.Linear)


def test_gguf_tokenizer_round_trips_and_splits_sensibly(smollm2):
    _, tok = smollm2
    for text in ["The capital of France is", "  two spaces,\ttabs\nand newlines\n\n",
                 "Ophelia’s “quotes” — naïve café, 日本語", "<|im_start|>user\nhi<|im_end|>", "x = 12345"]:
        assert tok.decode(tok.encode(text)) == text
    # Common words are single tokens carrying their leading space (byte-level "Ġ").
    assert tok.encode(" Paris") == [tok.token_to_id("ĠParis")]
    assert len(tok.encode("The capital of France is")) == 5
    # llama.cpp's "smollm" pre-tokenizer splits numbers into single digits.
    assert [tok.decode([i]) for i in tok.encode("2024")] == ["2", "0", "2", "4"]
    # Control tokens are matched whole.
    assert tok.encode("<|im_start|>") == [1]


def test_smollm2_knows_the_capital_of_france(smollm2):
    model, tok = smollm2
    assert "Paris" in generate(model, tok, "The capital of France is", max_new_tokens=4)


def test_smollm2_key_value_cache_gives_the_same_logits_and_tokens(smollm2):
    model, tok = smollm2
    ids = torch.tensor([tok.encode("To be, or not to be, that is the question")])
    with torch.inference_mode():
        full = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, :5], cache)] + [model(ids[:, i:i + 1], cache) for i in range(5, 8)]
        steps.append(model(ids[:, 8:], cache))  # several new positions after a cache
    assert cache[0][0].shape[2] == ids.shape[1]
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-3, rtol=1e-4)
    prompt = "The capital of France is"
    assert generate(model, tok, prompt, max_new_tokens=12) == generate(model, tok, prompt, 12, cache=False)


def test_smollm2_perplexity_on_hamlet_slice(smollm2):
    model, tok = smollm2
    # Past the cast list (a list of names is unusually easy), into Act I's dialogue.
    ids = torch.tensor(tok.encode(shakespeare_text("hamlet")))[2048:2560]
    ppl = perplexity(model, ids, context=512)
    assert 20 < ppl < 200
    # A model that has learnt nothing would be near the vocabulary size.
    assert ppl < model.cfg.vocab_size / 100


def test_llama_config_from_gguf():
    cfg = LlamaConfig.from_gguf(smollm2_path())
    # SmolLM2-135M as published: 30 layers, hidden 576, 9 query / 3 kv heads of 64.
    assert (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert (cfg.ffn_dim, cfg.vocab_size, cfg.rope_base) == (1536, 49152, 100000.0)
    assert cfg.norm_eps == pytest.approx(1e-5)


def test_load_llama_errors_name_the_file(tmp_path):
    with pytest.raises(HiltError, match="nope.gguf"):
        load_llama(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(HiltError, match="bad.gguf"):
        load_llama(bad)


def test_load_llama_rejects_unknown_tensor_names():
    with pytest.raises(HiltError, match="model.layers.0"):
        load_llama(tensors={"model.layers.0.self_attn.q_proj.weight": torch.zeros(576, 576)})


# --------------------------------------------------------------- MiniLM (real BERT)


@pytest.fixture(scope="module")
def minilm():
    return load_minilm()


def test_bert_state_dict_keys_are_the_safetensors_names(minilm):
    model, _ = minilm
    with open_source(minilm_path()) as src:
        names = set(src.names())
    keys = set(model.state_dict())
    assert keys <= names
    assert {n for n in names - keys if not n.startswith("pooler.")} == {"embeddings.position_ids"}
    assert "encoder.layer.5.attention.self.query.weight" in keys


def test_minilm_matches_published_similarities(minilm):
    """Numbers from the sentence-transformers README for all-MiniLM-L6-v2."""
    model, tok = minilm
    e = embed(model, tok, ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."])
    torch.testing.assert_close(e.norm(dim=1), torch.ones(3))
    sim = e @ e.T
    assert sim[0, 1].item() == pytest.approx(0.6660, abs=1e-3)
    assert sim[0, 2].item() == pytest.approx(0.1046, abs=1e-3)
    assert sim[1, 2].item() == pytest.approx(0.1411, abs=1e-3)


def test_minilm_paraphrase_beats_unrelated_and_padding_is_masked(minilm):
    model, tok = minilm
    s = ["A man is playing a guitar.", "Someone is strumming a guitar.",
         "The stock market fell sharply today.",
         "A long sentence about something else entirely, with many more words in it than the others have."]
    e = embed(model, tok, s, batch_size=4)  # the short ones are padded in this batch
    assert e[0] @ e[1] > 0.5 > e[0] @ e[2] + 0.3
    alone = embed(model, tok, s[:1], batch_size=1)  # no padding at all
    torch.testing.assert_close(e[0], alone[0], rtol=0, atol=1e-5)


def test_embedding_similarity():
    x = F.normalize(torch.randn(5, 8, generator=torch.Generator().manual_seed(4)), dim=-1)
    assert embedding_similarity(x, x) == pytest.approx(1.0, abs=1e-12)
    assert embedding_similarity(x, -x) == pytest.approx(-1.0, abs=1e-12)
    with pytest.raises(HiltError):
        embedding_similarity(x, x[:3])


def test_minilm_runs_with_quantized_embedding_tables():
    """Every embedding table quantized (as `hilt quantize --embeddings 8` writes them): the forward
    looks rows up through QuantEmbedding, and equals the model with the dequantized tables."""
    from hilt.quant import QuantConfig
    from hilt.quant.nn import QuantEmbedding
    from hilt.quant.quantize import quantize_tensor

    model, tok = load_minilm()
    dense, _ = load_minilm()
    e, d = model.embeddings, dense.embeddings
    for name in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
        q = quantize_tensor(getattr(e, name).weight.detach(), QuantConfig("int", 8, 64), name=name)
        setattr(e, name, QuantEmbedding(q))
        getattr(d, name).weight.data = q.dequantize().float()
    text = ["The weather is lovely today.", "He drove to the stadium."]
    torch.testing.assert_close(embed(model, tok, text), embed(dense, tok, text))
