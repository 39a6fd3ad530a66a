"""`hilt drift --model smollm2|minilm|FOLDER`: a language model on CIM hardware over time after programming.

Every Linear of the decoder blocks / encoder layers goes on analog arrays (embeddings, norms, the
attention products and SmolLM2's tied LM head stay digital); all chips are programmed at once and
read in one pass per time, the inputs stacked one copy per chip (cim_sim.stacked_chips).

- a causal LM (SmolLM2, a Llama GGUF, a transformers causal-LM folder): perplexity per chip on
  ``tokens`` tokens of the text (default Hamlet) in windows of ``context`` tokens;
- an encoder (MiniLM, a BERT folder): the mean cosine similarity per chip of its sentence
  embeddings to the digital model's, on ``sentences`` Hamlet sentences.

Static input ranges (``input_range="static"``) and smoothing scales are calibrated on Macbeth, never on Hamlet.
"""

from __future__ import annotations

import dataclasses
import math
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hilt.errors import HiltError
from hilt.progress import LOG, Progress

LANGUAGE_MODELS = ("smollm2", "gemma3", "minilm")


@dataclass
class LanguageModel:
    kind: str  # causal | encoder
    model: nn.Module
    name: str
    encode: Callable  # text -> token ids (causal) / sentences -> (ids, mask) (encoder)
    logits: Callable | None = None  # causal: (model, ids (B, T)) -> logits (B, T, vocab)
    hidden: Callable | None = None  # encoder: (model, ids, mask) -> last hidden states (B, T, d)
    bos: int | None = None  # causal: the token each scored window starts with (hilt.models.lm.split_windows)
    causal: object | None = None  # causal: the hilt.models.lm.CausalLM (its cache-keeping forward, its tokenizer)


def is_language_model(spec: str) -> bool:
    """Whether ``--model`` names a language model (a built-in one, a GGUF file or a folder): its form only."""
    return spec in LANGUAGE_MODELS or spec.endswith(".gguf") or Path(spec).is_dir()


