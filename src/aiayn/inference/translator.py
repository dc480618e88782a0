"""The one decode driver: the ``Translator``, behind `aiayn translate`, `aiayn evaluate`,
the validation during training (``aiayn.evaluation.evaluate``) and attention pictures.

    >>> from aiayn.inference.translator import Translator
    >>> t = Translator.from_pretrained("runs/demo")           # best.safetensors
    >>> t.translate(["The Lord is my shepherd."])      # the run's search (config.yaml's decode)
    ['El Señor es mi pastor.']
    >>> t.translate(["The Lord is my shepherd."], beam=4, alpha=0.6)   # the paper's (6.1)
    ['El Señor es mi pastor.']
    >>> t.translate(["The Lord is my shepherd."], no_repeat_ngram=3)   # no 3-gram twice
    ['El Señor es mi pastor.']
    >>> t.translate_nbest(["The Lord is my shepherd."], nbest=3,      # 3 samples each
    ...                   sampling=Sampling(temperature=0.8, top_p=0.9, seed=1))

Behind ``translate`` the sentences are tokenized, sorted by length, cut into batches of at
most ``max_tokens`` padded source tokens x beam (``aiayn.data.batching.token_batches``; fewer
sentences than fill a batch per stream are cut into about one batch per stream), decoded
with the KV cache (``aiayn.inference.search``) on one CPU thread per batch, several batches at once
(``aiayn.util.threads.parallel_map``: a busy core then slows one stream, not every op), and put
back in their input order.

Rules for awkward input (never a crash):

- An empty (or all-whitespace) sentence is not decoded; its translation is ``""``.
- A sentence whose source ids (tokens + EOS) are longer than the model's ``max_len`` keeps
  its first ``max_len - 1`` tokens and its EOS; a ``TruncationWarning`` says how many were
  cut. (The output is limited by the same ``max_len``.)
"""

from __future__ import annotations

import math
import secrets
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from itertools import islice
from pathlib import Path

import torch

from aiayn.config import DecodeConfig, alignment_layer_index
from aiayn.data.batching import pad, token_batches
from aiayn.data.tokenizer import EOS_ID
from aiayn.errors import AiaynError, is_out_of_memory
from aiayn.inference.align import Alignment, pharaoh, piece_words, text_words, word_alignment
from aiayn.inference.attention import SentenceAttention, cross_attention, sentence_attention
from aiayn.inference.budget import (
    CPU_MAX_TOKENS,
    decode_bytes_per_token,
    default_max_tokens,
    memory_bytes,
    stream_budget,
)
from aiayn.inference.kernels import choose_output_kernel
from aiayn.inference.search import (
    Hypothesis,
    Sampling,
    Search,
    beam_search,
    greedy_decode,
    next_distribution,
)
from aiayn.model import OutputKernel, Transformer
from aiayn.runs.directory import load_run
from aiayn.util.device import parameter_device
from aiayn.util.threads import default_streams, on_one_thread, parallel_map

# Rows of a decoding step the output layer's kernel is chosen for (aiayn.inference.kernels): a beam
# of 4-6 over the ~50 sentences of an 8,192-token batch.
DECODE_PROBE_ROWS = 256


ENGINES = ("aiayn", "ctranslate2")  # who searches: aiayn.inference.search, or aiayn.inference.ct2


class TruncationWarning(UserWarning):
    """Some input sentences were longer than the model's max_len and were truncated."""


# ---------------------------------------------------------------- search settings, sources
MAX_NO_REPEAT_NGRAM = 64  # as config.RANGES["decode"]["no_repeat_ngram"]


MAX_SAMPLES = 64  # samples per sentence, as the widest beam decode.beam allows


MAX_TEMPERATURE = 100.0


