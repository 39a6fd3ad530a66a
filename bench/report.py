"""`hilt report`: the whole toolkit on the embedded defaults, written to one folder.

At the top, hilt's claims, each with the numbers this run measured and a verdict computed from the
sections' JSON (bench/claims.py). Sections, each from a real run: the quantization table (SmolLM2-135M,
MiniLM; plain and compensated k-means and int), SmolLM2 decoding on the CPU through transformers'
`from_pretrained` and hilt's own Llama, the LUT matmul kernels (checked against their reference; SmolLM2
decoding through them; timed against cuBLAS when there is a GPU), FP8 attention (weight-only logit bounds,
the transient study, accuracy in real models), the CNN and SmolLM2 (--full: Gemma 3 as well) on PCM over a year, hilt beside aihwkit,
standard vs noise-injection vs DWP training under mismatch and drift, energy per inference against a GPU,
weight-perturbation certificates against quantization and drift, and the two ONNX exports checked in ONNX
Runtime. A section that fails is reported as failed (with its error) and the command exits non-zero at
the end; the other sections still run.

`hilt report` runs the quick budgets (QUICK and each study's quick plan: smaller samples of the same real
models, about 8 minutes on 2 CPU cores); `hilt report --full` the full ones (about 50 minutes).
"""

from __future__ import annotations

import json
import shutil
import time
import traceback
from pathlib import Path

from hilt.atomic import write_text
from hilt.models import TRAINED
from hilt.errors import HiltError
from hilt.progress import LOG, Progress

QUICK = {"drift_chips": 2, "drift_images": 2000, "energy_images": 500}
FULL = {"drift_chips": 5, "drift_images": 10_000, "energy_images": 2000}
ENERGY_TRAININGS = ("standard", "dwp")  # the trained CNNs whose energy the report compares


def _section(name: str, out: Path, sections: list, fn, progress: Progress):
    start = time.perf_counter()
    LOG.info(f"== {name}")
    try:
        body = fn()
        sections.append({"name": name, "ok": True, "seconds": time.perf_counter() - start, "markdown": body})
    except Exception as e:  # noqa: BLE001 (a section's failure, whatever its kind, is reported; the others still run)
        with (out / "errors.log").open("a") as log_file:
            log_file.write(f"{name}\n{traceback.format_exc()}\n")
        sections.append({"name": name, "ok": False, "seconds": time.perf_counter() - start,
                         "markdown": f"**This section failed:** {e}\n"})
        LOG.warning(f"{name} failed: {e}")
    progress.done(name, "ok" if sections[-1]["ok"] else "FAILED")


def kernel_section(out: Path, quick: bool = True) -> str:
    """The LUT kernels' section: check (``quick``: its quick case list on the CPU, where the Triton interpreter
    is slow; tests/test_lut_matmul.py runs every fixed case) and SmolLM2 decode (and quick timings on a GPU), saved to
    OUT/lut_kernels.json; raises when the kernel disagrees with its reference."""
    import torch

    from hilt.bench.perf import lut_kernels
    from hilt.atomic import write_json

    gpu = torch.cuda.is_available()
    result = {"check": lut_kernels.check("cuda" if gpu else "cpu", quick=quick and not gpu),
              "decode": lut_kernels.decode()}
    chk, dec = result["check"], result["decode"]
    lines = [(f"The Triton kernel against its PyTorch reference (`hilt bench kernels --check`; "
             f"{'natively on the GPU' if gpu else 'on the CPU through Triton’s interpreter'}): {chk['cases']} cases "
             f"({chk['configs_checked']} tuning configurations), {len(chk['failures'])} failures, worst error "
             f"{chk['max_error_ratio']:.3f} of what fp16/bf16 inputs allow."), "",
             (f"SmolLM2-135M, greedy decode of 32 tokens after \"The capital of France is\" with a key/value cache "
             f"(`hilt bench kernels --decode`): k-means weights through `QuantLinear` ({dec['through']}) against "
             f"the dequantized model:"), "",
             "| weights | same tokens | QuantLinear s | dequantized s | text (QuantLinear) |", "|---|---|---|---|---|"]
    for bits in (4, 1):
        d = dec[f"{bits}bit"]
        text = json.dumps(d["kernel"], ensure_ascii=False)[1:-1].replace("|", "\\|")
        lines.append(f"| {bits}-bit k-means | {'yes' if d['same'] else '**no**'} | {d['kernel_seconds']:.1f} | "
                     f"{d['dequantized_seconds']:.1f} | `{text}` |")
    if gpu:
        result["machine"] = lut_kernels.gpu_info()
        result["timings"] = lut_kernels.timings(quick=True)
        lines += ["", lut_kernels.render_table(result)]
    else:
        lines += ["", "Timings against cuBLAS need a GPU: `bash bench/perf/gpu_check.sh` (docs/gpu.md)."]
    lines += ["", ("1-bit weights quantized after training decode noise; the check is that the kernel gives the "
              "same noise as the dequantized matmul (`hilt bench qat` trains models that survive 1 bit).")]
    write_json(out / "lut_kernels.json", result)
    if lut_kernels.failed(result):
        raise HiltError(f"the kernels disagree with their reference (details in {out / 'lut_kernels.json'})")
    return "\n".join(lines) + "\n"


