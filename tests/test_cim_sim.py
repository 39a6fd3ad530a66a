"""CIM simulator: device statistics against the published formulas, life cycle, reproducibility."""

import math

import pytest
import torch
from torch import nn

from hilt.cim_sim import (
    PCM,
    convert_to_analog,
    devices,
    drift_to,
    mismatch,
    parse_time,
    preset,
    program,
    stuck_at,
)
from hilt.cim_sim.devices import gaussian_
from hilt.errors import HiltError


def _pcm_stats(g_target, t, n=200_000, seed=0):
    dev, gen = PCM(), torch.Generator().manual_seed(seed)
    g = torch.full((n,), g_target, dtype=torch.float64)
    prog = dev.program(g, gen)
    nu = dev.drift_exponent(g, gen)
    return prog, nu, dev.read(prog, nu, t, gen)


def test_programming_noise_follows_the_formula():
    prog, _, _ = _pcm_stats(10.0, 0.0)
    x = 10.0 / 25.0
    sigma = 0.26348 + 1.9650 * x - 1.1731 * x * x  # g_max = 25 µS
    assert float(prog.mean()) == pytest.approx(10.0, abs=4 * sigma / math.sqrt(len(prog)) + 1e-3)
    assert float(prog.std()) == pytest.approx(sigma, rel=0.01)


def test_drift_exponent_statistics():
    _, nu, _ = _pcm_stats(10.0, 0.0)
    x = 10.0 / 25.0
    mu = min(max(-0.0155 * math.log(x) + 0.0244, 0.049), 0.1)
    sd = min(max(-0.0125 * math.log(x) - 0.0059, 0.008), 0.045)
    assert float(nu.mean()) == pytest.approx(mu, rel=0.01)  # mu >> sd: the |.| barely folds
    assert float(nu.std()) == pytest.approx(sd, rel=0.02)


@pytest.mark.parametrize("t", [3600.0, 31_557_600.0])
def test_conductance_after_drift_matches_the_model(t):
    prog, nu, g = _pcm_stats(20.0, t)
    T = t + 20.0
    expected_mean = float((prog * (T / 20.0) ** (-nu)).mean())  # read noise is zero-mean
    assert float(g.mean()) == pytest.approx(expected_mean, rel=0.005)
    drifted = prog * (T / 20.0) ** (-nu)
    q = (0.0088 / (prog / 25.0).pow(0.65).clamp_min(1e-3)).clamp_max(0.2)
    sigma_r = q * math.sqrt(math.log((T + 250e-9) / (2 * 250e-9)))
    z = (g - drifted) / (drifted * sigma_r)
    assert float(z.mean()) == pytest.approx(0.0, abs=0.01) and float(z.std()) == pytest.approx(1.0, rel=0.01)
    assert float(g.mean()) < 20.0 * 0.9  # a year (or an hour) of drift lowers conductance


@pytest.mark.parametrize(("n", "dtype"), [(1_000_003, torch.float32), (7, torch.float32), (40_001, torch.float64)])
def test_per_read_gaussian_draws(n, dtype):
    """The quantile-lookup N(0, 1) of per-read noise: moments of a normal, every element
    written (odd sizes too), the same seed gives the same draws, another seed others."""
    z = gaussian_(torch.full((n,), float("nan"), dtype=dtype), torch.Generator().manual_seed(3))
    assert z.dtype == dtype and torch.isfinite(z).all()
    again = gaussian_(torch.empty(n, dtype=dtype), torch.Generator().manual_seed(3))
    assert torch.equal(z, again)
    assert not torch.equal(z, gaussian_(torch.empty(n, dtype=dtype), torch.Generator().manual_seed(4)))
    if n > 10_000:
        tol = 5 / math.sqrt(n)
        z = z.double()
        assert abs(float(z.mean())) < tol and abs(float(z.var()) - 1) < 2 * tol
        assert abs(float((z**4).mean()) - 3) < 20 * tol  # normal kurtosis: not a uniform or two-point draw
        assert float(z.abs().max()) < 4.33  # the table's tails


