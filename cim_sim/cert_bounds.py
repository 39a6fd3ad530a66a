"""Certificates: the smallest weight change that flips a prediction (docs/certify.md; sources in
docs/references.md §7).

    from hilt.cim_sim import certify, quantization_perturbation
    from hilt.quant import QuantConfig
    certs = certify(model, (images, labels), quantization_perturbation(model, QuantConfig("int", 4)))
    certs.fractions()     # {"exact": ..., "first_order": ..., "lipschitz": ...}

The model is read as a chain (cim_sim/cert_chain.py); a perturbation is a per-layer bound on
||Delta W_l||_F (quant/cert_quant.py for a format, cim_sim/cert_chip.py for a chip at a time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from hilt.cim_sim.cert_chain import Network
from hilt.errors import HiltError
from hilt.quant.cert_quant import Perturbation

KINDS = ("exact", "first_order", "lipschitz")

@dataclass
class Analysis:
    """What the certificates of a model on some inputs need, computed once (see ``analyze``)."""

    layers: list
    predictions: torch.Tensor  # (n,)
    labels: torch.Tensor | None
    margins: torch.Tensor  # (n,)  z_i - max_j z_j
    flip: torch.Tensor  # (n, layers): smallest flipping ||Delta W_l||_F, exact (last) / first order
    flip_class: torch.Tensor  # (n, layers): the class it flips to
    nu: torch.Tensor  # (n, layers): ||U(x_{l-1})||_F
    seconds: float = 0.0

    @property
    def names(self) -> list:
        return [layer.name for layer in self.layers]

    @property
    def exact(self) -> list:
        """Which layers' flip norms are exact (the last), not first order."""
        return [i == len(self.layers) - 1 for i in range(len(self.layers))]

    def eps_vector(self, perturbation: Perturbation | dict | None) -> torch.Tensor:
        eps = {} if perturbation is None else perturbation.eps if isinstance(perturbation, Perturbation) else perturbation
        unknown = sorted(set(eps) - set(self.names))
        if unknown:
            raise HiltError(f"the perturbation names {', '.join(unknown)}, not weight layers of the model "
                            f"({', '.join(self.names)})")
        return torch.tensor([float(eps.get(name, 0.0)) for name in self.names], dtype=torch.float64)

    def output_bound(self, eps: torch.Tensor) -> torch.Tensor:
        """Per input, the sound bound sqrt(2) e_L on |Dz_j - Dz_i| when ||Delta W_l||_F <= eps_l for every
        layer at once (the recursion of docs/certify.md, item 3). ``eps``: (layers,) or (n, layers)."""
        eps = eps.double().expand(self.nu.shape[0], -1) if eps.dim() == 1 else eps.double()
        nu = self.nu.double()
        d = torch.zeros(nu.shape[0], dtype=torch.float64)
        e = d
        for l, layer in enumerate(self.layers):
            e = layer.operator_norm * d + eps[:, l] * (nu[:, l] + math.sqrt(layer.multiplicity) * d)
            d = layer.lipschitz_after * e
        return math.sqrt(2) * e

    def lipschitz_radii(self) -> torch.Tensor:
        """(n, layers): the sound radius when layer l alone is perturbed, m / (sqrt(2) nu_l c_l prod_{k>l}
        Lambda_k c_k); the last column equals the exact last-layer radius for a Linear last layer."""
        gain = torch.ones(len(self.layers), dtype=torch.float64)
        tail = 1.0
        for l in range(len(self.layers) - 1, -1, -1):
            gain[l] = self.layers[l].lipschitz_after * tail
            tail *= self.layers[l].operator_norm * self.layers[l].lipschitz_after
        return self.margins.double()[:, None] / (math.sqrt(2) * self.nu.double() * gain)

    def lipschitz_scale(self, eps: torch.Tensor, iterations: int = 60) -> torch.Tensor:
        """Per input, the largest t such that t * eps is certified by the all-layers bound (bisection on
        the increasing polynomial t -> sqrt(2) e_L(t eps)); inf where eps is all zero."""
        n = self.margins.shape[0]
        m = self.margins.double()
        if not bool((eps > 0).any()):
            return torch.full((n,), math.inf, dtype=torch.float64)
        lo, hi = torch.zeros(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64)
        for _ in range(200):  # bracket: grow hi until it is not certified
            over = self.output_bound(hi[:, None] * eps) >= m
            if bool(over.all()):
                break
            hi = torch.where(over, hi, hi * 4)
        for _ in range(iterations):
            mid = (lo + hi) / 2
            ok = self.output_bound(mid[:, None] * eps) < m
            lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid)
        return lo

    def certify(self, perturbation: Perturbation | dict | None) -> "Certificates":
        eps = self.eps_vector(perturbation)
        per_layer = eps[None, :] < self.flip.double()
        last = len(self.layers) - 1
        lip = self.output_bound(eps) < self.margins.double()
        certified = {"exact": per_layer[:, last], "first_order": per_layer.all(1), "lipschitz": lip}
        if not isinstance(perturbation, Perturbation):
            perturbation = Perturbation(dict(zip(self.names, eps.tolist())))
        return Certificates(self, perturbation, eps, per_layer, certified, self.lipschitz_scale(eps))