def load_language_model(spec: str) -> LanguageModel:
    """A causal LM as hilt.models.lm names it (smollm2, gemma3, a GGUF file, a causal-LM folder), or an encoder:
    minilm, a BERT folder hilt runs (config model_type bert) or a transformers encoder folder."""
    from hilt.models import bert, lm as causal

    path = Path(spec)
    if spec in causal.BUILTIN or spec.endswith(".gguf"):
        return _causal(causal.load_lm(spec))
    if spec != "minilm" and not path.is_dir():
        raise HiltError(f"--model {spec}: not {', '.join(LANGUAGE_MODELS)}, a .gguf file or a model folder")
    if spec != "minilm" and not (path / "config.json").is_file():
        raise HiltError(f"{path}: not a model folder (no config.json)")
    import json

    config = {} if spec == "minilm" else json.loads((path / "config.json").read_text())
    if spec == "minilm" or (config.get("model_type") == "bert" and (path / "tokenizer.json").is_file()):
        net, tok = bert.load_minilm(None if spec == "minilm" else path)

        def encode(sentences):
            encs = tok.encode_batch(sentences)
            return (torch.tensor([e.ids for e in encs]), torch.tensor([e.attention_mask for e in encs]))

        return LanguageModel("encoder", net, spec, encode, hidden=lambda m, ids, mask: m(ids, mask))
    from hilt.models import hf

    hf.check_folder(path)
    if causal.is_language_model(path):
        return _causal(causal.load_lm(path))
    net, tok = hf.load_encoder(path)

    def encode_hf(sentences):
        enc = tok(sentences, padding=True, truncation=True, max_length=256, return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"]

    return LanguageModel("encoder", net, str(path), encode_hf,
                         hidden=lambda m, ids, mask: m(input_ids=ids, attention_mask=mask).last_hidden_state)


def _causal(lm) -> LanguageModel:
    return LanguageModel("causal", lm.model, lm.name, lm.encode, logits=lambda m, ids: lm.logits(ids, m), bos=lm.bos,
                         causal=lm)


def _read_text(text) -> tuple[str, str]:
    from hilt.data.text import shakespeare_text

    if text is None:
        return shakespeare_text("hamlet"), "Hamlet"
    try:
        body = Path(text).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise HiltError(f"--text {text}: cannot read it ({e})") from None
    if not body.strip():
        raise HiltError(f"--text {text}: the file is empty")
    return body, str(text)


def eval_data(lm: LanguageModel, text=None, tokens: int = 256, context: int = 128, sentences: int = 64):
    """The evaluation inputs: windows of token ids (causal) or batches of (ids, mask) (encoder)."""
    body, name = _read_text(text)
    if lm.kind == "causal":
        if context < 2:
            raise HiltError(f"--context must be at least 2 tokens, got {context}")
        ids = torch.tensor(lm.encode(body)[:tokens], dtype=torch.long)
        if len(ids) < min(tokens, 2):
            raise HiltError(f"{name}: only {len(ids)} tokens, need at least 2")
        from hilt.models.lm import split_windows

        windows = split_windows(ids, context, lm.bos)
        return windows, f"{name}, {len(ids)} tokens in windows of {context}"
    from hilt.data.text import spoken_sentences, sentences as hamlet_sentences

    batch = hamlet_sentences(sentences) if text is None else spoken_sentences(body, 6, 40)[:sentences]
    if not batch:
        raise HiltError(f"{name}: no sentence of 6 to 40 words in it")
    return [lm.encode(batch[i:i + 32]) for i in range(0, len(batch), 32)], f"{name}, {len(batch)} sentences"


@torch.no_grad()
def chip_metric(lm: LanguageModel, model: nn.Module, data, reference=None) -> list[float]:
    """One number per chip the model holds: perplexity (causal) or mean cosine to ``reference`` (the
    digital embeddings, encoder). Every chip's copy of the inputs goes through one forward."""
    from hilt.cim_sim import stacked_chips
    from hilt.models.bert import mean_pool

    chips = getattr(model, "chips", 1)
    with stacked_chips(model):
        if lm.kind == "causal":
            nll, count = torch.zeros(chips, dtype=torch.float64), 0
            for w in data:
                logits = lm.logits(model, w.view(1, -1).repeat(chips, 1))[:, :-1].float()
                target = w[1:].repeat(chips)
                nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target, reduction="none").view(chips, -1) \
                    .double().sum(1)
                count += w.numel() - 1
            return [math.exp(v) for v in (nll / count).tolist()]
        embs = []
        for ids, mask in data:
            hidden = lm.hidden(model, ids.repeat(chips, 1), mask.repeat(chips, 1))
            embs.append(mean_pool(hidden, mask.repeat(chips, 1)).view(chips, len(ids), -1))
        emb = torch.cat(embs, 1)
    if reference is None:
        return emb
    return F.cosine_similarity(emb.double(), reference.double().unsqueeze(0), dim=-1).mean(1).tolist()


def digital_reading(lm: LanguageModel, data, reference_model: nn.Module | None = None):
    """(metric name, the encoder's reference embeddings or None, the digital model's metric) on ``data``: an
    encoder is compared with ``reference_model``'s embeddings (default: its own, cosine 1)."""
    if lm.kind == "causal":
        return "perplexity", None, chip_metric(lm, lm.model, data)[0]
    reference = chip_metric(lm, lm.model if reference_model is None else reference_model, data)[0]
    return "cosine", reference, 1.0 if reference_model is None else chip_metric(lm, lm.model, data, reference)[0]


def calibration_run(lm: LanguageModel, tokens: int = 256, context: int = 128) -> Callable:
    """``run(model)``: the model over the calibration text, Macbeth (causal: ``tokens`` tokens in windows of
    ``context``; encoder: 64 sentences), never the evaluation text."""
    from hilt.data.text import sentences as play_sentences, shakespeare_text

    if lm.kind == "causal":
        from hilt.models.lm import split_windows

        windows = split_windows(lm.encode(shakespeare_text("macbeth"))[:tokens], context, lm.bos)

        def run(m):
            for w in windows:  # led by the model's BOS where it has one, as the evaluation's windows are
                lm.logits(m, w.view(1, -1))
        return run
    batch = play_sentences(64, work="macbeth")

    def run(m):
        lm.hidden(m, *lm.encode(batch))
    return run


def calibrate(lm: LanguageModel, analog: nn.Module, tokens: int = 256, context: int = 128) -> None:
    """Static input ranges and smoothing scales from the calibration text (:func:`calibration_run`)."""
    from hilt.cim_sim import calibrate_inputs

    saved = getattr(analog, "chips", 1)
    calibrate_inputs(analog, calibration_run(lm, tokens, context))
    assert getattr(analog, "chips", 1) == saved


