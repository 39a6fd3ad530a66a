"""`hilt bench analog-lm`: language models on CIM chips over a year, as trained and tuned for the chip.

For each model (SmolLM2 and MiniLM by default) three variants: the model as trained and two copies
fine-tuned for the chip by `hilt hwa` (``noise``: noise injection with one device read per step;
``dwp``: two reads per step at spread noise levels, half the steps, as many reads). The tuned
copies are trained once against the ``pcm`` device, with column mapping, and kept in the work
folder: a rerun with the same settings reads them back, other settings are refused.

Each variant is deployed on every preset with the mapping the diagnosis found best (column
mapping, smoothing 0.5 calibrated on Macbeth; docs/results/cim_lm.md), programmed on ``chips``
chips (``group`` per pass: a SmolLM2 chip holds about 1.5 GB) and read at each time after programming
with global drift compensation. Chip k is the chip `hilt drift` draws as chip k.

Beside the chips, each variant digital on the same tokens: float, W4 (int4 round to nearest in
groups of 64, every layer the chip would hold) and W4A8 (W4 with each such layer's input rounded
to 8 bits in a static per-tensor range, its abs-max over the calibration text). A causal LM is
scored by perplexity on Hamlet, an encoder by the cosine of its sentence embeddings to the
original model's float embeddings (so tuned copies are held to the original).

Per model also the energy per token of the layers the chip holds (the rram-22nm chip model against
the GPU model, cim_sim.energy), and, when aihwkit is installed, aihwkit's default inference
configuration on the same weights and tokens beside hilt's ``pcm`` preset with aihwkit's programming
scale (``weight_mapping="tile"``) and per-array compensation, the model as trained.
"""

from __future__ import annotations

import copy
import json
import math
import time
from pathlib import Path

import torch
from torch import nn

from hilt.cim_sim.config import LM_DEPLOYMENT
from hilt.errors import HiltError
from hilt.progress import LOG

DEPLOY = LM_DEPLOYMENT
PEER_MAPPING = {"weight_mapping": "tile"}  # beside aihwkit: its programming scale, one per tile
TUNE_PRESET = "pcm"
VARIANTS = ("as trained", "noise", "dwp")
FULL = dict(models=("smollm2", "minilm"), presets=("pcm", "rram"), times=("1s", "1h", "1d", "1mo", "1y"), chips=8,
            group=2, tokens=128, context=128, sentences=64, steps={"noise": 80, "dwp": 40}, batch=None,
            peer_times=("1h", "1y"), peer_chips=8, speed_tokens=512, speed_most=8)
QUICK = dict(models=("smollm2", "minilm"), presets=("pcm",), times=("1s", "1y"), chips=2, group=2, tokens=64,
             context=64, sentences=16, steps={"noise": 2, "dwp": 1}, batch=1, peer_times=("1y",), peer_chips=1, speed_tokens=64,
             speed_most=2)  # 8 SmolLM2 chips in one pass alone take 3 min
LR = 5e-5  # the tuning rate measured in docs/results/cim_lm.md
GOALS = {"ppl_mean_over_w4": 1.15, "ppl_worst_over_w4": 1.3}
TUNED_WORK = Path("analog-lm-work")  # where the study keeps its tuned copies by default (the report reads them)


def _stats(values: list[float], worst) -> dict:
    v = torch.tensor(values, dtype=torch.float64)
    return {"mean": float(v.mean()), "std": float(v.std()) if len(values) > 1 else 0.0,
            "worst": float(worst(values)), "all": list(values)}


# -- the digital rows ------------------------------------------------------------------------------

def chip_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The Linear layers convert_to_analog puts on the chip: all but an ``lm_head``."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] != "lm_head"]


