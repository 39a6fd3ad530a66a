"""AnalogConfig.devices_per_weight: several devices per side of a weight, their currents summed on the
column and read out divided by their number (a multi-device synapse)."""

import dataclasses

import pytest
import torch
from torch import nn

from hilt.cim_sim import convert_to_analog, drift_to, preset, program
from hilt.cim_sim.cert_chip import cim_perturbation
from hilt.cim_sim.energy import chip, cim_energy
from hilt.cim_sim.model import analog_layers, chip_memory
from hilt.cim_sim.training import perturb
from hilt.errors import HiltError

YEAR = 365.25 * 86400


def _pcm(n: int, **fields):
    return dataclasses.replace(preset("pcm"), devices_per_weight=n, **fields)


def _layer(n_in=512, n_out=256, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(n_in, n_out))


def _weight_error(model, n, t, mapping="column") -> float:
    """The relative error of the one layer's weights as held on chip, drifted to ``t`` with global compensation."""
    chip_ = convert_to_analog(model, _pcm(n, weight_mapping=mapping))
    program(chip_, seed=3)
    drift_to(chip_, t, seed=5, gdc="global")
    (_, layer), = analog_layers(chip_)
    w = layer.w_eff * layer.gdc_scale.view(-1, 1)
    return float((w - layer.w_digital).std() / layer.w_digital.std())


def test_the_weight_is_the_mean_of_its_pairs():
    """Each layer of a pool takes its own devices: n pairs per weight, laid out pair by pair, averaged."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 8))
    one, three = (convert_to_analog(model, _pcm(n)) for n in (1, 3))
    program(one, seed=1)
    program(three, seed=1)
    (pool,) = three.device_pools
    assert pool["g"].shape == (1, 2, 3 * (24 * 16 + 16 * 8))
    first = analog_layers(three)[0][1].w_digital.numel()
    pairs = (pool["g"][0, 0] - pool["g"][0, 1])[: 3 * first].view(3, first)
    assert not torch.equal(pairs[0], pairs[1])  # the pairs draw their own programming noise
    drift_to(three, 3600.0, seed=2, gdc="none")  # a read: each device drifts and is read on its own, then averaged
    dev, nu, q, offset = pool["device"], [], [], 0
    for _, layer in analog_layers(three):  # each device's drift exponent and read-noise coefficient, as programmed
        g_target = (torch.stack([layer.w_digital, -layer.w_digital]) * layer.g_scale).clamp(0, dev.g_max)
        z = torch.randn(2, 3, *layer.w_digital.shape, generator=torch.Generator().set_state(layer.drift_draws[0]))
        nu.append(dev.drift_exponent_of(g_target.unsqueeze(1), z).view(2, -1))
        n = 3 * layer.w_digital.numel()
        q.append(dev.read_noise_coefficient(pool["g"][0, :, offset : offset + n] * layer.g_scale))
        offset += n
    read = dev.read(pool["g"][0], torch.cat(nu, 1), 3600.0, torch.Generator().manual_seed(2), q=torch.cat(q, 1))
    reads = read[0] - read[1]
    offset = 0
    for _, layer in analog_layers(three):
        n = layer.w_digital.numel()
        torch.testing.assert_close(layer.w_eff, reads[offset : offset + 3 * n].view(3, n).mean(0).view_as(layer.w_eff))
        offset += 3 * n
    assert chip_memory(three)["device_bytes"] == 3 * chip_memory(one)["device_bytes"]


def test_more_devices_shrink_the_error_as_one_over_sqrt_n():
    """Programming noise, drift spread and read noise are drawn per device: four devices per side halve
    the weights' error, a second after programming and a year later (global compensation); one device
    is what the default gives."""
    model = _layer()
    for t in (1.0, YEAR):
        e1, e4 = _weight_error(model, 1, t), _weight_error(model, 4, t)
        assert 0.42 < e4 / e1 < 0.58, (t, e1, e4)
    default = convert_to_analog(model, preset("pcm"))
    program(default, seed=3)
    once = convert_to_analog(model, _pcm(1))
    program(once, seed=3)
    assert torch.equal(analog_layers(default)[0][1].w_eff, analog_layers(once)[0][1].w_eff)


def test_chips_in_one_pass_equal_one_at_a_time():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 24), nn.ReLU(), nn.Linear(24, 6))
    x = torch.randn(5, 40)
    chips = convert_to_analog(model, _pcm(2))
    program(chips, seeds=[3, 7])
    drift_to(chips, 86400.0, seeds=[5, 9])
    with torch.no_grad():
        together = chips(x).view(2, 5, -1)
    for k, (seed, read) in enumerate([(3, 5), (7, 9)]):
        one = convert_to_analog(model, _pcm(2))
        program(one, seed=seed)
        drift_to(one, 86400.0, seed=read)
        with torch.no_grad():
            assert torch.equal(one(x), together[k])


def test_training_reads_average_the_devices_too():
    """hilt hwa's device reads (perturb) follow the option: four devices halve a read's error."""
    torch.manual_seed(0)
    w = torch.randn(128, 256) * 0.02

    def error(devices):
        gen = torch.Generator().manual_seed(1)
        reads = [perturb(w, 1.0, "pcm", gen, "column", times=(YEAR, YEAR), devices=devices) for _ in range(2)]
        return float(torch.stack([r - w for r in reads]).std() / w.std())

    assert 0.42 < error(4) / error(1) < 0.58


def test_energy_charges_the_devices_and_certificates_refuse_them():
    shape = {"vectors": 1, "n_in": 1024, "n_out": 512}
    one, four = (cim_energy(shape, chip("rram-22nm"), devices=n)["joules"] for n in (1, 4))
    assert four["array"] == pytest.approx(4 * one["array"]) and four["adc"] == one["adc"]
    with pytest.raises(HiltError, match="one device pair per weight"):
        cim_perturbation(_layer(16, 8), _pcm(2), 1.0)


@pytest.mark.parametrize("value", [0, 65, 1.5, True, "2"])
def test_a_bad_count_is_refused(value):
    with pytest.raises(HiltError, match="devices_per_weight"):
        _pcm(value).device_model()
