"""The `aiayn` command line: prepare | train | translate | evaluate | score | average |
export | trace | attention | plot | serve | doctor | info.

Each sub-command has an ``_add_<name>`` function (its arguments) and a ``_run_<name>``
function that calls one library function and prints what it returns; options shared by
several commands are declared once (``_add_set``, ``_add_device``, ``_add_weights``,
``_add_search``). Errors a user can cause are AiaynError: printed as one line, exit status
2, no traceback; warnings (e.g. truncated sentences) as one line each.

Building the parser needs no torch (the choices it offers come from aiayn.config and
aiayn.options): each ``_run_<name>`` imports what it calls, so that `aiayn --help`, a
command's --help and a mistyped option answer in a fraction of a second, not after the
seconds torch takes to load.

At about 1,000 lines this module is over the house's ~500: it is thirteen small commands'
arguments and printing, each pair short and independent, which read best beside the
options they share.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import math
import os
import sys
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import NoReturn

from aiayn.config import AUTO, Config, DecodeConfig, check_setting, load_config, preset_names, validate_given
from aiayn.errors import AiaynError, SettingError, is_out_of_memory
from aiayn.inference.settings import Sampling, resolve_search
from aiayn.options import CHUNK_LINES, DEVICES, ENGINES, EXPORT_TARGETS, QUANTIZATIONS
from aiayn.util.io import DiskError, as_disk_error, atomic_path, check_output_file, check_writable_dir
from aiayn.util.progress import bar


def _config_from_args(args, default: str | None = None) -> Config:
    path = getattr(args, "config", None) or default
    overrides = getattr(args, "set", None) or []
    if path:
        return load_config(path, overrides)
    return validate_given(Config().override(overrides), "defaults", overrides) if overrides \
        else Config().validate()


def _add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config setting, e.g. --set train.max_steps=100 (repeatable)")


def _add_device(p: argparse.ArgumentParser, extra: str = "") -> None:
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="auto: a CUDA GPU when there is one, else Apple's MPS where the model "
                   "runs on it, else the CPU" + extra)


def _add_direction(p: argparse.ArgumentParser) -> None:
    p.add_argument("--to", metavar="LANG", help="the language to translate into, for a model "
                   "trained on several directions (`aiayn info` lists them; "
                   "docs/data.md#several-corpora-and-directions)")


def _add_weights(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", default="best",
                   help="best, last, NAME for RUN_DIR/NAME.safetensors (e.g. averaged), or a "
                   ".safetensors path")


def _add_engine(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=ENGINES, default="aiayn",
                   help="who decodes: aiayn (a run directory) or ctranslate2 (a directory from "
                   "`aiayn export --to ctranslate2`)")
    p.add_argument("--int8", action="store_true",
                   help="aiayn's engine on a CPU: the decoder and the output layer in int8, "
                   "through aiayn's own kernel (faster; the translations differ a little from "
                   "fp32: docs/translating.md#int8-decoding)")


def _add_search(p: argparse.ArgumentParser, beam: int | None = None,
                decode_tokens: bool = True) -> None:
    """--beam and --alpha; not given (None), the run's config says (its decode section)."""
    run_default = "the run's decode.beam: 4 unless its config says otherwise"
    p.add_argument("--beam", type=int, default=beam,
                   help=f"beam size (1: greedy search; default: {beam or run_default})")
    p.add_argument("--alpha", type=float, default=None,
                   help="length penalty (default: the run's decode.alpha: 0.6 unless its "
                   "config says otherwise)")
    if decode_tokens:
        _add_decode_tokens(p, "decoding budget: padded source tokens x beam of a batch "
                           "(default 8192 on a CPU; on a GPU what a quarter of its free memory "
                           "holds, up to 262144; not train.max_tokens, training's)")


def _add_decode_tokens(p: argparse.ArgumentParser, text: str) -> None:
    """The decoding budget: --decode-tokens, or its older name --max-tokens (the one place
    the alias lives; ``_Given`` keeps which of the two was typed, for the messages)."""
    p.add_argument("--decode-tokens", "--max-tokens", dest="decode_tokens", type=int,
                   default=None, metavar="N", action=_Given,
                   help=f"{text}; --max-tokens is its older name")


