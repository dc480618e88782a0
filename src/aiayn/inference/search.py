"""Decoding: batched greedy search and batched beam search over the model's KV cache.

Source ids are ``tokens + [EOS]``; a hypothesis starts with BOS and ends at EOS. The
source is encoded once; every step feeds only the newest token through the decoder and
reuses the cached keys/values of the earlier ones (``use_cache=False`` re-runs the whole
prefix instead, as the tutorials do: same tokens, far slower).

Rules shared by both searches:

- Output length limit, per sentence: ``source length + max_len_b`` new tokens (the paper,
  6.1: "input length + 50"), and never more than ``model.cfg.max_len - 1`` (the target
  sequence ``[BOS] + tokens + [EOS]`` must fit the model's positions). The source length
  counts its EOS. A hypothesis that reaches the limit without EOS ends there.
- PAD and BOS are never generated (their logits are set to -inf).
- A sentence that is done leaves the batch (its cache rows are dropped), so short
  sentences in a batch cost nothing once they are finished, and the result for a sentence
  does not depend on the others in its batch.

Beam search (the paper, 6.1: beam 4, length penalty alpha 0.6) scores a hypothesis Y by

    score(Y) = log P(Y | X) / lp(Y),   lp(Y) = ((5 + |Y|) / 6) ** alpha     (GNMT, Wu et al. 2016)

where |Y| counts the generated tokens including the final EOS. Each step expands the
``beam`` live hypotheses of a sentence by every token, takes the ``2 * beam`` best
candidates by log-probability, moves those that end in EOS *and* rank among the first
``beam`` to the sentence's finished list, and keeps the ``beam`` best that do not end in
EOS alive. A sentence is done when it has ``beam`` finished hypotheses or reaches its
length limit (its live hypotheses are then finished as they are). With ``beam=1`` this is
exactly greedy search; with a beam wider than the number of possible hypotheses it is
exhaustive search (both are tests).

Two options change what the searches may choose (both off by default):

- ``no_repeat_ngram=n`` (``decode.no_repeat_ngram``; CTranslate2's and Transformers'
  ``no_repeat_ngram_size``): a token that would complete an n-gram already in the
  hypothesis gets logit -inf (``ban_repeated_ngrams``), so no hypothesis holds the same
  n-gram twice. It acts in ``_DecoderState.next_logits``, the one step that greedy, beam,
  joined search and sampling share; at n=0 it does nothing at all.
- ``sampling`` (a ``Sampling``): instead of searching, each of ``beam`` rows per sentence
  draws its next token from the model's distribution at a temperature, cut to the top-k
  pieces and to the nucleus of mass top-p (Holtzman et al. 2020), until it draws EOS or
  reaches the limit. The draws come from a counter-based generator keyed by the seed, the
  sentence's source ids, the sample's number and the step (``_uniforms``), so a sample
  depends on nothing else: not on the other sentences of its batch, their order, the batch
  budget, the threads, or when it joined a running search. Its score is as beam search's:
  the model's log-probability (temperature 1) divided by the length penalty.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from aiayn.model import OutputKernel, Transformer

NEVER_GENERATED = (PAD_ID, BOS_ID)

class Hypothesis(NamedTuple):
    """One search result; a tuple, so ``ids, score = hypothesis`` works."""

    ids: list[int]  # token ids, without BOS and EOS
    score: float  # log-probability / length penalty (greedy search reports 0.0)


@dataclass(frozen=True)
class Sampling:
    """Random sampling instead of search (see the module docstring). Frozen: part of a
    ``Search``, which keys the searches of `aiayn serve`."""

    temperature: float = 1.0  # the logits are divided by it: < 1 sharper, > 1 flatter
    top_k: int = 0  # draw among the k most likely pieces only (0: all)
    top_p: float = 1.0  # ... and among the fewest whose probabilities sum to top_p (1: all)
    seed: int | None = None  # the same seed, sentence and settings give the same samples


@dataclass(frozen=True)
class Search:
    """Every setting of one search, as one hashable value: `aiayn serve` joins in one
    ``JoinableSearch`` only sentences whose ``Search`` is equal. ``beam``: the beam's
    width, or with ``sampling`` the samples drawn per sentence."""

    beam: int = 4
    alpha: float = 0.6
    no_repeat_ngram: int = 0
    sampling: Sampling | None = None


def output_limits(model: Transformer, src_pad: Tensor, max_len_b: int = 50) -> Tensor:
    """(B,) most new tokens (EOS included) per sentence: source length + max_len_b, capped
    so that ``[BOS] + tokens + [EOS]`` fits in ``model.cfg.max_len`` positions."""
    src_len = (~src_pad).sum(dim=1)
    return (src_len + max_len_b).clamp(min=1, max=max(1, model.cfg.max_len - 1))


def length_penalty(length: int | Tensor, alpha: float) -> float | Tensor:
    """GNMT length penalty lp(Y) = ((5 + |Y|) / 6) ** alpha; alpha = 0 means no penalty."""
    return ((5 + length) / 6) ** alpha


class _DecoderState:
    """The encoder output and decoder cache for the rows still being decoded.

    Rows are sentences (greedy) or sentence-major beams (``row = sentence * beam + k``).
    """

    def __init__(self, model: Transformer, src: Tensor, copies: int, use_cache: bool,
                 no_repeat_ngram: int = 0, kernel: OutputKernel | None = None):
        self.model, self.kernel = model, kernel  # the output layer's product (model.py)
        self.no_repeat_ngram = no_repeat_ngram
        src_pad = model.src_pad_mask(src)
        memory = model.encode(src, src_pad)  # encode once, then copy to the beams
        if copies > 1:
            memory = memory.repeat_interleave(copies, dim=0)
            src_pad = src_pad.repeat_interleave(copies, dim=0)
        self.memory, self.src_pad = memory, src_pad
        self.cache = model.new_cache() if use_cache else None
        self.ids, self._never = _columns(model)
        self.rows = model.generator.allowed_rows()  # once per search: the weights are fixed

    def next_logits(self, tokens: Tensor, history: np.ndarray | None = None) -> Tensor:
        """(N, t) prefixes starting with BOS -> (N, V') float logits of the next token over
        the pieces the output layer can score: the vocabulary, or with a restricted layer
        only its pieces (column j is token ``ids[j]``; see ``token_ids``). Searching those
        alone skips spreading every row over the whole vocabulary at each step.
        ``history``: each row's tokens so far (host), for the repetition guard."""
        step_input = tokens[:, -1:] if self.cache is not None else tokens
        hidden = self.model.decode(step_input, self.memory, self.src_pad, self.cache)
        logits = self.model.generator.output_logits(hidden[:, -1], self.rows, self.kernel).float()
        logits[:, self._never] = float("-inf")
        if self.no_repeat_ngram:
            generator = self.model.generator
            ban_repeated_ngrams(logits, history, self.no_repeat_ngram,
                                generator.positions if generator.restricted else None)
        return logits

    def token_ids(self, columns: Tensor) -> Tensor:
        """The token ids of columns of ``next_logits``."""
        return columns if self.ids is None else self.ids[columns]

    @classmethod
    def joinable(cls, model: Transformer, no_repeat_ngram: int = 0,
                 kernel: OutputKernel | None = None) -> _DecoderState:
        """No rows yet: sentences ``join`` it. The cross-attention K/V of every row are
        computed when it joins, so the memory itself is not kept."""
        state = cls.__new__(cls)
        state.model, state.memory, state.kernel = model, None, kernel
        state.no_repeat_ngram = no_repeat_ngram
        state.ids, state._never = _columns(model)
        with torch.no_grad():  # a search's rows are constants, not part of a graph
            state.rows = model.generator.allowed_rows()
        state.src_pad = torch.zeros(0, 0, dtype=torch.bool, device=_device(model))
        state.cache = model.new_cache()
        return state

    def join(self, src: Tensor, copies: int) -> Tensor:
        """Encode ``src`` (n, S) and add its rows (``copies`` per sentence) at the next
        step; returns their (n, S) source padding mask."""
        src_pad = self.model.src_pad_mask(src)
        memory = self.model.encode(src, src_pad).repeat_interleave(copies, dim=0)
        self.cache.join(self.model.new_cache(memory))
        width = max(self.src_pad.size(1), src.size(1))  # padded on the right, masked
        self.src_pad = torch.cat([
            F.pad(self.src_pad, (0, width - self.src_pad.size(1)), value=True),
            F.pad(src_pad.repeat_interleave(copies, dim=0), (0, width - src.size(1)), value=True)])
        return src_pad

    def select(self, rows: Tensor, shrinks: bool) -> None:
        """Keep (and reorder) rows ``rows``.

        The beams of one sentence share one memory and so the same cross-attention K/V:
        a reorder within sentences leaves those unchanged, and only the self-attention K/V
        (which differ per beam) need following; the rest is copied only when sentences
        leave the batch. (Copying the cross-attention cache every step took a third of
        beam search's time.)
        """
        if shrinks:
            if self.cache is not None:
                self.cache.reorder(rows)
            if self.memory is not None:
                self.memory = self.memory.index_select(0, rows)
            self.src_pad = self.src_pad.index_select(0, rows)
            self._narrow()
        elif self.cache is not None:
            self.cache.reorder(rows, kinds=("self",))

    def _narrow(self) -> None:
        """Drop the source positions that are padding in every row left (sources are
        padded on the right). Sentences leave and join a running search (``JoinableSearch``)
        at will: without this, its cross-attention would span the longest source it has
        ever held, where a batch of ``beam_search`` spans the longest of its own."""
        width = int((~self.src_pad).sum(1).max()) if self.src_pad.size(0) else 0
        if width < self.src_pad.size(1):
            self.src_pad = self.src_pad[:, :width]
            if self.memory is not None:
                self.memory = self.memory[:, :width]
            if self.cache is not None:
                self.cache.narrow_memory(width)


@torch.no_grad()
def greedy_decode(
    model: Transformer,
    src: Tensor,
    max_len_b: int = 50,
    use_cache: bool = True,
    no_repeat_ngram: int = 0,
    kernel: OutputKernel | None = None,
) -> list[list[int]]:
    """Batched greedy search. src: (B, S) padded ids. Returns token ids without BOS/EOS.
    ``no_repeat_ngram``: the repetition guard (module docstring; 0: off).

    With ``use_cache=False`` the whole prefix is re-run through the decoder at every step,
    as the tutorials do; it gives the same tokens and exists to measure the cache's gain.
    The tokens chosen are copied to the host once a step, where the bookkeeping runs (see
    :class:`_Rows`).
    """
    B = src.size(0)
    state = _DecoderState(model, src, 1, use_cache, no_repeat_ngram, kernel)
    rows = _Rows(output_limits(model, state.src_pad, max_len_b), copies=1)
    outputs: list[list[int]] = [[] for _ in range(B)]
    next_token = torch.full((B,), BOS_ID, dtype=torch.long, device=src.device)
    for step in range(1, rows.longest + 1 if B else 1):
        logits = state.next_logits(rows.decoder_input(next_token, use_cache), rows.history)
        next_token = state.token_ids(logits.argmax(dim=-1))
        chosen = next_token.cpu().numpy()  # the one transfer to the host of this step
        rows.grow(chosen)
        done = (chosen == EOS_ID) | rows.at_limit(step)
        if not done.any():
            continue
        for row in np.flatnonzero(done):
            outputs[rows.sentence[row]] = strip_special(rows.history[row].tolist())
        keep = np.flatnonzero(~done)
        if keep.size == 0:
            break
        rows.keep(keep)
        index = torch.from_numpy(keep).to(src.device)
        next_token = next_token.index_select(0, index)
        state.select(index, shrinks=True)
    return outputs


@torch.no_grad()
def beam_search(
    model: Transformer,
    src: Tensor,
    beam: int,
    alpha: float = 0.6,
    max_len_b: int = 50,
    nbest: int = 1,
    use_cache: bool = True,
    no_repeat_ngram: int = 0,
    sampling: Sampling | None = None,
    kernel: OutputKernel | None = None,
) -> list[list[Hypothesis]]:
    """Batched beam search (see the module docstring for the exact rules).

    ``no_repeat_ngram``: the repetition guard (0: off). ``sampling``: draw ``beam`` samples
    per sentence instead (``Sampling``; their seed must be set), scored as the beam's.

    src: (B, S) padded source ids. Returns, per sentence, up to ``nbest`` hypotheses
    ``(token ids without BOS/EOS, score)``, best first; the score is the log-probability
    divided by the GNMT length penalty.

    The scores and choices stay on the model's device; once a step the few numbers the
    bookkeeping needs ((A, 2K) candidates, (A, K) survivors) are copied to the host in one
    transfer, and the finished lists, limits and token histories are kept there
    (:class:`_Rows`): on a GPU, a synchronisation per sentence and step cost more than the
    model itself (docs/findings.md#decoding-on-a-gpu).
    """
    if beam < 1:
        raise ValueError(f"beam must be at least 1, got {beam}")
    if not 1 <= nbest <= beam:
        raise ValueError(f"nbest must be between 1 and the beam size {beam}, got {nbest}")
    B, K, device = src.size(0), beam, src.device
    state = _DecoderState(model, src, K, use_cache, no_repeat_ngram, kernel)
    rows = _Rows(output_limits(model, state.src_pad[::K], max_len_b), copies=K,
                 keys=None if sampling is None else sample_keys(src, _seed(sampling), K))
    scores = _first_scores(B, K, sampling, device)
    token = torch.full((B, K), BOS_ID, dtype=torch.long, device=device)
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]

    for step in range(1, rows.longest + 1 if B else 1):
        logits = state.next_logits(rows.decoder_input(token.reshape(-1), use_cache),
                                   rows.history)
        if sampling is None:
            scores, token, host = _expand(logits, scores, K, state)
        else:
            scores, token, host = _draw(logits, scores, K, state, sampling,
                                        _uniforms(rows.keys, np.full(len(rows.keys), step)))
        done = _settle(rows, finished, host, step, alpha)
        keep = np.flatnonzero(~done)
        if keep.size == 0:
            break
        scores, token = _advance(rows, state, host, keep, scores, token)

    return [sorted(hyps, key=lambda h: -h.score)[:nbest] for hyps in finished]


