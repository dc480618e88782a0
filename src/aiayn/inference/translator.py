"""The one decode driver: the ``Translator``, behind `aiayn translate`, `aiayn evaluate`,
the validation during training (``aiayn.evaluation.evaluate``) and attention pictures.

    >>> from aiayn.inference.translator import Translator
    >>> t = Translator.from_pretrained("runs/demo")           # best.safetensors
    >>> t.translate(["The Lord is my shepherd."])      # the run's search (config.yaml's decode)
    ['El Señor es mi pastor.']
    >>> t.translate(["The Lord is my shepherd."], t.resolve(beam=4, no_repeat_ngram=3))
    ['El Señor es mi pastor.']
    >>> t.translate_nbest(["The Lord is my shepherd."],               # 3 samples each
    ...                   t.resolve(nbest=3, sampling=Sampling(temperature=0.8, seed=1)))

The search is one ``Search`` value (``aiayn.inference.settings``), every method's
``search`` (None: the run's). ``Translator.resolve(beam=..., alpha=..., nbest=...,
no_repeat_ngram=..., sampling=..., max_len_a=..., max_len_b=...)`` builds it, the settings
not given taking the run's ``decode`` section; a command resolves it once and hands that
value to every call. Who searches is the ``engine`` (``aiayn.inference.engine``: aiayn's
own or CTranslate2's).

Behind ``translate`` the sentences are tokenized, sorted by length, cut into batches of at
most ``decode_tokens`` padded source tokens x beam (``aiayn.data.batching.token_batches``),
decoded by the engine (aiayn's: on one CPU thread per batch, several batches at once, a
busy core then slowing one stream, not every op) and put back in their input order.

Rules for awkward input (never a crash):

- A ``str`` where a list of sentences is wanted is refused (a ``TypeError``): a string is
  iterable, and each of its characters would be translated as a sentence.
- An empty (or all-whitespace) sentence is not decoded; its translation is ``""``.
- A sentence whose source ids (tokens + EOS) are longer than the model's ``max_len`` keeps
  its first ``max_len - 1`` tokens and its EOS; a ``TruncationWarning`` says how many were
  cut. (The output is limited by the same ``max_len``.)
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import torch

from aiayn.config import DecodeConfig, alignment_layer_index
from aiayn.data.batching import token_batches
from aiayn.data.tokenizer import EOS_ID
from aiayn.errors import AiaynError, SettingError
from aiayn.inference.aiayn_engine import AiaynEngine
from aiayn.inference.align import Alignment, pharaoh, piece_words, text_words, word_alignment
from aiayn.inference.attention import SentenceAttention, cross_attention, sentence_attention
from aiayn.inference.engine import Engine
from aiayn.inference.engines import ENGINES, engine_class
from aiayn.inference.scoring import PairScore, score_pairs
from aiayn.inference.search import Hypothesis, next_distribution
from aiayn.inference.settings import Sampling, Search, resolve_search
from aiayn.model import OutputKernel, Transformer
from aiayn.util.threads import on_one_thread

__all__ = ["ENGINES", "NextPiece", "Sources", "Translator", "TruncationWarning"]


class TruncationWarning(UserWarning):
    """Some input sentences were longer than the model's max_len and were truncated."""


