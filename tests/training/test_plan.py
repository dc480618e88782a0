"""The budget a run states at its start: steps, minutes and the passes over the data they
make, and the warning when an unregularised recipe would make far more passes than it is
meant for."""

from __future__ import annotations

import re

import pytest
from helpers import TINY, error_line, run_cli

from aiayn.config import load_config
from aiayn.training.plan import MEASURE_S, OVERFIT_PASSES, BudgetPlan


def plan(preset: str, max_minutes: float, max_steps: int, steps_per_pass: float = 100.0):
    config = load_config(preset, [f"train.max_minutes={max_minutes}",
                                  f"train.max_steps={max_steps}"])
    lines, warnings = [], []
    return BudgetPlan(config, steps_per_pass, 0, 0.0, lines.append, warnings.append), lines, \
        warnings


def test_a_step_limit_alone_states_its_passes_and_warns_the_unregularised_demo():
    budget, lines, warnings = plan("demo", 0, 100_000)
    budget.start_lines()
    assert lines == ["budget: to step 100,000 (no time limit: train.max_minutes 0); a pass over "
                     "the training data is 100 steps of <= 1,024 tokens, so 1,000.0 passes"]
    assert len(warnings) == 1 and "configs/bible-60.yaml" in warnings[0]
    assert "~1000.0 passes" in warnings[0] and "over-fits past ~4" in warnings[0]
    # A recipe with dropout and label smoothing is not warned; nor a budget within ~4 passes.
    for preset, steps in (("bible-60", 100_000), ("demo", int(OVERFIT_PASSES * 100))):
        budget, _, warnings = plan(preset, 0, steps)
        budget.start_lines()
        assert warnings == []


def test_a_time_budget_states_its_passes_once_the_speed_is_measured():
    budget, lines, warnings = plan("demo", 12, 100_000)
    budget.start_lines()
    assert lines == ["budget: 12 min of training or step 100,000, whichever comes first; a pass "
                     "over the training data is 100 steps of <= 1,024 tokens (step 100,000 "
                     "would be 1,000.0 passes); the passes 12 min make are said once the "
                     "speed is measured"]
    # 2 steps a second: 12 minutes reach step 1,440, 14.4 passes (the warm-up steps aside).
    for step in range(1, 200):
        budget.observe(step, (step - 1) / 2)
    assert lines[1:] == ["budget: at 2.00 steps/s, 12 min of training reach step ~1,441: "
                         "~14.4 passes over the training data"]
    assert len(warnings) == 1 and "(12 min) makes ~14.4 passes" in warnings[0]
    budget.observe(400, 300.0)
    assert len(lines) == 2  # said once
    assert MEASURE_S < 200 / 2


@pytest.mark.slow
def test_the_start_of_train_states_the_budget(tmp_path, capsys):
    """`aiayn train` prints its budget line before the first step."""
    from helpers import write_prepared

    data = write_prepared(tmp_path / "data")
    code, out, err = run_cli(["train", "--config", TINY, "--data", str(data), "--out",
                              str(tmp_path / "run"), "--set", "train.max_steps=16",
                              "--set", "train.eval_every=100", "--set", "train.max_minutes=0"],
                             capsys)
    assert code == 0, err
    budget = [line for line in out.splitlines() if line.startswith("budget:")]
    assert len(budget) == 1 and re.fullmatch(
        r"budget: to step 16 \(no time limit: train.max_minutes 0\); a pass over the training "
        r"data is (\d+) steps of <= 256 tokens, so ([\d.]+) passes", budget[0]), budget
    steps, passes = re.findall(r"is (\d+) steps.*so ([\d.]+) passes", budget[0])[0]
    assert float(passes) == pytest.approx(16 / int(steps), abs=0.05)
    assert out.index("budget:") < out.index("step 16:")
    assert "aiayn: warning" not in err  # tiny has dropout


def test_max_minutes_0_is_refused_with_how_to_ask_for_no_limit(tmp_path, capsys):
    code, _, err = run_cli(["train", "--config", TINY, "--data", str(tmp_path), "--out",
                            str(tmp_path / "run"), "--max-minutes", "0"], capsys)
    assert code == 2 and "--set train.max_minutes=0" in error_line(err)
