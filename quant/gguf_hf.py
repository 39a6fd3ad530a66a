"""GGUF metadata, vocabulary and tensor layout from a Hugging Face Llama-family folder, for
`hilt export gguf` of a checkpoint quantized from such a folder.

What llama.cpp needs and where it comes from:

* hyperparameters from config.json: ``llama.block_count`` (num_hidden_layers), ``context_length``
  (max_position_embeddings), ``embedding_length`` (hidden_size), ``feed_forward_length``
  (intermediate_size), ``attention.head_count`` / ``head_count_kv``, ``rope.freq_base``
  (rope_theta), ``rope.dimension_count`` (head_dim), ``attention.layer_norm_rms_epsilon``,
  ``vocab_size``; linear rope scaling as ``rope.scaling.*``; other rope scalings are refused;
* the vocabulary from tokenizer.json (byte-level BPE only: ``tokenizer.ggml.model = gpt2``): the
  tokens in id order, the merges as "a b" strings, the token types (added special tokens are
  control tokens, other added tokens user-defined, the rest normal), the special token ids and
  add_bos/add_eos from tokenizer_config.json, the chat template;
* ``tokenizer.ggml.pre``, the name of the pre-tokenizer llama.cpp applies, read from the
  tokenizer.json's pre-tokenizer structure: ByteLevel with its regex alone is "gpt-2", individual
  digits then ByteLevel is "smollm"; any other structure is refused rather than guessed;
* tensor names through the ``gguf`` package's own map of Hugging Face names; q_proj and k_proj rows
  reordered from Hugging Face's rotate-half layout to llama.cpp's interleaved rope pairs (within each
  head, row 2i+j of the GGUF tensor is row j*half + i of the Hugging Face one). Quantized blocks run
  along rows, so the reordering moves whole rows of blocks and stays exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hilt.errors import HiltError
from hilt.quant.hf_folder import CONFIG, read_config

ARCHITECTURES = {"llama": "llama"}  # model_type -> GGUF architecture (Llama-family layout and rope)


def _read_json(path: Path, required: bool = True) -> dict:
    if not path.is_file():
        if required:
            raise HiltError(f"{path}: missing; the GGUF export builds its vocabulary from it")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise HiltError(f"{path}: not readable JSON ({e})") from None


def _pre_tokenizer(pre: dict | None, where: Path) -> str:
    """llama.cpp's name for the tokenizer.json pre-tokenizer, from its structure."""
    steps = (pre or {}).get("pretokenizers", [pre]) if (pre or {}).get("type") == "Sequence" else [pre]
    kinds = [(s or {}).get("type") for s in steps]
    byte_level = steps[-1] if kinds and kinds[-1] == "ByteLevel" else None
    if byte_level is not None and byte_level.get("use_regex", True) and not byte_level.get("add_prefix_space"):
        if kinds == ["ByteLevel"]:
            return "gpt-2"
        if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
            return "smollm"
    raise HiltError(f"{where}: pre-tokenizer {' + '.join(map(str, kinds))} has no llama.cpp equivalent known "
                    "here (known: ByteLevel, Digits(individual) + ByteLevel)")


def _token_id(value, vocab: dict, where: Path, key: str) -> int | None:
    if value is None:
        return None
    text = value.get("content") if isinstance(value, dict) else value
    if text not in vocab:
        raise HiltError(f"{where}: {key} {text!r} is not in the vocabulary")
    return vocab[text]


