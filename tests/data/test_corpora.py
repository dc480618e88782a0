"""Corpora: the Bible read from the real SWORD modules, the Hugging Face path through
`datasets` on local files, the user's own files, and a clear one-line error for each kind of
bad input."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
from helpers import first_pass, stream_pairs

from aiayn.config import DataConfig
from aiayn.data import corpora
from aiayn.data.bible import (
    BIBLE_DEV_BOOKS,
    BIBLE_TEST_BOOKS,
    clean_osis,
    parse_bible_spec,
    read_bible_pairs,
)
from aiayn.data.corpora import SPEC_FORMS
from aiayn.data.pairs import Pair
from aiayn.errors import AiaynError

GENESIS_1_1 = "In the beginning, God created the heavens and the earth."


def book(pair) -> str:
    return pair.ref.split(".")[0]


# ------------------------------------------------------------------ the Bible
def test_genesis_1_1_reads_exactly(bible_stream):
    first = bible_stream.splits["train"][0]
    assert first.ref == "Gen.1.1"
    assert first.src == GENESIS_1_1  # the footnote on "God" is gone, no "Godcreated"
    assert first.tgt == "EN el principio crió Dios los cielos y la tierra."


def test_bible_counts_and_split_sizes(bible_stream, bible_prepared):
    """The figures stated in docs/data.md's table of the Bible, as `aiayn prepare` reports them."""
    stats = json.loads((bible_prepared / "stats.json").read_text(encoding="utf-8"))
    assert stats["pairs"]["read"] == bible_stream.stream.read == 31102
    assert stats["pairs"]["dropped"] == bible_stream.stream.dropped == {
        "empty": 25, "versification": 592, "too_long": 1, "length_ratio": 6}
    sizes = {name: len(p) for name, p in bible_stream.splits.items()}
    assert stats["splits"] == sizes == {"train": 29417, "dev": 371, "test": 690}
    assert stats["pairs"]["kept"] == 31102 - (25 + 592 + 1 + 6)
    assert stats["split_rule"] == bible_stream.stream.split_rule


def test_bible_split_is_by_whole_books(bible_stream):
    books = {name: {book(p) for p in pairs} for name, pairs in bible_stream.splits.items()}
    assert books["test"] == set(BIBLE_TEST_BOOKS)
    assert books["dev"] == set(BIBLE_DEV_BOOKS)
    assert not books["train"] & (set(BIBLE_TEST_BOOKS) | set(BIBLE_DEV_BOOKS))
    assert len(books["train"]) == 66 - 15
    refs = [p.ref for pairs in bible_stream.splits.values() for p in pairs]
    assert len(refs) == len(set(refs))


def test_no_test_verse_text_in_train(bible_stream):
    """Whole books held out: no test pair (text, not just reference) appears in train."""
    train = set(bible_stream.texts("train"))
    assert not train & set(bible_stream.texts("test"))
    assert not train & set(bible_stream.texts("dev"))
    assert all(book(p) in BIBLE_TEST_BOOKS for p in bible_stream.splits["test"])


def test_revelation_glossary_is_dropped(bible_stream):
    refs = {p.ref for pairs in bible_stream.splits.values() for p in pairs}
    assert "Rev.22.21" not in refs
    assert "Rev.22.20" in refs
    assert not any("Glossary" in p.src or "Abaddon is Hebrew" in p.src
                   for p in bible_stream.splits["train"])


