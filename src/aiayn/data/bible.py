"""The Bible as a parallel corpus: verse pairs read from CrossWire's SWORD modules.

``bible:eng-spa`` and its kin (``aiayn.data.corpora``'s spec table) pair the verses of two
modules that share a versification scheme, with a fixed split by whole books
(``BIBLE_TEST_BOOKS``, ``BIBLE_DEV_BOOKS``) so that no verse of a held-out book is trained
on. The modules are Debian's (sword-text-web, -sparv, -kjv) or any under $SWORD_PATH, read
with pysword; ``clean_osis`` turns their OSIS markup into plain verse text, and
``chapters_versified_differently`` finds the chapters whose verses do not pair one to one.
"""

from __future__ import annotations

import functools
import html
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiayn.config import DataConfig
from aiayn.data.pairs import SPLITS, Pair, RawCorpus, normalize_text
from aiayn.errors import AiaynError
from aiayn.util.progress import bar as progress_bar


@dataclass(frozen=True)
class BibleModule:
    module: str  # SWORD module name
    package: str  # Debian package holding it
    title: str


BIBLE_MODULES = {
    "eng": BibleModule("engWEB2015eb", "sword-text-web", "World English Bible"),
    "spa": BibleModule("spaRV1909eb", "sword-text-sparv", "Reina-Valera 1909"),
    "kjv": BibleModule("engKJV2006eb", "sword-text-kjv", "King James Version"),
}
BIBLE_PAIRS = ("eng-spa", "spa-eng", "kjv-spa", "spa-kjv")
# Whole books held out (OSIS names), so that no verse of a test book is seen in training.
BIBLE_TEST_BOOKS = ("Ruth", "Joel", "Jonah", "Gal", "Phil", "Titus", "Jas", "1John")
BIBLE_DEV_BOOKS = ("Obad", "Nah", "Hab", "Zeph", "Hag", "Col", "2Pet")
DEFAULT_SWORD_PATH = "/usr/share/sword"
_APT_HINT = "apt-get install " + " ".join(m.package for m in BIBLE_MODULES.values())


def sword_path() -> Path:
    """Where SWORD modules live: $SWORD_PATH (as for SWORD itself), else Debian's place."""
    return Path(os.environ.get("SWORD_PATH") or DEFAULT_SWORD_PATH)


def bible_split(book: str) -> str:
    """The fixed split of a book (OSIS name)."""
    if book in BIBLE_TEST_BOOKS:
        return "test"
    if book in BIBLE_DEV_BOOKS:
        return "dev"
    return "train"


def parse_bible_spec(arg: str) -> tuple[str, list[str]]:
    """``eng+kjv-spa`` -> (``eng-spa``, [``kjv-spa``]): the pair of every split, and the pairs
    that add training verses only (a side may list several modules, joined by ``+``; its
    first one is the held-out splits')."""
    sides = arg.split("-")
    codes = [side.split("+") for side in sides]
    pairs = [f"{s}-{t}" for s in codes[0] for t in codes[-1]] if len(sides) == 2 else []
    if (not pairs or any(p not in BIBLE_PAIRS for p in pairs)
            or any(len(set(side)) != len(side) for side in codes)):
        raise AiaynError(f"unknown Bible pair 'bible:{arg}'; valid: "
                         + ", ".join(f"bible:{p}" for p in BIBLE_PAIRS)
                         + ", and a side of several modules for more training verses, "
                         "e.g. bible:eng+kjv-spa")
    return pairs[0], pairs[1:]


def read_bible(arg: str, cfg: DataConfig, progress: bool) -> RawCorpus:
    """The reader of a ``bible:`` spec (``arg``: what follows the colon)."""
    main, extras = parse_bible_spec(arg)
    pairs, dropped = read_bible_pairs(main, progress=progress)
    routed = [(pair, bible_split(_book(pair.ref))) for pair in pairs]
    train_books = {_book(pair.ref) for pair, split in routed if split == "train"}
    for extra in extras:  # training verses only: the held-out books stay unseen
        more, more_dropped = read_bible_pairs(extra, books=train_books, progress=progress)
        routed += [(Pair(p.src, p.tgt, f"{p.ref}@{extra}"), "train") for p in more]
        dropped += more_dropped

    def title(code: str) -> str:
        module = BIBLE_MODULES[code]
        return f"{module.title} ({module.module})"

    src_code, tgt_code = main.split("-")
    extra_codes = {code for extra in extras for code in extra.split("-")} - {src_code, tgt_code}
    description = f"{title(src_code)} -> {title(tgt_code)}" + "".join(
        f"; in train also {title(code)}" for code in sorted(extra_codes))
    return RawCorpus(
        description=description,
        given=set(SPLITS),
        pairs=routed,
        split_rule="by book: test " + ", ".join(BIBLE_TEST_BOOKS) + "; dev "
        + ", ".join(BIBLE_DEV_BOOKS),
        dropped={"versification": dropped},
    )


