"""One format per tensor under a bits budget: the multiple-choice knapsack.

Each tensor t has options o with a predicted cost c[t, o] (its TPV, hilt.quant.sensitivity) and
a storage size b[t, o] in bits (codes + scales + codebooks, counted as the checkpoint stores
them). Choose one option per tensor to minimise Σ c subject to Σ b <= budget.

Solved by a Lagrangian sweep: on each tensor's lower convex hull of (bits, cost), upgrades are
taken in order of cost saved per bit until the next one no longer fits. The cost there, less
the leftover budget times that upgrade's saving per bit, is the optimum of the linear relaxation,
a lower bound on every choice's cost (the certificate). The remaining budget is then filled with
the best-paying upgrades that still fit. ``Allocation.gap`` is the certified distance from the
optimum: the choice made is at most that far above it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hilt.errors import HiltError


@dataclass
class Allocation:
    choice: dict[str, str]  # tensor -> option
    cost: float  # Σ of the chosen options' costs
    bits: int  # Σ of their storage bits
    budget_bits: float
    lower_bound: float  # no choice within the budget costs less

    @property
    def gap(self) -> float:
        """Certified: cost - optimum <= gap."""
        return max(0.0, self.cost - self.lower_bound)


def _hull(options: dict[str, tuple[float, int]]) -> list[tuple[int, float, str]]:
    """The lower convex hull of (bits, cost) points, by increasing bits (decreasing cost)."""
    pts = sorted(((b, c, o) for o, (c, b) in options.items()), key=lambda p: (p[0], p[1]))
    frontier = []  # Pareto: each point cheaper in cost than every smaller one
    for p in pts:
        if not frontier or p[1] < frontier[-1][1]:
            if frontier and frontier[-1][0] == p[0]:
                frontier.pop()
            frontier.append(p)
    hull: list[tuple[int, float, str]] = []
    for p in frontier:
        while len(hull) >= 2:
            (b1, c1, _), (b2, c2, _) = hull[-2], hull[-1]
            # drop the middle point when it lies on or above the segment from hull[-2] to p
            if (c2 - c1) * (p[0] - b1) >= (p[1] - c1) * (b2 - b1):
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


def allocate(options: dict[str, dict[str, tuple[float, int]]], budget_bits: float) -> Allocation:
    """``options[tensor][option] = (cost, bits)``; see the module doc."""
    if not options:
        raise HiltError("nothing to allocate: no tensor has a candidate format")
    for t, opts in options.items():
        if not opts:
            raise HiltError(f"tensor '{t}' takes none of the candidate formats (block sizes must divide its inputs)")
    least = sum(min(b for _, b in opts.values()) for opts in options.values())
    if least > budget_bits:
        raise HiltError(f"the budget ({budget_bits:.0f} bits) is below the smallest choice ({least} bits)")
    hulls = {t: _hull(opts) for t, opts in options.items()}
    level = {t: 0 for t in options}  # position on each hull
    upgrades = []  # (saving per bit, tensor, hull index it reaches)
    for t, h in hulls.items():
        for i in range(1, len(h)):
            upgrades.append(((h[i - 1][1] - h[i][1]) / (h[i][0] - h[i - 1][0]), t, i))
    upgrades.sort(key=lambda u: -u[0])  # along one hull the rates decrease, so order within a tensor holds
    bits = least
    cost = sum(h[0][1] for h in hulls.values())
    bound = None
    for rate, t, i in upgrades:
        h = hulls[t]
        if level[t] != i - 1:
            continue
        step = h[i][0] - h[i - 1][0]
        if bits + step > budget_bits:
            if bound is None:  # the linear relaxation stops here, with this upgrade taken in part
                bound = cost - rate * (budget_bits - bits)
            continue
        if bound is not None:
            continue  # past the relaxation's stop: the fill below decides
        bits += step
        cost -= h[i - 1][1] - h[i][1]
        level[t] = i
    if bound is None:
        bound = cost  # every upgrade fitted: the hull tops are optimal
    choice = {t: hulls[t][level[t]][2] for t in options}
    # fill the leftover budget with whole upgrades (any option, not only hull points) that still fit
    while True:
        best = None
        for t, opts in options.items():
            c0, b0 = opts[choice[t]]
            for o, (c, b) in opts.items():
                if c < c0 and bits - b0 + b <= budget_bits:
                    gain = (c0 - c) / max(b - b0, 1)
                    if best is None or gain > best[0]:
                        best = (gain, t, o)
        if best is None:
            break
        _, t, o = best
        bits += options[t][o][1] - options[t][choice[t]][1]
        choice[t] = o
    cost = sum(options[t][choice[t]][0] for t in options)
    return Allocation(choice, cost, bits, budget_bits, min(bound, cost))
