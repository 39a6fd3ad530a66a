"""Bounds on attention logits from the weights alone, before any activation is seen.

A pre-attention norm caps the norm of every token's input:

* RMSNorm:   x = gamma * z with ||z|| <= sqrt(d)                 -> ||x|| <= max|gamma| sqrt(d)
* LayerNorm: x = gamma * z + beta, z zero-mean, unit variance   -> ||x|| <= max|gamma| sqrt(d) + ||beta||

so a logit S_ij = q_i . k_j / sqrt(d_h) = x_i^T M_h x_j / sqrt(d_h) obeys

    |S_ij| <= sigma_h R^2 / sqrt(d_h),   sigma_h = ||M_h||_2 (fp8.spectral)

Biases enter as a constant input 1: sigma of [W | b], R^2 + 1 (BERT's query and key).
RoPE rotates q and k by different angles, q_i^T Rot(j - i) k_j, so its bound uses
||W_Q,h||_2 ||W_K,g||_2 instead of ||W_Q,h^T W_K,g||_2 (safe, looser). These bounds hold
for every input: they are what the observed maxima on real text are checked against.

The rank-aware prediction (docs/references.md section 3) is probabilistic. For unit inputs u, v
spread evenly over the sphere in R^d and M of rank r, Mv lies in an r-dimensional space,
so |Mv| ~ sigma sqrt(r/d) and u^T Mv ~ sigma sqrt(r)/d N(0, 1): P(|u^T M v| > alpha sigma)
<= 2 exp(-d^2 alpha^2 / (2 gamma r)). A union bound over the n^2 pairs of a sequence gives

    alpha* = sqrt(2 gamma r ln(2 n^2 / delta)) / d,    S_max = alpha* sigma R^2 / sqrt(d_h)

(alpha* capped at 1, the worst case). A full-rank M (r = d) gives the rank-agnostic
alpha = sqrt(2 gamma ln(2 n^2 / delta) / d): the rank-aware one is sqrt(d / r) tighter.
Real inputs are not isotropic, so gamma > 1 absorbs that; `burn_in_gamma` fits it on
calibration text. The scale is 448 / (margin S_max).

Attention whose q and k leave an RMSNorm (Gemma 3, Qwen3 per head; OLMo2 over the whole
projection) needs neither W_Q nor W_K: q = g_q * z_q with |z_q| < sqrt(N_q) (N the norm's
length; eps makes it strict), likewise k, and RoPE turns each rotate-half pair (c, c + d_h/2)
of q by one angle. Per pair p, |q_p . R k_p| <= Gq_p |z_q,p| Gk_p |z_k,p| (Gq_p: the pair's
larger |gain|), and Cauchy-Schwarz over the pairs gives

    |S_ij| < scaling sqrt(N_q N_k) max_p Gq_h,p Gk_g,p        (`qk_norm_logit_bounds`)

approached when q and k put all their mass on the pair p* that attains it, at positions
whose rotation of p* carries q's largest-gain coordinate onto k's (any i = j when both are
the same coordinate). Its prediction is one-sided and sound: if a query's direction is
uniform on the sphere (whatever the keys), P(|u . w| > alpha |w|) <= 2 exp(-N alpha^2 / 2)
(the measure of a spherical cap), so alpha = tail_alpha(N_q, N_q, n, delta). The two-sided,
stable-rank analogue of the prediction above is not offered: with a few dominant gains the
logit is close to a product of two coordinates, whose tail is exponential, not Gaussian.
"""

from __future__ import annotations

import math

import torch

from hilt.fp8.spectral import head_norms, split_heads
from hilt.errors import HiltError


def norm_radius(gamma: torch.Tensor, beta: torch.Tensor | None = None) -> float:
    """The largest norm an RMSNorm (beta None) or LayerNorm output can reach."""
    d = gamma.numel()
    r = float(gamma.abs().max()) * math.sqrt(d)
    return r + (float(beta.norm()) if beta is not None else 0.0)


