"""`hilt bench exports --quick`: the study behind docs/results/export.md runs end to end and writes its JSON."""

import json

import pytest

from helpers import one_torch_thread  # noqa: F401  (a fixture)
from hilt.tasks import llama_cpp


@pytest.mark.skipif(bool(llama_cpp.missing_tools()), reason="llama.cpp tools not built (scripts/build_llama_cpp.sh)")
def test_bench_exports_quick(smollm2_gguf, tmp_path, capsys):
    from hilt.cli import main

    assert main(["-q", "bench", "exports", "--quick", "--out", str(tmp_path), "--work", str(tmp_path / "w")]) == 0
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "export_llama_cpp_quick.json").read_text())
    (row,) = result["rows"]
    assert row["variant"] in printed and row["consumer"] == "llama.cpp"
    assert row["tokens_identical"] and abs(row["ppl_rel_diff"]) < 0.01 and row["within_tolerance"], row
    assert row["tokens_per_s"] > 0 and (row["peak_rss_bytes"] is None or row["peak_rss_bytes"] > row["bytes"] / 4)
