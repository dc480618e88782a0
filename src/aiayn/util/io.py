"""The one place files are written: atomically, so that a crash never leaves half a file.

A file is written to a temporary file in the same directory, flushed and fsync'ed, then
renamed over the target (``os.replace`` is atomic on POSIX), then the directory is
fsync'ed. A kill at any moment leaves either the old file or the new one.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from aiayn.errors import AiaynError

# The errors of a write that the user fixes on their side (space, quota, mount, permissions),
# and what each says.
DISK_ERRORS = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded",
               errno.EROFS: "read-only filesystem", errno.EACCES: "permission denied",
               errno.EPERM: "operation not permitted"}


class DiskError(AiaynError):
    """A write refused by the filesystem (``DISK_ERRORS``): the path, what it needed and
    the fix, as one line. ``line(option)`` names the option that chooses another place
    (the CLI knows it: --out, -o, OUT_DIR); ``str()`` says "another location"."""

    def __init__(self, code: int, path: str | Path, need: int | None = None,
                 what: str = "the file", free: int | None = None):
        self.code, self.path, self.need, self.what = code, Path(path), need, what
        self.free = free  # set by check_room: refused before anything was written
        super().__init__(self.line())

    def line(self, option: str | None = None, fix: str | None = None) -> str:
        where = f"choose another {option}" if option else "write to another location"
        if self.free is not None:
            return (f"not enough space on {self.path}: {self.what} needs ~"
                    f"{human_size(self.need or 0)}, {human_size(self.free)} free; "
                    f"{fix or f'free space or {where}'}")
        if self.code in (errno.ENOSPC, errno.EDQUOT):
            need = f"{self.what} needs ~{human_size(self.need)}" if self.need else \
                f"writing {self.what}"
            fix = fix or f"free space or {where}"
            return f"{DISK_ERRORS[self.code]} on {self.path}: {need}; {fix}"
        fix = fix or (f"check its permissions or {where}" if self.code in
                      (errno.EACCES, errno.EPERM) else f"remount it writable or {where}")
        return f"{DISK_ERRORS[self.code]} writing {self.path}: {fix}"


def human_size(n: int) -> str:
    """1234567 -> "1.2 MB" (decimal units, as df -H and file managers show them)."""
    value = float(n)
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def as_disk_error(exc: BaseException, path: str | Path | None = None,
                  need: int | None = None, what: str = "the file") -> DiskError | None:
    """The DiskError for an OSError of ``DISK_ERRORS`` (or a library's error that carries
    one as "(os error 28)", as safetensors' Rust writer does) about ``path`` (or a file in
    it, or its temporary ``.NAME.*`` sibling); None for anything else, e.g. a file read
    elsewhere. Without ``path``: the file the error names."""
    if isinstance(exc, DiskError):
        return exc
    code, filename = getattr(exc, "errno", None), getattr(exc, "filename", None)
    if not isinstance(exc, OSError):
        found = re.search(r"\(os error (\d+)\)", str(exc))
        code, filename = (int(found.group(1)), None) if found else (None, None)
    if code not in DISK_ERRORS:
        return None
    if path is not None and filename is not None and not _concerns(Path(filename), Path(path)):
        return None
    return DiskError(code, path if path is not None else (filename or "a file"), need, what)


def _concerns(filename: Path, path: Path) -> bool:
    """``filename`` is ``path``, inside it, or inside a temporary ``.NAME.*`` beside it."""
    for part in (filename, *filename.parents):
        if part == path or (part.parent == path.parent and part.name.startswith(f".{path.name}.")):
            return True
    return False


def check_room(path: str | Path, need: int, what: str) -> None:
    """Refuse (one DiskError) before a long job when the filesystem that will hold ``path``
    has less than ``need`` bytes free (an estimate of what the job writes, so that its
    last file does not fail after hours of work; the writes still report a full disk)."""
    path = Path(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        return  # cannot tell: the writes themselves report a full disk
    if free < need:
        raise DiskError(errno.ENOSPC, path, need, what, free=free)


@contextmanager
def disk_errors(path: str | Path | None = None, need: int | None = None,
                what: str = "the file") -> Iterator[None]:
    """Turn a full disk, a quota, a read-only mount or a permission error of a write to
    ``path`` raised inside into one DiskError naming ``path`` (see ``as_disk_error``)."""
    try:
        yield
    except Exception as exc:
        error = as_disk_error(exc, path, need, what)
        if error is None:
            raise
        raise error from None


@contextmanager
def atomic_path(path: str | Path, need: int | None = None,
                what: str = "the file") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success, fsync it and rename it over ``path``.

    A write the filesystem refuses (``DISK_ERRORS``) is one DiskError naming ``path`` and
    ``need`` (bytes, when the caller knows it); the old file stays as it was and the
    temporary one goes.
    """
    path = Path(path)
    if path.is_dir():  # else os.replace fails at the end, naming the temporary file
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    with disk_errors(path, need, what):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            yield tmp
            # mkstemp makes 0600, and a writer that replaces the path (safetensors' does)
            # keeps that: give the file the umask's mode, as any other file, so that a
            # service user other than the trainer can read the weights.
            os.chmod(tmp, 0o666 & ~_umask())
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, path)
            _fsync_dir(path.parent)
        finally:
            tmp.unlink(missing_ok=True)


