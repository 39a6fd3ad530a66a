"""Read weights from checkpoints a user already has, one tensor at a time.

Supported: a safetensors file; a Hugging Face-style folder (one or many
safetensors shards, with or without ``model.safetensors.index.json``); a GGUF
file (through the ``gguf`` package, dequantized to float32). Pickle-based
files (``.bin``, ``.pt``, ``.pth``, ``.ckpt``) are refused, never loaded.

Tensors come in PyTorch orientation: a linear weight is (out_features,
in_features). Every error names the file, and the tensor where there is one.
"""

from __future__ import annotations

import functools
import json
import struct
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np
import torch

from hilt.errors import HiltError, one_line

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class Source(ABC):
    """A read-only, lazily loaded set of named tensors (one subclass per file format)."""

    path: Path
    format: str

    @abstractmethod
    def names(self) -> list[str]:
        """Tensor names, in a stable order."""

    @abstractmethod
    def shape(self, name: str) -> tuple[int, ...]:
        """The shape in PyTorch orientation."""

    @abstractmethod
    def stored_type(self, name: str) -> str:
        """The dtype as stored in the file (e.g. 'BF16', 'F32', 'Q4_1')."""

    def get(self, name: str) -> torch.Tensor:
        """The tensor, floating types as float32 (others unchanged)."""
        t = self.get_stored(name)
        return t.float() if t.is_floating_point() else t

    @abstractmethod
    def get_stored(self, name: str) -> torch.Tensor:
        """The tensor in its stored dtype (GGUF block formats: dequantized float32)."""

    @abstractmethod
    def is_floating(self, name: str) -> bool:
        """Whether the tensor holds floating-point values (only those can be quantized)."""

    def is_block_quantized(self, name: str) -> bool:
        """Whether the file stores the tensor in a quantized block type (GGUF's Q4_1, Q8_0, ...)."""
        return False

    def stored_bytes(self, name: str) -> tuple[Path, int, int] | None:
        """(file, offset, length) of the tensor's bytes when they are already what a safetensors file
        holds (so a writer can copy them file to file); None where the layout differs."""
        return None

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of the weight files on disk."""

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


class SafetensorsSource(Source):
    """safetensors files, validated by the safetensors library, tensors read with plain file reads.

    Plain reads rather than the library's memory map: the pages of a mapped
    file count as the process's resident memory once touched, so streaming a
    4 GB checkpoint through a map ends at 4 GB of RSS; a read keeps only the
    tensor in hand.
    """

    format = "safetensors"

    def __init__(self, path: Path, files: list[Path]):
        from safetensors import SafetensorError, safe_open

        self.path = path
        self._where: dict[str, tuple[Path, dict, int]] = {}
        for f in files:
            data_start, header = read_safetensors_header(f)
            try:
                with safe_open(str(f), framework="pt"):  # full validation of the header
                    pass
            except (SafetensorError, OSError, ValueError) as e:
                raise HiltError(f"{f}: not a readable safetensors file ({one_line(e)})") from None
            for name in sorted(k for k in header if k != "__metadata__"):
                if name in self._where:
                    raise HiltError(f"{f}: tensor '{name}' also appears in another shard")
                if header[name]["dtype"] not in SAFETENSORS_DTYPES:
                    raise HiltError(f"{f}: tensor '{name}' has dtype {header[name]['dtype']}, which hilt cannot read")
                self._where[name] = (f, header[name], data_start)

    def names(self):
        return list(self._where)

    def nbytes(self):
        return sum(f.stat().st_size for f in {f for f, _, _ in self._where.values()})

    def shape(self, name):
        return tuple(self._where[name][1]["shape"])

    def stored_type(self, name):
        return self._where[name][1]["dtype"]

    def is_floating(self, name):
        return SAFETENSORS_DTYPES[self.stored_type(name)].is_floating_point

    def stored_bytes(self, name):
        f, info, data_start = self._where[name]
        start, end = info["data_offsets"]
        return f, data_start + start, end - start

    def get_stored(self, name):
        f, info, data_start = self._where[name]
        start, end = info["data_offsets"]
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        if end == start:
            return torch.empty(info["shape"], dtype=dtype)
        buf = bytearray(end - start)
        try:
            with open(f, "rb") as fh:
                fh.seek(data_start + start)
                got = fh.readinto(buf)
        except OSError as e:
            raise HiltError(f"{f}: cannot read tensor '{name}' ({e.strerror})") from None
        if got != len(buf):
            raise HiltError(f"{f}: tensor '{name}' is cut short")
        return torch.frombuffer(buf, dtype=dtype).reshape(info["shape"])


def read_safetensors_header(f: Path) -> tuple[int, dict]:
    """(offset of the data, header). Refuses a truncated file up front: the offsets must fit the size."""
    size = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > size - 8:
                raise ValueError("header is longer than the file")
            header = json.loads(fh.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise HiltError(f"{f}: not a readable safetensors file ({one_line(e)})") from None
    if 8 + n + end > size:
        raise HiltError(f"{f}: truncated safetensors file ({size} bytes, header promises {8 + n + end})")
    return 8 + n, header


class GGUFSource(Source):
    format = "gguf"
    _NATIVE = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    _INTEGER = ("I8", "I16", "I32", "I64")

    def __init__(self, path: Path):
        self.path = path
        self.reader = read_gguf(path)
        self._tensors = {t.name: t for t in self.reader.tensors}

    def names(self):
        return list(self._tensors)

    def shape(self, name):
        return tuple(int(s) for s in reversed(self._tensors[name].shape))  # GGUF lists dims innermost first

    def stored_type(self, name):
        return self._tensors[name].tensor_type.name

    def is_floating(self, name):
        return self.stored_type(name) not in self._INTEGER

    def is_block_quantized(self, name):
        kind = self.stored_type(name)
        return kind not in self._INTEGER and kind not in self._NATIVE

    def nbytes(self):
        return self.path.stat().st_size

    def get_stored(self, name):
        """F64/F32/F16/BF16 in that dtype, integers as they are, block types dequantized to float32."""
        import gguf

        t = self._tensors[name]
        kind = t.tensor_type.name
        if kind in self._INTEGER or kind in ("F32", "F64", "F16"):
            return torch.from_numpy(np.array(t.data)).reshape(self.shape(name))  # a writable copy
        try:  # block types, and BF16 (raw 16-bit words in the file)
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except (NotImplementedError, ValueError, KeyError) as e:
            raise HiltError(f"{self.path}: tensor '{name}' has GGUF type {kind}, which hilt cannot read ({one_line(e)})") from None
        out = torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(self.shape(name))
        return out.to(self._NATIVE.get(kind, torch.float32))


def read_gguf(path):
    """The parsed GGUF file at ``path`` (a ``gguf.GGUFReader``), shared while the file is unchanged
    (same size, time and inode): parsing a model's metadata (its vocabulary is tens of thousands of
    strings) takes seconds, and loading a model reads it more than once. Raises HiltError naming the file."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError:
        raise HiltError(f"{path}: no such GGUF file") from None
    if not path.is_file():
        raise HiltError(f"{path}: not a GGUF file (a folder)")
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as e:
        raise HiltError(f"{path}: cannot read ({e.strerror})") from None
    if magic != b"GGUF":  # checked here: gguf's reader says only "magic invalid", or numpy's words on a tiny file
        found = f"starts with {magic!r}" if magic else "empty"
        raise HiltError(f"{path}: not a GGUF file ({found}, a GGUF file with b'GGUF')")
    try:
        return _parsed_gguf(str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    except _Truncated as e:
        what = "its tensor table promises" if e.whole else "its header alone needs at least"
        raise HiltError(f"{path}: truncated GGUF file ({st.st_size} bytes, {what} {e.needed}); "
                        "copy or download it again") from None
    except Exception as e:  # gguf raises ValueError/struct errors on a bad file
        raise HiltError(f"{path}: not a readable GGUF file ({one_line(e)})") from None


class _Truncated(Exception):
    def __init__(self, needed: int, whole: bool):
        super().__init__(needed)
        self.needed, self.whole = needed, whole


@functools.lru_cache(maxsize=2)
def _parsed_gguf(path: str, size: int, mtime_ns: int, inode: int):
    import gguf

    class CheckedReader(gguf.GGUFReader):
        """gguf's reader, refusing reads past the end of the file: its own slices come back short there,
        and numpy then fails with a message about dtypes or shapes that never says "truncated". Its
        slices are of a plain ndarray over the same memory map: slicing the np.memmap itself costs
        half the time of parsing a vocabulary of tens of thousands of strings."""

        def _get(self, offset, dtype, count=1, override_order=None):
            count, dtype = int(count), np.dtype(dtype)
            end = int(offset) + dtype.itemsize * count
            if end > len(self.data):
                raise _Truncated(end, whole=False)
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            arr = plain[offset:end].view(dtype)
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        def _build_tensors(self, start_offs, fields):
            # the end of the last tensor: the size the file must have, said before any tensor is cut
            need = 0
            for field in fields:
                dims, raw_type, offset = field.parts[3], field.parts[4], field.parts[5]
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_type[0]))]
                need = max(need, int(start_offs) + int(offset[0]) + int(np.prod(dims)) * type_size // block)
            if need > len(self.data):
                raise _Truncated(need, whole=True)
            return super()._build_tensors(start_offs, fields)

    return CheckedReader(path)  # a read-only memory map: sharing it is safe


def open_source(path) -> Source:
    """Open a checkpoint for reading (see module docstring). Raises HiltError on bad input."""
    path = Path(path)
    if not path.exists():
        raise HiltError(f"{path}: no such file or directory")
    if path.is_dir():
        return _open_folder(path)
    if path.suffix in PICKLE_SUFFIXES:
        raise HiltError(f"{path}: pickle-based checkpoint; hilt never loads pickles, convert it to safetensors")
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as e:
        raise HiltError(f"{path}: cannot read ({e.strerror})") from None
    if magic == b"GGUF":
        return GGUFSource(path)
    if path.suffix == ".gguf":
        return GGUFSource(path)  # read_gguf names what the file holds instead
    return SafetensorsSource(path, [path])


def _open_folder(path: Path) -> Source:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise HiltError(f"{index}: not a valid safetensors index ({one_line(e)})") from None
        files = sorted({path / f for f in weight_map.values()})
        missing = [f for f in files if not f.exists()]
        if missing:
            raise HiltError(f"{index}: shard {missing[0].name} is missing")
        return SafetensorsSource(path, files)
    files = sorted(path.glob("*.safetensors"))
    if files:
        return SafetensorsSource(path, files)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return GGUFSource(ggufs[0])
    pickles = [f.name for f in path.iterdir() if f.suffix in PICKLE_SUFFIXES]
    if pickles:
        raise HiltError(f"{path}: only pickle-based weights ({pickles[0]}); hilt never loads pickles, convert to safetensors")
    raise HiltError(f"{path}: no weights found (no *.safetensors, index or single *.gguf file)")
