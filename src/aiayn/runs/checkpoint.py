"""Checkpoints that survive a crash, and loading that never unpickles arbitrary objects.

Every file is written atomically (``aiayn.util.io``).

Weights are safetensors (tensors only, no code). Tied weights are stored once.

What else a run directory holds, and where: ``aiayn.runs.directory``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from aiayn.errors import AiaynError
from aiayn.util.io import atomic_path, interrupt_deferred


def unique_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with each shared (tied) tensor kept once, under its first name."""
    seen: set[int] = set()
    tensors = {}
    for name, tensor in model.state_dict().items():
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        tensors[name] = tensor.detach().cpu().contiguous()
    return tensors


# What the weights alone cannot tell: settings that change the function computed with
# tensors of the same shapes (heads, norm placement, tying). Stored in every file's
# metadata with the sizes, and checked against the config on load.
ARCHITECTURE = ("src_vocab_size", "tgt_vocab_size", "d_model", "n_heads", "d_ff",
                "n_encoder_layers", "n_decoder_layers", "max_len", "norm_first",
                "qk_norm", "qk_norm_cross", "qk_norm_cross_query", "output_vocab",
                "tie_embeddings", "pad_id")
ARCHITECTURE_KEY = "aiayn_architecture"


def architecture(model: nn.Module) -> dict[str, object]:
    """The model's architecture settings (``ARCHITECTURE``) from its ModelConfig."""
    return {name: getattr(model.cfg, name) for name in ARCHITECTURE}


