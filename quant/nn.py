"""QuantLinear and the model-level API, in the style of torchao's ``quantize_``.

    quantize_model_(model, QuantConfig(method="kmeans", bits=2))   # in place
    load_quantized_(model, "model-2bit/")                          # from `hilt quantize`
"""

from __future__ import annotations

import dataclasses
import re
import threading

import torch
from torch import nn

from hilt.errors import HiltError
from hilt.kernels import byte_table, dequantize_lut, int_cpu, lut_cpu, lut_matmul, uses_byte_table
from hilt.kernels.lut_matmul import PackedWeight
from hilt.quant.checkpoint import load_checkpoint
from hilt.quant.targets import KEEP_DENSE, embedding_config
from hilt.quant.quantize import QuantConfig, quantize_tensor
from hilt.quant.qweight import QuantizedWeight


# Held while a kept kernel is made or a weight's order is put back: two threads running a layer for the
# first time must not both permute its buffers (an RLock: making one reads the weight, which restores).
_ORDER_LOCK = threading.RLock()


def _stored_order_hook(module, *args):
    """Before state_dict and load_state_dict: the buffers in the stored order (a named function, so that
    the layer still pickles); outputs its group computed ahead from the old buffers are dropped."""
    module._stored_order()
    if getattr(module, "group", None) is not None:
        module.group.forget()


