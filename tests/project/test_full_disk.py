"""A full disk, on a real small filesystem (tmpfs, mounted here as root; skipped with the
reason where mounting is not permitted): every command that writes ends with one line
naming the path, what it needed and the fix, exit status 2; a new directory it made is
gone; a resumed run keeps its last good checkpoint and continues from it bit for bit."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from forked_cli import ForkedCLIs
from helpers import assert_equal_weights, toy_tsv, weights

from aiayn import cli
from aiayn.runs.checkpoint import load_train_state
from aiayn.training import loop as train
from aiayn.util.io import DiskError, as_disk_error, atomic_write_text

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
WORDS = "the a red blue cat dog sun sea big small house tree eats sees and old".split()
RUN_SETTINGS = ["--set", "train.max_steps=12", "--set", "train.save_every=4",
                "--set", "train.eval_every=4", "--set", "train.keep_checkpoints=2"]


@pytest.fixture(scope="module")
def aiayn():
    """`python -m aiayn ARGS`, each a process forked from one that has imported aiayn
    (tests/forked_cli.py): ``subprocess.run``'s result."""
    servers = ForkedCLIs(env={**os.environ, "PYTHONWARNINGS": "default"}, cwd=ROOT)
    yield lambda *args: servers.run(*args, timeout=300)
    servers.close()


def one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.replace("\r", "\n").splitlines() if line.startswith("aiayn:")]
    assert len(lines) == 1 and lines[0].startswith("aiayn: error: "), stderr
    return lines[0]


