"""The API of `aiayn serve` (aiayn.serving.app) in-process through FastAPI's TestClient:
each route's answer is the Translator's, and every bad request is one line.

The run is the tiny trained copy model of tests/conftest.py's run_dir.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'aiayn[serve]'")
from fastapi.testclient import TestClient  # noqa: E402
from helpers import random_sentence  # noqa: E402
from serve_helpers import (  # noqa: E402
    LONG,
    REPEATING,
    SENTENCES,
    assert_clean_error,
    attention_by_hand,
)

from aiayn.config import DecodeConfig, save_config  # noqa: E402
from aiayn.data.tokenizer import BOS_ID  # noqa: E402
from aiayn.inference.joinable import JoinableSearch  # noqa: E402
from aiayn.inference.search import Sampling  # noqa: E402
from aiayn.inference.translator import Translator, TruncationWarning  # noqa: E402
from aiayn.runs.directory import load_run  # noqa: E402
from aiayn.serving.app import create_app  # noqa: E402
from aiayn.serving.service import MAX_BEAM, ModelService  # noqa: E402

# A JSON type that FastAPI reads as JSON and JsonFastPath leaves to it.
ROUTED = {"Content-Type": "application/x-aiayn+json"}
JSON = {"Content-Type": "application/json"}


# ---------------------------------------------------------------- /translate

@pytest.mark.parametrize("beam", [1, 4])
def test_translate_equals_the_translator(client, translator, beam):
    body = {"text": SENTENCES + [LONG], "beam": beam, "alpha": 0.6, "nbest": beam}
    answer = client.post("/translate", json=body).json()
    with pytest.warns(TruncationWarning):  # the same warning as the answer's
        search = translator.resolve(beam=beam, alpha=0.6, nbest=beam)
        assert answer["translations"] == translator.translate(SENTENCES + [LONG], search)
        expected = translator.translate_nbest(SENTENCES + [LONG], search)
    got = [[(h["text"], h["score"]) for h in hyps] for hyps in answer["nbest"]]
    assert [[t for t, _ in hyps] for hyps in got] == [[t for t, _ in h] for h in expected]
    assert np.allclose([s for h in got for _, s in h], [s for h in expected for _, s in h])
    assert answer["translations"][1] == "" and answer["nbest"][1] == []  # the empty line
    assert len(answer["warnings"]) == 1 and "truncated" in answer["warnings"][0]


@pytest.mark.parametrize("beam", [1, 3])
def test_translate_answers_scores_and_completes_prefixes_as_the_translator(client, translator,
                                                                          beam):
    texts, prefixes = ["red sun", "", "star tree", "moon"], ["blue", None, "", "white river"]
    answer = client.post("/translate", json={"text": texts, "prefix": prefixes, "beam": beam,
                                             "nbest": beam}).json()
    want = translator.translate_scored(texts, translator.resolve(beam=beam, nbest=beam),
                                       prefixes=prefixes)
    assert answer["translations"] == [w[0].text if w else "" for w in want]
    assert answer["translations"][0].startswith("blue ")
    assert answer["translations"][3].startswith("white river")
    assert answer["scores"][1] is None
    assert np.allclose([s for s in answer["scores"] if s is not None],
                       [w[0].score for w in want if w])
    for entries, hyps in zip(answer["nbest"], want, strict=True):
        for entry, t in zip(entries, hyps, strict=True):
            assert entry["pieces"] == t.pieces and entry["text"] == t.text
            assert np.allclose(entry["log_probs"], t.log_probs)
            assert entry["log_prob"] == pytest.approx(sum(entry["log_probs"]))
    one = client.post("/translate", json={"text": "red sun", "prefix": "blue"}).json()
    assert one["translations"] == translator.translate(["red sun"], prefixes=["blue"])


@pytest.mark.parametrize(("body", "words"), [
    ({"text": ["red", "sun"], "prefix": ["blue"]}, '"prefix" has 1 entries for 2 sentences'),
    ({"text": "red", "prefix": ["blue"]}, '"prefix" must be a string where "text" is one'),
    ({"text": ["red"], "prefix": ["zzq"]}, "prefix of sentence 1 ('zzq') has pieces this "
                                            "model cannot write"),
])
def test_a_bad_prefix_gets_422_with_one_line(client, body, words):
    assert_clean_error(client.post("/translate", json=body), 422, words)


def test_translate_takes_one_string_and_keeps_the_order(client, translator):
    assert client.post("/translate", json={"text": "black sun"}).json()["translations"] == \
        translator.translate(["black sun"])
    rng = random.Random(3)
    texts = [random_sentence(rng) for _ in range(8)]
    answer = client.post("/translate", json={"text": texts, "beam": 2}).json()
    assert answer["translations"] == [translator.translate([t], translator.resolve(beam=2))[0]
                                    for t in texts]
    assert answer["warnings"] == []


def test_translate_with_alignments_gives_the_translators_word_pairs(client, translator):
    body = {"text": SENTENCES, "beam": 2, "nbest": 2, "alignments": True}
    answer = client.post("/translate", json=body).json()
    expected = translator.translate_aligned(SENTENCES, translator.resolve(beam=2))
    assert answer["translations"] == [text for text, _ in expected]
    assert answer["alignments"] == [[list(pair) for pair in links] for _, links in expected]
    assert answer["alignments"][1] == [] and answer["nbest"][1] == []  # the empty line
    for hyps, links in zip(answer["nbest"], answer["alignments"], strict=True):
        assert [h["alignment"] for h in hyps[:1]] == ([links] if hyps else [])
        for h in hyps:  # one pair per word of each hypothesis
            assert [j for _, j in h["alignment"]] == list(range(len(h["text"].split())))
    # Without the option the answer is as before: no alignments anywhere.
    plain = client.post("/translate", json={"text": SENTENCES, "beam": 2}).json()
    assert "alignments" not in plain and all("alignment" not in h for hyps in plain["nbest"]
                                              for h in hyps)


def test_a_request_without_a_search_gets_the_runs_own(run_dir, tmp_path):
    """The run's config.yaml says beam 3, alpha 1.5 (decode): a request without beam or
    alpha decodes so and says so; one that names them gets what it names."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    config = load_run(run)[0]
    save_config(dataclasses.replace(config, decode=DecodeConfig(beam=3, alpha=1.5)),
                run / "config.yaml")
    ours = Translator.from_pretrained(run)
    service = ModelService.from_run(run)
    client = TestClient(create_app(service))
    try:
        assert client.get("/info").json()["decode"] == {"beam": 3, "alpha": 1.5,
                                                         "no_repeat_ngram": 0}
        answer = client.post("/translate", json={"text": SENTENCES, "nbest": 3}).json()
        assert (answer["beam"], answer["alpha"]) == (3, 1.5)
        want = ours.translate_nbest(SENTENCES, ours.resolve(beam=3, alpha=1.5, nbest=3))
        assert [[(h["text"], h["score"]) for h in hyps] for hyps in answer["nbest"]] == \
            [[(text, score) for text, score in hyps] for hyps in want]
        told = client.post("/translate",
                           json={"text": SENTENCES, "nbest": 3, "alpha": 0.6}).json()
        assert (told["beam"], told["alpha"]) == (3, 0.6) and told["nbest"] != answer["nbest"]
    finally:
        service.close()
    # A run's beam over the server's limit: a request that names none is refused in one line
    save_config(dataclasses.replace(config, decode=DecodeConfig(beam=MAX_BEAM + 1)),
                run / "config.yaml")
    service = ModelService.from_run(run)
    client = TestClient(create_app(service))
    try:
        assert_clean_error(client.post("/translate", json={"text": ["red"]}), 422,
                           f"decode.beam {MAX_BEAM + 1} is over this server's limit")
        assert client.post("/translate", json={"text": ["red"], "beam": 2}).json()["beam"] == 2
    finally:
        service.close()


