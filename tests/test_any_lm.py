"""Every language-model path on three families: tiny random Llama, Gemma 3 (q/k RMSNorm, GeGLU, sliding
window, tied embeddings) and Qwen2 (q/k/v biases), built from transformers configs, no download."""

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hilt.cli import main  # noqa: E402
from hilt.errors import HiltError  # noqa: E402
from hilt.models.lm import HF_FOLDER, OWN, is_language_model, lm_source, load_lm  # noqa: E402

VOCAB = 128


def _tokenizer():
    """Characters as tokens (printable ASCII at their code points), saved the way transformers reads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({chr(i): i for i in range(32, 127)} | {"<unk>": 1, "\n": 10},
                                    unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")


def _config(family):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if family == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=True), transformers.LlamaForCausalLM
    if family == "gemma3":
        return (transformers.Gemma3TextConfig(**common, head_dim=32, sliding_window=16, query_pre_attn_scalar=32,
                                              layer_types=["sliding_attention", "full_attention"]),
                transformers.Gemma3ForCausalLM)
    return transformers.Qwen2Config(**common, tie_word_embeddings=False), transformers.Qwen2ForCausalLM


FAMILIES = ("llama", "gemma3", "qwen2")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{family: a Hugging Face folder of a tiny random model of it}; Gemma 3 in bfloat16, the others float32."""
    out = {}
    for i, family in enumerate(FAMILIES):
        config, cls = _config(family)
        torch.manual_seed(i)
        model = cls(config)
        with torch.no_grad():  # norms away from their initial values, so a wrong gain convention shows
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(0.3 * torch.randn_like(p))
        folder = tmp_path_factory.mktemp(family)
        model.to(torch.bfloat16 if family == "gemma3" else torch.float32).save_pretrained(folder)
        _tokenizer().save_pretrained(folder)
        out[family] = folder
    return out


def hilt(capsys, *args):
    capsys.readouterr()
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 8


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_loads_scores_and_lists_layers(folders, family):
    source = lm_source(folders[family])
    assert source.runner == HF_FOLDER and is_language_model(folders[family])
    lm = load_lm(folders[family], source)
    ids = lm.encode(TEXT)
    assert ids[:2] == [ord("T"), ord("o")]  # no special token in front
    # perplexity by hand: one window, cross-entropy of the model's own logits
    window = torch.tensor(ids[:64])
    with torch.no_grad():
        logits = lm.model(input_ids=window[None]).logits[0, :-1].float()
    expected = math.exp(float(torch.nn.functional.cross_entropy(logits, window[1:])))
    assert lm.perplexity(window, context=64) == pytest.approx(expected, rel=1e-5)
    layers = lm.linear_layers()
    assert len(layers) == 2 * 7 and not any(n.endswith("lm_head") for n in layers)  # q k v o gate up down a block
    assert len(lm.attention_layers()) == 2
    if family == "qwen2":
        assert all(layers[f"model.layers.0.self_attn.{p}_proj"].bias is not None for p in "qkv")


def test_the_builtin_llama_runs_on_hilts_own_forward(smollm2_gguf):
    assert lm_source("smollm2").runner == OWN and lm_source(smollm2_gguf).runner == OWN


def test_refusals_name_the_file_and_what_is_supported(tmp_path, folders):
    import gguf

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "no-such-arch")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(HiltError, match=r"m\.gguf: architecture 'no-such-arch' .*supported: .*gemma3"):
        lm_source(path)
    with pytest.raises(HiltError, match="no such file or folder"):
        lm_source(tmp_path / "nothing")
    encoder = tmp_path / "enc"
    encoder.mkdir()
    (encoder / "config.json").write_text('{"model_type": "bert", "architectures": ["BertModel"]}')
    (encoder / "model.safetensors").write_bytes(b"")
    with pytest.raises(HiltError, match="is an encoder, not a causal LM"):
        lm_source(encoder)
    assert not is_language_model(encoder)


@pytest.mark.parametrize("family", FAMILIES)
def test_eval_ppl_quantize_compensate_and_sensitivity(folders, family, tmp_path, capsys):
    src = folders[family]
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 4)
    code, _, err = hilt(capsys, "eval", "ppl", src, "--text", text, "--tokens", 256, "--context", 64, "--json",
                        tmp_path / "ppl.json")
    assert code == 0, err
    import json

    ppl = json.loads((tmp_path / "ppl.json").read_text())
    lm = load_lm(src)
    assert ppl["perplexity"] == pytest.approx(lm.perplexity(lm.encode(TEXT * 4)[:256], context=64), rel=1e-5)
    assert math.isfinite(ppl["perplexity"]) and ppl["family"] == lm.source.family

    dst = tmp_path / "q"
    code, _, err = hilt(capsys, "quantize", src, dst, "--method", "kmeans", "--bits", 4, "--block-size", 32,
                        "--compensate", "--calibration", text, "--calibration-tokens", 512)
    assert code == 0, err
    code, _, err = hilt(capsys, "eval", "ppl", dst, "--text", text, "--tokens", 256, "--context", 64)
    assert code == 0, err

    code, _, err = hilt(capsys, "sensitivity", src, "--calibration", text, "--tokens", 512, "--candidates",
                        "kmeans4,int4", "--block-size", 32, "--json", tmp_path / "tpv.json")
    assert code == 0, err
    tpv = json.loads((tmp_path / "tpv.json").read_text())
    assert tpv["kind"] == "causal" and len(tpv["layers"]) == 14
    assert all(math.isfinite(v) and v > 0 for layer in tpv["layers"] for v in layer["tpv"].values())


