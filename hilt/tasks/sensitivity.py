"""`hilt sensitivity`: per-layer TPV (hilt.quant.sensitivity) on the models hilt runs, from
calibration data that the evaluations never use.

- SmolLM2 (or a Llama GGUF): windows of 512 tokens of Macbeth; outputs are the next-token logits
  in the softmax (Fisher) metric, so TPV / 2 predicts the mean KL divergence per token.
- MiniLM (or a BERT folder): Macbeth sentences; outputs are the unit-norm sentence embeddings,
  so TPV / 2 predicts 1 - cosine similarity.
- The Fashion-MNIST workloads (mlp, cnn): training images; outputs are the class logits in the
  softmax metric, so TPV / 2 predicts the mean KL divergence of the class distribution per image
  (a shift common to all logits changes no decision, and this metric does not count it).

The evaluations use Hamlet and the test images.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from hilt.errors import HiltError
from hilt.progress import LOG, Progress
from hilt.quant.sensitivity import (Variance, estimate_output_tpv, estimate_tpv, format_label, parse_candidates,
                                    quantization_variance, resolve, weight_params)

WORKLOAD_NAMES = ("mlp", "cnn")
# k-means where learned levels pay most (1-4 bits; above, its optimal fit costs more than it gains), integers to 8
DEFAULT_CANDIDATES = {"lm": "kmeans1-4,int2-8", "workload": "kmeans1-4@row,int2-8@row"}
PREDICTS = {"llama": "mean KL divergence of the next-token distribution per token (TPV / 2)",
            "causal": "mean KL divergence of the next-token distribution per token (TPV / 2)",
            "bert": "1 - cosine similarity of the sentence embeddings (TPV / 2)",
            "workload": "mean KL divergence of the predicted class distribution per image (TPV / 2)"}


@dataclass
class Subject:
    """A model with what its sensitivity needs: calibration batches, the output, its metric, and the
    weights to measure (name -> parameter, names as the model's checkpoint names them)."""

    kind: str  # llama (hilt's own forward) | causal (any other causal LM, through transformers) | bert | workload
    model: nn.Module
    batches: list
    output: Callable
    metric: str
    params: dict
    calibration: str
    path: str
    tokenizer: object = None
    unused: dict = field(default_factory=dict)  # tensors `hilt quantize` takes that the outputs never use


def _bert_output(model, ids, mask):
    hidden = model(ids, mask)
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=-1)


def _llama_output(model, ids):
    return model(ids)[:, :-1]  # the last position predicts past the window


def _text_model_kind(src: Path) -> str:
    """'causal' for any causal language model (hilt.models.lm), 'bert' for a BERT folder (or a file in one);
    otherwise the real problem, read before any weights: no config.json, one that is not JSON, another model_type."""
    from hilt.models.lm import is_language_model
    from hilt.quant.hf_folder import CONFIG, read_config

    if is_language_model(src):
        return "causal"
    folder = src if src.is_dir() else src.parent
    runs = "hilt sensitivity runs mlp, cnn, a causal language model (a GGUF file or folder) or a BERT folder"
    if not (folder / CONFIG).is_file():
        raise HiltError(f"{src}: no {CONFIG} beside the weights, so not a BERT folder ({runs})")
    model_type = read_config(folder).get("model_type")
    if model_type != "bert":
        raise HiltError(f"{folder / CONFIG}: model_type {model_type!r}, not 'bert' ({runs})")
    return "bert"


