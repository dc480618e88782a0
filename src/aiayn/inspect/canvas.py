"""What every picture of ``aiayn.inspect`` is drawn on: a matplotlib ``Figure`` drawn by Agg,
without ``pyplot`` (no display needed, no global figure state), and written atomically.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from aiayn.errors import AiaynError
from aiayn.util.io import atomic_path, check_output_file

DPI = 110


def new_figure(**kwargs) -> Figure:
    """A figure drawn by Agg (headless), whatever matplotlib's default backend is."""
    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def check_picture_path(path: str | Path, option: str | None = None) -> Path:
    """``path`` can take a picture of ``save_figure``: named *.png, not a directory, no file
    in the way of the directories it makes. ``option``: the flag that gave it, which the
    message names (a command checks before it draws: ``check_picture_path(out, "-o")``)."""
    path = Path(path)
    if option is not None:
        check_output_file(path, option, make_dirs=True)
    if path.suffix.lower() != ".png":
        where = f"{option} {path}" if option else str(path)
        raise AiaynError(f"{where}: pictures are written as PNG; name the file *.png")
    return path


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` as a PNG (creating the parent directory); returns the path."""
    path = check_picture_path(path)
    with atomic_path(path, what="the picture") as tmp:  # no half PNG on a full disk
        fig.savefig(tmp, dpi=DPI, format="png")
    return path
