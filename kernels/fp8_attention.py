"""Attention forward with Q, K, P (and optionally V) in FP8 E4M3: softmax(Q K^T * sm_scale) V.

q (B, H, Tq, D); k, v (B, G, Tk, D) with H % G == 0 (grouped-query attention: query head
h reads kv head h // (H // G); K and V are never repeated in memory); float16, bfloat16 or
float32 in, (B, H, Tq, D) in q's dtype out. The definition is :func:`fp8_attention_reference`:

* ``Q8 = e4m3(q * q_scale[h])``, ``K8 = e4m3(k * k_scale[g])``, per-head float32 factors
  from any recipe (e.g. 448 / amax). ``e4m3`` clamps to +-448, then rounds to nearest-even
  (torch's cast does not saturate).
* ``S = Q8 K8^T / (q_scale[h] k_scale[g]) * sm_scale`` in float32; sm_scale = 1/sqrt(D) by default.
* Causal: query i sees key j iff j <= i + (Tk - Tq) (bottom-right, as flash-attn); Tq > Tk
  would leave queries with no key and is refused.
* ``p = exp(S - rowmax)`` in [0, 1]; ``P8 = e4m3(448 p)`` (P_SCALE: a row's largest weight
  maps to 448 exactly); P8 V accumulates in float32 and the 448 is removed at the end. The
  row sum l is over the unquantized p, so each p is converted once, on its way into the dot
  (summing the quantized p measured 10-20 % lower relative L1 in an emulation: not worth an
  extra upcast of every p on the GPU).
* ``split_qk=True``: Q and K each as two E4M3 terms, ``X8 = hi + lo / 16`` with
  ``hi = e4m3(x * scale)``, ``lo = e4m3(16 (x * scale - hi))``, and
  ``Q8 K8^T ~ Qhi Khi^T + (Qlo Khi^T + Qhi Klo^T) / 16`` (the lo x lo term, ~2^-8 of the
  rest, dropped): three FP8 products for the logits instead of one, a relative rounding
  error of ~2^-8 instead of ~2^-4. One large product that dominates a logit (an outlier
  channel in Q and K) is then no longer off by E4M3's 3-bit mantissa (tests: relative L1
  5-7e-2 -> 0.05-0.2e-2 with V 16-bit).
* ``v_scale`` (G, D): ``V8 = e4m3(v * v_scale)``, output channel d divided by v_scale[g, d]
  at the end. ``v_scale=None``: V stays in its dtype and p is rounded to that dtype (no 448:
  16-bit floats hold [0, 1]) for P V in that dtype (float32: p exact).

Triton: Q, K (and V) go to FP8 in one small quantize pass each (V8 stored with Tk
contiguous: the K-major layout Hopper's FP8 wgmma wants for P V), then a flash-style kernel,
one program per (BLOCK_M queries, batch x head), reads FP8 and runs fp8 x fp8 -> fp32
``tl.dot`` (sm89+) over KV tiles with a running max and sum. Its P is therefore rounded
against the running row max, not the final one: the one intended difference from the
reference.

Triton's interpreter (TRITON_INTERPRET=1) loads and stores FP8 and runs fp8 x fp8 ``tl.dot``
exactly, but its float32 -> E4M3 cast is wrong (ties round up, a mantissa carry is lost so
126.4 becomes 64, subnormals truncate, no saturation) and float32 -> bfloat16 truncates.
So under the interpreter those roundings are done in exact integer arithmetic
(:func:`_round_e4m3`, :func:`kernels.triton_util.to_dtype`) before the cast, which is then exact; a GPU uses its
conversion instructions (``cvt.rn.satfinite.e4m3x2.f32``: nearest-even, saturating). The
interpreter also gets bfloat16 ``tl.dot`` wrong, so there a bfloat16 P V runs in float32
(exact for bfloat16 inputs).

Dispatch: :func:`fp8_attention` validates once, then sends CUDA tensors on sm89+ with head_dim
64 or 128 to Triton and anything else (CPU, older GPUs, other head dims) to the reference. On
the CPU the Triton code runs under the interpreter through
``kernels.backends.triton_kernels("fp8_attention_triton", interpret=True).fp8_attention_triton``:
that is how the tests check it.
"""

import math

import torch

from hilt.errors import HiltError

