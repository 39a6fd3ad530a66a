"""The scale benchmark's synthetic Llama folder, the threaded writer, and a full disk."""

import contextlib
import hashlib
import json
import subprocess
from pathlib import Path

import pytest
import torch

from hilt.bench.perf import scale
from hilt.cli import main
from hilt.quant import QuantConfig, quantize_checkpoint


@pytest.fixture(scope="session")
def synthetic(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("scale") / "llama"
    made = scale.write_synthetic(folder, "quick")
    assert made["shards"] > 1 and (folder / "model.safetensors.index.json").exists()
    return folder


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_synthetic_weights_have_the_measured_spread_and_tails():
    g = torch.Generator().manual_seed(1)
    w = scale.synthetic_weight((2048, 1024), "q_proj", g).double()
    std, row_sigma, col_sigma, nu = scale.SMOLLM2_STATS["q_proj"]
    rows = w.std(1)
    z = w / rows[:, None]
    cols = z.std(0)
    z = z / cols
    assert abs(float(w.std()) / std - 1) < 0.01
    assert abs(float(rows.log().std()) / row_sigma - 1) < 0.1
    assert abs(float(cols.log().std()) / col_sigma - 1) < 0.15
    kurtosis = float((z**4).mean() / z.var() ** 2)
    assert 3 + 6 / (nu - 4) * 0.5 < kurtosis < 3 + 6 / (nu - 4) * 2  # heavier than a Gaussian, as measured
    assert torch.isfinite(w).all()


def test_synthetic_folder_loads_in_transformers_and_quantizes(synthetic, tmp_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(synthetic)
    assert model.config.num_hidden_layers == scale.SHAPES["quick"]["layers"]
    up = model.model.layers[0].mlp.up_proj.weight
    assert up.dtype == torch.bfloat16 and float(up.float().std()) > 0
    out = model(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(out).all()
    tokenizer = transformers.AutoTokenizer.from_pretrained(synthetic)  # for --compensate's calibration text
    assert tokenizer("Macbeth", add_special_tokens=False)["input_ids"] == list(b"Macbeth")
    written = quantize_checkpoint(synthetic, tmp_path / "q", QuantConfig("int", 4))
    assert written.header["totals"]["quantized_tensors"] == 7 * scale.SHAPES["quick"]["layers"]
    assert set(written.seconds) >= {"read", "fit", "pack", "error", "write"}


# SHA-256 of the shard and the mean error each format gets from the quick synthetic folder, as the writer
# wrote them before its speed and memory work (commit c6f3209, and every commit since): the bytes stay.
WRITTEN_BEFORE = {
    ("int", 4): ("ef2869157e749af28e15b25ee0fb0e006593ee0d8864ee7d1d38c50ebf86bde6", 0.119414),
    ("kmeans", 4): ("5730e384d9ff767cb7d02f30a68c75b2a798d63fcfecc5e81bc466420a80d5e3", 0.092111),
    ("kmeans", 3): ("59a9ff4fdb6e1734c38f5cd7f5c2691bafa0754832c0d0adff5d1ee5443d7dc3", 0.189235),
}


@pytest.mark.parametrize("method,bits", list(WRITTEN_BEFORE))
def test_the_writer_writes_the_bytes_it_wrote_before(synthetic, tmp_path, method, bits):
    written = quantize_checkpoint(synthetic, tmp_path / "q", QuantConfig(method, bits))
    digest, error = WRITTEN_BEFORE[method, bits]
    assert written.header["shards"] == ["model.safetensors"]
    assert hashlib.sha256((tmp_path / "q" / "model.safetensors").read_bytes()).hexdigest() == digest
    assert written.header["totals"]["rel_error_mean"] == error


def test_threaded_writer_writes_the_bytes_of_one_thread(synthetic, tmp_path):
    for method in ["kmeans", "int"]:
        one = quantize_checkpoint(synthetic, tmp_path / f"{method}1", QuantConfig(method, 3), threads=1,
                                  shard_bytes=100_000)
        two = quantize_checkpoint(synthetic, tmp_path / f"{method}2", QuantConfig(method, 3), threads=2,
                                  shard_bytes=100_000)
        assert len(one.header["shards"]) > 2
        assert files(tmp_path / f"{method}1") == files(tmp_path / f"{method}2")
        assert one.header["totals"] == two.header["totals"]


def test_bench_scale_quick(tmp_path, capsys):
    out = tmp_path / "scale.json"
    assert main(["bench", "scale", "--quick", "--runs", "int4", "--work", str(tmp_path / "w"), "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    (run,) = r["runs"]
    assert run["run"] == "int4" and run["wall_s"] > 0 and run["cpu_s"] > 0
    assert 50 << 20 < run["peak_rss_bytes"] < 4 << 30
    assert run["linear_weights_per_s"] == pytest.approx(r["model"]["linear_weights"] / run["wall_s"])
    assert {"read", "fit", "pack", "error", "write"} <= set(run["split_s"])
    assert r["read"]["bytes"] > r["model"]["bytes"]  # every shard read whole: its tensors and its header
    assert not (tmp_path / "w" / "llama-quick").exists()  # removed without --keep
    assert "int4" in capsys.readouterr().out


@contextlib.contextmanager
def small_disk(tmp_path: Path, size: str):
    """A tmpfs of ``size`` (e.g. "200k") mounted for the block; the test skips where mounting is not allowed."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_full_disk_is_one_line_and_leaves_nothing(synthetic, tmp_path, capsys):
    with small_disk(tmp_path, "200k") as mnt:
        assert main(["quantize", str(synthetic), str(mnt / "q"), "--quiet"]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("hilt: error:") and "No space left on device" in err, err
        assert list(mnt.iterdir()) == []


def test_a_table_as_large_as_a_shard_is_copied_file_to_file(synthetic, tmp_path, monkeypatch):
    """Embeddings and head at least a shard's size: a shard each, their bytes copied from the source
    (by the kernel, or through a buffer where it cannot), the same checkpoint either way."""
    from safetensors import safe_open

    from hilt.quant import load_checkpoint
    from hilt.quant.sources import open_source

    shard = 60_000  # the quick shape's tables are 256 x 128 bf16: 65,536 bytes
    quantize_checkpoint(synthetic, tmp_path / "kernel", QuantConfig("int", 4), shard_bytes=shard)

    def refused(*args):
        raise OSError(18, "Invalid cross-device link")  # EXDEV: what two file systems answer

    monkeypatch.setattr("os.copy_file_range", refused)
    written = quantize_checkpoint(synthetic, tmp_path / "buffered", QuantConfig("int", 4), shard_bytes=shard)
    assert files(tmp_path / "kernel") == files(tmp_path / "buffered")
    tensors = written.header["tensors"]
    with open_source(synthetic) as src:
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            with safe_open(str(tmp_path / "kernel" / tensors[name]["shard"]), framework="pt") as f:
                assert list(f.keys()) == [name]
            assert tensors[name]["dtype"] == "bfloat16" and tensors[name]["kind"] == "dense"
            assert torch.equal(load_checkpoint(tmp_path / "kernel", [name])[name], src.get_stored(name))


def test_a_full_disk_while_copying_a_table_is_one_line(synthetic, tmp_path):
    from hilt.errors import HiltError

    with small_disk(tmp_path, "40k") as mnt:
        with pytest.raises(HiltError, match="No space left on device") as e:
            quantize_checkpoint(synthetic, mnt / "q", QuantConfig("int", 4), shard_bytes=60_000)
        assert "\n" not in str(e.value) and "shard-" in str(e.value)
        assert [p.name for p in mnt.iterdir()] in ([], ["q.partial"])  # a resumable start, no temporaries
        assert not [p for p in mnt.rglob("*") if p.name.endswith(".tmp")]
