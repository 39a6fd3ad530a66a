"""Mixed precision under a bits budget, four ways: `hilt bench mixed`.

At average budgets of 2.5, 3.0, 3.5 and 4.25 bits per weight (codes + scales + codebooks over the
quantized tensors), on SmolLM2-135M (perplexity on 2048 tokens of Hamlet) and all-MiniLM-L6-v2
(mean cosine similarity of 256 Hamlet sentence embeddings to fp32), each allocator picks a format
per tensor from the same candidates (k-means 1-4 bits, int 2-8 bits, blocks of 64 and 128):

- ``uniform``: one format for every tensor, the one of the most bits that fits (k-means on ties);
- ``llama.cpp``: llama.cpp's Q4_K_M rule scaled to the budget: ``attn_v`` and ``ffn_down``
  (MiniLM: ``attention.self.value`` and the FFN's ``output.dense``) of the first and last eighth
  of the layers and of every third layer between get 2 more bits than the rest; the base width
  and block size are the ones that use the most of the budget;
- ``hawq``: HAWQ-V3's measure, Tr(H_l) / n_l x ||Q(W_l) - W_l||², with H_l the Hessian of the
  calibration loss over the layer's weights (Hutchinson; SmolLM2: next-token cross-entropy on
  Macbeth; MiniLM: the squared distance to its own fp32 embeddings, whose Hessian there is the
  Gauss-Newton matrix), allocated by the same knapsack;
- ``tpv``: the summed predicted TPV with each format's actual error (eᵀ H_eff e), same knapsack;
  ``tpv-blocks``: the block-diagonal TPV of the issue's definition.

Calibration is Macbeth; evaluation is Hamlet. Formats are applied by dequantizing in place the
weights each allocation chose (what `hilt eval --quantized` of that checkpoint computes).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hilt.atomic import write_json, write_text
from hilt.bench import RESULTS
from hilt.tasks.sensitivity import candidate_variances, load_subject
from hilt.quant.allocate import allocate
from hilt.quant.sensitivity import estimate_tpv, loss_hessian_trace, parse_candidates
from hilt.progress import LOG

BUDGETS = (2.5, 3.0, 3.5, 4.25)
CANDIDATES = "kmeans1-4,int2-8,kmeans1-4@128,int2-8@128"
ALLOCATORS = ("uniform", "llama.cpp", "hawq", "tpv-blocks", "tpv")
DEFAULT_OUT = RESULTS / "mixed.json"


def promoted(name: str, n_layers: int) -> bool:
    """llama.cpp's use_more_bits for the tensors Q4_K_M promotes (attn_v, ffn_down and their BERT names)."""
    m = re.search(r"(?:^|\.)(?:blk|layer)\.(\d+)\.", name)
    if m is None or not re.search(r"attn_v\.|ffn_down\.|attention\.self\.value\.|\d+\.output\.dense\.", name):
        return False
    i, eighth = int(m[1]), n_layers // 8
    return i < eighth or i >= 7 * n_layers // 8 or (i - eighth) % 3 == 2


def _layers(names) -> int:
    return 1 + max(int(m[1]) for n in names if (m := re.search(r"(?:^|\.)(?:blk|layer)\.(\d+)\.", n)))


