"""The chip of IBM's Analog Foundation Models (Büchel et al., NeurIPS 2025) as their public code defines it:
its evaluation noise and its analog forward, for the yardstick a published result gives (docs/references.md §12
says where each constant comes from).

Programming noise (:func:`pcm_noise`, :func:`additive_noise`), drawn once per chip, no drift: each output row
of a weight matrix, cut into parts of at most ``tile_inputs`` inputs, is scaled so that its largest |w| is
G_MAX = 180; every weight gets Gaussian noise whose sigma is a cubic in the scaled |w| (one fit up to 52.5,
another above); weights under 0.6 after scaling read 0; the row is scaled back. Or, ``noise="additive"``:
Gaussian noise of ``additive_std`` times the part's largest |w|.

The forward (:class:`AfmLinear`): the input clipped to the layer's static range r and rounded to 2^dac_bits - 2
steps over [-r, r]; the product with the weights as programmed; the output rounded to 2^adc_bits - 2 steps over
[-b, b] and clipped there, b = r * out_bound * max_j |w_ij| per output row (the ranges scale with the
weights, so the converters see every row at full scale). Static ranges start as their training starts them:
the mean over calibration batches of ``range_std_alpha`` times the input's standard deviation.

Training (``hilt hwa --method afm``): the same forward with the rounding passed straight through, the range
learned by their rule (:class:`_RangeClip`), Gaussian weight noise per output row (``weight_noise`` times the
row's abs-max) and output noise drawn every forward, and each row clipped to ``clip_sigma`` standard
deviations after each step (:func:`clip_rows_`).
"""

from __future__ import annotations

import copy
import math
import typing
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from hilt.cim_sim.config import array_bounds
from hilt.errors import HiltError

G_MAX = 180.0  # the largest scaled weight (their GMAX)
BRANCH = 52.5  # where the second fit takes over (their OD_TD_DIVERGENCE)
ZEROED_BELOW = 0.6  # scaled weights under this read 0
# sigma(|w|) = p0 |w|^3 + p1 |w|^2 + p2 |w| + p3, in the units of the scaled weight; the first fit below BRANCH,
# the second above it
SIGMA_LOW = (2.939751381126213e-05, -0.00371581208142707, 0.22419685954327148, 2.5797410660159494)
SIGMA_HIGH = (1.2329755395573392e-05, -0.003054993405157235, 0.2453487119885723, 2.110295720240385)
NOISE_KINDS = ("pcm", "additive", "none")
RANGES_FILE = "afm_input_ranges.json"  # a tuned model's learned input ranges, beside its weights


@dataclass(frozen=True)
class AfmConfig:
    noise: str = "pcm"  # "pcm", "additive" or "none"
    additive_std: float = 0.05  # additive: the noise's std over the part's largest |w|
    tile_inputs: int = 512  # inputs per part a row is scaled in (0: the whole row)
    dac_bits: int | None = 8
    adc_bits: int | None = 8
    out_bound: float = 14.0  # the ADC's range in units of r * max_j |w_ij|
    range_std_alpha: float = 18.0  # a static range starts at this many input standard deviations

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            kind = (typing.get_args(_HINTS[f.name]) or (_HINTS[f.name],))[0]
            if value is None and f.name in ("dac_bits", "adc_bits"):
                continue
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (isinstance(value, str) if kind is str else number and (kind is float or isinstance(value, int))):
                raise HiltError(f"AfmConfig.{f.name}: expected {kind.__name__}, got {value!r}")
            if f.name in RANGES:
                lo, hi, open_low = RANGES[f.name]
                if not math.isfinite(value) or (value <= lo if open_low else value < lo) or (hi is not None and value > hi):
                    raise HiltError(f"AfmConfig.{f.name}: {'above' if open_low else 'at least'} {lo:g}"
                                    + (f" and at most {hi:g}" if hi is not None else "") + f"; got {value!r}")
        if self.noise not in NOISE_KINDS:
            raise HiltError(f"AfmConfig.noise: {self.noise!r}; choose {', '.join(NOISE_KINDS)}")


_HINTS = typing.get_type_hints(AfmConfig)
# Each numeric field's range: (lowest, highest or None, whether the lowest itself is excluded)
RANGES = {"additive_std": (0.0, None, False), "tile_inputs": (0, None, False), "dac_bits": (2, 24, False),
          "adc_bits": (2, 24, False), "out_bound": (0.0, None, True), "range_std_alpha": (0.0, None, True)}


def _row_parts(w: torch.Tensor, tile_inputs: int) -> torch.Tensor:
    """Each weight's part abs-max, shaped like ``w`` (out, in): parts of at most ``tile_inputs`` inputs per row, cut
    into equal sizes (within one) as the arrays cut a layer; 0 or fewer: the whole row."""
    if tile_inputs <= 0:
        return w.abs().amax(1, keepdim=True).expand_as(w)
    out = torch.empty_like(w)
    for k0, k1 in array_bounds(w.shape[1], tile_inputs):
        out[:, k0:k1] = w[:, k0:k1].abs().amax(1, keepdim=True)
    return out


