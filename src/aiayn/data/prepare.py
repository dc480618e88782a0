"""``aiayn prepare``: a corpus spec becomes a prepared data directory::

    DIR/train.jsonl, dev.jsonl, test.jsonl   {"src": ..., "tgt": ...} per line (the text:
                                             BLEU references, samples, `aiayn evaluate`)
    DIR/ids/{split}.{src,tgt}.ids.npy        the token ids, written once (aiayn.data.tokenids)
    DIR/ids/{split}.{src,tgt}.offsets.npy
    DIR/tokenizer/                           see aiayn.data.tokenizer
    DIR/stats.json                           what was read, dropped, kept; the languages
                                             (aiayn.data.languages); tokens; lengths

and running it twice gives identical files. It streams: the corpus is read pair by pair
(``aiayn.data.corpora.CorpusStream``), the tokenizer learns from an iterator over the train
text, and the ids are encoded in chunks and appended to the files, so its memory does not
grow with the corpus. Everything is written in a staging directory that replaces the
files of DIR only when all of it succeeded. Reading a prepared directory: ``aiayn.data.prepared``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, replace
from json.encoder import encode_basestring as _json_string
from pathlib import Path
from typing import Any

import numpy as np

from aiayn.config import DataConfig
from aiayn.data.batching import TokenBatchSampler
from aiayn.data.corpora import CorpusStream, held_out_positions
from aiayn.data.directions import (
    TAG_PATTERN,
    CorpusLine,
    check_tag_free,
    corpus_lines,
    needs_tags,
    tag_of,
)
from aiayn.data.languages import bleu_tokenize, resolve_languages
from aiayn.data.pairs import SPLITS
from aiayn.data.prepared import (
    ENCODE_CHUNK,
    IDS_DIR,
    IDS_FORMAT,
    LANGUAGE_SAMPLE,
    STATS_FILE,
    TOKENIZER_DIR,
    SplitIds,
    fit_to_max_len,
)
from aiayn.data.tokenids import SIDES, RaggedWriter
from aiayn.data.tokenizer import Tokenizers, tokenizer_fingerprint, train_tokenizers
from aiayn.errors import AiaynError
from aiayn.util.io import atomic_write_text, check_room, staged_directory
from aiayn.util.progress import bar as progress_bar

PERCENTILES = (50, 90, 95, 99, 100)
WARN_DROPPED = 1 / 3  # a filter that drops more than this share of the pairs read is suspect


def prepare(data_cfg: DataConfig, out_dir: str | Path, model_max_len: int,
            max_tokens: int = 4096, progress: bool = False,
            force: bool = False,
            tokenizers: Tokenizers | None = None) -> dict[str, Any]:
    """Read ``data_cfg.corpus``, train and save the tokenizer(s) on the train split, write
    every split's text and token ids, and write ``stats.json``. Returns the stats.

    Three passes, each with a progress bar and its rate: reading (normalize, filter, and
    set each pair's split: ``read_pairs``), the tokenizer (on at most
    ``data.tokenizer_max_pairs`` train pairs spread over the split), writing and encoding
    (``write_splits``). Memory: one chunk of pairs, the tokenizer's word counts and its
    word cache, whatever the corpus size.

    ``out_dir`` must be empty or new unless ``force``; it is locked while prepare runs and
    its old contents stay until the new ones are complete (aiayn.util.io.staged_directory).

    ``model_max_len`` and ``max_tokens`` only feed the report: how many pairs the model's
    length limit would drop or truncate, and the padding of train batches of that budget
    (the ids are written whole; training applies the limit).
    ``tokenizers``: use (and save) these instead of training new ones, e.g. a run's, to
    fine-tune it on this corpus (aiayn.training.transfer.prepare_from_run).
    """
    lines = corpus_lines(data_cfg.corpus)
    need = prepared_size(data_cfg.corpus)
    if need is not None:
        check_room(out_dir, need, "the prepared data")
    with staged_directory(out_dir, force, "aiayn prepare", marker=STATS_FILE, need=need) as stage:
        pairs = read_corpora(data_cfg, lines, stage, progress)
        n_train = pairs.info["splits"]["train"]
        sample = min(n_train, data_cfg.tokenizer_max_pairs)
        tags = [tag_of(c["languages"]["tgt"]) for c in pairs.corpora] if pairs.tagged else []
        tags += [c["source_tag"] for c in pairs.corpora if c.get("source_tag")]
        if tokenizers is None:
            tokenizers = train_tokenizers(lambda: pairs.train_sample(sample), data_cfg,
                                          progress=progress, total=sample,
                                          tags=list(dict.fromkeys(tags)))
        else:  # given (a run's, to fine-tune it on this corpus): nothing is trained
            sample = 0
            have = {t.content for t in tokenizers.src.get_added_tokens_decoder().values()}
            missing = sorted(set(tags) - have)
            if missing:
                raise AiaynError(f"the run's tokenizer has no tag {', '.join(missing)}; "
                                 "fine-tune it on directions and tags it was trained with")
        languages = dict(pairs.corpora[0]["languages"])
        tokenizers.save(stage / TOKENIZER_DIR)
        ids = write_splits(stage, pairs, tokenizers, progress)
        pairs.remove()
        stats = {
            **pairs.info,
            "languages": languages,
            "corpora": pairs.corpora,
            "tokenizer": {"kind": tokenizers.kind, "joint": tokenizers.joint,
                          "src_vocab_size": tokenizers.src_vocab_size,
                          "tgt_vocab_size": tokenizers.tgt_vocab_size,
                          "trained_on_pairs": sample},
            **_token_stats(ids, model_max_len, data_cfg.long_policy, max_tokens),
            "ids": {"format": IDS_FORMAT, "directory": IDS_DIR,
                    "pairs": {name: len(split.src) for name, split in ids.items()},
                    "tokenizer_sha256": tokenizer_fingerprint(stage / TOKENIZER_DIR)},
            "data_config": asdict(data_cfg),
        }
        del ids  # unmap before the files move
        atomic_write_text(stage / STATS_FILE, json.dumps(stats, indent=2, ensure_ascii=False) + "\n")
    return stats


def drop_warnings(stats: dict[str, Any]) -> list[str]:
    """One line for each filter that dropped more than a third of the pairs read: a wrong
    column, a wrong file, or a length limit that does not fit the corpus."""
    read = stats["pairs"]["read"]
    hints = {"empty": "is a column empty, or the file not source<TAB>target?",
             "too_long": "raise data.max_words if the corpus has long sentences",
             "length_ratio": "are the sides aligned line by line? else raise "
                             "data.max_length_ratio (docs/data.md#languages)",
             "versification": "the Bible modules pair badly"}
    return [f"the {reason} filter dropped {n} of {read} pairs ({100 * n / read:.0f}%); "
            + hints.get(reason, "check the corpus")
            for reason, n in stats["pairs"]["dropped"].items() if read and n > WARN_DROPPED * read]


# Fewer held-out pairs than this give a dev or test BLEU that moves by points between runs.
SMALL_SPLIT = 100
# What the first row of a TSV with a header holds: column names made of these words, or of
# language codes ("source<TAB>target", "en<TAB>fr", "src_text<TAB>tgt_text").
_HEADER_WORDS = frozenset(
    "source target src tgt input output text texts sentence sentences translation original "
    "lang language english french spanish german italian portuguese chinese japanese "
    "russian arabic".split())
_LANGUAGE_CODES = frozenset(
    "en fr es de it pt nl ru zh ja ko ar hi tr pl sv da fi nb no cs el he uk ro hu id vi th "
    "fa ca eu gl eng fra fre spa deu ger ita por nld rus zho jpn kor ara".split())


def prepare_warnings(stats: dict[str, Any]) -> list[str]:
    """What ``aiayn prepare`` warns about once the data is written: filters that dropped
    much (``drop_warnings``), a dev or test split too small for a steady score, and a first
    TSV row that looks like column names (it was kept as a pair)."""
    lines = drop_warnings(stats)
    for split in ("dev", "test"):
        n = stats["splits"].get(split, 0)
        if n < SMALL_SPLIT:
            lines.append(f"the {split} split has only {n} pairs, too few for a steady BLEU (a "
                         f"few pairs more or less move it by points); hold out more with --set "
                         f"data.{split}_fraction=0.05 (or give a larger {split} file)")
    for line in corpus_lines(stats["corpus"]):
        header = _header_row(line.spec)
        if header is None:
            continue
        path, columns = header
        lines.append(f"{path}: the first line ({' <TAB> '.join(columns)}) looks like column "
                         "names and was kept as a sentence pair; delete it if it is a header row")
    return lines


def _header_row(spec: str) -> tuple[str, tuple[str, str]] | None:
    """The file and first two columns of a ``tsv:`` corpus's first line when they look like
    column names (``_HEADER_WORDS``, language codes); else None. Reads one line."""
    kind, _, arg = spec.partition(":")
    if kind != "tsv":
        return None
    path = Path(arg.strip().replace("{split}", "train")).expanduser()
    try:
        with open(path, encoding="utf-8-sig", errors="replace") as fh:
            columns = fh.readline().rstrip("\r\n").split("\t")
    except OSError:
        return None
    if len(columns) < 2:
        return None
    src, tgt = (c.strip() for c in columns[:2])

    def name(cell: str) -> bool:
        parts = [p for p in cell.lower().replace("-", "_").replace(" ", "_").split("_") if p]
        return bool(parts) and len(parts) <= 3 and all(
            p in _HEADER_WORDS or p in _LANGUAGE_CODES for p in parts)

    if src.lower() != tgt.lower() and name(src) and name(tgt):
        return str(path), (src, tgt)
    return None


def prepared_size(spec: str) -> int | None:
    """About the bytes prepare writes for corpora of the user's files (tsv, jsonl,
    parallel; every line of ``spec``): three times their size (the staged pairs, the JSON
    lines, the ids, which take about as much as the text); None where a corpus's size is
    not known beforehand."""
    sizes = [_corpus_size(line.spec) for line in corpus_lines(spec)]
    return None if None in sizes else sum(sizes) or None


def _corpus_size(spec: str) -> int | None:
    kind, _, arg = spec.partition(":")
    if kind not in ("tsv", "jsonl", "parallel"):
        return None
    total = 0
    for pattern in arg.strip().split(",") if kind == "parallel" else [arg.strip()]:
        names = [pattern.replace("{split}", split) for split in SPLITS] if "{split}" in pattern \
            else [pattern]
        total += sum(path.stat().st_size for path in (Path(n).expanduser() for n in names)
                     if path.is_file())
    return 3 * total or None


class SplitPairs:
    """The pairs of a corpus read once into tab-separated files in the staging directory
    (``{split}.pairs.tsv``, normalized text has no tab or line break), with the split of
    each: the file's own, or for train's file the held-out positions (dev, test)."""

    def __init__(self, directory: Path, files: dict[str, Path], held: dict[int, str],
                 info: dict[str, Any]):
        self.directory, self.files, self.held, self.info = directory, files, held, info

    def routed(self) -> Iterator[tuple[str, str, str]]:
        """(split, source, target) for every pair, each split in corpus order."""
        for split, path in self.files.items():
            with open(path, encoding="utf-8", newline="\n") as fh:
                if split == "train" and self.held:
                    held = self.held
                    for i, line in enumerate(fh):
                        src, tgt = line[:-1].split("\t")
                        yield held.get(i, "train"), src, tgt
                else:
                    for line in fh:
                        src, tgt = line[:-1].split("\t")
                        yield split, src, tgt

    def train_sample(self, k: int) -> Iterator[tuple[str, str]]:
        """``k`` train pairs spread evenly over the train split (all of them when k >= n)."""
        n = self.info["splits"]["train"]
        k = min(k, n)
        wanted = (np.arange(k, dtype=np.int64) * n) // max(1, k)  # train positions
        # The line of train position t is t plus the held-out lines before it.
        held = np.sort(np.fromiter(self.held, dtype=np.int64, count=len(self.held)))
        lines = wanted + np.searchsorted(held - np.arange(len(held)), wanted, side="right")
        take = np.zeros(n + len(held), dtype=bool)
        take[lines] = True
        with open(self.files["train"], encoding="utf-8", newline="\n") as fh:
            for line in itertools.compress(fh, take):
                src, tgt = line[:-1].split("\t")
                yield src, tgt

    def remove(self) -> None:
        for path in self.files.values():
            path.unlink()


def read_pairs(cfg: DataConfig, directory: Path, progress: bool = False,
               prefix: str = "") -> SplitPairs:
    """Pass 1: stream the corpus (``aiayn.data.corpora.CorpusStream``) into tab-separated files,
    one per split it has, and choose the held-out positions
    (``aiayn.data.corpora.held_out_positions``). ``info`` holds what was read, dropped and kept
    and the split rule (the first keys of stats.json). ``prefix``: of the files' names."""
    stream = CorpusStream(cfg.corpus, cfg, progress)
    files = {name: directory / f"{prefix}{name}.pairs.tsv" for name in SPLITS}
    counts = dict.fromkeys(SPLITS, 0)
    with contextlib.ExitStack() as stack:
        handles = {name: stack.enter_context(open(path, "w", encoding="utf-8", newline="\n"))
                   for name, path in files.items()}
        for pair, split in stream:
            src, tgt = pair.src, pair.tgt
            if "\t" in src or "\t" in tgt or "\n" in src or "\n" in tgt:
                raise AiaynError(f"{pair.ref}: a tab or line break in normalized text")
            handles[split].write(f"{src}\t{tgt}\n")
            counts[split] += 1
    stream.check_kept(counts)
    chosen, rule = held_out_positions(counts["train"], stream.given, cfg, cfg.corpus)
    held = {int(i): name for name, positions in chosen.items() for i in positions}
    counts["train"] -= len(held)
    counts.update({name: len(positions) for name, positions in chosen.items()})
    info = {"corpus": cfg.corpus, "description": stream.description,
            "pairs": {"read": stream.read, "kept": sum(counts.values()),
                      "dropped": stream.dropped},
            "split_rule": stream.split_rule or rule, "splits": counts}
    return SplitPairs(directory, files, held, info)