def test_markup_strong_numbers_and_footnotes_are_gone(bible_stream):
    pairs = [p for split in bible_stream.splits.values() for p in split]
    for pair in pairs:
        for text in (pair.src, pair.tgt):
            assert "<" not in text and ">" not in text and "strong:" not in text
            assert text == text.strip() and "  " not in text
    by_ref = {p.ref: p for p in pairs}
    # footnotes sat between these words; their content ("Elohim", "darnel is a weed") is gone
    assert by_ref["Ps.42.8"].src.startswith("Yahweh will command his loving kindness")
    assert "sowed darnel weeds also among the wheat" in by_ref["Matt.13.25"].src
    assert "weed grass" not in by_ref["Matt.13.25"].src
    assert "Elohim" not in " ".join(p.src for p in pairs[:50])
    # RV1909 words split across <w>/<transChange> elements are not glued
    assert "hay allí también bdelio" in by_ref["Gen.2.12"].tgt
    # the canonical Psalm title is verse text (the Spanish verse has it too)
    assert by_ref["Ps.3.1"].src.startswith("A Psalm by David, when he fled from Absalom")
    assert by_ref["Ps.3.1"].tgt.startswith("Salmo de David, cuando huía")


def test_chapters_versified_differently_are_left_out(bible_stream):
    """RV1909 starts Jonah 2 at the KJV's 1:17: every verse of Jonah 2 would be misaligned."""
    chapters = Counter((book(p), int(p.ref.split(".")[1])) for p in bible_stream.splits["test"])
    assert ("Jonah", 2) not in chapters and ("Jonah", 3) in chapters
    assert not any(p.ref.startswith("Num.13.") for p in bible_stream.splits["train"])


def test_other_bible_pairs_read_the_right_modules():
    kjv, dropped = read_bible_pairs("kjv-spa", books=["Gen"])
    assert dropped == 0
    assert kjv[0].src == "In the beginning God created the heaven and the earth."
    spa_eng, _ = read_bible_pairs("spa-eng", books=["Gen"])
    assert (spa_eng[0].src, spa_eng[0].tgt) == (kjv[0].tgt, GENESIS_1_1)
    spa_kjv, _ = read_bible_pairs("spa-kjv", books=["Gen"])
    assert [(p.src, p.tgt, p.ref) for p in spa_kjv] == [(p.tgt, p.src, p.ref) for p in kjv]


def test_a_second_english_bible_adds_training_verses_only(bible_stream):
    both = stream_pairs("bible:eng+kjv-spa")
    for held in ("dev", "test"):  # held out as before
        assert both.splits[held] == bible_stream.splits[held]
    web_train = bible_stream.splits["train"]
    assert both.splits["train"][:len(web_train)] == web_train
    extra = both.splits["train"][len(web_train):]
    kjv_train = [p for p in read_bible_pairs("kjv-spa")[0]
                 if book(p) not in BIBLE_DEV_BOOKS + BIBLE_TEST_BOOKS]
    assert len(extra) > 0.95 * len(kjv_train)  # a few dropped by the length filters
    assert extra[0] == Pair("In the beginning God created the heaven and the earth.",
                            web_train[0].tgt, "Gen.1.1@kjv-spa")
    # every extra verse's Spanish is the same verse's Spanish in the WEB pairs
    spanish = {p.ref: p.tgt for p in web_train}
    shared = [p for p in extra if p.ref.split("@")[0] in spanish]
    assert len(shared) > 0.95 * len(extra)
    assert all(p.tgt == spanish[p.ref.split("@")[0]] for p in shared)
    assert "in train also King James Version" in both.stream.description


@pytest.mark.parametrize("arg, expected", [
    ("eng-spa", ("eng-spa", [])),
    ("eng+kjv-spa", ("eng-spa", ["kjv-spa"])),
    ("kjv+eng-spa", ("kjv-spa", ["eng-spa"])),
    ("spa-eng+kjv", ("spa-eng", ["spa-kjv"])),
])
def test_parse_bible_spec(arg, expected):
    assert parse_bible_spec(arg) == expected


@pytest.mark.parametrize("arg", ["eng+eng-spa", "eng+fra-spa", "eng-spa+kjv", "eng+kjv",
                                 "eng-kjv-spa", "+eng-spa", "eng+-spa"])
def test_bad_bible_specs_are_named(arg, tmp_path):
    with pytest.raises(AiaynError, match=rf"unknown Bible pair 'bible:{re.escape(arg)}'.*"
                                         "bible:eng\\+kjv-spa"):
        first_pass(f"bible:{arg}", DataConfig(), tmp_path)


