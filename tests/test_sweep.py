"""`hilt sweep`: a 3 x 3 x 2 grid on the MLP (200 images, 2 chips) run through the command line, then
on Ray, interrupted and resumed, reordered and cut down: the same rows every time; bad grids refused."""

import csv
import json
import math
from pathlib import Path

import pytest

from helpers import run_hilt

pytest.importorskip("hilt.data.fashion_mnist")

GRID = """
chips = 2
images = 200

[axes]
model = "mlp"
preset = ["pcm", "rram"]
adc_bits = [6, 8, 9]
time = ["1s", "1d", "1y"]
"""
# the same grid with its keys in another order: the same cells in the same grid order
GRID_SHUFFLED = """
images = 200
chips = 2

[axes]
time = ["1s", "1d", "1y"]
adc_bits = [6, 8, 9]
preset = ["pcm", "rram"]
model = "mlp"
"""


def write_grid(folder: Path, text: str, name: str = "grid.toml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def files(out: Path) -> dict:
    return {name: (out / name).read_bytes() for name in ("results.jsonl", "results.csv")}


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def cell_key(row: dict) -> tuple:
    return row["model"], row["preset"], row["adc_bits"], row["chips"], row["gdc"], row["time"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The grid run once through the command line (in this process: its compiled kernels are reused
    by the tests below), with plots and a JSON summary."""
    import contextlib
    import io

    from hilt.cli import main

    folder = tmp_path_factory.mktemp("sweep")
    grid = write_grid(folder, GRID)
    out, summary = folder / "out", folder / "summary.json"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(["sweep", str(grid), "--out", str(out), "--json", str(summary)]) == 0
    return {"grid": grid, "out": out, "files": files(out), "stdout": stdout.getvalue(),
            "summary": json.loads(summary.read_text())}


def test_rows_files_progress_and_plots(reference):
    out, rows = reference["out"], rows_of(reference["out"])
    assert len(rows) == 18
    # grid order: presets, then ADC bits, time innermost
    assert [cell_key(r)[1:3] + (r["time"],) for r in rows[:4]] == [
        ("pcm", 6, "1s"), ("pcm", 6, "1d"), ("pcm", 6, "1y"), ("pcm", 8, "1s")]
    assert list(rows[0]) == ["model", "preset", "adc_bits", "chips", "gdc", "time", "seconds", "mean", "std", "worst",
                             "accuracies", "seed", "digital"]
    for r in rows:
        acc = r["accuracies"]
        assert len(acc) == 2 and all(0.5 < a <= 1 for a in acc), r
        assert r["mean"] == pytest.approx(sum(acc) / 2, abs=1e-6) and r["worst"] == min(acc)
        assert r["std"] == pytest.approx(abs(acc[0] - acc[1]) / math.sqrt(2), abs=1e-6)
        assert r["gdc"] == "global" and r["chips"] == 2
    assert rows[2]["seconds"] == 31557600.0
    # one seed per (model, configuration): shared over time, different between configurations
    assert len({r["seed"] for r in rows}) == 6 and len({r["seed"] for r in rows[:3]}) == 1
    assert len({r["digital"] for r in rows}) == 1 and 0.8 < rows[0]["digital"] < 0.95
    # the same chips read at other times differ (drift and read noise are not a no-op)
    assert len({tuple(r["accuracies"]) for r in rows}) > 6
    with open(out / "results.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 18 and table[4]["time"] == rows[4]["time"] and float(table[4]["mean"]) == rows[4]["mean"]
    assert [float(a) for a in table[7]["accuracies"].split()] == rows[7]["accuracies"]
    # a progress line per cell, without a terminal
    lines = [line for line in reference["stdout"].splitlines() if line.startswith("[")]
    assert len(lines) == 18 and lines[0].startswith("[1/18] preset=pcm adc_bits=6 1s ... ") and "mean 0." in lines[0]
    for axis in ("preset", "adc_bits"):
        assert (out / f"accuracy_by_{axis}.png").stat().st_size > 10_000
    assert reference["summary"]["cells"] == 18 and reference["summary"]["rows"] == rows
    assert json.loads((out / "timing.json").read_text())["cells_computed"] == 18


def test_a_cell_is_its_chips_programmed_and_read_alone(reference):
    """One cell recomputed one chip at a time through the plain API, with the documented seeds."""
    from hilt.tasks import grid
    from hilt.tasks.cim_inputs import load_data, load_model
    from hilt.cim_sim import convert_to_analog, drift_to, evaluate, preset, program

    row = rows_of(reference["out"])[13]  # rram, 8 bits, 1 day
    assert (row["preset"], row["adc_bits"], row["time"]) == ("rram", 8, "1d")
    model, _ = load_model("mlp")
    data = load_data(None, limit=200)
    import dataclasses

    analog = convert_to_analog(model, dataclasses.replace(preset("rram"), adc_bits=8))
    for k in range(2):
        program(analog, seed=grid.derive(row["seed"], "program", k))
        drift_to(analog, 86400, seed=grid.derive(row["seed"], "read", 86400.0, k), gdc="global")
        assert round(float(evaluate(analog, data)[0]), 6) == row["accuracies"][k]


def test_ray_run_is_byte_identical(reference, tmp_path):
    ray = pytest.importorskip("ray")
    from hilt.tasks.sweep import run_sweep

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        run_sweep(reference["grid"], tmp_path / "ray", use_ray=True, workers=2, plots=False)
    finally:
        ray.shutdown()
    assert files(tmp_path / "ray") == reference["files"]
    assert json.loads((tmp_path / "ray" / "timing.json").read_text())["cpus_per_task"] == 1


def test_interrupted_then_resumed_is_byte_identical(reference, tmp_path):
    from hilt.tasks.sweep import run_sweep
    from hilt.errors import HiltError

    out = tmp_path / "out"
    seen = []

    def stop_after_seven(row):  # Ctrl-C in the middle of the third group
        seen.append(row)
        if len(seen) == 7:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep(reference["grid"], out, plots=False, on_row=stop_after_seven)
    assert len((out / "results.jsonl").read_text().splitlines()) == 7
    assert len((out / "results.csv").read_text().splitlines()) == 8
    with open(out / "results.jsonl", "ab") as f:  # killed while writing the eighth row
        f.write(b'{"model": "mlp", "preset": "pc')
    with pytest.raises(HiltError, match="exists: continue that sweep with --resume"):
        run_sweep(reference["grid"], out, plots=False)
    done = []
    run_sweep(reference["grid"], out, resume=True, plots=False, on_row=done.append)
    assert len(done) == 11
    assert files(out) == reference["files"]
    # resuming a finished sweep computes nothing and changes nothing
    run_sweep(reference["grid"], out, resume=True, plots=False, on_row=done.append)
    assert len(done) == 11 and files(out) == reference["files"]


def test_resume_refuses_another_grid(reference, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name, data in reference["files"].items():
        (out / name).write_bytes(data)
    (out / "grid.json").write_bytes((reference["out"] / "grid.json").read_bytes())
    other = write_grid(tmp_path, GRID.replace("images = 200", "images = 300"))
    r = run_hilt("sweep", other, "--out", out, "--resume")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "belong to another grid (images: 300 in the grid, 200 in the finished cells)" in r.stderr
    assert files(out) == reference["files"]


def test_rows_do_not_depend_on_order_or_on_the_other_cells(reference, tmp_path):
    from hilt.tasks.sweep import run_sweep

    quiet = {"plots": False}
    # the keys in another order: the same grid (resuming the reference's rows computes nothing)
    shuffled = tmp_path / "shuffled"
    shuffled.mkdir()
    for name in ("results.jsonl", "results.csv", "grid.json"):
        (shuffled / name).write_bytes((reference["out"] / name).read_bytes())
    assert run_sweep(write_grid(tmp_path, GRID_SHUFFLED), shuffled, resume=True, **quiet)["computed"] == 0
    assert files(shuffled) == reference["files"]
    # values reversed, one time and one resolution left out, gdc none added
    subset = GRID.replace('["pcm", "rram"]', '["rram", "pcm"]').replace("[6, 8, 9]", "[9, 6]") \
        .replace('["1s", "1d", "1y"]', '["1y", "1s"]\ngdc = ["none", "global"]')
    run_sweep(write_grid(tmp_path, subset, "subset.toml"), tmp_path / "subset", **quiet)
    rows = rows_of(tmp_path / "subset")
    assert len(rows) == 16 and [cell_key(r)[1:] for r in rows[:3]] == [
        ("rram", 9, 2, "none", "1y"), ("rram", 9, 2, "none", "1s"), ("rram", 9, 2, "global", "1y")]
    expected = {cell_key(r): r for r in rows_of(reference["out"])}
    compensated = [r for r in rows if r["gdc"] == "global"]
    assert len(compensated) == 8 and all(r == expected[cell_key(r)] for r in compensated)
    # gdc none: the same chips, the same reads, no compensation
    assert all(r["seed"] == expected[cell_key(r)[:4] + ("global", r["time"])]["seed"] for r in rows)


@pytest.mark.parametrize("text,needle", [
    ('[axes]\nmodel = "mlp"\ntime = ["1s", "soon"]', "axes.time: cannot read time 'soon'"),
    ('[axes]\nmodel = "mlp"\ntime = ["1s"]\nadc_bit = [6]', "axes.adc_bit: unknown axis"),
    ('[axes]\nmodel = "mlp"\ntime = ["1s"]\npreset = ["pcmx"]', "axes.preset: unknown preset 'pcmx'"),
    ('[axes]\nmodel = "mlp"\ntime = []', "axes.time is empty"),
    ('[axes]\nmodel = "mlp"', "axes.time is missing"),
    ('[axes]\nmodel = "mlp"\ntime = ["1s"]\nadc_bits = [1]', "axes.adc_bits: expected integers >= 2 and <= 24 or 'off', got 1"),
    ('[axes]\nmodel = "mlp"\ntime = ["1s"]\nout_noise = ["high"]', "axes.out_noise: expected numbers >= 0"),
    ('[axes]\nmodel = "mlp"\ntime = ["1s"]\ngdc = ["half"]', "axes.gdc: unknown drift compensation 'half'"),
    ('[axes]\nmodel = "mlp"\ntime = ["1d", "86400"]', "axes.time: '1d' and '86400' are the same time"),
    ('[axes]\nmodel = "mlp"\ntime = ["1s"]\nchips = [2, 2]', "axes.chips: a value is given twice"),
    ('[axes]\nmodel = "mlp"\ntime = ["1s"]\ndevice = ["flash"]', "axes.device: unknown device 'flash'"),
    ('chip = 3\n[axes]\nmodel = "mlp"\ntime = ["1s"]', "unknown key 'chip'"),
    ('images = 0\n[axes]\nmodel = "mlp"\ntime = ["1s"]', "images: expected an integer >= 1, got 0"),
    ('[axes]\nmodel = "mlp"\ntime = ["1s"]\n[models.mlp]\nweights = "x"', "models.mlp.weights: unknown key"),
    ('[axes]\nmodel = ["vit"]\ntime = ["1s"]', "axes.model:"),
    ('[axes]\nmodel = ["mine"]\ntime = ["1s"]\n[models.mine]\nspec = "mlp"\ncheckpoint = "none.safetensors"',
     "models.mine:"),
    ('[axes\nmodel = "mlp"', "not a valid TOML file"),
])
def test_bad_grids_are_one_line_and_leave_nothing(tmp_path, capsys, text, needle):
    from hilt.cli import main

    grid = write_grid(tmp_path, text)
    assert main(["sweep", str(grid), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"hilt: error: {grid}: ") and needle in err, err
    assert not (tmp_path / "out").exists()


def test_flags_and_existing_results(reference, tmp_path, capsys, monkeypatch):
    import sys

    from hilt.cli import main

    out = reference["out"]
    assert main(["sweep", str(reference["grid"]), "--out", str(out)]) == 1
    assert "results.jsonl exists: continue that sweep with --resume, or replace it with --overwrite" in \
        capsys.readouterr().err
    assert main(["sweep", str(reference["grid"]), "--out", str(out), "--resume", "--overwrite"]) == 2
    assert "give one" in capsys.readouterr().err
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["sweep", str(reference["grid"]), "--out", str(tmp_path / "o"), "--workers", "2"]) == 2
    assert "--workers" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ray", None)  # Ray not installed
    assert main(["sweep", str(reference["grid"]), "--out", str(tmp_path / "o"), "--ray"]) == 1
    assert capsys.readouterr().err.strip() == "hilt: error: --ray needs Ray: pip install 'hilt[ray]'"
    assert not (tmp_path / "o").exists() and files(out) == reference["files"]


def test_data_file_beside_the_grid(tmp_path, capsys):
    """data: a file read from the grid's folder; data the model does not take fails before DIR exists."""
    import numpy as np

    from hilt.tasks.sweep import run_sweep
    from hilt.tasks.cim_inputs import load_data
    from hilt.cli import main

    x, y = load_data(None, limit=60)
    (tmp_path / "data").mkdir()
    np.savez(tmp_path / "data" / "few.npz", inputs=x.numpy(), labels=y.numpy())
    np.savez(tmp_path / "data" / "flat.npz", inputs=np.zeros((4, 7), np.float32), labels=np.zeros(4, np.int64))
    text = 'data = "data/{}"\nchips = 1\n[axes]\nmodel = "mlp"\ntime = ["1h"]\npreset = "ideal"\n'
    grid = write_grid(tmp_path, text.format("few.npz"))
    rows = run_sweep(grid, tmp_path / "out", plots=False)["rows"]
    # the ideal preset is the digital model
    assert len(rows) == 1 and rows[0]["accuracies"] == [rows[0]["digital"]] and rows[0]["digital"] > 0.7
    np.savez(tmp_path / "data" / "few.npz", inputs=x.numpy(), labels=y.flip(0).numpy())  # other data, same name
    assert main(["sweep", str(grid), "--out", str(tmp_path / "out"), "--resume"]) == 1
    assert "belong to another grid (sha256.data/few.npz:" in capsys.readouterr().err
    bad = write_grid(tmp_path, text.format("flat.npz"), "bad.toml")
    assert main(["sweep", str(bad), "--out", str(tmp_path / "bad")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "axes.model 'mlp' on the data: inputs of shape (7,) do not fit" in err, err
    assert not (tmp_path / "bad").exists()


def test_the_example_grid_reads():
    from hilt import tasks
    from hilt.tasks.cim_inputs import load_model
    from hilt.tasks.grid import cells_of, parse_grid

    grid = parse_grid(Path(tasks.__file__).parent / "grids" / "example.toml")
    cells, groups = cells_of(grid)
    entry = grid.models["cnn-dwp"]
    assert (len(cells), len(groups)) == (80, 8) and entry["spec"] == "cnn"
    model, _ = load_model(entry["spec"], grid.path.parent / entry["checkpoint"])  # paths: from the grid's folder
    assert sum(p.numel() for p in model.parameters()) > 100_000

    lm_grid = parse_grid(Path(tasks.__file__).parent / "grids" / "smollm2.toml")
    assert len(cells_of(lm_grid)[1]) == 4 and lm_grid.is_language_model("smollm2") and lm_grid.language["tokens"] == 128


def test_a_failing_cell_is_named(tmp_path, capsys, monkeypatch):
    """A model that runs on one chip but not on two (it reshapes its logits to its input's batch):
    the error names the cell, and the rows already written stay for --resume."""
    from hilt.cli import main

    (tmp_path / "batchbound.py").write_text(
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        torch.manual_seed(0)\n"
        "        self.fc = torch.nn.Linear(784, 10)\n"
        "    def forward(self, x):\n"
        "        return self.fc(x.flatten(1)).view(x.shape[0], -1)\n"
        "def build():\n"
        "    return Net()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    grid = write_grid(tmp_path, 'images = 60\n[models.net]\nspec = "batchbound:build"\n'
                                '[axes]\nmodel = "net"\nchips = [1, 2]\ntime = ["1h"]\n')
    assert main(["sweep", str(grid), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{grid}: cell chips=2 1h: the model returned shape" in err, err
    assert [r["chips"] for r in rows_of(tmp_path / "out")] == [1]


def test_language_models_in_a_grid_name_their_metric(tiny_gguf, tmp_path):
    """A tiny Llama file beside the grid and the MLP in one sweep: perplexity rows (worst = highest) beside
    accuracy rows, each row naming its metric; a chip's perplexity is the one `hilt drift` reads with the
    same seeds."""
    import shutil

    import torch

    from hilt.cim_sim import convert_to_analog, drift_to, program
    from hilt.tasks.drift_lm import chip_metric, eval_data, load_language_model
    from hilt.tasks.grid import parse_grid, program_seeds, read_seeds

    shutil.copy(tiny_gguf, tmp_path / "tiny.gguf")
    grid = write_grid(tmp_path, """
chips = 2
images = 100
tokens = 32

[axes]
model = ["tiny", "mlp"]
time = ["1s", "1y"]

[models.tiny]
spec = "tiny.gguf"
""")
    from hilt.tasks.sweep import run_sweep

    run_sweep(grid, tmp_path / "out")  # in this process: the kernels the other tests compiled are reused
    rows = rows_of(tmp_path / "out")
    assert [(row["model"], row["metric"]) for row in rows] == [("tiny", "perplexity")] * 2 + [("mlp", "accuracy")] * 2
    for row in rows:
        assert len(row["values"]) == 2 and "accuracies" not in row
        assert row["worst"] == (max if row["metric"] == "perplexity" else min)(row["values"])
    assert rows[0]["digital"] > 1 and (tmp_path / "out" / "accuracy_by_model.png").is_file()

    # chip 1 of the 1y cell, by hand with the cell's seeds
    lm = load_language_model(str(tmp_path / "tiny.gguf"))
    data, _ = eval_data(lm, None, 32, 128)
    seed = rows[1]["seed"]
    analog = convert_to_analog(lm.model, parse_grid(grid).config({"preset": "pcm"}))
    program(analog, seeds=program_seeds(seed, 2))
    drift_to(analog, rows[1]["seconds"], seeds=read_seeds(seed, rows[1]["seconds"], 2))
    by_hand = [round(p, 6) for p in chip_metric(lm, analog, data)]  # as the rows round them
    assert by_hand == rows[1]["values"]  # the same chips, to the last digit the rows keep
    assert torch.isfinite(torch.tensor(rows[1]["values"])).all()


def test_a_language_model_takes_no_checkpoint_and_needs_a_text(tiny_gguf, tmp_path):
    import shutil

    shutil.copy(tiny_gguf, tmp_path / "tiny.gguf")
    (tmp_path / "empty.txt").write_text("")
    base = '[axes]\nmodel = "tiny"\ntime = "1s"\n[models.tiny]\nspec = "tiny.gguf"\n'
    for text, needle in ((base + 'checkpoint = "w.safetensors"\n', "takes no checkpoint"),
                         ('text = "empty.txt"\n' + base, "empty")):
        r = run_hilt("sweep", write_grid(tmp_path, text), "--out", tmp_path / "out")
        err = r.stderr.strip()
        assert r.returncode == 1 and len(err.splitlines()) == 1 and needle in err and "grid.toml" in err, err
        assert not (tmp_path / "out").exists()