def _lowbias32(x: int) -> int:
    """The read-noise hash in plain Python integers: the reference the tensor versions must match."""
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & m
    x ^= x >> 15
    x = (x * 0xD35A2D97) & m
    return x ^ (x >> 15)


def test_hashed_read_noise_is_the_documented_generator():
    """Draw i of a read is table[top 16 bits of h(h(i ^ k0) ^ k1)], compiled or not; its draws have
    the moments of N(0, 1); two reads (other keys) and neighbouring devices are uncorrelated."""
    keys = torch.tensor([-123_456_789, 987_654_321], dtype=torch.int32)
    n = 1_000_003
    z = devices.hashed_normal(n, keys)
    k0, k1 = (int(k) & 0xFFFFFFFF for k in keys)
    for i in (0, 1, 2, 77_777, n - 1):
        expected = devices._QUANTILES[_lowbias32(_lowbias32(i ^ k0) ^ k1) >> 16].float()
        assert float(z[i]) == float(expected)
    assert torch.equal(devices.compiled(devices.hashed_normal)(n, keys), z)
    tol = 5 / math.sqrt(n)
    z = z.double()
    assert abs(float(z.mean())) < tol and abs(float(z.var()) - 1) < 2 * tol
    assert abs(float((z**4).mean()) - 3) < 20 * tol
    other = devices.hashed_normal(n, keys + 1).double()
    assert abs(float(torch.corrcoef(torch.stack([z, other]))[0, 1])) < tol
    assert abs(float(torch.corrcoef(torch.stack([z[:-1], z[1:]]))[0, 1])) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_reads_equal_their_reference(dtype, monkeypatch):
    """The compiled read (one pass) computes what its torch reference does, with the same draws; a layer's
    pairs read (read_pairs, the drift exponents drawn again from their normal draws) is that read of each
    of its devices at its place in a chip's stream of draws, G+ - G-, averaged over the devices per side;
    a failed compile warns once and runs the reference."""
    dev, gen = PCM(), torch.Generator().manual_seed(5)
    n, out, inp = 3, 37, 53
    m, offset, size = n * out * inp, 1000, n * out * inp + 2017
    w = torch.randn(out, inp, generator=gen, dtype=dtype)
    scale = dev.g_max / w.abs().amax(1, keepdim=True)  # column mapping
    target = torch.stack([w * scale, -w * scale]).clamp(0, dev.g_max).unsqueeze(1).expand(2, n, out, inp).contiguous()
    g = dev.program(target, gen)
    z = torch.randn(target.shape, generator=gen, dtype=dtype)
    # the layer's devices at ``offset`` of a chip's pool of ``size`` devices per side
    pool_g = torch.rand(2, size, generator=gen, dtype=dtype) * dev.g_max
    pool_nu = dev.drift_exponent(pool_g, gen)
    pool_g[:, offset : offset + m], pool_nu[:, offset : offset + m] = g.view(2, m), dev.drift_exponent_of(target, z).view(2, m)
    state = torch.Generator().manual_seed(9).get_state()
    read = dev.read(pool_g, pool_nu, 86400.0, torch.Generator().set_state(state))
    keys = dev.read_keys(torch.Generator().set_state(state))
    args = (pool_g, pool_nu, dev.read_noise_coefficient(pool_g), *dev._time_args(86400.0, dtype), keys)
    reference = devices._drifted_read(*args)
    assert read.dtype == dtype and torch.isfinite(read).all() and (read >= 0).all()
    torch.testing.assert_close(read, reference, rtol=1e-6, atol=1e-6)
    start = torch.tensor([offset, size + offset], dtype=torch.int32)
    pairs = dev.read_pairs(g / scale, z, w, scale, 86400.0, keys, start)
    layer = read[:, offset : offset + m].view(2, n, out, inp) / scale
    assert pairs.shape == (out, inp) and pairs.dtype == dtype
    torch.testing.assert_close(pairs, (layer[0] - layer[1]).mean(0), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(pairs, layer[0, 0] - layer[1, 0], rtol=1e-3, atol=1e-3)  # the devices are averaged

    def no_compiler(fn, **kwargs):
        def fail(*args):
            raise RuntimeError("no C++ compiler")
        return fail

    monkeypatch.setattr(torch, "compile", no_compiler)
    fallback = devices.compiled(devices._drifted_read)
    with pytest.warns(UserWarning, match="uncompiled"):
        again = fallback(*args)
    assert torch.equal(again, reference)


def test_same_seed_same_numbers():
    a, b = _pcm_stats(5.0, 86400.0, n=1000, seed=3), _pcm_stats(5.0, 86400.0, n=1000, seed=3)
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    assert not torch.equal(a[2], _pcm_stats(5.0, 86400.0, n=1000, seed=4)[2])


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 10))


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 10))


