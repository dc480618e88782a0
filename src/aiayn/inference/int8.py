"""Decoding with an int8 output layer on a CPU: the output layer's product h W^T (a third of
a small model's decoding step) with W in int8 (one scale per output row) and each row of h
quantized to int8 on its own scale, through FBGEMM, the x86 int8 GEMM that PyTorch's CPU
builds ship (``torch.ops.quantized.linear_dynamic``). ``Int8Output`` is that product as a
``model.OutputKernel``, as ``aiayn.inference.kernels``' oneDNN product is: the searches and
the model do not change.

Why this kernel, and only there (measured on an AVX2-only CPU, one thread:
docs/translating.md#the-int8-output-layer): FBGEMM runs the demo's output layer, 256 x 5,131,
~1.9x faster than fp32 at the rows a decoding step holds; its other layers, 256 to 768
wide, gain nothing once each row is quantized on its own scale (below), so they stay
fp32. PyTorch's other int8 products are slow there: ``torch._int_mm`` and
``_weight_int8pack_mm`` fall back to loops without AVX-512 (20-40x slower than fp32), and
oneDNN's ``qlinear_pointwise`` needs a separate quantization of its input that costs more
than it saves. The weights are quantized through ``torch.quantize_per_channel``, which
PyTorch marks deprecated; where FBGEMM is missing, ``check_int8`` says so in one line.

int8 changes the translations a little (held to a BLEU and agreement tolerance, not to
exactness: tests/inference/test_int8.py); fp32 stays the reference of every exactness test.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from aiayn.errors import AiaynError


def fbgemm_available() -> bool:
    """Whether this PyTorch has FBGEMM's quantized products (x86 CPU builds do)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def check_int8(device: torch.device | str) -> None:
    """An AiaynError unless this PyTorch can run ``Int8Output`` on ``device``."""
    if torch.device(device).type != "cpu":
        raise AiaynError(f"int8 decoding runs on a CPU, not on {device}: leave out --int8 "
                         "(a GPU decodes in fp32 or bf16)")
    if not fbgemm_available():
        raise AiaynError(f"int8 decoding needs FBGEMM, which this PyTorch ({torch.__version__}) "
                         "lacks (x86 CPU builds have it): leave out --int8")


def pack(weight: Tensor):
    """FBGEMM's packed int8 form of ``weight`` (out x in): W_ij ~ q_ij * s_i with
    s_i = max_j |W_ij| / 127."""
    w = weight.detach().float().contiguous()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).double()
    zeros = torch.zeros(w.size(0), dtype=torch.long)
    with warnings.catch_warnings():  # the deprecation of quantized tensors: see above
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(w, scales, zeros, 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(q, None)


def anchor(features: int) -> Tensor:
    """The row ``int8_product`` appends: its largest value 1, its smallest -1."""
    row = torch.zeros(1, features)
    row[0, 0], row[0, 1] = 1.0, -1.0
    return row


def int8_product(x: Tensor, packed, out_features: int, bias: Tensor | None,
                 anchor_row: Tensor) -> Tensor:
    """x W^T + b for (..., in) ``x``, each row of x quantized to int8 on its own scale.

    FBGEMM's dynamic product quantizes its whole input on one range, its min and max (7
    bits, as it needs on AVX2), so a row's result would depend on the rows beside it: a
    sentence's translation on the batch it is in. So each row is divided by its own max |x|
    and the ``anchor`` row is appended: every input then spans exactly [-1, 1], one fixed
    range, and the row's scale is multiplied back after the int32 sum."""
    rows = x.reshape(-1, x.size(-1)).float()
    scale = rows.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12)
    out = torch.ops.quantized.linear_dynamic(torch.cat([rows / scale, anchor_row]), packed,
                                             True)[:-1]
    out = out * scale if bias is None else torch.addcmul(bias, out, scale)
    return out.view(*x.shape[:-1], out_features)


class Int8Output:
    """The output layer's product (``model.OutputKernel``) in int8 for one generator whose
    weights do not change while it decodes (a loaded run's): its allowed rows are packed
    once, here, and every call computes with them. The weight a caller passes must be those
    rows (as ``Generator.output_logits`` passes them): a weight of another shape is
    refused."""

    def __init__(self, generator):
        check_int8(generator.proj.weight.device)
        with torch.no_grad():
            weight, bias = generator.allowed_rows()
        self.shape, self.bias = tuple(weight.shape), bias
        self.packed, self.anchor = pack(weight), anchor(weight.size(1))

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        if tuple(weight.shape) != self.shape:
            raise ValueError(f"Int8Output packed a {self.shape} output layer, "
                             f"got {tuple(weight.shape)}")
        return int8_product(x, self.packed, self.shape[0], self.bias, self.anchor)
