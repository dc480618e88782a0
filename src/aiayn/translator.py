"""The one decode driver: the ``Translator``, behind `aiayn translate`, `aiayn evaluate`,
the validation during training (``aiayn.evaluate``) and attention pictures.

    >>> from aiayn.translator import Translator
    >>> t = Translator.from_pretrained("runs/demo")           # best.safetensors
    >>> t.translate(["The Lord is my shepherd."])      # the run's search (config.yaml's decode)
    ['El Señor es mi pastor.']
    >>> t.translate(["The Lord is my shepherd."], beam=4, alpha=0.6)   # the paper's (6.1)
    ['El Señor es mi pastor.']

Behind ``translate`` the sentences are tokenized, sorted by length, cut into batches of at
most ``max_tokens`` padded source tokens x beam (``aiayn.batching.token_batches``; fewer
sentences than fill a batch per stream are cut into about one batch per stream), decoded
with the KV cache (``aiayn.decode``) on one CPU thread per batch, several batches at once
(``aiayn.threads.parallel_map``: a busy core then slows one stream, not every op), and put
back in their input order.

Rules for awkward input (never a crash):

- An empty (or all-whitespace) sentence is not decoded; its translation is ``""``.
- A sentence whose source ids (tokens + EOS) are longer than the model's ``max_len`` keeps
  its first ``max_len - 1`` tokens and its EOS; a ``TruncationWarning`` says how many were
  cut. (The output is limited by the same ``max_len``.)
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np
import torch

from aiayn.batching import pad, token_batches
from aiayn.checkpoint import load_weights
from aiayn.config import DecodeConfig
from aiayn.decode import Hypothesis, beam_search, greedy_decode
from aiayn.distributed import physical_memory
from aiayn.errors import AiaynError, is_out_of_memory
from aiayn.kernels import choose_output_kernel
from aiayn.model import Transformer, capture_attention
from aiayn.rundir import load_run, read_metrics, step_weights
from aiayn.threads import default_streams, on_one_thread, parallel_map
from aiayn.tokenizer import BOS_ID, EOS_ID

# Rows of a decoding step the output layer's kernel is chosen for (aiayn.kernels): a beam
# of 4-6 over the ~50 sentences of an 8,192-token batch.
DECODE_PROBE_ROWS = 256
ENGINES = ("aiayn", "ctranslate2")  # who searches: aiayn.decode, or aiayn.ct2_engine


class TruncationWarning(UserWarning):
    """Some input sentences were longer than the model's max_len and were truncated."""


# ---------------------------------------------------------------- search settings, sources
def check_search(beam: int | None, nbest: int = 1, alpha: float | None = None) -> None:
    """The one check of the search settings that needs no model (an AiaynError names the
    option); ``Translator.check_limits`` adds the bounds the model and memory set. None (not
    given: the run's ``decode`` section will say) passes; nbest is then checked against the
    run's beam, once it is loaded."""
    if beam is not None and beam < 1:
        raise AiaynError(f"--beam must be at least 1, got {beam}")
    if nbest < 1 or (beam is not None and nbest > beam):
        top = "the beam" if beam is None else f"the beam ({beam})"
        raise AiaynError(f"--nbest must be between 1 and {top}, got {nbest}")
    if alpha is not None and not (math.isfinite(alpha) and 0 <= alpha <= 10):
        raise AiaynError(f"--alpha must be in [0, 10], got {alpha}")


def decode_bytes_per_token(cfg) -> int:
    """Memory one padded source token of a decoding batch can hold, in fp32 bytes: the
    encoder output and every decoder layer's cross-attention keys and values ((1 + 2L) d),
    the self-attention cache of a translation up to twice the source's length (4 L d per
    source token) and one row of logits over the target vocabulary (V, for a 1-token
    source at worst)."""
    layers, d = cfg.n_decoder_layers, cfg.d_model
    return 4 * ((1 + 6 * layers) * d + cfg.tgt_vocab_size)


def memory_bytes(device: torch.device | None = None) -> int:
    """The memory a decoding pass on ``device`` can use: a GPU's free memory, else this
    machine's physical memory."""
    if device is not None and device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return physical_memory()