def chip_config(preset_name: str, overrides: dict | None = None):
    """The preset's AnalogConfig with ``overrides`` (``--set`` fields) in place of its own, each checked
    against its field's type ("none" or null where the field may be None, e.g. ``adc_bits=none``)."""
    from hilt.cim_sim import AnalogConfig, preset

    config = preset(preset_name)
    if overrides:
        unknown = set(overrides) - {f.name for f in dataclasses.fields(config)}
        if unknown:
            raise HiltError(f"--set {', '.join(sorted(unknown))}: not a field of AnalogConfig")
        hints = typing.get_type_hints(AnalogConfig)
        values = {k: _field_value(k, v, hints[k]) for k, v in overrides.items()}
        config = _replaced(config, values, overrides)
    return config


def _replaced(config, values: dict, overrides: dict):
    """``config`` with ``values``; a value out of its field's range names the ``--set`` the user wrote for it (all
    of them where only their combination is refused)."""
    try:
        return dataclasses.replace(config, **values)
    except HiltError as e:
        for k in values:
            try:
                dataclasses.replace(config, **{k: values[k]})
            except HiltError:
                raise HiltError(f"--set {k}={overrides[k]}: {e}") from None
        raise HiltError(f"--set {', '.join(f'{k}={v}' for k, v in overrides.items())}: {e}") from None


def lm_deployment(overrides: dict | None, as_is: bool = False) -> dict:
    """The AnalogConfig fields a language model goes on a preset's chip with: cim_sim.config.LM_DEPLOYMENT under
    ``overrides`` (the user's ``--set``), or ``overrides`` alone where ``as_is`` (the preset as aihwkit configures
    it)."""
    from hilt.cim_sim.config import LM_DEPLOYMENT

    return dict(overrides or {}) if as_is else {**LM_DEPLOYMENT, **(overrides or {})}


def chip_name(preset_name: str, config) -> str:
    """The preset and the fields ``config`` sets over it, e.g. "pcm (weight_mapping=column, smoothing=0.5)"."""
    from hilt.cim_sim import preset

    base = preset(preset_name)
    changed = [f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config)
               if getattr(config, f.name) != getattr(base, f.name)]
    return preset_name + (f" ({', '.join(changed)})" if changed else " (as the preset is)")


def _field_value(name: str, value, hint):
    """``value`` as the AnalogConfig field ``name`` (type ``hint``) takes it, or a one-line error."""
    allowed = typing.get_args(hint) or (hint,)
    if (value is None or (isinstance(value, str) and value.lower() in ("none", "null"))) and type(None) in allowed:
        return None
    elif bool in allowed:
        if isinstance(value, bool):
            return value
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and (float in allowed or int in allowed):
        if float in allowed:
            return float(value)
        if float(value).is_integer():
            return int(value)
    elif str in allowed and isinstance(value, str):
        return value
    names = " or ".join("none" if a is type(None) else getattr(a, "__name__", str(a)) for a in allowed)
    raise HiltError(f"--set {name}={value!r}: expected {names}")


