"""int8 decoding (aiayn.inference.int8 over aiayn.inference.native's kernels): the product
close to fp32's on every row, a row's result independent of the rows beside it (so a
sentence's translation of its batch), the step's attention and QK-norm equal to PyTorch's up
to rounding, the model given left as it was, incremental decoding equal to a full pass,
translations held to an agreement tolerance against fp32 (not to exactness), and one-line
refusals.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import cache_walk, run_cli
from search_helpers import random_sources
from torch import nn

from aiayn.cache import KVCache, Store
from aiayn.config import ModelConfig
from aiayn.data.prepared import load_prepared
from aiayn.data.tokenizer import EOS_ID
from aiayn.errors import AiaynError
from aiayn.inference import native
from aiayn.inference.attention import capture_attention
from aiayn.inference.ct2 import CTranslate2Engine
from aiayn.inference.int8 import (
    Int8Linear,
    Int8Output,
    NativeDecoderLayer,
    NativeHeadNorm,
    NativeTransformer,
    StepAgain,
    StepAttention,
    int8_model,
)
from aiayn.inference.joinable import JoinableSearch
from aiayn.inference.native import (
    PackedInt8,
    beam_choose,
    build,
    check_int8,
    log_softmax,
    mask_step,
    rms_norm,
    step_attention,
    step_attention_fits,
    top_log_softmax,
)
from aiayn.inference.sampling import ban_repeated_ngrams
from aiayn.inference.search import beam_search, decode_beam
from aiayn.inference.settings import Search
from aiayn.inference.steps import DecoderState, Rows, expand
from aiayn.inference.translator import Translator
from aiayn.model import Generator, HeadNorm, MultiHeadAttention, Transformer
from aiayn.runs.directory import read_data_dir

pytestmark = pytest.mark.skipif(not native.cpu_supported(), reason="int8 decoding needs AVX2")


def rows_of_many_scales(n: int = 12, d: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * torch.logspace(-2, 2, n)[:, None]


@pytest.mark.parametrize("features", [64, 66])  # 66: not a multiple of the kernel's 8
def test_the_product_is_close_to_fp32_on_every_row(features):
    """Each row within 3% of its own size (7-bit weights and inputs: ~2% on random values):
    rows 10^4 apart in scale are each quantized on their own range. 300 outputs: not a
    multiple of the kernel's panel of 16."""
    g = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(300, features, generator=g) * 0.1, torch.randn(300, generator=g)
    x = rows_of_many_scales(d=features)
    exact = F.linear(x, weight, bias)
    got = PackedInt8(weight, bias)(x)
    error = (got - exact).norm(dim=1) / (exact - bias).norm(dim=1)
    assert error.max() < 0.03, error
    zeros = PackedInt8(weight, bias)(torch.zeros(2, features))  # an all-zero row: the bias
    assert torch.allclose(zeros, bias.expand(2, -1))


def test_a_row_gets_the_same_result_alone_as_beside_others():
    """The same kernel on both sides, so exact: a sentence's logits (and so its translation)
    do not depend on the batch it is decoded in, whatever the rows' tiling."""
    weight = torch.randn(200, 64, generator=torch.Generator().manual_seed(2))
    product = PackedInt8(weight)
    x = rows_of_many_scales(n=13)
    together = product(x)
    for i in (0, 5, 11, 12):
        assert torch.equal(product(x[i:i + 1]), together[i:i + 1])
    assert torch.equal(product(x[3:10]), together[3:10])
    shaped = product(x[:12].view(3, 4, 64))  # (..., d) inputs
    assert torch.equal(shaped.view(12, 200), together[:12])
    assert product(x[:0]).shape == (0, 200)
    with pytest.raises(ValueError, match="float32 CPU input"):
        product(x.double())


@pytest.mark.skipif(not native.cpu_supported() or not native.avx512_supported(),
                    reason="the VNNI path needs AVX-512 VNNI")
@pytest.mark.parametrize("rows, features, outputs", [(1, 64, 16), (7, 66, 300), (13, 512, 5000)])
def test_the_vnni_path_gives_avx2s_floats(rows, features, outputs):
    """Two kernels, one integer sum: AVX-512 VNNI's vpdpbusd sums the same 7-bit products
    exactly, and the epilogue is the same operations per element, so every float is equal
    (whatever the rows, the columns' padding and a last panel short of 16 outputs)."""
    g = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(outputs, features, generator=g), torch.randn(outputs, generator=g)
    x = rows_of_many_scales(n=rows, d=features, seed=rows)
    vnni, avx2 = PackedInt8(weight, bias, avx512=True), PackedInt8(weight, bias, avx512=False)
    assert torch.equal(vnni(x), avx2(x))


def test_the_avx512_paths_follow_pytorchs_capability(monkeypatch):
    """ATEN_CPU_CAPABILITY=avx2 (PyTorch's reading "AVX2") keeps aiayn's kernels on AVX2 too."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    native.avx512_supported.cache_clear()
    try:
        assert native.avx512_supported() is False
    finally:
        native.avx512_supported.cache_clear()


def test_the_avx512_paths_are_refused_where_the_cpu_lacks_them(monkeypatch):
    monkeypatch.setattr(native, "avx512_supported", lambda: False)
    with pytest.raises(ValueError, match="lacks AVX-512"):
        PackedInt8(torch.randn(16, 8), avx512=True)
    with pytest.raises(ValueError, match="lacks AVX-512"):
        q = torch.randn(2, 1, 1, 16)
        step_attention(q, q, q, avx512=True)
    assert PackedInt8(torch.randn(16, 8)).avx512 is False


def path(avx512: bool) -> bool:
    """The kernels' path a test asks for: AVX2's everywhere, AVX-512's where the CPU has it."""
    if avx512 and not native.avx512_supported():
        pytest.skip("this CPU lacks AVX-512")
    return avx512


@pytest.mark.parametrize("avx512", [False, True])
@pytest.mark.parametrize("kept", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, group, keys, masked", [
    (8, 1, 1, False),  # a first step: one key
    (8, 1, 13, False),  # self-attention: each row its own keys, not a multiple of 8
    (12, 4, 37, True),  # cross-attention: a beam of 4 over each sentence's padded memory
    (30, 6, 16, True),
])
def test_the_step_attention_equals_pytorchs(rows, group, keys, masked, kept, avx512):
    """One query per row against PyTorch's fused attention (through the model's own
    ``attend``, which folds the beams), up to float rounding: the keys and values views of
    wider buffers, as a cache keeps them, the queries a view of a fused projection; keys and
    values kept in float32 or float16 (PyTorch's reading the same halves as float32); on
    AVX2's products and on AVX-512's."""
    g = torch.Generator().manual_seed(rows + keys)
    heads, d, sets = 4, 64, rows // group
    qkv = torch.randn(rows, 1, 3 * heads * d, generator=g)
    q = qkv[..., :heads * d].view(rows, 1, heads, d).transpose(1, 2)
    k = torch.randn(sets + 3, heads, keys + 5, d, generator=g).to(kept)[:sets, :, :keys]
    v = (3 * torch.randn(sets + 3, heads, keys + 5, d, generator=g)).to(kept)[:sets, :, :keys]
    mask = None
    if masked:  # padding on the right, at least one key seen
        lengths = torch.randint(1, keys + 1, (sets,), generator=g)
        mask = (torch.arange(keys) < lengths[:, None])[:, None, None, :]
    assert step_attention_fits(q, k, v, mask)
    reference, _ = MultiHeadAttention(heads * d, heads).eval().attend(q, k.float(), v.float(), mask,
                                                                     False, False)
    got = step_attention(q, k, v, mask, avx512=path(avx512))
    assert got.shape == reference.shape
    assert torch.allclose(got, reference, atol=1e-5, rtol=1e-5), (got - reference).abs().max()


