"""1-D weighted k-means: a fast Lloyd and a globally optimal solver.

Both work on a flat tensor of values ``x`` with optional non-negative
importance ``weights`` and minimise  sum_i w_i (x_i - c[a_i])^2.

* :func:`kmeans_lloyd`: k-means++ initialisation, then Lloyd iterations until
  at most ``tol`` of the assignments change (the published procedure). The
  values are sorted once; then each iteration is O(k log n): the points
  nearest a centroid are a contiguous run found by binary search of the
  midpoints, and the run's sums come from prefix sums. No n x k distances.
* :func:`kmeans_optimal`: in one dimension an optimal clustering is a set of
  contiguous ranges of the sorted values, so dynamic programming finds the
  global optimum (Wang & Song's Ckmeans.1d.dp idea). The DP runs on weighted
  distinct values when there are at most ``max_exact`` of them (exact), or
  else on a ``bins``-bin histogram that keeps each bin's count, sum and sum of
  squares, so the cost of any run of bins is the exact cost of its points.
  The histogram solution is then polished by Lloyd (which never raises the
  cost) and comes with a certified bound: it is within
  ``2 * h * (max - min) * max_bin_weight`` of the optimum, h the bin width
  (moving each optimal boundary to a bin edge moves at most one bin's points
  to a neighbouring centroid, each at a cost of at most 2 * h * gap).

The DP step  D_j[i] = min_m D_{j-1}[m] + cost(m, i)  has a monotone argmin, so
each step is solved by divide and conquer, processed level by level with
tensor ops: O(k * m log m) for m points, no Python loop over points.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_CHUNK = 1 << 22  # values per chunk when building prefix sums: bounds temporary memory

@dataclass
class KMeansResult:
    centroids: torch.Tensor  # (k,) float64, sorted ascending
    cost: float  # weighted sum of squared errors of the points to their nearest centroid
    iterations: int  # Lloyd iterations run (0 for an exact DP solution)
    gap_bound: float  # certified: cost - optimal cost <= gap_bound (inf when unknown)


class SortedValues:
    """Values sorted once, with prefix sums of w, w*x and w*x^2 available at any index.

    After the one sort, every k-means step is O(k log n): the points nearest
    to a centroid form a contiguous run, found by binary search of the
    midpoints, and a run's weight, sum and squared error come from the prefix
    sums. Prefix sums are stored in float64 only at every ``GROUP``-th index
    (plus the sorted float32 values), and completed on demand from at most
    ``GROUP - 1`` values: memory stays near one copy of the tensor.
    """

    GROUP = 64

    def __init__(self, x: torch.Tensor, weights: torch.Tensor | None = None, overwrite: bool = False):
        """``overwrite``: the caller gives ``x`` up, and unweighted values are sorted in its storage."""
        if weights is not None:  # same shape as x, or broadcastable to it
            weights = torch.broadcast_to(weights.float(), x.shape).reshape(-1)
        x = x.reshape(-1).float()
        if weights is None:
            if overwrite and x.is_contiguous():
                x.numpy().sort()  # np.sort's own algorithm, without its copy
                self.x = x
            else:
                self.x = torch.from_numpy(np.sort(x.numpy()))  # no index array: saves 8 bytes per value
            self.w = None
        else:
            order = torch.argsort(x)
            self.x, self.w = x[order], weights[order]
            if bool((self.w < 0).any()):
                raise ValueError("importance weights must be non-negative")
        self.n = self.x.numel()
        # unweighted, the weight before index i is i itself (``weight``): no prefix sums of ones
        self._coarse = [None if kind == 0 and self.w is None else self._coarse_prefix(kind) for kind in range(3)]

    def _terms(self, start: int, stop: int, kind: int) -> torch.Tensor:
        """float64 w, w*x or w*x^2 (kind 0, 1, 2) of the sorted values [start, stop)."""
        x = self.x[start:stop].double()
        t = torch.ones_like(x) if kind == 0 else x if kind == 1 else x * x
        return t if self.w is None else t * self.w[start:stop].double()

    def _coarse_prefix(self, kind: int) -> torch.Tensor:
        """Prefix sums at indices 0, G, 2G, ... (chunked: bounded temporary memory)."""
        G, sums = self.GROUP, [torch.zeros(1, dtype=torch.float64)]
        full = self.n // G * G
        for start in range(0, full, _CHUNK):
            stop = min(start + _CHUNK, full)
            sums.append(self._terms(start, stop, kind).view(-1, G).sum(1))
        return torch.cat(sums).cumsum(0)

    def prefix(self, idx: torch.Tensor, kind: int) -> torch.Tensor:
        """sum over t < i of the kind-th term, for every i in ``idx`` (0 <= i <= n)."""
        G = self.GROUP
        base = idx // G
        pos = base[:, None] * G + torch.arange(G)[None, :]
        inside = pos < idx[:, None]
        pos = pos.clamp_max(self.n - 1)
        x = self.x[pos].double()
        t = torch.ones_like(x) if kind == 0 else x if kind == 1 else x * x
        if self.w is not None:
            t = t * self.w[pos].double()
        return self._coarse[kind][base] + (t * inside).sum(1)

    def weight(self, idx: torch.Tensor) -> torch.Tensor:
        return idx.double() if self.w is None else self.prefix(idx, 0)

    def squares_before(self, idx: torch.Tensor) -> torch.Tensor:
        return self.prefix(idx, 2)

    def boundaries(self, centroids: torch.Tensor) -> torch.Tensor:
        """(k + 1,) indices: points [b[j], b[j+1]) are nearest to centroid j (sorted)."""
        mids = ((centroids[1:] + centroids[:-1]) / 2).float()
        inner = torch.searchsorted(self.x, mids)
        return torch.cat([torch.zeros(1, dtype=torch.int64), inner, torch.tensor([self.n])])

    def cost(self, centroids: torch.Tensor) -> float:
        c = centroids.double().sort().values
        b = self.boundaries(c)
        w = self.weight(b).diff()
        s = self.prefix(b, 1).diff()
        q = self.squares_before(b).diff()
        return float((q - 2 * c * s + c * c * w).clamp_min(0).sum())

    def lloyd(self, centroids: torch.Tensor, tol: float = 1e-4, max_iter: int = 1000):
        """Lloyd from ``centroids`` until at most tol * n assignments change. Returns (centroids, iters)."""
        c = centroids.double().sort().values
        b = self.boundaries(c)
        it = 0
        for it in range(1, max_iter + 1):
            w = self.weight(b).diff()
            s = self.prefix(b, 1).diff()
            c = torch.where(w > 0, s / w.clamp_min(1e-300), c)  # an empty cluster keeps its centroid
            c = c.sort().values
            nb = self.boundaries(c)
            changed = int((nb - b).abs().sum())  # points that crossed a boundary
            b = nb
            if changed <= tol * self.n:
                break
        return c, it


def clustering_cost(x: torch.Tensor, centroids: torch.Tensor, weights: torch.Tensor | None = None) -> float:
    """Weighted SSE of ``x`` to its nearest centroid."""
    return SortedValues(x, weights).cost(centroids)


def assign(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Index of the nearest centroid (centroids sorted ascending) for each value."""
    mids = ((centroids[1:] + centroids[:-1]) / 2).to(x.dtype)
    return torch.bucketize(x, mids)


