"""Analog layers: a Linear, Conv1d or Conv2d whose weights live as conductance pairs in crossbar arrays.

The forward pass of one analog layer, all as a few tensor ops per layer:

1. weights: W_eff = (G+ - G-) / scale, the conductances read at the current time
   (programming noise, drift and read noise from the device model), held by the
   arrays as two int8 codes per weight, to 1/64,516 of each row's abs-max
   (:class:`HeldArray`);
2. the input dimension is cut into ceil(in / ``tile_size``) arrays of equal
   size, each a tile of its own as in aihwkit;
3. per array, DAC: each input row's slice is divided by its abs-max (noise
   management) and quantized to ``dac_bits`` over [-inp_bound, inp_bound];
4. per array: the MVM (on the CPU an int8 x int8 -> int32 product of the DAC's codes
   and the held codes, exact: :func:`int8_product`), per-read weight noise (pcm-hwa), a first-order IR-drop
   attenuation, Gaussian output noise, then the ADC: clip at ``out_bound`` and
   quantize to ``adc_bits``; input rows whose output saturates are retried at
   half scale, up to 4 times, as aihwkit does (bound management);
5. digital: partial outputs summed, scaled back, drift compensation applied,
   bias added.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import cache, cached_property

import torch
import torch.nn.functional as F
from torch import nn

from hilt.cim_sim.config import AnalogConfig, array_bounds, tile_unit
from hilt.cim_sim.devices import compiled, gaussian_, hashed_normal, stuck_at
from hilt.cim_sim.output_pass import output_pass
from hilt.errors import HiltError

_ZERO = torch.zeros(())  # addmm's ignored input (beta=0): a product scaled inside BLAS


# A sum of up to 1,040 products of codes within +-127 stays below 2^24 (127 * 127 * 1,040), below which
# float32 holds every integer: float32 products over this many inputs are exact.
_EXACT_FLOAT_TERMS = 1024


def _int8_product_by_floats(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """torch._int_mm(a, b), the same int32, through float32 BLAS products over the inner dimension in
    slices whose sums are exact."""
    k = a.shape[1]
    af, bf = a.float(), b.float()
    out = torch.empty(a.shape[0], b.shape[1], dtype=torch.int32) if out is None else out
    for k0 in range(0, k, _EXACT_FLOAT_TERMS):
        part = af[:, k0:k0 + _EXACT_FLOAT_TERMS] @ bf[k0:k0 + _EXACT_FLOAT_TERMS]
        if k0 == 0:
            out.copy_(part)
        else:
            out.add_(part.to(torch.int32))
    return out


@cache
def _faster_int8_product():
    """torch._int_mm or _int8_product_by_floats, whichever runs one array's product faster here."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-127, 128, (64, 1024), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (512, 1024), dtype=torch.int8, generator=g).T
    best = {}
    for f in (torch._int_mm, _int8_product_by_floats):
        try:
            f(x, w)
        except RuntimeError:  # a build without an int8 product on this CPU
            continue
        start = time.perf_counter()
        for _ in range(3):
            f(x, w)
        best[f] = time.perf_counter() - start
    return min(best, key=best.get)


def int8_product(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a (m, k) int8 @ b (k, n) int8 -> int32, exact: torch's int8 product where it is the faster (CPUs
    with int8 dot-product instructions), else float32 products (on a CPU without them, such as AVX2
    alone, torch's int8 product runs 20-30x slower than float32's). Chosen once per process by timing
    both on one array's shape; the two give the same integers, so the choice changes no result."""
    f = _faster_int8_product()
    return f(a, b) if out is None else f(a, b, out=out)


def _combine_eager(planes, column_scale):
    """The two int32 planes of an integer product (coarse codes, then fine codes) -> the product
    in ADC steps: (coarse + fine / FINE) x each column's scale."""
    n = planes.shape[-1] // 2
    return (planes[..., :n] + planes[..., n:] * (1 / FINE)) * column_scale


def _output_stage_eager(part, column_scale, keys, noise_scale, levels, noise: bool, adc: bool):
    """The product (float, or an integer product's planes with ``column_scale``), output noise (draw
    i of chip k a hash of i and chip k's keys: no sequential generator, so the pass is parallel and
    fused, and chip k's draws do not depend on the other chips), then the ADC: clip at +-levels and
    round -> (part, per-row peak before the clip, or None without an ADC)."""
    if column_scale is not None:
        part = _combine_eager(part, column_scale)
    if noise:
        part = part + noise_scale * hashed_normal(part[0].numel(), keys).view(part.shape)
    if not adc:
        return part, None
    return part.clamp(-levels, levels).round(), part.abs().amax(-1)


_output_stage_compiled = compiled(_output_stage_eager)


