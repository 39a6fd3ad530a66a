import itertools

import pytest
import torch

from hilt.quant.kmeans import (SortedValues, clustering_cost, kmeans_lloyd, kmeans_optimal,
                          kmeans_optimal_batched)


def brute_force(x: torch.Tensor, k: int, w: torch.Tensor | None = None) -> float:
    """Optimal cost by trying every split of the sorted values into k contiguous groups."""
    order = x.double().argsort()
    xs = x.double()[order]
    ws = torch.ones_like(xs) if w is None else w.double()[order]
    n, best = len(xs), float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = [0, *cuts, n]
        total = 0.0
        for a, e in zip(b[:-1], b[1:]):
            seg, sw = xs[a:e], ws[a:e]
            mean = (seg * sw).sum() / sw.sum()
            total += float((sw * (seg - mean) ** 2).sum())
        best = min(best, total)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_optimal_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(4, 13, (1,), generator=g))
    k = int(torch.randint(2, 5, (1,), generator=g))
    x = torch.randn(n, generator=g) ** 3  # skewed, heavy-tailed
    w = torch.rand(n, generator=g) + 0.1 if seed % 2 else None
    r = kmeans_optimal(x, k, w)
    assert r.gap_bound == 0.0
    assert r.cost == pytest.approx(brute_force(x, k, w), rel=1e-9, abs=1e-12)
    assert torch.all(r.centroids[1:] >= r.centroids[:-1])


def test_optimal_on_real_weights_matches_brute_force(minilm_dir):
    from hilt.quant import open_source

    with open_source(minilm_dir) as src:
        w = src.get("encoder.layer.0.attention.self.query.weight")
    x = w.flatten()[::9973][:12]  # a real slice, small enough to enumerate
    r = kmeans_optimal(x, 3)
    assert r.cost == pytest.approx(brute_force(x, 3), rel=1e-9)


def _real_tensors(minilm_dir):
    from hilt.quant import open_source

    with open_source(minilm_dir) as src:
        return [src.get(n) for n in ("encoder.layer.0.attention.self.query.weight",
                                     "encoder.layer.3.intermediate.dense.weight")]


@pytest.mark.parametrize("k", [2, 4, 8, 16])
def test_optimal_never_worse_than_lloyd(k, minilm_dir):
    g = torch.Generator().manual_seed(k)
    tensors = [torch.randn(50_000, generator=g) * torch.rand(50_000, generator=g),
               torch.randn(3000, generator=g)] + _real_tensors(minilm_dir)
    for x in tensors:
        sv = SortedValues(x)
        opt = kmeans_optimal(sv, k)
        for seed in range(3):
            lloyd = kmeans_lloyd(sv, k, generator=torch.Generator().manual_seed(seed))
            assert opt.cost <= lloyd.cost * (1 + 1e-12), (x.numel(), k, opt.cost, lloyd.cost)


def test_histogram_bound_is_certified():
    """The histogram solver's cost minus its bound never exceeds the exact optimum."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12_000, generator=g) * torch.rand(12_000, generator=g)
    exact = kmeans_optimal(x, 8, max_exact=1 << 20)
    approx = kmeans_optimal(x, 8, bins=256, max_exact=0)
    assert exact.gap_bound == 0.0
    assert approx.cost >= exact.cost * (1 - 1e-12)
    assert approx.cost - approx.gap_bound <= exact.cost * (1 + 1e-12)


def test_cost_matches_direct_computation():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(1000, generator=g), torch.rand(1000, generator=g)
    c = torch.tensor([-1.0, 0.1, 0.9], dtype=torch.float64)
    direct = (w.double() * (x.double()[:, None] - c[None]).pow(2).min(1).values).sum()
    assert clustering_cost(x, c, w) == pytest.approx(float(direct), rel=1e-9)


def test_lloyd_reproducible_by_seed():
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(3))
    a = kmeans_lloyd(x, 8, generator=torch.Generator().manual_seed(7)).centroids
    b = kmeans_lloyd(x, 8, generator=torch.Generator().manual_seed(7)).centroids
    assert torch.equal(a, b)


def test_batched_matches_single():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(20, 64, generator=g)
    x[3] = 0.5  # a block with one distinct value
    batched = kmeans_optimal_batched(x, 4)
    for row in range(20):
        single = kmeans_optimal(x[row], 4)
        assert clustering_cost(x[row], batched[row]) == pytest.approx(single.cost, rel=1e-9, abs=1e-12)
