"""Small English-Chinese and English-Japanese corpora for the tests: sentences built from
written phrases (subject, verb, object, when), each language in its own grammar, so every
pair is a real translation and the pairs are many (384 of each)."""

from __future__ import annotations

import itertools
from pathlib import Path

# (English, English after he/she/the teacher, Chinese, Japanese)
SUBJECTS = [
    ("I", False, "我", "私は"), ("You", False, "你", "あなたは"), ("He", True, "他", "彼は"),
    ("She", True, "她", "彼女は"), ("We", False, "我们", "私たちは"),
    ("They", False, "他们", "彼らは"), ("My brother", True, "我哥哥", "兄は"),
    ("The teacher", True, "老师", "先生は"),
]
# (English, English third person, Chinese, Japanese particle + verb)
VERBS = [
    ("read", "reads", "看", "を読みます"), ("buy", "buys", "买", "を買います"),
    ("like", "likes", "喜欢", "が好きです"), ("want", "wants", "想要", "が欲しいです"),
    ("see", "sees", "看见", "を見ます"), ("bring", "brings", "带来", "を持ってきます"),
]
OBJECTS = [
    ("a book", "一本书", "本"), ("the newspaper", "报纸", "新聞"), ("apples", "苹果", "りんご"),
    ("green tea", "绿茶", "緑茶"), ("a new car", "一辆新车", "新しい車"),
    ("the letter", "那封信", "手紙"), ("fresh bread", "新鲜的面包", "新鮮なパン"),
    ("flowers", "花", "花"),
]
WHEN = [("", "", ""), (" every day", "每天", "毎日"), (" today", "今天", "今日")]


def pairs(lang: str) -> list[tuple[str, str]]:
    """(English, Chinese) or (English, Japanese) pairs, in a fixed order."""
    out = []
    for n, ((subj, third, zh_s, ja_s), (verb, verb3, zh_v, ja_v), (obj, zh_o, ja_o)) in enumerate(
            itertools.product(SUBJECTS, VERBS, OBJECTS)):
        en_when, zh_when, ja_when = WHEN[n % len(WHEN)]
        english = f"{subj} {verb3 if third else verb} {obj}{en_when}."
        if lang == "zh":
            out.append((english, f"{zh_s}{zh_when}{zh_v}{zh_o}。"))
        else:
            out.append((english, f"{ja_s}{ja_when}{ja_o}{ja_v}。"))
    return out


def write_tsv(path: Path, lang: str) -> Path:
    path.write_text("".join(f"{en}\t{other}\n" for en, other in pairs(lang)), encoding="utf-8")
    return path
