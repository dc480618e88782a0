"""Background load for timing runs: keep one core about half busy, as another program would.

    taskset -c 1 python3 benchmarks/busy.py &      # core 1: 50 ms spinning, 50 ms asleep
    make demo
    kill %1

The busy rows of docs/results.md run it as ``taskset -c 1 python benchmarks/busy.py
--on-ms 100 --off-ms 0``. It loops until killed (or for --seconds); pin it to a core with
taskset. ``--on-ms 100 --off-ms 0`` keeps the core 100% busy; ``--torch`` runs another
PyTorch job instead (benchmarks/threads.py uses all of these).
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--on-ms", type=float, default=50.0, help="spin this long")
    parser.add_argument("--off-ms", type=float, default=50.0, help="then sleep this long")
    parser.add_argument("--seconds", type=float, default=0.0, help="stop after (0: never)")
    parser.add_argument("--torch", action="store_true",
                        help="instead, small PyTorch ops on 2 OpenMP threads without a pause "
                             "(another program's training or decoding: its threads sleep and "
                             "wake at every op's barrier)")
    args = parser.parse_args()
    start = time.monotonic()
    if args.torch:
        import torch

        torch.set_num_threads(2)
        a = torch.randn(64, 256)
        w = torch.randn(256, 256)
        while not args.seconds or time.monotonic() - start < args.seconds:
            for _ in range(100):
                a = torch.tanh(a @ w)
        return
    while not args.seconds or time.monotonic() - start < args.seconds:
        until = time.perf_counter() + args.on_ms / 1e3
        while time.perf_counter() < until:
            pass
        time.sleep(args.off_ms / 1e3)


if __name__ == "__main__":
    main()
