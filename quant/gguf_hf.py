"""GGUF metadata, vocabulary and tensor layout from a Hugging Face folder (Llama, Gemma 3), for
`hilt export gguf` of a checkpoint quantized from such a folder.

What llama.cpp needs and where it comes from:

* the architecture from config.json's ``model_type``: ``llama`` -> GGUF ``llama``; ``gemma3_text``
  (Gemma3ForCausalLM) and ``gemma3`` (its text model, under ``text_config``; the vision tower is not
  written) -> GGUF ``gemma3``. Anything else is refused before a weight is read;
* hyperparameters from config.json: ``{arch}.block_count`` (num_hidden_layers), ``context_length``
  (max_position_embeddings), ``embedding_length`` (hidden_size), ``feed_forward_length``
  (intermediate_size), ``attention.head_count`` / ``head_count_kv``, ``attention.layer_norm_rms_epsilon``,
  ``vocab_size``; Llama: ``rope.freq_base`` (rope_theta), ``rope.dimension_count`` (head_dim), linear
  rope scaling as ``rope.scaling.*`` (other scalings refused); Gemma 3: ``attention.key_length`` /
  ``value_length`` (head_dim), ``rope.freq_base`` of the global layers and ``rope.freq_base_swa`` of the
  sliding ones, ``attention.sliding_window``, the per-layer sliding pattern (an array of booleans, written
  only where ``layer_types`` differs from llama.cpp's default of every sixth layer global),
  ``final_logit_softcapping``. llama.cpp derives Gemma 3's query scale from the shapes
  (1/sqrt(head_dim), or 1/sqrt(hidden/heads) for the 62-layer model), so a ``query_pre_attn_scalar``
  that gives another scale is refused, as are attention softcapping, biases, bidirectional attention
  and another activation than tanh-approximated GELU;
* the vocabulary from tokenizer.json (tokens in id order, the special token ids and add_bos/add_eos from
  tokenizer_config.json or, failing that, the post-processor's template; the chat template):
  - byte-level BPE -> ``tokenizer.ggml.model = gpt2`` with the merges as "a b" strings and
    ``tokenizer.ggml.pre`` read from the pre-tokenizer's structure: ByteLevel with its regex alone is
    "gpt-2", individual digits then ByteLevel is "smollm"; any other structure is refused;
  - SentencePiece-style BPE (byte fallback, spaces replaced by "▁", no word splitting: Gemma's, Llama 2's)
    -> ``tokenizer.ggml.model = llama`` with a score per token and the token types. llama.cpp merges, again
    and again, the adjacent pair whose joined piece scores highest; transformers applies merges in list
    order. A token's score is therefore minus the position of the first merge that makes it, and the
    merge list must hold every split of a token into two vocabulary pieces (as SentencePiece conversions
    write it), or llama.cpp could make a token transformers never makes: such a list is refused.
    ``<0xNN>`` tokens are BYTE, added special tokens CONTROL, other added tokens USER_DEFINED (with "▁"
    written as the space it stands for when transformers matches them after normalizing, since
    llama.cpp matches them in the raw text), ``add_space_prefix`` from a Prepend("▁") normalizer or
    Metaspace's prepend scheme;
* tensor names through the ``gguf`` package's own map of Hugging Face names. Llama: q_proj and k_proj
  rows reordered from Hugging Face's rotate-half layout to llama.cpp's interleaved rope pairs (within
  each head, row 2i+j of the GGUF tensor is row j*half + i of the Hugging Face one); quantized blocks run
  along rows, so the reordering moves whole rows of blocks and stays exact. Gemma 3 keeps the row order
  (llama.cpp ropes it rotate-half, as transformers does) and stores every RMSNorm weight w as 1 + w
  (transformers' Gemma3RMSNorm multiplies by 1 + w, llama.cpp by the weight), in float32.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from hilt.errors import HiltError
from hilt.quant.hf_folder import CONFIG, read_config

# model_type -> GGUF architecture
ARCHITECTURES = {"llama": "llama", "gemma3_text": "gemma3", "gemma3": "gemma3"}
SPACE = "\u2581"  # SentencePiece's visible space
# Gemma 3 (multimodal folder): where its text model's weights live, and the tensors a text GGUF leaves out
_GEMMA3_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                         ("language_model.lm_head.", "lm_head."))
_GEMMA3_OTHER_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                          "multi_modal_projector.")


def _read_json(path: Path, required: bool = True) -> dict:
    if not path.is_file():
        if required:
            raise HiltError(f"{path}: missing; the GGUF export builds its vocabulary from it")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise HiltError(f"{path}: not readable JSON ({e})") from None


def gguf_architecture(folder) -> tuple[str, dict]:
    """(GGUF architecture, the text model's config) of a Hugging Face folder, from config.json alone;
    any other model type is refused in one line."""
    folder = Path(folder)
    config = read_config(folder)
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        archs = ", ".join(map(str, config.get("architectures") or [])) or "no architectures listed"
        raise HiltError(f"{folder / CONFIG}: model_type {model_type!r} ({archs}); the GGUF export of Hugging Face "
                        f"folders supports Llama (model_type llama) and Gemma 3 (gemma3_text, gemma3)")
    if model_type == "gemma3":  # the multimodal folder: its language model
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise HiltError(f"{folder / CONFIG}: model_type 'gemma3' without a text_config")
        config = {**text, "model_type": "gemma3_text", "_multimodal": True,
                  "_name_or_path": config.get("_name_or_path")}
    return ARCHITECTURES[model_type], config


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


def _steps(part: dict | None) -> list[dict]:
    if not part:
        return []
    if part.get("type") != "Sequence":
        return [part]
    return list(part.get("normalizers") or part.get("pretokenizers") or [])


def _pattern(step: dict) -> str | None:
    pattern = step.get("pattern")
    return pattern.get("String") if isinstance(pattern, dict) else None


def _sentencepiece_spaces(tok: dict, where: Path) -> tuple[bool, bool]:
    """(add_space_prefix, added tokens see "▁" for a space) of a SentencePiece-style tokenizer.json:
    spaces become "▁" by a Replace normalizer (after an optional Prepend("▁")) with no word splitting, or
    by a Metaspace pre-tokenizer that does not split; any other structure is refused."""
    norms, pres = _steps(tok.get("normalizer")), _steps(tok.get("pre_tokenizer"))
    kinds = [s.get("type") for s in norms] + [s.get("type") for s in pres]
    replace = [s for s in norms if s.get("type") == "Replace" and _pattern(s) == " " and s.get("content") == SPACE]
    prepend = [s for s in norms if s.get("type") == "Prepend" and s.get("prepend") == SPACE]
    if replace and len(replace) + len(prepend) == len(norms) and (not prepend or norms[0] is prepend[0]):
        # after the Replace no space is left, so a Split on " " (transformers' Gemma tokenizer) does nothing
        if all(s.get("type") == "Split" and _pattern(s) == " " for s in pres):
            return bool(prepend), True
    if not norms and len(pres) == 1 and pres[0].get("type") == "Metaspace" and pres[0].get("replacement") == SPACE \
            and not pres[0].get("split", True):
        scheme = pres[0].get("prepend_scheme", "always" if pres[0].get("add_prefix_space", True) else "never")
        return scheme != "never", False
    steps = " + ".join(map(str, kinds)) or "none"
    raise HiltError(f"{where}: a byte-fallback BPE whose normalizer and pre-tokenizer ({steps}) are not "
                    "SentencePiece's (spaces replaced by '\u2581', no word splitting); no llama.cpp equivalent known")


def _write_sentencepiece(tok: dict, where: Path, size: int, writer) -> dict[str, int]:
    """tokenizer.json's byte-fallback BPE as llama.cpp's SentencePiece vocabulary; returns text -> id."""
    import gguf

    model = tok["model"]
    add_prefix, added_normalized = _sentencepiece_spaces(tok, where)
    pieces = dict(model["vocab"])
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    first: dict[str, int] = {}
    for rank, (a, b) in enumerate(merges):
        first.setdefault(a + b, rank)
    added = {a["content"]: a for a in tok.get("added_tokens", [])}
    byte = re.compile(r"<0x[0-9A-F]{2}>")
    # llama.cpp can join any two adjacent pieces that make a vocabulary piece; transformers only the listed pairs
    listed = set(merges)
    for text in pieces:
        if text in added or byte.fullmatch(text) or len(text) < 2:
            continue
        for i in range(1, len(text)):
            a, b = text[:i], text[i:]
            if a in pieces and b in pieces and (a, b) not in listed:
                raise HiltError(f"{where}: the merges lack {a!r} + {b!r} -> {text!r}; llama.cpp's SentencePiece "
                                "tokenizer would join them where transformers does not (the merges must list every "
                                "split of a token into two pieces, as SentencePiece conversions write them)")
    vocab = dict(pieces)
    for a in added.values():
        vocab.setdefault(a["content"], a["id"])
    tokens = [f"[PAD{i}]" for i in range(size)]
    scores = [-1e9] * size  # the padding rows never win a merge
    types = [gguf.TokenType.UNUSED] * size
    unk = model.get("unk_token")
    for text, i in vocab.items():
        a = added.get(text)
        score, kind = 0.0, gguf.TokenType.NORMAL
        if a is not None:
            kind = gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED
            if kind == gguf.TokenType.USER_DEFINED and a.get("normalized", True) and added_normalized:
                text = text.replace(SPACE, " ")  # transformers matches it after spaces became "▁"
        elif byte.fullmatch(text):
            kind = gguf.TokenType.BYTE
        elif text == unk:
            kind = gguf.TokenType.UNKNOWN
        else:
            score = -float(first.get(text, len(merges)))
        tokens[i], scores[i], types[i] = text, score, kind
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(add_prefix)
    return vocab


def _write_byte_level(tok: dict, where: Path, size: int, writer) -> dict[str, int]:
    """tokenizer.json's byte-level BPE as llama.cpp's gpt2 vocabulary; returns text -> id."""
    import gguf

    model = tok["model"]
    vocab = dict(model["vocab"])
    added = {a["content"]: a for a in tok.get("added_tokens", [])}
    for a in added.values():
        vocab.setdefault(a["content"], a["id"])
    tokens, types = [f"[PAD{i}]" for i in range(size)], [gguf.TokenType.UNUSED] * size
    for text, i in vocab.items():
        tokens[i] = text
        a = added.get(text)
        types[i] = (gguf.TokenType.NORMAL if a is None else
                    gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(tok.get("pre_tokenizer"), where))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    return vocab


def _template_adds(tok: dict, token: str | None, at_start: bool) -> bool:
    """Whether tokenizer.json's post-processor puts ``token`` first (last) in a single sequence."""
    post = tok.get("post_processor") or {}
    for step in post.get("processors") or [] if post.get("type") == "Sequence" else [post]:
        single = step.get("single") if step.get("type") == "TemplateProcessing" else None
        if single:
            end = single[0] if at_start else single[-1]
            return token is not None and (end.get("SpecialToken") or {}).get("id") == token
    return False


def _write_vocabulary(folder: Path, config: dict, writer) -> None:
    tok_path = folder / "tokenizer.json"
    tok = _read_json(tok_path)
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise HiltError(f"{tok_path}: a {model.get('type')!r} tokenizer; the GGUF export writes BPE vocabularies "
                        "(byte-level, or SentencePiece-style with byte fallback) only")
    ids = [a["id"] for a in tok.get("added_tokens", [])] + list(model["vocab"].values())
    size = max(int(config["vocab_size"]), max(ids) + 1)
    if model.get("byte_fallback"):
        vocab = _write_sentencepiece(tok, tok_path, size, writer)
    else:
        vocab = _write_byte_level(tok, tok_path, size, writer)

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
    text_of = {i: t for t, i in vocab.items()}
    # transformers 5 keeps add_bos in the post-processor's template rather than in tokenizer_config.json
    for key, add, first in (("bos", writer.add_add_bos_token, True), ("eos", writer.add_add_eos_token, False)):
        flag = tconf.get(f"add_{key}_token")
        add(bool(flag) if flag is not None else _template_adds(tok, text_of.get(ids[key]), first))
    template = tconf.get("chat_template")
    jinja = folder / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    if template:
        writer.add_chat_template(template)


def _rope(config: dict, layer_type: str | None = None) -> dict:
    """The rope settings of a config (transformers 5: rope_parameters, per layer type for Gemma 3;
    4.x: rope_scaling and rope_theta at the top level)."""
    params = dict(config.get("rope_parameters") or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    elif layer_type is not None and any(isinstance(v, dict) for v in params.values()):
        params = {}
    return dict(config.get("rope_scaling") or {}) | params


def _llama_parameters(config: dict, writer, where: Path) -> None:
    n_head, hidden = int(config["num_attention_heads"]), int(config["hidden_size"])
    rope = _rope(config)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_rope_dimension_count(int(config.get("head_dim") or hidden // n_head))
    _rope_scaling(rope, writer, where)


def _rope_scaling(rope: dict, writer, where: Path) -> None:
    """A linear RoPE scaling written as llama.cpp reads it; any other kind refused."""
    import gguf

    kind = rope.get("rope_type", rope.get("type"))
    if kind not in (None, "default"):
        if kind != "linear":
            raise HiltError(f"{where}: rope scaling {kind!r} is not written to GGUF here (linear only)")
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))


def gemma3_query_scalar(hidden: int, n_head: int, n_layer: int, head_dim: int) -> float:
    """What llama.cpp divides gemma3 queries by the square root of: it does not read the scale from the file but
    takes it from the shapes (hidden / heads for the 27B model's 62 layers, else the head dimension)."""
    return hidden / n_head if n_layer == 62 else float(head_dim)


def gemma3_default_sliding(n_layer: int) -> list[bool]:
    """llama.cpp's gemma3 layers when the file gives no pattern: five sliding-window layers, then a global one."""
    return [i % 6 < 5 for i in range(n_layer)]


def _gemma3_parameters(config: dict, writer, where: Path) -> None:
    n_layer, n_head, hidden = int(config["num_hidden_layers"]), int(config["num_attention_heads"]), \
        int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or 256)
    for key in ("attn_logit_softcapping", "use_bidirectional_attention", "attention_bias"):
        if config.get(key):
            raise HiltError(f"{where}: {key} = {config[key]!r}; llama.cpp's gemma3 has no such thing")
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise HiltError(f"{where}: hidden_activation {act!r}; llama.cpp's gemma3 computes tanh-approximated GELU "
                        "(gelu_pytorch_tanh)")
    llama_cpp_scalar = gemma3_query_scalar(hidden, n_head, n_layer, head_dim)
    scalar = float(config.get("query_pre_attn_scalar") or head_dim)
    if not math.isclose(scalar, llama_cpp_scalar, rel_tol=1e-6):
        raise HiltError(f"{where}: query_pre_attn_scalar {scalar:g}; llama.cpp scales gemma3 queries by "
                        f"1/sqrt({llama_cpp_scalar:g}) for this shape ({n_layer} layers)")
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    full, local = _rope(config, "full_attention"), _rope(config, "sliding_attention")
    writer.add_rope_freq_base(float(full.get("rope_theta", config.get("rope_theta", 1_000_000.0))))
    writer.add_rope_freq_base_swa(float(local.get("rope_theta", config.get("rope_local_base_freq", 10_000.0))))
    if local.get("rope_type", "default") != "default":
        raise HiltError(f"{where}: rope scaling {local.get('rope_type')!r} on the sliding layers; llama.cpp's "
                        "gemma3 scales the global layers only")
    _rope_scaling(full, writer, where)
    types = config.get("layer_types")
    if types is None:
        every = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6)
        types = ["sliding_attention" if every > 1 and (i + 1) % every else "full_attention" for i in range(n_layer)]
    if len(types) != n_layer or set(types) - {"sliding_attention", "full_attention"}:
        raise HiltError(f"{where}: layer_types must give 'sliding_attention' or 'full_attention' for each of the "
                        f"{n_layer} layers")
    sliding = [t == "sliding_attention" for t in types]
    if any(sliding):
        writer.add_sliding_window(int(config["sliding_window"]))
        if sliding != gemma3_default_sliding(n_layer):
            writer.add_sliding_window_pattern(sliding)
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))