class _Packed(nn.Module):
    """A weight kept as a QuantizedWeight's parts (buffers, so that .to(device) and state_dict carry
    them), with what the kernels keep between calls.

    Where the CPU kernel runs a weight faster in an order of its own (1-2 bits: lut_cpu's pair tables),
    a layer that may do so (``reorders``) lets it permute ``codes`` and ``scales`` in place rather than
    hold a second copy; reading the weight (``packed``, ``qweight``), ``state_dict``, ``load_state_dict``
    and moves put the stored order back first, and the next CPU call permutes again."""

    reorders = False
    int_copy = True  # whether PyTorch's int8 kernel, faster but holding a copy, may run this weight

    def __init__(self, qweight: QuantizedWeight):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.bits, self.block_size, self.method = qweight.bits, qweight.block_size, qweight.method
        self.weight_dtype = qweight.dtype
        self.register_buffer("codes", qweight.codes)
        self.register_buffer("codebook", qweight.codebook)
        self.register_buffer("scales", qweight.scales)
        self.register_buffer("offsets", qweight.offsets)
        self._table = self._cpu_pack = self._cpu_lut = None  # what the kernels keep (see _kept)
        self._derived_from: dict[str, list] = {}
        self.register_state_dict_pre_hook(_stored_order_hook)
        self.register_load_state_dict_pre_hook(_stored_order_hook)

    def __getstate__(self):
        """Copies and pickles carry the buffers in the stored order and none of what the kernels keep
        (C views of this layer's memory)."""
        self._stored_order()
        state = dict(super().__getstate__())
        state.update(_table=None, _cpu_pack=None, _cpu_lut=None, _derived_from={})
        return state

    @property
    def qweight(self) -> QuantizedWeight:
        """The weight in the stored order; a layer that ``reorders`` gives copies of codes and scales,
        which its next CPU call would otherwise permute under the caller."""
        self._stored_order()
        codes, scales = (self.codes.clone(), self.scales.clone()) if self.reorders else (self.codes, self.scales)
        return QuantizedWeight(
            codes, self.codebook, scales, self.offsets, (self.out_features, self.in_features),
            self.weight_dtype, self.bits, self.block_size, self.method,
        )

    @property
    def packed(self) -> PackedWeight:
        """The kernel's argument, from the buffers as they are now (moved, loaded), in the stored order."""
        self._stored_order()
        return PackedWeight(self.codes, self.codebook, self.scales, self.offsets, self.bits, self.block_size,
                            self.in_features)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not x.is_cuda:
            kernel = self._cpu_kernel(x)
            if kernel is not None:
                return kernel(x, bias)
        w = self.packed
        return lut_matmul(x, w, bias, table=self._byte_table(x, w))

    def _kept(self, name: str, parts: list[torch.Tensor | None], make):
        """The attribute ``name``, a value made from ``parts`` and kept between calls (decode would
        otherwise remake it every token); made again when a part is another tensor (moved, loaded) or
        was changed in place (its version; inference tensors have none)."""
        if not self._current(name, parts):
            with _ORDER_LOCK:
                if not self._current(name, parts):  # another thread may have made it meanwhile
                    setattr(self, name, make())
                    self._derived_from[name] = self._key(parts)  # after make, which may permute the parts
        return getattr(self, name)

    def _parts(self) -> list[torch.Tensor | None]:
        """The buffers a kept kernel is made from, read from ``_buffers`` (not nn.Module's __getattr__: a
        microsecond a name, on every call of a decode step)."""
        b = self._buffers
        return [b["codes"], b["codebook"], b["scales"], b["offsets"]]

    @staticmethod
    def _key(parts):
        return [(t, None if t is None or t.is_inference() else t._version) for t in parts]

    def _current(self, name: str, parts) -> bool:
        """Whether the kept ``name`` was made from these very parts, unchanged since (checked on every call
        of a decode step, so kept lean)."""
        old = self._derived_from.get(name)
        if old is None:
            return False
        for t, (a, va) in zip(parts, old):  # va is None for None and inference tensors (no version), as t is a
            if t is not a or (va is not None and t._version != va):
                return False
        return True

    def _stored_order(self) -> None:
        """The buffers back in the stored order where the CPU kernel holds them in its own (a no-op
        otherwise); a kernel made from buffers changed since is dropped, the new contents kept."""
        if self._cpu_lut is None or not self._cpu_lut.interleaved:
            return
        with _ORDER_LOCK:
            kernel = self._cpu_lut
            if kernel is None or not kernel.interleaved:
                return
            if self._current("_cpu_lut", self._parts()):
                kernel.restore()
            self._cpu_lut = None
            self._derived_from.pop("_cpu_lut", None)

    def _byte_table(self, x: torch.Tensor, w: PackedWeight) -> torch.Tensor | None:
        """The codebook's byte table for the CUDA kernel's one-row path."""
        if not (x.is_cuda and uses_byte_table(w)):
            return None
        return self._kept("_table", [w.codebook], lambda: byte_table(w.codebook, w.bits))

    def _cpu_kernel(self, x: torch.Tensor):
        """The CPU kernel readied for this weight, a callable ``(x, bias) -> y``: for a layer that may
        hold a copy (``int_copy``) with row-wise int8 and bfloat16 x of at most lut_cpu.SMALL_M rows,
        PyTorch's fused kernel (with its own copy of the weight; kernels.int_cpu.PREFERRED_BITS says
        why), else the lookup-table kernel on the stored buffers (kernels.lut_cpu.Prepared); None where
        no C compiler built the latter (lut_matmul then runs the reference, with its warning). At 1-2 bits a
        layer that ``reorders`` lets that kernel interleave its buffers in place (see the class)."""
        parts = self._parts()
        if (self.int_copy and self.bits in int_cpu.PREFERRED_BITS and x.dtype == torch.bfloat16
                and x.numel() // max(1, x.shape[-1]) <= lut_cpu.SMALL_M):  # prefill: the LUT kernel's bands
            pack = self._kept("_cpu_pack", parts, self._int_pack)
            if pack is not None:
                return pack
        return self._kept("_cpu_lut", parts, lambda: lut_cpu.prepare(self.packed, interleave=self.reorders))

    def _int_pack(self):
        w = self.packed
        return int_cpu.prepack(w) if int_cpu.supports(w) else None

    def _apply(self, fn, recurse=True):
        """Moves keep each packed part's dtype: ``model.to(torch.bfloat16)`` or ``.half()`` would round the
        float16 codebook (and a float32 one to bfloat16), changing the weights; only the device follows."""
        self._stored_order()
        kept = {n: b for n, b in self._buffers.items() if b is not None}
        self._table = self._cpu_pack = self._cpu_lut = None  # made again from the moved parts (old ones freed)
        self._derived_from.clear()
        out = super()._apply(fn, recurse)
        for name, old in kept.items():
            if self._buffers[name].dtype != old.dtype:
                self._buffers[name] = old.to(self._buffers[name].device)
        return out

    def _format_repr(self) -> str:
        return f"method={self.method}, bits={self.bits}, block_size={self.block_size}"


class QuantLinear(_Packed):
    """A Linear whose weight is a QuantizedWeight; runs through ``kernels.lut_matmul``."""

    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None = None):
        reorders = qweight.bits <= 2  # the widths the CPU kernel's pair tables take (lut_cpu.pair_path)
        if reorders:  # its own codes and scales, which that kernel permutes in place (the caller's stay as given)
            qweight = dataclasses.replace(qweight, codes=qweight.codes.clone(), scales=qweight.scales.clone())
        super().__init__(qweight)
        self.reorders = reorders
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    group = None  # the SharedInput this layer runs in, if any (see group_projections_)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None and not x.is_cuda:
            out = self.group.output(self, x)
            if out is not None:
                return out
        return self._matmul(x, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self._format_repr()}, "
                f"bias={self.bias is not None}")


