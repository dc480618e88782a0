"""Length-bucketed token-budget batches (aiayn.data.batching): padding, sharding, exact
resume, collate and the one batcher, token_batches."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from aiayn.data.batching import (
    Example,
    TokenBatchSampler,
    collate,
    length_curriculum,
    length_multiple,
    token_batches,
)
from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from aiayn.errors import AiaynError


# ------------------------------------------------------------------ TokenBatchSampler
def random_lengths(n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    src = [rng.randint(2, 60) for _ in range(n)]
    tgt = [max(3, s + rng.randint(-8, 8)) for s in src]
    return src, tgt


def test_batches_respect_the_budget_and_cover_every_example_once():
    src, tgt = random_lengths(1000)
    sampler = TokenBatchSampler(src, tgt, max_tokens=500, seed=3)
    batches = list(sampler)
    assert len(batches) == len(sampler)
    for batch in batches:
        assert len(batch) * max(max(src[i], tgt[i]) for i in batch) <= 500
    flat = [i for batch in batches for i in batch]
    assert sorted(flat) == list(range(1000))


def test_epochs_shuffle_batch_order_not_contents():
    src, tgt = random_lengths(500)
    sampler = TokenBatchSampler(src, tgt, max_tokens=400, seed=3)
    first, second = list(sampler), list(sampler)  # the iterator moves to epoch 1 by itself
    assert sampler.epoch == 2
    assert first != second and sorted(map(tuple, first)) == sorted(map(tuple, second))
    again = TokenBatchSampler(src, tgt, max_tokens=400, seed=3)
    assert list(again) == first  # same seed, same epoch: same order
    other_seed = TokenBatchSampler(src, tgt, max_tokens=400, seed=4)
    assert list(other_seed) != first
    ordered = TokenBatchSampler(src, tgt, max_tokens=400, shuffle=False)
    widths = [max(max(src[i], tgt[i]) for i in b) for b in ordered]
    assert widths == sorted(widths)


@pytest.mark.parametrize("world_size", [2, 3, 4, 7])
def test_sharding_sees_every_example_once_with_equal_batch_counts(world_size):
    src, tgt = random_lengths(997, seed=world_size)
    samplers = [TokenBatchSampler(src, tgt, max_tokens=700, seed=5, rank=r,
                                  world_size=world_size) for r in range(world_size)]
    for epoch in (0, 1):
        per_rank = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            per_rank.append(list(sampler))
        assert len({len(batches) for batches in per_rank}) == 1
        assert all(len(b) == len(s) for b, s in zip(per_rank, samplers, strict=True))
        flat = [i for batches in per_rank for batch in batches for i in batch]
        assert sorted(flat) == list(range(997))
        for batches in per_rank:
            for batch in batches:
                assert len(batch) * max(max(src[i], tgt[i]) for i in batch) <= 700


def test_sharding_splits_batches_until_the_count_divides():
    src, tgt = [10] * 30, [10] * 30  # 3 batches of 10 at max_tokens=100
    assert len(TokenBatchSampler(src, tgt, 100)) == 3
    samplers = [TokenBatchSampler(src, tgt, 100, rank=r, world_size=4) for r in range(4)]
    assert [len(s) for s in samplers] == [1, 1, 1, 1]
    assert sorted(i for s in samplers for b in s for i in b) == list(range(30))
    with pytest.raises(AiaynError, match="cannot"):
        TokenBatchSampler([5, 5], [5, 5], 100, rank=0, world_size=3)


def test_resume_continues_exactly():
    src, tgt = random_lengths(800)
    full = TokenBatchSampler(src, tgt, 300, seed=9)
    epoch0, epoch1 = list(full), list(full)

    sampler = TokenBatchSampler(src, tgt, 300, seed=9)
    sampler.set_epoch(0)
    it = iter(sampler)
    seen = [next(it) for _ in range(5)]
    state = sampler.state_dict()
    assert state["epoch"] == 0 and state["batches_yielded"] == 5

    resumed = TokenBatchSampler(src, tgt, 300, seed=9)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    resumed.set_epoch(0)  # a training loop's usual call keeps the restored position
    assert seen + list(resumed) == epoch0
    resumed.set_epoch(1)
    assert list(resumed) == epoch1


def test_resume_refuses_another_layout():
    src, tgt = random_lengths(300)
    state = TokenBatchSampler(src, tgt, 300).state_dict()
    with pytest.raises(AiaynError, match="world_size"):
        TokenBatchSampler(src, tgt, 300, rank=0, world_size=2).load_state_dict(state)


def test_example_longer_than_the_budget_is_refused_up_front():
    with pytest.raises(AiaynError, match="train.max_tokens=50"):
        TokenBatchSampler([10, 60], [10, 10], 50)


# ------------------------------------------------------------------ collate
def test_collate_pads_and_shifts():
    examples = [Example([5, 6, 7, EOS_ID], [BOS_ID, 8, 9, EOS_ID], 4),
                Example([5, EOS_ID], [BOS_ID, 8, 9, 10, 11, EOS_ID], 7)]
    batch = collate(examples)
    assert batch.src.tolist() == [[5, 6, 7, EOS_ID], [5, EOS_ID, PAD_ID, PAD_ID]]
    assert batch.tgt_in.tolist() == [[BOS_ID, 8, 9, PAD_ID, PAD_ID],
                                     [BOS_ID, 8, 9, 10, 11]]
    assert batch.tgt_out.tolist() == [[8, 9, EOS_ID, PAD_ID, PAD_ID],
                                      [8, 9, 10, 11, EOS_ID]]
    assert batch.n_tokens == 8 and batch.index.tolist() == [4, 7]
    assert batch.src.dtype == batch.tgt_in.dtype == batch.index.dtype == torch.long
    assert len(batch) == 2 and batch.to("cpu").src.equal(batch.src)


def test_collate_rounds_lengths_up_to_a_multiple_with_padding_only():
    examples = [Example([5, 6, 7, EOS_ID], [BOS_ID, 8, 9, EOS_ID], 4),
                Example([5, EOS_ID], [BOS_ID, 8, 9, 10, 11, EOS_ID], 7)]
    plain, padded = collate(examples), collate(examples, multiple=16)
    assert padded.src.shape == padded.tgt_in.shape == padded.tgt_out.shape == (2, 16)
    for name in ("src", "tgt_in", "tgt_out"):
        a, b = getattr(plain, name), getattr(padded, name)
        assert b[:, : a.size(1)].equal(a) and (b[:, a.size(1):] == PAD_ID).all()
    assert padded.n_tokens == plain.n_tokens == 8
    # a length already on the multiple is left as it is
    assert collate(examples, multiple=4).src.shape == (2, 4)
    assert length_multiple(bf16=False) == 1 and length_multiple(bf16=True) % 8 == 0


# ------------------------------------------------------------------ token_batches
def test_token_batches_cover_every_sentence_once_within_the_padded_budget():
    rng = random.Random(0)
    lengths = [rng.randint(1, 30) for _ in range(200)] + [100]
    batches = token_batches(lengths, max_tokens=120, copies=2)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        longest = max(lengths[i] for i in batch)
        assert len(batch) == 1 or len(batch) * longest * 2 <= 120
    assert [len(b) for b in batches if lengths[b[0]] == 100] == [1]


# ------------------------------------------------------------------ the length curriculum
def test_a_length_curriculum_widens_from_the_narrowest_batches_to_all():
    rng = random.Random(0)
    widths = [rng.randint(3, 90) for _ in range(400)]
    order = length_curriculum(widths, 0.1, random.Random(1))
    assert sorted(order) == list(range(400))  # each batch once
    ranked = sorted(widths)
    for p, b in enumerate(order):  # step p draws among the narrowest ceil(c(p) n)
        allowed = math.ceil(min(1.0, math.sqrt(0.01 + 0.99 * p / 400)) * 400)
        assert widths[b] <= ranked[allowed - 1]
    first, last = [widths[b] for b in order[:40]], [widths[b] for b in order[-40:]]
    assert sum(first) / 40 < sum(widths) / 400 < sum(last) / 40
    assert length_curriculum(widths, 0.1, random.Random(1)) == order  # its rng decides
    assert length_curriculum(widths, 0.1, random.Random(2)) != order
    assert length_curriculum(widths, 1.0, random.Random(1)) != order  # start 1: all at once


def test_a_curriculum_orders_the_first_epoch_only_and_resumes_exactly():
    src, tgt = random_lengths(900)
    plain = TokenBatchSampler(src, tgt, 300, seed=9)
    sampler = TokenBatchSampler(src, tgt, 300, seed=9, curriculum_start=0.1)
    first, second = list(sampler), list(sampler)
    assert sorted(map(tuple, first)) == sorted(map(tuple, list(plain)))  # the same batches
    assert second == list(plain)  # epoch 1: shuffled as without a curriculum

    def width(batch):
        return max(max(src[i], tgt[i]) for i in batch)
    tenth = len(first) // 10
    assert sum(map(width, first[:tenth])) < sum(map(width, first[-tenth:]))

    again = TokenBatchSampler(src, tgt, 300, seed=9, curriculum_start=0.1)
    it = iter(again)
    seen = [next(it) for _ in range(7)]
    state = json.loads(json.dumps(again.state_dict()))
    resumed = TokenBatchSampler(src, tgt, 300, seed=9, curriculum_start=0.1)
    resumed.load_state_dict(state)
    assert seen + list(resumed) == first
    for other in (None, 0.3):  # another curriculum would take other batches of the pass
        with pytest.raises(AiaynError, match="first pass's batch order"):
            TokenBatchSampler(src, tgt, 300, seed=9, curriculum_start=other).load_state_dict(state)
    state["epoch"], state["batches_yielded"] = 1, 0  # later passes are the same either way
    TokenBatchSampler(src, tgt, 300, seed=9).load_state_dict(state)


def test_ranks_share_one_curriculum_order():
    src, tgt = random_lengths(997, seed=3)
    two = [TokenBatchSampler(src, tgt, 700, seed=5, rank=r, world_size=2, curriculum_start=0.2)
           for r in range(2)]
    per_rank = [list(s) for s in two]
    flat = sorted(i for batches in per_rank for batch in batches for i in batch)
    assert flat == list(range(997)) and len(per_rank[0]) == len(per_rank[1])
    widths = [[max(max(src[i], tgt[i]) for i in b) for b in batches] for batches in per_rank]
    for w in widths:  # both ranks start on narrow batches
        assert sum(w[:len(w) // 10]) < sum(w[-(len(w) // 10):])
