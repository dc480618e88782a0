"""Continuous batching for `aiayn serve`: requests join the running search of their settings.

A ``Job`` is one request's sentences and one ``Search`` value; the ``Batcher`` groups jobs by
search, starts a search when a budget of source tokens is full or the first job has waited
``max_wait_ms``, lets new jobs join a running search at its next step and answers each job
as soon as its last sentence is done (``BatchStats`` counts what happened). It needs no
HTTP library: the app and tests drive it through futures. On a CPU of two cores or more
the searches run in lane processes (``aiayn.serving.lanes``).

At about 630 lines this module is over the house's ~500: the batcher's thread, its lanes
and its statistics share one lock and one set of invariants, and read best together.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from aiayn.errors import AiaynError
from aiayn.inference.engine import Engine
from aiayn.inference.settings import Search
from aiayn.inference.translator import (
    Sources,
    Translator,
)
from aiayn.serving.lanes import Adds, LaneLost, LaneProcess, LaneSearches, Round
from aiayn.util.threads import default_streams


class ClientGone(Exception):
    """The client closed its connection before its answer was ready (answered 499, to no one)."""


MAX_WAIT_MS = 5.0  # the default wait for more requests: see Batcher


# ---------------------------------------------------------------- the batcher
@dataclass(eq=False)
class Job:
    """One request waiting for the model: sentences to translate with a search (``key``:
    the request's resolved ``Search``, its nbest included), or a function that needs the
    model to itself (``alone``)."""

    key: Search | None
    sources: Sources | None = None
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
    """One stream of continuous batching: its searches (``aiayn.serving.lanes``: here, or in a
    process of their own) and, here, whose their sentences are."""

    searches: LaneSearches | LaneProcess | None = None
    requests: dict[Search, int] = field(default_factory=dict)  # in each search's run
    owners: dict[int, tuple[Job, int]] = field(default_factory=dict)  # sentence -> job, index
    load: int = 0  # source tokens x beam of its sentences
    removes: list[int] = field(default_factory=list)  # sentences to take out (Batcher.forget)
    unsent: Adds = field(default_factory=list)  # handed over but not sent: its thread sends them
    wake: threading.Condition | None = None  # its thread waits on it, under the batcher's lock


class Batcher:
    """The threads that run the model, and the queue of requests waiting for them.

    With aiayn's own model, batching is continuous (per step). ``streams`` lanes
    (``Translator.streams``: one per core on a CPU, as `aiayn translate` decodes; one on a
    GPU) each hold one ``JoinableSearch`` per search settings (beam, alpha) that has
    sentences, stepped in turn on one intra-op thread (``aiayn.serving.lanes``): in the lane's
    thread here (``lanes="threads"``), or in a process of the lane's own that steps on its
    own while its thread here sends it jobs and its answers are read here, by the server's
    event loop once it runs (``read_on``), else by a thread (``"processes"``, the default
    on a CPU of two or more cores: threads would take turns on Python's lock).
    Before each round of steps (a process: whenever jobs wait; while something decodes, the
    thread that submits a job sends it to the process itself) a lane takes the waiting
    jobs, oldest first, while they fit: every lane's sentences together stay within
    ``decode_tokens`` source tokens x beam (a job comes whole; the first when nothing decodes
    always goes, however large), and a lane takes a job only while no other lane holds
    fewer (so the cores share the work).
    A job's sentences join the lane's search of its settings at its next step (or start
    one), each sentence leaves it when it is done, and the job is answered when its last
    sentence is, with each sentence's lists (cut to its request's n-best by the lane,
    else by ``Translator.finish``). Each answer equals the request decoded alone: a
    sentence's search does not depend on the others decoded beside it or on when it joined
    (``JoinableSearch``).
    Settings are never mixed in one search; a job whose settings have no search in the
    lane starts one there, decoded in turn with the others. When nothing decodes, the
    first job waits until it has waited ``max_wait`` seconds (or the budget is full):
    requests sent together (a page's burst, many clients at once) then start together.
    While something decodes, a new job joins at the next step. A job whose client has gone
    (``forget``) has its sentences taken out at the lane's next step.

    With an engine that cannot take sentences in mid-search (``Engine.continuous``, e.g.
    ``--engine ctranslate2``) batching stays per pass, on one
    thread: CTranslate2's translate_batch decodes a batch to its end and cannot take
    sentences in mid-search; ``batching="pass"`` chooses it for aiayn's model too (more
    sentences per second under heavy load on a CPU, longer waits: docs/serving.md#batching).
    The oldest job takes every later one with the same settings
    while they fit ``decode_tokens`` and are decoded as one ``Translator.decode_ids`` pass after the
    same wait; jobs with other settings wait for a later pass.

    A function run ``alone`` (attention capture sets flags on the model's modules) waits its
    turn in the queue, then runs while no lane steps this process's model (lane processes
    have models of their own and go on).
    """

    def __init__(self, translator: Translator, max_wait_ms: float = MAX_WAIT_MS,
                 batching: str = "continuous", lanes: str | None = None):
        check_max_wait(max_wait_ms)
        check_batching(batching, type(translator.engine))
        check_lanes(lanes, translator.device, batching)
        self.translator = translator
        self.decode_tokens = translator.decode_tokens  # the budget of a pass, or of a lane
        self.max_wait = max_wait_ms / 1000
        self.stats = BatchStats()
        self.continuous = translator.engine.continuous and batching == "continuous"
        self._queue: deque[Job] = deque()
        lock = threading.RLock()  # one lock; the per-pass thread and each lane wait on their own
        self._changed = threading.Condition(lock)
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
            # A new job wakes only the lane that may take it: each wake is a thread switch
            # in the server's process.
            self._lanes = [_Lane(wake=threading.Condition(lock)) for _ in range(streams)]
            for lane in self._lanes:
                if self.lane_kind == "processes":
                    lane.searches = LaneProcess(
                        translator.model, translator.bf16,
                        on_result=lambda result, lane=lane: self._lane_result(lane, result),
                        on_lost=lambda exc, lane=lane: self._lane_lost(lane, exc),
                        kernel=translator.kernel)
                else:
                    lane.searches = LaneSearches(translator.model, translator.bf16,
                                                 translator.kernel)
            try:  # started together, then each waited for
                for lane in self._lanes:
                    if lane.searches.remote:
                        lane.searches.wait_ready()
            except AiaynError:
                for lane in self._lanes:
                    lane.searches.close()
                raise
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

    def translate(self, sources: Sources, search: Search) -> Future:
        """A future of ``sources``' hypotheses (up to ``search.nbest`` or more per sentence)
        by the search ``search`` and the seconds from the start of their decoding to their
        answer."""
        return self._submit(Job(search, sources))

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
            lane.wake.notify()

    def read_on(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Called on ``loop``'s thread as it starts: that event loop reads what the lane
        processes answer (``LaneProcess.read_on``: one thread fewer woken an answer); None,
        as it stops: their threads read again."""
        for lane in self._lanes:
            if lane.searches.remote:
                lane.searches.read_on(loop)

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
            self._wake_all()
        for lane in self._lanes:  # the answers still to come are read, whoever stopped how
            if lane.searches.remote:
                lane.searches.take_back()
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
            if job.alone is not None or not self._lanes:
                self._wake_all()
                return job.future
            lane = self._lane_taking_now()
            if lane is None:
                self._wake_taker()
                return job.future
            jobs = self._admit(lane)
            if self._queue:  # what did not fit waits for a lane with room
                self._wake_taker(besides=lane)
            adds, removes = self._hand_over(lane, jobs)
        # Outside the lock, as a lane's thread sends; never waiting here (this is the
        # server's event loop): where the pipe is busy, the lane's thread sends them.
        if (adds or removes) and not lane.searches.send(adds, removes, wait=False):
            with self._changed:
                lane.unsent[:0], lane.removes[:0] = adds, removes
                lane.wake.notify()
        return job.future

    def _lane_taking_now(self) -> _Lane | None:
        """Under the lock: the lane process that a new job goes to at once from the caller's
        thread (the one holding the least), where its lane's thread would take it without
        waiting: nothing runs alone or waits to, and something is decoding or the waiting
        jobs fill the budget (an idle server's first job waits ``max_wait`` for others on
        that thread). None otherwise. Each request then wakes one thread fewer in the
        server's process: a wakeup that waits for a core the lanes hold
        (docs/serving.md#lanes). Two threads may send to one lane: a job's removal can
        reach the lane before its sentences, which are then decoded for nothing (their
        answers are dropped, as for any job forgotten)."""
        lane = min(self._lanes, key=lambda lane: lane.load)
        if (not lane.searches.remote or self._exclusive or self._queue[0].alone is not None
                or (self._load == 0 and not self._queue_fills_budget())):
            return None
        return lane

    def _wake_all(self) -> None:
        """Under the lock: every thread that waits for a change."""
        self._changed.notify_all()
        for lane in self._lanes:
            lane.wake.notify_all()

    def _wake_taker(self, besides: _Lane | None = None) -> None:
        """Under the lock: the lane that may take the oldest waiting job (one that holds no
        more than any other: ``_admit``), unless that is ``besides``."""
        taker = min(self._lanes, key=lambda lane: lane.load)
        if taker is not besides:
            taker.wake.notify()

    # ------------------------------------------------ continuous batching (aiayn's model)
    def _run_lane(self, lane: _Lane) -> None:
        """A lane's thread: take jobs and decode them here (a round of steps at a time),
        or send them to the lane's process (``aiayn.serving.lanes``), until closed."""
        while True:
            with self._changed:
                taken = self._lane_next(lane)
                if taken is None:
                    return
                alone, jobs = taken
                adds, removes = self._hand_over(lane, jobs)
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
                    # Only a job run alone waits for the lanes' rounds, and lanes for its end.
                    if self._exclusive or alone is not None:
                        self._exclusive = self._exclusive and alone is None
                        self._wake_all()

    def _lane_next(self, lane: _Lane) -> tuple[Job | None, list[Job]] | None:
        """Under the lock: a job to run alone, or the jobs joining this lane before its next
        round of steps (maybe none); None once closed with nothing left."""
        while True:
            if self._exclusive:
                lane.wake.wait()
                continue
            head = self._queue[0] if self._queue else None
            if head is not None and head.alone is not None:
                self._queue.popleft()
                if not head.future.set_running_or_notify_cancel():
                    self.stats.dropped += 1
                    continue
                self._exclusive = True
                while self._stepping:
                    lane.wake.wait()
                return head, []
            if head is not None and self._load == 0 and not self._closed:
                left = head.arrived + self.max_wait - time.monotonic()
                if left > 0 and not self._queue_fills_budget():
                    lane.wake.wait(left)  # woken early by a new job it may take
                    continue
            jobs = self._admit(lane)
            if self._queue:  # what it left waits for a lane that holds less (or for room)
                self._wake_taker(besides=lane)
            # A lane's process steps on its own: its thread here only sends it work.
            if jobs or lane.removes or lane.unsent or (lane.load and not lane.searches.remote):
                return None, jobs
            if self._closed and not self._queue and not lane.load:
                return None
            if not self._stepping:
                torch.set_num_threads(self._threads)  # idle: leave the process as it was
            lane.wake.wait()

    def _queue_fills_budget(self) -> bool:
        tokens = 0
        for job in self._queue:
            if job.alone is not None:
                return True  # what comes before it is all that can start now
            tokens += job.cost
        return tokens >= self.decode_tokens

    def _admit(self, lane: _Lane) -> list[Job]:
        """Take the oldest jobs for this lane while they fit (see the class docstring)."""
        jobs = []
        while self._queue and self._queue[0].alone is None:
            job = self._queue[0]
            if any(other.load < lane.load for other in self._lanes):
                break  # a lane with less to do takes it
            if self._load and self._load + job.cost > self.decode_tokens:
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

    def _hand_over(self, lane: _Lane, jobs: list[Job]) -> tuple[Adds, list[int]]:
        """Under the lock: what ``lane`` gets next, the sentences handed over before but not
        sent, ``jobs``' (``_lane_adds``), and those it is to take out (``forget``)."""
        removes, lane.removes = lane.removes, []
        unsent, lane.unsent = lane.unsent, []
        return unsent + self._lane_adds(lane, jobs), removes

    def _lane_adds(self, lane: _Lane, jobs: list[Job]) -> Adds:
        """Under the lock: number the sentences of ``jobs`` (the lane's owners know whose
        each is) and group them by search settings, as ``LaneSearches.round`` takes them;
        jobs of empty lines only are answered at once."""
        started, adds = time.monotonic(), []
        for key, group in _by_key(jobs).items():
            self.stats.joins += len(group) if key in lane.requests else 0
            lane.requests[key] = lane.requests.get(key, 0) + len(group)
            sentences, sources, prefixes, kept = [], [], [], []
            for job in group:
                job.hyps, job.left, job.started = [None] * len(job.sources.ids), 0, started
                job.lane = lane
                for i, ids in enumerate(job.sources.ids):
                    sentences.append(next(self._ids))
                    lane.owners[sentences[-1]] = (job, i)
                    job.left += 1
                    sources.append(ids)
                    prefixes.append(job.sources.prefixes[i] if job.sources.prefixes else [])
                    kept.append(job.key.nbest)
            adds.append((key, sentences, sources, prefixes, kept))
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
            # The freed load matters only to jobs waiting or to a close: waking the lane
            # threads for nothing costs the server a thread switch per answer.
            if self._closed:
                self._wake_all()
            elif self._queue:
                self._wake_taker()

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
            if jobs and tokens + job.cost > self.decode_tokens:
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
        # Equal searches but for nbest (left out of equality): one pass keeping the most.
        search = replace(jobs[0].key, nbest=max(job.key.nbest for job in jobs))
        started = time.monotonic()
        try:
            hyps = self.translator.decode_ids(
                [ids for job in jobs for ids in job.sources.ids], greedy_ok=False,
                search=search, prefixes=[prefix for job in jobs for prefix in
                                         (job.sources.prefixes or [[]] * len(job.sources.ids))])
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


def check_batching(batching: str, engine: type[Engine]) -> None:
    """--batching: continuous (an engine that takes sentences in mid-search:
    ``Engine.continuous``) or per pass."""
    if batching not in BATCHINGS:
        raise AiaynError(f"--batching must be one of {', '.join(BATCHINGS)}, got {batching!r}")
    if batching == "continuous" and not engine.continuous:
        raise AiaynError(f"--batching continuous needs aiayn's own model: the {engine.name} engine "
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
    lock as threads: ``aiayn.serving.lanes``); one lane, or a GPU's, is a thread."""
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
    """Continuous where the engine can (``Engine.continuous``), else per pass."""
    return "continuous" if translator.engine.continuous else "pass"