class CorpusSet:
    """The corpora of every line of a spec read once (``SplitPairs`` each), as one corpus:
    their pairs one corpus after the other in every split, each source with its direction
    tag where the target languages differ (aiayn.data.directions). ``corpora``: per line,
    what stats.json's "corpora" records (its share of each split, in this order)."""

    def __init__(self, parts: list[SplitPairs], corpora: list[dict[str, Any]]):
        self.parts, self.corpora = parts, corpora
        self.tagged = needs_tags([c["languages"]["tgt"] for c in corpora])
        if len(parts) == 1:
            self.info = parts[0].info
            return
        splits = {name: sum(p.info["splits"][name] for p in parts) for name in SPLITS}
        dropped = {reason: sum(p.info["pairs"]["dropped"].get(reason, 0) for p in parts)
                   for reason in parts[0].info["pairs"]["dropped"]}
        self.info = {"corpus": "\n".join(c["line"] for c in corpora),
                     "description": "; ".join(p.info["description"] for p in parts),
                     "pairs": {"read": sum(p.info["pairs"]["read"] for p in parts),
                               "kept": sum(splits.values()), "dropped": dropped},
                     "split_rule": "per corpus: " + "; ".join(
                         p.info["split_rule"] for p in parts),
                     "splits": splits}

    def routed(self) -> Iterator[tuple[str, str, str]]:
        """(split, source, target): every corpus's pairs in turn, tagged where needed."""
        heads = [" ".join(t for t in (c["tag"], c.get("source_tag")) if t)
                 for c in self.corpora]  # what each corpus's sources start with
        tags = [t for c in self.corpora for t in (c["tag"], c.get("source_tag")) if t]
        for i, part in enumerate(self.parts):
            for split, src, tgt in part.routed():
                if tags:
                    check_tag_free(src, tags, f"{self.corpora[i]['line']} ({split})")
                    check_tag_free(tgt, tags, f"{self.corpora[i]['line']} ({split})")
                if heads[i]:
                    src = f"{heads[i]} {src}"
                yield split, src, tgt

    def train_sample(self, k: int) -> Iterator[tuple[str, str]]:
        """``k`` train pairs (without tags), each corpus's share by its size."""
        n = self.info["splits"]["train"]
        for part in self.parts:
            yield from part.train_sample(round(k * part.info["splits"]["train"] / max(1, n)))

    def remove(self) -> None:
        for part in self.parts:
            part.remove()


