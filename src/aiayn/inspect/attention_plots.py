"""Pictures of attention: the maps of one translation (every layer and head, paper 3.2) and
one sentence's cross-attention at each saved step of a run, drawn from plain arrays.

    attention_figure         layers x heads grid of attention maps, rows = queries
    attention_figures        the three kinds (encoder, decoder_self, cross) of one sentence
    attention_steps_figure   one sentence's cross-attention at each saved step of a run

Reading an attention map: row i is query position i, column j is key position j, and the
value is how much of query i's output comes from key j's value (each row sums to 1).
Encoder self-attention: queries and keys are source tokens. Decoder self-attention:
both are the decoder's input tokens ([BOS] + hypothesis), and a row only sees the columns
left of and on the diagonal (the causal mask). Cross-attention: queries are the decoder's
input tokens, keys are source tokens. ``drawn_matrices`` and ``drawn_panels`` read a figure
back, so a test can hold what is drawn against the model.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from matplotlib.colors import PowerNorm
from matplotlib.figure import Figure

from aiayn.inspect.canvas import new_figure, save_figure
from aiayn.util.io import atomic_path

if TYPE_CHECKING:  # the pictures take arrays; this only names their containers
    from aiayn.inference.attention import SentenceAttention
    from aiayn.inspect.attention_steps import StepAttention


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
