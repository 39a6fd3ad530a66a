"""`hilt hwa`: fine-tuning a language model for a CIM chip (cim_sim.training's LM losses, hilt.tasks.hwa)."""

import dataclasses
import filecmp
import json
import math

import pytest
import torch

from helpers import run_hilt
from hilt.cim_sim.training import (NoisyTraining, _device_read, clip_columns_, distillation_loss,
                                   embedding_distillation_loss)
from hilt.cim_sim.devices import PCM
from hilt.errors import HiltError
from hilt.models import llama
from hilt.tasks import hwa


def _one_line_failure(r, *needles, absent=()):
    err = r.stderr.strip()
    assert r.returncode == 1 and len(err.splitlines()) == 1 and err.startswith("hilt: error:"), err
    for n in needles:
        assert n in err, err
    for path in absent:
        assert not path.exists(), path


SMALL = {"steps": 2, "batch": 1, "context": 16, "save_every": 1, "progress": False,
         "overrides": {"weight_mapping": "column"}}


def test_saved_gguf_is_the_model(tiny_gguf):
    model, tok = llama.load_llama(tiny_gguf)
    ids = torch.tensor([tok.encode("To be, or not to be")])
    again = llama.Llama(model.cfg)
    again.load_state_dict(model.state_dict())
    assert model.cfg.dim == 32 and len(tok.encode("Macbeth")) >= 1
    assert torch.equal(model(ids), again.eval()(ids))


def test_device_read_follows_the_device_model():
    """The fused read (one pass, counter-based normals) draws what PCM.program, drift_exponent and read do."""
    dev = PCM()
    target = torch.stack([torch.full((200_000,), 15.0), torch.zeros(200_000)])  # G+ at 15 uS, G- at 0
    t = 86400.0
    gen = torch.Generator().manual_seed(0)
    read = dev.read(dev.program(target, gen), dev.drift_exponent(target, gen), t, gen)
    slow = read[0] - read[1]
    keys = torch.tensor([11, 12], dtype=torch.int32)
    log_t, sigma = torch.tensor(math.log((t + dev.t0) / dev.t0)), torch.tensor(dev.read_sigma(t))
    fast = _device_read(target, keys, log_t, sigma, dev)
    assert torch.isfinite(fast).all()
    assert float(fast.mean()) == pytest.approx(float(slow.mean()), rel=0.005)
    assert float(fast.std()) == pytest.approx(float(slow.std()), rel=0.02)
    assert float(fast.mean()) < 15.0 * 0.7  # drifted: a day is (86420 / 20)^-nu with nu near 0.06


def test_device_reads_are_drawn_within_the_time_range(monkeypatch):
    """perturb's read times: log-uniform within ``times`` (both ends reached in 200 draws), 1 s to a year
    by default; a year's reads stray further from the weights than a second's."""
    from hilt.cim_sim import training

    seen, real = [], training._device_read_compiled
    monkeypatch.setattr(training, "_device_read_compiled", lambda t, k, log_t, *a: seen.append(float(log_t)) or
                        real(t, k, log_t, *a))
    w, dev, year = torch.randn(16, 24), PCM(), 31557600.0
    log_of = lambda t: math.log((t + dev.t0) / dev.t0)  # noqa: E731
    for times in [(86400.0, year), (1.0, year)]:
        seen.clear()
        for i in range(200):
            training.perturb(w, 1.0, "pcm", torch.Generator().manual_seed(i), "column", times=times)
        lo, hi = log_of(times[0]), log_of(times[1])
        assert lo - 1e-6 <= min(seen) < lo + 0.1 * (hi - lo) and hi - 0.1 * (hi - lo) < max(seen) <= hi + 1e-6
    seen.clear()
    training.perturb(w, 1.0, "pcm", torch.Generator().manual_seed(0), "column")
    assert lo - 1e-6 <= seen[0] <= hi + 1e-6  # the default: 1 s to a year
    error = {t: float(sum((training.perturb(w, 1.0, "pcm", torch.Generator().manual_seed(i), "column", times=(t, t))
                           - w).norm() for i in range(20))) for t in (1.0, year)}
    assert error[year] > 1.3 * error[1.0], error


def test_distillation_losses_vanish_on_the_teacher_and_dwp_weights_disagreement():
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(6, 11, generator=g)
    same = teacher.expand(3, 6, 11)
    for method in ["noise", "dwp"]:
        cfg = NoisyTraining(method=method, copies=3)
        assert float(distillation_loss(same, teacher, cfg)) == pytest.approx(0, abs=1e-6)
        assert float(embedding_distillation_loss(same, teacher, cfg)) == pytest.approx(0, abs=1e-6)
    noisy = teacher + torch.randn(3, 6, 11, generator=g)
    plain = distillation_loss(noisy, teacher, NoisyTraining(method="noise"))
    unweighted = distillation_loss(noisy, teacher, NoisyTraining(method="dwp", copies=3, weighting="none"))
    weighted = distillation_loss(noisy, teacher, NoisyTraining(method="dwp", copies=3))
    assert float(unweighted) == pytest.approx(float(plain), rel=1e-6)  # weights all one: the mean KL
    assert float(weighted) != pytest.approx(float(plain), rel=1e-3)
    # KL(teacher || copy) per token, by hand for one copy
    p, q = teacher.softmax(-1), noisy[:1].softmax(-1)
    kl = (p * (p.log() - q.log())).sum(-1).mean()
    assert float(distillation_loss(noisy[:1], teacher, NoisyTraining(method="noise"))) == pytest.approx(float(kl),
                                                                                                        rel=1e-5)


