"""The Analog Foundation Models chip (cim_sim/afm.py): its noise against their formula, its forward against a
direct computation, the range gradient against their rule, and the commands built on it (`hilt drift --preset afm`,
`hilt hwa --method afm`, `hilt bench afm`)."""

import json

import numpy as np
import pytest
import torch
from torch import nn

from helpers import run_hilt
from hilt.cim_sim import afm
from hilt.errors import HiltError


def _their_sigma(g: np.ndarray) -> np.ndarray:
    """Their noise std at scaled |w| = g: numpy's polyval of the branch's fit, rounded to float16 as they round it."""
    low, high = np.polyval(afm.SIGMA_LOW, g), np.polyval(afm.SIGMA_HIGH, g)
    return np.where(g > afm.BRANCH, high, low).astype(np.float16).astype(np.float64)


def test_sigma_is_their_fit_in_both_branches_and_continuous_where_they_meet():
    g = torch.tensor([0.0, 0.6, 10.0, 52.5, 52.6, 100.0, 180.0], dtype=torch.float64)
    assert np.array_equal(afm.pcm_sigma(g).numpy(), _their_sigma(g.numpy()))
    at = np.array([afm.BRANCH])
    assert np.polyval(afm.SIGMA_LOW, at) == pytest.approx(np.polyval(afm.SIGMA_HIGH, at), rel=2e-3)
    assert float(afm.pcm_sigma(torch.tensor(180.0))) == pytest.approx(19.2, abs=0.1)  # about 10.7% of G_MAX


@pytest.mark.parametrize("level", [30.0, 52.5, 120.0])
def test_pcm_noise_has_their_std_at_each_level_per_row_part(level):
    # rows of 1024 inputs in two parts of 512: each part's first weight sets its scale (2 and 0.5), the others sit at
    # `level` of 180 of that scale
    rows, n = 256, 1024
    w = torch.empty(rows, n)
    w[:, :512], w[:, 512:] = 2.0 * level / afm.G_MAX, 0.5 * level / afm.G_MAX
    w[:, 0], w[:, 512] = 2.0, -0.5
    w[:, 1::2] *= -1
    noisy = afm.pcm_noise(w, 512, torch.Generator().manual_seed(0))
    sigma = _their_sigma(np.array([level]))[0]
    for sl, scale in ((slice(2, 512), 2.0), (slice(514, None), 0.5)):
        err = ((noisy[:, sl] - w[:, sl]) * afm.G_MAX / scale).double()
        assert float(err.mean()) == pytest.approx(0.0, abs=4 * sigma / err.numel() ** 0.5)
        assert float(err.std()) == pytest.approx(sigma, rel=0.01)
    # one part for the whole row: the second part's weights are then small against the row's max of 2
    whole = afm.pcm_noise(w, 0, torch.Generator().manual_seed(0))
    err = ((whole[:, 514:] - w[:, 514:]) * afm.G_MAX / 2.0).double()
    assert float(err.std()) == pytest.approx(_their_sigma(np.array([level / 4]))[0], rel=0.01)


def test_pcm_noise_zeroes_what_scales_under_0_6_and_keeps_no_nan():
    w = torch.tensor([[1.0, 0.59 / 180, 0.61 / 180, 0.0], [0.0, 0.0, 0.0, 0.0]])
    noisy = afm.pcm_noise(w.repeat(500, 1), 0, torch.Generator().manual_seed(1))
    assert torch.isfinite(noisy).all()
    assert (noisy[0::2, 1] == 0).all() and (noisy[0::2, 3] == 0).all() and (noisy[0::2, 2] != 0).all()
    assert (noisy[1::2] == 0).all()  # an all-zero row stays zero (no division by zero)


def test_additive_noise_is_its_share_of_the_part_max():
    w = torch.zeros(512, 1024)
    w[:, 0], w[:, 600] = 4.0, 1.0
    noisy = afm.additive_noise(w, 0.05, 512, torch.Generator().manual_seed(2))
    assert float((noisy - w)[:, 1:512].std()) == pytest.approx(0.05 * 4.0, rel=0.01)
    assert float((noisy - w)[:, 601:].std()) == pytest.approx(0.05 * 1.0, rel=0.01)


