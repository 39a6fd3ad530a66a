"""Hugging Face model folders: a GGUF made into one, and any one run through transformers.

transformers (the ``hf`` extra) is imported inside the functions. A folder ``hilt quantize`` wrote
from a Hugging Face folder loads like any other once ``hilt`` is imported (hilt.quant.hf_quantizer).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from hilt.atomic import check_parent, make_readable, move_into_place
from hilt.errors import HiltError, one_line
from hilt.quant.hf_folder import CONFIG, INDEX, WEIGHT_SUFFIXES, is_hf_folder, read_config
from hilt.quant.sources import read_gguf

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def require_transformers():
    try:
        import transformers
    except ImportError:
        raise HiltError("this needs transformers: pip install 'hilt[hf]'") from None
    return transformers


def gguf_to_hf(src, dst, dtype: torch.dtype = torch.bfloat16, overwrite: bool = False) -> Path:
    """Write the model of a GGUF file as a Hugging Face folder of its architecture: config, weights in
    ``dtype`` (transformers' own GGUF reader maps the names and undoes llama.cpp's row order), generation
    settings and chat template. A byte-level BPE tokenizer ('gpt2') is rebuilt from the GGUF's vocabulary
    as llama.cpp splits text (digits one by one), which transformers' GGUF tokenizer does not; any other
    kind transformers reads (SentencePiece, 'llama') is kept as transformers builds it. The architecture
    and tokenizer are checked before any weight is read. Written under ``DST.partial`` and renamed when
    complete."""
    from hilt.models.llama import GGUFTokenizer

    src, dst = Path(src), Path(dst)
    # the destination first: a conversion takes seconds to minutes, and its failure to write would
    # otherwise surface as transformers' error about the source
    check_parent(dst)
    if dst.exists() and not (overwrite and is_hf_folder(dst)):
        raise HiltError(f"{dst}: already exists" + ("; pass --overwrite to replace it" if not overwrite else
                                                     " and is not a model folder; refusing to replace it"))
    reader = read_gguf(src)
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    transformers = require_transformers()
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise HiltError(f"{src}: architecture {arch!r} has no Hugging Face conversion here (supported: "
                        f"{', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))})")
    tokenizer_kind = gguf_tokenizer_kind(src, reader, arch)
    partial = dst.with_name(dst.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        partial.mkdir()
    except OSError as e:
        raise HiltError(f"{dst}: cannot write the folder ({e.strerror or one_line(e)})") from None
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(src.parent), gguf_file=src.name, dtype=dtype,
            quantization_config=transformers.GgufConfig(dequantize=True))
        if arch == "gemma3":
            _gemma3_as_llama_cpp_reads(model.config, reader)
        model.save_pretrained(partial)
        del model
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        tokenizer.save_pretrained(partial)  # tokenizer_config, special tokens, chat template
        if tokenizer_kind == "gpt2":
            GGUFTokenizer.from_gguf(src, reader).tk.save(str(partial / "tokenizer.json"))
        for f in partial.iterdir():  # safetensors writes owner-only files
            make_readable(f)
    except BaseException as e:  # an interrupted or failed conversion leaves nothing behind
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(e, HiltError) or not isinstance(e, Exception):
            raise
        failed = _write_error(e, partial)
        if failed is not None:  # a full disk or a folder that turned read-only: the destination's fault
            raise HiltError(f"{dst}: cannot write {Path(failed.filename).name} "
                            f"({failed.strerror or one_line(failed)})") from None
        raise HiltError(f"{src}: transformers could not convert it ({one_line(e)})") from None
    move_into_place(partial, dst)  # an old DST (--overwrite) is removed only once the new one is in place
    return dst


def _gemma3_as_llama_cpp_reads(config, reader) -> None:
    """What transformers' GGUF reader leaves at its defaults, set as llama.cpp reads the file: the query scale (from
    the shapes) and which layers attend through the sliding window (the file's pattern, else llama.cpp's)."""
    from hilt.quant.gguf_hf import gemma3_default_sliding, gemma3_query_scalar

    n_layer = config.num_hidden_layers
    scalar = gemma3_query_scalar(config.hidden_size, config.num_attention_heads, n_layer, config.head_dim)
    config.query_pre_attn_scalar = int(scalar) if scalar.is_integer() else scalar  # the config's field is an int
    field = reader.fields.get("gemma3.attention.sliding_window_pattern")
    sliding = [bool(v) for v in field.contents()] if field is not None else gemma3_default_sliding(n_layer)
    config.layer_types = ["sliding_attention" if s else "full_attention" for s in sliding]


def gguf_tokenizer_kind(src, reader, arch: str) -> str:
    """The GGUF's ``tokenizer.ggml.model``, refused in one line where transformers builds no tokenizer of it."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import select_tokenizer_builder

    field = reader.fields.get("tokenizer.ggml.model")
    kind = field.contents() if field is not None else None
    try:
        select_tokenizer_builder(arch, kind)
    except ValueError as e:
        raise HiltError(f"{src}: {one_line(e)}") from None
    return kind


