"""Speed on a machine that is doing something else: decoding (and training), quiet and
beside a background load on one core, 1 vs 2 threads, aiayn vs CTranslate2, in one run.

    python benchmarks/threads.py --run-dir RUN --repeats 2               # decoding, 5 loads
    python benchmarks/threads.py --run-dir RUN --no-decode --train-seconds 45   # training

Loads (started by this script, pinned with taskset to the last core, stopped after):
quiet; benchmarks/busy.py at 50% (50 ms spinning, 50 ms asleep); at 100%; at 100% under
`nice -n 19`; another PyTorch job (``busy.py --torch``: small ops on 2 OpenMP threads).
In each, the decoding contenders take turns (order alternating) over the same sentences,
and the table gives sentences/s (median of --repeats) and the ratio to *quiet one-thread*
aiayn, whose floor is 0.8x:

- ``aiayn, 1 stream x 2 threads``: every op split over two OpenMP threads, batches one
  after another in the calling thread;
- ``aiayn, 1 thread``: one stream of one thread;
- ``aiayn, 2 streams x 1 thread``: aiayn's default (``aiayn.util.threads.parallel_map``);
- ``CTranslate2 float32``: the run exported (``aiayn.export``), 2 intra-op threads, decoded
  through the same Translator (only the search differs). The run must export, as the
  demo's does: a model with ``model.qk_norm_cross_query: heads`` does not, so pass --no-ct2
  for one.

Every contender goes through ``aiayn.evaluation.evaluate.translate_and_score``; the script checks that
aiayn's three settings translate every sentence the same.

With ``--train-seconds S`` each load also runs `aiayn train` (the run's config.yaml, on
its data, no validation or saving) for S seconds with train.cpu_threads 0 (the adaptive
tuner), 1 and 2, and reports steps per second of training time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402  (benchmarks/ is not a package)
    add_repeats_option,
    add_run_options,
    add_search_options,
    device_description,
    interleave,
    markdown_table,
    median,
    run_pairs,
    script_parser,
)

from aiayn.evaluation.evaluate import translate_and_score  # noqa: E402
from aiayn.inference.translator import Translator  # noqa: E402
from aiayn.runs.directory import read_data_dir  # noqa: E402

HERE = Path(__file__).resolve().parent
BUSY = [sys.executable, str(HERE / "busy.py")]
LOADS = {
    "quiet": None,
    "50% busy": [*BUSY, "--on-ms", "50", "--off-ms", "50"],
    "100% busy": [*BUSY, "--on-ms", "100", "--off-ms", "0"],
    "100% busy at nice 19": ["nice", "-n", "19", *BUSY, "--on-ms", "100", "--off-ms", "0"],
    "a PyTorch job": [*BUSY, "--torch"],
}
# name -> (streams, threads per stream) of aiayn's own search
AIAYN = {"aiayn, 1 stream x 2 threads (every op on both cores)": (1, 2), "aiayn, 1 thread": (1, 1),
         "aiayn, 2 streams x 1 thread (the default)": (2, 1)}
REFERENCE = "aiayn, 1 thread"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = script_parser(__doc__)
    add_run_options(p)
    add_search_options(p)
    add_repeats_option(p, 2)
    p.add_argument("--loads", default=",".join(LOADS),
                   help=f"comma-separated, of: {', '.join(LOADS)}".replace("%", "%%"))
    p.add_argument("--no-ct2", action="store_true", help="leave CTranslate2 out")
    p.add_argument("--no-decode", action="store_true", help="time training only")
    p.add_argument("--train-seconds", type=float, default=0.0,
                   help="also time `aiayn train` this long per load and thread setting")
    p.add_argument("--core", type=int, default=(os.cpu_count() or 1) - 1,
                   help="the core the load is pinned to")
    args = p.parse_args(argv)
    args.loads = [name.strip() for name in args.loads.split(",")]
    unknown = [name for name in args.loads if name not in LOADS]
    if unknown:
        p.error(f"--loads: unknown {', '.join(unknown)}")
    return args


@contextlib.contextmanager
def background(command: list[str] | None, core: int):
    """The load, pinned to ``core``, for the duration of the block."""
    if command is None:
        yield
        return
    proc = subprocess.Popen(["taskset", "-c", str(core), *command])
    try:
        time.sleep(1.0)  # let the scheduler see it
        yield
    finally:
        proc.terminate()
        proc.wait()


def decoders(args, tmp: Path) -> dict[str, Translator]:
    translators = {}
    for name, (streams, per_stream) in AIAYN.items():
        translators[name] = Translator.from_pretrained(
            args.run_dir, args.weights, decode_tokens=args.decode_tokens, streams=streams,
            threads_per_stream=per_stream)
    if not args.no_ct2:
        from aiayn.export.command import export_run

        out = tmp / "ct2-float32"
        export_run(args.run_dir, "ctranslate2", out, args.weights, "float32")
        torch.set_num_threads(2)  # CTranslate2's intra_threads follow torch's count
        translators["CTranslate2 float32, 2 threads"] = Translator.from_pretrained(
            out, engine="ctranslate2", decode_tokens=args.decode_tokens)
    return translators


def time_decoding(args, translators, pairs) -> tuple[dict[str, float], dict[str, list]]:
    outputs: dict[str, list] = {name: [] for name in translators}

    def contender(name: str):
        def run() -> None:
            translator = translators[name]
            search = translator.resolve(beam=args.beam, alpha=args.alpha)
            outputs[name].append(translate_and_score(translator, pairs, search)[0])
        return run

    times = interleave({name: contender(name) for name in translators}, args.repeats,
                       warmup=0)
    rates = {name: len(pairs) / median([sum(rep) for rep in times[name]]) for name in times}
    return rates, outputs


def time_training(args, seconds: float, threads: int) -> float:
    """Steps per second of training time of `aiayn train` on the run's config and data."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        command = [sys.executable, "-m", "aiayn", "train", "--config",
                   str(Path(args.run_dir) / "config.yaml"), "--data",
                   str(read_data_dir(args.run_dir)), "--out", str(out),
                   "--max-minutes", str(seconds / 60), "--set", f"train.cpu_threads={threads}",
                   "--set", "train.eval_every=100000000", "--set", "train.save_every=100000000",
                   "--set", "train.max_steps=100000000", "--set", "train.log_every=1"]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                if '"train"' in line][-1]
        return last["step"] / last["elapsed_s"]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    pairs = run_pairs(args)
    rates: dict[str, dict[str, float]] = {}
    train: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        translators = {} if args.no_decode else decoders(args, Path(tmp))
        for translator in translators.values():  # untimed: thread pools, allocators
            translator.translate([src for src, _ in pairs[:16]],
                                 translator.resolve(beam=args.beam, alpha=args.alpha))
        for load in args.loads:
            with background(LOADS[load], args.core):
                if translators:
                    rates[load], outputs = time_decoding(args, translators, pairs)
                if args.train_seconds > 0:
                    train[load] = {f"train.cpu_threads={n}": time_training(args, args.train_seconds, n)
                                   for n in (0, 1, 2)}
                    print(f"{load}: " + ", ".join(f"{n} {r:.2f} steps/s"
                                                  for n, r in train[load].items()), flush=True)
            if not translators:
                continue
            reference = outputs[REFERENCE][0]
            for name in AIAYN:
                if any(out != reference for out in outputs[name]):
                    raise SystemExit(f"{name} ({load}): translations differ from {REFERENCE}")
            print(f"{load}: " + ", ".join(f"{n} {r:.1f}" for n, r in rates[load].items()),
                  flush=True)
    report(args, pairs, rates, train)


