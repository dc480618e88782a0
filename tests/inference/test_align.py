"""Word alignments (aiayn.inference.align, Translator.translate_aligned, `aiayn translate
--alignments`): pieces grouped into words, the word pairs of an attention matrix, the
Pharaoh format, and a model that reverses digit strings aligning them on the anti-diagonal."""

from __future__ import annotations

import random
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import error_line, run_cli

from aiayn.config import (
    Config,
    DataConfig,
    DecodeConfig,
    ModelConfig,
    TrainConfig,
    alignment_layer_index,
    save_config,
)
from aiayn.data.tokenizer import train_tokenizers
from aiayn.errors import AiaynError
from aiayn.inference.align import (
    align_ids,
    alignment_error_rate,
    parse_pharaoh,
    pharaoh,
    piece_words,
    text_words,
    word_alignment,
)
from aiayn.inference.attention import cross_attention
from aiayn.inference.ct2 import CTranslate2Engine
from aiayn.inference.translator import Translator
from aiayn.runs.checkpoint import save_weights
from aiayn.training.toy import digit_pairs, train_toy


# ---------------------------------------------------------------- pieces to words
def test_source_pieces_map_to_the_whitespace_words_by_their_offsets():
    text = "The  Lord, is\u00a0my shepherd. "
    # The pieces of a Metaspace BPE: "▁Lord" spans the space before it; a lone "▁" (the
    # doubled space) belongs to the word after it; the trailing "▁" to none.
    offsets = [(0, 3), (3, 4), (4, 9), (9, 10), (10, 13), (13, 16), (16, 25), (25, 26),
               (26, 27)]
    assert text_words(text, offsets) == [0, 1, 1, 1, 2, 3, 4, 4, -1]
    assert text.split()[1] == "Lord," and text.split()[4] == "shepherd."


def test_target_pieces_map_to_the_words_of_the_decoded_text():
    pieces = ["▁Jeho", "vá", "▁es", "▁", ".", "[UNK]", "▁", "▁mi", "▁"]
    # "Jehová es .[UNK] mi": "▁" then "." is the word ".", [UNK] is glued to it as the
    # Metaspace decoder glues it, "▁", "▁mi" is one word, the trailing "▁" shows nothing.
    assert piece_words(pieces) == [0, 0, 1, 2, 2, 2, 3, 3, -1]
    assert piece_words([]) == []


def test_target_words_are_those_of_the_translation_text():
    """Whatever pieces a search emits, piece_words counts the words the text shows: on a
    BPE vocabulary (word pieces, lone "▁", punctuation pieces) and random piece ids."""
    text = ["the cat sat on the mat.", "a dog , a log !", "catalogues of dogmas; sat"]
    tok = train_tokenizers([(t, t) for t in text], DataConfig(tokenizer="bpe", vocab_size=60,
                                                              min_frequency=1))
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(4, tok.tgt_vocab_size) for _ in range(rng.randint(1, 8))]
        ids = [1, *ids] if rng.random() < 0.2 else ids  # [UNK] as the first piece
        words = piece_words([tok.tgt_id_to_token(i) for i in ids])
        assert max(words, default=-1) + 1 == len(tok.decode_tgt([ids])[0].split()), ids
    # and the source pieces of a sentence map to its whitespace words by their offsets
    for sentence in ["the  cat sat,on the mat .", "dogmas catalogues"]:
        words = text_words(sentence, tok.src_offsets(sentence))
        pieces = tok.src_tokens(sentence)[:-1]
        for k in range(len(sentence.split())):
            word = "".join(p for p, w in zip(pieces, words, strict=True) if w == k)
            assert word.replace("▁", "") == sentence.split()[k]


# ---------------------------------------------------------------- pairs of an attention matrix
def test_each_target_word_gets_the_source_word_its_pieces_attend_to_most():
    # Source pieces: w0 = [0], w1 = [1, 2], w2 = [3]; target pieces: v0 = [0, 1], v1 = [2].
    attention = np.array([
        [0.1, 0.3, 0.3, 0.3],  # w1 has 0.6 over its two pieces: summed, it beats w2's 0.3
        [0.5, 0.1, 0.1, 0.3],  # v0 averaged over its pieces: w0 0.3, w1 0.4, w2 0.3
        [0.1, 0.1, 0.1, 0.7],
    ])
    assert word_alignment(attention, [0, 1, 1, 2], [0, 0, 1]) == [(1, 0), (2, 1)]
    # A piece of no word (-1) counts for nothing: alone, v0's first piece picks w1.
    assert word_alignment(attention, [0, 1, 1, 2], [0, -1, 1]) == [(1, 0), (2, 1)]
    assert word_alignment(attention[:, :1], [0], [0, 0, 1]) == [(0, 0), (0, 1)]
    assert word_alignment(np.zeros((0, 4)), [0, 1, 1, 2], []) == []
    with pytest.raises(ValueError, match="shape"):
        word_alignment(attention, [0, 1], [0, 0, 1])


