"""Where sentence pairs come from, chosen by a corpus spec string.

``CorpusStream(spec, data_cfg)`` reads, cleans and filters one corpus, pair by pair, each
with its split where the corpus has one (``aiayn prepare`` holds the others out of train:
``held_out_positions``; it is the one path from a spec to token ids):

====================================  ===================================================
spec                                  pairs
====================================  ===================================================
``bible:eng-spa`` (default)           World English Bible -> Reina-Valera 1909, by verse
``bible:spa-eng``, ``bible:kjv-spa``  the same modules the other way round; King James
``bible:spa-kjv``                     (sword-text-kjv) as the English side
``bible:eng+kjv-spa``                 WEB -> RV1909, and in train also KJV -> RV1909: a
                                      second English text of the same verses doubles the
                                      training pairs (dev and test stay WEB -> RV1909;
                                      ``bible:spa-eng+kjv`` the other way round)
``hf:NAME[:CONFIG]``                  ``datasets.load_dataset(NAME, CONFIG)``, e.g.
                                      ``hf:opus_books:en-it``; NAME may also be a local
                                      data file or folder (read through ``datasets`` too)
``tsv:PATH``                          one ``source<TAB>target`` pair per line
``jsonl:PATH``                        one JSON object per line, fields ``data.src_field``
                                      and ``data.tgt_field``
``parallel:SRC_PATH,TGT_PATH``        two line-aligned plain-text files
====================================  ===================================================

A file path may contain ``{split}``: ``tsv:data/{split}.tsv`` reads ``data/train.tsv`` and,
where they exist, ``data/dev.tsv`` and ``data/test.tsv``. A split without its own file is
held out of train at random under ``data.split_seed`` (``data.dev_fraction`` and
``data.test_fraction`` of the pairs). The Bible has a fixed split by whole books; its reader
is ``aiayn.data.bible``. Every reader answers a ``RawCorpus`` of ``Pair``s
(``aiayn.data.pairs``, the floor below the readers); the spec registry here, one floor
above them, names each reader by its prefix.

Every text is normalized the same way: Unicode NFC, every run of whitespace one space, no
leading or trailing space. Then pairs are dropped, each under the first reason that holds:
``empty`` (a side with no text), ``versification`` (Bible chapters whose verses do not pair
one to one, see ``aiayn.data.bible.chapters_versified_differently``), ``too_long`` (a side
longer than ``data.max_words`` words) and ``length_ratio`` (the longer side more than
``data.max_length_ratio`` times the shorter, in words). The stream counts them. Words are
``aiayn.data.languages.length_units``: in scripts written without spaces (Chinese, Japanese,
Thai, ...) characters count as shares of a word, so those sentences are not one "word".
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from aiayn.config import DataConfig
from aiayn.data.bible import read_bible
from aiayn.data.languages import length_units
from aiayn.data.pairs import SPLITS, Pair, RawCorpus, normalize_text
from aiayn.errors import AiaynError
from aiayn.util.progress import bar as progress_bar

DROP_REASONS = ("empty", "versification", "too_long", "length_ratio")
SPEC_FORMS = (
    "bible:eng-spa", "bible:spa-eng", "bible:kjv-spa", "bible:spa-kjv", "bible:eng+kjv-spa",
    "hf:NAME[:CONFIG]", "tsv:PATH",
    "jsonl:PATH", "parallel:SRC_PATH,TGT_PATH",
)


class CorpusStream:
    """A corpus read pair by pair (its files are never held in memory): iterating yields
    the (pair, split) that pass the filter, once; ``read`` and ``dropped`` count as it goes
    and are complete when the iteration is.

    ``given``: the splits the corpus has itself; the others (dev, test) are held out of
    train afterwards (``held_out_positions``)."""

    def __init__(self, spec: str, cfg: DataConfig, progress: bool = False):
        kind, _, arg = spec.partition(":")
        readers: dict[str, Callable[[str, DataConfig, bool], RawCorpus]] = {
            "bible": read_bible, "hf": _read_hf, "tsv": _read_tsv, "jsonl": _read_jsonl,
            "parallel": _read_parallel,
        }
        if kind not in readers or not arg.strip():
            raise AiaynError(f"unknown corpus spec {spec!r}; valid forms: {', '.join(SPEC_FORMS)}")
        self.spec, self.cfg, self.progress = spec, cfg, progress
        self._raw = readers[kind](arg.strip(), cfg, progress)
        self.description, self.given = self._raw.description, self._raw.given
        self.read = 0
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self.kept = 0

    def __iter__(self) -> Iterator[tuple[Pair, str]]:
        pairs = progress_bar(self._raw.pairs, self.progress, "reading")
        for pair, split in pairs:
            self.read += 1
            reason = drop_reason(pair.src, pair.tgt, self.cfg)
            if reason:
                self.dropped[reason] += 1
            else:
                self.kept += 1
                yield pair, split
        for reason, n in self._raw.dropped.items():
            self.dropped[reason] += n
            self.read += n

    @property
    def split_rule(self) -> str:
        return self._raw.split_rule

    def check_kept(self, kept_per_split: dict[str, int]) -> None:
        """After the iteration: a clear error when nothing, or a given split, is left."""
        if not self.kept:
            reasons = ", ".join(f"{n} {r}" for r, n in self.dropped.items() if n)
            raise AiaynError(
                f"{self.spec}: no sentence pairs left after filtering ({self.read} read; "
                f"dropped: {reasons or 'none'}); check the file, data.max_words and "
                "data.max_length_ratio"
            )
        for name in sorted(self.given - {"train"}):
            if not kept_per_split.get(name):
                raise AiaynError(f"{self.spec}: the {name} split is empty after filtering")


# ------------------------------------------------------------------ cleaning and filtering


def drop_reason(src: str, tgt: str, cfg: DataConfig) -> str | None:
    """Why a (normalized) pair is dropped, or None to keep it (reasons: DROP_REASONS)."""
    if not src or not tgt:
        return "empty"
    # Words, or for scripts without spaces their characters as shares of a word.
    n_src, n_tgt = length_units(src), length_units(tgt)
    if max(n_src, n_tgt) > cfg.max_words:
        return "too_long"
    if max(n_src, n_tgt) > cfg.max_length_ratio * min(n_src, n_tgt):
        return "length_ratio"
    return None


# ------------------------------------------------------------------ splitting
def held_out_positions(n_train: int, given: set[str], cfg: DataConfig, spec: str
                       ) -> tuple[dict[str, np.ndarray], str]:
    """The splits a corpus does not have (dev, test), held out of its ``n_train`` train
    pairs at random under ``cfg.split_seed``: ``data.dev_fraction`` (``test_fraction``) of
    them, rounded up, and at most ``data.held_out_max`` pairs each, so that validating on a
    corpus of millions stays quick (1% up to 3,000 pairs by default).

    Returns the sorted positions of each held-out split (empty when every split is given)
    and a description of the rule."""
    fractions = {"dev": cfg.dev_fraction, "test": cfg.test_fraction}
    held_out = {name: frac for name, frac in fractions.items() if name not in given}
    if not held_out:
        return {}, "given"
    sizes = {name: min(math.ceil(frac * n_train), cfg.held_out_max)
             for name, frac in held_out.items()}
    if sum(sizes.values()) >= n_train:
        # One pair a split is the least a fraction holds out: below that only more pairs help.
        fix = ("give more pairs (a corpus needs thousands) or dev/test files (tsv:DIR/{split}.tsv)"
               if max(sizes.values()) <= 1 else
               "lower data.dev_fraction / data.test_fraction or give dev/test files")
        raise AiaynError(
            f"{spec}: only {n_train} training pairs, too few to hold out "
            + " and ".join(f"{n} {name}" for name, n in sizes.items()) + f" pairs; {fix}")
    drawn = np.random.default_rng(cfg.split_seed).choice(n_train, sum(sizes.values()),
                                                         replace=False)
    chosen, start = {}, 0
    for name, n in sizes.items():
        chosen[name] = np.sort(drawn[start:start + n])
        start += n
    rule = "; ".join(f"{name} {frac:g} of the pairs up to {cfg.held_out_max}"
                     for name, frac in held_out.items())
    given_text = "".join(f"; {name} given" for name in sorted(given - {"train"}))
    return chosen, f"random ({rule}; seed {cfg.split_seed}){given_text}"


# ------------------------------------------------------------------ Hugging Face datasets
_HF_SPLIT_NAMES = {"train": "train", "validation": "dev", "valid": "dev", "dev": "dev",
                   "test": "test"}
_LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "csv",
                   ".parquet": "parquet"}


def _read_hf(arg: str, cfg: DataConfig, progress: bool) -> RawCorpus:
    """A dataset through ``datasets.load_dataset``. ``NAME`` is a hub name (needs the
    network) or a local data file/folder; ``CONFIG`` is the hub config, whose ``xx-yy`` form
    also names the source and target languages of ``translation`` rows."""
    name, _, config = arg.partition(":")
    config = config or None
    dataset = _load_hf_dataset(name, config)
    langs = _config_languages(config)
    splits = {_HF_SPLIT_NAMES[s]: s for s in dataset if s in _HF_SPLIT_NAMES}
    if not splits and len(dataset) == 1:  # one split under another name: the whole corpus
        splits = {"train": next(iter(dataset))}
    if "train" not in splits:
        raise AiaynError(f"hf:{arg}: no train split among {', '.join(dataset)}")
    def pairs() -> Iterator[tuple[Pair, str]]:
        for split, hf_split in splits.items():
            for i, row in enumerate(dataset[hf_split]):
                src, tgt = _hf_row_texts(row, langs, cfg, f"hf:{arg} {hf_split} row {i}")
                yield Pair(normalize_text(src), normalize_text(tgt), f"{hf_split}:{i}"), split

    return RawCorpus(description=f"datasets.load_dataset({name!r}, {config!r})", given=set(splits),
                pairs=pairs())


def _looks_like_path(name: str) -> bool:
    """A local file or folder was meant: "./x", "/x", "~/x", "x/y.tsv", "x.jsonl"..."""
    return (name.startswith((".", "/", "~")) or Path(name).suffix.lower() in _LOCAL_BUILDERS
            or os.sep in name and name.count("/") != 1)  # "owner/name" is a hub id


def hub_reachable(host: str = "huggingface.co", timeout_s: float = 3.0) -> bool:
    """Whether a TCP connection to the hub opens within ``timeout_s`` (no request is sent)."""
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def _offline(datasets) -> None:
    """Make ``datasets`` use only its local cache (no retries against an unreachable hub)."""
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    for module, attribute in ((datasets.config, "HF_HUB_OFFLINE"),
                              (datasets.config, "HF_DATASETS_OFFLINE")):
        if hasattr(module, attribute):
            setattr(module, attribute, True)


def _load_hf_dataset(name: str, config: str | None):
    import datasets

    path = Path(name).expanduser()
    if not path.exists() and _looks_like_path(name):
        raise AiaynError(f"hf:{name}: no such file or directory")
    offline_note = ""
    if path.exists() or not hub_reachable():
        # Local files never need the hub; an unreachable hub answers from the cache at once.
        _offline(datasets)
        offline_note = "" if path.exists() else "; no network: huggingface.co is " \
            "unreachable, so only the local cache of datasets was searched"
    try:
        if path.is_file():
            builder = _LOCAL_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise AiaynError(f"hf:{name}: cannot tell the format of {path.name}; use one "
                                 f"of {', '.join(sorted(_LOCAL_BUILDERS))}")
            options = {"delimiter": "\t"} if path.suffix.lower() == ".tsv" else {}
            return datasets.load_dataset(builder, data_files=str(path), **options)
        if path.is_dir():
            return datasets.load_dataset(str(path))
        return datasets.load_dataset(name, config)
    except AiaynError:
        raise
    except Exception as exc:  # datasets raises many types (network, missing, format)
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise AiaynError(
            f"hf:{name}{':' + config if config else ''}: datasets.load_dataset failed "
            f"({message}){offline_note or '; a hub dataset needs network access to huggingface.co'}"
        ) from None


def _config_languages(config: str | None) -> tuple[str, str] | None:
    match = re.fullmatch(r"([A-Za-z_]+)-([A-Za-z_]+)", config or "")
    return (match.group(1), match.group(2)) if match else None


def _hf_row_texts(row: dict, langs: tuple[str, str] | None, cfg: DataConfig,
                  where: str) -> tuple[str, str]:
    """Source and target of one row: ``row["translation"][lang]`` (opus_books style, with
    the languages from data.src_field/tgt_field or else the config ``xx-yy``), or
    ``row[data.src_field]`` and ``row[data.tgt_field]``."""
    fields = (cfg.src_field, cfg.tgt_field)
    table = row.get("translation")
    if isinstance(table, dict):
        for keys in (fields, langs):
            if keys and all(k in table for k in keys):
                return _text_value(table[keys[0]], where), _text_value(table[keys[1]], where)
        raise AiaynError(f"{where}: translation has languages {', '.join(table)}; name the "
                         "pair in the spec (hf:NAME:xx-yy) or set data.src_field/tgt_field")
    if all(k in row for k in fields):
        return _text_value(row[fields[0]], where), _text_value(row[fields[1]], where)
    raise AiaynError(f"{where}: no 'translation' field and no fields {fields[0]!r}/"
                     f"{fields[1]!r} (fields: {', '.join(row)}); set data.src_field/tgt_field")


def _text_value(value: Any, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise AiaynError(f"{where}: expected text, got {type(value).__name__} {value!r:.40}")
    return value


# ------------------------------------------------------------------ the user's files
def _split_files(pattern: str) -> dict[str, Path]:
    """``{split}`` in a path: the existing split files (train required); else one file."""
    if "{split}" not in pattern:
        return {"train": _existing_file(Path(pattern).expanduser())}
    files = {name: Path(pattern.replace("{split}", name)).expanduser() for name in SPLITS}
    _existing_file(files["train"])
    return {name: path for name, path in files.items() if path.is_file()}


def _existing_file(path: Path) -> Path:
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "file not found"
        raise AiaynError(f"{path}: {what}")
    return path


def read_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 text file (without line ends; a leading BOM removed).
    Invalid UTF-8 is an error that names the file and line."""
    return list(iter_lines(path))


