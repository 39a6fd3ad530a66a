"""`hilt bench cim`: the simulator's analog forward and drift step against the digital forward
(and, when aihwkit is importable, against aihwkit's default inference configuration)."""

from __future__ import annotations

import os

import torch

from hilt.bench.perf import wall_times
from hilt.tasks.train import workload_model
from hilt.cim_sim import convert_to_analog, drift_to, preset
from hilt.progress import LOG


def speed(rounds: int = 7, repeats: int = 20) -> dict:
    """Forward time of each preset against the digital forward of the same model, and of a drift step.

    The committed trained checkpoints on the first 256 Fashion-MNIST test images: an untrained
    model on Gaussian inputs saturates the ADC on most rows and measures bound management instead.
    Each round times ``repeats`` calls of each and takes medians; the ratios are the median over
    rounds after the first (a warm-up), which keeps them steady on a machine whose speed wanders.
    """
    import statistics

    from hilt.data.fashion_mnist import load_fashion_mnist

    def median_time(fn):
        return statistics.median(wall_times(fn, repeats))

    x, _ = load_fashion_mnist("test", limit=256)
    rows = []
    for name in ("mlp", "cnn"):
        model, path = workload_model(name, None)
        n_rounds = rounds if name == "mlp" else 3  # the CNN's forward is 40x longer
        for p in ("ideal", "pcm", "pcm-hwa", "rram"):
            analog = convert_to_analog(model, preset(p))
            per_round = []
            for _ in range(n_rounds):
                with torch.inference_mode():
                    digital = median_time(lambda model=model: model(x))
                    fwd = median_time(lambda analog=analog: analog(x))
                drift = median_time(lambda analog=analog: drift_to(analog, 86400.0, gdc="global"))
                per_round.append((digital, fwd, drift))
            kept = per_round[1:] if len(per_round) > 1 else per_round
            digital, fwd, drift = (statistics.median(r[i] for r in kept) for i in range(3))
            ratio = statistics.median(r[1] / r[0] for r in kept)
            drift_ratio = statistics.median(r[2] / r[1] for r in kept)
            rows.append({"model": name, "checkpoint": path.name, "preset": p, "digital_ms": digital * 1e3,
                         "analog_ms": fwd * 1e3, "forward_ratio": ratio, "drift_ms": drift * 1e3,
                         "drift_over_forward": drift_ratio})
            LOG.info(f"{name} {p:<8} digital {digital * 1e3:7.2f} ms  analog {fwd * 1e3:8.2f} ms  x{ratio:5.2f}  "
                     f"drift step {drift * 1e3:7.2f} ms ({drift_ratio:.2f} of a forward)")
    result = {"batch": 256, "inputs": "Fashion-MNIST test[:256]", "threads": torch.get_num_threads(),
              "method": f"median over rounds (first dropped) of medians of {repeats} calls", "rows": rows}
    peer = aihwkit_speed(x, median_time, rounds)
    if peer is not None:
        result["aihwkit"] = peer
    return result


def aihwkit_speed(x, median_time, rounds: int) -> dict | None:
    """aihwkit's default inference configuration (``InferenceRPUConfig()``) on the same models and
    images, timed in the same rounds as hilt's pcm preset (forward, and a drift call to one day,
    each with its drift compensation readout), so that hilt / aihwkit comes from one run.
    None when aihwkit is not importable (an optional peer)."""
    import statistics

    from hilt.bench.studies.cim_peers import aihwkit_model, aihwkit_version

    version = aihwkit_version()
    if version is None:
        LOG.warning("aihwkit is not importable: no aihwkit rows (optional: pip install aihwkit)")
        return None
    rows = []
    for name in ("mlp", "cnn"):
        model, path = workload_model(name, None)
        model.eval()
        hilt_pcm = convert_to_analog(model, preset("pcm"))
        peer = aihwkit_model(model)
        with torch.random.fork_rng():  # aihwkit draws from torch's global generator
            torch.manual_seed(0)
            peer.program_analog_weights()
            per_round = []
            for _ in range(rounds if name == "mlp" else 3):
                with torch.inference_mode():
                    digital = median_time(lambda model=model: model(x))
                    fwd = median_time(lambda hilt_pcm=hilt_pcm: hilt_pcm(x))
                    peer_fwd = median_time(lambda peer=peer: peer(x))
                drift = median_time(lambda hilt_pcm=hilt_pcm: drift_to(hilt_pcm, 86400.0, gdc="global"))
                peer_drift = median_time(lambda peer=peer: peer.drift_analog_weights(86400.0))
                per_round.append((digital, fwd, peer_fwd, drift, peer_drift))
        kept = per_round[1:] if len(per_round) > 1 else per_round
        digital, fwd, peer_fwd, drift, peer_drift = (statistics.median(r[i] for r in kept) for i in range(5))
        ratio = lambda i, j: statistics.median(r[i] / r[j] for r in kept)  # noqa: E731
        rows.append({"model": name, "checkpoint": path.name, "config": "InferenceRPUConfig()",
                     "digital_ms": digital * 1e3, "analog_ms": peer_fwd * 1e3, "forward_ratio": ratio(2, 0),
                     "drift_ms": peer_drift * 1e3, "drift_over_forward": ratio(4, 2),
                     "hilt_pcm_analog_ms": fwd * 1e3, "hilt_pcm_drift_ms": drift * 1e3,
                     "hilt_over_aihwkit_forward": ratio(1, 2), "hilt_over_aihwkit_drift": ratio(3, 4)})
        LOG.info(f"{name} aihwkit  digital {digital * 1e3:7.2f} ms  analog {peer_fwd * 1e3:8.2f} ms  x{ratio(2, 0):5.2f}  "
                 f"drift call {peer_drift * 1e3:7.2f} ms; hilt pcm / aihwkit: forward {ratio(1, 2):.3f}, "
                 f"drift {ratio(3, 4):.3f}")
    return {"version": version, "config": "InferenceRPUConfig() (PCM noise model, global drift compensation)",
            "threads": {"torch": torch.get_num_threads(), "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS")},
            "rows": rows}
