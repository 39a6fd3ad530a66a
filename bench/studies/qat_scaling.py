"""`hilt bench qat`: validation loss against weight memory under QAT (docs/references.md section 1).

Character GPTs (hilt/models/gpt.py, 4 layers) of several widths are trained from scratch on
Shakespeare with the same token budget, in 16-bit (full precision) and with QAT at 1, 2 and
4 bits in two formats: k-means (codebook per layer, fitted after a full-precision warm-up,
then trained by the loss; or, with learn_codebook=False, refitted by k-means on schedule, the
published procedure) and integers (symmetric absmax; at 1 bit, sign x absmean). Every
configuration is trained from several seeds (the same seeds for every configuration: a seed
fixes the initial weights and the batches) and compared on its mean validation loss. Then:

* weight memory with the true bits per weight: each quantized Linear at its stored size
  (codes, bf16 block scales, fp16 codebook), everything else (embeddings, norms, biases) at
  16 bits; 16-bit models entirely at 16 bits;
* the scaling fit L(N) = E + A N^-alpha on the 16-bit runs (N: the weights of the Linears
  QAT quantizes), and for each quantized run its effective size N_eff, the N at which a
  16-bit model would reach its loss; then N_eff / N = 1 - exp(-P / gamma) fitted per format
  (P: bits per weight) gives gamma, the format's "bits to reach full quality" scale;
* the memory-matched comparison: at each model's memory, the lowest loss any configuration
  reaches within it;
* downstream tasks (hilt.tasks.downstream: next line, cloze, continuation on The Winter's Tale, which
  lies in the held-out 10%): every run is scored, the seeds pooled item by item; at the memory of each
  16-bit model, every format's largest width that fits is ranked by validation loss and by each task
  score, and the 1-bit claim (under a fixed memory budget 1-bit weights win) is judged by both.
"""

from __future__ import annotations

import math
import time

import torch

from hilt.errors import HiltError
from hilt.quant import QuantConfig
from hilt.quant.qat import (
    QATSchedule,
    fake_quant_layers,
    prepare_qat_,
    qat_param_groups,
    qat_step_,
)
from hilt.quant.formats import method_for_bits
from hilt.quant.quantize import expected_bits_per_weight
from hilt.progress import LOG
from hilt.tasks import downstream

FULL = {"widths": (64, 96, 128), "steps": 600, "batch": 32, "block": 64, "layers": 4, "heads": 4, "seeds": (0, 1, 2)}
QUICK = {"widths": (64, 128), "steps": 300, "batch": 32, "block": 64, "layers": 2, "heads": 4, "seeds": (0,)}
BITS = (1, 2, 4)
METHODS = ("kmeans", "int")
SERIES = ("16-bit", *METHODS)  # the plot's and the table's lines: the 16-bit baseline first
RIVAL = {"kmeans": "int", "int": "kmeans"}  # the table marks the lower of the two in bold
BLOCK_SIZE = 32
# Peak learning rate per width: each width's best 16-bit rate of those tried (docs/results/qat.md): 3e-3
# undertrains every width, 9e-3 beats 6e-3 at widths 64 and 96 (the highest tried at 96) and is
# unstable at 128, which diverges at 1.2e-2. Other widths get DEFAULT_LR.
LR_BY_WIDTH, DEFAULT_LR = {64: 9e-3, 96: 9e-3, 128: 6e-3}, 6e-3
VAL_BATCHES = 100  # of 32 random 64-character windows of the 506k held-out characters, the same for every run
WARMUP_FRACTION, REFITS = 0.2, 4  # full-precision warm-up share of the steps; k-means refits after it (not learned)


def config_for(method: str, bits: int) -> QuantConfig:
    """int at 1 bit is binary (hilt.quant.formats)."""
    return QuantConfig(method=method_for_bits(method, bits), bits=bits, block_size=BLOCK_SIZE)


def _label(method: str, bits: int) -> str:
    return method if bits == 16 else f"{method} {bits}-bit"


