"""Files written whole or not at all: every writer in hilt goes through here.

A file (or folder) is built under a temporary name beside its destination and renamed over it
once complete, so a reader, a crash or a Ctrl-C never finds half of one, and a failed write
leaves neither a temporary nor a changed destination. A write the system refuses (a read-only
folder, a full disk) becomes one HiltError naming the destination; the clean-up never hides it.
Imports nothing of the project but the error class, so every package can use it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from hilt.errors import HiltError, one_line


def _remove(path: Path) -> None:
    """Remove a file or a folder, quietly: clean-up after a failure must not raise a second error."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


def make_readable(path) -> None:
    """Give a file the permissions the umask allows: some writers (safetensors) create owner-only files."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def check_parent(path) -> None:
    """Refuse, before any work, a destination whose folder is missing, a file, or not writable."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise HiltError(f"{path}: parent folder {parent} " + ("is a file" if parent.exists() else "does not exist"))
    if not os.access(parent, os.W_OK | os.X_OK):
        raise HiltError(f"{path}: folder {parent} is not writable")


def check_out_folder(path) -> None:
    """Refuse, before any work, a folder to write results into that is a file, or cannot be made or written."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise HiltError(f"{path}: is a file; a folder to write results into is needed")
        if not os.access(path, os.W_OK | os.X_OK):
            raise HiltError(f"{path}: folder is not writable")
        return
    check_parent(path)


def move_into_place(tmp, path) -> None:
    """Rename a finished ``tmp`` over ``path``; a folder already at ``path`` is moved aside first
    and removed only once the new one is in place."""
    tmp, path = Path(tmp), Path(path)
    if tmp.is_dir() and path.is_dir():
        old = path.with_name(path.name + ".old")
        _remove(old)
        os.replace(path, old)
        os.replace(tmp, path)
        _remove(old)
    else:
        os.replace(tmp, path)


@contextlib.contextmanager
def replacing(path, suffix: str = ".tmp", *, unique: bool = False) -> Iterator[Path]:
    """``with replacing(dst) as tmp:`` write a file or a folder at ``tmp``; on a clean exit it
    replaces ``dst`` (a folder replaces a folder, the old one removed only after the rename).
    On any error ``tmp`` is removed and ``dst`` is left as it was; an OSError becomes a HiltError
    naming ``dst``. ``unique`` gives each writer its own temporary name, for processes that may
    build the same file at once."""
    path = Path(path)
    tag = f".{os.getpid()}-{uuid.uuid4().hex[:8]}" if unique else ""
    tmp = path.with_name(path.name + tag + suffix)
    _remove(tmp)
    try:
        yield tmp
        move_into_place(tmp, path)
    except OSError as e:
        _remove(tmp)
        raise HiltError(f"{path}: cannot write ({e.strerror or one_line(e)})") from None
    except BaseException:
        _remove(tmp)
        raise


def write_text(path, text: str, *, fsync: bool = False) -> None:
    """Write ``text`` whole; ``fsync`` also forces it to disk before the rename (files a resumed run trusts)."""
    path = Path(path)
    if not path.parent.is_dir():
        raise HiltError(f"{path}: folder {path.parent} does not exist")
    with replacing(path) as tmp, open(tmp, "w") as f:
        f.write(text)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def write_json(path, obj, *, sort_keys: bool = False) -> None:
    """Write ``obj`` as indented JSON, whole."""
    write_text(path, json.dumps(obj, indent=1, sort_keys=sort_keys) + "\n")


def save_safetensors(tensors: dict, path, metadata: dict | None = None) -> None:
    """Write a safetensors file whole, readable as the umask allows."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    path = Path(path)
    try:
        with replacing(path) as tmp:
            save_file(tensors, str(tmp), metadata=metadata)
            make_readable(tmp)
    except SafetensorError as e:
        raise HiltError(f"{path}: cannot write ({one_line(e)})") from None


