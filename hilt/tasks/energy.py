"""`hilt energy`: energy per inference of a Fashion-MNIST workload on a CIM chip against a GPU.

The model is cim_sim/energy.py. With ``precision_sweep`` the ADC resolution is
lowered until the analog model loses more than ``tolerance`` of its accuracy;
the energy is then reported at the lowest resolution that keeps it.
"""

from __future__ import annotations

import copy
import dataclasses
import time

import torch

from hilt.tasks.train import workload_model
from hilt.cim_sim import convert_to_analog, evaluate, preset, program
from hilt.cim_sim.energy import GPUEnergy, chip, estimate
from hilt.progress import LOG

ADC_BITS = (9, 8, 7, 6, 5, 4)


def measure_gpu(model, example: torch.Tensor, batch: int, seconds: float = 3.0) -> dict | None:
    """Joules per inference measured with NVML's energy counter around repeated bf16 batches, or None
    when there is no CUDA GPU or no NVML (pip install nvidia-ml-py)."""
    if not torch.cuda.is_available():
        return None
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    net = copy.deepcopy(model).to("cuda", torch.bfloat16).eval()
    x = example[:1].expand(batch, *example.shape[1:]).to("cuda", torch.bfloat16).contiguous()
    with torch.inference_mode():
        for _ in range(10):
            net(x)
        torch.cuda.synchronize()
        start_mj, start, runs = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle), time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            net(x)
            runs += 1
        torch.cuda.synchronize()
        used_mj = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) - start_mj
    return {"gpu": torch.cuda.get_device_name(), "joules_per_inference": used_mj * 1e-3 / (runs * batch),
            "batch": batch, "runs": runs}


def precision_sweep(model, images, labels, bits=ADC_BITS, chips: int = 2, tolerance: float = 0.01) -> dict:
    """Accuracy on the pcm preset (1 s after programming) at each ADC resolution; the lowest that stays
    within ``tolerance`` of the highest's."""

    rows = []
    for b in bits:
        analog = convert_to_analog(model, dataclasses.replace(preset("pcm"), adc_bits=b))
        accs = []
        for seed in range(chips):
            program(analog, seed=seed)
            accs.append(evaluate(analog, (images, labels)).item())
        rows.append({"adc_bits": b, "accuracy": sum(accs) / len(accs)})
        LOG.info(f"  ADC {b} bits: accuracy {rows[-1]['accuracy']:.4f} (pcm, 1 s, {chips} chips, {len(labels)} images)")
    best = max(r["accuracy"] for r in rows)
    keep = min(r["adc_bits"] for r in rows if r["accuracy"] >= best - tolerance)
    return {"rows": rows, "tolerance": tolerance, "adc_bits": keep}


def run(workload: str = "cnn", checkpoint=None, chip_name: str = "rram-22nm", adc_bits: int | None = None,
        dac_bits: int = 7, gpu_batch: int = 256, sweep: bool = False, test_images: int = 2000) -> dict:
    from hilt.data.fashion_mnist import load_fashion_mnist

    model, path = workload_model(workload, checkpoint)
    images, labels = load_fashion_mnist("test", limit=test_images)
    result = {"workload": workload, "checkpoint": path.name}
    if sweep:
        LOG.info(f"{workload} ({path.name}): lowest ADC resolution that keeps accuracy")
        result["precision"] = precision_sweep(model, images, labels)
        adc_bits = adc_bits or result["precision"]["adc_bits"]
    adc_bits = adc_bits or preset("pcm").adc_bits
    est = estimate(model, images, chip(chip_name), GPUEnergy(batch=gpu_batch), adc_bits=adc_bits, dac_bits=dac_bits)
    result.update(est)
    measured = measure_gpu(model, images, gpu_batch)
    result["gpu_measured"] = measured
    LOG.info(f"{workload} on {chip_name} (ADC {adc_bits} bits, DAC {dac_bits} bits) against {est['gpu']['name']} "
             f"at batch {gpu_batch}; energy per inference:")
    LOG.info(f"{'layer':<8} {'MVMs':>6} {'array':>9} {'ADC':>9} {'DAC':>9} {'digital':>9} {'movement':>9} "
             f"{'CIM':>10} {'GPU':>10} {'CIM/GPU':>8}")
    for r in est["layers"]:
        j = r["cim"]["joules"]
        LOG.info(f"{r['layer']:<8} {r['vectors']:>6} " + " ".join(f"{_nj(j[k]):>9}" for k in
                                                                  ("array", "adc", "dac", "digital", "movement"))
                 + f" {_nj(r['cim']['total']):>10} {_nj(r['gpu']['total']):>10} {r['cim']['total'] / r['gpu']['total']:>8.3f}")
    LOG.info(f"{'total':<8} {'':>6} {'':>49} {_nj(est['cim_joules']):>10} {_nj(est['gpu_joules']):>10} "
             f"{est['cim_over_gpu']:>8.3f}")
    if measured:
        LOG.info(f"measured on {measured['gpu']}: {_nj(measured['joules_per_inference'])} per inference "
                 f"(CIM/GPU {est['cim_joules'] / measured['joules_per_inference']:.3f})")
    return result


def _nj(joules: float) -> str:
    return f"{joules * 1e9:.2f} nJ"


def plot(result: dict, path) -> None:
    """Left: energy per inference per layer, CIM against GPU (log scale). Right: where the CIM energy goes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = result["layers"]
    names = [r["layer"] for r in layers] + ["total"]
    x = torch.arange(len(names), dtype=torch.float64)
    cim = [r["cim"]["total"] for r in layers] + [result["cim_joules"]]
    gpu = [r["gpu"]["total"] for r in layers] + [result["gpu_joules"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1.1, 1]})
    left.bar(x - 0.2, [v * 1e9 for v in cim], 0.4, color="tab:green", label=f"CIM ({result['chip']['name']})")
    left.bar(x + 0.2, [v * 1e9 for v in gpu], 0.4, color="tab:gray",
             label=f"GPU ({result['gpu']['name']}, batch {result['gpu']['batch']})")
    left.set_xticks(x.tolist(), names)
    left.set_yscale("log")
    left.set_ylabel("energy per inference (nJ)")
    left.set_title(f"{result['workload'].upper()}: CIM / GPU = {result['cim_over_gpu']:.3f}")
    left.legend(fontsize=8)
    left.grid(axis="y", alpha=0.3)
    colors = {"array": "tab:green", "adc": "tab:red", "dac": "tab:orange", "digital": "tab:purple",
              "movement": "tab:brown"}
    bottom = torch.zeros(len(names), dtype=torch.float64)
    for part, color in colors.items():
        vals = torch.tensor([r["cim"]["joules"][part] for r in layers]
                            + [sum(r["cim"]["joules"][part] for r in layers)], dtype=torch.float64)
        share = 100 * vals / torch.tensor(cim, dtype=torch.float64)
        right.bar(x, share, 0.6, bottom=bottom, color=color, label=part)
        bottom += share
    right.set_xticks(x.tolist(), names)
    right.set_ylabel("share of the CIM energy (%)")
    right.set_title(f"CIM breakdown (ADC {result['adc_bits']} bits, DAC {result['dac_bits']} bits)")
    right.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
