"""Error-compensated quantization: one layer against brute force and plain rounding, the layer-by-layer
pass through a model, and `hilt quantize --compensate` as a user runs it (MiniLM, real text)."""

import itertools
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import read_json, run_hilt
from hilt.errors import HiltError
from hilt.quant import QuantConfig, load_checkpoint, quantize_checkpoint, quantize_tensor
from hilt.quant.compensate import (CompensationConfig, Compensator, compensated_quantize, inverse_factor,
                                   output_error)
from test_cli_quantize import assert_clean_failure


def correlated_gram(k, seed, rows=512):
    """H = XᵀX/rows of inputs with strongly correlated columns, as a real layer's are."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k)
    x = torch.randn(rows, k, generator=g) @ mix
    x[:, : max(1, k // 8)] *= 4  # a few columns carry most of the energy
    return (x.T @ x).double() / rows


def test_compensation_between_brute_force_optimum_and_rounding():
    """Tiny layer, 2-bit int, one block of 8 (scales fixed): enumerate all 4**8 codes per row. The
    compensated weight can be no better than the optimum and never worse than rounding."""
    k, levels = 8, torch.arange(-2, 2, dtype=torch.float64)
    grid = torch.tensor(list(itertools.product(range(4), repeat=k)))  # (65536, 8)
    gains = []
    for seed in range(6):
        H = correlated_gram(k, seed)
        w = torch.randn(3, k, generator=torch.Generator().manual_seed(100 + seed)) * 0.1
        config = QuantConfig(method="int", bits=2, block_size=k)
        q, stats = compensated_quantize(w, H, config, CompensationConfig(scales="before", damp=1e-6))
        rounded = quantize_tensor(w, config)
        scale = rounded.scales.double()  # (3, 1), the same grid for every candidate
        cand = levels[grid][None] * scale[:, None, :]  # (3, 65536, 8)
        d = w.double()[:, None, :] - cand
        best = float(torch.einsum("rci,ij,rcj->rc", d, H, d).min(1).values.sum())
        err_q = output_error(w, q.dequantize(), H)
        err_r = output_error(w, rounded.dequantize(), H)
        assert best <= err_q * (1 + 1e-5) and err_q <= err_r * (1 + 1e-6), (seed, best, err_q, err_r)
        assert stats["output_rel_error"] <= stats["output_rel_error_rounded"]
        gains.append(err_r / err_q)
    assert max(gains) > 1.2  # on correlated inputs the compensation does win, not just tie


@pytest.mark.parametrize("method,bits", [("int", 4), ("int", 3), ("int", 2), ("int-asym", 3), ("kmeans", 3),
                                         ("kmeans", 2), ("binary", 1)])
@pytest.mark.parametrize("scales,act_order", [("before", False), ("during", False), ("during", True)])
def test_compensation_beats_rounding_on_correlated_inputs(method, bits, scales, act_order):
    H = correlated_gram(128, seed=bits)
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(7)) * 0.05
    w[:, 5] += 0.3  # an outlier column
    config = QuantConfig(method=method, bits=bits, block_size=32)
    q, stats = compensated_quantize(w, H, config, CompensationConfig(scales=scales, act_order=act_order,
                                                                    block_columns=48))
    assert stats["compensated"]
    # symmetric 2-bit int has a single positive level: little room to move error onto
    margin = 0.97 if (method, bits) == ("int", 2) else 0.9
    assert stats["output_rel_error"] < margin * stats["output_rel_error_rounded"]
    assert (q.method, q.bits, q.shape) == (method, bits, (48, 128))
    assert torch.isfinite(q.dequantize()).all()
    # the stats describe the weight that was returned
    base = output_error(w, torch.zeros_like(w), H)
    assert (output_error(w, q.dequantize(), H) / base) ** 0.5 == pytest.approx(stats["output_rel_error"], rel=1e-4)


@pytest.mark.parametrize("act_order", [False, True])
def test_a_shared_factor_gives_the_same_bytes(act_order, monkeypatch):
    """Layers that share an input share one inverse factor, computed in the Gram matrix's own storage a
    band of columns at a time: it is the factor of (H + damp)⁻¹ to the bit that cholesky_solve on the
    whole identity gives, and quantizing with it gives what computing it per layer gives (the sweep's
    rounding depends on the factor's memory layout too)."""
    monkeypatch.setattr("hilt.quant.compensate.SOLVE_COLUMNS", 80)  # three bands, the last one narrower
    k, comp = 192, CompensationConfig(act_order=act_order)
    H = correlated_gram(k, 3)
    order, U = inverse_factor(H.clone(), comp, "x")
    Hp = H[order][:, order]
    damped = Hp + comp.damp * float(Hp.diagonal().mean()) * torch.eye(k, dtype=H.dtype)
    assert torch.allclose(U.double().T @ U.double() @ damped, torch.eye(k, dtype=H.dtype), atol=1e-4)
    eye = torch.eye(k, dtype=H.dtype)  # the same steps on fresh arrays: same values, same layout
    reference = torch.linalg.cholesky(torch.cholesky_solve(eye, torch.linalg.cholesky(damped)), upper=True).float()
    assert torch.equal(U, reference) and U.stride() == reference.stride()
    config = QuantConfig(method="kmeans", bits=3)
    w = torch.randn(40, k, generator=torch.Generator().manual_seed(7))
    alone, _ = compensated_quantize(w, H, config, comp)
    shared, _ = compensated_quantize(w, H.float(), config, comp, factor=(order, U))
    for a, b in zip((alone.codes, alone.scales, alone.codebook), (shared.codes, shared.scales, shared.codebook)):
        assert torch.equal(a, b)
    with pytest.raises(HiltError, match="layer 'x'.*float64"):
        inverse_factor(H.float(), comp, "x")


def test_compensation_refuses_bad_gram_and_per_block_codebooks():
    w = torch.randn(8, 64)
    H = correlated_gram(64, 0)
    H[3, 3] = float("nan")
    with pytest.raises(HiltError, match="layer 'blk.0.x.weight'.*NaN"):
        compensated_quantize(w, H, QuantConfig(method="int", bits=4), name="blk.0.x.weight")
    with pytest.raises(HiltError, match="Gram matrix of shape"):
        compensated_quantize(w, correlated_gram(32, 0), QuantConfig(method="int", bits=4, block_size=32))
    with pytest.raises(HiltError, match="--codebook layer"):
        compensated_quantize(w, correlated_gram(64, 0), QuantConfig(bits=3, codebook="block"))


class TinyBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q, self.k = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x, gain):
        a = torch.tanh(self.q(x)) * self.k(x)
        return x + self.down(torch.relu(self.up(x + a))) * gain


