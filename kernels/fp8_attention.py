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
the CPU the Triton code runs under the interpreter through :func:`fp8_attention_triton`: that
is how the tests check it.
"""

import math

import torch
import triton
import triton.language as tl

from kernels.errors import HiltError
from kernels.triton_util import autotune, interpreting, to_dtype

E4M3_MAX = 448.0
P_SCALE = 448.0  # p in [0, 1] times this spans E4M3's range; the row max maps to 448 exactly
TRITON_HEAD_DIMS = (64, 128)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_REF_CHUNK = 1 << 25  # logits per query chunk in the references (bounds their memory)


# ----------------------------------------------------------------------------- references


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


# ----------------------------------------------------------------------------- checks


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


def _validate(q, k, v, q_scale, k_scale, v_scale, causal, sm_scale):
    _check_shapes(q, k, v, causal)
    scales = _check_scale_shapes(q, k, q_scale, k_scale, v_scale)
    _check_values(q, k, v, scales)
    return scales, _sm_scale(sm_scale, q.shape[3])


# ----------------------------------------------------------------------------- Triton


@triton.jit
def _round_e4m3(x):
    """x (float32, already within +-448) rounded to the nearest E4M3 value, ties to even,
    with exact integer arithmetic; the result is float32 and converts to FP8 exactly."""
    a = tl.abs(x)
    # normal range (|x| >= 2^-6): keep 3 mantissa bits, nearest-even; a carry moves the exponent
    bits = a.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 == ~0xFFFFF
    normal = bits.to(tl.float32, bitcast=True)
    # subnormal range: multiples of 2^-9
    y = a * 512.0
    fl = y.to(tl.int32)  # y >= 0: truncation is floor
    frac = y - fl.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((fl & 1) == 1))
    sub = (fl + up.to(tl.int32)).to(tl.float32) * (1.0 / 512.0)
    r = tl.where(a < 0.015625, sub, normal)
    return tl.where(x < 0, -r, r)


@triton.jit
def _to_e4m3(x, EMULATE: tl.constexpr):
    if EMULATE:
        x = _round_e4m3(x)
    return x.to(tl.float8e4nv)


@triton.jit
def _quantize_kernel(
    x_ptr, s_ptr, y_ptr, lo_ptr, T, HX,
    stride_xb, stride_xh, stride_xt, stride_xd,
    stride_yb, stride_yh, stride_yt, stride_yd,
    stride_sh, stride_sd,
    D: tl.constexpr, BLOCK_T: tl.constexpr, EMULATE: tl.constexpr, SPLIT: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HX).to(tl.int64)
    h = (pid_bh % HX).to(tl.int64)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, D)
    mask = (offs_t < T)[:, None]
    x = tl.load(x_ptr + b * stride_xb + h * stride_xh + offs_t[:, None] * stride_xt + offs_d[None, :] * stride_xd,
                mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + h * stride_sh + offs_d * stride_sd)
    y = tl.minimum(tl.maximum(x * s[None, :], -448.0), 448.0)
    y_offs = b * stride_yb + h * stride_yh + offs_t[:, None] * stride_yt + offs_d[None, :] * stride_yd
    hi = _to_e4m3(y, EMULATE)
    tl.store(y_ptr + y_offs, hi, mask=mask)
    if SPLIT:  # lo has y's strides; |y - hi| <= 16 (half an ulp at 448), so 16 (y - hi) stays in range
        tl.store(lo_ptr + y_offs, _to_e4m3((y - hi.to(tl.float32)) * 16.0, EMULATE), mask=mask)


@triton.jit
def _attn_tile(
    acc, l_i, m_i, q, q_lo, k_base, k_lo_base, v_base, offs_m, lo, hi, Tk, causal_off, qk_scale,
    stride_kn, stride_kd, stride_vn, stride_vd,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    V_FP8: tl.constexpr, EMULATE: tl.constexpr, PV_FP32: tl.constexpr, SPLIT: tl.constexpr,
):
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
        if MASKED:
            in_k = (offs_n < Tk)[:, None]
            k = tl.load(k_ptrs, mask=in_k, other=0.0)
            v = tl.load(v_ptrs, mask=in_k, other=0.0)  # zeros: p * garbage could be NaN
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = tl.dot(q, tl.trans(k))  # fp8 x fp8 -> fp32
        if SPLIT:
            k_lo_ptrs = k_lo_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
            if MASKED:
                k_lo = tl.load(k_lo_ptrs, mask=(offs_n < Tk)[:, None], other=0.0)
            else:
                k_lo = tl.load(k_lo_ptrs)
            s += (tl.dot(q_lo, tl.trans(k)) + tl.dot(q, tl.trans(k_lo))) * 0.0625
        s = s * qk_scale  # logits in log2 units
        if MASKED:
            keep = (offs_n < Tk)[None, :]
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= offs_m[:, None] + causal_off)
            s = tl.where(keep, s, float("-inf"))
        # every row sees key 0 in the first tile, so m_new is finite from then on
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if V_FP8:
            acc += tl.dot(_to_e4m3(p * 448.0, EMULATE), v)
        elif PV_FP32:
            acc += tl.dot(to_dtype(p, v.dtype, EMULATE).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(to_dtype(p, v.dtype, EMULATE), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, qs_ptr, ks_ptr, vs_ptr, o_ptr, q_lo_ptr, k_lo_ptr,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    H, GROUP, Tq, Tk, sm_scale_log2, tk_bucket,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    V_FP8: tl.constexpr, EMULATE: tl.constexpr, PV_FP32: tl.constexpr, SPLIT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    g = h // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_offs = b * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    q = tl.load(q_ptr + q_offs, mask=(offs_m < Tq)[:, None], other=0.0)
    if SPLIT:  # q_lo has q's strides
        q_lo = tl.load(q_lo_ptr + q_offs, mask=(offs_m < Tq)[:, None], other=0.0)
    else:
        q_lo = q
    qk_scale = sm_scale_log2 / (tl.load(qs_ptr + h) * tl.load(ks_ptr + g))
    k_base = k_ptr + b * stride_kb + g.to(tl.int64) * stride_kh
    v_base = v_ptr + b * stride_vb + g.to(tl.int64) * stride_vh
    k_lo_base = k_lo_ptr + b * stride_kb + g.to(tl.int64) * stride_kh  # same strides as k
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    if CAUSAL:
        causal_off = Tk - Tq
        # tiles every row of this block sees whole, then the tiles crossing the diagonal
        full_hi = (tl.minimum(start_m + causal_off + 1, Tk) // BLOCK_N) * BLOCK_N
        hi = tl.minimum(start_m + BLOCK_M + causal_off, Tk)
    else:
        causal_off = 0
        full_hi = (Tk // BLOCK_N) * BLOCK_N
        hi = Tk
    acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, q_lo, k_base, k_lo_base, v_base, offs_m, 0, full_hi, Tk, causal_off, qk_scale,
                               stride_kn, stride_kd, stride_vn, stride_vd,
                               HEAD_DIM, BLOCK_N, False, CAUSAL, V_FP8, EMULATE, PV_FP32, SPLIT)
    acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, q_lo, k_base, k_lo_base, v_base, offs_m, full_hi, hi, Tk, causal_off, qk_scale,
                               stride_kn, stride_kd, stride_vn, stride_vd,
                               HEAD_DIM, BLOCK_N, True, CAUSAL, V_FP8, EMULATE, PV_FP32, SPLIT)
    out = acc / l_i[:, None]
    if V_FP8:
        out = out / (tl.load(vs_ptr + g * HEAD_DIM + offs_d) * 448.0)[None, :]
    tl.store(o_ptr + b * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_om
             + offs_d[None, :] * stride_od, to_dtype(out, o_ptr.dtype.element_ty, EMULATE), mask=(offs_m < Tq)[:, None])


# Compiled for sm_90 (`hilt bench kernels --sass`), 128 x 64 tiles with 4 warps and 4 stages
# spill 312-528 bytes of registers per thread with V in FP8 or split_qk, and are left out;
# of these, only 128 x 128 spills (216-288 bytes, with split_qk).
TUNING_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=3),
]
# Keyed on the power-of-two bucket of Tk, not Tk itself, so a model's many lengths share a tuning.
_attn_fwd_tuned = autotune(TUNING_CONFIGS, key=["tk_bucket", "HEAD_DIM", "CAUSAL", "V_FP8", "SPLIT"])(_attn_fwd_kernel)
INTERPRETER_BLOCKS = (64, 64)  # (BLOCK_M, BLOCK_N): one fixed small config keeps the interpreter fast


def _quantize(x, scale, out, emulate, lo=None):
    """E4M3 copy of x (B, HX, T, D) into ``out`` (any strides) at ``scale`` (HX, D) or (HX,);
    with ``lo`` (out's shape and strides), the split_qk second term too."""
    b, hx, t, d = x.shape
    stride_sd = scale.stride(1) if scale.ndim == 2 else 0
    block_t = 64
    _quantize_kernel[(triton.cdiv(t, block_t), b * hx)](
        x, scale, out, out if lo is None else lo, t, hx, *x.stride(), *out.stride(), scale.stride(0), stride_sd,
        D=d, BLOCK_T=block_t, EMULATE=emulate, SPLIT=lo is not None)
    return out


def quantize_inputs(q, k, v, q_scale, k_scale, v_scale, split_qk=False):
    """(q8, k8, v8) or, with split_qk, (q8, k8, v8, q_lo, k_lo): the FP8 copies the attention
    kernel reads (v8 is v itself when v_scale is None).

    v8 is stored with Tk contiguous (padded to 16 elements) and returned as a (B, G, Tk, D) view.
    head_dim must be 64 or 128; inputs are not validated here (see :func:`fp8_attention_triton`)."""
    emulate = interpreting()
    f8 = torch.float8_e4m3fn
    q8, k8 = (torch.empty(x.shape, dtype=f8, device=x.device) for x in (q, k))
    lows = tuple(torch.empty_like(x8) for x8 in (q8, k8)) if split_qk else (None, None)
    _quantize(q, q_scale, q8, emulate, lows[0])
    _quantize(k, k_scale, k8, emulate, lows[1])
    if v_scale is None:
        v8 = v
    else:
        b, g, tk, d = v.shape
        store = torch.empty(b, g, d, triton.cdiv(tk, 16) * 16, dtype=f8, device=v.device)
        v8 = _quantize(v, v_scale, store[..., :tk].transpose(2, 3), emulate)
    return (q8, k8, v8, *lows) if split_qk else (q8, k8, v8)


def attention_from_fp8(q8, k8, v8, q_scale, k_scale, v_scale, causal, sm_scale, out,
                       block_m=None, block_n=None, q_lo=None, k_lo=None):
    """Launch the attention kernel on inputs already quantized by :func:`quantize_inputs`
    (``q_lo``, ``k_lo``: the split_qk second terms, both or neither)."""
    b, h, tq, d = q8.shape
    g, tk = k8.shape[1], k8.shape[2]
    v_fp8 = v_scale is not None
    emulate = interpreting()
    pv_fp32 = not v_fp8 and (v8.dtype == torch.float32 or (emulate and v8.dtype == torch.bfloat16))
    split = q_lo is not None
    if split != (k_lo is not None):
        raise HiltError("split_qk needs the second terms of both Q and K (q_lo and k_lo)")
    args = (q8, k8, v8, q_scale, k_scale, v_scale if v_fp8 else q_scale, out,
            q_lo if split else q8, k_lo if split else k8, *q8.stride(), *k8.stride(), *v8.stride(), *out.stride(),
            h, h // g, tq, tk, sm_scale * math.log2(math.e), triton.next_power_of_2(tk))
    flags = {"HEAD_DIM": d, "CAUSAL": bool(causal), "V_FP8": v_fp8, "EMULATE": emulate, "PV_FP32": pv_fp32,
             "SPLIT": split}
    if q8.is_cuda and block_m is None and block_n is None:
        def grid(meta):
            return (triton.cdiv(tq, meta["BLOCK_M"]), b * h)

        _attn_fwd_tuned[grid](*args, **flags)
    else:
        bm = block_m or (INTERPRETER_BLOCKS[0] if emulate else 128)
        bn = block_n or (INTERPRETER_BLOCKS[1] if emulate else 64)
        _attn_fwd_kernel[(triton.cdiv(tq, bm), b * h)](*args, BLOCK_M=bm, BLOCK_N=bn, **flags)
    return out


def _check_triton(q):
    d = q.shape[3]
    if d not in TRITON_HEAD_DIMS:
        raise HiltError(f"head_dim {d} is not supported by the Triton FP8 attention kernel (64 or 128)")
    if q.is_cuda and torch.cuda.get_device_capability(q.device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(q.device)
        raise HiltError(f"the Triton FP8 attention kernel needs compute capability 8.9+ (FP8 tensor cores); "
                        f"this GPU is sm{major}{minor}")


def fp8_attention_triton(q, k, v, q_scale, k_scale, v_scale=None, causal=False, sm_scale=None, *,
                         split_qk=False, block_m=None, block_n=None, out=None):
    """The Triton path (a GPU with FP8 tensor cores, or the CPU interpreter); same arguments
    as :func:`fp8_attention`. ``block_m``/``block_n`` override the tile sizes (tests);
    ``out`` is an optional (B, H, Tq, D) output tensor in q's dtype."""
    (q_scale, k_scale, v_scale), sm_scale = _validate(q, k, v, q_scale, k_scale, v_scale, causal, sm_scale)
    _check_triton(q)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype or out.device != q.device:
        raise HiltError(f"out must be {q.dtype} {tuple(q.shape)} on {q.device}, got {out.dtype} "
                        f"{tuple(out.shape)} on {out.device}")
    q8, k8, v8, *lows = quantize_inputs(q, k, v, q_scale, k_scale, v_scale, split_qk)
    return attention_from_fp8(q8, k8, v8, q_scale, k_scale, v_scale, causal, sm_scale, out, block_m, block_n, *lows)


def _triton_runs(q) -> bool:
    return (isinstance(q, torch.Tensor) and q.is_cuda and q.ndim == 4 and q.shape[3] in TRITON_HEAD_DIMS
            and torch.cuda.get_device_capability(q.device) >= (8, 9))


def fp8_attention(q, k, v, q_scale, k_scale, v_scale=None, causal=False, sm_scale=None, split_qk=False):
    """Public entry: CUDA tensors on sm89+ with head_dim 64 or 128 -> Triton kernel; anything
    else (CPU, older GPUs, other head dims) -> :func:`fp8_attention_reference` on the tensors'
    device (same numbers up to the kernel's online-softmax rounding of P).

    q (B, H, Tq, D); k, v (B, G, Tk, D); q_scale (H,), k_scale (G,), v_scale (G, D) or
    None (V kept in its dtype); split_qk: Q and K as two E4M3 terms each (three FP8 products
    for the logits; for activations with outliers). Returns (B, H, Tq, D) in q's dtype. See
    the module docstring for what is computed."""
    if _triton_runs(q):
        return fp8_attention_triton(q, k, v, q_scale, k_scale, v_scale, causal, sm_scale, split_qk=split_qk)
    (q_scale, k_scale, v_scale), sm_scale = _validate(q, k, v, q_scale, k_scale, v_scale, causal, sm_scale)
    return fp8_attention_reference(q, k, v, q_scale, k_scale, v_scale, causal, sm_scale, split_qk)
