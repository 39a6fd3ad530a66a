"""The Hugging Face side of a hilt checkpoint folder: shard names, the index, the config's
``quantization_config`` and the model's other files (tokenizer, generation settings).

A quantized folder made from a Hugging Face model folder is itself one: ``config.json`` (the
source's, with a ``quantization_config`` whose ``quant_method`` is ``"hilt"``), the tokenizer and
generation files, ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json``, and ``hilt.json`` beside them. transformers reads it through
hilt.quant.hf_quantizer. Nothing here imports transformers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from hilt.atomic import write_json
from hilt.errors import HiltError

QUANT_METHOD = "hilt"
CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
# Weight files of any framework: never copied beside the quantized shards.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".gguf", ".onnx", ".h5", ".msgpack",
                   ".ot", ".tflite", ".mlmodel")

__all__ = ["is_hf_folder", "read_config", "unknown_model_type", "shard_names", "write_index", "quantization_config", "copy_companions",
           "module_formats"]


def is_hf_folder(path) -> bool:
    """A folder with a config.json: a Hugging Face model folder (its weights may be anything)."""
    path = Path(path)
    return path.is_dir() and (path / CONFIG).is_file()


def unknown_model_type(config: dict) -> str | None:
    """Why transformers would not build this config (no model_type, or one it does not know), or None;
    None too without transformers, which cannot be asked."""
    model_type = config.get("model_type")
    if not model_type:
        return "no model_type"
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:
        return None
    return None if model_type in CONFIG_MAPPING else f"model_type {model_type!r} is not one transformers knows"


def read_config(folder) -> dict:
    """config.json of a model folder, refused in one line when unreadable or already quantized by another tool."""
    path = Path(folder) / CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise HiltError(f"{path}: not a readable config ({getattr(e, 'strerror', None) or e})") from None
    if not isinstance(config, dict):
        raise HiltError(f"{path}: not a model config (a JSON object)")
    return config


def shard_names(count: int) -> list[str]:
    """Hugging Face's shard names for ``count`` shards."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_index(folder: Path, weight_map: dict[str, str], total_size: int) -> None:
    """model.safetensors.index.json: which shard holds each key (only for more than one shard)."""
    write_json(folder / INDEX, {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))})


def module_formats(tensors: dict) -> dict[str, dict]:
    """Per quantized module (a weight's name less ``.weight``): method, bits, block size, codebook scope."""
    return {name.removesuffix(".weight"): {"method": e["method"], "bits": e["bits"], "block_size": e["block_size"],
                                           "codebook": e["codebook"]}
            for name, e in tensors.items() if e["kind"] == "quantized"}


def quantization_config(header: dict) -> dict:
    """The ``quantization_config`` a quantized folder's config.json carries: the format, the defaults the
    command was given, every quantized module's format, and the 2-D weights left unconverted."""
    tensors = header["tensors"]
    unconverted = sorted(n.removesuffix(".weight") for n, e in tensors.items()
                         if e["kind"] == "dense" and len(e["shape"]) == 2 and n.endswith(".weight"))
    config = header["config"]
    return {
        "quant_method": QUANT_METHOD,
        "format_version": header["format_version"],
        "method": config["method"],
        "bits": config["bits"],
        "block_size": config["block_size"],
        "codebook": config["codebook"],
        "mixed": "mixed" in header,
        "modules": module_formats(tensors),
        "modules_to_not_convert": unconverted,
    }


def copy_companions(src: Path, dst: Path) -> list[str]:
    """Copy a model folder's files other than weights and config.json (tokenizer, generation config,
    sentence-transformers settings, README) into ``dst``; sub-folders only when they hold no weights.
    Returns the names copied."""
    copied = []
    for item in sorted(src.iterdir()):
        if item.name == CONFIG or item.name == INDEX or item.name.startswith("."):
            continue
        if item.is_file() and item.suffix not in WEIGHT_SUFFIXES:
            shutil.copy2(item, dst / item.name)
            copied.append(item.name)
        elif item.is_dir() and not any(f.suffix in WEIGHT_SUFFIXES for f in item.rglob("*")):
            shutil.copytree(item, dst / item.name)
            copied.append(item.name + "/")
    return copied
