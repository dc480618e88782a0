"""A bounded load test of `aiayn serve`: 1, 8 and 32 concurrent clients, and a soak.

    .venv/bin/python benchmarks/serve_load.py RUN_DIR                   # 1, 8, 32 clients
    .venv/bin/python benchmarks/serve_load.py RUN_DIR --clients 8 --requests 16 --beam 1
    .venv/bin/python benchmarks/serve_load.py RUN_DIR --soak 300        # 5 minutes of load
    .venv/bin/python benchmarks/serve_load.py RUN_DIR --save xeon207-quiet --load "quiet"
    python benchmarks/serve_load.py RUN_DIR --device cuda            # the server on a GPU

Starts `aiayn serve RUN_DIR` on a free port of 127.0.0.1 (nothing else is ever contacted)
and sends N sentences of the run's test split, each as its own POST /translate, from K
concurrent clients (each sends its next request when its last is answered, over the same
connection: ``--connections new`` opens one a request; all K from one thread, ``Clients``, so
that they take little of the cores the server runs on), for each K of --clients. Every
answer is checked against the same sentences translated in this process: none lost, none
wrong. The reference, timed in the same run on the same machine: those
sentences decoded offline as one batch (``Translator.translate``), the best a server could
approach, timed before the server starts and again after its last K (the mean is the one
compared: a shared machine's speed drifts within minutes); ``--repeats N`` runs every K
N times, the reference after each repeat, and reports medians. After each K the server's GET
/stats says what it decoded together (sentences per decoding step and requests that joined
a running search; per pass for the CTranslate2 engine) and how long requests waited.

With continuous batching on a CPU a second reference says what part of the gap is the
server's: its lanes alone (``LanesAlone``). K clients keep about K / L sentences in each of
the server's L lanes; L processes, each decoding its share of the sentences by the search a
lane runs (``JoinableSearch``, one thread) with as many kept in flight, all at once, are
what the lanes could answer with no HTTP, no queue and no server process: a server near
that rate is limited by the size of its steps, not by serving. Each row of the server
also says what CPU time a request cost its own process, its lanes and the clients (/proc):
on a CPU they share the cores; the reference rows, what a sentence cost the offline batch
and the lanes alone.

``--soak SECONDS``: K clients (--soak-clients) keep the server busy for that long, while one
more client, over and over, sends a request of 8 sentences and hangs up before the answer;
reports the server's RSS at the start and end (and every 10 s), every polite request
answered and correct, and their latency.

``--save KEY``: the rows (and their conditions: command, commit, CPU, torch, date, --load)
replace those of KEY in benchmarks/results/serve_load.json, which docs/results.md shows.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import http.client
import json
import math
import multiprocessing
import os
import random
import selectors
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, cpu_model, git_commit  # noqa: E402

from aiayn.data.batching import pad  # noqa: E402
from aiayn.errors import AiaynError  # noqa: E402
from aiayn.inference.joinable import JoinableSearch  # noqa: E402
from aiayn.inference.translator import Translator  # noqa: E402
from aiayn.runs.directory import read_data_dir  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "serve_load.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict | None = None, timeout: float = 300) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def server_options(run_dir: str, weights: str = "best", int8: bool = False) -> argparse.Namespace:
    """What ``start_server`` reads, for the server as a user starts it (this script's
    defaults, two torch threads): the scripts that start one for other work
    (server_cost.py, serve_screenshot.py) take a new server option's default from here."""
    return parse_args([f"--weights={weights}", "--threads", "2",
                       *(["--int8"] if int8 else []), "--", run_dir])