def allocations(variances: dict, tpv: dict, hawq: dict, budget: float, weights: dict) -> dict[str, dict[str, str]]:
    """Each allocator's format per tensor at ``budget`` bits/weight (None where it cannot meet it)."""
    names = list(variances)
    total = sum(weights.values())
    cap = budget * total
    bits = {n: {lab: v.bits for lab, v in variances[n].items()} for n in names}
    labels = [lab for lab in variances[names[0]] if all(lab in variances[n] for n in names)]
    out = {}
    fits = [lab for lab in labels if sum(bits[n][lab] for n in names) <= cap]
    if fits:
        best = max(fits, key=lambda lab: (sum(bits[n][lab] for n in names), lab.startswith("kmeans")))
        out["uniform"] = {n: best for n in names}
    else:
        out["uniform"] = None
    n_layers = _layers(names)
    pairs = []
    for base in labels:
        if not base.startswith("kmeans"):
            continue
        b, block = int(base[6]), base.split("@")[1]
        up_bits = min(b + 2, 8)
        up = f"{'kmeans' if up_bits <= 4 else 'int'}{up_bits}@{block}"
        if up not in labels:
            continue
        choice = {n: up if promoted(n, n_layers) else base for n in names}
        used = sum(bits[n][choice[n]] for n in names)
        if used <= cap:
            pairs.append((used, choice))
    out["llama.cpp"] = max(pairs, key=lambda p: p[0])[1] if pairs else None
    sq = {n: {lab: float(v.var.sum()) * v.block for lab, v in variances[n].items()} for n in names}
    costs = {
        "hawq": {n: {lab: max(hawq[n][0], 0.0) / weights[n] * sq[n][lab] for lab in variances[n]} for n in names},
        "tpv-blocks": {n: {lab: tpv[n].tpv[lab] for lab in variances[n]} for n in names},
        "tpv": {n: {lab: tpv[n].tpv_full[lab] for lab in variances[n]} for n in names},
    }
    for name, cost in costs.items():
        plan = allocate({n: {lab: (cost[n][lab], bits[n][lab]) for lab in variances[n]} for n in names}, cap)
        out[name] = plan.choice
    return out


class _Quality:
    """SmolLM2 perplexity on Hamlet, or MiniLM's mean cosine similarity to its fp32 embeddings."""

    def __init__(self, subject, quick: bool):
        self.subject = subject
        if subject.kind == "llama":
            from hilt.data.text import shakespeare_text

            self.ids = torch.tensor(subject.tokenizer.encode(shakespeare_text("hamlet"))[:1024 if quick else 2048])
            self.name, self.higher_is_better = "perplexity", False
        else:
            from hilt.data.text import sentences
            from hilt.models import bert

            self.sentences = sentences(64 if quick else 256)
            self.ref = bert.embed(subject.model, subject.tokenizer, self.sentences)
            self.name, self.higher_is_better = "cosine", True

    def __call__(self) -> float:
        s = self.subject
        if s.kind == "llama":
            from hilt.models import llama

            return llama.perplexity(s.model, self.ids, context=512)
        from hilt.models import bert

        return bert.embedding_similarity(self.ref, bert.embed(s.model, s.tokenizer, self.sentences))