CPU_MAX_TOKENS = 8192  # a CPU's default batch budget: larger batches decode no faster there
GPU_MAX_TOKENS = 1 << 18  # a GPU's largest default: the 690 test verses x beam 4 in one batch


def default_max_tokens(cfg, device: torch.device) -> int:
    """The batch budget ``max_tokens=None`` means on ``device``.

    A CPU decodes no faster in larger batches than 8,192 padded source tokens x beam. A GPU
    launches the same kernels for a batch of 10 sentences as for 1,000, and a step of the
    demo's model is launch-bound far below that: its decoding speed grows with the batch
    until the memory runs out (docs/findings.md#decoding-on-a-gpu). So there the budget is
    what a quarter of the free GPU memory holds (``decode_bytes_per_token``), up to 2**18.
    """
    if device.type != "cuda":
        return CPU_MAX_TOKENS
    fits = memory_bytes(device) // 4 // decode_bytes_per_token(cfg)
    return max(CPU_MAX_TOKENS, min(GPU_MAX_TOKENS, fits))


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
                 decode: DecodeConfig | None = None):
        """``max_tokens``: batch budget in padded source tokens x beam (``token_batches``;
        None: ``default_max_tokens`` of the device, 8,192 on a CPU);
        ``bf16``: decode under bfloat16 autocast (as training validates under train.bf16).
        ``streams``: batches decoded at once, each on one CPU thread (``aiayn.threads``;
        None: ``default_streams``, as many as torch has threads when decoding starts);
        ``threads_per_stream`` > 1 only to measure the barriers that one thread avoids.
        ``engine``: search with this instead of ``model`` (None then), e.g. an
        ``aiayn.ct2_engine.CTranslate2Search``: it has ``max_len``, ``device`` and
        ``search(sources, beam, alpha, nbest, max_len_b) -> list[list[Hypothesis]]``.
        ``decode``: the search that a beam or alpha of None means (the run's config section;
        default the paper's beam 4, alpha 0.6)."""
        self.engine = engine
        self.decode = decode or DecodeConfig()
        if engine is not None:
            self.device, self.model, self.max_len = torch.device(engine.device), None, engine.max_len
            max_tokens = CPU_MAX_TOKENS if max_tokens is None else max_tokens
        else:
            self.device = torch.device(device) if device is not None else _parameter_device(model)
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
            if model.generator.kernel is None:  # not chosen yet (a Trainer chooses for its own)
                choose_output_kernel(model.generator, DECODE_PROBE_ROWS, enabled=not bf16)
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
            from aiayn.ct2_engine import load_ctranslate2

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

    def translate(self, sentences: Sequence[str], beam: int | None = None,
                  alpha: float | None = None, max_len_b: int = 50,
                  progress: Callable[[int], object] | None = None) -> list[str]:
        """One translation per sentence, in input order (``beam=1``: greedy search)."""
        hyps = self._translate(sentences, beam, alpha, 1, max_len_b, progress, scored=False)
        return [h[0][0] if h else "" for h in hyps]

    def translate_nbest(self, sentences: Sequence[str], beam: int | None = None,
                        alpha: float | None = None, nbest: int = 1, max_len_b: int = 50,
                        progress: Callable[[int], object] | None = None
                        ) -> list[list[tuple[str, float]]]:
        """Up to ``nbest`` (translation, score) pairs per sentence, best first.

        The score is the length-normalised log-probability (see ``aiayn.decode``); an empty
        sentence gets an empty list.
        """
        return self._translate(sentences, beam, alpha, nbest, max_len_b, progress, scored=True)

    def _translate(self, sentences, beam, alpha, nbest, max_len_b, progress, scored):
        """Tokenize the non-empty sentences, decode them, detokenize, keep the input order.

        ``progress(n)`` is called after each batch with its number of sentences (e.g. a
        tqdm bar's ``update``); ``self.last_stats`` describes the pass afterwards.
        """
        beam, alpha = self.search(beam, alpha)
        self.check_limits(beam, nbest, alpha)
        sources = self.prepare(sentences)
        if sources.truncated:
            warnings.warn(truncation_message(sources.truncated, self.max_len),
                          TruncationWarning, stacklevel=3)
        start = time.perf_counter()
        hyps = self.decode_ids(sources.ids, beam, alpha, nbest, max_len_b, progress,
                               greedy_ok=not scored)
        seconds = time.perf_counter() - start
        self.last_stats = DecodeStats(len(sources.todo), sum(len(h[0][0]) for h in hyps if h),
                                      seconds, sources.truncated)
        return self.finish(sources, hyps, nbest)

    def prepare(self, sentences: Sequence[str]) -> Sources:
        """Sentences as one line each, the empty ones set aside, the rest tokenized and
        truncated by the module's rule (no warning: the caller says what was cut)."""
        sentences = [_one_line(s) for s in sentences]
        todo = [i for i, s in enumerate(sentences) if s.strip()]
        ids, truncated = self.source_ids([sentences[i] for i in todo])
        return Sources(len(sentences), todo, ids, truncated)

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
                        alpha: float | None = None, nbest: int = 1, chunk: int = 2000
                        ) -> Iterator[str]:
        """`aiayn translate`'s output, ``chunk`` lines at a time (so output appears as it is
        ready and memory stays bounded; ``chunk=1`` answers each line of a lazy iterable,
        e.g. a terminal, as soon as it arrives): one translation per line, or with
        ``nbest > 1`` rows 'LINE<TAB>SCORE<TAB>TRANSLATION' (an empty line gives
        'LINE<TAB><TAB>')."""
        beam, alpha = self.search(beam, alpha)
        self.check_limits(beam, nbest, alpha)
        lines, first = iter(lines), 0  # first: the number of the chunk's first line
        while part := list(islice(lines, chunk)):
            if nbest == 1:
                yield "".join(text + "\n" for text in self.translate(part, beam, alpha))
            else:
                rows = []
                for i, hyps in enumerate(self.translate_nbest(part, beam, alpha, nbest), first):
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
                   greedy_ok: bool = True) -> list[list[Hypothesis]]:
        """Decode source id lists in length-sorted batches; results in input order.

        With ``beam=1, nbest=1, greedy_ok`` it runs greedy search, which returns the same
        tokens as a beam of 1 more cheaply but no score (reported as 0.0).
        """
        beam, alpha = self.search(beam, alpha)
        self.check_limits(beam, nbest, alpha)
        results: list[list[Hypothesis]] = [[] for _ in sources]
        greedy = greedy_ok and beam == 1 and nbest == 1
        widths = [len(s) for s in sources]
        if self.engine is not None:  # CTranslate2 runs its own threads
            batches = token_batches(widths, self.max_tokens, copies=beam)
            decoded_batches = (self.engine.search([sources[i] for i in batch], beam, alpha,
                                                  nbest, max_len_b) for batch in batches)
        else:  # one intra-op thread per stream: see aiayn.threads
            streams = self.streams or default_streams(self.device)
            batches = token_batches(widths, stream_budget(widths, self.max_tokens, beam,
                                                          streams), copies=beam)
            decoded_batches = parallel_map(
                lambda batch: self._search([sources[i] for i in batch], beam, alpha, nbest,
                                           max_len_b, greedy), batches,
                streams, self.threads_per_stream)
        for batch, decoded in zip(batches, decoded_batches, strict=True):
            for i, hyps in zip(batch, decoded, strict=True):
                results[i] = hyps
            if progress is not None:
                progress(len(batch))
        return results

    @torch.no_grad()
    def _search(self, rows: list[list[int]], beam, alpha, nbest, max_len_b, greedy
                ) -> list[list[Hypothesis]]:
        """aiayn's own search (``aiayn.decode``) over one batch of source id lists (on a
        stream's thread: grad mode and autocast are per thread, so both are set here)."""
        src = pad(rows).to(self.device)
        autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if self.bf16
                    else nullcontext())
        try:
            with autocast:
                if greedy:
                    return [[Hypothesis(ids, 0.0)]
                            for ids in greedy_decode(self.model, src, max_len_b)]
                return beam_search(self.model, src, beam, alpha, max_len_b, nbest)
        except (RuntimeError, MemoryError) as exc:
            if not is_out_of_memory(exc):
                raise
            raise AiaynError(
                f"out of memory decoding a batch of {len(rows)} sentence(s) x beam {beam} "
                f"({src.numel() * beam} padded tokens) on {self.device}; give a smaller "
                f"--max-tokens (now {self.max_tokens})") from None

    def check_limits(self, beam: int | None, nbest: int = 1, alpha: float | None = None
                     ) -> None:
        """``check_search`` of the search to run (``search``), and a beam the model and the
        batch budget can hold: at most the target vocabulary (more hypotheses than tokens
        cannot differ at the first step) and ``max_tokens // 2`` (one source of a word and
        EOS, times the beam, must fit)."""
        beam, alpha = self.search(beam, alpha)
        check_search(beam, nbest, alpha)
        vocab = (self.model.cfg.tgt_vocab_size if self.model is not None
                 else self.tokenizers.tgt_vocab_size)  # decode_ids needs no tokenizers
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

    def attention_of(self, model: Transformer, sentence: str, hypothesis: Sequence[int]
                     ) -> SentenceAttention:
        """Every attention map of ``model`` (this one's, or another with the same
        architecture, e.g. an earlier checkpoint's) teacher-forced on ``hypothesis``."""
        return on_one_thread(lambda: sentence_attention(model, self.tokenizers, sentence,
                                                        hypothesis))


