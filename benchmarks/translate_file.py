"""Translating a big file: `aiayn translate -i FILE -o OUT` against one in-process batch.

    python benchmarks/translate_file.py --run-dir runs/demo --lines 100000 --threads 1
    python benchmarks/translate_file.py --run-dir runs/demo --lines 200 --json row.json

Builds a file of N lines from the source side of the run's prepared data (the Bible's train
verses, repeated as often as N needs) and times, on the same sentences and search (greedy
by default):

- the command, as a user runs it: `aiayn translate RUN -i FILE -o OUT` in its own process
  (lazy reading, chunks of --chunk-lines written and fsync'ed to OUT.partial with their
  record, the rename at the end); its wall time, and that time less the same command's on an
  empty file (the start: imports and loading the model), and its peak RSS (the process's
  ru_maxrss), which should not grow with N;
- the reference: the same lines in one ``Translator.translate`` call in this process (length-
  sorted batches of the decoding budget over all of them, as `aiayn evaluate` decodes), the
  model loaded before the clock starts.

The claim is the ratio of lines/s (the command's, start excluded, over the reference's),
measured in one run; the contenders take turns over --repeats (medians). It also says how
many output lines equal the reference's (chunks batch sentences otherwise than one call,
which may move a float in the last place, rarely a token).

``--json PATH``: the table (a row for each --chunk-lines) with its conditions (command,
commit, CPU, torch, load, date), in the shape of benchmarks/results/*.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402  (benchmarks/ is not a package)
    add_json_option,
    add_repeats_option,
    add_run_options,
    add_threads_option,
    cpu_flags,
    cpu_model,
    git_commit,
    note_load,
    set_threads,
)

from aiayn.data.prepared import load_prepared  # noqa: E402
from aiayn.inference.translator import Translator  # noqa: E402
from aiayn.options import CHUNK_LINES  # noqa: E402
from aiayn.runs.directory import read_data_dir  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_options(p, split=False)
    p.add_argument("--lines", type=int, default=100_000, help="lines in the file")
    p.add_argument("--beam", type=int, default=1, help="beam (default 1: greedy)")
    p.add_argument("--decode-tokens", type=int, default=8192,
                   help="decoding budget: padded source tokens x beam of a batch")
    p.add_argument("--chunk-lines", type=int, nargs="+", default=[CHUNK_LINES],
                   help="the command's --chunk-lines: a row for each, against one reference")
    add_repeats_option(p, 1)
    add_threads_option(p, default=1, help="torch threads, here and in the command")
    p.add_argument("--work", help="folder for the file and the outputs (default: a temporary one)")
    add_json_option(p)
    return p.parse_args(argv)


def verses(run_dir: str, n: int) -> list[str]:
    """``n`` source sentences: the run's train verses, over again as often as needed."""
    sources = [src for src, _ in load_prepared(read_data_dir(run_dir)).split("train")]
    return [sources[i % len(sources)] for i in range(n)]


