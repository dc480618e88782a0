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
    >>> t.translate_scored(["The Lord is my shepherd."])[0][0].score   # its confidence
    -0.21
    >>> t.translate(["The Lord is my shepherd."], prefixes=["El Dios"])  # completion
    ['El Dios es mi pastor.']
    >>> both = Translator.from_pretrained("runs/both", to="es")  # a model of two directions
    >>> both.toward("en").translate(["Jehová es mi pastor."])
    ['Yahweh is my shepherd.']

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
- A target prefix (``prefixes``, one per sentence or None) is tokenized as target text, its
  trailing spaces dropped; the translation starts with its pieces and goes on from there
  (``aiayn.inference.search``). A prefix the model cannot write (a piece outside its output
  layer, an unknown piece, more pieces than max_len leaves room for) is refused, naming it.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch

from aiayn.config import DecodeConfig, alignment_layer_index
from aiayn.data.directions import with_tag
from aiayn.data.tokenizer import EOS, EOS_ID, UNK_ID
from aiayn.errors import AiaynError, SettingError
from aiayn.inference.aiayn_engine import AiaynEngine
from aiayn.inference.align import Alignment, hypothesis_alignments
from aiayn.inference.attention import SentenceAttention, sentence_attention
from aiayn.inference.engine import Engine
from aiayn.inference.engines import ENGINES, engine_class
from aiayn.inference.scoring import PairScore, score_pairs
from aiayn.inference.search import Hypothesis, next_distribution
from aiayn.inference.settings import Sampling, Search, resolve_search
from aiayn.inference.translations import (
    DecodeStats,
    Sources,
    Translation,
    TruncationWarning,
    one_line,
    output_rows,
    sentence_list,
    single_line,
    truncate_source,
    truncation_message,
)
from aiayn.model import OutputKernel, Transformer
from aiayn.util.threads import on_one_thread

__all__ = ["ENGINES", "NextPiece", "Sources", "Translation", "Translator", "TruncationWarning",
           "truncation_message"]


