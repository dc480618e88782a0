"""CPU threads on a busy machine (aiayn.util.threads): parallel streams of one thread each, and
the thread tuner of training. Behaviour only; the speed is benchmarks/threads.py's."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading

import pytest
import torch

from aiayn.config import Config, DataConfig, ModelConfig
from aiayn.data.tokenizer import EOS_ID, train_tokenizers
from aiayn.evaluation.evaluate import dev_loss
from aiayn.inference.translator import Translator
from aiayn.model import Transformer
from aiayn.util.threads import ThreadTuner, batch_policy, on_one_thread, parallel_map

WORDS = "red green blue black white sun moon star tree river".split()


@pytest.fixture
def threads():
    """Restore the test session's thread count whatever a test sets."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_parallel_map_keeps_order_and_runs_each_piece_on_one_thread(threads):
    torch.set_num_threads(2)
    seen: dict[int, tuple[str, int]] = {}

    def work(i: int) -> int:
        seen[i] = (threading.current_thread().name, torch.get_num_threads())
        return i * i

    assert list(parallel_map(work, range(40), streams=3)) == [i * i for i in range(40)]
    assert {count for _, count in seen.values()} == {1}
    workers = {name for name, _ in seen.values()}
    assert 1 <= len(workers) <= 3 and all(n.startswith("aiayn-stream") for n in workers)
    # The caller keeps its count, and so does a thread started afterwards.
    assert torch.get_num_threads() == 2
    later: list[int] = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert later == [2]
    assert list(parallel_map(work, [], streams=2)) == []


def test_parallel_map_raises_the_error_of_a_piece(threads):
    def work(i: int) -> int:
        if i == 3:
            raise ValueError("piece 3")
        return i

    with pytest.raises(ValueError, match="piece 3"):
        list(parallel_map(work, range(8), streams=2))


def test_on_one_thread_returns_the_value_computed_on_one_thread(threads):
    torch.set_num_threads(3)
    assert on_one_thread(torch.get_num_threads) == 1
    assert torch.get_num_threads() == 3
    # One stream of two threads: the calling thread, its count set for the while.
    assert list(parallel_map(lambda _: torch.get_num_threads(), range(3), streams=1,
                             threads_per_stream=2)) == [2, 2, 2]


@pytest.fixture(scope="module")
def random_translator() -> Translator:
    """An untrained model (its searches branch a lot) with a word-level tokenizer."""
    pairs = [(w, w) for w in WORDS]
    tokenizers = train_tokenizers(pairs, DataConfig(tokenizer="wordlevel", vocab_size=100,
                                                    min_frequency=1))
    torch.manual_seed(3)
    cfg = ModelConfig(src_vocab_size=tokenizers.src_vocab_size,
                      tgt_vocab_size=tokenizers.tgt_vocab_size, d_model=32, n_heads=4,
                      d_ff=64, n_encoder_layers=2, n_decoder_layers=2, dropout=0.0,
                      max_len=40)
    return Translator(Transformer(cfg), tokenizers, decode_tokens=64)


def sources(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 14) for _ in range(rng.randint(1, 12))] + [EOS_ID]
            for _ in range(n)]


@pytest.mark.parametrize("beam", [1, 3])
def test_translations_do_not_depend_on_the_number_of_streams(random_translator, beam, threads):
    ids = sources(60)
    by_streams = {}
    for streams in (1, 2, 4):
        random_translator.streams = streams
        by_streams[streams] = random_translator.decode_ids(
            ids, random_translator.resolve(beam=beam, nbest=beam))
    random_translator.streams = None
    assert len(by_streams[1]) == 60 and any(len(h[0].ids) > 3 for h in by_streams[1])
    assert by_streams[2] == by_streams[1] and by_streams[4] == by_streams[1]  # scores too