class _Given(argparse.Action):
    """Store the value, and the option string typed for it (``_flag``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given_flags = {**getattr(namespace, "given_flags", {}),
                                 self.dest: option_string}


# The settings whose flag is not their Python name with dashes; in `aiayn train`, the
# config keys that set the validation's search and budget; the settings a command may have
# no flag for, in words.
FLAGS = {"sampling": "--sample"}
TRAIN_KEYS = {"beam": "train.eval_beam", "decode_tokens": "train.max_tokens"}
UNFLAGGED = {"decode_tokens": "the decoding budget"}


def _flag(name: str, args) -> str:
    """A setting as the command line names it (``SettingError.spelled``): its flag, as typed
    (--max-tokens for --decode-tokens if so); a setting without a flag in this command, as
    the config names it (decode.max_len_b; train.eval_beam in `aiayn train`), else in words
    (never a flag of another command: `aiayn attention` has no --decode-tokens)."""
    typed = getattr(args, "given_flags", {}).get(name)
    if typed:
        return typed
    flag = FLAGS.get(name, "--" + name.replace("_", "-"))
    if hasattr(args, flag.lstrip("-").replace("-", "_")):
        return flag
    if args.command == "train" and name in TRAIN_KEYS:
        return TRAIN_KEYS[name]
    if hasattr(DecodeConfig, name):
        return f"decode.{name}"
    return UNFLAGGED.get(name, name)


def _setting_line(exc: SettingError, args) -> str:
    """A SettingError in the command line's names; an alias typed is named with the
    option it stands for."""
    line = exc.spelled(lambda name: _flag(name, args))
    if getattr(args, "given_flags", {}).get("decode_tokens") == "--max-tokens":
        line += " (--max-tokens is --decode-tokens' older name)"
    return line


def _add_guard(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-repeat-ngram", type=int, default=None, metavar="N",
                   help="repetition guard: no translation holds the same N-gram of pieces "
                   "twice (0: off; default: the run's decode.no_repeat_ngram, 0 unless its "
                   "config says otherwise)")


def _add_sampling(p: argparse.ArgumentParser) -> None:
    """--sample and its settings (aiayn.inference.search.Sampling)."""
    p.add_argument("--sample", action="store_true",
                   help="draw random samples from the model instead of searching (--nbest N "
                   "of them per sentence, best first)")
    p.add_argument("--temperature", type=float, default=None,
                   help="--sample: divide the logits by it (< 1 sharper, > 1 flatter; default 1)")
    p.add_argument("--top-k", type=int, default=None,
                   help="--sample: draw among the K likeliest pieces only (default 0: all)")
    p.add_argument("--top-p", type=float, default=None,
                   help="--sample: draw among the fewest likeliest pieces whose probabilities "
                   "sum to P (nucleus sampling; default 1: all)")
    p.add_argument("--seed", type=int, default=None,
                   help="--sample: the same seed, sentence and settings draw the same samples "
                   "(default: a random seed, printed on stderr)")


def _sampling_from_args(args) -> Sampling | None:
    """The --sample settings (None without --sample; a seed is drawn when the search is
    resolved, and ``_say_seed`` names it)."""
    given = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
             "seed": args.seed}
    given = {key: value for key, value in given.items() if value is not None}
    if not args.sample:
        if given:
            raise AiaynError(f"--{next(iter(given)).replace('_', '-')} goes with --sample")
        return None
    return Sampling(**given)


def _say_seed(args, sampling: Sampling | None) -> None:
    """Name on stderr the random seed drawn for samples no --seed asked for (to draw them
    again)."""
    if sampling is not None and args.seed is None:
        print(f"aiayn: sampling with --seed {sampling.seed} (give it to draw these samples "
              "again)", file=sys.stderr)


def _at_least(value: int, low: int, option: str) -> None:
    if value < low:
        raise AiaynError(f"{option} must be at least {low}, got {value}")


@contextmanager
def _warnings_as_lines() -> Iterator[None]:
    """Show warnings raised inside (e.g. truncated sentences) as one stderr line each."""
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *args, **kwargs: print(
            f"aiayn: warning: {message}", file=sys.stderr)
        yield


# ---------------------------------------------------------------- prepare
def _add_prepare(sub) -> None:
    p = sub.add_parser("prepare", help="read a corpus, clean and split it, train tokenizers")
    p.add_argument("--corpus", action="append", help="corpus spec, e.g. bible:eng-spa, "
                   "hf:opus_books:en-it, tsv:PATH, jsonl:PATH, parallel:SRC,TGT (default: the "
                   "config's); repeat it for several corpora in one directory, each with "
                   "options weight=W (its share of the training batches), src=LANG, tgt=LANG "
                   "(docs/data.md#several-corpora-and-directions)")
    p.add_argument("--out", required=True, help="directory for the prepared data (new or empty)")
    p.add_argument("--force", action="store_true",
                   help="replace the contents of a non-empty --out (refused while in use)")
    p.add_argument("--config", help="YAML config whose data section to use")
    p.add_argument("--vocab-size", type=int, help="tokenizer vocabulary size")
    p.add_argument("--tokenizer", choices=["bpe", "wordlevel"],
                   help="tokenizer kind (data.tokenizer; default: the config's)")
    p.add_argument("--tokenizer-from", metavar="RUN_DIR", help="encode with this run's "
                   "tokenizers (and its data settings) instead of training new ones, to "
                   "fine-tune it with `aiayn train --init-from RUN_DIR`")
    _add_set(p)


def _run_prepare(args) -> int:
    from aiayn.data.prepare import prepare
    from aiayn.training.transfer import prepare_from_run

    if args.corpus is not None:  # one line per corpus (aiayn.data.directions)
        args.corpus = "\n".join(args.corpus)
    if args.tokenizer_from:
        if args.config:
            raise AiaynError("--tokenizer-from RUN_DIR takes the data settings from the run; "
                             "drop --config (change data.* settings with --set)")
        given = {"vocab_size": args.vocab_size, "tokenizer": args.tokenizer}
        given = {key: value for key, value in given.items() if value is not None}
        overrides = [*args.set, *(f"data.{k}={v}" for k, v in given.items())]
        stats = prepare_from_run(args.tokenizer_from, args.out, args.corpus, overrides,
                                 progress=True, force=args.force,
                                 flags={key: "--" + key.replace("_", "-") for key in given})
        return _print_prepared(stats, args.out)
    config = _config_from_args(args)
    changes = {"corpus": args.corpus, "vocab_size": args.vocab_size, "tokenizer": args.tokenizer}
    changes = {key: value for key, value in changes.items() if value is not None}
    if args.vocab_size is not None:  # blamed on the flag, not on the config file
        check_setting("--vocab-size", "data.vocab_size", args.vocab_size)
    config.data = dataclasses.replace(config.data, **changes)
    config.validate("command line")
    stats = prepare(config.data, args.out, config.model.max_len, config.train.max_tokens,
                    progress=True, force=args.force)
    return _print_prepared(stats, args.out)


def _print_prepared(stats: dict, out: str) -> int:
    from aiayn.data.prepare import prepare_warnings

    print(_prepare_summary(stats, out))
    for line in prepare_warnings(stats):
        print(f"aiayn: warning: {line}", file=sys.stderr)
    return 0


def _prepare_summary(stats: dict, out: str) -> str:
    """A few lines: what was read, dropped and kept, the splits, the vocabulary, batching."""
    pairs, splits, tok = stats["pairs"], stats["splits"], stats["tokenizer"]
    dropped = ", ".join(f"{reason} {n}" for reason, n in pairs["dropped"].items() if n)
    vocab = (f"joint vocabulary of {tok['src_vocab_size']}" if tok["joint"] else
             f"vocabularies of {tok['src_vocab_size']} (source) and {tok['tgt_vocab_size']} (target)")
    lengths = stats["lengths"]["train"]
    batching = stats["batching"]
    corpora = stats.get("corpora") or []
    several = len(corpora) > 1
    return "\n".join([
        *([f"corpus   {stats['corpus']}: {stats['description']}"] if not several else [
            f"corpus {i}  {c['line']}: {c['languages']['src'] or '?'} -> "
            f"{c['languages']['tgt'] or '?'}"
            + (f", tag {c['tag']}" if c.get("tag") else "")
            + f"; train {c['splits']['train']}, dev {c['splits']['dev']}, test "
              f"{c['splits']['test']}" for i, c in enumerate(corpora, 1)]),
        f"pairs    read {pairs['read']}, kept {pairs['kept']}, dropped "
        f"{sum(pairs['dropped'].values())} ({dropped or 'none'})",
        *([] if several else _languages_line(stats.get("languages"))),
        f"splits   train {splits['train']}, dev {splits['dev']}, test {splits['test']} "
        f"({stats['split_rule']})",
        f"tokens   {tok['kind']}, {vocab} ("
        + (f"learnt from {tok['trained_on_pairs']} train pairs" if tok['trained_on_pairs']
           else "a trained run's, copied") + "); "
        f"train lengths p50/p99/max src "
        f"{lengths['src']['p50']}/{lengths['src']['p99']}/{lengths['src']['p100']}, tgt "
        f"{lengths['tgt']['p50']}/{lengths['tgt']['p99']}/{lengths['tgt']['p100']}",
        f"batches  {batching['batches']} train batches of <= {batching['max_tokens']} tokens, "
        f"padding {100 * batching['padding_fraction']:.1f}%",
        f"wrote    {out}/{{train,dev,test}}.jsonl, ids/ (token ids), tokenizer/, stats.json",
    ])


def _languages_line(languages: dict | None) -> list[str]:
    """The languages of the sides, how each was known, and BLEU's tokenizer (docs/data.md)."""
    if not languages:
        return []
    side = {s: f"{languages[s] or 'unnamed, written with spaces'} (from the "
               f"{languages[f'{s}_from']})" for s in ("src", "tgt")}
    return [f"language source {side['src']}, target {side['tgt']}; BLEU tokenize "
            f"{languages['bleu_tokenize']}"]


