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

A sentence may come with a **target prefix** (``prefixes``: the tokens its translation
starts with, e.g. what a person typed): for its first steps each of its rows takes the
prefix's next token, scored by the model's log-probability of it (the guard does not
apply to given tokens), and the search goes on from there by its own rules; its length
limit is at least the prefix (one that reaches the limit is the whole output). Greedy
search and sampling given the first k tokens of their own output give that output again;
beam search given its 1-best's first k tokens may find a better-scoring ending, since its
whole beam then follows that prefix.
The settings arrive as one ``Search`` value (``aiayn.inference.settings``), resolved once by
whoever called; a sentence joining a running search: ``aiayn.inference.joinable``. The
steps both drive (the decoder's state, the candidates of a step, the host's rows) are
``aiayn.inference.steps``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from aiayn.config import DecodeConfig
from aiayn.data.tokenizer import BOS_ID, EOS_ID
from aiayn.inference.sampling import sample_keys, sampling_distribution, seed_of
from aiayn.inference.settings import Sampling, Search
from aiayn.inference.steps import (
    DecoderState,
    Followed,
    Hypothesis,
    Rows,
    advance,
    check_prefixes,
    decode_and_choose,
    first_scores,
    go_on,
    output_limits,
    settle,
    strip_special,
)
from aiayn.model import OutputKernel, Transformer


@torch.inference_mode()
def decode_greedy(model: Transformer, src: Tensor, search: Search, use_cache: bool = True,
                  kernel: OutputKernel | None = None,
                  prefixes: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
    """Batched greedy search with ``search``'s length limit and repetition guard (its beam,
    alpha and nbest are not read). src: (B, S) padded ids. Returns token ids without BOS/EOS.
    ``kernel``: the output layer's product (``aiayn.model.OutputKernel``; None: F.linear).
    ``prefixes``: per sentence the target tokens it starts with (the module docstring).

    With ``use_cache=False`` the whole prefix is re-run through the decoder at every step,
    as the tutorials do; it gives the same tokens and exists to measure the cache's gain.
    The tokens chosen are copied to the host once a step, where the bookkeeping runs (see
    ``aiayn.inference.steps.Rows``).
    """
    B = src.size(0)
    if prefixes is not None:
        check_prefixes(model, prefixes)
    state = DecoderState(model, src, 1, use_cache, search.no_repeat_ngram, kernel)
    rows = Rows(output_limits(model, state.src_len, search), copies=1, prefixes=prefixes)
    outputs: list[list[int]] = [[] for _ in range(B)]
    next_token = torch.full((B,), BOS_ID, dtype=torch.long, device=src.device)
    for step in range(1, rows.longest + 1 if B else 1):
        given = rows.given(step)
        logits = state.next_logits(rows.decoder_input(next_token, use_cache), rows.history,
                                   None if given is None else given.rows)
        next_token = state.token_ids(logits.argmax(dim=-1))
        if given is not None:
            next_token = torch.where(torch.from_numpy(given.rows).to(src.device),
                                     torch.from_numpy(given.tokens).to(src.device), next_token)
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
        state.select(index, index)
    return outputs


@torch.inference_mode()
def decode_beam(model: Transformer, src: Tensor, search: Search, use_cache: bool = True,
                kernel: OutputKernel | None = None,
                prefixes: Sequence[Sequence[int]] | None = None) -> list[list[Hypothesis]]:
    """Batched beam search of ``search`` (see the module docstring for the exact rules);
    with ``search.sampling`` (seeded) it draws ``search.beam`` samples per sentence instead,
    scored as the beam's. ``kernel`` and ``prefixes``: as ``decode_greedy``'s.

    src: (B, S) padded source ids. Returns, per sentence, up to ``search.nbest`` hypotheses
    (token ids without BOS/EOS, score, per-token log-probabilities: ``Hypothesis``), best
    first; the score is the log-probability divided by the GNMT length penalty.

    The scores and choices stay on the model's device; once a step the few numbers the
    bookkeeping needs ((A, 2K) candidates, (A, K) survivors) are copied to the host in one
    transfer, and the finished lists, limits and token histories are kept there
    (``aiayn.inference.steps.Rows``): on a GPU, a synchronisation per sentence and step
    cost more than the model itself (docs/findings.md#decoding-on-a-gpu). Each step is
    ``aiayn.inference.steps``'s three: choose (``decode_and_choose``), settle, advance.
    """
    sampling, alpha, nbest = search.sampling, search.alpha, search.nbest
    B, K, device = src.size(0), search.beam, src.device
    if prefixes is not None:
        check_prefixes(model, prefixes)
    state = DecoderState(model, src, K, use_cache, search.no_repeat_ngram, kernel)
    rows = Rows(output_limits(model, state.src_len, search), copies=K,
                keys=None if sampling is None else sample_keys(src, seed_of(sampling), K),
                prefixes=prefixes)
    scores = first_scores(B, K, sampling, device)
    token = torch.full((B, K), BOS_ID, dtype=torch.long, device=device)
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]

    for step in range(1, rows.longest + 1 if B else 1):
        scores, token, host = decode_and_choose(step, token, scores, state, rows, sampling,
                                                rows.given(step), use_cache)
        if isinstance(host, Followed):  # nothing ends: every sentence goes on
            go_on(rows, state, host)
            continue
        done = settle(rows, finished, host, step, alpha)
        keep = np.flatnonzero(~done)
        if keep.size == 0:
            break
        scores, token = advance(rows, state, host, keep, scores, token)

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
    (``sampling`` needs its seed; ``Search`` checks the settings: a SettingError, a
    ValueError too)."""
    return decode_beam(model, src, Search(beam, alpha, no_repeat_ngram, sampling, nbest,
                                          max_len_b=max_len_b), use_cache, kernel)


def next_distribution(model: Transformer, src: Tensor, prefix: list[int], sampling: Sampling,
                      no_repeat_ngram: int = 0, kernel: OutputKernel | None = None
                      ) -> tuple[Tensor, Tensor]:
    """The distribution a sample's next token is drawn from, given source ids ``src``
    (1, S) and the target tokens so far ``prefix`` (no BOS): (V',) probabilities, most
    likely first, and their token ids (``sampling_distribution``; temperature 1 without top-k
    or top-p is the model's own distribution)."""
    state = DecoderState(model, src, 1, use_cache=False, no_repeat_ngram=no_repeat_ngram,
                          kernel=kernel)
    tokens = torch.tensor([[BOS_ID, *prefix]], dtype=torch.long, device=src.device)
    with torch.no_grad():
        logits = state.next_logits(tokens, np.array([prefix], dtype=np.int64).reshape(1, -1))
    probs, order = sampling_distribution(logits, sampling)
    return probs[0], state.token_ids(order[0])


