"""Greedy and beam search: equivalences that pin down what each search returns."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from search_helpers import random_sources, sequence_log_probs, tiny_model

from aiayn.config import ModelConfig
from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from aiayn.inference.joinable import JoinableSearch
from aiayn.inference.search import (
    Sampling,
    Search,
    beam_search,
    greedy_decode,
    next_distribution,
)
from aiayn.inference.steps import NEVER_GENERATED, length_penalty, output_limits, source_lengths
from aiayn.model import Transformer


def exhaustive_search(model: Transformer, src: torch.Tensor, limit: int, alpha: float):
    """Every hypothesis the searches may return, scored: EOS-terminated ones of up to
    ``limit`` tokens (EOS counted), and ``limit`` tokens without EOS (cut at the limit)."""
    vocab = model.cfg.tgt_vocab_size
    words = [t for t in range(vocab) if t not in NEVER_GENERATED and t != EOS_ID]
    hyps, ended, lengths = [], [], []
    for n in range(limit):
        for prefix in itertools.product(words, repeat=n):
            hyps.append(list(prefix)), ended.append(True), lengths.append(n + 1)
    for prefix in itertools.product(words, repeat=limit):
        hyps.append(list(prefix)), ended.append(False), lengths.append(limit)
    log_p = sequence_log_probs(model, src, hyps, ended)
    scores = log_p / length_penalty(torch.tensor(lengths, dtype=torch.float), alpha)
    order = scores.argsort(descending=True)
    return [(hyps[i], float(scores[i])) for i in order.tolist()]


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_beam_of_one_is_greedy(alpha):
    model = tiny_model()
    src = random_sources([7, 3, 9, 5, 2, 8, 4, 6, 10, 3, 5, 7], vocab=24)
    greedy = greedy_decode(model, src, max_len_b=10)
    beam = beam_search(model, src, beam=1, alpha=alpha, max_len_b=10)
    assert [hyps[0][0] for hyps in beam] == greedy
    limits = output_limits(model, source_lengths(src.eq(PAD_ID)), Search(max_len_b=10)).tolist()
    assert sum(len(g) < n for g, n in zip(greedy, limits)) >= 4, "many should end by EOS"


def test_the_length_limit_is_the_formula_in_float64_as_ctranslate2_computes_it():
    """floor(max_len_a x length) + max_len_b, capped by the positions, for fractional a too:
    the product in float32 put some limits a token off (a = 1.3 and 90 tokens: 116.99998
    -> 116), where the CTranslate2 engine takes Python's floor of the float64 product."""
    model = tiny_model(max_len=512)
    lengths = np.arange(0, 200)
    for a in (0.7, 1.05, 1.3, 1.5, 2.0):
        limits = output_limits(model, lengths, Search(max_len_a=a, max_len_b=3)).tolist()
        assert limits == [max(1, min(math.floor(a * n) + 3, model.cfg.max_len - 1)) for n in lengths]
    assert output_limits(model, np.array([90]), Search(max_len_a=1.3, max_len_b=0)).tolist() == [117]


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.5])
def test_wide_beam_is_exhaustive_search(alpha):
    # 7 tokens, of which PAD and BOS are never generated: UNK, EOS and three words remain.
    # A source of 3 ids + max_len_b 1 allows at most 4 tokens: 1 + 4 + 16 + 64 hypotheses
    # end in EOS and 256 are cut at the limit, 341 in all; a beam of 341 keeps every one.
    model = tiny_model(vocab=7, eos_bias=0.5, sharpness=1.0, seed=3)
    narrow_beam_missed = 0
    for seed in range(4):
        src = random_sources([3], vocab=7, seed=seed)
        expected = exhaustive_search(model, src, limit=4, alpha=alpha)[:5]
        got = beam_search(model, src, beam=341, alpha=alpha, max_len_b=1, nbest=5)[0]
        assert [h.ids for h in got] == [ids for ids, _ in expected]
        assert [h.score for h in got] == pytest.approx([s for _, s in expected], abs=1e-5)
        narrow = beam_search(model, src, beam=5, alpha=alpha, max_len_b=1, nbest=5)[0]
        narrow_beam_missed += [h.ids for h in narrow] != [ids for ids, _ in expected]
    if alpha > 0:  # the comparison has teeth: a narrow beam does prune hypotheses here
        assert narrow_beam_missed > 0


