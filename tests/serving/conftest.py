"""The serve tests' fixtures: the run's Translator, a service with lanes as threads, its
app under TestClient, and `aiayn serve` as a process (tests/conftest.py marks tests
that use any of them slow)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from helpers import copy_run, tagged_run
from serve_helpers import serve_process

from aiayn.inference.translator import Translator
from aiayn.serving.service import ModelService, ServeLimits

if TYPE_CHECKING:
    from fastapi.testclient import TestClient


@pytest.fixture(scope="module")
def translator(run_dir) -> Translator:
    return Translator.from_pretrained(run_dir)


@pytest.fixture(scope="module")
def service(run_dir) -> ModelService:
    # Lanes as threads, whatever torch's thread count: tests patch the search in-process.
    return ModelService.from_run(run_dir, lanes="threads")


@pytest.fixture(scope="module")
def client(service) -> TestClient:
    from fastapi.testclient import TestClient  # the serve extra: test files skip without it

    from aiayn.serving.app import create_app

    limits = ServeLimits(max_body_bytes=20_000, max_sentences=8, max_chars=400)
    return TestClient(create_app(service, limits))


@pytest.fixture(scope="session")
def server(run_dir):
    """`aiayn serve RUN_DIR --port P` as a subprocess, one for test_server.py and test_page.py;
    its base URL once /health answers."""
    with serve_process(run_dir) as served:
        yield served.url


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory):
    """One trained run for every serve test file, as when they were one file: none of them
    writes into it (those that change a run change a copy)."""
    return copy_run(tmp_path_factory.mktemp("copy"))


@pytest.fixture(scope="session")
def tagged_run_dir(tmp_path_factory):
    """A tiny run of two target languages, xx and yy (helpers.tagged_run), for
    test_service.py and test_page.py; none of them writes into it."""
    return tagged_run(tmp_path_factory.mktemp("tagged"))
