"""aiayn's own kernels for CPU decoding, built here with the machine's C compiler and called
through ctypes: the int8 product ``PackedInt8`` (``int8_linear.c`` beside this file, whose
comment has the arithmetic) and a step's one-query attention, QK-norm and log-softmax
(``step_attention``, ``rms_norm``, ``log_softmax``, ``top_log_softmax``: ``step_attention.c``),
an encoder layer and a decoder layer's whole step made of them (``encoder_layer``,
``decoder_layer_step``: ``layers.c``), a joining sentence's encoding and each decoder
layer's memory keys and values (``memory_kv``, ``encode_memory``, with the encoder's final
``layer_norm``: ``layers.c``), a beam step's work between the model and the
bookkeeping (``mask_step``, ``beam_choose``: ``search_step.c``), and a whole beam step from
the tokens to the choice in one call (``beam_step``); ``aiayn.inference.int8`` puts them in
the encoder, the decoder, the output layer and the searches' steps. Over 500 lines because
each kernel's ctypes signature, structures and wrapper are one library's interface, read in
one place.

Why a product of our own: at the few rows of a decoding step (4-64), PyTorch's int8 products
cost more than fp32 here: FBGEMM's dynamic product quantizes a whole batch on one scale, and
with each row on its own scale it is slower than fp32 on the demo's decoder layers;
``torch._int_mm`` and ``_weight_int8pack_mm`` fall back to loops without AVX-512;
``torch.ao.quantization`` is deprecated. This kernel quantizes each row on its own scale and
runs the demo's decoder layers 1.25-2.3x faster than fp32 at 4-256 rows on an AVX2 EPYC, its
output layer 3.6-6.9x (``benchmarks/int8_kernel.py``; docs/results.md). Why attention of our
own: PyTorch's fused attention spends most of its time setting up for one query per row, and
reads keys only where they lie contiguously, where an indirect cache (``aiayn.cache.Store``)
keeps them where they were written.

The sources are compiled once per machine (``$CC``, else ``cc``, with AVX2, FMA and F16C, which
every AVX2 CPU has; AVX-512 paths are compiled beside them and taken where the CPU has
AVX-512 VNNI: the product's, the same floats at 1.2-2.1x the AVX2 path's speed on an AMD Zen 5,
and the step attention's and softmax's, 16 lanes wide) into one
library in ``$XDG_CACHE_HOME/aiayn`` (``~/.cache/aiayn``), named by a hash of the sources,
compiler and flags, and loaded with ctypes, which lets go of the GIL during a call, so that
decoding streams run it at once. ``check_int8`` says in one line why it cannot run where it
cannot (not an x86 CPU with AVX2, no C compiler, a failed build).
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
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from aiayn.data.tokenizer import EOS_ID, PAD_ID
from aiayn.errors import AiaynError

# The kernels, compiled into one library: the int8 product and one-query attention.
SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("int8_linear.c", "step_attention.c", "layers.c", "search_step.c"))
FLAGS = ["-O3", "-fPIC", "-shared", "-std=gnu99", "-mavx2", "-mfma", "-mf16c"]
PANEL = 16  # output rows per packed panel (int8_linear.c)
MAX_CANDIDATES = 256  # a sentence's candidates at most in one beam step (search_step.c)
WEIGHT_LEVELS = 63  # 7-bit weights: two pairs of 7-bit products add in 16 bits (int8_linear.c)


def cache_dir() -> Path:
    """Where built kernels are kept: ``$XDG_CACHE_HOME/aiayn``, else ``~/.cache/aiayn``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "aiayn"


