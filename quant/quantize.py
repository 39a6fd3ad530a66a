"""Quantize one weight tensor into a QuantizedWeight.

The formats (k-means, symmetric and asymmetric integers, binary) are described in
hilt.quant.formats: their levels, scale rules and bit widths. This module applies them.

Stored scales, offsets and codebooks are rounded to their storage dtypes
*before* codes are chosen, so the error measured is the error of what is saved.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass

import torch

from hilt.errors import HiltError
from hilt.kernels import dequantize_lut, pack_codes, packed_row_bytes
from hilt.quant import kmeans
from hilt.quant.formats import MAX_BITS, MIN_BITS, Format, fitted_methods, get_format
from hilt.quant.qweight import QuantizedWeight

_ROWS_BYTES = 1 << 24  # rows processed together when coding: bounds temporary memory


@dataclass(frozen=True)
class QuantConfig:
    method: str = "kmeans"  # a name of hilt.quant.formats.FORMATS
    bits: int = 4
    block_size: int = 64
    codebook: str = "layer"  # kmeans only: one codebook per "layer" or per "block"
    solver: str = "optimal"  # kmeans only: "optimal" (certified DP) or "lloyd" (k-means++ + Lloyd)
    seed: int = 0

    def __post_init__(self):
        """A QuantConfig that exists is valid: a bad setting raises HiltError naming it."""
        fmt = get_format(self.method)
        if not MIN_BITS <= self.bits <= MAX_BITS:
            raise HiltError(f"bits must be between {MIN_BITS} and {MAX_BITS}, got {self.bits!r}")
        if self.block_size < 1:
            raise HiltError(f"block_size must be positive, got {self.block_size!r}")
        if self.codebook not in ("layer", "block"):
            raise HiltError(f"codebook must be 'layer' or 'block', got {self.codebook!r}")
        fmt.validate(self.bits, self.codebook)
        if self.solver not in ("optimal", "lloyd"):
            raise HiltError(f"unknown k-means solver {self.solver!r}; choose optimal or lloyd")

    @property
    def format(self) -> Format:
        """The entry of hilt.quant.formats that says what ``method`` stores."""
        return get_format(self.method)


def check_quantizable(name: str, shape, config: QuantConfig) -> None:
    """Refuse (naming the tensor) what this format cannot represent. We refuse rather than pad."""
    if len(shape) != 2:
        raise HiltError(f"tensor '{name}' has shape {tuple(shape)}: only 2-D weights can be quantized")
    if shape[1] % config.block_size:
        raise HiltError(
            f"tensor '{name}' has {shape[1]} input columns, not a multiple of --block-size {config.block_size}; "
            "choose a block size that divides it, or leave it out with --ignore"
        )


def block_scales(w: torch.Tensor, config: QuantConfig):
    """(scales, offsets) per block of the 2-D ``w``, rounded to bf16 storage."""
    n, k = w.shape
    rows = max(1, _ROWS_BYTES // (k * 4))  # in row bands: no float32 copy of the whole weight
    parts = [config.format.block_scales(w[r : r + rows].float().view(-1, k // config.block_size, config.block_size),
                                        config.bits) for r in range(0, n, rows)]
    s = torch.cat([p[0] for p in parts]).to(torch.bfloat16)
    return s, None if parts[0][1] is None else torch.cat([p[1] for p in parts]).to(torch.bfloat16)


def fixed_codebook(config: QuantConfig) -> torch.Tensor | None:
    """The fixed levels of ``config``'s format (float64), None where k-means fits them."""
    return config.format.levels(config.bits)


