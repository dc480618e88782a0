"""Decoding: batched greedy search and batched beam search over the model's KV cache.

Source ids are ``tokens + [EOS]``; a hypothesis starts with BOS and ends at EOS. The
source is encoded once; every step feeds only the newest token through the decoder and
reuses the cached keys/values of the earlier ones (``use_cache=False`` re-runs the whole
prefix instead, as the tutorials do: same tokens, far slower).

Rules shared by both searches:

- Output length limit, per sentence: ``floor(max_len_a x source length) + max_len_b`` new
  tokens (``decode.max_len_a``/``max_len_b``; the paper, 6.1: "input length + 50"), and
  never more than ``model.cfg.max_len - 1`` (the target sequence ``[BOS] + tokens +
  [EOS]`` must fit the model's positions). The source length counts its EOS. A
  hypothesis that reaches the limit without EOS ends there.
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

Two options change what the searches may choose (both off by default): the repetition
guard ``no_repeat_ngram`` and ``sampling`` in place of search (``aiayn.inference.sampling``).
The settings arrive as one ``Search`` value (``aiayn.inference.settings``), resolved once by
whoever called; a sentence joining a running search: ``aiayn.inference.joinable``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from aiayn.config import DecodeConfig
from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from aiayn.inference.sampling import (
    ban_repeated_ngrams,
    sample_keys,
    sampling_distribution,
    seed_of,
    uniforms,
)
from aiayn.inference.settings import Sampling, Search
from aiayn.model import OutputKernel, Transformer
from aiayn.util.device import parameter_device

NEVER_GENERATED = (PAD_ID, BOS_ID)

class Hypothesis(NamedTuple):
    """One search result; a tuple, so ``ids, score = hypothesis`` works."""

    ids: list[int]  # token ids, without BOS and EOS
    score: float  # log-probability / length penalty (greedy search reports 0.0)


def output_limits(model: Transformer, src_pad: Tensor, search: Search) -> Tensor:
    """(B,) most new tokens (EOS included) per sentence: floor(max_len_a x source length) +
    max_len_b, capped so that ``[BOS] + tokens + [EOS]`` fits in ``model.cfg.max_len``
    positions."""
    src_len = (~src_pad).sum(dim=1)
    a = search.max_len_a
    scaled = src_len * int(a) if float(a).is_integer() else (src_len * a).floor().long()
    return (scaled + search.max_len_b).clamp(min=1, max=max(1, model.cfg.max_len - 1))


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
        dtype = torch.get_autocast_dtype(src.device.type)  # cast once, not at every step
        self.rows = model.generator.allowed_rows(  # once per search: the weights are fixed
            dtype if torch.is_autocast_enabled(src.device.type) else None)

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
        state.src_pad = torch.zeros(0, 0, dtype=torch.bool, device=parameter_device(model))
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
def decode_greedy(model: Transformer, src: Tensor, search: Search, use_cache: bool = True,
                  kernel: OutputKernel | None = None) -> list[list[int]]:
    """Batched greedy search with ``search``'s length limit and repetition guard (its beam,
    alpha and nbest are not read). src: (B, S) padded ids. Returns token ids without BOS/EOS.
    ``kernel``: the output layer's product (``aiayn.model.OutputKernel``; None: F.linear).

    With ``use_cache=False`` the whole prefix is re-run through the decoder at every step,
    as the tutorials do; it gives the same tokens and exists to measure the cache's gain.
    The tokens chosen are copied to the host once a step, where the bookkeeping runs (see
    :class:`_Rows`).
    """
    B = src.size(0)
    state = _DecoderState(model, src, 1, use_cache, search.no_repeat_ngram, kernel)
    rows = _Rows(output_limits(model, state.src_pad, search), copies=1)
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
def decode_beam(model: Transformer, src: Tensor, search: Search, use_cache: bool = True,
                kernel: OutputKernel | None = None) -> list[list[Hypothesis]]:
    """Batched beam search of ``search`` (see the module docstring for the exact rules);
    with ``search.sampling`` (seeded) it draws ``search.beam`` samples per sentence instead,
    scored as the beam's. ``kernel``: the output layer's product (as ``decode_greedy``'s).

    src: (B, S) padded source ids. Returns, per sentence, up to ``search.nbest`` hypotheses
    ``(token ids without BOS/EOS, score)``, best first; the score is the log-probability
    divided by the GNMT length penalty.

    The scores and choices stay on the model's device; once a step the few numbers the
    bookkeeping needs ((A, 2K) candidates, (A, K) survivors) are copied to the host in one
    transfer, and the finished lists, limits and token histories are kept there
    (:class:`_Rows`): on a GPU, a synchronisation per sentence and step cost more than the
    model itself (docs/findings.md#decoding-on-a-gpu).
    """
    sampling, alpha, nbest = search.sampling, search.alpha, search.nbest
    B, K, device = src.size(0), search.beam, src.device
    state = _DecoderState(model, src, K, use_cache, search.no_repeat_ngram, kernel)
    rows = _Rows(output_limits(model, state.src_pad[::K], search), copies=K,
                 keys=None if sampling is None else sample_keys(src, seed_of(sampling), K))
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
                                        uniforms(rows.keys, np.full(len(rows.keys), step)))
        done = _settle(rows, finished, host, step, alpha)
        keep = np.flatnonzero(~done)
        if keep.size == 0:
            break
        scores, token = _advance(rows, state, host, keep, scores, token)

    return [sorted(hyps, key=lambda h: -h.score)[:nbest] for hyps in finished]


def greedy_decode(model: Transformer, src: Tensor, max_len_b: int = DecodeConfig.max_len_b,
                  use_cache: bool = True, no_repeat_ngram: int = 0,
                  kernel: OutputKernel | None = None) -> list[list[int]]:
    """``decode_greedy`` with its settings as keywords, for scripts that hold no run."""
    return decode_greedy(model, src, Search(1, no_repeat_ngram=no_repeat_ngram,
                                            max_len_b=max_len_b), use_cache, kernel)


def beam_search(model: Transformer, src: Tensor, beam: int, alpha: float = DecodeConfig.alpha,
                max_len_b: int = DecodeConfig.max_len_b, nbest: int = 1, use_cache: bool = True,
                no_repeat_ngram: int = 0, sampling: Sampling | None = None,
                kernel: OutputKernel | None = None) -> list[list[Hypothesis]]:
    """``decode_beam`` with its settings as keywords, for scripts that hold no run
    (``sampling`` needs its seed)."""
    if beam < 1:
        raise ValueError(f"beam must be at least 1, got {beam}")
    if not 1 <= nbest <= beam:
        raise ValueError(f"nbest must be between 1 and the beam size {beam}, got {nbest}")
    return decode_beam(model, src, Search(beam, alpha, no_repeat_ngram, sampling, nbest,
                                          max_len_b=max_len_b), use_cache, kernel)


def _columns(model: Transformer) -> tuple[Tensor | None, list[int]]:
    """The token id of each column of the model's logits (None: column = id), and the
    columns of the pieces never generated (PAD, BOS) among them."""
    generator = model.generator
    if not generator.restricted:
        return None, list(NEVER_GENERATED)
    positions = generator.positions[list(NEVER_GENERATED)].tolist()
    return generator.output_ids, [p for p in positions if p != generator.IGNORE]


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
