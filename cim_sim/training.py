"""Training for analog hardware: noise injection and DWP (diversity-aware weight perturbation).

Both train the clean weights through noisy copies of them. A noisy copy replaces
the weight of every Linear and Conv2d layer (the layers `convert_to_analog`
puts on arrays; biases stay digital) by a perturbed one drawn from a cim_sim
device model:

* ``mismatch`` (default): w (1 + eta N(0, 1)), the generic robustness model;
  the gradient reaches w through the multiplicative factor;
* ``pcm`` / ``rram``: w mapped to conductance pairs (the layer's abs-max, each output column's
  or each tile's, to g_max, as ``AnalogConfig.weight_mapping``), programmed, read at a time
  drawn log-uniformly between 1 s and 1 year (or a range given), globally compensated; eta scales
  the device's programming and read noise (eta = 1 is the published device).
  The gradient passes straight through the device (w + (w_device - w).detach()).
  Programming, drift exponent and read noise are drawn in one compiled pass from
  counter-based normals (devices.hashed_normal): the device model's distribution, at the
  cost of one read per step (a language model's 100M weights in about a second).

``noise`` (hardware-aware training): one copy per step at a fixed eta.

``dwp``: K copies per step, their eta spread evenly over [eta_min, eta_max]
(the diversity). Each sample gets a disagreement d(x) across the K copies:

* ``js``: the Jensen-Shannon divergence of the K predictive distributions,
  H(mean_k p_k) - mean_k H(p_k);
* ``error``: the fraction of copies that misclassify x;
* ``none``: d = 1 (diverse noise injection without weighting, for the ablation).

Sample weights a(x) = clip(d(x) / mean_batch d, clip_min, clip_max), renormalised
to mean 1, with no gradient through them; the loss is
mean_x a(x) mean_k CE(f_{W_k}(x), y). Hard samples for the perturbed networks
(those the copies disagree on) pull harder on the clean weights.

Language models (``hilt hwa``) are distilled from their digital model instead of trained on labels:
KL(digital || copy) per token for a causal LM, 1 - cosine per sentence embedding for an encoder, the
samples being tokens or sentences. Iterative weight clipping (``clip_columns_``) keeps each output
column within k standard deviations after every step, so that no outlier sets the column's
conductance range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from hilt.cim_sim.config import WEIGHT_MAPPINGS, array_bounds, tile_unit
from hilt.cim_sim.devices import PCM, RRAM, compiled, hashed_normal
from hilt.errors import HiltError

NOISE_MODELS = ("mismatch", "pcm", "rram")
WEIGHTINGS = ("js", "error", "none")
_YEAR = 31557600.0


@dataclass(frozen=True)
class NoisyTraining:
    """How the weights are perturbed during training; see the module docstring."""

    method: str = "dwp"
    noise_model: str = "mismatch"
    eta: float = 0.3  # noise injection: the fixed level
    eta_min: float = 0.1  # dwp: the range the K copies' levels spread over
    eta_max: float = 0.6
    copies: int = 4  # dwp: K
    weighting: str = "js"
    clip_min: float = 0.25
    clip_max: float = 4.0

    def validate(self) -> NoisyTraining:
        if self.method not in METHODS:
            raise HiltError(f"unknown training method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.noise_model not in NOISE_MODELS:
            raise HiltError(f"unknown training noise model {self.noise_model!r}; choose one of {', '.join(NOISE_MODELS)}")
        if self.weighting not in WEIGHTINGS:
            raise HiltError(f"unknown DWP weighting {self.weighting!r}; choose one of {', '.join(WEIGHTINGS)}")
        if not (self.eta >= 0 and 0 <= self.eta_min <= self.eta_max):
            raise HiltError(f"noise levels must satisfy eta >= 0 and 0 <= eta_min <= eta_max "
                            f"(got eta {self.eta}, range {self.eta_min}..{self.eta_max})")
        fewest = METHODS[self.method].min_copies
        if not isinstance(self.copies, int) or self.copies < fewest:
            raise HiltError(f"--method {self.method} needs at least {fewest} noisy copies per step, got {self.copies}")
        if not 0 < self.clip_min <= 1 <= self.clip_max:
            raise HiltError(f"sample-weight clip must satisfy 0 < min <= 1 <= max, got {self.clip_min}..{self.clip_max}")
        return self

    def levels(self) -> list[float]:
        """The noise level of each copy drawn per step (none: trained on the clean weights)."""
        return METHODS[self.method].levels(self)


@dataclass(frozen=True)
class TrainingMethod:
    """What a training method does per step, so that the loss and the checks read it, not the name."""

    levels: Callable[[NoisyTraining], list[float]]  # the noise level of each copy drawn per step
    weighted: bool = False  # samples weighted by the copies' disagreement (DWP)
    min_copies: int = 1  # the fewest copies ``NoisyTraining.copies`` may say


def _spread(cfg: NoisyTraining) -> list[float]:
    k = cfg.copies
    return [cfg.eta_min + (cfg.eta_max - cfg.eta_min) * i / (k - 1) for i in range(k)]


METHODS: dict[str, TrainingMethod] = {
    "standard": TrainingMethod(lambda cfg: []),
    "noise": TrainingMethod(lambda cfg: [cfg.eta]),
    "dwp": TrainingMethod(_spread, weighted=True, min_copies=2),
}


def analog_weights(model: nn.Module) -> list[str]:
    """Names of the parameters a CIM chip would hold: the weights of every Linear and Conv2d but a language
    model's ``lm_head``, which convert_to_analog keeps digital (tied to the embedding, it has no name of its own)."""
    return [f"{name}.weight" if name else "weight" for name, m in model.named_modules()
            if isinstance(m, (nn.Linear, nn.Conv2d)) and name.rsplit(".", 1)[-1] != "lm_head"]


