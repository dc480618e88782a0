"""Helpers shared by the benchmarks: their options, the device and its load, realistic
batches, interleaved timing, tables.

The machine these benchmarks run on is usually shared, so a single timing means little.
Every comparison here is A/B *interleaved*: in each repetition the contenders run one after
the other (the order alternating between repetitions, so a slow drift of the background
load hits both alike), and the reported figure is the median over repetitions, together
with the ratio between contenders, which is what the benchmarks claim.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from aiayn.data.batching import token_batches
from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from aiayn.util.device import cpu_model  # noqa: F401  (the benchmarks name their CPU with it)

FIRST_REAL_ID = 4  # ids below are [PAD] [UNK] [BOS] [EOS] (docs/interfaces.md)

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- options
# The options several scripts take, defined once so that they read and default alike.


def script_parser(doc: str) -> argparse.ArgumentParser:
    """A script's parser, described by the first paragraph of its docstring."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0])


def add_run_options(p: argparse.ArgumentParser, required: bool = True,
                    split: bool = True) -> None:
    """--run-dir and --weights (a trained run, read only); with ``split``, --split and
    --limit: which sentences of its prepared data (``run_pairs``)."""
    p.add_argument("--run-dir", required=required,
                   help="a trained run (read only)" if required else
                   "use this trained run (and its test split) instead")
    p.add_argument("--weights", default="best")
    if split:
        p.add_argument("--split", default="test", choices=["test", "dev"])
        p.add_argument("--limit", type=int, default=0,
                       help="only the first N sentences (0: all)")


def add_search_options(p: argparse.ArgumentParser, alpha: bool = True) -> None:
    """--beam, --alpha and --decode-tokens, at the paper's search and aiayn's CPU budget."""
    p.add_argument("--beam", type=int, default=4)
    if alpha:
        p.add_argument("--alpha", type=float, default=0.6)
    p.add_argument("--decode-tokens", type=int, default=8192,
                   help="decoding budget: padded source tokens x beam of a batch")


def add_threads_option(p: argparse.ArgumentParser, default: int = 0,
                       help: str = "torch threads (0: torch's default)") -> None:
    p.add_argument("--threads", type=int, default=default, help=help)


def add_repeats_option(p: argparse.ArgumentParser, default: int, flag: str = "--repeats",
                       help: str = "interleaved repetitions (the figures are their median)"
                       ) -> None:
    p.add_argument(flag, type=int, default=default, help=help)


def add_json_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH",
                   help="also write the table as JSON (headers, rows, conditions) to PATH")


