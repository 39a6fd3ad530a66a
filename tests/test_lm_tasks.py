"""Downstream tasks (`hilt eval tasks`): the stored items, the scorers on models whose score is known, refusals."""

import json

import pytest
import torch

from hilt.cli import main
from hilt.data import lm_tasks
from hilt.data.text import available_works, shakespeare_text
from hilt.tasks import downstream


@pytest.fixture(scope="module")
def items():
    return lm_tasks.load_items()


def test_stored_items_are_what_the_generator_writes(items):
    assert lm_tasks.item_path().read_text(encoding="utf-8") == lm_tasks.dumps(lm_tasks.make_items())
    assert {k: len(items[k]) for k in lm_tasks.COUNTS} == lm_tasks.COUNTS


def test_items_come_from_text_nothing_tunes_on(items):
    from hilt.tasks.compensate import DEFAULT_WORK

    assert lm_tasks.WORK not in (DEFAULT_WORK, "hamlet")
    # the character GPTs train on the first 90% of the works in name order; language models on their first 400k
    # tokens (well under the 90%)
    works = available_works()
    before = sum(len(shakespeare_text(w)) for w in works[:works.index(lm_tasks.WORK)])
    assert before >= 0.9 * sum(len(shakespeare_text(w)) for w in works)
    lines = shakespeare_text(lm_tasks.WORK).splitlines()
    for item in items["next_line"][:50]:
        true_line = item["choices"][item["answer"]]
        assert lines[item["choice_lines"][item["answer"]] - 1].strip() == true_line
        assert item["passage"].endswith("\n") and len(set(item["choices"])) == 4
    for item in items["cloze"][:50]:
        assert lines[item["line"] - 1].strip().startswith(item["passage"].rsplit("\n", 1)[-1])
        assert item["answer"].isalpha() or "'" in item["answer"]
        assert item["answer"].lower() in item["passage"].rsplit("\n", 1)[0].lower()  # the passage can tell it
    for item in items["continuation"][:50]:
        line = lines[item["line"] - 1].strip()
        head = item["passage"].rsplit("\n", 1)[-1]
        assert line.startswith(head) and item["answer"].startswith(" " + line[len(head):].strip())


