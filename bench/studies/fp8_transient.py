"""`hilt fp8 transient`: do FP8 attention logits overflow when something changes?

A small character-level GPT (hilt/models/gpt.py) is pretrained on Shakespeare in fp32, then
fine-tuned with every layer's attention logits passed through E4M3 (straight-through
gradient), one run per scale recipe and scenario:

* ``load``: the FP8 scaling state was built on the randomly initialised model (warm-up steps,
  as a training script does before it loads a checkpoint); then the pretrained weights are
  loaded and fine-tuning goes on.
* ``load-empty``: the pretrained weights in a fresh process: every history empty (delayed
  scaling starts at scale 1, as Transformer Engine does).
* ``resume``: fine-tuning stops and resumes from its checkpoint with the scaling state
  restored but the optimizer's moments lost (a common resume: Adam's first steps are large).
* ``lr-spike``: the learning rate jumps 10x for a few steps.

Recipes (fp8.recipes): ``delayed`` (TE default: amax history 1024, margin 0), ``current``
(this tensor's amax), ``geometry`` (the worst-case bound sigma R^2 / sqrt(d_h) from the weights,
recomputed after every optimizer step and right after a load, power iteration warm-started)
and ``rank-aware`` (the probabilistic prediction, delta 1e-6, gamma per layer from a burn-in on
four batches of the pretrained model). Per step and recipe the study
counts logits clipped at +-448 (overflow) and nonzero logits flushed to zero (underflow).
"""

from __future__ import annotations

import copy
import math

import torch

from hilt.fp8.bounds import burn_in_gamma, norm_radius, tail_alpha
from hilt.fp8.recipes import E4M3_MAX, Current, Delayed, GeometryAware, fp8_cast
from hilt.fp8.spectral import head_norms
from hilt.errors import HiltError
from hilt.progress import LOG

RECIPES = ("delayed", "current", "geometry", "rank-aware")
SCENARIOS = ("load", "load-empty", "resume", "lr-spike")
FULL = {"pretrain": 400, "before": 20, "after": 60, "spike": 10}
QUICK = {"pretrain": 100, "before": 5, "after": 15, "spike": 4}
LR, SPIKE, BATCH = 1e-3, 10.0, 16  # fine-tuning batch: windows of 128 characters