@pytest.mark.parametrize("family", FAMILIES)
def test_drift_on_a_chip(folders, family, tmp_path, capsys):
    code, out, err = hilt(capsys, "drift", "--model", folders[family], "--preset", "pcm", "--times", "1s", "--chips",
                          1, "--tokens", 64, "--context", 32, "--json", tmp_path / "d.json")
    assert code == 0, err
    import json

    result = json.loads((tmp_path / "d.json").read_text())
    assert result["kind"] == "causal" and result["analog_layers"] == 14
    assert all(math.isfinite(r["mean"]) for r in result["rows"])


def test_hwa_tunes_a_transformers_model_into_a_folder(folders, tmp_path, capsys):
    out = tmp_path / "tuned"
    code, _, err = hilt(capsys, "hwa", folders["gemma3"], out, "--steps", 2, "--batch", 1, "--context", 32,
                        "--save-every", 1)
    assert code == 0, err
    tuned, before = load_lm(out), load_lm(folders["gemma3"])
    assert type(tuned.model) is type(before.model) and tuned.encode(TEXT) == before.encode(TEXT)
    changed = [n for n, p in tuned.model.named_parameters()
               if not torch.equal(p, dict(before.model.named_parameters())[n])]
    assert any(".mlp." in n for n in changed)  # trained through the chip's reads
    assert not (tmp_path / "tuned.hwa-state").exists()
    code, _, err = hilt(capsys, "hwa", folders["gemma3"], out, "--steps", 1)
    assert code == 1 and "already exists" in err and out.is_dir()


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_scales_bound_every_head(folders, family, tmp_path, capsys, monkeypatch):
    import json

    from hilt.data import text as text_module

    monkeypatch.setattr(text_module, "shakespeare_text", lambda work: TEXT * 4)
    code, _, err = hilt(capsys, "fp8", "scales", folders[family], "--tokens", 128, "--context", 64, "--json",
                        tmp_path / "f.json")
    assert code == 0, err
    rows = json.loads((tmp_path / "f.json").read_text())["rows"]
    assert len(rows) == 2 and all(len(r["bound"]) == 4 and not r["exceeded"] for r in rows)
    assert all(0 < o <= b for r in rows for o, b in zip(r["observed"], r["bound"]))
    assert {r["kind"] for r in rows} == ({"qk_norm"} if family == "gemma3" else {"projection"})


def test_windows_with_a_bos_score_every_text_token():
    from hilt.models.lm import perplexity, split_windows

    ids = torch.arange(10, 20)
    plain = split_windows(ids, 4)
    assert [w.tolist() for w in plain] == [[10, 11, 12, 13], [14, 15, 16, 17], [18, 19]]
    led = split_windows(ids, 4, bos=2)
    assert [w.tolist() for w in led] == [[2, 10, 11, 12], [2, 13, 14, 15], [2, 16, 17, 18], [2, 19]]
    # a model that puts all its mass on the next id scores perplexity 1 on exactly the text's tokens
    seen = []

    def forward(w):
        seen.extend(w[0, 1:].tolist())
        return torch.nn.functional.one_hot(torch.cat([w[0, 1:], w[0, :1]]), 32).float()[None] * 100

    assert perplexity(forward, ids, 4, bos=2) == pytest.approx(1.0)
    assert seen == ids.tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_calibrate_then_quantize_by_importance(folders, family, tmp_path, capsys):
    imp = tmp_path / "imp.safetensors"
    code, _, err = hilt(capsys, "calibrate", folders[family], "--out", imp, "--tokens", 512)
    assert code == 0, err
    from safetensors.torch import load_file

    importance = load_file(imp)
    layers = {f"{n}.weight" for n in load_lm(folders[family]).linear_layers()}
    assert layers <= set(importance) and all(bool((importance[n] > 0).all()) for n in layers)
    code, _, err = hilt(capsys, "quantize", folders[family], tmp_path / "q", "--bits", 3, "--block-size", 32,
                        "--importance", imp)
    assert code == 0, err


