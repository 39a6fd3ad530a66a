"""Hugging Face folders in and out: hilt quantize writes a folder transformers loads with QuantLinear
layers holding the packed codes; the CPU int4 kernel; hilt eval on Hugging Face folders; bad input."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

import hilt  # noqa: E402,F401  (registers the quantizer with transformers)
from hilt.kernels import lut_cpu  # noqa: E402
from hilt.kernels.lut_matmul import error_ratio, lut_matmul_reference  # noqa: E402
from hilt.quant import QuantConfig, QuantLinear, load_checkpoint, load_quantized_, quantize_checkpoint  # noqa: E402
from hilt.quant.nn import QuantEmbedding, TiedHead  # noqa: E402
from hilt.quant.quantize import quantize_tensor  # noqa: E402

from hilt.cli import main  # noqa: E402
from hilt.errors import HiltError  # noqa: E402


def hilt(capsys, *args):
    """The command line, run in this process (transformers is imported once for the whole module):
    (exit code, stderr)."""
    capsys.readouterr()
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def tiny_llama(folder, dtype=torch.bfloat16, seed=0):
    """A small random Llama saved as a Hugging Face folder (weights in ``dtype``)."""
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(folder)
    return folder


def load_hf(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def hilt_side(src, dst):
    """hilt's own path: the unquantized model with the checkpoint loaded over it by load_quantized_."""
    model = load_hf(src)
    return load_quantized_(model, dst, strict=False)


@pytest.mark.parametrize("config", [QuantConfig("kmeans", 4, 32), QuantConfig("int", 4, 32), QuantConfig("kmeans", 2, 32),
                                    QuantConfig("int-asym", 3, 32), QuantConfig("kmeans", 2, 32, codebook="block")])
