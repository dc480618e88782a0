"""Continuous batching (aiayn.serving.batcher): requests decoded together each get the
answer they get alone, joining a running search, within the token budget, per pass,
with functions run alone between steps and requests whose client has gone taken out.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'aiayn[serve]'")
from fastapi.testclient import TestClient  # noqa: E402
from helpers import random_sentence  # noqa: E402
from serve_helpers import (  # noqa: E402
    MIXED,
    REPEATING,
    SENTENCES,
    assert_clean_error,
    assert_same_answer,
    expected_answer,
    held_model,
    send_while_held,
    until,
)

from aiayn.config import load_config  # noqa: E402
from aiayn.inference.joinable import JoinableSearch  # noqa: E402
from aiayn.inference.search import Sampling, Search  # noqa: E402
from aiayn.inference.translator import Translator  # noqa: E402
from aiayn.serving.app import create_app  # noqa: E402
from aiayn.serving.batcher import ClientGone  # noqa: E402
from aiayn.serving.service import ModelService, ServeLimits, serve_info  # noqa: E402


def one_lane_service(run_dir, max_tokens: int | None = None) -> ModelService:
    """A service whose batcher has one lane: where each request goes is then known."""
    translator = Translator.from_pretrained(run_dir, streams=1, max_tokens=max_tokens)
    config = load_config(run_dir / "config.yaml")
    return ModelService(translator, config, serve_info(run_dir, "best", config, translator))


def held_steps(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Every decoding step waits for ``release``; ``inside`` is set once one has begun."""
    inside, release = threading.Event(), threading.Event()
    real = JoinableSearch.step

    def held(self):
        inside.set()
        release.wait()
        return real(self)

    monkeypatch.setattr(JoinableSearch, "step", held)
    return inside, release


# ---------------------------------------------------------------- decoded together, each as alone

def test_requests_sent_together_are_decoded_together_each_as_alone(service, client,
                                                                   translator):
    """Mixed requests arrive while the model is busy: those with the same search share one
    pass (three searches: three passes), and each answer - n-best, scores, warnings - is
    the one it gets alone; the one over the limits is refused and costs the others nothing."""
    before = service.stats()
    responses = send_while_held(service, client, MIXED)
    assert_clean_error(responses[-1], 413, "9 sentences in one request")
    for (body, search), response in zip(MIXED[:-1], responses, strict=False):
        assert response.status_code == 200, response.text
        assert (response.json()["beam"], response.json()["alpha"]) == search
        assert_same_answer(response.json(), *expected_answer(translator, body, search))
    after = service.stats()
    # Three searches, each run in one lane or spread over the lanes; never mixed.
    assert 3 <= after["passes"] - before["passes"] <= 3 * after["lanes"]
    assert after["requests"] - before["requests"] == len(MIXED) - 1


def test_requests_with_other_guards_and_samples_decoded_together_each_get_theirs_alone(
        service, client, translator):
    """Requests of several guards and sampling settings queued together: each is decoded
    in the search of its own settings (none mixed) and gets its answer alone."""
    bodies = [{"text": REPEATING, "beam": 2, "no_repeat_ngram": 1},
              {"text": REPEATING[:2], "beam": 2, "no_repeat_ngram": 2},
              {"text": REPEATING, "beam": 2},
              {"text": SENTENCES, "nbest": 2, "sample": {"temperature": 2.0}, "seed": 1},
              {"text": REPEATING, "nbest": 2, "sample": {"temperature": 2.0}, "seed": 1,
               "no_repeat_ngram": 1}]
    over = {"text": ["sun"] * 9}  # refused (413): send_while_held waits for the rest
    responses = send_while_held(service, client, [(body, None) for body in [*bodies, over]])
    for body, response in zip(bodies, responses[:-1], strict=True):
        assert response.status_code == 200, response.text
        sampling = (Sampling(body["sample"]["temperature"], seed=body["seed"])
                    if "sample" in body else None)
        want = translator.translate_nbest(body["text"], body.get("beam"),
                                          nbest=body.get("nbest", 1), sampling=sampling,
                                          no_repeat_ngram=body.get("no_repeat_ngram"))
        assert [[h["text"] for h in hyps] for hyps in response.json()["nbest"]] == \
            [[text for text, _ in hyps] for hyps in want]


