"""`aiayn serve RUN_DIR`: a translation API and a page to watch the model work.

One process loads the run's model once (``Translator.from_pretrained``) and serves:

    POST /translate   {"text": ["...", ...], "beam": 4, "alpha": 0.6, "nbest": 1,
                       "alignments": false}
                      -> translations in input order, the n-best lists with their scores,
                         the warnings `aiayn translate` would print (truncation), and the
                         beam and alpha used (without them in the request: the run's, its
                         config's decode section); with "alignments": true, each
                         translation's word alignment, [source word, target word] pairs
    POST /translate   ... "no_repeat_ngram": 3, "sample": {"temperature": 0.8, "top_k": 0,
                      "top_p": 0.9}, "seed": 1
                      -> with "sample", "nbest" random samples per sentence instead of the
                         search, and the seed they were drawn with ("sample" in the answer)
    POST /next        {"text": "...", "target": "...", "step": 2, "temperature": 0.8,
                       "top": 10}
                      -> the likeliest pieces a sample would draw as the target's piece
                         number "step" (after the pieces before it), with their
                         probabilities at that temperature (top_k, top_p too): the page's
                         temperature slider
    POST /attention   {"text": "...", "beam": 1, "alpha": 0.6, "step": null}
                      -> the translation, source and target tokens and every layer x head
                         map of encoder self-, decoder self- and cross-attention, as
                         `aiayn attention` computes them (rows = queries, columns = keys);
                         with a "step" (one of /info's "steps"), the maps of that step
                         checkpoint's weights over the same translation (the served
                         model's), to watch the attention learn to align
    GET  /health, /info (model sizes, vocabulary, training steps, the best and last dev
                      scores as `aiayn info` gives them)
    GET  /stats       what the batcher has decoded: requests, joins, sentences per step, waits
    GET  /            the page (static/index.html, app.js, style.css: no build step, no CDN)
    GET  /figures/positional_encoding.png, /figures/schedule.png   the plots.py pictures
    GET  /docs        the OpenAPI page (FastAPI's)

Rules a client can rely on:

- Batching is continuous (``Batcher``): a translate request joins the running search of
  its settings (beam, alpha) at its next step, within a token budget (--max-tokens; an idle
  server first waits --max-wait-ms for more), and is answered as soon as its last sentence
  is done; each answer is the one the request would get alone (``JoinableSearch``). With
  --engine ctranslate2 it is per pass. Attention capture (which sets flags on the model's
  attention modules) runs while no search steps on this process's model (on a CPU of two
  or more cores the searches run in lane processes, on copies of their own:
  ``aiayn.lanes``). A step's maps come from a model of its own (loaded when first asked
  for, the last few kept: ``CheckpointModels``): the served weights never change.
  /health and /info never wait for the model.
- Requests over the limits (``ServeLimits``: body bytes, sentences, characters) get 413
  with a message; malformed JSON or values out of range get 422; a problem with the input
  that the library finds (``AiaynError``) gets 422 with its one line; anything else a 500
  with one line and no traceback (the traceback goes to the server's log).
- Only the files of ``static/`` are served, by their names (no paths from the URL reach the
  file system).

FastAPI and uvicorn are the optional extra ``aiayn[serve]``; `aiayn serve` says so in one
line when they are missing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import itertools
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from aiayn import plots
from aiayn.config import Config, load_config
from aiayn.decode import Sampling, Search
from aiayn.errors import AiaynError
from aiayn.lanes import Adds, LaneLost, LaneProcess, LaneSearches, Round
from aiayn.rundir import resolve_weights, step_weights
from aiayn.runinfo import run_info
from aiayn.threads import default_streams
from aiayn.translator import (
    MAX_NO_REPEAT_NGRAM,
    MAX_TEMPERATURE,
    CheckpointModels,
    SentenceAttention,
    Sources,
    Translator,
    truncation_message,
)

STATIC_DIR = Path(__file__).parent / "static"
MAX_BEAM = 16  # a wider beam is refused (422): its cost grows with the beam
MAX_TOP = 50  # pieces POST /next returns at most
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".png": "image/png"}
MAX_WAIT_MS = 5.0  # the default wait for more requests: see Batcher
CACHED_STEPS = 3  # step checkpoints' models kept loaded for POST /attention's "step"
log = logging.getLogger("aiayn.serve")


# ---------------------------------------------------------------- limits and errors
@dataclass(frozen=True)
class ServeLimits:
    """What one request may ask for; more is refused with 413 (or 422 for search settings)."""

    max_body_bytes: int = 1_000_000
    max_sentences: int = 64  # sentences in one /translate request
    max_chars: int = 20_000  # characters in one request, all sentences together


class TooLarge(Exception):
    """A request over a ``ServeLimits`` limit: answered with 413 and this message."""


class ClientGone(Exception):
    """The client closed its connection before its answer was ready (answered 499, to no one)."""


def check_size(texts: list[str], limits: ServeLimits) -> None:
    """Refuse (``TooLarge``) more sentences or characters than the limits allow."""
    if len(texts) > limits.max_sentences:
        raise TooLarge(f"{len(texts)} sentences in one request; the limit is "
                       f"{limits.max_sentences}: send them in several requests")
    chars = sum(len(t) for t in texts)
    if chars > limits.max_chars:
        raise TooLarge(f"{chars} characters in one request; the limit is {limits.max_chars}")


# ---------------------------------------------------------------- request bodies
class SearchSettings(BaseModel):
    """Beam search settings, as `aiayn translate` takes them."""

    model_config = ConfigDict(extra="forbid")
    beam: int | None = Field(None, ge=1, le=MAX_BEAM,
                             description="beam size (1: greedy; default: the run's decode.beam)")
    alpha: float | None = Field(None, ge=0.0, le=10.0, description="length penalty (GNMT; "
                                "default: the run's decode.alpha)")


class SamplingSettings(BaseModel):
    """Random sampling, as `aiayn translate --sample` takes it (aiayn.decode.Sampling)."""

    model_config = ConfigDict(extra="forbid")
    temperature: float = Field(1.0, gt=0.0, le=MAX_TEMPERATURE,
                               description="the logits are divided by it (towards 0: greedy)")
    top_k: int = Field(0, ge=0, description="draw among the k likeliest pieces only (0: all)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="draw among the fewest likeliest "
                         "pieces whose probabilities sum to top_p (1: all)")

    def sampling(self, seed: int | None = None) -> Sampling:
        return Sampling(self.temperature, self.top_k, self.top_p, seed)


class TranslateRequest(SearchSettings):
    text: list[str] | str = Field(description="sentences (or one sentence) to translate")
    nbest: int = Field(1, ge=1, description="hypotheses per sentence, at most beam (with "
                       "sample: the samples per sentence)")
    no_repeat_ngram: int | None = Field(None, ge=0, le=MAX_NO_REPEAT_NGRAM,
                                        description="repetition guard: no translation holds "
                                        "an n-gram of pieces twice (0: off; default: the run's "
                                        "decode.no_repeat_ngram)")
    sample: SamplingSettings | None = Field(None, description="draw nbest random samples per "
                                            "sentence instead of searching (no beam then)")
    seed: int | None = Field(None, ge=0, lt=2 ** 63, description="with sample: the same seed, "
                             "sentence and settings draw the same samples (default: a random "
                             "one, given in the answer)")
    alignments: bool = Field(False, description="also the word alignment of each "
                             "translation: [source word, target word] pairs (whitespace-"
                             "separated words, from 0), as `aiayn translate --alignments`")


class NextPieceRequest(SamplingSettings):
    text: str = Field(description="one sentence")
    target: str | None = Field(None, description="its translation (default: the served "
                               "model's greedy translation)")
    step: int | None = Field(None, ge=0, description="the distribution of the target's piece "
                             "number step (from 0), given the pieces before it (default: the "
                             "piece after the whole target)")
    top: int = Field(10, ge=1, le=MAX_TOP, description="how many of the likeliest pieces")
    no_repeat_ngram: int | None = Field(None, ge=0, le=MAX_NO_REPEAT_NGRAM,
                                        description="the repetition guard's bans included")


class AttentionRequest(SearchSettings):
    text: str = Field(description="one sentence")
    beam: int = Field(1, ge=1, le=MAX_BEAM,
                      description="beam size (1, greedy, as `aiayn attention`)")
    step: int | None = Field(None, description="the maps of this step checkpoint (one of "
                             "/info's steps) over the served model's translation; default: "
                             "the served model's own")


# ---------------------------------------------------------------- the batcher
@dataclass(eq=False)
class Job:
    """One request waiting for the model: sentences to translate with a search (``key``:
    its settings), or a function that needs the model to itself (``alone``)."""

    key: Search | None
    sources: Sources | None = None
    nbest: int = 1
    alone: Callable[[], Any] | None = None
    arrived: float = field(default_factory=time.monotonic)
    future: Future = field(default_factory=Future)
    # Continuous batching: each sentence's hypotheses as it finishes, and how many are left.
    hyps: list = field(default_factory=list)
    left: int = 0
    started: float = 0.0
    lane: Any = None  # the _Lane decoding it

    @property
    def cost(self) -> int:
        """Source tokens x beam: what the job adds to the rows decoded together (as a
        decoding batch counts them)."""
        return self.sources.tokens * self.key.beam if self.sources is not None else 0


@dataclass
class BatchStats:
    """What the batcher has done since it started (GET /stats).

    A pass is, per pass, one decoding pass; with continuous batching, one run of a search
    from its first request until its last sentence leaves (requests that join it while it
    decodes count in it)."""

    passes: int = 0
    requests: int = 0
    sentences: int = 0
    wait_s: float = 0.0  # summed over requests: from arrival to the start of their decoding
    max_wait_s: float = 0.0
    decode_s: float = 0.0
    pass_requests: dict[int, int] = field(default_factory=dict)  # requests in a pass -> passes
    dropped: int = 0  # requests whose client hung up while they waited: never decoded
    abandoned: int = 0  # requests whose client hung up mid-search: taken out of it
    joins: int = 0  # requests that joined a search already decoding others
    steps: int = 0  # decoding steps (one token of every sentence of one search)
    step_sentences: int = 0  # sentences decoded, summed over the steps
    most_tokens: int = 0  # the most source tokens x beam decoded at once

    def started(self, jobs: list[Job], now: float) -> None:
        waits = [now - job.arrived for job in jobs]
        self.requests += len(jobs)
        self.sentences += sum(len(job.sources.ids) for job in jobs)
        self.wait_s += sum(waits)
        self.max_wait_s = max(self.max_wait_s, *waits)

    def ended(self, requests: int) -> None:
        self.passes += 1
        self.pass_requests[requests] = self.pass_requests.get(requests, 0) + 1

    def record(self, jobs: list[Job], started: float, seconds: float) -> None:
        self.started(jobs, started)
        self.ended(len(jobs))
        self.decode_s += seconds


@dataclass(eq=False)
class _Lane:
    """One stream of continuous batching: its searches (``aiayn.lanes``: here, or in a
    process of their own) and, here, whose their sentences are."""

    searches: LaneSearches | LaneProcess | None = None
    requests: dict[Search, int] = field(default_factory=dict)  # in each search's run
    owners: dict[int, tuple[Job, int]] = field(default_factory=dict)  # sentence -> job, index
    load: int = 0  # source tokens x beam of its sentences
    removes: list[int] = field(default_factory=list)  # sentences to take out (Batcher.forget)


class Batcher:
    """The threads that run the model, and the queue of requests waiting for them.

    With aiayn's own model, batching is continuous (per step). ``streams`` lanes
    (``Translator.streams``: one per core on a CPU, as `aiayn translate` decodes; one on a
    GPU) each hold one ``JoinableSearch`` per search settings (beam, alpha) that has
    sentences, stepped in turn on one intra-op thread (``aiayn.lanes``): in the lane's
    thread here (``lanes="threads"``), or in a process of the lane's own that steps on its
    own while its thread here sends it jobs and a receiver answers them (``"processes"``,
    the default on a CPU of two or more cores: threads would take turns on Python's lock).
    Before each round of steps (a process: whenever jobs wait) a lane takes the waiting
    jobs, oldest first, while they fit: every lane's sentences together stay within
    ``budget`` source tokens x beam (a job comes whole; the first when nothing decodes
    always goes, however large), and a lane takes a job only while no other lane holds
    fewer (so the cores share the work).
    A job's sentences join the lane's search of its settings at its next step (or start
    one), each sentence leaves it when it is done, and the job is answered when its last
    sentence is, with each sentence's lists (``Translator.finish`` cuts them to its
    n-best). Each answer equals the request decoded alone: a sentence's search does not
    depend on the others decoded beside it or on when it joined (``JoinableSearch``).
    Settings are never mixed in one search; a job whose settings have no search in the
    lane starts one there, decoded in turn with the others. When nothing decodes, the
    first job waits until it has waited ``max_wait`` seconds (or the budget is full):
    requests sent together (a page's burst, many clients at once) then start together.
    While something decodes, a new job joins at the next step. A job whose client has gone
    (``forget``) has its sentences taken out at the lane's next step.

    With ``--engine ctranslate2`` (``Translator.engine``) batching stays per pass, on one
    thread: CTranslate2's translate_batch decodes a batch to its end and cannot take
    sentences in mid-search; ``batching="pass"`` chooses it for aiayn's model too (more
    sentences per second under heavy load on a CPU, longer waits: docs/serving.md#batching).
    The oldest job takes every later one with the same settings
    while they fit ``budget`` and are decoded as one ``Translator.decode_ids`` pass after the
    same wait; jobs with other settings wait for a later pass.

    A function run ``alone`` (attention capture sets flags on the model's modules) waits its
    turn in the queue, then runs while no lane steps this process's model (lane processes
    have models of their own and go on).
    """

    def __init__(self, translator: Translator, max_wait_ms: float = MAX_WAIT_MS,
                 batching: str = "continuous", lanes: str | None = None):
        check_max_wait(max_wait_ms)
        check_batching(batching, "aiayn" if translator.engine is None else "ctranslate2")
        check_lanes(lanes, translator.device, batching)
        self.translator = translator
        self.budget = translator.max_tokens
        self.max_wait = max_wait_ms / 1000
        self.stats = BatchStats()
        self.continuous = translator.engine is None and batching == "continuous"
        self._queue: deque[Job] = deque()
        self._changed = threading.Condition()
        self._closed = False
        self._threads = torch.get_num_threads()  # restored whenever the model is idle
        self._load = 0  # source tokens x beam of the sentences in every lane
        self._stepping = 0  # lanes between taking jobs and the end of their steps
        self._exclusive = False  # a job runs alone: no lane steps
        self._ids = itertools.count()
        self._jobs: dict[Future, Job] = {}  # the jobs not answered yet, by their futures
        if self.continuous:
            streams = max(1, translator.streams or default_streams(translator.device))
            self.lane_kind = lanes or default_lanes(translator.device, streams)
            self._lanes = [_Lane() for _ in range(streams)]
            for lane in self._lanes:
                if self.lane_kind == "processes":
                    lane.searches = LaneProcess(
                        translator.model, translator.bf16,
                        on_result=lambda result, lane=lane: self._lane_result(lane, result),
                        on_lost=lambda exc, lane=lane: self._lane_lost(lane, exc))
                else:
                    lane.searches = LaneSearches(translator.model, translator.bf16)
            targets = [lambda lane=lane: self._run_lane(lane) for lane in self._lanes]
        else:
            self._lanes, targets, self.lane_kind = [], [self._run], None
        self._workers = [threading.Thread(target=target, name=f"aiayn-batcher-{i}", daemon=True)
                         for i, target in enumerate(targets)]
        for worker in self._workers:
            worker.start()

    @property
    def lanes(self) -> int:
        return len(self._lanes)

    def translate(self, sources: Sources, search: Search, nbest: int) -> Future:
        """A future of ``sources``' hypotheses (up to ``nbest`` or more per sentence) by the
        search ``search`` and the seconds from the start of their decoding to their answer."""
        return self._submit(Job(search, sources, nbest))

    def forget(self, future: Future) -> None:
        """The client of ``future``'s request has hung up: a request still waiting is never
        decoded (``dropped``); one being decoded by continuous batching has its sentences
        taken out of their searches at the next step (``abandoned``), so that it costs the
        others nothing more. Per pass, a pass that has started runs to its end."""
        job = self._jobs.get(future)
        if job is None or future.cancel():
            return
        with self._changed:
            lane = job.lane
            if lane is None or future.done():
                return
            sentences = [s for s, (owner, _) in lane.owners.items() if owner is job]
            freed = sum(len(job.sources.ids[lane.owners.pop(s)[1]]) * job.key.beam
                        for s in sentences)
            lane.load -= freed
            self._load -= freed
            lane.removes += sentences
            self.stats.abandoned += 1
            future.set_exception(ClientGone())
            self._changed.notify_all()

    def run_alone(self, fn: Callable[[], Any]) -> Future:
        """A future of ``fn()``, run on a model thread with no decoding beside it."""
        return self._submit(Job(None, alone=fn))

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def close(self) -> None:
        """Finish the jobs taken and waiting, refuse new ones, stop the threads."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        for worker in self._workers:
            worker.join()
        for lane in self._lanes:
            lane.searches.close()
        torch.set_num_threads(self._threads)

    def _submit(self, job: Job) -> Future:
        with self._changed:
            if self._closed:
                raise AiaynError("the server is shutting down")
            self._queue.append(job)
            self._jobs[job.future] = job
            job.future.add_done_callback(lambda future: self._jobs.pop(future, None))
            self._changed.notify_all()
        return job.future

    # ------------------------------------------------ continuous batching (aiayn's model)
    def _run_lane(self, lane: _Lane) -> None:
        """A lane's thread: take jobs and decode them here (a round of steps at a time),
        or send them to the lane's process (``aiayn.lanes``), until closed."""
        while True:
            with self._changed:
                taken = self._lane_next(lane)
                if taken is None:
                    return
                alone, jobs = taken
                adds = self._lane_adds(lane, jobs)
                removes, lane.removes = lane.removes, []
                self._stepping += 1
            try:
                if alone is not None:
                    _settle(alone.future, alone.alone)
                elif lane.searches.remote:
                    if adds or removes:
                        lane.searches.send(adds, removes)
                else:
                    self._lane_result(lane, lane.searches.round(adds, removes))
            finally:
                with self._changed:
                    self._stepping -= 1
                    self._exclusive = self._exclusive and alone is None
                    self._changed.notify_all()

    def _lane_next(self, lane: _Lane) -> tuple[Job | None, list[Job]] | None:
        """Under the lock: a job to run alone, or the jobs joining this lane before its next
        round of steps (maybe none); None once closed with nothing left."""
        while True:
            if self._exclusive:
                self._changed.wait()
                continue
            head = self._queue[0] if self._queue else None
            if head is not None and head.alone is not None:
                self._queue.popleft()
                if not head.future.set_running_or_notify_cancel():
                    self.stats.dropped += 1
                    continue
                self._exclusive = True
                while self._stepping:
                    self._changed.wait()
                return head, []
            if head is not None and self._load == 0 and not self._closed:
                left = head.arrived + self.max_wait - time.monotonic()
                if left > 0 and not self._queue_fills_budget():
                    self._changed.wait(left)  # woken early by each new job
                    continue
            jobs = self._admit(lane)
            # A lane's process steps on its own: its thread here only sends it work.
            if jobs or lane.removes or (lane.load and not lane.searches.remote):
                return None, jobs
            if self._closed and not self._queue and not lane.load:
                return None
            if not self._stepping:
                torch.set_num_threads(self._threads)  # idle: leave the process as it was
            self._changed.wait()

    def _queue_fills_budget(self) -> bool:
        tokens = 0
        for job in self._queue:
            if job.alone is not None:
                return True  # what comes before it is all that can start now
            tokens += job.cost
        return tokens >= self.budget

    def _admit(self, lane: _Lane) -> list[Job]:
        """Take the oldest jobs for this lane while they fit (see the class docstring)."""
        jobs = []
        while self._queue and self._queue[0].alone is None:
            job = self._queue[0]
            if any(other.load < lane.load for other in self._lanes):
                break  # a lane with less to do takes it
            if self._load and self._load + job.cost > self.budget:
                break
            self._queue.popleft()
            if not job.future.set_running_or_notify_cancel():  # its client has gone
                self.stats.dropped += 1
                continue
            jobs.append(job)
            lane.load += job.cost
            self._load += job.cost
        if jobs:
            self.stats.started(jobs, time.monotonic())
            self.stats.most_tokens = max(self.stats.most_tokens, self._load)
        return jobs

    def _lane_adds(self, lane: _Lane, jobs: list[Job]) -> Adds:
        """Under the lock: number the sentences of ``jobs`` (the lane's owners know whose
        each is) and group them by search settings, as ``LaneSearches.round`` takes them;
        jobs of empty lines only are answered at once."""
        started, adds = time.monotonic(), []
        for key, group in _by_key(jobs).items():
            self.stats.joins += len(group) if key in lane.requests else 0
            lane.requests[key] = lane.requests.get(key, 0) + len(group)
            sentences, sources = [], []
            for job in group:
                job.hyps, job.left, job.started = [None] * len(job.sources.ids), 0, started
                job.lane = lane
                for i, ids in enumerate(job.sources.ids):
                    sentences.append(next(self._ids))
                    lane.owners[sentences[-1]] = (job, i)
                    job.left += 1
                    sources.append(ids)
            adds.append((key, sentences, sources))
        for job in jobs:
            if job.left == 0:
                job.future.set_result(([], 0.0))
        return adds

    def _lane_result(self, lane: _Lane, result: Round) -> None:
        """What a round of the lane did: answer the jobs whose last sentence is done, fail
        those a failure touched, free their load."""
        with self._changed:
            freed = 0
            for sentences, exc in result.failed:
                freed += self._fail(lane, sentences, exc)
            for sentence, hyps in result.done:
                owner = lane.owners.pop(sentence, None)
                if owner is None:  # its request failed meanwhile (its lane's process ended)
                    continue
                job, i = owner
                job.hyps[i], job.left = hyps, job.left - 1
                freed += len(job.sources.ids[i]) * job.key.beam
                if job.left == 0:
                    job.future.set_result((job.hyps, time.monotonic() - job.started))
            lane.load -= freed
            self._load -= freed
            self.stats.steps += result.steps
            self.stats.step_sentences += result.step_sentences
            self.stats.decode_s += result.seconds
            for key in result.ended:
                if key in lane.requests:
                    self.stats.ended(lane.requests.pop(key))
            self._changed.notify_all()

    def _lane_lost(self, lane: _Lane, exc: LaneLost) -> None:
        """The lane's process ended: every sentence it held fails with ``exc``."""
        self._lane_result(lane, Round(failed=[(list(lane.owners), exc)],
                                      ended=list(lane.requests)))

    def _fail(self, lane: _Lane, sentences: list[int], exc: Exception) -> int:
        """Every job with a sentence among ``sentences`` gets ``exc``; those sentences are
        forgotten. Returns the load they freed."""
        freed = 0
        for sentence in sentences:
            owner = lane.owners.pop(sentence, None)
            if owner is None:
                continue
            job, i = owner
            freed += len(job.sources.ids[i]) * job.key.beam
            if not job.future.done():
                job.future.set_exception(exc)
        return freed

    # ------------------------------------------------ per pass (CTranslate2)
    def _run(self) -> None:
        while (jobs := self._next()) is not None:
            self._decode(jobs)

    def _next(self) -> list[Job] | None:
        """The jobs of the next pass, taken off the queue (None: closed)."""
        with self._changed:
            while not self._queue and not self._closed:
                self._changed.wait()
            if not self._queue:
                return None
            while True:
                jobs, full = self._gather()
                left = self._queue[0].arrived + self.max_wait - time.monotonic()
                if full or left <= 0 or self._closed:
                    break
                self._changed.wait(left)  # woken early by each new job
            for job in jobs:
                self._queue.remove(job)
            # A future cancelled while it waited (its client gone) is not decoded.
            taken = [job for job in jobs if job.future.set_running_or_notify_cancel()]
            self.stats.dropped += len(jobs) - len(taken)
            return taken

    def _gather(self) -> tuple[list[Job], bool]:
        """The oldest job and those that may share its pass; whether the pass is full."""
        head = self._queue[0]
        if head.alone is not None:
            return [head], True
        jobs, tokens = [], 0
        for job in self._queue:
            if job.key != head.key:
                continue
            if jobs and tokens + job.cost > self.budget:
                return jobs, True
            jobs.append(job)
            tokens += job.cost
        return jobs, False

    def _decode(self, jobs: list[Job]) -> None:
        if not jobs:
            return
        if jobs[0].alone is not None:
            _settle(jobs[0].future, jobs[0].alone)
            return
        search, nbest = jobs[0].key, max(job.nbest for job in jobs)
        started = time.monotonic()
        try:
            hyps = self.translator.decode_ids(
                [ids for job in jobs for ids in job.sources.ids],
                None if search.sampling else search.beam, search.alpha,
                search.beam if search.sampling else nbest, greedy_ok=False,
                no_repeat_ngram=search.no_repeat_ngram, sampling=search.sampling)
        except Exception as exc:  # every request of the pass gets the error
            for job in jobs:
                job.future.set_exception(exc)
            return
        seconds = time.monotonic() - started
        self.stats.record(jobs, started, seconds)
        at = 0
        for job in jobs:
            n = len(job.sources.ids)
            job.future.set_result((hyps[at:at + n], seconds))
            at += n


def _by_key(jobs: list[Job]) -> dict[Search, list[Job]]:
    groups: dict[Search, list[Job]] = {}
    for job in jobs:
        if job.sources.ids:
            groups.setdefault(job.key, []).append(job)
    return groups


BATCHINGS = ("continuous", "pass")


def check_batching(batching: str, engine: str) -> None:
    """--batching: continuous (aiayn's own model, engine "aiayn", only) or per pass."""
    if batching not in BATCHINGS:
        raise AiaynError(f"--batching must be one of {', '.join(BATCHINGS)}, got {batching!r}")
    if batching == "continuous" and engine != "aiayn":
        raise AiaynError(f"--batching continuous needs aiayn's own model: the {engine} engine "
                         "decodes a batch to its end (use --batching pass)")


LANES = ("processes", "threads")


def check_lanes(lanes: str | None, device: torch.device, batching: str) -> None:
    """--lanes: where the lanes of continuous batching decode (None: ``default_lanes``)."""
    if lanes is not None and lanes not in LANES:
        raise AiaynError(f"--lanes must be one of {', '.join(LANES)}, got {lanes!r}")
    if lanes is not None and batching != "continuous":
        raise AiaynError("--lanes is for continuous batching; per pass, one thread decodes")
    if lanes == "processes" and torch.device(device).type != "cpu":
        raise AiaynError(f"--lanes processes is for a CPU; on {torch.device(device).type} the "
                         "one lane is a thread (--lanes threads)")


def default_lanes(device: torch.device, streams: int) -> str:
    """Processes where two or more lanes share a CPU (they would take turns on Python's
    lock as threads: ``aiayn.lanes``); one lane, or a GPU's, is a thread."""
    return "processes" if torch.device(device).type == "cpu" and streams > 1 else "threads"


def check_max_wait(max_wait_ms: float) -> None:
    """--max-wait-ms: a short wait (a second at most: longer only delays every answer)."""
    if not 0 <= max_wait_ms <= 1000:
        raise AiaynError(f"--max-wait-ms must be between 0 and 1000, got {max_wait_ms:g}")


def _settle(future: Future, fn: Callable[[], Any]) -> None:
    try:
        future.set_result(fn())
    except Exception as exc:
        future.set_exception(exc)


def default_batching(translator: Translator) -> str:
    """Continuous for aiayn's own model, per pass for an engine that decodes whole batches."""
    return "continuous" if translator.engine is None else "pass"


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
        # The run's saved steps (none for a CTranslate2 export): models of their own, used
        # on the batcher's thread alone.
        self.steps = run_steps(info["run_dir"]) if translator.engine is None else {}
        self.checkpoints = (CheckpointModels(translator.model.cfg, CACHED_STEPS)
                            if self.steps else None)
        info["steps"] = list(self.steps)
        self._figures: dict[str, bytes] = {}
        self._figures_lock = threading.Lock()

    @classmethod
    def from_run(cls, run_dir: str | Path, weights: str = "best",
                 device: str | torch.device = "cpu", engine: str = "aiayn",
                 max_tokens: int | None = None, max_wait_ms: float = MAX_WAIT_MS,
                 batching: str | None = None, lanes: str | None = None) -> ModelService:
        """Load ``run_dir`` once (``Translator.from_pretrained``: a run directory, or with
        ``engine="ctranslate2"`` an `aiayn export --to ctranslate2` directory) and gather
        what /info reports. ``max_tokens``: the budget of a decoding batch and of a pass (None:
        the device's, ``aiayn.translator.default_max_tokens``). ``batching``: see ``Batcher``
        (None: continuous where the engine allows it); ``lanes``: where continuous
        batching decodes, "processes" or "threads" (None: ``default_lanes``)."""
        translator = Translator.from_pretrained(run_dir, weights, device=device, engine=engine,
                                                max_tokens=max_tokens)
        config = load_config(Path(run_dir) / "config.yaml")
        info = serve_info(run_dir, weights, config, translator)
        return cls(translator, config, info, max_wait_ms, batching, lanes)

    def close(self) -> None:
        self.batcher.close()

    async def translate(self, texts: list[str], beam: int | None, alpha: float | None,
                        nbest: int, gone: Callable[[], Awaitable[bool]] | None = None,
                        no_repeat_ngram: int | None = None, sampling: Sampling | None = None,
                        alignments: bool = False) -> dict:
        """`aiayn translate`'s answer for ``texts``: translations in input order, the n-best
        lists (an empty sentence gives "" and an empty list), the truncation warning of
        these sentences, the search run (None: the run's, ``Translator.settings``) and the
        seconds of the decoding pass that answered them. ``gone``: see ``answer``. With
        ``sampling``: ``nbest`` samples per sentence, and the seed they were drawn with.
        ``alignments``: also each translation's word alignment ("alignments", and
        "alignment" in each n-best entry), from a teacher-forced pass over the hypotheses
        run while no search steps on the model (the capture sets flags on it)."""
        if alignments:
            self.translator.check_alignments()
        if sampling is None:
            beam, alpha = self.translator.search(beam, alpha)
            if beam > MAX_BEAM:  # only the run's own can be: a request's is checked on arrival
                raise AiaynError(f"the run's decode.beam {beam} is over this server's limit "
                                 f"of {MAX_BEAM}; give \"beam\" in the request")
        elif nbest > MAX_BEAM:  # as a beam: the samples are the rows decoded per sentence
            raise AiaynError(f"nbest {nbest}: at most {MAX_BEAM} samples per sentence")
        self.translator.check_limits(beam, nbest, alpha, no_repeat_ngram, sampling)
        search = self.translator.settings(beam, alpha, no_repeat_ngram, sampling, nbest)
        sources = self.translator.prepare(texts)
        future = self.batcher.translate(sources, search, nbest)
        try:
            hyps, seconds = await answer(future, gone)
        except ClientGone:
            self.batcher.forget(future)
            raise
        links = None
        if alignments:
            ids = hyps
            links = await answer(self.batcher.run_alone(
                lambda: self.translator.hypothesis_alignments(sources, ids, nbest)), gone)
        hyps = self.translator.finish(sources, hyps, nbest)
        self.requests += 1
        warnings = ([truncation_message(sources.truncated, self.translator.max_len)]
                    if sources.truncated else [])
        answered = {
            "translations": [h[0][0] if h else "" for h in hyps],
            "nbest": [[{"text": text, "score": score} for text, score in h] for h in hyps],
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

    async def attention(self, text: str, beam: int, alpha: float | None,
                        gone: Callable[[], Awaitable[bool]] | None = None,
                        step: int | None = None) -> dict:
        """`aiayn attention`'s maps for one sentence, as nested lists (see ``attention_json``);
        with ``step``, those of that step checkpoint over the served model's translation."""
        if step is not None and step not in self.steps:
            have = (f"this run has {', '.join(map(str, self.steps))}" if self.steps
                    else "this run has no step checkpoints")
            raise AiaynError(f"no step checkpoint {step}; {have}")

        def work() -> SentenceAttention:
            if step is None:
                return self.translator.attention(text, beam=beam, alpha=alpha)
            target = self.translator.target_ids(text, beam=beam, alpha=alpha)
            return self.translator.attention_of(self.checkpoints.get(self.steps[step]), text,
                                                target)

        att = await answer(self.batcher.run_alone(work), gone)
        self.requests += 1
        return {**attention_json(att), "step": step}

    async def next_piece(self, text: str, target: str | None, step: int | None,
                         sampling: Sampling, top: int, no_repeat_ngram: int | None = None,
                         gone: Callable[[], Awaitable[bool]] | None = None) -> dict:
        """POST /next: the ``top`` likeliest pieces a sample would draw at ``step`` of the
        translation, with their probabilities (``Translator.next_piece``)."""
        if self.translator.model is None:
            raise AiaynError("the next piece's distribution needs aiayn's own model, not "
                             "--engine ctranslate2")
        guard = self.translator.settings(no_repeat_ngram=no_repeat_ngram).no_repeat_ngram
        result = await answer(self.batcher.run_alone(lambda: self.translator.next_piece(
            text, target, step, sampling, top, guard)), gone)
        self.requests += 1
        return {**asdict(result), "temperature": sampling.temperature,
                "top_k": sampling.top_k, "top_p": sampling.top_p, "no_repeat_ngram": guard}

    def stats(self) -> dict:
        """GET /stats: the batcher's counters (``BatchStats``), the mean sentences decoded
        in a step, its settings and how it batches."""
        stats = asdict(self.batcher.stats)
        stats["pass_requests"] = {str(k): v for k, v in sorted(stats["pass_requests"].items())}
        steps = stats["steps"]
        return {**stats, "sentences_per_step": stats["step_sentences"] / steps if steps else 0.0,
                "batching": "continuous" if self.batcher.continuous else "per pass",
                "lanes": self.batcher.lanes, "max_tokens": self.batcher.budget,
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


async def answer(future: Future, gone: Callable[[], Awaitable[bool]] | None = None,
                 every: float = 0.1) -> Any:
    """The result of a batcher's ``future``. ``gone()`` (the request's ``is_disconnected``)
    is asked every ``every`` seconds meanwhile: once the client has hung up, the future is
    cancelled (a job still waiting is never decoded) and ClientGone raised (the caller
    tells the batcher: ``Batcher.forget``)."""
    waiting = asyncio.wrap_future(future)
    while gone is not None:
        done, _ = await asyncio.wait({waiting}, timeout=every)
        if done:
            break
        if await gone():
            waiting.cancel()
            raise ClientGone
    return await waiting


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
    `aiayn info` describes it (aiayn.runinfo.run_info): the steps trained, the best dev
    score by the run's ``train.best_metric`` (what best.safetensors holds) and the last.
    With CTranslate2 the weights are the export's model.bin."""
    run = run_info(run_dir)
    served = (Path(run_dir) / "model.bin" if translator.engine is not None
              else resolve_weights(run_dir, weights))
    return {
        "run_dir": str(run_dir),
        "weights": str(served),
        "engine": "aiayn" if translator.engine is None else "ctranslate2",
        "device": str(translator.device),
        "model": asdict(config.model),
        "parameters": run["model"]["parameters"],
        "tokenizer": config.data.tokenizer,
        "joint_vocab": config.data.joint_vocab,
        "corpus": config.data.corpus,
        "decode": run["decode"],  # the search a request without beam/alpha gets
        "training_steps": (run["training"] or {}).get("step"),
        "best": run["best"],
        "last_dev": run["last_dev"],
    }


# ---------------------------------------------------------------- the app
def create_app(service: ModelService, limits: ServeLimits = ServeLimits()) -> FastAPI:
    """The FastAPI application around one loaded model."""
    app = FastAPI(title="aiayn", summary="Translate with an aiayn run and look at its attention",
                  version="0.1.0")
    static_files = {p.name: p for p in STATIC_DIR.iterdir() if p.suffix in CONTENT_TYPES}

    app.add_middleware(RefuseLargeBodies, max_bytes=limits.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        return _error(422, _validation_line(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):  # 404, 405, ...
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(TooLarge)
    async def too_large(request: Request, exc: TooLarge):
        return _error(413, str(exc))

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone):
        return _error(499, "the client closed the connection before the answer")

    @app.exception_handler(LaneLost)
    async def lane_lost(request: Request, exc: LaneLost):  # worth sending again
        log.error("%s", exc)
        return _error(503, str(exc))

    @app.exception_handler(AiaynError)
    async def bad_input(request: Request, exc: AiaynError):
        return _error(422, str(exc))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return _error(500, f"internal error ({type(exc).__name__}); see the server's log")

    # Async: a request waiting for the batcher holds no thread, and /health, /info and
    # /stats answer at once however long a pass runs.
    @app.post("/translate", summary="Translate sentences (beam search, n-best lists)")
    async def translate(body: TranslateRequest, request: Request) -> dict:
        texts = [body.text] if isinstance(body.text, str) else body.text
        check_size(texts, limits)
        if body.sample is None and body.seed is not None:
            raise AiaynError("seed goes with sample")
        sampling = None if body.sample is None else body.sample.sampling(body.seed)
        return await service.translate(texts, body.beam, body.alpha, body.nbest,
                                       request.is_disconnected, body.no_repeat_ngram, sampling,
                                       body.alignments)

    @app.post("/next", summary="The distribution of the next piece of a translation, at a "
              "temperature")
    async def next_piece(body: NextPieceRequest, request: Request) -> dict:
        check_size([body.text, body.target or ""], limits)
        return await service.next_piece(body.text, body.target, body.step,
                                        body.sampling(), body.top, body.no_repeat_ngram,
                                        request.is_disconnected)

    @app.post("/attention", summary="Translate one sentence and return every attention map")
    async def attention(body: AttentionRequest, request: Request) -> dict:
        check_size([body.text], limits)
        return await service.attention(body.text, body.beam, body.alpha,
                                       request.is_disconnected, body.step)

    @app.get("/health", summary="Is the model loaded?")
    async def health() -> dict:
        return {"status": "ok", "requests": service.requests}

    @app.get("/info", summary="The model, its vocabulary and its training so far")
    async def info() -> dict:
        return {**service.info, "limits": asdict(limits), "max_beam": MAX_BEAM,
                "batching": {"max_tokens": service.batcher.budget,
                             "max_wait_ms": service.batcher.max_wait * 1000}}

    @app.get("/stats", summary="The decoding passes so far: requests per pass, waits")
    async def stats() -> dict:
        return service.stats()

    @app.get("/figures/{name}.png", summary="positional_encoding or schedule, as PNG")
    def figure(name: str) -> Response:
        if name not in ("positional_encoding", "schedule"):
            return _error(404, f"no figure {name!r}; there are positional_encoding and schedule")
        return Response(service.figure(name), media_type="image/png")

    @app.get("/", include_in_schema=False)
    def page() -> Response:
        return _static(static_files, "index.html")

    @app.get("/static/{name}", include_in_schema=False)
    def static(name: str) -> Response:
        return _static(static_files, name)

    return app


class RefuseLargeBodies:
    """413 for a body whose Content-Length is over the limit, before it is read. Plain ASGI
    (not FastAPI's @app.middleware, which hides a client's hanging up from the endpoint)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            length = dict(scope["headers"]).get(b"content-length", b"").decode("latin-1")
            if length.isdigit() and int(length) > self.max_bytes:
                response = _error(413, f"request body of {length} bytes; the limit is "
                                       f"{self.max_bytes}")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _static(files: dict[str, Path], name: str) -> Response:
    """One of the page's own files, looked up by name (never a path from the URL)."""
    path = files.get(name)
    if path is None:
        return _error(404, f"no file {name!r}")
    return FileResponse(path, media_type=CONTENT_TYPES[path.suffix],
                        headers={"Cache-Control": "no-cache"})


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _validation_line(errors) -> str:
    """Pydantic's list of errors as one line: 'body.beam: Input should be ...; ...'."""
    parts = []
    for error in errors:
        where = ".".join(str(part) for part in error.get("loc", ()))
        parts.append(f"{where}: {error.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


# ---------------------------------------------------------------- the command
def serve(run_dir: str | Path, host: str = "127.0.0.1", port: int = 8000,
          weights: str = "best", device: str | torch.device = "cpu",
          limits: ServeLimits = ServeLimits(), engine: str = "aiayn",
          max_tokens: int | None = None, max_wait_ms: float = MAX_WAIT_MS,
          batching: str | None = None, lanes: str | None = None) -> None:
    """Load the run once and serve it until interrupted (`aiayn serve`; port 0: any free
    one). ``engine``, ``max_tokens``, ``max_wait_ms``, ``batching``, ``lanes``: see
    ``ModelService.from_run``."""
    check_max_wait(max_wait_ms)  # before loading, as the port below
    if batching is not None:
        check_batching(batching, engine)
    check_lanes(lanes, torch.device(device),
                batching or ("continuous" if engine == "aiayn" else "pass"))
    sock = listening_socket(host, port)  # before loading: a busy port is one line, at once
    service = ModelService.from_run(run_dir, weights, device, engine, max_tokens, max_wait_ms,
                                    batching, lanes)
    app = create_app(service, limits)
    info = service.info
    port = sock.getsockname()[1]
    batcher = service.batcher
    batching = (f"requests join the running search at its next step ({batcher.lanes} "
                f"lane{'s' * (batcher.lanes > 1)}, {batcher.lane_kind})"
                if batcher.continuous else "requests batched per pass")
    print(f"aiayn serve: {info['weights']} ({info['parameters']:,} parameters, "
          f"{info['engine']}) on {info['device']}; {batching}, up to {service.batcher.budget} "
          f"tokens x beam, an idle server waiting up to {max_wait_ms:g} ms; open "
          f"http://{_url_host(host)}:{port}/", flush=True)
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    finally:
        service.close()


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``, or an AiaynError that says why it cannot be."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise AiaynError(f"--host {host}: not an address of this machine ({exc})") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise AiaynError(f"--host {host} --port {port}: cannot listen there "
                         f"({exc.strerror or exc}); choose another --port") from None
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
