"""Scoring given pairs (forced decoding): the log-probability a model gives a target sentence
for a source sentence, teacher-forced, under the very distribution the search draws from, so
that scoring the search's own best translation gives back the search's score.

    >>> t = Translator.from_pretrained("runs/demo")
    >>> [s] = t.score(["In the beginning God created the heavens."],
    ...               ["En el principio creó Dios los cielos."])
    >>> s.score, s.log_prob, len(s.log_probs) == len(s.pieces) + 1
    (-0.41..., -6.2..., True)

Per pair (``PairScore``): the log-probability of each target piece and of the final EOS
(``log_probs``), their sum (``log_prob``), and the ``score`` the search ranks a finished
hypothesis by, log_prob / lp(|Y|), lp the GNMT length penalty of ``search.alpha`` over
|Y| = pieces + EOS (``aiayn.inference.steps.length_penalty``).

The distribution is ``DecoderState.next_logits``'s (aiayn.inference.steps): the output
layer's allowed rows (a restricted ``output_vocab: targets`` layer scores only its pieces),
PAD and BOS at -inf, log_softmax in float32, under bfloat16 autocast where the translator
decodes so. The repetition guard (``search.no_repeat_ngram``) is a rule of the search, not of
the model: it applies only when the search given has it (the CLI's --no-repeat-ngram; off
unless asked). A target piece the model cannot produce (outside a restricted layer, or
banned by the guard) has log-probability -inf, and so have the pair's ``log_prob`` and
``score``: written "-inf" in TSV, null in JSON (``tsv_row``, ``json_row``).

Rules for awkward input:

- Sources are prepared as ``Translator.prepare`` does: one line (line breaks become spaces),
  and ids longer than the model's ``max_len`` keep their first ``max_len - 1`` tokens and EOS.
- A target whose pieces do not fit the decoder's positions (``[BOS]`` + pieces, at most
  ``max_len``) keeps its first ``max_len - 1`` pieces, scored with EOS after them (a low
  score that flags it); a ``PairTruncationWarning`` says how many of each side were cut.
- An empty source or target is scored as it is (a model gives every pair a probability):
  an empty target is the probability of ending at once; an empty source is [EOS] alone.
  Filtering by score then catches such pairs like any other poor pair.

Pairs are cut into batches of similar width (``token_batches``: the longer of source ids and
decoder input, under the translator's ``decode_tokens``) and computed several at once on
the CPU's streams, as the searches are (``aiayn.util.threads.parallel_map``).
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from aiayn.data.batching import pad, token_batches
from aiayn.data.prepared import load_prepared
from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from aiayn.errors import AiaynError
from aiayn.inference.kernels import log_softmax
from aiayn.inference.lines import text_lines
from aiayn.inference.sampling import ban_repeated_ngrams
from aiayn.inference.settings import Search
from aiayn.inference.steps import NEVER_GENERATED, length_penalty
from aiayn.inference.translations import one_line
from aiayn.model import OutputKernel, Transformer
from aiayn.runs.directory import read_data_dir
from aiayn.util.threads import default_streams, parallel_map


class PairTruncationWarning(UserWarning):
    """Some pairs' sources or targets were longer than the model's max_len and were cut."""


@dataclass
class PairScore:
    """One pair's teacher-forced log-probability (see the module docstring)."""

    score: float  # log_prob / length_penalty(len(pieces) + 1, alpha)
    log_prob: float  # the sum of log_probs
    log_probs: list[float]  # per target piece, then EOS
    pieces: list[str]  # the target's pieces (no BOS, no EOS)

    @property
    def tokens(self) -> int:
        """Target pieces + EOS: what ``log_prob`` sums over (``log_prob / tokens``: the mean)."""
        return len(self.log_probs)


