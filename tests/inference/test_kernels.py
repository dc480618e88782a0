"""The output layer's oneDNN product: the same values and gradients as F.linear, used only
where chosen, and chosen by what the probe measured."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from aiayn.config import ModelConfig
from aiayn.data.batching import pad
from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from aiayn.inference import kernels
from aiayn.inference.joinable import JoinableSearch
from aiayn.inference.steps import DecoderState
from aiayn.inference.translator import Translator
from aiayn.model import Transformer

needs_onednn = pytest.mark.skipif(not kernels.onednn_available(),
                                  reason="this PyTorch has no oneDNN linear")

CFG = ModelConfig(src_vocab_size=40, tgt_vocab_size=50, d_model=32, n_heads=4, d_ff=48,
                  n_encoder_layers=1, n_decoder_layers=1, dropout=0.0, max_len=32,
                  tie_embeddings="all", output_vocab="targets")


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, CFG.src_vocab_size, (3, 9), generator=g)
    src[:, -1], src[0, 6:] = EOS_ID, PAD_ID
    tgt = torch.randint(4, CFG.tgt_vocab_size, (3, 8), generator=g)
    tgt[:, 0], tgt[1, 5:] = BOS_ID, PAD_ID
    return src, tgt[:, :-1], tgt[:, 1:]


@needs_onednn
def test_onednn_linear_matches_f_linear_in_values_and_gradients():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 7, 16, generator=g, requires_grad=True)
    w = torch.randn(30, 16, generator=g, requires_grad=True)
    b = torch.randn(30, generator=g, requires_grad=True)
    up = torch.randn(4, 7, 30, generator=g)
    for bias in (None, b):
        ours = kernels.linear(x, w, bias, onednn=True)
        (ours * up).sum().backward()
        grads = [t.grad.clone() for t in (x, w, b) if t.grad is not None]
        x.grad = w.grad = b.grad = None
        ref = F.linear(x, w, bias)
        (ref * up).sum().backward()
        assert type(ours.grad_fn) is not type(ref.grad_fn)  # the oneDNN path ran
        torch.testing.assert_close(ours, ref)
        for ours_grad, ref_grad in zip(grads, [t.grad for t in (x, w, b) if t.grad is not None],
                                       strict=True):
            torch.testing.assert_close(ours_grad, ref_grad)
        x.grad = w.grad = b.grad = None


def graph_names(t: torch.Tensor) -> set[str]:
    """The names of every backward node behind ``t``."""
    names, stack, seen = set(), [t.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(node.name())
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


@needs_onednn
@pytest.mark.parametrize("output_vocab", ["targets", "all"])
def test_a_training_step_is_the_same_with_either_kernel(output_vocab):
    """Loss and every gradient of a tied model, its output layer restricted (the demo's) or
    not."""
    torch.manual_seed(0)
    model = Transformer(replace(CFG, output_vocab=output_vocab))
    if output_vocab == "targets":
        model.generator.set_outputs(torch.arange(4, 37))
    src, tgt_in, tgt_out = batch()
    results = []
    for onednn in (False, True):
        model.zero_grad()
        loss = model(src, tgt_in, tgt_out, kernel=kernels.onednn_linear if onednn else F.linear)
        assert ("_OneDNNLinearBackward" in graph_names(loss)) is onednn  # the path taken
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_blas, grads_blas), (loss_dnn, grads_dnn) = results
    torch.testing.assert_close(loss_dnn, loss_blas)
    assert grads_dnn.keys() == grads_blas.keys()
    for name in grads_blas:
        torch.testing.assert_close(grads_dnn[name], grads_blas[name], msg=name)
    with torch.no_grad():  # a search's steps: the rows it selected once, the same logits
        hidden, rows = torch.randn(2, 3, CFG.d_model), model.generator.allowed_rows()
        torch.testing.assert_close(
            model.generator.output_logits(hidden, rows, kernels.onednn_linear),
            model.generator.output_logits(hidden, rows, F.linear))


def test_autocast_and_unchosen_products_stay_with_f_linear():
    x, w = torch.randn(5, 8, requires_grad=True), torch.randn(6, 8)
    assert kernels.linear(x, w, None, onednn=False).grad_fn.name() == F.linear(x, w).grad_fn.name()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = kernels.linear(x, w, None, onednn=True)
    assert out.dtype == torch.bfloat16  # autocast's own product, not the fp32 kernel


def big_generator():
    """An output layer over MIN_PROBED_WEIGHTS, so that the choice is probed."""
    d = 64
    cfg = ModelConfig(src_vocab_size=10, tgt_vocab_size=kernels.MIN_PROBED_WEIGHTS // d + 1,
                      d_model=d, n_heads=4, d_ff=32, n_encoder_layers=1, n_decoder_layers=1,
                      max_len=16)
    return Transformer(cfg).generator


@pytest.mark.parametrize("blas, onednn, chosen", [(2.0, 1.0, True), (1.05, 1.0, False),
                                                  (1.0, 2.0, False)])
def test_the_choice_follows_the_probe(monkeypatch, blas, onednn, chosen):
    monkeypatch.setattr(kernels, "onednn_available", lambda: True)
    monkeypatch.setattr(kernels, "probe_seconds", lambda rows, d, vocab: (blas, onednn))
    generator = big_generator()
    kernel, why = kernels.choose_output_kernel(generator, rows=64)
    assert (kernel is kernels.onednn_linear) is chosen
    assert kernels.output_kernel_name(kernel) == ("oneDNN" if chosen else "F.linear")
    assert ("oneDNN (a probe" if chosen else "F.linear (a probe") in why
    assert f"{blas * 1e3:.1f} ms in BLAS" in why


def test_no_probe_where_it_cannot_matter(monkeypatch):
    def probe(*args):
        raise AssertionError("probed")
    monkeypatch.setattr(kernels, "probe_seconds", probe)
    kernel, why = kernels.choose_output_kernel(Transformer(CFG).generator, rows=64)
    assert kernel is F.linear and "too small to probe" in why
    kernel, why = kernels.choose_output_kernel(big_generator(), 64, enabled=False)
    assert kernel is F.linear and "not an fp32 CPU product" in why


def test_a_recorded_name_gives_its_product_back():
    """A train state records the name (train_state.pt "choices"); a resume turns it back."""
    for kernel in (F.linear, kernels.onednn_linear):
        name = kernels.output_kernel_name(kernel)
        expected = kernel if kernels.onednn_available() else F.linear
        assert kernels.output_kernel(name) is expected
    assert kernels.output_kernel_name(None) == "F.linear"


class Counted:
    """F.linear that counts its calls: which product a computation went through."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x, weight, bias=None):
        self.calls += 1
        return F.linear(x, weight, bias)


def test_a_translator_keeps_the_choice_it_is_given_and_searches_with_it():
    model = Transformer(CFG).eval()
    model.generator.set_outputs(torch.arange(4, 37))
    assert Translator(model, tokenizers=None).kernel is F.linear  # chosen: too small to probe
    counted = Counted()  # as a Trainer's choice, handed to its validation's Translator
    given = Translator(model, tokenizers=None, kernel=counted)
    assert given.kernel is counted
    sources = [[5, 6, 7, EOS_ID], [8, 9, EOS_ID]]
    plain = Translator(model, tokenizers=None)
    for beam in (1, 3):
        counted.calls = 0
        search = plain.resolve(beam=beam)
        assert given.decode_ids(sources, search) == plain.decode_ids(sources, search)
        assert counted.calls > 0  # every step of the search went through the given product
    assert not hasattr(model.generator, "kernel")  # the model keeps no choice of anyone's


@needs_onednn
def test_torch_compile_takes_f_linear():
    """train.compile: inductor cannot lower oneDNN's op, so a compiled model keeps F.linear."""
    x, w = torch.randn(6, 8, requires_grad=True), torch.randn(5, 8, requires_grad=True)
    compiled = torch.compile(lambda x, w: kernels.linear(x, w, None, onednn=True))
    out = compiled(x, w)
    out.sum().backward()
    torch.testing.assert_close(out, F.linear(x, w))
    torch.testing.assert_close(w.grad, torch.ones(6, 5).t() @ x)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_a_packed_weight_gives_the_unpacked_products_values(rows):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 48, generator=g), torch.randn(200, 48, generator=g)
    b = torch.randn(200, generator=g)
    packed = kernels.PackedOneDNN(w)
    with torch.inference_mode():
        out = packed(x, w, b)
    torch.testing.assert_close(out, kernels.onednn_linear(x, w, b))
    torch.testing.assert_close(out, F.linear(x, w, b))
    torch.testing.assert_close(packed(x.view(rows, 1, 48), w, b), out.view(rows, 1, 200))
    with pytest.raises(ValueError, match="packed a"):
        packed(x, w[:-1], b[:-1])


