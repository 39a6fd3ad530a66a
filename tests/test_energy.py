"""The CIM/GPU energy model: its arithmetic on hand-computed layers, and the command."""

import math

import pytest
import torch
from torch import nn

from hilt.cim_sim import convert_to_analog, preset
from hilt.cim_sim.energy import CHIPS, GPUEnergy, chip, estimate, layer_shapes
from hilt.errors import HiltError


def test_neurosim_two_point_fit():
    c = CHIPS["rram-22nm"]  # 178 fJ/MAC at 32 rows, 101 at 64: E(r) = a + b / r
    assert c.mac_fj + c.readout_fj / 32 == pytest.approx(178.0)
    assert c.mac_fj + c.readout_fj / 64 == pytest.approx(101.0)
    assert (c.mac_fj, c.readout_fj) == pytest.approx((24.0, 4928.0))


def test_linear_layer_by_hand():
    model = nn.Sequential(nn.Linear(600, 700))
    r = estimate(model, torch.randn(3, 600), chip("rram-22nm"), GPUEnergy(batch=10), tile=512, adc_bits=9, dac_bits=7)
    layer = r["layers"][0]
    # 600 inputs on 2 arrays of rows, 700 outputs on 2 arrays of columns, one vector per sample
    assert layer["cim"]["counts"] == {"macs": 420_000, "adc": 1400, "dac": 1200, "digital": 3500, "bytes": 1300}
    fj = 420_000 * 24.0 + 1400 * 4928.0 * 2 + 1200 * 1.0 * 7 + 3500 * 50.0 + 1300 * 100.0
    assert r["cim_joules"] == pytest.approx(fj * 1e-15)
    gpu_pj = 2 * 420_000 * (700 / 989.4) + (600 * 700 * 2 / 10 + (600 + 700) * 2) * 31.2
    assert r["gpu_joules"] == pytest.approx(gpu_pj * 1e-12)
    assert r["cim_over_gpu"] == pytest.approx(fj * 1e-15 / (gpu_pj * 1e-12))


def test_conv_counts_output_positions_and_analog_layers_match():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, stride=2), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 5 * 5, 4))
    x = torch.randn(2, 3, 10, 10)
    shapes = layer_shapes(model, x)
    assert [(s["n_in"], s["n_out"], s["vectors"]) for s in shapes] == [(27, 8, 25), (200, 4, 1)]
    analog = convert_to_analog(model, preset("pcm"))
    assert [(s["n_in"], s["n_out"], s["vectors"]) for s in layer_shapes(analog, x)] == [(27, 8, 25), (200, 4, 1)]


def test_fewer_adc_bits_cost_less_and_bad_input_is_refused():
    model, x = nn.Sequential(nn.Linear(64, 32)), torch.randn(1, 64)
    e9 = estimate(model, x, chip("sram-5nm"), adc_bits=9)["layers"][0]["cim"]["joules"]["adc"]
    e5 = estimate(model, x, chip("sram-5nm"), adc_bits=5)["layers"][0]["cim"]["joules"]["adc"]
    assert e9 == pytest.approx(16 * e5)
    with pytest.raises(HiltError, match="energy preset"):
        chip("pcm-3nm")
    with pytest.raises(HiltError, match="ADC bits"):
        estimate(model, x, chip("sram-5nm"), adc_bits=0)
    with pytest.raises(HiltError, match="GPU batch"):
        estimate(model, x, chip("sram-5nm"), GPUEnergy(batch=0))
    with pytest.raises(HiltError, match="no Linear or Conv2d"):
        estimate(nn.Sequential(nn.ReLU()), x, chip("sram-5nm"))
    assert math.isfinite(chip("rram-22nm", mac_fj=1.0).mac_fj)