def test_from_pretrained_runs_the_packed_weights(tmp_path, config):
    src = tiny_llama(tmp_path / "src")
    dst = tmp_path / "q"
    header = quantize_checkpoint(src, dst, config).header
    cfg = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "hilt" and cfg["format_version"] == header["format_version"] == 2
    assert set(cfg["modules"]) == {n.removesuffix(".weight") for n, e in header["tensors"].items()
                                   if e["kind"] == "quantized"}
    assert header["tensors"]["model.norm.weight"]["dtype"] == "bfloat16"  # dense tensors keep their dtype

    model = load_hf(dst)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, QuantLinear) and q_proj.codes.dtype == torch.uint8
    assert q_proj.codebook.dtype == torch.float16 and q_proj.scales.dtype == torch.bfloat16
    assert not any(isinstance(m, torch.nn.Linear) for n, m in model.named_modules() if n in cfg["modules"])
    stored = load_checkpoint(dst, ["model.layers.0.self_attn.q_proj.weight"])["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(q_proj.codes, stored.codes) and torch.equal(q_proj.scales, stored.scales)

    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    own = hilt_side(src, dst)
    with torch.inference_mode():
        ours, theirs = own(ids).logits, model(ids).logits
    assert torch.isfinite(theirs).all()
    assert float((theirs - ours).abs().max() / ours.abs().max()) <= 1e-3
    with torch.inference_mode():
        a = model.generate(ids[:1, :4], max_new_tokens=8, min_new_tokens=8, do_sample=False)
        b = own.generate(ids[:1, :4], max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert torch.equal(a, b)

    # save_pretrained (of the model loaded in the folder's own dtype, after a bfloat16 forward: at 2 bits the
    # CPU kernel then holds the codes interleaved) writes the same format back: same keys, dtypes and
    # values; it loads again
    native = transformers.AutoModelForCausalLM.from_pretrained(str(dst), dtype="auto")
    layer = native.model.layers[0].self_attn.q_proj
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.inference_mode():
        native(ids[:1, :4])
        y = layer(x)  # the layer as from_pretrained made it, on the CPU kernel's bfloat16 paths
    pairs = config.bits == 2 and config.codebook == "layer" and lut_cpu.machine_isa() >= 3
    assert (layer._cpu_lut is not None and layer._cpu_lut.interleaved) == pairs  # 2 bits: the pair tables ran
    q = layer.qweight
    assert error_ratio(y, x, lut_matmul_reference(x.double(), q.packed).double(), q.dequantize().double().abs()) <= 1
    native.save_pretrained(tmp_path / "again")
    with safe_open(str(dst / "model.safetensors"), "pt") as f, safe_open(str(tmp_path / "again/model.safetensors"), "pt") as g:
        assert set(f.keys()) == set(g.keys())
        for k in f.keys():
            assert f.get_tensor(k).dtype == g.get_tensor(k).dtype and torch.equal(f.get_tensor(k), g.get_tensor(k)), k
    again = json.loads((tmp_path / "again/config.json").read_text())["quantization_config"]
    assert again["modules"] == cfg["modules"]
    # hilt reads that folder too (no hilt.json: the header comes from the config and the shards)
    resaved, original = load_checkpoint(tmp_path / "again"), load_checkpoint(dst)
    assert resaved.keys() == original.keys()
    for name, value in original.items():
        other = resaved[name]
        if isinstance(value, torch.Tensor):
            assert torch.equal(other, value), name
        else:
            assert (other.method, other.shape) == (value.method, value.shape)
            assert torch.equal(other.dequantize(), value.dequantize()), name
    with torch.inference_mode():
        assert torch.equal(load_hf(tmp_path / "again")(ids).logits, theirs)


def test_sharded_output_has_an_index(tmp_path):
    src = tiny_llama(tmp_path / "src")
    dst = tmp_path / "q"
    header = quantize_checkpoint(src, dst, QuantConfig("int", 8, 32), shard_bytes=20_000).header
    n = len(header["shards"])
    assert n > 1 and header["shards"][0] == f"model-00001-of-{n:05d}.safetensors"
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["model.layers.0.self_attn.q_proj.codes"] == header["tensors"]["model.layers.0.self_attn.q_proj.weight"]["shard"]
    assert sorted(p.name for p in dst.glob("*.safetensors")) == sorted(header["shards"])
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert torch.allclose(load_hf(dst)(ids).logits, hilt_side(src, dst)(ids).logits, rtol=0, atol=1e-5)


def test_version_1_checkpoints_still_read(tmp_path):
    """Version 1 named the parts after the tensor (NAME.weight.codes) and its shards model-00001.safetensors."""
    src = tiny_llama(tmp_path / "src")
    v2 = tmp_path / "v2"
    header = quantize_checkpoint(src, v2, QuantConfig("kmeans", 3, 32)).header
    v1 = tmp_path / "v1"
    v1.mkdir()
    with safe_open(str(v2 / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    renamed = {}
    for name, e in header["tensors"].items():
        if e["kind"] == "dense":
            renamed[name] = tensors[name]
        else:
            module = name.removesuffix(".weight")
            renamed.update({f"{name}.{p}": tensors[f"{module}.{p}"] for p in ("codes", "codebook", "scales")
                            if f"{module}.{p}" in tensors})
    save_file(renamed, str(v1 / "model-00001.safetensors"))
    old = {**header, "format_version": 1, "shards": ["model-00001.safetensors"],
           "tensors": {n: {**e, "shard": "model-00001.safetensors"} for n, e in header["tensors"].items()}}
    (v1 / "hilt.json").write_text(json.dumps(old))
    a, b = load_checkpoint(v1), load_checkpoint(v2)
    for name, value in b.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(a[name], value)
        else:
            assert torch.equal(a[name].dequantize(), value.dequantize())


@pytest.mark.parametrize("bits, shape", [(4, (576, 576, 64)), (4, (100, 128, 32)), (4, (192, 256, 256)),
                                         (8, (100, 96, 96)), (8, (64, 576, 576))])
def test_cpu_integer_kernels_match_the_reference(bits, shape):
    """int8 (one block a row) runs PyTorch's int8 kernel; int4 the LUT kernel on the stored codes."""
    n, k, block = shape
    g = torch.Generator().manual_seed(n + bits)
    q = quantize_tensor(torch.randn(n, k, generator=g), QuantConfig("int", bits, block))
    layer = QuantLinear(q, torch.randn(n, generator=g))
    x = torch.randn(3, 5, k, generator=g).to(torch.bfloat16)
    y = layer(x)
    assert (layer._cpu_pack is not None and layer._cpu_pack.bits == 8) if bits == 8 else layer._cpu_pack is None
    assert y.dtype == torch.bfloat16 and y.shape == (3, 5, n)
    ref = lut_matmul_reference(x.double(), q.packed, layer.bias.double())
    assert error_ratio(y, x, ref, q.dequantize().abs()) <= 1
    # the kept copy follows the codes when they change in place
    with torch.no_grad():
        layer.codes.copy_(torch.roll(layer.codes, 1, dims=0))
    q2 = layer.qweight
    assert error_ratio(layer(x), x, lut_matmul_reference(x.double(), q2.packed, layer.bias.double()),
                       q2.dequantize().abs()) <= 1


def test_cpu_integer_kernels_only_where_exact():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 128, generator=g)
    for config in (QuantConfig("kmeans", 4, 32), QuantConfig("int-asym", 4, 32), QuantConfig("int", 8, 32),
                   QuantConfig("int", 4, 16), QuantConfig("int", 3, 32)):
        layer = QuantLinear(quantize_tensor(torch.randn(64, 128, generator=g), config))
        y = layer(x.to(torch.bfloat16))
        assert layer._cpu_pack is None, config
        xb = x.to(torch.bfloat16)  # the LUT kernel instead: within the kernels' bound
        assert error_ratio(y, xb, lut_matmul_reference(xb.double(), layer.packed).double(),
                           layer.qweight.dequantize().double().abs()) <= 1, config
    layer = QuantLinear(quantize_tensor(torch.randn(64, 128, generator=g), QuantConfig("int", 4, 32)))
    assert error_ratio(layer(x), x, lut_matmul_reference(x.double(), layer.packed).double(),
                       layer.qweight.dequantize().double().abs()) <= 1 and layer._cpu_pack is None  # float32 in


def test_quantized_embeddings_and_tied_head(tmp_path):
    src = tiny_llama(tmp_path / "src")
    dst = tmp_path / "q"
    header = quantize_checkpoint(src, dst, QuantConfig("int", 4, 32), embeddings=8).header
    table = header["tensors"]["model.embed_tokens.weight"]
    assert table["kind"] == "quantized" and table["bits"] == 8 and table["block_size"] == 64  # one scale per row
    assert "lm_head.weight" not in header["tensors"]  # tied: stored once
    model = load_hf(dst)
    assert isinstance(model.model.embed_tokens, QuantEmbedding) and isinstance(model.lm_head, TiedHead)
    assert model.lm_head.table is model.model.embed_tokens
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(3))
    own = hilt_side(src, dst)
    assert isinstance(own.lm_head, TiedHead)
    with torch.inference_mode():
        theirs, ours = model(ids).logits, own(ids).logits
    assert float((theirs - ours).abs().max() / ours.abs().max()) <= 1e-3
    dense = load_hf(src)
    with torch.inference_mode():  # the table really is quantized: the logits moved, a little
        moved = float((theirs - dense(ids).logits).abs().max() / ours.abs().max())
    assert 1e-4 < moved < 0.2
    transformers.AutoModelForCausalLM.from_pretrained(str(dst), dtype="auto").save_pretrained(tmp_path / "again")
    with safe_open(str(tmp_path / "again/model.safetensors"), "pt") as f:
        assert not any(k.startswith("lm_head") for k in f.keys()) and "model.embed_tokens.codes" in f.keys()
    with torch.inference_mode():
        assert torch.equal(load_hf(tmp_path / "again")(ids).logits, theirs)
    # bfloat16 decode runs the table's head on the stored buffers (no int8 copy of the table)
    fast = transformers.AutoModelForCausalLM.from_pretrained(str(dst), dtype=torch.bfloat16)
    with torch.inference_mode():
        fast(ids[:, :3])
    assert fast.model.embed_tokens._cpu_pack is None and fast.model.embed_tokens._cpu_lut is not None


def test_eval_ppl_and_embed_on_hf_folders(tmp_path, capsys):
    src = tiny_llama(tmp_path / "src", dtype=torch.float32)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=_byte_tokenizer())
    tok.save_pretrained(src)
    dst = tmp_path / "q"
    assert hilt(capsys, "quantize", src, dst, "--bits", "4", "--block-size", "32", "-q")[0] == 0
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be, that is the question " * 20)
    for model, out in ((src, "a.json"), (dst, "b.json")):
        code, err = hilt(capsys, "eval", "ppl", model, "--text", text, "--tokens", 200, "--context", 64,
                         "--json", tmp_path / out)
        assert code == 0, err
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert a["tokens"] == b["tokens"] == 200 and b["bits_per_weight"] == pytest.approx(4.55, abs=0.05)
    # a random model: perplexity near the vocabulary size, the quantized one close to it but not equal
    assert 100 < a["perplexity"] < 400 and a["perplexity"] != b["perplexity"]
    assert abs(b["perplexity"] / a["perplexity"] - 1) < 0.2

    # an encoder hilt has no model of its own for (RoBERTa): through transformers
    config = transformers.RobertaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=128, max_position_embeddings=80, pad_token_id=1)
    torch.manual_seed(0)
    encoder = tmp_path / "enc"
    transformers.RobertaModel(config).save_pretrained(encoder)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=_byte_tokenizer(), pad_token="<unk>",
                                                     model_max_length=64)
    tokenizer.save_pretrained(encoder)
    assert hilt(capsys, "quantize", encoder, tmp_path / "enc-q", "--bits", "3", "--block-size", "32", "-q")[0] == 0
    code, err = hilt(capsys, "eval", "embed", encoder, "--quantized", tmp_path / "enc-q", "--sentences", 16,
                     "--json", tmp_path / "e.json")
    assert code == 0, err
    e = json.loads((tmp_path / "e.json").read_text())
    assert e["sentences"] == 16 and 0.5 < e["cosine_similarity_min"] <= e["cosine_similarity"] < 1.0
    # the same number from the dense model with its weights replaced by their dequantized values
    from hilt.data.text import sentences
    from hilt.models.hf import embed

    ref, other = transformers.RobertaModel.from_pretrained(str(encoder)), transformers.RobertaModel.from_pretrained(str(encoder))
    with torch.no_grad():
        for name, q in load_checkpoint(tmp_path / "enc-q").items():
            if not isinstance(q, torch.Tensor):
                other.get_parameter(name).copy_(q.dequantize())
    text = sentences(16)
    cos = torch.nn.functional.cosine_similarity(embed(ref, tokenizer, text), embed(other, tokenizer, text), dim=-1)
    assert float(cos.mean()) == pytest.approx(e["cosine_similarity"], abs=1e-6)


