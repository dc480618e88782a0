"""Run directory -> translations: load_run, Translator, `aiayn translate|evaluate|average`.

The fixture is a real (tiny) run directory written with the public APIs: a word-level
tokenizer, a model trained for a few seconds to copy its input, config.yaml, best/last
weights, step checkpoints and a prepared data directory.
"""

from __future__ import annotations

import json
import os
import pty
import random
import select
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from helpers import error_line, random_sentence, run_cli, snapshot
from safetensors.torch import save_file

from aiayn.config import DataConfig, DecodeConfig, ModelConfig, load_config, save_config
from aiayn.data.batching import pad
from aiayn.data.tokenizer import EOS_ID, train_tokenizers
from aiayn.errors import AiaynError
from aiayn.inference.search import Sampling, greedy_decode
from aiayn.inference.translator import (
    Translator,
    TruncationWarning,
    truncate_source,
)
from aiayn.model import Transformer
from aiayn.runs.checkpoint import average_checkpoints, read_metadata, read_weights, save_weights
from aiayn.runs.directory import load_run, load_run_config, read_data_dir


@pytest.fixture(scope="module")
def translator(run_dir) -> Translator:
    return Translator.from_pretrained(run_dir)


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run_dir, target)
    return target


# ---------------------------------------------------------------- load_run
def test_load_run_returns_the_saved_model_in_eval_mode(run_dir):
    config, model, tokenizers = load_run(run_dir)
    assert not model.training
    assert config.model.tgt_vocab_size == tokenizers.tgt_vocab_size == model.cfg.tgt_vocab_size
    saved = read_weights(run_dir / "best.safetensors")
    for name, tensor in saved.items():
        assert torch.equal(model.state_dict()[name], tensor)


@pytest.mark.parametrize("missing, message", [
    ("config.yaml", "no config.yaml"),
    ("tokenizer", "no tokenizer/"),
    ("best.safetensors", "no weights 'best'"),
])
def test_load_run_names_the_missing_piece(run_dir, tmp_path, missing, message):
    run = copy_of(run_dir, tmp_path)
    target = run / missing
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    with pytest.raises(AiaynError, match=message):
        load_run(run)


def test_load_run_lists_the_weights_there_are(run_dir, tmp_path):
    run = copy_of(run_dir, tmp_path)
    (run / "best.safetensors").unlink()
    with pytest.raises(AiaynError, match="available: last"):
        load_run(run)
    assert load_run(run, "last")[1] is not None
    assert load_run(run, str(run / "last.safetensors"))[1] is not None


def test_load_run_refuses_a_tokenizer_of_another_vocabulary(run_dir, tmp_path):
    run = copy_of(run_dir, tmp_path)
    other = train_tokenizers([("one two three", "one two three")],
                             DataConfig(tokenizer="wordlevel", vocab_size=100, min_frequency=1))
    shutil.rmtree(run / "tokenizer")
    other.save(run / "tokenizer")
    with pytest.raises(AiaynError, match="does not belong to these weights"):
        load_run(run)


def test_load_run_refuses_weights_of_another_model(run_dir, tmp_path):
    run = copy_of(run_dir, tmp_path)
    config, model, _ = load_run(run)
    bigger = Transformer(ModelConfig(**{**vars(config.model), "d_model": 64}))
    save_weights(bigger, run / "best.safetensors")
    with pytest.raises(AiaynError, match="model.d_model=64 but the config says model.d_model=32"):
        load_run(run)


def test_load_run_refuses_a_config_edited_after_training(run_dir, tmp_path):
    """n_heads 4 -> 2 keeps every tensor's shape: only the stored architecture tells."""
    run = copy_of(run_dir, tmp_path)
    config = load_run(run)[0]
    text = (run / "config.yaml").read_text(encoding="utf-8")
    (run / "config.yaml").write_text(text.replace(f"n_heads: {config.model.n_heads}",
                                                  f"n_heads: {config.model.n_heads // 2}"))
    with pytest.raises(AiaynError, match=f"model.n_heads={config.model.n_heads} but the config "
                                         f"says model.n_heads={config.model.n_heads // 2}"):
        load_run(run)


def test_non_finite_weights_are_refused_on_load(run_dir, tmp_path):
    run = copy_of(run_dir, tmp_path)
    tensors = read_weights(run / "best.safetensors")
    name = next(iter(tensors))
    tensors[name][0] = float("nan")
    metadata = read_metadata(run / "best.safetensors")
    save_file(tensors, str(run / "best.safetensors"), metadata=metadata)
    with pytest.raises(AiaynError, match=f"{name} holds NaN or infinite values"):
        load_run(run)


def test_a_missing_run_directory_is_one_clear_error(tmp_path):
    with pytest.raises(AiaynError, match="run directory not found"):
        load_run(tmp_path / "nope")


# ---------------------------------------------------------------- Translator
def test_the_copy_model_translates_by_copying(translator):
    rng = random.Random(7)
    sentences = [random_sentence(rng) for _ in range(30)]
    for beam in (1, 4):
        out = translator.translate(sentences, translator.resolve(beam=beam))
        assert sum(o == s for o, s in zip(out, sentences)) >= 27


