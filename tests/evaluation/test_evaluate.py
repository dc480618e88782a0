"""Evaluation: the dev BLEU that training logs is the one `aiayn evaluate` reports for the
same weights and settings (one decode driver, one scorer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import TINY, run_train, sets, write_prepared

from aiayn.cli import main
from aiayn.evaluation.evaluate import eval_subset, evaluate_run
from aiayn.inference.settings import resolve_search
from aiayn.runs.directory import run_decode


@pytest.mark.parametrize("beam", [1, 2])
def test_validation_during_training_and_aiayn_evaluate_give_the_same_scores(tmp_path, beam,
                                                                             capsys):
    data_dir = write_prepared(tmp_path / "data")
    run = tmp_path / "run"
    # A moderate peak (the tiny preset's eq. 3 peaks near 4e-2): at that rate the toy model
    # collapsed to empty outputs on some CPUs (AVX2 numerics), and two empty scores agree.
    # The run's own length penalty (decode.alpha), which both take when not told one.
    run_train("--config", TINY, "--data", str(data_dir), "--out", str(run),
              *sets(max_steps=100, eval_every=1000, save_every=1000, eval_beam=beam,
                    num_samples=16, seed=2, schedule="linear", peak_lr=3e-3),
              "--set", "decode.alpha=1.5")
    lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    dev = [r for r in map(json.loads, lines) if r["kind"] == "dev"][-1]
    assert dev["step"] == 100 and dev["n_sentences"] == 16  # the final, whole-dev evaluation
    search = resolve_search(run_decode(run), beam=beam)
    summary = evaluate_run(run, "dev", search, weights="last", progress=False)
    assert summary["sentences"] == 16
    assert summary["bleu"] == dev["bleu"] and summary["chrf"] == dev["chrf"]
    assert summary["bleu_signature"] == dev["bleu_signature"]
    assert dev["chrf"] > 0
    hypotheses = Path(summary["output"]).read_text(encoding="utf-8").splitlines()
    assert [s["hyp"] for s in dev["samples"]] == hypotheses  # all 16: the same sentences
    # The command prints the same BLEU.
    assert main(["evaluate", str(run), "--split", "dev", "--beam", str(beam),
                 "--weights", "last", "-o", str(tmp_path / "hyp.txt")]) == 0
    assert f"BLEU  {dev['bleu']:.2f}" in capsys.readouterr().out


def test_eval_subset_spreads_k_positions_over_n():
    assert eval_subset(10, 0) == list(range(10))
    assert eval_subset(10, 20) == list(range(10))
    assert eval_subset(10, 5) == [0, 2, 4, 6, 8]


def test_validation_decodes_in_fp32_when_training_runs_in_bf16(tmp_path, monkeypatch):
    """`auto` trains in bf16 on a CPU with AVX512-BF16 or AMX; validation still decodes in
    fp32, as `aiayn evaluate` does by default, so the two report the same BLEU there too
    (bf16 decoding changes some tokens)."""
    import aiayn.evaluation.evaluate

    made = []

    class Recording(aiayn.evaluation.evaluate.Translator):
        def __init__(self, *args, **kwargs):
            made.append(kwargs.get("bf16"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(aiayn.evaluation.evaluate, "Translator", Recording)
    data_dir = write_prepared(tmp_path / "data")
    run_train("--config", TINY, "--data", str(data_dir), "--out", str(tmp_path / "run"),
              *sets(max_steps=10, eval_every=5, save_every=1000, bf16="true"))
    dev = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text(
        encoding="utf-8").splitlines()) if r["kind"] == "dev"]
    assert [r["step"] for r in dev] == [5, 10]
    assert made == [False, False]  # one Translator per validation, both in fp32


def test_evaluate_reports_the_stutter_of_hypotheses_and_references(run_dir, tmp_path, capsys):
    """The share that repeats a 4-gram of words, beside the references' share, printed and
    in the .json; the guard's n names the file, so that runs with and without it do not
    overwrite each other."""
    from aiayn.data.prepared import load_prepared
    from aiayn.evaluation.metrics import stutter_share

    refs = [tgt for _, tgt in load_prepared(Path((run_dir / "data_dir.txt").read_text(
        encoding="utf-8").strip())).split("test")]
    plain = evaluate_run(run_dir, search=resolve_search(run_decode(run_dir), beam=2),
                         output=tmp_path / "plain.txt", progress=False)
    assert plain["no_repeat_ngram"] == 0 and plain["repeats"]["n"] == 4
    assert plain["repeats"]["references"] == stutter_share(refs)
    hyps = (tmp_path / "plain.txt").read_text(encoding="utf-8").splitlines()
    assert plain["repeats"]["hypotheses"] == stutter_share(hyps)
    assert main(["evaluate", str(run_dir), "--beam", "2", "--no-repeat-ngram", "1"]) == 0
    out = capsys.readouterr().out
    assert "beam 2, alpha 0.6, no repeated 1-gram" in out
    scores = json.loads((run_dir / "eval" / "test.best.beam2.alpha0.6.norepeat1.json")
                        .read_text(encoding="utf-8"))
    guarded = Path(scores["output"]).read_text(encoding="utf-8").splitlines()
    assert all(len(set(h.split())) == len(h.split()) for h in guarded)  # word-level pieces
    assert guarded != hyps and scores["no_repeat_ngram"] == 1
    share = scores["repeats"]
    assert f"stutter {100 * share['hypotheses']:.1f}% of the translations repeat a 4-gram " \
           f"of words, {100 * share['references']:.1f}% of the references" in out
