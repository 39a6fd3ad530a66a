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
"""

from __future__ import annotations

import math

import torch

from fp8.spectral import head_norms, split_heads


def norm_radius(gamma: torch.Tensor, beta: torch.Tensor | None = None) -> float:
    """The largest norm an RMSNorm (beta None) or LayerNorm output can reach."""
    d = gamma.numel()
    r = float(gamma.abs().max()) * math.sqrt(d)
    return r + (float(beta.norm()) if beta is not None else 0.0)


def augment(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """[W | b]: the bias as the weight of a constant input 1."""
    return w if b is None else torch.cat([w, b[:, None]], 1)


def logit_bounds(w_q, w_k, n_heads: int, n_kv_heads: int, radius: float, b_q=None, b_k=None,
                 rope: bool = False) -> dict:
    """Per-head bound on |q . k| / sqrt(d_h) for inputs of norm <= radius; also the rank-agnostic
    product-of-norms bound ||W_Q,h|| ||W_K,g|| R^2 / sqrt(d_h) for comparison."""
    d_h = w_q.shape[0] // n_heads
    wq, wk = augment(w_q.double(), b_q), augment(w_k.double(), b_k)
    r2 = radius**2 + (1.0 if b_q is not None or b_k is not None else 0.0)
    q_norms = torch.linalg.matrix_norm(split_heads(wq, n_heads, "query weight"), ord=2)
    k_norms = torch.linalg.matrix_norm(split_heads(wk, n_kv_heads, "key weight"), ord=2)
    product = q_norms * k_norms[torch.arange(n_heads) // (n_heads // n_kv_heads)]
    sigma = product if rope else head_norms(wq, wk, n_heads, n_kv_heads).sigma
    return {"sigma": sigma, "bound": sigma * r2 / math.sqrt(d_h), "product_bound": product * r2 / math.sqrt(d_h),
            "radius": radius, "head_dim": d_h}
