"""The int8 output layer (aiayn.inference.int8): close to fp32's product, a row's result
independent of the rows beside it (so a sentence's translation of its batch), translations
held to an agreement tolerance against fp32 (not to exactness), and one-line refusals.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import run_cli

from aiayn.data.prepared import load_prepared
from aiayn.errors import AiaynError
from aiayn.inference import int8
from aiayn.inference.ct2 import CTranslate2Engine
from aiayn.inference.int8 import Int8Output, anchor, check_int8, fbgemm_available, int8_product, pack
from aiayn.inference.translator import Translator
from aiayn.model import Generator
from aiayn.runs.directory import read_data_dir

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="this PyTorch has no FBGEMM")


def rows_of_many_scales(n: int = 12, d: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * torch.logspace(-2, 2, n)[:, None]


def test_the_product_is_close_to_fp32_on_every_row():
    """Each row within 2% of its own size: rows 10^4 apart in scale are each quantized on
    their own range."""
    g = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(300, 64, generator=g) * 0.1, torch.randn(300, generator=g)
    x = rows_of_many_scales()
    exact = F.linear(x, weight, bias)
    got = int8_product(x, pack(weight), 300, bias, anchor(64))
    error = (got - exact).norm(dim=1) / (exact - bias).norm(dim=1)
    assert error.max() < 0.02, error


def test_a_row_gets_the_same_result_alone_as_beside_others():
    """The same kernel on both sides, so exact: a sentence's logits (and so its translation)
    do not depend on the batch it is decoded in."""
    weight = torch.randn(200, 64, generator=torch.Generator().manual_seed(2))
    packed, row = pack(weight), anchor(64)
    x = rows_of_many_scales()
    together = int8_product(x, packed, 200, None, row)
    for i in (0, 5, 11):
        assert torch.equal(int8_product(x[i:i + 1], packed, 200, None, row), together[i:i + 1])
    shaped = int8_product(x.view(3, 4, 64), packed, 200, None, row)  # (..., d) inputs
    assert torch.equal(shaped.view(12, 200), together)


def test_the_output_kernel_packs_the_allowed_rows_and_refuses_others():
    generator = Generator(32, 50, restricted=True)
    generator.set_outputs(torch.arange(10, 40))
    kernel = Int8Output(generator)
    weight, bias = generator.allowed_rows()
    h = torch.randn(3, 2, 32)
    got = generator.output_logits(h, kernel=kernel)
    assert got.shape == (3, 2, 30)
    assert ((got - F.linear(h, weight)).norm() / F.linear(h, weight).norm()) < 0.02
    with pytest.raises(ValueError, match="packed a"):
        kernel(h, generator.proj.weight, None)


def test_refusals_are_one_line(monkeypatch):
    with pytest.raises(AiaynError, match="runs on a CPU") as info:
        check_int8("cuda")
    assert "\n" not in str(info.value)
    monkeypatch.setattr(int8, "fbgemm_available", lambda: False)
    with pytest.raises(AiaynError, match="needs FBGEMM"):
        check_int8("cpu")
    with pytest.raises(AiaynError, match="--quantization int8"):
        CTranslate2Engine.load("unused", int8=True)


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
    assert agree >= 0.8 * len(sources), (agree, len(sources))
    assert [quantized.translate([s], search)[0] for s in sources[:8]] == ours[:8]


def test_evaluate_with_int8_keeps_its_own_file(run_dir, capsys):
    code, out, err = run_cli(["evaluate", str(run_dir), "--split", "test", "--limit", "5",
                              "--int8"], capsys)
    assert code == 0, err
    assert list((run_dir / "eval").glob("test.best.int8.beam*.txt"))
