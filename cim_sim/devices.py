"""Device models: how a programmed conductance deviates from its target, and drifts.

All functions work on whole tensors of conductances (µS) at once and take a
``torch.Generator`` for every random draw (the same seed gives the same numbers).

PCM follows the statistical model fitted to measured phase-change devices that
IBM's aihwkit ships as ``PCMLikeNoiseModel`` (REFERENCES.md §4), with
g_max = 25 µS, t0 = 20 s, t_read = 250 ns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# N(0, 1) at the midpoints of 65536 equal-probability bins: a draw is one lookup by 16 random bits
_QUANTILES = torch.special.ndtri((torch.arange(65536, dtype=torch.float64) + 0.5) / 65536).float()


def gaussian_(out: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Fill ``out`` (contiguous) with N(0, 1) draws for per-read noise, from ``gen``.

    The noise drawn afresh for every device at every read is most of a drift step, and torch's
    CPU sampler spends half its time on Box-Muller. Here each draw is 16 random bits looking up
    one of 65536 equal-probability quantiles (measured: a drift step of the MLP 3.5 -> 2.7 ms,
    its pcm forward 2.3 -> 2.0 ms); mean exact, variance 1 - 2e-5, tails cut at 4.3 sigma (a
    probability of 1.5e-5), far inside the noise models' own uncertainty. Programming noise and
    drift exponents, drawn once, use torch.randn.
    """
    n = out.numel()
    bits = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), 2**63 - 1, generator=gen)
    index = bits.view(torch.uint16)[:n].to(torch.int32)
    table = _QUANTILES if out.dtype == torch.float32 else _QUANTILES.to(out.dtype)
    return torch.index_select(table, 0, index, out=out.view(-1)).view(out.shape)


@dataclass(frozen=True)
class PCM:
    g_max: float = 25.0  # µS
    t0: float = 20.0  # s, time of the first read after programming
    t_read: float = 250e-9  # s
    prog_noise_scale: float = 1.0
    read_noise_scale: float = 1.0
    drift_scale: float = 1.0

    def programming_sigma(self, g_target: torch.Tensor) -> torch.Tensor:
        x = g_target / self.g_max
        return (0.26348 + 1.9650 * x - 1.1731 * x * x) * (self.g_max / 25.0) * self.prog_noise_scale

    def program(self, g_target: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """g_prog = max(0, g_T + sigma(g_T) * N(0, 1)), for every device (a zero target included)."""
        return (g_target + self.programming_sigma(g_target) * torch.randn(g_target.shape, generator=gen, dtype=g_target.dtype)).clamp_min_(0)

    def drift_exponent(self, g_target: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """nu = |mu(g_T) + sigma(g_T) N(0,1)|, drawn once per device at programming."""
        x = (g_target.abs() / self.g_max).clamp_min(1e-7)
        mu = (-0.0155 * torch.log(x) + 0.0244).clamp(0.049, 0.1)
        sd = (-0.0125 * torch.log(x) - 0.0059).clamp(0.008, 0.045)
        nu = (mu + sd * torch.randn(g_target.shape, generator=gen, dtype=g_target.dtype)).abs()
        return nu * self.drift_scale

    def read_noise_coefficient(self, g_prog: torch.Tensor) -> torch.Tensor:
        """Q(g_prog) of the 1/f read noise; depends only on the programmed state (computed once)."""
        return (0.0088 / (g_prog.abs() / self.g_max).pow(0.65).clamp_min(1e-3)).clamp_max(0.2)

    def read(self, g_prog: torch.Tensor, nu: torch.Tensor, t: float, gen: torch.Generator,
             q: torch.Tensor | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Conductance read t seconds after programming: drift, then 1/f read noise (a fresh draw).

        g = max(0, g_drift (1 + Q sqrt(ln((T + t_read) / (2 t_read))) N(0,1))),
        g_drift = g_prog (T / t0)^-nu, T = t + t0 (g_prog >= 0). ``q``: precomputed Q(g_prog).
        ``out``: two tensors shaped like g_prog to work in (the result is the first); reusing
        them at every read saves the page faults of fresh allocations, a third of a read's time.
        """
        T = t + self.t0
        q = self.read_noise_coefficient(g_prog) if q is None else q
        sigma = math.sqrt(math.log((T + self.t_read) / (2 * self.t_read))) * self.read_noise_scale
        g_buf, noise_buf = out if out is not None else (None, None)
        g = torch.mul(nu, -math.log(T / self.t0), out=g_buf).exp_().mul_(g_prog)
        noise = gaussian_(torch.empty_like(g) if noise_buf is None else noise_buf, gen)
        return g.addcmul_(g, noise.mul_(q), value=sigma).clamp_min_(0)  # g + sigma g Q N: three passes with the clamp, not five


@dataclass(frozen=True)
class RRAM(PCM):
    """A filamentary RRAM variant: flat 5% programming noise, weak drift, the PCM read-noise law.

    Our own simplification (documented, not fitted to a published device):
    RRAM relaxes much less than PCM over time, so nu is PCM's scaled by 0.1.
    """

    prog_relative: float = 0.05

    def programming_sigma(self, g_target: torch.Tensor) -> torch.Tensor:
        return self.prog_relative * self.g_max * torch.ones_like(g_target) * self.prog_noise_scale

    def drift_exponent(self, g_target, gen):
        return super().drift_exponent(g_target, gen) * 0.1


def mismatch(w: torch.Tensor, eta: float, gen: torch.Generator) -> torch.Tensor:
    """The generic robustness model: every weight becomes w * (1 + eta * N(0, 1))."""
    return w * (1 + eta * torch.randn(w.shape, generator=gen, dtype=w.dtype))


def stuck_at(g: torch.Tensor, rate: float, g_max: float, gen: torch.Generator) -> torch.Tensor:
    """A fraction ``rate`` of devices stuck, half at 0 (open) and half at g_max (shorted)."""
    if rate <= 0:
        return g
    u = torch.rand(g.shape, generator=gen, dtype=g.dtype)
    g = torch.where(u < rate / 2, torch.zeros_like(g), g)
    return torch.where((u >= rate / 2) & (u < rate), torch.full_like(g, g_max), g)
