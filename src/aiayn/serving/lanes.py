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
ids, token ids and the hypotheses each sentence's request keeps (its nbest) cross between
the server's process and a lane's.

A model of several target languages needs nothing here: a sentence's direction is its
first source id (its tag, put there where the service tokenizes the request), so
sentences of every direction share a search.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler

import torch

from aiayn.data.batching import pad
from aiayn.errors import AiaynError
from aiayn.inference.int8 import Int8Output, int8_decoding
from aiayn.inference.joinable import JoinableSearch
from aiayn.inference.search import Hypothesis
from aiayn.inference.settings import Search
from aiayn.inference.steps import Outputs
from aiayn.model import OutputKernel, Transformer
from aiayn.serving.pipes import CAN_COUNT_UNREAD, Frames, arrival_check, unread_bytes

log = logging.getLogger(__name__)
Key = Search  # a request's resolved search: only equal ones (nbest aside) share a search
QUIET_STEPS = 32  # a lane process's steps in one call while no sentence is done and nothing arrives
# (settings, sentence ids, source ids, target prefixes: [] where none, hypotheses each
# sentence's request keeps: its nbest, which searches of equal settings need not share)
Adds = list[tuple[Key, list[int], list[list[int]], list[list[int]], list[int]]]


@dataclass
class Round:
    """What one round of a lane did."""

    # (sentence, its request's nbest hypotheses, best first: what crosses back to the server)
    done: list[tuple[int, list[Hypothesis]]] = field(default_factory=list)
    failed: list[tuple[list[int], Exception]] = field(default_factory=list)  # (sentences, why)
    ended: list[Key] = field(default_factory=list)  # searches that have no sentence left
    steps: int = 0  # steps its searches took (one that failed: none)
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
        # The sentences in each search, each with the hypotheses its request keeps (nbest):
        # the others never cross to the server (at beam 4, nbest 1: two thirds of the bytes).
        self.members: dict[Key, dict[int, int]] = {}
        self.outputs: Outputs | None = None  # what every search reads of the output layer

    def round(self, adds: Adds, removes: Sequence[int] = (), wake: int | None = None) -> Round:
        """Add the sentences of ``adds`` to their searches (a search's jobs in one add: one
        encoding, one join of its cache), take the sentences ``removes`` out (their requests
        are gone), then step every search once; with ``wake`` (the lane's pipe), up to
        ``QUIET_STEPS`` steps while no sentence is done, nothing arrives there and no earlier
        search of the round has finished a sentence. A failure fails only the sentences it
        touched: those of a job refused (a ValueError, which leaves the search as it was),
        every job of its add where it failed otherwise, or, in a step, every sentence of
        that search (which then starts empty)."""
        if torch.get_num_threads() != 1:
            torch.set_num_threads(1)
        started = time.monotonic()
        result, by_search = Round(), {}
        for key, *job in adds:  # each search's jobs, in the order they came
            by_search.setdefault(key, []).append(job)
        for key, jobs in by_search.items():
            search = self.searches.get(key)
            if search is None:
                search = self.searches[key] = JoinableSearch(self.model, key, self.kernel, self.outputs)
                self.outputs, self.members[key] = search.outputs, {}
            live = len(search)
            try:
                self._add(key, jobs)
            except Exception as exc:
                if len(jobs) == 1 or not isinstance(exc, ValueError) or len(search) != live:
                    result.failed.append(([s for job in jobs for s in job[0]], exc))
                    continue
                for job in jobs:  # each on its own: only one that cannot join fails
                    try:
                        self._add(key, [job])
                    except Exception as exc:
                        result.failed.append((job[0], exc))
        for key, search in self.searches.items():  # after the adds: those sent before
            if gone := self.members[key].keys() & set(removes):
                search.remove(gone)
                self.members[key] = {s: n for s, n in self.members[key].items() if s not in gone}
        for key, search in list(self.searches.items()):
            if len(search):
                live = len(search)
                try:
                    with self._autocast():
                        singly = wake is None or result.done or result.failed  # answers wait
                        done = search.step() if singly else search.step(QUIET_STEPS, wake)
                    result.steps += search.taken
                    result.step_sentences += live * search.taken
                except Exception as exc:
                    result.failed.append((sorted(self.members[key]), exc))
                    search, done = JoinableSearch(self.model, key, self.kernel, self.outputs), []
                    self.searches[key], self.members[key] = search, {}
                for sentence, hyps in done:
                    # (None: a sentence whose add failed midway, answered to no one)
                    result.done.append((sentence, hyps[:self.members[key].pop(sentence, None)]))
            if not len(search):
                result.ended.append(key)
                del self.searches[key], self.members[key]
        result.seconds = time.monotonic() - started
        return result

    def _add(self, key: Key, jobs: list[tuple]) -> None:
        """The sentences of ``jobs`` (``Adds``' tuples less the key) join ``key``'s search."""
        sentences = [s for job in jobs for s in job[0]]
        with self._autocast():
            self.searches[key].add(sentences, pad([s for job in jobs for s in job[1]]),
                                   [p for job in jobs for p in job[2]])
        self.members[key].update(zip(sentences, (n for job in jobs for n in job[3]), strict=True))

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
    steps; what it finishes is read here and given to ``on_result(Round)``. So the server
    never waits on the child at a step (a round trip per step cost more than it saved: a
    process woken ~40 times per sentence). The child gets the model's config and weights
    once, at its start, and says when it can decode (``wait_ready``: a server that answered
    before its lanes had built their models kept its first requests waiting ~2 s). If it
    ends (killed, out of memory), ``on_lost(LaneLost)`` is called and a new child starts.

    What the child sends is read by a thread here, or, once the server's event loop has
    asked (``read_on``), by that loop itself: an answer then wakes one thread of the server
    instead of two, each wakeup a wait for a core the lanes hold (docs/serving.md#lanes).
    The thread reads again whenever the loop cannot: before it asks, after it lets go, and
    while a child that ended is replaced (a start takes seconds the loop must not wait)."""

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
        # Who reads the child's pipe: the thread, or the loop. Under _reader_lock: the loop
        # that asked (None: the thread reads), and whether the thread has handed over to it
        # (a call on the loop pending) or the loop reads.
        self._reader_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handing_over = self._loop_reads = False
        self._decoding = False  # the current child has said READY (the loop reads only then)
        # Wakes the thread to look at _loop again (where a loop may read: Linux).
        self._wake_r, self._wake_w = os.pipe() if CAN_COUNT_UNREAD else (None, None)
        self._start()
        self._start_receiver()

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a process with threads
        self._conn, child = context.Pipe()
        self._capacity = 0  # of the socket to the child, where ``unread_bytes`` can count
        self._frames: Frames | None = None  # where the loop may read (Linux): what came so far
        if CAN_COUNT_UNREAD:
            self._frames = Frames(self._conn.fileno())
            self._capacity = self._frames.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        self.process = context.Process(target=_lane_main, args=(child, *self._start_args),
                                       name="aiayn-lane", daemon=True)
        self.process.start()
        child.close()

    def send(self, adds: Adds, removes: Sequence[int] = (), wait: bool = True) -> bool:
        """What ``LaneSearches.round`` takes, for the child's next step. ``wait=False`` (the
        server's event loop, which must never wait here where it may be what reads the
        child's answers): only if no other send, and no start of a new child, holds the pipe
        now and, on Linux, the pipe has room for the whole message; returns whether it was
        sent."""
        if not self._lock.acquire(blocking=wait):
            return False
        try:
            message = ForkingPickler.dumps((adds, list(removes)))
            if not wait and not self._room_for(len(message)):
                return False  # the lane's thread sends it
            # A child that has ended is the reader's to report (its end closes the pipe).
            with contextlib.suppress(OSError):
                self._send(message)
        finally:
            self._lock.release()
        return True

    def _send(self, message: bytes) -> None:
        """One pickled message to the child, whole: where the loop may read, through
        ``Frames`` (the socket may be non-blocking: uvloop's poll makes it so); elsewhere
        through the Connection."""
        if self._frames is not None:
            self._frames.send(message)
        else:
            self._conn.send_bytes(message)

    def _room_for(self, size: int) -> bool:
        """Whether ``size`` more bytes fit in the pipe to the child now, so that sending them
        does not wait (with a margin for the kernel's accounting of what it holds). Where the
        platform cannot say, the loop never reads (``read_on``), so a wait is no deadlock."""
        try:
            unread = unread_bytes(self._conn)
        except OSError:
            return False
        return unread is None or unread + 2 * size + 4096 <= self._capacity

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

    def read_on(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Called on ``loop``'s own thread: let that event loop read what the child sends,
        from the thread's next look on (at once where it waits); the first loop to ask
        keeps it. None, on the reading loop's thread: it lets go (it is stopping) and a
        thread reads again. A platform that cannot say how much of a pipe is unread
        (``unread_bytes``: Linux can) keeps the thread: the loop must never wait on a send
        while it alone reads."""
        if loop is None:
            if self._loop is asyncio.get_running_loop():
                self._let_go()
            return
        if not CAN_COUNT_UNREAD or self._closing:
            return
        with self._reader_lock:
            if self._loop is not None:
                return
            self._loop = loop
        os.write(self._wake_w, b"x")

    def take_back(self) -> None:
        """From any thread: where the loop that reads has stopped without letting go (a
        forced exit may skip its shutdown), a thread reads again; a running loop keeps on."""
        with self._reader_lock:
            loop = self._loop
        if loop is not None and not loop.is_running():
            self._let_go()

    def _let_go(self) -> None:
        """The loop reads no more (from its thread, or from any where it does not run)."""
        with self._reader_lock:
            loop, self._loop = self._loop, None
            pending, self._handing_over = self._handing_over, False
            reads, self._loop_reads = self._loop_reads, False
        if reads:
            with contextlib.suppress(RuntimeError, OSError):  # a closed loop let go already
                loop.remove_reader(self._conn.fileno())
        if reads or pending:  # the thread has ended: a new one reads
            self._start_receiver()

    def _start_receiver(self) -> None:
        self._receiver = threading.Thread(target=self._receive, name="aiayn-lane-results",
                                          daemon=True)
        self._receiver.start()

    def _receive(self) -> None:
        """The thread's reading, until the loop takes over, a start fails, or close."""
        while True:
            with self._reader_lock:
                if self._loop is not None and self._decoding and not self._closing:
                    self._handing_over = True
                    self._loop.call_soon_threadsafe(self._read_on_loop)
                    return
            if self._wake_r is not None and self._wake_r in wait([self._conn, self._wake_r]):
                os.read(self._wake_r, 512)
                continue
            try:  # where the loop may read, what has come (it waited above); else one whole
                messages = self._frames.read() if self._frames else [self._conn.recv()]
            except (EOFError, OSError):
                if not self._replace():
                    return
                continue
            if not self._take_all(messages):
                return

    def _read_on_loop(self) -> None:
        """On the loop's thread: the thread has handed over; the loop reads from now on
        (unless it let go meanwhile: then a new thread reads already)."""
        with self._reader_lock:
            if not self._handing_over:
                return
            self._handing_over = False
            try:
                self._loop.add_reader(self._conn.fileno(), self._readable)
            except (RuntimeError, OSError):  # closing meanwhile: its thread ends it
                self._loop = None
                return
            self._loop_reads = True

    def _readable(self) -> None:
        """On the loop's thread: the child has sent something, or ended. What has come is
        read without waiting for the rest of a message (``Frames``): a child stopped in
        mid-write holds up no request but its own."""
        try:
            messages = self._frames.read()
        except (EOFError, OSError):  # a thread finds the end and starts a new child
            with self._reader_lock:
                self._loop_reads = self._decoding = False  # not back before a new READY
                with contextlib.suppress(RuntimeError, OSError):
                    self._loop.remove_reader(self._conn.fileno())
            self._start_receiver()
            return
        self._take_all(messages)

    def _take_all(self, messages: list) -> bool:
        """``_take`` each message in turn (False: no more to read); one whose handling fails
        is logged, and the others taken still: they have left the pipe."""
        for message in messages:
            try:
                if not self._take(message):
                    return False
            except Exception:
                log.exception("a lane's answer could not be taken")
        return True

    def _take(self, message) -> bool:
        """A message of the child: READY, CANNOT_START (then False: no more to read) or a
        ``Round``."""
        if message == READY:
            self._decoding = True
            self._ready.set()
        elif isinstance(message, tuple) and message[0] == CANNOT_START:
            self._start_failed = f"a decoding process of the server could not start: {message[1]}"
            self.process.join(timeout=10)  # it ends on its own
            self._ready.set()
            return False
        else:
            self.on_result(message)
        return True

    def _replace(self) -> bool:
        """The thread: the child has ended. Unless closing or it never could decode, its
        sentences are lost (``on_lost``) and a new child starts; returns whether it did."""
        with self._lock:
            if self._closing:
                return False
            self.process.join(timeout=5)
            if not self._ready.is_set():  # it never could decode: a new one would not
                self._start_failed = (f"a decoding process of the server ended before it "
                                      f"could decode (exit code {self.process.exitcode})")
                self._ready.set()
                return False
            lost = LaneLost(f"a decoding process of the server ended (exit code "
                            f"{self.process.exitcode}) with this request's sentences; "
                            "a new one has started: send it again")
            self.on_lost(lost)  # before the new child: what it gets is not lost
            self._close_conn()
            self._decoding = False  # the loop reads again once the new child is READY
            self._start()
        return True

    def close(self) -> None:
        """Stop the child (after the steps it has: its searches are the batcher's to have
        finished) and the reading; a loop reading must have let go (``read_on(None)``)."""
        with self._lock:
            self._closing = True
            with contextlib.suppress(OSError):
                self._send(ForkingPickler.dumps(None))
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()
        self._receiver.join(timeout=10)
        self._close_conn()
        if self._wake_w is not None and not self._receiver.is_alive():  # once: numbers reuse
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = None

    def _close_conn(self) -> None:
        """The pipe to the child that ended or is closing, and the reader's hold on it."""
        self._conn.close()
        if self._frames is not None:
            self._frames.close()


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
    arrived, wake = arrival_check(conn), conn.fileno()
    while True:
        adds: Adds = []
        removes: list[int] = []
        try:
            while not adds and not lane.searches or arrived():  # wait only when idle
                message = conn.recv()
                if message is None:
                    return
                adds.extend(message[0])
                removes.extend(message[1])
        except (EOFError, OSError):
            return
        result = lane.round(adds, removes, wake)
        steps, sentences = steps + result.steps, sentences + result.step_sentences
        seconds += result.seconds
        if result.done or result.failed or result.ended:
            result.steps, result.step_sentences, result.seconds = steps, sentences, seconds
            steps, sentences, seconds = 0, 0, 0.0
            result.failed = [(ids, _picklable(exc)) for ids, exc in result.failed]
            conn.send(result)


def _picklable(exc: Exception) -> Exception:
    """``exc`` itself if it can travel to the server and be read there, else a RuntimeError
    with its line."""
    try:
        pickle.loads(pickle.dumps(exc))  # both ways: some pickle and cannot be rebuilt
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
