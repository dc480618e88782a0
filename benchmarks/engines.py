"""What an export buys: the test split decoded by aiayn and by CTranslate2 (float32, int8).

    python benchmarks/engines.py --run-dir RUN --repeats 3   # beam 4, alpha 0.6, 2 threads

RUN must export to CTranslate2: a model with QK-norm in encoder-decoder attention (the
demo's) does not (the engine normalises those queries over all of d_model, not per head),
so train it with ``--set model.qk_norm_cross=false`` (QK-norm in self-attention only); a
restricted output layer exports as a bias.

The run is exported twice with `aiayn.export.command.export_run` (CTranslate2 float32 and int8)
into a temporary directory. Each engine then translates the same sentences through the same
``Translator`` (tokenization, truncation, length-sorted batches of --max-tokens x beam,
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

from common import device_description, interleave, markdown_table, median  # noqa: E402

from aiayn.data.prepared import load_prepared  # noqa: E402
from aiayn.evaluation.evaluate import translate_and_score  # noqa: E402
from aiayn.export.command import export_run  # noqa: E402
from aiayn.inference.translator import Translator  # noqa: E402
from aiayn.runs.directory import read_data_dir  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True, help="a trained run (read only)")
    p.add_argument("--weights", default="best")
    p.add_argument("--split", default="test", choices=["test", "dev"])
    p.add_argument("--limit", type=int, default=0, help="only the first N sentences (0: all)")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.6)
    p.add_argument("--threads", type=int, default=2, help="torch and CTranslate2 threads")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=8192, help="batch budget (x beam)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)  # CTranslate2 gets the same (Translator.from_pretrained)
    pairs = load_prepared(read_data_dir(args.run_dir)).split(args.split)
    if args.limit > 0:
        pairs = pairs[: args.limit]
    with tempfile.TemporaryDirectory() as tmp:
        translators = {f"aiayn (PyTorch {torch.__version__})": Translator.from_pretrained(
            args.run_dir, args.weights, max_tokens=args.max_tokens)}
        for quantization in ("float32", "int8"):
            out = Path(tmp) / quantization
            export_run(args.run_dir, "ctranslate2", out, args.weights, quantization)
            translators[f"CTranslate2 {quantization}"] = Translator.from_pretrained(
                out, engine="ctranslate2", max_tokens=args.max_tokens)
        outputs: dict[str, list] = {name: [] for name in translators}

        def contender(name: str):
            def run() -> None:
                outputs[name].append(translate_and_score(translators[name], pairs, args.beam,
                                                         args.alpha))
            return run

        # An untimed pass over a few sentences each: thread pools, allocators, caches.
        for translator in translators.values():
            translator.translate([src for src, _ in pairs[:16]], args.beam, args.alpha)
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
    print(f"{len(pairs)} {args.split} sentences of {args.run_dir} ({args.weights}), beam "
          f"{args.beam}, alpha {args.alpha}, {args.threads} threads, max_tokens "
          f"{args.max_tokens}; median of {args.repeats} interleaved repetitions")
    print(f"device: {device_description()}")
    print(f"BLEU signature: {outputs[names[0]][0][1].bleu_signature}")
    print()
    print(markdown_table(["engine", "sentences/s", "speed-up", "BLEU", "chrF",
                          "same translation as aiayn"], rows))


if __name__ == "__main__":
    main()