# ---------------------------------------------------------------- the translator
class Translator:
    """A search engine and its tokenizers, translating lists of sentences in length-sorted
    batches."""

    def __init__(self, model: Transformer | None, tokenizers, decode_tokens: int | None = None,
                 device: str | torch.device | None = None, bf16: bool = False,
                 engine: Engine | None = None, streams: int | None = None,
                 threads_per_stream: int = 1, decode: DecodeConfig | None = None,
                 kernel: OutputKernel | None = None, int8: bool = False,
                 to: str | None = None):
        """``engine``: who searches (``aiayn.inference.engine``; None: aiayn's own search over
        ``model`` on ``device``, with ``bf16``, ``streams`` and ``threads_per_stream``: see
        ``AiaynEngine``). ``decode_tokens``: the decoding budget in padded source tokens x
        beam (``token_batches``; None: the engine's default, 8,192 on a CPU). ``decode``: the
        search that settings left out mean (the run's config section; default the paper's
        beam 4, alpha 0.6). ``kernel``: the output layer's product for aiayn's engine
        (``AiaynEngine``; None: chosen there); ``int8``: its decoder and output layer in
        int8 (``aiayn.inference.int8``). ``to``: the target language, for a model that translates
        into several (its direction tags, aiayn.data.directions); ``toward`` gives another."""
        self.engine = engine or AiaynEngine(model, device, bf16, streams, threads_per_stream,
                                            kernel, int8)
        self.model, self.device = self.engine.model, self.engine.device
        self.max_len = self.engine.max_len
        self.decode = decode or DecodeConfig()
        self.decode_tokens = (self.engine.default_budget() if decode_tokens is None
                              else decode_tokens)
        self.engine.check_budget(self.decode_tokens)
        self.tokenizers = tokenizers
        self.bf16 = bf16
        self.last_stats = DecodeStats()
        self.to = to
        with_tag([], self.tags, to, "this model")  # a language the model lacks: refused

    def toward(self, to: str | None) -> Translator:
        """This translator (the same engine and model) writing into ``to``."""
        with_tag([], self.tags, to, "this model")
        other = copy.copy(self)
        other.to, other.last_stats = to, DecodeStats()
        return other

    @property
    def tags(self) -> dict[str, str]:
        """Target language -> direction tag (``Tokenizers.tags``); {} for one direction, and
        for a translator of ids alone (no tokenizers)."""
        return getattr(self.tokenizers, "tags", None) or {}

    @property
    def targets(self) -> list[str]:
        """The target languages a ``to`` may name (empty: one direction, no ``to``)."""
        return sorted(self.tags)

    def check_direction(self) -> None:
        """Before any input is read: a model of several target languages needs ``to``."""
        if self.targets and self.to is None:
            with_tag([""], self.tags, None, "this model")

    def tagged(self, sentences: Sequence[str]) -> list[str]:
        """The sentences as the encoder reads them: with the tag of ``self.to`` in front
        where the model has direction tags (aiayn.data.directions.with_tag)."""
        return with_tag(list(sentences), self.tags, self.to, "this model")

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
        unused), decoded by CTranslate2 with as many threads as torch uses. ``int8``
        (aiayn's engine): the decoder and output layer in int8 (an export has its own weight
        type).
        ``to``: the target language of a model with several (``Translator``)."""
        options = {k: kwargs.pop(k) for k in ("bf16", "streams", "threads_per_stream", "int8")
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
                  progress: Callable[[int], object] | None = None,
                  prefixes: Sequence[str | None] | None = None) -> list[str]:
        """One translation per sentence, in input order. ``search``: the ``Search`` to run
        (``resolve``; None: the run's), its best hypothesis kept (with sampling: one
        sample per sentence). ``prefixes``: per sentence the start of its translation
        (None or "": none), which the search completes (the module docstring)."""
        hyps = self._translate(sentence_list(sentences, "translate"), search, progress,
                               scored=False, prefixes=prefixes)
        return [h[0].text if h else "" for h in hyps]

    def translate_nbest(self, sentences: Sequence[str], search: Search | None = None,
                        progress: Callable[[int], object] | None = None,
                        prefixes: Sequence[str | None] | None = None
                        ) -> list[list[tuple[str, float]]]:
        """Up to ``search.nbest`` (translation, score) pairs per sentence, best first (with
        sampling: ``nbest`` samples, best first). ``search``, ``prefixes``: as ``translate``'s.

        The score is the length-normalised log-probability (see ``aiayn.inference.search``); an empty
        sentence gets an empty list.
        """
        return [[(t.text, t.score) for t in hyps] for hyps in self.translate_scored(
            sentence_list(sentences, "translate_nbest"), search, progress, prefixes)]

    def translate_scored(self, sentences: Sequence[str], search: Search | None = None,
                         progress: Callable[[int], object] | None = None,
                         prefixes: Sequence[str | None] | None = None
                         ) -> list[list[Translation]]:
        """Up to ``search.nbest`` ``Translation``s per sentence, best first: each with its
        score, its log-probability and each piece's (greedy search runs as a beam of one
        here, which gives the same tokens with their scores). An empty sentence gets an empty
        list. ``search``, ``prefixes``: as ``translate``'s."""
        return self._translate(sentence_list(sentences, "translate_scored"), search, progress,
                               scored=True, prefixes=prefixes)

    def translate_aligned(self, sentences: Sequence[str], search: Search | None = None,
                          progress: Callable[[int], object] | None = None,
                          prefixes: Sequence[str | None] | None = None
                          ) -> list[tuple[str, Alignment]]:
        """One (translation, word alignment) per sentence, in input order: the alignment
        links each word of the translation to a word of the sentence, (i, j) pairs of
        ``sentence.split()[i]`` and ``translation.split()[j]`` (``aiayn.inference.align``; write them
        with ``aiayn.inference.align.pharaoh``). An empty sentence gives ("", [])."""
        hyps = self._translate(sentence_list(sentences, "translate_aligned"), search,
                               progress, scored=False, aligned=True, prefixes=prefixes)
        return [(h[0].text, h[0].alignment) if h else ("", []) for h in hyps]

    def _translate(self, sentences, search: Search | None, progress, scored, aligned=False,
                   prefixes=None, first: int = 0) -> list[list[Translation]]:
        """Tokenize the non-empty sentences, decode them, detokenize, keep the input order.

        ``progress(n)`` is called after each batch with its number of sentences (e.g. a
        tqdm bar's ``update``); ``self.last_stats`` describes the pass afterwards.
        ``aligned``: each translation gets its word alignment. ``first``: the number of the
        first sentence, from 0, in what a refusal says (a file's line).
        """
        search = search or self.resolve()
        if aligned:
            self.check_alignments()
        sources = self.prepare(sentences, prefixes, first)
        if sources.truncated:
            warnings.warn(truncation_message(sources.truncated, self.max_len),
                          TruncationWarning, stacklevel=3)
        start = time.perf_counter()
        hyps = self.decode_ids(sources.ids, progress=progress, greedy_ok=not scored,
                               search=search, prefixes=sources.prefixes)
        seconds = time.perf_counter() - start
        self.last_stats = DecodeStats(len(sources.todo), sum(len(h[0].ids) for h in hyps if h),
                                      seconds, sources.truncated)
        results = self.translations(sources, hyps, search.nbest)
        if aligned:
            links = hypothesis_alignments(self, sources, hyps, search.nbest)
            for sentence, sentence_links in zip(results, links, strict=True):
                for translation, alignment in zip(sentence, sentence_links, strict=True):
                    translation.alignment = alignment
        return results

    def prepare(self, sentences: Sequence[str], prefixes: Sequence[str | None] | None = None,
                first: int = 0) -> Sources:
        """Sentences as one line each, the empty ones set aside, the rest tokenized and
        truncated by the module's rule (no warning: the caller says what was cut), with
        their prefixes' ids (``prefix_ids``; ``first``: as ``_translate``'s)."""
        sentences = [one_line(s) for s in sentences]
        todo = [i for i, s in enumerate(sentences) if s.strip()]
        texts = [sentences[i] for i in todo]
        ids, truncated = self.source_ids(texts)
        if prefixes is None:
            return Sources(len(sentences), todo, ids, truncated, texts)
        if len(prefixes) != len(sentences):
            raise AiaynError(f"{len(prefixes)} prefixes for {len(sentences)} sentences: give "
                             "one per sentence (None or '' for none)")
        return Sources(len(sentences), todo, ids, truncated, texts,
                       self.prefix_ids([prefixes[i] for i in todo], [first + i for i in todo]))

    def prefix_ids(self, prefixes: Sequence[str | None], numbers: Sequence[int]) -> list[list[int]]:
        """The target ids (no BOS or EOS) of each prefix (None or blank: none), or an
        AiaynError naming the first the model cannot write, by its number (from 0) in
        ``numbers``."""
        texts = [one_line(p).rstrip() if p else "" for p in prefixes]
        encoded = self.tokenizers.encode_tgt(texts) if texts else []
        ids = [e[1:-1] for e in encoded]  # without BOS and EOS
        room = self.max_len - 2  # BOS before the prefix, EOS after it
        for number, text, prefix in zip(numbers, texts, ids, strict=True):
            bad = [i for i in prefix if i == UNK_ID] or self.engine.unwritable(prefix)
            if bad:
                pieces = ", ".join(dict.fromkeys(repr(self.tokenizers.tgt_id_to_token(i))
                                                 for i in bad[:5]))
                raise AiaynError(f"the prefix of sentence {number + 1} ({text[:60]!r}) has "
                                 f"pieces this model cannot write: {pieces}")
            if len(prefix) > room:
                raise AiaynError(f"the prefix of sentence {number + 1} has {len(prefix)} "
                                 f"pieces; at most {room} fit this model's max_len")
        return ids

    def translations(self, sources: Sources, hyps: Sequence[list[Hypothesis]], nbest: int
                     ) -> list[list[Translation]]:
        """The first ``nbest`` hypotheses of each prepared sentence as ``Translation``s, in
        the input order; an empty sentence gets an empty list. (Beam search does not depend
        on nbest, only its list's length does: a search run for more gives the same first
        ones.)"""
        piece = self.tokenizers.tgt_id_to_token
        results: list[list[Translation]] = [[] for _ in range(sources.count)]
        for i, sentence_hyps in zip(sources.todo, hyps, strict=True):
            kept = sentence_hyps[:nbest]
            texts = [single_line(t) for t in self.tokenizers.decode_tgt([h.ids for h in kept])]
            results[i] = [Translation(
                text, h.score, h.log_prob if h.log_probs else None,
                [piece(t) for t in h.ids] + [EOS] * (len(h.log_probs) > len(h.ids)),
                list(h.log_probs) if h.log_probs else None)
                for text, h in zip(texts, kept, strict=True)]
        return results

    def finish(self, sources: Sources, hyps: Sequence[list[Hypothesis]], nbest: int
               ) -> list[list[tuple[str, float]]]:
        """``translations`` as (text, score) pairs."""
        return [[(t.text, t.score) for t in ts] for ts in self.translations(sources, hyps, nbest)]

    def translate_lines(self, lines: Iterable[str], search: Search | None = None,
                        chunk: int = 2000, alignments: bool = False, scores: bool = False,
                        prefixes: bool = False, progress: Callable[[int], object] | None = None,
                        first_line: int = 0) -> Iterator[str]:
        """`aiayn translate`'s output, ``chunk`` lines at a time (so output appears as it is
        ready and memory stays bounded; ``chunk=1`` answers each line of a lazy iterable,
        e.g. a terminal, as soon as it arrives): one translation per line, or with
        ``search.nbest > 1`` rows 'LINE<TAB>SCORE<TAB>TRANSLATION' (an empty line gives
        'LINE<TAB><TAB>'). ``search``: as ``translate``'s (one seed for every chunk).
        ``alignments``: each row ends with a tab and the translation's word alignment in the
        Pharaoh format ('0-0 1-2', ``aiayn.inference.align.pharaoh``). ``scores``: one JSON
        object per line instead (``Translation.as_dict``; with nbest > 1 {"nbest": [...]};
        an empty line {"translation": ""} alone, or with nbest > 1 {"nbest": []}). ``prefixes``: each line is
        'SENTENCE<TAB>PREFIX' (no tab: no prefix), the translation starting with PREFIX.
        ``progress(n)``: called after each batch with its number of sentences.
        ``first_line``: the number of the first of ``lines`` (a resumed file's rest), which
        n-best rows and error messages count from."""
        lines = sentence_list(lines, "translate_lines")
        search = search or self.resolve()
        if alignments:
            self.check_alignments()
        nbest = search.nbest
        lines, first = iter(lines), first_line  # first: the number of the chunk's first line
        while part := list(islice(lines, chunk)):
            given = None
            if prefixes:
                part, given = zip(*(line.partition("\t")[::2] for line in part), strict=True)
            results = self._translate(list(part), search, progress, scored=scores or nbest > 1,
                                      aligned=alignments, prefixes=given, first=first)
            yield "".join(output_rows(results, nbest, first, alignments, scores))
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
        sources = self.tokenizers.encode_src(self.tagged(sentences)) if sentences else []
        truncated = sum(len(ids) > max_len for ids in sources)
        return [truncate_source(ids, max_len) for ids in sources], truncated

    @torch.no_grad()
    def decode_ids(self, sources: list[list[int]], search: Search | None = None,
                   progress: Callable[[int], object] | None = None, greedy_ok: bool = True,
                   prefixes: list[list[int]] | None = None) -> list[list[Hypothesis]]:
        """Decode source id lists with the engine (``Engine.decode``: length-sorted batches
        of the decoding budget); results in input order. ``search``: as ``translate``'s.

        With a greedy search (beam 1, nbest 1) and ``greedy_ok`` aiayn's engine runs greedy
        search, which returns the same tokens as a beam of 1 more cheaply but no score
        (reported as 0.0). ``prefixes``: per source the target ids it starts with (``prepare``).
        """
        search = search or self.resolve()
        results: list[list[Hypothesis]] = [[] for _ in sources]
        batches, decoded = self.engine.decode(sources, search, self.decode_tokens, greedy_ok,
                                              prefixes)
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
            return self.tokenizers.encode_tgt([one_line(target)])[0][1:-1]
        # Decode ids (not text) so that the teacher-forced pass sees the exact hypothesis.
        sources, _ = self.encode([one_line(sentence)])
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
        sources, _ = self.encode([one_line(sentence)])
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
        tagged = self.tagged([sentence])[0]
        return on_one_thread(lambda: sentence_attention(model, self.tokenizers, tagged,
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


@dataclass
class NextPiece:
    """What a sample would draw at one step of a translation (``Translator.next_piece``)."""

    tgt_tokens: list[str]  # the target's pieces (no BOS, no EOS)
    step: int  # the piece drawn: number ``step`` of the target, after the ones before it
    target_piece: str  # the target's own piece there ([EOS] after its last)
    pieces: list[tuple[str, float]]  # the likeliest, with their probabilities, best first