def load_subject(model: str, checkpoint=None, calibration=None, tokens: int = 2048, sentences: int = 256,
                 images: int = 2048) -> Subject:
    """``model``: smollm2, gemma3, minilm, mlp, cnn, any causal LM hilt.models.lm loads or a BERT folder."""
    from hilt.tasks.compensate import bert_batches, llama_batches
    from hilt.quant.targets import select_targets
    from hilt.quant.sources import open_source

    if model in WORKLOAD_NAMES:
        if calibration is not None:
            raise HiltError("--calibration (a text file) applies to the text models; mlp and cnn calibrate on "
                            "Fashion-MNIST training images (--images)")
        from hilt.data.fashion_mnist import load_fashion_mnist
        from hilt.tasks.train import workload_model

        net, path = workload_model(model, checkpoint)
        x, _ = load_fashion_mnist("train", limit=images)
        batches = [(x[i:i + 64],) for i in range(0, x.shape[0], 64)]  # more, smaller samples
        return Subject("workload", net.eval(), batches, lambda m, a: m(a), "softmax", weight_params(net),
                       f"{x.shape[0]} Fashion-MNIST training images", str(path))
    if checkpoint is not None:
        raise HiltError("--checkpoint applies to the workloads (mlp, cnn) only")
    if model in ("smollm2", "gemma3"):
        from hilt.models.lm import lm_source
        src = lm_source(model).path
    elif model == "minilm":
        from hilt.models.bert import minilm_path
        src = minilm_path()
    else:
        src = Path(model)
        if not src.exists():
            raise HiltError(f"{model}: no such file or folder (models: smollm2, gemma3, minilm, mlp, cnn, a GGUF "
                            "file, a causal-LM or BERT folder)")
    kind = _text_model_kind(src)
    with open_source(src) as source:
        targets = select_targets(source)
    if kind == "causal":
        from hilt.models.lm import load_lm

        lm = load_lm(src)
        net, tokenizer = lm.model, lm.tokenizer
        windows, seen = llama_batches(lm, calibration, tokens)
        batches = [(w[i:i + 1],) for w in (b[0] for b in windows) for i in range(w.shape[0])]  # a window a pass
        if lm.own:
            kind, output = "llama", _llama_output
        else:
            output = lambda m, ids: lm.logits(ids, m)[:, :-1]  # noqa: E731
        metric = "softmax"
    else:
        from hilt.models import bert

        net, tokenizer = bert.load_minilm(src)
        batches, seen = bert_batches(tokenizer, calibration, sentences)
        output, metric = _bert_output, "euclidean"
    own = dict(net.named_parameters())
    params = {n: own[n] for n in targets if n in own}
    if kind == "causal" and not params:  # a GGUF read by transformers: its names are not the file's
        params = {f"{n}.weight": m.weight for n, m in lm.linear_layers().items()}
        targets = list(params)
    unused = {}
    if len(params) < len(targets):  # e.g. MiniLM's pooler: in the file, not in the sentence embedding
        with open_source(src) as source:
            unused = {n: source.get(n) for n in targets if n not in own}
    return Subject(kind, net, batches, output, metric, params, seen, str(src), tokenizer, unused)


def candidate_variances(subject: Subject, candidates, progress: bool = False, keep_error: bool = False
                        ) -> dict[str, dict[str, Variance]]:
    """Each measured weight quantized in each candidate format it can take: the per-block error."""
    out: dict[str, dict[str, Variance]] = {}
    tensors = {**subject.params, **subject.unused}
    bar = Progress(len(tensors), "quantize candidates", "tensor", enabled=progress)
    with bar, torch.no_grad():
        for name, w in tensors.items():
            out[name] = {}
            for c in candidates:
                fitted = resolve(c, w.shape)
                if fitted is not None:
                    out[name][format_label(c)] = quantization_variance(w, fitted, name, keep_error)
            bar.done(name, f"{len(out[name])} formats")
    return out


def cim_variances(subject: Subject, preset_name: str, time_text: str, chips: int = 8, gdc: str = "global",
                  seed: int = 0) -> tuple[str, dict[str, dict[str, Variance]], nn.Module]:
    """The weight errors a CIM chip makes ``time_text`` after programming: each layer programmed on
    ``chips`` chips of ``preset_name``, drifted, read and compensated (``gdc``), against the digital
    weights. Per weight the variance over the chips (block 1), and every chip's error; and the
    chips themselves (the converted model)."""
    from hilt.cim_sim import analog_layers, convert_to_analog, drift_to, parse_time, preset, program

    if subject.kind != "workload":
        raise HiltError("--preset (a CIM chip) applies to the Fashion-MNIST workloads (mlp, cnn)")
    if chips < 2:
        raise HiltError(f"--chips must be at least 2 (the variance is over chips), got {chips}")
    t = parse_time(time_text)
    analog = convert_to_analog(subject.model, preset(preset_name))
    program(analog, seeds=[seed + k for k in range(chips)])
    drift_to(analog, t, seeds=[10_000 + seed + k for k in range(chips)], gdc=gdc)
    label = f"{preset_name}@{time_text}"
    out = {}
    for path, layer in analog_layers(analog):
        name = f"{path}.weight"
        if name not in subject.params:
            continue
        w = layer.w_digital.reshape(layer.w_digital.shape[0], -1)
        w_eff = layer.held_weights().reshape(chips, *w.shape) * layer.gdc_scale.reshape(chips, -1, 1)
        e = w_eff - w
        out[name] = {label: Variance(e.square().mean(0), 1, None, None, e.half())}
    return label, out, analog


