"""aiayn.training.toy: the digit tasks and the short training run that docs/ablations.ipynb uses."""

from __future__ import annotations

import pytest
import torch

from aiayn.config import Config, ModelConfig, TrainConfig
from aiayn.training.toy import SURE, TASKS, digit_pairs, token_confidence, train_toy


def tiny(**train) -> Config:
    return Config(
        model=ModelConfig(src_vocab_size=14, tgt_vocab_size=14, d_model=16, n_heads=2, d_ff=32,
                          n_encoder_layers=1, n_decoder_layers=1, max_len=16,
                          tie_embeddings="all"),
        train=TrainConfig(max_tokens=128, warmup_steps=5, bf16="false", seed=0, **train)
    ).validate()


@pytest.mark.parametrize("task", sorted(TASKS))
def test_digit_pairs_are_distinct_and_answered_by_the_task(task):
    pairs = digit_pairs(task, 300, lengths=(2, 5), seed=3)
    sources = [s for s, _ in pairs]
    assert len(set(sources)) == 300
    for source, target in pairs:
        digits = source.split()
        assert 2 <= len(digits) <= 5 and all(d in "0123456789" for d in digits)
        assert target.split() == {"reverse": digits[::-1], "sort": sorted(digits),
                                  "copy": digits}[task]
    assert digit_pairs(task, 300, lengths=(2, 5), seed=3) == pairs  # the seed fixes them


def test_digit_pairs_refuse_an_unknown_task():
    with pytest.raises(ValueError, match="unknown task 'shuffle'; one of reverse, sort, copy"):
        digit_pairs("shuffle", 10)


def test_train_toy_records_every_step_and_evaluation_repeatably_and_calls_the_change():
    pairs = digit_pairs("copy", 220, seed=0)
    threads = torch.get_num_threads()
    changed = []

    def change(model):
        changed.append(model)

    seen_at = []
    run = train_toy(tiny(), pairs[:200], pairs[200:], steps=6, eval_every=3, change=change,
                    on_eval=lambda r, step: seen_at.append(step))
    assert changed == [run.model] and seen_at == [0, 3, 6]
    assert [r["step"] for r in run.records if "loss" in r] == list(range(1, 7))
    assert [r["step"] for r in run.evaluations()] == [0, 3, 6]
    assert all(0.0 <= r["exact"] <= 1.0 and r["dev_nll"] > 0 and r["dev_loss"] > 0
               for r in run.evaluations())
    assert run.seconds > 0 and not run.model.training
    assert torch.get_num_threads() == threads  # its one thread is given back
    again = train_toy(tiny(), pairs[:200], pairs[200:], steps=6, eval_every=3)
    assert again.records == run.records  # one seed, one thread: the same run
    assert run.translate([pairs[0][0]]) == again.translate([pairs[0][0]])


def test_train_toy_stops_where_the_loss_stops_being_finite():
    pairs = digit_pairs("copy", 220, seed=0)

    def poison(model):
        with torch.no_grad():
            model.encoder.layers[0].feed_forward.linear1.weight.fill_(float("nan"))

    run = train_toy(tiny(), pairs[:200], pairs[200:], steps=5, eval_every=5, change=poison)
    assert [r["step"] for r in run.records if "loss" in r] == [1]
    assert run.last("loss") != run.last("loss")  # nan


def test_token_confidence_of_a_model_is_its_own_top_probability():
    pairs = digit_pairs("copy", 220, seed=0)
    run = train_toy(tiny(), pairs[:200], pairs[200:], steps=3, eval_every=3)
    confidence = token_confidence(run.model, run.tokenizers, pairs[200:])
    src = torch.tensor(run.tokenizers.encode_src([pairs[200][0]]))
    tgt = torch.tensor(run.tokenizers.encode_tgt([pairs[200][1]]))
    with torch.no_grad():
        probs = run.model(src, tgt[:, :-1]).softmax(dim=-1)[0]
    one = token_confidence(run.model, run.tokenizers, pairs[200:201])
    assert one.top == pytest.approx(float(probs.max(dim=-1).values.mean()), rel=1e-5)
    assert one.right == pytest.approx(float(probs.argmax(dim=-1).eq(tgt[0, 1:]).float().mean()))
    top = probs.max(dim=-1).values
    assert one.sure == pytest.approx(float(top.gt(SURE).float().mean()))
    # over pairs of several lengths (padded together): the mean over every real position
    # of every pair, padding left out
    tops = []
    for source, target in pairs[200:]:
        src = torch.tensor(run.tokenizers.encode_src([source]))
        tgt = torch.tensor(run.tokenizers.encode_tgt([target]))
        with torch.no_grad():
            tops += run.model(src, tgt[:, :-1]).softmax(dim=-1)[0].max(dim=-1).values.tolist()
    assert confidence.top == pytest.approx(sum(tops) / len(tops), rel=1e-5)