def test_translations_keep_the_input_order_whatever_the_batching(translator):
    rng = random.Random(3)
    sentences = [random_sentence(rng, longest=10) for _ in range(25)]
    together = translator.translate(sentences, translator.resolve(beam=3))
    alone = [translator.translate([s], translator.resolve(beam=3))[0] for s in sentences]
    small = Translator(translator.model, translator.tokenizers, decode_tokens=40)
    assert small.translate(sentences, small.resolve(beam=3)) == together == alone


def test_a_translation_that_spells_a_line_break_stays_one_line_of_one_column(translator,
                                                                            monkeypatch):
    """A model with byte fallback can write a newline, a tab or another line break: each is
    a space, so that output line i is still input line i and a row keeps its columns."""
    breaks = "\n\r\t\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
    kind, real = type(translator.tokenizers), type(translator.tokenizers).decode_tgt
    monkeypatch.setattr(kind, "decode_tgt",
                        lambda self, ids: [f"a{breaks}b {text}" for text in real(self, ids)])
    rng = random.Random(5)
    sentences = [random_sentence(rng, longest=8) for _ in range(5)] + [""]
    assert all(t.startswith("a" + " " * len(breaks) + "b ") for t in
               translator.translate(sentences[:-1]))
    for search, rows, tabs in ((translator.resolve(), 6, 0),
                               (translator.resolve(beam=2, nbest=2), 11, 2)):
        out = "".join(translator.translate_lines(sentences, search))
        assert len(out.splitlines()) == rows == out.count("\n")
        assert all(line.count("\t") == tabs for line in out.splitlines())


def test_beam_one_translates_like_greedy_search(translator):
    sentences = ["red sun", "moon tree river blue", "star"]
    src = pad(translator.tokenizers.encode_src(sentences))
    greedy = translator.tokenizers.decode_tgt(greedy_decode(translator.model, src))
    assert translator.translate(sentences, translator.resolve(beam=1)) == greedy
    nbest = translator.translate_nbest(sentences, translator.resolve(beam=1))
    assert [h[0][0] for h in nbest] == greedy


def test_a_translator_without_tokenizers_decodes_ids_as_one_with_them(translator):
    """decode_ids takes token ids, so it needs no tokenizers: the same hypotheses, and a
    beam wider than the target vocabulary refused all the same (the model says its size)."""
    sources = translator.tokenizers.encode_src(["red sun", "moon tree river blue", "star"])
    bare = Translator(translator.model, tokenizers=None)
    search = translator.resolve(beam=3, nbest=2)
    assert bare.decode_ids(sources, search) == translator.decode_ids(sources, search)
    vocab = translator.model.cfg.tgt_vocab_size
    for t in (bare, translator):
        with pytest.raises(AiaynError, match=f"at most {min(vocab, t.decode_tokens // 2)}"):
            t.decode_ids(sources, t.resolve(beam=vocab + 1))


def test_empty_sentences_give_empty_translations_without_decoding(translator):
    out = translator.translate(["", "red sun", "   ", "moon"], translator.resolve(beam=2))
    assert out[0] == "" and out[2] == ""
    assert out[1:4:2] == translator.translate(["red sun", "moon"], translator.resolve(beam=2))
    assert translator.last_stats.sentences == 2
    assert translator.translate([]) == []


def test_a_sentence_longer_than_max_len_is_truncated_with_a_warning(translator):
    max_len = translator.model.cfg.max_len
    long = " ".join(["red", "green"] * max_len)
    with pytest.warns(TruncationWarning, match="1 sentence"):
        out = translator.translate([long, "sun"], translator.resolve(beam=2))
    assert len(out[0].split()) <= max_len - 1
    assert translator.last_stats.truncated == 1
    assert truncate_source([5] * 20 + [EOS_ID], 16) == [5] * 15 + [EOS_ID]


def test_nbest_gives_distinct_scored_hypotheses_best_first(translator):
    sentences = ["red green blue", "", "sun"]
    nbest = translator.translate_nbest(sentences, translator.resolve(beam=4, nbest=3))
    assert nbest[1] == []
    for hyps in (nbest[0], nbest[2]):
        assert len(hyps) == 3 and len({text for text, _ in hyps}) == 3
        assert [s for _, s in hyps] == sorted((s for _, s in hyps), reverse=True)
    best = [hyps[0][0] if hyps else "" for hyps in nbest]
    assert best == translator.translate(sentences, translator.resolve(beam=4))
    with pytest.raises(AiaynError, match="nbest"):
        translator.translate_nbest(sentences, translator.resolve(beam=2, nbest=3))


# ---------------------------------------------------------------- averaging
def test_average_checkpoints_is_the_element_wise_mean(run_dir, tmp_path):
    steps = sorted((run_dir / "checkpoints").glob("step_*.safetensors"))[-3:]
    averaged = average_checkpoints(steps, tmp_path / "avg.safetensors")
    loaded = read_weights(tmp_path / "avg.safetensors")
    tensors = [read_weights(p) for p in steps]
    for name, tensor in loaded.items():
        expected = sum(t[name].double() for t in tensors) / 3
        torch.testing.assert_close(tensor, expected.float())
        assert torch.equal(tensor, averaged[name])


def test_average_refuses_checkpoints_of_different_models(run_dir, tmp_path):
    config, _, _ = load_run(run_dir)
    other = Transformer(ModelConfig(**{**vars(config.model), "d_ff": 128}))
    save_weights(other, tmp_path / "other.safetensors")
    with pytest.raises(AiaynError, match="cannot average"):
        average_checkpoints([run_dir / "best.safetensors", tmp_path / "other.safetensors"],
                            tmp_path / "avg.safetensors")


