"""What several test modules need, in one place (test modules never import each other).

Corpora as ``aiayn prepare`` reads them (``stream_pairs``: the reader's own splits;
``first_pass``: prepare's first pass, held-out splits included).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from pathlib import Path

from aiayn.config import DataConfig
from aiayn.corpora import SPLITS, CorpusStream, Pair
from aiayn.prepare import read_pairs

_PASSES = itertools.count()


# ------------------------------------------------------------------ corpora
@dataclass
class StreamedCorpus:
    """A corpus whose reader gives every split itself (the Bible's books), read as
    ``aiayn prepare`` reads it: ``stream`` (read, dropped, description) and the kept pairs
    of each split, in corpus order, with their references (``Gen.1.1``)."""

    stream: CorpusStream
    splits: dict[str, list[Pair]]

    def texts(self, split: str) -> list[tuple[str, str]]:
        return [(p.src, p.tgt) for p in self.splits[split]]


def stream_pairs(spec: str, cfg: DataConfig | None = None) -> StreamedCorpus:
    stream = CorpusStream(spec, cfg or DataConfig())
    splits: dict[str, list[Pair]] = {name: [] for name in SPLITS}
    for pair, split in stream:
        splits[split].append(pair)
    stream.check_kept({name: len(pairs) for name, pairs in splits.items()})
    assert stream.given == set(SPLITS), "held-out splits: use first_pass (prepare routes them)"
    return StreamedCorpus(stream, splits)


def first_pass(spec: str, cfg: DataConfig, tmp_path: Path
               ) -> tuple[dict, dict[str, list[tuple[str, str]]]]:
    """What the first pass of ``aiayn prepare`` (``aiayn.prepare.read_pairs``) makes of a
    corpus: the first keys of stats.json (corpus, pairs read/kept/dropped, split_rule,
    splits) and the (source, target) pairs of each split, each in corpus order."""
    directory = tmp_path / f"first-pass-{next(_PASSES)}"
    directory.mkdir()
    pairs = read_pairs(replace(cfg, corpus=spec), directory)
    splits: dict[str, list[tuple[str, str]]] = {name: [] for name in SPLITS}
    for split, src, tgt in pairs.routed():
        splits[split].append((src, tgt))
    return pairs.info, splits
