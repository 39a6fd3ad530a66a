"""Does TPV predict what quantizing a layer costs? `hilt bench sensitivity`.

For each model: the TPV of every layer in each study format (from calibration data), then each
layer quantized on its own (the rest as they were) and the real change measured on evaluation
data the calibration never saw:

- MiniLM: 1 - mean cosine similarity of 256 Hamlet sentence embeddings to the fp32 model
  (predicted: TPV / 2);
- SmolLM2: mean KL divergence of the next-token distribution per token over 1024 tokens of Hamlet,
  and the perplexity (predicted KL: TPV / 2); every second layer (every fifth with --quick);
- CNN (Fashion-MNIST): mean KL divergence of the class distribution per test image (predicted:
  TPV / 2), with the accuracy and the mean squared logit change beside it.

Predicted is eᵀ H_eff e with each format's actual error e (``predicted``), and the block-diagonal
TPV (``predicted_blocks``: each block's error variance times its share of the trace). Reported:
Spearman rank correlation of predicted against measured over the layers, per format, and for the
whole model quantized in that format the predicted sum against the measured change.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hilt.bench import RESULTS
from hilt.tasks.sensitivity import load_subject, sensitivity_run
from hilt.atomic import write_json
from hilt.quant.quantize import quantize_tensor
from hilt.quant.sensitivity import format_label, parse_candidates, resolve, spearman
from hilt.progress import LOG

FORMATS = {"minilm": "int3,kmeans2", "cnn": "int3@row,kmeans2@row", "smollm2": "int3,kmeans3"}
# calibration size, and every how many layers one is measured (SmolLM2 has 210: each costs a forward)
QUICK = {"minilm": dict(sentences=64), "cnn": dict(images=1024), "smollm2": dict(tokens=1024, every=5)}
FULL = {"minilm": {}, "cnn": {}, "smollm2": dict(every=2)}


def _fake_quantized(w: torch.Tensor, config) -> torch.Tensor:
    w2 = w.detach().reshape(w.shape[0], -1).float()
    return quantize_tensor(w2, config).dequantize().view_as(w).to(w.dtype)


class _Measure:
    """The real output change of a model against its unquantized self, on evaluation data."""

    def __init__(self, subject, quick: bool):
        self.subject = subject
        kind = subject.kind
        with torch.inference_mode():
            if kind == "bert":
                from hilt.data.text import sentences
                from hilt.models import bert

                self.sentences = sentences(64 if quick else 256)
                self.ref = bert.embed(subject.model, subject.tokenizer, self.sentences)
            elif kind == "llama":
                from hilt.data.text import shakespeare_text

                ids = subject.tokenizer.encode(shakespeare_text("hamlet"))[:1024]
                self.windows = torch.tensor(ids).view(-1, 512)
                self.ref = [F.log_softmax(subject.model(w[None])[0, :-1].float(), -1) for w in self.windows]
            else:
                from hilt.data.fashion_mnist import load_fashion_mnist

                self.x, self.y = load_fashion_mnist("test", limit=2000 if quick else 10_000)
                self.ref = subject.model(self.x)

    def __call__(self) -> dict:
        s = self.subject
        with torch.inference_mode():
            if s.kind == "bert":
                from hilt.models import bert

                e = bert.embed(s.model, s.tokenizer, self.sentences)
                return {"change": 1 - bert.embedding_similarity(self.ref, e)}
            if s.kind == "llama":
                kl = nll = n = 0.0
                for w, ref in zip(self.windows, self.ref):
                    logp = F.log_softmax(s.model(w[None])[0, :-1].float(), -1)
                    kl += float((ref.exp() * (ref - logp)).sum())
                    nll += float(F.nll_loss(logp, w[1:], reduction="sum"))
                    n += w.numel() - 1
                return {"change": kl / n, "perplexity": math.exp(nll / n)}
            logits = s.model(self.x)
            p, q = F.log_softmax(self.ref, -1), F.log_softmax(logits, -1)
            return {"change": float((p.exp() * (p - q)).sum(-1).mean()),
                    "logit_mse": float((logits - self.ref).square().sum(-1).mean()),
                    "accuracy": float((logits.argmax(-1) == self.y).float().mean())}


def study(model: str, quick: bool = False, formats: str | None = None) -> dict:
    opts = dict((QUICK if quick else FULL)[model])
    every = opts.pop("every", 1)
    subject = load_subject(model, **opts)
    spec = formats or FORMATS[model]
    t0 = time.perf_counter()
    sens = sensitivity_run(subject=subject, candidates=spec, probes=2 if quick else 4, full=True)
    LOG.info(f"{model}: sensitivity of {len(sens['layers'])} layers in {time.perf_counter() - t0:.1f} s")
    half = 0.5  # the measured change (KL, 1 - cosine) is half the squared output change TPV predicts
    measure = _Measure(subject, quick)
    base = measure()
    rows = []
    layers = [r for r in sens["layers"] if not r.get("unused")][::every]
    for cfg in parse_candidates(spec):
        label = format_label(cfg)
        for r in layers:
            p = subject.params[r["name"]]
            fitted = resolve(cfg, p.shape)
            if fitted is None:
                continue
            saved = p.detach().clone()
            with torch.no_grad():
                p.copy_(_fake_quantized(saved, fitted))
            try:
                m = measure()
            finally:
                with torch.no_grad():
                    p.copy_(saved)
            rows.append({"format": label, "layer": r["name"], "predicted": half * r["tpv_full"][label],
                         "predicted_se": half * r["tpv_full_se"][label], "predicted_blocks": half * r["tpv"][label],
                         "predicted_blocks_se": half * r["tpv_se"][label], **{f"measured_{k}": v for k, v in m.items()}})
        LOG.info(f"{model} {label}: {len(layers)} layers measured one at a time")
    summary = {}
    for cfg in parse_candidates(spec):
        label = format_label(cfg)
        fr = [r for r in rows if r["format"] == label]
        saved = {n: p.detach().clone() for n, p in subject.params.items()}
        with torch.no_grad():
            for n, p in subject.params.items():
                fitted = resolve(cfg, p.shape)
                if fitted is not None:
                    p.copy_(_fake_quantized(p, fitted))
        whole = measure()
        with torch.no_grad():
            for n, p in subject.params.items():
                p.copy_(saved[n])
        predicted_whole = half * sum(r["tpv_full"].get(label, 0.0) for r in sens["layers"])
        predicted_whole_blocks = half * sum(r["tpv"].get(label, 0.0) for r in sens["layers"])
        summary[label] = {
            "layers": len(fr),
            "spearman": spearman([r["predicted"] for r in fr], [r["measured_change"] for r in fr]),
            "spearman_blocks": spearman([r["predicted_blocks"] for r in fr], [r["measured_change"] for r in fr]),
            "whole_model_predicted": predicted_whole, "whole_model_predicted_blocks": predicted_whole_blocks,
            "whole_model_measured": whole["change"],
            **{f"whole_model_{k}": v for k, v in whole.items() if k != "change"},
        }
        LOG.info(f"{model} {label}: Spearman {summary[label]['spearman']:.3f} (blocks {summary[label]['spearman_blocks']:.3f}) "
                 f"over {len(fr)} layers; whole model predicted {predicted_whole:.4g} (blocks {predicted_whole_blocks:.4g}), "
                 f"measured {whole['change']:.4g}")
    pairs = spearman([r["predicted"] for r in rows], [r["measured_change"] for r in rows])
    return {"model": model, "kind": subject.kind, "predicts": sens["predicts"], "calibration": sens["calibration"],
            "samples": sens["samples"], "baseline": base, "formats": summary, "spearman_all_pairs": pairs,
            "layers_every": every, "rows": rows, "sensitivity_seconds": sens["seconds"]}


def _on_chip(model, analog_paths, config, chips: int, times, x, y, gdc="global", seed=0) -> list[dict]:
    """The model with the layers ``analog_paths`` on CIM arrays (the rest digital), ``chips`` chips:
    at each time, per chip, the accuracy and the mean squared logit change against the digital model."""
    import copy

    from hilt.cim_sim import drift_to, parse_time, program
    from hilt.cim_sim.analog import AnalogConv1d, AnalogConv2d, AnalogLinear
    from hilt.quant.nn import replace_module

    kinds = {torch.nn.Linear: AnalogLinear, torch.nn.Conv2d: AnalogConv2d, torch.nn.Conv1d: AnalogConv1d}
    chip = copy.deepcopy(model)
    for path in analog_paths:
        module = chip.get_submodule(path)
        replace_module(chip, path, kinds[type(module)](module, config))
    chip.eval()
    program(chip, seeds=[seed + k for k in range(chips)])
    with torch.inference_mode():
        ref = model(x)
    out = []
    for i, t in enumerate(times):
        drift_to(chip, parse_time(t), seeds=[10_000 * (seed + k + 1) + i for k in range(chips)], gdc=gdc)
        logits = []
        with torch.inference_mode():
            for j in range(0, x.shape[0], 500):
                logits.append(chip(x[j:j + 500]).view(chips, -1, ref.shape[-1]))
        logits = torch.cat(logits, 1)
        p, q = F.log_softmax(ref, -1), F.log_softmax(logits, -1)
        out.append({"time": t, "accuracy": (logits.argmax(-1) == y).float().mean(1).tolist(),
                    "logit_mse": (logits - ref).square().sum(-1).mean(1).tolist(),
                    "kl": (p.exp() * (p - q)).sum(-1).mean(1).tolist()})
    return out


def cim_study(workload: str = "cnn", preset_name: str = "pcm", time_text: str = "1y", chips: int = 8,
              quick: bool = False) -> dict:
    """Which layers a CIM chip hurts: TPV with the chip's weight errors against each layer put on the
    arrays alone (the rest digital), and which layers to keep digital: the k of largest TPV against
    the usual rule (the first and the last layer), accuracy from 1 s to a year."""
    from hilt.cim_sim import preset
    from hilt.data.fashion_mnist import load_fashion_mnist

    subject = load_subject(workload, images=512 if quick else 2048)
    cim = {"preset_name": preset_name, "time_text": time_text, "chips": chips, "gdc": "global"}
    sens = sensitivity_run(subject=subject, probes=2 if quick else 4, cim=cim)
    label = sens["candidates"][0]
    x, y = load_fashion_mnist("test", limit=2000 if quick else 10_000)
    config = preset(preset_name)
    paths = [r["name"].removesuffix(".weight") for r in sens["layers"]]
    rows = []
    for r, path in zip(sens["layers"], paths):
        m = _on_chip(subject.model, [path], config, chips, [time_text], x, y)[0]
        rows.append({"layer": r["name"], "predicted": r["tpv_chip"][label] / 2, "predicted_se": r["tpv_chip_se"][label] / 2,
                     "predicted_weights": r["tpv_full"][label] / 2, "predicted_weights_se": r["tpv_full_se"][label] / 2,
                     "predicted_blocks": r["tpv"][label] / 2, "measured_kl": sum(m["kl"]) / chips,
                     "measured_logit_mse": sum(m["logit_mse"]) / chips,
                     "measured_accuracy": sum(m["accuracy"]) / chips})
        LOG.info(f"{workload} {label}: {path} alone on the chip: KL {rows[-1]['measured_kl']:.3g} "
                 f"(predicted {rows[-1]['predicted']:.3g}), accuracy {rows[-1]['measured_accuracy']:.4f}")
    with torch.inference_mode():
        digital = float((subject.model(x).argmax(-1) == y).float().mean())
    summary = {
        "spearman_kl": spearman([r["predicted"] for r in rows], [r["measured_kl"] for r in rows]),
        "spearman_accuracy_drop": spearman([r["predicted"] for r in rows],
                                           [digital - r["measured_accuracy"] for r in rows]),
        "spearman_weights_kl": spearman([r["predicted_weights"] for r in rows], [r["measured_kl"] for r in rows]),
        "spearman_weights_accuracy_drop": spearman([r["predicted_weights"] for r in rows],
                                                   [digital - r["measured_accuracy"] for r in rows]),
    }
    times = ["1s", "1mo", "1y"]
    by_tpv = [p for _, p in sorted(zip([-r["predicted"] for r in rows], paths))]
    keep, curves = {}, {}
    choices = [("none", [])]
    for k in (1, 2):  # the usual rule keeps the last layer, then the first one too
        choices += [(f"tpv, k={k}", by_tpv[:k]), (f"first/last, k={k}", [paths[-1], paths[0]][:k])]
    for key, digital_set in choices:
        chosen = tuple(sorted(digital_set))
        if chosen not in curves:  # the same layers kept digital: the same chips, measured once
            on_chip = [p for p in paths if p not in digital_set]
            curves[chosen] = [
                {"time": c["time"], "accuracy_mean": sum(c["accuracy"]) / chips,
                 "accuracy_std": float(torch.tensor(c["accuracy"]).std()), "accuracy": c["accuracy"]}
                for c in _on_chip(subject.model, on_chip, config, chips, times, x, y)]
        keep[key] = {"digital": digital_set, "curve": curves[chosen]}
        LOG.info(f"{workload} keep digital [{', '.join(digital_set) or 'none'}] ({key}): accuracy at {times[-1]} "
                 f"{keep[key]['curve'][-1]['accuracy_mean']:.4f} ± {keep[key]['curve'][-1]['accuracy_std']:.4f}")
    return {"workload": workload, "label": label, "chips": chips, "digital_accuracy": digital,
            "calibration": sens["calibration"], "samples": sens["samples"], "rows": rows, **summary,
            "keep_digital": keep}


def plot(results: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results["models"])
    panels = len(models) + ("cim" in results)
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 4.2), squeeze=False)
    if "cim" in results:
        c, ax = results["cim"], axes[0][-1]
        for r in c["rows"]:
            ax.errorbar(r["predicted"], r["measured_kl"], xerr=r["predicted_se"], fmt="o", ms=5, capsize=2)
            ax.annotate(r["layer"].removesuffix(".weight"), (r["predicted"], r["measured_kl"]), fontsize=8,
                        xytext=(4, 4), textcoords="offset points")
        lo = min(min(r["predicted"], r["measured_kl"]) for r in c["rows"]) / 2
        hi = max(max(r["predicted"], r["measured_kl"]) for r in c["rows"]) * 2
        ax.loglog([lo, hi], [lo, hi], "k:", lw=1)
        ax.set_xlabel("predicted KL (TPV / 2, the layer's output error on the chip)")
        ax.set_ylabel("measured KL, one layer on the chip")
        ax.set_title(f"cnn, {c['label']}, {c['chips']} chips (ρ={c['spearman_kl']:.2f})", fontsize=10)
    for ax, name in zip(axes[0], models):
        r = results["models"][name]
        for label in r["formats"]:
            pts = [(x["predicted"], x["measured_change"]) for x in r["rows"] if x["format"] == label]
            ax.loglog([p for p, _ in pts], [m for _, m in pts], "o", ms=4,
                      label=f"{label} (ρ={r['formats'][label]['spearman']:.2f})")
        lo = min(min(x["predicted"], x["measured_change"]) for x in r["rows"] if x["measured_change"] > 0)
        hi = max(max(x["predicted"], x["measured_change"]) for x in r["rows"])
        ax.plot([lo, hi], [lo, hi], "k:", lw=1)
        ax.set_xlabel("predicted (TPV / 2)")
        ax.set_ylabel("measured, one layer quantized")
        ax.set_title(name, fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(out=None, quick: bool = False, models=("minilm", "cnn", "cim")) -> dict:
    """The studies of ``models`` ("cim": the CNN on a PCM chip a year after programming); into ``out``
    (JSON, and a plot beside it), where the entries not run this time are kept from an earlier run of
    the same mode."""
    results = {"quick": quick, "models": {}}
    if out is not None and Path(out).exists():
        with contextlib.suppress(ValueError, OSError):
            earlier = json.loads(Path(out).read_text())
            if earlier.get("quick") == quick:
                results = earlier
    for m in models:
        if m == "cim":
            results["cim"] = cim_study(quick=quick)
        else:
            results["models"][m] = study(m, quick=quick)
    if out is not None:
        out = Path(out)
        write_json(out, results)
        plot(results, out.with_suffix(".png"))
        LOG.info(f"wrote {out} and {out.with_suffix('.png')}")
    return results


DEFAULT_OUT = RESULTS / "sensitivity_validation.json"