def run_pairs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The (source, reference) pairs of ``args.split`` of the run's prepared data, the first
    ``args.limit`` of them where it is set."""
    from aiayn.data.prepared import load_prepared
    from aiayn.runs.directory import read_data_dir

    pairs = load_prepared(read_data_dir(args.run_dir)).split(args.split)
    return pairs[: args.limit] if args.limit > 0 else pairs


def set_threads(threads: int) -> None:
    """torch's intra-op threads; 0 leaves torch's default."""
    if threads:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------- the device


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def device_description() -> str:
    """One line naming what the numbers were measured on."""
    flags = cpu_flags()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return (
        f"{cpu_model()}, {os.cpu_count()} logical CPUs, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads, capability {torch.backends.cpu.get_cpu_capability()}), "
        f"flags: {' '.join(isa) or 'n/a'}"
    )


def git_commit() -> str:
    """The checkout's short commit, for a result's provenance ("unknown" outside git)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def load_average() -> float:
    """The machine's load average over the last minute (0 where the system has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def note_load(quiet_below: float = 0.5) -> float:
    """Print the load average before timing, with a word on what a busy machine does to the
    figures; returns it, for the conditions of the results."""
    load = load_average()
    print(f"load average (1 min) before: {load:.2f} on {os.cpu_count()} CPUs", flush=True)
    if load > quiet_below:
        print("  note: other processes are running. With 2 OpenMP threads a busy CPU slows "
              "small ops far more than matmuls; compare ratios, rerun on a quiet machine, "
              "or try --threads 1.", flush=True)
    return load


# --------------------------------------------------------------------------- batches


@dataclass
class Batch:
    """Padded source and target ids, shaped as aiayn.data.batching.collate makes them.

    src: (B, S) ``tokens + [EOS]``; tgt_in: (B, T) ``[BOS] + tokens``; tgt_out: (B, T)
    ``tokens + [EOS]``; n_tokens: real (non-pad) target tokens, the unit of throughput.
    """

    src: Tensor
    tgt_in: Tensor
    tgt_out: Tensor
    n_tokens: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """(B, S, T)."""
        return self.src.size(0), self.src.size(1), self.tgt_in.size(1)

    @property
    def padding(self) -> float:
        """Fraction of pad positions over both sides."""
        total = self.src.numel() + self.tgt_out.numel()
        real = int(self.src.ne(PAD_ID).sum()) + self.n_tokens
        return 1.0 - real / total


def sentence_lengths(
    n: int, mean: float = 30.0, sigma: float = 0.6, max_len: int = 256, seed: int = 0
) -> list[tuple[int, int]]:
    """(source, target) lengths in tokens, special tokens included, like translation data.

    Source lengths are lognormal with the given mean (sigma 0.6: median ~25, a long right
    tail, ~1% above 100 tokens, as BPE-tokenised WMT/Europarl sentences are); the target
    length is the source length times a lognormal ratio (sigma 0.15), because translations
    of one sentence have correlated lengths. Both are clipped to [3, max_len - 1].
    """
    g = torch.Generator().manual_seed(seed)
    mu = math.log(mean) - sigma**2 / 2  # E[lognormal(mu, sigma)] = exp(mu + sigma^2 / 2)
    src = torch.exp(mu + sigma * torch.randn(n, generator=g))
    tgt = src * torch.exp(0.15 * torch.randn(n, generator=g))
    clip = lambda x: x.round().clamp(3, max_len - 1).long().tolist()  # noqa: E731
    return list(zip(clip(src), clip(tgt), strict=True))


def bucket(lengths: list[tuple[int, int]], max_tokens: int) -> list[list[tuple[int, int]]]:
    """Length-sorted token-budget buckets of (source, target) lengths: the groups that
    ``aiayn.data.batching.token_batches`` (the package's one batcher) makes of them, ordered as the
    training sampler orders them. On a corpus-sized pool (~1e5 pairs) this leaves a few
    percent of padding, as real loaders do.
    """
    widths = [max(s, t) for s, t in lengths]
    groups = token_batches(widths, max_tokens, order_key=[t - s for s, t in lengths])
    return [[lengths[i] for i in group] for group in groups]


def padding_fraction(groups: list[list[tuple[int, int]]]) -> float:
    """Fraction of pad positions over all groups, both sides (target counted as input)."""
    total = sum(len(g) * (max(s for s, _ in g) + max(t for _, t in g) - 1) for g in groups)
    real = sum(s + t - 1 for g in groups for s, t in g)
    return 1.0 - real / total


def make_batch(pairs: list[tuple[int, int]], vocab_size: int, seed: int = 0) -> Batch:
    """A padded batch of random ids with these (source, target) lengths.

    Lengths count the special tokens: a source of length s is ``s - 1`` tokens + [EOS], a
    target of length t is [BOS] + ``t - 2`` tokens + [EOS]. Token ids are uniform over the
    non-special vocabulary: speed does not depend on which ids they are.
    """
    g = torch.Generator().manual_seed(seed)
    B = len(pairs)
    S = max(s for s, _ in pairs)
    T = max(t for _, t in pairs) - 1  # the decoder input drops the last position
    src = torch.full((B, S), PAD_ID, dtype=torch.long)
    tgt = torch.full((B, T + 1), PAD_ID, dtype=torch.long)
    for b, (s, t) in enumerate(pairs):
        src[b, : s - 1] = torch.randint(FIRST_REAL_ID, vocab_size, (s - 1,), generator=g)
        src[b, s - 1] = EOS_ID
        tgt[b, 0] = BOS_ID
        tgt[b, 1 : t - 1] = torch.randint(FIRST_REAL_ID, vocab_size, (t - 2,), generator=g)
        tgt[b, t - 1] = EOS_ID
    tgt_in, tgt_out = tgt[:, :-1].contiguous(), tgt[:, 1:].contiguous()
    return Batch(src, tgt_in, tgt_out, int(tgt_out.ne(PAD_ID).sum()))


def representative(batches: list, k: int) -> list:
    """k batches at evenly spaced quantiles of the length-sorted list (short to long).

    Timing every batch of an epoch takes too long; k quantile picks keep the mix of
    short-and-wide and long-and-narrow batches that an epoch has.
    """
    if k >= len(batches):
        return list(batches)
    return [batches[int((i + 0.5) * len(batches) / k)] for i in range(k)]


# --------------------------------------------------------------------------- timing


def timed(fn: Callable[[], object]) -> float:
    """Wall-clock seconds of one call."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleave(
    contenders: dict[str, Callable[[], object] | list[Callable[[], object]]],
    reps: int,
    warmup: int = 1,
) -> dict[str, list[list[float]]]:
    """Run each contender ``reps`` times, interleaved; return the seconds of every run.

    A contender is a callable or a list of k callables (e.g. one training step per batch);
    all lists have the same length k. Within a repetition, item i of every contender runs
    before item i + 1 of any, so contenders alternate at the finest grain and a change in
    the machine's background load hits them alike. The order of the contenders alternates
    (A B, B A, A B, ...) so that none always runs right after another warmed the caches.
    ``warmup`` untimed runs of every contender's first item come first (allocator, oneDNN
    primitive caches, optimizer state). Returns ``times[name][rep][item]`` in seconds.
    """
    lists = {n: c if isinstance(c, list) else [c] for n, c in contenders.items()}
    k = {len(c) for c in lists.values()}
    if len(k) != 1:
        raise ValueError(f"contenders have different numbers of items: {k}")
    names, n_items = list(lists), k.pop()
    for _ in range(warmup):
        for items in lists.values():
            items[0]()
    times: dict[str, list[list[float]]] = {name: [] for name in names}
    flip = False
    for _ in range(reps):
        for name in names:
            times[name].append([0.0] * n_items)
        for i in range(n_items):
            for name in reversed(names) if flip else names:
                times[name][-1][i] = timed(lists[name][i])
            flip = not flip
    return times


