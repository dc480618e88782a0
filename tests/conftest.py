"""Shared test settings: tiny models run fastest on one thread (and CI has only 2 cores)."""

import pytest
import torch

torch.set_num_threads(1)


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
    from aiayn.prepare import prepare

    out = tmp_path_factory.mktemp("bible-eng-spa")
    prepare(DataConfig(), out, model_max_len=256, max_tokens=4096)
    return out
