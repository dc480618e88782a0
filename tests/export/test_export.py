"""`aiayn export`: the Transformers (Marian) and CTranslate2 models compute aiayn's function.

Two kinds of run directory: random models with every weight perturbed (so LayerNorm gains,
biases and the residual permutation all matter) for logits and log-probabilities, and the
trained copy model of test_translator for decoded tokens. Hub access stays off: every load
reads the local directory.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it

import dataclasses
import json
import math
import random
import re
import shutil
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from helpers import random_sentence, run_cli

from aiayn.config import Config, DataConfig, DecodeConfig, ModelConfig, load_config, save_config
from aiayn.data.batching import pad
from aiayn.data.tokenizer import train_tokenizers
from aiayn.errors import AiaynError
from aiayn.evaluation.evaluate import evaluate_run
from aiayn.export.command import export_run
from aiayn.export.hf import HF_CODE, residual_permutation
from aiayn.export.modelcard import CARD_FILE, model_card
from aiayn.inference.engines import Engine
from aiayn.inference.search import Sampling, Search, beam_search, greedy_decode
from aiayn.inference.translator import Translator
from aiayn.model import Transformer, sinusoid_table
from aiayn.runs.checkpoint import STATE_VERSION, save_train_state, save_weights
from aiayn.runs.directory import load_run

needs_hf = pytest.mark.skipif(find_spec("transformers") is None,
                              reason="pip install 'aiayn[export]'")
needs_ct2 = pytest.mark.skipif(find_spec("ctranslate2") is None,
                               reason="pip install 'aiayn[export]'")

TEXTS = ["¡Hola, señor! ¿Cómo estás?", "The Lord is my shepherd.", "red green, blue; sun moon",
         "In the beginning God created the heavens and the earth.", "Él dijo: «Sí.»"]


def random_run(root: Path, name: str, tie: str = "all", norm_first: bool = False,
               joint: bool = True, qk_norm: bool = False, output_vocab: str = "all",
               qk_norm_cross: bool = True) -> Path:
    """A run directory holding a random model (every parameter perturbed) and a BPE
    tokenizer over sentences with punctuation and accents."""
    pairs = [(s, s[::-1]) for s in TEXTS] * 4
    data = DataConfig(vocab_size=120, min_frequency=1, joint_vocab=joint)
    tokenizers = train_tokenizers(pairs, data)
    cfg = ModelConfig(src_vocab_size=tokenizers.src_vocab_size,
                      tgt_vocab_size=tokenizers.tgt_vocab_size, d_model=32, n_heads=4,
                      d_ff=48, n_encoder_layers=2, n_decoder_layers=1, dropout=0.1,
                      max_len=64, tie_embeddings=tie, norm_first=norm_first, qk_norm=qk_norm,
                      qk_norm_cross=qk_norm_cross, output_vocab=output_vocab)
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    if output_vocab == "targets":  # as aiayn train: the target side's pieces and [EOS]
        seen = {i for ids in tokenizers.encode_tgt([t for _, t in pairs]) for i in ids[1:]}
        model.generator.set_outputs(torch.tensor(sorted(seen)))
    run = root / name
    run.mkdir()
    save_config(Config(model=cfg, data=data).validate(), run / "config.yaml")
    tokenizers.save(run / "tokenizer")
    save_weights(model, run / "best.safetensors")
    return run


def teacher_forced(run: Path):
    """aiayn's model, its tokenizers, and a padded batch of TEXTS."""
    _, model, tokenizers = load_run(run)
    src = pad(tokenizers.encode_src(TEXTS))
    tgt = pad(tokenizers.encode_tgt([t[::-1] for t in TEXTS]))
    return model, tokenizers, src, tgt


