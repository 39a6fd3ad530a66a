"""Writes the checkpoints of tests/test_formats.py's legacy test: one tiny checkpoint per format,
with the dequantized weight each represents. Run once, with the code of the commit before the
format registry (a952883), so that the test checks that checkpoints written then still load:

    .venv/bin/python tests/data/legacy_formats/make.py
"""

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from hilt.quant import QuantConfig, load_checkpoint, quantize_checkpoint

HERE = Path(__file__).parent
CASES = {  # folder: the format written there
    "kmeans4": QuantConfig(method="kmeans", bits=4, block_size=32),
    "kmeans2-block": QuantConfig(method="kmeans", bits=2, block_size=16, codebook="block"),
    "kmeans1-lloyd": QuantConfig(method="kmeans", bits=1, block_size=32, solver="lloyd", seed=3),
    "int4": QuantConfig(method="int", bits=4, block_size=32),
    "int-asym3": QuantConfig(method="int-asym", bits=3, block_size=16),
    "binary1": QuantConfig(method="binary", bits=1, block_size=64),
}


def main() -> None:
    g = torch.Generator().manual_seed(35)
    src = HERE / "source.safetensors"
    save_file({"layer.weight": torch.randn(8, 64, generator=g) * 0.05,
               "layer.bias": torch.randn(8, generator=g)}, src)
    expected = {}
    for name, config in CASES.items():
        dst = HERE / name
        shutil.rmtree(dst, ignore_errors=True)
        quantize_checkpoint(src, dst, config)
        expected[name] = load_checkpoint(dst)["layer.weight"].dequantize().float().contiguous()
    save_file(expected, HERE / "expected.safetensors")


if __name__ == "__main__":
    main()