def _normalised(w: torch.Tensor, scales, offsets, block_size) -> torch.Tensor:
    n, k = w.shape
    blocks = w.to(torch.float32, copy=True).view(n, k // block_size, block_size)  # its own: changed in place
    if offsets is not None:
        blocks.sub_(offsets.float().unsqueeze(-1))
    s = scales.float().unsqueeze(-1)
    return blocks.div_(torch.where(s == 0, torch.ones_like(s), s))  # an all-zero block stays zero


def normalise_blocks(w: torch.Tensor, config: QuantConfig):
    """(scales, offsets, u): the stored block scales (and offsets), and w in block units, (n, blocks, B).

    ``u`` is what the codebook quantizes: W = codebook[code] * scale (+ offset).
    """
    scales, offsets = block_scales(w, config)
    return scales, offsets, _normalised(w, scales, offsets, config.block_size)


def floor_importance(importance: torch.Tensor) -> torch.Tensor:
    """Importance weights floored at 1e-6 of their mean, so that no value is ignored entirely
    (and all-zero importance still weighs every value alike)."""
    return importance.clamp_min(1e-6 * float(importance.mean()) + 1e-30)


def quantize_tensor(
    w: torch.Tensor,
    config: QuantConfig,
    name: str = "tensor",
    importance: torch.Tensor | None = None,
    codebook: torch.Tensor | None = None,
) -> QuantizedWeight:
    """Quantize a 2-D weight (out_features, in_features); see :func:`quantize_measured`."""
    return quantize_measured(w, config, name, importance, codebook, measure=False)[0]


def quantize_measured(
    w: torch.Tensor,
    config: QuantConfig,
    name: str = "tensor",
    importance: torch.Tensor | None = None,
    codebook: torch.Tensor | None = None,
    measure: bool = True,
    dtype: torch.dtype | None = None,
) -> tuple[QuantizedWeight, float | None, dict[str, float]]:
    """(the quantized weight, its :func:`relative_error` (None unless ``measure``), seconds spent on
    "fit": block scales and codebook, "pack": codes, "error": the error statistics). The error is
    summed band by band as the codes are made, from the same values :func:`relative_error` rebuilds,
    so it is that function's number without dequantizing the weight a second time.

    Quantize a 2-D weight (out_features, in_features).

    ``importance`` (k-means only): non-negative per-weight importance,
    broadcastable to ``w``, typically the mean squared input activation of each
    input column, shape (in_features,) (see hilt/tasks/calibrate.py). The k-means
    then minimises the importance-weighted error of the *weights*, so a
    normalised value is weighted by importance x scale^2. Importance is floored
    at 1e-6 of its mean, so that no weight is ignored entirely.

    ``codebook`` (k-means, one per layer): use these 2**bits levels instead of fitting them
    (a QAT export keeps the codebook the model was trained with).

    ``dtype``: the dtype the weight dequantizes to (default ``w``'s). ``w`` may stay in a narrower
    float type (bf16 as stored): every step widens it to float32 band by band, so the result is that
    of ``w.float()`` with half the memory.
    """
    t0 = time.perf_counter()
    check_quantizable(name, w.shape, config)
    if not torch.isfinite(w).all():
        raise HiltError(f"tensor '{name}' contains NaN or Inf values")
    if importance is not None:
        if not config.format.fitted:
            raise HiltError(f"importance weights apply to --method {fitted_methods()} only")
        importance = importance.float()
        if not torch.isfinite(importance).all() or bool((importance < 0).any()):
            raise HiltError(f"importance for '{name}' must be finite and non-negative")
        try:
            torch.broadcast_shapes(importance.shape, w.shape)
        except RuntimeError:
            raise HiltError(f"importance for '{name}' has shape {tuple(importance.shape)}, "
                            f"which does not match the weight {tuple(w.shape)}") from None
        importance = floor_importance(importance)
    n, k = w.shape
    B = config.block_size
    scales, offsets = block_scales(w, config)
    levels = 1 << config.bits

    if codebook is not None:
        if not config.format.fitted or config.codebook != "layer" or tuple(codebook.shape) != (levels,):
            raise HiltError(f"a given codebook for '{name}' must be one k-means codebook of {levels} levels "
                            f"(got shape {tuple(codebook.shape)} for {config.method}/{config.codebook})")
        if not torch.isfinite(codebook).all():
            raise HiltError(f"the codebook given for '{name}' contains NaN or Inf")
        codebook = codebook.to(torch.float16).sort().values
    elif (codebook := fixed_codebook(config)) is None:
        u = _normalised(w, scales, offsets, B)  # all of it: the codebook is fitted over every value
        weights = None
        if importance is not None:
            imp = torch.broadcast_to(importance.float(), w.shape).reshape(n, k // B, B)
            weights = imp * scales.float().unsqueeze(-1) ** 2
        if config.codebook == "block":
            flat_u = u.reshape(-1, B)
            flat_w = None if weights is None else weights.reshape(-1, B)
            step = max(1, (1 << 22) // (B + 1) ** 2)  # blocks per DP batch: ~32 MB per temporary
            codebook = torch.cat([
                kmeans.kmeans_optimal_batched(flat_u[i : i + step], levels,
                                              None if flat_w is None else flat_w[i : i + step])
                for i in range(0, flat_u.shape[0], step)
            ]).view(n, k // B, levels)
        else:
            values = kmeans.SortedValues(u, weights, overwrite=True)  # u sorted in place: no second copy
            del u, weights  # the sorted values are all the fit needs; codes below recompute u by rows
            if config.solver == "optimal":
                codebook = kmeans.kmeans_optimal(values, levels).centroids
            else:
                gen = torch.Generator().manual_seed(config.seed + zlib.crc32(name.encode()))
                codebook = kmeans.kmeans_lloyd(values, levels, generator=gen).centroids
            del values
        codebook = codebook.to(torch.float16).sort(dim=-1).values
    else:
        codebook = codebook.to(torch.float16)

    seconds = {"fit": time.perf_counter() - t0, "pack": 0.0, "error": 0.0}
    codes = torch.empty(n, packed_row_bytes(k, config.bits), dtype=torch.uint8)
    rows = max(1, _ROWS_BYTES // (k * 8))  # the bands of relative_error: the same sums in the same order
    book = codebook.double()
    unit = _unit_grid(book)
    book32 = codebook.float()
    diff2 = ref2 = 0.0
    for r in range(0, n, rows):
        t0 = time.perf_counter()
        off = None if offsets is None else offsets[r : r + rows]
        ur = _normalised(w[r : r + rows], scales[r : r + rows], off, B)
        if unit is not None:  # integer levels one apart: the nearest by arithmetic, as bucketize would pick it
            idx = (ur.double() - unit).ceil_().clamp_(0, levels - 1).to(torch.uint8)
        elif book.ndim == 1:
            idx = kmeans.assign(ur, book)
        else:  # per-block codebooks: nearest of each block's own sorted levels
            br = book[r : r + rows]
            mids = ((br[..., 1:] + br[..., :-1]) / 2).to(ur.dtype)
            idx = torch.searchsorted(mids.contiguous(), ur.contiguous())
        del ur
        codes[r : r + rows] = pack_codes(idx.reshape(idx.shape[0], k), config.bits)
        t1 = time.perf_counter()
        seconds["pack"] += t1 - t0
        if measure:  # dequantize_lut's operations on these codes
            idx = idx.reshape(-1, k // B, B)
            if unit is not None:  # levels first, first + 1, ...: the level by arithmetic, exactly the lookup's
                values = idx.float().add_(book32[0])
            elif book32.ndim == 1:
                values = book32[idx.long()]
            else:
                values = torch.gather(book32[r : r + rows], 2, idx.long())
            d = values.mul_(scales[r : r + rows].float().unsqueeze(-1))  # in place: the same values, fewer passes
            if off is not None:
                d = d.add_(off.float().unsqueeze(-1))
            band = w[r : r + rows].float()
            diff2 += _sum64(d.view(-1, k).sub_(band).square_())  # (d - w)² = (w - d)²
            ref2 += _sum64(band.square())  # not in place: band may be a view of w
            seconds["error"] += time.perf_counter() - t1
    q = QuantizedWeight(codes, codebook, scales, offsets, (n, k), dtype or w.dtype, config.bits, B, config.method)
    error = None if not measure else (diff2 / ref2) ** 0.5 if ref2 > 0 else diff2**0.5
    return q, error, seconds


def _unit_grid(book: torch.Tensor) -> float | None:
    """For one codebook of integer levels one apart (the int grids): the first midpoint, so that the
    nearest level of x is ceil(x - it), clamped; None for any other codebook. In float64, x - it is
    exact for a float32 x, so the code is the one torch.bucketize finds on the float32 midpoints."""
    if book.ndim != 1 or book.numel() < 2 or not bool((book.diff() == 1).all()) or book[0] != book[0].round():
        return None
    return float(book[0]) + 0.5


def _sum64(x: torch.Tensor) -> float:
    """The float64 sum of a band, row by row and then over the rows: the same bits whatever the number of
    threads (one sum over every element is split between threads, and its rounding follows the split)."""
    return float(x.sum(-1, dtype=torch.float64).sum())


def relative_error(w: torch.Tensor, q: QuantizedWeight) -> float:
    """||W - Q(W)||_F / ||W||_F (0 for an all-zero W that is reproduced exactly).

    Dequantizes a band of rows at a time, so memory stays near the weight's own size.
    """
    n, k = q.shape
    rows = max(1, _ROWS_BYTES // (k * 8))
    diff2 = ref2 = 0.0
    packed = q.packed
    for r in range(0, n, rows):
        d = dequantize_lut(packed.rows(r, r + rows))
        band = w[r : r + rows].float()
        diff2 += _sum64((band - d) ** 2)
        ref2 += _sum64(band**2)
    return (diff2 / ref2) ** 0.5 if ref2 > 0 else diff2**0.5


def expected_bits_per_weight(shape, config: QuantConfig) -> float:
    """Bits per weight a tensor of ``shape`` will take, without quantizing it (for --dry-run)."""
    n, k = shape
    blocks = n * (k // config.block_size)
    codes = n * packed_row_bytes(k, config.bits) * 8  # rows padded to whole bytes
    return (codes + config.format.overhead_bits(blocks, config.bits, config.codebook)) / (n * k)
