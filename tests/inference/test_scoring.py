"""Scoring given pairs (aiayn.inference.scoring): the teacher-forced numbers are the search's
own, batched or one by one, under a restricted output layer and the repetition guard; -inf
where the model cannot produce a piece; and the text side (Translator.score) on a trained
run's own translations."""

from __future__ import annotations

import io
import json
import math
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import error_line, run_cli, tiny_model

from aiayn.data.batching import pad
from aiayn.data.tokenizer import EOS_ID
from aiayn.inference.scoring import (
    PairScore,
    PairTruncationWarning,
    json_row,
    pair_score,
    score_ids,
    tsv_row,
)
from aiayn.inference.search import decode_beam
from aiayn.inference.settings import Search
from aiayn.inference.steps import length_penalty, output_limits, source_lengths
from aiayn.inference.translator import Translator

VOCAB = 16


class PieceNames:
    """The one thing ``score_ids`` asks of the tokenizers: a piece's name."""

    @staticmethod
    def tgt_id_to_token(i: int) -> str:
        return f"p{i}"


def random_translator(restricted: bool = False, decode_tokens: int = 8192) -> Translator:
    """An untrained tiny model (its searches end by EOS or at their limit, both kinds), its
    output layer all pieces or (``restricted``) all but pieces 5 and 6."""
    model = tiny_model(1, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, dropout=0.0, max_len=32,
                       output_vocab="targets" if restricted else "all").eval()
    if restricted:
        model.generator.set_outputs(torch.tensor([EOS_ID, 4, *range(7, VOCAB)]))
    return Translator(model, PieceNames(), decode_tokens=decode_tokens)


def random_sources(n: int = 8, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (int(k),), generator=g).tolist() + [EOS_ID]
            for k in torch.randint(2, 9, (n,), generator=g)]


@pytest.mark.parametrize("restricted", [False, True], ids=["all-pieces", "restricted"])
@pytest.mark.parametrize("guard", [0, 2], ids=["no-guard", "guard-2"])
def test_scoring_the_searchs_hypotheses_gives_back_their_scores(restricted, guard):
    """Every hypothesis of a beam search (nbest 4), scored teacher-forced with the same
    search's alpha and guard, gets the search's own score: log-probability over the length
    penalty with EOS for those that ended by EOS; those cut at their length limit have no
    EOS, so theirs is the sum of the piece terms alone."""
    translator = random_translator(restricted)
    sources = random_sources()
    search = Search(4, 0.8, guard, nbest=4, max_len_b=12)
    model = translator.model
    hyps = decode_beam(model, pad(sources), search, kernel=translator.kernel)
    limits = output_limits(model, source_lengths(model.src_pad_mask(pad(sources))), search).tolist()
    rows = [(i, h) for i, hs in enumerate(hyps) for h in hs]
    scored = score_ids(translator, [sources[i] for i, _ in rows], [h.ids for _, h in rows],
                       search)
    ended = 0
    for (i, h), s in zip(rows, scored, strict=True):
        if len(h.ids) < limits[i]:  # ended by EOS
            ended += 1
            assert s.score == pytest.approx(h.score, rel=1e-5, abs=1e-5)
        else:
            pieces = sum(s.log_probs[:-1]) / length_penalty(len(h.ids), search.alpha)
            assert pieces == pytest.approx(h.score, rel=1e-5, abs=1e-5)
        if restricted:
            assert not {"p5", "p6"} & set(s.pieces)
    assert 0 < ended < len(rows)  # both kinds were compared


def test_the_guard_applies_only_when_asked():
    """A target that repeats a 2-gram: under the guard of 2 the repeat cannot be produced
    (-inf), without it the model's own probability (finite); the pieces before the repeat
    score the same either way only where the guard banned nothing in their rows."""
    translator = random_translator()
    source, target = random_sources(1)[0], [7, 8, 9, 7, 8]
    free, = score_ids(translator, [source], [target], Search(1, 0.6, 0))
    guarded, = score_ids(translator, [source], [target], Search(1, 0.6, 2))
    assert all(math.isfinite(v) for v in free.log_probs)
    assert guarded.log_probs[4] == -math.inf  # 8 after 7 again
    assert guarded.log_prob == -math.inf and guarded.score == -math.inf
    assert guarded.log_probs[:4] == pytest.approx(free.log_probs[:4], rel=1e-6)


def test_a_piece_outside_a_restricted_layer_is_minus_inf_and_written_so():
    translator = random_translator(restricted=True)
    source = random_sources(1)[0]
    s, = score_ids(translator, [source], [[4, 5, 7]], Search(1, 1.0))
    assert s.log_probs[1] == -math.inf and math.isfinite(s.log_probs[0])
    assert s.log_prob == -math.inf
    assert tsv_row(s) == "-inf\t-inf\t4\n"
    row = json.loads(json_row(s))
    assert row["score"] is None and row["log_prob"] is None and row["log_probs"][1] is None
    assert row["pieces"] == ["p4", "p5", "p7"] and len(row["log_probs"]) == 4