def decode_section(out: Path, quick: bool) -> str:
    """SmolLM2 decode through from_pretrained and hilt's own Llama (quick: dense, int4 and k-means 4-bit, 16
    tokens, one GEMV format at SmolLM2's and an 8B model's shape), saved to OUT/decode.json. A result from a
    random model is refused: its timings describe neither SmolLM2 nor the machine."""
    from hilt.bench.perf import decode_speed
    from hilt.atomic import write_json

    if quick:
        result = decode_speed.run(model="smollm2", work=out, formats=decode_speed.REPORT_FORMATS,
                                  gemv_formats=decode_speed.GEMV_FORMATS[:1], new_tokens=16, repeats=3,
                                  everything=False)
    else:
        result = decode_speed.run(model="smollm2", work=out)
    if result["model"] != "SmolLM2-135M-Instruct":
        raise HiltError(f"the decode timings are of {result['model']!r}, not SmolLM2: not a result")
    write_json(out / "decode.json", result)
    return (f"SmolLM2-135M-Instruct made a Hugging Face folder by `hilt convert`, quantized by `hilt quantize` and "
            f"loaded by transformers' `from_pretrained` in bf16, and the same weights in hilt's own Llama; greedy "
            f"decode on the CPU ({result['threads']} threads, {result['new_tokens']} new tokens after a "
            f"{len(result['prompt'].split())}-word prompt, median of {result['repeats']} rounds in which the models "
            f"take turns; `hilt bench decode` has every format, load memory and llama.cpp):\n\n" + result["table"] + "\n")


def peers_markdown(result: dict) -> str:
    """The MLP on `pcm` beside aihwkit: accuracy over time and the time against digital forwards."""
    w = result["workloads"][0]
    lines = [f"The MLP on `pcm` against aihwkit {result['aihwkit']}'s `InferenceRPUConfig()`, {result['chips']} "
             f"chips, {result['test_images']} images (mean over chips):", "",
             "| time | hilt global | hilt gdc=aihwkit | aihwkit default | hilt none | aihwkit none |",
             "|---|---|---|---|---|---|"]
    for row in w["rows"]:
        cells = [row[k]["mean"] if k in row else float("nan")
                 for k in ("hilt_batched", "hilt_aihwkit", "aihwkit", "hilt_none", "aihwkit_none")]
        lines.append(f"| {row['time']} | " + " | ".join(f"{c:.4f}" for c in cells) + " |")
    r = w["timing"]["ratios"]
    lines += ["", f"Time against the digital forwards of the same images: hilt batched "
              f"{r['batched_over_digital']:.2f}x, one chip at a time {r['serial_over_digital']:.2f}x, aihwkit "
              f"{r['aihwkit_over_digital']:.2f}x."]
    return "\n".join(lines) + "\n"


COMMITTED_PEERS = Path(__file__).parent / "results" / "cim_sweep.json"