def run_command(args, source: Path, out: Path, chunk: int) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of `aiayn translate` on ``source`` in its own process."""
    command = [sys.executable, "-m", "aiayn", "translate", args.run_dir, "-i", str(source),
               "-o", str(out), "--weights", args.weights, "--beam", str(args.beam),
               "--decode-tokens", str(args.decode_tokens), "--chunk-lines",
               str(chunk), "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    start = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    err = proc.stderr.read().decode("utf-8", "replace") if proc.stderr else ""
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"aiayn translate failed: {err.strip()[-500:]}")
    return seconds, usage.ru_maxrss / 1024


def measure(args, work: Path) -> list[dict]:
    """A row for each --chunk-lines: the command's lines/s against the reference's, the
    contenders taking turns in each repetition (medians)."""
    lines = verses(args.run_dir, args.lines)
    source, empty = work / "in.txt", work / "empty.txt"
    source.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    empty.write_text("", encoding="utf-8")
    set_threads(args.threads)
    translator = Translator.from_pretrained(args.run_dir, args.weights, device="cpu",
                                            decode_tokens=args.decode_tokens)
    search = translator.resolve(beam=args.beam)
    translator.translate(lines[:8], search)  # warm-up
    chunks = args.chunk_lines
    command = {c: [] for c in chunks}
    rss = {c: [] for c in chunks}
    start, batch, same = [], [], {}
    reference: list[str] = []
    for repeat in range(args.repeats):
        for who in ("command", "batch") if repeat % 2 == 0 else ("batch", "command"):
            if who == "batch":
                began = time.perf_counter()
                reference = translator.translate(lines, search)
                batch.append(time.perf_counter() - began)
                continue
            start.append(run_command(args, empty, work / "empty.out", chunks[0])[0])
            for chunk in chunks:
                seconds, peak = run_command(args, source, work / f"out{chunk}.txt", chunk)
                command[chunk].append(seconds)
                rss[chunk].append(peak)
    fixed, alone = statistics.median(start), statistics.median(batch)
    rows = []
    for chunk in chunks:
        written = (work / f"out{chunk}.txt").read_text(encoding="utf-8").split("\n")[:-1]
        same = sum(a == b for a, b in zip(written, reference, strict=True)) / max(1, len(lines))
        wall = statistics.median(command[chunk])
        net = wall - fixed
        # A start that varies by more than the work leaves no rate to report (a few lines: the
        # difference of two noisy times could even be negative): None, said in words.
        measured = net > 0.1 * fixed
        rows.append({"lines": args.lines, "beam": args.beam, "chunk_lines": chunk,
                     "threads": args.threads, "command_s": round(wall, 2),
                     "start_s": round(fixed, 2),
                     "command_lines_per_s": round(args.lines / net, 1) if measured else None,
                     "command_lines_per_s_with_start": round(args.lines / wall, 1),
                     "batch_lines_per_s": round(args.lines / alone, 1),
                     "ratio": round(alone / net, 3) if measured else None,
                     "peak_rss_mb": round(max(rss[chunk])), "same_lines": round(same, 4)})
    return rows


TABLE = {
    "title": "Translating a file",
    "order": 42,
    "script": "benchmarks/translate_file.py",
    "about": "`aiayn translate RUN -i FILE -o OUT` as a user runs it (its own process: the file "
             "checked, then read lazily, chunks of `--chunk-lines` written and fsync'ed to "
             "OUT.partial with their record, the rename at the end) against the same lines in "
             "one `Translator.translate` call (length-sorted batches over all of them, as "
             "`aiayn evaluate` decodes): lines/s with the command's start (imports, loading) "
             "taken out, measured in one run, and the command's peak memory "
             "([large files](translating.md#large-files-progress-and-resume)).",
    "columns": [
        {"key": "chunk_lines", "label": "--chunk-lines", "align": "right"},
        {"key": "command_lines_per_s", "label": "command lines/s", "align": "right"},
        {"key": "batch_lines_per_s", "label": "one call lines/s", "align": "right"},
        {"key": "ratio", "label": "ratio", "align": "right"},
        {"key": "peak_rss_mb", "label": "peak RSS MB", "align": "right"},
        {"key": "same_lines", "label": "lines as the call's", "align": "right"},
    ],
    "notes": ["At the end of each chunk the CPU streams wait for its last batches; at 10,000 "
              "lines a chunk (the default) that wait no longer shows."],
}


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    load = note_load()
    if args.work:
        Path(args.work).mkdir(parents=True, exist_ok=True)
        rows = measure(args, Path(args.work))
    else:
        with tempfile.TemporaryDirectory() as work:
            rows = measure(args, Path(work))
    print(f"{args.lines:,} lines, beam {args.beam}, {args.threads} thread(s); one "
          f"Translator.translate call {rows[0]['batch_lines_per_s']:,.1f} lines/s")
    for row in rows:
        rate = (f"{row['command_lines_per_s']:,.1f} lines/s (start {row['start_s']:.1f} s "
                f"excluded), ratio {row['ratio']:.3f}" if row["ratio"] is not None else
                f"{row['command_s']:.1f} s, within the noise of its {row['start_s']:.1f} s "
                "start (no rate: give more --lines)")
        print(f"  aiayn translate -i FILE -o OUT, chunks of {row['chunk_lines']:,}: {rate}, "
              f"peak RSS {row['peak_rss_mb']} MB, {100 * row['same_lines']:.2f}% of lines as "
              "the call's")
    if args.json:
        label = f"{args.lines}-lines-beam{args.beam}"
        record = {**TABLE, "rows": [{**row, "conditions": label} for row in rows],
                  "conditions": {label: {
                      "command": "python benchmarks/translate_file.py " + " ".join(
                          sys.argv[1:] if argv is None else argv),
                      "commit": git_commit(), "cpu": cpu_model(),
                      "cpu_flags": " ".join(sorted(f for f in cpu_flags() if f.startswith(
                          ("avx", "amx")))),
                      "torch": torch.__version__, "load": f"{load:.2f} (1 min, before)",
                      "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}}}
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
