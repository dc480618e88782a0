"""The lanes of continuous batching (aiayn.serving.lanes) as processes of their own: each
answer as alone, a process that dies replaced, a forgotten request taken out; bad lane
settings refused in one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import pickle
import random
import re
import select
import signal
import socket
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'aiayn[serve]'")
from fastapi.testclient import TestClient  # noqa: E402
from helpers import random_sentence  # noqa: E402
from serve_helpers import (  # noqa: E402
    MIXED,
    assert_clean_error,
    assert_same_answer,
    expected_answer,
    send_while_held,
    until,
)

from aiayn.config import load_config  # noqa: E402
from aiayn.errors import AiaynError  # noqa: E402
from aiayn.inference.joinable import JoinableSearch  # noqa: E402
from aiayn.inference.search import Search  # noqa: E402
from aiayn.inference.translator import Translator  # noqa: E402
from aiayn.serving.app import create_app  # noqa: E402
from aiayn.serving.batcher import Batcher  # noqa: E402
from aiayn.serving.lanes import LaneProcess, LaneSearches  # noqa: E402
from aiayn.serving.service import ModelService, ServeLimits, serve_info  # noqa: E402


def assert_decodes_as_alone(batcher: Batcher, translator: Translator, hyps=None) -> None:
    """"red green" through ``batcher`` (or ``hyps``, its answer already) at beam 2 gives
    the translator's own translation."""
    sources = translator.prepare(["red green"])
    if hyps is None:
        hyps, _ = batcher.translate(sources, Search(2, 0.6)).result(timeout=60)
    assert translator.finish(sources, hyps, 1)[0][0][0] == \
        translator.translate(["red green"], translator.resolve(beam=2, alpha=0.6))[0]


def lane_processes(service: ModelService) -> list:
    """The lane processes of ``service`` that are alive."""
    return [lane.searches.process for lane in service.batcher._lanes
            if lane.searches.remote and lane.searches.process.is_alive()]


def process_lanes_service(run_dir) -> ModelService:
    """Two lanes, each a process of its own (what `aiayn serve` runs on a CPU of two or
    more cores; the tests' one torch thread would give one lane, a thread)."""
    translator = Translator.from_pretrained(run_dir, streams=2)
    config = load_config(run_dir / "config.yaml")
    return ModelService(translator, config, serve_info(run_dir, "best", config, translator),
                        lanes="processes")


def test_lanes_in_processes_answer_each_request_as_alone(run_dir, translator):
    """Mixed requests queued together, then many sent at once from eight clients (joining
    searches under way in both processes): every answer is the one it gets alone. Closing
    the service ends the processes."""
    service = process_lanes_service(run_dir)
    client = TestClient(create_app(service, ServeLimits(max_sentences=8)))
    try:
        assert len(lane_processes(service)) == 2 and service.stats()["lanes"] == 2
        assert all(lane.searches.ready for lane in service.batcher._lanes)  # before any request
        responses = send_while_held(service, client, MIXED)
        assert_clean_error(responses[-1], 413, "9 sentences in one request")
        for (body, search), response in zip(MIXED[:-1], responses, strict=False):
            assert response.status_code == 200, response.text
            assert_same_answer(response.json(), *expected_answer(translator, body, search))
        rng = random.Random(5)
        bodies = [{"text": [random_sentence(rng) for _ in range(rng.randint(1, 3))],
                   "beam": rng.choice([1, 4]), "alpha": 0.6} for _ in range(24)]
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda b: client.post("/translate", json=b), bodies))
        for body, response in zip(bodies, answers, strict=True):
            assert response.status_code == 200, response.text
            assert_same_answer(response.json(),
                               *expected_answer(translator, body, (body["beam"], 0.6)))
        stats = service.stats()
        assert stats["joins"] > 0 and stats["requests"] == len(MIXED) - 1 + len(bodies)
    finally:
        service.close()
    assert not lane_processes(service)


