"""Which layers need bits: per-layer test prediction variance (TPV), docs/references.md §9.

A weight perturbation δ with covariance C changes a model's outputs, to second order, by

    E_x ||f(w + δ) - f(w)||²_M  ≈  Tr(H_eff C),     H_eff = E_x[J(x)ᵀ M J(x)]

(J: the Jacobian of the outputs in the weights; M: the output metric). No labels are needed.
With a probe v over the outputs whose E[v vᵀ] = M, the gradient g = ∂⟨v, f(x)⟩/∂w has
E[g ⊙ g] = diag(H_eff): one sample per backward pass (Hutchinson). For a diagonal C that is
constant over a block of weights (a quantization format's block: its mean squared error),

    TPV_layer = Σ_blocks  (block's error variance) × (Σ of diag(H_eff) over the block).

Metrics: ``euclidean`` (M = I, a Rademacher probe; for unit-norm embeddings ||Δe||² = 2(1 - cos)),
``softmax`` (the outputs are logits of a categorical distribution and M = diag(p) - p pᵀ, its
Fisher metric, so TPV / 2 is the expected KL divergence of the predictions).

    variances = {name: {label: quantization_variance(w, config)} for ...}
    result = estimate_tpv(model, batches, params, variances, output=..., metric="softmax")

The allocation of formats under a bits budget from these numbers is ``hilt.quant.allocate``.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from hilt.errors import HiltError
from hilt.quant.quantize import QuantConfig, quantize_tensor
from hilt.quant.qweight import QuantizedWeight

METRICS = ("euclidean", "softmax")
ROW = 1 << 30  # a block_size that means "one block per row": resolved against each tensor
_LABEL = re.compile(r"^(kmeans|int|int-asym|binary)([1-8])(?:@(\d+|row))?$")


# ------------------------------------------------------------------ candidate formats


def parse_candidates(text: str, block_size: int = 64) -> list[QuantConfig]:
    """Formats from a comma-separated list such as ``kmeans2,kmeans3,int4@128,int8@row`` (method,
    bits, and optionally @block size; ``@row`` is one block per row; default ``block_size``).
    A range ``kmeans1-4`` is bits 1 to 4."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        m = re.match(r"^(kmeans|int|int-asym|binary)([1-8])-([1-8])(@.*)?$", item)
        items = [item] if m is None else [  # a range skips the widths its method cannot take
            f"{m[1]}{b}{m[4] or ''}" for b in range(int(m[2]), int(m[3]) + 1)
            if not (m[1] == "int" and b < 2) and not (m[1] == "binary" and b != 1)]
        for it in items:
            mm = _LABEL.match(it)
            if mm is None:
                raise HiltError(f"bad candidate format {it!r}: write METHOD BITS[@BLOCK], e.g. kmeans3 or int4@128 "
                                "(methods kmeans, int, int-asym, binary; bits 1-8; @row for one block per row)")
            block = ROW if mm[3] == "row" else int(mm[3] or block_size)
            out.append(QuantConfig(method=mm[1], bits=int(mm[2]), block_size=block))
    if not out:
        raise HiltError("no candidate formats given")
    labels = [format_label(c) for c in out]
    if len(set(labels)) != len(labels):
        raise HiltError(f"candidate formats repeat: {', '.join(sorted({x for x in labels if labels.count(x) > 1}))}")
    return out



def format_label(config: QuantConfig) -> str:
    """``kmeans3@64``, ``int8@row``: the name a candidate format goes by in results."""
    block = "row" if config.block_size == ROW else str(config.block_size)
    return f"{config.method}{config.bits}@{block}"


def resolve(config: QuantConfig, shape) -> QuantConfig | None:
    """The format as it applies to a weight of ``shape`` (out, in...): None where its block size does
    not divide the input size (that tensor cannot take it)."""
    k = math.prod(shape[1:])
    if config.block_size == ROW:
        return replace(config, block_size=k)
    return config if k % config.block_size == 0 else None


# ------------------------------------------------------------------ perturbation covariances