# ---------------------------------------------------------------- train
def _add_train(sub) -> None:
    p = sub.add_parser(
        "train", help="train a model on prepared data (or resume a run)",
        description="Train on prepared data: `aiayn train --config FILE --data DIR --out RUN_DIR`, "
        "or continue a run exactly: `aiayn train --resume RUN_DIR` (there, --set may change "
        "train.* and decode.* settings only, e.g. train.max_steps), or fine-tune one on new "
        "data: `aiayn train --init-from RUN_DIR --data DIR --out NEW_RUN` (DIR from `aiayn prepare "
        "--tokenizer-from RUN_DIR`). Under `torchrun --nproc_per_node K -m aiayn train ...` "
        "it runs DistributedDataParallel.")
    p.add_argument("--config", help="YAML config file, or a preset by name: "
                   f"{', '.join(preset_names())} (configs/*.yaml; a wheel carries them)")
    p.add_argument("--data", help="prepared data directory (from `aiayn prepare`); with "
                   "--resume, the default is the run's data_dir.txt")
    p.add_argument("--out", help="run directory to create")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue this run exactly")
    p.add_argument("--force", action="store_true", help="--out may hold files or an earlier "
                   "run: its run files (weights, state, logs) are replaced")
    p.add_argument("--init-from", metavar="RUN_DIR[:WEIGHTS]",
                   help="a new run (--data, --out) starting from this run's weights (best, "
                   "or :last, :FILE) with its model and tokenizers, a fresh optimizer and "
                   "schedule; settings: its config.yaml (or --config's train, data and decode sections; "
                   "its model section must be the run's, dropouts aside) and --set")
    p.add_argument("--max-minutes", type=float,
                   help="stop when the run has trained this long, over all its training sessions "
                   "(train.max_minutes; validations count); the final dev evaluation comes on top. "
                   "Above 0; no time limit: --set train.max_minutes=0 (then train.max_steps ends it)")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast (train.precision=bf16)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (train.compile)")
    _add_device(p, " (under torchrun: the rank's local GPU)")
    _add_set(p)


def _run_train(args) -> int:
    from aiayn.training.admission import check_run_request
    from aiayn.training.loop import train

    overrides = list(args.set or [])
    if args.max_minutes is not None:
        _check_max_minutes(args.max_minutes)
        overrides.append(f"train.max_minutes={args.max_minutes}")
    if args.bf16:
        overrides.append("train.precision=bf16")
    if args.compile:
        overrides.append("train.compile=true")
    check_run_request(bool(args.resume), args.init_from, bool(args.config), args.data,
                      args.out, args.force)
    config = load_config(args.config, overrides) if args.config else None
    if args.resume:
        train(None, args.data, args.resume, resume=True, overrides=overrides, device=args.device)
    else:
        train(config, args.data, args.out, overrides=overrides, device=args.device,
              force=args.force, init_from=args.init_from)
    return 0


def _check_max_minutes(minutes: float) -> None:
    """--max-minutes is a budget: 0 would silently mean none (train.max_minutes' 0), a run
    to train.max_steps that can take hours, so asking for no time limit is said in full,
    and the flag's range is train.max_minutes' without its 0."""
    if not (math.isfinite(minutes) and minutes > 0):
        raise AiaynError(f"--max-minutes {minutes:g}: a time budget must be in (0, inf) "
                         "minutes; for no time limit give --set train.max_minutes=0 (the run "
                         "then trains to train.max_steps: --set train.max_steps=N)")


# ---------------------------------------------------------------- translate
def _add_translate(sub) -> None:
    p = sub.add_parser(
        "translate", help="translate sentences (stdin or a file), one per line",
        description="Translate one sentence per line, keeping the order; an empty line gives "
        "an empty line. With --nbest N > 1 each input line gives up to N lines "
        "'LINE<TAB>SCORE<TAB>TRANSLATION' (LINE counts from 0, best first; SCORE is the "
        "log-probability divided by the length penalty; an empty input line gives one line "
        "'LINE<TAB><TAB>'). With --alignments each output line ends with a tab and the "
        "translation's word alignment in the Pharaoh format, 'i-j' pairs of source word i "
        "and target word j (whitespace-separated words, from 0). A sentence longer than the "
        "model's max_len is truncated, with a warning on stderr. With --sample: random "
        "samples instead of the search, --nbest of them per sentence (docs/translating.md). "
        "With -i IN -o OUT the translations go to OUT.partial as each chunk of lines is done "
        "and a killed run goes on with --resume, ending as an uninterrupted one.")
    p.add_argument("run_dir", help="run directory (from `aiayn train`)")
    _add_search(p)
    _add_guard(p)
    p.add_argument("--nbest", type=int, default=1, help="hypotheses per sentence (<= --beam; "
                   "with --sample: samples per sentence)")
    _add_sampling(p)
    p.add_argument("--alignments", action="store_true",
                   help="add a tab and the word alignment to each line: 'i-j' pairs "
                   "(Pharaoh format) from the cross-attention of decode.alignment_layer")
    p.add_argument("--scores", action="store_true",
                   help="one JSON object per line: the translation, its score (what the "
                   "search ranked it by), log_prob, and each piece with its log-probability "
                   "(with --nbest N: {\"nbest\": [...]})")
    p.add_argument("--prefix", action="store_true",
                   help="each input line is SENTENCE<TAB>PREFIX: the translation starts with "
                   "PREFIX and the search completes it (a line without a tab: no prefix)")
    p.add_argument("-i", "--input", help="input file (default: stdin); read lazily, checked "
                   "as UTF-8 before anything is written, with a progress bar on a terminal")
    p.add_argument("-o", "--output", help="output file (default: stdout); with -i written as "
                   "each chunk is done to OUTPUT.partial (and OUTPUT.partial.json, what is "
                   "done), renamed to OUTPUT at the end")
    p.add_argument("--resume", action="store_true",
                   help="continue the interrupted -i IN -o OUT run whose OUT.partial is left "
                   "(same settings; the output ends as an uninterrupted run's)")
    p.add_argument("--chunk-lines", type=int, default=CHUNK_LINES, metavar="N",
                   help=f"input lines decoded, written and recorded at a time (default "
                   f"{CHUNK_LINES}); a resumed run needs the interrupted run's N")
    p.add_argument("--interactive", action="store_true", help="answer each line of stdin as "
                   "soon as it is entered (the default when stdin is a terminal)")
    _add_direction(p)
    _add_weights(p)
    _add_device(p)
    _add_engine(p)