# ---------------------------------------------------------------- the guard and sampling

def test_translate_takes_the_guard_and_samples_as_the_translator(client, translator):
    answer = client.post("/translate", json={"text": REPEATING, "beam": 3,
                                             "no_repeat_ngram": 1}).json()
    assert answer["translations"] == translator.translate(
        REPEATING, translator.resolve(beam=3, no_repeat_ngram=1))
    assert answer["no_repeat_ngram"] == 1 and answer["sample"] is None
    assert answer["translations"] != translator.translate(REPEATING, translator.resolve(beam=3))
    body = {"text": SENTENCES, "nbest": 3, "sample": {"temperature": 3.0, "top_p": 0.95}}
    drawn = client.post("/translate", json={**body, "seed": 5}).json()
    assert drawn["sample"] == {"temperature": 3.0, "top_k": 0, "top_p": 0.95, "seed": 5}
    assert drawn["beam"] is None
    want = translator.translate_nbest(SENTENCES, translator.resolve(
        nbest=3, sampling=Sampling(3.0, 0, 0.95, 5)))
    assert [[h["text"] for h in hyps] for hyps in drawn["nbest"]] == \
        [[text for text, _ in hyps] for hyps in want]
    # Without a seed: a random one, given in the answer, that draws the same samples again.
    first = client.post("/translate", json=body).json()
    again = client.post("/translate", json={**body, "seed": first["sample"]["seed"]}).json()
    assert again["nbest"] == first["nbest"]