class CharModel:
    """Characters as tokens (code point mod 256, 0 pads); ``next_token(text)`` is the token it makes most likely
    after ``text`` (None: uniform)."""

    bos, context = None, None

    def __init__(self, next_token=None, row_bonus=None):
        self.next_token, self.row_bonus = next_token, row_bonus

    def encode(self, text):
        return [ord(c) % 256 for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def logits(self, ids):
        out = torch.zeros(*ids.shape, 256)
        for b, row in enumerate(ids.tolist()):
            text = self.decode(row).rstrip("\x00")
            if self.row_bonus is not None and self.row_bonus(text):  # every token of this row made likely
                out[b, torch.arange(len(row) - 1), torch.tensor(row[1:])] = 10.0
            if self.next_token is not None:
                tok = self.next_token(text)
                if tok is not None:
                    out[b, len(text) - 1, tok] = 10.0
        return out


def test_a_model_that_knows_the_text_scores_one(items):
    chosen = {t: downstream.spread(items[t], 12) for t in downstream.TASKS}
    truth = {it["passage"] + it["choices"][it["answer"]] + "\n" for it in chosen["next_line"]}
    answers = {it["passage"]: " " + it["answer"] + " " for it in chosen["cloze"]}
    answers |= {it["passage"]: it["answer"] for it in chosen["continuation"]}

    def next_token(text):
        for passage, answer in answers.items():
            if text.startswith(passage) and len(text) - len(passage) < len(answer):
                return ord(answer[len(text) - len(passage)]) % 256
        return None

    oracle = CharModel(next_token, truth.__contains__)
    scores = downstream.score_tasks(oracle, chosen, reference=[oracle.encode(it["answer"])[:8]
                                                               for it in chosen["continuation"]])
    assert scores["next_line"]["accuracy"]["score"] == 1.0 and scores["next_line"]["accuracy_norm"]["score"] == 1.0
    assert scores["cloze"]["exact"]["score"] == 1.0
    assert scores["continuation"]["exact"]["score"] == 1.0 and scores["continuation"]["prefix"]["score"] == 1.0
    assert scores["continuation"]["agreement_exact"]["score"] == 1.0


def test_a_uniform_model_scores_chance_within_its_interval(items):
    """Per character, a uniform model rates every line alike: it scores chance. Its total log-likelihood instead
    prefers the shortest line, which is why the per-character accuracy is the one reported first."""
    scores = downstream.next_line(CharModel(), items["next_line"])
    assert scores["chance"] == 0.25
    lo, hi = scores["accuracy_norm"]["interval"]
    assert lo <= 0.25 <= hi, scores["accuracy_norm"]
    shortest = [min(range(4), key=lambda c: len(it["choices"][c])) for it in items["next_line"]]
    assert scores["picks"] == shortest


def test_a_frequency_guess_scores_the_chance_level(items):
    """The generative tasks' chance is what always giving the most common answer scores."""
    chosen = downstream.spread(items["cloze"], 100)
    common = max({it["answer"].lower() for it in chosen}, key=[it["answer"].lower() for it in chosen].count)
    said = " " + common + " "

    def next_token(text):
        for n in range(len(said), 0, -1):  # how much of the guess is already out
            if text.endswith(said[:n]):
                return ord(said[n]) if n < len(said) else None
        return ord(said[0])

    guesser = CharModel(next_token)
    scores = downstream.cloze(guesser, chosen)
    assert scores["exact"]["score"] == pytest.approx(scores["chance"])
    targets = [[1, 2, 3], [1, 2, 4], [1, 5, 6], [7, 8, 9]]
    exact, prefix = downstream.frequency_guess(targets)
    assert exact == 0.25 and prefix == pytest.approx((1 + 2 / 3 + 1 / 3 + 0) / 4)  # guess 1, 2, 3


def test_bootstrap_interval_of_a_constant_is_the_constant_and_narrows_with_items():
    assert downstream.bootstrap_interval([1.0] * 30) == [1.0, 1.0]
    wide = downstream.bootstrap_interval([0, 1] * 10)
    narrow = downstream.bootstrap_interval([0, 1] * 500)
    assert wide[0] < narrow[0] < 0.5 < narrow[1] < wide[1]


def test_a_model_with_a_short_context_reads_long_inputs_in_windows():
    """Position t's logits depend on the tokens t-3..t here: windows of 8 reproduce a full read exactly."""
    calls = []

    class Local(CharModel):
        context = 8

        def logits(self, ids):
            calls.append(ids.shape[1])
            out = torch.zeros(*ids.shape, 256)
            for t in range(ids.shape[1]):
                for back in range(4):
                    if t - back >= 0:
                        out[:, t].scatter_add_(1, ids[:, t - back:t - back + 1], torch.ones(ids.shape[0], 1))
            return out

    ids = torch.randint(0, 256, (2, 29))
    unlimited = Local()
    unlimited.context = None
    expected = unlimited.logits(ids)
    calls.clear()
    assert torch.equal(downstream.read(Local(), ids), expected)
    assert max(calls) <= 8 and len(calls) == 1 + -(-(29 - 8) // 4)


@pytest.mark.parametrize("argv,message", [
    (["eval", "tasks", "smollm2", "--quantized", "/no/such/folder"], "--quantized /no/such/folder"),
    (["eval", "tasks", "/no/such/model.gguf"], "/no/such/model.gguf"),
    (["eval", "tasks", "smollm2", "--reference", "/no/such/ref"], "/no/such/ref"),
    (["eval", "tasks", "CHECKPOINT"], "hilt eval tasks smollm2 --quantized"),
])
def test_bad_arguments_are_refused_before_a_model_loads(monkeypatch, capsys, tmp_path, argv, message):
    import hilt.models.lm

    def no_loading(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(hilt.models.lm, "load_lm", no_loading)
    if "CHECKPOINT" in argv:  # a hilt checkpoint of SmolLM2 given as the model
        from hilt.models.llama import smollm2_path

        folder = tmp_path / "smol-int4"
        assert main(["-qq", "quantize", str(smollm2_path()), str(folder), "--method", "int", "--bits", "4",
                     "--only", r"^blk\.0\.attn_q"]) == 0
        capsys.readouterr()
        argv = [str(folder) if a == "CHECKPOINT" else a for a in argv]
    assert main(argv) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_smollm2_on_a_few_items(tmp_path, monkeypatch, capsys):
    """The real path: SmolLM2 through the language-model adapter, every task, the JSON written."""
    monkeypatch.setattr(downstream, "QUICK_COUNTS", {"next_line": 6, "cloze": 4, "continuation": 3})
    out = tmp_path / "tasks.json"
    assert main(["eval", "tasks", "smollm2", "--quick", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "next line: accuracy per character" in printed and "chance" in printed
    result = json.loads(out.read_text())
    tasks = result["tasks"]
    assert tasks["next_line"]["items"] == 6 and len(tasks["cloze"]["words"]) == 4
    assert tasks["continuation"]["tokens"] == downstream.CONTINUATION_TOKENS and result["reference"] is None
    for _, _, score, _ in downstream.rows(tasks):
        assert 0.0 <= score["score"] <= 1.0


class Uncached:
    """The same model without its key/value cache: every step re-reads the whole input."""

    def __init__(self, lm):
        self.lm, self.bos, self.context = lm, lm.bos, None

    def encode(self, text):
        return self.lm.encode(text)

    def decode(self, ids):
        return self.lm.decode(ids)

    def logits(self, ids):
        return self.lm.logits(ids)


class CharTokenizer:
    """Code points mod 200, for a random transformers model (the HF tokenizer calls the adapter makes)."""

    bos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 200 for c in text]}

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def _random_gemma3():
    """A random Gemma 3 with a sliding window shorter than the passages: the cache path must handle both kinds."""
    import transformers

    from hilt.models.lm import HF_FOLDER, CausalLM, LMSource

    config = transformers.Gemma3TextConfig(
        vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=1024, initializer_range=0.2)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).eval()
    return CausalLM(LMSource("random-gemma3", None, HF_FOLDER, "gemma3_text"), model, CharTokenizer())


@pytest.mark.parametrize("which", ["smollm2", "gemma3-random"])
def test_the_cache_changes_no_score(items, which):
    """Choices read after the passage's cache, and greedy tokens one a step, equal a full re-read."""
    from hilt.models.lm import load_lm

    lm = load_lm("smollm2") if which == "smollm2" else _random_gemma3()
    for item in downstream.spread(items["next_line"], 2):
        cached = downstream.choice_logprobs(lm, item["passage"], item["choices"])
        full = downstream.choice_logprobs(Uncached(lm), item["passage"], item["choices"])
        assert cached == pytest.approx(full, rel=1e-4, abs=1e-3)
    for item in downstream.spread(items["continuation"], 2):
        assert downstream.greedy(lm, item["passage"], 6) == downstream.greedy(Uncached(lm), item["passage"], 6)


def test_bench_ptq_scores_smollm2_rows_on_the_tasks(monkeypatch):
    """The study's task path on a few items: float SmolLM2 agrees with itself; a coarsely rounded copy (replaced
    tensors, as HQQ's rows) is scored through the same adapter; the table ranks methods by each measure."""
    from hilt.bench.studies import ptq
    from hilt.models.llama import smollm2_path
    from hilt.quant import open_source

    monkeypatch.setattr(ptq, "TASK_COUNTS", {"next_line": 2, "cloze": 2, "continuation": 1})
    items = ptq.task_items()
    float_lm = ptq._smollm2_lm()
    reference = downstream.greedy_continuations(float_lm, items["continuation"])
    same = ptq._tasks(float_lm, items, reference)
    assert same["agreement"]["score"] == 1.0 and same["next_line"]["chance"] == 0.25
    source = open_source(smollm2_path())
    name = "blk.0.ffn_down.weight"
    tensors = {name: torch.zeros_like(source.get(name).float())}  # one layer's weights gone
    other = ptq._tasks(ptq._smollm2_lm(tensors=tensors), items, reference)
    assert set(other) == set(ptq.TASK_MEASURES)
    rows = [{"model": "smollm2", "method": "fp32", "bits": 32, "bits_per_weight": 32.0, "quality": 17.6, "tasks": same},
            {"model": "smollm2", "method": "int", "bits": 3, "bits_per_weight": 3.25, "quality": 180.0, "tasks": other},
            {"model": "smollm2", "method": "kmeans", "bits": 3, "bits_per_weight": 3.25, "quality": 40.0,
             "tasks": same}]
    (ranking,) = ptq.rankings(rows)
    assert ranking["ranking"]["perplexity"] == ["kmeans", "int"] and ranking["same_best"]["agreement"]
    text = ptq.markdown({"rows": rows, "quality": {"smollm2": "perplexity"}, "verdicts": [], "rankings": [ranking],
                         "task_items": "test items"})
    assert "| smollm2 | kmeans | 3 | 3.250 | 40.00 | " in text
    assert "smollm2 3 bit, best first: by perplexity: kmeans > int" in text
