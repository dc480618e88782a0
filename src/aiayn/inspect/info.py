"""``aiayn info RUN_OR_DATA [--json]``: what a run is, in a few lines (or one JSON object).

Model size and parameters, the vocabulary, steps, epochs, tokens and minutes trained, the
best dev score and its step (``train.best_metric``, see aiayn.training.early_stopping), the last
validation, the weights files there are (with their steps), the data, the target languages
of a model that translates into several (``--to``, aiayn.data.directions), and the run it
was started from (``--init-from``). Reads files only; loads no weights::

    info = aiayn.run_info("runs/s60")      # a dict, the same as `aiayn info --json`
    print(aiayn.inspect.info.format_info(info))

Given a prepared data directory (`aiayn prepare --out DIR`), its corpora instead: per line
of the corpus spec its languages, direction tag and pairs per split (``data_info``). Given a
CTranslate2 export (`aiayn export --to ctranslate2`), the model and search it carries and
what it was exported from (``"export"``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from aiayn.config import load_config
from aiayn.data.prepared import STATS_FILE, TOKENIZER_DIR, load_prepared
from aiayn.data.tokenizer import Tokenizers
from aiayn.errors import AiaynError
from aiayn.model import Transformer
from aiayn.runs.checkpoint import load_train_state, read_metadata
from aiayn.runs.directory import (
    check_run_dir,
    describe_export,
    list_step_checkpoints,
    not_a_run_error,
    read_export_info,
)
from aiayn.runs.metrics import read_metrics
from aiayn.training.transfer import describe_tokenizer, read_init_from


def run_info(run_dir: str | Path) -> dict[str, Any]:
    """A summary of the run directory as plain JSON-able values (None where unknown); of a
    prepared data directory, ``data_info``'s."""
    run_dir = Path(run_dir)
    check_run_dir(run_dir)
    if not (run_dir / "config.yaml").is_file() and (run_dir / STATS_FILE).is_file():
        return data_info(run_dir)
    exported = read_export_info(run_dir)
    if exported is not None and not (run_dir / "config.yaml").is_file():
        raise not_a_run_error(run_dir, exported)  # a Transformers export: no config of ours
    if not (run_dir / "config.yaml").is_file():
        raise AiaynError(f"{run_dir}: no config.yaml; is it a run directory written by "
                         "`aiayn train`? (`aiayn doctor` says what is wrong with it)")
    config = load_config(run_dir / "config.yaml")
    m = config.model
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        parameters = Transformer(m).num_parameters()
    info: dict[str, Any] = {
        "run_dir": str(run_dir),
        "model": {"parameters": parameters, "d_model": m.d_model, "n_heads": m.n_heads,
                  "d_ff": m.d_ff, "encoder_layers": m.n_encoder_layers,
                  "decoder_layers": m.n_decoder_layers, "max_len": m.max_len,
                  "norm_first": m.norm_first, "tie_embeddings": m.tie_embeddings},
        "vocabulary": {"src": m.src_vocab_size, "tgt": m.tgt_vocab_size,
                       "tokenizer": describe_tokenizer(run_dir / "tokenizer")},
        "data_dir": _read_text(run_dir / "data_dir.txt"),
        "corpus": config.data.corpus,
        "targets": _targets(run_dir / "tokenizer"),
        "decode": {"beam": config.decode.beam, "alpha": config.decode.alpha,
                   "no_repeat_ngram": config.decode.no_repeat_ngram},
        "export": exported,
        "init_from": read_init_from(run_dir),
        "training": _training(run_dir),
        "best": None,
        "last_dev": None,
        "weights": _weights(run_dir),
    }
    if exported is not None:  # the model and search it carries; no training of its own
        return info
    devs = [r for r in read_metrics(run_dir, missing_ok=True) if r["kind"] == "dev"]
    if devs:
        last = devs[-1]
        info["last_dev"] = {k: last.get(k) for k in ("step", "dev_loss", "bleu", "chrf",
                                                       "n_sentences")}
    info["best"] = _best(run_dir, devs, config.train.best_metric)
    return info