@pytest.mark.parametrize("build,shape", [(mlp, (32, 64)), (cnn, (8, 1, 8, 8))])
def test_ideal_reproduces_the_digital_model_exactly(build, shape):
    model = build()
    x = torch.randn(*shape)
    analog = convert_to_analog(model, preset("ideal"))
    drift_to(analog, parse_time("1y"))
    assert torch.equal(analog(x), model(x))


@pytest.mark.parametrize("build,shape", [(mlp, (256, 64)), (cnn, (64, 1, 8, 8))])
def test_drift_lowers_output_and_compensation_restores_it(build, shape):
    model = build()
    x = torch.randn(*shape)
    ref = model(x).detach()
    # weights scaled onto the arrays: with raw weights (pcm) the output noise of these small
    # random layers is as large as their outputs
    analog = convert_to_analog(model, preset("pcm-scaled"))
    program(analog, seed=5)
    drift_to(analog, 1.0, gdc="none")
    fresh = analog(x).detach()
    assert float((fresh - ref).norm() / ref.norm()) < 0.35
    drift_to(analog, parse_time("1y"), gdc="none")
    drifted = analog(x).detach()
    assert float(drifted.norm() / ref.norm()) < 0.8
    for gdc in ("global", "column", "exact"):
        drift_to(analog, parse_time("1y"), gdc=gdc)
        assert float(analog(x).detach().norm() / ref.norm()) == pytest.approx(1.0, abs=0.2), gdc


@pytest.mark.parametrize("device", ["pcm", "rram"])
def test_each_layer_reads_its_own_devices(device):
    """A chip's devices are read in one pooled pass: with programming noise, drift and read noise
    off, every layer (conv, linear, and in the model's order) holds exactly its own weights, and
    with them on, each layer's read error is the size its own devices give (no layer swapped)."""
    import dataclasses

    model = cnn()
    quiet = dataclasses.replace(preset(device), prog_noise_scale=0.0, read_noise_scale=0.0, drift_scale=0.0)
    analog = convert_to_analog(model, quiet)
    drift_to(analog, parse_time("1y"))
    layers = [m for m in analog.modules() if hasattr(m, "w_eff")]
    assert len(layers) == 2 and len(analog.device_pools) == 1
    for layer in layers:
        torch.testing.assert_close(layer.w_eff, layer.w_digital, rtol=1e-6, atol=1e-7)
    noisy = convert_to_analog(model, preset(device))
    drift_to(noisy, 1.0, gdc="none")
    for layer in (m for m in noisy.modules() if hasattr(m, "w_eff")):
        assert layer.w_eff.shape == layer.w_digital.shape
        error = float((layer.w_eff - layer.w_digital).norm() / layer.w_digital.norm())
        assert 0.005 < error < 0.5


def test_analog_forward_is_reproducible_by_seed():
    model, x = mlp(), torch.randn(16, 64)
    outs = []
    for _ in range(2):
        analog = convert_to_analog(model, preset("pcm-hwa"))
        program(analog, seed=11)
        drift_to(analog, 3600.0, seed=2)
        outs.append(analog(x))
    assert torch.equal(outs[0], outs[1])