def iter_lines(path: Path) -> Iterator[str]:
    """``read_lines`` one line at a time (a file of any size in constant memory)."""
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise AiaynError(
                    f"{path}: line {number} is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at "
                    f"column {exc.start + 1}); convert the file, e.g. with iconv -t UTF-8"
                ) from None
            if number == 1:
                line = line.removeprefix("\ufeff")
            yield line.rstrip("\r\n")


def _read_tsv(arg: str, cfg: DataConfig, progress: bool) -> RawCorpus:
    """``source<TAB>target`` per line; further columns (e.g. attribution) are ignored."""
    files = _split_files(arg)

    def pairs() -> Iterator[tuple[Pair, str]]:
        for split, path in files.items():
            for number, line in enumerate(iter_lines(path), 1):
                if not line.strip():
                    src = tgt = ""
                else:
                    columns = line.split("\t")
                    if len(columns) < 2:
                        raise AiaynError(f"{path}: line {number} has no tab; expected "
                                         "source<TAB>target")
                    src, tgt = columns[0], columns[1]
                yield Pair(normalize_text(src), normalize_text(tgt), f"{path.name}:{number}"), split

    return RawCorpus(description=f"tab-separated pairs from {arg}", given=set(files), pairs=pairs())


def _read_jsonl(arg: str, cfg: DataConfig, progress: bool) -> RawCorpus:
    """One JSON object per line with the fields ``data.src_field`` and ``data.tgt_field``."""
    files = _split_files(arg)

    def pairs() -> Iterator[tuple[Pair, str]]:
        for split, path in files.items():
            for number, line in enumerate(iter_lines(path), 1):
                src, tgt = _jsonl_texts(line, cfg, f"{path}: line {number}")
                yield Pair(normalize_text(src), normalize_text(tgt), f"{path.name}:{number}"), split

    return RawCorpus(description=f"JSON lines ({cfg.src_field!r} -> {cfg.tgt_field!r}) from {arg}",
                given=set(files), pairs=pairs())


