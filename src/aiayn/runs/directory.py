"""What a run directory holds, written by ``aiayn train`` and read by everything after it.

::

    RUN_DIR/
      config.yaml               the resolved Config (model, data, train, decode)
      tokenizer/                the tokenizer JSON files (see aiayn.data.tokenizer)
      data_dir.txt              absolute path of the prepared data it was trained on
      last.safetensors          weights after the latest save
      best.safetensors          weights with the best dev BLEU so far
      checkpoints/step_0001000.safetensors ...   the last few saves, for averaging, and
                                those of train.keep_steps (never pruned)
      train_state.pt            optimizer, schedule, step, RNG, sampler position
      metrics.jsonl, tb/        logs (aiayn.runs.metrics)

Creating one (``create_run_dir``), the model its config describes (``build_model``: a
fresh one for training, the one its weights load into), reading it back (``load_run``,
``read_data_dir``, ``load_run_config``, ``resolve_weights``) and its step
checkpoints (list, prune, choose for averaging). A directory `aiayn export` wrote is told
apart from a run (``read_export_info``), so a command given one says what it is.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from aiayn.config import Config, DecodeConfig, load_config, save_config
from aiayn.data.tokenizer import Tokenizers
from aiayn.errors import AiaynError
from aiayn.model import Transformer
from aiayn.runs.checkpoint import load_weights, read_metadata
from aiayn.util.io import atomic_write_text, check_writable_dir, disk_errors
from aiayn.util.lock import PID_FILE

# ---------------------------------------------------------------- creating a run
# What `aiayn train` writes into a run directory (``--force`` removes exactly these).
RUN_FILES = ("config.yaml", "config_history.jsonl", "tokenizer", "data_dir.txt",
             "last.safetensors", "best.safetensors", "checkpoints", "train_state.pt",
             "metrics.jsonl", "tb", "eval", "init_from.json")


def check_new_run_dir(run_dir: Path, force: bool) -> None:
    """``--out`` for a new run: a new or empty directory, or (with ``force``) one whose run
    files may go. Checked before anything is written."""
    run_dir = check_writable_dir(run_dir, "--out")
    if not run_dir.is_dir() or force:
        return
    if (run_dir / "config.yaml").exists() or (run_dir / "train_state.pt").exists():
        raise AiaynError(
            f"{run_dir} already holds a run; continue it with `aiayn train --resume {run_dir}`, "
            f"start it over with --force (its weights, state and logs are deleted), or choose "
            f"another --out"
        )
    entries = sorted(p.name for p in run_dir.iterdir() if p.name != PID_FILE)
    if entries:
        raise AiaynError(f"--out {run_dir}: not empty (holds {', '.join(entries[:4])}"
                         f"{', ...' if len(entries) > 4 else ''}); choose a new directory or "
                         "give --force")


def create_run_dir(run_dir: Path, config: Config, data_dir: Path, force: bool = False) -> None:
    """Write the tokenizer copy, data_dir.txt and (last: it marks a run) config.yaml.

    ``force``: first remove the run files (``RUN_FILES``) an earlier run left; other files
    in the directory are left alone."""
    check_new_run_dir(run_dir, force)
    run_dir.mkdir(parents=True, exist_ok=True)
    if force:
        (run_dir / "config.yaml").unlink(missing_ok=True)  # no longer a run until rewritten
        for name in RUN_FILES:
            path = run_dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
    copy_tokenizer(data_dir / "tokenizer", run_dir / "tokenizer")
    atomic_write_text(run_dir / "data_dir.txt", str(data_dir.resolve()) + "\n")
    save_config(config, run_dir / "config.yaml")


def record_config(run_dir: Path, config: Config, overrides: list[str], step: int) -> None:
    """A resumed run: config.yaml takes the new train.*/decode.* settings, and config_history.jsonl
    says which, from which step (so a run's curve can be read with its changes)."""
    save_config(config, run_dir / "config.yaml")
    if overrides:
        line = json.dumps({"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                           "overrides": overrides}, ensure_ascii=False)
        history = run_dir / "config_history.jsonl"
        with disk_errors(history, what="the config history"), \
                open(history, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")


def resume_point(run_dir: Path, first_save: int) -> Path | None:
    """train_state.pt when the run saved one; None when it saved nothing yet: a crash before
    the first save, or during it before train_state.pt was written (start it over, which
    writes those weights again). Other weights without a train state cannot resume exactly:
    one AiaynError that names the ways on.

    A save writes the step checkpoint first, then train_state.pt, then last.safetensors, so a
    first save cut short leaves a step checkpoint of a step no later than ``first_save``
    (train.save_every; a run that stops earlier saves at its last step), no
    last.safetensors, and no weights of a later step (best.safetensors of a validation
    before it, train.keep_steps)."""
    state = run_dir / "train_state.pt"
    if state.is_file():
        return state
    named = sorted(run_dir.glob("*.safetensors"))
    steps = list_step_checkpoints(run_dir)
    if not named and not steps:
        return None
    if steps and not (run_dir / "last.safetensors").exists():
        newest = checkpoint_step(steps[-1])
        if newest <= first_save and all(0 <= _saved_step(p) <= newest for p in named):
            return None
    weights = [p.name for p in named] + [f"checkpoints/{p.name}" for p in steps]
    raise AiaynError(
        f"{run_dir}: has weights ({', '.join(weights[:3])}) but no train_state.pt, so it "
        f"cannot be resumed exactly; start a new run from them with `aiayn train --init-from "
        f"{run_dir} --data DIR --out NEW_RUN`, or start this one over with `aiayn train "
        f"--config {run_dir / 'config.yaml'} --data DIR --out {run_dir} --force`")


def _saved_step(path: Path) -> int:
    """The step in a weights file's metadata; -1 when it names none or cannot be read."""
    try:
        step = read_metadata(path).get("step", "")
    except AiaynError:
        return -1
    return int(step) if step.isdigit() else -1

def copy_tokenizer(src: Path, dst: Path) -> None:
    """Copy the tokenizer directory beside the weights (a temp dir renamed into place).
    File by file, not shutil.copytree: that one gathers a full disk into a shutil.Error
    without an errno; here it is one DiskError naming ``dst`` (and the temp dir goes)."""
    if not src.is_dir():
        raise AiaynError(f"tokenizer directory not found: {src} (run `aiayn prepare` first)")
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    files = sorted(path for path in src.rglob("*") if path.is_file())
    try:
        with disk_errors(dst, sum(path.stat().st_size for path in files), "the tokenizer copy"):
            tmp.mkdir(parents=True)
            for path in files:
                target = tmp / path.relative_to(src)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)
            shutil.rmtree(dst, ignore_errors=True)
            os.replace(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_run_config(run_dir: Path, overrides: list[str]) -> Config:
    """The run's saved config with ``train.*`` and ``decode.*`` overrides (a resumed run
    keeps its model/data; its search is no part of the weights)."""
    for item in overrides:
        if not item.strip().startswith(("train.", "decode.")):
            raise AiaynError(
                f"--set {item!r}: a resumed run keeps its model and data settings; only "
                f"train.* and decode.* settings can change"
            )
    return load_config(run_dir / "config.yaml", overrides)


def run_decode(run_dir: str | Path) -> DecodeConfig:
    """The search a run decodes with (its config.yaml's decode section), read alone, so that
    a command resolves and checks its search before it loads any weights. Without a
    config.yaml, the defaults: loading the run then says what is missing."""
    path = Path(run_dir) / "config.yaml"
    return load_config(path).decode if path.is_file() else DecodeConfig()


def read_data_dir(run_dir: str | Path) -> Path:
    """The prepared data directory a run was trained on (from data_dir.txt)."""
    path = Path(run_dir) / "data_dir.txt"
    if not path.is_file():
        raise AiaynError(f"{run_dir}: no data_dir.txt naming the prepared data; give --data DIR")
    data_dir = Path(path.read_text(encoding="utf-8").strip())
    if not data_dir.is_dir():  # moved or renamed since training: say where the name came from
        raise AiaynError(moved_data_line(data_dir, path))
    return data_dir


def moved_data_line(data_dir: Path, named_by: Path) -> str:
    """The error for prepared data that is not where the run's data_dir.txt says."""
    return (f"{data_dir}: prepared data directory not found (the path comes from {named_by}, "
            "written when the run was trained; if the data moved, give --data DIR, which "
            "overrides it)")


# ---------------------------------------------------------------- loading a run
def resolve_weights(run_dir: str | Path, weights: str | Path = "best") -> Path:
    """``best``/``last`` (or any NAME with RUN_DIR/NAME.safetensors), a file inside the run
    directory (``checkpoints/step_0001000.safetensors``, with or without the suffix) or a
    file path."""
    run_dir = Path(run_dir)
    stem = str(weights).removesuffix(".safetensors")
    named = run_dir / f"{stem}.safetensors"
    if named.is_file():
        return named
    path = Path(weights)
    if path.is_file():
        return path
    available = sorted(p.stem for p in run_dir.glob("*.safetensors")) + \
        [str(p.relative_to(run_dir).with_suffix("")) for p in reversed(list_step_checkpoints(run_dir))]
    more = f" and {len(available) - 4} more" if len(available) > 4 else ""
    hint = (f"available: {', '.join(available[:4])}{more} (choose with --weights; `aiayn info "
            f"{run_dir}` lists them all)" if available
            else "it holds no weights; has `aiayn train` saved any yet?")
    raise AiaynError(f"{run_dir}: no weights {str(weights)!r} (looked for {named} and "
                     f"{path}); {hint}")


def build_model(config: Config, device: torch.device) -> Transformer:
    """The Transformer ``config.model`` describes, freshly initialized, on ``device``."""
    return Transformer(config.model).to(device)


EXPORT_INFO = "aiayn_export.json"  # written by `aiayn export` (both targets): what, from where
_TARGET_NAMES = {"ctranslate2": "CTranslate2", "hf": "Hugging Face Transformers"}


def read_export_info(directory: str | Path) -> dict[str, Any] | None:
    """What `aiayn export` wrote into ``directory`` (its aiayn_export.json: target, run_dir,
    weights, quantization), or None where it is no export. A CTranslate2 model directory
    without that file (converted by hand) counts too, as target "ctranslate2"."""
    directory = Path(directory)
    path = directory / EXPORT_INFO
    if path.is_file():
        try:
            info = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # unreadable: still an export, of unknown origin
            info = {}
        return info if isinstance(info, dict) else {}
    if (directory / "model.bin").is_file() and not any(directory.glob("*.safetensors")):
        return {"target": "ctranslate2"}
    return None


def describe_export(info: dict[str, Any]) -> str:
    """An export in words: 'a CTranslate2 export (int8) of run demo, weights best'."""
    target = _TARGET_NAMES.get(info.get("target"), "an aiayn")
    kind = f" ({info['quantization']})" if info.get("quantization") else ""
    origin = f" of run {info['run_dir']}" if info.get("run_dir") else ""
    weights = f", weights {info['weights']}" if info.get("weights") else ""
    return f"a {target} export{kind}{origin}{weights}"


def not_a_run_error(run_dir: Path, info: dict[str, Any]) -> AiaynError:
    """The error of a command that needs a run directory and was given an export: what
    reads the export instead (docs/export.md)."""
    if info.get("target") == "ctranslate2":
        reader = "`aiayn translate|evaluate|serve` read it with --engine ctranslate2"
    else:
        reader = "Transformers loads it (docs/export.md)"
    return AiaynError(f"{run_dir}: {describe_export(info)}, not a run directory; {reader}; "
                      "training and export need the run directory it came from")


def check_run_dir(run_dir: Path) -> None:
    """A run directory that is no directory, as one line the same from every command: not
    there, or a file (a weights file given where its run is asked for)."""
    if run_dir.is_dir():
        return
    if run_dir.exists():
        raise AiaynError(f"{run_dir}: is a file, not a run directory (the folder `aiayn "
                         "train` wrote, not one of its files)")
    raise AiaynError(f"run directory not found: {run_dir}")


def load_run(run_dir: str | Path, weights: str | Path = "best"):
    """Load a run directory: ``(Config, Transformer in eval mode on the CPU, Tokenizers)``.

    Reads ``config.yaml``, ``tokenizer/`` and the weights (see ``resolve_weights``); a
    missing piece, or a tokenizer whose vocabulary does not fit the weights, is one
    AiaynError that names the file.
    """
    run_dir = Path(run_dir)
    check_run_dir(run_dir)
    exported = read_export_info(run_dir)
    if exported is not None:
        raise not_a_run_error(run_dir, exported)
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise AiaynError(f"{run_dir}: no config.yaml here; is it a run directory written by "
                         "`aiayn train`?")
    tokenizer_dir = run_dir / "tokenizer"
    if not tokenizer_dir.is_dir():
        raise AiaynError(f"{run_dir}: no tokenizer/ directory here; is it a run directory "
                         "written by `aiayn train`?")
    weights_path = resolve_weights(run_dir, weights)
    config = load_config(config_path)
    tokenizers = Tokenizers.load(tokenizer_dir)
    check_vocabularies(config, tokenizers, tokenizer_dir)
    model = build_model(config, torch.device("cpu"))
    load_weights(model, weights_path)
    return config, model.eval(), tokenizers


def check_vocabularies(config: Config, tokenizers, tokenizer_dir: Path) -> None:
    """The tokenizers must produce exactly the ids the model was built (and trained) for."""
    for side in ("src", "tgt"):
        have = int(getattr(tokenizers, f"{side}_vocab_size"))
        want = getattr(config.model, f"{side}_vocab_size")
        if have != want:
            raise AiaynError(
                f"{tokenizer_dir}: the {side} tokenizer has {have} tokens but the model's "
                f"model.{side}_vocab_size is {want}; this tokenizer does not belong to these "
                "weights"
            )


# ---------------------------------------------------------------- step checkpoints (training)
def step_checkpoint_path(run_dir: str | Path, step: int) -> Path:
    """RUN_DIR/checkpoints/step_0001000.safetensors: the weights after ``step`` updates."""
    return Path(run_dir) / "checkpoints" / f"step_{step:07d}.safetensors"


def list_step_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's step checkpoints, oldest first (by step number, not by file time)."""
    directory = Path(run_dir) / "checkpoints"
    if not directory.is_dir():
        return []
    paths = []
    for path in directory.glob("step_*.safetensors"):
        number = path.stem.removeprefix("step_")
        if number.isdigit():
            paths.append((int(number), path))
    return [path for _, path in sorted(paths)]


def checkpoint_step(path: str | Path) -> int:
    """The step of a step checkpoint, from its name (step_0001000.safetensors: 1000)."""
    return int(Path(path).stem.removeprefix("step_"))


def prune_step_checkpoints(run_dir: str | Path, keep: int, kept_steps=()) -> list[Path]:
    """Delete all but the newest ``keep`` step checkpoints, never those of ``kept_steps``
    (train.keep_steps: they do not count in ``keep``); returns the deleted paths.

    Call it only after train_state.pt names the newest one, so the weights a saved train
    state refers to are never the ones removed.
    """
    kept = set(kept_steps)
    paths = [p for p in list_step_checkpoints(run_dir) if checkpoint_step(p) not in kept]
    doomed = paths[: max(0, len(paths) - max(keep, 1))]
    for path in doomed:
        path.unlink(missing_ok=True)
    return doomed


def step_weights(run_dir: str | Path) -> list[tuple[int | None, Path]]:
    """(step, weights file) of every saved step of a run, oldest first: its step checkpoints,
    then last.safetensors unless a step checkpoint already holds its step (None: a file
    without the step in its metadata). A run without step checkpoints is one AiaynError that
    says how a run keeps them."""
    run_dir = Path(run_dir)
    paths = list_step_checkpoints(run_dir)
    if not paths:
        raise AiaynError(
            f"{run_dir}: no step checkpoints (checkpoints/step_*.safetensors) to compare; a run "
            "keeps its last train.keep_checkpoints saves (one every train.save_every steps) and "
            "those of train.keep_steps: train with e.g. --set 'train.keep_steps=[100, 200, 400]'")
    found = [(checkpoint_step(path), path) for path in paths]
    last = run_dir / "last.safetensors"
    if last.is_file():
        step = read_metadata(last).get("step")
        step = int(step) if step is not None and step.isdigit() else None
        if step is None or step not in {s for s, _ in found}:
            found.append((step, last))
    return found


def checkpoints_to_average(paths: list[str | Path], last: int | None = None) -> list[Path]:
    """The files `aiayn average` averages: each path a .safetensors file, or a run directory
    giving its last.safetensors (or, with ``last``, its newest ``last`` step checkpoints)."""
    if last is not None and last < 1:
        raise AiaynError(f"--last must be at least 1, got {last}")
    files = []
    for path in map(Path, paths):
        if path.is_file():
            files.append(path)
        elif not path.is_dir():
            raise AiaynError(f"not found: {path}")
        elif last is None:
            files.append(path / "last.safetensors")
        else:
            steps = list_step_checkpoints(path)
            if len(steps) < last:
                raise AiaynError(f"{path}: --last {last} asks for {last} step checkpoints but "
                                 f"{path / 'checkpoints'} holds {len(steps)}")
            files.extend(steps[-last:])
    return files
