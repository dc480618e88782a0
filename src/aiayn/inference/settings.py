"""The search settings as one value: ``Search`` (beam, alpha, nbest, length limit a/b,
repetition guard, sampling), which checks its own bounds when built (``aiayn.config.RANGES``),
and ``resolve_search``, the one function that fills the settings a caller left out from the
run's.

Every command builds it once from the run's ``decode`` section (``aiayn.config.
DecodeConfig``) and what the caller gave (`aiayn translate|evaluate` flags, a serve request,
train.eval_beam; in Python ``Translator.resolve(beam=4)``): a setting not given (None) takes
the run's. The Translator, the engines (``aiayn.inference.engine``), the searches
(``aiayn.inference.search``) and serve's batcher then pass that very value down unchanged;
none of them resolves or checks it again. The checks here need no model; ``Translator.check``
adds the bounds a model and a batch budget set (beam <= target vocabulary, rows <= half the
budget), and an engine says what it cannot run (``Engine.supports``).

A refusal is a ``SettingError`` naming the settings by their Python names; `aiayn translate`
spells them as its flags (``--beam``), the HTTP API as its JSON fields (``"beam"``).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field, replace

from aiayn.config import RANGES, DecodeConfig
from aiayn.errors import SettingError

# The samples per sentence a user may ask for: as many as the widest beam a run's config may
# hold (the search itself takes more: a test's exhaustive draw).
MAX_SAMPLES = RANGES["decode"]["beam"][1]


@dataclass(frozen=True)
class Sampling:
    """Random sampling instead of search (``aiayn.inference.search``'s docstring). Frozen:
    part of a ``Search``. Its bounds are ``RANGES["sample"]``'s, checked when built."""

    temperature: float = 1.0  # the logits are divided by it: < 1 sharper, > 1 flatter
    top_k: int = 0  # draw among the k most likely pieces only (0: all)
    top_p: float = 1.0  # ... and among the fewest whose probabilities sum to top_p (1: all)
    seed: int | None = None  # the same seed, sentence and settings give the same samples

    def __post_init__(self) -> None:
        within("sample", "temperature", self.temperature,
               "in {range} (towards 0: greedy search)")
        within("sample", "top_k", self.top_k, "{low} (every piece) or more")
        within("sample", "top_p", self.top_p, "in {range}")
        if self.seed is not None:
            within("sample", "seed", self.seed, "between {low} and {high}")


@dataclass(frozen=True)
class Search:
    """Every setting of one search, as one hashable value, checked when built (bounds from
    ``aiayn.config.RANGES``; a ``SettingError`` names the setting). ``beam``: the beam's
    width, or with ``sampling`` the samples drawn per sentence. A sentence of n source ids
    (EOS included) gets at most ``floor(max_len_a * n) + max_len_b`` new tokens (the paper,
    6.1: "input length + 50"), within the model's max_len.

    ``nbest`` (hypotheses kept per sentence, 1 to the beam) is left out of equality and
    hash: it changes how many results are kept, not how the search runs, so `aiayn serve`
    joins requests that differ in it alone in one ``JoinableSearch``."""

    beam: int = DecodeConfig.beam
    alpha: float = DecodeConfig.alpha
    no_repeat_ngram: int = DecodeConfig.no_repeat_ngram
    sampling: Sampling | None = None
    nbest: int = field(default=1, compare=False)
    max_len_a: float = DecodeConfig.max_len_a
    max_len_b: int = DecodeConfig.max_len_b

    def __post_init__(self) -> None:
        if not isinstance(self.nbest, int) or isinstance(self.nbest, bool):
            raise SettingError("{nbest} must be an integer, got {got!r}", got=self.nbest)
        # A beam's only bound here is its low end: decode.beam's top (a config's) is no
        # limit of the search's (a test's exhaustive beam is wider); ``Translator.check``
        # bounds it by the model and the budget.
        within("decode", "beam", self.beam, "at least {low}", top=False)
        if not 1 <= self.nbest <= self.beam:
            raise SettingError("{nbest} must be between 1 and the beam ({beam} {width}), "
                               "got {got}", width=self.beam, got=self.nbest)
        within("decode", "alpha", self.alpha, "in {range}")
        within("decode", "no_repeat_ngram", self.no_repeat_ngram,
               "between {low} (off) and {high}")
        within("decode", "max_len_a", self.max_len_a, "in {range}")
        within("decode", "max_len_b", self.max_len_b, "between {low} and {high}")

    @property
    def greedy(self) -> bool:
        """A beam of one keeping one hypothesis: greedy search gives its tokens."""
        return self.beam == 1 and self.nbest == 1 and self.sampling is None


def resolve_search(decode: DecodeConfig, *, beam: int | None = None,
                   alpha: float | None = None, nbest: int = 1,
                   no_repeat_ngram: int | None = None, sampling: Sampling | None = None,
                   max_len_a: float | None = None, max_len_b: int | None = None) -> Search:
    """The one resolution of a search: the settings given, the run's ``decode`` for those
    not (None), checked (``Search``). With ``sampling`` (seeded here, ``seeded``) ``nbest``
    samples per sentence are drawn: they are the search's rows, and a beam may not be
    given."""
    if sampling is not None and beam is not None:
        raise SettingError("{beam} is for beam search; {sampling} draws {nbest} samples per "
                           "sentence instead")
    if sampling is not None and not (isinstance(nbest, int) and 1 <= nbest <= MAX_SAMPLES):
        raise SettingError("{nbest} (samples per sentence with {sampling}) must be between 1 "
                           "and {top}, got {got}", top=MAX_SAMPLES, got=nbest)
    return Search(nbest if sampling is not None else decode.beam if beam is None else beam,
                  decode.alpha if alpha is None else alpha,
                  decode.no_repeat_ngram if no_repeat_ngram is None else no_repeat_ngram,
                  seeded(sampling), nbest,
                  decode.max_len_a if max_len_a is None else max_len_a,
                  decode.max_len_b if max_len_b is None else max_len_b)


def within(section: str, name: str, value, rule: str, top: bool = True) -> None:
    """A SettingError unless ``value`` is a number of ``RANGES[section][name]``'s kind (an
    integer where its low end is one) in that range. ``rule`` says the range in the
    message, with ``{low}``, ``{high}`` and ``{range}`` ("[0, 10]", "(0, 1]"). ``top``
    False: no upper bound."""
    low, high, open_low = RANGES[section][name]
    high = high if top else math.inf
    integer = isinstance(low, int)
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise SettingError(f"{{{name}}} must be {'an integer' if integer else 'a number'}, "
                           "got {got!r}", got=value)
    if math.isfinite(value) and (low < value if open_low else low <= value) and value <= high:
        return
    bounds = {"low": _number(low), "high": _number(high)}
    bounds["range"] = f"{'(' if open_low else '['}{bounds['low']}, {bounds['high']}]"
    raise SettingError(f"{{{name}}} must be {rule}, got {{got}}", got=value, **bounds)


def _number(x: float) -> str:
    """A bound as a message writes it: 10, 0.5, 2**63 - 1."""
    if isinstance(x, int) and x > 2 ** 32 and (x + 1).bit_count() == 1:
        return f"2**{x.bit_length()} - 1"
    return f"{x:g}"


def seeded(sampling: Sampling | None) -> Sampling | None:
    """``sampling`` with a seed: its own, else a random one (reported with the results, so
    that they can be drawn again)."""
    if sampling is None or sampling.seed is not None:
        return sampling
    return replace(sampling, seed=secrets.randbits(31))
