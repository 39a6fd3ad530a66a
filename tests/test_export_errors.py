"""Bad input to every `hilt export` format, through the command line: a format the target cannot hold, a
source that is not a hilt checkpoint, an existing destination without --overwrite, a destination that cannot
be written. Each is one line on stderr, exit 1, and leaves nothing behind."""

import os

import pytest

pytest.importorskip("transformers")

from hilt.cli import main  # noqa: E402
from hilt.quant import QuantConfig, quantize_checkpoint  # noqa: E402

from test_hf import tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A tiny Llama folder quantized three ways: int4 (every target holds it but ONNX, which exports MiniLM),
    k-means 4-bit (no GGUF block type, no compressed-tensors grid) and an empty folder that is no checkpoint."""
    root = tmp_path_factory.mktemp("export-errors")
    src = tiny_llama(root / "src")
    out = {}
    for name, cfg in [("int4", QuantConfig("int", 4, 32)), ("kmeans", QuantConfig("kmeans", 4, 32))]:
        quantize_checkpoint(src, root / name, cfg)
        out[name] = root / name
    (root / "empty").mkdir()
    out["empty"] = root / "empty"
    return out


# (target, file or folder to write)
TARGETS = [("gguf", "out.gguf"), ("onnx", "out.onnx"), ("compressed-tensors", "out-ct")]


def _fails(capsys, argv, where):
    before = sorted(os.listdir(where))
    code = main(["-q", *map(str, argv)])
    err = capsys.readouterr().err.strip()
    assert code == 1, err
    assert len(err.splitlines()) == 1 and err.startswith("hilt: error: "), err
    assert sorted(os.listdir(where)) == before, "something was left behind"
    return err


@pytest.mark.parametrize("target,name", TARGETS)
def test_a_format_the_target_cannot_hold(ckpts, tmp_path, capsys, target, name):
    src = ckpts["int4"] if target == "onnx" else ckpts["kmeans"]
    err = _fails(capsys, ["export", target, src, tmp_path / name], tmp_path)
    assert ("BERT" in err) if target == "onnx" else ("kmeans" in err), err


@pytest.mark.parametrize("target,name", TARGETS)
def test_a_source_that_is_not_a_hilt_checkpoint(ckpts, tmp_path, capsys, target, name):
    err = _fails(capsys, ["export", target, ckpts["empty"], tmp_path / name], tmp_path)
    assert str(ckpts["empty"]) in err, err
    missing = tmp_path / "nothing-here"
    _fails(capsys, ["export", target, missing, tmp_path / name], tmp_path)


@pytest.mark.parametrize("target,name", TARGETS)
def test_an_existing_destination_without_overwrite(ckpts, tmp_path, capsys, target, name):
    dst = tmp_path / name
    if name.endswith("ct"):
        dst.mkdir()
        (dst / "keep.txt").write_text("mine")
    else:
        dst.write_bytes(b"mine")
    src = ckpts["int4"]
    err = _fails(capsys, ["export", target, src, dst], tmp_path)
    assert "--overwrite" in err, err
    assert (dst / "keep.txt" if dst.is_dir() else dst).read_bytes() == b"mine"


@pytest.mark.parametrize("target,name", TARGETS)
def test_a_destination_that_cannot_be_written(ckpts, tmp_path, capsys, target, name):
    """Under a regular file (a read-only folder would not stop root, who may run the tests)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    src = ckpts["kmeans" if target == "onnx" else "int4"]
    err = _fails(capsys, ["export", target, src, blocker / name], tmp_path)
    assert "a-file" in err, err


def test_a_read_only_folder_is_refused_in_one_line(ckpts, tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders; the file-as-folder case above covers the refusal")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        for target, name in TARGETS:
            if target != "onnx":
                _fails(capsys, ["export", target, ckpts["int4"], ro / name], ro)
    finally:
        ro.chmod(0o700)
