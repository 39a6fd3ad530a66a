"""`hilt fp8 scales`: per layer and head, the weight-only logit bound (fp8/bounds.py) against the
largest |logit| observed on real text, for all-MiniLM-L6-v2 and SmolLM2-135M, or for another
checkpoint of either family: a llama GGUF file (text: Hamlet, with the file's tokenizer) or a
BERT directory with config.json, tokenizer.json and model.safetensors (text: English sentences).
`causal_lm` does the same for any causal LM transformers loads (Llama, Qwen2, Gemma 3, Qwen3,
OLMo2, ...): logits seen through transformers' attention hook, bounds from q/k norm gains where
the layer has them (fp8.bounds.qk_norm_logit_bounds), else from W_Q, W_K and the input norm."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from hilt.fp8.bounds import burn_in_gamma, logit_bounds, norm_radius, tail_alpha
from hilt.fp8.recipes import E4M3_MAX
from hilt.errors import HiltError
from hilt.progress import LOG


def _capture(modules: dict[str, torch.nn.Module]):
    """Forward hooks that keep each module's latest output under its name."""
    seen, hooks = {}, []
    for name, m in modules.items():
        hooks.append(m.register_forward_hook(lambda mod, inp, out, name=name: seen.__setitem__(name, out.detach())))
    return seen, hooks


