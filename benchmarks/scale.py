"""How `aiayn prepare` and `aiayn train` scale with the corpus: millions of pairs.

Builds a tab-separated corpus from the Bible's train verses (bible:eng-spa, 29,417 pairs)
and lightly varied copies of them (copy k puts "k:" before both sides and swaps two
neighbouring words in about half of the pairs; 34 copies = 1,000,178 pairs, ~250 MB;
136 copies = 4,000,712 pairs), then measures, each command in its own
process:

- `aiayn prepare --corpus tsv:FILE --out DIR` (default data settings): wall time, peak RSS;
- `aiayn train --config CONFIG --data DIR --out RUN --max-minutes M`: seconds from launch
  to the first optimizer step (the first line of metrics.jsonl, log_every=1), total wall
  time (the final validation and save included), peak RSS, and how long the final
  validation took (its eval_s).

Peak RSS is the child's ru_maxrss from os.wait4 (the resource usage of that one process).

    python benchmarks/scale.py --copies 34 --copies 136 --work /tmp/scale
    python benchmarks/scale.py --copies 2 --work /tmp/scale-small          # a quick look
    python benchmarks/scale.py --copies 4 --reference /tmp/old/src          # against another
                                          # aiayn source tree (e.g. `git archive` of a commit);
                                          # its training is stopped after the first step

Results are appended to --results (JSON lines) and printed as a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE_PAIRS = 29_417  # bible:eng-spa train verses


def build_corpus(path: Path, copies: int) -> int:
    """The Bible's train verses and ``copies - 1`` varied copies; returns the pair count."""
    from aiayn.config import DataConfig
    from aiayn.data.corpora import CorpusStream

    # The Bible gives its split itself (by books), so the stream's train pairs are prepare's.
    base = [(p.src, p.tgt) for p, split in CorpusStream("bible:eng-spa", DataConfig())
            if split == "train"]
    n = 0
    with open(path, "w", encoding="utf-8") as fh:
        for k in range(copies):
            rng = random.Random(k)
            for src, tgt in base:
                if k:
                    src, tgt = f"{k}: {_swap(src, rng)}", f"{k}: {_swap(tgt, rng)}"
                fh.write(f"{src}\t{tgt}\n")
                n += 1
    return n


def _swap(text: str, rng: random.Random) -> str:
    words = text.split(" ")
    if len(words) > 2 and rng.random() < 0.5:
        i = rng.randrange(len(words) - 1)
        words[i], words[i + 1] = words[i + 1], words[i]
    return " ".join(words)


def measure(cmd: list[str], env: dict[str, str], watch: Path | None = None,
            log: Path | None = None, stop_at_first_step: bool = False) -> dict:
    """Run ``cmd``; wall seconds, peak RSS (MB) and, with ``watch`` (a metrics.jsonl), the
    seconds until its first train record appeared (``stop_at_first_step``: then end it)."""
    start = time.perf_counter()
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    first_step = None
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if watch is not None and first_step is None and watch.is_file():
            if any('"kind": "train"' in line for line in watch.read_text().splitlines()):
                first_step = time.perf_counter() - start
                if stop_at_first_step:
                    proc.terminate()
        time.sleep(0.05)
    wall = time.perf_counter() - start
    if log:
        out.close()
    code = os.waitstatus_to_exitcode(status)
    if code != 0 and not (stop_at_first_step and first_step):
        tail = log.read_text()[-2000:] if log else ""
        raise SystemExit(f"{' '.join(cmd)} failed ({code}):\n{tail}")
    return {"wall_s": round(wall, 1), "peak_rss_mb": round(usage.ru_maxrss / 1024),
            **({"first_step_s": round(first_step, 1) if first_step else None} if watch else {})}