def test_bench_decode_refuses_a_model_no_path_serves_before_any_work(tmp_path, capsys):
    encoder = tmp_path / "enc"
    encoder.mkdir()
    (encoder / "config.json").write_text('{"model_type": "bert", "architectures": ["BertModel"]}')
    (encoder / "model.safetensors").write_bytes(b"")
    code, _, err = hilt(capsys, "bench", "decode", "--model", encoder, "--work", tmp_path / "w")
    assert code == 1 and "is an encoder, not a causal LM" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_compressed_tensors_export_reads_as_hilts_folder(folders, family, tmp_path, capsys):
    pytest.importorskip("compressed_tensors")
    q, ct = tmp_path / "q", tmp_path / "ct"
    assert hilt(capsys, "quantize", folders[family], q, "--method", "int", "--bits", 4, "--block-size", 32)[0] == 0
    code, _, err = hilt(capsys, "export", "compressed-tensors", q, ct)
    assert code == 0, err
    ids = torch.tensor([load_lm(folders[family]).encode(TEXT)[:24]])
    with torch.no_grad():
        ours = load_lm(q).logits(ids)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(ct), dtype=torch.float32)(ids).logits
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4)


def test_calibration_windows_lead_with_the_models_bos(tmp_path):
    from hilt.tasks.compensate import CONTEXT, llama_batches

    class Tokenizer:
        bos = 2

        def encode(self, text):
            return [ord(c) for c in text]

    text = tmp_path / "t.txt"
    text.write_text("abcdefgh" * 300)
    batches, seen = llama_batches(Tokenizer(), text, 2 * CONTEXT)
    windows = torch.cat([b[0] for b in batches])
    assert windows.shape == (2, CONTEXT) and (windows[:, 0] == 2).all() and "BOS" in seen
    assert windows[:, 1:].flatten().tolist() == [ord(c) for c in ("abcdefgh" * 300)[:2 * (CONTEXT - 1)]]
    Tokenizer.bos = None
    assert torch.cat([b[0] for b in llama_batches(Tokenizer(), text, 2 * CONTEXT)[0]])[0, 0] == ord("a")


@pytest.mark.parametrize("family, tokens", [("gemma3", 16), ("qwen2", 96)])  # the tiny Gemma's window is 16
def test_fp8_attention_perplexity_of_a_transformers_model(folders, family, tokens, tmp_path, capsys, monkeypatch):
    import json

    from hilt.data import text as text_module

    monkeypatch.setattr(text_module, "shakespeare_text", lambda work: TEXT * 4)
    code, _, err = hilt(capsys, "fp8", "attention", "--model", folders[family], "--tokens", tokens, "--json",
                        tmp_path / "a.json")
    assert code == 0, err
    r = json.loads((tmp_path / "a.json").read_text())
    assert len(r["rows"]) == 5 and all(math.isfinite(row["perplexity"]) for row in r["rows"])
    assert all(abs(row["perplexity_change_pct"]) < 10 for row in r["rows"])
    assert load_lm(folders[family]).model.config._attn_implementation != "hilt_fp8"


def test_a_quantized_folder_scores_the_same_in_a_fresh_process(folders, tmp_path, capsys):
    """A new interpreter imports transformers' quantizer registry through hilt's own checks: hilt's quantizer must
    still be registered, or transformers would load the folder's Linears randomly initialised."""
    import json
    import subprocess
    import sys

    q = tmp_path / "q"
    assert hilt(capsys, "quantize", folders["llama"], q, "--method", "int", "--bits", 4, "--block-size", 32)[0] == 0
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 4)
    args = ["eval", "ppl", q, "--text", text, "--tokens", 128, "--context", 64]
    assert hilt(capsys, *args, "--json", tmp_path / "here.json")[0] == 0
    r = subprocess.run([sys.executable, "-m", "hilt", *map(str, args), "--json", str(tmp_path / "fresh.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "could not register" not in r.stderr, r.stderr
    here, fresh = (json.loads((tmp_path / f"{n}.json").read_text())["perplexity"] for n in ("here", "fresh"))
    assert fresh == pytest.approx(here, rel=1e-6)


def test_compensation_of_a_gguf_transformers_runs_asks_for_a_folder(tmp_path, capsys):
    import gguf

    path = tmp_path / "g.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_tokenizer_model("llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    code, _, err = hilt(capsys, "quantize", path, tmp_path / "q", "--bits", 4, "--compensate")
    assert code == 1 and "`hilt convert" in err and "'gemma3' GGUF" in err and not (tmp_path / "q").exists()


def test_quantize_takes_a_builtin_model_by_name(smollm2_gguf, tmp_path, capsys):
    code, _, err = hilt(capsys, "quantize", "smollm2", tmp_path / "q", "--bits", 4, "--dry-run")
    assert code == 0, err
    assert not (tmp_path / "q").exists()
