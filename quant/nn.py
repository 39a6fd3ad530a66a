"""QuantLinear and the model-level API, in the style of torchao's ``quantize_``.

    quantize_model_(model, QuantConfig(method="kmeans", bits=2))   # in place
    load_quantized_(model, "model-2bit/")                          # from `hilt quantize`
"""

from __future__ import annotations

import re

import torch
from torch import nn

from hilt.errors import HiltError
from hilt.kernels import byte_table, lut_matmul, uses_byte_table
from hilt.kernels.lut_matmul import PackedWeight
from hilt.quant.checkpoint import KEEP_DENSE, load_checkpoint
from hilt.quant.quantize import QuantConfig, quantize_tensor
from hilt.quant.qweight import QuantizedWeight


class QuantLinear(nn.Module):
    """A Linear whose weight is a QuantizedWeight; runs through ``kernels.lut_matmul``."""

    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.bits, self.block_size, self.method = qweight.bits, qweight.block_size, qweight.method
        self.weight_dtype = qweight.dtype
        # buffers so that .to(device) and state_dict carry the packed weight
        self.register_buffer("codes", qweight.codes)
        self.register_buffer("codebook", qweight.codebook)
        self.register_buffer("scales", qweight.scales)
        self.register_buffer("offsets", qweight.offsets)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self._table, self._table_source, self._table_version = None, None, None

    @property
    def qweight(self) -> QuantizedWeight:
        return QuantizedWeight(
            self.codes, self.codebook, self.scales, self.offsets, (self.out_features, self.in_features),
            self.weight_dtype, self.bits, self.block_size, self.method,
        )

    @property
    def packed(self) -> PackedWeight:
        """The kernel's argument, from the buffers as they are now (moved, loaded)."""
        return PackedWeight(self.codes, self.codebook, self.scales, self.offsets, self.bits, self.block_size,
                            self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.packed
        return lut_matmul(x, w, self.bias, table=self._byte_table(x, w))

    def _byte_table(self, x: torch.Tensor, w: PackedWeight) -> torch.Tensor | None:
        """The codebook's byte table for the kernel's one-row path, kept between calls (decode
        would otherwise rebuild it every token) and rebuilt when the codebook is another tensor
        (moved, loaded) or was changed in place (its version; inference tensors have none)."""
        book = w.codebook
        if not (x.is_cuda and uses_byte_table(w)):
            return None
        version = None if torch.is_inference(book) else book._version
        if self._table is None or self._table_source is not book or self._table_version != version:
            self._table, self._table_source, self._table_version = byte_table(book, w.bits), book, version
        return self._table

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, method={self.method}, "
                f"bits={self.bits}, block_size={self.block_size}, bias={self.bias is not None}")


def replace_module(model: nn.Module, path: str, new: nn.Module) -> None:
    """Put ``new`` at ``path`` (dotted, as ``named_modules`` names it) in ``model``."""
    parent_path, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, attr, new)


def replace_modules(model: nn.Module, make) -> int:
    """Replace each module for which ``make(path, module)`` returns one (None: keep it), in place;
    returns how many were replaced."""
    replaced = 0
    for path, module in list(model.named_modules()):
        new = make(path, module)
        if new is not None:
            replace_module(model, path, new)
            replaced += 1
    return replaced


def eligible(module: nn.Module, path: str, config: QuantConfig, filter_fn=None) -> bool:
    """Whether quantize_model_ and prepare_qat_ swap ``module``: an nn.Linear that
    ``filter_fn(module, path)`` accepts or, without one, whose ``<path>.weight`` is not an
    embedding or LM head name (as ``hilt quantize``) and whose input size the block size divides."""
    if not isinstance(module, nn.Linear):
        return False
    if filter_fn is not None:
        return bool(filter_fn(module, path))
    return not KEEP_DENSE.search(f"{path}.weight") and module.in_features % config.block_size == 0


def quantize_model_(model: nn.Module, config: QuantConfig, filter_fn=None) -> nn.Module:
    """Swap every eligible ``nn.Linear`` of ``model`` for a QuantLinear, in place (eligible: see
    :func:`eligible`; ``filter_fn(module, path) -> bool`` overrides). Returns the model."""

    def make(path, module):
        if eligible(module, path, config, filter_fn):
            return QuantLinear(quantize_tensor(module.weight.detach(), config, name=f"{path}.weight"), module.bias)
        return None

    replace_modules(model, make)
    return model


def load_quantized_(model: nn.Module, dst, strict: bool = True) -> nn.Module:
    """Load a hilt checkpoint into ``model`` whose parameter names match its tensor names.

    Linear layers whose weight was quantized become QuantLinear; every other
    tensor is copied into the matching parameter or buffer. With ``strict``,
    a checkpoint tensor with no home in the model is an error naming it;
    without, such tensors (e.g. a pooler the model does not use) are skipped.
    """
    tensors = load_checkpoint(dst)
    modules = dict(model.named_modules())
    own = model.state_dict()
    if not any(n in own for n in tensors):
        raise HiltError(f"{dst}: no tensor name matches the model (was it quantized from another model?)")
    dense = {}
    for name, value in tensors.items():
        if isinstance(value, QuantizedWeight):
            path = re.sub(r"\.weight$", "", name)
            module = modules.get(path)
            if not isinstance(module, nn.Linear):
                if strict or name in own:
                    raise HiltError(f"{dst}: quantized tensor '{name}' has no matching nn.Linear in the model")
                continue
            if (module.out_features, module.in_features) != value.shape:
                raise HiltError(f"{dst}: tensor '{name}' has shape {value.shape}, layer '{path}' expects "
                                f"{(module.out_features, module.in_features)}")
            replace_module(model, path, QuantLinear(value, module.bias))
        else:
            dense[name] = value
    unknown = [n for n in dense if n not in own]
    if strict and unknown:
        raise HiltError(f"{dst}: tensor '{unknown[0]}' has no matching parameter in the model")
    with torch.no_grad():
        for name, value in dense.items():
            if name in own:
                if own[name].shape != value.shape:
                    raise HiltError(f"{dst}: tensor '{name}' has shape {tuple(value.shape)}, model expects {tuple(own[name].shape)}")
                own[name].copy_(value)
    return model