def _byte_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({chr(i): i for i in range(32, 127)} | {"<unk>": 1}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return tk


def test_bad_input_one_line(tmp_path, capsys):
    src = tiny_llama(tmp_path / "src")
    # a folder already quantized by another tool
    other = tmp_path / "gptq"
    shutil.copytree(src, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "gptq"}}))
    code, err = hilt(capsys, "quantize", other, tmp_path / "x")
    assert code == 1 and "already quantized (gptq)" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.partial").exists()
    # eval of a folder without config.json, and of an architecture transformers does not know
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(src / "model.safetensors", bare)
    code, err = hilt(capsys, "eval", "ppl", bare, "--tokens", 16)
    assert code == 1 and "no config.json" in err and len(err.strip().splitlines()) == 1
    unknown = tmp_path / "unknown"
    shutil.copytree(src, unknown)
    (unknown / "config.json").write_text(json.dumps({**cfg, "model_type": "nosuchmodel", "architectures": ["X"]}))
    code, err = hilt(capsys, "eval", "ppl", unknown, "--tokens", 16)
    assert code == 1 and "nosuchmodel" in err and len(err.strip().splitlines()) == 1
    # a folder of a newer format version
    dst = tmp_path / "q"
    quantize_checkpoint(src, dst, QuantConfig("int", 4, 32))
    qcfg = json.loads((dst / "config.json").read_text())
    qcfg["quantization_config"]["format_version"] = 99
    (dst / "config.json").write_text(json.dumps(qcfg))
    code, err = hilt(capsys, "eval", "ppl", dst, "--tokens", 16)
    assert code == 1 and "version 99" in err and len(err.strip().splitlines()) == 1
    # a GGUF of an architecture with no Hugging Face conversion: nothing left behind
    import gguf

    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "nosucharch")
    w.add_tensor("x.weight", torch.zeros(4, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    code, err = hilt(capsys, "convert", path, tmp_path / "hf")
    assert code == 1 and "'nosucharch'" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.partial").exists()


@pytest.fixture(scope="module")
def smollm2_hf(tmp_path_factory):
    """SmolLM2 converted by `hilt convert` to a float32 Hugging Face folder, once for the tests below."""
    from hilt.models.llama import smollm2_path

    hf = tmp_path_factory.mktemp("smol") / "smol-hf"
    assert main(["convert", str(smollm2_path()), str(hf), "--dtype", "float32"]) == 0
    return hf


PROMPT = "The capital of France is Paris. The capital of Germany is"


def test_smollm2_converted_tokenizes_as_hilt_does(smollm2_hf):
    from hilt.models.llama import load_llama

    _, tokenizer = load_llama()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2_hf))
    text = PROMPT + " 1234 digits, one by one:\n  and spaces."
    assert hf_tokenizer(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text)
    assert json.loads((smollm2_hf / "config.json").read_text())["num_hidden_layers"] == 30


