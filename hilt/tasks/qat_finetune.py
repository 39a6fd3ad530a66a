"""`hilt qat smollm2 DST`: QAT fine-tuning of the pretrained SmolLM2-135M, resumable, saved in
the `hilt quantize` format (so `hilt eval ppl smollm2 --quantized DST` scores it).

Training text: Shakespeare's works except Hamlet, which `hilt eval` holds out. The quantized
layers are those `hilt quantize` picks (every Linear but the tied embedding / LM head).
Every ``save_every`` steps the training state (weights, codebooks, AdamW moments, step)
goes to ``DST.qat-state/`` as safetensors + JSON (never pickle); ``--resume`` continues
from it with the same batches an uninterrupted run would draw. On a GPU it runs there.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from hilt.errors import HiltError
from hilt.progress import LOG, Progress
from hilt.quant import QuantConfig
from hilt.quant.qat import (
    QATSchedule,
    fake_quant_layers,
    prepare_qat_,
    qat_step_,
    save_qat,
    start_quantizing_,
)
from hilt.data.text import training_tokens
from hilt.tasks.training_state import claim_state, load_state, save_state, state_meta

def finetune(dst, method: str = "kmeans", bits: int = 2, block_size: int = 64, steps: int = 60, lr: float = 1e-4,
             batch: int = 4, context: int = 256, refit_every: int = 0, save_every: int = 10, seed: int = 0,
             resume: bool = False, overwrite: bool = False, only: str | None = None, learn_codebook: bool = True,
             progress: bool = True) -> dict:
    """QAT fine-tuning (see the module docstring); ``only``: a regular expression on weight names
    that narrows the quantized layers (as `hilt quantize --only`)."""
    from hilt.models.llama import load_llama

    dst = Path(dst)
    state_dir = dst.with_name(dst.name + ".qat-state")
    if dst.exists() and not overwrite:
        raise HiltError(f"{dst} exists; pass --overwrite to replace it")
    claim_state(state_dir, resume, overwrite)
    if steps < 1 or batch < 1 or context < 2 or save_every < 1:
        raise HiltError("QAT needs steps, batch and save-every >= 1 and a context >= 2")
    config = QuantConfig(method=method, bits=bits, block_size=block_size)
    settings = {"config": asdict(config), "steps": steps, "lr": lr, "batch": batch, "context": context,
                "refit_every": refit_every, "seed": seed, "only": only, "learn_codebook": learn_codebook}
    try:
        only_re = re.compile(only) if only else None
    except re.error as e:
        raise HiltError(f"bad regular expression in --only: {e}") from None
    meta = state_meta(state_dir, settings) if resume else None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_llama()
    model.to(device).requires_grad_(True)  # loaded for inference: frozen
    prepare_qat_(model, config, None if only_re is None else
                 lambda m, path: bool(only_re.search(f"{path}.weight")) and m.in_features % block_size == 0,
                 learn_codebook=learn_codebook)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    start = 0
    if meta is not None:
        start = load_state(state_dir, meta, model, opt)
        for layer in fake_quant_layers(model).values():
            layer.quantizing = True
        LOG.info(f"resuming at step {start} of {steps} from {state_dir}")
    else:
        LOG.info(f"fitting {len(fake_quant_layers(model))} {bits}-bit {method} codebooks to SmolLM2-135M...")
        start_quantizing_(model)
    tokens = torch.tensor(training_tokens(tokenizer.encode, 400_000))
    schedule = QATSchedule(warmup=0, refit_every=refit_every, steps=steps)
    losses = []
    bar = Progress(steps, "qat", "step", initial=start, enabled=progress)
    model.train()
    for step in range(start, steps):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)  # the same batch whether resumed or not
        starts = torch.randint(len(tokens) - context - 1, (batch,), generator=gen)
        window = tokens[starts[:, None] + torch.arange(context + 1)].to(device)
        logits = model(window[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), window[:, 1:].flatten())
        if not torch.isfinite(loss):
            raise HiltError(f"QAT loss became {float(loss)} at step {step}; lower --lr")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        bar.done(f"step {step + 1}", f"loss {losses[-1]:.3f}")
        qat_step_(model, step, schedule)
        if (step + 1) % save_every == 0 and step + 1 < steps:
            save_state(state_dir, model, opt, step + 1, settings)
    bar.close()
    model.cpu()
    header = save_qat(model, dst, overwrite=overwrite)
    shutil.rmtree(state_dir, ignore_errors=True)
    LOG.info(f"wrote {dst}: {header['totals']['quantized_tensors']} quantized tensors; "
             f"training loss {losses[0] if losses else float('nan'):.3f} -> {losses[-1] if losses else float('nan'):.3f}")
    return {"dst": str(dst), **settings, "resumed_at": start, "losses": losses}