@pytest.mark.parametrize("avx512", [False, True])
@pytest.mark.parametrize("half", [False, True])
def test_the_step_attention_sees_each_rows_window_alone(half, avx512):
    """Rows whose visible keys are a window (masked before, after, both, or everywhere, as a
    serving lane's rows see the cache from where they joined and their own source's length):
    PyTorch's attention over the window, zeros for a row that sees nothing, and nothing of the
    keys outside it in the result (not-a-number there changes no bit). (That the window leaves
    every float as the whole row's masked pass gave it is not visible from outside.)"""
    g = torch.Generator().manual_seed(7)
    rows, heads, d, keys = 10, 4, 64, 45
    kept = torch.float16 if half else torch.float32
    q = torch.randn(rows, heads, 1, d, generator=g)
    k = torch.randn(rows, heads, keys, d, generator=g).to(kept)
    v = torch.randn(rows, heads, keys, d, generator=g).to(kept)
    windows = [(0, 45), (9, 45), (0, 17), (8, 16), (13, 30), (44, 45), (0, 1), (20, 20), (3, 41), (16, 40)]
    mask = torch.zeros(rows, keys, dtype=torch.bool)
    for r, (a, b) in enumerate(windows):
        mask[r, a:b] = True
    mask = mask[:, None, None, :]
    got = step_attention(q, k, v, mask, avx512=path(avx512))
    reference, _ = MultiHeadAttention(heads * d, heads).eval().attend(q, k.float(), v.float(), mask,
                                                                     False, False)
    seen = mask.reshape(rows, keys).any(1)
    assert torch.allclose(got[seen], reference[seen], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[~seen], torch.zeros_like(got[~seen]))
    hidden = ~mask.reshape(rows, 1, keys, 1).expand_as(k)
    garbage = [t.masked_fill(hidden, float("nan")) for t in (k, v)]
    assert torch.equal(step_attention(q, *garbage, mask, avx512=path(avx512)), got)


@pytest.mark.parametrize("d, avx512", [(8, False), (16, False), (16, True)])
def test_the_step_attention_reads_an_indirect_cache_as_pytorch_reads_the_copying_one(d, avx512):
    """Through reorders, joins and trims (``helpers.cache_walk``), the kernel reading the
    indirect cache's store through its ancestry equals PyTorch's attention over the copying
    cache's K/V, each row masked before its ``start`` (d_k 8: AVX2's products alone)."""
    copying, indirect = KVCache(1), KVCache(1, indirect=True)
    attention = MultiHeadAttention(2 * d, 2).eval()
    for q in cache_walk([copying, indirect], heads=2, d=d):
        dense, store = copying.layers[0]["self"], indirect.layers[0]["self"]["store"]
        mask = None
        if copying.start is not None:
            mask = (torch.arange(store.length) >= copying.start[:, None])[:, None, None, :]
        assert step_attention_fits(q, store.k, store.v, mask, store.length, store.ancestry)
        got = step_attention(q, store.k, store.v, mask, store.length, store.ancestry,
                             avx512=path(avx512))
        reference, _ = attention.attend(q, dense["k"], dense["v"], mask, False, False)
        assert torch.allclose(got, reference, atol=1e-5, rtol=1e-5), (got - reference).abs().max()


def test_the_step_attention_takes_only_what_it_computes():
    q, k = torch.randn(4, 2, 1, 16), torch.randn(4, 2, 5, 16)
    assert step_attention_fits(q, k, k, None)
    assert not step_attention_fits(torch.randn(4, 2, 3, 16), k, k, None)  # several queries
    assert not step_attention_fits(q.double(), k.double(), k.double(), None)
    assert not step_attention_fits(torch.randn(4, 2, 1, 12), torch.randn(4, 2, 5, 12),
                                   torch.randn(4, 2, 5, 12), None)  # d_k not a multiple of 8
    assert not step_attention_fits(q, k[:3], k[:3], None)  # 4 rows over 3 key sets
    assert step_attention_fits(q, k.half(), k.half(), None)
    assert not step_attention_fits(q, k.half(), k, None)  # keys and values of two dtypes
    assert not step_attention_fits(q, k.bfloat16(), k.bfloat16(), None)
    assert not step_attention_fits(q, k, k, torch.ones(4, 2, 1, 5, dtype=torch.bool))  # per head


@pytest.mark.parametrize("shape", [(6, 4, 1, 64), (6, 1, 256)])
def test_the_native_rms_norm_equals_torchs(shape):
    """Per head and over a whole query, on a strided view; the input is left as it was."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(*shape[:-1], 2 * shape[-1], generator=g) * 5)[..., ::2]
    norm = HeadNorm(shape[-1])
    nn.init.normal_(norm.weight, generator=g)
    before = x.clone()
    got = rms_norm(x, norm.weight, norm.eps)
    assert torch.equal(x, before)
    assert torch.allclose(got, norm(x), atol=1e-5, rtol=1e-5)


def logits_with_banned_columns(n: int) -> torch.Tensor:
    """Rows as a search's logits: wide-ranging values, some columns -inf (banned pieces), one
    row -inf alone (nothing allowed)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(5, n, generator=g) * torch.tensor([1.0, 3.0, 10.0, 30.0, 1.0])[:, None]
    x[1, ::3] = float("-inf")
    x[4] = float("-inf")
    return x


@pytest.mark.parametrize("avx512", [False, True])
@pytest.mark.parametrize("n", [5, 8, 61, 5131])
def test_the_native_log_softmax_equals_torchs(n, avx512):
    x = logits_with_banned_columns(n)
    before = x.clone()
    got = log_softmax(x, avx512=path(avx512))
    assert torch.equal(x, before)
    assert torch.allclose(got[:4], torch.log_softmax(x[:4], dim=-1), atol=1e-5, rtol=1e-5)
    assert torch.equal(got.isinf(), x.isinf())  # the row of -inf alone: -inf (torch's: nan)


@pytest.mark.parametrize("avx512", [False, True])
@pytest.mark.parametrize("n, k", [(5, 5), (8, 1), (61, 12), (5131, 8), (5131, 12)])
def test_the_top_log_probabilities_are_the_log_softmaxs_floats_topk(n, k, avx512):
    """One kernel computes both sides (the same sum of exponentials, on either path): exact
    equality, the same columns where the values differ; a row with fewer than k finite values
    ends in -inf, every column once."""
    x = logits_with_banned_columns(n)
    values, columns = top_log_softmax(x, k, avx512=path(avx512))
    want, want_columns = log_softmax(x, avx512=avx512).topk(k, dim=1)
    assert torch.equal(values, want)
    finite = want.isfinite()
    assert torch.equal(columns[finite], want_columns[finite])
    assert all(len(set(row)) == k for row in columns.tolist())
    with pytest.raises(ValueError, match="1 <= k <= n"):
        top_log_softmax(x, n + 1)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("restricted", [False, True])
