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

Models hilt does not define (any transformers LM) are reached through transformers' own
attention hook (AttentionInterface): :func:`set_hf_attention` routes every attention call to a
handler that sees the post-norm, post-RoPE q and k; :func:`hf_attention_layers` describes each
layer for the logit bounds (q/k norm gains, or W_Q, W_K and the input norm; RoPE's layout and
scaling from the cos/sin the layer received); :func:`use_fp8_attention_hf` runs FP8Attention
there with each module's own logit scaling.
"""

from __future__ import annotations

import itertools
import math
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from hilt.fp8.bounds import gains_per_head, logit_bounds, norm_radius, qk_norm_logit_bounds
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

    def forward(self, q, k, v, causal: bool = False, key_mask: torch.Tensor | None = None,
                sm_scale: float | None = None):
        """sm_scale: the logit factor, 1/sqrt(d_h) unless given (Gemma 3's query_pre_attn_scalar^-1/2)."""
        if key_mask is not None:
            return self._padded(q, k, v, causal, key_mask, sm_scale)
        if self.rotate:
            q, k = incoherent(q, k)
        if self.scales == "current":
            q_scale, k_scale = _current(q, (0, 2, 3)), _current(k, (0, 2, 3))
        else:  # smoothing at most doubles a key's norm
            q_scale = E4M3_MAX / self.q_bound.float().clamp_min(AMAX_FLOOR)
            k_scale = E4M3_MAX / ((2.0 if self.rotate else 1.0) * self.k_bound.float()).clamp_min(AMAX_FLOOR)
        v_scale = _current(v, (0, 2)) if self.v_fp8 else None
        return fp8_attention(q, k, v, q_scale.to(q.device), k_scale.to(q.device), v_scale, causal, sm_scale,
                             split_qk=self.split_qk)

    def _padded(self, q, k, v, causal, key_mask, sm_scale=None):
        if key_mask.shape != (k.shape[0], k.shape[2]):
            raise HiltError(f"key mask of shape {tuple(key_mask.shape)} does not match keys {tuple(k.shape[:1] + k.shape[2:3])}")
        out = torch.zeros_like(q)
        lengths = key_mask.bool().sum(1).tolist()
        for i, n in enumerate(lengths):
            if n and bool(key_mask[i, :n].all()):
                out[i:i + 1, :, :n] = self(q[i:i + 1, :, :n], k[i:i + 1, :, :n], v[i:i + 1, :, :n], causal,
                                           sm_scale=sm_scale)
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


# --- any transformers model: the attention hook (transformers' AttentionInterface) -------------

_HF_NAMES = itertools.count()


def set_hf_attention(model: nn.Module, handler: Callable) -> str:
    """Route every attention call of a transformers model through ``handler``: the documented hook
    by which FP8 attention and the logit studies reach models hilt does not define.

    ``handler(module, query, key, value, attention_mask, inner, **kwargs)`` returns what a
    transformers attention function returns (output (B, Tq, H, d_h), weights or None). query
    (B, H, Tq, d_h) and key, value (B, G, Tk, d_h) are what the module attends with (after its
    q/k norms and RoPE); attention_mask is built by the mask function of ``inner``, the
    implementation the model ran before (sdpa, eager, ...), which the handler may call with the
    same arguments; kwargs carry scaling, sliding_window, dropout. Registered under a fresh name
    with transformers' AttentionInterface; returns the previous name, which
    ``model.set_attn_implementation(previous)`` restores (:func:`hf_attention` does that)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    previous = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if previous is None or not callable(getattr(model, "set_attn_implementation", None)):
        raise HiltError(f"{type(model).__name__} is not a transformers model with an attention implementation to hook")

    def attend(module, query, key, value, attention_mask, **kwargs):
        if previous in ALL_ATTENTION_FUNCTIONS:
            inner = ALL_ATTENTION_FUNCTIONS[previous]
        else:  # "eager" is each model file's own function (Gemma's soft-capping lives there)
            inner = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
            if inner is None:
                raise HiltError(f"{type(module).__name__}: no attention function named {previous!r} to wrap")
        return handler(module, query, key, value, attention_mask, inner, **kwargs)

    name = f"hilt_{next(_HF_NAMES)}"
    AttentionInterface.register(name, attend)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS.get(previous, sdpa_mask))
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise HiltError(f"{type(model).__name__} does not let its attention implementation be set: it does not "
                        f"call transformers' AttentionInterface")
    return previous


@contextmanager
def hf_attention(model: nn.Module, handler: Callable):
    """:func:`set_hf_attention` for the body of a ``with``; the previous implementation after it."""
    previous = set_hf_attention(model, handler)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


def hf_allowed_pairs(module: nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask,
                     **kwargs) -> torch.Tensor:
    """Which keys each query attends to, bool (B or 1, 1 or H, Tq, Tk), from what a transformers
    attention function receives: a 4-D mask (bool, True attends; or additive float) as it is;
    otherwise causality (bottom-right: keys 0..Tk-1, queries the last Tq positions), a sliding
    window (key > query - window) and a 2-D (B, Tk) padding mask where given."""
    tq, tk = query.shape[2], key.shape[2]
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        if attention_mask.dtype == torch.bool:
            return attention_mask[..., -tq:, :tk]
        return attention_mask[..., -tq:, :tk] > torch.finfo(attention_mask.dtype).min / 2
    i = torch.arange(tk - tq, tk, device=query.device)[:, None]
    j = torch.arange(tk, device=query.device)[None, :]
    allowed = torch.ones(tq, tk, dtype=torch.bool, device=query.device)
    causal = kwargs.get("is_causal")
    if causal if causal is not None else getattr(module, "is_causal", True):
        allowed &= j <= i
    window = kwargs.get("sliding_window")
    if window:
        allowed &= j > i - window
    allowed = allowed[None, None]
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        allowed = allowed & attention_mask[:, None, None, -tk:].bool()
    return allowed


@dataclass
class HFAttentionLayer:
    """One attention layer of a transformers model as the logit bounds see it (:func:`hf_attention_layers`).

    ``scaling`` is the module's logit factor times RoPE's attention scaling squared (cos^2 + sin^2,
    1 for plain RoPE); ``rope`` is "half" (rotate-half pairs below ``rotary_dim``, the
    transformers convention, checked on the cos/sin the layer received) or "any" (rotation not
    seen or of another layout: bounds that hold for any norm-keeping rotation). With q/k norms
    (``gain_q``, ``gain_k``: effective RMSNorm gains) the bound needs nothing else; without,
    ``w_q``/``w_k`` (``b_q``/``b_k``) project the output of the pre-attention norm
    (``norm_gain`` effective RMSNorm gain, or a LayerNorm's ``norm_gain``/``norm_bias``)."""

    name: str
    index: int
    module: nn.Module
    n_heads: int
    n_kv_heads: int
    head_dim: int
    scaling: float
    rope: str
    rotary_dim: int
    sliding_window: int | None = None
    module_scaling: float = 1.0  # the module's own factor, without RoPE's
    gain_q: torch.Tensor | None = None
    gain_k: torch.Tensor | None = None
    w_q: torch.Tensor | None = None
    w_k: torch.Tensor | None = None
    b_q: torch.Tensor | None = None
    b_k: torch.Tensor | None = None
    norm_gain: torch.Tensor | None = None
    norm_bias: torch.Tensor | None = None

    @property
    def qk_norm(self) -> bool:
        return self.gain_q is not None

    def logit_bounds(self, n_tokens: int = 512, delta: float = 1e-6, gamma: float = 1.0) -> dict:
        """Per-head bounds on |scaling q . k| (fp8.bounds): from the q/k norm gains when the layer
        has them, else from W_Q, W_K and the pre-attention norm (the RoPE product bound)."""
        if self.qk_norm:
            return qk_norm_logit_bounds(self.gain_q, self.gain_k, self.n_heads, self.n_kv_heads, self.head_dim,
                                        self.scaling, self.rope, self.rotary_dim, n_tokens, delta, gamma)
        return logit_bounds(self.w_q, self.w_k, self.n_heads, self.n_kv_heads, norm_radius(self.norm_gain, self.norm_bias),
                            _double(self.b_q), _double(self.b_k), rope=self.rope is not None, n_tokens=n_tokens,
                            delta=delta, gamma=gamma, scaling=self.scaling)

    def qk_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per head: the largest ||q|| (H,) and ||k|| (G,) any input can give, RoPE's scaling
        split evenly between them (what geometry-aware FP8 scales divide 448 by)."""
        rope = math.sqrt(self.scaling / self.module_scaling)
        if self.qk_norm:  # ||g * z|| <= max|g| ||z|| < max|g| sqrt(N)
            q = gains_per_head(self.gain_q, self.n_heads, self.head_dim, f"{self.name}.q_norm").amax(-1)
            k = gains_per_head(self.gain_k, self.n_kv_heads, self.head_dim, f"{self.name}.k_norm").amax(-1)
            return q * math.sqrt(self.gain_q.numel()) * rope, k * math.sqrt(self.gain_k.numel()) * rope
        q, k = attention_bounds(self.w_q, self.w_k, self.n_heads, self.n_kv_heads,
                                norm_radius(self.norm_gain, self.norm_bias), _double(self.b_q), _double(self.b_k))
        return q * rope, k * rope


def _double(t):
    return None if t is None else t.detach().double().cpu()


def _rope_layout(position_embeddings, head_dim: int) -> tuple[str, int, float]:
    """(layout, rotary dim, max cos^2 + sin^2) from the (cos, sin) a layer received: "half" when
    both repeat over their two halves (rotate-half pairs), else "any"; no cos/sin seen: "any", 1."""
    if not (isinstance(position_embeddings, (tuple, list)) and len(position_embeddings) == 2):
        return "any", head_dim, 1.0
    cos, sin = (t.detach().double() for t in position_embeddings)
    r = cos.shape[-1]
    gain = float((cos.pow(2) + sin.pow(2)).max())
    half = r // 2
    paired = (r % 2 == 0 and r <= head_dim and torch.equal(cos[..., :half], cos[..., half:])
              and torch.equal(sin[..., :half], sin[..., half:]))
    return ("half", r, gain) if paired else ("any", head_dim, gain)


@torch.no_grad()
def hf_attention_layers(model: nn.Module, input_ids: torch.Tensor) -> list[HFAttentionLayer]:
    """Every attention layer of a transformers causal LM, found by running ``input_ids`` (1-D or
    (1, T)) once through the hook: each module that calls the attention function is one layer
    (heads, head dim, scaling, sliding window as it passes them), with the cos/sin RoPE gave it
    and its weights or q/k norm gains. Refuses, naming the layer, one whose q and k come from
    neither q/k RMSNorms nor q_proj/k_proj after a pre-attention norm (``input_layernorm``)."""
    from hilt.fp8.bounds import rms_norm_gain

    names = {m: n for n, m in model.named_modules()}
    seen: dict[nn.Module, dict] = {}
    rope: dict[nn.Module, object] = {}

    def record(module, query, key, value, attention_mask, inner, **kwargs):
        if module not in seen:
            seen[module] = {"heads": query.shape[1], "kv_heads": key.shape[1], "head_dim": query.shape[-1],
                            "scaling": kwargs.get("scaling"), "window": kwargs.get("sliding_window")}
        return inner(module, query, key, value, attention_mask, **kwargs)

    def pre(module, args, kwargs):
        if "position_embeddings" in kwargs and module not in rope:
            rope[module] = kwargs["position_embeddings"]

    hooks = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in model.modules()]
    try:
        with hf_attention(model, record):
            ids = input_ids.reshape(1, -1).to(next(model.parameters()).device)
            model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    if not seen:
        raise HiltError(f"{type(model).__name__}: no layer called the attention function, so no attention to bound")
    layers = []
    for index, (module, s) in enumerate(seen.items()):
        name = names.get(module, f"attention {index}")
        d_h = s["head_dim"]
        scaling = float(s["scaling"] or getattr(module, "scaling", None) or d_h ** -0.5)
        layout, rotary_dim, rope_gain = _rope_layout(rope.get(module), d_h)
        layer = HFAttentionLayer(name, index, module, s["heads"], s["kv_heads"], d_h, scaling * rope_gain, layout,
                                 rotary_dim, s["window"], scaling)
        q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
        if isinstance(q_norm, nn.Module) and isinstance(k_norm, nn.Module):
            layer.gain_q = rms_norm_gain(q_norm, f"{name}.q_norm")
            layer.gain_k = rms_norm_gain(k_norm, f"{name}.k_norm")
            gains_per_head(layer.gain_q, layer.n_heads, d_h, f"{name}.q_norm")
            gains_per_head(layer.gain_k, layer.n_kv_heads, d_h, f"{name}.k_norm")
        else:
            layer.w_q, layer.w_k, layer.b_q, layer.b_k = _projections(module, name)
            layer.norm_gain, layer.norm_bias = _input_norm(model, name)
        layers.append(layer)
    return layers


def _projections(module: nn.Module, name: str):
    q, k = getattr(module, "q_proj", None), getattr(module, "k_proj", None)
    if not (isinstance(q, nn.Linear) and isinstance(k, nn.Linear)):
        raise HiltError(f"{name}: no q_norm/k_norm and no q_proj/k_proj linear layers (a fused projection?): "
                        f"nothing to bound its logits by")
    return (q.weight.detach().double().cpu(), k.weight.detach().double().cpu(), _double(q.bias), _double(k.bias))


def _input_norm(model: nn.Module, name: str):
    """The effective gain (and bias) of the norm that feeds the attention: the parent block's input_layernorm."""
    from hilt.fp8.bounds import rms_norm_gain

    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    norm = getattr(parent, "input_layernorm", None)
    if not isinstance(norm, nn.Module):
        raise HiltError(f"{name}: no q/k norms and no input_layernorm before it, so no bound on its input's norm")
    if isinstance(norm, nn.LayerNorm):  # x = g z + b, z zero-mean with unit variance
        bias = None if norm.bias is None else norm.bias.detach().double().cpu()
        return norm.weight.detach().double().cpu(), bias
    return rms_norm_gain(norm, f"{name.rpartition('.')[0]}.input_layernorm"), None


def _fp8_pattern(module, query, key, attention_mask, name: str, **kwargs):
    """(causal, key_mask or None) when the pairs a layer attends are full or causal attention, with
    right padding or without; anything else (a sliding window shorter than the keys) is refused."""
    allowed = hf_allowed_pairs(module, query, key, attention_mask, **kwargs)
    b, tq, tk = query.shape[0], query.shape[2], key.shape[2]
    if allowed.shape[1] > 1 and not bool((allowed == allowed[:, :1]).all()):
        raise HiltError(f"{name}: its heads attend different pairs; FP8 attention takes one mask for all heads")
    allowed = allowed[:, :1].expand(b, 1, tq, tk)
    if bool(allowed.all()):
        return False, None
    key_mask = allowed.any(2)[:, 0]  # (B, Tk): keys some query sees
    i = torch.arange(tk - tq, tk, device=query.device)[:, None]
    j = torch.arange(tk, device=query.device)[None, :]
    for causal, base in ((True, j <= i), (False, torch.ones_like(j <= i))):
        if tq <= tk and torch.equal(allowed, base[None, None] & key_mask[:, None, None, :]):
            return causal, (None if bool(key_mask.all()) else key_mask)
    window = kwargs.get("sliding_window")
    raise HiltError(f"{name}: attends neither all keys nor causally (with right padding) over {tk} keys"
                    + (f" (a sliding window of {window})" if window else "")
                    + ": FP8 attention runs those patterns only")


def use_fp8_attention_hf(model: nn.Module, scales: str = "current", v_fp8: bool = True, rotate: bool = True,
                         split_qk: bool = False, input_ids: torch.Tensor | None = None) -> nn.Module:
    """Route every attention layer of a transformers model through FP8Attention (E4M3 Q, K, P and
    V) through :func:`set_hf_attention`, each with its module's own logit scaling. With
    ``scales="geometry"`` the per-head bounds on ||q|| and ||k|| come from the weights
    (:meth:`HFAttentionLayer.qk_bounds`: q/k norm gains, or W_Q, W_K and the input norm), found
    by one pass of ``input_ids`` (eight tokens of id 0 unless given). A layer whose mask is not
    full or causal attention (a sliding window shorter than the sequence) is refused by name when
    it runs. ``model.set_attn_implementation("sdpa")`` (or what it ran before) undoes it."""
    if scales not in SCALES:
        raise HiltError(f"unknown FP8 attention scales {scales!r}; choose from {', '.join(SCALES)}")
    names = {m: n for n, m in model.named_modules()}
    attends: dict[nn.Module, FP8Attention] = {}
    if scales == "geometry":
        probe = torch.zeros(8, dtype=torch.long) if input_ids is None else input_ids
        for layer in hf_attention_layers(model, probe):
            q_bound, k_bound = layer.qk_bounds()
            attends[layer.module] = FP8Attention(scales, q_bound, k_bound, v_fp8, rotate, split_qk)

    def handler(module, query, key, value, attention_mask, inner, **kwargs):
        name = names.get(module, type(module).__name__)
        if module not in attends:
            if scales == "geometry":
                raise HiltError(f"{name}: not seen when the geometry-aware scales were computed")
            attends[module] = FP8Attention(scales, None, None, v_fp8, rotate, split_qk)
        if kwargs.get("softcap") is not None:
            raise HiltError(f"{name}: soft-capped logits (tanh) are not what the FP8 kernel computes")
        causal, key_mask = _fp8_pattern(module, query, key, attention_mask, name, **kwargs)
        scaling = kwargs.get("scaling") or getattr(module, "scaling", None) or query.shape[-1] ** -0.5
        out = attends[module](query, key, value, causal=causal, key_mask=key_mask, sm_scale=scaling)
        return out.transpose(1, 2).contiguous(), None  # transformers' layout: (B, Tq, H, d_h)

    set_hf_attention(model, handler)
    return model