def _jsonl_texts(line: str, cfg: DataConfig, where: str) -> tuple[str, str]:
    if not line.strip():
        return "", ""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise AiaynError(f"{where} is not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise AiaynError(f"{where} is not a JSON object")
    for name in (cfg.src_field, cfg.tgt_field):
        if name not in record:
            raise AiaynError(f"{where} lacks the field {name!r} (fields: "
                             f"{', '.join(record) or 'none'}); set data.src_field/tgt_field")
    return (_text_value(record[cfg.src_field], where), _text_value(record[cfg.tgt_field], where))


def _read_parallel(arg: str, cfg: DataConfig, progress: bool) -> RawCorpus:
    """Two line-aligned files: line n of the source translates line n of the target."""
    src_pattern, sep, tgt_pattern = arg.partition(",")
    if not sep or not src_pattern.strip() or not tgt_pattern.strip():
        raise AiaynError(f"parallel:{arg}: expected parallel:SRC_PATH,TGT_PATH")
    src_files, tgt_files = _split_files(src_pattern.strip()), _split_files(tgt_pattern.strip())
    if set(src_files) != set(tgt_files):
        raise AiaynError(f"parallel:{arg}: source splits ({', '.join(src_files)}) and target "
                         f"splits ({', '.join(tgt_files)}) differ")
    for split in src_files:  # cheap, and before any pair is read
        src_n, tgt_n = _count_lines(src_files[split]), _count_lines(tgt_files[split])
        if src_n != tgt_n:
            raise AiaynError(f"parallel files differ in length: {src_files[split]} has {src_n} "
                             f"lines, {tgt_files[split]} has {tgt_n}")

    def pairs() -> Iterator[tuple[Pair, str]]:
        for split in src_files:
            src_path, tgt_path = src_files[split], tgt_files[split]
            lines = zip(iter_lines(src_path), iter_lines(tgt_path), strict=True)
            for number, (src, tgt) in enumerate(lines, 1):
                yield Pair(normalize_text(src), normalize_text(tgt), f"{src_path.name}:{number}"), split

    return RawCorpus(description=f"parallel files {arg}", given=set(src_files), pairs=pairs())


def _count_lines(path: Path) -> int:
    """Lines as ``iter_lines`` counts them (a last line without a line end counts)."""
    n, last = 0, b"\n"
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            n += block.count(b"\n")
            last = block[-1:]
    return n + (last != b"\n")