def test_batched_equals_one_by_one():
    """Pairs of many lengths cut into small batches (a budget of 40 padded tokens), and
    each pair alone: the same numbers, in input order."""
    g = np.random.default_rng(3)
    sources = random_sources(12, seed=3)
    targets = [g.integers(4, VOCAB, size=g.integers(0, 12)).tolist() for _ in sources]
    search = Search(1, 0.6)
    batched = score_ids(random_translator(decode_tokens=40), sources, targets, search)
    alone = random_translator(decode_tokens=8192)
    for source, target, s in zip(sources, targets, batched, strict=True):
        one, = score_ids(alone, [source], [target], search)
        assert s.log_probs == pytest.approx(one.log_probs, rel=1e-5, abs=1e-6)
        assert len(s.log_probs) == len(target) + 1


def test_the_per_token_log_probabilities_sum_to_the_total():
    translator = random_translator()
    sources = random_sources(4)
    scored = score_ids(translator, sources, [[4, 9, 10], [], [11] * 6, [12, 13]],
                       Search(1, 0.7))
    for s in scored:
        assert s.log_prob == pytest.approx(math.fsum(s.log_probs), rel=1e-12)
        assert s.score == pytest.approx(s.log_prob / ((5 + s.tokens) / 6) ** 0.7, rel=1e-12)
        assert all(v <= 0 for v in s.log_probs)
    assert scored[1].tokens == 1 and scored[1].pieces == []  # an empty target: EOS alone


def test_pair_score_and_its_rows():
    s = pair_score(np.array([-0.5, -1.25, -0.25], dtype=np.float32), ["a", "b"], 1.0)
    assert s == PairScore(-2.0 / (8 / 6), -2.0, [-0.5, -1.25, -0.25], ["a", "b"])
    assert tsv_row(s) == "-1.5000\t-2.0000\t3\n"
    assert json.loads(json_row(s)) == {"score": -1.5, "log_prob": -2.0, "pieces": ["a", "b"],
                                       "log_probs": [-0.5, -1.25, -0.25]}


# ---------------------------------------------------------------- text, on a trained run
@pytest.fixture(scope="module")
def translator(run_dir) -> Translator:
    return Translator.from_pretrained(run_dir)


@pytest.mark.parametrize("guard", [0, 2])
def test_scoring_the_translations_text_gives_back_the_searchs_score(translator, guard):
    """`aiayn translate --nbest`'s (text, score) pairs, scored as text (word pieces: the
    text gives back the pieces), with the same search: the same scores."""
    sentences = ["red sun", "moon tree river star", "blue", "white white black sun moon"]
    search = translator.resolve(beam=3, nbest=3, alpha=0.6, no_repeat_ngram=guard)
    nbest = translator.translate_nbest(sentences, search)
    sources = [s for s, hyps in zip(sentences, nbest, strict=True) for _ in hyps]
    texts = [text for hyps in nbest for text, _ in hyps]
    scored = translator.score(sources, texts, search)
    assert [s.score for s in scored] == pytest.approx(
        [score for hyps in nbest for _, score in hyps], rel=1e-5, abs=1e-5)


def test_text_rules_long_targets_and_empty_sides(translator):
    """A target longer than the decoder's positions keeps its first max_len - 1 pieces
    (with a warning); an empty target or source is scored; a line break is a space."""
    long = " ".join(["red"] * 40)  # max_len 16
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s_long, s_empty, s_nosrc, s_break = translator.score(
            ["red", "red sun", "", "red\nsun"], [long, "", "red", "red\nsun"],
            translator.resolve(alpha=1.0))
    assert [type(w.message) for w in caught] == [PairTruncationWarning]
    assert "0 source(s) and 1 target(s)" in str(caught[0].message)
    red = translator.tokenizers.tgt_tokens("red")[1:-1]
    assert len(red) == 1 and s_long.pieces == red * 15 and s_long.tokens == 16
    assert s_empty.pieces == [] and math.isfinite(s_empty.score)
    assert math.isfinite(s_nosrc.score)
    s_space, = translator.score(["red sun"], ["red sun"], translator.resolve(alpha=1.0))
    assert s_break.log_probs == pytest.approx(s_space.log_probs, rel=1e-6)


def test_score_refuses_a_string_and_unpaired_lists(translator):
    with pytest.raises(TypeError, match="lists of sentences"):
        translator.score("red sun", ["red sun"])
    with pytest.raises(ValueError, match="2 sources but 1 targets"):
        translator.score(["red", "sun"], ["red"])