class JoinableSearch:
    """Beam search that sentences join at any step and leave as soon as they are done
    (continuous batching: `aiayn serve` adds the requests that arrive while it decodes).

    ``add(keys, src)`` encodes sentences and adds their rows at the next step; ``step()``
    decodes one token for every live row and returns the sentences that are done, as
    ``(key, hypotheses)`` with up to ``beam`` hypotheses best first. Every sentence gets
    what ``beam_search`` gives it alone (same tokens, scores up to float rounding; a test):
    the rules of the module docstring apply to each sentence from its own first step.
    Rows that joined later start later in the self-attention cache: their earlier columns
    are masked and their positions count from their own start (``KVCache.start``); sources
    of other lengths are padded on the right and masked. Columns that every live row
    started after are dropped, so a search that never empties stays as long as its oldest
    sentence. ``beam=1`` is greedy search. It scores with the output layer's rows as they
    were when it started (the weights of a model being served do not change): a model
    trained further needs a new search. ``no_repeat_ngram`` and ``sampling``: as
    ``beam_search``'s (a sample depends on its sentence alone, not on when it joined).
    """

    def __init__(self, model: Transformer, beam: int, alpha: float = 0.6, max_len_b: int = 50,
                 no_repeat_ngram: int = 0, sampling: Sampling | None = None,
                 kernel: OutputKernel | None = None):
        if beam < 1:
            raise ValueError(f"beam must be at least 1, got {beam}")
        self.model, self.beam, self.alpha, self.max_len_b = model, beam, alpha, max_len_b
        self.kernel = kernel
        self.no_repeat_ngram, self.sampling = no_repeat_ngram, sampling
        self._start()

    @classmethod
    def of(cls, model: Transformer, search: Search, max_len_b: int = 50,
           kernel: OutputKernel | None = None) -> JoinableSearch:
        """The joinable search of the settings ``search``."""
        return cls(model, search.beam, search.alpha, max_len_b, search.no_repeat_ngram,
                   search.sampling, kernel)

    def _start(self) -> None:
        K, device = self.beam, _device(self.model)
        self.state = _DecoderState.joinable(self.model, self.no_repeat_ngram, self.kernel)
        self.rows = _Rows(torch.zeros(0, dtype=torch.long), copies=K,
                          keys=None if self.sampling is None else np.zeros(0, np.uint64))
        self.scores = torch.zeros(0, K, device=device)
        self.token = torch.zeros(0, K, dtype=torch.long, device=device)
        self.finished: dict[int, list[Hypothesis]] = {}

    def __len__(self) -> int:
        """Sentences being decoded."""
        return len(self.rows.sentence)

    @torch.no_grad()
    def add(self, keys: list[int], src: Tensor) -> None:
        """Sentences ``src`` ((n, S) padded source ids), known by ``keys``, join the search."""
        if not keys:
            return
        if len(keys) != src.size(0) or set(keys) & set(self.finished):
            raise ValueError("add needs one new key per source row")
        K = self.beam
        src_pad = self.state.join(src.to(self.scores.device), K)
        limits = output_limits(self.model, src_pad, self.max_len_b).cpu().numpy()
        self.rows.add(np.array(keys, dtype=np.int64), limits, K,
                      None if self.sampling is None else
                      sample_keys(src, _seed(self.sampling), K))
        scores = _first_scores(len(keys), K, self.sampling, self.scores.device)
        self.scores = torch.cat([self.scores, scores])
        self.token = torch.cat([self.token, torch.full_like(scores, BOS_ID, dtype=torch.long)])
        self.finished.update((key, []) for key in keys)

    @torch.no_grad()
    def remove(self, keys: Iterable[int]) -> None:
        """Take the sentences ``keys`` out of the search before they are done (their
        requester has gone); the others go on as if they had never been there. Keys not
        in the search are ignored."""
        gone = np.isin(self.rows.sentence, np.fromiter(keys, dtype=np.int64))
        if not gone.any():
            return
        for key in self.rows.sentence[gone]:
            del self.finished[int(key)]
        keep = np.flatnonzero(~gone)
        if keep.size == 0:
            self._start()
            return
        K, device = self.beam, self.scores.device
        beam_rows = (keep[:, None] * K + np.arange(K)).reshape(-1)  # every beam, in place
        self.rows.keep(keep, beam_rows)
        self.state.select(torch.from_numpy(beam_rows).to(device), shrinks=True)
        index = torch.from_numpy(keep).to(device)
        self.scores, self.token = self.scores.index_select(0, index), self.token.index_select(0, index)
        self._trim()

    @torch.no_grad()
    def step(self) -> list[tuple[int, list[Hypothesis]]]:
        """Decode one token of every live sentence; the sentences done, with their lists."""
        if not len(self):
            return []
        rows, K = self.rows, self.beam
        step = rows.history.shape[1] + 1  # steps so far, counted from the oldest sentence
        logits = self.state.next_logits(self.token.reshape(-1, 1), rows.history)
        if self.sampling is None:
            self.scores, self.token, host = _expand(logits, self.scores, K, self.state)
        else:  # each sentence's own step: it counts from when the sentence joined
            own = step - np.repeat(rows.offset, K)
            self.scores, self.token, host = _draw(logits, self.scores, K, self.state,
                                                  self.sampling, _uniforms(rows.keys, own))
        done = _settle(rows, self.finished, host, step, self.alpha)
        answers = [(int(key), sorted(self.finished.pop(key), key=lambda h: -h.score)[:K])
                   for key in rows.sentence[done]]
        keep = np.flatnonzero(~done)
        if keep.size == 0:
            self._start()
            return answers
        self.scores, self.token = _advance(rows, self.state, host, keep, self.scores, self.token)
        self._trim()
        return answers

    def _trim(self) -> None:
        unused = int(self.rows.offset.min())  # columns from before every live sentence joined
        if unused:
            self.rows.trim(unused)
            self.state.cache.trim(unused)


