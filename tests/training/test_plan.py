"""The budget a run states at its start: steps, minutes and the passes over the data they
make, the warning when an unregularised recipe would make far more passes than it is meant
for, and the dropout and label smoothing that "auto" chooses by those passes."""

from __future__ import annotations

import re

import pytest
from helpers import TINY, error_line, run_cli

from aiayn.config import AUTO, load_config
from aiayn.errors import AiaynError
from aiayn.training import plan as plan_module
from aiayn.training.plan import (
    HALF_REGULARISED,
    MEASURE_S,
    OVERFIT_PASSES,
    REGULARISED,
    REPROJECT_AT,
    BudgetPlan,
    choose_regularisation,
    clearly_across,
    step_limit_passes,
)

# The demo's recipe as it was before "auto": no dropout, no label smoothing, whatever the budget.
UNREGULARISED = ["model.dropout=0", "train.label_smoothing=0"]


def plan(preset: str, max_minutes: float, max_steps: int, steps_per_pass: float = 100.0,
         sets: list[str] = UNREGULARISED):
    config = load_config(preset, [f"train.max_minutes={max_minutes}",
                                  f"train.max_steps={max_steps}", *sets])
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
    # A recipe with dropout and label smoothing is not warned, nor one that chooses them by
    # the passes ("auto", the demo's), nor a budget within ~4 passes.
    for preset, steps, sets in (("bible-60", 100_000, []), ("demo", 100_000, []),
                                ("demo", int(OVERFIT_PASSES * 100), UNREGULARISED)):
        budget, _, warnings = plan(preset, 0, steps, sets=sets)
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
    for step in range(1, 2 * int(MEASURE_S) + 20):
        budget.observe(step, (step - 1) / 2)
    assert lines[1:] == ["budget: at 2.00 steps/s, 12 min of training reach step ~1,441: "
                         "~14.4 passes over the training data"]
    assert len(warnings) == 1 and "(12 min) makes ~14.4 passes" in warnings[0]
    assert MEASURE_S < REPROJECT_AT[0] * 12 * 60


def test_the_passes_are_projected_again_from_the_speed_since():
    """A first half-minute at a quarter of the later speed: the first projection says too few
    passes, the next ones (REPROJECT_AT of the budget) the speed since; none after the last."""
    budget, lines, warnings = plan("demo", 12, 100_000, sets=[])
    projected, elapsed, step = {}, 0.0, 0
    while elapsed < 12 * 60:
        step += 1
        elapsed += 1.0 if elapsed < 60 else 0.25  # 1 step/s, then 4
        passes = budget.observe(step, elapsed)
        if passes is not None:
            projected[round(elapsed)] = passes
    # Timing starts after SKIP_STEPS steps (at 5 s here).
    assert list(projected) == [5 + MEASURE_S] + [at * 720 for at in REPROJECT_AT]
    first, between, *later = projected.values()
    assert first == pytest.approx(7.2, abs=0.05)  # 1 step/s to the end: step 720
    assert 7.2 < between < 27.0  # from 35 s to 90 s: 1 step/s, then 4
    assert later == pytest.approx([27.0, 27.0], abs=0.05)  # 4 steps/s to the end: step 2,700
    assert "at 2.64 steps/s over the last 55 s" in lines[1]
    assert "at 4.00 steps/s over the last 180 s" in lines[-1]
    assert warnings == []  # "auto" regularises: no warning


def test_a_step_limit_is_never_projected():
    budget, lines, _ = plan("demo", 0, 1000)
    assert all(budget.observe(step, step * 1.0) is None for step in range(1, 2000))
    assert lines == []


