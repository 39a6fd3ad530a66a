"""Energy per inference on a CIM chip and on a GPU, per layer.

CIM, for an analog layer with ``n_in`` inputs and ``n_out`` outputs on arrays of
``tile`` x ``tile`` devices, computing ``vectors`` matrix-vector products per
inference (1 for a Linear on one sample, oh * ow for a Conv2d):

    row_tiles = ceil(n_in / tile), col_tiles = ceil(n_out / tile)
    MACs      = vectors * n_in * n_out                   x  mac_fj
    ADC reads = vectors * n_out * row_tiles               x  adc_fj(adc_bits)
    DAC drives= vectors * n_in * col_tiles                x  dac_fj(dac_bits)
    digital   = vectors * n_out * (row_tiles + 3)         x  digital_op_fj
                (sum the tiles' partial outputs, then scale, compensate, bias+activation)
    movement  = vectors * (n_in + n_out) bytes            x  buffer_byte_fj
                (8-bit activations in and out through the on-chip buffers)

    With ``devices`` devices per side of a weight (AnalogConfig.devices_per_weight), the array part
    (MACs) costs ``devices`` times as much: the same rows drive that many devices' currents.

    adc_fj(b) = readout_fj * 2^(b - 8)    (the Walden figure of merit: energy doubles per bit)
    dac_fj(b) = dac_fj_per_bit * b

The chip constants come from NeuroSim V1.4's published chip-level energies (docs/references.md §4:
VGG8 on CIFAR-10, 8-bit, 128x128 arrays, ADC, buffers, interconnect and leakage included)
in femtojoules per MAC with 32 and 64 rows read per conversion: E(r) = a + b / r. Two points
give the per-MAC part a and the per-read-out part b, which we use as ``mac_fj`` and
``readout_fj`` (at 8 bits). DAC, digital and buffer constants are our assumptions, stated
where they are defined; every constant can be overridden.

GPU (modelled): 2 FLOPs per MAC at ``flop_pj`` and bytes moved to and from HBM at ``byte_pj``:
bf16 weights read once per batch (divided over its ``batch`` samples) and bf16 activations in
and out of every layer. ``flop_pj`` is the H200's 700 W board power spread over its
989 TFLOP/s dense BF16 peak (NVIDIA H200 datasheet), i.e. the energy of a FLOP with the
chip fully busy; ``byte_pj`` is 3.9 pJ/bit for HBM (O'Connor et al., MICRO 2017), 31.2 pJ
per byte. Measured GPU energy (NVML) replaces the model when a GPU is present.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from hilt.errors import HiltError


def _two_point(e32: float, e64: float) -> tuple[float, float]:
    """NeuroSim's per-MAC energies at 32 and 64 rows per read-out -> (per MAC a, per read-out b)."""
    b = (e32 - e64) * 64  # e32 - e64 = b/32 - b/64 = b/64
    return e32 - b / 32, b


@dataclass(frozen=True)
class ChipEnergy:
    name: str
    mac_fj: float  # per analog MAC: array read, row drive, local buffers (NeuroSim two-point fit)
    readout_fj: float  # per column read-out at 8 ADC bits: ADC, shift-add, periphery (NeuroSim fit)
    dac_fj_per_bit: float = 1.0  # per input row driven, per DAC bit (assumption: a few fF row at ~1 V)
    digital_op_fj: float = 50.0  # per digital periphery op on a partial sum (assumption: ~16-bit add/mul)
    buffer_byte_fj: float = 100.0  # per activation byte through on-chip SRAM buffers (assumption)
    source: str = ""

    def adc_fj(self, bits: int) -> float:
        return self.readout_fj * 2.0 ** (bits - 8)

    def dac_fj(self, bits: int) -> float:
        return self.dac_fj_per_bit * bits


def _chip(name: str, e32: float, e64: float, source: str) -> ChipEnergy:
    a, b = _two_point(e32, e64)
    return ChipEnergy(name=name, mac_fj=a, readout_fj=b, source=source)


_NEUROSIM = "NeuroSim V1.4, VGG8/CIFAR-10, 8-bit, 128x128 arrays, chip level: {} / {} fJ per MAC at 32 / 64 rows"
CHIPS = {
    "rram-22nm": _chip("rram-22nm", 178.0, 101.0, _NEUROSIM.format(178, 101)),
    "sram-22nm": _chip("sram-22nm", 228.0, 117.0, _NEUROSIM.format(228, 117)),
    "sram-5nm": _chip("sram-5nm", 62.0, 37.0, _NEUROSIM.format(62, 37)),
}


@dataclass(frozen=True)
class GPUEnergy:
    name: str = "H200 (modelled)"
    flop_pj: float = 700.0 / 989.4e12 * 1e12  # 700 W over 989.4 TFLOP/s dense BF16 = 0.71 pJ
    byte_pj: float = 3.9 * 8  # HBM, 3.9 pJ/bit
    weight_bytes: int = 2  # bf16
    activation_bytes: int = 2
    batch: int = 256