def test_beam_scores_are_normalised_log_probs_of_the_returned_hypotheses():
    model = tiny_model()
    src = random_sources([6, 4], vocab=24)
    results = beam_search(model, src, beam=4, alpha=0.6, max_len_b=6, nbest=4)
    limits = output_limits(model, source_lengths(src.eq(PAD_ID)), Search(max_len_b=6)).tolist()
    for i, hyps in enumerate(results):
        assert len(hyps) == 4
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        assert len({tuple(h.ids) for h in hyps}) == 4
        ids = [h.ids for h in hyps]
        ended = [len(h) < limits[i] for h in ids]  # shorter than the limit: ended by EOS
        log_p = sequence_log_probs(model, src[i : i + 1], ids, ended)
        lengths = torch.tensor([len(h) + e for h, e in zip(ids, ended)], dtype=torch.float)
        expected = log_p / length_penalty(lengths, 0.6)
        assert [h.score for h in hyps] == pytest.approx(expected.tolist(), abs=1e-5)


def test_beam_search_finds_hypotheses_at_least_as_good_as_greedy():
    model = tiny_model(seed=5)
    src = random_sources([5, 8, 3, 6], vocab=24, seed=2)
    greedy = beam_search(model, src, beam=1, alpha=0.0, max_len_b=8)
    wide = beam_search(model, src, beam=6, alpha=0.0, max_len_b=8)
    for g, w in zip(greedy, wide):
        assert w[0][1] >= g[0][1] - 1e-6


@pytest.mark.parametrize("beam", [1, 4])
def test_batched_decoding_equals_one_by_one(beam):
    model = tiny_model(seed=2)
    lengths = [9, 2, 6, 4, 7]
    src = random_sources(lengths, vocab=24, seed=4)
    batched = beam_search(model, src, beam=beam, max_len_b=8, nbest=beam)
    greedy_batched = greedy_decode(model, src, max_len_b=8)
    for i, n in enumerate(lengths):
        alone = src[i : i + 1, :n]  # no padding at all
        single = beam_search(model, alone, beam=beam, max_len_b=8, nbest=beam)[0]
        assert [h.ids for h in batched[i]] == [h.ids for h in single]
        assert [h.score for h in batched[i]] == pytest.approx([h.score for h in single], abs=1e-5)
        assert greedy_batched[i] == greedy_decode(model, alone, max_len_b=8)[0]


def test_cached_decoding_equals_recomputing_the_prefix():
    model = tiny_model(seed=7)
    src = random_sources([5, 9, 3], vocab=24, seed=6)
    assert greedy_decode(model, src, 8, use_cache=True) == greedy_decode(model, src, 8,
                                                                         use_cache=False)
    cached = beam_search(model, src, beam=3, max_len_b=8, nbest=3, use_cache=True)
    recomputed = beam_search(model, src, beam=3, max_len_b=8, nbest=3, use_cache=False)
    for c, r in zip(cached, recomputed):
        assert [h.ids for h in c] == [h.ids for h in r]
        assert [h.score for h in c] == pytest.approx([h.score for h in r], abs=1e-5)