def test_streams_decode_without_autograd_and_leave_the_caller_alone(random_translator, threads):
    """Grad mode is per thread: each stream must switch it off itself (a graph per step
    would cost memory and time), and the caller's own mode and thread count stay."""
    seen: list[tuple[bool, int]] = []
    hook = random_translator.model.decoder.register_forward_hook(
        lambda *_: seen.append((torch.is_grad_enabled(), torch.get_num_threads())))
    torch.set_num_threads(2)
    random_translator.streams = 2
    try:
        with torch.enable_grad():
            random_translator.decode_ids(sources(20), random_translator.resolve(beam=2))
            assert torch.is_grad_enabled()
    finally:
        random_translator.streams = None
        hook.remove()
    assert seen and set(seen) == {(False, 1)}
    assert torch.get_num_threads() == 2


def test_dev_loss_is_the_same_on_one_or_two_streams(random_translator, threads):
    from aiayn.data.batching import Example

    rng = random.Random(5)
    examples = [Example(s, [2, *rng.choices(range(4, 14), k=rng.randint(1, 9)), EOS_ID], i)
                for i, s in enumerate(sources(50, seed=1))]
    config = Config(model=random_translator.model.cfg).validate()
    config.train.max_tokens, config.train.bf16 = 64, "false"
    losses = {}
    for count in (1, 2):
        torch.set_num_threads(count)  # dev_loss takes as many streams as torch has threads
        losses[count] = dev_loss(random_translator.model, examples, config,
                                 torch.device("cpu"))
    assert losses[1] == losses[2]
    assert all(0 < x < 10 for x in losses[1])


# ---------------------------------------------------------------- the tuner of training
class FakeClock:
    """Seconds per token as a function of the thread count."""

    def __init__(self, per_token: dict[int, float]):
        self.per_token = per_token

    def step(self, tuner: ThreadTuner, tokens: int = 1000) -> None:
        tuner.observe(self.per_token[torch.get_num_threads()] * tokens, tokens)


class ShapeClock:
    """A first pass whose shapes keep changing: each shape three steps in a row, then never
    again; a shape's first step at a count costs 6x (one-time setup), later ones their
    count's price, two threads twice as fast as one."""

    price = {1: 1.0, 2: 0.5}

    def __init__(self):
        self.seen: set = set()

    def steps(self, tuner: ThreadTuner, shapes: range, tell: bool = True) -> int:
        """Run the steps; how many trials began."""
        trials = 0
        for i in shapes:
            shape, count = i // 3, torch.get_num_threads()
            first = (shape, count) not in self.seen
            self.seen.add((shape, count))
            before = tuner.trying
            tuner.observe(self.price[count] * (6.0 if first else 1.0) * 1000, 1000,
                          shape=shape if tell else None)
            trials += before is None and tuner.trying is not None
        return trials


def test_a_shapes_first_step_at_a_count_is_no_sample(threads):
    """Left on the wrong count (as a noisy first trial can leave it), the tuner moves to two
    threads at its first trial and stays, trials coming at their backed-off interval. Not
    told the shapes, it takes every new shape's first step for a change of load and starts
    a trial at once, over and over."""
    clock, tuner = ShapeClock(), ThreadTuner(2, every=10, every_s=1e9, trial=3)
    tuner.current = 1
    torch.set_num_threads(1)
    clock.steps(tuner, range(30))
    assert tuner.current == 2 and torch.get_num_threads() == 2
    assert clock.steps(tuner, range(30, 330)) <= 10  # every 10, 20, 40, 40, ... steps
    assert tuner.current == 2
    blind_clock, blind = ShapeClock(), ThreadTuner(2, every=10, every_s=1e9, trial=3)
    assert blind_clock.steps(blind, range(330), tell=False) > 25


def test_a_trial_of_new_shapes_alone_ends_and_changes_nothing(threads):
    """A trial lasts its steps whatever their shapes (its price stays bounded); with no
    step of a shape it had run before, nothing says it is faster: the count stays."""
    tuner = ThreadTuner(2, every=1000, every_s=1e9, trial=2)
    for _ in range(3):  # two threads, one shape (its first step no sample): the first trial
        tuner.observe(500.0, 1000, shape="seen")
    assert tuner.trying == 1
    tuner.observe(100.0, 1000, shape=1)  # new shapes, 5x faster even with their setup
    assert tuner.trying == 1
    tuner.observe(100.0, 1000, shape=2)
    assert tuner.trying is None and tuner.current == 2 and torch.get_num_threads() == 2


