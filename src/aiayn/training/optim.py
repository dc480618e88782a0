"""Optimisation: Adam and the learning-rate schedule (paper, 5.3), and fp16's gradient
scaler (``new_scaler``); the label-smoothed loss (5.4) is ``aiayn.loss.label_smoothed_loss``,
beside the model that computes it.

The training loop asks :func:`schedule_lr` for the learning rate of every update: a pure
function of the step and the config (and, for a ``linear`` schedule under a time budget, of
the training time so far, which the train state keeps), so a resumed run needs only those.
"""

from __future__ import annotations

import torch
from torch import nn

from aiayn.config import Config


# ---------------------------------------------------------------- learning rate (paper, 5.3)
def learning_rate(step: int, d_model: int, warmup: int, scale: float) -> float:
    """lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)   (paper, eq. 3).

    Rises linearly for ``warmup`` steps, peaks at step == warmup with
    scale * (d_model * warmup)^-0.5, then decays as step^-0.5. ``step`` counts optimizer
    updates from 1.
    """
    if step < 1:
        raise ValueError(f"the schedule starts at step 1, got {step}")
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def linear_decay(step: int, warmup: int, peak: float, fraction: float) -> float:
    """lr = peak * min(1, step / warmup) * (1 - fraction): a linear warm-up, then a straight
    line down to 0 as ``fraction`` (the share of the training budget already used, 0..1)
    reaches 1.

    The schedule for a run of known length: eq. 3 decays as step^-0.5 forever, so a short
    run stops at a still-high rate (with warm-up 400, a third of the 12-minute demo was
    warm-up). Ending at 0 exactly when the budget ends is the usual fixed-budget answer.
    """
    if step < 1:
        raise ValueError(f"the schedule starts at step 1, got {step}")
    return peak * min(1.0, step / warmup) * max(0.0, 1.0 - fraction)


def budget_fraction(step: int, elapsed_s: float, max_steps: int, max_minutes: float) -> float:
    """How much of the budget is used before update ``step``: the larger of the steps done
    over train.max_steps and the training seconds so far over train.max_minutes (when set)."""
    used = (step - 1) / max_steps
    if max_minutes > 0:
        used = max(used, elapsed_s / (60.0 * max_minutes))
    return min(1.0, used)


def schedule_lr(step: int, config: Config, elapsed_s: float = 0.0) -> float:
    """The learning rate of update ``step`` (from 1) under ``config``: eq. 3 of the paper
    (``train.schedule: eq3``) or :func:`linear_decay` to the end of the budget (``linear``;
    ``elapsed_s``: training seconds before this update, for a budget in minutes)."""
    m, t = config.model, config.train
    if t.schedule == "linear":
        fraction = budget_fraction(step, elapsed_s, t.max_steps, t.max_minutes)
        return linear_decay(step, t.warmup_steps, t.peak_lr, fraction)
    return learning_rate(step, m.d_model, t.warmup_steps, t.lr_scale)


# ---------------------------------------------------------------- Adam (paper, 5.3)
def build_optimizer(model: nn.Module, config: Config) -> torch.optim.Adam:
    """Adam(beta1=0.9, beta2=0.98, eps=1e-9) (paper, 5.3); the lr is set before every update.

    The fused kernel updates every parameter in one pass; on a CPU the default per-tensor
    loop costs ~100x more (seconds per step for bible-small on 2 cores, half the step time).
    """
    t = config.train
    device = next(model.parameters()).device
    return torch.optim.Adam(model.parameters(), lr=0.0, betas=(t.adam_beta1, t.adam_beta2),
                            eps=t.adam_eps, weight_decay=t.weight_decay,
                            fused=device.type in ("cpu", "cuda"))


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


# fp16's gradient scale below which the run stops as for a non-finite loss: the gradients
# overflow whatever the scale (fairseq's --min-loss-scale, 1e-4, stops there too).
MIN_LOSS_SCALE = 1e-4


def new_scaler(device: torch.device) -> torch.amp.GradScaler:
    """train.precision fp16's gradient scaler: PyTorch's defaults (scale 2^16, halved after
    an overflow, doubled after 2,000 steps without one); the loop's ``train_step`` uses it."""
    return torch.amp.GradScaler(device.type)
