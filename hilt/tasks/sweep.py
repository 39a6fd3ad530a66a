"""`hilt sweep GRID.toml --out DIR`: accuracy on simulated CIM chips over a grid of models x presets x
AnalogConfig fields x chips x drift compensation x times after programming, locally or on a Ray cluster.

The grid file (TOML; hilt/tasks/grids/example.toml is a small one)::

    seed = 0                # the grid's seed: every cell's chips derive from it and the cell (default 0)
    chips = 4               # chips programmed per cell (default 5); or an axis: [axes] chips = [2, 8]
    data = "fashion-mnist"  # the evaluation data: the Fashion-MNIST test split (default), or a
                            #   .safetensors / .npz file holding `inputs` and `labels`
    images = 2000           # evaluate on the first N samples of the data (default: all)
    batch_size = 500        # inputs per forward (default: hilt.cim_sim.evaluate's, 1000 / chips)

    [axes]                  # every combination of the values is a cell
    model = ["mlp", "cnn-dwp"]        # required: built-in workloads (mlp, cnn) or names from [models]
    time = ["1s", "1h", "1d", "1y"]   # required: times after programming (hilt.cim_sim.parse_time)
    preset = ["pcm", "rram"]          # CIM presets (default ["pcm"])
    gdc = ["none", "global"]          # drift compensation (default ["global"])
    adc_bits = [6, 8, "off"]          # any hilt.cim_sim.AnalogConfig field, replaced on each preset
    out_noise = [0.02, 0.06]          #   ("off": None, a converter that is not there)

    [models.cnn-dwp]        # a named model
    spec = "cnn"            # a built-in workload, or "PKG.MODULE:FACTORY" for your own nn.Module
    checkpoint = "../results/cnn-dwp.safetensors"

Relative paths (checkpoints, data) are read from the grid file's folder. An axis may be one value
instead of a list; the order of the keys in the file does not matter.

Output, in DIR: one tidy row per cell in ``results.jsonl`` (JSON Lines) and ``results.csv``: the
cell's axis values (model, preset, the AnalogConfig axes, chips, gdc, time as written, seconds),
then ``mean``, ``std`` (over chips, n - 1), ``worst``, ``accuracies`` (one per chip), ``seed`` and
``digital`` (the model's digital accuracy on the same data); accuracies rounded to 6 decimals.
Rows are appended (one write, flushed to disk) as cells finish and rewritten in grid order at the
end, so the final files are the same bytes whether the sweep ran here, on Ray, or was interrupted
and resumed. ``grid.json`` records the grid the rows belong to (``--resume`` refuses another);
``timing.json`` the wall times (kept out of the rows); ``accuracy_by_AXIS.png`` one plot per
axis with more than one value (accuracy against time, one line per value, bands over chips).

Grid order: models, then presets, then the AnalogConfig axes (in the dataclass's field order),
chips, gdc, and time innermost; each axis's values in the order written.

Seeds. The work is done per group: the cells that share model, configuration (the preset with the
axes' fields replaced) and chips, which differ only in gdc and time. A group programs its chips
once and drifts them to each time. Everything a row holds is a function of its cell alone:

- the cell's ``seed`` = hash(grid seed, model name, the resolved AnalogConfig), shared by the
  cells of a group (a preset written out field by field is the same configuration);
- chip k programs with hash(seed, "program", k), whatever the number of chips;
- chip k read at t seconds: hash(seed, "read", t, k), the same for every gdc mode, so that the
  modes compare the same reads; a read also seeds the forward noise after it (``drift_to``), so
  a row does not depend on which cells were computed before it on the same chips (resumed,
  reordered or subset grids give the same rows).

hash: the first 8 bytes of SHA-256 of the canonical JSON of its arguments, as a 63-bit integer.

Ray (``--ray``, or RAY_ADDRESS set): one task per group, streaming its cells back; each task
reserves ``num_cpus`` = cluster CPUs / ``--workers`` (default: one CPU per task) and sets torch's
threads to match. The driver loads each model and the data once and puts them in Ray's object
store, so workers need hilt installed but not the files.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import hashlib
import io
import itertools
import json
import logging
import math
import os
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hilt.cim_sim import (
    AnalogConfig,
    convert_to_analog,
    drift_to,
    evaluate,
    parse_time,
    preset,
    program,
)
from hilt.cim_sim.model import GDC_MODES
from hilt.atomic import Appender, write_text
from hilt.errors import HiltError
from hilt.progress import Progress

FORMAT = "hilt-sweep/1"  # part of every seed: a change in how seeds derive must change this
TOP_KEYS = ("seed", "chips", "data", "images", "batch_size", "axes", "models")
CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(AnalogConfig))
AXES = ("model", "preset", *CONFIG_FIELDS, "chips", "gdc", "time")  # grid order, time innermost
GROUP_AXES = AXES[: AXES.index("gdc")]  # what a group's cells share
DEFAULTS = {"preset": ["pcm"], "gdc": ["global"]}
DEFAULT_CHIPS = 5
RESULTS_JSONL, RESULTS_CSV, GRID_JSON, TIMING_JSON = "results.jsonl", "results.csv", "grid.json", "timing.json"
# lower bounds of AnalogConfig fields (exclusive when the bound is a float marked by _ABOVE)
_AT_LEAST = {"tile_size": 1, "dac_bits": 2, "adc_bits": 2}
_ABOVE = ("inp_bound", "out_bound")
_OFF = "off"


# ------------------------------------------------------------------ the grid


@dataclass(frozen=True)
class Grid:
    path: Path
    seed: int
    data: str | None
    images: int | None
    batch_size: int | None
    axes: dict  # axis -> list of values as written (times as strings), in grid order (AXES)
    models: dict  # model name -> {"spec": str, "checkpoint": str | None}
    declared: tuple = ()  # the model names that have a [models.NAME] table

    def normalized(self) -> dict:
        """What the rows depend on, as JSON (DIR/grid.json): resume compares it with the grid file's."""
        models = {m: self.models[m] for m in self.axes["model"]}
        files = [f for f in (self.data, *(e["checkpoint"] for e in models.values())) if f and f != "fashion-mnist"]
        return {"format": FORMAT, "seed": self.seed, "data": self.data, "images": self.images,
                "batch_size": self.batch_size, "axes": self.axes, "models": models,
                # the files' contents too: a retrained checkpoint under the same name is another grid
                "sha256": {f: _sha256(self.path.parent / f) for f in sorted(set(files))}}

    def config(self, values: dict) -> AnalogConfig:
        fields = {k: values[k] for k in CONFIG_FIELDS if k in values}
        return dataclasses.replace(preset(values["preset"]), **fields)