# ---------------------------------------------------------------- the model's side
@torch.no_grad()
def target_log_probs(model: Transformer, sources: Sequence[list[int]],
                     targets: Sequence[list[int]], no_repeat_ngram: int = 0,
                     kernel: OutputKernel | None = None) -> list[np.ndarray]:
    """One batch: source ids (tokens + EOS) and target ids (no BOS, no EOS) -> per pair a
    float32 array of len(target) + 1 log-probabilities, of each target id and then EOS,
    each given the source and the target ids before it, as ``DecoderState.next_logits``
    and the searches' ``log_softmax`` compute them (see the module docstring)."""
    device = next(model.parameters()).device
    src = pad(list(sources)).to(device)
    src_pad = model.src_pad_mask(src)
    memory = model.encode(src, src_pad)
    labels = [list(t) + [EOS_ID] for t in targets]
    tgt_in = pad([[BOS_ID] + list(t) for t in targets]).to(device)
    hidden = model.decode(tgt_in, memory, src_pad)  # (B, T, d), causal: padding on the right
    B, T = tgt_in.shape
    autocast = torch.is_autocast_enabled(device.type)
    rows = model.generator.allowed_rows(torch.get_autocast_dtype(device.type) if autocast
                                        else None)
    logits = model.generator.output_logits(hidden.reshape(B * T, -1), rows, kernel).float()
    generator = model.generator
    to_column = generator.positions if generator.restricted else None
    never = [c for c in (to_column[list(NEVER_GENERATED)].tolist() if generator.restricted
                         else NEVER_GENERATED) if c != generator.IGNORE]
    logits[:, never] = float("-inf")
    label_ids = pad(labels, PAD_ID).to(device)  # (B, T): a position's label is the next id
    if no_repeat_ngram:  # position t has the search's history at its step t + 1: t ids
        history, by_position = label_ids.cpu().numpy(), logits.view(B, T, -1)
        lengths = np.array([len(label) for label in labels])
        for t in range(no_repeat_ngram, T):  # (shorter histories hold no n-gram to repeat)
            # Only the pairs that reach position t: past its end a row's history holds PAD,
            # which a restricted layer has no column for.
            rows = torch.from_numpy(np.flatnonzero(lengths > t)).to(device)
            at_t = by_position[rows, t]
            ban_repeated_ngrams(at_t, history[rows.cpu().numpy(), :t], no_repeat_ngram,
                                to_column)
            by_position[rows, t] = at_t
    log_probs = log_softmax(logits, kernel).view(B, T, -1)
    columns = label_ids if to_column is None else to_column[label_ids]
    cannot = columns.eq(generator.IGNORE)  # a piece outside a restricted layer
    picked = log_probs.gather(2, columns.clamp(min=0)[:, :, None]).squeeze(2)
    picked = picked.masked_fill(cannot, float("-inf")).cpu().numpy()
    return [picked[b, :len(labels[b])].copy() for b in range(B)]


# ---------------------------------------------------------------- pairs of text
def score_pairs(translator, sources: Sequence[str], targets: Sequence[str], search: Search,
                progress: Callable[[int], object] | None = None) -> list[PairScore]:
    """``Translator.score``'s work, for a translator holding aiayn's model: each pair's
    ``PairScore`` in input order (see the module docstring); ``progress(n)`` after each
    batch of n pairs."""
    translator.engine.require_model("scoring given pairs")
    for name, given in (("sources", sources), ("targets", targets)):
        if isinstance(given, str):  # iterated, each character would be a sentence
            raise TypeError(f"score() takes lists of sentences; got a str as {name}")
    if len(sources) != len(targets):
        raise ValueError(f"{len(sources)} sources but {len(targets)} targets")
    max_len = translator.max_len
    src_ids, cut_sources = translator.source_ids([one_line(s) for s in sources])
    tokenizers = translator.tokenizers
    tgt_ids = [ids[1:-1] for ids in tokenizers.encode_tgt([one_line(t) for t in targets])] \
        if targets else []
    cut_targets = sum(len(ids) > max_len - 1 for ids in tgt_ids)
    tgt_ids = [ids[:max_len - 1] for ids in tgt_ids]  # [BOS] + pieces fit max_len positions
    if cut_sources or cut_targets:
        warnings.warn(f"{cut_sources} source(s) and {cut_targets} target(s) longer than the "
                      f"model's max_len={max_len} tokens were truncated to their first "
                      f"{max_len - 1} tokens", PairTruncationWarning, stacklevel=3)
    return score_ids(translator, src_ids, tgt_ids, search, progress)


def score_ids(translator, sources: Sequence[list[int]], targets: Sequence[list[int]],
              search: Search, progress: Callable[[int], object] | None = None
              ) -> list[PairScore]:
    """``score_pairs`` on ids: source ids (tokens + EOS, at most ``max_len``) and target ids
    (no BOS or EOS, at most ``max_len - 1``), e.g. a search's own hypotheses (a hypothesis's
    pieces need not be what the tokenizer makes of its text, and text scores the latter)."""
    model, kernel = translator.model, translator.kernel
    widths = [max(len(s), len(t) + 1) for s, t in zip(sources, targets, strict=True)]
    batches = token_batches(widths, translator.decode_tokens)
    bf16 = getattr(translator.engine, "bf16", False)

    def one(batch: np.ndarray) -> list[np.ndarray]:
        autocast = (torch.autocast(translator.device.type, dtype=torch.bfloat16) if bf16
                    else nullcontext())
        with autocast:
            return target_log_probs(model, [sources[i] for i in batch],
                                    [targets[i] for i in batch], search.no_repeat_ngram,
                                    kernel)

    streams = translator.streams or default_streams(translator.device)
    results: list[PairScore | None] = [None] * len(sources)
    piece = translator.tokenizers.tgt_id_to_token
    for batch, arrays in zip(batches, parallel_map(one, batches, streams), strict=True):
        for i, values in zip(batch, arrays, strict=True):
            results[i] = pair_score(values, [piece(t) for t in targets[i]], search.alpha)
        if progress is not None:
            progress(len(batch))
    return results


