"""aiayn.cli's own options (the commands' are tested beside the modules they call)."""

from __future__ import annotations

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