def check_search(beam: int | None, nbest: int = 1, alpha: float | None = None,
                 no_repeat_ngram: int | None = None, sampling: Sampling | None = None) -> None:
    """The one check of the search settings that needs no model (an AiaynError names the
    option); ``Translator.check_limits`` adds the bounds the model and memory set. None (not
    given: the run's ``decode`` section will say) passes; nbest is then checked against the
    run's beam, once it is loaded. With ``sampling``, nbest is the samples per sentence and
    a beam may not be given."""
    if sampling is not None:
        if beam is not None:
            raise AiaynError("--beam is for beam search; --sample draws --nbest samples per "
                             "sentence instead")
        check_sampling(sampling)
        if not 1 <= nbest <= MAX_SAMPLES:
            raise AiaynError(f"--nbest (samples per sentence with --sample) must be between 1 "
                             f"and {MAX_SAMPLES}, got {nbest}")
    if beam is not None and beam < 1:
        raise AiaynError(f"--beam must be at least 1, got {beam}")
    if sampling is None and (nbest < 1 or (beam is not None and nbest > beam)):
        top = "the beam" if beam is None else f"the beam ({beam})"
        raise AiaynError(f"--nbest must be between 1 and {top}, got {nbest}")
    if alpha is not None and not (math.isfinite(alpha) and 0 <= alpha <= 10):
        raise AiaynError(f"--alpha must be in [0, 10], got {alpha}")
    if no_repeat_ngram is not None and not 0 <= no_repeat_ngram <= MAX_NO_REPEAT_NGRAM:
        raise AiaynError(f"--no-repeat-ngram must be between 0 (off) and {MAX_NO_REPEAT_NGRAM}, "
                         f"got {no_repeat_ngram}")


def check_sampling(sampling: Sampling) -> None:
    """Settings a sample can be drawn with, or an AiaynError naming the option."""
    t = sampling.temperature
    if not (math.isfinite(t) and 0 < t <= MAX_TEMPERATURE):
        raise AiaynError(f"--temperature must be in (0, {MAX_TEMPERATURE:g}] (towards 0: "
                         f"greedy search), got {t}")
    if sampling.top_k < 0:
        raise AiaynError(f"--top-k must be 0 (every piece) or more, got {sampling.top_k}")
    if not (math.isfinite(sampling.top_p) and 0 < sampling.top_p <= 1):
        raise AiaynError(f"--top-p must be in (0, 1], got {sampling.top_p}")
    if sampling.seed is not None and not 0 <= sampling.seed < 2 ** 63:
        raise AiaynError(f"--seed must be between 0 and 2**63 - 1, got {sampling.seed}")


def seeded(sampling: Sampling | None) -> Sampling | None:
    """``sampling`` with a seed: its own, else a random one (reported with the results, so
    that they can be drawn again)."""
    if sampling is None or sampling.seed is not None:
        return sampling
    return replace(sampling, seed=secrets.randbits(31))


def truncate_source(ids: list[int], max_len: int) -> list[int]:
    """The documented rule: keep the first ``max_len - 1`` tokens and end with EOS."""
    if len(ids) <= max_len:
        return ids
    return ids[: max_len - 1] + [EOS_ID]


def truncation_message(count: int, max_len: int) -> str:
    """What a ``TruncationWarning`` says (and `aiayn serve` answers) about ``count`` cut."""
    return (f"{count} sentence(s) longer than the model's max_len={max_len} tokens "
            f"were truncated to their first {max_len - 1} tokens")


@dataclass
class Sources:
    """Sentences made ready to decode (``Translator.prepare``): the positions of the
    non-empty ones, their source ids (truncated by the module's rule) and how many were
    cut; ``Translator.finish`` puts their hypotheses back in the input order."""

    count: int  # sentences given, empty ones included
    todo: list[int]  # positions of the non-empty sentences
    ids: list[list[int]]  # their source ids, tokens + EOS
    truncated: int
    texts: list[str] = field(default_factory=list)  # the non-empty sentences, one line each

    @property
    def tokens(self) -> int:
        return sum(len(ids) for ids in self.ids)


@dataclass
class DecodeStats:
    """What one decoding pass did: for `aiayn evaluate`'s speed line."""

    sentences: int = 0  # sentences decoded (empty ones excluded)
    output_tokens: int = 0  # tokens of the best hypotheses, EOS excluded
    seconds: float = 0.0
    truncated: int = 0

    @property
    def sentences_per_s(self) -> float:
        return self.sentences / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


