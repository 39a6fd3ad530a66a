"""`hilt export gguf`: a hilt checkpoint of integer weights as a GGUF file, losslessly.

llama.cpp's block types hold exactly hilt's integer formats, in blocks of 32 along a row:

* symmetric 4-bit (``int``, levels -8..7 times the block scale) -> Q4_0: x = d (q - 8), q = level + 8;
* symmetric 8-bit (levels -128..127) -> Q8_0: x = d q;
* asymmetric 4-bit (``int-asym``, levels 0..15 times the scale plus the block minimum) -> Q4_1:
  x = d q + m.

A hilt block of B = 32 k weights is k GGUF blocks sharing its scale. d (and m) are fp16 in GGUF
and bf16 in hilt; every bf16 value whose exponent fp16 can hold converts exactly, and a scale that
does not is refused, so the file's dequantization equals hilt's bit for bit. k-means is refused:
GGUF has no learned-codebook block type. Dense tensors of two or more dimensions are written as stored
(F32, F16, BF16), as llama.cpp's own converter writes them; 1-D tensors (norms, biases) as F32, which
holds bf16 and fp16 exactly, because llama.cpp's CPU backend adds and multiplies them into float32
activations and has no float32-by-bf16 (or fp16) kernel for that.

Metadata, tokenizer and tensor names come from the GGUF file the checkpoint was quantized from
(hilt's names for a GGUF source are its tensor names), or, for a checkpoint quantized from a Hugging
Face Llama or Gemma 3 folder, from its config.json and tokenizer files (hilt.quant.gguf_hf).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hilt.atomic import check_parent, replacing
from hilt.errors import HiltError
from hilt.kernels.packing import unpack_codes
from hilt.quant.checkpoint import load_checkpoint, read_header
from hilt.quant.formats import FORMATS, get_format
from hilt.quant.qweight import QuantizedWeight
from hilt.quant.sources import read_gguf

GGUF_BLOCK = 32


def gguf_type(q: QuantizedWeight, name: str):
    """The GGUF block type that holds ``q`` exactly, or a one-line refusal naming the tensor."""
    import gguf

    fmt = get_format(q.method)
    held = ", ".join(f"{f.name} {b}-bit ({t})" for f in FORMATS.values() for b, t in f.gguf.items())
    if not fmt.gguf:
        raise HiltError(f"'{name}' is {q.method}: GGUF has no block type with {fmt.levels_are}; "
                        f"export a format it holds ({held}), or use `hilt export onnx`")
    if q.bits not in fmt.gguf:
        raise HiltError(f"'{name}' is {q.method} {q.bits}-bit: GGUF holds exactly {held}")
    kind = getattr(gguf.GGMLQuantizationType, fmt.gguf[q.bits])
    if q.block_size % GGUF_BLOCK:
        raise HiltError(f"'{name}' has blocks of {q.block_size}: GGUF blocks are {GGUF_BLOCK} weights, so hilt's "
                        f"block size must be a multiple of {GGUF_BLOCK}")
    return kind


def _fp16_exact(t: torch.Tensor, name: str, what: str) -> np.ndarray:
    h = t.to(torch.float16)
    if not torch.equal(h.float(), t.float()):
        raise HiltError(f"'{name}': a {what} does not fit fp16 exactly (GGUF stores them as fp16)")
    return h.numpy()


def gguf_blocks(q: QuantizedWeight, name: str = "tensor") -> tuple[np.ndarray, object]:
    """``q`` as GGUF block bytes, (out, in / 32 * block bytes) uint8, and its block type."""
    import gguf

    kind = gguf_type(q, name)
    n, k = q.shape
    per = q.block_size // GGUF_BLOCK
    codes = unpack_codes(q.codes, q.bits, k).view(n, k // GGUF_BLOCK, GGUF_BLOCK)
    d = _fp16_exact(q.scales.repeat_interleave(per, dim=1), name, "block scale").reshape(n, -1, 1)
    parts = [d.view(np.uint8)]
    if kind == gguf.GGMLQuantizationType.Q4_1:
        parts.append(_fp16_exact(q.offsets.repeat_interleave(per, dim=1), name, "block minimum").reshape(n, -1, 1)
                     .view(np.uint8))
    if kind == gguf.GGMLQuantizationType.Q8_0:
        levels = codes - 128  # hilt's code i is the level i - 128
        parts.append(levels.to(torch.int8).numpy().view(np.uint8))
    else:  # Q4_0 stores level + 8 = hilt's code; Q4_1 stores the code; low nibbles first half, high second
        nib = codes.to(torch.uint8)
        parts.append((nib[..., :16] | (nib[..., 16:] << 4)).numpy())
    blocks = np.concatenate(parts, axis=-1)
    return np.ascontiguousarray(blocks.reshape(n, -1)), kind


def copy_gguf_metadata(reader, writer, keep=None) -> None:
    """Copy the metadata of the GGUF ``reader`` to ``writer``: every field but the file's own header, its
    architecture (the writer writes it from its own argument) and its file type (the main block type,
    no longer true); ``keep``, if given, a test on the field's name."""
    import gguf

    skip = {"general.architecture", "general.file_type"}
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in skip or (keep is not None and not keep(field.name)):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub)


