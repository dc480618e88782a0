"""The model behind `aiayn serve`: one loaded run, its batcher, attention pictures and the
answers' JSON, with no HTTP in sight (``aiayn.serving.app`` puts it behind FastAPI).

``ModelService`` owns the ``Translator`` and the ``Batcher``; the request limits
(``ServeLimits``) and the refusal they raise (``TooLarge``) live here so that the app and
any other front end apply the same ones.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import logging
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aiayn.config import Config, load_config
from aiayn.errors import AiaynError, SettingError
from aiayn.inference.align import hypothesis_alignments
from aiayn.inference.attention import SentenceAttention
from aiayn.inference.settings import Sampling, Search, resolve_search
from aiayn.inference.translator import (
    Translator,
    truncation_message,
)
from aiayn.inspect import plots
from aiayn.inspect.attention_steps import CheckpointModels
from aiayn.inspect.info import run_info
from aiayn.runs.directory import resolve_weights, step_weights
from aiayn.serving.batcher import MAX_WAIT_MS, Batcher, ClientGone, default_batching

MAX_BEAM = 16  # a wider beam is refused (422): its cost grows with the beam


MAX_TOP = 50  # pieces POST /next returns at most


CACHED_STEPS = 3  # step checkpoints' models kept loaded for POST /attention's "step"


log = logging.getLogger("aiayn.serve")  # one name for the server's log lines


# ---------------------------------------------------------------- limits and errors
@dataclass(frozen=True)
class ServeLimits:
    """What one request may ask for; more is refused with 413 (or 422 for search settings)."""

    max_body_bytes: int = 1_000_000
    max_sentences: int = 64  # sentences in one /translate request
    max_chars: int = 20_000  # characters in one request, all sentences together


class TooLarge(Exception):
    """A request over a ``ServeLimits`` limit: answered with 413 and this message."""


def check_size(texts: list[str], limits: ServeLimits) -> None:
    """Refuse (``TooLarge``) more sentences or characters than the limits allow."""
    if len(texts) > limits.max_sentences:
        raise TooLarge(f"{len(texts)} sentences in one request; the limit is "
                       f"{limits.max_sentences}: send them in several requests")
    chars = sum(len(t) for t in texts)
    if chars > limits.max_chars:
        raise TooLarge(f"{chars} characters in one request; the limit is {limits.max_chars}")


# ---------------------------------------------------------------- the model behind the batcher
class ModelService:
    """A Translator behind a ``Batcher``, with what /info tells about its run."""

    def __init__(self, translator: Translator, config: Config, info: dict[str, Any],
                 max_wait_ms: float = MAX_WAIT_MS, batching: str | None = None,
                 lanes: str | None = None):
        self.translator = translator
        self.config = config
        self.info = info
        self.batcher = Batcher(translator, max_wait_ms, batching or default_batching(translator),
                               lanes)
        self.requests = 0
        self._toward: dict[str | None, Translator] = {}  # ``toward``'s, by direction
        # The run's saved steps (none for a CTranslate2 export): models of their own, used
        # on the batcher's thread alone.
        self.steps = run_steps(info["run_dir"]) if translator.engine.own_model else {}
        self.checkpoints = (CheckpointModels(translator.model.cfg, CACHED_STEPS)
                            if self.steps else None)
        info["steps"] = list(self.steps)
        self._figures: dict[str, bytes] = {}
        self._figures_lock = threading.Lock()

    @classmethod
    def from_run(cls, run_dir: str | Path, weights: str = "best",
                 device: str | torch.device = "cpu", engine: str = "aiayn",
                 decode_tokens: int | None = None, max_wait_ms: float = MAX_WAIT_MS,
                 batching: str | None = None, lanes: str | None = None,
                 int8: bool = False) -> ModelService:
        """Load ``run_dir`` once (``Translator.from_pretrained``: a run directory, or with
        ``engine="ctranslate2"`` an `aiayn export --to ctranslate2` directory) and gather
        what /info reports. ``decode_tokens``: the decoding budget of a batch and of a pass, in
        source tokens x beam (None: the device's, ``aiayn.inference.budget.
        default_decode_tokens``). ``batching``: see ``Batcher``
        (None: continuous where the engine allows it); ``lanes``: where continuous
        batching decodes, "processes" or "threads" (None: ``default_lanes``); ``int8``:
        aiayn's engine with its decoder and output layer in int8 (``aiayn.inference.int8``)."""
        translator = Translator.from_pretrained(run_dir, weights, device=device, engine=engine,
                                                decode_tokens=decode_tokens,
                                                int8=int8)
        config = load_config(Path(run_dir) / "config.yaml")
        info = serve_info(run_dir, weights, config, translator)
        return cls(translator, config, info, max_wait_ms, batching, lanes)

    def close(self) -> None:
        self.batcher.close()

    def toward(self, to: str | None) -> Translator:
        """The translator of a request's ``to`` (``Translator.toward``: the same engine and
        model), refused in one line (422) where the model has no such direction, or has
        several and ``to`` is None. A request's direction is its source ids' first piece,
        so requests of every direction share the batcher's searches."""
        translator = self._toward.get(to)
        if translator is None:  # made once per direction: a request's path is short
            translator = self.translator.toward(to)
            translator.check_direction()
            self._toward[to] = translator
        return translator

    def resolve(self, **settings) -> Search:
        """A request's search, resolved once over the run's (as ``Translator.resolve``, its
        keywords) and within this server's limit: a beam (or samples per sentence) of at
        most ``MAX_BEAM``. A request's own beam is refused on arrival (422); only the run's,
        or nbest samples, can be over it here."""
        search = resolve_search(self.translator.decode, **settings)
        if search.beam > MAX_BEAM and search.sampling is not None:  # the samples are the rows
            raise SettingError("{nbest} {got}: at most {top} samples per sentence on this "
                               "server", got=search.nbest, top=MAX_BEAM)
        if search.beam > MAX_BEAM:  # before the model's bounds: the request's fix is here
            raise SettingError("the run's decode.beam {got} is over this server's limit of "
                               "{top}; give {beam} in the request", got=search.beam, top=MAX_BEAM)
        self.translator.check(search)  # as Translator.resolve does
        return search

    async def translate(self, texts: list[str], search: Search,
                        gone: Callable[[], Awaitable[Any]] | None = None,
                        alignments: bool = False,
                        prefixes: list[str | None] | None = None, to: str | None = None
                        ) -> dict:
        """`aiayn translate`'s answer for ``texts``: translations in input order with their
        scores, the n-best lists (each entry with its score, log-probability, pieces and
        their log-probabilities: ``Translation.as_dict``; an empty sentence gives "", a null
        score and an empty list), the truncation warning of these sentences, the search run
        (``search``, as ``resolve`` gave it) and the seconds of the decoding pass that
        answered them. ``gone``: see ``answer``. With sampling: ``search.nbest`` samples per
        sentence, and the seed they were drawn with. ``prefixes``: the start of each
        translation (``Translator.translate``'s). ``to``: the target language of a model
        that has several (``toward``).
        ``alignments``: also each translation's word alignment ("alignments", and
        "alignment" in each n-best entry), from a teacher-forced pass over the hypotheses
        run while no search steps on the model (the capture sets flags on it)."""
        translator = self.toward(to)
        if alignments:
            translator.check_alignments()
        nbest, sampling = search.nbest, search.sampling
        sources = translator.prepare(texts, prefixes)  # the direction's tag: the first id
        future = self.batcher.translate(sources, search)
        try:
            hyps, seconds = await answer(future, gone)
        except ClientGone:
            self.batcher.forget(future)
            raise
        links = None
        if alignments:
            ids = hyps
            links = await answer(self.batcher.run_alone(
                lambda: hypothesis_alignments(translator, sources, ids, nbest)), gone)
        hyps = translator.translations(sources, hyps, nbest)
        self.requests += 1
        warnings = ([truncation_message(sources.truncated, self.translator.max_len)]
                    if sources.truncated else [])
        answered = {
            "translations": [h[0].text if h else "" for h in hyps],
            "scores": [h[0].as_dict()["score"] if h else None for h in hyps],
            "nbest": [[_entry(t) for t in h] for h in hyps],
            "warnings": warnings, "beam": None if sampling else search.beam,
            "alpha": search.alpha, "no_repeat_ngram": search.no_repeat_ngram,
            "sample": None if sampling is None else asdict(search.sampling),
            "seconds": seconds,
        }
        if links is not None:
            answered["alignments"] = [[list(pair) for pair in sentence[0]] if sentence else []
                                      for sentence in links]
            for entries, sentence in zip(answered["nbest"], links, strict=True):
                for entry, alignment in zip(entries, sentence, strict=True):
                    entry["alignment"] = [list(pair) for pair in alignment]
        return answered

    async def attention(self, text: str, search: Search,
                        gone: Callable[[], Awaitable[Any]] | None = None,
                        step: int | None = None, to: str | None = None) -> dict:
        """`aiayn attention`'s maps for one sentence translated by ``search`` (``resolve``),
        as nested lists (see ``attention_json``); with ``step``, those of that step
        checkpoint over the served model's translation. ``to``: as ``translate``'s."""
        translator = self.toward(to)
        if step is not None and step not in self.steps:
            have = (f"this run has {', '.join(map(str, self.steps))}" if self.steps
                    else "this run has no step checkpoints")
            raise AiaynError(f"no step checkpoint {step}; {have}")

        def work() -> SentenceAttention:
            if step is None:
                return translator.attention(text, search)
            target = translator.target_ids(text, search=search)
            return translator.attention_of(self.checkpoints.get(self.steps[step]), text,
                                                target)

        att = await answer(self.batcher.run_alone(work), gone)
        self.requests += 1
        return {**attention_json(att), "step": step}

    async def next_piece(self, text: str, target: str | None, step: int | None,
                         search: Search, top: int,
                         gone: Callable[[], Awaitable[Any]] | None = None,
                         to: str | None = None) -> dict:
        """POST /next: the ``top`` likeliest pieces a sample of ``search`` (``resolve``, with
        its sampling) would draw at ``step`` of the translation, with their probabilities
        (``Translator.next_piece``). ``to``: as ``translate``'s."""
        translator = self.toward(to)
        translator.engine.require_model("the next piece's distribution")
        result = await answer(self.batcher.run_alone(lambda: translator.next_piece(
            text, target, step, search, top)), gone)
        self.requests += 1
        sampling = search.sampling or Sampling()
        return {**asdict(result), "temperature": sampling.temperature,
                "top_k": sampling.top_k, "top_p": sampling.top_p,
                "no_repeat_ngram": search.no_repeat_ngram}

    def stats(self) -> dict:
        """GET /stats: the batcher's counters (``BatchStats``), the mean sentences decoded
        in a step, its settings and how it batches."""
        stats = asdict(self.batcher.stats)
        stats["pass_requests"] = {str(k): v for k, v in sorted(stats["pass_requests"].items())}
        steps = stats["steps"]
        return {**stats, "sentences_per_step": stats["step_sentences"] / steps if steps else 0.0,
                "batching": "continuous" if self.batcher.continuous else "per pass",
                "lanes": self.batcher.lanes, "decode_tokens": self.batcher.decode_tokens,
                "max_wait_ms": self.batcher.max_wait * 1000, "waiting": self.batcher.waiting}

    def figure(self, name: str) -> bytes:
        """The PNG of a plots.py picture of this run (rendered once, then kept)."""
        with self._figures_lock:
            if name not in self._figures:
                d_model = self.info["model"]["d_model"]
                if name == "positional_encoding":
                    fig = plots.positional_encoding_figure(100, d_model)
                else:
                    fig = plots.schedule_figure(*self.schedule_drawn())
                buffer = io.BytesIO()
                fig.savefig(buffer, dpi=plots.DPI, format="png")
                self._figures[name] = buffer.getvalue()
            return self._figures[name]


    def schedule_drawn(self) -> tuple[Config, str]:
        """The run's config for its schedule picture, and the picture's label. A linear
        schedule whose time budget ended the run reached 0 at its last step: drawn so."""
        train, steps = self.config.train, self.info["training_steps"]
        if train.schedule == "linear" and train.max_minutes and steps and steps < train.max_steps:
            shortened = dataclasses.replace(train, max_steps=steps)
            return (dataclasses.replace(self.config, train=shortened),
                    f"this run: its {train.max_minutes:g} minutes ended at step {steps:,}")
        return self.config, "this run"


