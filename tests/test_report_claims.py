"""The report's headline block: every verdict is computed from the sections' JSON, a claim the numbers contradict
reads "does not hold", one this run did not measure says so, and no decode row from a random model is a result."""

import copy
import json

import pytest

from hilt.bench import claims, report
from hilt.errors import HiltError


def _stats(mean, worst=None):
    return {"mean": mean, "std": 0.0, "worst": mean if worst is None else worst, "all": [mean]}


def _quant_row(method, bits, ppl, cos=0.9):
    return {"method": method, "bits": bits, "smollm2_perplexity": ppl, "minilm_cosine": cos}


# every section's JSON, in the shapes the report writes, with numbers where every claim holds
RESULTS = {
    "quant_table": {"rows": [_quant_row("fp32", 32, 17.6, 1.0)]
                    + [_quant_row(m, b, ppl) for b, base in ((4, 25.0), (3, 300.0), (2, 3e6))
                       for m, ppl in (("int", base), ("gptq-int", base * 0.8), ("gptq-kmeans", base * 0.5),
                                      ("kmeans", base * 0.9))]},
    "decode": {"model": "SmolLM2-135M-Instruct", "rows": [
        {"model": "dense bf16", "tokens_per_second": 40.0},
        {"model": "hilt int4 (block 64)", "tokens_per_second": 70.0},
        {"model": "hilt k-means 4 (block 64)", "tokens_per_second": 69.0},
        {"model": "llama.cpp llama-bench (Q4_0, Q8_0 exports)", "tokens_per_second": None, "note": "not built"}]},
    "lut_kernels": {"check": {"cases": 332, "failures": []}, "decode": {"4bit": {"same": True}, "1bit": {"same": True}}},
    "fp8-scales-smollm2": [{"max_observed_over_bound": 0.4, "exceeded": False}],
    "fp8-scales-minilm": [{"max_observed_over_bound": 0.2, "exceeded": False}],
    "fp8-attention": {"float32_perplexity": 17.6, "rows": [
        {"variant": "fp8", "perplexity": 17.7, "perplexity_change_pct": 0.56},
        {"variant": "fp8 geometry scales", "perplexity": 17.75, "perplexity_change_pct": 0.83}]},
    "drift": {"digital_accuracy": 0.908, "repeats": 2, "rows": [
        {"gdc": "none", "time": "1y", "mean": 0.79}, {"gdc": "global", "time": "1y", "mean": 0.83}]},
    "robustness": {"etas": [0.0, 0.7], "methods": {
        m: {"mismatch": [{"eta": 0.0, "mean": 0.91, "worst": 0.91}, {"eta": 0.7, "mean": acc, "worst": acc - 0.1}]}
        for m, acc in (("standard", 0.74), ("dwp", 0.87))}},
    "energy-dwp": {"cim_joules": 113e-9, "gpu_joules": 5865e-9, "cim_over_gpu": 0.019,
                   "chip": {"name": "rram-22nm"}, "gpu": {"name": "H200"}},
    "cim_lm": {"budget": {"times": ["1s", "1y"], "chips": 2}, "models": {"smollm2": {"variants": {
        "as trained": {"digital": {"float": 18.5, "w4": 28.5, "w4a8": 108.0},
                       "chips": {"pcm": {"times": {"1s": _stats(70.0), "1y": _stats(30.0, 32.0)}}}}}}}},
}


def _lines(results):
    return {v.claim: v for v in claims.headline(results)}


def test_every_claim_holds_on_numbers_that_support_it_and_each_reads_its_own_file():
    verdicts = claims.headline(RESULTS)
    assert len(verdicts) == len(claims.CLAIMS) and all(v.holds is True for v in verdicts), \
        [v.line() for v in verdicts if not v.holds]
    md = claims.markdown(verdicts)
    assert f"({len(verdicts)} of {len(verdicts)} measured hold" in md and "does not hold" not in md
    # remove one file at a time: exactly the claims that read it are "not measured", the others still hold
    for name in claims.INPUTS:
        partial = {k: v for k, v in RESULTS.items() if k != name}
        missing = [v for v in claims.headline(partial) if v.measured is None]
        assert missing, f"no claim reads {name}"
        assert all("not measured in this run" in v.line() for v in missing)
        assert all(v.holds for v in claims.headline(partial) if v.measured is not None)