def test_missing_sword_modules_name_the_debian_packages(tmp_path, monkeypatch):
    monkeypatch.setenv("SWORD_PATH", str(tmp_path))
    with pytest.raises(AiaynError) as err:
        first_pass("bible:eng-spa", DataConfig(), tmp_path)
    message = str(err.value)
    assert "engWEB2015eb" in message and str(tmp_path) in message
    assert "apt-get install sword-text-web sword-text-sparv sword-text-kjv" in message
    assert "\n" not in message


def test_clean_osis_keeps_words_apart_and_drops_notes():
    raw = ('<w lemma="strong:H0430">God</w><note placement="foot"><reference>1:1 </reference>'
           'a note</note><w lemma="strong:H1254">created</w> <speaker>Beloved</speaker>'
           '<title>ב BETH.</title> <w>shall more be give</w>n.<l eID="x"/> '
           '<w>hay allí</w><transChange type="added">también</transChange><w>bdelio</w>, '
           'preguntándo<transChange>le</transChange>, “<w>There</w>”<note>n</note>.')
    assert clean_osis(raw) == ("God created shall more be given. hay allí también bdelio, "
                               "preguntándole, “There”.")


# ------------------------------------------------------------------ spec errors
@pytest.mark.parametrize("spec", ["foo:bar", "bible", "tsv:", "opus_books"])
def test_unknown_spec_lists_the_valid_forms(spec, tmp_path):
    with pytest.raises(AiaynError) as err:
        first_pass(spec, DataConfig(), tmp_path)
    for form in SPEC_FORMS:
        assert form in str(err.value)


def test_unknown_bible_pair(tmp_path):
    with pytest.raises(AiaynError, match="bible:eng-spa, bible:spa-eng, bible:kjv-spa"):
        first_pass("bible:eng-fra", DataConfig(), tmp_path)


# ------------------------------------------------------------------ the user's files
def write(path: Path, text: str | bytes) -> Path:
    if isinstance(text, str):
        text = text.encode("utf-8")
    path.write_bytes(text)
    return path


def numbered_pairs(n: int) -> list[tuple[str, str]]:
    return [(f"the house number {i} is red", f"la casa número {i} es roja") for i in range(n)]


def test_tsv_drops_and_counts_blank_lines(tmp_path):
    lines = [f"{s}\t{t}" for s, t in numbered_pairs(20)]
    lines[3] = "   "
    lines[7] = ""
    lines[9] = "only source\t  "
    path = write(tmp_path / "c.tsv", "\n".join(lines) + "\n")
    cfg = DataConfig(dev_fraction=0.1, test_fraction=0.1)
    info, splits = first_pass(f"tsv:{path}", cfg, tmp_path)
    assert info["pairs"]["read"] == 20 and info["pairs"]["kept"] == 17
    assert info["pairs"]["dropped"]["empty"] == 3
    assert {name: len(p) for name, p in splits.items()} == info["splits"] == {
        "train": 13, "dev": 2, "test": 2}
    kept = {pair for split in splits.values() for pair in split}
    assert kept == {pair for i, pair in enumerate(numbered_pairs(20)) if i not in (3, 7, 9)}
    assert "random" in info["split_rule"] and "seed 1234" in info["split_rule"]


def test_seeded_split_is_reproducible_and_depends_on_the_seed(tmp_path):
    path = write(tmp_path / "c.tsv", "".join(f"{s}\t{t}\n" for s, t in numbered_pairs(200)))
    cfg = DataConfig(dev_fraction=0.05, test_fraction=0.05)
    (_, a), (_, b) = first_pass(f"tsv:{path}", cfg, tmp_path), first_pass(f"tsv:{path}", cfg,
                                                                          tmp_path)
    assert a == b
    _, other = first_pass(f"tsv:{path}", DataConfig(dev_fraction=0.05, test_fraction=0.05,
                                                    split_seed=7), tmp_path)
    assert other["dev"] != a["dev"]
    assert len(a["dev"]) == len(a["test"]) == 10
    # each split keeps the file's order
    line = {pair: i for i, pair in enumerate(numbered_pairs(200))}
    for name in ("train", "dev", "test"):
        assert [line[p] for p in a[name]] == sorted(line[p] for p in a[name])


