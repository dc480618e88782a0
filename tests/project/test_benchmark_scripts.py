"""The benchmark scripts still start: each one's --help runs (its imports resolve, its options
parse). The benchmarks themselves are not run here (benchmarks/README.md measures with them);
this catches a script left behind when a module it imports moves, as time_to_bleu.py was
once left importing read_metrics from aiayn.inspect.plots."""

import json
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


def test_the_scripts_on_a_run_read_its_options_alike(monkeypatch):
    """engines.py, threads.py and decode.py take a run, its sentences and the search through
    benchmarks/common.py, so one option means one thing with one default in all three."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    parsed = {}
    for name in ("engines.py", "threads.py", "decode.py"):
        parse_args = runpy.run_path(str(BENCHMARKS / name))["parse_args"]
        parsed[name] = vars(parse_args(["--run-dir", "runs/x", "--beam", "2"]))
    shared = ("run_dir", "weights", "beam", "decode_tokens", "repeats")
    assert parsed["engines.py"]["split"] == parsed["threads.py"]["split"] == "test"
    assert {n: {k: a[k] for k in shared} for n, a in parsed.items() if n != "decode.py"} == {
        n: {"run_dir": "runs/x", "weights": "best", "beam": 2, "decode_tokens": 8192, "repeats": 2}
        for n in ("engines.py", "threads.py")}
    assert parsed["decode.py"]["run_dir"] == "runs/x" and parsed["decode.py"]["beam"] == 2


def test_print_table_writes_what_it_prints_as_json(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import common

    out = tmp_path / "table.json"
    common.print_table(["engine", "sentences/s"], [["aiayn", "12.5"], ["other", "3.0"]],
                       "10 test sentences of runs/x", str(out))
    printed = capsys.readouterr().out
    record = json.loads(out.read_text(encoding="utf-8"))
    assert record["headers"] == ["engine", "sentences/s"]
    assert record["rows"] == [["aiayn", "12.5"], ["other", "3.0"]]
    assert record["conditions"] in printed and "| aiayn | 12.5 |" in printed
    assert record["device"]  # the machine the figures were measured on