def test_a_lane_answers_each_sentence_with_its_own_requests_nbest(translator):
    """Requests that differ only in nbest share a search (``Search`` leaves nbest out of
    equality); the lane sends back each sentence's own nbest hypotheses, no more (the rest
    would only be pickled and dropped), and they are the first of that search's list."""
    texts = ["red green blue", "sun moon star tree"]
    search = Search(4, 0.6, nbest=1)
    sources = translator.prepare(texts)
    lane = LaneSearches(translator.model)
    done = dict(lane.round([(search, [7, 8], sources.ids, [[], []], [1, 3])]).done)
    for _ in range(200):
        if len(done) == 2:
            break
        done.update(lane.round([]).done)
    assert [len(done[7]), len(done[8])] == [1, 3]
    full = translator.translate_nbest(texts, translator.resolve(beam=4, alpha=0.6, nbest=4))
    for key, want in ((7, full[0]), (8, full[1])):
        got = translator.finish(translator.prepare([texts[key - 7]]), [done[key]], 4)[0]
        assert [text for text, _ in got] == [text for text, _ in want[:len(got)]]
        assert [score for _, score in got] == pytest.approx(
            [score for _, score in want[:len(got)]], abs=1e-5)


def test_a_lanes_searches_share_one_copy_of_the_output_layer(translator, monkeypatch):
    """Selecting a restricted output layer's rows copies them: a lane selects them once, for
    its first search, and every other search, and a search that emptied and started again,
    reads the same copy; the sentences of each are answered as before."""
    real, copies = translator.model.generator.allowed_rows, []
    monkeypatch.setattr(translator.model.generator, "allowed_rows",
                        lambda *a, **k: copies.append(1) or real(*a, **k))
    lane, searches = LaneSearches(translator.model), [Search(2, 0.6), Search(3, 0.6)]
    texts = ["red green blue", "sun moon star tree"]
    sources = translator.prepare(texts)
    done, rows = {}, []
    for turn in range(2):  # the second turn's searches start after the first's emptied
        keys = [10 * turn + 1, 10 * turn + 2]
        adds = [(search, [key], [ids], [[]], [1]) for search, key, ids in zip(searches, keys, sources.ids)]
        done.update(lane.round(adds).done)
        for _ in range(200):
            rows.extend(s.state.rows[0] for s in lane.searches.values())
            if all(key in done for key in keys):
                break
            done.update(lane.round([]).done)
        assert not lane.searches  # every search emptied
    assert len(copies) == 1 and all(r is rows[0] for r in rows)
    want = [translator.translate_nbest([text], translator.resolve(beam=search.beam, alpha=0.6))[0][0]
            for search, text in zip(searches, texts)]
    for key in (1, 2, 11, 12):
        got = translator.finish(translator.prepare([texts[key % 10 - 1]]), [done[key]], 1)[0][0]
        assert got[0] == want[key % 10 - 1][0]


def test_the_jobs_of_one_search_in_a_round_join_it_in_one_add(translator, monkeypatch):
    """Jobs of the same search that arrive between two steps join it together (one add:
    one encoding, one join of the cache), each sentence answered as alone; a job that
    cannot join (a prefix of an id the model has not got) fails alone, the others join."""
    real, adds = JoinableSearch.add, []
    monkeypatch.setattr(JoinableSearch, "add",
                        lambda self, keys, *a, **k: adds.append(list(keys)) or real(self, keys, *a, **k))
    lane, search = LaneSearches(translator.model), Search(2, 0.6)
    ids = translator.prepare(["red green", "sun moon", "blue"]).ids
    first = lane.round([(search, [1], ids[:1], [[]], [1]), (search, [2], ids[1:2], [[]], [1])])
    assert adds == [[1, 2]] and not first.failed
    adds.clear()
    second = lane.round([(search, [3], ids[2:], [[]], [1]), (search, [4], ids[:1], [[10 ** 6]], [1])])
    assert adds == [[3, 4], [3], [4]] and [ids for ids, _ in second.failed] == [[4]]
    adds.clear()
    again = lane.round([(search, [5], ids[:1], [[]], [1]), (search, [5], ids[1:2], [[]], [1])])
    assert adds == [[5, 5], [5], [5]] and [ids for ids, _ in again.failed] == [[5]]  # once only
    done = dict(first.done) | dict(second.done) | dict(again.done)
    done.update(lane.round([], removes=[5]).done)
    for _ in range(200):
        if len(done) == 3:
            break
        done.update(lane.round([]).done)
    for key, text in ((1, "red green"), (2, "sun moon"), (3, "blue")):
        got = translator.finish(translator.prepare([text]), [done[key]], 1)[0][0][0]
        assert got == translator.translate([text], translator.resolve(beam=2, alpha=0.6))[0]


