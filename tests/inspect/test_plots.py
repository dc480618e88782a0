"""Pictures: attention maps drawn the right way round, curves from metrics.jsonl, the
positional encoding, the schedule and the trace diagram, each a real PNG."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import prepare_splits, tiny_model
from PIL import Image

from aiayn.cli import main
from aiayn.config import load_config
from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from aiayn.errors import AiaynError
from aiayn.inference.attention import capture_attention, sentence_attention
from aiayn.inspect import attention_plots, plots
from aiayn.model import Transformer, sinusoid_table
from aiayn.runs.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"

# A toy language pair that translates word for word, in the same order: a trained model's
# cross-attention must then be diagonal (decoder input i, which predicts target word i,
# looks at source word i), a known answer for the orientation of a real model's maps.
LEXICON = {"red": "rojo", "blue": "azul", "cat": "gato", "dog": "perro", "sun": "sol",
           "sea": "mar", "big": "grande", "small": "chico", "house": "casa", "tree": "arbol",
           "eats": "come", "sees": "ve", "old": "viejo", "bird": "ave", "fish": "pez",
           "moon": "luna"}


def word_for_word_pairs(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    words = sorted(LEXICON)
    pairs = []
    for _ in range(n):
        src = [rng.choice(words) for _ in range(rng.randint(3, 8))]
        pairs.append((" ".join(src), " ".join(LEXICON[w] for w in src)))
    return pairs


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A run directory from `aiayn train` (configs/tiny.yaml, 300 steps, ~10 s) on data
    prepared by `aiayn prepare` (a word-level tokenizer)."""
    base = tmp_path_factory.mktemp("plots_run")
    splits = {"train": word_for_word_pairs(400, 1), "dev": word_for_word_pairs(12, 2),
              "test": word_for_word_pairs(12, 3)}
    data = prepare_splits(base / "data", splits)
    run = base / "run"
    settings = ["train.max_steps=300", "train.warmup_steps=50", "train.lr_scale=0.6",
                "train.eval_every=150", "train.save_every=300", "model.dropout=0.0"]
    argv = ["train", "--config", str(TINY), "--data", str(data), "--out", str(run)]
    for setting in settings:
        argv += ["--set", setting]
    assert main(argv) == 0
    return run


def assert_png(path: Path, min_size=(300, 200), max_size=(8000, 8000)) -> np.ndarray:
    """A real PNG of plausible dimensions that is not a blank canvas; returns its pixels."""
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    with Image.open(path) as img:
        width, height = img.size
        pixels = np.asarray(img.convert("RGB"))
    assert min_size[0] <= width <= max_size[0] and min_size[1] <= height <= max_size[1], (
        f"{path}: implausible size {width}x{height}")
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 10, f"{path} looks blank"
    return pixels


def tick_texts(labels) -> list[str]:
    return [t.get_text() for t in labels]


def render(fig) -> np.ndarray:
    """The figure's pixels as Agg draws them (rows top to bottom)."""
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def seen_rgb(pixels: np.ndarray, row_labels_ax, col_labels_ax, i: int, j: int) -> np.ndarray:
    """The colour a reader sees for (row label i, column label j): the pixel where the
    i-th y tick label's row meets the j-th x tick label's column. Labels are read from
    the outer panels (``row_labels_ax`` in the same row, ``col_labels_ax`` in the same
    column), as the reader does."""
    ylab = row_labels_ax.get_yticklabels()[i].get_window_extent()
    xlab = col_labels_ax.get_xticklabels()[j].get_window_extent()
    y, x = (ylab.y0 + ylab.y1) / 2, (xlab.x0 + xlab.x1) / 2  # display: origin bottom-left
    return pixels[pixels.shape[0] - 1 - int(round(y)), int(round(x))]


def colormap_rgb(ax, value: float) -> np.ndarray:
    image = ax.images[0]
    return np.round(np.asarray(image.cmap(image.norm(value))[:3]) * 255)


# ---------------------------------------------------------------- orientation

def one_hot_maps(n_layers, n_heads, n_q, n_k):
    """Attention whose every query puts all its weight on key (layer + 2*head) % n_k."""
    maps, expected_key = [], {}
    for l in range(n_layers):
        layer = np.zeros((n_heads, n_q, n_k), dtype=np.float32)
        for h in range(n_heads):
            j = (l + 2 * h) % n_k
            layer[h, :, j] = 1.0
            expected_key[l, h] = j
        maps.append(layer)
    return maps, expected_key