def study(model: str, budgets=BUDGETS, quick: bool = False, candidates: str = CANDIDATES) -> dict:
    opts = {"smollm2": dict(tokens=1024), "minilm": dict(sentences=24)}[model] if quick else {}
    subject = load_subject(model, **opts)
    params = subject.params
    weights = {n: p.numel() for n, p in params.items()}
    t0 = time.perf_counter()
    variances = candidate_variances(subject, parse_candidates(candidates), keep_error=True)
    variances = {n: variances[n] for n in params}  # what the outputs never use is not in the comparison
    t1 = time.perf_counter()
    probes = 1 if quick else 2  # Hutchinson probes per calibration sample (TPV and HAWQ's traces)
    tpv = estimate_tpv(subject.model, subject.batches, params, variances, output=subject.output,
                       metric=subject.metric, probes=probes)
    t2 = time.perf_counter()
    if subject.kind == "llama":
        def loss(m, ids):
            return F.cross_entropy(m(ids)[0, :-1].float(), ids[0, 1:])
        hawq_batches = subject.batches
    else:
        with torch.no_grad():
            refs = [subject.output(subject.model, *b).detach() for b in subject.batches]
        hawq_batches = [(*b, r) for b, r in zip(subject.batches, refs)]

        def loss(m, ids, mask, ref):
            return 0.5 * (subject.output(m, ids, mask) - ref).square().sum(-1).mean()
    hawq = loss_hessian_trace(subject.model, hawq_batches, params, loss, probes=probes)
    t3 = time.perf_counter()
    LOG.info(f"{model}: candidates {t1 - t0:.0f} s, TPV {t2 - t1:.0f} s, loss-Hessian traces {t3 - t2:.0f} s")
    quality = _Quality(subject, quick)
    rows = [{"allocator": "unquantized", "budget": None, "bits_per_weight": 32.0, quality.name: quality()}]
    total = sum(weights.values())
    saved = {n: p.detach().clone() for n, p in params.items()}
    for budget in budgets:
        for allocator, choice in allocations(variances, tpv, hawq, budget, weights).items():
            if choice is None:
                rows.append({"allocator": allocator, "budget": budget, "bits_per_weight": None, quality.name: None})
                LOG.info(f"{model} {budget} {allocator}: no uniform choice meets the budget")
                continue
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(variances[n][choice[n]].qweight.dequantize().float().view_as(p))
            try:
                value = quality()
            finally:
                with torch.no_grad():
                    for n, p in params.items():
                        p.copy_(saved[n])
            used = sum(variances[n][choice[n]].bits for n in params) / total
            counts: dict[str, int] = {}
            for lab in choice.values():
                counts[lab] = counts.get(lab, 0) + 1
            rows.append({"allocator": allocator, "budget": budget, "bits_per_weight": used, quality.name: value,
                         "predicted_tpv": sum(tpv[n].tpv_full[choice[n]] for n in params), "formats": counts})
            LOG.info(f"{model} budget {budget}: {allocator:<10} {used:.4f} bits/weight, {quality.name} {value:.4f}")
    return {"model": subject.path, "kind": subject.kind, "quality": quality.name,
            "higher_is_better": quality.higher_is_better, "calibration": subject.calibration,
            "candidates": candidates, "probes": probes, "samples": len(subject.batches) * probes,
            "seconds": {"candidates": round(t1 - t0, 1), "tpv": round(t2 - t1, 1), "hawq": round(t3 - t2, 1)},
            "rows": rows}


def table(results: dict) -> str:
    lines = []
    for name, r in results["models"].items():
        q = r["quality"]
        lines += [f"**{name}** ({q}, {'higher' if r['higher_is_better'] else 'lower'} is better)", "",
                  "| budget | " + " | ".join(ALLOCATORS) + " |", "|---" * (len(ALLOCATORS) + 1) + "|"]
        for budget in sorted({x["budget"] for x in r["rows"] if x["budget"] is not None}):
            cells = []
            for a in ALLOCATORS:
                x = next((x for x in r["rows"] if x["budget"] == budget and x["allocator"] == a), None)
                cells.append("—" if x is None or x[q] is None else f"{x[q]:.4g} ({x['bits_per_weight']:.2f} b)")
            lines.append(f"| {budget} | " + " | ".join(cells) + " |")
        base = next(x for x in r["rows"] if x["allocator"] == "unquantized")
        lines += ["", f"unquantized: {base[q]:.4g}", ""]
    return "\n".join(lines)


def plot(results: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.2), squeeze=False)
    for ax, name in zip(axes[0], models):
        r = results["models"][name]
        q = r["quality"]
        for a in ALLOCATORS:
            pts = sorted((x["bits_per_weight"], x[q]) for x in r["rows"] if x["allocator"] == a and x[q] is not None)
            if pts:
                ax.plot([p for p, _ in pts], [v for _, v in pts], marker="o", label=a)
        if not r["higher_is_better"]:
            ax.set_yscale("log")
        ax.set_xlabel("bits per weight (codes + scales + codebooks)")
        ax.set_ylabel(q)
        ax.set_title(f"{name}: quality against bits", fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(out=None, quick: bool = False, models=("minilm", "smollm2"), budgets=BUDGETS,
        candidates: str = CANDIDATES) -> dict:
    results = {"quick": quick, "budgets": list(budgets), "models": {}}
    for m in models:
        results["models"][m] = study(m, budgets, quick=quick, candidates=candidates)
    results["table"] = table(results)
    if out is not None:
        out = Path(out)
        write_json(out, results)
        plot(results, out.with_suffix(".png"))
        write_text(out.with_suffix(".md"), results["table"] + "\n")
        LOG.info(f"wrote {out}, {out.with_suffix('.png')} and {out.with_suffix('.md')}")
    return results