def test_average_keeps_the_output_pieces_and_refuses_files_that_differ_in_them(run_dir, tmp_path):
    """output_vocab "targets" saves which pieces the model may output beside the weights: an
    average keeps them as they are (not as a mean), and files of differing pieces are refused."""
    config, _, _ = load_run(run_dir)
    cfg = ModelConfig(**{**vars(config.model), "output_vocab": "targets"})
    paths = []
    for i, allowed in enumerate(([3, 5, 6, 9], [3, 5, 6, 9], [3, 5, 7])):
        torch.manual_seed(i)
        model = Transformer(cfg)
        model.generator.set_outputs(torch.tensor(allowed))
        paths.append(tmp_path / f"{i}.safetensors")
        save_weights(model, paths[-1])
    average_checkpoints(paths[:2], tmp_path / "avg.safetensors")
    averaged = Transformer(cfg)
    averaged.load_state_dict(read_weights(tmp_path / "avg.safetensors"), strict=False)
    assert averaged.generator.output_ids.tolist() == [3, 5, 6, 9]
    with pytest.raises(AiaynError, match="generator.output_mask differs"):
        average_checkpoints(paths, tmp_path / "avg2.safetensors")


# ---------------------------------------------------------------- the command line
def test_cli_translate_keeps_order_and_empty_lines(run_dir, capsys, monkeypatch, translator):
    lines = ["red sun", "", "moon tree river", "star"]
    code, out, _ = run_cli(["translate", str(run_dir), "--beam", "2"], capsys,
                           "\n".join(lines) + "\n", monkeypatch)
    assert code == 0
    assert out.split("\n")[:-1] == translator.translate(lines, translator.resolve(beam=2))
    assert out.split("\n")[1] == ""


def test_cli_translate_files_and_nbest(run_dir, tmp_path, capsys):
    source = tmp_path / "in.txt"
    source.write_text("red sun\n\nstar\n", encoding="utf-8")
    target = tmp_path / "out.txt"
    code, _, _ = run_cli(["translate", str(run_dir), "-i", str(source), "-o", str(target),
                          "--beam", "3", "--nbest", "2"], capsys)
    assert code == 0
    rows = [line.split("\t") for line in target.read_text(encoding="utf-8").splitlines()]
    assert [r[0] for r in rows] == ["0", "0", "1", "2", "2"]
    assert rows[2] == ["1", "", ""]
    assert float(rows[0][1]) >= float(rows[1][1])


def test_cli_translate_warns_about_truncation_in_one_line(run_dir, capsys, monkeypatch):
    code, out, err = run_cli(["translate", str(run_dir), "--beam", "1"], capsys,
                             " ".join(["sun"] * 40) + "\n", monkeypatch)
    assert code == 0 and len(out.splitlines()) == 1
    assert err.startswith("aiayn: warning: 1 sentence(s) longer") and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--no-repeat-ngram", "-1"], "--no-repeat-ngram must be between 0 (off) and 64, got -1"),
    (["--temperature", "0.5"], "--temperature goes with --sample"),
    (["--sample", "--beam", "2"], "--beam is for beam search; --sample draws --nbest samples"),
    (["--sample", "--temperature", "0"], "--temperature must be in (0, 100]"),
    (["--sample", "--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["--sample", "--top-k", "-2"], "--top-k must be 0 (every piece) or more, got -2"),
    (["--sample", "--seed", "-1"], "--seed must be between 0 and 2**63 - 1, got -1"),
    (["--sample", "--nbest", "65"], "--nbest (samples per sentence with --sample) must be"),
    (["--beam", "0"], "--beam must be at least 1"),
    (["--beam", "2", "--nbest", "3"], "--nbest must be between 1 and the beam (--beam 2), got 3"),
    (["--decode-tokens", "0"], "--decode-tokens must be between 1 and"),
    # the alias typed is named, and the option it stands for
    (["--max-tokens", "0"], "(--max-tokens is --decode-tokens' older name)"),
    (["--weights", "nope"], "no weights 'nope'"),
    (["-i", "/nonexistent/in.txt"], "input file not found"),
])
def test_cli_translate_errors_are_one_line(run_dir, capsys, argv, message):
    code, _, err = run_cli(["translate", str(run_dir), *argv], capsys)
    assert code == 2
    assert err.startswith("aiayn: error: ") and message in err and err.count("\n") == 1


# ---------------------------------------------------------------- the run's search (decode)
SEARCH_SENTENCES = ["red sun", "moon tree river", "star"]


def with_search(run_dir: Path, tmp_path: Path, beam: int, alpha: float) -> Path:
    """A copy of the run whose config.yaml's decode section says ``beam`` and ``alpha``."""
    run = copy_of(run_dir, tmp_path)
    config = load_config(run / "config.yaml")
    config.decode = DecodeConfig(beam=beam, alpha=alpha)
    save_config(config, run / "config.yaml")
    return run