@torch.no_grad()
def w4_copy(model: nn.Module, activations_from=None) -> nn.Module:
    """A copy whose chip layers hold int4 round-to-nearest weights (groups of 64, or the row where
    shorter). ``activations_from``: a ``run(model)`` over calibration text; each such layer's input is
    then rounded to 8 bits in a static symmetric range, its abs-max over that run (W4A8)."""
    from hilt.quant.quantize import QuantConfig, quantize_tensor

    q = copy.deepcopy(model)
    layers = chip_linears(q)
    for name, m in layers:
        config = QuantConfig(method="int", bits=4, block_size=math.gcd(64, m.in_features))
        m.weight.copy_(quantize_tensor(m.weight.detach().float(), config, name=f"{name}.weight").dequantize())
    if activations_from is None:
        return q
    ranges = {name: 0.0 for name, _ in layers}

    def record(name):
        def hook(module, args):
            ranges[name] = max(ranges[name], float(args[0].abs().max()))
        return hook

    hooks = [m.register_forward_pre_hook(record(n)) for n, m in layers]
    try:
        activations_from(q)
    finally:
        for h in hooks:
            h.remove()

    def round8(step):
        def hook(module, args):
            return (torch.clamp(torch.round(args[0] / step), -127, 127) * step,) + tuple(args[1:])
        return hook

    for name, m in layers:
        if ranges[name] > 0:
            m.register_forward_pre_hook(round8(ranges[name] / 127))
    return q


def digital_rows(lm, data, reference, calibration) -> dict:
    """float, W4 and W4A8 of ``lm`` on ``data``: perplexity, or cosine to ``reference``."""
    from hilt.tasks.drift_lm import chip_metric

    models = {"float": lm.model, "w4": w4_copy(lm.model), "w4a8": w4_copy(lm.model, calibration)}
    return {k: chip_metric(lm, m, data, reference)[0] for k, m in models.items()}


# -- chips ------------------------------------------------------------------------------------------

def on_chips(lm, preset_name: str, overrides: dict, times, chips: int, group: int, budget: dict, gdc="global",
             reference_model=None) -> dict:
    """Every chip at every time, ``group`` chips per pass -> {time: stats over chips}, memory, seconds."""
    from hilt.tasks.drift_lm import lm_drift_study

    start = time.perf_counter()
    r = lm_drift_study(lm.name, preset_name, ",".join(times), chips, gdc, tokens=budget["tokens"],
                       context=budget["context"], sentences=budget["sentences"], overrides=overrides, lm=lm,
                       uncompensated=False, reference_model=reference_model, per_pass=group)
    worst = max if lm.kind == "causal" else min
    return {"times": {row["time"]: _stats(row["all"], worst) for row in r["rows"]}, "memory_per_chip": r["memory_per_chip"],
            "seconds": round(time.perf_counter() - start, 1)}


# -- the tuned copies -------------------------------------------------------------------------------

def _stem(model: str) -> str:
    from hilt.models import lm as causal_lm

    return model if model in ("minilm", *causal_lm.BUILTIN) else Path(model).stem


def tuned_path(model: str, method: str, work) -> Path:
    """Where ``model`` tuned by ``method`` is kept in ``work``: a GGUF for a model hilt's own Llama runs (hwa
    writes what it read), else a folder."""
    from hilt.models import lm as causal_lm

    as_gguf = (model != "minilm" and causal_lm.is_language_model(model)
               and causal_lm.lm_source(model).runner == causal_lm.OWN)
    return Path(work) / (f"{_stem(model)}-{method}.gguf" if as_gguf else f"{_stem(model)}-{method}")


def tuned_copy(model: str, method: str, work: Path, steps: int, batch: int | None, context: int,
               options: dict | None = None) -> tuple[str, dict]:
    """The path of ``model`` tuned by ``method`` in ``work``, trained now or read back when a
    previous run trained it with the same settings. ``options``: more of `hwa.tune`'s arguments (``afm``: its
    recipe's); the ``afm`` method tunes for its own chip. -> (path, training record)."""
    from hilt.atomic import write_json
    from hilt.tasks import hwa

    from hilt.models import lm as causal_lm

    causal = model != "minilm" and causal_lm.is_language_model(model)
    out = tuned_path(model, method, work)
    record_path = work / f"{_stem(model)}-{method}.json"
    afm = method == "afm"
    settings = {"model": model, "method": method, "preset": "afm" if afm else TUNE_PRESET,
                "overrides": {} if afm else {"weight_mapping": "column"},
                "steps": steps, "batch": batch or (4 if causal else 8), "context": context, "lr": LR}
    if options:
        settings["options"] = options
    if out.exists():
        try:
            record = json.loads(record_path.read_text())
        except (OSError, ValueError):
            record = None
        if not record or record.get("settings") != settings:
            raise HiltError(f"{out}: a tuned model trained with other settings (or no record {record_path.name}); "
                            f"remove it or choose another --work folder")
        LOG.info(f"{out}: tuned earlier with the same settings; read back")
        return str(out), record
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    r = hwa.tune(model, out, method=method, preset_name=settings["preset"], overrides=settings["overrides"],
                 steps=steps, lr=LR, batch=settings["batch"], context=context, resume=(out.with_name(
                     out.name + ".hwa-state") / "state.json").exists(), **(options or {}))
    record = {"settings": settings, "losses": r["losses"], "seconds": round(time.perf_counter() - start, 1)}
    write_json(record_path, record)
    return str(out), record


