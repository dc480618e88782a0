"""Pictures of the model and its training, as PNG files drawn by matplotlib's Agg backend.

Every picture is made by a pure function that takes plain data (metrics records, a config,
trace rows, attention matrices) and returns a matplotlib ``Figure``; ``save_figure`` writes
it (both from ``aiayn.inspect.canvas``: a ``Figure`` without ``pyplot``, so no display is
needed and no global figure state leaks between calls).

    curves_figure        training loss, dev loss, dev BLEU, learning rate against steps
    comparison_figure    chosen metrics of several runs against steps (an ablation)
    positional_encoding_figure   the sinusoid table of section 3.5
    schedule_figure      the learning-rate schedule of section 5.3, eq. 3
    trace_figure         the shapes of a forward pass through the layers (``aiayn trace``)

The attention pictures are ``aiayn.inspect.attention_plots``'s; this module also names its
savers (and ``save_figure``, ``check_picture_path``, ``DPI``) so that ``from
aiayn.inspect.plots import ...`` reaches every picture.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle
from matplotlib.ticker import StrMethodFormatter

from aiayn.errors import SettingError
from aiayn.inspect.attention_plots import (  # noqa: F401  (the commands reach them here)
    save_attention_figures,
    save_attention_steps,
)
from aiayn.inspect.canvas import DPI, check_picture_path, new_figure, save_figure  # noqa: F401  (as above)
from aiayn.model import sinusoid_table
from aiayn.training.optim import schedule_lr

# ---------------------------------------------------------------- training curves

# (panel title, record kind, field, y label; the training loss's is loss_label's)
CURVES = [
    ("training loss", "train", "loss", "cross-entropy"),
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


def loss_label(smoothing: Sequence[float | None]) -> str:
    """The training loss's axis label from the runs' train.label_smoothing (None: not known):
    "label-smoothed" only where every run smoothed, with its epsilon when they share one."""
    values = set(smoothing)
    if not values or None in values:
        return "training loss (label-smoothed where the run's config says so)"
    if values == {0.0}:
        return "cross-entropy"
    if 0.0 in values:
        return "cross-entropy, label-smoothed in some runs"
    epsilon = f" (eps {values.pop():g})" if len(values) == 1 else ""
    return f"label-smoothed cross-entropy{epsilon}"


def curves_figure(runs: dict[str, list[dict[str, Any]]],
                  smoothing: Sequence[float | None] = ()) -> Figure:
    """Four panels against optimizer steps, one colour per run, one legend for all.
    ``smoothing``: each run's train.label_smoothing (None: unknown), for the training loss's
    label (``loss_label``)."""
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
        ax.set_ylabel(loss_label(smoothing or [None] * len(runs)) if key == "loss" else ylabel)
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
    # SettingError: each command names the two as its users give them (--positions).
    if positions < 2:
        raise SettingError("{positions} must be at least 2, got {got}", got=positions)
    if d_model < 2 or d_model % 2:
        raise SettingError("{d_model} must be even and at least 2 (sines and cosines come in "
                           "pairs), got {got}", got=d_model)
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
