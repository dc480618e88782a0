"""The lanes of `aiayn serve`'s continuous batching: the searches of one stream, run in the
server's process or in a process of their own.

A lane's work in a round is search alone: the sentences that arrived join the
``JoinableSearch`` of their settings (a ``Search``: beam, alpha, guard, sampling), then
every search decodes one token.
``LaneSearches`` does that wherever it is called; ``LaneProcess`` does it in a child process
(its own copy of the model, one intra-op thread), so that two lanes do not take turns on
Python's global interpreter lock. Every torch call of a decoding step gives up the lock
and takes it back, and a small model's step is a few hundred such calls, so lanes that
are threads of one process wait for each other (figures: docs/serving.md#lanes). The
server keeps the requests, the queue and the answers (``serve.Batcher``); only sentence
ids, token ids and hypotheses cross to a lane's process.

A model of several target languages needs nothing here: a sentence's direction is its
first source id (its tag, put there where the service tokenizes the request), so
sentences of every direction share a search.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from aiayn.data.batching import pad
from aiayn.errors import AiaynError
from aiayn.inference.int8 import Int8Output, int8_decoding
from aiayn.inference.joinable import JoinableSearch
from aiayn.inference.search import Hypothesis
from aiayn.inference.settings import Search
from aiayn.model import OutputKernel, Transformer

Key = Search  # a request's resolved search: only equal ones (nbest aside) share a search
# (settings, sentence ids, source ids, target prefixes: [] where none)
Adds = list[tuple[Key, list[int], list[list[int]], list[list[int]]]]


@dataclass
class Round:
    """What one round of a lane did."""

    done: list[tuple[int, list[Hypothesis]]] = field(default_factory=list)  # (sentence, best first)
    failed: list[tuple[list[int], Exception]] = field(default_factory=list)  # (sentences, why)
    ended: list[Key] = field(default_factory=list)  # searches that have no sentence left
    steps: int = 0  # searches stepped
    step_sentences: int = 0  # sentences decoded in those steps
    seconds: float = 0.0  # spent in the round (or since the last report)


class LaneSearches:
    """One lane's searches, one per search settings, stepped in turn (see the module
    docstring); ``bf16``: decode under bfloat16 autocast (``Translator.bf16``); ``kernel``:
    the output layer's product (``Translator.kernel``)."""

    remote = False

    def __init__(self, model: Transformer, bf16: bool = False,
                 kernel: OutputKernel | None = None):
        self.model, self.bf16, self.kernel = model, bf16, kernel
        self.searches: dict[Key, JoinableSearch] = {}
        self.members: dict[Key, set[int]] = {}  # the sentences in each search

    def round(self, adds: Adds, removes: Sequence[int] = ()) -> Round:
        """Add the sentences of ``adds`` to their searches, take the sentences ``removes``
        out (their requests are gone), then step every search once. A failure fails only the
        sentences it touched: those added, or, in a step, every sentence of that search
        (which then starts empty)."""
        if torch.get_num_threads() != 1:
            torch.set_num_threads(1)
        started = time.monotonic()
        result = Round()
        for key, sentences, sources, prefixes in adds:
            search = self.searches.get(key)
            if search is None:
                search = self.searches[key] = JoinableSearch(self.model, key, self.kernel)
                self.members[key] = set()
            try:
                with self._autocast():
                    search.add(sentences, pad(sources), prefixes)
                self.members[key].update(sentences)
            except Exception as exc:
                result.failed.append((sentences, exc))
        for key, search in self.searches.items():  # after the adds: those sent before
            if gone := self.members[key].intersection(removes):
                search.remove(gone)
                self.members[key] -= gone
        for key, search in list(self.searches.items()):
            if len(search):
                result.steps += 1
                result.step_sentences += len(search)
                try:
                    with self._autocast():
                        done = search.step()
                except Exception as exc:
                    result.failed.append((sorted(self.members[key]), exc))
                    search, done = JoinableSearch(self.model, key, self.kernel), []
                    self.searches[key], self.members[key] = search, set()
                for sentence, hyps in done:
                    self.members[key].discard(sentence)
                    result.done.append((sentence, hyps))
            if not len(search):
                result.ended.append(key)
                del self.searches[key], self.members[key]
        result.seconds = time.monotonic() - started
        return result

    def close(self) -> None:
        self.searches.clear()

    def _autocast(self):
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(next(self.model.parameters()).device.type, dtype=torch.bfloat16)


READY = "ready"  # what a lane's process sends once, when it can decode
CANNOT_START = "cannot start"  # or, with why, when it cannot build its model


class LaneLost(RuntimeError):
    """A lane's process ended: the sentences it held are gone."""