# -- speed, energy and the peer --------------------------------------------------------------------

def forward_speed(lm, tokens: int, group: int, repeats: int = 2, most: int = 8) -> dict:
    """Seconds of one forward over ``tokens`` Hamlet tokens (an encoder: 64 sentences), best of ``repeats``
    after a warm-up: digital, and on 1, ``group`` and ``most`` chips in one pass (deployed as the study
    deploys); ``most`` only where its chips' state fits in 60% of the memory available (programming and the
    forward add about half as much again: 8 SmolLM2 chips hold 11.9 GB and peak at 17.4 GB), else its bytes
    are kept."""
    from hilt.cim_sim import chip_memory, convert_to_analog, drift_to, needs_calibration, program
    from hilt.tasks.drift_lm import available_bytes, calibrate, chip_config, chip_metric, eval_data

    data, _ = eval_data(lm, None, tokens, tokens, 64)

    def best(model, reference=None):
        chip_metric(lm, model, data, reference)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            chip_metric(lm, model, data, reference)
            times.append(time.perf_counter() - start)
        return min(times)

    reference = None if lm.kind == "causal" else chip_metric(lm, lm.model, data)[0]
    out = {"tokens": sum(w.numel() for w in data) if lm.kind == "causal" else None,
           "digital_s": best(lm.model, reference), "chips_s": {}}
    analog = convert_to_analog(lm.model, chip_config("pcm", DEPLOY))
    if needs_calibration(analog):
        calibrate(lm, analog)
    need = most * chip_memory(analog)["bytes_per_chip"]
    available = available_bytes()
    fits = available is not None and need < 0.6 * available
    out["most"], out["most_bytes"] = most, need
    for n in sorted({1, group} | ({most} if fits else set())):
        program(analog, seeds=range(n))
        drift_to(analog, 3600.0, seeds=range(n))
        out["chips_s"][str(n)] = best(analog, reference)  # str: the keys JSON keeps
    del analog
    out["one_chip_over_digital"] = out["chips_s"]["1"] / out["digital_s"]
    out["group_over_one_chip"] = out["chips_s"][str(group)] / out["chips_s"]["1"]
    if str(most) in out["chips_s"]:
        out["most_over_one_chip"] = out["chips_s"][str(most)] / out["chips_s"]["1"]
    return out


def energy_per_token(lm, data, chip_name: str = "rram-22nm", devices: int = 1) -> dict:
    """Joules per token of the layers the chip holds: on the CIM chip model against the GPU model
    (``devices``: per side of a weight)."""
    from hilt.cim_sim.energy import chip, estimate

    class Forward(nn.Module):  # estimate feeds one tensor; an encoder also takes its mask
        def __init__(self):
            super().__init__()
            self.inner = lm.model

        def forward(self, ids):
            if lm.kind == "causal":
                return lm.logits(self.inner, ids)
            return lm.hidden(self.inner, ids, torch.ones_like(ids))

    example = data[0].view(1, -1) if lm.kind == "causal" else data[0][0][:1]
    result = estimate(Forward(), example, chip(chip_name), devices=devices)
    on_chip = {f"inner.{n}" for n, _ in chip_linears(lm.model)}
    layers = [r for r in result["layers"] if r["layer"] in on_chip]
    tokens = example.shape[1]
    cim = sum(r["cim"]["total"] for r in layers) / tokens
    gpu = sum(r["gpu"]["total"] for r in layers) / tokens
    return {"chip": chip_name, "devices_per_weight": devices, "layers": len(layers), "tokens": tokens,
            "cim_joules_per_token": cim,
            "gpu_joules_per_token": gpu, "cim_over_gpu": cim / gpu}


