"""`hilt export gguf`: integer formats to llama.cpp's block types, exactly; what GGUF cannot hold refused."""

import gguf
import numpy as np
import pytest
import torch

from helpers import run_hilt
from hilt.errors import HiltError
from hilt.quant import QuantConfig, load_checkpoint, quantize_checkpoint
from hilt.quant.gguf_export import export_gguf


def _source(path):
    """A small Llama-named GGUF with metadata, a vocabulary and float tensors."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_name("tiny")
    w.add_token_list(["<s>", "a", "b"])
    g = torch.Generator().manual_seed(0)
    tensors = {"blk.0.attn_q.weight": torch.randn(64, 128, generator=g),
               "blk.0.ffn_down.weight": torch.randn(96, 64, generator=g) * 3 + 1,  # shifted: asymmetric blocks
               "token_embd.weight": torch.randn(3, 128, generator=g), "blk.0.attn_norm.weight": torch.ones(128)}
    for n, t in tensors.items():
        w.add_tensor(n, t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("config,kind", [(QuantConfig("int", 4, 64), "Q4_0"), (QuantConfig("int", 8, 32), "Q8_0"),
                                         (QuantConfig("int-asym", 4, 64), "Q4_1")])
def test_round_trip_is_exact(tmp_path, config, kind):
    src = tmp_path / "src.gguf"
    _source(src)
    q = tmp_path / "q"
    quantize_checkpoint(src, q, config)
    out = tmp_path / "q.gguf"
    r = export_gguf(q, out)
    assert r["types"] == {kind: 2, "F32": 2}
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.name"].contents() == "tiny"
    assert reader.fields["tokenizer.ggml.tokens"].contents() == ["<s>", "a", "b"]
    ours = load_checkpoint(q)
    for t in reader.tensors:
        want = ours[t.name]
        want = want.float() if torch.is_tensor(want) else want.dequantize().float()
        got = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type))).float().view(want.shape)
        assert torch.equal(got, want), t.name  # gguf's own dequantization, bit for bit


def test_what_gguf_cannot_hold_is_refused(tmp_path):
    src = tmp_path / "src.gguf"
    _source(src)
    for config, msg in ((QuantConfig("kmeans", 4, 64), "no block type with a learned"),
                        (QuantConfig("int", 3, 64), "GGUF holds exactly int 4-bit"),
                        (QuantConfig("int", 4, 16), "multiple of 32")):
        q = tmp_path / f"q{config.bits}{config.method}{config.block_size}"
        quantize_checkpoint(src, q, config)
        with pytest.raises(HiltError, match=msg):
            export_gguf(q, tmp_path / "x.gguf")
        assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x.gguf.partial").exists()
    q = tmp_path / "ok"
    quantize_checkpoint(src, q, QuantConfig("int", 4, 64))
    r = run_hilt("export", "gguf", q, tmp_path / "ok.gguf")
    assert r.returncode == 0 and "Q4_0" in r.stdout, r.stderr
    r = run_hilt("export", "gguf", q, tmp_path / "ok.gguf")
    assert r.returncode == 1 and "already exists" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for out, msg in ((notes, "exists and is not a GGUF file; refusing to replace it"), (tmp_path, "is a folder")):
        with pytest.raises(HiltError, match=msg):
            export_gguf(q, out, overwrite=True)
    assert notes.read_text() == "mine"
    r = run_hilt("export", "gguf", tmp_path / "q4kmeans64", tmp_path / "k.gguf")
    assert r.returncode == 1 and "learned" in r.stderr and not (tmp_path / "k.gguf").exists()


def test_the_source_is_found_from_another_folder(tmp_path, monkeypatch):
    _source(tmp_path / "src.gguf")
    monkeypatch.chdir(tmp_path)
    quantize_checkpoint("src.gguf", "q", QuantConfig("int", 4, 64))  # paths as typed, relative
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    assert export_gguf("../q", "q.gguf")["types"]["Q4_0"] == 2


def test_needs_a_gguf_source(tiny_ckpt, tmp_path):
    q = tmp_path / "q"
    quantize_checkpoint(tiny_ckpt, q, QuantConfig("int", 4, 64))
    with pytest.raises(HiltError, match="quantized from a safetensors file"):
        export_gguf(q, tmp_path / "x.gguf")


def test_a_gguf_is_parsed_once_while_unchanged(tmp_path):
    from hilt.quant.sources import read_gguf

    src = tmp_path / "src.gguf"
    _source(src)
    first = read_gguf(src)
    assert read_gguf(tmp_path / "." / "src.gguf") is first  # the same file by another spelling
    replaced = tmp_path / "new.gguf"
    _source(replaced)
    replaced.replace(src)  # a new file under the old name is read afresh
    again = read_gguf(src)
    assert again is not first and again.fields["general.name"].contents() == "tiny"
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 8)
    for path, msg in ((tmp_path / "bad.gguf", "bad.gguf: not a readable GGUF file"),
                      (tmp_path / "none.gguf", "none.gguf: no such GGUF file"), (tmp_path, "a folder")):
        with pytest.raises(HiltError, match=msg):
            read_gguf(path)
