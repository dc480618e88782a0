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

``--json PATH``: the row and its conditions (command, commit, CPU, torch, load, date) as
JSON, in the shape of benchmarks/results/*.json's rows and conditions.
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
from aiayn.inference.files import CHUNK_LINES  # noqa: E402
from aiayn.inference.translator import Translator  # noqa: E402
from aiayn.runs.directory import read_data_dir  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_options(p, split=False)
    p.add_argument("--lines", type=int, default=100_000, help="lines in the file")
    p.add_argument("--beam", type=int, default=1, help="beam (default 1: greedy)")
    p.add_argument("--decode-tokens", type=int, default=8192,
                   help="decoding budget: padded source tokens x beam of a batch")
    p.add_argument("--chunk-lines", type=int, default=CHUNK_LINES,
                   help="the command's --chunk-lines")
    add_repeats_option(p, 1)
    add_threads_option(p, default=1, help="torch threads, here and in the command")
    p.add_argument("--work", help="folder for the file and the outputs (default: a temporary one)")
    add_json_option(p)
    return p.parse_args(argv)


def verses(run_dir: str, n: int) -> list[str]:
    """``n`` source sentences: the run's train verses, over again as often as needed."""
    sources = [src for src, _ in load_prepared(read_data_dir(run_dir)).split("train")]
    return [sources[i % len(sources)] for i in range(n)]


def run_command(args, source: Path, out: Path) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of `aiayn translate` on ``source`` in its own process."""
    command = [sys.executable, "-m", "aiayn", "translate", args.run_dir, "-i", str(source),
               "-o", str(out), "--weights", args.weights, "--beam", str(args.beam),
               "--decode-tokens", str(args.decode_tokens), "--chunk-lines",
               str(args.chunk_lines), "--device", "cpu"]
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


def measure(args, work: Path) -> dict:
    lines = verses(args.run_dir, args.lines)
    source, empty = work / "in.txt", work / "empty.txt"
    source.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    empty.write_text("", encoding="utf-8")
    set_threads(args.threads)
    translator = Translator.from_pretrained(args.run_dir, args.weights, device="cpu",
                                            decode_tokens=args.decode_tokens)
    search = translator.resolve(beam=args.beam)
    translator.translate(lines[:8], search)  # warm-up
    command, start, batch, rss = [], [], [], []
    reference: list[str] = []
    for repeat in range(args.repeats):
        for who in ("command", "batch") if repeat % 2 == 0 else ("batch", "command"):
            if who == "batch":
                began = time.perf_counter()
                reference = translator.translate(lines, search)
                batch.append(time.perf_counter() - began)
            else:
                start.append(run_command(args, empty, work / "empty.out")[0])
                seconds, peak = run_command(args, source, work / "out.txt")
                command.append(seconds)
                rss.append(peak)
    written = (work / "out.txt").read_text(encoding="utf-8").split("\n")[:-1]
    same = sum(a == b for a, b in zip(written, reference, strict=True)) / max(1, len(lines))
    wall, fixed, alone = (statistics.median(x) for x in (command, start, batch))
    net = max(wall - fixed, 1e-9)
    return {"lines": args.lines, "beam": args.beam, "chunk_lines": args.chunk_lines,
            "threads": args.threads, "command_s": round(wall, 2), "start_s": round(fixed, 2),
            "command_lines_per_s": round(args.lines / net, 1),
            "command_lines_per_s_with_start": round(args.lines / wall, 1),
            "batch_lines_per_s": round(args.lines / alone, 1),
            "ratio": round((args.lines / net) / (args.lines / alone), 3),
            "peak_rss_mb": round(max(rss)), "same_lines": round(same, 4)}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    load = note_load()
    if args.work:
        Path(args.work).mkdir(parents=True, exist_ok=True)
        row = measure(args, Path(args.work))
    else:
        with tempfile.TemporaryDirectory() as work:
            row = measure(args, Path(work))
    print(f"{row['lines']:,} lines, beam {row['beam']}, chunks of {row['chunk_lines']:,}, "
          f"{row['threads']} thread(s):")
    print(f"  aiayn translate -i FILE -o OUT  {row['command_lines_per_s']:>9,.1f} lines/s "
          f"(start {row['start_s']:.1f} s excluded; {row['command_lines_per_s_with_start']:,.1f}"
          f" with it), peak RSS {row['peak_rss_mb']} MB")
    print(f"  one Translator.translate call   {row['batch_lines_per_s']:>9,.1f} lines/s")
    print(f"  ratio {row['ratio']:.3f}; output lines equal to the call's: "
          f"{100 * row['same_lines']:.2f}%")
    if args.json:
        label = f"{row['lines']}-lines-beam{row['beam']}"
        record = {"script": "benchmarks/translate_file.py",
                  "rows": [{**row, "conditions": label}],
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
    return row


if __name__ == "__main__":
    main()