def beside_aihwkit(lm, data, times, chips: int) -> dict | None:
    """aihwkit's default inference configuration on the model's weights, chips one at a time as its
    examples run them (programming and drift seeded per chip; its forward noise has no seed). None
    when aihwkit is not installed."""
    from hilt.bench.studies.cim_peers import aihwkit_model, aihwkit_version
    from hilt.cim_sim import parse_time
    from hilt.tasks.drift_lm import chip_metric

    version = aihwkit_version()
    if version is None:
        return None
    reference = None if lm.kind == "causal" else chip_metric(lm, lm.model, data)[0]
    start = time.perf_counter()
    analog = aihwkit_model(lm.model)
    values = {t: [] for t in times}
    with torch.random.fork_rng():
        for k in range(chips):
            torch.manual_seed(k)
            analog.program_analog_weights()
            for i, t in enumerate(times):
                torch.manual_seed(10_000 * k + i)
                analog.drift_analog_weights(parse_time(t))
                values[t].append(chip_metric(lm, analog, data, reference)[0])
    worst = max if lm.kind == "causal" else min
    return {"version": version, "times": {t: _stats(v, worst) for t, v in values.items()},
            "seconds": round(time.perf_counter() - start, 1)}


# -- the study --------------------------------------------------------------------------------------

