"""The model card every export writes (aiayn.export.modelcard): the run's own figures,
loading code that translates, and the directions of a model of several (none for one)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from export_helpers import needs_ct2, needs_hf

from aiayn.config import save_config
from aiayn.data.tokenizer import Tokenizers
from aiayn.errors import AiaynError
from aiayn.evaluation.evaluate import evaluate_run
from aiayn.export.command import export_run
from aiayn.export.hf import HF_CODE
from aiayn.export.modelcard import CARD_FILE, model_card
from aiayn.inference.translator import Translator
from aiayn.runs.checkpoint import STATE_VERSION, save_train_state, save_weights, weights_fingerprint
from aiayn.runs.directory import load_run


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
             "bleu": bleu, "chrf": chrf, "limit": 0, "weights_step": "300" if weights == "best"
             else None, "weights_sha256": weights_fingerprint(run / f"{weights}.safetensors"),
             **signatures}))
    (run / "eval" / "dev.best.beam1.json").write_text(json.dumps(
        {"split": "dev", "weights": "best", "beam": 1, "alpha": 0.6, "sentences": 20,
         "bleu": 99.0, "chrf": 99.0}))  # the dev split: not a test figure
    evaluation = section(model_card(run, "hf"), "Evaluation")
    assert "| best (step 300) (exported) | beam 4, alpha 0.6 | 40 | 23.45 | 51.20 |" in evaluation
    assert "| last | greedy | 40 | 19.87 | 47.65 |" in evaluation
    assert "99" not in evaluation and "Not evaluated" not in evaluation
    assert all(f"`{sig}`" in evaluation for sig in signatures.values())


def test_the_card_shows_a_test_figure_only_for_the_weights_that_gave_it(run_dir, tmp_path):
    """`aiayn evaluate --limit N` writes a file of its own, not over the whole split's, and
    the card leaves it out; weights saved again under the evaluated name (a resumed run's
    new best) take the old figure off the card."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    config, model, _ = load_run(run)
    save_weights(model, run / "best.safetensors", metadata={"step": "8"})  # as training saves it
    whole = evaluate_run(run, "test", progress=False, device="cpu")
    sample = evaluate_run(run, "test", limit=2, progress=False, device="cpu")
    int8 = evaluate_run(run, "test", progress=False, device="cpu", int8=True)
    assert Path(sample["output"]).name.endswith(".first2.txt") and sample["sentences"] == 2
    assert json.loads(Path(whole["scores_file"]).read_text())["sentences"] == whole["sentences"] > 2
    search = "greedy" if whole["beam"] == 1 else f"beam {whole['beam']}, alpha {whole['alpha']}"
    assert whole["weights_step"] == 8  # a number, as `aiayn info --json` gives steps
    row = (f"| best (step 8) (exported) | {search} | {whole['sentences']} | "
           f"{whole['bleu']:.2f} |")
    evaluation = section(model_card(run, "hf"), "Evaluation")
    assert row in evaluation
    assert (f"{search}, int8 decoding | {int8['sentences']} | {int8['bleu']:.2f} |"
            in evaluation)  # the int8 figure is not the exported model's own
    assert "Left out: 1 evaluation(s) of the first sentences only" in evaluation
    # best.safetensors replaced by other weights: the figure no longer describes it
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    save_weights(model, run / "best.safetensors", metadata={"step": "999"})
    evaluation = section(model_card(run, "hf"), "Evaluation")
    assert "| best" not in evaluation and "Not evaluated on the test split" in evaluation
    assert "2 of weights the run no longer holds under that name" in evaluation  # fp32, int8


def test_weights_saved_again_during_an_evaluation_are_refused_not_recorded(
        run_dir, tmp_path, monkeypatch):
    """A training run that saves best.safetensors while `aiayn evaluate` translates with the
    weights it had: the evaluation writes nothing rather than a figure under the new ones."""
    import aiayn.evaluation.evaluate as evaluate_module

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    config, model, _ = load_run(run)
    translate = evaluate_module.translate_and_score

    def and_save_again(*args, **kwargs):
        done = translate(*args, **kwargs)
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
        save_weights(model, run / "best.safetensors", metadata={"step": "999"})
        return done

    monkeypatch.setattr(evaluate_module, "translate_and_score", and_save_again)
    with pytest.raises(AiaynError, match="best.safetensors was saved again while it was being read"):
        evaluate_run(run, "test", progress=False, device="cpu")
    assert not (run / "eval").exists() or not list((run / "eval").iterdir())


