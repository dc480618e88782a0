"""`aiayn doctor` finds each way a run can be broken, on deliberately broken copies of a tiny
run (and leaves the files alone), and says when a run's logged dev figures are not what its
weights give; `aiayn info` reports what the files say."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import TINY, prepare_splits, records, run_train, sets, snapshot, synthetic_pairs, write_prepared
from safetensors.torch import load_file, save_file

import aiayn
from aiayn.cli import main
from aiayn.config import load_config
from aiayn.data.prepared import load_prepared
from aiayn.data.tokenizer import Tokenizers
from aiayn.evaluation.evaluate import dev_loss
from aiayn.inspect import doctor as checkup
from aiayn.model import Transformer
from aiayn.runs.checkpoint import load_train_state, read_metadata
from aiayn.runs.directory import load_run, read_data_dir

CHECKS = ["config", "weights", "shapes", "tokenizer", "data", "round-trip", "translate",
          "validation", "resume"]


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("doctor")
    data = write_prepared(root / "data")
    run = root / "run"
    run_train("--config", TINY, "--data", str(data), "--out", str(run),
              *sets(schedule="linear", peak_lr=0.003, warmup_steps=10, max_steps=30,
                    eval_every=15, save_every=15))
    return run


def status(report) -> dict[str, bool | None]:
    return {check.name: check.ok for check in report.checks}


def test_a_healthy_run_passes_every_check_and_nothing_is_written(healthy, capsys):
    before = snapshot(healthy)
    report = aiayn.doctor(healthy)
    assert [c.name for c in report.checks] == CHECKS
    assert report.ok and all(status(report).values()), str(report)
    assert main(["doctor", str(healthy)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].endswith("all checks passed")
    assert "BLEU" in out and out.count("src: ") == 3 and "fix:" not in out
    assert snapshot(healthy) == before


# Each breakage: what it does to a copy of the run, and the checks that must fail.
def nan_in_best(run: Path) -> None:
    tensors = load_file(run / "best.safetensors")
    name = next(iter(tensors))
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, run / "best.safetensors")


def config_of_another_size(run: Path) -> None:
    text = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(text.replace("d_ff: 64", "d_ff: 48"))


def config_with_other_heads(run: Path) -> None:
    """The same shapes, another function: found by the architecture the weights carry."""
    text = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(text.replace("n_heads: 4", "n_heads: 2"))


def tokenizer_of_another_corpus(run: Path) -> None:
    other = write_prepared(run.parent / "other-data", joint=False)
    shutil.rmtree(run / "tokenizer")
    shutil.copytree(other / "tokenizer", run / "tokenizer")


def special_ids_swapped(run: Path) -> None:
    path = run / "tokenizer" / "joint.json"
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    vocab["[BOS]"], vocab["[EOS]"] = vocab["[EOS]"], vocab["[BOS]"]
    for added in tok["added_tokens"]:
        added["id"] = {2: 3, 3: 2}.get(added["id"], added["id"])
    path.write_text(json.dumps(tok))


def data_dir_gone(run: Path) -> None:
    (run / "data_dir.txt").write_text(str(run.parent / "nowhere") + "\n")


def data_with_its_own_tokenizer(run: Path) -> None:
    other = write_prepared(run.parent / "other-data", joint=False)
    (run / "data_dir.txt").write_text(str(other) + "\n")


def dev_text_the_tokenizer_cannot_spell(run: Path) -> None:
    data = Path((run / "data_dir.txt").read_text().strip())
    copy = run.parent / "data-copy"
    shutil.copytree(data, copy)
    (copy / "dev.jsonl").write_text(json.dumps({"src": "the zebra", "tgt": "la cebra"}) + "\n")
    (run / "data_dir.txt").write_text(str(copy) + "\n")


def metrics_line_damaged(run: Path) -> None:
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join([lines[0], "{not json\n", *lines[1:]]))


def train_state_corrupt(run: Path) -> None:
    (run / "train_state.pt").write_bytes(b"not a checkpoint")


def train_state_names_missing_weights(run: Path) -> None:
    state = load_train_state(run / "train_state.pt")
    (run / state["weights"]).unlink()


def optimizer_state_of_another_model(run: Path) -> None:
    state = load_train_state(run / "train_state.pt")
    state["optimizer"]["state"].pop(0)
    torch.save(state, run / "train_state.pt")


def no_weights_at_all(run: Path) -> None:
    for path in run.rglob("*.safetensors"):
        path.unlink()


BREAKAGES: list[tuple[Callable[[Path], None], set[str]]] = [
    (nan_in_best, {"weights"}),
    (config_of_another_size, {"shapes"}),
    (config_with_other_heads, {"shapes"}),
    (tokenizer_of_another_corpus, {"tokenizer", "data"}),
    (special_ids_swapped, {"tokenizer", "data"}),
    (data_dir_gone, {"data"}),
    (data_with_its_own_tokenizer, {"data"}),
    (dev_text_the_tokenizer_cannot_spell, {"round-trip"}),
    (metrics_line_damaged, {"validation"}),
    (train_state_corrupt, {"resume"}),
    (train_state_names_missing_weights, {"resume"}),
    (optimizer_state_of_another_model, {"resume"}),
    (no_weights_at_all, {"weights", "resume"}),
]


@pytest.mark.parametrize("breakage,failing", BREAKAGES, ids=[b.__name__ for b, _ in BREAKAGES])
def test_each_breakage_is_found_with_a_fix_and_exit_status_1(healthy, tmp_path, breakage,
                                                             failing, capsys):
    run = tmp_path / "run"
    shutil.copytree(healthy, run)
    breakage(run)
    before = snapshot(run)
    report = aiayn.doctor(run)
    failed = {name for name, ok in status(report).items() if ok is False}
    assert failed == failing, str(report)
    assert main(["doctor", str(run)]) == 1
    lines = capsys.readouterr().out.splitlines()
    fails = [line for line in lines if line.startswith("FAIL")]
    assert len(fails) == len(failing) and all("; fix: " in line for line in fails)
    assert lines[-1].endswith(f"{len(failing)} check(s) failed: "
                              + ", ".join(c for c in CHECKS if c in failing))
    assert snapshot(run) == before


def test_the_failure_lines_name_what_is_wrong(healthy, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(healthy, run)
    nan_in_best(run)
    config_of_another_size(run)
    report = {c.name: c for c in aiayn.doctor(run).checks}
    assert "best.safetensors: 1 non-finite values" in report["weights"].detail
    assert "has shape (64,) but the model expects (48,)" in report["shapes"].detail
    assert report["resume"].ok is None  # its weights do not fit: said once, under shapes
    assert report["translate"].ok is None  # no weights fit: nothing to translate with
    shutil.rmtree(run)
    shutil.copytree(healthy, run)
    tokenizer_of_another_corpus(run)
    tok = {c.name: c for c in aiayn.doctor(run).checks}["tokenizer"]
    assert "tokenizer has" in tok.detail and "rows" in tok.detail and "cp -r" in tok.fix


def test_a_missing_run_directory_is_one_failure(tmp_path, capsys):
    report = aiayn.doctor(tmp_path / "nowhere")
    assert [c.ok for c in report.checks] == [False] + [None] * (len(CHECKS) - 1)
    assert main(["doctor", str(tmp_path / "nowhere")]) == 1
    assert "no such directory" in capsys.readouterr().out


def test_doctor_checks_against_the_data_given(healthy, tmp_path):
    other = write_prepared(tmp_path / "other", joint=False)
    report = aiayn.doctor(healthy, data_dir=other)
    assert {c.name for c in report.checks if c.ok is False} == {"data"}
    assert "aiayn prepare --tokenizer-from" in report.checks[CHECKS.index("data")].fix


# ---------------------------------------------------------------- validation
@pytest.fixture(scope="module")
def validated(tmp_path_factory) -> Path:
    """A run that learns enough for a BLEU above 0, validated on 10 of its 16 dev pairs
    with a beam of 2, so a validation again must take the run's subset and search."""
    root = tmp_path_factory.mktemp("validated")
    data = write_prepared(root / "data")
    run = root / "run"
    run_train("--config", TINY, "--data", str(data), "--out", str(run),
              *sets(schedule="linear", peak_lr=0.005, warmup_steps=10, max_steps=120,
                    eval_every=60, save_every=60, eval_max_sentences=10, eval_beam=2))
    return run


