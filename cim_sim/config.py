"""A chip's configuration: :class:`AnalogConfig` (device, converters, noise, mapping, input ranges),
its presets, and how a layer's weights are cut into crossbar arrays (:func:`array_bounds`,
:func:`tile_unit`). The analog layers that compute with it are in cim_sim/analog.py."""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, fields

import torch

from hilt.cim_sim.devices import PCM, RRAM
from hilt.errors import HiltError

WEIGHT_MAPPINGS = ("layer", "column", "tile")  # AnalogConfig.weight_mapping


@dataclass(frozen=True)
class AnalogConfig:
    device: str = "pcm"  # "ideal" (exact digital), "pcm" or "rram"
    tile_size: int = 512  # rows (inputs) per crossbar array, like aihwkit
    dac_bits: int | None = 7
    inp_bound: float = 1.0
    adc_bits: int | None = 9
    out_bound: float = 12.0
    out_noise: float = 0.06  # std of additive output noise, in normalised output units
    bound_management: bool = True
    w_noise: float = 0.0  # per-read weight noise, std of sqrt(sum_j |w_ij| x_j^2)
    ir_drop: float = 0.0  # IR-drop strength (0 = off)
    stuck_at_rate: float = 0.0
    prog_noise_scale: float = 1.0
    read_noise_scale: float = 1.0
    drift_scale: float = 1.0
    # False: the arrays compute with the weights themselves, so output noise, output bound and ADC
    # step are in units of weight x normalised input (aihwkit's default, weight_scaling_omega=0);
    # True: each layer's weights scaled to abs-max 1 on the arrays, the scale applied digitally
    # (aihwkit's weight_scaling_omega=1)
    weight_scaling: bool = False
    # Weight mapping (programming): "layer" maps the layer's abs-max weight to g_max; "column" maps
    # each output column's own abs-max to g_max (its scale applied digitally, so output noise and ADC
    # step are relative to that column's largest weight, as aihwkit's columnwise weight scaling);
    # "tile" maps each tile's abs-max (tile_size inputs x tile_size outputs, split as the arrays
    # split a layer) to g_max, as aihwkit programs its tiles; the arrays still hold the weights.
    weight_mapping: str = "layer"
    # Outliers clipped per output column before mapping (0 = off): at clip_std times the column's
    # weight std, or at the clip_percentile-th percentile of its |w| (e.g. 99.9).
    clip_std: float = 0.0
    clip_percentile: float = 0.0
    # Input ranges: "dynamic" divides each input row by its abs-max (noise management, with bound
    # management on the outputs); "static" divides every row by one range per array, calibrated as
    # the input_percentile-th percentile of |x| on calibration data (calibrate_inputs), and
    # clips what lies beyond it.
    input_range: str = "dynamic"
    input_percentile: float = 99.99
    # SmoothQuant's migration strength alpha (0 = off), calibrated on data (calibrate_inputs): the
    # digital periphery divides input channel j by s_j = max|x_j|^alpha / max|W[:, j]|^(1 - alpha)
    # before the DAC, and the arrays hold W[:, j] * s_j. The product is unchanged; the outlier
    # channels that set each row's DAC range move into the weights. (For inputs that come from a
    # norm, the division folds into the norm's gain and costs nothing.)
    smoothing: float = 0.0
    # Where the drift compensation factor acts: False, digitally after the ADC (aihwkit's way), so it
    # multiplies the output noise and the ADC step with the signal; True, as a gain ahead of the output
    # noise and the ADC (a read-out whose integration window or ADC reference follows the drift), the
    # output noise referred to the ADC's input: what a periphery that tracks the drift can do at best.
    gdc_before_adc: bool = False
    # Devices per side of a weight (a multi-device synapse): each of the n G+ and n G- devices is
    # programmed to the pair's target and their currents add on the column, the read-out dividing by n.
    # Programming noise, drift exponents and read noise are drawn per device, so their share of the
    # weight shrinks as 1/sqrt(n); the array holds n times the devices and draws n times the current.
    devices_per_weight: int = 1

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Every field against its type and its range (FIELD_RANGES): one place for the Python API, `--set` and
        sweep grids. A bad value is a one-line error naming the field, before any layer is built."""
        for f in fields(self):
            value, hint = getattr(self, f.name), _FIELD_TYPES[f.name]
            if value is None and f.name in _OPTIONAL:
                continue
            if hint is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if isinstance(value, bool) != (hint is bool) or not isinstance(value, hint) or (
                    hint is float and not math.isfinite(value)):
                raise HiltError(f"AnalogConfig.{f.name}: expected {'a finite ' if hint is float else ''}"
                                f"{hint.__name__}{' or None' if f.name in _OPTIONAL else ''}, got {value!r}")
            if f.name in FIELD_RANGES:
                lo, hi, open_low = FIELD_RANGES[f.name]
                if (value <= lo if open_low else value < lo) or (hi is not None and value > hi):
                    raise HiltError(f"AnalogConfig.{f.name}: {describe_range(f.name)}; got {value!r}")
        self.device_model()

    def converter_steps(self) -> tuple[float, float]:
        """(DAC step, ADC step) in normalised units (1 where a converter is off)."""
        return (2 * self.inp_bound / (2**self.dac_bits - 2) if self.dac_bits is not None else 1.0,
                2 * self.out_bound / (2**self.adc_bits - 2) if self.adc_bits is not None else 1.0)

    @property
    def needs_calibration(self) -> bool:
        """Whether layers of this configuration need calibrate_inputs before they run."""
        return bool(self.smoothing) or self.input_range == "static"

    def device_model(self):
        if self.device not in ("ideal", "pcm", "rram"):
            raise HiltError(f"unknown device {self.device!r}; choose ideal, pcm or rram")
        if self.weight_mapping not in WEIGHT_MAPPINGS:
            raise HiltError(f"unknown weight_mapping {self.weight_mapping!r}; choose {', '.join(WEIGHT_MAPPINGS)}")
        if self.input_range not in ("dynamic", "static"):
            raise HiltError(f"unknown input_range {self.input_range!r}; choose dynamic or static")
        if not 0 <= self.smoothing <= 1:
            raise HiltError(f"smoothing is SmoothQuant's alpha, 0 (off) to 1; got {self.smoothing}")
        if self.clip_std < 0 or not 0 <= self.clip_percentile <= 100 or not 0 < self.input_percentile <= 100:
            raise HiltError(f"clip_std must be >= 0 and clip_percentile 0 to 100, input_percentile in (0, 100]; got "
                            f"{self.clip_std}, {self.clip_percentile}, {self.input_percentile}")
        if self.clip_std and self.clip_percentile:
            raise HiltError("clip_std and clip_percentile exclude each other: set one of them")
        kw = dict(prog_noise_scale=self.prog_noise_scale, read_noise_scale=self.read_noise_scale,
                  drift_scale=self.drift_scale)
        return {"ideal": None, "pcm": PCM(**kw), "rram": RRAM(**kw)}[self.device]


# Each numeric field's range: (lowest, highest or None, whether the lowest itself is excluded). A converter
# needs 2 bits (a 1-bit DAC or ADC has no step: its levels are -bound and +bound only); 24 is beyond any
# converter built. Read by AnalogConfig.check, `--set` and sweep grids alike.
FIELD_RANGES = {
    "tile_size": (1, None, False), "dac_bits": (2, 24, False), "adc_bits": (2, 24, False),
    "inp_bound": (0.0, None, True), "out_bound": (0.0, None, True), "out_noise": (0.0, None, False),
    "w_noise": (0.0, None, False), "ir_drop": (0.0, None, False), "stuck_at_rate": (0.0, 1.0, False),
    "prog_noise_scale": (0.0, None, False), "read_noise_scale": (0.0, None, False), "drift_scale": (0.0, None, False),
    "clip_std": (0.0, None, False), "clip_percentile": (0.0, 100.0, False), "input_percentile": (0.0, 100.0, True),
    "smoothing": (0.0, 1.0, False), "devices_per_weight": (1, 64, False),
}
_FIELD_TYPES = {name: (typing.get_args(hint) or (hint,))[0] for name, hint in typing.get_type_hints(AnalogConfig).items()}
_OPTIONAL = ("dac_bits", "adc_bits")


def describe_range(name: str) -> str:
    """``name``'s range in words, e.g. 'at least 2 and at most 24'."""
    lo, hi, open_low = FIELD_RANGES[name]
    return f"{'above' if open_low else 'at least'} {lo:g}" + (f" and at most {hi:g}" if hi is not None else "")


