"""The steps of a search, the public piece that the batch searches (``decode_beam``,
``decode_greedy``: ``aiayn.inference.search``) and the joinable search (``JoinableSearch``:
``aiayn.inference.joinable``) both drive, so that a sentence gets the same tokens and scores
whichever search it is in.

A beam search's step, as fairseq splits it (its ``Search.step(step, lprobs, scores)`` answers
the best 2 x beam candidates; the generator around it finishes the EOS ones and carries on
the beam best others), is three calls here, each on every live sentence at once:

1. ``choose(step, logits, scores, state, rows, sampling)``: from the (A*K, V') logits of the
   ``DecoderState`` (``next_logits``) and the (A, K) live scores, the 2K best candidates
   and the K that stay alive (``expand``; with ``sampling`` each row draws its own:
   ``draw``), copied to the host in one transfer as ``Candidates``.
2. ``settle(rows, finished, candidates, step, alpha)``: the hypotheses that end this step
   move to their sentence's finished list (scored by ``length_penalty``); which sentences
   are done.
3. ``advance(rows, state, candidates, keep, scores, token)``: the sentences ``keep`` go on,
   their host rows (``Rows``), device rows and cache following the beams they chose.

The searches call the first as ``decode_and_choose`` (``next_logits``, then ``choose``),
which takes both in one call where the output kernel offers it (``DecoderState.beam_step``:
the int8 engine's: the same kernels but for the final layer norm, equal up to rounding).
That call also follows every beam on the host's side; where it finds that nothing ends, it
answers ``Followed`` and ``go_on`` stands for the other two. A call of several steps
(``most``) goes on past hypotheses that end while no sentence is done and answers them as
``ended``, which ``Rows.finish_ended`` settles as ``settle`` would have at their steps.

``DecoderState`` holds the encoder output and the decoder's KV cache of the live rows (a
joinable one starts empty and sentences ``join`` it); ``Rows`` holds the host's side (each
row's tokens so far, each sentence's limit, ``output_limits``, and the step it joined at).
The module is over 500 lines because the three steps are read with the two states they
share: cutting ``Rows`` or ``DecoderState`` away would split one contract over two files.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from aiayn.inference.kernels import for_fixed_weight, log_softmax, top_log_probs
from aiayn.inference.sampling import ban_repeated_ngrams, sampling_distribution, uniforms
from aiayn.inference.settings import Sampling, Search
from aiayn.inference.topk import topk_rows
from aiayn.model import OutputKernel, Transformer

NEVER_GENERATED = (PAD_ID, BOS_ID)


class Hypothesis(NamedTuple):
    """One search result."""

    ids: list[int]  # token ids, without BOS and EOS
    score: float  # log-probability / length penalty (greedy search reports 0.0)
    # The log-probability of each token of ``ids`` and then of EOS (none after a hypothesis
    # cut at its length limit); their sum over the length penalty is ``score``. Empty where
    # the search gives none (greedy search, an engine without them).
    log_probs: tuple[float, ...] = ()

    @property
    def log_prob(self) -> float:
        """log P(ids + EOS | source): the sum of ``log_probs``."""
        return float(sum(self.log_probs))


def source_lengths(src_pad: Tensor) -> np.ndarray:
    """(B,) tokens of each source on the host, from its (B, S) padding mask."""
    return (~src_pad).sum(dim=1).cpu().numpy()


def output_limits(model: Transformer, src_len: np.ndarray, search: Search) -> np.ndarray:
    """(B,) most new tokens (EOS included) per sentence of ``src_len`` source tokens (host,
    ``source_lengths``): floor(max_len_a x source length) + max_len_b, capped so that
    ``[BOS] + tokens + [EOS]`` fits in ``model.cfg.max_len`` positions. The product is a
    float64's, as CTranslate2's engine computes it (``aiayn.inference.ct2``)."""
    a = search.max_len_a
    scaled = src_len * int(a) if float(a).is_integer() else np.floor(src_len * a).astype(np.int64)
    return np.minimum(np.maximum(scaled + search.max_len_b, 1), max(1, model.cfg.max_len - 1))


def length_penalty(length: int | Tensor, alpha: float) -> float | Tensor:
    """GNMT length penalty lp(Y) = ((5 + |Y|) / 6) ** alpha; alpha = 0 means no penalty."""
    return ((5 + length) / 6) ** alpha


class Outputs(NamedTuple):
    """What a search's steps read of the model's output layer, fixed while its weights are
    (``outputs_of``): the token id of each column of the logits (None: column = id), the
    columns never generated, token id -> column (None: the same), the allowed weight rows
    (and bias) and the product that multiplies by them. A search that restarts, and the
    searches of one serving lane, share one: selecting a restricted layer's rows (the demo's
    5,131 pieces) copies them, and oneDNN's product packs them."""

    ids: Tensor | None
    never: list[int]
    to_column: Tensor | None
    rows: tuple[Tensor, Tensor | None]
    kernel: OutputKernel | None