def _run_translate(args) -> int:
    from aiayn.inference.files import Job, run_identity, translate_file
    from aiayn.inference.translator import Translator
    from aiayn.runs.directory import run_decode
    from aiayn.util.device import choose_device

    # The one resolution of the search (the run's decode section and these options),
    # before waiting for stdin or loading; every layer below gets this very value.
    decode = run_decode(args.run_dir)
    search = resolve_search(decode, beam=args.beam, alpha=args.alpha,
                            nbest=args.nbest, no_repeat_ngram=args.no_repeat_ngram,
                            sampling=_sampling_from_args(args))
    if args.interactive and args.input is not None:
        raise AiaynError("--interactive reads stdin line by line; drop -i/--input")
    if args.resume and (args.output is None or args.input is None):
        raise AiaynError("--resume continues an interrupted `-i IN -o OUT` run; give the same "
                         "-i and -o" + ("" if args.output is None else
                                        " (stdin cannot be read again)"))
    _at_least(args.chunk_lines, 1, "--chunk-lines")
    if args.output is not None:
        check_output_file(args.output, "-o", {"-i": args.input})
    if args.input is not None and Path(args.input).is_dir():
        raise AiaynError(f"-i {args.input}: is a directory, not a file")
    terminal = sys.stdin is not None and sys.stdin.isatty()
    interactive = args.input is None and (args.interactive or terminal)
    device = choose_device(args.device)
    modes = {"alignments": args.alignments, "scores": args.scores, "prefixes": args.prefix}
    job = None
    if args.input is not None and args.output is not None:  # checked before the model loads
        job = Job(args.input, args.output, search, chunk=args.chunk_lines, resume=args.resume,
                  seed_given=args.seed is not None, modes=modes,
                  run=run_identity(args.run_dir, args.weights, args.engine, str(device),
                                   args.decode_tokens, int8=args.int8, to=args.to,
                                   alignment_layer=_alignment_layer(decode, args.alignments)))
        search = job.search  # on --resume, a seed drawn at random is the interrupted run's
    translator = Translator.from_pretrained(args.run_dir, args.weights, device=device,
                                            decode_tokens=args.decode_tokens,
                                            engine=args.engine, int8=args.int8, to=args.to)
    translator.check(search)  # what the model and the decoding budget can hold
    translator.check_direction()
    if args.alignments:
        translator.check_alignments()
    if interactive and terminal:
        print("aiayn: translating each line as it is entered; end with Ctrl-D", file=sys.stderr)
    _say_seed(args, search.sampling)
    if job is not None:
        job.run(translator)
        return 0
    if args.input is not None:  # a bar only where it does not draw over the translations
        chunks = translate_file(translator, args.input, search, args.chunk_lines,
                                progress=not sys.stdout.isatty(), **modes)
    else:
        lines = _stdin_lines() if interactive else _read_stdin()
        chunks = translator.translate_lines(lines, chunk=1 if interactive else args.chunk_lines,
                                            search=search, **modes)
    _write_output(chunks, args.output)
    return 0


def _alignment_layer(decode, alignments: bool) -> int | None:
    """The run's decode.alignment_layer for a resumable job's record where word alignments
    are written and it is not the default (a record without one is the default's: those
    written before it was recorded resume as they were)."""
    from aiayn.config import DecodeConfig

    layer = decode.alignment_layer
    return layer if alignments and layer != DecodeConfig().alignment_layer else None


def _write_output(chunks: Iterator[str], output: str | None) -> None:
    """``chunks`` to stdout as they come, or to ``output`` whole (written atomically: a
    failure leaves it as it was)."""
    if output is None:
        _write(chunks, sys.stdout)
        return
    with atomic_path(output) as tmp, open(tmp, "w", encoding="utf-8") as out:
        _write(chunks, out)


def _write(chunks: Iterator[str], out) -> None:
    for text in chunks:
        out.write(text)
        out.flush()


def _stdin_lines() -> Iterator[str]:
    """stdin line by line, each as soon as it has arrived, by ``_read_stdin``'s rules (UTF-8,
    lines end at "\\n" only, a trailing "\\r" goes, a byte-order mark at the start too)."""
    from aiayn.inference.lines import stream_lines

    if not hasattr(sys.stdin, "buffer"):  # a text stream put in its place
        for number, line in enumerate(sys.stdin):
            line = line.removeprefix("\ufeff") if number == 0 else line
            yield line.removesuffix("\n").removesuffix("\r")
        return
    yield from stream_lines(sys.stdin.buffer, "stdin")


def _read_stdin() -> list[str]:
    """All of stdin's lines, by ``aiayn.inference.lines.read_lines``'s rules (lines end at
    "\\n" only, a trailing "\\r" goes, a UTF-8 byte-order mark at the start too), read
    before any is translated, so that text that is not UTF-8 fails before any output."""
    from aiayn.inference.lines import text_lines

    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else \
        sys.stdin.read().encode("utf-8")
    return text_lines(data, "stdin")


# ---------------------------------------------------------------- evaluate
def _add_evaluate(sub) -> None:
    p = sub.add_parser(
        "evaluate", help="score a run on the test or dev split",
        description="Translate the test (or dev) split of the prepared data, write the "
        "hypotheses (one per line) and print sacreBLEU BLEU with its signature, chrF, CER and "
        "WER, and the decoding speed. The scores also go to a .json file beside the "
        "hypotheses.")
    p.add_argument("run_dir", help="run directory (from `aiayn train`)")
    p.add_argument("--split", choices=["test", "dev"], default="test",
                   help="the prepared split to translate and score")
    _add_search(p)
    _add_guard(p)
    p.add_argument("--data", help="prepared data directory (default: the one the run used, "
                   "from RUN_DIR/data_dir.txt)")
    _add_weights(p)
    p.add_argument("-o", "--output", help="file for the hypotheses, the scores beside it with "
                   "the suffix .json (default: "
                   "RUN_DIR/eval/SPLIT.WEIGHTS.beamK.alphaA.txt; greedy: .beam1.txt; with "
                   "--no-repeat-ngram N: .norepeatN before .txt; with --limit N: .firstN)")
    p.add_argument("--limit", type=int, default=0, help="only the first N sentences (0: all; "
                   "written to files of their own, never over the whole split's)")
    _add_device(p)
    _add_engine(p)


