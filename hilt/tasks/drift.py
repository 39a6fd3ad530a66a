"""`hilt drift`: accuracy of a model (a built-in Fashion-MNIST workload or a user's) on CIM hardware over
time after programming, many programmed chips evaluated at once."""

from __future__ import annotations

from pathlib import Path

import torch

from hilt.cim_sim import convert_to_analog, drift_to, parse_time, preset, program
from hilt.errors import HiltError
from hilt.progress import LOG, Progress

DEFAULT_TIMES = "1s,1h,1d,1mo,1y"


def drift_study(workload="cnn", checkpoint=None, preset_name="pcm", times=DEFAULT_TIMES, repeats=5,
                gdc="global", test_images=10_000, progress=False, model=None, data=None) -> dict:
    """Accuracy at each time after programming, over ``repeats`` programmed chips, with and without GDC.

    ``workload``: a built-in workload name or ``PKG.MODULE:FACTORY`` (see bench.tasks.cim_inputs);
    ``data``: a data file (default the Fashion-MNIST test split); ``model``: a model to use instead
    of loading one. All chips are programmed at once and evaluated in one batched pass per time;
    chip r is the one-chip model programmed with seed r and read with seed 10000 r + (time index).
    """
    from hilt.tasks.cim_inputs import is_factory, load_data, load_model
    from hilt.cim_sim import analog_layers, evaluate

    seconds = [parse_time(t) for t in (times.split(",") if isinstance(times, str) else times)]
    if len(set(seconds)) != len(seconds):
        raise HiltError(f"--times {times if isinstance(times, str) else ','.join(map(str, times))}: "
                        "a time is listed twice")
    if repeats < 1:
        raise HiltError(f"--repeats must be at least 1, got {repeats}")
    config = preset(preset_name)
    path = None
    if model is None:
        model, info = load_model(workload, checkpoint)
        path = info["checkpoint"] and Path(info["checkpoint"])
        if checkpoint is None and is_factory(workload):
            # said once the model is built (a model that cannot be built is the one error), before any
            # programming: the factory's own weights are usually its random initialisation
            LOG.warning(f"--model {workload} without --checkpoint: running the weights "
                        f"{workload.partition(':')[2]}() builds (untrained unless it loads them itself); "
                        "give --checkpoint FILE for trained weights")
    images, labels = load_data(data, limit=test_images)
    try:
        digital = float(evaluate(model, (images, labels))[0])
    except HiltError as e:  # inputs or labels that do not fit the model: name the file they came from
        raise HiltError(f"{data or 'fashion-mnist'}: {e}") from None
    analog = convert_to_analog(model, config)
    program(analog, seeds=range(repeats))
    modes = ["none"] if gdc == "none" else ["none", gdc]
    acc = {m: [] for m in modes}  # per mode, per time: one accuracy per chip
    labels_t = times.split(",") if isinstance(times, str) else [str(t) for t in times]
    steps = Progress(len(seconds), "drift", "time", steps=len(modes), enabled=progress)
    for i, t in enumerate(seconds):
        for m in modes:
            drift_to(analog, t, seeds=[10_000 * r + i for r in range(repeats)], gdc=m)  # same read for both modes
            acc[m].append(evaluate(analog, (images, labels)).tolist())
            steps.tick()
        steps.done(labels_t[i], f"{repeats} chips, mean accuracy: "
                   + ", ".join(f"{m} {sum(acc[m][i]) / repeats:.4f}" for m in modes))
    steps.close()
    rows = []
    for m in modes:
        for i, t in enumerate(seconds):
            a = torch.tensor(acc[m][i])
            rows.append({"gdc": m, "time": labels_t[i], "seconds": t, "mean": float(a.mean()),
                         "std": float(a.std()) if repeats > 1 else 0.0, "worst": float(a.min()), "all": acc[m][i]})
    result = {"workload": workload, "checkpoint": path and _relative(path), "data": _relative(Path(data)) if data else "fashion-mnist",
              "preset": preset_name, "repeats": repeats, "digital_layers": analog.digital_layers,
              "test_images": len(labels), "digital_accuracy": digital, "rows": rows}
    LOG.info(f"{workload} on {preset_name}: digital accuracy {digital:.4f}; {repeats} programmed chips, "
             f"{len(labels)} test examples; {len(analog_layers(analog))} layers on analog arrays, kept digital: "
             f"{', '.join(analog.digital_layers) or 'none'}")
    LOG.info(f"{'time':>6} " + "".join(f"{m:>28}" for m in modes))
    for t in labels_t:
        cells = "".join(f"{r['mean']:>12.4f} ±{r['std']:.4f} min {r['worst']:.4f}"
                        for r in rows if r["time"] == t)
        LOG.info(f"{t:>6} {cells}")
    return result


def _relative(path: Path) -> str:
    """A path as the user would type it from the current folder (no machine-specific prefix in results)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def plot_drift(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for m, color in zip(sorted({r["gdc"] for r in result["rows"]}), ("tab:red", "tab:blue", "tab:green"), strict=False):
        rows = [r for r in result["rows"] if r["gdc"] == m]
        t = [r["seconds"] for r in rows]
        mean = torch.tensor([r["mean"] for r in rows])
        std = torch.tensor([r["std"] for r in rows])
        label = "no compensation" if m == "none" else f"{m} drift compensation"
        ax.plot(t, mean, "o-", color=color, label=label)
        ax.fill_between(t, mean - std, mean + std, color=color, alpha=0.2)
        ax.plot(t, [r["worst"] for r in rows], ":", color=color, lw=1)
    metric = result.get("metric", "accuracy")
    ax.axhline(result.get("digital", result.get("digital_accuracy")), color="gray", ls="--", lw=1, label="digital")
    ax.set_xscale("log")
    if metric == "perplexity":
        ax.set_yscale("log")
    ax.set_xlabel("time after programming (s)")
    ax.set_ylabel({"accuracy": "test accuracy", "perplexity": "perplexity",
                   "cosine": "cosine to the digital embeddings"}[metric] + " (mean ± std; dotted: worst chip)")
    name = result["workload"].upper() if result["workload"] in ("mlp", "cnn") else result["workload"]
    ax.set_title(f"{name} on {result.get('data', 'fashion-mnist')}, {result['preset']} preset, {result['repeats']} chips")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
