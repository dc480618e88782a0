"""What a run will train, said at its start: the budget it runs to (steps, minutes) and the
passes over the training data that makes, with a warning when that is far more passes than
an unregularised recipe (the demo's) is meant for; and, for a config whose model.dropout or
train.label_smoothing is "auto", the regularisation those passes call for
(``choose_regularisation``).

A pass is the batches of one epoch (the sampler's count on this rank, already built: no
extra pass over the data) divided by train.grad_accum. Under a step limit alone the passes
are known at the start; under a time budget they depend on the speed, so they are said
once the first ``MEASURE_S`` seconds of steps have been timed (``BudgetPlan.observe``),
and said again at the fractions of the budget in ``REPROJECT_AT``, from the speed since.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from aiayn.config import AUTO, Config

# Without dropout and label smoothing the demo's model learns fastest over 2-3.5 passes and
# over-fits from about 4 (docs/findings.md#regularisation-by-the-budget): past this, "auto"
# regularises, and a recipe set to none of either gets the warning.
OVERFIT_PASSES = 4.0
# What "auto" takes beyond OVERFIT_PASSES: half the paper's dropout and label smoothing up to
# FULL_PASSES (at 4.7 passes, at equal compute, it led the paper's 0.1 by 0.04-0.08 nats of
# dev loss in two seeds, and where none's dev loss turned up before a busy Zen 5's 12 minutes
# ended, it fell to the end), the paper's (5.4) beyond, as configs/bible-60.yaml keeps them
# (docs/findings.md#regularisation-by-the-budget).
HALF_REGULARISED, FULL_PASSES, REGULARISED = 0.05, 5.5, 0.1
# Dropout's price a step, by which a run with it makes fewer passes in the same minutes: 1.09
# in fp32 on an AVX2 CPU, 1.12-1.14 in bf16 on a Zen 5 at 0.05-0.1 (benchmarks/step_cost.py
# --variant do1=model.dropout=0.1). The passes of a run with dropout are scaled by it before
# they meet the lines, so choosing dropout does not by itself undo the choice at the next
# projection.
DROPOUT_PRICE = 1.1
# The regularised preset for longer budgets, named by the warning.
LONGER_PRESET = "configs/bible-60.yaml"
# Training seconds timed (after the session's first steps, which include warm-up work)
# before the passes a time budget makes are projected.
MEASURE_S = 30.0
SKIP_STEPS = 5
# The fractions of a time budget at which its passes are projected again, from the speed of
# the steps since the last projection, and "auto" chooses again: a first half-minute can run
# at half the later speed or above it (thread trials, another program starting or stopping),
# and a choice made on it alone missed the passes by up to 2x (docs/training.md#regularisation-by-the-budget).
REPROJECT_AT = (0.125, 0.25, 0.5)
# A projection made again changes the choice only when its passes are this far (a fraction
# of the line) across a line: a budget near a line projects to either side from one
# measurement to the next, near a line the choices on either side score alike (above), and
# each change of the label smoothing starts the best by dev loss over.
CHANGE_MARGIN = 0.05


def passes_of(steps: float, steps_per_pass: float, config: Config) -> float:
    """Passes over the training data that ``steps`` optimizer steps make (within
    train.max_epochs, where the run stops in any case)."""
    return min(steps / max(steps_per_pass, 1e-9), config.train.max_epochs)


def step_limit_passes(config: Config, steps_per_pass: float) -> float | None:
    """The passes a step limit alone makes (train.max_minutes 0); None under a time budget,
    whose passes ``BudgetPlan.observe`` projects once the speed is measured."""
    if config.train.max_minutes > 0:
        return None
    return passes_of(config.train.max_steps, steps_per_pass, config)


def has_auto_regularisation(config: Config) -> bool:
    return AUTO in (config.model.dropout, config.train.label_smoothing)


def line_passes(passes: float, dropout: float) -> float:
    """The passes the steps that projected ``passes`` would make at the speed without dropout,
    as the lines OVERFIT_PASSES and FULL_PASSES count them: ``dropout`` is what those steps
    ran with."""
    return passes * DROPOUT_PRICE if dropout > 0 else passes


def choose_regularisation(config: Config, passes: float | None,
                          ran_with: float = 0.0) -> tuple[Config, str]:
    """``config`` with its "auto" dropout and label smoothing set for a budget of ``passes``
    over the training data, projected from steps that ran with dropout ``ran_with``, at the
    speed without dropout: none up to OVERFIT_PASSES (a few passes learn fastest without
    either), HALF_REGULARISED up to FULL_PASSES, REGULARISED beyond (without them the dev
    loss turns up); and the line that says what was chosen and why. ``passes`` None: not
    known yet (a time budget before its speed is measured): 0 for now. A setting given as a
    number stays as it is."""
    m, t = config.model, config.train
    if passes is None:
        value, why = 0.0, "0 until the speed is measured"
    else:
        counted = line_passes(passes, ran_with)
        # Two decimals: near a line one would say "~5.5 ..., more than 5.5".
        said = f"~{passes:.1f} passes over the training data" + (
            f", ~{counted:.2f} at the speed without dropout" if counted != passes else "")
        if counted > FULL_PASSES:
            value, why = REGULARISED, f"{said}, more than {FULL_PASSES:g}"
        elif counted > OVERFIT_PASSES:
            value, why = HALF_REGULARISED, f"{said}, more than {OVERFIT_PASSES:g}, at most " \
                f"{FULL_PASSES:g}"
        else:
            value, why = 0.0, f"{said}, at most {OVERFIT_PASSES:g}"
    dropout = value if m.dropout == AUTO else m.dropout
    smoothing = value if t.label_smoothing == AUTO else t.label_smoothing
    chosen = replace(config, model=replace(m, dropout=dropout),
                     train=replace(t, label_smoothing=smoothing))
    return chosen, (f"regularisation: dropout {dropout:g}, label smoothing {smoothing:g} "
                    f"(auto: {why}; docs/training.md#regularisation-by-the-budget)")


def clearly_across(passes: float, ran_with: float = 0.0) -> bool:
    """Are ``passes``, projected from steps that ran with dropout ``ran_with``, far enough
    from both lines (OVERFIT_PASSES, FULL_PASSES) for a projection made again to change the
    choice (``CHANGE_MARGIN``)?"""
    counted = line_passes(passes, ran_with)
    return all(abs(counted - line) > CHANGE_MARGIN * line
               for line in (OVERFIT_PASSES, FULL_PASSES))


class BudgetPlan:
    """The budget line at the start (``start_lines``) and, under a time budget, the
    projections once the speed is known (``observe``, called after every step)."""

    def __init__(self, config: Config, steps_per_pass: float, step: int, elapsed_s: float,
                 log: Callable[[str], None], warn: Callable[[str], None]):
        self.config, self.steps_per_pass = config, max(steps_per_pass, 1e-9)
        self.log, self.warn = log, warn
        self.first_step, self.mark = step, None  # mark: (step, elapsed_s) timing starts at
        self.projected, self.next_s = 0, math.inf  # projections made; when the next is due
        self.done = config.train.max_minutes <= 0  # nothing to project under steps alone

    def passes(self, steps: float) -> float:
        """Passes over the training data that ``steps`` optimizer steps make."""
        return passes_of(steps, self.steps_per_pass, self.config)

    def start_lines(self) -> None:
        """Log the budget; warn now when the step limit alone already over-trains."""
        t = self.config.train
        per_pass = (f"a pass over the training data is {self.steps_per_pass:,.0f} steps of "
                    f"<= {t.max_tokens * t.grad_accum:,} tokens")
        by_steps = self.passes(t.max_steps)
        if t.max_minutes <= 0:
            self.log(f"budget: to step {t.max_steps:,} (no time limit: train.max_minutes 0); "
                     f"{per_pass}, so {by_steps:,.1f} passes")
            self.check(by_steps, f"to step {t.max_steps:,}")
        else:
            self.log(f"budget: {t.max_minutes:g} min of training or step {t.max_steps:,}, "
                     f"whichever comes first; {per_pass} (step {t.max_steps:,} would be "
                     f"{by_steps:,.1f} passes); the passes {t.max_minutes:g} min make are said "
                     "once the speed is measured")

    def observe(self, step: int, elapsed_s: float) -> float | None:
        """After each step: once ``MEASURE_S`` seconds of steps are timed, and again at each
        fraction ``REPROJECT_AT`` of the budget, log the step rate since the last projection
        and the passes the time budget reaches at it (the first time, warn when too many);
        return those passes then, None at every other step."""
        if self.done or step < self.first_step + SKIP_STEPS:
            return None
        if self.mark is None:
            self.mark = (step, elapsed_s)
            return None
        t = self.config.train
        budget_s = t.max_minutes * 60
        timed = elapsed_s - self.mark[1]
        wait_s = MEASURE_S - timed if self.projected == 0 else self.next_s - elapsed_s
        if wait_s > 0:
            return None
        rate = (step - self.mark[0]) / timed
        since = "" if self.projected == 0 else f" over the last {timed:.0f} s"
        self.mark, self.projected = (step, elapsed_s), self.projected + 1
        later = [at * budget_s for at in REPROJECT_AT if at * budget_s > elapsed_s]
        self.next_s, self.done = (later[0], False) if later else (math.inf, True)
        final = min(t.max_steps, step + rate * max(budget_s - elapsed_s, 0.0))
        passes = self.passes(final)
        self.log(f"budget: at {rate:.2f} steps/s{since}, {t.max_minutes:g} min of training "
                 f"reach step ~{final:,.0f}: ~{passes:.1f} passes over the training data")
        if self.projected == 1:
            self.check(passes, f"{t.max_minutes:g} min")
        return passes

    def check(self, passes: float, budget: str) -> None:
        """Warn when an unregularised recipe would make far more passes than it is meant for
        (not where "auto" regularises by them)."""
        m, t = self.config.model, self.config.train
        if passes > OVERFIT_PASSES and m.dropout == 0 and t.label_smoothing == 0 \
                and math.isfinite(passes):
            self.warn(f"the budget ({budget}) makes ~{passes:.1f} passes over the training "
                      f"data, and this "
                      f"recipe (no dropout, no label smoothing) over-fits past ~"
                      f"{OVERFIT_PASSES:g}: for this budget take {LONGER_PRESET}, which keeps "
                      "dropout and label smoothing, or a shorter budget "
                      "(docs/quickstart.md#choosing-a-preset)")
