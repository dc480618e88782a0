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
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from aiayn.model import Transformer
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID

NEVER_GENERATED = (PAD_ID, BOS_ID)

class Hypothesis(NamedTuple):
    """One search result; a tuple, so ``ids, score = hypothesis`` works."""

    ids: list[int]  # token ids, without BOS and EOS
    score: float  # log-probability / length penalty (greedy search reports 0.0)


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

    def __init__(self, model: Transformer, src: Tensor, copies: int, use_cache: bool):
        self.model = model
        src_pad = model.src_pad_mask(src)
        memory = model.encode(src, src_pad)  # encode once, then copy to the beams
        if copies > 1:
            memory = memory.repeat_interleave(copies, dim=0)
            src_pad = src_pad.repeat_interleave(copies, dim=0)
        self.memory, self.src_pad = memory, src_pad
        self.cache = model.new_cache() if use_cache else None

    def next_logits(self, tokens: Tensor) -> Tensor:
        """(N, t) prefixes starting with BOS -> (N, V) float logits of the next token."""
        step_input = tokens[:, -1:] if self.cache is not None else tokens
        hidden = self.model.decode(step_input, self.memory, self.src_pad, self.cache)
        logits = self.model.generator(hidden[:, -1]).float()
        logits[:, NEVER_GENERATED] = float("-inf")
        return logits

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
            self.memory = self.memory.index_select(0, rows)
            self.src_pad = self.src_pad.index_select(0, rows)
        elif self.cache is not None:
            self.cache.reorder(rows, kinds=("self",))


@torch.no_grad()
def greedy_decode(
    model: Transformer,
    src: Tensor,
    max_len_b: int = 50,
    use_cache: bool = True,
) -> list[list[int]]:
    """Batched greedy search. src: (B, S) padded ids. Returns token ids without BOS/EOS.

    With ``use_cache=False`` the whole prefix is re-run through the decoder at every step,
    as the tutorials do; it gives the same tokens and exists to measure the cache's gain.
    """
    B = src.size(0)
    state = _DecoderState(model, src, 1, use_cache)
    limits = output_limits(model, state.src_pad, max_len_b)
    active = torch.arange(B, device=src.device)  # original sentence of each row
    tokens = torch.full((B, 1), BOS_ID, dtype=torch.long, device=src.device)
    outputs: list[list[int]] = [[] for _ in range(B)]
    for step in range(1, int(limits.max()) + 1 if B else 1):
        next_token = state.next_logits(tokens).argmax(dim=-1)
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        done = next_token.eq(EOS_ID) | limits[active].eq(step)
        if not bool(done.any()):
            continue
        for row in done.nonzero().flatten().tolist():
            outputs[int(active[row])] = strip_special(tokens[row, 1:].tolist())
        keep = (~done).nonzero().flatten()
        if keep.numel() == 0:
            break
        active, tokens = active[keep], tokens[keep]
        state.select(keep, shrinks=True)
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
) -> list[list[Hypothesis]]:
    """Batched beam search (see the module docstring for the exact rules).

    src: (B, S) padded source ids. Returns, per sentence, up to ``nbest`` hypotheses
    ``(token ids without BOS/EOS, score)``, best first; the score is the log-probability
    divided by the GNMT length penalty.
    """
    if beam < 1:
        raise ValueError(f"beam must be at least 1, got {beam}")
    if not 1 <= nbest <= beam:
        raise ValueError(f"nbest must be between 1 and the beam size {beam}, got {nbest}")
    B, K, device = src.size(0), beam, src.device
    state = _DecoderState(model, src, K, use_cache)
    limits = output_limits(model, state.src_pad[::K], max_len_b)
    active = torch.arange(B, device=device)  # original sentence of each live sentence
    tokens = torch.full((B * K, 1), BOS_ID, dtype=torch.long, device=device)
    # Log-probabilities of the live hypotheses; only the first beam is live at the start,
    # so the K copies of BOS do not become K copies of the same hypothesis.
    scores = torch.full((B, K), float("-inf"), device=device)
    scores[:, 0] = 0.0
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]

    for step in range(1, int(limits.max()) + 1 if B else 1):
        A = active.numel()
        log_probs = torch.log_softmax(state.next_logits(tokens), dim=-1)  # (A*K, V)
        V = log_probs.size(-1)
        candidates = (scores[:, :, None] + log_probs.view(A, K, V)).view(A, K * V)
        top_scores, top_index = candidates.topk(min(2 * K, K * V), dim=1)  # (A, 2K) best first
        top_beam, top_token = top_index // V, top_index % V
        prefixes = tokens.view(A, K, -1)[:, :, 1:]  # drop BOS

        ends = top_token.eq(EOS_ID) & torch.isfinite(top_scores)
        ends[:, K:] = False  # only EOS candidates that rank among the first K are finished
        _finish(finished, active, ends, top_scores, top_beam, prefixes, None, step, alpha)

        # The K best candidates that do not end in EOS stay alive (a stable sort keeps rank).
        alive = top_token.ne(EOS_ID).to(torch.int8).argsort(dim=1, descending=True, stable=True)
        alive = alive[:, :K]
        scores = top_scores.gather(1, alive)
        beam_of, token = top_beam.gather(1, alive), top_token.gather(1, alive)

        at_limit = limits[active].eq(step)
        if bool(at_limit.any()):  # live hypotheses that reached the limit end as they are
            cut = at_limit[:, None] & torch.isfinite(scores)
            _finish(finished, active, cut, scores, beam_of, prefixes, token, step, alpha)
        done = at_limit | ~torch.isfinite(scores[:, 0])
        done |= torch.tensor([len(finished[int(s)]) >= K for s in active], device=device)

        keep = (~done).nonzero().flatten()
        if keep.numel() == 0:
            break
        rows = (keep[:, None] * K + beam_of[keep]).flatten()  # sentence-major beam rows
        tokens = torch.cat([tokens.index_select(0, rows), token[keep].reshape(-1, 1)], dim=1)
        state.select(rows, shrinks=keep.numel() < A)
        active, scores = active[keep], scores[keep]

    return [sorted(hyps, key=lambda h: -h.score)[:nbest] for hyps in finished]


def _finish(
    finished: list[list[Hypothesis]],
    active: Tensor,
    chosen: Tensor,
    scores: Tensor,
    beam_of: Tensor,
    prefixes: Tensor,
    last_token: Tensor | None,
    step: int,
    alpha: float,
) -> None:
    """Move the chosen (A, C) candidates to their sentence's finished list.

    A candidate is ``prefixes[a, beam_of[a, c]]`` followed by EOS (``last_token`` None) or
    by ``last_token[a, c]``; either way it has ``step`` generated tokens.
    """
    if not bool(chosen.any()):
        return
    penalty = length_penalty(step, alpha)
    for a, c in chosen.nonzero().tolist():
        ids = prefixes[a, beam_of[a, c]].tolist()
        if last_token is not None:
            ids.append(int(last_token[a, c]))
        finished[int(active[a])].append(Hypothesis(ids, float(scores[a, c]) / penalty))


def strip_special(ids: list[int]) -> list[int]:
    """Cut a hypothesis at its first EOS."""
    return ids[: ids.index(EOS_ID)] if EOS_ID in ids else ids
