"""The benchmark scripts still start: each one's --help runs (its imports resolve, its options
parse). The benchmarks themselves are not run here (benchmarks/README.md measures with them);
this catches a script left behind when a module it imports moves, as time_to_bleu.py was
once left importing read_metrics from aiayn.inspect.plots."""

import runpy
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p for p in [*BENCHMARKS.glob("*.py"), *BENCHMARKS.glob("*/*.py")]
                 if 'if __name__ == "__main__":' in p.read_text(encoding="utf-8"))


def test_the_scripts_are_found():
    names = {p.name for p in SCRIPTS}
    assert {"time_to_bleu.py", "threads.py", "step_cost.py", "run.py"} <= names
    assert "common.py" not in names  # a library of the scripts, not one itself


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_help_runs(script, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(script.parent))  # as `python benchmarks/X.py` would
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out


def test_time_to_bleu_plots_one_panel_with_tokens_only(tmp_path, monkeypatch, capsys):
    """plot --tokens-only draws BLEU against tokens alone: one panel, half the width."""
    from PIL import Image

    curve = tmp_path / "run.json"
    curve.write_text('{"label": "a", "curve": [{"step": 1, "minutes": 1.0, "tokens": 1000000, '
                     '"bleu": 5.0, "chrf": 20.0, "n_sentences": 10}, {"step": 2, "minutes": '
                     '2.0, "tokens": 2000000, "bleu": 9.0, "chrf": 30.0, "n_sentences": 10}]}',
                     encoding="utf-8")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    widths = {}
    for name, extra in (("both", []), ("tokens", ["--tokens-only"])):
        out = tmp_path / f"{name}.png"
        monkeypatch.setattr(sys, "argv", ["time_to_bleu.py", "plot", str(curve), "-o", str(out),
                                          *extra])
        runpy.run_path(str(BENCHMARKS / "time_to_bleu.py"), run_name="__main__")
        with Image.open(out) as image:
            widths[name] = image.width
    assert widths["tokens"] < 0.7 * widths["both"]
    assert '"bleu": 9.0' in capsys.readouterr().out