def test_a_lane_given_its_pipe_takes_quiet_steps_several_to_a_call(run_dir):
    """With its pipe as ``wake`` (as a lane's process steps), an int8 lane takes a search's
    steps several to a round while nothing ends and nothing arrives: the same answers as a
    step a round, in as many steps (``Round.steps``, what /stats counts) over fewer rounds;
    with something to read on the pipe, a step a round."""
    translator = Translator.from_pretrained(run_dir, int8=True)
    search = Search(4, 0.6)
    texts = [" ".join(["red green blue"] * 4), "sun moon star tree river", "blue", "tree sun"]
    sources = translator.prepare(texts).ids

    def decoded(wake: int | None) -> tuple[dict, int, int]:
        lane = LaneSearches(translator.model, kernel=translator.kernel)
        rounds = [lane.round([(search, [0, 1, 2, 3], sources, [[]] * 4, [4] * 4)], wake=wake)]
        while len(done := {k: h for r in rounds for k, h in r.done}) < len(texts):
            rounds.append(lane.round([], wake=wake))
        return done, sum(r.steps for r in rounds), len(rounds)

    quiet, woken = os.pipe(), os.pipe()
    os.write(woken[1], b"x")
    try:
        alone, steps, rounds = decoded(None)
        together, together_steps, fewer = decoded(quiet[0])
        interrupted, _, each = decoded(woken[0])
    finally:
        for fd in (*quiet, *woken):
            os.close(fd)
    assert together == alone == interrupted and together_steps == steps
    assert fewer < rounds == each == steps


def test_a_sentence_whose_add_failed_midway_does_not_stop_its_lane(translator, monkeypatch):
    """An add that fails after its rows joined the search fails its sentences (the server
    answers their requests with the error); should such a sentence still finish, the lane
    reports it like any other (the server drops it: no request owns it) and goes on."""
    real = JoinableSearch.add

    def add_then_fail(self, *args, **kwargs):
        real(self, *args, **kwargs)
        raise RuntimeError("failed after joining")

    lane = LaneSearches(translator.model)
    search = Search(2, 0.6)
    monkeypatch.setattr(JoinableSearch, "add", add_then_fail)
    first = lane.round([(search, [1], translator.prepare(["red green"]).ids, [[]], [1])])
    monkeypatch.setattr(JoinableSearch, "add", real)
    assert [ids for ids, _ in first.failed] == [[1]]
    done = dict(first.done)
    lane.round([(search, [2], translator.prepare(["sun moon"]).ids, [[]], [1])])
    for _ in range(200):
        if 1 in done and 2 in done:
            break
        done.update(lane.round([]).done)
    assert len(done[2]) == 1 and len(done[1]) >= 1


def test_a_job_that_arrives_while_lanes_decode_goes_to_a_lane_from_its_own_thread(
        run_dir, translator):
    """An idle server's first job waits on a lane's thread (for others to start with it);
    one that arrives while something decodes is sent to the lane process holding least by
    the thread that submits it (``Batcher._lane_taking_now``: no wakeup of a lane's thread),
    unless that lane's pipe is busy (a send or a new child's start): then the submitting
    thread does not wait, and the lane's thread sends it. The answers are those alone."""
    service = process_lanes_service(run_dir)
    batcher, sends = service.batcher, []
    for lane in batcher._lanes:
        def send(adds, removes=(), wait=True, send=lane.searches.send):
            sent = send(adds, removes, wait)
            sends.append((threading.current_thread().name, sent))
            return sent
        lane.searches.send = send
    processes = [lane.searches.process for lane in batcher._lanes]
    search = translator.resolve(beam=2)
    texts = ["red green", "black sun", "white star moon"]
    here = threading.current_thread().name
    try:
        for process in processes:  # frozen: the jobs stay in their lanes
            os.kill(process.pid, signal.SIGSTOP)
        futures = [batcher.translate(translator.prepare(texts[:1]), search)]
        until(lambda: sends, "the first job sent")
        futures.append(batcher.translate(translator.prepare(texts[1:2]), search))
        assert sends[0][0].startswith("aiayn-batcher-") and sends[1:] == [(here, True)]
        assert [lane.load > 0 for lane in batcher._lanes] == [True, True]  # the other lane
        busy = min(batcher._lanes, key=lambda lane: lane.load)
        with busy.searches._lock:  # its pipe held: the third job is left to its thread
            futures.append(batcher.translate(translator.prepare(texts[2:]), search))
            assert sends[2] == (here, False)
        until(lambda: len(sends) == 4, "the lane's thread to send the third job")
        assert sends[3][0].startswith("aiayn-batcher-") and sends[3][1] and not busy.unsent
        for process in processes:
            os.kill(process.pid, signal.SIGCONT)
        answers = [translator.translations(translator.prepare([text]), future.result(60)[0],
                                           1)[0][0].text
                   for text, future in zip(texts, futures, strict=True)]
        assert answers == translator.translate(texts, search)
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)
        service.close()