def save_causal_lm(model, like, out) -> Path:
    """Write a transformers causal LM as a Hugging Face folder ``out``, with the tokenizer and settings of
    ``like`` (the folder, or the GGUF file, it was loaded from). Written whole or not at all."""
    from hilt.atomic import replacing

    like, out = Path(like), Path(out)
    with replacing(out, ".partial") as tmp:
        if like.is_dir():
            shutil.copytree(like, tmp, ignore=shutil.ignore_patterns(
                *(f"*{s}" for s in WEIGHT_SUFFIXES), INDEX, "hilt.json", ".gitattributes"))
        else:
            transformers = require_transformers()
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(like.parent), gguf_file=like.name)
            tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp)
        for f in tmp.iterdir():
            make_readable(f)
    return out


def check_folder(folder) -> dict:
    """The config of a Hugging Face model folder, after the checks that read no weights: a folder,
    with a config.json, and every shard its index lists present (transformers' own error names a
    path deep in its loader)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise HiltError(f"{folder}: not a model folder")
    if not is_hf_folder(folder):
        raise HiltError(f"{folder}: no {CONFIG}; a Hugging Face model folder is needed here")
    config = read_config(folder)
    index = folder / INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise HiltError(f"{index}: not a safetensors index (a 'weight_map' of tensor -> shard: "
                            f"{one_line(e, 120)})") from None
        missing = [f for f in shards if not (folder / f).is_file()]
        if missing:
            raise HiltError(f"{index}: shard {missing[0]} is missing ({len(missing)} of the {len(shards)} listed "
                            "there); copy the folder again")
    elif not any(f.suffix in WEIGHT_SUFFIXES for f in folder.iterdir()):
        raise HiltError(f"{folder}: no weights beside {CONFIG} (no model.safetensors, no shard index); "
                        "copy the folder again")
    return config


def require_causal_lm(folder, config: dict, embed_hint: str) -> None:
    """Refuse an encoder before its weights load: transformers would give it a randomly initialised
    language-model head (BERT's BertLMHeadModel), and its perplexity would mean nothing."""
    require_transformers()
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    model_type, archs = config.get("model_type"), config.get("architectures") or []
    heads = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if archs:
        causal = any(a in heads or a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
    else:  # no architectures recorded: an encoder family unless the config says decoder
        causal = model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and (
            model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES or bool(config.get("is_decoder")))
    if not causal:
        what = f"model_type {model_type!r}" + (f" ({', '.join(map(str, archs))})" if archs else "")
        raise HiltError(f"{Path(folder) / CONFIG}: {what} is an encoder, not a causal LM: it has no next-token "
                        f"head to score perplexity with; use {embed_hint}")


def _write_error(e: BaseException | None, partial: Path) -> OSError | None:
    """The OSError on a file under ``partial`` that ``e`` is or was raised from, if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.filename is not None and \
                Path(e.filename).resolve().is_relative_to(partial.resolve()):
            return e
        e = e.__cause__ or e.__context__
    return None


def _load(folder, auto_class: str, dtype=torch.float32):
    """(model in eval mode, tokenizer) of a model folder through transformers' ``auto_class``; errors in one line.
    What reads no weight comes first: the folder, its shards' headers against the config, the tokenizer."""
    folder = Path(folder)
    config = check_folder(folder)
    transformers = require_transformers()
    import hilt  # noqa: F401  (registers hilt's quantizer with transformers)

    _check_weights(folder, config, auto_class)
    tokenizer = _tokenizer(folder)
    try:
        model = getattr(transformers, auto_class).from_pretrained(str(folder), dtype=dtype)
    except HiltError:
        raise
    except (ValueError, KeyError, OSError, RuntimeError) as e:
        kind = config.get("model_type", "unknown")
        raise HiltError(f"{folder}: transformers cannot load it as {auto_class} (model_type {kind!r}: "
                        f"{one_line(e)})") from None
    return model.eval(), tokenizer


def _check_weights(folder: Path, config: dict, auto_class: str) -> None:
    """The weight files read by hilt before transformers reads them: every shard whole (a truncated one named), and
    the tensors the config's model needs all there. transformers would build a model its weights do not fill at the
    config's size, randomly initialised, and run it: a folder of a default-sized Llama whose weights are something
    else takes 28 GB before anything fails. A folder hilt quantized has its header checked instead."""
    from hilt.quant import read_header
    from hilt.quant.sources import open_source

    if config.get("quantization_config"):
        qc = config["quantization_config"] or {}
        if qc.get("quant_method") == "hilt":  # a newer format or a damaged header, named before anything loads
            # transformers' quantizer registry first: importing it registers hilt's quantizer (hilt/__init__.py),
            # which must not happen while hf_quantizer itself is half imported
            import transformers.quantizers.auto  # noqa: F401
            from hilt.quant.hf_quantizer import HiltQuantizationConfig

            try:
                HiltQuantizationConfig(**{k: v for k, v in qc.items() if k != "quant_method"})
            except (HiltError, TypeError) as e:
                raise HiltError(f"{folder / CONFIG}: {one_line(e)}") from None
            read_header(folder)
        return  # packed weights under other names: hilt's quantizer checks them as it loads them
    with open_source(folder) as source:
        if source.format != "safetensors":
            return
        stored = set(source.names())
    transformers = require_transformers()
    try:
        with torch.device("meta"):
            expected = getattr(transformers, auto_class).from_config(transformers.AutoConfig.from_pretrained(str(folder)))
    except Exception:  # noqa: BLE001 (a config transformers cannot build: its own load says why, in _load)
        return
    names = list(expected.state_dict())
    # a tied head is not stored; transformers' checkpoints may carry a 'model.' prefix or not
    found = {n for n in names if n in stored or n.split(".", 1)[-1] in stored or f"model.{n}" in stored}
    missing = [n for n in names if n not in found and not n.endswith("lm_head.weight")]
    if missing:
        raise HiltError(f"{folder}: its weights lack {len(missing)} of the {len(names)} tensors "
                        f"{type(expected).__name__} needs for this config.json (first: {missing[0]}); "
                        "copy the folder again, or fix config.json")


def load_causal_lm(folder, dtype=torch.float32):
    """(model, tokenizer) of a causal-LM folder, quantized by hilt or not."""
    return _load(folder, "AutoModelForCausalLM", dtype)


def load_encoder(folder, dtype=torch.float32):
    """(model, tokenizer) of an encoder folder (last hidden states), quantized by hilt or not."""
    return _load(folder, "AutoModel", dtype)


def _tokenizer(folder):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (ValueError, OSError, KeyError) as e:
        raise HiltError(f"{folder}: no usable tokenizer ({one_line(e, 200)})") from None


def embed(model, tokenizer, sentences: list[str], batch_size: int = 32, max_length: int = 256) -> torch.Tensor:
    """Sentence embeddings of a transformers encoder (bert.mean_pool), float32 (n, hidden)."""
    from hilt.models.bert import mean_pool

    out = []
    max_length = min(max_length, tokenizer.model_max_length)
    with torch.inference_mode():
        for i in range(0, len(sentences), batch_size):
            enc = tokenizer(sentences[i:i + batch_size], padding=True, truncation=True, max_length=max_length,
                            return_tensors="pt")
            out.append(mean_pool(model(**enc).last_hidden_state.float(), enc["attention_mask"]))
    return torch.cat(out)
