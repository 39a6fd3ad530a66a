"""Language models on the CIM simulator: tiny random Llama and BERT converted, programmed, drifted,
evaluated; chips in one pass equal one at a time; the mapping and input-range options do what they say."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from hilt.cim_sim import (analog_layers, calibrate_inputs, clipped_share, convert_to_analog, drift_to, preset,
                          program, stacked_chips)
from hilt.errors import HiltError
from hilt.models.bert import Bert, BertConfig
from hilt.models.llama import Llama, LlamaConfig


@pytest.fixture(scope="module")
def tiny_llama():
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=61, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=80,
                             max_seq_len=64)).eval()


def _chip(model, config, program_seed, read_seed, t=3600.0):
    one = convert_to_analog(model, config)
    program(one, seeds=[program_seed])
    return drift_to(one, t, seeds=[read_seed])


@pytest.mark.parametrize("config", ["pcm", dataclasses.replace(preset("pcm"), gdc_before_adc=True)],
                         ids=["pcm", "gdc-before-adc"])
def test_llama_chips_in_one_pass_equal_one_at_a_time(tiny_llama, config):
    ids = torch.randint(0, 61, (1, 20), generator=torch.Generator().manual_seed(1))
    analog = convert_to_analog(tiny_llama, config)
    assert {n for n, _ in analog_layers(analog)} == {f"blk.{i}.{p}" for i in range(2) for p in
                                                     ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                      "ffn_up", "ffn_down")}
    assert "token_embd" in analog.digital_layers and "output_norm" in analog.digital_layers
    program(analog, seeds=[0, 1, 2])
    drift_to(analog, 3600, seeds=[5, 6, 7])
    with stacked_chips(analog), torch.no_grad():
        out = analog(ids.repeat(3, 1))
    with torch.no_grad():
        alone = _chip(tiny_llama, config, 1, 6)(ids)
        digital = tiny_llama(ids)
    assert torch.equal(out[1], alone[0])
    assert not torch.equal(out[0], out[1]) and not torch.equal(out[1], digital[0])
    assert torch.isfinite(out).all()


def test_bert_chips_in_one_pass_equal_one_at_a_time():
    torch.manual_seed(0)
    bert = Bert(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=32)).eval()
    ids = torch.randint(0, 50, (3, 10))
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0
    analog = convert_to_analog(bert, "pcm")
    assert len(analog_layers(analog)) == 12
    program(analog, seeds=[0, 1])
    drift_to(analog, 60, seeds=[3, 4])
    with stacked_chips(analog), torch.no_grad():
        out = analog(ids.repeat(2, 1), mask.repeat(2, 1))
        alone = _chip(bert, "pcm", 1, 4, t=60)(ids, mask)
    assert torch.equal(out[3:], alone)


def test_lm_head_stays_digital_unless_asked():
    net = torch.nn.Sequential()
    net.add_module("body", torch.nn.Linear(4, 4))
    net.add_module("lm_head", torch.nn.Linear(4, 7))
    assert [n for n, _ in analog_layers(convert_to_analog(net, "pcm"))] == ["body"]
    assert [n for n, _ in analog_layers(convert_to_analog(net, "pcm", lm_head=True))] == ["body", "lm_head"]
    assert [n for n, _ in analog_layers(convert_to_analog(net, "pcm", lm_head=True, layers="head"))] == ["lm_head"]
    with pytest.raises(HiltError, match="no Linear"):
        convert_to_analog(torch.nn.Sequential(torch.nn.ReLU()), "pcm")


def test_clipping_clips_what_it_says():
    torch.manual_seed(0)
    lin = torch.nn.Linear(200, 8, bias=False)
    with torch.no_grad():
        lin.weight[0, 0] = 5.0  # an outlier
    x = torch.randn(16, 200)
    ideal = dataclasses.replace(preset("ideal"), clip_std=3.0)
    analog = convert_to_analog(lin, ideal)
    w = lin.weight.detach()
    limit = 3 * w.std(1, keepdim=True, correction=0)
    assert clipped_share(analog) == pytest.approx(float((w.abs() > limit).double().mean()))
    assert 0 < clipped_share(analog) < 0.01
    with torch.no_grad():
        assert torch.allclose(analog(x), x @ w.clamp(-limit, limit).T, atol=1e-3)  # arrays hold to 1/64516
        assert not torch.allclose(analog(x), lin(x), atol=0.1)
    pct = convert_to_analog(lin, dataclasses.replace(preset("ideal"), clip_percentile=50.0))
    assert clipped_share(pct) == pytest.approx(0.5, abs=0.01)
    # column mapping on a chip: the row with the outlier keeps its own scale, the others are mapped finer
    pcm_layer = convert_to_analog(lin, "pcm")
    col = convert_to_analog(lin, dataclasses.replace(preset("pcm"), weight_mapping="column"))
    err = [((a.w_eff - w)[1:].abs().mean() / w[1:].abs().mean()).item() for a in (pcm_layer, col)]
    assert err[1] < 0.5 * err[0]


def test_tile_mapping_scales_each_tile_and_is_layer_mapping_within_one():
    """weight_mapping="tile" (aihwkit's programming scale): within one tile it is the layer mapping, bit
    for bit; a layer of 2 x 2 tiles with an outlier in one programs the other tiles with their own,
    finer scale."""
    from hilt.cim_sim.config import tile_unit
    from hilt.cim_sim.training import perturb

    devices = dict(dac_bits=None, adc_bits=None, out_noise=0.0, bound_management=False)
    pcm = dataclasses.replace(preset("pcm"), **devices)
    torch.manual_seed(0)
    small = torch.nn.Linear(48, 40, bias=False)
    one = {m: convert_to_analog(small, dataclasses.replace(pcm, weight_mapping=m)) for m in ("layer", "tile")}
    assert torch.equal(one["layer"].w_eff, one["tile"].w_eff)
    w = small.weight.detach()
    read = {m: perturb(w, 1.0, "pcm", torch.Generator().manual_seed(3), m, 512) for m in ("layer", "tile")}
    assert torch.equal(read["layer"], read["tile"])

    big = torch.nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        big.weight.normal_(0, 0.05)
        big.weight[0, 0] = 5.0  # 100x the others: the layer's g_max goes to it
    unit = tile_unit(big.weight.detach(), 32)
    assert unit[0, 0] == 5.0 and unit[40, 40] == big.weight[32:, 32:].abs().max() and unit[0, 40] < 1
    error = {}
    for m in ("layer", "tile"):
        chip = convert_to_analog(big, dataclasses.replace(pcm, weight_mapping=m, tile_size=32))
        diff = (chip.w_eff - big.weight.detach())[32:, 32:]
        error[m] = float(diff.norm() / big.weight[32:, 32:].norm())
    assert error["tile"] < error["layer"] / 5, error  # the noise floor in g keeps it from 100x


def test_static_input_ranges_are_calibrated_and_clip():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 8, bias=False)
    x = torch.randn(32, 64)
    config = dataclasses.replace(preset("pcm"), input_range="static", input_percentile=50.0, out_noise=0.0)
    analog = convert_to_analog(lin, config)
    with pytest.raises(HiltError, match="calibrate_inputs"), torch.no_grad():
        analog(x)
    ranges = calibrate_inputs(analog, lambda m: m(x))[""]["input_ranges"]
    program(analog, seed=0)
    assert ranges == [pytest.approx(float(x.abs().flatten().kthvalue(32 * 32).values))]
    with torch.no_grad():
        y = analog(x)
        clipped = x.clamp(-ranges[0], ranges[0]) @ analog.w_eff.T
        assert (y - clipped).abs().max() < 0.1 * (y - lin(x)).abs().max()  # the clipping is what moved it


def _outlier_inputs(rows=64, n_in=96, channel=5, factor=40.0):
    """Inputs whose one channel is ``factor`` times larger than the others, as LLM activations have."""
    x = torch.randn(rows, n_in)
    x[:, channel] *= factor
    return x


@pytest.mark.parametrize("alpha", [0.25, 0.5, 1.0])
def test_smoothing_scales_follow_smoothquant(alpha):
    torch.manual_seed(1)
    lin = torch.nn.Linear(96, 16, bias=False)
    x = _outlier_inputs()
    analog = convert_to_analog(lin, dataclasses.replace(preset("pcm"), smoothing=alpha))
    with pytest.raises(HiltError, match="smoothing needs calibrated scales"), torch.no_grad():
        analog(x)
    stats = calibrate_inputs(analog, lambda m: m(x))[""]["smoothing"]
    expected = x.abs().amax(0) ** alpha / lin.weight.detach().abs().amax(0) ** (1 - alpha)
    assert torch.allclose(analog.input_scale, expected, rtol=1e-6)
    assert stats == pytest.approx([float(expected.min()), float(expected.median()), float(expected.max())], rel=1e-6)
    assert torch.allclose(analog.w_target, lin.weight.detach() * expected, rtol=1e-6)


def test_smoothing_leaves_the_product_exact_and_shrinks_the_dac_error():
    """Equality case: without converters or noise the smoothed layer is the digital one. With a 7-bit
    DAC, an outlier channel sets every row's range; smoothing moves it into the weights."""
    torch.manual_seed(2)
    lin = torch.nn.Linear(96, 16)
    x = _outlier_inputs()
    with torch.no_grad():
        y = lin(x)
        exact = convert_to_analog(lin, dataclasses.replace(preset("ideal"), smoothing=0.5))
        calibrate_inputs(exact, lambda m: m(x))
        program(exact, seed=0)
        assert not exact.is_ideal  # the smoothed path ran, not the digital shortcut
        assert (exact(x) - y).norm() < 1e-4 * y.norm()  # arrays hold weights to 1/64,516 of a row's abs-max
        assert torch.allclose(exact.held_weights(), lin.weight, rtol=1e-6, atol=1e-7)
        errors = {}
        for alpha in (0.0, 0.5):
            dac_only = dataclasses.replace(preset("ideal"), dac_bits=7, smoothing=alpha)
            analog = convert_to_analog(lin, dac_only)
            if alpha:
                calibrate_inputs(analog, lambda m: m(x))
            program(analog, seed=0)
            errors[alpha] = float((analog(x) - y).norm() / y.norm())
    assert errors[0.5] < 0.5 * errors[0.0], errors
    with pytest.raises(HiltError, match="smoothing: at least 0 and at most 1"):
        convert_to_analog(lin, dataclasses.replace(preset("pcm"), smoothing=1.5))
    with pytest.raises(HiltError, match="Linear layers only"):
        convert_to_analog(torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3)), dataclasses.replace(preset("pcm"), smoothing=0.5))


