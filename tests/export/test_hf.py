"""`aiayn export --to hf` (aiayn.export.hf): the Transformers (Marian) model computes aiayn's
function: logits of random models with every weight perturbed (so LayerNorm gains, biases
and the residual permutation all matter), the tokenizer, and decoded tokens of the
trained copy model (tests/conftest.py's run_dir). Hub access stays off (export_helpers):
every load reads the local directory."""

from __future__ import annotations

import pytest
import torch
from export_helpers import (
    LANGUAGES,
    PRESETS,
    SENTENCES,
    TEXTS,
    load_hf,
    needs_hf,
    preset_switches,
    random_run,
    strip,
    strip_all,
    teacher_forced,
)

from aiayn.data.batching import pad
from aiayn.data.tokenizer import Tokenizers
from aiayn.export.command import export_run
from aiayn.export.hf import HF_CODE, residual_permutation
from aiayn.inference.search import beam_search, greedy_decode
from aiayn.inference.translator import Translator
from aiayn.model import sinusoid_table
from aiayn.runs.directory import load_run


# ---------------------------------------------------------------- the permutation
def test_the_permutation_turns_aiayn_sinusoids_into_marians_layout():
    d = 16
    table = sinusoid_table(10, d)
    marian = table[:, residual_permutation(d)]
    position = torch.arange(10, dtype=torch.float64)[:, None]
    angle = position / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    expected = torch.cat([angle.sin(), angle.cos()], dim=1).float()  # [sin | cos]
    assert torch.allclose(marian, expected, atol=1e-6)


# ---------------------------------------------------------------- Transformers
@needs_hf
@pytest.mark.parametrize("tie", ["all", "decoder", "none"])
def test_the_marian_model_gives_aiayn_logits(tmp_path, tie):
    run = random_run(tmp_path, "run", tie=tie)
    export_run(run, "hf", tmp_path / "hf")
    marian, _ = load_hf(tmp_path / "hf")
    assert type(marian).__name__ == "MarianMTModel"
    model, _, src, tgt = teacher_forced(run)
    with torch.no_grad():
        ours = model(src, tgt[:, :-1])
        theirs = marian(input_ids=src, attention_mask=src.ne(0),
                        decoder_input_ids=tgt[:, :-1]).logits
    real = tgt[:, :-1].ne(0)  # positions past a target's end see padding in neither model
    assert (ours - theirs)[real].abs().max() <= 1e-4
    tied = marian.lm_head.weight.data_ptr() == marian.model.decoder.embed_tokens.weight.data_ptr()
    assert tied == (tie != "none")


@needs_hf
def test_the_exported_tokenizer_gives_aiayn_ids_and_text(tmp_path):
    run = random_run(tmp_path, "run")
    export_run(run, "hf", tmp_path / "hf")
    _, tokenizer = load_hf(tmp_path / "hf")
    _, _, tokenizers = load_run(run)
    assert tokenizer(TEXTS).input_ids == tokenizers.encode_src(TEXTS)
    # Labels are target ids without [BOS]; Marian shifts them right behind [BOS].
    assert tokenizer(text_target=TEXTS).input_ids == [ids[1:] for ids in tokenizers.encode_tgt(TEXTS)]
    ids = tokenizers.encode_tgt(TEXTS)
    assert tokenizer.batch_decode(ids, skip_special_tokens=True) == tokenizers.decode_tgt(ids)
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    assert torch.equal(batch.input_ids, pad(tokenizers.encode_src(TEXTS)))


@needs_hf
def test_generate_gives_aiayn_greedy_and_beam_tokens(run_dir, tmp_path):
    export_run(run_dir, "hf", tmp_path / "hf")
    marian, tokenizer = load_hf(tmp_path / "hf")
    _, model, tokenizers = load_run(run_dir)
    sentences = ["red sun", "moon tree river star", "black white", "sun sun moon blue green"]
    batch = tokenizer(sentences, padding=True, return_tensors="pt")
    src = batch.input_ids
    with torch.no_grad():
        greedy = marian.generate(**batch, num_beams=1, do_sample=False)
    assert [strip(row) for row in greedy.tolist()] == greedy_decode(model, src)
    assert tokenizer.batch_decode(greedy, skip_special_tokens=True) == sentences
    # Beam 4, all four hypotheses with their scores. alpha 0: Transformers divides by
    # length**alpha where aiayn uses GNMT's penalty; without a penalty both are log P(Y|X).
    with torch.no_grad():
        beams = marian.generate(**batch, num_beams=4, num_return_sequences=4,
                                length_penalty=0.0, early_stopping=True,
                                output_scores=True, return_dict_in_generate=True)
    ours = beam_search(model, src, beam=4, alpha=0.0, nbest=4)
    theirs = [strip(row) for row in beams.sequences.tolist()]
    assert theirs == [h.ids for hyps in ours for h in hyps]
    assert torch.allclose(beams.sequences_scores,
                          torch.tensor([h.score for hyps in ours for h in hyps]), atol=1e-4)