def _reference_forward(x, w, b, r, cfg):
    """Their analog forward written out: clip to r, round to 254 steps, product, round to 254 steps over
    r * out_bound * row max, clip there."""
    x = x.clamp(-r, r)
    dx = 2 * r / (2**cfg.dac_bits - 2)
    x = torch.round(x / dx) * dx
    y = x @ w.T
    bound = r * cfg.out_bound * w.abs().amax(1)
    dy = 2 * bound / (2**cfg.adc_bits - 2)
    return torch.minimum(torch.maximum(torch.round(y / dy) * dy, -bound), bound) + b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_is_their_computation_with_clipping_at_both_ends(dtype):
    gen = torch.Generator().manual_seed(3)
    lin = nn.Linear(37, 11)
    layer = afm.AfmLinear(lin, afm.AfmConfig())
    layer.input_range.fill_(1.5)
    x = 2 * torch.randn(5, 37, generator=gen)  # some inputs beyond the range
    with torch.no_grad():
        expect = _reference_forward(x, lin.weight, lin.bias, 1.5, layer.config)
        assert torch.allclose(layer(x), expect, atol=1e-5)
        # the output at its bound: one input at the range, one weight per row
        lin.weight.zero_()
        lin.weight[:, 0] = 1.0
        small = afm.AfmLinear(lin, afm.AfmConfig(out_bound=0.5))
        small.input_range.fill_(1.5)
        y = small(torch.full((1, 37), 9.0)) - lin.bias
        assert torch.allclose(y, torch.full((1, 11), 1.5 * 0.5))
        out = afm.AfmLinear(lin.to(dtype), afm.AfmConfig())(x.to(dtype))
        assert out.dtype == dtype and torch.isfinite(out).all()
        lin.weight[3] = 0.0  # an all-zero row reads its bias, not NaN
        out = afm.AfmLinear(lin, afm.AfmConfig())(x.to(dtype))
        assert torch.isfinite(out).all() and torch.equal(out[:, 3], lin.bias[3].expand(5))


def test_range_gradient_follows_their_rule():
    r = torch.tensor(1.0, requires_grad=True)
    x = torch.tensor([2.0, -3.0, 0.5, 1.0, -2.0], requires_grad=True)
    y = afm._RangeClip.apply(x, r, 0.0, 0.95)
    y.backward(torch.tensor([-1.0, 2.0, 3.0, 5.0, -4.0]))
    # upper-clipped (2.0, and 1.0 at the edge) take min(d, 0): -1 + 0; lower-clipped (-3, -2) take -max(d, 0): -2
    assert float(r.grad) == pytest.approx(-3.0)
    assert x.grad.tolist() == [0.0, 0.0, 3.0, 5.0, 0.0]  # the edge value passes its gradient
    r.grad = None
    y = afm._RangeClip.apply(torch.tensor([0.1] * 40 + [2.0]), r, 0.01, 0.95)
    y.backward(torch.zeros(41))
    assert float(r.grad) == pytest.approx(0.01)  # under 5% clipped: the decay pulls the range in


def test_calibrated_range_is_alpha_times_the_mean_std():
    model = nn.Sequential(nn.Linear(8, 8))
    chip = afm.to_afm(model, afm.AfmConfig(range_std_alpha=3.0))
    batches = [torch.randn(4, 8) * s for s in (1.0, 3.0)]
    afm.calibrate_ranges(chip, lambda m: [m(b) for b in batches])
    expect = 3.0 * sum(float(b.std()) for b in batches) / 2
    assert float(chip[0].input_range) == pytest.approx(expect, rel=1e-5)
    with pytest.raises(HiltError, match="no input reached"):
        afm.calibrate_ranges(afm.to_afm(model, afm.AfmConfig()), lambda m: None)


@pytest.mark.parametrize("field,value", [("noise", "gauss"), ("dac_bits", 1), ("out_bound", 0.0),
                                         ("tile_inputs", -1), ("additive_std", -0.1), ("adc_bits", 2.5),
                                         ("range_std_alpha", float("inf")), ("dac_bits", True), ("noise", 3)])
def test_bad_config_is_one_line_naming_the_field(field, value):
    with pytest.raises(HiltError, match=field):
        afm.AfmConfig(**{field: value})


def test_drift_reads_a_model_on_the_afm_chip(tiny_gguf, tmp_path):
    out = tmp_path / "afm.json"
    r = run_hilt("drift", "--model", tiny_gguf, "--preset", "afm", "--chips", "2", "--tokens", "32", "--context", "16",
                 "--json", out)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    row = result["rows"][0]
    assert result["preset"] == "afm" and result["input_ranges"] == "calibrated" and len(row["all"]) == 2
    assert row["all"][0] != row["all"][1] and row["worst"] == max(row["all"])
    for args, words in ((["--times", "1s,1y"], "no drift"), (["--set", "noise=gauss"], "noise"),
                        (["--set", "tile_size=4"], "not a field"), (["--plot", str(tmp_path / "p.png")], "--plot")):
        bad = run_hilt("drift", "--model", tiny_gguf, "--preset", "afm", *args)
        assert bad.returncode != 0 and words in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert run_hilt("drift", "--model", "cnn", "--preset", "afm").returncode != 0


