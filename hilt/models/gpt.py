"""A small decoder-only transformer (nanoGPT-like), trained from scratch on Shakespeare with
characters as tokens: the model the FP8 transient study fine-tunes and the QAT study sizes.

Pre-norm blocks (LayerNorm, causal self-attention, 4x GELU MLP), learned positions, the LM
head tied to the token embedding. Q, K and V are separate bias-free Linears so that
`fp8.bounds` reads W_Q and W_K directly. ``Attention.logit_hook`` sees the attention logits
before the mask and softmax (the FP8 study casts them through E4M3 there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from hilt.data.text import available_works, shakespeare_text
from hilt.errors import HiltError
from hilt.progress import Progress


@lru_cache(maxsize=1)
def corpus() -> tuple[str, torch.Tensor, torch.Tensor]:
    """(alphabet, train ids, validation ids): every work concatenated in name order, the last
    10% of the characters held out for validation."""
    text = "".join(shakespeare_text(w) for w in available_works())
    alphabet = "".join(sorted(set(text)))
    lookup = torch.zeros(max(map(ord, alphabet)) + 1, dtype=torch.uint8)
    lookup[torch.tensor([ord(c) for c in alphabet])] = torch.arange(len(alphabet), dtype=torch.uint8)
    ids = lookup[torch.tensor([ord(c) for c in text])]
    split = int(0.9 * len(ids))
    return alphabet, ids[:split], ids[split:]


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise HiltError(f"width {self.n_embd} does not split into {self.n_head} heads")


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.n_embd
        self.n_head = cfg.n_head
        self.q, self.k, self.v, self.proj = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.logit_hook = None  # callable(logits (B, H, T, T), causal mask (T, T)) -> logits

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (m(x).view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for m in (self.q, self.k, self.v))
        if self.logit_hook is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            s = self.logit_hook(q @ k.transpose(-1, -2) / math.sqrt(d // self.n_head), mask)
            y = s.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(cfg.n_embd), Attention(cfg), nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte, self.wpe = nn.Embedding(cfg.vocab_size, cfg.n_embd), nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by depth
            if name.endswith(("proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise HiltError(f"sequence of {t} tokens is longer than the model's block size {self.cfg.block_size}")
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln_f(x) @ self.wte.weight.T
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten().long())


class CharLM:
    """A GPT and its alphabet as the text model hilt.tasks.downstream scores: characters as tokens, no BOS, at
    most ``block_size`` characters read at once."""

    bos = None

    def __init__(self, model: GPT, alphabet: str):
        self.model, self.alphabet = model, alphabet
        self.index = {c: i for i, c in enumerate(alphabet)}
        self.context = model.cfg.block_size

    def encode(self, text: str) -> list[int]:
        try:
            return [self.index[c] for c in text]
        except KeyError as e:
            raise HiltError(f"character {e.args[0]!r} is not in the model's alphabet") from None

    def decode(self, ids) -> str:
        return "".join(self.alphabet[i] for i in ids)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)


def batch(data: torch.Tensor, block: int, size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` random windows of ``block`` characters and their next characters."""
    start = torch.randint(len(data) - block - 1, (size,), generator=gen)
    rows = start[:, None] + torch.arange(block + 1)
    w = data[rows].long()
    return w[:, :-1], w[:, 1:]


@torch.no_grad()
def evaluate(model: GPT, data: torch.Tensor, batches: int = 20, size: int = 32, seed: int = 1234) -> float:
    """Mean cross-entropy (nats per character) over fixed random windows of ``data``."""
    gen = torch.Generator().manual_seed(seed)
    was = model.training
    model.eval()
    losses = [float(model(*batch(data, model.cfg.block_size, size, gen))[1]) for _ in range(batches)]
    model.train(was)
    return sum(losses) / len(losses)


def train(model: GPT, steps: int, lr: float = 1e-3, size: int = 32, seed: int = 0, optimizer=None,
          lr_at=None, after_step=None, progress: bool = False, desc: str = "train") -> list[float]:
    """AdamW on random training windows; returns the loss of every step.

    ``lr_at(step)`` overrides the constant rate (schedules, spikes); ``after_step(step, loss)``
    runs after each optimizer step (the FP8 study recomputes its bounds there)."""
    _, data, _ = corpus()
    gen = torch.Generator().manual_seed(seed)
    opt = optimizer or torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    model.train()
    losses = []
    bar = Progress(1, desc, steps=steps, enabled=progress)  # the run is one item: a line when it ends
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr if lr_at is None else lr_at(step)
        _, loss = model(*batch(data, model.cfg.block_size, size, gen))
        if not torch.isfinite(loss):
            raise HiltError(f"{desc}: the loss became {float(loss.detach())} at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        bar.tick()
        if after_step is not None:
            after_step(step, losses[-1])
    bar.done(desc, f"{steps} steps, final loss {losses[-1]:.3f}" if losses else "no steps")
    bar.close()
    return losses
