"""`hilt export onnx`: a quantized MiniLM checkpoint, or a Fashion-MNIST workload frozen on CIM
hardware at a time after programming, as an ONNX file that ONNX Runtime runs.

Both are exported from the PyTorch model with torch.onnx (the torch.export-based exporter),
then checked with onnx.checker and run in ONNX Runtime against PyTorch on real inputs.

* Quantized: exported unoptimised, so that every weight stays an initializer under its own
  name; the float weights are then swapped for their packed codes, codebook and scales with
  a subgraph that rebuilds them (quant/onnx_export.py), so the file keeps the quantized size.
* CIM: every analog layer becomes its frozen counterpart (cim_sim/frozen.py): the weights
  read from the devices at that time (one chip, one read), the drift compensation folded in,
  and the DAC and ADC as quantize-dequantize arithmetic (scale, Round, Clip, rescale) with
  noise and bound management per array as in the simulator; no random noise, so the file
  computes one deterministic snapshot of the chip.
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path

import torch

from hilt.atomic import check_parent, replacing
from hilt.errors import HiltError
from hilt.progress import LOG

OPSET = 20


def _export(model: torch.nn.Module, args: tuple, input_names, output_names, dynamic_shapes, optimize: bool):
    """torch.onnx's exporter; ``optimize=False`` keeps every parameter an initializer under its own name."""
    quiet = logging.getLogger("torch.onnx")  # its registry logs a line per optional library it lacks
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(model, args, dynamo=True, optimize=optimize, opset_version=OPSET,
                                        verbose=False, input_names=input_names, output_names=output_names,
                                        dynamic_shapes=dynamic_shapes)
    finally:
        quiet.setLevel(level)
    return program.model_proto


def _save(model_proto, out: Path) -> int:
    """Check and write atomically; returns the file size in bytes."""
    import onnx

    onnx.checker.check_model(model_proto, full_check=True)
    with replacing(out, ".partial") as tmp:
        onnx.save_model(model_proto, str(tmp))
    return out.stat().st_size


def _check_out(out) -> Path:
    out = Path(out)
    if out.suffix != ".onnx":
        raise HiltError(f"{out}: the output file must end in .onnx")
    check_parent(out)  # before the minutes of work, not after
    return out


_SESSION_MEMORY = """
import sys, onnxruntime as ort
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) * 1024
base = rss()
sess = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
print(rss() - base)
"""


def session_memory(path: Path) -> int | None:
    """Resident bytes an ONNX Runtime session of ``path`` adds, in a fresh process (Linux; None elsewhere)."""
    import subprocess
    import sys

    if not Path("/proc/self/status").exists():
        return None
    r = subprocess.run([sys.executable, "-c", _SESSION_MEMORY, str(path)], capture_output=True, text=True, timeout=600)
    return int(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None


def _session(path: Path):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


# ------------------------------------------------------------------ quantized MiniLM


def export_quantized(src, out, sentences: int = 64, overwrite: bool = False, packed_ops: bool = True) -> dict:
    """A hilt quantized checkpoint of all-MiniLM-L6-v2 -> ONNX (input_ids, attention_mask -> hidden states).
    ``packed_ops``: symmetric 2/4/8-bit integer weights as MatMulNBits (packed in the session); the
    other formats, and all of them without it, as the rebuild subgraph (folded to float at load)."""
    from hilt.models.bert import Bert, BertConfig, embed, load_minilm, minilm_path
    from hilt.models.weights import meta_init
    from hilt.data.text import sentences as real_sentences
    from hilt.quant import QuantizedWeight
    from hilt.quant.checkpoint import load_checkpoint, read_header
    from hilt.quant.onnx_export import replace_initializers, use_matmulnbits

    out = _check_out(out)
    if out.exists() and not overwrite:
        raise HiltError(f"{out} already exists; pass --overwrite to replace it")
    src = Path(src)
    header = read_header(src)
    if not any(name.startswith("encoder.layer.") for name in header["tensors"]):
        raise HiltError(f"{src}: not a BERT (all-MiniLM-L6-v2) checkpoint; ONNX export of quantized checkpoints "
                        f"supports MiniLM so far")
    origin = Path(header.get("source", {}).get("path", ""))
    model_dir = origin if (origin / "config.json").is_file() else minilm_path()
    tensors = load_checkpoint(src)
    with meta_init():  # the weights' names only (a folder save_pretrained wrote holds no dense copy)
        params = dict(Bert(BertConfig.from_json(model_dir / "config.json")).named_parameters())
    quantized = {n: t for n, t in tensors.items() if isinstance(t, QuantizedWeight) and n in params}
    dense = {n: t.float() for n, t in tensors.items() if not isinstance(t, QuantizedWeight) and n in params}
    model, tokenizer = load_minilm(model_dir, {**dense, **{n: q.dequantize().float() for n, q in quantized.items()}})

    start = time.perf_counter()
    ids = torch.tensor([tokenizer.encode("a short example sentence").ids] * 2)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=model.cfg.max_position_embeddings)
    proto = _export(model, (ids, torch.ones_like(ids)), ["input_ids", "attention_mask"], ["hidden"],
                    {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}, optimize=False)
    as_op = use_matmulnbits(proto, quantized) if packed_ops else []
    replace_initializers(proto, {n: q for n, q in quantized.items() if n not in as_op})
    size = _save(proto, out)
    LOG.info(f"wrote {out}: {len(quantized)} quantized weights kept packed ({len(as_op)} as MatMulNBits), "
             f"{size / 1e6:.1f} MB ({time.perf_counter() - start:.0f} s)")

    # check against PyTorch on real sentences: hidden states and sentence embeddings
    sess = _session(out)
    text = real_sentences(sentences)
    worst_rel, worst_abs = 0.0, 0.0
    for i in range(0, len(text), 16):
        encs = tokenizer.encode_batch(text[i:i + 16])
        ids = torch.tensor([e.ids for e in encs])
        mask = torch.tensor([e.attention_mask for e in encs])
        with torch.inference_mode():
            want = model(ids, mask)
        got = torch.from_numpy(sess.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0])
        if not torch.isfinite(got).all():
            raise HiltError(f"{out}: ONNX Runtime produced NaN or Inf")
        keep = mask.bool()  # padded positions are not outputs anyone reads
        worst_abs = max(worst_abs, float((got - want)[keep].abs().max()))
        worst_rel = max(worst_rel, float(((got - want)[keep].abs().max() / want[keep].abs().max())))
    embeddings_torch = embed(model, tokenizer, text)
    shard_bytes = sum((src / s).stat().st_size for s in header["shards"])
    result = {"kind": "quantized", "source": str(src), "onnx": str(out), "onnx_bytes": size,
              "safetensors_bytes": shard_bytes, "size_ratio": size / shard_bytes, "quantized_weights": len(quantized),
              "matmulnbits": len(as_op), "session_rss_bytes": session_memory(out),
              "sentences": len(text), "max_abs_error": worst_abs, "max_rel_error": worst_rel,
              "embedding_dim": int(embeddings_torch.shape[1]), "opset": OPSET}
    LOG.info(f"checked: onnx.checker passes; ONNX Runtime vs PyTorch on {len(text)} sentences: max |error| "
             f"{worst_abs:.2e}, relative to the largest output {worst_rel:.2e}; file size {size / shard_bytes:.3f}x "
             f"the quantized safetensors ({shard_bytes / 1e6:.1f} MB)"
             + ("" if result["session_rss_bytes"] is None else f"; a session holds {result['session_rss_bytes'] / 1e6:.1f} MB"))
    return result


