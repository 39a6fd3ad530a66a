"""hilt checkpoints in transformers: ``AutoModel*.from_pretrained(folder)`` of a folder that
``hilt quantize`` made from a Hugging Face model folder.

Its config.json carries ``"quantization_config": {"quant_method": "hilt", ...}`` listing every
quantized module's format (hilt.quant.hf_folder). Before transformers loads the weights, each of
those ``nn.Linear`` modules becomes an empty QuantLinear whose buffers (``codes``, ``codebook``,
``scales``, ``offsets``) carry the shard keys' names and dtypes, so transformers' own loader fills
them from the shards as stored: the model holds the packed weights, never a dequantized copy.
``save_pretrained`` writes the same keys and the same quantization_config back.

``import hilt`` registers the two classes with transformers once transformers' quantizer registry
is imported (see hilt/__init__.py); :func:`register` does it directly.
"""

from __future__ import annotations

from pathlib import Path

from transformers.quantizers.auto import (AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING,
                                          register_quantization_config, register_quantizer)
from transformers.quantizers.base import HfQuantizer  # not transformers.quantizers: still importing when register() runs
from transformers.utils.quantization_config import QuantizationConfigMixin

from hilt.errors import HiltError
from hilt.quant.checkpoint import FORMAT_VERSION
from hilt.quant.hf_folder import QUANT_METHOD

__all__ = ["HiltQuantizationConfig", "HiltHfQuantizer", "register"]


class HiltQuantizationConfig(QuantizationConfigMixin):
    """The ``quantization_config`` of a hilt folder (written by hilt.quant.hf_folder.quantization_config)."""

    def __init__(self, modules: dict | None = None, format_version: int = FORMAT_VERSION, method: str = "kmeans",
                 bits: int = 4, block_size: int = 64, codebook: str = "layer", mixed: bool = False,
                 modules_to_not_convert: list | None = None, **kwargs):
        self.quant_method = QUANT_METHOD
        self.format_version = format_version
        self.method, self.bits, self.block_size, self.codebook, self.mixed = method, bits, block_size, codebook, mixed
        self.modules = dict(modules or {})
        self.modules_to_not_convert = list(modules_to_not_convert or [])
        if format_version > FORMAT_VERSION:
            raise HiltError(f"quantization_config: hilt format version {format_version} is newer than this hilt "
                            f"reads ({FORMAT_VERSION}); upgrade hilt")
        if format_version < 2:
            raise HiltError("quantization_config: hilt format version 1 names its parts after the weights; "
                            "re-quantize with this hilt to load it with transformers")


class HiltHfQuantizer(HfQuantizer):
    """Loads hilt's packed weights into QuantLinear modules; quantizing on load is not offered
    (``hilt quantize`` does that, with its calibration and error reports)."""

    requires_calibration = True  # pre-quantized folders only
    quantization_config: HiltQuantizationConfig

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        from torch import nn

        from hilt.quant.nn import QuantEmbedding, QuantLinear, TiedHead, group_projections_, replace_module
        from hilt.quant.qweight import QuantizedWeight
        from hilt.quant.sources import read_safetensors_header

        for f in checkpoint_files or ():  # a truncated shard named here, not by the reader deep in transformers
            if str(f).endswith(".safetensors"):
                read_safetensors_header(Path(f))

        prefix = getattr(model, "base_model_prefix", "")
        replaced = {}
        for path, fmt in self.quantization_config.modules.items():
            # The folder may hold a base model's keys loaded into a model with a head (bert.encoder...), or the reverse
            found = [p for p in (path, f"{prefix}.{path}", path.removeprefix(f"{prefix}.")) if p]
            target = next((p for p in found if _has_submodule(model, p)), None)
            if target is None:
                raise HiltError(f"quantization_config names module '{path}', which {type(model).__name__} does not have")
            module = model.get_submodule(target)
            if not isinstance(module, (nn.Linear, nn.Embedding)):
                raise HiltError(f"quantization_config names module '{path}', a {type(module).__name__} in "
                                f"{type(model).__name__}, not an nn.Linear or nn.Embedding")
            q = QuantizedWeight.empty(tuple(module.weight.shape), fmt["method"], fmt["bits"], fmt["block_size"],
                                      fmt["codebook"], dtype=module.weight.dtype, device=module.weight.device)
            new = (QuantLinear(q, module.bias) if isinstance(module, nn.Linear)
                   else QuantEmbedding.replacing(module, q))
            replace_module(model, target, new)
            replaced[target] = new
        # An output head tied to a quantized embedding (tie_word_embeddings) reads the embedding's buffers
        # (TiedHead); transformers, which ties parameters by name, is told the tie is done.
        tied = getattr(model, "all_tied_weights_keys", None) or {}
        for head, table in list(tied.items()):
            source = replaced.get(table.removesuffix(".weight"))
            if isinstance(source, QuantEmbedding) and head.endswith(".weight"):
                path = head.removesuffix(".weight")
                replace_module(model, path, TiedHead(source, getattr(model.get_submodule(path), "bias", None)))
                del tied[head]
        group_projections_(model)
        return model

    def is_serializable(self):
        return True

    @property
    def is_trainable(self) -> bool:
        return False


def _has_submodule(model, path: str) -> bool:
    try:
        model.get_submodule(path)
        return True
    except AttributeError:
        return False


def register() -> None:
    """Make ``quant_method: "hilt"`` known to transformers (once; later calls do nothing)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(HiltQuantizationConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(HiltHfQuantizer)