def chip(name: str, **overrides) -> ChipEnergy:
    if name not in CHIPS:
        raise HiltError(f"unknown energy preset {name!r}; choose one of {', '.join(CHIPS)}")
    return replace(CHIPS[name], **overrides)


@torch.no_grad()
def layer_shapes(model: nn.Module, example: torch.Tensor) -> list[dict]:
    """Every Linear and Conv2d of ``model`` (or its analog counterpart) with the matrix-vector
    products it computes for ONE sample of ``example`` (batch dimension first)."""
    from hilt.cim_sim.analog import AnalogConv2d, AnalogLinear

    rows, hooks = [], []

    def hook(name):
        def record(module, inputs, output):
            x, y = inputs[0], output
            per_sample = y.shape[0]
            if isinstance(module, (nn.Conv2d, AnalogConv2d)):
                n_out = y.shape[1]
                vectors = y[0, 0].numel()  # output positions of one sample
                weight = module.weight if isinstance(module, nn.Conv2d) else module.w_digital
                n_in, params = weight[0].numel(), weight.numel()  # C * kh * kw inputs per output
            else:
                n_in, n_out = x.shape[-1], y.shape[-1]
                vectors = y.numel() // per_sample // n_out
                params = n_in * n_out
            rows.append({"layer": name, "kind": "conv" if y.dim() == 4 else "linear", "n_in": n_in, "n_out": n_out,
                         "vectors": vectors, "params": params, "in_elems": x[0].numel(), "out_elems": y[0].numel()})
        return record

    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Conv2d, AnalogLinear, AnalogConv2d)):
            hooks.append(m.register_forward_hook(hook(name)))
    try:
        was_training = model.training
        model.eval()
        model(example[:1])
        model.train(was_training)
    finally:
        for h in hooks:
            h.remove()
    if not rows:
        raise HiltError("the model has no Linear or Conv2d layer to estimate energy for")
    return rows


def cim_energy(shape: dict, chip_: ChipEnergy, tile: int = 512, adc_bits: int = 9, dac_bits: int = 7,
               devices: int = 1) -> dict:
    """Energy in joules of one layer for one inference on the CIM chip, by component."""
    v, n_in, n_out = shape["vectors"], shape["n_in"], shape["n_out"]
    row_tiles, col_tiles = math.ceil(n_in / tile), math.ceil(n_out / tile)
    counts = {"macs": v * n_in * n_out, "adc": v * n_out * row_tiles, "dac": v * n_in * col_tiles,
              "digital": v * n_out * (row_tiles + 3), "bytes": v * (n_in + n_out)}
    fj = {"array": counts["macs"] * chip_.mac_fj * devices, "adc": counts["adc"] * chip_.adc_fj(adc_bits),
          "dac": counts["dac"] * chip_.dac_fj(dac_bits), "digital": counts["digital"] * chip_.digital_op_fj,
          "movement": counts["bytes"] * chip_.buffer_byte_fj}
    joules = {k: v * 1e-15 for k, v in fj.items()}
    return {"counts": counts, "joules": joules, "total": sum(joules.values())}


def gpu_energy(shape: dict, gpu: GPUEnergy) -> dict:
    """Modelled energy in joules of one layer for one inference on the GPU."""
    flops = 2 * shape["vectors"] * shape["n_in"] * shape["n_out"]
    bytes_ = shape["params"] * gpu.weight_bytes / gpu.batch + (shape["in_elems"] + shape["out_elems"]) * gpu.activation_bytes
    joules = {"compute": flops * gpu.flop_pj * 1e-12, "memory": bytes_ * gpu.byte_pj * 1e-12}
    return {"flops": flops, "bytes": bytes_, "joules": joules, "total": sum(joules.values())}


def estimate(model: nn.Module, example: torch.Tensor, chip_: ChipEnergy, gpu: GPUEnergy | None = None,
             tile: int = 512, adc_bits: int = 9, dac_bits: int = 7, devices: int = 1) -> dict:
    """Per-layer and total energy per inference, CIM against the GPU, and their ratio (``devices``: per
    side of a weight)."""
    gpu = gpu or GPUEnergy()
    if not isinstance(gpu.batch, int) or gpu.batch < 1:
        raise HiltError(f"the GPU batch must be a positive integer, got {gpu.batch!r}")
    for what, bits in (("ADC", adc_bits), ("DAC", dac_bits)):
        if not isinstance(bits, int) or not 1 <= bits <= 16:
            raise HiltError(f"{what} bits must be an integer from 1 to 16, got {bits!r}")
    layers = []
    for shape in layer_shapes(model, example):
        c, g = cim_energy(shape, chip_, tile, adc_bits, dac_bits, devices), gpu_energy(shape, gpu)
        layers.append({**shape, "cim": c, "gpu": g})
    cim_total = sum(r["cim"]["total"] for r in layers)
    gpu_total = sum(r["gpu"]["total"] for r in layers)
    return {"chip": asdict(chip_), "gpu": asdict(gpu), "tile": tile, "adc_bits": adc_bits, "dac_bits": dac_bits,
            "devices_per_weight": devices,
            "layers": layers, "cim_joules": cim_total, "gpu_joules": gpu_total, "cim_over_gpu": cim_total / gpu_total}