def data_info(data_dir: str | Path) -> dict[str, Any]:
    """A prepared data directory: its splits, tokenizer, the target languages of its
    direction tags (empty: one direction) and per line of its corpus spec (stats.json's
    "corpora") the line, its languages, its direction tag and the tag that marks its
    sources (None without) and its pairs per split."""
    data = load_prepared(data_dir, log=lambda _: None)
    return {
        "kind": "data",
        "data_dir": str(data_dir),
        "corpus": data.stats.get("corpus"),
        "splits": data.stats.get("splits"),
        "tokenizer": describe_tokenizer(Path(data_dir) / TOKENIZER_DIR),
        "targets": sorted(data.tokenizers.tags),
        "corpora": [{"line": c.get("line"),
                     "languages": {side: (c.get("languages") or {}).get(side)
                                   for side in ("src", "tgt")},
                     "tag": c.get("tag"), "source_tag": c.get("source_tag"),
                     "splits": c.get("splits")} for c in data.corpora],
    }


def _targets(tokenizer_dir: Path) -> list[str]:
    """The target languages of the run's direction tags ([]: one direction, or no
    readable tokenizer: `aiayn doctor` says why)."""
    try:
        return sorted(Tokenizers.load(tokenizer_dir).tags)
    except (AiaynError, OSError, ValueError):
        return []


def _read_text(path: Path) -> str | None:
    return path.read_text(encoding="utf-8").strip() if path.is_file() else None


def _training(run_dir: Path) -> dict[str, Any] | None:
    """Step, epoch, tokens and time from train_state.pt (None when there is none)."""
    path = run_dir / "train_state.pt"
    if not path.is_file():
        return None
    state = load_train_state(path)
    return {"step": state.get("step"), "epoch": state.get("epoch"),
            "tokens": state.get("tokens"), "minutes": round(state.get("elapsed_s", 0) / 60, 2),
            "world_size": state.get("world_size")}


def _best(run_dir: Path, devs: list[dict[str, Any]], metric: str) -> dict[str, Any] | None:
    """The best validation by the run's rule: what best.safetensors holds (its metadata)
    and that step's dev record."""
    path = run_dir / "best.safetensors"
    if not path.is_file():
        return None
    meta = _metadata(path)
    step = int(meta["step"]) if meta.get("step", "").isdigit() else None
    # The last record of that step: a resumed run logs again the steps after its checkpoint.
    record = next((r for r in reversed(devs) if r.get("step") == step), {})
    return {"metric": meta.get("best_metric", "bleu" if "select_bleu" in meta else metric),
            "step": step, "dev_loss": record.get("dev_loss"), "bleu": record.get("bleu"),
            "chrf": record.get("chrf"), "n_sentences": record.get("n_sentences")}


def _metadata(path: Path) -> dict[str, str]:
    try:
        return read_metadata(path)
    except AiaynError:  # an unreadable file: `aiayn doctor` says why
        return {}


def _weights(run_dir: Path) -> list[dict[str, Any]]:
    """Every weights file with its step (from its metadata) and size."""
    named = sorted(run_dir.glob("*.safetensors"))
    rows = []
    for path in named + list_step_checkpoints(run_dir):
        meta = _metadata(path)
        rows.append({"file": str(path.relative_to(run_dir)),
                     "step": int(meta["step"]) if meta.get("step", "").isdigit() else None,
                     "mb": round(path.stat().st_size / 2**20, 1)})
    return rows