# ------------------------------------------------------------------ CIM snapshot


def export_cim(workload: str, checkpoint, out, preset_name: str = "pcm", time_text: str = "1y", seed: int = 0,
               gdc: str = "global", test_images: int = 10_000, overwrite: bool = False) -> dict:
    """A workload programmed on CIM hardware and read ``time_text`` later, frozen into ONNX (images -> logits)."""
    from hilt.tasks.train import workload_model
    from hilt.data.fashion_mnist import load_fashion_mnist
    from hilt.cim_sim import convert_to_analog, drift_to, evaluate, parse_time, preset, program
    from hilt.cim_sim.frozen import freeze

    out = _check_out(out)
    if out.exists() and not overwrite:
        raise HiltError(f"{out} already exists; pass --overwrite to replace it")
    seconds = parse_time(time_text)
    model, path = workload_model(workload, checkpoint)
    analog = convert_to_analog(model, preset(preset_name))
    program(analog, seed=seed)
    drift_to(analog, seconds, seed=seed + 1, gdc=gdc)
    frozen = freeze(analog)

    images, labels = load_fashion_mnist("test", limit=test_images)
    start = time.perf_counter()
    batch = torch.export.Dim("batch")
    proto = _export(frozen, (images[:2],), ["image"], ["logits"], {"x": {0: batch}}, optimize=True)
    size = _save(proto, out)
    LOG.info(f"wrote {out}: {workload} on {preset_name}, {time_text} after programming (chip seed {seed}, {gdc} drift "
             f"compensation), {size / 1e3:.0f} kB ({time.perf_counter() - start:.0f} s)")

    sess = _session(out)
    logits = torch.cat([torch.from_numpy(sess.run(None, {"image": images[i:i + 1000].numpy()})[0])
                        for i in range(0, len(labels), 1000)])
    if not torch.isfinite(logits).all():
        raise HiltError(f"{out}: ONNX Runtime produced NaN or Inf")
    acc_onnx = float((logits.argmax(1) == labels).float().mean())
    acc_torch = evaluate(frozen, (images, labels)).item()
    result = {"kind": "cim", "workload": workload, "checkpoint": path.name, "preset": preset_name, "time": time_text,
              "seconds": seconds, "seed": seed, "gdc": gdc, "onnx": str(out), "onnx_bytes": size,
              "test_images": len(labels), "accuracy_onnx": acc_onnx, "accuracy_torch": acc_torch,
              "accuracy_difference": acc_onnx - acc_torch, "opset": OPSET}
    LOG.info(f"checked: onnx.checker passes; test accuracy on {len(labels)} images: ONNX Runtime {acc_onnx:.4f}, "
             f"PyTorch {acc_torch:.4f} (difference {100 * (acc_onnx - acc_torch):+.2f} points)")
    return result