@dataclass
class Cell:
    index: int  # position in grid order
    values: dict  # axis -> value, in grid order
    seconds: float
    group: int
    seed: int

    @property
    def key(self) -> str:
        return _canonical(self.values)

    def label(self, grid: Grid) -> str:
        return " ".join(_show(a, v) for a, v in self.values.items() if len(grid.axes[a]) > 1 or a == "time")


@dataclass
class Group:
    index: int
    model: str
    config: AnalogConfig
    chips: int
    seed: int
    cells: list = field(default_factory=list)


def _sha256(path: Path) -> str | None:
    """The file's SHA-256 (None where it cannot be read: loading it reports that, with its name)."""
    try:
        st = path.stat()
        return _sha256_of(str(path.resolve()), st.st_size, st.st_mtime_ns)
    except OSError:
        return None


@functools.lru_cache(maxsize=16)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def derive(*parts) -> int:
    """A 63-bit seed from JSON-able parts: SHA-256 of their canonical JSON."""
    return int.from_bytes(hashlib.sha256(_canonical(list(parts)).encode()).digest()[:8], "little") >> 1


def program_seeds(seed: int, chips: int) -> list[int]:
    return [derive(seed, "program", k) for k in range(chips)]


def read_seeds(seed: int, seconds: float, chips: int) -> list[int]:
    return [derive(seed, "read", float(seconds), k) for k in range(chips)]


