"""What `aiayn serve` costs its own process a request, beside the decoding: the server's CPU
time per request of three kinds, each against a plain GET /health in the same run.

The server, its lanes and its clients share a machine's cores, so the server's own CPU time
per request is what it takes from the lanes' rate (docs/serving.md#batching). This script
starts `aiayn serve RUN` (lanes in processes of their own on a CPU of two cores or more:
their time is left out), then from ``--clients`` threads (each over a connection it keeps
open: ``--connections new`` opens one a request) sends ``--requests`` requests of
each kind, the kinds interleaved in every repetition: GET /health (HTTP alone: uvicorn and
FastAPI's routing), POST /translate of one short sentence (the translate path with next to no
decoding: validation, tokenizing, handing the sentence to a lane and back, the answer), and
POST /translate of the test verses, one a request. It reports the server process's CPU
milliseconds a request (user and system, from /proc: Linux), the ratio to /health's, and the
requests a second (medians of ``--repeats``).

    python benchmarks/server_cost.py runs/demo --int8 --requests 400 --repeats 3
"""

from __future__ import annotations

import argparse
import sys
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_description, interleave, print_table  # noqa: E402
from serve_load import ask, cpu_seconds, kept, server_options, start_server  # noqa: E402

from aiayn.data.prepared import load_prepared  # noqa: E402
from aiayn.runs.directory import read_data_dir  # noqa: E402

SHORT = "Amen."  # a sentence of a few pieces: the translate path with next to no decoding


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--weights", default="best")
    p.add_argument("--int8", action="store_true", help="the server decoding in int8")
    p.add_argument("--requests", type=int, default=400, help="requests of each kind a repetition")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (threads)")
    p.add_argument("--connections", choices=["kept", "new"], default="kept",
                   help="each client's: kept open from a request to its next, or a new one each")
    p.add_argument("--repeats", type=int, default=3, help="repetitions; medians are reported")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.6)
    p.add_argument("--json", metavar="PATH",
                   help="also write the table as JSON (headers, rows, conditions) to PATH")
    args = p.parse_args(argv)
    if not 1 <= args.requests <= 10_000 or not 1 <= args.clients <= 64 or not 1 <= args.repeats <= 10:
        raise SystemExit("--requests must be in 1..10000, --clients in 1..64, --repeats in 1..10")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    verses = [src for src, _ in load_prepared(read_data_dir(args.run_dir)).split("test")]
    keep_alive = args.connections == "kept"
    process, url = start_server(server_options(args.run_dir, args.weights, args.int8))
    cpu: dict[str, list[float]] = {}  # ms of the server's process a request, each repetition

    def kind(name: str, send: Callable[[int], object]) -> Callable[[], None]:
        def run() -> None:
            before = cpu_seconds([process.pid])
            with ThreadPoolExecutor(args.clients) as pool:
                list(pool.map(send, range(args.requests)))
            cpu.setdefault(name, []).append(1e3 * (cpu_seconds([process.pid]) - before)
                                            / args.requests)
        return run

    def health(_: int) -> None:
        if keep_alive:
            kept(url).json("GET", "/health")
            return
        with urllib.request.urlopen(f"{url}/health", timeout=60) as response:
            response.read()

    kinds = {"GET /health": kind("GET /health", health),
             f"POST /translate {SHORT!r}": kind(f"POST /translate {SHORT!r}",
                                                lambda _: ask(url, SHORT, args.beam, args.alpha,
                                                               keep_alive)),
             "POST /translate, a test verse": kind("POST /translate, a test verse", lambda i: ask(
                 url, verses[i % len(verses)], args.beam, args.alpha, keep_alive))}
    try:
        times = interleave(kinds, args.repeats, warmup=1)
    finally:
        process.terminate()
        process.wait(timeout=60)
    base = median(cpu["GET /health"][1:])  # the warm-up's run left out
    rows = []
    for name in kinds:
        ms = median(cpu[name][1:])
        rate = args.requests / median(rep[0] for rep in times[name])
        ratio = f"{ms / base:.2f}x" if base > 0 else "n/a (/health took under a clock tick)"
        rows.append([name, f"{ms:.2f}", ratio, f"{rate:.1f}"])
    conditions = (f"aiayn serve {args.run_dir} ({args.weights}{', --int8' if args.int8 else ''}), "
                  f"{args.clients} concurrent clients ({args.connections} connections), {args.requests} "
                  f"requests of each kind, beam "
                  f"{args.beam}, alpha {args.alpha}; median of {args.repeats} interleaved "
                  f"repetitions; the server's own process only (its lanes left out)\n"
                  f"device: {device_description()}")
    print_table(["request", "server CPU ms a request", "/ GET /health", "requests/s"], rows,
                conditions, args.json)


if __name__ == "__main__":
    main()