def kill_the_lane_holding(service: ModelService, client, body: dict,
                          meanwhile=lambda: None) -> tuple:
    """Freeze every lane process, send ``body`` (it waits in the lane that takes it), kill
    the process that holds it and resume the others: its response and that lane. Calls
    ``meanwhile()`` once the response came, before the others resume."""
    lanes = service.batcher._lanes
    processes = [lane.searches.process for lane in lanes]
    try:
        for process in processes:
            os.kill(process.pid, signal.SIGSTOP)
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(client.post, "/translate", json=body)
            until(lambda: any(lane.owners for lane in lanes), "a lane to take the request")
            holder = next(lane for lane in lanes if lane.owners)
            os.kill(holder.searches.process.pid, signal.SIGKILL)
            response = sent.result(timeout=60)
            meanwhile()
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)
    return response, holder.searches


def test_a_lane_process_that_dies_is_replaced_and_costs_only_its_requests_a_503(run_dir,
                                                                              translator):
    """A process that ended while it held nothing is replaced unnoticed; one that ends
    while it decodes a request costs that request a 503 with one line, and is replaced."""
    service = process_lanes_service(run_dir)
    client = TestClient(create_app(service), raise_server_exceptions=False)
    body = {"text": ["red green"], "beam": 2}
    expected = translator.translate(["red green"], translator.resolve(beam=2))
    try:
        lanes = [lane.searches for lane in service.batcher._lanes]
        ended = [lane.process for lane in lanes]
        for process in ended:
            os.kill(process.pid, signal.SIGKILL)
            process.join()
        until(lambda: all(lane.process not in ended for lane in lanes), "new processes")
        for _ in range(3):
            assert client.post("/translate", json=body).json()["translations"] == expected
        response, _ = kill_the_lane_holding(service, client, body)
        assert_clean_error(response, 503, "a decoding process of the server ended "
                                          "(exit code -9) with this request's sentences")
        assert [client.post("/translate", json=body).json()["translations"]
                for _ in range(3)] == [expected] * 3
        assert service.stats()["requests"] == 7
    finally:
        service.close()
    assert not lane_processes(service)


def test_a_lane_process_takes_out_the_sentences_of_a_request_whose_client_hung_up(
        run_dir, translator):
    """Sent to a lane's process while it is frozen and forgotten before it wakes, a request
    is never stepped there (its sentences leave before the next step); the lane goes on."""
    service = process_lanes_service(run_dir)
    batcher = service.batcher
    processes = [lane.searches.process for lane in batcher._lanes]
    try:
        for process in processes:
            os.kill(process.pid, signal.SIGSTOP)
        gone = batcher.translate(translator.prepare(["sun moon star tree river"]),
                                 Search(4, 0.6))
        until(lambda: any(lane.owners for lane in batcher._lanes), "a lane to take it")
        batcher.forget(gone)

        def removal_sent() -> bool:  # the lane's thread has taken the removal and sent it
            with batcher._changed:
                return not any(lane.removes for lane in batcher._lanes) and not batcher._stepping

        until(removal_sent, "the lane's thread to send the removal")
        for process in processes:
            os.kill(process.pid, signal.SIGCONT)
        until(lambda: service.stats()["passes"] == 1, "the lane to report its search ended")
        stats = service.stats()
        assert stats["abandoned"] == 1 and stats["steps"] == 0 and batcher._load == 0
        assert_decodes_as_alone(batcher, translator)
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)
        service.close()


