"""THE length-bucketed batcher, and batches as tensors.

``token_batches`` groups positions into batches of similar length under a token budget
(the paper: "sentence pairs were batched together by approximate sequence length",
section 5.1); ``TokenBatchSampler`` is training's use of it (shuffled per epoch, sharded
by rank, resumable); ``collate`` pads encoded pairs (``Example``) into a ``Batch`` and
``pad`` pads id lists. Used by training, validation, `aiayn evaluate`, the Translator and
the benchmarks; it reads no files (the examples come from ``aiayn.data.prepared``).
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from aiayn.data.tokenizer import PAD_ID
from aiayn.errors import AiaynError


# ------------------------------------------------------------------ encoded pairs
@dataclass
class Example:
    """One encoded pair: source ids (tokens + [EOS]), target ids ([BOS] + tokens + [EOS]),
    and its position in the split it came from."""

    src: list[int]
    tgt: list[int]
    index: int



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


def length_curriculum(widths: Sequence[int], start: float, rng: random.Random) -> list[int]:
    """The order in which a competence curriculum (Platanios et al. 2019) takes n batches of
    these widths: step p draws uniformly among the batches not yet taken of the narrowest
    c(p) = min(1, sqrt(start^2 + (1 - start^2) p / n)) (ties in width broken at random), so
    the pass starts on the narrowest ``start`` of them and widens to all by its end; each
    batch comes once. Deterministic given ``rng``'s state."""
    n = len(widths)
    keys = [rng.random() for _ in range(n)]
    by_ease = sorted(range(n), key=lambda i: (widths[i], keys[i]))
    unused = list(range(n))  # ranks in by_ease not taken yet, ascending
    order = []
    for p in range(n):
        competence = min(1.0, math.sqrt(start ** 2 + (1 - start ** 2) * p / n))
        allowed = bisect.bisect_left(unused, math.ceil(competence * n)) or len(unused)
        order.append(by_ease[unused.pop(rng.randrange(allowed))])
    return order


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

    Weighted corpora (``groups``: the corpus of each example, ``weights``: each corpus's
    share of the batches, aiayn.data.directions): every corpus is batched on its own, and an
    epoch (as many batches as the corpora have together) takes from corpus g its share,
    ``weights[g] / sum(weights)`` of the batches, going round its own batches in an order
    shuffled anew each time round (a small corpus of weight 1 beside a large one of weight 1
    is seen many times in an epoch, the large one in part); the epoch's batches are then
    shuffled together. Each epoch's order is a function of ``seed`` and its number alone,
    so a resume continues it exactly.

    ``curriculum_start`` (None: none): the first epoch's batches in the order of a length
    curriculum (``length_curriculum``) instead of shuffled, from the narrowest up; the
    ranks take every ``world_size``-th of that one order, so they all start short.

    The iterator moves to the next epoch by itself when it is exhausted; ``set_epoch(e)``
    with a different epoch jumps there (and is a no-op for the current one, so a resumed
    position is kept). ``state_dict`` records the epoch and the batches already yielded in
    it: a sampler given that state continues with exactly the batches that were left.
    """

    def __init__(self, src_lens: Sequence[int], tgt_lens: Sequence[int], max_tokens: int,
                 shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1,
                 groups: Sequence[int] | None = None, weights: Sequence[float] | None = None,
                 curriculum_start: float | None = None):
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
        self.curriculum_start = curriculum_start
        self.rank, self.world_size = rank, world_size
        self.shares: list[int] = []  # batches of each corpus per epoch (weighted corpora)
        if weights is None:
            by_shape = token_batches(widths, max_tokens, order_key=tgt_lens - src_lens)
            self.batches = _even_batches(by_shape, world_size)
        else:
            groups = np.asarray(groups, dtype=np.int64)
            self.group_batches = []
            for g in range(len(weights)):
                members = np.flatnonzero(groups == g)
                self.group_batches.append([members[b] for b in token_batches(
                    widths[members], max_tokens, order_key=(tgt_lens - src_lens)[members])])
            self.batches = [b for batches in self.group_batches for b in batches]
            self.shares = _shares([len(b) for b in self.group_batches], weights, world_size)
        self.epoch = 0
        self._offset = 0  # batches of this epoch already yielded on this rank

    def _epoch_order(self, epoch: int) -> list[np.ndarray]:
        """This rank's batches for ``epoch``."""
        if self.shares:
            batches = self._weighted_order(epoch)
        elif epoch == 0 and self.curriculum_start is not None:
            batches = self.batches
        else:
            order = list(range(len(self.batches)))
            if self.shuffle:
                random.Random(f"aiayn-batches-{self.seed}-{epoch}").shuffle(order)
            batches = [self.batches[b] for b in order]
        if epoch == 0 and self.curriculum_start is not None:
            widths = [int(max(self.src_lens[b].max(), self.tgt_lens[b].max())) for b in batches]
            rng = random.Random(f"curriculum-{self.seed}")
            batches = [batches[i] for i in length_curriculum(widths, self.curriculum_start, rng)]
        return batches[self.rank::self.world_size]

    def _weighted_order(self, epoch: int) -> list[np.ndarray]:
        """Every rank's batches of ``epoch`` with weighted corpora: corpus g's batches
        ``epoch * share`` to ``(epoch + 1) * share`` of its endless round, each round in an
        order of its own, the epoch shuffled together."""
        chosen: list[np.ndarray] = []
        for g, (batches, share) in enumerate(zip(self.group_batches, self.shares, strict=True)):
            rounds: dict[int, list[int]] = {}
            for p in range(epoch * share, (epoch + 1) * share):
                r = p // len(batches)
                if r not in rounds:
                    rounds[r] = list(range(len(batches)))
                    random.Random(f"aiayn-corpus-{self.seed}-{g}-{r}").shuffle(rounds[r])
                chosen.append(batches[rounds[r][p % len(batches)]])
        random.Random(f"aiayn-batches-{self.seed}-{epoch}").shuffle(chosen)
        return chosen

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
        return (sum(self.shares) if self.shares else len(self.batches)) // self.world_size

    def state_dict(self) -> dict[str, int | float | None]:
        """Epoch and batches yielded in it (``aiayn.training.loop.BatchStream`` saves the state from
        before a batch it drew ahead, so a saved state counts the batches trained on)."""
        return {"epoch": self.epoch, "batches_yielded": self._offset, "n_batches": len(self.batches),
                "world_size": self.world_size, "seed": self.seed,
                "curriculum_start": self.curriculum_start}

    def load_state_dict(self, state: dict[str, int | float | None]) -> None:
        for key in ("n_batches", "world_size", "seed"):
            mine = len(self.batches) if key == "n_batches" else getattr(self, key)
            if state.get(key) != mine:
                raise AiaynError(
                    f"cannot resume the batch order: it was saved with {key}={state.get(key)}, "
                    f"now {key}={mine} (same prepared data, train.max_tokens, seed and number "
                    "of processes are needed for an exact resume)"
                )
        saved = state.get("curriculum_start")  # a state saved before curricula: none
        if state["epoch"] == 0 and saved != self.curriculum_start:
            def said(start):
                return "none" if start is None else f"length from {start:g}"
            raise AiaynError(
                f"cannot resume the first pass's batch order: it was saved with the curriculum "
                f"{said(saved)}, now {said(self.curriculum_start)} (give the run's "
                "train.curriculum and train.curriculum_start again)")
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


