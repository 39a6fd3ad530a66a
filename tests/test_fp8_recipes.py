"""FP8 scale recipes and the counting E4M3 cast."""

import pytest
import torch

from hilt.fp8.recipes import E4M3_MAX, Current, Delayed, GeometryAware, fp8_cast
from hilt.errors import HiltError


def test_cast_counts_clipping_and_round_trips_in_range_values():
    x = torch.tensor([0.5, -3.0, 100.0, 500.0, -1000.0])
    y, overflow = fp8_cast(x, 1.0)
    assert overflow == 2 and y[3] == E4M3_MAX and y[4] == -E4M3_MAX
    torch.testing.assert_close(y[:3], x[:3], rtol=2**-3, atol=0)  # E4M3 keeps 3 mantissa bits
    assert not torch.isnan(y).any()
    # 460 rounds to 448 anyway (the next E4M3 step would be 480): the clip changed nothing
    assert fp8_cast(torch.tensor([460.0]), 1.0)[1] == 0 and fp8_cast(torch.tensor([470.0]), 1.0)[1] == 1
    with pytest.raises(HiltError, match="NaN"):
        fp8_cast(torch.tensor([float("nan")]), 1.0)


def test_delayed_scaling_overflows_after_a_jump_and_after_a_reset():
    recipe = Delayed(history=16)
    small = torch.randn(1000)
    for _ in range(5):
        _, overflow = fp8_cast(small, recipe.scale_for(small))
        recipe.observe(float(small.abs().max()))
    big = small * 20  # a learning-rate spike, a new batch with outliers
    _, overflow = fp8_cast(big, recipe.scale_for(big))
    assert overflow > 0  # it only knows the past
    recipe.reset()  # a resume with an empty history: scale 1
    assert recipe.scale_for(big) == 1.0
    _, overflow = fp8_cast(big * 30, recipe.scale_for(big))
    assert overflow > 0


def test_geometry_and_current_never_overflow_and_zero_is_finite():
    x = torch.randn(4096) * 50
    bound = float(x.abs().max()) * 1.01  # any valid bound on |x|
    for recipe in (GeometryAware(bound), Current()):
        assert fp8_cast(x, recipe.scale_for(x))[1] == 0
    assert GeometryAware(0.0).scale_for(x) == 1.0  # a zero-norm head
    zero = torch.zeros(8)
    s = Current().scale_for(zero)
    y, overflow = fp8_cast(zero, s)
    assert s < float("inf") and overflow == 0 and torch.equal(y, zero)
    with pytest.raises(HiltError, match="finite bound"):
        GeometryAware(float("inf"))