def _book(ref: str) -> str:
    return ref.split(".")[0]


def read_bible_pairs(pair_code: str, books: Iterable[str] | None = None,
                     progress: bool = False) -> tuple[list[Pair], int]:
    """Verse pairs of the books (OSIS names; default: all) present in both modules, in
    canonical order, cleaned; verses of chapters versified differently are left out.

    Returns the pairs and the number of non-empty pairs left out for versification."""
    if pair_code not in BIBLE_PAIRS:
        raise AiaynError(f"unknown Bible pair 'bible:{pair_code}'; valid: "
                         + ", ".join(f"bible:{p}" for p in BIBLE_PAIRS))
    src_code, tgt_code = pair_code.split("-")
    src_bible, tgt_bible = open_sword_modules(
        [BIBLE_MODULES[src_code].module, BIBLE_MODULES[tgt_code].module])
    src_books, tgt_books = sword_books(src_bible), sword_books(tgt_bible)
    wanted = set(books) if books is not None else None
    shared = [b for b in src_books if b in tgt_books and (wanted is None or b in wanted)]
    kept: list[Pair] = []
    dropped = 0
    for book in progress_bar(shared, progress, "reading books", unit=""):
        src_verses = dict(read_sword_book(src_bible, src_books[book]))
        pairs = [
            Pair(clean_osis(src_verses[ref]), clean_osis(tgt_raw), ref)
            for ref, tgt_raw in read_sword_book(tgt_bible, tgt_books[book])
            if ref in src_verses  # a verse in one versification only is no pair
        ]
        shifted = chapters_versified_differently(pairs)
        for pair in pairs:
            if _chapter(pair.ref) in shifted and pair.src and pair.tgt:
                dropped += 1
            else:  # (a pair empty on one side is kept here and dropped as "empty")
                kept.append(pair)
    return kept, dropped


def _chapter(ref: str) -> int:
    return int(ref.split(".")[1])


def chapters_versified_differently(pairs: list[Pair]) -> set[int]:
    """Chapters of one book whose verses do not pair one to one.

    The modules share a versification scheme (KJV's, or NRSVA's for the WEB), but a text
    that divides chapters differently leaves the scheme's last verse(s) of a chapter empty
    and starts the next chapter early: RV1909's Jonah 2:1 is the KJV's Jonah 1:17, so every
    verse of Jonah 2 would pair with its neighbour. A chapter ending in a verse empty on one
    side only marks that chapter and the next as shifted (or merged near the end)."""
    last: dict[int, Pair] = {}
    for pair in pairs:
        last[_chapter(pair.ref)] = pair
    shifted = set()
    for chapter, pair in last.items():
        if bool(pair.src) != bool(pair.tgt):
            shifted.update(c for c in (chapter, chapter + 1) if c in last)
    return shifted


def open_sword_modules(names: list[str]) -> list[Any]:
    """Open SWORD Bible modules with pysword; a clear error names the missing packages."""
    try:
        from pysword.modules import SwordModules
    except ImportError:
        raise AiaynError("reading the Bible needs the Python package pysword: "
                         "pip install pysword") from None
    root = sword_path()
    found: dict[str, Any] = {}
    if (root / "mods.d").is_dir():
        library = SwordModules(paths=[str(root)])
        found = library.parse_modules()
    missing = [name for name in names if name not in found]
    if missing:
        raise AiaynError(
            f"SWORD module(s) {', '.join(missing)} not found in {root} (set SWORD_PATH to look "
            f"elsewhere); install the Debian packages: {_APT_HINT}"
        )
    bibles = []
    for name in names:
        bible = library.get_bible_from_module(name)
        # pysword inflates a whole book's compressed block for every verse it returns
        # (~1 minute per Bible); keeping the last blocks makes reading take a second.
        if hasattr(bible, "_decompressed_text"):
            bible._decompressed_text = functools.lru_cache(maxsize=4)(bible._decompressed_text)
        bibles.append(bible)
    return bibles


