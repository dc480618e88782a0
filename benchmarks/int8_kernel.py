"""What aiayn's int8 product buys, layer by layer: x W^T + b for the demo model's linear layers
at the rows a decoding step holds, in fp32 (``F.linear``: MKL in PyTorch's x86 builds), in
FBGEMM's int8 (``torch.ops.quantized.linear_dynamic``, each row scaled to its own range and
an anchor row appended so that its result does not depend on the other rows, as aiayn's
`--int8` computed the output layer before its own kernel) and in aiayn's own int8 kernel
(``aiayn.inference.native.PackedInt8``), on one thread; where the CPU has AVX-512 VNNI, which
the kernel then takes, its AVX2 path too (the same floats).

    python benchmarks/int8_kernel.py --repeats 5

The shapes (out x in) are the demo's: self-attention's fused Q/K/V (768 x 256), a 256 x 256
projection, the feed-forward's two layers (512 x 256, 256 x 512) and the output layer over
the 5,131 pieces the demo's targets use (5131 x 256). Rows: 4 (one sentence, beam 4) to 256
(an offline batch's step). The three products take turns (``common.interleave``) and each
cell is the median over repetitions of the fastest of a burst of calls; the speed-ups are
over fp32 in the same run. The last column is the int8 product's error relative to the
exact one (random weights, so a bound rather than the demo's).
"""

from __future__ import annotations

import sys
import time
import warnings
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402  (benchmarks/ is not a package)
    add_json_option,
    add_repeats_option,
    device_description,
    interleave,
    median,
    note_load,
    print_table,
    script_parser,
    set_threads,
)

from aiayn.inference.native import PackedInt8, avx512_supported, check_int8  # noqa: E402

SHAPES = [(768, 256), (256, 256), (512, 256), (256, 512), (5131, 256)]
ROWS = [4, 16, 64, 256]


def fbgemm_product(weight: torch.Tensor, bias: torch.Tensor):
    """FBGEMM's dynamic int8 product with each row on its own scale (an anchor row spans
    [-1, 1] so that the batch's one range is every row's); None where FBGEMM is missing."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return None
    scales = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12).double()
    with warnings.catch_warnings():  # quantized tensors are deprecated
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(weight, scales, torch.zeros(weight.size(0), dtype=torch.long),
                                       0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(q, None)
    anchor = torch.zeros(1, weight.size(1))
    anchor[0, 0], anchor[0, 1] = 1.0, -1.0

    def product(x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
        out = torch.ops.quantized.linear_dynamic(torch.cat([x / scale, anchor]), packed, True)[:-1]
        return torch.addcmul(bias, out, scale)
    return product


def burst(fn, calls: int):
    """One timed item: ``calls`` calls in a row (a single one is below the clock's grain)."""
    def run() -> None:
        for _ in range(calls):
            fn()
    return run


def main(argv: list[str] | None = None) -> None:
    p = script_parser(__doc__)
    add_repeats_option(p, 5)
    add_json_option(p)
    args = p.parse_args(argv)
    check_int8()
    set_threads(1)
    note_load()
    numbers = torch.Generator().manual_seed(0)
    rows_out = []
    for n, k in SHAPES:
        weight = torch.randn(n, k, generator=numbers) / k ** 0.5
        bias = torch.randn(n, generator=numbers) * 0.1
        ours, fbgemm = PackedInt8(weight, bias), fbgemm_product(weight, bias)
        avx2 = PackedInt8(weight, bias, avx512=False) if avx512_supported() else None
        for m in ROWS:
            x = torch.randn(m, k, generator=numbers)
            calls = max(1, int(2e7 // (m * n * k)))  # ~40 MFLOP a burst
            contenders = {"fp32": burst(partial(F.linear, x, weight, bias), calls),
                          "aiayn": burst(partial(ours, x), calls)}
            if fbgemm is not None:
                contenders["fbgemm"] = burst(partial(fbgemm, x), calls)
            if avx2 is not None:
                contenders["avx2"] = burst(partial(avx2, x), calls)
            times = interleave(contenders, args.repeats)
            us = {name: 1e6 * median([rep[0] for rep in t]) / calls for name, t in times.items()}
            exact = F.linear(x, weight, bias)
            error = ((ours(x) - exact).norm() / (exact - bias).norm()).item()
            fb, path = (f"{us[name]:.1f} ({us['fp32'] / us[name]:.2f}x)" if name in us else "-"
                        for name in ("fbgemm", "avx2"))
            rows_out.append([f"{n} x {k}", str(m), f"{us['fp32']:.1f}", fb,
                             f"{us['aiayn']:.1f} ({us['fp32'] / us['aiayn']:.2f}x)", path,
                             f"{2 * m * n * k / us['aiayn'] / 1e3:.0f}", f"{error:.3f}"])
    conditions = (f"one thread, median of {args.repeats} interleaved repetitions of a burst of "
                  f"calls each; {time.strftime('%Y-%m-%d')}\ndevice: {device_description()}")
    print_table(["layer (out x in)", "rows", "fp32 us", "FBGEMM int8 us (speed-up)",
                 "aiayn int8 us (speed-up)", "its AVX2 path us (speed-up)", "aiayn GFLOP/s",
                 "aiayn int8 rel. error"],
                rows_out, conditions, args.json)


if __name__ == "__main__":
    main()