class TinyNet(nn.Module):
    def __init__(self, d=64, n=3):
        super().__init__()
        self.embed = nn.Linear(16, d)
        self.blocks = nn.ModuleList(TinyBlock(d) for _ in range(n))

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h, gain=0.5)
        return h


def test_compensator_runs_blocks_in_order_and_beats_rounding():
    torch.manual_seed(0)
    net = TinyNet().eval().requires_grad_(False)
    mix = torch.randn(16, 16)
    data = [(torch.randn(32, 16) @ mix,) for _ in range(8)]
    config = QuantConfig(method="int", bits=3, block_size=32)
    reference = torch.cat([net(*b) for b in data])
    rounded_net = TinyNet().eval().requires_grad_(False)
    rounded_net.load_state_dict(net.state_dict())
    for name, lin in rounded_net.blocks.named_modules():
        if isinstance(lin, nn.Linear):
            lin.weight.copy_(quantize_tensor(lin.weight, config).dequantize())
    comp = Compensator(net, data, config, targets=None, calibration="8 random batches")
    out = comp.run_all()
    assert sorted(out) == sorted(f"blocks.{i}.{n}.weight" for i in range(3) for n in ("q", "k", "up", "down"))
    assert comp.settings["calibration"] == "8 random batches" and comp.settings["scales"] == "during"
    # the model now holds the dequantized weights: its error is the compensated pass's
    err_comp = float((torch.cat([net(*b) for b in data]) - reference).pow(2).mean())
    err_round = float((torch.cat([rounded_net(*b) for b in data]) - reference).pow(2).mean())
    assert err_comp < 0.7 * err_round, (err_comp, err_round)
    assert all(v >= 0 for v in comp.seconds.values())