def stream_budget(widths: Sequence[int], max_tokens: int, copies: int, streams: int) -> int:
    """The batch budget for decoding sentences of these widths on ``streams`` streams:
    ``max_tokens``, or less when they would not fill a batch per stream, so that a few
    sentences (a short file, the requests a server gathered) are cut into about one batch
    per stream and decode on every core rather than on one."""
    if streams <= 1 or len(widths) < 2:
        return max_tokens
    per_stream = -(-len(widths) // streams)
    return max(1, min(max_tokens, max(widths) * per_stream * copies))


def _one_line(sentence: str) -> str:
    """Line breaks inside a sentence would break the one-line-per-sentence contract."""
    return " ".join(sentence.splitlines()) if "\n" in sentence or "\r" in sentence else sentence


def _parameter_device(model: Transformer) -> torch.device:
    return next(model.parameters()).device


# ---------------------------------------------------------------- attention capture
@dataclass
class SentenceAttention:
    """One sentence's translation and every attention map of a teacher-forced pass over it."""

    source: str
    translation: str
    src_tokens: list[str]  # the encoder's input tokens (keys of encoder and cross attention)
    tgt_tokens: list[str]  # the decoder's input tokens, [BOS] + hypothesis
    maps: dict[str, list[np.ndarray]]  # kind -> one (H, T_q, T_k) array per layer


@torch.no_grad()
def sentence_attention(model, tokenizers, sentence: str, hypothesis: Sequence[int]
                       ) -> SentenceAttention:
    """Run ``model`` teacher-forced on ``sentence`` -> [BOS] + ``hypothesis`` (target ids
    without BOS/EOS, e.g. from beam search) and record the attention weights of every
    layer (explicit-weights path, eval mode: no dropout)."""
    src_ids = tokenizers.encode_src([sentence])[0]
    tgt_ids = [BOS_ID, *hypothesis]  # the decoder inputs that produced the hypothesis
    src_tokens = list(tokenizers.src_tokens(sentence))
    if len(src_tokens) != len(src_ids):
        raise AiaynError(f"the tokenizer gives {len(src_tokens)} source token strings for "
                         f"{len(src_ids)} source ids")
    tgt_tokens = [tokenizers.tgt_id_to_token(i) for i in tgt_ids]
    max_len = model.cfg.max_len
    if len(src_ids) > max_len or len(tgt_ids) > max_len:
        raise AiaynError(f"the sentence ({len(src_ids)} tokens) or its translation "
                         f"({len(tgt_ids)}) is longer than the model's max_len={max_len}")
    translation = tokenizers.decode_tgt([list(hypothesis)])[0]
    device = _parameter_device(model)
    src = torch.tensor([src_ids], dtype=torch.long, device=device)
    tgt = torch.tensor([tgt_ids], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        with capture_attention(model) as maps:
            model(src, tgt)
    finally:
        model.train(was_training)
    arrays = {kind: [m[0].float().cpu().numpy() for m in layer_maps]
              for kind, layer_maps in maps.items()}
    return SentenceAttention(sentence, translation, src_tokens, tgt_tokens, arrays)


# ---------------------------------------------------------------- attention over training
class CheckpointModels:
    """Models holding the weights of a run's checkpoints, each loaded when first asked for
    and kept for the ``size`` most recently used. They are models of their own, never the
    one that translates: a server keeps answering with its weights meanwhile."""

    def __init__(self, cfg, size: int = 3):
        self.cfg, self.size = cfg, max(1, size)
        self._models: dict[Path, Transformer] = {}

    def get(self, path: str | Path) -> Transformer:
        path = Path(path)
        model = self._models.pop(path, None)
        if model is None:
            if len(self._models) >= self.size:
                del self._models[next(iter(self._models))]  # the least recently used
            model = Transformer(self.cfg)
            load_weights(model, path)
            model.eval()
        self._models[path] = model  # now the most recently used
        return model


@dataclass
class StepAttention:
    """One sentence's cross-attention in one decoder layer at each saved step of a run, all
    over the same target (teacher-forced), so that every panel has the same axes."""

    source: str
    translation: str  # the target every checkpoint is given
    src_tokens: list[str]  # columns (keys)
    tgt_tokens: list[str]  # rows (queries): [BOS] + the target
    layer: int  # the decoder layer, from 0
    n_layers: int
    steps: list[int | None]  # per checkpoint; None: last.safetensors without a step
    files: list[Path]
    maps: list[np.ndarray]  # per checkpoint: (heads, T_q, T_k)
    bleu: list[float | None]  # the dev BLEU metrics.jsonl has at that step


def check_layer(layer: int | None, n_layers: int) -> int:
    """--layer (from 1; None: the last) as an index from 0, or an AiaynError."""
    if layer is None:
        return n_layers - 1
    if not 1 <= layer <= n_layers:
        raise AiaynError(f"--layer must be between 1 and {n_layers} (the model's decoder "
                         f"layers), got {layer}")
    return layer - 1


def attention_over_steps(run_dir: str | Path, sentence: str, target: str | None = None,
                         layer: int | None = None, weights: str | Path = "best",
                         beam: int = 1, alpha: float | None = None,
                         progress: Callable[[int], object] | None = None) -> StepAttention:
    """The cross-attention of ``sentence`` at each of the run's saved steps (``step_weights``:
    its step checkpoints and last.safetensors), in step order. The target is the same in
    every checkpoint: ``target`` if given, else the translation by ``weights`` (search
    ``beam``, ``alpha``). ``layer``: the decoder layer, from 1 (None: the last).
    ``progress(1)`` is called after each checkpoint."""
    if not sentence.strip():
        raise AiaynError("the sentence to translate is empty")
    saved = step_weights(run_dir)  # before loading anything: a run without them says so
    translator = Translator.from_pretrained(run_dir, weights=weights)
    n_layers = translator.model.cfg.n_decoder_layers
    index = check_layer(layer, n_layers)
    hypothesis = translator.target_ids(sentence, target, beam=beam, alpha=alpha)
    models = CheckpointModels(translator.model.cfg, size=1)
    maps, first = [], None
    for _, path in saved:
        att = translator.attention_of(models.get(path), sentence, hypothesis)
        first = first or att
        maps.append(att.maps["cross"][index])
        if progress is not None:
            progress(1)
    bleu = {r["step"]: r.get("bleu") for r in read_metrics(run_dir, missing_ok=True)
            if r["kind"] == "dev"}
    steps = [step for step, _ in saved]
    return StepAttention(sentence, first.translation, first.src_tokens, first.tgt_tokens,
                         index, n_layers, steps, [path for _, path in saved], maps,
                         [bleu.get(step) for step in steps])
