"""The export tests' trained run."""

import pytest
from helpers import copy_run


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory):
    """One trained run for every export test file, as when they were one file: none of them
    writes into it (those that change a run change a copy)."""
    return copy_run(tmp_path_factory.mktemp("copy"))
