"""The Triton kernels of kernels.fp8_attention (see that module for what they compute and how the
interpreter's roundings are emulated). Imported only when a kernel runs: on CUDA tensors, or
under Triton's CPU interpreter when asked for (kernels.backends.triton_kernels)."""

import math

import torch
import triton
import triton.language as tl

from hilt.errors import HiltError
from hilt.kernels.fp8_attention import E4M3_MAX, P_SCALE, triton_unsupported, validate
from hilt.kernels.triton_util import autotune, interpreting, to_dtype

# Triton kernels read module-level numbers only as constexprs
E4M3_LIMIT = tl.constexpr(E4M3_MAX)
P_RANGE = tl.constexpr(P_SCALE)


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
    y = tl.minimum(tl.maximum(x * s[None, :], -E4M3_LIMIT), E4M3_LIMIT)
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
            acc += tl.dot(_to_e4m3(p * P_RANGE, EMULATE), v)
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
        out = out / (tl.load(vs_ptr + g * HEAD_DIM + offs_d) * P_RANGE)[None, :]
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


def fp8_attention_triton(q, k, v, q_scale, k_scale, v_scale=None, causal=False, sm_scale=None, *,
                         split_qk=False, block_m=None, block_n=None, out=None):
    """The Triton path (a GPU with FP8 tensor cores, or the CPU interpreter); same arguments
    as :func:`fp8_attention`. ``block_m``/``block_n`` override the tile sizes (tests);
    ``out`` is an optional (B, H, Tq, D) output tensor in q's dtype."""
    (q_scale, k_scale, v_scale), sm_scale = validate(q, k, v, q_scale, k_scale, v_scale, causal, sm_scale)
    reason = triton_unsupported(q)
    if reason:
        raise HiltError(reason)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype or out.device != q.device:
        raise HiltError(f"out must be {q.dtype} {tuple(q.shape)} on {q.device}, got {out.dtype} "
                        f"{tuple(out.shape)} on {out.device}")
    q8, k8, v8, *lows = quantize_inputs(q, k, v, q_scale, k_scale, v_scale, split_qk)
    return attention_from_fp8(q8, k8, v8, q_scale, k_scale, v_scale, causal, sm_scale, out, block_m, block_n, *lows)