@pytest.mark.parametrize("body, words", [
    ({"text": "red", "seed": 3}, "seed goes with sample"),
    ({"text": "red", "beam": 2, "sample": {}},
     "beam is for beam search; sample draws nbest samples per sentence instead"),
    ({"text": "red", "sample": {"temperature": 0}}, "body.sample.temperature"),
    ({"text": "red", "sample": {"top_p": 0}}, "body.sample.top_p"),
    ({"text": "red", "no_repeat_ngram": -1}, "body.no_repeat_ngram"),
])
def test_bad_guard_and_sampling_requests_get_422_with_one_line(client, body, words):
    assert_clean_error(client.post("/translate", json=body), 422, words)


def test_next_gives_the_distribution_a_sample_draws_from(client, translator):
    """POST /next at temperature 1 is the model's own distribution of the target's piece
    at that step (a teacher-forced pass gives it too); a colder one is sharper, and every
    piece together sums to 1."""
    sentence, target = "red sun moon", "red sun moon"
    ids = translator.tokenizers.encode_tgt([target])[0]  # BOS, pieces, EOS
    pieces = [translator.tokenizers.tgt_id_to_token(i) for i in ids]
    src = torch.tensor(translator.tokenizers.encode_src([sentence]))
    with torch.no_grad():
        logits = translator.model(src, torch.tensor([ids[:-1]]))[0].float()
    logits[:, [0, BOS_ID]] = float("-inf")  # PAD and BOS are never generated
    for step in (0, 2, 3):
        got = client.post("/next", json={"text": sentence, "target": target, "step": step,
                                         "top": 50}).json()
        assert got["tgt_tokens"] == pieces[1:-1] and got["step"] == step
        assert got["target_piece"] == pieces[step + 1]
        probs = torch.softmax(logits[step], -1)
        want = sorted(((translator.tokenizers.tgt_id_to_token(i), float(p))
                       for i, p in enumerate(probs) if p > 0), key=lambda x: -x[1])
        assert [p for p, _ in got["pieces"]][:3] == [p for p, _ in want][:3]
        assert np.allclose([q for _, q in got["pieces"]], [q for _, q in want], atol=1e-5)
        assert sum(q for _, q in got["pieces"]) == pytest.approx(1.0, abs=1e-5)
    cold = client.post("/next", json={"text": sentence, "target": target, "step": 1,
                                      "temperature": 0.3, "top": 3}).json()
    warm = client.post("/next", json={"text": sentence, "target": target, "step": 1,
                                      "temperature": 3.0, "top": 3}).json()
    assert len(cold["pieces"]) == len(warm["pieces"]) == 3
    assert cold["pieces"][0][0] == warm["pieces"][0][0] == pieces[2]
    assert cold["pieces"][0][1] > warm["pieces"][0][1] and cold["temperature"] == 0.3
    # Without a target: the served model's greedy translation, after its last piece.
    plain = client.post("/next", json={"text": sentence}).json()
    assert plain["tgt_tokens"] == [translator.tokenizers.tgt_id_to_token(i) for i in
                                   translator.target_ids(sentence)]
    assert plain["step"] == len(plain["tgt_tokens"]) and plain["target_piece"] == pieces[-1]
    assert_clean_error(client.post("/next", json={"text": sentence, "target": target,
                                                  "step": 9}), 422,
                       "step must be between 0 and 3 (the target's pieces), got 9")


# ---------------------------------------------------------------- /attention