def kmeans_plusplus(sv: SortedValues, k: int, generator=None) -> torch.Tensor:
    """k-means++ seeding (D^2 sampling, weighted) on sorted values. Returns k sorted centroids."""
    x = sv.x.double()
    w = torch.ones_like(x) if sv.w is None else sv.w.double()

    def draw(p):  # inverse-CDF sampling: no 2**24 category limit, seeded by ``generator``
        cdf = p.cumsum(0)
        u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
        return int(torch.searchsorted(cdf, u).clamp_max(x.numel() - 1))

    i = draw(w)
    centers = [float(x[i])]
    d2 = (x - x[i]) ** 2
    for _ in range(1, k):
        p = d2 * w
        if float(p.sum()) <= 0:  # fewer distinct values than k: repeat a centre
            centers.append(centers[-1])
            continue
        i = draw(p)
        centers.append(float(x[i]))
        d2 = torch.minimum(d2, (x - x[i]) ** 2)
    return torch.tensor(sorted(centers), dtype=torch.float64)


def kmeans_lloyd(x, k, weights=None, tol=1e-4, max_iter=1000, generator=None, init=None) -> KMeansResult:
    """k-means++ (or ``init``) then Lloyd until at most ``tol`` of assignments change."""
    sv = x if isinstance(x, SortedValues) else SortedValues(x, weights)
    c0 = kmeans_plusplus(sv, k, generator) if init is None else init.double().sort().values
    c, iters = sv.lloyd(c0, tol, max_iter)
    return KMeansResult(c, sv.cost(c), iters, float("inf"))


