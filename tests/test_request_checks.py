"""Requests refused whole before any model loads: field ranges in one place, negative numbers read as values,
interrupted state guarded, Python errors naming arguments."""

import dataclasses

import pytest

from hilt.cim_sim import AnalogConfig, preset
from hilt.cim_sim.config import FIELD_RANGES
from hilt.cli import main
from hilt.errors import HiltError
from hilt.quant import QuantConfig


def hilt(capsys, *args):
    capsys.readouterr()
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(FIELD_RANGES))
def test_every_range_holds_at_its_edge_and_not_past_it(name):
    lo, hi, open_low = FIELD_RANGES[name]
    kind = type(getattr(AnalogConfig(), name) if getattr(AnalogConfig(), name) is not None else 1)
    step = 1 if kind is int else 1e-6
    edges = [] if open_low else [lo]
    edges += [hi] if hi is not None else [lo + 1000 * step]
    outside = [lo - step if not open_low else lo] + ([hi + step] if hi is not None else [])
    for value in edges:
        assert getattr(dataclasses.replace(AnalogConfig(), **{name: kind(value)}), name) == kind(value)
    for value in outside:
        with pytest.raises(HiltError, match=rf"AnalogConfig\.{name}: "):
            dataclasses.replace(AnalogConfig(), **{name: kind(value)})


def test_types_and_non_finite_values_are_refused():
    with pytest.raises(HiltError, match="tile_size: expected int, got 2.5"):
        AnalogConfig(tile_size=2.5)
    with pytest.raises(HiltError, match="devices_per_weight: expected int, got True"):
        AnalogConfig(devices_per_weight=True)
    with pytest.raises(HiltError, match="out_noise: expected a finite float"):
        AnalogConfig(out_noise=float("inf"))
    assert AnalogConfig(adc_bits=None).adc_bits is None


@pytest.mark.parametrize("setting, words", [("tile_size=0", "at least 1"), ("dac_bits=1", "at least 2"),
                                            ("out_bound=0", "above 0"), ("smoothing=1.5", "at most 1")])
def test_set_out_of_range_is_one_line_before_the_model_loads(setting, words, capsys, monkeypatch):
    from hilt.tasks import drift_lm

    monkeypatch.setattr(drift_lm, "load_language_model", lambda *a: pytest.fail("the model was loaded"))
    code, err = hilt(capsys, "drift", "--model", "smollm2", "--set", setting)
    assert code == 1 and f"--set {setting}" in err and words in err and len(err.strip().splitlines()) == 1


def test_grid_and_set_share_the_ranges(tmp_path):
    from hilt.tasks.grid import parse_grid

    path = tmp_path / "g.toml"
    path.write_text('[axes]\nmodel = "mlp"\ntime = ["1s"]\ndac_bits = [25]')
    with pytest.raises(HiltError, match="axes.dac_bits: expected integers >= 2 and <= 24"):
        parse_grid(path)


def test_one_token_is_refused_before_the_model_loads(capsys, monkeypatch):
    from hilt.tasks import drift_lm

    monkeypatch.setattr(drift_lm, "load_language_model", lambda *a: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit_:  # read with the command line: a window of one token predicts nothing
        hilt(capsys, "drift", "--model", "smollm2", "--tokens", 1)
    assert exit_.value.code == 2 and "--tokens: expected an integer >= 2, got '1'" in capsys.readouterr().err
    with pytest.raises(HiltError, match="--tokens and --context must be at least 2"):  # and by the task itself
        drift_lm.lm_drift_study("smollm2", tokens=1)


@pytest.mark.parametrize("value", ["-1e-5", "-.5", "-2"])
def test_a_negative_number_is_a_value_not_a_flag(value, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        hilt(capsys, "hwa", "smollm2", tmp_path / "x.gguf", "--lr", value)
    assert exit_.value.code == 2 and f"--lr: expected a positive number, got '{value}'" in capsys.readouterr().err


def test_an_interrupted_runs_state_is_neither_continued_nor_lost_unasked(capsys, tmp_path):
    state = tmp_path / "tuned.gguf.hwa-state"
    state.mkdir()
    (state / "state.json").write_text("{}")
    code, err = hilt(capsys, "hwa", "smollm2", tmp_path / "tuned.gguf")
    assert code == 1 and "--resume" in err and "--overwrite" in err and (state / "state.json").is_file()
    qat_state = tmp_path / "q.qat-state"
    qat_state.mkdir()
    (qat_state / "state.json").write_text("{}")
    code, err = hilt(capsys, "qat", "smollm2", tmp_path / "q")
    assert code == 1 and "--resume" in err and "--overwrite" in err and (qat_state / "state.json").is_file()


def test_python_errors_name_the_argument_not_a_flag():
    with pytest.raises(HiltError, match=r"^bits must be between 1 and 8, got 9$"):
        QuantConfig("kmeans", 9)
    with pytest.raises(HiltError, match=r"^method binary is 1 bit, got bits 2$"):
        QuantConfig("binary", 2)
    with pytest.raises(HiltError, match="^block_size must be positive"):
        QuantConfig("int", 4, 0)
    assert preset("pcm").tile_size == 512


@pytest.mark.parametrize("command", [["bench", "decode", "--quick"], ["bench", "exports", "--quick"]])
def test_a_results_folder_that_cannot_be_written_is_refused_before_the_benchmark(command, capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, err = hilt(capsys, *command, "--out", blocker / "results")
    assert code == 1 and "is a file" in err and len(err.strip().splitlines()) == 1
    code, err = hilt(capsys, *command, "--out", blocker)
    assert code == 1 and "a folder to write results into is needed" in err
