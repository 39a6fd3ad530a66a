"""Logit bounds for attention whose q and k leave an RMSNorm (Gemma 3, Qwen3, OLMo2), and
`causal_lm`, the fp8 scales study on any transformers causal LM: reached exactly by a
constructed model, never exceeded on random ones (float32, bfloat16), against logits recomputed
by hand. Tiny models from transformers configs; nothing is downloaded."""

import math

import pytest
import torch

from hilt.errors import HiltError

tf = pytest.importorskip("transformers")

V = 64  # vocabulary


def _config(family: str, layers: int = 2, **extra):
    small = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if family == "gemma3":
        types = (["sliding_attention", "full_attention"] * layers)[:layers]
        extra = {"sliding_window": 6, **extra}
        return tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(**small, head_dim=16, layer_types=types,
                                                          query_pre_attn_scalar=24, **extra)
    if family == "qwen3":
        return tf.Qwen3ForCausalLM, tf.Qwen3Config(**small, head_dim=16, **extra)
    if family == "olmo2":  # one norm over the whole q (k) projection, no pre-attention norm
        return tf.Olmo2ForCausalLM, tf.Olmo2Config(**small, pad_token_id=0, eos_token_id=1, **extra)
    if family == "llama":
        return tf.LlamaForCausalLM, tf.LlamaConfig(**small, head_dim=16, **extra)
    if family == "qwen2":  # biases on q, k, v
        return tf.Qwen2ForCausalLM, tf.Qwen2Config(**small, **extra)
    raise AssertionError(family)


def _model(family: str, seed: int, dtype=torch.float32, layers: int = 2, **extra):
    """A tiny random model whose norms have uneven gains (Gemma stores gain - 1)."""
    cls, cfg = _config(family, layers, **extra)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if family == "gemma3" else 1.0, 0.6)
            elif p.dim() == 2:
                p.normal_(0, 0.3)
            else:
                p.normal_(0, 0.5)
    return model.to(dtype)


def _windows(seed: int, n: int = 3, length: int = 24):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (length,), generator=g) for _ in range(n)]


def _set_gain(norm, gain: torch.Tensor, gemma: bool):
    with torch.no_grad():
        norm.weight.copy_(gain - 1 if gemma else gain)


def test_effective_gain_of_each_family_norm_and_refusals():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from hilt.fp8.bounds import rms_norm_gain

    torch.manual_seed(0)
    for cls, offset in ((Gemma3RMSNorm, 1.0), (Qwen3RMSNorm, 0.0), (LlamaRMSNorm, 0.0), (Olmo2RMSNorm, 0.0)):
        norm = cls(16, eps=1e-2)  # a large eps: undoing it matters
        with torch.no_grad():
            norm.weight.uniform_(-2, 2)
        for dtype in (torch.float32, torch.bfloat16):
            norm = norm.to(dtype)
            want = offset + norm.weight.double()
            torch.testing.assert_close(rms_norm_gain(norm, "n"), want, rtol=2e-7, atol=2e-7)
    with pytest.raises(HiltError, match=r"layers\.3\.q_norm \(LayerNorm\): not an RMSNorm"):
        rms_norm_gain(torch.nn.LayerNorm(16), "layers.3.q_norm")
    with pytest.raises(HiltError, match="layers.1.k_norm .*no numeric eps"):
        rms_norm_gain(torch.nn.Linear(4, 4), "layers.1.k_norm")


