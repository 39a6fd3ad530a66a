"""Model-level API: convert a model's layers to analog, program chips, let them drift, evaluate.

Many chips at once: ``program(model, seeds=[s0, s1, ...])`` draws one chip per seed; every analog
layer then holds all of them (a leading chip dimension), ``drift_to`` reads them all, and one
forward evaluates every chip on the same batch (``evaluate`` returns one accuracy per chip).
Chip k equals a one-chip model programmed with ``seed=s_k`` and read with the same read seed.

Drift compensation (``gdc``), computed per layer from a fixed probe input:

* ``global``: after programming, the mean |y| of the probe through the noisy
  layer is the reference; after drift the digital output is scaled by
  reference / current mean |y| (one number per layer), as aihwkit does;
* ``column``: the same per output column;
* ``exact``: the reference is the *ideal* digital layer's mean |y| (what a
  perfect calibration would restore), one number per layer;
* ``aihwkit``: as aihwkit's GlobalDriftCompensation reads out: one number per array, the
  mean |y| of the identity (one input at a time) through the array's full noisy forward,
  against the same read of the programmed weights (before drift and read noise);
* ``none``.
"""

from __future__ import annotations

import contextlib
import copy
import math
import re

import torch
from torch import nn

from hilt.cim_sim.analog import AnalogConv1d, AnalogConv2d, AnalogLinear, AnalogMixin, ChipForward
from hilt.cim_sim.config import AnalogConfig, preset
from hilt.errors import HiltError
from hilt.quant.compensate import trim_heap
from hilt.quant.nn import replace_modules

GDC_MODES = ("global", "column", "exact", "aihwkit", "none")
_UNITS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800, "mo": 2629800, "y": 31557600}