class QuantEmbedding(_Packed):
    """An Embedding whose table is a QuantizedWeight (rows: tokens): a lookup dequantizes only the rows
    it reads, in ``dtype`` (the model's). :meth:`linear` is the tied output head, logits = x @ table.T."""

    # the table is a model's largest tensor, and quantized to save memory: its tied head runs on the
    # stored buffers (PyTorch's int8 kernel would be 1.3x faster there but hold a second table)
    int_copy = False

    def __init__(self, qweight: QuantizedWeight, dtype: torch.dtype = torch.float32, scale: float | None = None):
        super().__init__(qweight)
        self.dtype = dtype
        self.scale = scale  # a lookup's factor (Gemma's sqrt(hidden size)); the tied head reads the table unscaled

    @classmethod
    def replacing(cls, module: nn.Embedding, qweight: QuantizedWeight) -> "QuantEmbedding":
        """The quantized table in place of ``module``, with its dtype and the factor its lookups multiply by
        (transformers' scaled embeddings: Gemma's ``embed_scale``), so that the model's inputs stay as they were."""
        scale = getattr(module, "scalar_embed_scale", None)
        if scale is None and isinstance(getattr(module, "embed_scale", None), torch.Tensor) \
                and not module.embed_scale.is_meta:
            scale = float(module.embed_scale)
        return cls(qweight, module.weight.dtype, None if scale is None else float(scale))

    def _apply(self, fn, recurse=True):
        # a dtype cast of the model changes the dtype lookups return (the packed parts keep theirs)
        self.dtype = fn(torch.zeros((), dtype=self.dtype, device=self.codes.device)).dtype
        return super()._apply(fn, recurse)

    @property
    def num_embeddings(self) -> int:
        return self.out_features

    @property
    def embedding_dim(self) -> int:
        return self.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = ids.reshape(-1)
        w = self.packed
        book = w.codebook[rows] if w.per_block_codebook else w.codebook
        offsets = None if w.offsets is None else w.offsets[rows]
        picked = PackedWeight(w.codes[rows], book, w.scales[rows], offsets, w.bits, w.block_size, w.in_features)
        out = dequantize_lut(picked).to(self.dtype).reshape(*ids.shape, self.in_features)
        # as transformers scales: by the factor rounded to the model's dtype
        return out if self.scale is None else out * torch.tensor(self.scale, dtype=self.dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._matmul(x, bias)

    def extra_repr(self) -> str:
        scale = "" if self.scale is None else f", scale={self.scale:g}"
        return f"{self.num_embeddings}, {self.embedding_dim}, {self._format_repr()}{scale}"


def replace_module(model: nn.Module, path: str, new: nn.Module) -> None:
    """Put ``new`` at ``path`` (dotted, as ``named_modules`` names it) in ``model``."""
    if not path:
        raise HiltError(f"cannot replace the {type(model).__name__} passed in, only layers inside it: wrap a single "
                        "layer in nn.Sequential")
    parent_path, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, attr, new)


def replace_modules(model: nn.Module, make) -> int:
    """Replace each module for which ``make(path, module)`` returns one (None: keep it), in place;
    returns how many were replaced. A module the model holds under several paths (shared) is made
    once, from its first path, and replaced under every one, so it stays shared."""
    made = {}
    for path, module in list(model.named_modules(remove_duplicate=False)):
        if id(module) not in made:
            made[id(module)] = make(path, module)
        if made[id(module)] is not None:
            replace_module(model, path, made[id(module)])
    return sum(new is not None for new in made.values())


