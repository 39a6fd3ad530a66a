"""The format registry (quant/formats.py): each entry's rules, and checkpoints written before it."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hilt.errors import HiltError
from hilt.quant import QuantConfig, load_checkpoint, quantize_checkpoint, quantize_tensor
from hilt.quant.formats import FORMATS, MAX_BITS, METHODS, get_format, method_for_bits
from hilt.quant.quantize import expected_bits_per_weight

LEGACY = Path(__file__).parent / "data" / "legacy_formats"  # written by a952883: see make.py there
CASES = sorted(p.name for p in LEGACY.iterdir() if (p / "hilt.json").is_file())


def test_every_format_has_a_legacy_checkpoint():
    written = {json.loads((LEGACY / c / "hilt.json").read_text())["config"]["method"] for c in CASES}
    assert written == set(METHODS)


@pytest.mark.parametrize("case", CASES)
def test_a_checkpoint_written_before_the_registry_loads_to_the_same_weight(case):
    expected = load_file(LEGACY / "expected.safetensors")[case]
    header = json.loads((LEGACY / case / "hilt.json").read_text())
    loaded = load_checkpoint(LEGACY / case)
    q, entry = loaded["layer.weight"], header["tensors"]["layer.weight"]
    assert (q.method, q.bits, q.block_size, q.codebook_scope) == (entry["method"], entry["bits"],
                                                                  entry["block_size"], entry["codebook"])
    assert torch.equal(q.dequantize(), expected)
    assert q.bits_per_weight == pytest.approx(entry["bits_per_weight"])
    assert torch.equal(loaded["layer.bias"], load_file(LEGACY / "source.safetensors")["layer.bias"])


@pytest.mark.parametrize("case", CASES)
def test_the_writer_writes_the_same_bytes_as_before(case, tmp_path):
    header = json.loads((LEGACY / case / "hilt.json").read_text())
    config = QuantConfig(**header["config"])
    new = quantize_checkpoint(LEGACY / "source.safetensors", tmp_path / case, config).header
    assert (tmp_path / case / "model.safetensors").read_bytes() == (LEGACY / case / "model.safetensors").read_bytes()
    assert new["tensors"] == header["tensors"] and new["totals"] == header["totals"]


@pytest.mark.parametrize("method", METHODS)
def test_each_format_keeps_its_promises_at_every_width_it_takes(method):
    """Levels: 2**bits ascending (or fitted); offsets stored exactly when the entry says so; the
    bits per weight predicted without quantizing are those stored."""
    fmt = get_format(method)
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    for bits in range(fmt.min_bits, fmt.max_bits + 1):
        levels = fmt.levels(bits)
        assert (levels is None) == fmt.fitted
        if levels is not None:
            assert levels.shape == (1 << bits,) and bool((levels.diff() > 0).all())
        for codebook in ("layer", "block") if fmt.fitted else ("layer",):
            config = QuantConfig(method, bits, 32, codebook=codebook)
            q = quantize_tensor(w, config)
            assert (q.offsets is not None) == fmt.offsets
            assert q.storage_bits() == pytest.approx(expected_bits_per_weight(w.shape, config) * w.numel())
            if levels is not None:
                assert torch.equal(q.codebook.double(), levels)


def test_widths_and_scopes_a_format_cannot_take_are_refused_naming_the_argument():
    for method, fmt in FORMATS.items():
        for bits in range(1, MAX_BITS + 1):
            ok = fmt.min_bits <= bits <= fmt.max_bits
            if ok:
                QuantConfig(method, bits)
            else:
                with pytest.raises(HiltError, match=f"^method {method} "):
                    QuantConfig(method, bits)
        if not fmt.fitted:
            with pytest.raises(HiltError, match="codebook 'block' applies to method kmeans only"):
                QuantConfig(method, max(2, fmt.min_bits) if fmt.fixed_bits is None else fmt.fixed_bits,
                            codebook="block")
    with pytest.raises(HiltError, match="unknown method 'nf4'; choose one of kmeans, int"):
        get_format("nf4")


def test_a_format_below_its_fewest_bits_has_a_stand_in():
    assert method_for_bits("int", 1) == "binary" and method_for_bits("int", 2) == "int"
    assert method_for_bits("kmeans", 1) == "kmeans"
    for fmt in FORMATS.values():
        if fmt.below_min is not None:
            get_format(fmt.below_min).validate(fmt.min_bits - 1)