def available_bytes() -> int | None:
    """The memory the system has available now (Linux's MemAvailable), or None where it cannot tell."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def chips_per_pass(bytes_per_chip: int, chips: int, available: int | None) -> int:
    """How many chips one pass holds: all of them where their state fits in a third of ``available`` (programming
    and reading them takes about as much again, transiently), else as many as fit, at least one."""
    if available is None:
        return chips
    return max(1, min(chips, int(available / 3 // max(bytes_per_chip, 1))))


def lm_drift_study(model="smollm2", preset_name="pcm", times="1s,1h,1d,1mo,1y", chips=2, gdc="global", text=None,
                   tokens=256, context=128, sentences=64, overrides: dict | None = None, progress=False,
                   lm: LanguageModel | None = None, uncompensated: bool = True,
                   reference_model: nn.Module | None = None, per_pass: int | None = None) -> dict:
    """The metric at each time after programming over ``chips`` chips, with ``gdc`` and (``uncompensated``)
    without. ``overrides``: AnalogConfig fields replacing the preset's. Chip k (0 .. ``chips`` - 1)
    is programmed with seed k and read with seed 10000 k + (time index), as for the
    classifiers, so chips run a few at a time are the chips one pass would hold: ``per_pass`` chips at a time
    (default: as many as the memory available holds). An encoder's chips are compared with the digital
    embeddings of ``reference_model`` (default: the model itself)."""
    from hilt.cim_sim import (analog_layers, chip_memory, clipped_share, convert_to_analog, drift_to,
                              needs_calibration, parse_time, program)

    labels = times.split(",") if isinstance(times, str) else [str(t) for t in times]
    seconds = [parse_time(t) for t in labels]
    if len(set(seconds)) != len(seconds):
        raise HiltError(f"--times {','.join(labels)}: a time is listed twice")
    if chips < 1:
        raise HiltError(f"--chips must be at least 1, got {chips}")
    if per_pass is not None and per_pass < 1:
        raise HiltError(f"chips per pass must be at least 1, got {per_pass}")
    config = chip_config(preset_name, overrides)
    if tokens < 2 or context < 2:  # one token predicts nothing: a perplexity of no window is nan
        raise HiltError(f"--tokens and --context must be at least 2, got {tokens} and {context}")
    _read_text(text)  # an unreadable or empty text before the model loads
    lm = lm or load_language_model(model)
    available = available_bytes()  # before the chips' copy of the model
    data, data_name = eval_data(lm, text, tokens, context, sentences)
    metric, reference, digital = digital_reading(lm, data, reference_model)
    analog = convert_to_analog(lm.model, config)
    if needs_calibration(analog):
        calibrate(lm, analog)
    start = time.perf_counter()
    memory = chip_memory(analog)
    per_pass = per_pass or chips_per_pass(memory["bytes_per_chip"], chips, available)
    passes = [range(k, min(k + per_pass, chips)) for k in range(0, chips, per_pass)]
    if len(passes) > 1:
        LOG.info(f"{chips} chips of {memory['bytes_per_chip'] / 2**20:.0f} MiB: {per_pass} at a time"
                 + (f" (what {available / 2**30:.1f} GiB available holds)" if available else ""))
    modes = ["none"] if gdc == "none" else ["none", gdc] if uncompensated else [gdc]
    values = {m: [[] for _ in seconds] for m in modes}
    steps = Progress(len(seconds) * len(passes), "drift", "time", steps=len(modes), enabled=progress)
    for chip_ids in passes:
        program(analog, seeds=chip_ids)  # the last pass's chips go before this pass's come
        for i, t in enumerate(seconds):
            for m in modes:
                drift_to(analog, t, seeds=[10_000 * k + i for k in chip_ids], gdc=m)
                values[m][i].extend(chip_metric(lm, analog, data, reference))
                steps.tick()
            which = f" chips {chip_ids[0]}-{chip_ids[-1]}" if len(passes) > 1 else ""
            steps.done(labels[i] + which, f"{len(chip_ids)} chips, mean {metric}: "
                       + ", ".join(f"{m} {sum(values[m][i][-len(chip_ids):]) / len(chip_ids):.4g}" for m in modes))
    steps.close()
    worst = max if metric == "perplexity" else min
    rows = []
    for m in modes:
        for i, t in enumerate(seconds):
            v = torch.tensor(values[m][i], dtype=torch.float64)
            rows.append({"gdc": m, "time": labels[i], "seconds": t, "metric": metric, "mean": float(v.mean()),
                         "std": float(v.std()) if chips > 1 else 0.0, "worst": float(worst(values[m][i])),
                         "all": values[m][i]})
    result = {"workload": lm.name, "model": lm.name, "kind": lm.kind, "metric": metric, "data": data_name,
              "preset": preset_name, "config": dataclasses.asdict(config), "repeats": chips, "chips": chips,
              "digital": digital, "analog_layers": len(analog_layers(analog)),
              "digital_layers": analog.digital_layers, "clipped_share": clipped_share(analog),
              "memory_per_chip": memory, "chips_per_pass": per_pass, "seconds": round(time.perf_counter() - start, 1),
              "rows": rows}
    LOG.info(f"{lm.name} on {chip_name(preset_name, config)}: digital {metric} {digital:.4g} on {data_name}; {chips} chips, "
             f"{len(analog_layers(analog))} analog layers, {memory['bytes_per_chip'] / 2**20:.0f} MiB per chip"
             + (f", {100 * result['clipped_share']:.3f}% of weights clipped" if result["clipped_share"] else ""))
    for t in labels:
        LOG.info(f"{t:>6} " + "".join(f"{r['gdc']:>8} {r['mean']:>10.4g} ±{r['std']:<8.3g} worst {r['worst']:<10.4g}"
                                      for r in rows if r["time"] == t))
    return result


def afm_config(overrides: dict | None = None):
    """The ``afm`` chip's AfmConfig with ``overrides`` (``--set`` fields) in place of its own."""
    from hilt.cim_sim.afm import AfmConfig

    config = AfmConfig()
    if not overrides:
        return config
    unknown = set(overrides) - {f.name for f in dataclasses.fields(config)}
    if unknown:
        raise HiltError(f"--set {', '.join(sorted(unknown))}: not a field of the afm chip (AfmConfig: "
                        f"{', '.join(f.name for f in dataclasses.fields(config))})")
    hints = typing.get_type_hints(AfmConfig)
    return _replaced(config, {k: _field_value(k, v, hints[k]) for k, v in overrides.items()}, overrides)