def test_per_pass_batching_of_aiayn_model_answers_each_request_as_alone(run_dir, translator):
    """--batching pass with aiayn's own model: the waiting requests with the same search
    are one pass (three searches: three passes, in one thread), each answer as alone."""
    service = ModelService.from_run(run_dir, batching="pass")
    try:
        client = TestClient(create_app(service, ServeLimits(max_body_bytes=20_000,
                                                            max_sentences=8, max_chars=400)))
        responses = send_while_held(service, client, MIXED)
        for (body, search), response in zip(MIXED[:-1], responses, strict=False):
            assert response.status_code == 200, response.text
            assert_same_answer(response.json(), *expected_answer(translator, body, search))
        stats = service.stats()
        assert stats["batching"] == "per pass" and stats["joins"] == 0
        assert stats["passes"] == 3 and stats["requests"] == len(MIXED) - 1
    finally:
        service.close()


def test_the_budget_bounds_the_sentences_decoded_together(run_dir, translator):
    """A budget of 8 tokens x beam: requests of 4 source tokens (3 words and EOS) at beam
    2 are decoded one at a time, those of 2 tokens two at a time; each answered as alone."""
    service = one_lane_service(run_dir, max_tokens=8)
    client = TestClient(create_app(service))
    texts = ["red green blue", "sun moon star", "white tree river", "black sun moon",
             "red", "blue", "tree", "sun"]
    try:
        gate = held_model(service)
        try:
            with ThreadPoolExecutor(len(texts)) as pool:
                sent = []
                for i, text in enumerate(texts):  # one after the other: a known order
                    sent.append(pool.submit(client.post, "/translate",
                                            json={"text": [text], "beam": 2, "alpha": 0.6}))
                    until(lambda n=i + 1: service.batcher.waiting == n, "the request to queue")
                gate.set()
                answers = [f.result().json() for f in sent]
        finally:
            gate.set()
        assert [a["translations"][0] for a in answers] == translator.translate(texts, 2, 0.6)
        stats = service.stats()
        assert stats["most_tokens"] == 8  # reached, never passed
        assert stats["step_sentences"] > stats["steps"]  # some steps decoded two
    finally:
        service.close()


def test_requests_arriving_mid_decode_join_the_running_search(run_dir, translator,
                                                              monkeypatch):
    """Mixed requests sent while a search is at its first step: those with its settings
    join it at its next step, the others start their own; every answer as alone."""
    service = one_lane_service(run_dir)
    client = TestClient(create_app(service, ServeLimits(max_sentences=8)))
    inside, release = held_steps(monkeypatch)
    first = {"text": ["sun moon star tree river"], "beam": 4, "alpha": 0.6, "nbest": 3}
    try:
        with ThreadPoolExecutor(len(MIXED) + 1) as pool:
            try:
                running = pool.submit(client.post, "/translate", json=first)
                until(inside.is_set, "the first step")
                sent = [pool.submit(client.post, "/translate", json=body) for body, _ in MIXED]
                until(lambda: service.batcher.waiting == len(MIXED) - 1,
                      "the requests to queue")
            finally:
                release.set()
            responses = [f.result() for f in sent]
            assert_same_answer(running.result().json(),
                               *expected_answer(translator, first, (4, 0.6)))
        assert_clean_error(responses[-1], 413, "9 sentences in one request")
        for (body, search), response in zip(MIXED[:-1], responses, strict=False):
            assert response.status_code == 200, response.text
            assert_same_answer(response.json(), *expected_answer(translator, body, search))
        stats = service.stats()
        # MIXED's three beam 4, alpha 0.6 requests with sentences joined the first one's
        # search; (2, 0.6) and (4, 1.5) started their own, decoded in turn with it.
        assert stats["joins"] == 3
        assert stats["pass_requests"] == {"4": 1, "2": 1, "1": 1}
        assert stats["batching"] == "continuous" and stats["lanes"] == 1
    finally:
        release.set()
        service.close()


# ---------------------------------------------------------------- run alone, and answered meanwhile

def test_a_function_run_alone_never_overlaps_a_decoding_step(service, translator,
                                                            monkeypatch):
    """Eight clients at once, with functions run alone (as attention capture is) among
    them: every request answered right, no alone function while a search steps."""
    inside, seen = [0], []
    counter = threading.Lock()
    real = JoinableSearch.step

    def probe(self):
        with counter:
            inside[0] += 1
        time.sleep(0.002)  # give the other threads a chance to come in
        try:
            return real(self)
        finally:
            with counter:
                inside[0] -= 1

    monkeypatch.setattr(JoinableSearch, "step", probe)
    client = TestClient(create_app(service))
    texts = [random_sentence(random.Random(i)) for i in range(32)]

    def send(i: int) -> dict:
        alone = service.batcher.run_alone(lambda: seen.append(inside[0]))
        answer = client.post("/translate", json={"text": [texts[i]], "beam": 1}).json()
        alone.result()
        return answer

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(send, range(len(texts))))
    assert seen == [0] * len(texts)
    assert [a["translations"][0] for a in answers] == translator.translate(texts, 1, 0.6)


