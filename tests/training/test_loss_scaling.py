"""train.precision fp16: float16 autocast with a gradient scaler (aiayn.training.loop's
``train_step`` and ``new_scaler``). A GPU without bf16 trains so; its logic runs on the CPU
(float16 autocast works there, slowly), so it is tested here: an overflow skips the update
and halves the scale, the run counts and logs the skips, and a resume keeps the scaler."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import TINY, assert_equal_weights, records, run_train, sets, weights, write_prepared

from aiayn.config import load_config
from aiayn.data.batching import Example, collate
from aiayn.runs.checkpoint import load_train_state
from aiayn.training import loop as train
from aiayn.training.distributed import Dist
from aiayn.training.optim import build_optimizer
from aiayn.training.stream import build_model


def tiny_step_parts(precision: str):
    config = load_config(TINY, ["model.dropout=0.0", f"train.precision={precision}"])
    torch.manual_seed(0)
    model = build_model(config, torch.device("cpu"))
    optimizer = build_optimizer(model, config)
    batch = collate([Example([5, 6, 7, 3], [2, 8, 9, 3], i) for i in range(4)],
                    config.model.pad_id, 1)
    return config, model, optimizer, batch


def test_an_overflowing_gradient_skips_the_update_and_halves_the_scale():
    config, model, optimizer, batch = tiny_step_parts("fp16")
    scaler = train.new_scaler(torch.device("cpu"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first = next(model.parameters())
    hook = first.register_hook(lambda grad: torch.full_like(grad, math.inf))
    result = train.train_step(model, None, optimizer, [batch], 1, config, Dist(), scaler=scaler)
    hook.remove()
    assert result.skipped and math.isfinite(result.loss) and not math.isfinite(result.grad_norm)
    assert result.scale == scaler.get_scale() == 2.0**15  # 2^16 halved
    assert_equal_weights(model.state_dict(), before, "a skipped step")
    assert not optimizer.state  # Adam took no step: its moments were never made
    # The next step's gradients are finite: it updates, and the scale stays.
    result = train.train_step(model, None, optimizer, [batch], 1, config, Dist(), scaler=scaler)
    assert not result.skipped and math.isfinite(result.grad_norm)
    assert result.scale == 2.0**15
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_the_scaler_unscales_what_it_scaled():
    """fp16's update is the update of the unscaled gradients: the norm the step reports is
    that of the loss without the scale (close to fp32's, float16's rounding apart)."""
    norms = {}
    for precision in ("fp32", "fp16"):
        config, model, optimizer, batch = tiny_step_parts(precision)
        scaler = train.new_scaler(torch.device("cpu")) if precision == "fp16" else None
        norms[precision] = train.train_step(model, None, optimizer, [batch], 1, config, Dist(),
                                            scaler=scaler).grad_norm
    assert norms["fp16"] == pytest.approx(norms["fp32"], rel=2e-2)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return write_prepared(tmp_path_factory.mktemp("prepared"))


@pytest.mark.slow
def test_fp16_runs_log_their_skips_and_resume_exactly(data_dir, tmp_path, monkeypatch):
    """A scale that starts far too high (2^40) overflows the first steps: each is skipped
    without counting as a step (the schedule stays), metrics.jsonl logs the scale and the
    skips, and a run interrupted after a save ends on the uninterrupted run's weights, scale
    and skip count, bit for bit."""
    monkeypatch.setattr(train, "new_scaler", lambda device: torch.amp.GradScaler(
        device.type, init_scale=2.0**40, growth_interval=3))
    n = 6
    common = ["--config", TINY, "--data", str(data_dir), "--set", "train.precision=fp16",
              *sets(eval_every=100, save_every=n, log_every=1, warmup_steps=4)]
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_train(*common, "--out", str(straight), *sets(max_steps=2 * n))
    logged = records(straight, "train")
    assert [r["step"] for r in logged] == list(range(1, 2 * n + 1))  # skips are not steps
    assert logged[0]["skipped_steps"] >= 1 and logged[0]["loss_scale"] < 2.0**40
    assert logged[-1]["skipped_steps"] >= logged[0]["skipped_steps"]
    assert all(math.isfinite(r["loss"]) for r in logged)
    run_train(*common, "--out", str(split), *sets(max_steps=n))
    run_train("--resume", str(split), *sets(max_steps=2 * n))
    assert_equal_weights(weights(split), weights(straight))
    a, b = (load_train_state(r / "train_state.pt") for r in (straight, split))
    assert a["scaler"] == b["scaler"] and a["skipped"] == b["skipped"] >= 1
    assert a["choices"]["precision"] == "fp16"
    resumed = records(split, "train")
    assert [r["loss_scale"] for r in resumed] == [r["loss_scale"] for r in logged]