def read_corpora(cfg: DataConfig, lines: list[CorpusLine], directory: Path,
                 progress: bool = False) -> CorpusSet:
    """Pass 1 for every line of the spec (``read_pairs``), the languages of each
    (aiayn.data.languages.resolve_languages: the line's src=/tgt=, then data.src_lang /
    tgt_lang, the spec, the script). Direction tags need every target language known."""
    parts, corpora = [], []
    for i, line in enumerate(lines):
        line_cfg = replace(cfg, corpus=line.spec, **(
            {"dev_fraction": 0.0, "test_fraction": 0.0} if line.train_only else {}))
        part = read_pairs(line_cfg, directory, progress, prefix=f"{i}." if len(lines) > 1 else "")
        if line.train_only:
            part.info["split_rule"] = "all train (splits=train)"
        n_train = part.info["splits"]["train"]
        languages = resolve_languages(line.src_lang or cfg.src_lang, line.tgt_lang or cfg.tgt_lang,
                                      line.spec,
                                      part.train_sample(min(n_train, LANGUAGE_SAMPLE)))
        for side, given in (("src", line.src_lang), ("tgt", line.tgt_lang)):
            if given:
                languages[f"{side}_from"] = "corpus line"
        languages["bleu_tokenize"] = bleu_tokenize(cfg.bleu_tokenize, languages["tgt"])
        parts.append(part)
        corpora.append({"line": " ".join([line.spec] + [f"{k}={v}" for k, v in (
            ("weight", line.weight), ("src", line.src_lang), ("tgt", line.tgt_lang),
            ("tag", line.tag), ("splits", "train" if line.train_only else None)) if v]),
            "spec": line.spec, "weight": line.weight, "languages": languages,
            "source_tag": line.source_tag,
            "pairs": part.info["pairs"], "splits": part.info["splits"]})
    targets = [c["languages"]["tgt"] for c in corpora]
    if needs_tags(targets):
        for c in corpora:
            if not c["languages"]["tgt"] or not TAG_PATTERN.fullmatch(tag_of(c["languages"]["tgt"])):
                raise AiaynError(f"corpus line {c['line']!r}: its target language is not known, "
                                 "and the lines translate into different languages; name it "
                                 "with tgt=LANG on the line")
    for c in corpora:
        c["tag"] = tag_of(c["languages"]["tgt"]) if needs_tags(targets) else None
    return CorpusSet(parts, corpora)