E4M3_MAX = 448.0
P_SCALE = 448.0  # p in [0, 1] times this spans E4M3's range; the row max maps to 448 exactly
TRITON_HEAD_DIMS = (64, 128)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_REF_CHUNK = 1 << 25  # logits per query chunk in the references (bounds their memory)


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to E4M3 (clamped to +-448 first), returned in float32."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def _query_chunks(b, h, tq, tk):
    rows = max(1, _REF_CHUNK // max(1, b * h * tk))
    return [(i, min(tq, i + rows)) for i in range(0, tq, rows)]


def _causal_mask(i0, i1, tq, tk, device):
    i = torch.arange(i0, i1, device=device)[:, None]
    j = torch.arange(tk, device=device)[None, :]
    return j <= i + (tk - tq)


def attention_reference(q, k, v, causal=False, sm_scale=None):
    """Plain float32 attention (the truth): GQA by indexing kv heads, returns q's dtype."""
    _check_shapes(q, k, v, causal)
    b, h, tq, d = q.shape
    g, tk = k.shape[1], k.shape[2]
    sm_scale = _sm_scale(sm_scale, d)
    qf = q.float().reshape(b, g, h // g, tq, d)
    kf = k.float().reshape(b, g, 1, tk, d)
    vf = v.float().reshape(b, g, 1, tk, d)
    out = torch.empty(b, g, h // g, tq, d, dtype=torch.float32, device=q.device)
    for i0, i1 in _query_chunks(b, h, tq, tk):
        s = (qf[:, :, :, i0:i1] @ kf.transpose(-1, -2)) * sm_scale
        if causal:
            s = s.masked_fill(~_causal_mask(i0, i1, tq, tk, q.device), float("-inf"))
        out[:, :, :, i0:i1] = torch.softmax(s, dim=-1) @ vf
    return out.reshape(b, h, tq, d).to(q.dtype)


def _split_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) E4M3 values in float32 with x ~ hi + lo / 16 (x already scaled; see split_qk)."""
    hi = _e4m3(x)
    return hi, _e4m3((x.clamp(-E4M3_MAX, E4M3_MAX) - hi) * 16)


def fp8_attention_reference(q, k, v, q_scale, k_scale, v_scale=None, causal=False, sm_scale=None,
                            split_qk=False):
    """The definition, emulated in torch: Q, K (V) through E4M3 at their scales, S in
    float32, P = e4m3(448 * exp(S - rowmax)) / 448 (or p rounded to v's dtype when
    v_scale is None), row sum over the unquantized p. Vectorised over heads; long
    queries are processed in chunks so memory stays bounded."""
    _check_shapes(q, k, v, causal)
    q_scale, k_scale, v_scale = _check_scale_shapes(q, k, q_scale, k_scale, v_scale)
    b, h, tq, d = q.shape
    g, tk = k.shape[1], k.shape[2]
    r = h // g
    sm_scale = _sm_scale(sm_scale, d)
    qs = q_scale.view(1, g, r, 1, 1)
    ks = k_scale.view(1, g, 1, 1, 1)
    if split_qk:
        q8, q_lo = _split_e4m3(q.float().reshape(b, g, r, tq, d) * qs)
        k8, k_lo = _split_e4m3(k.float().reshape(b, g, 1, tk, d) * ks)
    else:
        q8 = _e4m3(q.float().reshape(b, g, r, tq, d) * qs)
        k8 = _e4m3(k.float().reshape(b, g, 1, tk, d) * ks)
    logit_scale = sm_scale / (qs * ks)  # (1, g, r, 1, 1)
    if v_scale is not None:
        vs = v_scale.view(1, g, 1, 1, d)
        vq = _e4m3(v.float().reshape(b, g, 1, tk, d) * vs)
    else:
        vq = v.float().reshape(b, g, 1, tk, d)
    out = torch.empty(b, g, r, tq, d, dtype=torch.float32, device=q.device)
    for i0, i1 in _query_chunks(b, h, tq, tk):
        s = q8[:, :, :, i0:i1] @ k8.transpose(-1, -2)
        if split_qk:
            s += (q_lo[:, :, :, i0:i1] @ k8.transpose(-1, -2) + q8[:, :, :, i0:i1] @ k_lo.transpose(-1, -2)) / 16
        s.mul_(logit_scale)
        if causal:
            s.masked_fill_(~_causal_mask(i0, i1, tq, tk, q.device), float("-inf"))
        p = s.sub_(s.amax(dim=-1, keepdim=True)).exp_()  # in place: these are the big tensors
        l_row = p.sum(dim=-1, keepdim=True)
        if v_scale is not None:  # 448 p <= 448: no clamp needed
            o = (p.mul_(P_SCALE).to(torch.float8_e4m3fn).float() @ vq) / (l_row * P_SCALE * vs)
        else:
            o = (p.to(v.dtype).float() @ vq) / l_row
        out[:, :, :, i0:i1] = o
    return out.reshape(b, h, tq, d).to(q.dtype)


def _sm_scale(sm_scale, d):
    if sm_scale is None:
        return 1.0 / math.sqrt(d)
    sm_scale = float(sm_scale)
    if not math.isfinite(sm_scale) or sm_scale <= 0:
        raise HiltError(f"sm_scale must be finite and > 0, got {sm_scale}")
    return sm_scale


def _check_shapes(q, k, v, causal):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise HiltError(f"{name} must be 4-D (batch, heads, tokens, head_dim), got {shape}")
        if t.dtype not in _DTYPES:
            raise HiltError(f"{name} has dtype {t.dtype}; float16, bfloat16 or float32 expected")
        if t.device != q.device:
            raise HiltError(f"{name} is on {t.device}, q on {q.device}")
    b, h, tq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise HiltError(f"batch sizes differ: q {b}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[3] != d or v.shape[3] != d:
        raise HiltError(f"head_dim differs: q {d}, k {k.shape[3]}, v {v.shape[3]}")
    if v.shape[1] != k.shape[1]:
        raise HiltError(f"k has {k.shape[1]} heads, v has {v.shape[1]}")
    if v.shape[2] != k.shape[2]:
        raise HiltError(f"k has {k.shape[2]} tokens (Tk), v has {v.shape[2]}")
    g, tk = k.shape[1], k.shape[2]
    if min(b, h, g, tq, tk, d) < 1:
        raise HiltError(f"empty attention: q {tuple(q.shape)}, k {tuple(k.shape)} (every dimension must be >= 1)")
    if h % g:
        raise HiltError(f"query heads ({h}) must be a multiple of kv heads ({g})")
    if causal and tq > tk:
        raise HiltError(f"causal attention needs Tq <= Tk (Tq {tq}, Tk {tk}): bottom-right alignment would "
                        f"leave the first {tq - tk} queries with no key")


def _check_scale_shapes(q, k, q_scale, k_scale, v_scale):
    h, g, d = q.shape[1], k.shape[1], q.shape[3]
    out = []
    for name, s, shape, what in (("q_scale", q_scale, (h,), "one per query head"),
                                 ("k_scale", k_scale, (g,), "one per kv head"),
                                 ("v_scale", v_scale, (g, d), "kv heads x head_dim")):
        if s is None and name == "v_scale":
            out.append(None)
            continue
        if not isinstance(s, torch.Tensor):
            raise HiltError(f"{name} must be a tensor of shape {shape} ({what}), got {type(s).__name__}")
        if tuple(s.shape) != shape:
            raise HiltError(f"{name} has shape {tuple(s.shape)}, expected {shape} ({what})")
        out.append(s.to(device=q.device, dtype=torch.float32).contiguous())
    return out


def _check_values(q, k, v, scales):
    """NaN/Inf in q, k, v and non-positive or non-finite scales; one host sync for all."""
    names, flags = [], []
    for name, t in (("q", q), ("k", k), ("v", v)):
        lo, hi = torch.aminmax(t)  # both propagate NaN; an Inf shows in one of them
        names.append(f"{name} contains NaN or Inf")
        flags.append(~(torch.isfinite(lo) & torch.isfinite(hi)))
    for name, s in zip(("q_scale", "k_scale", "v_scale"), scales):
        if s is not None:
            names.append(f"{name} has a zero, negative, NaN or Inf entry (scales must be finite and > 0)")
            flags.append(~(torch.isfinite(s) & (s > 0)).all())
    bad = torch.stack(flags).cpu()
    for name, flag in zip(names, bad.tolist()):
        if flag:
            raise HiltError(name)


def validate(q, k, v, q_scale, k_scale, v_scale, causal, sm_scale):
    _check_shapes(q, k, v, causal)
    scales = _check_scale_shapes(q, k, q_scale, k_scale, v_scale)
    _check_values(q, k, v, scales)
    return scales, _sm_scale(sm_scale, q.shape[3])


def triton_unsupported(q) -> str | None:
    """Why the Triton kernel cannot take ``q`` (its head dim, or a GPU without FP8 tensor cores),
    or None when it can. CPU tensors pass here: the interpreter runs them when asked for."""
    d = q.shape[3]
    if d not in TRITON_HEAD_DIMS:
        return f"head_dim {d} is not supported by the Triton FP8 attention kernel (64 or 128)"
    if q.is_cuda and torch.cuda.get_device_capability(q.device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(q.device)
        return (f"the Triton FP8 attention kernel needs compute capability 8.9+ (FP8 tensor cores); "
                f"this GPU is sm{major}{minor}")
    return None


def fp8_attention(q, k, v, q_scale, k_scale, v_scale=None, causal=False, sm_scale=None, split_qk=False):
    """Public entry: CUDA tensors on sm89+ with head_dim 64 or 128 -> Triton kernel; anything
    else (CPU, older GPUs, other head dims) -> :func:`fp8_attention_reference` on the tensors'
    device (same numbers up to the kernel's online-softmax rounding of P).

    q (B, H, Tq, D); k, v (B, G, Tk, D); q_scale (H,), k_scale (G,), v_scale (G, D) or
    None (V kept in its dtype); split_qk: Q and K as two E4M3 terms each (three FP8 products
    for the logits; for activations with outliers). Returns (B, H, Tq, D) in q's dtype. See
    the module docstring for what is computed."""
    if isinstance(q, torch.Tensor) and q.is_cuda and q.ndim == 4 and triton_unsupported(q) is None:
        from hilt.kernels.backends import triton_kernels

        kernel = triton_kernels("fp8_attention_triton").fp8_attention_triton
        return kernel(q, k, v, q_scale, k_scale, v_scale, causal, sm_scale, split_qk=split_qk)
    (q_scale, k_scale, v_scale), sm_scale = validate(q, k, v, q_scale, k_scale, v_scale, causal, sm_scale)
    return fp8_attention_reference(q, k, v, q_scale, k_scale, v_scale, causal, sm_scale, split_qk)

