"""Translating a file of any length: `aiayn translate -i IN -o OUT`, resumable.

The input is read twice, lazily, so memory stays flat in the file's length: a first cheap
pass (``scan_input``) checks that it is UTF-8 text (a bad byte is one error line with its
line number, before anything is written), counts its lines for the progress bar and hashes
it (the input's identity for ``--resume``); the second feeds ``Translator.translate_lines``,
whose output comes a chunk of input lines at a time.

Each chunk is appended to ``OUT.partial`` as soon as it is done (flushed and fsync'ed), and
then the sidecar ``OUT.partial.json`` (written atomically) records how many input lines,
input bytes and output bytes are complete and what the run is (``Job.settings``: the run
directory, the weights file, engine, device, decoding budget, the resolved search with its
sampling seed, the chunk size, the translator's modes, and the input's path, size and
SHA-256). At the end ``OUT.partial`` is renamed to ``OUT`` (atomic) and the sidecar goes.

After a kill, even ``kill -9`` in the middle of a write, ``--resume`` truncates
``OUT.partial`` to the bytes recorded, seeks the input to the line recorded and goes on
with the same chunks from the file's start, so the output is byte-identical to that of an
uninterrupted run. An error that stops the run (a full disk, Ctrl-C) leaves the same state:
whole chunks and their record; one that stops it before any chunk is done leaves nothing.

One writer per output: the writer holds an exclusive ``flock`` on ``OUT.partial`` (the
kernel releases it when the process dies, as aiayn.util.lock's directory locks), so a
second translate to the same ``-o`` is refused in one line naming the holder's pid.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from aiayn.errors import AiaynError
from aiayn.inference.lines import read_lines, scan_input
from aiayn.inference.settings import Search
from aiayn.options import CHUNK_LINES
from aiayn.runs.directory import resolve_weights
from aiayn.util.io import DiskError, as_disk_error, atomic_write_text
from aiayn.util.lock import hold_file, process_alive
from aiayn.util.progress import bar

SIDECAR_VERSION = 1


def translate_file(translator, source: str | Path, search: Search, chunk: int = CHUNK_LINES,
                   progress: bool = True, **modes) -> Iterator[str]:
    """``translate_lines`` over a file checked first (``scan_input``: nothing comes out of
    a file that is not all UTF-8) and read lazily, with a progress bar of its lines."""
    found = scan_input(source)
    lines = read_lines(found.path, end=found.size)
    counter = bar(enabled=progress, desc="translating", total=found.lines, unit=" sentences")
    done = 0
    try:
        for text in translator.translate_lines(lines, search=search, chunk=chunk, **modes,
                                               **_per_batch(translator, counter)):
            yield text
            done = min(done + chunk, found.lines)
            counter.update(done - counter.n)
    finally:
        counter.close()


# ---------------------------------------------------------------- the job
class Job:
    """One `aiayn translate -i IN -o OUT` (``resume``: go on with ``OUT.partial``).

    Built before the model loads: it checks the input, and what ``OUT.partial`` says
    (refusals change nothing on disk); ``search`` is the search to run (on resume with a
    seed drawn at random, the partial run's seed). ``run(translator)`` writes."""

    def __init__(self, source: str | Path, output: str | Path, search: Search, *,
                 run: dict, chunk: int = CHUNK_LINES, resume: bool = False,
                 seed_given: bool = True, modes: dict | None = None):
        if chunk < 1:
            raise AiaynError(f"--chunk-lines must be at least 1, got {chunk}")
        self.output, self.chunk, self.modes = Path(output), chunk, dict(modes or {})
        self.partial = self.output.with_name(self.output.name + ".partial")
        self.sidecar = self.output.with_name(self.output.name + ".partial.json")
        self.input = scan_input(source)
        self.run_identity = run
        self.done = {"lines": 0, "input_bytes": 0, "output_bytes": 0}
        self.resume = resume
        if self.partial.exists():
            self._refuse_if_in_use()
            if not resume:
                raise AiaynError(f"-o {self.output}: {self.partial} is left by an interrupted "
                                 f"translate ({self._lines_said()}); --resume continues it, "
                                 "or delete it to start again")
            recorded = self._read_sidecar()
            self.search = search = self._recorded_seed(search, recorded, seed_given)
            self._check_same(recorded)
            self.done = {key: int(recorded["done"][key]) for key in self.done}
        elif resume:
            raise AiaynError(f"--resume: nothing to resume for -o {self.output} (no "
                             f"{self.partial}); run without --resume")
        self.search = search

    # ------------------------------------------------------------ what the run is
    def settings(self) -> dict:
        """Everything the output depends on, as the sidecar records it."""
        return {"run": self.run_identity, "search": _search_record(self.search),
                "chunk_lines": self.chunk,
                "modes": json.loads(json.dumps(self.modes, default=repr, sort_keys=True)),
                "input": self.input.identity()}

    def _read_sidecar(self) -> dict:
        try:
            recorded = json.loads(self.sidecar.read_text(encoding="utf-8"))
            if recorded.get("version") != SIDECAR_VERSION or not all(
                    int(recorded["done"][key]) >= 0 for key in self.done):
                raise ValueError("not a record of this version")
            return recorded
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise AiaynError(f"--resume: {self.sidecar} is missing or unreadable, so "
                             f"{self.partial} cannot be continued; delete both to start "
                             "again") from None

    @staticmethod
    def _recorded_seed(search: Search, recorded: dict, seed_given: bool) -> Search:
        """The partial run's sampling seed where none was given: drawn at random, it is
        no setting of this run's but the other's (its samples must go on the same)."""
        seed = (recorded.get("settings", {}).get("search", {}).get("sampling") or {}).get("seed")
        if search.sampling is None or seed_given or not isinstance(seed, int):
            return search
        return dataclasses.replace(search, sampling=dataclasses.replace(search.sampling,
                                                                          seed=seed))

    def _check_same(self, recorded: dict) -> None:
        """Refuse to continue what another run, search or input wrote (say which)."""
        before, now = recorded.get("settings", {}), self.settings()
        for part, what in (("input", "the input differs"), ("run", "the model differs"),
                           ("search", "the search differs"),
                           ("chunk_lines", "--chunk-lines differs"),
                           ("modes", "the output's options differ")):
            if before.get(part) == now[part]:
                continue
            differs = _difference(before.get(part), now[part])
            raise AiaynError(f"--resume: {what} from the interrupted run's "
                             f"({differs}); give the same ones, or delete {self.partial} "
                             "to start again")

    def _refuse_if_in_use(self) -> None:
        try:
            fd = os.open(self.partial, os.O_RDONLY)
        except OSError:
            return
        try:
            if not hold_file(fd) or self._writer_alive():
                raise self._in_use()
        finally:
            os.close(fd)  # releases the hold, if taken

    def _writer_alive(self) -> bool:
        """Without flock (Windows) the sidecar's pid says whether its writer still runs."""
        from aiayn.util.lock import fcntl

        if fcntl is not None:
            return False
        pid = self._sidecar_pid()
        return pid is not None and pid != os.getpid() and process_alive(pid)

    def _sidecar_pid(self) -> int | None:
        try:
            pid = json.loads(self.sidecar.read_text(encoding="utf-8")).get("pid")
        except (OSError, ValueError, AttributeError):
            return None
        return pid if isinstance(pid, int) else None

    def _in_use(self) -> AiaynError:
        pid = self._sidecar_pid()
        who = f"pid {pid} (aiayn translate)" if pid else "another aiayn translate"
        return AiaynError(f"-o {self.output} is in use by {who}, writing {self.partial}; wait "
                          "for it to finish (or stop it) and try again")

    def _lines_said(self) -> str:
        try:
            lines = int(json.loads(self.sidecar.read_text(encoding="utf-8"))["done"]["lines"])
        except (OSError, ValueError, KeyError, TypeError):
            return "its record is missing"
        return f"{lines:,} of {self.input.lines:,} lines done"

    # ------------------------------------------------------------ writing
    def run(self, translator, progress: bool = True) -> None:
        """Translate what is left into ``OUT.partial``, chunk by chunk, then rename it."""
        fd = self._open_partial()
        try:
            try:
                self._write_chunks(translator, fd, progress)
            except BaseException as exc:
                self._stopped(fd, exc)
                raise
            os.fsync(fd)
            try:
                os.replace(self.partial, self.output)
            except OSError as exc:
                raise self._disk_error(exc) or exc from None
            _fsync_dir(self.output.parent)
            self.sidecar.unlink(missing_ok=True)
        finally:
            os.close(fd)  # releases the lock, after the rename

    def _open_partial(self) -> int:
        """Open ``OUT.partial`` (new, or to resume: cut to the bytes recorded) and hold it."""
        try:
            if self.resume:
                fd = os.open(self.partial, os.O_RDWR)
            else:
                fd = os.open(self.partial, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:  # another translate began it since the checks
            raise self._in_use() from None
        except FileNotFoundError:  # the partial run's file is gone since the checks
            raise AiaynError(f"--resume: {self.partial} is gone; run without --resume") from None
        except OSError as exc:
            raise self._disk_error(exc) or exc from None
        if not hold_file(fd):
            os.close(fd)
            raise self._in_use()
        size = os.fstat(fd).st_size
        if size < self.done["output_bytes"]:
            os.close(fd)
            raise AiaynError(f"--resume: {self.partial} holds {size} bytes, fewer than the "
                             f"{self.done['output_bytes']} recorded in {self.sidecar}; "
                             "delete both to start again")
        try:
            if self.resume:  # what a kill left of a chunk half written goes
                os.ftruncate(fd, self.done["output_bytes"])
            os.lseek(fd, self.done["output_bytes"], os.SEEK_SET)
            self._record()
        except BaseException as exc:
            self._stopped(fd, exc)
            os.close(fd)
            if isinstance(exc, OSError):
                raise self._disk_error(exc) or exc from None
            raise
        return fd

    def _write_chunks(self, translator, fd: int, progress: bool) -> None:
        total, done = self.input.lines, self.done["lines"]
        ends: dict[int, int] = {}
        lines = read_lines(self.input.path, self.done["input_bytes"], ends, self.chunk,
                           first_line=done, end=self.input.size)
        counter = bar(enabled=progress, desc="translating", total=total, unit=" sentences",
                      initial=done)
        try:
            for text in translator.translate_lines(lines, search=self.search, chunk=self.chunk,
                                                   first_line=done, **self.modes,
                                                   **_per_batch(translator, counter)):
                data = text.encode("utf-8")
                try:
                    _write_all(fd, data)
                    os.fsync(fd)
                except OSError as exc:
                    raise self._disk_error(exc) or exc from None
                done = min(done + self.chunk, total)
                if done not in ends:  # its lines are not where the scan found them
                    raise AiaynError(f"-i {self.input.path}: the file changed while it was "
                                     "translated; translate it once it is written whole")
                self.done = {"lines": done, "input_bytes": ends.pop(done),
                             "output_bytes": self.done["output_bytes"] + len(data)}
                self._record()
                counter.update(done - counter.n)
        finally:
            counter.close()

    def _record(self) -> None:
        """The sidecar: what is done, and what the run is (atomic: old or new, whole)."""
        record = {"version": SIDECAR_VERSION, "pid": os.getpid(), "output": str(self.output),
                  "done": self.done, "lines_total": self.input.lines,
                  "settings": self.settings()}
        try:
            atomic_write_text(self.sidecar, json.dumps(record, indent=1) + "\n")
        except DiskError as exc:
            raise self._disk_error(exc) from None

    def _stopped(self, fd: int, exc: BaseException) -> None:
        """After an error: keep whole chunks and their record (the bytes of a chunk half
        written go), or, with none done by a new run, nothing at all."""
        try:
            if self.done["lines"] == 0 and not self.resume:
                self.partial.unlink(missing_ok=True)
                self.sidecar.unlink(missing_ok=True)
                return
            os.ftruncate(fd, self.done["output_bytes"])
        except OSError:
            return
        kept = (f"aiayn: {self.partial} keeps the first {self.done['lines']:,} of "
                f"{self.input.lines:,} lines; the same command with --resume continues it")
        if isinstance(exc, KeyboardInterrupt):
            print(kept, file=sys.stderr)
        elif not isinstance(exc, DiskError):  # whose own line says what is kept
            print(f"{kept} once the cause below is fixed (after a change to -i, delete it and "
                  f"{self.sidecar.name} to start again)", file=sys.stderr)

    def _disk_error(self, exc: BaseException) -> DiskError | None:
        """A full disk (or the like) writing the output, as one line that says what is kept."""
        error = as_disk_error(exc, self.output, what="the translations")
        if error is None:
            for path in (self.partial, self.sidecar):
                error = error or as_disk_error(exc, path, what="the translations")
        if error is None:
            return None
        return PartialDiskError(error.code, self.output, what="the translations", job=self)


class PartialDiskError(DiskError):
    """A full disk during a resumable translate: the fix says how to go on."""

    def __init__(self, code: int, path, what: str, job: Job):
        self.job = job
        super().__init__(code, path, what=what)

    def line(self, option: str | None = None, fix: str | None = None) -> str:
        job = getattr(self, "job", None)
        if fix is None and job is not None and (job.done["lines"] or job.resume):
            fix = (f"{job.partial} keeps the first {job.done['lines']:,} of "
                   f"{job.input.lines:,} lines: free space, then the same command with "
                   "--resume continues it")
        return super().line(option, fix)


def _per_batch(translator, counter) -> dict:
    """``progress=`` for a ``translate_lines`` that takes one (the bar then moves with each
    batch decoded, not only with each chunk written; each chunk then sets it exact)."""
    try:
        takes = "progress" in inspect.signature(translator.translate_lines).parameters
    except (TypeError, ValueError):
        takes = False
    return {"progress": counter.update} if takes else {}


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _search_record(search: Search) -> dict:
    """The search as JSON, nbest included (``Search`` equality leaves it out)."""
    return json.loads(json.dumps(dataclasses.asdict(search)))


def _difference(before, now, where: str = "") -> str:
    """The first setting that differs, 'beam 4 then, 1 now' (nested: 'sampling.seed ...')."""
    if isinstance(before, dict) and isinstance(now, dict):
        for key in sorted(set(before) | set(now), key=str):
            if before.get(key) != now.get(key):
                return _difference(before.get(key), now.get(key), f"{where}{key}.")
    return f"{where.rstrip('.') or 'value'} {_said(before)} then, {_said(now)} now"


def _said(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, str) and len(value) > 16 and all(c in "0123456789abcdef" for c in value):
        return value[:12]  # a hash: its start tells them apart
    return json.dumps(value) if not isinstance(value, str) else value


def run_identity(run_dir: str | Path, weights: str, engine: str, device: str,
                 decode_tokens: int | None, int8: bool = False, to: str | None = None,
                 alignment_layer: int | None = None) -> dict:
    """What the model is, for the sidecar: the run directory, the weights file (its size and
    modification time: a run that trained on since then decodes otherwise), the engine,
    the device and the decoding budget (batches of another size may round otherwise), and
    int8 decoding where it decodes so (``aiayn.inference.int8``), and the target
    language of a model of several (``to``: another would translate every line otherwise),
    and with word alignments the run's ``decode.alignment_layer`` (the layer they are read
    from: editable after training)."""
    identity = {"run_dir": str(Path(run_dir).resolve()), "weights": str(weights),
                "engine": engine, "device": str(device), "decode_tokens": decode_tokens}
    if int8:
        identity["int8"] = True
    if to is not None:
        identity["to"] = to
    if alignment_layer is not None:
        identity["alignment_layer"] = alignment_layer
    try:
        path = resolve_weights(run_dir, weights) if engine == "aiayn" else \
            Path(run_dir) / "model.bin"
        stat = path.stat()
        identity["weights_file"] = {"path": str(path.resolve()), "size": stat.st_size,
                                    "mtime_ns": stat.st_mtime_ns}
    except (AiaynError, OSError):
        pass  # loading the translator says what is wrong
    return identity