def test_weight_forced_onto_one_key_is_drawn_in_that_column():
    queries = ["[BOS]", "el", "perro", "come"]
    keys = ["the", "dog", "eats", "meat", "[EOS]"]
    maps, expected_key = one_hot_maps(2, 3, len(queries), len(keys))
    fig = attention_plots.attention_figure(maps, queries, keys, title="cross")

    drawn = attention_plots.drawn_matrices(fig)
    assert drawn.shape == (2, 3, len(queries), len(keys))  # layers, heads, rows=queries, cols=keys
    panels = [ax for ax in fig.axes if ax.images]
    pixels = render(fig)
    for (l, h), j in expected_key.items():
        ax = panels[l * 3 + h]
        assert ax.images[0].origin == "upper"  # row 0 (the first query) at the top
        np.testing.assert_array_equal(drawn[l, h][:, j], 1.0)
        assert drawn[l, h].sum() == len(queries)  # nothing outside column j
        # the labels say which token each row/column is (shown on the outer panels)
        assert list(ax.get_xticks()) == list(range(len(keys)))
        assert list(ax.get_yticks()) == list(range(len(queries)))
        if l == 1:
            assert tick_texts(ax.get_xticklabels()) == keys
        if h == 0:
            assert tick_texts(ax.get_yticklabels()) == queries
        # and what is seen agrees: the bright cells are under key label j, in every row
        for i in range(len(queries)):
            for k in range(len(keys)):
                seen = seen_rgb(pixels, panels[l * 3], panels[3 + h], i, k)
                np.testing.assert_allclose(seen, colormap_rgb(ax, float(k == j)), atol=2)
    assert tick_texts(panels[0].get_xticklabels()) == []  # inner panels: no tick labels
    assert tick_texts(panels[4].get_yticklabels()) == []


def test_attention_figure_refuses_labels_that_do_not_fit():
    maps, _ = one_hot_maps(1, 2, 3, 4)
    with pytest.raises(ValueError, match="queries=4, keys=3"):
        attention_plots.attention_figure(maps, ["a"] * 4, ["b"] * 3)  # rows and columns swapped


def small_model(seed: int = 0) -> Transformer:
    """2 layers of 2 heads each side, no dropout, in eval mode: small pictures to check."""
    return tiny_model(seed, src_vocab_size=40, tgt_vocab_size=40, d_model=16, n_heads=2,
                      d_ff=32, max_len=32, dropout=0.0).eval()


def test_model_maps_causal_decoder_self_attention_is_lower_triangular_in_the_picture():
    model = small_model()
    src = torch.tensor([[5, 6, 7, 8, 9, EOS_ID]])
    tgt = torch.tensor([[BOS_ID, 11, 12, 13]])
    with capture_attention(model) as maps:
        model(src, tgt)
    tokens = ["[BOS]", "y1", "y2", "y3"]
    fig = attention_plots.attention_figure([m[0] for m in maps["decoder_self"]], tokens, tokens)
    drawn = attention_plots.drawn_matrices(fig)
    assert drawn.shape == (2, 2, 4, 4)
    for mat in drawn.reshape(-1, 4, 4):
        np.testing.assert_array_equal(np.triu(mat, k=1), 0.0)  # no query sees a later key
        assert (np.diag(mat) > 0).all()
        np.testing.assert_allclose(mat.sum(axis=1), 1.0, atol=1e-6)  # rows are queries
    assert drawn[0, 0, 0, 0] == pytest.approx(1.0)  # [BOS] can only look at itself
    panels = [ax for ax in fig.axes if ax.images]
    assert tick_texts(panels[0].get_yticklabels()) == tokens
    assert tick_texts(panels[2].get_xticklabels()) == tokens
    assert panels[0].images[0].origin == "upper"  # [BOS]'s row at the top
    pixels = render(fig)
    for l in range(2):
        for h in range(2):
            ax, rows_ax, cols_ax = panels[2 * l + h], panels[2 * l], panels[2 + h]
            for i in range(4):
                for j in range(4):
                    np.testing.assert_allclose(seen_rgb(pixels, rows_ax, cols_ax, i, j),
                                               colormap_rgb(ax, drawn[l, h, i, j]), atol=3)