def gguf_dense(value: torch.Tensor):
    """A dense tensor as GGUF data and its type (None: numpy's dtype says it): 1-D as F32 (llama.cpp has no
    float32-by-bf16 or -fp16 elementwise kernel on the CPU), others as stored."""
    import gguf

    if value.dim() <= 1 and value.dtype != torch.float32:
        value = value.float()  # exact from bf16 and fp16
    if value.dtype == torch.bfloat16:  # numpy has no bfloat16: its bytes, typed BF16
        return value.contiguous().view(torch.uint8).numpy(), gguf.GGMLQuantizationType.BF16
    return value.contiguous().numpy(), None


def export_gguf(dst, out, overwrite: bool = False, dense: bool = False) -> dict:
    """Write the hilt checkpoint ``dst`` as the GGUF file ``out``: quantized from a GGUF file (its metadata,
    vocabulary and names copied), or from a Hugging Face Llama or Gemma 3 folder (built by hilt.quant.gguf_hf).
    ``dense``: every tensor as F32, the quantized ones dequantized (the same weights, which llama.cpp
    then multiplies in float32 rather than with its 8-bit rounded activations)."""
    import gguf

    from hilt.quant.gguf_hf import TensorLayout, gguf_architecture, write_hf_metadata
    from hilt.quant.hf_folder import is_hf_folder

    out, dst = Path(out), Path(dst)
    header = read_header(dst)
    source = Path(header["source"]["path"])
    from_gguf = header["source"]["format"] == "gguf"
    if not from_gguf and not is_hf_folder(dst):
        raise HiltError(f"{dst}: quantized from a {header['source']['format']} file; `hilt export gguf` takes its "
                        "metadata and tokenizer from the GGUF the checkpoint came from, or from a Hugging Face "
                        "folder's config and tokenizer")
    if from_gguf and not source.is_file():
        raise HiltError(f"{dst}: its source {source} is gone; the GGUF export needs its metadata and tokenizer")
    if not from_gguf:
        arch, _ = gguf_architecture(dst)  # another model type is refused here, before any weight is read
    if out.is_dir():
        raise HiltError(f"{out}: is a folder; give the GGUF file's name")
    if out.exists() and not overwrite:
        raise HiltError(f"{out}: already exists; pass --overwrite to replace it")
    if out.exists():
        with open(out, "rb") as f:
            if f.read(4) != b"GGUF":
                raise HiltError(f"{out}: exists and is not a GGUF file; refusing to replace it")
    check_parent(out)
    for name, e in header["tensors"].items():  # refuse before writing anything
        if e["kind"] == "quantized" and not dense:
            gguf_type(_Meta(e), name)
    layout = None
    if from_gguf:
        reader = read_gguf(source)
        arch = reader.fields["general.architecture"].contents()
    counts: dict[str, int] = {}
    written = 0
    with replacing(out, ".partial") as tmp:
        writer = gguf.GGUFWriter(str(tmp), arch)
        if from_gguf:
            copy_gguf_metadata(reader, writer)
        else:  # config and vocabulary first: their refusals come before the weights are read
            layout = TensorLayout(write_hf_metadata(dst, writer, dst.name), arch)
        tensors = load_checkpoint(dst)
        for name, value in tensors.items():
            if layout is not None and layout.skip(name):
                continue
            if dense:
                value = (value.dequantize() if isinstance(value, QuantizedWeight) else value).float()
            if layout is not None:
                value = layout.dense(name, value)
            if isinstance(value, QuantizedWeight):
                data, kind = gguf_blocks(value, name)
            else:
                data, kind = gguf_dense(value)
            if layout is not None:
                order = layout.rows(name, data.shape[0])
                name = layout.name(name)
                if order is not None:  # whole rows (of blocks) move: exact
                    data = np.ascontiguousarray(data[order])
            writer.add_tensor(name, data, raw_dtype=kind)
            label = kind.name if kind is not None else {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}.get(
                data.dtype, str(data.dtype))
            counts[label] = counts.get(label, 0) + 1
            written += 1
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    result = {"out": str(out), "architecture": arch,
              "source": str(source) if from_gguf else f"{dst / 'config.json'} and its tokenizer files",
              "tensors": written, "types": counts, "bytes": out.stat().st_size}
    if written < len(tensors):
        result["left_out"] = len(tensors) - written  # a multimodal Gemma 3's vision tower
    return result


class _Meta:
    """A header entry seen as the parts gguf_type reads."""

    def __init__(self, entry: dict):
        self.method, self.bits, self.block_size = entry["method"], entry["bits"], entry["block_size"]
