"""Several corpora in one prepared directory, and the direction tags of a model that
translates into more than one language.

A corpus spec (``data.corpus``, ``aiayn prepare --corpus``) is one line per corpus::

    bible:eng-spa
    bible:spa-eng   weight=1
    tsv:in_domain.tsv  weight=3  src=en tgt=es

Each line is a spec of ``aiayn.data.corpora`` and, after it, options ``key=value``:
``weight`` (its share of the training batches, against the other lines' weights: given on
every line or on none; none: the corpora are pooled at their natural sizes), ``src`` and
``tgt`` (the line's languages, where neither the spec nor the script tells them), ``tag``
(``tag=bt``: every source of this corpus starts with the piece ``<bt>``, e.g. to mark
back-translated sources as synthetic: Caswell et al. 2019, "Tagged Back-Translation"),
``splits=train`` (all its pairs train: no dev or test is held out of it, e.g. synthetic
pairs, which nobody wants a score on).

Where the lines' target languages differ, the model needs to be told which one to write:
every source sentence starts with the tag of its target language, ``<2es>`` (Johnson et al.
2017, "Google's Multilingual Neural Machine Translation System"), one special piece of the
tokenizer that is never split. The tag is part of the source *text* (train.jsonl, dev.jsonl
hold "<2es> In the beginning ..."), so everything that encodes text (validation, `aiayn
evaluate`, an exported tokenizer) sees what training saw; ``with_tag`` is the one place that
adds it to a user's sentence (``Translator(to=...)``, `aiayn translate --to`, serve's
``"to"``). A model with one target language has no tags, and nothing changes for it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from aiayn.errors import AiaynError

TAG_PATTERN = re.compile(r"<2([A-Za-z][A-Za-z0-9_-]*)>")
OPTIONS = ("weight", "src", "tgt", "tag", "splits")
SOURCE_TAG = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")  # tag=NAME: the piece <NAME>


def tag_of(language: str) -> str:
    """The direction tag of a target language: ``<2es>``."""
    return f"<2{language}>"


@dataclass(frozen=True)
class CorpusLine:
    """One line of a corpus spec: the spec and its options."""

    spec: str
    weight: float | None = None
    src_lang: str | None = None
    tgt_lang: str | None = None
    tag: str | None = None
    train_only: bool = False

    @property
    def source_tag(self) -> str | None:
        """The piece ``tag=NAME`` puts before every source of this corpus: ``<NAME>``."""
        return f"<{self.tag}>" if self.tag else None


def corpus_lines(text: str) -> list[CorpusLine]:
    """The lines of ``data.corpus`` (blank lines skipped), options parsed and checked: a
    one-line error for an unknown option, a weight that is not a positive number, or
    weights on some lines only."""
    lines = []
    for raw in text.splitlines():
        words = raw.split()
        if not words:
            continue
        spec_words, options = [], {}
        for word in words:
            key, eq, value = word.partition("=")
            if eq and key in OPTIONS and spec_words:
                if key in options:
                    raise AiaynError(f"corpus line {raw.strip()!r}: {key}= given twice")
                options[key] = value
            elif eq and spec_words and ":" not in word and "/" not in word:
                raise AiaynError(f"corpus line {raw.strip()!r}: unknown option {key!r}; "
                                 f"options are {', '.join(o + '=' for o in OPTIONS)}")
            elif options:
                raise AiaynError(f"corpus line {raw.strip()!r}: {word!r} after the options; "
                                 "write the spec first, then key=value options")
            else:
                spec_words.append(word)
        tag = options.get("tag")
        if tag is not None and not (SOURCE_TAG.fullmatch(tag) and not TAG_PATTERN.fullmatch(
                f"<{tag}>")):
            raise AiaynError(f"corpus line {raw.strip()!r}: tag must be a name of letters, "
                             f"digits, - and _ that starts with a letter, got {tag!r}")
        splits = options.get("splits")
        if splits not in (None, "train"):
            raise AiaynError(f"corpus line {raw.strip()!r}: splits=train is the one choice "
                             f"(no dev or test held out of this corpus), got {splits!r}")
        lines.append(CorpusLine(" ".join(spec_words), _weight(options.get("weight"), raw),
                                options.get("src"), options.get("tgt"), tag,
                                splits == "train"))
    if not lines:
        raise AiaynError("data.corpus is empty; give a corpus spec such as bible:eng-spa")
    weighted = [line.weight is not None for line in lines]
    if any(weighted) and not all(weighted):
        raise AiaynError("weight= is given on some corpus lines but not on others; give every "
                         "line a weight (its share of the training batches), or none")
    return lines


def _weight(value: str | None, raw: str) -> float | None:
    if value is None:
        return None
    try:
        weight = float(value)
    except ValueError:
        weight = math.nan
    if not (math.isfinite(weight) and weight > 0):
        raise AiaynError(f"corpus line {raw.strip()!r}: weight must be a positive number, "
                         f"got {value!r}")
    return weight


def needs_tags(target_languages: list[str]) -> bool:
    """Whether corpora of these target languages need direction tags: more than one."""
    return len(set(target_languages)) > 1


def check_tag_free(text: str, tags: list[str], where: str) -> None:
    """A corpus text that contains a tag (a direction's or a ``tag=`` option's) would be
    read as that tag: refused."""
    if "<" in text:
        for tag in tags:
            if tag in text:
                raise AiaynError(f"{where}: the text contains {tag}, a tag of this data; it "
                                 "would be read as the tag, not as text")


def with_tag(texts: list[str], tags: dict[str, str], to: str | None, what: str) -> list[str]:
    """Source sentences with the tag of ``to`` in front, for a model whose ``tags`` map
    target languages to their tag (empty: one direction, the texts as they are).

    A sentence that starts with a tag already (a prepared split's) keeps it. Refused in one
    line: ``to`` for a model without tags (it has one direction), a language the model
    lacks, and no ``to`` where a sentence has no tag."""
    if not tags:
        if to is not None:
            raise AiaynError(f"{what} translates in one direction and has no direction tags; "
                             "drop --to (Python: to=; serve: \"to\")")
        return texts
    if to is not None and to not in tags:
        raise AiaynError(f"{what} does not translate into {to!r}; it translates into "
                         f"{', '.join(sorted(tags))}")
    out = []
    for text in texts:
        if TAG_PATTERN.match(text):
            out.append(text)
        elif to is None:
            raise AiaynError(f"{what} translates into {', '.join(sorted(tags))}: say which "
                             "with --to (Python: to=; serve: \"to\")")
        else:
            out.append(f"{tags[to]} {text}")
    return out
