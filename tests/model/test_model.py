"""The model proven against torch.nn.Transformer, the paper's formulas and its own invariants."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import cache_walk, cross_only
from torch import Tensor, nn

from aiayn.cache import KVCache, Store, append_positions, fold_beams, unfold_beams
from aiayn.config import Config, ModelConfig, load_config
from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from aiayn.errors import AiaynError
from aiayn.inference.attention import capture_attention
from aiayn.inspect.reference import TorchReference, copy_weights, max_logit_difference
from aiayn.model import MultiHeadAttention, Transformer, causal_mask, padding_mask, sinusoid_table

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(src_vocab_size=23, tgt_vocab_size=29, d_model=32, n_heads=4, d_ff=48,
            n_encoder_layers=2, n_decoder_layers=2, dropout=0.1, max_len=40,
            tie_embeddings="none")


def tiny(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY, **overrides})


def random_batch(cfg: ModelConfig, src_lens, tgt_lens, seed=0):
    """Right-padded source (ending in EOS) and target (starting with BOS) ids."""
    g = torch.Generator().manual_seed(seed)
    src = torch.full((len(src_lens), max(src_lens)), PAD_ID)
    tgt = torch.full((len(tgt_lens), max(tgt_lens)), PAD_ID)
    for i, (s, t) in enumerate(zip(src_lens, tgt_lens)):
        src[i, :s] = torch.randint(4, cfg.src_vocab_size, (s,), generator=g)
        src[i, s - 1] = EOS_ID
        tgt[i, :t] = torch.randint(4, cfg.tgt_vocab_size, (t,), generator=g)
        tgt[i, 0] = BOS_ID
    return src, tgt


# ----------------------------------------------------------------- torch.nn reference
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_equals_torch_nn_transformer_with_the_same_weights(norm_first):
    """aiayn.inspect.reference puts aiayn's weights into torch.nn.Transformer (between aiayn's own
    embeddings and generator): the two must give the same logits."""
    torch.manual_seed(0)
    cfg = tiny(norm_first=norm_first)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():  # not the defaults: LayerNorms and biases differ too
            nn.init.normal_(p, std=0.2)
    ref = TorchReference(cfg)
    src, tgt = random_batch(cfg, [9, 5, 7], [6, 8, 3])
    assert max_logit_difference(model, ref, src, tgt) > 0.1  # different weights, so it can fail
    copy_weights(model, ref)
    model.eval(), ref.eval()
    with torch.no_grad():
        got, expected = model(src, tgt), ref(src, tgt)
    real = tgt.ne(PAD_ID)
    assert got.shape == (3, 8, cfg.tgt_vocab_size)
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)
    assert max_logit_difference(model, ref, src, tgt) < 1e-5


# ----------------------------------------------------------------- masks
def test_causal_mask_hides_the_future():
    torch.manual_seed(1)
    cfg = tiny()
    model = Transformer(cfg).eval()
    src, tgt = random_batch(cfg, [7, 7], [9, 9])
    changed = tgt.clone()
    t = 4
    changed[:, t + 1:] = torch.randint(4, cfg.tgt_vocab_size, changed[:, t + 1:].shape)
    assert not torch.equal(changed, tgt)
    with torch.no_grad():
        a, b = model(src, tgt), model(src, changed)
    # Exact: the same shapes and weights, so the same kernels compute both sides.
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], atol=0, rtol=0)
    assert not torch.allclose(a[:, t + 1:], b[:, t + 1:])  # the future did change something


def test_padding_is_invisible_on_both_sides():
    torch.manual_seed(2)
    cfg = tiny()
    model = Transformer(cfg).eval()
    src, tgt = random_batch(cfg, [6], [5])
    padded_src = torch.cat([src, torch.full((1, 4), PAD_ID)], dim=1)
    padded_tgt = torch.cat([tgt, torch.full((1, 3), PAD_ID)], dim=1)
    with torch.no_grad():
        plain = model(src, tgt)
        padded = model(padded_src, padded_tgt)
    torch.testing.assert_close(padded[:, :5], plain, atol=1e-6, rtol=1e-5)
    # and a batch mixing lengths gives each sentence what it gets alone
    src2, tgt2 = random_batch(cfg, [6, 11], [5, 9], seed=3)
    with torch.no_grad():
        batched = model(src2, tgt2)
        alone = model(src2[:1, :6], tgt2[:1, :5])
    torch.testing.assert_close(batched[:1, :5], alone, atol=1e-6, rtol=1e-5)


def test_mask_helpers():
    m = causal_mask(3, 5)  # 3 new queries after 2 cached positions
    assert m.tolist() == [[True, True, True, False, False],
                          [True, True, True, True, False],
                          [True, True, True, True, True]]
    pad = torch.tensor([[False, False, True]])
    assert padding_mask(pad).shape == (1, 1, 1, 3)
    assert padding_mask(pad)[0, 0, 0].tolist() == [True, True, False]


# ----------------------------------------------------------------- attention paths
def test_explicit_attention_equals_fast_path_and_weights_are_distributions():
    torch.manual_seed(3)
    mha = MultiHeadAttention(32, 4).eval()
    x = torch.randn(2, 6, 32)
    pad = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    mask = padding_mask(pad)
    fast = mha(x, mask=mask)
    slow, weights = mha(x, mask=mask, need_weights=True)
    torch.testing.assert_close(slow, fast, atol=1e-6, rtol=1e-5)
    assert weights.shape == (2, 4, 6, 6)
    assert (weights >= 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 6))
    assert (weights[1, :, :, 4:] == 0).all()  # padded keys get exactly zero

    causal_fast = mha(x, is_causal=True)
    causal_slow, cw = mha(x, is_causal=True, need_weights=True)
    torch.testing.assert_close(causal_slow, causal_fast, atol=1e-6, rtol=1e-5)
    assert (cw.triu(diagonal=1) == 0).all()


def test_cross_attention_paths_agree():
    torch.manual_seed(4)
    mha = MultiHeadAttention(32, 4, cross=True).eval()
    x, memory = torch.randn(2, 3, 32), torch.randn(2, 7, 32)
    mask = padding_mask(torch.tensor([[False] * 7, [False] * 5 + [True] * 2]))
    fast = mha(x, memory, mask=mask)
    slow, w = mha(x, memory, mask=mask, need_weights=True)
    torch.testing.assert_close(slow, fast, atol=1e-6, rtol=1e-5)
    assert w.shape == (2, 4, 3, 7) and (w[1, ..., 5:] == 0).all()


def test_capture_attention_records_every_layer_with_queries_as_rows():
    torch.manual_seed(5)
    cfg = tiny()
    model = Transformer(cfg).eval()
    src, tgt = random_batch(cfg, [7, 4], [5, 3])
    with torch.no_grad():
        plain = model(src, tgt)
        with capture_attention(model) as maps:
            captured = model(src, tgt)
    torch.testing.assert_close(captured, plain, atol=1e-6, rtol=1e-5)
    assert [m.shape for m in maps["encoder"]] == [(2, 4, 7, 7)] * 2
    assert [m.shape for m in maps["decoder_self"]] == [(2, 4, 5, 5)] * 2
    assert [m.shape for m in maps["cross"]] == [(2, 4, 5, 7)] * 2
    assert all((m.triu(diagonal=1) == 0).all() for m in maps["decoder_self"])
    assert all((m[1, ..., 4:] == 0).all() for m in maps["cross"])  # source padding
    assert not any(layer.self_attn.record_weights for layer in model.encoder.layers)


# ----------------------------------------------------------------- incremental decoding
@pytest.mark.parametrize("norm_first, qk_norm, cross_query",
                         [(False, False, "heads"), (True, False, "heads"), (True, True, "heads"),
                          (True, True, "whole")],
                         ids=["post-norm", "pre-norm", "pre-norm+qk-norm", "whole-cross-query"])
def test_incremental_decoding_equals_full_forward(norm_first, qk_norm, cross_query):
    torch.manual_seed(6)
    cfg = tiny(norm_first=norm_first, qk_norm=qk_norm, qk_norm_cross_query=cross_query)
    model = Transformer(cfg).eval()
    src, tgt = random_batch(cfg, [8, 5], [7, 7])
    with torch.no_grad():
        full = model(src, tgt)
        src_pad = model.src_pad_mask(src)
        memory = model.encode(src, src_pad)
        cache = model.new_cache()
        steps = [model.generator(model.decode(tgt[:, t:t + 1], memory, src_pad, cache))
                 for t in range(tgt.size(1))]
    assert cache.length == tgt.size(1)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cross, whole", [(False, False), (True, False), (True, True)],
                         ids=["self", "cross", "cross-whole-query"])
def test_qk_norm_makes_attention_blind_to_the_scale_of_queries_and_keys(cross, whole):
    """softmax(norm(q) norm(k)^T / sqrt(d_k)): scaling W_Q and W_K (and their biases) by 50
    changes nothing with QK-norm, and changes the attention weights without it."""
    torch.manual_seed(11)
    x, memory = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    for qk_norm in (True, False):
        mha = MultiHeadAttention(32, 4, cross=cross, qk_norm=qk_norm,
                                 whole_query=whole and qk_norm).eval()
        with torch.no_grad():
            before = mha(x, memory if cross else None, need_weights=True)[1]
            if cross:
                for w in (mha.q_proj.weight, mha.q_proj.bias,
                          mha.kv_proj.weight[:32], mha.kv_proj.bias[:32]):
                    w.mul_(50.0)
            else:
                mha.qkv_proj.weight[:64].mul_(50.0)
                mha.qkv_proj.bias[:64].mul_(50.0)
            after = mha(x, memory if cross else None, need_weights=True)[1]
        if qk_norm:
            torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-4)
        else:
            assert (after - before).abs().max() > 0.1


def test_a_whole_query_norm_is_one_rms_over_every_head_and_per_head_is_not():
    """qk_norm_cross_query "whole": q / rms(q) * g over all d_model features, then the heads
    (as CTranslate2's encoder-decoder attention); "heads" normalises each head alone. A query
    whose heads differ in scale tells the two apart."""
    torch.manual_seed(12)
    x = torch.randn(1, 3, 32)
    whole = MultiHeadAttention(32, 4, cross=True, qk_norm=True, whole_query=True).eval()
    heads = MultiHeadAttention(32, 4, cross=True, qk_norm=True).eval()
    assert whole.q_norm.weight.shape == (32,) and heads.q_norm.weight.shape == (8,)
    with torch.no_grad():
        heads.q_proj.load_state_dict(whole.q_proj.state_dict())
        whole.q_norm.weight.copy_(torch.rand(32) + 0.5)
        heads.q_norm.weight.copy_(whole.q_norm.weight[:8])
        whole.q_proj.weight[:8].mul_(10.0)  # the first head's query ten times the others'
        heads.q_proj.weight[:8].mul_(10.0)
        q = whole.q_proj(x)
        expected = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-5) * whole.q_norm.weight
        got = whole._heads(whole.q_norm(q))
        torch.testing.assert_close(got, whole._heads(expected))
        per_head = heads.q_norm(heads._heads(heads.q_proj(x)))
        assert (per_head - got).abs().max() > 0.1
    # Self-attention's query stays per head: whole_query is a setting of cross-attention.
    assert MultiHeadAttention(32, 4, qk_norm=True, whole_query=True).q_norm.weight.shape == (8,)


def test_cache_prefill_of_several_tokens_then_single_steps():
    torch.manual_seed(7)
    cfg = tiny()
    model = Transformer(cfg).eval()
    src, tgt = random_batch(cfg, [6, 6], [8, 8])
    with torch.no_grad():
        full = model(src, tgt)
        src_pad = model.src_pad_mask(src)
        memory = model.encode(src, src_pad)
        cache = model.new_cache()
        first = model.generator(model.decode(tgt[:, :3], memory, src_pad, cache))
        middle = model.generator(model.decode(tgt[:, 3:6], memory, src_pad, cache))
        last = model.generator(model.decode(tgt[:, 6:], memory, src_pad, cache))
    torch.testing.assert_close(torch.cat([first, middle, last], 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qk_norm, cross_query", [(False, "heads"), (True, "whole")],
                         ids=["plain", "qk-norm-whole-query"])
def test_beams_that_share_their_sentence_memory_decode_as_rows_with_their_own_copy(qk_norm, cross_query):
    """A beam search keeps the memory and its cross-attention K/V once per sentence and folds
    the beams' queries onto it: with the cache, without it (the whole prefix each step), and
    with the weights recorded (attention pictures), every row gets what it gets from a
    memory repeated for each of its rows, and the shared K/V follow sentences, not beams."""
    torch.manual_seed(13)
    cfg = tiny(qk_norm=qk_norm, qk_norm_cross_query=cross_query)
    model = Transformer(cfg).eval()
    K = 3
    src, _ = random_batch(cfg, [8, 5], [2, 2])
    tgt = torch.randint(4, cfg.tgt_vocab_size, (2 * K, 6))
    tgt[:, 0] = BOS_ID
    order = torch.tensor([2, 0, 0, 4, 5, 3])  # beams change parents within their sentence
    with torch.no_grad():
        src_pad = model.src_pad_mask(src)
        memory = model.encode(src, src_pad)
        rows_pad, rows_memory = src_pad.repeat_interleave(K, 0), memory.repeat_interleave(K, 0)
        full = model.decode(tgt, rows_memory, rows_pad)
        torch.testing.assert_close(model.decode(tgt, memory, src_pad), full, atol=1e-5, rtol=1e-5)
        with capture_attention(model) as maps_rows:
            model.decode(tgt, rows_memory, rows_pad)
        with capture_attention(model) as maps_shared:
            model.decode(tgt, memory, src_pad)
        for a, b in zip(maps_shared["cross"], maps_rows["cross"], strict=True):
            assert a.shape == b.shape == (2 * K, cfg.n_heads, tgt.size(1), src.size(1))
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        caches = {"shared": model.new_cache(), "rows": model.new_cache()}
        for t in range(tgt.size(1)):
            new = tgt[:, t:t + 1]
            stepped = {"shared": model.decode(new, memory, src_pad, caches["shared"]),
                       "rows": model.decode(new, rows_memory, rows_pad, caches["rows"])}
            torch.testing.assert_close(stepped["shared"], stepped["rows"], atol=1e-5, rtol=1e-5)
            for cache in caches.values():
                cache.reorder(order, kinds=("self",))
        assert caches["shared"].layers[0]["cross"]["k"].size(0) == 2  # one per sentence
        caches["shared"].reorder(torch.tensor([1]), kinds=("cross",))  # sentence 0 leaves
        caches["shared"].reorder(torch.tensor([3, 4, 5]), kinds=("self",))
        caches["rows"].reorder(torch.tensor([3, 4, 5]))
        last = tgt[3:, -1:]
        torch.testing.assert_close(model.decode(last, memory[1:], src_pad[1:], caches["shared"]),
                                   model.decode(last, rows_memory[3:], rows_pad[3:], caches["rows"]),
                                   atol=1e-5, rtol=1e-5)


def test_folding_beams_onto_their_sentences_is_undone_exactly():
    q = torch.randn(6, 4, 2, 5)  # 2 sentences x 3 beams, 4 heads, 2 queries
    folded = fold_beams(q, 2)
    assert folded.shape == (2, 4, 6, 5)
    torch.testing.assert_close(folded[1, :, 2:4], q[4], rtol=0, atol=0)  # beam 1 of sentence 1
    assert torch.equal(unfold_beams(folded, 6), q)
    with pytest.raises(ValueError, match="cannot share the memory of 4 sentences"):
        fold_beams(q, 4)


def test_cache_reorder_follows_beams():
    """After a beam-style reorder, each row continues the prefix of the row it was taken from."""
    torch.manual_seed(8)
    cfg = tiny()
    model = Transformer(cfg).eval()
    src, _ = random_batch(cfg, [6, 6, 6], [2, 2, 2])
    src = src[:1].expand(3, -1).contiguous()  # three beams of one sentence
    prefixes = torch.tensor([[BOS_ID, 5, 6], [BOS_ID, 7, 8], [BOS_ID, 9, 10]])
    next_tokens = torch.tensor([[11], [12], [13]])
    order = torch.tensor([2, 0, 0])  # beam 0 <- old beam 2, beams 1 and 2 <- old beam 0
    with torch.no_grad():
        src_pad = model.src_pad_mask(src)
        memory = model.encode(src, src_pad)
        cache = model.new_cache()
        model.decode(prefixes, memory, src_pad, cache)
        cache.reorder(order)
        stepped = model.generator(model.decode(next_tokens, memory, src_pad, cache))[:, -1]
        full = model(src, torch.cat([prefixes[order], next_tokens], dim=1))[:, -1]
    torch.testing.assert_close(stepped, full, atol=1e-5, rtol=1e-5)


def test_cache_buffers_hold_exactly_what_concatenation_and_index_select_would():
    """Random beam reorders, sentences leaving, sentences joining (longer and shorter
    sources), trims and steps: every layer's cached K/V equal a plain reference built with
    cat / index_select / zero padding; a join that fits writes only the joining rows; and a
    tensor handed out earlier is never changed afterwards (the spare rows and column that
    later steps write into are outside every view)."""
    rng = torch.Generator().manual_seed(12)
    H, d = 2, 3
    cache = KVCache(1)
    ref = {"self": None, "cross": None}
    handed_out, in_place = [], 0
    width = 5
    cross = torch.randn(4, H, width, d, generator=rng)
    cache.join(cross_only(cross))
    ref["cross"] = cross
    for step in range(40):
        B = ref["cross"].size(0)
        new = torch.randn(B, H, 1, d, generator=rng)
        k, _ = append_positions(cache.layers[0]["self"], new, new)
        cache.length += 1
        ref["self"] = new if ref["self"] is None else torch.cat([ref["self"], new], dim=2)
        torch.testing.assert_close(k, ref["self"], rtol=0, atol=0)  # copies: no arithmetic
        handed_out.append((k, k.clone()))
        action = step % 4
        if action == 0:  # beams change parents
            index = torch.randint(0, B, (B,), generator=rng)
        elif action == 1 and B > 2:  # a sentence leaves
            index = torch.tensor([i for i in range(B) if i != step % B])
        else:
            index = None
        if index is not None:
            cache.reorder(index, kinds=("self", "cross") if action == 1 else ("self",))
            ref["self"] = ref["self"].index_select(0, index)
            if action == 1:
                ref["cross"] = ref["cross"].index_select(0, index)
        if action in (2, 3):  # sentences join, their sources shorter or longer
            n, S = 1 + step % 3, width + (step % 5) - 2
            joining = torch.randn(n, H, S, d, generator=rng)
            before = cache.layers[0]["cross"]["k"].data_ptr()
            fits = S <= ref["cross"].size(2) and cache_buffer_rows(cache) >= B + n
            cache.join(cross_only(joining))
            w = max(ref["cross"].size(2), S)
            ref["cross"] = torch.cat([_pad_keys(ref["cross"], w), _pad_keys(joining, w)])
            ref["self"] = torch.cat([ref["self"], ref["self"].new_zeros(n, H, cache.length, d)])
            if fits:
                assert cache.layers[0]["cross"]["k"].data_ptr() == before
                in_place += 1
        if step % 7 == 6:
            unused = int(cache.start.min()) if cache.start is not None else 0
            cache.trim(unused)
            ref["self"] = ref["self"][:, :, unused:]
        for kind in ("self", "cross"):
            torch.testing.assert_close(cache.layers[0][kind]["k"], ref[kind], rtol=0, atol=0)
    for tensor, copy in handed_out:
        assert torch.equal(tensor, copy)
    assert in_place >= 5  # joins that fitted the spare rows did happen


def test_an_indirect_cache_reads_what_the_copying_one_holds():
    """An indirect cache (each position kept where it was written, beams recording their
    ancestry) gives every row the keys and values of the copying cache at every position the
    row may see (from its ``start`` on), through reorders, joins and trims, and stays finite
    where it may not; its store grows (room for 4 positions at first)."""
    copying, indirect = KVCache(1), KVCache(1, indirect=True, positions=4)
    grown = 0
    for _ in cache_walk([copying, indirect]):
        dense, store = copying.layers[0]["self"], indirect.layers[0]["self"]["store"]
        k, v = store.gather()
        assert k.shape == dense["k"].shape and torch.isfinite(k).all()
        start = torch.zeros(k.size(0), dtype=torch.long) if copying.start is None else copying.start
        seen = torch.arange(k.size(2)) >= start[:, None]  # (B, t)
        for mine, theirs in ((k, dense["k"]), (v, dense["v"])):
            assert torch.equal(mine.transpose(1, 2)[seen], theirs.transpose(1, 2)[seen])
        assert torch.equal(copying.start if copying.start is not None else start,
                           indirect.start if indirect.start is not None else start)
        grown = max(grown, store.keys.size(0))
    assert grown > 4

def test_a_store_that_keeps_trimming_moves_what_it_keeps_back_to_the_front_of_its_buffer():
    """A store whose oldest positions keep being trimmed (a search that sentences keep
    joining and leaving) reads what was written at every step, its beams changing parents
    too, and where it reaches the end of its buffer with room trimmed at the front it moves
    its positions back there instead of taking a new buffer: a few buffers for dozens of
    times the end was reached."""
    rng = torch.Generator().manual_seed(3)
    store, B, H, d = Store(positions=8), 3, 2, 4
    keys = values = torch.zeros(B, H, 0, d)
    seen, moves = [], 0  # every view seen, held: a freed buffer's address cannot come back
    for step in range(200):
        k, v = torch.randn(B, H, 1, d, generator=rng), torch.randn(B, H, 1, d, generator=rng)
        before = store.keys.untyped_storage().data_ptr() if store.keys is not None else None
        at_front = store.keys is not None and store.keys.data_ptr() == before
        store.append(k, v)
        keys, values = torch.cat([keys, k], 2), torch.cat([values, v], 2)
        buffer = store.keys.untyped_storage().data_ptr()
        moves += buffer == before and not at_front and store.keys.data_ptr() == buffer
        seen.append(store.keys)
        if step % 5 == 4:  # beams change parents: each row reads another's past
            parents = torch.randint(0, B, (B,), generator=rng)
            store.reorder(parents)
            keys, values = keys[parents], values[parents]
        if step % 4 != 3:  # three of four steps drop the oldest position: the window grows slowly
            store.trim(1)
            keys, values = keys[:, :, 1:], values[:, :, 1:]
        got_k, got_v = store.gather()
        assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    buffers = {view.untyped_storage().data_ptr() for view in seen}
    assert moves >= 10 and len(buffers) <= 6, (moves, len(buffers))


def _pad_keys(kv: Tensor, width: int) -> Tensor:
    return torch.nn.functional.pad(kv, (0, 0, 0, width - kv.size(2)))


def test_the_self_mask_of_rows_that_joined_sees_their_own_keys_up_to_each_query():
    """Rows that began at other columns (``start``): query i of T new ones sees the keys from
    its row's start up to its own position, for a step (T = 1) as for several."""
    cache = KVCache(1)
    cache.length, cache.start = 5, torch.tensor([0, 2, 5])
    for T in (1, 3):
        keys = torch.arange(5 + T)
        queries = torch.arange(5, 5 + T)
        expected = ((keys[None, None, :] <= queries[None, :, None])
                    & (keys[None, None, :] >= cache.start[:, None, None]))[:, None]
        assert torch.equal(cache.self_mask(T, torch.device("cpu")), expected)


def cache_buffer_rows(cache: KVCache) -> int:
    buffers = cache.layers[0]["cross"].get("buffers")
    return 0 if buffers is None else buffers[0].size(0)


# ----------------------------------------------------------------- formulas and plumbing
def test_positional_encoding_equals_the_formula():
    d, L = 16, 50
    table = sinusoid_table(L, d)
    for pos in (0, 1, 7, 49):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    cfg = tiny(dropout=0.0)
    model = Transformer(cfg).eval()
    x = torch.zeros(1, 5, cfg.d_model)
    torch.testing.assert_close(model.src_pos(x, offset=3)[0], model.src_pos.table[3:8])


def test_embedding_is_scaled_by_sqrt_d_model():
    cfg = tiny()
    model = Transformer(cfg)
    ids = torch.tensor([[4, 5]])
    expected = model.src_embed.embedding.weight[ids] * math.sqrt(cfg.d_model)
    torch.testing.assert_close(model.src_embed(ids), expected)


def test_longer_than_max_len_is_a_clear_error():
    cfg = tiny(max_len=8)
    model = Transformer(cfg)
    with pytest.raises(ValueError, match="max_len=8"):
        model(torch.full((1, 9), 5), torch.full((1, 3), 5))


def test_every_parameter_receives_a_gradient():
    torch.manual_seed(9)
    for tie in ("none", "decoder", "all"):
        vocab = dict(src_vocab_size=29) if tie == "all" else {}
        cfg = tiny(tie_embeddings=tie, **vocab)
        model = Transformer(cfg).train()
        src, tgt = random_batch(cfg, [7, 4], [6, 5])
        model(src, tgt).logsumexp(-1).mean().backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, f"{tie}: {name} got no gradient"


def test_tied_embeddings_share_one_matrix():
    model = Transformer(tiny(tie_embeddings="all", src_vocab_size=29))
    w = model.generator.proj.weight
    assert w is model.tgt_embed.embedding.weight is model.src_embed.embedding.weight
    untied = Transformer(tiny(tie_embeddings="none"))
    assert untied.generator.proj.weight is not untied.tgt_embed.embedding.weight
    # tying removes the duplicate matrices from the parameter count
    # untied: source (23 x 32), target and generator (29 x 32 each); tied: one 29 x 32
    assert untied.num_parameters() - model.num_parameters() == 23 * 32 + 29 * 32


def test_xavier_initialisation():
    torch.manual_seed(10)
    model = Transformer(tiny())
    w = model.encoder.layers[0].feed_forward.linear1.weight  # (d_ff, d_model)
    bound = math.sqrt(6 / (w.size(0) + w.size(1)))
    assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound
    assert (model.encoder.layers[0].feed_forward.linear1.bias == 0).all()


@pytest.mark.parametrize("tie", ["none", "decoder", "all"])
def test_embeddings_start_with_unit_variance_after_the_sqrt_d_scale(tie):
    """embedding_init normal: N(0, d^-0.5), so TokenEmbedding's output (x sqrt(d)) has
    variance 1, the positional encoding's scale; xavier: the tutorials' draw."""
    torch.manual_seed(13)
    d, V = 64, 3000
    cfg = tiny(d_model=d, n_heads=4, src_vocab_size=V, tgt_vocab_size=V, tie_embeddings=tie)
    model = Transformer(cfg)
    ids = torch.arange(4, V).unsqueeze(0)
    for embed in (model.src_embed, model.tgt_embed):
        assert embed(ids).var().item() == pytest.approx(1.0, rel=0.05)
    if tie == "none":  # an untied output projection is no embedding: it stays Xavier
        w = model.generator.proj.weight
        assert w.abs().max() <= math.sqrt(6 / (w.size(0) + w.size(1)))
    xavier = Transformer(replace(cfg, embedding_init="xavier"))
    scaled = xavier.tgt_embed(ids)
    assert scaled.var().item() == pytest.approx(2 / (V + d) * d, rel=0.05)
    assert scaled.abs().max() <= math.sqrt(6 / (V + d)) * math.sqrt(d) + 1e-6


def test_state_dict_round_trip():
    torch.manual_seed(11)
    cfg = tiny(tie_embeddings="decoder")
    a, b = Transformer(cfg).eval(), Transformer(cfg).eval()
    src, tgt = random_batch(cfg, [5], [4])
    assert not torch.allclose(a(src, tgt), b(src, tgt))
    b.load_state_dict(a.state_dict())
    # Exact: the same shapes and weights, so the same kernels compute both sides.
    torch.testing.assert_close(a(src, tgt), b(src, tgt), atol=0, rtol=0)
    assert b.generator.proj.weight is b.tgt_embed.embedding.weight  # still tied


# ----------------------------------------------------------------- output_vocab: targets
ALLOWED = torch.tensor([EOS_ID, 4, 7, 8, 15, 20, 28])  # pieces a toy training target holds


def restricted_and_full(seed: int = 12) -> tuple[Transformer, Transformer]:
    """The same weights twice: scoring only ALLOWED (output_vocab "targets"), and all."""
    torch.manual_seed(seed)
    full = Transformer(tiny(tie_embeddings="decoder")).eval()
    restricted = Transformer(tiny(tie_embeddings="decoder", output_vocab="targets")).eval()
    restricted.load_state_dict(full.state_dict(), strict=False)  # all but output_mask
    restricted.generator.set_outputs(ALLOWED)
    return restricted, full


def test_a_restricted_output_layer_scores_its_pieces_as_the_full_one_and_the_rest_minus_inf():
    restricted, full = restricted_and_full()
    src, tgt = random_batch(full.cfg, [6, 4], [5, 3])
    got, expected = restricted(src, tgt), full(src, tgt)
    others = torch.ones(full.cfg.tgt_vocab_size, dtype=torch.bool)
    others[ALLOWED] = False
    torch.testing.assert_close(got[..., ALLOWED], expected[..., ALLOWED], atol=1e-6, rtol=1e-6)
    assert torch.isneginf(got[..., others]).all()
    assert restricted.generator.output_logits(torch.randn(2, 3, 32)).shape == (2, 3, len(ALLOWED))


@pytest.mark.parametrize("eps", [0.0, 0.1])
@torch.no_grad()
def test_the_loss_of_a_restricted_model_is_the_cross_entropy_over_its_pieces(eps):
    """forward(src, tgt_in, tgt_out, eps) = -sum_v q_v log p_v with p the softmax over the
    allowed pieces and q smoothed over them; padding and labels it cannot output (id 5)
    are left out; an unrestricted model's is F.cross_entropy's over the vocabulary."""
    restricted, full = restricted_and_full()
    src, tgt = random_batch(full.cfg, [6, 4], [5, 3])
    tgt_in = tgt[:, :-1]
    labels = ALLOWED[torch.tensor([[1, 2, 0, 3], [4, 0, 5, 6]])]
    labels[1, 2] = 5  # not an output piece
    labels[0, 3] = PAD_ID
    logp = torch.log_softmax(full(src, tgt_in)[..., ALLOWED], dim=-1)  # over the allowed
    column = {int(t): i for i, t in enumerate(ALLOWED)}
    expected = 0.0
    for b, t in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 3)]:
        q = torch.full((len(ALLOWED),), eps / len(ALLOWED))
        q[column[int(labels[b, t])]] += 1 - eps
        expected -= float((q * logp[b, t]).sum())
    assert float(restricted(src, tgt_in, labels, eps)) == pytest.approx(expected, rel=1e-5)
    plain = torch.nn.functional.cross_entropy(
        full(src, tgt_in).flatten(0, 1), labels.flatten(), ignore_index=PAD_ID,
        label_smoothing=eps, reduction="sum")
    assert float(full(src, tgt_in, labels, eps)) == pytest.approx(float(plain), rel=1e-5)


