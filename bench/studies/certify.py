"""`hilt bench certify`: minimal-norm weight-perturbation certificates for the Fashion-MNIST
workloads, against hilt's quantization formats and against CIM chips over time.

The maths is in docs/certify.md (code: cim_sim/cert_*.py, quant/cert_quant.py); `hilt certify` runs
from hilt/tasks/certify.py. The study, per workload (the MLP and the CNN):

1. the flip norms of every test input (exact at the last layer, first order before it) and the
   sound all-layers (Lipschitz) bound, and how the two compare on the same inputs;
2. against quantization (int and k-means, 2/3/4/8 bits, blocks of 64 or the largest divisor below
   it): the certified fraction per certificate, for the actual error ||W - Q(W)||_F and for the
   worst case inside the rounding cells, the quantized model's accuracy, and per layer the
   compression threshold (the coarsest format whose error stays under the flip norm of 99% of
   the inputs);
3. against CIM presets from 1 s to 1 y after programming: the certified fraction beside the
   accuracy measured on simulated chips;
4. Monte-Carlo soundness: many quantization-noise draws inside the rounding cells (uniform, cell
   corners, the Frobenius sphere), gradient-aligned and projected-gradient attacks, and chips
   drawn by the simulator: no input certified by an exact or Lipschitz certificate may flip;
   first-order violations are counted, and the first-order flip norm is compared with the real
   one along its own direction by a line search.
"""

from __future__ import annotations

import math
import time

import torch

from hilt.cim_sim.cert_bounds import KINDS, analyze
from hilt.cim_sim.cert_chain import Network
from hilt.cim_sim.cert_chip import cim_perturbation, cim_perturbations
from hilt.progress import LOG, Progress
from hilt.quant.cert_quant import QuantizedLayer, quantization_perturbation, quantize_layers
from hilt.tasks.certify import fashion_test_set
from hilt.tasks.train import workload_model

WORKLOADS = ("mlp", "cnn")
DEFAULT_TIMES = "1s,1h,1d,1mo,1y"
# Budgets. images: test images certified; mc_images: inputs of the Monte-Carlo checks; draws:
# quantization-noise draws; chips: simulator chips of the CIM soundness check (at mc_time);
# accuracy_chips/accuracy_images: chips and images of the measured accuracy beside each time;
# pgd_inputs / line_inputs: inputs of the projected-gradient attack and of the first-order line search.
FULL = dict(images=10_000, bits=(2, 3, 4, 5, 6, 8), methods=("int", "kmeans"), block_size=64, presets=("pcm", "rram"),
            times=DEFAULT_TIMES, delta=0.01, mc_images=500, draws=1000, chips=500, mc_time="1y",
            accuracy_chips=2, accuracy_images=2000, pgd_inputs=64, pgd_steps=20, line_inputs=200)
QUICK = dict(images=200, bits=(2, 4), methods=("int", "kmeans"), block_size=64, presets=("pcm",), times="1s,1y",
             delta=0.01, mc_images=64, draws=6, chips=2, mc_time="1y", accuracy_chips=1, accuracy_images=200,
             pgd_inputs=4, pgd_steps=3, line_inputs=8)
# `hilt report` (quick): every part, on fewer images and draws (about a minute per workload on 2 cores)
REPORT = dict(FULL, images=2000, presets=("pcm",), times="1s,1d,1y", mc_images=200, draws=200, chips=100,
              accuracy_chips=1, accuracy_images=1000, pgd_inputs=16, pgd_steps=10, line_inputs=50)
KIND_LABELS = {"exact": "exact (last layer)", "first_order": "first order (each layer)",
               "lipschitz": "Lipschitz (all layers, sound)"}


def _accuracy(net: Network, x: torch.Tensor, labels: torch.Tensor, weights: dict | None = None) -> float:
    with torch.no_grad():
        pred = torch.cat([net.run(x[i : i + 1000], weights).argmax(1) for i in range(0, len(x), 1000)])
    return float((pred == labels).double().mean())


def _weights(net: Network, flat: dict) -> dict:
    """Layer name -> weights shaped as the layers hold them, from 2-D (out, inputs) ones."""
    shapes = {layer.name: layer.weight_shape for layer in net.layers}
    return {name: w.reshape(shapes[name]).to(torch.float32) for name, w in flat.items()}


# ----------------------------------------------------------------------------- quantization


def quantization_rows(model, net, analysis, x, labels, plan) -> tuple[list, dict]:
    """Certified fractions per (method, bits), for the actual error and the rounding-cell worst case."""
    from hilt.quant import QuantConfig

    rows, errors = [], {}
    for method in plan["methods"]:
        for bits in plan["bits"]:
            config = QuantConfig(method, bits, plan["block_size"])
            layers = quantize_layers(model, config)
            accuracy = _accuracy(net, x, labels, _weights(net, {n: q.quantized for n, q in layers.items()}))
            for worst in (False, True):
                p = quantization_perturbation(model, config, worst, quantized=layers)
                cert = analysis.certify(p)
                rows.append({"method": method, "bits": bits, "error": "cells" if worst else "actual",
                             "certified": cert.fractions(), "accuracy": accuracy,
                             "eps": [float(e) for e in cert.eps],
                             "relative_error": [float(e) / info.weight_norm for e, info in zip(cert.eps, net.layers)],
                             "lipschitz_scale_median": float(cert.lipschitz_scale.median()),
                             "bits_per_weight": p.detail["bits_per_weight"], "block_size": p.detail["block_size"]})
            errors[(method, bits)] = rows[-2]["eps"]
            r = rows[-2]
            LOG.info(f"  {method} {bits}-bit: accuracy {accuracy:.4f}; certified (actual error) exact "
                     f"{r['certified']['exact']:.3f}, first order {r['certified']['first_order']:.3f}, Lipschitz {r['certified']['lipschitz']:.3f} "
                     f"(cells: {rows[-1]['certified']['exact']:.3f} / {rows[-1]['certified']['first_order']:.3f} / "
                     f"{rows[-1]['certified']['lipschitz']:.3f})")
    return rows, errors