def _chip_layers(subject: Subject, analog: nn.Module) -> tuple[dict, dict]:
    """The digital layers and, for each, its analog twin as a function of the layer's input (all chips)."""
    from hilt.cim_sim import analog_layers
    from hilt.cim_sim.analog import ChipForward

    twins = dict(analog_layers(analog))
    layers = {n.removesuffix(".weight"): subject.model.get_submodule(n.removesuffix(".weight")) for n in subject.params}

    def run(layer):
        def forward(x):
            layer.chip_forward = ChipForward(x.shape[0])  # x is the layer's input, shared by its chips
            return layer(x)
        return forward
    return layers, {p: run(twins[p]) for p in layers}


def sensitivity_run(model="smollm2", checkpoint=None, candidates=None, block_size: int = 64, probes: int = 2,
                    calibration=None, tokens: int = 2048, sentences: int = 256, images: int = 2048, seed: int = 0,
                    progress: bool = False, subject: Subject | None = None, full: bool = False,
                    cim: dict | None = None) -> dict:
    """Tr(H_eff) per layer and the predicted output change of every candidate format per layer, or
    with ``cim`` (keyword arguments of :func:`cim_variances`: preset_name, time_text, chips, gdc) of
    the chip's weight errors instead."""
    if probes < 1:
        raise HiltError(f"--probes must be at least 1, got {probes}")
    subject = subject or load_subject(model, checkpoint, calibration, tokens, sentences, images)
    if not subject.params:
        raise HiltError(f"{subject.path}: no quantizable layer (no Linear or convolution weight) to measure")
    t0 = time.perf_counter()
    if cim is not None:
        if candidates is not None:
            raise HiltError("--candidates (quantization formats) and --preset (a CIM chip) exclude each other")
        label, variances, analog = cim_variances(subject, seed=seed, **cim)
        labels = [label]
    else:
        spec = candidates or DEFAULT_CANDIDATES["workload" if subject.kind == "workload" else "lm"]
        formats = parse_candidates(spec, block_size)
        variances = candidate_variances(subject, formats, progress, keep_error=full)
        labels = [format_label(c) for c in formats]
    t1 = time.perf_counter()
    total = len(subject.batches) * probes
    bar = Progress(total, "sensitivity", "probe", enabled=progress)
    used = {n: v for n, v in variances.items() if n in subject.params}
    with bar:
        layers = estimate_tpv(subject.model, subject.batches, subject.params, used, output=subject.output,
                              metric=subject.metric, probes=probes, seed=seed,
                              on_sample=lambda i: bar.done(f"probe {i}"))
    chip = {}
    if cim is not None:  # the whole analog layer: weights, converters and output noise at its output
        digital_layers, twins = _chip_layers(subject, analog)
        chip = estimate_output_tpv(subject.model, subject.batches, digital_layers, twins, output=subject.output,
                                   metric=subject.metric, probes=probes, seed=seed)
    t2 = time.perf_counter()
    rows = []
    for name, layer in layers.items():
        row = layer.as_dict()
        if chip:
            mean, se = chip[name.removesuffix(".weight")]
            row["tpv_chip"], row["tpv_chip_se"] = {labels[0]: mean}, {labels[0]: se}
        row["bits"] = {label: v.bits for label, v in variances[name].items() if v.bits is not None}
        row["rel_error"] = {label: round(v.rel_error, 6) for label, v in variances[name].items()
                            if v.rel_error is not None}
        rows.append(row)
    for name, w in subject.unused.items():  # the outputs do not depend on it: every format costs nothing
        zero = {label: 0.0 for label in variances[name]}
        rows.append({"name": name, "shape": list(w.shape), "weights": w.numel(), "trace": 0.0, "trace_se": 0.0,
                     "samples": total, "unused": True, "tpv": zero, "tpv_se": zero, "tpv_full": zero,
                     "tpv_full_se": zero, "bits": {label: v.bits for label, v in variances[name].items()},
                     "rel_error": {label: round(v.rel_error, 6) for label, v in variances[name].items()}})
    return {
        "model": subject.path, "kind": subject.kind, "metric": subject.metric,
        "predicts": PREDICTS[subject.kind], "calibration": subject.calibration, "probes": probes,
        "samples": total, "seed": seed, "candidates": labels, **({"cim": cim} if cim else {}),
        "seconds": {"candidates": round(t1 - t0, 2), "probes": round(t2 - t1, 2)}, "layers": rows,
    }


