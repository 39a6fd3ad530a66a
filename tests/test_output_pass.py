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
            got = kernel.output_pass(part, scale, keys, noise_scale, levels, noise, adc, isa=path)
            where = f"chips {chips}, rows {rows}, n {n}, integer {integer}, noise {noise}, adc {adc}"
            assert same(expected[0], got[0]) and same(expected[1], got[1]), where
            # rows of every chip side by side (a shared input's one wide product), read in place
            wide = part.transpose(0, 1).contiguous().transpose(0, 1)
            got = kernel.output_pass(wide, scale, keys, noise_scale, levels, noise, adc, isa=path)
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
    out, peak = kernel.output_pass(part, None, keys, torch.tensor(1.0), torch.tensor(2.0), True, True, isa=path)
    assert same(expected[0], out) and same(expected[1], peak)
    assert peak.isnan().tolist() == [[False, True, False], [False, False, True]]


def test_the_forward_runs_the_kernel_or_the_compiled_pass_alike(monkeypatch):
    """An analog forward gives the same outputs with the kernel and, where it cannot be built,
    with torch.compile's pass."""
    from torch import nn

    from hilt.cim_sim import analog, convert_to_analog, drift_to, preset, program

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 24), nn.ReLU(), nn.Linear(24, 5))
    x = torch.rand(9, 40)
    outs = []
    for available in (True, False):
        if not available:
            monkeypatch.setattr(analog, "output_pass", lambda *args: None)
        chip = convert_to_analog(model, preset("pcm"))
        program(chip, seeds=[1, 2])
        drift_to(chip, 3600.0, seeds=[3, 4])
        with torch.no_grad():
            outs.append(chip(x))
    assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1])


def test_built_once_into_the_cache_or_not_at_all(tmp_path, monkeypatch):
    """The kernel builds into the user's cache; without a working compiler there is no kernel (the
    forward then runs the compiled PyTorch pass) and no error."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernel.library.__wrapped__() is not None
    assert len(list((tmp_path / "hilt").glob("output_pass-*.so"))) == 1
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert kernel.library.__wrapped__() is None
    assert len(list((tmp_path / "hilt").iterdir())) == 1  # nothing half-built left behind