def compression_thresholds(net, analysis, errors: dict, plan, quantile: float = 0.01) -> list:
    """Per layer and method: the coarsest bit width whose actual error stays under the flip norm of
    (1 - quantile) of the inputs (exact/first order) and under the sound single-layer radius; and the
    relative error that would be needed (the flip norm's quantile over ||W||_F)."""
    radii = analysis.lipschitz_radii()
    out = []
    for l, info in enumerate(net.layers):
        flip_q = float(analysis.flip[:, l].double().quantile(quantile))
        radius_q = float(radii[:, l].quantile(quantile))
        row = {"layer": info.name, "exact": analysis.exact[l], "needed_relative_error": flip_q / info.weight_norm,
               "needed_relative_error_sound": radius_q / info.weight_norm}
        for method in plan["methods"]:
            ok = [b for b in sorted(plan["bits"]) if errors[(method, b)][l] < flip_q]
            sound = [b for b in sorted(plan["bits"]) if errors[(method, b)][l] < radius_q]
            row[method] = ok[0] if ok else None
            row[f"{method}_sound"] = sound[0] if sound else None
        if "int" in plan["methods"]:  # beyond the widths tried: an integer grid's error halves with each bit
            top = max(plan["bits"])
            err = errors[("int", top)][l]
            for key, found, needed in (("int_bits_extrapolated", row["int"], flip_q),
                                       ("int_bits_extrapolated_sound", row["int_sound"], radius_q)):
                row[key] = found if found is not None else \
                    top + max(0, math.ceil(math.log2(err / needed))) if needed > 0 else None
        out.append(row)
    return out


# ----------------------------------------------------------------------------- CIM over time


def _chip_weights(analog) -> dict:
    """Layer name -> the effective weights a chip holds now (devices read, drift compensation folded in)."""
    from hilt.cim_sim import analog_layers

    return {name: (layer.held_weights() * layer.gdc_scale[:, None]).detach() for name, layer in analog_layers(analog)}


def cim_rows(model, net, analysis, x, labels, plan) -> list:
    """Certified fraction at each preset and time beside the accuracy measured on simulated chips (the
    full analog forward, and the chip's weights in digital arithmetic: what the certificate covers)."""
    from hilt.cim_sim import convert_to_analog, drift_to, evaluate, parse_time, preset, program

    rows = []
    times = plan["times"].split(",")
    xa, la = x[: plan["accuracy_images"]], labels[: plan["accuracy_images"]]
    for name in plan["presets"]:
        analog = convert_to_analog(model, preset(name))
        bounds = cim_perturbations(model, name, [parse_time(label) for label in times], plan["delta"])
        for label, p in zip(times, bounds):
            t = parse_time(label)
            cert = analysis.certify(p)
            full, weights_only = [], []
            for chip in range(plan["accuracy_chips"]):
                program(analog, seed=chip)
                drift_to(analog, t, seed=10_000 + chip)
                full.append(evaluate(analog, (xa, la)).item())
                weights_only.append(_accuracy(net, xa, la, _weights(net, _chip_weights(analog))))
            rows.append({"preset": name, "time": label, "seconds": t, "certified": cert.fractions(),
                         "eps": [float(e) for e in cert.eps],
                         "relative_bound": [float(e) / info.weight_norm for e, info in zip(cert.eps, net.layers)],
                         "accuracy": sum(full) / len(full), "accuracy_weights_only": sum(weights_only) / len(weights_only),
                         "lipschitz_scale_median": float(cert.lipschitz_scale.median())})
            r = rows[-1]
            LOG.info(f"  {name} {label}: ||dW||/||W|| bound {', '.join(f'{v:.3f}' for v in r['relative_bound'])}; certified "
                     f"exact {r['certified']['exact']:.3f}, first order {r['certified']['first_order']:.3f}, Lipschitz "
                     f"{r['certified']['lipschitz']:.3f}; accuracy {r['accuracy']:.4f} (weights only {r['accuracy_weights_only']:.4f})")
    return rows


# ----------------------------------------------------------------------------- the bounds compared


def compare_bounds(net, analysis) -> dict:
    """The sound all-layers bound against the single-layer flip norms on the same inputs: per layer the
    sound single-layer radius over the flip norm; and for a perturbation of every layer by the same
    share of its norm (eps_l = rho ||W_l||_F), the sound certified rho over the smallest single-layer
    one (min_l flip_l / ||W_l||_F) and over the exact last-layer one."""
    q = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    ratio = analysis.lipschitz_radii() / analysis.flip.double()
    norms = torch.tensor([info.weight_norm for info in net.layers], dtype=torch.float64)
    rho_all = analysis.lipschitz_scale(norms)
    rho_single = analysis.flip.double() / norms
    all_over_min = rho_all / rho_single.min(1).values
    all_over_last = rho_all / rho_single[:, -1]
    quant = lambda v: dict(zip(("p10", "median", "p90"), v[torch.isfinite(v)].quantile(q).tolist()))  # noqa: E731
    return {"single_layer": [{"layer": info.name, "exact": analysis.exact[l], **quant(ratio[:, l])}
                             for l, info in enumerate(net.layers)],
            "all_over_smallest_single": quant(all_over_min), "all_over_last_layer": quant(all_over_last),
            "relative_radius_all_median": float(rho_all.median()),
            "relative_radius_single_median": [float(v) for v in rho_single.median(0).values]}