def outputs_of(model: Transformer, kernel: OutputKernel | None,
               dtype: torch.dtype | None = None) -> Outputs:
    """The model's ``Outputs`` now, its rows cast to ``dtype`` if given, ``kernel`` the
    output layer's product (``for_fixed_weight``'s of it)."""
    ids, never = _columns(model)
    with torch.no_grad():  # a search's rows are constants, not part of a graph
        rows = model.generator.allowed_rows(dtype)
    return Outputs(ids, never, _to_column(model), rows, for_fixed_weight(kernel, rows[0]))


class DecoderState:
    """The encoder output and decoder cache for the rows still being decoded.

    Rows are sentences (greedy) or sentence-major beams (``row = sentence * beam + k``).
    The memory, its padding and its cross-attention K/V are kept once per sentence: the
    beams of a sentence share them (``cache.fold_beams``).
    """

    followed: Tensor | None = None  # the cache's slot table after a fused step's choice
    # The kernel's next fused step while the cache only follows (int8's ``StepAgain``): every
    # other change of the rows or the cache (join, select, trim, a modules' step) drops it.
    again = None

    def __init__(self, model: Transformer, src: Tensor, copies: int, use_cache: bool,
                 no_repeat_ngram: int = 0, kernel: OutputKernel | None = None):
        self.model = model
        self.no_repeat_ngram = no_repeat_ngram
        self.src_pad = model.src_pad_mask(src)  # (B, S): one row per sentence, as memory
        self.src_len = source_lengths(self.src_pad)  # (B,) on the host: limits, narrowing
        self.memory = model.encode(src, self.src_pad)  # encoded once, read by every beam
        self.cache = model.new_cache() if use_cache else None
        dtype = torch.get_autocast_dtype(src.device.type)  # cast once, not at every step
        self._take(outputs_of(model, kernel, dtype if torch.is_autocast_enabled(src.device.type)
                              else None))

    def _take(self, outputs: Outputs) -> None:
        self.ids, self._never, self._to_column, self.rows, self.kernel = outputs

    @property
    def outputs(self) -> Outputs:
        """The output layer's parts this state's steps read (``Outputs``)."""
        return Outputs(self.ids, self._never, self._to_column, self.rows, self.kernel)

    def next_logits(self, tokens: Tensor, history: np.ndarray | None = None,
                    given: np.ndarray | None = None) -> Tensor:
        """(N, t) prefixes starting with BOS -> (N, V') float logits of the next token over
        the pieces the output layer can score: the vocabulary, or with a restricted layer
        only its pieces (column j is token ``ids[j]``; see ``token_ids``). Searching those
        alone skips spreading every row over the whole vocabulary at each step.
        ``history``: each row's tokens so far (host), for the repetition guard; ``given``:
        (N,) rows whose next token is given (a target prefix, ``Forced``), which the guard
        leaves alone: it rules what the search chooses, not what it is told."""
        step_input = tokens[:, -1:] if self.cache is not None else tokens
        self.again = None
        hidden = self.model.decode(step_input, self.memory, self.src_pad, self.cache)
        logits = self.model.generator.output_logits(hidden[:, -1], self.rows, self.kernel).float()
        to_column = self._to_column
        own = getattr(self.kernel, "mask_step", None)  # int8's: the same columns in one call
        if own is not None and logits.is_contiguous():
            own(logits, self._never, history, self.no_repeat_ngram, given, to_column)
            return logits
        logits[:, self._never] = float("-inf")
        if self.no_repeat_ngram:
            ban_repeated_ngrams(logits, history, self.no_repeat_ngram, to_column, given)
        return logits

    def beam_step(self, token: Tensor, scores: Tensor, history: np.ndarray,
                  totals: np.ndarray | None = None, most: int = 1, wake: int | None = None,
                  finished: np.ndarray | None = None
                  ) -> tuple[Tensor, Tensor, Candidates | Followed, Followed | None] | None:
        """``next_logits`` and ``expand`` in one call of the output kernel's ``beam_step``
        (the int8 engine's: the same kernels, its final layer norm in C, equal up to
        rounding), for the (A, K) newest ``token`` and live ``scores``; None where there is
        none or it does not take this step. With the rows' ``totals`` (``Rows``) the kernel
        also follows every beam: a step at which nothing ends answers ``Followed`` (``go_on``),
        any other ``Candidates`` with it (``advance`` takes it where every sentence goes on).
        With totals, the kernel (its first step after a change, and one that repeats its step:
        ``again``) takes up to ``most`` steps in one call while nothing ends and nothing
        arrives on the file descriptor ``wake``: the fourth answer is then the rows' history
        and totals before the last (``Followed``; the cache has followed those steps), else
        None. With ``finished`` too ((A,) the hypotheses each sentence has finished:
        ``Rows.ends``), a step at which hypotheses end but no sentence is done does not stop
        it: the third answer's ``ended`` holds those hypotheses."""
        K = scores.size(1)
        answer = (None if self.again is None else
                  self.again(token.view(-1), scores, history, totals, most, wake, finished))
        if answer is None:
            own = getattr(self.kernel, "beam_step", None)
            if own is None or self.cache is None:
                return None
            width, C = candidate_widths(K, self.rows[0].size(0))
            answer = own(self.model, token.reshape(-1), scores, self.src_pad, self.cache, history,
                         self._never, self.no_repeat_ngram, self._to_column, self.ids, width, C, totals,
                         most, wake, finished)
            if answer is None:
                return None
        host, scores, token, rows, self.followed, self.again, earlier, ended = answer
        earlier = None if earlier is None else Followed(*earlier)
        if rows is not None and rows[2]:  # nothing ends (but what ``ended`` holds)
            return scores, token, Followed(*rows[:2], ended), earlier
        followed = None if rows is None else Followed(*rows[:2])
        return scores, token, _candidates(host, candidate_widths(K, self.rows[0].size(0))[1], K,
                                          followed, ended), earlier

    def follow(self) -> None:
        """Every row takes the beam a fused ``beam_step`` chose for it, every sentence
        staying: the cache takes the slot table that step made (``select``'s, made already)."""
        followed, self.followed = self.followed, None
        self.cache.follow(followed)

    def token_ids(self, columns: Tensor) -> Tensor:
        """The token ids of columns of ``next_logits``."""
        return columns if self.ids is None else self.ids[columns]

    def only_given(self, values: Tensor, given: Given | None, rest: float = float("-inf")
                   ) -> Tensor:
        """(N, V') ``values`` (logits or log-probabilities) with every column of a row
        whose token is ``given`` set to ``rest`` except that token's, which keeps its value:
        the search can only follow the prefix, and the prefix's tokens are scored as the
        model scores them."""
        if given is None:
            return values
        device = values.device
        rows = torch.from_numpy(np.flatnonzero(given.rows)).to(device)
        tokens = torch.from_numpy(given.tokens[given.rows]).to(device)
        columns = tokens if self.ids is None else self.model.generator.positions[tokens]
        kept = values[rows, columns]
        values = values.clone()
        values[rows] = rest
        values[rows, columns] = kept
        return values

    @classmethod
    def joinable(cls, model: Transformer, no_repeat_ngram: int = 0,
                 kernel: OutputKernel | None = None, outputs: Outputs | None = None) -> DecoderState:
        """No rows yet: sentences ``join`` it. The cross-attention K/V of every row are
        computed when it joins, so the memory itself is not kept. ``outputs``: the model's
        ``Outputs`` with ``kernel`` made already (None: made here)."""
        state = cls.__new__(cls)
        state.model, state.memory = model, None
        state.no_repeat_ngram = no_repeat_ngram
        state._take(outputs if outputs is not None else outputs_of(model, kernel))
        state.src_pad = torch.zeros(0, 0, dtype=torch.bool, device=state.rows[0].device)
        state.src_len = np.zeros(0, dtype=np.int64)
        state.cache = model.new_cache()
        return state

    def join(self, src: Tensor, copies: int) -> np.ndarray:
        """Encode ``src`` (n, S) and add its rows (``copies`` per sentence) at the next
        step; returns their (n,) source lengths (host)."""
        src_pad = self.model.src_pad_mask(src)
        self.again = None
        self.cache.join(self.model.encoded_cache(src, src_pad), copies)
        width = max(self.src_pad.size(1), src.size(1))  # padded on the right, masked
        self.src_pad = torch.cat([F.pad(self.src_pad, (0, width - self.src_pad.size(1)), value=True),
                                  F.pad(src_pad, (0, width - src.size(1)), value=True)])
        lengths = source_lengths(src_pad)
        self.src_len = np.concatenate([self.src_len, lengths])
        return lengths

    def select(self, rows: Tensor, sentences: Tensor | None = None) -> None:
        """Keep (and reorder) rows ``rows``, of the sentences ``sentences`` when some leave
        (None: every sentence stays, and each row takes a row of its own sentence: the
        chosen beams of the step just taken, whose slot table a fused ``beam_step`` has
        made already).

        The self-attention K/V (which differ per beam) follow the rows; the memory, its
        padding and the cross-attention K/V, one per sentence, follow the sentences, and
        so are copied only when sentences leave. (Copying the cross-attention cache every
        step took a third of beam search's time.)
        """
        followed, self.followed = self.followed, None  # ``beam_step``'s, of this step alone
        self.again = None
        if self.cache is not None:
            self.cache.reorder(rows, kinds=("self",), within_sentences=sentences is None,
                               ancestry=followed if sentences is None else None)
        if sentences is None:
            return
        if self.cache is not None:
            self.cache.reorder(sentences, kinds=("cross",))
        if self.memory is not None:
            self.memory = self.memory.index_select(0, sentences)
        self.src_pad = self.src_pad.index_select(0, sentences)
        self.src_len = self.src_len[sentences.cpu().numpy()]
        self._narrow()

    def trim(self, columns: int) -> None:
        """Drop the cache's first ``columns`` positions (``KVCache.trim``: every row began
        after them)."""
        self.again = None
        self.cache.trim(columns)

    def _narrow(self) -> None:
        """Drop the source positions that are padding in every row left (sources are
        padded on the right). Sentences leave and join a running search (``JoinableSearch``)
        at will: without this, its cross-attention would span the longest source it has
        ever held, where a batch of ``beam_search`` spans the longest of its own."""
        width = int(self.src_len.max()) if self.src_len.size else 0
        if width < self.src_pad.size(1):
            self.src_pad = self.src_pad[:, :width]
            if self.memory is not None:
                self.memory = self.memory[:, :width]
            if self.cache is not None:
                self.cache.narrow_memory(width)


