"""`hilt drift`, `hilt train`, `hilt energy` and `hilt export` as a user runs them (small, fast settings)."""

import json
import re

import pytest

from helpers import read_json, run_hilt


@pytest.fixture(scope="module")
def mlp_checkpoint(tmp_path_factory):
    pytest.importorskip("hilt.data.fashion_mnist")
    from hilt.tasks.train import save_workload, train

    path = tmp_path_factory.mktemp("cim") / "mlp.safetensors"
    model, _ = train("mlp", epochs=1, limit=4000)
    save_workload(model, path, "mlp")
    return path


def test_drift_table_json_and_plot(mlp_checkpoint, tmp_path):
    js, png = tmp_path / "drift.json", tmp_path / "drift.png"
    r = run_hilt("drift", "--workload", "mlp", "--checkpoint", mlp_checkpoint, "--times", "1s,1d,1y",
                 "--repeats", "2", "--test-images", "500", "--json", js, "--plot", png)
    assert r.returncode == 0, r.stderr
    assert "1y" in r.stdout and "digital accuracy" in r.stdout
    # no terminal: a line per time after programming, both chips evaluated at once
    assert re.findall(r"^\[(\d)/3\] (\w+) \.\.\. \d+\.\ds  2 chips, mean accuracy: none 0\.\d+, global 0\.\d+$",
                      r.stdout, re.M) == [("1", "1s"), ("2", "1d"), ("3", "1y")], r.stdout
    result = read_json(js)
    assert {row["gdc"] for row in result["rows"]} == {"none", "global"}
    assert all(0 <= row["worst"] <= row["mean"] <= 1 and len(row["all"]) == 2 for row in result["rows"])
    assert png.stat().st_size > 10_000


def assert_bad_flag(result, command, flag, needle):
    """One line naming the command and the flag, exit 2."""
    assert result.returncode == 2, result.stderr
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"hilt {command}: error: {flag}: ") and needle in err, err


