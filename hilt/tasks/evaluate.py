"""Evaluation runs behind `hilt eval`: perplexity of a causal LM and embedding similarity of an encoder.

Built-in models (SmolLM2 from its GGUF, MiniLM) run hilt's own forward: the quantized model is the
unquantized one with the tensors of a hilt checkpoint loaded over it (QuantLinear for the quantized
layers). Any Hugging Face model folder runs through transformers; a folder `hilt quantize` made from
one loads with its packed weights (hilt.quant.hf_quantizer).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from hilt.errors import HiltError
from hilt.progress import LOG
from hilt.quant import load_quantized_, read_header
from hilt.quant.checkpoint import HEADER
from hilt.quant.hf_folder import is_hf_folder, read_config


def _resolve(model: str, default_name: str, default_path) -> Path:
    return default_path() if model in (None, default_name) else Path(model)


def perplexity_run(model="smollm2", quantized=None, text=None, tokens=2048, context=512, progress=False) -> dict:
    """Perplexity of a causal LM on ``tokens`` tokens of ``text`` (a file; default Hamlet). ``model``: any
    language model hilt.models.lm names (smollm2, gemma3, a GGUF file, a Hugging Face causal-LM folder,
    quantized by hilt or not). ``quantized``: a hilt checkpoint of a Llama GGUF, loaded over it, or a hilt
    folder made from a Hugging Face model, run instead of it."""
    from hilt.data.text import shakespeare_text
    from hilt.models.lm import BUILTIN

    if text is None:
        body, text_name = shakespeare_text("hamlet"), "Hamlet (shakespeare package)"
    else:
        try:
            body, text_name = Path(text).read_text(encoding="utf-8"), str(text)
        except (OSError, UnicodeDecodeError) as e:
            raise HiltError(f"{text}: cannot read text ({e})") from None
    if tokens < 2:
        raise HiltError(f"--tokens must be at least 2, got {tokens}")
    lm, source, path, quantized = _open_lm(model, quantized, "ppl")
    if quantized is not None and lm.own:
        load_quantized_(lm.model, quantized, strict=False)
    ids = lm.encode(body)[:tokens]
    if len(ids) < tokens:
        raise HiltError(f"{text_name}: only {len(ids)} tokens, asked for {tokens}")
    start = time.perf_counter()
    ppl = lm.perplexity(ids, context=context, progress=progress)
    return {
        "model": model if model in BUILTIN else str(path), "family": source.family,
        "quantized": None if quantized is None else str(quantized),
        "bits_per_weight": _bits(quantized), "text": text_name, "tokens": len(ids), "context": context,
        "perplexity": ppl, "seconds": round(time.perf_counter() - start, 2),
    }


def _open_lm(model, quantized, metric: str):
    """The language model ``model`` names, loaded float, with where it came from: (lm, source, path, quantized).
    A hilt folder made from a Hugging Face model runs through transformers as it is (``quantized`` is then that
    folder); a hilt checkpoint of a model hilt runs itself is left for the caller to load over ``lm.model``."""
    from hilt.models.lm import BUILTIN, HF_FOLDER, OWN, load_lm, lm_source

    if quantized is not None and not Path(quantized).exists():
        raise HiltError(f"--quantized {quantized}: no such file or folder")
    path = None if model in BUILTIN else Path(model)
    if path is not None and path.is_dir():
        if quantized is None and not is_hf_folder(path):
            _refuse_quantized_as_model(path, metric, "smollm2")
        if quantized is None and is_hf_folder(path) and read_config(path).get("quantization_config"):
            quantized = path  # a quantized folder given as the model: say so in the result
    source = lm_source(model, _embed_hint(path, quantized) if path is not None else None)
    if source.runner == HF_FOLDER and quantized is not None:
        source = lm_source(quantized, _embed_hint(source.path, quantized))  # hilt's folder, run through transformers
    elif quantized is not None and source.runner != OWN:
        raise HiltError(f"--quantized {quantized}: {model} runs through transformers; quantize a Hugging Face folder "
                        f"of it (`hilt convert`, then `hilt quantize`) and give that folder as the model")
    return load_lm(model, source), source, path, quantized


def tasks_run(model="smollm2", quantized=None, tasks=None, quick=False, reference=None, progress=False) -> dict:
    """Downstream task scores (hilt.tasks.downstream) of a causal LM, named as for :func:`perplexity_run`. The
    continuation task also compares with a float reference's own continuation: ``reference`` (a language model
    with the same tokenizer), or, for a hilt checkpoint loaded over ``model``, ``model`` itself before loading."""
    from hilt.data.lm_tasks import item_path, load_items
    from hilt.models.lm import BUILTIN, load_lm, lm_source
    from hilt.tasks import downstream

    tasks = tuple(tasks or downstream.TASKS)
    unknown = [t for t in tasks if t not in downstream.TASKS]
    if unknown:
        raise HiltError(f"unknown task {unknown[0]!r}; the tasks are {', '.join(downstream.TASKS)}")
    if reference is not None:
        lm_source(reference)  # a reference that names nothing is refused before any model loads
    items = load_items()
    counts = downstream.QUICK_COUNTS if quick else {}
    chosen = {t: downstream.spread(items[t], counts.get(t)) for t in tasks}
    lm, source, path, quantized = _open_lm(model, quantized, "tasks")
    if reference is None and quantized is not None and not lm.own and path is not None \
            and path.resolve() != Path(quantized).resolve():
        reference = str(path)  # a Hugging Face folder and hilt's quantized folder of it: the first is the float model
    ref_tokens, ref_name = None, None
    if "continuation" in tasks and (reference is not None or (quantized is not None and lm.own)):
        LOG.info(f"continuations of the float reference on {len(chosen['continuation'])} items, for the agreement")
    if "continuation" in tasks:
        if reference is not None:
            ref = load_lm(reference)
            probe = chosen["continuation"][0]["answer"]
            if ref.encode(probe) != lm.encode(probe):
                raise HiltError(f"--reference {reference}: its tokenizer is not {model}'s; the continuations "
                                "cannot be compared token by token")
            ref_tokens, ref_name = downstream.greedy_continuations(ref, chosen["continuation"]), str(reference)
            del ref
        elif quantized is not None and lm.own:
            ref_tokens, ref_name = downstream.greedy_continuations(lm, chosen["continuation"]), f"{model} (float)"
    if quantized is not None and lm.own:
        load_quantized_(lm.model, quantized, strict=False)
    start = time.perf_counter()
    scores = downstream.score_tasks(lm, chosen, tasks, ref_tokens, progress)
    return {
        "model": model if model in BUILTIN else str(path), "family": source.family,
        "quantized": None if quantized is None else str(quantized), "bits_per_weight": _bits(quantized),
        "items": f"{items['work']} (hilt/data/lm_tasks/{item_path().name}, seed {items['seed']})",
        "quick": quick, "reference": ref_name, "tasks": scores, "seconds": round(time.perf_counter() - start, 2),
    }


def embedding_run(model="minilm", quantized=None, sentences=256) -> dict:
    """Mean (and worst) cosine similarity of sentence embeddings against the fp32 model."""
    import torch

    from hilt.models import bert
    from hilt.data.text import sentences as real_sentences

    path = _resolve(model, "minilm", bert.minilm_path)
    if quantized is None:
        _refuse_quantized_as_model(path, "embed", "minilm")
    batch = real_sentences(sentences)
    if quantized is not None and is_hf_folder(quantized) and _is_hf_model(path):
        from hilt.models import hf

        ref = hf.embed(*hf.load_encoder(path), batch)
        other = hf.embed(*hf.load_encoder(quantized), batch)
        cos = torch.nn.functional.cosine_similarity(ref.double(), other.double(), dim=-1)
        return {
            "model": str(path), "quantized": str(quantized), "bits_per_weight": _bits(quantized),
            "sentences": len(batch), "cosine_similarity": float(cos.mean()), "cosine_similarity_min": float(cos.min()),
        }
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


def _made_from(folder: Path, packaged: str) -> str:
    """The model a hilt checkpoint was made from, as the user would name it: the packaged model by its
    name, a path that still exists, or MODEL."""
    from hilt.models.bert import minilm_path
    from hilt.models.llama import smollm2_path

    try:
        source = Path(read_header(folder)["source"]["path"])
    except (HiltError, KeyError, TypeError):
        return "MODEL"
    default = {"minilm": minilm_path, "smollm2": smollm2_path}[packaged]
    with contextlib.suppress(HiltError, OSError):
        if source.resolve() in (default().resolve(), default().resolve().parent):
            return packaged
    return str(source) if source.exists() else "MODEL"


def _refuse_quantized_as_model(path: Path, metric: str, packaged: str) -> None:
    """A hilt checkpoint given as MODEL where the command needs the unquantized model to load it over
    (its weights are stored as codes, so the model's tensors are not there by their names)."""
    if path.is_dir() and (path / HEADER).is_file() and not (metric != "embed" and is_hf_folder(path)):
        raise HiltError(f"{path}: stored quantized by hilt ({HEADER}); give the model it was made from and this "
                        f"folder as --quantized: hilt eval {metric} {_made_from(path, packaged)} --quantized {path}")


def _embed_hint(path: Path, quantized) -> str:
    """`hilt eval embed` as it would run the folder given to `hilt eval ppl`."""
    if quantized is not None and Path(quantized) != path:
        return f"`hilt eval embed {path} --quantized {quantized}`"
    if (path / HEADER).is_file():
        return f"`hilt eval embed {_made_from(path, 'minilm')} --quantized {path}`"
    return f"`hilt eval embed {path}`"


def _is_hf_model(path: Path) -> bool:
    """A Hugging Face folder hilt's own BERT cannot run (it runs MiniLM's: model_type bert)."""
    return is_hf_folder(path) and read_config(path).get("model_type") != "bert"


def _bits(checkpoint) -> float | None:
    """Bits per quantized weight of a hilt checkpoint; None for anything else."""
    if checkpoint is None or not (Path(checkpoint) / "hilt.json").exists():
        return None
    return read_header(checkpoint)["totals"]["bits_per_weight"]