# Presets. "pcm" is aihwkit's default inference configuration (PCM noise model, DAC 7 bit,
# ADC 9 bit, output bound 12, output noise 0.06, noise and bound management, arrays of at most
# 512 inputs, raw weights on the arrays); "pcm-scaled" the same with each layer's weights
# scaled to abs-max 1 (weight_scaling_omega=1: less output noise relative to the weights);
# "pcm-hwa" adds per-read PCM weight noise and IR drop as aihwkit's standard hardware-aware
# training preset does (values as we read that preset: w_noise 0.0175, IR drop 1.0, output
# noise 0.04, weight scaling); "rram" swaps the device model; "ideal" is exact digital arithmetic.
PRESETS = {
    "ideal": AnalogConfig(device="ideal", dac_bits=None, adc_bits=None, out_noise=0.0, bound_management=False),
    "pcm": AnalogConfig(),
    "pcm-scaled": AnalogConfig(weight_scaling=True),
    "pcm-hwa": AnalogConfig(w_noise=0.0175, ir_drop=1.0, out_noise=0.04, weight_scaling=True),
    "rram": AnalogConfig(device="rram"),
}


# How a language model goes on a preset's chip unless asked otherwise: each output column mapped to its own
# conductance range and SmoothQuant-style smoothing 0.5 of the inputs, calibrated on text (the diagnosis in
# docs/results/cim_lm.md: a language model's outlier columns and channels collapse it under the presets' own,
# aihwkit's, layer mapping and dynamic input scaling).
LM_DEPLOYMENT = {"weight_mapping": "column", "smoothing": 0.5}