def test_health_info_and_stats_answer_while_a_long_pass_runs(run_dir, translator,
                                                             monkeypatch):
    service = one_lane_service(run_dir)
    client = TestClient(create_app(service))
    inside, release = held_steps(monkeypatch)
    try:
        with ThreadPoolExecutor(2) as pool:
            try:
                answer = pool.submit(client.post, "/translate", json={"text": ["red sun"]})
                until(inside.is_set, "the decoding to start")
                assert client.get("/health").json()["status"] == "ok"
                assert client.get("/info").json()["batching"] == {"max_tokens": 8192,
                                                                 "max_wait_ms": 5.0}
                queued = pool.submit(client.post, "/translate", json={"text": ["blue"]})
                until(lambda: client.get("/stats").json()["waiting"] == 1,
                      "the second request")
                assert not answer.done()  # the step is still running
            finally:
                release.set()
            assert answer.result().json()["translations"] == translator.translate(["red sun"])
            assert queued.result().json()["translations"] == translator.translate(["blue"])
    finally:
        release.set()
        service.close()


def test_attention_waits_for_no_pass_and_runs_alone(service, client, translator):
    """An attention request sent while translations wait is answered, maps and all, and
    the translations with it."""
    gate = held_model(service)
    try:
        with ThreadPoolExecutor(3) as pool:
            first = pool.submit(client.post, "/translate", json={"text": ["red"], "beam": 2})
            maps = pool.submit(client.post, "/attention", json={"text": "black sun"})
            until(lambda: service.batcher.waiting == 2, "the requests to queue")
            gate.set()
            assert first.result().json()["translations"] == translator.translate(["red"], 2)
            assert maps.result().json()["translation"] == translator.translate(["black sun"], 1)[0]
    finally:
        gate.set()


# ---------------------------------------------------------------- clients that hang up

def test_a_request_whose_client_hangs_up_mid_search_is_taken_out_of_it(run_dir, translator,
                                                                      monkeypatch):
    """Forgotten while its first step runs, a request's two sentences are gone from the
    next step on (the request sent meanwhile is decoded alone, as alone), its load is
    freed and it counts as abandoned."""
    service = one_lane_service(run_dir)
    batcher = service.batcher
    inside, release, sizes = threading.Event(), threading.Event(), []
    real = JoinableSearch.step

    def held(self):
        sizes.append(len(self))
        inside.set()
        release.wait()
        return real(self)

    monkeypatch.setattr(JoinableSearch, "step", held)
    other = translator.prepare(["white tree river"])
    try:
        gone = batcher.translate(translator.prepare(["sun moon star tree river", "red green"]),
                                 Search(4, 0.6))
        until(inside.is_set, "the first step")
        kept = batcher.translate(other, Search(4, 0.6))
        batcher.forget(gone)
        assert isinstance(gone.exception(timeout=0), ClientGone)
        release.set()
        hyps, _ = kept.result(timeout=60)
        assert translator.finish(other, hyps, 1)[0][0][0] == \
            translator.translate(["white tree river"], 4, 0.6)[0]
        assert sizes[0] == 2 and set(sizes[1:]) == {1}
        assert service.stats()["abandoned"] == 1 and batcher._load == 0
    finally:
        release.set()
        service.close()


# ---------------------------------------------------------------- settings

@pytest.mark.parametrize("args, words", [
    (["--max-wait-ms", "2000"], "--max-wait-ms must be between 0 and 1000, got 2000"),
    (["--max-wait-ms", "nan"], "--max-wait-ms must be between 0 and 1000, got nan"),
    (["--max-tokens", "0"], "--max-tokens must be at least 1, got 0"),
    (["--engine", "ctranslate2", "--batching", "continuous"],
     "--batching continuous needs aiayn's own model: the ctranslate2 engine decodes a batch "
     "to its end (use --batching pass)"),
    (["--lanes", "threads", "--batching", "pass"],
     "--lanes is for continuous batching; per pass, one thread decodes"),
    (["--engine", "ctranslate2", "--lanes", "processes"],  # per pass: the engine's only way
     "--lanes is for continuous batching; per pass, one thread decodes"),
])
def test_batching_settings_out_of_range_are_one_line(run_dir, capsys, args, words):
    from aiayn import cli

    assert cli.main(["serve", str(run_dir), "--port", "0", *args]) == 2
    assert capsys.readouterr().err == f"aiayn: error: {words}\n"