def _output_stage(part, column_scale, keys, noise_scale, levels, noise: bool, adc: bool, out=None, peak=None):
    """The output pass by the C kernel (cim_sim/output_pass.c), else by torch.compile: the same floats.
    ``out``, ``peak``: where to write them (float32, contiguous), else new tensors."""
    result = output_pass(part, column_scale, keys, noise_scale, levels, noise, adc, out=out, peak=peak)
    if result is None:
        result = _output_stage_compiled(part, column_scale, keys, noise_scale, levels, noise, adc)
        if out is not None:
            out.copy_(result[0])
            if adc:
                peak.copy_(result[1])
            result = out, peak if adc else None
    return result


def _input_stage_eager(x, in_step, levels, as_int8: bool):
    """Noise management and the DAC: each row divided by its abs-max, in DAC steps, clipped at
    +-levels and rounded -> (x in DAC steps, as int8 for the integer product, per-row scale).
    One compiled pass."""
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-12)
    xq = (x * (1 / (scale * in_step))).clamp(-levels, levels).round()
    return (xq.to(torch.int8) if as_int8 else xq), scale


_input_stage = compiled(_input_stage_eager)


class ChipForward:
    """What the analog layers of one forward of a model holding several chips share: the model's
    batch size, and whether an analog layer has run yet. Only analog layers stack rows per chip, so
    until the first has run every input is shared, whatever its row count (a model may reshape its
    batch to a multiple of the chip count); after it, a layer tells a shared input from a stacked
    one by its rows."""

    def __init__(self, batch: int):
        self.batch, self.stacked = batch, False


# What an array holds: each weight as two int8 codes against its row's step s (the row's abs-max /
# COARSE), w = s (coarse + fine / FINE): to 1/64,516 of the row's abs-max, far below the devices'
# programming and read noise, and exactly what an int8 x int8 -> int32 product computes with.
COARSE, FINE = 127, 254


def _hold_eager(w):
    """Weights (rows, k) -> (coarse codes, fine codes (rows, k) int8, each row's step s (rows,)).
    One compiled pass."""
    scale = w.abs().amax(-1, keepdim=True).clamp_min(1e-30) / COARSE
    coarse = (w / scale).round().clamp(-COARSE, COARSE)
    fine = ((w - coarse * scale) * (FINE / scale)).round().clamp(-COARSE, COARSE)  # |fine| <= FINE / 2
    return coarse.to(torch.int8), fine.to(torch.int8), scale.squeeze(-1)


_hold = compiled(_hold_eager)


@dataclass(frozen=True)
class HeldArray:
    """One crossbar array (input rows k0:k1) on every chip: what it holds, chips first."""

    k0: int
    k1: int
    codes: torch.Tensor  # (chips, 2 out, k) int8: the coarse codes' rows, then the fine codes'
    scale: torch.Tensor  # (chips, out): each row's step s

    @classmethod
    def of(cls, w: torch.Tensor, k0: int, k1: int) -> HeldArray:
        """The array holding ``w`` (chips, out, k)."""
        chips, out, k = w.shape
        # 2-D and contiguous: one shape family for the compiled pass (a chip count of 1 would compile apart)
        coarse, fine, scale = _hold(w.reshape(chips * out, k).contiguous())
        codes = torch.cat([coarse.view(chips, out, k), fine.view(chips, out, k)], 1)
        return cls(k0, k1, codes, scale.view(chips, out))

    @cached_property
    def w(self) -> torch.Tensor:
        """The held weights as floats (chips, out, k): for float products and the frozen model."""
        n = self.scale.shape[-1]
        return (self.codes[:, :n].float() + self.codes[:, n:].float() * (1 / FINE)) * self.scale.unsqueeze(-1)

    @cached_property
    def w_abs(self) -> torch.Tensor:
        """|w|, for per-read weight noise and IR drop."""
        return self.w.abs()