def load_hf(out: Path, remote_code: bool = False):
    """The loading code a user writes; ``remote_code``: trust the folder's own model code."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    model = AutoModelForSeq2SeqLM.from_pretrained(out, local_files_only=True,
                                                  trust_remote_code=remote_code).eval()
    return model, AutoTokenizer.from_pretrained(out, local_files_only=True,
                                                trust_remote_code=remote_code)


def preset_switches(path: Path) -> dict:
    """The architecture switches of a preset in configs/, for a tiny model built alike."""
    cfg = load_config(path).model
    return {"tie": cfg.tie_embeddings, "norm_first": cfg.norm_first, "qk_norm": cfg.qk_norm,
            "qk_norm_cross": cfg.qk_norm_cross, "output_vocab": cfg.output_vocab}


PRESETS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def strip_all(rows: list[list[int]]) -> list[list[int]]:
    return [strip(row) for row in rows]


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
@needs_ct2
def test_both_exports_keep_the_runs_search(tmp_path):
    """A run whose config's decode says beam 3, alpha 1.5: Transformers' generation defaults
    and the CTranslate2 directory's Translator both search so."""
    run = random_run(tmp_path, "run")
    config = load_run(run)[0]
    save_config(dataclasses.replace(config, decode=DecodeConfig(beam=3, alpha=1.5,
                                                                no_repeat_ngram=3)),
                run / "config.yaml")
    export_run(run, "hf", tmp_path / "hf")
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert (generation["num_beams"], generation["length_penalty"]) == (3, 1.5)
    assert generation["no_repeat_ngram_size"] == 3
    export_run(run, "ctranslate2", tmp_path / "ct2")
    theirs = Translator.from_pretrained(tmp_path / "ct2", engine="ctranslate2")
    assert theirs.resolve() == Search(3, 1.5, 3)
    # Each export carries its model card, which says the same search.
    for to, out in (("hf", "hf"), ("ctranslate2", "ct2")):
        card = (tmp_path / out / CARD_FILE).read_text(encoding="utf-8")
        assert card == model_card(run, to)
        assert "searches with beam 3 and length penalty alpha 1.5" in card
        assert "same 3 pieces in a row twice" in card  # the run's guard
    # greedy (beam 1): Transformers refuses beam-only settings beside it, so none are written
    save_config(dataclasses.replace(config, decode=DecodeConfig(beam=1, alpha=1.5)),
                run / "config.yaml")
    export_run(run, "hf", tmp_path / "hf1")
    generation = json.loads((tmp_path / "hf1" / "generation_config.json").read_text())
    assert generation.get("num_beams", 1) == 1 and "length_penalty" not in generation


def strip(row: list[int]) -> list[int]:
    """Generated ids without the start token, the end token and padding."""
    ids = row[1:]
    return ids[: ids.index(3)] if 3 in ids else [i for i in ids if i != 0]


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


# ---------------------------------------------------------------- CTranslate2
def assert_ct2_log_probs_are_aiayns(run: Path, ct2_dir: Path) -> None:
    """CTranslate2's score_batch gives aiayn's teacher-forced log-probabilities (1e-4)."""
    import ctranslate2

    model, tokenizers, src, tgt = teacher_forced(run)
    with torch.no_grad():
        log_probs = torch.log_softmax(model(src, tgt[:, :-1]), dim=-1)
    source = [tokenizers.src_tokens(t)[:-1] for t in TEXTS]  # CTranslate2 appends [EOS]
    target = [tokenizers.tgt_tokens(t[::-1])[1:-1] for t in TEXTS]
    results = ctranslate2.Translator(str(ct2_dir)).score_batch(source, target)
    for b, result in enumerate(results):
        expected = [log_probs[b, t, tgt[b, t + 1]].item() for t in range(len(target[b]) + 1)]
        assert result.log_probs == pytest.approx(expected, abs=1e-4)


@needs_ct2
@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_every_presets_architecture_leaves_for_ctranslate2_exactly_or_is_refused(tmp_path,
                                                                                 capsys, preset):
    """The same log-probabilities (float32), or, for QK-norm, a one-line refusal."""
    switches = preset_switches(preset)
    run = random_run(tmp_path, "run", **switches)
    code, _, err = run_cli(["export", str(run), "--to", "ctranslate2", str(tmp_path / "ct2")],
                           capsys)
    if switches["qk_norm"] and switches["qk_norm_cross"]:
        assert one_line_error(code, err, "model.qk_norm_cross: true")
        return
    assert code == 0
    assert_ct2_log_probs_are_aiayns(run, tmp_path / "ct2")


