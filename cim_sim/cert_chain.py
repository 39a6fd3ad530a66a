"""A model read as a chain of weight layers, for the certificates: tracing (torch.fx), running it with
other weights, back-propagating the pair margins to every weight layer, and the constants the sound
bound needs (operator norms, patch multiplicities, Lipschitz constants). The derivation:
docs/certify.md."""

from __future__ import annotations

import dataclasses
import math
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hilt.errors import HiltError

GELU_LIPSCHITZ = 1.13  # >= max |GELU'(x)| = 1.12899 (exact erf form and tanh form alike)
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
    """A supported model read as a chain (docs/certify.md): runs it, back-propagates the pair
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