def _columns(model: Transformer) -> tuple[Tensor | None, list[int]]:
    """The token id of each column of the model's logits (None: column = id), and the
    columns of the pieces never generated (PAD, BOS) among them."""
    generator = model.generator
    if not generator.restricted:
        return None, list(NEVER_GENERATED)
    positions = generator.positions[list(NEVER_GENERATED)].tolist()
    return generator.output_ids, [p for p in positions if p != generator.IGNORE]


def _to_column(model: Transformer) -> Tensor | None:
    """Token id -> column of the model's logits (None: column = id)."""
    generator = model.generator
    return generator.positions if generator.restricted else None


def first_scores(n: int, K: int, sampling: Sampling | None, device) -> Tensor:
    """(n, K) scores of new sentences: every sample row is live; of a beam only the first,
    so that the K copies of BOS do not become K copies of the same hypothesis."""
    if sampling is not None:
        return torch.zeros(n, K, device=device)
    scores = torch.full((n, K), float("-inf"), device=device)
    scores[:, 0] = 0.0
    return scores


def draw(logits: Tensor, scores: Tensor, K: int, state: DecoderState, sampling: Sampling,
         uniforms: np.ndarray, given: Given | None = None) -> tuple[Tensor, Tensor, Candidates]:
    """One step of sampling, in the shape of ``expand``'s answer so that the searches'
    bookkeeping (``settle``, ``advance``) serves it unchanged: row k of a sentence draws
    its token (inverse CDF at ``uniforms[row]``) and stays row k; a row that draws EOS is
    finished and stays dead (score -inf) until its sentence's other rows end too. A row
    whose token is ``given`` draws that one (its uniform is spent all the same, so that
    the draws after a prefix are the draws without it)."""
    A = scores.size(0)
    log_probs = log_softmax(logits, state.kernel)  # the model's: a sample's score
    probs, order = sampling_distribution(state.only_given(logits, given, rest=float("-inf")),
                                         sampling)
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
    return alive, token, Candidates(host[:, :K], beam_of, h_token, host[:, 2 * K:], beam_of,
                                    h_token)