class AnalogMixin:
    """State and analog matrix-vector product shared by the analog Linear and Conv layers.

    A layer holds ``chips`` programmed copies of its arrays (``program(model, seeds=[...])``): with
    K > 1, ``w_eff`` is (K, out, in) and ``gdc_scale`` (K, out), and a forward takes the model's
    batch once (shared by every chip) or stacked chip-major (K x batch rows), returning K x batch
    rows, chip-major. Each chip draws its forward noise from its own generator, so chip k computes
    exactly what a one-chip model programmed and read with chip k's seeds computes.
    """

    config: AnalogConfig

    def _init_analog(self, weight: torch.Tensor, bias, config: AnalogConfig):
        self.config = config
        self.device_model = config.device_model()
        w = weight.detach().reshape(weight.shape[0], -1).float()
        if not torch.isfinite(w).all():
            raise HiltError("a weight of the model contains NaN or Inf; cannot map it to conductances")
        self.register_buffer("w_digital", w.clone())
        self.register_buffer("w_eff", w.clone())  # what the arrays hold now
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.w_max = float(w.abs().max()) or 1.0
        self.gdc_scale = torch.ones(w.shape[0])  # drift compensation, per output column
        self.chips = 1
        self.gens = [torch.Generator().manual_seed(0)]
        self.chip_forward = None  # the forward under way (ChipForward), set by cim_sim.model before each
        self.path = ""  # where the model holds this layer, for messages (set by cim_sim.model.program)
        self.column_unit = None  # weight_mapping="column": per output column, the weight mapped to g_max
        self.w_target = None  # the weights as mapped where smoothing or clipping changed them (else w_digital)
        self.clipped_share = 0.0  # the share of this layer's weights clipped by the mapping
        self.g_scale = None  # program: conductance per weight unit (scalar, per column or per weight)
        self.drift_draws = []  # program: each chip's generator state before its drift exponents' draw
        self.input_ranges = None  # input_range="static": one calibrated range per array (calibrate_inputs)
        self.input_scale = None  # smoothing: s per input channel (calibrate_inputs); the arrays hold W * s
        self.calibrating = False  # True while calibrate_inputs records inputs: the layer computes digitally
        if config.clip_std or config.clip_percentile or config.weight_mapping == "column":
            self._map_weights(w)

    def _map_weights(self, w: torch.Tensor) -> None:
        """The mapping options: the smoothing scales applied to the input columns, outliers clipped per
        output column, then the layer's or each column's abs-max taken as g_max."""
        c = self.config
        if self.input_scale is not None:
            w = w * self.input_scale
            self.w_target = w
        if c.clip_std or c.clip_percentile:
            if c.clip_std:
                limit = c.clip_std * w.std(1, keepdim=True, correction=0)
            else:
                k = max(1, min(w.shape[1], math.ceil(c.clip_percentile / 100 * w.shape[1])))
                limit = w.abs().kthvalue(k, dim=1, keepdim=True).values
            limit = torch.where(limit > 0, limit, w.abs().amax(1, keepdim=True))  # a constant column stays whole
            self.clipped_share = float((w.abs() > limit).double().mean())
            w = torch.maximum(torch.minimum(w, limit), -limit)
            self.w_target = w
        if c.weight_mapping == "column":
            self.column_unit = w.abs().amax(1).clamp_min(1e-30)
        else:
            self.w_max = float(w.abs().max()) or 1.0

    def smooth_inputs(self, x_absmax: torch.Tensor) -> torch.Tensor:
        """Set the smoothing scales from each input channel's calibrated abs-max and remap the weights
        (program the chips after it). A channel that never carried a signal, or whose weights are all
        zero, keeps scale 1. Returns the scales."""
        alpha = self.config.smoothing
        w_absmax = self.w_digital.abs().amax(0)
        live = (x_absmax > 0) & (w_absmax > 0)
        s = torch.where(live, x_absmax.clamp_min(1e-30) ** alpha / w_absmax.clamp_min(1e-30) ** (1 - alpha),
                        torch.ones_like(w_absmax))
        self.input_scale = s.float()
        self.w_target, self.clipped_share = None, 0.0
        self._map_weights(self.w_digital)
        return self.input_scale

    def held_weights(self) -> torch.Tensor:
        """What the arrays hold now in the digital layer's units (the smoothing scales taken out), shaped
        like ``w_eff``; drift compensation not applied."""
        return self.w_eff if self.input_scale is None else self.w_eff / self.input_scale

    def check_calibrated(self) -> None:
        """Refuse a forward that needs calibrate_inputs before it has run."""
        c = self.config
        if c.input_range == "static" and self.input_ranges is None:
            missing = "input_range='static' needs calibrated ranges"
        elif c.smoothing and self.input_scale is None:
            missing = "smoothing needs calibrated scales"
        else:
            return
        raise HiltError(f"analog layer {self.path or type(self).__name__}: {missing}; call "
                        "hilt.cim_sim.calibrate_inputs(model, run), then program")

    # -- device life cycle ------------------------------------------------------------------

    def program(self, gens: list[torch.Generator], out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Program the conductance pairs of one chip per generator: programming noise and drift
        exponents drawn once, each chip from its own generator.

        Returns the programmed conductances for the model to hold (cim_sim.model pools every layer's
        devices), chips first: G+ and G- stacked, each side ``devices_per_weight`` devices deep, in weight
        units (G / scale; a read is linear in G), written into ``out`` (chips, 2, devices per side) where
        given (the layer's place in the pool). None on the ideal device, whose weights are then the
        digital ones. The drift exponents are not stored: each chip's generator state before their draw
        is (``drift_draws``), and every read draws them again from it (read_pairs): held, they and the
        read-noise coefficients would triple the chip's memory.
        """
        self.chips = len(gens)
        self.gens = [torch.Generator().manual_seed(int(torch.randint(2**62, (1,), generator=g))) for g in gens]
        dev = self.device_model
        mapped = self.w_digital if self.w_target is None else self.w_target
        if dev is None:
            w = mapped.clone()
            self.set_weights(w if self.chips == 1 else w.expand(self.chips, *w.shape))
            return None
        if self.config.weight_mapping == "tile":
            scale = dev.g_max / tile_unit(mapped, self.config.tile_size)
        else:
            scale = dev.g_max / (self.w_max if self.column_unit is None else self.column_unit.view(-1, 1))
        self.g_scale = torch.as_tensor(scale, dtype=mapped.dtype)
        # G+ and G- stacked: one tensor op per step for both devices of every pair; n devices per side,
        # each at the pair's target (their reads are averaged)
        n = self.config.devices_per_weight
        g_target = torch.stack([mapped * scale, -mapped * scale]).clamp(0, dev.g_max).unsqueeze(1)
        g_target = g_target.expand(2, n, *mapped.shape).contiguous()
        out = torch.empty(len(gens), *g_target.shape, dtype=g_target.dtype) if out is None else \
            out.view(len(gens), *g_target.shape)
        self.drift_draws = []
        for k, gen in enumerate(gens):  # in each chip's generator, the draws of a one-chip programming
            g_prog = stuck_at(dev.program(g_target, gen), self.config.stuck_at_rate, dev.g_max, gen)
            self.drift_draws.append(gen.get_state())
            torch.randn(g_target.shape, generator=gen, dtype=g_target.dtype)  # the drift exponents' draws, dropped
            torch.div(g_prog, scale, out=out[k])
        return out

    def read_pairs(self, g: torch.Tensor, chip: int, t: float, keys: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """The weights chip ``chip`` holds t seconds after programming (before compensation), from its
        programmed devices ``g`` (2, devices): PCM.read_pairs with the drift exponents drawn again as
        ``program`` drew them."""
        shape = (2, self.config.devices_per_weight, *self.w_digital.shape)
        z = torch.randn(shape, generator=torch.Generator().set_state(self.drift_draws[chip]), dtype=g.dtype)
        mapped = self.w_digital if self.w_target is None else self.w_target
        return self.device_model.read_pairs(g.view(shape), z, mapped, self.g_scale, t, keys, start)

    def set_weights(self, w: torch.Tensor) -> None:
        """What the arrays hold now (a read of the devices): shaped like the digital weights, with a
        leading chip dimension when the layer holds several chips."""
        self.w_eff = w
        self._tiles_of = self._tile_list = None  # the old codes go now, before the next forward builds new ones

    def chip_rows(self, x: torch.Tensor) -> bool:
        """Whether a forward's input ``x`` is stacked one batch per chip (else shared by all chips)."""
        n, f = x.shape[0], self.chip_forward
        if self.chips == 1 or f is None:
            return False
        if not f.stacked:  # the forward's first analog layer: its input is the model's, shared, whatever its rows
            f.stacked = True  # its output is stacked per chip
            return False
        if n == f.batch:
            return False
        if n == self.chips * f.batch:
            return True
        raise HiltError(f"analog layer {self.path or type(self).__name__} holding {self.chips} chips got {n} input "
                        f"rows: expected the model's batch of {f.batch} (shared by the chips) or {self.chips} x "
                        f"{f.batch} (one batch per chip)")

    # -- the analog matrix-vector product ---------------------------------------------------

    def mvm(self, x: torch.Tensor, column_scale: torch.Tensor | None = None, bias=None) -> torch.Tensor:
        """x (rows, in) shared by the chips, or (chips, rows, in) -> (chips, rows, out) through DAC,
        tiled arrays, noise, ADC; then times ``column_scale`` (drift compensation) plus ``bias``,
        in the digital periphery (with ``config.gdc_before_adc``, the compensation is a gain ahead of
        the output noise and the ADC instead).

        Each array of ``tile_size`` inputs is a tile of its own, as in aihwkit: it scales
        its slice of the input (noise management) and retries its own saturated rows
        (bound management); the periphery sums the tiles' outputs.
        """
        if self.input_scale is not None:  # the digital periphery's smoothing division, before the DAC
            x = x / self.input_scale
        if self.is_ideal:
            y = torch.matmul(x, self.w_eff.view(self.chips, *self.w_digital.shape).transpose(1, 2))
        else:
            y = None
            tile_scale = getattr(self, "tile_scale", None)  # per-array drift compensation (gdc="aihwkit")
            ahead = self.config.gdc_before_adc and (column_scale is not None or tile_scale is not None)
            # with ``ahead``, the compensation is each array's gain ahead of its output noise and ADC, (chips, out)
            gain = None if not ahead else column_scale.view(self.chips, -1) if column_scale is not None else \
                torch.ones(self.chips, self.w_digital.shape[0])
            for i, array in enumerate(self.tiles()):  # a loop over arrays (a handful), not over devices
                array_gain = gain if tile_scale is None or not ahead else gain * tile_scale[:, i : i + 1]
                part, x_scale = self._tile_mvm(x[..., array.k0 : array.k1], array, gain=array_gain)
                if tile_scale is not None and not ahead:
                    x_scale = x_scale * tile_scale[:, i].view(-1, 1, 1)
                y = part.mul_(x_scale) if y is None else y.addcmul_(part, x_scale)
            if ahead:
                column_scale = None
        factor = 1.0 if self.is_ideal else self.w_unit * self.converter_steps()[1]  # ADC steps -> weights x inputs
        if self.column_unit is not None and not self.is_ideal:  # the arrays hold each column over its unit
            factor = self.column_unit.view(1, 1, -1) * factor
        if column_scale is not None:
            factor = column_scale.view(self.chips, 1, -1) * factor
        if bias is None:
            return y.mul_(factor)
        return torch.addcmul(bias, y, factor) if torch.is_tensor(factor) else y.mul_(factor).add_(bias)

    def _tile_mvm(self, x: torch.Tensor, array: HeldArray, fused: bool = True,
                  gain: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One array on every chip: noise management, DAC, MVM, ADC, bound management -> (ADC
        output in steps (chips, rows, out), input scale). ``fused``: the compiled passes (else the
        same functions run eagerly: for small one-off inputs that would only add compiled shapes).
        ``gain`` (chips, out): each column's gain ahead of the output noise and the ADC."""
        c = self.config
        in_step, out_step = self.converter_steps()
        as_int8 = self.integer_product
        if c.input_range == "static" and self.input_ranges is not None:  # (until calibrated: dynamic)
            xq, x_scale = self._static_input(x, array, in_step, as_int8)
        elif c.dac_bits is not None:
            # one shape family (3-D, contiguous) for the compiled pass, so that it compiles once
            x3 = (x if x.dim() == 3 else x.unsqueeze(0)).contiguous()
            stage = _input_stage if fused else _input_stage_eager
            xq, x_scale = stage(x3, *(torch.tensor(v, dtype=torch.float32) for v in (in_step, c.inp_bound / in_step)),
                                as_int8)
            if x.dim() == 2:
                xq, x_scale = xq[0], x_scale[0]
        else:
            xq, x_scale = x, torch.ones(*x.shape[:-1], 1)
        part, peak = self._read_out(xq, array, list(range(self.chips)), fused, gain=gain)
        bound = c.out_bound / out_step
        if not c.bound_management or peak is None or not bool((peak >= bound).any()):
            return part, x_scale
        # bound management: retry the saturated rows at half the input scale, every chip's in one pass;
        # chip k's rows are padded to the longest chip's (at least 2: a size-1 dimension would compile
        # apart), which moves none of its draws
        chip_of, row_of = (peak >= bound).nonzero(as_tuple=True)  # chip-major, rows ascending
        shared = x.dim() == 2
        factor = 1.0
        for _ in range(4):  # down to 1/16 of the input scale, as aihwkit (max_bm_res 0.25 at 7 DAC bits)
            if len(chip_of) == 0:
                break
            factor *= 2
            chip_ids, slot = torch.unique_consecutive(chip_of, return_inverse=True)
            counts = torch.bincount(slot)
            pos = torch.arange(len(slot)) - (counts.cumsum(0) - counts)[slot]  # each row's place in its chip's batch
            at = row_of if shared else (chip_of, row_of)
            xq = x[at].mul_(1 / (x_scale[at] * (factor * in_step)))
            if c.dac_bits is not None:
                xq.clamp_(-c.inp_bound / in_step, c.inp_bound / in_step).round_()
            batch = torch.zeros(len(chip_ids), max(2, int(counts.max())), x.shape[-1],
                                dtype=torch.int8 if as_int8 else xq.dtype)
            batch[slot, pos] = xq.to(batch.dtype)
            retry, retry_peak = self._read_out(batch, array, chip_ids.tolist(), fused, real_rows=counts.tolist(),
                                               gain=gain)
            part[chip_of, row_of] = retry[slot, pos].mul_(factor)
            still = retry_peak[slot, pos] >= bound
            chip_of, row_of = chip_of[still], row_of[still]
        return part, x_scale

    def _static_input(self, x, array: HeldArray, in_step: float, as_int8: bool):
        """Static input ranges: every row of the array's slice over the array's calibrated range, clipped
        at +-inp_bound (and through the DAC) -> (x in DAC steps, per-row scale: the range)."""
        r = float(self.input_ranges[array.k0])
        c = self.config
        xq = (x * (1 / (r * in_step))).clamp(-c.inp_bound / in_step, c.inp_bound / in_step)
        if c.dac_bits is not None:
            xq = xq.round()
        return (xq.to(torch.int8) if as_int8 else xq), torch.full((*x.shape[:-1], 1), r)

    def _read_out(self, xq: torch.Tensor, array: HeldArray, chip_ids: list[int], fused: bool = True,
                  real_rows: list[int] | None = None, gain: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One pass through ``array`` on the chips ``chip_ids``: xq the DAC's output in its steps
        (|xq| <= 1 / DAC step; int8 for the integer product), (rows, k) shared or (chips, rows, k)
        -> (ADC output in steps (chips, rows, out), per-row peak (chips, rows) before clipping; None
        without an ADC). ``real_rows``: how many leading rows of each chip's are inputs (the rest
        padding, which draws no per-read noise). ``gain`` (all chips, out): each column's gain ahead of the
        output noise and the ADC.

        Converters work in integer steps: the DAC's step is folded into the input scaling
        and the ADC's into the product's scale and the final scaling, so each pass over the data is one
        multiply, clip or round (this is most of the simulator's cost).
        """
        c = self.config
        in_step, out_step = self.converter_steps()
        to_steps = in_step / (out_step * self.w_unit)  # weights x DAC steps -> ADC steps
        gens = [self.gens[k] for k in chip_ids]
        n_chips, rows, n_out = len(chip_ids), xq.shape[-2], array.scale.shape[-1]
        chip_x = (lambda i: xq) if xq.dim() == 2 else (lambda i: xq[i])
        code_step = array.scale[chip_ids] if gain is None else array.scale[chip_ids] * gain[chip_ids]
        if xq.dtype == torch.int8 and not (xq.dim() == 2 and chip_ids == list(range(self.chips))):
            return self._read_out_by_chip(chip_x, array, chip_ids, rows, n_out, code_step * to_steps, fused)
        if xq.dtype == torch.int8:  # int8 x int8 -> int32: exact, two planes (coarse, fine codes)
            # an input every chip shares: one product against every chip's codes side by side (a
            # wider product runs faster than one per chip), read as (chips, rows, 2 out)
            wide = int8_product(xq, array.codes.view(-1, xq.shape[-1]).T)
            part = wide.view(rows, n_chips, 2 * n_out).transpose(0, 1)
            column_scale = (code_step * to_steps).unsqueeze(1)
        else:
            part, column_scale = torch.empty(n_chips, rows, n_out), None
            for i, k in enumerate(chip_ids):  # BLAS scales the product for free
                torch.addmm(_ZERO, chip_x(i), array.w[k].T, beta=0, alpha=to_steps, out=part[i])
        if c.w_noise or c.ir_drop:  # (float products only: see integer_product)
            # both need |w| against a function of x: one matmul for both
            moments = torch.cat([xq * xq, xq.abs()], -2)
            for i, k in enumerate(chip_ids):
                stats = torch.addmm(_ZERO, moments if xq.dim() == 2 else moments[i], array.w_abs[k].T, beta=0,
                                    alpha=1 / self.w_unit)
                if c.ir_drop:
                    # first-order IR drop (our approximation): a bit line carrying a large total
                    # current loses a share of it, 5% at full current on every row of the array
                    part[i] *= 1 - (0.05 * c.ir_drop * in_step / (array.k1 - array.k0)) * stats[rows:]
                if c.w_noise:  # per-read PCM noise: std w_noise * sqrt(sum_j |w_ij| x_j^2)
                    n = rows if real_rows is None else real_rows[i]
                    noise = torch.zeros(part.shape[1:])
                    gaussian_(noise[:n], gens[i]).mul_(stats[:n].sqrt_())
                    part[i].add_(noise, alpha=c.w_noise * in_step / out_step)
        if gain is not None and column_scale is None:
            part.mul_(gain[chip_ids].unsqueeze(1))
        if not c.out_noise and c.adc_bits is None:
            return (part if column_scale is None else _combine_eager(part, column_scale).contiguous()), None
        # product planes, output noise, ADC clip and round, row peaks: one pass over the outputs of every chip
        keys, noise_scale, levels = self._output_draws(gens)
        stage = _output_stage if fused else _output_stage_eager
        out, peak = stage(part, column_scale, keys, noise_scale, levels, bool(c.out_noise), c.adc_bits is not None)
        return out.contiguous(), peak  # chip-major rows, also when the planes were read side by side

    def _output_draws(self, gens):
        """The output pass's noise keys (two draws of each chip's generator), its noise scale and the ADC's
        levels, in ADC steps."""
        c, (_, out_step) = self.config, self.converter_steps()
        keys = torch.stack([torch.randint(-(2**31), 2**31, (2,), generator=g, dtype=torch.int32) for g in gens]) \
            if c.out_noise else torch.zeros(len(gens), 2, dtype=torch.int32)
        noise_scale, levels = (torch.tensor(v, dtype=torch.float32) for v in (c.out_noise / out_step, c.out_bound / out_step))
        return keys, noise_scale, levels

    def _read_out_by_chip(self, chip_x, array: HeldArray, chip_ids: list[int], rows: int, n_out: int,
                          column_scale: torch.Tensor, fused: bool):
        """_read_out's integer product with inputs of each chip's own, a chip at a time: its product's planes
        into one buffer that every chip reuses, then its output pass, so the planes stay in cache (all the
        chips' planes at once outgrow it: with 8 chips of MiniLM each product took 2.3-2.7x as long). The
        same floats as one pass over every chip: a chip's output noise is drawn from its own keys.
        ``column_scale`` (chips, out): each column's codes to ADC steps."""
        c = self.config
        gens = [self.gens[k] for k in chip_ids]
        planes = torch.empty(rows, 2 * n_out, dtype=torch.int32)
        column_scale = column_scale.unsqueeze(1)
        out = torch.empty(len(chip_ids), rows, n_out)
        if not c.out_noise and c.adc_bits is None:
            for i, k in enumerate(chip_ids):
                int8_product(chip_x(i), array.codes[k].T, out=planes)
                out[i] = _combine_eager(planes, column_scale[i])
            return out, None
        keys, noise_scale, levels = self._output_draws(gens)
        adc = c.adc_bits is not None
        peak = torch.empty(len(chip_ids), rows) if adc else None
        stage = _output_stage if fused else _output_stage_eager
        for i, k in enumerate(chip_ids):
            int8_product(chip_x(i), array.codes[k].T, out=planes)
            args = (planes.unsqueeze(0), column_scale[i : i + 1], keys[i : i + 1], noise_scale, levels, bool(c.out_noise),
                    adc)
            if fused:
                stage(*args, out=out[i : i + 1], peak=None if peak is None else peak[i : i + 1])
            else:
                o, p = stage(*args)
                out[i] = o[0]
                if adc:
                    peak[i] = p[0]
        return out, peak

    def converter_steps(self) -> tuple[float, float]:
        """(DAC step, ADC step) in normalised units (1 where a converter is off)."""
        return self.config.converter_steps()

    def tile_bounds(self) -> list[tuple[int, int]]:
        return array_bounds(self.w_digital.shape[1], self.config.tile_size)

    @property
    def integer_product(self) -> bool:
        """Whether the arrays compute with int8 x int8 -> int32 products: the DAC's codes fit int8
        (at most 8 bits), the layer is on the CPU (where :func:`int8_product` runs them at least as
        fast as float32 products of the held weights), and neither per-read weight noise nor IR drop needs the product as
        floats first. Both ways compute with the same held weights."""
        c = self.config
        return c.dac_bits is not None and c.dac_bits <= 8 and not (c.w_noise or c.ir_drop) \
            and self.w_eff.device.type == "cpu"

    def tiles(self) -> list[HeldArray]:
        """What each array holds on every chip (see :class:`HeldArray`), rebuilt when a read replaces
        the weights."""
        key = (id(self.w_eff), self.w_eff._version)  # set_weights also resets it; the version counts in-place writes
        if getattr(self, "_tiles_of", None) != key:
            w = self.w_eff.view(self.chips, *self.w_digital.shape)
            if self.column_unit is not None:
                w = w / self.column_unit.view(1, -1, 1)
            self._tile_list = [HeldArray.of(w[..., k0:k1], k0, k1) for k0, k1 in self.tile_bounds()]
            self._tiles_of = key
        return self._tile_list

    def array_readout(self) -> torch.Tensor:
        """aihwkit's drift-compensation read-out of every array on every chip: the identity (one
        input at a time) through the array's full forward (output noise, ADC), mean |y| over the
        array's whole output, in weight units -> (chips, arrays)."""
        out_step = self.converter_steps()[1]
        reads = []
        for array in self.tiles():
            part, _ = self._tile_mvm(torch.eye(array.k1 - array.k0), array, fused=False)  # a one-hot row's abs-max is 1
            reads.append((part.abs().mean((1, 2)) * (self.w_unit * out_step)).clamp_min(1e-4))
        return torch.stack(reads, 1)

    @property
    def w_unit(self) -> float:
        """The weight the arrays hold as 1: the layer's abs-max with weight scaling, else 1."""
        if self.column_unit is not None:
            return 1.0  # each column over its own unit already
        return self.w_max if self.config.weight_scaling else 1.0

    @property
    def is_ideal(self) -> bool:
        c = self.config
        return c.device == "ideal" and c.dac_bits is None and c.adc_bits is None and not c.out_noise \
            and not c.w_noise and not c.ir_drop and self.w_target is None and c.input_range == "dynamic"

    def _repeat_for_chips(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The ideal layer's output for every chip (they are all the digital layer)."""
        if self.chips == 1 or self.chip_rows(x):
            return y
        return y.repeat(self.chips, *([1] * (y.dim() - 1)))


class AnalogLinear(AnalogMixin, nn.Module):
    def __init__(self, linear: nn.Linear, config: AnalogConfig):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._init_analog(linear.weight, linear.bias, config)

    def forward(self, x):
        if self.is_ideal or self.calibrating:  # exactly the digital layer's arithmetic
            y = F.linear(x, self.w_digital.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
            return self._repeat_for_chips(y, x)
        self.check_calibrated()
        per_chip = self.chip_rows(x)
        flat = x.reshape(self.chips, -1, self.in_features) if per_chip else x.reshape(-1, self.in_features)
        y = self.mvm(flat.float(), self.gdc_scale, self.bias)
        lead = x.shape[:-1] if per_chip or self.chips == 1 else (self.chips * x.shape[0], *x.shape[1:-1])
        return y.reshape(*lead, self.out_features).to(x.dtype)


class _AnalogConv(AnalogMixin, nn.Module):
    """Convolution as an analog MVM over unfolded patches (im2col), as crossbar accelerators do."""

    dims: int
    conv_type: type

    def __init__(self, conv, config: AnalogConfig):
        nn.Module.__init__(self)
        if conv.groups != 1 or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            raise HiltError(f"analog {type(conv).__name__} supports groups=1, zero padding given as numbers")
        if config.needs_calibration:
            raise HiltError(f"analog {type(conv).__name__}: smoothing and static input ranges are calibrated for "
                            "Linear layers only; convert the convolutions with a config without them")
        self.out_channels, self.kernel_size = conv.out_channels, conv.kernel_size
        self.stride, self.padding, self.dilation = conv.stride, conv.padding, conv.dilation
        self._init_analog(conv.weight, conv.bias, config)

    def forward(self, x):
        if self.is_ideal:  # exactly the digital layer's arithmetic
            weight = self.w_digital.view(self.out_channels, -1, *self.kernel_size).to(x.dtype)
            conv = F.conv1d if self.dims == 1 else F.conv2d
            return self._repeat_for_chips(conv(x, weight, self.bias, self.stride, self.padding, self.dilation), x)
        if x.dim() != self.dims + 2:
            raise HiltError(f"analog layer {self.path or type(self).__name__} takes (batch, channels, "
                            f"{'length' if self.dims == 1 else 'height, width'}) inputs, got shape {tuple(x.shape)}")
        per_chip = self.chip_rows(x)
        n = x.shape[0] * (1 if per_chip else self.chips)  # output batch
        cols, out_size = self._patches(x.float())
        y = self.mvm(cols.view(self.chips, -1, cols.shape[1]) if per_chip else cols, self.gdc_scale, self.bias)
        positions = math.prod(out_size)
        return y.view(n, positions, self.out_channels).transpose(1, 2).reshape(n, self.out_channels, *out_size).to(x.dtype)

    def _patches(self, x):
        """im2col as a strided view then one copy: (n * positions, C * kernel), in F.unfold's order.

        Much faster on the CPU than F.unfold (measured 20x on a 256 x 16 x 14 x 14 batch).
        """
        k, s, p, d = self.kernel_size, self.stride, self.padding, self.dilation
        xp = F.pad(x, [side for pad in reversed(p) for side in (pad, pad)])
        n, c, *size = xp.shape
        out = [(size[i] - d[i] * (k[i] - 1) - 1) // s[i] + 1 for i in range(self.dims)]
        st = xp.stride()
        view = xp.as_strided((n, *out, c, *k), (st[0], *(st[2 + i] * s[i] for i in range(self.dims)), st[1],
                                                *(st[2 + i] * d[i] for i in range(self.dims))))
        return view.reshape(n * math.prod(out), c * math.prod(k)), out


class AnalogConv1d(_AnalogConv):
    dims, conv_type = 1, nn.Conv1d


class AnalogConv2d(_AnalogConv):
    dims, conv_type = 2, nn.Conv2d
