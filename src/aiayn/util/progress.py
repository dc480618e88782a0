"""Progress bars and the lines printed beside them: one helper each, for every command.

``bar`` is the bar of the passes of ``aiayn prepare`` (reading, the tokenizer, encoding):
a rate and a count, gone when the pass ends, and nothing at all when stderr is not a
terminal (tqdm's ``disable=None``) or when progress was not asked for.

``log`` prints a line while a bar may be drawn. On a terminal it goes through
``tqdm.write``, which clears the bar, prints the line and redraws the bar under it. When
stderr is not a terminal (CI, ``make demo > log``) a bar cannot be cleared, so that redraw
would print the bar's line again after every logged line (a validation printed it four
times); there the line is printed plainly and the bar keeps its own interval.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any


def bar(items: Iterable | None = None, enabled: bool = True, desc: str = "",
        total: int | None = None, unit: str = " pairs", initial: int = 0) -> Any:
    """A transient tqdm bar over ``items`` (or, with ``items=None``, one updated by hand).
    Not ``enabled``: ``items`` themselves (no wrapper), or a bar that draws nothing.
    ``initial``: the count already done (a resumed job; its rate counts from here)."""
    if not enabled and items is not None:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, total=total, unit=unit, unit_scale=bool(unit), leave=False,
                dynamic_ncols=True, disable=None if enabled else True, initial=initial)


def log(line: str) -> None:
    """Print ``line`` to stdout without repainting a bar on a stderr that is not a terminal."""
    if sys.stderr is not None and sys.stderr.isatty():
        from tqdm import tqdm

        tqdm.write(line)
    else:
        print(line, flush=True)
