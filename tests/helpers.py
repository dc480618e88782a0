"""What several test modules need, in one place (test modules never import each other).

- Prepared data made by ``aiayn prepare`` itself (``prepare_splits``), so every test that
  trains or evaluates runs on the memory-mapped ids users get; the toy language pair of
  the training tests (``write_prepared``).
- The tiny copy model of the run-directory tests (``train_copy_model``; the ``run_dir``
  fixture in conftest.py), and a tiny run of two target languages (``tagged_run``).
- Running the CLI (``run_train``, ``sets``, ``run_cli``, ``error_line``) and reading what
  it wrote (``weights``, ``records``, ``snapshot``).
- Corpora as ``aiayn prepare`` reads them (``stream_pairs``: the reader's own splits;
  ``first_pass``: prepare's first pass, held-out splits included).
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import random
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from aiayn import cli
from aiayn.config import Config, DataConfig, ModelConfig, save_config
from aiayn.data.batching import pad
from aiayn.data.corpora import CorpusStream
from aiayn.data.pairs import SPLITS, Pair
from aiayn.data.prepare import prepare, read_pairs
from aiayn.data.tokenizer import Tokenizers
from aiayn.model import Transformer
from aiayn.runs.checkpoint import read_weights, save_weights

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
_PASSES = itertools.count()


# ------------------------------------------------------------------ prepared data
# A tokenizer that knows every word of the toy corpora below.
WORD_LEVEL = DataConfig(tokenizer="wordlevel", vocab_size=64, min_frequency=1)


def prepare_splits(directory: Path, splits: dict[str, list[tuple[str, str]]],
                   data: DataConfig = WORD_LEVEL, tokenizers: Tokenizers | None = None,
                   model_max_len: int = 64) -> Path:
    """``directory`` prepared by ``aiayn.data.prepare.prepare`` from these splits (written as
    ``DIR.corpus/{split}.tsv`` beside it, the corpus ``tsv:DIR.corpus/{split}.tsv``):
    text, memory-mapped ids, the tokenizer (trained on train, or ``tokenizers``) and
    stats.json, as `aiayn prepare` writes them."""
    corpus = directory.parent / f"{directory.name}.corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for name, pairs in splits.items():
        (corpus / f"{name}.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in pairs),
                                            encoding="utf-8")
    prepare(replace(data, corpus=f"tsv:{corpus}/{{split}}.tsv"), directory,
            model_max_len=model_max_len, tokenizers=tokenizers)
    return directory


# A toy language pair: each source word has one target word, and the order is reversed.
LEXICON = {"red": "rojo", "blue": "azul", "cat": "gato", "dog": "perro", "sun": "sol",
           "sea": "mar", "big": "grande", "small": "chico", "house": "casa", "tree": "arbol",
           "eats": "come", "sees": "ve", "the": "el", "a": "un", "and": "y", "old": "viejo"}


def synthetic_pairs(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    words = sorted(LEXICON)
    pairs = []
    for _ in range(n):
        src = [rng.choice(words) for _ in range(rng.randint(2, 9))]
        pairs.append((" ".join(src), " ".join(LEXICON[w] for w in reversed(src))))
    return pairs


def write_prepared(directory: Path, joint: bool = True) -> Path:
    """The toy pair prepared by `aiayn prepare`: 240 train, 16 dev and 16 test pairs."""
    splits = {"train": synthetic_pairs(240, 1), "dev": synthetic_pairs(16, 2),
              "test": synthetic_pairs(16, 3)}
    return prepare_splits(directory, splits, replace(WORD_LEVEL, joint_vocab=joint))


# ------------------------------------------------------------------ the tiny copy model
COPY_WORDS = "red green blue black white sun moon star tree river".split()


def random_sentence(rng: random.Random, longest: int = 6) -> str:
    return " ".join(rng.choice(COPY_WORDS) for _ in range(rng.randint(1, longest)))


def train_copy_model(tokenizers: Tokenizers, run_dir: Path, steps: int = 400) -> Transformer:
    """A tiny model taught to copy sentences; saves step checkpoints along the way."""
    torch.manual_seed(0)
    rng = random.Random(1)
    cfg = ModelConfig(src_vocab_size=tokenizers.src_vocab_size,
                      tgt_vocab_size=tokenizers.tgt_vocab_size, d_model=32, n_heads=4,
                      d_ff=64, n_encoder_layers=1, n_decoder_layers=1, dropout=0.0,
                      max_len=16, tie_embeddings="all")
    model = Transformer(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(1, steps + 1):
        batch = [random_sentence(rng) for _ in range(32)]
        src, tgt = pad(tokenizers.encode_src(batch)), pad(tokenizers.encode_tgt(batch))
        logits = model(src, tgt[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten(), ignore_index=0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0:
            save_weights(model, run_dir / "checkpoints" / f"step_{step:07d}.safetensors")
    return model.eval()


# ------------------------------------------------------------------ the CLI and its files
def run_train(*args: str) -> None:
    assert cli.main(["train", *args]) == 0


def sets(**settings) -> list[str]:
    out = []
    for key, value in settings.items():
        out += ["--set", f"train.{key}={value}"]
    return out


def run_cli(argv: list[str], capsys, stdin: str | None = None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def error_line(stderr: str) -> str:
    """The CLI's one-line error (the progress bar may have written to stderr before it)."""
    lines = [line for line in stderr.replace("\r", "\n").splitlines()
             if line.startswith("aiayn: error:")]
    assert len(lines) == 1, stderr
    return lines[0]


