"""`hilt fp8 attention`: what FP8 attention (fp8/attention.py) costs real models.

SmolLM2-135M: perplexity on Hamlet with every attention layer in FP8 against the same model
in float32 (target: within 1%). MiniLM: mean cosine similarity of sentence embeddings against
float32. Variants: the default (current scales, K smoothing + Hadamard rotation, V in E4M3),
geometry-aware scales, no rotation, V kept 16-bit. On the CPU the FP8 path is the emulated
reference (kernels.fp8_attention), which rounds exactly as the kernel does.
"""

from __future__ import annotations

import time

import torch

from hilt.errors import HiltError
from hilt.fp8.attention import use_fp8_attention
from hilt.progress import LOG

TARGET_PCT = 1.0  # the most FP8 attention may change SmolLM2's perplexity
VARIANTS = {  # name: (scales, v_fp8, rotate, split_qk)
    "fp8": ("current", True, True, False),
    "fp8 geometry scales": ("geometry", True, True, False),
    "fp8 no rotation": ("current", True, False, False),
    "fp8, V 16-bit": ("current", False, True, False),
    "fp8, split Q K": ("current", True, True, True),
}


def causal_lm(model: str, tokens: int = 4096, context: int = 512, variants=tuple(VARIANTS)) -> dict:
    """Any causal LM transformers runs (hilt.models.lm: gemma3, a GGUF, a folder): perplexity on Hamlet with every
    attention layer in FP8 (fp8.attention.use_fp8_attention_hf, each layer's own logit scaling) against float32."""
    from hilt.data.text import shakespeare_text
    from hilt.fp8.attention import use_fp8_attention_hf
    from hilt.models.lm import load_lm

    lm = load_lm(model)
    if lm.own:
        raise HiltError(f"{model}: runs on hilt's own Llama; `hilt fp8 attention` without --model measures it")
    ids = lm.encode(shakespeare_text("hamlet"))[:tokens]
    was = lm.model.config._attn_implementation
    base = lm.perplexity(ids, context)
    LOG.info(f"{model}, {len(ids)} tokens of Hamlet in windows of {context}: float32 perplexity {base:.3f}")
    probe = torch.tensor(ids[:context])
    rows = []
    try:
        for name in variants:
            scales, v_fp8, rotate, split_qk = VARIANTS[name]
            use_fp8_attention_hf(lm.model, scales, v_fp8, rotate, split_qk, input_ids=probe)
            ppl = lm.perplexity(ids, context)
            lm.model.set_attn_implementation(was)
            rows.append({"variant": name, "scales": scales, "v_fp8": v_fp8, "rotate": rotate, "split_qk": split_qk,
                         "perplexity": ppl, "perplexity_change_pct": 100 * (ppl / base - 1)})
            LOG.info(f"  {name:<20} perplexity {ppl:.3f} ({rows[-1]['perplexity_change_pct']:+.2f}%)")
    finally:
        lm.model.set_attn_implementation(was)
    return {"model": model, "tokens": len(ids), "context": context, "float32_perplexity": base, "rows": rows,
            "target_pct": TARGET_PCT}


def run(tokens: int = 4096, context: int = 512, sentences: int = 256, variants=tuple(VARIANTS)) -> dict:
    from hilt.models.bert import embed, embedding_similarity, load_minilm
    from hilt.models.llama import load_llama, perplexity
    from hilt.data.text import sentences as real_sentences
    from hilt.data.text import shakespeare_text

    llama, tokenizer = load_llama()
    ids = torch.tensor(tokenizer.encode(shakespeare_text("hamlet"))[:tokens])
    start = time.perf_counter()
    base = perplexity(llama, ids, context)
    LOG.info(f"SmolLM2-135M, {len(ids)} tokens of Hamlet in windows of {context}: float32 perplexity {base:.3f} "
             f"({time.perf_counter() - start:.0f} s)")
    minilm, bert_tok = load_minilm()
    text = real_sentences(sentences)
    ref = embed(minilm, bert_tok, text)
    rows = []
    for name in variants:
        scales, v_fp8, rotate, split_qk = VARIANTS[name]
        ppl = perplexity(use_fp8_attention(llama, scales, v_fp8, rotate, split_qk), ids, context)
        sim = embedding_similarity(ref, embed(use_fp8_attention(minilm, scales, v_fp8, rotate, split_qk), bert_tok, text))
        rows.append({"variant": name, "scales": scales, "v_fp8": v_fp8, "rotate": rotate, "split_qk": split_qk,
                     "perplexity": ppl,
                     "perplexity_change_pct": 100 * (ppl / base - 1), "minilm_cosine": sim})
        LOG.info(f"  {name:<20} perplexity {ppl:.3f} ({rows[-1]['perplexity_change_pct']:+.2f}%)   "
                 f"MiniLM embedding cosine {sim:.5f}")
    return {"tokens": len(ids), "context": context, "sentences": len(text), "float32_perplexity": base,
            "rows": rows, "target_pct": TARGET_PCT}
