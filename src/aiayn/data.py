"""Prepared data, encoded examples, length-bucketed token-budget batches, collate.

``prepare`` turns a corpus spec into a directory::

    DIR/train.jsonl, dev.jsonl, test.jsonl   {"src": ..., "tgt": ...} per line (the text:
                                             BLEU references, samples, `aiayn evaluate`)
    DIR/ids/{split}.{src,tgt}.ids.npy        the token ids, written once (aiayn.tokenids)
    DIR/ids/{split}.{src,tgt}.offsets.npy
    DIR/tokenizer/                           see aiayn.tokenizer
    DIR/stats.json                           what was read, dropped, kept; tokens; lengths

and running it twice gives identical files. It streams: the corpus is read pair by pair
(``aiayn.corpora.CorpusStream``), the tokenizer learns from an iterator over the train
text, and the ids are encoded in chunks and appended to the files, so its memory does not
grow with the corpus. Everything is written in a staging directory that replaces the
files of DIR only when all of it succeeded.

Training maps the ids (``Prepared.encoded``: an ``EncodedSplit`` of the pairs that fit
model.max_len), batches them by length under a token budget (``TokenBatchSampler``, the
way the paper batched: "sentence pairs were batched together by approximate sequence
length", section 5.1) and pads each batch (``collate``). A directory prepared before the
ids existed still works: its text is encoded in memory at every start (with a note).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from json.encoder import encode_basestring as _json_string
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aiayn.config import DataConfig
from aiayn.corpora import SPLITS, CorpusResult, CorpusStream, held_out_positions
from aiayn.errors import AiaynError
from aiayn.io import atomic_write_text, staged_directory
from aiayn.progress import bar as progress_bar
from aiayn.tokenids import SIDES, RaggedIds, RaggedWriter
from aiayn.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    Tokenizers,
    tokenizer_fingerprint,
    train_tokenizers,
)

STATS_FILE = "stats.json"
TOKENIZER_DIR = "tokenizer"
IDS_DIR = "ids"
IDS_FORMAT = 1
LONG_POLICIES = ("drop", "truncate")
PERCENTILES = (50, 90, 95, 99, 100)
ENCODE_CHUNK = 8192  # pairs per encode_batch call: big enough for Rust's threads, small in memory


# ------------------------------------------------------------------ prepare
def prepare(data_cfg: DataConfig, out_dir: str | Path, model_max_len: int,
            max_tokens: int = 4096, progress: bool = False,
            corpus: CorpusResult | None = None, force: bool = False,
            tokenizers: Tokenizers | None = None) -> dict[str, Any]:
    """Read ``data_cfg.corpus``, train and save the tokenizer(s) on the train split, write
    every split's text and token ids, and write ``stats.json``. Returns the stats.

    Three passes, each with a progress bar and its rate: reading (normalize, filter, and
    set each pair's split: ``read_pairs``), the tokenizer (on at most
    ``data.tokenizer_max_pairs`` train pairs spread over the split), writing and encoding
    (``write_splits``). Memory: one chunk of pairs, the tokenizer's word counts and its
    word cache, whatever the corpus size.

    ``out_dir`` must be empty or new unless ``force``; it is locked while prepare runs and
    its old contents stay until the new ones are complete (aiayn.io.staged_directory).

    ``model_max_len`` and ``max_tokens`` only feed the report: how many pairs the model's
    length limit would drop or truncate, and the padding of train batches of that budget
    (the ids are written whole; training applies the limit).
    ``corpus``: the result of ``read_corpus(data_cfg.corpus, data_cfg)`` if already read.
    ``tokenizers``: use (and save) these instead of training new ones, e.g. a run's, to
    fine-tune it on this corpus (aiayn.transfer.prepare_from_run).
    """
    with staged_directory(out_dir, force, "aiayn prepare", marker=STATS_FILE) as stage:
        pairs = read_pairs(data_cfg, stage, progress, corpus)
        n_train = pairs.info["splits"]["train"]
        sample = min(n_train, data_cfg.tokenizer_max_pairs)
        if tokenizers is None:
            tokenizers = train_tokenizers(lambda: pairs.train_sample(sample), data_cfg,
                                          progress=progress, total=sample)
        else:  # given (a run's, to fine-tune it on this corpus): nothing is trained
            sample = 0
        tokenizers.save(stage / TOKENIZER_DIR)
        ids = write_splits(stage, pairs, tokenizers, progress)
        pairs.remove()
        stats = {
            **pairs.info,
            "tokenizer": {"kind": tokenizers.kind, "joint": tokenizers.joint,
                          "src_vocab_size": tokenizers.src_vocab_size,
                          "tgt_vocab_size": tokenizers.tgt_vocab_size,
                          "trained_on_pairs": sample},
            **_token_stats(ids, model_max_len, data_cfg.long_policy, max_tokens),
            "ids": {"format": IDS_FORMAT, "directory": IDS_DIR,
                    "pairs": {name: len(split.src) for name, split in ids.items()},
                    "tokenizer_sha256": tokenizer_fingerprint(stage / TOKENIZER_DIR)},
            "data_config": asdict(data_cfg),
        }
        del ids  # unmap before the files move
        atomic_write_text(stage / STATS_FILE, json.dumps(stats, indent=2, ensure_ascii=False) + "\n")
    return stats


class SplitPairs:
    """The pairs of a corpus read once into tab-separated files in the staging directory
    (``{split}.pairs.tsv``, normalized text has no tab or line break), with the split of
    each: the file's own, or for train's file the held-out positions (dev, test)."""

    def __init__(self, directory: Path, files: dict[str, Path], held: dict[int, str],
                 info: dict[str, Any]):
        self.directory, self.files, self.held, self.info = directory, files, held, info

    def routed(self) -> Iterator[tuple[str, str, str]]:
        """(split, source, target) for every pair, each split in corpus order."""
        for split, path in self.files.items():
            with open(path, encoding="utf-8", newline="\n") as fh:
                if split == "train" and self.held:
                    held = self.held
                    for i, line in enumerate(fh):
                        src, tgt = line[:-1].split("\t")
                        yield held.get(i, "train"), src, tgt
                else:
                    for line in fh:
                        src, tgt = line[:-1].split("\t")
                        yield split, src, tgt

    def train_sample(self, k: int) -> Iterator[tuple[str, str]]:
        """``k`` train pairs spread evenly over the train split (all of them when k >= n)."""
        n = self.info["splits"]["train"]
        k = min(k, n)
        wanted = (np.arange(k, dtype=np.int64) * n) // max(1, k)  # train positions
        # The line of train position t is t plus the held-out lines before it.
        held = np.sort(np.fromiter(self.held, dtype=np.int64, count=len(self.held)))
        lines = wanted + np.searchsorted(held - np.arange(len(held)), wanted, side="right")
        take = np.zeros(n + len(held), dtype=bool)
        take[lines] = True
        with open(self.files["train"], encoding="utf-8", newline="\n") as fh:
            for line in itertools.compress(fh, take):
                src, tgt = line[:-1].split("\t")
                yield src, tgt

    def remove(self) -> None:
        for path in self.files.values():
            path.unlink()


def read_pairs(cfg: DataConfig, directory: Path, progress: bool = False,
               corpus: CorpusResult | None = None) -> SplitPairs:
    """Pass 1: stream the corpus (``aiayn.corpora.CorpusStream``) into tab-separated files,
    one per split it has, and choose the held-out positions
    (``aiayn.corpora.held_out_positions``). ``info`` holds what was read, dropped and kept
    and the split rule (the first keys of stats.json)."""
    if corpus is not None:  # already read and split, in memory
        source = ((p, name) for name in SPLITS for p in corpus.splits[name])
    else:
        source = stream = CorpusStream(cfg.corpus, cfg, progress)
    files = {name: directory / f"{name}.pairs.tsv" for name in SPLITS}
    counts = dict.fromkeys(SPLITS, 0)
    with contextlib.ExitStack() as stack:
        handles = {name: stack.enter_context(open(path, "w", encoding="utf-8", newline="\n"))
                   for name, path in files.items()}
        for pair, split in source:
            src, tgt = pair.src, pair.tgt
            if "\t" in src or "\t" in tgt or "\n" in src or "\n" in tgt:
                raise AiaynError(f"{pair.ref}: a tab or line break in normalized text")
            handles[split].write(f"{src}\t{tgt}\n")
            counts[split] += 1
    if corpus is not None:
        info = _corpus_info(cfg.corpus, corpus.description, corpus.read, corpus.dropped,
                            corpus.split_rule, counts)
        return SplitPairs(directory, files, {}, info)
    stream.check_kept(counts)
    chosen, rule = held_out_positions(counts["train"], stream.given, cfg, cfg.corpus)
    held = {int(i): name for name, positions in chosen.items() for i in positions}
    counts["train"] -= len(held)
    counts.update({name: len(positions) for name, positions in chosen.items()})
    info = _corpus_info(cfg.corpus, stream.description, stream.read, stream.dropped,
                        stream.split_rule or rule, counts)
    return SplitPairs(directory, files, held, info)


def _corpus_info(spec: str, description: str, read: int, dropped: dict[str, int],
                 split_rule: str, splits: dict[str, int]) -> dict[str, Any]:
    return {"corpus": spec, "description": description,
            "pairs": {"read": read, "kept": sum(splits.values()), "dropped": dropped},
            "split_rule": split_rule, "splits": splits}


def write_splits(directory: Path, pairs: SplitPairs, tokenizers: Tokenizers,
                 progress: bool = False) -> dict[str, SplitIds]:
    """Pass 3: write each split's text (``{split}.jsonl``) and, encoded in chunks, its ids
    (``ids/``); returns the ids, mapped."""
    encoders = tokenizers.array_encoders()
    writers = {name: [RaggedWriter(directory / IDS_DIR, name, side, encoder.dtype)
                      for side, encoder in zip(SIDES, encoders, strict=True)]
               for name in SPLITS}
    buffers: dict[str, tuple[list[str], list[str]]] = {name: ([], []) for name in SPLITS}

    def flush(name: str) -> None:
        for writer, encoder, sentences in zip(writers[name], encoders, buffers[name],
                                              strict=True):
            writer.append(*encoder.encode(sentences))
            sentences.clear()

    total = sum(pairs.info["splits"].values())
    with contextlib.ExitStack() as stack:
        for pair_writers in writers.values():
            for writer in pair_writers:
                stack.callback(writer.discard)  # closes its files after an error; else no-op
        texts = {name: stack.enter_context(open(directory / f"{name}.jsonl", "w",
                                                encoding="utf-8")) for name in SPLITS}
        bar = stack.enter_context(progress_bar(None, progress, "encoding", total))
        for n, (name, src, tgt) in enumerate(pairs.routed(), 1):
            texts[name].write(_json_line(src, tgt))
            buffer = buffers[name]
            buffer[0].append(src)
            buffer[1].append(tgt)
            if len(buffer[0]) == ENCODE_CHUNK:
                flush(name)
                bar.update(n - bar.n)
        for name in SPLITS:
            flush(name)
        bar.update(total - bar.n)
        for fh in texts.values():
            fh.flush()
            os.fsync(fh.fileno())  # on disk before prepare swaps the directory in
        for pair_writers in writers.values():
            for writer in pair_writers:
                writer.close()
    return {name: SplitIds.open(directory / IDS_DIR, name) for name in SPLITS}


def _json_line(src: str, tgt: str) -> str:
    """``json.dumps({"src": src, "tgt": tgt}, ensure_ascii=False)`` and a line end, written
    out (json.dumps builds an encoder at every call with ensure_ascii=False: 3x slower)."""
    return f'{{"src": {_json_string(src)}, "tgt": {_json_string(tgt)}}}\n'


def _token_stats(ids: dict[str, SplitIds], max_len: int, policy: str,
                 max_tokens: int) -> dict[str, Any]:
    """Tokens per side (without specials), length percentiles (in ids, as the model sees
    them: source + [EOS], [BOS] + target + [EOS]), the max_len rule, train batch padding."""
    tokens, lengths, long_counts = {}, {}, {}
    for name, split in ids.items():
        src_len, tgt_len = split.src.lengths(), split.tgt.lengths()
        tokens[name] = {"src": int(src_len.sum()) - len(src_len),
                        "tgt": int(tgt_len.sum()) - 2 * len(tgt_len)}
        lengths[name] = {"src": percentiles(src_len), "tgt": percentiles(tgt_len)}
        kept, long_counts[name] = fit_to_max_len(src_len, tgt_len, max_len, policy)
        if name == "train":
            sampler = TokenBatchSampler(np.minimum(src_len[kept], max_len),
                                        np.minimum(tgt_len[kept], max_len), max_tokens,
                                        shuffle=False)
    return {
        "tokens": tokens,
        "lengths": lengths,
        "max_len": {"model_max_len": max_len, "policy": policy, **long_counts},
        "batching": {"split": "train", "max_tokens": max_tokens, **sampler.padding_stats()},
    }


def percentiles(values: Sequence[int]) -> dict[str, int]:
    """Nearest-rank percentiles p50..p99 and the max (p100) of integer lengths (>= 0).
    Counted, not sorted: memory and time grow with the longest length, not the corpus."""
    values = np.asarray(values, dtype=np.int64)
    n = len(values)
    if not n:
        return {f"p{p}": 0 for p in PERCENTILES}
    at_most = np.cumsum(np.bincount(values))  # how many values are <= each length
    return {f"p{p}": int(np.searchsorted(at_most, max(1, -(-p * n // 100))))
            for p in PERCENTILES}


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
@dataclass
class Example:
    """One encoded pair: source ids (tokens + [EOS]), target ids ([BOS] + tokens + [EOS]),
    and its position in the split it came from."""

    src: list[int]
    tgt: list[int]
    index: int


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


# ------------------------------------------------------------------ batching
def token_batches(widths: Sequence[int], max_tokens: int, copies: int = 1,
                  order_key: Sequence[int] | None = None) -> list[np.ndarray]:
    """THE batcher: positions grouped into batches of similar width under a token budget.

    ``max_tokens`` bounds a batch's *padded* size, ``sentences x widest x copies``: the
    width of an item is its padded length (training and dev loss: the longer of source and
    target; decoding: the source) and ``copies`` is the beam when decoding. Positions are
    sorted by width (then ``order_key[position]``, then position) and cut greedily in that
    order, so neighbours have nearly equal lengths and little padding is needed. An item
    wider than the budget gets a batch of its own (the training sampler refuses it first).
    Used by the training sampler, dev-loss batching, the Translator and the benchmarks.

    Returns arrays of positions. Vectorized: the greedy cut is worked out once per distinct
    width (a run of equal widths fills batches of ``max_tokens // (width x copies)``), so
    millions of sentences take well under a second and no Python object per sentence.
    """
    widths = np.asarray(widths, dtype=np.int64)
    if order_key is None:
        order = np.argsort(widths, kind="stable")
    else:
        order = np.lexsort((np.asarray(order_key, dtype=np.int64), widths))
    values, starts, counts = np.unique(widths[order], return_index=True, return_counts=True)
    cuts: list[np.ndarray] = []
    open_n = 0  # items in the batch still open
    for width, start, count in zip(values.tolist(), starts.tolist(), counts.tolist(),
                                   strict=True):
        # Sorted by width, so an item of this run is the widest of its batch: it joins the
        # open batch while (items + 1) x width x copies <= max_tokens.
        cap = max(1, max_tokens // (width * copies))
        if open_n >= cap:
            cuts.append(np.array([start]))
            open_n = 0
        take = min(count, cap - open_n)
        rest = count - take
        if rest:
            new = start + take + cap * np.arange(-(-rest // cap))
            cuts.append(new)
            open_n = rest - cap * (len(new) - 1)
        else:
            open_n += take
    boundaries = np.concatenate(cuts) if cuts else np.zeros(0, np.int64)
    return np.split(order, boundaries) if len(order) else []


class TokenBatchSampler:
    """Length-bucketed batches under a token budget, shuffled per epoch, sharded by rank.

    Batches are built once by :func:`token_batches`: example positions sorted by the longer
    side's length (which sets a batch's padded size), then by target minus source length
    (so that the rows of a batch also agree on how long the shorter side is), then by
    position; that order is cut greedily so that
    ``n_sentences * max(longest source, longest target) <= max_tokens``.
    Neighbours in that order have nearly equal lengths on both sides, so little padding is
    needed (about 4% on the Bible with 4096 tokens; lexicographic (source, target) order
    gives 6.5%). Each epoch shuffles the order of the batches (not their contents) under
    ``seed`` and the epoch number. The lengths are numpy arrays (from mapped ids, say), and
    what is held per epoch is one array of positions and the order of the batches.

    Distributed: every rank builds the same batches and takes every ``world_size``-th of
    the epoch's order, starting at ``rank``. When the number of batches does not divide by
    ``world_size``, the largest batches are halved until it does, so every rank runs the
    same number of steps (DistributedDataParallel needs that) and every example is seen
    exactly once per epoch across the ranks.

    The iterator moves to the next epoch by itself when it is exhausted; ``set_epoch(e)``
    with a different epoch jumps there (and is a no-op for the current one, so a resumed
    position is kept). ``state_dict`` records the epoch and the batches already yielded in
    it: a sampler given that state continues with exactly the batches that were left.
    """

    def __init__(self, src_lens: Sequence[int], tgt_lens: Sequence[int], max_tokens: int,
                 shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1):
        src_lens = np.asarray(src_lens, dtype=np.int64)
        tgt_lens = np.asarray(tgt_lens, dtype=np.int64)
        if len(src_lens) != len(tgt_lens):
            raise ValueError(f"{len(src_lens)} source lengths but {len(tgt_lens)} target lengths")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of size {world_size}")
        widths = np.maximum(src_lens, tgt_lens)
        too_long = np.flatnonzero(widths > max_tokens)
        if len(too_long):
            i = int(too_long[0])
            raise AiaynError(
                f"{len(too_long)} example(s) longer than the batch budget train.max_tokens="
                f"{max_tokens} (e.g. position {i}: {widths[i]} tokens); "
                "raise train.max_tokens or lower model.max_len"
            )
        self.src_lens, self.tgt_lens = src_lens, tgt_lens
        self.max_tokens = max_tokens
        self.shuffle, self.seed = shuffle, seed
        self.rank, self.world_size = rank, world_size
        by_shape = token_batches(widths, max_tokens, order_key=tgt_lens - src_lens)
        self.batches = _even_batches(by_shape, world_size)
        self.epoch = 0
        self._offset = 0  # batches of this epoch already yielded on this rank

    def _epoch_order(self, epoch: int) -> list[np.ndarray]:
        """This rank's batches for ``epoch``."""
        order = list(range(len(self.batches)))
        if self.shuffle:
            random.Random(f"aiayn-batches-{self.seed}-{epoch}").shuffle(order)
        return [self.batches[b] for b in order[self.rank::self.world_size]]

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self._offset = epoch, 0

    def __iter__(self):
        order = self._epoch_order(self.epoch)
        while self._offset < len(order):
            self._offset += 1
            yield order[self._offset - 1].tolist()
        self.epoch, self._offset = self.epoch + 1, 0

    def __len__(self) -> int:
        """Batches per epoch on this rank (the same on every rank)."""
        return len(self.batches) // self.world_size

    def state_dict(self) -> dict[str, int]:
        """Epoch and batches yielded in it (the stream does not prefetch: yielded = trained on)."""
        return {"epoch": self.epoch, "batches_yielded": self._offset, "n_batches": len(self.batches),
                "world_size": self.world_size, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("n_batches", "world_size", "seed"):
            mine = len(self.batches) if key == "n_batches" else getattr(self, key)
            if state.get(key) != mine:
                raise AiaynError(
                    f"cannot resume the batch order: it was saved with {key}={state.get(key)}, "
                    f"now {key}={mine} (same prepared data, train.max_tokens, seed and number "
                    "of processes are needed for an exact resume)"
                )
        self.epoch, self._offset = int(state["epoch"]), int(state["batches_yielded"])

    def padding_stats(self) -> dict[str, float | int]:
        """How much of the padded batches is padding, both sides together."""
        if not self.batches:
            return {"batches": 0, "examples": 0, "mean_sentences_per_batch": 0.0,
                    "padding_fraction": 0.0}
        flat = np.concatenate(self.batches)
        sizes = np.fromiter(map(len, self.batches), dtype=np.int64, count=len(self.batches))
        starts = np.cumsum(sizes) - sizes
        src, tgt = self.src_lens[flat], self.tgt_lens[flat]
        real = int(src.sum() + tgt.sum())
        slots = int((sizes * (np.maximum.reduceat(src, starts)
                              + np.maximum.reduceat(tgt, starts))).sum())
        return {
            "batches": len(self.batches),
            "examples": len(self.src_lens),
            "mean_sentences_per_batch": round(len(self.src_lens) / max(1, len(self.batches)), 2),
            "padding_fraction": round(1 - real / slots, 4) if slots else 0.0,
        }


def _even_batches(batches: list[np.ndarray], world_size: int) -> list[np.ndarray]:
    """Halve the batches with the most sentences until their number divides by
    ``world_size`` (halves never exceed the budget of the whole)."""
    batches = list(batches)
    while len(batches) % world_size:
        largest = max(range(len(batches)), key=lambda b: (len(batches[b]), -b))
        batch = batches[largest]
        if len(batch) == 1:
            raise AiaynError(
                f"{len(batches)} single-sentence batches cannot be shared evenly by "
                f"{world_size} processes; use fewer processes, more data or a larger "
                "train.max_tokens"
            )
        half = (len(batch) + 1) // 2
        batches[largest: largest + 1] = [batch[:half], batch[half:]]
    return batches


# ------------------------------------------------------------------ batches as tensors
@dataclass
class Batch:
    """Padded tensors for one step: ``src`` (B, S); decoder input ``tgt_in`` = tgt[:-1] and
    labels ``tgt_out`` = tgt[1:] (B, T); ``n_tokens`` real target tokens (non-pad labels);
    ``index`` (B,) the examples' positions in their split."""

    src: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor
    n_tokens: int
    index: torch.Tensor

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        return Batch(move(self.src), move(self.tgt_in), move(self.tgt_out), self.n_tokens,
                     move(self.index))

    def __len__(self) -> int:
        return self.src.size(0)


def length_multiple(bf16: bool) -> int:
    """What a batch's sequence lengths are padded up to (see :func:`collate`).

    In bfloat16 a CPU runs its matmuls through oneDNN, which compiles a kernel for every new
    shape it meets and keeps a bounded cache of them. Length-bucketed batches come in
    hundreds of shapes (668 in an epoch of the demo's Bible batches), so bf16 training spent
    much of its time compiling kernels. Lengths padded to a multiple of 8 leave 114 shapes
    for ~9% more padding: 1.39x the target tokens/s of exact lengths on a 2-core Xeon with
    AMX, where a multiple of 16 (84 shapes, ~19% more padding) gave 1.32x
    (benchmarks/bf16_shapes.py). GPUs' bf16 tensor cores want multiples of 8 too. fp32 runs
    through BLAS, which has no per-shape cost: no padding there (it cost 6%).
    """
    return 8 if bf16 else 1


def collate(examples: list[Example], pad_id: int = PAD_ID, multiple: int = 1) -> Batch:
    """Pad a list of examples into a Batch (right padding with ``pad_id``, each side's length
    rounded up to ``multiple``: more padding never changes a loss, only a batch's shape)."""
    if not examples:
        raise ValueError("collate needs at least one example")
    src = pad([e.src for e in examples], pad_id, multiple)
    tgt_in = pad([e.tgt[:-1] for e in examples], pad_id, multiple)
    tgt_out = pad([e.tgt[1:] for e in examples], pad_id, multiple)
    index = torch.tensor([e.index for e in examples], dtype=torch.long)
    return Batch(src, tgt_in, tgt_out, int((tgt_out != pad_id).sum()), index)


def pad(seqs: list[list[int]], pad_id: int = PAD_ID, multiple: int = 1) -> torch.Tensor:
    """Right-pad id lists into a (B, L) LongTensor, L = the longest rounded up to ``multiple``."""
    longest = max(len(s) for s in seqs)
    out = torch.full((len(seqs), -(-longest // multiple) * multiple), pad_id, dtype=torch.long)
    for row, seq in enumerate(seqs):
        out[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return out


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


__all__ = [
    "BOS_ID", "EOS_ID", "PAD_ID", "Batch", "EncodedSplit", "Example", "Prepared", "SplitIds",
    "TokenBatchSampler", "collate", "encode_split", "fit_to_max_len", "length_multiple",
    "load_prepared", "pad",
    "prepare", "sample_batch", "token_batches",
]
