"""`hilt bench sweep`: a drift sweep (chips x times x test images) timed four ways in one run,
and its accuracy curves beside IBM's aihwkit.

The sweep: a Fashion-MNIST workload on the ``pcm`` preset, ``chips`` programmed chips, each read
at every time after programming and evaluated on the test images. Timed, after conversion and
warm-up, in the same process:

1. digital: the trained model's forward over as many images as the sweep evaluates (the baseline);
2. aihwkit: its serial loop as its examples write it (``program_analog_weights``, then
   ``drift_analog_weights`` and an evaluation per time), on its default inference configuration
   ``InferenceRPUConfig()`` (only when aihwkit is importable: an optional peer);
3. hilt, one chip at a time: ``program(seed)``, ``drift_to``, ``accuracy`` per chip;
4. hilt, batched: ``program(model, seeds=...)``, ``drift_to(..., seeds=...)``, ``evaluate``.

Accuracy per time per chip is kept for each, plus untimed runs of the other compensations on the
same chips (hilt ``none`` and, where the simulator has it, ``aihwkit``; aihwkit with
``drift_compensation=None``; aihwkit with each tile's weights scaled to abs-max 1,
``mapping.weight_scaling_omega=1``, beside hilt's ``pcm-scaled`` preset), and per time the
agreement checks: hilt with aihwkit's compensation against aihwkit's default (within 2 standard
deviations over chips), hilt and aihwkit without compensation (within sampling error), and the
others for the record.
"""

from __future__ import annotations

import math
import os
import statistics
import time

import torch

from hilt.errors import HiltError
from hilt.progress import LOG

TIMES = ("1s", "1h", "1d", "1w", "1mo", "1y")
# Budgets. rounds: how many times the timed sweeps are repeated (the ratios are medians over rounds).
# batch: images per batched forward (evaluate's batch_size; every chip runs on each image): the MLP's
# arrays are small, so a large batch amortises each forward's fixed cost; the CNN's patches at 10
# chips x 1000 images would hold several GB, so it keeps evaluate's default (1000 // chips).
FULL = dict(workloads=("mlp", "cnn"), chips=10, times=TIMES, images=10_000, rounds={"mlp": 3, "cnn": 1},
            batch={"mlp": 1000, "cnn": None})
QUICK = dict(workloads=("mlp",), chips=2, times=("1s", "1y"), images=500, rounds={"mlp": 1, "cnn": 1},
             batch={"mlp": 1000, "cnn": None})
# The issue's targets on the MLP: (ratio, comparison, bound).
TARGETS = (("batched_over_digital", "<=", 2.0), ("serial_over_batched", ">=", 1.5),
           ("aihwkit_over_batched", ">=", 6.0))
QUIET_LOAD = 1.2  # 1-minute load average under which the machine counts as quiet
# the accuracy series: key -> (label, how it was produced)
SERIES = {
    "hilt_batched": "hilt pcm, global compensation (batched, timed)",
    "hilt_serial": "hilt pcm, global compensation (one chip at a time, timed)",
    "hilt_none": "hilt pcm, no compensation",
    "hilt_aihwkit": "hilt pcm, gdc='aihwkit'",
    "aihwkit": "aihwkit InferenceRPUConfig() (global drift compensation, timed)",
    "aihwkit_none": "aihwkit InferenceRPUConfig(drift_compensation=None)",
    "aihwkit_omega1": "aihwkit InferenceRPUConfig() with mapping.weight_scaling_omega=1 (each tile's weights "
                      "scaled to abs-max 1)",
    "hilt_scaled_aihwkit": "hilt pcm-scaled (each layer's weights scaled to abs-max 1), gdc='aihwkit'",
}