def run_size(copies: int, args, env: dict[str, str], label: str) -> dict:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / f"bible-x{copies}.tsv"
    if not corpus.is_file():
        began = time.perf_counter()
        n = build_corpus(corpus, copies)
        print(f"built {corpus} ({n} pairs, {corpus.stat().st_size / 1e6:.0f} MB) in "
              f"{time.perf_counter() - began:.0f}s", flush=True)
    pairs = sum(1 for _ in open(corpus, "rb"))
    data, run = work / f"data-x{copies}-{label}", work / f"run-x{copies}-{label}"
    for path in (data, run):
        shutil.rmtree(path, ignore_errors=True)
    aiayn = [sys.executable, "-m", "aiayn"]
    result = {"label": label, "pairs": pairs, "mb": round(corpus.stat().st_size / 1e6)}
    sets = [x for value in args.prepare_set or [] for x in ("--set", value)]
    result["prepare"] = measure([*aiayn, "prepare", "--corpus", f"tsv:{corpus}", "--out",
                                 str(data), *sets], env, log=work / f"prepare-x{copies}-{label}.log")
    if sets:
        result["prepare_set"] = args.prepare_set
    print(f"{label} {pairs} pairs: prepare {result['prepare']}", flush=True)
    if args.max_minutes > 0:
        # A reference source tree may decode the whole dev split at the end, with no
        # bound: its run is stopped after the first step.
        result["train"] = measure(
            [*aiayn, "train", "--config", args.config, "--data", str(data), "--out", str(run),
             "--max-minutes", str(args.max_minutes), "--set", "train.log_every=1"],
            env, watch=run / "metrics.jsonl", log=work / f"train-x{copies}-{label}.log",
            stop_at_first_step=label == "reference" or args.stop_at_first_step)
        if label == "reference" or args.stop_at_first_step:
            result["train"]["wall_s"] = None  # stopped
        devs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        devs = [r for r in devs if r["kind"] == "dev"]
        if devs:
            result["train"]["final_validation_s"] = round(devs[-1].get("eval_s", 0), 1)
            result["train"]["dev_sentences"] = devs[-1].get("n_sentences")
        print(f"{label} {pairs} pairs: train {result['train']}", flush=True)
    if not args.keep:
        for path in (data, run):
            shutil.rmtree(path, ignore_errors=True)
    return result


def table(results: list[dict]) -> str:
    lines = ["| code | pairs | prepare wall | prepare peak RSS | train: launch to first step "
             "| train peak RSS | train total wall | final validation |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        p, t = r["prepare"], r.get("train", {})
        lines.append(f"| {r['label']} | {r['pairs']:,} | {p['wall_s']} s | {p['peak_rss_mb']} MB "
                     f"| {t.get('first_step_s', '-')} s | {t.get('peak_rss_mb', '-')} MB "
                     f"| {t.get('wall_s', '-')} s | {t.get('final_validation_s', '-')} s |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, action="append",
                        help="corpus sizes in copies of the Bible's train verses (repeatable; "
                        "34: 1M pairs, 136: 4M)")
    parser.add_argument("--work", default="/tmp/aiayn-scale", help="corpora, data and runs")
    parser.add_argument("--config", default=str(ROOT / "configs" / "bible-small.yaml"))
    parser.add_argument("--max-minutes", type=float, default=0.5,
                        help="training budget of the train measurement (0: no training)")
    parser.add_argument("--reference", help="another aiayn source directory (its src/) to "
                        "measure too, in the same run, e.g. an earlier checkout to compare with")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "scale.jsonl"))
    parser.add_argument("--keep", action="store_true", help="keep the prepared data and runs")
    parser.add_argument("--build-only", action="store_true", help="only write the corpora")
    parser.add_argument("--stop-at-first-step", action="store_true",
                        help="end each training at its first step (start-up time and memory only)")
    parser.add_argument("--prepare-set", action="append", metavar="KEY=VALUE",
                        help="a --set for aiayn prepare, e.g. data.tokenizer_max_pairs=100000")
    args = parser.parse_args()
    if args.build_only:
        Path(args.work).mkdir(parents=True, exist_ok=True)
        for copies in args.copies or [34]:
            n = build_corpus(Path(args.work) / f"bible-x{copies}.tsv", copies)
            print(f"bible-x{copies}.tsv: {n} pairs")
        return
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    versions = [("this", env)]
    if args.reference:
        ref = str(Path(args.reference).resolve())
        versions.append(("reference", {**env, "PYTHONPATH": ref, "PYTHONDONTWRITEBYTECODE": "1"}))
    results = []
    for copies in args.copies or [34]:
        for label, version_env in versions:
            result = run_size(copies, args, version_env, label)
            result.update({"copies": copies, "cpus": os.cpu_count(),
                           "max_minutes": args.max_minutes, "config": Path(args.config).name,
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
            results.append(result)
            with open(args.results, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(result) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
