"""Several corpora in one prepared directory: the spec's lines, direction tags, weighted
batches, and a translator told which language to write."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import WORD_LEVEL, error_line, run_cli, snapshot, tiny_model, toy_tsv

from aiayn.data.batching import TokenBatchSampler
from aiayn.data.directions import CorpusLine, corpus_lines, with_tag
from aiayn.data.prepare import prepare
from aiayn.data.prepared import load_prepared
from aiayn.errors import AiaynError
from aiayn.inference.translator import Translator

WORDS = "sun moon star tree river stone".split()


def two_way(tmp_path, weights: tuple[str, str] = ("", "")):
    """Prepared data of two toy corpora: "a" into language xx (its words reversed, in upper
    case) and "b" into yy (copied), each line with its weight option, if any."""
    a = toy_tsv(tmp_path / "a.tsv", WORDS, n=300, seed=1)
    b = toy_tsv(tmp_path / "b.tsv", WORDS, n=200, seed=2, copy=True)
    spec = f"tsv:{a} tgt=xx {weights[0]}\n\ntsv:{b} tgt=yy {weights[1]}"
    cfg = replace(WORD_LEVEL, corpus=spec)
    out = tmp_path / "data"
    prepare(cfg, out, 64, 256)
    return out


# ------------------------------------------------------------------ the spec's lines
def test_a_spec_has_a_line_per_corpus_with_its_options():
    lines = corpus_lines("bible:eng-spa weight=1\n  \ntsv:in.tsv weight=3 src=en tgt=es\n")
    assert lines == [CorpusLine("bible:eng-spa", 1.0),
                     CorpusLine("tsv:in.tsv", 3.0, "en", "es")]
    assert corpus_lines("bible:eng-spa") == [CorpusLine("bible:eng-spa")]


@pytest.mark.parametrize("text, says", [
    ("tsv:a.tsv weight=0", "weight must be a positive number, got '0'"),
    ("tsv:a.tsv weight=-1", "weight must be a positive number"),
    ("tsv:a.tsv weight=much", "weight must be a positive number, got 'much'"),
    ("tsv:a.tsv weight=nan", "weight must be a positive number"),
    ("tsv:a.tsv weight=2\ntsv:b.tsv", "weight= is given on some corpus lines but not on others"),
    ("tsv:a.tsv colour=red", "unknown option 'colour'"),
    ("tsv:a.tsv weight=1 weight=2", "weight= given twice"),
    ("tsv:a.tsv weight=1 extra", "'extra' after the options"),
    ("  \n", "data.corpus is empty"),
    ("tsv:a.tsv tag=2es", "tag must be a name of letters"),
    ("tsv:a.tsv tag=b<t", "tag must be a name of letters"),
    ("tsv:a.tsv splits=dev", "splits=train is the one choice"),
])
def test_a_bad_line_is_refused_in_one_line(text, says):
    with pytest.raises(AiaynError, match=says.replace("(", r"\(")) as caught:
        corpus_lines(text)
    assert "\n" not in str(caught.value)


# ------------------------------------------------------------------ prepared directions
def test_corpora_of_two_target_languages_are_tagged_in_text_and_ids(tmp_path):
    data = load_prepared(two_way(tmp_path))
    corpora = data.corpora
    assert [c["tag"] for c in corpora] == ["<2xx>", "<2yy>"]
    assert [c["languages"]["tgt"] for c in corpora] == ["xx", "yy"]
    tok = data.tokenizers
    assert tok.tags == {"xx": "<2xx>", "yy": "<2yy>"}
    for split in ("train", "dev", "test"):
        pairs = data.split(split)
        n_a = corpora[0]["splits"][split]
        assert n_a + corpora[1]["splits"][split] == len(pairs) == data.stats["splits"][split]
        assert all(src.startswith("<2xx> ") for src, _ in pairs[:n_a])
        assert all(src.startswith("<2yy> ") for src, _ in pairs[n_a:])
        # the ids prepare wrote are what the tokenizer makes of the tagged text
        ids = data.split_ids(split)
        assert [ids.src.row(i) for i in range(len(pairs))] == tok.encode_src(
            [src for src, _ in pairs])
        tag_ids = {ids.src.row(i)[0] for i in range(len(pairs))}
        assert tag_ids == {tok.src.token_to_id("<2xx>"), tok.src.token_to_id("<2yy>")}
    # each direction found by evaluate: its own pairs
    found = data.directions("dev")
    assert list(found) == ["?-xx", "?-yy"]
    assert found["?-xx"] == ("xx", list(range(corpora[0]["splits"]["dev"])))


def test_one_corpus_has_no_tags(tmp_path):
    toy_tsv(tmp_path / "a.tsv", WORDS, n=300, seed=1)
    prepare(replace(WORD_LEVEL, corpus=f"tsv:{tmp_path / 'a.tsv'}"), tmp_path / "data", 64)
    data = load_prepared(tmp_path / "data")
    assert data.tokenizers.tags == {}
    assert [c["tag"] for c in data.corpora] == [None]
    assert not any(src.startswith("<2") for src, _ in data.dev)
    assert len(data.directions("dev")) == 1


def test_a_text_that_holds_a_tag_is_refused_and_nothing_is_written(tmp_path):
    a = toy_tsv(tmp_path / "a.tsv", WORDS, n=300, seed=1)
    b = tmp_path / "b.tsv"
    b.write_text("".join(f"sun moon {i}\tsay <2xx> {i}\n" for i in range(200)), encoding="utf-8")
    out = tmp_path / "data"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    before = snapshot(out)
    cfg = replace(WORD_LEVEL, corpus=f"tsv:{a} tgt=xx\ntsv:{b} tgt=yy")
    with pytest.raises(AiaynError, match="contains <2xx>, a tag of this data"):
        prepare(cfg, out, 64, force=True)
    assert snapshot(out) == before


def test_a_tag_option_marks_every_source_of_its_corpus(tmp_path):
    a = toy_tsv(tmp_path / "a.tsv", WORDS, n=300, seed=1)
    b = toy_tsv(tmp_path / "b.tsv", WORDS, n=200, seed=3)
    prepare(replace(WORD_LEVEL, corpus=f"tsv:{a}\ntsv:{b} tag=bt splits=train"), tmp_path / "d",
            64)
    data = load_prepared(tmp_path / "d")
    n_a = data.corpora[0]["splits"]["train"]
    # splits=train: every pair of b trains, none is held out
    assert data.corpora[1]["splits"] == {"train": 200, "dev": 0, "test": 0}
    assert not any(src.startswith("<bt>") for src, _ in data.dev + data.test)
    assert [c["source_tag"] for c in data.corpora] == [None, "<bt>"]
    assert not any(src.startswith("<") for src, _ in data.train[:n_a])
    assert all(src.startswith("<bt> ") for src, _ in data.train[n_a:])
    assert data.tokenizers.tags == {}  # one target language: no direction to choose
    bt = data.tokenizers.src.token_to_id("<bt>")
    assert data.tokenizers.encode_src(["<bt> sun"])[0][0] == bt


def test_tags_need_every_target_language(tmp_path):
    a = toy_tsv(tmp_path / "a.tsv", WORDS, n=300, seed=1)
    b = toy_tsv(tmp_path / "b.tsv", WORDS, n=300, seed=2, copy=True)
    # The toy text is Latin script, so its language is not known unless named.
    with pytest.raises(AiaynError, match="target language is not known.*tgt=LANG"):
        prepare(replace(WORD_LEVEL, corpus=f"tsv:{a} tgt=xx\ntsv:{b}"), tmp_path / "d", 64)


# ------------------------------------------------------------------ weighted batches
def test_weighted_corpora_get_their_share_of_each_epoch_and_resume_exactly(tmp_path):
    rng = np.random.default_rng(0)
    src = rng.integers(3, 20, 900)
    tgt = rng.integers(3, 20, 900)
    groups = np.repeat([0, 1], [800, 100])  # a large corpus and a small one

    def sampler():
        return TokenBatchSampler(src, tgt, 64, seed=3, groups=groups, weights=[1.0, 1.0])

    s = sampler()
    n = len(s.batches)
    assert s.shares[0] + s.shares[1] == len(s) == n
    assert abs(s.shares[0] - s.shares[1]) <= 1  # equal weights: half each
    for _ in range(3):  # epochs
        batches = list(s)
        assert len(batches) == n
        seen = Counter(int(groups[b[0]]) for b in batches)
        assert seen == {0: s.shares[0], 1: s.shares[1]}
        assert all(len(set(groups[b].tolist())) == 1 for b in batches)  # one corpus a batch
    # the small corpus goes round its batches in full, in a new order each round
    small = len(s.group_batches[1])
    assert s.shares[1] > small
    # a resume continues the epoch with exactly the batches that were left
    a, b = sampler(), sampler()
    first = [x for _, x in zip(range(7), a, strict=False)]
    b.load_state_dict(a.state_dict())
    assert len(first) == 7 and list(b) == list(a)


def test_a_weight_three_times_another_gets_three_times_the_batches():
    lens = np.full(400, 10)
    groups = np.repeat([0, 1], 200)
    s = TokenBatchSampler(lens, lens, 100, groups=groups, weights=[3, 1])
    assert s.shares[0] == 3 * s.shares[1]


def test_weights_reach_the_training_sampler(tmp_path):
    from aiayn.config import Config
    from aiayn.training.distributed import Dist
    from aiayn.training.stream import load_data

    data_dir = two_way(tmp_path, ("weight=1", "weight=4"))
    stats = json.loads((data_dir / "stats.json").read_text())
    assert [c["weight"] for c in stats["corpora"]] == [1.0, 4.0]
    config = Config()
    config.model.max_len, config.train.max_tokens = 64, 256
    lines = []
    data = load_data(data_dir, config, Dist(), log=lines.append)
    shares = data.sampler.shares
    assert abs(shares[1] / shares[0] - 4) < 0.5
    assert any(line.startswith("corpora: ") for line in lines)


# ------------------------------------------------------------------ the translator's direction
def test_a_translator_writes_into_the_language_it_is_told(tmp_path):
    data = load_prepared(two_way(tmp_path))
    tok = data.tokenizers
    model = tiny_model(src_vocab_size=tok.src_vocab_size, tgt_vocab_size=tok.tgt_vocab_size)
    torch.manual_seed(0)
    plain = Translator(model, tok)
    assert plain.targets == ["xx", "yy"]
    sentences = ["sun moon", "tree river stone"]
    for lang in ("xx", "yy"):
        to = plain.toward(lang)
        tagged = [f"<2{lang}> {s}" for s in sentences]
        assert to.translate(sentences) == plain.translate(tagged)
        assert to.source_ids(sentences)[0] == tok.encode_src(tagged)
        assert Translator(model, tok, to=lang).translate(sentences) == to.translate(sentences)
    with pytest.raises(AiaynError, match="translates into xx, yy: say which with --to"):
        plain.translate(sentences)
    with pytest.raises(AiaynError, match="translates into xx, yy: say which"):
        plain.check_direction()
    with pytest.raises(AiaynError, match="does not translate into 'zz'; it translates into xx, yy"):
        plain.toward("zz")


def test_a_one_direction_model_takes_no_direction():
    assert with_tag(["a b"], {}, None, "this model") == ["a b"]
    with pytest.raises(AiaynError, match="has no direction tags; drop --to"):
        with_tag(["a b"], {}, "es", "this model")


# ------------------------------------------------------------------ commands
def test_prepare_takes_a_corpus_per_flag_and_says_what_each_holds(tmp_path, capsys):
    a = toy_tsv(tmp_path / "a.tsv", WORDS, n=300, seed=1)
    b = toy_tsv(tmp_path / "b.tsv", WORDS, n=200, seed=2, copy=True)
    code, out, _ = run_cli(["prepare", "--corpus", f"tsv:{a} tgt=xx weight=2",
                            "--corpus", f"tsv:{b} tgt=yy weight=1", "--tokenizer", "wordlevel",
                            "--vocab-size", "64", "--out", str(tmp_path / "d")], capsys)
    assert code == 0
    corpus_rows = [line for line in out.splitlines() if line.startswith("corpus ")]
    assert corpus_rows == [
        f"corpus 1  tsv:{a} weight=2.0 tgt=xx: ? -> xx, tag <2xx>; train 294, dev 3, test 3",
        f"corpus 2  tsv:{b} weight=1.0 tgt=yy: ? -> yy, tag <2yy>; train 196, dev 2, test 2"]
    # a bad option: one line, nothing written
    code, _, err = run_cli(["prepare", "--corpus", f"tsv:{a} weight=0", "--out",
                            str(tmp_path / "e")], capsys)
    assert code == 2 and "weight must be a positive number" in error_line(err)
    assert not (tmp_path / "e").exists()


def test_each_direction_is_scored_on_its_own_pairs(tmp_path):
    from aiayn.evaluation.evaluate import direction_scores
    from aiayn.evaluation.metrics import score

    data = load_prepared(two_way(tmp_path))
    pairs = data.test
    n_a = data.corpora[0]["splits"]["test"]
    # the first direction's hypotheses are its references, the second's are wrong
    hyps = [tgt for _, tgt in pairs[:n_a]] + ["moon"] * (len(pairs) - n_a)
    found = direction_scores(data, "test", hyps, pairs)
    assert list(found) == ["?-xx", "?-yy"]
    assert found["?-xx"]["bleu"] == pytest.approx(100) and found["?-xx"]["sentences"] == n_a
    assert found["?-yy"]["bleu"] == score(hyps[n_a:], [t for _, t in pairs[n_a:]], "13a").bleu
    assert found["?-yy"]["bleu"] < 100
    # only the first pairs (evaluate --limit): the directions they reach
    assert list(direction_scores(data, "test", hyps[:n_a], pairs[:n_a])) == []
