"""FP8Attention: what an attention layer calls instead of scaled_dot_product_attention.

A model opts in by yielding an :class:`AttentionSite` per attention layer from a method
``fp8_attention_sites()``; :func:`use_fp8_attention` then sets each layer's ``attend``.

Before the E4M3 casts of the kernel (kernels.fp8_attention), two exact rewrites that make
the casts cheaper in accuracy (measured on SmolLM2-135M, `hilt fp8 attention`):

* K smoothing: k_j - mean_j(k). Each query's logits move by the constant q_i . mean(k), which
  softmax ignores, and the channel offsets that dominate trained keys leave the FP8 range.
* Incoherent processing (as FlashAttention-3): Q and K times one orthonormal Hadamard matrix
  H (Q H (K H)^T = Q K^T). An outlier channel is spread over all d_h channels, so no single
  product of two 3-bit-mantissa values carries a logit.

Scales per head: ``current`` (448 / this tensor's amax, a reduction per call) or
``geometry`` (448 / a bound from the weights: |entry of q| <= ||q|| <= ||W_Q,h||_2 R, and K
smoothing at most doubles ||k||; rotation keeps norms), set by :func:`use_fp8_attention`.
V goes to E4M3 with per-channel current scales (``v_fp8=True``) or stays 16-bit.
``split_qk=True`` stores Q and K as two E4M3 terms each (kernels.fp8_attention): three FP8
products for the logits, for activations whose outliers survive the rotation.

A padding mask (MiniLM's batches) is served sequence by sequence at its own length: keys past
it are cut off, and padded queries, whose outputs nothing reads, get zeros.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from hilt.fp8.bounds import norm_radius
from hilt.fp8.recipes import AMAX_FLOOR, E4M3_MAX
from hilt.errors import HiltError
from hilt.kernels import fp8_attention

SCALES = ("current", "geometry")


def hadamard(n: int, device=None) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix of size n (a power of two), float32."""
    if n < 1 or n & (n - 1):
        raise HiltError(f"incoherent processing needs a power-of-two head dim, got {n}")
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def incoherent(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K smoothed over its tokens, then Q and K rotated by H: the same softmax(Q K^T)."""
    h = hadamard(q.shape[-1], q.device)
    k = k.float() - k.float().mean(dim=2, keepdim=True)
    return (q.float() @ h).to(q.dtype), (k @ h).to(q.dtype)


def _current(x: torch.Tensor, dims) -> torch.Tensor:
    return E4M3_MAX / x.detach().float().abs().amax(dim=dims).clamp_min(AMAX_FLOOR)


class FP8Attention(nn.Module):
    """softmax(Q K^T / sqrt(d_h)) V with Q, K, P (and V) in E4M3; q (B, H, T, d_h), k, v (B, G, T, d_h)."""

    def __init__(self, scales: str = "current", q_bound: torch.Tensor | None = None,
                 k_bound: torch.Tensor | None = None, v_fp8: bool = True, rotate: bool = True,
                 split_qk: bool = False):
        super().__init__()
        if scales not in SCALES:
            raise HiltError(f"unknown FP8 attention scales {scales!r}; choose from {', '.join(SCALES)}")
        if scales == "geometry" and (q_bound is None or k_bound is None):
            raise HiltError("geometry-aware FP8 attention needs per-head bounds on |q| and |k| from the weights")
        self.scales, self.v_fp8, self.rotate, self.split_qk = scales, v_fp8, rotate, split_qk
        self.q_bound, self.k_bound = q_bound, k_bound

    def forward(self, q, k, v, causal: bool = False, key_mask: torch.Tensor | None = None):
        if key_mask is not None:
            return self._padded(q, k, v, causal, key_mask)
        if self.rotate:
            q, k = incoherent(q, k)
        if self.scales == "current":
            q_scale, k_scale = _current(q, (0, 2, 3)), _current(k, (0, 2, 3))
        else:  # smoothing at most doubles a key's norm
            q_scale = E4M3_MAX / self.q_bound.float().clamp_min(AMAX_FLOOR)
            k_scale = E4M3_MAX / ((2.0 if self.rotate else 1.0) * self.k_bound.float()).clamp_min(AMAX_FLOOR)
        v_scale = _current(v, (0, 2)) if self.v_fp8 else None
        return fp8_attention(q, k, v, q_scale.to(q.device), k_scale.to(q.device), v_scale, causal,
                             split_qk=self.split_qk)

    def _padded(self, q, k, v, causal, key_mask):
        if key_mask.shape != (k.shape[0], k.shape[2]):
            raise HiltError(f"key mask of shape {tuple(key_mask.shape)} does not match keys {tuple(k.shape[:1] + k.shape[2:3])}")
        out = torch.zeros_like(q)
        lengths = key_mask.bool().sum(1).tolist()
        for i, n in enumerate(lengths):
            if n and bool(key_mask[i, :n].all()):
                out[i:i + 1, :, :n] = self(q[i:i + 1, :, :n], k[i:i + 1, :, :n], v[i:i + 1, :, :n], causal)
            elif n:
                raise HiltError(f"the key mask of sequence {i} is not a padding mask (valid tokens first)")
        return out


@torch.no_grad()
def attention_bounds(w_q, w_k, n_heads: int, n_kv_heads: int, radius: float, b_q=None, b_k=None):
    """Per head: the largest ||q|| and ||k|| any input of norm <= radius can give (||[W | b]||_2 (R^2 + 1)^1/2)."""
    from hilt.fp8.bounds import augment
    from hilt.fp8.spectral import split_heads

    r = math.sqrt(radius**2 + (1.0 if b_q is not None or b_k is not None else 0.0))
    q = torch.linalg.matrix_norm(split_heads(augment(w_q.double(), b_q), n_heads, "query weight"), ord=2)
    k = torch.linalg.matrix_norm(split_heads(augment(w_k.double(), b_k), n_kv_heads, "key weight"), ord=2)
    return q * r, k * r


@dataclass
class AttentionSite:
    """One attention layer as FP8 attention sees it: what a model's ``fp8_attention_sites()`` yields.

    ``module`` calls ``module.attend(q, k, v, causal=..., key_mask=...)`` when ``attend`` is set
    (q (B, H, T, d_h); k, v (B, G, T, d_h); key_mask (B, T), True for real tokens) and its own
    attention when ``attend`` is None. ``w_q``, ``w_k`` (and biases ``b_q``, ``b_k``) project the
    output of the normalisation ``norm_weight``/``norm_bias`` (RMSNorm without a bias, LayerNorm
    with one) that precedes the layer, from which geometry-aware scales bound |q| and |k|.
    """

    module: nn.Module
    w_q: torch.Tensor
    w_k: torch.Tensor
    n_heads: int
    n_kv_heads: int
    norm_weight: torch.Tensor
    norm_bias: torch.Tensor | None = None
    b_q: torch.Tensor | None = None
    b_k: torch.Tensor | None = None


def use_fp8_attention(model: nn.Module, scales: str = "current", v_fp8: bool = True, rotate: bool = True,
                      split_qk: bool = False) -> nn.Module:
    """Route every attention layer of ``model`` through FP8Attention; with ``scales="geometry"``
    the per-head bounds come from its weights.

    The model opts in with a method ``fp8_attention_sites()`` that yields one
    :class:`AttentionSite` per attention layer (the built-in SmolLM2 and MiniLM models do)."""
    sites_of = getattr(model, "fp8_attention_sites", None)
    if not callable(sites_of):
        raise HiltError(f"{type(model).__name__} has no fp8_attention_sites() method: FP8 attention needs the model "
                        f"to name its attention layers (see hilt.fp8.attention.AttentionSite)")
    for site in sites_of():
        b_q = None if site.b_q is None else site.b_q.double()
        b_k = None if site.b_k is None else site.b_k.double()
        qb, kb = attention_bounds(site.w_q, site.w_k, site.n_heads, site.n_kv_heads,
                                  norm_radius(site.norm_weight, site.norm_bias), b_q, b_k)
        site.module.attend = FP8Attention(scales, qb, kb, v_fp8, rotate, split_qk)
    return model