@pytest.mark.parametrize("beam", [1, 3])
def test_attention_maps_are_those_of_aiayn_attention(client, translator, beam):
    sentence = "sun moon star tree"
    answer = client.post("/attention", json={"text": sentence, "beam": beam}).json()
    search = translator.resolve(beam=beam)
    expected = translator.attention(sentence, search)
    assert answer["translation"] == expected.translation == translator.translate([sentence],
                                                                                 search)[0]
    assert answer["src_tokens"] == expected.src_tokens
    assert answer["tgt_tokens"] == expected.tgt_tokens
    n_src, n_tgt = len(expected.src_tokens), len(expected.tgt_tokens)
    cfg = translator.model.cfg
    rows_cols = {"encoder": (n_src, n_src), "decoder_self": (n_tgt, n_tgt), "cross": (n_tgt, n_src)}
    for kind, (rows, cols) in rows_cols.items():
        layers = cfg.n_encoder_layers if kind == "encoder" else cfg.n_decoder_layers
        maps = np.array(answer["maps"][kind])
        assert maps.shape == tuple(answer["shapes"][kind]) == (layers, cfg.n_heads, rows, cols)
        assert np.allclose(maps.sum(-1), 1.0, atol=1e-3)  # every query's weights sum to 1
        assert np.allclose(maps, np.stack(expected.maps[kind]), atol=1e-5)
    causal = np.array(answer["maps"]["decoder_self"])
    assert np.all(np.triu(causal, k=1) == 0)  # a query never sees a later position


# ---------------------------------------------------------------- /attention at a step

def test_attention_at_a_step_is_that_checkpoints_over_the_served_translation(
        client, translator, run_dir):
    assert client.get("/info").json()["steps"] == [100, 200, 300, 400]
    sentence = "sun moon star tree"
    served = client.post("/attention", json={"text": sentence}).json()
    assert served["step"] is None
    for step in (100, 300):
        answer = client.post("/attention", json={"text": sentence, "step": step}).json()
        expected = attention_by_hand(run_dir, translator, sentence, step)
        assert answer["step"] == step
        # The same rows at every step: the served model's translation, teacher-forced.
        assert answer["translation"] == served["translation"] == expected.translation
        assert answer["tgt_tokens"] == served["tgt_tokens"] == expected.tgt_tokens
        for kind in ("encoder", "decoder_self", "cross"):
            assert np.allclose(answer["maps"][kind], np.stack(expected.maps[kind]), atol=1e-5)
    early = client.post("/attention", json={"text": sentence, "step": 100}).json()
    assert not np.allclose(early["maps"]["cross"], served["maps"]["cross"], atol=1e-2)


@pytest.mark.parametrize("step, status, words", [
    (7, 422, "no step checkpoint 7; this run has 100, 200, 300, 400"),
    ("late", 422, "body.step: Input should be a valid integer"),
])
def test_a_step_the_run_has_not_is_a_4xx_with_one_line(client, step, status, words):
    response = client.post("/attention", json={"text": "red sun", "step": step})
    assert_clean_error(response, status, words)


def test_a_run_without_step_checkpoints_offers_none(run_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns("checkpoints"))
    service = ModelService.from_run(run)
    try:
        client = TestClient(create_app(service))
        assert client.get("/info").json()["steps"] == []
        assert_clean_error(client.post("/attention", json={"text": "red", "step": 100}), 422,
                           "no step checkpoint 100; this run has no step checkpoints")
    finally:
        service.close()


# ---------------------------------------------------------------- bad requests

def test_requests_over_the_limits_get_413_with_a_message(client):
    assert_clean_error(client.post("/translate", json={"text": ["red"] * 9}), 413,
                       "9 sentences in one request; the limit is 8")
    assert_clean_error(client.post("/translate", json={"text": ["red green " * 25] * 2}), 413,
                       "500 characters in one request; the limit is 400")
    assert_clean_error(client.post("/attention", json={"text": "red " * 120}), 413,
                       "the limit is 400")
    body = json.dumps({"text": ["x" * 30_000]})
    assert_clean_error(client.post("/translate", content=body,
                                   headers={"Content-Type": "application/json"}), 413,
                       "the limit is 20000")
    for kind in (JSON, ROUTED):  # chunked, with no Content-Length: counted as it comes
        chunks = iter([body[:15_000].encode(), body[15_000:].encode()])
        assert_clean_error(client.post("/translate", content=chunks, headers=kind), 413,
                           "sent without a Content-Length); the limit is 20000")
    small = iter([b'{"text": ', b'["red"]}'])
    assert client.post("/translate", content=small, headers=JSON).status_code == 200


