"""Toy tasks on digit strings and a short training run on them, for the notebooks.

A model of a few hundred thousand weights learns to reverse, sort or copy strings of digits in
a minute on one CPU core, so a notebook can train it for real, change one part, train it again
and compare (docs/ablations.ipynb). The run uses the package's own pieces, the ones
``aiayn train`` runs: the word-level tokenizer, the token-budget batches, ``train_step`` with
Adam and the schedule of ``config.train``, greedy search for the held-out answers.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from aiayn.config import Config, DataConfig
from aiayn.data.batching import TokenBatchSampler, pad
from aiayn.data.prepared import EncodedSplit, SplitIds, encode_split
from aiayn.data.tokenizer import PAD_ID, Tokenizers, train_tokenizers
from aiayn.evaluation.evaluate import dev_loss
from aiayn.inference.search import greedy_decode
from aiayn.model import Transformer
from aiayn.training.distributed import Dist, set_seed
from aiayn.training.loop import train_step
from aiayn.training.optim import build_optimizer
from aiayn.training.stream import BatchStream, TrainData

# What each task writes for a string of digits (a list of one-character strings).
TASKS: dict[str, Callable[[list[str]], list[str]]] = {
    "reverse": lambda digits: digits[::-1],
    "sort": sorted,
    "copy": lambda digits: digits,
}


def digit_pairs(task: str, n: int, lengths: tuple[int, int] = (3, 8), seed: int = 0
                ) -> list[tuple[str, str]]:
    """``n`` pairs (source, target) of distinct random digit strings, space-separated, each
    ``lengths[0]`` to ``lengths[1]`` digits long; the target is ``TASKS[task]`` of the source."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; one of {', '.join(TASKS)}")
    rng = random.Random(seed)
    pairs: dict[str, str] = {}
    while len(pairs) < n:  # distinct sources: a held-out string is never a training string
        digits = [rng.choice("0123456789") for _ in range(rng.randint(*lengths))]
        pairs[" ".join(digits)] = " ".join(TASKS[task](digits))
    return list(pairs.items())


def digit_tokenizers(pairs: list[tuple[str, str]]) -> Tokenizers:
    """A joint word-level vocabulary: the 4 special tokens and the 10 digits."""
    return train_tokenizers(pairs, DataConfig(tokenizer="wordlevel", vocab_size=16,
                                              min_frequency=1))


@dataclass
class ToyRun:
    """A model trained by :func:`train_toy`, with what was measured along the way."""

    model: Transformer
    tokenizers: Tokenizers
    config: Config
    held_out: list[tuple[str, str]]
    # {"step", "loss"} every step (the label-smoothed training loss), and {"step",
    # "dev_loss", "dev_nll", "exact"} at every evaluation (held-out teacher-forced loss,
    # label-smoothed and plain, and the share of held-out strings that greedy search gets
    # exactly right)
    records: list[dict] = field(default_factory=list)
    seconds: float = 0.0  # the run's wall time, evaluations included

    def evaluations(self) -> list[dict]:
        return [r for r in self.records if "exact" in r]

    def last(self, key: str) -> float:
        """The last value of ``key`` in the records."""
        return next(r[key] for r in reversed(self.records) if key in r)

    def translate(self, sources: list[str]) -> list[str]:
        """Greedy search, as the evaluation runs it."""
        return translate_greedy(self.model, self.tokenizers, sources)


def translate_greedy(model: Transformer, tokenizers: Tokenizers, sources: list[str]
                     ) -> list[str]:
    was_training = model.training
    model.eval()
    try:
        ids = greedy_decode(model, pad(tokenizers.encode_src(sources)))
    finally:
        model.train(was_training)
    return tokenizers.decode_tgt(ids)