def test_incremental_logits_equal_a_full_forward_after_a_beam_reorder():
    model = tiny_model(seed=8)
    src = random_sources([6, 4], vocab=24, seed=8).repeat_interleave(3, dim=0)  # 2 x 3 beams
    src_pad = model.src_pad_mask(src)
    g = torch.Generator().manual_seed(0)
    prefix = torch.cat([torch.full((6, 1), BOS_ID), torch.randint(4, 24, (6, 5), generator=g)], 1)
    with torch.no_grad():
        memory = model.encode(src, src_pad)
        cache = model.new_cache()
        for t in range(3):
            model.decode(prefix[:, t : t + 1], memory, src_pad, cache)
        # Beam-style reorder: each sentence's beams follow parents within the sentence.
        rows = torch.tensor([2, 2, 0, 4, 3, 3])
        cache.reorder(rows)
        prefix = prefix.index_select(0, rows)
        steps = [model.decode(prefix[:, t : t + 1], memory, src_pad, cache) for t in range(3, 6)]
        incremental = model.generator(torch.cat(steps, dim=1))
        full = model(src, prefix)[:, 3:6]
    torch.testing.assert_close(incremental, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_outputs_stop_at_source_length_plus_b_and_at_max_len(search):
    model = tiny_model(eos_bias=-1e4, max_len=12)  # never chooses EOS: always hits the limit
    src = random_sources([2, 5, 11], vocab=24)
    if search == "greedy":
        outputs = greedy_decode(model, src, max_len_b=3)
    else:
        outputs = [hyps[0][0] for hyps in beam_search(model, src, beam=3, max_len_b=3)]
    # 2 + 3 = 5 and 5 + 3 = 8 new tokens; 11 + 3 is capped at max_len - 1 = 11.
    assert [len(o) for o in outputs] == [5, 8, 11]
    assert all(t not in (PAD_ID, BOS_ID, EOS_ID) for o in outputs for t in o)


def test_bad_beam_arguments_are_refused():
    model = tiny_model()
    src = random_sources([3], vocab=24)
    with pytest.raises(ValueError, match="beam"):
        beam_search(model, src, beam=0)
    with pytest.raises(ValueError, match="nbest"):
        beam_search(model, src, beam=2, nbest=3)


def run_joining(search: JoinableSearch, src: torch.Tensor, lengths: list[int],
                plan: dict[int, list[int]]) -> tuple[dict, int]:
    """Add sentence i (unpadded) at the step ``plan`` names and step until all are done;
    their lists by index, and the most sentences that were decoded in one step."""
    got, step, most = {}, 0, 0
    while len(got) < len(lengths):
        for i in plan.get(step, []):
            search.add([i], src[i : i + 1, : lengths[i]])
        most = max(most, len(search))
        for key, hyps in search.step():
            assert key not in got
            got[key] = hyps
        step += 1
        assert step < 100, "the search never ended"
    return got, most


@pytest.mark.parametrize("beam, alpha, eos_bias", [(1, 0.6, 0.0), (4, 0.6, 0.0), (3, 0.0, 1.0),
                                                   (5, 1.5, 0.0), (4, 0.6, 4.0)])
def test_sentences_joining_a_running_search_get_what_beam_search_gives_them_alone(
        beam, alpha, eos_bias):
    """Sentences of other lengths join at other steps (several at once, one while the
    others are half done, one after the search had emptied): each gets beam_search's
    n-best list of it alone, and greedy search's tokens at beam 1."""
    model = tiny_model(seed=2, eos_bias=eos_bias)
    lengths = [9, 2, 6, 4, 7, 3, 11, 5, 8]
    src = random_sources(lengths, vocab=24, seed=4)
    plan = {0: [0, 1], 1: [2], 3: [3, 4, 5], 4: [6], 7: [7], 30: [8]}
    got, most = run_joining(JoinableSearch(model, Search(beam, alpha, max_len_b=8)), src, lengths,
                            plan)
    assert most >= 4  # sentences did decode together
    outputs = []
    for i, n in enumerate(lengths):
        alone = beam_search(model, src[i : i + 1, :n], beam=beam, alpha=alpha, max_len_b=8,
                            nbest=beam)[0]
        assert [h.ids for h in got[i]] == [h.ids for h in alone], i
        assert [h.score for h in got[i]] == pytest.approx([h.score for h in alone], abs=1e-5)
        outputs.extend(h.ids for h in got[i])
        if beam == 1:
            assert got[i][0].ids == greedy_decode(model, src[i : i + 1, :n], max_len_b=8)[0]
    if eos_bias == 4.0:  # a sentence whose best ends at once: EOS at the first step
        assert any(hyps[0].ids == [] for hyps in got.values())
    else:
        assert len({len(ids) for ids in outputs}) >= 4  # hypotheses of many lengths


@pytest.mark.parametrize("beam", [1, 3])
def test_joining_sentences_stop_at_their_own_length_limit(beam):
    model = tiny_model(eos_bias=-1e4, max_len=12)  # never chooses EOS: always hits the limit
    lengths = [2, 5, 11, 3]
    src = random_sources(lengths, vocab=24)
    got, _ = run_joining(JoinableSearch(model, Search(beam, 0.6, max_len_b=3)), src, lengths,
                         {0: [0], 2: [1, 2], 6: [3]})
    # 2 + 3, 5 + 3, 11 + 3 capped at max_len - 1 = 11, 3 + 3 new tokens.
    assert [len(got[i][0].ids) for i in range(4)] == [5, 8, 11, 6]
    for i, n in enumerate(lengths):
        alone = beam_search(model, src[i : i + 1, :n], beam=beam, max_len_b=3, nbest=beam)[0]
        assert [h.ids for h in got[i]] == [h.ids for h in alone]


def test_a_search_that_sentences_keep_joining_stays_as_long_as_its_oldest():
    """The cache drops the columns from before every live sentence joined: it never grows
    past the longest output however long the search runs; and its cross-attention spans
    the longest source still live, not the longest it ever held."""
    model = tiny_model(seed=4, eos_bias=1.0, max_len=16)
    lengths = [4, 6, 3, 5, 9] * 8
    src = random_sources(lengths, vocab=24, seed=9)
    search = JoinableSearch(model, Search(2, 0.6, max_len_b=4))
    steps, longest, live, narrower = 0, 0, set(), 0
    for i, n in enumerate(lengths):  # one sentence joins every step
        search.add([i], src[i : i + 1, :n])
        live.add(i)
        live -= {key for key, _ in search.step()}
        steps += 1
        longest = max(longest, search.state.cache.length, search.rows.history.shape[1])
        width = max(lengths[key] for key in live) if live else 0
        cross = search.state.cache.layers[0]["cross"]["k"]
        assert search.state.src_pad.size(1) == width and cross.size(2) == width, i
        narrower += width < max(lengths)
    assert steps == 40 and longest <= max(lengths) + 4 and narrower > 10


@pytest.mark.parametrize("beam", [1, 4])
def test_sentences_taken_out_mid_search_leave_the_others_as_they_were_alone(beam):
    """Sentences removed at several steps (one just joined, one half done, unknown keys,
    then all that were left): the others get what beam_search gives them alone, the removed
    are never answered, and an emptied search takes new sentences."""
    model = tiny_model(seed=3)
    lengths = [7, 3, 9, 5, 6, 4]
    src = random_sources(lengths, vocab=24, seed=6)
    search = JoinableSearch(model, Search(beam, 0.6, max_len_b=8))
    got, removes = {}, {1: [4], 2: [1, 99], 5: [3]}
    for step in range(60):
        if step in (0, 1):
            for i in ([0, 1, 2] if step == 0 else [3, 4]):
                search.add([i], src[i : i + 1, : lengths[i]])
        search.remove(removes.get(step, []))
        got.update(search.step())
    assert set(got) == {0, 2} and not len(search)
    for i in got:
        alone = beam_search(model, src[i : i + 1, : lengths[i]], beam=beam, alpha=0.6,
                            max_len_b=8, nbest=beam)[0]
        assert [h.ids for h in got[i]] == [h.ids for h in alone]
        assert [h.score for h in got[i]] == pytest.approx([h.score for h in alone], abs=1e-5)
    search.add([5], src[5:6, : lengths[5]])
    search.remove([5])
    assert not len(search) and not search.finished and search.step() == []
    search.add([5], src[5:6, : lengths[5]])  # the same key again, once it has left
    while not (done := search.step()):
        pass
    assert [h.ids for h in done[0][1]] == [h.ids for h in beam_search(
        model, src[5:6, : lengths[5]], beam=beam, alpha=0.6, max_len_b=8, nbest=beam)[0]]


def test_a_joinable_search_refuses_a_key_twice():
    model = tiny_model()
    search = JoinableSearch(model, Search(2))
    src = random_sources([3, 4], vocab=24)
    search.add([0], src[:1])
    with pytest.raises(ValueError, match="key"):
        search.add([0], src[1:])
    with pytest.raises(ValueError, match="beam"):
        JoinableSearch(model, Search(0))


# ---------------------------------------------------------------- the repetition guard
def looping_model(seed: int = 0) -> Transformer:
    """A random model that rarely ends (EOS biased down), so that long outputs repeat."""
    return tiny_model(vocab=12, eos_bias=-3.0, sharpness=4.0, seed=seed)


def has_repeat(ids: list[int], n: int) -> bool:
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) < len(grams)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_search_with_the_guard_emits_a_repeated_ngram(n):
    model = looping_model()
    src = random_sources([6, 9, 4, 8], vocab=12, seed=3)
    plain = greedy_decode(model, src, max_len_b=10)
    assert sum(has_repeat(ids, n) for ids in plain) >= 2  # the guard has work to do
    greedy = greedy_decode(model, src, max_len_b=10, no_repeat_ngram=n)
    beams = beam_search(model, src, beam=3, max_len_b=10, nbest=3, no_repeat_ngram=n)
    assert not any(has_repeat(ids, n) for ids in greedy)
    assert not any(has_repeat(h.ids, n) for hyps in beams for h in hyps)
    # Beam 1 is greedy search with the guard too.
    one = beam_search(model, src, beam=1, max_len_b=10, no_repeat_ngram=n)
    assert [hyps[0].ids for hyps in one] == greedy


