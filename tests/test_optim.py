"""Optimisation: the paper's learning-rate schedule (eq. 3) and the label-smoothed loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aiayn.optim import label_smoothed_loss, learning_rate


def test_learning_rate_is_eq3_and_peaks_at_warmup():
    d, warmup, scale = 512, 4000, 1.0
    for step in (1, 10, 100, 3999, 4000, 4001, 10_000, 100_000):
        expected = d**-0.5 * min(step**-0.5, step * warmup**-1.5)
        assert learning_rate(step, d, warmup, scale) == pytest.approx(expected, rel=1e-12)
    # The paper's base model peaks at about 7.0e-4 exactly at step == warmup.
    peak = learning_rate(warmup, d, warmup, scale)
    assert peak == pytest.approx((d * warmup) ** -0.5) and peak == pytest.approx(6.988e-4, rel=1e-3)
    values = [learning_rate(s, d, warmup, scale) for s in range(1, 3 * warmup)]
    assert max(range(len(values)), key=values.__getitem__) + 1 == warmup
    assert learning_rate(100, d, warmup, 2.0) == pytest.approx(2 * learning_rate(100, d, warmup, 1))
    assert learning_rate(1, d, warmup, scale) == pytest.approx(d**-0.5 * warmup**-1.5)
    with pytest.raises(ValueError):
        learning_rate(0, d, warmup, scale)


def test_label_smoothed_loss_ignores_padding_and_smooths_over_the_vocabulary():
    torch.manual_seed(0)
    V, eps = 7, 0.1
    logits = torch.randn(2, 4, V)
    labels = torch.tensor([[5, 3, 0, 0], [1, 2, 6, 0]])  # 0 is padding
    got = label_smoothed_loss(logits, labels, eps, pad_id=0)
    logp = F.log_softmax(logits, dim=-1)
    expected = 0.0
    for b in range(2):
        for t in range(4):
            if labels[b, t] != 0:
                target = torch.full((V,), eps / V)
                target[labels[b, t]] += 1 - eps
                expected += -(target * logp[b, t]).sum()
    assert got.item() == pytest.approx(float(expected), rel=1e-5)
    # Changing the logits at padded positions changes nothing.
    logits2 = logits.clone()
    logits2[labels == 0] = 100.0
    assert label_smoothed_loss(logits2, labels, eps, 0).item() == pytest.approx(got.item())


def test_linear_schedule_warms_up_then_falls_to_zero_at_the_end_of_the_budget():
    from aiayn.optim import budget_fraction, linear_decay

    peak, warmup = 1.5e-3, 200
    assert linear_decay(1, warmup, peak, 0.0) == pytest.approx(peak / warmup)
    assert linear_decay(100, warmup, peak, 0.0) == pytest.approx(peak / 2)
    assert linear_decay(200, warmup, peak, 0.0) == pytest.approx(peak)
    assert linear_decay(500, warmup, peak, 0.25) == pytest.approx(0.75 * peak)
    assert linear_decay(900, warmup, peak, 1.0) == 0.0
    assert linear_decay(900, warmup, peak, 1.3) == 0.0  # never negative
    # The budget: steps over max_steps, or training time over max_minutes if that is further.
    assert budget_fraction(1, 0.0, 1000, 0.0) == 0.0
    assert budget_fraction(501, 0.0, 1000, 0.0) == pytest.approx(0.5)
    assert budget_fraction(11, 180.0, 100_000, 12.0) == pytest.approx(0.25)  # 3 of 12 minutes
    assert budget_fraction(901, 60.0, 1000, 12.0) == pytest.approx(0.9)  # steps first
    assert budget_fraction(5, 10_000.0, 1000, 12.0) == 1.0
    with pytest.raises(ValueError):
        linear_decay(0, warmup, peak, 0.0)


def test_schedule_lr_follows_train_schedule():
    from aiayn.config import Config
    from aiayn.optim import schedule_lr

    config = Config().override(["train.warmup_steps=10", "train.max_steps=110", "train.lr_scale=2"])
    assert schedule_lr(10, config) == pytest.approx(learning_rate(10, 512, 10, 2.0))
    linear = config.override(["train.schedule=linear", "train.peak_lr=1e-3"])
    lrs = [schedule_lr(s, linear) for s in range(1, 111)]
    assert max(lrs) == pytest.approx(1e-3 * (1 - 9 / 110)) and lrs.index(max(lrs)) == 9
    assert lrs[-1] == pytest.approx(1e-3 / 110) and all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    timed = linear.override(["train.max_minutes=2"])  # 60 of 120 seconds: half-way down
    assert schedule_lr(50, timed, elapsed_s=60.0) == pytest.approx(0.5e-3)
