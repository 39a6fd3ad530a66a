"""Per-head spectral norms of the attention bilinear form, without forming it.

For query head h reading key/value group g (grouped-query attention: g = h // (H / G)),
the logit between positions i and j is q_i . k_j = x_i^T M_h x_j with
M_h = W_Q,h^T W_K,g (d x d, rank <= d_h), weights in PyTorch's (out, in) layout.

    sigma_h = ||M_h||_2,   sigma_h^2 = lambda_max(A_h B_g),
    A_h = W_Q,h W_Q,h^T,  B_g = W_K,g W_K,g^T          (both d_h x d_h)

so each head costs two d_h x d_h Gram matrices; keys are never repeated per query head
(B is computed once per group and indexed). Power iteration on A_h B_g, batched over
heads, estimates lambda with the symmetric Rayleigh quotient u^T B A B u / u^T B u (the
quotient of B^1/2 A B^1/2 at B^1/2 u), whose error is quadratic in the direction's.
``v0`` warm-starts it from a previous call's directions when the weights changed a little.
Biases (BERT's query and key) enter through augmented weights [W | b] and inputs [x; 1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hilt.errors import HiltError


@dataclass
class HeadNorms:
    sigma: torch.Tensor  # (H,) float64: ||W_Q,h^T W_K,g||_2
    directions: torch.Tensor  # (H, d_h) float64: the iteration's vectors, for warm starts
    iterations: int
    converged: bool


def split_heads(w: torch.Tensor, n: int, what: str) -> torch.Tensor:
    """(n * d_h, d) -> (n, d_h, d); refuses a row count that n does not divide."""
    if w.dim() != 2 or w.shape[0] % n:
        raise HiltError(f"{what} of shape {tuple(w.shape)} does not split into {n} heads")
    if not torch.isfinite(w).all():
        raise HiltError(f"{what} contains NaN or Inf")
    return w.reshape(n, w.shape[0] // n, w.shape[1])


def head_norms(w_q: torch.Tensor, w_k: torch.Tensor, n_heads: int, n_kv_heads: int,
               v0: torch.Tensor | None = None, max_iters: int = 500, tol: float = 1e-9) -> HeadNorms:
    """sigma_h for every query head, by batched power iteration (see the module docstring)."""
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise HiltError(f"{n_heads} query heads cannot share {n_kv_heads} key/value heads evenly")
    q = split_heads(w_q.double(), n_heads, "query weight")
    k = split_heads(w_k.double(), n_kv_heads, "key weight")
    if q.shape[1:] != k.shape[1:]:
        raise HiltError(f"query heads {tuple(q.shape[1:])} and key heads {tuple(k.shape[1:])} differ in shape")
    a = q @ q.transpose(1, 2)  # (H, d_h, d_h)
    b = (k @ k.transpose(1, 2))[torch.arange(n_heads) // (n_heads // n_kv_heads)]  # (H, d_h, d_h), per group
    d_h = a.shape[-1]
    u = torch.ones(n_heads, d_h, dtype=torch.float64) if v0 is None else v0.double().clone()
    lam = torch.zeros(n_heads, dtype=torch.float64)
    converged = False
    for it in range(1, max_iters + 1):
        bu = (b @ u.unsqueeze(-1)).squeeze(-1)
        abu = (a @ bu.unsqueeze(-1)).squeeze(-1)
        denom = (u * bu).sum(-1)
        new = torch.where(denom > 0, (bu * abu).sum(-1) / denom.clamp_min(1e-300), torch.zeros_like(denom))
        norm = abu.norm(dim=-1, keepdim=True)
        u = torch.where(norm > 0, abu / norm.clamp_min(1e-300), u)  # a zero head keeps its vector, sigma 0
        if it > 1 and bool(((new - lam).abs() <= tol * new.abs().clamp_min(1e-300)).all()):
            lam, converged = new, True
            break
        lam = new
    return HeadNorms(lam.clamp_min(0).sqrt(), u, it, converged)