def start_server(args) -> tuple[subprocess.Popen, str]:
    """`aiayn serve` on 127.0.0.1 and a free port; returns once GET /health answers."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    command = [sys.executable, "-m", "aiayn", "serve", args.run_dir, "--port", str(port),
               "--weights", args.weights, "--device", args.device, "--engine", args.engine,
               "--decode-tokens", str(args.decode_tokens),
               "--max-wait-ms", str(args.max_wait_ms)]
    if args.batching:
        command += ["--batching", args.batching]
    if args.lanes:
        command += ["--lanes", args.lanes]
    if args.scheduling:
        command += ["--scheduling", args.scheduling]
    if args.int8:
        command.append("--int8")
    process = subprocess.Popen(command, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            http_json(f"{url}/health", timeout=2)
            return process, url
        except (urllib.error.URLError, ConnectionError):
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise SystemExit("aiayn serve did not start") from None
            time.sleep(0.2)


def rss_mb(pid: int) -> float:
    """The resident memory of process ``pid`` and of its children (the server's lane
    processes) in MB (Linux /proc)."""
    total = 0.0
    for process in [pid, *children(pid)]:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{process}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
    return total or float("nan")


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, and theirs (Linux /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def cpu_seconds(pids: list[int]) -> float:
    """The CPU time (user and system) processes ``pids`` have used so far (Linux /proc)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def cpu_split(server: int) -> tuple[float, float, float]:
    """CPU seconds so far of the server's own process, of its lane processes, and of this
    process (the clients: nothing else runs here meanwhile)."""
    return cpu_seconds([server]), cpu_seconds(children(server)), time.process_time()


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, linear between the two nearest ranks (as numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class KeptConnection:
    """A client's HTTP/1.1 connection, kept open from one request to its next as
    ``requests.Session``, httpx and browsers keep theirs: neither side pays a new TCP
    connection a request. One per client thread (``kept``); a request that finds the
    connection closed by the server (idle too long) is sent again once on a new one."""

    def __init__(self, url: str, timeout: float):
        host, port = url.removeprefix("http://").split(":")
        self.connection = http.client.HTTPConnection(host, int(port), timeout=timeout)

    def json(self, method: str, path: str, body: dict | None = None) -> dict:
        """The answer's JSON; ConnectionError where its status is not 200."""
        data = None if body is None else json.dumps(body).encode()
        headers = {} if body is None else {"Content-Type": "application/json"}
        for attempt in range(2):
            try:
                self.connection.request(method, path, data, headers)
                response = self.connection.getresponse()
                answer = response.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.connection.close()
                if attempt:
                    raise
        if response.status != 200:
            raise ConnectionError(f"HTTP {response.status}")
        return json.loads(answer)


_kept = threading.local()  # each client thread's KeptConnection, by server URL


def kept(url: str, timeout: float = 300) -> KeptConnection:
    """This thread's kept connection to ``url``."""
    connections = _kept.__dict__.setdefault("by_url", {})
    if url not in connections:
        connections[url] = KeptConnection(url, timeout)
    return connections[url]


def ask(url: str, sentence: str, beam: int, alpha: float, keep_alive: bool = True
        ) -> tuple[str | None, float]:
    """One POST /translate of one sentence: its translation (None: lost) and latency.
    ``keep_alive``: over this thread's kept connection (``kept``), else a new one."""
    body = {"text": [sentence], "beam": beam, "alpha": alpha}
    start = time.perf_counter()
    try:
        answer = (kept(url).json("POST", "/translate", body) if keep_alive
                  else http_json(f"{url}/translate", body))
        text = answer["translations"][0]
    except (OSError, http.client.HTTPException, KeyError, ValueError):
        text = None  # URLError, ConnectionError and TimeoutError are OSErrors
    return text, time.perf_counter() - start


class Clients:
    """K clients of POST /translate, one sentence a request, each sending its next when its
    last is answered, over a connection kept open from one request to its next (HTTP/1.1
    keep-alive, as client libraries keep theirs) or a new one a request (``keep_alive``).

    All K from one thread (``selectors``), each answer read as any client reads it (status
    line, Content-Length, the JSON body): the clients share the cores with the server they
    measure, and a thread a client (``http.client``, Python's lock handed between them at
    every socket call) costs those cores several times what this loop does (the CPU column
    of docs/results.md#serving-under-load)."""

    def __init__(self, url: str, beam: int, alpha: float, keep_alive: bool = True,
                 timeout: float = 300):
        host, port = url.removeprefix("http://").split(":")
        self.address, self.settings = (host, int(port)), {"beam": beam, "alpha": alpha}
        self.keep_alive, self.timeout = keep_alive, timeout
        self.head = (f"POST /translate HTTP/1.1\r\nHost: {host}:{port}\r\n"
                     "Content-Type: application/json\r\n"
                     + ("" if keep_alive else "Connection: close\r\n")).encode()

    def run(self, jobs: Iterator[tuple[int, str]], clients: int
            ) -> list[tuple[int, str | None, float]]:
        """Send the sentence of every (id, sentence) of ``jobs``, taken as clients are free,
        ``clients`` at a time: (id, its translation or None where lost, seconds), in the
        order answered."""
        # Each connection's data: [(id, sentence), sent at, the answer so far, sent again]
        selector = selectors.DefaultSelector()
        done: list[tuple[int, str | None, float]] = []

        def send(sock: socket.socket | None, job: tuple[int, str], retried: bool = False
                 ) -> bool:
            """``job``'s request over ``sock`` (kept, registered) or a new connection; False
            where it could not be sent (counted lost)."""
            body = json.dumps({"text": [job[1]], **self.settings}).encode()
            request = self.head + b"Content-Length: %d\r\n\r\n" % len(body) + body
            kept = sock is not None
            try:
                if not kept:
                    sock = socket.create_connection(self.address, timeout=self.timeout)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.sendall(request)
            except OSError:  # a kept connection the server closed (idle): once more, anew
                if kept:
                    hang_up(sock)
                    if not retried:
                        return send(None, job, retried=True)
                done.append((job[0], None, 0.0))
                return False
            state = [job, time.perf_counter(), bytearray(), retried]
            if kept:
                selector.modify(sock, selectors.EVENT_READ, state)  # no system call
            else:
                selector.register(sock, selectors.EVENT_READ, state)
            return True

        def hang_up(sock: socket.socket) -> None:
            selector.unregister(sock)
            sock.close()

        def next_request(sock: socket.socket | None) -> None:
            """The next job that can be sent (a loop, not a recursion: a server that is
            gone loses every job), over ``sock`` where it is kept; none left: it closes."""
            if sock is not None and not self.keep_alive:
                hang_up(sock)
                sock = None
            for job in jobs:
                if send(sock, job):
                    return
                sock = None  # a kept one that failed is closed
            if sock is not None:
                hang_up(sock)

        def answered(sock: socket.socket, state: list, text: str | None, reuse: bool) -> None:
            done.append((state[0][0], text, time.perf_counter() - state[1]))
            if not reuse:
                hang_up(sock)
            next_request(sock if reuse else None)

        for _ in range(clients):
            next_request(None)
        while selector.get_map():
            for key, _ in selector.select(timeout=1.0):
                sock, state = key.fileobj, key.data
                try:
                    data = sock.recv(1 << 16)
                except OSError:
                    data = b""
                if not data:  # closed by the server: a kept connection idle too long, once
                    hang_up(sock)
                    if not state[2] and not state[3] and self.keep_alive:
                        if send(None, state[0], retried=True):  # (a failed one counts lost)
                            continue
                    else:
                        done.append((state[0][0], None, time.perf_counter() - state[1]))
                    next_request(None)
                    continue
                state[2] += data
                answer = _http_answer(state[2])
                if answer is not None:
                    status, body, close = answer
                    try:
                        text = json.loads(body)["translations"][0] if status == 200 else None
                    except (ValueError, KeyError, IndexError):
                        text = None
                    answered(sock, state, text, self.keep_alive and not close)
            now = time.perf_counter()
            for key in list(selector.get_map().values()):
                if now - key.data[1] > self.timeout:
                    answered(key.fileobj, key.data, None, reuse=False)
        selector.close()
        return done


def _http_answer(data: bytearray) -> tuple[int, bytes, bool] | None:
    """An HTTP/1.1 answer with a Content-Length as (status, body, whether the server closes
    the connection), once ``data`` holds all of it; None before."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = bytes(data[:end]).decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(":", 1) for line in lines[1:] if ":" in line)
    length = int(headers.get("content-length", "0"))
    if len(data) < end + 4 + length:
        return None
    return (int(lines[0].split()[1]), bytes(data[end + 4:end + 4 + length]),
            "close" in headers.get("connection", ""))


def load(url: str, sentences: list[str], clients: int, beam: int, alpha: float,
         keep_alive: bool = True) -> tuple[list[str | None], list[float], float]:
    """Each sentence as its own request, ``clients`` at a time (``Clients``): answers and
    latencies in the order of ``sentences``, and the wall time."""
    start = time.perf_counter()
    done = sorted(Clients(url, beam, alpha, keep_alive).run(enumerate(sentences), clients))
    wall = time.perf_counter() - start
    return [text for _, text, _ in done], [seconds for _, _, seconds in done], wall


def pass_summary(before: dict, after: dict) -> dict:
    """What the server decoded between two GET /stats, in words ("together"): sentences per
    decoding step and requests that joined a running search (continuous batching), or
    requests per pass and the largest (per pass: the CTranslate2 engine); and the mean wait
    before decoding."""
    requests = after["requests"] - before["requests"]
    wait_ms = 1000 * (after["wait_s"] - before["wait_s"]) / max(requests, 1)
    if after.get("batching") == "continuous":
        steps = after["steps"] - before["steps"]
        per_step = (after["step_sentences"] - before["step_sentences"]) / max(steps, 1)
        joins = after["joins"] - before["joins"]
        return {"together": f"{per_step:.1f} sentences/step, {joins} joins",
                "mean_wait_ms": wait_ms}
    passes = after["passes"] - before["passes"]
    sizes = [int(k) for k, v in after["pass_requests"].items()
             if v > before["pass_requests"].get(k, 0)]
    per_pass = requests / passes if passes else 0.0
    return {"together": f"{per_pass:.1f} requests/pass ({max(sizes, default=0)})",
            "mean_wait_ms": wait_ms}


def hang_up(url: str, sentences: list[str], beam: int, alpha: float) -> None:
    """Send a POST /translate and close the connection without reading the answer."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"text": sentences, "beam": beam, "alpha": alpha}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /translate HTTP/1.1\r\nHost: " + host.encode() +
                     b"\r\nContent-Type: application/json\r\nContent-Length: " +
                     str(len(body)).encode() + b"\r\n\r\n" + body)