@pytest.mark.parametrize("path, body, words", [
    ("/translate", '{"text": ["red"', "the body is not valid JSON (Expecting ',' delimiter, "
     "at character 16); send an object such as {\"text\": "),
    ("/translate", "not json at all", "the body is not valid JSON (Expecting value, at "
     "character 1)"),
    ("/translate", "", 'the request has no body; send a JSON object such as {"text": '),
    ("/translate", '["red"]', 'the body must be a JSON object, such as {"text": '),
    ("/next", '"red"', 'the body must be a JSON object, such as {"text": '),
    ("/translate", '{"txt": ["red"]}', "body.text: Field required"),
    ("/translate", '{"text": ["red"], "beam": 0}', "body.beam"),
    ("/translate", '{"text": ["red"], "beam": 99}', "body.beam"),
    ("/translate", '{"text": ["red"], "alpha": "high"}', "body.alpha"),
    ("/translate", '{"text": [1, 2]}', "body.text"),
    ("/translate", '{"text": ["red"], "beam": 2, "nbest": 3}',
     "nbest must be between 1 and the beam (beam 2), got 3"),
    ("/translate", '{"text": ["red", "x\\udcff"]}', "sentence 2 is not valid Unicode"),
    ("/attention", '{"text": "   "}', "the sentence to translate is empty"),
    ("/attention", '{"text": ["red"]}', "body.text"),
])
def test_malformed_requests_get_422_with_one_line(client, path, body, words):
    response = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert_clean_error(response, 422, words)


def test_a_json_body_sent_as_a_form_names_the_header(client):
    """`curl -d '{...}'` sends application/x-www-form-urlencoded: the line says what to add."""
    response = client.post("/translate", content='{"text": ["red"]}',
                           headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert_clean_error(response, 422, "the body was not read as JSON; send the body as JSON "
                                      "with the header Content-Type: application/json")
    response = client.post("/translate", content='{"txt": ["red"]}',
                           headers={"Content-Type": "application/json"})
    assert "Content-Type" not in response.json()["error"]


@pytest.mark.parametrize("path, body, words", [
    # strict types: a string or a boolean is not converted to a number
    ("/translate", '{"text": ["red"], "beam": "4"}', "body.beam: Input should be a valid integer"),
    ("/translate", '{"text": ["red"], "beam": true}', "body.beam: Input should be a valid integer"),
    ("/translate", '{"text": ["red"], "nbest": "2"}', "body.nbest"),
    ("/translate", '{"text": ["red"], "alignments": "yes"}', "body.alignments"),
    ("/attention", '{"text": "red", "beam": true}', "body.beam"),
    ("/next", '{"text": "red", "top": "3"}', "body.top"),
    # NaN and infinity (Python's JSON reads them) are no numbers here
    ("/translate", '{"text": ["red"], "alpha": NaN}', "body.alpha: Input should be a finite "
                                                      "number"),
    ("/translate", '{"text": ["red"], "sample": {"temperature": Infinity}}',
     "body.sample.temperature: Input should be a finite number"),
])
def test_the_api_takes_json_numbers_strictly(client, path, body, words):
    response = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert_clean_error(response, 422, words)


@pytest.mark.parametrize("body, message", [
    ({"text": ["red"], "beam": 2, "nbest": 3},
     "nbest must be between 1 and the beam (beam 2), got 3"),
    ({"text": ["red"], "beam": 2, "sample": {}},
     "beam is for beam search; sample draws nbest samples per sentence instead"),
    ({"text": ["red"], "nbest": 65, "sample": {}},
     "nbest (samples per sentence with sample) must be between 1 and 64, got 65"),
])
def test_search_errors_name_the_json_fields_not_the_command_lines_flags(client, body, message):
    response = client.post("/translate", json=body)
    assert response.status_code == 422 and response.json() == {"error": message}


def test_an_unexpected_failure_is_a_500_without_traceback(run_dir, monkeypatch):
    service = ModelService.from_run(run_dir, lanes="threads")
    monkeypatch.setattr(JoinableSearch, "step",
                        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("secret detail")))
    client = TestClient(create_app(service), raise_server_exceptions=False)
    try:
        response = client.post("/translate", json={"text": ["red"]})
        assert_clean_error(response, 500, "internal error (RuntimeError)")
        assert "secret detail" not in response.text
        monkeypatch.undo()  # the search that failed is gone: the next request is answered
        assert client.post("/translate", json={"text": ["red"]}).status_code == 200
    finally:
        service.close()


# ---------------------------------------------------------------- the fast path

