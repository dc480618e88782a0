"""The export tests' trained runs: a copy model, and a model of two directions."""

import pytest
from export_helpers import tagged_run
from helpers import copy_run

from aiayn.export.command import export_run


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory):
    """One trained run for every export test file, as when they were one file: none of them
    writes into it (those that change a run change a copy)."""
    return copy_run(tmp_path_factory.mktemp("copy"))


@pytest.fixture(scope="session")
def tagged_run_dir(tmp_path_factory):
    """A run of two target languages, es and fr (export_helpers.tagged_run), for the tests
    of exports that keep the direction tags; none writes into it."""
    return tagged_run(tmp_path_factory.mktemp("tagged"))


@pytest.fixture(scope="session")
def tagged_hf(tagged_run_dir, tmp_path_factory):
    """``tagged_run_dir`` exported --to hf, once."""
    return export_run(tagged_run_dir, "hf", tmp_path_factory.mktemp("tagged-hf") / "out")


@pytest.fixture(scope="session")
def tagged_ct2(tagged_run_dir, tmp_path_factory):
    """``tagged_run_dir`` exported --to ctranslate2, once."""
    return export_run(tagged_run_dir, "ctranslate2",
                      tmp_path_factory.mktemp("tagged-ct2") / "out")