def format_info(info: dict[str, Any]) -> str:
    """The summary as aligned lines (of a run, or of prepared data: ``format_data``)."""
    if info.get("kind") == "data":
        return format_data(info)
    m, v, t = info["model"], info["vocabulary"], info["training"]
    lines = [
        f"run        {info['run_dir']}",
        f"model      {m['parameters'] / 1e6:.2f}M parameters: d_model {m['d_model']}, "
        f"{m['n_heads']} heads, d_ff {m['d_ff']}, {m['encoder_layers']}+"
        f"{m['decoder_layers']} layers, max_len {m['max_len']}, "
        f"{'pre' if m['norm_first'] else 'post'}-norm, tied {m['tie_embeddings']}",
        f"vocabulary {v['src']}/{v['tgt']} ({v['tokenizer']})",
        f"data       {info['data_dir'] or '?'} (corpus "
        f"{'; '.join(str(info['corpus']).splitlines())})",  # one line per corpus: joined
        *_directions_line(info.get("targets") or []),
        f"search     beam {info['decode']['beam']}, alpha {info['decode']['alpha']}"
        f"{_guard_words(info['decode'].get('no_repeat_ngram', 0))} (its config's decode: what "
        "translate, evaluate and serve use when not told)",
    ]
    if info.get("export") is not None:
        return "\n".join(lines + [f"export     {describe_export(info['export'])} "
                                  "(decode it with --engine ctranslate2)"])
    if info["init_from"]:
        i = info["init_from"]
        lines.append(f"init from  {i.get('weights')} (step {i.get('step')})")
    if t:
        tokens = f"{t['tokens']:,}" if isinstance(t.get("tokens"), int) else "?"
        lines.append(f"trained    {t['step']} steps, epoch {t['epoch']}, {tokens} target "
                     f"tokens, {t['minutes']:.1f} min, {t['world_size']} rank(s)")
    else:
        lines.append("trained    no train_state.pt")
    lines.append("best       " + _describe_dev(
        info["best"], f"best.safetensors, by dev {(info['best'] or {}).get('metric')}"))
    lines.append("last dev   " + _describe_dev(info["last_dev"], ""))
    weights = ", ".join(f"{w['file']} (step {w['step']})" if w["step"] is not None
                        else f"{w['file']} (no step: averaged or written outside training)"
                        for w in info["weights"])
    lines.append(f"weights    {weights or 'none'}")
    return "\n".join(lines)


def format_data(info: dict[str, Any]) -> str:
    """Prepared data as aligned lines: one per corpus, then its directions."""
    splits = info["splits"] or {}
    lines = [f"data       {info['data_dir']} (prepared)",
             f"tokenizer  {info['tokenizer']}",
             "splits     " + ", ".join(f"{k} {n}" for k, n in splits.items())]
    several = len(info["corpora"]) > 1
    for i, c in enumerate(info["corpora"], 1):
        languages = c["languages"]
        name = f"corpus {i}" if several else "corpus"
        counts = ", ".join(f"{k} {n}" for k, n in (c["splits"] or {}).items())
        lines.append(f"{name:<10} {c['line']}: {languages['src'] or '?'} -> "
                     f"{languages['tgt'] or '?'}" + (f", tag {c['tag']}" if c["tag"] else "")
                     + (f", source tag {c['source_tag']}" if c.get("source_tag") else "")
                     + f"; {counts}")
    lines += _directions_line(info["targets"])
    return "\n".join(lines)


def _directions_line(targets: list[str]) -> list[str]:
    """How to choose the direction of a model of several target languages (none: [])."""
    if not targets:
        return []
    return [f"directions into {', '.join(targets)}: say which with --to LANG (`aiayn "
            f"translate`, `score`, `attention`; Python: to=; serve: \"to\")"]


def _describe_dev(record: dict[str, Any] | None, note: str) -> str:
    if not record:
        return "none"
    parts = [f"step {record.get('step')}"]
    for key, label, digits in (("bleu", "BLEU", 2), ("chrf", "chrF", 2),
                               ("dev_loss", "loss", 3)):
        if isinstance(record.get(key), (int, float)):
            parts.append(f"{label} {record[key]:.{digits}f}")
    if record.get("n_sentences"):
        parts.append(f"on {record['n_sentences']} dev sentences")
    return ", ".join(parts) + (f" ({note})" if note else "")


def _guard_words(n: int) -> str:
    """The repetition guard in `aiayn info`'s search line ("" when off)."""
    return f", no repeated {n}-gram" if n else ""