class Followed(NamedTuple):
    """The rows' (A*K, t + 1) history and totals after a fused beam step that followed every
    beam (``DecoderState.beam_step``), as ``Rows.follow`` makes them where every sentence
    goes on; alone, a step at which no sentence is done and, but for ``ended``'s, no
    hypothesis ends."""

    history: np.ndarray
    totals: np.ndarray
    # the hypotheses that ended at steps a call took while every sentence went on (the kernel's
    # record: ``Rows.finish_ended``), before this answer's candidates; None: none
    ended: tuple | None = None


class Candidates(NamedTuple):
    """A beam step's choices on the host (A live sentences): the 2K best candidates by
    log-probability (score, beam, token), and the K that stay alive (score, beam, token)."""

    top_scores: np.ndarray  # (A, 2K) float
    top_beam: np.ndarray  # (A, 2K) int
    top_token: np.ndarray
    scores: np.ndarray  # (A, K) float
    beam_of: np.ndarray  # (A, K) int
    token: np.ndarray
    followed: Followed | None = None  # a fused step's rows, every beam followed (``Followed``)
    ended: tuple | None = None  # ``Followed.ended``: of the steps a call took before this one


def expand(logits: Tensor, scores: Tensor, K: int, state: DecoderState,
           given: Given | None = None) -> tuple[Tensor, Tensor, Candidates]:
    """One step of beam search on the device: (A*K, V') logits (``next_logits``) and (A, K)
    live scores -> the survivors' (A, K) scores and tokens, and the step's choices copied
    to the host. Rows whose token is ``given`` can only take it."""
    A = scores.size(0)
    width, C = candidate_widths(K, logits.size(-1))
    if given is None:
        row_best, row_columns = top_log_probs(logits, width, state.kernel)  # (A*K, 2K)
    else:  # rows that follow a prefix: their other columns -inf after the softmax
        row_best, row_columns = topk_rows(state.only_given(log_softmax(logits, state.kernel), given), width)
    own = getattr(state.kernel, "beam_choose", None)  # int8's: the same choice in one call
    if own is not None:
        host, scores, token = own(row_best, row_columns, scores, state.ids, width, C)
        return scores, token, _candidates(host, C, K)
    candidates = (scores[:, :, None] + row_best.view(A, K, width)).view(A, K * width)
    top_scores, top_index = candidates.topk(C, dim=1)  # (A, 2K) best first
    top_beam = top_index // width
    top_token = state.token_ids(row_columns.view(A, K * width).gather(1, top_index))
    # The K best candidates that do not end in EOS stay alive (a stable sort keeps rank).
    alive = top_token.ne(EOS_ID).to(torch.int8).argsort(dim=1, descending=True, stable=True)
    alive = alive[:, :K]
    scores = top_scores.gather(1, alive)
    beam_of, token = top_beam.gather(1, alive), top_token.gather(1, alive)
    # One transfer: float64 holds the float32 scores and the ids exactly.
    host = torch.cat([t.double() for t in (top_scores, top_beam, top_token, scores,
                                           beam_of, token)], dim=1).cpu().numpy()
    return scores, token, _candidates(host, C, K)


