"""`hilt bench analog-lm-diagnosis`: where a language model's error on a CIM chip comes from.

Each Linear of the chosen decoder blocks is put alone on one analog chip, programmed, read
``time`` after programming (global drift compensation) and fed the inputs it sees in the digital
model on Hamlet tokens. Its relative output error ||y_chip - y|| / ||y|| is measured with every
non-ideality on, then with each one alone (devices only, DAC only, ADC only, output noise only),
then with the mapping and range options. Static input ranges are calibrated on Macbeth.

Beside the errors, the inputs themselves: with dynamic ranges each token's input row is divided by
its abs-max, so a row whose largest entry is an outlier channel puts most of its entries below
half a DAC step, where they read as zero.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from hilt.errors import HiltError
from hilt.progress import LOG, Progress

# name -> AnalogConfig fields over the preset
SCENARIOS = {
    "all": {},
    "devices only": {"dac_bits": None, "adc_bits": None, "out_noise": 0.0},
    "DAC only": {"device": "ideal", "adc_bits": None, "out_noise": 0.0, "bound_management": False},
    "ADC only": {"device": "ideal", "dac_bits": None, "out_noise": 0.0},
    "output noise only": {"device": "ideal", "dac_bits": None, "adc_bits": None, "bound_management": False},
    "all, weight scaling": {"weight_scaling": True},
    "all, column mapping": {"weight_mapping": "column"},
    "all, column mapping, static ranges": {"weight_mapping": "column", "input_range": "static"},
    "all, column mapping, smoothing 0.5": {"weight_mapping": "column", "smoothing": 0.5},
}
KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _layer_inputs(model, windows, names) -> dict[str, torch.Tensor]:
    """The input rows each named Linear sees over ``windows`` (digital forward)."""
    seen, hooks = {n: [] for n in names}, []
    for n in names:
        hooks.append(model.get_submodule(n).register_forward_pre_hook(
            lambda mod, args, n=n: seen[n].append(args[0].detach().reshape(-1, args[0].shape[-1]).float())))
    try:
        with torch.no_grad():
            for w in windows:
                model(w.view(1, -1))
    finally:
        for h in hooks:
            h.remove()
    return {n: torch.cat(v) for n, v in seen.items()}


def input_stats(x: torch.Tensor, dac_bits: int = 7) -> dict:
    """Per token row: abs-max over the RMS (the crest factor), and the share of entries that a
    ``dac_bits`` DAC over the row's abs-max reads as zero."""
    peak = x.abs().amax(1).clamp_min(1e-30)
    step = 2 / (2**dac_bits - 2)  # the DAC step over [-1, 1]
    zero = ((x.abs() / peak.unsqueeze(1)) < step / 2).float().mean(1)
    crest = peak / x.square().mean(1).sqrt().clamp_min(1e-30)
    return {"crest_median": float(crest.median()), "crest_max": float(crest.max()),
            "zero_share": float(zero.mean())}


@torch.no_grad()
def layer_error(linear: nn.Linear, x: torch.Tensor, config, t: float, calibration: torch.Tensor | None = None,
                seed: int = 0) -> tuple[float, float]:
    """(relative output error of ``linear`` alone on one chip at ``t`` seconds, share of its weights clipped)."""
    from hilt.cim_sim import calibrate_inputs, clipped_share, convert_to_analog, drift_to, needs_calibration, program

    analog = convert_to_analog(nn.Sequential(linear), config)
    if needs_calibration(analog):
        calibrate_inputs(analog, lambda m: m(calibration))
    program(analog, seeds=[seed])
    drift_to(analog, t, seeds=[10_000 * seed], gdc="global")
    y = linear(x)
    err = (analog(x).reshape(y.shape) - y).norm() / y.norm().clamp_min(1e-30)
    return float(err), clipped_share(analog)