def test_a_run_decodes_with_its_own_search_unless_told(run_dir, tmp_path):
    t = Translator.from_pretrained(with_search(run_dir, tmp_path, 3, 1.5))
    pairs = [(s.beam, s.alpha) for s in (t.resolve(), t.resolve(beam=1, alpha=0.2),
                                               t.resolve(beam=2))]
    assert pairs == [(3, 1.5), (1, 0.2), (2, 1.5)]
    # n-best scores are divided by the length penalty: alpha shows in them, the beam in
    # how many hypotheses there can be
    ours = t.translate_nbest(SEARCH_SENTENCES, t.resolve(nbest=3))
    assert ours == t.translate_nbest(SEARCH_SENTENCES, t.resolve(beam=3, alpha=1.5, nbest=3))
    assert ours != t.translate_nbest(SEARCH_SENTENCES, t.resolve(beam=3, alpha=0.6, nbest=3))
    with pytest.raises(AiaynError, match=r"^nbest must be between 1 and the beam \(beam 3\), got 4"):
        t.translate_nbest(SEARCH_SENTENCES, t.resolve(nbest=4))
    lines = "".join(t.translate_lines(SEARCH_SENTENCES, t.resolve(nbest=3)))
    assert lines == "".join(t.translate_lines(SEARCH_SENTENCES,
                                              t.resolve(beam=3, alpha=1.5, nbest=3)))


def test_translate_resolves_its_search_once_and_every_layer_gets_that_value(
        run_dir, tmp_path, capsys, monkeypatch):
    """`aiayn translate` builds one Search at the edge; each batch's search receives that
    very object (no layer rebuilds or re-resolves it); a bad option is one line, said
    once, before any weights load."""
    from aiayn import cli
    from aiayn.inference import aiayn_engine, settings, translator

    built, received, resolved = [], [], []

    def resolve(*args, **kwargs):
        resolved.append(args)
        built.append(settings.resolve_search(*args, **kwargs))
        return built[-1]

    def search(model, src, value, use_cache=True, kernel=None, prefixes=None):
        received.append(value)
        return real(model, src, value, use_cache)

    real = aiayn_engine.decode_beam
    monkeypatch.setattr(cli, "resolve_search", resolve)
    monkeypatch.setattr(translator, "resolve_search", lambda *a, **k: pytest.fail("resolved twice"))
    monkeypatch.setattr(aiayn_engine, "decode_beam", search)
    source = tmp_path / "in.txt"
    source.write_text("".join(s + "\n" for s in SEARCH_SENTENCES * 2), encoding="utf-8")
    code, out, _ = run_cli(["translate", str(run_dir), "-i", str(source), "--beam", "3",
                            "--nbest", "2", "--max-tokens", "40"], capsys)
    assert code == 0 and len(out.splitlines()) == 4 * len(SEARCH_SENTENCES)
    assert len(resolved) == 1 and len(received) > 1  # several batches (a small budget)
    assert all(value is built[0] for value in received)
    assert (built[0].beam, built[0].nbest, built[0].max_len_b) == (3, 2, 50)

    monkeypatch.setattr(Translator, "from_pretrained",
                        lambda *a, **k: pytest.fail("loaded before the search was checked"))
    code, _, err = run_cli(["translate", str(run_dir), "-i", str(source), "--beam", "0"], capsys)
    assert code == 2 and err.count("--beam must be at least 1, got 0") == 1


