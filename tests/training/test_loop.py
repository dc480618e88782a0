"""Training: the schedule, the loss, exact resume, crash-safe checkpoints, the NaN stop and
a 2-process DistributedDataParallel run, all on tiny synthetic data through the real data API."""

from __future__ import annotations

import errno
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    ROOT,
    TINY,
    assert_equal_weights,
    error_line,
    records,
    run_train,
    sets,
    weights,
    write_prepared,
)

import aiayn.model
from aiayn.cli import main
from aiayn.config import load_config
from aiayn.data.batching import Example, collate
from aiayn.errors import AiaynError
from aiayn.runs.checkpoint import load_train_state
from aiayn.runs.directory import build_model
from aiayn.training import loop as train
from aiayn.training import stream
from aiayn.training.distributed import Dist
from aiayn.training.optim import build_optimizer, learning_rate
from aiayn.util import io


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return write_prepared(tmp_path_factory.mktemp("prepared"))


def batches_per_epoch(data_dir: Path, max_tokens: int = 256, world_size: int = 1) -> int:
    from aiayn.data.batching import TokenBatchSampler
    from aiayn.data.prepared import encode_split, load_prepared

    prepared = load_prepared(data_dir)
    examples, _ = encode_split(prepared.train, prepared.tokenizers, 64, "drop")
    return len(TokenBatchSampler([len(e.src) for e in examples], [len(e.tgt) for e in examples],
                                 max_tokens, shuffle=True, seed=1, world_size=world_size))


def test_training_tests_run_on_the_memory_mapped_ids_users_get(data_dir):
    """helpers.write_prepared is `aiayn prepare`'s output: training maps its ids, with no
    note about a directory prepared by an older aiayn (whose text is encoded at start)."""
    import numpy as np

    from aiayn.training.distributed import Dist

    notes: list[str] = []
    data = stream.load_data(data_dir, load_config(TINY), Dist(), log=notes.append)
    assert not [n for n in notes if "older aiayn" in n], notes
    assert isinstance(data.train.ids.src.ids, np.memmap)
    assert isinstance(data.train.ids.tgt.ids, np.memmap)


# ---------------------------------------------------------------- the run directory
def test_run_directory_layout_metrics_and_dev_scores(data_dir, tmp_path):
    run = tmp_path / "run"
    old_umask = os.umask(0o022)
    try:
        run_train("--config", TINY, "--data", str(data_dir), "--out", str(run),
                  *sets(max_steps=10, eval_every=5, save_every=5, log_every=5,
                        keep_checkpoints=1, keep_steps="[3]"))
    finally:
        os.umask(old_umask)
    # Every file has the umask's mode, the weights too: a service user other than the
    # trainer reads them (docs/serving.md).
    modes = {str(p.relative_to(run)): oct(p.stat().st_mode & 0o777)
             for p in run.rglob("*") if p.is_file()}
    assert {"best.safetensors", "last.safetensors", "checkpoints/step_0000003.safetensors",
            "checkpoints/step_0000010.safetensors", "train_state.pt"} <= modes.keys()
    assert {name: mode for name, mode in modes.items() if mode != oct(0o644)} == {}
    assert (run / "config.yaml").is_file() and (run / "tokenizer").is_dir()
    assert (run / "data_dir.txt").read_text().strip() == str(data_dir.resolve())
    for name in ("last.safetensors", "best.safetensors", "train_state.pt"):
        assert (run / name).is_file(), name
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step_0000003.safetensors", "step_0000010.safetensors"]
    assert any((run / "tb").iterdir())
    config = load_config(run / "config.yaml")
    from aiayn.data.tokenizer import Tokenizers

    tok = Tokenizers.load(run / "tokenizer")
    assert (config.model.src_vocab_size, config.model.tgt_vocab_size) == (
        tok.src_vocab_size, tok.tgt_vocab_size)  # taken from the tokenizers, not the YAML
    trains, devs = records(run, "train"), records(run, "dev")
    assert [r["step"] for r in trains] == [5, 10]
    for r in trains:
        assert {"step", "epoch", "loss", "lr", "tokens_per_s", "elapsed_s"} <= r.keys()
        assert r["lr"] == pytest.approx(learning_rate(r["step"], 32, 20, 1.0))
        assert math.isfinite(r["loss"]) and r["tokens_per_s"] > 0
    assert [r["step"] for r in devs] == [5, 10]
    for r in devs:
        assert {"step", "dev_loss", "bleu", "chrf", "bleu_signature", "elapsed_s"} <= r.keys()
        assert r["bleu_signature"].startswith("nrefs:1|") and r["n_sentences"] == 16
        assert len(r["samples"]) == 3 and {"src", "ref", "hyp"} <= r["samples"][0].keys()
    state = load_train_state(run / "train_state.pt")
    assert state["step"] == 10 and state["weights"] == "checkpoints/step_0000010.safetensors"
    assert_equal_weights(weights(run), weights(run, state["weights"]))


