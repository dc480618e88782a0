"""`aiayn serve` as a real server: uvicorn on a thread (a client that hangs up) and the
command as a process of its own under concurrent clients (the ``server`` fixture).
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'aiayn[serve]'")
from helpers import random_sentence  # noqa: E402
from serve_helpers import (  # noqa: E402
    child_processes,
    held_model,
    http_json,
    serve_process,
    until,
)

from aiayn.errors import AiaynError  # noqa: E402
from aiayn.serving.app import create_app  # noqa: E402
from aiayn.serving.service import ModelService  # noqa: E402


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_client_that_hangs_up_while_waiting_is_never_decoded(run_dir, translator, http):
    """A real server (uvicorn on a thread, with either HTTP parser: h11 where httptools is
    missing): a request whose client closes the connection while it waits is dropped
    before any pass; the request behind it is answered alone."""
    import uvicorn

    if http == "httptools":
        pytest.importorskip("httptools", reason="the serve extra's httptools is not installed")

    from aiayn.serving.app import listening_socket

    service = ModelService.from_run(run_dir)
    sock = listening_socket("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning", http=http))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    gate = threading.Event()
    try:
        until(lambda: server.started, "the server to start")
        gate = held_model(service)
        body = json.dumps({"text": ["red green blue"], "beam": 2}).encode()
        with socket.create_connection(("127.0.0.1", sock.getsockname()[1])) as rude:
            rude.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            until(lambda: service.batcher.waiting == 1, "the request to queue")
            job = service.batcher._queue[0]
        until(job.future.cancelled, "the server to notice the client has gone")
        with ThreadPoolExecutor(1) as pool:
            polite = pool.submit(http_json, f"{url}/translate", {"text": ["black sun"]})
            until(lambda: service.batcher.waiting == 2, "the second request to queue")
            gate.set()
            assert polite.result()["translations"] == translator.translate(["black sun"])
        stats = service.stats()
        assert (stats["dropped"], stats["requests"], stats["pass_requests"]) == (1, 1, {"1": 1})
    finally:
        gate.set()
        server.should_exit = True
        thread.join(timeout=30)
        service.close()


# ---------------------------------------------------------------- a real server process

def test_a_real_server_answers_concurrent_clients_correctly(server, translator):
    """A small load test: 40 requests from 8 clients at once, each answer the right one."""
    rng = random.Random(7)
    texts = [random_sentence(rng) for _ in range(40)]
    expected = translator.translate(texts, translator.resolve(beam=2))
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda t: http_json(f"{server}/translate",
                                                     {"text": [t], "beam": 2}), texts))
    assert [a["translations"][0] for a in answers] == expected


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
@pytest.mark.parametrize("scheduling", [None, "inherited"])
def test_a_cpu_server_and_its_lane_processes_run_under_the_batch_policy(run_dir, translator,
                                                                        scheduling):
    """On a CPU every thread of `aiayn serve` and every lane process is SCHED_BATCH
    (aiayn.util.threads.batch_policy: a thread that wakes does not preempt a lane in
    mid-step); with --scheduling inherited, as the test started it. Either way it answers
    as the translator does."""
    args = ["--lanes", "processes"] + (["--scheduling", scheduling] if scheduling else [])
    with serve_process(run_dir, *args) as served:
        answer = http_json(f"{served.url}/translate", {"text": ["black sun"]})
        threads = [int(thread) for thread in os.listdir(f"/proc/{served.pid}/task")]
        lanes = [child for child in child_processes(served.pid)
                 if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()]
        policies = {os.sched_getscheduler(pid) for pid in [*threads, *lanes]}
    assert len(lanes) == 1 and len(threads) > 2  # one core's lane; the event loop, the batcher's
    assert policies == {os.SCHED_BATCH if scheduling is None else os.sched_getscheduler(0)}
    assert answer["translations"] == translator.translate(["black sun"])


def test_an_unknown_scheduling_is_one_line_before_loading():
    from aiayn.serving.app import serve

    with pytest.raises(AiaynError, match="^--scheduling must be one of batch, inherited, got "
                                         "'nice'$"):
        serve("no-such-run", port=0, scheduling="nice")


def test_the_server_listens_on_localhost_only_by_default(server):
    import aiayn.cli as cli

    args = cli.build_parser().parse_args(["serve", "RUN"])
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    assert server.startswith("http://127.0.0.1:")


def test_a_busy_port_is_one_line_before_loading_anything(server, capsys):
    from aiayn import cli

    port = server.rsplit(":", 1)[1]
    assert cli.main(["serve", "no-such-run", "--port", port]) == 2  # the port, not the run
    assert capsys.readouterr().err == (f"aiayn: error: --host 127.0.0.1 --port {port}: cannot "
                                       "listen there (Address already in use); choose another "
                                       "--port\n")