def test_too_few_pairs_to_hold_out_names_the_fix_that_can_work(tmp_path):
    """Two pairs cannot give a train, a dev and a test pair whatever the fractions: the line
    asks for more pairs or split files; where smaller fractions would do, it says so."""
    two = write(tmp_path / "two.tsv", "The cat sleeps.\tEl gato duerme.\nGood day.\tBuen día.\n")
    with pytest.raises(AiaynError, match=r"only 2 training pairs, too few to hold out 1 dev and "
                                         r"1 test pairs; give more pairs .* or dev/test files"):
        first_pass(f"tsv:{two}", DataConfig(), tmp_path)
    ten = write(tmp_path / "ten.tsv", "".join(f"{s}\t{t}\n" for s, t in numbered_pairs(10)))
    with pytest.raises(AiaynError, match=r"too few to hold out 5 dev and 5 test pairs; lower "
                                         r"data.dev_fraction"):
        first_pass(f"tsv:{ten}", DataConfig(dev_fraction=0.5, test_fraction=0.5), tmp_path)


def test_tsv_extra_columns_ignored_and_missing_tab_is_an_error(tmp_path):
    good = write(tmp_path / "g.tsv", "a b\tc d\tCC-BY attribution\n" * 5)
    _, splits = first_pass(f"tsv:{good}", DataConfig(dev_fraction=0.2, test_fraction=0.2),
                           tmp_path)
    assert splits["train"][0] == ("a b", "c d")
    bad = write(tmp_path / "b.tsv", "a\tb\nno tab here\n")
    with pytest.raises(AiaynError, match=r"b\.tsv: line 2 has no tab"):
        first_pass(f"tsv:{bad}", DataConfig(), tmp_path)


def test_split_files_are_used_when_given(tmp_path):
    for name, n in (("train", 30), ("dev", 4), ("test", 5)):
        write(tmp_path / f"{name}.tsv", "".join(f"{s}\t{t}\n" for s, t in numbered_pairs(n)))
    info, splits = first_pass(f"tsv:{tmp_path}/{{split}}.tsv", DataConfig(), tmp_path)
    assert [len(splits[s]) for s in ("train", "dev", "test")] == [30, 4, 5]
    assert info["split_rule"] == "given"
    (tmp_path / "test.tsv").unlink()  # no test file: test is held out of train
    _, splits = first_pass(f"tsv:{tmp_path}/{{split}}.tsv", DataConfig(test_fraction=0.1),
                           tmp_path)
    assert [len(splits[s]) for s in ("train", "dev", "test")] == [27, 4, 3]


def test_parallel_files(tmp_path):
    pairs = numbered_pairs(10)
    src = write(tmp_path / "c.en", "".join(s + "\n" for s, _ in pairs))
    tgt = write(tmp_path / "c.es", "".join(t + "\r\n" for _, t in pairs))  # CRLF is fine
    _, splits = first_pass(f"parallel:{src},{tgt}", DataConfig(dev_fraction=0.1,
                                                               test_fraction=0.1), tmp_path)
    assert sorted(splits["train"] + splits["dev"] + splits["test"]) == sorted(pairs)


def test_parallel_files_with_different_line_counts(tmp_path):
    src = write(tmp_path / "c.en", "a\nb\nc\n")
    tgt = write(tmp_path / "c.es", "x\ny\n")
    with pytest.raises(AiaynError) as err:
        first_pass(f"parallel:{src},{tgt}", DataConfig(), tmp_path)
    message = str(err.value)
    assert f"{src} has 3 lines" in message and f"{tgt} has 2" in message