def _columns(model: Transformer) -> tuple[Tensor | None, list[int]]:
    """The token id of each column of the model's logits (None: column = id), and the
    columns of the pieces never generated (PAD, BOS) among them."""
    generator = model.generator
    if not generator.restricted:
        return None, list(NEVER_GENERATED)
    positions = generator.positions[list(NEVER_GENERATED)].tolist()
    return generator.output_ids, [p for p in positions if p != generator.IGNORE]


def _device(model: Transformer) -> torch.device:
    return next(model.parameters()).device


# ---------------------------------------------------------------- the repetition guard
def ban_repeated_ngrams(logits: Tensor, history: np.ndarray, n: int,
                        to_column: Tensor | None = None) -> None:
    """Set to -inf, in place, the (N, V') ``logits`` of every token that would complete an
    n-gram already in its row's ``history`` (N, t): the row's last n-1 tokens were followed
    by that token before. ``to_column``: token id -> column, for a restricted output layer.

    Vectorised on the host, where the searches keep the histories: one comparison of every
    (n-1)-gram with the last (hypotheses are short). A joined row's history starts with
    PAD (before it joined); PAD windows can only ban PAD, which is never generated anyway.
    """
    t = history.shape[1]
    if t < n:  # no n-gram complete yet, so nothing to repeat
        return
    windows = np.lib.stride_tricks.sliding_window_view(history, n, axis=1)  # (N, t-n+1, n)
    last = history[:, t - n + 1:]  # (N, n-1): what the next token would follow
    rows, at = np.nonzero((windows[:, :, :n - 1] == last[:, None, :]).all(axis=2))
    if rows.size == 0:
        return
    tokens = torch.from_numpy(windows[rows, at, n - 1]).to(logits.device)
    columns = tokens if to_column is None else to_column[tokens]
    logits[torch.from_numpy(rows).to(logits.device), columns] = float("-inf")


