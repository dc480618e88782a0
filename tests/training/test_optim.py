"""Optimisation: the paper's learning-rate schedule (eq. 3) and the label-smoothed loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aiayn.loss import label_smoothed_loss
from aiayn.training.optim import learning_rate


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
    got = label_smoothed_loss(logits, labels, eps, ignore_index=0)
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


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_label_smoothed_loss_and_its_gradient_are_torch_cross_entropy(eps):
    """SmoothedCrossEntropy keeps the softmax for backward: the same loss and the same
    gradient as F.cross_entropy(label_smoothing=eps, ignore_index=pad), also for rows with a
    hopeless reference (a logit gap of 200, where the reference's probability is 0 in fp32)."""
    torch.manual_seed(0)
    V = 50
    logits = torch.randn(3, 7, V) * 5
    logits[1, 2, 9], logits[1, 2, 4] = 200.0, 0.0  # reference 4, 200 nats behind token 9
    labels = torch.randint(1, V, (3, 7))
    labels[1, 2] = 4
    labels[0, 5:] = 0  # padding
    ours = logits.clone().requires_grad_()
    theirs = logits.clone().requires_grad_()
    got = label_smoothed_loss(ours, labels, eps, ignore_index=0)
    expected = F.cross_entropy(theirs.reshape(-1, V), labels.reshape(-1), ignore_index=0,
                               label_smoothing=eps, reduction="sum")
    assert torch.isfinite(got) and got.item() > 200.0 * (1 - eps)
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)
    got.backward(torch.tensor(0.3))
    expected.backward(torch.tensor(0.3))
    assert torch.allclose(ours.grad, theirs.grad, atol=1e-7)
    assert ours.grad[0, 5:].abs().max() == 0  # padding gets no gradient
    # The kept softmax is updated in place by the backward pass: a second one is refused.
    again = ours.detach().clone().requires_grad_()
    loss = label_smoothed_loss(again, labels, eps, 0)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError):
        loss.backward()


def test_linear_schedule_warms_up_then_falls_to_zero_at_the_end_of_the_budget():
    from aiayn.training.optim import budget_fraction, linear_decay

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
    from aiayn.training.optim import schedule_lr

    config = Config().override(["train.warmup_steps=10", "train.max_steps=110", "train.lr_scale=2"])
    assert schedule_lr(10, config) == pytest.approx(learning_rate(10, 512, 10, 2.0))
    linear = config.override(["train.schedule=linear", "train.peak_lr=1e-3"])
    lrs = [schedule_lr(s, linear) for s in range(1, 111)]
    assert max(lrs) == pytest.approx(1e-3 * (1 - 9 / 110)) and lrs.index(max(lrs)) == 9
    assert lrs[-1] == pytest.approx(1e-3 / 110) and all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    timed = linear.override(["train.max_minutes=2"])  # 60 of 120 seconds: half-way down
    assert schedule_lr(50, timed, elapsed_s=60.0) == pytest.approx(0.5e-3)


# ---------------------------------------------------------------- Muon
def test_orthogonalize_brings_every_singular_value_near_one_in_any_orientation():
    from aiayn.training.optim import orthogonalize

    torch.manual_seed(0)
    for shape in ((4, 64, 64), (3, 32, 96), (2, 96, 32)):
        n, k = shape[0], min(shape[1:])
        u = torch.linalg.qr(torch.randn(n, shape[1], k)).Q
        v = torch.linalg.qr(torch.randn(n, shape[2], k)).Q
        g = u @ torch.diag_embed(torch.logspace(-1, 1, k).expand(n, k)) @ v.mT  # 100x apart
        o = orthogonalize(g)
        s = torch.linalg.svdvals(o)
        assert s.shape == (n, k)
        assert 0.6 < float(s.min()) and float(s.max()) < 1.25
        # the same singular directions as g: o is about U V^T
        assert float((u.mT @ o @ v).diagonal(dim1=1, dim2=2).min()) > 0.6
        assert float((o - u @ v.mT).norm() / (u @ v.mT).norm()) < 0.3


def _tiny_model():
    from aiayn.config import ModelConfig
    from aiayn.model import Transformer

    torch.manual_seed(0)
    return Transformer(ModelConfig(src_vocab_size=40, tgt_vocab_size=40, d_model=32, n_heads=4,
                                   d_ff=48, n_encoder_layers=1, n_decoder_layers=1, dropout=0.0,
                                   max_len=16))


def test_muon_moves_the_layers_matrices_part_by_part_and_leaves_the_rest_to_adam():
    """One update: every other parameter moves exactly as under the same Adam alone; a
    layer's matrix moves by the orthogonalized momentum of each of its parts (Q, K, V of a
    fused projection apart), at the rate's 0.2 sqrt(max(rows, cols)) times lr_ratio."""
    from aiayn.training.optim import Muon, orthogonalize

    model, reference = _tiny_model(), _tiny_model()
    src = torch.randint(4, 40, (3, 7))
    tgt = torch.randint(4, 40, (3, 6))
    for m in (model, reference):
        m(src, tgt[:, :-1], tgt[:, 1:], 0.0).backward()
    muon = Muon(model, lr_ratio=2.0, lr=1e-2, betas=(0.9, 0.98), eps=1e-9)
    chosen = {id(p) for g in muon.param_groups if g["muon"] for p in g["params"]}
    names, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
    matrices = [n for n, p in names.items() if id(p) in chosen]
    assert "encoder.layers.0.self_attn.qkv_proj.weight" in matrices
    assert not any("embed" in n or "norm" in n or n.endswith("bias") for n in matrices)
    adam = torch.optim.Adam([theirs[n] for n in names if n not in matrices], lr=1e-2,
                            betas=(0.9, 0.98), eps=1e-9)
    before = {n: p.detach().clone() for n, p in names.items()}
    grads = {n: p.grad.clone() for n, p in names.items()}
    muon.step()
    adam.step()
    for n, p in names.items():
        if n not in matrices:
            assert torch.equal(p, theirs[n]), n
    qkv = "decoder.layers.0.self_attn.qkv_proj.weight"
    g = grads[qkv]
    parts = orthogonalize((g + 0.95 * g).view(3, 32, 32))  # Nesterov on a fresh buffer
    expected = before[qkv] - 1e-2 * 2.0 * 0.2 * 32 ** 0.5 * parts.reshape(96, 32)
    torch.testing.assert_close(names[qkv], expected)
    ff = "encoder.layers.0.feed_forward.linear1.weight"  # (48, 32): one part, tall
    expected = before[ff] - 1e-2 * 2.0 * 0.2 * 48 ** 0.5 * orthogonalize(
        (1.95 * grads[ff])[None])[0]
    torch.testing.assert_close(names[ff], expected)


def test_muon_is_chosen_by_the_config_and_a_bad_name_is_one_line():
    from helpers import TINY

    from aiayn.config import load_config
    from aiayn.errors import AiaynError
    from aiayn.training.optim import Muon, build_optimizer

    config = load_config(TINY, ["train.optimizer=muon", "train.muon_lr_ratio=1.5",
                                "train.precision=fp32"])
    optimizer = build_optimizer(_tiny_model(), config)
    assert isinstance(optimizer, Muon) and optimizer.lr_ratio == 1.5
    assert optimizer.ns_dtype == torch.float32
    with pytest.raises(AiaynError, match="train.optimizer"):
        load_config(TINY, ["train.optimizer=sgd"])
