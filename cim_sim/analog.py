"""Analog layers: a Linear or Conv2d whose weights live as conductance pairs in crossbar arrays.

The forward pass of one analog layer, all as a few tensor ops per layer:

1. weights: W_eff = (G+ - G-) / scale, the conductances read at the current time
   (programming noise, drift and read noise from the device model);
2. the input dimension is cut into arrays of ``tile_size`` rows, each a tile
   of its own as in aihwkit;
3. per array, DAC: each input row's slice is divided by its abs-max (noise
   management) and quantized to ``dac_bits`` over [-inp_bound, inp_bound];
4. per array: the MVM, per-read weight noise (pcm-hwa), a first-order IR-drop
   attenuation, Gaussian output noise, then the ADC: clip at ``out_bound`` and
   quantize to ``adc_bits``; input rows whose output saturates are retried at
   half scale, up to 3 times (bound management);
5. digital: partial outputs summed, scaled back, drift compensation applied,
   bias added.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hilt.cim_sim.devices import PCM, RRAM, gaussian_, stuck_at
from hilt.errors import HiltError

_ZERO = torch.zeros(())  # addmm's ignored input (beta=0): a product scaled inside BLAS


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

    def device_model(self):
        if self.device not in ("ideal", "pcm", "rram"):
            raise HiltError(f"unknown device {self.device!r}; choose ideal, pcm or rram")
        kw = dict(prog_noise_scale=self.prog_noise_scale, read_noise_scale=self.read_noise_scale,
                  drift_scale=self.drift_scale)
        return {"ideal": None, "pcm": PCM(**kw), "rram": RRAM(**kw)}[self.device]


# Presets. "pcm" is aihwkit's default inference configuration (PCM noise model, DAC 7 bit,
# ADC 9 bit, output bound 12, output noise 0.06, noise and bound management, 512x512 tiles);
# "pcm-hwa" adds per-read PCM weight noise and IR drop as aihwkit's standard hardware-aware
# training preset does (values as we read that preset: w_noise 0.0175, IR drop 1.0,
# output noise 0.04); "rram" swaps the device model; "ideal" is exact digital arithmetic.
PRESETS = {
    "ideal": AnalogConfig(device="ideal", dac_bits=None, adc_bits=None, out_noise=0.0, bound_management=False),
    "pcm": AnalogConfig(),
    "pcm-hwa": AnalogConfig(w_noise=0.0175, ir_drop=1.0, out_noise=0.04),
    "rram": AnalogConfig(device="rram"),
}


def preset(name: str) -> AnalogConfig:
    if name not in PRESETS:
        raise HiltError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


class AnalogMixin:
    """State and analog matrix-vector product shared by AnalogLinear and AnalogConv2d."""

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
        self.gen = torch.Generator().manual_seed(0)

    # -- device life cycle ------------------------------------------------------------------

    def program(self, gen: torch.Generator) -> dict | None:
        """Program the conductance pairs: programming noise and drift exponents drawn once.

        Returns the devices for the model to read (cim_sim.model pools every layer's devices, so a
        drift step reads them all in one pass): G+ and G- stacked, in weight units (G / scale; a
        read is linear in G), their drift exponents and read-noise coefficients. None on the ideal
        device, whose weights are then the digital ones.
        """
        self.gen = torch.Generator().manual_seed(int(torch.randint(2**62, (1,), generator=gen)))
        dev = self.device_model
        if dev is None:
            self.set_weights(self.w_digital.clone())
            return None
        scale = dev.g_max / self.w_max
        # G+ and G- stacked: one tensor op per step for both devices of every pair
        g_target = torch.stack([(self.w_digital * scale).clamp(0, dev.g_max), (-self.w_digital * scale).clamp(0, dev.g_max)])
        g_prog = stuck_at(dev.program(g_target, gen), self.config.stuck_at_rate, dev.g_max, gen)
        return {"g": g_prog / scale, "nu": dev.drift_exponent(g_target, gen), "q": dev.read_noise_coefficient(g_prog)}

    def set_weights(self, w: torch.Tensor) -> None:
        """What the arrays hold now (a read of the devices), shaped like the digital weights."""
        self.w_eff = w
        self._tiles_of = None

    # -- the analog matrix-vector product ---------------------------------------------------

    def _mvm(self, x: torch.Tensor, column_scale: torch.Tensor | None = None, bias=None) -> torch.Tensor:
        """x (rows, in) -> (rows, out) through DAC, tiled arrays, noise, ADC; then times
        ``column_scale`` (drift compensation) plus ``bias``, in the digital periphery.

        Each array of ``tile_size`` inputs is a tile of its own, as in aihwkit: it scales
        its slice of the input (noise management) and retries its own saturated rows
        (bound management); the periphery sums the tiles' outputs.
        """
        if self.is_ideal:
            y = x @ self.w_eff.T
        else:
            y = None
            for k0, k1, w, w_abs in self._tiles():  # a loop over arrays (a handful), not over devices
                part, x_scale = self._tile_mvm(x[:, k0:k1], w, w_abs)
                y = part.mul_(x_scale) if y is None else y.addcmul_(part, x_scale)
        factor = 1.0 if self.is_ideal else self.w_max * self._steps()[1]  # ADC steps -> weights x inputs
        if column_scale is not None:
            factor = column_scale * factor
        if bias is None:
            return y.mul_(factor)
        return torch.addcmul(bias, y, factor) if torch.is_tensor(factor) else y.mul_(factor).add_(bias)

    def _tile_mvm(self, x: torch.Tensor, w: torch.Tensor, w_abs) -> tuple[torch.Tensor, torch.Tensor]:
        """One array: noise management, DAC, MVM, ADC, bound management -> (ADC output in steps, input scale)."""
        c = self.config
        in_step, out_step = self._steps()
        if c.dac_bits is not None:  # noise management: each input row scaled by its abs-max
            x_scale = x.abs().amax(1, keepdim=True).clamp_min_(1e-12)  # (10x faster than aminmax or vector_norm)
        else:
            x_scale = torch.ones(x.shape[0], 1)
        part, peak = self._read_out(x * (1 / (x_scale * in_step)), w, w_abs)
        rows, factor = None, 1.0
        for _ in range(3 if c.bound_management else 0):
            if peak is None:
                break
            saturated = peak >= c.out_bound / out_step
            rows = saturated.nonzero().squeeze(1) if rows is None else rows[saturated]
            if len(rows) == 0:
                break
            factor *= 2  # bound management: retry the saturated rows at half the input scale
            retry, peak = self._read_out(x[rows] * (1 / (x_scale[rows] * (factor * in_step))), w, w_abs)
            part[rows] = retry.mul_(factor)
        return part, x_scale

    def _read_out(self, xq: torch.Tensor, w: torch.Tensor, w_abs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One pass through an array: xq in DAC steps (|xq| <= 1 / DAC step) -> (ADC output in
        steps, per-row peak before clipping or None when no output saturated).

        Converters work in integer steps: the DAC's step is folded into the input scaling
        and the ADC's into the product's scale and the final scaling, so each pass over the data is one
        multiply, clip or round (this is most of the simulator's cost).
        """
        c = self.config
        in_step, out_step = self._steps()
        if c.dac_bits is not None:
            if c.inp_bound < 1:
                xq.clamp_(-c.inp_bound / in_step, c.inp_bound / in_step)
            xq.round_()
        # w and w_abs are views of the weights (/ w_max inside the product; BLAS scales for free)
        part = torch.addmm(_ZERO, xq, w.T, beta=0, alpha=in_step / (out_step * self.w_max))  # in ADC steps
        if c.w_noise or c.ir_drop:
            # both need |w| against a function of x: one matmul for both
            stats = torch.addmm(_ZERO, torch.cat([xq * xq, xq.abs()]), w_abs.T, beta=0, alpha=1 / self.w_max)
            if c.ir_drop:
                # first-order IR drop (our approximation): a bit line carrying a large total
                # current loses a share of it, 5% at full current on every row of the array
                part *= 1 - (0.05 * c.ir_drop * in_step / w.shape[1]) * stats[len(xq):]
            if c.w_noise:  # per-read PCM noise: std w_noise * sqrt(sum_j |w_ij| x_j^2)
                noise = gaussian_(torch.empty(part.shape), self.gen).mul_(stats[: len(xq)].sqrt_())
                part.add_(noise, alpha=c.w_noise * in_step / out_step)
        if c.out_noise:
            part.add_(gaussian_(torch.empty(part.shape), self.gen), alpha=c.out_noise / out_step)
        peak = None
        if c.adc_bits is not None:
            out_levels = c.out_bound / out_step
            low, high = torch.aminmax(part)
            if max(float(high), -float(low)) >= out_levels:  # saturated somewhere: find the rows
                peak = part.abs().amax(1)
                part.clamp_(-out_levels, out_levels)
            part.round_()
        return part, peak

    def _steps(self) -> tuple[float, float]:
        """(DAC step, ADC step) in normalised units (1 where a converter is off)."""
        c = self.config
        return (2 * c.inp_bound / (2**c.dac_bits - 2) if c.dac_bits is not None else 1.0,
                2 * c.out_bound / (2**c.adc_bits - 2) if c.adc_bits is not None else 1.0)

    def _tiles(self) -> list:
        """(k0, k1, w, |w|) per array of ``tile_size`` inputs: views of the weights (and of their
        magnitudes, where per-read noise or IR drop need them), rebuilt when a read replaces them."""
        key = (id(self.w_eff), self.w_eff._version)  # set_weights also resets it; the version counts in-place writes
        if getattr(self, "_tiles_of", None) != key:
            c, n_in = self.config, self.w_eff.shape[1]
            w_abs = self.w_eff.abs() if c.w_noise or c.ir_drop else None
            self._tile_list = [(k0, min(n_in, k0 + c.tile_size), self.w_eff[:, k0 : k0 + c.tile_size],
                                None if w_abs is None else w_abs[:, k0 : k0 + c.tile_size])
                               for k0 in range(0, n_in, c.tile_size)]
            self._tiles_of = key
        return self._tile_list

    @property
    def is_ideal(self) -> bool:
        c = self.config
        return c.device == "ideal" and c.dac_bits is None and c.adc_bits is None and not c.out_noise \
            and not c.w_noise and not c.ir_drop