def write_hf_metadata(folder, writer, name_hint: str) -> dict:
    """Add the folder's hyperparameters and vocabulary to the GGUF ``writer``; returns the config."""
    import gguf

    folder = Path(folder)
    config = read_config(folder)
    where = folder / CONFIG
    if config.get("model_type") not in ARCHITECTURES:
        raise HiltError(f"{where}: model_type {config.get('model_type')!r}; the GGUF export of Hugging Face folders "
                        f"supports {', '.join(ARCHITECTURES)}")
    try:
        n_head = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        named = config.get("_name_or_path") or config.get("_model_name_or_path")
        writer.add_name(Path(str(named)).name if named else name_hint)
        writer.add_block_count(int(config["num_hidden_layers"]))
        writer.add_context_length(int(config.get("max_position_embeddings", 2048)))
        writer.add_embedding_length(hidden)
        writer.add_feed_forward_length(int(config["intermediate_size"]))
        writer.add_head_count(n_head)
        writer.add_head_count_kv(int(config.get("num_key_value_heads") or n_head))
        # transformers 5 keeps rope settings under rope_parameters, 4.x at the top level
        rope = dict(config.get("rope_scaling") or {}) | dict(config.get("rope_parameters") or {})
        writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
        writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
        writer.add_rope_dimension_count(int(config.get("head_dim") or hidden // n_head))
        writer.add_vocab_size(int(config["vocab_size"]))
    except (KeyError, TypeError, ValueError) as e:
        raise HiltError(f"{where}: not a Llama config ({type(e).__name__}: {e})") from None
    kind = rope.get("rope_type", rope.get("type"))
    if kind not in (None, "default"):
        if kind != "linear":
            raise HiltError(f"{where}: rope scaling {kind!r} is not written to GGUF here (linear only)")
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    tok_path = folder / "tokenizer.json"
    tok = _read_json(tok_path)
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise HiltError(f"{tok_path}: a {model.get('type')!r} tokenizer; the GGUF export writes byte-level BPE only")
    vocab = dict(model["vocab"])
    added = {a["content"]: a for a in tok.get("added_tokens", [])}
    for a in added.values():
        vocab.setdefault(a["content"], a["id"])
    size = max(int(config["vocab_size"]), max(vocab.values()) + 1)
    tokens, types = [f"[PAD{i}]" for i in range(size)], [gguf.TokenType.UNUSED] * size
    for text, i in vocab.items():
        tokens[i] = text
        a = added.get(text)
        types[i] = (gguf.TokenType.NORMAL if a is None else
                    gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(tok.get("pre_tokenizer"), tok_path))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)

    tconf_path = folder / "tokenizer_config.json"
    tconf = _read_json(tconf_path, required=False)
    gen = _read_json(folder / "generation_config.json", required=False)
    ids = {key: _token_id(tconf.get(f"{key}_token"), vocab, tconf_path, f"{key}_token")
           for key in ("bos", "eos", "unk", "pad")}
    for key, fallback in (("bos", "bos_token_id"), ("eos", "eos_token_id")):
        if ids[key] is None:
            value = gen.get(fallback, config.get(fallback))
            ids[key] = value[0] if isinstance(value, list) else value
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                     ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
        if ids[key] is not None:
            add(int(ids[key]))
    writer.add_add_bos_token(bool(tconf.get("add_bos_token", False)))
    writer.add_add_eos_token(bool(tconf.get("add_eos_token", False)))
    template = tconf.get("chat_template")
    jinja = folder / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    if template:
        writer.add_chat_template(template)
    return config


class TensorLayout:
    """Hugging Face tensor names -> GGUF names, and the rope row order llama.cpp expects for q and k."""

    def __init__(self, config: dict):
        import gguf

        self.blocks = int(config["num_hidden_layers"])
        self.n_head = int(config["num_attention_heads"])
        self.n_head_kv = int(config.get("num_key_value_heads") or self.n_head)
        self.map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, self.blocks)

    def name(self, hf_name: str) -> str:
        got = self.map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if got is None:
            raise HiltError(f"'{hf_name}': no GGUF name for this Llama tensor")
        return got

    def rows(self, hf_name: str, n_rows: int) -> np.ndarray | None:
        """The row order of the GGUF tensor (an index into the Hugging Face rows), or None to keep it."""
        if hf_name.endswith("self_attn.q_proj.weight"):
            heads = self.n_head
        elif hf_name.endswith("self_attn.k_proj.weight"):
            heads = self.n_head_kv
        else:
            return None
        half = n_rows // heads // 2
        # GGUF row (h, i, j) (head, pair, member) comes from Hugging Face row (h, j, i)
        return np.arange(n_rows).reshape(heads, 2, half).transpose(0, 2, 1).reshape(-1)