def _run_evaluate(args) -> int:
    from aiayn.evaluation.evaluate import evaluate_run
    from aiayn.runs.directory import run_decode

    search = resolve_search(run_decode(args.run_dir), beam=args.beam, alpha=args.alpha,
                            no_repeat_ngram=args.no_repeat_ngram)
    r = evaluate_run(args.run_dir, args.split, search, data_dir=args.data,
                     weights=args.weights, output=args.output, limit=args.limit,
                     decode_tokens=args.decode_tokens, device=args.device, engine=args.engine,
                     int8=args.int8)
    search = "greedy" if r["beam"] == 1 else f"beam {r['beam']}, alpha {r['alpha']}"
    if r["no_repeat_ngram"]:
        search += f", no repeated {r['no_repeat_ngram']}-gram"
    repeats = r["repeats"]
    print("\n".join([
        f"{r['split']}: {r['sentences']} sentences from {r['data_dir']}, weights "
        f"{r['weights']}, {search}",
        *([] if r["loss"] is None else
          [f"loss  {r['loss']:.4f}   NLL {r['nll']:.4f} per target token (teacher forcing)"]),
        f"BLEU  {r['bleu']:.2f}   {r['bleu_signature']}",
        f"chrF  {r['chrf']:.2f}   {r['chrf_signature']}",
        *(f"{name:<5} BLEU {d['bleu']:.2f}   chrF {d['chrf']:.2f}   ({d['sentences']} "
          f"sentences, BLEU tokenize {d['bleu_tokenize']})"
          for name, d in r["directions"].items()),
        f"CER   {100 * r['cer']:.2f}%   WER {100 * r['wer']:.2f}%",
        f"stutter {100 * repeats['hypotheses']:.1f}% of the translations repeat a "
        f"{repeats['n']}-gram of words, {100 * repeats['references']:.1f}% of the references",
        f"speed {r['sentences_per_s']:.1f} sentences/s, {r['tokens_per_s']:.0f} tokens/s "
        f"({r['seconds']:.1f} s on {r['device']}, {r['threads']} thread"
        f"{'' if r['threads'] == 1 else 's'}, {r['engine']})",
        f"wrote {r['output']} and {r['scores_file']}",
    ]))
    return 0


# ---------------------------------------------------------------- score
def _add_score(sub) -> None:
    p = sub.add_parser(
        "score", help="score given source-target pairs (their log-probability, teacher-forced)",
        description="The model's log-probability of each given target given its source "
        "(forced decoding), with the numbers the search gives its own translations: one line "
        "per pair, in input order, 'SCORE<TAB>LOG_PROB<TAB>TOKENS' (SCORE: LOG_PROB over the "
        "length penalty of --alpha, what the beam search ranks by; TOKENS: the target's pieces "
        "+ EOS, so LOG_PROB/TOKENS is the mean per token; \"-inf\" where the model cannot "
        "produce a piece), or with --json one JSON object per line with the pieces and each "
        "one's log-probability (null for -inf). Pairs from -i (SOURCE<TAB>TARGET lines), "
        "--source/--target (line i with line i) or --split of the prepared data. An empty "
        "source or target is scored as it is. The repetition guard is off unless "
        "--no-repeat-ngram asks for it (docs/scoring.md).")
    p.add_argument("run_dir", help="run directory (from `aiayn train`)")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("-i", "--input", help="a file of SOURCE<TAB>TARGET lines ('-': stdin)")
    given.add_argument("--source", help="a file of sources, one per line (with --target; "
                       "'-': stdin)")
    given.add_argument("--split", choices=["train", "dev", "test"],
                       help="the pairs of this split of the prepared data")
    p.add_argument("--target", help="a file of targets, line i the target of --source's line i "
                   "('-': stdin)")
    p.add_argument("--data", help="--split: prepared data directory (default: the one the run "
                   "used, from RUN_DIR/data_dir.txt)")
    p.add_argument("-o", "--output", help="output file (default: stdout), written whole at the end")
    p.add_argument("--json", action="store_true",
                   help="JSON lines: score, log_prob, pieces and log_probs (one per piece, "
                   "then EOS's)")
    p.add_argument("--alpha", type=float, default=None,
                   help="length penalty of SCORE (default: the run's decode.alpha)")
    p.add_argument("--no-repeat-ngram", type=int, default=0, metavar="N",
                   help="score under the search's repetition guard of N-grams of pieces (a "
                   "target that repeats one then scores -inf; default 0: off, the model alone)")
    _add_decode_tokens(p, "scoring budget: padded tokens of a batch (default 8192 on a CPU)")
    _add_direction(p)
    _add_weights(p)
    _add_device(p)


def _run_score(args) -> int:
    from aiayn.inference.scoring import read_file_pairs, read_split_pairs, read_tsv_pairs, score_lines
    from aiayn.inference.translator import Translator
    from aiayn.runs.directory import run_decode
    from aiayn.util.device import choose_device

    search = resolve_search(run_decode(args.run_dir), alpha=args.alpha,
                            no_repeat_ngram=args.no_repeat_ngram)
    if (args.source is None) != (args.target is None):
        raise AiaynError("--source and --target go together (line i of one pairs with line i "
                         "of the other)")
    if args.data is not None and args.split is None:
        raise AiaynError("--data goes with --split")
    if args.output is not None:
        check_output_file(args.output, "-o", {"-i": args.input, "--source": args.source,
                                              "--target": args.target})
    if args.input is not None:
        sources, targets = read_tsv_pairs(args.input)
    elif args.source is not None:
        sources, targets = read_file_pairs(args.source, args.target)
    else:
        sources, targets = read_split_pairs(args.run_dir, args.split, args.data)
    translator = Translator.from_pretrained(args.run_dir, args.weights,
                                            device=choose_device(args.device),
                                            decode_tokens=args.decode_tokens, to=args.to)
    if args.split is None:  # a prepared split's sources carry their tags
        translator.check_direction()
    with bar(total=len(sources), desc="score", enabled=len(sources) > 1000) as progress:
        chunks = score_lines(translator, sources, targets, search, args.json,
                             progress=progress.update)
        _write_output(chunks, args.output)
    return 0


# ---------------------------------------------------------------- average
def _add_average(sub) -> None:
    p = sub.add_parser(
        "average", help="average checkpoints (paper, 6.1)",
        description="Average weights element-wise, as the paper does with its last 5 "
        "checkpoints (section 6.1). Give .safetensors files, or run directories: with "
        "--last N a run directory gives its last N step checkpoints "
        "(RUN_DIR/checkpoints/step_*.safetensors), without it its last.safetensors. "
        "Evaluate the result with `aiayn evaluate RUN_DIR --weights OUT`.")
    p.add_argument("paths", nargs="+", help="run directories or .safetensors files")
    p.add_argument("--last", type=int, help="a run directory gives its last N step checkpoints")
    p.add_argument("-o", "--output", required=True, help="the averaged .safetensors file")


def _run_average(args) -> int:
    from aiayn.runs.checkpoint import average_checkpoints
    from aiayn.runs.directory import checkpoints_to_average

    check_output_file(args.output, "-o", make_dirs=True)  # not after reading every file
    files = checkpoints_to_average(args.paths, args.last)
    average_checkpoints(files, args.output)
    print(f"averaged {len(files)} checkpoints:")
    print("".join(f"  {path}\n" for path in files), end="")
    print(f"wrote {args.output}")
    return 0