@needs_ct2
def test_the_ctranslate2_cards_loading_code_translates(run_dir, tmp_path):
    """The card's Python for CTranslate2 and `tokenizers` alone gives what `aiayn translate
    --engine ctranslate2` gives, the run's repetition guard included (a sentence that repeats
    itself, which the copying model would copy, repetition and all, without it)."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    config = load_run(run)[0]
    save_config(dataclasses.replace(config, decode=dataclasses.replace(
        config.decode, no_repeat_ngram=2)), run / "config.yaml")
    out = export_run(run, "ctranslate2", tmp_path / "ct2")
    card = (out / CARD_FILE).read_text(encoding="utf-8")
    code = section(card, "How to load").split("```python\n", 1)[1].split("```", 1)[0]
    for sentence in ("red green blue", "red green red green red green"):
        run_code = code.replace("THIS_DIR", str(out)).replace("A sentence to translate.", sentence)
        printed = subprocess.run([sys.executable, "-c", run_code], capture_output=True,
                                 text=True, check=True).stdout
        theirs = Translator.from_pretrained(out, engine="ctranslate2")
        assert printed.splitlines() == theirs.translate([sentence])
    unguarded = theirs.translate([sentence], theirs.resolve(no_repeat_ngram=0))
    assert printed.splitlines() != unguarded  # the guard changed this one


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


def test_the_cards_of_a_tagged_run_dir_name_each_direction(tagged_run_dir):
    """Both cards list every target language with its tag and say how to ask for one in
    aiayn, Transformers and CTranslate2; their loading code writes the first."""
    tags = Tokenizers.load(tagged_run_dir / "tokenizer").tags
    for target in ("hf", "ctranslate2"):
        card = model_card(tagged_run_dir, target)
        directions = section(card, "Directions")
        for lang, tag in tags.items():
            assert f"| {lang} | `{tag}` |" in directions
        assert '--to es' in directions and 'to="es"' in directions
        assert '"<2es> "' in directions and '["<2es>"]' in directions
        loading = section(card, "How to load")
        assert ('"<2es> A sentence to translate."' if target == "hf" else
                '["<2es>"] + source.encode') in loading


def test_a_one_direction_runs_card_names_no_direction(run_dir):
    """A model of one target language: no Directions section, no tag, no --to."""
    for target in ("hf", "ctranslate2"):
        card = model_card(run_dir, target)
        assert "## Directions" not in card and "<2" not in card
        assert "--to " not in card.replace("aiayn export --to", "")


@needs_ct2
def test_the_ctranslate2_cards_loading_code_translates_the_direction_it_names(tagged_ct2):
    """The card's Python for CTranslate2 and `tokenizers` alone, tag token included, gives
    what aiayn's CTranslate2 engine gives with to="es"."""
    out = tagged_ct2
    card = (out / CARD_FILE).read_text(encoding="utf-8")
    code = section(card, "How to load").split("```python\n", 1)[1].split("```", 1)[0]
    code = code.replace("THIS_DIR", str(out)).replace("A sentence to translate.", "red sun")
    printed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout
    theirs = Translator.from_pretrained(out, engine="ctranslate2", to="es")
    assert printed.splitlines() == theirs.translate(["red sun"]) == ["red sun"]


@needs_hf
def test_the_transformers_cards_loading_code_translates_the_direction_it_names(tagged_hf):
    """The card's Transformers lines, tag included, translate into the language it names."""
    out = tagged_hf
    card = (out / CARD_FILE).read_text(encoding="utf-8")
    code = section(card, "How to load").split("```python\n", 1)[1].split("```", 1)[0]
    code = code.replace("THIS_DIR", str(out)).replace("A sentence to translate.", "red sun")
    printed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}).stdout
    assert printed.splitlines() == ["['red sun']"]