def test_auto_regularises_by_the_passes_and_keeps_numbers_given():
    config = load_config("demo", ["train.max_minutes=0", "train.max_steps=1000"])
    assert (config.model.dropout, config.train.label_smoothing) == (AUTO, AUTO)
    assert step_limit_passes(config, 100.0) == 10.0
    assert step_limit_passes(load_config("demo"), 100.0) is None  # a time budget: not yet
    few, line = choose_regularisation(config, OVERFIT_PASSES)
    assert (few.model.dropout, few.train.label_smoothing) == (0.0, 0.0)
    assert line.startswith("regularisation: dropout 0, label smoothing 0 (auto: ~4.0 passes")
    half, line = choose_regularisation(config, 4.7)
    assert (half.model.dropout, half.train.label_smoothing) == (HALF_REGULARISED, HALF_REGULARISED)
    assert "(auto: ~4.7 passes over the training data, more than 4, at most 5.5;" in line
    many, line = choose_regularisation(config, 6.5)
    assert (many.model.dropout, many.train.label_smoothing) == (REGULARISED, REGULARISED)
    assert "dropout 0.1, label smoothing 0.1 (auto: ~6.5 passes" in line
    unknown, line = choose_regularisation(config, None)
    assert (unknown.model.dropout, unknown.train.label_smoothing) == (0.0, 0.0)
    assert "until the speed is measured" in line
    # A number given stays that number, whatever the passes; only "auto" is chosen.
    given = load_config("demo", ["model.dropout=0.0"])
    chosen, line = choose_regularisation(given, 20.0)
    assert (chosen.model.dropout, chosen.train.label_smoothing) == (0.0, REGULARISED)
    assert config.model.dropout == AUTO  # choosing returns a new config


def test_passes_measured_with_dropout_count_at_the_speed_without_it():
    """The lines are drawn in passes at the speed without dropout: a projection from steps
    that ran with it (slower by DROPOUT_PRICE) is scaled up before it meets them, so that
    choosing dropout does not by itself undo the choice at the next projection."""
    config = load_config("demo", ["train.max_minutes=0", "train.max_steps=1000"])
    plain, _ = choose_regularisation(config, 5.2)
    assert plain.model.dropout == HALF_REGULARISED
    slowed, line = choose_regularisation(config, 5.2, ran_with=REGULARISED)
    assert (slowed.model.dropout, slowed.train.label_smoothing) == (REGULARISED, REGULARISED)
    assert "(auto: ~5.2 passes over the training data, ~5.72 at the speed without dropout, " \
        "more than 5.5;" in line
    assert clearly_across(4.9) and not clearly_across(4.9, ran_with=REGULARISED)  # 5.39
    assert clearly_across(4.5, ran_with=REGULARISED)  # 4.95: clearly between the lines
    assert not clearly_across(3.9) and not clearly_across(4.1)  # near the first line


@pytest.mark.parametrize("setting", ["model.d_ff=auto", "train.clip_norm=auto",
                                     "model.dropout=sometimes"])
def test_auto_is_refused_where_nothing_chooses(setting):
    with pytest.raises(AiaynError, match=setting.partition("=")[0]):
        load_config("demo", [setting])


def dropout_seen(monkeypatch) -> list[float]:
    """The dropout probability of every residual sublayer call from now on, in order."""
    from aiayn.model import SublayerConnection

    seen, original = [], SublayerConnection.forward

    def forward(self, x, sublayer):
        seen.append(self.dropout.p)
        return original(self, x, sublayer)

    monkeypatch.setattr(SublayerConnection, "forward", forward)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("budget", ["steps", "minutes"])