# ---------------------------------------------------------------- optimal DP


def _range_cost(W, S, Q, a, b):
    """Exact SSE of the points in prefix range [a, b) (index arrays; numpy float64)."""
    wt, st, qt = W[b] - W[a], S[b] - S[a], Q[b] - Q[a]
    with np.errstate(divide="ignore", invalid="ignore"):
        c = qt - st * st / wt
    return np.where(wt > 0, np.maximum(c, 0.0), 0.0)


def _monotone_argmin(D, W, S, Q, j, m):
    """For i in [j, m]: argmin over t in [j-1, i-1] of D[t] + cost(t, i), by level-wise D&C.

    numpy rather than torch here: the arrays are small (<= bins) and the cost
    is per-op overhead, which numpy keeps low.
    """
    opt = np.empty(m - j + 1, dtype=np.int64)
    ilo, ihi = np.array([j]), np.array([m])
    olo, ohi = np.array([j - 1]), np.array([m - 1])
    while ilo.size:
        mid = (ilo + ihi) // 2
        cnt = np.minimum(ohi, mid - 1) - olo + 1
        start = np.cumsum(cnt) - cnt
        seg = np.repeat(np.arange(mid.size), cnt)
        cand = olo[seg] + np.arange(seg.size) - start[seg]
        val = D[cand] + _range_cost(W, S, Q, cand, mid[seg])
        best_val = np.minimum.reduceat(val, start)
        best = np.minimum.reduceat(np.where(val <= best_val[seg], cand, np.iinfo(np.int64).max), start)
        opt[mid - j] = best
        left, right = ilo <= mid - 1, mid + 1 <= ihi
        ilo, ihi, olo, ohi = (
            np.concatenate([ilo[left], (mid + 1)[right]]),
            np.concatenate([(mid - 1)[left], ihi[right]]),
            np.concatenate([olo[left], best[right]]),
            np.concatenate([best[left], ohi[right]]),
        )
    return opt


def optimal_partition(W, S, Q, k):
    """Optimal split of m weighted points (given as prefix sums, length m + 1) into k ranges.

    Returns (boundaries: (k + 1,) int64 tensor from 0 to m, cost). Requires k <= m.
    """
    W, S, Q = (t.numpy() for t in (W, S, Q))
    m = W.size - 1
    idx = np.arange(m + 1)
    D = _range_cost(W, S, Q, np.zeros_like(idx), idx)
    choices = []
    for j in range(2, k + 1):
        opt = _monotone_argmin(D, W, S, Q, j, m)
        Dn = np.full_like(D, np.inf)
        Dn[j:] = D[opt] + _range_cost(W, S, Q, opt, idx[j:])
        choices.append(opt)
        D = Dn
    bounds = [m]
    for j in range(k, 1, -1):
        bounds.append(int(choices[j - 2][bounds[-1] - j]))
    bounds.append(0)
    return torch.tensor(bounds[::-1]), float(D[m])


def _centroids_from(W, S, bounds):
    a, b = bounds[:-1], bounds[1:]
    return (S[b] - S[a]) / (W[b] - W[a])


def _pad_centroids(c: torch.Tensor, k: int) -> torch.Tensor:
    """Fewer distinct values than k: repeat the largest level (those codes go unused)."""
    if c.numel() >= k:
        return c
    return torch.cat([c, c[-1:].expand(k - c.numel())])


