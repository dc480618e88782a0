"""``topk_rows`` finds what ``Tensor.topk`` finds, and a beam search over a vocabulary wide
enough for its chunks chooses as it does with ``Tensor.topk`` in its place (that a beam's own
2K best hold the sentence's 2K best: the exhaustive-search tests of test_search.py)."""

from __future__ import annotations

import pytest
import torch
from search_helpers import random_sources, tiny_model

from aiayn.inference import kernels, steps
from aiayn.inference.search import Search, decode_beam
from aiayn.inference.topk import CHUNK, topk_rows


def distinct(rows: int, width: int, seed: int) -> torch.Tensor:
    """Distinct values (a permutation, scaled), so that the k largest are one set."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(width, generator=g) for _ in range(rows)]).float() * 0.37 - 900


@pytest.mark.parametrize("width", [5303, 64 * 90, 64 * 17 + 1, 40])  # a tail; none; few chunks
@pytest.mark.parametrize("k", [1, 8, 12])
def test_the_k_largest_of_each_row_are_topks_values_at_their_columns(width, k):
    x = distinct(7, width, seed=width + k)
    # the largest values crowded into one chunk, and into the tail, in some rows
    x[1, CHUNK * 3:CHUNK * 3 + k] += 5000
    x[2, -k:] += 5000
    values, columns = topk_rows(x, k)
    expected_values, expected_columns = x.topk(k, dim=1)
    assert torch.equal(values, expected_values)
    assert torch.equal(columns, expected_columns)  # distinct values: one answer


def test_rows_of_minus_infinity_but_a_few_keep_those_few_first():
    x = torch.full((3, 3000), float("-inf"))
    x[0, 2999] = -1.0  # in the tail
    x[1, [5, 700, 2100]] = torch.tensor([-3.0, -1.0, -2.0])
    values, columns = topk_rows(x, 8)
    assert values[0, 0] == -1.0 and columns[0, 0] == 2999
    assert values[1, :3].tolist() == [-1.0, -2.0, -3.0] and columns[1, :3].tolist() == [700, 2100, 5]
    assert torch.isinf(values[:, 3:]).all() and torch.isinf(values[2]).all()
    assert torch.equal(x.gather(1, columns), values)  # every column holds its value


def test_equal_values_give_topks_values_and_columns_that_hold_them():
    x = torch.randint(0, 6, (5, 4000)).float()
    values, columns = topk_rows(x, 10)
    assert torch.equal(values, x.topk(10, dim=1).values)
    assert torch.equal(x.gather(1, columns), values)
    assert all(len(set(row)) == 10 for row in columns.tolist())  # no column twice


@pytest.mark.parametrize("beam, no_repeat", [(4, 0), (6, 2)])
def test_a_beam_search_over_a_wide_vocabulary_chooses_as_with_topk(monkeypatch, beam, no_repeat):
    model = tiny_model(vocab=2 * beam * CHUNK * 3 + 37, eos_bias=2.0)
    src = random_sources([9, 4, 12, 7], vocab=model.generator.proj.out_features, seed=3)
    search = Search(beam, 0.6, nbest=beam, no_repeat_ngram=no_repeat, max_len_b=10)
    with torch.no_grad():
        chunked = decode_beam(model, src, search)
        for module in (steps, kernels):  # the search's two ways to it
            monkeypatch.setattr(module, "topk_rows", lambda x, k: x.topk(k, dim=1))
        plain = decode_beam(model, src, search)
    assert chunked == plain