def test_bound_arithmetic_pairs_and_groups():
    from hilt.fp8.bounds import qk_norm_logit_bounds

    d_h = 8
    gq = torch.ones(d_h)
    gk = torch.ones(d_h)
    gq[1], gk[5] = 3.0, 2.0  # q's and k's largest gains on the two coordinates of pair (1, 5)
    half = qk_norm_logit_bounds(gq, gk, 2, 1, d_h, scaling=0.5)
    assert half["bound"].tolist() == [0.5 * d_h * 6.0] * 2  # one RoPE pair joins them
    none = qk_norm_logit_bounds(gq, gk, 2, 1, d_h, scaling=0.5, rope=None)
    assert none["bound"].tolist() == [0.5 * d_h * 3.0] * 2  # without rotation they never meet
    part = qk_norm_logit_bounds(gq, gk, 2, 1, d_h, scaling=0.5, rotary_dim=4)  # pairs (0,2), (1,3); 4.. fixed
    assert part["bound"].tolist() == [0.5 * d_h * 3.0] * 2
    # OLMo2: one norm over all heads; head h has its own gains, group g its own, N = H d_h
    gq_all, gk_all = torch.ones(4 * d_h), torch.ones(2 * d_h)
    gq_all[2 * d_h] = 5.0  # head 2, coordinate 0
    whole = qk_norm_logit_bounds(gq_all, gk_all, 4, 2, d_h, scaling=1.0)
    reach = math.sqrt(4 * d_h * 2 * d_h)
    assert whole["bound"].tolist() == [reach, reach, 5 * reach, reach]
    assert whole["rank_aware"][0] <= whole["bound"][0] and whole["d"] == 4 * d_h  # alpha capped at 1
    with pytest.raises(HiltError, match="query norm: 12 gains"):
        qk_norm_logit_bounds(torch.ones(12), gk, 2, 1, d_h, 1.0)
    with pytest.raises(HiltError, match="even rotary dim"):
        qk_norm_logit_bounds(gq, gk, 2, 1, d_h, 1.0, rotary_dim=3)


def _one_hot_model(family: str, q_coord: int, k_coord: int, dtype=torch.float32):
    """One layer whose every query head (key head) is one-hot on q_coord (k_coord) for every token:
    W_Q, W_K read only hidden coordinate 0, which every embedding sets to 1. The q_norm and k_norm
    gains are largest there (3 and 2.5), the rest uneven in (-1, 1)."""
    cls, cfg = _config(family, 1)
    torch.manual_seed(3)
    model = cls(cfg).eval()
    att, d_h = model.model.layers[0].self_attn, 16
    gemma = family == "gemma3"
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0
        _set_gain(model.model.layers[0].input_layernorm, torch.ones(32), gemma)
        for proj, coord in ((att.q_proj, q_coord), (att.k_proj, k_coord)):
            proj.weight.zero_()
            proj.weight.view(-1, d_h, 32)[:, coord, 0] = 100.0
        gq, gk = torch.rand(d_h) * 2 - 1, torch.rand(d_h) * 2 - 1
        gq[q_coord], gk[k_coord] = 3.0, -2.5
        _set_gain(att.q_norm, gq, gemma)
        _set_gain(att.k_norm, gk, gemma)
    return model.to(dtype), gq, gk


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_bound_is_reached_when_q_and_k_sit_on_the_largest_gain(family):
    from hilt.bench.studies.fp8_scales import causal_lm

    model, gq, gk = _one_hot_model(family, 3, 3)
    row = causal_lm(model, [torch.arange(10)], family)[0]
    scaling = 24 ** -0.5 if family == "gemma3" else 16 ** -0.5
    assert row["kind"] == "qk_norm" and row["rope"] == "half"
    # the worst case by hand: scaling d_h max_p Gq_p Gk_p, here on pair (3, 11)
    pair_q = torch.maximum(gq.abs()[:8], gq.abs()[8:])
    pair_k = torch.maximum(gk.abs()[:8], gk.abs()[8:])
    want = scaling * 16 * float((pair_q * pair_k).max())
    assert want == pytest.approx(scaling * 16 * 7.5)
    assert row["bound"] == pytest.approx([want] * 4, rel=1e-6)
    # reached at i = j, to float32 rounding: a constant smaller by 1e-5 would be exceeded
    assert row["observed"] == pytest.approx(row["bound"], rel=1e-6)
    model16 = model.to(torch.bfloat16)  # bfloat16 q and k round within 2^-8 each
    row16 = causal_lm(model16, [torch.arange(10)], family)[0]
    assert row16["observed"] == pytest.approx(row["bound"], rel=2**-6)


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_rope_pairs_matter_a_per_coordinate_constant_is_exceeded(family):
    """q on coordinate 0, k on coordinate d_h/2: the same RoPE pair. Without RoPE the largest
    logit would be max_c |gq_c gk_c| (under half the bound here); RoPE's pair 0 turns one radian a
    token, so keys 11 tokens back carry q's coordinate almost onto k's: |sin 11| = 0.99999 of the
    bound (Gemma 3's first layer sees 5 tokens back at most, its sliding window: |sin 5| = 0.959)."""
    from hilt.bench.studies.fp8_scales import causal_lm

    model, gq, gk = _one_hot_model(family, 0, 8)
    row = causal_lm(model, [torch.arange(12)], family)[0]
    scaling = row["scaling"]
    per_coordinate = scaling * 16 * float((gq.abs() * gk.abs()).max())
    observed, bound = torch.tensor(row["observed"]), torch.tensor(row["bound"])
    assert (observed > 2 * per_coordinate).all() and not row["exceeded"]
    reach = 11 if row["sliding_window"] is None else row["sliding_window"] - 1
    best = max(abs(math.sin(t)) for t in range(reach + 1))
    assert observed.tolist() == pytest.approx((best * bound).tolist(), rel=1e-5)