@pytest.mark.parametrize("lanes, device, batching, words", [
    ("cores", "cpu", "continuous", "--lanes must be one of processes, threads, got 'cores'"),
    ("processes", "cpu", "pass", "--lanes is for continuous batching"),
    ("processes", "meta", "continuous", "--lanes processes is for a CPU"),
])
def test_bad_lanes_are_refused_in_one_line(run_dir, lanes, device, batching, words):
    translator = Translator.from_pretrained(run_dir, streams=2)
    translator.device = torch.device(device)  # only checked, never decoded on
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(AiaynError, match=re.escape(words)):
        Batcher(translator, batching=batching, lanes=lanes)
    assert {p.pid for p in multiprocessing.active_children()} == before  # none started


def test_lane_processes_decode_in_int8_as_the_server_does(run_dir):
    """With int8 (aiayn.inference.int8) each lane process packs its decoder and output layer from
    the weights it gets: the answers are the in-process int8 translator's. Not to the last bit:
    int8 rounding can turn fp32's last-bit differences between batches into a different
    integer (docs/translating.md#int8-decoding), so the scores within 0.05; the translations
    of this model, which copies its input, with margins far above that."""
    translator = Translator.from_pretrained(run_dir, streams=2, int8=True)
    config = load_config(run_dir / "config.yaml")
    service = ModelService(translator, config, serve_info(run_dir, "best", config, translator),
                           lanes="processes")
    client = TestClient(create_app(service))
    try:
        assert len(lane_processes(service)) == 2
        rng = random.Random(8)
        bodies = [{"text": [random_sentence(rng) for _ in range(rng.randint(1, 3))],
                   "beam": 4, "alpha": 0.6} for _ in range(12)]
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda b: client.post("/translate", json=b), bodies))
        for body, response in zip(bodies, answers, strict=True):
            assert response.status_code == 200, response.text
            hyps, _ = expected_answer(translator, body, (4, 0.6))
            answer = response.json()
            assert answer["translations"] == [h[0][0] for h in hyps]
            scores = [h["score"] for nbest in answer["nbest"] for h in nbest]
            assert np.allclose(scores, [s for h in hyps for _, s in h], atol=0.05)
    finally:
        service.close()


def test_a_lane_process_that_cannot_build_its_model_fails_the_start_in_one_line(translator):
    """A lane's process that cannot build its model (here its config and weights disagree)
    is not started again and again: waiting for it raises one line that says why."""
    model = translator.model

    class Mismatched:  # what LaneProcess reads of a model, with a config its weights do not fit
        cfg = dataclasses.replace(model.cfg, d_ff=model.cfg.d_ff + 8)
        state_dict = model.state_dict

    lane = LaneProcess(Mismatched(), False, on_result=lambda result: None,
                       on_lost=lambda exc: None)
    try:
        with pytest.raises(AiaynError, match="could not start: RuntimeError: .*size mismatch") as err:
            lane.wait_ready(timeout=120)
        assert "\n" not in str(err.value)
        assert not lane.ready and not lane.process.is_alive()
    finally:
        lane.close()


def reading_on_loop(service: ModelService) -> bool:
    """Whether an event loop, not a thread, reads every lane process's answers now."""
    return all(lane.searches._loop_reads for lane in service.batcher._lanes)


# Only Linux can say how much of a pipe is unread (SIOCOUTQ): elsewhere threads read.
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the event loop reads the lanes on Linux only")


