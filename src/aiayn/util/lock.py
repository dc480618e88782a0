"""One writer per directory: an advisory lock held for a whole command.

``aiayn train`` holds its run directory exclusively, ``aiayn prepare`` its output
directory; a training run also holds its prepared data directory *shared*, so that
``prepare --force`` cannot replace the data under it. A second writer is refused at once
with a line that names the holder's pid. Readers (translate, evaluate) take no lock: every
file they read is written atomically (aiayn.util.io).

On Linux and macOS the lock is ``flock`` on the directory itself, so it creates nothing a
failed command would leave behind, and the kernel releases it when the process dies (even
by kill -9). While it is held, ``DIR/.lock`` names the holder's pid for the message; the
file goes when the lock is released (a stale one after a kill is overwritten by the next
holder).

``hold_file`` holds one open file the same way (`aiayn translate -o OUT` its OUT.partial:
one writer per output, not per directory).

Where there is no ``fcntl`` (Windows), the lock is the files themselves: a writer creates
``DIR/.lock`` (exclusively: ``O_EXCL``), a reader ``DIR/.lock.shared.PID.N``; each creates
its own file first and then looks for the others' (so of two that start together, at least
one sees the other and steps back), and a file whose process is gone is stale and taken
over, so a killed command blocks nobody.
"""

from __future__ import annotations

import errno
import itertools
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from aiayn.errors import AiaynError

try:
    import fcntl
except ImportError:  # Windows: the lock files below
    fcntl = None

PID_FILE = ".lock"
SHARED_PREFIX = ".lock.shared."
_numbers = itertools.count()  # several shared holds of one process each have their own file


def holder(directory: Path) -> str:
    """Who holds the lock, as the .lock file says ("pid 1234 (aiayn train)"), or "another process"."""
    try:
        text = (directory / PID_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        return "another process"
    return text or "another process"


@contextmanager
def locked(directory: str | Path, what: str, shared: bool = False) -> Iterator[None]:
    """Hold ``directory`` (which must exist) for the ``with`` block: exclusively (a writer)
    or shared (a reader that must not see it replaced). ``what`` names the command for the
    refusal message of others, e.g. "aiayn train"."""
    directory = Path(directory)
    if fcntl is None:
        with _locked_by_files(directory, what, shared):
            yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise AiaynError(f"{directory} is in use by {holder(directory)}; wait for it to "
                             "finish (or stop it) and try again") from None
        if not shared:
            _write_pid(directory, what)
        try:
            yield
        finally:
            if not shared:
                (directory / PID_FILE).unlink(missing_ok=True)
    finally:
        os.close(fd)  # releases the flock


def in_use(directory: str | Path) -> str | None:
    """Who holds ``directory`` exclusively right now ("pid 1234 (aiayn train)"), or None:
    for a reader that must say its files are changing under it (``aiayn doctor`` on a run
    still training). Takes nothing: a shared hold is tried and let go at once."""
    directory = Path(directory)
    if fcntl is None:
        return holder(directory) if _live_holder(directory / PID_FILE) else None
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        return holder(directory)
    finally:
        os.close(fd)  # releases the shared hold, if taken
    return None


def _write_pid(directory: Path, what: str) -> None:
    """The holder's line, for others' refusal messages only: on a full disk it is left out
    (the lock is held all the same; the command's own writes report the disk)."""
    tmp = directory / f"{PID_FILE}.{os.getpid()}"
    try:
        tmp.write_text(f"pid {os.getpid()} ({what})\n", encoding="utf-8")
        os.replace(tmp, directory / PID_FILE)
    except OSError:
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------- without fcntl
def _refuse(directory: Path, who: str) -> AiaynError:
    return AiaynError(f"{directory} is in use by {who}; wait for it to finish (or stop it) "
                      "and try again")


@contextmanager
def _locked_by_files(directory: Path, what: str, shared: bool) -> Iterator[None]:
    """``locked`` where ``flock`` does not exist (see the module's docstring)."""
    line = f"pid {os.getpid()} ({what})\n"
    exclusive = directory / PID_FILE
    if shared:
        mine = directory / f"{SHARED_PREFIX}{os.getpid()}.{next(_numbers)}"
        _create(mine, line)
        if _live_holder(exclusive):
            mine.unlink(missing_ok=True)
            raise _refuse(directory, holder(directory))
    else:
        mine = exclusive
        if not _create(exclusive, line):
            if _live_holder(exclusive):
                raise _refuse(directory, holder(directory))
            exclusive.unlink(missing_ok=True)  # its process is gone: a stale lock
            if not _create(exclusive, line):  # another took it over first
                raise _refuse(directory, holder(directory))
        readers = [path for path in directory.glob(f"{SHARED_PREFIX}*") if _live_holder(path)]
        if readers:
            exclusive.unlink(missing_ok=True)
            raise _refuse(directory, _read_line(readers[0]) or "another process")
    try:
        yield
    finally:
        mine.unlink(missing_ok=True)


def _create(path: Path, line: str) -> bool:
    """Create ``path`` holding ``line``; False when it exists already."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, line.encode("utf-8"))
    except OSError:  # a full disk: no half-made lock left behind
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return True


def _read_line(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError:
        return ""


def _live_holder(path: Path) -> bool:
    """Whether the lock file ``path`` belongs to a running process; a stale one (its process
    gone) is removed. A file being written (no pid yet) counts as held, for a few seconds
    (one left empty by a kill at that moment is stale after them)."""
    text = _read_line(path)
    try:
        age = time.time() - path.stat().st_mtime
    except OSError:  # gone meanwhile: released
        return False
    parts = text.split()
    if len(parts) >= 2 and parts[0] == "pid" and parts[1].isdigit():
        if process_alive(int(parts[1])):
            return True
    elif age < 10:
        return True
    path.unlink(missing_ok=True)
    return False


def process_alive(pid: int) -> bool:
    """Whether a process with this pid runs (on this machine)."""
    if pid == os.getpid():
        return True
    if os.name == "nt":
        return _windows_process_alive(pid)
    try:
        os.kill(pid, 0)  # signal 0: nothing is sent, only whether it could be
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it runs, as another user
        return True
    return True


def _windows_process_alive(pid: int) -> bool:
    """OpenProcess and GetExitCodeProcess (os.kill on Windows would terminate it)."""
    import ctypes

    kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined]
    handle = kernel32.OpenProcess(0x1000, False, pid)  # PROCESS_QUERY_LIMITED_INFORMATION
    if not handle:
        return ctypes.get_last_error() == 5  # ERROR_ACCESS_DENIED: it exists
    try:
        code = ctypes.c_ulong()
        return bool(kernel32.GetExitCodeProcess(handle, ctypes.byref(code))) and code.value == 259
    finally:
        kernel32.CloseHandle(handle)  # 259: STILL_ACTIVE


def hold_file(fd: int) -> bool:
    """Hold the open file ``fd`` exclusively (``flock``: the kernel lets go when the process
    dies, even by kill -9, or when ``fd`` is closed); False when another process holds it.
    Where there is no ``fcntl`` it holds nothing and says True: the caller then asks
    whether the writer it recorded still runs (``process_alive``)."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        return False
    return True
