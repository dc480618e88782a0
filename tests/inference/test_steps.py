"""What the search steps add to a hypothesis: per-token log-probabilities, and completion
from a given target prefix (``aiayn.inference.steps``' ``Rows.given``, ``only_given``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from search_helpers import random_sources, sequence_log_probs, tiny_model

from aiayn.data.tokenizer import EOS_ID
from aiayn.inference.joinable import JoinableSearch
from aiayn.inference.sampling import ban_repeated_ngrams
from aiayn.inference.search import Sampling, Search, decode_beam, decode_greedy
from aiayn.inference.steps import Rows, check_prefixes, length_penalty, unwritable

LENGTHS = [7, 3, 9, 5, 6]


def model_and_sources(seed: int = 0):
    return tiny_model(seed=seed, eos_bias=1.0), random_sources(LENGTHS, vocab=24, seed=seed + 1)


# ---------------------------------------------------------------- per-token log-probabilities
@pytest.mark.parametrize("search", [Search(4, 0.6, nbest=4, max_len_b=8),
                                    Search(1, 1.0, max_len_b=8),
                                    Search(3, 0.6, no_repeat_ngram=2, nbest=3, max_len_b=8),
                                    Search(3, 0.6, nbest=3, max_len_b=8,
                                           sampling=Sampling(temperature=1.3, seed=5))])
def test_each_token_log_probability_is_the_models_and_they_sum_to_the_score(search):
    model, src = model_and_sources()
    for i, hyps in enumerate(decode_beam(model, src, search)):
        for h in hyps:
            ended = len(h.log_probs) == len(h.ids) + 1  # EOS scored: ended by EOS
            assert len(h.log_probs) in (len(h.ids), len(h.ids) + 1)
            assert h.score == pytest.approx(h.log_prob / length_penalty(len(h.log_probs),
                                                                        search.alpha), abs=1e-9)
            if search.no_repeat_ngram:  # the guard renormalises: only the total is checked
                continue
            per_token = [sequence_log_probs(model, src[i:i + 1], [h.ids[:n]], [False]).item()
                         for n in range(1, len(h.ids) + 1)]
            if ended:
                per_token.append(sequence_log_probs(model, src[i:i + 1], [h.ids], [True]).item())
            expected = np.diff([0.0, *per_token])
            assert list(h.log_probs) == pytest.approx(expected.tolist(), abs=1e-4)


# ---------------------------------------------------------------- prefixes
def test_greedy_search_given_the_start_of_its_own_output_gives_that_output_again():
    model, src = model_and_sources()
    for guard in (0, 2):
        search = Search(1, no_repeat_ngram=guard, max_len_b=10)
        own = decode_greedy(model, src, search)
        assert len({len(o) for o in own}) > 2  # outputs of several lengths
        for k in range(max(map(len, own)) + 1):
            prefixes = [o[:k] for o in own]  # each sentence its own k tokens, in one batch
            assert decode_greedy(model, src, search, prefixes=prefixes) == own, (guard, k)
            beam_one = decode_beam(model, src, Search(1, no_repeat_ngram=guard, max_len_b=10),
                                   prefixes=prefixes)
            assert [h[0].ids for h in beam_one] == own


def test_sampling_given_the_start_of_its_own_sample_draws_that_sample_again():
    model, src = model_and_sources(seed=2)
    search = Search(1, max_len_b=10, no_repeat_ngram=3,
                    sampling=Sampling(temperature=1.5, top_p=0.9, seed=11))
    own = [h[0] for h in decode_beam(model, src, search)]
    for k in (1, 2, 4):
        again = decode_beam(model, src, search, prefixes=[h.ids[:k] for h in own])
        assert [h[0].ids for h in again] == [h.ids for h in own]
        # the prefix's tokens are scored as the model scores them; after it, as before
        for h, o in zip(again, own, strict=True):
            assert h[0].log_probs[k:] == pytest.approx(o.log_probs[k:], abs=1e-5)


def test_beam_search_follows_the_prefix_and_given_its_whole_best_scores_at_least_as_well():
    model, src = model_and_sources(seed=3)
    search = Search(4, 0.6, nbest=4, max_len_b=10)
    own = decode_beam(model, src, search)
    whole = decode_beam(model, src, search, prefixes=[h[0].ids for h in own])
    for hyps, best in zip(whole, own, strict=True):
        assert hyps[0].score >= best[0].score - 1e-5
        assert all(h.ids[:len(best[0].ids)] == best[0].ids for h in hyps)
    for k in (1, 3):
        prefixes = [h[-1].ids[:k] for h in own]  # the start of the *worst* hypothesis
        for hyps, prefix in zip(decode_beam(model, src, search, prefixes=prefixes), prefixes,
                                strict=True):
            assert hyps and all(h.ids[:len(prefix)] == prefix for h in hyps)
            assert len({tuple(h.ids) for h in hyps}) == len(hyps)  # the beam still spreads


def test_a_prefix_longer_than_the_length_limit_is_the_whole_output():
    model, src = model_and_sources()
    prefix = [5, 6, 7, 8, 9, 10, 11, 12]
    for search in (Search(2, max_len_a=0.0, max_len_b=2), Search(1, max_len_a=0.0, max_len_b=2)):
        out = decode_beam(model, src[:1], search, prefixes=[prefix])[0]
        assert out[0].ids == prefix and len(out[0].log_probs) == len(prefix)
    assert decode_greedy(model, src[:1], Search(1, max_len_a=0.0, max_len_b=2),
                         prefixes=[prefix]) == [prefix]


def test_the_guard_leaves_a_given_prefix_alone_and_rules_what_follows():
    model, src = model_and_sources()
    prefix = [5, 6, 5, 6, 5]  # repeats the bigram (5, 6) twice
    for search in (Search(1, no_repeat_ngram=2, max_len_b=12),
                   Search(3, no_repeat_ngram=2, nbest=3, max_len_b=12)):
        for h in decode_beam(model, src[:2], search, prefixes=[prefix, prefix]):
            ids = h[0].ids
            assert ids[:5] == prefix and np.isfinite(h[0].score)
            rest = ids[4:]  # from the prefix's last token on: no bigram twice, none of its own
            seen = {tuple(ids[j:j + 2]) for j in range(3)}
            for j in range(len(rest) - 1):
                assert tuple(rest[j:j + 2]) not in seen
                seen.add(tuple(rest[j:j + 2]))


def test_the_guard_bans_nothing_for_a_joined_rows_padding_with_a_restricted_layer():
    # A row that joined 4 steps late has only PAD before its first own token: its windows of
    # PAD repeat, but PAD has no column of a restricted layer (IGNORE, -100), and a negative
    # index would ban the 100th column from the end.
    to_column = torch.full((160,), -100)
    to_column[3:] = torch.arange(157)
    logits = torch.zeros(2, 157)
    history = np.array([[0, 0, 0, 0], [5, 6, 5, 6]])
    ban_repeated_ngrams(logits, history, 2, to_column)
    assert torch.isfinite(logits[0]).all()
    assert logits[1, to_column[5]] == float("-inf") and torch.isfinite(logits[1]).sum() == 156


def test_the_guard_can_skip_rows():
    logits = torch.zeros(2, 6)
    history = np.array([[4, 5, 4], [4, 5, 4]])
    ban_repeated_ngrams(logits, history, 2, skip=np.array([True, False]))
    assert torch.isfinite(logits[0]).all() and logits[1, 5] == float("-inf")


@pytest.mark.parametrize("beam", [1, 3])
def test_a_joined_search_with_prefixes_equals_decode_beam(beam):
    model, src = model_and_sources(seed=4)
    search = Search(beam, 0.6, nbest=beam, max_len_b=8)
    prefixes = [[5], [], [7, 8], [9, 10, 11], []]
    alone = decode_beam(model, src, search, prefixes=prefixes)
    joined = JoinableSearch(model, search)
    done, live = {}, list(range(len(LENGTHS)))
    while live or len(joined):
        if live:  # one sentence joins at every step
            i = live.pop(0)
            joined.add([i], src[i:i + 1, :LENGTHS[i]], [prefixes[i]])
        done.update(joined.step())
    for i in range(len(LENGTHS)):
        assert [h.ids for h in done[i]] == [h.ids for h in alone[i]]
        assert [h.score for h in done[i]] == pytest.approx([h.score for h in alone[i]], abs=1e-5)


def test_a_prefix_the_model_cannot_write_is_refused_before_searching():
    model, src = model_and_sources()
    assert unwritable(model, [5, EOS_ID, 6]) == [EOS_ID]
    with pytest.raises(ValueError, match="cannot be produced"):
        decode_beam(model, src[:1], Search(2), prefixes=[[5, EOS_ID]])
    with pytest.raises(ValueError, match="max_len"):
        check_prefixes(model, [[5] * model.cfg.max_len])
    restricted = tiny_model()
    restricted.generator.restricted = True
    restricted.generator.set_outputs(torch.tensor([0, 1, 2, 3, 5, 6]))
    assert unwritable(restricted, [5, 6, 7]) == [7]


def test_following_every_sentences_beams_is_keeping_every_sentence_then_growing():
    rng = np.random.default_rng(0)
    A, K, t = 3, 4, 5
    made = []
    for _ in range(2):
        rows = Rows(np.array([9, 9, 9]), copies=K, keys=np.arange(A * K, dtype=np.uint64))
        rows.history = np.arange(A * K * t).reshape(A * K, t)
        rows.totals = -np.arange(A * K * t, dtype=float).reshape(A * K, t)
        made.append(rows)
    beam_of = rng.integers(0, K, size=(A, K))
    tokens, totals = rng.integers(4, 50, size=(A, K)), rng.normal(size=(A, K))
    followed, kept = made
    beam_rows = (followed.beam_base(K) + beam_of).reshape(-1)
    followed.follow(beam_rows, tokens, totals)
    kept.keep(np.arange(A), (np.arange(A)[:, None] * K + beam_of).reshape(-1))
    kept.grow(tokens.reshape(-1), totals.reshape(-1))
    for name in ("history", "totals", "keys", "sentence", "limits", "offset"):
        np.testing.assert_array_equal(getattr(followed, name), getattr(kept, name))
