"""Attention over a run's saved steps (`aiayn attention --steps`): one panel per checkpoint
in step order, each the attention that checkpoint's weights give for one fixed target."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers import error_line
from PIL import Image

from aiayn.cli import main
from aiayn.inference.attention import sentence_attention
from aiayn.inference.translator import Translator
from aiayn.inspect import attention_plots
from aiayn.inspect.attention_steps import attention_over_steps
from aiayn.model import Transformer
from aiayn.runs.checkpoint import load_weights
from aiayn.runs.directory import list_step_checkpoints

SENTENCE = "sun moon star tree river"


@pytest.fixture(scope="module")
def steps_att(run_dir):
    return attention_over_steps(run_dir, SENTENCE)


def test_one_checkpoint_after_another_in_step_order(run_dir, steps_att):
    # conftest's run: step checkpoints 100..400 and a last.safetensors without a step
    assert steps_att.steps == [100, 200, 300, 400, None]
    assert steps_att.files == [*list_step_checkpoints(run_dir), run_dir / "last.safetensors"]
    translator = Translator.from_pretrained(run_dir)
    assert steps_att.translation == translator.translate([SENTENCE])[0]
    assert steps_att.layer == 0 and steps_att.n_layers == 1


def test_each_step_is_the_attention_of_its_weights_loaded_by_hand(run_dir, steps_att):
    translator = Translator.from_pretrained(run_dir)
    sources, _ = translator.encode([SENTENCE])
    target = translator.decode_ids(sources)[0][0].ids  # the run's search, as steps_att
    maps = []
    for path in steps_att.files:
        model = Transformer(translator.model.cfg)
        load_weights(model, path)
        att = sentence_attention(model.eval(), translator.tokenizers, SENTENCE, target)
        assert att.tgt_tokens == steps_att.tgt_tokens  # the same target at every step
        maps.append(att.maps["cross"][0])
    for got, want in zip(steps_att.maps, maps, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)
    # The steps differ (the attention learns), and the last is what `aiayn attention` draws.
    assert not np.allclose(steps_att.maps[0], steps_att.maps[-1], atol=1e-3)
    final = Translator.from_pretrained(run_dir, weights="last").attention(SENTENCE)
    np.testing.assert_allclose(steps_att.maps[-1], final.maps["cross"][0], atol=1e-6)


def test_the_strip_has_a_panel_per_step_in_order(steps_att):
    panels = attention_plots.drawn_panels(attention_plots.attention_steps_figure(steps_att))
    assert [title for title, _ in panels] == ["step 100", "step 200", "step 300", "step 400",
                                              "last weights"]
    for (_, drawn), maps in zip(panels, steps_att.maps, strict=True):
        np.testing.assert_allclose(drawn, maps.mean(axis=0), atol=1e-6)  # mean of the heads
    one_head = attention_plots.drawn_panels(attention_plots.attention_steps_figure(steps_att, head=2))
    np.testing.assert_allclose(one_head[1][1], steps_att.maps[1][2])


def test_a_given_target_is_the_rows_of_every_panel(run_dir):
    att = attention_over_steps(run_dir, SENTENCE, target="tree star", layer=1)
    assert att.tgt_tokens == ["[BOS]", "▁tree", "▁star"]
    assert all(m.shape[1:] == (3, len(att.src_tokens)) for m in att.maps)


def test_dev_bleu_of_the_step_is_in_its_title(run_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    (run / "metrics.jsonl").write_text(
        json.dumps({"kind": "dev", "step": 200, "bleu": 12.34, "dev_loss": 1.0}) + "\n")
    att = attention_over_steps(run, SENTENCE)
    assert att.bleu == [None, 12.34, None, None, None]
    titles = [t for t, _ in attention_plots.drawn_panels(attention_plots.attention_steps_figure(att))]
    assert titles[1] == "step 200\ndev BLEU 12.3"


def test_the_command_writes_the_strip_and_a_frame_per_step(run_dir, tmp_path, capsys):
    out = tmp_path / "steps"
    assert main(["attention", str(run_dir), SENTENCE, "--steps", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "steps: 100, 200, 300, 400, last" in printed
    with Image.open(out / "cross_steps.png") as png:
        assert png.format == "PNG" and png.size[0] > 800
    with Image.open(out / "cross_steps.gif") as gif:
        assert gif.format == "GIF" and gif.n_frames == 5


def _no_checkpoints(run_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    shutil.rmtree(run / "checkpoints")
    return run


@pytest.mark.parametrize("args, words", [
    (["--steps", "--layer", "2"], "--layer must be between 1 and 1 (the model's decoder "
                                  "layers), got 2"),
    (["--steps", "--head", "0"], "--head must be between 1 and 4"),
    (["--steps", "--target", " "], "the --target translation is empty"),
    (["--layer", "1"], "--layer goes with --steps"),
    (["--steps", "--sentence-empty"], "the sentence to translate is empty"),
    (["--steps", "--no-checkpoints"], "no step checkpoints (checkpoints/step_*.safetensors)"
                                      " to compare; a run keeps"),
])
def test_what_cannot_be_drawn_is_one_line(run_dir, tmp_path, capsys, args, words):
    run, sentence = run_dir, SENTENCE
    if "--no-checkpoints" in args:
        run, args = _no_checkpoints(run_dir, tmp_path), ["--steps"]
    if "--sentence-empty" in args:
        sentence, args = "  ", ["--steps"]
    assert main(["attention", str(run), sentence, *args, "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    line = error_line(err)
    assert words in line and "Traceback" not in err, err
    assert not (tmp_path / "o").exists()


def test_many_steps_are_rows_of_panels_in_reading_order(steps_att):
    import dataclasses

    eight = dataclasses.replace(steps_att, steps=list(range(100, 900, 100)),
                                maps=[steps_att.maps[i % 5] for i in range(8)],
                                bleu=[None] * 8)
    fig = attention_plots.attention_steps_figure(eight)
    panels = [ax for ax in fig.axes if ax.images]
    assert [(ax.get_subplotspec().rowspan.start, ax.get_subplotspec().colspan.start)
            for ax in panels] == [(r, c) for r in range(2) for c in range(4)]
    assert [t for t, _ in attention_plots.drawn_panels(fig)] == [f"step {s}" for s in range(100, 900, 100)]
