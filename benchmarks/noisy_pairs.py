"""Noisy training pairs and filtering them by score (docs/scoring.md#filtering-a-noisy-corpus).

`noisy` copies a prepared data directory with a share of its training targets shuffled among
themselves (reproducible with --seed), so that those pairs no longer translate each other;
`filter` copies a prepared directory without the training pairs that `aiayn score` gave the
lowest scores (or, the control, as many drawn at random), and, given the noisy directory's
record of which pairs it shuffled, says how many of them the filter caught (precision and
recall). The tokenizer, dev and test are the
source's, unchanged, so runs trained on the copies are scored on the same test verses.

    python benchmarks/noisy_pairs.py noisy --data data/bible-eng-spa --out data/noisy --share 0.2
    aiayn score RUN --split train --data data/noisy -o scores.tsv
    python benchmarks/noisy_pairs.py filter --data data/noisy --scores scores.tsv --drop 0.2 \
        --out data/filtered
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

from aiayn.data.prepared import IDS_DIR, STATS_FILE, SplitIds
from aiayn.data.tokenids import ids_path, offsets_path

SHUFFLED_FILE = "shuffled.json"  # the noisy copy's record of the pairs it shuffled


def _copy_without_train(src: Path, out: Path) -> dict:
    """The prepared directory ``src`` copied to ``out`` but for its training split."""
    out.mkdir(parents=True, exist_ok=False)
    for name in ("dev.jsonl", "test.jsonl"):
        shutil.copy2(src / name, out / name)
    shutil.copytree(src / "tokenizer", out / "tokenizer")
    (out / IDS_DIR).mkdir()
    for split in ("dev", "test"):
        for side in ("src", "tgt"):
            for path in (ids_path(src / IDS_DIR, split, side), offsets_path(src / IDS_DIR, split, side)):
                shutil.copy2(path, out / IDS_DIR / path.name)
    return json.loads((src / STATS_FILE).read_text(encoding="utf-8"))


def _write_train(out: Path, stats: dict, pairs: list[tuple[str, str]],
                 src_rows: list[list[int]], tgt_rows: list[list[int]], dtype) -> None:
    with open(out / "train.jsonl", "w", encoding="utf-8") as fh:
        for s, t in pairs:
            fh.write(json.dumps({"src": s, "tgt": t}, ensure_ascii=False) + "\n")
    for side, rows in (("src", src_rows), ("tgt", tgt_rows)):
        flat = np.array([i for row in rows for i in row], dtype=dtype)
        offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
        np.save(ids_path(out / IDS_DIR, "train", side), flat)
        np.save(offsets_path(out / IDS_DIR, "train", side), offsets)
    stats["ids"]["pairs"]["train"] = len(pairs)
    stats["splits"]["train"] = len(pairs)
    (out / STATS_FILE).write_text(json.dumps(stats, indent=2, ensure_ascii=False) + "\n",
                                  encoding="utf-8")


def _train(src: Path) -> tuple[list[tuple[str, str]], list[list[int]], list[list[int]], object]:
    records = (json.loads(line) for line in open(src / "train.jsonl", encoding="utf-8"))
    pairs = [(r["src"], r["tgt"]) for r in records]
    ids = SplitIds.open(src / IDS_DIR, "train")
    return (pairs, [ids.src.row(i) for i in range(len(pairs))],
            [ids.tgt.row(i) for i in range(len(pairs))], ids.src.ids.dtype)


def make_noisy(src: Path, out: Path, share: float, seed: int) -> None:
    pairs, src_rows, tgt_rows, dtype = _train(src)
    rng = np.random.default_rng(seed)
    chosen = np.sort(rng.choice(len(pairs), size=round(share * len(pairs)), replace=False))
    # One cycle through the chosen pairs in a random order: each takes the next one's target,
    # so none keeps its own (a random permutation would leave about one in place).
    order = rng.permutation(chosen)
    chosen, moved = order, np.roll(order, -1)
    new_pairs, new_tgt = list(pairs), list(tgt_rows)
    for i, j in zip(chosen.tolist(), moved.tolist()):
        new_pairs[i] = (pairs[i][0], pairs[j][1])
        new_tgt[i] = tgt_rows[j]
    stats = _copy_without_train(src, out)
    stats["corpus"] = f"{stats.get('corpus')} with {share:.0%} of the train targets shuffled (seed {seed})"
    _write_train(out, stats, new_pairs, src_rows, new_tgt, dtype)
    (out / SHUFFLED_FILE).write_text(json.dumps({"seed": seed, "share": share,
                                                 "lines": sorted(i + 1 for i in chosen.tolist())}) + "\n")
    print(f"{out}: {len(pairs)} training pairs, {len(chosen)} targets shuffled (seed {seed})")


def read_scores(path: Path, column: str) -> list[float]:
    """One score per line of an `aiayn score` TSV output (SCORE, LOG_PROB, TOKENS, ...)."""
    index = {"score": 0, "log_prob": 1, "mean": None}[column]
    values = []
    for line in open(path, encoding="utf-8"):
        fields = line.rstrip("\n").split("\t")
        if index is None:  # the per-token mean: log-prob over (target pieces + EOS)
            values.append(float(fields[1]) / int(fields[2]))
        else:
            values.append(float(fields[index]))
    return values


def filter_pairs(src: Path, scores_path: Path | None, drop: float, out: Path, column: str,
                 seed: int = 1) -> dict:
    pairs, src_rows, tgt_rows, dtype = _train(src)
    if column == "random":  # the control: as many pairs dropped, blind to the scores
        scores = np.random.default_rng(seed).random(len(pairs))
        scores_path = Path(f"random (seed {seed})")
    else:
        scores = np.array(read_scores(scores_path, column))
    if len(scores) != len(pairs):
        raise SystemExit(f"{scores_path}: {len(scores)} scores for {len(pairs)} training pairs")
    # Lowest first; a stable sort, so ties drop the earlier line, the same every time.
    dropped = np.sort(np.argsort(scores, kind="stable")[:round(drop * len(pairs))])
    keep = np.setdiff1d(np.arange(len(pairs)), dropped)
    stats = _copy_without_train(src, out)
    stats["corpus"] = f"{stats.get('corpus')}, less the {drop:.0%} lowest by {column}"
    _write_train(out, stats, [pairs[i] for i in keep], [src_rows[i] for i in keep],
                 [tgt_rows[i] for i in keep], dtype)
    report = {"pairs": len(pairs), "dropped": len(dropped), "by": column}
    record = src / SHUFFLED_FILE
    if record.is_file():
        shuffled = {line - 1 for line in json.loads(record.read_text())["lines"]}
        caught = len(shuffled & set(dropped.tolist()))
        report |= {"shuffled": len(shuffled), "caught": caught,
                   "precision": round(caught / max(len(dropped), 1), 4),
                   "recall": round(caught / max(len(shuffled), 1), 4)}
    print(json.dumps(report))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    noisy = sub.add_parser("noisy", help="a copy with a share of the training targets shuffled")
    noisy.add_argument("--data", type=Path, required=True)
    noisy.add_argument("--out", type=Path, required=True)
    noisy.add_argument("--share", type=float, default=0.2)
    noisy.add_argument("--seed", type=int, default=0)
    filt = sub.add_parser("filter", help="a copy without the lowest-scoring training pairs")
    filt.add_argument("--data", type=Path, required=True)
    filt.add_argument("--scores", type=Path, help="`aiayn score` TSV output (not with --by random)")
    filt.add_argument("--drop", type=float, default=0.2)
    filt.add_argument("--by", choices=("score", "log_prob", "mean", "random"), default="mean",
                      help="SCORE, LOG_PROB, their mean per token LOG_PROB/TOKENS, or random "
                      "(a control that drops as many pairs blind)")
    filt.add_argument("--seed", type=int, default=1, help="--by random: its seed")
    filt.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.command == "noisy":
        make_noisy(args.data, args.out, args.share, args.seed)
    else:
        if (args.scores is None) != (args.by == "random"):
            parser.error("--scores is needed, except with --by random")
        filter_pairs(args.data, args.scores, args.drop, args.out, args.by, args.seed)


if __name__ == "__main__":
    main()
