"""The label-smoothed cross-entropy of the paper (5.4), with a backward pass that keeps one
softmax instead of log-probabilities. Torch alone: ``model.py`` computes the training loss
with it, and an export with aiayn's own code ships it.
"""

from __future__ import annotations

import torch
from torch import Tensor


# ---------------------------------------------------------------- loss (paper, 5.4)
def label_smoothed_loss(logits: Tensor, labels: Tensor, smoothing: float,
                        ignore_index: int) -> Tensor:
    """Summed cross-entropy with label smoothing eps_ls (paper, 5.4); positions whose label is
    ``ignore_index`` (padding) are left out.

    The smoothed target q puts 1 - eps on the reference token and spreads eps uniformly over
    the vocabulary; the loss of a position is -sum_v q_v log p_v with p = softmax(logits).
    Returns the sum over real tokens; the caller divides by their count. It equals
    ``F.cross_entropy(..., label_smoothing=eps, reduction="sum")`` (a test), computed by
    :class:`SmoothedCrossEntropy`.
    """
    return SmoothedCrossEntropy.apply(logits.float().reshape(-1, logits.size(-1)),
                                      labels.reshape(-1), smoothing, ignore_index)


class SmoothedCrossEntropy(torch.autograd.Function):
    """-sum_i sum_v q_iv log softmax(x_i)_v over the rows i whose label is not ``ignore``,
    with the softmax kept for the backward pass, which is then d loss / d x = p - q.

    ``F.cross_entropy`` keeps log-probabilities instead: its backward fills an N x V tensor
    with zeros for the NLL's gradient and then exponentiates all N x V log-probabilities again.
    With the demo's 8,000-piece vocabulary those passes over ~1,000 x 8,000 numbers were ~10%
    of a training step on a CPU; this one exponentiates once and updates p in place
    (docs/findings.md#the-price-of-a-step).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, smoothing: float, ignore: int) -> Tensor:
        keep = labels.ne(ignore)
        labels = labels.masked_fill(~keep, 0)[:, None]  # (N, 1), any valid id where ignored
        p = torch.softmax(logits, dim=-1)  # (N, V)
        # log Z = log sum_v exp(x_v) = max_v x_v - log max_v p_v: the largest probability is
        # >= 1/V, so this never underflows (log p_y taken from p directly would be -inf for
        # p_y < 1e-38). amax finds no indices: 3x faster than max here.
        log_z = logits.amax(dim=-1, keepdim=True) - torch.log(p.amax(dim=-1, keepdim=True))
        loss = log_z - logits.gather(1, labels)  # -log p_y
        if smoothing > 0:
            uniform = log_z - logits.mean(dim=-1, keepdim=True)  # -(1/V) sum_v log p_v
            loss = (1.0 - smoothing) * loss + smoothing * uniform
        ctx.save_for_backward(p, labels, keep)
        ctx.smoothing = smoothing
        return (loss.squeeze(1) * keep).sum()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        p, labels, keep = ctx.saved_tensors
        eps = ctx.smoothing
        # p - q, in place: q = (1 - eps) one_hot(y) + eps / V.
        p.scatter_add_(1, labels, torch.full_like(labels, eps - 1.0, dtype=p.dtype))
        if eps > 0:
            p.sub_(eps / p.size(-1))
        p.mul_(grad * keep[:, None])
        return p, None, None, None
