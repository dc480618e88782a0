"""Decoding with CTranslate2: the search engine behind `aiayn translate|evaluate --engine
ctranslate2` on a directory written by `aiayn export RUN_DIR --to ctranslate2 OUT_DIR`.

Only the search differs: ``aiayn.inference.translator.Translator`` still tokenizes, truncates, batches
(``aiayn.data.batching.token_batches``), detokenizes and keeps the input order, and
``aiayn.evaluation.evaluate`` scores as always. An export directory holds, beside CTranslate2's
model.bin, config.json and vocabularies, the run's config.yaml (max_len, and the search in
its decode section) and tokenizer/ (no data_dir.txt: an export names no local path, so
``evaluate`` is given the prepared data).

The search follows ``aiayn.inference.search``'s rules where CTranslate2 can: [PAD] and [BOS] are
never generated (``suppress_sequences``), and each sentence gets at most its own limit of
``floor(max_len_a x source length) + max_len_b`` tokens within max_len (CTranslate2 takes
one limit per call: it decodes up to the batch's longest limit, then each sentence is cut
to its own; for greedy search that is exactly aiayn's result).
CTranslate2's length penalty divides by length**alpha rather than GNMT's
((5 + length) / 6)**alpha, so beam search may rank finished hypotheses differently.
The repetition guard is CTranslate2's ``no_repeat_ngram_size``. Sampling is aiayn's own:
CTranslate2's draws (``sampling_topk``...) come from generators of its worker threads,
which its ``set_random_seed`` does not reach, so a seed would not draw the same samples
again.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from aiayn.config import Config, load_config
from aiayn.data.tokenizer import BOS, PAD, Tokenizers
from aiayn.errors import AiaynError, SettingError
from aiayn.inference.engine import Engine
from aiayn.inference.settings import Search
from aiayn.inference.steps import Hypothesis
from aiayn.util.extras import require
from aiayn.util.threads import default_streams

MODEL_FILE = "model.bin"
SAMPLING_REFUSED = ("{sampling} needs aiayn's own model: CTranslate2's sampling cannot be seeded "
                    "(translate the run directory with --engine aiayn)")


def is_ctranslate2_dir(path: str | Path) -> bool:
    """Whether ``path`` looks like a CTranslate2 model directory."""
    return (Path(path) / MODEL_FILE).is_file()


class CTranslate2Engine(Engine):
    """Greedy and beam search by a ``ctranslate2.Translator`` over aiayn's token ids (an
    ``Engine``: whole batches; no sampling). On a CPU, as aiayn's engine, one batch per core
    at once, each on one thread (CTranslate2's ``inter_threads``): two batches at once decoded
    the demo's test split 1.21x (int8) and 1.06x (float32) faster than one batch at a time
    on two threads (2-core AVX2 EPYC: docs/translating.md#device-and-engine)."""

    name = "ctranslate2"
    continuous = False  # CTranslate2 decodes whole batches: serve batches per pass
    own_model = False
    model = None

    def __init__(self, directory: str | Path, tokenizers: Tokenizers, max_len: int,
                 device: str = "cpu", threads: int = 0, compute_type: str = "default"):
        """``threads``: on a CPU the batches decoded at once, one thread each (0: as many as
        torch has threads); on a GPU CTranslate2's intra_threads (0: its default).
        ``compute_type``: "default" runs the saved weight type (e.g. int8) where the device
        supports it."""
        ctranslate2 = require("ctranslate2", "--engine ctranslate2")
        self.device, self.threads = torch.device(device), threads
        if self.device.type == "cpu":  # a worker per stream; CTranslate2 shares the weights
            self.streams = max(1, threads or default_streams(self.device))
            workers = {"inter_threads": self.streams, "intra_threads": 1}
        else:
            self.streams, workers = 1, {"intra_threads": threads}
        before = torch.get_num_threads()
        self.translator = ctranslate2.Translator(str(directory), device=device,
                                                 compute_type=compute_type, **workers)
        # Its constructor sets the calling thread's OpenMP count to intra_threads; torch reads
        # that count (aiayn's streams follow it), so it is given back.
        torch.set_num_threads(before)
        self.max_len = max_len
        self.tokenizers = tokenizers
        self.tgt_vocab_size = tokenizers.tgt_vocab_size
        self.tgt_ids = tokenizers.tgt.get_vocab()  # token string -> id

    @classmethod
    def load(cls, run_dir: str | Path, weights: str | Path = "best",
             device: str | torch.device | None = None, **options):
        """An export directory's engine, tokenizers and config (``load_ctranslate2``), with
        as many threads as torch uses; bf16 is unused (the exported weight type decides).
        ``weights`` other than "best" (the default) and ``int8`` are refused: an export's
        weights and weight type are chosen when it is written, and silently decoding
        others than those asked for would mislead."""
        if str(weights) != "best":
            raise AiaynError(f"--weights {weights}: a CTranslate2 export decodes the weights it "
                             "was written with; choose them when exporting (aiayn export "
                             f"RUN_DIR --to ctranslate2 --weights {weights} OUT_DIR)")
        if options.get("int8"):
            raise AiaynError("--int8 is aiayn's engine's; a CTranslate2 export decodes in the "
                             "weight type it was written with (aiayn export --quantization int8)")
        kind = torch.device(device).type if device is not None else "cpu"
        return load_ctranslate2(run_dir, kind, torch.get_num_threads())

    def supports(self, search: Search) -> None:
        """Sampling is refused (``SAMPLING_REFUSED``)."""
        if search.sampling is not None:
            raise SettingError(SAMPLING_REFUSED)

    def search(self, sources: list[list[int]], search: Search, greedy_ok: bool = False,
               prefixes: list[list[int]] | None = None) -> list[list[Hypothesis]]:
        """``search.no_repeat_ngram`` is CTranslate2's ``no_repeat_ngram_size``, a prefix its
        ``target_prefix``. Its score is CTranslate2's (no per-token log-probabilities)."""
        self.supports(search)
        src = self.tokenizers.src
        # CTranslate2 appends [EOS] itself (config add_source_eos), as aiayn's ids end in one.
        tokens = [[src.id_to_token(i) for i in ids[:-1]] for ids in sources]
        a, b = search.max_len_a, search.max_len_b
        limits = [max(1, min(math.floor(a * len(ids)) + b, self.max_len - 1)) for ids in sources]
        target_prefix = None
        if prefixes is not None and any(prefixes):
            tgt = self.tokenizers.tgt
            target_prefix = [[tgt.id_to_token(i) for i in p] for p in prefixes]
            limits = [max(limit, len(p)) for limit, p in zip(limits, prefixes, strict=True)]
        results = self.translator.translate_batch(
            tokens, beam_size=search.beam, num_hypotheses=search.nbest, length_penalty=search.alpha,
            no_repeat_ngram_size=search.no_repeat_ngram,
            max_decoding_length=max(limits), max_input_length=0, return_scores=True,
            suppress_sequences=[[PAD], [BOS]], target_prefix=target_prefix)
        return [[Hypothesis([self.tgt_ids[t] for t in hyp[:limit]], float(score))
                 for hyp, score in zip(result.hypotheses, result.scores, strict=True)]
                for result, limit in zip(results, limits, strict=True)]


def load_ctranslate2(directory: str | Path, device: str = "cpu", threads: int = 0
                     ) -> tuple[CTranslate2Engine, Tokenizers, Config]:
    """Read an export directory: its search engine, aiayn's tokenizers and the run's config
    (its ``decode`` section is the search a Translator runs when not told)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise AiaynError(f"directory not found: {directory}")
    if not is_ctranslate2_dir(directory):
        raise AiaynError(f"{directory}: no {MODEL_FILE} here; --engine ctranslate2 reads a "
                         "directory written by `aiayn export RUN_DIR --to ctranslate2 OUT_DIR`")
    for piece in ("config.yaml", "tokenizer"):
        if not (directory / piece).exists():
            raise AiaynError(f"{directory}: no {piece} here; was it written by `aiayn export`?")
    config = load_config(directory / "config.yaml")
    tokenizers = Tokenizers.load(directory / "tokenizer")
    search = CTranslate2Engine(directory, tokenizers, config.model.max_len, device, threads)
    return search, tokenizers, config
