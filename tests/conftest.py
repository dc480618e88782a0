"""Shared test settings: tiny models run fastest on one thread (and CI has only 2 cores);
and the two tiers: `make test` runs every test (CI), `make test-fast` only those not
marked ``slow``, in about a minute on two cores, for the edit-run loop."""

import pytest
import torch

torch.set_num_threads(1)

# A test is slow when it needs one of these fixtures: each trains a model, reads or prepares
# the Bible, builds a run directory or starts a server, seconds to a minute before the first
# assertion. Tests that are slow on their own (a browser, a process killed, torchrun, a
# notebook, a wheel) carry ``@pytest.mark.slow`` themselves.
SLOW_FIXTURES = frozenset({
    "bible_stream", "bible_prepared", "run_dir", "translator", "service", "client", "server",
    "world", "small_fs", "data_dir", "trained_run", "random_translator", "steps_att",
    "base_run", "second_corpus", "demo_run", "healthy", "validated", "executed", "reversal",
    "tagged_run_dir",
})


def pytest_collection_modifyitems(items):
    for item in items:
        if SLOW_FIXTURES.intersection(item.fixturenames):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Each test starts on one torch thread, whatever the one before left (a command run
    in-process may choose its own count; `aiayn serve`'s lanes follow it)."""
    torch.set_num_threads(1)
    yield


# The Bible corpus from the real SWORD modules (Debian's sword-text-web/-sparv/-kjv):
# reading it takes a few seconds, so each test session reads and prepares it once.


@pytest.fixture(scope="session")
def bible_stream():
    """``bible:eng-spa`` as ``aiayn prepare`` reads it, with the default data settings: the
    kept pairs of each split (by whole books) with their references (helpers.stream_pairs)."""
    from helpers import stream_pairs

    return stream_pairs("bible:eng-spa")


@pytest.fixture(scope="session")
def bible_prepared(tmp_path_factory):
    """``bible:eng-spa`` prepared by ``aiayn prepare`` with the defaults (BPE, joint 8000)."""
    from aiayn.config import DataConfig
    from aiayn.data.prepare import prepare

    out = tmp_path_factory.mktemp("bible-eng-spa")
    prepare(DataConfig(), out, model_max_len=256, max_tokens=4096)
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real (tiny) run directory (helpers.copy_run): a model trained for a few seconds to
    copy its input. tests/serving/ and tests/export/ share one across their files."""
    from helpers import copy_run

    return copy_run(tmp_path_factory.mktemp("copy"))