def weight_memory_bits(model, config: QuantConfig | None) -> tuple[float, float, int]:
    """(bits of weight memory in all, bits of the quantizable Linears, N = their weights)."""
    layers = fake_quant_layers(model)
    quantized = {f"{p}.weight" for p in layers}
    books = {f"{p}.codebook" for p in layers}  # trained codebooks: counted in the bits per weight
    total, linear, n = 0.0, 0.0, 0
    for name, p in model.named_parameters():
        if name in books:
            continue
        bits = 16.0 * p.numel()
        if name in quantized:
            n += p.numel()
            bits = p.numel() * expected_bits_per_weight(tuple(p.shape), config) if config else bits
            linear += bits
        total += bits
    return total, linear, n


def lr_for(width: int, lr: float | None = None) -> float:
    """The peak learning rate of a width: ``lr`` when given (every width), else LR_BY_WIDTH's."""
    return LR_BY_WIDTH.get(width, DEFAULT_LR) if lr is None else lr


def _one(width: int, method: str | None, bits: int, plan: dict, seed: int, learn_codebook: bool = True,
         lr: float | None = None, task_items: dict | None = None) -> dict:
    from hilt.models.gpt import GPT, CharLM, GPTConfig, corpus, evaluate, train
    from hilt.tasks import downstream

    alphabet, _, val = corpus()
    torch.manual_seed(seed)
    model = GPT(GPTConfig(len(alphabet), block_size=plan["block"], n_layer=plan["layers"], n_head=plan["heads"],
                          n_embd=width))
    steps, lr = plan["steps"], lr_for(width, lr)
    config = None if method is None else config_for(method, bits)
    # 16-bit runs get the same FakeQuantLinear layers (to count N the same way) and never start quantizing
    prepare_qat_(model, config or QuantConfig(method="int", bits=8, block_size=BLOCK_SIZE),
                 learn_codebook=learn_codebook)
    warmup = max(1, int(WARMUP_FRACTION * steps))
    refit_every = 0 if learn_codebook else max(1, (steps - warmup) // (REFITS + 1))
    schedule = QATSchedule(warmup=warmup, refit_every=refit_every, steps=steps)
    events = []

    def after_step(step, loss):
        if config is not None and qat_step_(model, step, schedule):
            events.append(step)

    def lr_at(step):  # 20 steps of linear warm-up, then cosine decay to zero
        return lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / steps))

    start = time.perf_counter()
    opt = torch.optim.AdamW(qat_param_groups(model, weight_decay=0.1), lr=lr, betas=(0.9, 0.95))  # as train()'s
    losses = train(model, steps, lr, plan["batch"], seed=seed, optimizer=opt, lr_at=lr_at, after_step=after_step)
    val_loss = evaluate(model, val, batches=VAL_BATCHES, size=32)
    memory, linear_bits, n = weight_memory_bits(model, config)
    row = {"width": width, "method": method or "16-bit", "bits": bits, "seed": seed, "val_loss": val_loss,
           "train_loss_end": sum(losses[-10:]) / 10, "memory_kib": memory / 8 / 1024, "n_quantizable": n,
           "bits_per_weight": linear_bits / n, "lr": lr,
           "qat_events": events, "seconds": time.perf_counter() - start}
    tasks = ""
    if task_items is not None:
        scores = downstream.score_tasks(CharLM(model.eval(), alphabet), task_items)
        row["tasks"] = downstream.main_scores(scores)
        tasks = "; " + downstream.summary(scores)
    LOG.info(f"  seed {seed} width {width:>4} {row['method']:>7} {bits:>2} bits: validation loss {val_loss:.4f} nats/char, "
             f"weights {row['memory_kib']:.0f} KiB ({row['seconds']:.0f} s){tasks}")
    return row