def test_the_guard_changes_nothing_where_no_repetition_arises():
    model = tiny_model(seed=2)
    src = random_sources([9, 2, 6, 4, 7], vocab=24, seed=4)
    # An n longer than any output can be: nothing ever repeats, so nothing is banned.
    for beam in (1, 4):
        plain = beam_search(model, src, beam=beam, max_len_b=8, nbest=beam)
        guarded = beam_search(model, src, beam=beam, max_len_b=8, nbest=beam,
                              no_repeat_ngram=20)
        assert plain == guarded  # the same kernels on both sides: exactly equal
    # Greedy: an output without a repeated n-gram never met a ban on its way.
    plain = greedy_decode(model, src, max_len_b=8)
    guarded = greedy_decode(model, src, max_len_b=8, no_repeat_ngram=3)
    clean = [i for i, ids in enumerate(plain) if not has_repeat(ids, 3)]
    assert len(clean) >= 3 and all(guarded[i] == plain[i] for i in clean)


@pytest.mark.parametrize("beam", [1, 3])
def test_a_joined_search_with_the_guard_equals_one_by_one(beam):
    model = looping_model(seed=1)
    lengths = [6, 3, 8, 5, 7]
    src = random_sources(lengths, vocab=12, seed=5)
    search = JoinableSearch(model, Search(beam, 0.6, 2, max_len_b=8))
    got, most = run_joining(search, src, lengths, {0: [0, 1], 2: [2], 5: [3, 4]})
    assert most >= 3
    changed = 0
    for i, n in enumerate(lengths):
        alone = beam_search(model, src[i : i + 1, :n], beam=beam, max_len_b=8, nbest=beam,
                            no_repeat_ngram=2)[0]
        assert [h.ids for h in got[i]] == [h.ids for h in alone]
        assert [h.score for h in got[i]] == pytest.approx([h.score for h in alone], abs=1e-5)
        plain = beam_search(model, src[i : i + 1, :n], beam=beam, max_len_b=8)[0]
        changed += plain[0].ids != alone[0].ids
    assert changed >= 2  # the guard did change outputs


