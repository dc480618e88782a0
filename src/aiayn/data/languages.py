"""What changes with the language of a side: how its length is counted, and how BLEU
tokenizes it.

Two things depend on how a language is written, and only those two:

- **Length** (``length_units``), which the corpus filters compare (``data.max_words``,
  ``data.max_length_ratio``; aiayn.data.corpora). Text with spaces counts its words. Scripts
  written without spaces (Chinese, Japanese, Thai, Lao, Khmer, Burmese) count their
  characters, converted to words at about the rate a translation has: 1.5 Han characters,
  3 kana, 4 letters of the Southeast Asian scripts per English word. So "I love you." and
  "我爱你。" are 3 and 2 units, and a normal English-Chinese or English-Japanese pair stays
  within the length ratio that English-Spanish pairs meet. The count is per text, from its
  characters alone: the filter needs no language and runs while the corpus streams (the
  tokenizer, whose pieces would be another fair unit, is learnt after the filter).
- **BLEU's tokenizer** (``bleu_tokenize``): sacreBLEU's ``13a`` splits at spaces and
  punctuation, which leaves a Chinese sentence one token; ``zh`` splits Chinese characters,
  ``ja-mecab`` Japanese words (with its package, else ``char``), ``char`` every character.

The language of a side is known, in this order, from ``data.src_lang``/``data.tgt_lang``,
from the corpus spec (``bible:eng-spa``, ``hf:opus_books:en-it``), or from the script of
the text (``detect_language``: kana make Japanese, Han without kana Chinese; Hangul,
Thai, Lao, Khmer, Myanmar their language). Text in other scripts, all written with
spaces, is "" when nobody names it: nothing here depends on which one it is.
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from collections.abc import Iterable

_HAN = ("\u2e80-\u2fdf\u3005\u3007\u3021-\u3029\u3038-\u303b\u3400-\u4dbf\u4e00-\u9fff"
        "\uf900-\ufaff\U00020000-\U0003ffff")
_KANA = "\u3040-\u309f\u30a0-\u30ff\u31f0-\u31ff\uff66-\uff9f"
_SEA = "\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u19e0-\u19ff"  # Thai, Lao, Myanmar, Khmer
_HANGUL = "\u1100-\u11ff\u3130-\u318f\uac00-\ud7af"
# Punctuation of those scripts (。、「」, fullwidth ！？): no word of its own, as "." in "you."
_CJK_MARKS = "\u3000-\u3004\u3008-\u3020\u3030\u303d-\u303f\uff01-\uff0f\uff1a-\uff20\uff5b-\uff65"
_SPACELESS = re.compile(f"[{_HAN}{_KANA}{_SEA}]")
_COUNTS = {"han": (re.compile(f"[{_HAN}]"), 1.5), "kana": (re.compile(f"[{_KANA}]"), 3.0),
           "sea": (re.compile(f"[{_SEA}]"), 4.0)}
_NOT_A_WORD = re.compile(f"[{_HAN}{_KANA}{_SEA}{_CJK_MARKS}]+")

# The script a language is detected by, and the scripts written without spaces.
_SCRIPTS = {"hangul": ("ko", re.compile(f"[{_HANGUL}]")), "thai": ("th", re.compile("[\u0e00-\u0e7f]")),
            "lao": ("lo", re.compile("[\u0e80-\u0eff]")), "khmer": ("km", re.compile("[\u1780-\u17ff]")),
            "myanmar": ("my", re.compile("[\u1000-\u109f]"))}
SPACELESS_LANGUAGES = ("zh", "ja", "th", "lo", "km", "my")
# ISO 639-3 codes a spec may use (bible:eng-spa, the SWORD modules), as the 639-1 codes here.
_THREE_LETTER = {"eng": "en", "kjv": "en", "spa": "es", "zho": "zh", "cmn": "zh", "jpn": "ja",
                 "kor": "ko", "tha": "th"}


def length_units(text: str) -> int:
    """The length of a normalized text (single spaces, none around) as the corpus filters
    count it: its words, where each character of a script written without spaces counts as
    a share of a word (see the module's docstring). Text without such characters: exactly
    its space-separated words."""
    if text.isascii() or not _SPACELESS.search(text):
        return text.count(" ") + 1 if text else 0
    units = sum(len(pattern.findall(text)) / per_word for pattern, per_word in _COUNTS.values())
    units += sum(1 for chunk in _NOT_A_WORD.sub(" ", text).split())
    return max(1, math.ceil(units))


def detect_language(texts: Iterable[str]) -> str:
    """The language the script of ``texts`` shows: "ja" where kana are at least 5% of the
    characters of spaceless scripts (Japanese mixes them with Han, Chinese has none), "zh"
    for Han without them, "ko", "th", "lo", "km", "my" for their scripts; "" for text in
    scripts written with spaces (Latin, Cyrillic, Greek, Arabic, ...), which nothing here
    needs told apart. The majority over the texts decides."""
    counts: Counter[str] = Counter()
    for text in texts:
        if text.isascii():
            counts["other"] += len(text)
            continue
        han = len(_COUNTS["han"][0].findall(text))
        kana = len(_COUNTS["kana"][0].findall(text))
        counts["han"] += han
        counts["kana"] += kana
        found = han + kana
        for name, (_, pattern) in _SCRIPTS.items():
            n = len(pattern.findall(text))
            counts[name] += n
            found += n
        counts["other"] += sum(c.isalpha() for c in text) - found
    if not counts:
        return ""
    scripts = {"cjk": counts["han"] + counts["kana"],
               **{name: counts[name] for name in _SCRIPTS}, "other": counts["other"]}
    winner = max(scripts, key=scripts.get)
    if winner == "cjk" and scripts["cjk"]:
        return "ja" if counts["kana"] >= 0.05 * scripts["cjk"] else "zh"
    if winner in _SCRIPTS and scripts[winner]:
        return _SCRIPTS[winner][0]
    return ""


def spec_languages(spec: str) -> tuple[str, str]:
    """The languages a corpus spec names: ``bible:eng-spa`` (its modules' languages; a side
    of several modules, ``eng+kjv``, takes its first), ``hf:NAME:xx-yy``; ("", "") else."""
    kind, _, arg = spec.partition(":")
    if kind == "bible":
        sides = arg.split("-")
        if len(sides) == 2:
            return tuple(_THREE_LETTER.get(side.split("+")[0], "") for side in sides)  # type: ignore[return-value]
    if kind == "hf":
        match = re.fullmatch(r"[^:]+:([A-Za-z_]+)-([A-Za-z_]+)", arg.strip())
        if match:
            return tuple(_code(x) for x in match.groups())  # type: ignore[return-value]
    return "", ""


def _code(name: str) -> str:
    name = name.lower()
    return _THREE_LETTER.get(name, name)


def resolve_languages(src_setting: str, tgt_setting: str, spec: str,
                      sample: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The language of each side and how it was known ("data.src_lang", "corpus spec",
    "script"), for stats.json: a setting other than "auto" first, then the spec, then the
    script of ``sample`` (a few thousand pairs are plenty)."""
    pairs = list(sample)
    named = spec_languages(spec)
    result = {}
    for i, (side, setting) in enumerate((("src", src_setting), ("tgt", tgt_setting))):
        if setting != "auto":
            result[side], how = _code(setting), f"data.{side}_lang"
        elif named[i]:
            result[side], how = named[i], "corpus spec"
        else:
            result[side], how = detect_language(pair[i] for pair in pairs), "script"
        result[f"{side}_from"] = how
    return result


@functools.cache
def mecab_available() -> bool:
    """Whether sacreBLEU's ja-mecab tokenizer can run here (packages mecab-python3, ipadic)."""
    try:
        import ipadic  # noqa: F401
        import MeCab  # noqa: F401
    except ImportError:
        return False
    return True


def bleu_tokenize(setting: str, tgt_lang: str) -> str:
    """sacreBLEU's tokenizer for BLEU: ``setting`` (data.bleu_tokenize) unless "auto"; then
    by the target language: "zh" for Chinese, "ja-mecab" for Japanese where its package is
    installed else "char", "char" for Thai, Lao, Khmer and Burmese (13a would see a
    sentence as one or two words), "13a" (sacreBLEU's default) for every other language."""
    if setting != "auto":
        return setting
    base = tgt_lang.split("-")[0].split("_")[0]
    if base == "zh":
        return "zh"
    if base == "ja":
        return "ja-mecab" if mecab_available() else "char"
    if base in SPACELESS_LANGUAGES:
        return "char"
    return "13a"