def pair_score(log_probs: np.ndarray, pieces: list[str], alpha: float) -> PairScore:
    """A ``PairScore`` from the log-probabilities of the pieces and EOS: their sum (in float64)
    and that over the length penalty, as ``decode_beam`` scores a finished hypothesis."""
    total = float(np.sum(log_probs, dtype=np.float64))
    return PairScore(total / length_penalty(len(log_probs), alpha), total,
                     [float(v) for v in log_probs], pieces)


# ---------------------------------------------------------------- output rows
def tsv_row(s: PairScore) -> str:
    """'SCORE<TAB>LOG_PROB<TAB>TOKENS\\n' (TOKENS: target pieces + EOS, what LOG_PROB sums
    over); a pair the model cannot produce has SCORE and LOG_PROB "-inf"."""
    return f"{_number(s.score)}\t{_number(s.log_prob)}\t{s.tokens}\n"


def json_row(s: PairScore) -> str:
    """One JSON object per line: score, log_prob, pieces and log_probs (one per piece, then
    EOS's); -inf (which JSON cannot hold) is written null."""
    return json.dumps({"score": _finite(s.score, 4), "log_prob": _finite(s.log_prob, 4),
                       "pieces": s.pieces,
                       "log_probs": [_finite(v, 5) for v in s.log_probs]},
                      ensure_ascii=False) + "\n"


def _number(value: float) -> str:
    return f"{value:.4f}" if math.isfinite(value) else "-inf"


def _finite(value: float, digits: int) -> float | None:
    return round(value, digits) if math.isfinite(value) else None


def score_lines(translator, sources: Sequence[str], targets: Sequence[str], search: Search,
                as_json: bool = False, chunk: int = 2000,
                progress: Callable[[int], object] | None = None) -> Iterator[str]:
    """`aiayn score`'s output, ``chunk`` pairs at a time: one ``tsv_row`` (or with ``as_json``
    one ``json_row``) per pair, in input order."""
    row = json_row if as_json else tsv_row
    for start in range(0, len(sources), chunk):
        scores = translator.score(sources[start:start + chunk], targets[start:start + chunk],
                                  search, progress)
        yield "".join(map(row, scores))


# ---------------------------------------------------------------- `aiayn score`'s input
def read_lines(path: str | Path, option: str) -> list[str]:
    """Lines of a UTF-8 file ("-": stdin, as `paste src tgt | aiayn score RUN -i -` sends
    them), by `aiayn translate`'s rules: lines end at "\\n" only (a trailing "\\r" goes), a
    byte-order mark at the start is dropped (``files.text_lines``)."""
    if str(path) == "-":
        return text_lines(sys.stdin.buffer.read(), f"{option} - (stdin)")
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise AiaynError(f"{option} {path}: file not found") from None
    except IsADirectoryError:
        raise AiaynError(f"{option} {path}: is a directory, not a file") from None
    return text_lines(data, f"{option} {path}")


def read_tsv_pairs(path: str | Path, option: str = "-i") -> tuple[list[str], list[str]]:
    """Sources and targets of a file of 'SOURCE<TAB>TARGET' lines; a line without exactly one
    tab is an AiaynError naming it."""
    sources, targets = [], []
    for number, line in enumerate(read_lines(path, option), 1):
        fields = line.split("\t")
        if len(fields) != 2:
            raise AiaynError(f"{option} {path}, line {number}: {len(fields) - 1} tabs; each line "
                             "is one pair, SOURCE<TAB>TARGET (one tab)")
        sources.append(fields[0])
        targets.append(fields[1])
    return sources, targets


def read_file_pairs(source: str | Path, target: str | Path) -> tuple[list[str], list[str]]:
    """Line i of ``source`` paired with line i of ``target``: they must have as many lines."""
    if str(source) == str(target) == "-":
        raise AiaynError("--source - and --target - would both read stdin: give one of them "
                         "as a file, or the pairs as SOURCE<TAB>TARGET lines with -i -")
    sources, targets = read_lines(source, "--source"), read_lines(target, "--target")
    if len(sources) != len(targets):
        raise AiaynError(f"--source {source} has {len(sources)} lines but --target {target} has "
                         f"{len(targets)}; line i of one pairs with line i of the other")
    return sources, targets


def read_split_pairs(run_dir: str | Path, split: str, data_dir: str | Path | None = None
                     ) -> tuple[list[str], list[str]]:
    """The pairs of a prepared split (``data_dir``: default the run's, data_dir.txt)."""
    prepared = load_prepared(data_dir or read_data_dir(run_dir), log=lambda _: None)
    pairs = prepared.split(split)
    return [p[0] for p in pairs], [p[1] for p in pairs]