def _shares(sizes: list[int], weights: Sequence[float], world_size: int) -> list[int]:
    """Batches of each corpus in an epoch of ``sum(sizes)`` batches: its weight's share,
    rounded (at least one for a corpus that has batches); the corpus of the largest weight
    takes the few more that make the total divide by ``world_size``."""
    total, weight = sum(sizes), sum(w for w, n in zip(weights, sizes, strict=True) if n)
    shares = [max(1, round(total * w / weight)) if n else 0
              for w, n in zip(weights, sizes, strict=True)]
    largest = max(range(len(sizes)), key=lambda g: (sizes[g] > 0, weights[g]))
    shares[largest] += -sum(shares) % world_size
    return shares


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
    """Right-pad id lists into a (B, L) LongTensor, L = the longest rounded up to ``multiple``.

    One copy of all ids into the positions a mask marks, not a tensor per row: 12x faster
    for a 25,000-token batch, time a GPU's training loop otherwise waited for
    (docs/findings.md#the-training-loop-on-a-gpu)."""
    lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    width = -(-int(lengths.max()) // multiple) * multiple
    ids = np.fromiter(chain.from_iterable(seqs), dtype=np.int64, count=int(lengths.sum()))
    out = np.full((len(seqs), width), pad_id, dtype=np.int64)
    out[np.arange(width) < lengths[:, None]] = ids  # row by row, as chain reads them
    return torch.from_numpy(out)
