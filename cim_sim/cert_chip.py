"""The perturbation a CIM chip makes, for the certificates: a bound on ||Delta W_l||_F of every layer
at time t after programming that holds for all layers at once with probability >= 1 - delta under
the device model of cim_sim.devices, for every drift-compensation factor in a reported interval
(the derivation and its one approximation: docs/certify.md, item 4).
"""

from __future__ import annotations

import functools
import math
import types

import torch
from torch import nn

from hilt.errors import HiltError
from hilt.quant.cert_quant import Perturbation, weight_layers

def _legendre(n: int = 32) -> tuple:
    import numpy as np

    x, w = np.polynomial.legendre.leggauss(n)
    return torch.from_numpy(x), torch.from_numpy(w)


def _normal_pdf(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _rectified_moments(s: torch.Tensor) -> torch.Tensor:
    """E[max(0, 1 + s N(0,1))^k] for k = 0..4 (stacked first), from the partial moments
    M_j = E[Z^j; Z > a] of a standard normal, a = -1/s: M_0 = Phi(-a), M_1 = phi(a),
    M_j = a^(j-1) phi(a) + (j-1) M_(j-2); then the binomial sums sum_j C(k, j) s^j M_j."""
    a = (-1 / s.clamp_min(1e-300)).clamp_min(-40.0)
    pdf = _normal_pdf(a)
    m0, m1 = torch.special.ndtr(-a), pdf
    m2 = a * pdf + m0
    m3 = a * a * pdf + 2 * m1
    m4 = a * a * a * pdf + 3 * m2
    t1, t2 = s * m1, s * s * m2
    t3, t4 = s * s * s * m3, s * s * s * s * m4
    return torch.stack([m0, m0 + t1, m0 + 2 * t1 + t2, m0 + 3 * t1 + 3 * t2 + t3, m0 + 4 * t1 + 6 * t2 + 4 * t3 + t4])


def _folded_laplace(mu: torch.Tensor, sd: torch.Tensor, lam: float) -> torch.Tensor:
    """E[exp(-lam |X|)], X ~ N(mu, sd^2): exp(-lam mu + lam^2 sd^2 / 2) Phi(mu/sd - lam sd) +
    exp(lam mu + lam^2 sd^2 / 2) Phi(-mu/sd - lam sd), in log space."""
    half = 0.5 * lam * lam * sd * sd
    return (torch.exp(-lam * mu + half + torch.special.log_ndtr(mu / sd - lam * sd))
            + torch.exp(lam * mu + half + torch.special.log_ndtr(-mu / sd - lam * sd)))


def _q_kink(dev) -> float:
    """The conductance below which the read-noise coefficient Q(g) sits at its cap (a kink in the
    integrand: the quadrature splits there)."""
    top = float(dev.read_noise_coefficient(torch.zeros(1, dtype=torch.float64)))
    lo, hi = 0.0, dev.g_max
    for _ in range(80):
        mid = (lo + hi) / 2
        if float(dev.read_noise_coefficient(torch.tensor([mid], dtype=torch.float64))) >= top * (1 - 1e-12):
            lo = mid
        else:
            hi = mid
    return hi


def _noise_integrals(dev, g_target: torch.Tensor, t: float, nodes: int = 32, chunk: int = 65536) -> torch.Tensor:
    """I_k = E[g_p^k max(0, 1 + sigma_r Q(g_p) eta)^k], k = 0..4 (stacked first): the programming and read
    noise part of E[g^k] (smooth in g_T), by Gauss-Legendre quadrature over xi in two pieces split where
    Q stops being capped; g_p = 0 (xi below -g_T / sigma_p) adds nothing for k >= 1."""
    x, w = _legendre(nodes)
    flat = g_target.reshape(-1)
    out = torch.empty(5, flat.numel(), dtype=torch.float64)
    sr = dev.read_sigma(t)
    kink = _q_kink(dev)
    for c in range(0, flat.numel(), chunk):
        gt = flat[c : c + chunk]
        sp = dev.programming_sigma(gt).clamp_min(1e-12)
        lo = (-gt / sp).clamp_min(-9.0)
        hi = torch.clamp(lo + 1.0, min=9.0)
        split = ((kink - gt) / sp).clamp(min=lo, max=hi)
        total = torch.zeros(5, gt.numel(), dtype=torch.float64)
        for a, b in ((lo, split), (split, hi)):
            half = (b - a)[:, None] / 2
            xi = (a + b)[:, None] / 2 + half * x  # (devices, nodes)
            weight = half * w * _normal_pdf(xi)
            gp = (gt[:, None] + sp[:, None] * xi).clamp_min(0)
            rect = _rectified_moments(sr * dev.read_noise_coefficient(gp))  # (5, devices, nodes)
            total += (torch.stack([gp**k for k in range(5)]) * rect * weight).sum(-1)
        total[0] = 1.0  # k = 0: the whole probability mass
        out[:, c : c + chunk] = total
    return out.view(5, *g_target.shape)


def _drift_moments(dev, g_target: torch.Tensor, t: float) -> torch.Tensor:
    """E[(T/t0)^(-k nu)], k = 0..4, in closed form (nu independent of the programming and read noise)."""
    mu, sd, factor = dev.drift_law(g_target)
    log_t = math.log((t + dev.t0) / dev.t0)
    return torch.stack([_folded_laplace(mu, sd, k * log_t * factor) for k in range(5)])


def _combine(dev, integrals: torch.Tensor, drift: torch.Tensor, t: float, stuck_rate: float) -> torch.Tensor:
    moments = integrals * drift
    if stuck_rate:  # half the stuck devices read 0; half sit at g_max, then drift and read noise as usual
        q_max = dev.read_noise_coefficient(torch.tensor([dev.g_max], dtype=torch.float64))
        rect = _rectified_moments(dev.read_sigma(t) * q_max)[:, 0]
        at_max = torch.stack([dev.g_max**k * rect[k] for k in range(5)]).view(5, *[1] * (drift.dim() - 1)) * drift
        at_zero = torch.zeros_like(moments)
        at_zero[0] = 1.0
        moments = (1 - stuck_rate) * moments + (stuck_rate / 2) * (at_max + at_zero)
    return moments


def device_moments(dev, g_target: torch.Tensor, t: float, stuck_rate: float = 0.0, nodes: int = 32) -> torch.Tensor:
    """E[g^k], k = 0..4 (stacked first), of a device with target conductance ``g_target`` (uS, float64)
    read t seconds after programming, under the device model (docs/certify.md, item 4)."""
    return _combine(dev, _noise_integrals(dev, g_target, t, nodes), _drift_moments(dev, g_target, t), t, stuck_rate)


ALPHA_SDS = 4.0  # half-width of the compensation factors covered, in standard deviations of the probe's read-outs
_GRID = 4097  # target conductances at which the device moments are tabulated (every 1/4096 of g_max)


@functools.lru_cache(maxsize=64)
def _noise_table(dev, t: float, nodes: int) -> torch.Tensor:
    """The noise integrals on _GRID target conductances from 0 to g_max, once per device and time."""
    return _noise_integrals(dev, torch.linspace(0, dev.g_max, _GRID, dtype=torch.float64), t, nodes)


def _interpolate(table: torch.Tensor, g: torch.Tensor, g_max: float) -> torch.Tensor:
    """The tabulated noise integrals (5, _GRID) at conductances ``g``, linearly interpolated (they are
    smooth in g_T; the drift law, which has kinks where its clips engage, is evaluated exactly per device)."""
    pos = g * ((_GRID - 1) / g_max)
    i = pos.floor().clamp(0, _GRID - 2).long()
    frac = pos - i
    return table[:, i] * (1 - frac) + table[:, i + 1] * frac


def _pair_moments(pos: torch.Tensor, neg: torch.Tensor, unit: float) -> torch.Tensor:
    """E[W^k], k = 0..4, of W = (G+ - G-) * unit from independent devices' moments."""
    return torch.stack([sum(math.comb(k, j) * pos[j] * (-1) ** (k - j) * neg[k - j] for j in range(k + 1)) * unit**k
                        for k in range(5)])


def _abs_mean(mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """E|Y| for Y ~ N(mean, var) (the folded normal's mean)."""
    sd = var.clamp_min(1e-300).sqrt()
    return (sd * math.sqrt(2 / math.pi) * torch.exp(-0.5 * (mean / sd) ** 2)
            + mean * (1 - 2 * torch.special.ndtr(-mean / sd)))


def _probe_read(config, probe: torch.Tensor, mean_w: torch.Tensor, var_w: torch.Tensor, unit: float) -> tuple:
    """The drift-compensation probe through arrays holding weights of mean ``mean_w`` and variance
    ``var_w`` (out, in), per output column: the mean-field mean of R_o = mean over rows of |y_ro|
    (Gaussian y, plus the variance of output noise, ADC and DAC rounding per array; noise management
    scales each array's slice of the input by its abs-max), and an Efron-Stein bound on Var R_o: the
    weights are independent and |y| is 1-Lipschitz, so resampling W_ok moves R_o by at most
    a_k |dW_ok| with a_k = mean_r |p_rk| (E dW^2 = 2 Var W), and a row's noise moves it by |dn| / rows.
    ``unit``: the weight the arrays hold as 1 (AnalogMixin.w_unit). -> (mean (out,), var bound (out,))."""
    from hilt.cim_sim.config import array_bounds

    in_step, out_step = config.converter_steps()
    mean = probe @ mean_w.T
    var = (probe * probe) @ var_w.T
    extra_all = torch.zeros_like(mean)
    for k0, k1 in array_bounds(probe.shape[1], config.tile_size):
        xs = probe[:, k0:k1].abs().amax(1, keepdim=True)  # (rows, 1)
        extra = (config.out_noise * unit * xs) ** 2
        if config.adc_bits is not None:
            extra = extra + (unit * out_step * xs) ** 2 / 12
        if config.dac_bits is not None:
            second = (mean_w[:, k0:k1] ** 2 + var_w[:, k0:k1]).sum(1)
            extra = extra + (xs * in_step) ** 2 / 12 * second[None, :]
        extra_all = extra_all + extra
    rows = probe.shape[0]
    a = probe.abs().mean(0)
    spread = var_w @ (a * a) + extra_all.sum(0) / rows**2
    return _abs_mean(mean, var + extra_all).mean(0), spread


def _cantelli(mean: float, var: float, delta: float) -> float:
    """k-free form: the value S stays below with probability >= 1 - delta given only its mean and
    variance (Cantelli: P(S >= E S + k) <= Var / (Var + k^2))."""
    return mean + math.sqrt(max(var, 0.0) * (1 - delta) / delta)


def cim_perturbation(model: nn.Module, config="pcm", t_seconds: float = 0.0, delta: float = 0.01,
                     gdc: str = "global", seed: int = 0, nodes: int = 32) -> Perturbation:
    """Per-layer bounds on ||Delta W||_F of ``model`` on a chip (an AnalogConfig or a preset name) read
    ``t_seconds`` after programming, holding for all layers at once with probability >= 1 - delta over
    the chip for every drift-compensation factor inside the interval each layer's detail reports
    (``alpha_interval``; docs/certify.md, item 4). Layers the simulator keeps digital get no bound.
    ``seed``: the programming seed whose drift-compensation probe is used (cim_sim.model)."""
    return cim_perturbations(model, config, [t_seconds], delta, gdc, seed, nodes)[0]


def cim_perturbations(model: nn.Module, config="pcm", times=(0.0,), delta: float = 0.01, gdc: str = "global",
                      seed: int = 0, nodes: int = 32) -> list:
    """:func:`cim_perturbation` at each of ``times`` (seconds), sharing the work that does not depend on time."""
    from hilt.cim_sim.config import AnalogConfig, preset
    from hilt.cim_sim.model import GDC_MODES, gdc_probe_input

    name = config if isinstance(config, str) else None
    config = preset(config) if isinstance(config, str) else config
    if not isinstance(config, AnalogConfig):
        raise HiltError(f"a chip is an AnalogConfig or a preset name, got {type(config).__name__}")
    modes = [m for m in GDC_MODES if m != "aihwkit"]  # per-array identity read-outs are not modelled
    if gdc not in modes:
        raise HiltError(f"certificates take drift compensation {', '.join(modes)}; got {gdc!r}")
    if not 0 < delta < 1:
        raise HiltError(f"delta must be in (0, 1), got {delta}")
    if config.weight_mapping != "layer":  # the moments below map each layer with one scale
        raise HiltError(f"certificates model one programming scale per layer; got weight_mapping="
                        f"{config.weight_mapping!r}")
    if config.devices_per_weight != 1:  # nor do they average several devices per side
        raise HiltError(f"certificates model one device pair per weight; got devices_per_weight="
                        f"{config.devices_per_weight}")
    times = [float(t) for t in times]
    if not all(t >= 0 for t in times):
        raise HiltError(f"time after programming must be >= 0 s, got {min(times)}")
    dev = config.device_model()
    layers = [(n, m) for n, m in weight_layers(model) if isinstance(m, (nn.Linear, nn.Conv2d))]
    share = delta / max(1, len(layers)) / (2 if config.w_noise else 1)  # union bound over layers (and terms)
    out = [({}, {"chip": name or config.device, "seconds": t, "delta": delta, "gdc": gdc, "layers": {}}) for t in times]
    for lname, m in layers:
        w = m.weight.detach().reshape(m.weight.shape[0], -1).double()
        if dev is None:  # the ideal device holds the digital weights
            for eps, _ in out:
                eps[lname] = 0.0
            continue
        w_max = float(w.float().abs().max()) or 1.0
        scale = dev.g_max / w_max
        unit = w_max if config.weight_scaling else 1.0
        targets = torch.cat([(w * scale).clamp(0, dev.g_max).reshape(-1), (-w * scale).clamp(0, dev.g_max).reshape(-1)])
        values, inverse = torch.unique(targets, return_inverse=True)  # half the devices at least target 0

        def moments_at(t):
            integrals = _interpolate(_noise_table(dev, t, nodes), values, dev.g_max)
            mom = _combine(dev, integrals, _drift_moments(dev, values, t), t, config.stuck_at_rate)[:, inverse]
            pos, neg = mom[:, : w.numel()].view(5, *w.shape), mom[:, w.numel():].view(5, *w.shape)
            return _pair_moments(pos, neg, 1 / scale)

        probe = ref = None
        ref_var = 0.0
        if gdc != "none":
            probe = gdc_probe_input(types.SimpleNamespace(w_digital=w.float()), torch.Generator().manual_seed(seed)).double()
            if gdc == "exact":  # the ideal read-out: no randomness
                ref = (probe @ w.T).abs().mean(0)
            else:
                e0 = moments_at(0.0)
                ref, ref_var = _probe_read(config, probe, e0[1], (e0[2] - e0[1] ** 2).clamp_min(0), unit)
        for t, (eps, detail) in zip(times, out):
            ew = moments_at(t)
            lo = hi = centre = torch.ones(w.shape[0], 1, dtype=torch.float64)
            if gdc != "none":
                now, now_var = _probe_read(config, probe, ew[1], (ew[2] - ew[1] ** 2).clamp_min(0), unit)
                r, n, vr, vn = (ref, now, ref_var, now_var) if gdc == "column" else \
                    (ref.sum(), now.sum(), ref_var.sum() if torch.is_tensor(ref_var) else 0.0, now_var.sum())
                # the interval of factors the bound covers: the mean-field factor widened by ALPHA_SDS
                # Efron-Stein standard deviations of both read-outs (per column: more, for the largest of
                # many). A design choice, not a probability: the chip computes its own factor and is
                # covered when the factor lies inside (the detail reports the interval).
                k = ALPHA_SDS + (math.sqrt(2 * math.log(w.shape[0])) if gdc == "column" else 0.0)
                n_lo = n - k * torch.as_tensor(vn).sqrt()
                if bool((n_lo <= 0).any()):
                    raise HiltError(f"layer '{lname}': the drift-compensation probe reads too little at {t:g} s "
                                    "to bound the compensation factor; certify it with gdc='none'")
                r_sd = torch.as_tensor(vr, dtype=torch.float64).sqrt()
                centre = (r / n).reshape(-1, 1).expand(w.shape[0], 1)
                lo = ((r - k * r_sd).clamp_min(0) / (n + k * torch.as_tensor(vn).sqrt())).reshape(-1, 1).expand(w.shape[0], 1)
                hi = ((r + k * r_sd) / n_lo).reshape(-1, 1).expand(w.shape[0], 1)

            def error_moments(alpha):
                """Mean and variance of S = ||alpha W - w||_F^2 for fixed factors alpha (out, 1)."""
                d2 = alpha**2 * ew[2] - 2 * alpha * w * ew[1] + w * w
                d4 = sum(math.comb(4, j) * alpha**j * ew[j] * (-w) ** (4 - j) for j in range(5))
                return float(d2.sum()), float((d4 - d2 * d2).clamp_min(0).sum())

            mean_s, var_s = error_moments(centre)
            if gdc == "none":
                bound = math.sqrt(_cantelli(mean_s, var_s, share))
            elif gdc != "column":
                # one factor per layer: S is a convex quadratic in it, so its largest value over [lo, hi]
                # is at an end; each end bounded with half the share
                bound = math.sqrt(max(_cantelli(*error_moments(end), share / 2) for end in (lo, hi)))
            else:
                # per column: ||alpha W - w|| <= ||c W - w|| + ||(alpha - c) W||, (alpha - c)_o at most r_o
                half = torch.maximum(hi - centre, centre - lo)
                sq = half**2 * ew[2]
                spread = math.sqrt(_cantelli(float(sq.sum()), float((half**4 * (ew[4] - ew[2] ** 2)).clamp_min(0).sum()),
                                             share / 2))
                bound = math.sqrt(_cantelli(mean_s, var_s, share / 2)) + spread
            noise = 0.0
            if config.w_noise:  # per-read weight noise N(0, w_noise^2 unit |W|), times alpha (at most hi)
                c = config.w_noise**2 * unit
                noise = math.sqrt(_cantelli(float((hi**2 * c * ew[2].sqrt()).sum()),  # E|W| <= sqrt(E W^2)
                                            float((3 * hi**4 * c * c * ew[2]).sum()), share))  # Var <= E N^4
            eps[lname] = bound + noise
            detail["layers"][lname] = {"expected_sq_error": mean_s, "sd_sq_error": math.sqrt(var_s), "bound": bound,
                                       "read_noise_bound": noise, "alpha": float(centre.mean()),
                                       "alpha_interval": [float(lo.min()), float(hi.max())],
                                       "relative_bound": eps[lname] / max(float(w.norm()), 1e-30)}
    return [Perturbation(eps, "chip", 1 - delta, detail) for eps, detail in out]
