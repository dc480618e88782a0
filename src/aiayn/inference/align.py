"""Word alignments from the cross-attention: which source word each target word came from.

The translation's cross-attention (one decoder layer, its heads averaged: the choice and
how it was made are in docs/translating.md#word-alignments) is a (target pieces x source
pieces) matrix. Pieces are grouped into words, and each target word is linked to the source
word it attends to most, as in fairseq's hard alignment and Marian's: the attention its
pieces give each source word's pieces, summed over the source pieces (the mass on a word)
and averaged over the target pieces (a long word counts no more than a short one).

Words are whitespace-separated: source word i is ``sentence.split()[i]`` and target word j
is ``translation.split()[j]``, so the pairs index the text a user gave and got back, not the
tokenizer's pieces. The pairs are written in the Pharaoh format of fast_align, Moses and
Marian: ``i-j`` (source-target, from 0), space-separated.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from aiayn.data.batching import token_batches
from aiayn.data.directions import TAG_PATTERN
from aiayn.inference.attention import cross_attention

if TYPE_CHECKING:
    from aiayn.inference.search import Hypothesis

SPACE = "\u2581"  # "▁": the Metaspace pre-tokenizer's start of a word (aiayn.data.tokenizer)
Alignment = list[tuple[int, int]]  # (source word, target word) pairs, from 0


def text_words(text: str, offsets: Sequence[tuple[int, int]]) -> list[int]:
    """The whitespace-separated word of ``text`` that each piece belongs to, from the
    pieces' character ``offsets`` into ``text`` (``tokenizers``' ``Encoding.offsets``): the
    word holding the piece's first non-space character at or after its start (a piece
    "▁Lord" spans the space before "Lord"; a lone "▁" belongs to the word after it); -1
    for a piece with no word there (trailing spaces)."""
    word_of = np.full(len(text) + 1, -1, dtype=np.int64)  # per character; spaces: -1
    for index, match in enumerate(re.finditer(r"\S+", text)):
        word_of[match.start():match.end()] = index
    # The next word at or after each character: scan from the end.
    next_word = word_of.copy()
    for k in range(len(text) - 1, -1, -1):
        if next_word[k] < 0:
            next_word[k] = next_word[k + 1]
    return [int(next_word[min(start, len(text))]) for start, _ in offsets]


def piece_words(pieces: Sequence[str]) -> list[int]:
    """The word of each target piece, from the pieces alone, as the Metaspace decoder
    joins them into the translation's text: a piece that starts with "▁" starts a new word
    once the current one has something visible (so "▁", "." is the word "."); any other
    piece continues the current word. -1 for pieces of an empty last word (a trailing
    "▁"), which the text does not show."""
    words, word, visible = [], -1, False
    for piece in pieces:
        if word < 0 or (piece.startswith(SPACE) and visible):
            word, visible = word + 1, False
        visible = visible or bool(piece.lstrip(SPACE).strip())
        words.append(word)
    if not visible:  # the last word shows nothing: no word of the text
        words = [-1 if w == word else w for w in words]
    return words


def word_alignment(attention: np.ndarray, src_words: Sequence[int],
                   tgt_words: Sequence[int]) -> Alignment:
    """One (source word, target word) pair per target word, in target order.

    ``attention``: (target pieces, source pieces) weights, row j being the attention of the
    step that produced target piece j (the [EOS] row and column left out by the caller);
    ``src_words``/``tgt_words``: the word of each piece (-1: none, left out). The score of
    source word i for target word j sums the weights on i's pieces and averages that over
    j's pieces; j is linked to the best-scoring i (the first of equals)."""
    attention = np.asarray(attention, dtype=np.float64)
    src_words, tgt_words = np.asarray(src_words), np.asarray(tgt_words)
    if attention.shape != (len(tgt_words), len(src_words)):
        raise ValueError(f"attention of shape {attention.shape} for {len(tgt_words)} target "
                         f"and {len(src_words)} source pieces")
    n_src = int(src_words.max()) + 1 if len(src_words) else 0
    n_tgt = int(tgt_words.max()) + 1 if len(tgt_words) else 0
    if n_src == 0 or n_tgt == 0:
        return []
    # Pieces x words indicator matrices: sum over source pieces, mean over target pieces.
    src_onehot = (src_words[:, None] == np.arange(n_src)[None, :]).astype(np.float64)
    tgt_onehot = (tgt_words[:, None] == np.arange(n_tgt)[None, :]).astype(np.float64)
    counts = tgt_onehot.sum(axis=0)
    scores = tgt_onehot.T @ attention @ src_onehot / np.maximum(counts, 1)[:, None]
    return [(int(scores[j].argmax()), j) for j in range(n_tgt) if counts[j] > 0]


