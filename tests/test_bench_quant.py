"""The quantization benchmarks' own parts, on small inputs (the full runs live in `hilt bench`/`hilt report`)."""

import torch

from hilt.bench.perf.quantize_speed import memory, reference_kmeans
from hilt.bench.studies.quant_table import _verdicts, markdown
from hilt.quant.kmeans import SortedValues, kmeans_optimal


def test_reference_procedure_is_a_real_kmeans_and_optimal_is_not_worse():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20_000, generator=g) * torch.rand(20_000, generator=g)
    c, iters = reference_kmeans(x, 8, generator=torch.Generator().manual_seed(1))
    assert iters > 1 and torch.all(c[1:] >= c[:-1])
    sv = SortedValues(x)
    ref_cost = sv.cost(c)
    # a converged Lloyd: one more update barely moves it
    assert sv.cost(sv.lloyd(c, tol=0, max_iter=1)[0]) <= ref_cost
    assert kmeans_optimal(sv, 8).cost <= ref_cost * (1 + 1e-12)


def test_memory_probe_runs_the_real_command():
    r = memory(0.07, log=lambda *_: None)  # one 4096x4096 tensor
    assert r["tensors"] == 1 and r["checkpoint_bytes"] > 6e7
    assert 6e7 < r["peak_rss_bytes"] < 4e9


def test_verdicts_and_markdown_report_losses_too():
    rows = [{"method": "fp32", "bits": 32, "smollm2_bits_per_weight": 32, "smollm2_perplexity": 20.0,
             "minilm_bits_per_weight": 32, "minilm_cosine": 1.0}]
    for label, ppl, cos in (("kmeans", 30.0, 0.9), ("int", 25.0, 0.8)):
        rows.append({"method": label, "bits": 3, "smollm2_bits_per_weight": 3.25, "smollm2_perplexity": ppl,
                     "minilm_bits_per_weight": 3.25, "minilm_cosine": cos})
    v = _verdicts(rows)
    assert v == [{"bits": 3, "kmeans": "kmeans", "baseline": "int", "perplexity": False, "embedding": True}]
    md = markdown({"rows": rows, "kmeans_beats_int": v, "tokens": 8, "text": "t", "context": 4, "sentences": 2,
                   "block_size": 64, "note": "n"})
    assert "does NOT beat int" in md and "| kmeans | 3 | 3.250 | 30.00 |" in md
