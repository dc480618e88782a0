"""A prepared data directory (what ``aiayn.data.prepare`` writes), read back; encoded examples.

``load_prepared(DIR)`` opens it: tokenizers and stats at once, each split's text
(``{split}.jsonl``) read when first used, its token ids (``ids/``, aiayn.data.tokenids) mapped
on demand. Training maps the ids (``Prepared.encoded``: an ``EncodedSplit`` of the pairs
that fit model.max_len, under ``data.long_policy``), and ``aiayn.data.batching`` batches them by
length under a token budget and pads each batch. A directory prepared before the ids
existed still works: its text is encoded in memory at every start (with a note).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from aiayn.data.batching import Batch, Example, collate
from aiayn.data.languages import bleu_tokenize, resolve_languages
from aiayn.data.pairs import SPLITS
from aiayn.data.tokenids import RaggedIds
from aiayn.data.tokenizer import EOS_ID, Tokenizers, tokenizer_fingerprint
from aiayn.errors import AiaynError

STATS_FILE = "stats.json"
TOKENIZER_DIR = "tokenizer"
IDS_DIR = "ids"
IDS_FORMAT = 1
LONG_POLICIES = ("drop", "truncate")
LANGUAGE_SAMPLE = 2000  # train pairs whose script tells a side's language (when not named)
ENCODE_CHUNK = 8192  # pairs per encode_batch call: big enough for Rust's threads, small in memory


# ------------------------------------------------------------------ loading
@dataclass
class SplitIds:
    """The ids of one split: source (tokens + [EOS]) and target ([BOS] + tokens + [EOS])."""

    src: RaggedIds
    tgt: RaggedIds

    @classmethod
    def open(cls, directory: Path, split: str) -> SplitIds:
        ids = cls(RaggedIds.open(directory, split, "src"), RaggedIds.open(directory, split, "tgt"))
        if len(ids.src) != len(ids.tgt):
            raise AiaynError(f"{directory}: {split} has {len(ids.src)} source but {len(ids.tgt)} "
                             "target sentences; run `aiayn prepare` again")
        return ids

    @classmethod
    def encode(cls, pairs: Sequence[tuple[str, str]], tokenizers: Tokenizers) -> SplitIds:
        """In memory, with the encoders ``prepare`` uses."""
        sides = []
        for side, encoder in enumerate(tokenizers.array_encoders()):
            chunks = [encoder.encode([p[side] for p in pairs[i:i + ENCODE_CHUNK]])
                      for i in range(0, len(pairs), ENCODE_CHUNK)]
            sides.append(RaggedIds.from_chunks(chunks, encoder.dtype))
        return cls(*sides)


class Prepared:
    """A prepared data directory: tokenizers and stats at once, each split's text read on
    first use (``.train`` / ``.dev`` / ``.test``), its ids mapped on demand (``encoded``)."""

    def __init__(self, data_dir: Path, tokenizers: Tokenizers, stats: dict[str, Any],
                 log: Callable[[str], object] = print):
        self.data_dir, self.tokenizers, self.stats, self.log = data_dir, tokenizers, stats, log
        self._noted_legacy = False

    @cached_property
    def train(self) -> list[tuple[str, str]]:
        return read_split(self.data_dir / "train.jsonl")

    @cached_property
    def dev(self) -> list[tuple[str, str]]:
        return read_split(self.data_dir / "dev.jsonl")

    @cached_property
    def test(self) -> list[tuple[str, str]]:
        return read_split(self.data_dir / "test.jsonl")

    @cached_property
    def languages(self) -> dict[str, str]:
        """The language of each side (aiayn.data.languages): as stats.json records it, or for a
        directory prepared before it did, from its corpus spec and the script of its text."""
        recorded = self.stats.get("languages")
        if isinstance(recorded, dict) and "tgt" in recorded:
            return recorded
        given = self.stats.get("data_config") or {}
        sample = itertools.islice(iter_split(self.data_dir / "train.jsonl"), LANGUAGE_SAMPLE)
        return resolve_languages(given.get("src_lang", "auto"), given.get("tgt_lang", "auto"),
                                 str(self.stats.get("corpus", "")), sample)

    @cached_property
    def corpora(self) -> list[dict[str, Any]]:
        """Per line of the corpus spec (aiayn.data.directions): its spec, weight (None: the
        corpora pooled), languages, direction tag (None without) and its share of each split
        (the splits hold the corpora one after another); a directory prepared before they
        were recorded is one corpus."""
        recorded = self.stats.get("corpora")
        if recorded:
            return recorded
        corpus = str(self.stats.get("corpus", ""))
        return [{"line": corpus, "spec": corpus, "weight": None,
                 "languages": self.languages, "tag": None,
                 "splits": self.stats.get("splits", {})}]

    def directions(self, split: str, n: int | None = None) -> dict[str, tuple[str, list[int]]]:
        """Per direction ("en-es"; several corpora of one direction together), its target
        language and the positions of its pairs among the first ``n`` of ``split`` (None:
        all)."""
        found: dict[str, tuple[str, list[int]]] = {}
        start = 0
        for c in self.corpora:
            count = int(c["splits"].get(split, 0))
            languages = c["languages"]
            name = f"{languages['src'] or '?'}-{languages['tgt'] or '?'}"
            stop = start + count if n is None else min(start + count, n)
            found.setdefault(name, (languages["tgt"], []))[1].extend(range(start, max(start, stop)))
            start += count
        return {name: value for name, value in found.items() if value[1]}

    def bleu_tokenize(self, setting: str = "auto", language: str | None = None) -> str:
        """sacreBLEU's tokenizer for BLEU on this data: ``setting`` (the run's
        data.bleu_tokenize) unless "auto", then the one this data was prepared with, then
        the target language's (aiayn.data.languages.bleu_tokenize): ``language``'s, where
        given (one direction of several), else the data's first target language."""
        if setting == "auto":
            setting = (self.stats.get("data_config") or {}).get("bleu_tokenize", "auto")
        return bleu_tokenize(setting, language or self.languages["tgt"])

    def split(self, name: str) -> list[tuple[str, str]]:
        if name not in SPLITS:
            raise AiaynError(f"unknown split {name!r}; one of {', '.join(SPLITS)}")
        return getattr(self, name)

    def split_ids(self, name: str) -> SplitIds:
        """The ids of a split, mapped from the files; in a directory prepared before they
        existed, encoded from the text in memory (with a one-line note)."""
        meta = self.stats.get("ids")
        if meta is None:
            if not self._noted_legacy:
                self.log(f"note: {self.data_dir} has no token ids (prepared by an older aiayn), "
                         "so its text is encoded at every start; run `aiayn prepare` again to "
                         "start in seconds")
                self._noted_legacy = True
            return SplitIds.encode(self.split(name), self.tokenizers)
        if meta.get("format") != IDS_FORMAT:
            raise AiaynError(f"{self.data_dir}: token ids of format {meta.get('format')!r}, this "
                             f"aiayn reads format {IDS_FORMAT}; run `aiayn prepare` again")
        if meta.get("tokenizer_sha256") != tokenizer_fingerprint(self.data_dir / TOKENIZER_DIR):
            raise AiaynError(f"{self.data_dir}: the token ids were made with another tokenizer "
                             f"than {TOKENIZER_DIR}/; run `aiayn prepare` again")
        ids = SplitIds.open(self.data_dir / meta.get("directory", IDS_DIR), name)
        if len(ids.src) != meta.get("pairs", {}).get(name):
            raise AiaynError(f"{self.data_dir}: {name} has {len(ids.src)} encoded pairs, "
                             f"stats.json says {meta.get('pairs', {}).get(name)}; run "
                             "`aiayn prepare` again")
        return ids

    def encoded(self, name: str, max_len: int, policy: str) -> EncodedSplit:
        """The examples of a split that ``max_len`` and ``policy`` keep (see EncodedSplit)."""
        return EncodedSplit(self.split_ids(name), max_len, policy)

    def validation_split(self, max_len: int) -> tuple[list[Example], list[tuple[str, str]]]:
        """The dev split as a validation reads it (aiayn.evaluation.evaluate.validate): every pair's
        ids, long ones truncated (the dev score covers every dev pair), and the text its
        references come from (``Example.index`` is a position in it). `aiayn train` and
        `aiayn doctor`'s re-validation both read it here, so both score the same pairs."""
        examples = list(self.encoded("dev", max_len, "truncate"))
        if len(examples) != len(self.dev):
            raise AiaynError(f"{self.data_dir}: dev.jsonl holds {len(self.dev)} pairs but its "
                             f"token ids {len(examples)}; run `aiayn prepare` again")
        return examples, list(self.dev)