@pytest.mark.parametrize("family, dtype", [("gemma3", torch.float32), ("gemma3", torch.bfloat16),
                                           ("qwen3", torch.float32), ("qwen3", torch.bfloat16),
                                           ("olmo2", torch.float32)])
def test_random_models_never_exceed_the_bound(family, dtype):
    from hilt.bench.studies.fp8_scales import causal_lm

    rows = causal_lm(_model(family, 5, dtype), _windows(6), family)
    assert len(rows) == 2 and all(r["kind"] == "qk_norm" and len(r["bound"]) == 4 for r in rows)
    for r in rows:
        assert not r["exceeded"] and 0 < r["max_observed_over_bound"] < 1
        assert all(b <= p + 1e-9 for b, p in zip(r["bound"], r["product_bound"]))


def test_prediction_covers_random_query_directions_against_worst_keys():
    """The one-sided prediction: queries in uniformly random directions, keys all on the largest
    gain; over n^2 pairs at every RoPE offset, never above it at delta 1e-3, and not vacuous."""
    from hilt.fp8.bounds import qk_norm_logit_bounds

    torch.manual_seed(7)
    d_h, n = 64, 300
    gq, gk = torch.rand(d_h, dtype=torch.float64) + 0.5, torch.rand(d_h, dtype=torch.float64) + 0.5
    gq[5], gk[5] = 3.0, 3.0
    b = qk_norm_logit_bounds(gq, gk, 1, 1, d_h, scaling=d_h ** -0.5, n_tokens=n, delta=1e-3)
    z_q = torch.nn.functional.normalize(torch.randn(n, d_h, dtype=torch.float64), dim=1) * math.sqrt(d_h)
    z_k = torch.zeros(n, d_h, dtype=torch.float64)
    z_k[:, 5] = math.sqrt(d_h)
    inv_freq = 10000.0 ** (-torch.arange(0, d_h, 2, dtype=torch.float64) / d_h)
    angle = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq
    cos, sin = torch.cat([angle.cos()] * 2, 1), torch.cat([angle.sin()] * 2, 1)

    def rope(x):
        return x * cos + torch.cat([-x[:, d_h // 2:], x[:, :d_h // 2]], 1) * sin

    logits = (rope(gq * z_q) @ rope(gk * z_k).T).abs() * d_h ** -0.5
    assert float(logits.max()) <= float(b["rank_aware"][0]) < float(b["bound"][0])
    assert float(logits.max()) > float(b["rank_aware"][0]) / 4


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])  # boolean and additive masks
def test_recorded_logits_match_a_hand_computation_with_a_sliding_window(implementation):
    """The hook's observed max per head against q and k rebuilt from the layer's weights, with
    Gemma 3's sliding window (6) shorter than the window of 24 tokens."""
    from transformers.models.gemma3.modeling_gemma3 import apply_rotary_pos_emb

    from hilt.bench.studies.fp8_scales import _logit_recorder
    from hilt.fp8.attention import hf_attention

    model = _model("gemma3", 8)
    model.set_attn_implementation(implementation)
    ids = _windows(9, 1)[0]
    inputs = {}
    att = model.model.layers[0].self_attn
    hook = att.register_forward_pre_hook(lambda m, a, kw: inputs.update(kw), with_kwargs=True)
    store = {}
    with torch.no_grad(), hf_attention(model, _logit_recorder(store)):
        out = model(ids[None]).logits
    hook.remove()
    assert model.config._attn_implementation == implementation  # restored
    torch.testing.assert_close(out, model(ids[None]).logits.detach())  # the hook does not change the outputs
    with torch.no_grad():
        x = inputs["hidden_states"]
        q = att.q_norm(att.q_proj(x).view(1, 24, 4, 16).transpose(1, 2))
        k = att.k_norm(att.k_proj(x).view(1, 24, 2, 16).transpose(1, 2))
        q, k = apply_rotary_pos_emb(q, k, *inputs["position_embeddings"])
        s = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)).abs() * att.scaling
    i, j = torch.arange(24)[:, None], torch.arange(24)[None]
    allowed = (j <= i) & (j > i - 6)
    want = s.masked_fill(~allowed, 0).amax(dim=(0, 2, 3))
    torch.testing.assert_close(store[att], want, rtol=1e-5, atol=1e-6)
    assert (s.masked_fill(allowed, 0).amax(dim=(0, 2, 3)) > want).any()  # the window mattered


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen2"])
def test_causal_lm_rows_one_per_layer_and_head(family):
    from hilt.bench.studies.fp8_scales import causal_lm

    model = _model(family, 11)
    rows = causal_lm(model, _windows(12), family)
    kind = "qk_norm" if family == "gemma3" else "projection"
    assert [r["layer"] for r in rows] == [0, 1] and all(r["kind"] == kind for r in rows)
    assert all(len(r["bound"]) == len(r["observed"]) == len(r["scale"]) == 4 for r in rows)
    assert all(r["name"] == f"model.layers.{r['layer']}.self_attn" for r in rows)
    assert not any(r["exceeded"] for r in rows) and all(r["max_observed_over_bound"] > 0 for r in rows)
    if family == "qwen2":  # the biases widen the bound: [W | b] on the input [x; 1]
        from hilt.fp8.attention import hf_attention_layers

        layer = hf_attention_layers(model, _windows(12)[0])[0]
        assert layer.b_q is not None and layer.scaling == pytest.approx(8 ** -0.5)
        without = layer.logit_bounds(24)
        layer.b_q = layer.b_k = None
        assert (without["bound"] > layer.logit_bounds(24)["bound"]).all()