def aihwkit_version() -> str | None:
    """aihwkit's version when it imports (its compiled core included), else None."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # its OpenBLAS threads would fight torch's on few cores
    try:
        import aihwkit
        from aihwkit.simulator import rpu_base  # noqa: F401  (the C++ core: fails without libopenblas)
    except (ImportError, OSError):
        return None
    return aihwkit.__version__


def chip_seed(chip: int) -> int:
    return chip


def read_seed(chip: int, step: int) -> int:
    """The read noise of chip ``chip`` at the ``step``-th time (as ``hilt drift`` numbers them)."""
    return 10_000 * chip + step


def wait_quiet(tries: int = 5, pause: float = 60.0) -> dict:
    """Wait (up to ``tries`` x ``pause`` s) for the 1-minute load average to fall under QUIET_LOAD."""
    loads = []
    for attempt in range(max(1, tries)):
        load = os.getloadavg()[0]
        loads.append(round(load, 2))
        if load < QUIET_LOAD:
            return {"quiet": True, "load_1min": loads}
        if attempt < tries - 1:
            LOG.info(f"load average {load:.2f} >= {QUIET_LOAD}: waiting {pause:.0f} s before timing")
            time.sleep(pause)
    LOG.warning(f"the machine never became quiet (load {loads}): timings are measured anyway")
    return {"quiet": False, "load_1min": loads}


# -- the four ways ---------------------------------------------------------------------------------

def run_digital(model, images, labels, passes: int):
    from hilt.cim_sim import evaluate

    start = time.perf_counter()
    for _ in range(passes):
        acc = evaluate(model, (images, labels)).item()
    return acc, time.perf_counter() - start


def run_hilt_serial(analog, seconds, chips: int, images, labels):
    """program(seed) / drift_to / accuracy, one chip at a time -> (acc[time][chip], seconds)."""
    from hilt.cim_sim import drift_to, evaluate, program

    acc = [[0.0] * chips for _ in seconds]
    start = time.perf_counter()
    for k in range(chips):
        program(analog, seed=chip_seed(k))
        for i, t in enumerate(seconds):
            drift_to(analog, t, seed=read_seed(k, i), gdc="global")
            acc[i][k] = evaluate(analog, (images, labels)).item()
    return acc, time.perf_counter() - start


def run_hilt_batched(analog, seconds, chips: int, images, labels, modes=("global",), batch_size=None):
    """All chips at once: program(seeds) / drift_to(seeds) / evaluate -> ({mode: acc[time][chip]}, seconds
    of the first mode's sweep). Later modes reread the same chips with the same read seeds (untimed)."""
    from hilt.cim_sim import drift_to, evaluate, program

    acc, elapsed = {}, 0.0
    start = time.perf_counter()
    program(analog, seeds=[chip_seed(k) for k in range(chips)])
    for n, mode in enumerate(modes):
        acc[mode] = []
        for i, t in enumerate(seconds):
            drift_to(analog, t, seeds=[read_seed(k, i) for k in range(chips)], gdc=mode)
            acc[mode].append([float(a) for a in evaluate(analog, (images, labels), batch_size=batch_size)])
        if n == 0:
            elapsed = time.perf_counter() - start
    return acc, elapsed


def aihwkit_model(model, compensation: bool = True, omega: float = 0.0):
    """``model`` converted by aihwkit with its default inference configuration (or without drift
    compensation; ``omega``: its mapping.weight_scaling_omega, 0 by default: raw weights on the
    tiles), in evaluation mode (which its programming and drift calls require)."""
    from aihwkit.nn.conversion import convert_to_analog
    from aihwkit.simulator.configs import InferenceRPUConfig

    config = InferenceRPUConfig() if compensation else InferenceRPUConfig(drift_compensation=None)
    config.mapping.weight_scaling_omega = omega
    return convert_to_analog(model, config).eval()


def run_aihwkit(analog, seconds, chips: int, images, labels):
    """aihwkit's serial loop -> (acc[time][chip], seconds). Its programming and drift draw from
    torch's global generator (seeded per chip and per read here, inside a forked generator state);
    its forward noise comes from its C++ core, which has no seed."""
    from hilt.cim_sim import evaluate

    acc = [[0.0] * chips for _ in seconds]
    with torch.random.fork_rng():
        start = time.perf_counter()
        for k in range(chips):
            torch.manual_seed(chip_seed(k))
            analog.program_analog_weights()
            for i, t in enumerate(seconds):
                torch.manual_seed(read_seed(k, i))
                analog.drift_analog_weights(t)
                acc[i][k] = evaluate(analog, (images, labels)).item()
        elapsed = time.perf_counter() - start
    return acc, elapsed


# -- statistics ------------------------------------------------------------------------------------

def _stats(values) -> dict:
    n = len(values)
    mean = sum(values) / n
    std = statistics.stdev(values) if n > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(values), "max": max(values)}


