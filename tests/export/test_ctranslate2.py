"""`aiayn export --to ctranslate2` (aiayn.export.ctranslate2): the CTranslate2 model computes
aiayn's log-probabilities and greedy tokens, and as an engine (aiayn.inference.ct2) answers
the engine interface as aiayn's own does, in `aiayn translate` and `aiayn evaluate`."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from export_helpers import (
    LANGUAGES,
    PRESETS,
    SENTENCES,
    TEXTS,
    needs_ct2,
    one_line_error,
    preset_switches,
    random_run,
    teacher_forced,
)
from helpers import random_sentence, run_cli

from aiayn.config import DecodeConfig
from aiayn.data.tokenizer import Tokenizers
from aiayn.errors import AiaynError
from aiayn.evaluation.evaluate import evaluate_run
from aiayn.export.command import export_run
from aiayn.inference.engine import Engine
from aiayn.inference.search import Sampling, Search
from aiayn.inference.settings import resolve_search
from aiayn.inference.translator import Translator
from aiayn.runs.directory import run_decode


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
    """The same log-probabilities (float32), or, for a per-head QK-norm of cross-attention's
    query, a one-line refusal."""
    switches = preset_switches(preset)
    run = random_run(tmp_path, "run", **switches)
    code, _, err = run_cli(["export", str(run), "--to", "ctranslate2", str(tmp_path / "ct2")],
                           capsys)
    if switches["qk_norm"] and switches["qk_norm_cross"] \
            and switches["qk_norm_cross_query"] == "heads":
        assert one_line_error(code, err, "model.qk_norm_cross_query: heads")
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
        got = theirs.decode_ids(sources, theirs.resolve(beam=beam, alpha=0.0, nbest=beam))
        assert all(allowed[i] for hyps in got for h in hyps for i in h.ids)
        assert all(math.isfinite(h.score) for hyps in got for h in hyps)
        if quantization is None:
            want = ours.decode_ids(sources, ours.resolve(beam=beam, alpha=0.0, nbest=beam))
            assert ids(got) == ids(want)


@needs_ct2
@pytest.mark.parametrize("tie, norm_first, qk_norm, cross", [
    ("all", False, False, None), ("decoder", False, False, None), ("none", False, False, None),
    ("all", True, False, None),
    ("all", True, True, None),  # QK-norm in self-attention only
    ("all", True, True, "whole"), ("none", False, True, "whole")])  # and the whole cross query
def test_the_ctranslate2_model_gives_aiayn_log_probabilities(tmp_path, tie, norm_first,
                                                             qk_norm, cross):
    run = random_run(tmp_path, "run", tie=tie, norm_first=norm_first, qk_norm=qk_norm,
                     qk_norm_cross=cross is not None, qk_norm_cross_query=cross or "heads")
    export_run(run, "ctranslate2", tmp_path / "ct2")
    assert_ct2_log_probs_are_aiayns(run, tmp_path / "ct2")


@needs_ct2
def test_ctranslate2_float32_gives_aiayn_greedy_tokens(run_dir, tmp_path):
    export_run(run_dir, "ctranslate2", tmp_path / "ct2")
    ours = Translator.from_pretrained(run_dir)
    theirs = Translator.from_pretrained(tmp_path / "ct2", engine="ctranslate2")
    sentences = [random_sentence(random.Random(i)) for i in range(30)]
    sources, _ = ours.encode(sentences)
    greedy = ids(ours.decode_ids(sources, ours.resolve(beam=1)))
    assert ids(theirs.decode_ids(sources, theirs.resolve(beam=1))) == greedy
    # The per-sentence output limit (floor(max_len_a x source length) + max_len_b), cut as
    # aiayn cuts.
    cut = ours.resolve(beam=1, max_len_a=0.75, max_len_b=0)
    short = ids(theirs.decode_ids(sources, cut))
    assert short == ids(ours.decode_ids(sources, cut))
    assert any(len(s[0]) < len(t[0]) for s, t in zip(short, greedy))
    # decode.max_len_a scales the source length: CTranslate2 takes one limit per batch, the
    # longest sentence's, and each sentence is cut at its own, as aiayn's.
    scaled = ours.resolve(beam=1, max_len_a=0.5, max_len_b=1)
    halves = ids(theirs.decode_ids(sources, search=scaled))
    assert halves == ids(ours.decode_ids(sources, search=scaled))
    assert all(len(h[0]) <= len(s) // 2 + 1 for h, s in zip(halves, sources, strict=True))
    # The repetition guard is CTranslate2's no_repeat_ngram_size: the same greedy tokens.
    guarded = ids(ours.decode_ids(sources, ours.resolve(beam=1, no_repeat_ngram=1)))
    assert ids(theirs.decode_ids(sources, theirs.resolve(beam=1, no_repeat_ngram=1))) == guarded
    assert guarded != greedy
    # Its sampling cannot be seeded: refused in one line.
    with pytest.raises(AiaynError, match="^sampling needs aiayn's own model"):
        theirs.decode_ids(sources, theirs.resolve(nbest=1, sampling=Sampling(seed=1)))
    # A target prefix is its target_prefix: the same completions, greedy, of prefixes that
    # are the start of aiayn's own translations and of others.
    prefixes = [g[0].ids[:k] for k, g in zip(range(3, 33), ours.decode_ids(sources, cut))]
    prefixes[::3] = [[ours.tokenizers.tgt.token_to_id("▁blue")]] * len(prefixes[::3])
    completed = ids(ours.decode_ids(sources, ours.resolve(beam=1), prefixes=prefixes))
    assert ids(theirs.decode_ids(sources, theirs.resolve(beam=1), prefixes=prefixes)) == completed
    assert all(c[0][:len(p)] == p for c, p in zip(completed, prefixes, strict=True))


@needs_ct2
def test_both_engines_answer_the_engine_interface_alike(run_dir, tmp_path):
    """aiayn's search and CTranslate2's are one ``Engine``: the same call, a batch of source
    ids and one Search, gives the same beam-search hypotheses (alpha 0: both rank by the
    log-probability; CTranslate2's length penalty differs from GNMT's otherwise)."""
    export_run(run_dir, "ctranslate2", tmp_path / "ct2")
    engines = [Translator.from_pretrained(run_dir).engine,
               Translator.from_pretrained(tmp_path / "ct2", engine="ctranslate2").engine]
    assert [type(e).__name__ for e in engines] == ["AiaynEngine", "CTranslate2Engine"]
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
    with pytest.raises(AiaynError, match="^sampling needs aiayn's own model"):
        engines[1].supports(Search(2, sampling=Sampling(seed=1)))


@needs_ct2
def test_ctranslate2_decodes_a_batch_per_stream_as_one_at_a_time(run_dir, tmp_path):
    """On a CPU the engine decodes one batch per torch thread at once (CTranslate2's
    inter_threads), each on one thread: the same hypotheses and scores as one batch at a
    time, and loading it leaves torch's thread count as it was (CTranslate2 sets the
    calling thread's OpenMP count, which torch and aiayn's streams read)."""
    export_run(run_dir, "ctranslate2", tmp_path / "ct2")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = Translator.from_pretrained(tmp_path / "ct2", engine="ctranslate2", decode_tokens=64)
        assert torch.get_num_threads() == 2 and two.engine.streams == 2
        torch.set_num_threads(1)
        one = Translator.from_pretrained(tmp_path / "ct2", engine="ctranslate2", decode_tokens=64)
        assert one.engine.streams == 1
    finally:
        torch.set_num_threads(before)
    sentences = [random_sentence(random.Random(i)) for i in range(40)]
    sources, _ = one.encode(sentences)
    search = one.resolve(beam=3, nbest=2)
    batches, _ = two.engine.decode(sources, search, two.decode_tokens)
    assert len(batches) > 2  # several batches, so the two workers overlap
    theirs = two.decode_ids(sources, search)
    assert ids(theirs) == ids(one.decode_ids(sources, search))
    assert [[h.score for h in hyps] for hyps in theirs] == [
        [h.score for h in hyps] for hyps in one.decode_ids(sources, search)]


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
    ours = evaluate_run(run_dir, search=resolve_search(run_decode(run_dir), beam=1),
                        output=tmp_path / "a.txt", progress=False)
    data = (run_dir / "data_dir.txt").read_text(encoding="utf-8").strip()
    code, printed, _ = run_cli(["evaluate", str(out), "--engine", "ctranslate2", "--beam", "1",
                                "-o", str(tmp_path / "b.txt"), "--data", data], capsys)
    assert code == 0 and f"BLEU  {ours['bleu']:.2f}" in printed and "ctranslate2" in printed
    assert (tmp_path / "b.txt").read_text() == (tmp_path / "a.txt").read_text()
    # An int8 model still copies the test sentences.
    code, _, _ = run_cli(["export", str(run_dir), "--to", "ctranslate2", str(tmp_path / "int8"),
                          "--quantization", "int8"], capsys)
    assert code == 0
    summary = evaluate_run(tmp_path / "int8", search=resolve_search(DecodeConfig(), beam=4),
                           engine="ctranslate2", progress=False, data_dir=data)
    assert summary["bleu"] > 80 and summary["engine"] == "ctranslate2"
    assert json.loads((tmp_path / "int8" / "config.json").read_text())["decoder_start_token"] == "[BOS]"


@needs_ct2
def test_an_export_given_where_a_run_is_needed_is_named(run_dir, tmp_path, capsys, monkeypatch):
    """A CTranslate2 export is not a run: translate without --engine, export and train from it
    say what it is and where it came from in one line, writing nothing; info describes it."""
    out = tmp_path / "ct2"
    assert run_cli(["export", str(run_dir), "--to", "ctranslate2", str(out),
                    "--quantization", "int8"], capsys)[0] == 0
    before = sorted((p.name, p.stat().st_mtime_ns) for p in out.rglob("*"))
    what = f"a CTranslate2 export (int8) of run {run_dir.name}, weights best, not a run directory"
    code, _, err = run_cli(["translate", str(out)], capsys, "red sun\n", monkeypatch)
    assert one_line_error(code, err, what, "--engine ctranslate2")
    code, _, err = run_cli(["export", str(out), "--to", "ctranslate2", str(tmp_path / "again")],
                           capsys)
    assert one_line_error(code, err, what) and not (tmp_path / "again").exists()
    data = (run_dir / "data_dir.txt").read_text(encoding="utf-8").strip()
    code, _, err = run_cli(["train", "--init-from", str(out), "--data", data, "--out",
                            str(tmp_path / "new")], capsys)
    assert one_line_error(code, err, f"--init-from {out}", what) and not (tmp_path / "new").exists()
    code, printed, err = run_cli(["info", str(out)], capsys)
    assert code == 0 and err == ""
    assert f"export     a CTranslate2 export (int8) of run {run_dir.name}" in printed
    assert not any(line.startswith(("trained", "best", "weights")) for line in printed.splitlines())
    code, printed, _ = run_cli(["info", str(out), "--json"], capsys)
    assert json.loads(printed)["export"]["quantization"] == "int8"
    # Converted by hand (no aiayn_export.json): still told apart by its model.bin.
    (out / "aiayn_export.json").unlink()
    code, _, err = run_cli(["translate", str(out)], capsys, "red sun\n", monkeypatch)
    assert one_line_error(code, err, "a CTranslate2 export, not a run directory")
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.rglob("*")
                  ) == [b for b in before if b[0] != "aiayn_export.json"]


@needs_ct2
def test_ctranslate2_translates_each_direction_as_aiayn(tagged_run_dir, tagged_ct2):
    """`Translator.from_pretrained(export, engine="ctranslate2", to=lang)` puts the tag in
    front as aiayn's engine does: the same greedy translations and best of beam 4; the
    export's vocabulary and tokenizer hold the tags."""
    out = tagged_ct2
    tags = Tokenizers.load(out / "tokenizer").tags
    assert tags == Tokenizers.load(tagged_run_dir / "tokenizer").tags
    vocabulary = (out / "shared_vocabulary.json").read_text(encoding="utf-8")
    assert all(f'"{tag}"' in vocabulary for tag in tags.values())
    translations = set()
    for lang in LANGUAGES:
        ours = Translator.from_pretrained(tagged_run_dir, to=lang)
        theirs = Translator.from_pretrained(out, engine="ctranslate2", to=lang)
        greedy = ours.translate(SENTENCES, ours.resolve(beam=1))
        assert theirs.translate(SENTENCES, theirs.resolve(beam=1)) == greedy
        sources, _ = ours.encode(SENTENCES)
        # The best of beam 4 (CTranslate2 may rank an empty hypothesis, which aiayn's beam
        # keeps among the n-best, elsewhere: a difference of the engines, not of the tags).
        beam = ours.resolve(beam=4, alpha=0.0)
        assert ids(theirs.decode_ids(sources, beam)) == ids(ours.decode_ids(sources, beam))
        translations.add(tuple(greedy))
    assert len(translations) == len(LANGUAGES)
    with pytest.raises(Exception, match="say which"):  # no direction: refused as aiayn's
        Translator.from_pretrained(out, engine="ctranslate2").translate(SENTENCES)