def test_held_weights_are_two_int8_codes_within_a_64516th_of_the_row():
    """What an array holds: a coarse and a fine int8 code per weight, within 1/64,516 of its row's
    abs-max, on an awkward shape, a zero row and rows eight decades apart."""
    from hilt.cim_sim.analog import HeldArray

    w = torch.randn(3, 13, 37, generator=torch.Generator().manual_seed(0)) * torch.logspace(-6, 2, 13).view(1, 13, 1)
    w[1, 4] = 0
    array = HeldArray.of(w, 0, 37)
    assert array.codes.dtype == torch.int8 and array.codes.shape == (3, 26, 37)
    assert int(array.codes.abs().max()) <= 127 and torch.isfinite(array.w).all()
    row_max = w.abs().amax(-1, keepdim=True)
    assert ((array.w - w).abs() <= row_max * (1 / 64_516 + 1e-6)).all()
    assert not array.w[1, 4].any() and torch.equal(array.w_abs, array.w.abs())
    rebuilt = (array.codes[:, :13].double() + array.codes[:, 13:].double() / 254) * array.scale.double().unsqueeze(-1)
    torch.testing.assert_close(array.w.double(), rebuilt, rtol=1e-6, atol=0)  # the floats are the codes


@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 37, 5), (17, 1024, 9), (29, 1025, 40), (8, 3000, 33)])
def test_int8_product_is_torchs_whichever_way_it_runs(shape):
    """Both ways of the arrays' int8 product give torch._int_mm's int32 exactly, on awkward shapes and
    on codes at +-127, whose sums over 3,000 terms float32 would round if it summed them in one go."""
    from hilt.cim_sim.analog import _int8_product_by_floats, int8_product

    m, k, n = shape
    g = torch.Generator().manual_seed(k)
    for a, b in [(torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g),
                  torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g).T),
                 (torch.full((m, k), 127, dtype=torch.int8),
                  torch.where(torch.rand(k, n, generator=g) < 0.97, 127, -127).to(torch.int8))]:
        want = torch._int_mm(a, b) if m > 16 and k % 8 == 0 and n % 8 == 0 else a.int() @ b.int()
        assert torch.equal(int8_product(a, b), want) and torch.equal(_int8_product_by_floats(a, b), want)
        out = torch.empty(m, n, dtype=torch.int32)
        assert _int8_product_by_floats(a, b, out=out) is out and torch.equal(out, want)
    if k > 2048:  # the +-127 codes: one float32 sum of all k terms would not be exact
        assert not torch.equal((a.float() @ b.float()).to(torch.int32), want)


@pytest.mark.parametrize("dac_bits", [7, 8])
def test_integer_product_computes_what_the_float_product_does(dac_bits, monkeypatch):
    """The arrays' int8 x int8 -> int32 product against a float32 product of the same held weights:
    three arrays of an awkward layer, output noise, bound management retrying saturated rows, the
    same draws. The ADC codes agree but where float rounding moves a value across a rounding tie."""
    import dataclasses

    from hilt.cim_sim.analog import AnalogMixin

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(37, 13))
    with torch.no_grad():
        model[0].weight.add_(2.0)  # positive weights on positive inputs: the ADC saturates on many rows
    config = dataclasses.replace(preset("pcm"), tile_size=16, dac_bits=dac_bits)
    x = 0.8 + 0.2 * torch.rand(29, 37)
    from hilt.cim_sim import analog as analog_module

    real_product, calls = analog_module.int8_product, []
    monkeypatch.setattr(analog_module, "int8_product", lambda *a, **kw: calls.append(1) or real_product(*a, **kw))
    outs = []
    for integer in (True, False):
        monkeypatch.setattr(AnalogMixin, "integer_product", property(lambda self, v=integer: v))
        analog = convert_to_analog(model, config)
        program(analog, seed=1)
        drift_to(analog, 3600.0, seed=2)
        calls.clear()
        with torch.no_grad():
            outs.append(analog(x))
        assert len(calls) > 3 if integer else not calls  # three arrays, then the retries of saturated rows
    assert torch.isfinite(outs[0]).all()
    step = analog[0].converter_steps()[1] * float(x.abs().max())  # one ADC step, in output units, at the largest input scale
    assert float((outs[0] - outs[1]).abs().max()) <= step
    assert int((outs[0] != outs[1]).sum()) <= 2