def write_splits(directory: Path, pairs: SplitPairs | CorpusSet, tokenizers: Tokenizers,
                 progress: bool = False) -> dict[str, SplitIds]:
    """Pass 3: write each split's text (``{split}.jsonl``) and, encoded in chunks, its ids
    (``ids/``); returns the ids, mapped."""
    encoders = tokenizers.array_encoders()
    writers = {name: [RaggedWriter(directory / IDS_DIR, name, side, encoder.dtype)
                      for side, encoder in zip(SIDES, encoders, strict=True)]
               for name in SPLITS}
    buffers: dict[str, tuple[list[str], list[str]]] = {name: ([], []) for name in SPLITS}

    def flush(name: str) -> None:
        for writer, encoder, sentences in zip(writers[name], encoders, buffers[name],
                                              strict=True):
            writer.append(*encoder.encode(sentences))
            sentences.clear()

    total = sum(pairs.info["splits"].values())
    with contextlib.ExitStack() as stack:
        for pair_writers in writers.values():
            for writer in pair_writers:
                stack.callback(writer.discard)  # closes its files after an error; else no-op
        texts = {name: stack.enter_context(open(directory / f"{name}.jsonl", "w",
                                                encoding="utf-8")) for name in SPLITS}
        bar = stack.enter_context(progress_bar(None, progress, "encoding", total))
        for n, (name, src, tgt) in enumerate(pairs.routed(), 1):
            texts[name].write(_json_line(src, tgt))
            buffer = buffers[name]
            buffer[0].append(src)
            buffer[1].append(tgt)
            if len(buffer[0]) == ENCODE_CHUNK:
                flush(name)
                bar.update(n - bar.n)
        for name in SPLITS:
            flush(name)
        bar.update(total - bar.n)
        for fh in texts.values():
            fh.flush()
            os.fsync(fh.fileno())  # on disk before prepare swaps the directory in
        for pair_writers in writers.values():
            for writer in pair_writers:
                writer.close()
    return {name: SplitIds.open(directory / IDS_DIR, name) for name in SPLITS}