def checks(run: Path, **options) -> dict[str, checkup.Check]:
    return {check.name: check for check in aiayn.doctor(run, **options).checks}


def best_step(run: Path) -> int:
    return int(read_metadata(run / "best.safetensors")["step"])


def logged(run: Path, step: int) -> dict:
    return [r for r in records(run, "dev") if r["step"] == step][-1]


def rewrite_logged(run: Path, step: int, **changes) -> None:
    """metrics.jsonl with the dev record of ``step`` changed (values: old -> new)."""
    lines = []
    for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if record["kind"] == "dev" and record["step"] == step:
            record.update({key: change(record[key]) for key, change in changes.items()})
        lines.append(json.dumps(record) + "\n")
    (run / "metrics.jsonl").write_text("".join(lines), encoding="utf-8")


def figures(detail: str, name: str) -> dict[str, float]:
    """The figures the validation line gives for one weights file."""
    part = detail.split(f"{name} (step ")[1].split(";")[0].split(", so ")[0]
    return {key: float(value) for key, value in
            re.findall(r"(dev loss|BLEU|its weights give) (-?[\d.]+)", part)}


def test_the_logged_figures_of_a_trained_run_are_what_its_weights_give(healthy, validated):
    # Both validate at their two saves; best.safetensors holds the first unless the second
    # scored higher (healthy: BLEU 0 at both, so best 15 and last 30 are checked apart).
    for run, last in ((healthy, 30), (validated, 120)):
        files = {"best.safetensors": best_step(run)}
        if last != files["best.safetensors"]:
            files["last.safetensors"] = last
        check = checks(run)["validation"]
        assert check.ok is True, check.detail
        for name, step in files.items():
            assert f"{name} (step {step})" in check.detail
            shown = figures(check.detail, name)
            assert abs(shown["dev loss"] - logged(run, step)["dev_loss"]) < 1e-3
            assert abs(shown["BLEU"] - logged(run, step)["bleu"]) < 0.01
    detail = checks(validated)["validation"].detail
    assert "the loss over 16 dev pairs, BLEU over 10 of them, beam 2" in detail
    assert logged(validated, best_step(validated))["bleu"] > 0, "the fixture's run learned nothing"