def test_frozen_model_keeps_the_smoothing_division():
    from hilt.cim_sim.frozen import freeze

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(96, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    x = _outlier_inputs(rows=16)
    analog = convert_to_analog(model, dataclasses.replace(preset("pcm"), out_noise=0.0, smoothing=0.5))
    calibrate_inputs(analog, lambda m: m(x))
    program(analog, seed=0)
    drift_to(analog, 3600.0, seed=1)
    with torch.no_grad():
        want, got = analog(x), freeze(analog)(x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    static = convert_to_analog(model, dataclasses.replace(preset("pcm"), input_range="static"))
    calibrate_inputs(static, lambda m: m(x))
    program(static, seed=0)
    with pytest.raises(HiltError, match="static input ranges"):
        freeze(static)


def test_drift_command_bad_input_is_one_line(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    cases = [(["--model", str(tmp_path), "--times", "1s"], "no config.json"),
             (["--model", "smollm2", "--times", "1x"], "cannot read time"),
             (["--model", "smollm2", "--text", str(empty)], "empty")]
    for extra, message in cases:
        r = subprocess.run([sys.executable, "-m", "hilt", "drift", *extra, "--json", str(tmp_path / "out.json")],
                           capture_output=True, text=True)
        assert r.returncode == 1, r.stderr
        assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "out.json").exists()


def test_set_fields_are_read_as_their_types():
    """`--set` values come as JSON or text; each is checked against its AnalogConfig field: "none" where the
    field may be None (the converters off), numbers for numbers, and a one-line error naming the field."""
    from hilt.tasks.drift_lm import chip_config

    c = chip_config("pcm", {"adc_bits": "none", "dac_bits": None, "clip_std": 3, "bound_management": False,
                            "weight_mapping": "column"})
    assert c.adc_bits is None and c.dac_bits is None and c.clip_std == 3.0 and isinstance(c.clip_std, float)
    assert c.bound_management is False and c.weight_mapping == "column" and c.smoothing == preset("pcm").smoothing
    for bad, expected in (({"adc_bits": "many"}, "int or none"), ({"adc_bits": 7.5}, "int or none"),
                          ({"smoothing": "x"}, "float"), ({"bound_management": 1}, "bool"), ({"device": None}, "str")):
        with pytest.raises(HiltError, match=f"--set {next(iter(bad))}=.*expected {expected}"):
            chip_config("pcm", bad)


@pytest.mark.parametrize("dac_bits", [7, None], ids=["integer-product", "float-product"])
def test_compensation_ahead_of_the_adc_does_not_scale_the_periphery(dac_bits):
    """gdc_before_adc: the drift compensation factor multiplies the product ahead of the output noise
    and the ADC, so at a factor of 2.5 the output noise is its own size, not 2.5 times it (the same
    draws), and the ADC's rounding error stays within half a step, where compensating after the
    ADC spreads it over 2.5 steps."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(40, 24)
    x = torch.randn(64, 40)
    quiet = dict(prog_noise_scale=0.0, read_noise_scale=0.0, drift_scale=0.0, dac_bits=dac_bits, bound_management=False)

    def run(ahead, **fields):
        chip = _chip(lin, dataclasses.replace(preset("pcm"), gdc_before_adc=ahead, **quiet, **fields), 0, 1)
        chip.gdc_scale = torch.full_like(chip.gdc_scale, 2.5)
        with torch.no_grad():
            return chip(x)

    exact = run(False, out_noise=0.0, adc_bits=None)  # 2.5 x the product the arrays compute
    torch.testing.assert_close(run(True, out_noise=0.0, adc_bits=None), exact, rtol=1e-5, atol=1e-5)
    after, ahead = run(False, adc_bits=None) - exact, run(True, adc_bits=None) - exact
    assert float(ahead.std()) > 0.01
    torch.testing.assert_close(after, 2.5 * ahead, rtol=1e-3, atol=1e-4)
    # the ADC alone: its step in output units, at each row's input scale (noise management)
    rows = x.abs().amax(-1, keepdim=True) if dac_bits else 1.0
    step = 2 * 12.0 / (2**9 - 2) * rows
    err = {ahead: float(((run(ahead, out_noise=0.0) - exact) / step).abs().max()) for ahead in (False, True)}
    assert err[True] <= 0.5 + 1e-3 < 1.0 < err[False] <= 1.25 + 1e-3, err


def test_a_language_model_goes_on_a_preset_with_its_deployment_unless_asked(tiny_gguf, tmp_path, capsys):
    """`hilt drift` puts a language model on the preset with column mapping and smoothing 0.5 (the log names them);
    `--set` changes one, `--preset-as-is` keeps the preset's own."""
    from hilt.tasks.drift_lm import chip_name, lm_deployment
    from hilt.cim_sim import preset

    assert lm_deployment({"smoothing": 0.0}) == {"weight_mapping": "column", "smoothing": 0.0}
    assert lm_deployment({"tile_size": 64}, as_is=True) == {"tile_size": 64}
    out = tmp_path / "r.json"
    from hilt.cli import main

    capsys.readouterr()
    assert main(["drift", "--model", str(tiny_gguf), "--times", "1s", "--chips", "1", "--tokens", "32", "--context",
                 "16", "--json", str(out)]) == 0
    config = json.loads(out.read_text())["config"]
    assert config["weight_mapping"] == "column" and config["smoothing"] == 0.5
    assert "on pcm (weight_mapping=column, smoothing=0.5)" in "".join(capsys.readouterr())
    assert chip_name("pcm", preset("pcm")) == "pcm (as the preset is)"
