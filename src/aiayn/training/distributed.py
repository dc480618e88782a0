"""Processes: one, or one per rank under torchrun; the device and its precision; collectives
(and the failure that says a peer rank is gone); the DDP (and compiled) module the training
loop calls; seeds and RNG states. (CPU threads: aiayn.util.threads.)

Every function takes the :class:`Dist` that ``setup_distributed`` returns and is a no-op
(or the identity) in a single process, so the training loop reads the same either way.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from aiayn.errors import AiaynError
from aiayn.util.device import choose_device


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




def world_size_from_env() -> int:
    """How many ranks the launcher (torchrun, or a cluster's) started: WORLD_SIZE, else 1."""
    given = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(given)
    except ValueError:
        raise AiaynError(f"WORLD_SIZE={given!r} is not a number of processes (torchrun or a "
                         "cluster's launcher sets it; unset it to train in one process)") from None


def setup_distributed(device: str | None = None) -> Dist:
    """Read torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); start the process group.

    NCCL when every rank has a GPU, gloo on CPUs. ``device``: see :func:`choose_device`
    (under torchrun, a rank's GPU is its LOCAL_RANK).
    """
    world_size = world_size_from_env()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    where = choose_device(device, local_rank)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if where.type == "cuda" else "gloo",
                                timeout=timedelta(minutes=30))
    return Dist(rank, world_size, local_rank, where)


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


# What a collective raises on a rank whose peer process died (gloo's TCP transport).
PEER_LOST = ("Connection closed by peer", "Connection reset by peer")


def lost_a_rank(exc: BaseException) -> bool:
    """Whether ``exc`` says that another rank's process is gone (killed, out of memory): a
    failure of the run, not of this rank, which the CLI reports as one line."""
    return any(marker in str(exc) for marker in PEER_LOST)


def wrap_for_training(model: nn.Module, compile_: bool, world: Dist
                      ) -> tuple[nn.Module | None, nn.Module]:
    """(the DistributedDataParallel wrapper or None, the module the loop calls)."""
    ddp: nn.Module | None = None
    train_model = model
    if world.enabled:
        ddp = train_model = nn.parallel.DistributedDataParallel(
            model, device_ids=[world.device.index] if world.device.type == "cuda" else None)
    if compile_:
        # Batch shapes vary with the length buckets: compile once for symbolic shapes.
        train_model = torch.compile(train_model, dynamic=True)
    return ddp, train_model


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
