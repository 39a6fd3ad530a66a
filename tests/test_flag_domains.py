"""Every typed flag of every command has a declared domain, and a value outside it is refused when the command line is
read: one line naming the flag, exit 2, before anything is loaded or written.

The domains are declared here, not read from the parser: a bound removed from a flag (say `--chips` taking any
integer) makes a value this table calls bad parse, and its case fails.
"""

import argparse
import functools

import pytest

from hilt.cli import build_parser

DOMAINS = {
    "int>=0": ["quantize --seed", "sensitivity --seed", "train --seed", "export onnx --seed", "fp8 transient --seed",
               "qat --seed", "hwa --seed", "bench qat --seeds", "bench certify --seed", "qat --refit-every"],
    "int>=1": ["quantize --block-size", "quantize --calibration-tokens", "quantize --calibration-sentences",
               "quantize --workers", "calibrate --tokens", "calibrate --sentences", "sensitivity --block-size",
               "sensitivity --probes", "sensitivity --tokens", "sensitivity --sentences", "sensitivity --images",
               "train --copies", "train --epochs", "energy --adc-bits", "energy --dac-bits", "energy --gpu-batch",
               "fp8 scales --tokens", "fp8 scales --context", "fp8 attention --tokens", "qat --block-size",
               "qat --steps", "qat --batch", "qat --save-every", "hwa --steps", "hwa --batch", "hwa --save-every",
               "drift --repeats", "drift --chips", "drift --test-images", "drift --sentences", "sweep --workers",
               "certify --block-size", "certify --n", "eval embed --sentences", "bench startup --repeats",
               "bench decode --threads", "bench decode --tokens", "bench decode --repeats", "bench analog-lm --chips",
               "bench afm --chips"],
    "int>=2": ["sensitivity --chips", "qat --context", "hwa --copies", "hwa --context", "eval ppl --tokens",
               "eval ppl --context", "drift --tokens", "drift --context", "bench analog-lm-diagnosis --tokens",
               "hwa --synthetic"],
    "int 1..8": ["quantize --bits", "qat --bits", "certify --bits"],
    "int 2..8": ["bench ptq --bits"],
    "head format": ["quantize --embeddings"],
    "decode rows": ["bench decode --formats"],
    "number>0": ["quantize --budget", "quantize --shard-size", "qat --lr", "hwa --lr", "certify --delta",
                 "bench qat --lr", "bench mixed --budgets", "hwa --clip-sigma", "hwa --range-lr"],
    "number>=0": ["train --eta", "hwa --eta", "hwa --weight-noise", "hwa --out-noise"],
    "noise range": ["train --eta-range", "hwa --eta-range"],
    "model": ["drift --model", "drift --workload"],
    "task list": ["eval tasks --tasks"],
}
# typed flags whose values are paths the command checks when it runs (tests/test_request_checks.py)
PATHS = {"bench analog-lm --work", "bench afm --work"}

OUTSIDE = {
    "int>=0": ["-1", "1.5", "abc", ""],
    "int>=1": ["0", "-1", "1.5", "abc", ""],
    "int>=2": ["1", "0", "-3", "2.0", "abc"],
    "int 1..8": ["0", "9", "-1", "4.5", "abc"],
    "int 2..8": ["1", "9", "-2", "abc"],
    "number>0": ["0", "-1e-5", "-.5", "nan", "inf", "abc", ""],
    "number>=0": ["-0.1", "-1e-3", "nan", "inf", "abc"],
    "noise range": ["0.6,0.1", "-0.1,0.5", "0.5", "a,b", "nan,1", "0.1,inf"],
    "model": ["no-such-model", ""],
    "task list": ["", "next-line", "cloze,", "cloze,nope", "NEXT_LINE"],
    "head format": ["", "1", "9", "int9", "kmeans5", "kmeans1", "nf4", "int 4"],
    "decode rows": ["", "kmeans4,", "kmeans5", "KMEANS4", "dense"],
}


def _flags(parser, path=()):
    """(command words, flag, action) of every option below ``parser``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _flags(sub, (*path, name))
        elif action.option_strings:
            yield " ".join(path), action.option_strings[-1], action


@functools.cache
def _parser():
    return build_parser()


def _refused(capsys, words: list[str], flag: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(words)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, (words, err)
    assert len(err.strip().splitlines()) == 1 and flag in err, (words, err)
    return err


def test_every_typed_flag_has_a_declared_domain():
    typed = {f"{cmd} {flag}" for cmd, flag, action in _flags(_parser()) if action.type is not None}
    declared = {f for flags in DOMAINS.values() for f in flags} | PATHS
    assert typed - declared == set(), "declare these flags' domains in DOMAINS"
    assert declared - typed == set(), "these declared flags no longer exist"


CASES = [(flag, value) for domain, flags in DOMAINS.items() for flag in flags for value in OUTSIDE[domain]]


@pytest.mark.parametrize("flag,value", CASES, ids=[f"{f}={v!r}" for f, v in CASES])
def test_a_value_outside_the_domain_is_refused_naming_the_flag(capsys, flag, value):
    *command, name = flag.split()
    _refused(capsys, [*command, name, value], name)


def test_a_choice_not_offered_is_refused_naming_the_flag(capsys):
    chosen = [(cmd, flag) for cmd, flag, action in _flags(_parser()) if action.choices is not None and cmd
              and not isinstance(action.choices, dict)]
    assert len(chosen) > 20
    for cmd, flag in chosen:
        err = _refused(capsys, [*cmd.split(), flag, "no-such-choice"], flag)
        assert "expected one of" in err


def test_values_inside_the_domain_parse():
    """The edges of each domain are accepted (a bound one off would refuse them)."""
    inside = {"int>=0": "0", "int>=1": "1", "int>=2": "2", "int 1..8": "8", "int 2..8": "2", "number>0": "1e-6",
              "number>=0": "0", "noise range": "0,0",
              "task list": "continuation,cloze", "head format": "kmeans4",
              "decode rows": "kmeans4,int4+int8emb"}
    for domain, value in inside.items():
        for flag in DOMAINS[domain]:
            *command, name = flag.split()
            action = next(a for c, f, a in _flags(_parser()) if c == " ".join(command) and f == name)
            assert action.type(value) is not None, (flag, value)
