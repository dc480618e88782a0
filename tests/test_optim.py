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
