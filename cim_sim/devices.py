"""Device models: how a programmed conductance deviates from its target, and drifts.

All functions work on whole tensors of conductances (µS) at once and take a
``torch.Generator`` for every random draw (the same seed gives the same numbers).

PCM follows the statistical model fitted to measured phase-change devices that
IBM's aihwkit ships as ``PCMLikeNoiseModel`` (docs/references.md §4), with
g_max = 25 µS, t0 = 20 s, t_read = 250 ns.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

# -- per-read noise -----------------------------------------------------------------------------
# N(0, 1) at the midpoints of 65536 equal-probability bins: a draw is one lookup by 16 random bits.
# Mean exact, variance 1 - 2e-5, tails cut at 4.33 sigma (a probability of 1.5e-5), far inside the
# noise models' own uncertainty; torch's CPU sampler spends half its time on Box-Muller instead.
_QUANTILES = torch.special.ndtri((torch.arange(65536, dtype=torch.float64) + 0.5) / 65536)
NORMAL_TABLES = {torch.float64: _QUANTILES, torch.float32: _QUANTILES.float()}


def gaussian_(out: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Fill ``out`` (contiguous) with N(0, 1) draws for the forward's per-read noise, from ``gen``:
    16 bits of torch's generator per draw (four draws per int64) looking up the table above."""
    n = out.numel()
    bits = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), 2**63 - 1, generator=gen)
    index = bits.view(torch.uint16)[:n].to(torch.int32)
    return torch.index_select(NORMAL_TABLES[out.dtype], 0, index, out=out.view(-1)).view(out.shape)


# The read noise of a drift step is drawn afresh for every device, and is most of the step. There
# the 16 bits come from a counter-based generator instead: draw i of a read is a hash of i and two
# keys the read takes from the caller's generator. With no sequential state, torch.compile fuses
# the draws with the drift arithmetic into one parallel pass over the devices; torch's sampler is
# serial. Integer arithmetic in int32, wrapping on overflow; right shifts masked to be logical.