# ---------------------------------------------------------------- sampling
def sampling_distribution(logits: Tensor, sampling: Sampling) -> tuple[Tensor, Tensor]:
    """(N, V') logits -> what a sample is drawn from, most likely first: (N, V')
    probabilities of softmax(logits / temperature) cut to the top-k pieces and to the
    fewest whose mass reaches top-p (the most likely always stays), renormalised (zero past
    the cut), and the columns they belong to. The sort is stable, so that a tie goes to
    the lower column, as argmax (greedy search) does."""
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    probs, order = probs.sort(dim=-1, descending=True, stable=True)
    cut = probs.new_zeros(probs.shape, dtype=torch.bool)
    if sampling.top_k:
        cut[:, sampling.top_k:] = True
    if sampling.top_p < 1:
        cut |= (probs.cumsum(dim=-1) - probs) >= sampling.top_p  # mass before it: enough
    probs = probs.masked_fill(cut, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True), order


def next_distribution(model: Transformer, src: Tensor, prefix: list[int], sampling: Sampling,
                      no_repeat_ngram: int = 0, kernel: OutputKernel | None = None
                      ) -> tuple[Tensor, Tensor]:
    """The distribution a sample's next token is drawn from, given source ids ``src``
    (1, S) and the target tokens so far ``prefix`` (no BOS): (V',) probabilities, most
    likely first, and their token ids (``sampling_distribution``; temperature 1 without top-k
    or top-p is the model's own distribution)."""
    state = _DecoderState(model, src, 1, use_cache=False, no_repeat_ngram=no_repeat_ngram,
                          kernel=kernel)
    tokens = torch.tensor([[BOS_ID, *prefix]], dtype=torch.long, device=src.device)
    with torch.no_grad():
        logits = state.next_logits(tokens, np.array([prefix], dtype=np.int64).reshape(1, -1))
    probs, order = sampling_distribution(logits, sampling)
    return probs[0], state.token_ids(order[0])


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's increment (2^64 / golden ratio)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (Steele, Lea & Flood 2014) on a uint64 array: each output bit
    depends on every input bit. Array arithmetic wraps modulo 2^64 by design."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sample_keys(src: Tensor, seed: int, copies: int) -> np.ndarray:
    """(n * copies,) uint64: the random stream of each sample (``copies`` per sentence) of
    the (n, S) padded sources, a function of the seed, the sentence's ids and the sample's
    number alone."""
    ids = src.cpu().numpy()
    sentence = np.array([zlib.crc32(row[row != PAD_ID].astype("<i8").tobytes()) for row in ids],
                        dtype=np.uint64)
    base = _mix(_mix(np.full(len(ids), seed, dtype=np.uint64)) ^ sentence)
    sample = np.tile(np.arange(1, copies + 1, dtype=np.uint64), len(ids))
    return _mix(np.repeat(base, copies) + sample * _GOLDEN)