def weights(run_dir: Path, name: str = "last.safetensors") -> dict[str, torch.Tensor]:
    return read_weights(run_dir / name)


def assert_equal_weights(a: dict, b: dict, context: str = "") -> None:
    assert a.keys() == b.keys()
    differ = [name for name in a if not torch.equal(a[name], b[name])]
    assert not differ, (f"{len(differ)} of {len(a)} tensors differ, e.g. {differ[0]} by up to "
                        f"{(a[differ[0]] - b[differ[0]]).abs().max():.2e}"
                        + (f" ({context})" if context else ""))


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


# ------------------------------------------------------------------ corpora
@dataclass
class StreamedCorpus:
    """A corpus whose reader gives every split itself (the Bible's books), read as
    ``aiayn prepare`` reads it: ``stream`` (read, dropped, description) and the kept pairs
    of each split, in corpus order, with their references (``Gen.1.1``)."""

    stream: CorpusStream
    splits: dict[str, list[Pair]]

    def texts(self, split: str) -> list[tuple[str, str]]:
        return [(p.src, p.tgt) for p in self.splits[split]]


def stream_pairs(spec: str, cfg: DataConfig | None = None) -> StreamedCorpus:
    stream = CorpusStream(spec, cfg or DataConfig())
    splits: dict[str, list[Pair]] = {name: [] for name in SPLITS}
    for pair, split in stream:
        splits[split].append(pair)
    stream.check_kept({name: len(pairs) for name, pairs in splits.items()})
    assert stream.given == set(SPLITS), "held-out splits: use first_pass (prepare routes them)"
    return StreamedCorpus(stream, splits)


def first_pass(spec: str, cfg: DataConfig, tmp_path: Path
               ) -> tuple[dict, dict[str, list[tuple[str, str]]]]:
    """What the first pass of ``aiayn prepare`` (``aiayn.data.prepare.read_pairs``) makes of a
    corpus: the first keys of stats.json (corpus, pairs read/kept/dropped, split_rule,
    splits) and the (source, target) pairs of each split, each in corpus order."""
    directory = tmp_path / f"first-pass-{next(_PASSES)}"
    directory.mkdir()
    pairs = read_pairs(replace(cfg, corpus=spec), directory)
    splits: dict[str, list[tuple[str, str]]] = {name: [] for name in SPLITS}
    for split, src, tgt in pairs.routed():
        splits[split].append((src, tgt))
    return pairs.info, splits