# Each way a log can fail to describe the weights best.safetensors holds: (what it does to a
# copy of the run, the figures the failure must name, those it must not).
def logged_loss_rewritten(run: Path) -> None:
    rewrite_logged(run, best_step(run), dev_loss=lambda loss: loss + 0.25)


def logged_bleu_rewritten(run: Path) -> None:
    rewrite_logged(run, best_step(run), bleu=lambda bleu: bleu + 2.0)


def best_swapped_for_other_weights(run: Path) -> None:
    """The tensors of the other saved step, under best's name and metadata (its step)."""
    path = run / "best.safetensors"
    other = next(p for p in (run / "checkpoints").glob("step_*.safetensors")
                 if int(p.stem.removeprefix("step_")) != best_step(run))
    save_file(load_file(other), path, metadata=read_metadata(path))


MISLOGGED = [(logged_loss_rewritten, {"dev loss"}, {"BLEU"}),
             (logged_bleu_rewritten, {"BLEU"}, {"dev loss"}),
             (best_swapped_for_other_weights, {"dev loss"}, set())]  # BLEU: may or may not


@pytest.mark.parametrize("mislogged,named,unnamed", MISLOGGED,
                         ids=[m.__name__ for m, _, _ in MISLOGGED])
def test_a_log_that_does_not_describe_the_weights_fails_naming_file_and_figures(
        validated, tmp_path, mislogged, named, unnamed, capsys):
    run = tmp_path / "run"
    shutil.copytree(validated, run)
    step = best_step(run)
    kept = logged(validated, step)
    mislogged(run)
    before = snapshot(run)
    report = checks(run)
    assert {name for name, c in report.items() if c.ok is False} == {"validation"}
    line = report["validation"].lines()[0]
    assert line.startswith(f"FAIL  validation  best.safetensors (step {step}): logged ")
    assert "metrics.jsonl does not describe these weights; fix: " in line
    assert f"aiayn evaluate {run} --split dev --weights best" in line
    for figure, key, form in (("dev loss", "dev_loss", ".3f"), ("BLEU", "bleu", ".2f")):
        if figure in unnamed:
            assert f"logged {figure} " not in line
        if figure not in named:
            continue
        now = logged(run, step)[key]
        said = re.search(rf"logged {figure} ([\d.]+), its weights give ([\d.]+)", line)
        assert said and said[1] == f"{now:{form}}", line
        if mislogged is not best_swapped_for_other_weights:  # the weights: the logged ones
            assert abs(float(said[2]) - kept[key]) <= 10 ** -int(form[1]), line
    assert main(["doctor", str(run)]) == 1
    assert "1 check(s) failed: validation" in capsys.readouterr().out
    assert snapshot(run) == before


