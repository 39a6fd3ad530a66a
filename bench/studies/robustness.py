"""`hilt bench robustness`: standard training, noise injection and DWP on the Fashion-MNIST CNN.

For each method: accuracy under weight mismatch w (1 + eta N(0, 1)) over many
draws, and over a year of PCM drift with global compensation; then an ablation
of DWP's own knobs (K, the noise range, the weighting rule), each changed alone
from the default at a smaller training budget. See cim_sim/training.py for the
methods.
"""

from __future__ import annotations

import dataclasses
import json
import time

import torch

from hilt.models import TRAINED
from hilt.tasks.drift import drift_study
from hilt.data.fashion_mnist import load_fashion_mnist
from hilt.tasks.train import (
    DEFAULT_EPOCHS,
    load_workload,
    save_workload,
    train,
)
from hilt.cim_sim import evaluate
from hilt.cim_sim.training import NoisyTraining, mismatch_copy
from hilt.progress import LOG, quiet

ETAS = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7)
METHODS = {
    "standard": NoisyTraining(method="standard"),
    "noise": NoisyTraining(method="noise"),
    "dwp": NoisyTraining(method="dwp"),
}
ABLATION = {  # one knob changed from the default DWP at a time
    "dwp (default)": {},
    "K=2": {"copies": 2},
    "K=8": {"copies": 8},
    "eta 0.1..0.3": {"eta_min": 0.1, "eta_max": 0.3},
    "eta 0.3..0.9": {"eta_min": 0.3, "eta_max": 0.9},
    "weighting error": {"weighting": "error"},
    "weighting none": {"weighting": "none"},
}
# Budgets: training images (None: all 60,000) and epochs; mismatch draws per level; test images for every
# evaluation; programmed chips and times for the drift study; the ablation's training images, epochs, draws.
FULL = dict(limit=None, epochs=DEFAULT_EPOCHS["cnn"], draws=50, test_images=2000, chips=3,
            times="1s,1h,1d,1mo,1y", ablation_limit=20_000, ablation_epochs=2, ablation_draws=20)
QUICK = dict(limit=10_000, epochs=2, draws=10, test_images=1000, chips=2, times="1s,1d,1y",
             ablation_limit=6000, ablation_epochs=1, ablation_draws=8)


