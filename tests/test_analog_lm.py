"""`hilt bench analog-lm` (bench/studies/analog_lm.py): its digital baselines, chips run a few at a time,
the tuned copies it keeps, and the --quick study on a tiny Llama through the command line."""

import json

import pytest
import torch
from torch import nn

from helpers import run_hilt
from hilt.bench.studies import analog_lm
from hilt.errors import HiltError


def test_w4a8_rounds_each_chip_layer_input_to_its_static_8bit_range():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    calib = torch.randn(16, 64) * 3

    w4 = analog_lm.w4_copy(model)
    w4a8 = analog_lm.w4_copy(model, lambda m: m(calib))
    for layer in (w4[0], w4[2]):  # int4 grid: at most 16 levels per group
        groups = layer.weight.reshape(layer.out_features, -1, min(64, layer.in_features))
        assert max(len(torch.unique(g)) for row in groups for g in row) <= 16
    assert torch.equal(w4[0].weight, w4a8[0].weight) and not torch.equal(w4[0].weight, model[0].weight)

    seen = {}
    w4a8[0].register_forward_hook(lambda m, args, out: seen.__setitem__("x", args[0]))
    x = torch.randn(8, 64) * 5  # beyond the calibrated range: clipped to it
    y = w4a8(x)
    step = float(calib.abs().max()) / 127
    codes = seen["x"] / step
    assert torch.allclose(codes, codes.round(), atol=1e-3) and codes.abs().max() <= 127 + 1e-3
    assert not torch.allclose(y, w4(x), atol=1e-4)  # the rounding is not ignored
    assert torch.isfinite(y).all()


def test_chips_run_a_few_at_a_time_are_the_chips_of_one_pass(tiny_gguf):
    from hilt.tasks.drift_lm import load_language_model

    lm = load_language_model(str(tiny_gguf))
    budget = {"tokens": 32, "context": 16, "sentences": 8}
    one_pass = analog_lm.on_chips(lm, "pcm", analog_lm.DEPLOY, ["1s", "1y"], 3, 3, budget)
    in_groups = analog_lm.on_chips(lm, "pcm", analog_lm.DEPLOY, ["1s", "1y"], 3, 2, budget)
    for t in ("1s", "1y"):
        assert len(in_groups["times"][t]["all"]) == 3
        assert in_groups["times"][t]["all"] == pytest.approx(one_pass["times"][t]["all"], rel=1e-5)
        assert in_groups["times"][t]["worst"] == max(in_groups["times"][t]["all"])


def test_drift_runs_the_chips_a_pass_at_a_time_where_they_do_not_fit(tiny_gguf, monkeypatch):
    """`hilt drift` on a language model: chips whose state does not fit in a third of the memory available run
    a few at a time, and read what one pass reads."""
    from hilt.tasks import drift_lm

    assert drift_lm.chips_per_pass(100, 8, None) == 8 and drift_lm.chips_per_pass(100, 8, 10**6) == 8
    assert drift_lm.chips_per_pass(100, 8, 750) == 2 and drift_lm.chips_per_pass(100, 8, 10) == 1
    lm = drift_lm.load_language_model(str(tiny_gguf))
    args = dict(times="1s,1y", chips=3, tokens=32, context=16, lm=lm, uncompensated=False)
    one = drift_lm.lm_drift_study(**args)
    per_chip = one["memory_per_chip"]["bytes_per_chip"]
    monkeypatch.setattr(drift_lm, "available_bytes", lambda: 3 * per_chip)  # one chip a pass
    apart = drift_lm.lm_drift_study(**args)
    assert one["chips_per_pass"] == 3 and apart["chips_per_pass"] == 1
    for a, b in zip(one["rows"], apart["rows"], strict=True):
        assert len(b["all"]) == 3 and b["all"] == pytest.approx(a["all"], rel=1e-5)


def test_energy_counts_the_layers_the_chip_holds(tiny_gguf):
    from hilt.tasks.drift_lm import eval_data, load_language_model

    lm = load_language_model(str(tiny_gguf))
    data, _ = eval_data(lm, None, 32, 16)
    e = analog_lm.energy_per_token(lm, data)
    assert e["layers"] == 2 * 7 and e["tokens"] == 16
    assert 0 < e["cim_joules_per_token"] and e["cim_over_gpu"] == pytest.approx(
        e["cim_joules_per_token"] / e["gpu_joules_per_token"])


def test_forward_speed_runs_the_most_chips_only_where_they_fit(tiny_gguf, monkeypatch):
    """The study's speed: 1, ``group`` and ``most`` chips in one pass, ``most`` only where its chips' state fits in
    60% of the memory available (else its bytes are reported and no ratio)."""
    from hilt.tasks import drift_lm

    lm = drift_lm.load_language_model(str(tiny_gguf))
    speed = analog_lm.forward_speed(lm, 16, 2, repeats=1, most=3)
    assert set(speed["chips_s"]) == {"1", "2", "3"} and speed["most_bytes"] > 0
    assert speed["most_over_one_chip"] == pytest.approx(speed["chips_s"]["3"] / speed["chips_s"]["1"])
    need = speed["most_bytes"]
    for available, measured in ((int(need / 0.6) + 2, {"1", "2", "3"}), (int(need / 0.6) - 1, {"1", "2"})):
        monkeypatch.setattr(drift_lm, "available_bytes", lambda: available)
        speed = analog_lm.forward_speed(lm, 16, 2, repeats=1, most=3)
        assert set(speed["chips_s"]) == measured and ("most_over_one_chip" in speed) == ("3" in measured)