@pytest.mark.parametrize("body", [
    '{"text": ["red sun", "", "star tree"], "beam": 3, "nbest": 2, "alignments": true}',
    '{"text": "moon", "prefix": "white", "alpha": 1}',
    '{"text": ["red"], "sample": {"temperature": 0.5}, "seed": 3, "nbest": 2}',
    '{"text": ["red"], "seed": 3}',  # the answer's refusal (AiaynError)
    '{"text": ["red"], "x": 1}',  # a field the API does not name
    '{"text": ["red"] * 9}',  # not JSON
    '{"text": ["red", "red", "red", "red", "red", "red", "red", "red", "red"]}',  # TooLarge
    '{"text": ["red"], "beam": "4"}',  # does not validate: FastAPI's own line
    '{"text": ["red"], "to": "es"}',  # a model of one direction
    '{"text": "\\ud800"}',  # a lone surrogate: JSON to Python, not to pydantic's reader (422)
])
def test_the_fast_path_answers_as_fastapis_route(client, body):
    fast = client.post("/translate", content=body, headers=JSON)
    routed = client.post("/translate", content=body, headers=ROUTED)
    assert fast.status_code == routed.status_code
    got, expected = fast.json(), routed.json()
    got.pop("seconds", None), expected.pop("seconds", None)
    assert got == expected


def test_a_json_body_the_fast_path_cannot_read_goes_on_to_fastapi_whole(client, translator):
    """Python's JSON reads UTF-16, pydantic's reader does not: the request goes on to
    FastAPI's route with its body handed on, and is answered."""
    body = json.dumps({"text": SENTENCES, "beam": 2}).encode("utf-16")
    answer = client.post("/translate", content=body, headers=JSON)
    assert answer.status_code == 200
    assert answer.json()["translations"] == translator.translate(
        SENTENCES, translator.resolve(beam=2))


def test_the_fast_path_answers_without_fastapis_route(service, translator):
    app = create_app(service)
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", "") != "/translate"]
    client = TestClient(app)
    answer = client.post("/translate", json={"text": SENTENCES, "beam": 2})
    assert answer.status_code == 200
    assert answer.json()["translations"] == translator.translate(
        SENTENCES, translator.resolve(beam=2))
    # what it does not take goes on to FastAPI, which here has no such route
    assert client.post("/translate", content='{"text": ["red"]}', headers=ROUTED).status_code == 404
    assert client.post("/translate", content='{"txt": ["red"]}', headers=JSON).status_code == 404


# ---------------------------------------------------------------- the rest of the API

def test_health_info_and_the_openapi_page(client, translator, run_dir):
    assert client.get("/health").json()["status"] == "ok"
    info = client.get("/info").json()
    cfg = translator.model.cfg
    assert info["model"]["d_model"] == cfg.d_model and info["model"]["max_len"] == cfg.max_len
    assert info["parameters"] == sum(p.numel() for p in translator.model.parameters())
    assert info["weights"] == str(run_dir / "best.safetensors")
    assert info["limits"]["max_sentences"] == 8
    assert info["training_steps"] is None  # this run has no metrics.jsonl
    spec = client.get("/openapi.json").json()
    assert {"/translate", "/attention", "/health", "/info"} <= set(spec["paths"])
    assert client.get("/docs").status_code == 200


def test_only_the_pages_own_files_are_served(client):
    page = client.get("/")
    assert page.status_code == 200 and '<script src="/static/app.js">' in page.text
    assert "http" not in page.text.split("<footer")[0].replace('href="/', "")  # nothing remote
    for name in ("app.js", "style.css"):
        assert client.get(f"/static/{name}").status_code == 200
    for path in ("/static/../serve.py", "/static/..%2Fserve.py", "/static/%2e%2e/serve.py",
                 "/static/serve.py", "/static/..%2F..%2Fpyproject.toml", "/static/",
                 "/static/%2Fetc%2Fpasswd", "/figures/../serve.py", "/serve.py"):
        response = client.get(path)
        assert response.status_code == 404, path
        assert "import" not in response.text and "root:" not in response.text


def test_figures_are_pngs(client):
    for name in ("positional_encoding", "schedule"):
        response = client.get(f"/figures/{name}.png")
        assert response.status_code == 200 and response.content[:8] == b"\x89PNG\r\n\x1a\n"
    assert_clean_error(client.get("/figures/secret.png"), 404, "no figure 'secret'")
    assert_clean_error(client.get("/no/such/page"), 404, "Not Found")
    assert_clean_error(client.get("/translate"), 405, "Method Not Allowed")


def test_serve_without_the_extra_says_how_to_install_it(run_dir, monkeypatch, capsys):
    from aiayn import cli

    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if FastAPI were not installed
    monkeypatch.delitem(sys.modules, "aiayn.serving.app", raising=False)
    assert cli.main(["serve", str(run_dir)]) == 2
    assert capsys.readouterr().err == ("aiayn: error: aiayn serve needs FastAPI and uvicorn "
                                       "(fastapi is missing): pip install 'aiayn[serve]'\n")