def _show(axis: str, value) -> str:
    if axis == "time":
        return str(value)
    return f"{axis}={_OFF if value is None else value}"


def parse_grid(path) -> Grid:
    """Read and check a grid file; every mistake is a HiltError naming the file and the key."""
    path = Path(path)
    if not path.is_file():
        raise HiltError(f"{path}: no such grid file")
    try:
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise HiltError(f"{path}: not a valid TOML file ({e})") from None
    where = str(path)
    for key in raw:
        if key not in TOP_KEYS:
            raise HiltError(f"{where}: unknown key {key!r}; a grid has {', '.join(TOP_KEYS)}"
                            + (" (axes go under [axes])" if key in AXES else ""))

    def integer(key, lo, default):
        value = raw.get(key, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < lo):
            raise HiltError(f"{where}: {key}: expected an integer >= {lo}, got {value!r}")
        return value

    seed = integer("seed", -(2**63), 0)
    images = integer("images", 1, None)
    batch_size = integer("batch_size", 1, None)
    data = raw.get("data")
    if data is not None and (not isinstance(data, str) or not data):
        raise HiltError(f"{where}: data: expected 'fashion-mnist' or a file name, got {data!r}")

    axes_raw = raw.get("axes")
    if not isinstance(axes_raw, dict):
        raise HiltError(f"{where}: no [axes] table; a grid needs at least [axes] model = [...] and time = [...]")
    for key in axes_raw:
        if key not in AXES:
            raise HiltError(f"{where}: axes.{key}: unknown axis; choose model, preset, chips, gdc, time or a "
                            f"field of hilt.cim_sim.AnalogConfig ({', '.join(CONFIG_FIELDS)})")
    for key in ("model", "time"):
        if key not in axes_raw:
            raise HiltError(f"{where}: axes.{key} is missing: a grid needs at least [axes] model and time")
    if "chips" in axes_raw and "chips" in raw:
        raise HiltError(f"{where}: chips is given both as a setting and as axes.chips; keep one")

    models_raw = raw.get("models", {})
    if not isinstance(models_raw, dict):
        raise HiltError(f"{where}: models: expected tables [models.NAME] with spec and checkpoint")
    models = {}
    for name, entry in models_raw.items():
        if not isinstance(entry, dict):
            raise HiltError(f"{where}: models.{name}: expected a table with spec and checkpoint")
        for k in entry:
            if k not in ("spec", "checkpoint"):
                raise HiltError(f"{where}: models.{name}.{k}: unknown key; a model has spec and checkpoint")
        for k in ("spec", "checkpoint"):
            if k in entry and (not isinstance(entry[k], str) or not entry[k]):
                raise HiltError(f"{where}: models.{name}.{k}: expected a string, got {entry[k]!r}")
        models[name] = {"spec": entry.get("spec", name), "checkpoint": entry.get("checkpoint")}

    axes = {}
    for axis in AXES:
        if axis == "chips":
            values = axes_raw.get("chips", integer("chips", 1, DEFAULT_CHIPS))
        else:
            values = axes_raw.get(axis, DEFAULTS.get(axis))
        if values is None:
            continue
        values = values if isinstance(values, list) else [values]
        if not values:
            raise HiltError(f"{where}: axes.{axis} is empty; give at least one value")
        axes[axis] = _check_axis(where, axis, values, models)
    grid = Grid(path, seed, data, images, batch_size, axes,
                {m: models.get(m, {"spec": m, "checkpoint": None}) for m in axes["model"]}, tuple(models))
    for values in _combinations(grid, GROUP_AXES):  # every configuration must be one the simulator takes
        config = grid.config(values)
        try:
            config.device_model()
        except HiltError as e:
            raise HiltError(f"{where}: axes.device: {e}") from None
    return grid