def test_iterative_clipping_holds_every_column_within_k_std():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    with torch.no_grad():
        net[0].weight[2, 5] = 10.0  # an outlier
    before = net[0].weight.detach().clone()
    limit = 2 * before.std(1, keepdim=True, correction=0)
    share = clip_columns_(net, 2.0)
    assert 0 < share < 0.2
    assert torch.equal(net[0].weight.detach(), before.clamp(-limit, limit))
    assert float(net[0].weight[2, 5]) == pytest.approx(float(limit[2]))


def test_resume_gives_the_same_bytes(tiny_gguf, tmp_path, monkeypatch):
    real_save = llama.save_gguf

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C after step 1's state was written, before the model

    monkeypatch.setattr(llama, "save_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        hwa.tune(str(tiny_gguf), tmp_path / "resumed.gguf", **SMALL)
    assert (tmp_path / "resumed.gguf.hwa-state" / "state.json").is_file()
    assert not (tmp_path / "resumed.gguf").exists()
    monkeypatch.setattr(llama, "save_gguf", real_save)
    with pytest.raises(HiltError, match="other settings"):
        hwa.tune(str(tiny_gguf), tmp_path / "resumed.gguf", **{**SMALL, "lr": 1e-3}, resume=True)
    with pytest.raises(HiltError, match="nothing to resume"):
        hwa.tune(str(tiny_gguf), tmp_path / "never.gguf", **SMALL, resume=True)
    resumed = hwa.tune(str(tiny_gguf), tmp_path / "resumed.gguf", **SMALL, resume=True)
    assert resumed["resumed_at"] == 1 and not (tmp_path / "resumed.gguf.hwa-state").exists()
    straight = hwa.tune(str(tiny_gguf), tmp_path / "straight.gguf", **SMALL)
    assert straight["losses"][1] == resumed["losses"][0]
    assert filecmp.cmp(tmp_path / "resumed.gguf", tmp_path / "straight.gguf", shallow=False)
    tuned, _ = llama.load_llama(tmp_path / "straight.gguf")
    base, _ = llama.load_llama(tiny_gguf)
    assert not torch.equal(tuned.blk[0].attn_q.weight, base.blk[0].attn_q.weight)


def test_a_teacher_is_what_the_student_is_distilled_from(tiny_gguf, tmp_path):
    """--teacher: the loss is taken against the teacher's outputs while the student starts from MODEL; a copy
    of MODEL as the teacher changes nothing."""
    copy_path = tmp_path / "copy.gguf"
    copy_path.write_bytes(tiny_gguf.read_bytes())
    other = tmp_path / "other.gguf"
    torch.manual_seed(1)
    model, _ = llama.load_llama(tiny_gguf)
    llama.save_gguf(llama.Llama(model.cfg).eval(), tiny_gguf, other)
    one = {**SMALL, "steps": 1}
    itself = hwa.tune(str(tiny_gguf), tmp_path / "a.gguf", **one)
    copied = hwa.tune(str(tiny_gguf), tmp_path / "b.gguf", **one, teacher=str(copy_path))
    taught = hwa.tune(str(tiny_gguf), tmp_path / "c.gguf", **one, teacher=str(other))
    assert copied["losses"] == itself["losses"] and copied["teacher"] == str(copy_path)
    assert filecmp.cmp(tmp_path / "a.gguf", tmp_path / "b.gguf", shallow=False)
    assert taught["losses"][0] > 2 * itself["losses"][0]  # two random models disagree far more than noise does
    tuned, _ = llama.load_llama(tmp_path / "c.gguf")  # one step from MODEL, not from the teacher
    assert torch.allclose(tuned.blk[0].attn_q.weight, model.blk[0].attn_q.weight, atol=1e-3)


def test_a_teacher_must_share_the_students_tokens(tiny_gguf, tmp_path):
    from hilt.tasks.drift_lm import load_language_model

    lm = load_language_model(str(tiny_gguf))
    shifted = dataclasses.replace(lm, encode=lambda text: [i + 1 for i in lm.encode(text)])
    with pytest.raises(HiltError, match="tokenizer splits text differently"):
        hwa._teacher(shifted, str(tiny_gguf), "student.gguf")
    _one_line_failure(run_hilt("hwa", tiny_gguf, tmp_path / "e.gguf", "--teacher", "minilm"),
                      "--teacher minilm: an encoder", "a causal LM", absent=[tmp_path / "e.gguf"])


def test_clip_std_clips_the_tuned_weights(tiny_gguf, tmp_path):
    r = hwa.tune(str(tiny_gguf), tmp_path / "clipped.gguf", **{**SMALL, "steps": 1, "overrides": {"clip_std": 1.5}})
    assert 0 < r["clipped_share"] < 0.5  # uniform init: |w| reaches sqrt(3) std
    tuned, _ = llama.load_llama(tmp_path / "clipped.gguf")
    base, _ = llama.load_llama(tiny_gguf)
    w, w0 = tuned.blk[1].ffn_down.weight, base.blk[1].ffn_down.weight
    # one step of AdamW at lr 2e-5 moves a weight by about 2e-5; the clip moved the outliers further
    assert bool((w.abs().amax(1) < w0.abs().amax(1) - 1e-3).all())
    assert torch.allclose(w.abs().amax(1), 1.5 * w0.std(1, correction=0), rtol=0.02)


def test_dwp_tunes_minilm_into_a_folder_hilt_reads(minilm_dir, tmp_path):
    from hilt.models import bert

    r = hwa.tune("minilm", tmp_path / "mini", method="dwp", steps=1, batch=2, progress=False)
    assert len(r["losses"]) == 1 and math.isfinite(r["losses"][0]) and r["training"]["copies"] == 2
    tuned, _ = bert.load_minilm(tmp_path / "mini")
    base, _ = bert.load_minilm(minilm_dir)
    assert (tmp_path / "mini" / "tokenizer.json").is_file() and (tmp_path / "mini" / "modules.json").is_file()
    assert not torch.equal(tuned.encoder.layer[0].attention["self"].query.weight,
                           base.encoder.layer[0].attention["self"].query.weight)


def test_cli_tunes_and_refuses_to_overwrite(tiny_gguf, tmp_path):
    out = tmp_path / "tuned.gguf"
    r = run_hilt("hwa", tiny_gguf, out, "--steps", "1", "--batch", "1", "--context", "16", "--periphery",
                 "--json", tmp_path / "h.json")
    assert r.returncode == 0, r.stderr
    assert out.is_file() and json.loads((tmp_path / "h.json").read_text())["periphery"] is True
    before = out.read_bytes()
    _one_line_failure(run_hilt("hwa", tiny_gguf, out, "--steps", "1"), "already exists", "--overwrite")
    assert out.read_bytes() == before


def test_drift_and_eval_read_a_tuned_model(tiny_gguf, tmp_path):
    out = tmp_path / "tuned.gguf"
    hwa.tune(str(tiny_gguf), out, **{**SMALL, "steps": 1})
    r = run_hilt("drift", "--model", out, "--preset", "pcm", "--times", "1s", "--chips", "1", "--tokens", "32",
                 "--context", "16")
    assert r.returncode == 0 and "perplexity" in r.stdout, r.stderr
    r = run_hilt("eval", "ppl", out, "--tokens", "32", "--context", "16")
    assert r.returncode == 0 and "perplexity" in r.stdout, r.stderr


def test_bad_input_is_one_line_and_writes_nothing(tiny_gguf, tmp_path):
    from test_hf import tiny_llama

    folder = tiny_llama(tmp_path / "hf")  # no tokenizer: refused before its weights load
    _one_line_failure(run_hilt("hwa", folder, tmp_path / "a"), "no usable tokenizer", absent=[tmp_path / "a"])
    _one_line_failure(run_hilt("hwa", tiny_gguf, tmp_path / "b.gguf", "--set", "tile_size=0"), "--set tile_size=0",
                      "at least 1", absent=[tmp_path / "b.gguf"])
    (tmp_path / "dir.gguf").mkdir()
    _one_line_failure(run_hilt("hwa", tiny_gguf, tmp_path / "dir.gguf", "--overwrite"), "is a folder")
    _one_line_failure(run_hilt("hwa", tiny_gguf, tmp_path / "b.gguf", "--set", "colour=red"), "colour",
                      "not a field of AnalogConfig", absent=[tmp_path / "b.gguf"])
    _one_line_failure(run_hilt("hwa", tiny_gguf, tmp_path / "b.gguf", "--set", "adc_bits=many"), "adc_bits",
                      "expected int or none", absent=[tmp_path / "b.gguf"])


def test_bad_chip_or_times_is_one_line_and_writes_nothing(tiny_gguf, tmp_path):
    _one_line_failure(run_hilt("hwa", tiny_gguf, tmp_path / "c.gguf", "--preset", "ideal"), "pcm or rram",
                      absent=[tmp_path / "c.gguf"])
    for times in ("1y,1d", "1d", "0,1y", "1d,soon"):
        _one_line_failure(run_hilt("hwa", tiny_gguf, tmp_path / "c.gguf", "--times", times), "time",
                          absent=[tmp_path / "c.gguf"])
    _one_line_failure(run_hilt("hwa", tmp_path / "missing.gguf", tmp_path / "d.gguf"), "missing.gguf",
                      absent=[tmp_path / "d.gguf"])