@needs_ct2
@pytest.mark.parametrize("quantization", [None, "int8", "float16", "bfloat16"])
def test_a_restricted_output_layer_leaves_for_ctranslate2_as_a_bias(tmp_path, quantization):
    """Excluded pieces get bias -inf: float32 gives aiayn's greedy and beam-4 tokens (its
    log-probabilities: the preset test); no weight type ever emits an excluded piece or a
    non-finite score."""
    run = random_run(tmp_path, "run", norm_first=True, output_vocab="targets")
    export_run(run, "ctranslate2", tmp_path / "ct2", quantization=quantization)
    ours = Translator.from_pretrained(run)
    theirs = Translator.from_pretrained(tmp_path / "ct2", engine="ctranslate2")
    sources, _ = ours.encode(TEXTS)
    allowed = ours.model.generator.output_mask
    for beam in (1, 4):
        got = theirs.decode_ids(sources, beam=beam, alpha=0.0, nbest=beam)
        assert all(allowed[i] for hyps in got for h in hyps for i in h.ids)
        assert all(math.isfinite(h.score) for hyps in got for h in hyps)
        if quantization is None:
            want = ours.decode_ids(sources, beam=beam, alpha=0.0, nbest=beam)
            assert ids(got) == ids(want)


@needs_ct2
@pytest.mark.parametrize("tie, norm_first, qk_norm", [
    ("all", False, False), ("decoder", False, False), ("none", False, False),
    ("all", True, False), ("all", True, True)])  # the last: QK-norm in self-attention only
def test_the_ctranslate2_model_gives_aiayn_log_probabilities(tmp_path, tie, norm_first,
                                                             qk_norm):
    run = random_run(tmp_path, "run", tie=tie, norm_first=norm_first, qk_norm=qk_norm,
                     qk_norm_cross=False)
    export_run(run, "ctranslate2", tmp_path / "ct2")
    assert_ct2_log_probs_are_aiayns(run, tmp_path / "ct2")