def _max_logits(q, k, n_heads, n_kv, mask) -> torch.Tensor:
    """q (B, T, H*d_h), k (B, T, G*d_h), mask (B, T, T) bool -> per-head max |q.k| / sqrt(d_h) over allowed pairs."""
    b, t, _ = q.shape
    d_h = q.shape[-1] // n_heads
    qh = q.view(b, t, n_heads, d_h).transpose(1, 2)
    kh = k.view(b, t, n_kv, d_h).transpose(1, 2).repeat_interleave(n_heads // n_kv, dim=1)
    s = (qh @ kh.transpose(-1, -2)).abs() / math.sqrt(d_h)
    return s.masked_fill(~mask[:, None], 0).amax(dim=(0, 2, 3))


@torch.inference_mode()
def minilm(sentences: int = 128, path=None) -> list[dict]:
    from hilt.models.bert import load_minilm
    from hilt.data.text import sentences as real_sentences

    model, tokenizer = load_minilm(path)
    cfg, layers = model.cfg, model.encoder.layer
    mods = {}
    for i, layer in enumerate(layers):
        mods[f"{i}.q"], mods[f"{i}.k"] = layer.attention["self"].query, layer.attention["self"].key
    seen, hooks = _capture(mods)
    observed, longest = [], 0
    try:
        text = real_sentences(sentences)
        for start in range(0, len(text), 32):
            encs = tokenizer.encode_batch(text[start:start + 32])
            ids = torch.tensor([e.ids for e in encs])
            mask = torch.tensor([e.attention_mask for e in encs]).bool()
            model(ids, mask.long())
            pairs = mask[:, :, None] & mask[:, None, :]
            heads, longest = cfg.num_attention_heads, max(longest, ids.shape[1])
            observed.append(torch.stack([_max_logits(seen[f"{i}.q"], seen[f"{i}.k"], heads, heads, pairs)
                                         for i in range(len(layers))]))
    finally:
        for h in hooks:
            h.remove()
    rows = []
    for i, layer in enumerate(layers):
        norm = model.embeddings.LayerNorm if i == 0 else layers[i - 1].output.LayerNorm  # post-norm BERT
        att = layer.attention["self"]
        b = logit_bounds(att.query.weight, att.key.weight, cfg.num_attention_heads, cfg.num_attention_heads,
                         norm_radius(norm.weight, norm.bias), att.query.bias.double(), att.key.bias.double(),
                         n_tokens=longest)
        rows.append(_row("minilm", i, b, observed, d=att.query.weight.shape[1] + 1))
    return rows


@torch.inference_mode()
def smollm2(tokens: int = 1024, context: int = 256, path=None) -> list[dict]:
    from hilt.models.llama import apply_rope, load_llama, rope_cos_sin
    from hilt.data.text import shakespeare_text

    model, tokenizer = load_llama(path)
    cfg = model.cfg
    mods = {}
    for i, blk in enumerate(model.blk):
        mods[f"{i}.q"], mods[f"{i}.k"] = blk.attn_q, blk.attn_k
    seen, hooks = _capture(mods)
    observed = []
    ids = torch.tensor(tokenizer.encode(shakespeare_text("hamlet"))[:tokens])
    if len(ids) < context:
        raise HiltError(f"the text has only {len(ids)} tokens, fewer than one context of {context}")
    windows = ids[: len(ids) // context * context].view(-1, context)
    cos, sin = rope_cos_sin(cfg, context)
    causal = torch.ones(context, context, dtype=torch.bool).tril()[None]
    try:
        for w in windows:
            model(w[None])
            per_layer = []
            for i in range(cfg.n_layers):
                q = apply_rope(seen[f"{i}.q"].view(1, context, cfg.n_heads, -1).transpose(1, 2), cos, sin)
                k = apply_rope(seen[f"{i}.k"].view(1, context, cfg.n_kv_heads, -1).transpose(1, 2), cos, sin)
                q, k = q.transpose(1, 2).reshape(1, context, -1), k.transpose(1, 2).reshape(1, context, -1)
                per_layer.append(_max_logits(q, k, cfg.n_heads, cfg.n_kv_heads, causal))
            observed.append(torch.stack(per_layer))
    finally:
        for h in hooks:
            h.remove()
    rows = []
    for i, blk in enumerate(model.blk):
        b = logit_bounds(blk.attn_q.weight, blk.attn_k.weight, cfg.n_heads, cfg.n_kv_heads,
                         norm_radius(blk.attn_norm.weight), rope=True, n_tokens=context)
        rows.append(_row("smollm2", i, b, observed, d=cfg.dim))
    return rows


_CHUNK = 1 << 24  # logits at a time when recording (bounds the memory of long windows)


def _logit_recorder(store: dict):
    """A set_hf_attention handler: per attention module, the running max over calls of
    |scaling q . k| per query head (H,) over the pairs the layer attends, then the layer's own attention."""
    from hilt.fp8.attention import hf_allowed_pairs

    def handler(module, query, key, value, attention_mask, inner, **kwargs):
        scaling = kwargs.get("scaling") or getattr(module, "scaling", None) or query.shape[-1] ** -0.5
        allowed = hf_allowed_pairs(module, query, key, attention_mask, **kwargs)
        b, h, tq, _ = query.shape
        k = key.detach().float().repeat_interleave(h // key.shape[1], dim=1)
        rows = max(1, _CHUNK // max(1, b * h * key.shape[2]))
        best = torch.zeros(h, device=query.device)
        for i in range(0, tq, rows):
            s = (query[:, :, i:i + rows].detach().float() @ k.transpose(-1, -2)).abs() * scaling
            best = torch.maximum(best, s.masked_fill(~allowed[..., i:i + rows, :], 0).amax(dim=(0, 2, 3)))
        store[module] = torch.maximum(store[module], best) if module in store else best
        return inner(module, query, key, value, attention_mask, **kwargs)

    return handler


@torch.inference_mode()
def causal_lm(model: torch.nn.Module, windows: list[torch.Tensor], name: str = "model") -> list[dict]:
    """Per attention layer of a transformers causal LM (eval): the weight-only bounds against the
    largest |logit| seen on ``windows`` (1-D token tensors), rows as for SmolLM2 and MiniLM plus
    the layer's name, its kind (``qk_norm``: the bound from q/k norm gains; ``projection``: from
    W_Q, W_K, biases and the input norm), scaling and RoPE layout."""
    from hilt.fp8.attention import hf_attention, hf_attention_layers

    windows = [w.reshape(-1) for w in windows]
    if not windows or min(len(w) for w in windows) < 1:
        raise HiltError(f"{name}: no token windows to observe logits on")
    device = next(model.parameters()).device
    layers = hf_attention_layers(model, windows[0])
    store, observed = {}, []
    with hf_attention(model, _logit_recorder(store)):
        for w in windows:
            store.clear()
            model(input_ids=w[None].to(device), use_cache=False)
            missing = [layer.name for layer in layers if layer.module not in store]
            if missing:
                raise HiltError(f"{name}: attention layer {missing[0]} did not run on a window of {len(w)} tokens")
            observed.append([store[layer.module].cpu() for layer in layers])
    n = max(len(w) for w in windows)
    rows = []
    for layer in layers:
        b = layer.logit_bounds(n_tokens=n)
        row = _row(name, layer.index, b, observed, d=b["d"])
        row.update({"name": layer.name, "kind": "qk_norm" if layer.qk_norm else "projection",
                    "heads": layer.n_heads, "kv_heads": layer.n_kv_heads, "head_dim": layer.head_dim,
                    "scaling": b["scaling"], "rope": layer.rope, "sliding_window": layer.sliding_window})
        rows.append(row)
    return rows


def _row(model: str, layer: int, b: dict, batches: list[torch.Tensor], d: int) -> dict:
    """One layer's bounds against what was observed. The first quarter of the batches is the
    burn-in that fits the rank-aware gamma; the rest is held out to test the fitted prediction."""
    per_batch = torch.stack([o[layer] for o in batches])  # (batches, heads)
    burn = max(1, len(batches) // 4)
    observed, held_out = per_batch.amax(0), per_batch[burn:].amax(0) if len(batches) > burn else per_batch.amax(0)
    bound, aware = b["bound"], b["rank_aware"]
    gamma = burn_in_gamma(per_batch[:burn].amax(0), bound, d, b["rank"], b["n_tokens"], b["delta"])
    fitted = min(1.0, tail_alpha(d, b["rank"], b["n_tokens"], b["delta"], gamma)) * bound
    return {"model": model, "layer": layer, "sigma": b["sigma"].tolist(), "bound": bound.tolist(),
            "product_bound": b["product_bound"].tolist(), "rank_aware": aware.tolist(),
            "rank_agnostic": b["rank_agnostic"].tolist(), "observed": observed.tolist(),
            "scale": [E4M3_MAX / max(v, 1e-30) for v in bound.tolist()],  # no logit can pass 448
            "max_observed_over_bound": float((observed / bound.clamp_min(1e-30)).max()),
            "max_observed_over_rank_aware": float((observed / aware.clamp_min(1e-30)).max()),
            "agnostic_over_aware": float((b["rank_agnostic"] / aware.clamp_min(1e-30)).min()),
            "n_tokens": b["n_tokens"], "burn_in_gamma": gamma, "held_out_exceeds_fitted": bool((held_out > fitted).any()),
            "exceeded": bool((observed > bound).any())}


# the first layer's query and key weights, by family: what a checkpoint must hold to be analysed
ATTENTION_WEIGHTS = {"llama": ("blk.0.attn_q.weight", "blk.0.attn_k.weight"),
                     "bert": ("encoder.layer.0.attention.self.query.weight", "encoder.layer.0.attention.self.key.weight")}


def checkpoint_family(path) -> str:
    """"llama" or "bert" for a checkpoint hilt fp8 scales can analyse; a clear error otherwise."""
    from hilt.quant.sources import GGUFSource, open_source

    path = Path(path)
    with open_source(path) as src:  # names the file when it is missing, a pickle or not a checkpoint
        family = "llama" if isinstance(src, GGUFSource) else "bert"
        names = set(src.names())
    missing = [n for n in ATTENTION_WEIGHTS[family] if n not in names]
    if missing:
        raise HiltError(f"{path}: no attention weights to bound (no {' or '.join(missing)}); "
                        f"hilt fp8 scales reads llama GGUF and BERT safetensors checkpoints")
    return family


def run(model: str, tokens: int = 1024, context: int = 256) -> dict:
    """``model``: minilm, smollm2, the path of a llama GGUF / BERT safetensors checkpoint, or any other causal
    LM hilt.models.lm loads (gemma3, a GGUF transformers reads, a causal-LM folder): ``tokens`` tokens of Hamlet
    in windows of ``context``."""
    from hilt.models import lm as causal

    source = None
    if model == "gemma3" or (model not in ("minilm", "smollm2") and Path(model).exists()
                             and causal.is_language_model(model)):
        source = causal.lm_source(model)
    if model in ("minilm", "smollm2"):
        rows = minilm() if model == "minilm" else smollm2()
    elif source is not None and source.runner != causal.OWN:
        from hilt.data.text import shakespeare_text

        lm = causal.load_lm(model, source)
        rows = causal_lm(lm.model, lm.windows(shakespeare_text("hamlet"), tokens, context, "Hamlet"), model)
        model = str(model)
    elif Path(model).exists():
        family = checkpoint_family(model)
        rows = minilm(path=model) if family == "bert" else smollm2(path=model)
        model = str(model)
    else:
        raise HiltError(f"{model}: not minilm, smollm2 or gemma3, and no such file or directory")
    first = rows[0]
    LOG.info(f"{model}: per layer, max over heads: largest |logit| observed on real text; the worst-case bound "
             f"(holds for every input); the rank-aware prediction (delta 1e-6, n {first['n_tokens']}) and how the "
             f"rank-agnostic one compares; gamma fitted on the first quarter of the text (burn-in)")
    for r in rows:
        LOG.info(f"  layer {r['layer']:>2}: observed {max(r['observed']):8.2f}  worst case {max(r['bound']):9.1f} "
                 f"(obs/bound {r['max_observed_over_bound']:.3f})  rank-aware {max(r['rank_aware']):8.2f} "
                 f"(obs/pred {r['max_observed_over_rank_aware']:.2f}; agnostic {r['agnostic_over_aware']:.2f}x looser)  "
                 f"burn-in gamma {r['burn_in_gamma']:.2f}" + ("  HELD-OUT ABOVE FIT" if r["held_out_exceeds_fitted"] else "")
                 + ("  EXCEEDED" if r["exceeded"] else ""))
    exceeded = [r["layer"] for r in rows if r["exceeded"]]
    if exceeded:
        raise HiltError(f"{model}: observed logits exceed the bound on layers {exceeded}: the bound is wrong")
    return {"model": model, "rows": rows}