def soak(url: str, pid: int, sentences: list[str], expected: dict[str, str], args) -> dict:
    """``args.soak_clients`` polite clients and one that hangs up, for ``args.soak`` seconds."""
    stop = time.monotonic() + args.soak
    sent: list[str] = []  # the polite clients' sentences, by request
    answers: list[tuple[int, str | None, float]] = []
    hung_up = [0]

    def jobs() -> Iterator[tuple[int, str]]:
        rng = random.Random(0)
        while time.monotonic() < stop:
            sent.append(rng.choice(sentences))
            yield len(sent) - 1, sent[-1]

    def polite() -> None:
        clients = Clients(url, args.beam, args.alpha, args.keep_alive)
        answers.extend(clients.run(jobs(), args.soak_clients))

    def rude() -> None:
        rng = random.Random(-1)
        while time.monotonic() < stop:
            hang_up(url, rng.sample(sentences, 8), args.beam, args.alpha)
            hung_up[0] += 1
            time.sleep(0.5)  # a request every half second: a steady trickle, not a flood

    before = http_json(f"{url}/stats")
    rss = [rss_mb(pid)]
    threads = [threading.Thread(target=polite), threading.Thread(target=rude)]
    for thread in threads:
        thread.start()
    while time.monotonic() < stop:
        time.sleep(min(10.0, stop - time.monotonic()))
        rss.append(rss_mb(pid))
    for thread in threads:
        thread.join()
    rss.append(rss_mb(pid))
    after = http_json(f"{url}/stats")
    results = [(text is not None, text == expected[sent[i]], seconds)  # answered, correct
               for i, text, seconds in answers]
    seconds = [s for _, _, s in results]
    return {"requests": len(results), "answered": sum(answered for answered, _, _ in results),
            "correct": sum(ok for _, ok, _ in results),
            "hung_up": hung_up[0], "dropped": after["dropped"] - before["dropped"],
            "abandoned": after.get("abandoned", 0) - before.get("abandoned", 0),
            "rps": len(results) / args.soak,
            "p50": percentile(seconds, 50), "p95": percentile(seconds, 95),
            "p99": percentile(seconds, 99), "rss_mb": rss,
            "health": http_json(f"{url}/health")["status"]}


