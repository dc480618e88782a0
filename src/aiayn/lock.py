"""One writer per directory: an advisory lock held for a whole command.

``aiayn train`` holds its run directory exclusively, ``aiayn prepare`` its output
directory; a training run also holds its prepared data directory *shared*, so that
``prepare --force`` cannot replace the data under it. A second writer is refused at once
with a line that names the holder's pid. Readers (translate, evaluate) take no lock: every
file they read is written atomically (aiayn.io).

The lock is ``flock`` on the directory itself, so it creates nothing a failed command
would leave behind, and the kernel releases it when the process dies (even by kill -9).
While it is held, ``DIR/.lock`` names the holder's pid for the message; the file goes
when the lock is released (a stale one after a kill is overwritten by the next holder).
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from aiayn.errors import AiaynError

PID_FILE = ".lock"


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


def _write_pid(directory: Path, what: str) -> None:
    """The holder's line, for others' refusal messages only: on a full disk it is left out
    (the lock is held all the same; the command's own writes report the disk)."""
    tmp = directory / f"{PID_FILE}.{os.getpid()}"
    try:
        tmp.write_text(f"pid {os.getpid()} ({what})\n", encoding="utf-8")
        os.replace(tmp, directory / PID_FILE)
    except OSError:
        tmp.unlink(missing_ok=True)
