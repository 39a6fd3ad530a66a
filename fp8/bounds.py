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
                 rope: bool = False, n_tokens: int = 512, delta: float = 1e-6, gamma: float = 1.0) -> dict:
    """Per-head bounds on |q . k| / sqrt(d_h) for inputs of norm <= radius: the worst case
    (``bound``), the rank-aware and rank-agnostic predictions for sequences of ``n_tokens``,
    and the product-of-norms bound ||W_Q,h|| ||W_K,g|| R^2 / sqrt(d_h) for comparison."""
    d_h = w_q.shape[0] // n_heads
    wq, wk = augment(w_q.double(), b_q), augment(w_k.double(), b_k)
    r2 = radius**2 + (1.0 if b_q is not None or b_k is not None else 0.0)
    q_norms = torch.linalg.matrix_norm(split_heads(wq, n_heads, "query weight"), ord=2)
    k_norms = torch.linalg.matrix_norm(split_heads(wk, n_kv_heads, "key weight"), ord=2)
    product = q_norms * k_norms[torch.arange(n_heads) // (n_heads // n_kv_heads)]
    sigma = product if rope else head_norms(wq, wk, n_heads, n_kv_heads).sigma
    bound = sigma * r2 / math.sqrt(d_h)
    d, rank = wq.shape[1], min(wq.shape[1], d_h + (1 if wq.shape[1] > w_q.shape[1] else 0))
    return {"sigma": sigma, "bound": bound, "product_bound": product * r2 / math.sqrt(d_h),
            "rank_aware": tail_alpha(d, rank, n_tokens, delta, gamma) * bound,
            "rank_agnostic": tail_alpha(d, d, n_tokens, delta, gamma) * bound,
            "radius": radius, "head_dim": d_h, "rank": rank, "n_tokens": n_tokens, "delta": delta, "gamma": gamma}
