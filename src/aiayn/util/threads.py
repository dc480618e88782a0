"""CPU threads on a machine that is doing something else.

Why this module exists. PyTorch splits every CPU op evenly over its OpenMP threads and
waits at a barrier at the op's end. When another program takes one of the cores, the
thread on that core runs only when the scheduler hands it a time slice (milliseconds
later), and every op waits for it. A decoding step is hundreds of ops of a few
microseconds each, so it can become many times slower than *one* thread on the free core
would be, by how much depends on the hypervisor and the scheduler (docs/threads.md).
Waiting policies (OMP_WAIT_POLICY, GOMP_SPINCOUNT) only change how the waiting is done: the
descheduled thread still holds everyone up.

Two remedies, one per shape of work (and a third for a server, ``batch_policy``):

- Work that comes in independent pieces (decoding batches, dev-loss batches):
  :func:`parallel_map` runs the pieces on ``streams`` Python threads with ONE intra-op
  thread each, every stream taking the next piece when it finishes its own. No op waits
  for another thread; a stream that loses its core simply takes fewer pieces. PyTorch
  releases the GIL inside its ops, so the streams overlap. Each piece runs on one thread
  whatever the number of streams, so the results do not depend on it (a test).
- One computation that cannot be cut into independent pieces (a training step):
  :class:`ThreadTuner` keeps the intra-op thread count that is fastest *now*, and notices
  within a step or two when the load changes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")


# ---------------------------------------------------------------- independent pieces
def default_streams(device: torch.device | str = "cpu") -> int:
    """Streams for :func:`parallel_map` on ``device``: on a CPU as many as the calling
    thread's torch threads (all cores by default; ``OMP_NUM_THREADS`` or
    ``torch.set_num_threads`` set it); on a GPU one (its kernels queue on one device)."""
    return torch.get_num_threads() if torch.device(device).type == "cpu" else 1


def parallel_map(fn: Callable[[T], R], items: Iterable[T], streams: int | None = None,
                 threads_per_stream: int = 1) -> Iterator[R]:
    """``fn(item)`` for every item, yielded in the items' order, computed on ``streams``
    worker threads (default :func:`default_streams`; one stream is the calling thread)
    that each run torch ops on ``threads_per_stream`` intra-op threads (one: no op waits
    for another thread; more only to measure what that costs, benchmarks/threads.py) and
    take the next item as soon as they are free.

    OpenMP and MKL keep their thread counts per OS thread, so the calling thread's own
    count is left as it was (torch's default for threads started later, which a worker's
    ``set_num_threads`` changes, is restored too).
    """
    items = list(items)
    if not items:
        return
    streams = max(1, min(streams or default_streams(), len(items)))
    caller_threads = torch.get_num_threads()
    try:
        if streams == 1:  # no pool: the calling thread, with its count set for the while
            torch.set_num_threads(threads_per_stream)
            yield from map(fn, items)
            return
        with ThreadPoolExecutor(streams, thread_name_prefix="aiayn-stream",
                                initializer=torch.set_num_threads,
                                initargs=(threads_per_stream,)) as pool:
            yield from pool.map(fn, items)
    finally:
        torch.set_num_threads(caller_threads)


def on_one_thread(fn: Callable[[], R]) -> R:
    """``fn()`` with one intra-op thread (a single small computation, e.g. the teacher-forced
    pass of one sentence, which two threads would not speed up and a busy core would slow
    down many times); the calling thread's count is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------- a server beside its lanes
def batch_policy() -> bool:
    """Put the threads of this process that run under the ordinary policy, and the threads
    and processes they start after, under Linux's SCHED_BATCH scheduling policy (a policy
    chosen for the process, such as `chrt --idle`, stays); False where there is no such
    policy or it is refused. Once set, the process keeps it.

    For `aiayn serve` on a CPU, whose lanes decode on the cores its HTTP threads use
    (aiayn.serving.lanes). A request wakes the server's event loop when it arrives and when
    its lane answers, and under the ordinary policy each wakeup preempts whatever runs on
    the core, often a lane in mid-step, which then resumes with its caches cold. A batch
    thread that wakes waits for the running one's time slice to end instead; its share of
    the CPU is the same. On a 2-core CPU a little more of the offline rate with nothing
    else running, the same with a core busy (docs/serving.md#lanes)."""
    if not hasattr(os, "SCHED_BATCH") or not hasattr(os, "sched_setscheduler"):
        return False
    try:
        threads = [int(thread) for thread in os.listdir("/proc/self/task")]
    except OSError:  # no /proc
        return False
    for thread in threads:
        try:
            if os.sched_getscheduler(thread) == os.SCHED_OTHER:
                os.sched_setscheduler(thread, os.SCHED_BATCH, os.sched_param(0))
        except ProcessLookupError:  # it ended meanwhile
            continue
        except OSError:  # a system that refuses
            return False
    return True


