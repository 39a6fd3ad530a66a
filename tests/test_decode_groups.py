"""Decode's larger calls: sibling layers that read the same input computed in one kernel call
(kernels.lut_cpu.PreparedGroup, quant.nn.SharedInput), and the output head quantized through the same kernel
(quantize_model_'s ``embeddings``). Each grouped output must equal the layer's own, bit for bit."""

import pytest
import torch
from torch import nn

from hilt.kernels import lut_cpu
from hilt.quant import QuantConfig, QuantLinear, quantize_model_, quantize_tensor
from hilt.quant.nn import QuantEmbedding, SharedInput, TiedHead, group_projections_

pytestmark = pytest.mark.skipif(not lut_cpu.available(), reason="no C compiler for the CPU kernel")

transformers = pytest.importorskip("transformers")


def _count_group_calls(monkeypatch) -> list:
    calls = []
    real = lut_cpu.PreparedGroup.__call__

    def spy(self, x, biases):
        calls.append(len(self.members))
        return real(self, x, biases)

    monkeypatch.setattr(lut_cpu.PreparedGroup, "__call__", spy)
    return calls


@pytest.mark.parametrize("seed", range(3))
def test_group_call_equals_each_layer_alone_on_awkward_shapes(seed):
    """Fresh random weights of mixed widths (the pair tables at 1-2 bits, the weight lookup at 3-4), odd row
    counts, biases on some; x of 1 to 17 rows in float32 and bfloat16, NaN and inf in x propagating alike."""
    g = torch.Generator().manual_seed(seed)
    k = 64 * int(torch.randint(1, 5, (1,), generator=g))
    rows = [1, 17, 33, 48, 5][: 2 + seed]
    bits = [(1, "binary"), (2, "kmeans"), (3, "kmeans"), (4, "kmeans"), (4, "int")]
    layers = []
    for i, n in enumerate(rows):
        b, method = bits[(i + seed) % len(bits)]
        q = quantize_tensor(torch.randn(n, k, generator=g), QuantConfig(method, b, 64))
        layers.append(QuantLinear(q, torch.randn(n, generator=g) if i % 2 else None))
    for dtype in (torch.float32, torch.bfloat16):
        for m in (1, 3, 16, 17):
            x = torch.randn(2, m, k, generator=g).to(dtype)[:1]  # a view, as a model's activations can be
            if m == 3:
                x[0, 1, 5], x[0, 2, 7] = float("nan"), float("inf")
            alone = [layer._matmul(x, layer.bias) for layer in layers]
            kernels = [layer._cpu_kernel(x) for layer in layers]
            together = lut_cpu.PreparedGroup(kernels)(x, [layer.bias for layer in layers])
            for a, t in zip(alone, together):
                assert t.dtype == dtype and t.shape == a.shape
                assert torch.equal(a.isnan(), t.isnan()) and torch.equal(a.nan_to_num(), t.nan_to_num())


def test_shared_input_gives_each_layer_its_own_output_once(monkeypatch):
    g = torch.Generator().manual_seed(0)
    q, k = (QuantLinear(quantize_tensor(torch.randn(n, 128, generator=g), QuantConfig("kmeans", 4, 64)))
            for n in (96, 32))
    parent = nn.Module()
    parent.q_proj, parent.k_proj = q, k
    parent.v_proj = QuantLinear(quantize_tensor(torch.randn(32, 128, generator=g), QuantConfig("kmeans", 2, 64)))
    parent.o_proj = QuantLinear(quantize_tensor(torch.randn(128, 128, generator=g), QuantConfig("kmeans", 4, 64)))
    assert group_projections_(parent) == 1 and parent.o_proj.group is None
    assert isinstance(q.group, SharedInput) and q.group is parent.v_proj.group
    calls = _count_group_calls(monkeypatch)
    with torch.inference_mode():
        x, other = torch.randn(1, 128, generator=g), torch.randn(1, 128, generator=g)
        expected = [layer._matmul(x, None) for layer in (q, k, parent.v_proj)]
        got = [q(x), k(x), parent.v_proj(x)]
        assert calls == [3] and all(torch.equal(a, b) for a, b in zip(expected, got))
        # a sibling given another input computes for that input, not the group's
        assert torch.equal(q(x), expected[0]) and torch.equal(k(other), k._matmul(other, None))
        assert torch.equal(k(x), expected[1])  # taken once: the group ran again for x
    with torch.no_grad():  # an input changed in place after the group ran is another input
        y = torch.randn(1, 128, generator=g)
        q(y)
        y.mul_(2)
        assert torch.equal(k(y), k._matmul(y, None))
    with torch.inference_mode():
        # more rows than the kernel runs itself (prefill): each layer alone
        prefill = torch.randn(40, 128, generator=g)
        assert torch.equal(q(prefill), q._matmul(prefill, None))
    assert calls == [3] * 6  # the changed input ran the group again