def test_train_chooses_auto_regularisation_and_writes_it_into_config_yaml(
        tmp_path, capsys, monkeypatch, budget):
    """`aiayn train` with "auto": the line that says what it chose, the dropout in force in
    the model, config.yaml holding the choice (a resume keeps it)."""
    from helpers import write_prepared

    data = write_prepared(tmp_path / "data")
    # The time budget alone: tiny.yaml's 40 steps end before a fast CPU has timed MEASURE_S.
    limit = (["--set", "train.max_steps=60", "--set", "train.max_minutes=0"]
             if budget == "steps" else ["--set", "train.max_minutes=0.05",
                                        "--set", "train.max_steps=100000"])
    monkeypatch.setattr(plan_module, "MEASURE_S", 0.3)  # a short run projects early
    seen = dropout_seen(monkeypatch)
    code, out, err = run_cli(["train", "--config", TINY, "--data", str(data), "--out",
                              str(tmp_path / "run"), "--set", "model.dropout=auto", "--set",
                              "train.label_smoothing=auto", "--set", "train.eval_every=100000",
                              "--set", "train.max_epochs=1000", *limit], capsys)
    assert code == 0, err
    chosen = [line for line in out.splitlines() if line.startswith("regularisation:")]
    saved = load_config(tmp_path / "run" / "config.yaml")
    if budget == "steps":  # 60 steps: over 4 passes of the tiny data, known at the start
        assert len(chosen) == 1 and "dropout 0.1, label smoothing 0.1 (auto:" in chosen[0]
        assert set(seen) == {REGULARISED}
    else:  # 0 until the speed is measured, then the passes 3 seconds make over tiny data
        assert len(chosen) == 2 and "0 until the speed is measured" in chosen[0]
        assert "dropout 0.1, label smoothing 0.1" in chosen[1]
        assert seen[0] == 0.0 and seen[-1] == REGULARISED
    assert (saved.model.dropout, saved.train.label_smoothing) == (REGULARISED, REGULARISED)


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


@pytest.mark.slow
def test_a_later_projection_changes_the_choice_and_the_best_loss_starts_over(
        tmp_path, capsys, monkeypatch):
    """The first projection's choice holds until the next one, which chooses freely; after
    that a choice changes only for passes clearly across the line. config.yaml holds the last
    choice, and the best by dev loss (which counts the smoothing) starts over at each change."""
    from helpers import write_prepared

    data = write_prepared(tmp_path / "data")
    # What the time budget's speed would project: 5.0 first (a fast first half-minute: half
    # the regularisation), then 2.0 (chosen: the first projection's choice is not held), 4.1
    # (more than 4 but too near the line to change a choice made since: plan.CHANGE_MARGIN),
    # then clearly more than 5.5, then 5.1 from steps with dropout (5.6 at the speed without
    # it: too near the line to change back to half).
    passes_at = {6: 5.0, 10: 2.0, 14: 4.1, 18: 8.0, 22: 5.1}
    monkeypatch.setattr(BudgetPlan, "observe", lambda self, step, elapsed_s: passes_at.get(step))
    seen = dropout_seen(monkeypatch)
    run = tmp_path / "run"
    code, out, err = run_cli(["train", "--config", TINY, "--data", str(data), "--out", str(run),
                              "--set", "model.dropout=auto", "--set", "train.label_smoothing=auto",
                              "--set", "train.max_minutes=60", "--set", "train.max_steps=24",
                              "--set", "train.eval_every=4", "--set", "train.eval_max_sentences=8",
                              "--set", "train.best_metric=loss"], capsys)
    assert code == 0, err
    chosen = [line for line in out.splitlines() if line.startswith("regularisation:")]
    assert [re.search(r"~([\d.]+) passes", line)[1] for line in chosen[1:]] == \
        ["5.0", "2.0", "8.0"], chosen  # 4.1 and 5.1 changed nothing
    assert "0 until the speed is measured" in chosen[0]
    assert [line for line in out.splitlines() if line.startswith("best:")] == [
        f"best: the dev loss now counts label smoothing {value}; the best weights are chosen "
        "afresh from the next validation" for value in ("0.05", "0", "0.1")]  # after step 4
    assert seen[0] == 0.0 and seen[-1] == REGULARISED and 0.0 in seen[len(seen) // 2:]
    saved = load_config(run / "config.yaml")
    assert (saved.model.dropout, saved.train.label_smoothing) == (REGULARISED, REGULARISED)
    import json

    dev = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    after = [r for r in dev if r["kind"] == "dev" and r["step"] > 18]
    assert [r["step"] for r in after] == [20, 24]
    assert after[0]["best_step"] == 20  # the first validation after the change is the best
    assert after[-1]["best_value"] == min(r["dev_loss"] for r in after)