def _uniforms(keys: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """(R,) floats in [0, 1): row r's draw at its own step ``steps[r]`` (53 random bits)."""
    bits = _mix(keys ^ _mix(steps.astype(np.uint64) * _GOLDEN))
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def _seed(sampling: Sampling) -> int:
    if sampling.seed is None:
        raise ValueError("sampling needs a seed (aiayn.inference.translator.Translator draws one)")
    return sampling.seed


def _first_scores(n: int, K: int, sampling: Sampling | None, device) -> Tensor:
    """(n, K) scores of new sentences: every sample row is live; of a beam only the first,
    so that the K copies of BOS do not become K copies of the same hypothesis."""
    if sampling is not None:
        return torch.zeros(n, K, device=device)
    scores = torch.full((n, K), float("-inf"), device=device)
    scores[:, 0] = 0.0
    return scores


def _draw(logits: Tensor, scores: Tensor, K: int, state: _DecoderState, sampling: Sampling,
          uniforms: np.ndarray) -> tuple[Tensor, Tensor, _Candidates]:
    """One step of sampling, in the shape of ``_expand``'s answer so that the searches'
    bookkeeping (``_settle``, ``_advance``) serves it unchanged: row k of a sentence draws
    its token (inverse CDF at ``uniforms[row]``) and stays row k; a row that draws EOS is
    finished and stays dead (score -inf) until its sentence's other rows end too."""
    A = scores.size(0)
    log_probs = torch.log_softmax(logits, dim=-1)  # the model's: a sample's score
    probs, order = sampling_distribution(logits, sampling)
    cdf = probs.cumsum(dim=-1)
    u = torch.from_numpy(uniforms).to(cdf.device, cdf.dtype)[:, None]
    pick = torch.searchsorted(cdf, (u * cdf[:, -1:]).contiguous(), right=True)
    pick = torch.minimum(pick, (probs > 0).sum(dim=-1, keepdim=True) - 1)  # u rounded to 1
    column = order.gather(1, pick)  # (A*K, 1)
    token = state.token_ids(column.squeeze(1)).view(A, K)
    drawn = scores + log_probs.gather(1, column).view(A, K)
    alive = drawn.masked_fill(token.eq(EOS_ID), float("-inf"))
    host = torch.cat([drawn.double(), token.double(), alive.double()], dim=1).cpu().numpy()
    beam_of = np.broadcast_to(np.arange(K), (A, K))
    h_token = host[:, K:2 * K].astype(np.int64)
    return alive, token, _Candidates(host[:, :K], beam_of, h_token, host[:, 2 * K:], beam_of,
                                     h_token)


class _Candidates(NamedTuple):
    """A beam step's choices on the host (A live sentences): the 2K best candidates by
    log-probability (score, beam, token), and the K that stay alive (score, beam, token)."""

    top_scores: np.ndarray  # (A, 2K) float
    top_beam: np.ndarray  # (A, 2K) int
    top_token: np.ndarray
    scores: np.ndarray  # (A, K) float
    beam_of: np.ndarray  # (A, K) int
    token: np.ndarray


def _expand(logits: Tensor, scores: Tensor, K: int, state: _DecoderState
            ) -> tuple[Tensor, Tensor, _Candidates]:
    """One step of beam search on the device: (A*K, V') logits (``next_logits``) and (A, K)
    live scores -> the survivors' (A, K) scores and tokens, and the step's choices copied
    to the host."""
    A = scores.size(0)
    log_probs = torch.log_softmax(logits, dim=-1)  # (A*K, V')
    V = log_probs.size(-1)
    candidates = (scores[:, :, None] + log_probs.view(A, K, V)).view(A, K * V)
    top_scores, top_index = candidates.topk(min(2 * K, K * V), dim=1)  # (A, 2K) best first
    top_beam, top_token = top_index // V, state.token_ids(top_index % V)
    # The K best candidates that do not end in EOS stay alive (a stable sort keeps rank).
    alive = top_token.ne(EOS_ID).to(torch.int8).argsort(dim=1, descending=True, stable=True)
    alive = alive[:, :K]
    scores = top_scores.gather(1, alive)
    beam_of, token = top_beam.gather(1, alive), top_token.gather(1, alive)
    # One transfer: float64 holds the float32 scores and the ids exactly.
    host = torch.cat([t.double() for t in (top_scores, top_beam, top_token, scores,
                                           beam_of, token)], dim=1).cpu().numpy()
    c = top_scores.size(1)
    h_top_scores, h_top_beam, h_top_token = (host[:, i * c:(i + 1) * c] for i in range(3))
    h_scores, h_beam_of, h_token = (host[:, 3 * c + i * K:3 * c + (i + 1) * K]
                                    for i in range(3))
    return scores, token, _Candidates(h_top_scores, h_top_beam.astype(np.int64),
                                      h_top_token.astype(np.int64), h_scores,
                                      h_beam_of.astype(np.int64), h_token.astype(np.int64))


def _settle(rows: _Rows, finished, c: _Candidates, step: int, alpha: float) -> np.ndarray:
    """Move this step's finished hypotheses to ``finished[sentence]``; (A,) which sentences
    are done: ``beam`` hypotheses finished, or at their length limit, or nothing alive."""
    K = c.scores.shape[1]
    ends = (c.top_token == EOS_ID) & np.isfinite(c.top_scores)
    ends[:, K:] = False  # only EOS candidates that rank among the first K are finished
    rows.finish(finished, ends, c.top_scores, c.top_beam, None, step, alpha)
    at_limit = rows.at_limit(step)
    if at_limit.any():  # live hypotheses that reached the limit end as they are
        cut = at_limit[:, None] & np.isfinite(c.scores)
        rows.finish(finished, cut, c.scores, c.beam_of, c.token, step, alpha)
    done = at_limit | ~np.isfinite(c.scores).any(axis=1)  # (sampling: rows in place)
    done |= np.array([len(finished[s]) >= K for s in rows.sentence], dtype=bool)
    return done


def _advance(rows: _Rows, state: _DecoderState, c: _Candidates, keep: np.ndarray,
             scores: Tensor, token: Tensor) -> tuple[Tensor, Tensor]:
    """Keep the sentences ``keep`` (host rows, device rows and cache follow their chosen
    beams); their (A', K) scores and tokens."""
    K = c.scores.shape[1]
    beam_rows = (keep[:, None] * K + c.beam_of[keep]).reshape(-1)  # sentence-major
    rows.keep(keep, beam_rows)
    rows.grow(c.token[keep].reshape(-1))
    device = scores.device
    index = torch.from_numpy(keep).to(device)
    state.select(torch.from_numpy(beam_rows).to(device), shrinks=keep.size < c.scores.shape[0])
    return scores.index_select(0, index), token.index_select(0, index)


class _Rows:
    """The host's side of a search: for each live sentence its original index and output
    limit, and for each live row (sentence-major, ``copies`` rows a sentence) the tokens
    generated so far. The model's device only ever needs the newest token of each row
    (the KV cache holds the rest), or, without a cache, the whole prefix (copied over).

    In a ``JoinableSearch`` a sentence joins after ``offset`` steps of the search: its
    history's first ``offset`` columns are padding and its limit counts the search's steps
    (its own limit + offset), so that one step number serves every sentence.
    """

    def __init__(self, limits: Tensor, copies: int, keys: np.ndarray | None = None):
        self.keys = keys  # (A*K,) sampling: each row's random stream (``sample_keys``)
        self.limits = limits.cpu().numpy()  # (A,) most new tokens of each live sentence
        self.sentence = np.arange(len(self.limits))  # (A,) original index of each
        self.offset = np.zeros(len(self.limits), dtype=np.int64)  # (A,) steps before it joined
        self.history = np.zeros((len(self.limits) * copies, 0), dtype=np.int64)  # (A*K, t)
        self.longest = int(self.limits.max()) if len(self.limits) else 0

    def add(self, sentences: np.ndarray, limits: np.ndarray, copies: int,
            keys: np.ndarray | None = None) -> None:
        """Sentences joining after the ``t`` steps so far: offset t, history padded."""
        t = self.history.shape[1]
        if keys is not None:
            self.keys = np.concatenate([self.keys, keys])
        self.sentence = np.concatenate([self.sentence, sentences])
        self.limits = np.concatenate([self.limits, limits + t])
        self.offset = np.concatenate([self.offset, np.full(len(sentences), t)])
        padding = np.full((len(sentences) * copies, t), PAD_ID, dtype=np.int64)
        self.history = np.concatenate([self.history, padding])

    def trim(self, columns: int) -> None:
        """Forget the first ``columns`` steps (before every live sentence joined)."""
        self.history = self.history[:, columns:]
        self.limits, self.offset = self.limits - columns, self.offset - columns

    def at_limit(self, step: int) -> np.ndarray:
        return self.limits == step

    def grow(self, new_tokens: np.ndarray) -> None:
        """Append one token to every row."""
        self.history = np.concatenate([self.history, new_tokens[:, None]], axis=1)

    def keep(self, sentences: np.ndarray, rows: np.ndarray | None = None) -> None:
        """Keep the live ``sentences`` and (reordered) history ``rows`` (default: the same)."""
        self.sentence, self.limits = self.sentence[sentences], self.limits[sentences]
        self.offset = self.offset[sentences]
        self.history = self.history[sentences if rows is None else rows]
        if self.keys is not None:
            self.keys = self.keys[sentences if rows is None else rows]

    def decoder_input(self, newest: Tensor, use_cache: bool) -> Tensor:
        """(N, 1) newest tokens with a cache; else (N, 1 + t) BOS and the whole prefix."""
        if use_cache or self.history.shape[1] == 0:
            return newest.reshape(-1, 1)
        bos = np.full((self.history.shape[0], 1), BOS_ID, dtype=np.int64)
        return torch.from_numpy(np.concatenate([bos, self.history], axis=1)).to(newest.device)

    def finish(self, finished: list[list[Hypothesis]], chosen: np.ndarray, scores: np.ndarray,
               beam_of: np.ndarray, last_token: np.ndarray | None, step: int,
               alpha: float) -> None:
        """Move the chosen (A, C) candidates to their sentence's finished list.

        A candidate is row ``beam_of[a, c]`` of sentence ``a`` followed by EOS
        (``last_token`` None) or by ``last_token[a, c]``; either way it has ``step`` (minus
        the sentence's offset) generated tokens.
        """
        if not chosen.any():
            return
        K = self.history.shape[0] // len(self.sentence)
        for a, c in zip(*np.nonzero(chosen), strict=True):
            start = int(self.offset[a])
            ids = self.history[a * K + beam_of[a, c], start:].tolist()
            if last_token is not None:
                ids.append(int(last_token[a, c]))
            penalty = length_penalty(step - start, alpha)
            finished[self.sentence[a]].append(Hypothesis(ids, float(scores[a, c]) / penalty))


def strip_special(ids: list[int]) -> list[int]:
    """Cut a hypothesis at its first EOS."""
    return ids[: ids.index(EOS_ID)] if EOS_ID in ids else ids