def test_the_native_step_mask_bans_the_guards_columns_and_the_never_generated(n, restricted):
    """One call sets what ``next_logits`` sets in two: the never-generated columns and the
    repetition guard's (histories of few tokens repeat; a joined row starts with PAD; some
    rows skipped; a history trimmed to a view; one too short for an n-gram)."""
    g = np.random.default_rng(n)
    vocab, rows, t = 12, 40, 14
    history = g.integers(3, 7, size=(rows, t))
    history[:5, :6] = 0  # rows that joined 6 steps late: PAD first
    skip = g.random(rows) < 0.2
    to_column = None
    if restricted:  # column = id - 3; PAD, BOS, EOS have none (-100)
        to_column = torch.full((vocab,), -100)
        to_column[3:] = torch.arange(vocab - 3)
    cols = vocab - 3 if restricted else vocab
    never = torch.tensor([] if restricted else [0, 1], dtype=torch.long)
    for seen in (history, history[:, 2:]):  # the whole history, and a trimmed one (a view)
        logits = torch.randn(rows, cols)
        want = logits.clone()
        want[:, never] = float("-inf")
        ban_repeated_ngrams(want, seen, n, to_column, skip)
        mask_step(logits, never, seen, n, skip, to_column)
        assert torch.equal(logits, want)
        assert logits.isinf().sum() > len(never) * rows  # the guard banned some
    short = torch.zeros(2, cols)
    mask_step(short, never, history[:2, :n - 1], n)  # no n-gram complete yet
    assert short.isinf().sum() == 2 * len(never)


@pytest.mark.parametrize("restricted", [False, True])
@pytest.mark.parametrize("K, width", [(1, 2), (4, 8), (6, 12), (3, 1)])
def test_the_native_beam_choice_is_expands(K, width, restricted):
    """``expand``'s choice with int8's kernel (one C call) and with PyTorch's operations: the
    same candidates, survivors and host rows, on sentences whose beams are partly dead (-inf)
    and whose best candidates end in EOS; where candidates tie (topk's order is not fixed),
    the earlier comes first."""
    g = torch.Generator().manual_seed(K * 100 + width)
    A, V = 7, 40
    logits = torch.randn(A * K, V, generator=g) * 3
    logits[:, 0] = float("-inf")
    ids = torch.arange(V).flip(0) if restricted else None  # column j is token V - 1 - j
    eos_column = V - 1 - EOS_ID if restricted else EOS_ID
    logits[2 * K:3 * K, eos_column] = 20.0  # sentence 2: EOS the best of every beam
    logits[3 * K:4 * K] = 0.0  # sentence 3: every candidate ties
    scores = torch.randn(A, K, generator=g)
    scores[0, 1:] = float("-inf")  # a first step: one live beam
    scores[3] = 0.0

    class Kernel:  # the int8 output kernel's softmax, with or without its beam choice
        top_log_softmax = staticmethod(top_log_softmax)

    class Native(Kernel):
        beam_choose = staticmethod(beam_choose)

    class State:
        def __init__(self, kernel):
            self.kernel, self.ids = kernel, ids

        def token_ids(self, columns):
            return columns if ids is None else ids[columns]

    want_scores, want_token, want = expand(logits, scores, K, State(Kernel()))
    got_scores, got_token, got = expand(logits, scores, K, State(Native()))
    rest = [a for a in range(A) if a != 3]
    assert torch.equal(got_scores, want_scores)
    assert torch.equal(got_token[rest], want_token[rest])
    finite = np.isfinite(want.top_scores[rest])
    # only a fused step follows the beams, and only a call of several records what ends
    assert got.followed is got.ended is want.followed is want.ended is None
    for name in want._fields[:-2]:
        a, b = getattr(got, name)[rest], getattr(want, name)[rest]
        assert np.array_equal(a[finite] if a.shape == finite.shape else a,
                              b[finite] if b.shape == finite.shape else b), name
    if K * width > 1:  # sentence 2: EOS candidates among its best, none survives while others do
        assert (got.top_token[2] == EOS_ID).any()
        assert (got.token[2] != EOS_ID).all() or (got.top_token[2] != EOS_ID).sum() < K
    ties = got.top_beam[3] * width  # sentence 3: equal candidates in their order
    assert (np.diff(ties) >= 0).all() and (got.top_scores[3] == got.top_scores[3, 0]).all()


def test_int8_steps_equal_the_int8_full_pass():
    """The int8 copy decoding one token at a time (its step attention and QK-norm in aiayn's
    kernels, the cache growing) gives the logits of one pass over the whole prefix (PyTorch's
    attention and norm), up to rounding: the same int8 products, and the same K/V rounded to
    the float16 the steps keep, on both sides."""
    torch.manual_seed(0)
    cfg = ModelConfig(src_vocab_size=40, tgt_vocab_size=40, d_model=64, n_heads=4, d_ff=64,
                      n_encoder_layers=1, n_decoder_layers=2, dropout=0.0, max_len=32,
                      norm_first=True, qk_norm=True, qk_norm_cross_query="whole")
    model = int8_model(Transformer(cfg).eval())
    src, tgt = torch.randint(4, 40, (3, 7)), torch.randint(4, 40, (3, 6))
    src[1, 5:] = cfg.pad_id
    with torch.no_grad():
        src_pad = model.src_pad_mask(src)
        memory = model.encode(src, src_pad)
        full = model.decode(tgt, memory, src_pad)
        cache = model.new_cache()
        steps = torch.cat([model.decode(tgt[:, i:i + 1], memory, src_pad, cache)
                           for i in range(tgt.size(1))], dim=1)
    assert torch.allclose(steps, full, atol=1e-4), (steps - full).abs().max()
    kept = cache.layers[0]
    assert kept["self"]["store"].keys.dtype == kept["cross"]["k"].dtype == torch.float16


def test_the_output_kernel_packs_the_allowed_rows_and_refuses_others():
    generator = Generator(32, 50, restricted=True)
    generator.set_outputs(torch.arange(10, 40))
    kernel = Int8Output(generator)
    weight, bias = generator.allowed_rows()
    h = torch.randn(3, 2, 32)
    got = generator.output_logits(h, kernel=kernel)
    assert got.shape == (3, 2, 30)
    assert ((got - F.linear(h, weight)).norm() / F.linear(h, weight).norm()) < 0.03
    with pytest.raises(ValueError, match="packed a"):
        kernel(h, generator.proj.weight, None)


