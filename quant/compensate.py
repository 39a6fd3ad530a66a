"""Error-compensated quantization (GPTQ's column sweep) for every hilt format, and the layer-by-layer
pass through a model that feeds it (docs/references.md §8).

One layer. With X the layer's calibration inputs (rows) and H = XᵀX, the output error of a weight
error ΔW is tr(ΔW H ΔWᵀ). Quantizing the input columns one at a time, each column's rounding error
e_j is pushed onto the columns not yet quantized through the upper Cholesky factor U of H⁻¹:

    W[:, j+1:] -= (e_j / U[j, j]) ⊗ U[j, j+1:]

which is the least-squares correction of the remaining columns (GPTQ). Columns are processed in
blocks of ``block_columns`` with the update to later blocks applied once per block (the lazy-batch
form: same result, one matrix product instead of many). The format is hilt's: per-block scales (and
offsets) along the input dimension and one codebook per layer. For k-means the codebook is fitted
first, over the block-normalised weights weighted by diag(H) (the input importance of each column,
as ``--importance`` uses), then every column is rounded to its nearest level. Block scales are either
fixed from the original weights before the sweep (``scales="before"``) or taken from the already
compensated weights when the sweep reaches a block's first column (``scales="during"``).

A model. :class:`Compensator` walks a model's repeated blocks (the largest ``nn.ModuleList``, e.g.
decoder layers) in order. Each block's inputs come from the blocks before it, already quantized.
Inside a block, linears that read the same input form a group (q/k/v, gate/up); groups are quantized
in the order the forward reaches them, each from inputs computed with the earlier groups already
quantized (GPTQ's "true sequential"), and each forward stops as soon as the group's inputs are
captured. Only one block's weights need to be in memory: ``load_block`` fills a block just before
it is processed and ``release_block`` frees it after; ``release_outside`` frees the rest of the model
once the first block's inputs are captured.
"""

from __future__ import annotations

import ctypes
import functools
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

import torch
from torch import nn

from hilt.errors import HiltError
from hilt.kernels import pack_codes
from hilt.quant.quantize import QuantConfig, block_scales, check_quantizable, quantize_tensor
from hilt.quant.qweight import QuantizedWeight

SCALES = ("before", "during")
SOLVE_COLUMNS = 256  # columns of H⁻¹ solved at once: bounds the temporaries, not the result
GRAM_ROWS = 512  # rows of the Gram matrix widened and summed at once (the same sums)


@dataclass(frozen=True)
class CompensationConfig:
    """How the error compensation runs (the format itself is the QuantConfig)."""

    damp: float = 0.01  # added to H's diagonal, as a fraction of its mean: keeps H invertible
    block_columns: int = 128  # lazy-batch width
    act_order: bool = False  # columns by decreasing diag(H): the most used inputs are rounded first
    scales: str = "during"  # "before": block scales from the original weights; "during": from the compensated ones

    def __post_init__(self):
        if not 0 < self.damp < 1:
            raise HiltError(f"dampening must be in (0, 1), got {self.damp}")
        if self.block_columns < 1:
            raise HiltError(f"block_columns must be positive, got {self.block_columns}")
        if self.scales not in SCALES:
            raise HiltError(f"scales must be one of {', '.join(SCALES)}, got {self.scales!r}")


@contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim  # glibc
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """Hand the pages of freed memory back to the system. glibc keeps what a forward pass frees in its heaps,
    fragmented, and each block's peak lands on top: over the 16 blocks of a 1B model the peak grew from
    2.5 to 2.8 GB; trimmed after every pass it stays at 2.4 GB. A no-op where the C library is not glibc."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def check_compensable(config: QuantConfig) -> None:
    if config.codebook != "layer":
        raise HiltError("--compensate needs one codebook per layer (--codebook layer)")


def output_error(w: torch.Tensor, w_hat: torch.Tensor, H: torch.Tensor) -> float:
    """tr(ΔW H ΔWᵀ): the squared output error over the calibration inputs of replacing w by w_hat
    (float32 products, float64 sum: a statistic, not part of the sweep)."""
    d = w.float() - w_hat.float()
    return float(((d @ H.float()) * d).sum(dtype=torch.float64))


def inverse_factor(H: torch.Tensor, comp: CompensationConfig, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The column order of the sweep and the upper Cholesky factor U of (H + damp·mean(diag H)·I)⁻¹ in
    that order (float32), dampening more if H is near singular. Layers that share an input share both.

    ``H`` must be a float64 tensor the caller gives up: it is overwritten (its storage holds H⁻¹, then
    the factor), so an 8192-wide input needs one k x k float64 array beside it (L), not five.
    """
    if H.dtype != torch.float64:
        raise HiltError(f"layer '{name}': inverse_factor needs a float64 Gram matrix, got {H.dtype}")
    if not torch.isfinite(H).all():
        raise HiltError(f"layer '{name}': its input Gram matrix holds NaN or Inf (the calibration run diverged)")
    order = torch.argsort(H.diagonal(), descending=True) if comp.act_order else torch.arange(H.shape[0])
    if comp.act_order:
        H = H[order][:, order]
    diag = H.diagonal()
    dead = diag <= 0
    mean = float(diag[~dead].mean()) if bool((~dead).any()) else 1.0
    diag[dead] = mean  # an input that is always zero: its column gets plain rounding
    undamped = diag.clone()
    for attempt in range(4):
        diag.copy_(undamped).add_((comp.damp * 10**attempt) * mean)
        L, info = torch.linalg.cholesky_ex(H)
        if int(info) == 0:
            # H⁻¹ into H's own storage (column-major, as cholesky_solve leaves it), a band of columns at a
            # time by the two triangular solves cholesky_solve makes, without its copies of L and of the
            # identity: the same bits
            inverse, k = H.mT, H.shape[0]
            for j in range(0, k, SOLVE_COLUMNS):
                cols = torch.arange(min(SOLVE_COLUMNS, k - j))
                e = torch.zeros(k, len(cols), dtype=H.dtype)
                e[j + cols, cols] = 1
                inverse[:, j : j + len(cols)] = torch.linalg.solve_triangular(
                    L.mT, torch.linalg.solve_triangular(L, e, upper=False), upper=True)
            del L
            # factored in place (LAPACK's column-major layout, on which the sweep's rounding depends)
            U, info = torch.linalg.cholesky_ex(inverse, upper=True, out=(inverse, torch.empty((), dtype=torch.int32)))
            if int(info) == 0:
                return order, U.float()
            break
    raise HiltError(f"layer '{name}': its input Gram matrix is not positive definite even with dampening")


