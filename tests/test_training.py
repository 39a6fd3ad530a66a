"""Noise injection and DWP training (cim_sim.training), and the robustness study."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hilt.cim_sim.training import (
    NoisyTraining,
    analog_weights,
    disagreement,
    mismatch_copy,
    noisy_loss,
    perturb,
    sample_weights,
)
from hilt.errors import HiltError


def test_mismatch_perturbation_statistics_and_gradient():
    w = torch.full((400, 500), 0.5, requires_grad=True)
    noisy = perturb(w, 0.3, "mismatch", torch.Generator().manual_seed(0))
    values = noisy.detach()
    assert float(values.mean()) == pytest.approx(0.5, abs=0.002)
    assert float(values.std()) == pytest.approx(0.15, rel=0.01)
    noisy.sum().backward()
    assert torch.allclose(w.grad, noisy.detach() / 0.5)  # d/dw of w (1 + eta eps) is (1 + eta eps)


@pytest.mark.parametrize("device", ["pcm", "rram"])
def test_device_perturbation_is_straight_through(device):
    torch.manual_seed(0)
    w = (torch.randn(64, 80) * 0.1).requires_grad_()
    noisy = perturb(w, 1.0, device, torch.Generator().manual_seed(1))
    assert torch.isfinite(noisy).all() and not torch.equal(noisy, w)
    rel = float((noisy - w).norm() / w.norm())
    assert 0.005 < rel < 1.0  # a noisy copy, compensated back to the right scale
    (noisy * 3).sum().backward()
    assert torch.equal(w.grad, torch.full_like(w, 3.0))


def test_disagreement_measures():
    same = torch.randn(1, 5, 10).expand(4, 5, 10)
    labels = torch.arange(5)
    assert torch.allclose(disagreement(same, labels, "js"), torch.zeros(5), atol=1e-6)
    logits = torch.zeros(2, 3, 2)
    logits[0, :, 0] = 10  # copy 0 says class 0 with confidence
    logits[1, 0, 0] = 10  # copy 1 agrees on sample 0 only
    logits[1, 1:, 1] = 10
    js = disagreement(logits, torch.zeros(3, dtype=torch.long), "js")
    assert float(js[0]) == pytest.approx(0, abs=1e-4) and float(js[1]) == pytest.approx(math.log(2), rel=1e-3)
    assert disagreement(logits, torch.zeros(3, dtype=torch.long), "error").tolist() == [0.0, 0.5, 0.5]
    assert disagreement(logits, torch.zeros(3, dtype=torch.long), "none").tolist() == [1.0, 1.0, 1.0]


def test_sample_weights_normalised_and_clipped():
    d = torch.tensor([0.0, 0.0, 0.01, 1.0, 100.0])
    a = sample_weights(d, 0.25, 4.0)
    assert float(a.mean()) == pytest.approx(1.0)
    assert float(a.max() / a.min()) == pytest.approx(16.0)  # clipped at both ends before renormalising
    assert torch.equal(sample_weights(torch.zeros(4), 0.25, 4.0), torch.ones(4))


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


def test_analog_weights_are_linear_and_conv_weights():
    assert analog_weights(_net()) == ["0.weight", "3.weight"]


def test_dwp_loss_weights_samples_and_reaches_clean_weights():
    net, x, y = _net(), torch.randn(16, 1, 8, 8), torch.randint(0, 5, (16,))
    cfg = NoisyTraining(method="dwp", copies=3, eta_min=0.1, eta_max=0.5).validate()
    assert cfg.levels() == pytest.approx([0.1, 0.3, 0.5])
    loss, logits = noisy_loss(net, x, y, cfg, torch.Generator().manual_seed(0))
    loss.backward()
    assert logits.shape == (16, 5) and torch.isfinite(loss)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters())
    # same seed, same loss; no noise: DWP with eta 0 is standard cross-entropy
    again, _ = noisy_loss(net, x, y, cfg, torch.Generator().manual_seed(0))
    assert float(again) == float(loss)
    clean = NoisyTraining(method="dwp", copies=2, eta_min=0.0, eta_max=0.0, weighting="none")
    zero, _ = noisy_loss(net, x, y, clean, torch.Generator().manual_seed(0))
    assert float(zero) == pytest.approx(float(F.cross_entropy(net(x), y)), rel=1e-6)


def test_mismatch_copy_leaves_the_model_alone():
    net = _net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    noisy = mismatch_copy(net, 0.5, torch.Generator().manual_seed(0))
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert not torch.equal(noisy[0].weight, net[0].weight) and torch.equal(noisy[0].bias, net[0].bias)


@pytest.mark.parametrize("change, needle", [
    ({"method": "magic"}, "training method"), ({"noise_model": "flash"}, "noise model"),
    ({"weighting": "vote"}, "weighting"), ({"copies": 1}, "at least 2"),
    ({"eta_min": 0.5, "eta_max": 0.1}, "eta_min <= eta_max"), ({"clip_min": 2.0}, "clip"),
])
def test_bad_training_settings(change, needle):
    with pytest.raises(HiltError, match=needle):
        dataclasses.replace(NoisyTraining(), **change).validate()


def test_robustness_study_tiny(monkeypatch):
    import logging

    from hilt.bench.studies import robustness
    from hilt.data.fashion_mnist import DEFAULT_ROOT
    from hilt.progress import LOG

    if not (DEFAULT_ROOT / "t10k-images-idx3-ubyte.gz").is_file():
        pytest.skip("Fashion-MNIST not installed: apt-get install -y dataset-fashion-mnist (scripts/setup.sh)")

    plan = dict(limit=600, epochs=1, draws=2, test_images=200, chips=1, times="1s,1y",
                ablation_limit=300, ablation_epochs=1, ablation_draws=2)
    lines = []  # the hilt logger's lines, read by a handler of its own: whatever earlier tests configured
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    monkeypatch.setattr(LOG, "level", logging.INFO)
    LOG.addHandler(handler)
    try:
        result = robustness.study(quick=True, plan=plan, ablation=("dwp (default)", "weighting none"))
    finally:
        LOG.removeHandler(handler)
    # its own line per method on the hilt logger; the drift task's table it runs inside is held back
    assert sum(" mismatch " in m for m in lines) == 3 and not any("programmed chips" in m for m in lines)
    assert list(result["methods"]) == ["standard", "noise", "dwp"]
    for r in result["methods"].values():
        assert [row["eta"] for row in r["mismatch"]] == list(robustness.ETAS)
        assert all(0 <= row["worst"] <= row["mean"] <= 1 for row in r["mismatch"])
        assert [row["time"] for row in r["drift"]] == ["1s", "1y"]
    assert list(result["ablation"]) == ["dwp (default)", "weighting none"]
    table = robustness.render(result)
    assert "| dwp |" in table and "weighting none" in table