# ---------------------------------------------------------------- sources
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
    """A search engine and its tokenizers, translating lists of sentences in length-sorted
    batches."""

    def __init__(self, model: Transformer | None, tokenizers, decode_tokens: int | None = None,
                 device: str | torch.device | None = None, bf16: bool = False,
                 engine: Engine | None = None, streams: int | None = None,
                 threads_per_stream: int = 1, decode: DecodeConfig | None = None,
                 kernel: OutputKernel | None = None):
        """``engine``: who searches (``aiayn.inference.engine``; None: aiayn's own search over
        ``model`` on ``device``, with ``bf16``, ``streams`` and ``threads_per_stream``: see
        ``AiaynEngine``). ``decode_tokens``: the decoding budget in padded source tokens x
        beam (``token_batches``; None: the engine's default, 8,192 on a CPU). ``decode``: the
        search that settings left out mean (the run's config section; default the paper's
        beam 4, alpha 0.6). ``kernel``: the output layer's product for aiayn's engine
        (``AiaynEngine``; None: chosen there)."""
        self.engine = engine or AiaynEngine(model, device, bf16, streams, threads_per_stream,
                                            kernel)
        self.model, self.device = self.engine.model, self.engine.device
        self.max_len = self.engine.max_len
        self.decode = decode or DecodeConfig()
        self.decode_tokens = (self.engine.default_budget() if decode_tokens is None
                              else decode_tokens)
        self.engine.check_budget(self.decode_tokens)
        self.tokenizers = tokenizers
        self.bf16 = bf16
        self.last_stats = DecodeStats()

    kernel = property(lambda self: self.engine.kernel,
                      doc="the output layer's product the searches compute with (the engine's)")

    @property
    def streams(self) -> int | None:
        """Batches aiayn's engine decodes at once (None: ``default_streams``)."""
        return self.engine.streams

    @streams.setter
    def streams(self, value: int | None) -> None:
        self.engine.streams = value

    @classmethod
    def from_pretrained(cls, run_dir: str | Path, weights: str | Path = "best",
                        device: str | torch.device | None = None, engine: str = "aiayn",
                        **kwargs) -> Translator:
        """Load ``run_dir`` with the engine named ``engine`` (``engine_class``): a run
        directory (``load_run``; ``device`` defaults to the CPU), or with ``"ctranslate2"``
        a directory written by `aiayn export --to ctranslate2` (``weights`` and bf16 then
        unused), decoded by CTranslate2 with as many threads as torch uses."""
        options = {k: kwargs.pop(k) for k in ("bf16", "streams", "threads_per_stream")
                   if k in kwargs}
        searcher, tokenizers, config = engine_class(engine).load(run_dir, weights, device,
                                                                 **options)
        kwargs.setdefault("decode", config.decode)
        return cls(searcher.model, tokenizers, engine=searcher,
                   bf16=options.get("bf16", False), **kwargs)

    def resolve(self, **settings) -> Search:
        """The search of these settings (``resolve_search``'s keywords: beam, alpha, nbest,
        no_repeat_ngram, sampling, max_len_a, max_len_b) over the run's (``self.decode``),
        checked against this translator too (``check``); with none, the run's search, the
        one every method's ``search=None`` means."""
        search = resolve_search(self.decode, **settings)
        self.check(search)
        return search

    def check(self, search: Search) -> None:
        """What the engine cannot run (``Engine.supports``), and a beam the model and the
        decoding budget can hold: at most the target vocabulary (more hypotheses than tokens
        cannot differ at the first step) and ``decode_tokens // 2`` (one source of a word and
        EOS, times the beam, must fit). Samples may repeat each other: only the budget
        bounds them."""
        self.engine.supports(search)
        half = self.decode_tokens // 2
        if search.sampling is not None:
            if search.beam > half:
                raise SettingError("{nbest} (samples) must be at most {half} for "
                                   "{decode_tokens} {budget} (half the decoding budget), got "
                                   "{got}", half=half, budget=self.decode_tokens, got=search.beam)
            return
        limit = min(self.engine.tgt_vocab_size, half)
        if search.beam > limit:
            raise SettingError("{beam} must be at most {limit} for this model and "
                               "{decode_tokens} {budget} (the target vocabulary, and half the "
                               "decoding budget), got {got}", limit=limit,
                               budget=self.decode_tokens, got=search.beam)

    def translate(self, sentences: Sequence[str], search: Search | None = None,
                  progress: Callable[[int], object] | None = None) -> list[str]:
        """One translation per sentence, in input order. ``search``: the ``Search`` to run
        (``resolve``; None: the run's), its best hypothesis kept (with sampling: one
        sample per sentence)."""
        hyps = self._translate(_sentence_list(sentences, "translate"), search, progress,
                               scored=False)
        return [h[0][0] if h else "" for h in hyps]

    def translate_nbest(self, sentences: Sequence[str], search: Search | None = None,
                        progress: Callable[[int], object] | None = None
                        ) -> list[list[tuple[str, float]]]:
        """Up to ``search.nbest`` (translation, score) pairs per sentence, best first (with
        sampling: ``nbest`` samples, best first). ``search``: as ``translate``'s.

        The score is the length-normalised log-probability (see ``aiayn.inference.search``); an empty
        sentence gets an empty list.
        """
        return self._translate(_sentence_list(sentences, "translate_nbest"), search, progress,
                               scored=True)

    def translate_aligned(self, sentences: Sequence[str], search: Search | None = None,
                          progress: Callable[[int], object] | None = None
                          ) -> list[tuple[str, Alignment]]:
        """One (translation, word alignment) per sentence, in input order: the alignment
        links each word of the translation to a word of the sentence, (i, j) pairs of
        ``sentence.split()[i]`` and ``translation.split()[j]`` (``aiayn.inference.align``; write them
        with ``aiayn.inference.align.pharaoh``). An empty sentence gives ("", [])."""
        hyps = self._translate(_sentence_list(sentences, "translate_aligned"), search,
                               progress, scored=False, aligned=True)
        return [(h[0][0], h[0][2]) if h else ("", []) for h in hyps]

    def _translate(self, sentences, search: Search | None, progress, scored, aligned=False):
        """Tokenize the non-empty sentences, decode them, detokenize, keep the input order.

        ``progress(n)`` is called after each batch with its number of sentences (e.g. a
        tqdm bar's ``update``); ``self.last_stats`` describes the pass afterwards.
        ``aligned``: each (text, score) gets its word alignment as a third item.
        """
        search = search or self.resolve()
        if aligned:
            self.check_alignments()
        sources = self.prepare(sentences)
        if sources.truncated:
            warnings.warn(truncation_message(sources.truncated, self.max_len),
                          TruncationWarning, stacklevel=3)
        start = time.perf_counter()
        hyps = self.decode_ids(sources.ids, progress=progress, greedy_ok=not scored,
                               search=search)
        seconds = time.perf_counter() - start
        self.last_stats = DecodeStats(len(sources.todo), sum(len(h[0][0]) for h in hyps if h),
                                      seconds, sources.truncated)
        results = self.finish(sources, hyps, search.nbest)
        if aligned:
            links = self.hypothesis_alignments(sources, hyps, search.nbest)
            results = [[(*r, a) for r, a in zip(rs, ls, strict=True)]
                       for rs, ls in zip(results, links, strict=True)]
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

    def translate_lines(self, lines: Iterable[str], search: Search | None = None,
                        chunk: int = 2000, alignments: bool = False) -> Iterator[str]:
        """`aiayn translate`'s output, ``chunk`` lines at a time (so output appears as it is
        ready and memory stays bounded; ``chunk=1`` answers each line of a lazy iterable,
        e.g. a terminal, as soon as it arrives): one translation per line, or with
        ``search.nbest > 1`` rows 'LINE<TAB>SCORE<TAB>TRANSLATION' (an empty line gives
        'LINE<TAB><TAB>'). ``search``: as ``translate``'s (one seed for every chunk).
        ``alignments``: each row ends with a tab and the translation's word alignment in the
        Pharaoh format ('0-0 1-2', ``aiayn.inference.align.pharaoh``)."""
        lines = _sentence_list(lines, "translate_lines")
        search = search or self.resolve()
        if alignments:
            self.check_alignments()
        nbest = search.nbest
        lines, first = iter(lines), 0  # first: the number of the chunk's first line
        while part := list(islice(lines, chunk)):
            if alignments:
                yield "".join(_aligned_rows(self._translate(
                    part, search, None, scored=nbest > 1, aligned=True), nbest, first))
            elif nbest == 1:
                yield "".join(text + "\n" for text in self.translate(part, search=search))
            else:
                rows = []
                for i, hyps in enumerate(self.translate_nbest(part, search=search), first):
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
    def decode_ids(self, sources: list[list[int]], search: Search | None = None,
                   progress: Callable[[int], object] | None = None, greedy_ok: bool = True
                   ) -> list[list[Hypothesis]]:
        """Decode source id lists with the engine (``Engine.decode``: length-sorted batches
        of the decoding budget); results in input order. ``search``: as ``translate``'s.

        With a greedy search (beam 1, nbest 1) and ``greedy_ok`` aiayn's engine runs greedy
        search, which returns the same tokens as a beam of 1 more cheaply but no score
        (reported as 0.0).
        """
        search = search or self.resolve()
        results: list[list[Hypothesis]] = [[] for _ in sources]
        batches, decoded = self.engine.decode(sources, search, self.decode_tokens, greedy_ok)
        for batch, hyps in zip(batches, decoded, strict=True):
            for i, sentence_hyps in zip(batch, hyps, strict=True):
                results[i] = sentence_hyps
            if progress is not None:
                progress(len(batch))
        return results

    def attention(self, sentence: str, search: Search | None = None) -> SentenceAttention:
        """Translate ``sentence`` with ``search`` (None: the run's; `aiayn attention` gives
        ``resolve(beam=1)``, greedy) and capture every attention map of that translation."""
        hypothesis = self.target_ids(sentence, search=search)
        return self.attention_of(self.model, sentence, hypothesis)

    def target_ids(self, sentence: str, target: str | None = None,
                   search: Search | None = None) -> list[int]:
        """The target ids (no BOS, no EOS) a teacher-forced pass over ``sentence`` is given:
        ``target`` tokenized, or else this translator's translation of ``sentence`` by
        ``search`` (None: the run's)."""
        if not sentence.strip():
            raise AiaynError("the sentence to translate is empty")
        self.engine.require_model("attention maps")
        if target is not None:
            if not target.strip():
                raise AiaynError("the --target translation is empty")
            return self.tokenizers.encode_tgt([_one_line(target)])[0][1:-1]
        # Decode ids (not text) so that the teacher-forced pass sees the exact hypothesis.
        sources, _ = self.encode([_one_line(sentence)])
        return self.decode_ids(sources, search)[0][0].ids

    def next_piece(self, sentence: str, target: str | None = None, step: int | None = None,
                   search: Search | None = None, top: int = 10) -> NextPiece:
        """The ``top`` likeliest pieces that a sample of ``search`` (its sampling: temperature,
        top-k, top-p, and its repetition guard; None: the run's search, drawing at
        temperature 1) would draw as piece number ``step`` of ``target`` (None: this
        translator's greedy translation), given the source and the pieces before it, with
        their probabilities (``aiayn.inference.search.next_distribution``); ``step`` None:
        after the whole target."""
        search = search or self.resolve(sampling=Sampling())
        sampling = search.sampling or Sampling()
        ids = self.target_ids(sentence, target, self.resolve(beam=1))
        step = len(ids) if step is None else step
        if not 0 <= step <= len(ids):
            raise AiaynError(f"step must be between 0 and {len(ids)} (the target's pieces), "
                             f"got {step}")
        sources, _ = self.encode([_one_line(sentence)])
        src = torch.tensor(sources, dtype=torch.long, device=self.device)
        probs, tokens = on_one_thread(lambda: next_distribution(
            self.model, src, ids[:step], sampling, search.no_repeat_ngram, self.kernel))
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

    def score(self, sources: Sequence[str], targets: Sequence[str], search: Search | None = None,
              progress: Callable[[int], object] | None = None) -> list[PairScore]:
        """Each pair's teacher-forced log-probability under ``search``: aiayn.inference.scoring."""
        return score_pairs(self, sources, targets, search or self.resolve(), progress)

    # ------------------------------------------------------------ word alignments
    def check_alignments(self) -> None:
        """Word alignments come from aiayn's own model's cross-attention (an AiaynError for
        an engine without it)."""
        self.engine.require_model("word alignments (its cross-attention)")

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
        turns into word pairs. Batched by ``decode_tokens``; one pass at a time, since the
        capture sets flags on the model's attention modules."""
        self.check_alignments()
        layer = self.alignment_layer()
        results: list[Alignment] = [[] for _ in texts]
        widths = [max(len(s), len(t) + 1) for s, t in zip(sources, targets, strict=True)]
        for batch in token_batches(widths, self.decode_tokens):
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


def _sentence_list(sentences, method: str):
    """``sentences``, unless a bare string was given where a list is wanted: iterated, it
    would be translated one character at a time (a TypeError, naming the list wanted)."""
    if isinstance(sentences, str):
        raise TypeError(f"{method}() takes a list of sentences; got a str: use "
                        f"{method}([text])")
    return sentences


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