def test_model_maps_padding_forces_encoder_and_cross_attention_onto_the_one_real_key():
    # One real source token and three pads: every query of the encoder and of the
    # cross-attention must put all its weight on key 0, i.e. in column 0.
    model = small_model()
    src = torch.tensor([[EOS_ID, PAD_ID, PAD_ID, PAD_ID]])
    tgt = torch.tensor([[BOS_ID, 11, 12, 13, 14, 15]])  # 6 queries vs 4 keys: not square
    with capture_attention(model) as maps:
        model(src, tgt)
    src_tokens, tgt_tokens = ["[EOS]", "[PAD]", "[PAD]", "[PAD]"], ["[BOS]", *"abcde"]
    for kind, queries in (("encoder", src_tokens), ("cross", tgt_tokens)):
        fig = attention_plots.attention_figure([m[0] for m in maps[kind]], queries, src_tokens)
        drawn = attention_plots.drawn_matrices(fig)
        assert drawn.shape == (2, 2, len(queries), 4)
        np.testing.assert_allclose(drawn[..., 0], 1.0, atol=1e-6)
        np.testing.assert_array_equal(drawn[..., 1:], 0.0)


class WordTokenizers:
    """A stand-in with the Tokenizers interface (docs/interfaces.md): one id per word."""

    def __init__(self, words):
        self.vocab = ["[PAD]", "[UNK]", "[BOS]", "[EOS]", *words]

    def _ids(self, text):
        return [self.vocab.index(w) if w in self.vocab else 1 for w in text.split()]

    def encode_src(self, texts):
        return [self._ids(t) + [EOS_ID] for t in texts]

    def encode_tgt(self, texts):
        return [[BOS_ID, *self._ids(t), EOS_ID] for t in texts]

    def src_tokens(self, text):
        return [*text.split(), "[EOS]"]

    def tgt_id_to_token(self, i):
        return self.vocab[i]

    def decode_tgt(self, ids):
        return [" ".join(self.vocab[i] for i in seq if i > EOS_ID) for seq in ids]


def test_sentence_attention_labels_and_shapes(tmp_path):
    tok = WordTokenizers(["the", "dog", "eats", "el", "perro", "come"])
    hypothesis = tok.encode_tgt(["el perro come"])[0][1:-1]
    att = sentence_attention(small_model(), tok, "the dog eats", hypothesis)
    assert att.translation == "el perro come"
    assert att.src_tokens == ["the", "dog", "eats", "[EOS]"]
    assert att.tgt_tokens == ["[BOS]", "el", "perro", "come"]
    assert [m.shape for m in att.maps["encoder"]] == [(2, 4, 4)] * 2
    assert [m.shape for m in att.maps["decoder_self"]] == [(2, 4, 4)] * 2
    assert [m.shape for m in att.maps["cross"]] == [(2, 4, 4)] * 2
    figures = attention_plots.attention_figures(att)
    cross = [ax for ax in figures["cross"].axes if ax.images]
    assert tick_texts(cross[0].get_yticklabels()) == att.tgt_tokens  # rows: decoder inputs
    assert tick_texts(cross[-1].get_xticklabels()) == att.src_tokens  # columns: source
    paths = attention_plots.save_attention_figures(att, tmp_path / "att")
    assert sorted(p.name for p in paths) == ["cross.png", "decoder_self.png", "encoder_self.png"]
    for p in paths:
        assert_png(p)


def test_attention_command_writes_three_pictures_of_a_trained_run(trained_run, tmp_path,
                                                                   capsys):
    out = tmp_path / "maps"
    assert main(["attention", str(trained_run), "red dog eats old fish", "-o", str(out),
                 "--beam", "2"]) == 0
    printed = capsys.readouterr().out
    assert "translation: rojo perro come viejo pez" in printed
    for name in ("encoder_self.png", "decoder_self.png", "cross.png"):
        assert_png(out / name, min_size=(500, 400))
        assert str(out / name) in printed


