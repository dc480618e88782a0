"""A bounded load test of `aiayn serve`: N requests from K concurrent clients, on localhost.

    .venv/bin/python benchmarks/serve_load.py RUN_DIR                 # 200 requests, 8 clients
    .venv/bin/python benchmarks/serve_load.py RUN_DIR --requests 40 --clients 4 --beam 1

Starts `aiayn serve RUN_DIR` on a free port of 127.0.0.1 (nothing else is ever contacted),
sends each of N sentences of the run's test split as its own POST /translate, K at a time,
and checks every answer against the same sentence translated in this process by the
``Translator`` with the same settings: none lost, none wrong. The reference, timed in the
same run: the same sentences translated one by one in this process (no HTTP, no queue),
so the table shows what the server adds. The server runs one request at a time (its lock),
so with K clients a request mostly waits: its latency is about K service times.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model  # noqa: E402

from aiayn.rundir import read_data_dir  # noqa: E402
from aiayn.translator import Translator  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 300) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def start_server(run_dir: str, weights: str, threads: int) -> tuple[subprocess.Popen, str]:
    """`aiayn serve` on 127.0.0.1 and a free port; returns once GET /health answers."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    process = subprocess.Popen([sys.executable, "-m", "aiayn", "serve", run_dir, "--port",
                                str(port), "--weights", weights, "--device", "cpu"], env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return process, url
        except (urllib.error.URLError, ConnectionError):
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise SystemExit("aiayn serve did not start") from None
            time.sleep(0.2)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, linear between the two nearest ranks (as numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def load(url: str, sentences: list[str], clients: int, beam: int, alpha: float
         ) -> tuple[list[str | None], list[float], float]:
    """Each sentence as its own request, ``clients`` at a time: answers, latencies, wall time."""

    def one(sentence: str) -> tuple[str | None, float]:
        start = time.perf_counter()
        try:
            answer = post(f"{url}/translate", {"text": [sentence], "beam": beam, "alpha": alpha})
            text = answer["translations"][0]
        except (urllib.error.URLError, ConnectionError, KeyError, TimeoutError):
            text = None  # lost: counted below
        return text, time.perf_counter() - start

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one, sentences))
    wall = time.perf_counter() - start
    return [text for text, _ in results], [seconds for _, seconds in results], wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=0.6)
    parser.add_argument("--weights", default="best")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads of the server and of the reference")
    args = parser.parse_args()
    if not 1 <= args.requests <= 10_000 or not 1 <= args.clients <= 64:
        raise SystemExit("--requests must be in 1..10000 and --clients in 1..64 (a bounded test)")

    test = read_data_dir(args.run_dir) / "test.jsonl"
    pairs = [json.loads(line) for line in test.read_text(encoding="utf-8").splitlines() if line]
    sentences = [pairs[i % len(pairs)]["src"] for i in range(args.requests)]

    torch.set_num_threads(args.threads)
    translator = Translator.from_pretrained(args.run_dir, args.weights, device="cpu")
    expected = translator.translate(sentences, args.beam, args.alpha)

    process, url = start_server(args.run_dir, args.weights, args.threads)
    try:
        post(f"{url}/translate", {"text": sentences[:2], "beam": args.beam})  # warm up
        one_by_one = []
        for sentence in sentences:  # the reference: no HTTP, no queue
            start = time.perf_counter()
            translator.translate([sentence], args.beam, args.alpha)
            one_by_one.append(time.perf_counter() - start)
        answers, latencies, wall = load(url, sentences, args.clients, args.beam, args.alpha)
    finally:
        process.terminate()
        process.wait(timeout=30)

    lost = sum(a is None for a in answers)
    wrong = sum(a is not None and a != e for a, e in zip(answers, expected))
    service = sum(one_by_one) / len(one_by_one)
    print(f"aiayn serve load test: {args.run_dir} ({args.weights}), beam {args.beam}, "
          f"alpha {args.alpha}, {args.threads} torch thread(s); CPU: {cpu_model()}")
    print(f"{args.requests} requests (one test-split sentence each) from {args.clients} "
          f"concurrent clients on 127.0.0.1: {args.requests - lost - wrong} answered correctly, "
          f"{wrong} wrong, {lost} lost")
    print("| | p50 ms | p95 ms | max ms | requests/s |")
    print("|---|--:|--:|--:|--:|")
    print(f"| server, {args.clients} clients | {1000 * percentile(latencies, 50):.0f} | "
          f"{1000 * percentile(latencies, 95):.0f} | {1000 * max(latencies):.0f} | "
          f"{args.requests / wall:.1f} |")
    print(f"| reference: Translator in-process, one by one | "
          f"{1000 * percentile(one_by_one, 50):.0f} | {1000 * percentile(one_by_one, 95):.0f} | "
          f"{1000 * max(one_by_one):.0f} | {1 / service:.1f} |")
    print(f"throughput ratio server / reference: {(args.requests / wall) * service:.2f}; "
          f"p50 latency ratio: {percentile(latencies, 50) / percentile(one_by_one, 50):.1f}")
    if lost or wrong:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