def _check_axis(where: str, axis: str, values: list, models: dict) -> list:
    def bad(expected, v):
        raise HiltError(f"{where}: axes.{axis}: expected {expected}, got {v!r}")

    out = []
    if axis == "model":
        for v in values:
            if not isinstance(v, str) or not v:
                bad("model names (built-in workloads or names from [models])", v)
        out = list(values)
    elif axis == "preset":
        for v in values:
            if not isinstance(v, str):
                bad("preset names", v)
            try:
                preset(v)
            except HiltError as e:
                raise HiltError(f"{where}: axes.preset: {e}") from None
        out = list(values)
    elif axis == "gdc":
        for v in values:
            if v not in GDC_MODES:
                raise HiltError(f"{where}: axes.gdc: unknown drift compensation {v!r}; choose one of "
                                f"{', '.join(GDC_MODES)}")
        out = list(values)
    elif axis == "chips":
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad("a positive number of chips", v)
        out = list(values)
    elif axis == "time":
        seen = {}
        for v in values:
            if isinstance(v, bool) or not isinstance(v, str | int | float):
                bad("times such as '1s', '1d', '1y' or seconds", v)
            try:
                seconds = parse_time(v)
            except HiltError as e:
                raise HiltError(f"{where}: axes.time: {e}") from None
            if not math.isfinite(seconds):
                bad("a finite time", v)
            if seconds in seen:
                raise HiltError(f"{where}: axes.time: {seen[seconds]!r} and {str(v)!r} are the same time")
            seen[seconds] = str(v)
            out.append(str(v))
        return out
    else:  # an AnalogConfig field: the type of its default decides what it takes
        f = next(f for f in dataclasses.fields(AnalogConfig) if f.name == axis)
        optional = "None" in str(f.type)
        kind = type(f.default)
        for v in values:
            if optional and v == _OFF:
                out.append(None)
                continue
            ok = (isinstance(v, bool) if kind is bool else isinstance(v, str) if kind is str
                  else isinstance(v, int) and not isinstance(v, bool) if kind is int
                  else isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v))
            expected = {bool: "true or false", str: "strings", int: "integers", float: "numbers"}[kind]
            if kind in (int, float):
                lo = _AT_LEAST.get(axis, 0)
                ok = ok and (v > lo if axis in _ABOVE else v >= lo)
                expected += f" {'>' if axis in _ABOVE else '>='} {lo}"
            if not ok:
                bad(expected + (f" or {_OFF!r}" if optional else ""), v)
            out.append(float(v) if kind is float else v)
    if len({_canonical(v) for v in out}) != len(out):
        raise HiltError(f"{where}: axes.{axis}: a value is given twice")
    return out


def _combinations(grid: Grid, axes) -> list[dict]:
    names = [a for a in axes if a in grid.axes]
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*(grid.axes[a] for a in names))]


def cells_of(grid: Grid) -> tuple[list[Cell], list[Group]]:
    """Every cell in grid order, and the groups (model, configuration, chips) they fall in."""
    cells, groups, by_key = [], [], {}
    for values in _combinations(grid, AXES):
        config = grid.config(values)
        seed = derive(FORMAT, grid.seed, values["model"], dataclasses.asdict(config))
        key = (values["model"], _canonical(dataclasses.asdict(config)), values["chips"])
        if key not in by_key:
            by_key[key] = Group(len(groups), values["model"], config, values["chips"], seed)
            groups.append(by_key[key])
        group = by_key[key]
        cell = Cell(len(cells), values, parse_time(values["time"]), group.index, seed)
        cells.append(cell)
        group.cells.append(cell)
    return cells, groups


# ------------------------------------------------------------------ evaluation (runs locally or in a Ray task)


class CellError(HiltError):
    """A cell's evaluation failed: the sweep names the cell (the group's first when the failure is in
    what its cells share)."""

    def __init__(self, cell: int, reason: str):
        super().__init__(cell, reason)  # as args, so that it pickles back from a Ray task
        self.cell, self.reason = cell, reason

    def __str__(self):
        return f"cell {self.cell}: {self.reason}"