def test_trained_word_for_word_model_has_diagonal_cross_attention(trained_run):
    from aiayn.inference.translator import Translator

    translator = Translator.from_pretrained(trained_run)
    sentence = "red dog eats old fish"
    sources, _ = translator.encode([sentence])
    hypothesis = translator.decode_ids(sources, translator.resolve(beam=1))[0][0][0]
    att = sentence_attention(translator.model, translator.tokenizers, sentence,
                                   hypothesis)
    assert att.translation == "rojo perro come viejo pez"
    assert att.src_tokens == ["▁red", "▁dog", "▁eats", "▁old", "▁fish", "[EOS]"]
    assert att.tgt_tokens == ["[BOS]", "▁rojo", "▁perro", "▁come", "▁viejo", "▁pez"]
    drawn = attention_plots.drawn_matrices(attention_plots.attention_figures(att)["cross"])
    last_layer = drawn[-1].mean(axis=0)  # (queries, keys), averaged over heads
    # Decoder input i ([BOS], rojo, ...) predicts target word i, the translation of
    # source word i: it looks at column i.
    assert list(last_layer[:5].argmax(axis=1)) == [0, 1, 2, 3, 4]


def test_plot_command_draws_a_real_metrics_file(trained_run, tmp_path):
    records = read_metrics(trained_run)
    assert {r["kind"] for r in records} == {"train", "dev"}
    fig = plots.curves_figure({"run": records})
    bleu = next(ax for ax in fig.axes if ax.get_title() == "dev BLEU")
    assert list(bleu.get_lines()[0].get_xdata()) == [150, 300]
    out = tmp_path / "curves.png"
    assert main(["plot", str(trained_run), "-o", str(out)]) == 0
    assert_png(out, min_size=(800, 600))


# ---------------------------------------------------------------- training curves

def write_metrics(run_dir: Path, scale: float, steps=(5, 10, 15, 20)) -> list[dict]:
    run_dir.mkdir(parents=True)
    records = []
    for s in steps:
        records.append({"kind": "train", "step": s, "epoch": 0, "loss": scale * 10 / s,
                        "lr": 1e-3 * min(s / 10, (10 / s) ** 0.5), "tokens_per_s": 1000.0,
                        "elapsed_s": float(s)})
        if s % 10 == 0:
            records.append({"kind": "dev", "step": s, "dev_loss": scale * 8 / s,
                            "bleu": s / scale, "chrf": 2 * s, "bleu_signature": "sig",
                            "elapsed_s": float(s), "samples": [{"src": "a", "ref": "b"}]})
    text = "".join(json.dumps(r) + "\n" for r in records)
    (run_dir / "metrics.jsonl").write_text(text, encoding="utf-8")
    return records


def test_curves_figure_draws_each_metric_of_each_run(tmp_path):
    runs = {"a": write_metrics(tmp_path / "a", 1.0), "b": write_metrics(tmp_path / "b", 2.0)}
    fig = plots.curves_figure(runs)
    titles = {ax.get_title(): ax for ax in fig.axes}
    assert set(titles) == {"training loss", "dev loss", "dev BLEU", "learning rate"}
    for title, kind, key, _ in plots.CURVES:
        lines = titles[title].get_lines()
        assert [line.get_label() for line in lines] == ["a", "b"]
        for line, records in zip(lines, runs.values(), strict=True):
            wanted = [(r["step"], r[key]) for r in records if r["kind"] == kind]
            assert list(zip(line.get_xdata(), line.get_ydata(), strict=True)) == wanted
    legend_texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend_texts == ["a", "b"]


def test_the_training_loss_is_labelled_label_smoothed_only_where_the_run_smoothed(
        tmp_path, capsys):
    """The demo trains its ~2 passes of 12 minutes without label smoothing: its loss is a
    plain cross-entropy; the label follows each run's config.yaml (as the trainer wrote its
    "auto" choice there), and says nothing of smoothing where the choice is not written."""
    from aiayn.config import save_config
    from aiayn.training.plan import choose_regularisation

    two_passes = choose_regularisation(load_config("demo"), 2.0)[0]
    for name, config in (("demo", two_passes), ("b60", load_config("bible-60")),
                         ("unchosen", load_config("demo"))):
        write_metrics(tmp_path / name, 1.0)
        save_config(config, tmp_path / name / "config.yaml")

    def label(*names: str) -> str:
        fig = plots.curves_figure({n: read_metrics(tmp_path / n) for n in names},
                                  [load_config(tmp_path / n / "config.yaml").train.label_smoothing
                                   for n in names])
        return next(ax for ax in fig.axes if ax.get_title() == "training loss").get_ylabel()

    assert label("demo") == "cross-entropy"
    assert label("b60") == "label-smoothed cross-entropy (eps 0.1)"
    assert label("demo", "b60") == "cross-entropy, label-smoothed in some runs"
    assert "label-smoothed cross-entropy" not in plots.loss_label([None])
    assert main(["plot", str(tmp_path / "demo"), "-o", str(tmp_path / "c.png")]) == 0
    # "auto", not chosen yet (a run stopped in its first half-minute): drawn all the same
    assert main(["plot", str(tmp_path / "unchosen"), "-o", str(tmp_path / "u.png")]) == 0
    capsys.readouterr()


