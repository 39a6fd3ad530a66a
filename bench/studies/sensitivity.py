"""Does TPV predict what quantizing a layer costs? `hilt bench sensitivity`.

For each model: the TPV of every layer in each study format (from calibration data), then each
layer quantized on its own (the rest as they were) and the real change measured on evaluation
data the calibration never saw:

- MiniLM: 1 - mean cosine similarity of 256 Hamlet sentence embeddings to the fp32 model
  (predicted: TPV / 2);
- SmolLM2: mean KL divergence of the next-token distribution per token over 1024 tokens of Hamlet,
  and the perplexity (predicted KL: TPV / 2); every second layer (every fifth with --quick);
- CNN (Fashion-MNIST): mean squared logit change per test image (predicted: TPV), and accuracy.

Predicted is eᵀ H_eff e with each format's actual error e (``predicted``), and the block-diagonal
TPV (``predicted_blocks``: each block's error variance times its share of the trace). Reported:
Spearman rank correlation of predicted against measured over the layers, per format, and for the
whole model quantized in that format the predicted sum against the measured change.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hilt.bench import RESULTS
from hilt.bench.tasks.sensitivity import load_subject, sensitivity_run
from hilt.quant.checkpoint import write_json
from hilt.quant.quantize import quantize_tensor
from hilt.quant.sensitivity import parse_candidates, resolve, spearman

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
                from hilt.bench.data.text import sentences
                from hilt.bench.models import bert

                self.sentences = sentences(64 if quick else 256)
                self.ref = bert.embed(subject.model, subject.tokenizer, self.sentences)
            elif kind == "llama":
                from hilt.bench.data.text import shakespeare_text

                ids = subject.tokenizer.encode(shakespeare_text("hamlet"))[:1024]
                self.windows = torch.tensor(ids).view(-1, 512)
                self.ref = [F.log_softmax(subject.model(w[None])[0, :-1].float(), -1) for w in self.windows]
            else:
                from hilt.bench.data.fashion_mnist import load_fashion_mnist

                self.x, self.y = load_fashion_mnist("test", limit=2000 if quick else 10_000)
                self.ref = subject.model(self.x)

    def __call__(self) -> dict:
        s = self.subject
        with torch.inference_mode():
            if s.kind == "bert":
                from hilt.bench.models import bert

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
            return {"change": float((logits - self.ref).square().sum(-1).mean()),
                    "accuracy": float((logits.argmax(-1) == self.y).float().mean())}


def study(model: str, quick: bool = False, log=print, formats: str | None = None) -> dict:
    opts = dict((QUICK if quick else FULL)[model])
    every = opts.pop("every", 1)
    subject = load_subject(model, **opts)
    spec = formats or FORMATS[model]
    t0 = time.perf_counter()
    sens = sensitivity_run(subject=subject, candidates=spec, probes=2 if quick else 4, full=True)
    log(f"{model}: sensitivity of {len(sens['layers'])} layers in {time.perf_counter() - t0:.1f} s")
    half = 1.0 if subject.kind == "workload" else 0.5  # what the measured change is in units of TPV
    measure = _Measure(subject, quick)
    base = measure()
    rows = []
    layers = [r for r in sens["layers"] if not r.get("unused")][::every]
    for cfg in parse_candidates(spec):
        from hilt.quant.sensitivity import format_label

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
        log(f"{model} {label}: {len(layers)} layers measured one at a time")
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
        log(f"{model} {label}: Spearman {summary[label]['spearman']:.3f} (blocks {summary[label]['spearman_blocks']:.3f}) "
            f"over {len(fr)} layers; whole model predicted {predicted_whole:.4g} (blocks {predicted_whole_blocks:.4g}), "
            f"measured {whole['change']:.4g}")
    pairs = spearman([r["predicted"] for r in rows], [r["measured_change"] for r in rows])
    return {"model": model, "kind": subject.kind, "predicts": sens["predicts"], "calibration": sens["calibration"],
            "samples": sens["samples"], "baseline": base, "formats": summary, "spearman_all_pairs": pairs,
            "layers_every": every, "rows": rows, "sensitivity_seconds": sens["seconds"]}


def plot(results: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(4.6 * len(models), 4.2), squeeze=False)
    for ax, name in zip(axes[0], models):
        r = results["models"][name]
        for label in r["formats"]:
            pts = [(x["predicted"], x["measured_change"]) for x in r["rows"] if x["format"] == label]
            ax.loglog([p for p, _ in pts], [m for _, m in pts], "o", ms=4,
                      label=f"{label} (ρ={r['formats'][label]['spearman']:.2f})")
        lo = min(min(x["predicted"], x["measured_change"]) for x in r["rows"] if x["measured_change"] > 0)
        hi = max(max(x["predicted"], x["measured_change"]) for x in r["rows"])
        ax.plot([lo, hi], [lo, hi], "k:", lw=1)
        ax.set_xlabel("predicted (TPV)")
        ax.set_ylabel("measured, one layer quantized")
        ax.set_title(name, fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(out=None, quick: bool = False, models=("minilm", "cnn"), log=print) -> dict:
    results = {"quick": quick, "models": {}}
    for m in models:
        results["models"][m] = study(m, quick=quick, log=log)
    if out is not None:
        out = Path(out)
        write_json(out, results)
        plot(results, out.with_suffix(".png"))
        log(f"wrote {out} and {out.with_suffix('.png')}")
    return results


DEFAULT_OUT = RESULTS / "sensitivity_validation.json"