def _device_read(target, keys, log_t, read_sigma, device):
    """One chip's G+ - G- for conductance targets ``target`` (pairs stacked on dim 0): programmed,
    drift exponents drawn, read at log(T / t0) = ``log_t``, as PCM.program / drift_exponent / read."""
    n = target.numel()
    z = hashed_normal(3 * n, keys).view(3, *target.shape)
    g = (target + device.programming_sigma(target) * z[0]).clamp_min(0)
    mu, sd, factor = device.drift_law(target)
    nu = (mu + sd * z[1]).abs() * factor
    g_t = g * torch.exp(nu * -log_t)
    g_t = (g_t + read_sigma * g_t * device.read_noise_coefficient(g) * z[2]).clamp_min(0)
    return g_t[0] - g_t[1]


_device_read_compiled = compiled(_device_read)


def perturb(w: torch.Tensor, eta: float, noise_model: str, gen: torch.Generator,
            mapping: str = "layer", tile: int = 512, times: tuple[float, float] = (1.0, _YEAR),
            devices: int = 1, return_gain: bool = False) -> torch.Tensor | tuple[torch.Tensor, float]:
    """One noisy copy of weight ``w`` (differentiable to w), per the module docstring. ``mapping``:
    the device models' weight mapping, "layer", "column" or "tile" (AnalogConfig.weight_mapping; ``tile``:
    its tile_size). ``times``: the device models' read time is drawn log-uniformly between these (seconds).
    ``devices``: devices per side of a weight (AnalogConfig.devices_per_weight), their reads averaged.
    ``return_gain``: also return the global drift compensation factor applied (1 for ``mismatch``)."""
    if noise_model == "mismatch":
        noisy = w * (1 + eta * torch.randn(w.shape, generator=gen, dtype=w.dtype))
        return (noisy, 1.0) if return_gain else noisy
    if mapping not in WEIGHT_MAPPINGS:
        raise HiltError(f"unknown weight mapping {mapping!r}; choose {', '.join(WEIGHT_MAPPINGS)}")
    device = {"pcm": PCM, "rram": RRAM}[noise_model](prog_noise_scale=eta, read_noise_scale=eta)
    with torch.no_grad():
        wd = w.detach().float().reshape(w.shape[0], -1)
        unit = wd.abs().amax(1, keepdim=True) if mapping == "column" else tile_unit(wd, tile) if mapping == "tile" \
            else wd.abs().max().view(1, 1)
        scale = device.g_max / unit.clamp_min(1e-30)
        target = torch.stack([(wd * scale).clamp_min(0), (-wd * scale).clamp_min(0)])
        if devices > 1:  # the devices of a side stacked on the rows: the compiled read keeps its shapes' rank
            target = target.unsqueeze(1).expand(2, devices, *wd.shape).reshape(2, devices * wd.shape[0], -1)
        lo, hi = math.log(times[0]), math.log(times[1])
        t = math.exp(lo + float(torch.rand((), generator=gen)) * (hi - lo))  # log-uniform
        keys = torch.randint(-(2**31), 2**31, (2,), generator=gen, dtype=torch.int32)
        log_t, sigma = (torch.tensor(v) for v in (math.log((t + device.t0) / device.t0), device.read_sigma(t)))
        w_t = _device_read_compiled(target, keys, log_t, sigma, device)
        w_t = (w_t.view(devices, *wd.shape).mean(0) if devices > 1 else w_t) / scale
        gain = wd.abs().sum() / w_t.abs().sum().clamp_min(1e-12)
        w_t *= gain  # global drift compensation
    noisy = w + (w_t.view(w.shape).to(w.dtype) - w).detach()
    return (noisy, float(gain)) if return_gain else noisy