def run_group(model, data, task: dict, threads: int | None = None):
    """Evaluate one group: program its chips once, then per cell drift to the cell's time and gdc.

    ``task``: {"config", "chips", "seed", "batch_size", "cells": [(cell index, seconds, gdc), ...]}.
    Yields (cell index, per-chip accuracies, digital accuracy, seconds spent) per cell, in order.
    """
    if threads:
        torch.set_num_threads(threads)
    start = time.perf_counter()
    batch = task["batch_size"]
    index = task["cells"][0][0]
    try:
        digital = float(evaluate(model, data, batch_size=batch)[0])
        analog = convert_to_analog(model, task["config"])
        program(analog, seeds=program_seeds(task["seed"], task["chips"]))
    except HiltError as e:
        raise CellError(index, str(e)) from None
    for index, seconds, gdc in task["cells"]:
        try:
            drift_to(analog, seconds, gdc=gdc, seeds=read_seeds(task["seed"], seconds, task["chips"]))  # also seeds the forward noise
            accuracies = evaluate(analog, data, batch_size=batch).tolist()
        except HiltError as e:
            raise CellError(index, str(e)) from None
        now = time.perf_counter()
        yield index, accuracies, digital, now - start
        start = now


# ------------------------------------------------------------------ rows and files


def _round(x: float) -> float:
    return round(float(x), 6)


def make_row(cell: Cell, accuracies, digital: float) -> dict:
    acc = [_round(a) for a in accuracies]
    mean = sum(acc) / len(acc)
    std = math.sqrt(sum((a - mean) ** 2 for a in acc) / (len(acc) - 1)) if len(acc) > 1 else 0.0
    row = dict(cell.values)
    row["seconds"] = cell.seconds
    row.update(mean=_round(mean), std=_round(std), worst=min(acc), accuracies=acc, seed=cell.seed,
               digital=_round(digital))
    return row


def _jsonl(row: dict) -> str:
    return json.dumps(row, allow_nan=False) + "\n"


def _csv_line(row: dict, header: bool = False) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    if header:
        w.writerow(list(row))
    w.writerow([" ".join(map(repr, v)) if isinstance(v, list) else "" if v is None else v for v in row.values()])
    return buf.getvalue()


def _write_rows(out: Path, rows: list[dict]) -> None:
    """results.jsonl and results.csv, whole (each to a temporary name, then renamed)."""
    write_text(out / RESULTS_JSONL, "".join(_jsonl(r) for r in rows), fsync=True)
    write_text(out / RESULTS_CSV, "".join(_csv_line(r, i == 0) for i, r in enumerate(rows)), fsync=True)


def _first_difference(a, b, prefix="") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in [*a, *(k for k in b if k not in a)]:
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{prefix}{k}.")
    text = f"{prefix[:-1]}: {json.dumps(b)} in the grid, {json.dumps(a)} in the finished cells"
    return text if len(text) < 200 else text[:197] + "..."


def _resume_rows(out: Path, grid: Grid, cells: list[Cell]) -> dict[int, dict]:
    """The rows DIR/results.jsonl already holds, by cell index; refuses rows of another grid.
    A partial last line (a run killed while writing it) is dropped from the file."""
    path, recorded = out / RESULTS_JSONL, out / GRID_JSON
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    complete, tail = lines[:-1], lines[-1]
    # no whole row: say so, rather than speak of finished cells that are not there
    nothing = f"{out}: no finished cells to resume ({path} holds no whole row)" if not any(complete) else None
    if not recorded.is_file():
        if nothing:
            raise HiltError(f"{nothing} and {recorded} is missing; use --overwrite to start there, or another --out")
        raise HiltError(f"{recorded} is missing, so the rows in {path} cannot be matched to the grid; "
                        f"use --overwrite to start again")
    try:
        before = json.loads(recorded.read_text())
    except (OSError, ValueError) as e:
        raise HiltError(f"{recorded}: cannot read it ({e}); use --overwrite to start again") from None
    now = json.loads(_canonical(grid.normalized()))
    if before != now:
        if nothing:
            raise HiltError(f"{nothing}, and it was started with another grid ({_first_difference(before, now)}); "
                            "use --overwrite to start this grid there, or another --out")
        raise HiltError(f"{out}: the finished cells belong to another grid ({_first_difference(before, now)}); "
                        f"resume with the same grid, or use --overwrite or another --out")
    if tail:  # killed mid-write: keep the whole rows only
        write_text(path, b"".join(line + b"\n" for line in complete).decode(), fsync=True)
    by_key = {c.key: c for c in cells}
    done = {}
    for number, line in enumerate(complete, 1):
        try:
            row = json.loads(line)
            values = {a: row[a] for a in grid.axes}
        except (ValueError, KeyError, TypeError):
            raise HiltError(f"{path}: line {number} is not a row of this sweep; use --overwrite to start "
                            f"again") from None
        cell = by_key.get(_canonical(values))
        if cell is None or row.get("seed") != cell.seed:
            what = " ".join(_show(a, v) for a, v in values.items())
            raise HiltError(f"{path}: line {number} ({what}) is not a cell of {grid.path} "
                            f"{'with this seed' if cell else ''}".rstrip() + "; use --overwrite to start again")
        if cell.index in done:
            raise HiltError(f"{path}: line {number} repeats a cell; use --overwrite to start again")
        done[cell.index] = row
    return done