@needs_ct2
def test_ctranslate2_float32_gives_aiayn_greedy_tokens(run_dir, tmp_path):
    export_run(run_dir, "ctranslate2", tmp_path / "ct2")
    ours = Translator.from_pretrained(run_dir)
    theirs = Translator.from_pretrained(tmp_path / "ct2", engine="ctranslate2")
    sentences = [random_sentence(random.Random(i)) for i in range(30)]
    sources, _ = ours.encode(sentences)
    assert ids(theirs.decode_ids(sources, beam=1)) == ids(ours.decode_ids(sources, beam=1))
    # The per-sentence output limit (source length + max_len_b), cut as aiayn cuts.
    short = ids(theirs.decode_ids(sources, beam=1, max_len_b=-3))
    assert short == ids(ours.decode_ids(sources, beam=1, max_len_b=-3))
    assert any(len(s[0]) < len(t[0]) for s, t in zip(short, ids(ours.decode_ids(sources, beam=1))))
    # decode.max_len_a scales the source length: CTranslate2 takes one limit per batch, the
    # longest sentence's, and each sentence is cut at its own, as aiayn's.
    scaled = dataclasses.replace(ours.resolve(1), max_len_a=0.5, max_len_b=1)
    halves = ids(theirs.decode_ids(sources, search=scaled))
    assert halves == ids(ours.decode_ids(sources, search=scaled))
    assert all(len(h[0]) <= len(s) // 2 + 1 for h, s in zip(halves, sources, strict=True))
    # The repetition guard is CTranslate2's no_repeat_ngram_size: the same greedy tokens.
    guarded = ids(ours.decode_ids(sources, beam=1, no_repeat_ngram=1))
    assert ids(theirs.decode_ids(sources, beam=1, no_repeat_ngram=1)) == guarded
    assert guarded != ids(ours.decode_ids(sources, beam=1))
    # Its sampling cannot be seeded: refused in one line.
    with pytest.raises(AiaynError, match="--sample needs aiayn's own model"):
        theirs.decode_ids(sources, nbest=1, sampling=Sampling(seed=1))


@needs_ct2
def test_both_engines_answer_the_engine_interface_alike(run_dir, tmp_path):
    """aiayn's search and CTranslate2's are one ``Engine``: the same call, a batch of source
    ids and one Search, gives the same beam-search hypotheses (alpha 0: both rank by the
    log-probability; CTranslate2's length penalty differs from GNMT's otherwise)."""
    export_run(run_dir, "ctranslate2", tmp_path / "ct2")
    engines = [Translator.from_pretrained(run_dir).engine,
               Translator.from_pretrained(tmp_path / "ct2", engine="ctranslate2").engine]
    assert [type(e).__name__ for e in engines] == ["AiaynEngine", "CTranslate2Search"]
    assert all(isinstance(e, Engine) for e in engines)
    sources = Translator.from_pretrained(run_dir).encode(TEXTS[1:3])[0]
    search = Search(4, 0.0, nbest=4)
    ours, theirs = (e.search(sources, search) for e in engines)
    assert ids(ours) == ids(theirs) and all(len(h) == 4 for h in ours)
    # Both best first (their scores' agreement: test_the_ctranslate2_model_gives_aiayn_...).
    for hyps in (*ours, *theirs):
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
    # What an engine cannot run is one AiaynError, asked of the engine itself.
    engines[0].supports(Search(2, sampling=Sampling(seed=1)))
    with pytest.raises(AiaynError, match="--sample needs aiayn's own model"):
        engines[1].supports(Search(2, sampling=Sampling(seed=1)))


def ids(results) -> list[list[list[int]]]:
    return [[h.ids for h in hyps] for hyps in results]


@needs_ct2
def test_translate_and_evaluate_with_the_ctranslate2_engine(run_dir, tmp_path, capsys,
                                                            monkeypatch):
    out = tmp_path / "ct2"
    code, printed, _ = run_cli(["export", str(run_dir), "--to", "ctranslate2", str(out)], capsys)
    assert code == 0 and printed == f"wrote {out}\n"
    lines = "red sun\n\nmoon tree river star\nblack\n"
    _, ours, _ = run_cli(["translate", str(run_dir), "--beam", "1"], capsys, lines, monkeypatch)
    code, theirs, err = run_cli(["translate", str(out), "--engine", "ctranslate2", "--beam", "1"],
                                capsys, lines, monkeypatch)
    assert code == 0 and theirs == ours and err == ""
    ours = evaluate_run(run_dir, beam=1, output=tmp_path / "a.txt", progress=False)
    data = (run_dir / "data_dir.txt").read_text(encoding="utf-8").strip()
    code, printed, _ = run_cli(["evaluate", str(out), "--engine", "ctranslate2", "--beam", "1",
                                "-o", str(tmp_path / "b.txt"), "--data", data], capsys)
    assert code == 0 and f"BLEU  {ours['bleu']:.2f}" in printed and "ctranslate2" in printed
    assert (tmp_path / "b.txt").read_text() == (tmp_path / "a.txt").read_text()
    # An int8 model still copies the test sentences.
    code, _, _ = run_cli(["export", str(run_dir), "--to", "ctranslate2", str(tmp_path / "int8"),
                          "--quantization", "int8"], capsys)
    assert code == 0
    summary = evaluate_run(tmp_path / "int8", beam=4, engine="ctranslate2", progress=False,
                           data_dir=data)
    assert summary["bleu"] > 80 and summary["engine"] == "ctranslate2"
    assert json.loads((tmp_path / "int8" / "config.json").read_text())["decoder_start_token"] == "[BOS]"


# ---------------------------------------------------------------- refusals, one line each
def one_line_error(code: int, err: str, *words: str) -> bool:
    return (code == 2 and err.startswith("aiayn: error: ") and err.count("\n") == 1
            and all(w in err for w in words))


@pytest.mark.parametrize("to", ["hf", "ctranslate2"])
def test_export_into_a_non_empty_directory_is_refused(run_dir, tmp_path, capsys, to):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine\n")
    code, _, err = run_cli(["export", str(run_dir), "--to", to, str(out)], capsys)
    assert one_line_error(code, err, str(out), "not an empty directory")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "mine\n"


@needs_ct2
def test_export_into_an_empty_directory_fills_it(run_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    code, _, _ = run_cli(["export", str(run_dir), "--to", "ctranslate2", str(out)], capsys)
    assert code == 0 and (out / "model.bin").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary left behind


@pytest.mark.parametrize("to", ["hf", "ctranslate2"])
def test_a_run_without_weights_is_one_line(run_dir, tmp_path, capsys, to):
    if find_spec("transformers" if to == "hf" else "ctranslate2") is None:
        pytest.skip("the missing library is reported first")
    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.yaml", "data_dir.txt"):
        (run / name).write_bytes((run_dir / name).read_bytes())
    load_run(run_dir)[2].save(run / "tokenizer")
    code, _, err = run_cli(["export", str(run), "--to", to, str(tmp_path / "out")], capsys)
    assert one_line_error(code, err, "holds no weights")
    assert not (tmp_path / "out").exists()


@needs_ct2
def test_a_qk_norm_run_is_refused_for_ctranslate2_in_one_line(tmp_path, capsys):
    """CTranslate2 4.8 RMS-normalises the query of encoder-decoder attention over all of
    d_model, not per head: refused before any weights are read, nothing written."""
    run = random_run(tmp_path, "run", norm_first=True, qk_norm=True)
    (run / "best.safetensors").unlink()  # the refusal comes from config.yaml alone
    code, _, err = run_cli(["export", str(run), "--to", "ctranslate2", str(tmp_path / "out")],
                           capsys)
    assert one_line_error(code, err, "model.qk_norm_cross: true", "--to ctranslate2",
                          "each head", "--set model.qk_norm_cross=false")
    assert not (tmp_path / "out").exists()


@needs_hf
def test_separate_vocabularies_are_refused_for_transformers_in_one_line(tmp_path, capsys):
    run = random_run(tmp_path, "run", tie="decoder", joint=False)
    code, _, err = run_cli(["export", str(run), "--to", "hf", str(tmp_path / "out")], capsys)
    assert one_line_error(code, err, "joint vocabulary")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("to, library", [("hf", "transformers"), ("ctranslate2", "ctranslate2")])
def test_a_missing_library_says_what_to_install(run_dir, tmp_path, capsys, monkeypatch,
                                                 to, library):
    monkeypatch.setitem(sys.modules, library, None)  # import now raises ImportError
    code, _, err = run_cli(["export", str(run_dir), "--to", to, str(tmp_path / "out")], capsys)
    assert one_line_error(code, err, library, "pip install 'aiayn[export]'")
    assert not (tmp_path / "out").exists()


def test_quantization_is_for_ctranslate2_only(run_dir, tmp_path, capsys):
    code, _, err = run_cli(["export", str(run_dir), "--to", "hf", str(tmp_path / "out"),
                            "--quantization", "int8"], capsys)
    assert one_line_error(code, err, "--quantization", "ctranslate2")


@needs_ct2
def test_the_engines_name_the_directory_they_need(run_dir, tmp_path, capsys):
    out = tmp_path / "ct2"
    export_run(run_dir, "ctranslate2", out)
    code, _, err = run_cli(["evaluate", str(out)], capsys)
    assert one_line_error(code, err, "--engine ctranslate2")
    code, _, err = run_cli(["evaluate", str(run_dir), "--engine", "ctranslate2"], capsys)
    assert one_line_error(code, err, "model.bin", "aiayn export")


# ---------------------------------------------------------------- the model card
def section(card: str, title: str) -> str:
    """The text of one ``## title`` section of a card."""
    return card.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_model_card_shows_the_runs_own_figures(run_dir, tmp_path):
    """Every figure on the card is the run's: a run with known training, dev and test
    figures shows exactly them; without a test evaluation it says so, with no figure."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    config, model, _ = load_run(run)
    save_weights(model, run / "best.safetensors",
                 metadata={"step": "300", "best_metric": "bleu", "best_value": "11.11"})
    save_train_state({"version": STATE_VERSION, "step": 400, "epoch": 3, "tokens": 12345,
                      "elapsed_s": 754.2, "world_size": 1}, run / "train_state.pt")
    (run / "metrics.jsonl").write_text(json.dumps(
        {"kind": "dev", "step": 300, "bleu": 11.11, "chrf": 33.33, "dev_loss": 2.5,
         "n_sentences": 20}) + "\n")
    card = model_card(run, "ctranslate2")
    evaluation = section(card, "Evaluation")
    assert "Not evaluated on the test split" in evaluation
    assert not re.search(r"\d", evaluation.replace("eval/test.*.json", ""))  # no figure at all
    stats = json.loads((Path((run / "data_dir.txt").read_text().strip()) / "stats.json")
                       .read_text())
    assert f"| parameters | {model.num_parameters():,} |" in card
    assert (f"| {config.model.n_encoder_layers} encoder + {config.model.n_decoder_layers} "
            "decoder |") in card
    for split, count in stats["splits"].items():
        tokens = stats["tokens"][split]
        assert f"| {split} | {count:,} | {tokens['src']:,} | {tokens['tgt']:,} |" in card
    assert "400 steps (3 epochs, 12,345 target tokens) in 12.6 minutes" in card
    assert "Exported weights: `best` (step 300)" in card
    assert "at step 300: BLEU 11.11, chrF 33.33 on 20 dev sentences" in card
    # A test evaluation, as `aiayn evaluate --split test` writes it, and one of other weights.
    signatures = {"bleu_signature": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0",
                  "chrf_signature": "nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:2.6.0"}
    (run / "eval").mkdir()
    for name, weights, beam, bleu, chrf in (("test.best.beam4.alpha0.6", "best", 4, 23.45, 51.2),
                                             ("test.last.beam1", "last", 1, 19.87, 47.65)):
        (run / "eval" / f"{name}.json").write_text(json.dumps(
            {"split": "test", "weights": weights, "beam": beam, "alpha": 0.6, "sentences": 40,
             "bleu": bleu, "chrf": chrf, **signatures}))
    (run / "eval" / "dev.best.beam1.json").write_text(json.dumps(
        {"split": "dev", "weights": "best", "beam": 1, "alpha": 0.6, "sentences": 20,
         "bleu": 99.0, "chrf": 99.0}))  # the dev split: not a test figure
    evaluation = section(model_card(run, "hf"), "Evaluation")
    assert "| best (exported) | beam 4, alpha 0.6 | 40 | 23.45 | 51.20 |" in evaluation
    assert "| last | greedy | 40 | 19.87 | 47.65 |" in evaluation
    assert "99" not in evaluation and "Not evaluated" not in evaluation
    assert all(f"`{sig}`" in evaluation for sig in signatures.values())


@needs_ct2
def test_the_ctranslate2_cards_loading_code_translates(run_dir, tmp_path):
    """The card's Python for CTranslate2 and `tokenizers` alone gives what `aiayn translate
    --engine ctranslate2` gives."""
    out = export_run(run_dir, "ctranslate2", tmp_path / "ct2")
    card = (out / CARD_FILE).read_text(encoding="utf-8")
    code = section(card, "How to load").split("```python\n", 1)[1].split("```", 1)[0]
    code = code.replace("THIS_DIR", str(out)).replace("A sentence to translate.", "red green blue")
    printed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout
    expected = Translator.from_pretrained(out, engine="ctranslate2").translate(["red green blue"])
    assert printed.splitlines() == expected


# ---------------------------------------------------------------- what leaves the machine
@needs_hf
@needs_ct2
def test_an_export_holds_no_local_path_and_every_file_is_readable_by_all(run_dir, tmp_path):
    """An export is meant to be published (its card becomes a hub page): no file it writes
    names the run, the prepared data, the corpus files or the home folder; and every file
    has the umask's mode (0644 under 022), the weights too, so a service user can read them."""
    run = tmp_path / "home-of-the-run" / "mine"
    shutil.copytree(run_dir, run)
    data_dir = Path((run / "data_dir.txt").read_text(encoding="utf-8").strip())
    config = load_config(run / "config.yaml")
    config.data.corpus = f"tsv:{data_dir}.corpus/{{split}}.tsv"  # as the data was prepared
    save_config(config, run / "config.yaml")
    local = {str(run), str(run.resolve()), str(data_dir), str(data_dir.resolve()),
             str(data_dir.parent), str(tmp_path)}
    if Path.home() != Path("/"):
        local.add(str(Path.home()))
    weights = shutil.copy(run / "best.safetensors", tmp_path / "mine.safetensors")
    local.add(str(weights))
    old = os.umask(0o022)
    try:
        outs = [export_run(run, "hf", tmp_path / "hf"),
                export_run(run, "ctranslate2", tmp_path / "ct2", weights=weights)]
    finally:
        os.umask(old)
    for out in outs:
        files = [p for p in out.rglob("*") if p.is_file()]
        assert {"README.md", "aiayn_export.json"} <= {p.name for p in files}
        for path in files:
            assert oct(path.stat().st_mode & 0o777) == oct(0o644), path
            data = path.read_bytes()
            leaks = [where for where in local if where.encode() in data]
            assert not leaks, f"{path.relative_to(out)} names {leaks}"


def test_the_advice_before_trust_remote_code_names_every_python_file_shipped(run_dir):
    """The card and docs/export.md name each Python file an export of aiayn's own model
    ships (and trust_remote_code runs): model.py imports cache.py and loss.py."""
    assert {"model.py", "hf_model.py", "cache.py", "loss.py"} <= set(HF_CODE)
    card = model_card(run_dir, "hf", marian=False)
    advice = card.split("`trust_remote_code=True` runs", 1)[1].split("\n\n", 1)[0]
    assert all(f"`{name}`" in advice for name in HF_CODE), advice
    docs = (Path(__file__).resolve().parents[2] / "docs" / "export.md").read_text()
    advice = docs.split("`trust_remote_code=True` means", 1)[1].split("\n\n", 1)[0]
    assert all(f"`{name}`" in advice for name in HF_CODE), advice