@dataclass
class Variance:
    """A diagonal perturbation covariance: ``var[n, j]`` is the error variance of the weights of row n,
    block j (``block`` weights along the flattened input), and ``bits`` the storage the format takes."""

    var: torch.Tensor  # float32 (out, in // block)
    block: int
    bits: int | None = None  # storage bits of the tensor in this format (codes + scales + codebooks)
    rel_error: float | None = None
    error: torch.Tensor | None = None  # the error itself (out x in, or draws x out x in; float16): eᵀ H_eff e
    qweight: QuantizedWeight | None = None  # the quantized weight, kept with the error


def quantization_variance(w: torch.Tensor, config: QuantConfig, name: str = "tensor", keep_error: bool = False
                          ) -> Variance:
    """The actual error of quantizing ``w`` (2-D, or a conv weight flattened to out x rest) in
    ``config`` (already resolved to it), as a per-block mean squared error (and, with ``keep_error``,
    the error itself and the quantized weight)."""
    w2 = w.detach().reshape(w.shape[0], -1).float()
    q = quantize_tensor(w2, config, name=name)
    e = w2 - q.dequantize().float()
    err = e.square()
    n, k = w2.shape
    ref = float(w2.square().sum())
    return Variance(err.view(n, k // config.block_size, config.block_size).mean(-1), config.block_size,
                    q.storage_bits(), (float(err.sum()) / ref) ** 0.5 if ref > 0 else 0.0,
                    e.half() if keep_error else None, q if keep_error else None)


# ------------------------------------------------------------------ the estimate


def probe(y: torch.Tensor, metric: str, gen: torch.Generator) -> torch.Tensor:
    """A probe v over outputs ``y`` (examples x outputs) with E[v vᵀ] = M, row by row."""
    r = torch.randint(0, 2, y.shape, generator=gen).to(y.dtype) * 2 - 1
    if metric == "euclidean":
        return r
    p = torch.softmax(y.float(), dim=-1).to(y.dtype)
    a = p.sqrt() * r  # E[a aᵀ] = diag(p)
    return a - p * a.sum(-1, keepdim=True)  # (I - p 1ᵀ) a: E[v vᵀ] = diag(p) - p pᵀ


@dataclass
class LayerTPV:
    """One layer's estimate: the trace of H_eff over its weights and the TPV of each format, per
    example, with Monte-Carlo standard errors over the probe samples."""

    name: str
    shape: tuple
    trace: float = 0.0
    trace_se: float = 0.0
    tpv: dict = field(default_factory=dict)  # label -> predicted output change (block-diagonal C)
    tpv_se: dict = field(default_factory=dict)
    tpv_full: dict = field(default_factory=dict)  # label -> eᵀ H_eff e with the error e itself
    tpv_full_se: dict = field(default_factory=dict)
    samples: int = 0

    def as_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "weights": math.prod(self.shape),
                "trace": self.trace, "trace_se": self.trace_se, "samples": self.samples,
                "tpv": dict(self.tpv), "tpv_se": dict(self.tpv_se),
                **({"tpv_full": dict(self.tpv_full), "tpv_full_se": dict(self.tpv_full_se)} if self.tpv_full else {})}


