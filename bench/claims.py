"""The report's headline: hilt's claims, each checked against what this run measured.

Every claim reads the JSON files the report's sections wrote (:func:`load`) and gives one line: the
claim, the numbers this run measured, and a verdict computed from them (holds / does not hold in this
run). A claim whose numbers this run did not produce (its section failed, or the row is not in the
budget) says so: nothing is carried over from an earlier run or written by hand.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hilt.bench.studies import analog_lm, fp8_accuracy

# the section files the claims read (OUT/<name>.json); the report removes them before its sections run
INPUTS = ("quant_table", "decode", "lut_kernels", "fp8-scales-smollm2", "fp8-scales-minilm", "fp8-attention",
          "drift", "robustness", "energy-dwp", "cim_lm")
SAME_SPEED = 0.9  # k-means 4-bit "at int4's speed": at least this share of int4's tokens/s
FP8_COST_PCT = fp8_accuracy.TARGET_PCT  # FP8 attention with scales from the weights: at most this perplexity change
LM_CHIP_GOAL = analog_lm.GOALS["ppl_mean_over_w4"]  # a language model on the chip at a year, against its W4


@dataclass(frozen=True)
class Verdict:
    claim: str
    measured: str | None = None  # None: this run did not measure it
    holds: bool | None = None

    def line(self) -> str:
        if self.measured is None:
            return f"- {self.claim}: not measured in this run"
        return f"- {self.claim}: {self.measured} (**{'holds' if self.holds else 'does not hold'}**)"


def load(out) -> dict:
    """{name: parsed JSON} of the INPUTS present in ``out``."""
    results = {}
    for name in INPUTS:
        path = Path(out) / f"{name}.json"
        if path.is_file():
            results[name] = json.loads(path.read_text())
    return results


def _quant_row(results, method: str, bits: int) -> dict:
    return next(r for r in results["quant_table"]["rows"] if r["method"] == method and r["bits"] == bits)


def _compensated_kmeans(bits: int):
    claim = f"compensated k-means {bits}-bit beats the best integer {bits}-bit on SmolLM2 (perplexity)"

    def check(results):
        mine = _quant_row(results, "gptq-kmeans", bits)["smollm2_perplexity"]
        ints = {}
        for method in ("int", "gptq-int"):
            try:
                ints[method] = _quant_row(results, method, bits)["smollm2_perplexity"]
            except StopIteration:
                pass
        best = min(ints, key=ints.get)  # ValueError when neither ran: not measured
        return f"{mine:,.2f} vs {ints[best]:,.2f} ({best})", mine < ints[best]
    return claim, check


def _decode_rows(results) -> dict:
    decode = results["decode"]
    if "tiny" in decode["model"] or "random" in decode["model"]:
        raise LookupError("a random model's timings are no result")
    return {r["model"]: r for r in decode["rows"] if r.get("tokens_per_second")}


def _kmeans_at_int_speed(results):
    rows = _decode_rows(results)
    k, i = rows["hilt k-means 4 (block 64)"]["tokens_per_second"], rows["hilt int4 (block 64)"]["tokens_per_second"]
    return f"{k:.1f} vs {i:.1f} tokens/s ({k / i:.2f}x)", k >= SAME_SPEED * i


def _kmeans_beats_dense(results):
    rows = _decode_rows(results)
    k, d = rows["hilt k-means 4 (block 64)"]["tokens_per_second"], rows["dense bf16"]["tokens_per_second"]
    return f"{k:.1f} vs {d:.1f} tokens/s ({k / d:.2f}x)", k > d


def _kernels_agree(results):
    r = results["lut_kernels"]
    failures = len(r["check"]["failures"])
    same = [bits for bits in ("4bit", "1bit") if r["decode"][bits]["same"]]
    return (f"{r['check']['cases']} cases, {failures} failures; SmolLM2 decodes the same tokens at "
            f"{len(same)} of 2 widths"), failures == 0 and len(same) == 2


def _fp8_bound(results):
    rows = results["fp8-scales-smollm2"] + results["fp8-scales-minilm"]
    worst = max(r["max_observed_over_bound"] for r in rows)
    exceeded = sum(bool(r["exceeded"]) for r in rows)
    return f"largest observed logit {worst:.3f} of its bound over {len(rows)} layers, exceeded in {exceeded}", exceeded == 0


def _fp8_cost(results):
    acc = results["fp8-attention"]
    row = next(r for r in acc["rows"] if r["variant"] == "fp8 geometry scales")
    return (f"{row['perplexity_change_pct']:+.2f}% ({acc['float32_perplexity']:.2f} -> {row['perplexity']:.2f})",
            abs(row["perplexity_change_pct"]) <= FP8_COST_PCT)


def _drift_compensation(results):
    d = results["drift"]
    year = {r["gdc"]: r["mean"] for r in d["rows"] if r["time"] == "1y"}
    return (f"{year['global']:.4f} vs {year['none']:.4f} without (digital {d['digital_accuracy']:.4f}, "
            f"{d['repeats']} chips)"), year["global"] > year["none"]


def _dwp_robust(results):
    methods = results["robustness"]["methods"]
    eta = max(results["robustness"]["etas"])
    at = {m: next(r for r in methods[m]["mismatch"] if r["eta"] == eta) for m in ("standard", "dwp")}
    return (f"eta {eta}: {at['dwp']['mean']:.3f} vs {at['standard']['mean']:.3f} (worst draw "
            f"{at['dwp']['worst']:.3f} vs {at['standard']['worst']:.3f})"), at["dwp"]["mean"] > at["standard"]["mean"]


def _energy(results):
    e = results["energy-dwp"]
    return (f"{e['cim_joules'] * 1e9:.0f} nJ on {e['chip']['name']} vs {e['gpu_joules'] * 1e9:.0f} nJ on the "
            f"{e['gpu']['name']} ({e['cim_over_gpu']:.3f}x)"), e["cim_over_gpu"] < 1


def _lm_on_chip(results):
    r = results["cim_lm"]
    last, chips = r["budget"]["times"][-1], r["budget"]["chips"]
    variants = r["models"]["smollm2"]["variants"]
    year = {v: row["chips"]["pcm"]["times"][last] for v, row in variants.items()}
    best = min(year, key=lambda v: year[v]["mean"])
    w4 = variants["as trained"]["digital"]["w4"]
    mean = year[best]["mean"]
    return f"{mean:,.1f} ({best}) vs W4 {w4:.2f}: {mean / w4:.2f}x, {chips} chips", mean <= LM_CHIP_GOAL * w4


CLAIMS = [
    _compensated_kmeans(4), _compensated_kmeans(3), _compensated_kmeans(2),
    ("k-means 4-bit decodes at int4's speed on the CPU through from_pretrained (SmolLM2, at least "
     f"{SAME_SPEED:.0%})", _kmeans_at_int_speed),
    ("k-means 4-bit decodes faster than the dense bf16 model (SmolLM2, from_pretrained)", _kmeans_beats_dense),
    ("the LUT kernels agree with their PyTorch reference", _kernels_agree),
    ("FP8 attention-logit bounds from the weights alone are never exceeded on real text (SmolLM2, MiniLM)",
     _fp8_bound),
    (f"FP8 attention with scales from the weights costs SmolLM2 at most {FP8_COST_PCT:g}% perplexity", _fp8_cost),
    ("global drift compensation raises the CNN's accuracy on PCM a year after programming", _drift_compensation),
    ("DWP training holds accuracy under device mismatch better than standard training (CNN)", _dwp_robust),
    ("a CIM chip spends less energy per inference than a GPU (DWP-trained CNN, modelled)", _energy),
    (f"SmolLM2 on the `pcm` chip a year after programming stays within {LM_CHIP_GOAL}x of its W4 perplexity",
     _lm_on_chip),
]


def headline(results: dict) -> list[Verdict]:
    """Every claim's verdict on ``results`` (:func:`load`)."""
    verdicts = []
    for claim, check in CLAIMS:
        try:
            measured, holds = check(results)
        except (LookupError, StopIteration, ValueError):  # its numbers are not in this run
            verdicts.append(Verdict(claim))
            continue
        verdicts.append(Verdict(claim, measured, bool(holds)))
    return verdicts


def markdown(verdicts: list[Verdict]) -> str:
    held = sum(v.holds is True for v in verdicts)
    measured = sum(v.measured is not None for v in verdicts)
    return "\n".join([f"**Claims, checked by this run** ({held} of {measured} measured hold; each verdict is computed "
                      "from the sections' JSON below):", "", *(v.line() for v in verdicts)]) + "\n"
