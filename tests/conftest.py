"""Shared test settings: tiny models run fastest on one thread (and CI has only 2 cores)."""

import pytest
import torch

torch.set_num_threads(1)


# The Bible corpus from the real SWORD modules (Debian's sword-text-web/-sparv/-kjv):
# reading it takes a few seconds, so each test session reads and prepares it once.


@pytest.fixture(scope="session")
def bible_corpus():
    """``read_corpus("bible:eng-spa")`` with the default data settings."""
    from aiayn.config import DataConfig
    from aiayn.corpora import read_corpus

    return read_corpus("bible:eng-spa", DataConfig())


@pytest.fixture(scope="session")
def bible_prepared(bible_corpus, tmp_path_factory):
    """``bible:eng-spa`` prepared with the defaults (BPE, joint 8000) into a directory."""
    from aiayn.config import DataConfig
    from aiayn.prepare import prepare

    out = tmp_path_factory.mktemp("bible-eng-spa")
    prepare(DataConfig(), out, model_max_len=256, max_tokens=4096, corpus=bible_corpus)
    return out