def exact_share(model: Transformer, tokenizers: Tokenizers, pairs: list[tuple[str, str]]
                ) -> float:
    """The share of ``pairs`` whose greedy translation is exactly the target."""
    outputs = translate_greedy(model, tokenizers, [s for s, _ in pairs])
    return sum(o == t for o, (_, t) in zip(outputs, pairs, strict=True)) / len(pairs)


def train_toy(config: Config, train_pairs: list[tuple[str, str]],
              held_out: list[tuple[str, str]], steps: int, eval_every: int = 50,
              change: Callable[[Transformer], None] | None = None,
              on_eval: Callable[[ToyRun, int], None] | None = None) -> ToyRun:
    """Train a fresh model of ``config`` for ``steps`` updates on one CPU thread.

    The seed is ``config.train.seed``, drawn the same way for every run, so two runs differ
    only by ``change`` (called on the new model before the optimizer sees it: swap a module,
    zero a table) and by the config. ``on_eval(run, step)`` is called at step 0 and at every
    evaluation (e.g. to record an attention map as it forms). A run whose loss stops being
    finite ends there, its records up to that step kept.
    """
    began = time.perf_counter()
    tokenizers = digit_tokenizers(train_pairs)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the same float sums on every machine, and seconds per run
    try:
        set_seed(config.train.seed)
        model = Transformer(config.model)
        if change is not None:
            change(model)
        model.train()
        optimizer = build_optimizer(model, config)
        train = EncodedSplit(SplitIds.encode(train_pairs, tokenizers), config.model.max_len,
                             "drop")
        sampler = TokenBatchSampler(train.src_lens, train.tgt_lens, config.train.max_tokens,
                                    seed=config.train.seed)
        dev, _ = encode_split(held_out, tokenizers, config.model.max_len, "truncate")
        stream = BatchStream(TrainData(train, sampler, dev, held_out, tokenizers), PAD_ID,
                             torch.device("cpu"), max_epochs=1_000_000)
        run = ToyRun(model, tokenizers, config, held_out)
        world = Dist()

        def evaluate(step: int) -> None:
            was_training = model.training
            model.eval()
            try:
                loss, nll = dev_loss(model, dev, config, world.device)
            finally:
                model.train(was_training)
            run.records.append({"step": step, "dev_loss": loss, "dev_nll": nll,
                                "exact": exact_share(model, tokenizers, held_out)})
            if on_eval is not None:
                on_eval(run, step)

        evaluate(0)
        for step in range(1, steps + 1):
            result = train_step(model, None, optimizer, [stream.next()], step, config, world)
            if not math.isfinite(result.loss):
                run.records.append({"step": step, "loss": result.loss})
                break
            run.records.append({"step": step, "loss": result.loss})
            if step % eval_every == 0 or step == steps:
                evaluate(step)
        model.eval()
        run.seconds = time.perf_counter() - began
        return run
    finally:
        torch.set_num_threads(before)


class Confidence(NamedTuple):
    """How sure a model is of the next token, teacher-forced on the right answers."""

    top: float  # the mean probability of its most probable token
    right: float  # the share of positions where that token is the right one
    sure: float  # the share of positions where it gives that token more than ``SURE``


SURE = 0.95


@torch.no_grad()
def token_confidence(model: Transformer, tokenizers: Tokenizers,
                     pairs: list[tuple[str, str]]) -> Confidence:
    """The model's :class:`Confidence` over the target positions of ``pairs``."""
    was_training = model.training
    model.eval()
    try:
        src = pad(tokenizers.encode_src([s for s, _ in pairs]))
        tgt = pad(tokenizers.encode_tgt([t for _, t in pairs]))
        probs = model(src, tgt[:, :-1]).float().softmax(dim=-1)
    finally:
        model.train(was_training)
    real = tgt[:, 1:].ne(PAD_ID)
    top, choice = probs.max(dim=-1)
    return Confidence(float(top[real].mean()), float(choice.eq(tgt[:, 1:])[real].float().mean()),
                      float(top[real].gt(SURE).float().mean()))