def eligible(module: nn.Module, path: str, config: QuantConfig, filter_fn=None) -> bool:
    """Whether quantize_model_ and prepare_qat_ swap ``module``: an nn.Linear that
    ``filter_fn(module, path)`` accepts or, without one, whose ``<path>.weight`` is not an
    embedding or LM head name (as ``hilt quantize``) and whose input size the block size divides."""
    if not isinstance(module, nn.Linear):
        return False
    if filter_fn is not None:
        return bool(filter_fn(module, path))
    return not KEEP_DENSE.search(f"{path}.weight") and module.in_features % config.block_size == 0


def quantize_model_(model: nn.Module, config: QuantConfig, filter_fn=None,
                    embeddings: int | QuantConfig | None = None) -> nn.Module:
    """Swap every eligible ``nn.Linear`` of ``model`` for a QuantLinear, in place (eligible: see
    :func:`eligible`; ``filter_fn(module, path) -> bool`` overrides). Returns the model.

    ``embeddings``: also quantize the embedding tables and output heads, as ``hilt quantize --embeddings``
    (bits of row-wise integers, or a QuantConfig): an ``nn.Embedding`` becomes a QuantEmbedding, a head
    tied to it (an ``nn.Linear`` holding the same weight) a TiedHead that reads its buffers, an untied head
    a QuantLinear."""
    tables = {}  # an embedding weight's id -> the QuantEmbedding made of it

    def head_format(module, path):
        return embedding_config(embeddings, tuple(module.weight.shape))

    def make_table(path, module):
        name = f"{path}.weight"
        if isinstance(module, nn.Embedding) and KEEP_DENSE.search(name):
            table = QuantEmbedding.replacing(module, quantize_tensor(module.weight.detach(), head_format(module, path),
                                                                     name=name))
            tables[id(module.weight)] = table
            return table
        return None

    def make(path, module):
        name = f"{path}.weight"
        if isinstance(module, nn.Linear) and id(module.weight) in tables:
            return TiedHead(tables[id(module.weight)], module.bias)
        if embeddings is not None and isinstance(module, nn.Linear) and KEEP_DENSE.search(name):
            return QuantLinear(quantize_tensor(module.weight.detach(), head_format(module, path), name=name),
                               module.bias)
        if eligible(module, path, config, filter_fn):
            return QuantLinear(quantize_tensor(module.weight.detach(), config, name=name), module.bias)
        return None

    if embeddings is not None:  # the tables first: a head tied to one may come before it
        replace_modules(model, make_table)
    replace_modules(model, make)
    group_projections_(model)
    return model