def pharaoh(alignment: Iterable[tuple[int, int]]) -> str:
    """Pairs in the Pharaoh format: "0-0 1-2 2-1" (source-target, from 0)."""
    return " ".join(f"{i}-{j}" for i, j in alignment)


def parse_pharaoh(text: str) -> Alignment:
    """The pairs of a Pharaoh line ("0-0 1-2"; "0?1", a possible link, reads as a link)."""
    pairs = []
    for item in text.split():
        i, sep, j = item.replace("?", "-").partition("-")
        if not sep or not i.isdigit() or not j.isdigit():
            raise ValueError(f"not a Pharaoh pair (i-j): {item!r}")
        pairs.append((int(i), int(j)))
    return pairs


def alignment_error_rate(predicted: Iterable[tuple[int, int]], sure: Iterable[tuple[int, int]],
                         possible: Iterable[tuple[int, int]] = ()) -> float:
    """AER = 1 - (|A & S| + |A & P|) / (|A| + |S|) (Och and Ney, 2003), with the sure links
    S counted among the possible ones P; 0 is a perfect alignment. Summed over a corpus,
    pass every sentence's pairs tagged with its number (e.g. (k, i, j) triples)."""
    a, s = set(predicted), set(sure)
    p = set(possible) | s
    if not a and not s:
        return 0.0
    return 1.0 - (len(a & s) + len(a & p)) / (len(a) + len(s))


# ---------------------------------------------------------------- a translator's alignments
# ``translator``: an aiayn.inference.translator.Translator, whose model and tokenizers these
# read (not imported: the translator imports this module).
def hypothesis_alignments(translator, sources, hyps: Sequence[list[Hypothesis]], nbest: int
                          ) -> list[list[Alignment]]:
    """The word alignment of each of the first ``nbest`` hypotheses of each sentence a
    translator prepared (``sources``: its ``Sources``, in ``Translator.decode_ids``' order:
    ``sources.todo``), as
    ``Translator.finish`` lays them out: in the input order, an empty list for an empty
    sentence."""
    rows = [(k, n) for k, sentence_hyps in enumerate(hyps)
            for n in range(min(nbest, len(sentence_hyps)))]
    links = align_ids(translator, [sources.texts[k] for k, _ in rows],
                      [sources.ids[k] for k, _ in rows], [hyps[k][n].ids for k, n in rows])
    results: list[list[Alignment]] = [[] for _ in range(sources.count)]
    for (k, _), alignment in zip(rows, links, strict=True):
        results[sources.todo[k]].append(alignment)
    return results


def align_ids(translator, texts: Sequence[str], sources: Sequence[list[int]],
              targets: Sequence[Sequence[int]]) -> list[Alignment]:
    """The word alignment of each source text (one line) with its ids (tokens + EOS, as
    ``Translator.source_ids`` gives them, truncated or not) and target ids (no BOS or EOS, e.g. a
    search's hypothesis): a teacher-forced pass over the target records the
    cross-attention of ``alignment_layer`` (heads averaged), which ``word_alignment``
    turns into word pairs. Batched by ``decode_tokens``; one pass at a time, since the
    capture sets flags on the model's attention modules."""
    translator.check_alignments()
    layer = translator.alignment_layer()
    results: list[Alignment] = [[] for _ in texts]
    widths = [max(len(s), len(t) + 1) for s, t in zip(sources, targets, strict=True)]
    for batch in token_batches(widths, translator.decode_tokens):
        maps = cross_attention(translator.model, [sources[i] for i in batch],
                               [targets[i] for i in batch], layer)
        for i, attention in zip(batch, maps, strict=True):
            text, target = texts[i], targets[i]
            # A direction tag the translator put in front is no word of the text.
            lead = int(bool(translator.tags) and not TAG_PATTERN.match(text))
            pieces = len(sources[i]) - 1 - lead  # the text's tokens, tag and EOS left out
            src_words = text_words(text, translator.tokenizers.src_offsets(text))[:pieces]
            # (a target longer than max_len - 1 keeps the rows the model could give it)
            tgt_words = piece_words([translator.tokenizers.tgt_id_to_token(t)
                                     for t in target])[:len(attention)]
            results[i] = word_alignment(attention[:, lead:lead + pieces], src_words,
                                        tgt_words)
    return results