def test_existing_run_dir_and_tie_all_without_joint_vocab_are_clear_errors(
        data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    run_train("--config", TINY, "--data", str(data_dir), "--out", str(run), *sets(max_steps=1))
    capsys.readouterr()
    assert main(["train", "--config", TINY, "--data", str(data_dir), "--out", str(run)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    separate = write_prepared(tmp_path / "separate", joint=False)
    code = main(["train", "--config", TINY, "--data", str(separate), "--out",
                 str(tmp_path / "r2"), "--set", "model.tie_embeddings=all"])
    assert code == 2 and "needs a joint vocabulary" in error_line(capsys.readouterr().err)


@pytest.mark.parametrize(("argv", "api", "words"), [
    (["--data", "D", "--out", "O"], {"config": None, "data_dir": "D", "run_dir": "O"},
     "a new run needs --config FILE --data PREPARED_DIR --out RUN_DIR"),
    (["--config", "TINY", "--out", "O"], {"config": "TINY", "data_dir": None, "run_dir": "O"},
     "a new run needs --config FILE --data PREPARED_DIR --out RUN_DIR"),
    (["--resume", "O", "--config", "TINY"],
     {"config": "TINY", "data_dir": None, "run_dir": "O", "resume": True},
     "--resume RUN_DIR continues a run with its own config and directory"),
    (["--resume", "O", "--force"], {"config": None, "data_dir": None, "run_dir": "O",
                                     "resume": True, "force": True},
     "--resume RUN_DIR continues a run with its own config and directory"),
    (["--init-from", "R", "--out", "O"],
     {"config": None, "data_dir": None, "run_dir": "O", "init_from": "R"},
     "--init-from RUN_DIR starts a new run: give --data PREPARED_DIR"),
    (["--init-from", "R", "--resume", "O", "--data", "D"],
     {"config": None, "data_dir": "D", "run_dir": "O", "init_from": "R", "resume": True},
     "--init-from RUN_DIR starts a new run: give --data PREPARED_DIR"),
])
def test_the_three_ways_to_start_are_checked_once_with_one_message(
        argv, api, words, data_dir, tmp_path, capsys):
    """A new run, a resume, a run from another run: each wrong combination of what they
    need is one line, the same from the CLI and from aiayn.training.loop.train, before anything
    is written."""
    names = {"D": str(data_dir), "O": str(tmp_path / "out"), "R": str(tmp_path / "base"),
             "TINY": TINY}
    assert main(["train", *[names.get(a, a) for a in argv]]) == 2
    line = error_line(capsys.readouterr().err)
    assert words in line
    settings = {k: (load_config(TINY) if v == "TINY" else names.get(v, v))
                for k, v in api.items()}
    with pytest.raises(AiaynError) as err:
        train.train(**settings)
    assert line == f"aiayn: error: {err.value}"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("flags", "blamed"), [
    (["--max-minutes", "-1"], "--max-minutes -1: a time budget must be in (0, inf) minutes"),
    (["--set", "train.peak_lr=-1"], "--set train.peak_lr=-1: train.peak_lr must be in (0, inf)"),
    (["--set", "train.seed=3", "--set", "train.max_tokens=10"],
     "--set train.max_tokens=10: train.max_tokens (10) is smaller than model.max_len"),
    (["--max-minutes", "0"], "--max-minutes 0: a time budget must be in (0, inf) minutes; for "
     "no time limit give --set train.max_minutes=0"),
])
def test_a_bad_value_is_blamed_on_the_flag_or_set_that_gave_it(flags, blamed, tmp_path, capsys):
    """Not on the preset, which holds no such value; and --max-minutes 0 is no silent
    'no budget' (train.max_minutes=0 says it in full)."""
    assert main(["train", "--config", "demo", "--data", str(tmp_path / "data"),
                 "--out", str(tmp_path / "run"), *flags]) == 2
    line = error_line(capsys.readouterr().err)
    assert line.startswith(f"aiayn: error: {blamed}"), line
    assert "demo.yaml" not in line and not (tmp_path / "run").exists()


def test_the_config_help_names_every_preset():
    from aiayn.cli import build_parser
    from aiayn.config import preset_names

    train = build_parser()._subparsers._group_actions[0].choices["train"]
    text = next(a.help for a in train._actions if "--config" in a.option_strings)
    names = preset_names()
    assert {"bible-small", "demo", "bible-60", "tiny"} <= set(names)
    assert f"by name: {', '.join(names)} (" in text


def test_a_bad_value_in_the_file_is_still_blamed_on_the_file(tmp_path, capsys):
    config = tmp_path / "mine.yaml"
    config.write_text("train:\n  peak_lr: -1\n", encoding="utf-8")
    assert main(["train", "--config", str(config), "--data", str(tmp_path / "data"),
                 "--out", str(tmp_path / "run"), "--set", "train.seed=3"]) == 2
    assert error_line(capsys.readouterr().err).startswith(
        f"aiayn: error: {config}: train.peak_lr must be in (0, inf)")


# ---------------------------------------------------------------- exact resume
def test_resume_continues_exactly_like_an_uninterrupted_run(data_dir, tmp_path):
    per_epoch = batches_per_epoch(data_dir)
    n = max(2, (2 * per_epoch) // 3)  # resume mid-epoch; 2n steps cross an epoch boundary
    common = ["--config", TINY, "--data", str(data_dir),
              *sets(eval_every=3, save_every=4, log_every=1, keep_checkpoints=2)]
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_train(*common, "--out", str(straight), *sets(max_steps=2 * n))
    run_train(*common, "--out", str(split), *sets(max_steps=n))
    half = load_train_state(split / "train_state.pt")
    assert half["step"] == n and half["epoch"] == 0
    run_train("--resume", str(split), *sets(max_steps=2 * n))
    assert load_train_state(straight / "train_state.pt")["epoch"] >= 1
    assert load_config(TINY).model.dropout > 0  # dropout on: the RNG states matter
    assert_equal_weights(weights(split), weights(straight))
    a = load_train_state(split / "train_state.pt")["optimizer"]["state"]
    b = load_train_state(straight / "train_state.pt")["optimizer"]["state"]
    for key in a:
        assert torch.equal(a[key]["exp_avg_sq"], b[key]["exp_avg_sq"])
    # The log reads as one run: each step once, the same losses as the straight run.
    loss = {r["step"]: r["loss"] for r in records(straight, "train")}
    resumed = records(split, "train")
    assert [r["step"] for r in resumed] == list(range(1, 2 * n + 1))
    assert all(r["loss"] == loss[r["step"]] for r in resumed)


def test_a_muon_run_resumes_exactly_like_an_uninterrupted_one(data_dir, tmp_path):
    """train.optimizer muon: its momentum buffers and Adam's moments travel in the train
    state, so a resumed run ends with the weights and state of one never stopped."""
    n = max(2, batches_per_epoch(data_dir) // 2)
    common = ["--config", TINY, "--data", str(data_dir), *sets(optimizer="muon", log_every=1)]
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_train(*common, "--out", str(straight), *sets(max_steps=2 * n))
    run_train(*common, "--out", str(split), *sets(max_steps=n))
    run_train("--resume", str(split), *sets(max_steps=2 * n))
    assert_equal_weights(weights(split), weights(straight))
    a = load_train_state(split / "train_state.pt")["optimizer"]
    b = load_train_state(straight / "train_state.pt")["optimizer"]
    assert [g["muon"] for g in a["param_groups"]] == [False, True]
    kinds = {tuple(sorted(state)) for state in a["state"].values()}
    assert kinds == {("momentum_buffer",), ("exp_avg", "exp_avg_sq", "step")}
    for key, state in a["state"].items():
        for name, value in state.items():
            assert torch.equal(value, b["state"][key][name]), (key, name)


def test_collating_ahead_trains_and_resumes_exactly_as_without(data_dir, tmp_path, monkeypatch):
    """The loop that collates the next batch during the step (on a GPU) trains on the same
    batches, and a run saved with a batch drawn ahead resumes at that batch: weights equal to
    an uninterrupted run that never collated ahead, epochs and sampler states alike."""
    per_epoch = batches_per_epoch(data_dir)
    n = max(2, (2 * per_epoch) // 3)
    common = ["--config", TINY, "--data", str(data_dir),
              *sets(eval_every=3, save_every=4, log_every=1, keep_checkpoints=2)]
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_train(*common, "--out", str(straight), *sets(max_steps=2 * n))
    monkeypatch.setattr(train, "collates_ahead", lambda device: True)
    run_train(*common, "--out", str(split), *sets(max_steps=n))
    half = load_train_state(split / "train_state.pt")
    assert half["step"] == n and half["epoch"] == 0
    assert half["stream"][0]["sampler"]["batches_yielded"] == n  # not n + 1: one was ahead
    run_train("--resume", str(split), *sets(max_steps=2 * n))
    assert_equal_weights(weights(split), weights(straight))
    a, b = (load_train_state(run / "train_state.pt") for run in (split, straight))
    assert a["stream"] == b["stream"] and a["epoch"] == b["epoch"] >= 1
    loss = {r["step"]: r["loss"] for r in records(straight, "train")}
    assert all(r["loss"] == loss[r["step"]] for r in records(split, "train"))


def test_a_resume_keeps_the_choices_of_its_runs_probes(data_dir, tmp_path, monkeypatch):
    """precision "auto" and the output layer's kernel are chosen by timing probes, which can come
    out otherwise in another process (a busy core, two close timings). A resume on the same
    kind of machine keeps what its run chose, so it ends on the uninterrupted run's weights
    bit for bit though its own probes would choose bf16 and the other kernel."""
    import aiayn.inference.kernels
    import aiayn.util.device

    probes = {"bf16": False, "onednn": True}  # what the probes say now
    monkeypatch.setattr(aiayn.util.device, "prefer_bf16", lambda fp32, bf16: probes["bf16"])
    monkeypatch.setattr(aiayn.inference.kernels, "MIN_PROBED_WEIGHTS", 0)  # probe the tiny layer too
    monkeypatch.setattr(aiayn.inference.kernels, "probe_seconds",
                        lambda *shape: (1.0, 0.5) if probes["onednn"] else (0.5, 1.0))
    n = 4
    common = ["--config", TINY, "--data", str(data_dir), "--set", "train.bf16=auto",
              *sets(eval_every=100, save_every=n, log_every=1)]
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_train(*common, "--out", str(straight), *sets(max_steps=2 * n))
    run_train(*common, "--out", str(split), *sets(max_steps=n))
    probes.update(bf16=True, onednn=False)
    run_train("--resume", str(split), *sets(max_steps=2 * n))
    assert_equal_weights(weights(split), weights(straight))
    choices = load_train_state(split / "train_state.pt")["choices"]
    assert (choices["precision"], choices["output_kernel"]) == ("fp32", "oneDNN")
    # Another kind of machine chooses again.
    monkeypatch.setattr(train, "machine_kind", lambda device: "another machine")
    run_train("--resume", str(split), *sets(max_steps=2 * n + 1))
    choices = load_train_state(split / "train_state.pt")["choices"]
    assert (choices["precision"], choices["output_kernel"]) == ("bf16", "F.linear")


def test_output_vocab_targets_scores_the_pieces_of_the_training_targets(data_dir, tmp_path):
    """model.output_vocab=targets: the run's output layer allows exactly the pieces that the
    prepared training targets hold (and EOS), none of the source side's own words; the set
    is saved with the weights and kept by a resume."""
    import numpy as np

    from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizers
    from aiayn.runs.directory import load_run

    run = tmp_path / "run"
    every = sets(eval_every=100, save_every=3)
    run_train("--config", TINY, "--data", str(data_dir), "--out", str(run), *every,
              "--set", "model.output_vocab=targets", *sets(max_steps=3))
    targets = np.load(data_dir / "ids" / "train.tgt.ids.npy")
    expected = (set(np.unique(targets).tolist()) - {BOS_ID, PAD_ID}) | {EOS_ID}
    _, model, _ = load_run(run, "last")
    allowed = set(model.generator.output_ids.tolist())
    assert allowed == expected
    vocab = Tokenizers.load(data_dir / "tokenizer").tgt.get_vocab()
    assert vocab["▁gato"] in allowed and vocab["▁cat"] not in allowed  # a joint vocabulary
    assert len(allowed) < model.cfg.tgt_vocab_size
    run_train("--resume", str(run), *every, *sets(max_steps=6))
    _, resumed, _ = load_run(run, "last")
    assert set(resumed.generator.output_ids.tolist()) == expected


@pytest.mark.parametrize("failing_write", [0, 1, 2])
def test_a_save_interrupted_between_temp_and_rename_leaves_a_resumable_run(
        data_dir, tmp_path, monkeypatch, capsys, failing_write):
    """Writes per save: 0 the step file, 1 train_state.pt, 2 last.safetensors. Kill one of
    them at the second save: the run resumes from what is on disk and ends like a run that
    never crashed."""
    common = ["--config", TINY, "--data", str(data_dir),
              *sets(eval_every=100, save_every=3, keep_checkpoints=1)]
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    run_train(*common, "--out", str(straight), *sets(max_steps=8))
    real_replace = io.os.replace
    calls = []

    def replace(src, dst):
        calls.append(Path(dst).name)
        if Path(dst).suffix in (".safetensors", ".pt") and "best" not in Path(dst).name:
            writes = [c for c in calls if c.endswith((".safetensors", ".pt")) and "best" not in c]
            if len(writes) == 3 + failing_write + 1:  # the second save's writes are 4, 5, 6
                raise OSError(errno.EIO, "simulated kill", str(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(io.os, "replace", replace)
    assert main(["train", *common, "--out", str(crashed), *sets(max_steps=8)]) == 2
    assert "simulated kill" in error_line(capsys.readouterr().err)
    monkeypatch.undo()
    state = load_train_state(crashed / "train_state.pt")
    assert state["step"] == (6 if failing_write >= 2 else 3)
    assert (crashed / state["weights"]).is_file()
    assert not list(crashed.rglob(".*.tmp"))
    run_train("--resume", str(crashed))
    assert_equal_weights(weights(crashed), weights(straight))


# ---------------------------------------------------------------- the NaN stop
def test_non_finite_loss_stops_with_one_line_and_keeps_the_last_good_checkpoint(
        data_dir, tmp_path, monkeypatch, capsys):
    calls = {"n": 0}
    real = aiayn.loss.label_smoothed_loss  # what Transformer.forward computes the loss with

    def poisoned(logits, labels, smoothing, ignore_index):
        loss = real(logits, labels, smoothing, ignore_index)
        if torch.is_grad_enabled():  # a training step, not validation
            calls["n"] += 1
            if calls["n"] >= 7:
                return loss * float("nan")
        return loss

    monkeypatch.setattr(aiayn.model, "label_smoothed_loss", poisoned)
    run = tmp_path / "run"
    code = main(["train", "--config", TINY, "--data", str(data_dir), "--out", str(run),
                 *sets(max_steps=20, save_every=5, eval_every=100)])
    err = error_line(capsys.readouterr().err)
    assert code == 2
    assert "step 7: non-finite loss nan" in err and "checkpoint is step 5" in err
    assert f"aiayn train --resume {run} --set train.lr_scale=0.5" in err
    state = load_train_state(run / "train_state.pt")
    assert state["step"] == 5
    saved = weights(run)
    assert_equal_weights(saved, weights(run, state["weights"]))
    assert all(torch.isfinite(t).all() for t in saved.values())


def test_the_advised_resume_after_a_non_finite_stop_lowers_the_rate_and_trains_on(
        data_dir, tmp_path, monkeypatch, capsys):
    """A run that diverges from step 7 at lr_scale 1 (simulated: the step reports a NaN
    loss and does not update, as train_step does) stops; the resume its message advises,
    with half the rate, trains to the end at that rate and records the change."""
    real_step = train.train_step

    def unstable(model, ddp, optimizer, micro, step, config, world, elapsed_s=0.0,
                 prefetch=None, kernel=None, scaler=None):
        if step >= 7 and config.train.lr_scale >= 1:
            return train.StepResult(float("nan"), sum(b.n_tokens for b in micro),
                                    float("nan"), 0.0)
        return real_step(model, ddp, optimizer, micro, step, config, world, elapsed_s, prefetch,
                         kernel, scaler)

    monkeypatch.setattr(train, "train_step", unstable)
    run = tmp_path / "run"
    assert main(["train", "--config", TINY, "--data", str(data_dir), "--out", str(run),
                 *sets(max_steps=12, save_every=5, eval_every=100, log_every=1)]) == 2
    advice = error_line(capsys.readouterr().err).split("`")[1]  # the command it advises
    assert advice == f"aiayn train --resume {run} --set train.lr_scale=0.5"
    assert main(advice.split()[1:]) == 0
    assert load_train_state(run / "train_state.pt")["step"] == 12
    config = load_config(run / "config.yaml")
    assert config.train.lr_scale == 0.5
    lrs = {r["step"]: r["lr"] for r in records(run, "train")}
    assert lrs[12] == pytest.approx(learning_rate(12, config.model.d_model,
                                                  config.train.warmup_steps, 0.5))
    history = [json.loads(line) for line in
               (run / "config_history.jsonl").read_text(encoding="utf-8").splitlines()]
    assert history == [{"step": 5, "time": history[0]["time"],
                        "overrides": ["train.lr_scale=0.5"]}]


# ---------------------------------------------------------------- gradient accumulation
def test_gradient_accumulation_equals_one_batch_of_the_same_tokens(data_dir):
    """Two micro-batches give the update of their union: the loss is normalised by the
    real target tokens of the whole update, not averaged per micro-batch. Plain SGD makes
    the weight change lr * gradient, so the gradients themselves are compared."""
    from aiayn.data.batching import collate
    from aiayn.data.prepared import encode_split, load_prepared

    config = load_config(TINY, ["model.dropout=0.0", "train.bf16=false"])
    prepared = load_prepared(data_dir)
    config = stream.resolve_config(config, prepared.tokenizers, data_dir)
    examples, _ = encode_split(prepared.train, prepared.tokenizers, 64, "drop")
    short, long = examples[:3], [e for e in examples if len(e.tgt) > 8][:2]
    world = train.Dist()
    lr = learning_rate(1, config.model.d_model, config.train.warmup_steps, config.train.lr_scale)
    results = []
    for micro in ([collate(short), collate(long)], [collate(short + long)]):
        torch.manual_seed(0)
        model = build_model(config, world.device)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        sgd = torch.optim.SGD(model.parameters(), lr=0.0)
        step = train.train_step(model, None, sgd, micro, 1, config, world)
        grads = {k: (before[k] - v) / lr for k, v in model.state_dict().items()}
        results.append((step, grads))
    (a, ga), (b, gb) = results
    assert a.n_tokens == b.n_tokens == sum(len(e.tgt) - 1 for e in short + long)
    assert a.loss == pytest.approx(b.loss, rel=1e-5)
    assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-3, atol=1e-5)


def test_padding_lengths_to_a_multiple_changes_no_update(data_dir):
    """bf16 training pads lengths to aiayn.data.batching.length_multiple (fewer shapes for oneDNN):
    the extra pad positions are masked out, so the loss and gradients are those of the
    unpadded batch (checked in fp32, where the sums are comparable)."""
    from aiayn.data.batching import collate
    from aiayn.data.prepared import encode_split, load_prepared

    config = load_config(TINY, ["model.dropout=0.0", "train.bf16=false"])
    prepared = load_prepared(data_dir)
    config = stream.resolve_config(config, prepared.tokenizers, data_dir)
    examples, _ = encode_split(prepared.train, prepared.tokenizers, 64, "drop")
    batch = examples[:5]
    world = train.Dist()
    results = []
    for multiple in (1, 16):
        collated = collate(batch, config.model.pad_id, multiple)
        assert collated.src.size(1) % multiple == 0
        torch.manual_seed(0)
        model = build_model(config, world.device)
        grads = {}  # each parameter's gradient as backward leaves it (train_step clears them)
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(
                lambda p, name=name, grads=grads: grads.__setitem__(name, p.grad.clone()))
        sgd = torch.optim.SGD(model.parameters(), lr=0.0)
        step = train.train_step(model, None, sgd, [collated], 1, config, world)
        results.append((step, grads, collated.src.size(1)))
    (a, ga, width_a), (b, gb, width_b) = results
    assert width_b > width_a  # the second really was padded further
    assert a.n_tokens == b.n_tokens
    assert a.loss == pytest.approx(b.loss, rel=1e-5)
    assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)
    assert ga.keys() == gb.keys() and len(ga) == len(list(model.parameters()))
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- distributed
TEARDOWN = "the interpreter tore this rank down"


def rank_program(tmp_path: Path) -> str:
    """`python -m aiayn` that prints TEARDOWN if the interpreter's exit runs: a rank must end
    without it (gloo's threads can abort a process there, SIGABRT, after its run is done)."""
    script = tmp_path / "rank.py"
    script.write_text("import atexit\n"
                      f"atexit.register(print, {TEARDOWN!r}, flush=True)\n"
                      "from aiayn.cli import main\n"
                      "raise SystemExit(main())\n")
    return str(script)


def test_a_bug_on_a_rank_prints_its_traceback_and_ends_the_same_way(monkeypatch, capsys):
    """An exception that escapes a rank's command (a bug: a traceback, not one line) also ends
    the process without the interpreter's teardown, with status 1; a WORLD_SIZE that is not
    a number leaves main as in one process (the run's set-up reports it)."""
    import aiayn.cli as cli

    def bug(args):
        raise RuntimeError("a bug")

    def exit_now(code):
        raise SystemExit(("ended at once", code))

    monkeypatch.setattr(cli, "_run_command", bug)
    monkeypatch.setattr(cli.os, "_exit", exit_now)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as ended:
        cli.main(["train", "--resume", "runs/none"])
    assert ended.value.code == ("ended at once", 1)
    assert "RuntimeError: a bug" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["train", "--resume", "runs/none"])


def test_a_world_size_that_is_no_number_is_one_line(data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "two")
    code = main(["train", "--config", TINY, "--data", str(data_dir), "--out",
                 str(tmp_path / "run"), *sets(max_steps=1)])
    assert code == 2
    assert "WORLD_SIZE='two' is not a number of processes" in error_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


def test_two_gloo_processes_match_one_process_with_the_same_global_batch(data_dir, tmp_path):
    """torchrun, 2 CPU ranks with one micro-batch each == 1 process accumulating 2.

    Dropout is off (each rank draws its own masks). The key biases of attention get exactly
    zero gradient in exact arithmetic (softmax ignores a shift of all scores), so with the
    paper's eps=1e-9 Adam turns float32 rounding noise there into +-lr steps; the test uses
    eps=1e-6, which leaves real gradients alone. Tolerance: the same losses to 1e-5
    (relative) and every weight within 5e-5 (observed: below 1e-5, largest in those biases;
    below 1e-6 elsewhere)."""
    # A budget whose batch count is even, so that sharding over 2 ranks needs no split
    # batch and the two ranks together run exactly the single process's batches.
    budget = next(b for b in range(256, 150, -8) if batches_per_epoch(data_dir, b) % 2 == 0)
    assert batches_per_epoch(data_dir, budget, world_size=2) * 2 == batches_per_epoch(
        data_dir, budget)
    steps = max(2, batches_per_epoch(data_dir, budget) // 2 - 1)  # within the first epoch
    common = ["--config", TINY, "--data", str(data_dir), "--set", "model.dropout=0.0",
              *sets(max_steps=steps, eval_every=100, save_every=100, log_every=1,
                    adam_eps="1.0e-6", max_tokens=budget)]
    one, two = tmp_path / "one", tmp_path / "two"
    run_train(*common, "--out", str(one), *sets(grad_accum=2))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", rank_program(tmp_path), "train", *common, "--out", str(two), "--device", "cpu"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert TEARDOWN not in done.stdout
    loss_one = [r["loss"] for r in records(one, "train")]
    loss_two = [r["loss"] for r in records(two, "train")]
    assert len(loss_one) == len(loss_two) == steps
    assert loss_two == pytest.approx(loss_one, rel=1e-5)
    wa, wb = weights(one), weights(two)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=0, atol=5e-5)
    state = load_train_state(two / "train_state.pt")
    assert state["world_size"] == 2 and len(state["rng"]) == len(state["stream"]) == 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_error_on_rank_0_stops_every_rank_at_once(data_dir, tmp_path):
    """Rank 0 alone creates the run directory; when it refuses, rank 1 must stop with the
    same one-line error, not crash at its next collective with a traceback (gloo: the peer
    is gone) or wait there until the timeout. The ranks are started by hand, as a cluster
    launcher would; torchrun would kill rank 1 itself and hide that."""
    run = tmp_path / "run"
    run_train("--config", TINY, "--data", str(data_dir), "--out", str(run), *sets(max_steps=1))
    cmd = [sys.executable, rank_program(tmp_path), "train", "--config", TINY, "--data",
           str(data_dir), "--out", str(run), "--device", "cpu"]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2"}
    ranks = [subprocess.Popen(cmd, cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert [p.returncode for p in ranks] == [2, 2]
    for out, err in outs:
        assert "already holds a run" in error_line(err)
        assert TEARDOWN not in out


def test_a_rank_killed_mid_run_stops_the_other_with_one_line_naming_the_resume(
        data_dir, tmp_path):
    """SIGKILL of rank 1 while the ranks train: rank 0's next collective finds its peer gone,
    and it stops with one line that says so and names the resume command, not a traceback.
    The ranks are started by hand; torchrun would end rank 0 itself at once."""
    import signal
    import time

    run = tmp_path / "run"
    cmd = [sys.executable, rank_program(tmp_path), "train", "--config", TINY, "--data",
           str(data_dir), "--out", str(run), "--device", "cpu",
           *sets(max_steps=100_000, save_every=2, eval_every=100_000)]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2"}
    ranks = [subprocess.Popen(cmd, cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        deadline = time.time() + 120
        while not (run / "train_state.pt").exists() and time.time() < deadline:
            time.sleep(0.05)
        ranks[1].send_signal(signal.SIGKILL)
        out, err = ranks[0].communicate(timeout=120)
    finally:
        for p in ranks:
            p.kill()
    assert ranks[0].returncode == 2 and "Traceback" not in err, err
    assert TEARDOWN not in out
    line = error_line(err)
    assert "rank 0 of 2: another process of the run stopped" in line
    assert f"-m aiayn train --resume {run}`" in line


def test_max_epochs_stops_after_exactly_that_many_passes(data_dir, tmp_path):
    run = tmp_path / "run"
    run_train("--config", TINY, "--data", str(data_dir), "--out", str(run),
              *sets(max_epochs=2, max_steps=10_000, eval_every=10_000, log_every=1))
    state = load_train_state(run / "train_state.pt")
    assert state["step"] == 2 * batches_per_epoch(data_dir)
    assert [r["epoch"] for r in records(run, "train")].count(1) == batches_per_epoch(data_dir)


# ---------------------------------------------------------------- train.keep_steps
def test_kept_steps_survive_pruning_and_a_resume_and_change_nothing_else(data_dir, tmp_path):
    """train.keep_steps: the weights of those steps are saved (between saves too) and never
    pruned, a resumed run keeps them and writes those still ahead, and the run itself (its
    weights, its resume) is the same as without them."""
    from aiayn.runs.directory import checkpoint_step, list_step_checkpoints

    common = ["--config", TINY, "--data", str(data_dir),
              *sets(eval_every=100, save_every=4, log_every=1, keep_checkpoints=1)]
    kept = sets(keep_steps="[1, 3, 4, 7]")
    plain, straight, split = tmp_path / "plain", tmp_path / "straight", tmp_path / "split"
    run_train(*common, "--out", str(plain), *sets(max_steps=10))
    run_train(*common, "--out", str(straight), *kept, *sets(max_steps=10))
    run_train(*common, "--out", str(split), *kept, *sets(max_steps=5))

    def steps(run):
        return [checkpoint_step(p) for p in list_step_checkpoints(run)]

    assert steps(plain) == [10]  # keep_checkpoints=1 prunes the saves at 4 and 8
    assert steps(split) == [1, 3, 4, 5]  # 5: the last save
    run_train("--resume", str(split), *sets(max_steps=10))
    assert steps(straight) == steps(split) == [1, 3, 4, 7, 10]
    assert_equal_weights(weights(straight), weights(plain))
    assert_equal_weights(weights(split), weights(plain))
    for step in (1, 3, 4, 7):
        name = f"checkpoints/step_{step:07d}.safetensors"
        assert_equal_weights(weights(split, name), weights(straight, name))
    early, later = (weights(split, f"checkpoints/step_{s:07d}.safetensors") for s in (1, 7))
    assert any(not torch.equal(early[name], later[name]) for name in early)  # their own steps


# ---------------------------------------------------------------- train.precision fp16
# Float16 autocast with a gradient scaler (``train_step``, ``new_scaler``): a GPU without bf16
# trains so; its logic runs on the CPU (float16 autocast works there, slowly), so it is
# tested here: an overflow skips the update and halves the scale, the run counts and logs
# the skips, and a resume keeps the scaler.

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