# ---------------------------------------------------------------- export
def _add_export(sub) -> None:
    p = sub.add_parser(
        "export", help="write a run's model for Hugging Face Transformers or CTranslate2",
        description="`--to hf OUT_DIR`: a directory (config, safetensors, fast tokenizer) that "
        "transformers' AutoModelForSeq2SeqLM / AutoTokenizer load without aiayn: a "
        "MarianMTModel where the run's model is one, else aiayn's own model code beside it "
        "(trust_remote_code=True; the demo's). `--to ctranslate2 OUT_DIR`: a CTranslate2 "
        "model, which `aiayn translate|evaluate|serve OUT_DIR --engine ctranslate2` decode. "
        "OUT_DIR must be new or empty. Needs pip install 'aiayn[export]'.")
    p.add_argument("run_dir", help="run directory (from `aiayn train`)")
    p.add_argument("--to", required=True, choices=EXPORT_TARGETS, help="the library")
    p.add_argument("out_dir", help="directory to create")
    _add_weights(p)
    p.add_argument("--quantization", choices=QUANTIZATIONS,
                   help="--to ctranslate2: weight type (default: float32 as trained)")


def _run_export(args) -> int:
    from aiayn.export.command import export_run

    out = export_run(args.run_dir, args.to, args.out_dir, args.weights, args.quantization)
    print(f"wrote {out}")
    return 0


# ---------------------------------------------------------------- trace
def _add_trace(sub) -> None:
    p = sub.add_parser("trace", help="print every module's output shape for one batch")
    p.add_argument("--config", default=None, help="YAML config (default: the built-in defaults, "
                   "the paper's base sizes)")
    p.add_argument("--data", help="prepared data directory: trace a real batch from it")
    p.add_argument("--batch-size", type=int, default=2, help="sentences in the traced batch")
    p.add_argument("--depth", type=int, default=99, help="deepest nesting level to show")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and batch")
    p.add_argument("--png", metavar="FILE", help="also draw the shapes as a diagram (PNG)")
    _add_set(p)


def _run_trace(args) -> int:
    import torch

    from aiayn.inspect.trace import format_trace, trace_batch, trace_forward
    from aiayn.model import Transformer

    _at_least(args.depth, 0, "--depth")
    _at_least(args.batch_size, 1, "--batch-size")
    if args.png:  # before the trace, not after it
        from aiayn.inspect.canvas import check_picture_path

        check_picture_path(args.png, "--png")
    config = _config_from_args(args)
    torch.manual_seed(args.seed)
    src, tgt = trace_batch(config, args.data, args.batch_size)
    model = Transformer(config.model)
    rows = trace_forward(model, src, tgt)
    print(format_trace(rows, src, tgt, args.depth))
    if args.png:
        from aiayn.inspect.plots import save_figure, trace_figure

        fig = trace_figure(rows, src.shape, tgt.shape, config.model.n_heads)
        print(f"wrote {save_figure(fig, args.png)}")
    return 0


# ---------------------------------------------------------------- attention
def _add_attention(sub) -> None:
    p = sub.add_parser(
        "attention", help="attention heatmaps for one translated sentence",
        description="Translate the sentence and draw every attention map of its translation "
        "(encoder_self.png, decoder_self.png, cross.png). With --steps: draw its "
        "cross-attention at each saved step of the run (checkpoints/step_*.safetensors and "
        "the last weights), all over one target, to watch the attention learn to align "
        "(cross_steps.png, and cross_steps.gif a frame per step).")
    p.add_argument("run_dir", help="run directory (from `aiayn train`)")
    p.add_argument("sentence", help="the source sentence to translate and draw")
    p.add_argument("-o", "--out", default="attention", help="output directory for the PNGs")
    p.add_argument("--steps", action="store_true",
                   help="the cross-attention at each of the run's step checkpoints (a run "
                   "keeps them with train.keep_checkpoints and train.keep_steps)")
    p.add_argument("--target", help="--steps: the translation every checkpoint is given "
                   "(default: the translation by --weights)")
    p.add_argument("--layer", type=int, help="--steps: the decoder layer, from 1 "
                   "(default: the last)")
    p.add_argument("--head", type=int, help="--steps: one head, from 1 (default: the mean "
                   "of the layer's heads)")
    _add_search(p, beam=1, decode_tokens=False)
    _add_direction(p)
    _add_weights(p)


def _run_attention(args) -> int:
    from aiayn.inference.translator import Translator
    from aiayn.inspect.plots import save_attention_figures

    check_writable_dir(args.out, "-o")  # before the model loads, as --out of train and prepare
    if args.steps:
        return _attention_steps(args)
    for option in ("target", "layer", "head"):
        if getattr(args, option) is not None:
            raise AiaynError(f"--{option} goes with --steps")
    translator = Translator.from_pretrained(args.run_dir, weights=args.weights, to=args.to)
    translator.check_direction()
    att = translator.attention(args.sentence,
                               translator.resolve(beam=args.beam, alpha=args.alpha))
    print(f"translation: {att.translation}")
    for path in save_attention_figures(att, args.out):
        print(f"wrote {path}")
    return 0


def _attention_steps(args) -> int:
    from aiayn.inspect.attention_steps import attention_over_steps
    from aiayn.inspect.plots import save_attention_steps
    from aiayn.runs.directory import run_decode, step_weights

    search = resolve_search(run_decode(args.run_dir), beam=args.beam, alpha=args.alpha)
    saved = step_weights(args.run_dir)
    heads = load_config(Path(args.run_dir) / "config.yaml").model.n_heads
    if args.head is not None and not 1 <= args.head <= heads:
        raise AiaynError(f"--head must be between 1 and {heads} (the model's heads), "
                         f"got {args.head}")
    with bar(desc="checkpoints", total=len(saved), unit="") as progress:
        att = attention_over_steps(args.run_dir, args.sentence, args.target, args.layer,
                                   args.weights, search, progress.update, to=args.to)
    print(f"target: {att.translation}")
    print(f"steps: {', '.join('last' if s is None else str(s) for s in att.steps)}")
    head = None if args.head is None else args.head - 1
    for path in save_attention_steps(att, args.out, head):
        print(f"wrote {path}")
    return 0


# ---------------------------------------------------------------- plot
def _add_plot(sub) -> None:
    p = sub.add_parser("plot", help="training curves (and positional-encoding/schedule plots)")
    p.add_argument("run_dirs", nargs="*", help="run directories to overlay (their metrics.jsonl)")
    p.add_argument("-o", "--output", help="PNG file (default: curves.png, "
                   "positional_encoding.png or schedule.png)")
    p.add_argument("--pe", action="store_true", help="plot the positional-encoding table")
    p.add_argument("--positions", type=int, default=100, help="--pe: positions to show")
    p.add_argument("--d-model", type=int, default=128, help="--pe: embedding size")
    p.add_argument("--schedule", metavar="CONFIG", help="plot the learning-rate schedule")
    _add_set(p)