def candidate_widths(K: int, V: int) -> tuple[int, int]:
    """A beam step's best log-probabilities per row and candidates per sentence, of K beams
    over V columns: a sentence's 2K best candidates are among its beams' own 2K best each, so
    only those A*K*2K sums are formed, not all A*K*V (the same floats, so the same choice)."""
    width = min(2 * K, V)
    return width, min(2 * K, K * width)


def _candidates(host: np.ndarray, C: int, K: int, followed: Followed | None = None,
                ended: tuple | None = None) -> Candidates:
    """``Candidates`` from the (A, 3C + 3K) rows of one transfer: the C candidates' scores,
    beams and tokens, then the K survivors'."""
    top, alive = host[:, C:3 * C].astype(np.int64), host[:, 3 * C + K:].astype(np.int64)
    return Candidates(host[:, :C], top[:, :C], top[:, C:], host[:, 3 * C:3 * C + K], alive[:, :K],
                      alive[:, K:], followed, ended)


def decode_and_choose(step: int, token: Tensor, scores: Tensor, state: DecoderState, rows: Rows,
                      sampling: Sampling | None, given: Given | None = None, use_cache: bool = True,
                      most: int = 1, wake: int | None = None
                      ) -> tuple[Tensor, Tensor, Candidates | Followed]:
    """A step from the (A, K) newest tokens to its choice: ``state.next_logits`` of the
    rows, then ``choose``; a beam step that no prefix rules, with an output kernel that does
    both at once (``DecoderState.beam_step``: the int8 engine's), in one call of it, which
    answers ``Followed`` where nothing ends at this step (no sentence is at its limit, and
    the kernel finds no EOS among any sentence's best K and a live beam in each; with
    ``most`` > 1, where no sentence is done). There,
    up to ``most`` steps while no sentence is done and nothing arrives on the file
    descriptor ``wake`` (none reaching a sentence's limit): ``rows`` then hold every step
    but the last, whose choice this answers (its number: ``rows.history``'s columns + 1),
    and the answer's ``ended`` the hypotheses that ended at the steps before it or, where it
    is ``Followed``, at it too (``Rows.finish_ended`` settles them)."""
    if sampling is None and given is None and use_cache:
        quiet = step < rows.soonest
        most = min(most, rows.soonest - step) if quiet else 1
        answer = state.beam_step(token, scores, rows.history, rows.totals if quiet else None, most,
                                 wake, rows.ends if most > 1 else None)
        if answer is not None:
            scores, token, host, earlier = answer
            if earlier is not None:  # the steps before the last went on (``go_on``)
                rows.history, rows.totals = earlier.history, earlier.totals
            return scores, token, host
    logits = state.next_logits(rows.decoder_input(token.reshape(-1), use_cache), rows.history,
                               None if given is None else given.rows)
    return choose(step, logits, scores, state, rows, sampling, given)


