"""Tokenizers (Hugging Face `tokenizers`): BPE by default, WordLevel as the tutorials use.

Special tokens have the same ids everywhere; the model's pad_id is PAD_ID.

Both kinds share one text pipeline, chosen so that decoding gives the text back:

- normalizer: Unicode NFC (the corpora are NFC with single spaces already, see
  ``aiayn.corpora.normalize_text``; this also normalizes what users type at translate time);
- pre-tokenizer: ``Metaspace`` (each space becomes ``▁``, the start of the next word, as in
  SentencePiece) then ``Punctuation`` (every punctuation mark is its own piece, so "earth."
  and "earth" share "▁earth");
- decoder: ``Metaspace``, which turns ``▁`` back into spaces.

So ``decode(encode(s)) == s`` for any ``s`` that is NFC with single spaces and no leading or
trailing space, as long as its characters (BPE) or words (WordLevel) were seen in training;
anything else is ``[UNK]``, which decoding keeps visible as ``[UNK]``.

Source ids are ``tokens + [EOS]``; target ids are ``[BOS] + tokens + [EOS]``.

A tokenizer directory holds ``meta.json`` (kind, joint) and either ``joint.json`` (one
vocabulary for both sides) or ``src.json`` and ``tgt.json``, each a `tokenizers` JSON file.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from aiayn.config import DataConfig
from aiayn.errors import AiaynError
from aiayn.io import atomic_write_text

PAD, UNK, BOS, EOS = "[PAD]", "[UNK]", "[BOS]", "[EOS]"
SPECIAL_TOKENS = [PAD, UNK, BOS, EOS]
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

KINDS = ("bpe", "wordlevel")
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

    def src_tokens(self, text: str) -> list[str]:
        """The source token strings the model sees, [EOS] included."""
        return self.src.encode(text, add_special_tokens=False).tokens + [EOS]

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
                "special_tokens": SPECIAL_TOKENS}
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


def train_tokenizers(pairs: list[tuple[str, str]], cfg: DataConfig,
                     progress: bool = False) -> Tokenizers:
    """Train the tokenizer(s) on (source, target) pairs -- the train split only.

    ``cfg.joint_vocab``: one vocabulary of ``cfg.vocab_size`` for both sides; else one of
    that size per side. ``cfg.tokenizer``: "bpe" or "wordlevel" (``cfg.min_frequency``
    applies to both: rarer merges / words are left out)."""
    if cfg.tokenizer not in KINDS:
        raise AiaynError(f"data.tokenizer must be one of {', '.join(KINDS)}, got {cfg.tokenizer!r}")
    if not pairs:
        raise AiaynError("cannot train a tokenizer on no sentences")
    if cfg.joint_vocab:
        joint = _train_one(_both_sides(pairs), cfg, progress)
        return Tokenizers(joint, joint, cfg.tokenizer)
    src = _train_one((s for s, _ in pairs), cfg, progress)
    tgt = _train_one((t for _, t in pairs), cfg, progress)
    return Tokenizers(src, tgt, cfg.tokenizer)


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


def _train_one(texts: Iterable[str], cfg: DataConfig, progress: bool) -> Tokenizer:
    tok = new_tokenizer(cfg.tokenizer)
    trainer_class = trainers.BpeTrainer if cfg.tokenizer == "bpe" else trainers.WordLevelTrainer
    trainer = trainer_class(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                            special_tokens=SPECIAL_TOKENS, show_progress=progress)
    tok.train_from_iterator(texts, trainer)
    return tok


def _both_sides(pairs: list[tuple[str, str]]) -> Iterator[str]:
    for src, tgt in pairs:
        yield src
        yield tgt


def _check_special_ids(tok: Tokenizer, side: str) -> None:
    for token, expected in zip(SPECIAL_TOKENS, range(len(SPECIAL_TOKENS)), strict=True):
        if tok.token_to_id(token) != expected:
            raise AiaynError(f"{side} tokenizer: {token} has id {tok.token_to_id(token)}, "
                             f"expected {expected}; it was not made by aiayn")


def _encode(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    if isinstance(texts, str):  # a common slip: one string is not a list of sentences
        raise TypeError("encode_src/encode_tgt take a list of strings")
    return [enc.ids for enc in tok.encode_batch(list(texts), add_special_tokens=False)]


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