# Sibling layers that read the same input in the architectures hilt meets (Llama, Gemma, Qwen, Mistral, ...;
# hilt's own Llama names them as GGUF does): one kernel call computes each group's outputs at decode.
SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"),
                       ("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))


class SharedInput:
    """QuantLinear layers of one module that take the same input (q, k and v; gate and up). The first of
    them called with an input runs the CPU kernel for all (``lut_cpu.PreparedGroup``: one C call) and keeps
    the others' outputs for that very tensor, which they then take instead of computing; a layer called with
    another input, or with more rows than the kernel runs itself (prefill), computes alone. Each output is
    what the layer alone gives, bit for bit. A plain object, not a module: state_dict, moves and saving see
    the layers as they were."""

    def __init__(self, layers: list[QuantLinear]):
        self.layers = layers
        self._ahead: dict[int, tuple] = {}  # thread -> (input, its version, {id(layer): output}), taken once each
        self._run = None  # (the members' kernels, their PreparedGroup)

    def __getstate__(self):
        return {"layers": self.layers, "_ahead": {}, "_run": None}

    def forget(self) -> None:
        self._ahead.clear()

    def output(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor | None:
        """``layer``'s output for ``x`` from the group's call, or None (then the layer computes alone)."""
        thread = threading.get_ident()
        version = None if x.is_inference() else x._version  # an input changed in place is another input
        ahead = self._ahead.get(thread)
        if ahead is not None and ahead[0] is x and ahead[1] == version:
            out = ahead[2].pop(id(layer), None)
            if not ahead[2]:
                del self._ahead[thread]
            if out is not None:
                return out
        if x.numel() // max(1, x.shape[-1]) > lut_cpu.SMALL_M or x.requires_grad:
            return None
        kernels = [m._cpu_kernel(x) for m in self.layers]
        if not all(isinstance(k, lut_cpu.Prepared) for k in kernels):  # int8's PyTorch kernel, or no C compiler
            return None
        if self._run is None or any(a is not b for a, b in zip(self._run[0], kernels)):
            self._run = (kernels, lut_cpu.PreparedGroup(kernels))
        outs = self._run[1](x, [m.bias for m in self.layers])
        self._ahead[thread] = (x, version, {id(m): o for m, o in zip(self.layers, outs) if m is not layer})
        return outs[self.layers.index(layer)]


def group_projections_(model: nn.Module) -> int:
    """Group the QuantLinear layers of ``model`` that take the same input (SHARED_INPUT_GROUPS, within one
    module, same input size) so that decode computes each group in one kernel call; returns how many
    groups. The layers, their buffers and their outputs stay as they are."""
    count = 0
    for module in model.modules():
        for names in SHARED_INPUT_GROUPS:
            layers = [module._modules.get(n) for n in names]
            if (all(isinstance(m, QuantLinear) for m in layers)
                    and len({m.in_features for m in layers}) == 1 and len({id(m) for m in layers}) == len(layers)):
                group = SharedInput(layers)
                for m in layers:
                    m.group = group
                count += 1
    return count


class TiedHead(nn.Module):
    """An output head tied to a quantized embedding: logits = x @ table.T (+ bias), read from the
    table's buffers at each call. It holds no buffers of its own, so nothing is stored twice and
    moving or loading the table is all it needs; the table is not one of its submodules (the model
    holds it once, where it is)."""

    def __init__(self, table: QuantEmbedding, bias: torch.Tensor | None = None):
        super().__init__()
        self.__dict__["table"] = table
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @property
    def in_features(self) -> int:
        return self.table.in_features

    @property
    def out_features(self) -> int:
        return self.table.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table.linear(x, self.bias)

    def extra_repr(self) -> str:
        return f"tied to a quantized embedding {self.out_features} x {self.in_features}"


def load_quantized_(model: nn.Module, dst, strict: bool = True) -> nn.Module:
    """Load a hilt checkpoint into ``model`` whose parameter names match its tensor names.

    Linear layers whose weight was quantized become QuantLinear, embeddings QuantEmbedding (and a
    Linear head sharing the embedding's weight, a tied head, a QuantLinear on the same buffers);
    every other tensor is copied into the matching parameter or buffer. With ``strict``, a
    checkpoint tensor with no home in the model is an error naming it; without, such tensors
    (e.g. a pooler the model does not use) are skipped.
    """
    tensors = load_checkpoint(dst)
    modules = dict(model.named_modules())
    own = model.state_dict()
    if not any(n in own for n in tensors):
        raise HiltError(f"{dst}: no tensor name matches the model (was it quantized from another model?)")
    heads: dict[int, list[str]] = {}  # a weight's id -> the Linear modules that hold it (tied heads)
    for path, module in modules.items():
        if isinstance(module, nn.Linear):
            heads.setdefault(id(module.weight), []).append(path)
    dense = {}
    for name in list(tensors):
        value = tensors.pop(name)  # released once its layer holds its own copy: the peak stays one layer over
        if isinstance(value, QuantizedWeight):
            path = re.sub(r"\.weight$", "", name)
            module = modules.get(path)
            if not isinstance(module, (nn.Linear, nn.Embedding)):
                if strict or name in own:
                    raise HiltError(f"{dst}: quantized tensor '{name}' has no matching nn.Linear or nn.Embedding "
                                    "in the model")
                continue
            if tuple(module.weight.shape) != value.shape:
                raise HiltError(f"{dst}: tensor '{name}' has shape {value.shape}, layer '{path}' expects "
                                f"{tuple(module.weight.shape)}")
            if isinstance(module, nn.Linear):
                replace_module(model, path, QuantLinear(value, module.bias))
                continue
            table = QuantEmbedding.replacing(module, value)
            replace_module(model, path, table)
            for head in heads.get(id(module.weight), []):
                replace_module(model, head, TiedHead(table, modules[head].bias))
        else:
            dense[name] = value
    unknown = [n for n in dense if n not in own]
    if strict and unknown:
        raise HiltError(f"{dst}: tensor '{unknown[0]}' has no matching parameter in the model")
    with torch.no_grad():
        for name, value in dense.items():
            if name in own:
                if own[name].shape != value.shape:
                    raise HiltError(f"{dst}: tensor '{name}' has shape {tuple(value.shape)}, model expects {tuple(own[name].shape)}")
                own[name].copy_(value)
    group_projections_(model)
    return model
