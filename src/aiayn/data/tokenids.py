"""Token ids of one side of a split, on disk: written once in chunks, read by mapping.

A side of a split (say the source side of train) is two numpy ``.npy`` files::

    train.src.ids.npy       every sentence's ids, one sentence after another (uint16 when
                            the vocabulary has at most 65,536 entries, else uint32)
    train.src.offsets.npy   int64, n + 1 entries: sentence i is ids[offsets[i]:offsets[i+1]]

so lengths are ``np.diff(offsets)`` and reading sentence i touches only its own bytes.
``np.load(..., mmap_mode="r")`` maps the files: opening is instant whatever their size,
the operating system pages in what is read and shares the pages between the processes of
a machine (torchrun ranks), and a process holds no copy of the corpus.

Why plain ``.npy`` (numpy, already a dependency) and not Arrow files through ``datasets``:
the data is two integer columns, so a format that any numpy reads back (``np.load``) is
enough; random access to one row is two array lookups, with no per-row Python objects or
record batches in between; and the writer needs nothing but appending bytes. It is the
layout of fairseq's memory-mapped indexed datasets (.bin + .idx) in numpy's own format.

The writer appends chunks as they are encoded (memory: one chunk) and writes the final
length into the ``.npy`` header at the end: numpy pads the header so that the length of
its first axis can grow in place (``np.lib.format``'s growth padding), which is checked.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from numpy.lib import format as npy

from aiayn.errors import AiaynError

SIDES = ("src", "tgt")


def ids_path(directory: Path, split: str, side: str) -> Path:
    return directory / f"{split}.{side}.ids.npy"


def offsets_path(directory: Path, split: str, side: str) -> Path:
    return directory / f"{split}.{side}.offsets.npy"


class RaggedIds:
    """Sentences of ids as one flat array plus offsets (mapped from disk or in memory)."""

    def __init__(self, ids: np.ndarray, offsets: np.ndarray):
        self.ids, self.offsets = ids, offsets

    @classmethod
    def from_chunks(cls, chunks: list[tuple[np.ndarray, np.ndarray]], dtype) -> RaggedIds:
        """In memory, from (ids, lengths) chunks as ``ArrayEncoder.encode`` returns them."""
        ids = np.concatenate([c[0] for c in chunks]) if chunks else np.zeros(0, dtype)
        lengths = np.concatenate([c[1] for c in chunks]) if chunks else np.zeros(0, np.int64)
        return cls(ids.astype(dtype, copy=False), np.concatenate([[0], np.cumsum(lengths)]))

    @classmethod
    def open(cls, directory: Path, split: str, side: str) -> RaggedIds:
        """Map the two files of one side of a split (nothing is read yet)."""
        try:
            ids = np.load(ids_path(directory, split, side), mmap_mode="r")
            offsets = np.load(offsets_path(directory, split, side), mmap_mode="r")
        except (OSError, ValueError) as exc:
            raise AiaynError(f"{directory}: token ids of {split} ({side}) unreadable ({exc}); "
                             "run `aiayn prepare` again") from None
        if (offsets.ndim != 1 or len(offsets) == 0 or offsets[0] != 0
                or int(offsets[-1]) != len(ids)):
            raise AiaynError(f"{offsets_path(directory, split, side)}: does not match "
                             f"{ids_path(directory, split, side).name}; run `aiayn prepare` again")
        return cls(ids, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        """Ids per sentence (int64; reads the offsets only)."""
        return np.diff(np.asarray(self.offsets, dtype=np.int64))

    def row(self, i: int) -> list[int]:
        """The ids of sentence ``i``."""
        return self.ids[self.offsets[i]:self.offsets[i + 1]].tolist()

    def id_counts(self, vocab_size: int, chunk: int = 1 << 24) -> np.ndarray:
        """How often each id in [0, vocab_size) occurs, read a chunk at a time (memory does
        not grow with the corpus)."""
        counts = np.zeros(vocab_size, dtype=np.int64)
        for start in range(0, len(self.ids), chunk):
            counts += np.bincount(np.asarray(self.ids[start:start + chunk]),
                                  minlength=vocab_size)[:vocab_size]
        return counts


class NpyAppender:
    """Writes a 1-D ``.npy`` file by appending arrays; the header gets the length at close."""

    def __init__(self, path: Path, dtype):
        self.path, self.dtype, self.count = path, np.dtype(dtype), 0
        self._fh = open(path, "wb")  # noqa: SIM115 -- closed by close()
        self._header_size = self._write_header(0)

    def _write_header(self, count: int) -> int:
        self._fh.seek(0)
        header = {"descr": npy.dtype_to_descr(self.dtype), "fortran_order": False,
                  "shape": (count,)}
        npy.write_array_header_1_0(self._fh, header)
        return self._fh.tell()

    def append(self, values: np.ndarray) -> None:
        self._fh.write(np.ascontiguousarray(values, dtype=self.dtype).tobytes())
        self.count += len(values)

    def discard(self) -> None:
        """Close the file unfinished (after an error; the staging directory goes anyway)."""
        self._fh.close()

    def close(self) -> None:
        end = self._fh.tell()
        if self._write_header(self.count) != self._header_size:  # numpy leaves room; check
            raise RuntimeError(f"{self.path}: the .npy header grew; cannot finish in place")
        self._fh.seek(end)
        self._fh.flush()
        os.fsync(self._fh.fileno())  # on disk before prepare swaps the directory in
        self._fh.close()


class RaggedWriter:
    """Writes one side of a split: append (ids, lengths) chunks, then ``close``."""

    def __init__(self, directory: Path, split: str, side: str, dtype):
        directory.mkdir(parents=True, exist_ok=True)
        self.ids = NpyAppender(ids_path(directory, split, side), dtype)
        self.offsets = NpyAppender(offsets_path(directory, split, side), np.int64)
        self.offsets.append(np.zeros(1, np.int64))

    def append(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        self.offsets.append(self.ids.count + np.cumsum(lengths, dtype=np.int64))
        self.ids.append(ids)

    def close(self) -> None:
        self.ids.close()
        self.offsets.close()

    def discard(self) -> None:
        self.ids.discard()
        self.offsets.discard()
