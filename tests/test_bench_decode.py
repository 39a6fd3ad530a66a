"""`hilt bench decode --quick`: the whole pipeline (quantize, from_pretrained, generate through the CPU
kernel, the GEMV table, the llama.cpp row) on a tiny random Llama, in seconds."""

import json
import stat

import pytest

from hilt.bench.perf import decode_speed
from hilt.cli import main
from hilt.kernels import lut_cpu

pytest.importorskip("transformers")


def test_quick_decode_runs_every_part(tmp_path, capsys):
    work = tmp_path / "made" / "work"  # made by the command
    assert main(["bench", "decode", "--quick", "--work", str(work), "--out", str(tmp_path / "out")]) == 0
    r = json.loads((tmp_path / "out" / "decode.json").read_text())
    rows = {row["model"]: row for row in r["rows"]}
    assert rows["dense bf16"]["tokens_per_second"] > 0 and rows["dense bf16"]["vs_dense_bf16"] == 1.0
    km = rows["hilt k-means 4 (block 64)"]
    assert km["tokens_per_second"] > 0 and km["weight_bytes"] < rows["dense bf16"]["weight_bytes"]
    assert km["prefill_tokens_per_second"] > 0 and km["prefill_vs_dense_bf16"] > 0 and r["prefill_tokens"] > 16
    for row in (km, rows["hilt's Llama, k-means 4 (block 64)"]):  # the per-token split: parts of the whole
        parts = [row[f"{kind}_ms_per_token"] for kind in ("linear", "head", "attention", "rest")]
        assert all(p > 0 for p in parts[:3]) and sum(parts) == pytest.approx(row["ms_per_token"], abs=0.05)
    assert rows["llama.cpp llama-bench (Q4_0, Q8_0 exports)"]["note"] in ("not built", "not run in --quick")
    for label in ("hilt's Llama, dense bf16", "hilt's Llama, k-means 4 (block 64)"):  # the same timing, its own model
        assert rows[label]["tokens_per_second"] > 0 and rows[label]["prefill_tokens_per_second"] > 0
    assert rows["hilt's Llama, k-means 4 (block 64)"]["weight_bytes"] < rows["hilt's Llama, dense bf16"]["weight_bytes"]
    formats = [g["format"] for g in r["gemv"]]
    assert formats[0] == "dense bf16 (torch)" and formats[1].startswith("hilt k-means 4 (lut_cpu")
    if lut_cpu.machine_isa() >= 3:
        assert "bf16 path" in formats[1]
    assert all(g["gb_per_s"] > 0 and g["of_copy_bandwidth"] > 0 for g in r["gemv"])
    assert r["copy_gb_per_s"] > 0 and "| hilt k-means 4 (block 64) |" in capsys.readouterr().out
    assert not list(work.glob("tmp*"))  # the work folder is cleaned up


def test_the_cli_row_names_are_the_bench_rows():
    from hilt.cli.bench_quant import DECODE_NAMES

    assert DECODE_NAMES == tuple(decode_speed.NAMES) and set(decode_speed.NAMES.values()) == set(decode_speed.FORMATS)


def test_a_file_as_work_folder_is_one_line(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert main(["bench", "decode", "--quick", "--work", str(tmp_path / "f")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--work is a file" in err


def test_llama_cpp_tool_is_found_only_where_built(tmp_path, monkeypatch):
    monkeypatch.setenv("HILT_LLAMA_CPP", str(tmp_path))
    assert decode_speed.llama_cpp_tool("llama-bench") is None
    (tmp_path / "bin").mkdir()
    tool = tmp_path / "bin" / "llama-bench"
    tool.write_text("#!/bin/sh\n")
    assert decode_speed.llama_cpp_tool("llama-bench") is None  # not executable
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    assert decode_speed.llama_cpp_tool("llama-bench") == tool
    monkeypatch.setenv("HILT_LLAMA_CPP", str(tmp_path / "elsewhere"))
    assert decode_speed._llama_cpp_rows(tmp_path, 1, 4, 1)[0]["note"] == "not built"


def test_memory_probe_counts_library_code_apart(tmp_path):
    """The fresh-process probe reports the shared libraries' resident code beside the high-water marks
    (code pages only grow), and the table shows the memory over weights with and without it."""
    import transformers

    folder = decode_speed._tiny_llama(tmp_path / "tiny", transformers)
    m = decode_speed._load_memory(folder, {})
    assert "error" not in m, m
    assert 0 < m["baseline_code"] <= m["loaded_code"] <= m["decoding_code"]
    assert m["baseline"] <= m["loaded"] <= m["decoding"]
    row = {"model": "x", "tokens_per_second": 1.0, "vs_dense_bf16": 1.0, "weight_bytes": 100 << 20,
           **{f"rss_{k}": v for k, v in m.items()}}
    held = m["decoding"] - m["baseline"] - (m["decoding_code"] - m["baseline_code"])
    row.update(loaded_over_weights=1.0, decoding_over_weights=1.0, first_forward_mb=2.0, first_forward_code_mb=1.0,
               decoding_over_weights_without_code=held / row["weight_bytes"])
    assert f"1.00x / 1.00x ({held / (100 << 20):.2f}x) | 2.0 (1.0) |" in decode_speed.table([row])


def test_hilt_llama_runner_decodes_greedily_with_its_cache():
    """The runner's generate (the cache, one token a step) picks what the whole sequence's forward picks."""
    import torch

    runner = decode_speed._hilt_llamas(quick=True)["hilt's Llama, dense bf16"].float()
    ids = torch.arange(1, 6).unsqueeze(0)
    with torch.no_grad():
        out = runner.generate(ids, max_new_tokens=5)
        want = ids
        for _ in range(5):
            want = torch.cat([want, runner(want)[:, -1].argmax(-1, keepdim=True)], 1)
    assert out.shape == (1, 10) and torch.equal(out, want)


def test_the_table_shows_memory_columns_only_where_the_probes_ran_and_unknown_formats_are_refused():
    row = {"model": "dense bf16", "tokens_per_second": 20.0, "vs_dense_bf16": 1.0, "ms_per_token": 50.0,
           "linear_ms_per_token": 25.0, "head_ms_per_token": 5.0, "attention_ms_per_token": 8.0,
           "rest_ms_per_token": 12.0, "prefill_tokens_per_second": 800.0, "prefill_vs_dense_bf16": 1.0,
           "weight_bytes": 269e6}
    skipped = {"model": "llama.cpp llama-bench (Q4_0, Q8_0 exports)", "tokens_per_second": None, "note": "not built"}
    bare = decode_speed.table([row, skipped]).splitlines()
    assert "resident" not in bare[0] and bare[0].count("|") == 7 and all(line.count("|") == 7 for line in bare)
    assert "| 20.00 | 1.00x | 25.0 / 5.0 / 8.0 / 12.0 | 800 (1.00x) | 269.0 |" in bare[2] and "| not built |" in bare[3]
    probed = {**row, "rss_baseline": 1, "loaded_over_weights": 1.05, "decoding_over_weights": 1.1,
              "decoding_over_weights_without_code": 1.03, "first_forward_mb": 13.5, "first_forward_code_mb": 10.1}
    full = decode_speed.table([probed, skipped]).splitlines()
    assert "resident" in full[0] and all(line.count("|") == 9 for line in full)
    assert "1.05x / 1.10x (1.03x)" in full[2] and "13.5 (10.1)" in full[2]
    with pytest.raises(decode_speed.HiltError, match="no decode format"):
        decode_speed.run(formats=("hilt k-means 5",), gemv=False, model="smollm2")
