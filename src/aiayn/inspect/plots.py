"""Pictures of the model and its training, as PNG files drawn by matplotlib's Agg backend.

Every picture is made by a pure function that takes plain data (attention matrices and
token strings, metrics records, a config, trace rows) and returns a matplotlib ``Figure``;
``save_figure`` writes it. Figures are built with ``matplotlib.figure.Figure`` directly,
never through ``pyplot``, so no display is needed and no global figure state leaks
between calls (a figure is freed as soon as it is no longer referenced).

    attention_figure     layers x heads grid of attention maps (paper, 3.2), rows = queries
    attention_steps_figure   one sentence's cross-attention at each saved step of a run
    curves_figure        training loss, dev loss, dev BLEU, learning rate against steps
    comparison_figure    chosen metrics of several runs against steps (an ablation)
    positional_encoding_figure   the sinusoid table of section 3.5
    schedule_figure      the learning-rate schedule of section 5.3, eq. 3
    trace_figure         the shapes of a forward pass through the layers (``aiayn trace``)

Reading an attention map: row i is query position i, column j is key position j, and the
value is how much of query i's output comes from key j's value (each row sums to 1).
Encoder self-attention: queries and keys are source tokens. Decoder self-attention:
both are the decoder's input tokens ([BOS] + hypothesis), and a row only sees the columns
left of and on the diagonal (the causal mask). Cross-attention: queries are the decoder's
input tokens, keys are source tokens.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import PowerNorm
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle
from matplotlib.ticker import StrMethodFormatter

from aiayn.errors import AiaynError
from aiayn.model import sinusoid_table
from aiayn.training.optim import schedule_lr
from aiayn.util.io import atomic_path

if TYPE_CHECKING:  # plots take arrays; this only names their containers
    from aiayn.inference.attention import SentenceAttention
    from aiayn.inspect.attention_steps import StepAttention

DPI = 110


def new_figure(**kwargs) -> Figure:
    """A figure drawn by Agg (headless), whatever matplotlib's default backend is."""
    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` as a PNG (creating the parent directory); returns the path."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise AiaynError(f"{path}: pictures are written as PNG; name the file *.png")
    with atomic_path(path, what="the picture") as tmp:  # no half PNG on a full disk
        fig.savefig(tmp, dpi=DPI, format="png")
    return path


# ---------------------------------------------------------------- attention maps

# Titles and axis names per kind, from capture_attention's keys.
ATTENTION_KINDS = {
    "encoder": ("Encoder self-attention", "query: source token", "key: source token"),
    "decoder_self": ("Decoder self-attention (masked)", "query: decoder input token",
                     "key: decoder input token"),
    "cross": ("Encoder-decoder (cross) attention", "query: decoder input token",
              "key: source token"),
}


def attention_figure(
    layers: Sequence[Any],
    query_tokens: Sequence[str],
    key_tokens: Sequence[str],
    title: str = "attention",
    query_name: str = "query",
    key_name: str = "key",
) -> Figure:
    """A grid of heatmaps, one row of panels per layer and one column per head.

    ``layers[l]`` is an (H, T_q, T_k) array (tensor or numpy) of attention weights for
    one sentence. In every panel row i is query ``query_tokens[i]`` (top to bottom) and
    column j is key ``key_tokens[j]`` (left to right): the array is drawn as it is, with
    ``origin="upper"``, so what ``panel.images[0].get_array()`` returns is what is shown.
    """
    mats = [_as_numpy(m) for m in layers]
    if not mats:
        raise ValueError("attention_figure needs at least one layer")
    n_q, n_k = len(query_tokens), len(key_tokens)
    n_heads = mats[0].shape[0]
    for i, m in enumerate(mats):
        if m.ndim != 3 or m.shape != (n_heads, n_q, n_k):
            raise ValueError(
                f"layer {i}: expected attention of shape (heads={n_heads}, queries={n_q}, "
                f"keys={n_k}), got {m.shape}"
            )
    n_layers = len(mats)
    # Size the figure so that every token keeps a readable label and cells stay about
    # square; the panels then fill the figure (aspect "auto") without stray gaps.
    cell = 0.2  # inches per token
    panel_w, panel_h = max(1.2, cell * n_k), max(1.2, cell * n_q)
    ytick_w = 0.075 * max(len(t) for t in query_tokens) + 0.7  # y tick labels + layer name
    xtick_h = 0.075 * max(len(t) for t in key_tokens) + 0.45  # x tick labels + axis name
    width = ytick_w + n_heads * (panel_w + 0.1) + 1.1  # + colour bar
    height = 1.0 + n_layers * (panel_h + 0.3) + xtick_h  # + the two-line title, head names
    fig = new_figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(n_layers, n_heads, squeeze=False, sharex=True, sharey=True)
    # A square-root colour scale: weak but real attention stays visible next to peaks,
    # and one scale (0..1) for every panel keeps panels comparable.
    norm = PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0)
    image = None
    for l, mat in enumerate(mats):
        for h in range(n_heads):
            ax = axes[l, h]
            image = ax.imshow(mat[h], cmap="viridis", norm=norm, origin="upper",
                              interpolation="nearest", aspect="auto")
            ax.set_xticks(range(n_k), labels=list(key_tokens), rotation=90, fontsize=7)
            ax.set_yticks(range(n_q), labels=list(query_tokens), fontsize=7)
            ax.tick_params(length=2, pad=1)
            if l == 0:
                ax.set_title(f"head {h + 1}", fontsize=9)
            if h == 0:
                ax.set_ylabel(f"layer {l + 1}\n{query_name}", fontsize=8)
            if l == n_layers - 1:
                ax.set_xlabel(key_name, fontsize=8)
            ax.label_outer()  # tick labels on the left column and bottom row only
    # A colour bar of about 4 inches, however tall the grid of panels is.
    grid_h = n_layers * (panel_h + 0.3)
    fig.colorbar(image, ax=axes, shrink=min(0.8, 4.0 / grid_h), aspect=25,
                 label="attention weight")
    # Wrap long titles (a long translation) to the figure's width: ~12 characters an inch.
    chars = max(40, int(width * 12))
    lines = [textwrap.shorten(line, 3 * chars, placeholder=" …") for line in title.split("\n")]
    wrapped = "\n".join(textwrap.fill(line, chars) for line in lines)
    fig.suptitle(f"{wrapped}\nrows: queries, columns: keys; each row sums to 1", fontsize=10)
    return fig


def drawn_matrices(fig: Figure) -> np.ndarray:
    """The matrices an attention figure shows, as (layers, heads, T_q, T_k), read back
    from its images (for tests and for checking a picture against the model)."""
    panels = [ax for ax in fig.axes if ax.images]
    n_heads = max(ax.get_subplotspec().colspan.stop for ax in panels)
    grid = [np.asarray(ax.images[0].get_array()) for ax in panels]
    return np.stack(grid).reshape(len(grid) // n_heads, n_heads, *grid[0].shape)


def _as_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float32)


def attention_figures(att: SentenceAttention) -> dict[str, Figure]:
    """The three figures for one sentence, keyed by kind (encoder, decoder_self, cross)."""
    labels = {
        "encoder": (att.src_tokens, att.src_tokens),
        "decoder_self": (att.tgt_tokens, att.tgt_tokens),
        "cross": (att.tgt_tokens, att.src_tokens),
    }
    figures = {}
    for kind, (title, query_name, key_name) in ATTENTION_KINDS.items():
        queries, keys = labels[kind]
        figures[kind] = attention_figure(
            att.maps[kind], queries, keys,
            title=f"{title}\n{att.source!r} -> {att.translation!r}",
            query_name=query_name, key_name=key_name,
        )
    return figures


def save_attention_figures(att: SentenceAttention, out_dir: str | Path) -> list[Path]:
    """Write ``encoder_self.png``, ``decoder_self.png`` and ``cross.png`` into ``out_dir``."""
    names = {"encoder": "encoder_self.png", "decoder_self": "decoder_self.png",
             "cross": "cross.png"}
    out_dir = Path(out_dir)
    return [save_figure(fig, out_dir / names[kind])
            for kind, fig in attention_figures(att).items()]


# ---------------------------------------------------------------- attention over training
def step_label(step: int | None, bleu: float | None = None) -> str:
    """A panel's title: its step, and the dev BLEU logged there."""
    label = "last weights" if step is None else f"step {step:,}"
    return label + (f"\ndev BLEU {bleu:.1f}" if bleu is not None else "")


def attention_steps_figure(att: StepAttention, head: int | None = None,
                           columns: int = 6, only: int | None = None) -> Figure:
    """One panel per saved step of ``att`` (in its order, left to right, then the next
    row; at most ``columns`` to a row), each the cross-attention of one decoder layer: the
    mean of its heads, or ``head`` (from 0). Every panel has the same rows (the one target)
    and columns, and one colour scale. ``only``: draw that checkpoint alone (a GIF frame)."""
    picked = range(len(att.maps)) if only is None else [only]
    mats = [att.maps[i].mean(axis=0) if head is None else att.maps[i][head] for i in picked]
    n_q, n_k = len(att.tgt_tokens), len(att.src_tokens)
    n_rows = -(-len(mats) // columns)
    n_cols = -(-len(mats) // n_rows)  # rows as even as they go: 8 panels are 2 rows of 4
    cell = 0.17
    panel_w, panel_h = max(1.4, cell * n_k), max(1.4, cell * n_q)
    ytick_w = 0.075 * max(len(t) for t in att.tgt_tokens) + 0.5
    xtick_h = 0.075 * max(len(t) for t in att.src_tokens) + 0.3
    width = ytick_w + n_cols * (panel_w + 0.15) + 1.0
    height = 1.2 + n_rows * (panel_h + xtick_h + 0.55)
    fig = new_figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(n_rows, n_cols, squeeze=False)
    norm = PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0)  # as attention_figure: comparable panels
    image = None
    for i, ax in enumerate(axes.ravel()):
        if i >= len(mats):
            ax.set_axis_off()
            continue
        k = picked[i]
        image = ax.imshow(mats[i], cmap="viridis", norm=norm, origin="upper",
                          interpolation="nearest", aspect="auto")
        ax.set_title(step_label(att.steps[k], att.bleu[k]), fontsize=9)
        ax.set_xticks(range(n_k), labels=att.src_tokens, rotation=90, fontsize=6.5)
        ax.set_yticks(range(n_q), labels=att.tgt_tokens if i % n_cols == 0 else [],
                      fontsize=6.5)
        ax.tick_params(length=2, pad=1)
    fig.colorbar(image, ax=axes, shrink=min(0.8, 3.5 / (n_rows * panel_h)), aspect=25,
                 label="attention weight")
    heads = (f"mean of its {att.maps[0].shape[0]} heads" if head is None
             else f"head {head + 1} of {att.maps[0].shape[0]}")
    chars = max(40, int(width * 12))
    pair = textwrap.shorten(f"{att.source!r} -> {att.translation!r}", 2 * chars,
                            placeholder=" …")
    fig.suptitle(f"Cross-attention of decoder layer {att.layer + 1} of {att.n_layers} "
                 f"({heads}) at each saved step\n{textwrap.fill(pair, chars)}\n"
                 "rows: decoder inputs ([BOS] + the same target at every step), columns: "
                 "source tokens", fontsize=9.5)
    return fig


def save_attention_steps(att: StepAttention, out_dir: str | Path, head: int | None = None
                         ) -> list[Path]:
    """Write ``cross_steps.png`` (every step in one figure) and ``cross_steps.gif`` (a
    frame per step) into ``out_dir``."""
    from PIL import Image

    out_dir = Path(out_dir)
    paths = [save_figure(attention_steps_figure(att, head), out_dir / "cross_steps.png")]
    frames = []
    for i in range(len(att.maps)):
        fig = attention_steps_figure(att, head, only=i)
        fig.canvas.draw()
        frames.append(Image.fromarray(np.asarray(fig.canvas.buffer_rgba())).convert("RGB"))
    gif = out_dir / "cross_steps.gif"
    with atomic_path(gif, what="the picture") as tmp:
        # A longer look at the last frame, the finished alignment, before the loop restarts.
        durations = [700] * (len(frames) - 1) + [2000]
        frames[0].save(tmp, format="GIF", save_all=True, append_images=frames[1:],
                       duration=durations, loop=0)
    return [*paths, gif]


def drawn_panels(fig: Figure) -> list[tuple[str, np.ndarray]]:
    """(title, matrix) of each panel of an attention_steps_figure, in reading order."""
    return [(ax.get_title(), np.asarray(ax.images[0].get_array())) for ax in fig.axes
            if ax.images]


# ---------------------------------------------------------------- training curves

# (panel title, record kind, field, y label)
CURVES = [
    ("training loss", "train", "loss", "label-smoothed cross-entropy"),
    ("dev loss", "dev", "dev_loss", "cross-entropy"),
    ("dev BLEU", "dev", "bleu", "BLEU"),
    ("learning rate", "train", "lr", "lr"),
]


def metric_series(records: list[dict[str, Any]], kind: str, key: str) -> tuple[list, list]:
    """(steps, values) of ``key`` in records of ``kind``, by step. When a step appears
    more than once (a resumed run logs again the steps after its last checkpoint), the
    later record wins."""
    by_step = {}
    for record in records:
        if record["kind"] == kind and record.get(key) is not None:
            by_step[record["step"]] = record[key]
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def run_labels(run_dirs: Sequence[str | Path]) -> list[str]:
    """Short legend names: the directory's name, or its path where names collide."""
    names = [Path(run_dir).resolve().name for run_dir in run_dirs]
    return [name if names.count(name) == 1 else str(run_dir)
            for name, run_dir in zip(names, run_dirs, strict=True)]


def curves_figure(runs: dict[str, list[dict[str, Any]]]) -> Figure:
    """Four panels against optimizer steps, one colour per run, one legend for all."""
    fig = new_figure(figsize=(11, 7.5), layout="constrained")
    # One step axis for all four panels, so that dev scores line up with the training.
    axes = fig.subplots(2, 2, sharex=True).ravel()
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for ax, (title, kind, key, ylabel) in zip(axes, CURVES, strict=True):
        drawn = False
        for (label, records), color in zip(runs.items(), colors, strict=True):
            steps, values = metric_series(records, kind, key)
            if not steps:
                continue
            # Dev scores are few and far between: mark each one.
            marker = "o" if kind == "dev" else None
            ax.plot(steps, values, color=color, label=label, marker=marker, markersize=3,
                    linewidth=1.3)
            drawn = True
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        if not drawn:
            ax.text(0.5, 0.5, f'no "{key}" records yet', transform=ax.transAxes,
                    ha="center", va="center", color="0.5")
            ax.set_yticks([])
        ax.set_title(title)
        if ax in axes[2:]:
            ax.set_xlabel("step (optimizer updates)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    handles = [Line2D([], [], color=c, linewidth=2, label=label)
               for label, c in zip(runs, colors, strict=True)]
    fig.legend(handles=handles, loc="outside upper center", ncols=min(len(runs), 4),
               title="run")
    return fig


# ---------------------------------------------------------------- positional encoding

def comparison_figure(runs: dict[str, list[dict[str, Any]]],
                      panels: Sequence[tuple[str, str]], title: str = "",
                      log_scale: Sequence[str] = ()) -> Figure:
    """One panel per ``(key, label)`` of ``panels``: the records of each run that hold
    ``key``, against their "step", one colour per run (the same in every panel). Keys in
    ``log_scale`` get a logarithmic y axis. Values that are not finite (a run that
    diverged) are left out of the line and the run's label says where it stopped."""
    fig = new_figure(figsize=(4.2 * len(panels) + 0.6, 3.6), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    colors = {label: f"C{i % 10}" for i, label in enumerate(runs)}
    for ax, (key, ylabel) in zip(axes, panels, strict=True):
        for label, records in runs.items():
            points = [(r["step"], r[key]) for r in records if key in r]
            finite = [(s, v) for s, v in points if math.isfinite(v)]
            if not finite:
                continue
            steps, values = zip(*finite, strict=True)
            few = len(finite) < 40  # evaluations: mark each one
            ax.plot(steps, values, color=colors[label], marker="o" if few else None,
                    markersize=3, linewidth=1.4, label=label)
        if key in log_scale:
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    handles = []
    for label, records in runs.items():
        bad = next((r["step"] for r in records
                    if any(isinstance(v, float) and not math.isfinite(v) for v in r.values())),
                   None)
        text = label if bad is None else f"{label} (not finite at step {bad})"
        handles.append(Line2D([], [], color=colors[label], linewidth=2, label=text))
    fig.legend(handles=handles, loc="outside upper center", ncols=min(len(runs), 4),
               fontsize=9, title=title or None)
    return fig


def positional_encoding_figure(positions: int = 100, d_model: int = 128) -> Figure:
    """The sinusoid table of section 3.5 as a heatmap (position x dimension), and a few
    of its columns as curves: each pair of dimensions is a sine/cosine of its own
    wavelength, from 2*pi (dimension 0) up to 10000*2*pi."""
    if positions < 2 or d_model < 2 or d_model % 2:
        raise AiaynError(f"positional encoding needs >= 2 positions and an even d_model >= 2, "
                         f"got {positions} and {d_model}")
    table = sinusoid_table(positions, d_model).numpy()
    fig = new_figure(figsize=(12, 4.8), layout="constrained")
    heat, curves = fig.subplots(1, 2, width_ratios=[1.25, 1])
    image = heat.imshow(table, cmap="RdBu_r", vmin=-1, vmax=1, origin="upper",
                        aspect="auto", interpolation="nearest")
    heat.set_xlabel("embedding dimension (even: sin, odd: cos)")
    heat.set_ylabel("position in the sentence")
    heat.set_title(f"PE(pos, 2i) = sin(pos / 10000^(2i/d)),  PE(pos, 2i+1) = cos(...),  "
                   f"d = {d_model}", fontsize=10)
    fig.colorbar(image, ax=heat, pad=0.02)
    fig.get_layout_engine().set(wspace=0.06)
    # Even dimensions spread over the table; integer positions alias the shortest
    # wavelengths, so the first dimensions are left to the heatmap.
    dims = sorted({2 * round(d_model * f / 2) for f in (0.1, 0.2, 0.35, 0.5)})
    for d in dims:
        wavelength = 2 * math.pi * 10000 ** (d / d_model)
        curves.plot(range(positions), table[:, d],
                    label=f"dimension {d} (sin, wavelength {wavelength:,.0f})")
    curves.set_xlabel("position in the sentence")
    curves.set_ylabel("PE(pos, dimension)")
    curves.set_ylim(-1.15, 1.45)
    curves.set_title("a few columns of the table", fontsize=10)
    curves.legend(loc="upper center", ncols=2, fontsize=7.5)
    curves.grid(True, alpha=0.3)
    return fig


# ---------------------------------------------------------------- learning-rate schedule

def schedule_figure(config, label: str = "") -> Figure:
    """The training loop's learning rate (aiayn.training.optim.schedule_lr: eq. 3 of the paper, or
    the linear schedule) over ``config.train.max_steps`` steps, with the end of the warm-up
    marked. A linear schedule is drawn against its step budget: for one that ends with
    train.max_minutes, set max_steps to the steps the run will reach."""
    d_model, warmup, scale = config.model.d_model, config.train.warmup_steps, config.train.lr_scale
    last = max(config.train.max_steps, 2)
    steps = np.unique(np.concatenate([np.linspace(1, last, 1500).round(), [warmup]]))
    steps = steps[steps <= last].astype(int)
    lrs = [schedule_lr(int(s), config) for s in steps]  # the training loop's schedule
    peak = schedule_lr(warmup, config)
    fig = new_figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    ax.plot(steps, lrs, color="C0", label=label or None)
    if warmup <= last:
        ax.axvline(warmup, color="0.5", linestyle="--", linewidth=1)
        ax.annotate(f"end of warm-up: step {warmup:,}, lr {peak:.2e}", xy=(warmup, peak),
                    xytext=(12, -4), textcoords="offset points", va="top", fontsize=9)
    ax.set_xlabel("step (optimizer updates)")
    ax.xaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    ax.set_ylabel("learning rate")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.set_title(
        (f"lr = {scale:g} · d^-0.5 · min(step^-0.5, step · warmup^-1.5)\n"
         f"d_model = {d_model}, warmup = {warmup:,} steps" if config.train.schedule == "eq3" else
         f"lr = {config.train.peak_lr:g} · min(1, step / warmup) · (1 - step / max_steps)\n"
         f"warmup = {warmup:,} steps, max_steps = {last:,}")
        + (f"  ({label})" if label else ""),
        fontsize=10,
    )
    return fig


# ---------------------------------------------------------------- forward-pass diagram

@dataclass
class _Box:
    title: str
    shape: str
    detail: str = ""
    layer: int | None = None  # index of the encoder/decoder layer it belongs to
    is_cross: bool = False


def _fmt_shape(shape) -> str:
    return "×".join(str(s) for s in shape) if shape else "-"


def _nested(rows, i: int) -> list:
    """The rows called from inside rows[i] (the trace is in call order, with depths)."""
    out = []
    for row in rows[i + 1:]:
        if row.depth <= rows[i].depth:
            break
        out.append(row)
    return out


def _sublayer_box(rows, i: int, layer: int) -> _Box:
    inner = _nested(rows, i)
    core = next((r for r in inner if r.kind in ("MultiHeadAttention", "FeedForward")), None)
    shape = _fmt_shape(rows[i].shape)
    if core is None:
        return _Box("sub-layer + Add & Norm", shape, layer=layer)
    parts = {r.name.rsplit(".", 1)[-1]: r for r in inner}
    if core.kind == "FeedForward":
        hidden = parts.get("linear1")
        detail = f"inner ReLU layer {_fmt_shape(hidden.shape)}" if hidden else ""
        return _Box("Feed-forward + Add & Norm", shape, detail, layer)
    if core.name.endswith("cross_attn"):
        kv = parts.get("kv_proj")
        detail = f"K,V from memory {_fmt_shape(kv.shape)}" if kv else ""
        return _Box("Cross-attention + Add & Norm", shape, detail, layer, is_cross=True)
    qkv = parts.get("qkv_proj")
    detail = f"fused Q,K,V {_fmt_shape(qkv.shape)}" if qkv else ""
    masked = "Masked self-attention" if core.name.startswith("decoder") else "Self-attention"
    return _Box(f"{masked} + Add & Norm", shape, detail, layer)


def _trace_columns(rows) -> tuple[list[_Box], list[_Box]]:
    """Boxes for the encoder (left) and decoder (right) columns, from trace rows."""
    titles = {"TokenEmbedding": "Embedding × √d_model",
              "PositionalEncoding": "+ Positional encoding",
              "Generator": "Generator: linear → logits",
              "LayerNorm": "final LayerNorm (pre-norm)"}
    columns: dict[str, list[_Box]] = {"left": [], "right": []}
    layer, memory = None, None
    for i, row in enumerate(rows):
        top = row.name.split(".")[0]
        side = "left" if top in ("src_embed", "src_pos", "encoder") else "right"
        if row.kind in ("EncoderLayer", "DecoderLayer"):
            layer = int(row.name.split(".")[-1])
        elif row.kind == "Encoder":
            memory = _Box("memory = encoder output", _fmt_shape(row.shape))
        elif row.kind == "SublayerConnection":
            columns[side].append(_sublayer_box(rows, i, layer))
        elif row.depth == 1 and row.kind in titles or (
                row.kind == "LayerNorm" and row.name in ("encoder.norm", "decoder.norm")):
            columns[side].append(_Box(titles[row.kind], _fmt_shape(row.shape)))
            layer = None
    if memory is not None:
        columns["left"].append(memory)
    return columns["left"], columns["right"]


def _collapse_layers(boxes: list[_Box], keep: int = 2) -> list[_Box | str]:
    """Keep the first and last ``keep``-1 layers; the ones between become one '...' line."""
    layers = sorted({b.layer for b in boxes if b.layer is not None})
    if len(layers) <= keep + 1:
        return list(boxes)
    hidden = layers[1:-1]
    out: list[_Box | str] = []
    for b in boxes:
        if b.layer in hidden:
            if b.layer == hidden[0] and (not out or not isinstance(out[-1], str)):
                out.append(f"layers {hidden[0] + 1}–{hidden[-1] + 1}: the same shapes")
            continue
        out.append(b)
    return out


def trace_figure(rows, src_shape: Sequence[int], tgt_shape: Sequence[int],
                 n_heads: int | None = None) -> Figure:
    """The shapes of one forward pass as a diagram in the spirit of the paper's Figure 1:
    the encoder on the left, the decoder on the right, one box per sub-layer (with its
    output shape), the encoder's memory feeding every cross-attention. ``n_heads``
    (optional) is named in the title with the per-head size d_k."""
    enc, dec = _trace_columns(rows)
    if not enc or not dec:
        raise ValueError("trace rows do not look like a Transformer's forward pass")
    B, S = src_shape[0], src_shape[1]
    T = tgt_shape[1]
    columns = {"left": [f"source ids {B}×{S}", *_collapse_layers(enc)],
               "right": [f"target ids {B}×{T}", *_collapse_layers(dec)]}
    n_slots = max(len(c) for c in columns.values())
    fig = new_figure(figsize=(11, 0.72 * n_slots + 1.3), layout="constrained")
    ax = fig.subplots()
    ax.set_xlim(0, 10)
    ax.set_ylim(n_slots, -0.1)
    ax.axis("off")
    x_center = {"left": 2.6, "right": 7.4}
    box_w, box_h = 3.8, 0.72
    cross_slots: list[float] = []
    frames: dict[tuple[str, int], list[int]] = {}
    for side, items in columns.items():
        x = x_center[side]
        for slot, item in enumerate(items):
            y = slot + 0.5
            if slot > 0:
                ax.add_patch(FancyArrowPatch((x, y - 1 + box_h / 2), (x, y - box_h / 2),
                                             arrowstyle="-|>", mutation_scale=9, color="0.4"))
            if isinstance(item, str):
                color = "#eeeeee" if slot == 0 else "white"
                ax.add_patch(FancyBboxPatch((x - box_w / 2, y - box_h / 2), box_w, box_h,
                                            boxstyle="round,pad=0.02", fc=color, ec="0.6",
                                            linestyle="-" if slot == 0 else ":"))
                ax.text(x, y, item, ha="center", va="center", fontsize=8.5,
                        style="normal" if slot == 0 else "italic")
                continue
            color = _box_color(item)
            ax.add_patch(FancyBboxPatch((x - box_w / 2, y - box_h / 2), box_w, box_h,
                                        boxstyle="round,pad=0.02", fc=color, ec="0.3"))
            ax.text(x, y - 0.16, item.title, ha="center", va="center", fontsize=8.5,
                    weight="bold")
            detail = f"  ({item.detail})" if item.detail else ""
            ax.text(x, y + 0.17, f"{item.shape}{detail}", ha="center", va="center",
                    fontsize=8, family="monospace")
            if item.layer is not None:
                frames.setdefault((side, item.layer), []).append(slot)
            if item.is_cross:
                cross_slots.append(y)
    for (side, layer), slots in frames.items():
        x = x_center[side]
        top, bottom = min(slots) + 0.5 - box_h / 2 - 0.08, max(slots) + 0.5 + box_h / 2 + 0.08
        ax.add_patch(Rectangle((x - box_w / 2 - 0.12, top), box_w + 0.24, bottom - top,
                               fill=False, ec="0.55", linestyle="--", linewidth=0.8))
        name = "encoder" if side == "left" else "decoder"
        label_x = x - box_w / 2 - 0.18 if side == "left" else x + box_w / 2 + 0.18
        ax.text(label_x, (top + bottom) / 2, f"{name}\nlayer {layer + 1}", fontsize=8,
                ha="right" if side == "left" else "left", va="center", color="0.35")
    # The encoder's output (memory) gives the keys and values of every cross-attention.
    start = (x_center["left"] + box_w / 2, len(columns["left"]) - 0.5)
    for y in cross_slots:
        ax.add_patch(FancyArrowPatch(start, (x_center["right"] - box_w / 2, y),
                                     arrowstyle="-|>", mutation_scale=10, color="C3",
                                     connectionstyle="arc3,rad=0.1", linewidth=1.1))
    title = (f"A forward pass: B = {B} sentences, S = {S} source tokens, T = {T} target "
             f"tokens; shapes are B×length×features")
    d_model = _model_width(rows)
    if n_heads and d_model:
        title += (f"\nd_model = {d_model}: attention splits it into {n_heads} heads of "
                  f"d_k = {d_model // n_heads}")
    fig.suptitle(title, fontsize=10)
    return fig


def _model_width(rows) -> int | None:
    """d_model, read from the source embedding's output shape."""
    row = next((r for r in rows if r.kind == "TokenEmbedding" and r.shape), None)
    return row.shape[-1] if row else None


def _box_color(box: _Box) -> str:
    title = box.title.lower()
    if "attention" in title:
        return "#fde9c9"  # the paper's orange attention blocks
    if "feed-forward" in title:
        return "#d6eaf8"  # the paper's blue feed-forward blocks
    if "generator" in title:
        return "#e8daef"
    if "memory" in title:
        return "#f5b7b1"
    return "#fadbd8"  # embeddings and encodings
