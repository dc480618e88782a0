"""The serve tests' fixtures: the run's Translator, a service with lanes as threads, its
app under TestClient, and `aiayn serve` as a process (tests/conftest.py marks tests
that use any of them slow)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
from typing import TYPE_CHECKING

import pytest
from serve_helpers import free_port, http_json

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


@pytest.fixture(scope="module")
def server(run_dir):
    """`aiayn serve RUN_DIR --port P` as a subprocess; its base URL once /health answers."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "aiayn", "serve", str(run_dir),
                                "--port", str(port), "--device", "cpu"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            http_json(f"{url}/health", timeout=2)
            break
        except (urllib.error.URLError, ConnectionError):
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"aiayn serve did not start: {process.stdout.read()}")
            time.sleep(0.2)
    yield url
    process.terminate()
    process.wait(timeout=10)
