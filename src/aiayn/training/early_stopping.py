"""Which weights are the best, and when to stop: ``train.best_metric`` and ``train.patience``.

The rule, in one place:

- After every validation the chosen metric is read from its record: ``bleu`` (the BLEU of
  the fixed dev subset, ``select_bleu``, so every validation is compared on the same
  sentences), ``chrf`` (likewise ``select_chrf``) or ``loss`` (the label-smoothed dev loss
  over the whole dev split). Higher is better for BLEU and chrF, lower for the loss.
- A validation *improves* when its value is strictly better than the best so far; then
  ``best.safetensors`` is written with those weights, and the validation count without
  improvement goes back to 0. Otherwise the count goes up by one.
- With ``train.patience`` P > 0, training stops after P validations in a row without
  improvement (the reason is printed and returned); P = 0 never stops early.

::

    tracker = BestTracker("loss", patience=3)
    tracker.update(step=400, record)    # True: these weights are the best so far
    tracker.should_stop                 # True after 3 validations without improvement
    tracker.describe()                  # "dev loss 3.215 at step 400"
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from aiayn.config import BEST_METRICS

# The key of a validation record (aiayn.evaluation.evaluate.validate) each metric is read from.
RECORD_KEYS = {"bleu": "select_bleu", "chrf": "select_chrf", "loss": "dev_loss"}
LABELS = {"bleu": "dev BLEU", "chrf": "dev chrF", "loss": "dev loss"}


@dataclass
class BestTracker:
    """The best value of one metric so far, its step, and the validations since then."""

    metric: str = "bleu"
    patience: int = 0  # 0: never stop early
    value: float | None = None  # None: no validation yet
    step: int = 0
    stale: int = 0  # validations in a row without improvement

    def __post_init__(self) -> None:
        if self.metric not in BEST_METRICS:
            raise ValueError(f"best metric must be one of {', '.join(BEST_METRICS)}, "
                             f"got {self.metric!r}")

    def better(self, value: float) -> bool:
        """Is ``value`` strictly better than the best so far? (NaN never is.)"""
        if not math.isfinite(value):
            return False
        if self.value is None:
            return True
        return value < self.value if self.metric == "loss" else value > self.value

    def update(self, step: int, record: dict[str, Any]) -> bool:
        """Take one validation record; True when its weights are the new best."""
        value = float(record[RECORD_KEYS[self.metric]])
        if self.better(value):
            self.value, self.step, self.stale = value, step, 0
            return True
        self.stale += 1
        return False

    def forget(self) -> None:
        """Start over, as before the first validation: what the metric measures changed
        (the label smoothing in the dev loss)."""
        self.value, self.step, self.stale = None, 0, 0

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.stale >= self.patience

    def stop_reason(self) -> str:
        return (f"patience: {self.stale} validations without a better {LABELS[self.metric]} "
                f"(train.patience={self.patience})")

    def describe(self) -> str:
        """``dev BLEU 12.34 at step 400`` (or ``none yet``)."""
        if self.value is None:
            return f"{LABELS[self.metric]}: none yet"
        digits = 3 if self.metric == "loss" else 2
        return f"{LABELS[self.metric]} {self.value:.{digits}f} at step {self.step}"

    def short(self) -> str:
        """``12.34@400`` for the progress bar (``-`` before the first validation)."""
        if self.value is None:
            return "-"
        return f"{self.value:.{3 if self.metric == 'loss' else 2}f}@{self.step}"

    def patience_note(self) -> str:
        """`` (2/5 validations without improvement)`` when early stopping is on."""
        if self.patience <= 0:
            return ""
        return f" ({self.stale}/{self.patience} validations without improvement)"

    def record_fields(self) -> dict[str, Any]:
        """What each dev line of metrics.jsonl says about the best so far."""
        return {"best_metric": self.metric, "best_value": self.value, "best_step": self.step,
                "stale_validations": self.stale}

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Restore from a train state; returns False (and starts over) when the saved best
        is of another metric, so a resume with a new train.best_metric compares like with
        like. The patience always comes from the current config."""
        if state.get("metric") != self.metric:
            return False
        self.value = None if state.get("value") is None else float(state["value"])
        self.step, self.stale = int(state.get("step", 0)), int(state.get("stale", 0))
        return True