@linux_only
def test_a_running_server_reads_the_lanes_answers_on_its_event_loop(run_dir, translator):
    """Once the app's loop starts (its lifespan), it reads the lane processes' answers
    itself: every answer is taken on the loop's thread, none by a thread of the lanes, and
    each is the one alone. When the loop stops, threads read again, and a job sent after it
    is answered."""
    service = process_lanes_service(run_dir)
    batcher, taken_on = service.batcher, []
    lane_result = batcher._lane_result

    def recording(lane, result):
        taken_on.append(threading.current_thread().name)
        lane_result(lane, result)

    batcher._lane_result = recording
    rng = random.Random(11)
    bodies = [{"text": [random_sentence(rng) for _ in range(rng.randint(1, 3))], "beam": 2}
              for _ in range(12)]
    try:
        with TestClient(create_app(service)) as client:
            until(lambda: reading_on_loop(service), "the loop to read the lanes")
            assert not any(lane.searches._receiver.is_alive() for lane in batcher._lanes)
            loop_thread = client.portal.call(lambda: threading.current_thread().name)
            with ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(lambda b: client.post("/translate", json=b), bodies))
        for body, response in zip(bodies, answers, strict=True):
            assert response.status_code == 200, response.text
            assert_same_answer(response.json(), *expected_answer(translator, body, (2, 0.6)))
        assert taken_on and set(taken_on) == {loop_thread}
        assert not any(lane.searches._loop_reads for lane in batcher._lanes)
        assert all(lane.searches._receiver.is_alive() for lane in batcher._lanes)
        assert_decodes_as_alone(batcher, translator)
        assert taken_on[-1] == "aiayn-lane-results"
    finally:
        service.close()
    assert not lane_processes(service)


@linux_only
def test_a_lane_process_that_dies_while_the_loop_reads_is_replaced_off_the_loop(run_dir,
                                                                              translator):
    """A lane process that ends while the event loop reads its answers: its request gets a
    503 with one line, a thread starts the new process (the loop goes on answering
    meanwhile), and once the new one can decode the loop reads its answers again."""
    service = process_lanes_service(run_dir)
    body = {"text": ["red green"], "beam": 2}
    expected = translator.translate(["red green"], translator.resolve(beam=2))
    try:
        with TestClient(create_app(service), raise_server_exceptions=False) as client:
            until(lambda: reading_on_loop(service), "the loop to read the lanes")
            processes = [lane.searches.process for lane in service.batcher._lanes]
            # A new child starts on a thread: meanwhile the loop answers at once.
            response, holder = kill_the_lane_holding(
                service, client, body,
                meanwhile=lambda: client.get("/health").raise_for_status())
            assert_clean_error(response, 503, "a decoding process of the server ended "
                                              "(exit code -9) with this request's sentences")
            until(lambda: reading_on_loop(service), "the loop to read the new process")
            assert holder.process not in processes
            assert [client.post("/translate", json=body).json()["translations"]
                    for _ in range(3)] == [expected] * 3
    finally:
        service.close()
    assert not lane_processes(service)


@linux_only
def test_the_loop_never_waits_to_send_to_a_lane_process(translator):
    """What the server's loop sends a lane process (``send(wait=False)``) goes only where
    the pipe has room for all of it: with the child frozen, sends are refused once the pipe
    is nearly full, and none of them blocks (the loop may be what reads the child's
    answers); the lane's thread sends the rest, waiting. Each refusal writes nothing."""
    lane = LaneProcess(translator.model, False, on_result=lambda result: None,
                       on_lost=lambda exc: None)
    try:
        lane.wait_ready(timeout=120)
        os.kill(lane.process.pid, signal.SIGSTOP)
        removes = list(range(2000))  # a message of a few KB: only removals, of no sentence
        size = len(pickle_size(removes))
        results: list[bool] = []

        def send_until_refused() -> None:
            for _ in range(2 * lane._capacity // size + 2):  # more than the pipe holds
                results.append(lane.send([], removes, wait=False))
                if not results[-1]:
                    return

        sender = threading.Thread(target=send_until_refused, daemon=True)
        sender.start()
        sender.join(timeout=60)
        assert not sender.is_alive(), "a send of the loop's waited for the frozen child"
        assert results[0] and results[-1] is False  # some went, then one was refused
        assert 0.25 * lane._capacity < (len(results) - 1) * size <= lane._capacity
        assert lane.send([], removes, wait=False) is False
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(lane.process.pid, signal.SIGCONT)
        lane.close()


def pickle_size(removes: list[int]) -> bytes:
    from multiprocessing.reduction import ForkingPickler
    return bytes(ForkingPickler.dumps(([], removes)))


@linux_only
def test_a_loop_that_stops_without_letting_go_leaves_the_answers_to_threads(run_dir,
                                                                           translator):
    """A forced exit stops the server's loop without its shutdown (which lets go of the
    lanes): closing the service still reads the answers still to come, so the jobs taken
    are answered and the close ends."""
    import asyncio

    service = process_lanes_service(run_dir)
    batcher = service.batcher
    loop = asyncio.new_event_loop()
    running = threading.Thread(target=loop.run_forever, daemon=True)
    running.start()
    processes = [lane.searches.process for lane in batcher._lanes]
    closing = threading.Thread(target=service.close, daemon=True)
    try:
        loop.call_soon_threadsafe(batcher.read_on, loop)
        until(lambda: reading_on_loop(service), "the loop to read the lanes")
        for process in processes:  # frozen: the job waits in its lane
            os.kill(process.pid, signal.SIGSTOP)
        future = batcher.translate(translator.prepare(["red green"]), Search(2, 0.6))
        until(lambda: any(lane.owners for lane in batcher._lanes), "a lane to take it")
        loop.call_soon_threadsafe(loop.stop)
        running.join(timeout=30)
        for process in processes:
            os.kill(process.pid, signal.SIGCONT)
        closing.start()
        closing.join(timeout=60)
        assert not closing.is_alive(), "the close waited for answers nobody read"
        assert_decodes_as_alone(batcher, translator, future.result(timeout=0)[0])
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)
        if not closing.is_alive():  # a close that hangs would hang here too
            service.close()
        loop.close()
    assert not lane_processes(service)


