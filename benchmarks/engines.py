"""What an export buys: the test split decoded by aiayn (float32, int8 weights) and by
CTranslate2 (float32, int8).

    python benchmarks/engines.py --run-dir RUN --repeats 3   # beam 4, alpha 0.6, 2 threads

RUN must export to CTranslate2, as the demo's does: a model whose encoder-decoder attention
normalises each head's query alone (``model.qk_norm_cross_query: heads``) does not (the
engine normalises that query over all of d_model); a restricted output layer exports as a
bias.

The run is exported twice with `aiayn.export.command.export_run` (CTranslate2 float32 and int8)
into a temporary directory. Each engine then translates the same sentences through the same
``Translator`` (tokenization, truncation, length-sorted batches of --decode-tokens x beam,
detokenization) and is scored by the same code as `aiayn evaluate`
(``aiayn.evaluation.evaluate.translate_and_score``): only the search differs. The engines take turns
within each repetition (the order alternating, ``common.interleave``), so a change in the
machine's load hits them alike; the table gives the median sentences/s and the speed-up
over aiayn within the same repetitions. Decoding is deterministic: the script checks that
every repetition gives the same translations, and says how many sentences each engine
translates exactly as aiayn does.

Length penalty: aiayn divides a hypothesis's log-probability by GNMT's
((5 + |Y|) / 6)^alpha, CTranslate2 by |Y|^alpha; both get the same alpha.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402  (benchmarks/ is not a package)
    add_json_option,
    add_repeats_option,
    add_run_options,
    add_search_options,
    add_threads_option,
    device_description,
    interleave,
    median,
    note_load,
    print_table,
    run_pairs,
    script_parser,
    set_threads,
)

from aiayn.evaluation.evaluate import translate_and_score  # noqa: E402
from aiayn.export.command import export_run  # noqa: E402
from aiayn.inference.translator import Translator  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = script_parser(__doc__)
    add_run_options(p)
    add_search_options(p)
    add_threads_option(p, 2, "torch and CTranslate2 threads")
    add_repeats_option(p, 2)
    add_json_option(p)
    p.add_argument("--no-int8", action="store_true",
                   help="leave out aiayn's int8 weights (aiayn.inference.int8)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    set_threads(args.threads)  # CTranslate2 gets the same (Translator.from_pretrained)
    pairs = run_pairs(args)
    note_load()
    with tempfile.TemporaryDirectory() as tmp:
        translators = {f"aiayn (PyTorch {torch.__version__})": Translator.from_pretrained(
            args.run_dir, args.weights, decode_tokens=args.decode_tokens)}
        if not args.no_int8:
            translators["aiayn int8"] = Translator.from_pretrained(
                args.run_dir, args.weights, decode_tokens=args.decode_tokens, int8=True)
        for quantization in ("float32", "int8"):
            out = Path(tmp) / quantization
            export_run(args.run_dir, "ctranslate2", out, args.weights, quantization)
            translators[f"CTranslate2 {quantization}"] = Translator.from_pretrained(
                out, engine="ctranslate2", decode_tokens=args.decode_tokens)
        outputs: dict[str, list] = {name: [] for name in translators}

        def contender(name: str):
            def run() -> None:
                translator = translators[name]
                search = translator.resolve(beam=args.beam, alpha=args.alpha)
                outputs[name].append(translate_and_score(translator, pairs, search))
            return run

        # An untimed pass over a few sentences each: thread pools, allocators, caches.
        for translator in translators.values():
            translator.translate([src for src, _ in pairs[:16]],
                                 translator.resolve(beam=args.beam, alpha=args.alpha))
        times = interleave({name: contender(name) for name in translators}, args.repeats,
                           warmup=0)
    report(args, pairs, translators, outputs, times)


def report(args, pairs, translators, outputs, times) -> None:
    names = list(translators)
    reference = outputs[names[0]][0][0]
    rows = []
    for name in names:
        runs = outputs[name]
        hyps, scores = runs[0]
        if any(h != hyps for h, _ in runs[1:]):
            raise SystemExit(f"{name}: repetitions gave different translations")
        seconds = [sum(rep) for rep in times[name]]
        speedups = [a / b for a, b in zip([sum(r) for r in times[names[0]]], seconds,
                                          strict=True)]
        same = sum(h == r for h, r in zip(hyps, reference, strict=True))
        rows.append([name, f"{len(pairs) / median(seconds):.1f}", f"{median(speedups):.2f}x",
                     f"{scores.bleu:.2f}", f"{scores.chrf:.2f}",
                     f"{same}/{len(pairs)}"])
    conditions = (f"{len(pairs)} {args.split} sentences of {args.run_dir} ({args.weights}), "
                  f"beam {args.beam}, alpha {args.alpha}, {args.threads} threads, decode_tokens "
                  f"{args.decode_tokens}; median of {args.repeats} interleaved repetitions\n"
                  f"device: {device_description()}\n"
                  f"BLEU signature: {outputs[names[0]][0][1].bleu_signature}")
    print_table(["engine", "sentences/s", "speed-up", "BLEU", "chrF",
                 "same translation as aiayn"], rows, conditions, args.json)


if __name__ == "__main__":
    main()