def test_parallel_spec_needs_two_paths(tmp_path):
    with pytest.raises(AiaynError, match="parallel:SRC_PATH,TGT_PATH"):
        first_pass(f"parallel:{tmp_path / 'only.en'}", DataConfig(), tmp_path)


def test_invalid_utf8_names_file_and_line(tmp_path):
    path = write(tmp_path / "c.tsv", b"ok\tbien\ncaf\xe9\tcaf\xe9\n")
    with pytest.raises(AiaynError) as err:
        first_pass(f"tsv:{path}", DataConfig(), tmp_path)
    assert f"{path}: line 2 is not valid UTF-8" in str(err.value)


def test_utf8_bom_is_ignored(tmp_path):
    path = write(tmp_path / "c.tsv", "\ufeffhello there\thola\n" * 10)
    _, splits = first_pass(f"tsv:{path}", DataConfig(dev_fraction=0.1, test_fraction=0.1),
                           tmp_path)
    assert splits["train"][0][0] == "hello there"


@pytest.mark.parametrize("kind", ["tsv", "jsonl"])
def test_missing_file(tmp_path, kind):
    with pytest.raises(AiaynError, match="file not found"):
        first_pass(f"{kind}:{tmp_path / 'nope.txt'}", DataConfig(), tmp_path)


def test_missing_parallel_file(tmp_path):
    src = write(tmp_path / "c.en", "a\n")
    with pytest.raises(AiaynError, match=r"c\.es: file not found"):
        first_pass(f"parallel:{src},{tmp_path / 'c.es'}", DataConfig(), tmp_path)


def test_jsonl_with_configured_fields(tmp_path):
    rows = [{"en": s, "es": t, "extra": 1} for s, t in numbered_pairs(10)]
    path = write(tmp_path / "c.jsonl",
                 "\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n\n")
    cfg = DataConfig(src_field="en", tgt_field="es", dev_fraction=0.1, test_fraction=0.1)
    info, splits = first_pass(f"jsonl:{path}", cfg, tmp_path)
    assert info["pairs"]["read"] == 11 and info["pairs"]["dropped"]["empty"] == 1
    assert splits["train"][0][1] == "la casa número 0 es roja"


def test_jsonl_line_not_json(tmp_path):
    path = write(tmp_path / "c.jsonl", '{"src": "a", "tgt": "b"}\n{"src": "a", tgt}\n')
    with pytest.raises(AiaynError, match=r"c\.jsonl: line 2 is not valid JSON"):
        first_pass(f"jsonl:{path}", DataConfig(), tmp_path)


def test_jsonl_line_lacking_a_field(tmp_path):
    path = write(tmp_path / "c.jsonl", '{"src": "a", "tgt": "b"}\n' * 3 + '{"src": "a"}\n')
    with pytest.raises(AiaynError) as err:
        first_pass(f"jsonl:{path}", DataConfig(), tmp_path)
    assert "c.jsonl: line 4 lacks the field 'tgt'" in str(err.value)
    path = write(tmp_path / "d.jsonl", '["a", "b"]\n')
    with pytest.raises(AiaynError, match="line 1 is not a JSON object"):
        first_pass(f"jsonl:{path}", DataConfig(), tmp_path)


def test_empty_corpus_after_filtering(tmp_path):
    path = write(tmp_path / "c.tsv", "\n  \na\tb c d e f g h\n")
    with pytest.raises(AiaynError) as err:
        first_pass(f"tsv:{path}", DataConfig(), tmp_path)
    message = str(err.value)
    assert "no sentence pairs left" in message and "2 empty" in message
    assert "1 length_ratio" in message


def test_pair_filters(tmp_path):
    cfg = DataConfig(max_words=5, max_length_ratio=2.0)
    assert corpora.drop_reason("a b c d e f", "a b c d e f", cfg) == "too_long"
    assert corpora.drop_reason("a", "a b c", cfg) == "length_ratio"
    assert corpora.drop_reason("a b", "a b c d", cfg) is None
    assert corpora.drop_reason("", "a", cfg) == "empty"


