"""Certificates: the smallest weight change that flips a prediction (docs/references.md §7).

    from hilt.cim_sim import certify, quantization_perturbation, cim_perturbation
    certs = certify(model, (images, labels), quantization_perturbation(model, QuantConfig("int", 4)))
    certs.fractions()     # {"exact": ..., "first_order": ..., "lipschitz": ...}

Supported models: a chain of ``nn.Linear``, ``nn.Conv1d`` and ``nn.Conv2d`` layers (groups 1, zero
padding) with ReLU or GELU activations, max or average pooling, flatten/reshape, dropout (in eval)
and an optional final log-softmax, written as modules or as functional calls in ``forward``
(torch.fx reads the chain). The output must be class scores, (batch, classes), straight from the
last weight layer. Anything else (another activation, a residual connection, batch norm) is refused
with a HiltError that names it.

Notation. Layer l maps its input x_{l-1} to y_l = A_l(W_l, x_{l-1}) + b_l, bilinear in the
weight and the input (a matrix product, or a convolution: W_l times the im2col matrix U(x) of
input patches, one row per output position). Between layers, x_l = phi_l(y_l) with phi_l a
composition of activations, pools and reshapes with Lipschitz constant c_l. The class scores
are z = y_L; the prediction is i = argmax z, the pair margins m_ij = z_i - z_j (j != i) and the
margin m = min_j m_ij. Only the weights are perturbed, W_l -> W_l + D_l: hilt's formats
quantize weights and keep biases, CIM arrays hold weights and add the bias digitally.

1. Last layer, exact. With only W_L perturbed, z' = z + A_L(D, x_{L-1}) is affine in D, so the
   prediction leaves i iff, for some j, <grad_W m_ij, D> <= -m_ij: a union of half-spaces. The
   Frobenius distance to a half-space {<g, D> <= -m} is m / ||g||_F, so the smallest flipping
   perturbation has norm exactly

       rho_L = min_j m_ij / ||grad_W m_ij||_F  =  min_j (z_i - z_j) / (sqrt(2) ||a||)

   for a Linear layer (grad_W m_ij = (e_i - e_j) a^T, a = x_{L-1}; attained by
   D = -(m_ij / 2) (e_i - e_j) a^T / ||a||^2). The bias enters only through z. (Were the bias
   perturbed too, ||a|| would become sqrt(||a||^2 + 1).) For a convolutional last layer the
   gradient is D_ij U (below); the formula is the same and still exact.

2. Hidden layers, first order. m_ij(W_l + D) = m_ij + <grad_{W_l} m_ij, D> + O(||D||^2), and the
   same half-space argument gives rho_l ~ min_j m_ij / ||grad_{W_l} m_ij||_F. The gradient is
   sum_p g_p u_p^T, with g = d m_ij / d y_l the margin back-propagated to the layer's output and
   u_p the input patch at output position p: g a^T (norm ||g|| ||a||) for a Linear layer, the
   product D U of the (out x positions) gradient map and the (positions x C k_h k_w) im2col matrix
   for a convolution (the Jacobian of a conv's output in its weights is the im2col matrix). This
   is NOT a bound: ReLU and max-pool switching can make the true minimum smaller. It is flagged
   first order and its violations are counted by Monte-Carlo (bench/studies/certify.py).

3. All layers at once, sound. With d_l = ||x'_l - x_l||, e_l = ||y'_l - y_l|| and eps_l >= ||D_l||_F:

       y'_l - y_l = A_l(W_l, x'_{l-1} - x_{l-1}) + A_l(D_l, x'_{l-1})          (the bias cancels)
       ||A_l(W_l, v)||    <= Lambda_l ||v||                     (Lambda_l: operator norm of the layer)
       ||A_l(D, v)||      =  ||D U(v)||_F <= ||D||_2 ||U(v)||_F <= ||D||_F ||U(v)||_F
       ||U(x'_{l-1})||_F  <= nu_l + sqrt(R_l) d_{l-1}           (U linear; ||U(v)||^2 <= R_l ||v||^2)

   where nu_l = ||U(x_{l-1})||_F is the actual input's patch norm (||x_{l-1}|| for a Linear layer)
   and R_l the largest number of patches one input element belongs to (1 for Linear). Hence

       e_l <= Lambda_l d_{l-1} + eps_l (nu_l + sqrt(R_l) d_{l-1}),   d_l <= c_l e_l,   d_0 = 0,

   with every product of perturbations kept: no linearisation anywhere. A flip needs
   Dz_j - Dz_i >= m_ij >= m for some j, and |Dz_j - Dz_i| <= sqrt(2) ||Dz|| <= sqrt(2) e_L, so the
   input is certified when sqrt(2) e_L < m. Lambda_l is an upper bound: for a Linear layer the
   largest singular value (float64 SVD, rounded up by 1e-6); for a convolution the zero-padded
   map is the circular convolution on a grid of (H + 2p) with the input embedded by zeros and
   the output restricted (and strided), so Lambda_l <= max_f sigma_max(K_hat(f)) over the 2-D
   DFT of the kernel on that grid (Sedghi, Gupta and Long 2019). Power iteration on conv /
   conv_transpose gives a lower bound, reported beside it. c_l: ReLU 1; GELU 1.13 (max |GELU'| =
   1.1290 at x = sqrt(2), tanh form 1.1290); max pool sqrt(largest number of windows one element is
   in), so 1 for non-overlapping windows; average pool sqrt(max_p sum_{w ni p} r_w^2 / s_w) with
   r_w the window's weight sum and s_w its element count; flatten and dropout (eval) 1.
   Perturbing layer l alone, the same recursion gives the sound single-layer radius
   r_l = m / (sqrt(2) nu_l c_l prod_{k>l} Lambda_k c_k); at the last layer it equals rho_L.

4. A chip at time t (`cim_perturbation`): the weight the arrays hold is
   W_eff = alpha (G+ - G-) w_max / g_max, each conductance read from the device model of
   cim_sim.devices: g_p = max(0, g_T + sigma_p(g_T) xi), nu = f |mu(g_T) + s(g_T) zeta|,
   g = max(0, g_p (T/t0)^-nu (1 + sigma_r(t) Q(g_p) eta)), xi, zeta, eta independent N(0, 1), and a
   stuck-at mixture where the preset has one. Per device, E[g^k] (k = 1..4) is computed in
   closed form in zeta (the folded normal's Laplace transform) and eta (moments of a rectified
   normal), by Gauss-Legendre quadrature in xi (split where Q(g_p) stops being clipped). The two
   devices of a pair are independent, which gives E[W^k] and so the first four moments of every
   weight error D = alpha W_eff - w. Devices are independent, so S = ||D||_F^2 has mean
   sum E[D^2] and variance sum Var(D^2); Cantelli's inequality P(S >= E S + k) <= Var S /
   (Var S + k^2) then bounds S with probability 1 - delta' for any distribution (no Gaussian
   assumption), and a union bound over layers (delta' = delta / layers) makes the bounds hold for
   all layers at once with probability >= 1 - delta. Per-read weight noise (pcm-hwa's w_noise),
   Gaussian with variance w_noise^2 w_max |W_eff|, gets a second Cantelli bound (half of delta').
   Assumptions, not rigorous: the drift compensation alpha is treated as a constant, its
   mean-field value (the probe's expected mean |y| at programming over the same at time t, each
   |y| a folded normal from the weights' means and variances plus the converters' and output
   noise's variance); the noise integrals are tabulated on 4,097 target conductances and
   interpolated (within 3e-5 relative of direct quadrature, which is within 1e-9 of 64 nodes);
   the read noise's tabulated normal (cut at 4.33 sigma) is treated as a true normal (it has
   lighter tails). The bound covers
   the weights the arrays hold; the periphery (DAC/ADC rounding, output noise, IR drop) is not a
   weight perturbation and is outside it. bench/studies/certify.py checks the bound by drawing
   chips with the simulator itself.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hilt.errors import HiltError

GELU_LIPSCHITZ = 1.13  # >= max |GELU'(x)| = 1.12899 (exact erf form and tanh form alike)
KINDS = ("exact", "first_order", "lipschitz")
_ROUND_UP = 1 + 1e-6  # float64 norms rounded up: the sound bound never uses a value below the true one
_UNSUPPORTED_ACTIVATIONS = {
    "sigmoid", "tanh", "silu", "elu", "selu", "celu", "leaky_relu", "relu6", "hardtanh", "softplus", "mish",
    "hardswish", "hardsigmoid", "softsign", "logsigmoid", "prelu", "softmax", "softmin", "glu", "tanhshrink",
    "softshrink", "hardshrink", "threshold", "rrelu", "sin", "exp", "abs", "leakyrelu",
}
_SUPPORTED = ("certificates handle Linear, Conv1d and Conv2d layers with ReLU or GELU activations, max or average "
              "pooling, flatten and dropout")


# ----------------------------------------------------------------------------- the model as a chain


@dataclass
class _Step:
    """One operation of the chain. ``op``: affine | relu | gelu | maxpool | avgpool | reshape | identity |
    log_softmax. ``params``: a pool's settings; ``call``: the operation as x -> y."""

    op: str
    name: str
    module: nn.Module | None = None
    call: object = None
    params: dict = field(default_factory=dict)
    lipschitz: float = 1.0
    in_shape: tuple = ()  # per sample, from the first forward
    out_shape: tuple = ()