def test_releasing_what_lies_outside_the_blocks_changes_nothing_but_memory():
    torch.manual_seed(1)
    nets = [TinyNet().eval().requires_grad_(False) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    data = [(torch.randn(32, 16),) for _ in range(4)]
    config = QuantConfig(method="kmeans", bits=3, block_size=32)
    kept, freed = (Compensator(net, data, config, release_outside=r).run_all() for net, r in zip(nets, (False, True)))
    assert all(torch.equal(kept[n].codes, freed[n].codes) and torch.equal(kept[n].scales, freed[n].scales)
               for n in kept)
    assert nets[1].embed.weight.is_meta and nets[1].embed.bias.is_meta and not nets[0].embed.weight.is_meta
    assert not nets[1].blocks[0].q.weight.is_meta


def test_compensator_refuses_a_model_without_blocks():
    flat = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    with pytest.raises(HiltError, match="no list of repeated blocks"):
        Compensator(flat, [(torch.randn(2, 8),)], QuantConfig(method="int", bits=4, block_size=8))


@pytest.fixture(scope="module")
def minilm():
    from hilt.models.bert import minilm_path

    return minilm_path()


def test_cli_compensate_minilm(tmp_path, minilm):
    """Real model, real text: the header records the run and every layer's output error, which is
    never worse than rounding's (the quality against rounding: test_bench_ptq_quick)."""
    dst = tmp_path / "comp"
    r = run_hilt("quantize", minilm, dst, "--method", "int", "--bits", "3", "--compensate",
                 "--calibration-sentences", "16", "--only", r"encoder\.layer\.[01]\.", "--json", tmp_path / "q.json")
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and "output error" in r.stdout + r.stderr
    header = read_json(dst / "hilt.json")
    assert header["compensation"]["calibration"] == "16 sentences of macbeth"
    layers = [e for e in header["tensors"].values() if "compensated" in e]
    assert len(layers) == 12  # 2 layers x (q, k, v, attention output, intermediate, output)
    assert all(e["output_rel_error"] <= e["output_rel_error_rounded"] for e in layers)
    assert sum(e["compensated"] for e in layers) >= 10
    report = read_json(tmp_path / "q.json")
    assert report["compensation"]["seconds"]["quantize"] > 0


def test_compensate_resumes_to_the_same_bytes(tmp_path, minilm):
    """Interrupted after a few tensors (DST.partial kept), resumed: the same files as one run."""
    from hilt.tasks.compensate import compensator

    config = QuantConfig(method="int", bits=4)

    def make(targets, stop_after=None):
        comp = compensator(minilm, config, CompensationConfig(), targets, sentences=16)
        if stop_after is not None:
            real, calls = comp.quantized, [0]

            def interrupted(name, known=None):
                calls[0] += 1
                if calls[0] > stop_after:
                    raise KeyboardInterrupt
                return real(name, known)
            comp.quantized = interrupted
        return comp

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    layers = r"^encoder\.layer\.[01]\."  # 12 tensors compensated, in several shards; the rest copied
    quantize_checkpoint(minilm, whole, config, only=layers, compensate=make, shard_bytes=1 << 18)
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(minilm, resumed, config, only=layers, compensate=lambda t: make(t, stop_after=7),
                            shard_bytes=1 << 18)
    assert Path(str(resumed) + ".partial").is_dir() and not resumed.exists()
    quantize_checkpoint(minilm, resumed, config, only=layers, compensate=make, shard_bytes=1 << 18, resume=True)
    a, b = load_checkpoint(whole), load_checkpoint(resumed)
    assert list(a) == list(b) and sum(not isinstance(x, torch.Tensor) for x in a.values()) == 12
    for name in a:
        x, y = a[name], b[name]
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), name
        else:
            assert torch.equal(x.codes, y.codes) and torch.equal(x.scales, y.scales), name


def test_cli_compensate_bad_input(tmp_path, minilm):
    dst = tmp_path / "out"
    r = run_hilt("quantize", minilm, dst, "--calibration", "x.txt")
    assert r.returncode == 2 and "--calibration applies with --compensate only" in r.stderr
    short = tmp_path / "short.txt"
    short.write_text("One sentence only.\nAnd a second.\n")
    r = run_hilt("quantize", minilm, dst, "--compensate", "--calibration", short)
    assert_clean_failure(r, "short.txt", "calibration text too short", dst=dst)
    other = tmp_path / "plain.safetensors"
    from safetensors.torch import save_file

    save_file({"layer.weight": torch.randn(8, 64)}, str(other))
    r = run_hilt("quantize", other, dst, "--compensate")
    assert_clean_failure(r, "plain.safetensors", "causal language models (a GGUF file, a Hugging Face folder)", dst=dst)
    r = run_hilt("quantize", minilm, dst, "--compensate", "--codebook", "block")
    assert_clean_failure(r, "--codebook layer", dst=dst)
    r = run_hilt("quantize", minilm, dst, "--compensate", "--importance", short)
    assert r.returncode != 0 and not dst.exists()