class LaneProcess:
    """``LaneSearches`` in a child process that decodes on its own: ``send`` gives it
    sentences, and it steps its searches while it has any, taking what is sent between
    steps; a thread here receives what it finishes and calls ``on_result(Round)``. So the
    server never waits on the child at a step (a round trip per step cost more than it
    saved: a process woken ~40 times per sentence). The child gets the model's config and
    weights once, at its start, and says when it can decode (``wait_ready``: a server that
    answered before its lanes had built their models kept its first requests waiting ~2 s).
    If it ends (killed, out of memory), ``on_lost(LaneLost)`` is called and a new child
    starts."""

    remote = True

    def __init__(self, model: Transformer, bf16: bool, on_result: Callable[[Round], None],
                 on_lost: Callable[[LaneLost], None], kernel: OutputKernel | None = None):
        int8 = isinstance(kernel, Int8Output)  # packed again in the child, from the weights
        self._start_args = (model.cfg, {k: v.detach().clone() for k, v in
                                        model.state_dict().items()},
                            None if int8 else kernel, bf16, int8)
        self.on_result, self.on_lost = on_result, on_lost
        self._lock = threading.Lock()  # a send, or the swap to a new child
        self._closing = False
        self._ready = threading.Event()  # the child has built its model (READY), or failed to
        self._start_failed: str | None = None  # why the first child ended before it was ready
        self._start()
        self._receiver = threading.Thread(target=self._receive, name="aiayn-lane-results",
                                          daemon=True)
        self._receiver.start()

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a process with threads
        self._conn, child = context.Pipe()
        self.process = context.Process(target=_lane_main, args=(child, *self._start_args),
                                       name="aiayn-lane", daemon=True)
        self.process.start()
        child.close()

    def send(self, adds: Adds, removes: Sequence[int] = (), wait: bool = True) -> bool:
        """What ``LaneSearches.round`` takes, for the child's next step. ``wait=False``:
        only if no other send, and no start of a new child, holds the pipe now (the server's
        event loop must not wait seconds for a child to start); returns whether it was sent."""
        if not self._lock.acquire(blocking=wait):
            return False
        try:
            # A child that has ended is the receiver's to report (its end closes the pipe).
            with contextlib.suppress(OSError):
                self._conn.send((adds, list(removes)))
        finally:
            self._lock.release()
        return True

    @property
    def ready(self) -> bool:
        """Whether the child has said it can decode."""
        return self._ready.is_set() and self._start_failed is None

    def wait_ready(self, timeout: float = 600) -> None:
        """Return once the child can decode (its model built); an AiaynError if it has not
        within ``timeout`` seconds."""
        if not self._ready.wait(timeout):
            raise AiaynError(f"a decoding process of the server did not start within {timeout:g} s")
        if self._start_failed is not None:
            raise AiaynError(self._start_failed)

    def _receive(self) -> None:
        while True:
            try:
                result = self._conn.recv()
            except (EOFError, OSError):
                with self._lock:
                    if self._closing:
                        return
                    self.process.join(timeout=5)
                    if not self._ready.is_set():  # it never could decode: a new one would not
                        self._start_failed = (f"a decoding process of the server ended before it "
                                              f"could decode (exit code {self.process.exitcode})")
                        self._ready.set()
                        return
                    lost = LaneLost(f"a decoding process of the server ended (exit code "
                                    f"{self.process.exitcode}) with this request's sentences; "
                                    "a new one has started: send it again")
                    self.on_lost(lost)  # before the new child: what it gets is not lost
                    self._conn.close()
                    self._start()
                continue
            if result == READY:
                self._ready.set()
                continue
            if isinstance(result, tuple) and result[0] == CANNOT_START:
                self._start_failed = f"a decoding process of the server could not start: {result[1]}"
                self.process.join(timeout=10)  # it ends on its own
                self._ready.set()
                return
            self.on_result(result)

    def close(self) -> None:
        with self._lock:
            self._closing = True
            with contextlib.suppress(OSError):
                self._conn.send(None)
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()
        self._receiver.join(timeout=10)
        self._conn.close()


def _lane_main(conn, cfg, state: dict, kernel, bf16: bool, int8: bool) -> None:
    """A lane's child process: build the model, then decode what is sent until told to
    stop (None) or the server is gone. Between steps it takes every message waiting; it
    reports after a step that finished or failed a sentence, with the steps counted since."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the server, which stops us
    torch.set_num_threads(1)
    try:
        model = Transformer(cfg)
        model.load_state_dict(state)
        model.eval()
        del state
        if int8:  # the server decodes in int8 (aiayn.inference.int8)
            model, kernel = int8_decoding(model)
        lane = LaneSearches(model, bf16, kernel)
    except Exception as exc:  # the server says why in one line, not this process's traceback
        with contextlib.suppress(OSError):
            conn.send((CANNOT_START, " ".join(f"{type(exc).__name__}: {exc}".split())))
        return
    try:
        conn.send(READY)
    except OSError:
        return
    with torch.inference_mode():  # for its life: a search's step need not enter it each time
        _lane_loop(conn, lane)


def _lane_loop(conn, lane: LaneSearches) -> None:
    """``_lane_main``'s decoding, until told to stop or the server is gone."""
    steps, sentences, seconds = 0, 0, 0.0
    while True:
        adds: Adds = []
        removes: list[int] = []
        try:
            while not adds and not lane.searches or conn.poll():  # wait only when idle
                message = conn.recv()
                if message is None:
                    return
                adds.extend(message[0])
                removes.extend(message[1])
        except (EOFError, OSError):
            return
        result = lane.round(adds, removes)
        steps, sentences = steps + result.steps, sentences + result.step_sentences
        seconds += result.seconds
        if result.done or result.failed or result.ended:
            result.steps, result.step_sentences, result.seconds = steps, sentences, seconds
            steps, sentences, seconds = 0, 0, 0.0
            result.failed = [(ids, _picklable(exc)) for ids, exc in result.failed]
            conn.send(result)


def _picklable(exc: Exception) -> Exception:
    """``exc`` itself if it can travel to the server, else a RuntimeError with its line."""
    try:
        pickle.dumps(exc)
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