def _pool_params(kind: str, dims: int, src, args=(), kwargs=None) -> dict:
    """A pool's settings from its module, or from a functional call's arguments."""
    names = {"max": ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices"),
             "avg": ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")}[kind]
    if src is not None:
        p = {n: getattr(src, n) for n in names if hasattr(src, n)}
    else:
        p = dict(zip(names, args))
        p.update(kwargs or {})
    tup = lambda v, d: tuple(v) if isinstance(v, (tuple, list)) else (v,) * dims if v is not None else d  # noqa: E731
    k = tup(p["kernel_size"], None)
    return {"kernel_size": k, "stride": tup(p.get("stride") or None, k), "padding": tup(p.get("padding", 0), (0,) * dims),
            "dilation": tup(p.get("dilation", 1), (1,) * dims), "ceil_mode": bool(p.get("ceil_mode", False)),
            "count_include_pad": bool(p.get("count_include_pad", True)), "divisor_override": p.get("divisor_override"),
            "dims": dims}


def _check_affine(name: str, m: nn.Module) -> None:
    if isinstance(m, (nn.Conv1d, nn.Conv2d)):
        if m.groups != 1 or m.padding_mode != "zeros":
            raise HiltError(f"layer '{name}': convolutions with groups={m.groups}, padding_mode={m.padding_mode!r} "
                            "are not supported; certificates handle groups=1 with zero padding")
        if isinstance(m.padding, str) and m.padding != "valid":
            raise HiltError(f"layer '{name}': padding={m.padding!r} is not supported; give the padding as numbers")


def _module_step(name: str, m: nn.Module) -> _Step:
    if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)):
        _check_affine(name, m)
        return _Step("affine", name, m)
    if isinstance(m, nn.ReLU):
        return _Step("relu", name, call=F.relu)
    if isinstance(m, nn.GELU):
        return _Step("gelu", name, call=lambda x, a=m.approximate: F.gelu(x, approximate=a), lipschitz=GELU_LIPSCHITZ)
    for cls, kind, dims in ((nn.MaxPool1d, "max", 1), (nn.MaxPool2d, "max", 2), (nn.AvgPool1d, "avg", 1),
                            (nn.AvgPool2d, "avg", 2)):
        if isinstance(m, cls):
            return _Step(f"{kind}pool", name, params=_pool_params(kind, dims, m))
    if isinstance(m, (nn.Flatten, nn.Unflatten)):
        return _Step("reshape", name, call=m)
    if isinstance(m, (nn.Identity, nn.Dropout)):
        return _Step("identity", name, call=m)
    if isinstance(m, nn.LogSoftmax):
        return _Step("log_softmax", name, call=m)
    kind = type(m).__name__
    if kind.lower() in _UNSUPPORTED_ACTIVATIONS or kind.lower().rstrip("0123456789") in _UNSUPPORTED_ACTIVATIONS:
        raise HiltError(f"layer '{name}': activation {kind} is not supported (certificates handle ReLU and GELU)")
    raise HiltError(f"layer '{name}' ({kind}) is not supported: {_SUPPORTED}")


def _function_step(node, target, args, kwargs) -> _Step:
    """A call_function or call_method node of the traced forward."""
    fname = target if isinstance(target, str) else getattr(target, "__name__", str(target))
    base = fname.rstrip("_")
    name = node.name
    rest, kw = args[1:], dict(kwargs)
    if base == "relu":
        return _Step("relu", name, call=F.relu)
    if base == "gelu":
        approx = kw.get("approximate", rest[0] if rest else "none")
        return _Step("gelu", name, call=lambda x: F.gelu(x, approximate=approx), lipschitz=GELU_LIPSCHITZ)
    for prefix, kind in (("max_pool", "max"), ("avg_pool", "avg")):
        if base in (f"{prefix}1d", f"{prefix}2d"):
            if kw.get("return_indices") or (kind == "max" and len(rest) >= 6 and rest[5]):
                raise HiltError(f"'{name}': max pooling that returns indices is not supported")
            return _Step(f"{kind}pool", name, params=_pool_params(kind, int(base[-2]), None, rest, kw))
    if base in ("flatten", "view", "reshape", "unflatten", "squeeze", "unsqueeze"):
        return _Step("reshape", name)
    if base in ("contiguous", "clone", "detach"):
        return _Step("identity", name, call=lambda x: x)
    if base == "dropout":
        if kw.get("training", rest[1] if len(rest) > 1 else True) and kw.get("p", rest[0] if rest else 0.5):
            raise HiltError(f"'{name}': dropout in training mode changes the function; call it with training=self.training "
                            "and put the model in eval mode")
        return _Step("identity", name, call=lambda x: x)
    if base == "log_softmax":
        return _Step("log_softmax", name, call=lambda x: F.log_softmax(x, dim=kw.get("dim", rest[0] if rest else -1)))
    if base in ("linear", "conv1d", "conv2d"):
        raise HiltError(f"'{name}': a functional {base} (its weight not a Linear/Conv module) is not supported; "
                        "use nn.Linear / nn.Conv1d / nn.Conv2d")
    if base in _UNSUPPORTED_ACTIVATIONS:
        raise HiltError(f"'{name}': activation {base} is not supported (certificates handle ReLU and GELU)")
    raise HiltError(f"'{name}': operation {fname!r} is not supported: {_SUPPORTED}")


def _trace(model: nn.Module) -> list[_Step]:
    """The model's forward as a list of steps, each taking the previous one's output (torch.fx)."""
    import torch.fx

    try:
        gm = torch.fx.symbolic_trace(model)
    except Exception as e:  # any tracing failure: data-dependent control flow, unsupported Python
        reason = (str(e).strip().splitlines() or [""])[0][:160]
        raise HiltError(f"cannot read {type(model).__name__}'s forward as a chain of layers (torch.fx: "
                        f"{type(e).__name__}: {reason})") from None
    modules = dict(gm.named_modules())
    shape_queries = set()
    steps, current = [], None
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if current is not None:
                raise HiltError(f"{type(model).__name__}.forward takes more than one input; certificates need one")
            current = node
            continue
        if node.op == "output":
            if node.args[0] is not current:
                raise HiltError(f"{type(model).__name__} does not return one tensor of class scores")
            break
        if node.op == "get_attr":
            raise HiltError(f"'{node.target}': the forward uses a parameter outside a Linear/Conv layer; {_SUPPORTED}")
        if (node.op == "call_method" and node.target in ("size", "dim")) or \
                (node.op == "call_function" and getattr(node.target, "__name__", "") == "getattr") or \
                (node.args and node.args[0] in shape_queries):
            shape_queries.add(node)  # x.size(0), x.shape[0]: read the shape, do not advance the chain
            continue
        others = [a for a in _flat((node.args[1:], node.kwargs)) if isinstance(a, torch.fx.Node)]
        if not node.args or node.args[0] is not current or any(a not in shape_queries for a in others):
            what = f"layer '{node.target}'" if node.op == "call_module" else f"'{node.name}'"
            raise HiltError(f"{type(model).__name__} is not a chain of layers at {what} (a residual connection or "
                            f"several inputs); certificates need each operation to take the previous one's output")
        if node.op == "call_module":
            steps.append(_module_step(node.target, modules[node.target]))
        else:
            steps.append(_function_step(node, node.target, node.args, node.kwargs))
        current = node
    if not any(s.op == "affine" for s in steps):
        raise HiltError(f"{type(model).__name__} has no Linear or Conv layer to certify")
    last = max(i for i, s in enumerate(steps) if s.op == "affine")
    for s in steps[last + 1:]:
        if s.op not in ("reshape", "identity", "log_softmax"):
            raise HiltError(f"'{s.name}' ({s.op}) follows the last weight layer '{steps[last].name}': certificates need "
                            "class scores straight from a Linear/Conv layer (a final log_softmax is fine)")
    return steps


