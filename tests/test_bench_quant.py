"""The quantization benchmarks' own parts, on small inputs (the full runs live in `hilt bench`/`hilt report`)."""

import itertools

import pytest
import torch

from hilt.bench.perf.quantize_speed import memory, reference_kmeans
from hilt.bench.studies.quant_table import _verdicts, markdown
from hilt.quant.kmeans import SortedValues, kmeans_optimal


def test_reference_procedure_stops_at_a_lloyd_fixed_point():
    """Run until no assignment changes, the reference's centroids are each the mean of the points
    nearest to it (a procedure that skipped or botched the update step would not be)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3000, generator=g) * torch.rand(3000, generator=g)
    c, iters = reference_kmeans(x, 8, tol=0, generator=torch.Generator().manual_seed(1))
    assert 1 < iters < 1000 and torch.all(c[1:] > c[:-1])
    nearest = ((x.double()[:, None] - c[None, :]) ** 2).argmin(1)
    means = torch.zeros(8, dtype=torch.float64).index_add_(0, nearest, x.double()) / torch.bincount(nearest, minlength=8)
    torch.testing.assert_close(c, means, rtol=1e-6, atol=1e-7)  # the centroids are float32
    again, _ = SortedValues(x).lloyd(c, tol=0, max_iter=1)  # hilt's own Lloyd step leaves it there too
    torch.testing.assert_close(again, c, rtol=1e-6, atol=1e-7)


def test_optimal_kmeans_is_the_brute_force_optimum_and_the_reference_never_beats_it():
    # 1-D: an optimal clustering is a partition of the sorted values into runs, so trying every
    # split of 13 values into 4 runs finds the optimum
    x = torch.randn(13, generator=torch.Generator().manual_seed(2))
    xs = x.double().sort().values

    def sse(run):
        return float(((run - run.mean()) ** 2).sum())

    best = min(sum(sse(xs[a:b]) for a, b in zip((0, *cuts), (*cuts, 13)))
               for cuts in itertools.combinations(range(1, 13), 3))
    sv = SortedValues(x)
    assert kmeans_optimal(sv, 4).cost == pytest.approx(best, rel=1e-9, abs=1e-12)
    costs = [sv.cost(reference_kmeans(x, 4, tol=0, generator=torch.Generator().manual_seed(s))[0]) for s in range(8)]
    assert min(costs) >= best * (1 - 1e-9)  # never better than optimal, and here it finds the optimum
    assert min(costs) == pytest.approx(best, rel=1e-9)
    # on a larger input too: the certified optimum is never worse than the reference procedure
    g = torch.Generator().manual_seed(0)
    big = torch.randn(20_000, generator=g) * torch.rand(20_000, generator=g)
    c, _ = reference_kmeans(big, 8, generator=torch.Generator().manual_seed(1))
    assert kmeans_optimal(SortedValues(big), 8).cost <= SortedValues(big).cost(c) * (1 + 1e-12)


def test_memory_probe_runs_the_real_command():
    r = memory(0.07)  # one 4096x4096 tensor
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
    assert "3 bit, kmeans better than int? SmolLM2 perplexity: no; MiniLM cosine: yes" in md
    assert "| kmeans | 3 | 3.250 | 30.00 |" in md and "uniform guess" not in md
    # both above a uniform guess: no verdict on perplexity, and the capped rows named
    for r in rows[1:]:
        r["smollm2_perplexity"] *= 1e4
    v = _verdicts(rows, uniform=49152)
    assert v[0]["perplexity"] is None
    md = markdown({"rows": rows, "kmeans_beats_int": v, "tokens": 8, "text": "t", "context": 4, "sentences": 2,
                   "block_size": 64, "note": "n", "uniform_perplexity": 49152})
    assert "SmolLM2 perplexity: both above a uniform guess" in md and "kmeans 3, int 3, mean" in md