def test_hwa_afm_recipe_writes_weights_and_learned_ranges_and_resumes(tiny_gguf, tmp_path, monkeypatch):
    from hilt.tasks import drift_lm, hwa

    # an interrupted run resumes where it stopped, on the same text, to the weights of one that was not
    clip, calls = afm.clip_rows_, []

    def stop_after_two(model, sigma):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return clip(model, sigma)

    again = tmp_path / "again.gguf"
    state = again.with_name(again.name + ".hwa-state")
    monkeypatch.setattr(afm, "clip_rows_", stop_after_two)
    with pytest.raises(KeyboardInterrupt):
        hwa.tune(str(tiny_gguf), again, method="afm", steps=3, batch=1, context=16, save_every=1, synthetic=64,
                 progress=False)
    monkeypatch.setattr(afm, "clip_rows_", clip)
    assert (state / "state.json").is_file() and hwa.synthetic_path(state).is_file()
    with pytest.raises(HiltError, match="other settings"):
        hwa.tune(str(tiny_gguf), again, method="afm", steps=3, batch=1, context=16, synthetic=64, resume=True,
                 progress=False, weight_noise=0.1)
    other = tmp_path / "other.gguf"  # another model resumed into this one's state
    other.write_bytes(tiny_gguf.read_bytes())
    with pytest.raises(HiltError, match="other settings"):
        hwa.tune(str(other), again, method="afm", steps=3, batch=1, context=16, save_every=1, synthetic=64,
                 resume=True, progress=False)
    resumed = hwa.tune(str(tiny_gguf), again, method="afm", steps=3, batch=1, context=16, save_every=1,
                       synthetic=64, resume=True, progress=False)
    whole = hwa.tune(str(tiny_gguf), tmp_path / "whole.gguf", method="afm", steps=3, batch=1, context=16,
                     save_every=1, synthetic=64, progress=False)
    assert resumed["resumed_at"] == 2 and resumed["input_ranges"] == pytest.approx(whole["input_ranges"])
    assert resumed["losses"] == pytest.approx(whole["losses"][2:])

    out = tmp_path / "whole.gguf"
    ranges = json.loads(drift_lm.ranges_path(out).read_text())
    assert whole["input_ranges"] == ranges and all(v > 0 for v in ranges.values()) and len(ranges) == 14
    assert whole["recipe"]["clip_sigma"] == 2.5 and whole["synthetic"] == 64 and all(map(np.isfinite, whole["losses"]))
    assert not hwa.synthetic_path(out.with_name(out.name + ".hwa-state")).exists()
    assert drift_lm.afm_study(str(out), draws=1, tokens=32, context=16)["input_ranges"] == "learned"


@pytest.mark.parametrize("args,words", [
    (["--method", "afm", "--clip-sigma", "0"], "--clip-sigma"),
    (["--method", "afm", "--synthetic", "0"], "--synthetic"),
    (["--method", "afm", "--synthetic", "8", "--context", "16"], "--synthetic"),
    (["--method", "noise", "--clip-sigma", "2"], "apply to --method afm"),
    (["--method", "noise", "--preset", "afm"], "--method afm"),
    (["--method", "afm", "--preset", "pcm"], "--preset pcm"),
    (["--method", "afm", "--set", "dac_bits=1"], "dac_bits"),
])
def test_hwa_afm_options_refused_in_one_line_before_work(tiny_gguf, tmp_path, args, words):
    out = tmp_path / "t.gguf"
    r = run_hilt("hwa", tiny_gguf, out, *args)
    assert r.returncode != 0 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists() and not any(tmp_path.iterdir())


def test_quick_study_on_a_tiny_llama(tiny_gguf, tmp_path):
    from hilt.bench.studies import afm as afm_study

    work = tmp_path / "work"
    result = json.loads(json.dumps(afm_study.study(quick=True, models=[str(tiny_gguf)], work=work)))
    entry = result["models"][str(tiny_gguf)]
    assert list(entry["variants"]) == list(afm_study.VARIANTS)
    for variant, row in entry["variants"].items():
        assert set(row["digital"]) == {"float", "w4", "w4a8", "w4a8_token"}
        assert len(row["afm"]["all"]) == afm_study.QUICK["draws"] and row["afm"]["worst"] == max(row["afm"]["all"])
        assert row["afm"]["input_ranges"] == ("learned" if variant == "afm recipe" else "calibrated")
        assert set(row["pcm"]) == {"1"} and set(row["pcm"]["1"]["times"]) == set(afm_study.QUICK["times"])
    assert (work / "tiny-afm.gguf").is_file() and (work / "tiny-afm.gguf.afm_input_ranges.json").is_file()
    goals = result["goals"][str(tiny_gguf)]
    assert goals["afm_recipe_over_w4a8"] == pytest.approx(entry["variants"]["afm recipe"]["afm"]["mean"] / goals["w4a8"])
    text = afm_study.render(result)
    assert "| afm recipe |" in text and "W4A8 per token" in text and "afm chip: the recipe's mean" in text
    afm_study.plot(result, tmp_path / "afm.png")
    assert (tmp_path / "afm.png").stat().st_size > 0


def test_bench_afm_refuses_an_encoder_in_one_line(tmp_path):
    r = run_hilt("bench", "afm", "--models", "minilm", "--work", tmp_path / "w")
    assert r.returncode == 1 and "encoder" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "w").exists()