# ---------------------------------------------------------------- sampling
def samples(model, src, n=3, max_len_b=8, **settings):
    return beam_search(model, src, beam=n, max_len_b=max_len_b, nbest=n,
                       sampling=Sampling(**{"seed": 7, **settings}))


def test_sampling_with_a_seed_is_reproducible_and_independent_of_the_batch():
    model = tiny_model(seed=2, eos_bias=0.0)
    lengths = [9, 2, 6, 4, 7]
    src = random_sources(lengths, vocab=24, seed=4)
    first = samples(model, src, temperature=1.5)
    assert first == samples(model, src, temperature=1.5)
    other = samples(model, src, temperature=1.5, seed=8)
    assert [h.ids for hyps in first for h in hyps] != [h.ids for hyps in other for h in hyps]
    texts = {tuple(h.ids) for hyps in first for h in hyps}
    assert len(texts) >= 10  # they do differ from sample to sample
    for i, n in enumerate(lengths[::-1]):  # alone, and in another order: the same samples
        i = len(lengths) - 1 - i
        alone = samples(model, src[i : i + 1, :n], temperature=1.5)[0]
        assert [h.ids for h in alone] == [h.ids for h in first[i]]
        assert [h.score for h in alone] == pytest.approx([h.score for h in first[i]], abs=1e-5)
    # A sample's score is the model's log-probability of it, over the length penalty.
    limits = output_limits(model, source_lengths(src.eq(PAD_ID)), Search(max_len_b=8)).tolist()
    for i, hyps in enumerate(first):
        ids = [h.ids for h in hyps]
        ended = [len(h) < limits[i] for h in ids]
        log_p = sequence_log_probs(model, src[i : i + 1], ids, ended)
        lengths_ = torch.tensor([len(h) + e for h, e in zip(ids, ended)], dtype=torch.float)
        assert [h.score for h in hyps] == pytest.approx(
            (log_p / length_penalty(lengths_, 0.6)).tolist(), abs=1e-4)