@linux_only
@pytest.mark.filterwarnings("ignore::aiayn.inference.translations.TruncationWarning")
def test_long_messages_cross_a_pipe_a_uvloop_loop_reads_whole_both_ways(run_dir, translator):
    """uvloop (what `aiayn serve` runs) makes a socket it polls non-blocking, where a
    Connection's own reads and writes can stop at half a message: over the pipe the loop
    reads (non-blocking), a job of 300 sentences (a send larger than the pipe holds, left
    to the lane's thread) and rounds of many long n-best lists (messages of several writes:
    the tiny model's length limit ends the sentences together) arrive whole."""
    uvloop = pytest.importorskip("uvloop")
    service = process_lanes_service(run_dir)
    batcher = service.batcher
    loop = uvloop.new_event_loop()
    running = threading.Thread(target=loop.run_forever, daemon=True)
    running.start()
    try:
        loop.call_soon_threadsafe(batcher.read_on, loop)
        until(lambda: reading_on_loop(service), "the loop to read the lanes")
        assert not any(os.get_blocking(lane.searches._conn.fileno()) for lane in batcher._lanes)
        rng = random.Random(3)
        texts = [" ".join(random_sentence(rng) for _ in range(6)) for _ in range(300)]
        search = Search(4, 0.6, nbest=4)
        sources = translator.prepare(texts)
        hyps, _ = batcher.translate(sources, search).result(timeout=300)
        got = translator.finish(sources, hyps, 4)
        assert all(len(nbest) == 4 for nbest in got)
        assert [nbest[0][0] for nbest in got] == translator.translate(
            texts, translator.resolve(beam=4, alpha=0.6))
    finally:
        loop.call_soon_threadsafe(batcher.read_on, None)
        loop.call_soon_threadsafe(loop.stop)
        running.join(timeout=30)
        service.close()
        loop.close()