def _fit_scaling(rows: list[dict]) -> dict | None:
    """L = E + A N^-alpha through the 16-bit runs (E = 0 with fewer than 3 widths); None when the
    losses do not fall with size (a diverged run), so that the runs are still reported."""
    pts = sorted((r["n_quantizable"], r["val_loss"]) for r in rows)
    n = torch.tensor([p[0] for p in pts], dtype=torch.float64)
    loss = torch.tensor([p[1] for p in pts], dtype=torch.float64)
    candidates = [0.0] if len(pts) < 3 else [float(loss.min()) * f for f in torch.linspace(0, 0.99, 199).tolist()]
    best = None
    for e in candidates:
        y, x = torch.log(loss - e), torch.log(n)
        slope, intercept = torch.linalg.lstsq(torch.stack([x, torch.ones_like(x)], 1), y[:, None]).solution[:, 0]
        sse = float(((slope * x + intercept - y) ** 2).sum())
        if best is None or sse < best[0]:
            best = (sse, e, float(math.exp(intercept)), float(-slope))
    _, e, a, alpha = best
    return {"E": e, "A": a, "alpha": alpha} if alpha > 0 else None


def _gamma(rows: list[dict], fit: dict) -> float:
    """gamma minimising the squared error of N_eff/N = 1 - exp(-P/gamma) over the rows (which get
    their n_eff and n_eff_ratio)."""
    pts = []
    for r in rows:
        excess = r["val_loss"] - fit["E"]
        n_eff = (excess / fit["A"]) ** (-1 / fit["alpha"]) if excess > 0 else float("inf")
        r["n_eff"] = n_eff
        r["n_eff_ratio"] = min(n_eff / r["n_quantizable"], 1.0)
        pts.append((r["bits"], r["n_eff_ratio"]))
    grid = torch.logspace(-2, 2, 2001, dtype=torch.float64)
    p = torch.tensor([b for b, _ in pts], dtype=torch.float64)[:, None]
    ratio = torch.tensor([q for _, q in pts], dtype=torch.float64)[:, None]
    sse = ((ratio - (1 - torch.exp(-p / grid))) ** 2).sum(0)
    return float(grid[sse.argmin()])


def _mean_rows(runs: list[dict]) -> list[dict]:
    """One row per (width, format): the seeds' mean validation loss, their spread and every seed's loss."""
    rows = {}
    for run in runs:
        key = (run["width"], run["method"], run["bits"])
        rows.setdefault(key, {k: run[k] for k in ("width", "method", "bits", "memory_kib", "n_quantizable",
                                                 "bits_per_weight", "lr")} | {"val_losses": []})
        rows[key]["val_losses"].append(run["val_loss"])
    for row in rows.values():
        losses = torch.tensor(row["val_losses"], dtype=torch.float64)
        row["val_loss"] = float(losses.mean())
        row["val_loss_std"] = float(losses.std()) if len(losses) > 1 else 0.0
    for key, row in rows.items():
        scored = [run["tasks"] for run in runs if "tasks" in run and (run["width"], run["method"], run["bits"]) == key]
        if scored:
            row["tasks"] = downstream.pooled(scored)
    return list(rows.values())


def _budget_rankings(rows: list[dict]) -> list[dict]:
    """At the weight memory of each 16-bit model: every format's largest width within it, ranked by validation loss
    and by each task's score, and whether a 1-bit format comes first by each."""
    out = []
    for budget in sorted(r["memory_kib"] for r in rows if r["method"] == "16-bit"):
        entries = []
        for method, bits in [("16-bit", 16)] + [(m, b) for m in METHODS for b in BITS]:
            fitting = [r for r in rows if r["method"] == method and r["bits"] == bits
                       and r["memory_kib"] <= budget + 1e-9]
            if fitting:
                r = max(fitting, key=lambda r: r["width"])
                entries.append({"format": _label(method, bits), "bits": bits, "width": r["width"],
                                "memory_kib": r["memory_kib"], "val_loss": r["val_loss"], "tasks": r.get("tasks", {})})
        by = {"val_loss": [e["format"] for e in sorted(entries, key=lambda e: e["val_loss"])]}
        for task in entries[0]["tasks"]:
            by[task] = [e["format"] for e in sorted(entries, key=lambda e: -e["tasks"][task]["score"])]
        one_bit = {e["format"] for e in entries if e["bits"] == 1}
        first = {measure: order[0] for measure, order in by.items()}
        entry = {e["format"]: e for e in entries}
        # a task's winner is clear when the lower end of its interval is above the runner-up's score
        clear = {t: len(by[t]) < 2 or entry[by[t][0]]["tasks"][t]["interval"][0] > entry[by[t][1]]["tasks"][t]["score"]
                 for t in by if t != "val_loss"}
        # a task says nothing where even its best score is not clear of the chance level
        above_chance = {t: entry[by[t][0]]["tasks"][t]["interval"][0] > entry[by[t][0]]["tasks"][t]["chance"]
                        for t in by if t != "val_loss"}
        out.append({"memory_kib": budget, "entries": entries, "ranking": by, "above_chance": above_chance,
                    "one_bit_first": {measure: f in one_bit for measure, f in first.items()}, "clear_first": clear,
                    "rankings_agree": {task: by[task] == by["val_loss"] for task in by if task != "val_loss"}})
    return out


