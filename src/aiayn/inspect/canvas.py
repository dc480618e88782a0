"""What every picture of ``aiayn.inspect`` is drawn on: a matplotlib ``Figure`` drawn by Agg,
without ``pyplot`` (no display needed, no global figure state), and written atomically.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from aiayn.errors import AiaynError
from aiayn.util.io import atomic_path

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