def study(quick: bool = False, models=None, presets=None, chips: int | None = None, work=None,
          peer: bool = True, overrides: dict | None = None) -> dict:
    """The study on each model (see the module doc); ``work``: where the tuned copies are kept;
    ``overrides``: AnalogConfig fields over the deployment (``--set``), on every preset."""
    from hilt.tasks.drift_lm import calibration_run, chip_config, chip_metric, eval_data, load_language_model

    budget = dict(QUICK if quick else FULL)
    budget["models"] = tuple(models or budget["models"])
    budget["presets"] = tuple(presets or budget["presets"])
    if chips is not None:
        if chips < 1:
            raise HiltError(f"--chips must be at least 1, got {chips}")
        budget["chips"] = chips
    work = Path(work) if work is not None else TUNED_WORK
    deploy = {**DEPLOY, **(overrides or {})}
    for preset_name in budget["presets"]:
        chip_config(preset_name, deploy)  # a field or value that does not fit fails here, before any work
    start = time.perf_counter()
    result = {"quick": quick, "budget": {k: v for k, v in budget.items()}, "deploy": deploy,
              "tune_preset": TUNE_PRESET, "gdc": "global", "models": {}}
    for spec in budget["models"]:
        base = lm = load_language_model(spec)
        data, data_name = eval_data(lm, None, budget["tokens"], budget["context"], budget["sentences"])
        original = lm.model
        reference = None if lm.kind == "causal" else chip_metric(lm, original, data)[0]
        metric = "perplexity" if lm.kind == "causal" else "cosine"
        entry = {"kind": lm.kind, "metric": metric, "data": data_name, "variants": {},
                 "energy": energy_per_token(lm, data, devices=deploy.get("devices_per_weight", 1)),
                 "speed": forward_speed(lm, budget["speed_tokens"], budget["group"],
                                           most=budget["speed_most"])}
        speed = entry["speed"]
        LOG.info(f"{spec}: {metric} on {data_name}; the chip layers {entry['energy']['cim_over_gpu']:.3g}x "
                 f"the GPU's energy per token; one forward on one chip {speed['one_chip_over_digital']:.3g}x the "
                 f"digital one, {budget['group']} chips in one pass {speed['group_over_one_chip']:.3g}x one chip")
        for variant in VARIANTS:
            lm, record = base, None
            if variant != "as trained":
                path, record = tuned_copy(spec, variant, work, budget["steps"][variant], budget["batch"],
                                          budget["context"])
                lm = load_language_model(path)
            row = {"digital": digital_rows(lm, data, reference, calibration_run(lm)), "chips": {},
                   "training": record}
            LOG.info(f"{spec} {variant}: digital " + ", ".join(f"{k} {v:.4g}" for k, v in row["digital"].items()))
            for preset_name in budget["presets"]:
                row["chips"][preset_name] = on_chips(lm, preset_name, deploy, budget["times"], budget["chips"],
                                                     budget["group"], budget, reference_model=original)
                LOG.info(f"{spec} {variant} on {preset_name}: " + ", ".join(
                    f"{t} {s['mean']:.4g} (worst {s['worst']:.4g})" for t, s in row["chips"][preset_name]["times"].items()))
            entry["variants"][variant] = row
        if peer:
            from hilt.bench.studies.cim_peers import agreement

            peer_row = beside_aihwkit(base, data, budget["peer_times"], budget["peer_chips"])
            if peer_row is not None:
                hilt_row = on_chips(base, "pcm", PEER_MAPPING, budget["peer_times"], budget["peer_chips"],
                                    budget["group"], budget, gdc="aihwkit")
                peer_row["hilt"] = hilt_row
                peer_row["agreement"] = {t: agreement(hilt_row["times"][t]["all"], peer_row["times"][t]["all"])
                                         for t in budget["peer_times"]}
            entry["aihwkit"] = peer_row
        result["models"][spec] = entry
    result["goals"] = goals(result)
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def goals(result: dict) -> dict:
    """The issue's quality goals at the last time on ``pcm``, where the study measured them."""
    out = {}
    for spec, entry in result["models"].items():
        variants = entry["variants"]
        last = result["budget"]["times"][-1]
        if "pcm" not in result["budget"]["presets"]:
            continue
        w4 = variants["as trained"]["digital"]["w4"]
        year = {v: variants[v]["chips"]["pcm"]["times"][last] for v in VARIANTS}
        tuned = [v for v in VARIANTS if v != "as trained"]
        if entry["kind"] == "causal":
            best = min(tuned, key=lambda v: year[v]["mean"])
            out[spec] = {"time": last, "best": best, "w4": w4, "mean_over_w4": year[best]["mean"] / w4,
                         "worst_over_w4": year[best]["worst"] / w4,
                         "met": year[best]["mean"] <= GOALS["ppl_mean_over_w4"] * w4
                         and year[best]["worst"] <= GOALS["ppl_worst_over_w4"] * w4}
        else:
            best = max(tuned, key=lambda v: year[v]["mean"])
            out[spec] = {"time": last, "best": best, "w4": w4, "mean": year[best]["mean"],
                         "met": year[best]["mean"] >= w4}
        dwp, noise = year["dwp"], year["noise"]
        if entry["kind"] == "causal":
            out[spec]["dwp_at_least_noise"] = dwp["mean"] <= noise["mean"] and dwp["worst"] <= noise["worst"]
        else:
            out[spec]["dwp_at_least_noise"] = dwp["mean"] >= noise["mean"] and dwp["worst"] >= noise["worst"]
    return out


# -- output -----------------------------------------------------------------------------------------

def _cell(s: dict) -> str:
    return f"{s['mean']:.4g} ± {s['std']:.3g} ({s['worst']:.4g})"


def _extra_fields(result: dict) -> list[str]:
    """The deployment's fields set over the study's own (``--set``), as FIELD=VALUE."""
    return [f"{k}={v}" for k, v in result["deploy"].items() if DEPLOY.get(k) != v]