@dataclass
class Certificates:
    """Which inputs a perturbation provably (or to first order) cannot flip.

    ``certified["exact"]``: the last layer alone perturbed by up to its eps: exact, no flip possible.
    ``certified["first_order"]``: each layer alone perturbed by up to its eps: below its flip norm
    (exact at the last layer, first order before it): an estimate, not a guarantee.
    ``certified["lipschitz"]``: every layer at once, each by up to its eps: sound.
    ``per_layer`` (n, layers): eps_l below the layer's flip norm."""

    analysis: Analysis
    perturbation: Perturbation
    eps: torch.Tensor
    per_layer: torch.Tensor
    certified: dict
    lipschitz_scale: torch.Tensor

    def fractions(self) -> dict:
        return {k: float(v.double().mean()) for k, v in self.certified.items()}

    def summary(self) -> dict:
        """The results as JSON-ready numbers (fractions, per-layer flip-norm quantiles, the bounds)."""
        a = self.analysis
        q = torch.tensor([0.01, 0.5], dtype=torch.float64)
        layers = []
        radii = a.lipschitz_radii()
        for l, info in enumerate(a.layers):
            f = a.flip[:, l].double()
            layers.append({**info.to_dict(), "exact": a.exact[l], "eps": float(self.eps[l]),
                           "eps_over_weight_norm": float(self.eps[l]) / info.weight_norm if info.weight_norm else 0.0,
                           "flip_norm_p01": _number(f.quantile(q[0])), "flip_norm_median": _number(f.quantile(q[1])),
                           "lipschitz_radius_median": _number(radii[:, l].quantile(q[1])),
                           "certified": float(self.per_layer[:, l].double().mean())})
        out = {"inputs": int(a.margins.shape[0]), "source": self.perturbation.source,
               "probability": self.perturbation.probability, "certified": self.fractions(), "layers": layers,
               "lipschitz_scale_median": _number(self.lipschitz_scale.quantile(q[1])), "seconds": a.seconds}
        if a.labels is not None:
            correct = a.predictions == a.labels
            out["accuracy"] = float(correct.double().mean())
            out["certified_and_correct"] = {k: float((v & correct).double().mean()) for k, v in self.certified.items()}
        if self.perturbation.detail:
            out["detail"] = self.perturbation.detail
        return out


def _number(value) -> float | None:
    """A float for JSON: None where it is infinite (no flip at all) or undefined."""
    value = float(value)
    return value if math.isfinite(value) else None


def _split(data) -> tuple:
    if isinstance(data, (tuple, list)):
        if len(data) != 2:
            raise HiltError("data must be inputs, or (inputs, labels)")
        x, y = data
        return x, (None if y is None else torch.as_tensor(y))
    return data, None


def analyze(model: nn.Module, data, batch_size: int | None = None, network: Network | None = None,
            progress=None) -> Analysis:
    """Flip norms, margins and activation norms of ``model`` on ``data`` (inputs, or (inputs, labels))."""
    import time

    x, labels = _split(data)
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or len(x) == 0:
        raise HiltError("data must be a non-empty tensor of inputs (batch first)")
    if labels is not None and len(labels) != len(x):
        raise HiltError(f"{len(x)} inputs but {len(labels)} labels")
    start = time.perf_counter()
    x = x.float()
    net = network or Network(model, x)
    bs = batch_size or net.batch_size()
    parts = []
    for i in range(0, len(x), bs):
        parts.append(net.analyze_batch(x[i : i + bs]))
        if progress is not None:
            progress(min(len(x), i + bs), len(x))
    cat = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    return Analysis(net.layers, cat["pred"], labels, cat["margin"], cat["flip"], cat["flip_class"], cat["nu"],
                    time.perf_counter() - start)


def certify(model: nn.Module, data, perturbation: Perturbation | dict | None = None,
            batch_size: int | None = None) -> Certificates:
    """Certificates of ``model`` on ``data`` (inputs, or (inputs, labels)) against ``perturbation``
    (per-layer bounds on ||Delta W||_F: `quantization_perturbation`, `cim_perturbation`, or a dict
    name -> bound). See :class:`Certificates` for what each kind guarantees."""
    return analyze(model, data, batch_size).certify(perturbation)