def test_a_bare_layer_converts_to_its_analog_counterpart():
    from hilt.cim_sim import evaluate
    from hilt.cim_sim.analog import AnalogConv1d, AnalogLinear

    layer = convert_to_analog(nn.Linear(8, 3), preset("pcm"))
    assert isinstance(layer, AnalogLinear) and isinstance(convert_to_analog(nn.Conv1d(2, 3, 3), preset("pcm")), AnalogConv1d)
    program(layer, seeds=[1, 2])
    drift_to(layer, 60.0, seeds=[3, 4])
    assert layer(torch.randn(5, 8)).shape == (10, 3)
    assert evaluate(layer, (torch.randn(6, 8), torch.zeros(6, dtype=torch.long))).shape == (2,)


def test_mismatch_and_stuck_at():
    g = torch.Generator().manual_seed(0)
    w = torch.ones(100_000)
    noisy = mismatch(w, 0.3, g)
    assert float(noisy.mean()) == pytest.approx(1.0, abs=0.01) and float(noisy.std()) == pytest.approx(0.3, rel=0.02)
    stuck = stuck_at(torch.full((100_000,), 10.0), 0.1, 25.0, g)
    assert float((stuck == 0).float().mean()) == pytest.approx(0.05, abs=0.005)
    assert float((stuck == 25.0).float().mean()) == pytest.approx(0.05, abs=0.005)


def test_bad_input_is_named():
    with pytest.raises(HiltError, match="unknown preset 'pcmx'"):
        preset("pcmx")
    for bad in ("-1s", "soon", "1 fortnight"):
        with pytest.raises(HiltError, match="cannot read time"):
            parse_time(bad)
    assert parse_time("1mo") == 2629800 and parse_time("90") == 90 and parse_time("2H") == 7200
    with pytest.raises(HiltError, match="M is ambiguous; write 1mo for a month, 1min for a minute"):
        parse_time("1M")
    with pytest.raises(HiltError, match="no Linear, Conv1d or Conv2d"):
        convert_to_analog(nn.Sequential(nn.ReLU()), preset("pcm"))
    model = mlp()
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    with pytest.raises(HiltError, match="NaN or Inf"):
        convert_to_analog(model, preset("pcm"))
    with pytest.raises(HiltError, match="drift compensation"):
        drift_to(convert_to_analog(mlp(), preset("pcm")), 1.0, gdc="magic")


def test_conv_patches_match_unfold():
    from hilt.cim_sim.analog import AnalogConv2d

    for kw in (dict(kernel_size=3, padding=1), dict(kernel_size=(5, 3), stride=2, padding=(2, 1), dilation=(1, 2))):
        conv = nn.Conv2d(3, 4, **kw)
        layer = AnalogConv2d(conv, preset("pcm"))
        x = torch.randn(2, 3, 11, 9)
        cols, (oh, ow) = layer._patches(x)
        ref = torch.nn.functional.unfold(x, conv.kernel_size, conv.dilation, conv.padding, conv.stride)
        assert (oh, ow) == conv(x).shape[2:]
        assert torch.equal(cols, ref.transpose(1, 2).reshape(-1, ref.shape[1]))


def test_conv1d_patches_match_unfold():
    from hilt.cim_sim.analog import AnalogConv1d

    for kw in (dict(kernel_size=3, padding=1), dict(kernel_size=5, stride=2, padding=2, dilation=2)):
        conv = nn.Conv1d(3, 4, **kw)
        x = torch.randn(2, 3, 17)
        cols, (length,) = AnalogConv1d(conv, preset("pcm"))._patches(x)
        # the 1-D unfold is the 2-D one on a height-1 image
        ref = torch.nn.functional.unfold(x[:, :, None], (1, conv.kernel_size[0]), (1, conv.dilation[0]),
                                         (0, conv.padding[0]), (1, conv.stride[0]))
        assert length == conv(x).shape[2]
        assert torch.equal(cols, ref.transpose(1, 2).reshape(-1, ref.shape[1]))