def diagnose(model: str = "smollm2", preset_name: str = "pcm", time_text: str = "1s", blocks=None, tokens: int = 128,
             quick: bool = False, progress: bool = False, lm=None) -> dict:
    """The per-layer account: relative output error per Linear of ``blocks`` (default: the first,
    the middle and the last block) per scenario, and the statistics of its inputs."""
    import dataclasses

    from hilt.cim_sim import parse_time, preset
    from hilt.data.text import shakespeare_text
    from hilt.tasks.drift_lm import load_language_model

    t = parse_time(time_text)  # a bad time before the model loads
    lm = lm or load_language_model(model)
    if lm.kind != "causal" or not hasattr(lm.model, "blk"):
        raise HiltError(f"--model {model}: the diagnosis runs on a causal language model (smollm2 or a Llama GGUF)")
    n_blocks = len(lm.model.blk)
    if quick:
        blocks, tokens = [0, n_blocks - 1], min(tokens, 32)
    blocks = sorted(set(blocks if blocks is not None else [0, n_blocks // 2, n_blocks - 1]))
    if not blocks or blocks[0] < 0 or blocks[-1] >= n_blocks:
        raise HiltError(f"--blocks {','.join(map(str, blocks))}: {lm.name} has blocks 0 to {n_blocks - 1}")
    base = preset(preset_name)
    names = [f"blk.{b}.{k}" for b in blocks for k in KINDS]
    hamlet = torch.tensor(lm.encode(shakespeare_text("hamlet"))[:tokens], dtype=torch.long)
    macbeth = torch.tensor(lm.encode(shakespeare_text("macbeth"))[:tokens], dtype=torch.long)
    start = time.perf_counter()
    inputs = _layer_inputs(lm.model, [hamlet], names)
    calibration = _layer_inputs(lm.model, [macbeth], names)
    rows = []
    bar = Progress(len(names), "diagnose", "layer", steps=len(SCENARIOS), enabled=progress)
    with bar:
        for n in names:
            linear = lm.model.get_submodule(n)
            row = {"layer": n, "block": int(n.split(".")[1]), "kind": n.split(".")[2], "shape": list(linear.weight.shape),
                   "weight_absmax_over_std": float(linear.weight.abs().max() / linear.weight.std()),
                   **input_stats(inputs[n], base.dac_bits or 7), "error": {}, "clipped": {}}
            for s, fields in SCENARIOS.items():
                err, clipped = layer_error(linear, inputs[n], dataclasses.replace(base, **fields), t, calibration[n])
                row["error"][s] = err
                if clipped:
                    row["clipped"][s] = clipped
                bar.tick()
            rows.append(row)
            bar.done(n, f"all {row['error']['all']:.3g}, devices {row['error']['devices only']:.3g}, "
                        f"DAC {row['error']['DAC only']:.3g}, output noise {row['error']['output noise only']:.3g}")
    by_kind = {k: {s: sum(r["error"][s] for r in rows if r["kind"] == k) / len(blocks) for s in SCENARIOS}
               for k in KINDS}
    result = {"model": lm.name, "preset": preset_name, "time": time_text, "blocks": blocks, "tokens": len(hamlet),
              "data": f"Hamlet, the first {len(hamlet)} tokens (static ranges calibrated on Macbeth)",
              "scenarios": {s: f or "the preset as is" for s, f in SCENARIOS.items()},
              "seconds": round(time.perf_counter() - start, 1), "by_kind": by_kind, "layers": rows}
    LOG.info(render(result))
    return result


def render(result: dict) -> str:
    """The mean relative output error per layer kind and scenario, as Markdown."""
    scen = list(result["scenarios"])
    lines = [f"Relative output error per layer kind (mean over blocks {', '.join(map(str, result['blocks']))}), "
             f"{result['model']} on `{result['preset']}` at {result['time']}, global compensation, "
             f"{result['tokens']} tokens", "",
             "| layer | " + " | ".join(scen) + " |", "|---|" + "---|" * len(scen)]
    for k, errs in result["by_kind"].items():
        lines.append(f"| {k} | " + " | ".join(f"{errs[s]:.3f}" for s in scen) + " |")
    lines += ["", "| layer | weight abs-max / std | input crest factor (median) | (max) | inputs read as zero by "
              "the DAC |", "|---|---|---|---|---|"]
    for r in result["layers"]:
        lines.append(f"| {r['layer']} | {r['weight_absmax_over_std']:.1f} | {r['crest_median']:.1f} | "
                     f"{r['crest_max']:.1f} | {100 * r['zero_share']:.1f}% |")
    return "\n".join(lines)


def plot(result: dict, path) -> None:
    """Relative output error per layer (x) for each scenario (one line each), log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["layers"]
    fig, ax = plt.subplots(figsize=(max(8, 0.35 * len(rows)), 4.5))
    for s in result["scenarios"]:
        ax.plot(range(len(rows)), [r["error"][s] for r in rows], marker="o", ms=3, label=s)
    ax.set_xticks(range(len(rows)), [r["layer"].removeprefix("blk.") for r in rows], rotation=90, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("relative output error")
    ax.set_title(f"{result['model']} on {result['preset']} at {result['time']}: each Linear alone on a chip")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
