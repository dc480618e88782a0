"""`aiayn export RUN_DIR --to hf|ctranslate2 OUT_DIR`: one run's weights, tokenizer and model
card into a new directory, written atomically (a failed export leaves nothing behind).
"""

from __future__ import annotations

import json
from glob import escape as glob_escape
from pathlib import Path

from aiayn.config import load_config
from aiayn.errors import AiaynError
from aiayn.export.base import (
    check_target_can_express,
    export_size,
    without_local_paths,
    write_aiayn_side,
)
from aiayn.export.ctranslate2 import write_ctranslate2
from aiayn.export.hf import check_one_vocabulary, is_marian, write_hf
from aiayn.export.modelcard import CARD_FILE, model_card
from aiayn.options import EXPORT_TARGETS, QUANTIZATIONS
from aiayn.runs.checkpoint import check_unchanged, weights_fingerprint
from aiayn.runs.directory import EXPORT_INFO, load_run, resolve_weights
from aiayn.util.extras import require
from aiayn.util.io import atomic_directory, atomic_write_text, check_room, check_writable_dir
from aiayn.util.progress import log


def export_run(run_dir: str | Path, to: str, out_dir: str | Path, weights: str | Path = "best",
               quantization: str | None = None) -> Path:
    """Write the run's model for ``to`` ("hf" or "ctranslate2") into a new ``out_dir``.

    Refused, with nothing written: an unknown target or quantization, an ``out_dir`` that
    exists and is not empty, a missing library, a run without weights, a model the target
    cannot express. The directory appears whole or not at all (written beside it, then
    renamed).
    """
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if to not in EXPORT_TARGETS:
        raise AiaynError(f"--to must be one of {', '.join(EXPORT_TARGETS)}, got {to!r}")
    if quantization is not None and to != "ctranslate2":
        raise AiaynError("--quantization applies to --to ctranslate2 only")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise AiaynError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, "
                         f"got {quantization!r}")
    check_writable_dir(out_dir, "OUT_DIR")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise AiaynError(f"OUT_DIR {out_dir}: exists and is not an empty directory; export "
                         "into a new one")
    require("transformers" if to == "hf" else "ctranslate2", f"--to {to}")
    config_path = run_dir / "config.yaml"
    if config_path.is_file():  # refuse before reading any weights
        check_target_can_express(load_config(config_path).model, to, str(run_dir))
    config, model, tokenizers = load_run(run_dir, weights)
    weights_file = resolve_weights(run_dir, weights)
    fingerprint = weights_fingerprint(weights_file)  # the weights exported, for the card
    if to == "hf":
        check_one_vocabulary(tokenizers, str(run_dir))
    need = export_size(model, run_dir)
    check_room(out_dir, need, "the export")
    for left in stale_exports(out_dir):
        log(f"note: {left} is what an export to {out_dir} left when it was killed before it "
            "finished; it is not used: delete it")
    with atomic_directory(out_dir, need, "the export") as tmp:
        if to == "hf":
            write_hf(model, tokenizers, tmp, config.decode)
        else:
            write_ctranslate2(model, tokenizers, tmp, quantization)
            write_aiayn_side(config, run_dir, tmp)
        info = {"format": 1, "target": to, "run_dir": run_dir.resolve().name,
                "weights": without_local_paths(str(weights)), "quantization": quantization}
        atomic_write_text(tmp / EXPORT_INFO, json.dumps(info, indent=2) + "\n")
        card = model_card(run_dir, to, weights, quantization, marian=is_marian(model.cfg),
                          weights_sha256=fingerprint)
        atomic_write_text(tmp / CARD_FILE, card)
        check_unchanged(weights_file, fingerprint)  # else the export is of other weights
    return out_dir


def stale_exports(out_dir: Path) -> list[Path]:
    """The temporary directories beside ``out_dir`` that exports into it began and never
    renamed (``atomic_directory``'s; a kill -9 leaves one, tens of MB, where nothing else will
    clean it). Reported, not deleted: one may be another export's, still running."""
    if not out_dir.parent.is_dir():
        return []
    return sorted(path for path in out_dir.parent.glob(f".{glob_escape(out_dir.name)}.*.tmp")
                  if path.is_dir())