@needs_hf
@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_every_presets_architecture_leaves_for_transformers_exactly(tmp_path, preset):
    """Marian where it computes the model (post-norm, no QK-norm: no remote code), else
    aiayn's own model.py beside the weights: the same logits, -inf where aiayn has -inf."""
    switches = preset_switches(preset)
    run = random_run(tmp_path, "run", **switches)
    export_run(run, "hf", tmp_path / "hf")
    marian = not switches["norm_first"] and not switches["qk_norm"]
    theirs_model, tokenizer = load_hf(tmp_path / "hf", remote_code=not marian)
    assert (type(theirs_model).__name__ == "MarianMTModel") == marian
    assert all((tmp_path / "hf" / name).is_file() != marian for name in HF_CODE)
    model, tokenizers, src, tgt = teacher_forced(run)
    with torch.no_grad():
        ours = model(src, tgt[:, :-1])
        theirs = theirs_model(input_ids=src, attention_mask=src.ne(0),
                              decoder_input_ids=tgt[:, :-1]).logits
    real = tgt[:, :-1].ne(0)[..., None].expand_as(ours)
    finite = torch.isfinite(ours)
    assert torch.equal(finite[real], torch.isfinite(theirs)[real])
    assert (ours - theirs)[real & finite].abs().max() <= 1e-4
    assert tokenizer(TEXTS).input_ids == tokenizers.encode_src(TEXTS)


@needs_hf
@pytest.mark.parametrize("switches", [
    {"norm_first": True, "qk_norm": True, "output_vocab": "targets"},  # the demo's
    {"norm_first": False, "output_vocab": "targets"},  # Marian with final_logits_bias
    {"norm_first": True, "tie": "none"}])
def test_generate_gives_aiayn_tokens_for_every_kind_of_model(tmp_path, switches):
    """greedy and beam 4 (all hypotheses, their scores) through generate, on random models:
    a restricted output layer never emits an excluded piece in either."""
    run = random_run(tmp_path, "run", **switches)
    export_run(run, "hf", tmp_path / "hf")
    theirs, tokenizer = load_hf(tmp_path / "hf", remote_code=True)
    _, model, _ = load_run(run)
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        greedy = theirs.generate(**batch, num_beams=1, do_sample=False)
        beams = theirs.generate(**batch, num_beams=4, num_return_sequences=4,
                                length_penalty=0.0, early_stopping=True,
                                output_scores=True, return_dict_in_generate=True)
    assert strip_all(greedy.tolist()) == greedy_decode(model, batch.input_ids)
    ours = beam_search(model, batch.input_ids, beam=4, alpha=0.0, nbest=4)
    assert strip_all(beams.sequences.tolist()) == [h.ids for hyps in ours for h in hyps]
    assert torch.allclose(beams.sequences_scores,
                          torch.tensor([h.score for hyps in ours for h in hyps]), atol=1e-4)


# ---------------------------------------------------------------- several directions
@needs_hf
def test_the_transformers_tokenizer_keeps_each_tag_one_special_token(tagged_run_dir, tagged_hf):
    """"<2es> " + text gives the tag's id, then aiayn's ids of the text; the tags are
    special tokens of the exported tokenizer (never split, dropped by skip_special_tokens)."""
    _, tokenizer = load_hf(tagged_hf)
    tokenizers = Tokenizers.load(tagged_run_dir / "tokenizer")
    assert set(tokenizer.all_special_tokens) >= set(tokenizers.tags.values())
    for lang, tag in tokenizers.tags.items():
        tag_id = tokenizers.src.token_to_id(tag)
        got = tokenizer([f"{tag} {t}" for t in TEXTS]).input_ids
        assert got == [[tag_id] + ids_ for ids_ in tokenizers.encode_src(TEXTS)]
        ours = Translator.from_pretrained(tagged_run_dir, to=lang)
        assert got == tokenizers.encode_src(ours.tagged(TEXTS))  # before the length limit
        assert tokenizer.batch_decode(got, skip_special_tokens=True) == \
            tokenizer.batch_decode(tokenizers.encode_src(TEXTS), skip_special_tokens=True)


@needs_hf
def test_generate_translates_each_direction_as_aiayn(tagged_run_dir, tagged_hf):
    """Greedy and beam 4 (all hypotheses, their scores; alpha 0, where both rank by the
    log-probability) of `generate` on the tagged text are aiayn's on its tagged sources."""
    model, tokenizer = load_hf(tagged_hf)
    greedies = set()
    for lang in LANGUAGES:
        ours = Translator.from_pretrained(tagged_run_dir, to=lang)
        batch = tokenizer([f"{ours.tokenizers.tags[lang]} {t}" for t in SENTENCES],
                          padding=True, return_tensors="pt")
        assert torch.equal(batch.input_ids, pad(ours.encode(SENTENCES)[0]))
        with torch.no_grad():
            greedy = model.generate(**batch, num_beams=1, do_sample=False)
            beams = model.generate(**batch, num_beams=4, num_return_sequences=4,
                                   length_penalty=0.0, early_stopping=True,
                                   output_scores=True, return_dict_in_generate=True)
        assert strip_all(greedy.tolist()) == greedy_decode(ours.model, batch.input_ids)
        want = beam_search(ours.model, batch.input_ids, beam=4, alpha=0.0, nbest=4)
        assert strip_all(beams.sequences.tolist()) == [h.ids for hyps in want for h in hyps]
        assert torch.allclose(beams.sequences_scores,
                              torch.tensor([h.score for hyps in want for h in hyps]), atol=1e-4)
        greedies.add(str(greedy.tolist()))
    assert len(greedies) == len(LANGUAGES)  # the tag steers the model: a real check
