"""The data of the back-translation measurement (docs/data.md#back-translation).

`bt-split` halves a prepared directory's training split, alternate pairs: one half stays
parallel, the other half's targets become monolingual text (its sources are set aside, to
say how close the back-translations come). It writes, in --out:

    fwd-{train,dev,test}.tsv    the parallel half, and the directory's own dev and test
    rev-{train,dev,test}.tsv    the same, the sides swapped (for the reverse model)
    mono.tgt                    the other half's targets, one a line
    mono.src.reference          their real sources (never trained on)

    python benchmarks/directions.py bt-split --data data/bible-eng-spa --out data/bt
    aiayn prepare --corpus "tsv:data/bt/rev-{split}.tsv" --out data/bt-rev
    aiayn train --data data/bt-rev --out runs/bt-rev ...
    aiayn translate runs/bt-rev -i data/bt/mono.tgt -o data/bt/mono.bt
    paste data/bt/mono.bt data/bt/mono.tgt > data/bt/bt.tsv
    aiayn prepare --corpus "tsv:data/bt/fwd-{split}.tsv weight=1" \\
        --corpus "tsv:data/bt/bt.tsv weight=1 tag=bt splits=train" --out data/bt-with
"""

from __future__ import annotations

import argparse
from pathlib import Path

from aiayn.data.prepared import read_split


def _tsv(path: Path, pairs: list[tuple[str, str]], swap: bool = False) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        for src, tgt in pairs:
            fh.write(f"{tgt}\t{src}\n" if swap else f"{src}\t{tgt}\n")


def bt_split(data: Path, out: Path) -> dict[str, int]:
    """Write the files of the module docstring; returns the pairs of each half."""
    out.mkdir(parents=True, exist_ok=True)
    train = read_split(data / "train.jsonl")
    parallel, mono = train[0::2], train[1::2]
    for split, pairs in (("train", parallel), ("dev", read_split(data / "dev.jsonl")),
                         ("test", read_split(data / "test.jsonl"))):
        _tsv(out / f"fwd-{split}.tsv", pairs)
        _tsv(out / f"rev-{split}.tsv", pairs, swap=True)
    (out / "mono.tgt").write_text("".join(t + "\n" for _, t in mono), encoding="utf-8")
    (out / "mono.src.reference").write_text("".join(s + "\n" for s, _ in mono),
                                            encoding="utf-8")
    return {"parallel": len(parallel), "monolingual": len(mono)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("bt-split", help="halve a prepared training split: parallel and "
                       "monolingual")
    p.add_argument("--data", required=True, type=Path, help="a prepared data directory")
    p.add_argument("--out", required=True, type=Path, help="folder for the files")
    args = parser.parse_args()
    counts = bt_split(args.data, args.out)
    print(f"wrote {args.out}: {counts['parallel']} parallel pairs, "
          f"{counts['monolingual']} monolingual sentences")


if __name__ == "__main__":
    main()