@pytest.fixture
def small_fs(tmp_path):
    """An 8 MB tmpfs at tmp_path/small, unmounted after the test whatever happened."""
    mount = tmp_path / "small"
    mount.mkdir()
    if not shutil.which("mount"):
        pytest.skip("no mount command here")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or 'not permitted'})")
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def fill(directory: Path, leave: int = 0) -> Path:
    """Fill ``directory``'s filesystem, then give back ``leave`` bytes; returns the filler."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for block in (1 << 16, 4096, 1):  # big blocks, then the last pages, then bytes
            try:
                while True:
                    os.write(fd, b"\0" * block)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    size = filler.stat().st_size
    os.truncate(filler, max(0, size - leave))
    return filler


def free_bytes(directory: Path) -> int:
    return shutil.disk_usage(directory).free


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """Prepared data and a tiny run (saved at 4 and 8) on the ordinary disk."""
    root = tmp_path_factory.mktemp("full-disk")
    corpus = toy_tsv(root / "pairs.tsv", WORDS, lengths=(2, 8), copy=True)
    data, run = root / "data", root / "run"
    assert cli.main(["prepare", "--corpus", f"tsv:{corpus}", "--config", str(TINY),
                     "--out", str(data), "--set", "data.tokenizer=wordlevel"]) == 0
    assert cli.main(["train", "--config", str(TINY), "--data", str(data), "--out", str(run),
                     "--set", "train.max_steps=8", "--set", "train.save_every=4",
                     "--set", "train.eval_every=4"]) == 0
    return {"root": root, "data": data, "run": run, "corpus": corpus}


def fill_at_save(monkeypatch, step: int, directory: Path) -> list[Path]:
    """Make the disk full just before the save of ``step``; returns [the filler] once done."""
    real_save = train.Trainer.save
    fillers: list[Path] = []

    def save(self):
        if self.progress.step == step and not fillers:
            fillers.append(fill(directory))
        return real_save(self)

    monkeypatch.setattr(train.Trainer, "save", save)
    return fillers


# ---------------------------------------------------------------- the one line
def test_the_line_names_the_path_the_need_and_the_fix():
    full = as_disk_error(OSError(errno.ENOSPC, "No space left on device", "/x/.w.1.tmp"),
                         "/x/w", need=30_000_000, what="the checkpoint")
    assert full.line("--out") == ("no space left on /x/w: the checkpoint needs ~30.0 MB; free "
                                  "space or choose another --out")
    quota = as_disk_error(OSError(errno.EDQUOT, "Disk quota exceeded", "/x/w"))
    assert quota.line("-o").startswith("disk quota exceeded on /x/w: writing the file; free")
    ro = as_disk_error(OSError(errno.EROFS, "Read-only file system", "/x/w"))
    assert ro.line("-o") == "read-only filesystem writing /x/w: remount it writable or choose another -o"
    denied = as_disk_error(OSError(errno.EACCES, "Permission denied", "/x/w"))
    assert denied.line("OUT_DIR") == ("permission denied writing /x/w: check its permissions or "
                                      "choose another OUT_DIR")
    # safetensors' writer raises its own error type; the errno is in its text
    rust = RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert as_disk_error(rust, "/x/w").code == errno.ENOSPC
    # an error about another file (a corpus being read) is not the write's
    assert as_disk_error(OSError(errno.EACCES, "Permission denied", "/y/corpus.tsv"), "/x/w") is None
    assert as_disk_error(OSError(errno.ENOENT, "No such file", "/x/w")) is None


def test_a_full_disk_in_an_atomic_write_keeps_the_old_file(small_fs):
    target = small_fs / "file.txt"
    atomic_write_text(target, "old\n")
    fill(small_fs)
    with pytest.raises(DiskError) as caught:
        atomic_write_text(target, "new" * 100_000)
    assert str(target) in str(caught.value) and "needs ~300.0 kB" in str(caught.value)
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in small_fs.iterdir()) == ["file.txt", "filler"]


# ---------------------------------------------------------------- training
def test_a_new_run_stopped_by_a_full_disk_is_removed(world, small_fs, monkeypatch, capsys):
    run = small_fs / "runs" / "new"
    (small_fs / "runs").mkdir()
    fill_at_save(monkeypatch, 4, small_fs)
    code = cli.main(["train", "--config", str(TINY), "--data", str(world["data"]),
                     "--out", str(run), *RUN_SETTINGS])
    line = one_error_line(capsys.readouterr().err)
    assert code == 2
    assert line.startswith(f"aiayn: error: no space left on {run}/")
    assert "needs ~" in line and "choose another --out" in line
    assert not run.exists()  # the half-made run is gone, nothing to resume
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler", "runs"]


def test_a_resume_whose_save_fails_keeps_the_last_good_state_and_continues_exactly(
        world, small_fs, tmp_path, monkeypatch, capsys):
    # The reference: the same run, 12 steps without a fault, on the ordinary disk.
    reference = tmp_path / "reference"
    assert cli.main(["train", "--config", str(TINY), "--data", str(world["data"]),
                     "--out", str(reference), *RUN_SETTINGS]) == 0
    run = small_fs / "run"
    fillers = fill_at_save(monkeypatch, 8, small_fs)
    code = cli.main(["train", "--config", str(TINY), "--data", str(world["data"]),
                     "--out", str(run), *RUN_SETTINGS])
    monkeypatch.undo()
    line = one_error_line(capsys.readouterr().err)
    assert code == 2 and fillers
    assert line.startswith(f"aiayn: error: no space left on {run}/")
    assert f"`aiayn train --resume {run}` goes on from the last good checkpoint" in line
    # the last good save (step 4) whole, nothing of the failed one
    assert load_train_state(run / "train_state.pt")["step"] == 4
    assert not list(run.rglob(".*.tmp"))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_0000004.safetensors"]
    fillers[0].unlink()  # space again
    assert cli.main(["train", "--resume", str(run)]) == 0
    assert load_train_state(run / "train_state.pt")["step"] == 12
    assert_equal_weights(weights(run), weights(reference))


def test_a_resume_on_a_full_disk_changes_nothing(world, small_fs, capsys):
    run = small_fs / "run"
    shutil.copytree(world["run"], run)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"}
    fill(small_fs)
    code = cli.main(["train", "--resume", str(run), "--set", "train.max_steps=12"])
    line = one_error_line(capsys.readouterr().err)
    assert code == 2
    assert line.startswith(f"aiayn: error: not enough space on {run}: the run needs ~")
    assert f"free space, then `aiayn train --resume {run}` goes on" in line
    after = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"}
    # metrics.jsonl and config.yaml may be rewritten with the same content; the checkpoints
    # and the train state are untouched, and nothing new stays
    assert set(after) <= set(before) | {run / "config_history.jsonl"}
    for name in ("train_state.pt", "last.safetensors", "best.safetensors"):
        assert after[run / name] == before[run / name]


# ---------------------------------------------------------------- refused before it starts
def test_train_is_refused_before_it_starts_when_the_checkpoints_do_not_fit(aiayn, world, small_fs):
    fill(small_fs, leave=256 << 10)
    run = small_fs / "run"
    result = aiayn("train", "--config", TINY, "--data", world["data"], "--out", run)
    line = one_error_line(result.stderr.decode())
    assert result.returncode == 2 and "train:" not in result.stderr.decode()  # no step run
    assert line.startswith(f"aiayn: error: not enough space on {run}: the run needs ~")
    assert "kB free; free space or choose another --out" in line
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]


def test_prepare_is_refused_before_it_starts_when_the_corpus_does_not_fit(aiayn, world, small_fs):
    fill(small_fs, leave=3 * world["corpus"].stat().st_size // 2)
    out = small_fs / "data"
    result = aiayn("prepare", "--corpus", f"tsv:{world['corpus']}", "--config", TINY,
                   "--out", out, "--set", "data.tokenizer=wordlevel")
    line = one_error_line(result.stderr.decode())
    assert result.returncode == 2
    assert line.startswith(f"aiayn: error: not enough space on {out}: the prepared data needs ~")
    assert line.endswith("free space or choose another --out")
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]


def test_export_is_refused_before_it_starts_when_the_model_does_not_fit(aiayn, world, small_fs):
    pytest.importorskip("transformers")
    fill(small_fs, leave=64 << 10)
    out = small_fs / "new" / "hf"
    result = aiayn("export", world["run"], "--to", "hf", out)
    line = one_error_line(result.stderr.decode())
    assert result.returncode == 2
    assert line.startswith(f"aiayn: error: not enough space on {out}: the export needs ~")
    assert line.endswith("free space or choose another OUT_DIR")
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]


# ---------------------------------------------------------------- full while writing
# The check above passes (an estimate, or another process filled the disk since): the
# writes themselves fail, and the new directory goes.
def test_prepare_stopped_by_a_full_disk_leaves_nothing(world, small_fs, monkeypatch, capsys):
    from aiayn.data import prepare

    monkeypatch.setattr(prepare, "check_room", lambda *args: None)
    fill(small_fs, leave=16 << 10)
    out = small_fs / "data"
    code = cli.main(["prepare", "--corpus", f"tsv:{world['corpus']}", "--config", str(TINY),
                     "--out", str(out), "--set", "data.tokenizer=wordlevel"])
    line = one_error_line(capsys.readouterr().err)
    assert code == 2
    assert line.startswith(f"aiayn: error: no space left on {out}: the prepared data needs ~")
    assert line.endswith("free space or choose another --out")
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]


def test_export_stopped_by_a_full_disk_leaves_nothing(world, small_fs, monkeypatch, capsys):
    pytest.importorskip("transformers")
    from aiayn.export import command

    monkeypatch.setattr(command, "check_room", lambda *args: None)
    fill(small_fs, leave=64 << 10)
    out = small_fs / "new" / "hf"
    code = cli.main(["export", str(world["run"]), "--to", "hf", str(out)])
    line = one_error_line(capsys.readouterr().err)
    assert code == 2
    assert line.startswith(f"aiayn: error: no space left on {out}: the export needs ~")
    assert line.endswith("free space or choose another OUT_DIR")
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]


def test_average_and_evaluate_on_a_full_disk_are_one_line_and_write_nothing(aiayn, world, small_fs):
    fill(small_fs, leave=4 << 10)
    avg = small_fs / "avg.safetensors"
    result = aiayn("average", world["run"], "--last", "2", "-o", avg)
    line = one_error_line(result.stderr.decode())
    assert result.returncode == 2
    assert line.startswith(f"aiayn: error: no space left on {avg}: the weights file needs ~")
    assert line.endswith("free space or choose another -o")
    hyp = small_fs / "hyp.txt"
    (small_fs / "filler").unlink()
    fill(small_fs)
    result = aiayn("evaluate", world["run"], "--beam", "1", "--limit", "5", "-o", hyp)
    line = one_error_line(result.stderr.decode())
    assert result.returncode == 2
    assert line.startswith(f"aiayn: error: no space left on {hyp}")
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]


def test_the_metrics_log_and_a_plot_on_a_full_disk(aiayn, small_fs):
    from aiayn.runs.metrics import MetricsLog

    run = small_fs / "run"
    run.mkdir()
    metrics = MetricsLog(run, enabled=True)
    try:
        fill(small_fs)
        with pytest.raises(DiskError) as caught:
            metrics.write({"kind": "train", "step": 1, "loss": 2.5, "lr": 0.1})
    finally:
        metrics.close()
    assert caught.value.line("--out") == (f"no space left on {run / 'metrics.jsonl'}: writing "
                                          "the metrics log; free space or choose another --out")
    png = small_fs / "pe.png"
    result = aiayn("plot", "--pe", "-o", png)
    assert one_error_line(result.stderr.decode()) == (
        f"aiayn: error: no space left on {png}: writing the picture; free space or choose "
        "another -o")
    assert result.returncode == 2 and not png.exists()
    assert not [p for p in small_fs.rglob("*") if p.name.startswith(".")]


def test_a_read_only_filesystem_is_one_line_naming_the_file(aiayn, world, small_fs):
    if subprocess.run(["mount", "-o", "remount,ro", str(small_fs)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot remount the tmpfs read-only here")
    avg = small_fs / "avg.safetensors"
    result = aiayn("average", world["run"], "--last", "2", "-o", avg)
    assert result.returncode == 2
    assert one_error_line(result.stderr.decode()) == (
        f"aiayn: error: read-only filesystem writing {avg}: remount it writable or choose "
        "another -o")


def test_translate_on_a_full_disk_leaves_nothing_or_whole_chunks_to_resume(
        aiayn, world, small_fs, tmp_path, monkeypatch, capsys):
    from aiayn.inference.translator import Translator

    source = tmp_path / "in.txt"
    source.write_text("".join(f"the red cat {w}\n" for w in WORDS * 3), encoding="utf-8")
    argv = ["translate", str(world["run"]), "-i", str(source), "--beam", "1",
            "--chunk-lines", "10"]
    out = small_fs / "out.txt"
    filler = fill(small_fs)
    result = aiayn(*argv, "-o", out)
    assert result.returncode == 2
    assert one_error_line(result.stderr.decode()) == (
        f"aiayn: error: no space left on {out}: writing the translations; free space or "
        "choose another -o")
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]
    filler.unlink()

    real = Translator.translate_lines

    def full_after_the_first_chunk(self, *args, **kwargs):
        for i, text in enumerate(real(self, *args, **kwargs)):
            if i == 1:
                fill(small_fs)
            yield text

    monkeypatch.setattr(Translator, "translate_lines", full_after_the_first_chunk)
    assert cli.main([*argv, "-o", str(out)]) == 2
    monkeypatch.undo()
    line = one_error_line(capsys.readouterr().err)
    # (the last page of a file may still take a chunk: 10 or 20 lines are kept)
    kept = (small_fs / "out.txt.partial").read_text(encoding="utf-8").count("\n")
    assert kept in (10, 20) and line == (
        f"aiayn: error: no space left on {out}: writing the translations; {out}.partial keeps "
        f"the first {kept} of {3 * len(WORDS)} lines: free space, then the same command with "
        "--resume continues it")
    assert not out.exists()
    (small_fs / "filler").unlink()
    assert cli.main([*argv, "-o", str(out), "--resume"]) == 0
    assert cli.main([*argv, "-o", str(tmp_path / "whole.txt")]) == 0
    assert out.read_bytes() == (tmp_path / "whole.txt").read_bytes()
    assert sorted(p.name for p in small_fs.iterdir()) == ["out.txt"]
