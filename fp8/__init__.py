"""fp8: geometry-aware FP8 attention scales from the weights alone.

So far: per-head spectral norms of W_Q,h^T W_K,g by batched power iteration
(grouped-query aware, warm-startable), `fp8.spectral.head_norms`, and the
worst-case logit bounds they give behind a pre-attention norm
(`fp8.bounds.logit_bounds`; `hilt fp8 scales`), and the scale recipes behind one
interface (geometry-aware, delayed, current) with a cast that counts clipping
(`fp8.recipes`). The rank-aware bound, the transient study, the FP8 attention
kernel and module are still to come (issue 4).
"""

from fp8.bounds import logit_bounds, norm_radius
from fp8.recipes import Current, Delayed, GeometryAware, ScaleRecipe, fp8_cast
from fp8.spectral import HeadNorms, head_norms

__all__ = ["Current", "Delayed", "GeometryAware", "HeadNorms", "ScaleRecipe", "fp8_cast", "head_norms",
           "logit_bounds", "norm_radius"]