# The chips a language model can be put on: the presets, and "afm", the Analog Foundation Models chip
# (cim_sim/afm.py: its own noise model and forward, no drift).
LM_CHIPS = (*PRESETS, "afm")


def tile_unit(w: torch.Tensor, tile_size: int) -> torch.Tensor:
    """weight_mapping="tile": each weight's tile abs-max, shaped like ``w`` (out, in); tiles of
    ``tile_size`` inputs by ``tile_size`` outputs, cut into equal parts as :func:`array_bounds` cuts."""
    unit = torch.empty_like(w)
    for n0, n1 in array_bounds(w.shape[0], tile_size):
        for k0, k1 in array_bounds(w.shape[1], tile_size):
            unit[n0:n1, k0:k1] = w[n0:n1, k0:k1].abs().max()
    return unit.clamp_min_(1e-30)


def array_bounds(n_in: int, tile_size: int) -> list[tuple[int, int]]:
    """The input rows of each array: ceil(n_in / tile_size) arrays of equal size (within one row),
    as aihwkit splits a layer."""
    n = -(-n_in // tile_size)
    base, extra = divmod(n_in, n)
    edges = [0]
    for i in range(n):
        edges.append(edges[-1] + base + (i < extra))
    return list(zip(edges[:-1], edges[1:], strict=True))


def preset(name: str) -> AnalogConfig:
    if name not in PRESETS:
        raise HiltError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]
