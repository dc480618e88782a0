"""aiayn's own int8 product for CPU decoding, ``PackedInt8`` (``int8_linear.c`` beside this
file, whose comment has the arithmetic), built here with the machine's C compiler and called
through ctypes; ``aiayn.inference.int8`` puts it in the decoder and the output layer.

Why a kernel of our own: at the few rows of a decoding step (4-64), PyTorch's int8 products
cost more than fp32 here: FBGEMM's dynamic product quantizes a whole batch on one scale, and
with each row on its own scale it is slower than fp32 on the demo's decoder layers;
``torch._int_mm`` and ``_weight_int8pack_mm`` fall back to loops without AVX-512;
``torch.ao.quantization`` is deprecated. This kernel quantizes each row on its own scale and
runs the demo's decoder layers 1.3-2.3x faster than fp32 at 4-256 rows on an AVX2 EPYC, its
output layer 2.8-5.3x (``benchmarks/int8_kernel.py``; docs/results.md).

The source is compiled once per machine (``$CC``, else ``cc``, with AVX2 and FMA) into
``$XDG_CACHE_HOME/aiayn`` (``~/.cache/aiayn``), named by a hash of the source, compiler and
flags, and loaded with ctypes, which lets go of the GIL during a call, so that decoding
streams run it at once. ``check_int8`` says in one line why it cannot run where it cannot
(not an x86 CPU with AVX2, no C compiler, a failed build).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from aiayn.errors import AiaynError

SOURCE = Path(__file__).with_name("int8_linear.c")
FLAGS = ["-O3", "-fPIC", "-shared", "-std=gnu99", "-mavx2", "-mfma"]
PANEL = 16  # output rows per packed panel (int8_linear.c)
WEIGHT_LEVELS = 63  # 7-bit weights: no pair of u8 x s8 products saturates 16 bits (int8_linear.c)


def cache_dir() -> Path:
    """Where built kernels are kept: ``$XDG_CACHE_HOME/aiayn``, else ``~/.cache/aiayn``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "aiayn"


def cpu_supported() -> bool:
    """An x86-64 CPU with AVX2 and FMA (PyTorch's reading: "AVX2" or "AVX512")."""
    return (platform.machine().lower() in ("x86_64", "amd64")
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


def build(source: Path = SOURCE, directory: Path | None = None) -> Path:
    """The shared library of ``source``, compiled now unless an identical build is kept.
    Written under a temporary name and renamed into place: processes building it at once
    never load a half-written one. An AiaynError in one line where it cannot be built."""
    name = os.environ.get("CC") or "cc"
    compiler = shutil.which(name)
    if compiler is None:
        raise AiaynError(f"int8 decoding builds its kernel with a C compiler, and {name!r} is "
                         "not on PATH: install one (gcc or clang; or set CC) or leave out --int8")
    digest = hashlib.sha256(source.read_bytes() + " ".join([compiler, *FLAGS]).encode())
    directory = directory or cache_dir()
    library = directory / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if library.exists():
        return library
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            built = Path(scratch) / library.name
            subprocess.run([compiler, *FLAGS, str(source), "-o", str(built), "-lm"],
                           check=True, capture_output=True, text=True, timeout=300)
            os.replace(built, library)
    except subprocess.CalledProcessError as e:
        last = (e.stderr or "").strip().splitlines()[-1:] or ["no message"]
        raise AiaynError(f"int8 decoding could not build its kernel with {compiler}: "
                         f"{last[0]}") from None
    except (OSError, subprocess.SubprocessError) as e:
        raise AiaynError(f"int8 decoding could not build its kernel in {directory}: {e}") from None
    return library


@functools.cache  # built and loaded once per process
def _library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build()))
    pointer, size = ctypes.c_void_p, ctypes.c_long
    lib.int8_linear.argtypes = [pointer, size, size, pointer, pointer, pointer, pointer, size, size,
                                pointer, pointer, pointer]
    lib.int8_linear.restype = None
    return lib


def check_int8(device: torch.device | str = "cpu") -> None:
    """An AiaynError in one line unless the int8 kernel runs here (building it if need be)."""
    if torch.device(device).type != "cpu":
        raise AiaynError(f"int8 decoding runs on a CPU, not on {device}: leave out --int8 "
                         "(a GPU decodes in fp32 or bf16)")
    if not cpu_supported():
        raise AiaynError(f"int8 decoding needs an x86 CPU with AVX2 (this one: {platform.machine()}, "
                         f"{torch.backends.cpu.get_cpu_capability()}): leave out --int8")
    _library()


def quantize_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(n, k) float -> int8 q in [-63, 63] and (n,) scales s, W ~ s q row by row."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / WEIGHT_LEVELS).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp_(-WEIGHT_LEVELS, WEIGHT_LEVELS).to(torch.int8)
    return q, scales


class PackedInt8:
    """A weight (and bias) in ``int8_linear.c``'s layout, packed once; ``__call__`` is
    x W^T + b for (..., k) float32 x on a CPU."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        check_int8(weight.device)
        self.lib = _library()
        n, k = weight.shape
        self.n, self.k, self.width = n, k, -(-k // 4) * 4
        panels = -(-n // PANEL)
        q, scales = quantize_weight(weight)
        padded = torch.zeros(panels * PANEL, self.width, dtype=torch.int8)
        padded[:n, :k] = q
        # (panel, group of 4 columns, half, row of 8, 4 weights): int8_linear.c's order
        self.packed = padded.view(panels, 2, 8, self.width // 4, 4).permute(0, 3, 1, 2, 4).contiguous()
        self.sums = torch.zeros(panels * PANEL, dtype=torch.int32)
        self.sums[:n] = q.sum(dim=1, dtype=torch.int32)
        self.scales = torch.zeros(panels * PANEL)
        self.scales[:n] = scales
        self.bias = torch.zeros(panels * PANEL)
        if bias is not None:
            self.bias[:n] = bias.detach().float()

    def __call__(self, x: Tensor) -> Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.size(-1) != self.k:
            raise ValueError(f"the int8 product takes (..., {self.k}) float32 CPU input, got "
                             f"{tuple(x.shape)} {x.dtype} on {x.device}")
        rows = x.reshape(-1, self.k).contiguous()
        m = rows.size(0)
        y = torch.empty(m, self.n)
        if m:
            u = torch.empty(m, self.width, dtype=torch.uint8)
            row_scales = torch.empty(m)
            self.lib.int8_linear(rows.data_ptr(), m, self.k, self.packed.data_ptr(),
                                 self.sums.data_ptr(), self.scales.data_ptr(), self.bias.data_ptr(),
                                 self.n, self.width, y.data_ptr(), u.data_ptr(), row_scales.data_ptr())
        return y.view(*x.shape[:-1], self.n)