def test_the_int8_model_is_a_copy_and_the_model_given_is_unchanged():
    torch.manual_seed(0)
    cfg = ModelConfig(src_vocab_size=40, tgt_vocab_size=40, d_model=32, n_heads=4, d_ff=64,
                      n_encoder_layers=1, n_decoder_layers=2, dropout=0.0, max_len=32)
    model = Transformer(cfg).eval()
    src, tgt = torch.randint(4, 40, (3, 7)), torch.randint(4, 40, (3, 5))
    with torch.no_grad():
        before = model(src, tgt)
        quantized = int8_model(model)
        after, approx = model(src, tgt), quantized(src, tgt)
    assert torch.equal(before, after)
    assert not any(isinstance(m, Int8Linear) for m in model.modules())
    linears = [m for m in quantized.decoder.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 2 * 7  # self qkv and out; cross q, kv and out; two feed-forward
    assert not any(type(m) is nn.Linear for m in quantized.decoder.modules())
    attention = [m for m in quantized.decoder.modules() if isinstance(m, MultiHeadAttention)]
    assert len(attention) == 4 and all(isinstance(m, StepAttention) for m in attention)
    assert not any(isinstance(m, (StepAttention, NativeHeadNorm)) for m in model.modules())
    encoder_linears = [m for m in quantized.encoder.modules() if isinstance(m, Int8Linear)]
    assert len(encoder_linears) == 4  # self qkv and out; two feed-forward
    assert not any(type(m) is nn.Linear for m in quantized.encoder.modules())
    assert quantized.encoder is not model.encoder  # its linears replaced in a copy; the rest shared
    assert quantized.encoder.norm is model.encoder.norm
    assert quantized.decoder.layers[0].sublayer1.norm is model.decoder.layers[0].sublayer1.norm
    assert (approx.softmax(-1) - before.softmax(-1)).abs().max() < 0.05


def test_refusals_are_one_line(monkeypatch, tmp_path):
    with pytest.raises(AiaynError, match="runs on a CPU") as info:
        check_int8("cuda")
    assert "\n" not in str(info.value)
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(AiaynError, match="'no-such-compiler' is not on PATH") as info:
        build(directory=tmp_path)
    assert "\n" not in str(info.value)
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    with pytest.raises(AiaynError, match="could not build its kernel"):
        build(directory=tmp_path)
    assert not list(tmp_path.glob("*.so"))  # nothing half-written left behind
    monkeypatch.setattr(native, "cpu_supported", lambda: False)
    with pytest.raises(AiaynError, match="needs an x86 CPU with AVX2"):
        check_int8("cpu")
    with pytest.raises(AiaynError, match="--quantization int8"):
        CTranslate2Engine.load("unused", int8=True)


def test_a_build_is_kept_and_used_again(tmp_path):
    first = build(directory=tmp_path)
    stamp = first.stat().st_mtime_ns
    assert build(directory=tmp_path) == first and first.stat().st_mtime_ns == stamp


def test_int8_translations_agree_with_fp32_and_with_themselves_alone(run_dir):
    fp32 = Translator.from_pretrained(run_dir)
    quantized = Translator.from_pretrained(run_dir, int8=True)
    assert isinstance(quantized.kernel, Int8Output) and not isinstance(fp32.kernel, Int8Output)
    with pytest.raises(AiaynError, match="exclude each other"):
        Translator.from_pretrained(run_dir, int8=True, bf16=True)
    sources = [src for src, _ in load_prepared(read_data_dir(run_dir)).split("test")]
    search = fp32.resolve(beam=4, alpha=0.6)
    ours, theirs = quantized.translate(sources, search), fp32.translate(sources, search)
    agree = sum(a == b for a, b in zip(ours, theirs, strict=True))
    assert agree >= 0.6 * len(sources), (agree, len(sources))
    # Alone as in the batch: each row is quantized on its own scale. Not guaranteed to the
    # last bit (rounding can turn fp32's last-bit differences between batches into another
    # integer: docs/translating.md#int8-decoding), so 7 of 8.
    alone = [quantized.translate([s], search)[0] for s in sources[:8]]
    assert sum(a == b for a, b in zip(alone, ours[:8], strict=True)) >= 7, (alone, ours[:8])


def test_evaluate_with_int8_keeps_its_own_file(run_dir, capsys):
    code, out, err = run_cli(["evaluate", str(run_dir), "--split", "test", "--limit", "5",
                              "--int8"], capsys)
    assert code == 0, err
    assert list((run_dir / "eval").glob("test.best.int8.beam*.txt"))


def test_the_int8_copy_keeps_the_models_weights_by_name():
    """A serving lane's process rebuilds the int8 copy from its state_dict: the fp32 model's."""
    cfg = ModelConfig(src_vocab_size=40, tgt_vocab_size=40, d_model=32, n_heads=4, d_ff=64,
                      n_encoder_layers=1, n_decoder_layers=1, dropout=0.0, max_len=32)
    model = Transformer(cfg)
    mine, theirs = int8_model(model).state_dict(), model.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(mine[k].data_ptr() == theirs[k].data_ptr() for k in theirs)  # shared, not copied


def layer_by_layer(monkeypatch) -> None:
    """Every ``NativeDecoderLayer`` computed by its modules (the kernel's step refused)."""
    monkeypatch.setattr(NativeDecoderLayer, "_places", lambda self, *args: None)


def count_native_steps(monkeypatch) -> list[int]:
    """A list that grows by the rows of every step the native layer computes."""
    calls, step = [], native.decoder_layer_step

    def counted(layer, places, x, avx512=None):
        calls.append(x.size(0))
        return step(layer, places, x, avx512)

    monkeypatch.setattr(native, "decoder_layer_step", counted)
    return calls


def joined_and_reordered(model: Transformer) -> list[torch.Tensor]:
    """The logits of a joinable search's steps as sentences join, beams reorder and a
    sentence leaves: what a serving lane does to the cache (``DecoderState``)."""
    g = torch.Generator().manual_seed(3)
    src = torch.randint(4, 40, (3, 7), generator=g)
    src[1, 4:] = model.cfg.pad_id
    state, out = DecoderState.joinable(model), []
    with torch.no_grad():
        state.join(src[:2], copies=2)  # 4 rows
        for rows, sentences, joins in [(None, None, False), ([1, 1, 2, 3], None, False),
                                       ([0, 1, 3, 3], None, True), ([4, 5, 0, 1, 2, 2], None, False),
                                       ([0, 1, 4, 5], [0, 2], False), ([1, 0, 3, 2], None, False)]:
            if rows is not None:
                state.select(torch.tensor(rows), None if sentences is None else torch.tensor(sentences))
            if joins:
                state.join(src[2:], copies=2)
            n = state.cache.layers[0]["cross"]["k"].size(0) * 2
            out.append(state.next_logits(torch.randint(4, 40, (n, 1), generator=g)))
    return out


@pytest.mark.parametrize("norm_first", [True, False])
def test_the_native_step_embeds_and_decodes_as_the_models_decode(monkeypatch, norm_first):
    """The int8 copy's step after the first (``NativeTransformer.decode``: the embedding and
    positions in aiayn's kernel, the layers called directly) gives the floats of the model's
    own ``decode`` over the same cache, as sentences join, beams reorder and one leaves; and
    refuses a token id outside the vocabulary in one line."""
    torch.manual_seed(0)
    cfg = ModelConfig(src_vocab_size=40, tgt_vocab_size=40, d_model=64, n_heads=4, d_ff=96,
                      n_encoder_layers=1, n_decoder_layers=2, dropout=0.0, max_len=32,
                      norm_first=norm_first)
    model = int8_model(Transformer(cfg).eval())
    assert isinstance(model, NativeTransformer)
    embedded, embed, encoded, encode = [], native.embed_step, [], native.encode_memory
    monkeypatch.setattr(native, "embed_step", lambda *a: embedded.append(1) or embed(*a))
    monkeypatch.setattr(native, "encode_memory", lambda *a: encoded.append(1) or encode(*a))
    ours = joined_and_reordered(model)
    assert len(embedded) == 5  # every step but the first
    assert len(encoded) == 2  # the two joins' encodings
    with monkeypatch.context() as m:
        m.setattr(NativeTransformer, "decode", Transformer.decode)
        theirs = joined_and_reordered(model)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
    table = model.tgt_pos.table
    with pytest.raises(ValueError, match="outside the tables"):
        native.embed_step(model.tgt_embed.embedding.weight, 8.0, table, torch.tensor([40]),
                          torch.tensor([0]))


@pytest.mark.parametrize("norm_first, qk_norm, whole, avx512", [
    (True, True, "whole", True), (True, True, "head", True), (False, False, "head", True),
    (True, True, "whole", False)])
def test_the_native_decoder_layer_gives_its_modules_logits(monkeypatch, norm_first, qk_norm, whole,
                                                            avx512):
    """One call of the kernel per layer and step computes what the layer's modules compute
    (the same int8 products, attention and QK-norm; the layer norm and additions in C, equal
    up to rounding), over a cache that sentences join and leave and beams reorder; on the
    AVX2 paths as on AVX-512's."""
    if not avx512:  # both sides on AVX2's paths
        monkeypatch.setattr(native, "avx512_supported", lambda: False)
    torch.manual_seed(0)
    cfg = ModelConfig(src_vocab_size=40, tgt_vocab_size=40, d_model=64, n_heads=4, d_ff=96,
                      n_encoder_layers=1, n_decoder_layers=2, dropout=0.0, max_len=32,
                      norm_first=norm_first, qk_norm=qk_norm, qk_norm_cross_query=whole)
    model = int8_model(Transformer(cfg).eval())
    calls = count_native_steps(monkeypatch)
    native_logits = joined_and_reordered(model)
    assert calls == [4, 4, 6, 6, 6, 6, 4, 4, 4, 4]  # every step but the first, each layer
    with monkeypatch.context() as m:
        layer_by_layer(m)
        modules_logits = joined_and_reordered(model)
    for ours, theirs in zip(native_logits, modules_logits, strict=True):
        assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()


def small_int8_encoder(monkeypatch, avx512: bool, norm_first: bool, qk_norm: bool,
                       decoder_layers: int) -> tuple[Transformer, torch.Tensor]:
    """A small random model's int8 copy (two encoder layers) on the AVX2 paths or AVX-512's,
    and three sources of 9, 5 and 2 tokens padded together."""
    if not avx512:
        monkeypatch.setattr(native, "avx512_supported", lambda: False)
    torch.manual_seed(0)
    cfg = ModelConfig(src_vocab_size=40, tgt_vocab_size=40, d_model=64, n_heads=4, d_ff=96,
                      n_encoder_layers=2, n_decoder_layers=decoder_layers, dropout=0.0, max_len=32,
                      norm_first=norm_first, qk_norm=qk_norm)
    src = torch.randint(4, 40, (3, 9), generator=torch.Generator().manual_seed(1))
    src[1, 5:], src[2, 2:] = cfg.pad_id, cfg.pad_id
    return int8_model(Transformer(cfg).eval()), src


@pytest.mark.parametrize("norm_first, qk_norm, avx512", [(True, True, True), (False, False, True),
                                                         (True, True, False)])
def test_the_native_encoder_gives_its_modules_memory(monkeypatch, norm_first, qk_norm, avx512):
    """One call of the kernel per encoder layer (``NativeTransformer.encode``) computes what the
    layers' modules compute (the same int8 products and QK-norm; the attention, layer norm
    and additions in C, equal up to rounding) for sentences of several lengths padded
    together, each as if alone; on the AVX2 paths as on AVX-512's. A pass that keeps
    gradients or records the attention takes the modules."""
    model, src = small_int8_encoder(monkeypatch, avx512, norm_first, qk_norm, decoder_layers=1)
    calls, layer = [], native.encoder_layer
    monkeypatch.setattr(native, "encoder_layer", lambda *a: calls.append(a[1].shape) or layer(*a))
    kept = ~model.src_pad_mask(src)
    with torch.no_grad():
        ours = model.encode(src)
        assert calls == [(3, 9, 64)] * 2
        theirs = Transformer.encode(model, src)
        alone = [model.encode(src[i:i + 1, :int(kept[i].sum())])[0] for i in range(3)]
    assert torch.allclose(ours[kept], theirs[kept], atol=1e-5), (ours - theirs)[kept].abs().max()
    for i in range(3):  # padding changes nothing but rounding
        assert torch.allclose(ours[i, kept[i]], alone[i], atol=1e-5)
    calls.clear()
    model.encode(src)  # gradients kept: the modules
    with torch.no_grad(), capture_attention(model):
        model.encode(src)
    with torch.no_grad():  # a padding mask that broadcasts over the sentences
        shared = model.encode(src[:1].expand(3, -1), model.src_pad_mask(src[:1]))
    assert calls == []
    assert torch.allclose(shared[0], ours[0], atol=1e-5)


@pytest.mark.parametrize("qk_norm, avx512", [(True, True), (False, True), (True, False)])
def test_the_native_memory_kv_is_the_modules_to_the_bit(monkeypatch, qk_norm, avx512):
    """Each decoder layer's cross-attention K/V of a memory in one call of the kernel
    (``NativeTransformer.new_cache``: ``native.memory_kv``) are the floats its modules keep
    (the same int8 product, QK-norm kernel and float16 rounding), of the same shape, with or
    without QK-norm, on the AVX2 paths as on AVX-512's, for memories of any size; a pass that
    keeps gradients or records the attention takes the modules."""
    if not avx512:
        monkeypatch.setattr(native, "avx512_supported", lambda: False)
    torch.manual_seed(0)
    cfg = ModelConfig(src_vocab_size=40, tgt_vocab_size=40, d_model=64, n_heads=4, d_ff=96,
                      n_encoder_layers=1, n_decoder_layers=2, dropout=0.0, max_len=32,
                      norm_first=True, qk_norm=qk_norm)
    model = int8_model(Transformer(cfg).eval())
    calls, kernel = [], native.memory_kv
    monkeypatch.setattr(native, "memory_kv", lambda *a: calls.append(a[1].shape) or kernel(*a))
    for n, S in [(3, 9), (1, 1), (0, 4)]:
        memory = 4 * torch.randn(n, S, 64)
        with torch.no_grad():
            ours, theirs = model.new_cache(memory), Transformer.new_cache(model, memory)
        assert calls == [(n, S, 64)] * 2
        calls.clear()
        for mine, its in zip(ours.layers, theirs.layers, strict=True):
            for name in ("k", "v"):
                a, b = mine["cross"][name], its["cross"][name]
                assert a.dtype == b.dtype == torch.float16 and a.shape == b.shape == (n, 4, S, 16)
                assert torch.equal(a, b)
    memory = torch.randn(2, 5, 64)
    model.new_cache(memory.requires_grad_())  # gradients kept: the modules
    with torch.no_grad(), capture_attention(model):
        model.new_cache(memory)
    assert calls == []
    with pytest.raises(ValueError, match="memory_kv takes"):
        native.memory_kv(native.Product.of(model.decoder.layers[0].cross_attn.kv_proj.product),
                         torch.randn(1, 3, 32), 4, None, 0.0)
    with pytest.raises(ValueError, match="layer_norm takes"):  # 12 features: not a multiple of 8
        native.layer_norm(torch.randn(2, 12), torch.ones(12), torch.zeros(12), 1e-5)


@pytest.mark.parametrize("norm_first, qk_norm, avx512", [(True, True, True), (False, False, True),
                                                         (True, True, False)])
def test_the_native_encoded_cache_is_encode_then_new_cache(monkeypatch, norm_first, qk_norm, avx512):
    """Sentences joining a search get the encoder and every decoder layer's cross-attention K/V
    in one call of the kernel (``NativeTransformer.encoded_cache``: ``native.encode_memory``):
    the floats of ``encode`` then ``new_cache`` (which a batch's first step computes; the
    memory_kv test above holds new_cache's to the modules') to the bit, of their shapes and
    dtype, padded sentences as if alone up to rounding; a pass that keeps gradients or records
    the attention takes the modules; an id outside the embedding is a ValueError."""
    model, src = small_int8_encoder(monkeypatch, avx512, norm_first, qk_norm, decoder_layers=2)
    calls, kernel = [], native.encode_memory
    monkeypatch.setattr(native, "encode_memory", lambda *a: calls.append(a[1].shape) or kernel(*a))
    kept = ~model.src_pad_mask(src)
    with torch.no_grad():
        ours, theirs = model.encoded_cache(src), Transformer.encoded_cache(model, src)
        assert calls == [(3, 9)]
        alone = [model.encoded_cache(src[i:i + 1, :int(kept[i].sum())]) for i in range(3)]
    for layer, (mine, its) in enumerate(zip(ours.layers, theirs.layers, strict=True)):
        for name in ("k", "v"):
            a, b = mine["cross"][name], its["cross"][name]
            assert a.dtype == b.dtype == torch.float16 and a.shape == b.shape == (3, 4, 9, 16)
            assert torch.equal(a, b)
            for i in range(3):  # padding changes nothing but rounding
                own = alone[i].layers[layer]["cross"][name][0]
                assert torch.allclose(a[i][:, :own.size(1)].float(), own.float(), atol=2e-3, rtol=2e-3)
    calls.clear()
    model.encoded_cache(src)  # gradients kept: the modules
    with torch.no_grad(), capture_attention(model):
        model.encoded_cache(src)
    assert calls == []
    with torch.no_grad(), pytest.raises(ValueError, match="outside the tables"):
        model.encoded_cache(torch.full((1, 3), 40))


def sharp_model(norm_first: bool, restricted: bool) -> Transformer:
    """A small random model whose output layer is sharpened and leans to EOS (sentences end
    at several lengths), scoring every piece or (``restricted``) a few of them."""
    torch.manual_seed(5)
    cfg = ModelConfig(src_vocab_size=40, tgt_vocab_size=40, d_model=32, n_heads=4, d_ff=64,
                      n_encoder_layers=1, n_decoder_layers=2, dropout=0.0, max_len=32,
                      norm_first=norm_first, output_vocab="targets" if restricted else "all",
                      tie_embeddings="none", embedding_init="xavier")
    model = Transformer(cfg).eval()
    proj = nn.Linear(cfg.d_model, 40)
    with torch.no_grad():
        proj.weight.copy_(model.generator.proj.weight * 3.0)
        proj.bias.zero_()
        proj.bias[EOS_ID] = 3.0
    model.generator.proj = proj
    if restricted:
        model.generator.set_outputs(torch.tensor([EOS_ID, 4, 5, 7, 9, 11, 12, 20, 28, 31, 39]))
    return model


def searched_both_ways(model: Transformer, search: Search) -> list[list[list]]:
    """A joinable search's lists (sentences joining at several steps) and a batch beam
    search's, each as [(ids, score)] per sentence."""
    kernel = Int8Output(model.generator)
    lengths = [7, 3, 9, 5, 6]
    src = random_sources(lengths, vocab=40, seed=2)
    joinable, got, step = JoinableSearch(model, search, kernel), {}, 0
    plan = {0: [0, 1], 2: [2], 3: [3], 9: [4]}
    while len(got) < len(lengths):
        for i in plan.get(step, []):
            joinable.add([i], src[i:i + 1, :lengths[i]])
        got.update(joinable.step())
        step += 1
    batch = beam_search(model, src, search.beam, search.alpha, search.max_len_b, search.beam,
                        no_repeat_ngram=search.no_repeat_ngram, kernel=kernel)
    return [[[(h.ids, h.score) for h in got[i]] for i in range(len(lengths))],
            [[(h.ids, h.score) for h in hyps] for hyps in batch]]


@pytest.mark.parametrize("norm_first, restricted, guard, beam", [
    (True, False, 0, 4), (False, True, 2, 3), (True, True, 3, 1), (True, False, 2, 6)])
def test_the_whole_beam_step_in_one_call_chooses_what_the_calls_one_by_one_choose(
        monkeypatch, norm_first, restricted, guard, beam):
    """``native.beam_step`` (the decoder, the masks, the top-k and the choice in one call) gives
    the hypotheses of the same kernels called one by one (``next_logits`` and ``expand``), and
    their scores up to rounding (its final layer norm is C's, not PyTorch's), in a joinable
    search whose rows start at several columns and in a batch beam search; with the
    repetition guard and a restricted output layer, pre- and post-norm."""
    model = int8_model(sharp_model(norm_first, restricted))
    search = Search(beam, 0.6, no_repeat_ngram=guard, max_len_b=8)
    calls, whole = [], native.beam_step
    monkeypatch.setattr(native, "beam_step", lambda *a, **k: calls.append(1) or whole(*a, **k))
    ours = searched_both_ways(model, search)
    assert len(calls) >= 10
    with monkeypatch.context() as m:
        m.setattr(Int8Output, "beam_step", lambda self, *a: None)
        theirs = searched_both_ways(model, search)
    assert len({len(ids) for lists in ours[0] for ids, _ in lists}) >= 2  # several lengths
    for mine, other in zip(ours, theirs, strict=True):
        for a, b in zip(mine, other, strict=True):
            assert [ids for ids, _ in a] == [ids for ids, _ in b]
            assert [score for _, score in a] == pytest.approx([score for _, score in b], abs=1e-5)


def _beam_rows(answer, K: int, C: int) -> np.ndarray:
    """The (A*K,) rows that a ``native.beam_step`` answer's survivors follow (sentence-major)."""
    host = answer[0]
    beam_of = host[:, 3 * C + K:3 * C + 2 * K].astype(np.int64)
    return (np.arange(len(host))[:, None] * K + beam_of).reshape(-1)


def test_the_whole_beam_step_writes_the_slot_table_the_cache_would_make(monkeypatch):
    """After a whole beam step in one call that every sentence survives, the cache's stores
    take the slot table the call wrote (``native.beam_step``'s ``followed``) rather than make
    it: it is the table ``Store.reorder`` makes of the rows the choice follows, in a joinable
    search whose rows start at several columns, whose sentences leave and whose cache is
    trimmed, and in a batch beam search."""
    model = int8_model(sharp_model(True, False))
    made, taken = [], []
    whole, follow = native.beam_step, Store.follow

    def writing(*args, **kwargs):
        answer = whole(*args, **kwargs)
        made.append((args[8], _beam_rows(answer, args[5].size(1), args[2].candidates)))
        return answer

    def checked(self, ancestry):
        for table, rows in made:
            if ancestry is table:
                want = self.slots().index_select(0, torch.from_numpy(rows))
                taken.append(torch.equal(ancestry, want))
        return follow(self, ancestry)

    monkeypatch.setattr(native, "beam_step", writing)
    monkeypatch.setattr(Store, "follow", checked)
    searched_both_ways(model, Search(4, 0.6, no_repeat_ngram=2, max_len_b=8))
    assert len(taken) >= 10 and all(taken)


def test_the_whole_beam_step_follows_the_rows_as_the_search_would(monkeypatch):
    """A whole beam step given the rows' totals also answers their history and totals after
    it, every row following its chosen beam (what ``Rows.follow`` makes of them), and says
    that nothing ends exactly where no sentence has EOS among its K best candidates and each
    keeps a live beam; the searches then skip ``settle`` (the lists: the tests above)."""
    model = sharp_model(True, False)
    with torch.no_grad():
        model.generator.proj.bias[EOS_ID] = 1.0  # less sharp: steps at which nothing ends too
    model, whole, K, seen = int8_model(model), native.beam_step, 4, []

    def checked(*args, **kwargs):
        answer = whole(*args, **kwargs)
        history, totals = args[6], args[9] if len(args) > 9 else kwargs.get("totals")
        if totals is None:
            return answer
        C = args[2].candidates
        rows, host = _beam_rows(answer, K, C), answer[0]
        alive = host[:, 3 * C:3 * C + 3 * K]
        assert np.array_equal(answer[3][0], np.concatenate(
            [history[rows], alive[:, 2 * K:].reshape(-1, 1).astype(np.int64)], axis=1))
        assert np.array_equal(answer[3][1], np.concatenate(
            [totals[rows], alive[:, :K].reshape(-1, 1)], axis=1))
        quiet = not (host[:, 2 * C:2 * C + K] == EOS_ID).any() and np.isfinite(alive[:, :K]).any(1).all()
        assert answer[3][2] == quiet
        seen.append(quiet)
        return answer

    monkeypatch.setattr(native, "beam_step", checked)
    searched_both_ways(model, Search(K, 0.0, no_repeat_ngram=2, max_len_b=20))
    assert seen.count(True) >= 5 and seen.count(False) >= 5


def test_the_whole_beam_steps_that_follow_the_rows_give_each_sentence_its_lists_to_the_end(
        monkeypatch):
    """With limits short enough that sentences end there too (steps at which nothing else
    ends, and a sentence joining late), the lists of the whole beam step (steps that follow
    the rows in the kernel included) equal those of the kernels called one by one: the same
    ids, scores and per-token log-probabilities up to rounding."""
    model = sharp_model(True, False)
    with torch.no_grad():
        model.generator.proj.bias[EOS_ID] = 1.0  # less sharp: many steps end nothing
    model = int8_model(model)
    search = Search(4, 0.6, max_len_a=0.0, max_len_b=5)

    def lists() -> list:
        kernel, src = Int8Output(model.generator), random_sources([7, 3, 9], vocab=40, seed=4)
        joinable, got = JoinableSearch(model, search, kernel), {}
        joinable.add([0, 1], src[:2, :7])
        for step in range(12):
            if step == 2:
                joinable.add([2], src[2:])
            got.update(joinable.step())
        return [got[i] for i in range(3)] + decode_beam(model, src, search, kernel=kernel)

    followed = []
    whole = native.beam_step
    monkeypatch.setattr(native, "beam_step", lambda *a, **k: followed.append(
        k.get("totals", a[9] if len(a) > 9 else None) is not None) or whole(*a, **k))
    ours = lists()
    with monkeypatch.context() as m:
        m.setattr(Int8Output, "beam_step", lambda self, *a: None)
        theirs = lists()
    assert followed.count(True) >= 4 and followed.count(False) >= 2  # limits reached on some
    for mine, other in zip(ours, theirs, strict=True):
        assert [h.ids for h in mine] == [h.ids for h in other] and mine
        for a, b in zip(mine, other, strict=True):
            assert a.score == pytest.approx(b.score, abs=1e-5)
            assert a.log_probs == pytest.approx(b.log_probs, abs=1e-5)


def test_the_whole_beam_steps_places_are_made_again_only_when_what_they_point_into_changes(
        monkeypatch):
    """A search's whole beam steps reuse the places kept on its cache (each layer's, made
    anew only when a tensor they point into changes: sentences join or leave, a store grows):
    a sentence searched alone makes them once; one joining it makes them again (that they
    point right: the tests above)."""
    model = int8_model(sharp_model(True, False))
    kernel, src = Int8Output(model.generator), random_sources([9, 6], vocab=40, seed=2)
    calls, made = [], []
    whole, places = native.beam_step, NativeDecoderLayer._places
    monkeypatch.setattr(native, "beam_step", lambda *a, **k: calls.append(1) or whole(*a, **k))
    monkeypatch.setattr(NativeDecoderLayer, "_places",
                        lambda self, *a: made.append(1) or places(self, *a))
    layers = len(model.decoder.layers)
    search = JoinableSearch(model, Search(4, 0.0, max_len_b=20), kernel)
    search.add([0], src[:1])
    search.step()  # a search's first step is the modules'
    made.clear()
    for _ in range(3):
        search.step()
    assert len(calls) == 3 and len(made) == layers
    search.add([1], src[1:, :6])
    search.step()
    assert len(calls) == 4 and len(made) == 2 * layers


def test_a_sentence_leaving_as_another_joins_is_not_stepped_on_the_old_places(monkeypatch):
    """A search's steps between changes repeat the last one (``StepAgain``) while the cache
    keeps its places. One sentence removed and another added before the next step leaves as
    many rows and the same stores, but new memory buffers: the next step makes its places
    anew, and each sentence gets the lists it gets alone."""
    model = int8_model(sharp_model(True, False))
    search, kernel = Search(4, 0.6, max_len_b=20), Int8Output(model.generator)
    src = random_sources([9, 6, 8], vocab=40, seed=4)
    checked, repeated = [], []
    full, again = NativeTransformer.beam_step, StepAgain.__call__
    monkeypatch.setattr(NativeTransformer, "beam_step",
                        lambda *a, **k: checked.append(1) or full(*a, **k))
    monkeypatch.setattr(StepAgain, "__call__", lambda *a, **k: repeated.append(1) or again(*a, **k))
    joinable, got = JoinableSearch(model, search, kernel), {}
    joinable.add([0, 1], src[:2])
    for _ in range(4):
        got.update(joinable.step())
    assert len(joinable) == 2 and len(repeated) > len(checked)  # none done; steps repeated
    kept = joinable.state.cache.kernel_places
    joinable.remove([0])
    joinable.add([2], src[2:3])
    assert joinable.state.again is None
    checked.clear()
    got.update(joinable.step())
    assert checked and joinable.state.cache.kernel_places is not kept  # its places made anew
    while len(joinable):
        got.update(joinable.step())
    for i in (1, 2):
        alone = beam_search(model, src[i:i + 1], 4, 0.6, 20, 4, kernel=kernel)[0]
        assert [h.ids for h in got[i]] == [h.ids for h in alone]
        assert [h.score for h in got[i]] == pytest.approx([h.score for h in alone], abs=1e-5)


def joined_two_at_a_time(model: Transformer, search: Search, src: torch.Tensor, most: int,
                         wake: int | None = None) -> tuple[dict, list[int], list[int]]:
    """Each sentence's (ids, score, log-probs) lists from a search that holds two sentences,
    the next joining as one ends, stepped with ``most``; the steps each call took, and those
    of each call right after a sentence joined."""
    joinable, got, sent = JoinableSearch(model, search, Int8Output(model.generator)), {}, 0
    taken, after_join = [], []
    while len(got) < len(src):
        joined = sent < len(src) and len(joinable) < 2
        if joined:
            joinable.add([sent], src[sent:sent + 1])
            sent += 1
        for key, hyps in joinable.step(most, wake):
            got[key] = [(h.ids, h.score, h.log_probs) for h in hyps]
        rows = joinable.rows  # each live sentence's count of finished hypotheses is its list's
        assert rows.ends.tolist() == [len(joinable.finished[int(s)]) for s in rows.sentence]
        taken.append(joinable.taken)
        if joined:
            after_join.append(joinable.taken)
    return got, taken, after_join


@pytest.mark.parametrize("guard, a, b, eos", [(0, 1.0, 20, 3.0), (2, 1.0, 20, 3.0), (0, 0.5, 2, -20.0)],
                         ids=["no-guard", "guard-2", "no-eos-short-limits"])
def test_quiet_steps_taken_in_one_call_are_the_steps_taken_one_at_a_time(guard, a, b, eos, monkeypatch):
    """A search's steps while no sentence is done may go in one call of the kernel
    (``JoinableSearch.step(most)``), the hypotheses that end meanwhile kept by the kernel:
    with sentences joining as others end, with the repetition guard, and with sentences that
    never choose EOS and end at their length limits (a call must stop before a sentence's
    last step), every sentence gets the same hypotheses, scores and per-token
    log-probabilities as from one step a call (the same kernels: equal floats), in as many
    steps, some calls taking several: where EOS is likely, some of them past steps at which
    hypotheses ended; where hypotheses end only at the limits, a call right after a sentence
    joined among them (the step that makes the kernel's places anew)."""
    model = sharp_model(True, False)
    with torch.no_grad():
        model.generator.proj.bias[EOS_ID] = eos
    model = int8_model(model)
    src = random_sources([9, 6, 8, 12, 5, 7], vocab=40, seed=4)
    search = Search(4, 0.6, no_repeat_ngram=guard, max_len_a=a, max_len_b=b)
    finished, finish = [], Rows._finish  # every hypothesis finished, in order, as made

    def logged(rows, lists, a, history, totals, score, last, step, alpha):
        finished.append((int(rows.sentence[a]), step, history[int(rows.offset[a]):].tolist(), score, last))
        finish(rows, lists, a, history, totals, score, last, step, alpha)

    monkeypatch.setattr(Rows, "_finish", logged)
    one, one_taken, _ = joined_two_at_a_time(model, search, src, 1)
    one_finished, finished[:] = finished[:], []
    kept, finish_ended = [], Rows.finish_ended
    monkeypatch.setattr(Rows, "finish_ended",
                        lambda rows, lists, ended, alpha: (kept.append(len(ended[0])),
                                                           finish_ended(rows, lists, ended, alpha)))
    several, taken, after_join = joined_two_at_a_time(model, search, src, 8)
    assert several == one and len(one) == len(src) and finished == one_finished
    assert set(one_taken) == {1} and sum(taken) == sum(one_taken) and max(taken) > 1
    if eos < 0:  # nothing ends before the limits: a call after a join has quiet steps too
        assert max(after_join) > 1 and not kept
    else:  # hypotheses ended within calls: the kernel kept them, the same as a step a call
        assert sum(kept) >= 3


def test_a_call_of_several_steps_stops_once_something_arrives():
    """The steps of one call stop after the first where the file descriptor ``wake`` has
    something to read (a serving lane's pipe: a sentence joining or leaving waits for no
    more than a step), and go on where it has nothing."""
    model = int8_model(sharp_model(True, False))
    src = random_sources([9, 6, 8, 12, 5, 7], vocab=40, seed=4)
    search = Search(4, 0.6, max_len_b=20)
    quiet, empty = os.pipe()
    woken, written = os.pipe()
    os.write(written, b"x")
    try:
        expected, taken, _ = joined_two_at_a_time(model, search, src, 8, quiet)
        got, woken_taken, _ = joined_two_at_a_time(model, search, src, 8, woken)
    finally:
        for fd in (quiet, empty, woken, written):
            os.close(fd)
    assert max(taken) > 1 and set(woken_taken) == {1} and got == expected


def test_the_whole_beam_step_holds_what_its_places_point_into(monkeypatch):
    """A search in another thread may replace the model's padding mask while this search's
    call runs (the kernel lets go of the GIL): what the call reads stays alive and unchanged,
    at a step that made its places and at the steps that repeat it (``StepAgain``). Here the
    model's copy is dropped wherever there is one and its memory likely reused with zeros
    (masking every source position) at each call: the hypotheses do not change."""
    model = int8_model(sharp_model(True, False))
    search = Search(4, 0.6, max_len_b=8)
    theirs = searched_both_ways(model, search)
    whole, dropped = native.beam_step, []

    def meddled(*args, **kwargs):
        seen = model.__dict__.pop("_padding_seen", None)
        dropped.append(seen is not None)
        if seen is not None:
            shape = seen[1].shape
            del seen
            _ = [torch.zeros(shape, dtype=torch.bool) for _ in range(4)]  # the freed block, reused
        return whole(*args, **kwargs)

    monkeypatch.setattr(native, "beam_step", meddled)
    assert searched_both_ways(model, search) == theirs
    assert any(dropped) and not all(dropped)  # both kinds of step were taken