def write_hf_metadata(folder, writer, name_hint: str) -> dict:
    """Add the folder's hyperparameters and vocabulary to the GGUF ``writer`` (made for the architecture
    gguf_architecture gives); returns the text model's config."""
    import gguf

    folder = Path(folder)
    arch, config = gguf_architecture(folder)
    where = folder / CONFIG
    try:
        n_head = int(config["num_attention_heads"])
        named = config.get("_name_or_path") or config.get("_model_name_or_path")
        writer.add_name(Path(str(named)).name if named else name_hint)
        writer.add_block_count(int(config["num_hidden_layers"]))
        writer.add_context_length(int(config.get("max_position_embeddings", 2048)))
        writer.add_embedding_length(int(config["hidden_size"]))
        writer.add_feed_forward_length(int(config["intermediate_size"]))
        writer.add_head_count(n_head)
        writer.add_head_count_kv(int(config.get("num_key_value_heads") or n_head))
        writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
        writer.add_vocab_size(int(config["vocab_size"]))
        (_gemma3_parameters if arch == "gemma3" else _llama_parameters)(config, writer, where)
    except (KeyError, TypeError, ValueError) as e:
        raise HiltError(f"{where}: not a complete {arch} config ({type(e).__name__}: {e})") from None
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _write_vocabulary(folder, config, writer)
    return config


