"""What every corpus reader builds on: a sentence ``Pair``, the ``RawCorpus`` a reader
answers, the ``SPLITS`` and the one text normalization (``normalize_text``). The readers
(``aiayn.data.bible`` and the file and Hugging Face readers of ``aiayn.data.corpora``) import
this module; the registry of specs that chooses among them is ``aiayn.data.corpora``.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, field

SPLITS = ("train", "dev", "test")


@dataclass(frozen=True)
class Pair:
    """One sentence pair and where it came from (``Gen.1.1``, ``data.tsv:12``, ...)."""

    src: str
    tgt: str
    ref: str


@dataclass
class RawCorpus:
    """What a reader returns: the splits it has (``given``: "train" alone for a lone file),
    its pairs with their split, read lazily, and the pairs it dropped itself (the Bible's
    versification differences)."""

    description: str
    given: set[str]
    pairs: Iterable[tuple[Pair, str]] = ()
    split_rule: str = ""
    dropped: dict[str, int] = field(default_factory=dict)


def normalize_text(text: str) -> str:
    """Unicode NFC, whitespace runs collapsed to one space, stripped."""
    # str.split() splits at the characters that regex \s matches (str.isspace), 8x faster.
    return " ".join(unicodedata.normalize("NFC", text).split())
