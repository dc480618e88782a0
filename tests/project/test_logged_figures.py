"""What a run logs is what its weights give (docs/training.md#what-the-log-promises).

The demo's recipe (configs/demo.yaml as it is: restricted output layer, QK-norm, pre-norm,
tied embeddings, the optimizer `aiayn train` builds) trains on a small slice of the Bible
with a validation every few steps; then a fresh process evaluates the weights the run
saved, and its figures must be the ones the run logged for them. A decoding speed-up that
scored validations with stale weights passed every unit test and broke exactly this.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import ROOT, prepare_splits, records

from aiayn.config import load_config
from aiayn.runs.checkpoint import read_metadata

DEMO = ROOT / "configs" / "demo.yaml"
STEPS, EVERY = 120, 40  # three validations: two on the way and the final one


@pytest.fixture(scope="module")
def demo_run(bible_stream, tmp_path_factory):
    """A run of the demo's config on 2,000 training verses (dev: 20 verses)."""
    root = tmp_path_factory.mktemp("demo-recipe")
    splits = {"train": bible_stream.texts("train")[:2000], "dev": bible_stream.texts("dev")[:20],
              "test": bible_stream.texts("test")[:10]}
    data = prepare_splits(root / "data", splits,
                          replace(load_config(DEMO).data, vocab_size=2000),
                          model_max_len=load_config(DEMO).model.max_len)
    run = root / "run"
    # fp32 on every CPU (bf16: auto trains in bf16 where it is fast) so that both sides
    # compute in the same precision; the whole dev split is decoded at each validation
    # (eval_max_sentences 0), as `aiayn evaluate --split dev` does.
    settings = {"max_steps": STEPS, "max_minutes": 0, "warmup_steps": EVERY, "bf16": "false",
                "eval_every": EVERY, "save_every": EVERY, "eval_max_sentences": 0,
                "max_tokens": 512, "keep_steps": "[]", "log_every": 20, "cpu_threads": 1,
                "num_samples": 20}  # every dev verse's translation logged as a sample
    sets = [arg for key, value in settings.items() for arg in ("--set", f"train.{key}={value}")]
    aiayn("train", "--config", str(DEMO), "--data", str(data), "--out", str(run), *sets)
    return run


def aiayn(*args: str) -> str:
    """Run the CLI in a process of its own; its standard output."""
    result = subprocess.run([sys.executable, "-m", "aiayn", *args], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return result.stdout


def evaluate(run, weights: str) -> dict:
    """A fresh process's dev figures for ``weights``, with the validation's search
    (train.eval_beam: greedy, and the run's repetition guard) and batch budget, and its
    translations as "hyps"."""
    output = run / f"fresh-dev.{weights}.txt"
    aiayn("evaluate", str(run), "--split", "dev", "--weights", weights, "--beam", "1",
          "--max-tokens", "512", "-o", str(output))
    summary = json.loads(output.with_suffix(".json").read_text(encoding="utf-8"))
    assert summary["no_repeat_ngram"] == load_config(DEMO).decode.no_repeat_ngram  # both guarded
    summary["hyps"] = Path(summary["output"]).read_text(encoding="utf-8").splitlines()
    return summary


def assert_same_translations(logged: dict, fresh: dict) -> None:
    """The validation's samples (every dev verse) against the fresh translations. The same
    search on the same weights gives the same tokens; a near-tie decided by the last bit of
    another kernel (see LOSS_TOLERANCE) could change one sentence, not more."""
    hyps = [sample["hyp"] for sample in logged["samples"]]
    assert len(hyps) == len(fresh["hyps"])
    differ = sum(a != b for a, b in zip(hyps, fresh["hyps"]))
    assert differ <= 1, f"{differ} of {len(hyps)} dev translations differ"
    assert fresh["bleu"] == pytest.approx(logged["bleu"], abs=0.5)


# The logged loss and a fresh one may differ in the last digits: a process picks the output
# product's kernel (aiayn.inference.kernels) by a timing probe, and BLAS and oneDNN round differently.
# Stale weights moved the loss by tenths.
LOSS_TOLERANCE = 1e-4


def test_the_last_validation_logged_what_last_safetensors_gives(demo_run):
    dev = records(demo_run, "dev")
    assert [r["step"] for r in dev] == list(range(EVERY, STEPS + 1, EVERY))
    assert dev[-1]["dev_loss"] < dev[0]["dev_loss"] - 0.2  # it learned: the figures move
    fresh = evaluate(demo_run, "last")
    assert fresh["loss"] == pytest.approx(dev[-1]["dev_loss"], abs=LOSS_TOLERANCE)
    assert_same_translations(dev[-1], fresh)


def test_best_safetensors_holds_the_step_the_log_names_and_scores_what_it_logged(demo_run):
    dev = records(demo_run, "dev")
    best = min(dev, key=lambda r: r["dev_loss"])  # configs/demo.yaml: best_metric loss
    assert dev[-1]["best_step"] == best["step"]
    assert read_metadata(demo_run / "best.safetensors")["step"] == str(best["step"])
    fresh = evaluate(demo_run, "best")
    assert fresh["loss"] == pytest.approx(best["dev_loss"], abs=LOSS_TOLERANCE)
    assert_same_translations(best, fresh)