@pytest.mark.parametrize("command,args,flag,needle", [
    ("drift", ["--preset", "pcmx"], "--preset", "expected one of ideal, pcm, pcm-scaled, pcm-hwa, rram, afm, got 'pcmx'"),
    ("drift", ["--gdc", "half"], "--gdc", "expected one of global, column, exact, aihwkit, none, got 'half'"),
    ("drift", ["--workload", "vit"], "--workload", "expected one of mlp, cnn or PKG.MODULE:FACTORY, got 'vit'"),
    ("drift", ["--model", "vit"], "--model", "expected one of mlp, cnn or PKG.MODULE:FACTORY, got 'vit'"),
    ("drift", ["--repeats", "0"], "--repeats", "expected a positive integer, got '0'"),
    ("energy", ["--workload", "mlp", "--chip", "pcm-3nm"], "--chip", "expected one of rram-22nm, sram-22nm, sram-5nm"),
    ("energy", ["--workload", "mlp", "--preset", "rram-22nm"], "--preset", "renamed to --chip"),
    ("energy", ["--workload", "mlp", "--sweep", "--adc-bits", "4"], "--sweep", "picks the ADC resolution itself"),
    ("train", ["--workload", "mlp", "--method", "magic"], "--method", "expected one of standard, noise, dwp"),
    ("train", ["--workload", "mlp", "--noise-model", "flash"], "--noise-model", "expected one of mismatch, pcm, rram"),
    ("train", ["--workload", "mlp", "--epochs", "two"], "--epochs", "expected a positive integer, got 'two'"),
])
def test_bad_flags(tmp_path, command, args, flag, needle):
    assert_bad_flag(run_hilt(command, *args, "--json", tmp_path / "r.json"), command, flag, needle)
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("args,needle", [
    (["--times", "1s,-1h"], "cannot read time '-1h'"),
    (["--times", "soon"], "cannot read time 'soon'"),
    (["--times", "1y,1s,1s"], "--times 1y,1s,1s: a time is listed twice"),
    (["--workload", "cnn"], "holds workload 'mlp', not 'cnn'"),
    (["--plot", "no-such-folder/d.png"], "--plot no-such-folder/d.png: folder no-such-folder does not exist"),
])
def test_drift_bad_input(mlp_checkpoint, args, needle):
    base = {"--workload": "mlp", "--checkpoint": str(mlp_checkpoint), "--repeats": "1", "--test-images": "100"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    r = run_hilt("drift", *[x for kv in base.items() for x in kv])
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, r.stderr


@pytest.mark.parametrize("args,needle", [
    (["--method", "dwp", "--eta-range", "0.5,0.1"], "0 <= MIN <= MAX"),
    (["--method", "dwp", "--eta-range", "half"], "MIN,MAX"),
    (["--method", "dwp", "--copies", "1"], "at least 2"),
])
def test_train_refuses_bad_noise_settings(tmp_path, args, needle):
    r = run_hilt("train", "--workload", "mlp", *args, "--out", tmp_path / "m.safetensors")
    assert r.returncode != 0 and needle in r.stderr, r.stderr
    assert not (tmp_path / "m.safetensors").exists()


def test_dwp_train_run_records_its_settings(tmp_path):
    pytest.importorskip("hilt.data.fashion_mnist")
    from hilt.tasks.train import load_workload, train_run
    from hilt.cim_sim.training import NoisyTraining

    out = tmp_path / "dwp.safetensors"
    r = train_run("mlp", training=NoisyTraining(method="dwp", copies=2), epochs=1, limit=600, out=out)
    assert r["method"] == "dwp" and r["training"]["copies"] == 2 and 0.2 < r["test_accuracy"] <= 1
    _, meta = load_workload(out)
    assert meta["method"] == "dwp" and '"copies": 2' in meta["training"]


def test_energy_table_json_and_plot(mlp_checkpoint, tmp_path):
    js, png = tmp_path / "energy.json", tmp_path / "energy.png"
    r = run_hilt("energy", "--workload", "mlp", "--checkpoint", mlp_checkpoint, "--adc-bits", "6", "--json", js,
                 "--plot", png)
    assert r.returncode == 0, r.stderr
    assert "fc1" in r.stdout and "total" in r.stdout and "CIM/GPU" in r.stdout
    result = read_json(js)
    assert result["adc_bits"] == 6 and [layer["layer"] for layer in result["layers"]] == ["fc1", "fc2", "fc3"]
    assert result["cim_joules"] == pytest.approx(sum(layer["cim"]["total"] for layer in result["layers"]))
    assert png.stat().st_size > 10_000
    r = run_hilt("energy", "--workload", "mlp", "--checkpoint", mlp_checkpoint, "--adc-bits", "6", "--chip",
                 "sram-5nm", "--json", "-")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["chip"]["name"] == "sram-5nm" and "fc1" in r.stderr


def test_export_cim_snapshot_runs_in_onnxruntime(mlp_checkpoint, tmp_path):
    out, js = tmp_path / "mlp-1d.onnx", tmp_path / "export.json"
    r = run_hilt("export", "onnx", mlp_checkpoint, out, "--time", "1d", "--json", js)
    assert r.returncode == 0, r.stderr
    result = read_json(js)
    assert out.stat().st_size == result["onnx_bytes"] > 100_000
    assert abs(result["accuracy_difference"]) <= 0.001 and result["accuracy_onnx"] > 0.5
    again = run_hilt("export", "onnx", mlp_checkpoint, out)  # never overwritten silently
    assert again.returncode == 1 and "already exists" in again.stderr


@pytest.mark.parametrize("src,out,needle", [
    ("nowhere", "m.onnx", "nowhere: no such file or folder"),
    ("CKPT", "m.txt", "must end in .onnx"),
])
def test_export_bad_input(mlp_checkpoint, tmp_path, src, out, needle):
    r = run_hilt("export", "onnx", mlp_checkpoint if src == "CKPT" else tmp_path / src, tmp_path / out)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, r.stderr
    assert not (tmp_path / out).exists()
