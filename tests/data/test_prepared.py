"""Token ids prepared once and mapped: they equal the tokenizer's encoding, batches equal
those of the in-memory pipeline for the same seed, ranks read disjoint shares, a resume
mid-epoch is exact, old directories still work, bad ones fail in one line, a failed
prepare changes nothing, held-out splits are capped, the last validation is bounded."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import snapshot, toy_tsv

from aiayn.cli import main
from aiayn.config import DataConfig, load_config
from aiayn.data.batching import Example, collate, token_batches
from aiayn.data.prepare import prepare
from aiayn.data.prepared import load_prepared
from aiayn.data.tokenizer import EOS_ID, tokenizer_fingerprint
from aiayn.errors import AiaynError
from aiayn.runs.checkpoint import load_train_state, read_weights
from aiayn.training.distributed import Dist
from aiayn.training.stream import BatchStream, load_data
from aiayn.training.transfer import describe_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
WORDS = ("el la casa perro gato sol mar grande rojo azul come ve y un viejo niño está allí "
         "también árbol canción café naïve ¿qué? ¡sí! «hola», (paréntesis) 1,000.5 emoji😀 "
         "x[EOS]y [UNK] a-b").split()


def prepared_dir(tmp_path: Path, name: str = "data", **changes) -> Path:
    corpus = toy_tsv(tmp_path / "corpus.tsv", WORDS, n=400, lengths=(1, 14))
    settings = {"corpus": f"tsv:{corpus}", "vocab_size": 120,
                "min_frequency": 1, "dev_fraction": 0.05, "test_fraction": 0.05,
                "tokenizer": "wordlevel"}
    prepare(DataConfig(**{**settings, **changes}), tmp_path / name, model_max_len=64,
            max_tokens=256)
    return tmp_path / name


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return prepared_dir(tmp_path_factory.mktemp("prepared"))


def tiny_config(max_len: int = 64, policy: str = "drop", **train):
    config = load_config(TINY)
    config.model.max_len = max_len
    config.data.long_policy = policy
    for key, value in train.items():
        setattr(config.train, key, value)
    return config


# ------------------------------------------------------------------ the ids
@pytest.mark.parametrize("kind,joint", [("bpe", True), ("wordlevel", False)])
def test_prepared_ids_equal_the_tokenizers_encoding_of_the_text(tmp_path, kind, joint):
    data = prepared_dir(tmp_path, tokenizer=kind, joint_vocab=joint, vocab_size=90)
    prepared = load_prepared(data)
    tok = prepared.tokenizers
    for split in ("train", "dev", "test"):
        pairs = prepared.split(split)
        ids = prepared.split_ids(split)
        assert len(ids.src) == len(ids.tgt) == len(pairs) > 0
        src, tgt = tok.encode_src([s for s, _ in pairs]), tok.encode_tgt([t for _, t in pairs])
        assert [ids.src.row(i) for i in range(len(pairs))] == src
        assert [ids.tgt.row(i) for i in range(len(pairs))] == tgt
        # The files are plain .npy: numpy reads them back without aiayn.
        flat = np.load(data / "ids" / f"{split}.src.ids.npy")
        offsets = np.load(data / "ids" / f"{split}.src.offsets.npy")
        assert flat.dtype == np.uint16 and offsets[-1] == len(flat)
        assert flat[offsets[1]:offsets[2]].tolist() == src[1]


def test_the_word_cache_encoder_equals_the_rust_tokenizer_on_awkward_text(data_dir):
    tok = load_prepared(data_dir).tokenizers
    texts = ["el  perro", " el", "el ", "", "x [EOS] y", "[UNK]", "a[BOS]b", "e\u0301 ñ",
             "tab\there", "nb\u00a0sp", "日本語 😀", "[ no special ]", "casa casa casa"] * 2
    for encoder, reference in zip(tok.array_encoders(), (tok.encode_src, tok.encode_tgt),
                                  strict=True):
        encoder.max_words = 5  # the cache is emptied between calls: still the same ids
        for chunk in (texts[:7], texts[7:], texts):
            ids, lengths = encoder.encode(chunk)
            rows = np.split(ids, np.cumsum(lengths)[:-1])
            assert [r.tolist() for r in rows] == reference(chunk)


# ------------------------------------------------------------------ batches
def greedy_reference(widths, max_tokens, copies=1, keys=None):
    """The batcher as it was first written: one item at a time, in (width, key, i) order."""
    order = sorted(range(len(widths)), key=lambda i: (widths[i], keys[i] if keys else 0, i))
    batches, batch = [], []
    for i in order:
        if batch and (len(batch) + 1) * widths[i] * copies > max_tokens:
            batches.append(batch)
            batch = []
        batch.append(i)
    return batches + [batch] if batch else batches


@pytest.mark.parametrize("seed", range(6))
def test_token_batches_equal_the_one_item_at_a_time_greedy_cut(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 400)
    widths = [rng.randint(1, 80) for _ in range(n)]
    keys = [rng.randint(-5, 5) for _ in range(n)]
    for max_tokens, copies in ((rng.randint(60, 700), 1), (150, 4), (40, 1)):  # some too wide
        got = token_batches(widths, max_tokens, copies, order_key=keys)
        assert [b.tolist() for b in got] == greedy_reference(widths, max_tokens, copies, keys)
        got = token_batches(widths, max_tokens, copies)
        assert [b.tolist() for b in got] == greedy_reference(widths, max_tokens, copies)
    assert token_batches([], 100) == []


def reference_epochs(data_dir: Path, max_len: int, policy: str, max_tokens: int, seed: int,
                     epochs: int) -> list[list[Example]]:
    """Batches as the in-memory pipeline made them: each pair encoded by the tokenizer at
    start-up, the max_len rule applied, the greedy batches shuffled per epoch."""
    prepared = load_prepared(data_dir)
    pairs = prepared.train
    src = prepared.tokenizers.encode_src([s for s, _ in pairs])
    tgt = prepared.tokenizers.encode_tgt([t for _, t in pairs])
    examples = []
    for i, (s, t) in enumerate(zip(src, tgt, strict=True)):
        if len(s) <= max_len and len(t) <= max_len:
            examples.append(Example(s, t, i))
        elif policy == "truncate":
            cut = [(x[: max_len - 1] + [EOS_ID]) if len(x) > max_len else x for x in (s, t)]
            examples.append(Example(*cut, i))
    widths = [max(len(e.src), len(e.tgt)) for e in examples]
    keys = [len(e.tgt) - len(e.src) for e in examples]
    batches = greedy_reference(widths, max_tokens, 1, keys)
    out = []
    for epoch in range(epochs):
        order = list(range(len(batches)))
        random.Random(f"aiayn-batches-{seed}-{epoch}").shuffle(order)
        out += [[examples[i] for i in batches[b]] for b in order]
    return out


@pytest.mark.parametrize("max_len,policy", [(64, "drop"), (12, "drop"), (12, "truncate")])
def test_mapped_data_gives_the_same_batches_as_encoding_in_memory(data_dir, max_len, policy):
    config = tiny_config(max_len, policy, max_tokens=200, seed=7)
    data = load_data(data_dir, config, Dist(), log=lambda *a: None)
    stream = BatchStream(data, 0, torch.device("cpu"), max_epochs=2)
    expected = reference_epochs(data_dir, max_len, policy, 200, 7, epochs=2)
    if max_len == 12:
        assert data.train.counts["dropped_too_long" if policy == "drop" else "truncated"] > 0
    assert len(expected) == 2 * len(data.sampler)
    for examples in expected:
        got, want = stream.next(), collate(examples)
        for name in ("src", "tgt_in", "tgt_out", "index"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert stream.next() is None


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_read_disjoint_shares_that_cover_the_epoch(data_dir, world_size):
    config = tiny_config(max_tokens=160, seed=3)
    ranks = [load_data(data_dir, config, Dist(rank=r, world_size=world_size), log=lambda *a: None)
             for r in range(world_size)]
    kept = set(ranks[0].train.positions.tolist())
    for epoch in (0, 1):
        shares = []
        for data in ranks:
            data.sampler.set_epoch(epoch)
            batches = list(data.sampler)
            shares.append([data.train[j].index for batch in batches for j in batch])
        assert len({len(list(d.sampler)) for d in ranks}) == 1  # the same number of steps
        seen = [i for share in shares for i in share]
        assert len(seen) == len(set(seen)) and set(seen) == kept  # disjoint, all of them


def test_resume_from_the_middle_of_an_epoch_is_exact(data_dir, tmp_path):
    config = tiny_config()
    per_epoch = len(load_data(data_dir, config, Dist(), log=lambda *a: None).sampler)
    n = max(2, (2 * per_epoch) // 3)  # stop mid-epoch; 2n steps cross into the next epoch
    common = ["--config", TINY, "--data", str(data_dir), "--set", "train.eval_every=1000",
              "--set", "train.save_every=1000", "--set", "train.log_every=1"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(["train", *common, "--out", str(straight), "--set", f"train.max_steps={2 * n}"]) == 0
    assert main(["train", *common, "--out", str(split), "--set", f"train.max_steps={n}"]) == 0
    state = load_train_state(split / "train_state.pt")
    assert state["epoch"] == 0 and 0 < state["stream"][0]["sampler"]["batches_yielded"] < per_epoch
    assert main(["train", "--resume", str(split), "--set", f"train.max_steps={2 * n}"]) == 0
    assert load_train_state(straight / "train_state.pt")["epoch"] >= 1
    a, b = read_weights(split / "last.safetensors"), read_weights(straight / "last.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ old and broken directories
def test_an_old_directory_without_ids_still_works_with_a_one_line_note(data_dir, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(data_dir, old)
    shutil.rmtree(old / "ids")
    stats = json.loads((old / "stats.json").read_text())
    del stats["ids"]
    (old / "stats.json").write_text(json.dumps(stats))
    config = tiny_config(max_len=12, policy="truncate")
    notes: list[str] = []
    legacy = load_data(old, config, Dist(), log=notes.append)
    mapped = load_data(data_dir, config, Dist(), log=lambda *a: None)
    assert len([n for n in notes if "run `aiayn prepare` again" in n]) == 1
    assert list(legacy.train) == list(mapped.train) and legacy.dev == mapped.dev
    assert ([b.tolist() for b in legacy.sampler.batches]
            == [b.tolist() for b in mapped.sampler.batches])


def test_ids_that_do_not_fit_the_directory_are_a_one_line_error(data_dir, tmp_path, capsys):
    other = prepared_dir(tmp_path, "other", vocab_size=50)
    broken = tmp_path / "broken"
    shutil.copytree(data_dir, broken)
    shutil.rmtree(broken / "tokenizer")
    shutil.copytree(other / "tokenizer", broken / "tokenizer")  # not the ids' tokenizer
    with pytest.raises(AiaynError, match="another tokenizer.*run `aiayn prepare` again"):
        load_data(broken, tiny_config(), Dist(), log=lambda *a: None)
    code = main(["train", "--config", TINY, "--data", str(broken), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code != 0 and err.count("\n") == 1 and "run `aiayn prepare` again" in err
    assert not (tmp_path / "r").exists()
    short = tmp_path / "short"
    shutil.copytree(data_dir, short)
    offsets = short / "ids" / "train.tgt.offsets.npy"
    np.save(offsets, np.load(offsets)[:-1])
    with pytest.raises(AiaynError, match="run `aiayn prepare` again"):
        load_data(short, tiny_config(), Dist(), log=lambda *a: None)


def test_a_failed_prepare_changes_nothing_on_disk(data_dir, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(data_dir, out)
    before = snapshot(out)
    bad = toy_tsv(tmp_path / "bad.tsv", WORDS, n=300, lengths=(1, 14))
    with open(bad, "a", encoding="utf-8") as fh:
        fh.write("a line without a tab at the very end\n")  # found only after reading it all
    cfg = DataConfig(corpus=f"tsv:{bad}", vocab_size=60, min_frequency=1)
    with pytest.raises(AiaynError, match="line 301 has no tab"):
        prepare(cfg, out, model_max_len=64, force=True)
    assert snapshot(out) == before
    with pytest.raises(AiaynError, match="line 301 has no tab"):
        prepare(cfg, tmp_path / "new", model_max_len=64)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.tsv", "out"]  # no staging left


# ------------------------------------------------------------------ bounded splits and validation
def test_held_out_splits_are_capped_and_the_tokenizer_learns_from_a_spread_sample(tmp_path):
    lines = [f"w{i} casa\tW{i} CASA" for i in range(100)]
    (tmp_path / "c.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    cfg = DataConfig(corpus=f"tsv:{tmp_path / 'c.tsv'}", tokenizer="wordlevel", min_frequency=1,
                     vocab_size=500, dev_fraction=0.2, test_fraction=0.1, held_out_max=7,
                     tokenizer_max_pairs=9)
    stats = prepare(cfg, tmp_path / "out", model_max_len=16)
    assert stats["splits"] == {"train": 86, "dev": 7, "test": 7}
    assert "dev 0.2 of the pairs up to 7" in stats["split_rule"]
    assert stats["tokenizer"]["trained_on_pairs"] == 9
    prepared = load_prepared(tmp_path / "out")
    train_words = [s.split()[0] for s, _ in prepared.train]
    vocab = prepared.tokenizers.src.get_vocab()
    learned = [w for w in train_words if "▁" + w in vocab]
    assert learned == [train_words[(i * 86) // 9] for i in range(9)]  # evenly spread


def test_the_last_validation_decodes_the_same_bounded_subset(data_dir, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--config", TINY, "--data", str(data_dir), "--out", str(run),
                 "--set", "train.max_steps=3", "--set", "train.eval_every=2",
                 "--set", "train.eval_max_sentences=5"]) == 0
    lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    devs = [r for r in map(json.loads, lines) if r["kind"] == "dev"]
    assert [(r["step"], r["n_sentences"]) for r in devs] == [(2, 5), (3, 5)]
    assert len(load_prepared(data_dir).dev) == 20  # the whole split is larger


def test_the_ids_record_the_one_tokenizer_fingerprint(data_dir, tmp_path):
    """prepare records, the loader checks and fine-tuning compares one fingerprint: a file
    that is not the tokenizer's (a README beside it) changes none of them."""
    stats = json.loads((data_dir / "stats.json").read_text(encoding="utf-8"))
    recorded = stats["ids"]["tokenizer_sha256"]
    assert recorded == tokenizer_fingerprint(data_dir / "tokenizer")
    assert describe_tokenizer(data_dir / "tokenizer").endswith(f"sha256 {recorded[:12]}")
    noted = tmp_path / "noted"
    shutil.copytree(data_dir, noted)
    (noted / "tokenizer" / "README.txt").write_text("made by aiayn prepare\n")
    mapped = load_data(noted, tiny_config(), Dist(), log=lambda *a: None)
    assert len(mapped.train) == len(load_data(data_dir, tiny_config(), Dist(),
                                               log=lambda *a: None).train)
