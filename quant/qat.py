"""Quantization-aware training for the k-means, integer and 1-bit formats.

    prepare_qat_(model, QuantConfig(method="kmeans", bits=2))   # Linear -> FakeQuantLinear, in place
    opt = torch.optim.AdamW(qat_param_groups(model, weight_decay=0.1), lr=...)
    ... train; call qat_step_(model, step, schedule) after each optimizer step ...
    save_qat(model, "model-2bit-qat/")                           # the `hilt quantize` format

A FakeQuantLinear keeps the full-precision weight W as its trainable parameter and runs its
forward on Q(W), the weight exactly as the saved checkpoint will hold it: block scales
recomputed from the live W at every forward (rounded to bf16 like the stored ones), each
value snapped to the nearest codebook level (rounded to fp16 like the stored codebook).
The gradient goes straight through Q to W (straight-through estimator): dL/dW = dL/dQ(W).

k-means codebooks are fitted (the certified-optimal 1-D k-means of quant.kmeans) when
quantization starts, after ``warmup`` full-precision steps. From then on they are trained
with the weights (``learn_codebook``, the default): each level gets the gradient of the loss,
dL/dc = sum over the weights snapped to c of scale x dL/dQ, so the levels go where the loss
wants them rather than where the latent weights' squared error does (under the
straight-through estimator the latent weights are not what the model computes with).
Without it they are refitted by k-means every ``refit_every`` steps, the published procedure
(docs/references.md section 1). Measured with bench/studies/qat_scaling.py (docs/results/qat.md).
Integer and 1-bit grids are fixed. Exporting quantizes W with the layer's own codebook, so the
saved model computes exactly what QAT trained.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from hilt.errors import HiltError
from hilt.quant import kmeans
from hilt.quant.checkpoint import quantize_checkpoint
from hilt.quant.nn import eligible, replace_modules
from hilt.quant.quantize import QuantConfig, fixed_codebook, normalise_blocks


@dataclass(frozen=True)
class QATSchedule:
    warmup: int = 0  # full-precision steps before quantization starts (and the codebooks are fitted)
    # k-means codebooks refitted every this many steps after that (0: never; trained codebooks need no refits)
    refit_every: int = 0
    # total steps, if known: no refit with fewer than refit_every steps left to train against it. A refit
    # moves every level at once; just before the end it costs more than it fits (measured: +0.06 nats)
    steps: int | None = None

    def __post_init__(self):
        if self.warmup < 0 or self.refit_every < 0:
            raise HiltError(f"QAT warm-up and refit interval must be >= 0, got {self.warmup}, {self.refit_every}")


class FakeQuantLinear(nn.Module):
    """A Linear trained through its quantized weight (see the module docstring)."""

    def __init__(self, linear: nn.Linear, config: QuantConfig, name: str = "linear", learn_codebook: bool = True):
        super().__init__()
        if linear.in_features % config.block_size:
            raise HiltError(f"layer '{name}' has {linear.in_features} inputs, not a multiple of block size "
                            f"{config.block_size}")
        self.config, self.name = config, name
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        fixed = fixed_codebook(config)
        # in the state dict either way: a resumed QAT run continues with the codebook it had
        book = torch.zeros(1 << config.bits) if fixed is None else fixed.float()  # zeros: fitted when quantizing starts
        book = book.to(linear.weight.device)  # a model already on the GPU gets its codebooks there
        if fixed is None and learn_codebook:
            self.codebook = nn.Parameter(book)
        else:
            self.register_buffer("codebook", book)
        self.quantizing = False

    @torch.no_grad()
    def fit_codebook(self) -> None:
        """Fit the k-means levels to the current weights in block units (a no-op for fixed grids)."""
        if not self.config.format.fitted:
            return
        _, _, u = normalise_blocks(self.weight.detach().float(), self.config)
        levels = kmeans.kmeans_optimal(u.flatten(), 1 << self.config.bits).centroids
        self.codebook.copy_(levels.to(torch.float16).sort().values.float())

    def levels(self) -> torch.Tensor:
        """The codebook as stored: fp16 values, ascending (training may move one level past another)."""
        return self.codebook.to(torch.float16).float().sort().values

    def quantized_weight(self) -> torch.Tensor:
        """Q(W) as the checkpoint will store it. Its gradient goes straight through to W and, for a
        trained codebook, to the levels (each gets the scale-weighted gradients of its weights)."""
        w = self.weight
        scales, offsets, u = normalise_blocks(w.detach().float(), self.config)
        book = self.levels()
        q = book[kmeans.assign(u, book.detach().double())] * scales.float().unsqueeze(-1)
        if offsets is not None:
            q = q + offsets.float().unsqueeze(-1)
        return q.view_as(w).to(w.dtype) + (w - w.detach())

    def forward(self, x):
        return F.linear(x, self.quantized_weight() if self.quantizing else self.weight, self.bias)

    def extra_repr(self):
        c = self.config
        return (f"in_features={self.in_features}, out_features={self.out_features}, method={c.method}, bits={c.bits}, "
                f"block_size={c.block_size}, quantizing={self.quantizing}")


def fake_quant_layers(model: nn.Module) -> dict[str, FakeQuantLinear]:
    return {path: m for path, m in model.named_modules() if isinstance(m, FakeQuantLinear)}


def prepare_qat_(model: nn.Module, config: QuantConfig, filter_fn=None, learn_codebook: bool = True) -> nn.Module:
    """Swap every eligible nn.Linear for a FakeQuantLinear, in place (the same layers that
    ``quantize_model_`` and ``hilt quantize`` would quantize, unless ``filter_fn(module, path)`` says).
    ``learn_codebook``: k-means levels trained by the loss after their fit, or only refitted (module docstring)."""
    swapped = replace_modules(model, lambda path, module: FakeQuantLinear(module, config, path, learn_codebook)
                              if eligible(module, path, config, filter_fn) else None)
    if not swapped:
        raise HiltError(f"no Linear layer of {type(model).__name__} can take block size {config.block_size}")
    return model


def qat_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Optimizer parameter groups: trained codebooks are levels in block units, not weights, so
    they get no weight decay (it would shrink every level towards zero for nothing)."""
    books = {id(layer.codebook) for layer in fake_quant_layers(model).values()
             if isinstance(layer.codebook, nn.Parameter)}
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if id(p) not in books], "weight_decay": weight_decay},
            {"params": [p for p in params if id(p) in books], "weight_decay": 0.0}]


