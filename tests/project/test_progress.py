"""aiayn.util.progress: the one bar helper, and log lines that leave a bar alone off a terminal."""

from __future__ import annotations

import io
import sys

from tqdm import tqdm

from aiayn.util import progress


def _bar_lines_after_logging(write, capsys) -> tuple[int, str]:
    """A training-like bar on stderr (not a terminal under capsys), four lines logged the
    way a validation logs them: how many times stderr shows the bar, and stdout."""
    capsys.readouterr()
    bar = tqdm(total=100, desc="train", unit="step", file=sys.stderr, mininterval=30)
    bar.update(1)
    for line in ("step 1: dev loss 3.000", "  src: a", "  src: b", "  src: c"):
        write(line)
    bar.close()
    out, err = capsys.readouterr()
    return err.count("train:"), out


def test_log_lines_do_not_repaint_the_bar_when_stderr_is_no_terminal(capsys):
    shown, out = _bar_lines_after_logging(progress.log, capsys)
    assert out.splitlines() == ["step 1: dev loss 3.000", "  src: a", "  src: b", "  src: c"]
    assert shown <= 2  # drawn when it starts and when it closes, nothing per logged line
    # tqdm.write itself redraws the bar after every line: what a log of CI used to show.
    assert _bar_lines_after_logging(tqdm.write, capsys)[0] >= shown + 4


def test_on_a_terminal_log_lines_go_through_tqdm_write(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    written: list[str] = []
    monkeypatch.setattr(sys, "stderr", Terminal())
    monkeypatch.setattr(tqdm, "write", classmethod(lambda cls, s, **k: written.append(s)))
    progress.log("step 5")
    assert written == ["step 5"]


def test_a_bar_that_is_not_asked_for_draws_nothing(capsys):
    items = [1, 2, 3]
    assert progress.bar(items, enabled=False, desc="reading") is items
    with progress.bar(None, enabled=False, desc="encoding", total=3) as bar:
        bar.update(3)
    assert capsys.readouterr() == ("", "")
