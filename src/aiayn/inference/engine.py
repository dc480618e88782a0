"""Who searches: one interface, ``Engine``, that aiayn's own search
(``aiayn.inference.aiayn_engine.AiaynEngine``) and CTranslate2's
(``aiayn.inference.ct2.CTranslate2Engine``) both implement, so that the Translator, `aiayn
serve` and `aiayn evaluate` never ask which one they hold: they ask the engine what it can do
(``supports``, ``continuous``, ``own_model``) and give it batches of source ids with one
``Search`` value. Which engines there are, by the name --engine takes, is
``aiayn.inference.engines`` (one floor up: this base names none of them).

An engine searches a batch of source id lists (tokens + EOS) with a search and answers, per
sentence, up to ``search.nbest`` hypotheses with their scores, best first (``search``), and
decodes many batches of a budget (``decode``: several at once, one per stream: on a CPU one
per core, each on one thread; aiayn's and CTranslate2's alike).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import ClassVar

import torch

from aiayn.data.batching import token_batches
from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from aiayn.errors import AiaynError, SettingError, is_out_of_memory
from aiayn.inference.budget import default_decode_tokens, stream_budget
from aiayn.inference.settings import Search
from aiayn.inference.steps import Hypothesis
from aiayn.model import OutputKernel, Transformer
from aiayn.util.threads import default_streams, parallel_map


class Engine(ABC):
    """A search engine. Class-level answers, known before one is loaded: ``continuous``
    (sentences can join a running search: serve's continuous batching) and ``own_model``
    (it holds aiayn's Transformer, which teacher-forced passes need: attention maps, word
    alignments, scores of given targets, next-piece distributions)."""

    name: ClassVar[str]
    continuous: ClassVar[bool]
    own_model: ClassVar[bool]
    device: torch.device
    max_len: int  # the model's positions: sources and outputs are cut to fit
    tgt_vocab_size: int
    model: Transformer | None  # aiayn's model where ``own_model``
    streams: int | None = None  # batches decoded at once (None: ``default_streams``)
    threads_per_stream: int = 1  # torch's intra-op threads in each (aiayn's engine: see there)
    kernel: OutputKernel | None = None  # the output layer's product aiayn's model computes with

    def supports(self, search: Search) -> None:  # noqa: B027 (runs everything, by default)
        """An AiaynError naming what this engine cannot run of ``search`` (nothing here)."""

    @classmethod
    def require_model(cls, what: str) -> None:
        """An AiaynError unless the engine holds aiayn's model, which ``what`` needs."""
        if not cls.own_model:
            raise AiaynError(f"{what} need aiayn's own model, not --engine {cls.name}")

    def unwritable(self, ids: list[int]) -> list[int]:
        """The target ids among ``ids`` a search never outputs, which a prefix may not hold:
        PAD, BOS and EOS here (an engine that knows its output layer says more)."""
        return [i for i in ids if i in (PAD_ID, BOS_ID, EOS_ID)]

    def default_budget(self) -> int:
        """The decoding budget (padded source tokens x beam) ``decode_tokens=None`` means."""
        return default_decode_tokens(None, torch.device("cpu"))

    def check_budget(self, decode_tokens: int) -> None:
        """An AiaynError if the decoding budget cannot be held."""
        if decode_tokens < 1:
            raise SettingError("{decode_tokens} must be at least 1, got {got}", got=decode_tokens)

    @abstractmethod
    def search(self, sources: list[list[int]], search: Search, greedy_ok: bool = False,
               prefixes: list[list[int]] | None = None) -> list[list[Hypothesis]]:
        """One batch of source ids (tokens + EOS) -> per sentence up to ``search.nbest``
        hypotheses, best first. ``greedy_ok``: a greedy ``search`` may skip the scores
        (reported as 0.0). ``prefixes``: per sentence the target ids its translation starts
        with (no BOS; None: none)."""

    def decode(self, sources: list[list[int]], search: Search, decode_tokens: int,
               greedy_ok: bool = False, prefixes: list[list[int]] | None = None
               ) -> tuple[list[list[int]], Iterable[list[list[Hypothesis]]]]:
        """Every source, in batches of at most ``decode_tokens`` padded source tokens x beam
        (``token_batches``), cut for the streams (``stream_budget``: a few sentences still
        fill each stream): the batches (indices into ``sources``) and, lazily, each one's
        hypotheses, decoded several at once (``parallel_map``; one stream: one after another)."""
        streams = self.streams or default_streams(self.device)
        widths = [len(s) for s in sources]
        batches = token_batches(widths, stream_budget(widths, decode_tokens, search.beam,
                                                      streams), copies=search.beam)

        def one(batch: list[int]) -> list[list[Hypothesis]]:
            rows = [sources[i] for i in batch]
            try:
                return self.search(rows, search, greedy_ok, pick(prefixes, batch))
            except (RuntimeError, MemoryError) as exc:
                if not is_out_of_memory(exc):
                    raise
                tokens = len(rows) * max(map(len, rows)) * search.beam
                raise SettingError(
                    "out of memory decoding a batch of {rows} sentence(s) x beam {width} "
                    "({tokens} padded tokens) on {device}; give a smaller {decode_tokens} "
                    "(now {budget})", rows=len(rows), width=search.beam, tokens=tokens,
                    device=self.device, budget=decode_tokens) from None

        return batches, parallel_map(one, batches, streams, self.threads_per_stream)


def pick(prefixes: list[list[int]] | None, batch: list[int]) -> list[list[int]] | None:
    """The prefixes of a batch's sentences (None: none given)."""
    return None if prefixes is None else [prefixes[i] for i in batch]