def render(result: dict) -> str:
    """The study's tables as Markdown."""
    times = result["budget"]["times"]
    extra = ", ".join(f"`{f}`" for f in _extra_fields(result))
    lines = []
    for spec, entry in result["models"].items():
        lines += [f"### {spec} ({entry['metric']}, {entry['data']})", ""]
        for preset_name in result["budget"]["presets"]:
            lines += [f"On `{preset_name}`{' with ' + extra if extra else ''}, {result['budget']['chips']} chips, "
                      "mean ± std over chips (worst chip):", "",
                      "| model | float | W4 | W4A8 | " + " | ".join(times) + " |",
                      "|---" * (4 + len(times)) + "|"]
            for variant, row in entry["variants"].items():
                d = row["digital"]
                cells = [_cell(row["chips"][preset_name]["times"][t]) for t in times]
                lines.append(f"| {variant} | {d['float']:.4g} | {d['w4']:.4g} | {d['w4a8']:.4g} | " + " | ".join(cells) + " |")
            lines.append("")
        sp = entry["speed"]
        lines += [f"One forward ({sp['tokens'] or 64} {'tokens' if sp['tokens'] else 'sentences'}): digital "
                  f"{sp['digital_s']:.3g} s; on one chip {sp['one_chip_over_digital']:.3g}x that; "
                  + ", ".join(f"{n} chips in one pass {s / sp['chips_s']['1']:.3g}x one chip"
                              for n, s in sp["chips_s"].items() if n != "1")
                  + ("" if str(sp["most"]) in sp["chips_s"] else
                     f"; {sp['most']} chips would hold {sp['most_bytes'] / 1e9:.1f} GB, more than 60% of the memory "
                     "available: not run") + ".", ""]
        e = entry["energy"]
        lines += [f"Energy per token of the {e['layers']} chip layers: {e['cim_joules_per_token'] * 1e6:.3g} uJ on the "
                  f"{e['chip']} chip model"
                  + (f" ({e['devices_per_weight']} devices per side of a weight)" if e.get("devices_per_weight", 1) > 1
                     else "") + f" against {e['gpu_joules_per_token'] * 1e6:.3g} uJ on the GPU model "
                  f"({e['cim_over_gpu']:.3g}x).", ""]
        peer = entry.get("aihwkit", "not run")
        if peer is None:
            lines += ["aihwkit: not installed.", ""]
        elif isinstance(peer, dict):
            lines += [f"Beside aihwkit {peer['version']} (the model as trained; hilt's `pcm` with aihwkit's per-tile "
                      "programming scale and per-array compensation):", "", "| time | hilt | aihwkit | within 2 std of aihwkit |",
                      "|---|---|---|---|"]
            for t, agree in peer["agreement"].items():
                lines.append(f"| {t} | {_cell(peer['hilt']['times'][t])} | {_cell(peer['times'][t])} | "
                             f"{'yes' if agree['within_2std'] else 'no'} |")
            lines.append("")
    for spec, g in result["goals"].items():
        if "mean_over_w4" in g:
            lines.append(f"- {spec} at {g['time']}, best tuned ({g['best']}): mean {g['mean_over_w4']:.3g}x W4, worst chip "
                         f"{g['worst_over_w4']:.3g}x (goal {GOALS['ppl_mean_over_w4']}x and {GOALS['ppl_worst_over_w4']}x): "
                         f"{'met' if g['met'] else 'not met'}; DWP at least as good as noise: {g['dwp_at_least_noise']}")
        else:
            lines.append(f"- {spec} at {g['time']}, best tuned ({g['best']}): mean cosine {g['mean']:.3g} against W4's "
                         f"{g['w4']:.3g}: {'met' if g['met'] else 'not met'}; DWP at least as good as noise: "
                         f"{g['dwp_at_least_noise']}")
    return "\n".join(lines) + "\n"