# ---------------------------------------------------------------- the translator
class Translator:
    """A model and its tokenizers, translating lists of sentences in length-sorted batches."""

    def __init__(self, model: Transformer | None, tokenizers, max_tokens: int | None = None,
                 device: str | torch.device | None = None, bf16: bool = False, engine=None,
                 streams: int | None = None, threads_per_stream: int = 1,
                 decode: DecodeConfig | None = None, kernel: OutputKernel | None = None):
        """``max_tokens``: batch budget in padded source tokens x beam (``token_batches``;
        None: ``default_max_tokens`` of the device, 8,192 on a CPU);
        ``bf16``: decode under bfloat16 autocast (as training validates under train.bf16).
        ``streams``: batches decoded at once, each on one CPU thread (``aiayn.util.threads``;
        None: ``default_streams``, as many as torch has threads when decoding starts);
        ``threads_per_stream`` > 1 only to measure the barriers that one thread avoids.
        ``engine``: search with this instead of ``model`` (None then), e.g. an
        ``aiayn.inference.ct2.CTranslate2Search``: it has ``max_len``, ``device`` and
        ``search(sources, search: Search, nbest, max_len_b) -> list[list[Hypothesis]]``.
        ``decode``: the search that a beam or alpha of None means (the run's config section;
        default the paper's beam 4, alpha 0.6). ``kernel``: the output layer's product
        (``aiayn.inference.kernels``: a Trainer's choice for its model); None: chosen here.
        The searches compute with ``self.kernel``."""
        self.engine, self.kernel = engine, kernel
        self.decode = decode or DecodeConfig()
        if engine is not None:
            self.device, self.model, self.max_len = torch.device(engine.device), None, engine.max_len
            max_tokens = CPU_MAX_TOKENS if max_tokens is None else max_tokens
        else:
            self.device = torch.device(device) if device is not None else parameter_device(model)
            if max_tokens is None:
                max_tokens = default_max_tokens(model.cfg, self.device)
            # The batch budget a decoding pass can hold in half of the device's memory.
            limit = memory_bytes(self.device) // 2 // decode_bytes_per_token(model.cfg)
            where = "the GPU's free memory" if self.device.type == "cuda" else \
                "this machine's memory"
            if not 1 <= max_tokens <= limit:
                raise AiaynError(f"--max-tokens must be between 1 and {limit} for this model "
                                 f"(half of {where} at "
                                 f"{decode_bytes_per_token(model.cfg)} bytes per padded "
                                 f"token), got {max_tokens}")
            self.model = model.to(self.device).eval()
            if kernel is None:  # not chosen yet (a Trainer chooses for its own)
                self.kernel = choose_output_kernel(model.generator, DECODE_PROBE_ROWS,
                                                   enabled=not bf16)[0]
            self.max_len = model.cfg.max_len
        self.tokenizers = tokenizers
        self.max_tokens = max_tokens
        self.bf16 = bf16
        self.streams, self.threads_per_stream = streams, threads_per_stream
        self.last_stats = DecodeStats()

    @classmethod
    def from_pretrained(cls, run_dir: str | Path, weights: str | Path = "best",
                        device: str | torch.device | None = None, engine: str = "aiayn",
                        **kwargs) -> Translator:
        """Load ``run_dir`` (see ``load_run``); ``device`` defaults to the CPU.

        ``engine="ctranslate2"``: ``run_dir`` is a directory written by `aiayn export --to
        ctranslate2` (``weights`` is then unused), decoded by CTranslate2 with as many
        threads as torch uses.
        """
        if engine not in ENGINES:
            raise AiaynError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        if engine == "ctranslate2":
            from aiayn.inference.ct2 import load_ctranslate2

            kind = torch.device(device).type if device is not None else "cpu"
            search, tokenizers, config = load_ctranslate2(run_dir, kind, torch.get_num_threads())
            kwargs.pop("bf16", None)  # the exported weight type decides
            kwargs.setdefault("decode", config.decode)
            return cls(None, tokenizers, engine=search, **kwargs)
        if (Path(run_dir) / "model.bin").is_file() and not any(Path(run_dir).glob("*.safetensors")):
            raise AiaynError(f"{run_dir}: a CTranslate2 export, not a run directory; "
                             "`aiayn translate|evaluate` read it with --engine ctranslate2")
        config, model, tokenizers = load_run(run_dir, weights)
        kwargs.setdefault("decode", config.decode)
        return cls(model, tokenizers, device=device or "cpu", **kwargs)

    def search(self, beam: int | None = None, alpha: float | None = None) -> tuple[int, float]:
        """The beam and alpha to decode with: those given, else ``self.decode``'s (the run's
        ``decode`` section). Every method below takes None to mean this."""
        return (self.decode.beam if beam is None else beam,
                self.decode.alpha if alpha is None else alpha)

    def settings(self, beam: int | None = None, alpha: float | None = None,
                 no_repeat_ngram: int | None = None, sampling: Sampling | None = None,
                 nbest: int = 1) -> Search:
        """Every setting of the search to run, as one value: ``search``'s beam and alpha,
        the run's ``decode.no_repeat_ngram`` unless given, and with ``sampling`` (seeded:
        ``seeded``) ``nbest`` rows per sentence in place of the beam."""
        beam, alpha = self.search(beam, alpha)
        guard = self.decode.no_repeat_ngram if no_repeat_ngram is None else no_repeat_ngram
        if sampling is not None:
            return Search(nbest, alpha, guard, seeded(sampling))
        return Search(beam, alpha, guard)

    def translate(self, sentences: Sequence[str], beam: int | None = None,
                  alpha: float | None = None, max_len_b: int = 50,
                  progress: Callable[[int], object] | None = None,
                  no_repeat_ngram: int | None = None, sampling: Sampling | None = None
                  ) -> list[str]:
        """One translation per sentence, in input order (``beam=1``: greedy search).
        ``no_repeat_ngram``: the repetition guard (None: the run's decode.no_repeat_ngram);
        ``sampling``: one sample per sentence instead of the search (``aiayn.inference.search``)."""
        hyps = self._translate(sentences, beam, alpha, 1, max_len_b, progress, scored=False,
                               no_repeat_ngram=no_repeat_ngram, sampling=sampling)
        return [h[0][0] if h else "" for h in hyps]

    def translate_nbest(self, sentences: Sequence[str], beam: int | None = None,
                        alpha: float | None = None, nbest: int = 1, max_len_b: int = 50,
                        progress: Callable[[int], object] | None = None,
                        no_repeat_ngram: int | None = None, sampling: Sampling | None = None
                        ) -> list[list[tuple[str, float]]]:
        """Up to ``nbest`` (translation, score) pairs per sentence, best first (with
        ``sampling``: ``nbest`` samples, best first).

        The score is the length-normalised log-probability (see ``aiayn.inference.search``); an empty
        sentence gets an empty list.
        """
        return self._translate(sentences, beam, alpha, nbest, max_len_b, progress, scored=True,
                               no_repeat_ngram=no_repeat_ngram, sampling=sampling)

    def translate_aligned(self, sentences: Sequence[str], beam: int | None = None,
                          alpha: float | None = None, max_len_b: int = 50,
                          progress: Callable[[int], object] | None = None,
                          no_repeat_ngram: int | None = None) -> list[tuple[str, Alignment]]:
        """One (translation, word alignment) per sentence, in input order: the alignment
        links each word of the translation to a word of the sentence, (i, j) pairs of
        ``sentence.split()[i]`` and ``translation.split()[j]`` (``aiayn.inference.align``; write them
        with ``aiayn.inference.align.pharaoh``). An empty sentence gives ("", [])."""
        hyps = self._translate(sentences, beam, alpha, 1, max_len_b, progress, scored=False,
                               no_repeat_ngram=no_repeat_ngram, aligned=True)
        return [(h[0][0], h[0][2]) if h else ("", []) for h in hyps]

    def _translate(self, sentences, beam, alpha, nbest, max_len_b, progress, scored,
                   no_repeat_ngram=None, sampling=None, aligned=False):
        """Tokenize the non-empty sentences, decode them, detokenize, keep the input order.

        ``progress(n)`` is called after each batch with its number of sentences (e.g. a
        tqdm bar's ``update``); ``self.last_stats`` describes the pass afterwards.
        ``aligned``: each (text, score) gets its word alignment as a third item.
        """
        if aligned:
            self.check_alignments()
        self.check_limits(beam, nbest, alpha, no_repeat_ngram, sampling)
        sampling = seeded(sampling)  # one seed for every batch of the pass
        sources = self.prepare(sentences)
        if sources.truncated:
            warnings.warn(truncation_message(sources.truncated, self.max_len),
                          TruncationWarning, stacklevel=3)
        start = time.perf_counter()
        hyps = self.decode_ids(sources.ids, beam, alpha, nbest, max_len_b, progress,
                               greedy_ok=not scored, no_repeat_ngram=no_repeat_ngram,
                               sampling=sampling)
        seconds = time.perf_counter() - start
        self.last_stats = DecodeStats(len(sources.todo), sum(len(h[0][0]) for h in hyps if h),
                                      seconds, sources.truncated)
        results = self.finish(sources, hyps, nbest)
        if aligned:
            results = [[(*r, a) for r, a in zip(rs, links, strict=True)] for rs, links in
                       zip(results, self.hypothesis_alignments(sources, hyps, nbest), strict=True)]
        return results

    def prepare(self, sentences: Sequence[str]) -> Sources:
        """Sentences as one line each, the empty ones set aside, the rest tokenized and
        truncated by the module's rule (no warning: the caller says what was cut)."""
        sentences = [_one_line(s) for s in sentences]
        todo = [i for i, s in enumerate(sentences) if s.strip()]
        texts = [sentences[i] for i in todo]
        ids, truncated = self.source_ids(texts)
        return Sources(len(sentences), todo, ids, truncated, texts)

    def finish(self, sources: Sources, hyps: Sequence[list[Hypothesis]], nbest: int
               ) -> list[list[tuple[str, float]]]:
        """The first ``nbest`` hypotheses of each prepared sentence as (text, score), in the
        input order; an empty sentence gets an empty list. (Beam search does not depend on
        nbest, only its list's length does: a search run for more gives the same first ones.)"""
        results: list[list[tuple[str, float]]] = [[] for _ in range(sources.count)]
        for i, sentence_hyps in zip(sources.todo, hyps, strict=True):
            kept = sentence_hyps[:nbest]
            texts = self.tokenizers.decode_tgt([ids for ids, _ in kept])
            results[i] = [(text, score) for text, (_, score) in zip(texts, kept)]
        return results

    def translate_lines(self, lines: Iterable[str], beam: int | None = None,
                        alpha: float | None = None, nbest: int = 1, chunk: int = 2000,
                        no_repeat_ngram: int | None = None, sampling: Sampling | None = None,
                        alignments: bool = False) -> Iterator[str]:
        """`aiayn translate`'s output, ``chunk`` lines at a time (so output appears as it is
        ready and memory stays bounded; ``chunk=1`` answers each line of a lazy iterable,
        e.g. a terminal, as soon as it arrives): one translation per line, or with
        ``nbest > 1`` rows 'LINE<TAB>SCORE<TAB>TRANSLATION' (an empty line gives
        'LINE<TAB><TAB>'). ``no_repeat_ngram``, ``sampling``: as ``translate``'s (one seed
        for every chunk). ``alignments``: each row ends with a tab and the translation's
        word alignment in the Pharaoh format ('0-0 1-2', ``aiayn.inference.align.pharaoh``)."""
        self.check_limits(beam, nbest, alpha, no_repeat_ngram, sampling)
        if alignments:
            self.check_alignments()
        if sampling is None:
            beam, alpha = self.search(beam, alpha)
        sampling = seeded(sampling)
        guard = {"no_repeat_ngram": no_repeat_ngram, "sampling": sampling}
        lines, first = iter(lines), 0  # first: the number of the chunk's first line
        while part := list(islice(lines, chunk)):
            if alignments:
                yield "".join(_aligned_rows(self._translate(
                    part, beam, alpha, nbest, 50, None, scored=nbest > 1, aligned=True,
                    **guard), nbest, first))
            elif nbest == 1:
                yield "".join(text + "\n" for text in self.translate(part, beam, alpha,
                                                                     **guard))
            else:
                rows = []
                for i, hyps in enumerate(self.translate_nbest(part, beam, alpha, nbest,
                                                              **guard), first):
                    rows.extend(f"{i}\t{score:.4f}\t{text}\n" for text, score in hyps)
                    if not hyps:
                        rows.append(f"{i}\t\t\n")
                yield "".join(rows)
            first += len(part)

    def encode(self, sentences: Sequence[str]) -> tuple[list[list[int]], int]:
        """Source ids (tokens + EOS) truncated by the module's rule, and how many were cut
        (a ``TruncationWarning`` says so)."""
        sources, truncated = self.source_ids(sentences)
        if truncated:
            warnings.warn(truncation_message(truncated, self.max_len), TruncationWarning,
                          stacklevel=2)
        return sources, truncated

    def source_ids(self, sentences: Sequence[str]) -> tuple[list[list[int]], int]:
        """``encode`` without the warning."""
        max_len = self.max_len
        sources = self.tokenizers.encode_src(list(sentences)) if sentences else []
        truncated = sum(len(ids) > max_len for ids in sources)
        return [truncate_source(ids, max_len) for ids in sources], truncated

    @torch.no_grad()
    def decode_ids(self, sources: list[list[int]], beam: int | None = None,
                   alpha: float | None = None, nbest: int = 1, max_len_b: int = 50,
                   progress: Callable[[int], object] | None = None,
                   greedy_ok: bool = True, no_repeat_ngram: int | None = None,
                   sampling: Sampling | None = None) -> list[list[Hypothesis]]:
        """Decode source id lists in length-sorted batches; results in input order.

        With ``beam=1, nbest=1, greedy_ok`` it runs greedy search, which returns the same
        tokens as a beam of 1 more cheaply but no score (reported as 0.0). The settings are
        resolved by ``settings`` (``no_repeat_ngram``, ``sampling``: see ``translate``).
        """
        self.check_limits(beam, nbest, alpha, no_repeat_ngram, sampling)
        search = self.settings(beam, alpha, no_repeat_ngram, sampling, nbest)
        results: list[list[Hypothesis]] = [[] for _ in sources]
        greedy = greedy_ok and search.beam == 1 and nbest == 1 and search.sampling is None
        widths = [len(s) for s in sources]
        copies = search.beam
        if self.engine is not None:  # CTranslate2 runs its own threads
            batches = token_batches(widths, self.max_tokens, copies=copies)
            decoded_batches = (self.engine.search([sources[i] for i in batch], search, nbest,
                                                  max_len_b) for batch in batches)
        else:  # one intra-op thread per stream: see aiayn.util.threads
            streams = self.streams or default_streams(self.device)
            batches = token_batches(widths, stream_budget(widths, self.max_tokens, copies,
                                                          streams), copies=copies)
            decoded_batches = parallel_map(
                lambda batch: self._search([sources[i] for i in batch], search, nbest,
                                           max_len_b, greedy), batches,
                streams, self.threads_per_stream)
        for batch, decoded in zip(batches, decoded_batches, strict=True):
            for i, hyps in zip(batch, decoded, strict=True):
                results[i] = hyps
            if progress is not None:
                progress(len(batch))
        return results

    @torch.no_grad()
    def _search(self, rows: list[list[int]], search: Search, nbest, max_len_b, greedy
                ) -> list[list[Hypothesis]]:
        """aiayn's own search (``aiayn.inference.search``) over one batch of source id lists (on a
        stream's thread: grad mode and autocast are per thread, so both are set here)."""
        src = pad(rows).to(self.device)
        autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if self.bf16
                    else nullcontext())
        try:
            with autocast:
                if greedy:
                    return [[Hypothesis(ids, 0.0)] for ids in greedy_decode(
                        self.model, src, max_len_b, no_repeat_ngram=search.no_repeat_ngram,
                        kernel=self.kernel)]
                return beam_search(self.model, src, search.beam, search.alpha, max_len_b, nbest,
                                   no_repeat_ngram=search.no_repeat_ngram,
                                   sampling=search.sampling, kernel=self.kernel)
        except (RuntimeError, MemoryError) as exc:
            if not is_out_of_memory(exc):
                raise
            raise AiaynError(
                f"out of memory decoding a batch of {len(rows)} sentence(s) x beam "
                f"{search.beam} ({src.numel() * search.beam} padded tokens) on {self.device}; give a smaller "
                f"--max-tokens (now {self.max_tokens})") from None

    def check_limits(self, beam: int | None, nbest: int = 1, alpha: float | None = None,
                     no_repeat_ngram: int | None = None, sampling: Sampling | None = None
                     ) -> None:
        """``check_search`` of the search to run (``search``), and a beam the model and the
        batch budget can hold: at most the target vocabulary (more hypotheses than tokens
        cannot differ at the first step) and ``max_tokens // 2`` (one source of a word and
        EOS, times the beam, must fit). With ``sampling``, the samples are its rows."""
        if sampling is not None:
            check_search(beam, nbest, alpha, no_repeat_ngram, sampling)
            if self.engine is not None:
                from aiayn.inference.ct2 import SAMPLING_REFUSED

                raise AiaynError(SAMPLING_REFUSED)
            beam = nbest
        beam, alpha = self.search(beam, alpha)
        check_search(beam, nbest, alpha, no_repeat_ngram)
        vocab = (self.model.cfg.tgt_vocab_size if self.model is not None
                 else self.tokenizers.tgt_vocab_size)  # decode_ids needs no tokenizers
        if sampling is not None:  # samples may repeat each other: only the budget bounds them
            if beam > self.max_tokens // 2:
                raise AiaynError(f"--nbest (samples) must be at most {self.max_tokens // 2} for "
                                 f"--max-tokens {self.max_tokens} (half the batch budget), "
                                 f"got {beam}")
            return
        limit = min(vocab, self.max_tokens // 2)
        if beam > limit:
            raise AiaynError(f"--beam must be at most {limit} for this model and --max-tokens "
                             f"{self.max_tokens} (the target vocabulary, and half the batch "
                             f"budget), got {beam}")

    def attention(self, sentence: str, beam: int = 1, alpha: float | None = None
                  ) -> SentenceAttention:
        """Translate ``sentence`` and capture every attention map of that translation."""
        hypothesis = self.target_ids(sentence, beam=beam, alpha=alpha)
        return self.attention_of(self.model, sentence, hypothesis)

    def target_ids(self, sentence: str, target: str | None = None, beam: int = 1,
                   alpha: float | None = None) -> list[int]:
        """The target ids (no BOS, no EOS) a teacher-forced pass over ``sentence`` is given:
        ``target`` tokenized, or else this translator's translation of ``sentence``."""
        if not sentence.strip():
            raise AiaynError("the sentence to translate is empty")
        if self.model is None:
            raise AiaynError("attention maps need aiayn's own model, not --engine ctranslate2")
        if target is not None:
            if not target.strip():
                raise AiaynError("the --target translation is empty")
            return self.tokenizers.encode_tgt([_one_line(target)])[0][1:-1]
        # Decode ids (not text) so that the teacher-forced pass sees the exact hypothesis.
        sources, _ = self.encode([_one_line(sentence)])
        return self.decode_ids(sources, beam=beam, alpha=alpha)[0][0].ids

    def next_piece(self, sentence: str, target: str | None = None, step: int | None = None,
                   sampling: Sampling | None = None, top: int = 10, no_repeat_ngram: int = 0
                   ) -> NextPiece:
        """The ``top`` likeliest pieces that a sample (``sampling``: temperature, top-k,
        top-p) would draw as piece number ``step`` of ``target`` (None: this translator's
        greedy translation), given the source and the pieces before it, with their
        probabilities (``aiayn.inference.search.next_distribution``); ``step`` None: after the whole
        target."""
        sampling = sampling or Sampling()
        check_sampling(sampling)
        check_search(None, 1, None, no_repeat_ngram)
        ids = self.target_ids(sentence, target)
        step = len(ids) if step is None else step
        if not 0 <= step <= len(ids):
            raise AiaynError(f"step must be between 0 and {len(ids)} (the target's pieces), "
                             f"got {step}")
        sources, _ = self.encode([_one_line(sentence)])
        src = torch.tensor(sources, dtype=torch.long, device=self.device)
        probs, tokens = on_one_thread(lambda: next_distribution(
            self.model, src, ids[:step], sampling, no_repeat_ngram, self.kernel))
        piece = self.tokenizers.tgt_id_to_token
        chosen = ids[step] if step < len(ids) else EOS_ID
        return NextPiece([piece(i) for i in ids], step, piece(chosen),
                         [(piece(int(t)), float(p)) for t, p in zip(tokens[:top].tolist(),
                                                                     probs[:top].tolist())
                          if p > 0])

    def attention_of(self, model: Transformer, sentence: str, hypothesis: Sequence[int]
                     ) -> SentenceAttention:
        """Every attention map of ``model`` (this one's, or another with the same
        architecture, e.g. an earlier checkpoint's) teacher-forced on ``hypothesis``."""
        return on_one_thread(lambda: sentence_attention(model, self.tokenizers, sentence,
                                                        hypothesis))

    # ------------------------------------------------------------ word alignments
    def check_alignments(self) -> None:
        """Word alignments come from aiayn's own model's cross-attention (an AiaynError for
        a CTranslate2 engine)."""
        if self.model is None:
            raise AiaynError("word alignments need aiayn's own model (its cross-attention), "
                             "not --engine ctranslate2")

    def alignment_layer(self) -> int:
        """``decode.alignment_layer`` as an index from 0 (``alignment_layer_index``)."""
        return alignment_layer_index(self.decode.alignment_layer,
                                     self.model.cfg.n_decoder_layers)

    def hypothesis_alignments(self, sources: Sources, hyps: Sequence[list[Hypothesis]],
                              nbest: int) -> list[list[Alignment]]:
        """The word alignment of each of the first ``nbest`` hypotheses of each prepared
        sentence (``decode_ids``' order: ``sources.todo``), as ``finish`` lays them out: in
        the input order, an empty list for an empty sentence."""
        rows = [(k, n) for k, sentence_hyps in enumerate(hyps)
                for n in range(min(nbest, len(sentence_hyps)))]
        links = self.align_ids([sources.texts[k] for k, _ in rows],
                               [sources.ids[k] for k, _ in rows],
                               [hyps[k][n].ids for k, n in rows])
        results: list[list[Alignment]] = [[] for _ in range(sources.count)]
        for (k, _), alignment in zip(rows, links, strict=True):
            results[sources.todo[k]].append(alignment)
        return results

    def align_ids(self, texts: Sequence[str], sources: Sequence[list[int]],
                  targets: Sequence[Sequence[int]]) -> list[Alignment]:
        """The word alignment of each source text (one line) with its ids (tokens + EOS, as
        ``source_ids`` gives them, truncated or not) and target ids (no BOS or EOS, e.g. a
        search's hypothesis): a teacher-forced pass over the target records the
        cross-attention of ``alignment_layer`` (heads averaged), which ``aiayn.inference.align``
        turns into word pairs. Batched by ``max_tokens``; one pass at a time, since the
        capture sets flags on the model's attention modules."""
        self.check_alignments()
        layer = self.alignment_layer()
        results: list[Alignment] = [[] for _ in texts]
        widths = [max(len(s), len(t) + 1) for s, t in zip(sources, targets, strict=True)]
        for batch in token_batches(widths, self.max_tokens):
            maps = cross_attention(self.model, [sources[i] for i in batch],
                                   [targets[i] for i in batch], layer)
            for i, attention in zip(batch, maps, strict=True):
                text, target = texts[i], targets[i]
                pieces = len(sources[i]) - 1  # the source tokens, EOS left out
                src_words = text_words(text, self.tokenizers.src_offsets(text))[:pieces]
                # (a target longer than max_len - 1 keeps the rows the model could give it)
                tgt_words = piece_words([self.tokenizers.tgt_id_to_token(t)
                                         for t in target])[:len(attention)]
                results[i] = word_alignment(attention[:, :pieces], src_words, tgt_words)
        return results


def _aligned_rows(results: list[list[tuple[str, float, Alignment]]], nbest: int, first: int
                  ) -> Iterator[str]:
    """`aiayn translate --alignments`' rows: 'TRANSLATION<TAB>PAIRS', or with ``nbest > 1``
    'LINE<TAB>SCORE<TAB>TRANSLATION<TAB>PAIRS'; an empty line gives '<TAB>' (or
    'LINE<TAB><TAB><TAB>')."""
    for i, hyps in enumerate(results, first):
        if nbest == 1:
            text, _, links = hyps[0] if hyps else ("", 0.0, [])
            yield f"{text}\t{pharaoh(links)}\n"
            continue
        for text, score, links in hyps:
            yield f"{i}\t{score:.4f}\t{text}\t{pharaoh(links)}\n"
        if not hyps:
            yield f"{i}\t\t\t\n"


def _one_line(sentence: str) -> str:
    """Line breaks inside a sentence would break the one-line-per-sentence contract."""
    return " ".join(sentence.splitlines()) if "\n" in sentence or "\r" in sentence else sentence


@dataclass
class NextPiece:
    """What a sample would draw at one step of a translation (``Translator.next_piece``)."""

    tgt_tokens: list[str]  # the target's pieces (no BOS, no EOS)
    step: int  # the piece drawn: number ``step`` of the target, after the ones before it
    target_piece: str  # the target's own piece there ([EOS] after its last)
    pieces: list[tuple[str, float]]  # the likeliest, with their probabilities, best first
