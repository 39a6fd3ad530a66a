"""Bad input to the commands, as a careless user gives it, and its clean neighbour (the same command
with the input put right): one line on stderr naming the file, flag or key, exit 1 or 2, and the
destination untouched; the neighbour succeeds or gets past the check. Cheap: a probe that must fail
before a model loads replaces the loader with a sentinel, so nothing is ever run (docs/errors.md)."""

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from helpers import make_checkpoint
from hilt.cli import main
from hilt.errors import HiltError

SENTINEL = "sentinel: the checks passed and the loader was reached"


@dataclass
class Probe:
    argv: list
    code: int  # the exit code expected
    says: list[str]  # what stderr's line contains (empty: nothing on stderr)
    dest: Path | None = None  # must be left as it was
    warns: list[str] = field(default_factory=list)  # a warning line before it (its words)
    created: Path | None = None  # a clean run writes this


def _reach(monkeypatch, target: str) -> None:
    """Replace the loader at ``target`` (module:attribute) with one that raises the sentinel."""
    module, attr = target.split(":")

    def sentinel(*args, **kwargs):
        raise HiltError(SENTINEL)

    monkeypatch.setattr(__import__(module, fromlist=[attr]), attr, sentinel)


def _state(path: Path):
    """Every file and folder under ``path`` with its size and time; None when ``path`` is absent."""
    if not path.exists():
        return None
    if path.is_file():
        return path.stat().st_size, path.stat().st_mtime_ns
    return {str(p.relative_to(path)): (p.is_dir(), p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*")}


def _gguf(path: Path, arch: str = "llama", rows: int = 64) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("gpt2")
    w.add_tensor("blk.0.ffn_up.weight", np.random.default_rng(0).standard_normal((rows, 64)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _folder(path: Path, config: dict | None, weights=("model.safetensors",), index: list | None = None) -> Path:
    """A model folder: config.json (None: none), these weight files, and an index listing ``index``."""
    path.mkdir()
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    for name in weights:
        save_file({"w": torch.zeros(4, 4)}, str(path / name))
    if index:
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {f"t{i}": name for i, name in enumerate(index)}}))
    return path


def _quantized(tmp: Path) -> tuple[Path, Path]:
    """(source, a hilt checkpoint of it): a small Llama-like file quantized to 4-bit integers."""
    from hilt.quant import QuantConfig, quantize_checkpoint

    src = tmp / "tiny.safetensors"
    make_checkpoint(src, n_layers=1, hidden=64)
    quantize_checkpoint(src, tmp / "q", QuantConfig("int", 4, 32))
    return src, tmp / "q"


LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
BERT = {"model_type": "bert", "architectures": ["BertModel"]}

# ------------------------------------------------------------------ hilt sensitivity FOLDER


def sensitivity_not_json(tmp, mp):
    (_folder(tmp / "m", None) / "config.json").write_text("{not json")
    _reach(mp, "hilt.models.bert:load_minilm")  # must not be reached
    return Probe(["sensitivity", tmp / "m"], 1, [str(tmp / "m" / "config.json"), "Expecting"])


def sensitivity_no_config(tmp, mp):
    _folder(tmp / "m", None)
    _reach(mp, "hilt.models.bert:load_minilm")
    return Probe(["sensitivity", tmp / "m"], 1, [str(tmp / "m"), "no config.json"])


def sensitivity_other_model_type(tmp, mp):
    _folder(tmp / "m", {"model_type": "t5", "architectures": ["T5Model"]})
    _reach(mp, "hilt.models.llama:load_llama")
    return Probe(["sensitivity", tmp / "m"], 1, ["config.json", "model_type 't5'", "'bert'"])


def sensitivity_weights_not_the_configs(tmp, mp):
    """A causal-LM config over weights of something else: refused before transformers builds the model (a
    default-sized Llama, 28 GB)."""
    _folder(tmp / "m", LLAMA)
    return Probe(["sensitivity", tmp / "m"], 1, [str(tmp / "m"),
                                                 "LlamaForCausalLM", "model.embed_tokens.weight"])


def sensitivity_bert_folder_clean(tmp, mp):
    _folder(tmp / "m", BERT)
    _reach(mp, "hilt.models.bert:load_minilm")
    return Probe(["sensitivity", tmp / "m"], 1, [SENTINEL])


# ------------------------------------------------------------------ hilt eval embed / ppl


def embed_quantized_as_model(tmp, mp):
    src, q = _quantized(tmp)
    _reach(mp, "hilt.models.bert:load_minilm")
    return Probe(["eval", "embed", q], 1, [str(q), "stored quantized", "--quantized", f"{src} --quantized {q}"], dest=q)


def embed_quantized_flag_clean(tmp, mp):
    src, q = _quantized(tmp)
    _reach(mp, "hilt.models.bert:load_minilm")
    return Probe(["eval", "embed", src, "--quantized", q], 1, [SENTINEL], dest=q)


def ppl_quantized_as_model(tmp, mp):
    src, q = _quantized(tmp)
    _reach(mp, "hilt.models.hf:load_causal_lm")
    return Probe(["eval", "ppl", q, "--tokens", 16], 1, [str(q), "stored quantized", f"eval ppl {src} --quantized"])


def ppl_encoder(tmp, mp):
    pytest.importorskip("transformers")
    _folder(tmp / "m", BERT)
    _reach(mp, "hilt.models.hf:load_causal_lm")  # must not be reached
    return Probe(["eval", "ppl", tmp / "m", "--tokens", 16], 1,
                 ["config.json", "model_type 'bert' (BertModel)", "encoder", "`hilt eval embed"], dest=tmp / "m")


def ppl_encoder_quantized_by_hilt(tmp, mp):
    pytest.importorskip("transformers")
    _folder(tmp / "m", {**BERT, "quantization_config": {"quant_method": "hilt"}})
    _reach(mp, "hilt.models.hf:load_causal_lm")
    return Probe(["eval", "ppl", tmp / "m", "--tokens", 16], 1, ["model_type 'bert'", "encoder"], dest=tmp / "m")


def ppl_encoder_without_architectures(tmp, mp):
    pytest.importorskip("transformers")
    _folder(tmp / "m", {"model_type": "roberta"})
    _reach(mp, "hilt.models.hf:load_causal_lm")
    return Probe(["eval", "ppl", tmp / "m", "--tokens", 16], 1, ["model_type 'roberta'", "encoder"])


def ppl_missing_shard(tmp, mp):
    pytest.importorskip("transformers")
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    _folder(tmp / "m", LLAMA, weights=shards[:1], index=shards)
    _reach(mp, "hilt.models.hf:load_causal_lm")
    return Probe(["eval", "ppl", tmp / "m", "--tokens", 16], 1,
                 ["model.safetensors.index.json", "shard model-00002-of-00002.safetensors is missing"], dest=tmp / "m")


def ppl_no_weights(tmp, mp):
    pytest.importorskip("transformers")
    _folder(tmp / "m", LLAMA, weights=())
    _reach(mp, "hilt.models.hf:load_causal_lm")
    return Probe(["eval", "ppl", tmp / "m", "--tokens", 16], 1, [str(tmp / "m"), "no weights"])


def ppl_causal_lm_clean(tmp, mp):
    pytest.importorskip("transformers")
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    _folder(tmp / "m", LLAMA, weights=shards, index=shards)
    _reach(mp, "hilt.models.hf:load_causal_lm")
    return Probe(["eval", "ppl", tmp / "m", "--tokens", 16], 1, [SENTINEL])


# ------------------------------------------------------------------ hilt convert GGUF DST


def _read_only(folder: Path, mp) -> Path:
    """A folder this process cannot write: its mode bits, and where the process runs as root (which
    the bits do not stop), os.access answering as they say."""
    folder.mkdir()
    folder.chmod(0o555)
    if os.geteuid() == 0:
        real = os.access
        mp.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == folder and mode & os.W_OK
                   else real(p, mode, **kw))
    return folder