def _row(rows: list[dict], width: int, method: str, bits: int) -> dict:
    return next(r for r in rows if r["width"] == width and r["method"] == method and r["bits"] == bits)


def _kmeans_vs_int(rows: list[dict]) -> list[dict]:
    """k-means against int in every (width, bits) cell: on the seeds' mean, and seed by seed (the same
    seed starts both from the same weights and feeds them the same batches)."""
    versus = []
    for w, b in sorted({(r["width"], r["bits"]) for r in rows if r["method"] == "kmeans"}):
        km, integer = _row(rows, w, "kmeans", b), _row(rows, w, "int", b)
        diffs = [k - i for k, i in zip(km["val_losses"], integer["val_losses"], strict=True)]
        versus.append({"width": w, "bits": b, "kmeans_minus_int": km["val_loss"] - integer["val_loss"],
                       "per_seed": diffs, "kmeans_wins": km["val_loss"] < integer["val_loss"],
                       "seeds_won": sum(d < 0 for d in diffs)})
    return versus


def study(quick: bool = False, seeds=None, lr: float | None = None, learn_codebook: bool = True) -> dict:
    plan = QUICK if quick else FULL
    rates = {w: lr_for(w, lr) for w in plan["widths"]}
    seeds = tuple(plan["seeds"] if seeds is None else seeds)
    if not seeds:
        raise HiltError("the QAT study needs at least one seed")
    codebook = "trained by the loss" if learn_codebook else f"refitted by k-means {REFITS} times"
    LOG.info(f"QAT study: widths {plan['widths']}, {plan['steps']} steps of {plan['batch']} x {plan['block']} characters "
             "each at peak lr " + ", ".join(f"{r:g} (width {w})" for w, r in rates.items())
             + f", bits {BITS} x {METHODS} and 16-bit, seeds {seeds}; k-means codebooks {codebook}")
    from hilt.data.lm_tasks import load_items

    items = load_items()  # every item of every task: the char GPTs read them in seconds
    task_items = {t: items[t] for t in downstream.TASKS}
    runs = []
    for seed in seeds:
        for width in plan["widths"]:
            runs.append(_one(width, None, 16, plan, seed, learn_codebook, lr, task_items))
            for method in METHODS:
                for bits in BITS:
                    runs.append(_one(width, method, bits, plan, seed, learn_codebook, lr, task_items))
    rows = _mean_rows(runs)
    fit = _fit_scaling([r for r in rows if r["method"] == "16-bit"])
    if fit is None:
        gammas = None
        LOG.warning("no scaling fit: the 16-bit losses do not fall with model size (a run diverged? lower --lr)")
    else:
        gammas = {m: _gamma([r for r in rows if r["method"] == m], fit) for m in METHODS}
        widths = sum(r["method"] == "16-bit" for r in rows)
        fixed = f" (E fixed at 0: {widths} widths fit only a power law)" if widths < 3 else ""
        LOG.info(f"  16-bit fit: L = {fit['E']:.3f} + {fit['A']:.3g} N^-{fit['alpha']:.3f}{fixed};  gamma: "
                 + ", ".join(f"{m} {g:.3f}" for m, g in gammas.items()))
    versus = _kmeans_vs_int(rows)
    for v in versus:
        LOG.info(f"  width {v['width']:>4} {v['bits']} bits: k-means - int = {v['kmeans_minus_int']:+.4f} nats/char "
                 f"(k-means lower on {v['seeds_won']} of {len(seeds)} seeds)")
    budgets = []
    for budget in sorted({r["memory_kib"] for r in rows}):
        fitting = [r for r in rows if r["memory_kib"] <= budget + 1e-9]
        best = min(fitting, key=lambda r: r["val_loss"])
        budgets.append({"memory_kib": budget, "winner": f"width {best['width']} {_label(best['method'], best['bits'])}",
                        "val_loss": best["val_loss"]})
    for b in budgets:
        LOG.info(f"  within {b['memory_kib']:7.0f} KiB: best {b['winner']} (loss {b['val_loss']:.4f})")
    rankings = _budget_rankings(rows)
    for b in rankings:
        LOG.info(f"  within {b['memory_kib']:7.0f} KiB, first by loss: {b['ranking']['val_loss'][0]}; by task: "
                 + ", ".join(f"{downstream.LABELS[t]} {order[0]}" for t, order in b["ranking"].items()
                             if t != "val_loss"))
    return {"quick": quick, "seeds": list(seeds), "learn_codebook": learn_codebook, "plan": plan,
            "block_size": BLOCK_SIZE, "lr_by_width": rates, "val_batches": VAL_BATCHES, "rows": rows, "runs": runs,
            "scaling_fit": fit, "gamma": gammas, "kmeans_vs_int": versus, "memory_matched": budgets,
            "task_items": f"{items['work']} (seed {items['seed']}): "
                          + ", ".join(f"{len(task_items[t])} {downstream.LABELS[t]}" for t in downstream.TASKS),
            "budget_rankings": rankings}


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    styles = {"16-bit": ("k", "o"), "kmeans": ("tab:blue", "s"), "int": ("tab:red", "^")}
    for method in SERIES:
        for bits in sorted({r["bits"] for r in result["rows"] if r["method"] == method}):
            pts = sorted((r["memory_kib"], r["val_loss"], r["val_loss_std"]) for r in result["rows"]
                         if r["method"] == method and r["bits"] == bits)
            color, marker = styles[method]
            dash = {1: ":", 2: "--", 4: "-.", 16: "-"}[bits]
            memory, loss, spread = zip(*pts, strict=True)
            ax.errorbar(memory, loss, yerr=spread, color=color, marker=marker, ls=dash, lw=1.3, capsize=2,
                        label=_label(method, bits))
    ax.set_xscale("log")
    ax.set_xlabel("weight memory (KiB, true bits per weight)")
    seeds = len(result["seeds"])
    ax.set_ylabel(f"validation loss (nats/char; mean of {seeds} seed{'s' * (seeds > 1)}, bars: std)")
    g = result["gamma"]
    gammas = f"gamma: k-means {g['kmeans']:.2f}, int {g['int']:.2f}" if g else "no scaling fit"
    ax.set_title(f"QAT on Shakespeare: loss against memory ({gammas})")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render(result: dict) -> str:
    """The study as Markdown: mean validation loss (seeds' std) per width and format, the lower of
    k-means and int in bold, gamma, memory-matched winners."""
    widths = sorted({r["width"] for r in result["rows"]})
    formats = [("16-bit", 16)] + [(m, b) for m in METHODS for b in BITS]
    lines = ["| format | bits/weight | " + " | ".join(f"width {w}" for w in widths) + " |",
             "|---|---|" + "---|" * len(widths)]
    for method, bits in formats:
        rows = {r["width"]: r for r in result["rows"] if r["method"] == method and r["bits"] == bits}
        name = _label(method, bits)
        cells = []
        for w in widths:
            r = rows[w]
            other = RIVAL.get(method)
            rival = _row(result["rows"], w, other, bits) if other else None
            best = rival is not None and r["val_loss"] < rival["val_loss"]
            spread = f" ± {r['val_loss_std']:.3f}" if len(r["val_losses"]) > 1 else ""
            cells.append(f"{'**' if best else ''}{r['val_loss']:.4f}{'**' if best else ''}{spread} "
                         f"({r['memory_kib']:.0f} KiB)")
        bpw = sorted({f"{r['bits_per_weight']:.2f}" for r in rows.values()})  # block scales: a little by width
        bits_text = bpw[0] if len(bpw) == 1 else f"{bpw[0]}-{bpw[-1]}"
        lines.append(f"| {name} | {bits_text} | " + " | ".join(cells) + " |")
    fit, g = result["scaling_fit"], result["gamma"]
    lines += ["", "No scaling fit: the 16-bit losses do not fall with model size." if fit is None else
              f"16-bit fit L = {fit['E']:.3f} + {fit['A']:.3g} N^-{fit['alpha']:.3f}; "
              f"gamma: k-means {g['kmeans']:.3f}, int {g['int']:.3f} (N_eff / N = 1 - exp(-bits / gamma)).", "",
              "| width | bits | k-means - int (mean) | per seed |", "|---|---|---|---|"]
    lines += [f"| {v['width']} | {v['bits']} | {v['kmeans_minus_int']:+.4f} | "
              + ", ".join(f"{d:+.4f}" for d in v["per_seed"]) + " |" for v in result["kmeans_vs_int"]]
    lines += ["", "| weight memory budget | lowest loss within it | loss |", "|---|---|---|"]
    lines += [f"| {b['memory_kib']:.0f} KiB | {b['winner']} | {b['val_loss']:.4f} |" for b in result["memory_matched"]]
    if result.get("budget_rankings"):
        lines += ["", render_tasks(result)]
    return "\n".join(lines) + "\n"