# ----------------------------------------------------------------------------- Monte-Carlo soundness


def _draw(kind: str, ql: QuantizedLayer, eps: float, gen: torch.Generator) -> torch.Tensor:
    """A perturbation within the layer's rounding cells (norm <= its cell bound): the error of a weight
    drawn uniformly in its cell, a random corner of the cells, or a uniform point of the sphere."""
    if kind == "cell":
        inside = ql.lower + (ql.upper - ql.lower) * torch.rand(ql.weight.shape, generator=gen)
        return ql.quantized - inside
    if kind == "corner":
        signs = torch.randint(0, 2, ql.weight.shape, generator=gen).float() * 2 - 1
        return ql.half_width * signs
    d = torch.randn(ql.weight.shape, generator=gen)
    return d * (eps / float(d.norm()))


def _aligned(net, x, analysis, idx, eps: torch.Tensor, layers, classes=None) -> dict:
    """Per input, each layer's perturbation of norm eps_l against the margin's gradient (toward the
    runner-up, or ``classes`` per layer): the first-order worst direction."""
    out = {}
    for l in layers:
        name = net.names[l]
        cls = None if classes is None else classes[idx, l]
        g, _ = net.margin_gradient(x, l, cls)
        norms = g.flatten(1).norm(dim=1).clamp_min(1e-30)
        out[name] = -(float(eps[l]) / norms).view(-1, *[1] * (g.dim() - 1)) * g
    return out


def _pgd(net, x, eps: torch.Tensor, steps: int, start: dict) -> torch.Tensor:
    """Projected gradient descent on the margin, every layer at once, each inside its Frobenius ball of
    radius eps_l, one perturbation per input (from ``start``). Returns the margins reached."""
    base = {layer.name: net.steps[i].module.weight.detach() for layer, i in zip(net.layers, net.affine)}
    with torch.no_grad():
        z0 = net.run(x)
    pred = z0.argmax(1)
    delta = {k: v.clone().requires_grad_() for k, v in start.items()}
    radius = {name: float(eps[l]) for l, name in enumerate(net.names)}
    margins = None
    for step in range(steps + 1):
        z = net.run(x, {k: base[k] + d for k, d in delta.items()})
        other = z.scatter(1, pred[:, None], -math.inf).max(1).values
        margins = z.gather(1, pred[:, None]).squeeze(1) - other
        if step == steps:
            break
        grads = torch.autograd.grad(margins.sum(), list(delta.values()))
        with torch.no_grad():
            for (k, d), g in zip(delta.items(), grads):
                flat = g.flatten(1)
                d -= (2.5 * radius[k] / steps) * (g / flat.norm(dim=1).clamp_min(1e-30).view(-1, *[1] * (g.dim() - 1)))
                n = d.flatten(1).norm(dim=1).clamp_min(1e-30)
                d *= (radius[k] / n).clamp(max=1.0).view(-1, *[1] * (d.dim() - 1))
    return margins.detach()


def _flips(net, x, pred, weights=None, start=0) -> torch.Tensor:
    with torch.no_grad():
        return net.run(x, weights, start).argmax(1) != pred