def pcm_sigma(g: torch.Tensor) -> torch.Tensor:
    """The programming noise's std at scaled |w| = ``g`` (0 .. G_MAX): the fitted cubic of its branch, computed in
    float64 and rounded to float16 as their code rounds it."""
    g64 = g.double()
    low = sum(c * g64 ** (3 - i) for i, c in enumerate(SIGMA_LOW))
    high = sum(c * g64 ** (3 - i) for i, c in enumerate(SIGMA_HIGH))
    return torch.where(g64 > BRANCH, high, low).half().to(g.dtype)


def pcm_noise(w: torch.Tensor, tile_inputs: int, gen: torch.Generator) -> torch.Tensor:
    """``w`` as programmed on their PCM: scaled per row part to G_MAX, noised, small weights zeroed, scaled back."""
    w = w.float()
    scale = G_MAX / (_row_parts(w, tile_inputs) + torch.finfo(torch.float16).tiny)
    g = w * scale
    noisy = g + torch.randn(g.shape, generator=gen) * pcm_sigma(g.abs())
    noisy[g.abs() < ZEROED_BELOW] = 0.0
    return noisy / scale


def additive_noise(w: torch.Tensor, std: float, tile_inputs: int, gen: torch.Generator) -> torch.Tensor:
    """``w`` plus Gaussian noise of ``std`` times its row part's abs-max."""
    w = w.float()
    return w + std * _row_parts(w, tile_inputs) * torch.randn(w.shape, generator=gen)


def _ste_round(v: torch.Tensor) -> torch.Tensor:
    return v + (v.round() - v).detach()


class _RangeClip(torch.autograd.Function):
    """clamp(x, -r, r) with their gradients: none to x where it was clipped; to r only the part that would widen
    the range (from the clipped inputs), times r, plus ``decay`` r whenever more than ``min_unclipped`` of the
    inputs were not clipped (so an unused range shrinks)."""

    @staticmethod
    def forward(ctx, x, r, decay: float, min_unclipped: float):
        upper, lower = x >= r, x <= -r
        ctx.save_for_backward(upper, lower, r, x.abs() == r)
        ctx.decay, ctx.min_unclipped = decay, min_unclipped
        return torch.minimum(torch.maximum(x, -r), r)

    @staticmethod
    def backward(ctx, d):
        upper, lower, r, at_edge = ctx.saved_tensors
        clipped = upper | lower
        dx = d.masked_fill(clipped & ~at_edge, 0.0)
        dr = (d[upper].clamp(max=0.0).sum() - d[lower].clamp(min=0.0).sum()) * r
        unclipped = 1.0 - clipped.sum() / clipped.numel()
        if ctx.decay > 0:
            dr = dr + ctx.decay * r * (unclipped > ctx.min_unclipped)
        return dx, dr.reshape(r.shape).to(r.dtype), None, None


@dataclass(frozen=True)
class AfmTraining:
    """The recipe's per-forward noise and range learning (their training configuration's values by default)."""

    weight_noise: float = 0.03  # Gaussian weight noise per row, std over the row's abs-max
    out_noise: float = 0.0  # Gaussian output noise, std over r * the layer's largest |w|
    learn_ranges: bool = True
    range_decay: float = 0.01
    min_unclipped: float = 0.95


class AfmLinear(nn.Module):
    """A Linear on the AFM chip (see the module doc). Shares ``weight`` and ``bias`` with the layer it replaces;
    ``input_range`` is its static range r; ``clean`` keeps the weights before programming noise."""

    def __init__(self, linear: nn.Linear, config: AfmConfig):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.input_range = nn.Parameter(torch.tensor(3.0), requires_grad=False)  # their init value, before data
        self.config = config
        self.training_noise: AfmTraining | None = None
        self.gen: torch.Generator | None = None  # the draws of training noise
        self.clean: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, r={float(self.input_range):.4g}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg, train = self.config, self.training_noise if self.training else None
        r = self.input_range
        w = self.weight
        w_max = w.detach().abs().amax(1)
        if train is not None and train.weight_noise > 0:
            w = w + train.weight_noise * w_max[:, None] * torch.randn(w.shape, generator=self.gen)
        learn = train is not None and train.learn_ranges and r.requires_grad
        x = _RangeClip.apply(x, r if learn else r.detach(), train.range_decay if learn else 0.0,
                             train.min_unclipped if learn else 0.0)
        r = r.detach()
        tiny = torch.finfo(x.dtype).tiny  # a zero range or an all-zero row reads 0, as their rounding has it
        if cfg.dac_bits is not None:
            step = (2 * r / (2**cfg.dac_bits - 2)).clamp_min(tiny)
            x = _ste_round(x / step) * step
        y = F.linear(x, w.to(x.dtype))
        if train is not None and train.out_noise > 0:
            y = y + train.out_noise * w_max.max() * r * torch.randn(y.shape, generator=self.gen)
        if cfg.adc_bits is not None:
            bound = (r * cfg.out_bound * w_max).to(y.dtype)
            step = (2 * bound / (2**cfg.adc_bits - 2)).clamp_min(tiny)
            y = torch.minimum(torch.maximum(_ste_round(y / step) * step, -bound), bound)
        return y if self.bias is None else y + self.bias


