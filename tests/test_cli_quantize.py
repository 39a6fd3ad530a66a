"""`hilt quantize` / `hilt inspect` as a user runs them, including every bad input."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from helpers import make_checkpoint, read_json, run_hilt
from hilt.errors import HiltError
from hilt.quant import QuantConfig, load_checkpoint, quantize_checkpoint


def assert_clean_failure(result, *needles, dst=None):
    assert result.returncode != 0
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1, err  # one line, no traceback
    assert err.startswith("hilt: error:") or err.startswith("hilt: interrupted"), err
    for n in needles:
        assert n in err, err
    if dst is not None:
        assert not Path(dst).exists()
        assert not Path(str(dst) + ".partial").exists()


def assert_bad_flag(result, command, flag, *needles):
    """A bad flag value: one line naming the command and the flag, exit 2, no usage block."""
    assert result.returncode == 2, result.stderr
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"hilt {command}: error: {flag}"), err
    for n in needles:
        assert n in err, err
    assert result.stdout == ""


def test_quantize_inspect_and_json(tiny_ckpt, tmp_path):
    dst, js = tmp_path / "out", tmp_path / "report.json"
    r = run_hilt("quantize", tiny_ckpt, dst, "--method", "kmeans", "--bits", "2", "--json", js)
    assert r.returncode == 0, r.stderr
    assert "model.layers.0.mlp.up_proj.weight" in r.stdout and "bits/weight" in r.stdout
    assert r.stderr == ""
    report = read_json(js)
    names = {t["name"] for t in report["tensors"]}
    # embeddings, the LM head and 1-D norms stay unquantized by default
    assert names == {f"model.layers.{i}.{p}.weight" for i in range(2)
                     for p in ("self_attn.q_proj", "mlp.up_proj", "mlp.down_proj")}
    for t in report["tensors"]:
        assert set(t) >= {"name", "bits_per_weight", "rel_error"}
        assert t["bits_per_weight"] == pytest.approx(2.25, abs=0.01) and 0 < t["rel_error"] < 0.6
    header = read_json(dst / "hilt.json")
    assert header["format"] == "hilt-quantized" and header["format_version"] == 2
    loaded = load_checkpoint(dst)
    assert torch.equal(loaded["lm_head.weight"], make_checkpoint(tmp_path / "again.safetensors")["lm_head.weight"])
    r = run_hilt("inspect", dst, "--tensors")
    assert r.returncode == 0 and "kmeans, 2 bits, block 64" in r.stdout and "lm_head.weight" in r.stdout
    shard = dst / header["shards"][0]
    for again, why in ((dst, "already a hilt quantized checkpoint"), (shard, "holds quantized codes and scales")):
        assert_clean_failure(run_hilt("quantize", again, tmp_path / "twice", "--dry-run"), why, dst=tmp_path / "twice")
    with pytest.raises(HiltError, match="already a hilt quantized checkpoint"):
        quantize_checkpoint(dst, tmp_path / "twice", QuantConfig("int", 4, 64))
    with open(shard, "r+b") as f:  # cut short, as a copy that stopped half-way leaves it
        f.truncate(shard.stat().st_size // 2)
    assert_clean_failure(run_hilt("inspect", dst), f"{shard}: not a readable safetensors file")
    with pytest.raises(HiltError, match="not a readable safetensors file"):
        load_checkpoint(dst)


def test_only_and_ignore_select_tensors(tiny_ckpt, tmp_path):
    r = run_hilt("quantize", tiny_ckpt, tmp_path / "o", "--only", r"layers\.0\.", "--ignore", "down_proj",
                 "--json", tmp_path / "o.json")
    assert r.returncode == 0, r.stderr
    names = {t["name"] for t in read_json(tmp_path / "o.json")["tensors"]}
    assert names == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"}


def test_dry_run_writes_nothing(tiny_ckpt, tmp_path):
    r = run_hilt("quantize", tiny_ckpt, tmp_path / "d", "--bits", "3", "--dry-run")
    assert r.returncode == 0 and "6 tensors to quantize" in r.stdout and "3.25" in r.stdout
    assert not (tmp_path / "d").exists()


def test_folder_with_sharded_index(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    t = make_checkpoint(tmp_path / "full.safetensors")
    names = sorted(t)
    half = len(names) // 2
    save_file({n: t[n] for n in names[:half]}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({n: t[n] for n in names[half:]}, str(folder / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {n: f"model-0000{1 + (i >= half)}-of-00002.safetensors" for i, n in enumerate(names)}}
    (folder / "model.safetensors.index.json").write_text(__import__("json").dumps(index))
    (folder / "config.json").write_text("{}")
    r = run_hilt("quantize", folder, tmp_path / "q", "--method", "int", "--bits", "4")
    assert r.returncode == 0, r.stderr
    assert len(load_checkpoint(tmp_path / "q")) == len(names)


def test_real_minilm_all_methods(minilm_dir, tmp_path):
    errors = {}
    for method, bits in [("kmeans", 2), ("int", 2), ("binary", 1), ("kmeans", 1)]:
        js = tmp_path / f"{method}{bits}.json"
        r = run_hilt("quantize", minilm_dir, tmp_path / f"{method}{bits}", "--method", method, "--bits", bits,
                     "--only", r"encoder\.layer\.[05]\.", "--json", js, "--quiet")  # the first and last layers
        assert r.returncode == 0, r.stderr
        errors[method, bits] = read_json(js)["totals"]["rel_error_mean"]
    assert errors["kmeans", 2] < errors["int", 2]
    assert errors["kmeans", 1] <= errors["binary", 1] + 1e-4


# ------------------------------------------------------------------ bad input


def test_missing_source(tmp_path):
    r = run_hilt("quantize", tmp_path / "nope.safetensors", tmp_path / "o")
    assert_clean_failure(r, "nope.safetensors", "no such file", dst=tmp_path / "o")


def test_truncated_safetensors(tiny_ckpt, tmp_path):
    bad = tmp_path / "cut.safetensors"
    bad.write_bytes(tiny_ckpt.read_bytes()[:-1000])
    assert_clean_failure(run_hilt("quantize", bad, tmp_path / "o"), "cut.safetensors", "truncated", dst=tmp_path / "o")


def test_corrupt_safetensors(tmp_path):
    bad = tmp_path / "junk.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + bytes(100))
    assert_clean_failure(run_hilt("quantize", bad, tmp_path / "o"), "junk.safetensors", "not a readable safetensors",
                         dst=tmp_path / "o")


def test_folder_without_weights(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    assert_clean_failure(run_hilt("quantize", tmp_path / "empty", tmp_path / "o"), "no weights found", dst=tmp_path / "o")


def test_pickles_are_refused(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    assert_clean_failure(run_hilt("quantize", tmp_path / "m", tmp_path / "o"), "never loads pickles", dst=tmp_path / "o")


def _gguf_with(tmp_path, raw_type, data: np.ndarray, shape):
    import gguf

    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.ffn_up.weight", data, raw_shape=shape, raw_dtype=raw_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_unreadable_tensor_type(tmp_path):
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_K]
    path = _gguf_with(tmp_path, gguf.GGMLQuantizationType.Q8_K, np.zeros((64, size), dtype=np.uint8), (64, size))
    r = run_hilt("quantize", path, tmp_path / "o")
    assert_clean_failure(r, "odd.gguf", "blk.0.ffn_up.weight", "Q8_K", dst=tmp_path / "o")


def test_gguf_small_file_quantizes(tmp_path):
    import gguf

    data = np.random.default_rng(0).standard_normal((32, 128)).astype(np.float32)
    path = _gguf_with(tmp_path, gguf.GGMLQuantizationType.F32, data, (32, 128))
    r = run_hilt("quantize", path, tmp_path / "o", "--bits", "3")
    assert r.returncode == 0, r.stderr
    q = load_checkpoint(tmp_path / "o")["blk.0.ffn_up.weight"]
    assert q.shape == (32, 128)  # PyTorch orientation (GGUF lists dims innermost first)
    ref = torch.from_numpy(data)
    assert float((q.dequantize() - ref).norm() / ref.norm()) < 0.25  # 3-bit error, and not transposed


def test_nan_weight_names_tensor(tmp_path):
    t = make_checkpoint(tmp_path / "m.safetensors")
    t["model.layers.1.mlp.up_proj.weight"][0, 0] = float("inf")
    save_file(t, str(tmp_path / "m.safetensors"))
    r = run_hilt("quantize", tmp_path / "m.safetensors", tmp_path / "o")
    assert_clean_failure(r, "model.layers.1.mlp.up_proj.weight", "NaN or Inf", dst=tmp_path / "o")


@pytest.mark.parametrize("bits", ["0", "9", "abc", "2.5"])
def test_bits_out_of_range(tiny_ckpt, tmp_path, bits):
    r = run_hilt("quantize", tiny_ckpt, tmp_path / "o", "--bits", bits)
    assert_bad_flag(r, "quantize", "--bits", f"expected an integer 1..8, got '{bits}'")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args,flag,needle", [
    (["--method", "foo"], "--method", "expected one of kmeans, int, int-asym, binary, got 'foo'"),
    (["--block-size", "x"], "--block-size", "expected a positive integer, got 'x'"),
    (["--block-size", "0"], "--block-size", "expected a positive integer, got '0'"),
    (["--shard-size", "-1"], "--shard-size", "expected a positive number"),
    (["--codebook", "row"], "--codebook", "expected one of layer, block"),
    (["--method", "binary", "--bits", "4"], "--method binary", "--bits 4"),
    (["--method", "kmeans", "--asymmetric"], "--asymmetric", "--method int"),
    (["--method", "int", "--solver", "lloyd"], "--solver", "--method kmeans only"),
    (["--frobnicate"], "unrecognized arguments", "--frobnicate"),
])
def test_bad_flags_are_one_line(tiny_ckpt, tmp_path, args, flag, needle):
    assert_bad_flag(run_hilt("quantize", tiny_ckpt, tmp_path / "o", *args), "quantize", flag, needle)
    assert not (tmp_path / "o").exists()


def test_method_binary_implies_one_bit(tiny_ckpt, tmp_path):
    r = run_hilt("quantize", tiny_ckpt, tmp_path / "b", "--method", "binary", "--json", tmp_path / "b.json")
    assert r.returncode == 0, r.stderr
    report = read_json(tmp_path / "b.json")
    assert report["config"]["method"] == "binary" and report["config"]["bits"] == 1
    assert all(t["bits_per_weight"] == pytest.approx(1.25, abs=0.01) for t in report["tensors"])
    assert read_json(tmp_path / "b" / "hilt.json")["config"]["bits"] == 1
    r = run_hilt("quantize", tiny_ckpt, tmp_path / "b1", "--method", "binary", "--bits", "1")  # said explicitly
    assert r.returncode == 0, r.stderr


def test_version_is_the_package_metadata(tiny_ckpt, tmp_path):
    from importlib.metadata import version

    import hilt
    from hilt.quant.checkpoint import TOOL_VERSION

    r = run_hilt("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"hilt {version('hilt')}", r.stdout
    assert hilt.__version__ == TOOL_VERSION == version("hilt")
    assert run_hilt("quantize", tiny_ckpt, tmp_path / "o", "--bits", "2").returncode == 0
    assert read_json(tmp_path / "o" / "hilt.json")["tool_version"] == version("hilt")


def test_json_to_stdout(tiny_ckpt, tmp_path):
    r = run_hilt("quantize", tiny_ckpt, tmp_path / "o", "--bits", "2", "--json", "-")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)  # nothing else on stdout
    assert report["config"]["bits"] == 2 and len(report["tensors"]) == 6
    assert "wrote" in r.stderr and "[6/6]" in r.stderr
    r = run_hilt("inspect", tmp_path / "o", "--tensors", "--json", "-")
    assert r.returncode == 0 and json.loads(r.stdout)["config"]["bits"] == 2
    assert "lm_head.weight" in r.stderr
    assert not (tmp_path / "-").exists()


def test_progress_lines_without_a_terminal(tiny_ckpt, tmp_path):
    """Not a tty (a pipe here): one line per quantized tensor, in order, with its time."""
    r = run_hilt("quantize", tiny_ckpt, tmp_path / "o", "--bits", "2")
    assert r.returncode == 0, r.stderr
    lines = [m.groups() for m in re.finditer(r"^\[(\d+)/(\d+)\] (\S+) \.\.\. \d+\.\ds  2\.\d+ bits/weight",
                                             r.stdout, re.M)]
    assert [(int(i), int(n)) for i, n, _ in lines] == [(i, 6) for i in range(1, 7)], r.stdout
    assert lines[0][2] == "model.layers.0.mlp.down_proj.weight"
    assert "\r" not in r.stdout + r.stderr  # no bar
    quiet = run_hilt("quantize", tiny_ckpt, tmp_path / "q", "--bits", "2", "-q")
    assert quiet.returncode == 0 and quiet.stdout.startswith("wrote") and len(quiet.stdout.splitlines()) == 1


def test_block_size_that_does_not_divide(tiny_ckpt, tmp_path):
    r = run_hilt("quantize", tiny_ckpt, tmp_path / "o", "--block-size", "48")
    assert_clean_failure(r, "model.layers.0.mlp.down_proj.weight", "not a multiple of --block-size 48",
                         dst=tmp_path / "o")


def test_existing_destination_needs_overwrite(tiny_ckpt, tmp_path):
    dst = tmp_path / "o"
    assert run_hilt("quantize", tiny_ckpt, dst, "--bits", "2").returncode == 0
    before = (dst / "hilt.json").read_bytes()
    r = run_hilt("quantize", tiny_ckpt, dst, "--bits", "4")
    assert_clean_failure(r, "already exists", "--overwrite")
    assert (dst / "hilt.json").read_bytes() == before  # untouched
    assert run_hilt("quantize", tiny_ckpt, dst, "--bits", "4", "--overwrite").returncode == 0
    assert read_json(dst / "hilt.json")["config"]["bits"] == 4


def test_overwrite_refuses_a_folder_that_is_not_ours(tiny_ckpt, tmp_path):
    mine = tmp_path / "photos"
    mine.mkdir()
    (mine / "cat.jpg").write_bytes(b"meow")
    r = run_hilt("quantize", tiny_ckpt, mine, "--overwrite")
    assert_clean_failure(r, "not a hilt checkpoint")
    assert (mine / "cat.jpg").exists()
    assert_clean_failure(run_hilt("inspect", mine), "photos: not a hilt checkpoint (no hilt.json)")
    assert_clean_failure(run_hilt("inspect", tmp_path / "gone"), "gone: no such file or directory")


def test_unwritable_destination(tiny_ckpt, tmp_path):
    # root ignores permission bits, so use a place no one can create folders in
    r = run_hilt("quantize", tiny_ckpt, "/proc/hilt-out")
    assert_clean_failure(r, "/proc/hilt-out")
    r = run_hilt("quantize", tiny_ckpt, tmp_path / "missing-parent" / "o")
    assert_clean_failure(r, "does not exist")


def test_interrupt_then_resume_gives_identical_bytes(tmp_path):
    src = tmp_path / "big.safetensors"
    make_checkpoint(src, n_layers=12, hidden=256)
    args = ["--method", "kmeans", "--bits", "3", "--shard-size", "0.05"]
    ref = tmp_path / "ref"
    assert run_hilt("quantize", src, ref, *args).returncode == 0
    dst = tmp_path / "dst"
    partial = Path(str(dst) + ".partial")
    # SIGINT back to its default in the child: a test run started in the background by a
    # non-interactive shell inherits SIGINT ignored, and Python then never raises KeyboardInterrupt
    proc = subprocess.Popen([sys.executable, "-m", "hilt", "quantize", str(src), str(dst), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while not (partial / "shard-00002.safetensors").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "--resume" in err and "Traceback" not in err
    assert not dst.exists() and partial.exists()
    r = run_hilt("quantize", src, dst, *args)  # without --resume: refuse, keep the partial run
    assert_clean_failure(r, "--resume")
    assert partial.exists()
    (partial / "next-shard.tmp").write_bytes(b"stale")  # the shard being filled when it stopped: never output
    r = run_hilt("quantize", src, dst, *args, "--resume")
    assert r.returncode == 0, r.stderr
    assert not partial.exists()
    ref_files = sorted(p.name for p in ref.iterdir())
    assert ref_files == sorted(p.name for p in dst.iterdir()) and len(ref_files) > 3
    for name in ref_files:
        assert (ref / name).read_bytes() == (dst / name).read_bytes(), name


def test_write_json_is_whole_or_nothing(tiny_ckpt, tmp_path):
    from hilt.errors import HiltError
    from hilt.atomic import write_json

    d = tmp_path / "j"
    d.mkdir()
    write_json(d / "a.json", {"b": 1, "a": [1.5]})
    assert read_json(d / "a.json") == {"b": 1, "a": [1.5]}
    write_json(d / "a.json", {"c": 2})  # replaced whole
    assert read_json(d / "a.json") == {"c": 2}
    with pytest.raises(HiltError, match=r"missing/a.json: folder .*missing does not exist"):
        write_json(d / "missing" / "a.json", {})
    (d / "d.json").mkdir()
    with pytest.raises(HiltError, match=r"d.json: cannot write"):
        write_json(d / "d.json", {})
    with pytest.raises(TypeError):  # not JSON: nothing written, no temporary
        write_json(d / "e.json", {"x": object()})
    assert sorted(p.name for p in d.iterdir()) == ["a.json", "d.json"]
    r = run_hilt("quantize", tiny_ckpt, tmp_path / "o", "--dry-run", "--json", d / "missing" / "o.json")
    assert_clean_failure(r, "missing/o.json: folder")  # the command line writes through it too