def peers_committed() -> str:
    """Without aihwkit: what the section compares, and the committed run's numbers, marked as not from this run."""
    import subprocess

    head = ("aihwkit is not installed here (its CPU build: `pip install --no-deps aihwkit-1.2.0-*.whl`, "
            "docs/aihwkit.md), so this run compares nothing with it; the section would time hilt's chips against "
            "aihwkit's on the same MLP and weights, and compare their accuracies over a year.")
    if not COMMITTED_PEERS.is_file():
        return head + "\n"
    try:
        when = subprocess.run(["git", "log", "-1", "--format=%ad, commit %h", "--date=short", "--",
                               COMMITTED_PEERS.name], cwd=COMMITTED_PEERS.parent, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        when = ""
    return (head + f"\n\n**Not from this run**: the last committed run (`bench/results/{COMMITTED_PEERS.name}`"
            f"{', ' + when if when else ''}):\n\n" + peers_markdown(json.loads(COMMITTED_PEERS.read_text())))


def run(out="report", quick: bool = True, progress: bool = False) -> dict:
    """Every section into OUT (report.md, JSON and PNG per section); ``quick=False`` is `--full`.
    ``progress``: a line per finished section (see hilt.progress)."""
    from hilt.atomic import check_out_folder

    check_out_folder(out)  # a file, or a folder that cannot be made or written: said before the minutes of work
    import torch

    from hilt.bench import claims
    from hilt.bench.studies import quant_table, robustness
    from hilt.tasks import drift, energy, export
    from hilt.kernels.backends import triton_kernels
    from hilt.atomic import write_json

    if not torch.cuda.is_available():  # the kernel section checks the Triton code in its CPU interpreter,
        triton_kernels("lut_matmul_triton", interpret=True)  # which must be chosen before Triton loads
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "errors.log").unlink(missing_ok=True)
    for name in claims.INPUTS:  # the headline reads only what this run wrote
        (out / f"{name}.json").unlink(missing_ok=True)
    plan = QUICK if quick else FULL
    sections: list[dict] = []
    started = time.perf_counter()

    def quantization():
        quant_table.run(out=out, quick=quick)
        return ((out / "quant_table.md").read_text() + "\n![quantization](quant_table.png)\n")

    def cim_drift():  # not `drift`: that name is the module
        result = drift.drift_study("cnn", preset_name="pcm", repeats=plan["drift_chips"],
                                 test_images=plan["drift_images"])
        write_json(out / "drift.json", result)
        drift.plot_drift(result, out / "drift.png")
        lines = [(f"The Fashion-MNIST CNN (digital accuracy {result['digital_accuracy']:.4f} on these "
                 f"{result['test_images']} test images) on the `pcm` preset, {result['repeats']} programmed chips:"), "",
                 "| time | no compensation (mean ± std, worst) | global compensation |", "|---|---|---|"]
        for t in dict.fromkeys(r["time"] for r in result["rows"]):
            cells = [f"{r['mean']:.4f} ± {r['std']:.4f}, {r['worst']:.4f}" for r in result["rows"] if r["time"] == t]
            lines.append(f"| {t} | " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n\n![drift](drift.png)\n"

    def robust():
        # quick: DWP's default and its copies knob changed both ways, of the ablation's eight variants
        ablation = ("dwp (default)", "K=2", "K=8") if quick else tuple(robustness.ABLATION)
        result = robustness.study(quick=quick, ablation=ablation)
        write_json(out / "robustness.json", result)
        robustness.plot(result, out / "robustness.png")
        return (f"Mismatch w(1 + eta N(0,1)), {result['plan']['draws']} draws per level on "
                f"{result['plan']['test_images']} test images; PCM drift with global compensation.\n\n"
                + robustness.render(result) + "\n![robustness](robustness.png)\n")

    def energies():
        lines = []
        for method in ENERGY_TRAININGS:
            checkpoint = TRAINED / f"cnn-{method}.safetensors"
            result = energy.run("cnn", checkpoint if checkpoint.exists() else None, sweep=True,
                                test_images=plan["energy_images"])
            write_json(out / f"energy-{method}.json", result)
            energy.plot(result, out / f"energy-{method}.png")
            kept = result["precision"]["adc_bits"]
            lines.append(f"- CNN trained with **{method}**: lowest ADC resolution within 1 point of the 9-bit "
                         f"accuracy on {plan['energy_images']} test images: {kept} bits; energy per inference "
                         f"{result['cim_joules'] * 1e9:.1f} nJ on "
                         f"{result['chip']['name']} vs {result['gpu_joules'] * 1e9:.1f} nJ on the "
                         f"{result['gpu']['name']} at batch {result['gpu']['batch']} "
                         f"(**{100 * (1 - result['cim_over_gpu']):.0f}% lower**). ![energy](energy-{method}.png)")
        return "\n".join(lines) + "\n\nConstants and their sources: `cim_sim/energy.py`.\n"

    def fp8_section():
        from hilt.bench.studies import fp8_accuracy
        from hilt.bench.studies import fp8_scales
        from hilt.bench.studies import fp8_transient

        lines = [("Bounds on |attention logit| from the weights alone against the largest seen on real text "
                 "(`hilt fp8 scales`: SmolLM2 on 1024 Hamlet tokens in windows of 256, MiniLM on 128 Hamlet "
                 "sentences); per model, over layers and heads:"), "",
                 ("| model | observed / worst-case bound | observed / rank-aware prediction | "
                 "rank-agnostic / rank-aware | exceeded |"), "|---|---|---|---|---|"]
        for model in ("minilm", "smollm2"):
            rows = fp8_scales.run(model)["rows"]
            write_json(out / f"fp8-scales-{model}.json", rows)
            lines.append(f"| {model} | {min(r['max_observed_over_bound'] for r in rows):.3f} – "
                         f"{max(r['max_observed_over_bound'] for r in rows):.3f} | "
                         f"{min(r['max_observed_over_rank_aware'] for r in rows):.2f} – "
                         f"{max(r['max_observed_over_rank_aware'] for r in rows):.2f} | "
                         f"{min(r['agnostic_over_aware'] for r in rows):.2f}x | "
                         f"{'yes' if any(r['exceeded'] for r in rows) else 'never'} |")
        result = fp8_transient.study(quick=quick)
        write_json(out / "fp8-transient.json", result)
        fp8_transient.plot(result, out / "fp8-transient.png")
        lines += ["", ("Transients (`hilt fp8 transient`): a character GPT fine-tuned with its attention logits in "
                  "E4M3; steps after the event with logits clipped at ±448 (logits clipped):"), "",
                  "| scenario | " + " | ".join(fp8_transient.RECIPES) + " |", "|---" * (1 + len(fp8_transient.RECIPES)) + "|"]
        for scenario in fp8_transient.SCENARIOS:
            runs = {r["recipe"]: r for r in result["runs"] if r["scenario"] == scenario}
            lines.append(f"| {scenario} | " + " | ".join(
                f"{runs[n]['overflow_steps']} ({runs[n]['overflow_logits']})" for n in fp8_transient.RECIPES) + " |")
        variants = ("fp8", "fp8 geometry scales") if quick else tuple(fp8_accuracy.VARIANTS)
        acc = fp8_accuracy.run(tokens=2048 if quick else 4096, sentences=128 if quick else 256, variants=variants)
        write_json(out / "fp8-attention.json", acc)
        lines += ["", "![fp8 transients](fp8-transient.png)", "",
                  (f"FP8 attention in real models (`hilt fp8 attention`; SmolLM2-135M perplexity on {acc['tokens']} "
                  f"tokens of Hamlet, float32 {acc['float32_perplexity']:.3f}; MiniLM embedding cosine vs float32):"),
                  "", "| variant | perplexity | change | MiniLM cosine |", "|---|---|---|---|"]
        lines += [f"| {r['variant']} | {r['perplexity']:.3f} | {r['perplexity_change_pct']:+.2f}% | "
                  f"{r['minilm_cosine']:.5f} |" for r in acc["rows"]]
        return "\n".join(lines) + "\n"

    def certificates():
        from hilt.bench.studies import certify

        result = certify.study(plan=certify.REPORT if quick else certify.FULL)
        write_json(out / "certify.json", result)
        certify.plot(result, out / "certify.png")
        if any(result["sound_violations"].values()):
            raise HiltError(f"a certified input flipped under an allowed perturbation: {result['sound_violations']}")
        return ("Per test image, the smallest weight change (Frobenius norm) that flips its prediction: exact when "
                "the last layer alone changes, first order for a hidden layer alone, and a sound bound when every "
                "layer changes at once (`hilt bench certify`; docs/results/certify.md).\n\n"
                + certify.render(result) + "\n![certificates](certify.png)\n")

    def onnx_exports():
        from hilt.models.bert import minilm_path
        from hilt.quant import QuantConfig, quantize_checkpoint

        ckpt = out / "ckpt-minilm-kmeans4"
        quantize_checkpoint(minilm_path(), ckpt, QuantConfig(method="kmeans", bits=4, block_size=64), overwrite=True)
        q = export.export_quantized(ckpt, out / "minilm-kmeans4.onnx", overwrite=True)
        shutil.rmtree(ckpt)
        c = export.export_cim("cnn", None, out / "cnn-pcm-1y.onnx", "pcm", "1y", overwrite=True,
                              test_images=plan["drift_images"])
        write_json(out / "onnx.json", {"quantized": q, "cim": c})
        return (f"- all-MiniLM-L6-v2, 4-bit k-means: `minilm-kmeans4.onnx`, {q['onnx_bytes'] / 1e6:.1f} MB "
                f"({q['size_ratio']:.3f}x the quantized safetensors); ONNX Runtime vs PyTorch on {q['sentences']} "
                f"sentences: max relative error {q['max_rel_error']:.1e}.\n"
                f"- CNN on PCM one year after programming: `cnn-pcm-1y.onnx`; test accuracy ONNX Runtime "
                f"{c['accuracy_onnx']:.4f} vs PyTorch {c['accuracy_torch']:.4f} on {c['test_images']} images.\n")

    def cim_peers():
        from hilt.bench.studies import cim_peers as peers

        if peers.aihwkit_version() is None:
            return peers_committed()
        result = peers.sweep(quick=quick, workloads=("mlp",))
        write_json(out / "cim_sweep.json", result)
        peers.plot(result, out / "cim_sweep.png")
        return peers_markdown(result) + "\n![hilt and aihwkit](cim_sweep.png)\n"

    def decode():
        import importlib.util

        if importlib.util.find_spec("transformers") is None:
            return "transformers is not installed, so this section is left out (`pip install hilt[hf]`).\n"
        return decode_section(out, quick)

    def lm_on_chip():
        from hilt.bench.studies import analog_lm

        # quick: SmolLM2 on 2 chips; --full: Gemma 3 270M beside it, 4 chips, 256 tokens, a day as well
        budget = {} if quick else {"chips": 4, "times": ("1s", "1d", "1y"), "tokens": 256}
        result = analog_lm.snapshot("smollm2", **budget)
        if not quick:
            result["models"].update(analog_lm.snapshot("gemma3", **budget)["models"])
        write_json(out / "cim_lm.json", result)
        analog_lm.plot(result, out / "cim_lm.png")
        return (analog_lm.snapshot_markdown(result) + "\nThe whole study, tuned models and the hardware that reaches "
                "the goal: `hilt bench analog-lm` and docs/results/cim_lm.md"
                + (" (Gemma 3 270M beside SmolLM2: `hilt report --full`)" if quick else "")
                + ".\n\n![language models on PCM](cim_lm.png)\n")

    plan_sections = [
        ("Quantization: SmolLM2-135M and all-MiniLM-L6-v2", quantization),
        ("Decode on the CPU: SmolLM2 through from_pretrained and hilt's own Llama", decode),
        ("LUT matmul kernels: correctness and decode", lambda: kernel_section(out, quick)),
        ("FP8 attention: scales from the weights, transients, accuracy", fp8_section),
        ("Compute-in-memory: a year on PCM", cim_drift),
        ("Compute-in-memory: language models on PCM over a year", lm_on_chip),
        ("Compute-in-memory: side by side with aihwkit", cim_peers),
        ("Training for noisy hardware: standard, noise injection, DWP", robust),
        ("Energy per inference: CIM against a GPU", energies),
        ("Certificates: the smallest weight change that flips a prediction", certificates),
        ("ONNX export", onnx_exports),
    ]
    with Progress(len(plan_sections), "report", "section", enabled=progress) as bar:
        for name, fn in plan_sections:
            _section(name, out, sections, fn, bar)

    total = time.perf_counter() - started
    verdicts = claims.headline(claims.load(out))
    md = [f"# hilt report{' (quick)' if quick else ''}", "",
          f"Generated by `hilt report{'' if quick else ' --full'}` in {total / 60:.1f} minutes; each section's "
          "time is beside its title.", "", claims.markdown(verdicts), ""]
    for s in sections:
        md += [f"## {s['name']} ({s['seconds']:.0f} s{'' if s['ok'] else ', FAILED'})", "", s["markdown"], ""]
    write_text(out / "report.md", "\n".join(md))
    summary = {"quick": quick, "seconds": total, "claims": [vars(v) for v in verdicts],
               "sections": [{k: s[k] for k in ("name", "ok", "seconds")} for s in sections]}
    write_json(out / "report.json", summary)
    LOG.info(f"wrote {out / 'report.md'} ({total / 60:.1f} min)")
    failed = [s["name"] for s in sections if not s["ok"]]
    if failed:
        raise HiltError(f"{len(failed)} report section(s) failed: {', '.join(failed)} (details in {out / 'errors.log'})")
    return summary
