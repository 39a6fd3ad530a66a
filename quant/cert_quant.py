"""The perturbation a quantization format makes, for the certificates (docs/certify.md): per weight
layer the actual error ||W - Q(W)||_F, or the worst case inside the format's rounding cells.
``Perturbation``, the per-layer bounds every certificate takes, lives here so that quant need not
import cim_sim."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from hilt.errors import HiltError


@dataclass(frozen=True)
class Perturbation:
    """Per-layer bounds eps_l >= ||Delta W_l||_F, by layer name (a layer not named stays exact).
    ``probability``: the bounds hold with at least this probability (1: always)."""

    eps: dict
    source: str = "given"
    probability: float = 1.0
    detail: dict = field(default_factory=dict)

    def __post_init__(self):
        bad = {k: v for k, v in self.eps.items() if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0)}
        if bad:
            raise HiltError(f"perturbation bounds must be finite and >= 0, got {bad}")


def weight_layers(model: nn.Module) -> list:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d))]


def block_for(in_features: int, block_size: int) -> int:
    """The block size used for a layer: ``block_size`` if it divides the layer's inputs (C k_h k_w for a
    convolution), else the largest size below it that does (hilt refuses to pad)."""
    return max(b for b in range(1, min(block_size, in_features) + 1) if in_features % b == 0)


@dataclass
class QuantizedLayer:
    """One layer's weight (out, inputs), its quantized value, and the rounding cell of every weight:
    ``lower`` <= w <= ``upper`` holds for every weight that this format stores with the same codes,
    scales and block ranges (the cells of the nearest-level assignment, the outer ones closed by the
    block's own smallest and largest value)."""

    weight: torch.Tensor
    quantized: torch.Tensor
    lower: torch.Tensor
    upper: torch.Tensor
    block_size: int
    bits_per_weight: float

    @property
    def error(self) -> float:
        """||W - Q(W)||_F."""
        return float((self.quantized.double() - self.weight.double()).norm())

    @property
    def half_width(self) -> torch.Tensor:
        """Per weight, the largest |Q(w) - w'| over its cell."""
        return torch.maximum((self.quantized - self.lower).abs(), (self.upper - self.quantized).abs())

    @property
    def cell_bound(self) -> float:
        """The worst ||W' - Q(W)||_F over every W' inside the cells (>= the actual error)."""
        return float(self.half_width.double().norm())


def _cells(w: torch.Tensor, q) -> tuple:
    """(lower, upper) of each weight's rounding cell, in weight units."""
    n, k = w.shape
    b = q.block_size
    scales = q.scales.float().unsqueeze(-1)
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    blocks = w.float().view(n, k // b, b)
    offsets = q.offsets.float().unsqueeze(-1) if q.offsets is not None else torch.zeros_like(scales)
    u = (blocks - offsets) / safe  # what the codebook quantized (as hilt.quant.quantize computes it)
    book = q.codebook.float()
    if book.dim() == 1:
        book = book.expand(n, k // b, -1)
    mids = (book[..., 1:] + book[..., :-1]) / 2
    idx = torch.searchsorted(mids.contiguous(), u.contiguous())  # the nearest level, as the quantizer chose it
    inf = torch.full_like(mids[..., :1], math.inf)
    lo_mid = torch.cat([-inf, mids], -1).gather(-1, idx)
    hi_mid = torch.cat([mids, inf], -1).gather(-1, idx)
    lo = torch.maximum(lo_mid, u.amin(-1, keepdim=True))  # outer cells closed by the block's own range
    hi = torch.minimum(hi_mid, u.amax(-1, keepdim=True))
    lower = (lo * scales + offsets).view(n, k)
    upper = (hi * scales + offsets).view(n, k)
    return torch.minimum(lower, w), torch.maximum(upper, w)  # rounding: keep w itself inside


def quantize_layers(model: nn.Module, config, layers=None) -> dict:
    """Every Linear/Conv weight of ``model`` (or those named in ``layers``) quantized with ``config``
    (a hilt.quant.QuantConfig; the block size per layer from :func:`block_for`): name -> QuantizedLayer."""
    from hilt.quant import quantize_tensor

    out = {}
    for name, m in weight_layers(model):
        if layers is not None and name not in layers:
            continue
        w = m.weight.detach().float().reshape(m.weight.shape[0], -1)
        b = block_for(w.shape[1], config.block_size)
        q = quantize_tensor(w, dataclasses.replace(config, block_size=b), name=f"{name}.weight")
        lower, upper = _cells(w, q)
        out[name] = QuantizedLayer(w, q.dequantize().float(), lower, upper, b, q.bits_per_weight)
    return out


def quantization_perturbation(model: nn.Module, config, worst_case: bool = False, layers=None,
                              quantized: dict | None = None) -> Perturbation:
    """Per-layer bounds from a hilt format: the actual error ||W - Q(W)||_F, or (``worst_case``) the
    largest error of any weights the format would store with the same codes and scales (the rounding
    cells: a bound that does not depend on where inside its cell each weight lies)."""
    quantized = quantized if quantized is not None else quantize_layers(model, config, layers)
    eps = {name: (q.cell_bound if worst_case else q.error) for name, q in quantized.items()}
    label = f"{config.method} {config.bits}-bit"
    detail = {"format": label, "worst_case": worst_case,
              "block_size": {name: q.block_size for name, q in quantized.items()},
              "bits_per_weight": {name: q.bits_per_weight for name, q in quantized.items()},
              "relative_error": {name: q.error / max(float(q.weight.double().norm()), 1e-30)
                                 for name, q in quantized.items()}}
    return Perturbation(eps, "quantization cells" if worst_case else "quantization error", 1.0, detail)