def cpu_supported() -> bool:
    """An x86-64 CPU with AVX2 and FMA (PyTorch's reading: "AVX2" or "AVX512")."""
    return (platform.machine().lower() in ("x86_64", "amd64")
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


def build(sources: tuple[Path, ...] = SOURCES, directory: Path | None = None) -> Path:
    """The shared library of ``sources``, compiled now unless an identical build is kept.
    Written under a temporary name and renamed into place: processes building it at once
    never load a half-written one. An AiaynError in one line where it cannot be built."""
    name = os.environ.get("CC") or "cc"
    compiler = shutil.which(name)
    if compiler is None:
        raise AiaynError(f"int8 decoding builds its kernel with a C compiler, and {name!r} is "
                         "not on PATH: install one (gcc or clang; or set CC) or leave out --int8")
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in sources)
                            + " ".join([compiler, *FLAGS]).encode())
    directory = directory or cache_dir()
    library = directory / f"aiayn-native-{digest.hexdigest()[:16]}.so"
    if library.exists():
        return library
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            built = Path(scratch) / library.name
            subprocess.run([compiler, *FLAGS, *map(str, sources), "-o", str(built), "-lm"],
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
                                pointer, ctypes.c_int]
    lib.int8_linear.restype = ctypes.c_int
    lib.avx512.argtypes = []
    lib.avx512.restype = ctypes.c_int
    lib.step_attention.argtypes = [pointer, size, size, size, size, size,
                                   pointer, size, size, size, pointer, size, size, size, size,
                                   ctypes.c_int, pointer, size, size,
                                   pointer, size, pointer, size, ctypes.c_int]
    lib.step_attention.restype = ctypes.c_int
    lib.log_softmax.argtypes = [pointer, size, size, pointer, ctypes.c_int]
    lib.log_softmax.restype = None
    lib.top_log_softmax.argtypes = [pointer, size, size, size, pointer, pointer, ctypes.c_int]
    lib.top_log_softmax.restype = None
    lib.rms_norm.argtypes = [pointer, size, size, pointer, ctypes.c_float]
    lib.rms_norm.restype = None
    lib.layer_norm.argtypes = [pointer, size, size, pointer, pointer, ctypes.c_float, pointer]
    lib.layer_norm.restype = None
    lib.decoder_layer_step.argtypes = [ctypes.POINTER(LayerWeights), ctypes.POINTER(StepPlaces),
                                       pointer, size, ctypes.c_int]
    lib.decoder_layer_step.restype = ctypes.c_int
    lib.encoder_layer.argtypes = [ctypes.POINTER(LayerWeights), pointer, size, size, pointer, ctypes.c_int]
    lib.encoder_layer.restype = ctypes.c_int
    lib.memory_kv.argtypes = [ctypes.POINTER(Product), pointer, size, size, pointer, ctypes.c_float,
                              pointer, pointer, ctypes.c_int]
    lib.memory_kv.restype = ctypes.c_int
    lib.encode_memory.argtypes = [ctypes.POINTER(MemoryWeights), pointer, size, size, pointer, pointer,
                                  pointer, ctypes.c_int]
    lib.encode_memory.restype = ctypes.c_int
    lib.mask_step.argtypes = [pointer, size, size, pointer, size, pointer, size, size, pointer,
                              pointer, ctypes.c_int64]
    lib.mask_step.restype = None
    lib.beam_choose.argtypes = [pointer, pointer, size, size, size, pointer, pointer, ctypes.c_int64,
                                size, pointer, pointer, pointer]
    lib.beam_choose.restype = ctypes.c_int
    lib.embed_step.argtypes = [pointer, size, ctypes.c_float, pointer, size, pointer, pointer, size,
                               size, pointer]
    lib.embed_step.restype = ctypes.c_int
    lib.beam_step.argtypes = [ctypes.POINTER(DecoderWeights), ctypes.POINTER(StepPlaces), size,
                              ctypes.POINTER(Choice), pointer, pointer, size, size, pointer, size,
                              pointer, pointer, pointer, pointer, pointer, size, size, size, pointer,
                              pointer, pointer, pointer, ctypes.c_int]
    lib.beam_step.restype = ctypes.c_int
    lib.beam_steps.argtypes = [ctypes.POINTER(DecoderWeights), ctypes.POINTER(StepPlaces), size,
                               ctypes.POINTER(Choice), pointer, pointer, size, size, pointer, size,
                               pointer, pointer, pointer, pointer, pointer, size, size, size, pointer,
                               pointer, pointer, pointer, size, ctypes.c_int, ctypes.c_int,
                               ctypes.POINTER(ctypes.c_long), pointer, ctypes.POINTER(ctypes.c_long),
                               pointer, pointer, pointer]
    lib.beam_steps.restype = ctypes.c_int
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