# ---------------------------------------------------------------- `aiayn score`
def test_cli_three_input_forms_agree_with_the_api(run_dir, translator, tmp_path, capsys):
    """The test split as --split, as one TSV file and as two files: the same lines, the API's
    numbers (the run's alpha), written atomically to -o or to stdout; --json carries each
    piece's log-probability, summing to the total."""
    pairs = [json.loads(line) for line in
             (Path((run_dir / "data_dir.txt").read_text().strip()) / "test.jsonl").open()]
    (tmp_path / "p.tsv").write_text("".join(f"{p['src']}\t{p['tgt']}\n" for p in pairs))
    (tmp_path / "s.txt").write_text("".join(p["src"] + "\n" for p in pairs))
    (tmp_path / "t.txt").write_text("".join(p["tgt"] + "\n" for p in pairs))
    run = str(run_dir)
    outputs = []
    for form in (["--split", "test"], ["-i", str(tmp_path / "p.tsv")],
                 ["--source", str(tmp_path / "s.txt"), "--target", str(tmp_path / "t.txt")]):
        code, out, _ = run_cli(["score", run, *form], capsys)
        assert code == 0
        outputs.append(out)
    assert outputs[0] == outputs[1] == outputs[2]
    expected = translator.score([p["src"] for p in pairs], [p["tgt"] for p in pairs])
    assert outputs[0] == "".join(map(tsv_row, expected))
    assert len(outputs[0].splitlines()) == len(pairs) == 40
    code, _, _ = run_cli(["score", run, "--split", "test", "--json", "--alpha", "0",
                          "-o", str(tmp_path / "out.jsonl")], capsys)
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert code == 0 and len(rows) == 40
    for row, s in zip(rows, expected, strict=True):
        assert row["score"] == row["log_prob"] == pytest.approx(s.log_prob, abs=1e-4)  # alpha 0
        assert sum(row["log_probs"]) == pytest.approx(row["log_prob"], abs=1e-3)
        assert len(row["log_probs"]) == len(row["pieces"]) + 1


def test_cli_reads_pairs_from_stdin_given_as_dash(run_dir, tmp_path, capsys, monkeypatch):
    """`-i -` and `--source -` read stdin (`paste src tgt | aiayn score RUN -i -`): the same
    lines as from files; both sides on stdin is one line, as is a bad byte there."""
    pairs = [("red green", "red green"), ("blue", "blue sun"), ("", "moon")]
    tsv = "".join(f"{s}\t{t}\n" for s, t in pairs)
    (tmp_path / "p.tsv").write_text(tsv)
    (tmp_path / "t.txt").write_text("".join(t + "\n" for _, t in pairs))
    run = str(run_dir)

    def stdin(data: bytes) -> None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))

    code, expected, _ = run_cli(["score", run, "-i", str(tmp_path / "p.tsv")], capsys)
    assert code == 0 and len(expected.splitlines()) == 3
    stdin(tsv.encode())
    assert run_cli(["score", run, "-i", "-"], capsys)[:2] == (0, expected)
    stdin("".join(s + "\n" for s, _ in pairs).encode())
    assert run_cli(["score", run, "--source", "-", "--target", str(tmp_path / "t.txt")],
                   capsys)[:2] == (0, expected)
    stdin(b"")
    code, _, err = run_cli(["score", run, "--source", "-", "--target", "-"], capsys)
    assert code == 2 and "would both read stdin" in error_line(err)
    stdin(b"red\tred\nbad \xff\tx\n")
    code, _, err = run_cli(["score", run, "-i", "-"], capsys)
    assert code == 2 and "-i - (stdin)" in error_line(err) and "line 2" in error_line(err)


@pytest.mark.parametrize("case", ["tabs", "counts", "missing", "not-utf8", "lone-source"])
def test_cli_bad_input_is_one_line_and_leaves_the_output_as_it_was(run_dir, tmp_path, capsys,
                                                                   case):
    (tmp_path / "ok.txt").write_text("red\nsun\nmoon\n")
    (tmp_path / "two.txt").write_text("red\nsun\n")
    (tmp_path / "tabs.tsv").write_text("red\tred\nsun sun\nmoon\tmoon\n")
    (tmp_path / "bad.tsv").write_bytes(b"red\tred\nsun\xff\tsun\n")
    given, expected = {
        "tabs": (["-i", str(tmp_path / "tabs.tsv")], "tabs.tsv, line 2: 0 tabs"),
        "counts": (["--source", str(tmp_path / "ok.txt"), "--target", str(tmp_path / "two.txt")],
                   "ok.txt has 3 lines but --target"),
        "missing": (["-i", str(tmp_path / "none.tsv")], "none.tsv: file not found"),
        "not-utf8": (["-i", str(tmp_path / "bad.tsv")], "bad.tsv, line 2: not UTF-8"),
        "lone-source": (["--source", str(tmp_path / "ok.txt")], "--source and --target go"),
    }[case]
    out = tmp_path / "out.tsv"
    out.write_text("before\n")
    code, _, err = run_cli(["score", str(run_dir), *given, "-o", str(out)], capsys)
    assert code == 2
    assert expected in error_line(err)
    if case == "counts":
        assert "two.txt has 2" in error_line(err)
    assert out.read_text() == "before\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
