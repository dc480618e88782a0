"""Windows and macOS without a Windows or a Mac: the CLI runs where there is no ``fcntl``
(its locks are then files) and no ``fork`` (serve's lanes spawn), and ``--device`` knows
Apple's MPS."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from cjk_corpus import write_tsv

from aiayn.errors import AiaynError
from aiayn.util import device, lock
from aiayn.util.lock import PID_FILE, SHARED_PREFIX, locked

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"

# Imported by every Python process started with this directory first on its path (spawned
# lanes too): no fcntl, no os.fork, no "fork"/"forkserver" start method, as on Windows.
SITECUSTOMIZE = textwrap.dedent("""\
    import multiprocessing.context, os, sys
    # sacreBLEU's portalocker takes fcntl on POSIX and msvcrt on Windows: it keeps its own.
    import portalocker
    sys.modules["fcntl"] = None  # any later import fcntl raises ImportError
    for name in ("fork", "forkpty"):
        if hasattr(os, name):
            delattr(os, name)
    multiprocessing.set_start_method("spawn", force=True)  # the default where fork is not
    for name in ("fork", "forkserver"):
        multiprocessing.context._concrete_contexts.pop(name, None)
    """)


def windowsish(tmp_path: Path) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT / "src")])}


def run(env, *args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, **kwargs)


@pytest.fixture
def no_fcntl(monkeypatch):
    monkeypatch.setattr(lock, "fcntl", None)


def lock_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(PID_FILE))


def test_lock_files_admit_one_writer_or_many_readers(no_fcntl, tmp_path):
    with locked(tmp_path, "aiayn train"):
        assert (tmp_path / PID_FILE).read_text() == f"pid {os.getpid()} (aiayn train)\n"
        for shared in (False, True):
            with pytest.raises(AiaynError, match=f"is in use by pid {os.getpid()} \\(aiayn train\\)"):
                with locked(tmp_path, "aiayn prepare", shared=shared):
                    pass
    assert lock_files(tmp_path) == []
    with locked(tmp_path, "aiayn train", shared=True), locked(tmp_path, "aiayn train", shared=True):
        assert len(lock_files(tmp_path)) == 2
        with pytest.raises(AiaynError, match="is in use by pid"):
            with locked(tmp_path, "aiayn prepare"):
                pass
        assert not (tmp_path / PID_FILE).exists()  # the refused writer left nothing
    assert lock_files(tmp_path) == []


def test_a_lock_file_of_a_process_gone_is_taken_over(no_fcntl, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    (tmp_path / PID_FILE).write_text(f"pid {dead} (aiayn train)\n")
    (tmp_path / f"{SHARED_PREFIX}{dead}.0").write_text(f"pid {dead} (aiayn train)\n")
    with locked(tmp_path, "aiayn prepare"):
        assert lock_files(tmp_path) == [PID_FILE]
    assert lock_files(tmp_path) == []


@pytest.mark.slow  # eight processes that each import torch: a minute on 2 busy cores
def test_the_cli_runs_without_fcntl_and_fork(tmp_path):
    """prepare, train, and serve's lanes in processes with neither; a second writer
    is refused while a first holds the run, and takes it once that one is killed."""
    env = windowsish(tmp_path)
    corpus, data, run_dir = write_tsv(tmp_path / "enzh.tsv", "zh"), tmp_path / "data", tmp_path / "run"
    for args in (("prepare", "--corpus", f"tsv:{corpus}", "--out", data, "--config", TINY),
                 ("train", "--config", TINY, "--data", data, "--out", run_dir,
                  "--set", "train.max_steps=4", "--set", "train.eval_every=4")):
        result = run(env, "-m", "aiayn", *args)
        assert result.returncode == 0, result.stderr

    # serve's lanes: two processes, spawned, answer as the translator does alone.
    script = textwrap.dedent(f"""\
        import asyncio, json, os
        import aiayn.util.lock
        from aiayn.serving.service import ModelService
        service = ModelService.from_run({str(run_dir)!r}, lanes="processes")
        try:
            texts = ["I read a book.", "She likes green tea every day."]
            search = service.resolve(beam=1, alpha=0.6)
            served = asyncio.run(service.translate(texts, search))["translations"]
            alone = service.translator.translate(texts, search)
            print(json.dumps([aiayn.util.lock.fcntl is None, hasattr(os, "fork"),
                              service.stats()["lanes"], served == alone]))
        finally:
            service.close()
        """)
    result = run(env, "-c", script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[true, false, 2, true]", result.stdout

    holder = subprocess.Popen(
        [sys.executable, "-c", f"from aiayn.util.lock import locked\nimport sys\n"
         f"with locked({str(run_dir)!r}, 'aiayn train'):\n    print('held', flush=True)\n"
         "    sys.stdin.read()"], cwd=ROOT, env=env, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        again = run(env, "-m", "aiayn", "train", "--resume", run_dir,
                    "--set", "train.max_steps=6")
        assert again.returncode != 0
        assert f"{run_dir} is in use by pid {holder.pid} (aiayn train)" in again.stderr
    finally:
        holder.send_signal(signal.SIGKILL)  # no release: its lock file stays, stale
        holder.wait()
    assert (run_dir / PID_FILE).exists()
    again = run(env, "-m", "aiayn", "train", "--resume", run_dir, "--set", "train.max_steps=6")
    assert again.returncode == 0, again.stderr
    assert lock_files(run_dir) == []


def test_device_auto_takes_mps_where_the_model_runs_on_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for works in (True, False):
        monkeypatch.setattr(device, "_probe_mps", lambda works=works: works)
        assert device.choose_device("auto") == torch.device("mps" if works else "cpu")
    with pytest.raises(AiaynError, match="--device mps: no Apple-silicon GPU"):
        device.choose_device("mps")
    with pytest.raises(AiaynError, match="--device must be one of auto, cpu, cuda, mps"):
        device.choose_device("tpu")
    assert device.resolve_bf16("auto", torch.device("mps"))[0] is False


def test_the_mps_probe_says_no_where_there_is_no_mps(monkeypatch):
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    device._probe_mps.cache_clear()  # a test before may have replaced its answer
    assert device.mps_usable() is False
    assert device.physical_memory() > 0