def offline_rate(translator: Translator, sentences: list[str], args) -> tuple[float, float]:
    """The reference: sentences/s of all of them decoded as one batch, in-process, and the
    CPU ms a sentence cost this process (every thread's: nothing else runs in it then)."""
    start, cpu = time.perf_counter(), time.process_time()
    translator.translate(sentences, translator.resolve(beam=args.beam, alpha=args.alpha))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return len(sentences) / seconds, 1000 * cpu / len(sentences)


class LanesAlone:
    """The second reference (module docstring): ``lanes`` processes, each with its own copy
    of the model on one thread as a lane process has, that decode their shares of the same
    sentences at the same time with K / L of them in flight (a new one joins as one is
    done, as the clients send their next), timed from a common start to the last done."""

    def __init__(self, args, lanes: int):
        context = multiprocessing.get_context("spawn")
        self.lanes, self.barrier = lanes, context.Barrier(lanes)
        self.pool = ProcessPoolExecutor(lanes, context, initializer=_lane_start,
                                        initargs=(args.run_dir, args.weights, args.int8,
                                                  args.beam, args.alpha, self.barrier))

    def rate(self, sentences: list[str], clients: int) -> tuple[float, float]:
        """Sentences/s of the lanes together at the load of ``clients`` clients, and the CPU
        ms a sentence cost them."""
        in_flight = math.ceil(clients / self.lanes)
        shares = [sentences[i::self.lanes] for i in range(self.lanes)]
        timed = list(self.pool.map(_lane_decode, shares, [in_flight] * self.lanes))
        return (len(sentences) / max(seconds for seconds, _ in timed),
                1000 * sum(cpu for _, cpu in timed) / len(sentences))

    def close(self) -> None:
        self.pool.shutdown()


