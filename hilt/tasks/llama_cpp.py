"""llama.cpp as the judge of `hilt export gguf`: its own tools read the exported file, and their
perplexity, tokenization and greedy text are compared with hilt's reading of the same file.

The tools are built once by ``scripts/build_llama_cpp.sh`` into ``$HILT_LLAMA_CPP/bin`` (default
``~/.cache/hilt/llama.cpp/bin``); nothing here downloads or builds. Each tool runs on one thread:
llama.cpp's thread pool spins while it waits, which on a busy machine costs far more than it gains.

Perplexity the way ``llama-perplexity`` computes it: the text tokenized whole (a BOS first only when
the vocabulary asks for one; SmolLM2's does not), cut into chunks of ``context`` tokens, each chunk
run fresh (its first token replaced by BOS when the vocabulary adds one), and only the second half
of each chunk scored, every token there predicted from at least ``context / 2`` tokens before it.
:func:`perplexity_as_llama_cpp` scores hilt's forward the same way, so the two numbers are the same
statistic on the same tokens. (`hilt eval ppl` scores every token of non-overlapping windows, a
different and higher number.)
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import tempfile
from pathlib import Path

from hilt.errors import HiltError

TOOLS = ("llama-perplexity", "llama-completion", "llama-tokenize", "llama-simple", "llama-bench")


def tools_dir() -> Path:
    return Path(os.environ.get("HILT_LLAMA_CPP", Path.home() / ".cache" / "hilt" / "llama.cpp")) / "bin"


def tool(name: str) -> Path | None:
    """A built llama.cpp tool, or None."""
    path = tools_dir() / name
    return path if path.is_file() and os.access(path, os.X_OK) else None


def missing_tools() -> list[str]:
    return [t for t in TOOLS if tool(t) is None]


def run_tool(name: str, args: list, timeout: int = 900) -> tuple[str, str]:
    """(stdout, stderr) of the llama.cpp tool ``name`` run on ``args``; a missing tool or a failure is one line."""
    exe = tool(name)
    if exe is None:
        raise HiltError(f"{name}: not built; run scripts/build_llama_cpp.sh (tools go to {tools_dir()})")
    r = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise HiltError(f"{name} failed on {args[1] if len(args) > 1 else args} (exit {r.returncode}): {tail}")
    return r.stdout, r.stderr


def llama_perplexity(gguf, text_file, context: int, chunks: int) -> float:
    """``llama-perplexity``'s final estimate over the first ``chunks`` chunks of ``context`` tokens."""
    out = run_tool("llama-perplexity", ["-m", gguf, "-f", text_file, "-c", context, "-b", context, "--chunks", chunks,
                                    "-t", 1, "-tb", 1, "--no-warmup"])
    text = "\n".join(out)
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", text)
    if m is not None:
        return float(m.group(1))
    # tools built elsewhere (without the build script's drain of the log thread at exit) can lose the last line;
    # the running estimate after the last chunk is the same number
    m = re.search(rf"\[{chunks}\]([0-9.]+),", text)
    if m is None:
        raise HiltError(f"llama-perplexity on {gguf}: no final estimate in its output")
    return float(m.group(1))