def compensated_quantize(
    w: torch.Tensor, H: torch.Tensor, config: QuantConfig, comp: CompensationConfig = CompensationConfig(),
    name: str = "tensor", factor: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[QuantizedWeight, dict]:
    """Quantize the 2-D ``w`` (out, in) to ``config``'s format minimising tr(ΔW H ΔWᵀ) column by column.

    ``H`` (in, in) is the Gram matrix of the layer's calibration inputs; ``factor`` is
    :func:`inverse_factor` of it, computed here when not given. The sweep is greedy, so the
    result is checked against rounding each weight on its own (same codebook, scales fixed before):
    the one with the smaller output error is returned, so compensation never does worse than
    rounding. Returns (weight, stats): the output errors of both, relative to tr(W H Wᵀ), and which won.
    """
    check_quantizable(name, w.shape, config)
    check_compensable(config)
    n, k = w.shape
    if tuple(H.shape) != (k, k):
        raise HiltError(f"layer '{name}': Gram matrix of shape {tuple(H.shape)} for a weight with {k} inputs")
    if not torch.isfinite(w).all():
        raise HiltError(f"tensor '{name}' contains NaN or Inf values")
    B = config.block_size

    # k-means: one codebook for the layer, fitted with each column's importance diag(H)
    importance = H.diagonal().float().clamp_min(0) if config.format.fitted else None
    rounded = quantize_tensor(w, config, name=name, importance=importance)
    levels = rounded.codebook.float()  # sorted, in its stored precision: the error is that of what is saved
    mids = ((levels[1:] + levels[:-1]) / 2).contiguous()

    order, U = factor if factor is not None else inverse_factor(H.to(torch.float64, copy=True), comp, name)
    W = w.float()[:, order]
    n_blocks = k // B
    scales = torch.empty(n, n_blocks, dtype=torch.bfloat16)
    offsets = torch.zeros(n, n_blocks, dtype=torch.bfloat16)
    asym = config.format.offsets
    have = [False] * n_blocks
    if comp.scales == "before":
        scales, o0 = block_scales(w, config)
        if asym:
            offsets = o0
        have = [True] * n_blocks
    # float32 working copies of the stored (bf16) scales; a zero scale divides by one (the block is zero)
    S, O = scales.float().T.contiguous(), offsets.float().T.contiguous()  # (blocks, n): rows are cheap to read
    S_inv = torch.where(S == 0, torch.ones_like(S), S).reciprocal()
    position = torch.empty(k, dtype=torch.long)
    position[order] = torch.arange(k)  # where each original column sits in the permuted W
    codes = torch.empty(k, n, dtype=torch.uint8 if config.bits <= 8 else torch.int16)  # per permuted column
    block_of = (order // B).tolist()
    diag = U.diagonal().tolist()

    with _one_thread():  # thousands of tiny ops: thread handoffs would cost more than they share
        for i1 in range(0, k, comp.block_columns):
            i2 = min(i1 + comp.block_columns, k)
            W1 = W[:, i1:i2].clone()
            E1 = torch.empty_like(W1)
            for j in range(i2 - i1):
                b = block_of[i1 + j]
                if not have[b]:  # "during": this block's scale from its columns as compensated so far
                    pos = position[b * B:(b + 1) * B]
                    current = W[:, pos].clone()
                    here = (pos >= i1) & (pos < i2)
                    current[:, here] = W1[:, pos[here] - i1]
                    s_b, o_b = block_scales(current, config)
                    scales[:, b] = s_b[:, 0]
                    S[b] = s_b[:, 0].float()
                    S_inv[b] = torch.where(S[b] == 0, torch.ones_like(S[b]), S[b]).reciprocal()
                    if asym:
                        offsets[:, b] = o_b[:, 0]
                        O[b] = o_b[:, 0].float()
                    have[b] = True
                wj = W1[:, j]
                idx = torch.bucketize((wj - O[b]) * S_inv[b], mids)
                codes[i1 + j] = idx
                err = (wj - (levels[idx] * S[b] + O[b])) / diag[i1 + j]
                W1[:, j:].addr_(err, U[i1 + j, i1 + j:i2], alpha=-1)
                E1[:, j] = err
            W[:, i2:].addmm_(E1, U[i1:i2, i2:], alpha=-1)

    codes = codes.T[:, position]  # back to (rows, original column order)
    offsets = offsets if asym else None
    q = QuantizedWeight(pack_codes(codes, config.bits), rounded.codebook, scales, offsets, (n, k), w.dtype,
                        config.bits, B, config.method)
    base = output_error(w, torch.zeros_like(w), H)
    err_q, err_r = output_error(w, q.dequantize(), H), output_error(w, rounded.dequantize(), H)
    rel = (lambda e: (e / base) ** 0.5 if base > 0 else e**0.5)  # noqa: E731
    stats = {"output_rel_error": rel(min(err_q, err_r)), "output_rel_error_rounded": rel(err_r),
             "compensated": err_q <= err_r}
    return (q if err_q <= err_r else rounded), stats


# ------------------------------------------------------------------------------------------ model pass


class _Stop(Exception):
    """Raised inside a forward once what was needed from it has been captured."""


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's repeated blocks: the ``nn.ModuleList`` holding the most parameters."""
    best, best_size = None, 0
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            size = sum(p.numel() for p in module.parameters())
            if size > best_size and any(isinstance(m, nn.Linear) for m in module.modules()):
                best, best_size = (path, module), size
    if best is None:
        raise HiltError(f"{type(model).__name__}: no list of repeated blocks with linear layers found; "
                        "error compensation needs a model built of blocks (decoder or encoder layers)")
    return best


def _hidden(args, kwargs) -> torch.Tensor:
    """The hidden state a block receives: its first positional argument, or ``hidden_states``."""
    h = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(h, torch.Tensor):
        raise HiltError("a block's first input is not a tensor: cannot capture the layer inputs of this architecture")
    return h


def _with_hidden(args, kwargs, h):
    return ((h, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h})


def _block_output(out) -> torch.Tensor:
    h = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(h, torch.Tensor):
        raise HiltError("a block returned no tensor: cannot follow the hidden state of this architecture")
    return h


class Compensator:
    """Quantize a model's block linears with error compensation, block by block, on demand.

    ``batches``: argument tuples for ``model`` (calibration text already tokenized); ``calibration``
    says in words what they are (recorded in the checkpoint header). ``targets``: the weight names
    (``<module path>.weight``) to quantize; those that are not linears inside the blocks are not
    covered (``hilt quantize`` rounds them as without compensation). :meth:`quantized` returns one
    tensor's QuantizedWeight, running the blocks up to the one that holds it; ``stats[name]`` then
    holds its output errors. ``seconds`` splits the time spent so far: forward passes, input Gram
    matrices, and the quantization itself.
    """

    def __init__(self, model: nn.Module, batches: Iterable[tuple], config: QuantConfig,
                 comp: CompensationConfig = CompensationConfig(), targets: Iterable[str] | None = None,
                 calibration: str = "", load_block: Callable[[int, nn.Module], None] | None = None,
                 release_block: Callable[[int, nn.Module], None] | None = None, release_outside: bool = False):
        check_compensable(config)
        self.model, self.config, self.comp = model, config, comp
        self.path, self.blocks = find_blocks(model)
        self.load_block, self.release_block = load_block, release_block
        self.release_outside = release_outside
        wanted = None if targets is None else set(targets)
        prefix = f"{self.path}." if self.path else ""
        self.linears: list[dict[str, nn.Linear]] = []  # per block: weight name -> linear
        for i, block in enumerate(self.blocks):
            found = {f"{prefix}{i}.{p}.weight": m for p, m in block.named_modules() if isinstance(m, nn.Linear)}
            self.linears.append({k: v for k, v in found.items() if wanted is None or k in wanted})
        self.block_of = {name: i for i, names in enumerate(self.linears) for name in names}
        if not self.block_of:
            raise HiltError(f"none of the tensors to quantize is a linear layer inside the model's blocks ({self.path})")
        self.batches = list(batches)
        if not self.batches:
            raise HiltError("no calibration batches")
        self.settings = {**asdict(comp), "calibration": calibration}
        self.next_block = 0
        self.inputs: list[tuple] | None = None  # (args, kwargs) of every batch at the next block
        self.done: dict[str, QuantizedWeight] = {}
        self.stats: dict[str, dict] = {}
        self.seconds = {"forward": 0.0, "gram": 0.0, "quantize": 0.0}

    def covers(self, name: str) -> bool:
        return name in self.block_of

    # -- public

    def quantized(self, name: str, known: Callable[[list[str]], dict] | None = None) -> QuantizedWeight:
        if name not in self.block_of:
            raise HiltError(f"'{name}' is not one of the compensated layers")
        while name not in self.done:
            self._run_block(known)
        return self.done.pop(name)

    def run_all(self) -> dict[str, QuantizedWeight]:
        while self.next_block < len(self.blocks):
            self._run_block(None)
        out, self.done = self.done, {}
        return out

    # -- the pass

    def _capture_first_inputs(self) -> list[tuple]:
        captured = []

        def grab(module, args, kwargs):
            captured.append((args, kwargs))
            raise _Stop

        handle = self.blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
        try:
            with torch.inference_mode():
                for batch in self.batches:
                    try:
                        self.model(*batch)
                    except _Stop:
                        continue
                    raise HiltError("the model's forward never reached its first block: cannot capture layer inputs")
        finally:
            handle.remove()
        for args, kwargs in captured:
            _hidden(args, kwargs)
        return captured

    def _release_outside(self) -> None:
        """Free the parameters outside the blocks (embeddings, final norm, head): past the first block's
        inputs only the blocks run."""
        inside = {id(m) for m in self.blocks.modules()}
        for module in self.model.modules():
            if id(module) not in inside:
                for name, p in list(module.named_parameters(recurse=False)):
                    setattr(module, name, nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False))

    def _forward(self, block: nn.Module, inputs, hooks: dict[nn.Module, Callable] | None = None,
                 stop_after: set | None = None) -> list[torch.Tensor] | None:
        """Run ``block`` on every captured input. With ``stop_after``, stop each forward once all of
        those modules have run (their hooks have seen their inputs); else return the outputs."""
        outputs = []
        handles = []
        seen: set = set()
        for module, fn in (hooks or {}).items():
            def hook(mod, args, fn=fn):
                fn(args[0])
                seen.add(mod)
                if stop_after is not None and stop_after <= seen:
                    raise _Stop
            handles.append(module.register_forward_pre_hook(hook))
        try:
            with torch.inference_mode():
                for args, kwargs in inputs:
                    seen.clear()
                    try:
                        outputs.append(_block_output(block(*args, **kwargs)))
                    except _Stop:
                        pass
        finally:
            for h in handles:
                h.remove()
            trim_heap()
        return None if stop_after is not None else outputs

    def _groups(self, block: nn.Module, inputs, linears: dict[str, nn.Linear]) -> list[list[str]]:
        """Target linears grouped by shared input, in the order the forward reaches them (first batch)."""
        by_module = {m: n for n, m in linears.items()}
        order: list[tuple[int, str]] = []  # (input tensor id, name)
        keep = []  # hold the inputs so that their ids stay unique during the forward

        def note(name):
            def fn(x):
                keep.append(x)
                order.append((id(x), name))
            return fn

        self._forward(block, inputs[:1], {m: note(n) for m, n in by_module.items()}, stop_after=set(by_module))
        missing = sorted(set(linears) - {n for _, n in order})
        if missing:
            raise HiltError(f"layer '{missing[0]}' is never called by its block's forward: cannot capture its inputs")
        groups: dict[int, list[str]] = {}
        for key, name in order:
            groups.setdefault(key, []).append(name)
        return list(groups.values())

    def _run_block(self, known) -> None:
        i = self.next_block
        if i >= len(self.blocks):
            raise HiltError("every block has been processed")
        start, before = time.perf_counter(), self.seconds["gram"] + self.seconds["quantize"]
        block = self.blocks[i]
        if self.inputs is None:
            self.inputs = self._capture_first_inputs()
            if self.release_outside:
                self._release_outside()
        if self.load_block is not None:
            self.load_block(i, block)
        linears = self.linears[i]
        have = known(list(linears)) if known is not None and linears else {}
        if linears and len(have) == len(linears):  # resumed: already written, only replay them
            for name, lin in linears.items():
                with torch.no_grad():
                    lin.weight.copy_(have[name].dequantize().to(lin.weight.dtype))
        elif linears:
            for group in self._groups(block, self.inputs, linears):
                H = self._gram(block, [linears[n] for n in group])
                t0 = time.perf_counter()
                H32 = H.float()  # what the statistics need; H itself becomes the factor's work space
                factor = inverse_factor(H, self.comp, ", ".join(group))
                del H
                self.seconds["quantize"] += time.perf_counter() - t0
                for name in group:
                    t0 = time.perf_counter()
                    lin = linears[name]
                    q, self.stats[name] = compensated_quantize(lin.weight.detach(), H32, self.config, self.comp,
                                                               name, factor)
                    with torch.no_grad():
                        lin.weight.copy_(q.dequantize().to(lin.weight.dtype))
                    self.done[name] = q
                    self.seconds["quantize"] += time.perf_counter() - t0
        outputs = self._forward(block, self.inputs)
        self.inputs = [_with_hidden(a, kw, h) for (a, kw), h in zip(self.inputs, outputs)]
        if self.release_block is not None:
            self.release_block(i, block)
            trim_heap()
        self.next_block += 1
        others = self.seconds["gram"] + self.seconds["quantize"]
        self.seconds["forward"] += time.perf_counter() - start - (others - before)

    def _gram(self, block: nn.Module, group: list[nn.Linear]) -> torch.Tensor:
        """H = XᵀX of the group's shared input over every calibration batch: float32 per batch,
        summed in float64."""
        k = group[0].in_features
        H = torch.zeros(k, k, dtype=torch.float64)
        # a reused buffer: fresh k x k temporaries every batch fragment the heap (gigabytes of RSS)
        product = torch.empty(k, k)
        rows = [0]

        def add(x):
            t0 = time.perf_counter()
            x = x.detach().reshape(-1, x.shape[-1]).float()
            torch.mm(x.T, x, out=product)
            for r in range(0, k, GRAM_ROWS):  # widening to float64 makes a copy: one band's, not k x k
                H[r : r + GRAM_ROWS].add_(product[r : r + GRAM_ROWS])
            rows[0] += x.shape[0]
            self.seconds["gram"] += time.perf_counter() - t0

        self._forward(block, self.inputs, {group[0]: add}, stop_after={group[0]})
        if not torch.isfinite(H).all():
            name = next(n for n, m in self.linears[self.next_block].items() if m is group[0])
            raise HiltError(f"layer '{name}': NaN or Inf in its calibration inputs")
        return H.div_(max(rows[0], 1))

