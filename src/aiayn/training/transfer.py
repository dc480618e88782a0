"""Starting a run from another run: fine-tuning on new data with the same vocabulary.

A run's weights only make sense with the tokenizers they were trained with, so a new
corpus is encoded with the old run's tokenizers, and the new run keeps the model's shape::

    aiayn prepare --tokenizer-from runs/web --corpus bible:kjv-spa --out data/kjv-spa
    aiayn train --init-from runs/web:best --data data/kjv-spa --out runs/kjv-ft

or from Python::

    from aiayn.training.loop import train
    from aiayn.training.transfer import prepare_from_run

    prepare_from_run("runs/web", "data/kjv-spa", corpus="bible:kjv-spa")
    train(None, "data/kjv-spa", "runs/kjv-ft", init_from="runs/web:best",
          overrides=["train.max_steps=2000", "train.patience=3"])

The new run starts from the weights (``RUN_DIR:best`` by default; ``:last`` or any name
``resolve_weights`` knows), with a fresh optimizer and a fresh learning-rate schedule
(warm-up again from step 1; change it with ``--set train.*``). Its settings: the old run's
config.yaml, or the ``train`` and ``decode`` sections of ``--config FILE``, then ``--set``. What cannot
change is refused with both values named: the model's shape (every ``model.*`` setting but
the two dropouts) and the vocabulary (the data's tokenizer files must be the run's, byte
for byte, compared by their SHA-256). ``RUN_DIR/init_from.json`` in the new run records
where it started.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from safetensors import safe_open

from aiayn.config import Config, ModelConfig, load_config
from aiayn.data.prepare import prepare
from aiayn.data.prepared import TOKENIZER_DIR, prepared_corpus
from aiayn.data.tokenizer import META_FILE, Tokenizers, tokenizer_fingerprint
from aiayn.errors import AiaynError
from aiayn.runs.checkpoint import load_weights
from aiayn.runs.directory import (
    check_vocabularies,
    not_a_run_error,
    read_export_info,
    resolve_weights,
)
from aiayn.util.io import atomic_write_text

INIT_FILE = "init_from.json"
# model.* settings a new run may change: they do not change any weight's shape or meaning.
FREE_MODEL_FIELDS = ("dropout", "attention_dropout")
# Vocabulary sizes follow the tokenizers (checked by their fingerprint), not the YAML.
VOCAB_FIELDS = ("src_vocab_size", "tgt_vocab_size")
# data.* settings that describe the tokenizer a corpus is encoded with.
TOKENIZER_FIELDS = ("tokenizer", "vocab_size", "joint_vocab", "min_frequency")


# ---------------------------------------------------------------- the tokenizers' identity
def describe_tokenizer(directory: str | Path) -> str:
    """``bpe, joint vocabulary of 8000, sha256 1a2b3c4d5e6f`` from meta.json."""
    directory = Path(directory)
    try:
        meta = json.loads((directory / META_FILE).read_text(encoding="utf-8"))
        sizes = (f"joint vocabulary of {meta['src_vocab_size']}" if meta["joint"] else
                 f"vocabularies of {meta['src_vocab_size']}/{meta['tgt_vocab_size']}")
        kind = meta["kind"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"unreadable {directory / META_FILE}"
    return f"{kind}, {sizes}, sha256 {tokenizer_fingerprint(directory)[:12]}"


def check_same_tokenizers(run_dir: str | Path, data_dir: str | Path) -> None:
    """The prepared data must be encoded with the run's own tokenizers (same files)."""
    run_tok, data_tok = Path(run_dir) / "tokenizer", Path(data_dir) / TOKENIZER_DIR
    for directory, what in ((run_tok, "the run"), (data_tok, "the data")):
        if not (directory / META_FILE).is_file():
            raise AiaynError(f"{directory}: no tokenizer of {what} here")
    if tokenizer_fingerprint(run_tok) != tokenizer_fingerprint(data_tok):
        raise AiaynError(
            f"{data_dir} is encoded with another tokenizer ({describe_tokenizer(data_tok)}) "
            f"than the run {run_dir} ({describe_tokenizer(run_tok)}); prepare the new corpus "
            f"with the run's: `aiayn prepare --tokenizer-from {run_dir} --corpus SPEC "
            f"--out DIR`")