# ---------------------------------------------------------------- one computation at a time
class ThreadTuner:
    """Keeps the CPU thread count that trains fastest *now*.

    On a quiet 2-core machine two OpenMP threads are fastest. When another process keeps
    one core busy, the two threads wait for each other at every op's barrier and a step
    can take 7-10x longer, while one thread on the free core keeps more than half the
    speed. The load comes and goes, so no count chosen at start-up is right for a whole
    run. The tuner measures seconds per token at each count and:

    - tries the other count for ``trial`` steps every ``every`` steps or ``every_s``
      seconds (the first time after ``trial`` steps), and keeps whichever is faster by
      ``margin``;
    - after each trial that changes nothing, waits twice as long for the next one, up to
      ``max_backoff`` times ``every`` / ``every_s``; back to ``every`` when the count changes
      or the load does. Trials of the slower count are the tuner's price: on a quiet
      2-core AVX2 EPYC a step of the demo at one thread takes ~1.6x one at two, so 4 of
      them every 100 steps would cost ~2.5% of the training time; with a core spinning
      (benchmarks/busy.py) a step at two threads took ~1.7x one at one thread, so ~3%
      (estimates from those prices). With the backoff the demo's trials cost 4.8 s of its
      720 quiet and 3.6 s busy (``trial_excess_s``);
    - ends a trial after one step when that step is ``clearly`` slower than the current
      count's median (a trial of two threads on a busy machine then costs one slow step,
      not ``trial`` of them);
    - starts a trial at once when a step at the current count is ``clearly`` slower than
      its own recent median (the load has changed: no waiting for the next interval);
    - leaves out of every comparison the first step of each batch shape at each count
      (``observe``'s ``shape``): that step pays one-time setup for the shape at that count
      (a bf16 linear's first call at a new shape or count took 1.5-2x a later one on a
      Zen 5), so it says nothing of the load. In a pass whose shapes keep changing (a length
      curriculum's first) such steps are many, and counted they make a trial count look
      slower than it is and a new shape look like a change of load (a test).

    Only for CPU training with more than one core (``adaptive``); otherwise it just sets
    ``max_threads``. The count can change the order of floating-point sums, so a run that
    must repeat bit for bit fixes it (train.cpu_threads).
    """

    # A shape's first step at a count takes up to this many times a later one (1.5-2x
    # measured): such a step ends a trial as clearly worse only beyond ``clearly`` times this.
    SETUP = 2.0

    def __init__(self, max_threads: int, adaptive: bool = True, every: int = 100,
                 every_s: float = 60.0, trial: int = 4, margin: float = 1.1,
                 clearly: float = 2.0, max_backoff: int = 4):
        self.counts = sorted({1, max_threads})
        self.current = max_threads
        self.every, self.every_s, self.trial = every, every_s, trial
        self.margin, self.clearly = margin, clearly
        self.max_backoff = max_backoff
        self._backoff = 1  # the interval between trials, in units of every / every_s
        # What trials cost: seconds their steps took beyond the current count's median
        # (negative when a trial was faster); aiayn train logs it as tuner_excess_s.
        self.trial_excess_s = 0.0
        self.enabled = adaptive and len(self.counts) > 1
        self._seconds: dict[int, list[float]] = {c: [] for c in self.counts}  # s/token, recent
        self._seen: set[tuple] = set()  # (shape, count) pairs that have run once
        self._trying: int | None = None
        self._trial_steps = 0  # steps of the trial on now, new shapes included
        self._since = (0, 0.0)  # steps and seconds since the last trial
        torch.set_num_threads(self.current)

    @property
    def trying(self) -> int | None:
        """The count on trial now, or None."""
        return self._trying

    def observe(self, seconds: float, tokens: int, shape: tuple | None = None) -> None:
        """Record one step's time; start a trial when one is due, decide when it ends.
        ``shape``: the step's batch shape (any hashable); the first step of a shape at the
        count it ran on is no sample (one-time setup), though it counts towards the time
        and steps between trials and a trial's length, and can still end a trial as clearly
        worse (beyond ``SETUP`` times the bar)."""
        if not self.enabled or tokens <= 0:
            return
        per_token = seconds / tokens
        count = self.current if self._trying is None else self._trying
        novel = shape is not None and (shape, count) not in self._seen
        if novel:
            self._seen.add((shape, count))
        if self._trying is not None:
            self._observe_trial(per_token, tokens, novel)
            return
        if novel:
            self._since = (self._since[0] + 1, self._since[1] + seconds)
            return
        samples = self._seconds[self.current]
        # A step far slower than this count's recent ones: the load changed. Not kept
        # among the samples, so a single slow step does not move the median.
        jumped = (len(samples) >= self.trial
                  and per_token > self.clearly * _median(samples))
        if not jumped:
            samples.append(per_token)
            del samples[: -self.trial]
        steps, elapsed = self._since[0] + 1, self._since[1] + seconds
        self._since = (steps, elapsed)
        untried = any(not self._seconds[c] for c in self.counts)
        if jumped:  # the older samples describe a machine that is gone: this step is now
            samples[:] = [per_token]
            self._backoff = 1
        if (jumped or (untried and len(samples) >= self.trial)
                or steps >= self.every * self._backoff
                or elapsed >= self.every_s * self._backoff):
            self._start_trial()

    def _start_trial(self) -> None:
        self._trying = next(c for c in self.counts if c != self.current)
        self._seconds[self._trying] = []
        self._since, self._trial_steps = (0, 0.0), 0
        torch.set_num_threads(self._trying)

    def _observe_trial(self, per_token: float, tokens: int, novel: bool) -> None:
        """A trial lasts ``trial`` steps, new shapes included (its price stays bounded);
        it is decided on the steps of shapes it has run before."""
        trial, current = self._seconds[self._trying], self._seconds[self.current]
        self._trial_steps += 1
        self.trial_excess_s += (per_token - _median(current)) * tokens
        worse = per_token > self.clearly * (self.SETUP if novel else 1.0) * _median(current)
        if worse or not novel:  # a clearly worse step is a sample whatever its shape
            trial.append(per_token)
        if worse:
            self._end_trial(keep_trial=False)  # clearly worse: one step was enough
        elif self._trial_steps >= self.trial:
            self._end_trial(keep_trial=bool(trial) and _median(trial) * self.margin < _median(current))

    def _end_trial(self, keep_trial: bool) -> None:
        if keep_trial:
            self.current = self._trying
            self._backoff = 1
        else:
            self._backoff = min(2 * self._backoff, self.max_backoff)
        self._trying = None
        torch.set_num_threads(self.current)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]
