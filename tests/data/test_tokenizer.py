"""Tokenizers: fixed special ids, BOS/EOS framing, exact round trips (accented Spanish
included), WordLevel's min_frequency, save/load, determinism."""

from __future__ import annotations

import dataclasses
import json

import pytest

from aiayn.config import DataConfig
from aiayn.data.tokenizer import (
    BOS,
    BOS_ID,
    EOS,
    EOS_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    UNK_ID,
    Tokenizers,
    _batch_ids,
    train_tokenizers,
)
from aiayn.errors import AiaynError

PAIRS = [
    ("In the beginning, God created the heavens and the earth.",
     "EN el principio crió Dios los cielos y la tierra."),
    ("The earth was formless and empty.", "Y la tierra estaba desordenada y vacía."),
    ("“Where are you?” he asked.", "¿Dónde estás? le preguntó él."),
    ("Don’t be afraid; I am with you.", "No temas, porque yo estoy contigo."),
    ("The children of Israel went to Zion.", "Los hijos de Israel fueron á Sión."),
    ("Jesus wept.", "Y lloró Jesús."),
    ("He said: peace be with you, 12 times!", "Él dijo: ¡paz á vosotros, 12 veces!"),
    ("The mother and the son ate bread.", "La madre y el niño comieron pan."),
] * 3

NEW_SENTENCES = [  # unseen sentences made of seen characters
    "¿Dónde está el niño? Él comió pan y lloró.",
    "Sión, la tierra vacía: ¡paz!",
    "“Jesus,” he said, “where is the bread?”",
]

