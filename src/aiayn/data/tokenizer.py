"""Tokenizers (Hugging Face `tokenizers`): BPE by default, WordLevel as the tutorials use.

Special tokens have the same ids everywhere; the model's pad_id is PAD_ID.

Both kinds share one text pipeline, chosen so that decoding gives the text back:

- normalizer: Unicode NFC (the corpora are NFC with single spaces already, see
  ``aiayn.data.pairs.normalize_text``; this also normalizes what users type at translate time);
- pre-tokenizer: ``Metaspace`` (each space becomes ``▁``, the start of the next word, as in
  SentencePiece) then ``Punctuation`` (every punctuation mark is its own piece, so "earth."
  and "earth" share "▁earth");
- decoder: ``Metaspace``, which turns ``▁`` back into spaces.

So ``decode(encode(s)) == s`` for any ``s`` that is NFC with single spaces and no leading or
trailing space. A BPE tokenizer made with ``data.byte_fallback`` (the default, for a
``data.vocab_size`` of at least 1024) has 256 of its pieces after the learnt ones,
``<0x00>`` to ``<0xFF>`` (within vocab_size, as SentencePiece counts them): a character it
never saw is spelt
as the bytes of its UTF-8 encoding (as SentencePiece's byte fallback), and the decoder
(``ByteFallback`` before ``Metaspace``) turns them back into it, so any Unicode text
round-trips and ``[UNK]`` never appears. Without it (WordLevel, and BPE tokenizers made
before it existed, which load and decode as they always did), an unseen character (BPE)
or word (WordLevel) is ``[UNK]``, which decoding keeps visible as ``[UNK]``.

Text in scripts without spaces (Chinese, Japanese, Thai) is one ``Metaspace`` piece per
run between spaces and punctuation, which BPE splits into learnt pieces; decoding joins
pieces without spaces (only ``▁`` becomes a space), so nothing is inserted between
characters.

Source ids are ``tokens + [EOS]``; target ids are ``[BOS] + tokens + [EOS]``.

A tokenizer directory holds ``meta.json`` (kind, joint) and either ``joint.json`` (one
vocabulary for both sides) or ``src.json`` and ``tgt.json``, each a `tokenizers` JSON file.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from aiayn.config import DataConfig
from aiayn.data.directions import TAG_PATTERN
from aiayn.errors import AiaynError
from aiayn.util.io import atomic_write_text
from aiayn.util.progress import bar as progress_bar

PAD, UNK, BOS, EOS = "[PAD]", "[UNK]", "[BOS]", "[EOS]"
SPECIAL_TOKENS = [PAD, UNK, BOS, EOS]
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

KINDS = ("bpe", "wordlevel")
BYTE_PIECES = tuple(f"<0x{b:02X}>" for b in range(256))  # the names ByteFallback decodes
# Below this vocabulary the 256 byte pieces would be over a quarter of it: a toy vocabulary
# (the tests', configs/tiny.yaml) keeps [UNK] instead.
BYTE_FALLBACK_MIN_VOCAB = 1024
META_FILE = "meta.json"
_FORMAT = 1


class Tokenizers:
    """The source and target tokenizers (the same object when the vocabulary is joint)."""

    def __init__(self, src: Tokenizer, tgt: Tokenizer, kind: str) -> None:
        for side, tok in (("source", src), ("target", tgt)):
            _check_special_ids(tok, side)
        self.src = src
        self.tgt = tgt
        self.kind = kind

    @property
    def joint(self) -> bool:
        return self.src is self.tgt

    @property
    def byte_fallback(self) -> bool:
        """Whether unseen characters become byte pieces rather than [UNK] (both sides)."""
        return all(getattr(tok.model, "byte_fallback", False) for tok in (self.src, self.tgt))

    @property
    def tags(self) -> dict[str, str]:
        """Target language -> its direction tag (``<2es>``, aiayn.data.directions), the
        source tokenizer's special pieces of that form; empty for a model of one direction."""
        found = (TAG_PATTERN.fullmatch(t.content)
                 for t in self.src.get_added_tokens_decoder().values())
        return {m.group(1): m.group(0) for m in found if m}

    @property
    def src_vocab_size(self) -> int:
        return self.src.get_vocab_size()

    @property
    def tgt_vocab_size(self) -> int:
        return self.tgt.get_vocab_size()

    # ---------------------------------------------------------------- encoding
    def encode_src(self, texts: list[str]) -> list[list[int]]:
        """Source ids: tokens + [EOS]."""
        return [ids + [EOS_ID] for ids in _encode(self.src, texts)]

    def encode_tgt(self, texts: list[str]) -> list[list[int]]:
        """Target ids: [BOS] + tokens + [EOS]."""
        return [[BOS_ID] + ids + [EOS_ID] for ids in _encode(self.tgt, texts)]

    def array_encoders(self) -> tuple[ArrayEncoder, ArrayEncoder]:
        """Fast encoders to flat numpy arrays, giving the ids of encode_src and encode_tgt."""
        return (ArrayEncoder(self.src, [], [EOS_ID]), ArrayEncoder(self.tgt, [BOS_ID], [EOS_ID]))

    def src_tokens(self, text: str) -> list[str]:
        """The source token strings the model sees, [EOS] included."""
        return self.src.encode(text, add_special_tokens=False).tokens + [EOS]

    def src_offsets(self, text: str) -> list[tuple[int, int]]:
        """The (start, end) characters of ``text`` that each source token covers ([EOS]
        excluded): what ``aiayn.inference.align`` maps tokens to words with."""
        return self.src.encode(text, add_special_tokens=False).offsets

    def tgt_tokens(self, text: str) -> list[str]:
        """The target token strings, [BOS] and [EOS] included."""
        return [BOS] + self.tgt.encode(text, add_special_tokens=False).tokens + [EOS]

    # ---------------------------------------------------------------- decoding
    def decode_tgt(self, ids: list[list[int]]) -> list[str]:
        """Target texts: each sequence cut at its first [EOS], [PAD]/[BOS] dropped."""
        return [_decode(self.tgt, seq) for seq in ids]

    def decode_src(self, ids: list[list[int]]) -> list[str]:
        """Source texts, as ``decode_tgt``."""
        return [_decode(self.src, seq) for seq in ids]

    def tgt_id_to_token(self, i: int) -> str:
        return _id_to_token(self.tgt, i)

    # ---------------------------------------------------------------- files
    def save(self, directory: str | Path) -> None:
        """Write meta.json and the tokenizer JSON file(s), atomically each."""
        directory = Path(directory)
        files = {"src": "joint.json", "tgt": "joint.json"} if self.joint else {
            "src": "src.json", "tgt": "tgt.json"}
        for side, name in files.items():
            atomic_write_text(directory / name, getattr(self, side).to_str(pretty=True) + "\n")
        for stale in {"joint.json", "src.json", "tgt.json"} - set(files.values()):
            (directory / stale).unlink(missing_ok=True)
        meta = {"format": _FORMAT, "kind": self.kind, "joint": self.joint, "files": files,
                "src_vocab_size": self.src_vocab_size, "tgt_vocab_size": self.tgt_vocab_size,
                "special_tokens": SPECIAL_TOKENS,
                # Only where on: a tokenizer made before byte fallback, saved again (a run's,
                # fine-tuned on new data), keeps its bytes and so its fingerprint.
                **({"byte_fallback": True} if self.byte_fallback else {})}
        atomic_write_text(directory / META_FILE, json.dumps(meta, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> Tokenizers:
        """Read a directory written by ``save``; a clear error for anything missing."""
        directory = Path(directory)
        meta_path = directory / META_FILE
        if not meta_path.is_file():
            raise AiaynError(f"{directory}: no tokenizer here ({META_FILE} missing); "
                             "run `aiayn prepare` to make one")
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            files, kind = meta["files"], meta["kind"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise AiaynError(f"{meta_path}: not a tokenizer description ({exc})") from None
        loaded: dict[str, Tokenizer] = {}
        for name in sorted(set(files.values())):
            path = directory / name
            if not path.is_file():
                raise AiaynError(f"{path}: tokenizer file missing")
            try:
                loaded[name] = Tokenizer.from_file(str(path))
            except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
                raise AiaynError(f"{path}: not a tokenizers JSON file ({exc})") from None
        return cls(loaded[files["src"]], loaded[files["tgt"]], kind)


class ArrayEncoder:
    """Encodes many sentences into one flat numpy array of ids and their lengths, fast:
    what ``aiayn prepare`` writes (one per side: ``Tokenizers.array_encoders``).

    The result equals ``encode_src``/``encode_tgt`` (the Rust tokenizer on each whole
    sentence; a test checks it), but each distinct word goes through the Rust
    ``encode_batch`` only once. That holds because nothing in the pipeline crosses a space:
    NFC does not compose across one, ``Metaspace`` turns each space into the ``▁`` that
    starts the next piece (and puts one before the first word), and BPE merges stay inside
    a piece; so a sentence's ids are its words' ids one after another. Encoding whole
    sentences costs ~70 us each on a 2-core EPYC (the per-sentence work in Rust, not the
    merges), ~5x more than looking words up. Sentences for which that argument does not
    hold (leading, trailing or doubled spaces, a special token's text) are encoded whole.

    ``prefix``/``suffix``: ids put around every sentence ([BOS] / [EOS]). The word cache
    is emptied when it holds ``max_words`` words, so its memory stays bounded.
    """

    def __init__(self, tok: Tokenizer, prefix: Sequence[int], suffix: Sequence[int],
                 max_words: int = 1_000_000) -> None:
        self.tok = tok
        self.prefix, self.suffix = list(prefix), list(suffix)
        self.max_words = max_words
        self.dtype = ids_dtype(tok.get_vocab_size())
        self._clear()

    def _clear(self) -> None:
        """An empty cache: word -> row of (start, length) into one flat array of ids; row 0
        is the prefix, row 1 the suffix."""
        self.rows: dict[str, int] = _Rows()
        self._ids = np.array(self.prefix + self.suffix, dtype=self.dtype)
        self._starts = np.array([0, len(self.prefix)], dtype=np.int64)
        self._lens = np.array([len(self.prefix), len(self.suffix)], dtype=np.int64)

    def _add(self, keys: list[str], texts: list[str]) -> None:
        """Encode ``texts`` with the Rust tokenizer (parallel) and append them as rows."""
        encoded = _batch_ids(self.tok, texts)
        lens = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        ids = np.fromiter(itertools.chain.from_iterable(encoded), dtype=self.dtype,
                          count=int(lens.sum()))
        first = len(self._lens)
        self.rows.update(zip(keys, range(first, first + len(keys)), strict=True))
        self._starts = np.concatenate([self._starts, len(self._ids) + np.cumsum(lens) - lens])
        self._lens = np.concatenate([self._lens, lens])
        self._ids = np.concatenate([self._ids, ids])

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(the ids of all the sentences, one after another, in one array; their lengths)."""
        if len(self._lens) > self.max_words:
            self._clear()
        split = [text.split(" ") for text in texts]
        looked = self._look_up(split)
        missing = np.flatnonzero(looked < 0)
        if len(missing) and self._learn(texts, split, missing):
            looked = self._look_up(split)  # some sentences became one entry each
        elif len(missing):  # new words, now learnt
            flat = list(itertools.chain.from_iterable(split))
            looked[missing] = [self.rows[flat[j]] for j in missing.tolist()]
        # Rows per sentence: the prefix (row 0), its words, the suffix (row 1).
        counts = np.fromiter(map(len, split), dtype=np.int64, count=len(split)) + 2
        ends = np.cumsum(counts)
        rows = np.empty(int(ends[-1]) if len(ends) else 0, dtype=np.int64)
        inner = np.ones(len(rows), dtype=bool)
        inner[ends - counts] = inner[ends - 1] = False
        rows[~inner] = np.tile([0, 1], len(split))
        rows[inner] = looked
        # A ragged take: the ids of every row, in order.
        take = self._lens[rows]
        token_ends = np.cumsum(take)
        within = np.arange(int(token_ends[-1]) if len(rows) else 0) - np.repeat(token_ends - take, take)
        ids = self._ids[np.repeat(self._starts[rows], take) + within]
        sentence_ends = token_ends[ends - 1] if len(rows) else token_ends
        return ids, np.diff(sentence_ends, prepend=0)

    def _look_up(self, split: list[list[str]]) -> np.ndarray:
        """The row of every word of every sentence, in order; -1 where there is none."""
        words = itertools.chain.from_iterable(split)
        return np.fromiter(map(self.rows.__getitem__, words), dtype=np.int64)

    def _learn(self, texts: Sequence[str], split: list[list[str]], missing: np.ndarray) -> bool:
        """Add the words at the ``missing`` positions. A sentence for which word-by-word
        encoding would differ (an empty word: a leading, trailing or doubled space; a
        special token's text) becomes one entry of its own instead, under a key with a
        space (no word has one). Returns whether any did."""
        flat = list(itertools.chain.from_iterable(split))
        starts = np.cumsum([0] + [len(words) for words in split])
        sentence = np.searchsorted(starts, missing, side="right") - 1
        new, whole, changed = {}, {}, False
        for j, i in zip(missing.tolist(), sentence.tolist(), strict=True):
            word = flat[j]
            if word == "" or ("[" in word and any(t in word for t in SPECIAL_TOKENS)):
                key = " " + texts[i]
                split[i], changed = [key], True
                if key not in self.rows:
                    whole[key] = texts[i]
            else:
                new[word] = word
        for batch in (new, whole):
            if batch:
                self._add(list(batch), list(batch.values()))
        return changed


class _Rows(dict):
    """word -> row; a word not in it reads as -1 (a lookup at C speed, no default argument)."""

    def __missing__(self, key: str) -> int:
        return -1


def tokenizer_fingerprint(directory: str | Path) -> str:
    """SHA-256 over a tokenizer directory's JSON files (``meta.json`` and the tokenizer
    files, names and bytes, sorted by name): equal fingerprints mean the same ids for every
    text. The one identity of a tokenizer: prepared ids record it (aiayn.data.prepare; checked
    by aiayn.data.prepared) and a run is fine-tuned only on data of its own (aiayn.training.transfer)."""
    directory = Path(directory)
    files = sorted(directory.glob("*.json"))
    if not files:
        raise AiaynError(f"{directory}: no tokenizer files here")
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def ids_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer type that holds every id of the vocabulary."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def train_tokenizers(pairs: Sequence[tuple[str, str]] | Callable[[], Iterable[tuple[str, str]]],
                     cfg: DataConfig, progress: bool = False, total: int | None = None,
                     tags: Sequence[str] = ()) -> Tokenizers:
    """Train the tokenizer(s) on (source, target) pairs -- the train split only.

    ``pairs``: a sequence, or a function that returns a fresh iterator over them (so that a
    corpus too large for memory streams from disk; separate vocabularies read it twice).
    ``cfg.joint_vocab``: one vocabulary of ``cfg.vocab_size`` for both sides; else one of
    that size per side. ``cfg.tokenizer``: "bpe" or "wordlevel" (``cfg.min_frequency``
    applies to both: rarer merges / words are left out). ``cfg.byte_fallback`` (BPE, a
    vocab_size of 1024 or more: ``uses_byte_fallback``): the last 256 of the vocab_size
    pieces are the bytes. ``progress``: a bar with the rate
    at which pairs are counted (``total`` pairs, if known); that pass is most of the time,
    the merges (BPE) come after it. ``tags``: direction tags (aiayn.data.directions), special
    pieces of the source vocabulary after the four of SPECIAL_TOKENS, never split."""
    if cfg.tokenizer not in KINDS:
        raise AiaynError(f"data.tokenizer must be one of {', '.join(KINDS)}, got {cfg.tokenizer!r}")
    fresh = pairs if callable(pairs) else (lambda: iter(pairs))
    if next(iter(fresh()), None) is None:
        raise AiaynError("cannot train a tokenizer on no sentences")

    def texts(side: str) -> Iterator[str]:
        # NFC here (a quick check on text that already is) rather than in the tokenizer
        # while it trains: the same vocabulary, 15% less time.
        bar = progress_bar(fresh(), progress, f"tokenizer ({side})", total)
        for src, tgt in bar:
            if side != "target":
                yield unicodedata.normalize("NFC", src)
            if side != "source":
                yield unicodedata.normalize("NFC", tgt)

    if cfg.joint_vocab:
        joint = _train_one(texts("joint"), cfg, tags)
        return Tokenizers(joint, joint, cfg.tokenizer)
    return Tokenizers(_train_one(texts("source"), cfg, tags), _train_one(texts("target"), cfg),
                      cfg.tokenizer)


def new_tokenizer(kind: str) -> Tokenizer:
    """An untrained tokenizer with the text pipeline described at the top of this module."""
    model = models.BPE(unk_token=UNK) if kind == "bpe" else models.WordLevel(unk_token=UNK)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Metaspace(), pre_tokenizers.Punctuation()]
    )
    tok.decoder = decoders.Metaspace()
    return tok


def _train_one(texts: Iterable[str], cfg: DataConfig, tags: Sequence[str] = ()) -> Tokenizer:
    """Train on NFC ``texts`` (the normalizer is set after training), ``tags`` special
    pieces after SPECIAL_TOKENS."""
    tok = new_tokenizer(cfg.tokenizer)
    normalizer, tok.normalizer = tok.normalizer, None
    trainer_class = trainers.BpeTrainer if cfg.tokenizer == "bpe" else trainers.WordLevelTrainer
    # Rust's own bars show no rate and would fight with the tqdm bar over the pairs.
    fallback = uses_byte_fallback(cfg)
    learnt = cfg.vocab_size - (len(BYTE_PIECES) if fallback else 0)
    trainer = trainer_class(vocab_size=learnt, min_frequency=cfg.min_frequency,
                            special_tokens=SPECIAL_TOKENS + list(tags), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.normalizer = normalizer
    return with_byte_fallback(tok) if fallback else tok


def uses_byte_fallback(cfg: DataConfig) -> bool:
    """Whether a tokenizer trained under ``cfg`` gets byte fallback: data.byte_fallback, BPE,
    and a vocabulary of at least BYTE_FALLBACK_MIN_VOCAB pieces."""
    return cfg.byte_fallback and cfg.tokenizer == "bpe" and cfg.vocab_size >= BYTE_FALLBACK_MIN_VOCAB


def with_byte_fallback(tok: Tokenizer) -> Tokenizer:
    """A trained BPE tokenizer with the 256 byte pieces appended to its vocabulary (ids after
    the learnt ones, so a learnt piece keeps its id) and byte fallback on: a character
    outside the learnt alphabet is encoded as its UTF-8 bytes instead of [UNK], and decoded
    back (decoders.ByteFallback, then Metaspace)."""
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    next_id = max(vocab.values()) + 1
    for piece in BYTE_PIECES:
        if piece not in vocab:  # never learnt: Punctuation keeps "<" and ">" pieces apart
            vocab[piece], next_id = next_id, next_id + 1
    spec["model"]["byte_fallback"] = True
    out = Tokenizer.from_str(json.dumps(spec))
    out.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    return out


def _check_special_ids(tok: Tokenizer, side: str) -> None:
    for token, expected in zip(SPECIAL_TOKENS, range(len(SPECIAL_TOKENS)), strict=True):
        if tok.token_to_id(token) != expected:
            raise AiaynError(f"{side} tokenizer: {token} has id {tok.token_to_id(token)}, "
                             f"expected {expected}; it was not made by aiayn")


def _encode(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    if isinstance(texts, str):  # a common slip: one string is not a list of sentences
        raise TypeError("encode_src/encode_tgt take a list of strings")
    texts = list(texts)
    try:
        return _batch_ids(tok, texts)
    except TypeError:  # the tokenizer's words for text that is no Unicode it can read
        for number, text in enumerate(texts, 1):
            try:
                if isinstance(text, str):
                    text.encode("utf-8")
            except UnicodeEncodeError as exc:  # a lone surrogate, as JSON's "\ud800" gives
                raise AiaynError(f"sentence {number} is not valid Unicode: "
                                 f"{text[exc.start]!r} at character {exc.start + 1} is half "
                                 "of a UTF-16 pair") from None
        raise


def _batch_ids(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's ids. ``encode_batch_fast`` (newer tokenizers libraries) leaves out the
    character offsets that only ``src_offsets`` reads: the same ids in ~4/5 of the time
    (38 -> 30 us a sentence on a 2-core EPYC), where `aiayn serve` tokenizes every request."""
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    return [enc.ids for enc in encode(texts, add_special_tokens=False)]


def _decode(tok: Tokenizer, ids: list[int]) -> str:
    ids = list(ids)
    if EOS_ID in ids:
        ids = ids[: ids.index(EOS_ID)]
    kept = [i for i in ids if i not in (PAD_ID, BOS_ID)]
    return tok.decode(kept, skip_special_tokens=False)


def _id_to_token(tok: Tokenizer, i: int) -> str:
    token = tok.id_to_token(int(i))
    if token is None:
        raise IndexError(f"token id {i} is outside the vocabulary of {tok.get_vocab_size()}")
    return token
