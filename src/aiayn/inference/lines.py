"""Lines of text as aiayn reads what it translates and scores: lines end at "\\n" only (a
trailing "\\r" goes), so input line i is output line i whatever else the text holds; a UTF-8
byte-order mark at the start goes; the newline that ends the last line starts no new one;
text that is not UTF-8 is one error naming its line and byte. For a file read twice,
lazily (``scan_input`` checks, counts and hashes it, ``read_lines`` reads it: `aiayn
translate -i`, ``aiayn.inference.files``), for data read whole (``text_lines``: stdin,
`aiayn score -i`) and for a stream read as its lines arrive (``stream_lines``: stdin
answered line by line).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator
from pathlib import Path

from aiayn.errors import AiaynError

BOM = b"\xef\xbb\xbf"


@dataclasses.dataclass(frozen=True)
class InputFile:
    """What ``scan_input`` found: the line count, and the identity ``--resume`` checks."""

    path: Path
    lines: int
    size: int
    sha256: str

    def identity(self) -> dict:
        return {"path": str(self.path.resolve()), "size": self.size, "sha256": self.sha256}


def scan_input(path: str | Path, option: str = "-i") -> InputFile:
    """One streaming pass over the file: UTF-8 checked line by line (the error names the
    line and the byte), the lines counted by ``read_lines``'s rules, the bytes hashed."""
    path = Path(path)
    if path.exists() and not path.is_file() and not path.is_dir():
        raise AiaynError(f"{option} {path}: not a regular file; {option} is read twice (to "
                         "check and count its lines, then to translate them), which a pipe or "
                         "a device cannot be: send it on stdin instead")
    digest, lines, size = hashlib.sha256(), 0, 0
    for number, raw in _raw_lines(path, option):
        digest.update(raw)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise not_utf8(f"{option} {path}", number + 1, exc, size) from None
        size += len(raw)
        lines += _is_line(number, raw)
    return InputFile(path, lines, size, digest.hexdigest())


def read_lines(path: str | Path, start: int = 0, boundaries: dict | None = None,
               chunk: int = 0, first_line: int = 0, end: int | None = None) -> Iterator[str]:
    """The file's lines, one at a time, by `aiayn translate`'s rules: lines end at "\\n"
    only (a trailing "\\r" goes), so input line i is output line i whatever else the text
    holds; a UTF-8 byte-order mark at the start goes; the newline that ends the last line
    starts no new one. ``start``: the byte offset to begin at (a line's start), numbered
    ``first_line``. ``boundaries``: filled with {line number: byte offset} at each
    ``chunk``-th line and at the end (where each chunk of the output ends in the input).
    ``end``: the file's size when ``scan_input`` read it; lines are read up to there, and a
    file that no longer ends on a line there (written to meanwhile) is an AiaynError."""
    path = Path(path)
    number, offset = first_line, start
    for index, raw in _raw_lines(path, "-i", start):
        if end is not None and offset + len(raw) > end:
            break  # what was written since the scan (or a line that changed): refused below
        offset += len(raw)
        if not _is_line(index if start == 0 else 1, raw):
            continue
        text = raw.decode("utf-8")
        if index == 0 and start == 0:
            text = text.removeprefix("\ufeff")
        number += 1
        if boundaries is not None and chunk and number % chunk == 0:
            boundaries[number] = offset
        yield text.removesuffix("\n").removesuffix("\r")
        if offset == end:
            break
    now = _size(path) if end is not None else None
    if end is not None and (offset != end or now not in (end, None)):  # None: removed, read
        said = f"{now:,} now" if now is not None else "removed or renamed since"
        raise AiaynError(f"-i {path}: the file changed while it was translated ({end:,} "
                         f"bytes when the command began, {said}); translate it once it is "
                         "written whole")
    if boundaries is not None:
        boundaries[number] = offset


def _size(path: Path) -> int | None:
    """The file's size now; None where it is gone (what was read through the open file
    stands: all of it, where the reading reached the scan's end)."""
    try:
        return path.stat().st_size
    except OSError:
        return None


def text_lines(data: bytes, where: str) -> list[str]:
    """The lines of ``data`` read whole (stdin, `aiayn score`'s file) by ``read_lines``'
    rules; text that is not UTF-8 is one error naming ``where``, the line and the byte
    (counted in ``data``, a byte-order mark included)."""
    start = len(BOM) if data.startswith(BOM) else 0
    try:
        text = data[start:].decode("utf-8")
    except UnicodeDecodeError as exc:
        byte = start + exc.start
        line_start = data.rfind(b"\n", 0, byte) + 1
        exc.start = byte - line_start  # counted in its line, as the two readers above count
        raise not_utf8(where, data.count(b"\n", 0, byte) + 1, exc, line_start) from None
    lines = text.split("\n")
    if lines[-1] == "":  # the newline that ends the last line starts no new one
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def stream_lines(stream, where: str) -> Iterator[str]:
    """A binary stream's lines (a terminal's, or a pipe's), each as soon as it has arrived,
    by ``read_lines``' rules; a line that is not UTF-8 is one error naming ``where``, the
    line and the byte, after the lines before it."""
    offset = 0
    for index, raw in enumerate(stream):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise not_utf8(where, index + 1, exc, offset) from None
        offset += len(raw)
        if index == 0:
            if raw == BOM:  # a stream of nothing but a byte-order mark holds no line
                continue
            text = text.removeprefix("\ufeff")
        yield text.removesuffix("\n").removesuffix("\r")


def not_utf8(where: str, line: int, exc: UnicodeDecodeError, line_start: int) -> AiaynError:
    """The one error of text that is not UTF-8: ``exc`` of decoding line ``line`` (from 1),
    which starts at byte ``line_start`` of the input (from 0); says where the bad byte is in
    its line and in the input, both counted from 1 (an editor's column, ``cmp``'s byte)."""
    return AiaynError(f"{where}, line {line}: not UTF-8 text ({exc.reason}: byte "
                      f"{exc.start + 1} of the line, {line_start + exc.start + 1} of the input)")


def _raw_lines(path: Path, option: str, start: int = 0) -> Iterator[tuple[int, bytes]]:
    """(index, bytes) of each line, its "\\n" kept (a binary file splits at b"\\n" only)."""
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        raise AiaynError(f"{option} {path}: input file not found") from None
    except IsADirectoryError:
        raise AiaynError(f"{option} {path}: is a directory, not a file") from None
    with fh:
        fh.seek(start)
        yield from enumerate(fh)


def _is_line(index: int, raw: bytes) -> bool:
    """Every piece is a line but a file holding nothing but a byte-order mark (the text
    after it is empty, and no newline starts a line)."""
    return not (index == 0 and raw == BOM)
