"""Which tensors of a checkpoint a run quantizes, and in which format: the blocks' 2-D weights by default,
the embedding tables and output heads only when asked (``--embeddings``), in their own format."""

from __future__ import annotations

import re

from hilt.errors import HiltError
from hilt.quant.quantize import QuantConfig
from hilt.quant.sources import Source

# Embeddings and LM heads stay in 16/32-bit by default (docs/references.md §1).
KEEP_DENSE = re.compile(
    r"(^|\.)(embed_tokens|embeddings?|word_embeddings|position_embeddings|token_type_embeddings|"
    r"wte|wpe|tok_embeddings|token_embd|lm_head|output)\.weight$|(^|\.)(lm_head|embed_tokens)(\.|$)"
)


def select_targets(source: Source, only: str | None = None, ignore: str | None = None) -> list[str]:
    """Names of the tensors to quantize, in file order.

    Default: 2-D floating weights named ``*.weight`` except embeddings and the
    LM head. ``only`` replaces the default with the 2-D floating tensors whose
    name matches it (re.search), so it can select an embedding on purpose;
    ``ignore`` then removes matches.
    """
    try:
        only_re = re.compile(only) if only else None
        ignore_re = re.compile(ignore) if ignore else None
    except re.error as e:
        raise HiltError(f"bad regular expression in --only/--ignore: {e}") from None
    chosen = []
    for name in source.names():
        if len(source.shape(name)) != 2 or not source.is_floating(name):
            continue
        if only_re is not None:
            if not only_re.search(name):
                continue
        elif not name.endswith("weight") or KEEP_DENSE.search(name):
            continue
        if ignore_re is not None and ignore_re.search(name):
            continue
        chosen.append(name)
    return chosen


def embedding_tables(source: Source, ignore: str | None = None) -> list[str]:
    """The embeddings and output heads (2-D floating ``*.weight`` tensors KEEP_DENSE names), in file order."""
    ignore_re = re.compile(ignore) if ignore else None
    return [n for n in source.names() if n.endswith("weight") and KEEP_DENSE.search(n) and len(source.shape(n)) == 2
            and source.is_floating(n) and not (ignore_re is not None and ignore_re.search(n))]


def embedding_config(embeddings: int | QuantConfig, shape) -> QuantConfig:
    """The format of an embedding table or output head under ``embeddings``: bits alone are symmetric
    integers with one scale per row; a QuantConfig is taken as it is (k-means with block scales, say)."""
    if isinstance(embeddings, QuantConfig):
        return embeddings
    return QuantConfig(method="int", bits=embeddings, block_size=int(shape[1]))


def embeddings_record(embeddings: int | QuantConfig | None):
    """How the header records ``embeddings``: the bits of row-wise integers, or the format's fields."""
    if isinstance(embeddings, QuantConfig):
        return {"method": embeddings.method, "bits": embeddings.bits, "block_size": embeddings.block_size}
    return embeddings