# ---------------------------------------------------------------- --init-from RUN_DIR[:WEIGHTS]
@dataclass
class InitFrom:
    """Where a new run starts: the old run, its weights file and its config."""

    run_dir: Path
    weights: Path
    config: Config

    @classmethod
    def parse(cls, spec: str | Path) -> InitFrom:
        """``RUN_DIR`` (its best weights) or ``RUN_DIR:WEIGHTS`` (best, last, a step
        checkpoint name or a .safetensors path)."""
        spec = str(spec)
        run_dir, weights = spec, "best"
        if not Path(spec).is_dir() and ":" in spec:
            run_dir, _, weights = spec.rpartition(":")
        run_dir = Path(run_dir)
        exported = read_export_info(run_dir)
        if exported is not None:
            raise AiaynError(f"--init-from {spec}: {not_a_run_error(run_dir, exported)}")
        if not (run_dir / "config.yaml").is_file():
            raise AiaynError(f"--init-from {spec}: {run_dir} is not a run directory (no "
                             "config.yaml); give RUN_DIR or RUN_DIR:best|last|FILE")
        return cls(run_dir, resolve_weights(run_dir, weights or "best"),
                   load_config(run_dir / "config.yaml"))

    def config_for_new_run(self, given: Config | None, overrides: list[str],
                           data_dir: str | Path) -> Config:
        """The new run's config: ``given`` (its train/data/decode sections; its model section must
        be this run's shape) or this run's config with ``overrides``. The model is this
        run's, but for the dropouts; the tokenizer settings are this run's; data.corpus is
        the one ``data_dir`` was prepared from (its stats.json)."""
        base = self.config
        if given is None:
            given, source = base.override(overrides, "--set"), "--set"
        else:
            source = "--config"
        given.validate(source)
        for f in fields(ModelConfig):
            if f.name in FREE_MODEL_FIELDS + VOCAB_FIELDS:
                continue
            ours, theirs = getattr(base.model, f.name), getattr(given.model, f.name)
            if ours != theirs:
                raise AiaynError(
                    f"model.{f.name}: the run {self.run_dir} has {ours!r}, {source} asks for "
                    f"{theirs!r}; a run started with --init-from keeps the model's shape "
                    f"(only model.{' and model.'.join(FREE_MODEL_FIELDS)} may change)")
        model = replace(base.model, **{k: getattr(given.model, k) for k in FREE_MODEL_FIELDS})
        data = replace(given.data, **{k: getattr(base.data, k) for k in TOKENIZER_FIELDS})
        data.corpus = prepared_corpus(data_dir) or data.corpus
        return Config(model=model, data=data, train=given.train, decode=given.decode)

    def check_data(self, data_dir: str | Path) -> None:
        check_same_tokenizers(self.run_dir, data_dir)

    def load_into(self, model) -> None:
        """Copy the weights into ``model`` (shapes checked by name, both named on error)."""
        load_weights(model, self.weights)

    def record(self, new_run: str | Path) -> None:
        """Write NEW_RUN/init_from.json: the run, the weights file and their step."""
        with safe_open(str(self.weights), "pt") as fh:
            meta = fh.metadata() or {}
        info = {"run_dir": str(self.run_dir.resolve()), "weights": str(self.weights.resolve()),
                "step": int(meta["step"]) if meta.get("step", "").isdigit() else None,
                "tokenizer_sha256": tokenizer_fingerprint(self.run_dir / "tokenizer")}
        atomic_write_text(Path(new_run) / INIT_FILE, json.dumps(info, indent=2) + "\n")


def read_init_from(run_dir: str | Path) -> dict[str, Any] | None:
    """What RUN_DIR/init_from.json says (None for a run trained from scratch)."""
    path = Path(run_dir) / INIT_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError):
        return None


# ---------------------------------------------------------------- the library calls
def prepare_from_run(run_dir: str | Path, out_dir: str | Path, corpus: str | None = None,
                     overrides: list[str] | None = None, progress: bool = False,
                     force: bool = False, flags: dict[str, str] | None = None
                     ) -> dict[str, Any]:
    """``aiayn prepare --tokenizer-from RUN_DIR``: read ``corpus`` (default: the run's) with
    the run's data settings and ``overrides`` (``data.*``), split it, and save the run's
    tokenizers (the same bytes) instead of training new ones. Returns the stats.
    ``out_dir`` as for ``aiayn.data.prepare.prepare`` (new or empty, unless ``force``).

    A ``data.*`` tokenizer setting that differs from the run's is refused, naming both, and
    the flag that gave it where ``flags`` names one (``{"vocab_size": "--vocab-size"}``)."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise AiaynError(f"--tokenizer-from {run_dir}: not a run directory (no config.yaml)")
    base = load_config(run_dir / "config.yaml")
    config = base.override(list(overrides or []), "--set")
    # Before the ranges: any value but the run's is refused, whatever its range says.
    for name in TOKENIZER_FIELDS:
        ours, theirs = getattr(base.data, name), getattr(config.data, name)
        if ours != theirs:
            flag = (flags or {}).get(name)
            where = f"{flag}: data.{name}" if flag else f"data.{name}"  # as check_setting's
            raise AiaynError(f"{where}: the run {run_dir}'s tokenizer has {ours!r}, the command "
                             f"line asks for {theirs!r}; --tokenizer-from keeps the run's "
                             f"tokenizer (drop {flag or 'the setting'})")
    config.validate("--set")
    if corpus:
        config.data = replace(config.data, corpus=corpus)
    tokenizers = Tokenizers.load(run_dir / "tokenizer")
    check_vocabularies(base, tokenizers, run_dir / "tokenizer")
    stats = prepare(config.data, out_dir, config.model.max_len, config.train.max_tokens,
                    progress=progress, force=force, tokenizers=tokenizers)
    return stats