_lane: dict = {}  # a LanesAlone process's translator, search and start barrier


def _lane_start(run_dir: str, weights: str, int8: bool, beam: int, alpha: float,
                barrier) -> None:
    torch.set_num_threads(1)
    translator = Translator.from_pretrained(run_dir, weights, int8=int8)
    _lane.update(translator=translator, search=translator.resolve(beam=beam, alpha=alpha),
                 barrier=barrier)


def _lane_decode(share: list[str], in_flight: int) -> tuple[float, float]:
    """Seconds to decode ``share`` as a lane does, ``in_flight`` sentences at a time,
    after every lane of the reference is ready (the barrier: one share per process), and
    the CPU seconds it took this process."""
    translator, search = _lane["translator"], _lane["search"]
    ids = translator.tokenizers.encode_src(translator.tagged(share))
    _lane["barrier"].wait(timeout=300)  # every lane ready: one share per process
    start, cpu = time.perf_counter(), time.process_time()
    lane = JoinableSearch(translator.model, search, translator.kernel)
    sent = done = 0
    with torch.inference_mode():  # as a lane's process holds it
        while done < len(ids):
            while sent < len(ids) and len(lane) < in_flight:
                lane.add([sent], pad([ids[sent]]))
                sent += 1
            done += len(lane.step())
    return time.perf_counter() - start, time.process_time() - cpu


def device_name(device: str) -> str:
    """The CPU's model, and on a GPU the GPU's name beside it (the server's Python runs on
    the CPU either way)."""
    if torch.device(device).type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CPU: {cpu_model()})"
    return cpu_model()


ABOUT = (
    "`benchmarks/serve_load.py` starts `aiayn serve RUN_DIR` on a free port of 127.0.0.1 "
    "(nothing else is contacted) and sends test-split sentences, each as its own `POST "
    "/translate` (beam 4, α 0.6), from 1, 8 and 32 concurrent clients, each keeping its "
    "connection open from one request to its next as client libraries do (HTTP/1.1 "
    "keep-alive; rows that say *a new connection a request* opened one each), checking every answer "
    "against the same sentence translated in-process (none lost, none wrong). The server "
    "decodes concurrent requests together, each joining the running search at its next step "
    "(see [Serving](serving.md)); *decoded together* is what it formed: the mean sentences "
    "per decoding step and the requests that joined a search under way, or, for rows of "
    "`--batching pass`, the requests per pass (and the largest). The reference, timed in "
    "the same run: the same sentences decoded offline as one batch by the `Translator`, the "
    "rate a server could approach, timed before and after each repeat of the server's runs "
    "(each repeat compares with the mean of its two; rows give the medians over the "
    "repeats): read the ratio. A second reference says how much of the gap is the "
    "server's: its lanes alone at each load, without the server (a process per lane, "
    "each decoding its share of the sentences at the same time by the search a lane runs, "
    "on one thread, with as many in flight as the clients keep in a lane). The CPU time "
    "a request cost, from /proc: the server's own process (HTTP, JSON, tokenizing, the "
    "queue), its lane processes (the model; with lanes as threads, a GPU's or a single "
    "lane's, the model counts in the server's), and the benchmark's clients, all on the same "
    "cores: where the server's rate falls short of its lanes'. /proc counts in 10 ms ticks: "
    "over 120 requests a figure is good to about 0.1 ms (the two lanes' to 0.2). On the "
    "reference rows that column is the CPU a sentence cost the offline batch (its process, "
    "every thread) and the lanes alone (their processes together): it moves less than a rate "
    "when a shared machine's speed swings, and the server's three figures against the "
    "batch's say what serving costs beside the model. *Cores held*: that CPU time over the "
    "wall time (the CPU a request cost times the requests a second), the share of the "
    "cores the row's processes had: a row's ratio is its share against the batch's times "
    "the batch's CPU a sentence against the row's a request, so the two columns say whether "
    "a gap is the cores a row got (another program on a core takes more from one than from "
    "another) or the CPU it spent. The soak row: "
    "steady load for minutes, "
    "with one more client that hangs up before each answer; the server's memory at the "
    "start, its least and most over the samples of the load (every 10 s from the first on: "
    "flat there means nothing leaks), and at the end. The model: a quiet `make demo` run on "
    "the rows' CPU (4.7M parameters).")