def prepared_corpus(data_dir: str | Path) -> str | None:
    """The corpus spec a prepared data directory was made from (its stats.json), or None
    where it cannot be read: what a run trained on it records as ``data.corpus``."""
    try:
        corpus = json.loads((Path(data_dir) / STATS_FILE).read_text(encoding="utf-8"))["corpus"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return corpus if isinstance(corpus, str) else None


def load_prepared(data_dir: str | Path, log: Callable[[str], object] = print) -> Prepared:
    """Open what ``prepare`` wrote; a clear error when something is missing. The text of
    a split is read when first used."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise AiaynError(f"{data_dir}: prepared data directory not found "
                         "(make one with `aiayn prepare --out DIR`)")
    for name in SPLITS:
        path = data_dir / f"{name}.jsonl"
        if not path.is_file():
            raise AiaynError(f"{path}: missing; is {data_dir} a directory made by `aiayn prepare`?")
    stats_path = data_dir / STATS_FILE
    try:
        stats = json.loads(stats_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AiaynError(f"{stats_path}: missing; run `aiayn prepare` again") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AiaynError(f"{stats_path}: not valid JSON ({exc})") from None
    tokenizers = Tokenizers.load(data_dir / TOKENIZER_DIR)
    return Prepared(data_dir, tokenizers, stats, log)


def read_split(path: Path) -> list[tuple[str, str]]:
    """The (src, tgt) pairs of one prepared ``.jsonl`` split."""
    return list(iter_split(path))


def iter_split(path: Path) -> Iterator[tuple[str, str]]:
    """``read_split`` one pair at a time."""
    if not path.is_file():
        raise AiaynError(f"{path}: missing; is {path.parent} a directory made by `aiayn prepare`?")
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            try:
                record = json.loads(line)
                pair = (record["src"], record["tgt"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise AiaynError(f"{path}: line {number} is not a {{\"src\", \"tgt\"}} "
                                 "JSON object") from None
            yield pair


# ------------------------------------------------------------------ encoding
# ------------------------------------------------------------------ encoding
class EncodedSplit:
    """The examples of a split that fit ``max_len``: a pair whose source or target ids are
    longer is dropped (``policy="drop"``) or cut to ``max_len`` keeping its [EOS]
    (``"truncate"``). ``counts``: ``{"pairs", "kept", "dropped_too_long", "truncated"}``.

    Examples are made when read (``split[j]``: the j-th kept pair), from ids that may be
    mapped from disk; ``src_lens``/``tgt_lens`` (numpy) are what the batcher needs, so
    building batches reads no ids at all."""

    def __init__(self, ids: SplitIds, max_len: int, policy: str):
        src_len, tgt_len = ids.src.lengths(), ids.tgt.lengths()
        self.positions, self.counts = fit_to_max_len(src_len, tgt_len, max_len, policy)
        self.src_lens = np.minimum(src_len[self.positions], max_len)
        self.tgt_lens = np.minimum(tgt_len[self.positions], max_len)
        self.ids, self.max_len = ids, max_len

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, j: int) -> Example:
        i = int(self.positions[j])
        return Example(_cut(self.ids.src.row(i), self.max_len),
                       _cut(self.ids.tgt.row(i), self.max_len), i)

    def __iter__(self) -> Iterator[Example]:
        return (self[j] for j in range(len(self)))


def _cut(ids: list[int], max_len: int) -> list[int]:
    return ids[: max_len - 1] + [EOS_ID] if len(ids) > max_len else ids


def encode_split(pairs: Sequence[tuple[str, str]], tokenizers: Tokenizers, max_len: int,
                 policy: str) -> tuple[list[Example], dict[str, int]]:
    """Encode pairs in memory under the max_len ``policy`` (see EncodedSplit); returns the
    examples and the counts. It never raises for a long pair, so no epoch can stop halfway."""
    split = EncodedSplit(SplitIds.encode(pairs, tokenizers), max_len, policy)
    return list(split), split.counts


def fit_to_max_len(src_len: np.ndarray, tgt_len: np.ndarray, max_len: int,
                   policy: str) -> tuple[np.ndarray, dict[str, int]]:
    """The positions the long-pair policy keeps, and the counts."""
    if policy not in LONG_POLICIES:
        raise AiaynError(f"data.long_policy must be one of {', '.join(LONG_POLICIES)}, "
                         f"got {policy!r}")
    if max_len < 3:
        raise AiaynError(f"model.max_len must be at least 3 ([BOS] token [EOS]), got {max_len}")
    fits = (np.asarray(src_len) <= max_len) & (np.asarray(tgt_len) <= max_len)
    n_long = int(len(fits) - fits.sum())
    kept = np.flatnonzero(fits) if policy == "drop" else np.arange(len(fits))
    counts = {"pairs": len(fits), "kept": len(kept),
              "dropped_too_long": n_long if policy == "drop" else 0,
              "truncated": n_long if policy == "truncate" else 0}
    return kept, counts


def sample_batch(data_dir: str | Path, config, batch_size: int) -> Batch:
    """The first ``batch_size`` pairs of the dev split (train if dev is empty), encoded
    under ``config.model.max_len`` and ``config.data.long_policy`` (for `aiayn trace`)."""
    prepared = load_prepared(data_dir)
    tok = prepared.tokenizers
    for side, data_size, model_size in (("src", tok.src_vocab_size, config.model.src_vocab_size),
                                        ("tgt", tok.tgt_vocab_size, config.model.tgt_vocab_size)):
        if data_size > model_size:
            raise AiaynError(f"{data_dir}: the {side} vocabulary has {data_size} tokens but "
                             f"model.{side}_vocab_size is {model_size}; "
                             f"use --set model.{side}_vocab_size={data_size}")
    pairs = (prepared.dev or prepared.train)[: max(1, batch_size)]
    examples, _ = encode_split(pairs, tok, config.model.max_len, config.data.long_policy)
    if not examples:
        raise AiaynError(f"{data_dir}: no pair fits model.max_len={config.model.max_len}")
    return collate(examples, config.model.pad_id)