def test_differences_within_the_tolerances_pass(validated, tmp_path):
    """Another process may compute the loss with other kernels, and a BLEU may move by a
    tie: 0.1% of the loss (at least 0.002) and 0.5 BLEU are not reported."""
    run = tmp_path / "run"
    shutil.copytree(validated, run)
    step = best_step(run)
    rewrite_logged(run, step, dev_loss=lambda loss: loss + 0.0015, bleu=lambda b: b - 0.4)
    assert checks(run)["validation"].ok is True
    rewrite_logged(run, step, dev_loss=lambda loss: loss + 0.0015 * 2)
    assert checks(run)["validation"].ok is False


def test_a_run_whose_bf16_was_auto_is_compared_in_either_precision(validated, tmp_path,
                                                                    monkeypatch):
    """train.precision "auto" chose per machine: a logged loss that only bf16 autocast gives
    passes then, and fails where the config says fp32. (The tolerance is made a quarter of
    the gap bf16 makes here: on the tiny model bf16 moves the loss by less than the real
    tolerance, and by how much depends on the CPU's bf16 products.)"""
    run = tmp_path / "run"
    shutil.copytree(validated, run)
    step = best_step(run)
    config, model, _ = load_run(run, "best")
    dev, _ = load_prepared(read_data_dir(run)).validation_split(config.model.max_len)
    losses = {}
    for bf16 in ("false", "true"):
        config.train.bf16 = bf16
        losses[bf16] = dev_loss(model, dev, config, torch.device("cpu"))[0]
    gap = abs(losses["true"] - losses["false"])
    assert gap > 0  # bf16 autocast changes the loss: something to tell apart
    monkeypatch.setattr(checkup, "LOSS_TOLERANCE", {"rel_tol": gap / losses["false"] / 4, "abs_tol": 0.0})
    rewrite_logged(run, step, dev_loss=lambda _: losses["true"])
    text = (run / "config.yaml").read_text()
    assert "precision: fp32" in text
    (run / "config.yaml").write_text(text.replace("precision: fp32", "precision: auto"))
    assert checks(run)["validation"].ok is True
    # A run directory written before train.precision says it with train.bf16.
    (run / "config.yaml").write_text(text.replace("precision: fp32", "bf16: auto"))
    assert checks(run)["validation"].ok is True
    (run / "config.yaml").write_text(text)
    assert checks(run)["validation"].ok is False


def test_the_validation_check_skips_what_it_cannot_compare(validated, tmp_path):
    # No metrics.jsonl (a run trained outside aiayn train): nothing was logged.
    run = tmp_path / "run"
    shutil.copytree(validated, run)
    (run / "metrics.jsonl").unlink()
    check = checks(run)["validation"]
    assert check.ok is None and "logs no validation" in check.detail
    # Data with the run's tokenizer but another dev split: not what the log was scored on.
    other = prepare_splits(tmp_path / "other", {"train": synthetic_pairs(40, 5),
                                                "dev": synthetic_pairs(16, 6),
                                                "test": synthetic_pairs(4, 7)},
                           tokenizers=Tokenizers.load(validated / "tokenizer"))
    report = checks(validated, data_dir=other)
    assert report["data"].ok is True
    assert report["validation"].ok is None
    assert "is not the one the run validated on" in report["validation"].detail


