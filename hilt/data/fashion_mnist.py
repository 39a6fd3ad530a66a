"""Fashion-MNIST, read from the Debian package `dataset-fashion-mnist` (docs/assets.md).

The package installs the original gzip-compressed IDX files under
/usr/share/datasets/fashion-mnist:

    train-images-idx3-ubyte.gz  60,000 images, 28x28 uint8
    train-labels-idx1-ubyte.gz  60,000 labels, uint8 in 0..9
    t10k-images-idx3-ubyte.gz   10,000 images
    t10k-labels-idx1-ubyte.gz   10,000 labels

IDX layout: a big-endian header (magic number 0x00000803 for a 3-d uint8
array of images, 0x00000801 for a 1-d uint8 array of labels, then one uint32
per dimension: 16 bytes for images, 8 for labels), then the raw bytes.
"""

from __future__ import annotations

import gzip
import math
import zlib
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from hilt.errors import HiltError

DEFAULT_ROOT = Path("/usr/share/datasets/fashion-mnist")
INSTALL_HINT = "install it with `apt-get update && apt-get install -y dataset-fashion-mnist` (or run scripts/setup.sh)"

CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
           "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")

_PREFIX = {"train": "train", "test": "t10k"}
_IMAGES_MAGIC = 0x00000803  # uint8 data, 3 dimensions
_LABELS_MAGIC = 0x00000801  # uint8 data, 1 dimension
_SIDE = 28


def _read_idx(path: Path, magic: int, ndim: int) -> np.ndarray:
    """Decode one gzip IDX file into a uint8 array, checking its magic number and size."""
    if not path.is_file():
        raise HiltError(f"Fashion-MNIST file {path} is missing; {INSTALL_HINT}")
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as e:
        raise HiltError(f"{path}: not a readable gzip file ({e})") from None
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise HiltError(f"{path}: {len(raw)} bytes, shorter than the {header}-byte IDX header")
    found = int.from_bytes(raw[:4], "big")
    if found != magic:
        raise HiltError(f"{path}: IDX magic number is 0x{found:08x}, expected 0x{magic:08x}")
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    size = math.prod(dims)
    if len(raw) != header + size:
        raise HiltError(f"{path}: header says {'x'.join(map(str, dims))} = {size} bytes of data, "
                        f"the file holds {len(raw) - header}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


@lru_cache(maxsize=8)
def _raw(root: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """The decoded uint8 images [N,28,28] and labels [N] of one split (cached, read-only)."""
    base = Path(root)
    images_path = base / f"{_PREFIX[split]}-images-idx3-ubyte.gz"
    labels_path = base / f"{_PREFIX[split]}-labels-idx1-ubyte.gz"
    images = _read_idx(images_path, _IMAGES_MAGIC, 3)
    labels = _read_idx(labels_path, _LABELS_MAGIC, 1)
    if images.shape[1:] != (_SIDE, _SIDE):
        raise HiltError(f"{images_path}: images are {images.shape[1]}x{images.shape[2]}, expected {_SIDE}x{_SIDE}")
    if len(images) != len(labels):
        raise HiltError(f"{labels_path}: {len(labels)} labels for {len(images)} images in {images_path}")
    if len(labels) and labels.max() >= len(CLASSES):
        raise HiltError(f"{labels_path}: label {int(labels.max())} outside 0..{len(CLASSES) - 1}")
    return images, labels  # np.frombuffer arrays over bytes are read-only


@lru_cache(maxsize=8)
def _train_stats(root: str) -> tuple[float, float]:
    """Mean and standard deviation of the training pixels scaled to [0, 1]."""
    images, _ = _raw(root, "train")
    x = images.astype(np.float64) / 255.0
    return float(x.mean()), float(x.std())


def train_stats(root: str | Path | None = None) -> tuple[float, float]:
    """(mean, std) used to normalise both splits: those of the training images in [0, 1]."""
    return _train_stats(str(Path(root) if root is not None else DEFAULT_ROOT))


def load_fashion_mnist(split: str = "train", root: str | Path | None = None,
                       limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fashion-MNIST ``split`` ("train" or "test") as (images, labels).

    images: float32 [N, 1, 28, 28], pixels scaled to [0, 1] then normalised
    with the training set's mean and std (so both splits use the same
    transform). labels: int64 [N] in 0..9. ``root`` is the folder holding the
    four .gz files (default: where the Debian package puts them). ``limit``
    keeps only the first ``limit`` images (the normalisation still uses the
    whole training split).

    Decoded files are cached in memory; each call returns fresh tensors, so a
    caller may modify them in place.
    """
    if split not in _PREFIX:
        raise HiltError(f"unknown Fashion-MNIST split {split!r}; choose 'train' or 'test'")
    key = str(Path(root) if root is not None else DEFAULT_ROOT)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise HiltError(f"limit must be a positive int, got {limit!r}")
    images, labels = _raw(key, split)
    images, labels = images[:limit], labels[:limit]
    mean, std = _train_stats(key)
    x = torch.from_numpy(images.astype(np.float32)).div_(255.0).sub_(mean).div_(std).unsqueeze(1)
    y = torch.from_numpy(labels.astype(np.int64))
    return x, y
