"""Prepared data, encoded examples, length-bucketed token-budget batches, collate.

``prepare`` turns a corpus spec into a directory::

    DIR/train.jsonl, dev.jsonl, test.jsonl   {"src": ..., "tgt": ...} per line
    DIR/tokenizer/                           see aiayn.tokenizer
    DIR/stats.json                           what was read, dropped, kept; tokens; lengths

and running it twice gives identical files. Training then encodes each split
(``encode_split``), batches it by length under a token budget (``TokenBatchSampler``, the
way the paper batched: "sentence pairs were batched together by approximate sequence
length", section 5.1) and pads each batch (``collate``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from aiayn.config import DataConfig
from aiayn.corpora import SPLITS, CorpusResult, read_corpus
from aiayn.errors import AiaynError
from aiayn.io import atomic_write_text, staged_directory
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizers, train_tokenizers

STATS_FILE = "stats.json"
TOKENIZER_DIR = "tokenizer"
LONG_POLICIES = ("drop", "truncate")
PERCENTILES = (50, 90, 95, 99, 100)


# ------------------------------------------------------------------ prepare
def prepare(data_cfg: DataConfig, out_dir: str | Path, model_max_len: int,
            max_tokens: int = 4096, progress: bool = False,
            corpus: CorpusResult | None = None, force: bool = False,
            tokenizers: Tokenizers | None = None) -> dict[str, Any]:
    """Read ``data_cfg.corpus``, write the splits, train and save the tokenizer(s) on the
    train split, and write ``stats.json``. Returns the stats.

    ``out_dir`` must be empty or new unless ``force``; it is locked while prepare runs and
    its old contents stay until the new ones are complete (aiayn.io.staged_directory).

    ``model_max_len`` and ``max_tokens`` only feed the report: how many pairs the model's
    length limit would drop or truncate, and the padding of train batches of that budget.
    ``corpus``: the result of ``read_corpus(data_cfg.corpus, data_cfg)`` if already read.
    ``tokenizers``: use (and save) these instead of training new ones, e.g. a run's, to
    fine-tune it on this corpus (aiayn.transfer.prepare_from_run).
    """
    with staged_directory(out_dir, force, "aiayn prepare", marker=STATS_FILE) as out:
        return _write_prepared(data_cfg, out, model_max_len, max_tokens, progress, corpus,
                               tokenizers)


def _write_prepared(data_cfg: DataConfig, out: Path, model_max_len: int, max_tokens: int,
                    progress: bool, corpus: CorpusResult | None,
                    tokenizers: Tokenizers | None) -> dict[str, Any]:
    if corpus is None:
        corpus = read_corpus(data_cfg.corpus, data_cfg, progress=progress)
    splits = {name: corpus.texts(name) for name in SPLITS}
    for name, pairs in splits.items():
        atomic_write_text(out / f"{name}.jsonl", _jsonl(pairs))
    if tokenizers is None:
        tokenizers = train_tokenizers(splits["train"], data_cfg, progress=progress)
    tokenizers.save(out / TOKENIZER_DIR)
    stats = {
        "corpus": data_cfg.corpus,
        "description": corpus.description,
        "pairs": {"read": corpus.read, "kept": corpus.kept, "dropped": corpus.dropped},
        "split_rule": corpus.split_rule,
        "splits": {name: len(pairs) for name, pairs in splits.items()},
        "tokenizer": {"kind": tokenizers.kind, "joint": tokenizers.joint,
                      "src_vocab_size": tokenizers.src_vocab_size,
                      "tgt_vocab_size": tokenizers.tgt_vocab_size},
        **_token_stats(splits, tokenizers, model_max_len, data_cfg.long_policy, max_tokens),
        "data_config": asdict(data_cfg),
    }
    atomic_write_text(out / STATS_FILE, json.dumps(stats, indent=2, ensure_ascii=False) + "\n")
    return stats


def _jsonl(pairs: list[tuple[str, str]]) -> str:
    return "".join(json.dumps({"src": s, "tgt": t}, ensure_ascii=False) + "\n" for s, t in pairs)


def _token_stats(splits: dict[str, list[tuple[str, str]]], tokenizers: Tokenizers,
                 max_len: int, policy: str, max_tokens: int) -> dict[str, Any]:
    """Tokens per side (without specials), length percentiles (in ids, as the model sees
    them: source + [EOS], [BOS] + target + [EOS]), the max_len rule, train batch padding."""
    tokens, lengths, long_counts = {}, {}, {}
    for name, pairs in splits.items():
        src_ids = tokenizers.encode_src([s for s, _ in pairs])
        tgt_ids = tokenizers.encode_tgt([t for _, t in pairs])
        tokens[name] = {"src": sum(len(x) - 1 for x in src_ids),
                        "tgt": sum(len(x) - 2 for x in tgt_ids)}
        lengths[name] = {"src": percentiles([len(x) for x in src_ids]),
                         "tgt": percentiles([len(x) for x in tgt_ids])}
        kept, long_counts[name] = _fit_to_max_len(src_ids, tgt_ids, max_len, policy)
        if name == "train":
            sampler = TokenBatchSampler([len(src_ids[i]) for i in kept],
                                        [len(tgt_ids[i]) for i in kept], max_tokens,
                                        shuffle=False)
    return {
        "tokens": tokens,
        "lengths": lengths,
        "max_len": {"model_max_len": max_len, "policy": policy, **long_counts},
        "batching": {"split": "train", "max_tokens": max_tokens, **sampler.padding_stats()},
    }


def percentiles(values: list[int]) -> dict[str, int]:
    """Nearest-rank percentiles p50..p99 and the max (p100) of integer lengths."""
    if not values:
        return {f"p{p}": 0 for p in PERCENTILES}
    ordered = sorted(values)
    n = len(ordered)
    return {f"p{p}": ordered[max(0, -(-p * n // 100) - 1)] for p in PERCENTILES}


# ------------------------------------------------------------------ loading
@dataclass
class Prepared:
    """A prepared data directory in memory."""

    train: list[tuple[str, str]]
    dev: list[tuple[str, str]]
    test: list[tuple[str, str]]
    tokenizers: Tokenizers
    stats: dict[str, Any]

    def split(self, name: str) -> list[tuple[str, str]]:
        if name not in SPLITS:
            raise AiaynError(f"unknown split {name!r}; one of {', '.join(SPLITS)}")
        return getattr(self, name)


def load_prepared(data_dir: str | Path) -> Prepared:
    """Read what ``prepare`` wrote; a clear error when something is missing."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise AiaynError(f"{data_dir}: prepared data directory not found "
                         "(make one with `aiayn prepare --out DIR`)")
    splits = {name: read_split(data_dir / f"{name}.jsonl") for name in SPLITS}
    stats_path = data_dir / STATS_FILE
    try:
        stats = json.loads(stats_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AiaynError(f"{stats_path}: missing; run `aiayn prepare` again") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AiaynError(f"{stats_path}: not valid JSON ({exc})") from None
    tokenizers = Tokenizers.load(data_dir / TOKENIZER_DIR)
    return Prepared(**splits, tokenizers=tokenizers, stats=stats)


def read_split(path: Path) -> list[tuple[str, str]]:
    """The (src, tgt) pairs of one prepared ``.jsonl`` split."""
    if not path.is_file():
        raise AiaynError(f"{path}: missing; is {path.parent} a directory made by `aiayn prepare`?")
    pairs = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            try:
                record = json.loads(line)
                pairs.append((record["src"], record["tgt"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise AiaynError(f"{path}: line {number} is not a {{\"src\", \"tgt\"}} "
                                 "JSON object") from None
    return pairs


# ------------------------------------------------------------------ encoding
@dataclass
class Example:
    """One encoded pair: source ids (tokens + [EOS]), target ids ([BOS] + tokens + [EOS]),
    and its position in the split it came from."""

    src: list[int]
    tgt: list[int]
    index: int


def encode_split(pairs: list[tuple[str, str]], tokenizers: Tokenizers, max_len: int,
                 policy: str) -> tuple[list[Example], dict[str, int]]:
    """Encode pairs; a pair whose source or target ids are longer than ``max_len`` is
    dropped (``policy="drop"``) or cut to ``max_len`` keeping its [EOS] (``"truncate"``).

    Returns the examples and counts ``{"pairs", "kept", "dropped_too_long", "truncated"}``;
    it never raises for a long pair, so no epoch can stop halfway."""
    src_ids = tokenizers.encode_src([s for s, _ in pairs])
    tgt_ids = tokenizers.encode_tgt([t for _, t in pairs])
    kept, counts = _fit_to_max_len(src_ids, tgt_ids, max_len, policy)
    examples = [Example(src_ids[i], tgt_ids[i], i) for i in kept]
    return examples, counts


def _fit_to_max_len(src_ids: list[list[int]], tgt_ids: list[list[int]], max_len: int,
                    policy: str) -> tuple[list[int], dict[str, int]]:
    """Apply the long-pair policy in place; returns the kept positions and the counts."""
    if policy not in LONG_POLICIES:
        raise AiaynError(f"data.long_policy must be one of {', '.join(LONG_POLICIES)}, "
                         f"got {policy!r}")
    if max_len < 3:
        raise AiaynError(f"model.max_len must be at least 3 ([BOS] token [EOS]), got {max_len}")
    kept, dropped, truncated = [], 0, 0
    for i, (src, tgt) in enumerate(zip(src_ids, tgt_ids, strict=True)):
        if len(src) <= max_len and len(tgt) <= max_len:
            kept.append(i)
        elif policy == "drop":
            dropped += 1
        else:
            src_ids[i] = src[: max_len - 1] + [EOS_ID] if len(src) > max_len else src
            tgt_ids[i] = tgt[: max_len - 1] + [EOS_ID] if len(tgt) > max_len else tgt
            truncated += 1
            kept.append(i)
    counts = {"pairs": len(src_ids), "kept": len(kept), "dropped_too_long": dropped,
              "truncated": truncated}
    return kept, counts


# ------------------------------------------------------------------ batching
def token_batches(widths: Sequence[int], max_tokens: int, copies: int = 1,
                  order_key: Callable[[int], Any] | None = None) -> list[list[int]]:
    """THE batcher: positions grouped into batches of similar width under a token budget.

    ``max_tokens`` bounds a batch's *padded* size, ``sentences x widest x copies``: the
    width of an item is its padded length (training and dev loss: the longer of source and
    target; decoding: the source) and ``copies`` is the beam when decoding. Positions are
    sorted by width (then ``order_key(position)``, then position) and cut greedily in that
    order, so neighbours have nearly equal lengths and little padding is needed. An item
    wider than the budget gets a batch of its own (the training sampler refuses it first).
    Used by the training sampler, dev-loss batching, the Translator and the benchmarks.
    """
    tiebreak = order_key or (lambda i: 0)
    order = sorted(range(len(widths)), key=lambda i: (widths[i], tiebreak(i), i))
    batches: list[list[int]] = []
    batch: list[int] = []
    for i in order:
        # Sorted by width, so the newest item is the widest: the padded size is n x its width.
        if batch and (len(batch) + 1) * widths[i] * copies > max_tokens:
            batches.append(batch)
            batch = []
        batch.append(i)
    if batch:
        batches.append(batch)
    return batches


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
    ``seed`` and the epoch number.

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

    def __init__(self, src_lens: list[int], tgt_lens: list[int], max_tokens: int,
                 shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1):
        if len(src_lens) != len(tgt_lens):
            raise ValueError(f"{len(src_lens)} source lengths but {len(tgt_lens)} target lengths")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of size {world_size}")
        too_long = [i for i, (s, t) in enumerate(zip(src_lens, tgt_lens, strict=True))
                    if max(s, t) > max_tokens]
        if too_long:
            i = too_long[0]
            raise AiaynError(
                f"{len(too_long)} example(s) longer than the batch budget train.max_tokens="
                f"{max_tokens} (e.g. position {i}: {max(src_lens[i], tgt_lens[i])} tokens); "
                "raise train.max_tokens or lower model.max_len"
            )
        self.src_lens, self.tgt_lens = list(src_lens), list(tgt_lens)
        self.max_tokens = max_tokens
        self.shuffle, self.seed = shuffle, seed
        self.rank, self.world_size = rank, world_size
        widths = [max(s, t) for s, t in zip(src_lens, tgt_lens, strict=True)]
        by_shape = token_batches(widths, max_tokens, order_key=lambda i: tgt_lens[i] - src_lens[i])
        self.batches = _even_batches(by_shape, world_size)
        self.epoch = 0
        self._offset = 0  # batches of this epoch already yielded on this rank

    def _epoch_order(self, epoch: int) -> list[list[int]]:
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
            yield list(order[self._offset - 1])
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
        real = slots = 0
        for batch in self.batches:
            src = [self.src_lens[i] for i in batch]
            tgt = [self.tgt_lens[i] for i in batch]
            real += sum(src) + sum(tgt)
            slots += len(batch) * (max(src) + max(tgt))
        return {
            "batches": len(self.batches),
            "examples": len(self.src_lens),
            "mean_sentences_per_batch": round(len(self.src_lens) / max(1, len(self.batches)), 2),
            "padding_fraction": round(1 - real / slots, 4) if slots else 0.0,
        }


def _even_batches(batches: list[list[int]], world_size: int) -> list[list[int]]:
    """Halve the batches with the most sentences until their number divides by
    ``world_size`` (halves never exceed the budget of the whole)."""
    batches = [list(b) for b in batches]
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


def collate(examples: list[Example], pad_id: int = PAD_ID) -> Batch:
    """Pad a list of examples into a Batch (right padding with ``pad_id``)."""
    if not examples:
        raise ValueError("collate needs at least one example")
    src = pad([e.src for e in examples], pad_id)
    tgt_in = pad([e.tgt[:-1] for e in examples], pad_id)
    tgt_out = pad([e.tgt[1:] for e in examples], pad_id)
    index = torch.tensor([e.index for e in examples], dtype=torch.long)
    return Batch(src, tgt_in, tgt_out, int((tgt_out != pad_id).sum()), index)


def pad(seqs: list[list[int]], pad_id: int = PAD_ID) -> torch.Tensor:
    """Right-pad id lists into a (B, longest) LongTensor."""
    out = torch.full((len(seqs), max(len(s) for s in seqs)), pad_id, dtype=torch.long)
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
    "BOS_ID", "EOS_ID", "PAD_ID", "Batch", "Example", "Prepared", "TokenBatchSampler",
    "collate", "encode_split", "load_prepared", "pad", "prepare", "sample_batch", "token_batches",
]