class Periphery:
    """A chip's periphery as a training read sees it: each analog Linear's input through the DAC and its
    output through the output noise and the ADC, array by array, as the chip's layers compute them
    (cim_sim/analog.py), the gradient passing straight through the converters.

    Per array j of a layer (``tile_size`` inputs) and token row r, the chip divides the row's slice of
    x / s (s: the smoothing scales) by a_rj, its abs-max (static ranges: the array's calibrated range,
    clipped beyond it; no DAC and dynamic ranges: 1), rounds it to the DAC's steps, and reads the product
    in units of the weight the arrays hold as 1, u_o (weight_mapping="column": column o's abs-max of W s,
    before a percentile clip the mapping would apply). The output noise
    (std ``out_noise``) and the ADC's rounding (a step's uniform error, variance step^2 / 12) are added in
    those units, so in the layer's units output o of row r carries noise of variance
    u_o^2 (out_noise^2 + step^2 / 12) sum_j a_rj^2: one normal draw per output. Noise in the compensated
    output is multiplied by the layer's drift compensation unless the chip applies it ahead of the ADC
    (``gdc_before_adc``). The ADC's rounding enters as noise of its variance, not as the rounding itself
    (that would need each array's output apart), and its clip is left out (bound management retries
    saturated rows).

    The smoothing scales and static ranges are the deployment's, calibrated once on the model as it
    starts (:meth:`calibrated`)."""

    def __init__(self, config, scales: dict, ranges: dict):
        self.config, self.scales, self.ranges = config, scales, ranges  # per analog Linear's path

    @classmethod
    def calibrated(cls, model: nn.Module, config, run) -> Periphery:
        """The periphery of ``model`` on a chip of ``config``, its smoothing scales and static ranges
        calibrated by ``run(model)`` as cim_sim.calibrate_inputs does for the deployment."""
        import dataclasses

        from hilt.cim_sim.analog import AnalogLinear
        from hilt.cim_sim.model import analog_layers, calibrate_inputs, convert_to_analog

        # an ideal device: calibration computes digitally, so programming devices would only cost memory
        probe = convert_to_analog(model, dataclasses.replace(config, device="ideal", devices_per_weight=1))
        if config.needs_calibration:
            calibrate_inputs(probe, run)
        layers = analog_layers(probe)
        for name, layer in layers:
            if not isinstance(layer, AnalogLinear):
                kind = type(layer).__name__.removeprefix("Analog")
                raise HiltError(f"periphery noise in training covers Linear layers; {name} is a {kind}")
        return cls(config, {n: layer.input_scale for n, layer in layers},
                   {n: layer.input_ranges for n, layer in layers})

    def unit(self, w: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
        """The weight each output column's arrays hold as 1 (AnalogMixin.w_unit and column_unit), (out,)."""
        w = w.detach().float()
        if s is not None:
            w = w * s
        if self.config.weight_mapping == "column":
            return w.abs().amax(1).clamp_min(1e-30)
        return (w.abs().max() if self.config.weight_scaling else torch.ones(())).expand(w.shape[0])

    def attach(self, model: nn.Module, weights: dict[str, torch.Tensor], gen: torch.Generator,
               gains: dict[str, float] | None = None) -> list:
        """Hooks on ``model``'s chip layers that read them through this periphery (remove them after the
        forward). ``weights``: the weights as programmed (by name; they set each column's unit, as the
        mapping does); ``gains``: each layer's drift compensation factor (by name), where it multiplies the
        noise. Noise is drawn from ``gen``."""
        c = self.config
        in_step, out_step = c.converter_steps()
        sigma = math.sqrt(c.out_noise**2 + (out_step**2 / 12 if c.adc_bits is not None else 0.0))
        modules = dict(model.named_modules())
        handles = []
        for name, s in self.scales.items():
            m, ranges = modules[name], self.ranges[name]
            bounds = array_bounds(m.in_features, c.tile_size)
            gain = 1.0 if c.gdc_before_adc or gains is None else gains[f"{name}.weight"]
            unit = self.unit(weights[f"{name}.weight"], s)
            seen = {}

            def before(mod, args, s=s, ranges=ranges, bounds=bounds, seen=seen):
                x = args[0]
                xs = x if s is None else x / s
                parts, squares = [], 0
                for k0, k1 in bounds:
                    part = xs[..., k0:k1]
                    if ranges is not None:  # static: the array's range, what lies beyond it clipped
                        a = torch.full((*x.shape[:-1], 1), float(ranges[k0]))
                        part = torch.maximum(torch.minimum(part, a * c.inp_bound), -a * c.inp_bound)
                    elif c.dac_bits is not None:  # noise management: the row's own abs-max
                        a = part.detach().abs().amax(-1, keepdim=True).clamp_min(1e-12)
                    else:  # no DAC: the row as it comes
                        a = torch.ones((*x.shape[:-1], 1))
                    if c.dac_bits is not None:
                        part = (part / (a * in_step)).round() * (a * in_step)
                    parts.append(part)
                    squares = squares + a.detach() ** 2
                seen["a2"] = squares
                read = torch.cat(parts, -1) if len(parts) > 1 else parts[0]
                if s is not None:
                    read = read * s
                return (x + (read - x).detach(),) + args[1:]

            def after(mod, args, y, unit=unit, gain=gain, seen=seen):
                if not sigma:
                    return y
                scale = (seen.pop("a2").sqrt() * unit) * (sigma * gain)
                return y + torch.randn(y.shape, generator=gen, dtype=y.dtype) * scale.to(y.dtype)

            handles += [m.register_forward_pre_hook(before), m.register_forward_hook(after)]
        return handles


def disagreement(logits: torch.Tensor, labels: torch.Tensor, weighting: str) -> torch.Tensor:
    """Per-sample disagreement of K copies: logits (K, B, C) -> (B,)."""
    if weighting == "none":
        return torch.ones(logits.shape[1])
    if weighting == "error":
        return (logits.argmax(-1) != labels).float().mean(0)
    logp = logits.log_softmax(-1)
    p = logp.exp()
    mean_p = p.mean(0)
    entropy_of_mean = -(mean_p * mean_p.clamp_min(1e-12).log()).sum(-1)
    mean_entropy = -(p * logp).sum(-1).mean(0)
    return (entropy_of_mean - mean_entropy).clamp_min(0)


def sample_weights(d: torch.Tensor, clip_min: float, clip_max: float) -> torch.Tensor:
    """a(x) = clip(d / mean d), renormalised to mean 1; all ones when the copies agree on every sample."""
    mean = d.mean()
    if not float(mean) > 0:
        return torch.ones_like(d)
    a = (d / mean).clamp(clip_min, clip_max)
    return a / a.mean()


def noisy_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: NoisyTraining,
               gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The training loss of one batch under ``cfg``; returns (loss, logits of the first copy)."""
    levels = cfg.levels()
    if not levels:
        logits = model(x)
        return F.cross_entropy(logits, y), logits
    params = dict(model.named_parameters())
    names = analog_weights(model)
    outs = []
    for eta in levels:
        noisy = {n: perturb(params[n], eta, cfg.noise_model, gen) for n in names}
        outs.append(functional_call(model, noisy, (x,)))
    logits = torch.stack(outs)  # (K, B, C)
    ce = F.cross_entropy(logits.flatten(0, 1), y.repeat(len(outs)), reduction="none").view(len(outs), -1)
    if not METHODS[cfg.method].weighted:
        return ce.mean(), logits[0]
    with torch.no_grad():
        a = sample_weights(disagreement(logits, y, cfg.weighting), cfg.clip_min, cfg.clip_max)
    return (ce.mean(0) * a).mean(), logits[0]


def distillation_loss(outs: torch.Tensor, teacher: torch.Tensor, cfg: NoisyTraining) -> torch.Tensor:
    """The loss of K noisy copies of a causal LM against the digital model (fine-tuning for the chip):
    ``outs`` (K, N, vocab) each copy's logits for N tokens, ``teacher`` (N, vocab) the digital model's;
    KL(teacher || copy) per token. DWP weights each token by the copies' disagreement as ``noisy_loss``
    weights samples, the teacher's top token standing in for the label of the ``error`` weighting."""
    logp = teacher.float().log_softmax(-1)
    logq = outs.float().log_softmax(-1)
    per = (logp.exp() * (logp - logq)).sum(-1)  # (K, N)
    if not METHODS[cfg.method].weighted:
        return per.mean()
    with torch.no_grad():
        d = disagreement(outs.float(), teacher.argmax(-1), cfg.weighting)
    return (per.mean(0) * sample_weights(d, cfg.clip_min, cfg.clip_max)).mean()


def embedding_distillation_loss(outs: torch.Tensor, teacher: torch.Tensor, cfg: NoisyTraining) -> torch.Tensor:
    """As :func:`distillation_loss` for sentence embeddings: 1 - cos(copy, teacher) per sentence; DWP's
    disagreement is the copies' spread, the mean of 1 - cos(copy, mean of the copies) (any weighting
    but ``none``)."""
    per = 1 - F.cosine_similarity(outs.float(), teacher.float().unsqueeze(0), dim=-1)  # (K, N)
    if not METHODS[cfg.method].weighted:
        return per.mean()
    with torch.no_grad():
        d = torch.ones(outs.shape[1]) if cfg.weighting == "none" else \
            (1 - F.cosine_similarity(outs.float(), outs.float().mean(0, keepdim=True), dim=-1)).mean(0)
    return (per.mean(0) * sample_weights(d, cfg.clip_min, cfg.clip_max)).mean()


@torch.no_grad()
def clip_columns_(model: nn.Module, k: float) -> float:
    """Iterative weight clipping: every analog weight clipped per output column to k times that column's
    std (in place). Returns the share of weights clipped."""
    params = dict(model.named_parameters())
    clipped = total = 0
    for n in analog_weights(model):
        w = params[n].data.view(params[n].shape[0], -1)
        limit = k * w.std(1, keepdim=True, correction=0)
        over = w.abs() > limit
        clipped += int(over.sum())
        total += w.numel()
        torch.maximum(torch.minimum(w, limit), -limit, out=w)
    return clipped / max(total, 1)


@torch.no_grad()
def mismatch_copy(model: nn.Module, eta: float, gen: torch.Generator) -> nn.Module:
    """Evaluate-time robustness: a copy of ``model`` whose analog weights are w (1 + eta N(0, 1))."""
    import copy

    noisy = copy.deepcopy(model)
    params = dict(noisy.named_parameters())
    for n in analog_weights(noisy):
        params[n].copy_(perturb(params[n], eta, "mismatch", gen))
    return noisy