@functools.cache
def avx512_supported() -> bool:
    """Whether the kernels take their AVX-512 paths (the int8 product's, the same floats as
    AVX2's, and the step attention's, the same up to rounding): where the CPU has AVX-512 F,
    BW, VL and VNNI and PyTorch runs its own AVX-512 kernels (``ATEN_CPU_CAPABILITY=avx2``
    keeps both on AVX2)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and bool(_library().avx512())


def _avx512_path(asked: bool | None) -> bool:
    if asked and not avx512_supported():
        raise ValueError("the kernels run on AVX2 here: this CPU lacks AVX-512 (F, BW, VL and VNNI), "
                         "or ATEN_CPU_CAPABILITY keeps PyTorch off it")
    return avx512_supported() if asked is None else asked


class PackedInt8:
    """A weight (and bias) in ``int8_linear.c``'s layout, packed once; ``__call__`` is
    x W^T + b for (..., k) float32 x on a CPU. ``avx512``: the AVX-512 VNNI path or AVX2's
    (default: AVX-512 where the CPU has it); both give the same floats."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None, avx512: bool | None = None):
        check_int8(weight.device)
        self.lib = _library()
        self.avx512 = _avx512_path(avx512)
        n, k = weight.shape
        self.n, self.k, self.width = n, k, -(-k // 8) * 8
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
        if m and self.lib.int8_linear(rows.data_ptr(), m, self.k, self.packed.data_ptr(),
                                      self.sums.data_ptr(), self.scales.data_ptr(),
                                      self.bias.data_ptr(), self.n, self.width, y.data_ptr(),
                                      int(self.avx512)):
            raise MemoryError(f"the int8 product could not allocate its scratch for {m} rows")
        return y.view(*x.shape[:-1], self.n)


def _address(array: np.ndarray) -> int:
    """Where a writable C-contiguous array made here lies, read through ctypes itself where
    it holds anything: ``array.ctypes.data`` builds numpy's ctypes helper in Python at
    every call, and a whole beam step reads three such addresses."""
    return ctypes.addressof(ctypes.c_char.from_buffer(array)) if array.size else array.ctypes.data


def _pointer(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def step_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                   keys: int | None = None, ancestry: Tensor | None = None,
                   avx512: bool | None = None) -> Tensor:
    """softmax(q K^T / sqrt(d_k)) V (eq. 1) for one query per row, q (n, H, 1, d_k), over the
    first ``keys`` positions (default all) of k, v (m, H, t, d_k), float32 or float16. Without
    ``ancestry`` each of the m key sets is shared by n / m consecutive rows (a beam's, as
    ``cache.fold_beams`` groups them); with it (an indirect cache's ``Store``: (n, c) int64),
    row r reads position j < c from row ``ancestry[r, j]`` of k and v, and later ones from row
    r. mask: None or bool (n / m or n, 1, 1, keys), True = may attend. ``step_attention_fits``
    says what it takes. ``avx512``: the AVX-512 products (where d_k is a multiple of 16) or
    AVX2's, the same up to rounding (default: AVX-512 where the CPU has it). Returns
    (n, H, 1, d_k), a view of (n, 1, H, d_k) rows."""
    n, H, _, d = q.shape
    keys = k.size(2) if keys is None else keys
    group = 1 if ancestry is not None else n // k.size(0)
    out = torch.empty(n, 1, H, d)
    mask_row = 0
    if mask is not None:
        mask = mask.reshape(mask.size(0), keys)
        mask_row = mask.stride(0) if mask.size(0) > 1 else 0
    written, ancestry_row = (0, 0) if ancestry is None else (ancestry.size(1), ancestry.stride(0))
    failed = _library().step_attention(
        q.data_ptr(), q.stride(0), n, group, H, d, k.data_ptr(), k.stride(0), k.stride(1),
        k.stride(2), v.data_ptr(), v.stride(0), v.stride(1), v.stride(2), keys,
        int(k.dtype == torch.float16), _pointer(ancestry), ancestry_row, written, _pointer(mask),
        mask_row, out.data_ptr(), H * d, int(_avx512_path(avx512)))
    if failed:
        raise MemoryError(f"the step attention could not allocate its scratch for {keys} keys")
    return out.transpose(1, 2)


def step_attention_fits(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                        keys: int | None = None, ancestry: Tensor | None = None) -> bool:
    """Whether ``step_attention`` computes this product: one float32 query per row on a CPU
    whose heads lie d_k apart, d_k a multiple of 8 up to 128, k and v of one shape and dtype
    (float32 or float16) with their last dimension contiguous; rows a multiple of the key
    sets (without ``ancestry``) or at most as many as k's (with one, (rows, c) int64 whose
    last dimension is contiguous); a mask of one row of ``keys`` per key set or per row (or
    one for all)."""
    n, H, T, d = q.shape
    keys = k.size(2) if keys is None else keys
    if (T != 1 or d % 8 or d > 128 or q.dtype != torch.float32 or not q.is_cpu
            or q.stride(1) != d or q.stride(3) != 1 or k.size(0) == 0 or keys > k.size(2)):
        return False
    if any(x.dtype not in (torch.float32, torch.float16) or not x.is_cpu or x.stride(3) != 1
           for x in (k, v)):
        return False
    if k.shape != v.shape or k.dtype != v.dtype:
        return False
    if ancestry is None:
        sets = k.size(0)
        if n % sets:
            return False
    else:
        sets = n
        if (ancestry.dtype != torch.long or ancestry.size(0) != n or n > k.size(0)
                or ancestry.size(1) > keys or (ancestry.size(1) > 1 and ancestry.stride(1) != 1)):
            return False
    if mask is None:
        return True
    return (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1:3] == (1, 1)
            and mask.size(0) in (1, sets) and mask.size(3) == keys and mask.stride(3) == 1)