def test_state_dict_load_drops_outputs_computed_ahead():
    g = torch.Generator().manual_seed(1)
    parent = nn.Module()
    parent.gate_proj, parent.up_proj = (QuantLinear(quantize_tensor(torch.randn(64, 64, generator=g),
                                                                    QuantConfig("kmeans", 4, 64))) for _ in range(2))
    group_projections_(parent)
    other = QuantLinear(quantize_tensor(torch.randn(64, 64, generator=g), QuantConfig("kmeans", 4, 64)))
    with torch.inference_mode():
        x = torch.randn(1, 64, generator=g)
        parent.gate_proj(x)  # up's output for x is now kept ahead
    parent.up_proj.load_state_dict(other.state_dict())
    with torch.inference_mode():
        assert torch.equal(parent.up_proj(x), other(x))


def _tiny(family):
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    if family == "gemma3":
        config = transformers.Gemma3TextConfig(**common, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                               layer_types=["sliding_attention", "full_attention"])
        return transformers.Gemma3ForCausalLM(config).eval()
    if family == "qwen2":  # biases on q, k and v
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=False)).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=True)).eval()


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_decode_equals_ungrouped_in_transformers_models(monkeypatch, family, dtype):
    model = quantize_model_(_tiny(family), QuantConfig("kmeans", 4, 64)).to(dtype)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert sum(m.group is not None for m in layers) == 2 * 5  # q, k, v and gate, up in each of 2 layers
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(2))
    calls = _count_group_calls(monkeypatch)
    with torch.inference_mode():
        grouped = model.generate(ids, max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
        assert calls and set(calls) == {3, 2}
        for m in layers:
            m.group = None
        alone = model.generate(ids, max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    assert torch.equal(grouped.sequences, alone.sequences)
    assert all(torch.equal(a, b) for a, b in zip(grouped.scores, alone.scores))


@pytest.mark.parametrize("embeddings", [8, 4, QuantConfig("kmeans", 4, 64)])
def test_quantized_head_tied_and_untied(embeddings):
    """A tied head reads the quantized table's buffers (nothing stored twice); an untied one is its own layer.
    Logits stay close to those of the model with only its linear layers quantized, the more so the more bits."""
    for family in ("llama", "qwen2", "gemma3"):  # Gemma scales its lookups by sqrt(hidden size)
        model = quantize_model_(_tiny(family), QuantConfig("kmeans", 4, 64))
        ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            ref = model(ids).logits
        quantize_model_(model, QuantConfig("kmeans", 4, 64), embeddings=embeddings)  # now the tables and heads
        table = model.model.embed_tokens
        assert isinstance(table, QuantEmbedding)
        assert (table.scale is not None) == (family == "gemma3")
        if family != "qwen2":
            assert isinstance(model.lm_head, TiedHead) and model.lm_head.table is table
            assert not any(k.startswith("lm_head") for k in model.state_dict())
        else:
            assert isinstance(model.lm_head, QuantLinear) and model.lm_head.bits == table.bits
        with torch.no_grad():
            out = model(ids).logits
        assert torch.isfinite(out).all()
        assert (out - ref).norm() / ref.norm() < (0.02 if embeddings == 8 else 0.3)


def test_llama_cache_grows_in_place_and_equals_the_whole_forward():
    """hilt's Llama writes each new position into buffers with room to spare (no copy of the cache per token),
    moving to larger ones as they fill; the logits equal the whole sequence's, a cache expanded to a batch too."""
    from hilt.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                              max_seq_len=256)).eval()
    ids = torch.randint(0, 64, (1, 150), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        whole = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, :3], cache)]
        buffers = [cache[0][2].data_ptr()]
        for t in range(3, 150):
            steps.append(model(ids[:, t:t + 1], cache))
            buffers.append(cache[0][2].data_ptr())
        assert cache[0][0].shape[2] == 150 and cache[0][2].shape[2] >= 150
        assert len(set(buffers)) == 3  # 64 positions, then 130, then 266: not a new buffer per token
        torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=1e-4, atol=1e-4)
        batch = [[t.expand(3, *t.shape[1:]) for t in kv[:2]] for kv in cache]
        last = model(torch.full((3, 1), 5), batch)
        torch.testing.assert_close(last, model(torch.cat([ids, torch.tensor([[5]])], 1))[:, -1:].expand(3, 1, 64),
                                   rtol=1e-4, atol=1e-4)


def test_gemma_folder_with_quantized_embeddings_loads_scaled(tmp_path):
    """Gemma multiplies its embedding lookups by sqrt(hidden size): the quantized table loaded through
    from_pretrained keeps that factor (without it the 270M model's perplexity was 1e8)."""
    import hilt  # noqa: F401  (registers the quantizer)
    from hilt.quant import quantize_checkpoint

    model = _tiny("gemma3")
    model.save_pretrained(tmp_path / "dense")
    quantize_checkpoint(tmp_path / "dense", tmp_path / "q", QuantConfig("int", 8, 64), embeddings=8)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "q")).eval()
    assert loaded.model.embed_tokens.scale == pytest.approx(64 ** 0.5)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref, out = model(ids).logits, loaded(ids).logits
    assert (out - ref).norm() / ref.norm() < 0.03
