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


def _run(name: str, args: list, timeout: int = 900) -> tuple[str, str]:
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
    out = _run("llama-perplexity", ["-m", gguf, "-f", text_file, "-c", context, "-b", context, "--chunks", chunks,
                                    "-t", 1, "-tb", 1, "--no-warmup"])
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", "\n".join(out))
    if m is None:
        raise HiltError(f"llama-perplexity on {gguf}: no final estimate in its output")
    return float(m.group(1))


def llama_tokenize(gguf, text: str) -> list[int]:
    """The token ids llama.cpp gives ``text`` (special tokens not parsed, no BOS added)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8", delete=False) as f:
        f.write(text)
    try:
        out, _ = _run("llama-tokenize", ["-m", gguf, "-f", f.name, "--ids", "--no-bos", "--log-disable"])
    finally:
        os.unlink(f.name)
    m = re.search(r"^\[([0-9, ]*)\]\s*$", out, re.M)
    if m is None:
        raise HiltError(f"llama-tokenize on {gguf}: no id list in its output")
    return [int(x) for x in m.group(1).split(",") if x.strip()]


def llama_generate(gguf, prompt: str, new_tokens: int) -> str:
    """Greedy continuation of ``prompt`` by ``llama-completion`` (the new text only)."""
    out, _ = _run("llama-completion", ["-m", gguf, "-p", prompt, "-n", new_tokens, "--temp", 0, "-t", 1, "-tb", 1,
                                    "-no-cnv", "-c", 256, "--no-warmup", "--no-display-prompt"])
    return out.removesuffix("\n\n")  # the tool ends its text with a blank line


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
               new_tokens: int = 32) -> dict:
    """llama.cpp and hilt on the same GGUF file: perplexity (llama-perplexity's statistic), the tokens of
    ``text``, and the greedy continuation of ``prompt``."""
    from hilt.models import llama

    gguf = Path(gguf)
    net, tokenizer = llama.load_llama(gguf)
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
    text_cpp = llama_generate(gguf, prompt, new_tokens)
    text_hilt = llama.generate(net, tokenizer, prompt, max_new_tokens=new_tokens)
    gen_cpp, gen_hilt = tokenizer.encode(text_cpp)[:new_tokens], tokenizer.encode(text_hilt)[:new_tokens]
    agree = next((i for i, (a, b) in enumerate(zip(gen_cpp, gen_hilt)) if a != b), min(len(gen_cpp), len(gen_hilt)))
    return {"gguf": str(gguf), "bytes": gguf.stat().st_size, "context": context, "chunks": chunks,
            "ppl_llama_cpp": ppl_cpp, "ppl_hilt": ppl_hilt, "ppl_rel_diff": ppl_cpp / ppl_hilt - 1,
            "tokens_hilt": len(hilt_ids), "tokens_llama_cpp": len(cpp_ids),
            "tokens_identical": hilt_ids == cpp_ids, "tokens_same_position": same,
            "prompt": prompt, "text_llama_cpp": text_cpp, "text_hilt": text_hilt,
            "generated_tokens_agreeing": agree, "generated_tokens": len(gen_hilt)}
