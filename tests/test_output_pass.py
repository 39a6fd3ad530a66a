"""The analog output pass's C kernel (cim_sim/output_pass.c) against its PyTorch reference
(analog._output_stage_eager): bit for bit, on every vector path this CPU runs, awkward shapes, NaN."""

import itertools

import pytest
import torch

from hilt.cim_sim import output_pass as kernel
from hilt.cim_sim.analog import _output_stage_eager

pytestmark = pytest.mark.skipif(kernel.library() is None, reason="no C compiler builds the kernel here")
PATHS = {0: "one column at a time", 1: "AVX2", 2: "AVX-512"}


def inputs(chips, rows, n, integer, gen):
    if integer:  # product planes as the int8 products give them, and per-column scales
        part = torch.randint(-30_000, 30_000, (chips, rows, 2 * n), dtype=torch.int32, generator=gen)
        scale = torch.rand(chips, 1, n, generator=gen) * 2e-3
    else:
        part, scale = torch.randn(chips, rows, n, generator=gen) * 40, None
    keys = torch.randint(-(2**31), 2**31, (chips, 2), dtype=torch.int32, generator=gen)
    return part, scale, keys


def same(a, b) -> bool:
    return (a is None and b is None) or torch.equal(a.nan_to_num(7.5), b.nan_to_num(7.5))


@pytest.mark.parametrize("path", range(kernel.isa() + 1), ids=lambda p: PATHS[p])
def test_kernel_equals_the_reference(path):
    gen = torch.Generator().manual_seed(path)
    levels, noise_scale = torch.tensor(25.0), torch.tensor(1.3)
    for chips, rows, n in itertools.product((1, 3), (1, 5), (1, 7, 8, 15, 16, 17, 33, 256)):
        for integer, noise, adc in itertools.product((True, False), repeat=3):
            if not (noise or adc):
                continue  # the forward skips the pass then
            part, scale, keys = inputs(chips, rows, n, integer, gen)
            expected = _output_stage_eager(part, scale, keys, noise_scale, levels, noise, adc)
            got = kernel.output_pass(part, scale, keys, noise_scale, levels, noise, adc, path=path)
            where = f"chips {chips}, rows {rows}, n {n}, integer {integer}, noise {noise}, adc {adc}"
            assert same(expected[0], got[0]) and same(expected[1], got[1]), where
            # rows of every chip side by side (a shared input's one wide product), read in place
            wide = part.transpose(0, 1).contiguous().transpose(0, 1)
            got = kernel.output_pass(wide, scale, keys, noise_scale, levels, noise, adc, path=path)
            assert same(expected[0], got[0]) and same(expected[1], got[1]), where + ", chips side by side"
            if adc:  # clipped and rounded to whole ADC steps
                assert float(got[0].abs().max()) <= 25 and torch.equal(got[0], got[0].round())


@pytest.mark.parametrize("path", range(kernel.isa() + 1), ids=lambda p: PATHS[p])
def test_nan_is_kept(path):
    """A NaN product stays NaN in the output and in its row's peak, in a vector and in the tail."""
    part = torch.randn(2, 3, 37)
    part[1, 2, 35] = part[0, 1, 3] = float("nan")
    keys = torch.zeros(2, 2, dtype=torch.int32)
    expected = _output_stage_eager(part, None, keys, torch.tensor(1.0), torch.tensor(2.0), True, True)
    out, peak = kernel.output_pass(part, None, keys, torch.tensor(1.0), torch.tensor(2.0), True, True, path=path)
    assert same(expected[0], out) and same(expected[1], peak)
    assert peak.isnan().tolist() == [[False, True, False], [False, False, True]]


@pytest.mark.parametrize("path", range(kernel.isa() + 1), ids=lambda p: PATHS[p])
def test_ties_round_to_even_and_the_ends_clip(path):
    """Values on an ADC rounding tie, in the vector lanes and in the tail, round as torch.round does."""
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 24.5, -24.5, 3.5, float("inf"), float("-inf"), 0.0, -0.0, 30.0])
    part = torch.cat([ties, ties, ties]).view(1, 3, 13)  # 13 columns: one AVX2 vector and a tail
    keys = torch.zeros(1, 2, dtype=torch.int32)
    expected = _output_stage_eager(part, None, keys, torch.tensor(0.0), torch.tensor(25.0), False, True)
    got = kernel.output_pass(part, None, keys, torch.tensor(0.0), torch.tensor(25.0), False, True, path=path)
    assert same(expected[0], got[0]) and same(expected[1], got[1])
    assert got[0][0, 0, :8].tolist() == [0.0, 2.0, 2.0, -0.0, -2.0, 24.0, -24.0, 4.0]


@pytest.mark.parametrize("config", ["pcm", "no converters"])
def test_the_forward_runs_the_kernel_or_the_compiled_pass_alike(config, monkeypatch):
    """A conv net holding three chips gives the same outputs with the kernel and, where it cannot be
    built, with torch.compile's pass (the first layer's planes are read side by side there too)."""
    import dataclasses

    from torch import nn

    from hilt.cim_sim import analog, convert_to_analog, drift_to, preset, program

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 5))
    settings = preset("pcm") if config == "pcm" else dataclasses.replace(preset("pcm"), out_noise=0.0, adc_bits=None)
    x = torch.rand(3, 2, 6, 6)
    outs = []
    for available in (True, False):
        if not available:
            monkeypatch.setattr(analog, "output_pass", lambda *args, **kwargs: None)
        chip = convert_to_analog(model, settings)
        program(chip, seeds=[1, 2, 5])
        drift_to(chip, 3600.0, seeds=[3, 4, 6])
        with torch.no_grad():
            outs.append(chip(x))
    assert outs[0].shape == (9, 5) and torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1])


def test_without_a_vector_path_the_compiled_pass_runs(monkeypatch):
    """On a CPU without AVX2 the kernel steps aside: one column at a time it is slower than the
    compiled pass (which vectorizes for any CPU)."""
    part, scale, keys = inputs(2, 3, 16, True, torch.Generator().manual_seed(0))
    args = (part, scale, keys, torch.tensor(1.0), torch.tensor(25.0), True, True)
    assert kernel.output_pass(*args) is not None
    monkeypatch.setattr(kernel, "isa", lambda: 0)
    assert kernel.output_pass(*args) is None
    assert kernel.output_pass(*args, path=0) is not None


def test_built_once_into_the_cache_or_not_at_all(tmp_path, monkeypatch):
    """The kernel builds into the user's cache; without a working compiler there is no kernel (the
    forward then runs the compiled PyTorch pass) and no error."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a"))
    assert kernel.library.__wrapped__() is not None
    built = list((tmp_path / "a" / "hilt").glob("output_pass-*.so"))
    assert len(built) == 1
    damaged = tmp_path / "b" / "hilt" / built[0].name  # another cache holding a damaged copy: built afresh
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    assert kernel.library.__wrapped__() is not None and damaged.stat().st_size > 0
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert kernel.library.__wrapped__() is None
    assert list((tmp_path / "b" / "hilt").iterdir()) == [damaged]  # nothing half-built left behind