def test_smollm2_quantized_from_its_folder_and_its_gguf_agree(smollm2_hf, tmp_path):
    """A few layers quantized from the Hugging Face folder and from the GGUF: transformers' logits and
    greedy decode equal hilt's own Llama forward."""
    from hilt.models.llama import generate, load_llama, smollm2_path

    only_hf, only_gguf = r"layers\.(0|29)\.(self_attn|mlp)\.", r"blk\.(0|29)\.(attn|ffn)_(q|k|v|output|gate|up|down)\."
    quantize_checkpoint(smollm2_hf, tmp_path / "q-hf", QuantConfig("kmeans", 4, 64), only=only_hf)
    quantize_checkpoint(smollm2_path(), tmp_path / "q-gguf", QuantConfig("kmeans", 4, 64), only=only_gguf,
                        dense_dtype=torch.float32)
    model = load_hf(tmp_path / "q-hf")
    assert isinstance(model.model.layers[29].self_attn.k_proj, QuantLinear)
    net, tokenizer = load_llama()
    load_quantized_(net, tmp_path / "q-gguf", strict=False)
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "q-hf"))
    with torch.inference_mode():
        theirs, ours = model(ids).logits, net(ids)
        out = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert float((theirs - ours).abs().max() / ours.abs().max()) <= 1e-3
    assert hf_tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True) == generate(net, tokenizer, PROMPT, 16)


