"""Decoding speed: batched search on the KV cache against the tutorials' way.

The tutorials decode one sentence at a time and re-run the decoder over the whole prefix
at every step. `aiayn` decodes length-sorted batches, feeds only the newest token and
keeps the keys/values of the earlier ones in a cache. This script times both (and the
cache alone, at batch size 1) on the same model and the same sentences, in one process:
the methods take turns within every repetition (so a busy machine slows all of them
alike) and the table reports medians.

    python benchmarks/decode.py                        # random model of configs/small.yaml
    python benchmarks/decode.py --run-dir runs/demo    # a trained run, its test sentences

A random model hardly ever emits EOS, so every output runs to the length limit (source
length + 50): the longest outputs, the slowest case for recomputing prefixes. All methods
produce the same tokens; the script checks that and says so under the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402  (benchmarks/ is not a package)
    add_json_option,
    add_repeats_option,
    add_run_options,
    add_search_options,
    add_threads_option,
    cpu_model,
    note_load,
    print_table,
    script_parser,
    set_threads,
)

from aiayn.config import load_config
from aiayn.data.batching import pad
from aiayn.data.prepared import load_prepared
from aiayn.data.tokenizer import EOS_ID
from aiayn.inference.search import beam_search, greedy_decode
from aiayn.inference.translator import Translator
from aiayn.model import Transformer
from aiayn.runs.directory import load_run, read_data_dir


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = script_parser(__doc__)
    p.add_argument("--config", default="configs/small.yaml",
                   help="model sizes for the random model (default: configs/small.yaml)")
    add_run_options(p, required=False, split=False)
    p.add_argument("--sentences", type=int, default=100)
    p.add_argument("--min-len", type=int, default=10, help="random source length range")
    p.add_argument("--max-len", type=int, default=40)
    add_search_options(p, alpha=False)
    add_repeats_option(p, 3)
    add_threads_option(p)
    p.add_argument("--seed", type=int, default=0)
    add_json_option(p)
    return p.parse_args(argv)


def random_setup(args) -> tuple[Transformer, list[list[int]], str]:
    config = load_config(args.config)
    torch.manual_seed(args.seed)
    model = Transformer(config.model).eval()
    g = torch.Generator().manual_seed(args.seed)
    vocab = config.model.src_vocab_size
    sources = []
    for _ in range(args.sentences):
        n = int(torch.randint(args.min_len, args.max_len + 1, (1,), generator=g))
        sources.append(torch.randint(4, vocab, (n,), generator=g).tolist() + [EOS_ID])
    return model, sources, f"random weights, sizes of {args.config}"


def trained_setup(args) -> tuple[Transformer, list[list[int]], str]:
    _, model, tokenizers = load_run(args.run_dir, args.weights)
    data_dir = read_data_dir(args.run_dir)
    sentences = [src for src, _ in load_prepared(data_dir).test[: args.sentences]]
    translator = Translator(model, tokenizers)
    sources, _ = translator.encode(sentences)
    return model, sources, f"trained run {args.run_dir} ({args.weights}), its test split"


def methods(model: Transformer, sources: list[list[int]], beam: int, decode_tokens: int
            ) -> dict[str, Callable[[], list[list[int]]]]:
    """Name -> a function decoding every source and returning the best token ids."""
    singles = [pad([ids]) for ids in sources]
    translator = Translator(model, tokenizers=None, decode_tokens=decode_tokens)

    def one_by_one(search):
        return lambda: [search(src)[0] for src in singles]

    def batched(b):
        return lambda: [hyps[0][0] for hyps in translator.decode_ids(sources, translator.resolve(beam=b))]

    def best_of_beam(use_cache):
        return lambda src: [beam_search(model, src, beam, use_cache=use_cache)[0][0][0]]

    return {
        "greedy, batch 1, recompute prefix (tutorials)":
            one_by_one(lambda src: greedy_decode(model, src, use_cache=False)),
        "greedy, batch 1, KV cache": one_by_one(lambda src: greedy_decode(model, src)),
        "greedy, batched, KV cache": batched(1),
        f"beam {beam}, batch 1, recompute prefix": one_by_one(best_of_beam(False)),
        f"beam {beam}, batch 1, KV cache": one_by_one(best_of_beam(True)),
        f"beam {beam}, batched, KV cache": batched(beam),
    }


def run(args) -> None:
    set_threads(args.threads)
    note_load()
    model, sources, what = trained_setup(args) if args.run_dir else random_setup(args)
    table = methods(model, sources, args.beam, args.decode_tokens)
    times: dict[str, list[float]] = {name: [] for name in table}
    outputs: dict[str, list[list[int]]] = {}
    names = list(table)
    for rep in range(args.repeats):
        # Rotate the order each repetition so no method always runs first or last.
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            start = time.perf_counter()
            outputs[name] = table[name]()
            times[name].append(time.perf_counter() - start)
            print(f"  rep {rep + 1}: {name}: {times[name][-1]:.2f} s", file=sys.stderr)
    tokens = {name: sum(len(ids) + 1 for ids in out) for name, out in outputs.items()}
    report(times, tokens, len(sources), names, what, args)
    print(compare_outputs(outputs, names) + ".")


def compare_outputs(outputs: dict[str, list[list[int]]], names: list[str]) -> str:
    """Cache and batching should not change the tokens (greedy and beam separately); a
    difference can only come from float rounding deciding a near-tie, and is reported."""
    half = len(names) // 2
    notes = []
    for group in (names[:half], names[half:]):
        reference = outputs[group[0]]
        for name in group[1:]:
            differ = sum(a != b for a, b in zip(outputs[name], reference))
            if differ:
                notes.append(f"{differ} sentence(s) of '{name}' differ from '{group[0]}'")
    return "; ".join(notes) or "every method produced the same tokens as its baseline"


def report(times, tokens, n_sentences, names, what, args) -> None:
    half = len(names) // 2
    rows = []
    for i, name in enumerate(names):
        baseline = statistics.median(times[names[0 if i < half else half]])
        t = statistics.median(times[name])
        rows.append([name, f"{t:.2f}", f"{n_sentences / t:.1f}", f"{tokens[name] / t:.0f}",
                     f"{baseline / t:.1f}x"])
    print_table(["decoding", "median time (s)", "sentences/s", "tokens/s", "speed-up"], rows,
                f"{n_sentences} sentences, {what}; {cpu_model()}, {torch.get_num_threads()} "
                f"torch threads, torch {torch.__version__}; median of {args.repeats} "
                "interleaved repetitions.", args.json)
    print()
    print("Speed-up: against the same search at batch 1 recomputing the prefix. "
          "Tokens: generated tokens, EOS included.")


if __name__ == "__main__":
    run(parse_args())
