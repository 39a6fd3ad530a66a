"""fp8: geometry-aware FP8 attention scales from the weights alone, and FP8 attention.

Per-head spectral norms of W_Q,h^T W_K,g by batched power iteration (grouped-query aware,
warm-startable: `fp8.spectral.head_norms`); the worst-case logit bounds and the rank-aware
prediction they give behind a pre-attention norm, with burn-in calibration
(`fp8.bounds`; `hilt fp8 scales`); scale recipes behind one interface (geometry-aware,
delayed, current) with a cast that counts clipping (`fp8.recipes`; `hilt fp8 transient`);
and `FP8Attention`, the module the SmolLM2 and MiniLM forwards use to run attention through
the FP8 kernel (`fp8.attention`; `hilt fp8 attention`). Any transformers model runs it too, through
transformers' attention-function hook (`use_fp8_attention_hf`); attention whose q and k pass an RMSNorm
(Gemma 3, Qwen3, OLMo2) is bounded by the norms' gains (`qk_norm_logit_bounds`).
"""

from hilt.fp8.attention import FP8Attention, use_fp8_attention, use_fp8_attention_hf
from hilt.fp8.bounds import burn_in_gamma, logit_bounds, norm_radius, qk_norm_logit_bounds, tail_alpha
from hilt.fp8.recipes import Current, Delayed, GeometryAware, ScaleRecipe, fp8_cast
from hilt.fp8.spectral import HeadNorms, head_norms

__all__ = ["Current", "Delayed", "FP8Attention", "GeometryAware", "HeadNorms", "ScaleRecipe", "burn_in_gamma",
           "fp8_cast", "head_norms", "logit_bounds", "norm_radius", "qk_norm_logit_bounds", "tail_alpha",
           "use_fp8_attention", "use_fp8_attention_hf"]