def convert_read_only_destination(tmp, mp):
    pytest.importorskip("transformers")
    ro = _read_only(tmp / "ro", mp)
    _reach(mp, "hilt.models.hf:read_gguf")  # the source is not even opened
    return Probe(["convert", _gguf(tmp / "m.gguf"), ro / "hf"], 1, [str(ro / "hf"), f"folder {ro} is not writable"],
                 dest=ro)


def convert_missing_parent(tmp, mp):
    pytest.importorskip("transformers")
    return Probe(["convert", _gguf(tmp / "m.gguf"), tmp / "no" / "hf"], 1, ["parent folder", "does not exist"],
                 dest=tmp / "no")


def convert_write_fails(tmp, mp):
    """A destination that fails while being written (a full disk): named, the source not blamed."""
    transformers = pytest.importorskip("transformers")
    dst = tmp / "hf"

    class Model:
        def save_pretrained(self, folder):
            raise PermissionError(13, "Permission denied", str(Path(folder) / "model.safetensors"))

    mp.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Model())
    return Probe(["convert", _gguf(tmp / "m.gguf"), dst], 1, [f"{dst}: cannot write model.safetensors",
                                                              "Permission denied"], dest=tmp / "hf.partial")


def convert_writable_clean(tmp, mp):
    """A writable destination gets past the check; the source's architecture is refused next."""
    pytest.importorskip("transformers")
    return Probe(["convert", _gguf(tmp / "m.gguf", "nosucharch"), tmp / "hf"], 1, ["m.gguf", "'nosucharch'"],
                 dest=tmp / "hf")


