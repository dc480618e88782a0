"""What the serve tests share (tests/serving/): the sentences, the mixed requests, and
ways to hold the model, wait for a state, compare answers and call a server."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from helpers import COPY_WORDS, random_sentence

from aiayn.inference.attention import SentenceAttention, sentence_attention
from aiayn.inference.translator import TruncationWarning
from aiayn.model import Transformer
from aiayn.runs.checkpoint import load_weights

SENTENCES = ["red green blue", "", "sun moon star tree river", "white", "black sun"]


LONG = " ".join(COPY_WORDS * 3)  # 30 words: over the tiny model's max_len of 16 tokens


REPEATING = ["red red red sun sun", "moon tree moon tree moon", "star"]


def assert_clean_error(response, status: int, words: str) -> None:
    """The status, a JSON body with one line naming the problem, no traceback."""
    assert response.status_code == status, response.text
    message = response.json()["error"]
    assert words in message and "\n" not in message and "Traceback" not in response.text


def until(condition, what: str, seconds: float = 30) -> None:
    """Poll ``condition()`` until true (a state the test waits for, not a guessed delay)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.005)


def held_model(service):
    """Occupy the model's thread until the returned event is set: requests sent meanwhile
    wait in the queue and are decoded together once it is."""
    gate = threading.Event()
    holding = service.batcher.run_alone(gate.wait)
    until(holding.running, "the batcher to take the holding job")
    return gate


def send_while_held(service, client, requests, queued: int | None = None) -> list:
    """POST every (body, _) of ``requests`` at once while the model is held, so they all
    queue; release it once ``queued`` of them wait (default: all but one, MIXED's last is
    refused before it queues) and return the responses in order."""
    gate = held_model(service)
    queued = len(requests) - 1 if queued is None else queued
    try:
        with ThreadPoolExecutor(len(requests)) as pool:
            sent = [pool.submit(client.post, "/translate", json=body) for body, _ in requests]
            try:
                until(lambda: service.batcher.waiting == queued, "the requests to queue")
            finally:
                gate.set()  # before the pool waits for its requests: never a deadlock
            return [f.result() for f in sent]
    finally:
        gate.set()


MIXED = [  # (request body, the search it runs): one over-long sentence, empty lines, ...
    ({"text": ["red green blue", "", LONG], "beam": 4, "alpha": 0.6, "nbest": 2}, (4, 0.6)),
    ({"text": ["white"], "beam": 4, "alpha": 0.6}, (4, 0.6)),
    ({"text": [random_sentence(random.Random(i)) for i in range(6)], "beam": 4,
      "alpha": 0.6, "nbest": 4}, (4, 0.6)),
    ({"text": ""}, (4, 0.6)),  # the run's search: its config's decode (4, 0.6)
    ({"text": ["black sun", "sun moon star tree river"], "beam": 2, "nbest": 2}, (2, 0.6)),
    ({"text": ["red", "tree river"], "beam": 4, "alpha": 1.5, "nbest": 3}, (4, 1.5)),
    ({"text": [LONG, "blue"], "beam": 2, "alpha": 0.6}, (2, 0.6)),
    ({"text": ["sun"] * 9, "beam": 4}, None),  # over the limit of 8 sentences: 413
]


def expected_answer(translator, body: dict, search) -> tuple[list, list[str]]:
    """The n-best lists and warnings of translating this request alone, in-process."""
    texts = [body["text"]] if isinstance(body["text"], str) else body["text"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TruncationWarning)
        beam, alpha = search
        hyps = translator.translate_nbest(texts, translator.resolve(beam=beam, alpha=alpha,
                                                                    nbest=body.get("nbest", 1)))
    return hyps, [str(w.message) for w in caught if w.category is TruncationWarning]


def assert_same_answer(answer: dict, hyps: list, messages: list[str]) -> None:
    got = [[(h["text"], h["score"]) for h in nbest] for nbest in answer["nbest"]]
    assert [[t for t, _ in h] for h in got] == [[t for t, _ in h] for h in hyps]
    assert np.allclose([s for h in got for _, s in h], [s for h in hyps for _, s in h],
                       atol=1e-4)
    assert answer["translations"] == [h[0][0] if h else "" for h in hyps]
    assert answer["warnings"] == messages


def attention_by_hand(run_dir, translator, sentence: str, step: int, beam: int = 1
                      ) -> SentenceAttention:
    """The maps of step ``step``'s weights, loaded by hand, over the served translation."""
    sources, _ = translator.encode([sentence])
    target = translator.decode_ids(sources, translator.resolve(beam=beam))[0][0].ids
    model = Transformer(translator.model.cfg)
    load_weights(model, run_dir / "checkpoints" / f"step_{step:07d}.safetensors")
    return sentence_attention(model.eval(), translator.tokenizers, sentence, target)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict | None = None, timeout: float = 30) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


@dataclasses.dataclass
class Served:
    """A server of ``serve_process``: its base URL and process id."""

    url: str
    pid: int


@contextlib.contextmanager
def serve_process(run_dir, *args: str):
    """`aiayn serve RUN_DIR --port P ARGS` as a subprocess, once /health answers."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "aiayn", "serve", str(run_dir),
                                "--port", str(port), "--device", "cpu", *args], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                http_json(f"{url}/health", timeout=2)
                break
            except (urllib.error.URLError, ConnectionError):
                if process.poll() is not None or time.monotonic() > deadline:
                    process.kill()
                    pytest.fail(f"aiayn serve did not start: {process.stdout.read()}")
                time.sleep(0.2)
        yield Served(url, process.pid)
    finally:
        process.terminate()
        process.wait(timeout=10)


def child_processes(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:  # "pid (name) state ppid ..."
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # ended meanwhile
                continue
            if parent == pid:
                found.append(int(entry))
    return found
