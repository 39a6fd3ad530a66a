"""`hilt sweep GRID.toml --out DIR`: accuracy (a language model: perplexity or embedding cosine) on
simulated CIM chips over a grid of models x presets x AnalogConfig fields x chips x drift compensation x
times after programming, locally or on a Ray cluster.

The grid (its format, cells, groups and seeds) is `hilt.tasks.grid`; this module runs the groups (here
or as Ray tasks), writes the rows, resumes, and draws the plots. The grid format, the output files and
the resume rules: docs/sweep.md.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import logging
import math
import os
import time
from pathlib import Path

import torch

from hilt.atomic import Appender, write_text
from hilt.cim_sim import convert_to_analog, drift_to, evaluate, program
from hilt.errors import HiltError
from hilt.progress import LOG, Progress
from hilt.tasks.drift_lm import LANGUAGE_MODELS
from hilt.tasks.grid import GROUP_AXES, Cell, Grid, canonical, cells_of, parse_grid, program_seeds, read_seeds, show

RESULTS_JSONL, RESULTS_CSV, GRID_JSON, TIMING_JSON = "results.jsonl", "results.csv", "grid.json", "timing.json"


# ------------------------------------------------------------------ evaluation (runs locally or in a Ray task)


class CellError(HiltError):
    """A cell's evaluation failed: the sweep names the cell (the group's first when the failure is in
    what its cells share)."""

    def __init__(self, cell: int, reason: str):
        super().__init__(cell, reason)  # as args, so that it pickles back from a Ray task
        self.cell, self.reason = cell, reason

    def __str__(self):
        return f"cell {self.cell}: {self.reason}"


def _scoring(model, data, batch):
    """(the network to put on chips, its digital score, score(analog) -> one number per chip, metric, calibrate).
    A classifier scores accuracy; a language model (hilt.tasks.drift_lm.LanguageModel) perplexity or,
    an encoder, the cosine of its embeddings to the digital ones."""
    from hilt.tasks.drift_lm import LanguageModel, calibrate, chip_metric

    if not isinstance(model, LanguageModel):
        return (model, float(evaluate(model, data, batch_size=batch)[0]),
                lambda analog: evaluate(analog, data, batch_size=batch).tolist(), "accuracy", None)
    def calibrated(analog):
        calibrate(model, analog)

    if model.kind == "causal":
        return (model.model, chip_metric(model, model.model, data)[0], lambda analog: chip_metric(model, analog, data),
                "perplexity", calibrated)
    reference = chip_metric(model, model.model, data)[0]
    return model.model, 1.0, lambda analog: chip_metric(model, analog, data, reference), "cosine", calibrated


def run_group(model, data, task: dict, threads: int | None = None):
    """Evaluate one group: program its chips once, then per cell drift to the cell's time and gdc.

    ``task``: {"config", "chips", "seed", "batch_size", "cells": [(cell index, seconds, gdc), ...]}.
    Yields (cell index, per-chip scores, digital score, seconds spent, metric) per cell, in order.
    """
    from hilt.cim_sim import needs_calibration

    if threads:
        torch.set_num_threads(threads)
    start = time.perf_counter()
    batch = task["batch_size"]
    index = task["cells"][0][0]
    try:
        network, digital, score, metric, calibrate = _scoring(model, data, batch)
        analog = convert_to_analog(network, task["config"])
        if calibrate is not None and needs_calibration(analog):
            calibrate(analog)
        program(analog, seeds=program_seeds(task["seed"], task["chips"]))
    except HiltError as e:
        raise CellError(index, str(e)) from None
    for index, seconds, gdc in task["cells"]:
        try:
            drift_to(analog, seconds, gdc=gdc, seeds=read_seeds(task["seed"], seconds, task["chips"]))  # also seeds the forward noise
            scores = score(analog)
        except HiltError as e:
            raise CellError(index, str(e)) from None
        now = time.perf_counter()
        yield index, scores, digital, now - start, metric
        start = now


# ------------------------------------------------------------------ rows and files


def _round(x: float) -> float:
    return round(float(x), 6)


def make_row(cell: Cell, scores, digital: float, metric: str | None = None) -> dict:
    """A cell's row. A grid of classifiers only keeps the rows it always had (``accuracies``, no
    ``metric``); a grid with a language model names each row's ``metric`` and keeps its ``values``."""
    values = [_round(a) for a in scores]
    mean = sum(values) / len(values)
    std = math.sqrt(sum((a - mean) ** 2 for a in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    row = dict(cell.values)
    row["seconds"] = cell.seconds
    worst = max(values) if metric == "perplexity" else min(values)
    if metric is None:
        row.update(mean=_round(mean), std=_round(std), worst=worst, accuracies=values)
    else:
        row.update(metric=metric, mean=_round(mean), std=_round(std), worst=worst, values=values)
    row.update(seed=cell.seed, digital=_round(digital))
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
    now = json.loads(canonical(grid.normalized()))
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
        cell = by_key.get(canonical(values))
        if cell is None or row.get("seed") != cell.seed:
            what = " ".join(show(a, v) for a, v in values.items())
            raise HiltError(f"{path}: line {number} ({what}) is not a cell of {grid.path} "
                            f"{'with this seed' if cell else ''}".rstrip() + "; use --overwrite to start again")
        if cell.index in done:
            raise HiltError(f"{path}: line {number} repeats a cell; use --overwrite to start again")
        done[cell.index] = row
    return done


# ------------------------------------------------------------------ models and data


def _load_model(grid: Grid, name: str):
    """A classifier (nn.Module) or a language model (hilt.tasks.drift_lm.LanguageModel)."""
    from hilt.tasks.cim_inputs import load_model

    entry = grid.models[name]
    key = f"models.{name}" if name in grid.declared else "axes.model"
    try:
        if grid.is_language_model(name):
            from hilt.tasks.drift_lm import load_language_model

            spec = entry["spec"]
            return load_language_model(spec if spec in LANGUAGE_MODELS else str(grid.path.parent / spec))
        checkpoint = entry["checkpoint"]
        if checkpoint is not None:
            checkpoint = grid.path.parent / checkpoint
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


def _language_data(grid: Grid, lm):
    """A language model's evaluation inputs: ``tokens`` tokens (default 128, windows of 128) or
    ``sentences`` sentences (default 64) of the grid's ``text`` (default Hamlet)."""
    from hilt.tasks.drift_lm import eval_data

    text = grid.language.get("text")
    try:
        data, _ = eval_data(lm, None if text is None else grid.path.parent / text, grid.language.get("tokens", 128),
                            128, grid.language.get("sentences", 64))
    except HiltError as e:
        raise HiltError(f"{grid.path}: text: {e}") from None
    return data


# ------------------------------------------------------------------ running


def run_sweep(grid_path, out, *, resume: bool = False, overwrite: bool = False, use_ray: bool = False,
              workers: int | None = None, plots: bool = True, progress: bool = False, on_row=None) -> dict:
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
        import_ray()
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
        LOG.info(f"{out}: no finished cells to resume; running all {len(cells)}")
    todo = [g for g in groups if any(c.index not in done for c in g.cells)]
    models = {name: _load_model(grid, name) for name in dict.fromkeys(g.model for g in todo)}
    classifiers = [name for name in models if not grid.is_language_model(name)]
    data = _load_data(grid) if classifiers else None
    inputs = {name: data if name in classifiers else _language_data(grid, models[name]) for name in models}
    named = any(grid.is_language_model(m) for m in grid.axes["model"])  # then every row names its metric
    for name in classifiers:  # a model the data does not fit fails here, before DIR is touched
        model = models[name]
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
    LOG.info(f"{grid.path}: {len(cells)} cells in {len(groups)} groups (model x configuration x chips)"
        + (f"; {len(done)} already in {results}" if done else "") + (f"; {len(data[1])} samples" if data else ""))

    rows = dict(done)
    group_seconds = {}
    jsonl, csv_file = Appender(results), Appender(out / RESULTS_CSV)
    bar = Progress(len(cells), "sweep", "cell", initial=len(done), enabled=progress)
    header = not done

    def finished(index, scores, digital, seconds, cell_metric):
        nonlocal header
        cell = cells[index]
        row = make_row(cell, scores, digital, cell_metric if named else None)
        jsonl.write(_jsonl(row))
        csv_file.write(_csv_line(row, header))
        header = False
        rows[index] = row
        group_seconds[cell.group] = group_seconds.get(cell.group, 0.0) + seconds
        bar.done(cell.label(grid), (f"{row['metric']} " if "metric" in row else "")
                 + f"mean {row['mean']:.4f} ± {row['std']:.4f}, worst {row['worst']:.4f}")
        if on_row is not None:
            on_row(row)

    tasks = [(g, {"config": g.config, "chips": g.chips, "seed": g.seed, "batch_size": grid.batch_size,
                  "cells": [(c.index, c.seconds, c.values["gdc"]) for c in g.cells if c.index not in done]})
             for g in todo]
    try:
        if use_ray and tasks:
            placement = _run_ray(tasks, models, inputs, workers, finished)
        else:
            placement = None
            for g, task in tasks:
                for item in run_group(models[g.model], inputs[g.model], task):
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
              "groups": [{"group": " ".join(show(a, g.cells[0].values[a]) for a in GROUP_AXES if a in grid.axes),
                          "cells": len(task["cells"]), "seconds": round(group_seconds.get(g.index, 0.0), 3)}
                         for g, task in tasks]}
    write_text(out / TIMING_JSON, json.dumps(timing, indent=1) + "\n", fsync=True)
    drawn = plot_sweep(grid, ordered, out) if plots else []
    LOG.info(f"wrote {results}, {out / RESULTS_CSV}" + (f" and {len(drawn)} plots" if drawn else ""))
    return {"grid": str(grid.path), "out": str(out), "cells": len(cells), "computed": len(cells) - len(done),
            "resumed": len(done), "wall_seconds": timing["wall_seconds"], "plots": [str(p) for p in drawn],
            "rows": ordered}


def import_ray():
    try:
        import ray
    except ImportError:
        raise HiltError("--ray needs Ray: pip install 'hilt[ray]'") from None
    return ray


def _run_ray(tasks, models, inputs, workers, finished) -> dict:
    """One Ray task per group on the cluster at RAY_ADDRESS, the one this process already joined,
    or a local instance on every CPU; rows come back cell by cell (the tasks are generators)."""
    ray = import_ray()
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
        LOG.info(f"Ray: {cpus} CPUs, {per_task} per task ({slots} tasks at a time), {len(tasks)} tasks")
        remote = ray.remote(run_group).options(num_cpus=per_task)
        refs = {}  # one object per distinct input (the classifiers share theirs)
        input_refs = {name: refs.setdefault(id(x), ray.put(x)) for name, x in inputs.items()}
        model_refs = {name: ray.put(m) for name, m in models.items()}
        pending = [remote.remote(model_refs[g.model], input_refs[g.model], task, per_task) for g, task in tasks]
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
    metrics = sorted({r.get("metric", "accuracy") for r in rows})
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
                ax.plot(t, mean, "o-", color=color, label=show(axis, value) if axis else "mean over chips")
                ax.fill_between(t, [m - s for m, s in zip(mean, std, strict=True)],
                                [m + s for m, s in zip(mean, std, strict=True)], color=color, alpha=0.2)
            for d in sorted({r["digital"] for r in mine}):
                ax.axhline(d, color="gray", ls="--", lw=1)
            ax.set_xscale("log" if log_x else "symlog")
            if metrics == ["perplexity"]:
                ax.set_yscale("log")
            ax.set_title(", ".join(show(a, v) for a, v in fixed.items()) or f"{' / '.join(metrics)} over time", fontsize=9)
            ax.grid(alpha=0.3)
            ax.set_xlabel("time after programming (s)")
            ax.legend(fontsize=8)
        for ax in list(axs.flat)[len(panels):]:
            ax.set_visible(False)
        for ax in axs[:, 0]:
            ax.set_ylabel(f"{' / '.join(metrics)} (mean ± std over chips)")
        fig.suptitle(f"{grid.path.name}: dashed = digital" + (f", by {axis}" if axis else ""))
        fig.tight_layout()
        path = out / (f"accuracy_by_{axis}.png" if axis else "accuracy.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