def test_the_restricted_layer_scores_with_the_weights_as_they_are_at_each_call():
    """After in-place changes of the tied weight (as an optimizer step makes, or
    load_state_dict) and of the pieces, the restricted layer's logits are the whole
    layer's at those pieces; with gradients they reach the tied embedding."""
    restricted, full = restricted_and_full()
    hidden = torch.randn(3, 1, 32)

    def check(allowed: Tensor) -> None:
        # Tolerance: the two sides multiply by matrices of other shapes (V_out rows against
        # V), for which BLAS and oneDNN may choose other kernels on other CPUs.
        torch.testing.assert_close(restricted.generator.output_logits(hidden),
                                   full.generator(hidden)[..., allowed.sort().values],
                                   atol=1e-6, rtol=1e-6)

    with torch.no_grad():
        check(ALLOWED)
        for model in (restricted, full):  # tied: the embedding and output layer change
            model.generator.proj.weight.mul_(-2.0)
        check(ALLOWED)
        other = Transformer(restricted.cfg).state_dict()  # other weights, the same pieces
        other["generator.output_mask"] = restricted.generator.output_mask.clone()
        restricted.load_state_dict(other)
        full.load_state_dict(restricted.state_dict(), strict=False)
        check(ALLOWED)
        restricted.generator.set_outputs(ALLOWED[:3])
        check(ALLOWED[:3])
    restricted.generator.output_logits(hidden).sum().backward()
    grad = restricted.tgt_embed.embedding.weight.grad
    assert grad is not None and grad[ALLOWED[:3]].abs().sum() > 0
    assert grad[ALLOWED[3:]].abs().sum() == 0


