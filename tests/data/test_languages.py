"""Languages written without spaces: English-Chinese and English-Japanese corpora go through
prepare, a short train, translate and evaluate whole; BLEU tokenizes by the target
language; byte fallback round-trips any character."""

import json
import re

import pytest
from cjk_corpus import pairs, write_tsv
from helpers import run_cli

from aiayn.config import Config, DataConfig
from aiayn.data.corpora import drop_reason
from aiayn.data.languages import (
    bleu_tokenize,
    detect_language,
    length_units,
    mecab_available,
    spec_languages,
)
from aiayn.data.prepared import load_prepared
from aiayn.data.tokenizer import UNK_ID, Tokenizers, train_tokenizers
from aiayn.errors import AiaynError
from aiayn.inference.translator import Translator

TINY = "configs/tiny.yaml"
CJK = "\u3002\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff"  # 。, kana, Han
RARE = "𠮷野家で鱻を食べた😀 Ωμέγα naïve ฉันรักคุณ 안녕하세요"


def test_length_units_count_words_and_characters_of_scripts_without_spaces():
    assert length_units("I love you.") == 3  # text with spaces: its words, as before
    assert length_units("Él me ama mucho.") == 4
    assert length_units("我爱你。") == 2  # 3 Han / 1.5; the full stop is no word
    assert length_units("おはようございます。") == 3  # 9 kana / 3
    assert length_units("明日東京に行きたいです。") == 6  # 5 Han, 6 kana
    assert length_units("我买了iPhone 15。") == 4  # 3 Han, and two words with spaces
    for en, other in pairs("zh") + pairs("ja"):
        assert drop_reason(en, other, DataConfig()) is None, (en, other)


def test_languages_are_detected_from_the_script_or_named_by_the_spec():
    assert detect_language(zh for _, zh in pairs("zh")) == "zh"
    assert detect_language(ja for _, ja in pairs("ja")) == "ja"
    assert detect_language(["안녕하세요 만나서 반갑습니다"]) == "ko"
    assert detect_language(["ฉันรักคุณมาก"]) == "th"
    assert detect_language(["I love you.", "Él me ama."]) == ""
    assert spec_languages("bible:eng-spa") == ("en", "es")
    assert spec_languages("bible:eng+kjv-spa") == ("en", "es")
    assert spec_languages("hf:opus_books:en-it") == ("en", "it")
    assert spec_languages("tsv:data.tsv") == ("", "")
    assert bleu_tokenize("auto", "zh") == "zh"
    assert bleu_tokenize("auto", "zh-TW") == "zh"
    assert bleu_tokenize("auto", "ja") == ("ja-mecab" if mecab_available() else "char")
    assert bleu_tokenize("auto", "th") == "char"
    assert bleu_tokenize("auto", "es") == bleu_tokenize("auto", "") == "13a"
    assert bleu_tokenize("intl", "zh") == "intl"


@pytest.mark.parametrize("setting", ["data.tgt_lang=Chinese!", "data.bleu_tokenize=spm"])
def test_bad_language_settings_are_refused_by_name(setting):
    with pytest.raises(AiaynError, match=setting.split("=")[0]):
        Config().override([f"{setting}"]).validate()


@pytest.mark.parametrize("lang", ["zh", "ja"])
def test_a_cjk_corpus_prepares_trains_translates_and_evaluates_whole(lang, tmp_path, capsys):
    corpus = write_tsv(tmp_path / f"en{lang}.tsv", lang)
    data, run = tmp_path / "data", tmp_path / "run"
    code, out, err = run_cli(["prepare", "--corpus", f"tsv:{corpus}", "--out", str(data),
                              "--config", TINY, "--set", "data.vocab_size=1024",
                              # pieces shared by many sentences, not a piece per sentence
                              "--set", "data.min_frequency=4"], capsys)
    assert code == 0, err
    stats = json.loads((data / "stats.json").read_text(encoding="utf-8"))
    assert stats["pairs"] == {"read": 384, "kept": 384, "dropped": dict.fromkeys(
        ["empty", "versification", "too_long", "length_ratio"], 0)}
    assert "aiayn: warning" not in err
    expected = "zh" if lang == "zh" else ("ja-mecab" if mecab_available() else "char")
    assert stats["languages"]["tgt"] == lang and stats["languages"]["src"] == ""
    assert f"target {lang} (from the script); BLEU tokenize {expected}" in out

    # Any character round-trips, seen in training or not, with no [UNK]; the pieces of a
    # sentence decode with no space between them.
    tokenizers = Tokenizers.load(data / "tokenizer")
    texts = [RARE, *[other for _, other in pairs(lang)]]
    for encode in (tokenizers.encode_src, tokenizers.encode_tgt):
        ids = encode(texts)
        assert not any(UNK_ID in seq for seq in ids)
        assert tokenizers.decode_tgt(ids) == texts
    src_encoder, tgt_encoder = tokenizers.array_encoders()
    flat, lengths = tgt_encoder.encode(texts)
    assert flat.tolist() == [i for seq in tokenizers.encode_tgt(texts) for i in seq]

    code, _, err = run_cli(["train", "--config", TINY, "--data", str(data), "--out", str(run),
                            "--set", "train.max_steps=40", "--set", "train.eval_every=40",
                            "--set", "train.save_every=40"], capsys)
    assert code == 0, err
    dev = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
           if json.loads(line).get("kind") == "dev"]
    assert f"tok:{expected}" in dev[-1]["bleu_signature"]

    sources = tmp_path / "sources.txt"
    sources.write_text("".join(en + "\n" for en, _ in pairs(lang)[:20]), encoding="utf-8")
    code, out, err = run_cli(["translate", str(run), "--input", str(sources), "--beam", "1"],
                             capsys)
    assert code == 0, err
    # What a 40-step model writes depends on the CPU's rounding ("我 我 我" on one, "我们看"
    # on another), so only what holds for any model is asserted: the target's script...
    lines = out.splitlines()
    assert len(lines) == 20 and all(re.search(f"[{CJK}]", line) for line in lines if line), out
    # ...and the decoder's rule: the pieces of a word join with no space, words (a piece that
    # starts one, "▁") take one, whatever pieces the model chose.
    translator = Translator.from_pretrained(run)
    hyps = translator.decode_ids(translator.source_ids([en for en, _ in pairs(lang)[:20]])[0])
    for ids in (h[0].ids for h in hyps):
        assert_joined_by_word(tokenizers, ids)

    code, out, err = run_cli(["evaluate", str(run), "--beam", "1", "--split", "dev"], capsys)
    assert code == 0, err
    assert re.search(rf"^BLEU .*tok:{expected}\|", out, re.M), out
    scores = json.loads(next((run / "eval").glob("dev.*.json")).read_text())
    assert scores["bleu_tokenize"] == expected