def rms_norm(x: Tensor, gain: Tensor, eps: float) -> Tensor:
    """x / rms(x) * gain over the last dimension, a new contiguous float32 tensor
    (torch.nn.RMSNorm's values up to rounding): QK-norm's, for one head's d_k values or a
    whole query's d_model, a multiple of 8."""
    out = x.clone(memory_format=torch.contiguous_format)
    d = x.size(-1)
    _library().rms_norm(out.data_ptr(), out.numel() // d, d, gain.data_ptr(), eps)
    return out


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dimension, a new contiguous
    float32 tensor (torch.nn.LayerNorm's values up to rounding; a multiple of 8 features): the
    encoder's final norm as ``encode_memory`` computes it, so that a memory and the K/V made
    from it agree to the bit whichever way they are made."""
    d = x.size(-1)
    if (x.dtype != torch.float32 or not x.is_cpu or d % 8 or any(
            t.dtype != torch.float32 or t.shape != (d,) or not t.is_contiguous() for t in (weight, bias))):
        raise ValueError("layer_norm takes float32 CPU input of a multiple of 8 features and a "
                         "float32 weight and bias of as many")
    out, x = torch.empty(x.shape, dtype=torch.float32), x.contiguous()
    _library().layer_norm(x.data_ptr(), x.numel() // d, d, weight.data_ptr(), bias.data_ptr(), eps,
                          out.data_ptr())
    return out


def log_softmax(x: Tensor, avx512: bool | None = None) -> Tensor:
    """log softmax over the last dimension of float32 CPU x (torch.log_softmax's values up to
    rounding), a new contiguous tensor: a search's log-probabilities in one pass of AVX2's
    exponentials, where PyTorch's takes several times longer at a step's 5,000 pieces.
    ``avx512``: the exponentials 16 at a time or 8 (default: 16 where the CPU has AVX-512)."""
    if x.dtype != torch.float32 or not x.is_cpu:
        raise ValueError(f"the native log softmax takes float32 CPU input, got {x.dtype} on {x.device}")
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.size(-1)
    if x.numel():
        _library().log_softmax(x.data_ptr(), x.numel() // n, n, out.data_ptr(), int(_avx512_path(avx512)))
    return out


def top_log_softmax(x: Tensor, k: int, avx512: bool | None = None) -> tuple[Tensor, Tensor]:
    """The k largest log-probabilities of each row of (R, n) float32 CPU logits, largest
    first, and their columns (R, k): ``log_softmax(x).topk(k)``'s values, the same floats,
    in one pass that writes no row of n log-probabilities (a beam step needs 2K of them).
    Among equal values the first column comes first (topk's order is not fixed); a NaN logit
    is never ranked. ``avx512`` as ``log_softmax``'s: the same floats as it on the same path."""
    if x.dtype != torch.float32 or not x.is_cpu or x.dim() != 2 or not 1 <= k <= x.size(1):
        raise ValueError(f"the native top log softmax takes (rows, n) float32 CPU input and "
                         f"1 <= k <= n, got {tuple(x.shape)} {x.dtype} on {x.device}, k={k}")
    x = x.contiguous()
    values, columns = torch.empty(x.size(0), k), torch.empty(x.size(0), k, dtype=torch.long)
    if x.size(0):
        _library().top_log_softmax(x.data_ptr(), x.size(0), x.size(1), k, values.data_ptr(),
                                   columns.data_ptr(), int(_avx512_path(avx512)))
    return values, columns


class Product(ctypes.Structure):
    """A ``PackedInt8`` as ``layers.c`` takes it."""

    _fields_ = [("packed", ctypes.c_void_p), ("sums", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("n", ctypes.c_long), ("k", ctypes.c_long),
                ("width", ctypes.c_long)]

    @classmethod
    def of(cls, p: PackedInt8) -> Product:
        return cls(p.packed.data_ptr(), p.sums.data_ptr(), p.scales.data_ptr(), p.bias.data_ptr(),
                   p.n, p.k, p.width)


class LayerWeights(ctypes.Structure):
    """One layer's fixed weights for ``decoder_layer_step`` or ``encoder_layer`` (``layers.c``'s
    ``Layer``): pointers into tensors that whoever fills it keeps alive and unchanged."""

    _fields_ = [*((name, Product) for name in ("qkv", "self_out", "cross_q", "cross_out", "ff1", "ff2")),
                ("norm_gain", ctypes.c_void_p * 3), ("norm_bias", ctypes.c_void_p * 3),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("cross_q_norm", ctypes.c_void_p), ("cross_q_whole", ctypes.c_long),
                ("d_model", ctypes.c_long), ("heads", ctypes.c_long), ("d_ff", ctypes.c_long),
                ("norm_first", ctypes.c_long), ("norm_eps", ctypes.c_float), ("qk_eps", ctypes.c_float)]


class StepPlaces(ctypes.Structure):
    """Where one step of ``decoder_layer_step`` reads and writes (``layers.c``'s ``Step``):
    the self-attention store, the memory's K/V and the masks."""

    _fields_ = [("keys", ctypes.c_void_p), ("values", ctypes.c_void_p),
                ("slot_row", ctypes.c_long), ("slot_pos", ctypes.c_long), ("position", ctypes.c_long),
                ("ancestry", ctypes.c_void_p), ("ancestry_row", ctypes.c_long), ("written", ctypes.c_long),
                ("self_mask", ctypes.c_void_p), ("self_mask_row", ctypes.c_long),
                ("cross_k", ctypes.c_void_p), ("cross_v", ctypes.c_void_p),
                *((name, ctypes.c_long) for name in ("ck_row", "ck_head", "ck_pos", "cv_row", "cv_head",
                                                     "cv_pos", "sources", "group", "cross_half")),
                ("src_mask", ctypes.c_void_p), ("src_mask_row", ctypes.c_long)]


def decoder_layer_step(layer: LayerWeights, places: StepPlaces, x: Tensor,
                       avx512: bool | None = None) -> None:
    """One decoder layer for one new position per row, in place on x (rows, d_model), float32
    and contiguous: ``layers.c``. ``avx512`` as ``PackedInt8``'s."""
    if _library().decoder_layer_step(ctypes.byref(layer), ctypes.byref(places), x.data_ptr(),
                                     x.size(0), int(_avx512_path(avx512))):
        raise MemoryError(f"a decoder layer's step could not allocate its scratch for {x.size(0)} rows")


def encoder_layer(layer: LayerWeights, x: Tensor, may_attend: Tensor,
                  avx512: bool | None = None) -> None:
    """One encoder layer over whole sentences, in place on x (sets, length, d_model), float32
    and contiguous: ``layers.c``. ``may_attend``: (sets, length) uint8, nonzero where a key
    is not padding. ``avx512`` as ``PackedInt8``'s."""
    sets, length, _ = x.shape
    if (may_attend.shape != (sets, length) or may_attend.dtype != torch.uint8
            or not may_attend.is_contiguous()):
        raise ValueError(f"encoder_layer takes a contiguous ({sets}, {length}) uint8 mask, got "
                         f"{tuple(may_attend.shape)} {may_attend.dtype}")
    if _library().encoder_layer(ctypes.byref(layer), x.data_ptr(), sets, length, may_attend.data_ptr(),
                                int(_avx512_path(avx512))):
        raise MemoryError(f"an encoder layer could not allocate its scratch for {sets * length} rows")


def memory_kv(kv: Product, memory: Tensor, heads: int, k_gain: Tensor | None, eps: float,
              avx512: bool | None = None) -> tuple[Tensor, Tensor]:
    """A decoder layer's cross-attention K and V of ``memory`` ((n, S, d_model) float32,
    contiguous) through its fused product ``kv`` (d_model -> 2 d_model: k | v) and, where
    ``k_gain`` (d_k) is given, its keys' QK-norm: (n, H, S, d_k) float16 each, views of
    (n, S, H, d_k) tensors (``layers.c``). The same floats as the modules' ``memory_kv``
    kept in float16 (``int8.StepAttention``). ``avx512`` as ``PackedInt8``'s."""
    n, S, d = memory.shape
    if (kv.k != d or kv.n != 2 * d or d % heads or (d // heads) % 8 or memory.dtype != torch.float32
            or not memory.is_contiguous() or (k_gain is not None and k_gain.numel() != d // heads)):
        raise ValueError(f"memory_kv takes contiguous (n, S, {kv.k}) float32 memory, a product of "
                         f"{kv.k} -> 2 x {kv.k} and heads of a multiple of 8 features")
    k, v = (torch.empty(n, S, heads, d // heads, dtype=torch.float16) for _ in range(2))
    if _library().memory_kv(ctypes.byref(kv), memory.data_ptr(), n * S, heads, _pointer(k_gain), eps,
                            k.data_ptr(), v.data_ptr(), int(_avx512_path(avx512))):
        raise MemoryError(f"memory_kv could not allocate its scratch for {n * S} rows")
    return k.transpose(1, 2), v.transpose(1, 2)


class MemoryWeights(ctypes.Structure):
    """The encoder and each decoder layer's memory product for ``encode_memory`` (``layers.c``'s
    ``Memory``): its layers' ``LayerWeights``, the source embedding and sinusoid table, the
    final LayerNorm (None after post-norm layers), the decoder layers' cross-attention K/V
    ``Product``s and their keys' QK-norm gains (None: none); pointers into tensors that whoever
    fills it keeps alive and unchanged."""

    _fields_ = [("layers", ctypes.POINTER(LayerWeights)), ("n_layers", ctypes.c_long),
                ("embedding", ctypes.c_void_p), ("table", ctypes.c_void_p), ("vocab", ctypes.c_long),
                ("positions", ctypes.c_long), ("scale", ctypes.c_float), ("norm_gain", ctypes.c_void_p),
                ("norm_bias", ctypes.c_void_p), ("norm_eps", ctypes.c_float),
                ("kv", ctypes.POINTER(Product)), ("k_gain", ctypes.POINTER(ctypes.c_void_p)),
                ("n_decoder", ctypes.c_long), ("heads", ctypes.c_long), ("qk_eps", ctypes.c_float)]


def encode_memory(weights: MemoryWeights, src: Tensor, may_attend: Tensor, d_model: int,
                  avx512: bool | None = None) -> list[tuple[Tensor, Tensor]]:
    """Sentences' (n, S) source ids (padded; ``may_attend`` (n, S) uint8, nonzero where not
    padding) through the encoder to each decoder layer's cross-attention K and V, (n, H, S,
    d_k) float16 each, views of (n, S, H, d_k) tensors (``layers.c``): ``memory_kv`` of the
    encoder's memory, in one call. A ValueError for an id outside the embedding or a sentence
    longer than the positions. ``avx512`` as ``PackedInt8``'s."""
    n, S = src.shape
    if may_attend.shape != (n, S) or may_attend.dtype != torch.uint8 or not may_attend.is_contiguous():
        raise ValueError(f"encode_memory takes a contiguous ({n}, {S}) uint8 mask")
    src = src.to(torch.long).contiguous()
    heads = weights.heads
    kept = [tuple(torch.empty(n, S, heads, d_model // heads, dtype=torch.float16) for _ in range(2))
            for _ in range(weights.n_decoder)]
    keys = (ctypes.c_void_p * len(kept))(*(k.data_ptr() for k, _ in kept))
    values = (ctypes.c_void_p * len(kept))(*(v.data_ptr() for _, v in kept))
    failed = _library().encode_memory(ctypes.byref(weights), src.data_ptr(), n, S, may_attend.data_ptr(),
                                      keys, values, int(_avx512_path(avx512)))
    if failed == -2:
        raise ValueError(f"source ids or positions outside the tables ({weights.vocab} ids, "
                         f"{weights.positions} positions)")
    if failed:
        raise MemoryError(f"encode_memory could not allocate its scratch for {n * S} rows")
    return [(k.transpose(1, 2), v.transpose(1, 2)) for k, v in kept]


def mask_step(logits: Tensor, never: Sequence[int], history: np.ndarray | None = None,
              n: int = 0, skip: np.ndarray | None = None, to_column: Tensor | None = None) -> None:
    """Set to -inf, in place, the (N, V') float32 ``logits``' columns ``never`` of every row
    and, with ``n``, the repetition guard's (``search_step.c``:
    ``sampling.ban_repeated_ngrams``' columns, in one call). ``history``: (N, t) int64 tokens
    so far; ``skip``: (N,) bool rows the guard leaves; ``to_column``: token id -> column."""
    if logits.dtype != torch.float32 or not logits.is_cpu or not logits.is_contiguous():
        raise ValueError(f"mask_step takes contiguous float32 CPU logits, got {logits.dtype} "
                         f"on {logits.device}")
    rows, cols = logits.shape
    never = np.ascontiguousarray(never, dtype=np.int64)
    guard = n > 0 and history is not None and history.shape[1] >= n
    if guard:
        history = np.ascontiguousarray(history, dtype=np.int64)
        skip = None if skip is None else np.ascontiguousarray(skip, dtype=np.uint8)
    _library().mask_step(logits.data_ptr(), rows, cols, never.ctypes.data, never.size,
                         history.ctypes.data if guard else None, history.shape[1] if guard else 0,
                         n if guard else 0, skip.ctypes.data if guard and skip is not None else None,
                         _pointer(None if to_column is None else to_column.to(torch.long).contiguous()),
                         PAD_ID)


def beam_choose(best: Tensor, columns: Tensor, scores: Tensor, ids: Tensor | None, width: int,
                candidates: int) -> tuple[np.ndarray, Tensor, Tensor]:
    """A beam step's choice (``search_step.c``, ``steps.expand``'s after its top-k): the
    (A*K, width) best log-probabilities of each row and their columns, and the (A, K) live
    scores -> the (A, 3 C + 3 K) host rows ``expand`` copies over (the C = ``candidates``
    best, then the K that stay alive: scores, beams, tokens) and the survivors' (A, K) scores
    and tokens. ``ids``: column -> token id (None: the same)."""
    A, K = scores.shape
    best, columns, scores = best.contiguous(), columns.contiguous(), scores.contiguous()
    ids = None if ids is None else ids.to(torch.long).contiguous()
    host = np.empty((A, 3 * candidates + 3 * K))
    alive_scores, alive_tokens = torch.empty(A, K), torch.empty(A, K, dtype=torch.long)
    if A and _library().beam_choose(best.data_ptr(), columns.data_ptr(), A, K, width,
                                    scores.data_ptr(), _pointer(ids), EOS_ID, candidates,
                                    host.ctypes.data, alive_scores.data_ptr(),
                                    alive_tokens.data_ptr()):
        raise ValueError(f"beam_choose takes up to {MAX_CANDIDATES} candidates from at least beam's, "
                         f"got {candidates} of {K} x {width}")
    return host, alive_scores, alive_tokens


def embed_step(embedding: Tensor, scale: float, table: Tensor, ids: Tensor, positions: Tensor
               ) -> Tensor:
    """(N,) token ids at (N,) positions -> (N, d) ``embedding[ids] * scale + table[positions]``
    (``search_step.c``: the model's embedding and positional encoding of one step, the same
    floats); a ValueError for an id or position outside its table."""
    ids, positions = ids.to(torch.long).contiguous(), positions.to(torch.long).contiguous()
    if embedding.dtype != torch.float32 or table.dtype != torch.float32 or not embedding.is_cpu:
        raise ValueError("embed_step takes float32 CPU tables")
    embedding, table = embedding.contiguous(), table.contiguous()
    out = torch.empty(ids.numel(), embedding.size(1))
    if _library().embed_step(embedding.data_ptr(), embedding.size(0), scale, table.data_ptr(),
                             table.size(0), ids.data_ptr(), positions.data_ptr(), ids.numel(),
                             embedding.size(1), out.data_ptr()):
        raise ValueError(f"token ids or positions outside the tables ({embedding.size(0)} ids, "
                         f"{table.size(0)} positions)")
    return out


class DecoderWeights(ctypes.Structure):
    """The decoder's fixed weights around its layers for ``beam_step`` (``layers.c``'s
    ``Decoder``): its layers' ``LayerWeights``, the target embedding and sinusoid table, the
    final LayerNorm (None after post-norm layers) and the output layer's product; pointers into
    tensors that whoever fills it keeps alive and unchanged."""

    _fields_ = [("layers", ctypes.POINTER(LayerWeights)), ("n_layers", ctypes.c_long),
                ("embedding", ctypes.c_void_p), ("table", ctypes.c_void_p), ("vocab", ctypes.c_long),
                ("positions", ctypes.c_long), ("scale", ctypes.c_float), ("norm_gain", ctypes.c_void_p),
                ("norm_bias", ctypes.c_void_p), ("norm_eps", ctypes.c_float), ("output", Product)]


class Choice(ctypes.Structure):
    """What a beam search fixes for all its steps (``search_step.c``'s ``Choice``): the columns
    never chosen, the repetition guard's n, column <-> token id, EOS and PAD, each row's best
    and each sentence's candidates."""

    _fields_ = [("never", ctypes.c_void_p), ("n_never", ctypes.c_long), ("n_gram", ctypes.c_long),
                ("to_column", ctypes.c_void_p), ("ids", ctypes.c_void_p), ("eos", ctypes.c_int64),
                ("pad", ctypes.c_int64), ("width", ctypes.c_long), ("candidates", ctypes.c_long)]


def beam_step(decoder: DecoderWeights, places: ctypes.Array, choice: Choice, tokens: Tensor,
              start: Tensor | None, scores: Tensor, history: np.ndarray,
              ancestry: Tensor | None = None, followed: Tensor | None = None,
              totals: np.ndarray | None = None, avx512: bool | None = None
              ) -> tuple[np.ndarray, Tensor, Tensor, tuple[np.ndarray, np.ndarray, bool] | None]:
    """A whole beam step in one call (``search_step.c``): the (A*K,) newest tokens through the
    decoder (its layers' ``places``, one ``StepPlaces`` each, every layer's position and slot
    table read from the first's; ``start``: (A*K,) int64 column where each row began, or
    None), the step's masks, top-k and choice with the (A, K) live
    scores and the rows' (A*K, t) ``history`` -> ``beam_choose``'s answer: the host rows and
    the survivors' scores and tokens. ``tokens`` and ``start`` must be contiguous int64,
    ``scores`` contiguous float32. ``followed``: an (A*K, t' + 1) int64
    tensor that the call fills with the slot table of a store of t' positions (its
    ``ancestry`` before the step, (A*K, c) int64 with unit column stride, or None: no
    recorded slots) after the choice, every row following its chosen beam: what
    ``cache.Store.reorder`` would make of it when every sentence stays. ``totals``: the rows'
    (A*K, t) float64 log-probabilities so far (``steps.Rows``); with them the fourth answer is
    the rows' history and totals after the step, (A*K, t + 1) each, every row following its
    chosen beam (what ``Rows.follow`` makes of them), and whether nothing ends at this step
    (no EOS among any sentence's K best candidates, a live beam in each); else None."""
    A, K = scores.shape
    C = choice.candidates
    if followed is not None:
        rows, columns = (0, 0) if ancestry is None else ancestry.shape
        if (followed.shape[0] != A * K or not followed.is_contiguous() or followed.dtype != torch.long
                or columns >= followed.shape[1] or (rows * columns and (
                    rows != A * K or ancestry.dtype != torch.long or ancestry.stride(1) != 1))):
            raise ValueError(f"followed must be ({A * K}, positions + 1) int64 and contiguous, ancestry "
                             "its store's slots before the step")
        ancestry = ancestry if rows * columns else None
    host = np.empty((A, 3 * C + 3 * K))
    alive_scores, alive_tokens = torch.empty(A, K), torch.empty(A, K, dtype=torch.long)
    t = history.shape[1]  # the kernel's guard reads it where n_gram > 0 and t >= n_gram
    if history.shape[0] != A * K or (totals is not None and totals.shape != history.shape):
        raise ValueError(f"history (and totals) must be ({A * K}, t), a row per beam")
    history = np.ascontiguousarray(history, dtype=np.int64)
    if totals is not None:
        totals = np.ascontiguousarray(totals, dtype=np.float64)
        following = np.empty((A * K, t + 1), dtype=np.int64), np.empty((A * K, t + 1))
    failed = _library().beam_step(ctypes.byref(decoder), places, decoder.output.n, ctypes.byref(choice),
                                  tokens.data_ptr(), _pointer(start), A, K, history.ctypes.data, t,
                                  scores.data_ptr(), _address(host), alive_scores.data_ptr(),
                                  alive_tokens.data_ptr(), _pointer(ancestry),
                                  0 if ancestry is None else ancestry.stride(0),
                                  0 if ancestry is None else ancestry.size(1),
                                  0 if followed is None else followed.size(1) - 1, _pointer(followed),
                                  *((totals.ctypes.data, _address(following[0]),
                                     _address(following[1])) if totals is not None else (None,) * 3),
                                  int(_avx512_path(avx512)))
    _check_step(failed, decoder, choice, A, K)
    return host, alive_scores, alive_tokens, None if totals is None else (*following, failed == 1)


def beam_steps(decoder: DecoderWeights, places: ctypes.Array, choice: Choice, tokens: Tensor,
               start: Tensor | None, scores: Tensor, history: np.ndarray, totals: np.ndarray,
               ancestry: Tensor | None, length: int, most: int, wake: int | None = None,
               avx512: bool | None = None, finished: np.ndarray | None = None) -> tuple:
    """Up to ``most`` of ``beam_step``'s steps in one call (``search_step.c``'s beam_steps),
    each with ``totals`` and the cache's slot table followed (``ancestry``, of a store of
    ``length`` positions before the first), the next taken while the last ended nothing and
    nothing has arrived on the file descriptor ``wake`` (None: none); ``places`` move with
    them. With ``finished`` ((A,) the hypotheses each sentence has finished), a step at which
    hypotheses end but no sentence is done counts as ending nothing, its hypotheses recorded.
    -> the last step's ``beam_step`` answer (host rows, survivors' scores and tokens,
    the rows' history and totals after it and whether it ended nothing, or with
    ``finished`` whether every sentence goes on after it), its slot table
    ((A*K, length + taken)), the steps taken, the rows' history, totals and slot table
    before it (None where it was the first): what the caller's quiet steps made of them, and
    the hypotheses recorded (None where none): (n, 3) their sentence (row of ``scores``),
    history columns before their step (t) and score, and (n, >= t) the history and totals of
    the beam each ends, before its step."""
    A, K = scores.shape
    rows, t = A * K, history.shape[1]
    if history.shape != (rows, t) or totals.shape != history.shape or most < 1:
        raise ValueError(f"history and totals must be ({rows}, t), a row per beam, for 1 step or more")
    _check_ancestry(ancestry, rows, length)
    ancestry = ancestry if ancestry is not None and ancestry.numel() else None
    history = np.ascontiguousarray(history, dtype=np.int64)
    totals = np.ascontiguousarray(totals, dtype=np.float64)
    host = np.empty((A, 3 * choice.candidates + 3 * K))
    alive_scores, alive_tokens = torch.empty(A, K), torch.empty(A, K, dtype=torch.long)
    tables = torch.empty(2, rows * (length + most), dtype=torch.long)  # the answers of steps in turn
    histories, all_totals = np.empty((2, rows * (t + most)), dtype=np.int64), np.empty((2, rows * (t + most)))
    taken, n_ended = ctypes.c_long(0), ctypes.c_long(0)
    counts = ended = ended_ids = ended_totals = None
    if finished is not None:
        counts = np.array(finished, dtype=np.int64)  # a copy: the kernel counts the recorded in
        if counts.shape != (A,):
            raise ValueError(f"finished must count each of the {A} sentences' hypotheses")
        ended = np.empty((rows, 3))  # at most K - 1 a sentence: one more and it would be done
        ended_ids, ended_totals = np.empty((rows, t + most), dtype=np.int64), np.empty((rows, t + most))
    failed = _library().beam_steps(ctypes.byref(decoder), places, decoder.output.n, ctypes.byref(choice),
                                   tokens.data_ptr(), _pointer(start), A, K, history.ctypes.data, t,
                                   scores.data_ptr(), _address(host), alive_scores.data_ptr(),
                                   alive_tokens.data_ptr(), _pointer(ancestry),
                                   0 if ancestry is None else ancestry.stride(0),
                                   0 if ancestry is None else ancestry.size(1), length, tables.data_ptr(),
                                   totals.ctypes.data, _address(histories), _address(all_totals), most,
                                   -1 if wake is None else wake, int(_avx512_path(avx512)),
                                   ctypes.byref(taken), None if counts is None else _address(counts),
                                   ctypes.byref(n_ended), *(None if x is None else _address(x)
                                                            for x in (ended, ended_ids, ended_totals)))
    _check_step(failed, decoder, choice, A, K)

    def answer(i: int) -> tuple[np.ndarray, np.ndarray, Tensor]:  # step i's, from 0: its half
        h, width = i % 2, t + i + 1
        return (histories[h, :rows * width].reshape(rows, width),
                all_totals[h, :rows * width].reshape(rows, width),
                tables[h, :rows * (length + i + 1)].view(rows, length + i + 1))

    steps = taken.value
    history, totals, followed = answer(steps - 1)
    n = n_ended.value
    return (host, alive_scores, alive_tokens, (history, totals, failed == 1), followed, steps,
            answer(steps - 2) if steps > 1 else None,
            (ended[:n], ended_ids[:n], ended_totals[:n]) if n else None)


def _check_ancestry(ancestry: Tensor | None, rows: int, length: int) -> None:
    if ancestry is not None and ancestry.numel() and (
            ancestry.shape[0] != rows or ancestry.size(1) > length or ancestry.dtype != torch.long
            or ancestry.stride(1) != 1):
        raise ValueError(f"ancestry must be its store's ({rows}, up to {length} positions) int64 slots, "
                         "unit column stride")


def _check_step(failed: int, decoder: DecoderWeights, choice: Choice, A: int, K: int) -> None:
    """A beam step's failure (``search_step.c``'s codes), raised in a line."""
    if failed == -2:
        raise ValueError(f"token ids or positions outside the tables ({decoder.vocab} ids, "
                         f"{decoder.positions} positions)")
    if failed == -3:
        raise ValueError(f"beam_step takes up to {MAX_CANDIDATES} candidates from at least beam's, "
                         f"got {choice.candidates} of {K} x {choice.width}")
    if failed < 0:
        raise MemoryError(f"a beam step could not allocate its scratch for {A * K} rows")


def choice(never: Sequence[int], n_gram: int, to_column: Tensor | None, ids: Tensor | None,
           width: int, candidates: int) -> Choice:
    """A search's ``Choice``, keeping the arrays it points into (``never``: the columns never
    chosen; ``to_column``, ``ids``: token id -> column and back, None: the same)."""
    keep = [np.ascontiguousarray(never, dtype=np.int64)]
    keep += [None if t is None else t.to(torch.long).contiguous() for t in (to_column, ids)]
    made = Choice(keep[0].ctypes.data, keep[0].size, n_gram, _pointer(keep[1]), _pointer(keep[2]), EOS_ID,
                  PAD_ID, width, candidates)
    made.keep = keep
    return made