def augment(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """[W | b]: the bias as the weight of a constant input 1."""
    return w if b is None else torch.cat([w, b[:, None]], 1)


def tail_alpha(d: int, rank: int, n_tokens: int, delta: float = 1e-6, gamma: float = 1.0) -> float:
    """alpha* = sqrt(2 gamma r ln(2 n^2 / delta)) / d, at most 1 (see the module docstring)."""
    if not (0 < delta < 1) or gamma <= 0 or n_tokens < 1 or not (1 <= rank <= d):
        raise HiltError(f"rank-aware bound needs 0 < delta < 1, gamma > 0, n >= 1, 1 <= rank <= d "
                        f"(got delta={delta}, gamma={gamma}, n={n_tokens}, rank={rank}, d={d})")
    return min(1.0, math.sqrt(2 * gamma * rank * math.log(2 * n_tokens**2 / delta)) / d)


def burn_in_gamma(observed: torch.Tensor, worst_case: torch.Tensor, d: int, rank: int, n_tokens: int,
                  delta: float = 1e-6) -> float:
    """The smallest gamma >= 1 whose rank-aware prediction covers every observed max |logit|
    (burn-in calibration on a few batches of real text)."""
    alpha1 = tail_alpha(d, rank, n_tokens, delta)
    needed = (observed.double() / (alpha1 * worst_case.double()).clamp_min(1e-300)).max()
    return max(1.0, float(needed) ** 2)


def logit_bounds(w_q, w_k, n_heads: int, n_kv_heads: int, radius: float, b_q=None, b_k=None,
                 rope: bool = False, n_tokens: int = 512, delta: float = 1e-6, gamma: float = 1.0,
                 scaling: float | None = None) -> dict:
    """Per-head bounds on |scaling q . k| (scaling 1/sqrt(d_h) unless given) for inputs of norm
    <= radius: the worst case (``bound``), the rank-aware and rank-agnostic predictions for
    sequences of ``n_tokens``, and the product-of-norms bound ||W_Q,h|| ||W_K,g|| R^2 scaling
    for comparison."""
    d_h = w_q.shape[0] // n_heads
    scale = 1.0 / math.sqrt(d_h) if scaling is None else _check_scaling(scaling)
    wq, wk = augment(w_q.double(), b_q), augment(w_k.double(), b_k)
    r2 = radius**2 + (1.0 if b_q is not None or b_k is not None else 0.0)
    q_norms = torch.linalg.matrix_norm(split_heads(wq, n_heads, "query weight"), ord=2)
    k_norms = torch.linalg.matrix_norm(split_heads(wk, n_kv_heads, "key weight"), ord=2)
    product = q_norms * k_norms[torch.arange(n_heads) // (n_heads // n_kv_heads)]
    sigma = product if rope else head_norms(wq, wk, n_heads, n_kv_heads).sigma

    def scaled(x):  # dividing by sqrt(d_h) as before keeps the default's numbers to the bit
        return x / math.sqrt(d_h) if scaling is None else x * scale

    bound = scaled(sigma * r2)
    d, rank = wq.shape[1], min(wq.shape[1], d_h + (1 if wq.shape[1] > w_q.shape[1] else 0))
    return {"sigma": sigma, "bound": bound, "product_bound": scaled(product * r2),
            "rank_aware": tail_alpha(d, rank, n_tokens, delta, gamma) * bound,
            "rank_agnostic": tail_alpha(d, d, n_tokens, delta, gamma) * bound,
            "radius": radius, "head_dim": d_h, "rank": rank, "d": d, "scaling": scale,
            "n_tokens": n_tokens, "delta": delta, "gamma": gamma}


def _check_scaling(scaling) -> float:
    scaling = float(scaling)
    if not math.isfinite(scaling) or scaling <= 0:
        raise HiltError(f"the logit scaling must be finite and > 0, got {scaling}")
    return scaling


@torch.no_grad()
def rms_norm_gain(norm: torch.nn.Module, name: str = "norm", size: int | None = None) -> torch.Tensor:
    """The effective gain g (float64) of an RMSNorm-like module, y = g * u / sqrt(mean(u^2) + eps),
    whatever its parametrisation (Llama's and Qwen3's weight, Gemma's 1 + weight): its output for
    a vector of ones (rms 1) times sqrt(1 + eps), eps read from ``eps`` or ``variance_epsilon``.
    A module that is not of that form (a LayerNorm, say) is refused, ``name`` naming the layer."""
    what = f"{name} ({type(norm).__name__})"
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise HiltError(f"{what}: no numeric eps or variance_epsilon attribute, so no effective RMSNorm gain")
    weight = getattr(norm, "weight", None)
    n = size if size is not None else (weight.numel() if isinstance(weight, torch.Tensor) else None)
    if not n:
        raise HiltError(f"{what}: has no weight to give its size; pass size")
    device = weight.device if isinstance(weight, torch.Tensor) else torch.device("cpu")

    def call(x: torch.Tensor) -> torch.Tensor:
        try:  # float64 where the module allows it; its own dtype where it insists (torch's LayerNorm)
            return norm(x.to(device)).double().flatten().cpu()
        except (RuntimeError, TypeError):
            return norm(x.to(device, getattr(weight, "dtype", torch.float32))).double().flatten().cpu()

    gain = call(torch.ones(n, dtype=torch.float64)) * math.sqrt(1 + eps)
    # an RMSNorm is odd and sees only direction and rms: check that on one uneven input
    u = torch.linspace(-3.0, 1.0, n, dtype=torch.float64) * 7.0
    expected = gain * u / math.sqrt(float(u.pow(2).mean()) + eps)
    got = call(u)
    if got.shape != expected.shape or not torch.isfinite(gain).all() or \
            float((got - expected).abs().max()) > 1e-4 * max(float(expected.abs().max()), 1e-30):
        raise HiltError(f"{what}: not an RMSNorm (y = g * u / sqrt(mean(u^2) + eps)), so no bound from its gain")
    return gain


def _rotation_blocks(g: torch.Tensor, rope: str | None, rotary_dim: int) -> torch.Tensor:
    """(n, d_h) |gains| -> (n, blocks) the largest |gain| of each set of coordinates that a
    position's rotation mixes: rotate-half pairs (c, c + r/2) below rotary_dim, single
    coordinates above it (or everywhere without RoPE), the whole head for an unknown rotation."""
    if rope is None:
        return g
    if rope == "any":
        return g.amax(-1, keepdim=True)
    half = rotary_dim // 2
    return torch.cat([torch.maximum(g[:, :half], g[:, half:rotary_dim]), g[:, rotary_dim:]], 1)


def gains_per_head(gain: torch.Tensor, heads: int, d_h: int, what: str) -> torch.Tensor:
    """A q_norm/k_norm gain over one head (shared by all heads: Gemma 3, Qwen3) or over the whole
    projection (OLMo2) as (heads, d_h) |gains|."""
    g = gain.detach().double().abs().flatten().cpu()
    if g.numel() == d_h:
        return g.expand(heads, d_h)
    if g.numel() == heads * d_h:
        return g.view(heads, d_h)
    raise HiltError(f"{what}: {g.numel()} gains, neither one head's ({d_h}) nor {heads} heads' ({heads * d_h})")


ROPE_LAYOUTS = (None, "half", "any")


def qk_norm_logit_bounds(gain_q: torch.Tensor, gain_k: torch.Tensor, n_heads: int, n_kv_heads: int,
                         head_dim: int, scaling: float, rope: str | None = "half", rotary_dim: int | None = None,
                         n_tokens: int = 512, delta: float = 1e-6, gamma: float = 1.0) -> dict:
    """Per-head bounds on |scaling q . k| when q and k leave an RMSNorm (docs/results/fp8.md,
    "Attention with q/k norms"), from the norms' effective gains alone (``rms_norm_gain``):

        |logit| < scaling sqrt(N_q N_k) max_p Gq_h,p Gk_g,p

    N the norm's length (head_dim, or the whole projection's for OLMo2), p over the sets of
    coordinates the RoPE rotation mixes (``rope="half"``: pairs (c, c + rotary_dim / 2);
    ``None``: no rotation; ``"any"``: an unknown norm-keeping rotation), G their largest |gain|.
    ``scaling`` is the module's logit factor times RoPE's attention scaling squared. The
    prediction (``rank_aware``; ``rank_agnostic`` is the same) holds with probability 1 - delta
    over a sequence of ``n_tokens`` whose normalised queries point in uniformly random
    directions, whatever the keys; gamma > 1 widens it for real text (``burn_in_gamma``)."""
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise HiltError(f"{n_heads} query heads cannot share {n_kv_heads} key/value heads evenly")
    if rope not in ROPE_LAYOUTS:
        raise HiltError(f"unknown RoPE layout {rope!r}; choose from {', '.join(map(str, ROPE_LAYOUTS))}")
    r = head_dim if rotary_dim is None else int(rotary_dim)
    if rope == "half" and (r % 2 or not 0 < r <= head_dim):
        raise HiltError(f"rotate-half RoPE needs an even rotary dim in 1..{head_dim}, got {r}")
    scale = _check_scaling(scaling)
    gq = gains_per_head(gain_q, n_heads, head_dim, "the query norm")
    gk = gains_per_head(gain_k, n_kv_heads, head_dim, "the key norm")
    n_q, n_k = gain_q.numel(), gain_k.numel()
    group = torch.arange(n_heads) // (n_heads // n_kv_heads)
    sigma = (_rotation_blocks(gq, rope, r) * _rotation_blocks(gk, rope, r)[group]).amax(-1)
    reach = scale * math.sqrt(n_q * n_k)  # |z_q| < sqrt(N_q), |z_k| < sqrt(N_k)
    bound = sigma * reach
    alpha = tail_alpha(n_q, n_q, n_tokens, delta, gamma)  # one-sided: the query's direction only
    return {"sigma": sigma, "bound": bound, "product_bound": gq.amax(-1) * gk.amax(-1)[group] * reach,
            "rank_aware": alpha * bound, "rank_agnostic": alpha * bound, "radius_q": math.sqrt(n_q),
            "radius_k": math.sqrt(n_k), "head_dim": head_dim, "rank": n_q, "d": n_q, "scaling": scale,
            "rope": rope, "rotary_dim": r, "n_tokens": n_tokens, "delta": delta, "gamma": gamma}