def test_logit_bounds_scaling_and_a_layer_it_cannot_bound():
    from hilt.bench.studies.fp8_scales import causal_lm
    from hilt.fp8.bounds import logit_bounds

    torch.manual_seed(0)
    w_q, w_k = torch.randn(32, 16), torch.randn(16, 16)
    plain = logit_bounds(w_q, w_k, 4, 2, 3.0, rope=True)
    double = logit_bounds(w_q, w_k, 4, 2, 3.0, rope=True, scaling=2 / math.sqrt(8))
    torch.testing.assert_close(double["bound"], 2 * plain["bound"])
    cfg = tf.GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=4, n_positions=32)
    gpt2 = tf.GPT2LMHeadModel(cfg).eval()  # one fused c_attn projection
    with pytest.raises(HiltError, match=r"transformer\.h\.0\.attn: no q_norm/k_norm and no q_proj/k_proj"):
        causal_lm(gpt2, _windows(0, 1), "gpt2")


@pytest.mark.parametrize("scales", ["current", "geometry"])
def test_fp8_attention_on_a_transformers_gemma3(scales):
    """Every layer through FP8Attention (Gemma 3's scaling 24^-1/2, not 16^-1/2): next-token
    logits close to float32's, never NaN; Q and K split in two E4M3 terms with V kept 16-bit
    come within 1e-2 of them, which a wrong logit scaling would not."""
    from hilt.fp8.attention import use_fp8_attention_hf

    model = _model("gemma3", 13, sliding_window=32)
    ids = _windows(14, 2, 20)
    batch = torch.stack(ids)
    with torch.no_grad():
        want = model(batch).logits
        use_fp8_attention_hf(model, scales)
        got = model(batch).logits
        model.set_attn_implementation("sdpa")
        use_fp8_attention_hf(model, scales, v_fp8=False, split_qk=True)
        split = model(batch).logits
    assert torch.isfinite(got).all() and torch.isfinite(split).all()
    cosine = torch.nn.functional.cosine_similarity(got.flatten(1), want.flatten(1))
    assert (cosine > 0.99).all()
    assert float((split - want).abs().max() / want.abs().max()) < 1e-2
    assert float((got - want).abs().max() / want.abs().max()) > float((split - want).abs().max() / want.abs().max())
    with torch.no_grad(), pytest.raises(HiltError, match=r"model\.layers\.0\.self_attn: .*sliding window of 32"):
        model(torch.zeros(1, 40, dtype=torch.long))  # longer than the window