def start_quantizing_(model: nn.Module) -> None:
    """Fit every codebook to the current weights and switch the forwards to Q(W)."""
    for layer in fake_quant_layers(model).values():
        layer.fit_codebook()
        layer.quantizing = True


def qat_step_(model: nn.Module, step: int, schedule: QATSchedule) -> str | None:
    """Call after optimizer step ``step`` (0-based): starts quantization when the warm-up ends
    and refits the codebooks on schedule. Returns what it did ("start", "refit") or None."""
    done = step + 1
    if done >= schedule.warmup and not all(layer.quantizing for layer in fake_quant_layers(model).values()):
        start_quantizing_(model)  # the warm-up is over (warmup 0: right after the first step)
        return "start"
    room = schedule.steps is None or done + schedule.refit_every <= schedule.steps
    if done > schedule.warmup and schedule.refit_every and (done - schedule.warmup) % schedule.refit_every == 0 and room:
        for layer in fake_quant_layers(model).values():
            layer.fit_codebook()
        return "refit"
    return None


def save_qat(model: nn.Module, dst, overwrite: bool = False) -> dict:
    """Write the model in the `hilt quantize` format: each FakeQuantLinear's W quantized with its
    own codebook (so the saved model equals the QAT forward), every other tensor dense."""
    layers = fake_quant_layers(model)
    if not layers:
        raise HiltError("the model has no FakeQuantLinear layer: call prepare_qat_ first")
    configs = {layer.config for layer in layers.values()}
    if len(configs) > 1:
        raise HiltError("save_qat writes one format per checkpoint; the model's QAT layers use several")
    if not all(layer.quantizing for layer in layers.values()):
        raise HiltError("QAT has not started quantizing yet (still in warm-up): there is nothing quantized to save")
    config = configs.pop()
    tensors = {n: t.detach().contiguous() for n, t in model.state_dict().items()
               if not any(n == f"{p}.codebook" for p in layers)}
    codebooks = {f"{p}.weight": layer.levels().detach().to(torch.float16) for p, layer in layers.items()}
    only = "^(" + "|".join(re.escape(n) for n in codebooks) + ")$"
    dst = Path(dst)
    with tempfile.TemporaryDirectory(dir=dst.parent if dst.parent.exists() else None) as tmp:
        src = Path(tmp) / "qat.safetensors"
        save_file(_unshared(tensors), src)
        return quantize_checkpoint(src, dst, config, only=only, overwrite=overwrite,
                                   codebooks=codebooks if config.format.fitted else None).header


def _unshared(tensors: dict) -> dict:
    """safetensors refuses tensors that share memory (tied embeddings): give each its own copy."""
    seen, out = set(), {}
    for name, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        out[name] = t.clone() if key in seen else t
        seen.add(key)
    return out
