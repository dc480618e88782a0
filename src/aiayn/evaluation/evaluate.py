"""Scores of a model on a split: dev loss, BLEU / chrF / CER / WER, sample translations.

``aiayn evaluate`` (:func:`evaluate_run`) and the validation during training
(:func:`validate`) both translate through :class:`aiayn.inference.translator.Translator` (the same
batching, truncation and search) and score with :func:`aiayn.evaluation.metrics.score`, so a BLEU in
metrics.jsonl and one from ``aiayn evaluate`` differ only when the weights or the
settings (split, beam, alpha, bf16) do.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from aiayn.config import Config, rate
from aiayn.data.batching import Example, collate, length_multiple, token_batches
from aiayn.data.prepared import IDS_DIR, STATS_FILE, TOKENIZER_DIR, load_prepared
from aiayn.errors import AiaynError
from aiayn.evaluation.metrics import STUTTER_N, Scores, score, stutter_share
from aiayn.inference.settings import Search, resolve_search
from aiayn.inference.translator import Translator, TruncationWarning
from aiayn.model import OutputKernel, Transformer
from aiayn.runs.checkpoint import check_unchanged, read_metadata, weights_fingerprint
from aiayn.runs.directory import (
    RUN_FILES,
    check_run_dir,
    load_run_config,
    read_data_dir,
    resolve_weights,
    run_decode,
)
from aiayn.util.device import choose_device
from aiayn.util.io import atomic_write_text, check_output_file
from aiayn.util.threads import default_streams, parallel_map


def translate_and_score(translator: Translator, pairs: Sequence[tuple[str, str]],
                        search: Search | None = None,
                        progress: Callable[[int], object] | None = None,
                        bleu_tokenize: str = "13a") -> tuple[list[str], Scores]:
    """Translate the sources of ``pairs`` with ``search`` (``Translator.resolve``; None: the
    run's) and score them against the targets (BLEU tokenized by ``bleu_tokenize``:
    aiayn.data.prepared.Prepared.bleu_tokenize)."""
    hypotheses = translator.translate([src for src, _ in pairs], search, progress)
    return hypotheses, score(hypotheses, [tgt for _, tgt in pairs], bleu_tokenize)


# ---------------------------------------------------------------- validation during training
def eval_subset(n: int, k: int) -> list[int]:
    """Positions of ``k`` dev pairs spread evenly over all ``n`` (all of them when k is 0)."""
    if k <= 0 or k >= n:
        return list(range(n))
    return sorted({(i * n) // k for i in range(k)})


def dev_loss(model: Transformer, examples: list, config: Config, device: torch.device,
             kernel: OutputKernel | None = None) -> tuple[float, float]:
    """(label-smoothed loss, plain NLL) per real target token, teacher forcing, the output
    layer's product by ``kernel`` (``Transformer.forward``), under bf16 autocast where the
    run trains in bf16 (fp16 runs score in fp32, as `aiayn evaluate` does by default); the
    batches run on parallel streams of one thread each (``aiayn.util.threads``) and are
    summed in order."""
    t, m = config.train, config.model
    smoothing = rate(t.label_smoothing)  # "auto": a run stopped before its trainer chose

    @torch.no_grad()
    def batch_losses(positions) -> tuple[float, float, int]:
        batch = collate([examples[i] for i in positions], m.pad_id,
                        length_multiple(t.use_bf16)).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.use_bf16):
            smoothed = model(batch.src, batch.tgt_in, batch.tgt_out, smoothing, kernel).item()
            nll = (model(batch.src, batch.tgt_in, batch.tgt_out, kernel=kernel).item()
                   if smoothing else smoothed)
        return smoothed, nll, batch.n_tokens

    widths = [max(len(e.src), len(e.tgt)) for e in examples]
    total_ls = total_nll = 0.0
    n = 0
    for ls, nll, tokens in parallel_map(batch_losses, token_batches(widths, t.max_tokens),
                                        default_streams(device)):
        total_ls, total_nll, n = total_ls + ls, total_nll + nll, n + tokens
    return total_ls / n, total_nll / n


def validate(model: Transformer, tokenizers, dev: list[Example], dev_pairs: list[tuple[str, str]],
             config: Config, device: torch.device, full: bool,
             kernel: OutputKernel | None = None) -> dict[str, Any]:
    """Dev loss over the whole dev split; BLEU/chrF over the whole split (``full``) or over
    train.eval_max_sentences pairs spread evenly over it, BLEU tokenized by
    config.data.bleu_tokenize (the caller resolves "auto" for its data:
    aiayn.data.prepared.Prepared.bleu_tokenize; "13a" if it did not). ``select_bleu`` is always the
    BLEU of that fixed subset (``select_chrf`` its chrF), so checkpoints are compared on the
    same sentences (aiayn.training.early_stopping). ``kernel``: the output layer's product
    the caller chose (the Trainer's); None: the Translator chooses one."""
    t = config.train
    bleu_tokenize = "13a" if config.data.bleu_tokenize == "auto" else config.data.bleu_tokenize
    was_training = model.training
    model.eval()
    try:
        loss, nll = dev_loss(model, dev, config, device, kernel)
        subset = eval_subset(len(dev), t.eval_max_sentences)
        chosen = list(range(len(dev))) if full else subset
        pairs = [dev_pairs[dev[i].index] for i in chosen]
        # Decoded in fp32 as `aiayn evaluate` decodes by default, so the BLEU logged here is
        # the one it reports for these weights on every machine (bf16 decoding, which a CPU
        # with AVX512-BF16 or AMX trains in, changes some tokens).
        # Its decoding budget is training's batch budget (train.max_tokens), as it always was.
        translator = Translator(model, tokenizers, device=device, bf16=False,
                                decode=config.decode, decode_tokens=t.max_tokens, kernel=kernel)
        # train.eval_beam (greedy by default), with the run's length penalty, guard and limit
        search = translator.resolve(beam=t.eval_beam)
        with warnings.catch_warnings():  # long dev sources: truncated, as load_data says
            warnings.simplefilter("ignore", TruncationWarning)
            hyps, scores = translate_and_score(translator, pairs, search=search,
                                               bleu_tokenize=bleu_tokenize)
    finally:
        model.train(was_training)
    by_position = dict(zip(chosen, hyps, strict=True))
    sub_hyps = [by_position[i] for i in subset]
    sub_refs = [dev_pairs[dev[i].index][1] for i in subset]
    select = scores if len(chosen) == len(subset) else score(sub_hyps, sub_refs, bleu_tokenize)
    n_show = min(t.num_samples, len(chosen))
    samples = [{"src": pairs[j][0], "ref": pairs[j][1], "hyp": hyps[j]}
               for j in eval_subset(len(chosen), n_show)[:n_show]]
    return {"dev_loss": loss, "dev_nll": nll, "bleu": scores.bleu, "chrf": scores.chrf,
            "bleu_signature": scores.bleu_signature, "n_sentences": len(chosen),
            "select_bleu": select.bleu, "select_chrf": select.chrf, "samples": samples}


def direction_scores(prepared, split: str, hypotheses: Sequence[str],
                     pairs: Sequence[tuple[str, str]], setting: str = "auto") -> dict[str, Any]:
    """Data of several directions (aiayn.data.directions): BLEU and chrF of each on its own
    pairs, BLEU tokenized for its own target language unless ``setting`` (the run's
    data.bleu_tokenize) or the data names one (``Prepared.bleu_tokenize``); {} for one."""
    found = prepared.directions(split, len(pairs))
    if len(found) < 2:
        return {}
    result = {}
    for name, (language, positions) in found.items():
        tokenize = prepared.bleu_tokenize(setting, language)
        scores = score([hypotheses[i] for i in positions], [pairs[i][1] for i in positions],
                       tokenize)
        result[name] = {"sentences": len(positions), "bleu": scores.bleu, "chrf": scores.chrf,
                        "bleu_signature": scores.bleu_signature, "bleu_tokenize": tokenize}
    return result


# ---------------------------------------------------------------- `aiayn evaluate`
def split_loss(model: Transformer, prepared, split: str, limit: int, config: Config,
               device: torch.device, bf16: bool, kernel: OutputKernel | None = None
               ) -> tuple[float, float]:
    """The loss the run's validation logs as "dev_loss" (and its "dev_nll"), for the first
    ``limit`` pairs of ``split``: the same examples (long ones truncated), batches and
    label smoothing, in bf16 only when ``bf16``; so `aiayn evaluate --split dev` of the
    weights a validation saw gives the figure it logged."""
    examples = list(islice(prepared.encoded(split, model.cfg.max_len, "truncate"), limit))
    config = replace(config, train=replace(config.train, precision="bf16" if bf16 else "fp32"))
    return dev_loss(model, examples, config, device, kernel)


def search_name(search: Search) -> str:
    """The search in a file name: "beam1" (greedy: no length penalty), else "beam6.alpha1";
    with the repetition guard ".norepeat3" after it."""
    name = "beam1" if search.beam == 1 else f"beam{search.beam}.alpha{search.alpha:g}"
    guard = search.no_repeat_ngram
    return f"{name}.norepeat{guard}" if guard else name


def _step(weights_file: Path | None) -> int | None:
    """The training step a weights file was saved at, as a number (safetensors metadata
    holds strings; `aiayn info --json` and /info give steps as numbers), or None."""
    step = read_metadata(weights_file).get("step") if weights_file else None
    return int(step) if step is not None and str(step).isdigit() else None


def check_evaluate_output(output: str | Path, run_dir: str | Path, data_dir: Path,
                          weights_file: Path | None) -> None:
    """-o (and the .json of its scores beside it) replaces none of what the evaluation
    reads: the prepared data's files (its splits, stats, ids and tokenizer) or the run's
    (``RUN_FILES``: its config, tokenizer, weights...; its evaluations under eval/ aside,
    which a new evaluation of the same name replaces), or the weights it scores."""
    output = Path(output)
    read = [(data_dir / name, f"the prepared data {data_dir}") for name in
            (*(f"{split}.jsonl" for split in ("train", "dev", "test")), STATS_FILE, IDS_DIR,
             TOKENIZER_DIR)]
    read += [(Path(run_dir) / name, f"the run {run_dir}") for name in RUN_FILES if name != "eval"]
    if weights_file is not None:
        read.append((weights_file, "the weights it scores"))
    for path in (output, output.with_suffix(".json")):
        if not path.exists():
            continue
        where = path.resolve()
        for kept, whose in read:
            if kept.exists() and where.is_relative_to(kept.resolve()):  # it, or inside it
                raise AiaynError(f"-o {output}: {path} is a file of {whose}, which the "
                                 "evaluation reads; writing it would replace it: choose "
                                 "another -o")


def evaluate_run(run_dir: str | Path, split: str = "test", search: Search | None = None,
                 data_dir: str | Path | None = None, weights: str | Path = "best",
                 output: str | Path | None = None, limit: int = 0,
                 decode_tokens: int | None = None, device: str | None = "auto",
                 bf16: bool = False, progress: bool = True, engine: str = "aiayn",
                 int8: bool = False) -> dict[str, Any]:
    """Translate a split of the run's prepared data, write the hypotheses (one per line)
    and a .json of the scores beside them; returns that summary.

    ``search``: the ``Search`` to run (``resolve_search`` over the run's ``decode`` section,
    as `aiayn evaluate` builds it from its flags; None: the run's own, the paper's beam 4,
    alpha 0.6 unless the run says otherwise). ``data_dir``: default the run's
    data_dir.txt. ``output``: default
    RUN_DIR/eval/SPLIT.WEIGHTS.beamK.alphaA.txt (greedy: SPLIT.WEIGHTS.beam1.txt; with a
    repetition guard .norepeatN before .txt: ``search_name``), so searches that differ in
    alpha alone keep their own files. ``limit``: only the first N sentences (0: all; the
    default name then ends .firstN.txt). The summary names the weights by their step and
    the sha256 of their file (``weights_fingerprint``: the model card shows an evaluation
    only for the weights it scored).
    ``decode_tokens``: the decoding budget (``Translator``'s). ``engine="ctranslate2"``:
    ``run_dir`` is an `aiayn export --to ctranslate2` directory, decoded by CTranslate2
    (WEIGHTS in the file name is then "ctranslate2"). ``int8``: aiayn's engine with its decoder
    and output layer in int8 (``aiayn.inference.int8``; WEIGHTS.int8 in the file name, and the loss is
    computed with it). The summary's "repeats" gives the
    share of hypotheses and of references that repeat a 4-gram of words
    (``aiayn.evaluation.metrics.stutter_share``).
    """
    # The search, resolved and checked once, before anything loads.
    search = search or resolve_search(run_decode(run_dir))
    if limit < 0:
        raise AiaynError(f"--limit must be 0 (all) or a positive number of sentences, got {limit}")
    check_run_dir(Path(run_dir))  # before anything is looked for in it
    if output is not None:
        check_output_file(output, "-o")  # the spelling translate and score use
        if Path(output).suffix == ".json":  # the scores go to OUTPUT with .json for its suffix
            raise AiaynError(f"-o {output}: the scores are written to the output's name "
                             "with .json for its suffix, the same file; give the translations "
                             "another suffix (e.g. .txt)")
    translator = Translator.from_pretrained(run_dir, weights, device=choose_device(device),
                                            decode_tokens=decode_tokens, bf16=bf16, engine=engine,
                                            int8=int8)
    own = translator.engine.own_model  # else the engine's name stands for its weights
    # Which weights are scored: hashed as they were loaded, checked again before writing.
    weights_file = resolve_weights(run_dir, weights) if own else None
    fingerprint = weights_fingerprint(weights_file) if weights_file else None
    translator.check(search)  # what the model and the decoding budget can hold
    data_dir = Path(data_dir) if data_dir else read_data_dir(run_dir)
    if output is not None:  # before the split is read: -o must not be one of its files
        check_evaluate_output(output, run_dir, data_dir, weights_file)
    prepared = load_prepared(data_dir)
    pairs = prepared.split(split)
    if limit > 0:
        pairs = pairs[:limit]
    if not pairs:
        raise AiaynError(f"{data_dir}: the {split} split is empty")
    loss = nll = None
    setting = "auto"
    if own:  # scoring given targets needs aiayn's model
        run_config = load_run_config(Path(run_dir), [])
        setting = run_config.data.bleu_tokenize
        loss, nll = split_loss(translator.model, prepared, split, len(pairs), run_config,
                               translator.device, bf16, translator.kernel)
    tokenize = prepared.bleu_tokenize(setting)
    # Into a log (stderr no terminal) a line every 30 s, as training's bar: not ten a second.
    with tqdm(total=len(pairs), unit="sent", dynamic_ncols=True, disable=not progress,
              desc=f"{split} beam {search.beam}",
              mininterval=1 if sys.stderr is not None and sys.stderr.isatty() else 30) as bar:
        hypotheses, scores = translate_and_score(translator, pairs, search, bar.update,
                                                 tokenize)
    speed = translator.last_stats
    directions = direction_scores(prepared, split, hypotheses, pairs, setting)
    weights_name = Path(str(weights)).name.removesuffix(".safetensors") if own else engine
    weights_name += ".int8" if int8 else ""
    first = f".first{limit}" if limit > 0 else ""  # a sample never replaces the whole split
    output = Path(output) if output else (
        Path(run_dir) / "eval" / f"{split}.{weights_name}.{search_name(search)}{first}.txt")
    if weights_file:
        check_unchanged(weights_file, fingerprint)
    atomic_write_text(output, "".join(h + "\n" for h in hypotheses))
    summary = {
        "run_dir": str(run_dir), "data_dir": str(data_dir),
        "weights": str(weights) if own else weights_name,
        "weights_step": _step(weights_file),
        "weights_sha256": fingerprint,
        "split": split, "sentences": len(pairs), "limit": limit, "beam": search.beam, "alpha": search.alpha,
        "no_repeat_ngram": search.no_repeat_ngram,
        "loss": loss, "nll": nll,
        "bleu": scores.bleu, "bleu_signature": scores.bleu_signature, "bleu_tokenize": tokenize,
        "chrf": scores.chrf, "chrf_signature": scores.chrf_signature,
        "cer": scores.cer, "wer": scores.wer, "directions": directions,
        "repeats": {"n": STUTTER_N, "hypotheses": stutter_share(hypotheses),
                    "references": stutter_share([tgt for _, tgt in pairs])},
        "seconds": speed.seconds, "sentences_per_s": speed.sentences_per_s,
        "tokens_per_s": speed.tokens_per_s, "truncated_sources": speed.truncated,
        "threads": torch.get_num_threads(), "device": translator.device.type, "engine": engine,
        "int8": int8,
        "output": str(output), "scores_file": str(output.with_suffix(".json")),
    }
    atomic_write_text(output.with_suffix(".json"), json.dumps(summary, indent=2) + "\n")
    return summary