class SafetensorsWriter:
    """One safetensors file built a tensor at a time and never held whole in memory: each tensor's bytes go
    to the file ``scratch`` as they arrive (the page cache keeps them, not this process), or stay where
    another safetensors file already holds them (:meth:`add_stored`: a table of gigabytes is copied file
    to file by the kernel). :meth:`finish` writes the file safetensors' ``save_file`` writes for the same
    tensors, byte for byte: the library itself orders the tensors and names their dtypes."""

    def __init__(self, scratch):
        self.scratch = Path(scratch)
        self._file = None
        self._parts: dict[str, tuple] = {}  # name -> (torch dtype name, shape, file, offset, length)
        self.nbytes = 0  # of the tensors added so far

    def __len__(self) -> int:
        return len(self._parts)

    def add(self, name: str, tensor) -> None:
        import torch

        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()  # its bytes, no copy
        if self._file is None:
            self._file = open(self.scratch, "w+b")
        offset = self._file.tell()
        self._file.write(memoryview(data))
        self._parts[name] = (str(tensor.dtype).removeprefix("torch."), list(tensor.shape), self.scratch, offset,
                             data.nbytes)
        self.nbytes += data.nbytes

    def add_stored(self, name: str, dtype, shape, src, offset: int, length: int) -> None:
        """A tensor whose bytes are ``length`` bytes of the file ``src`` from ``offset``, already in
        safetensors' layout (little-endian, row-major)."""
        self._parts[name] = (str(dtype).removeprefix("torch."), list(shape), Path(src), offset, length)
        self.nbytes += length

    def finish(self, path, metadata: dict | None = None) -> None:
        """Write the file at ``path`` (whole or not at all) and remove the scratch file."""
        from safetensors import TensorSpec, serialize

        if self._file is not None:
            self._file.flush()
        # the library's order and dtype names, from a file of the same tensors with no elements
        probe = serialize({n: TensorSpec(dtype=p[0], shape=[0], data_ptr=0, data_len=0)
                           for n, p in self._parts.items()}, metadata=metadata)
        probe = bytes(probe)
        layout = json.loads(probe[8 : 8 + int.from_bytes(probe[:8], "little")])
        header, order, end = {}, [n for n in layout if n != "__metadata__"], 0
        if "__metadata__" in layout:
            header["__metadata__"] = layout["__metadata__"]
        for n in order:
            _, shape, _, _, length = self._parts[n]
            header[n] = {"dtype": layout[n]["dtype"], "shape": shape, "data_offsets": [end, end + length]}
            end += length
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        path = Path(path)
        try:
            with replacing(path) as tmp, open(tmp, "wb") as out:
                out.write(len(text).to_bytes(8, "little") + text)
                out.flush()
                for n in order:
                    _, _, src, offset, length = self._parts[n]
                    _copy_range(src, out, offset, length, n)
        finally:
            self.discard()

    def discard(self) -> None:
        """Forget the tensors and remove the scratch file (after finish, or instead of it)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self.scratch.unlink(missing_ok=True)
        self._parts, self.nbytes = {}, 0


def _copy_range(src: Path, out, offset: int, length: int, name: str) -> None:
    """Append ``length`` bytes of ``src`` from ``offset`` to the open file ``out``: by the kernel where it
    can (copy_file_range), through a bounded buffer across file systems or where it is not offered."""
    with open(src, "rb") as fin:
        done, in_kernel = 0, hasattr(os, "copy_file_range")
        while done < length:
            n = 0
            if in_kernel:
                try:
                    n = os.copy_file_range(fin.fileno(), out.fileno(), length - done, offset + done)
                except OSError as e:
                    if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                        raise
                    in_kernel = False
            if not in_kernel:
                fin.seek(offset + done)
                n = out.write(fin.read(min(length - done, 1 << 24)))
            if n == 0:
                raise HiltError(f"{src}: tensor '{name}' is cut short")
            done += n
    out.flush()  # what went through the buffer lands before the next kernel copy


class Appender:
    """A file that rows are appended to: each row is one write, then fsync, so a kill leaves whole
    rows and at most one partial last line (which a resumed reader drops)."""

    def __init__(self, path):
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise HiltError(f"{path}: cannot write ({e.strerror or one_line(e)})") from None

    def write(self, text: str) -> None:
        os.write(self.fd, text.encode())
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)
