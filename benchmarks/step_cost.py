"""What a change to a recipe costs per training step, as a ratio to the recipe, in one process.

A recipe A/B on a CPU is fairest at equal minutes, but minutes are what a shared machine
measures worst: the same run made 15% more steps in one round than in another. This script
measures only the price of a change (a wider model, another layer, QK-norm): the training
step of the config and of each variant, interleaved batch by batch on the same
length-bucketed token-budget batches (``benchmarks/common.py``), so background load hits
them alike. The ratios then turn a comparison at equal minutes into one at equal steps that
does not depend on the machine's speed: a variant that costs 1.25x per step gets
``max_steps / 1.25`` steps (docs/findings.md#the-price-of-a-step).

    python benchmarks/step_cost.py --config configs/demo.yaml --threads 1 \\
        --variant qk=model.qk_norm=true --variant 3+3=model.n_encoder_layers=3,model.n_decoder_layers=3

Each variant is a name and comma-separated ``--set`` overrides of the config. ``--torch-loss``
adds each config whose ``model.output_vocab`` is ``all`` trained with ``F.cross_entropy`` in
place of aiayn's loss (``aiayn.loss.SmoothedCrossEntropy``), to price the loss itself; each
config trains with its own ``train.label_smoothing``. A variant that changes
``train.max_tokens`` trains on batches of its own budget, cut from the same sentence lengths;
a further column then compares the time of a target token, which is what equal compute
means when a step holds other batches. ``--onednn-output`` adds each config with its output
layer's forward product in oneDNN (``aiayn.inference.kernels``), which ``aiayn train`` takes where a
probe finds it faster; the configs themselves run it as ``F.linear`` does. ``--bf16`` times
every step under bfloat16 autocast, as ``train.bf16: auto`` trains on a CPU with AMX or
AVX512-BF16 (on AVX2 alone bf16 is far slower: do not use it there). A config whose dropout
or label smoothing is ``auto`` (the demo's) is priced with the values ``aiayn train`` chooses
for ``--passes`` passes over the data (none given: 0, what a timed run starts with).
``--mfu`` times a large square matmul in the same repetitions and gives each step's matmul
FLOP/s (``speed.training_flops``) as a share of it.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    add_json_option,
    add_repeats_option,
    add_threads_option,
    bucket,
    device_description,
    interleave,
    make_batch,
    median,
    note_load,
    paired_ratios,
    print_table,
    representative,
    script_parser,
    sentence_lengths,
    set_threads,
    spread,
)
from speed import aiayn_loss, matmul_peak, torch_loss, training_flops, training_steps  # noqa: E402

from aiayn.config import load_config  # noqa: E402
from aiayn.errors import AiaynError  # noqa: E402
from aiayn.inference.kernels import onednn_available, onednn_linear  # noqa: E402
from aiayn.model import Transformer  # noqa: E402
from aiayn.training.optim import build_optimizer, set_learning_rate  # noqa: E402
from aiayn.training.plan import choose_regularisation, has_auto_regularisation  # noqa: E402


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, sep, sets = text.partition("=")
    if not sep or not sets:
        raise SystemExit(f"--variant {text!r}: expected NAME=key=value[,key=value...]")
    return name, sets.split(",")


def optimizer_of(model: torch.nn.Module, cfg, bf16: bool) -> torch.optim.Optimizer:
    """The config's optimizer (train.optimizer), as aiayn train builds it, at a small rate."""
    precision = "bf16" if bf16 else "fp32"
    optimizer = build_optimizer(model, replace(cfg, train=replace(cfg.train, precision=precision)))
    set_learning_rate(optimizer, 1e-4)
    return optimizer


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--variant", action="append", default=[], type=parse_variant,
                        help="NAME=key=value[,key=value...] (repeatable)")
    add_threads_option(parser, 1)
    add_repeats_option(parser, 5, "--reps")
    parser.add_argument("--batches", type=int, default=8, help="representative batches per rep")
    parser.add_argument("--output-pieces", type=int, default=5303,
                        help="pieces a model.output_vocab=targets variant scores (default: as "
                             "many as the Bible's training targets hold of the joint 8,000)")
    parser.add_argument("--onednn-output", action="store_true",
                        help="also time each config with the output layer's forward in oneDNN")
    parser.add_argument("--bf16", action="store_true",
                        help="every step under bfloat16 autocast (the path of AMX CPUs)")
    parser.add_argument("--torch-loss", action="store_true",
                        help="also time each config whose output_vocab is all with "
                             "F.cross_entropy in place of aiayn's loss")
    parser.add_argument("--passes", type=float, default=None,
                        help="the passes over the training data that \"auto\" dropout and label "
                             "smoothing are chosen for, as aiayn train chooses them (default: "
                             "none yet, as a timed run starts: 0)")
    parser.add_argument("--mfu", action="store_true",
                        help="also time a large square matmul of the step's precision in the "
                             "same repetitions and give each step's matmul FLOP/s as a share "
                             "of it (model FLOP utilisation)")
    add_json_option(parser)
    args = parser.parse_args(argv)
    set_threads(args.threads)
    note_load()

    try:
        configs = {"recipe": load_config(args.config)}
        configs.update({name: load_config(args.config, sets) for name, sets in args.variant})
    except AiaynError as exc:  # a bad --config or --variant setting: one line
        parser.error(str(exc))
    # A recipe's "auto" regularisation is a number only once a run knows its passes: price
    # the step a run of --passes trains (the demo's on a CPU without fast bf16: none).
    if has_auto_regularisation(configs["recipe"]):
        print(f"recipe: {choose_regularisation(configs['recipe'], args.passes)[1]}")
    configs = {name: choose_regularisation(cfg, args.passes)[0] for name, cfg in configs.items()}
    ref = configs["recipe"]
    lengths = sentence_lengths(20_000, mean=31.0, max_len=ref.model.max_len)
    # Random ids valid in every variant's vocabularies (a variant may have smaller ones).
    vocab = min(min(c.model.src_vocab_size, c.model.tgt_vocab_size) for c in configs.values())
    batches = {}  # train.max_tokens -> the batches of that budget (a variant may change it)
    for max_tokens in sorted({c.train.max_tokens for c in configs.values()}):
        groups = representative(bucket(lengths, max_tokens), args.batches)
        batches[max_tokens] = [make_batch(g, vocab, seed=i) for i, g in enumerate(groups)]
    if args.onednn_output:
        if args.bf16:  # aiayn.inference.kernels takes F.linear under autocast: nothing to compare
            parser.error("--onednn-output: the oneDNN output layer is fp32 only; drop --bf16")
        if not onednn_available():
            parser.error("--onednn-output: this PyTorch has no oneDNN linear")
        configs.update({f"{name}, oneDNN output": cfg for name, cfg in list(configs.items())})
    steps = {}
    for name, cfg in configs.items():
        torch.manual_seed(0)
        model = Transformer(cfg.model)
        if model.generator.restricted:  # which pieces does not change the time, how many does
            model.generator.set_outputs(torch.arange(args.output_pieces))
        kernel = onednn_linear if name.endswith(", oneDNN output") else F.linear
        # each config's own label smoothing: with none, F.cross_entropy takes a cheaper path
        loss = partial(aiayn_loss, smoothing=cfg.train.label_smoothing, kernel=kernel)
        steps[name] = training_steps(model, batches[cfg.train.max_tokens], bf16=args.bf16,
                                     loss_fn=loss, optimizer=optimizer_of(model, cfg, args.bf16))
    if args.torch_loss:  # F.cross_entropy reads logits over the whole vocabulary
        for name, cfg in list(configs.items()):
            if cfg.model.output_vocab == "all":
                configs[f"{name}, F.cross_entropy"] = cfg
                torch.manual_seed(0)
                loss = partial(torch_loss, smoothing=cfg.train.label_smoothing)
                steps[f"{name}, F.cross_entropy"] = training_steps(
                    Transformer(cfg.model), batches[cfg.train.max_tokens], bf16=args.bf16,
                    loss_fn=loss)
    if args.mfu:  # one peak matmul per batch, so it alternates with the steps batch by batch
        peak, peak_flops = matmul_peak(torch.bfloat16 if args.bf16 else torch.float32)
        steps["matmul peak"] = [peak] * args.batches
    times = interleave(steps, args.reps)
    peak_times = times.pop("matmul peak", None)
    steps.pop("matmul peak", None)

    def tokens(name: str) -> int:
        return sum(b.n_tokens for b in batches[configs[name].train.max_tokens])

    def mfu(name: str) -> float:
        """The step's matmul FLOP/s (speed.training_flops, over the pieces its output layer
        scores) over the peak matmul's, medians of the repetitions."""
        model_cfg = configs[name].model
        if model_cfg.output_vocab == "targets":
            model_cfg = replace(model_cfg, tgt_vocab_size=args.output_pieces)
        flops = sum(training_flops(model_cfg, *b.src.shape, b.tgt_in.size(1))
                    for b in batches[configs[name].train.max_tokens])
        step_s = median([sum(rep) for rep in times[name]])
        peak_s = median([sum(rep) for rep in peak_times]) / args.batches
        return (flops / step_s) / (peak_flops / peak_s)

    other_batches = len(batches) > 1
    rows = []
    for name in steps:
        per_rep = [sum(rep) for rep in times[name]]
        ratios = paired_ratios(times[name], times["recipe"])
        params = sum(p.numel() for p in Transformer(configs[name].model).parameters())
        row = [name, f"{params / 1e6:.2f}M", f"{tokens(name) / median(per_rep):,.0f}",
               f"{median(ratios):.3f} ({spread(ratios)})"]
        if other_batches:  # a step of other batches: compare the time of a target token
            per_token = [r * tokens("recipe") / tokens(name) for r in ratios]
            row.append(f"{median(per_token):.3f} ({spread(per_token)})")
        if args.mfu:
            row.append(f"{100 * mfu(name):.0f}%")
        rows.append(row)
    header = ["variant", "parameters", "target tokens/s", "step time / recipe's"]
    header += ["time a target token / recipe's"] * other_batches
    if args.mfu:
        peak_s = median([sum(rep) for rep in peak_times]) / args.batches
        header.append(f"MFU (peak {peak_flops / peak_s / 1e9:,.0f} GFLOP/s)")
    print_table(header, rows,
                f"{device_description()}; {args.threads} thread(s); {args.config}; "
                f"{'bf16 autocast' if args.bf16 else 'fp32'}; {args.batches} batches of <= "
                f"{', '.join(map(str, batches))} tokens x {args.reps} reps", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