def llama_tokenize(gguf, text: str) -> list[int]:
    """The token ids llama.cpp gives ``text`` (special tokens not parsed, no BOS added)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8", delete=False) as f:
        f.write(text)
    try:
        out, _ = run_tool("llama-tokenize", ["-m", gguf, "-f", f.name, "--ids", "--no-bos", "--log-disable"])
    finally:
        os.unlink(f.name)
    m = re.search(r"^\[([0-9, ]*)\]\s*$", out, re.M)
    if m is None:
        raise HiltError(f"llama-tokenize on {gguf}: no id list in its output")
    return [int(x) for x in m.group(1).split(",") if x.strip()]


def llama_generate(gguf, prompt: str, new_tokens: int) -> str:
    """Greedy continuation of ``prompt`` by ``llama-completion`` (the new text only)."""
    out, _ = run_tool("llama-completion", ["-m", gguf, "-p", prompt, "-n", new_tokens, "--temp", 0, "-t", 1, "-tb", 1,
                                    "-no-cnv", "-c", 256, "--no-warmup", "--no-display-prompt"])
    return out.removesuffix("\n\n")  # the tool ends its text with a blank line


def _high_water(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        return None


def llama_bench(gguf, new_tokens: int = 32) -> dict:
    """``llama-bench``'s greedy decode rate (one thread, ``new_tokens`` generated, no prompt) and the peak
    resident memory of its process: its VmHWM, read every 20 ms while it runs (Linux; None elsewhere).
    (The rusage of a child counts the parent's memory at the fork, so it is not used.)"""
    import json
    import time

    exe = tool("llama-bench")
    if exe is None:
        raise HiltError(f"llama-bench: not built; run scripts/build_llama_cpp.sh (tools go to {tools_dir()})")
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([str(exe), "-m", str(gguf), "-p", "0", "-n", str(new_tokens), "-r", "1", "-t", "1",
                                 "-o", "json"], stdout=out, stderr=err, text=True)
        peak = None
        while proc.poll() is None:
            peak = max(filter(None, [peak, _high_water(proc.pid)]), default=None)
            time.sleep(0.02)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise HiltError(f"llama-bench failed on {gguf} (exit {proc.returncode}): "
                            + ((err.read().strip().splitlines() or ["no output"])[-1]))
        runs = json.loads(out.read())
    return {"tokens_per_s": float(runs[0]["avg_ts"]), "peak_rss_bytes": peak}


def perplexity_as_llama_cpp(forward, ids: list[int], context: int, chunks: int, bos: int | None = None) -> float:
    """llama-perplexity's statistic for hilt's ``forward`` (token ids (1, T) -> logits (1, T, V))."""
    import torch
    import torch.nn.functional as F

    if len(ids) < chunks * context or context < 4:
        raise HiltError(f"perplexity needs {chunks} chunks of {context} tokens; the text has {len(ids)}")
    first, nll, count = context // 2, 0.0, 0
    with torch.inference_mode():
        for c in range(chunks):
            chunk = torch.tensor(ids[c * context:(c + 1) * context])
            if bos is not None:
                chunk[0] = bos
            logits = forward(chunk[None])[0].float()
            nll += F.cross_entropy(logits[first:-1], chunk[first + 1:], reduction="sum").item()
            count += context - 1 - first
    return math.exp(nll / count)


def check_gguf(gguf, text: str, context: int = 512, chunks: int = 4, prompt: str = "The king said",
               new_tokens: int = 32, tolerance: float | None = None, model=None, hilt_text: bool = False) -> dict:
    """llama.cpp and hilt on the same GGUF file: perplexity (llama-perplexity's statistic), the tokens of
    ``text``, and llama.cpp's greedy continuation of ``prompt`` judged by hilt's logits (:func:`greedy_gaps`):
    equal up to the first difference, and every token llama.cpp chose within ``tolerance`` logits of hilt's
    top one (default GREEDY_TOLERANCE; 0 for a dense export, whose products llama.cpp does not round).
    Teacher-forced on llama.cpp's tokens, the equal prefix is where hilt's own greedy text would part.
    ``model``: hilt's (Llama, tokenizer) of these weights, already loaded; ``hilt_text``: also hilt's
    greedy text, for reading."""
    from hilt.models import llama

    gguf = Path(gguf)
    net, tokenizer = model or llama.load_llama(gguf)
    hilt_ids = tokenizer.encode(text)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8", delete=False) as f:
        f.write(text)
    try:
        ppl_cpp = llama_perplexity(gguf, f.name, context, chunks)
    finally:
        os.unlink(f.name)
    cpp_ids = llama_tokenize(gguf, text)
    same = sum(1 for a, b in zip(hilt_ids, cpp_ids) if a == b) if len(hilt_ids) == len(cpp_ids) else None
    ppl_hilt = perplexity_as_llama_cpp(net, hilt_ids, context, chunks)
    # trailing whitespace dropped: the tool ends its output with blank lines of its own, which would
    # make the last newline token ambiguous
    text_cpp = llama_generate(gguf, prompt, new_tokens).rstrip()
    text_hilt = llama.generate(net, tokenizer, prompt, max_new_tokens=new_tokens) if hilt_text else None
    rows = greedy_gaps(net, tokenizer, prompt, text_cpp, new_tokens)
    verdict = greedy_agreement(rows, GREEDY_TOLERANCE if tolerance is None else tolerance)
    return {"gguf": str(gguf), "bytes": gguf.stat().st_size, "context": context, "chunks": chunks,
            "ppl_llama_cpp": ppl_cpp, "ppl_hilt": ppl_hilt, "ppl_rel_diff": ppl_cpp / ppl_hilt - 1,
            "tokens_hilt": len(hilt_ids), "tokens_llama_cpp": len(cpp_ids),
            "tokens_identical": hilt_ids == cpp_ids, "tokens_same_position": same,
            "prompt": prompt, "text_llama_cpp": text_cpp, "text_hilt": text_hilt,
            "generated_tokens_agreeing": verdict["equal_prefix"], "generated_tokens": len(rows), **verdict}


# ------------------------------------------------------------------ greedy text: where and why it parts

# llama.cpp's CPU matrix products convert the activations to the weight type's "vec_dot" partner first:
# Q4_0 and Q8_0 weights multiply Q8_0 activations, Q4_1 weights Q8_1 (the same values, plus a block sum),
# BF16 weights bf16 activations; F32 weights multiply float32 activations unchanged.
# How far (in logits) a token llama.cpp chooses greedily may lie below hilt's top one on a quantized export:
# over 1,020 Hamlet positions of the SmolLM2 int4 exports (Q4_0 with a BF16 or a Q8_0 embedding), the
# rounding above changed the margin between hilt's top two logits by at most 0.54 (median 0.07), so
# only a near-tie within that can flip; a larger gap means llama.cpp computes something else.
GREEDY_TOLERANCE = 0.6

ACTIVATIONS = {"Q4_0": "q8", "Q8_0": "q8", "Q4_1": "q8", "BF16": "bf16", "F16": "f16", "F32": None}


def round_activations(x, kind: str | None):
    """``x`` (..., K) rounded as llama.cpp rounds a matrix product's input for weights of type ``kind``
    (an ACTIVATIONS value): q8 is blocks of 32 along K, d = max|x| / 127 stored as fp16, x = d round(x / d)."""
    import torch

    if kind is None:
        return x
    if kind in ("bf16", "f16"):
        return x.to(torch.bfloat16 if kind == "bf16" else torch.float16).to(x.dtype)
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.round(blocks * torch.where(d > 0, 1 / d, torch.zeros_like(d)))
    return (q * d.half().to(x.dtype)).reshape(x.shape)


def simulate_llama_cpp_rounding(net, gguf) -> None:
    """Make hilt's Llama ``net`` (loaded from ``gguf``) round every matrix product's input as llama.cpp's
    CPU path does for that file's tensor types (the tied head included). In place; for measurement."""
    import gguf as gg

    types = {t.name: t.tensor_type.name for t in gg.GGUFReader(str(gguf)).tensors}
    for i, block in enumerate(net.blk):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            kind = ACTIVATIONS[types[f"blk.{i}.{part}.weight"]]
            getattr(block, part).register_forward_pre_hook(lambda _m, args, kind=kind: (round_activations(args[0], kind),))
    head, kind = net.head, ACTIVATIONS[types.get("output.weight", types["token_embd.weight"])]
    net.head = lambda h: head(round_activations(h, kind))


def greedy_gaps(net, tokenizer, prompt: str, continuation: str, new_tokens: int) -> list[dict]:
    """hilt's logits along another program's greedy ``continuation`` of ``prompt``, teacher-forced: per
    position, hilt's top token, the margin between hilt's top two logits, and ``gap``, how far the other
    program's token lies below hilt's top logit (0 where they agree)."""
    import torch

    head = tokenizer.encode(prompt)
    cont = tokenizer.encode(continuation)[:new_tokens]
    with torch.inference_mode():
        logits = net(torch.tensor([head + cont]))[0, len(head) - 1:-1].float()
    top2 = logits.topk(2, dim=-1)
    rows = []
    for i, tok in enumerate(cont):
        best = float(top2.values[i, 0])
        rows.append({"token": tok, "hilt_top": int(top2.indices[i, 0]),
                     "margin": best - float(top2.values[i, 1]), "gap": best - float(logits[i, tok])})
    return rows


def greedy_agreement(rows: list[dict], tolerance: float) -> dict:
    """The verdict on :func:`greedy_gaps`: the tokens equal up to the first difference, the margin hilt had
    there, and whether every token the other program chose is within ``tolerance`` of hilt's top logit
    (a near-tie that rounding can flip) rather than a choice hilt's logits rule out."""
    first = next((i for i, r in enumerate(rows) if r["gap"] > 0), len(rows))
    worst = max((r["gap"] for r in rows), default=0.0)
    return {"equal_prefix": first, "margin_at_first_difference": rows[first]["margin"] if first < len(rows) else None,
            "gap_at_first_difference": rows[first]["gap"] if first < len(rows) else None,
            "largest_gap": worst, "tolerance": tolerance, "within_tolerance": worst <= tolerance}