@pytest.mark.parametrize("settings", [{"top_k": 1}, {"temperature": 1e-4}, {"top_p": 1e-6},
                                      {"top_k": 1, "temperature": 5.0}])
def test_sampling_that_keeps_only_the_likeliest_piece_is_greedy_search(settings):
    model = tiny_model(seed=5)
    src = random_sources([5, 8, 3, 6, 7], vocab=24, seed=2)
    greedy = greedy_decode(model, src, max_len_b=8)
    for hyps in samples(model, src, n=2, **settings):
        assert len(hyps) == 2
    assert [hyps[0].ids for hyps in samples(model, src, n=2, **settings)] == greedy
    assert all(hyps[1].ids == hyps[0].ids for hyps in samples(model, src, n=2, **settings))


def test_sampling_draws_from_the_cut_distribution():
    """top-k: no sample holds a piece outside the k likeliest at its step; the draws of
    many samples follow the model's first-step distribution."""
    model = tiny_model(seed=3, eos_bias=-1e4, sharpness=1.0)
    src = random_sources([4], vocab=24, seed=1)
    got = samples(model, src, n=400, max_len_b=1, top_k=3)[0]
    probs, ids = next_distribution(model, src, [], Sampling())
    top3 = set(ids[:3].tolist())
    first = [h.ids[0] for h in got]
    assert set(first) <= top3 and len(set(first)) == 3
    expected = probs[:3] / probs[:3].sum()
    share = torch.tensor([first.count(int(t)) / len(first) for t in ids[:3]])
    assert torch.allclose(share, expected, atol=0.08)  # 400 draws: about 2.5 sigma


def test_a_joined_sampling_search_equals_one_by_one():
    model = tiny_model(seed=2, eos_bias=1.0)
    lengths = [9, 2, 6, 4, 7, 3]
    src = random_sources(lengths, vocab=24, seed=4)
    sampling = Sampling(temperature=1.3, top_p=0.9, seed=11)
    search = JoinableSearch(model, Search(3, 0.6, 2, sampling, max_len_b=8))
    got, most = run_joining(search, src, lengths, {0: [0, 1], 1: [2], 3: [3, 4], 9: [5]})
    assert most >= 3
    for i, n in enumerate(lengths):
        alone = beam_search(model, src[i : i + 1, :n], beam=3, max_len_b=8, nbest=3,
                            no_repeat_ngram=2, sampling=sampling)[0]
        assert [h.ids for h in got[i]] == [h.ids for h in alone]
        assert not any(has_repeat(h.ids, 2) for h in alone)


def test_under_autocast_a_restricted_output_layer_is_cast_once_per_search(monkeypatch):
    """A restricted output layer's rows are a selection, which autocast does not keep cast:
    the search casts them once (``allowed_rows(dtype)``), every step computes with that one bf16
    matrix, and the hypotheses and scores are those of autocast casting it each step."""
    import torch.nn.functional as F

    from aiayn.inference.search import decode_beam

    torch.manual_seed(0)
    cfg = ModelConfig(src_vocab_size=40, tgt_vocab_size=40, d_model=16, n_heads=2, d_ff=32,
                      n_encoder_layers=1, n_decoder_layers=2, dropout=0.0, max_len=32,
                      output_vocab="targets")
    model = Transformer(cfg).eval()
    model.generator.set_outputs(torch.tensor([EOS_ID, *range(4, 30)]))
    src = random_sources([7, 5, 3], 40)
    seen = []

    def kernel(hidden, weight, bias):
        seen.append((weight.dtype, weight.data_ptr()))
        return F.linear(hidden, weight, bias)

    search = Search(beam=3, alpha=0.6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        once = decode_beam(model, src, search, kernel=kernel)
        assert len(seen) > 3 and set(seen) == {(torch.bfloat16, seen[0][1])}
        rows = model.generator.allowed_rows
        monkeypatch.setattr(model.generator, "allowed_rows", lambda dtype=None: rows())
        every_step = decode_beam(model, src, search, kernel=kernel)
    assert once == every_step
    assert seen[-1][0] == torch.float32  # ... where each step's product cast the fp32 rows
    # Without autocast the rows are the fp32 selection, as before.
    assert decode_beam(model, src, search, kernel=kernel) and seen[-1][0] == torch.float32