class LogitCast:
    """One layer's E4M3 cast of its attention logits under one recipe; counts per step."""

    def __init__(self, recipe):
        self.recipe, self.overflow, self.flushed, self.amax = recipe, 0, 0, 0.0

    def __call__(self, s: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        allowed = s.detach().masked_fill(~mask, 0)  # masked pairs never reach the softmax: not counted
        q, overflow = fp8_cast(allowed, self.recipe.scale_for(allowed))
        amax = float(allowed.abs().max())
        self.overflow += overflow
        self.flushed += int(((q == 0) & (allowed != 0)).sum())
        self.amax = max(self.amax, amax)
        self.recipe.observe(amax)
        return s + (q - s).detach()  # straight-through: the cast's error is not differentiated

    def take(self) -> tuple[int, int, float]:
        out = (self.overflow, self.flushed, self.amax)
        self.overflow, self.flushed, self.amax = 0, 0, 0.0
        return out


class GeometryBounds:
    """Per-layer logit bounds of a GPT from its weights, recomputed on demand: the worst case,
    or with ``gammas`` (one per layer) the rank-aware prediction for sequences of ``n_tokens``."""

    def __init__(self, model, n_tokens: int, gammas: list[float] | None = None):
        self.model, self.n_tokens, self.gammas = model, n_tokens, gammas
        self.directions = [None] * len(model.blocks)

    @torch.no_grad()
    def __call__(self) -> list[float]:
        cfg, bounds = self.model.cfg, []
        d_h = cfg.n_embd // cfg.n_head
        for i, blk in enumerate(self.model.blocks):
            alpha = 1.0 if self.gammas is None else tail_alpha(cfg.n_embd, d_h, self.n_tokens, gamma=self.gammas[i])
            norms = head_norms(blk.attn.q.weight, blk.attn.k.weight, cfg.n_head, cfg.n_head, v0=self.directions[i])
            self.directions[i] = norms.directions
            radius = norm_radius(blk.ln_1.weight, blk.ln_1.bias)
            bounds.append(alpha * float(norms.sigma.max()) * radius**2 / math.sqrt(d_h))
        return bounds


def _recipe(name: str):
    if name == "delayed":
        return Delayed()
    if name == "current":
        return Current()
    if name in ("geometry", "rank-aware"):
        return GeometryAware(0.0)  # the bound is set from the weights before the first cast
    raise HiltError(f"unknown recipe {name!r}; choose from {', '.join(RECIPES)}")


@torch.no_grad()
def burn_in(model, batches: int = 4, seed: int = 7) -> list[float]:
    """Per layer, the rank-aware gamma that covers the largest logits of a few training batches."""
    from hilt.models.gpt import batch, corpus

    cfg, (_, data, _) = model.cfg, corpus()
    seen = [0.0] * cfg.n_layer
    for i, blk in enumerate(model.blocks):
        def hook(s, mask, i=i):
            seen[i] = max(seen[i], float(s.masked_fill(~mask, 0).abs().max()))
            return s
        blk.attn.logit_hook = hook
    gen = torch.Generator().manual_seed(seed)
    try:
        for _ in range(batches):
            model(batch(data, cfg.block_size, BATCH, gen)[0])
    finally:
        for blk in model.blocks:
            blk.attn.logit_hook = None
    worst = GeometryBounds(model, cfg.block_size)()
    d_h = cfg.n_embd // cfg.n_head
    return [burn_in_gamma(torch.tensor([o]), torch.tensor([w]), cfg.n_embd, d_h, cfg.block_size)
            for o, w in zip(seen, worst, strict=True)]


def _run(pretrained, scenario: str, recipe_name: str, plan: dict, seed: int, gammas: list[float]) -> list[dict]:
    from hilt.models.gpt import GPT, train

    cfg = pretrained.cfg
    model = GPT(cfg) if scenario == "load" else copy.deepcopy(pretrained)
    casts = [LogitCast(_recipe(recipe_name)) for _ in model.blocks]
    for blk, cast in zip(model.blocks, casts, strict=True):
        blk.attn.logit_hook = cast
    bounds = GeometryBounds(model, cfg.block_size, gammas if recipe_name == "rank-aware" else None)

    def refresh_bounds():  # after every weight change: optimizer steps, loads, resumes
        if isinstance(casts[0].recipe, GeometryAware):
            for cast, b in zip(casts, bounds(), strict=True):
                cast.recipe.bound = b

    rows = []

    def record(phase):
        def after_step(step, loss):
            refresh_bounds()
            taken = [c.take() for c in casts]
            rows.append({"step": len(rows), "phase": phase, "loss": loss, "overflow": sum(t[0] for t in taken),
                         "flushed": sum(t[1] for t in taken), "amax": max(t[2] for t in taken)})
        return after_step

    refresh_bounds()
    before, after = plan["before"], plan["after"]
    if scenario == "load":
        train(model, before, LR, BATCH, seed=seed, after_step=record("before"))
        model.load_state_dict(pretrained.state_dict())
        refresh_bounds()
        train(model, after, LR, BATCH, seed=seed + 1, after_step=record("after"))
    elif scenario == "load-empty":
        train(model, after, LR, BATCH, seed=seed + 1, after_step=record("after"))
    elif scenario == "resume":
        train(model, before, LR, BATCH, seed=seed, after_step=record("before"))
        train(model, after, LR, BATCH, seed=seed + 1, after_step=record("after"))  # a new AdamW: moments lost
    elif scenario == "lr-spike":
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, betas=(0.9, 0.95))
        train(model, before, LR, BATCH, seed=seed, optimizer=opt, after_step=record("before"))
        spike = lambda step: LR * SPIKE if step < plan["spike"] else LR  # noqa: E731
        train(model, after, LR, BATCH, seed=seed + 1, optimizer=opt, lr_at=spike, after_step=record("after"))
    else:
        raise HiltError(f"unknown scenario {scenario!r}; choose from {', '.join(SCENARIOS)}")
    return rows


