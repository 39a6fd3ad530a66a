"""hilt.atomic: a file or folder appears whole or not at all, and a refused write is one clear line."""

import json
import os
from pathlib import Path

import pytest
import torch

from helpers import run_hilt
from hilt.atomic import Appender, SafetensorsWriter, replacing, save_safetensors, write_json, write_text
from hilt.errors import HiltError
from hilt.quant import QuantConfig, quantize_checkpoint
from test_gguf_export import _source



@pytest.fixture
def read_only(tmp_path):
    """A folder this process cannot write to: a chmod-ed one, or for root (who ignores modes) /sys."""
    if os.geteuid() != 0:
        folder = tmp_path / "ro"
        folder.mkdir()
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    folder = Path("/sys")
    try:
        (folder / "hilt-probe").touch()
    except OSError:
        yield folder
        return
    pytest.skip("no read-only folder to write to")


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "a.json"
    write_json(path, {"x": 1})
    with pytest.raises(ZeroDivisionError), replacing(path) as tmp:
        tmp.write_text("half")
        1 / 0
    assert path.read_text() == '{\n "x": 1\n}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_a_folder_replaces_a_folder(tmp_path):
    path = tmp_path / "state"
    for step in (1, 2):
        with replacing(path) as tmp:
            tmp.mkdir()
            write_text(tmp / "step", str(step))
    assert (path / "step").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]


def test_safetensors_are_readable_by_the_group(tmp_path):
    from safetensors.torch import load_file

    old = os.umask(0o022)
    try:
        save_safetensors({"w": torch.ones(2)}, tmp_path / "w.safetensors")
    finally:
        os.umask(old)
    assert (tmp_path / "w.safetensors").stat().st_mode & 0o777 == 0o644
    assert torch.equal(load_file(tmp_path / "w.safetensors")["w"], torch.ones(2))


@pytest.mark.parametrize("seed", range(4))
def test_a_file_written_tensor_by_tensor_is_what_save_file_writes(tmp_path, seed):
    """Tensors streamed to a scratch file, or taken from where another file stores them, give the bytes of
    safetensors' own writer for the same dictionary: its order (dtype, then name), dtype names, alignment."""
    g = torch.Generator().manual_seed(seed)
    dtypes = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
              torch.float32, torch.float64, torch.bool]
    tensors = {}
    for i in range(int(torch.randint(1, 12, (1,), generator=g))):
        dtype = dtypes[int(torch.randint(len(dtypes), (1,), generator=g))]
        shape = torch.randint(0, 5, (int(torch.randint(0, 3, (1,), generator=g)),), generator=g).tolist()
        name = ["w", "é.codes", "Z", "layers.10.x", "layers.9.x"][i % 5] + str(int(torch.randint(99, (1,), generator=g)))
        tensors[name] = (torch.randn(shape, generator=g) * 9).to(dtype)
    metadata = None if seed % 2 else {"format": "pt"}
    save_safetensors(tensors, tmp_path / "lib.safetensors", metadata=metadata)
    stored = list(tensors)[::2]  # every other one copied from the library's file
    raw = (tmp_path / "lib.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    layout = json.loads(raw[8:8 + n])
    w = SafetensorsWriter(tmp_path / "scratch.tmp")
    for name, t in tensors.items():
        if name in stored:
            a, b = layout[name]["data_offsets"]
            w.add_stored(name, t.dtype, t.shape, tmp_path / "lib.safetensors", 8 + n + a, b - a)
        else:
            w.add(name, t)
    w.finish(tmp_path / "ours.safetensors", metadata=metadata)
    assert (tmp_path / "ours.safetensors").read_bytes() == raw
    assert not (tmp_path / "scratch.tmp").exists() and len(w) == 0


def test_rows_append_whole(tmp_path):
    rows = Appender(tmp_path / "rows.jsonl")
    rows.write('{"a": 1}\n')
    rows.write('{"a": 2}\n')
    rows.close()
    assert (tmp_path / "rows.jsonl").read_text().splitlines() == ['{"a": 1}', '{"a": 2}']


def test_a_read_only_folder_is_one_error_naming_the_file(read_only):
    before = sorted(read_only.iterdir())
    for write in (lambda p: write_json(p, {}), lambda p: save_safetensors({"w": torch.ones(1)}, p),
                  lambda p: Appender(p)):
        with pytest.raises(HiltError, match=r"/out: cannot write \(.*Permission denied"):
            write(read_only / "out")
    assert sorted(read_only.iterdir()) == before


def test_export_gguf_to_a_read_only_folder_is_one_line(tmp_path, read_only):
    src = tmp_path / "src.gguf"
    _source(src)
    quantize_checkpoint(src, tmp_path / "q", QuantConfig("int", 4, 64))
    before = sorted(read_only.iterdir())
    done = run_hilt("export", "gguf", tmp_path / "q", read_only / "q.gguf")
    assert done.returncode == 1
    err = done.stderr.strip()
    assert len(err.splitlines()) == 1 and "q.gguf: cannot write (Permission denied)" in err, err
    assert sorted(read_only.iterdir()) == before


def test_an_onnx_model_to_a_read_only_folder_is_one_error(read_only):
    pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    from hilt.tasks.export import _save

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    before = sorted(read_only.iterdir())
    with pytest.raises(HiltError, match=r"q.onnx: cannot write \(Permission denied\)$"):
        _save(model, read_only / "q.onnx")
    assert sorted(read_only.iterdir()) == before