def parse_time(text: str) -> float:
    """'1s', '1h', '1d', '1mo', '1y', '3600' -> seconds. Negative or unparsable: HiltError."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if m and m.group(2) == "M":
        raise HiltError(f"cannot read time {text!r}: M is ambiguous; write 1mo for a month, 1min for a minute")
    if not m or m.group(2).lower() not in ("", *_UNITS):
        raise HiltError(f"cannot read time {text!r}: use a number of seconds or e.g. 1s, 1h, 1d, 1mo, 1y")
    return float(m.group(1)) * _UNITS.get(m.group(2).lower() or "s", 1)


def analog_layers(model: nn.Module) -> list[tuple[str, AnalogMixin]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, AnalogMixin)]


def convert_to_analog(model: nn.Module, config: AnalogConfig | str, inplace: bool = False, lm_head: bool = False,
                      layers: str | None = None) -> nn.Module:
    """Replace every nn.Linear, nn.Conv1d and nn.Conv2d by its analog counterpart (on a copy unless ``inplace``).
    ``config``: an AnalogConfig or a preset's name.

    Other layers stay digital; ``model.digital_layers`` lists them. The copy is
    programmed once with seed 0; call :func:`program` to draw another chip.

    Language models: embeddings, norms and the attention products (softmax, QK^T, AV) are no
    Linear and stay digital; a Linear named ``lm_head`` (a transformers model's output layer) stays
    digital too unless ``lm_head``. ``layers``: a regular expression; only the Linear/Conv layers
    whose path it matches (re.search) go analog, the others stay digital (listed with the rest).
    """
    if isinstance(config, str):
        config = preset(config)
    if not isinstance(config, AnalogConfig):
        raise HiltError(f"convert_to_analog takes an AnalogConfig or a preset's name, not {type(config).__name__}")
    config.device_model()  # validates the device name
    model = model if inplace else copy.deepcopy(model)
    digital = []

    pattern = None if layers is None else re.compile(layers)

    def analog(name, module):
        if any(name.startswith(f"{d}.") for d in digital):
            return None  # inside a layer kept digital whole
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)) and name and (
                (not lm_head and name.rsplit(".", 1)[-1] == "lm_head") or (pattern and not pattern.search(name))):
            digital.append(name)
            return None
        if isinstance(module, nn.MultiheadAttention):
            digital.append(name)  # it reads its projections' weights itself, so they stay digital with it
            return None
        for digital_type, analog_type in ((nn.Linear, AnalogLinear), (nn.Conv2d, AnalogConv2d), (nn.Conv1d, AnalogConv1d)):
            if isinstance(module, digital_type):
                try:
                    return analog_type(module, config)
                except HiltError as e:
                    raise HiltError(f"layer {name or type(module).__name__}: {e}") from None
        if name and not list(module.children()) and any(True for _ in module.parameters(recurse=False)):
            digital.append(name)
        return None

    single = analog("", model)  # a bare layer becomes its analog counterpart
    if single is not None:
        model = single
    elif replace_modules(model, analog) == 0:
        raise HiltError("the model has no Linear, Conv1d or Conv2d layer to put on analog hardware")
    model.digital_layers = digital
    model.eval()
    program(model, seed=0)
    return model


def gdc_probe_input(layer: AnalogMixin, gen: torch.Generator) -> torch.Tensor:
    """A fixed random input batch for drift compensation: 32 rows, uniform in [-1, 1] on about
    64 inputs per row, zero elsewhere. Sparse so that the arrays' outputs stay inside the ADC
    range: a dense probe on a wide layer saturates the ADC and costs bound-management retries."""
    n_in = layer.w_digital.shape[1]
    values = torch.rand(32, n_in, generator=gen) * 2 - 1
    return values * (torch.rand(32, n_in, generator=gen) < 64 / n_in)


def _seeds(seed: int, seeds, what: str) -> list[int]:
    if seeds is None:
        return [int(seed)]
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise HiltError(f"{what}: seeds must name at least one chip")
    return seeds


def _require_analog(model: nn.Module, what: str) -> None:
    if not analog_layers(model):
        raise HiltError(f"{what}: the model has no analog layer; convert it with convert_to_analog first")


def _record_batch(model: nn.Module, args, kwargs) -> None:
    """Forward pre-hook: tell every analog layer the model's batch size, so that a layer holding
    several chips knows a shared batch from one stacked per chip."""
    x = next((a for a in (*args, *kwargs.values()) if torch.is_tensor(a)), None)
    forward = None if x is None or x.dim() == 0 else ChipForward(x.shape[0])
    chips = getattr(model, "chips", 1)
    if forward is not None and getattr(model, "inputs_stacked", False) and chips > 1:
        if x.shape[0] % chips:
            raise HiltError(f"stacked_chips: the model's input has {x.shape[0]} rows, not a multiple of its {chips} chips")
        forward = ChipForward(x.shape[0] // chips)
        forward.stacked = True  # every analog layer's input is one batch per chip, chip-major
    for _, layer in analog_layers(model):
        layer.chip_forward = forward


@contextlib.contextmanager
def stacked_chips(model: nn.Module):
    """Within: the model's inputs hold one batch per chip, chip-major (chips x batch rows), from its
    first layer on. For models that cannot broadcast a shared batch against per-chip activations
    (a residual stream, an attention mask, reshapes by the input's batch size: language models):
    feed ``x.repeat(chips, ...)`` and read chip k's outputs from rows k*batch:(k+1)*batch."""
    before = getattr(model, "inputs_stacked", False)
    model.inputs_stacked = True
    try:
        yield model
    finally:
        model.inputs_stacked = before


@torch.no_grad()
def calibrate_inputs(model: nn.Module, run, percentile: float | None = None) -> dict:
    """Calibrate what the analog layers' configurations ask for from the inputs they see: ``run(model)``
    drives calibration forwards (one chip's worth of inputs, not stacked) while every analog layer
    computes digitally and records its inputs. Then, per layer:

    - ``smoothing``: each input channel's abs-max sets its scale (``AnalogMixin.smooth_inputs``);
    - ``input_range="static"``: each array's range is the ``percentile``-th percentile (default the
      layer config's input_percentile) of |x| over its inputs, after the smoothing division.

    Program the chips after it (the arrays' weights and the drift-compensation references depend on
    it). Returns {layer path: {"input_ranges": [per array], "smoothing": [min, median, max scale]}}
    with what was calibrated."""
    _require_analog(model, "calibrate_inputs")
    seen, hooks = {}, []
    layers = analog_layers(model)
    for name, layer in layers:
        layer.calibrating = True
        hooks.append(layer.register_forward_pre_hook(
            lambda mod, args, name=name: seen.setdefault(name, []).append(args[0].detach().reshape(-1, args[0].shape[-1]).float())))
    try:
        run(model)
    finally:
        for h in hooks:
            h.remove()
        for _, layer in layers:
            layer.calibrating = False
    report = {}
    for name, layer in layers:
        if name not in seen:
            raise HiltError(f"calibrate_inputs: layer {name} saw no input in the calibration run")
        x = torch.cat(seen.pop(name)).abs()
        entry = report.setdefault(name, {})
        if layer.config.smoothing:
            s = layer.smooth_inputs(x.amax(0))
            x = x / s
            entry["smoothing"] = [float(s.min()), float(s.median()), float(s.max())]
        if layer.config.input_range == "static":
            p = layer.config.input_percentile if percentile is None else percentile
            layer.input_ranges = {}
            for k0, k1 in layer.tile_bounds():
                flat = x[:, k0:k1].reshape(-1)
                k = max(1, min(flat.numel(), math.ceil(p / 100 * flat.numel())))
                layer.input_ranges[k0] = max(float(flat.kthvalue(k).values), 1e-12)
            entry["input_ranges"] = list(layer.input_ranges.values())
    return report


def needs_calibration(model: nn.Module) -> bool:
    """Whether an analog layer's configuration asks for calibrate_inputs (static ranges or smoothing)."""
    return any(layer.config.needs_calibration for _, layer in analog_layers(model))


def chip_memory(model: nn.Module) -> dict:
    """Bytes the simulator holds per programmed chip: the devices (their programmed conductances) and
    the weights as read (float, and the arrays' int8 codes)."""
    chips = getattr(model, "chips", 1)
    devices = sum(pool["g"].numel() * pool["g"].element_size() for pool in getattr(model, "device_pools", [])) // chips
    weights = sum(layer.w_digital.numel() for _, layer in analog_layers(model))
    return {"device_bytes": devices, "weight_bytes": weights * (4 + 2), "analog_weights": weights,
            "bytes_per_chip": devices + weights * 6}


def clipped_share(model: nn.Module) -> float:
    """The share of all analog weights that the mapping's clipping (clip_std / clip_percentile) changed."""
    layers = [layer for _, layer in analog_layers(model)]
    n = sum(layer.w_digital.numel() for layer in layers)
    return sum(layer.clipped_share * layer.w_digital.numel() for layer in layers) / max(n, 1)


@torch.no_grad()
def program(model: nn.Module, seed: int = 0, seeds=None) -> nn.Module:
    """Program every analog layer: a new chip (programming noise and drift exponents drawn), or
    one chip per entry of ``seeds``, all held at once (``model.chips``)."""
    seeds = _seeds(seed, seeds, "program")
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    chips = len(seeds)
    _require_analog(model, "program")
    # every device of a chip in one flat pool per device model: a read is one pass over all of them. Each
    # layer's devices go into their place as it is programmed, so a chip is never held twice (nor the chips
    # programmed before: they go first).
    model.device_pools = []
    pools, places = {}, {}
    for name, layer in analog_layers(model):
        layer.path = name
        if layer.device_model is not None:
            pool = pools.setdefault(layer.device_model, {"device": layer.device_model, "layers": [], "size": 0})
            n = layer.config.devices_per_weight * layer.w_digital.numel()
            places[name] = slice(pool["size"], pool["size"] + n)
            pool["layers"].append(layer)
            pool["size"] += n
    for pool in pools.values():
        pool["g"] = torch.empty(chips, 2, pool["size"], dtype=pool["layers"][0].w_digital.dtype)
    for name, layer in analog_layers(model):
        if layer.device_model is None:
            layer.program(gens)
            continue
        layer.program(gens, out=pools[layer.device_model]["g"][:, :, places[name]])
    model.device_pools = [{k: v for k, v in pool.items() if k != "size"} for pool in pools.values()]
    trim_heap()  # what programming freed, glibc would keep resident (2 SmolLM2 chips: 9.0 -> 7.1 GB peak)
    model.chips = chips
    if not hasattr(model, "_chip_batch_hook"):
        model._chip_batch_hook = model.register_forward_pre_hook(_record_batch, with_kwargs=True)
    _set_programmed(model)
    for _, layer in analog_layers(model):
        layer.tile_scale = None
        layer.array_ref = layer.array_readout()  # gdc="aihwkit": its baseline, from the programmed weights
    _read(model, 0.0, gens)
    for _, layer in analog_layers(model):
        layer.gdc_scale = torch.ones(layer.w_digital.shape[0]) if chips == 1 else torch.ones(chips, layer.w_digital.shape[0])
        probes = [gdc_probe_input(layer, torch.Generator().manual_seed(s)) for s in seeds]
        layer.gdc_probe = probes[0] if chips == 1 else torch.stack(probes)
        layer.gdc_ref_noisy = layer.mvm(layer.gdc_probe).abs().mean(-2)  # (chips, out)
        layer.gdc_ref_ideal = (layer.gdc_probe @ layer.w_digital.T).abs().mean(-2).view(chips, -1)
    return model


def _set_programmed(model: nn.Module) -> None:
    """Every analog layer's weights as programmed (no drift, no read noise): with several devices per weight,
    the mean of its pairs (their summed currents, read out divided by their number)."""
    for pool in getattr(model, "device_pools", []):
        g, chips = pool["g"], pool["g"].shape[0]
        for layer, offset, n in _pool_places(pool):
            pairs = g[:, 0, offset : offset + n] - g[:, 1, offset : offset + n]
            w = pairs.view(chips, layer.config.devices_per_weight, -1).mean(1)
            layer.set_weights(w.view(layer.w_digital.shape) if chips == 1 else w.view(chips, *layer.w_digital.shape))


def _pool_places(pool: dict):
    """(layer, first device, devices per side) of each layer in its pool, in the pool's order."""
    offset = 0
    for layer in pool["layers"]:
        n = layer.config.devices_per_weight * layer.w_digital.numel()
        yield layer, offset, n
        offset += n


def _read(model: nn.Module, t: float, gens: list[torch.Generator]) -> None:
    """Set every analog layer's weights to its devices read t seconds after programming, chip k
    with generator k: one stream of read-noise draws over the chip's pool, a layer at a time."""
    for pool in getattr(model, "device_pools", []):
        size = pool["g"].shape[-1]
        keys = [pool["device"].read_keys(gen) for gen in gens]
        for layer, offset, n in _pool_places(pool):
            start = torch.tensor([offset, size + offset], dtype=torch.int32)  # G+ then G- in the stream
            w = torch.empty(len(gens), *layer.w_digital.shape, dtype=pool["g"].dtype)
            for k in range(len(gens)):
                w[k] = layer.read_pairs(pool["g"][k, :, offset : offset + n], k, t, keys[k], start)
            layer.set_weights(w[0] if len(gens) == 1 else w)
    trim_heap()


@torch.no_grad()
def drift_to(model: nn.Module, t_seconds: float, seed: int = 1, gdc: str = "global", seeds=None) -> nn.Module:
    """Read every analog layer ``t_seconds`` after programming (fresh read noise), then compensate.

    With K chips, ``seeds`` gives each chip its read seed (default: chip k reads with seed + k).
    The read seed also seeds the forward noise that follows, so a chip's outputs depend on its
    programming seed, its read seed and its inputs only."""
    if gdc not in GDC_MODES:
        raise HiltError(f"unknown drift compensation {gdc!r}; choose one of {', '.join(GDC_MODES)}")
    if not t_seconds >= 0:
        raise HiltError(f"time after programming must be >= 0 s, got {t_seconds}")
    _require_analog(model, "drift_to")
    chips = getattr(model, "chips", 1)
    seeds = [seed + k for k in range(chips)] if seeds is None else _seeds(seed, seeds, "drift_to")
    if len(seeds) != chips:
        raise HiltError(f"drift_to: {len(seeds)} read seeds for a model holding {chips} chips")
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    _read(model, float(t_seconds), gens)
    for _, layer in analog_layers(model):
        # the forward noise from here on follows from the read seed, not from what ran before
        layer.gens = [torch.Generator().manual_seed(int(torch.randint(2**62, (1,), generator=g))) for g in gens]
    for _, layer in analog_layers(model):
        scale = torch.ones(chips, layer.w_digital.shape[0])
        layer.tile_scale = layer.array_ref / layer.array_readout() if gdc == "aihwkit" else None
        if gdc not in ("none", "aihwkit"):
            now = layer.mvm(layer.gdc_probe).abs().mean(-2)  # (chips, out)
            if gdc == "column":
                scale = layer.gdc_ref_noisy / now.clamp_min(1e-12)
            else:
                ref = layer.gdc_ref_ideal if gdc == "exact" else layer.gdc_ref_noisy
                scale = (ref.sum(-1, keepdim=True) / now.sum(-1, keepdim=True).clamp_min(1e-12)).expand_as(now).clone()
        layer.gdc_scale = scale[0] if chips == 1 else scale
    return model


@torch.no_grad()
def evaluate(model: nn.Module, data, batch_size: int | None = None) -> torch.Tensor:
    """Accuracy of every chip the model holds on ``data = (inputs, labels)`` (labels: class
    indices): a tensor of K accuracies. One forward per batch evaluates all K chips on it.

    ``batch_size``: inputs per forward (default 1000 / K, at least 1); chip k's accuracy equals a
    one-chip model's with the same seeds and the same batch size (the noise draws follow the batches).
    A digital model counts as one chip.
    """
    inputs, labels = data
    if not (torch.is_tensor(inputs) and torch.is_tensor(labels)):
        raise HiltError(f"evaluate takes torch tensors (inputs, labels), got {type(inputs).__name__} and "
                        f"{type(labels).__name__}")
    n = len(labels)
    if n == 0 or len(inputs) != n:
        raise HiltError(f"evaluate needs as many inputs as labels, at least one (got {len(inputs)} and {n})")
    if labels.dim() != 1 or labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise HiltError(f"evaluate needs labels as a 1-D tensor of class indices, got {labels.dtype} of shape "
                        f"{tuple(labels.shape)}")
    chips = getattr(model, "chips", 1)
    batch_size = max(1, 1000 // chips) if batch_size is None else batch_size
    if batch_size < 1:
        raise HiltError(f"batch size must be at least 1, got {batch_size}")
    was_training = model.training
    model.eval()
    correct = torch.zeros(chips, dtype=torch.long)
    try:
        with torch.no_grad():  # as program and drift_to: the compiled passes see one kind of tensor
            for i in range(0, n, batch_size):
                x, y = inputs[i : i + batch_size], labels[i : i + batch_size]
                try:
                    out = model(x)
                except RuntimeError as e:
                    if i:
                        raise
                    reason = (str(e).strip().splitlines() or [""])[0]
                    if chips > 1:
                        reason += (f" (with {chips} chips each analog layer returns {chips} batches stacked on the "
                                   "first dimension: a model that reshapes to its input's batch size instead of -1 "
                                   "runs one chip at a time only)")
                    raise HiltError(f"inputs of shape {tuple(inputs.shape[1:])} do not fit the model: {reason}") from e
                if out.dim() != 2 or out.shape[0] != chips * len(y):
                    raise HiltError(f"the model returned shape {tuple(out.shape)} for {len(y)} inputs on {chips} "
                                    f"chip(s); evaluate needs ({chips} x {len(y)}, classes) logits")
                if i == 0 and not (0 <= int(labels.min()) and int(labels.max()) < out.shape[-1]):
                    raise HiltError(f"labels run from {int(labels.min())} to {int(labels.max())}, but the model has "
                                    f"{out.shape[-1]} outputs: labels must be class indices 0 to {out.shape[-1] - 1}")
                correct += (out.view(chips, len(y), -1).argmax(-1) == y).sum(1)
    finally:
        model.train(was_training)
    return correct.double() / n
