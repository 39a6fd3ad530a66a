"""The per-layer CIM diagnosis of a language model (bench/studies/analog_lm_diagnosis.py) on a tiny random Llama."""

import dataclasses

import pytest
import torch

from hilt.bench.studies import analog_lm_diagnosis
from hilt.cim_sim import preset
from hilt.errors import HiltError
from hilt.models.llama import Llama, LlamaConfig
from hilt.tasks.drift_lm import LanguageModel


@pytest.fixture(scope="module")
def tiny_lm():
    torch.manual_seed(0)
    net = Llama(LlamaConfig(vocab_size=61, dim=48, n_layers=3, n_heads=6, n_kv_heads=2, ffn_dim=80,
                            max_seq_len=64)).eval()
    return LanguageModel("causal", net, "tiny", lambda text: [ord(c) % 61 for c in text], logits=lambda m, ids: m(ids))


def test_input_stats_on_a_row_with_one_outlier():
    # 7-bit DAC over [-1, 1]: step 2/126, so |x| / abs-max below 1/126 reads as zero
    x = torch.tensor([[100.0, 0.5, -0.5, 0.7, 0.9]])  # 0.5 and 0.7 of 100 lie below 1/126, 0.9 above
    stats = analog_lm_diagnosis.input_stats(x)
    assert stats["zero_share"] == pytest.approx(3 / 5)
    assert stats["crest_median"] == pytest.approx(100 / x.square().mean().sqrt().item())


def test_layer_error_is_zero_on_the_ideal_chip_and_grows_with_each_non_ideality():
    torch.manual_seed(1)
    linear = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(16, 64)
    assert analog_lm_diagnosis.layer_error(linear, x, preset("ideal"), 1.0)[0] == 0.0
    ideal = preset("ideal")
    dac = analog_lm_diagnosis.layer_error(linear, x, dataclasses.replace(ideal, dac_bits=4), 1.0)[0]
    assert 0 < dac < analog_lm_diagnosis.layer_error(linear, x, dataclasses.replace(ideal, dac_bits=2), 1.0)[0]
    noise = analog_lm_diagnosis.layer_error(linear, x, dataclasses.replace(ideal, out_noise=0.06), 1.0)[0]
    assert noise > 0 and torch.isfinite(torch.tensor(noise))
    clipped = analog_lm_diagnosis.layer_error(linear, x, dataclasses.replace(preset("pcm"), clip_std=1.0), 1.0)
    assert clipped[1] > 0.2  # a 1-sigma clip takes about a third of Gaussian weights


def test_diagnose_covers_every_layer_and_scenario(tiny_lm):
    result = analog_lm_diagnosis.diagnose(lm=tiny_lm, blocks=[0, 2], tokens=24)
    assert [r["layer"] for r in result["layers"]] == [f"blk.{b}.{k}" for b in (0, 2) for k in analog_lm_diagnosis.KINDS]
    for r in result["layers"]:
        assert set(r["error"]) == set(analog_lm_diagnosis.SCENARIOS)
        assert all(torch.isfinite(torch.tensor(v)) and v > 0 for v in r["error"].values())
    assert set(result["by_kind"]) == set(analog_lm_diagnosis.KINDS)
    assert "| attn_q |" in analog_lm_diagnosis.render(result)
    with pytest.raises(HiltError, match="blocks 0 to 2"):
        analog_lm_diagnosis.diagnose(lm=tiny_lm, blocks=[3], tokens=24)


def test_cli_bad_blocks_is_one_line(tmp_path):
    from helpers import run_hilt

    r = run_hilt("bench", "analog-lm-diagnosis", "--blocks", "0,x", "--json", tmp_path / "d.json")
    assert r.returncode == 1 and "--blocks 0,x" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "d.json").exists()
    r = run_hilt("bench", "analog-lm-diagnosis", "--time", "soon", "--json", tmp_path / "d.json")
    assert r.returncode == 1 and "cannot read time 'soon'" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "d.json").exists()