# ------------------------------------------------------------------ models and data


def _load_model(grid: Grid, name: str):
    from hilt.tasks.cim_inputs import load_model

    entry = grid.models[name]
    checkpoint = entry["checkpoint"]
    if checkpoint is not None:
        checkpoint = grid.path.parent / checkpoint
    key = f"models.{name}" if name in grid.declared else "axes.model"
    try:
        model, _ = load_model(entry["spec"], checkpoint)
    except HiltError as e:
        raise HiltError(f"{grid.path}: {key}: {e}") from None
    return model


def _load_data(grid: Grid):
    from hilt.tasks.cim_inputs import load_data

    spec = grid.data
    if spec is not None and spec != "fashion-mnist":
        spec = str(grid.path.parent / spec)
    try:
        return load_data(spec, limit=grid.images)
    except HiltError as e:
        raise HiltError(f"{grid.path}: data: {e}") from None


# ------------------------------------------------------------------ running


def run_sweep(grid_path, out, *, resume: bool = False, overwrite: bool = False, use_ray: bool = False,
              workers: int | None = None, plots: bool = True, progress: bool = False, log=print,
              on_row=None) -> dict:
    """Run (or continue) a sweep; returns a summary with every row in grid order.

    Nothing is written before the grid, its models and its data have been read. ``on_row(row)``
    is called after each row is on disk (as it finishes, not in grid order).
    """
    if resume and overwrite:
        raise HiltError("--resume continues DIR/results.jsonl and --overwrite replaces it: give one")
    if workers is not None and workers < 1:
        raise HiltError(f"workers must be at least 1, got {workers}")
    wall = time.perf_counter()
    if use_ray:
        _import_ray()
    grid = parse_grid(grid_path)
    cells, groups = cells_of(grid)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise HiltError(f"{out}: exists and is not a folder")
    results = out / RESULTS_JSONL
    done = {}
    if results.exists() and not overwrite:
        if not resume:
            raise HiltError(f"{results} exists: continue that sweep with --resume, or replace it with --overwrite")
        done = _resume_rows(out, grid, cells)
    if resume and not done:
        log(f"{out}: no finished cells to resume; running all {len(cells)}")
    todo = [g for g in groups if any(c.index not in done for c in g.cells)]
    models = {name: _load_model(grid, name) for name in dict.fromkeys(g.model for g in todo)}
    data = _load_data(grid) if todo else None
    for name, model in models.items():  # a model the data does not fit fails here, before DIR is touched
        try:
            evaluate(model, (data[0][:1], data[1][:1]))
        except HiltError as e:
            raise HiltError(f"{grid.path}: {'models.' + name if name in grid.declared else 'axes.model'} {name!r} "
                            f"on the data: {e}") from None

    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HiltError(f"{out}: cannot create the folder ({e.strerror or e})") from None
    write_text(out / GRID_JSON, json.dumps(grid.normalized(), indent=1) + "\n", fsync=True)
    if not done:
        for name in (RESULTS_JSONL, RESULTS_CSV, TIMING_JSON):
            (out / name).unlink(missing_ok=True)
        for png in out.glob("accuracy*.png"):
            png.unlink()
    else:  # the csv follows the kept rows (the run that wrote them may have died between the two files)
        write_text(out / RESULTS_CSV, "".join(_csv_line(r, i == 0) for i, r in enumerate(done.values())), fsync=True)
    log(f"{grid.path}: {len(cells)} cells in {len(groups)} groups (model x configuration x chips)"
        + (f"; {len(done)} already in {results}" if done else "") + f"; {len(data[1]) if data else 0} samples")

    rows = dict(done)
    group_seconds = {}
    jsonl, csv_file = Appender(results), Appender(out / RESULTS_CSV)
    bar = Progress(len(cells), "sweep", "cell", initial=len(done), enabled=progress)
    header = not done

    def finished(index, accuracies, digital, seconds):
        nonlocal header
        cell = cells[index]
        row = make_row(cell, accuracies, digital)
        jsonl.write(_jsonl(row))
        csv_file.write(_csv_line(row, header))
        header = False
        rows[index] = row
        group_seconds[cell.group] = group_seconds.get(cell.group, 0.0) + seconds
        bar.done(cell.label(grid), f"mean {row['mean']:.4f} ± {row['std']:.4f}, worst {row['worst']:.4f}")
        if on_row is not None:
            on_row(row)

    tasks = [(g, {"config": g.config, "chips": g.chips, "seed": g.seed, "batch_size": grid.batch_size,
                  "cells": [(c.index, c.seconds, c.values["gdc"]) for c in g.cells if c.index not in done]})
             for g in todo]
    try:
        if use_ray and tasks:
            placement = _run_ray(tasks, models, data, workers, finished, log)
        else:
            placement = None
            for g, task in tasks:
                for item in run_group(models[g.model], data, task):
                    finished(*item)
    except Exception as e:
        if not rows:  # failed before its first row (a model that cannot run on analog arrays): leave no sweep behind
            for name in (RESULTS_JSONL, RESULTS_CSV, GRID_JSON):
                (out / name).unlink(missing_ok=True)
            if created and not any(out.iterdir()):
                out.rmdir()
        if isinstance(e, CellError):
            raise HiltError(f"{grid.path}: cell {cells[e.cell].label(grid)}: {e.reason}") from None
        raise
    finally:
        bar.close()
        jsonl.close()
        csv_file.close()

    ordered = [rows[i] for i in range(len(cells))]
    _write_rows(out, ordered)
    timing = {"wall_seconds": round(time.perf_counter() - wall, 3), "ray": bool(use_ray and tasks),
              **(placement or {}), "cells_computed": len(cells) - len(done), "cells_resumed": len(done),
              "groups": [{"group": " ".join(_show(a, g.cells[0].values[a]) for a in GROUP_AXES if a in grid.axes),
                          "cells": len(task["cells"]), "seconds": round(group_seconds.get(g.index, 0.0), 3)}
                         for g, task in tasks]}
    write_text(out / TIMING_JSON, json.dumps(timing, indent=1) + "\n", fsync=True)
    drawn = plot_sweep(grid, ordered, out) if plots else []
    log(f"wrote {results}, {out / RESULTS_CSV}" + (f" and {len(drawn)} plots" if drawn else ""))
    return {"grid": str(grid.path), "out": str(out), "cells": len(cells), "computed": len(cells) - len(done),
            "resumed": len(done), "wall_seconds": timing["wall_seconds"], "plots": [str(p) for p in drawn],
            "rows": ordered}