def choose(step: int, logits: Tensor, scores: Tensor, state: DecoderState, rows: Rows,
           sampling: Sampling | None, given: Given | None = None
           ) -> tuple[Tensor, Tensor, Candidates]:
    """One step's choice (fairseq's ``Search.step``): (A*K, V') logits and (A, K) live scores
    -> the survivors' (A, K) scores and tokens on the device, and the step's ``Candidates``
    on the host. Beam search: ``expand``; sampling: ``draw``, each row at its sentence's
    own step (counted from when the sentence joined: a sample does not depend on it).
    ``given``: this step's rows that follow a target prefix (``Rows.given``)."""
    K = scores.size(1)
    if sampling is None:
        return expand(logits, scores, K, state, given)
    own = step - np.repeat(rows.offset, K)
    return draw(logits, scores, K, state, sampling, uniforms(rows.keys, own), given)


def settle(rows: Rows, finished, c: Candidates, step: int, alpha: float) -> np.ndarray:
    """Move this step's finished hypotheses to ``finished[sentence]``; (A,) which sentences
    are done: ``beam`` hypotheses finished (``Rows.ends``, which ``Rows.finish`` and
    ``finish_ended`` count), or at their length limit, or nothing alive."""
    K = c.scores.shape[1]
    # Most steps end nothing: each test below is a few operations on the host's small arrays,
    # and at a serving lane's few rows each of those costs as much as the rows' arithmetic.
    ends = c.top_token[:, :K] == EOS_ID  # only EOS candidates among the first K are finished
    ended = bool(ends.any())
    if ended:
        rows.finish(finished, ends & np.isfinite(c.top_scores[:, :K]), c.top_scores, c.top_beam,
                    None, step, alpha)
    at_limit = rows.at_limit(step)
    cut = bool(at_limit.any())
    if cut:  # live hypotheses that reached the limit end as they are
        rows.finish(finished, at_limit[:, None] & np.isfinite(c.scores), c.scores, c.beam_of,
                    c.token, step, alpha)
    done = ~np.isfinite(c.scores).any(axis=1)  # nothing alive (sampling: rows in place)
    if cut:
        done |= at_limit
    if ended or cut:  # a live sentence had fewer than K finished before this step
        done |= rows.ends >= K
    return done


def go_on(rows: Rows, state: DecoderState, followed: Followed) -> None:
    """Every sentence goes on after a step its kernel followed (``Followed``): what ``settle``
    (which would finish nothing) and ``advance`` (keeping every sentence) do, made already.
    At a serving lane's four sentences their small operations cost ~14% of a step."""
    rows.history, rows.totals = followed.history, followed.totals
    state.follow()


def advance(rows: Rows, state: DecoderState, c: Candidates, keep: np.ndarray,
            scores: Tensor, token: Tensor) -> tuple[Tensor, Tensor]:
    """Keep the sentences ``keep`` (host rows, device rows and cache follow their chosen
    beams); their (A', K) scores and tokens."""
    K = c.scores.shape[1]
    device = scores.device
    if keep.size == c.scores.shape[0] and c.followed is not None:  # the kernel followed them
        go_on(rows, state, c.followed)
        return scores, token
    if keep.size == c.scores.shape[0]:  # every sentence goes on: only the beams reorder
        beam_rows = (rows.beam_base(K) + c.beam_of).reshape(-1)
        rows.follow(beam_rows, c.token, c.scores)
        state.select(torch.from_numpy(beam_rows).to(device))
        return scores, token
    beam_rows = (keep[:, None] * K + c.beam_of[keep]).reshape(-1)  # sentence-major
    rows.keep(keep, beam_rows)
    rows.grow(c.token[keep].reshape(-1), c.scores[keep].reshape(-1))
    index = torch.from_numpy(keep).to(device)
    state.select(torch.from_numpy(beam_rows).to(device), index)
    return scores.index_select(0, index), token.index_select(0, index)


