"""Downstream tasks behind `hilt eval tasks`: what a language model does with text, beside its perplexity.

The items are hilt.data.lm_tasks's (a held-out Shakespeare work). Each task is scored per item, so a
score comes with a 95% bootstrap interval over items and a chance level beside it:

* ``next_line``: the four candidate lines are scored by the model's log-likelihood after the passage;
  the pick is the highest total (``accuracy``) and the highest per character of the line
  (``accuracy_norm``, which does not favour short lines). Chance is one in four.
* ``cloze``: greedy decoding after the passage until a word is complete; exact match of that word with
  the line's last word (letters and apostrophes, case ignored). Chance is a frequency guess: always
  answering the most common answer of the items.
* ``continuation``: greedy decoding of ``CONTINUATION_TOKENS`` tokens after the passage, compared with
  the true text's next tokens (``exact``: all of them; ``prefix``: the share matched before the first
  miss) and, given a reference model (the float model a quantized one was made from), with the
  reference's own greedy continuation (``agreement_exact``, ``agreement_prefix``). Chance is a frequency
  guess: one fixed continuation for every item, built token by token from the most common true tokens.

A model here is anything with ``encode(text)``, ``decode(ids)``, ``logits(ids)`` (B, T) -> (B, T, vocab),
``bos`` (a token to lead every input, or None) and ``context`` (the most tokens it reads at once, or None; see
:func:`read`): hilt.models.lm.CausalLM (which also has a key/value cache), or the character GPTs of `bench qat`
(hilt.models.gpt.CharLM).
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import torch
import torch.nn.functional as F

from hilt.errors import HiltError
from hilt.progress import Progress

TASKS = ("next_line", "cloze", "continuation")
# each task's main measure (its per-item values are the result's "per_item") and that measure's chance level
MAIN = {"next_line": ("accuracy_norm", "chance"), "cloze": ("exact", "chance"),
        "continuation": ("prefix", "chance_prefix")}
LABELS = {"next_line": "next line", "cloze": "cloze", "continuation": "continuation"}
QUICK_COUNTS = {"next_line": 60, "cloze": 60, "continuation": 30}  # items of each set, spread over the work
CONTINUATION_TOKENS = 8
CLOZE_MAX_TOKENS = 16  # a character model needs one token a letter
RESAMPLES = 2000
_WORD = re.compile(r"^\s*([A-Za-z][A-Za-z']*)")


def bootstrap_interval(values, resamples: int = RESAMPLES, seed: int = 0) -> list[float]:
    """95% percentile interval of the mean of ``values`` (one per item) by resampling items."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        raise HiltError("no items to score")
    means = v[np.random.default_rng(seed).integers(0, v.size, (resamples, v.size))].mean(1)
    return [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]


def _score(values) -> dict:
    return {"score": float(np.mean(values)), "interval": bootstrap_interval(values)}


