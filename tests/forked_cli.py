"""`python -m aiayn ARGS` as a process of its own, without paying for `import torch` each time.

A test of the real command line needs a process per command (its exit status, what it writes
to stdout and stderr, a traceback if one escapes), and most of such a process's seconds go to
importing torch (~3 s of ~4 on a 2-core CI machine). ``ForkedCLI`` starts one Python that
imports ``aiayn.cli`` and the modules its commands load when they run (``COMMAND_MODULES``,
torch with them) once and then forks a child per command: the child
points its stdin, stdout and stderr at the command's files, changes to its directory and
runs ``aiayn/__main__.py`` as `python -m aiayn` does; an exception that escapes prints its
traceback and exits 1, as the interpreter does. What the import printed (a warning, say) is
put in front of every command's output, as a fresh process would print it. The server has
run no torch operation, so no thread pool is forked half-made.

It gives what ``subprocess.run`` gives (a ``CompletedProcess`` with bytes), for commands that
run under the server's environment; a command that needs another environment (a locale, a
variable) takes a real subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

_SERVER = r"""
import importlib, json, os, runpy, sys, traceback
import aiayn.cli
for name in sys.argv[1:]:  # the seconds a command would spend importing torch, once
    importlib.import_module(name)
sys.stdout.flush(); sys.stderr.flush()
requests, replies = os.fdopen(os.dup(0), "rb", buffering=0), os.dup(1)
os.write(replies, b"ready\n")
for line in requests:
    ask = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(replies)
            os.chdir(ask["cwd"])
            for fd, path, flags in ((0, ask["stdin"], os.O_RDONLY),
                                    (1, ask["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                    (2, ask["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
                opened = os.open(path, flags, 0o644)
                os.dup2(opened, fd)
                os.close(opened)
            sys.argv = ["aiayn", *ask["argv"]]
            try:
                runpy.run_module("aiayn", run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as exc:
                if exc.code is None or isinstance(exc.code, int):
                    code = exc.code or 0
                else:
                    print(exc.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
            sys.stdout.flush(); sys.stderr.flush()
        except BaseException:  # the redirection itself failed: say so where stderr now is
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    os.write(replies, (json.dumps(os.waitstatus_to_exitcode(status)) + "\n").encode())
"""


# The modules aiayn.cli's commands import when they run (aiayn.cli itself imports none of
# them, so that its parser answers without torch).
COMMAND_MODULES = ("aiayn.data.prepare", "aiayn.training.admission", "aiayn.training.loop",
                   "aiayn.training.transfer", "aiayn.inference.files", "aiayn.inference.scoring",
                   "aiayn.inference.translator", "aiayn.evaluation.evaluate",
                   "aiayn.export.command", "aiayn.inspect.doctor", "aiayn.inspect.info",
                   "aiayn.inspect.trace")


class ForkedCLI:
    """One server (see the module's docstring); ``run`` is safe from several threads, one
    command at a time (start one per thread that runs commands at once)."""

    def __init__(self, env: dict[str, str] | None = None, cwd: Path | None = None):
        self.cwd = Path(cwd or os.getcwd())
        self.files = Path(tempfile.mkdtemp(prefix="forked-cli-"))
        self.import_err = self.files / "import.err"
        with open(self.import_err, "wb") as err:
            # A session of its own: a command that hangs is killed with its server (and its
            # children) as one process group.
            self.server = subprocess.Popen([sys.executable, "-c", _SERVER, *COMMAND_MODULES],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=err, cwd=self.cwd, env=env,
                                           start_new_session=True)
        self.import_out = b""  # what the import printed: the lines before "ready"
        while (line := self.server.stdout.readline()) not in (b"ready\n", b""):
            self.import_out += line
        if not line:
            raise RuntimeError("the forked CLI's server did not start: "
                               + self.import_err.read_text(errors="replace"))
        self.lock, self.count, self.dead = threading.Lock(), 0, False

    def run(self, *args, stdin: bytes | None = None, cwd: Path | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
        with self.lock:
            self.count += 1
            paths = {name: self.files / f"{self.count}.{name}" for name in ("stdin", "stdout", "stderr")}
            paths["stdin"].write_bytes(stdin or b"")
            argv = [str(a) for a in args]
            ask = {"argv": argv, "cwd": str(cwd or self.cwd), **{k: str(v) for k, v in paths.items()}}
            self.server.stdin.write((json.dumps(ask) + "\n").encode())
            self.server.stdin.flush()
            try:
                reply = _read_line(self.server.stdout, timeout)
            except TimeoutError:  # as subprocess.run: the command is killed, then raised
                self.kill()
                raise subprocess.TimeoutExpired([sys.executable, "-m", "aiayn", *argv],
                                                timeout) from None
            out, err = paths["stdout"].read_bytes(), paths["stderr"].read_bytes()
            for path in paths.values():
                path.unlink()
        return subprocess.CompletedProcess(
            [sys.executable, "-m", "aiayn", *argv], json.loads(reply),
            self.import_out + out, self.import_err.read_bytes() + err)

    def kill(self) -> None:
        """The server, its command and that command's children, at once."""
        self.dead = True
        try:
            os.killpg(self.server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.server.wait()

    def close(self) -> None:
        try:
            if not self.dead:
                self.server.stdin.close()
                try:
                    self.server.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.kill()
        finally:
            shutil.rmtree(self.files, ignore_errors=True)


def _read_line(stream, timeout: float) -> bytes:
    """A line from ``stream``, or TimeoutError after ``timeout`` seconds (a hung command)."""
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not got or not got[0]:
        raise TimeoutError(f"a forked aiayn command gave no exit status within {timeout} s")
    return got[0]


class ForkedCLIs:
    """As many ``ForkedCLI`` servers as commands run at once: ``run`` takes an idle one, or
    starts one when all are busy."""

    def __init__(self, env: dict[str, str] | None = None, cwd: Path | None = None):
        self.env, self.cwd = env, cwd
        self.idle: list[ForkedCLI] = []
        self.all: list[ForkedCLI] = []
        self.lock = threading.Lock()

    def run(self, *args, **kwargs) -> subprocess.CompletedProcess:
        with self.lock:
            server = self.idle.pop() if self.idle else None
        if server is None:
            server = ForkedCLI(self.env, self.cwd)
            with self.lock:
                self.all.append(server)
        try:
            return server.run(*args, **kwargs)
        finally:
            if not server.dead:  # one whose command hung was killed: never used again
                with self.lock:
                    self.idle.append(server)

    def close(self) -> None:
        for server in self.all:
            try:
                server.close()
            except Exception:  # noqa: BLE001 (close the others whatever this one did)
                server.kill()