# ------------------------------------------------------------------ GGUF files that are not whole


def _cut(src: Path, dst: Path, size: int) -> Path:
    dst.write_bytes(src.read_bytes()[:size])
    return dst


def gguf_truncated_data(tmp, mp):
    whole = _gguf(tmp / "whole.gguf")
    cut = _cut(whole, tmp / "cut.gguf", whole.stat().st_size - 1000)
    return Probe(["quantize", cut, tmp / "q"], 1, [str(cut), "truncated GGUF file",
                                                  f"({cut.stat().st_size} bytes, its tensor table promises "
                                                  f"{whole.stat().st_size})"], dest=tmp / "q")


def gguf_truncated_header(tmp, mp):
    cut = _cut(_gguf(tmp / "whole.gguf"), tmp / "cut.gguf", 40)
    return Probe(["quantize", cut, tmp / "q"], 1, [str(cut), "truncated GGUF file (40 bytes, its header"],
                 dest=tmp / "q")


def gguf_truncated_convert(tmp, mp):
    pytest.importorskip("transformers")
    whole = _gguf(tmp / "whole.gguf")
    cut = _cut(whole, tmp / "cut.gguf", whole.stat().st_size // 2)
    return Probe(["convert", cut, tmp / "hf"], 1, [str(cut), "truncated GGUF file"], dest=tmp / "hf")


def gguf_text_file(tmp, mp):
    text = tmp / "notes.gguf"
    text.write_text("hello, these are notes\n")
    return Probe(["quantize", text, tmp / "q"], 1, [str(text), "not a GGUF file (starts with b'hell'"],
                 dest=tmp / "q")


def gguf_tiny_text_file(tmp, mp):
    pytest.importorskip("transformers")
    text = tmp / "hi.gguf"
    text.write_text("hi\n")
    return Probe(["convert", text, tmp / "hf"], 1, [str(text), "not a GGUF file"], dest=tmp / "hf")


def gguf_whole_clean(tmp, mp):
    return Probe(["quantize", _gguf(tmp / "whole.gguf"), tmp / "q", "--method", "int", "--bits", 4, "-q"], 0, [],
                 created=tmp / "q")


# ------------------------------------------------------------------ hilt sweep --resume

GRID = """
chips = 2
images = 20

[axes]
model = "mlp"
time = ["1s"]
"""


def _sweep_folder(tmp: Path, grid_json: str | None, rows: str = "") -> tuple[Path, Path]:
    grid = tmp / "grid.toml"
    grid.write_text(GRID)
    out = tmp / "out"
    out.mkdir()
    (out / "results.jsonl").write_text(rows)
    if grid_json is not None:
        (out / "grid.json").write_text(grid_json)
    return grid, out


def _normalized(grid: Path) -> str:
    from hilt.tasks.sweep import parse_grid

    return json.dumps(parse_grid(grid).normalized(), indent=1) + "\n"


def sweep_resume_nothing_other_grid(tmp, mp):
    grid, out = _sweep_folder(tmp, json.dumps({"axes": {"model": ["cnn"]}}))
    _reach(mp, "hilt.tasks.sweep:_load_model")
    return Probe(["sweep", grid, "--out", out, "--resume"], 1, [str(out), "no finished cells to resume",
                                                                "--overwrite"], dest=out)


def sweep_resume_partial_line_only(tmp, mp):
    grid, out = _sweep_folder(tmp, None, rows='{"model": "ml')
    _reach(mp, "hilt.tasks.sweep:_load_model")
    return Probe(["sweep", grid, "--out", out, "--resume"], 1, ["no finished cells to resume", "grid.json is missing"],
                 dest=out)


def sweep_resume_rows_of_other_grid(tmp, mp):
    grid, out = _sweep_folder(tmp, json.dumps({"axes": {"model": ["cnn"]}}), rows='{"model": "cnn"}\n')
    _reach(mp, "hilt.tasks.sweep:_load_model")
    return Probe(["sweep", grid, "--out", out, "--resume"], 1, ["finished cells belong to another grid"], dest=out)


def sweep_resume_same_grid_clean(tmp, mp):
    grid, out = _sweep_folder(tmp, None)
    (out / "grid.json").write_text(_normalized(grid))
    _reach(mp, "hilt.tasks.sweep:_load_model")
    return Probe(["sweep", grid, "--out", out, "--resume"], 1, [SENTINEL], dest=out)


# ------------------------------------------------------------------ hilt drift --model PKG:FACTORY

FACTORY = """
import torch

def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3))
"""


def _factory(tmp: Path, mp) -> str:
    (tmp / "probe_nets.py").write_text(FACTORY)
    mp.syspath_prepend(str(tmp))
    _reach(mp, "hilt.tasks.cim_inputs:load_data")
    return "probe_nets:make"


def drift_factory_without_checkpoint(tmp, mp):
    spec = _factory(tmp, mp)
    return Probe(["drift", "--model", spec, "--repeats", 1, "--times", "1s"], 1, [SENTINEL],
                 warns=["--model probe_nets:make without --checkpoint", "make()", "untrained"])


def drift_factory_with_checkpoint_clean(tmp, mp):
    spec = _factory(tmp, mp)
    ckpt = tmp / "nets.safetensors"
    save_file(torch.nn.Sequential(torch.nn.Linear(4, 3)).state_dict(), str(ckpt))
    return Probe(["drift", "--model", spec, "--checkpoint", ckpt, "--repeats", 1, "--times", "1s"], 1, [SENTINEL])


# ------------------------------------------------------------------ hilt quantize FOLDER


def _weights_folder(tmp: Path, config: dict | None) -> Path:
    folder = tmp / "m"
    folder.mkdir()
    make_checkpoint(folder / "model.safetensors", n_layers=1, hidden=64)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def quantize_folder_without_config(tmp, mp):
    folder = _weights_folder(tmp, None)
    return Probe(["quantize", folder, tmp / "q", "--method", "int"], 0, [], warns=["no config.json", "from_pretrained"],
                 created=tmp / "q" / "hilt.json")


def quantize_unknown_model_type(tmp, mp):
    pytest.importorskip("transformers")
    folder = _weights_folder(tmp, {"model_type": "nonesuch"})
    return Probe(["quantize", folder, tmp / "q", "--method", "int"], 0, [],
                 warns=["config.json", "model_type 'nonesuch'", "from_pretrained"], created=tmp / "q" / "hilt.json")


def quantize_llama_folder_clean(tmp, mp):
    folder = _weights_folder(tmp, LLAMA)
    return Probe(["quantize", folder, tmp / "q", "--method", "int"], 0, [], created=tmp / "q" / "config.json")


def quantize_budget_out_of_reach(tmp, mp):
    src = tmp / "tiny.safetensors"
    make_checkpoint(src, n_layers=1, hidden=64)
    _reach(mp, "hilt.tasks.sensitivity:sensitivity_run")  # measuring must not start
    return Probe(["quantize", src, tmp / "q", "--budget", 99], 1, ["--budget 99", "outside", "(all largest)"],
                 dest=tmp / "q")


def quantize_budget_within_reach_clean(tmp, mp):
    src = tmp / "tiny.safetensors"
    make_checkpoint(src, n_layers=1, hidden=64)
    _reach(mp, "hilt.tasks.sensitivity:sensitivity_run")
    return Probe(["quantize", src, tmp / "q", "--budget", 3], 1, [SENTINEL], dest=tmp / "q")


PROBES = [sensitivity_not_json, sensitivity_no_config, sensitivity_other_model_type, sensitivity_weights_not_the_configs,
          sensitivity_bert_folder_clean,
          embed_quantized_as_model, embed_quantized_flag_clean, ppl_quantized_as_model, ppl_encoder,
          ppl_encoder_quantized_by_hilt, ppl_encoder_without_architectures, ppl_missing_shard, ppl_no_weights,
          ppl_causal_lm_clean, convert_read_only_destination, convert_missing_parent, convert_write_fails,
          convert_writable_clean, gguf_truncated_data, gguf_truncated_header, gguf_truncated_convert, gguf_text_file,
          gguf_tiny_text_file, gguf_whole_clean, sweep_resume_nothing_other_grid, sweep_resume_partial_line_only,
          sweep_resume_rows_of_other_grid, sweep_resume_same_grid_clean, drift_factory_without_checkpoint,
          drift_factory_with_checkpoint_clean, quantize_folder_without_config, quantize_unknown_model_type,
          quantize_llama_folder_clean, quantize_budget_out_of_reach, quantize_budget_within_reach_clean]


@pytest.mark.parametrize("make", PROBES, ids=[p.__name__ for p in PROBES])
def test_probe(make, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    probe = make(tmp_path, monkeypatch)
    before = None if probe.dest is None else _state(probe.dest)
    capsys.readouterr()
    try:
        code = main([str(a) for a in probe.argv])
    finally:
        for p in tmp_path.rglob("*"):  # let pytest remove a folder made read-only
            if p.is_dir():
                p.chmod(0o755)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == probe.code, err
    warnings = [line for line in lines if line.startswith("hilt: warning: ")]
    errors = [line for line in lines if line not in warnings]
    assert len(warnings) == (1 if probe.warns else 0), err
    for words in probe.warns:
        assert words in warnings[0], err
    if probe.code == 0:
        assert errors == [], err
        assert probe.created is None or probe.created.exists()
    else:
        assert len(errors) == 1 and errors[0].startswith(("hilt: error: ", "hilt ")), err
        for words in probe.says:
            assert words in errors[0], err
        if SENTINEL not in probe.says:
            assert SENTINEL not in err, "the check ran after the loader"
    if probe.dest is not None:
        assert _state(probe.dest) == before, f"{probe.dest} was changed"
        assert not probe.dest.with_name(probe.dest.name + ".partial").exists()