def sword_books(bible: Any) -> dict[str, Any]:
    """The books of a module's versification by OSIS name, in canonical order."""
    books = {}
    for testament_books in bible.get_structure().get_books().values():
        for book in testament_books:
            books[book.osis_name] = book
    return books


def read_sword_book(bible: Any, book: Any) -> Iterator[tuple[str, str]]:
    """(``Book.chapter.verse``, raw OSIS text) for every verse of ``book``."""
    refs = [
        f"{book.osis_name}.{chapter}.{verse}"
        for chapter, n_verses in enumerate(book.chapter_lengths, 1)
        for verse in range(1, n_verses + 1)
    ]
    texts = list(bible.get_iter(books=[book.name], clean=False))
    if len(texts) != len(refs):  # pysword skips unreadable verses: the refs would shift
        raise AiaynError(f"SWORD module: {book.name} has {len(texts)} readable verses of "
                         f"{len(refs)}; the module looks damaged, reinstall it ({_APT_HINT})")
    return zip(refs, texts, strict=True)


# OSIS elements whose content is not verse text: footnotes and cross-references (with
# their nested <reference>/<rdg>/<catchWord>), the speaker labels of the Song of Songs,
# and headings that are not canonical (the Psalms' canonical titles are verse text).
_NOT_TEXT = re.compile(
    r"<(note|speaker)\b[^>]*(?<!/)>.*?</\1\s*>"
    r"|<title\b(?![^>]*canonical=\"true\")[^>]*(?<!/)>.*?</title\s*>",
    re.S,
)
_REMOVED = "<removed/>"
_TAG_RUN = re.compile(r"(?:<[^>]*>)+")
_OPENERS = "“‘(¿¡[«"
# Markup that cannot glue two words: followed by neither a word nor an opening mark, or
# preceded by a space or an opening mark. (Written to start with a literal, for speed.)
_TAG_RUN_BEFORE_NO_WORD = re.compile(rf"(?:<[^>]*>)+(?![\w{_OPENERS}<])")
_TAG_RUN_AFTER_SPACE = re.compile(rf"([\s{_OPENERS}])(?:<[^>]*>)+")
_TAG = re.compile(r"<(/?)([A-Za-z]+)\b[^>]*?(/?)>")
# Elements that always separate words: poetry lines, paragraphs, milestones, lists, ...
_BLOCK_TAGS = {"l", "lg", "lb", "div", "p", "chapter", "verse", "title", "list", "item",
               "milestone", "removed", "speaker", "note"}
# A footnote between a word and its "?" leaves a space in one WEB verse (Luke 12:6).
_SPACE_BEFORE_PUNCT = re.compile(r" ([,.;:!?])(?= |$)")


def clean_osis(text: str) -> str:
    """Plain verse text from OSIS markup: tags and Strong's numbers gone, footnotes and
    non-canonical headings gone with their content, words never glued together.

    Where markup is removed between two words with no space left, a space is put back when
    the markup separated words: a footnote ("God<note>..</note>created"), a block element,
    or one word element closing and the next opening ("</w><transChange>"). Markup inside a
    word ("give</w>n") is removed without a space.
    """
    text = _NOT_TEXT.sub(_REMOVED, text)
    text = _TAG_RUN_BEFORE_NO_WORD.sub("", text)
    text = _TAG_RUN_AFTER_SPACE.sub(r"\1", text)
    # What is left stands between a word (or closing mark) and a word (or opening mark).
    text = _TAG_RUN.sub(lambda m: " " if _separates_words(m.group(0)) else "", text)
    text = html.unescape(text).replace("¶", " ")  # KJV paragraph marks are not words
    return _SPACE_BEFORE_PUNCT.sub(r"\1", normalize_text(text))


def _separates_words(run: str) -> bool:
    closed = False
    for m in _TAG.finditer(run):
        is_end, name, self_closing = m.group(1) == "/", m.group(2), m.group(3) == "/"
        if name in _BLOCK_TAGS:
            return True
        if is_end:
            closed = True
        elif not self_closing and (closed or name == "w"):
            return True
    return False