@contextmanager
def interrupt_deferred() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that comes during the block until the block is done, then
    deliver it as it would have come. For torch.save through a Python file: a Ctrl-C inside
    one of its writes surfaces as a RuntimeError ("unexpected pos ..."), not as the
    KeyboardInterrupt that says where to resume. Outside the main thread, or where SIGINT's
    handler was not set from Python, the block runs as it is (there is nothing to hold)."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is None:
        yield
        return
    came: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if came:
            signal.raise_signal(signal.SIGINT)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some filesystems do not allow opening directories
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_path(path, need=len(text.encode("utf-8"))) as tmp:
        tmp.write_text(text, encoding="utf-8")


def remove_temp_files(directory: str | Path) -> list[Path]:
    """Delete what an interrupted atomic write leaves behind (``.NAME.*.tmp`` files, and
    ``.NAME.tmp`` directories of a copy); returns what was removed. Call it only while
    holding the directory's lock (aiayn.util.lock), so no running writer's file is removed."""
    removed = []
    directory = Path(directory)
    if not directory.is_dir():
        return removed
    for path in directory.rglob(".*.tmp"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def check_writable_dir(path: str | Path, option: str) -> Path:
    """``path`` may become a directory: it is one, or it does not exist yet and its nearest
    existing parent is a directory. Otherwise one AiaynError naming ``option``."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise AiaynError(f"{option} {path}: exists and is not a directory")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise AiaynError(f"{option} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK):
        raise AiaynError(f"{option} {path}: {parent} is not writable")
    return path


def check_output_file(path: str | Path, option: str,
                      inputs: dict[str, str | Path | None] | None = None,
                      make_dirs: bool = False) -> Path:
    """``path`` can be written as a file (it is not a directory; its directory exists, or
    with ``make_dirs``, as ``atomic_path`` makes it, no file stands in its way) and is none
    of the command's ``inputs`` (option -> file; None: not given), which writing it would
    replace before or while they are read. Called before the work, so that a command
    does not fail at its end."""
    path = Path(path)
    if path.is_dir():
        raise AiaynError(f"{option} {path}: is a directory, not a file")
    if make_dirs:
        parent = path.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir():
            raise AiaynError(f"{option} {path}: {parent} is not a directory")
    elif not path.parent.is_dir():
        raise AiaynError(f"{option} {path}: directory {path.parent} does not exist")
    for name, given in (inputs or {}).items():
        if given is not None and path.exists() and Path(given).exists() \
                and os.path.samefile(path, given):
            raise AiaynError(f"{option} {path}: is the file {name} reads; writing it would "
                             f"replace the input: choose another {option}")
    return path


STAGING_DIR = ".staging.tmp"


@contextmanager
def staged_directory(out: str | Path, force: bool, what: str, marker: str,
                     need: int | None = None) -> Iterator[Path]:
    """Write a directory's new contents in a staging directory, then swap them in.

    ``out`` must be empty, missing, or ``force`` given; it is locked (aiayn.util.lock) for the
    whole block, so a second writer, or one replacing a directory a training run reads, is
    refused. The block writes into the yielded staging directory (inside ``out``, so the
    lock covers it). On success the old entries go and the new ones are moved in, ``marker``
    (the file that says "complete", e.g. stats.json) removed first and moved in last: a
    kill during the swap leaves a directory without its marker, which readers refuse; a
    kill before it leaves the old contents untouched (and a staging directory that the
    next writer removes). A failure leaves ``out`` as it was (a directory created here is
    removed again); a full disk (``need``: the bytes expected, when known) is one DiskError.
    """
    from aiayn.util.lock import PID_FILE, locked  # aiayn.util.lock imports nothing of ours but errors

    out = check_writable_dir(out, "--out")
    created = missing_dirs(out)  # out and the parents this command makes (data/)
    if not created and not force:
        entries = [p.name for p in out.iterdir() if p.name not in (PID_FILE, STAGING_DIR)]
        if entries:
            raise AiaynError(f"--out {out}: not empty (holds {', '.join(sorted(entries)[:4])}"
                             f"{', ...' if len(entries) > 4 else ''}); choose another "
                             "directory, or give --force to replace its contents")
    with disk_errors(out, need, "the prepared data"):
        out.mkdir(parents=True, exist_ok=True)
    try:
        with locked(out, what), disk_errors(out, need, "the prepared data"):
            remove_temp_files(out)
            stage = out / STAGING_DIR
            stage.mkdir()
            try:
                yield stage
                (out / marker).unlink(missing_ok=True)
                for old in out.iterdir():
                    if old.name in (PID_FILE, STAGING_DIR):
                        continue
                    shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
                for new in sorted(stage.iterdir(), key=lambda p: p.name == marker):
                    os.replace(new, out / new.name)
                _fsync_dir(out)
            finally:
                shutil.rmtree(stage, ignore_errors=True)
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)
            remove_empty_dirs(created[1:])
        raise


@contextmanager
def atomic_directory(path: str | Path, need: int | None = None,
                     what: str = "the directory") -> Iterator[Path]:
    """Yield a new temporary directory beside ``path``; on success, rename it to ``path``.

    ``path`` must not exist or be an empty directory (``os.replace`` of a directory onto an
    empty one is atomic on POSIX). On failure the temporary directory is removed, so a crash
    or an error leaves either nothing or the whole directory (parents created here are
    removed too); a full disk (``need``: the bytes expected) is one DiskError.
    """
    path = Path(path)
    created = missing_dirs(path)[1:]
    try:
        with disk_errors(path, need, what):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
            try:
                os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700: the usual mode
                yield tmp
                _usual_file_modes(tmp)
                if os.name == "nt" and path.is_dir():  # Windows renames onto no directory,
                    path.rmdir()  # even an empty one (this one is: see above)
                os.replace(tmp, path)
                _fsync_dir(path.parent)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        remove_empty_dirs(created)
        raise


def _usual_file_modes(directory: Path) -> None:
    """Give every file under ``directory`` the umask's mode, as any other file: a library
    that writes through a temporary file of its own (safetensors' writer, which
    Transformers' save_pretrained uses) leaves 0600, which other users cannot read."""
    mode = 0o666 & ~_umask()
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


def missing_dirs(path: str | Path) -> list[Path]:
    """``path`` and its parents that do not exist yet, innermost first: what a command that
    creates ``path`` makes, and removes again if it fails (``remove_empty_dirs``)."""
    missing = []
    for folder in (Path(path), *Path(path).parents):
        if folder.exists():
            break
        missing.append(folder)
    return missing


def remove_empty_dirs(folders: list[Path]) -> None:
    """Remove ``folders`` (innermost first, from ``missing_dirs``) while they are empty: a
    failed command leaves no folder it made, and nothing someone else wrote meanwhile."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            break
