"""bf16 training on a CPU: batches at their exact lengths against lengths padded to a multiple.

A bf16 matmul on a CPU runs through oneDNN, which compiles a kernel for each new shape.
Length-bucketed batches come in hundreds of shapes; ``aiayn.data.batching.length_multiple`` pads
bf16 batches so that there are only a few dozen. This benchmark trains the demo preset
(``configs/demo.yaml``) on the first ``--steps`` batches of a prepared corpus's first epoch
(the batches and order ``aiayn train`` uses), once with exact lengths (``multiple`` 1) and
once padded to the multiple, each in a fresh process as a run starts (an empty kernel
cache), alternating the two arms over ``--reps`` repetitions. It reports real target tokens
per second (median) and the ratio padded / exact, which is what it claims.

    python benchmarks/bf16_shapes.py --data data/bible-eng-spa --steps 200 --reps 2 --multiple 8 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from common import add_repeats_option, add_threads_option, device_description, script_parser

REPO = Path(__file__).resolve().parents[1]


def one_arm(data_dir: str, multiple: int, steps: int, threads: int, precision: str) -> dict:
    """Train ``steps`` steps in this process and return its throughput."""
    import torch

    from aiayn.config import load_config
    from aiayn.data.batching import collate
    from aiayn.runs.directory import build_model
    from aiayn.training.distributed import Dist
    from aiayn.training.loop import train_step
    from aiayn.training.optim import build_optimizer
    from aiayn.training.plan import choose_regularisation
    from aiayn.training.stream import load_data, resolve_config

    torch.set_num_threads(threads)
    config = load_config(REPO / "configs" / "demo.yaml")
    data = load_data(Path(data_dir), config, Dist(), log=lambda *_: None)
    config = resolve_config(config, data.tokenizers, Path(data_dir))
    # The preset's "auto" dropout and label smoothing as a run starts (no speed measured
    # yet: none); both arms alike, so the ratio is the shapes' alone.
    config = choose_regularisation(config, None)[0]
    config = replace(config, train=replace(config.train, precision=precision))
    torch.manual_seed(0)
    model = build_model(config, torch.device("cpu"))
    optimizer = build_optimizer(model, config)
    batches = [collate([data.train[i] for i in positions], config.model.pad_id, multiple)
               for positions, _ in zip(iter(data.sampler), range(steps), strict=False)]
    tokens = sum(b.n_tokens for b in batches)
    start = time.perf_counter()
    for step, batch in enumerate(batches, 1):
        train_step(model, None, optimizer, [batch], step, config, Dist())
    seconds = time.perf_counter() - start
    return {"multiple": multiple, "steps": len(batches), "tokens": tokens, "seconds": seconds,
            "shapes": len({(b.src.shape, b.tgt_in.shape) for b in batches}),
            "tok_s": tokens / seconds}


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--data", required=True, help="a prepared data directory")
    parser.add_argument("--steps", type=int, default=200)
    add_repeats_option(parser, 3, "--reps")
    add_threads_option(parser, 2)
    parser.add_argument("--multiple", type=int, nargs="+", default=[8, 16],
                        help="the padded arms' multiples (each against exact lengths)")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                        help="train.precision of both arms (default: bf16)")
    parser.add_argument("--arm", type=int, help=argparse.SUPPRESS)  # internal: one arm
    args = parser.parse_args()
    if args.arm is not None:
        print(json.dumps(one_arm(args.data, args.arm, args.steps, args.threads, args.precision)))
        return
    print(device_description())
    arms = [1, *args.multiple]
    results: dict[int, list[dict]] = {m: [] for m in arms}
    for rep in range(args.reps):
        for multiple in arms if rep % 2 == 0 else arms[::-1]:
            out = subprocess.run(
                [sys.executable, __file__, "--data", args.data, "--steps", str(args.steps),
                 "--threads", str(args.threads), "--precision", args.precision,
                 "--arm", str(multiple)], capture_output=True, text=True)
            if out.returncode:  # the arm's own error, not only that it failed
                raise SystemExit(f"the arm padded to {multiple} failed:\n{out.stderr[-3000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            results[multiple].append(result)
            print(f"rep {rep} multiple {multiple:>2}: {result['tok_s']:,.0f} target tok/s "
                  f"({result['steps']} steps, {result['shapes']} batch shapes)", flush=True)
    exact = statistics.median(r["tok_s"] for r in results[1])
    print(f"median, {args.precision}, {args.threads} threads: exact lengths {exact:,.0f} tok/s")
    for multiple in args.multiple:
        padded = statistics.median(r["tok_s"] for r in results[multiple])
        print(f"  padded to {multiple}: {padded:,.0f} tok/s, {padded / exact:.2f}x")


if __name__ == "__main__":
    main()