def test_bench_ptq_quick(tmp_path):
    """The peers study on MiniLM at 3 bits: every method ran, bits/weight counted alike, and the
    compensated formats beat their rounded counterparts."""
    from hilt.bench.studies.ptq import hqq_available

    r = run_hilt("bench", "ptq", "--quick", "--out", tmp_path, "--json", tmp_path / "ptq.json", timeout=900)
    assert r.returncode == 0, r.stderr
    result = read_json(tmp_path / "ptq.json")
    rows = {row["method"]: row for row in result["rows"]}
    expected = {"fp32", "int", "kmeans", "kmeans-imp", "gptq-int", "gptq-kmeans"} | ({"hqq"} if hqq_available() else set())
    assert set(rows) == expected
    assert rows["int"]["bits_per_weight"] == pytest.approx(3.25, abs=0.01)
    if "hqq" in rows:
        assert rows["hqq"]["bits_per_weight"] == pytest.approx(3.5)  # fp16 scale and zero per group of 64
    assert rows["gptq-int"]["quality"] > rows["int"]["quality"]
    assert rows["gptq-kmeans"]["quality"] > max(rows["kmeans-imp"]["quality"], rows["gptq-int"]["quality"])
    assert set(rows["gptq-kmeans"]["seconds_split"]) == {"forward", "gram", "quantize"}
    assert (tmp_path / "ptq_quick.png").stat().st_size > 10_000 and (tmp_path / "ptq.md").exists()


def test_compensate_a_hugging_face_causal_lm(tmp_path):
    """A Hugging Face Llama folder (tensor names as transformers has them) compensated on Macbeth: every block
    linear compensated, none worse than rounding, and the folder still loads through from_pretrained."""
    transformers = pytest.importorskip("transformers")
    from test_hf import _byte_tokenizer, tiny_llama

    src = tiny_llama(tmp_path / "src", dtype=torch.float32)
    transformers.PreTrainedTokenizerFast(tokenizer_object=_byte_tokenizer()).save_pretrained(src)
    dst = tmp_path / "comp"
    r = run_hilt("quantize", src, dst, "--method", "kmeans", "--bits", "3", "--block-size", "32", "--compensate",
                 "--calibration-tokens", "1024")
    assert r.returncode == 0, r.stderr
    header = read_json(dst / "hilt.json")
    assert header["compensation"]["calibration"] == "1024 tokens of macbeth"
    layers = {n: e for n, e in header["tensors"].items() if "compensated" in e}
    assert len(layers) == 14 and all(n.startswith("model.layers.") for n in layers)  # 2 blocks x 7 linears
    assert all(e["output_rel_error"] <= e["output_rel_error_rounded"] for e in layers.values())
    model = transformers.AutoModelForCausalLM.from_pretrained(str(dst), dtype=torch.float32)
    with torch.inference_mode():
        assert torch.isfinite(model(torch.tensor([[40, 41, 42]])).logits).all()
    # a folder transformers runs, but not as a causal LM: refused in one line before anything is read
    other = tmp_path / "encoder"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "vit"}')
    r = run_hilt("quantize", other, tmp_path / "out", "--compensate")
    assert_clean_failure(r, "'vit' is none of these", dst=tmp_path / "out")


def test_trim_heap_hands_freed_pages_back():
    """glibc keeps freed heap memory resident; trim_heap returns it (a block's temporaries, each pass)."""
    import ctypes
    import os

    from hilt.quant.compensate import trim_heap

    try:
        ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        trim_heap()  # elsewhere: a no-op
        pytest.skip("not glibc")

    def resident_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    chunks = [bytearray(64 << 10) for _ in range(4096)]  # 256 MB in pieces below mmap's threshold: the heap
    for c in chunks:
        c[::4096] = b"\x01" * len(c[::4096])  # every page touched: resident
    keep = chunks[::64]  # one piece in 64 kept: the heap cannot just shrink from its top
    del chunks
    before = resident_mb()
    trim_heap()
    assert resident_mb() < before - 150, (before, resident_mb())
    del keep