def _run_plot(args) -> int:
    from aiayn.inspect import plots
    from aiayn.runs.metrics import read_metrics

    chosen = [bool(args.run_dirs), args.pe, args.schedule is not None]
    if sum(chosen) != 1:
        raise AiaynError("plot what? give run directories, --pe, or --schedule CONFIG "
                         "(exactly one of them)")
    if args.output is not None:
        plots.check_picture_path(args.output, "-o")
    if args.set and args.schedule is None:
        Config().override(args.set)  # an unknown setting is refused as everywhere
        raise AiaynError("--set goes with --schedule CONFIG (--pe and run directories read "
                         "no config settings)")
    if args.pe:
        fig = plots.positional_encoding_figure(args.positions, args.d_model)
        output = args.output or "positional_encoding.png"
    elif args.schedule:
        config = load_config(args.schedule, args.set)
        fig = plots.schedule_figure(config, label=args.schedule)
        output = args.output or "schedule.png"
    else:
        labels = plots.run_labels(args.run_dirs)
        runs = {label: read_metrics(run_dir)
                for label, run_dir in zip(labels, args.run_dirs, strict=True)}
        fig = plots.curves_figure(runs, [_label_smoothing(run_dir) for run_dir in args.run_dirs])
        output = args.output or "curves.png"
    print(f"wrote {plots.save_figure(fig, output)}")
    return 0


def _label_smoothing(run_dir: str) -> float | None:
    """The run's train.label_smoothing (the loss `plot` labels), or None when unreadable or
    not yet chosen ("auto": the trainer writes its choice once the budget's passes are known)."""
    try:
        smoothing = load_config(Path(run_dir) / "config.yaml").train.label_smoothing
    except AiaynError:
        return None
    return None if smoothing == AUTO else smoothing


# ---------------------------------------------------------------- serve
def _add_serve(sub) -> None:
    p = sub.add_parser(
        "serve", help="an HTTP API and a web page: translate, n-best lists, attention maps",
        description="Load the run's model once and serve POST /translate, POST /next, POST "
        "/attention, GET /info, GET /health, GET /stats, the run's figures at "
        "/figures/NAME.png, the page at / and the API's documentation at /docs (needs the "
        "extra: pip install 'aiayn[serve]'). Requests that wait while the model is busy are "
        "decoded together, each answer the same as alone. The start-up line, with the address "
        "(the port chosen where --port is 0), goes to stdout; warnings and errors to stderr.")
    p.add_argument("run_dir", help="run directory (from `aiayn train`; with --engine "
                   "ctranslate2 a directory from `aiayn export --to ctranslate2`)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    _add_decode_tokens(p, "decoding budget: the sentences decoded together, all requests and "
                       "searches, hold at most this many source tokens x beam; a request that "
                       "does not fit waits (default as `aiayn translate`'s: 8192 on a CPU)")
    p.add_argument("--max-wait-ms", type=float, default=5.0,
                   help="when nothing is being decoded, wait up to this long after the oldest "
                   "waiting request for others to start with it (0-1000; default 5)")
    p.add_argument("--batching", choices=["continuous", "pass"], default=None,
                   help="continuous: a request joins the running search at its next step and "
                   "leaves it when done (the default with aiayn's model: the shortest waits); "
                   "pass: the waiting requests are decoded together to the end of the pass "
                   "(CTranslate2's only way; on a CPU more requests/s under heavy load)")
    p.add_argument("--lanes", choices=["processes", "threads"], default=None,
                   help="continuous batching decodes on one lane per core: processes (the "
                   "default on a CPU with two or more cores: lanes as threads take turns on "
                   "Python's lock) or threads (one process, less memory)")
    p.add_argument("--scheduling", choices=["batch", "inherited"], default=None,
                   help="batch: the server's threads and lanes under Linux's batch policy, so "
                   "that its HTTP threads do not preempt a lane in mid-step (the default on a "
                   "CPU); inherited: as the server was started (the default on a GPU)")
    _add_weights(p)
    _add_device(p)
    _add_engine(p)


def _run_serve(args) -> int:
    from aiayn.util.device import choose_device

    try:
        from aiayn.serving.app import serve
    except ImportError as exc:
        raise AiaynError(f"aiayn serve needs FastAPI and uvicorn ({exc.name} is missing): "
                         "pip install 'aiayn[serve]'") from None
    if not 0 <= args.port <= 65535:
        raise AiaynError(f"--port must be between 0 and 65535, got {args.port}")
    if args.decode_tokens is not None and args.decode_tokens < 1:
        raise SettingError("{decode_tokens} must be at least 1, got {got}",
                           got=args.decode_tokens)
    serve(args.run_dir, args.host, args.port, args.weights, choose_device(args.device),
          engine=args.engine, decode_tokens=args.decode_tokens, max_wait_ms=args.max_wait_ms,
          batching=args.batching, lanes=args.lanes, int8=args.int8,
          scheduling=args.scheduling)
    return 0


# ---------------------------------------------------------------- doctor / info
def _add_doctor(sub) -> None:
    p = sub.add_parser(
        "doctor", help="check a run directory for what can silently break it",
        description="Check a run: weights present and finite, shapes = config, tokenizers "
        "(special ids, vocabulary sizes = embeddings), the data encoded with the same "
        "tokenizers, a round-trip of dev sentences, a greedy translation of three dev "
        "sentences with BLEU, the logged dev loss and BLEU of the best and last weights "
        "reproduced by validating them again, the train state resumable. One line per "
        "check, each failure with its fix; exit status 0 when all pass, 1 otherwise.")
    p.add_argument("run_dir", help="run directory (from `aiayn train`)")
    p.add_argument("--data", help="prepared data to check against (default: the run's "
                   "data_dir.txt)")
    _add_weights(p)


def _run_doctor(args) -> int:
    from aiayn.inspect.doctor import doctor

    report = doctor(args.run_dir, args.data, args.weights)
    print(report)
    return 0 if report.ok else 1


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="what a run is: model, vocabulary, steps, best score",
                       description="Model size and parameters, vocabulary, steps, tokens "
                       "seen, the best dev score and its step, the weights files there are, "
                       "the languages --to may name. Of prepared data: its corpora, each "
                       "with its languages, direction tag and pairs per split.")
    p.add_argument("run_dir", metavar="RUN_OR_DATA", help="run directory (from `aiayn "
                   "train`) or prepared data directory (from `aiayn prepare`)")
    p.add_argument("--json", action="store_true", help="one JSON object, for scripts")


def _run_info(args) -> int:
    from aiayn.inspect.info import format_info, run_info

    info = run_info(args.run_dir)
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


