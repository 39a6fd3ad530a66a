"""Evaluation runs behind `hilt eval`: perplexity (SmolLM2) and embedding similarity (MiniLM).

A quantized model is the unquantized model with the tensors of a hilt
checkpoint (from `hilt quantize` of the same model) loaded over it: the
quantized linear layers run as QuantLinear, everything else as stored.
"""

from __future__ import annotations

import time
from pathlib import Path

from hilt.errors import HiltError
from hilt.quant import load_quantized_, read_header


def _resolve(model: str, default_name: str, default_path) -> Path:
    return default_path() if model in (None, default_name) else Path(model)


def perplexity_run(model="smollm2", quantized=None, text=None, tokens=2048, context=512, progress=False) -> dict:
    """Perplexity of a Llama-architecture GGUF on ``tokens`` tokens of ``text`` (a file; default Hamlet)."""
    from hilt.bench.models import llama
    from hilt.bench.data.text import shakespeare_text

    path = _resolve(model, "smollm2", llama.smollm2_path)
    if text is None:
        body, text_name = shakespeare_text("hamlet"), "Hamlet (shakespeare package)"
    else:
        try:
            body, text_name = Path(text).read_text(encoding="utf-8"), str(text)
        except (OSError, UnicodeDecodeError) as e:
            raise HiltError(f"{text}: cannot read text ({e})") from None
    if tokens < 2:
        raise HiltError(f"--tokens must be at least 2, got {tokens}")
    net, tokenizer = llama.load_llama(path)
    if quantized is not None:
        load_quantized_(net, quantized, strict=False)
    ids = tokenizer.encode(body)[:tokens]
    if len(ids) < tokens:
        raise HiltError(f"{text_name}: only {len(ids)} tokens, asked for {tokens}")
    start = time.perf_counter()
    ppl = llama.perplexity(net, ids, context=context, progress=progress)
    return {
        "model": str(path), "quantized": None if quantized is None else str(quantized),
        "bits_per_weight": _bits(quantized), "text": text_name, "tokens": len(ids), "context": context,
        "perplexity": ppl, "seconds": round(time.perf_counter() - start, 2),
    }


def embedding_run(model="minilm", quantized=None, sentences=256) -> dict:
    """Mean (and worst) cosine similarity of sentence embeddings against the fp32 model."""
    import torch

    from hilt.bench.models import bert
    from hilt.bench.data.text import sentences as real_sentences

    path = _resolve(model, "minilm", bert.minilm_path)
    batch = real_sentences(sentences)
    ref_model, tokenizer = bert.load_minilm(path)
    ref = bert.embed(ref_model, tokenizer, batch)
    other = ref
    if quantized is not None:
        load_quantized_(ref_model, quantized, strict=False)  # same model object, now quantized
        other = bert.embed(ref_model, tokenizer, batch)
    cos = torch.nn.functional.cosine_similarity(ref.double(), other.double(), dim=-1)
    return {
        "model": str(path), "quantized": None if quantized is None else str(quantized),
        "bits_per_weight": _bits(quantized), "sentences": len(batch),
        "cosine_similarity": bert.embedding_similarity(ref, other), "cosine_similarity_min": float(cos.min()),
    }


def _bits(quantized) -> float | None:
    return None if quantized is None else read_header(quantized)["totals"]["bits_per_weight"]
