"""The device a command runs on and its precision: ``--device auto|cpu|cuda|mps``, the
precision choice (bf16 on a CPU measured, never assumed from its name; fp16 on a GPU
without bf16), the machine's memory and CPU model.
"""

from __future__ import annotations

import functools
import math
import os
import platform
import time

import torch

from aiayn.errors import AiaynError
from aiayn.options import DEVICES
from aiayn.util.threads import on_one_thread


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


def mps_usable() -> bool:
    """Whether PyTorch's MPS backend exists here and runs the operations the model is made
    of (embedding, attention through scaled_dot_product_attention, LayerNorm, the
    label-smoothed loss and its backward pass): a probe on tiny tensors, once per process.
    An MPS that lacks one of them (an older macOS or PyTorch) is not chosen by "auto"."""
    return _probe_mps()


@functools.cache  # the answer cannot change within a process
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


def resolve_precision(setting: str, device: torch.device) -> tuple[str, str]:
    """``train.precision``: "fp32", "bf16" and "fp16" force it; "auto" takes bfloat16
    autocast where this device runs it fast (a GPU that supports it; a CPU whose bf16 matmul
    beats fp32 in a probe), float16 with a gradient scaler on a GPU without bf16 (a T4, V100,
    P100: fp16 tensor cores), else fp32 (a CPU without fast bf16; MPS). Returns the choice
    and why, for the log."""
    if setting != "auto":
        return setting, f"train.precision={setting}"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16", "auto: this GPU supports bfloat16"
        return "fp16", "auto: this GPU has no bfloat16, so float16 with a gradient scaler"
    if device.type == "mps":  # its bf16 autocast is partial across macOS versions
        return "fp32", "auto: fp32 on MPS"
    # On one thread: what the probe compares is the core's arithmetic, and two threads would
    # time the barrier of a busy core instead (fp32 8.0 ms against 0.2 ms quiet, seen here).
    fp32, bf16 = on_one_thread(lambda: (matmul_seconds(torch.float32),
                                        matmul_seconds(torch.bfloat16)))
    use = "bf16" if prefer_bf16(fp32, bf16) else "fp32"
    return use, (f"auto: a probe matmul took {fp32 * 1e3:.1f} ms in fp32 and {bf16 * 1e3:.1f} ms "
                 f"in bf16 on this CPU ({torch.backends.cpu.get_cpu_capability()})")


def resolve_bf16(setting: str, device: torch.device) -> tuple[bool, str]:
    """The older question, whether to train in bf16 (``train.bf16``: "true" / "false" /
    "auto"): ``resolve_precision`` of the precision it stands for, answered as a bool."""
    precision = {"true": "bf16", "false": "fp32"}.get(setting, setting)
    use, why = resolve_precision(precision, device)
    return use == "bf16", why.replace(f"train.precision={precision}", f"train.bf16={setting}")


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a resolved precision (None: fp32, no autocast)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


def machine_kind(device: torch.device) -> str:
    """The kind of machine a timing probe's choice holds for: the GPU, or the CPU's model
    with the vector instructions PyTorch uses on it, and the PyTorch build (a run's resume
    on the same kind keeps the choices of its start: aiayn.training.loop.kept_choices)."""
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


def parameter_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's weights."""
    return next(model.parameters()).device