def agreement(a, b) -> dict:
    """Series ``a`` against reference ``b`` (accuracies over chips at one time): the difference of
    means, whether it is within 2 standard deviations of ``b`` over chips, and its z-score against
    the standard error of the difference (within sampling error: |z| <= 2)."""
    sa, sb = _stats(a), _stats(b)
    diff = sa["mean"] - sb["mean"]
    se = math.sqrt(sa["std"] ** 2 / len(a) + sb["std"] ** 2 / len(b))
    z = diff / se if se > 0 else (0.0 if diff == 0 else math.inf)
    return {"diff": diff, "std_reference": sb["std"], "within_2std": abs(diff) <= 2 * sb["std"],
            "se": se, "z": z, "within_sampling_error": abs(z) <= 2}


# -- the study -------------------------------------------------------------------------------------

def sweep(quick: bool = False, workloads=None) -> dict:
    """The sweep on each workload (default: the budget's), timed four ways; see the module doc."""
    from hilt.data.fashion_mnist import load_fashion_mnist
    from hilt.tasks.train import workload_model
    from hilt.cim_sim import PRESETS, convert_to_analog, parse_time, preset
    from hilt.cim_sim.model import GDC_MODES

    budget = QUICK if quick else FULL
    workloads = tuple(workloads or budget["workloads"])
    for w in workloads:
        if w not in ("mlp", "cnn"):
            raise HiltError(f"unknown workload {w!r}; choose mlp or cnn")
    chips, labels_t, n_images = budget["chips"], list(budget["times"]), budget["images"]
    seconds = [parse_time(t) for t in labels_t]
    version = aihwkit_version()
    has_gdc_aihwkit = "aihwkit" in GDC_MODES
    if version is None:
        LOG.warning("aihwkit is not importable: its rows are left out (it is an optional peer: pip install aihwkit)")
    if not has_gdc_aihwkit:
        LOG.warning("this simulator has no gdc='aihwkit' mode: that series is left out")
    images, labels = load_fashion_mnist("test", limit=n_images)
    config = preset("pcm")
    result = {"preset": "pcm", "times": labels_t, "seconds": seconds, "chips": chips, "test_images": len(labels),
              "aihwkit": version, "gdc_aihwkit": has_gdc_aihwkit, "threads": torch.get_num_threads(),
              "series": {},
              "method": "each way timed from after conversion and a warm-up; ratios: median over rounds of "
                        "each round's ratio (digital, aihwkit, hilt serial, hilt batched timed in turn)",
              "seeds": "chip k programs with seed k and reads time i with seed 10000 k + i, in hilt and (through "
                       "torch.manual_seed) in aihwkit, whose forward noise has no seed",
              "workloads": []}
    for name in workloads:
        model, path = workload_model(name, None)
        model.eval()
        rounds, batch = budget["rounds"][name], budget["batch"][name]
        passes = chips * len(seconds)
        LOG.info(f"{name}: {chips} chips x {len(seconds)} times x {len(labels)} images, pcm preset, {rounds} round(s)")
        # conversion and warm-up outside the timings (the first drift step compiles its fused read)
        hilt_serial_model = convert_to_analog(model, config)
        hilt_batched_model = convert_to_analog(model, config)
        _warm_up(hilt_serial_model, hilt_batched_model, images, labels, chips, batch)
        run_digital(model, images[:200], labels[:200], 1)
        peer = aihwkit_model(model) if version else None
        if peer is not None:
            with torch.inference_mode():
                peer(images[:200])
        machine = wait_quiet(tries=1) if quick else wait_quiet()  # checked before each workload's timings
        per_round, acc = [], {}
        for r in range(rounds):
            times = {}
            digital_acc, times["digital"] = run_digital(model, images, labels, passes)
            if peer is not None:
                acc["aihwkit"], times["aihwkit"] = run_aihwkit(peer, seconds, chips, images, labels)
            acc["hilt_serial"], times["hilt_serial"] = run_hilt_serial(hilt_serial_model, seconds, chips, images, labels)
            batched, times["hilt_batched"] = run_hilt_batched(hilt_batched_model, seconds, chips, images, labels,
                                                              batch_size=batch)
            acc["hilt_batched"] = batched["global"]
            per_round.append(times)
            LOG.info(f"  round {r + 1}: " + ", ".join(f"{k} {v:.2f} s" for k, v in times.items()))
        # the other compensations on the same chips and reads (untimed)
        extra = ["none"] + (["aihwkit"] if has_gdc_aihwkit else [])
        batched, _ = run_hilt_batched(hilt_batched_model, seconds, chips, images, labels, modes=extra,
                                      batch_size=batch)
        for m in extra:
            acc[f"hilt_{m}"] = batched[m]
        if has_gdc_aihwkit and "pcm-scaled" in PRESETS:  # the counterpart of aihwkit's weight_scaling_omega=1
            scaled, _ = run_hilt_batched(convert_to_analog(model, preset("pcm-scaled")), seconds, chips, images,
                                         labels, modes=("aihwkit",), batch_size=batch)
            acc["hilt_scaled_aihwkit"] = scaled["aihwkit"]
        if peer is not None:
            acc["aihwkit_none"], _ = run_aihwkit(aihwkit_model(model, compensation=False), seconds, chips,
                                                images, labels)
            # hilt scales each layer to its abs-max: the aihwkit mapping closest to that
            acc["aihwkit_omega1"], _ = run_aihwkit(aihwkit_model(model, omega=1.0), seconds, chips, images, labels)
        entry = _summarise(name, path.name, digital_acc, labels_t, seconds, acc, per_round, passes)
        entry["batch_size"] = {"digital": 1000, "hilt_serial": 1000, "aihwkit": 1000,
                               "hilt_batched": batch or max(1, 1000 // chips)}
        entry["machine"] = {**machine, "load_1min_after": round(os.getloadavg()[0], 2)}
        result["series"].update({k: v for k, v in SERIES.items() if k in acc})
        result["workloads"].append(entry)
        _log_entry(entry)
    return result


def _warm_up(serial, batched, images, labels, chips: int, batch) -> None:
    """One small pass of each hilt way: compiles the fused passes before any timing."""
    from hilt.cim_sim import drift_to, evaluate, program

    program(serial, seed=0)
    drift_to(serial, 1.0, seed=0)
    evaluate(serial, (images[:200], labels[:200])).item()
    program(batched, seeds=list(range(chips)))
    drift_to(batched, 1.0, seeds=list(range(chips)))
    n = min(len(labels), 2 * (batch or max(1, 1000 // chips)))
    evaluate(batched, (images[:n], labels[:n]), batch_size=batch)


def _summarise(name, checkpoint, digital_acc, labels_t, seconds, acc, per_round, passes) -> dict:
    median = lambda values: statistics.median(values)  # noqa: E731
    timing = {f"{k}_s": median([t[k] for t in per_round]) for k in per_round[0]}
    ratios = {}
    pairs = [("hilt_batched", "digital"), ("hilt_serial", "digital"), ("hilt_serial", "hilt_batched"),
             ("aihwkit", "digital"), ("aihwkit", "hilt_batched"), ("aihwkit", "hilt_serial")]
    for a, b in pairs:
        if a in per_round[0] and b in per_round[0]:
            key = f"{a.removeprefix('hilt_')}_over_{b.removeprefix('hilt_')}"
            ratios[key] = median([t[a] / t[b] for t in per_round])
    targets = []
    if name == "mlp":
        for key, op, bound in TARGETS:
            value = ratios.get(key)
            met = None if value is None else (value <= bound if op == "<=" else value >= bound)
            targets.append({"ratio": key, "target": f"{op} {bound}", "value": value, "met": met})
    rows = []
    for i, t in enumerate(labels_t):
        row = {"time": t, "seconds": seconds[i]}
        for key, series in acc.items():
            row[key] = {**_stats(series[i]), "all": series[i]}
        checks = {}
        if "hilt_aihwkit" in acc and "aihwkit" in acc:
            checks["hilt_aihwkit_vs_aihwkit"] = agreement(acc["hilt_aihwkit"][i], acc["aihwkit"][i])
        if "hilt_scaled_aihwkit" in acc and "aihwkit_omega1" in acc:
            checks["hilt_scaled_aihwkit_vs_aihwkit_omega1"] = agreement(acc["hilt_scaled_aihwkit"][i],
                                                                        acc["aihwkit_omega1"][i])
        if "aihwkit_none" in acc:
            checks["hilt_none_vs_aihwkit_none"] = agreement(acc["hilt_none"][i], acc["aihwkit_none"][i])
        if "aihwkit" in acc:
            checks["hilt_global_vs_aihwkit"] = agreement(acc["hilt_batched"][i], acc["aihwkit"][i])
        checks["hilt_batched_vs_serial"] = agreement(acc["hilt_batched"][i], acc["hilt_serial"][i])
        row["agreement"] = checks
        rows.append(row)
    return {"workload": name, "checkpoint": checkpoint, "digital_accuracy": digital_acc,
            "evaluations": passes, "timing": {**timing, "rounds": len(per_round),
                                                               "per_round": per_round, "ratios": ratios},
            "targets": targets, "rows": rows}


def _log_entry(entry: dict) -> None:
    keys = [k for k in SERIES if k in entry["rows"][0]]
    LOG.info(f"{entry['workload']}: digital accuracy {entry['digital_accuracy']:.4f}; accuracy mean ± std over chips")
    LOG.info(f"{'time':>5} " + "".join(f"{k:>22}" for k in keys))
    for row in entry["rows"]:
        LOG.info(f"{row['time']:>5} " + "".join(f"{row[k]['mean']:>14.4f} ±{row[k]['std']:.4f}" for k in keys))
        for check, a in row["agreement"].items():
            LOG.info(f"      {check}: diff {a['diff']:+.4f}, z {a['z']:+.2f}, within 2 std {a['within_2std']}, "
                     f"within sampling error {a['within_sampling_error']}")
    t = entry["timing"]
    LOG.info("  time: " + ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in t.items() if k.endswith("_s"))
             + "; ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in t["ratios"].items()))
    for target in entry["targets"]:
        value = "n/a" if target["value"] is None else f"{target['value']:.2f}"
        LOG.info(f"  target {target['ratio']} {target['target']}: {value} "
                 f"({'met' if target['met'] else 'not met' if target['met'] is not None else 'not measured'})")


def plot(result: dict, path) -> None:
    """Accuracy against time (mean ± std over chips) per workload, and the sweep's time per way."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = result["workloads"]
    fig, axes = plt.subplots(1, len(entries) + 1, figsize=(5.2 * (len(entries) + 1), 4.2))
    styles = {"hilt_batched": ("tab:blue", "-", "hilt pcm, global (default)"),
              "hilt_aihwkit": ("tab:green", "-", "hilt pcm, gdc='aihwkit'"),
              "aihwkit": ("tab:red", "-", "aihwkit default"),
              "hilt_none": ("tab:blue", ":", "hilt pcm, no compensation"),
              "aihwkit_none": ("tab:red", ":", "aihwkit, no compensation"),
              "aihwkit_omega1": ("tab:orange", "--", "aihwkit default, weight_scaling_omega=1"),
              "hilt_scaled_aihwkit": ("tab:purple", "--", "hilt pcm-scaled, gdc='aihwkit'")}
    for ax, entry in zip(axes, entries, strict=False):
        t = [row["seconds"] for row in entry["rows"]]
        for key, (color, ls, label) in styles.items():
            if key not in entry["rows"][0]:
                continue
            mean = torch.tensor([row[key]["mean"] for row in entry["rows"]])
            std = torch.tensor([row[key]["std"] for row in entry["rows"]])
            ax.plot(t, mean, "o-" if ls == "-" else ls, color=color, label=label, lw=1.5 if ls == "-" else 1)
            if ls == "-":
                ax.fill_between(t, mean - std, mean + std, color=color, alpha=0.18)
        ax.axhline(entry["digital_accuracy"], color="gray", ls="--", lw=1, label="digital")
        low, high = ax.get_ylim()
        ax.set_ylim(low, max(high, entry["digital_accuracy"] + 0.1 * (high - low)))
        ax.set_xscale("log")
        ax.set_xlabel("time after programming (s)")
        ax.set_ylabel("test accuracy (mean ± std over chips)")
        ax.set_title(f"{entry['workload'].upper()}, {result['chips']} chips, {result['test_images']} images")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[-1]
    ways = ["digital", "hilt_batched", "hilt_serial", "aihwkit"]
    width = 0.8 / len(entries)
    for n, entry in enumerate(entries):
        values = [entry["timing"].get(f"{w}_s") for w in ways]
        xs = [i + n * width for i, v in enumerate(values) if v is not None]
        kept = [v for v in values if v is not None]
        ax.bar(xs, kept, width, label=entry["workload"].upper())
        for x, v in zip(xs, kept, strict=True):
            ax.annotate(f"{v:.3g} s", (x, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks([i + width * (len(entries) - 1) / 2 for i in range(len(ways))],
                  ["digital", "hilt\nbatched", "hilt one\nchip at a time", "aihwkit\nserial"])
    ax.set_yscale("log")
    ax.set_ylabel("seconds for the whole sweep")
    ax.set_title("time of the sweep")
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
