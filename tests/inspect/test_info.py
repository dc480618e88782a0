"""`aiayn info` of a model of several target languages and of prepared data of several
corpora (aiayn.data.directions): the directions and how to choose one, one line per
corpus."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import replace

import pytest
from helpers import WORD_LEVEL, run_cli, tagged_run, toy_tsv

from aiayn.cli import build_parser
from aiayn.data.prepare import prepare
from aiayn.inspect.info import data_info, format_info, run_info

WORDS = "sun moon star tree".split()


def test_prepared_data_of_two_corpora_has_a_line_per_corpus(tmp_path, capsys):
    a = toy_tsv(tmp_path / "a.tsv", WORDS, n=300, seed=1)
    b = toy_tsv(tmp_path / "b.tsv", WORDS, n=200, seed=2, copy=True)
    prepare(replace(WORD_LEVEL, corpus=f"tsv:{a} tgt=xx\ntsv:{b} src=en tgt=yy"),
            tmp_path / "data", 64)
    info = data_info(tmp_path / "data")
    assert info["targets"] == ["xx", "yy"]
    assert [(c["tag"], c["languages"]["tgt"]) for c in info["corpora"]] == [("<2xx>", "xx"),
                                                                          ("<2yy>", "yy")]
    assert info["corpora"][1]["languages"]["src"] == "en"
    for split in ("train", "dev", "test"):
        assert sum(c["splits"][split] for c in info["corpora"]) == info["splits"][split]
    lines = format_info(info).splitlines()
    corpus = [line for line in lines if line.startswith("corpus")]
    first, second = info["corpora"][0]["splits"], info["corpora"][1]["splits"]
    assert corpus == [
        f"corpus 1   tsv:{a} tgt=xx: ? -> xx, tag <2xx>; train {first['train']}, dev "
        f"{first['dev']}, test {first['test']}",
        f"corpus 2   tsv:{b} src=en tgt=yy: en -> yy, tag <2yy>; train {second['train']}, "
        f"dev {second['dev']}, test {second['test']}"]
    assert lines[-1].startswith("directions into xx, yy: say which with --to LANG")
    # the command: the same lines, and --json the same dict
    code, out, _ = run_cli(["info", str(tmp_path / "data")], capsys)
    assert code == 0 and out.splitlines() == lines
    code, out, _ = run_cli(["info", str(tmp_path / "data"), "--json"], capsys)
    assert code == 0 and json.loads(out) == json.loads(json.dumps(info))


def test_prepared_data_of_one_corpus_has_no_directions(tmp_path):
    a = toy_tsv(tmp_path / "a.tsv", WORDS, n=300, seed=1)
    prepare(replace(WORD_LEVEL, corpus=f"tsv:{a}"), tmp_path / "data", 64)
    info = data_info(tmp_path / "data")
    assert info["targets"] == [] and [c["tag"] for c in info["corpora"]] == [None]
    text = format_info(info)
    assert "directions" not in text and "tag" not in text
    assert [line for line in text.splitlines() if line.startswith("corpus ")] == [
        f"corpus     tsv:{a}: ? -> ?; train {info['splits']['train']}, dev "
        f"{info['splits']['dev']}, test {info['splits']['test']}"]


@pytest.mark.slow  # a model is trained
def test_a_run_of_two_target_languages_says_how_to_choose(tmp_path, capsys):
    run = tagged_run(tmp_path, steps=1)
    info = run_info(run)
    assert info["targets"] == ["xx", "yy"]
    lines = format_info(info).splitlines()
    assert ("directions into xx, yy: say which with --to LANG (`aiayn translate`, `score`, "
            '`attention`; Python: to=; serve: "to")') in lines
    # every command the line names takes --to
    line = next(line for line in lines if line.startswith("directions"))
    named = re.findall(r"`(?:aiayn )?(\w+)`", line)
    subcommands = next(a for a in build_parser()._actions
                       if isinstance(a, argparse._SubParsersAction)).choices
    assert named and all("--to" in subcommands[name]._option_string_actions for name in named)
    # the corpus spec's two lines on the data line, as one line
    assert [line for line in lines if line.startswith("data ")] == [
        f"data       {tmp_path / 'tagged-data'} (corpus tsv:{tmp_path / 'xx.tsv'} tgt=xx; "
        f"tsv:{tmp_path / 'yy.tsv'} tgt=yy)"]
    code, out, _ = run_cli(["info", str(run)], capsys)
    assert code == 0 and out.splitlines() == lines
    # a model of one direction has no such line
    assert not any(line.startswith("directions") for line in
                   format_info({**info, "targets": []}).splitlines())
