"""A run's metrics log: ``RUN_DIR/metrics.jsonl`` (one JSON object a line, see
docs/interfaces.md) and its TensorBoard scalars, written by training (``MetricsLog``) and
read by `aiayn info`, `aiayn plot`, `aiayn doctor`, serve's /info and a resume
(``read_metrics``).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from aiayn.errors import AiaynError
from aiayn.util.io import atomic_write_text, disk_errors

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """metrics.jsonl (one JSON object per line) and TensorBoard scalars; rank 0 only.

    On resume, lines logged after the checkpoint's step are dropped: the resumed run
    writes them again.
    """

    def __init__(self, run_dir: Path, enabled: bool, resume_step: int | None = None):
        self.enabled = enabled
        self.path = run_dir / METRICS_FILE
        self.writer = None
        if not enabled:
            return
        if resume_step is not None and self.path.exists():
            # A line cut by the crash being resumed from is dropped with the later ones.
            keep = [r for r in read_metrics(run_dir, missing_ok=True) if r["step"] <= resume_step]
            atomic_write_text(self.path, "".join(map(_metrics_line, keep)))
        from torch.utils.tensorboard import SummaryWriter

        purge = resume_step + 1 if resume_step is not None else None
        self.writer = SummaryWriter(str(run_dir / "tb"), purge_step=purge)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        # A line cut by a full disk is left out when read (read_metrics) and on resume.
        with disk_errors(self.path, what="the metrics log"), \
                open(self.path, "a", encoding="utf-8") as fh:
            fh.write(_metrics_line(record))
        kind, step = record["kind"], record["step"]
        for key, value in record.items():
            if key not in ("kind", "step") and isinstance(value, (int, float)):
                self.writer.add_scalar(f"{kind}/{key}", value, step)
        for j, sample in enumerate(record.get("samples", [])):
            text = f"src: {sample['src']}  \nref: {sample['ref']}  \nhyp: {sample['hyp']}"
            self.writer.add_text(f"samples/{j}", text, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _metrics_line(record: dict[str, Any]) -> str:
    return json.dumps(record, ensure_ascii=False) + "\n"


# The numbers of metrics.jsonl records that readers compute with, by record kind.
METRIC_NUMBERS = {"train": ("loss", "lr"), "dev": ("dev_loss", "bleu", "chrf")}


def read_metrics(run_dir: str | Path, missing_ok: bool = False) -> list[dict[str, Any]]:
    """The records of ``RUN_DIR/metrics.jsonl`` (see docs/interfaces.md), in file order; the
    one reader of `aiayn plot`, `aiayn info`, `aiayn serve`'s /info and a resume.

    Each line is a JSON object with a ``kind`` and a numeric ``step``, and the numbers of
    ``METRIC_NUMBERS`` are numbers. The writer appends whole lines, so a last line without
    its newline that is not such a record was cut short (a run writing it right now, or one
    stopped mid-line by a crash or a full disk): it is left out, with a warning that says so.
    Any other bad line is damage, an error naming the file and line. A missing file is an
    error too, unless ``missing_ok`` (a run that has logged nothing yet has no records)."""
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    if not path.is_file():
        if missing_ok:
            return []
        if not run_dir.is_dir():
            raise AiaynError(f"{run_dir}: not a directory (expected a run directory from "
                             "`aiayn train`)")
        raise AiaynError(f"{path}: not found; is {run_dir} a run directory from `aiayn train`?")
    with open(path, encoding="utf-8", errors="replace") as fh:
        lines = fh.read().split("\n")  # the last item: what follows the last newline
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(_metrics_record(line))
        except ValueError as exc:
            if number < len(lines):
                raise AiaynError(f"{path}, line {number}: {exc}") from None
            warnings.warn(f"{path}, line {number}: left out, cut short: {exc} (the run is "
                          "writing it, or stopped while it did)", stacklevel=2)
    return records


def _metrics_record(line: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    for key in ("step", "kind"):
        if key not in record:
            raise ValueError(f'the record has no "{key}"')
    for key in ("step", *METRIC_NUMBERS.get(record["kind"], ())):
        value = record.get(key)
        if key in record and not (isinstance(value, (int, float)) and not isinstance(value, bool)):
            raise ValueError(f'"{key}" is not a number ({value!r})')
    return record
