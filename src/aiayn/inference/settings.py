"""The search settings as one value: ``Search`` (beam, alpha, nbest, length limit a/b,
repetition guard, sampling), resolved and checked once, at the edge, by ``resolve_search``.

Every command builds it once from the run's ``decode`` section (``aiayn.config.
DecodeConfig``) and what the caller gave (`aiayn translate|evaluate` flags, a serve request,
train.eval_beam): a setting not given (None) takes the run's. The Translator, the engines
(``aiayn.inference.engine``), the searches (``aiayn.inference.search``) and serve's batcher
then pass that very value down unchanged; none of them resolves or checks it again. The
checks here need no model; ``Translator.check`` adds the bounds a model and a batch budget
set (beam <= target vocabulary, rows <= half the budget), and an engine says what it
cannot run (``Engine.supports``).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field, replace

from aiayn.config import RANGES, DecodeConfig
from aiayn.errors import AiaynError

MAX_NO_REPEAT_NGRAM = RANGES["decode"]["no_repeat_ngram"][1]
MAX_SAMPLES = RANGES["decode"]["beam"][1]  # samples per sentence, as the widest beam
MAX_TEMPERATURE = 100.0


@dataclass(frozen=True)
class Sampling:
    """Random sampling instead of search (``aiayn.inference.search``'s docstring). Frozen:
    part of a ``Search``."""

    temperature: float = 1.0  # the logits are divided by it: < 1 sharper, > 1 flatter
    top_k: int = 0  # draw among the k most likely pieces only (0: all)
    top_p: float = 1.0  # ... and among the fewest whose probabilities sum to top_p (1: all)
    seed: int | None = None  # the same seed, sentence and settings give the same samples


@dataclass(frozen=True)
class Search:
    """Every setting of one search, as one hashable value. ``beam``: the beam's width, or
    with ``sampling`` the samples drawn per sentence. A sentence of n source ids (EOS
    included) gets at most ``floor(max_len_a * n) + max_len_b`` new tokens (the paper, 6.1:
    "input length + 50"), within the model's max_len.

    ``nbest`` (hypotheses kept per sentence) is left out of equality and hash: it changes
    how many results are kept, not how the search runs, so `aiayn serve` joins requests
    that differ in it alone in one ``JoinableSearch``."""

    beam: int = DecodeConfig.beam
    alpha: float = DecodeConfig.alpha
    no_repeat_ngram: int = DecodeConfig.no_repeat_ngram
    sampling: Sampling | None = None
    nbest: int = field(default=1, compare=False)
    max_len_a: float = DecodeConfig.max_len_a
    max_len_b: int = DecodeConfig.max_len_b

    @property
    def greedy(self) -> bool:
        """A beam of one keeping one hypothesis: greedy search gives its tokens."""
        return self.beam == 1 and self.nbest == 1 and self.sampling is None


def resolve_search(decode: DecodeConfig, beam: int | None = None, alpha: float | None = None,
                   nbest: int = 1, no_repeat_ngram: int | None = None,
                   sampling: Sampling | None = None, max_len_a: float | None = None,
                   max_len_b: int | None = None) -> Search:
    """The one resolution of a search: the settings given, the run's ``decode`` for those
    not (None), checked (an AiaynError naming the option). With ``sampling`` (seeded here,
    ``seeded``) ``nbest`` samples per sentence are drawn: they are the search's rows."""
    check_options(beam, nbest, alpha, no_repeat_ngram, sampling)
    beam = decode.beam if beam is None else beam
    if sampling is None and nbest > beam:
        raise AiaynError(f"--nbest must be between 1 and the beam ({beam}), got {nbest}")
    return Search(nbest if sampling is not None else beam,
                  decode.alpha if alpha is None else alpha,
                  decode.no_repeat_ngram if no_repeat_ngram is None else no_repeat_ngram,
                  seeded(sampling), nbest,
                  decode.max_len_a if max_len_a is None else max_len_a,
                  decode.max_len_b if max_len_b is None else max_len_b)


def check_options(beam: int | None, nbest: int = 1, alpha: float | None = None,
                  no_repeat_ngram: int | None = None, sampling: Sampling | None = None) -> None:
    """The settings a caller gave, before the run's fill the rest: an AiaynError naming
    the option. None (not given) passes. With ``sampling``, nbest is the samples per
    sentence and a beam may not be given."""
    if sampling is not None:
        if beam is not None:
            raise AiaynError("--beam is for beam search; --sample draws --nbest samples per "
                             "sentence instead")
        check_sampling(sampling)
        if not 1 <= nbest <= MAX_SAMPLES:
            raise AiaynError(f"--nbest (samples per sentence with --sample) must be between 1 "
                             f"and {MAX_SAMPLES}, got {nbest}")
    if beam is not None and beam < 1:
        raise AiaynError(f"--beam must be at least 1, got {beam}")
    if sampling is None and (nbest < 1 or (beam is not None and nbest > beam)):
        top = "the beam" if beam is None else f"the beam ({beam})"
        raise AiaynError(f"--nbest must be between 1 and {top}, got {nbest}")
    if alpha is not None and not (math.isfinite(alpha) and 0 <= alpha <= 10):
        raise AiaynError(f"--alpha must be in [0, 10], got {alpha}")
    if no_repeat_ngram is not None and not 0 <= no_repeat_ngram <= MAX_NO_REPEAT_NGRAM:
        raise AiaynError(f"--no-repeat-ngram must be between 0 (off) and {MAX_NO_REPEAT_NGRAM}, "
                         f"got {no_repeat_ngram}")


def check_sampling(sampling: Sampling) -> None:
    """Settings a sample can be drawn with, or an AiaynError naming the option."""
    t = sampling.temperature
    if not (math.isfinite(t) and 0 < t <= MAX_TEMPERATURE):
        raise AiaynError(f"--temperature must be in (0, {MAX_TEMPERATURE:g}] (towards 0: "
                         f"greedy search), got {t}")
    if sampling.top_k < 0:
        raise AiaynError(f"--top-k must be 0 (every piece) or more, got {sampling.top_k}")
    if not (math.isfinite(sampling.top_p) and 0 < sampling.top_p <= 1):
        raise AiaynError(f"--top-p must be in (0, 1], got {sampling.top_p}")
    if sampling.seed is not None and not 0 <= sampling.seed < 2 ** 63:
        raise AiaynError(f"--seed must be between 0 and 2**63 - 1, got {sampling.seed}")


def seeded(sampling: Sampling | None) -> Sampling | None:
    """``sampling`` with a seed: its own, else a random one (reported with the results, so
    that they can be drawn again)."""
    if sampling is None or sampling.seed is not None:
        return sampling
    return replace(sampling, seed=secrets.randbits(31))
