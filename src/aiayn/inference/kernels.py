"""The output layer's product h W^T through oneDNN where this machine runs it faster.

The output layer (``model.Generator``) is the largest matmul of a small model: the demo's
(~1,000 x 256) decoder output times a (5,303 x 256) embedding, a third of its training
step's matmul time. PyTorch runs fp32 matmuls through its BLAS (MKL in the x86 wheels); on
an AVX2 AMD EPYC, MKL runs this one shape, a (d x V) right-hand side with V >> d, at half
the FLOP rate of its other products, while oneDNN, which PyTorch also ships, runs it ~1.6x
faster (docs/findings.md#the-price-of-a-step). The backward products
(g W and g^T h) are as fast in MKL, so only the forward changes.

Which is faster depends on the CPU and its libraries, so it is measured, not assumed:
:func:`choose_output_kernel` times both on the generator's own shape (on one thread, like
the bf16 probe of ``aiayn.util.device``) and returns oneDNN's product only when it is
clearly faster. The model keeps no choice: whoever computes with it holds the product it
chose (the Trainer, a Translator, a serving lane) and passes it to
``Generator.output_logits`` (or ``Transformer.forward``), None meaning ``F.linear``.
Output layers too small to matter are not probed (and so are computed the same way in
every process). Under bf16 autocast, on a GPU, inside ``torch.compile`` (train.compile:
inductor cannot lower the op) or where oneDNN is missing, ``F.linear`` runs as always.

Given a plain weight, oneDNN reorders it into its blocked layout at every call: at the few
rows of a decoding step that reorder is most of the product. A search's weight does not
change, so each search packs it once (:func:`for_fixed_weight`, ``PackedOneDNN``): the same
values as the unpacked product, in less time (docs/translating.md#how-decoding-works).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor

from aiayn.inference.topk import topk_rows
from aiayn.model import OutputKernel
from aiayn.util.threads import on_one_thread

# Output layers with fewer weights than this (d x V) are left to BLAS without a probe: a
# gain there is nothing next to the rest of a step. The tests' tiny models are far below it.
MIN_PROBED_WEIGHTS = 1 << 20
MARGIN = 1.1  # oneDNN must be this much faster in the probe (a tie keeps BLAS)


def onednn_available() -> bool:
    """Whether this PyTorch build has oneDNN's dense linear (x86 CPU wheels do)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._linear_pointwise  # noqa: B018 (the op's existence is the question)
    except (AttributeError, RuntimeError):
        return False
    return True


