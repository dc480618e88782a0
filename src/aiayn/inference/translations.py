"""What the Translator takes and gives, beside it: sentences made ready to decode
(``Sources``, with the truncation rule), the translations with their scores
(``Translation``), what a pass did (``DecodeStats``) and the rows `aiayn translate` writes
(``output_rows``). ``aiayn.inference.translator`` holds the Translator itself.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from aiayn.data.tokenizer import EOS_ID
from aiayn.inference.align import Alignment, pharaoh


class TruncationWarning(UserWarning):
    """Some input sentences were longer than the model's max_len and were truncated."""


def truncate_source(ids: list[int], max_len: int) -> list[int]:
    """The documented rule: keep the first ``max_len - 1`` tokens and end with EOS."""
    if len(ids) <= max_len:
        return ids
    return ids[: max_len - 1] + [EOS_ID]


def truncation_message(count: int, max_len: int) -> str:
    """What a ``TruncationWarning`` says (and `aiayn serve` answers) about ``count`` cut."""
    return (f"{count} sentence(s) longer than the model's max_len={max_len} tokens "
            f"were truncated to their first {max_len - 1} tokens")


@dataclass
class Sources:
    """Sentences made ready to decode (``Translator.prepare``): the positions of the
    non-empty ones, their source ids (truncated by the module's rule) and how many were
    cut; ``Translator.finish`` puts their hypotheses back in the input order."""

    count: int  # sentences given, empty ones included
    todo: list[int]  # positions of the non-empty sentences
    ids: list[list[int]]  # their source ids, tokens + EOS
    truncated: int
    texts: list[str] = field(default_factory=list)  # the non-empty sentences, one line each
    prefixes: list[list[int]] | None = None  # their target prefixes' ids (None: none given)

    @property
    def tokens(self) -> int:
        return sum(len(ids) for ids in self.ids)


@dataclass
class Translation:
    """One hypothesis with what the search knows of it (``Translator.translate_scored``)."""

    text: str
    score: float  # what the search ranked it by: log_prob / the length penalty
    log_prob: float | None  # log P(pieces | sentence), EOS included (None: the engine gives none)
    pieces: list[str]  # its target pieces, then "[EOS]" where the search ended it
    log_probs: list[float] | None  # each piece's log-probability (None: as log_prob)
    alignment: Alignment | None = None  # word pairs, where asked for (``translate_aligned``)

    def as_dict(self) -> dict:
        """Its fields as JSON takes them (`aiayn translate --scores`, serve's answers)."""
        fields = {"translation": self.text, "score": self.score, "log_prob": self.log_prob,
                  "pieces": self.pieces, "log_probs": self.log_probs}
        if self.alignment is not None:
            fields["alignment"] = pharaoh(self.alignment)
        return fields


@dataclass
class DecodeStats:
    """What one decoding pass did: for `aiayn evaluate`'s speed line."""

    sentences: int = 0  # sentences decoded (empty ones excluded)
    output_tokens: int = 0  # tokens of the best hypotheses, EOS excluded
    seconds: float = 0.0
    truncated: int = 0

    @property
    def sentences_per_s(self) -> float:
        return self.sentences / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


def output_rows(results: list[list[Translation]], nbest: int, first: int, alignments: bool,
          scores: bool) -> Iterator[str]:
    """`aiayn translate`'s rows for ``results`` (``translate_lines``' formats): with
    ``alignments`` each ends with a tab and the word pairs ('TRANSLATION<TAB>PAIRS'; an empty
    line '<TAB>')."""
    for i, hyps in enumerate(results, first):
        if scores:
            objects = [t.as_dict() for t in hyps]
            if nbest > 1:
                yield json.dumps({"nbest": objects}, ensure_ascii=False) + "\n"
            else:
                yield json.dumps(objects[0] if objects else {"translation": ""},
                                 ensure_ascii=False) + "\n"
            continue
        tail = (lambda t: f"\t{pharaoh(t.alignment)}") if alignments else (lambda t: "")
        if nbest == 1:
            yield (f"{hyps[0].text}{tail(hyps[0])}\n" if hyps
                   else "\t\n" if alignments else "\n")
            continue
        for t in hyps:
            yield f"{i}\t{t.score:.4f}\t{t.text}{tail(t)}\n"
        if not hyps:
            yield f"{i}\t\t\t\n" if alignments else f"{i}\t\t\n"


def sentence_list(sentences, method: str):
    """``sentences``, unless a bare string was given where a list is wanted: iterated, it
    would be translated one character at a time (a TypeError, naming the list wanted)."""
    if isinstance(sentences, str):
        raise TypeError(f"{method}() takes a list of sentences; got a str: use "
                        f"{method}([text])")
    return sentences


def one_line(sentence: str) -> str:
    """Line breaks inside a sentence would break the one-line-per-sentence contract."""
    return " ".join(sentence.splitlines()) if "\n" in sentence or "\r" in sentence else sentence


# What ends a line for str.splitlines (and so for many readers of a text file), and the tab
# that separates `aiayn translate`'s columns: each a space in a translation.
_BREAKS = re.compile("[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029\t]")


def single_line(translation: str) -> str:
    """A translation as one line of one column: a model whose vocabulary spells any byte
    (byte fallback) can write a newline, a tab or another line break, which would shift every
    later line of a file (``read_lines``' contract: input line i is output line i) or split
    a row's columns; each becomes a space."""
    return _BREAKS.sub(" ", translation)  # 0.4 us a translation (str.translate: 4 us)
