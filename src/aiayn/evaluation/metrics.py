"""Translation metrics: sacreBLEU's corpus BLEU and chrF, character/word error rates, and
the share of sentences that stutter (repeat an n-gram of words)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sacrebleu

from aiayn.errors import AiaynError


@dataclass
class Scores:
    bleu: float
    chrf: float
    cer: float
    wer: float
    bleu_signature: str
    chrf_signature: str


def edit_distance(a: Sequence, b: Sequence) -> int:
    """Levenshtein distance (insertions, deletions, substitutions each cost 1).

    Bit-parallel (Myers 1999, in Hyyro's 2001 form for edit distance): the column of the
    dynamic-programming table for the shorter sequence is kept as bit vectors of +1/-1
    vertical differences in two Python integers, so each element of the longer sequence
    costs a handful of integer operations instead of a loop over the shorter one; tens
    of times faster than the textbook table on sentence-length inputs. Works for any
    hashable items (characters for CER, words for WER).
    """
    if len(a) < len(b):
        a, b = b, a
    if not b:
        return len(a)
    m = len(b)
    match: dict = {}  # item -> bit i set where b[i] == item
    for i, item in enumerate(b):
        match[item] = match.get(item, 0) | (1 << i)
    mask, last = (1 << m) - 1, 1 << (m - 1)
    plus, minus, distance = mask, 0, m  # vertical deltas +1 / -1; D[m][0] = m
    for item in a:
        eq = match.get(item, 0)
        xv = eq | minus
        xh = (((eq & plus) + plus) ^ plus) | eq
        h_plus = minus | (~(xh | plus) & mask)
        h_minus = plus & xh
        if h_plus & last:
            distance += 1
        elif h_minus & last:
            distance -= 1
        h_plus = ((h_plus << 1) | 1) & mask  # row 0 grows by one per column: D[0][j] = j
        h_minus = (h_minus << 1) & mask
        plus = h_minus | (~(xv | h_plus) & mask)
        minus = h_plus & xv
    return distance


def error_rate(hypotheses: list[str], references: list[str], unit: str) -> float:
    """Corpus-level CER (unit="char") or WER (unit="word"): total edits / reference length."""
    split = list if unit == "char" else str.split
    edits = sum(edit_distance(split(h), split(r)) for h, r in zip(hypotheses, references))
    length = sum(len(split(r)) for r in references)
    return edits / max(length, 1)


def score(hypotheses: list[str], references: list[str], tokenize: str = "13a") -> Scores:
    """Corpus BLEU and chrF (sacreBLEU defaults) plus CER and WER. ``tokenize``: BLEU's
    tokenizer (aiayn.data.languages.bleu_tokenize: "zh" for Chinese, ...), in its signature."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    try:
        bleu = sacrebleu.metrics.BLEU(tokenize=tokenize)
    except (ImportError, RuntimeError) as exc:  # ja-mecab / ko-mecab without their packages
        raise AiaynError(f"data.bleu_tokenize={tokenize}: sacreBLEU cannot load it "
                         f"({str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}); "
                         "install its package or choose another tokenizer") from None
    chrf = sacrebleu.metrics.CHRF()
    b = bleu.corpus_score(hypotheses, [references])
    c = chrf.corpus_score(hypotheses, [references])
    return Scores(
        bleu=b.score,
        chrf=c.score,
        cer=error_rate(hypotheses, references, "char"),
        wer=error_rate(hypotheses, references, "word"),
        bleu_signature=str(bleu.get_signature()),
        chrf_signature=str(chrf.get_signature()),
    )


STUTTER_N = 4  # `aiayn evaluate` counts the sentences that repeat a 4-gram of words


def repeats_ngram(items: Sequence, n: int) -> bool:
    """Whether ``items`` (words, token ids...) hold some n-gram twice."""
    grams = [tuple(items[i:i + n]) for i in range(len(items) - n + 1)]
    return len(set(grams)) < len(grams)


def stutter_share(texts: Sequence[str], n: int = STUTTER_N) -> float:
    """The share of ``texts`` that repeat an n-gram of (whitespace-separated) words: "como
    no he visto mis ojos como no he visto mis ojos" repeats 4-grams. 0.0 for no texts."""
    return sum(repeats_ngram(t.split(), n) for t in texts) / len(texts) if texts else 0.0