def test_a_clearly_slower_new_shape_still_ends_a_trial_after_one_step(threads):
    """On a busy machine a trial of two threads costs one step even when that step is a
    shape new to two threads; a new shape merely as slow as setup makes it does not."""
    tuner = ThreadTuner(2, every=1000, every_s=1e9, trial=3)
    tuner.current = 1
    torch.set_num_threads(1)
    for _ in range(4):  # one thread, one shape (its first step no sample): the first trial
        tuner.observe(1000.0, 1000, shape="seen")
    assert tuner.trying == 2
    tuner.observe(3000.0, 1000, shape="new")  # 3x: within setup's allowance (2 x 2)
    assert tuner.trying == 2
    tuner.observe(8000.0, 1000, shape="newer")  # 8x: the load, not setup
    assert tuner.trying is None and tuner.current == 1 and torch.get_num_threads() == 1


def test_tuner_moves_to_one_thread_under_load_and_back_when_it_ends(threads):
    tuner = ThreadTuner(2, every=10, every_s=1e9, trial=3)
    assert torch.get_num_threads() == 2
    # Two threads waiting on each other at barriers: the first trial (after 3 steps)
    # already finds one thread faster.
    busy = FakeClock({1: 1.0, 2: 5.0})
    for _ in range(6):
        busy.step(tuner)
    assert tuner.current == 1 and torch.get_num_threads() == 1
    # Then a trial every 10 steps; each phase below ends between trials.
    for _ in range(9):
        busy.step(tuner)
    assert tuner.current == 1 and torch.get_num_threads() == 1
    quiet = FakeClock({1: 1.0, 2: 0.6})
    for _ in range(13):
        quiet.step(tuner)
    assert tuner.current == 2 and torch.get_num_threads() == 2
    # A trial that is only a little faster does not switch (margin).
    close = FakeClock({1: 0.58, 2: 0.6})
    for _ in range(13):
        close.step(tuner)
    assert tuner.current == 2 and torch.get_num_threads() == 2


def test_tuner_trials_also_come_by_time(threads):
    tuner = ThreadTuner(2, every=1000, every_s=30.0, trial=2, max_backoff=1)
    slow = FakeClock({1: 0.002, 2: 0.001})  # 1 s per step of 1000 tokens with 2 threads
    for _ in range(4):  # the first trial (1 thread, steps 3-4) loses
        slow.step(tuner)
    assert tuner.current == 2 and torch.get_num_threads() == 2
    for _ in range(29):  # 29 s: no trial yet
        slow.step(tuner)
    assert torch.get_num_threads() == 2
    slow.step(tuner)  # 30 s since the last trial: the next one starts
    assert torch.get_num_threads() == 1


def test_tuner_reacts_to_a_load_change_at_the_next_step(threads):
    tuner = ThreadTuner(2, every=1000, every_s=1e9, trial=3)
    quiet, busy = FakeClock({1: 1.0, 2: 0.6}), FakeClock({1: 1.0, 2: 6.0})
    for _ in range(8):  # the first trial of 1 thread loses
        quiet.step(tuner)
    assert tuner.current == 2 and tuner.trying is None
    busy.step(tuner)  # one step 10x slower than two threads' median: a trial at once
    assert tuner.trying == 1 and torch.get_num_threads() == 1
    for _ in range(3):
        busy.step(tuner)
    assert tuner.current == 1 and torch.get_num_threads() == 1


def test_a_clearly_slower_trial_ends_after_one_step(threads):
    tuner = ThreadTuner(2, every=5, every_s=1e9, trial=4, max_backoff=1)
    busy = FakeClock({1: 1.0, 2: 8.0})
    for _ in range(8):  # the first trial (after 4 steps at 2 threads) moves to 1 thread
        busy.step(tuner)
    assert tuner.current == 1
    slow_steps = 0
    for _ in range(60):  # trials of 2 threads every 5 steps: each costs one step
        if torch.get_num_threads() == 2:
            slow_steps += 1
        busy.step(tuner)
        assert tuner.trying is None or torch.get_num_threads() == 2
    assert tuner.current == 1 and 5 <= slow_steps <= 12


