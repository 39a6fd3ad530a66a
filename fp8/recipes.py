"""FP8 scale recipes behind one small interface, and the E4M3 cast that counts what it clips.

Every recipe answers ``scale_for(x)`` (the factor that maps x into E4M3's +-448 for the
coming cast) and is told ``observe(amax)`` after it; ``reset()`` forgets history, as a fresh
load or a resume does.

* ``GeometryAware(bound)``: 448 / (margin * bound) with the bound from the weights alone
  (fp8.bounds): known before any activation, unchanged by history.
* ``Delayed``: Transformer Engine's default: 448 / (amax * 2^margin), amax the largest of the
  last ``history`` steps (1024, margin 0); with no history the scale is 1, as TE starts.
* ``Current``: 448 / amax of this very tensor (just-in-time; costs a reduction per cast).

All keep a floor on amax, so a zero tensor or a zero-norm head never gives an infinite scale.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque

import torch

from hilt.errors import HiltError
from hilt.kernels.fp8_attention import E4M3_MAX

AMAX_FLOOR = 1e-12


class ScaleRecipe(ABC):
    name: str

    @abstractmethod
    def scale_for(self, x: torch.Tensor) -> float:
        """The factor x is multiplied by before the E4M3 cast."""

    def observe(self, amax: float) -> None:  # noqa: B027 (a recipe without history ignores it)
        """This step's largest |value|, seen after the cast."""

    def reset(self) -> None:  # noqa: B027
        """Forget the history (a fresh load, a resume)."""


class GeometryAware(ScaleRecipe):
    name = "geometry"

    def __init__(self, bound: float, margin: float = 1.0):
        if not math.isfinite(bound) or bound < 0 or margin < 1:
            raise HiltError(f"a geometry-aware scale needs a finite bound >= 0 and margin >= 1 (got {bound}, {margin})")
        self.bound, self.margin = bound, margin

    def scale_for(self, x):
        return E4M3_MAX / (self.margin * max(self.bound, AMAX_FLOOR)) if self.bound > 0 else 1.0


class Delayed(ScaleRecipe):
    name = "delayed"

    def __init__(self, history: int = 1024, margin: int = 0):
        if history < 1:
            raise HiltError(f"the amax history needs at least one step, got {history}")
        self.history, self.margin = deque(maxlen=history), margin

    def scale_for(self, x):
        if not self.history:
            return 1.0
        return E4M3_MAX / (max(max(self.history), AMAX_FLOOR) * 2.0**self.margin)

    def observe(self, amax):
        self.history.append(float(amax))

    def reset(self):
        self.history.clear()


class Current(ScaleRecipe):
    name = "current"

    def scale_for(self, x):
        return E4M3_MAX / max(float(x.detach().abs().max()) if x.numel() else 0.0, AMAX_FLOOR)


# Between 448 and 464 (half-way to the next step, 480, were there one) round-to-nearest gives
# 448 anyway: clipping changes a value only from 464 on, so only those count as overflow.
OVERFLOW_FROM = E4M3_MAX + 16.0  # 464


def fp8_cast(x: torch.Tensor, scale: float) -> tuple[torch.Tensor, int]:
    """x through E4M3 at ``scale`` and back: (the dequantized values, how many the clip changed).

    PyTorch's cast to float8_e4m3fn does not saturate (out of range becomes NaN), so values
    are clipped first, as FP8 hardware paths with saturation do.
    """
    if not torch.isfinite(x).all():
        raise HiltError("a tensor cast to FP8 contains NaN or Inf")
    y = x.float() * scale
    overflow = int((y.abs() >= OVERFLOW_FROM).sum())
    y = y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return (y / scale).to(x.dtype), overflow