class Rows:
    """The host's side of a search: for each live sentence its original index and output
    limit, and for each live row (sentence-major, ``copies`` rows a sentence) the tokens
    generated so far. The model's device only ever needs the newest token of each row
    (the KV cache holds the rest), or, without a cache, the whole prefix (copied over).

    In a ``JoinableSearch`` a sentence joins after ``offset`` steps of the search: its
    history's first ``offset`` columns are padding and its limit counts the search's steps
    (its own limit + offset), so that one step number serves every sentence.

    A sentence may come with a target prefix (``prefixes``): its first tokens are given,
    not chosen (``given``), and its limit is at least the prefix (a prefix that reaches
    it is the whole output). Beside each row's
    tokens the host keeps the row's log-probability after each of them (``totals``), from
    which a finished hypothesis gets its per-token log-probabilities.
    """

    def __init__(self, limits: np.ndarray, copies: int, keys: np.ndarray | None = None,
                 prefixes: Sequence[Sequence[int]] | None = None):
        self.keys = keys  # (A*K,) sampling: each row's random stream (``sample_keys``)
        self.sentence = np.arange(len(limits))  # (A,) original index of each
        self.prefix, self.prefix_len = _prefix_table(prefixes, len(limits))  # (A, P), (A,)
        # (A,) most new tokens of each live sentence: at least its prefix
        self.limits = np.maximum(limits, self.prefix_len)
        self.offset = np.zeros(len(self.limits), dtype=np.int64)  # (A,) steps before it joined
        self.ends = np.zeros(len(self.limits), dtype=np.int64)  # (A,) hypotheses it has finished
        self.history = np.zeros((len(self.limits) * copies, 0), dtype=np.int64)  # (A*K, t)
        self.totals = np.zeros((len(self.limits) * copies, 0))  # (A*K, t) log P so far
        self.longest = int(self.limits.max()) if len(self.limits) else 0
        self._base: tuple | None = None  # ``beam_base``'s, with the A and K it was made for
        self._limits_changed()

    def _limits_changed(self) -> None:
        """``soonest``: the first step at which a live sentence reaches its limit."""
        self.soonest = int(self.limits.min()) if len(self.limits) else 0

    def add(self, sentences: np.ndarray, limits: np.ndarray, copies: int,
            keys: np.ndarray | None = None,
            prefixes: Sequence[Sequence[int]] | None = None) -> None:
        """Sentences joining after the ``t`` steps so far: offset t, history padded."""
        t = self.history.shape[1]
        if keys is not None:
            self.keys = np.concatenate([self.keys, keys])
        prefix, prefix_len = _prefix_table(prefixes, len(sentences))
        width = max(self.prefix.shape[1], prefix.shape[1])
        self.prefix = np.concatenate([_widen(self.prefix, width), _widen(prefix, width)])
        self.prefix_len = np.concatenate([self.prefix_len, prefix_len])
        self.sentence = np.concatenate([self.sentence, sentences])
        self.limits = np.concatenate([self.limits, np.maximum(limits, prefix_len) + t])
        self.offset = np.concatenate([self.offset, np.full(len(sentences), t)])
        self.ends = np.concatenate([self.ends, np.zeros(len(sentences), dtype=np.int64)])
        self._limits_changed()
        padding = np.full((len(sentences) * copies, t), PAD_ID, dtype=np.int64)
        self.history = np.concatenate([self.history, padding])
        self.totals = np.concatenate([self.totals, np.zeros(padding.shape)])

    def trim(self, columns: int) -> None:
        """Forget the first ``columns`` steps (before every live sentence joined)."""
        self.history, self.totals = self.history[:, columns:], self.totals[:, columns:]
        self.limits, self.offset = self.limits - columns, self.offset - columns
        self._limits_changed()

    def given(self, step: int) -> Given | None:
        """The rows whose token at ``step`` is given by their sentence's prefix, or None."""
        if not self.prefix.size:
            return None
        own = step - self.offset  # (A,) the sentence's own step, from 1
        on = own <= self.prefix_len
        if not on.any():
            return None
        at = np.minimum(own - 1, self.prefix.shape[1] - 1)[:, None]
        tokens = np.take_along_axis(self.prefix, at, axis=1)[:, 0]
        copies = self.history.shape[0] // len(self.sentence)
        return Given(np.repeat(on, copies), np.repeat(tokens, copies))

    def at_limit(self, step: int) -> np.ndarray:
        return self.limits == step

    def grow(self, new_tokens: np.ndarray, totals: np.ndarray | None = None) -> None:
        """Append one token to every row, and each row's log-probability after it (greedy
        search keeps none: NaN)."""
        self.history = np.concatenate([self.history, new_tokens[:, None]], axis=1)
        totals = np.full(len(new_tokens), np.nan) if totals is None else totals
        self.totals = np.concatenate([self.totals, totals[:, None]], axis=1)

    def beam_base(self, K: int) -> np.ndarray:
        """(A, 1) the first row of each live sentence's K (sentence-major rows)."""
        A = len(self.sentence)
        if self._base is None or self._base[:2] != (A, K):
            self._base = (A, K, (np.arange(A) * K)[:, None])
        return self._base[2]

    def follow(self, rows: np.ndarray, tokens: np.ndarray, totals: np.ndarray) -> None:
        """Every sentence goes on: ``keep`` of every sentence with history ``rows``, then
        ``grow`` by (A, K) ``tokens`` and ``totals``, in fewer operations (each step of beam
        search does this)."""
        if self.keys is not None:
            self.keys = self.keys[rows]
        self.history = np.concatenate([self.history[rows], tokens.reshape(-1, 1)], axis=1)
        self.totals = np.concatenate([self.totals[rows], totals.reshape(-1, 1)], axis=1)

    def keep(self, sentences: np.ndarray, rows: np.ndarray | None = None) -> None:
        """Keep the live ``sentences`` and (reordered) history ``rows`` (default: the same)."""
        self.sentence, self.limits = self.sentence[sentences], self.limits[sentences]
        self.offset, self.ends = self.offset[sentences], self.ends[sentences]
        self._limits_changed()
        self.prefix, self.prefix_len = self.prefix[sentences], self.prefix_len[sentences]
        self.history = self.history[sentences if rows is None else rows]
        self.totals = self.totals[sentences if rows is None else rows]
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
            row = a * K + beam_of[a, c]
            self._finish(finished, a, self.history[row], self.totals[row], float(scores[a, c]),
                         None if last_token is None else int(last_token[a, c]), step, alpha)

    def finish_ended(self, finished: list[list[Hypothesis]], ended: tuple, alpha: float) -> None:
        """Move the hypotheses that ended at steps a kernel's call took while every sentence
        went on (``Followed.ended``: each one's sentence, history columns before its step and
        score, and the history and totals of the beam it ends, before that step) to their
        sentence's finished list, as ``finish`` would have at their steps."""
        for (a, t, score), history, totals in zip(*ended, strict=True):
            t = int(t)
            self._finish(finished, int(a), history[:t], totals[:t], float(score), None, t + 1, alpha)

    def _finish(self, finished: list[list[Hypothesis]], a: int, history: np.ndarray,
                totals: np.ndarray, score: float, last_token: int | None, step: int,
                alpha: float) -> None:
        """Sentence ``a``'s hypothesis of ``step`` steps that ends the beam of ``history`` and
        ``totals`` (from the search's first step) with EOS or ``last_token``, of ``score``."""
        start = int(self.offset[a])
        ids = history[start:].tolist()
        if last_token is not None:
            ids.append(last_token)
        # log P after each token (and EOS), from 0 before the first: their steps (Python's
        # float subtraction is numpy's float64 one, in a tenth of the calls for a sentence)
        totals = totals[start:].tolist()
        log_probs = tuple(after - before for before, after in
                          zip([0.0, *totals], [*totals, score], strict=True))
        finished[self.sentence[a]].append(Hypothesis(ids, score / length_penalty(step - start, alpha),
                                                     log_probs))
        self.ends[a] += 1