COLUMNS = [
    {"key": "who", "label": "translating"},
    *({"key": key, "label": label, "align": "right"} for key, label in [
        ("p50", "p50 ms"), ("p95", "p95 ms"), ("p99", "p99 ms"), ("rps", "requests/s"),
        ("ratio", "/ offline batch"), ("correct", "answered correctly"),
        ("batches", "decoded together"), ("wait", "mean wait ms"),
        ("cpu", "CPU ms a request: server, its lanes, the clients"),
        ("cores", "cores held"),
        ("memory", "server RSS: start → under load (least–most) → end")]),
]


def save(key: str, rows: list[dict], args) -> None:
    """Replace the rows of conditions ``key`` in RESULTS (the table docs/results.md shows),
    whose description and columns this script's are."""
    table = json.loads(RESULTS.read_text(encoding="utf-8"))
    table["about"], table["columns"] = ABOUT, COLUMNS
    table["rows"] = [r for r in table["rows"] if r["conditions"] != key] + \
        [{**row, "conditions": key} for row in rows]
    table["conditions"][key] = {
        "command": "python benchmarks/serve_load.py " + " ".join(sys.argv[1:]),
        "commit": git_commit(), "cpu": device_name(args.device), "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "load": f"{args.load}, {args.threads} torch threads"}
    RESULTS.write_text(json.dumps(table, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"saved {len(rows)} rows as {key!r} in {RESULTS}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; also what ``start_server`` reads (server_cost.py starts the server
    from it, so that a new server option has its default there too)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--data", metavar="DIR",
                        help="the prepared data whose test split is sent (default: the run's; "
                             "needed with --engine ctranslate2, an export names none)")
    parser.add_argument("--requests", type=int, default=120, help="requests per client count")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every client count this many times; medians are reported")
    parser.add_argument("--clients", default="1,8,32", help="concurrent clients, comma-separated")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=0.6)
    parser.add_argument("--weights", default="best")
    parser.add_argument("--engine", default="aiayn", choices=["aiayn", "ctranslate2"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="the server's and the reference's")
    parser.add_argument("--decode-tokens", type=int, default=8192, help="the server's")
    parser.add_argument("--max-wait-ms", type=float, default=5.0, help="the server's")
    parser.add_argument("--batching", choices=["continuous", "pass"],
                        help="the server's (default: its own)")
    parser.add_argument("--lanes", choices=["processes", "threads"],
                        help="the server's (default: its own)")
    parser.add_argument("--scheduling", choices=["batch", "inherited"],
                        help="the server's (default: its own)")
    parser.add_argument("--int8", action="store_true",
                        help="the server and the reference decoding in int8")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads of the server and of the reference")
    parser.add_argument("--connections", choices=["kept", "new"], default="kept",
                        help="each client's: one kept open from a request to its next (HTTP/1.1 "
                             "keep-alive, as client libraries do), or a new one a request")
    parser.add_argument("--soak", type=float, default=0.0, metavar="SECONDS",
                        help="instead: steady load for this long (see above)")
    parser.add_argument("--soak-clients", type=int, default=8)
    parser.add_argument("--save", metavar="KEY", help="write the rows to " + str(RESULTS))
    parser.add_argument("--load", default="quiet", help="--save: the machine's load, in words")
    args = parser.parse_args(argv)
    args.keep_alive = args.connections == "kept"
    return args


def main() -> None:
    args = parse_args()
    try:
        clients = [int(c) for c in args.clients.split(",")]
    except ValueError:
        raise SystemExit(f"--clients: comma-separated numbers, got {args.clients!r}") from None
    if not 1 <= args.repeats <= 10:
        raise SystemExit("--repeats must be in 1..10")
    if not 1 <= args.requests <= 10_000 or not all(1 <= c <= 64 for c in clients):
        raise SystemExit("--requests must be in 1..10000 and --clients in 1..64 (a bounded test)")
    if not 0 <= args.soak <= 3600 or not 1 <= args.soak_clients <= 64:
        raise SystemExit("--soak must be in 0..3600 seconds and --soak-clients in 1..64")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device cuda: this torch ({torch.__version__}) sees no CUDA GPU")

    try:
        test = (Path(args.data) if args.data else read_data_dir(args.run_dir)) / "test.jsonl"
    except AiaynError as e:
        raise SystemExit(f"{e}") from None
    if not test.is_file():
        raise SystemExit(f"--data: {test} not found (a directory from `aiayn prepare`)")
    pairs = [json.loads(line) for line in test.read_text(encoding="utf-8").splitlines() if line]
    sentences = [pairs[i % len(pairs)]["src"] for i in range(args.requests)]

    torch.set_num_threads(args.threads)
    translator = Translator.from_pretrained(args.run_dir, args.weights, device=args.device,
                                            engine=args.engine,
                                            decode_tokens=args.decode_tokens, int8=args.int8)
    search = translator.resolve(beam=args.beam, alpha=args.alpha)
    translator.translate(sentences[:8], search)  # warm-up
    expected = translator.translate(sentences, search)
    offline = offline_rate(translator, sentences, args)

    print(f"aiayn serve load test: {args.run_dir} ({args.weights}, {args.engine}), beam "
          f"{args.beam}, alpha {args.alpha}, {args.threads} torch thread(s), server "
          f"--decode-tokens {args.decode_tokens} --max-wait-ms {args.max_wait_ms:g}; "
          f"{device_name(args.device)}")
    process, url = start_server(args)
    rows, failed = [], False
    lanes_alone: LanesAlone | None = None
    try:
        http_json(f"{url}/translate", {"text": sentences[:2], "beam": args.beam})  # warm-up
        if args.soak:
            result = soak(url, process.pid, sentences, dict(zip(sentences, expected)), args)
            rss = result["rss_mb"]
            loaded = rss[1:-1] or rss  # the samples taken under load (the last: after it)
            print(f"soak: {args.soak:g} s, {args.soak_clients} clients + one that hung up "
                  f"{result['hung_up']} times ({result['dropped']} of those requests dropped "
                  f"before decoding, {result['abandoned']} taken out mid-search): "
                  f"{result['answered']}/{result['requests']} answered, "
                  f"{result['correct']} correctly, "
                  f"{result['rps']:.1f} requests/s, p50 "
                  f"{1000 * result['p50']:.0f} ms, p95 {1000 * result['p95']:.0f} ms, p99 "
                  f"{1000 * result['p99']:.0f} ms; server RSS {rss[0]:.0f} MB at the start, "
                  f"{rss[-1]:.0f} MB at the end (every 10 s: "
                  f"{' '.join(f'{r:.0f}' for r in rss)}); /health {result['health']}")
            # int8: an answer may differ from the batch's, rarely (as above); a lost one fails.
            failed = (result["answered" if args.int8 else "correct"] < result["requests"]
                      or result["health"] != "ok")
            rows.append({"who": f"soak, {args.soak:g} s: {args.soak_clients} clients and one "
                                f"that hangs up ({result['hung_up']} times: {result['dropped']} "
                                f"dropped before decoding, {result['abandoned']} taken out "
                                "mid-search)" + ("" if args.keep_alive else
                                                 ", a new connection a request"),
                         "p50": round(1000 * result["p50"]), "p95": round(1000 * result["p95"]),
                         "p99": round(1000 * result["p99"]), "rps": round(result["rps"], 1),
                         "correct": f"{result['correct']}/{result['requests']}" + (
                             f" (all {result['requests']} answered)"
                             if result["answered"] == result["requests"] else
                             f" ({result['answered']} answered)"),
                         "memory": f"{rss[0]:.0f} → {min(loaded):.0f}–{max(loaded):.0f} → "
                                   f"{rss[-1]:.0f} MB"})
        else:
            # Each repeat runs every client count in turn, then times the reference again
            # with the server idle; a repeat compares with the mean of the references
            # before and after it (a shared machine's speed drifts within minutes), and a
            # row gives the medians over the repeats.
            runs: dict[int, list[dict]] = {k: [] for k in clients}
            alone: dict[int, list[tuple[float, float]]] = {k: [] for k in clients}  # LanesAlone
            references = [offline]
            for _ in range(args.repeats):
                for k in clients:
                    before, cpu_before = http_json(f"{url}/stats"), cpu_split(process.pid)
                    answers, latencies, wall = load(url, sentences, k, args.beam, args.alpha,
                                                      args.keep_alive)
                    after, cpu_after = http_json(f"{url}/stats"), cpu_split(process.pid)
                    passes = pass_summary(before, after)
                    correct = sum(a == e for a, e in zip(answers, expected))
                    # int8 rounding can make an answer depend on its batch (rarely: counted
                    # in the table, docs/translating.md#int8-decoding); a lost one fails.
                    failed |= (correct < len(sentences) if not args.int8
                               else any(a is None for a in answers))
                    runs[k].append({"latencies": latencies, "rps": len(sentences) / wall,
                                    "correct": correct, **passes,
                                    "cpu": [1000 * (b - a) / len(sentences)
                                            for a, b in zip(cpu_before, cpu_after)],
                                    "cores": sum(b - a for a, b in zip(cpu_before, cpu_after))
                                    / wall})
                    if after.get("batching") == "continuous" and args.device == "cpu":
                        lanes_alone = lanes_alone or LanesAlone(args, after["lanes"])
                        alone[k].append(lanes_alone.rate(sentences, k))
                references.append(offline_rate(translator, sentences, args))
            reference_of = [(a + b) / 2 for (a, _), (b, _) in zip(references, references[1:])]
            how = "".join(f", {name} {value}" for name, value in
                          [("batching", args.batching), ("lanes", args.lanes),
                           ("scheduling", args.scheduling)] if value)
            how += ", --int8" if args.int8 else ""
            connections = "" if args.keep_alive else ", a new connection a request"
            of = f", median of {args.repeats}" if args.repeats > 1 else ""
            for k in clients:
                done = runs[k]
                ratio = statistics.median(r["rps"] / ref for r, ref in zip(done, reference_of))
                rows.append({"who": f"the server, {k} concurrent client{'s' * (k > 1)}{how}"
                                    f"{connections}{of}",
                             **{f"p{q}": round(1000 * statistics.median(
                                 percentile(r["latencies"], q) for r in done))
                                for q in (50, 95, 99)},
                             "rps": round(statistics.median(r["rps"] for r in done), 1),
                             "ratio": f"{ratio:.2f}",
                             "correct": f"{sum(r['correct'] for r in done)}/"
                                        f"{len(sentences) * len(done)}",
                             "batches": done[len(done) // 2]["together"],
                             "cpu": ", ".join(f"{statistics.median(r['cpu'][i] for r in done):.2f}"
                                              for i in range(3)),
                             "wait": round(statistics.median(r["mean_wait_ms"] for r in done)),
                             "cores": f"{statistics.median(r['cores'] for r in done):.2f}"})
            for k in clients:
                if not alone[k]:
                    continue
                ratio = statistics.median(r / ref for (r, _), ref in zip(alone[k], reference_of))
                lanes = lanes_alone.lanes
                rows.append({"who": f"reference: the server's {lanes} lanes alone at {k} "
                                    f"client{'s' * (k > 1)}' load, no server (a process per "
                                    f"lane, one thread each, {math.ceil(k / lanes)} sentences "
                                    f"in flight in each){how}{of}",
                             "rps": round(statistics.median(r for r, _ in alone[k]), 1),
                             "ratio": f"{ratio:.2f}",
                             "cpu": f"{statistics.median(cpu for _, cpu in alone[k]):.2f}",
                             "cores": f"{statistics.median(r * cpu / 1000 for r, cpu in alone[k]):.2f}"})
            timed = ", ".join(f"{r:.1f}" for r, _ in references)
            rows.append({"who": f"reference: the same sentences as one batch, in-process "
                                f"(`Translator.translate`; timed before and after each repeat: "
                                f"{timed})",
                         "rps": round(statistics.median(reference_of), 1), "ratio": "1.00",
                         "cpu": f"{statistics.median(cpu for _, cpu in references):.2f}",
                         "cores": f"{statistics.median(r * cpu / 1000 for r, cpu in references):.2f}"})
            print("| | p50 ms | p95 ms | p99 ms | requests/s | / offline | correct | "
                  "decoded together | mean wait ms | CPU ms a request: server, lanes, clients | "
                  "cores held |")
            print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
            for row in rows:
                print("| " + " | ".join(str(row.get(key, "")) for key in (
                    "who", "p50", "p95", "p99", "rps", "ratio", "correct", "batches", "wait",
                    "cpu", "cores")) + " |")
    finally:
        if lanes_alone is not None:
            lanes_alone.close()
        process.terminate()
        process.wait(timeout=30)
    if args.save:
        save(args.save, rows, args)
    if failed:
        raise SystemExit("some requests were lost or answered wrongly")


if __name__ == "__main__":
    main()