@pytest.mark.parametrize("name,change,claim_start", [
    ("quant_table", lambda r: next(x for x in r["rows"] if x["method"] == "gptq-kmeans" and x["bits"] == 3).update(
        smollm2_perplexity=241.0), "compensated k-means 3-bit"),
    ("decode", lambda r: r["rows"][2].update(tokens_per_second=60.0), "k-means 4-bit decodes at int4's speed"),
    ("decode", lambda r: r["rows"][0].update(tokens_per_second=69.5), "k-means 4-bit decodes faster"),
    ("lut_kernels", lambda r: r["check"]["failures"].append({"case": 1}), "the LUT kernels"),
    ("fp8-scales-minilm", lambda r: r[0].update(exceeded=True), "FP8 attention-logit bounds"),
    ("fp8-attention", lambda r: r["rows"][1].update(perplexity_change_pct=-1.01), "FP8 attention with scales"),
    ("drift", lambda r: r["rows"][1].update(mean=0.79), "global drift compensation"),
    ("robustness", lambda r: r["methods"]["dwp"]["mismatch"][1].update(mean=0.74), "DWP training"),
    ("energy-dwp", lambda r: r.update(cim_over_gpu=1.0), "a CIM chip"),
    ("cim_lm", lambda r: r["models"]["smollm2"]["variants"]["as trained"]["chips"]["pcm"]["times"]["1y"].update(
        mean=28.5 * 1.15 + 0.01), "SmolLM2 on the `pcm` chip"),
])
def test_a_claim_the_numbers_contradict_reads_does_not_hold(name, change, claim_start):
    results = copy.deepcopy(RESULTS)
    change(results[name])
    failed = [v for v in claims.headline(results) if v.holds is False]
    assert [v.claim[:len(claim_start)] for v in failed] == [claim_start]
    assert failed[0].line().endswith("(**does not hold**)")


def test_the_bounds_hold_at_their_edge():
    """At the stated limits a claim still holds (k-means at exactly 90% of int4, the FP8 cost at exactly 1%, the
    chip at exactly 1.15x W4): a wrong constant or comparison fails here."""
    results = copy.deepcopy(RESULTS)
    results["decode"]["rows"][2]["tokens_per_second"] = 63.0  # 0.9 x 70
    results["fp8-attention"]["rows"][1]["perplexity_change_pct"] = 1.0
    results["cim_lm"]["models"]["smollm2"]["variants"]["as trained"]["chips"]["pcm"]["times"]["1y"]["mean"] = 28.5 * 1.15
    assert all(v.holds for v in claims.headline(results))


def test_the_headline_is_read_back_from_the_report_folder(tmp_path):
    for name, data in RESULTS.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    (tmp_path / "quant_table.json").write_text(json.dumps({"rows": [_quant_row("gptq-kmeans", 3, 400.0),
                                                                    _quant_row("int", 3, 300.0)]}))
    lines = claims.markdown(claims.headline(claims.load(tmp_path))).splitlines()
    assert any(line.startswith("- compensated k-means 3-bit") and "400.00 vs 300.00 (int)" in line
               and line.endswith("(**does not hold**)") for line in lines)
    assert any(line.startswith("- compensated k-means 4-bit") and line.endswith("not measured in this run")
               for line in lines)


def test_decode_timings_of_a_random_model_are_never_a_result(tmp_path, monkeypatch):
    """The report's decode section runs SmolLM2 itself (never the benchmark's random --quick model), refuses a
    result that is not SmolLM2's, and the headline does not count a random model's rows."""
    from hilt.bench.perf import decode_speed

    asked = {}

    def fake_run(**kwargs):
        asked.update(kwargs)
        return {"model": "tiny random Llama (quick)", "rows": [], "table": ""}

    monkeypatch.setattr(decode_speed, "run", fake_run)
    with pytest.raises(HiltError, match="not SmolLM2"):
        report.decode_section(tmp_path, quick=True)
    assert asked["model"] == "smollm2" and not asked.get("quick")
    assert set(asked["formats"]) == {"hilt int4 (block 64)", "hilt k-means 4 (block 64)"}
    assert not (tmp_path / "decode.json").exists()
    results = copy.deepcopy(RESULTS)
    results["decode"]["model"] = "tiny random Llama (quick)"
    assert [v.measured for v in claims.headline(results) if v.claim.startswith("k-means 4-bit")] == [None, None]


def test_without_aihwkit_the_peer_section_shows_the_committed_run_labelled_as_such():
    md = report.peers_committed()
    assert md.startswith("aihwkit is not installed here") and "**Not from this run**" in md
    assert "| 1y |" in md and "aihwkit 1.2.0" in md


def test_a_report_folder_that_cannot_be_written_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    from hilt.bench.studies import quant_table
    from hilt.cli import main

    monkeypatch.setattr(quant_table, "run", lambda **kw: pytest.fail("the report started its work"))
    (tmp_path / "file").write_text("x")
    for out, needle in ((tmp_path / "file", "is a file"), (tmp_path / "file" / "sub", "is a file"),
                        (tmp_path / "gone" / "sub", "does not exist")):
        assert main(["report", "--out", str(out)]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err and str(out) in err, err
