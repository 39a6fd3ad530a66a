"""`hilt export compressed-tensors`: a hilt checkpoint of a Hugging Face model as the folder format
llm-compressor writes and vLLM serves (``quant_method: compressed-tensors``, ``pack-quantized``).

compressed-tensors' integer weights are x = scale * (q - zero_point) with q a signed b-bit integer
(-2^(b-1) .. 2^(b-1)-1) and one scale per group of ``group_size`` weights along a row; the codes are
stored offset by 2^(b-1) and packed densely into int32 (``weight_packed``), with ``weight_scale``,
``weight_shape`` and, when asymmetric, the zero points packed the same way along the rows
(``weight_zero_point``). hilt's symmetric ``int`` (levels -2^(b-1)..2^(b-1)-1 times the block
scale) is that with zero_point 0: code - 2^(b-1) = q, the scale as stored, exactly.

hilt's ``int-asym`` is x = scale * code + minimum with the block's minimum a float; it fits an
integer zero point only where every minimum is a whole number of steps, which it is not in
general: such checkpoints are refused (GGUF's Q4_1 holds them). k-means and binary have no integer
grid, and compressed-tensors packs 1..8 bits: refused in one line naming the tensor.

Embedding tables hilt quantized (``--embeddings``) are stored dequantized in the model's dtype:
compressed-tensors quantizes Linear layers. Needs the ``compressed-tensors`` package (hilt[ct]),
which validates the written ``quantization_config`` and packs the codes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from hilt.atomic import check_parent, make_readable, move_into_place, save_safetensors, write_json
from hilt.errors import HiltError, one_line
from hilt.kernels.packing import unpack_codes
from hilt.quant import hf_folder
from hilt.quant.checkpoint import load_checkpoint, read_header
from hilt.quant.formats import get_format
from hilt.quant.qweight import QuantizedWeight

FORMAT = "pack-quantized"


def _require():
    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        raise HiltError("`hilt export compressed-tensors` needs the compressed-tensors package: "
                        "pip install 'hilt[ct]'") from None
    return compressed_tensors


def _entry_scheme(name: str, e: dict) -> tuple[int, bool, int]:
    """(bits, symmetric, group size) of a header entry, or a one-line refusal naming the tensor."""
    method, bits, block = e["method"], e["bits"], e["block_size"]
    fmt = get_format(method)
    levels = fmt.levels(bits)
    if levels is None or not torch.all(levels.diff() == 1):
        raise HiltError(f"'{name}' is {method}: compressed-tensors holds integer grids (scale x (q - zero point)); "
                        f"{method} has no such grid. Export an int or int-asym checkpoint, or use `hilt export onnx`")
    if not 2 <= bits <= 8:
        raise HiltError(f"'{name}' is {method} {bits}-bit: compressed-tensors packs 2..8-bit integers here")
    if e["shape"][1] % block:
        raise HiltError(f"'{name}': in_features {e['shape'][1]} is not a multiple of its block size {block}")
    return bits, not fmt.offsets, block


def _signed_levels(q: QuantizedWeight, name: str) -> torch.Tensor:
    """hilt's codes as compressed-tensors' signed integers q = code - 2^(b-1) (int8), after checking that
    the codebook is the plain grid those integers index."""
    half = 1 << (q.bits - 1)
    grid = get_format(q.method).levels(q.bits).float()
    book = q.codebook.float()
    if book.shape != grid.shape or not torch.equal(book, grid):
        raise HiltError(f"'{name}': its codebook is not the {q.method} {q.bits}-bit grid; re-quantize it")
    codes = unpack_codes(q.codes, q.bits, q.shape[1]).to(torch.int16)
    return (codes - half).to(torch.int8)


def _zero_points(q: QuantizedWeight, name: str) -> torch.Tensor:
    """int-asym: x = s*code + m = s*(q - zp) with q = code - 2^(b-1) needs zp = -(2^(b-1) + m/s), a whole
    number in the signed range; refused otherwise."""
    half = 1 << (q.bits - 1)
    steps = q.offsets.float() / q.scales.float()
    zp = -(half + steps)
    if not torch.equal(zp, zp.round()) or zp.min() < -half or zp.max() > half - 1:
        raise HiltError(f"'{name}' is int-asym: its block offsets (each block's minimum) are not whole numbers of "
                        "steps, and compressed-tensors' zero point is an integer; export a symmetric int "
                        "checkpoint, or `hilt export gguf` (Q4_1 holds int-asym exactly)")
    return zp.to(torch.int8)


def _scheme_dict(bits: int, symmetric: bool, group: int) -> dict:
    return {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": group,
            "dynamic": False, "actorder": None}


def quantization_config(schemes: dict[str, tuple[int, bool, int]], ignore: list[str]) -> dict:
    """The ``quantization_config`` for modules -> (bits, symmetric, group size), validated by
    compressed-tensors' own classes and dumped as its loaders read it."""
    _require()
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    kinds = sorted(set(schemes.values()))
    groups = {}
    for i, kind in enumerate(kinds):
        # one kind: every Linear not ignored (llm-compressor's usual form); several: each module by name
        targets = ["Linear"] if len(kinds) == 1 else sorted(m for m, k in schemes.items() if k == kind)
        groups[f"group_{i}"] = QuantizationScheme(targets=targets, weights=_scheme_dict(*kind), format=FORMAT)
    try:
        config = QuantizationConfig(config_groups=groups, format=FORMAT, quantization_status="compressed",
                                    ignore=ignore)
    except Exception as e:  # pydantic's ValidationError: a config the package itself would not read
        raise HiltError(f"compressed-tensors refused the quantization config ({one_line(e, 160)})") from None
    return config.model_dump(exclude_none=False)