def learned_ranges(spec: str) -> dict | None:
    """The input ranges `hilt hwa --method afm` learned for the model at ``spec`` (the file beside or in it), or None."""
    import json

    where = ranges_path(spec)
    if not where.is_file():
        return None
    try:
        ranges = json.loads(where.read_text())
    except (OSError, ValueError) as e:
        raise HiltError(f"{where}: not a JSON file of input ranges ({e})") from None
    if not isinstance(ranges, dict):
        raise HiltError(f"{where}: expected an object of layer name -> input range")
    return ranges


def ranges_path(out) -> Path:
    """Where the input ranges of a model written at ``out`` (a file or a folder) are kept."""
    from hilt.cim_sim.afm import RANGES_FILE

    out = Path(out)
    return out / RANGES_FILE if out.is_dir() else out.with_name(out.name + "." + RANGES_FILE)


def afm_study(model="smollm2", draws: int = 8, text=None, tokens: int = 256, context: int = 128,
              sentences: int = 64, overrides: dict | None = None, progress: bool = False,
              lm: LanguageModel | None = None, reference_model: nn.Module | None = None, seed: int = 0) -> dict:
    """The model on the Analog Foundation Models chip (cim_sim.afm): ``draws`` chips, each its own programming
    noise (chip k drawn with seed ``seed`` + k), no drift. Static input ranges are the ones `hilt hwa --method afm`
    learned where the model has them, else calibrated on Macbeth as their training starts them."""
    from hilt.cim_sim import afm

    if draws < 1:
        raise HiltError(f"--chips must be at least 1, got {draws}")
    if tokens < 2 or context < 2:
        raise HiltError(f"--tokens and --context must be at least 2, got {tokens} and {context}")
    config = afm_config(overrides)
    _read_text(text)
    ranges = learned_ranges(model) if isinstance(model, (str, Path)) else None
    lm = lm or load_language_model(model)
    data, data_name = eval_data(lm, text, tokens, context, sentences)
    metric, reference, digital = digital_reading(lm, data, reference_model)
    chip = afm.to_afm(lm.model, config)
    if ranges is not None:
        afm.set_ranges(chip, ranges, f"{model}: its learned input ranges")
    else:
        afm.calibrate_ranges(chip, calibration_run(lm))
    start = time.perf_counter()
    values = []
    steps = Progress(draws, "afm", "chip", enabled=progress)
    for k in range(draws):
        afm.program(chip, torch.Generator().manual_seed(seed + k))
        values.extend(chip_metric(lm, chip, data, reference))
        steps.done(f"chip {k}", f"{metric} {values[-1]:.4g}")
    steps.close()
    worst = max if metric == "perplexity" else min
    v = torch.tensor(values, dtype=torch.float64)
    row = {"time": "programmed", "metric": metric, "mean": float(v.mean()),
           "std": float(v.std()) if draws > 1 else 0.0, "worst": float(worst(values)), "all": values}
    result = {"workload": lm.name, "model": lm.name, "kind": lm.kind, "metric": metric, "data": data_name,
              "preset": "afm", "config": dataclasses.asdict(config), "chips": draws, "digital": digital,
              "input_ranges": "learned" if ranges is not None else "calibrated",
              "analog_layers": len(afm.afm_layers(chip)), "seconds": round(time.perf_counter() - start, 1),
              "rows": [row]}
    LOG.info(f"{lm.name} on the afm chip ({config.noise} noise, {result['input_ranges']} input ranges): digital "
             f"{metric} {digital:.4g} on {data_name}; {draws} chips: mean {row['mean']:.4g} ±{row['std']:.3g}, "
             f"worst {row['worst']:.4g}")
    return result
