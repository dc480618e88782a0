"""The second run: fine-tuning from a run (--init-from, prepare --tokenizer-from) and early
stopping by train.best_metric / train.patience, on tiny toy corpora through the CLI."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from helpers import (
    LEXICON,
    TINY,
    assert_equal_weights,
    error_line,
    records,
    run_train,
    sets,
    snapshot,
    weights,
    write_prepared,
)

import aiayn
from aiayn.cli import main
from aiayn.config import DecodeConfig, load_config
from aiayn.data.prepared import encode_split, load_prepared
from aiayn.evaluation.evaluate import dev_loss
from aiayn.runs.checkpoint import load_train_state
from aiayn.runs.directory import load_run
from aiayn.training import loop as train_module


def monotone_pairs(n: int, seed: int) -> list[tuple[str, str]]:
    """A second toy language over the same words: word for word, in the source's order
    (the first corpus reverses it), so the base run's vocabulary covers it."""
    rng = random.Random(seed)
    words = sorted(LEXICON)
    pairs = []
    for _ in range(n):
        src = [rng.choice(words) for _ in range(rng.randint(2, 9))]
        pairs.append((" ".join(src), " ".join(LEXICON[w] for w in src)))
    return pairs


def write_tsv_corpus(directory: Path) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    for split, (n, seed) in {"train": (240, 11), "dev": (16, 12), "test": (16, 13)}.items():
        lines = [f"{s}\t{t}" for s, t in monotone_pairs(n, seed)]
        (directory / f"{split}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return f"tsv:{directory}/{{split}}.tsv"


# A learning rate at which the tiny model learns within tens of steps.
STEADY = sets(schedule="linear", peak_lr=0.003, warmup_steps=10)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """A tiny run trained on the reversing toy language."""
    root = tmp_path_factory.mktemp("base")
    data = write_prepared(root / "data")
    run = root / "run"
    run_train("--config", TINY, "--data", str(data), "--out", str(run), *STEADY,
              *sets(max_steps=60, eval_every=30, save_every=30))
    return run


@pytest.fixture(scope="module")
def second_corpus(base_run, tmp_path_factory) -> Path:
    """The monotone toy language, prepared with the base run's tokenizer."""
    root = tmp_path_factory.mktemp("second")
    spec = write_tsv_corpus(root / "tsv")
    out = root / "prepared"
    assert main(["prepare", "--tokenizer-from", str(base_run), "--corpus", spec,
                 "--out", str(out)]) == 0
    return out


def dev_loss_of(run: Path, weights_name: str, data_dir: Path) -> float:
    config, model, tokenizers = load_run(run, weights_name)
    examples, _ = encode_split(load_prepared(data_dir).dev, tokenizers, config.model.max_len,
                               "truncate")
    config.train.bf16 = "false"
    return dev_loss(model, examples, config, torch.device("cpu"))[0]


# ---------------------------------------------------------------- fine-tuning
def test_fine_tuning_lowers_the_new_corpus_dev_loss_and_keeps_the_vocabulary(
        base_run, second_corpus, tmp_path):
    base_tokenizer = snapshot(base_run / "tokenizer")
    assert snapshot(second_corpus / "tokenizer") == base_tokenizer  # prepare --tokenizer-from
    again = tmp_path / "again"  # and, like prepare, it writes a new or empty --out only
    again.mkdir()
    (again / "keep.txt").write_text("mine")
    spec = json.loads((second_corpus / "stats.json").read_text())["corpus"]
    args = ["prepare", "--tokenizer-from", str(base_run), "--corpus", spec, "--out", str(again)]
    assert main(args) == 2
    assert main([*args, "--force"]) == 0 and snapshot(again / "tokenizer") == base_tokenizer
    assert json.loads((second_corpus / "stats.json").read_text())["splits"]["train"] == 240
    tuned = tmp_path / "tuned"
    run_train("--init-from", f"{base_run}:last", "--data", str(second_corpus),
              "--out", str(tuned), *sets(max_steps=40, eval_every=20, save_every=20))
    assert snapshot(tuned / "tokenizer") == base_tokenizer
    before = dev_loss_of(base_run, "last", second_corpus)
    after = dev_loss_of(tuned, "last", second_corpus)
    assert after < before - 0.1, (before, after)
    # A new run: its own step count from 1, a fresh optimizer; where it started is recorded.
    state = load_train_state(tuned / "train_state.pt")
    assert state["step"] == 40 and [r["step"] for r in records(tuned, "dev")] == [20, 40]
    init = json.loads((tuned / "init_from.json").read_text())
    assert init["weights"] == str((base_run / "last.safetensors").resolve())
    assert init["step"] == 60
    assert (tuned / "data_dir.txt").read_text().strip() == str(second_corpus.resolve())
    base_config, tuned_config = load_config(base_run / "config.yaml"), load_config(
        tuned / "config.yaml")
    assert tuned_config.model == base_config.model
    assert tuned_config.data.corpus.startswith("tsv:")  # the new corpus, from its stats.json
    assert aiayn.doctor(tuned).ok  # its data: the second corpus, with the same tokenizer
    assert aiayn.run_info(tuned)["init_from"]["step"] == 60


def test_a_new_run_records_the_corpus_its_data_was_prepared_from(second_corpus, tmp_path):
    """A preset names its own corpus (configs/tiny.yaml the Bible's); a run trained from it
    on data prepared from another records that other corpus, as the data's stats.json says."""
    run = tmp_path / "run"
    assert load_config(TINY).data.corpus.startswith("bible:")
    run_train("--config", TINY, "--data", str(second_corpus), "--out", str(run),
              *sets(max_steps=1, eval_every=10, save_every=10))
    recorded = load_config(run / "config.yaml").data.corpus
    assert recorded == json.loads((second_corpus / "stats.json").read_text())["corpus"]
    assert recorded.startswith("tsv:")


def test_the_new_run_starts_from_exactly_the_given_weights(base_run, second_corpus, tmp_path):
    """One update at a learning rate of 1e-10 leaves the weights where they started: the
    named ones (best here), not a fresh initialisation."""
    tuned = tmp_path / "tuned"
    run_train("--init-from", str(base_run), "--data", str(second_corpus), "--out", str(tuned),
              *sets(max_steps=1, peak_lr="1.0e-9", eval_every=10, save_every=10))
    start, now = weights(base_run, "best.safetensors"), weights(tuned)
    assert start.keys() == now.keys()
    for name in start:
        torch.testing.assert_close(now[name], start[name], rtol=0, atol=1e-6)


def test_a_changed_model_shape_or_vocabulary_is_refused_naming_both_values(
        base_run, second_corpus, tmp_path, capsys):
    out = tmp_path / "tuned"
    code = main(["train", "--init-from", str(base_run), "--data", str(second_corpus),
                 "--out", str(out), "--set", "model.d_ff=128"])
    assert code == 2
    assert "model.d_ff: the run" in (err := error_line(capsys.readouterr().err))
    assert "has 64, --set asks for 128" in err
    # Dropout may change; --config gives the train section, its model must be the run's.
    code = main(["train", "--init-from", str(base_run), "--data", str(second_corpus),
                 "--out", str(out), "--config", str(Path(TINY).parent / "base.yaml")])
    assert code == 2 and "model.d_model: the run" in error_line(capsys.readouterr().err)
    # Data prepared with its own tokenizer (another vocabulary) is refused, both named.
    other = write_prepared(tmp_path / "other", joint=False)
    code = main(["train", "--init-from", str(base_run), "--data", str(other),
                 "--out", str(out)])
    err = error_line(capsys.readouterr().err)
    assert code == 2 and "encoded with another tokenizer" in err
    assert "vocabularies of" in err and "joint vocabulary of" in err
    assert "aiayn prepare --tokenizer-from" in err
    assert not out.exists()  # nothing written
    # A tokenizer setting that contradicts the run's, in prepare --tokenizer-from.
    code = main(["prepare", "--tokenizer-from", str(base_run), "--vocab-size", "99",
                 "--out", str(tmp_path / "p")])
    err = error_line(capsys.readouterr().err)
    assert code == 2 and "data.vocab_size" in err and "64" in err and "99" in err
    assert not (tmp_path / "p").exists()


def test_fine_tuning_may_change_dropout_and_train_settings(base_run, second_corpus, tmp_path):
    tuned = tmp_path / "tuned"
    run_train("--init-from", str(base_run), "--data", str(second_corpus), "--out", str(tuned),
              "--set", "model.dropout=0.3", "--set", "decode.beam=3",
              *sets(max_steps=2, eval_every=10, warmup_steps=7))
    config = load_config(tuned / "config.yaml")
    assert config.model.dropout == 0.3 and config.train.warmup_steps == 7
    # the search: the old run's, with what --set changes
    old = load_config(base_run / "config.yaml").decode
    assert config.decode == DecodeConfig(beam=3, alpha=old.alpha)


# ---------------------------------------------------------------- early stopping
# Scripted validations (the loop, the files and the rule are real; the scores are given):
SCRIPT = {"loss": [3.0, 2.0, 2.5, 2.6, 2.7, 2.8, 2.9],
          "bleu": [1.0, 5.0, 3.0, 6.0, 2.0, 2.0, 2.0],
          "chrf": [10.0, 8.0, 20.0, 15.0, 14.0, 30.0, 1.0]}
# With patience 2: (validation that is best, validation that stops), counted from 1.
EXPECTED = {"loss": (2, 4), "bleu": (4, 6), "chrf": (3, 5)}


def scripted_validate(calls: list[int]):
    def fake(model, tokenizers, dev, dev_pairs, config, device, full, kernel=None):
        i = min(len(calls), len(SCRIPT["loss"]) - 1)
        calls.append(i)
        return {"dev_loss": SCRIPT["loss"][i], "dev_nll": SCRIPT["loss"][i],
                "bleu": SCRIPT["bleu"][i], "chrf": SCRIPT["chrf"][i],
                "select_bleu": SCRIPT["bleu"][i], "select_chrf": SCRIPT["chrf"][i],
                "bleu_signature": "scripted", "n_sentences": len(dev), "samples": []}
    return fake


@pytest.mark.parametrize("metric", ["loss", "bleu", "chrf"])
def test_patience_stops_and_best_weights_follow_the_chosen_metric(
        metric, tmp_path, monkeypatch, capsys):
    data = write_prepared(tmp_path / "data")
    calls: list[int] = []
    monkeypatch.setattr(train_module, "validate", scripted_validate(calls))
    run = tmp_path / "run"
    result = train_module.train(
        load_config(TINY, [f"train.best_metric={metric}", "train.patience=2",
                           "train.eval_every=2", "train.save_every=2", "train.max_steps=40",
                           "train.keep_checkpoints=20"]), data, run)
    best_at, stop_at = EXPECTED[metric]
    assert len(calls) == stop_at  # no further validation after the stop
    assert result["step"] == 2 * stop_at and result["best_step"] == 2 * best_at
    assert result["stop_reason"].startswith("patience: 2 validations without a better")
    out = capsys.readouterr().out  # tqdm.write: the log lines go to stdout
    assert f"stopped at step {2 * stop_at}" in out and f"at step {2 * best_at} (best" in out
    stop_line = next(line for line in out.splitlines() if line.startswith("stopped at step"))
    assert stop_line.count("best ") == 1  # the best value is said once
    devs = records(run, "dev")
    assert [r["best_step"] for r in devs][-1] == 2 * best_at
    assert all(r["best_metric"] == metric for r in devs)
    assert [r["stale_validations"] for r in devs][-2:] == [1, 2]
    # best.safetensors holds the weights of the best step (its step checkpoint).
    assert_equal_weights(weights(run, "best.safetensors"),
                         weights(run, f"checkpoints/step_{2 * best_at:07d}.safetensors"))
    state = load_train_state(run / "train_state.pt")
    assert state["best"]["metric"] == metric and state["best"]["step"] == 2 * best_at


def test_without_patience_training_runs_to_its_limit(tmp_path, monkeypatch):
    data = write_prepared(tmp_path / "data")
    calls: list[int] = []
    monkeypatch.setattr(train_module, "validate", scripted_validate(calls))
    result = train_module.train(load_config(TINY, ["train.best_metric=loss",
                                                   "train.eval_every=2",
                                                   "train.max_steps=16"]), data, tmp_path / "r")
    assert result["step"] == 16 and result["stop_reason"] == "max_steps"
    assert result["best_step"] == 4 and len(calls) == 8


def test_bad_early_stopping_settings_are_one_line_errors(tmp_path, capsys):
    data = write_prepared(tmp_path / "data")
    for setting, words in (("train.best_metric=ppl", "bleu, chrf, loss"),
                           ("train.patience=-1", "train.patience must be in [0, inf)")):
        code = main(["train", "--config", TINY, "--data", str(data), "--out",
                     str(tmp_path / "r"), "--set", setting])
        assert code == 2 and words in error_line(capsys.readouterr().err)
    assert not (tmp_path / "r").exists()


def test_a_resumed_run_keeps_its_best_and_its_patience_count(tmp_path, monkeypatch, capsys):
    data = write_prepared(tmp_path / "data")
    calls: list[int] = []
    monkeypatch.setattr(train_module, "validate", scripted_validate(calls))
    run = tmp_path / "run"
    settings = ["train.best_metric=bleu", "train.patience=2", "train.eval_every=2",
                "train.save_every=2", "train.max_steps=40"]
    assert train_module.train(load_config(TINY, settings), data, run)["step"] == 12
    state = (run / "train_state.pt").read_bytes()
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 2  # still out of patience
    err = error_line(capsys.readouterr().err)
    assert "stopped early at step 12" in err and "train.patience" in err
    assert (run / "train_state.pt").read_bytes() == state
    assert not (run / "config_history.jsonl").exists()  # the refused resume wrote nothing
    # More patience: it goes on from the saved best (6.0 at step 8) and count (2).
    result = train_module.train(None, None, run, resume=True, overrides=["train.patience=3"])
    assert result["step"] == 14 and result["best_step"] == 8
    assert result["stop_reason"].startswith("patience: 3 validations")


def test_a_train_state_from_before_best_metric_resumes_with_its_best_bleu(tmp_path):
    """Runs saved before train.best_metric kept best_bleu/best_step: they resume by BLEU."""
    data = write_prepared(tmp_path / "data")
    run = tmp_path / "run"
    run_train("--config", TINY, "--data", str(data), "--out", str(run),
              *sets(max_steps=4, eval_every=2, save_every=2))
    state = load_train_state(run / "train_state.pt")
    best = state.pop("best")
    state["best_bleu"], state["best_step"] = 99.0, best["step"]
    torch.save(state, run / "train_state.pt")
    result = train_module.train(None, None, run, resume=True, overrides=["train.max_steps=6"])
    assert result["step"] == 6 and result["best_metric"] == "bleu"
    assert (result["best_value"], result["best_step"]) == (99.0, best["step"])