CONFIGS = {
    "bpe-joint": DataConfig(vocab_size=300, min_frequency=1),
    "bpe-separate": DataConfig(vocab_size=200, min_frequency=1, joint_vocab=False),
    "wordlevel-joint": DataConfig(tokenizer="wordlevel", vocab_size=300, min_frequency=1),
    "wordlevel-separate": DataConfig(tokenizer="wordlevel", vocab_size=300, min_frequency=1,
                                     joint_vocab=False),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tokenizers(request) -> Tokenizers:
    return train_tokenizers(PAIRS, CONFIGS[request.param])


def test_special_tokens_have_fixed_ids(tokenizers):
    for tok in (tokenizers.src, tokenizers.tgt):
        assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert tokenizers.tgt_id_to_token(PAD_ID) == "[PAD]"
    assert tokenizers.tgt_id_to_token(UNK_ID) == "[UNK]"


def test_joint_means_one_vocabulary(tokenizers):
    assert tokenizers.joint == (tokenizers.src is tokenizers.tgt)
    if tokenizers.joint:
        assert tokenizers.src_vocab_size == tokenizers.tgt_vocab_size
    else:
        assert "▁Dios" not in tokenizers.src.get_vocab()
        assert "▁Dios" in tokenizers.tgt.get_vocab()


def test_source_ends_with_eos_and_target_is_framed(tokenizers):
    src = tokenizers.encode_src(["Jesus wept.", ""])
    tgt = tokenizers.encode_tgt(["Y lloró Jesús.", ""])
    assert src[0][-1] == EOS_ID and EOS_ID not in src[0][:-1] and src[1] == [EOS_ID]
    assert tgt[0][0] == BOS_ID and tgt[0][-1] == EOS_ID and tgt[1] == [BOS_ID, EOS_ID]
    assert tokenizers.src_tokens("Jesus wept.")[-1] == EOS
    assert tokenizers.tgt_tokens("Y lloró Jesús.")[0] == BOS
    assert [tokenizers.tgt_id_to_token(i) for i in tgt[0][1:-1]] == \
        tokenizers.tgt_tokens("Y lloró Jesús.")[1:-1]


def test_round_trip_gives_the_text_back(tokenizers):
    seen = [t for _, t in PAIRS[:8]]
    assert tokenizers.decode_tgt(tokenizers.encode_tgt(seen)) == seen
    assert tokenizers.decode_src(tokenizers.encode_src([s for s, _ in PAIRS[:8]])) == \
        [s for s, _ in PAIRS[:8]]


def test_bpe_round_trip_on_unseen_accented_sentences():
    """BPE falls back to characters, so any sentence of seen characters comes back exactly
    (the normalization: NFC, single spaces, no outer spaces)."""
    tok = train_tokenizers(PAIRS, CONFIGS["bpe-joint"])
    ids = tok.encode_tgt(NEW_SENTENCES)
    assert UNK_ID not in {i for seq in ids for i in seq}
    assert tok.decode_tgt(ids) == NEW_SENTENCES
    decomposed = "nin\u0303o"  # "niño" typed with a combining tilde comes back composed
    assert tok.decode_tgt(tok.encode_tgt([decomposed])) == ["niño"]


def test_unknown_pieces_stay_visible(tokenizers):
    ids = tokenizers.encode_tgt(["Y lloró ☃"])[0]
    assert UNK_ID in ids
    assert "[UNK]" in tokenizers.decode_tgt([ids])[0]


def test_decode_cuts_at_eos_and_drops_padding(tokenizers):
    ids = tokenizers.encode_tgt(["Y lloró Jesús."])[0]
    noisy = ids + [PAD_ID, PAD_ID] + tokenizers.encode_tgt(["pan"])[0][1:]
    assert tokenizers.decode_tgt([noisy, ids[1:]]) == ["Y lloró Jesús."] * 2


def test_wordlevel_min_frequency_leaves_rare_words_out():
    pairs = [("common word", "palabra común")] * 3 + [("rare", "rara")]
    tok = train_tokenizers(pairs, DataConfig(tokenizer="wordlevel", min_frequency=2))
    vocab = tok.src.get_vocab()
    assert "▁common" in vocab and "▁rare" not in vocab and "▁rara" not in vocab
    assert tok.encode_src(["rare"])[0] == [UNK_ID, EOS_ID]


def test_vocab_size_is_respected():
    tok = train_tokenizers(PAIRS, DataConfig(vocab_size=120, min_frequency=1))
    assert tok.src_vocab_size <= 120


def test_save_and_load(tokenizers, tmp_path):
    tokenizers.save(tmp_path / "tok")
    files = sorted(p.name for p in (tmp_path / "tok").iterdir())
    assert files == (["joint.json", "meta.json"] if tokenizers.joint else
                     ["meta.json", "src.json", "tgt.json"])
    meta = json.loads((tmp_path / "tok" / "meta.json").read_text())
    assert meta["joint"] == tokenizers.joint and meta["kind"] == tokenizers.kind
    loaded = Tokenizers.load(tmp_path / "tok")
    assert loaded.joint == tokenizers.joint and loaded.kind == tokenizers.kind
    assert loaded.encode_src(NEW_SENTENCES) == tokenizers.encode_src(NEW_SENTENCES)
    assert loaded.encode_tgt(NEW_SENTENCES) == tokenizers.encode_tgt(NEW_SENTENCES)


def test_saving_again_replaces_the_other_layout(tmp_path):
    joint = train_tokenizers(PAIRS, CONFIGS["bpe-joint"])
    separate = train_tokenizers(PAIRS, CONFIGS["bpe-separate"])
    separate.save(tmp_path)
    joint.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["joint.json", "meta.json"]
    assert Tokenizers.load(tmp_path).joint


def test_training_is_deterministic():
    for cfg in CONFIGS.values():
        a, b = train_tokenizers(PAIRS, cfg), train_tokenizers(PAIRS, cfg)
        assert a.src.to_str() == b.src.to_str() and a.tgt.to_str() == b.tgt.to_str()


def test_load_errors_are_clear(tmp_path):
    with pytest.raises(AiaynError, match="no tokenizer here"):
        Tokenizers.load(tmp_path)
    train_tokenizers(PAIRS, CONFIGS["bpe-joint"]).save(tmp_path)
    (tmp_path / "joint.json").unlink()
    with pytest.raises(AiaynError, match="joint.json: tokenizer file missing"):
        Tokenizers.load(tmp_path)


def test_bad_settings():
    with pytest.raises(AiaynError, match="data.tokenizer"):
        train_tokenizers(PAIRS, dataclasses.replace(DataConfig(), tokenizer="unigram"))
    with pytest.raises(AiaynError, match="no sentences"):
        train_tokenizers([], DataConfig())
    with pytest.raises(TypeError):
        train_tokenizers(PAIRS, DataConfig()).encode_src("not a list")


def test_text_that_is_no_unicode_is_one_line_naming_the_sentence():
    """A lone surrogate (JSON's "\\ud800", or a file's bad byte read with surrogateescape)
    is no text the tokenizer can read: an AiaynError that says which sentence, not its
    TypeError."""
    tokenizers = train_tokenizers(PAIRS, DataConfig())
    with pytest.raises(AiaynError, match=r"sentence 2 is not valid Unicode: '\\udcff' at "
                                         r"character 4"):
        tokenizers.encode_src(["fine", "bad\udcffbyte"])
    assert tokenizers.encode_src(["fine"]) == tokenizers.encode_src(["fine"])  # still works


def test_ids_are_those_of_the_tokenizers_full_encoding_with_or_without_its_fast_batch():
    """Encoding leaves out the character offsets where the tokenizers library can
    (``encode_batch_fast``, asked where it exists): the ids are ``encode_batch``'s; a library
    without it (an older one) is asked ``encode_batch``."""
    tok = train_tokenizers(PAIRS, DataConfig()).src
    texts = [src for src, _ in PAIRS] + ["  doubled  spaces ", ""]
    full = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    assert _batch_ids(tok, texts) == full

    class Older:  # the library's Tokenizer before encode_batch_fast
        encode_batch = tok.encode_batch

    assert _batch_ids(Older(), texts) == full
    asked = []

    class Newer(Older):
        def encode_batch_fast(self, texts, add_special_tokens):
            asked.append(len(texts))
            return tok.encode_batch_fast(texts, add_special_tokens=add_special_tokens)

    assert _batch_ids(Newer(), texts) == full and asked == [len(texts)]
