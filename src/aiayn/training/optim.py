"""Optimisation: Adam and the learning-rate schedule (paper, 5.3), Muon (``train.optimizer:
muon``), and fp16's gradient
scaler (``new_scaler``); the label-smoothed loss (5.4) is ``aiayn.loss.label_smoothed_loss``,
beside the model that computes it.

The training loop asks :func:`schedule_lr` for the learning rate of every update: a pure
function of the step and the config (and, for a ``linear`` schedule under a time budget, of
the training time so far, which the train state keeps), so a resumed run needs only those.
"""

from __future__ import annotations

import torch
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
    ``train.optimizer: muon``: :class:`Muon` for the layers' weight matrices, this Adam for
    the rest.

    The fused kernel updates every parameter in one pass; on a CPU the default per-tensor
    loop costs ~100x more (seconds per step for bible-small on 2 cores, half the step time).
    """
    t = config.train
    device = next(model.parameters()).device
    adam = dict(lr=0.0, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                weight_decay=t.weight_decay, fused=device.type in ("cpu", "cuda"))
    if t.optimizer == "muon":
        ns_dtype = torch.bfloat16 if t.use_bf16 else torch.float32
        return Muon(model, lr_ratio=t.muon_lr_ratio, ns_dtype=ns_dtype, **adam)
    return torch.optim.Adam(model.parameters(), **adam)


# ---------------------------------------------------------------- Muon (not in the paper)
# Jordan et al. (2024)'s quintic Newton-Schulz coefficients: each step maps a singular value
# s to a s + b s^3 + c s^5, which takes every s in (0, 1] to about 0.7-1.2 within 5 steps.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
# Projections computed as one product, orthogonalized part by part as the separate
# matrices they stand for (model.py: Q, K and V of self-attention; K and V of the memory).
FUSED_PARTS = {"qkv_proj": 3, "kv_proj": 2}


def orthogonalize(g: Tensor, steps: int = NS_STEPS) -> Tensor:
    """(n, r, c) matrices -> about U V^T of each (G = U S V^T): Newton-Schulz iterations
    X <- a X + (b A + c A^2) X with A = X X^T, from X = G / ||G||_F (singular values <= 1).
    Singular values end near 1 (0.7-1.2), not exactly 1, which trains as well (Jordan 2024)."""
    a, b, c = NS_COEFFICIENTS
    tall = g.size(1) > g.size(2)  # iterate on the wide side: A is then the smaller square
    x = g.mT if tall else g
    x = x / x.flatten(1).norm(dim=1).clamp(min=1e-7)[:, None, None]
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


class Muon(torch.optim.Adam):
    """Muon (MomentUm Orthogonalized by Newton-Schulz; Jordan et al. 2024) for the encoder's
    and decoder's weight matrices, Adam (this class's base, as ``build_optimizer`` sets it)
    for everything else: embeddings and the output layer tied to them, biases, norm gains.

    A matrix W with gradient G takes momentum B <- mu B + G, Nesterov's G + mu B, and steps
    along that direction orthogonalized (:func:`orthogonalize`): every singular direction of
    the update moves about as far, where Adam's update is dominated by a few. The step is
    ``lr * lr_ratio * 0.2 * sqrt(max(rows, cols))``: the 0.2 sqrt(max) gives the update the
    RMS of a typical Adam update (Liu et al. 2025, "Muon is scalable"), so the schedule's
    rate serves both; ``lr_ratio`` moves Muon's alone. Matrices of one shape are
    orthogonalized together (a batch of products), in ``ns_dtype`` (bf16 where training
    runs in bf16, as the reference implementation; else fp32: on a CPU without fast bf16 the
    bf16 products are many times slower). Evidence and cost: docs/findings.md#muon.
    """

    def __init__(self, model: nn.Module, lr_ratio: float = 1.0, momentum: float = 0.95,
                 ns_dtype: torch.dtype = torch.float32, **adam):
        matrices, parts = [], []
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and name.startswith(("encoder.", "decoder.")):
                matrices.append(module.weight)
                parts.append(FUSED_PARTS.get(name.rsplit(".", 1)[-1], 1))
        chosen = {id(p) for p in matrices}
        rest = [p for p in model.parameters() if id(p) not in chosen]
        super().__init__([dict(params=rest, muon=False),
                          dict(params=matrices, muon=True, parts=parts)], **adam)
        self.lr_ratio, self.momentum, self.ns_dtype = lr_ratio, momentum, ns_dtype

    def __setstate__(self, state: dict) -> None:
        """Adam's (run by ``load_state_dict``) over its groups alone: it would look for a
        step count in the matrices' state, which holds only the momentum."""
        groups = state["param_groups"]
        super().__setstate__({**state, "param_groups": [g for g in groups if not g["muon"]]})
        self.param_groups = groups

    @torch.no_grad()
    def step(self, closure=None):
        groups = self.param_groups
        try:  # Adam's own step, over its groups alone
            self.param_groups = [g for g in groups if not g["muon"]]
            super().step()
        finally:
            self.param_groups = groups
        for group in groups:
            if group["muon"]:
                self._muon_step(group)

    def _muon_step(self, group: dict) -> None:
        by_shape: dict[tuple[int, int], list] = {}  # (rows, cols) of a part -> its updates
        for p, k in zip(group["params"], group["parts"], strict=True):
            if p.grad is None:
                continue
            buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
            buf.mul_(self.momentum).add_(p.grad)
            update = p.grad.add(buf, alpha=self.momentum).view(k, p.size(0) // k, p.size(1))
            shape = tuple(sorted(update.shape[1:]))  # tall parts go in transposed
            by_shape.setdefault(shape, []).append((p, update))
        for (r, c), items in by_shape.items():
            wide = [u if u.size(1) <= u.size(2) else u.mT for _, u in items]
            done = orthogonalize(torch.cat(wide).to(self.ns_dtype)).float()
            step = group["lr"] * self.lr_ratio * 0.2 * max(r, c) ** 0.5
            for (p, u), o in zip(items, done.split([u.size(0) for _, u in items]), strict=True):
                p.add_((o if u.size(1) <= u.size(2) else o.mT).reshape(p.shape), alpha=-step)


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