def _mean_se(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return mean, float("nan")
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    return mean, (var / n) ** 0.5


@contextlib.contextmanager
def _grads_only_for(model: nn.Module, weights: list[torch.Tensor]):
    """Gradients for ``weights`` alone (the rest of ``model`` frozen), put back as they were after."""
    was = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    for p in weights:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p, flag in was.items():
            p.requires_grad_(flag)


def estimate_tpv(
    model: nn.Module,
    batches: Iterable[tuple],
    params: dict[str, torch.Tensor],
    variances: dict[str, dict[str, Variance]] | None = None,
    *,
    output: Callable[..., torch.Tensor] | None = None,
    metric: str = "euclidean",
    probes: int = 1,
    seed: int = 0,
    on_sample: Callable[[int], None] | None = None,
) -> dict[str, LayerTPV]:
    """Per layer: Tr(H_eff) over its weights and the TPV of each perturbation in ``variances``.

    ``batches`` yields argument tuples; ``output(model, *args)`` gives the outputs (examples along
    every dimension but the last; default ``model(*args)``). ``params``: weight name -> parameter of
    ``model`` (a Linear's or a conv's weight). Each batch is one forward pass and ``probes`` backward
    passes, each a sample; a sample's values are divided by the examples in its batch, so the
    results are per example (per token, per image, per sentence).
    """
    if metric not in METRICS:
        raise HiltError(f"unknown output metric {metric!r}; choose one of {', '.join(METRICS)}")
    if not params:
        raise HiltError("no layer to measure: the model has no Linear or convolution weight selected")
    variances = variances or {}
    for name, by_label in variances.items():
        if name not in params:
            raise HiltError(f"a perturbation is given for '{name}', which is not among the measured layers")
        for label, v in by_label.items():
            shape = params[name].shape
            k = math.prod(shape[1:])
            if k % v.block or tuple(v.var.shape) != (shape[0], k // v.block):
                raise HiltError(f"perturbation {label!r} of '{name}' has shape {tuple(v.var.shape)} with blocks of "
                                f"{v.block}, which does not fit the weight {tuple(shape)}")
    output = output or (lambda m, *args: m(*args))
    gen = torch.Generator().manual_seed(seed)
    names = list(params)
    weights = [params[n] for n in names]
    trace_samples = {n: [] for n in names}
    tpv_samples = {n: {label: [] for label in variances.get(n, {})} for n in names}
    full_samples = {n: {label: [] for label, v in variances.get(n, {}).items() if v.error is not None} for n in names}
    sample = 0
    with _grads_only_for(model, weights):
        for args in batches:
            with torch.enable_grad():
                y = output(model, *args)
            y = y.reshape(-1, y.shape[-1])
            examples = y.shape[0]
            for k in range(probes):
                v = probe(y.detach(), metric, gen)
                grads = torch.autograd.grad((y * v).sum(), weights, retain_graph=k + 1 < probes)
                for name, g in zip(names, grads):
                    g = g.detach().reshape(g.shape[0], -1).float()
                    g2 = g.square()
                    if not torch.isfinite(g2).all():
                        raise HiltError(f"the gradient of layer '{name}' is not finite: the model's outputs "
                                        "overflow on the calibration data")
                    trace_samples[name].append(float(g2.sum(dtype=torch.float64)) / examples)
                    for label, v_ in variances.get(name, {}).items():
                        per_block = g2.view(g2.shape[0], -1, v_.block).sum(-1)
                        tpv_samples[name][label].append(float((per_block * v_.var).sum(dtype=torch.float64))
                                                        / examples)
                        if v_.error is not None:  # E[(g·e)²] = eᵀ H_eff e over the probes (mean over draws)
                            e = v_.error.reshape(-1, *g.shape)
                            dots = (g * e).flatten(1).sum(-1, dtype=torch.float64)
                            full_samples[name][label].append(float(dots.square().mean()) / examples)
                sample += 1
                if on_sample is not None:
                    on_sample(sample)
            del y
    if sample == 0:
        raise HiltError("no calibration batch: nothing to estimate the sensitivity from")
    out = {}
    for name in names:
        layer = LayerTPV(name, tuple(params[name].shape), samples=sample)
        layer.trace, layer.trace_se = _mean_se(trace_samples[name])
        for label, xs in tpv_samples[name].items():
            layer.tpv[label], layer.tpv_se[label] = _mean_se(xs)
        for label, xs in full_samples[name].items():
            layer.tpv_full[label], layer.tpv_full_se[label] = _mean_se(xs)
        out[name] = layer
    return out


def estimate_output_tpv(
    model: nn.Module,
    batches: Iterable[tuple],
    layers: dict[str, nn.Module],
    perturbed: dict[str, Callable[[torch.Tensor], torch.Tensor]],
    *,
    output: Callable[..., torch.Tensor] | None = None,
    metric: str = "euclidean",
    probes: int = 1,
    seed: int = 0,
) -> dict[str, tuple[float, float]]:
    """Per layer, the predicted output change when the layer's *outputs* are perturbed: eᵀ H_z e with
    e = ``perturbed[path](x) - layer(x)`` on the layer's own calibration input x, H_z the second moment
    of the model outputs' Jacobian in that layer's outputs (probe gradients at the layer output).
    ``perturbed[path](x)`` may return several draws stacked first (chips): the mean over them.
    This counts what acts on activations too (converters, output noise), not only weight errors."""
    if metric not in METRICS:
        raise HiltError(f"unknown output metric {metric!r}; choose one of {', '.join(METRICS)}")
    output = output or (lambda m, *args: m(*args))
    gen = torch.Generator().manual_seed(seed)
    samples = {p: [] for p in layers}
    seen: dict[str, tuple] = {}

    def keep(path):
        def hook(module, inputs, out):
            seen[path] = (inputs[0].detach(), out)
        return hook
    handles = [m.register_forward_hook(keep(p)) for p, m in layers.items()]
    try:
        for args in batches:
            seen.clear()
            with torch.enable_grad():
                # grads flow to the layer outputs only: make the input require grad to build the graph
                args = tuple(a.detach().float().requires_grad_() if torch.is_tensor(a) and a.is_floating_point()
                             else a for a in args)
                y = output(model, *args)
            y = y.reshape(-1, y.shape[-1])
            examples = y.shape[0]
            outs = [seen[p][1] for p in layers]
            errors = {}
            with torch.no_grad():
                for p in layers:
                    x, z = seen[p]
                    e = perturbed[p](x).reshape(-1, *z.shape) - z.detach()
                    errors[p] = e
            for k in range(probes):
                v = probe(y.detach(), metric, gen)
                grads = torch.autograd.grad((y * v).sum(), outs, retain_graph=k + 1 < probes)
                for p, g in zip(layers, grads):
                    dots = (g.detach() * errors[p]).flatten(1).sum(-1, dtype=torch.float64)
                    samples[p].append(float(dots.square().mean()) / examples)
    finally:
        for h in handles:
            h.remove()
    if not any(samples.values()):
        raise HiltError("no calibration batch: nothing to estimate the sensitivity from")
    return {p: _mean_se(xs) for p, xs in samples.items()}


def loss_hessian_trace(
    model: nn.Module,
    batches: Iterable[tuple],
    params: dict[str, torch.Tensor],
    loss: Callable[..., torch.Tensor],
    *,
    probes: int = 1,
    seed: int = 0,
    on_sample: Callable[[int], None] | None = None,
) -> dict[str, tuple[float, float]]:
    """Per layer, the trace of the loss Hessian over its weights and its standard error (HAWQ's
    measure): Hutchinson with a Rademacher z over the weights, H z from a second backward pass.
    ``loss(model, *args)`` is a mean over the batch's examples."""
    gen = torch.Generator().manual_seed(seed)
    names = list(params)
    weights = [params[n] for n in names]
    samples = {n: [] for n in names}
    count = 0
    with _grads_only_for(model, weights):
        for args in batches:
            # the fused CPU attention kernels have no second derivative; the plain one does
            with torch.enable_grad(), sdpa_kernel([SDPBackend.MATH]):
                grads = torch.autograd.grad(loss(model, *args), weights, create_graph=True)
                for k in range(probes):
                    zs = [torch.randint(0, 2, w.shape, generator=gen).to(w.dtype) * 2 - 1 for w in weights]
                    hz = torch.autograd.grad(grads, weights, grad_outputs=zs, retain_graph=k + 1 < probes)
                    for name, z, h in zip(names, zs, hz):
                        samples[name].append(float((z * h).sum(dtype=torch.float64)))
                    count += 1
                    if on_sample is not None:
                        on_sample(count)
            del grads
    if count == 0:
        raise HiltError("no calibration batch: nothing to estimate the Hessian trace from")
    return {n: _mean_se(samples[n]) for n in names}


def weight_params(model: nn.Module, select: Callable[[str, nn.Module], bool] | None = None) -> dict[str, torch.Tensor]:
    """``<module path>.weight`` -> weight for every Linear and Conv1d/2d of ``model`` that
    ``select(path, module)`` accepts (all of them without it), in module order."""
    out = {}
    for path, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)) and (select is None or select(path, module)):
            out[f"{path}.weight"] = module.weight
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties); NaN for fewer than 2 points or a constant."""
    if len(a) != len(b):
        raise ValueError("spearman needs two lists of the same length")
    if len(a) < 2:
        return float("nan")

    def ranks(xs):
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        r = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for t in range(i, j + 1):
                r[order[t]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = torch.tensor(ranks(a), dtype=torch.float64), torch.tensor(ranks(b), dtype=torch.float64)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float(ra.norm() * rb.norm())
    return float((ra * rb).sum()) / den if den > 0 else float("nan")