def test_dtype_casts_keep_the_packed_parts():
    """model.to(bfloat16) must not round the float16 codebook: only the device follows a move, and a
    quantized embedding returns the model's new dtype."""
    q = quantize_tensor(torch.randn(64, 128, generator=torch.Generator().manual_seed(0)), QuantConfig("kmeans", 4, 32))
    model = torch.nn.ModuleDict({"head": QuantLinear(q), "table": QuantEmbedding(q)})
    book = model["head"].codebook.clone()
    model.to(torch.bfloat16)
    assert model["head"].codebook.dtype == torch.float16 and torch.equal(model["head"].codebook, book)
    assert model["table"](torch.tensor([[1, 2]])).dtype == torch.bfloat16
    model.float()
    assert model["table"](torch.tensor([3])).dtype == torch.float32 and model["table"].scales.dtype == torch.bfloat16


@pytest.mark.parametrize("config", [QuantConfig("kmeans", 4, 64), QuantConfig("int", 4, 64)])
def test_minilm_folder_through_automodel(minilm_dir, tmp_path, config):
    """The real MiniLM folder: AutoModel.from_pretrained of the quantized folder gives the last hidden
    states of hilt's own path (the dense model with load_quantized_)."""
    dst = tmp_path / "q"
    quantize_checkpoint(minilm_dir, dst, config)
    assert (dst / "tokenizer.json").is_file() and (dst / "1_Pooling").is_dir()
    model = transformers.AutoModel.from_pretrained(str(dst), dtype=torch.float32).eval()
    assert isinstance(model.encoder.layer[0].attention.self.query, QuantLinear)
    own = load_quantized_(transformers.AutoModel.from_pretrained(str(minilm_dir), dtype=torch.float32).eval(), dst,
                          strict=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(dst))
    batch = tokenizer(["A quantized encoder.", "To be, or not to be, that is the question."], padding=True,
                      return_tensors="pt")
    with torch.inference_mode():
        theirs, ours = model(**batch).last_hidden_state, own(**batch).last_hidden_state
    assert torch.isfinite(theirs).all()
    assert float((theirs - ours).abs().max() / ours.abs().max()) <= 1e-3


def test_from_pretrained_names_a_truncated_shard_of_a_hilt_folder(tmp_path):
    """transformers' own reader would fail deep inside with a SafetensorError naming no file; hilt's quantizer reads
    the shards' headers before the weights load and names the one cut short."""
    src = tiny_llama(tmp_path / "src")
    dst = tmp_path / "q"
    quantize_checkpoint(src, dst, QuantConfig("kmeans", 4, 32))
    shard = next(dst.glob("*.safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    with pytest.raises(HiltError, match=f"{shard}: truncated safetensors file") as e:
        load_hf(dst)
    assert len(str(e.value).splitlines()) == 1