def render_tasks(result: dict) -> str:
    """At each 16-bit model's memory: every format's largest width that fits, its loss and task scores (95%
    intervals over items), the two rankings, and the 1-bit claim judged by each measure."""
    tasks = [t for t in downstream.TASKS if t in result["budget_rankings"][0]["ranking"]]
    chance = {t: result["budget_rankings"][0]["entries"][0]["tasks"][t]["chance"] for t in tasks}
    head = " | ".join(f"{downstream.LABELS[t]} (chance {chance[t]:.3f})" for t in tasks)
    lines = [f"Downstream tasks ({result['task_items']}; main measures: next-line accuracy per character, cloze "
             "exact match, share of 8 continuation tokens before a miss), seeds pooled item by item:"]
    for b in result["budget_rankings"]:
        lines += ["", f"Within {b['memory_kib']:.0f} KiB (a 16-bit model's weight memory):", "",
                  f"| format | width | loss | {head} |", "|---|---|---|" + "---|" * len(tasks)]
        for e in sorted(b["entries"], key=lambda e: e["val_loss"]):
            cells = [f"{e['tasks'][t]['score']:.3f} ({e['tasks'][t]['interval'][0]:.3f}-"
                     f"{e['tasks'][t]['interval'][1]:.3f})" for t in tasks]
            lines.append(f"| {e['format']} | {e['width']} | {e['val_loss']:.4f} | " + " | ".join(cells) + " |")
        verdict = []
        for measure, order in b["ranking"].items():
            name = "loss" if measure == "val_loss" else downstream.LABELS[measure]
            agree = "" if measure == "val_loss" else \
                ((" (clear of the runner-up)" if b["clear_first"][measure] else " (within the runner-up's noise)")
                 + (", same order as by loss" if b["rankings_agree"][measure] else ", an order other than by loss"))
            if measure != "val_loss" and not b["above_chance"][measure]:
                verdict.append(f"by {name}: no verdict, no format clear of chance")
                continue
            verdict.append(f"by {name}: {order[0]} first, 1-bit wins: "
                           f"{'holds' if b['one_bit_first'][measure] else 'does not hold'}{agree}")
        lines += ["", "; ".join(verdict) + "."]
    return "\n".join(lines)