PRESETS = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_after_a_fused_optimizer_step_decoding_sees_the_new_weights(preset):
    """Each preset's output layer, trained one step by the optimizer `aiayn train` builds
    (fused Adam, which updates the weights in place without bumping their version
    counters): a search and the no-grad logits after it equal those of a model built
    afresh from the saved weights. Nothing derived from the weights may outlive a call."""
    from aiayn.inference.search import beam_search
    from aiayn.training.optim import build_optimizer, set_learning_rate

    config = load_config(ROOT / "configs" / f"{preset}.yaml")
    # The preset's output layer (d_model, tying, restriction, QK-norm, norm placement) on
    # one layer each side and a small vocabulary, so that every preset builds in moments.
    cfg = replace(config.model, src_vocab_size=61, tgt_vocab_size=61, n_encoder_layers=1,
                  n_decoder_layers=1, max_len=32, dropout=0.0)
    torch.manual_seed(0)
    model = Transformer(cfg)
    if cfg.output_vocab == "targets":
        model.generator.set_outputs(torch.arange(2, 40))
    optimizer = build_optimizer(model, config)
    assert optimizer.defaults["fused"]  # the case where version counters stay as they were
    src, tgt = random_batch(cfg, [7, 5], [6, 4], seed=1)

    def search(m: Transformer) -> list:
        return [[(h.ids, h.score) for h in hyps] for hyps in beam_search(m.eval(), src, beam=3,
                                                                       max_len_b=4)]

    def logits(m: Transformer) -> Tensor:
        with torch.no_grad():
            hidden = m.decode(tgt, m.encode(src, m.src_pad_mask(src)), m.src_pad_mask(src))
            return m.generator.output_logits(hidden)

    before = logits(model)
    search(model)  # decode once before the step, as a validation does
    model.train()
    set_learning_rate(optimizer, 1e-2)
    model(src, tgt[:, :-1], tgt[:, 1:]).backward()
    optimizer.step()
    fresh = Transformer(cfg)
    fresh.load_state_dict(model.state_dict())
    after = search(model)
    assert not torch.equal(logits(model), before)  # the step changed what is scored
    # Exact: the same kernels on the same shapes and the same weights compute both sides.
    assert torch.equal(logits(model), logits(fresh))
    assert after == search(fresh)