def snapshot(directory: Path, folders: bool = False) -> dict[str, str]:
    """Every file under ``directory`` (hidden ones too) by its path relative to it, with its
    SHA-256; ``folders``: every folder too (``"NAME/": "folder"``)."""
    entries = {}
    for path in sorted(Path(directory).rglob("*")):
        name = str(path.relative_to(directory))
        if path.is_file():
            entries[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        elif folders and path.is_dir():
            entries[name + "/"] = "folder"
    return entries


def toy_tsv(path: Path, words: list[str], n: int = 300, seed: int = 0,
            lengths: tuple[int, int] = (1, 12), copy: bool = False) -> Path:
    """A toy corpus file ``tsv:PATH``: ``n`` sentences of random ``words`` (``lengths``
    words each), each paired with itself (``copy``) or with its words reversed in upper
    case."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(*lengths)))
        target = sentence if copy else " ".join(reversed(sentence.split(" "))).upper()
        lines.append(f"{sentence}\t{target}\n")
    path.write_text("".join(lines), encoding="utf-8")
    return path


def tiny_model(seed: int = 0, **settings) -> Transformer:
    """A model of configs/tiny.yaml (with ``settings`` of model.* changed), seeded."""
    from aiayn.config import load_config

    torch.manual_seed(seed)
    return Transformer(replace(load_config(TINY).model, **settings))


def tagged_run(root: Path, corpora: dict[str, Path] | None = None, data: DataConfig = WORD_LEVEL,
               steps: int = 150, max_len: int = 16, **model) -> Path:
    """A tiny run directory under ``root`` that translates into two or more languages, each
    tagged ``<2LANG>`` (aiayn.data.directions): data prepared by `aiayn prepare` (with
    ``data``'s tokenizer) from ``corpora`` (target language -> tsv file; by default two toy
    corpora, ``toy_tsv``: into xx each sentence's words reversed in upper case, into yy
    copied), a model (``model``: settings of ModelConfig) trained ``steps`` steps on its
    train split, config.yaml, best/last weights."""
    if corpora is None:
        words = COPY_WORDS[:6]
        corpora = {"xx": toy_tsv(root / "xx.tsv", words, n=200, seed=1, lengths=(1, 6)),
                   "yy": toy_tsv(root / "yy.tsv", words, n=200, seed=2, lengths=(1, 6),
                                 copy=True)}
    data = replace(data, corpus="\n".join(f"tsv:{path} tgt={lang}"
                                          for lang, path in corpora.items()))
    data_dir = root / "tagged-data"
    prepare(data, data_dir, max_len)
    tokenizers = Tokenizers.load(data_dir / "tokenizer")
    assert sorted(tokenizers.tags) == sorted(corpora)
    pairs = [json.loads(line) for line in
             (data_dir / "train.jsonl").read_text(encoding="utf-8").splitlines()]
    torch.manual_seed(0)
    cfg = ModelConfig(**{**dict(src_vocab_size=tokenizers.src_vocab_size,
                                tgt_vocab_size=tokenizers.tgt_vocab_size, d_model=32, n_heads=4,
                                d_ff=64, n_encoder_layers=1, n_decoder_layers=1, dropout=0.0,
                                max_len=max_len, tie_embeddings="all"), **model})
    model = Transformer(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    rng = random.Random(0)
    for _ in range(steps):
        batch = rng.sample(pairs, 32)
        src = pad(tokenizers.encode_src([p["src"] for p in batch]))
        tgt = pad(tokenizers.encode_tgt([p["tgt"] for p in batch]))
        logits = model(src, tgt[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten(), ignore_index=0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    run = root / "tagged-run"
    run.mkdir()
    save_config(Config(model=cfg, data=data).validate(), run / "config.yaml")
    shutil.copytree(data_dir / "tokenizer", run / "tokenizer")
    save_weights(model.eval(), run / "best.safetensors")
    save_weights(model, run / "last.safetensors")
    (run / "data_dir.txt").write_text(str(data_dir) + "\n", encoding="utf-8")
    return run


def copy_run(root: Path) -> Path:
    """A real (tiny) run directory under ``root``: data prepared by `aiayn prepare` (sentences
    paired with themselves, a word-level tokenizer), a model trained for a few seconds to
    copy its input (train_copy_model), config.yaml, best/last weights, step checkpoints."""
    rng = random.Random(0)
    splits = {name: [(s, s) for s in (random_sentence(rng) for _ in range(n))]
              for name, n in (("train", 300), ("dev", 20), ("test", 40))}
    data = DataConfig(tokenizer="wordlevel", vocab_size=100, min_frequency=1)
    data_dir = prepare_splits(root / "data", splits, data)
    run = root / "run"
    run.mkdir()
    tokenizers = Tokenizers.load(data_dir / "tokenizer")
    model = train_copy_model(tokenizers, run)
    config = Config(model=model.cfg, data=data)
    config.train.max_tokens = 256
    save_config(config.validate(), run / "config.yaml")
    shutil.copytree(data_dir / "tokenizer", run / "tokenizer")
    save_weights(model, run / "best.safetensors")
    save_weights(model, run / "last.safetensors")
    (run / "data_dir.txt").write_text(str(data_dir) + "\n", encoding="utf-8")
    return run


def cross_only(kv):
    """A one-layer ``KVCache`` holding only cross-attention K/V (k = v = ``kv``): what a
    sentence joining a search brings."""
    from aiayn.cache import KVCache

    joining = KVCache(1)
    joining.layers[0]["cross"].update(k=kv, v=kv)
    return joining


def cache_walk(caches, steps: int = 40, heads: int = 2, d: int = 8, seed: int = 12):
    """Drive one-layer ``KVCache``s alike through a search's life: a new position per step,
    beams changing parents, sentences leaving, sentences joining (sources shorter and
    longer), trims. Yields after each step's position, with the (B, H, 1, d) queries of that
    step, before the step's reorder: the caches then hold the same positions."""
    from aiayn.cache import append_positions

    rng = torch.Generator().manual_seed(seed)
    width = 5
    cross = torch.randn(4, heads, width, d, generator=rng)
    for cache in caches:
        cache.join(cross_only(cross))
    rows = 4
    for step in range(steps):
        new = torch.randn(rows, heads, 1, d, generator=rng)
        values = torch.randn(rows, heads, 1, d, generator=rng)
        for cache in caches:
            append_positions(cache.layers[0]["self"], new, values)
            cache.length += 1
        yield torch.randn(rows, heads, 1, d, generator=rng)
        action = step % 4
        if action == 0:  # beams change parents
            index = torch.randint(0, rows, (rows,), generator=rng)
        elif action == 1 and rows > 2:  # a sentence leaves
            index = torch.tensor([i for i in range(rows) if i != step % rows])
        else:
            index = None
        if index is not None:
            for cache in caches:
                cache.reorder(index, kinds=("self", "cross") if action == 1 else ("self",))
            rows = index.numel()
        if action in (2, 3):  # sentences join, their sources shorter or longer
            n, S = 1 + step % 3, width + (step % 5) - 2
            joining = torch.randn(n, heads, S, d, generator=rng)
            for cache in caches:
                cache.join(cross_only(joining))
            rows += n
        if step % 7 == 6:
            for cache in caches:
                cache.trim(int(cache.start.min()) if cache.start is not None else 0)
