"""Processes: one, or one per rank under torchrun; the device and its precision; collectives;
seeds and RNG states. (CPU threads: aiayn.threads.)

Every function takes the :class:`Dist` that ``setup_distributed`` returns and is a no-op
(or the identity) in a single process, so the training loop reads the same either way.
"""

from __future__ import annotations

import math
import os
import platform
import random
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from aiayn.errors import AiaynError
from aiayn.threads import on_one_thread


# ---------------------------------------------------------------- processes and devices
@dataclass
class Dist:
    """Where this process runs: its rank among ``world_size`` and its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


DEVICES = ("auto", "cpu", "cuda", "mps")


def choose_device(choice: str | None = "auto", index: int = 0) -> torch.device:
    """``--device``: "cpu", "cuda" (GPU ``index``), "mps" (an Apple-silicon GPU) or
    "auto"/None: a CUDA GPU when there is one, else MPS where it runs the model
    (``mps_usable``), else the CPU."""
    if choice in (None, "auto"):
        choice = "cuda" if torch.cuda.is_available() else "mps" if mps_usable() else "cpu"
    if choice not in DEVICES[1:]:
        raise AiaynError(f"--device must be one of {', '.join(DEVICES)}, got {choice!r}")
    if choice == "cuda" and not torch.cuda.is_available():
        raise AiaynError("--device cuda: no CUDA GPU is available")
    if choice == "mps" and not mps_usable():
        raise AiaynError("--device mps: no Apple-silicon GPU (MPS) that runs the model here "
                         "(it needs macOS 12.3+ on Apple silicon and a PyTorch built with MPS)")
    return torch.device("cuda", index) if choice == "cuda" else torch.device(choice)


_MPS_USABLE: list[bool] = []  # the probe's answer, once per process


def mps_usable() -> bool:
    """Whether PyTorch's MPS backend exists here and runs the operations the model is made
    of (embedding, attention through scaled_dot_product_attention, LayerNorm, the
    label-smoothed loss and its backward pass): a probe on tiny tensors, once per process.
    An MPS that lacks one of them (an older macOS or PyTorch) is not chosen by "auto"."""
    if not _MPS_USABLE:
        _MPS_USABLE.append(_probe_mps())
    return _MPS_USABLE[0]


def _probe_mps() -> bool:
    backend = getattr(torch.backends, "mps", None)
    if backend is None or not backend.is_available():
        return False
    try:
        device = torch.device("mps")
        table = torch.randn(8, 16, device=device, requires_grad=True)
        x = torch.nn.functional.embedding(torch.tensor([[1, 2, 3]], device=device), table)
        q = x.view(1, 3, 2, 8).transpose(1, 2)
        y = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        y = torch.nn.functional.layer_norm(y.transpose(1, 2).reshape(1, 3, 16), (16,))
        loss = torch.nn.functional.cross_entropy(y[0] @ table.T, torch.tensor([1, 2, 0], device=device),
                                                 label_smoothing=0.1)
        loss.backward()
        return bool(torch.isfinite(loss).item())
    except Exception:  # any op missing or failing: the CPU it is
        return False


def physical_memory() -> int:
    """This machine's physical memory in bytes (POSIX sysconf; Windows
    GlobalMemoryStatusEx; 8 GiB where neither answers)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf: Windows
        pass
    try:
        import ctypes

        class MemoryStatus(ctypes.Structure):
            _fields_ = [("length", ctypes.c_ulong), ("load", ctypes.c_ulong),
                        ("total", ctypes.c_ulonglong), ("available", ctypes.c_ulonglong),
                        ("total_page", ctypes.c_ulonglong), ("available_page", ctypes.c_ulonglong),
                        ("total_virtual", ctypes.c_ulonglong),
                        ("available_virtual", ctypes.c_ulonglong),
                        ("available_extended", ctypes.c_ulonglong)]

        status = MemoryStatus(length=ctypes.sizeof(MemoryStatus))
        if ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status)):  # type: ignore[attr-defined]
            return int(status.total)
    except (AttributeError, OSError):
        pass
    return 8 << 30