@linux_only
def test_frames_take_whole_messages_from_any_piece_of_them_without_waiting(caplog):
    """What a lane's pipe carries, cut anywhere: a read gives the messages completed so far
    and never waits (on nothing, or for the rest of a message: the loop must not), a
    message begun survives to the next read, several arrive in one read, a long one over
    many, the 8-byte length's frame too; one that cannot be unpickled costs only itself;
    the other end's close is EOFError."""
    import fcntl
    import termios
    from multiprocessing.reduction import ForkingPickler

    from aiayn.serving.pipes import Frames

    ours, theirs = socket.socketpair()
    frames = Frames(ours.fileno())

    def waiting() -> int:  # bytes in our end not yet read
        return struct.unpack("i", fcntl.ioctl(ours.fileno(), termios.FIONREAD, b"\0" * 4))[0]

    def take(piece: bytes) -> list:  # send a piece and read until all of it is taken
        theirs.sendall(piece)
        got = []
        while waiting():
            got += frames.read()
        return got

    def frame(message, long_form: bool = False) -> bytes:  # as Connection.send writes it
        payload = ForkingPickler.dumps(message)
        head = struct.pack("!iQ", -1, len(payload)) if long_form else struct.pack("!i", len(payload))
        return head + payload

    try:
        reading = threading.Thread(target=frames.read)  # nothing has come: returns at once
        reading.start()
        reading.join(timeout=30)
        assert not reading.is_alive()
        first, second, big = frame("ready"), frame([1, 2.5, "x"]), frame("big", long_form=True)
        assert take(first[:2]) == []  # half a length
        assert take(first[2:] + second[:3]) == ["ready"]  # the next begun
        assert take(second[3:] + big[:4]) == [[1, 2.5, "x"]]  # the long form's -1 alone
        assert take(big[4:9]) == []  # within its 8-byte length
        assert take(big[9:-1]) == []
        assert take(big[-1:]) == ["big"]
        long = {"hyps": list(range(30_000))}  # over several reads of 64 KiB
        wire = frame(long)
        assert take(wire[:len(wire) // 2]) == [] and take(wire[len(wire) // 2:]) == [long]
        bad = struct.pack("!i", 6) + b"\x80\x05junk"  # no pickle
        assert take(frame("before") + bad + frame("after")) == ["before", "after"]
        assert "could not be read" in caplog.text
        theirs.close()
        with pytest.raises(EOFError):
            frames.read()
    finally:
        frames.close()
        ours.close()


class _RebuiltWrongly(Exception):
    """Pickles, but cannot be rebuilt from its args (its __init__ takes a keyword)."""

    def __init__(self, *, why: str):
        super().__init__(f"bad input: {why}")


def test_a_lanes_failure_travels_as_itself_only_where_the_server_can_read_it_back():
    from aiayn.serving.lanes import _picklable

    assert isinstance(_picklable(AiaynError("plain")), AiaynError)
    sent = _picklable(_RebuiltWrongly(why="x"))
    assert type(sent) is RuntimeError and str(sent) == "_RebuiltWrongly: bad input: x"
    pickle.loads(pickle.dumps(sent))  # and it arrives


@linux_only
def test_frames_send_a_message_whole_over_a_socket_that_does_not_block():
    """A message far larger than the socket holds, sent while the other end (a child's
    Connection) reads slowly: it arrives whole, where a Connection's write to a
    non-blocking socket stops part way."""
    from multiprocessing.connection import Connection
    from multiprocessing.reduction import ForkingPickler

    from aiayn.serving.pipes import Frames

    ours, theirs = socket.socketpair()
    frames = Frames(ours.fileno())
    child = Connection(theirs.detach())
    try:
        assert not os.get_blocking(ours.fileno())  # as an event loop's poll leaves it
        message = {"sources": [list(range(200)) for _ in range(2_000)]}  # a few MB pickled
        failed, got = [], []

        def send() -> None:
            try:
                frames.send(ForkingPickler.dumps(message))
            except Exception as exc:
                failed.append(exc)
        sending = threading.Thread(target=send, daemon=True)
        sending.start()
        time.sleep(0.2)  # the socket fills: the send must wait for room, not fail
        receiving = threading.Thread(target=lambda: got.append(child.recv()), daemon=True)
        receiving.start()
        sending.join(timeout=60)
        receiving.join(timeout=60)
        assert not failed and got == [message]
    finally:
        frames.close()
        ours.close()
        child.close()


@pytest.mark.skipif(not hasattr(select, "poll"), reason="the check is Connection.poll there")
def test_a_lanes_arrival_check_says_what_connection_poll_says_without_waiting():
    """The check a lane makes between two steps (a poller kept for the pipe's life where the
    platform has one) answers as Connection.poll(): nothing yet, a message, the message
    taken, and the other end closed (which ``recv`` then reports), never waiting."""
    from aiayn.serving.pipes import arrival_check

    ours, theirs = multiprocessing.Pipe()
    arrived = arrival_check(theirs)
    try:
        seen = []
        for act in (lambda: None, lambda: ours.send("job"), theirs.recv, ours.close):
            act()
            start = time.monotonic()
            seen.append((arrived(), theirs.poll()))
            assert time.monotonic() - start < 1.0
        assert seen == [(False, False), (True, True), (False, False), (True, True)]
        with pytest.raises(EOFError):
            theirs.recv()
    finally:
        theirs.close()