class AnalogLinear(AnalogMixin, nn.Module):
    def __init__(self, linear: nn.Linear, config: AnalogConfig):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._init_analog(linear.weight, linear.bias, config)

    def forward(self, x):
        if self.is_ideal:  # exactly the digital layer's arithmetic
            return F.linear(x, self.w_digital.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        lead = x.shape[:-1]
        y = self._mvm(x.reshape(-1, self.in_features).float(), self.gdc_scale, self.bias)
        return y.reshape(*lead, self.out_features).to(x.dtype)


class AnalogConv2d(AnalogMixin, nn.Module):
    """Conv2d as an analog MVM over unfolded patches (im2col), as crossbar accelerators do."""

    def __init__(self, conv: nn.Conv2d, config: AnalogConfig):
        nn.Module.__init__(self)
        if conv.groups != 1 or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            raise HiltError("analog Conv2d supports groups=1, zero padding given as numbers")
        self.out_channels, self.kernel_size = conv.out_channels, conv.kernel_size
        self.stride, self.padding, self.dilation = conv.stride, conv.padding, conv.dilation
        self._init_analog(conv.weight, conv.bias, config)

    def forward(self, x):
        if self.is_ideal:  # exactly the digital layer's arithmetic
            weight = self.w_digital.view(self.out_channels, -1, *self.kernel_size).to(x.dtype)
            return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation)
        n = x.shape[0]
        cols, oh, ow = self._patches(x.float())
        y = self._mvm(cols, self.gdc_scale, self.bias)
        return y.view(n, oh * ow, self.out_channels).transpose(1, 2).reshape(n, self.out_channels, oh, ow).to(x.dtype)

    def _patches(self, x):
        """im2col as a strided view then one copy: (n * oh * ow, C * kh * kw), in F.unfold's order.

        Much faster on the CPU than F.unfold (measured 20x on a 256 x 16 x 14 x 14 batch).
        """
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = self.kernel_size, self.stride, self.padding, self.dilation
        n, c, h, w = x.shape
        xp = F.pad(x, (pw, pw, ph, ph))
        oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
        ow = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
        s_n, s_c, s_h, s_w = xp.stride()
        view = xp.as_strided((n, oh, ow, c, kh, kw), (s_n, s_h * sh, s_w * sw, s_c, s_h * dh, s_w * dw))
        return view.reshape(n * oh * ow, c * kh * kw), oh, ow