def afm_layers(model: nn.Module) -> list[tuple[str, AfmLinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, AfmLinear)]


def to_afm(model: nn.Module, config: AfmConfig, inplace: bool = False) -> nn.Module:
    """Every Linear but an LM head (``lm_head``/``output``, kept digital as on hilt's other chips) replaced by an
    :class:`AfmLinear` sharing its parameters; on a copy unless ``inplace``."""
    from hilt.quant.nn import replace_modules

    model = model if inplace else copy.deepcopy(model)

    def swap(name, module):
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in ("lm_head", "output"):
            return AfmLinear(module, config)
        return None

    if replace_modules(model, swap) == 0:
        raise HiltError("the model has no Linear layer to put on the chip")
    return model


def from_afm(model: nn.Module) -> dict[str, float]:
    """Each AfmLinear back to an nn.Linear with the same parameters (in place); returns the input ranges by layer."""
    from hilt.quant.nn import replace_modules

    ranges = {}

    def swap(name, module):
        if isinstance(module, AfmLinear):
            ranges[name] = float(module.input_range)
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            linear.weight, linear.bias = module.weight, module.bias
            return linear
        return None

    replace_modules(model, swap)
    return ranges


@torch.no_grad()
def calibrate_ranges(model: nn.Module, run) -> None:
    """Each layer's static range as their training starts it: the mean over the batches ``run(model)`` feeds of
    ``range_std_alpha`` times the batch's input standard deviation."""
    sums, counts = {}, {}

    def hook(name, alpha):
        def record(module, args):
            std = float(args[0].float().std())
            if std > 0:
                sums[name] = sums.get(name, 0.0) + alpha * std
                counts[name] = counts.get(name, 0) + 1
        return record

    layers = afm_layers(model)
    was = model.training
    model.eval()
    hooks = [m.register_forward_pre_hook(hook(n, m.config.range_std_alpha)) for n, m in layers]
    try:
        run(model)
    finally:
        for h in hooks:
            h.remove()
        model.train(was)
    for name, m in layers:
        if name not in counts:
            raise HiltError(f"layer {name}: no input reached it while calibrating its input range")
        m.input_range.fill_(sums[name] / counts[name])


@torch.no_grad()
def set_ranges(model: nn.Module, ranges: dict[str, float], where: str = "input ranges") -> None:
    """The layers' static ranges from ``ranges`` (layer name -> r, as :func:`from_afm` returns them)."""
    layers = dict(afm_layers(model))
    if set(ranges) != set(layers):
        missing, extra = sorted(set(layers) - set(ranges)), sorted(set(ranges) - set(layers))
        raise HiltError(f"{where}: " + "; ".join(
            p for p in (missing and f"no range for {', '.join(missing[:3])}", extra and f"no layer {', '.join(extra[:3])}")
            if p))
    for name, r in ranges.items():
        if not (isinstance(r, (int, float)) and math.isfinite(r) and r > 0):
            raise HiltError(f"{where}: layer {name}'s range {r!r} is not a positive number")
        layers[name].input_range.fill_(float(r))


@torch.no_grad()
def program(model: nn.Module, gen: torch.Generator) -> nn.Module:
    """One chip: every AfmLinear's weights drawn anew from its clean weights by the configured noise."""
    for _, m in afm_layers(model):
        if m.clean is None:
            m.clean = m.weight.detach().clone()
        cfg = m.config
        if cfg.noise == "pcm":
            noisy = pcm_noise(m.clean, cfg.tile_inputs, gen)
        elif cfg.noise == "additive":
            noisy = additive_noise(m.clean, cfg.additive_std, cfg.tile_inputs, gen)
        else:
            noisy = m.clean
        m.weight.copy_(noisy.to(m.weight.dtype))
    return model


@torch.no_grad()
def clip_rows_(model: nn.Module, sigma: float) -> float:
    """Every AfmLinear's rows clipped to ``sigma`` times the row's standard deviation (in place), as their training
    clips after each step. Returns the share of weights clipped."""
    clipped = total = 0
    for _, m in afm_layers(model):
        w = m.weight.data
        limit = sigma * w.std(1, keepdim=True)
        clipped += int((w.abs() > limit).sum())
        total += w.numel()
        torch.maximum(torch.minimum(w, limit), -limit, out=w)
    return clipped / max(total, 1)