def test_the_output_pieces_travel_with_the_weights_and_bind_decoding():
    restricted, _ = restricted_and_full()
    fresh = Transformer(restricted.cfg).eval()
    assert len(fresh.generator.output_ids) == restricted.cfg.tgt_vocab_size  # all, until set
    fresh.load_state_dict(restricted.state_dict())
    assert torch.equal(fresh.generator.output_ids, ALLOWED.sort().values)
    assert "generator.output_mask" not in Transformer(tiny()).state_dict()  # old files load
    src, _ = random_batch(restricted.cfg, [6, 5, 4], [2, 2, 2], seed=3)
    from aiayn.inference.search import beam_search, greedy_decode

    fresh.generator.set_outputs(ALLOWED[1:])  # no EOS: every search runs to its limit
    for hypotheses in (greedy_decode(fresh, src, max_len_b=8),
                       [h[0].ids for h in beam_search(fresh, src, beam=3, max_len_b=8)]):
        assert all(len(h) >= 8 for h in hypotheses)
        assert {t for h in hypotheses for t in h} <= set(ALLOWED[1:].tolist())
    with pytest.raises(ValueError, match="restricted"):
        Transformer(tiny()).generator.set_outputs(ALLOWED)


def test_tiny_model_overfits_a_copy_task():
    """The copy task: a tiny model must learn to reproduce a few fixed sequences."""
    torch.manual_seed(12)
    cfg = tiny(dropout=0.0, tie_embeddings="all", src_vocab_size=16, tgt_vocab_size=16)
    model = Transformer(cfg).train()
    seqs = torch.randint(4, 16, (8, 6))
    src = torch.cat([seqs, torch.full((8, 1), EOS_ID)], dim=1)
    tgt = torch.cat([torch.full((8, 1), BOS_ID), seqs, torch.full((8, 1), EOS_ID)], dim=1)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.9, 0.98))
    for _ in range(150):
        logits = model(src, tgt[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 16), tgt[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05, f"copy task loss {loss.item():.3f} did not fall below 0.05"
    from aiayn.inference.search import greedy_decode

    model.eval()
    assert greedy_decode(model, src) == seqs.tolist()


# ----------------------------------------------------------------- configs
def test_bad_sizes_are_refused_with_a_clear_message():
    with pytest.raises(AiaynError, match=r"d_model \(30\) must be divisible by model.n_heads \(4\)"):
        Config(model=tiny(d_model=30)).validate()
    with pytest.raises(AiaynError, match=r"model.d_ff must be in \[1, inf\), got 0"):
        Config(model=tiny(d_ff=0)).validate()
    with pytest.raises(AiaynError, match=r"model.n_encoder_layers must be in \[1, inf\), got -1"):
        Config(model=tiny(n_encoder_layers=-1)).validate()
    with pytest.raises(AiaynError, match="shared vocabulary"):
        Config(model=tiny(tie_embeddings="all")).validate()


def test_config_files_load_and_reject_unknown_keys(tmp_path):
    tiny_cfg = load_config("configs/tiny.yaml")
    assert Transformer(tiny_cfg.model).num_parameters() > 0
    small = load_config("configs/small.yaml")
    assert (small.model.d_model, small.model.n_heads, small.model.d_ff) == (256, 4, 1024)
    base = load_config("configs/base.yaml")
    assert (base.model.d_model, base.model.n_heads, base.model.d_ff) == (512, 8, 2048)
    assert (base.model.n_encoder_layers, base.model.n_decoder_layers) == (6, 6)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  d_modle: 64\n")
    with pytest.raises(AiaynError, match=r"bad.yaml: model: unknown setting\(s\) d_modle"):
        load_config(bad)
    bad.write_text("model:\n  d_model: 30\n  n_heads: 4\n")
    with pytest.raises(AiaynError, match="bad.yaml: model.d_model"):
        load_config(bad)
    bad.write_text("train:\n  adam_eps: 1e-9\n")  # PyYAML reads this as a string
    assert load_config(bad).train.adam_eps == 1e-9
    assert load_config(bad, ["train.adam_eps=1e-6"]).train.adam_eps == 1e-6
    with pytest.raises(AiaynError, match=r"train.adam_eps: expected float, got 'tiny'"):
        load_config(bad, ["train.adam_eps=tiny"])
    cfg = load_config("configs/tiny.yaml", ["train.max_steps=7", "model.norm_first=true"])
    assert cfg.train.max_steps == 7 and cfg.model.norm_first is True
    with pytest.raises(AiaynError, match="unknown setting train.max_stepz"):
        load_config("configs/tiny.yaml", ["train.max_stepz=7"])


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-norm"])
def test_bf16_training_on_cpu_matches_fp32_within_bf16_precision(qk_norm):
    """Under bf16 autocast with gradients, attention takes the explicit path on a CPU."""
    torch.manual_seed(13)
    cfg = tiny(dropout=0.0, norm_first=qk_norm, qk_norm=qk_norm)
    model = Transformer(cfg).train()
    src, tgt = random_batch(cfg, [9, 5], [7, 4])
    reference = model(src, tgt)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(src, tgt)
    assert low.dtype == torch.bfloat16
    real = tgt.ne(PAD_ID)
    torch.testing.assert_close(low.float()[real], reference[real], atol=0.1, rtol=0.05)
    low.float().sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_auto_dropout_is_none_until_the_trainer_sets_it():
    """model.dropout "auto": a model built from such a config drops nothing (its trainer has
    not chosen yet, or it only translates); set_dropout reaches every embedding sum and
    sub-layer output, and a training forward then differs from the eval one."""
    torch.manual_seed(0)
    model = Transformer(tiny(dropout="auto", src_vocab_size=32, tgt_vocab_size=32))
    src, tgt = torch.randint(4, 32, (2, 7)), torch.randint(4, 32, (2, 6))
    model.train()
    assert torch.equal(model(src, tgt), model.eval()(src, tgt))
    model.set_dropout(0.3)
    rates = [m.p for m in model.modules() if isinstance(m, nn.Dropout)]
    assert len(rates) == 2 + 2 * 2 + 3 * 2 and set(rates) == {0.3}
    model.train()
    assert not torch.equal(model(src, tgt), model.eval()(src, tgt))