def setup_distributed(device: str | None = None) -> Dist:
    """Read torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); start the process group.

    NCCL when every rank has a GPU, gloo on CPUs. ``device``: see :func:`choose_device`
    (under torchrun, a rank's GPU is its LOCAL_RANK).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    where = choose_device(device, local_rank)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if where.type == "cuda" else "gloo",
                                timeout=timedelta(minutes=30))
    return Dist(rank, world_size, local_rank, where)


# ---------------------------------------------------------------- precision
def prefer_bf16(fp32_seconds: float, bf16_seconds: float, margin: float = 1.2) -> bool:
    """bfloat16 only where it is clearly faster: a CPU with native bf16 (AVX512-BF16, AMX)
    runs its matmuls about twice as fast as fp32; one without (AVX2 only) emulates them,
    many times slower."""
    return bf16_seconds * margin < fp32_seconds


def matmul_seconds(dtype: torch.dtype, size: tuple[int, int, int] = (128, 512, 512),
                   repeats: int = 3) -> float:
    """The fastest of ``repeats`` CPU matmuls (m x k) @ (k x n) in ``dtype`` (a probe of a
    few milliseconds in fp32)."""
    m, k, n = size
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return best


def resolve_bf16(setting: str, device: torch.device) -> tuple[bool, str]:
    """``train.bf16``: "true"/"false" force it; "auto" takes bfloat16 autocast where this
    device runs it fast (a GPU that supports it; a CPU whose bf16 matmul beats fp32 in a
    probe). Returns the choice and why, for the log."""
    if setting != "auto":
        return setting == "true", f"train.bf16={setting}"
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return ok, f"auto: this GPU {'supports' if ok else 'does not support'} bfloat16"
    if device.type == "mps":  # its bf16 autocast is partial across macOS versions
        return False, "auto: fp32 on MPS"
    # On one thread: what the probe compares is the core's arithmetic, and two threads would
    # time the barrier of a busy core instead (fp32 8.0 ms against 0.2 ms quiet, seen here).
    fp32, bf16 = on_one_thread(lambda: (matmul_seconds(torch.float32),
                                        matmul_seconds(torch.bfloat16)))
    use = prefer_bf16(fp32, bf16)
    return use, (f"auto: a probe matmul took {fp32 * 1e3:.1f} ms in fp32 and {bf16 * 1e3:.1f} ms "
                 f"in bf16 on this CPU ({torch.backends.cpu.get_cpu_capability()})")


def machine_kind(device: torch.device) -> str:
    """The kind of machine a timing probe's choice holds for: the GPU, or the CPU's model
    with the vector instructions PyTorch uses on it, and the PyTorch build (a run's resume
    on the same kind keeps the choices of its start: aiayn.train.kept_choices)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    elif device.type == "mps":
        name = f"Apple MPS on {cpu_model()}"
    else:
        name = f"{cpu_model()} ({torch.backends.cpu.get_cpu_capability()})"
    return f"{name}; torch {torch.__version__}"


def cpu_model() -> str:
    """/proc/cpuinfo's model name with its family and model numbers (a hypervisor often
    shortens the name, e.g. "AMD EPYC": the numbers name the generation, family 26 = AMD
    Zen 5), or what the platform says (the benchmarks name their CPU with it too)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, sep, value = line.partition(":")
                if not sep:
                    break  # the first processor's block ends here
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = info.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in info:
        name += f" (family {info['cpu family']} model {info.get('model', '?')})"
    return name


# ---------------------------------------------------------------- collectives

def all_reduce_sum(value: Tensor, world: Dist) -> Tensor:
    """The sum of ``value`` over all ranks (itself when there is one)."""
    if world.enabled:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def gather_objects(obj: Any, world: Dist) -> list[Any]:
    """Every rank's ``obj``, in rank order (for per-rank RNG and sampler states)."""
    if not world.enabled:
        return [obj]
    out: list[Any] = [None] * world.world_size
    dist.all_gather_object(out, obj)
    return out


def max_over_ranks(value: float, world: Dist) -> float:
    """The largest ``value`` of all ranks, on every rank (one clock for all: the training
    time that the budget and a time-based schedule read must be the same on every rank)."""
    if not world.enabled:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=world.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def on_main(action, world: Dist) -> None:
    """Run ``action`` on rank 0 only; if it fails with an AiaynError, every rank raises it
    (rather than the others waiting for rank 0 at the next collective until a timeout).
    Rank 0 raises its own error (a DiskError keeps its path and size for the CLI's line)."""
    error = caught = None
    if world.is_main:
        try:
            action()
        except AiaynError as exc:
            error, caught = str(exc), exc
    error = gather_objects(error, world)[0]
    if caught is not None:
        raise caught
    if error is not None:
        raise AiaynError(error)


# ---------------------------------------------------------------- seeds and RNG states
def set_seed(seed: int) -> None:
    """Seed every generator a run uses (python, numpy, torch CPU and GPUs)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """The RNG states as plain lists and tensors, loadable with ``weights_only=True``."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