def quantization_soundness(model, net, x, plan, seed=0, progress=False) -> dict:
    """Monte-Carlo check of the certificates against perturbations inside int8's rounding cells: the
    exact one (last layer alone) and the first-order ones (each layer alone) at the cells' size; the
    Lipschitz one (every layer at once) at the cells scaled to the inputs' median certified scale
    (the cells of a finer grid: int8 cells are far beyond what the sound bound certifies)."""
    from hilt.quant import QuantConfig

    analysis = analyze(model, x, network=net)
    layers = quantize_layers(model, QuantConfig("int", 8, plan["block_size"]))
    cells = [layers[name] for name in net.names]
    eps = torch.tensor([q.cell_bound for q in cells], dtype=torch.float64)
    cert = analysis.certify(dict(zip(net.names, eps.tolist())))
    scale = float(analysis.lipschitz_scale(eps).median())
    lip = analysis.output_bound(scale * eps) < analysis.margins.double()
    last = len(net.layers) - 1
    pred = analysis.predictions
    inputs = [net.layer_input(x, l) for l in range(len(net.layers))]
    base = {name: net.steps[i].module.weight.detach() for name, i in zip(net.names, net.affine)}
    shape = {layer.name: layer.weight_shape for layer in net.layers}
    counts = {"lipschitz": 0, "lipschitz_uncertified_flips": 0, "exact": 0, "first_order": [0] * last,
              "first_order_checked": [0] * last}
    gen = torch.Generator().manual_seed(seed)
    kinds = ("cell", "corner", "sphere")
    every = max(1, plan["draws"] // 10)  # a line per tenth of the draws
    bar = Progress(math.ceil(plan["draws"] / every), "certify Monte-Carlo", steps=every, enabled=progress)
    for d in range(plan["draws"]):
        kind = kinds[d % 3]
        deltas = {name: _draw(kind, q, float(e), gen).reshape(shape[name]) for name, q, e in zip(net.names, cells, eps)}
        flipped = _flips(net, x, pred, {k: base[k] + scale * v for k, v in deltas.items()})
        counts["lipschitz"] += int((flipped & lip).sum())
        counts["lipschitz_uncertified_flips"] += int((flipped & ~lip).sum())
        ex = cert.certified["exact"]
        if bool(ex.any()):
            counts["exact"] += int(_flips(net, inputs[last][ex], pred[ex], {net.names[last]: base[net.names[last]] + deltas[net.names[last]]}, last).sum())
        for l in range(last):
            ok = cert.per_layer[:, l]
            if bool(ok.any()):
                name = net.names[l]
                counts["first_order"][l] += int(_flips(net, inputs[l][ok], pred[ok], {name: base[name] + deltas[name]}, l).sum())
                counts["first_order_checked"][l] += int(ok.sum())
        bar.tick()
        if (d + 1) % every == 0 or d + 1 == plan["draws"]:
            bar.done(f"draws {d + 1}", f"flips of certified inputs: exact {counts['exact']}, Lipschitz {counts['lipschitz']}")
    bar.close()
    # the worst directions: against the margin's gradient (and the cells' corner that follows its signs)
    adversarial = {"lipschitz": 0, "exact": 0, "exact_tight": None, "first_order": [0] * last, "pgd": 0}
    idx = lip.nonzero().squeeze(1)
    if len(idx):
        aligned = _aligned(net, x[idx], analysis, idx, scale * eps, range(len(net.layers)))
        w = {k: base[k] + v for k, v in aligned.items()}
        adversarial["lipschitz"] += int(_flips(net, x[idx], pred[idx], w).sum())
        corner = {name: base[name] + scale * (cells[l].half_width.reshape(shape[name]) * torch.sign(aligned[name]))
                  for l, name in enumerate(net.names)}
        adversarial["lipschitz"] += int(_flips(net, x[idx], pred[idx], corner).sum())
        sub = idx[: plan["pgd_inputs"]]
        start = {k: v[: len(sub)] for k, v in aligned.items()}
        reached = _pgd(net, x[sub], scale * eps, plan["pgd_steps"], start)
        adversarial["pgd"] = int((reached <= 0).sum())
        adversarial["pgd_inputs"] = len(sub)
        adversarial["pgd_margin_left_min"] = float((reached / analysis.margins[sub]).min())
    ex = cert.certified["exact"].nonzero().squeeze(1)
    if len(ex):
        flip_class = analysis.flip_class
        g = _aligned(net, x[ex], analysis, ex, eps, [last], flip_class)[net.names[last]]
        adversarial["exact"] = int(_flips(net, inputs[last][ex], pred[ex], {net.names[last]: base[net.names[last]] + g}, last).sum())
        # tightness: along the same direction, 1.001 x the flip norm flips every input (the formula is exact)
        factor = (1.001 * analysis.flip[ex, last].double() / eps[last]).float().view(-1, 1, 1)
        adversarial["exact_tight"] = float(_flips(net, inputs[last][ex], pred[ex],
                                                   {net.names[last]: base[net.names[last]] + g * factor}, last).double().mean())
    for l in range(last):
        ok = cert.per_layer[:, l].nonzero().squeeze(1)
        if len(ok):
            g = _aligned(net, x[ok], analysis, ok, eps, [l], analysis.flip_class)[net.names[l]]
            adversarial["first_order"][l] = int(_flips(net, inputs[l][ok], pred[ok], {net.names[l]: base[net.names[l]] + g}, l).sum())
    result = {"format": "int 8-bit cells", "inputs": len(x), "draws": plan["draws"], "draw_kinds": list(kinds),
              "eps": eps.tolist(), "lipschitz_scale": scale, "certified_inputs": {
                  "exact": int(cert.certified["exact"].sum()), "lipschitz": int(lip.sum()),
                  "first_order": [int(cert.per_layer[:, l].sum()) for l in range(last)]},
              "flips_of_certified": {"exact": counts["exact"], "lipschitz": counts["lipschitz"]},
              "lipschitz_uncertified_flips": counts["lipschitz_uncertified_flips"],
              "first_order_violations": counts["first_order"], "first_order_checks": counts["first_order_checked"],
              "first_order_violation_rate": [v / c if c else 0.0 for v, c in zip(counts["first_order"], counts["first_order_checked"])],
              "adversarial": adversarial, "layers": net.names}
    LOG.info(f"  Monte-Carlo, {plan['draws']} draws in int8 cells on {len(x)} inputs: flips of certified inputs: exact "
             f"{counts['exact']} (of {int(cert.certified['exact'].sum())} certified), Lipschitz {counts['lipschitz']} (of "
             f"{int(lip.sum())}, at {scale:.3g} x the cells); first-order violation rate "
             f"{', '.join(f'{v:.2e}' for v in result['first_order_violation_rate'])}; aligned/PGD flips: "
             f"exact {adversarial['exact']}, Lipschitz {adversarial['lipschitz']} + PGD {adversarial['pgd']}")
    return result


def line_search(net, x, analysis, inputs: int) -> list:
    """Along each layer's first-order minimal direction -(m / ||g||^2) g, the scale at which the
    prediction really flips (1: the first-order norm is right; < 1: it overestimates): per layer
    median, 5th percentile and the share below 1 and below 0.9 (exactly 1 at the last layer)."""
    out = []
    x = x[:inputs]
    pred = analysis.predictions[:inputs]
    for l, name in enumerate(net.names):
        g, m = net.margin_gradient(x, l, analysis.flip_class[:inputs, l])
        sq = g.flatten(1).square().sum(1).clamp_min(1e-30)
        step = -(m / sq).view(-1, *[1] * (g.dim() - 1)) * g  # norm = the first-order flip norm
        a = net.layer_input(x, l)
        base = net.steps[net.affine[l]].module.weight.detach()

        def flips(s):
            return _flips(net, a, pred, {name: base + s.view(-1, *[1] * (g.dim() - 1)) * step}, l)

        lo = torch.zeros(len(x))
        hi = torch.full((len(x),), 8.0)
        never = ~flips(hi)
        for _ in range(20):
            mid = (lo + hi) / 2
            f = flips(mid)
            lo, hi = torch.where(f, lo, mid), torch.where(f, mid, hi)
        s = torch.where(never, torch.full_like(hi, math.inf), hi).double()
        finite = s[torch.isfinite(s)]
        out.append({"layer": name, "exact": analysis.exact[l], "median": float(s.median()),
                    "p05": float(s.quantile(0.05)) if len(finite) == len(s) else float(finite.quantile(0.05)) if len(finite) else math.inf,
                    "below_1": float((s < 1 - 1e-3).double().mean()), "below_0.9": float((s < 0.9).double().mean()),
                    "no_flip_within_8x": float(never.double().mean())})
    return out


def chip_soundness(model, net, x, plan, preset_name: str, seed: int = 0, progress=False) -> dict:
    """Chips drawn by the simulator at ``mc_time``: how often a layer's weight error exceeds its bound,
    and whether any input certified against that bound flips (the last layer's error alone for the
    exact certificate, every layer's for the Lipschitz one, each layer's alone for first order)."""
    from hilt.cim_sim import analog_layers, convert_to_analog, drift_to, parse_time, preset, program

    t = parse_time(plan["mc_time"])
    analysis = analyze(model, x, network=net)
    p = cim_perturbation(model, preset_name, t, plan["delta"])
    cert = analysis.certify(p)
    last = len(net.layers) - 1
    pred = analysis.predictions
    inputs = [net.layer_input(x, l) for l in range(len(net.layers))]
    base = {name: net.steps[i].module.weight.detach() for name, i in zip(net.names, net.affine)}
    analog = convert_to_analog(model, preset(preset_name))
    over = [0] * len(net.layers)
    worst = [0.0] * len(net.layers)
    squares = [0.0] * len(net.layers)  # the chips' mean squared error per layer, against the prediction
    alphas = [0.0] * len(net.layers)  # and their drift compensation factors
    analog_by_name = dict(analog_layers(analog))
    flips = {"exact": 0, "lipschitz": 0, "first_order": [0] * last}
    chips_over = 0
    every = max(1, plan["chips"] // 10)
    bar = Progress(math.ceil(plan["chips"] / every), f"certify chips ({preset_name})", steps=every, enabled=progress)
    for c in range(plan["chips"]):
        program(analog, seed=seed + c)
        drift_to(analog, t, seed=seed + 100_000 + c)
        chip = _weights(net, _chip_weights(analog))
        exceeded = False
        for l, name in enumerate(net.names):
            err = float((chip[name].double() - base[name].double()).norm())
            worst[l] = max(worst[l], err / float(cert.eps[l]))
            squares[l] += err * err / plan["chips"]
            alphas[l] += float(analog_by_name[name].gdc_scale.mean()) / plan["chips"]
            lo, hi = p.detail["layers"][name]["alpha_interval"]
            scale = analog_by_name[name].gdc_scale
            # outside the factors the bound covers counts as exceeding it
            if err > float(cert.eps[l]) or float(scale.min()) < lo or float(scale.max()) > hi:
                over[l] += 1
                exceeded = True
        chips_over += exceeded
        lip = cert.certified["lipschitz"]
        if bool(lip.any()):
            flips["lipschitz"] += int(_flips(net, x[lip], pred[lip], chip).sum())
        ex = cert.certified["exact"]
        if bool(ex.any()):
            name = net.names[last]
            flips["exact"] += int(_flips(net, inputs[last][ex], pred[ex], {name: chip[name]}, last).sum())
        for l in range(last):
            ok = cert.per_layer[:, l]
            if bool(ok.any()):
                flips["first_order"][l] += int(_flips(net, inputs[l][ok], pred[ok], {net.names[l]: chip[net.names[l]]}, l).sum())
        bar.tick()
        if (c + 1) % every == 0 or c + 1 == plan["chips"]:
            bar.done(f"chips {c + 1}", f"bound exceeded on {chips_over}; flips of certified inputs: exact {flips['exact']}")
    bar.close()
    result = {"preset": preset_name, "time": plan["mc_time"], "delta": plan["delta"], "chips": plan["chips"],
              "inputs": len(x), "eps": [float(e) for e in cert.eps], "chips_exceeding_bound": chips_over,
              "exceeded_per_layer": over, "largest_error_over_bound": worst,
              "mean_sq_error": squares, "predicted_sq_error": [p.detail["layers"][n]["expected_sq_error"] for n in net.names],
              "alpha": alphas, "predicted_alpha": [p.detail["layers"][n]["alpha"] for n in net.names],
              "certified_inputs": {"exact": int(cert.certified["exact"].sum()),
                                   "lipschitz": int(cert.certified["lipschitz"].sum()),
                                   "first_order": [int(cert.per_layer[:, l].sum()) for l in range(last)]},
              "flips_of_certified": {"exact": flips["exact"], "lipschitz": flips["lipschitz"]},
              "first_order_violations": flips["first_order"], "layers": net.names}
    LOG.info(f"  chips, {preset_name} at {plan['mc_time']}: {plan['chips']} chips; weight error above its bound on "
             f"{chips_over} (largest error / bound {max(worst):.3f}); flips of certified inputs: exact {flips['exact']} "
             f"(of {result['certified_inputs']['exact']} certified), Lipschitz {flips['lipschitz']} "
             f"(of {result['certified_inputs']['lipschitz']})")
    return result


def chip_bound_check(workloads=WORKLOADS, preset_name: str = "pcm", times: str = "1s,1d,1y", chips: int = 1000,
                     delta: float = 0.01, batch: int = 100) -> list:
    """The chip bound against ``chips`` chips per workload drawn by the simulator's batched pass, every
    layer: per workload and time, the chips on which some layer's weight error exceeds its bound or its
    compensation factor falls outside the interval the bound covers, and the largest error / bound."""
    from hilt.cim_sim import analog_layers, convert_to_analog, drift_to, parse_time, preset, program

    rows = []
    labels = times.split(",")
    for workload in workloads:
        model, _ = workload_model(workload, None)
        bounds = cim_perturbations(model, preset_name, [parse_time(t) for t in labels], delta)
        analog = convert_to_analog(model, preset(preset_name))
        stats = {t: {"violations": 0, "outside_interval": 0, "worst": {}} for t in labels}
        for start in range(0, chips, batch):
            seeds = list(range(start, min(chips, start + batch)))
            program(analog, seeds=seeds)
            for t, bound in zip(labels, bounds):
                drift_to(analog, parse_time(t), seeds=[100_000 + s for s in seeds])
                bad = torch.zeros(len(seeds), dtype=torch.bool)
                outside = torch.zeros(len(seeds), dtype=torch.bool)
                for name, layer in analog_layers(analog):
                    lo, hi = bound.detail["layers"][name]["alpha_interval"]
                    held = (layer.held_weights() * layer.gdc_scale[..., None]).double()
                    ratio = (held - layer.w_digital.double()).flatten(1).norm(dim=1) / bound.eps[name]
                    out = (layer.gdc_scale.amin(1) < lo) | (layer.gdc_scale.amax(1) > hi)
                    bad |= (ratio > 1) | out
                    outside |= out
                    worst = stats[t]["worst"]
                    worst[name] = max(worst.get(name, 0.0), float(ratio.max()))
                stats[t]["violations"] += int(bad.sum())
                stats[t]["outside_interval"] += int(outside.sum())
        for t, bound in zip(labels, bounds):
            rows.append({"workload": workload, "preset": preset_name, "time": t, "chips": chips, "delta": delta,
                         **stats[t], "relative_bound": {n: d["relative_bound"] for n, d in bound.detail["layers"].items()}})
            r = rows[-1]
            LOG.info(f"{workload} {preset_name} {t}: {r['violations']} of {chips} chips violate (factor outside: "
                     f"{r['outside_interval']}); largest error / bound {max(r['worst'].values()):.3f}")
    return rows


# ----------------------------------------------------------------------------- the study


def study(quick: bool = False, workloads=WORKLOADS, progress: bool = False, seed: int = 0,
          plan: dict | None = None) -> dict:
    """The whole study (module docstring); ``quick``: small budgets (seconds); ``plan``: budgets to use
    instead (FULL, QUICK, REPORT or one of their own)."""
    plan = dict(plan if plan is not None else QUICK if quick else FULL)
    result = {"quick": quick, "plan": {k: list(v) if isinstance(v, tuple) else v for k, v in plan.items()},
              "workloads": {}}
    started = time.perf_counter()
    for workload in workloads:
        model, path = workload_model(workload, None)
        x, labels = fashion_test_set(plan["images"])
        LOG.info(f"{workload}: {len(x)} test images")
        net = Network(model, x)
        start = time.perf_counter()
        analysis = analyze(model, (x, labels), network=net)
        seconds = time.perf_counter() - start
        w = {"checkpoint": path.name, "images": len(x), "analysis_seconds": seconds,
             "accuracy": float((analysis.predictions == labels).double().mean()),
             "layers": [dict(layer.to_dict(), flip_norm_median=float(analysis.flip[:, l].median()),
                             **{f"flip_norm_p{q:02d}": float(analysis.flip[:, l].double().quantile(q / 100))
                                for q in (1, 10, 90, 99)})
                        for l, layer in enumerate(net.layers)],
             "margin_median": float(analysis.margins.median())}
        LOG.info(f"  analysed in {seconds:.1f} s; flip norm medians "
                 + ", ".join(f"{layer.name} {layer_row['flip_norm_median']:.3f}" for layer, layer_row in zip(net.layers, w["layers"])))
        w["compare"] = compare_bounds(net, analysis)
        LOG.info("  sound single-layer radius / flip norm (median): "
                 + ", ".join(f"{r['layer']} {r['median']:.3g}" for r in w["compare"]["single_layer"])
                 + f"; all layers at once vs the smallest single layer: {w['compare']['all_over_smallest_single']['median']:.3g}")
        w["quantization"], errors = quantization_rows(model, net, analysis, x, labels, plan)
        w["thresholds"] = compression_thresholds(net, analysis, errors, plan)
        w["cim"] = cim_rows(model, net, analysis, x, labels, plan)
        mc_x = x[: plan["mc_images"]]
        w["soundness"] = quantization_soundness(model, net, mc_x, plan, seed, progress=progress)
        w["chips"] = chip_soundness(model, net, mc_x, plan, plan["presets"][0], seed, progress=progress)
        w["line_search"] = line_search(net, mc_x, analyze(model, mc_x, network=net), plan["line_inputs"])
        LOG.info("  first order along its own direction (real flip scale, median / share below 1): "
                 + ", ".join(f"{r['layer']} {r['median']:.3f} / {r['below_1']:.2f}" for r in w["line_search"]))
        result["workloads"][workload] = w
    violations = {wl: (r["soundness"]["flips_of_certified"]["exact"] + r["soundness"]["flips_of_certified"]["lipschitz"]
                       + r["soundness"]["adversarial"]["exact"] + r["soundness"]["adversarial"]["lipschitz"]
                       + r["soundness"]["adversarial"]["pgd"])
                  for wl, r in result["workloads"].items()}
    result["sound_violations"] = violations  # must be all zero (the CLI fails otherwise, after writing the results)
    result["seconds"] = time.perf_counter() - started
    return _finite(result)


def _finite(value):
    """inf and nan as None: the JSON stays standard."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


# ----------------------------------------------------------------------------- tables and plots


def render(result: dict) -> str:
    """Markdown tables of the study (for the report and docs/results/certify.md)."""
    lines = []
    for wl, w in result["workloads"].items():
        lines += [f"**{wl.upper()}** ({w['images']} test images, accuracy {w['accuracy']:.4f}; analysed in "
                  f"{w['analysis_seconds']:.1f} s). Certified fraction against quantization (actual error; worst case "
                  f"in the rounding cells in brackets):", "",
                  "| format | accuracy | exact (last layer) | first order (each layer) | Lipschitz (all layers) |",
                  "|---|---|---|---|---|"]
        rows = w["quantization"]
        for a, b in zip(rows[0::2], rows[1::2]):
            lines.append(f"| {a['method']} {a['bits']}-bit | {a['accuracy']:.4f} | "
                         + " | ".join(f"{a['certified'][k]:.3f} ({b['certified'][k]:.3f})" for k in KINDS) + " |")
        lines += ["", "Against CIM chips (bound with probability >= "
                  f"{1 - result['plan']['delta']:g}; accuracy measured on {result['plan']['accuracy_chips']} simulated "
                  "chip(s), full analog forward / the chip's weights in digital arithmetic):", "",
                  "| preset | time | bound ||dW||/||W|| (per layer) | exact | first order | Lipschitz | accuracy | weights only |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in w["cim"]:
            lines.append(f"| {r['preset']} | {r['time']} | {', '.join(f'{v:.3f}' for v in r['relative_bound'])} | "
                         + " | ".join(f"{r['certified'][k]:.3f}" for k in KINDS)
                         + f" | {r['accuracy']:.4f} | {r['accuracy_weights_only']:.4f} |")
        lines += ["", "Compression threshold per layer (coarsest bits whose actual error stays under the flip norm of "
                  "99% of the inputs; sound: under the single-layer Lipschitz radius; '-': none of the bit widths):", "",
                  "| layer | needed ||dW||/||W|| | int | kmeans | int bits, extrapolated | needed (sound) | int (sound) | "
                  "kmeans (sound) | int bits, extrapolated (sound) |", "|---|---|---|---|---|---|---|---|---|"]
        fmt = lambda v: "-" if v is None else str(v)  # noqa: E731
        for r in w["thresholds"]:
            lines.append(f"| {r['layer']}{'' if r['exact'] else ' (first order)'} | {r['needed_relative_error']:.2e} | "
                         f"{fmt(r.get('int'))} | {fmt(r.get('kmeans'))} | {fmt(r.get('int_bits_extrapolated'))} | "
                         f"{r['needed_relative_error_sound']:.2e} | {fmt(r.get('int_sound'))} | {fmt(r.get('kmeans_sound'))} | "
                         f"{fmt(r.get('int_bits_extrapolated_sound'))} |")
        cmp = w["compare"]
        lines += ["", "Sound bound against the single-layer flip norms on the same inputs (median over inputs, "
                  "p10-p90 in brackets):", "", "| layer | sound single-layer radius / flip norm |", "|---|---|"]
        for r in cmp["single_layer"]:
            lines.append(f"| {r['layer']}{' (exact)' if r['exact'] else ' (first order)'} | {r['median']:.3g} "
                         f"({r['p10']:.3g}-{r['p90']:.3g}) |")
        lines.append(f"| all layers at once, each by the same share of its norm, / smallest single layer | "
                     f"{cmp['all_over_smallest_single']['median']:.3g} ({cmp['all_over_smallest_single']['p10']:.3g}-"
                     f"{cmp['all_over_smallest_single']['p90']:.3g}) |")
        s, ch = w["soundness"], w["chips"]
        lines += ["", (f"Monte-Carlo: {s['draws']} draws inside int8's rounding cells ({', '.join(s['draw_kinds'])}) on "
                      f"{s['inputs']} inputs: **{s['flips_of_certified']['exact']}** flips of the "
                      f"{s['certified_inputs']['exact']} exact-certified inputs, **{s['flips_of_certified']['lipschitz']}** "
                      f"of the {s['certified_inputs']['lipschitz']} Lipschitz-certified ones (cells scaled by "
                      f"{s['lipschitz_scale']:.3g}); gradient-aligned and PGD attacks: "
                      f"{s['adversarial']['exact']} / {s['adversarial']['lipschitz'] + s['adversarial']['pgd']} flips; "
                      f"first-order violation rate per hidden layer "
                      f"{', '.join(f'{v:.1e}' for v in s['first_order_violation_rate'])} (aligned attack: "
                      f"{', '.join(str(v) for v in s['adversarial']['first_order'])} flips of "
                      f"{', '.join(str(v) for v in s['certified_inputs']['first_order'])} certified). "
                      f"{ch['chips']} {ch['preset']} chips at {ch['time']}: weight error above its bound on "
                      f"{ch['chips_exceeding_bound']} (largest error / bound {max(ch['largest_error_over_bound']):.3f}); "
                      f"mean squared error per layer, chips / predicted: "
                      f"{', '.join(f'{a / b:.3f}' for a, b in zip(ch['mean_sq_error'], ch['predicted_sq_error']))}; "
                      f"drift compensation, chips / mean field: "
                      f"{', '.join(f'{a / b:.4f}' for a, b in zip(ch['alpha'], ch['predicted_alpha']))}; "
                      f"flips of the {ch['certified_inputs']['exact']} exact-certified inputs: "
                      f"{ch['flips_of_certified']['exact']}."),
                  "", "First-order flip norm against the real flip along its own direction (line search):", "",
                  "| layer | real / first order, median | 5th percentile | share below 1 | below 0.9 |", "|---|---|---|---|---|"]
        for r in w["line_search"]:
            lines.append(f"| {r['layer']}{' (exact)' if r['exact'] else ''} | {r['median']:.3f} | {r['p05']:.3f} | "
                         f"{r['below_1']:.3f} | {r['below_0.9']:.3f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def plot(result: dict, path) -> None:
    """Certified fraction against bits (one panel per workload); on a chip over time, the certified
    fraction beside the measured accuracy, and the last layer's bound against its flip norms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["workloads"])
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.4))
    colors = {"exact": "tab:blue", "first_order": "tab:orange", "lipschitz": "tab:green"}
    for ax, wl in zip(axes[0], names):
        rows = result["workloads"][wl]["quantization"]
        for method, style in (("int", "-"), ("kmeans", "--")):
            for kind in KINDS:
                pts = [(r["bits"], r["certified"][kind]) for r in rows if r["method"] == method and r["error"] == "actual"]
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", color=colors[kind], label=f"{KIND_LABELS[kind]}, {method}")
            acc = [(r["bits"], r["accuracy"]) for r in rows if r["method"] == method and r["error"] == "actual"]
            ax.plot(*zip(*acc), style, color="gray", lw=1, label=f"accuracy, {method}")
        ax.set_xlabel("bits per code (blocks of 64 or the largest divisor below)")
        ax.set_ylabel("fraction of test images")
        ax.set_title(f"{wl.upper()}: certified against the quantization error")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    ax, gap = axes[1]
    styles = {"pcm": "-", "rram": "--", "pcm-hwa": ":"}
    for wl, marker in zip(names, ("o", "s")):
        w = result["workloads"][wl]
        last = w["layers"][-1]
        for preset in dict.fromkeys(r["preset"] for r in w["cim"]):
            pr = [r for r in w["cim"] if r["preset"] == preset]
            t = [r["seconds"] for r in pr]
            style = styles.get(preset, "-")
            ax.plot(t, [r["certified"]["exact"] for r in pr], style, marker=marker, color=colors["exact"],
                    label=f"{wl} {preset}: certified (exact, last layer)")
            ax.plot(t, [r["accuracy"] for r in pr], style, marker=marker, color="gray", label=f"{wl} {preset}: accuracy")
            gap.plot(t, [r["relative_bound"][-1] for r in pr], style, marker=marker,
                     color="tab:red" if wl == names[0] else "tab:purple", label=f"{wl} {preset}: bound on ||dW||/||W||")
        for q, ls in (("flip_norm_median", "-"), ("flip_norm_p90", "--"), ("flip_norm_p99", ":")):
            gap.axhline(last[q] / last["weight_norm"], ls=ls, lw=1, color="tab:red" if wl == names[0] else "tab:purple",
                        label=f"{wl}: flip norm / ||W||, {q.split('_')[-1]} of images")
    for a in (ax, gap):
        a.set_xscale("log")
        a.set_xlabel("time after programming (s)")
        a.grid(alpha=0.3)
    ax.set_ylabel("fraction of test images")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"on a chip: certified (probability >= {1 - result['plan']['delta']:g}) and measured accuracy")
    ax.legend(fontsize=6)
    gap.set_yscale("log")
    gap.set_ylabel("last layer: relative Frobenius norm")
    gap.set_title("the chip's error bound against the flip norms (last layer)")
    gap.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":  # python -m hilt.bench.studies.certify: the chip bound on 1,000 chips per workload
    import json
    import logging
    import sys

    # run directly, not through `hilt`: nothing else sends the hilt logger's lines anywhere
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    torch.set_num_threads(1)  # a chip's small products run faster on one thread than on busy several
    print(json.dumps(chip_bound_check(chips=int(sys.argv[1]) if len(sys.argv) > 1 else 1000), indent=1))