def save_weights(model: nn.Module, path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write the model's weights as safetensors, atomically, with its architecture."""
    model = getattr(model, "module", model)  # unwrap DistributedDataParallel
    model = getattr(model, "_orig_mod", model)  # unwrap torch.compile
    metadata = {**(metadata or {}), ARCHITECTURE_KEY: json.dumps(architecture(model))}
    write_safetensors(unique_state_dict(model), path, metadata)


def tensors_size(tensors) -> int:
    """Bytes the tensors take in a file (safetensors and torch.save store them raw)."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    if isinstance(tensors, dict):
        return sum(tensors_size(value) for value in tensors.values())
    if isinstance(tensors, (list, tuple)):
        return sum(tensors_size(value) for value in tensors)
    return 0


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | Path,
                      metadata: dict[str, str]) -> None:
    """The one place weights are written: atomically (aiayn.util.io.atomic_path), and a full
    disk, a quota or a read-only mount is one DiskError naming ``path`` and the size (the
    Rust writer raises its own SafetensorError, "... (os error 28)", not an OSError)."""
    with atomic_path(path, need=tensors_size(tensors), what="the weights file") as tmp:
        try:
            save_file(tensors, str(tmp), metadata=metadata)
        except SafetensorError as exc:
            code = re.search(r"\(os error (\d+)\)", str(exc))
            if code is None:
                raise
            number = int(code.group(1))
            raise OSError(number, os.strerror(number), str(tmp)) from None


def read_metadata(path: str | Path) -> dict[str, str]:
    """The metadata stored in a safetensors file (without reading its tensors)."""
    try:
        with safe_open(str(path), framework="pt") as fh:
            return fh.metadata() or {}
    except (SafetensorError, OSError, ValueError) as exc:
        raise AiaynError(f"{path}: not a readable safetensors file ({exc})") from None


def weights_fingerprint(path: str | Path) -> str:
    """The sha256 of a weights file's bytes: which weights an evaluation scored, so that
    its figures are never shown for other weights saved later under the same name."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_unchanged(path: str | Path, fingerprint: str) -> None:
    """An AiaynError if the weights file ``path`` no longer has ``fingerprint`` (taken before
    reading it): a training run saved it again meanwhile, and what was computed would be
    labelled with weights that did not give it."""
    if weights_fingerprint(path) != fingerprint:
        raise AiaynError(f"{path} was saved again while it was being read (is `aiayn train` "
                         "running on this run?); run the command again once it is done, or "
                         "give a step checkpoint with --weights")


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise AiaynError(f"weights file not found: {path}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise AiaynError(f"{path}: not a readable safetensors file ({exc})") from None


def load_weights(model: nn.Module, path: str | Path) -> None:
    """Load safetensors weights into ``model``. Refused, naming both values: weights saved
    for another architecture (n_heads, norm placement, ... from the file's metadata; files
    without it are checked by shapes alone); tensors whose shapes differ; non-finite values."""
    check_architecture(model, path)
    tensors = read_weights(path)
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise AiaynError(f"{path}: {name} holds NaN or infinite values; these weights "
                             "cannot translate (use an earlier checkpoint, e.g. --weights "
                             "last or one of checkpoints/step_*.safetensors)")
    load_state(model, tensors, str(path))


def check_architecture(model: nn.Module, path: str | Path) -> None:
    """The architecture in the file's metadata must be the model's (i.e. the config's)."""
    stored = read_metadata(path).get(ARCHITECTURE_KEY)
    if stored is None:
        return  # written before aiayn stored it: shapes are still checked
    try:
        stored = json.loads(stored)
    except json.JSONDecodeError:
        raise AiaynError(f"{path}: its {ARCHITECTURE_KEY} metadata is not JSON") from None
    expected = architecture(model)
    for name, value in expected.items():
        if name in stored and stored[name] != value:
            raise AiaynError(f"{path}: the weights were trained with model.{name}="
                             f"{stored[name]!r} but the config says model.{name}={value!r}; "
                             "put the training value back in config.yaml")


def load_state(model: nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    expected = model.state_dict()
    stored_once = set(unique_state_dict(model))
    missing = [k for k in stored_once if k not in tensors]
    unexpected = [k for k in tensors if k not in expected]
    if missing or unexpected:
        raise AiaynError(
            f"{source}: weights do not fit this model (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}); is the config the one it was trained with?"
        )
    for name, tensor in tensors.items():
        if tensor.shape != expected[name].shape:
            raise AiaynError(
                f"{source}: {name} has shape {tuple(tensor.shape)} but the model expects "
                f"{tuple(expected[name].shape)} (vocabulary or size mismatch)"
            )
    model.load_state_dict(tensors, strict=False)


# The layout of train_state.pt (aiayn.training.loop.Trainer.save writes it, resume and
# `aiayn doctor` read it); a change that old files cannot be read by raises it.
STATE_VERSION = 1


def save_train_state(state: dict, path: str | Path) -> None:
    """torch.save of plain containers and tensors, atomically (loaded with weights_only)."""
    # Through a Python file: torch's own file writer reports a full disk as a RuntimeError
    # without an errno ("unexpected pos ..."), a file object raises the OSError itself; a
    # Ctrl-C waits for the whole file (inside a write torch would make it a RuntimeError).
    with interrupt_deferred(), \
            atomic_path(path, need=tensors_size(state), what="the train state") as tmp, \
            open(tmp, "wb") as fh:
        torch.save(state, fh)


def load_train_state(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise AiaynError(f"training state not found: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a bad file to the user
        raise AiaynError(f"{path}: cannot read training state ({exc})") from None


# ---------------------------------------------------------------- averaging (paper, 6.1)
def average_checkpoints(paths: list[str | Path], out: str | Path) -> dict[str, torch.Tensor]:
    """Write the element-wise mean of the weights in ``paths`` to ``out`` (safetensors).

    The paper's base models use "a single model obtained by averaging the last 5
    checkpoints, which were written at 10-minute intervals" (section 6.1). The sum is kept
    in float64 and cast back to each tensor's dtype. Every file must hold the same tensor
    names and shapes; the first difference is reported by file and name.
    """
    if not paths:
        raise AiaynError("nothing to average: no checkpoint files given")
    first = read_weights(paths[0])
    total = {name: tensor.double() for name, tensor in first.items()}
    for path in paths[1:]:
        tensors = read_weights(path)
        _check_same_tensors(first, tensors, paths[0], path)
        for name, tensor in tensors.items():
            if not tensor.is_floating_point() and not torch.equal(tensor, first[name]):
                raise AiaynError(f"{path}: cannot average it with {paths[0]}: {name} differs "
                                 "(it is not a weight but a setting, e.g. the output pieces)")
            total[name] += tensor.double()
    averaged = {name: (t / len(paths)).to(first[name].dtype).contiguous()
                for name, t in total.items()}
    metadata = {"averaged_from": "\n".join(str(p) for p in paths)}
    architectures = {read_metadata(path).get(ARCHITECTURE_KEY) for path in paths}
    if len(architectures) > 1:
        raise AiaynError(f"cannot average {', '.join(map(str, paths))}: they were saved by "
                         "models of different architectures (their metadata differ)")
    if None not in architectures:
        metadata[ARCHITECTURE_KEY] = architectures.pop()
    write_safetensors(averaged, out, metadata)
    return averaged


def _check_same_tensors(reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor],
                        reference_path, other_path) -> None:
    if set(reference) != set(other):
        differ = sorted(set(reference) ^ set(other))
        raise AiaynError(f"{other_path}: cannot average it with {reference_path}: tensor names "
                         f"differ ({', '.join(differ[:3])})")
    for name, tensor in other.items():
        if tensor.shape != reference[name].shape:
            raise AiaynError(f"{other_path}: cannot average it with {reference_path}: {name} "
                             f"has shape {tuple(tensor.shape)}, not "
                             f"{tuple(reference[name].shape)}")