def _flat(value):
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from _flat(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _flat(v)
    else:
        yield value


# ----------------------------------------------------------------------------- per-operation maths


def _window_sums(values: torch.Tensor, p: dict, size: tuple) -> torch.Tensor:
    """For each input element, the sum of ``values`` (one per pooling window) over the windows that
    contain it: the adjoint of the window sum, as a transposed convolution with a ones kernel."""
    if p["dims"] == 1:
        values = values.unsqueeze(-2)
    k = (1,) * (2 - p["dims"]) + tuple(p["kernel_size"])
    s = (1,) * (2 - p["dims"]) + tuple(p["stride"])
    pad = (0,) * (2 - p["dims"]) + tuple(p["padding"])
    dil = (1,) * (2 - p["dims"]) + tuple(p["dilation"])
    ones = torch.ones(1, 1, *k, dtype=values.dtype)
    return F.conv_transpose2d(values.reshape(1, 1, *values.shape[-2:]), ones, stride=s, padding=pad, dilation=dil)


def _pool_lipschitz(step: _Step, in_shape: tuple) -> float:
    """Lipschitz constant (l2) of a max or average pool on inputs of ``in_shape`` (per sample)."""
    p = step.params
    spatial = in_shape[-p["dims"]:]
    one = torch.ones(1, 1, *spatial, dtype=torch.float64)
    out = _apply_pool(step, one)
    mult = float(_window_sums(torch.ones_like(out), p, spatial).max())
    if step.op == "maxpool":  # |max a - max b| <= max |a - b| <= ||a - b|| per window
        return math.sqrt(mult)
    # average: y_w = (1/n_w) sum_{p in w} x_p, so y_w^2 <= (s_w / n_w^2) sum x_p^2 with s_w real elements
    q = dict(p, count_include_pad=True, divisor_override=None)
    elems = _apply_pool(dataclasses.replace(step, params=q), one) * math.prod(p["kernel_size"])  # s_w
    r = out  # s_w / n_w: the op applied to ones
    return math.sqrt(float(_window_sums(r * r / elems.clamp_min(1e-12), p, spatial).max()))


def _apply_pool(step: _Step, x: torch.Tensor, indices: bool = False):
    p = step.params
    if step.op == "maxpool":
        fn = F.max_pool1d if p["dims"] == 1 else F.max_pool2d
        return fn(x, p["kernel_size"], p["stride"], p["padding"], p["dilation"], p["ceil_mode"], return_indices=indices)
    if p["dims"] == 1:
        return F.avg_pool1d(x, p["kernel_size"], p["stride"], p["padding"], p["ceil_mode"], p["count_include_pad"])
    return F.avg_pool2d(x, p["kernel_size"], p["stride"], p["padding"], p["ceil_mode"], p["count_include_pad"],
                        p["divisor_override"])


def _conv_args(m: nn.Module) -> dict:
    padding = (0,) * (m.weight.dim() - 2) if isinstance(m.padding, str) else tuple(m.padding)
    return {"stride": tuple(m.stride), "padding": padding, "dilation": tuple(m.dilation)}


def _affine(m: nn.Module, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """The layer on x, with its own weight, another one, or one per sample (weight.dim() one more)."""
    w = m.weight if weight is None else weight
    per_sample = w.dim() == m.weight.dim() + 1
    if isinstance(m, nn.Linear):
        if not per_sample:
            return F.linear(x, w, m.bias)
        y = torch.einsum("n...i,noi->n...o", x, w)
        return y if m.bias is None else y + m.bias
    conv = F.conv1d if isinstance(m, nn.Conv1d) else F.conv2d
    a = _conv_args(m)
    if not per_sample:
        return conv(x, w, m.bias, **a)
    n = x.shape[0]  # one weight per sample: a grouped convolution over the batch
    y = conv(x.reshape(1, n * x.shape[1], *x.shape[2:]), w.reshape(n * w.shape[1], *w.shape[2:]), None, **a, groups=n)
    y = y.reshape(n, w.shape[1], *y.shape[2:])
    return y if m.bias is None else y + m.bias.view(1, -1, *([1] * (y.dim() - 2)))


def _patches(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """im2col: (n, positions, C k...) for a conv layer's input, in the order of W.reshape(out, -1) and of
    the output's positions; (n, positions, in) for a Linear one. A strided view and one copy: much
    faster on the CPU than F.unfold (as cim_sim.analog does)."""
    if isinstance(m, nn.Linear):
        return x.reshape(x.shape[0], -1, x.shape[-1])
    a = _conv_args(m)
    dims = x.dim() - 2
    pad = [p for i in reversed(range(dims)) for p in (a["padding"][i], a["padding"][i])]
    xp = F.pad(x, pad).contiguous()
    k = m.kernel_size
    out = [(xp.shape[2 + i] - a["dilation"][i] * (k[i] - 1) - 1) // a["stride"][i] + 1 for i in range(dims)]
    st = xp.stride()
    view = xp.as_strided((x.shape[0], *out, x.shape[1], *k),
                         (st[0], *(st[2 + i] * a["stride"][i] for i in range(dims)), st[1],
                          *(st[2 + i] * a["dilation"][i] for i in range(dims))))
    return view.reshape(x.shape[0], math.prod(out), x.shape[1] * math.prod(k))


def _input_grad(m: nn.Module, g: torch.Tensor, in_shape: tuple, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Back through a layer: g (batch, *out) -> (batch, *in_shape[1:]), the transpose of x -> W x."""
    w = m.weight if weight is None else weight
    if isinstance(m, nn.Linear):
        return g @ w
    a = _conv_args(m)
    spatial, out, k = in_shape[1:], g.shape[2:], m.kernel_size
    extra = tuple(spatial[i] - ((out[i] - 1) * a["stride"][i] - 2 * a["padding"][i] + a["dilation"][i] * (k[i] - 1) + 1)
                  for i in range(len(spatial)))
    if isinstance(m, nn.Conv1d):
        return F.conv_transpose1d(g, w, None, a["stride"], a["padding"], extra, 1, a["dilation"])
    g = g.contiguous(memory_format=torch.channels_last)  # about 1.5x faster on the CPU
    return F.conv_transpose2d(g, w, None, a["stride"], a["padding"], extra, 1, a["dilation"]).contiguous()


def _multiplicity(m: nn.Module, in_shape: tuple) -> torch.Tensor:
    """Per input element (one channel), how many patches contain it (1 everywhere for Linear)."""
    if isinstance(m, nn.Linear):
        return torch.ones(1)
    ones = torch.ones(1, 1, *in_shape[1:], dtype=torch.float64)
    probe = types.SimpleNamespace(weight=torch.ones(1, 1, *m.kernel_size), **_conv_args(m))
    fn = F.conv1d if isinstance(m, nn.Conv1d) else F.conv2d
    out = fn(ones, probe.weight.double(), None, probe.stride, probe.padding, probe.dilation)
    conv_t = F.conv_transpose1d if isinstance(m, nn.Conv1d) else F.conv_transpose2d
    return conv_t(torch.ones_like(out), probe.weight.double(), None, probe.stride, probe.padding, 0, 1, probe.dilation)


def operator_norm_bound(m: nn.Module, in_shape: tuple) -> float:
    """An upper bound on the operator (l2) norm of x -> W x (no bias) for inputs of ``in_shape`` (per
    sample): the largest singular value for Linear; for a convolution the largest over frequencies of
    the kernel's DFT on the zero-padded grid (the circular convolution that the layer restricts)."""
    w = m.weight.detach().double()
    if isinstance(m, nn.Linear):
        return _largest_singular_value(w) * _ROUND_UP
    a = _conv_args(m)
    grid = [in_shape[1 + i] + 2 * a["padding"][i] for i in range(w.dim() - 2)]
    taps = torch.zeros(*w.shape[:2], *grid, dtype=torch.float64)
    index = tuple(slice(0, a["dilation"][i] * (w.shape[2 + i] - 1) + 1, a["dilation"][i]) for i in range(w.dim() - 2))
    taps[(slice(None), slice(None), *index)] = w
    spectrum = torch.fft.fftn(taps, dim=tuple(range(2, w.dim())))  # (out, in, *grid)
    per_freq = spectrum.flatten(2).permute(2, 0, 1)  # (frequencies, out, in)
    return _largest_singular_value(per_freq) * _ROUND_UP


def _largest_singular_value(a: torch.Tensor) -> float:
    """max sigma_max over a batch of (complex) matrices: the root of the top eigenvalue of the smaller
    Gram matrix (eigvalsh is far faster than an SVD on the CPU)."""
    gram = a.mH @ a if a.shape[-1] <= a.shape[-2] else a @ a.mH
    return math.sqrt(max(float(torch.linalg.eigvalsh(gram).max()), 0.0))


def operator_norm_power(m: nn.Module, in_shape: tuple, iterations: int = 50, seed: int = 0) -> float:
    """The same operator norm estimated by power iteration on the layer and its transpose (from below;
    float32, for comparison only)."""
    gen = torch.Generator().manual_seed(seed)
    w = m.weight.detach().float()
    v = torch.randn(1, *in_shape, generator=gen)
    sigma = 0.0
    for _ in range(iterations):
        v = v / v.norm()
        if isinstance(m, nn.Linear):
            y = v @ w.T
        else:
            y = (F.conv1d if isinstance(m, nn.Conv1d) else F.conv2d)(v, w, None, **_conv_args(m))
        sigma = float(y.norm())
        v = _input_grad(m, y, v.shape[1:], weight=w)
    return sigma


# ----------------------------------------------------------------------------- the network


@dataclass
class LayerInfo:
    """A weight layer of the chain and the constants of its certificates."""

    name: str
    kind: str  # linear | conv1d | conv2d
    weight_shape: tuple
    weight_norm: float  # ||W||_F
    operator_norm: float  # upper bound on the layer's operator norm (used by the sound bound)
    operator_norm_power: float  # power-iteration estimate (a lower bound), for comparison
    multiplicity: float  # R: most patches one input element is in (1 for Linear)
    lipschitz_after: float  # c_l: the activations, pools and reshapes up to the next weight layer

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"weight_shape": list(self.weight_shape)}


def _kind(m: nn.Module) -> str:
    return "linear" if isinstance(m, nn.Linear) else "conv1d" if isinstance(m, nn.Conv1d) else "conv2d"


class Network:
    """A supported model read as a chain (see the module docstring): runs it, back-propagates the pair
    margins to every weight layer, and evaluates it with other weights (shared or one set per sample).
    Puts the model in eval mode (dropout off: the certificates are about inference)."""

    def __init__(self, model: nn.Module, example: torch.Tensor):
        import torch.fx

        model.eval()
        self.model = model
        self.steps = _trace(model)
        self.affine = [i for i, s in enumerate(self.steps) if s.op == "affine"]
        self.names = [self.steps[i].name for i in self.affine]
        example = example[:2]
        shapes = {}

        class _Shapes(torch.fx.Interpreter):
            def run_node(self, n):
                out = super().run_node(n)
                if isinstance(out, torch.Tensor):
                    shapes[n.name] = tuple(out.shape)
                return out

        gm = torch.fx.symbolic_trace(model)
        by_target = {n.target if n.op == "call_module" else n.name: n.name for n in gm.graph.nodes}
        with torch.no_grad():
            try:
                reference = _Shapes(gm).run(example)
            except RuntimeError as e:
                reason = (str(e).strip().splitlines() or [""])[0][:160]
                raise HiltError(f"{type(model).__name__} fails on inputs of shape {tuple(example.shape[1:])}: "
                                f"{reason}") from None
            x = example
            for s in self.steps:
                s.in_shape = tuple(x.shape[1:])
                out = shapes[by_target[s.name]]
                if out[0] != len(example):
                    raise HiltError(f"'{s.name}' changes the batch dimension (output shape {out}); certificates "
                                    "need every operation to keep samples apart")
                s.out_shape = out[1:]
                x = self._apply(s, x)
        if not isinstance(reference, torch.Tensor) or reference.dim() != 2 or reference.shape[1] < 2:
            shape = tuple(reference.shape) if isinstance(reference, torch.Tensor) else type(reference).__name__
            raise HiltError(f"{type(model).__name__}'s output has shape {shape}, not (batch, classes): certificates "
                            "need class scores")
        if not torch.allclose(x, reference, rtol=1e-4, atol=1e-5 * float(reference.abs().max()) + 1e-12):
            raise HiltError(f"{type(model).__name__}: the forward read as a chain differs from the model's own "
                            "output; certificates cannot read this model")
        for s in self.steps:
            if s.op in ("maxpool", "avgpool"):
                s.lipschitz = _pool_lipschitz(s, s.in_shape)
        self.layers = []
        for k, i in enumerate(self.affine):
            s = self.steps[i]
            m = s.module
            end = self.affine[k + 1] if k + 1 < len(self.affine) else i + 1
            c = math.prod(t.lipschitz for t in self.steps[i + 1:end])
            self.layers.append(LayerInfo(
                s.name, _kind(m), tuple(m.weight.shape), float(m.weight.detach().double().norm()),
                operator_norm_bound(m, s.in_shape), operator_norm_power(m, s.in_shape),
                float(_multiplicity(m, s.in_shape).max()), c))

    # -- running it

    def _apply(self, s: _Step, x: torch.Tensor) -> torch.Tensor:
        if s.op == "affine":
            return _affine(s.module, x)
        if s.op in ("maxpool", "avgpool"):
            return _apply_pool(s, x)
        if s.op == "reshape":
            return x.reshape(x.shape[0], *s.out_shape)
        if s.op == "relu":
            return F.relu(x)
        return s.call(x)

    def run(self, x: torch.Tensor, weights: dict | None = None, start: int = 0) -> torch.Tensor:
        """Class scores for ``x``, the input of weight layer number ``start`` (0: the model's input).
        ``weights``: layer name -> weight to use instead (the layer's shape, or one per sample with a
        leading batch dimension)."""
        weights = weights or {}
        for s in self.steps[(0 if start == 0 else self.affine[start]):]:
            x = _affine(s.module, x, weights.get(s.name)) if s.op == "affine" else self._apply(s, x)
        return x

    def layer_input(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """The input that weight layer number ``layer`` sees for model input ``x``."""
        for s in self.steps[: self.affine[layer]]:
            x = self._apply(s, x)
        return x

    def batch_size(self) -> int:
        """Samples per batch of the analysis: the pair gradients of the largest activation in ~256 MB."""
        largest = max(math.prod(s.out_shape) for s in self.steps)
        classes = self.steps[-1].out_shape[-1]
        return max(1, min(2048, (1 << 26) // (max(1, classes - 1) * largest)))

    # -- the analysis of one batch

    @torch.no_grad()
    def analyze_batch(self, x: torch.Tensor) -> dict:
        """Per sample: scores, prediction, margin; per weight layer: the smallest-flip norm over the
        other classes (exact at the last layer, first order before), which class, and nu_l."""
        n = x.shape[0]
        inputs, saved = {}, {}
        h = x
        for i, s in enumerate(self.steps):
            if s.op == "affine":
                inputs[i] = h
                h = _affine(s.module, h)
            elif s.op == "relu":
                saved[i] = h > 0
                h = F.relu(h)
            elif s.op == "gelu":
                with torch.enable_grad():
                    t = h.detach().requires_grad_()
                    y = s.call(t)
                    saved[i] = torch.autograd.grad(y.sum(), t)[0]
                h = y.detach()
            elif s.op == "maxpool":
                h, idx = _apply_pool(s, h, indices=True)
                # after a ReLU, its mask at the pooled positions is (pooled > 0): applied in the pooled
                # domain, a quarter of the size (for 2x2 windows), and the ReLU's own step skipped
                fused = i > 0 and self.steps[i - 1].op == "relu"
                saved[i] = (idx, h > 0 if fused else None)
                if fused:
                    saved[i - 1] = None
            else:
                h = self._apply(s, h)
        z = h
        classes = z.shape[1]
        pred = z.argmax(1)
        pairs = classes - 1
        others = torch.arange(pairs).expand(n, pairs)
        others = others + (others >= pred[:, None]).long()  # the classes other than the prediction, in order
        m_pairs = z.gather(1, pred[:, None]) - z.gather(1, others)  # (n, pairs), >= 0
        g = torch.zeros(n, pairs, classes)  # d(z_i - z_j)/dz, one row per pair (samples first: no transposes)
        g.scatter_(2, pred.view(n, 1, 1).expand(n, pairs, 1), 1.0)
        g.scatter_(2, others.unsqueeze(-1), -1.0)
        flip, flip_class, nu = [], [], []
        first = self.affine[0]
        for i in range(len(self.steps) - 1, first - 1, -1):
            s = self.steps[i]
            if s.op == "affine":
                best, which, nu_l = self._layer_flips(s.module, inputs[i], g, m_pairs)
                flip.append(best)
                flip_class.append(others.gather(1, which[:, None]).squeeze(1))
                nu.append(nu_l)
                if i == first:
                    break
                g = _input_grad(s.module, g.reshape(n * pairs, *s.out_shape), s.in_shape).reshape(n, pairs, *s.in_shape)
            elif s.op in ("relu", "gelu"):
                if saved[i] is not None:  # None: folded into the max pool that follows
                    g = g * saved[i].unsqueeze(1)
            elif s.op == "maxpool":
                idx, positive = saved[i]
                if positive is not None:
                    g = g * positive.unsqueeze(1)
                idx = idx.flatten(2).unsqueeze(1).expand(n, pairs, *idx.shape[1:2], -1)
                flat = g.new_zeros(n, pairs, s.in_shape[0], math.prod(s.in_shape[1:]))
                g = flat.scatter_add_(3, idx, g.flatten(3)).reshape(n, pairs, *s.in_shape)
            elif s.op == "avgpool":  # linear: its transpose by autograd on a zero input
                with torch.enable_grad():
                    t = torch.zeros(n * pairs, *s.in_shape, requires_grad=True)
                    g = torch.autograd.grad(_apply_pool(s, t), t, g.reshape(n * pairs, *s.out_shape))[0]
                g = g.reshape(n, pairs, *s.in_shape)
            elif s.op == "reshape":
                g = g.reshape(n, pairs, *s.in_shape)
            # identity; log_softmax: z_i - z_j is the same before and after it
        return {"scores": z, "pred": pred, "margin": m_pairs.min(1).values, "flip": torch.stack(flip[::-1], 1),
                "flip_class": torch.stack(flip_class[::-1], 1), "nu": torch.stack(nu[::-1], 1)}

    @staticmethod
    def _layer_flips(m: nn.Module, a: torch.Tensor, g: torch.Tensor, m_pairs: torch.Tensor, chunk: int = 64):
        """For layer input a and the pair gradients g (n, pairs, *out) at the layer's output: per sample the
        smallest m_ij / ||d m_ij / dW||_F over the pairs, which pair gives it, and nu = ||U(a)||_F."""
        n, pairs = g.shape[:2]
        if isinstance(m, nn.Linear) and a.dim() == 2:  # grad = g a^T: its norm is a product
            nu = a.norm(dim=1)
            norms = g.norm(dim=2) * nu[:, None]
            ratio = torch.where(norms > 0, m_pairs / norms, torch.full_like(m_pairs, math.inf))
            best, which = ratio.min(1)
            return best, which, nu
        u = _patches(m, a)  # (n, positions, k); the gradient in W of pair j is D_j U
        out = m.weight.shape[0]
        d = g.reshape(n, pairs, out, -1) if not isinstance(m, nn.Linear) else g.reshape(n, pairs, -1, out).transpose(2, 3)
        d = d.reshape(n, pairs * out, -1)  # (n, pairs * out, positions): every pair in one product per sample
        norms = torch.cat([torch.bmm(d[c : c + chunk], u[c : c + chunk]).view(-1, pairs, out * u.shape[2]).norm(dim=2)
                           for c in range(0, n, chunk)])
        ratio = torch.where(norms > 0, m_pairs / norms, torch.full_like(m_pairs, math.inf))
        best, which = ratio.min(1)
        return best, which, u.flatten(1).norm(dim=1)

    def margin_gradient(self, x: torch.Tensor, layer: int, classes: torch.Tensor | None = None) -> tuple:
        """Per sample, d(z_i - z_j)/dW of weight layer ``layer`` (n, *W.shape) with i the prediction and j
        ``classes`` (default: the runner-up), and the pair margins (n,), by autograd (for small batches)."""
        from torch.func import grad, vmap

        weight = self.steps[self.affine[layer]].module.weight.detach()
        a = self.layer_input(x, layer).detach()
        with torch.no_grad():
            z = self.run(a, start=layer)
        pred = z.argmax(1)
        if classes is None:
            classes = z.scatter(1, pred[:, None], -math.inf).argmax(1)

        pair = F.one_hot(pred, z.shape[1]).to(z.dtype) - F.one_hot(classes, z.shape[1]).to(z.dtype)

        def margin(w, a1, e):
            return (self.run(a1[None], {self.names[layer]: w}, start=layer)[0] * e).sum()

        grads = vmap(grad(margin), in_dims=(None, 0, 0))(weight, a, pair)
        return grads, (z.gather(1, pred[:, None]) - z.gather(1, classes[:, None])).squeeze(1)


# ----------------------------------------------------------------------------- analysis and certificates


@dataclass(frozen=True)
class Perturbation:
    """Per-layer bounds eps_l >= ||Delta W_l||_F, by layer name (a layer not named stays exact).
    ``probability``: the bounds hold with at least this probability (1: always)."""

    eps: dict
    source: str = "given"
    probability: float = 1.0
    detail: dict = field(default_factory=dict)

    def __post_init__(self):
        bad = {k: v for k, v in self.eps.items() if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0)}
        if bad:
            raise HiltError(f"perturbation bounds must be finite and >= 0, got {bad}")


@dataclass
class Analysis:
    """What the certificates of a model on some inputs need, computed once (see ``analyze``)."""

    layers: list
    predictions: torch.Tensor  # (n,)
    labels: torch.Tensor | None
    margins: torch.Tensor  # (n,)  z_i - max_j z_j
    flip: torch.Tensor  # (n, layers): smallest flipping ||Delta W_l||_F, exact (last) / first order
    flip_class: torch.Tensor  # (n, layers): the class it flips to
    nu: torch.Tensor  # (n, layers): ||U(x_{l-1})||_F
    seconds: float = 0.0

    @property
    def names(self) -> list:
        return [layer.name for layer in self.layers]

    @property
    def exact(self) -> list:
        """Which layers' flip norms are exact (the last), not first order."""
        return [i == len(self.layers) - 1 for i in range(len(self.layers))]

    def eps_vector(self, perturbation: Perturbation | dict | None) -> torch.Tensor:
        eps = {} if perturbation is None else perturbation.eps if isinstance(perturbation, Perturbation) else perturbation
        unknown = sorted(set(eps) - set(self.names))
        if unknown:
            raise HiltError(f"the perturbation names {', '.join(unknown)}, not weight layers of the model "
                            f"({', '.join(self.names)})")
        return torch.tensor([float(eps.get(name, 0.0)) for name in self.names], dtype=torch.float64)

    def output_bound(self, eps: torch.Tensor) -> torch.Tensor:
        """Per input, the sound bound sqrt(2) e_L on |Dz_j - Dz_i| when ||Delta W_l||_F <= eps_l for every
        layer at once (the recursion of the module docstring). ``eps``: (layers,) or (n, layers)."""
        eps = eps.double().expand(self.nu.shape[0], -1) if eps.dim() == 1 else eps.double()
        nu = self.nu.double()
        d = torch.zeros(nu.shape[0], dtype=torch.float64)
        e = d
        for l, layer in enumerate(self.layers):
            e = layer.operator_norm * d + eps[:, l] * (nu[:, l] + math.sqrt(layer.multiplicity) * d)
            d = layer.lipschitz_after * e
        return math.sqrt(2) * e

    def lipschitz_radii(self) -> torch.Tensor:
        """(n, layers): the sound radius when layer l alone is perturbed, m / (sqrt(2) nu_l c_l prod_{k>l}
        Lambda_k c_k); the last column equals the exact last-layer radius for a Linear last layer."""
        gain = torch.ones(len(self.layers), dtype=torch.float64)
        tail = 1.0
        for l in range(len(self.layers) - 1, -1, -1):
            gain[l] = self.layers[l].lipschitz_after * tail
            tail *= self.layers[l].operator_norm * self.layers[l].lipschitz_after
        return self.margins.double()[:, None] / (math.sqrt(2) * self.nu.double() * gain)

    def lipschitz_scale(self, eps: torch.Tensor, iterations: int = 60) -> torch.Tensor:
        """Per input, the largest t such that t * eps is certified by the all-layers bound (bisection on
        the increasing polynomial t -> sqrt(2) e_L(t eps)); inf where eps is all zero."""
        n = self.margins.shape[0]
        m = self.margins.double()
        if not bool((eps > 0).any()):
            return torch.full((n,), math.inf, dtype=torch.float64)
        lo, hi = torch.zeros(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64)
        for _ in range(200):  # bracket: grow hi until it is not certified
            over = self.output_bound(hi[:, None] * eps) >= m
            if bool(over.all()):
                break
            hi = torch.where(over, hi, hi * 4)
        for _ in range(iterations):
            mid = (lo + hi) / 2
            ok = self.output_bound(mid[:, None] * eps) < m
            lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid)
        return lo

    def certify(self, perturbation: Perturbation | dict | None) -> "Certificates":
        eps = self.eps_vector(perturbation)
        per_layer = eps[None, :] < self.flip.double()
        last = len(self.layers) - 1
        lip = self.output_bound(eps) < self.margins.double()
        certified = {"exact": per_layer[:, last], "first_order": per_layer.all(1), "lipschitz": lip}
        if not isinstance(perturbation, Perturbation):
            perturbation = Perturbation(dict(zip(self.names, eps.tolist())))
        return Certificates(self, perturbation, eps, per_layer, certified, self.lipschitz_scale(eps))


@dataclass
class Certificates:
    """Which inputs a perturbation provably (or to first order) cannot flip.

    ``certified["exact"]``: the last layer alone perturbed by up to its eps: exact, no flip possible.
    ``certified["first_order"]``: each layer alone perturbed by up to its eps: below its flip norm
    (exact at the last layer, first order before it): an estimate, not a guarantee.
    ``certified["lipschitz"]``: every layer at once, each by up to its eps: sound.
    ``per_layer`` (n, layers): eps_l below the layer's flip norm."""

    analysis: Analysis
    perturbation: Perturbation
    eps: torch.Tensor
    per_layer: torch.Tensor
    certified: dict
    lipschitz_scale: torch.Tensor

    def fractions(self) -> dict:
        return {k: float(v.double().mean()) for k, v in self.certified.items()}

    def summary(self) -> dict:
        """The results as JSON-ready numbers (fractions, per-layer flip-norm quantiles, the bounds)."""
        a = self.analysis
        q = torch.tensor([0.01, 0.5], dtype=torch.float64)
        layers = []
        radii = a.lipschitz_radii()
        for l, info in enumerate(a.layers):
            f = a.flip[:, l].double()
            layers.append({**info.to_dict(), "exact": a.exact[l], "eps": float(self.eps[l]),
                           "eps_over_weight_norm": float(self.eps[l]) / info.weight_norm if info.weight_norm else 0.0,
                           "flip_norm_p01": _number(f.quantile(q[0])), "flip_norm_median": _number(f.quantile(q[1])),
                           "lipschitz_radius_median": _number(radii[:, l].quantile(q[1])),
                           "certified": float(self.per_layer[:, l].double().mean())})
        out = {"inputs": int(a.margins.shape[0]), "source": self.perturbation.source,
               "probability": self.perturbation.probability, "certified": self.fractions(), "layers": layers,
               "lipschitz_scale_median": _number(self.lipschitz_scale.quantile(q[1])), "seconds": a.seconds}
        if a.labels is not None:
            correct = a.predictions == a.labels
            out["accuracy"] = float(correct.double().mean())
            out["certified_and_correct"] = {k: float((v & correct).double().mean()) for k, v in self.certified.items()}
        if self.perturbation.detail:
            out["detail"] = self.perturbation.detail
        return out


def _number(value) -> float | None:
    """A float for JSON: None where it is infinite (no flip at all) or undefined."""
    value = float(value)
    return value if math.isfinite(value) else None


def _split(data) -> tuple:
    if isinstance(data, (tuple, list)):
        if len(data) != 2:
            raise HiltError("data must be inputs, or (inputs, labels)")
        x, y = data
        return x, (None if y is None else torch.as_tensor(y))
    return data, None


def analyze(model: nn.Module, data, batch_size: int | None = None, network: Network | None = None,
            progress=None) -> Analysis:
    """Flip norms, margins and activation norms of ``model`` on ``data`` (inputs, or (inputs, labels))."""
    import time

    x, labels = _split(data)
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or len(x) == 0:
        raise HiltError("data must be a non-empty tensor of inputs (batch first)")
    if labels is not None and len(labels) != len(x):
        raise HiltError(f"{len(x)} inputs but {len(labels)} labels")
    start = time.perf_counter()
    x = x.float()
    net = network or Network(model, x)
    bs = batch_size or net.batch_size()
    parts = []
    for i in range(0, len(x), bs):
        parts.append(net.analyze_batch(x[i : i + bs]))
        if progress is not None:
            progress(min(len(x), i + bs), len(x))
    cat = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    return Analysis(net.layers, cat["pred"], labels, cat["margin"], cat["flip"], cat["flip_class"], cat["nu"],
                    time.perf_counter() - start)


def certify(model: nn.Module, data, perturbation: Perturbation | dict | None = None,
            batch_size: int | None = None) -> Certificates:
    """Certificates of ``model`` on ``data`` (inputs, or (inputs, labels)) against ``perturbation``
    (per-layer bounds on ||Delta W||_F: `quantization_perturbation`, `cim_perturbation`, or a dict
    name -> bound). See :class:`Certificates` for what each kind guarantees."""
    return analyze(model, data, batch_size).certify(perturbation)


# ----------------------------------------------------------------------------- quantization


def _weight_layers(model: nn.Module) -> list:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d))]


def block_for(in_features: int, block_size: int) -> int:
    """The block size used for a layer: ``block_size`` if it divides the layer's inputs (C k_h k_w for a
    convolution), else the largest size below it that does (hilt refuses to pad)."""
    return max(b for b in range(1, min(block_size, in_features) + 1) if in_features % b == 0)


@dataclass
class QuantizedLayer:
    """One layer's weight (out, inputs), its quantized value, and the rounding cell of every weight:
    ``lower`` <= w <= ``upper`` holds for every weight that this format stores with the same codes,
    scales and block ranges (the cells of the nearest-level assignment, the outer ones closed by the
    block's own smallest and largest value)."""

    weight: torch.Tensor
    quantized: torch.Tensor
    lower: torch.Tensor
    upper: torch.Tensor
    block_size: int
    bits_per_weight: float

    @property
    def error(self) -> float:
        """||W - Q(W)||_F."""
        return float((self.quantized.double() - self.weight.double()).norm())

    @property
    def half_width(self) -> torch.Tensor:
        """Per weight, the largest |Q(w) - w'| over its cell."""
        return torch.maximum((self.quantized - self.lower).abs(), (self.upper - self.quantized).abs())

    @property
    def cell_bound(self) -> float:
        """The worst ||W' - Q(W)||_F over every W' inside the cells (>= the actual error)."""
        return float(self.half_width.double().norm())


def _cells(w: torch.Tensor, q) -> tuple:
    """(lower, upper) of each weight's rounding cell, in weight units."""
    n, k = w.shape
    b = q.block_size
    scales = q.scales.float().unsqueeze(-1)
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    blocks = w.float().view(n, k // b, b)
    offsets = q.offsets.float().unsqueeze(-1) if q.offsets is not None else torch.zeros_like(scales)
    u = (blocks - offsets) / safe  # what the codebook quantized (as hilt.quant.quantize computes it)
    book = q.codebook.float()
    if book.dim() == 1:
        book = book.expand(n, k // b, -1)
    mids = (book[..., 1:] + book[..., :-1]) / 2
    idx = torch.searchsorted(mids.contiguous(), u.contiguous())  # the nearest level, as the quantizer chose it
    inf = torch.full_like(mids[..., :1], math.inf)
    lo_mid = torch.cat([-inf, mids], -1).gather(-1, idx)
    hi_mid = torch.cat([mids, inf], -1).gather(-1, idx)
    lo = torch.maximum(lo_mid, u.amin(-1, keepdim=True))  # outer cells closed by the block's own range
    hi = torch.minimum(hi_mid, u.amax(-1, keepdim=True))
    lower = (lo * scales + offsets).view(n, k)
    upper = (hi * scales + offsets).view(n, k)
    return torch.minimum(lower, w), torch.maximum(upper, w)  # rounding: keep w itself inside


def quantize_layers(model: nn.Module, config, layers=None) -> dict:
    """Every Linear/Conv weight of ``model`` (or those named in ``layers``) quantized with ``config``
    (a hilt.quant.QuantConfig; the block size per layer from :func:`block_for`): name -> QuantizedLayer."""
    from hilt.quant import quantize_tensor

    out = {}
    for name, m in _weight_layers(model):
        if layers is not None and name not in layers:
            continue
        w = m.weight.detach().float().reshape(m.weight.shape[0], -1)
        b = block_for(w.shape[1], config.block_size)
        q = quantize_tensor(w, dataclasses.replace(config, block_size=b), name=f"{name}.weight")
        lower, upper = _cells(w, q)
        out[name] = QuantizedLayer(w, q.dequantize().float(), lower, upper, b, q.bits_per_weight)
    return out


def quantization_perturbation(model: nn.Module, config, worst_case: bool = False, layers=None,
                              quantized: dict | None = None) -> Perturbation:
    """Per-layer bounds from a hilt format: the actual error ||W - Q(W)||_F, or (``worst_case``) the
    largest error of any weights the format would store with the same codes and scales (the rounding
    cells: a bound that does not depend on where inside its cell each weight lies)."""
    quantized = quantized if quantized is not None else quantize_layers(model, config, layers)
    eps = {name: (q.cell_bound if worst_case else q.error) for name, q in quantized.items()}
    label = f"{config.method} {config.bits}-bit"
    detail = {"format": label, "worst_case": worst_case,
              "block_size": {name: q.block_size for name, q in quantized.items()},
              "bits_per_weight": {name: q.bits_per_weight for name, q in quantized.items()},
              "relative_error": {name: q.error / max(float(q.weight.double().norm()), 1e-30)
                                 for name, q in quantized.items()}}
    return Perturbation(eps, "quantization cells" if worst_case else "quantization error", 1.0, detail)


# ----------------------------------------------------------------------------- a CIM chip at time t

def _legendre(n: int = 32) -> tuple:
    import numpy as np

    x, w = np.polynomial.legendre.leggauss(n)
    return torch.from_numpy(x), torch.from_numpy(w)


def _normal_pdf(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _rectified_moments(s: torch.Tensor) -> torch.Tensor:
    """E[max(0, 1 + s N(0,1))^k] for k = 0..4 (stacked first), from the partial moments
    M_j = E[Z^j; Z > a] of a standard normal, a = -1/s: M_0 = Phi(-a), M_1 = phi(a),
    M_j = a^(j-1) phi(a) + (j-1) M_(j-2); then the binomial sums sum_j C(k, j) s^j M_j."""
    a = (-1 / s.clamp_min(1e-300)).clamp_min(-40.0)
    pdf = _normal_pdf(a)
    m0, m1 = torch.special.ndtr(-a), pdf
    m2 = a * pdf + m0
    m3 = a * a * pdf + 2 * m1
    m4 = a * a * a * pdf + 3 * m2
    t1, t2 = s * m1, s * s * m2
    t3, t4 = s * s * s * m3, s * s * s * s * m4
    return torch.stack([m0, m0 + t1, m0 + 2 * t1 + t2, m0 + 3 * t1 + 3 * t2 + t3, m0 + 4 * t1 + 6 * t2 + 4 * t3 + t4])


def _folded_laplace(mu: torch.Tensor, sd: torch.Tensor, lam: float) -> torch.Tensor:
    """E[exp(-lam |X|)], X ~ N(mu, sd^2): exp(-lam mu + lam^2 sd^2 / 2) Phi(mu/sd - lam sd) +
    exp(lam mu + lam^2 sd^2 / 2) Phi(-mu/sd - lam sd), in log space."""
    half = 0.5 * lam * lam * sd * sd
    return (torch.exp(-lam * mu + half + torch.special.log_ndtr(mu / sd - lam * sd))
            + torch.exp(lam * mu + half + torch.special.log_ndtr(-mu / sd - lam * sd)))


def _q_kink(dev) -> float:
    """The conductance below which the read-noise coefficient Q(g) sits at its cap (a kink in the
    integrand: the quadrature splits there)."""
    top = float(dev.read_noise_coefficient(torch.zeros(1, dtype=torch.float64)))
    lo, hi = 0.0, dev.g_max
    for _ in range(80):
        mid = (lo + hi) / 2
        if float(dev.read_noise_coefficient(torch.tensor([mid], dtype=torch.float64))) >= top * (1 - 1e-12):
            lo = mid
        else:
            hi = mid
    return hi


def _noise_integrals(dev, g_target: torch.Tensor, t: float, nodes: int = 32, chunk: int = 65536) -> torch.Tensor:
    """I_k = E[g_p^k max(0, 1 + sigma_r Q(g_p) eta)^k], k = 0..4 (stacked first): the programming and read
    noise part of E[g^k] (smooth in g_T), by Gauss-Legendre quadrature over xi in two pieces split where
    Q stops being capped; g_p = 0 (xi below -g_T / sigma_p) adds nothing for k >= 1."""
    x, w = _legendre(nodes)
    flat = g_target.reshape(-1)
    out = torch.empty(5, flat.numel(), dtype=torch.float64)
    sr = dev.read_sigma(t)
    kink = _q_kink(dev)
    for c in range(0, flat.numel(), chunk):
        gt = flat[c : c + chunk]
        sp = dev.programming_sigma(gt).clamp_min(1e-12)
        lo = (-gt / sp).clamp_min(-9.0)
        hi = torch.clamp(lo + 1.0, min=9.0)
        split = ((kink - gt) / sp).clamp(min=lo, max=hi)
        total = torch.zeros(5, gt.numel(), dtype=torch.float64)
        for a, b in ((lo, split), (split, hi)):
            half = (b - a)[:, None] / 2
            xi = (a + b)[:, None] / 2 + half * x  # (devices, nodes)
            weight = half * w * _normal_pdf(xi)
            gp = (gt[:, None] + sp[:, None] * xi).clamp_min(0)
            rect = _rectified_moments(sr * dev.read_noise_coefficient(gp))  # (5, devices, nodes)
            total += (torch.stack([gp**k for k in range(5)]) * rect * weight).sum(-1)
        total[0] = 1.0  # k = 0: the whole probability mass
        out[:, c : c + chunk] = total
    return out.view(5, *g_target.shape)


def _drift_moments(dev, g_target: torch.Tensor, t: float) -> torch.Tensor:
    """E[(T/t0)^(-k nu)], k = 0..4, in closed form (nu independent of the programming and read noise)."""
    mu, sd, factor = dev.drift_law(g_target)
    log_t = math.log((t + dev.t0) / dev.t0)
    return torch.stack([_folded_laplace(mu, sd, k * log_t * factor) for k in range(5)])


def _combine(dev, integrals: torch.Tensor, drift: torch.Tensor, t: float, stuck_rate: float) -> torch.Tensor:
    moments = integrals * drift
    if stuck_rate:  # half the stuck devices read 0; half sit at g_max, then drift and read noise as usual
        q_max = dev.read_noise_coefficient(torch.tensor([dev.g_max], dtype=torch.float64))
        rect = _rectified_moments(dev.read_sigma(t) * q_max)[:, 0]
        at_max = torch.stack([dev.g_max**k * rect[k] for k in range(5)]).view(5, *[1] * (drift.dim() - 1)) * drift
        at_zero = torch.zeros_like(moments)
        at_zero[0] = 1.0
        moments = (1 - stuck_rate) * moments + (stuck_rate / 2) * (at_max + at_zero)
    return moments


def device_moments(dev, g_target: torch.Tensor, t: float, stuck_rate: float = 0.0, nodes: int = 32) -> torch.Tensor:
    """E[g^k], k = 0..4 (stacked first), of a device with target conductance ``g_target`` (uS, float64)
    read t seconds after programming, under the device model (see the module docstring, item 4)."""
    return _combine(dev, _noise_integrals(dev, g_target, t, nodes), _drift_moments(dev, g_target, t), t, stuck_rate)


_GRID = 4097  # target conductances at which the device moments are tabulated (every 1/4096 of g_max)


@functools.lru_cache(maxsize=64)
def _noise_table(dev, t: float, nodes: int) -> torch.Tensor:
    """The noise integrals on _GRID target conductances from 0 to g_max, once per device and time."""
    return _noise_integrals(dev, torch.linspace(0, dev.g_max, _GRID, dtype=torch.float64), t, nodes)


def _interpolate(table: torch.Tensor, g: torch.Tensor, g_max: float) -> torch.Tensor:
    """The tabulated noise integrals (5, _GRID) at conductances ``g``, linearly interpolated (they are
    smooth in g_T; the drift law, which has kinks where its clips engage, is evaluated exactly per device)."""
    pos = g * ((_GRID - 1) / g_max)
    i = pos.floor().clamp(0, _GRID - 2).long()
    frac = pos - i
    return table[:, i] * (1 - frac) + table[:, i + 1] * frac


def _pair_moments(pos: torch.Tensor, neg: torch.Tensor, unit: float) -> torch.Tensor:
    """E[W^k], k = 0..4, of W = (G+ - G-) * unit from independent devices' moments."""
    return torch.stack([sum(math.comb(k, j) * pos[j] * (-1) ** (k - j) * neg[k - j] for j in range(k + 1)) * unit**k
                        for k in range(5)])


def _abs_mean(mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """E|Y| for Y ~ N(mean, var) (the folded normal's mean)."""
    sd = var.clamp_min(1e-300).sqrt()
    return (sd * math.sqrt(2 / math.pi) * torch.exp(-0.5 * (mean / sd) ** 2)
            + mean * (1 - 2 * torch.special.ndtr(-mean / sd)))


def _probe_abs(config, probe: torch.Tensor, mean_w: torch.Tensor, var_w: torch.Tensor, unit: float) -> torch.Tensor:
    """Mean-field E|y| (rows, out) of the drift-compensation probe through arrays holding weights of
    mean ``mean_w`` and variance ``var_w``: Gaussian y, plus the variance of output noise, ADC and DAC
    rounding per array (noise management scales each array's slice of the input by its abs-max).
    ``unit``: the weight the arrays hold as 1 (AnalogMixin.w_unit)."""
    from hilt.cim_sim.analog import AnalogMixin, array_bounds

    in_step, out_step = AnalogMixin._steps(types.SimpleNamespace(config=config))
    mean = probe @ mean_w.T
    var = (probe * probe) @ var_w.T
    for k0, k1 in array_bounds(probe.shape[1], config.tile_size):
        xs = probe[:, k0:k1].abs().amax(1, keepdim=True)  # (rows, 1)
        extra = (config.out_noise * unit * xs) ** 2
        if config.adc_bits is not None:
            extra = extra + (unit * out_step * xs) ** 2 / 12
        if config.dac_bits is not None:
            second = (mean_w[:, k0:k1] ** 2 + var_w[:, k0:k1]).sum(1)
            extra = extra + (xs * in_step) ** 2 / 12 * second[None, :]
        var = var + extra
    return _abs_mean(mean, var)


def _cantelli(mean: float, var: float, delta: float) -> float:
    """k-free form: the value S stays below with probability >= 1 - delta given only its mean and
    variance (Cantelli: P(S >= E S + k) <= Var / (Var + k^2))."""
    return mean + math.sqrt(max(var, 0.0) * (1 - delta) / delta)


def cim_perturbation(model: nn.Module, config="pcm", t_seconds: float = 0.0, delta: float = 0.01,
                     gdc: str = "global", seed: int = 0, nodes: int = 32) -> Perturbation:
    """Per-layer bounds on ||Delta W||_F of ``model`` on a chip (an AnalogConfig or a preset name) read
    ``t_seconds`` after programming, holding for all layers at once with probability >= 1 - delta over
    the chip (module docstring, item 4). Layers the simulator keeps digital get no bound (exact).
    ``seed``: the programming seed whose drift-compensation probe is used (cim_sim.model)."""
    return cim_perturbations(model, config, [t_seconds], delta, gdc, seed, nodes)[0]


def cim_perturbations(model: nn.Module, config="pcm", times=(0.0,), delta: float = 0.01, gdc: str = "global",
                      seed: int = 0, nodes: int = 32) -> list:
    """:func:`cim_perturbation` at each of ``times`` (seconds), sharing the work that does not depend on time."""
    from hilt.cim_sim.analog import AnalogConfig, preset
    from hilt.cim_sim.model import GDC_MODES, _probe

    name = config if isinstance(config, str) else None
    config = preset(config) if isinstance(config, str) else config
    if not isinstance(config, AnalogConfig):
        raise HiltError(f"a chip is an AnalogConfig or a preset name, got {type(config).__name__}")
    modes = [m for m in GDC_MODES if m != "aihwkit"]  # per-array identity read-outs are not modelled
    if gdc not in modes:
        raise HiltError(f"certificates take drift compensation {', '.join(modes)}; got {gdc!r}")
    if not 0 < delta < 1:
        raise HiltError(f"delta must be in (0, 1), got {delta}")
    times = [float(t) for t in times]
    if not all(t >= 0 for t in times):
        raise HiltError(f"time after programming must be >= 0 s, got {min(times)}")
    dev = config.device_model()
    layers = [(n, m) for n, m in _weight_layers(model) if isinstance(m, (nn.Linear, nn.Conv2d))]
    share = delta / max(1, len(layers)) / (2 if config.w_noise else 1)  # union bound over layers (and terms)
    out = [({}, {"chip": name or config.device, "seconds": t, "delta": delta, "gdc": gdc, "layers": {}}) for t in times]
    for lname, m in layers:
        w = m.weight.detach().reshape(m.weight.shape[0], -1).double()
        if dev is None:  # the ideal device holds the digital weights
            for eps, _ in out:
                eps[lname] = 0.0
            continue
        w_max = float(w.float().abs().max()) or 1.0
        scale = dev.g_max / w_max
        unit = w_max if config.weight_scaling else 1.0
        targets = torch.cat([(w * scale).clamp(0, dev.g_max).reshape(-1), (-w * scale).clamp(0, dev.g_max).reshape(-1)])
        values, inverse = torch.unique(targets, return_inverse=True)  # half the devices at least target 0

        def moments_at(t):
            integrals = _interpolate(_noise_table(dev, t, nodes), values, dev.g_max)
            mom = _combine(dev, integrals, _drift_moments(dev, values, t), t, config.stuck_at_rate)[:, inverse]
            pos, neg = mom[:, : w.numel()].view(5, *w.shape), mom[:, w.numel():].view(5, *w.shape)
            return _pair_moments(pos, neg, 1 / scale)

        probe = ref = None
        if gdc != "none":
            probe = _probe(types.SimpleNamespace(w_digital=w.float()), torch.Generator().manual_seed(seed)).double()
            if gdc == "exact":
                ref = (probe @ w.T).abs().mean(0)
            else:
                e0 = moments_at(0.0)
                ref = _probe_abs(config, probe, e0[1], (e0[2] - e0[1] ** 2).clamp_min(0), unit).mean(0)
        for t, (eps, detail) in zip(times, out):
            ew = moments_at(t)
            alpha = torch.ones(w.shape[0], 1, dtype=torch.float64)
            if gdc != "none":
                now = _probe_abs(config, probe, ew[1], (ew[2] - ew[1] ** 2).clamp_min(0), unit).mean(0)
                alpha = (ref / now.clamp_min(1e-300))[:, None] if gdc == "column" else \
                    torch.full_like(alpha, float(ref.sum() / now.sum().clamp_min(1e-300)))
            # Delta = alpha W - w: its second and fourth moments from E[W^k]
            d2 = alpha**2 * ew[2] - 2 * alpha * w * ew[1] + w * w
            d4 = sum(math.comb(4, j) * alpha**j * ew[j] * (-w) ** (4 - j) for j in range(5))
            mean_s, var_s = float(d2.sum()), float((d4 - d2 * d2).clamp_min(0).sum())
            bound = math.sqrt(_cantelli(mean_s, var_s, share))
            noise = 0.0
            if config.w_noise:  # per-read weight noise N(0, w_noise^2 unit |W|), times alpha
                c = config.w_noise**2 * unit
                noise = math.sqrt(_cantelli(float((alpha**2 * c * ew[2].sqrt()).sum()),  # E|W| <= sqrt(E W^2)
                                            float((3 * alpha**4 * c * c * ew[2]).sum()), share))  # Var <= E N^4
            eps[lname] = bound + noise
            detail["layers"][lname] = {"expected_sq_error": mean_s, "sd_sq_error": math.sqrt(var_s), "bound": bound,
                                       "read_noise_bound": noise, "alpha": float(alpha.mean()),
                                       "relative_bound": eps[lname] / max(float(w.norm()), 1e-30)}
    return [Perturbation(eps, "chip", 1 - delta, detail) for eps, detail in out]