def test_pharaoh_format_round_trips_and_aer_is_och_and_neys():
    pairs = [(2, 0), (1, 1), (0, 2)]
    assert pharaoh(pairs) == "2-0 1-1 0-2" and pharaoh([]) == ""
    assert parse_pharaoh("2-0 1-1  0-2\n") == pairs and parse_pharaoh("0?1") == [(0, 1)]
    with pytest.raises(ValueError, match="Pharaoh"):
        parse_pharaoh("0-a")
    assert alignment_error_rate(pairs, pairs) == 0.0
    assert alignment_error_rate([(0, 0)], pairs) == 1.0
    # 1 - (|A & S| + |A & P|) / (|A| + |S|), S within P: (1 + 2) / (3 + 2)
    assert alignment_error_rate([(2, 0), (1, 1), (1, 2)], [(2, 0), (0, 2)],
                                [(1, 1)]) == pytest.approx(1 - 3 / 5)


# ---------------------------------------------------------------- the reversal toy
def reversal_config(alignment_layer: int = -1) -> Config:
    """The walkthrough's toy model (2 + 2 layers, d_model 64, 4 heads), as small as keeps
    the test quick and still learns to reverse most held-out strings; its alignments from
    the last layer (which this toy aligns best with, unlike real text: the default 0 is the
    layer below)."""
    return Config(
        model=ModelConfig(src_vocab_size=14, tgt_vocab_size=14, d_model=64, n_heads=4,
                          d_ff=128, n_encoder_layers=2, n_decoder_layers=2, dropout=0.1,
                          max_len=16, tie_embeddings="all"),
        train=TrainConfig(max_tokens=512, warmup_steps=200, lr_scale=0.25, bf16="false",
                          seed=0),
        decode=DecodeConfig(beam=1, alignment_layer=alignment_layer)).validate()


@pytest.fixture(scope="module")
def reversal():
    # Strings of 3 to 6 digits: 300 steps teach most of them (about 10 s on one core).
    pairs = digit_pairs("reverse", 3100, lengths=(3, 6), seed=0)
    run = train_toy(reversal_config(), pairs[:3000], pairs[3000:], steps=300, eval_every=300)
    return run, pairs[3000:]


def corpus_aer(translator: Translator, held_out: list[tuple[str, str]]) -> float:
    """AER over the held-out strings, each aligned with its right answer (teacher-forced):
    target digit j comes from source digit n - 1 - j."""
    sources = [s for s, _ in held_out]
    targets = [ids[1:-1] for ids in translator.tokenizers.encode_tgt([t for _, t in held_out])]
    links = align_ids(translator, sources, translator.tokenizers.encode_src(sources), targets)
    predicted = {(k, i, j) for k, pairs in enumerate(links) for i, j in pairs}
    sure = {(k, len(s.split()) - 1 - j, j) for k, s in enumerate(sources)
            for j in range(len(s.split()))}
    return alignment_error_rate(predicted, sure)


def test_the_reversal_toy_aligns_on_the_anti_diagonal(reversal):
    run, held_out = reversal
    translator = Translator(run.model, run.tokenizers, decode=run.config.decode)
    # The last layer's heads averaged are the anti-diagonal; the layer below, which the
    # default (0) takes, is far from it here (docs/translating.md#word-alignments).
    last = corpus_aer(translator, held_out)
    translator.decode = DecodeConfig(beam=1)
    below = corpus_aer(translator, held_out)
    translator.decode = DecodeConfig(beam=1, alignment_layer=1)
    assert corpus_aer(translator, held_out) == below
    assert last <= 0.1 < 0.2 < below
    # A translation's own alignment: one pair per output word, within both sentences.
    translator.decode = run.config.decode
    source = "3 1 4 1 5 9"
    (text, links), = translator.translate_aligned([source])
    assert [j for _, j in links] == list(range(len(text.split())))
    if text == "9 5 1 4 1 3":
        assert alignment_error_rate(links, [(5 - j, j) for j in range(6)]) <= 1 / 3


def test_cross_attention_is_the_captured_map_of_a_teacher_forced_pass(reversal):
    """The batched, padded pass gives each pair the weights of its pass alone."""
    run, held_out = reversal
    tok = run.tokenizers
    sources = tok.encode_src([s for s, _ in held_out[:5]])
    targets = [ids[1:-1] for ids in tok.encode_tgt([t for _, t in held_out[:5]])]
    together = cross_attention(run.model, sources, targets, 1)
    for src, tgt, weights in zip(sources, targets, together, strict=True):
        alone, = cross_attention(run.model, [src], [tgt], 1)
        assert weights.shape == (len(tgt), len(src))
        # padding changes the sums' order and lengths: float32 rounding only
        np.testing.assert_allclose(weights, alone, atol=1e-5)
        np.testing.assert_allclose(weights.sum(axis=1), 1.0, atol=1e-5)
    # A given target longer than the model's max_len: the words it has rows for are linked.
    translator = Translator(run.model, tok)
    source = "1 2 3"
    target = tok.encode_tgt([" ".join("7" * 20)])[0][1:-1]
    links, = align_ids(translator, [source], tok.encode_src([source]), [target])
    assert [j for _, j in links] == list(range(run.config.model.max_len))  # max_len rows