def trial_starts(tuner: ThreadTuner, clock: FakeClock, steps: int) -> list[int]:
    """The steps (counted from 0) at which a trial began."""
    starts = []
    for i in range(steps):
        before = tuner.trying
        clock.step(tuner)
        if before is None and tuner.trying is not None:
            starts.append(i)
    return starts


def test_trials_that_change_nothing_come_less_often_until_the_load_changes(threads):
    tuner = ThreadTuner(2, every=10, every_s=1e9, trial=2, max_backoff=4)
    quiet = FakeClock({1: 1.0, 2: 0.6})
    starts = trial_starts(tuner, quiet, 152)  # the last trial ends at step 151
    # The first trial after 2 steps; each trial of 2 steps that loses doubles the wait for
    # the next: 20 steps, 40, then the cap (4 x 10) again.
    assert starts == [1, 23, 65, 107, 149]
    assert tuner.current == 2
    # What the trials cost: 5 trials of 2 steps at one thread, each 0.4 s per token slower
    # than two threads on the clock's 1000 tokens.
    assert tuner.trial_excess_s == pytest.approx(5 * 2 * 0.4 * 1000)
    # The load changes: the next step is a trial at once, and the one that wins (one
    # thread) brings the interval back to 10 steps.
    busy = FakeClock({1: 1.0, 2: 6.0})
    starts = trial_starts(tuner, busy, 30)
    assert tuner.current == 1
    assert starts[0] == 0 and starts[1] == 12


def test_a_fixed_thread_count_is_never_changed(threads):
    tuner = ThreadTuner(2, adaptive=False, every=2, trial=1)
    for _ in range(20):
        FakeClock({1: 1.0, 2: 50.0}).step(tuner)
    assert not tuner.enabled and torch.get_num_threads() == 2


BATCH_PROBE = """
import os, threading, subprocess, sys
from aiayn.util.threads import batch_policy
ids = []
def wait(ready):
    ids.append(threading.get_native_id())
    ready.wait(30)
ready = threading.Event()
before = threading.Thread(target=wait, args=(ready,), daemon=True)
chosen = threading.Thread(target=wait, args=(ready,), daemon=True)
before.start(), chosen.start()
while len(ids) < 2:
    pass
os.sched_setscheduler(chosen.native_id, os.SCHED_IDLE, os.sched_param(0))
done = batch_policy()
after = threading.Thread(target=lambda: ids.append(os.sched_getscheduler(0)))
after.start(), after.join()
child = subprocess.run([sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"],
                       capture_output=True, text=True, check=True).stdout.strip()
print(done, os.sched_getscheduler(0), os.sched_getscheduler(before.native_id),
      os.sched_getscheduler(chosen.native_id), ids[2], child)
ready.set()
"""


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_batch_policy_covers_the_threads_before_and_after_and_the_processes_after():
    """In a process of its own (it changes every thread of the caller): the calling thread,
    a thread started before, one started after and a child process become SCHED_BATCH; a
    thread put under another policy (SCHED_IDLE) keeps it."""
    out = subprocess.run([sys.executable, "-c", BATCH_PROBE], capture_output=True, text=True,
                         check=True).stdout.split()
    batch, idle = str(os.SCHED_BATCH), str(os.SCHED_IDLE)
    assert out == ["True", batch, batch, idle, batch, batch]


def test_batch_policy_says_false_where_the_system_has_none_or_refuses(monkeypatch):
    def refuse(*args):
        raise PermissionError("not here")

    monkeypatch.setattr(os, "sched_setscheduler", refuse, raising=False)
    assert batch_policy() is False  # refused (where the policy exists)
    monkeypatch.delattr(os, "SCHED_BATCH", raising=False)
    assert batch_policy() is False