def _json_line(src: str, tgt: str) -> str:
    """``json.dumps({"src": src, "tgt": tgt}, ensure_ascii=False)`` and a line end, written
    out (json.dumps builds an encoder at every call with ensure_ascii=False: 3x slower)."""
    return f'{{"src": {_json_string(src)}, "tgt": {_json_string(tgt)}}}\n'


def _token_stats(ids: dict[str, SplitIds], max_len: int, policy: str,
                 max_tokens: int) -> dict[str, Any]:
    """Tokens per side (without specials), length percentiles (in ids, as the model sees
    them: source + [EOS], [BOS] + target + [EOS]), the max_len rule, train batch padding."""
    tokens, lengths, long_counts = {}, {}, {}
    for name, split in ids.items():
        src_len, tgt_len = split.src.lengths(), split.tgt.lengths()
        tokens[name] = {"src": int(src_len.sum()) - len(src_len),
                        "tgt": int(tgt_len.sum()) - 2 * len(tgt_len)}
        lengths[name] = {"src": percentiles(src_len), "tgt": percentiles(tgt_len)}
        kept, long_counts[name] = fit_to_max_len(src_len, tgt_len, max_len, policy)
        if name == "train":
            sampler = TokenBatchSampler(np.minimum(src_len[kept], max_len),
                                        np.minimum(tgt_len[kept], max_len), max_tokens,
                                        shuffle=False)
    return {
        "tokens": tokens,
        "lengths": lengths,
        "max_len": {"model_max_len": max_len, "policy": policy, **long_counts},
        "batching": {"split": "train", "max_tokens": max_tokens, **sampler.padding_stats()},
    }


def percentiles(values: Sequence[int]) -> dict[str, int]:
    """Nearest-rank percentiles p50..p99 and the max (p100) of integer lengths (>= 0).
    Counted, not sorted: memory and time grow with the longest length, not the corpus."""
    values = np.asarray(values, dtype=np.int64)
    n = len(values)
    if not n:
        return {f"p{p}": 0 for p in PERCENTILES}
    at_most = np.cumsum(np.bincount(values))  # how many values are <= each length
    return {f"p{p}": int(np.searchsorted(at_most, max(1, -(-p * n // 100))))
            for p in PERCENTILES}
