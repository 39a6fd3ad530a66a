"""QAT (quant/qat.py; its study, bench/studies/qat_scaling.py): straight-through gradients, codebook refits,
export that equals training."""

import pytest
import torch

from hilt.models.gpt import GPT, GPTConfig, batch, corpus
from hilt.errors import HiltError
from hilt.quant import QuantConfig, load_quantized_
from hilt.quant.qat import (
    FakeQuantLinear,
    QATSchedule,
    fake_quant_layers,
    prepare_qat_,
    qat_step_,
    save_qat,
    start_quantizing_,
)


def _tiny(seed=0):
    alphabet, train, _ = corpus()
    torch.manual_seed(seed)
    model = GPT(GPTConfig(len(alphabet), block_size=32, n_layer=2, n_head=2, n_embd=64))
    x, y = batch(train, 32, 8, torch.Generator().manual_seed(seed))
    return model, x, y


def _quantized_weight_with_grad(fq, x):
    """Backpropagate (fq(x)^2).sum() through the layer, and the same loss through a plain linear on
    the detached Q(W); returns that Q(W), its .grad holding dL/dQ."""
    (fq(x) ** 2).sum().backward()
    q = fq.quantized_weight().detach().requires_grad_(True)
    (torch.nn.functional.linear(x, q, fq.bias.detach()) ** 2).sum().backward()
    return q


@pytest.mark.parametrize("method, bits", [("kmeans", 2), ("int", 4), ("binary", 1), ("int-asym", 3)])
def test_straight_through_gradient_is_the_gradient_at_the_quantized_weight(method, bits):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 8)
    fq = FakeQuantLinear(linear, QuantConfig(method=method, bits=bits, block_size=32))
    fq.fit_codebook()
    fq.quantizing = True
    q = _quantized_weight_with_grad(fq, torch.randn(5, 64))
    torch.testing.assert_close(linear.weight.grad, q.grad)
    assert not torch.equal(q, linear.weight.detach())  # it did quantize
    levels = fq.codebook.unique().numel()
    assert levels == 2**bits


def _loss_and_error(model, x, y, layers, quantizing=True):
    """(loss, the codebook fit's objective: squared quantization error in block units, summed) with
    the layers quantizing or not."""
    from hilt.quant.quantize import normalise_blocks

    with torch.no_grad():
        for layer in layers.values():
            layer.quantizing = quantizing
        loss = float(model(x, y)[1])
        err = 0.0
        for layer in layers.values():
            _, _, u = normalise_blocks(layer.weight.float(), layer.config)
            book = layer.codebook.half().float()
            err += float(((u - book[(u[..., None] - book).abs().argmin(-1)]) ** 2).sum())
        for layer in layers.values():
            layer.quantizing = True
    return loss, err


def test_a_trained_codebook_gets_the_scale_weighted_gradient_of_its_weights():
    """dL/dc = sum over the weights snapped to level c of their block scale x dL/dQ; W still gets
    dL/dQ; weight decay skips the codebooks; a codebook that is not trained is no parameter."""
    from hilt.quant import kmeans
    from hilt.quant.qat import qat_param_groups
    from hilt.quant.quantize import normalise_blocks

    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 16)
    config = QuantConfig(method="kmeans", bits=2, block_size=32)
    fq = FakeQuantLinear(linear, config)
    fq.fit_codebook()
    fq.quantizing = True
    q = _quantized_weight_with_grad(fq, torch.randn(7, 96))
    torch.testing.assert_close(linear.weight.grad, q.grad)
    scales, _, u = normalise_blocks(linear.weight.detach().float(), config)
    codes = kmeans.assign(u, fq.levels().double()).flatten()
    per_weight = (q.grad.view_as(u) * scales.float().unsqueeze(-1)).flatten()
    want = torch.zeros(4).index_add_(0, codes, per_weight)
    torch.testing.assert_close(fq.codebook.grad, want, rtol=2e-3, atol=1e-4)  # fp32 sums in another order
    assert (want != 0).all()

    model, _, _ = _tiny()
    prepare_qat_(model, config)
    decayed, kept = qat_param_groups(model, weight_decay=0.1)
    books = {id(layer.codebook) for layer in fake_quant_layers(model).values()}
    assert {id(p) for p in kept["params"]} == books and decayed["weight_decay"] == 0.1 and kept["weight_decay"] == 0
    assert len(decayed["params"]) + len(kept["params"]) == len(list(model.parameters()))
    fixed = FakeQuantLinear(torch.nn.Linear(64, 8), config, learn_codebook=False)
    assert "codebook" in dict(fixed.named_buffers()) and "codebook" not in dict(fixed.named_parameters())
    for learn in (True, False):  # the codebook lives where the weights do (a model already on the GPU)
        assert FakeQuantLinear(torch.nn.Linear(64, 8, device="meta"), config, learn_codebook=learn).codebook.is_meta