def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer mixer (xorshift-multiply with the constants of C. Wellons' lowbias32)."""
    x = (x ^ ((x >> 16) & 0xFFFF)) * 0x21F0AAAD
    x = (x ^ ((x >> 15) & 0x1FFFF)) * (0xD35A2D97 - (1 << 32))  # as a signed int32
    return x ^ ((x >> 15) & 0x1FFFF)


def hashed_normal(n: int, keys: torch.Tensor, start: torch.Tensor | None = None) -> torch.Tensor:
    """Draws 0..n-1 keyed by ``keys`` (two int32; or (K, 2) for K independent streams, shape (K, n)),
    in float32. A hash of a hash: two keys share (almost) no hashed counter, so their draws are
    independent. ``start`` (R int32, with two keys): R rows, row r holding draws start[r] .. start[r] + n - 1
    of the one stream (a slice of a longer read, the same numbers), shape (R, n)."""
    i = torch.arange(n, dtype=torch.int32)
    if start is not None:
        i = i.view(1, n) + start.view(-1, 1)
    if keys.dim() == 2:
        x = _hash32(_hash32(i.view(1, n) ^ keys[:, :1]) ^ keys[:, 1:])
    else:
        x = _hash32(_hash32(i ^ keys[0]) ^ keys[1])
    return NORMAL_TABLES[torch.float32][(x >> 16) & 0xFFFF]


def _drifted_read(g_prog, nu, q, log_t, sigma, keys):
    """g_prog (T/t0)^-nu (1 + sigma Q N), clipped at 0 (PCM.read): one pass over the devices when compiled."""
    g = g_prog * torch.exp(nu * -log_t)
    noise = hashed_normal(g_prog.numel(), keys).view(g_prog.shape).to(g_prog.dtype)
    return (g + sigma * g * q * noise).clamp_min(0)


def _pairs_read(g, z, w, scale, g_max, factor, log_t, sigma, keys, start):
    """One layer's differential pairs read at log(T / t0) = log_t, each weight's G+ - G- averaged over its
    n devices per side (one pass when compiled, never storing a device's read), all flat and every
    parameter a tensor so that one compiled loop serves every layer and device: ``g`` (2, n K) as
    programmed, in weight units (G / scale), device j of weight k at j K + k; ``z`` the normal draws of
    their drift exponents (nu = ``factor`` |mu + sd z|); the targets w * scale on G+ and -w * scale on G-
    (w, scale: K; both clipped to [0, g_max]), as programming set them; device i of side s draws read
    noise start[s] + i of ``keys``. PCM.read's arithmetic, per device. Returns K weights."""
    shape = (2, -1, w.shape[0])
    g, z = g.view(shape), z.view(shape)
    target = (torch.stack([w, -w]) * scale).clamp_min(0).minimum(g_max).unsqueeze(1)
    mu, sd = _drift_moments(target, g_max)
    nu = (mu + sd * z).abs() * factor
    q = _read_noise_coefficient(g * scale, g_max)
    drifted = g * torch.exp(nu * -log_t)
    noise = hashed_normal(g.shape[1] * g.shape[2], keys, start).view(g.shape).to(g.dtype)
    read = (drifted + sigma * drifted * q * noise).clamp_min(0)
    return (read[0] - read[1]).mean(0)


# PCM's device laws (RRAM's the same, its drift scaled), as functions for the compiled read to share

def _drift_moments(g_target: torch.Tensor, g_max) -> tuple[torch.Tensor, torch.Tensor]:
    """mu(g_T) and sd(g_T) of the drift exponent's normal before its absolute value."""
    x = (g_target.abs() / g_max).clamp_min(1e-7)
    mu = (-0.0155 * torch.log(x) + 0.0244).clamp(0.049, 0.1)
    sd = (-0.0125 * torch.log(x) - 0.0059).clamp(0.008, 0.045)
    return mu, sd


def _read_noise_coefficient(g_prog: torch.Tensor, g_max) -> torch.Tensor:
    # x^0.65 as exp(0.65 ln x) (x = 0 included): compiled, a vectorized loop where pow is not (2x the read's speed)
    return (0.0088 / torch.exp(0.65 * torch.log(g_prog.abs() / g_max)).clamp_min(1e-3)).clamp_max(0.2)


def compiled(fn):
    """``fn`` compiled by torch.compile (inductor: one C++ loop) on first use. Where compiling fails
    (no C++ compiler), ``fn`` itself after one warning: the same draws, several times slower."""
    fast = None

    def call(*args):
        nonlocal fast
        if fast is None:
            fast = torch.compile(fn, dynamic=True)
        try:
            return fast(*args)
        except Exception as e:  # any compile failure; a bug in fn raises again below
            if fast is fn:
                raise
            reason = (str(e).strip().splitlines() or [""])[0][:200]
            warnings.warn(f"torch.compile of {fn.__name__} failed ({type(e).__name__}: {reason}); it runs "
                          "uncompiled, several times slower", stacklevel=2)
            fast = fn
            return fn(*args)

    return call


_drifted_read_compiled = compiled(_drifted_read)
_pairs_read_compiled = compiled(_pairs_read)


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
        z = torch.randn(g_target.shape, generator=gen, dtype=g_target.dtype)
        return z.mul_(self.programming_sigma(g_target)).add_(g_target).clamp_min_(0)  # in place: one device-sized temporary

    @property
    def drift_factor(self) -> float:
        """What the drift exponents are scaled by (``drift_scale``)."""
        return self.drift_scale

    def drift_law(self, g_target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(mu, sd, factor): the drift exponent is nu = factor |mu(g_T) + sd(g_T) N(0,1)|
        (drift_exponent draws it; cim_sim.cert_chip takes its moments in closed form)."""
        return *_drift_moments(g_target, self.g_max), self.drift_factor

    def drift_exponent(self, g_target: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """nu = |mu(g_T) + sigma(g_T) N(0,1)|, drawn once per device at programming."""
        return self.drift_exponent_of(g_target, torch.randn(g_target.shape, generator=gen, dtype=g_target.dtype))

    def drift_exponent_of(self, g_target: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The drift exponents of devices programmed to ``g_target`` whose normal draws were ``z``."""
        mu, sd, factor = self.drift_law(g_target)
        return (mu + sd * z).abs() * factor

    def read_noise_coefficient(self, g_prog: torch.Tensor) -> torch.Tensor:
        """Q(g_prog) of the 1/f read noise; depends only on the programmed state."""
        return _read_noise_coefficient(g_prog, self.g_max)

    def read(self, g_prog: torch.Tensor, nu: torch.Tensor, t: float, gen: torch.Generator,
             q: torch.Tensor | None = None) -> torch.Tensor:
        """Conductance read t seconds after programming: drift, then 1/f read noise (a fresh draw).

        g = max(0, g_drift (1 + Q sqrt(ln((T + t_read) / (2 t_read))) N(0,1))),
        g_drift = g_prog (T / t0)^-nu, T = t + t0 (g_prog >= 0). ``q``: precomputed Q(g_prog).
        """
        q = self.read_noise_coefficient(g_prog) if q is None else q
        return _drifted_read_compiled(g_prog, nu, q, *self._time_args(t, g_prog.dtype), self.read_keys(gen))

    def read_pairs(self, g: torch.Tensor, z: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, t: float,
                   keys: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """One layer's pairs read t seconds after programming, as ``read`` reads each device, G+ - G- averaged
        over the devices per side: shaped like ``w``, in weight units. ``g`` (2, n, *w.shape): the programmed
        conductances over ``scale`` (programmed to the targets +-w * scale; ``scale`` broadcasts to w);
        ``z``: the normal draws of their drift exponents; device i of side s takes read-noise draw
        start[s] + i of ``keys`` (read_keys)."""
        flat = (2, -1)
        w_flat, scale_flat = w.reshape(-1), scale.expand(w.shape).contiguous().view(-1)  # one stride: one compile
        device = (torch.tensor(v, dtype=g.dtype) for v in (self.g_max, self.drift_factor))
        out = _pairs_read_compiled(g.reshape(flat), z.reshape(flat), w_flat, scale_flat, *device,
                                   *self._time_args(t, g.dtype), keys, start)
        return out.view(w.shape)

    def read_sigma(self, t: float) -> float:
        """sqrt(ln((T + t_read) / (2 t_read))) (times read_noise_scale), T = t + t0: the read noise
        of a device is g_drift Q(g_prog) read_sigma(t) N(0, 1)."""
        return math.sqrt(math.log((t + self.t0 + self.t_read) / (2 * self.t_read))) * self.read_noise_scale

    @staticmethod
    def read_keys(gen: torch.Generator) -> torch.Tensor:
        """The keys of one read's noise draws (hashed_normal), from the read's generator."""
        return torch.randint(-(2**31), 2**31, (2,), generator=gen, dtype=torch.int32)

    def _time_args(self, t: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """log(T / t0) and read_sigma(t) as 0-d tensors: the compiled reads would be specialised
        (recompiled) on each float."""
        log_t = math.log((t + self.t0) / self.t0)
        return torch.tensor(log_t, dtype=dtype), torch.tensor(self.read_sigma(t), dtype=dtype)


@dataclass(frozen=True)
class RRAM(PCM):
    """A filamentary RRAM variant: flat 5% programming noise, weak drift, the PCM read-noise law.

    Our own simplification (documented, not fitted to a published device):
    RRAM relaxes much less than PCM over time, so nu is PCM's scaled by 0.1.
    """

    prog_relative: float = 0.05

    def programming_sigma(self, g_target: torch.Tensor) -> torch.Tensor:
        return self.prog_relative * self.g_max * torch.ones_like(g_target) * self.prog_noise_scale

    @property
    def drift_factor(self) -> float:
        return self.drift_scale * 0.1


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
