"""Continuous batching: a beam search that sentences join at any step and leave when done
(``JoinableSearch``, behind `aiayn serve`), driving the steps ``decode_beam`` drives
(``aiayn.inference.steps``) so that each sentence gets what ``beam_search`` gives it alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from aiayn.data.tokenizer import BOS_ID
from aiayn.inference.sampling import sample_keys, seed_of
from aiayn.inference.settings import Search
from aiayn.inference.steps import (
    DecoderState,
    Followed,
    Hypothesis,
    Outputs,
    Rows,
    advance,
    check_prefixes,
    decode_and_choose,
    first_scores,
    go_on,
    output_limits,
    settle,
)
from aiayn.model import OutputKernel, Transformer


class JoinableSearch:
    """Beam search that sentences join at any step and leave as soon as they are done
    (continuous batching: `aiayn serve` adds the requests that arrive while it decodes).

    ``add(keys, src)`` encodes sentences and adds their rows at the next step; ``step()``
    decodes one token for every live row and returns the sentences that are done, as ``(key,
    hypotheses)`` with up to ``beam`` hypotheses best first. Every sentence gets what
    ``beam_search`` gives it alone (same tokens, scores up to float rounding; a test): the
    rules of ``aiayn.inference.search``'s docstring apply to each sentence from its own
    first step. Rows that joined later start later in the self-attention cache: their
    earlier columns are masked and their positions count from their own start
    (``KVCache.start``); sources of other lengths are padded on the right and masked.
    Columns that every live row started after are dropped, so a search that never empties
    stays as long as its oldest sentence. A ``search`` of beam 1 is greedy search; its nbest
    is not read (a sentence gets up to ``beam`` hypotheses: `aiayn serve` keeps what each
    request asked for). It scores with the output layer's rows as they were when it started
    (the weights of a model being served do not change): a model trained further needs a new
    search. The guard and sampling: as ``decode_beam``'s (a sample depends on its sentence
    alone, not on when it joined). ``kernel``: the output layer's product
    (``decode_beam``'s); ``outputs``: the model's ``Outputs`` with that kernel, where a search
    of the same model and kernel made them already (a serving lane's searches share them; a
    search that empties and starts again keeps its own): their kernel is the one used.
    """

    taken = 0  # the steps the last ``step`` took

    def __init__(self, model: Transformer, search: Search, kernel: OutputKernel | None = None,
                 outputs: Outputs | None = None):
        self.model, self.search, self.kernel, self.outputs = model, search, kernel, outputs
        self.beam, self.alpha, self.sampling = search.beam, search.alpha, search.sampling
        self._start()

    def _start(self) -> None:
        self.state = DecoderState.joinable(self.model, self.search.no_repeat_ngram,
                                            self.kernel, self.outputs)
        self.outputs = self.state.outputs
        K, device = self.beam, self.state.src_pad.device
        self.rows = Rows(np.zeros(0, dtype=np.int64), copies=K,
                          keys=None if self.sampling is None else np.zeros(0, np.uint64))
        self.scores = torch.zeros(0, K, device=device)
        self.token = torch.zeros(0, K, dtype=torch.long, device=device)
        self.finished: dict[int, list[Hypothesis]] = {}

    def __len__(self) -> int:
        """Sentences being decoded."""
        return len(self.rows.sentence)

    @torch.inference_mode()
    def add(self, keys: list[int], src: Tensor,
            prefixes: Sequence[Sequence[int]] | None = None) -> None:
        """Sentences ``src`` ((n, S) padded source ids), known by ``keys``, join the search;
        ``prefixes``: the target tokens each starts with (``decode_beam``'s). Keys that are
        not new and prefixes the model cannot write raise a ValueError before anything
        changes, as do ids outside int8's tables (the sentences are encoded before they join)."""
        if not keys:
            return
        if len(keys) != src.size(0) or len(set(keys)) < len(keys) or set(keys) & set(self.finished):
            raise ValueError("add needs one new key per source row")
        if prefixes is not None:
            check_prefixes(self.model, prefixes)
        K = self.beam
        limits = output_limits(self.model, self.state.join(src.to(self.scores.device), K), self.search)
        self.rows.add(np.array(keys, dtype=np.int64), limits, K,
                      None if self.sampling is None else
                      sample_keys(src, seed_of(self.sampling), K), prefixes)
        scores = first_scores(len(keys), K, self.sampling, self.scores.device)
        self.scores = torch.cat([self.scores, scores])
        self.token = torch.cat([self.token, torch.full_like(scores, BOS_ID, dtype=torch.long)])
        self.finished.update((key, []) for key in keys)

    @torch.inference_mode()
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
        index = torch.from_numpy(keep).to(device)
        self.state.select(torch.from_numpy(beam_rows).to(device), index)
        self.scores, self.token = self.scores.index_select(0, index), self.token.index_select(0, index)
        self._trim()

    def step(self, most: int = 1, wake: int | None = None) -> list[tuple[int, list[Hypothesis]]]:
        """Decode one token of every live sentence; the sentences done, with their lists.
        ``most`` > 1: where the kernel can (int8's fused step), up to ``most`` tokens in one
        call while no sentence is done and nothing arrives on the file descriptor ``wake`` (a
        serving lane's pipe), the hypotheses that end meanwhile kept by the kernel: the same
        tokens and hypotheses as as many steps, without the Python between them. (A serving
        lane holds inference mode for its life: entering it again at every step cost a lane
        ~2% of a step.)"""
        if torch.is_inference_mode_enabled():
            return self._step(most, wake)
        with torch.inference_mode():
            return self._step(most, wake)

    def _step(self, most: int, wake: int | None) -> list[tuple[int, list[Hypothesis]]]:
        self.taken = 0
        if not len(self):
            return []
        rows, K = self.rows, self.beam
        first = rows.history.shape[1] + 1  # steps so far, counted from the oldest sentence
        self.scores, self.token, host = decode_and_choose(first, self.token, self.scores, self.state,
                                                          rows, self.sampling, rows.given(first),
                                                          most=most, wake=wake)
        step = rows.history.shape[1] + 1  # the last step's, where it took several
        self.taken = step - first + 1
        if host.ended is not None:  # hypotheses that ended while every sentence went on
            rows.finish_ended(self.finished, host.ended, self.alpha)
        if isinstance(host, Followed):  # every sentence goes on
            go_on(rows, self.state, host)
            return []
        done = settle(rows, self.finished, host, step, self.alpha)
        answers = [(int(key), sorted(self.finished.pop(key), key=lambda h: -h.score)[:K])
                   for key in rows.sentence[done]]
        keep = np.flatnonzero(~done)
        if keep.size == 0:
            self._start()
            return answers
        self.scores, self.token = advance(rows, self.state, host, keep, self.scores, self.token)
        self._trim()
        return answers

    def _trim(self) -> None:
        unused = int(self.rows.offset.min())  # columns from before every live sentence joined
        if unused:
            self.rows.trim(unused)
            self.state.trim(unused)