def test_text_is_normalized(tmp_path):
    decomposed = "cafe\u0301  con\u00a0leche "
    path = write(tmp_path / "c.tsv", f"{decomposed}\tcoffee\n" * 10)
    _, splits = first_pass(f"tsv:{path}", DataConfig(dev_fraction=0.1, test_fraction=0.1),
                           tmp_path)
    assert splits["train"][0][0] == "caf\u00e9 con leche"


# ------------------------------------------------------------------ Hugging Face datasets
def opus_rows(n: int, start: int = 0) -> str:
    rows = [{"id": str(i), "translation": {"en": f"The house {i} is red.",
                                           "it": f"La casa {i} è rossa."}}
            for i in range(start, start + n)]
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """Keep `datasets`' cache of the local test files out of the home directory."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


def test_hf_local_file_goes_through_datasets(tmp_path, hf_cache, monkeypatch):
    import datasets

    calls = []
    real_load = datasets.load_dataset

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", spy)
    path = write(tmp_path / "books.jsonl", opus_rows(50))
    info, splits = first_pass(f"hf:{path}:en-it", DataConfig(dev_fraction=0.1,
                                                            test_fraction=0.1), tmp_path)
    assert calls and calls[0][0] == ("json",)
    assert info["pairs"]["read"] == 50
    assert [len(splits[s]) for s in ("train", "dev", "test")] == [40, 5, 5]
    assert splits["train"][0] == ("The house 0 is red.", "La casa 0 è rossa.")
    _, reverse = first_pass(f"hf:{path}", DataConfig(src_field="it", tgt_field="en"), tmp_path)
    assert reverse["train"][0][0] == "La casa 0 è rossa."


def test_hf_local_folder_keeps_its_splits(tmp_path, hf_cache):
    folder = tmp_path / "opus"
    folder.mkdir()
    write(folder / "train.jsonl", opus_rows(40))
    write(folder / "validation.jsonl", opus_rows(4, 40))
    write(folder / "test.jsonl", opus_rows(6, 44))
    info, splits = first_pass(f"hf:{folder}:en-it", DataConfig(), tmp_path)
    assert [len(splits[s]) for s in ("train", "dev", "test")] == [40, 4, 6]
    assert splits["test"][0][0] == "The house 44 is red."
    assert info["split_rule"] == "given"


def test_hf_hub_name_and_config_reach_load_dataset(tmp_path, hf_cache, monkeypatch):
    """``hf:opus_books:en-it`` calls ``load_dataset("opus_books", "en-it")``; the hub is
    unreachable here, so the call is answered from a local file of the same shape."""
    import datasets

    local = datasets.load_dataset("json", data_files=str(write(tmp_path / "b.jsonl",
                                                               opus_rows(30))))
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append(a) or local)
    info, splits = first_pass("hf:opus_books:en-it", DataConfig(dev_fraction=0.1,
                                                               test_fraction=0.1), tmp_path)
    assert calls == [("opus_books", "en-it")]
    assert info["pairs"]["kept"] == 30 and splits["train"][0][1] == "La casa 0 è rossa."


def test_hf_failure_is_one_line(tmp_path, hf_cache, monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'opus_books' on the Hub (LocalEntryNotFoundError)\n"
                              "more lines")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(AiaynError) as err:
        first_pass("hf:opus_books:en-it", DataConfig(), tmp_path)
    assert "\n" not in str(err.value) and "network" in str(err.value)


def test_hf_rows_without_the_languages(tmp_path, hf_cache):
    path = write(tmp_path / "books.jsonl", opus_rows(5))
    with pytest.raises(AiaynError, match="translation has languages en, it"):
        first_pass(f"hf:{path}:de-fr", DataConfig(), tmp_path)