# ---------------------------------------------------------------- translate --alignments
@pytest.fixture(scope="module")
def reversal_dir(reversal, tmp_path_factory):
    """The reversal toy as a run directory that `aiayn translate` reads."""
    run, _ = reversal
    directory = tmp_path_factory.mktemp("reversal")
    save_config(run.config, directory / "config.yaml")
    run.tokenizers.save(directory / "tokenizer")
    save_weights(run.model, directory / "best.safetensors")
    return directory


def test_translate_alignments_prints_the_translation_a_tab_and_pharaoh_pairs(
        reversal, reversal_dir, capsys, monkeypatch):
    _, held_out = reversal
    lines = [s for s, _ in held_out[:20]] + [""]
    code, out, _ = run_cli(["translate", str(reversal_dir), "--alignments"], capsys,
                           "\n".join(lines) + "\n", monkeypatch)
    assert code == 0
    rows = out.splitlines()
    translator = Translator.from_pretrained(reversal_dir)
    expected = translator.translate_aligned(lines)
    assert [tuple(row.split("\t")) for row in rows] == [(t, pharaoh(a)) for t, a in expected]
    assert [t for t, _ in expected] == translator.translate(lines)
    assert rows[-1] == "\t"  # an empty line: no translation, no pairs
    for line, (text, links) in zip(lines[:-1], expected, strict=False):
        assert [j for _, j in links] == list(range(len(text.split())))  # one per word
        assert all(0 <= i < len(line.split()) for i, _ in links)
    # The strings it reverses right are aligned on the anti-diagonal.
    right = [(k, line) for k, (line, (text, _)) in enumerate(zip(lines, expected))
             if line and text.split() == line.split()[::-1]]
    assert len(right) >= 10
    predicted = {(k, i, j) for k, _ in right for i, j in expected[k][1]}
    sure = {(k, len(line.split()) - 1 - j, j) for k, line in right
            for j in range(len(line.split()))}
    assert alignment_error_rate(predicted, sure) <= 0.1
    # With --nbest the pairs are a fourth column of each row.
    code, out, _ = run_cli(["translate", str(reversal_dir), "--alignments", "--beam", "2",
                            "--nbest", "2"], capsys, lines[0] + "\n\n", monkeypatch)
    rows = [row.split("\t") for row in out.splitlines()]
    assert [row[0] for row in rows] == ["0", "0", "1"] and rows[-1] == ["1", "", "", ""]
    best, = translator.translate_aligned(lines[:1], translator.resolve(beam=2))
    assert rows[0][2:] == [best[0], pharaoh(best[1])]


def test_alignments_need_aiayns_model_and_a_decoder_layer(reversal_dir, tmp_path, capsys,
                                                         monkeypatch):
    translator = Translator.from_pretrained(reversal_dir)
    # What an engine without aiayn's model answers (a class-level answer: no export needed).
    translator.engine = SimpleNamespace(require_model=CTranslate2Engine.require_model)
    with pytest.raises(AiaynError, match="aiayn's own model"):
        translator.check_alignments()
    with pytest.raises(AiaynError, match=r"decode.alignment_layer must be a decoder layer, "
                                         r"1 to 1 or -1 \(the last\) to -1, or 0 \(the "
                                         r"layer below the last\), got 2"):
        Config(decode=DecodeConfig(alignment_layer=2),
               model=ModelConfig(n_decoder_layers=1)).validate()
    # 0, the default, is the layer below the last, or the only one.
    assert [alignment_layer_index(layer, 6) for layer in (0, 1, 6, -1, -6)] == [4, 0, 5, 5, 0]
    assert alignment_layer_index(0, 1) == 0
    # A run whose config names a layer its model has not: one line naming the setting.
    copy = tmp_path / "run"
    shutil.copytree(reversal_dir, copy)
    config = (copy / "config.yaml").read_text(encoding="utf-8")
    assert "alignment_layer: -1" in config
    (copy / "config.yaml").write_text(config.replace("alignment_layer: -1",
                                                     "alignment_layer: -3"), encoding="utf-8")
    code, _, err = run_cli(["translate", str(copy), "--alignments"], capsys, "1 2\n",
                           monkeypatch)
    assert code != 0 and "decode.alignment_layer must be a decoder layer" in error_line(err)
