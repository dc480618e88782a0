"""Optimisation: Adam, the learning-rate schedule and the label-smoothed loss (paper, 5.3-5.4).

The training loop asks :func:`schedule_lr` for the learning rate of every update; it is a
pure function of the step and the config, so a resumed run needs only the step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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


def schedule_lr(step: int, config: Config) -> float:
    """The learning rate of update ``step`` (from 1) under ``config``: eq. 3 of the paper."""
    m, t = config.model, config.train
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


# ---------------------------------------------------------------- loss (paper, 5.4)
def label_smoothed_loss(logits: Tensor, labels: Tensor, smoothing: float, pad_id: int) -> Tensor:
    """Summed cross-entropy with label smoothing eps_ls (paper, 5.4), padding ignored.

    The smoothed target puts 1 - eps on the reference token and spreads eps uniformly over
    the vocabulary. Returns the sum over real tokens; the caller divides by their count.
    """
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)),
        labels.reshape(-1),
        ignore_index=pad_id,
        label_smoothing=smoothing,
        reduction="sum",
    )
