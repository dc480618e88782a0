"""aiayn.cli's own options (the commands' are tested beside the modules they call)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import aiayn
from aiayn.cli import main


def test_version_names_aiayn_and_torch(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"aiayn {aiayn.__version__} (torch {torch.__version__}, Python ")
    assert out.count("\n") == 1


WITHOUT_TORCH = r"""
import contextlib, io, sys
from aiayn.cli import main
codes = []
for argv in (["--help"], ["translate", "--help"], ["export", "--help"],
             ["translate", "RUN", "--beam", "four"], ["--version"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(argv)
        except SystemExit as exc:
            codes.append(exc.code)
print(codes, "torch" in sys.modules)
"""


def test_help_a_mistyped_option_and_the_version_answer_without_loading_torch():
    """The parser is built from aiayn.config and aiayn.options alone: `aiayn --help` or a
    wrong argument answers in a fraction of a second instead of after torch's import."""
    done = subprocess.run([sys.executable, "-c", WITHOUT_TORCH], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[0,", "0,", "0,", "2,", "0]", "False"]
