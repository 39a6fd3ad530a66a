"""Model-level API: convert a model's layers to analog, program them, let them drift.

Drift compensation (``gdc``), computed per layer from a fixed probe input:

* ``global``: after programming, the mean |y| of the probe through the noisy
  layer is the reference; after drift the digital output is scaled by
  reference / current mean |y| (one number per layer), as aihwkit does;
* ``column``: the same per output column;
* ``exact``: the reference is the *ideal* digital layer's mean |y| (what a
  perfect calibration would restore), one number per layer;
* ``none``.
"""

from __future__ import annotations

import copy
import re

import torch
from torch import nn

from hilt.cim_sim.analog import AnalogConfig, AnalogConv2d, AnalogLinear, AnalogMixin
from hilt.errors import HiltError
from hilt.quant.nn import replace_modules

GDC_MODES = ("global", "column", "exact", "none")
_UNITS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800, "mo": 2629800, "y": 31557600}


def parse_time(text: str) -> float:
    """'1s', '1h', '1d', '1mo', '1y', '3600' -> seconds. Negative or unparsable: HiltError."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in ("", *_UNITS):
        raise HiltError(f"cannot read time {text!r}: use a number of seconds or e.g. 1s, 1h, 1d, 1mo, 1y")
    return float(m.group(1)) * _UNITS.get(m.group(2) or "s", 1)


def analog_layers(model: nn.Module) -> list[tuple[str, AnalogMixin]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, AnalogMixin)]


def convert_to_analog(model: nn.Module, config: AnalogConfig, inplace: bool = False) -> nn.Module:
    """Replace every nn.Linear and nn.Conv2d by its analog counterpart (on a copy unless ``inplace``).

    Other layers stay digital; ``model.digital_layers`` lists them. The copy is
    programmed once with seed 0; call :func:`program` to draw another chip.
    """
    config.device_model()  # validates the device name
    model = model if inplace else copy.deepcopy(model)
    digital = []

    def analog(name, module):
        if isinstance(module, nn.Linear):
            return AnalogLinear(module, config)
        if isinstance(module, nn.Conv2d):
            return AnalogConv2d(module, config)
        if name and not list(module.children()) and any(True for _ in module.parameters(recurse=False)):
            digital.append(name)
        return None

    if replace_modules(model, analog) == 0:
        raise HiltError("the model has no Linear or Conv2d layer to put on analog hardware")
    model.digital_layers = digital
    model.eval()
    program(model, seed=0)
    return model


def _probe(layer: AnalogMixin, gen: torch.Generator) -> torch.Tensor:
    """A fixed random input batch for drift compensation: 32 rows, uniform in [-1, 1] on about
    64 inputs per row, zero elsewhere. Sparse so that the arrays' outputs stay inside the ADC
    range: a dense probe on a wide layer saturates the ADC and costs bound-management retries."""
    n_in = layer.w_digital.shape[1]
    values = torch.rand(32, n_in, generator=gen) * 2 - 1
    return values * (torch.rand(32, n_in, generator=gen) < 64 / n_in)


@torch.no_grad()
def program(model: nn.Module, seed: int = 0) -> nn.Module:
    """Program every analog layer (a new chip: programming noise and drift exponents drawn)."""
    gen = torch.Generator().manual_seed(seed)
    by_device = {}
    for _, layer in analog_layers(model):
        devices = layer.program(gen)
        if devices is not None:
            by_device.setdefault(layer.device_model, []).append((layer, devices))
    # every device of the chip in one flat pool per device model: a read is one pass over all of them
    model.device_pools = [
        {"device": device, "layers": [layer for layer, _ in members],
         **{k: torch.cat([d[k].reshape(2, -1) for _, d in members], 1) for k in ("g", "nu", "q")}}
        for device, members in by_device.items()]
    _read(model, 0.0, gen)
    for _, layer in analog_layers(model):
        layer.gdc_scale = torch.ones(layer.w_digital.shape[0])
        probe = _probe(layer, torch.Generator().manual_seed(seed))
        layer.gdc_probe = probe
        layer.gdc_ref_noisy = layer._mvm(probe).abs().mean(0)
        layer.gdc_ref_ideal = (probe @ layer.w_digital.T).abs().mean(0)
    return model


def _read(model: nn.Module, t: float, gen: torch.Generator) -> None:
    """Set every analog layer's weights to its devices read t seconds after programming."""
    for pool in getattr(model, "device_pools", []):
        w = pool["device"].read_differential(pool["g"], pool["nu"], t, gen, q=pool["q"])  # weight units
        offset = 0
        for layer in pool["layers"]:
            n = layer.w_digital.numel()
            layer.set_weights(w[offset : offset + n].view_as(layer.w_digital))
            offset += n


@torch.no_grad()
def drift_to(model: nn.Module, t_seconds: float, seed: int = 1, gdc: str = "global") -> nn.Module:
    """Read every analog layer ``t_seconds`` after programming (fresh read noise), then compensate."""
    if gdc not in GDC_MODES:
        raise HiltError(f"unknown drift compensation {gdc!r}; choose one of {', '.join(GDC_MODES)}")
    if not t_seconds >= 0:
        raise HiltError(f"time after programming must be >= 0 s, got {t_seconds}")
    _read(model, float(t_seconds), torch.Generator().manual_seed(seed))
    for _, layer in analog_layers(model):
        layer.gdc_scale = torch.ones(layer.w_digital.shape[0])
        if gdc == "none":
            continue
        now = layer._mvm(layer.gdc_probe).abs().mean(0)
        if gdc == "column":
            layer.gdc_scale = layer.gdc_ref_noisy / now.clamp_min(1e-12)
        else:
            ref = layer.gdc_ref_ideal if gdc == "exact" else layer.gdc_ref_noisy
            layer.gdc_scale = torch.full_like(now, float(ref.sum() / now.sum().clamp_min(1e-12)))
    return model