def assert_joined_by_word(tokenizers: Tokenizers, ids: list[int]) -> None:
    """``ids`` decode to their words, one space between, none inside a word: a word is a piece
    that starts one ("▁...") and the pieces after it up to the next such."""
    starts = [k for k, i in enumerate(ids) if tokenizers.tgt_id_to_token(i).startswith("\u2581")]
    bounds = sorted({0, *starts, len(ids)})
    words = [tokenizers.decode_tgt([ids[a:b]])[0].strip() for a, b in zip(bounds, bounds[1:])]
    assert all(" " not in word for word in words), words
    assert tokenizers.decode_tgt([ids])[0].split() == [w for w in words if w], (ids, words)


def test_data_prepared_before_languages_were_recorded_takes_them_from_its_text(tmp_path, capsys):
    data = tmp_path / "data"
    code, _, err = run_cli(["prepare", "--corpus", f"tsv:{write_tsv(tmp_path / 'c.tsv', 'zh')}",
                            "--out", str(data), "--config", TINY], capsys)
    assert code == 0, err
    stats = json.loads((data / "stats.json").read_text(encoding="utf-8"))
    del stats["languages"], stats["data_config"]["bleu_tokenize"]
    (data / "stats.json").write_text(json.dumps(stats), encoding="utf-8")
    prepared = load_prepared(data)
    assert prepared.languages["tgt"] == "zh" and prepared.bleu_tokenize() == "zh"
    assert prepared.bleu_tokenize("13a") == "13a"  # a run's own setting wins


def test_byte_pieces_take_the_place_of_the_last_merges_within_the_vocabulary():
    """The 256 byte pieces are the last of data.vocab_size: the learnt pieces are those of a
    tokenizer without them, but for its last 256 merges, with the same ids."""
    corpus = [(f"{en} {zh}", ja) for (en, zh), (_, ja) in zip(pairs("zh"), pairs("ja"))]
    size = 1024
    plain = train_tokenizers(corpus, DataConfig(vocab_size=size, min_frequency=1, byte_fallback=False))
    fallback = train_tokenizers(corpus, DataConfig(vocab_size=size, min_frequency=1))
    assert plain.tgt_vocab_size == size  # enough merges in this corpus to fill it
    assert fallback.byte_fallback and fallback.tgt_vocab_size == size
    vocab = fallback.tgt.get_vocab()
    kept = {piece: i for piece, i in plain.tgt.get_vocab().items() if i < size - 256}
    assert {piece: i for piece, i in vocab.items() if i < size - 256} == kept
    assert sorted(i for piece, i in vocab.items() if piece.startswith("<0x")) == \
        list(range(size - 256, size))
    # Without it, an unseen character is [UNK], as in every tokenizer made before it.
    assert UNK_ID in plain.encode_tgt(["鱻"])[0] and not plain.byte_fallback
    assert fallback.decode_tgt(fallback.encode_tgt(["鱻"])) == ["鱻"]
    # A toy vocabulary keeps [UNK]: 256 byte pieces would be most of it.
    assert not train_tokenizers(corpus, DataConfig(vocab_size=500)).byte_fallback


def test_a_filter_that_drops_over_a_third_is_named_in_one_warning_line(tmp_path, capsys):
    corpus = tmp_path / "shifted.tsv"
    lines = [f"{en}\t{zh}" for en, zh in pairs("zh")]
    lines += [f"{en} {en} {en} {en}\t好。" for en, _ in pairs("zh")[:300]]  # misaligned
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    code, _, err = run_cli(["prepare", "--corpus", f"tsv:{corpus}", "--out",
                            str(tmp_path / "data"), "--config", TINY], capsys)
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("aiayn: warning:")]
    assert warnings == ["aiayn: warning: the length_ratio filter dropped 300 of 684 pairs "
                        "(44%); are the sides aligned line by line? else raise "
                        "data.max_length_ratio (docs/data.md#languages)"]


def test_a_missing_ja_mecab_is_one_clear_error():
    if mecab_available():
        pytest.skip("mecab-python3 is installed here")
    from aiayn.evaluation.metrics import score

    with pytest.raises(AiaynError, match="data.bleu_tokenize=ja-mecab: sacreBLEU cannot load"):
        score(["私は本を読みます。"], ["私は本を読みます。"], "ja-mecab")
