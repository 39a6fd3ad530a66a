"""A CIM model frozen at one read-out: deterministic, export-friendly plain PyTorch.

`freeze(analog_model)` copies the model and replaces every analog layer by a frozen one
that holds the weights as the devices were last read (`program` / `drift_to`), with the
drift compensation folded in, and computes exactly what the simulator's forward computes
without its random draws (output noise and per-read weight noise): per array, noise
management, the DAC (scale, Round, Clip), the MVM, the IR-drop attenuation, the ADC
(Clip, Round) and bound management, written without data-dependent control flow (all
five input scales are computed and the first that fits the ADC is kept, per row), so that
torch.onnx can export it.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from hilt.cim_sim.analog import AnalogConv1d, AnalogConv2d, AnalogLinear, AnalogMixin
from hilt.errors import HiltError

_RETRY_FACTORS = (1, 2, 4, 8, 16)  # the simulator's bound management: 4 retries, halving the input each time


class FrozenArrays(nn.Module):
    """One analog layer's arrays at a fixed read-out: (rows, in) -> (rows, out), bias included."""

    def __init__(self, layer: AnalogMixin):
        super().__init__()
        c = layer.config
        if c.input_range == "static":
            raise HiltError(f"freeze: analog layer {layer.path or type(layer).__name__} uses static input ranges; "
                            "the frozen model computes dynamic ones")
        self.ideal = layer.is_ideal
        self.register_buffer("input_scale", None if layer.input_scale is None else layer.input_scale.clone())
        self.in_step, out_step = layer.converter_steps()
        self.dac, self.adc = c.dac_bits is not None, c.adc_bits is not None
        self.inp_levels = c.inp_bound / self.in_step
        self.out_levels = c.out_bound / out_step
        self.retry = _RETRY_FACTORS if c.bound_management and self.adc else (1,)
        self.ir_drop = 0.05 * c.ir_drop * self.in_step
        self.bounds = []
        gdc = layer.gdc_scale.clone().float()
        tile_scale = getattr(layer, "tile_scale", None)  # per-array compensation (gdc="aihwkit")
        self.tile_scale = [1.0] * len(layer.tile_bounds()) if tile_scale is None else tile_scale[0].tolist()
        if self.ideal:
            self.register_buffer("weight", layer.w_eff.clone())
        else:
            to_steps = self.in_step / (out_step * layer.w_unit)  # weights -> ADC steps per DAC step, as the arrays scale
            for i, array in enumerate(layer.tiles()):  # chip 0, the only one; the weights the arrays hold
                self.bounds.append((array.k0, array.k1))
                w = array.w[0] * to_steps
                if c.gdc_before_adc:  # the compensation as the arrays' gain, ahead of the ADC
                    w = w * (gdc * self.tile_scale[i]).view(-1, 1)
                self.register_buffer(f"w{i}", w)
                if self.ir_drop:
                    self.register_buffer(f"w_abs{i}", array.w_abs[0] / layer.w_unit)
            if c.gdc_before_adc:
                gdc, self.tile_scale = torch.ones_like(gdc), [1.0] * len(self.bounds)
        self.out_scale = out_step * layer.w_unit
        self.register_buffer("gdc", gdc)
        self.register_buffer("bias", None if layer.bias is None else layer.bias.detach().clone().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:  # smoothing, in the digital periphery
            x = x / self.input_scale
        if self.ideal:
            return F.linear(x, self.weight, self.bias)
        y = None
        for i, (k0, k1) in enumerate(self.bounds):
            xk = x[:, k0:k1]
            scale = xk.abs().amax(1, keepdim=True).clamp_min(1e-12) if self.dac else torch.ones_like(xk[:, :1])
            part = self._array(xk, scale, getattr(self, f"w{i}"), getattr(self, f"w_abs{i}", None), k1 - k0) * scale
            if self.tile_scale[i] != 1.0:
                part = part * self.tile_scale[i]
            y = part if y is None else y + part
        y = y * self.out_scale * self.gdc
        return y if self.bias is None else y + self.bias

    def _array(self, x, scale, w, w_abs, rows: int):
        chosen = None
        for factor in reversed(self.retry):  # largest first: each smaller one that fits replaces it
            xq = x * (1 / (scale * (factor * self.in_step)))
            if self.dac:
                if self.inp_levels < 1 / self.in_step:
                    xq = xq.clamp(-self.inp_levels, self.inp_levels)
                xq = torch.round(xq)  # DAC
            part = xq @ w.T
            if w_abs is not None:
                part = part * (1 - (self.ir_drop / rows) * (xq.abs() @ w_abs.T))
            if not self.adc:
                return part
            fits = part.abs().amax(1, keepdim=True) < self.out_levels
            out = torch.round(part.clamp(-self.out_levels, self.out_levels)) * factor  # ADC
            chosen = out if chosen is None else torch.where(fits, out, chosen)
        return chosen


class FrozenLinear(nn.Module):
    def __init__(self, layer: AnalogLinear):
        super().__init__()
        self.arrays = FrozenArrays(layer)
        self.out_features = layer.out_features

    def forward(self, x):
        lead = x.shape[:-1]
        return self.arrays(x.reshape(-1, x.shape[-1]).float()).reshape(*lead, self.out_features)


class FrozenConv2d(nn.Module):
    def __init__(self, layer: AnalogConv2d):
        super().__init__()
        self.arrays = FrozenArrays(layer)
        self.out_channels, self.kernel_size = layer.out_channels, layer.kernel_size
        self.stride, self.padding, self.dilation = layer.stride, layer.padding, layer.dilation

    def forward(self, x):
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = self.kernel_size, self.stride, self.padding, self.dilation
        n, c, h, w = x.shape
        oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
        ow = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
        xp = F.pad(x.float(), (pw, pw, ph, ph))
        # im2col by slicing, in F.unfold's order (channel, then kernel row, then kernel column)
        cols = [xp[:, :, i * dh: i * dh + sh * (oh - 1) + 1: sh, j * dw: j * dw + sw * (ow - 1) + 1: sw]
                for i in range(kh) for j in range(kw)]
        patches = torch.stack(cols, 2).reshape(n, c * kh * kw, oh * ow).transpose(1, 2).reshape(n * oh * ow, -1)
        y = self.arrays(patches)
        return y.reshape(n, oh * ow, self.out_channels).transpose(1, 2).reshape(n, self.out_channels, oh, ow)


class FrozenConv1d(nn.Module):
    def __init__(self, layer: AnalogConv1d):
        super().__init__()
        self.arrays = FrozenArrays(layer)
        self.out_channels, (self.k,), (self.s,), (self.p,), (self.d,) = (
            layer.out_channels, layer.kernel_size, layer.stride, layer.padding, layer.dilation)

    def forward(self, x):
        n, c, length = x.shape
        out = (length + 2 * self.p - self.d * (self.k - 1) - 1) // self.s + 1
        xp = F.pad(x.float(), (self.p, self.p))
        # im2col by slicing, in F.unfold's order (channel, then kernel position)
        cols = [xp[:, :, i * self.d: i * self.d + self.s * (out - 1) + 1: self.s] for i in range(self.k)]
        patches = torch.stack(cols, 2).reshape(n, c * self.k, out).transpose(1, 2).reshape(n * out, -1)
        return self.arrays(patches).reshape(n, out, self.out_channels).transpose(1, 2)


_FROZEN = ((AnalogConv2d, FrozenConv2d), (AnalogConv1d, FrozenConv1d), (AnalogLinear, FrozenLinear))


@torch.no_grad()
def freeze(model: nn.Module) -> nn.Module:
    """A copy of an analog model (one programmed chip) with every analog layer frozen at its current read-out."""
    if getattr(model, "chips", 1) != 1:
        raise HiltError(f"freeze takes one programmed chip; this model holds {model.chips} (program it with one seed)")
    frozen = copy.deepcopy(model)
    for name, module in list(frozen.named_modules()):
        if isinstance(module, AnalogMixin):
            new = next(f(module) for analog, f in _FROZEN if isinstance(module, analog))
            parent, _, attr = name.rpartition(".")
            setattr(frozen.get_submodule(parent) if parent else frozen, attr, new)
    return frozen.eval()
