"""Decoding in int8 on a CPU (`--int8`): every linear layer of the decoder and the output
layer compute x W^T + b with W in 7-bit integers (one scale per output row) and each row of
x quantized to 8 bits on its own scale, through aiayn's own kernel
(``aiayn.inference.native.PackedInt8``). The encoder, run once per sentence, stays fp32.

``int8_decoder`` gives a copy of the model whose decoder computes so (the model given does not
change: the copy shares its other modules and weights), ``Int8Output`` the output layer's
product as a ``model.OutputKernel``, as ``aiayn.inference.kernels``' oneDNN product is: the
searches and the model do not change. Both pack the weights once, so the weights must not
change while they decode (a loaded run's do not).

int8 changes the translations a little (held to a BLEU and agreement tolerance, not to
exactness: tests/inference/test_int8.py); fp32 stays the reference of every exactness test.
The figures: docs/translating.md#int8-decoding.
"""

from __future__ import annotations

from torch import Tensor, nn

from aiayn.inference.native import PackedInt8


class Int8Output:
    """The output layer's product (``model.OutputKernel``) in int8 for one generator whose
    weights do not change while it decodes: its allowed rows are packed once, here, and every
    call computes with them. The weight a caller passes must be those rows (as
    ``Generator.output_logits`` passes them): a weight of another shape is refused."""

    def __init__(self, generator):
        weight, bias = generator.allowed_rows()
        self.shape = tuple(weight.shape)
        self.product = PackedInt8(weight, bias)

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        if tuple(weight.shape) != self.shape:
            raise ValueError(f"Int8Output packed a {self.shape} output layer, "
                             f"got {tuple(weight.shape)}")
        return self.product(x)


class Int8Linear(nn.Module):
    """An ``nn.Linear`` whose weights do not change, computed in int8 (``PackedInt8``). It
    keeps the linear's own weight and bias (the same tensors, not copies), so that its
    model's ``state_dict`` is the fp32 model's (a serving lane's process starts from it)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.product = PackedInt8(linear.weight, linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.product(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def int8_decoder(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose decoder's linear layers compute in int8 (``Int8Linear``),
    sharing every other module and weight with ``model``, which does not change."""
    return _replaced(model, lambda name, module: (
        Int8Linear(module) if isinstance(module, nn.Linear) and name.startswith("decoder.")
        else None))


def _replaced(module: nn.Module, swap, prefix: str = "") -> nn.Module:
    """``module``, or a shallow copy of it in which the submodules that ``swap(name, module)``
    answers for (with a module; None keeps it) are replaced, at any depth; the rest shared."""
    children = {}
    for name, child in module.named_children():
        new = swap(prefix + name, child)
        children[name] = new if new is not None else _replaced(child, swap, f"{prefix}{name}.")
    if all(children[name] is child for name, child in module.named_children()):
        return module
    copy = module.__new__(type(module))
    copy.__dict__ = dict(module.__dict__)
    copy._modules = {**module._modules, **children}
    return copy