# ---------------------------------------------------------------- info
def test_info_reports_what_the_run_files_say(healthy, capsys):
    assert main(["info", str(healthy), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info == aiayn.run_info(healthy)
    config = load_config(healthy / "config.yaml")
    assert info["model"]["parameters"] == Transformer(config.model).num_parameters()
    assert info["vocabulary"]["src"] == config.model.src_vocab_size
    state = load_train_state(healthy / "train_state.pt")
    assert info["training"]["step"] == state["step"] == 30
    assert info["training"]["tokens"] == state["tokens"]
    devs = [json.loads(line) for line in (healthy / "metrics.jsonl").read_text().splitlines()]
    devs = [r for r in devs if r["kind"] == "dev"]
    assert info["best"]["step"] == devs[-1]["best_step"] == state["best"]["step"]
    assert info["best"]["metric"] == "bleu"
    assert info["last_dev"]["step"] == 30 and info["last_dev"]["bleu"] == devs[-1]["bleu"]
    files = {w["file"]: w["step"] for w in info["weights"]}
    assert files == {"best.safetensors": state["best"]["step"], "last.safetensors": 30,
                     "checkpoints/step_0000015.safetensors": 15,
                     "checkpoints/step_0000030.safetensors": 30}
    assert info["init_from"] is None
    assert info["decode"] == {"beam": config.decode.beam, "alpha": config.decode.alpha,
                              "no_repeat_ngram": 0}
    assert main(["info", str(healthy)]) == 0
    text = capsys.readouterr().out
    assert f"best       step {info['best']['step']}," in text and "trained    30 steps" in text
    assert f"search     beam {config.decode.beam}, alpha {config.decode.alpha} (its " in text


def test_info_on_a_directory_that_is_no_run_is_one_line(tmp_path, capsys):
    assert main(["info", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("aiayn: error:") and "no config.yaml" in err and "\n" not in err


@pytest.mark.slow  # processes of their own
def test_doctor_does_not_import_the_trainer():
    """The train-state version lives where the state is saved (aiayn.runs.checkpoint)."""
    code = "import sys, aiayn.inspect.doctor; print('aiayn.training.loop' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.strip() == "False"


def test_a_run_still_training_is_said_to_be_in_use_not_broken(healthy, tmp_path, capsys):
    """While `aiayn train` holds the run (before its first save, no train_state.pt yet), the
    doctor says who holds it and what it did not check, instead of "cannot be resumed"."""
    from aiayn.util.lock import locked

    run = tmp_path / "run"
    shutil.copytree(healthy, run)
    (run / "train_state.pt").unlink()
    with locked(run, "aiayn train"):
        code = main(["doctor", str(run)])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = {line.split()[1]: line for line in out.splitlines()[:-1] if line[:1] != " "}
    for name in ("validation", "resume"):
        assert lines[name].startswith("skip") and f"in use by pid {os.getpid()} (aiayn train)" \
            in lines[name] and "run `aiayn doctor` again when it has finished" in lines[name]
    assert "--init-from" not in out and "cannot be resumed" not in out
    assert all(lines[name].startswith("ok") for name in CHECKS[:7])


def test_data_that_moved_is_said_to_come_from_data_dir_txt_which_data_overrides(
        healthy, tmp_path, capsys):
    """`evaluate` and `doctor` on a run whose prepared data moved name where the path came
    from and the flag that overrides it; with --data they work."""
    run = tmp_path / "run"
    shutil.copytree(healthy, run)
    moved = tmp_path / "moved"
    shutil.copytree(read_data_dir(run), moved)
    data_dir_gone(run)
    gone = run.parent / "nowhere"
    assert main(["evaluate", str(run), "--limit", "2", "-o", str(tmp_path / "h.txt")]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"aiayn: error: {gone}: prepared data directory not found") \
        and f"{run / 'data_dir.txt'}" in line and "give --data DIR, which overrides it" in line
    assert "\n" not in line
    assert main(["doctor", str(run)]) == 1
    data_line = next(x for x in capsys.readouterr().out.splitlines() if x.split()[1] == "data")
    assert data_line.startswith("FAIL") and f"the path comes from {run / 'data_dir.txt'}" \
        in data_line and "give it with --data DIR, which overrides data_dir.txt" in data_line
    assert main(["evaluate", str(run), "--limit", "2", "-o", str(tmp_path / "h.txt"),
                 "--data", str(moved)]) == 0
    assert status(aiayn.doctor(run, data_dir=moved))["data"] is True
    capsys.readouterr()