class Given(NamedTuple):
    """The rows of a step whose token is given (a target prefix), not chosen."""

    rows: np.ndarray  # (A*K,) bool
    tokens: np.ndarray  # (A*K,) the given token id of each (any value where not given)


def _prefix_table(prefixes: Sequence[Sequence[int]] | None, n: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """n prefixes (None: none) as an (n, longest) table padded with PAD, and their lengths."""
    lengths = np.array([len(p) for p in prefixes] if prefixes is not None else [0] * n,
                       dtype=np.int64)
    if prefixes is not None and len(prefixes) != n:
        raise ValueError(f"{len(prefixes)} prefixes for {n} sentences")
    table = np.full((n, int(lengths.max()) if n else 0), PAD_ID, dtype=np.int64)
    for i, prefix in enumerate(prefixes or ()):
        table[i, :len(prefix)] = prefix
    return table, lengths


def _widen(table: np.ndarray, width: int) -> np.ndarray:
    if table.shape[1] == width:  # most joins: np.pad costs more than the rest of a join's rows
        return table
    return np.pad(table, ((0, 0), (0, width - table.shape[1])), constant_values=PAD_ID)


def check_prefixes(model: Transformer, prefixes: Sequence[Sequence[int]]) -> None:
    """A ValueError for a prefix the search could not follow: a token the output layer
    cannot produce (``unwritable``), or longer than the model's positions leave room for
    (max_len - 2: BOS before it, EOS after)."""
    for prefix in prefixes:
        if len(prefix) > model.cfg.max_len - 2:
            raise ValueError(f"a prefix of {len(prefix)} tokens; at most "
                             f"{model.cfg.max_len - 2} fit the model's max_len")
        if bad := unwritable(model, prefix):
            raise ValueError(f"prefix tokens {bad} cannot be produced by the output layer")


def unwritable(model: Transformer, ids: Sequence[int]) -> list[int]:
    """The token ids among ``ids`` the model never outputs: PAD, BOS, EOS, and with a
    restricted output layer the pieces outside it."""
    generator = model.generator
    allowed = generator.output_mask.cpu() if generator.restricted else None
    return [i for i in ids if i in (PAD_ID, BOS_ID, EOS_ID) or not 0 <= i < model.cfg.tgt_vocab_size
            or (allowed is not None and not bool(allowed[i]))]


def strip_special(ids: list[int]) -> list[int]:
    """Cut a hypothesis at its first EOS."""
    return ids[: ids.index(EOS_ID)] if EOS_ID in ids else ids
