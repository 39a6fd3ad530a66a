"""Filling a bench model with weights from its checkpoint file."""

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.nn as nn

from hilt.errors import HiltError
from hilt.quant.sources import Source, open_source


@contextlib.contextmanager
def meta_init() -> Iterator[None]:
    """Build modules on the meta device without their random init, for weights a file replaces.
    nn.Embedding's init draws normal_, which on the meta device imports torch's compiler: about 1.5 s
    of every model load."""
    reset = nn.Embedding.reset_parameters
    nn.Embedding.reset_parameters = lambda self: None
    try:
        with torch.device("meta"):
            yield
    finally:
        nn.Embedding.reset_parameters = reset


def load_weights_(model: nn.Module, path: Path, tensors: Mapping[str, torch.Tensor] | None, kind: str,
                  skip: str | None = None) -> nn.Module:
    """Load every parameter of ``model`` (built on the meta device) from ``path``, as float32.

    ``tensors`` (name -> tensor) replaces the file's tensors of those names; a
    name that is not a model tensor is an error, so a wrongly named mapping
    cannot silently fall back to the file. ``skip``: a name prefix left on the
    meta device (blocks that :func:`load_part_` fills one at a time). Returns
    the model in eval mode.
    """
    want = {k: v.shape for k, v in model.state_dict().items() if skip is None or not k.startswith(skip)}
    tensors = dict(tensors or {})
    unknown = sorted(set(tensors) - set(want))
    if unknown:
        raise HiltError(f"tensors not in the {kind} model: {', '.join(unknown[:5])}"
                        + (f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else ""))
    state = {}
    with open_source(path) as src:
        in_file = set(src.names())
        for name, shape in want.items():
            if name in tensors:
                t = tensors[name]
            elif name in in_file:
                t = src.get(name)
            else:
                raise HiltError(f"{path}: tensor {name!r} is missing")
            if tuple(t.shape) != tuple(shape):
                raise HiltError(f"tensor {name!r} has shape {tuple(t.shape)}, the model needs {tuple(shape)}")
            state[name] = t.detach().to(torch.float32).contiguous()
    model.load_state_dict(state, strict=skip is None, assign=True)
    return model.eval().requires_grad_(False)


def load_part_(module: nn.Module, source: Source, prefix: str) -> nn.Module:
    """Fill ``module`` (on the meta device) with the tensors named ``prefix + <its state name>`` of the
    open ``source``."""
    in_file = set(source.names())
    state = {}
    for name in module.state_dict():
        if prefix + name not in in_file:
            raise HiltError(f"{source.path}: tensor {prefix + name!r} is missing")
        state[name] = source.get(prefix + name).to(torch.float32).contiguous()
    module.load_state_dict(state, strict=True, assign=True)
    return module.requires_grad_(False)