def test_metric_series_keeps_the_last_record_of_a_repeated_step():
    records = [{"kind": "train", "step": 1, "loss": 5.0}, {"kind": "train", "step": 2, "loss": 4.0},
               {"kind": "train", "step": 2, "loss": 3.5}, {"kind": "dev", "step": 2, "bleu": 1.0}]
    assert plots.metric_series(records, "train", "loss") == ([1, 2], [5.0, 3.5])


def test_plot_command_overlays_runs(tmp_path, capsys):
    write_metrics(tmp_path / "run1", 1.0)
    write_metrics(tmp_path / "run2", 1.5)
    out = tmp_path / "curves.png"
    assert main(["plot", str(tmp_path / "run1"), str(tmp_path / "run2"), "-o", str(out)]) == 0
    assert_png(out, min_size=(800, 600))
    assert str(out) in capsys.readouterr().out


@pytest.mark.parametrize(("content", "message"), [
    (None, "metrics.jsonl: not found"),
    ('{"kind": "train", "step": 1, "lo\n{"kind": "train", "step": 2, "loss": 2.0}\n',
     "metrics.jsonl, line 1: not valid JSON"),
    ('{"kind": "train", "step": 1}\n\n[1, 2]\n', "metrics.jsonl, line 3: expected a JSON object"),
    ('{"kind": "dev", "bleu": 3.0}\n', 'metrics.jsonl, line 1: the record has no "step"'),
    ('{"kind": "train", "step": 1, "loss": "nan?"}\n', 'line 1: "loss" is not a number'),
])
def test_plot_command_names_the_file_and_line_of_bad_metrics(tmp_path, capsys, content, message):
    run = tmp_path / "run"
    run.mkdir()
    if content is not None:
        (run / "metrics.jsonl").write_text(content, encoding="utf-8")
    assert main(["plot", str(run), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("aiayn: error: ") and err.count("\n") == 1
    assert message in err and str(run) in err
    assert not (tmp_path / "x.png").exists()


TORN = '{"kind": "train", "step": 10, "loss": 2.0}\n{"kind": "dev", "step": 10, "bleu": 7.5}\n' \
       '{"kind": "train", "step": 20, "lo'  # the writer stopped mid-line


def test_a_torn_last_metrics_line_is_left_out_with_a_note_by_every_reader(run_dir, tmp_path,
                                                                          capsys):
    """plot, info (and so serve's /info) and a resume read a run whose last line is cut
    short as the run without it, and plot and info say so in one line."""
    from aiayn.inspect.info import run_info
    from aiayn.runs.metrics import MetricsLog

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    (run / "metrics.jsonl").write_text(TORN, encoding="utf-8")
    assert main(["plot", str(run), "-o", str(tmp_path / "c.png")]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("aiayn: warning: ")
    assert f"{run / 'metrics.jsonl'}, line 3: left out, cut short" in err
    assert main(["info", str(run), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["last_dev"]["step"] == 10 and "line 3: left out" in err
    with pytest.warns(UserWarning, match="line 3: left out"):
        assert [r["step"] for r in read_metrics(run)] == [10, 10]
    with pytest.warns(UserWarning, match="line 3: left out"):
        MetricsLog(run, enabled=True, resume_step=10).close()
    assert (run / "metrics.jsonl").read_text(encoding="utf-8") == TORN.rsplit("\n", 1)[0] + "\n"
    assert run_info(run)["last_dev"]["step"] == 10


def test_a_damaged_metrics_line_before_the_last_is_an_error_for_every_reader(run_dir, tmp_path,
                                                                              capsys):
    from aiayn.inspect.info import run_info
    from aiayn.runs.metrics import MetricsLog

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    damaged = TORN.replace('"step": 10, "bleu"', '"step": 10, "bl') + '"}\n'
    (run / "metrics.jsonl").write_text(damaged, encoding="utf-8")
    where = f"{run / 'metrics.jsonl'}, line 2: not valid JSON"
    for argv in (["plot", str(run), "-o", str(tmp_path / "c.png")], ["info", str(run)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("aiayn: error: ") and err.count("\n") == 1 and where in err
    for read in (lambda: run_info(run), lambda: MetricsLog(run, enabled=True, resume_step=10)):
        with pytest.raises(AiaynError, match="line 2: not valid JSON"):
            read()
    assert (run / "metrics.jsonl").read_text(encoding="utf-8") == damaged  # nothing rewritten
    assert not (tmp_path / "c.png").exists()


def test_plot_command_needs_exactly_one_thing_to_draw(tmp_path, capsys):
    assert main(["plot"]) == 2
    assert main(["plot", "--pe", "--schedule", str(TINY)]) == 2
    assert "exactly one" in capsys.readouterr().err


# ---------------------------------------------------------------- PE, schedule, trace

def test_plot_pe_draws_the_sinusoid_table(tmp_path):
    fig = plots.positional_encoding_figure(positions=50, d_model=64)
    heat = next(ax for ax in fig.axes if ax.images)
    np.testing.assert_allclose(heat.images[0].get_array(), sinusoid_table(50, 64).numpy())
    out = tmp_path / "pe.png"
    assert main(["plot", "--pe", "--positions", "50", "--d-model", "64", "-o", str(out)]) == 0
    assert_png(out, min_size=(800, 300))


def test_plot_schedule_peaks_at_the_end_of_warmup(tmp_path):
    config = load_config(TINY)
    fig = plots.schedule_figure(config)
    line = fig.axes[0].get_lines()[0]
    steps, lrs = line.get_xdata(), line.get_ydata()
    warmup, d = config.train.warmup_steps, config.model.d_model
    assert steps[np.argmax(lrs)] == warmup
    assert max(lrs) == pytest.approx(config.train.lr_scale * (d * warmup) ** -0.5)
    last = steps[-1]
    assert last == config.train.max_steps
    assert lrs[-1] == pytest.approx(config.train.lr_scale * d**-0.5 * last**-0.5)  # eq. 3
    out = tmp_path / "schedule.png"
    assert main(["plot", "--schedule", str(TINY), "--set", "train.max_steps=500",
                 "-o", str(out)]) == 0
    assert_png(out, min_size=(600, 300))


def test_trace_png(tmp_path, capsys):
    out = tmp_path / "trace.png"
    assert main(["trace", "--config", str(TINY), "--png", str(out)]) == 0
    assert "Transformer" in capsys.readouterr().out  # the text trace is still printed
    assert_png(out, min_size=(800, 600))


def test_trace_figure_boxes_follow_the_model():
    from aiayn.inspect.trace import trace_forward

    model = small_model()
    rows = trace_forward(model, torch.randint(4, 40, (2, 7)), torch.randint(4, 40, (2, 5)))
    enc, dec = plots._trace_columns(rows)
    assert [b.title for b in enc] == [
        "Embedding × √d_model", "+ Positional encoding",
        "Self-attention + Add & Norm", "Feed-forward + Add & Norm",
        "Self-attention + Add & Norm", "Feed-forward + Add & Norm", "memory = encoder output"]
    assert [b.layer for b in enc] == [None, None, 0, 0, 1, 1, None]
    assert sum(b.is_cross for b in dec) == 2
    assert dec[-1].shape == "2×5×40"  # logits over the target vocabulary


def test_comparison_figure_draws_each_runs_finite_values_and_names_where_one_diverged():
    runs = {"intact": [{"step": s, "loss": 3.0 - s / 10} for s in range(1, 6)]
            + [{"step": 5, "exact": 0.8}],
            "broken": [{"step": 1, "loss": 3.0}, {"step": 2, "loss": float("nan")}]}
    fig = plots.comparison_figure(runs, [("loss", "training loss"), ("exact", "exact")],
                                  log_scale=["loss"])
    loss_ax, exact_ax = fig.axes
    assert loss_ax.get_yscale() == "log" and exact_ax.get_yscale() == "linear"
    lines = {line.get_label(): line for line in loss_ax.get_lines()}
    assert list(lines["intact"].get_ydata()) == [3.0 - s / 10 for s in range(1, 6)]
    assert list(lines["broken"].get_xdata()) == [1]  # the nan is left out of the line
    assert [line.get_label() for line in exact_ax.get_lines()] == ["intact"]
    # one colour per run in every panel, and the legend says where a run stopped being finite
    assert exact_ax.get_lines()[0].get_color() == lines["intact"].get_color()
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["intact", "broken (not finite at step 2)"]
