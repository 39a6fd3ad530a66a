"""The model and data a CIM study runs on: a built-in workload or any model a user brings.

    load_model("cnn")                                        # a built-in Fashion-MNIST workload
    load_model("mypkg.nets:resnet8", "resnet8.safetensors")  # any nn.Module a factory builds
    load_data()                                              # the Fashion-MNIST test split
    load_data("test.npz")                                    # arrays `inputs` and `labels`

Checkpoints and data files are read with safetensors or numpy with pickles refused, so a file a
user hands over can hold tensors only. A factory module is imported from the Python path, the
current folder included.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import torch
from torch import nn

from hilt.errors import HiltError, one_line

DATA_KEYS = ("inputs", "labels")


def is_factory(spec: str) -> bool:
    return ":" in spec


def load_model(spec: str, checkpoint=None) -> tuple[nn.Module, dict]:
    """(model in eval mode, {"model": spec, "checkpoint": path or None}).

    ``spec``: a built-in workload name (``mlp``, ``cnn``; default checkpoint the committed one) or
    ``PKG.MODULE:FACTORY``, a function of no arguments returning an ``nn.Module``, whose weights come
    from ``checkpoint`` (a safetensors state dict) or, without one, from the factory itself.
    """
    if not is_factory(spec):
        from hilt.models.classifiers import check_workload
        from hilt.tasks.train import workload_model

        check_workload(spec)
        model, path = workload_model(spec, checkpoint)
        return model, {"model": spec, "checkpoint": str(path)}
    model = _build(spec)
    if checkpoint is not None:
        _load_state(model, Path(checkpoint), spec)
    if not any(isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)) for m in model.modules()):
        raise HiltError(f"{spec}: the model has no Linear, Conv1d or Conv2d layer to put on analog hardware")
    return model.eval(), {"model": spec, "checkpoint": None if checkpoint is None else str(checkpoint)}


def _build(spec: str) -> nn.Module:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise HiltError(f"model {spec!r}: expected a workload name or PKG.MODULE:FACTORY")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # a module beside the user, as `python -m` would find it
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise HiltError(f"model {spec}: cannot import {module_name}: {type(e).__name__}: {one_line(e)}") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise HiltError(f"model {spec}: {module_name} has no function {attr!r}")
    try:
        model = factory()
    except Exception as e:
        raise HiltError(f"model {spec}: {attr}() failed: {type(e).__name__}: {one_line(e)}") from e
    if not isinstance(model, nn.Module):
        raise HiltError(f"model {spec}: {attr}() returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _load_state(model: nn.Module, path: Path, spec: str) -> None:
    if path.suffix != ".safetensors":
        raise HiltError(f"{path}: checkpoints are read as .safetensors only (other formats can run code when loaded)")
    if not path.is_file():
        raise HiltError(f"{path}: no such checkpoint file")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        state = load_file(path)
    except (SafetensorError, OSError) as e:
        raise HiltError(f"{path}: not a readable safetensors file ({one_line(e)})") from e
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a tensor of another shape
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise HiltError(f"{path} does not fit {spec}: {next((x for x in lines if 'size mismatch' in x), lines[-1])}") from e
    problems = [f"{what}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                for what, names in (("missing", result.missing_keys), ("unexpected", result.unexpected_keys)) if names]
    if problems:
        raise HiltError(f"{path} does not fit {spec}: " + "; ".join(problems))


def load_data(spec=None, limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs as float32, labels as int64). ``spec``: None or ``fashion-mnist`` (its test split), or
    a ``.safetensors`` / ``.npz`` file holding ``inputs`` (the model's input, one row per example)
    and ``labels`` (class indices)."""
    if spec is None or spec == "fashion-mnist":
        from hilt.data.fashion_mnist import load_fashion_mnist

        return load_fashion_mnist("test", limit=limit)
    path = Path(spec)
    if not path.is_file():
        raise HiltError(f"{path}: no such data file")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            arrays = load_file(path)
        except (SafetensorError, OSError) as e:
            raise HiltError(f"{path}: not a readable safetensors file ({one_line(e)})") from e
    elif path.suffix == ".npz":
        import zipfile

        import numpy as np

        try:
            with np.load(path, allow_pickle=False) as npz:
                arrays = {k: torch.from_numpy(npz[k]) for k in npz.files if k in DATA_KEYS}
        except ValueError as e:  # object arrays would need pickle
            raise HiltError(f"{path}: cannot read it without pickle ({one_line(e)})") from e
        except (OSError, EOFError, zipfile.BadZipFile) as e:
            raise HiltError(f"{path}: not a readable .npz file ({one_line(e)})") from e
    else:
        raise HiltError(f"{path}: data files are .safetensors or .npz, with tensors `inputs` and `labels`")
    missing = [k for k in DATA_KEYS if k not in arrays]
    if missing:
        raise HiltError(f"{path}: no tensor named {' or '.join(missing)} (a data file holds `inputs` and `labels`)")
    inputs, labels = arrays["inputs"], arrays["labels"]
    if labels.dim() != 1 or labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise HiltError(f"{path}: `labels` must be a 1-D array of integer class indices, got {labels.dtype} "
                        f"of shape {tuple(labels.shape)}")
    if inputs.dim() < 2 or len(inputs) != len(labels) or len(labels) == 0:
        raise HiltError(f"{path}: `inputs` {tuple(inputs.shape)} and `labels` {tuple(labels.shape)} must have the "
                        "same number of rows, at least one")
    inputs = inputs.float()
    if not torch.isfinite(inputs).all():
        raise HiltError(f"{path}: `inputs` contains NaN or Inf")
    return (inputs[:limit], labels[:limit].long()) if limit else (inputs, labels.long())
