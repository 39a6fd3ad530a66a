"""`hilt drift` and `hilt train` as a user runs them (small, fast settings)."""

import pytest

from conftest import read_json, run_hilt


@pytest.fixture(scope="module")
def mlp_checkpoint(tmp_path_factory):
    pytest.importorskip("bench.fashion")
    from bench.workloads import save_checkpoint, train

    path = tmp_path_factory.mktemp("cim") / "mlp.safetensors"
    model, _ = train("mlp", epochs=1, limit=4000)
    save_checkpoint(model, path, "mlp")
    return path


def test_drift_table_json_and_plot(mlp_checkpoint, tmp_path):
    js, png = tmp_path / "drift.json", tmp_path / "drift.png"
    r = run_hilt("drift", "--workload", "mlp", "--checkpoint", mlp_checkpoint, "--times", "1s,1d,1y",
                 "--repeats", "2", "--test-images", "500", "--json", js, "--plot", png)
    assert r.returncode == 0, r.stderr
    assert "1y" in r.stdout and "digital accuracy" in r.stdout
    result = read_json(js)
    assert {row["gdc"] for row in result["rows"]} == {"none", "global"}
    assert all(0 <= row["worst"] <= row["mean"] <= 1 and len(row["all"]) == 2 for row in result["rows"])
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize("args,needle", [
    (["--preset", "pcmx"], "unknown preset 'pcmx'"),
    (["--times", "1s,-1h"], "cannot read time '-1h'"),
    (["--times", "soon"], "cannot read time 'soon'"),
    (["--workload", "cnn"], "holds workload 'mlp', not 'cnn'"),
])
def test_drift_bad_input(mlp_checkpoint, args, needle):
    base = {"--workload": "mlp", "--checkpoint": str(mlp_checkpoint), "--repeats": "1", "--test-images": "100"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    r = run_hilt("drift", *[x for kv in base.items() for x in kv])
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, r.stderr


def test_train_refuses_unknown_method(tmp_path):
    r = run_hilt("train", "--workload", "mlp", "--method", "magic", "--out", tmp_path / "m.safetensors")
    assert r.returncode == 1 and "magic" in r.stderr and not (tmp_path / "m.safetensors").exists()