def read_sensitivity(path) -> dict:
    """A `hilt sensitivity --json` file, checked."""
    path = Path(path)
    try:
        result = json.loads(path.read_text())
    except OSError as e:
        raise HiltError(f"{path}: cannot read ({e.strerror or e})") from None
    except ValueError as e:
        raise HiltError(f"{path}: not JSON ({e})") from None
    if not isinstance(result, dict) or not isinstance(result.get("layers"), list) or \
            any(not {"name", "tpv", "bits"} <= set(r) for r in result["layers"]):
        raise HiltError(f"{path}: not a `hilt sensitivity --json` file (no per-layer tpv and bits)")
    return result


def plot(result: dict, path) -> None:
    """Per-layer trace of H_eff (with its standard error) and the TPV of a few formats, log scale."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["layers"] if not r.get("unused")]
    x = range(len(rows))
    fig, (a, b) = plt.subplots(2, 1, figsize=(max(7, len(rows) * 0.06 + 4), 7), sharex=True)
    a.errorbar(x, [r["trace"] for r in rows], yerr=[r["trace_se"] if math.isfinite(r["trace_se"]) else 0
                                                      for r in rows], fmt="o", ms=3, capsize=2)
    a.set_yscale("log")
    a.set_ylabel("Tr(H_eff) per example")
    a.set_title(f"TPV sensitivity of {Path(result['model']).name} ({result['samples']} probe samples)")
    shown = [c for c in result["candidates"] if all(c in r["tpv"] for r in rows)][:: max(1, len(result["candidates"]) // 5)]
    for c in shown:
        b.plot(x, [max(r["tpv"][c], 1e-30) for r in rows], marker=".", label=c)
    b.set_yscale("log")
    b.set_ylabel("predicted output change (TPV)")
    b.legend(fontsize=7, ncol=3)
    if len(rows) <= 40:
        b.set_xticks(list(x), [r["name"].removesuffix(".weight") for r in rows], rotation=90, fontsize=6)
    else:
        b.set_xlabel("layer (checkpoint order)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _check_reachable(budget: float, formats, shapes: dict, src) -> None:
    """Refuse a budget outside [all tensors at their smallest candidate, all at their largest]."""
    from hilt.quant.quantize import expected_bits_per_weight

    lo = hi = 0.0
    for name, shape in shapes.items():
        bits = [expected_bits_per_weight(shape, c) * math.prod(shape) for c in (resolve(f, shape) for f in formats)
                if c is not None]
        if not bits:
            raise HiltError(f"{src}: no candidate format fits tensor '{name}' of shape {shape} (check --candidates)")
        lo, hi = lo + min(bits), hi + max(bits)
    weights = sum(math.prod(s) for s in shapes.values())
    if not lo / weights <= budget <= hi / weights:
        raise HiltError(f"--budget {budget} bits/weight is outside what the candidate formats reach on {src}: "
                        f"{lo / weights:.3f} (all smallest) to {hi / weights:.3f} (all largest)")


def budget_plan(src, budget: float, sensitivity=None, candidates=None, block_size: int = 64, only=None,
                ignore=None, estimate: str = "blocks", progress: bool = False) -> dict:
    """A format per tensor of ``src`` (those `hilt quantize` would quantize) with at most ``budget``
    bits per weight on average, minimising the summed predicted TPV (hilt.quant.allocate).

    ``sensitivity``: a `hilt sensitivity --json` file of this model; without one it is measured
    here on the default calibration data (``src`` must then be a model hilt runs). ``estimate``:
    ``blocks`` (the block-diagonal TPV) or ``full`` (eᵀ H_eff e with each format's actual error,
    where the file has it). Returns {"formats": name -> QuantConfig, "mixed": what the header records,
    "rows": per tensor}.
    """
    from hilt.quant.allocate import allocate
    from hilt.quant.targets import select_targets
    from hilt.quant.sources import open_source

    if estimate not in ("full", "blocks"):
        raise HiltError(f"unknown TPV estimate {estimate!r}; choose full or blocks")
    with open_source(src) as source:
        targets = select_targets(source, only, ignore)
        shapes = {n: tuple(source.shape(n)) for n in targets}
    if not targets:
        raise HiltError(f"{src}: no tensor selected for quantization (check --only/--ignore)")
    if sensitivity is not None:
        if candidates is not None:
            raise HiltError("--candidates applies when the sensitivity is measured here; the file "
                            f"{sensitivity} already fixes its candidate formats")
        sens, origin = read_sensitivity(sensitivity), str(sensitivity)
    else:
        # the reachable range follows from the candidates and the shapes: refused before minutes of measuring
        spec = candidates or DEFAULT_CANDIDATES["workload" if str(src) in WORKLOAD_NAMES else "lm"]
        _check_reachable(budget, parse_candidates(spec, block_size), shapes, src)
        LOG.info(f"measuring the sensitivity of {src} (save it with `hilt sensitivity --json` to reuse it)")
        sens = sensitivity_run(str(src), candidates=candidates, block_size=block_size, progress=progress,
                               full=estimate == "full")
        origin = f"measured on {sens['calibration']}"
    rows = {r["name"]: r for r in sens["layers"]}
    options = {}
    for name in targets:
        r = rows.get(name)
        if r is None:
            raise HiltError(f"{origin}: no sensitivity for tensor '{name}' (measured on another model?)")
        if tuple(r["shape"]) != shapes[name]:
            raise HiltError(f"{origin}: tensor '{name}' has shape {tuple(r['shape'])} there, {shapes[name]} in {src}")
        key = "tpv_full" if estimate == "full" and "tpv_full" in r else "tpv"
        options[name] = {label: (float(r[key][label]), int(r["bits"][label])) for label in r["bits"]}
    weights = sum(math.prod(shapes[n]) for n in targets)
    lo = sum(min(b for _, b in o.values()) for o in options.values()) / weights
    hi = sum(max(b for _, b in o.values()) for o in options.values()) / weights
    if not lo <= budget <= hi:
        raise HiltError(f"--budget {budget} bits/weight is outside what the candidate formats reach on {src}: "
                        f"{lo:.3f} (all smallest) to {hi:.3f} (all largest)")
    plan = allocate(options, budget * weights)
    formats = {n: resolve(parse_candidates(plan.choice[n])[0], shapes[n]) for n in targets}
    out_rows = [{"name": n, "shape": list(shapes[n]), "format": plan.choice[n],
                 "bits_per_weight": options[n][plan.choice[n]][1] / math.prod(shapes[n]),
                 "predicted": options[n][plan.choice[n]][0]} for n in targets]
    mixed = {"budget": budget, "bits_per_weight": plan.bits / weights, "predicted_tpv": plan.cost,
             "lower_bound": plan.lower_bound, "gap": plan.gap, "estimate": estimate, "sensitivity": origin,
             "metric": sens.get("metric"), "candidates": sens.get("candidates")}
    return {"formats": formats, "mixed": mixed, "rows": out_rows}
