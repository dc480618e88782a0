"""What the searches of ``aiayn.inference.search`` may choose besides the likeliest: the
repetition guard and random sampling (both off by default).

- ``no_repeat_ngram=n`` (``decode.no_repeat_ngram``; CTranslate2's and Transformers'
  ``no_repeat_ngram_size``): a token that would complete an n-gram already in the
  hypothesis gets logit -inf (``ban_repeated_ngrams``), so no hypothesis holds the same
  n-gram twice. It acts in ``aiayn.inference.steps.DecoderState.next_logits``, the one
  step that greedy, beam, joined search and sampling share; at n=0 it does nothing at all.
- ``sampling`` (a ``Sampling``): instead of searching, each of ``beam`` rows per sentence
  draws its next token from the model's distribution at a temperature, cut to the top-k
  pieces and to the nucleus of mass top-p (Holtzman et al. 2020), until it draws EOS or
  reaches the limit. The draws come from a counter-based generator keyed by the seed, the
  sentence's source ids, the sample's number and the step (``uniforms``), so a sample
  depends on nothing else: not on the other sentences of its batch, their order, the batch
  budget, the threads, or when it joined a running search. Its score is as beam search's:
  the model's log-probability (temperature 1) divided by the length penalty.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch
from torch import Tensor

from aiayn.data.tokenizer import PAD_ID
from aiayn.inference.settings import Sampling


# ---------------------------------------------------------------- the repetition guard
def ban_repeated_ngrams(logits: Tensor, history: np.ndarray, n: int,
                        to_column: Tensor | None = None, skip: np.ndarray | None = None) -> None:
    """Set to -inf, in place, the (N, V') ``logits`` of every token that would complete an
    n-gram already in its row's ``history`` (N, t): the row's last n-1 tokens were followed
    by that token before. ``to_column``: token id -> column, for a restricted output layer.
    ``skip``: (N,) bool, rows left as they are.

    Vectorised on the host, where the searches keep the histories: one comparison of every
    (n-1)-gram with the last (hypotheses are short). A joined row's history starts with
    PAD (before it joined); PAD windows could only ban PAD, which is never generated, so
    they ban nothing.
    """
    t = history.shape[1]
    if t < n:  # no n-gram complete yet, so nothing to repeat
        return
    windows = np.lib.stride_tricks.sliding_window_view(history, n, axis=1)  # (N, t-n+1, n)
    last = history[:, t - n + 1:]  # (N, n-1): what the next token would follow
    rows, at = np.nonzero((windows[:, :, :n - 1] == last[:, None, :]).all(axis=2))
    if skip is not None:
        rows, at = rows[~skip[rows]], at[~skip[rows]]
    if rows.size == 0:
        return
    tokens = windows[rows, at, n - 1]
    # PAD completes only windows of a joined row's padding: never generated, nothing to ban,
    # and with a restricted layer it has no column (to_column says IGNORE, a negative index).
    rows, tokens = rows[tokens != PAD_ID], torch.from_numpy(tokens[tokens != PAD_ID])
    if rows.size == 0:
        return
    tokens = tokens.to(logits.device)
    columns = tokens if to_column is None else to_column[tokens]
    logits[torch.from_numpy(rows).to(logits.device), columns] = float("-inf")


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


def uniforms(keys: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """(R,) floats in [0, 1): row r's draw at its own step ``steps[r]`` (53 random bits)."""
    bits = _mix(keys ^ _mix(steps.astype(np.uint64) * _GOLDEN))
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def seed_of(sampling: Sampling) -> int:
    if sampling.seed is None:
        raise ValueError("sampling needs a seed (aiayn.inference.translator.Translator draws one)")
    return sampling.seed
