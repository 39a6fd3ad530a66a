"""A fine-tune's resumable state: the model's weights, the AdamW moments, the step and the settings,
as safetensors + JSON in one folder (never pickle), replaced whole so an interruption leaves the
previous state intact. `hilt qat` and `hilt hwa` keep theirs beside their output."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from hilt.atomic import replacing, save_safetensors, write_json
from hilt.errors import HiltError


def save_state(path: Path, model, opt, step: int, settings: dict) -> None:
    tensors = {f"model.{n}": t.detach().contiguous().clone() for n, t in model.state_dict().items()}
    opt_state = opt.state_dict()
    for i, st in opt_state["state"].items():
        for key, value in st.items():
            tensors[f"opt.{i}.{key}"] = torch.as_tensor(value).contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:  # the previous state stays whole until the new one is complete
        tmp.mkdir()
        save_safetensors(tensors, tmp / "state.safetensors")
        write_json(tmp / "state.json", {"step": step, "settings": settings, "param_groups": opt_state["param_groups"]})


def claim_state(path: Path, resume: bool, overwrite: bool) -> None:
    """A run that saves its state at ``path`` neither continues nor overwrites an interrupted run's state unasked:
    ``overwrite`` (without ``resume``) removes it, ``resume`` keeps it, and neither refuses, naming both."""
    if overwrite and not resume:
        shutil.rmtree(path, ignore_errors=True)
    elif not resume and (path / "state.json").is_file():
        raise HiltError(f"{path}: an interrupted run's state is here; pass --resume to continue it or --overwrite "
                        "to start again")


def state_meta(path: Path, settings: dict) -> dict:
    """The interrupted run's step and optimizer groups; refuses other settings (before any model loads)."""
    if not (path / "state.json").is_file():
        raise HiltError(f"nothing to resume: {path} does not exist")
    meta = json.loads((path / "state.json").read_text())
    if meta["settings"] != json.loads(json.dumps(settings)):
        raise HiltError(f"{path}: the interrupted run used other settings ({meta['settings']}); "
                        f"rerun with them or pass --overwrite")
    return meta


def load_state(path: Path, meta: dict, model, opt) -> int:
    tensors = load_file(path / "state.safetensors")
    model.load_state_dict({n[len("model."):]: t for n, t in tensors.items() if n.startswith("model.")})
    state: dict = {}
    for name, t in tensors.items():
        if name.startswith("opt."):
            _, i, key = name.split(".", 2)
            state.setdefault(int(i), {})[key] = t
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    return meta["step"]
