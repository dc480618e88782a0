"""`aiayn prepare` (aiayn.data.prepare) and what it wrote read back: identical files on a
second run, stats, the max_len rule (encode_split), a sample batch, and the command."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import snapshot, toy_tsv

from aiayn.cli import main
from aiayn.config import Config, DataConfig
from aiayn.data.batching import TokenBatchSampler, collate
from aiayn.data.prepare import percentiles, prepare
from aiayn.data.prepared import encode_split, load_prepared, read_split, sample_batch
from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, train_tokenizers
from aiayn.errors import AiaynError

WORDS = ("el la casa perro gato sol mar grande rojo azul come ve y un viejo niño "
         "está allí también árbol canción").split()


def toy_cfg(path: Path, **changes) -> DataConfig:
    settings = {"corpus": f"tsv:{path}", "vocab_size": 100, "min_frequency": 1,
                "dev_fraction": 0.05, "test_fraction": 0.05}
    return DataConfig(**{**settings, **changes})


# ------------------------------------------------------------------ prepare
def test_prepare_twice_gives_identical_files(tmp_path):
    cfg = toy_cfg(toy_tsv(tmp_path / "c.tsv", WORDS))
    prepare(cfg, tmp_path / "a", model_max_len=32, max_tokens=256)
    prepare(cfg, tmp_path / "b", model_max_len=32, max_tokens=256)
    a, b = snapshot(tmp_path / "a"), snapshot(tmp_path / "b")
    ids = [f"ids/{split}.{side}.{kind}.npy" for split in ("dev", "test", "train")
           for side in ("src", "tgt") for kind in ("ids", "offsets")]
    assert sorted(a) == ["dev.jsonl", *ids, "stats.json", "test.jsonl", "tokenizer/joint.json",
                         "tokenizer/meta.json", "train.jsonl"]
    assert a == b


def test_prepare_writes_what_load_prepared_reads(tmp_path):
    cfg = toy_cfg(toy_tsv(tmp_path / "c.tsv", WORDS), tokenizer="wordlevel")
    stats = prepare(cfg, tmp_path / "out", model_max_len=32, max_tokens=256)
    prepared = load_prepared(tmp_path / "out")
    assert [len(prepared.train), len(prepared.dev), len(prepared.test)] == [270, 15, 15]
    assert prepared.stats == json.loads(json.dumps(stats))
    assert prepared.tokenizers.kind == "wordlevel" and prepared.tokenizers.joint
    first = json.loads((tmp_path / "out" / "train.jsonl").read_text().splitlines()[0])
    assert set(first) == {"src", "tgt"} and (first["src"], first["tgt"]) == prepared.train[0]
    assert stats["pairs"] == {"read": 300, "kept": 300, "dropped": {
        "empty": 0, "versification": 0, "too_long": 0, "length_ratio": 0}}
    assert stats["tokens"]["train"]["src"] == sum(len(s.split()) for s, _ in prepared.train)


def test_tokenizer_is_trained_on_train_only(tmp_path):
    for name, extra in (("train", ""), ("dev", "zanahoria"), ("test", "berenjena")):
        lines = [f"{w} casa\t{w.upper()} CASA" for w in WORDS] + [f"{extra} casa\tX CASA"] * 3
        (tmp_path / f"{name}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    cfg = DataConfig(corpus=f"tsv:{tmp_path}/{{split}}.tsv", tokenizer="wordlevel",
                     min_frequency=1)
    prepare(cfg, tmp_path / "out", model_max_len=32)
    vocab = load_prepared(tmp_path / "out").tokenizers.src.get_vocab()
    assert "▁casa" in vocab and "▁zanahoria" not in vocab and "▁berenjena" not in vocab


def test_load_prepared_errors(tmp_path):
    with pytest.raises(AiaynError, match="not found"):
        load_prepared(tmp_path / "nothing")
    with pytest.raises(AiaynError, match="train.jsonl: missing"):
        load_prepared(tmp_path)
    for name in ("train", "dev", "test"):
        (tmp_path / f"{name}.jsonl").write_text('{"src": "a", "tgt": "b"}\n')
    with pytest.raises(AiaynError, match="stats.json: missing"):
        load_prepared(tmp_path)
    (tmp_path / "dev.jsonl").write_text('{"src": "a"}\n')
    with pytest.raises(AiaynError, match="dev.jsonl: line 1"):  # read when first used
        read_split(tmp_path / "dev.jsonl")


def test_percentiles():
    assert percentiles(list(range(1, 101))) == {"p50": 50, "p90": 90, "p95": 95, "p99": 99,
                                                "p100": 100}
    assert percentiles([7]) == {"p50": 7, "p90": 7, "p95": 7, "p99": 7, "p100": 7}


# ------------------------------------------------------------------ the Bible, prepared
def test_bible_stats(bible_prepared):
    stats = json.loads((bible_prepared / "stats.json").read_text())
    assert stats["pairs"]["read"] == 31102 and stats["pairs"]["kept"] == 30478
    assert stats["splits"] == {"train": 29417, "dev": 371, "test": 690}
    assert stats["tokenizer"] == {"kind": "bpe", "joint": True, "src_vocab_size": 8000,
                                  "tgt_vocab_size": 8000, "trained_on_pairs": 29417}
    assert stats["max_len"]["train"]["dropped_too_long"] == 0
    assert stats["batching"]["padding_fraction"] < 0.05


def test_bible_batches_have_little_padding(bible_prepared):
    """The real corpus in real batches: padded size within budget, padding under 5%."""
    prepared = load_prepared(bible_prepared)
    examples, counts = encode_split(prepared.train, prepared.tokenizers, 256, "drop")
    assert counts["kept"] == len(prepared.train)
    sampler = TokenBatchSampler([len(e.src) for e in examples], [len(e.tgt) for e in examples],
                                4096, seed=1)
    real = padded = 0
    for positions in sampler:
        batch = collate([examples[i] for i in positions])
        assert len(positions) * max(batch.src.size(1), batch.tgt_in.size(1) + 1) <= 4096
        real += int((batch.src != PAD_ID).sum()) + int((batch.tgt_out != PAD_ID).sum())
        padded += batch.src.numel() + batch.tgt_out.numel()
    assert 1 - real / padded < 0.05
    assert sampler.padding_stats()["padding_fraction"] < 0.05


# ------------------------------------------------------------------ encode_split
@pytest.fixture(scope="module")
def toy_tokenizers():
    pairs = [(" ".join(WORDS[: i % len(WORDS) + 1]), " ".join(WORDS[: i % 7 + 1]).upper())
             for i in range(60)]
    return train_tokenizers(pairs, DataConfig(tokenizer="wordlevel", min_frequency=1))


def test_encode_split_drops_long_pairs_and_counts_them(toy_tokenizers):
    pairs = [("el la casa", "EL"), (" ".join(WORDS[:12]), "LA"), ("sol", " ".join(WORDS[:9]))]
    examples, counts = encode_split(pairs, toy_tokenizers, 8, "drop")
    assert counts == {"pairs": 3, "kept": 1, "dropped_too_long": 2, "truncated": 0}
    assert [e.index for e in examples] == [0]
    assert examples[0].src[-1] == EOS_ID and examples[0].tgt[0] == BOS_ID


def test_encode_split_truncates_keeping_eos(toy_tokenizers):
    pairs = [("el la casa", "EL"), (" ".join(WORDS[:12]), " ".join(WORDS[:12]).upper())]
    examples, counts = encode_split(pairs, toy_tokenizers, 8, "truncate")
    assert counts == {"pairs": 2, "kept": 2, "dropped_too_long": 0, "truncated": 1}
    long = examples[1]
    assert len(long.src) == len(long.tgt) == 8 and long.index == 1
    assert long.src[-1] == EOS_ID and long.tgt[0] == BOS_ID and long.tgt[-1] == EOS_ID
    assert long.src[:7] == toy_tokenizers.encode_src([pairs[1][0]])[0][:7]


def test_bad_long_policy(toy_tokenizers):
    with pytest.raises(AiaynError, match="data.long_policy"):
        encode_split([("a", "b")], toy_tokenizers, 8, "wrap")


# ------------------------------------------------------------------ sample_batch
def test_sample_batch(tmp_path):
    cfg = toy_cfg(toy_tsv(tmp_path / "c.tsv", WORDS), vocab_size=60)
    prepare(cfg, tmp_path / "out", model_max_len=64)
    config = Config()
    config.model.src_vocab_size = config.model.tgt_vocab_size = 60
    batch = sample_batch(tmp_path / "out", config, 3)
    dev = load_prepared(tmp_path / "out").dev
    assert batch.src.size(0) == 3 and batch.index.tolist() == [0, 1, 2]
    tok = load_prepared(tmp_path / "out").tokenizers
    assert tok.decode_tgt(batch.tgt_out.tolist()) == [t for _, t in dev[:3]]
    config.model.src_vocab_size = 32
    with pytest.raises(AiaynError, match="model.src_vocab_size"):
        sample_batch(tmp_path / "out", config, 3)


# ------------------------------------------------------------------ aiayn prepare
def test_cli_prepare(tmp_path, capsys):
    path = toy_tsv(tmp_path / "c.tsv", WORDS)
    code = main(["prepare", "--corpus", f"tsv:{path}", "--out", str(tmp_path / "out"),
                 "--vocab-size", "80", "--tokenizer", "wordlevel",
                 "--set", "data.min_frequency=1", "--set", "model.max_len=32"])
    assert code == 0
    out = capsys.readouterr().out
    assert "read 300, kept 300" in out and "train 294, dev 3, test 3" in out
    assert "wordlevel" in out and "padding" in out
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["data_config"]["vocab_size"] == 80
    assert stats["max_len"]["model_max_len"] == 32


def test_cli_prepare_errors_are_one_line(tmp_path, capsys):
    assert main(["prepare", "--corpus", "nope:x", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("aiayn: error: unknown corpus spec") and err.count("\n") == 1
    assert main(["prepare", "--corpus", f"tsv:{tmp_path}/missing.tsv",
                 "--out", str(tmp_path)]) == 2
    assert "file not found" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("x")
    assert main(["prepare", "--corpus", f"tsv:{toy_tsv(tmp_path / 'c.tsv', WORDS)}",
                 "--out", str(tmp_path / "a-file")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_a_failed_prepare_or_train_leaves_no_folder_it_made(tmp_path, capsys):
    """`prepare --out data/mine` and `train --out runs/x` make their parent folders; when
    the command fails, they go again (and a folder that was there before stays)."""
    bad = tmp_path / "bad.tsv"
    bad.write_text("a line without a tab\n", encoding="utf-8")
    assert main(["prepare", "--corpus", f"tsv:{bad}", "--config", "tiny",
                 "--out", str(tmp_path / "data" / "mine")]) == 2
    (tmp_path / "not-prepared").mkdir()
    assert main(["train", "--config", "tiny", "--data", str(tmp_path / "not-prepared"),
                 "--out", str(tmp_path / "runs" / "deeper" / "x")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.tsv", "not-prepared"]
    (tmp_path / "runs").mkdir()  # a folder the user made stays
    assert main(["train", "--config", "tiny", "--data", str(tmp_path / "not-prepared"),
                 "--out", str(tmp_path / "runs" / "x")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.tsv", "not-prepared", "runs"]
    assert not any((tmp_path / "runs").iterdir())
    capsys.readouterr()


def test_prepare_warns_of_small_held_out_splits_and_a_header_row(tmp_path, capsys):
    """1% of a few thousand pairs is a dev and a test split too small for a steady BLEU;
    a first row of column names is kept as a pair: both are one warning line each."""
    corpus = toy_tsv(tmp_path / "c.tsv", WORDS, n=400)
    corpus.write_text("source\ttarget\n" + corpus.read_text(encoding="utf-8"), encoding="utf-8")
    assert main(["prepare", "--corpus", f"tsv:{corpus}", "--out", str(tmp_path / "a"),
                 "--config", "tiny"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines()
                if line.startswith("aiayn: warning:")]
    assert len(warnings) == 3, warnings
    for split in ("dev", "test"):
        assert any(re.search(f"the {split} split has only [45] pairs", w)
                   and f"--set data.{split}_fraction=0.05" in w for w in warnings), warnings
    assert any(w.endswith("the first line (source <TAB> target) looks like column names and "
                          "was kept as a sentence pair; delete it if it is a header row")
               and str(corpus) in w for w in warnings), warnings
    # What looks like column names, and what does not (a first pair of words).
    from aiayn.data.prepare import _header_row

    for first, header in (("en\tfr", True), ("Source text\tTarget text", True),
                          ("src\ttgt\tattribution", True), ("no\tno", False),
                          ("the red cat\tthe blue dog", False), ("yes\tsí", False)):
        corpus.write_text(f"{first}\nred cat\tCAT RED\n", encoding="utf-8")
        assert (_header_row(f"tsv:{corpus}") is not None) == header, first
    # Enough held out and no header: no warning.
    assert main(["prepare", "--corpus", f"tsv:{toy_tsv(tmp_path / 'e.tsv', WORDS, n=400)}",
                 "--out", str(tmp_path / "b"), "--config", "tiny", "--set",
                 "data.dev_fraction=0.3", "--set", "data.test_fraction=0.3"]) == 0
    assert "aiayn: warning" not in capsys.readouterr().err