def report(args, pairs, rates, train) -> None:
    quiet_one = rates.get("quiet", {}).get(REFERENCE)
    loads = list(rates)

    def cell(value: float, floor: float | None) -> str:
        return f"{value:.1f}" + (f" ({value / floor:.2f}x)" if floor else "")

    if rates:
        print(f"\n{len(pairs)} {args.split} sentences of {args.run_dir} ({args.weights}), beam "
              f"{args.beam}, alpha {args.alpha}, decode_tokens {args.decode_tokens}; "
              f"sentences/s, median of {args.repeats}; (x) = against quiet '{REFERENCE}'; load "
              f"pinned to core {args.core}")
    print(f"device: {device_description()}\n")
    if rates:
        names = list(next(iter(rates.values())))
        print(markdown_table(["decoding", *loads], [[n, *(cell(rates[ld][n], quiet_one)
                                                         for ld in loads)] for n in names]))
    if train:
        floor = train.get("quiet", {}).get("train.cpu_threads=1")
        print(f"\ntraining steps/s over {args.train_seconds:g} s of `aiayn train` (x) = against "
              f"quiet train.cpu_threads=1; load pinned to core {args.core}\n")
        settings = list(next(iter(train.values())))
        print(markdown_table(["training", *train],
                             [[s, *(cell(train[ld][s], floor) for ld in train)]
                              for s in settings]))


if __name__ == "__main__":
    main()