def test_quick_study_on_a_tiny_llama_keeps_its_tuned_models(tiny_gguf, tmp_path, monkeypatch):
    work = tmp_path / "work"
    deployed, on_chips = [], analog_lm.on_chips
    monkeypatch.setattr(analog_lm, "on_chips", lambda lm, p, overrides, *a, **k: deployed.append(overrides) or
                        on_chips(lm, p, overrides, *a, **k))
    result = json.loads(json.dumps(analog_lm.study(quick=True, models=[str(tiny_gguf)], work=work, peer=False,
                                                   overrides={"gdc_before_adc": True})))
    # (through json: as --json writes it)
    assert deployed and all(d == {**analog_lm.DEPLOY, "gdc_before_adc": True} for d in deployed)
    assert "On `pcm` with `gdc_before_adc=True`" in analog_lm.render(result)
    analog_lm.plot(result, tmp_path / "study.png")
    entry = result["models"][str(tiny_gguf)]
    assert list(entry["variants"]) == list(analog_lm.VARIANTS)
    for variant, row in entry["variants"].items():
        assert set(row["digital"]) == {"float", "w4", "w4a8"}
        for stats in row["chips"]["pcm"]["times"].values():
            assert len(stats["all"]) == 2 and stats["worst"] == max(stats["all"])
        assert (row["training"] is None) == (variant == "as trained")
    assert entry["variants"]["noise"]["training"]["settings"]["steps"] == analog_lm.QUICK["steps"]["noise"]
    assert "mean_over_w4" in result["goals"][str(tiny_gguf)]
    speed = entry["speed"]  # --quick: at most 2 chips in one pass
    assert speed["one_chip_over_digital"] > 0 and set(speed["chips_s"]) == {"1", "2"} and speed["most"] == 2
    assert speed["most_over_one_chip"] == pytest.approx(speed["chips_s"]["2"] / speed["chips_s"]["1"])
    assert (tmp_path / "study.png").stat().st_size > 0 and "| as trained |" in analog_lm.render(result)

    # a rerun reads the tuned models back; other settings are refused, naming the file
    from hilt.tasks import hwa

    monkeypatch.setattr(hwa, "tune", lambda *a, **k: pytest.fail("retrained a kept model"))
    path, record = analog_lm.tuned_copy(str(tiny_gguf), "noise", work, analog_lm.QUICK["steps"]["noise"],
                                        analog_lm.QUICK["batch"], analog_lm.QUICK["context"])
    assert path.endswith("tiny-noise.gguf") and record["settings"]["method"] == "noise"
    with pytest.raises(HiltError, match="tiny-noise.gguf.*other settings"):
        analog_lm.tuned_copy(str(tiny_gguf), "noise", work, 99, 1, 64)


def test_bad_preset_is_one_line(tmp_path):
    r = run_hilt("bench", "analog-lm", "--presets", "pcm,nope", "--work", tmp_path / "w")
    assert r.returncode == 1 and "nope" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("flag", ["nope=1", "gdc_before_adc=maybe"])
def test_bad_deployment_field_is_one_line(tmp_path, flag):
    r = run_hilt("bench", "analog-lm", "--set", flag, "--work", tmp_path / "w", "--json", tmp_path / "r.json")
    assert r.returncode == 1 and flag.split("=")[0] in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "w").exists() and not (tmp_path / "r.json").exists()


def test_the_reports_snapshot_reads_tuned_copies_on_disk_and_feeds_the_claim(tiny_gguf, tmp_path):
    """The report's SmolLM2-on-PCM section, on a tiny Llama: the model as trained, a tuned copy where one lies in
    the work folder (here the model itself under the tuned name), each beside float, W4 and W4A8; the plot draws
    it, and the headline's chip claim reads it."""
    import shutil

    from hilt.bench import claims

    kwargs = dict(model=str(tiny_gguf), times=("1s", "1y"), chips=2, tokens=32, context=16)
    alone = analog_lm.snapshot(work=tmp_path, **kwargs)
    entry = alone["models"][str(tiny_gguf)]
    assert list(entry["variants"]) == ["as trained"] and entry["tuned_missing"] == ["noise", "dwp"]
    assert "No tuned copy on disk (noise, dwp)" in analog_lm.snapshot_markdown(alone)

    shutil.copy(tiny_gguf, analog_lm.tuned_path(str(tiny_gguf), "noise", tmp_path))
    result = analog_lm.snapshot(work=tmp_path, **kwargs)
    entry = result["models"][str(tiny_gguf)]
    assert list(entry["variants"]) == ["as trained", "noise"] and entry["tuned_missing"] == ["dwp"]
    for row in entry["variants"].values():
        assert set(row["digital"]) == {"float", "w4", "w4a8"} and all(v > 1 for v in row["digital"].values())
        assert [len(row["chips"]["pcm"]["times"][t]["all"]) for t in ("1s", "1y")] == [2, 2]
    analog_lm.plot(result, tmp_path / "cim_lm.png")
    assert (tmp_path / "cim_lm.png").stat().st_size > 10_000
    result["models"] = {"smollm2": entry}  # the claim is SmolLM2's: read under that name
    verdict = next(v for v in claims.headline({"cim_lm": result}) if v.claim.startswith("SmolLM2 on the `pcm` chip"))
    assert verdict.measured is not None and "2 chips" in verdict.measured
