"""`hilt certify`: certificates of a Fashion-MNIST workload on its test images against one setting (a
quantization format, a CIM chip at a time, or none), the table it prints and its plot. The bounds:
cim_sim.cert_bounds; the derivation: docs/certify.md; the study: bench/studies/certify.py."""

from __future__ import annotations

import math
import time

import torch

from hilt.cim_sim.cert_bounds import Certificates, analyze
from hilt.cim_sim.cert_chain import Network
from hilt.cim_sim.cert_chip import cim_perturbation
from hilt.errors import HiltError
from hilt.progress import Progress
from hilt.quant.cert_quant import quantization_perturbation
from hilt.tasks.train import workload_model


def fashion_test_set(n: int):
    """The first ``n`` Fashion-MNIST test images and their labels."""
    from hilt.data.fashion_mnist import load_fashion_mnist

    images, labels = load_fashion_mnist("test")
    return images[:n], labels[:n]


def certify_run(workload: str = "cnn", checkpoint=None, method: str | None = None, bits: int | None = None,
                block_size: int = 64, worst_case: bool = False, chip: str | None = None, time_text: str = "1y",
                delta: float = 0.01, gdc: str = "global", images: int = 10_000,
                progress: bool = False) -> tuple[dict, Certificates]:
    """Certificates of one workload on its test images against one setting: a quantization format
    (``method``, ``bits``), a chip at a time (``chip``, ``time_text``, ``delta``), or nothing (flip
    norms only). Returns the summary (JSON-ready) and the certificates themselves. ``seconds``:
    the bound and the analysis, after the model and the images are loaded."""
    from hilt.cim_sim import parse_time
    from hilt.quant import QuantConfig

    if method is not None and chip is not None:
        raise HiltError("give a quantization format (--method/--bits) or a chip (--chip/--time), not both")
    model, path = workload_model(workload, checkpoint)
    x, labels = fashion_test_set(images)
    start = time.perf_counter()
    if method is not None:
        perturbation = quantization_perturbation(model, QuantConfig(method, bits, block_size), worst_case)
        setting = f"{method} {bits}-bit ({'worst case in the rounding cells' if worst_case else 'actual error'})"
    elif chip is not None:
        perturbation = cim_perturbation(model, chip, parse_time(time_text), delta, gdc)
        setting = f"{chip} at {time_text}, probability >= {1 - delta:g}, {gdc} drift compensation"
    else:
        perturbation, setting = None, "no perturbation (flip norms only)"
    net = Network(model, x)
    batches = math.ceil(len(x) / net.batch_size())
    with Progress(batches, f"certify {workload}", "batch", enabled=progress) as bar:
        analysis = analyze(model, (x, labels), network=net, progress=lambda done, total: bar.done(f"{done}/{total} images"))
    cert = analysis.certify(perturbation)
    seconds = time.perf_counter() - start
    return {"workload": workload, "checkpoint": path.name, "setting": setting, **cert.summary(), "seconds": seconds}, cert


def render_run(result: dict) -> str:
    """The table `hilt certify` prints."""
    lines = [f"{result['workload']} ({result['checkpoint']}), {result['inputs']} test images, accuracy "
             f"{result.get('accuracy', float('nan')):.4f}; against {result['setting']}",
             f"{'layer':<8} {'kind':<7} {'weights':>8} {'||dW|| <=':>10} {'rel.':>7} {'flip p01':>9} {'flip med':>9} "
             f"{'certified':>9} {'sound r med':>11}"]
    for r in result["layers"]:
        n = math.prod(r["weight_shape"])
        num = lambda v, width: f"{'inf':>{width}}" if v is None else f"{v:>{width}.4g}"  # noqa: E731
        lines.append(f"{r['name']:<8} {r['kind']:<7} {n:>8} {r['eps']:>10.4g} {r['eps_over_weight_norm']:>7.4f} "
                     f"{num(r['flip_norm_p01'], 9)} {num(r['flip_norm_median'], 9)} {r['certified']:>9.4f} "
                     f"{num(r['lipschitz_radius_median'], 11)}{'' if r['exact'] else '  (first order)'}")
    c = result["certified"]
    lines.append(f"certified: exact (last layer alone) {c['exact']:.4f}, first order (each layer alone) "
                 f"{c['first_order']:.4f}, Lipschitz (all layers at once, sound) {c['lipschitz']:.4f}"
                 + (f"; holds with probability >= {result['probability']:g}" if result["probability"] < 1 else "")
                 + f"  [{result['seconds']:.1f} s]")
    return "\n".join(lines)


def plot_run(result: dict, cert: Certificates, path) -> None:
    """`hilt certify --plot`: every layer's flip norms over the inputs (log scale) and the setting's bounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = cert.analysis
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for l, info in enumerate(a.layers):
        v = a.flip[:, l].double()
        v = v[torch.isfinite(v) & (v > 0)]
        color = colors[l % len(colors)]
        kind = "exact" if a.exact[l] else "first order"
        ax.hist(v.log10().numpy(), bins=60, histtype="step", color=color, label=f"{info.name} ({kind})")
        if float(cert.eps[l]) > 0:
            ax.axvline(math.log10(float(cert.eps[l])), color=color, ls="--", lw=1)
    ax.set_xlabel("log10 of the smallest flipping ||dW||_F (dashed: the bound per layer)")
    ax.set_ylabel("test inputs")
    ax.set_title(f"{result['workload'].upper()}: {result['setting']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