def typical_total(runs: list[list[float]]) -> float:
    """Seconds of one pass over all items: the sum over items of each item's median.

    Taking the median per item (over repetitions) before summing discards a repetition's
    outlier item without discarding the whole repetition.
    """
    return sum(median([rep[i] for rep in runs]) for i in range(len(runs[0])))


def paired_ratios(slow: list[list[float]], fast: list[list[float]]) -> list[float]:
    """Per-repetition time ratios slow / fast, from runs interleaved item by item."""
    return [sum(s) / sum(f) for s, f in zip(slow, fast, strict=True)]


def median(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float]) -> str:
    """Relative half-range around the median, e.g. '±4%', to show how noisy a row was."""
    m = median(values)
    if len(values) < 2 or m == 0:
        return "n/a"
    return f"±{100 * (max(values) - min(values)) / (2 * m):.0f}%"


def matmul_flops_per_s(n: int, dtype: torch.dtype, reps: int = 3) -> float:
    """Best-of-``reps`` FLOP/s of an (n x n) @ (n x n) matmul: the achievable peak here."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    a @ b  # warm-up
    return 2 * n**3 / min(timed(lambda: a @ b) for _ in range(reps))


# --------------------------------------------------------------------------- output


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured markdown table; numbers are right-aligned."""
    align = ["---" if i == 0 else "---:" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def print_table(headers: list[str], rows: list[list[str]], conditions: str,
                json_path: str | None = None) -> None:
    """Print a script's result: its conditions, then the table; with ``json_path`` (the
    script's --json) also write both there, with the device, as JSON."""
    print(conditions)
    print()
    print(markdown_table(headers, rows))
    if json_path:
        record = {"conditions": conditions, "device": device_description(),
                  "headers": headers, "rows": rows}
        Path(json_path).write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n",
                                   encoding="utf-8")