def mismatch_sweep(model, images, labels, draws: int, etas=ETAS, seed: int = 0) -> list[dict]:
    """Accuracy under mismatch at each eta over ``draws`` draws: mean, std, worst."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for eta in etas:
        accs = torch.tensor([evaluate(mismatch_copy(model, eta, gen), (images, labels)).item()
                             for _ in range(draws if eta > 0 else 1)])
        rows.append({"eta": eta, "mean": float(accs.mean()), "std": float(accs.std()) if len(accs) > 1 else 0.0,
                     "worst": float(accs.min()), "draws": len(accs)})
    return rows


def _trained(method: str, cfg: NoisyTraining, plan: dict, quick: bool) -> tuple[torch.nn.Module, str]:
    """The CNN trained with ``cfg``: the committed checkpoint (hilt/models/trained) when it was trained with the
    same settings as the full plan's (the quick run then evaluates the same, fully trained models, and trains
    only the ablation's), otherwise trained now (and saved there, full runs only, saying so when it replaces a
    checkpoint trained with other settings)."""
    path = TRAINED / f"cnn-{method}.safetensors"
    want = {"method": cfg.method, "epochs": str(FULL["epochs"]), "seed": "0"}
    if path.exists() and (quick or plan["epochs"] == FULL["epochs"]):
        model, meta = load_workload(path, "cnn")
        training = dataclasses.asdict(cfg) if cfg.method != "standard" else None
        if all(meta.get(k) == v for k, v in want.items()) and (training is None or meta.get("training") == json.dumps(training)):
            LOG.info(f"{method}: using {path.name}")
            return model, f"{path.name} ({FULL['epochs']} epochs, all training images)"
        LOG.warning(f"{method}: {path} was trained with other settings; training it again"
                    + ("" if quick else " and replacing it"))
    start = time.perf_counter()
    model, _ = train("cnn", epochs=plan["epochs"], limit=plan["limit"], training=cfg, progress=False)
    LOG.info(f"{method}: trained in {time.perf_counter() - start:.0f} s")
    if not quick:
        images, labels = load_fashion_mnist("test")
        meta = {"method": cfg.method, "epochs": plan["epochs"], "seed": 0, "lr": 1e-3, "batch_size": 128,
                "test_accuracy": evaluate(model, (images, labels)).item()}
        if cfg.method != "standard":
            meta["training"] = dataclasses.asdict(cfg)
        save_workload(model, path, "cnn", meta)
    return model, f"trained in this run ({plan['epochs']} epochs, {plan['limit'] or 'all'} training images)"


def study(quick: bool = False, plan: dict | None = None, ablation=tuple(ABLATION)) -> dict:
    """The whole study; ``plan`` overrides the budget (QUICK or FULL), ``ablation`` picks variants by name."""
    plan = plan or (QUICK if quick else FULL)
    images, labels = load_fashion_mnist("test", limit=plan["test_images"])
    result = {"quick": quick, "plan": plan, "etas": list(ETAS), "methods": {}, "ablation": {}}
    for method, cfg in METHODS.items():
        model, origin = _trained(method, cfg, plan, quick)
        sweep = mismatch_sweep(model, images, labels, plan["draws"])
        with quiet():  # its per-time table would interleave with this study's lines; the summary below says it
            drift = drift_study("cnn", preset_name="pcm", times=plan["times"], repeats=plan["chips"],
                                test_images=plan["test_images"], model=model)
        drift_rows = [r for r in drift["rows"] if r["gdc"] == "global"]
        result["methods"][method] = {"training": dataclasses.asdict(cfg), "model": origin, "mismatch": sweep,
                                     "drift": drift_rows}
        cells = "  ".join(f"{r['eta']:.1f}: {r['mean']:.3f}" for r in sweep)
        year = [r["mean"] for r in drift_rows]
        LOG.info(f"{method:<9} mismatch {cells}   PCM drift (compensated) {min(year):.3f}..{max(year):.3f}")
    base = METHODS["dwp"]
    ablation_plan = dict(plan, limit=plan["ablation_limit"], epochs=plan["ablation_epochs"])
    for name in ablation:
        cfg = dataclasses.replace(base, **ABLATION[name])
        start = time.perf_counter()
        model, _ = train("cnn", epochs=ablation_plan["epochs"], limit=ablation_plan["limit"], training=cfg)
        seconds = time.perf_counter() - start
        sweep = mismatch_sweep(model, images, labels, plan["ablation_draws"], etas=(0.0, 0.5, 0.7))
        result["ablation"][name] = {"training": dataclasses.asdict(cfg), "mismatch": sweep, "train_seconds": seconds}
        LOG.info(f"ablation {name:<16} " + "  ".join(f"{r['eta']:.1f}: {r['mean']:.3f}" for r in sweep)
                 + f"  ({seconds:.0f} s)")
    return result


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"standard": "tab:gray", "noise": "tab:blue", "dwp": "tab:red"}
    for method, r in result["methods"].items():
        eta = [row["eta"] for row in r["mismatch"]]
        mean = torch.tensor([row["mean"] for row in r["mismatch"]])
        std = torch.tensor([row["std"] for row in r["mismatch"]])
        left.plot(eta, mean, "o-", color=colors[method], label=method)
        left.fill_between(eta, mean - std, mean + std, color=colors[method], alpha=0.2)
        left.plot(eta, [row["worst"] for row in r["mismatch"]], ":", color=colors[method], lw=1)
        t = [row["seconds"] for row in r["drift"]]
        right.plot(t, [row["mean"] for row in r["drift"]], "o-", color=colors[method], label=method)
        right.fill_between(t, [row["mean"] - row["std"] for row in r["drift"]],
                           [row["mean"] + row["std"] for row in r["drift"]], color=colors[method], alpha=0.2)
    left.set_xlabel("mismatch level eta (w -> w(1 + eta N(0,1)))")
    left.set_ylabel("test accuracy (mean ± std; dotted: worst draw)")
    left.set_title(f"CNN under weight mismatch, {result['plan']['draws']} draws per level")
    right.set_xscale("log")
    right.set_xlabel("time after programming (s)")
    right.set_ylabel("test accuracy (mean ± std over chips)")
    right.set_title("PCM drift, global compensation")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render(result: dict) -> str:
    """The study as Markdown tables."""
    etas = result["etas"]
    lines = ["| method | " + " | ".join(f"eta {e:g}" for e in etas) + " | drift 1 s .. 1 y (compensated) |",
             "|---|" + "---|" * (len(etas) + 1)]
    for method, r in result["methods"].items():
        cells = [f"{row['mean']:.3f} ± {row['std']:.3f} (worst {row['worst']:.3f})" for row in r["mismatch"]]
        year = [row["mean"] for row in r["drift"]]
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {year[0]:.3f} .. {year[-1]:.3f} "
                     f"(spread {max(year) - min(year):.3f}) |")
    if all(r.get("model") for r in result["methods"].values()):  # the committed checkpoints or this run's training
        lines += ["", "The CNNs: " + "; ".join(f"{m}: {r['model']}" for m, r in result["methods"].items()) + "."]
    lines += ["", "| DWP ablation | eta 0 | eta 0.5 | eta 0.7 |", "|---|---|---|---|"]
    for name, r in result["ablation"].items():
        lines.append(f"| {name} | " + " | ".join(f"{row['mean']:.3f} ± {row['std']:.3f}" for row in r["mismatch"]) + " |")
    return "\n".join(lines) + "\n"