@needs_onednn
def test_what_the_packed_form_does_not_cover_goes_to_the_unpacked_product():
    w = torch.randn(20, 8)
    packed = kernels.PackedOneDNN(w)
    x = torch.randn(3, 8, requires_grad=True)
    out = packed(x, w)
    out.sum().backward()  # a graph to differentiate: onednn_linear's
    torch.testing.assert_close(x.grad, torch.ones(3, 20) @ w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert packed(x.detach(), w).dtype == torch.bfloat16


@needs_onednn
def test_a_search_packs_only_oneDNNs_fp32_cpu_weight():
    w = torch.randn(20, 8)
    assert isinstance(kernels.for_fixed_weight(kernels.onednn_linear, w), kernels.PackedOneDNN)
    for kernel in (None, F.linear, Counted()):
        assert kernels.for_fixed_weight(kernel, w) is kernel
    assert kernels.for_fixed_weight(kernels.onednn_linear, w.bfloat16()) is kernels.onednn_linear
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert kernels.for_fixed_weight(kernels.onednn_linear, w) is kernels.onednn_linear


@needs_onednn
def test_searches_with_the_onednn_product_decode_as_with_f_linear():
    """Beam and greedy search, batched and joinable, pack the output layer's weight once and
    choose the tokens F.linear's products lead to."""
    model = Transformer(CFG).eval()
    model.generator.set_outputs(torch.arange(4, 37))
    sources = [[5, 6, 7, EOS_ID], [8, 9, EOS_ID], [10, 11, 12, 13, 9, EOS_ID]]
    plain = Translator(model, tokenizers=None)
    onednn = Translator(model, tokenizers=None, kernel=kernels.onednn_linear)
    tokens = lambda results: [hyps[0].ids for hyps in results]  # noqa: E731  (the best)
    for beam in (1, 4):
        search = plain.resolve(beam=beam)
        expected = tokens(plain.decode_ids(sources, search))
        assert tokens(onednn.decode_ids(sources, search)) == expected
        joining = JoinableSearch(model, search, kernels.onednn_linear)
        assert isinstance(joining.state.kernel, kernels.PackedOneDNN)
        done = {}
        for key, source in enumerate(sources):  # each joins the search already running
            joining.add([key], pad([source]))
            done.update(joining.step())
        while len(joining):
            done.update(joining.step())
        assert tokens(done[key] for key in range(len(sources))) == expected
    state = DecoderState(model, torch.tensor([sources[1]]), 1, True, kernel=kernels.onednn_linear)
    assert isinstance(state.kernel, kernels.PackedOneDNN)