async def answer(future: Future, gone: Callable[[], Awaitable[Any]] | None = None) -> Any:
    """The result of a batcher's ``future``. ``gone``: a function whose awaitable completes
    when the client hangs up (``hung_up``); if it does first, the future is cancelled (a job
    still waiting is never decoded) and ClientGone raised (the caller tells the batcher:
    ``Batcher.forget``). One wait on the client, not a question every tenth of a second,
    so a request costs the server's CPU nothing while it waits (docs/serving.md#batching).
    Should that wait fail, the request is still answered, only no longer watched."""
    waiting = asyncio.wrap_future(future)
    if gone is None:
        return await waiting
    hang_up = asyncio.ensure_future(gone())
    hang_up.add_done_callback(lambda watch: _hung_up(watch, waiting))
    try:
        return await waiting
    except asyncio.CancelledError:
        if (not asyncio.current_task().cancelling() and hang_up.done()
                and not hang_up.cancelled() and hang_up.exception() is None):
            raise ClientGone from None  # the client went first: ``_hung_up`` cancelled it
        raise  # this request itself was cancelled (the server stopping)
    finally:
        hang_up.cancel()


def _hung_up(watch: asyncio.Future, waiting: asyncio.Future) -> None:
    """``answer``'s watch on the client has ended: a hang-up cancels the wait for the
    result (a callback, not ``asyncio.wait`` over both: a request's path is short). A
    watch that failed leaves the request answered, only no longer watched."""
    if watch.cancelled():
        return
    failed = watch.exception()  # read even when the answer came first: asyncio logs one never read
    if waiting.done():
        return
    if failed is None:
        waiting.cancel()
    else:
        log.warning("could not watch a request's client (%s): answering it unwatched", failed)