def _import_ray():
    try:
        import ray
    except ImportError:
        raise HiltError("--ray needs Ray: pip install 'hilt[ray]'") from None
    return ray


def _run_ray(tasks, models, data, workers, finished, log) -> dict:
    """One Ray task per group on the cluster at RAY_ADDRESS, the one this process already joined,
    or a local instance on every CPU; rows come back cell by cell (the tasks are generators)."""
    ray = _import_ray()
    started = False
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        try:
            if address:
                ray.init(address=address, logging_level=logging.ERROR)
            else:
                ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level=logging.ERROR)
        except ConnectionError as e:
            raise HiltError(f"cannot reach the Ray cluster at RAY_ADDRESS={address} ({e})") from None
        started = True
    pending = []
    try:
        cpus = int(ray.cluster_resources().get("CPU", 1))
        slots = min(workers or cpus, cpus)
        per_task = max(1, cpus // slots)
        log(f"Ray: {cpus} CPUs, {per_task} per task ({slots} tasks at a time), {len(tasks)} tasks")
        remote = ray.remote(run_group).options(num_cpus=per_task)
        data_ref = ray.put(data)
        model_refs = {name: ray.put(m) for name, m in models.items()}
        pending = [remote.remote(model_refs[g.model], data_ref, task, per_task) for g, task in tasks]
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for stream in ready:
                try:
                    ref = next(stream)
                except StopIteration:
                    continue
                pending.append(stream)
                try:
                    item = ray.get(ref)
                except ray.exceptions.RayTaskError as e:
                    cause = getattr(e, "cause", None)
                    if isinstance(cause, HiltError):
                        raise cause from None
                    raise
                finished(*item)
        return {"cpus": cpus, "workers": slots, "cpus_per_task": per_task}
    finally:
        for stream in pending:
            ray.cancel(stream, force=True)
        if started:
            ray.shutdown()


# ------------------------------------------------------------------ plots


def plot_sweep(grid: Grid, rows: list[dict], out: Path, max_panels: int = 12) -> list[Path]:
    """Per axis with more than one value: accuracy against time, one line per value of the axis,
    mean ± std over chips as a band; a panel per combination of the other varying axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    varying = [a for a in grid.axes if a != "time" and len(grid.axes[a]) > 1]
    log_x = all(r["seconds"] > 0 for r in rows)
    paths = []
    for axis in varying or [None]:
        others = [a for a in varying if a != axis]
        panels = list(itertools.product(*(grid.axes[a] for a in others)))[:max_panels]
        cols = min(3, len(panels))
        n_rows = math.ceil(len(panels) / cols)
        fig, axs = plt.subplots(n_rows, cols, figsize=(5.2 * cols, 3.6 * n_rows), squeeze=False, sharey=True)
        for ax, combo in zip(axs.flat, panels, strict=False):
            fixed = dict(zip(others, combo, strict=True))
            mine = [r for r in rows if all(r[a] == v for a, v in fixed.items())]
            for value, color in zip(grid.axes[axis] if axis else [None], itertools.cycle(plt.cm.tab10.colors)):
                line = sorted((r for r in mine if axis is None or r[axis] == value), key=lambda r: r["seconds"])
                t = [r["seconds"] for r in line]
                mean = [r["mean"] for r in line]
                std = [r["std"] for r in line]
                ax.plot(t, mean, "o-", color=color, label=_show(axis, value) if axis else "mean over chips")
                ax.fill_between(t, [m - s for m, s in zip(mean, std, strict=True)],
                                [m + s for m, s in zip(mean, std, strict=True)], color=color, alpha=0.2)
            for d in sorted({r["digital"] for r in mine}):
                ax.axhline(d, color="gray", ls="--", lw=1)
            ax.set_xscale("log" if log_x else "symlog")
            ax.set_title(", ".join(_show(a, v) for a, v in fixed.items()) or "accuracy over time", fontsize=9)
            ax.grid(alpha=0.3)
            ax.set_xlabel("time after programming (s)")
            ax.legend(fontsize=8)
        for ax in list(axs.flat)[len(panels):]:
            ax.set_visible(False)
        for ax in axs[:, 0]:
            ax.set_ylabel("accuracy (mean ± std over chips)")
        fig.suptitle(f"{grid.path.name}: dashed = digital" + (f", by {axis}" if axis else ""))
        fig.tight_layout()
        path = out / (f"accuracy_by_{axis}.png" if axis else "accuracy.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
