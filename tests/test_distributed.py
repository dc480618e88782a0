"""The device's precision (train.bf16: auto) and the CPU thread policy."""

from __future__ import annotations

import pytest
import torch

from aiayn.config import Config
from aiayn.distributed import ThreadTuner, prefer_bf16, resolve_bf16
from aiayn.errors import AiaynError


def test_bf16_auto_takes_bf16_only_where_it_is_clearly_faster():
    assert prefer_bf16(fp32_seconds=2.0e-3, bf16_seconds=1.0e-3)  # AVX512-BF16: ~2x
    assert not prefer_bf16(fp32_seconds=1.0e-3, bf16_seconds=80e-3)  # AVX2 emulation: ~80x
    assert not prefer_bf16(fp32_seconds=1.0e-3, bf16_seconds=0.95e-3)  # a tie keeps fp32


def test_resolve_bf16_forces_or_probes():
    cpu = torch.device("cpu")
    assert resolve_bf16("true", cpu) == (True, "train.bf16=true")
    assert resolve_bf16("false", cpu) == (False, "train.bf16=false")
    use, why = resolve_bf16("auto", cpu)
    assert isinstance(use, bool) and why.startswith("auto: a probe matmul took")


def test_bf16_setting_accepts_yaml_booleans_and_auto_and_refuses_the_rest():
    assert Config.from_dict({"train": {"bf16": True}}).train.bf16 == "true"
    assert Config.from_dict({"train": {"bf16": False}}).train.bf16 == "false"
    assert Config().train.bf16 == "auto"
    with pytest.raises(AiaynError, match="train.bf16 must be one of auto, true, false"):
        Config().override(["train.bf16=maybe"]).validate()
    with pytest.raises(ValueError, match="must be resolved first"):
        _ = Config().train.use_bf16
    assert Config().override(["train.bf16=true"]).train.use_bf16


class FakeClock:
    """Seconds per token as a function of the thread count (a busy core: 1 thread wins)."""

    def __init__(self, per_token: dict[int, float]):
        self.per_token = per_token

    def step(self, tuner: ThreadTuner, tokens: int = 1000) -> None:
        tuner.observe(self.per_token[torch.get_num_threads()] * tokens, tokens)


def test_thread_tuner_moves_to_one_thread_under_load_and_back_when_it_ends():
    before = torch.get_num_threads()
    try:
        tuner = ThreadTuner(2, every=10, every_s=1e9, trial=3)
        assert torch.get_num_threads() == 2
        # Two threads waiting on each other at barriers: the first trial (after 3 steps)
        # already finds one thread faster.
        busy = FakeClock({1: 1.0, 2: 5.0})
        for _ in range(6):
            busy.step(tuner)
        assert tuner.current == 1 and torch.get_num_threads() == 1
        # Then a trial of 3 steps every 10 steps; each phase below ends between trials.
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
    finally:
        torch.set_num_threads(before)


def test_thread_tuner_trials_also_come_by_time():
    before = torch.get_num_threads()
    try:
        tuner = ThreadTuner(2, every=1000, every_s=30.0, trial=2)
        slow = FakeClock({1: 0.002, 2: 0.001})  # 1 s per step of 1000 tokens with 2 threads
        for _ in range(4):  # the first trial (1 thread, steps 3-4) loses
            slow.step(tuner)
        assert tuner.current == 2 and torch.get_num_threads() == 2
        for _ in range(29):  # 29 s: no trial yet
            slow.step(tuner)
        assert torch.get_num_threads() == 2
        slow.step(tuner)  # 30 s since the last trial: the next one starts
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_fixed_thread_count_is_never_changed():
    before = torch.get_num_threads()
    try:
        tuner = ThreadTuner(2, adaptive=False, every=2, trial=1)
        for _ in range(20):
            FakeClock({1: 1.0, 2: 50.0}).step(tuner)
        assert not tuner.enabled and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