def kmeans_optimal(x, k, weights=None, bins=8192, max_exact=1 << 14, tol=0.0, max_iter=1000) -> KMeansResult:
    """Globally optimal 1-D k-means: exact, or certified within ``gap_bound`` (see module doc)."""
    sv = x if isinstance(x, SortedValues) else SortedValues(x, weights)
    if sv.n == 0:
        raise ValueError("k-means of an empty tensor")
    lo, hi = float(sv.x[0]), float(sv.x[-1])
    if sv.n <= max_exact:  # DP over the distinct values: exact
        change = torch.ones(sv.n, dtype=torch.bool)
        change[1:] = sv.x[1:] != sv.x[:-1]
        edges = torch.cat([change.nonzero().squeeze(1), torch.tensor([sv.n])])
        h = 0.0
    else:  # DP over histogram bins; each bin's prefix sums keep range costs exact
        h = (hi - lo) / bins
        inner = torch.searchsorted(sv.x, lo + h * torch.arange(1, bins, dtype=torch.float64).float())
        edges = torch.cat([torch.zeros(1, dtype=torch.int64), inner, torch.tensor([sv.n])]).unique_consecutive()
    W, S, Q = sv.weight(edges), sv.prefix(edges, 1), sv.squares_before(edges)
    keep = torch.cat([torch.tensor([True]), W[1:] > W[:-1]])  # drop zero-weight bins
    W, S, Q, edges = W[keep], S[keep], Q[keep], edges[keep]
    m = W.numel() - 1
    kk = min(k, m)
    bounds, dp_cost = optimal_partition(W, S, Q, kk)
    c = _pad_centroids(_centroids_from(W, S, bounds), k)
    if h == 0.0:
        return KMeansResult(c, sv.cost(c), 0, 0.0)
    c, iters = sv.lloyd(c, tol, max_iter)  # polish on the points to a fixed point: never raises the cost
    cost = sv.cost(c)
    bound = 2.0 * h * (hi - lo) * float((W[1:] - W[:-1]).max())
    return KMeansResult(c, cost, iters, max(0.0, cost - (dp_cost - bound)))


def kmeans_optimal_batched(x: torch.Tensor, k: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Exact optimal k-means of each row of ``x`` (batch, n): dense O(k n^2) DP per row.

    Made for many small problems at once (one codebook per block of 32-256
    values). Returns sorted centroids (batch, k) float64; rows with fewer than
    k distinct values repeat their largest level.
    """
    batch, n = x.shape
    order = x.double().sort(dim=1)
    xs = order.values
    ws = torch.ones_like(xs) if weights is None else torch.gather(weights.double().expand_as(x), 1, order.indices)
    z = torch.zeros(batch, 1, dtype=torch.float64)
    W = torch.cat([z, ws.cumsum(1)], 1)
    S = torch.cat([z, (ws * xs).cumsum(1)], 1)
    Q = torch.cat([z, (ws * xs * xs).cumsum(1)], 1)
    # C[:, a, b]: cost of points [a, b); +inf unless a < b (clusters are non-empty)
    wt = W[:, None, :] - W[:, :, None]
    st = S[:, None, :] - S[:, :, None]
    qt = Q[:, None, :] - Q[:, :, None]
    C = (qt - st * st / wt.clamp_min(1e-300)).clamp_min(0)
    valid = torch.ones(n + 1, n + 1, dtype=torch.bool).triu(1)
    C = torch.where(valid, C, torch.full_like(C, float("inf")))
    kk = min(k, n)
    D = C[:, 0, :]  # D_1[i]: first i points in one cluster
    choices = []
    for _ in range(2, kk + 1):
        best = (D[:, :, None] + C).min(dim=1)
        choices.append(best.indices)
        D = best.values
    # backtrack boundaries; a row with fewer distinct values gets zero-width duplicates
    b = torch.full((batch,), n, dtype=torch.int64)
    bounds = [b]
    for ch in reversed(choices):
        b = torch.gather(ch, 1, b[:, None]).squeeze(1)
        bounds.append(b)
    bounds.append(torch.zeros(batch, dtype=torch.int64))
    bounds = torch.stack(bounds[::-1], 1)
    a, e = bounds[:, :-1], bounds[:, 1:]
    wsum = torch.gather(W, 1, e) - torch.gather(W, 1, a)
    ssum = torch.gather(S, 1, e) - torch.gather(S, 1, a)
    c = torch.where(wsum > 0, ssum / wsum.clamp_min(1e-300), torch.gather(xs, 1, (e - 1).clamp_min(0)))
    c = c.sort(dim=1).values
    if kk < k:
        c = torch.cat([c, c[:, -1:].expand(batch, k - kk)], 1)
    return c