def _onednn_forward(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x W^T + b in oneDNN (no fused activation)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight.contiguous(), bias,
                                              "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    """y = x W^T + b, forward in oneDNN; backward dL/dx = g W, dL/dW = g^T x in the BLAS."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        return _onednn_forward(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.size(-1))
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = rows.t() @ x.reshape(-1, x.size(-1)) if ctx.needs_input_grad[1] else None
        grad_b = rows.sum(0) if ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, onednn: bool) -> Tensor:
    """``F.linear(x, weight, bias)``, with the forward in oneDNN when ``onednn`` and this is
    an fp32 product on a CPU outside autocast; the same values up to rounding."""
    if (onednn and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling()):  # inductor cannot lower the op
        return _OneDNNLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The product an output layer runs once oneDNN was chosen for it."""
    return linear(x, weight, bias, onednn=True)


# The rows oneDNN chooses a packed layout for. It computes the same values whatever the
# rows (checked: packed for 1 to 1,000 rows, all gave identical products at 1 to 300 rows).
PACK_ROWS = 64


class PackedOneDNN:
    """oneDNN's product with one weight that does not change (an ``OutputKernel``), reordered
    into oneDNN's layout once, here; the weight a caller passes must be of that shape (as
    ``Generator.output_logits`` passes a search's rows). What the packed form does not cover
    (autocast, a graph to differentiate, non-fp32 input) goes to ``onednn_linear``."""

    def __init__(self, weight: Tensor):
        self.shape = tuple(weight.shape)
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(),
                                                                  PACK_ROWS)

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        if tuple(weight.shape) != self.shape:
            raise ValueError(f"PackedOneDNN packed a {self.shape} weight, got {tuple(weight.shape)}")
        if (x.dtype != torch.float32 or torch.is_autocast_enabled("cpu")
                or (torch.is_grad_enabled() and x.requires_grad)):
            return onednn_linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, bias, "none", [], "")


def for_fixed_weight(kernel: OutputKernel | None, weight: Tensor) -> OutputKernel | None:
    """The product to call at every step of a search with this ``weight``: oneDNN's with the
    weight packed once where ``kernel`` is oneDNN's fp32 CPU product; else ``kernel``."""
    if (kernel is onednn_linear and weight.device.type == "cpu"
            and weight.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")):
        return PackedOneDNN(weight)
    return kernel


def probe_seconds(rows: int, d: int, vocab: int, repeats: int = 3) -> tuple[float, float]:
    """The fastest of ``repeats`` (rows x d) @ (vocab x d)^T products, BLAS and oneDNN, on
    one thread, alternating so that a change of the machine's speed hits both."""
    numbers = torch.Generator().manual_seed(0)  # not the global stream a run draws from
    x, w = torch.randn(rows, d, generator=numbers), torch.randn(vocab, d, generator=numbers)

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def both() -> tuple[float, float]:
        blas = onednn = float("inf")
        for _ in range(repeats):
            blas = min(blas, timed(lambda: F.linear(x, w)))
            onednn = min(onednn, timed(lambda: _onednn_forward(x, w)))
        return blas, onednn

    return on_one_thread(both)


def choose_output_kernel(generator, rows: int, enabled: bool = True
                         ) -> tuple[OutputKernel, str]:
    """The product for ``generator``'s products of ``rows`` decoder positions (the training
    batch, or the rows a decoding step holds), and why, for the log. ``enabled`` False
    (bf16 autocast, a GPU) keeps BLAS without probing."""
    weight = generator.proj.weight
    vocab, d = int(generator.output_ids.numel()), weight.size(1)
    if not enabled or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return F.linear, "output layer: F.linear (not an fp32 CPU product)"
    if vocab * d < MIN_PROBED_WEIGHTS:
        return F.linear, f"output layer: F.linear ({vocab} x {d} weights: too small to probe)"
    if not onednn_available():
        return F.linear, "output layer: F.linear (this PyTorch has no oneDNN linear)"
    blas, onednn = probe_seconds(rows, d, vocab)
    kernel = onednn_linear if onednn * MARGIN < blas else F.linear
    return kernel, (f"output layer: {output_kernel_name(kernel)} (a probe took "
                    f"{blas * 1e3:.1f} ms in BLAS, {onednn * 1e3:.1f} ms in oneDNN)")


def output_kernel_name(kernel: OutputKernel | None) -> str:
    """The name of a product (what a train state records): "oneDNN" or "F.linear" (None)."""
    return "oneDNN" if kernel is onednn_linear else "F.linear"


def output_kernel(name: str) -> OutputKernel:
    """The product of an :func:`output_kernel_name` (a choice made before: kept by a resume,
    or rank 0's for every rank), without probing; F.linear where oneDNN is missing."""
    return onednn_linear if name == "oneDNN" and onednn_available() else F.linear


def log_softmax(logits: Tensor, kernel: OutputKernel | None) -> Tensor:
    """(N, V') float logits -> log-probabilities: the output kernel's own softmax where it
    brings one (aiayn's int8 engine's, ``Int8Output.log_softmax``), else PyTorch's. The
    searches (aiayn.inference.steps) and scoring (aiayn.inference.scoring) share it: a
    search's score is what scoring its translation gives."""
    own = getattr(kernel, "log_softmax", None)
    return own(logits) if own is not None else torch.log_softmax(logits, dim=-1)


def top_log_probs(logits: Tensor, k: int, kernel: OutputKernel | None) -> tuple[Tensor, Tensor]:
    """(N, V') float logits -> the k best log-probabilities of each row, best first, and their
    columns (N, k): ``log_softmax``'s values, then ``topk_rows``; in one pass where the output
    kernel brings one (``Int8Output.top_log_softmax``: the same floats)."""
    own = getattr(kernel, "top_log_softmax", None)
    return own(logits, k) if own is not None else topk_rows(log_softmax(logits, kernel), k)
