"""Time to BLEU: train a preset for a wall-clock budget and record dev BLEU against minutes
and training tokens; draw the curves of several runs in one picture.

    # one run (the demo preset, 12 training minutes, validations on a fixed dev subset)
    python benchmarks/time_to_bleu.py run --config configs/demo.yaml \
        --data data/bible-eng-spa --out runs/ttb-demo --minutes 12
    # the curves of runs, overlaid (dev BLEU against training minutes and tokens)
    python benchmarks/time_to_bleu.py plot runs/ttb-old runs/ttb-demo -o docs/time_to_bleu.png
    # the same, keeping the curves (benchmarks/results/curves/NAME.json, plotted like a run)
    python benchmarks/time_to_bleu.py plot runs/ttb-demo --save benchmarks/results/curves

``run`` is `aiayn train` with the budget and a validation interval set, then a table of its
dev records (step, minutes, target tokens, dev BLEU/chrF). Minutes are the run's training minutes as
its budget counts them (validations included); the tokens are real target tokens, the same
unit as the throughput on the progress bar. Every point, the last one too, is BLEU on the
run's validation subset (train.eval_max_sentences; `aiayn evaluate RUN --split dev` scores
the whole dev split). Choose recipes with it
on dev; score the chosen one on test once (`aiayn evaluate RUN --split test`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from aiayn.config import load_config
from aiayn.inspect.plots import save_figure
from aiayn.runs.metrics import read_metrics
from aiayn.training.loop import train


def dev_curve(run_dir: str | Path) -> list[dict]:
    """The run's dev records as {step, minutes, tokens, bleu, chrf, n_sentences}; ``run_dir``
    may also be a JSON file that ``plot --save`` wrote (the curves outlive their runs)."""
    if str(run_dir).endswith(".json"):
        return json.loads(Path(run_dir).read_text(encoding="utf-8"))["curve"]
    return [{"step": r["step"], "minutes": r["elapsed_s"] / 60, "tokens": r.get("tokens", 0),
             "bleu": r["bleu"], "chrf": r["chrf"], "n_sentences": r["n_sentences"]}
            for r in read_metrics(run_dir) if r["kind"] == "dev"]


def run(args: argparse.Namespace) -> None:
    overrides = [f"train.max_minutes={args.minutes}", *args.set]
    if args.eval_every:
        overrides.append(f"train.eval_every={args.eval_every}")
    config = load_config(args.config, overrides)
    train(config, args.data, args.out, device=args.device)
    print(f"\n{'step':>6} {'minutes':>8} {'tokens':>10} {'BLEU':>6} {'chrF':>6}  sentences")
    for r in dev_curve(args.out):
        print(f"{r['step']:>6} {r['minutes']:>8.1f} {r['tokens']:>10,} {r['bleu']:>6.2f} "
              f"{r['chrf']:>6.2f}  {r['n_sentences']}")


def plot(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # (x key, scale, label) of each panel; --tokens-only drops the minutes, which say nothing
    # of runs timed on another machine or side by side
    panels = [("tokens", 1e6, "real target tokens trained (millions)")]
    if not args.tokens_only:
        panels.insert(0, ("minutes", 1, "training minutes (validations included)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(1.5 + 5 * len(panels), 4.2), sharey=True,
                             squeeze=False)
    axes = axes[0]
    for run_dir, label in zip(args.runs, args.labels or args.runs, strict=False):
        curve = dev_curve(run_dir)
        if not curve:
            sys.exit(f"{run_dir}: no dev records in metrics.jsonl")
        for ax, (key, scale, _) in zip(axes, panels, strict=True):
            ax.plot([r[key] / scale for r in curve], [r["bleu"] for r in curve], "o-",
                    label=label)
    for ax, (_, _, xlabel) in zip(axes, panels, strict=True):
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("dev BLEU (sacreBLEU)")
    axes[0].legend(fontsize=8)
    fig.suptitle(args.title)
    fig.tight_layout()
    print(f"wrote {save_figure(fig, args.output)}")
    summary = {str(r): dev_curve(r) for r in args.runs}
    print(json.dumps(summary, indent=1))
    for run_dir, label in zip(args.runs, args.labels or args.runs, strict=False):
        if args.save and not str(run_dir).endswith(".json"):
            out = Path(args.save) / f"{Path(run_dir).name}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"label": label, "curve": summary[str(run_dir)]},
                                      indent=1) + "\n", encoding="utf-8")
            print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train a preset for a budget; print its dev curve")
    r.add_argument("--config", required=True)
    r.add_argument("--data", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--minutes", type=float, required=True, help="training minutes")
    r.add_argument("--eval-every", type=int, default=0, help="steps between validations")
    r.add_argument("--device", default="auto")
    r.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p = sub.add_parser("plot", help="overlay the dev curves of runs")
    p.add_argument("runs", nargs="+")
    p.add_argument("--labels", nargs="+")
    p.add_argument("--title", default="dev BLEU against training time and tokens")
    p.add_argument("-o", "--output", default="time_to_bleu.png")
    p.add_argument("--tokens-only", action="store_true",
                   help="draw BLEU against tokens alone (for runs timed on other machines)")
    p.add_argument("--save", metavar="DIR",
                   help="also write each run's curve to DIR/RUN.json (plot takes such files too)")
    args = parser.parse_args()
    run(args) if args.command == "run" else plot(args)


if __name__ == "__main__":
    main()
