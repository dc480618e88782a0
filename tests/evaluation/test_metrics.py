"""Metrics: the fast edit distance against the textbook table; CER/WER and sacreBLEU."""

from __future__ import annotations

import random

import pytest

from aiayn.evaluation.metrics import edit_distance, error_rate, score


def table_edit_distance(a, b) -> int:
    """Wagner-Fischer: the reference the bit-parallel version must agree with."""
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


@pytest.mark.parametrize("a, b, expected", [
    ("kitten", "sitting", 3), ("", "abc", 3), ("abc", "", 3), ("", "", 0),
    ("flaw", "lawn", 2), ("same", "same", 0), (["a", "b"], ["b", "a"], 2),
])
def test_known_edit_distances(a, b, expected):
    assert edit_distance(a, b) == expected == edit_distance(b, a)


def test_edit_distance_agrees_with_the_table_on_random_sequences():
    rng = random.Random(0)
    words = "the lord god said unto him and".split()
    for _ in range(3000):
        alphabet = rng.choice(["ab", "abcd", "abcdefghij"])
        a = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))
        b = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))
        assert edit_distance(a, b) == table_edit_distance(a, b)
    for _ in range(300):
        a = [rng.choice(words) for _ in range(rng.randint(0, 30))]
        b = [rng.choice(words) for _ in range(rng.randint(0, 30))]
        assert edit_distance(a, b) == table_edit_distance(a, b)


def test_error_rates_are_edits_over_reference_length():
    assert error_rate(["a b c"], ["a x c d"], "word") == pytest.approx(2 / 4)
    assert error_rate(["abc"], ["abd"], "char") == pytest.approx(1 / 3)


def test_score_reports_sacrebleu_with_its_signature():
    s = score(["the cat sat on the mat"], ["the cat sat on the mat"])
    assert s.bleu == pytest.approx(100.0) and s.chrf == pytest.approx(100.0)
    assert s.cer == 0.0 and s.wer == 0.0
    assert "tok:13a" in s.bleu_signature


def test_stutter_share_counts_the_texts_that_repeat_an_ngram_of_words():
    from aiayn.evaluation.metrics import repeats_ngram, stutter_share

    loop = "como no he visto mis ojos como no he visto mis ojos"
    assert repeats_ngram(loop.split(), 4) and not repeats_ngram(loop.split(), 7)
    assert stutter_share([loop, "a b c d", "a a a a a", ""], 4) == 0.5
    assert stutter_share(["a b a b"], 2) == 1.0 and stutter_share([], 4) == 0.0
