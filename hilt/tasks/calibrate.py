"""Calibration: how much each input column of each linear layer matters.

Runs real text through a model and records, for every nn.Linear, the mean
squared input activation of each input column, E[x_j^2]. That is the diagonal
of the layer's input Gram matrix, so  sum_j E[x_j^2] * sum_i (dW_ij)^2  is the
expected squared output error caused by a weight error dW when columns are
uncorrelated: the right weight for k-means to spend its levels on. Written as
a safetensors file whose names are the weights' tensor names, for
`hilt quantize --importance FILE`.

Calibrate on other text than you evaluate on: the defaults use Macbeth, and
the evaluations use Hamlet.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from hilt.errors import HiltError
from hilt.atomic import save_safetensors


def collect_importance(model: nn.Module, batches) -> dict[str, torch.Tensor]:
    """Mean of x^2 per input column of every nn.Linear, over all rows of all batches.

    ``batches`` yields argument tuples for ``model``. Keys are '<module path>.weight'.
    """
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []
    for path, module in model.named_modules():
        if isinstance(module, nn.Linear):
            def hook(mod, inputs, output, key=f"{path}.weight"):
                x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()
                sums[key] = sums.get(key, 0) + (x * x).sum(0)
                counts[key] = counts.get(key, 0) + x.shape[0]
            hooks.append(module.register_forward_hook(hook))
    try:
        with torch.inference_mode():
            for args in batches:
                model(*args)
    finally:
        for h in hooks:
            h.remove()
    return {k: (sums[k] / counts[k]).float() for k in sums}


def calibrate(model="smollm2", out="importance.safetensors", work="macbeth", tokens=2048, sentences=256,
              overwrite=False) -> dict:
    """Importance for any causal LM hilt.models.lm loads (smollm2, gemma3, a GGUF path, a causal-LM folder) or
    MiniLM ('minilm' or a BERT folder)."""

    from hilt.data.text import sentences as real_sentences
    from hilt.data.text import shakespeare_text
    from hilt.models import lm as causal

    out = Path(out)
    if out.exists() and not overwrite:
        raise HiltError(f"{out}: already exists; pass --overwrite to replace it")
    if not out.parent.is_dir():
        raise HiltError(f"{out}: folder {out.parent} does not exist")
    if model == "minilm" or not causal.is_language_model(model):
        from hilt.models import bert

        net, tokenizer = bert.load_minilm(None if model == "minilm" else model)
        batch = real_sentences(sentences, work=work)

        def batches():
            for i in range(0, len(batch), 64):
                enc = tokenizer.encode_batch(batch[i:i + 64])
                yield (torch.tensor([e.ids for e in enc]), torch.tensor([e.attention_mask for e in enc]))
        seen = f"{len(batch)} sentences of {work}"
    else:
        lm = causal.load_lm(model)
        net = lm.model
        ids = lm.encode(shakespeare_text(work))
        ids = ids[len(ids) // 4:][:tokens]  # past the cast list

        def batches():
            for w in causal.split_windows(ids, 512, lm.bos):
                yield (w[None],)
        seen = f"{len(ids)} tokens of {work}"
    importance = collect_importance(net, batches())
    save_safetensors({k: v.contiguous() for k, v in importance.items()}, out, metadata={"format": "pt"})
    return {"out": str(out), "layers": len(importance), "calibration": seen}
