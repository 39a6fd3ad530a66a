"""`hilt bench sweep --quick`: the drift sweep timed four ways, end to end. aihwkit is an optional
peer: without it (as in CI) its rows are left out and hilt's must still be there."""

import math

import pytest

from helpers import read_json, run_hilt


def check_hilt_rows(result: dict) -> None:
    assert result["preset"] == "pcm" and result["chips"] == 2 and result["times"] == ["1s", "1y"]
    assert result["test_images"] == 500
    (entry,) = result["workloads"]
    assert entry["workload"] == "mlp" and 0.8 < entry["digital_accuracy"] <= 1
    timing = entry["timing"]
    assert all(timing[f"{way}_s"] > 0 for way in ("digital", "hilt_serial", "hilt_batched"))
    assert timing["ratios"]["batched_over_digital"] > 0 and timing["ratios"]["serial_over_batched"] > 0
    assert {t["ratio"] for t in entry["targets"]} == {"batched_over_digital", "serial_over_batched",
                                                      "aihwkit_over_batched"}
    for row in entry["rows"]:
        for key in ("hilt_batched", "hilt_serial", "hilt_none"):
            cell = row[key]
            assert len(cell["all"]) == 2 and all(0.5 < a <= 1 for a in cell["all"])
            assert (cell["min"], cell["max"]) == (min(cell["all"]), max(cell["all"]))  # the summary is of these chips
            assert cell["mean"] == pytest.approx(sum(cell["all"]) / 2)
        # chip k of the batched sweep is the chip programmed alone with the same seed
        assert abs(row["hilt_batched"]["mean"] - row["hilt_serial"]["mean"]) < 0.03
        assert "hilt_batched_vs_serial" in row["agreement"]


def test_bench_sweep_quick(tmp_path):
    js, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    r = run_hilt("bench", "sweep", "--quick", "--json", js, "--plot", png, timeout=240)
    assert r.returncode == 0, r.stderr
    result = read_json(js)
    check_hilt_rows(result)
    assert png.stat().st_size > 10_000
    (entry,) = result["workloads"]
    rows = entry["rows"]
    if result["aihwkit"] is None:  # the peer is not installed: its rows are left out, cleanly
        assert "aihwkit is not importable" in r.stdout + r.stderr
        assert "aihwkit_s" not in entry["timing"] and all("aihwkit" not in row for row in rows)
        assert [t["met"] for t in entry["targets"] if t["ratio"] == "aihwkit_over_batched"] == [None]
    else:
        assert entry["timing"]["aihwkit_s"] > 0
        for row in rows:
            assert len(row["aihwkit"]["all"]) == 2 and len(row["aihwkit_none"]["all"]) == 2
            assert {"hilt_none_vs_aihwkit_none", "hilt_global_vs_aihwkit"} <= set(row["agreement"])
    if result["gdc_aihwkit"]:
        assert all(len(row["hilt_aihwkit"]["all"]) == 2 for row in rows)


def test_agreement():
    from hilt.bench.studies.cim_peers import agreement

    a = agreement([0.80, 0.82], [0.80, 0.81, 0.82])
    assert a["diff"] == pytest.approx(0.0) and a["within_2std"] and a["within_sampling_error"]
    far = agreement([0.70, 0.71], [0.80, 0.82])
    assert far["diff"] == pytest.approx(-0.105) and not far["within_2std"] and not far["within_sampling_error"]
    assert far["std_reference"] == pytest.approx(math.sqrt(2) * 0.01)
    same = agreement([0.8], [0.8])  # one chip each: no spread, equal means agree
    assert same["z"] == 0.0 and same["within_sampling_error"]