def plot(result: dict, path) -> None:
    """One panel per model and preset: the chips' mean (band: worst chip) per variant over time, the
    digital float, W4 and W4A8 of the model as trained as flat lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hilt.cim_sim import parse_time

    times = result["budget"]["times"]
    seconds = [parse_time(t) for t in times]
    panels = [(spec, p) for spec in result["models"] for p in result["budget"]["presets"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (spec, preset_name) in zip(axes[0], panels):
        entry = result["models"][spec]
        for variant, row in entry["variants"].items():
            stats = [row["chips"][preset_name]["times"][t] for t in times]
            line, = ax.plot(seconds, [s["mean"] for s in stats], marker="o", label=f"{variant} on chip")
            ax.fill_between(seconds, [s["mean"] for s in stats], [s["worst"] for s in stats], color=line.get_color(),
                            alpha=0.15)
        digital = entry["variants"]["as trained"]["digital"]
        for key, style in (("float", "-"), ("w4", "--"), ("w4a8", ":")):
            ax.axhline(digital[key], color="grey", linestyle=style, label=f"{key} (digital)")
        ax.set_xscale("log")
        if entry["kind"] == "causal":
            ax.set_yscale("log")
        ax.set_xticks(seconds, times)
        ax.set_xlabel("time after programming")
        ax.set_ylabel(entry["metric"])
        ax.set_title(f"{spec} on {preset_name}", fontsize=10)
        ax.legend(fontsize=7)
    if _extra_fields(result):
        fig.suptitle("deployed with " + ", ".join(_extra_fields(result)), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- the report's snapshot --------------------------------------------------------------------------

REPORT = dict(times=("1s", "1y"), chips=2, tokens=128, context=128)


def snapshot(model: str = "smollm2", work=TUNED_WORK, times=REPORT["times"], chips: int = REPORT["chips"],
             tokens: int = REPORT["tokens"], context: int = REPORT["context"]) -> dict:
    """The report's section: ``model`` on ``pcm`` with the deployment the diagnosis found best (DEPLOY), as
    trained and as tuned where `hilt bench analog-lm` left a tuned copy in ``work``, each beside its float, W4
    and W4A8 on the same tokens; shaped as :func:`study`'s result (one model, one preset), so :func:`plot`
    draws it."""
    from hilt.tasks.drift_lm import calibration_run, eval_data, load_language_model

    start = time.perf_counter()
    base = load_language_model(model)
    data, data_name = eval_data(base, None, tokens, context)
    variants = {"as trained": base}
    for method in VARIANTS[1:]:
        path = tuned_path(model, method, work)
        if path.exists():
            variants[method] = load_language_model(str(path))
    budget = {"times": list(times), "presets": [TUNE_PRESET], "chips": chips, "tokens": tokens, "context": context,
              "sentences": 0}
    entry = {"kind": base.kind, "metric": "perplexity", "data": data_name, "variants": {},
             "tuned_missing": [m for m in VARIANTS[1:] if m not in variants]}
    for variant, lm in variants.items():
        row = {"digital": digital_rows(lm, data, None, calibration_run(lm)),
               "chips": {TUNE_PRESET: on_chips(lm, TUNE_PRESET, DEPLOY, times, chips, chips, budget)}}
        LOG.info(f"{model} {variant} on {TUNE_PRESET}: " + ", ".join(
            f"{t} {s['mean']:.4g}" for t, s in row["chips"][TUNE_PRESET]["times"].items()))
        entry["variants"][variant] = row
    return {"budget": budget, "deploy": DEPLOY, "models": {model: entry},
            "seconds": round(time.perf_counter() - start, 1)}


def snapshot_markdown(result: dict) -> str:
    times, chips = result["budget"]["times"], result["budget"]["chips"]
    deploy = ", ".join(f"`{k}={v}`" for k, v in result["deploy"].items())
    lines = []
    for model, entry in result["models"].items():
        lines += [f"{model} on `{TUNE_PRESET}` (one device per side of a weight, 512-row arrays, its DAC and ADC) with "
                  f"{deploy} and global drift compensation; perplexity on {entry['data']}, {chips} chips, mean ± std "
                  "over chips (worst chip), beside the same model digital on the same tokens:", "",
                  "| model | float | W4 | W4A8 | " + " | ".join(times) + " |", "|---" * (4 + len(times)) + "|"]
        for variant, row in entry["variants"].items():
            d = row["digital"]
            lines.append(f"| {variant} | {d['float']:.2f} | {d['w4']:.2f} | {d['w4a8']:.2f} | "
                         + " | ".join(_cell(row["chips"][TUNE_PRESET]["times"][t]) for t in times) + " |")
        if entry["tuned_missing"]:
            lines += ["", f"No tuned copy on disk ({', '.join(entry['tuned_missing'])}): `hilt bench analog-lm` trains "
                      f"them into `{TUNED_WORK}/` (about 20 minutes), and this section then reads them."]
    return "\n".join(lines) + "\n"