def export_compressed_tensors(src, out, overwrite: bool = False) -> dict:
    """Write the hilt folder ``src`` (quantized from a Hugging Face folder) as a compressed-tensors folder
    ``out``: config.json with the quantization_config, model.safetensors, the tokenizer and other files."""
    _require()
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    src, out = Path(src), Path(out)
    header = read_header(src)
    if not hf_folder.is_hf_folder(src):
        raise HiltError(f"{src}: quantized from a {header['source']['format']} file, not a Hugging Face folder; "
                        "compressed-tensors folders are Hugging Face folders (`hilt convert` the GGUF, quantize "
                        "that folder, then export)")
    if out.exists() and not overwrite:
        raise HiltError(f"{out}: already exists; pass --overwrite to replace it")
    if out.exists() and not hf_folder.is_hf_folder(out):
        raise HiltError(f"{out}: exists and is not a model folder; refusing to replace it")
    check_parent(out)
    entries = header["tensors"]
    schemes = {n.removesuffix(".weight"): _entry_scheme(n, e) for n, e in entries.items()
               if e["kind"] == "quantized" and "embed" not in n}
    base = hf_folder.read_config(src)
    base.pop("quantization_config", None)
    dtype = getattr(torch, str(base.get("dtype") or base.get("torch_dtype") or "bfloat16"))
    modules_2d = {n.removesuffix(".weight") for n, e in entries.items() if len(e["shape"]) == 2}
    ignore = sorted(m for m in modules_2d - set(schemes) if "embed" not in m)
    if base.get("tie_word_embeddings") and "lm_head" not in ignore:
        ignore.append("lm_head")  # tied to the embedding table: stays dense
    qconfig = quantization_config(schemes, ignore)

    tensors: dict[str, torch.Tensor] = {}
    for name, value in load_checkpoint(src).items():
        module = name.removesuffix(".weight")
        if isinstance(value, QuantizedWeight) and module in schemes:
            levels = _signed_levels(value, name)
            tensors[f"{module}.weight_packed"] = pack_to_int32(levels, value.bits)
            tensors[f"{module}.weight_scale"] = value.scales.to(dtype)
            tensors[f"{module}.weight_shape"] = torch.tensor(value.shape, dtype=torch.int64)
            if get_format(value.method).offsets:
                # signed, packed along the rows, as the package packs them
                tensors[f"{module}.weight_zero_point"] = pack_to_int32(_zero_points(value, name), value.bits,
                                                                       packed_dim=0)
        elif isinstance(value, QuantizedWeight):  # an embedding table: dense for compressed-tensors
            tensors[name] = value.dequantize().to(dtype)
        else:
            tensors[name] = value.contiguous()
    base["quantization_config"] = qconfig

    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        partial.mkdir()
        save_safetensors(tensors, partial / "model.safetensors", metadata={"format": "pt"})
        write_json(partial / hf_folder.CONFIG, base)
        for item in sorted(src.iterdir()):  # tokenizer and generation files; not hilt.json, not the shards
            if (item.is_file() and item.suffix not in hf_folder.WEIGHT_SUFFIXES and item.name not in
                    (hf_folder.CONFIG, hf_folder.INDEX, "hilt.json") and not item.name.startswith(".")):
                shutil.copy2(item, partial / item.name)
                make_readable(partial / item.name)
        move_into_place(partial, out)
    except OSError as e:
        shutil.rmtree(partial, ignore_errors=True)
        raise HiltError(f"{out}: cannot write ({e.strerror or one_line(e)})") from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    size = (out / "model.safetensors").stat().st_size
    return {"out": str(out), "source": str(src), "format": FORMAT, "quantized_modules": len(schemes),
            "groups": {k: v["weights"] for k, v in qconfig["config_groups"].items()}, "ignore": ignore,
            "bytes": size}
