"""The CIM/GPU energy model: its arithmetic on hand-computed layers, and the command."""

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
    conv = estimate(model, x, chip("sram-5nm"), GPUEnergy(batch=1))["layers"][0]
    # 25 output positions, each a 27-input, 8-output product on one tile
    assert conv["cim"]["counts"] == {"macs": 25 * 27 * 8, "adc": 25 * 8, "dac": 25 * 27, "digital": 25 * 8 * 4,
                                     "bytes": 25 * (27 + 8)}
    assert conv["gpu"]["bytes"] == 8 * 27 * 2 + (3 * 10 * 10 + 8 * 5 * 5) * 2  # weights, one sample's input and output
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


def test_overridden_constants_by_hand():
    """A preset with constants overridden: the override and the preset's other constants both
    reach every component (64 inputs, 32 outputs, one 512 x 512 tile, one vector per sample)."""
    custom = chip("rram-22nm", mac_fj=1.0, digital_op_fj=0.0)
    assert (custom.name, custom.readout_fj, custom.buffer_byte_fj) == ("rram-22nm", pytest.approx(4928.0), 100.0)
    r = estimate(nn.Sequential(nn.Linear(64, 32)), torch.randn(1, 64), custom, GPUEnergy(batch=4), adc_bits=6,
                 dac_bits=3)
    cim = r["layers"][0]["cim"]
    assert cim["counts"] == {"macs": 2048, "adc": 32, "dac": 64, "digital": 128, "bytes": 96}
    # ADC: 4928 fJ at 8 bits, halved per bit below; DAC: 1 fJ per bit per row
    assert cim["joules"] == pytest.approx({"array": 2048 * 1.0e-15, "adc": 32 * 4928.0 / 4 * 1e-15,
                                           "dac": 64 * 3 * 1.0e-15, "digital": 0.0, "movement": 96 * 100.0e-15})
    gpu_pj = 2 * 2048 * (700 / 989.4) + (64 * 32 * 2 / 4 + (64 + 32) * 2) * 31.2
    assert r["gpu_joules"] == pytest.approx(gpu_pj * 1e-12)
