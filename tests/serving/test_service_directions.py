"""A model of several target languages served (aiayn.data.directions): a request's "to"
picks the direction, requests of both directions share the batcher's searches, and a
missing or unknown "to" is one line. The run is helpers.tagged_run's: into xx each
sentence's words reversed in upper case, into yy copied.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'aiayn[serve]'")
from fastapi.testclient import TestClient  # noqa: E402
from serve_helpers import assert_clean_error, assert_same_answer, send_while_held  # noqa: E402

from aiayn.config import load_config  # noqa: E402
from aiayn.inference.translator import Translator  # noqa: E402
from aiayn.serving.app import create_app  # noqa: E402
from aiayn.serving.service import ModelService, serve_info  # noqa: E402

pytestmark = pytest.mark.slow  # a model is trained for the module

SENTENCES = ["sun red", "", "green blue black", "white"]
CHOICES = "translates into xx, yy"


@pytest.fixture(scope="module")
def tagged_translator(tagged_run_dir) -> Translator:
    return Translator.from_pretrained(tagged_run_dir)


@pytest.fixture(scope="module")
def tagged_service(tagged_run_dir):
    service = ModelService.from_run(tagged_run_dir, lanes="threads")
    yield service
    service.close()


@pytest.fixture(scope="module")
def tagged_client(tagged_service) -> TestClient:
    return TestClient(create_app(tagged_service))


def alone(translator: Translator, body: dict) -> list:
    """The n-best lists of translating this request alone, in-process, into its "to"."""
    search = translator.resolve(beam=body.get("beam"), nbest=body.get("nbest", 1))
    return translator.toward(body["to"]).translate_nbest(body["text"], search)


def test_info_lists_the_target_languages(tagged_client, client):
    assert tagged_client.get("/info").json()["targets"] == ["xx", "yy"]
    assert client.get("/info").json()["targets"] == []  # one direction: no "to"


@pytest.mark.parametrize("to", ["xx", "yy"])
def test_a_request_with_to_is_the_translator_toward_that_language(tagged_client,
                                                                  tagged_translator, to):
    body = {"text": SENTENCES, "to": to, "beam": 3, "nbest": 2}
    answer = tagged_client.post("/translate", json=body)
    assert answer.status_code == 200, answer.text
    assert_same_answer(answer.json(), alone(tagged_translator, body), [])
    toward = tagged_translator.toward(to)
    assert answer.json()["translations"] == toward.translate(
        SENTENCES, toward.resolve(beam=3))
    # the word alignments leave the tag out: they link the sentence's own words
    aligned = tagged_client.post("/translate", json={**body, "alignments": True}).json()
    want = toward.translate_aligned(SENTENCES, toward.resolve(beam=3))
    assert aligned["alignments"] == [[list(p) for p in links] for _, links in want]


def test_the_directions_differ(tagged_client):
    answers = {to: tagged_client.post("/translate", json={"text": "green blue", "to": to,
                                                          "beam": 1}).json()["translations"]
               for to in ("xx", "yy")}
    assert answers == {"xx": ["BLUE GREEN"], "yy": ["green blue"]}


def mixed_bodies() -> list[tuple[dict, None]]:
    """Requests of both directions and one search, for ``send_while_held``."""
    texts = [["sun red", "white"], ["green blue black"], ["black", "", "red red sun"],
             ["blue white"], ["sun"]]
    return [({"text": text, "to": "xy"[i % 2] * 2, "beam": 2, "nbest": 2}, None)
            for i, text in enumerate(texts)]


def test_requests_of_both_directions_share_one_search_and_answer_as_alone(tagged_run_dir,
                                                                          tagged_translator):
    service = ModelService.from_run(tagged_run_dir, lanes="threads")
    try:
        requests = mixed_bodies()
        responses = send_while_held(service, TestClient(create_app(service)), requests)
        for (body, _), response in zip(requests, responses, strict=True):
            assert response.status_code == 200, response.text
            assert_same_answer(response.json(), alone(tagged_translator, body), [])
        # one search took them all: the direction is only the sources' first id
        assert service.stats()["pass_requests"] == {str(len(requests)): 1}
    finally:
        service.close()


def test_lanes_in_processes_answer_both_directions_as_alone(tagged_run_dir, tagged_translator):
    translator = Translator.from_pretrained(tagged_run_dir, streams=2)
    config = load_config(tagged_run_dir / "config.yaml")
    service = ModelService(translator, config,
                           serve_info(tagged_run_dir, "best", config, translator),
                           lanes="processes")
    try:
        assert service.stats()["lanes"] == 2 and service.batcher.lane_kind == "processes"
        requests = mixed_bodies()
        responses = send_while_held(service, TestClient(create_app(service)), requests)
        for (body, _), response in zip(requests, responses, strict=True):
            assert response.status_code == 200, response.text
            assert_same_answer(response.json(), alone(tagged_translator, body), [])
    finally:
        service.close()


@pytest.mark.parametrize("path", ["/translate", "/attention", "/next"])
def test_a_missing_or_unknown_to_is_a_422_of_one_line(tagged_client, path):
    assert_clean_error(tagged_client.post(path, json={"text": "sun red"}), 422,
                       f'this model {CHOICES}: say which with --to (Python: to=; serve: "to")')
    assert_clean_error(tagged_client.post(path, json={"text": "sun red", "to": "zz"}), 422,
                       f"this model does not translate into 'zz'; it {CHOICES}")
    assert_clean_error(tagged_client.post(path, json={"text": "sun red", "to": 3}), 422,
                       "body.to")


def test_a_request_of_empty_lines_still_needs_to(tagged_client):
    assert_clean_error(tagged_client.post("/translate", json={"text": ["", " "]}), 422, CHOICES)


def test_attention_and_next_piece_follow_to(tagged_client, tagged_translator):
    for to in ("xx", "yy"):
        toward = tagged_translator.toward(to)
        want = toward.attention("green blue", toward.resolve(beam=1))
        got = tagged_client.post("/attention", json={"text": "green blue", "to": to}).json()
        assert got["src_tokens"] == want.src_tokens and want.src_tokens[0] == f"<2{to}>"
        assert got["translation"] == want.translation
        assert got["tgt_tokens"] == want.tgt_tokens
        piece = tagged_client.post("/next", json={"text": "green blue", "to": to}).json()
        assert piece["tgt_tokens"] == want.tgt_tokens[1:]  # without [BOS]


def test_a_one_direction_model_refuses_to_and_answers_as_before(client, translator):
    for path in ("/translate", "/attention", "/next"):
        assert_clean_error(client.post(path, json={"text": "red sun", "to": "xx"}), 422,
                           "this model translates in one direction and has no direction tags")
    answer = client.post("/translate", json={"text": ["red sun", "blue"], "beam": 2}).json()
    assert answer["translations"] == translator.translate(["red sun", "blue"],
                                                          translator.resolve(beam=2))