def spread(items: list, n: int | None) -> list:
    """``n`` items evenly spread over ``items`` (all of them for None)."""
    if n is None or n >= len(items):
        return items
    return [items[i * len(items) // n] for i in range(n)]


def _prompt(model, passage: str) -> list[int]:
    """The passage's tokens, led by the BOS where the model has one."""
    return ([] if model.bos is None else [model.bos]) + model.encode(passage)


def read(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits of ``ids`` (B, T). A model that reads at most ``context`` tokens at once reads a longer input in
    windows half a context apart, each position predicted from at least half a context before it."""
    n, T = model.context, ids.shape[1]
    if n is None or T <= n:
        return model.logits(ids)
    parts, done = [model.logits(ids[:, :n])], n
    while done < T:
        end = min(done + n // 2, T)
        parts.append(model.logits(ids[:, end - n:end])[:, n - (end - done):])
        done = end
    return torch.cat(parts, 1)


@torch.inference_mode()
def choice_logprobs(model, passage: str, choices: list[str]) -> list[float]:
    """log P(choice + newline | passage) of each choice, summed over its tokens. A model with a key/value cache
    (``extend``) reads the passage once and the choices as one batch after it."""
    conts = [model.encode(c + "\n") for c in choices]
    ctx = _prompt(model, passage)
    width = max(len(c) for c in conts)
    padded = torch.tensor([c + [0] * (width - len(c)) for c in conts])  # right padding: no earlier position sees it
    if hasattr(model, "extend"):
        first, cache = model.extend(torch.tensor([ctx]))
        rest, _ = model.extend(padded[:, :-1], model.repeat_cache(cache, len(conts)))
        logits = torch.cat([first[:, -1:].expand(len(conts), -1, -1), rest], 1)  # position i predicts token i
    else:
        logits = read(model, torch.cat([torch.tensor([ctx]).expand(len(conts), -1), padded], 1))[:, len(ctx) - 1:-1]
    logp = F.log_softmax(logits.float(), dim=-1)
    return [float(logp[b, torch.arange(len(c)), torch.tensor(c)].sum()) for b, c in enumerate(conts)]


@torch.inference_mode()
def greedy(model, passage: str, steps: int, stop=None) -> list[int]:
    """Up to ``steps`` greedy tokens after ``passage``; ``stop(ids)`` ends early when true. A model with a
    key/value cache (``extend``) reads the passage once, then one token a step; one without reads the last
    ``context`` tokens (all, for None) each step."""
    ctx = _prompt(model, passage)
    out: list[int] = []
    cache = None
    step = torch.tensor([ctx])
    for _ in range(steps):
        if hasattr(model, "extend"):
            logits, cache = model.extend(step, cache)
        else:
            logits = model.logits(torch.tensor([(ctx + out)[-(model.context or 0):]]))
        out.append(int(logits[0, -1].float().argmax()))
        step = torch.tensor([[out[-1]]])
        if stop is not None and stop(out):
            break
    return out


def first_word(text: str) -> str:
    """The word a decoded continuation starts with (letters and inner apostrophes), '' if none."""
    m = _WORD.match(text)
    return m.group(1).rstrip("'").lower() if m else ""


def next_line(model, items: list[dict], bar=None) -> dict:
    correct, correct_norm, picks = [], [], []
    for item in items:
        logps = choice_logprobs(model, item["passage"], item["choices"])
        per_char = [lp / (len(c) + 1) for lp, c in zip(logps, item["choices"])]
        pick, pick_norm = int(np.argmax(logps)), int(np.argmax(per_char))
        correct.append(pick == item["answer"])
        correct_norm.append(pick_norm == item["answer"])
        picks.append(pick)
        if bar is not None:
            bar.tick()
    return {"items": len(items), "accuracy": _score(correct), "accuracy_norm": _score(correct_norm),
            "chance": 1 / len(items[0]["choices"]), "picks": picks, "per_item": [int(c) for c in correct_norm]}


def cloze(model, items: list[dict], bar=None) -> dict:
    correct, words = [], []
    for item in items:
        ids = greedy(model, item["passage"], CLOZE_MAX_TOKENS,
                     stop=lambda out: re.match(r"^\s*[A-Za-z][A-Za-z']*[^A-Za-z']", model.decode(out)) is not None)
        word = first_word(model.decode(ids))
        words.append(word)
        correct.append(word == item["answer"].lower())
        if bar is not None:
            bar.tick()
    answers = Counter(item["answer"].lower() for item in items)
    return {"items": len(items), "exact": _score(correct), "chance": answers.most_common(1)[0][1] / len(items),
            "words": words, "per_item": [int(c) for c in correct]}


def _prefix_share(a: list[int], b: list[int]) -> float:
    n = 0
    while n < len(b) and n < len(a) and a[n] == b[n]:
        n += 1
    return n / len(b)


def frequency_guess(targets: list[list[int]]) -> tuple[float, float]:
    """(exact, prefix) scores of one fixed guess for every item: the most common target for exact match, and
    for the prefix score the continuation built from the most common next token among the targets it still
    matches."""
    exact = Counter(tuple(t) for t in targets).most_common(1)[0][1] / len(targets)
    guess, alive = [], list(targets)
    for i in range(len(targets[0])):
        tok = Counter(t[i] for t in alive).most_common(1)[0][0]
        guess.append(tok)
        alive = [t for t in alive if t[i] == tok]
        if not alive:
            break
    guess += [-1] * (len(targets[0]) - len(guess))
    return exact, float(np.mean([_prefix_share(guess, t) for t in targets]))


def continuation_targets(model, items: list[dict], tokens: int = CONTINUATION_TOKENS) -> list[list[int]]:
    targets = [model.encode(item["answer"])[:tokens] for item in items]
    if any(len(t) < tokens for t in targets):
        raise HiltError(f"a continuation item holds fewer than {tokens} tokens of text")
    return targets


def continuation(model, items: list[dict], reference: list[list[int]] | None = None,
                 tokens: int = CONTINUATION_TOKENS, bar=None) -> dict:
    """``reference``: another model's greedy tokens for the same items (see :func:`greedy_continuations`)."""
    targets = continuation_targets(model, items, tokens)
    outs = greedy_continuations(model, items, tokens, bar)
    chance_exact, chance_prefix = frequency_guess(targets)
    prefix = [_prefix_share(o, t) for o, t in zip(outs, targets)]
    result = {"items": len(items), "tokens": tokens,
              "exact": _score([o == t for o, t in zip(outs, targets)]), "prefix": _score(prefix),
              "chance_exact": chance_exact, "chance_prefix": chance_prefix,
              "texts": [model.decode(o) for o in outs], "per_item": prefix}
    if reference is not None:
        result["agreement_exact"] = _score([o == r for o, r in zip(outs, reference)])
        result["agreement_prefix"] = _score([_prefix_share(o, r) for o, r in zip(outs, reference)])
    return result


def greedy_continuations(model, items: list[dict], tokens: int = CONTINUATION_TOKENS, bar=None) -> list[list[int]]:
    outs = []
    for item in items:
        outs.append(greedy(model, item["passage"], tokens))
        if bar is not None:
            bar.tick()
    return outs


def score_tasks(model, items: dict, tasks=TASKS, reference: list[list[int]] | None = None,
                progress: bool = False) -> dict:
    """Every task of ``tasks`` on its item set in ``items`` (hilt.data.lm_tasks's layout, already cut to size)."""
    out = {}
    # a bar ticking per item on a terminal; elsewhere a line per task
    with Progress(len(tasks), "tasks", "item", steps=max(len(items[t]) for t in tasks), enabled=progress) as bar:
        scorers = {"next_line": lambda: next_line(model, items["next_line"], bar),
                   "cloze": lambda: cloze(model, items["cloze"], bar),
                   "continuation": lambda: continuation(model, items["continuation"], reference, bar=bar)}
        for task in (t for t in TASKS if t in tasks):
            out[task] = scorers[task]()
            bar.done(LABELS[task], summary({task: out[task]}))
    return out


def summary(scores: dict) -> str:
    """One line: each task's main measure beside its chance level."""
    return ", ".join(f"{LABELS[t]} {scores[t][MAIN[t][0]]['score']:.3f} (chance {scores[t][MAIN[t][1]]:.3f})"
                     for t in TASKS if t in scores)


def main_scores(scores: dict) -> dict:
    """Each task's main measure: {task: {"per_item", "chance"}} (what a study keeps of a run)."""
    return {t: {"per_item": scores[t]["per_item"], "chance": scores[t][MAIN[t][1]]} for t in TASKS if t in scores}


def pooled(runs: list[dict]) -> dict:
    """:func:`main_scores` of several runs on the same items (seeds) as one score per task: the runs' mean, its
    interval by bootstrap over items of the per-item means."""
    out = {}
    for t in runs[0]:
        per_item = np.mean([r[t]["per_item"] for r in runs], axis=0)
        out[t] = {"score": float(per_item.mean()), "interval": bootstrap_interval(per_item),
                  "chance": runs[0][t]["chance"]}
    return out


def rows(scores: dict) -> list[tuple[str, str, dict, float | None]]:
    """(task, measure, score with interval, chance level or None) of every measure in ``scores``."""
    out = []
    if "next_line" in scores:
        s = scores["next_line"]
        out += [("next_line", "next line: accuracy per character", s["accuracy_norm"], s["chance"]),
                ("next_line", "next line: accuracy", s["accuracy"], s["chance"])]
    if "cloze" in scores:
        out.append(("cloze", "cloze: last word exact", scores["cloze"]["exact"], scores["cloze"]["chance"]))
    if "continuation" in scores:
        s, n = scores["continuation"], scores["continuation"]["tokens"]
        out += [("continuation", f"continuation: share of {n} tokens before a miss", s["prefix"], s["chance_prefix"]),
                ("continuation", f"continuation: all {n} tokens exact", s["exact"], s["chance_exact"])]
        if "agreement_prefix" in s:
            out += [("continuation", "continuation: agreement with the reference, share", s["agreement_prefix"], None),
                    ("continuation", "continuation: agreement with the reference, exact", s["agreement_exact"], None)]
    return out


def render(scores: dict, reference: str | None = None) -> str:
    """A Markdown table of :func:`rows`, items counted."""
    lines = ["| measure | items | score | 95% interval | chance |", "|---|---:|---:|---|---:|"]
    for task, name, s, chance in rows(scores):
        lo, hi = s["interval"]
        lines.append(f"| {name} | {scores[task]['items']} | {s['score']:.3f} | {lo:.3f}-{hi:.3f} | "
                     f"{'' if chance is None else f'{chance:.3f}'} |")
    if "continuation" in scores and "agreement_prefix" not in scores["continuation"]:
        lines.append("\n(no float reference: the continuation's agreement with one is not measured)")
    elif reference:
        lines.append(f"\nreference for agreement: {reference}")
    return "\n".join(lines)
