"""The FP8 transient study on a tiny budget, the character GPT it fine-tunes, and the GPU-only bench."""

import pytest
import torch

from hilt.bench.studies import fp8_transient
from hilt.models.gpt import GPT, GPTConfig, corpus


def test_gpt_hook_sees_causal_logits_and_changes_nothing_when_it_returns_them():
    alphabet, _, val = corpus()
    torch.manual_seed(0)
    model = GPT(GPTConfig(len(alphabet), block_size=16, n_layer=2, n_head=2, n_embd=32))
    idx = val[:16].long()[None]
    plain = model(idx)
    seen = []
    for blk in model.blocks:
        blk.attn.logit_hook = lambda s, mask: (seen.append(mask), s)[1]
    torch.testing.assert_close(model(idx), plain, atol=1e-5, rtol=1e-5)
    assert len(seen) == 2 and bool(seen[0].tril().eq(seen[0]).all()) and bool(seen[0].diagonal().all())


def test_geometry_scales_never_overflow_where_delayed_scaling_does():
    plan = {"pretrain": 20, "before": 2, "after": 3, "spike": 1}
    result = fp8_transient.study(plan=plan, shape={"block_size": 64, "n_layer": 2, "n_head": 2, "n_embd": 64})
    runs = {(r["scenario"], r["recipe"]): r for r in result["runs"]}
    assert len(runs) == len(fp8_transient.SCENARIOS) * len(fp8_transient.RECIPES)
    assert all(runs[(s, "geometry")]["overflow_logits"] == 0 for s in fp8_transient.SCENARIOS)
    assert runs[("load", "delayed")]["overflow_logits"] > 1000  # history from the random init: scale far too large
    assert all(len(r["steps"]) == (3 if s == "load-empty" else 5) for (s, _), r in runs.items())


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the benchmark runs instead")
def test_bench_attention_says_it_needs_a_gpu():
    from helpers import run_hilt

    r = run_hilt("bench", "attention")
    assert r.returncode == 1 and "need a CUDA GPU" in r.stderr


def test_bench_attention_saves_its_timings_then_fails_on_a_mismatch(tmp_path, monkeypatch, capsys):
    import json

    from hilt.bench.perf import attention_speed
    from hilt.cli import main

    result = {"rows": [{"seq": 1024, "causal": False, "speedup": 1.6}],
              "mismatches": [{"seq": 2048, "causal": True, "cosine_vs_bf16": 0.42}]}
    monkeypatch.setattr(attention_speed, "run", lambda: result)
    assert main(["bench", "attention", "--json", str(tmp_path / "a.json")]) == 1
    assert json.loads((tmp_path / "a.json").read_text()) == result
    assert "differs from bf16 SDPA (cosine < 0.99) at T=2048 causal (cosine 0.4200)" in capsys.readouterr().err
    monkeypatch.setattr(attention_speed, "run", lambda: {**result, "mismatches": []})
    assert main(["bench", "attention"]) == 0