def test_the_length_limit_is_the_runs_decode_max_len_a_and_b(run_dir, tmp_path):
    """decode.max_len_a/b set each sentence's limit, floor(a x source length) + b new tokens;
    the defaults (1, 50) are the paper's "input length + 50"."""
    run = copy_of(run_dir, tmp_path)
    config = load_config(run / "config.yaml")
    assert (config.decode.max_len_a, config.decode.max_len_b) == (1.0, 50)
    config.decode = DecodeConfig(max_len_a=0.5, max_len_b=0)
    save_config(config, run / "config.yaml")
    t = Translator.from_pretrained(run)
    sources, _ = t.encode(SEARCH_SENTENCES)
    for hyps, ids in zip(t.decode_ids(sources, t.resolve(beam=2, nbest=2)), sources, strict=True):
        assert all(len(h.ids) <= max(1, len(ids) // 2) for h in hyps)  # EOS, if any, in it
    with pytest.raises(AiaynError, match=r"decode.max_len_b must be in \[0, 4096\], got -1"):
        load_config(run / "config.yaml", ["decode.max_len_b=-1"])


def test_a_config_without_a_decode_section_searches_as_the_paper(run_dir, tmp_path):
    """Runs trained before the section existed: beam 4, alpha 0.6, as they decoded then."""
    run = copy_of(run_dir, tmp_path)
    text = (run / "config.yaml").read_text(encoding="utf-8")
    head, sep, _ = text.partition("decode:")
    assert sep
    (run / "config.yaml").write_text(head, encoding="utf-8")
    assert load_config(run / "config.yaml").decode == DecodeConfig(beam=4, alpha=0.6)
    search = Translator.from_pretrained(run).resolve()
    assert (search.beam, search.alpha) == (4, 0.6)


def test_a_resumed_run_may_change_its_search_but_not_its_model(run_dir):
    config = load_run_config(run_dir, ["decode.beam=6", "decode.alpha=1.0"])
    assert config.decode == DecodeConfig(beam=6, alpha=1.0)
    with pytest.raises(AiaynError, match="only train.\\* and decode.\\* settings can change"):
        load_run_config(run_dir, ["model.d_model=8"])


def test_cli_translate_and_evaluate_use_the_runs_search(run_dir, tmp_path, capsys, monkeypatch):
    run = with_search(run_dir, tmp_path, 3, 1.5)
    t = Translator.from_pretrained(run)
    text = "\n".join(SEARCH_SENTENCES) + "\n"
    code, out, _ = run_cli(["translate", str(run), "--nbest", "3"], capsys, text, monkeypatch)
    assert code == 0
    assert out == "".join(t.translate_lines(SEARCH_SENTENCES,
                                            t.resolve(beam=3, alpha=1.5, nbest=3)))
    code, told, _ = run_cli(["translate", str(run), "--nbest", "3", "--alpha", "0.6"], capsys,
                            text, monkeypatch)
    assert code == 0 and told == "".join(t.translate_lines(
        SEARCH_SENTENCES, t.resolve(beam=3, alpha=0.6, nbest=3)))
    assert told != out
    code, out, _ = run_cli(["evaluate", str(run), "--limit", "5"], capsys)
    assert code == 0 and "beam 3, alpha 1.5" in out
    summary = json.loads((run / "eval" / "test.best.beam3.alpha1.5.first5.json").read_text(
        encoding="utf-8"))
    assert (summary["beam"], summary["alpha"]) == (3, 1.5)
    # the same beam with another alpha keeps its own files
    code, _, _ = run_cli(["evaluate", str(run), "--limit", "5", "--alpha", "0.6"], capsys)
    assert code == 0
    names = {p.name for p in (run / "eval").iterdir()}
    assert {"test.best.beam3.alpha0.6.first5.txt", "test.best.beam3.alpha1.5.first5.txt"} <= names
    assert json.loads((run / "eval" / "test.best.beam3.alpha1.5.first5.json").read_text(
        encoding="utf-8"))["alpha"] == 1.5


def test_cli_evaluate_scores_the_test_split(run_dir, tmp_path, capsys):
    hyp = tmp_path / "hyp.txt"
    code, out, _ = run_cli(["evaluate", str(run_dir), "--beam", "2", "-o", str(hyp)], capsys)
    assert code == 0
    assert "BLEU" in out and "nrefs:1|case:mixed|eff:no|tok:13a" in out
    assert "chrF" in out and "CER" in out and "WER" in out and "sentences/s" in out
    hypotheses = hyp.read_text(encoding="utf-8").splitlines()
    assert len(hypotheses) == 40
    summary = json.loads(hyp.with_suffix(".json").read_text(encoding="utf-8"))
    assert summary["bleu"] > 80 and summary["sentences"] == 40 and summary["beam"] == 2


def test_cli_evaluate_refuses_an_output_that_would_replace_what_it_reads(run_dir, tmp_path,
                                                                         capsys):
    run, data = copy_of(run_dir, tmp_path), tmp_path / "data"
    shutil.copytree(read_data_dir(run), data)
    before = snapshot(tmp_path)
    for target, what in ((data / "test.jsonl", f"is a file of the prepared data {data}"),
                         (data / "stats.txt", "stats.json is a file of the prepared data"),
                         (run / "config.yaml", "is a file of the run"),
                         (run / "best.safetensors", "is a file of the run"),
                         (data / "ids" / "test.src.ids.npy", "of the prepared data")):
        code, _, err = run_cli(["evaluate", str(run), "--data", str(data), "--limit", "2",
                                "-o", str(target)], capsys)
        assert code == 2 and what in error_line(err), err
    assert snapshot(tmp_path) == before
    (run / "eval").mkdir(exist_ok=True)  # its own evaluations' folder: written there
    (run / "eval" / "mine.txt").write_text("an earlier evaluation\n", encoding="utf-8")
    for output in (run / "eval" / "mine.txt", run / "hyp.txt", data / "hyp.txt"):
        for _ in range(2):  # a file of its own it wrote before is no file it reads
            code, _, err = run_cli(["evaluate", str(run), "--data", str(data), "--limit", "2",
                                    "-o", str(output)], capsys)
            assert code == 0, err


def test_cli_evaluate_without_data_dir_asks_for_data(run_dir, tmp_path, capsys):
    run = copy_of(run_dir, tmp_path)
    (run / "data_dir.txt").unlink()
    code, _, err = run_cli(["evaluate", str(run), "--split", "dev"], capsys)
    assert code == 2 and "give --data" in err
    code, out, _ = run_cli(["evaluate", str(run), "--split", "dev", "--beam", "1",
                            "--data", str(Path(run_dir.parent, "data"))], capsys)
    assert code == 0 and "dev: 20 sentences" in out
    assert (run / "eval" / "dev.best.beam1.txt").is_file()


def test_cli_average_last_n(run_dir, tmp_path, capsys):
    out_file = tmp_path / "avg.safetensors"
    code, out, _ = run_cli(["average", str(run_dir), "--last", "2", "-o", str(out_file)], capsys)
    assert code == 0 and "averaged 2 checkpoints" in out
    steps = sorted((run_dir / "checkpoints").glob("step_*.safetensors"))[-2:]
    expected = average_checkpoints(steps, tmp_path / "direct.safetensors")
    loaded = read_weights(out_file)
    assert all(torch.equal(loaded[name], expected[name]) for name in expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Translator.from_pretrained(run_dir, weights=str(out_file)).translate(["sun"])
    code, _, err = run_cli(["average", str(run_dir), "--last", "9", "-o", str(out_file)], capsys)
    assert code == 2 and "holds 4" in err


def test_the_default_batch_budget_is_a_cpus_8192_and_on_a_gpu_what_its_memory_holds(monkeypatch):
    """decode_tokens=None: 8,192 on a CPU; on a GPU a quarter of its free memory at
    decode_bytes_per_token, between 8,192 and 2**18 (the GPU path, with its memory query
    replaced, checked on a CPU)."""
    from aiayn.config import ModelConfig
    from aiayn.inference import budget

    cfg = ModelConfig(d_model=256, n_decoder_layers=2, tgt_vocab_size=8000)
    per_token = budget.decode_bytes_per_token(cfg)
    assert budget.default_decode_tokens(cfg, torch.device("cpu")) == 8192
    gpu = torch.device("cuda")
    for free, expected in ((2**30, 8192), (8 * 2**30, 8 * 2**30 // 4 // per_token),
                           (80 * 2**30, 2**18)):
        monkeypatch.setattr(budget, "memory_bytes", lambda device, free=free: free)
        assert budget.default_decode_tokens(cfg, gpu) == expected
    assert 8192 < 8 * 2**30 // 4 // per_token < 2**18  # the middle case is the formula's


# ---------------------------------------------------------------- the guard and sampling
REPEATING = ["red red red sun sun", "moon tree moon tree moon", "star"]


def test_the_guard_keeps_every_translation_free_of_repeated_ngrams(translator, run_dir,
                                                                    tmp_path):
    def repeats(text: str, n: int) -> bool:
        words = text.split()
        return len({tuple(words[i:i + n]) for i in range(len(words) - n + 1)}) < len(words) - n + 1

    plain = translator.translate(REPEATING, translator.resolve(beam=3))
    # The copy model repeats what it copies (how exactly depends on the CPU's rounding: "red
    # red red sun sun" on one, "red red red red sun" on another), so the guard has work.
    assert repeats(plain[0], 2) and repeats(plain[1], 2), plain
    for n in (1, 2):
        guarded = translator.translate(REPEATING, translator.resolve(beam=3, no_repeat_ngram=n))
        assert not any(repeats(text, n) for text in guarded), guarded
        # A translation with nothing to repeat is left as it was.
        assert all(g == p for g, p in zip(guarded, plain) if not repeats(p, n)), (guarded, plain)
    # The run's decode.no_repeat_ngram is the default; 0 turns it off.
    run = copy_of(run_dir, tmp_path)
    config = load_config(run / "config.yaml")
    config.decode = DecodeConfig(no_repeat_ngram=2)
    save_config(config, run / "config.yaml")
    guarded = Translator.from_pretrained(run)
    assert guarded.translate(REPEATING, guarded.resolve(beam=3)) == translator.translate(
        REPEATING, translator.resolve(beam=3, no_repeat_ngram=2))
    assert guarded.translate(REPEATING, guarded.resolve(beam=3, no_repeat_ngram=0)) == plain


def test_sampling_through_the_translator_is_reproducible_for_a_seed(translator):
    sentences = ["red green blue sun", "", "moon tree river star black"]
    hot = Sampling(temperature=3.0, seed=5)
    drawn = translator.translate_nbest(sentences, translator.resolve(nbest=4, sampling=hot))
    assert drawn == translator.translate_nbest(sentences,
                                               translator.resolve(nbest=4, sampling=hot))
    assert drawn[1] == [] and all(len(hyps) == 4 for hyps in (drawn[0], drawn[2]))
    assert len({text for hyps in drawn for text, _ in hyps}) >= 4  # hot samples differ
    assert [s for _, s in drawn[0]] == sorted((s for _, s in drawn[0]), reverse=True)
    # Each sentence's samples are its own: alone, in another batch, the same.
    alone = translator.translate_nbest(sentences[2:], translator.resolve(nbest=4, sampling=hot))
    assert alone[0] == drawn[2]
    # Keeping only the likeliest piece is greedy search; translate gives one sample.
    greedy = translator.translate(sentences, translator.resolve(beam=1))
    for sampling in (Sampling(top_k=1, seed=1), Sampling(top_p=1e-6)):
        assert translator.translate(sentences, translator.resolve(sampling=sampling)) == greedy
    with pytest.raises(AiaynError, match="^beam is for beam search"):
        translator.translate(sentences, translator.resolve(beam=2, sampling=hot))


def test_cli_translate_samples_with_a_seed(run_dir, capsys, monkeypatch, translator):
    lines = "red green blue sun\nmoon tree river star black\n"
    argv = ["translate", str(run_dir), "--sample", "--temperature", "3", "--top-k", "5",
            "--nbest", "3"]
    code, out, err = run_cli(argv, capsys, lines, monkeypatch)
    assert code == 0 and err.startswith("aiayn: sampling with --seed ")
    seed = err.split()[4]
    rows = [line.split("\t") for line in out.splitlines()]
    assert [r[0] for r in rows] == ["0"] * 3 + ["1"] * 3
    again = run_cli([*argv, "--seed", seed], capsys, lines, monkeypatch)
    assert again == (0, out, "")
    expected = translator.translate_nbest(lines.splitlines(), translator.resolve(
        nbest=3, sampling=Sampling(temperature=3.0, top_k=5, seed=int(seed))))
    assert [r[2] for r in rows] == [text for hyps in expected for text, _ in hyps]
    code, out, _ = run_cli(["translate", str(run_dir), "--beam", "2", "--no-repeat-ngram",
                            "1"], capsys, "red red sun\n", monkeypatch)
    guarded = translator.resolve(beam=2, no_repeat_ngram=1)
    assert code == 0 and out == translator.translate(["red red sun"], guarded)[0] + "\n"


# ---------------------------------------------------------------- the Search value
@pytest.mark.parametrize("method", ["translate", "translate_nbest", "translate_aligned",
                                    "translate_lines"])
def test_a_str_where_a_list_of_sentences_is_wanted_is_refused(method):
    """A str is iterable: it was translated one character at a time, silently."""
    from helpers import tiny_model

    translator = Translator(tiny_model(), tokenizers=None)
    with pytest.raises(TypeError, match=rf"^{method}\(\) takes a list of sentences; got a str: "
                                        rf"use {method}\(\[text\]\)$"):
        list(getattr(translator, method)("God is love."))


@pytest.mark.parametrize("settings, message", [
    ({"beam": 0}, "beam must be at least 1, got 0"),
    ({"beam": "4"}, "beam must be an integer, got '4'"),
    ({"beam": True}, "beam must be an integer, got True"),
    ({"alpha": -1.0}, "alpha must be in [0, 10], got -1.0"),
    ({"alpha": float("nan")}, "alpha must be in [0, 10], got nan"),
    ({"beam": 2, "nbest": 3}, "nbest must be between 1 and the beam (beam 2), got 3"),
    ({"nbest": 0}, "nbest must be between 1 and the beam (beam 4), got 0"),
    ({"no_repeat_ngram": 65}, "no_repeat_ngram must be between 0 (off) and 64, got 65"),
    ({"max_len_a": -0.5}, "max_len_a must be in [0, 10], got -0.5"),
    ({"max_len_b": 5000}, "max_len_b must be between 0 and 4096, got 5000"),
    ({"beam": 2, "sampling": Sampling()}, "beam is for beam search; sampling draws nbest"),
    ({"nbest": 65, "sampling": Sampling()},
     "nbest (samples per sentence with sampling) must be between 1 and 64, got 65"),
])
def test_the_search_value_checks_its_settings_once_from_the_configs_ranges(settings, message):
    """Bounds from aiayn.config.RANGES, a SettingError naming the Python keyword (each edge
    spells it its own way: ``SettingError.spelled``)."""
    from aiayn.errors import SettingError
    from aiayn.inference.settings import Search, resolve_search

    with pytest.raises(SettingError) as caught:
        resolve_search(DecodeConfig(), **settings)
    assert str(caught.value).startswith(message)
    assert caught.value.spelled(lambda name: f"<{name}>").startswith("<")
    # Built directly, the value checks the same (no second list of bounds)
    if "sampling" not in settings:
        with pytest.raises(SettingError, match="^" + message.split(" ")[0]):
            Search(**{"beam": 4, **settings})


@pytest.mark.parametrize("settings, message", [
    ({"temperature": 0.0}, "temperature must be in (0, 100] (towards 0: greedy search)"),
    ({"top_k": -2}, "top_k must be 0 (every piece) or more, got -2"),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"seed": -1}, "seed must be between 0 and 2**63 - 1, got -1"),
    ({"seed": 2 ** 63}, "seed must be between 0 and 2**63 - 1"),
])
def test_sampling_checks_its_settings_when_built(settings, message):
    from aiayn.errors import SettingError

    with pytest.raises(SettingError) as caught:
        Sampling(**settings)
    assert str(caught.value).startswith(message)


def test_the_search_value_stays_hashable_with_nbest_out_of_equality():
    from aiayn.inference.settings import Search

    assert Search(4, nbest=1) == Search(4, nbest=3)
    assert hash(Search(4, nbest=1)) == hash(Search(4, nbest=3))
    assert len({Search(4, 0.6), Search(4, 0.6, nbest=2), Search(4, 1.0)}) == 2


def test_the_decoding_budget_has_one_name():
    """decode_tokens, not max_tokens: the Translator's keyword and property are gone."""
    from helpers import tiny_model

    translator = Translator(tiny_model(), tokenizers=None, decode_tokens=64)
    assert translator.decode_tokens == 64 and not hasattr(translator, "max_tokens")
    with pytest.raises(TypeError):
        Translator(tiny_model(), tokenizers=None, max_tokens=64)


# ---------------------------------------------------------------- aiayn translate, line by line

def read_lines(fd: int, count: int, timeout: float = 60) -> list[str]:
    """``count`` lines from a pipe, waiting at most ``timeout`` seconds for them."""
    data, deadline = b"", time.monotonic() + timeout
    while data.count(b"\n") < count:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise AssertionError(f"no answer within {timeout} s; got {data!r}")
        chunk = os.read(fd, 4096)
        if not chunk:
            raise AssertionError(f"the process ended; got {data!r}")
        data += chunk
    return data.decode().removesuffix("\n").split("\n")  # lines end at "\n" only


def start_translate(run: Path, *options: str, stdin) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "aiayn", "translate", str(run), *options],
                            stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_translate_interactive_answers_each_line_before_the_next(run_dir, translator):
    process = start_translate(run_dir, "--interactive", "--beam", "2", stdin=subprocess.PIPE)
    out = process.stdout.fileno()
    try:
        # translate's line rules: a "\r" before the "\n" goes, U+2028 ends no line.
        for line in ("red green blue\r", "", "sun\u2028moon", "white star"):
            process.stdin.write(line.encode() + b"\n")
            process.stdin.flush()  # and nothing more until the answer is back
            want = translator.translate([line.removesuffix("\r")], translator.resolve(beam=2))[0]
            assert read_lines(out, 1) == [want]
        process.stdin.close()
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()


def test_translate_reads_a_terminal_line_by_line(run_dir, translator):
    """A terminal on stdin (no --interactive): answers as lines come, n-best rows numbered
    across lines as for a file."""
    controller, terminal = pty.openpty()
    process = start_translate(run_dir, "--beam", "2", "--nbest", "2", stdin=terminal)
    os.close(terminal)
    out = process.stdout.fileno()
    try:
        for number, line in enumerate(["black sun", "white moon star"]):
            os.write(controller, line.encode() + b"\n")
            rows = read_lines(out, 2)
            want = translator.translate_nbest([line], translator.resolve(beam=2, nbest=2))[0]
            assert [r.split("\t")[0] for r in rows] == [str(number)] * 2
            assert [r.split("\t")[2] for r in rows] == [text for text, _ in want]
        os.write(controller, b"\x04")  # Ctrl-D: end of input
        assert process.wait(timeout=30) == 0
        assert "each line as it is entered" in process.stderr.read().decode()
    finally:
        process.kill()
        os.close(controller)


def test_translate_interactive_refuses_an_input_file(run_dir, capsys):
    from aiayn import cli

    assert cli.main(["translate", str(run_dir), "--interactive", "-i", "file.txt"]) == 2
    assert capsys.readouterr().err.strip() == \
        "aiayn: error: --interactive reads stdin line by line; drop -i/--input"


# ---------------------------------------------------------------- scores and prefixes
def test_every_translation_can_come_with_its_score_and_each_pieces_log_probability(translator):
    sentences = ["red sun moon", "", "star tree"]
    for search in (translator.resolve(beam=1), translator.resolve(beam=3, nbest=2)):
        scored = translator.translate_scored(sentences, search)
        assert scored[1] == [] and [len(s) for s in scored] == [search.nbest, 0, search.nbest]
        best = [s[0].text if s else "" for s in scored]
        assert best == translator.translate(sentences, search)
        for t in scored[0] + scored[2]:
            assert len(t.pieces) == len(t.log_probs) and t.pieces[-1] == "[EOS]"
            assert t.log_prob == pytest.approx(sum(t.log_probs))
            alpha = search.alpha
            assert t.score == pytest.approx(t.log_prob / ((5 + len(t.pieces)) / 6) ** alpha)
        nbest = translator.translate_nbest(sentences, search)
        assert nbest == [[(t.text, t.score) for t in s] for s in scored]


def test_a_translation_completes_the_prefix_it_is_given(translator):
    sentences = ["red sun moon river", "star tree blue", "sun"]
    greedy = translator.resolve(beam=1)
    own = translator.translate(sentences, greedy)
    for k in range(4):  # the first k words of its own translation: the same translation
        prefixes = [" ".join(o.split()[:k]) for o in own]
        assert translator.translate(sentences, greedy, prefixes=prefixes) == own
    out = translator.translate(sentences, translator.resolve(beam=3),
                               prefixes=["blue", None, "white star"])
    assert out[0].startswith("blue ") and out[1] == own[1] and out[2].startswith("white star")
    scored = translator.translate_scored(["red sun"], prefixes=["blue"])[0][0]
    assert scored.pieces[0] == "▁blue" and scored.log_probs[0] < -1  # unlikely, and says so


def test_a_prefix_the_model_cannot_write_is_one_line_naming_the_sentence(translator):
    with pytest.raises(AiaynError, match=r"prefix of sentence 2 \('zzq'\) has pieces this "
                                         r"model cannot write: '\[UNK\]'$"):
        translator.translate(["red", "sun"], prefixes=["", "zzq"])
    with pytest.raises(AiaynError, match=f"has 40 pieces; at most {translator.max_len - 2} fit"):
        translator.translate(["red"], prefixes=[" ".join(["sun"] * 40)])
    with pytest.raises(AiaynError, match="2 prefixes for 1 sentences"):
        translator.translate(["red"], prefixes=["a", "b"])


def test_cli_translate_scores_and_prefixes(run_dir, tmp_path, capsys, translator):
    source = tmp_path / "in.tsv"
    source.write_text("red sun\tblue\n\nstar tree\n", encoding="utf-8")
    code, out, _ = run_cli(["translate", str(run_dir), "-i", str(source), "--prefix",
                            "--scores", "--beam", "2"], capsys)
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert rows[1] == {"translation": ""}
    want = translator.translate_scored(["red sun", "star tree"], translator.resolve(beam=2),
                                       prefixes=["blue", None])
    for row, [t] in zip([rows[0], rows[2]], want, strict=True):
        assert row["translation"] == t.text and row["pieces"] == t.pieces
        assert row["score"] == pytest.approx(t.score, abs=1e-6)
    assert rows[0]["translation"].startswith("blue")
    code, out, _ = run_cli(["translate", str(run_dir), "-i", str(source), "--prefix",
                            "--beam", "2"], capsys)
    assert out.splitlines() == [t[0].text if t else "" for t in translator.translate_scored(
        ["red sun", "", "star tree"], translator.resolve(beam=2), prefixes=["blue", "", ""])]
    source.write_text("red\tzzq\n", encoding="utf-8")
    code, _, err = run_cli(["translate", str(run_dir), "-i", str(source), "--prefix"], capsys)
    assert code == 2 and err.count("\n") == 1 and "prefix of sentence 1" in err