@pytest.mark.parametrize("steps, refits", [(None, {6, 10}), (12, {6}), (15, {6, 10})])
def test_warmup_then_refits_follow_the_schedule(steps, refits):
    """Quantization starts after the warm-up; refits follow every refit_every steps, but none with
    fewer than refit_every steps left to train against it."""
    model, x, y = _tiny()
    prepare_qat_(model, QuantConfig(method="kmeans", bits=2, block_size=32))
    layers = fake_quant_layers(model)
    assert len(layers) == 2 * 6  # q, k, v, proj and the two MLP Linears per block; the tied head stays dense
    schedule = QATSchedule(warmup=3, refit_every=4, steps=steps)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    events = {}
    for step in range(12):
        assert all(layer.quantizing == (step >= 3) for layer in layers.values())
        loss = model(x, y)[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
        events[step] = qat_step_(model, step, schedule)
    assert {s: e for s, e in events.items() if e} == {2: "start"} | {s: "refit" for s in refits}


def test_a_refit_lowers_the_quantization_error_and_moves_the_loss_less_than_quantization_does():
    model, x, y = _tiny(3)
    prepare_qat_(model, QuantConfig(method="kmeans", bits=2, block_size=32))
    layers = fake_quant_layers(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(80):  # 50 full-precision steps, then the weights move away from the codebook fitted at 50
        if step == 50:
            start_quantizing_(model)
        loss = model(x, y)[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
    old_loss, old_err = _loss_and_error(model, x, y, layers)
    full_loss, _ = _loss_and_error(model, x, y, layers, quantizing=False)
    for layer in layers.values():
        layer.fit_codebook()
    new_loss, new_err = _loss_and_error(model, x, y, layers)
    assert new_err <= old_err * (1 + 1e-3)  # the optimal k-means of the current weights
    assert abs(new_loss - old_loss) <= abs(old_loss - full_loss)


def test_exported_checkpoint_reloads_to_the_same_outputs(tmp_path):
    model, x, _ = _tiny(1)
    prepare_qat_(model, QuantConfig(method="kmeans", bits=2, block_size=32))
    with pytest.raises(HiltError, match="warm-up"):
        save_qat(model, tmp_path / "early")
    start_quantizing_(model)
    with torch.no_grad():  # as training can leave it: a codebook whose levels moved past each other
        book = next(iter(fake_quant_layers(model).values())).codebook
        book.copy_(book.flip(0) * torch.tensor([1.0, 0.9, 1.1, 1.0]))
        want = model(x)
    header = save_qat(model, tmp_path / "qat")
    assert header["totals"]["quantized_tensors"] == 12
    fresh, _, _ = _tiny(2)  # other weights: everything must come from the checkpoint
    load_quantized_(fresh, tmp_path / "qat")
    with torch.no_grad():
        got = fresh(x)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    with pytest.raises(HiltError, match="exists"):
        save_qat(model, tmp_path / "qat")


def test_a_model_without_eligible_layers_is_refused():
    with pytest.raises(HiltError, match="block size 64"):
        prepare_qat_(torch.nn.Sequential(torch.nn.Linear(10, 4)), QuantConfig(block_size=64))


def test_qat_resumes_to_the_same_checkpoint_as_an_uninterrupted_run(smollm2_gguf, tmp_path, monkeypatch):
    from hilt.models import llama
    from hilt.quant import load_checkpoint
    from hilt.tasks import qat_finetune

    # SmolLM2's tokenizer and text, a 4-block Llama of width 64 (seeded): resume is about the
    # state on disk and the batches drawn, which the model's size does not change
    tokenizer = llama.GGUFTokenizer.from_gguf(smollm2_gguf, llama.read_gguf(smollm2_gguf))

    def small_llama():
        torch.manual_seed(0)
        cfg = llama.LlamaConfig(vocab_size=tokenizer.vocab_size, dim=64, n_layers=4, n_heads=4, n_kv_heads=2,
                                ffn_dim=128)
        return llama.Llama(cfg).eval(), tokenizer

    monkeypatch.setattr(llama, "load_llama", small_llama)

    small = {"bits": 2, "steps": 2, "batch": 1, "context": 16, "save_every": 1, "lr": 1e-4, "progress": False,
             "only": r"blk\.[01]\.attn_q"}
    real_save = qat_finetune.save_qat

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C after step 1's state was written, before the checkpoint

    monkeypatch.setattr(qat_finetune, "save_qat", interrupted)
    with pytest.raises(KeyboardInterrupt):
        qat_finetune.finetune(tmp_path / "resumed", **small)
    assert (tmp_path / "resumed.qat-state" / "state.json").is_file() and not (tmp_path / "resumed").exists()
    monkeypatch.setattr(qat_finetune, "save_qat", real_save)
    with pytest.raises(HiltError, match="other settings"):  # refused before the model loads
        qat_finetune.finetune(tmp_path / "resumed", **{**small, "lr": 2e-4}, resume=True)
    with pytest.raises(HiltError, match="nothing to resume"):
        qat_finetune.finetune(tmp_path / "never-started", **small, resume=True)
    resumed = qat_finetune.finetune(tmp_path / "resumed", **small, resume=True)
    assert resumed["resumed_at"] == 1 and not (tmp_path / "resumed.qat-state").exists()
    qat_finetune.finetune(tmp_path / "straight", **small)
    a, b = load_checkpoint(tmp_path / "resumed"), load_checkpoint(tmp_path / "straight")
    name = "blk.0.attn_q.weight"
    assert a.keys() == b.keys() and torch.equal(a[name].dequantize(), b[name].dequantize())
    assert sum(1 for n in a if n.endswith("attn_q.weight") and not isinstance(a[n], torch.Tensor)) == 2
    assert torch.equal(a["blk.3.attn_norm.weight"], b["blk.3.attn_norm.weight"])


def test_study_fits_recover_a_known_scaling_law_and_gamma():
    import math

    from hilt.bench.studies import qat_scaling

    e, a, alpha, gamma = 1.2, 40.0, 0.3, 1.5
    full = [{"width": w, "method": "16-bit", "bits": 16, "n_quantizable": n, "val_loss": e + a * n**-alpha}
            for w, n in ((64, 2e5), (96, 4.5e5), (128, 8e5), (192, 1.8e6))]
    fit = qat_scaling._fit_scaling(full)
    assert fit["E"] == pytest.approx(e, abs=0.02) and fit["alpha"] == pytest.approx(alpha, rel=0.05)
    quantized = []
    for r in full:
        for bits in (1, 2, 4):
            n_eff = r["n_quantizable"] * (1 - math.exp(-bits / gamma))
            quantized.append({**r, "method": "kmeans", "bits": bits, "val_loss": e + a * n_eff**-alpha})
    g = qat_scaling._gamma(quantized, {"E": e, "A": a, "alpha": alpha})
    assert g == pytest.approx(gamma, rel=0.01) and all(0 < r["n_eff_ratio"] <= 1 for r in quantized)
    assert qat_scaling._fit_scaling([{**r, "val_loss": 3.0 + r["n_quantizable"] * 1e-7} for r in full]) is None


def test_study_compares_formats_on_the_seeds_mean_and_seed_by_seed():
    from hilt.bench.studies import qat_scaling

    runs = [{"width": 64, "method": m, "bits": 2, "seed": s, "memory_kib": 10.0, "n_quantizable": 100,
             "bits_per_weight": 2.25, "lr": 9e-3, "val_loss": loss}
            for m, losses in (("kmeans", (2.0, 2.3, 2.1)), ("int", (2.1, 2.2, 2.15))) for s, loss in enumerate(losses)]
    rows = {r["method"]: r for r in qat_scaling._mean_rows(runs)}
    assert rows["kmeans"]["val_losses"] == [2.0, 2.3, 2.1] and rows["kmeans"]["val_loss"] == pytest.approx(6.4 / 3)
    assert rows["int"]["val_loss_std"] == pytest.approx(0.05)
    (v,) = qat_scaling._kmeans_vs_int(list(rows.values()))
    assert v["per_seed"] == pytest.approx([-0.1, 0.1, -0.05]) and v["seeds_won"] == 2
    assert v["kmeans_minus_int"] == pytest.approx(6.4 / 3 - 2.15) and v["kmeans_wins"]


def test_study_learning_rate_per_width():
    from hilt.bench.studies import qat_scaling

    assert qat_scaling.lr_for(64) == qat_scaling.LR_BY_WIDTH[64] and qat_scaling.lr_for(128) == qat_scaling.LR_BY_WIDTH[128]
    assert qat_scaling.lr_for(200) == qat_scaling.DEFAULT_LR and qat_scaling.lr_for(128, lr=1e-3) == 1e-3  # --lr: every width


def test_study_counts_a_trained_codebook_once():
    from hilt.bench.studies import qat_scaling

    config = QuantConfig(method="kmeans", bits=2, block_size=32)
    memory = []
    for learn in (True, False):
        model, _, _ = _tiny()
        prepare_qat_(model, config, learn_codebook=learn)
        memory.append(qat_scaling.weight_memory_bits(model, config))
    assert memory[0] == memory[1]
    total, linear, n = memory[0]
    assert linear == pytest.approx(n * (2 + 16 / 32) + 12 * 4 * 16)  # codes, bf16 scales, 12 fp16 codebooks


def test_study_ranks_formats_within_each_budget_by_loss_and_by_task():
    """At a 16-bit model's memory each format's largest fitting width is ranked; a 1-bit model that scores best on a
    task but not on loss gives "holds" by the task and "does not hold" by loss."""
    from hilt.bench.studies import qat_scaling

    def run(width, method, bits, memory, loss, correct):
        per_item = [1] * correct + [0] * (10 - correct)
        return {"width": width, "method": method, "bits": bits, "seed": 0, "memory_kib": memory, "n_quantizable": 100,
                "bits_per_weight": float(bits), "lr": 9e-3, "val_loss": loss,
                "tasks": {"next_line": {"per_item": per_item, "chance": 0.25}}}

    runs = [run(64, "16-bit", 16, 100.0, 1.5, 5), run(128, "16-bit", 16, 400.0, 1.3, 6),
            run(64, "kmeans", 1, 10.0, 2.0, 3), run(128, "kmeans", 1, 40.0, 1.7, 10),
            run(128, "int", 4, 150.0, 1.4, 4), run(64, "int", 4, 35.0, 1.6, 2)]
    rows = qat_scaling._mean_rows(runs)
    small, large = qat_scaling._budget_rankings(rows)
    assert small["memory_kib"] == 100.0
    assert [(e["format"], e["width"]) for e in small["entries"]] == [("16-bit", 64), ("kmeans 1-bit", 128),
                                                                      ("int 4-bit", 64)]
    assert small["ranking"]["val_loss"] == ["16-bit", "int 4-bit", "kmeans 1-bit"]
    assert small["ranking"]["next_line"] == ["kmeans 1-bit", "16-bit", "int 4-bit"]
    assert small["one_bit_first"] == {"val_loss": False, "next_line": True}
    assert small["clear_first"]["next_line"] and not small["rankings_agree"]["next_line"]
    assert small["above_chance"]["next_line"]
    assert large["ranking"]["val_loss"][0] == "16-bit" and large["entries"][2]["width"] == 128
    text = qat_scaling.render_tasks({"task_items": "test items", "budget_rankings": [small, large]})
    assert "by loss: 16-bit first, 1-bit wins: does not hold" in text
    assert "by next line: kmeans 1-bit first, 1-bit wins: holds (clear of the runner-up)" in text
    guessing = qat_scaling._budget_rankings(qat_scaling._mean_rows([{**r, "tasks": run(64, "int", 4, 1, 1, 3)["tasks"]}
                                                                    for r in runs]))
    assert not guessing[0]["above_chance"]["next_line"]  # 3 of 10 right, chance 1 in 4: the task tells nothing
    assert "by next line: no verdict, no format clear of chance" in qat_scaling.render_tasks(
        {"task_items": "test items", "budget_rankings": guessing})