COMMANDS = {
    "prepare": (_add_prepare, _run_prepare),
    "train": (_add_train, _run_train),
    "translate": (_add_translate, _run_translate),
    "evaluate": (_add_evaluate, _run_evaluate),
    "score": (_add_score, _run_score),
    "average": (_add_average, _run_average),
    "export": (_add_export, _run_export),
    "trace": (_add_trace, _run_trace),
    "attention": (_add_attention, _run_attention),
    "plot": (_add_plot, _run_plot),
    "serve": (_add_serve, _run_serve),
    "doctor": (_add_doctor, _run_doctor),
    "info": (_add_info, _run_info),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a wrong argument is one line (as every other error of the program) and
    a pointer to --help, not the whole usage."""

    def error(self, message: str):
        self.exit(2, f"aiayn: error: {' '.join(message.split())} (see `{self.prog} --help`)\n")


def _version_line() -> str:
    """aiayn's version and torch's (what a bug report needs first; torch's from its
    installed metadata, without loading it)."""
    from aiayn import __version__

    return (f"aiayn {__version__} (torch {metadata.version('torch')}, Python "
            f"{sys.version.split()[0]})")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(  # its subcommands' parsers are of the same class
        prog="aiayn",
        description="The Transformer of 'Attention Is All You Need': train, evaluate, translate.",
    )
    parser.add_argument("--version", action="version", version=_version_line())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add, _ in COMMANDS.values():
        add(sub)
    return parser


def _unknown_arguments(parser: argparse.ArgumentParser, command: str, extra: list[str],
                       argv: list[str]):
    """Arguments no option takes: one line, pointing to the help of where they stood (before
    the command: `aiayn --help`; after it: the command's); words given to `aiayn translate`
    are most likely the sentence itself."""
    before = argv[:argv.index(command)] if command in argv else []
    if all(word in before for word in extra):
        parser.exit(2, f"aiayn: error: unrecognized arguments: {' '.join(extra)} (before the "
                       f"command; see `aiayn --help`)\n")
    hint = ""
    if command == "translate" and not any(word.startswith("-") for word in extra):
        hint = ("; translate reads its sentences from stdin or -i FILE, e.g. `echo 'TEXT' | "
                "aiayn translate RUN_DIR`")
    parser.exit(2, f"aiayn: error: unrecognized arguments: {' '.join(extra)}{hint} "
                f"(see `aiayn {command} --help`)\n")


def main(argv: list[str] | None = None) -> int:
    _utf8_streams()
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args, extra = parser.parse_known_args(argv)
    if extra:
        _unknown_arguments(parser, args.command, extra, argv)
    if not (args.command == "train" and _one_rank_of_many()):
        return _run_command(args)
    try:
        code = _run_command(args)
    except Exception:  # a bug in aiayn: its traceback, then the same end as any other
        traceback.print_exc()
        code = 1
    _end_rank(code)


def _one_rank_of_many() -> bool:
    from aiayn.training.distributed import world_size_from_env

    try:
        return world_size_from_env() > 1
    except AiaynError:  # not a launcher's WORLD_SIZE: the run's set-up says so in one line
        return False


def _end_rank(code: int) -> NoReturn:
    """End a rank of a distributed run with ``code``, its line and files already out, without
    the interpreter's teardown: gloo's threads can abort a process there (SIGABRT, "terminate
    called without an active exception") after the run has finished and destroyed its process
    group, which turned a finished run, or a clean one-line stop, into a crash."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_command(args) -> int:
    """Run the command; a user's mistake becomes one line and status 2 (a bug keeps its
    traceback)."""
    _, run = COMMANDS[args.command]
    try:
        with _warnings_as_lines():
            return run(args) or 0
    except DiskError as exc:
        return _error(_disk_error_line(exc, args))
    except SettingError as exc:
        return _error(_setting_line(exc, args))
    except AiaynError as exc:
        return _error(str(exc))
    except OSError as exc:  # a file the user named, a full disk, a permission
        if isinstance(exc, BrokenPipeError):  # `aiayn translate ... | head`
            return 0
        disk = as_disk_error(exc)
        return _error(_disk_error_line(disk, args) if disk else _os_error_line(exc))
    except (RuntimeError, MemoryError) as exc:
        if not is_out_of_memory(exc):
            raise  # a bug in aiayn: keep the traceback
        return _error(f"out of memory ({str(exc).splitlines()[0][:120]}); use smaller batches "
                      "(--decode-tokens, or train.max_tokens in training)")
    except KeyboardInterrupt:
        print(f"aiayn: interrupted{_way_on(args)}", file=sys.stderr)
        return 130


def _way_on(args) -> str:
    """For an interrupted `aiayn train`: the command that goes on, and from which step."""
    run = (args.resume or args.out) if args.command == "train" else None
    if not run or not (Path(run) / "config.yaml").is_file():
        return ""
    from aiayn.runs.checkpoint import load_train_state

    try:
        step = load_train_state(Path(run) / "train_state.pt")["step"]
    except (AiaynError, OSError, KeyError, TypeError):
        snapshots = any((Path(run) / "checkpoints").glob("step_*.safetensors"))
        why = "no checkpoint to go on from was saved yet"
        if snapshots:
            why += "; checkpoints/step_*.safetensors are weights to look at, not a point to go on from"
        return f"; `aiayn train --resume {run}` starts it again from step 0 ({why})"
    return f"; `aiayn train --resume {run}` goes on from step {step}, its last checkpoint"


def _error(line: str) -> int:
    print(f"aiayn: error: {' '.join(line.split())}", file=sys.stderr)
    return 2


# The option of each command that chooses where it writes (named in a full disk's fix).
OUTPUT_OPTION = {"prepare": "--out", "train": "--out", "translate": "-o", "evaluate": "-o",
                 "score": "-o",
                 "average": "-o", "export": "OUT_DIR", "trace": "--png", "attention": "-o",
                 "plot": "-o"}


def _disk_error_line(exc: DiskError, args) -> str:
    """The DiskError's line with the fix for this command: the option to change, or for
    `train --resume` the command that goes on from the last good checkpoint."""
    run = (args.resume or args.out) if args.command == "train" else None
    if run and exc.code in (errno.ENOSPC, errno.EDQUOT) and (Path(run) / "train_state.pt").is_file():
        return exc.line(fix=f"free space, then `aiayn train --resume {run}` goes on from the "
                        "last good checkpoint (kept as it was)")
    return exc.line(OUTPUT_OPTION.get(args.command))


def _os_error_line(exc: OSError) -> str:
    """'PATH: No space left on device' and the like (no traceback: the path says where)."""
    where = exc.filename if exc.filename is not None else "a file"
    reason = exc.strerror or str(exc)
    hint = {errno.ENOSPC: "; free some space and run the command again (files written "
                          "before are intact)",
            errno.EACCES: "; check its permissions",
            errno.EISDIR: "; a file is expected here"}.get(exc.errno, "")
    return f"{where}: {reason}{hint}"


def _utf8_streams() -> None:
    """Write UTF-8 whatever the terminal's locale says (a C/POSIX locale would make
    Python's default ASCII and every accented translation an error)."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure") and (stream.encoding or "").lower() not in ("utf-8", "utf8"):
            stream.reconfigure(encoding="utf-8", errors="backslashreplace" if stream is sys.stderr
                               else "strict")


if __name__ == "__main__":
    sys.exit(main())