async def hung_up(receive: Callable[[], Awaitable[dict]]) -> None:
    """Returns when the client of a request whose body has been read hangs up: ASGI's
    ``receive`` then says "http.disconnect" (and until then waits)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _entry(translation) -> dict:
    """An n-best entry of serve's answer: ``Translation.as_dict`` with "text" for
    "translation", the name the answers have always used."""
    entry = translation.as_dict()
    return {"text": entry.pop("translation"), **entry}


def attention_json(att: SentenceAttention, decimals: int = 5) -> dict:
    """A SentenceAttention as JSON: ``maps[kind][layer][head][query][key]``, with the shape
    of each kind as (layers, heads, queries, keys)."""
    maps = {kind: np.stack(layers).astype(np.float64).round(decimals).tolist()
            for kind, layers in att.maps.items()}
    shapes = {kind: list(np.stack(layers).shape) for kind, layers in att.maps.items()}
    return {"source": att.source, "translation": att.translation,
            "src_tokens": att.src_tokens, "tgt_tokens": att.tgt_tokens,
            "maps": maps, "shapes": shapes,
            "axes": {"encoder": ["src_tokens", "src_tokens"],
                     "decoder_self": ["tgt_tokens", "tgt_tokens"],
                     "cross": ["tgt_tokens", "src_tokens"]}}


def run_steps(run_dir: str | Path) -> dict[int, Path]:
    """{step: weights file} of the run's saved steps that have a step (``step_weights``),
    in step order; empty for a run without step checkpoints."""
    try:
        return {step: path for step, path in step_weights(run_dir) if step is not None}
    except AiaynError:
        return {}


def serve_info(run_dir: str | Path, weights: str, config: Config, translator: Translator
               ) -> dict:
    """What GET /info reports: the served weights, sizes, vocabularies, and the run as
    `aiayn info` describes it (aiayn.inspect.info.run_info): the steps trained, the best dev
    score by the run's ``train.best_metric`` (what best.safetensors holds) and the last, and
    the target languages a request's "to" may name. With CTranslate2 the weights are the
    export's model.bin."""
    run = run_info(run_dir)
    served = (resolve_weights(run_dir, weights) if translator.engine.own_model
              else Path(run_dir) / "model.bin")
    return {
        "run_dir": str(run_dir),
        "weights": str(served),
        "engine": translator.engine.name,
        "device": str(translator.device),
        "model": asdict(config.model),
        "parameters": run["model"]["parameters"],
        "tokenizer": config.data.tokenizer,
        "joint_vocab": config.data.joint_vocab,
        "corpus": config.data.corpus,
        "decode": run["decode"],  # the search a request without beam/alpha gets
        "targets": translator.targets,  # what a request's "to" may name ([]: no "to")
        "training_steps": (run["training"] or {}).get("step"),
        "best": run["best"],
        "last_dev": run["last_dev"],
    }