class TensorLayout:
    """Hugging Face tensor names -> GGUF names, the rope row order llama.cpp expects for Llama's q and k,
    and Gemma's norm weights as llama.cpp stores them."""

    def __init__(self, config: dict, arch: str = "llama"):
        import gguf

        self.arch = arch
        self.blocks = int(config["num_hidden_layers"])
        self.n_head = int(config["num_attention_heads"])
        self.n_head_kv = int(config.get("num_key_value_heads") or self.n_head)
        self.multimodal = bool(config.get("_multimodal"))
        kind = gguf.MODEL_ARCH.GEMMA3 if arch == "gemma3" else gguf.MODEL_ARCH.LLAMA
        self.map = gguf.get_tensor_name_map(kind, self.blocks)

    def _text_name(self, hf_name: str) -> str:
        if self.multimodal:
            for old, new in _GEMMA3_TEXT_PREFIXES:
                if hf_name.startswith(old):
                    return new + hf_name[len(old):]
        return hf_name

    def skip(self, hf_name: str) -> bool:
        """A tensor the text model's GGUF leaves out (Gemma 3's vision tower and projector)."""
        return self.multimodal and hf_name.startswith(_GEMMA3_OTHER_PREFIXES)

    def name(self, hf_name: str) -> str:
        got = self.map.get_name(self._text_name(hf_name), try_suffixes=(".weight", ".bias"))
        if got is None:
            raise HiltError(f"'{hf_name}': no GGUF name for this {self.arch} tensor")
        return got

    def dense(self, hf_name: str, value):
        """The tensor as llama.cpp wants it: Gemma's RMSNorm weights w as 1 + w, in float32."""
        from hilt.quant.qweight import QuantizedWeight

        if self.arch != "gemma3" or not hf_name.endswith("norm.weight"):
            return value
        if isinstance(value, QuantizedWeight):
            raise HiltError(f"'{hf_name}': a quantized norm weight; GGUF gemma3 stores 1 + w for norms, so "
                            "quantize without it (norms are 1-D and left as stored by default)")
        return value.float() + 1

    def rows(self, hf_name: str, n_rows: int) -> np.ndarray | None:
        """The row order of the GGUF tensor (an index into the Hugging Face rows), or None to keep it."""
        if self.arch != "llama":
            return None  # gemma3 ropes rotate-half in llama.cpp too
        if hf_name.endswith("self_attn.q_proj.weight"):
            heads = self.n_head
        elif hf_name.endswith("self_attn.k_proj.weight"):
            heads = self.n_head_kv
        else:
            return None
        half = n_rows // heads // 2
        # GGUF row (h, i, j) (head, pair, member) comes from Hugging Face row (h, j, i)
        return np.arange(n_rows).reshape(heads, 2, half).transpose(0, 2, 1).reshape(-1)