def study(quick: bool = False, seed: int = 0, plan: dict | None = None, shape: dict | None = None) -> dict:
    """The study; ``shape`` overrides the GPT's size (GPTConfig fields), for smoke runs."""
    from hilt.models.gpt import GPT, GPTConfig, corpus, evaluate, train

    plan = plan or (QUICK if quick else FULL)
    alphabet, _, val = corpus()
    torch.manual_seed(seed)
    pretrained = GPT(GPTConfig(len(alphabet), **(shape or {})))
    LOG.info(f"pretraining a {sum(p.numel() for p in pretrained.parameters()) / 1e6:.2f} M-parameter character GPT "
             f"on Shakespeare for {plan['pretrain']} steps (fp32)...")
    train(pretrained, plan["pretrain"], 2e-3, seed=seed, progress=True, desc="pretrain")
    val_loss = evaluate(pretrained, val)
    LOG.info(f"  validation loss {val_loss:.3f} nats/char")
    gammas = burn_in(pretrained)
    LOG.info(f"  burn-in on 4 training batches: rank-aware gamma per layer {', '.join(f'{g:.2f}' for g in gammas)}")
    runs = []
    for scenario in SCENARIOS:
        for name in RECIPES:
            torch.manual_seed(seed + 1)
            rows = _run(pretrained, scenario, name, plan, seed + 1, gammas)
            after = [r for r in rows if r["phase"] == "after"]
            runs.append({"scenario": scenario, "recipe": name, "steps": rows,
                         "overflow_steps": sum(r["overflow"] > 0 for r in after),
                         "overflow_logits": sum(r["overflow"] for r in after),
                         "overflow_steps_before": sum(r["overflow"] > 0 for r in rows if r["phase"] == "before"),
                         "flushed_logits": sum(r["flushed"] for r in after),
                         "final_loss": after[-1]["loss"]})
            r = runs[-1]
            LOG.info(f"  {scenario:>10} {name:>10}: {r['overflow_steps']:>3} of {len(after)} steps overflow after the event "
                     f"({r['overflow_logits']} logits clipped), {r['flushed_logits']} flushed to zero, "
                     f"final loss {r['final_loss']:.3f}")
    broken = [r["scenario"] for r in runs if r["recipe"] == "geometry" and r["overflow_steps"]]
    if broken:
        LOG.warning(f"geometry-aware scales overflowed in: {', '.join(broken)} (they must not: the bound is wrong)")
    return {"quick": quick, "seed": seed, "plan": plan, "lr": LR, "spike_factor": SPIKE, "e4m3_max": E4M3_MAX,
            "model": {"config": vars(pretrained.cfg), "pretrain_validation_loss": val_loss}, "burn_in_gamma": gammas, "runs": runs}


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SCENARIOS), figsize=(4.2 * len(SCENARIOS), 3.6), sharey=True)
    colors = {"delayed": "tab:red", "current": "tab:blue", "geometry": "tab:green", "rank-aware": "tab:olive"}
    for ax, scenario in zip(axes, SCENARIOS, strict=True):
        for r in (r for r in result["runs"] if r["scenario"] == scenario):
            steps = r["steps"]
            ax.plot([s["step"] for s in steps], [s["overflow"] for s in steps], label=r["recipe"],
                    color=colors[r["recipe"]], lw=1.4, drawstyle="steps-mid")
            event = next((s["step"] for s in steps if s["phase"] == "after"), 0)
        if event:
            ax.axvline(event - 0.5, color="0.4", ls="--", lw=1)
        ax.set_yscale("symlog", linthresh=1)
        ax.set_title(scenario)
        ax.set_xlabel("fine-tuning step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("attention logits clipped at ±448 (all layers)")
    axes[-1].legend(loc="upper right", fontsize=8)
    fig.suptitle("FP8 (E4M3) attention logits: overflow per step and recipe (dashed: the event)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
