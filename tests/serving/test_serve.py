"""`aiayn serve`: the API in-process (FastAPI's TestClient), a real server process under
concurrent clients, and the page in a real headless Chromium; and `aiayn translate`
answering line by line (--interactive, or a terminal on stdin).

The run is test_translator's tiny trained copy model (a real run directory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import multiprocessing
import os
import pty
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'aiayn[serve]'")
from fastapi.testclient import TestClient  # noqa: E402
from helpers import COPY_WORDS, random_sentence  # noqa: E402

import aiayn  # noqa: E402
from aiayn.config import DecodeConfig, load_config, save_config  # noqa: E402
from aiayn.data.tokenizer import BOS_ID  # noqa: E402
from aiayn.errors import AiaynError  # noqa: E402
from aiayn.inference.attention import SentenceAttention, sentence_attention
from aiayn.inference.joinable import JoinableSearch  # noqa: E402
from aiayn.inference.search import Sampling, Search  # noqa: E402
from aiayn.inference.translator import Translator, TruncationWarning
from aiayn.model import Transformer  # noqa: E402
from aiayn.runs.checkpoint import (  # noqa: E402
    STATE_VERSION,
    load_weights,
    read_metadata,
    save_train_state,
    save_weights,
)
from aiayn.runs.directory import load_run  # noqa: E402
from aiayn.serving.app import create_app  # noqa: E402
from aiayn.serving.batcher import Batcher, ClientGone
from aiayn.serving.service import MAX_BEAM, ModelService, ServeLimits, serve_info

SENTENCES = ["red green blue", "", "sun moon star tree river", "white", "black sun"]
LONG = " ".join(COPY_WORDS * 3)  # 30 words: over the tiny model's max_len of 16 tokens


@pytest.fixture(scope="module")
def translator(run_dir) -> Translator:
    return Translator.from_pretrained(run_dir)


@pytest.fixture(scope="module")
def service(run_dir) -> ModelService:
    # Lanes as threads, whatever torch's thread count: tests patch the search in-process.
    return ModelService.from_run(run_dir, lanes="threads")


@pytest.fixture(scope="module")
def client(service) -> TestClient:
    limits = ServeLimits(max_body_bytes=20_000, max_sentences=8, max_chars=400)
    return TestClient(create_app(service, limits))


def assert_clean_error(response, status: int, words: str) -> None:
    """The status, a JSON body with one line naming the problem, no traceback."""
    assert response.status_code == status, response.text
    message = response.json()["error"]
    assert words in message and "\n" not in message and "Traceback" not in response.text


# ---------------------------------------------------------------- /translate
@pytest.mark.parametrize("beam", [1, 4])
def test_translate_equals_the_translator(client, translator, beam):
    body = {"text": SENTENCES + [LONG], "beam": beam, "alpha": 0.6, "nbest": beam}
    answer = client.post("/translate", json=body).json()
    with pytest.warns(TruncationWarning):  # the same warning as the answer's
        assert answer["translations"] == translator.translate(SENTENCES + [LONG], beam, 0.6)
        expected = translator.translate_nbest(SENTENCES + [LONG], beam, 0.6, nbest=beam)
    got = [[(h["text"], h["score"]) for h in hyps] for hyps in answer["nbest"]]
    assert [[t for t, _ in hyps] for hyps in got] == [[t for t, _ in h] for h in expected]
    assert np.allclose([s for h in got for _, s in h], [s for h in expected for _, s in h])
    assert answer["translations"][1] == "" and answer["nbest"][1] == []  # the empty line
    assert len(answer["warnings"]) == 1 and "truncated" in answer["warnings"][0]


def test_translate_takes_one_string_and_keeps_the_order(client, translator):
    assert client.post("/translate", json={"text": "black sun"}).json()["translations"] == \
        translator.translate(["black sun"])
    rng = random.Random(3)
    texts = [random_sentence(rng) for _ in range(8)]
    answer = client.post("/translate", json={"text": texts, "beam": 2}).json()
    assert answer["translations"] == [translator.translate([t], 2)[0] for t in texts]
    assert answer["warnings"] == []


def test_translate_with_alignments_gives_the_translators_word_pairs(client, translator):
    body = {"text": SENTENCES, "beam": 2, "nbest": 2, "alignments": True}
    answer = client.post("/translate", json=body).json()
    expected = translator.translate_aligned(SENTENCES, beam=2)
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
        want = ours.translate_nbest(SENTENCES, 3, 1.5, nbest=3)
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
REPEATING = ["red red red sun sun", "moon tree moon tree moon", "star"]


def test_translate_takes_the_guard_and_samples_as_the_translator(client, translator):
    answer = client.post("/translate", json={"text": REPEATING, "beam": 3,
                                             "no_repeat_ngram": 1}).json()
    assert answer["translations"] == translator.translate(REPEATING, 3, no_repeat_ngram=1)
    assert answer["no_repeat_ngram"] == 1 and answer["sample"] is None
    assert answer["translations"] != translator.translate(REPEATING, 3)
    body = {"text": SENTENCES, "nbest": 3, "sample": {"temperature": 3.0, "top_p": 0.95}}
    drawn = client.post("/translate", json={**body, "seed": 5}).json()
    assert drawn["sample"] == {"temperature": 3.0, "top_k": 0, "top_p": 0.95, "seed": 5}
    assert drawn["beam"] is None
    want = translator.translate_nbest(SENTENCES, nbest=3, sampling=Sampling(3.0, 0, 0.95, 5))
    assert [[h["text"] for h in hyps] for hyps in drawn["nbest"]] == \
        [[text for text, _ in hyps] for hyps in want]
    # Without a seed: a random one, given in the answer, that draws the same samples again.
    first = client.post("/translate", json=body).json()
    again = client.post("/translate", json={**body, "seed": first["sample"]["seed"]}).json()
    assert again["nbest"] == first["nbest"]


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


@pytest.mark.parametrize("body, words", [
    ({"text": "red", "seed": 3}, "seed goes with sample"),
    ({"text": "red", "beam": 2, "sample": {}}, "--beam is for beam search"),
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
    expected = translator.attention(sentence, beam=beam)
    assert answer["translation"] == expected.translation == translator.translate([sentence], beam)[0]
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
def attention_by_hand(run_dir, translator, sentence: str, step: int, beam: int = 1
                      ) -> SentenceAttention:
    """The maps of step ``step``'s weights, loaded by hand, over the served translation."""
    sources, _ = translator.encode([sentence])
    target = translator.decode_ids(sources, beam=beam)[0][0].ids
    model = Transformer(translator.model.cfg)
    load_weights(model, run_dir / "checkpoints" / f"step_{step:07d}.safetensors")
    return sentence_attention(model.eval(), translator.tokenizers, sentence, target)


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


def test_steps_are_loaded_when_asked_a_few_kept_and_the_served_weights_never_change(run_dir):
    service = ModelService.from_run(run_dir)
    try:
        client = TestClient(create_app(service))
        served = {k: v.clone() for k, v in service.translator.model.state_dict().items()}
        assert service.checkpoints._models == {}  # nothing loaded before it is asked for
        for step in (100, 200, 300, 400, 100):
            assert client.post("/attention", json={"text": "red sun", "step": step}).status_code == 200
        kept = [path.name for path in service.checkpoints._models]
        assert kept == ["step_0000300.safetensors", "step_0000400.safetensors",
                        "step_0000100.safetensors"]  # the last 3 asked for
        assert all(torch.equal(served[k], v)
                   for k, v in service.translator.model.state_dict().items())
    finally:
        service.close()


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


@pytest.mark.parametrize("path, body, words", [
    ("/translate", '{"text": ["red"', "JSON decode error"),
    ("/translate", "not json at all", "JSON decode error"),
    ("/translate", '["red"]', "body"),
    ("/translate", '{"txt": ["red"]}', "body.text: Field required"),
    ("/translate", '{"text": ["red"], "beam": 0}', "body.beam"),
    ("/translate", '{"text": ["red"], "beam": 99}', "body.beam"),
    ("/translate", '{"text": ["red"], "alpha": "high"}', "body.alpha"),
    ("/translate", '{"text": [1, 2]}', "body.text"),
    ("/translate", '{"text": ["red"], "beam": 2, "nbest": 3}', "--nbest must be between 1 and"),
    ("/attention", '{"text": "   "}', "the sentence to translate is empty"),
    ("/attention", '{"text": ["red"]}', "body.text"),
])
def test_malformed_requests_get_422_with_one_line(client, path, body, words):
    response = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert_clean_error(response, 422, words)


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


def test_info_names_the_best_weights_as_aiayn_info_does(run_dir, tmp_path):
    """Under train.best_metric: chrf the best weights are not those of the highest BLEU:
    /info's "best" is what best.safetensors holds, the same record `aiayn info` gives."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    config, model, _ = load_run(run)
    config.train.best_metric = "chrf"
    save_config(config, run / "config.yaml")
    records = [{"kind": "train", "step": 50, "loss": 3.0},
               {"kind": "dev", "step": 100, "bleu": 7.5, "chrf": 30.0, "dev_loss": 2.0},
               {"kind": "dev", "step": 200, "bleu": 6.0, "chrf": 35.0, "dev_loss": 2.1}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    save_weights(model, run / "best.safetensors",
                 metadata={"step": "200", "best_metric": "chrf", "best_value": "35.0"})
    save_train_state({"version": STATE_VERSION, "step": 200, "epoch": 3, "tokens": 9000,
                      "elapsed_s": 60.0, "world_size": 1}, run / "train_state.pt")
    service = ModelService.from_run(run)
    service.close()  # only what it read is looked at
    info = service.info
    assert info["best"] == aiayn.run_info(run)["best"]
    assert (info["best"]["metric"], info["best"]["step"], info["best"]["bleu"]) == ("chrf", 200, 6.0)
    assert read_metadata(run / "best.safetensors")["step"] == str(info["best"]["step"])
    assert info["last_dev"]["step"] == 200 and info["training_steps"] == 200
    assert service.schedule_drawn() == (service.config, "this run")  # eq. 3: as configured
    # A linear schedule that a time budget ended at step 200 reached 0 there.
    service.config.train = dataclasses.replace(service.config.train, schedule="linear",
                                               max_minutes=12.0, max_steps=100_000)
    config, label = service.schedule_drawn()
    assert config.train.max_steps == 200 and "12 minutes ended at step 200" in label


def test_info_of_a_run_whose_metrics_are_being_written(run_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    (run / "metrics.jsonl").write_text('{"kind": "dev", "step": 100, "bleu": 7.5}\n'
                                       '{"kind": "dev", "step": 200, "bl')  # half a line
    with pytest.warns(UserWarning, match="line 2: left out, cut short"):
        service = ModelService.from_run(run)
    service.close()
    info = service.info
    assert info["last_dev"]["step"] == 100 and info["best"] == {
        "metric": "bleu", "step": None, "dev_loss": None, "bleu": None, "chrf": None,
        "n_sentences": None}  # best.safetensors without a step: not guessed from the log


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


# ---------------------------------------------------------------- batching
def until(condition, what: str, seconds: float = 30) -> None:
    """Poll ``condition()`` until true (a state the test waits for, not a guessed delay)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.005)


def send_while_held(service, client, requests) -> list:
    """POST every (body, _) of ``requests`` at once while the model is held, so they all
    queue behind the first; release it and return the responses in order."""
    gate = held_model(service)
    try:
        with ThreadPoolExecutor(len(requests)) as pool:
            sent = [pool.submit(client.post, "/translate", json=body) for body, _ in requests]
            until(lambda: service.batcher.waiting == len(requests) - 1, "the requests to queue")
            gate.set()
            return [f.result() for f in sent]
    finally:
        gate.set()


def held_model(service):
    """Occupy the model's thread until the returned event is set: requests sent meanwhile
    wait in the queue and are decoded together once it is."""
    gate = threading.Event()
    holding = service.batcher.run_alone(gate.wait)
    until(holding.running, "the batcher to take the holding job")
    return gate


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
        hyps = translator.translate_nbest(texts, *search, nbest=body.get("nbest", 1))
    return hyps, [str(w.message) for w in caught if w.category is TruncationWarning]


def assert_same_answer(answer: dict, hyps: list, messages: list[str]) -> None:
    got = [[(h["text"], h["score"]) for h in nbest] for nbest in answer["nbest"]]
    assert [[t for t, _ in h] for h in got] == [[t for t, _ in h] for h in hyps]
    assert np.allclose([s for h in got for _, s in h], [s for h in hyps for _, s in h],
                       atol=1e-4)
    assert answer["translations"] == [h[0][0] if h else "" for h in hyps]
    assert answer["warnings"] == messages


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


def one_lane_service(run_dir, max_tokens: int | None = None) -> ModelService:
    """A service whose batcher has one lane: where each request goes is then known."""
    translator = Translator.from_pretrained(run_dir, streams=1, max_tokens=max_tokens)
    config = load_config(run_dir / "config.yaml")
    return ModelService(translator, config, serve_info(run_dir, "best", config, translator))


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


def test_a_lane_process_that_dies_is_replaced_and_costs_only_its_requests_a_503(run_dir,
                                                                              translator):
    """A process that ended while it held nothing is replaced unnoticed; one that ends
    while it decodes a request costs that request a 503 with one line, and is replaced."""
    service = process_lanes_service(run_dir)
    client = TestClient(create_app(service), raise_server_exceptions=False)
    body, expected = {"text": ["red green"], "beam": 2}, translator.translate(["red green"], 2)
    try:
        lanes = [lane.searches for lane in service.batcher._lanes]
        ended = [lane.process for lane in lanes]
        for process in ended:
            os.kill(process.pid, signal.SIGKILL)
            process.join()
        until(lambda: all(lane.process not in ended for lane in lanes), "new processes")
        for _ in range(3):
            assert client.post("/translate", json=body).json()["translations"] == expected
        processes = [lane.process for lane in lanes]
        for process in processes:  # frozen: the request is sent to one and waits there
            os.kill(process.pid, signal.SIGSTOP)
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(client.post, "/translate", json=body)
            until(lambda: any(lane.owners for lane in service.batcher._lanes),
                  "a lane to take the request")
            holder = next(lane for lane in service.batcher._lanes if lane.owners)
            os.kill(holder.searches.process.pid, signal.SIGKILL)
            response = sent.result()
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)
        assert_clean_error(response, 503, "a decoding process of the server ended "
                                          "(exit code -9) with this request's sentences")
        assert [client.post("/translate", json=body).json()["translations"]
                for _ in range(3)] == [expected] * 3
        assert service.stats()["requests"] == 7
    finally:
        service.close()
    assert not lane_processes(service)


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
        for process in processes:
            os.kill(process.pid, signal.SIGCONT)
        until(lambda: service.stats()["passes"] == 1, "the lane to report its search ended")
        stats = service.stats()
        assert stats["abandoned"] == 1 and stats["steps"] == 0 and batcher._load == 0
        sources = translator.prepare(["red green"])
        hyps, _ = batcher.translate(sources, Search(2, 0.6)).result(timeout=60)
        assert translator.finish(sources, hyps, 1)[0][0][0] == \
            translator.translate(["red green"], 2, 0.6)[0]
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


def test_a_client_that_hangs_up_while_waiting_is_never_decoded(run_dir, translator):
    """A real server (uvicorn on a thread): a request whose client closes the connection
    while it waits is dropped before any pass; the request behind it is answered alone."""
    import uvicorn

    from aiayn.serving.app import listening_socket

    service = ModelService.from_run(run_dir)
    sock = listening_socket("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning"))
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


@pytest.mark.skipif(importlib.util.find_spec("ctranslate2") is None,
                    reason="pip install 'aiayn[export]'")
def test_the_ctranslate2_engine_served(run_dir, tmp_path):
    """An `aiayn export --to ctranslate2` directory served with engine ctranslate2: every
    answer that of its Translator, requests sent together or alone; no attention maps."""
    from aiayn.export.command import export_run

    export_run(run_dir, "ctranslate2", tmp_path / "ct2")
    service = ModelService.from_run(tmp_path / "ct2", engine="ctranslate2")
    theirs = Translator.from_pretrained(tmp_path / "ct2", engine="ctranslate2")
    client = TestClient(create_app(service, ServeLimits(max_sentences=8)))
    try:
        info = client.get("/info").json()
        assert info["engine"] == "ctranslate2" and info["weights"].endswith("model.bin")
        assert info["parameters"] == sum(p.numel() for p in load_run(run_dir)[1].parameters())
        responses = send_while_held(service, client, MIXED)
        for (body, search), response in zip(MIXED[:-1], responses, strict=False):
            assert_same_answer(response.json(), *expected_answer(theirs, body, search))
        assert_clean_error(client.post("/attention", json={"text": "red"}), 422,
                           "attention maps need aiayn's own model")
    finally:
        service.close()


def test_serve_without_the_extra_says_how_to_install_it(run_dir, monkeypatch, capsys):
    from aiayn import cli

    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if FastAPI were not installed
    monkeypatch.delitem(sys.modules, "aiayn.serving.app", raising=False)
    assert cli.main(["serve", str(run_dir)]) == 2
    assert capsys.readouterr().err == ("aiayn: error: aiayn serve needs FastAPI and uvicorn "
                                       "(fastapi is missing): pip install 'aiayn[serve]'\n")


@pytest.mark.slow  # a process of its own
def test_the_batcher_and_the_service_need_no_web_library():
    """Only aiayn.serving.app is FastAPI's: the batcher and the model service import (and
    can be driven) without FastAPI, uvicorn, starlette or pydantic."""
    script = ("import sys\n"
              "for name in ('fastapi', 'uvicorn', 'starlette', 'pydantic'):\n"
              "    sys.modules[name] = None\n"
              "import aiayn.serving.batcher, aiayn.serving.lanes, aiayn.serving.service\n"
              "print('ok')")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


# ---------------------------------------------------------------- a real server process
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict | None = None, timeout: float = 30) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


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


def test_a_real_server_answers_concurrent_clients_correctly(server, translator):
    """A small load test: 40 requests from 8 clients at once, each answer the right one."""
    rng = random.Random(7)
    texts = [random_sentence(rng) for _ in range(40)]
    expected = translator.translate(texts, beam=2)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda t: http_json(f"{server}/translate",
                                                     {"text": [t], "beam": 2}), texts))
    assert [a["translations"][0] for a in answers] == expected


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


# ---------------------------------------------------------------- the page in Chromium
def chromium_driver():
    """A headless Chromium through Selenium, or a skip that says what is missing."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not (browser and driver_path):
        pytest.skip("Chromium is missing: apt-get install chromium chromium-driver "
                    "(`make test` installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1100,1400"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options,
                            service=webdriver.ChromeService(executable_path=driver_path))


def expected_colour(value: float) -> np.ndarray:
    """The page's colour scale (app.js, colour): white to (8, 48, 107), square root."""
    t = np.sqrt(np.clip(value, 0, 1))
    return np.round(np.array([255, 255, 255]) + (np.array([8, 48, 107]) - 255) * t)


READ_CELLS = """
const canvas = document.getElementById("heatmap");
const d = canvas.dataset, cell = Number(d.cell);
const pixels = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height);
const out = [];
for (let r = 0; r < Number(d.rows); r++) {
  const row = [];
  for (let c = 0; c < Number(d.cols); c++) {
    const x = Math.floor(Number(d.left) + c * cell + cell / 2);
    const y = Math.floor(Number(d.top) + r * cell + cell / 2);
    const i = 4 * (y * canvas.width + x);
    row.push([pixels.data[i], pixels.data[i + 1], pixels.data[i + 2]]);
  }
  out.push(row);
}
return {cells: out, kind: d.kind, width: canvas.width, height: canvas.height};
"""


def test_the_page_translates_and_draws_the_attention_in_chromium(server, translator, run_dir):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.select import Select
    from selenium.webdriver.support.ui import WebDriverWait

    sentence = "red sun moon tree"
    driver = chromium_driver()
    try:
        driver.get(server + "/")
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: "parameters" in d.find_element(By.ID, "info").text)
        driver.find_element(By.ID, "source").send_keys(sentence)
        driver.find_element(By.ID, "translate").click()
        wait.until(lambda d: d.find_element(By.ID, "status").text.startswith("done")
                   or d.find_element(By.ID, "error").text)
        assert driver.find_element(By.ID, "error").text == ""
        translation = translator.translate([sentence], beam=4)[0]
        assert driver.find_element(By.ID, "translation").text == translation
        items = driver.find_elements(By.CSS_SELECTOR, "ol#nbest > li")
        want = translator.translate_nbest([sentence], beam=4, nbest=4)[0]
        assert all(li.is_displayed() for li in items)
        shown = [(li.find_element(By.CLASS_NAME, "text").text,
                  float(li.find_element(By.CLASS_NAME, "score").text)) for li in items]
        assert [t for t, _ in shown] == [t for t, _ in want] and len(want) > 1
        assert np.allclose([s for _, s in shown], [s for _, s in want], atol=1e-4)

        # The next piece at step 0, temperature 1; then the temperature slider at its
        # coldest end redraws the bars of that distribution.
        def shown_pieces():
            return [(li.find_element(By.CLASS_NAME, "piece").text,
                     li.find_element(By.CLASS_NAME, "probability").text)
                    for li in driver.find_elements(By.CSS_SELECTOR, "ol#next-pieces > li")]

        for temperature in (1.0, 0.05):
            if temperature != 1.0:
                driver.find_element(By.ID, "temperature").send_keys(Keys.HOME)
            wait.until(lambda d, t=temperature: d.find_element(
                By.ID, "next-pieces").get_attribute("data-temperature") == f"{t:g}")
            want = http_json(server + "/next", {"text": sentence, "target": translation,
                                                "step": 0, "temperature": temperature})
            assert shown_pieces() == [(p, f"{q:.3f}") for p, q in want["pieces"]]
        assert float(shown_pieces()[0][1]) > 0.99  # cold: the likeliest piece takes it all

        att = translator.attention(sentence, beam=4)
        for kind, rows, cols in (("cross", att.tgt_tokens, att.src_tokens),
                                 ("decoder_self", att.tgt_tokens, att.tgt_tokens)):
            Select(driver.find_element(By.ID, "kind")).select_by_value(kind)
            Select(driver.find_element(By.ID, "layer")).select_by_value("0")
            Select(driver.find_element(By.ID, "head")).select_by_value("1")
            drawn = driver.execute_script(READ_CELLS)
            cells = np.array(drawn["cells"], dtype=float)
            assert drawn["kind"] == kind and cells.shape == (len(rows), len(cols), 3)
            # Rows are queries, columns keys: each cell has the colour of its weight.
            want = np.stack([[expected_colour(v) for v in row] for row in att.maps[kind][0][1]])
            assert np.abs(cells - want).max() <= 2
            assert len({tuple(c) for c in cells.reshape(-1, 3)}) > 2  # not a blank canvas
        assert np.all(cells[np.triu_indices(len(rows), 1)] == 255)  # causal: white above

        # The step slider: at its left end, the first step checkpoint's cross-attention
        # over the same translation, another picture than the served model's.
        Select(driver.find_element(By.ID, "kind")).select_by_value("cross")
        Select(driver.find_element(By.ID, "head")).select_by_value("1")
        served = np.array(driver.execute_script(READ_CELLS)["cells"], dtype=float)
        slider = driver.find_element(By.ID, "step")
        assert slider.is_displayed() and slider.get_attribute("max") == "4"
        slider.send_keys(Keys.HOME)
        wait.until(lambda d: d.find_element(By.ID, "heatmap").get_attribute("data-step") == "100"
                   or d.find_element(By.ID, "error").text)
        assert driver.find_element(By.ID, "error").text == ""
        assert driver.find_element(By.ID, "step-label").text == "step 100"
        early = attention_by_hand(run_dir, translator, sentence, 100, beam=4)
        assert early.tgt_tokens == att.tgt_tokens
        drawn = np.array(driver.execute_script(READ_CELLS)["cells"], dtype=float)
        want = np.stack([[expected_colour(v) for v in row] for row in early.maps["cross"][0][1]])
        assert np.abs(drawn - want).max() <= 2
        assert np.abs(drawn - served).max() > 20  # the picture changed
    finally:
        driver.quit()


# ---------------------------------------------------------------- aiayn translate, line by line
def read_lines(fd: int, count: int, timeout: float = 60) -> list[str]:
    """``count`` lines from a pipe, waiting at most ``timeout`` seconds for them."""
    data, deadline = b"", time.monotonic() + timeout
    while data.count(b"\n") < count:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise AssertionError(f"no answer within {timeout} s; got {data!r}")
        chunk = os.read(fd, 4096)
        if not chunk:
            raise AssertionError(f"the process ended; got {data!r}")
        data += chunk
    return data.decode().removesuffix("\n").split("\n")  # lines end at "\n" only


def start_translate(run: Path, *options: str, stdin) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "aiayn", "translate", str(run), *options],
                            stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_translate_interactive_answers_each_line_before_the_next(run_dir, translator):
    process = start_translate(run_dir, "--interactive", "--beam", "2", stdin=subprocess.PIPE)
    out = process.stdout.fileno()
    try:
        # translate's line rules: a "\r" before the "\n" goes, U+2028 ends no line.
        for line in ("red green blue\r", "", "sun\u2028moon", "white star"):
            process.stdin.write(line.encode() + b"\n")
            process.stdin.flush()  # and nothing more until the answer is back
            want = translator.translate([line.removesuffix("\r")], beam=2)[0]
            assert read_lines(out, 1) == [want]
        process.stdin.close()
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()


def test_translate_reads_a_terminal_line_by_line(run_dir, translator):
    """A terminal on stdin (no --interactive): answers as lines come, n-best rows numbered
    across lines as for a file."""
    controller, terminal = pty.openpty()
    process = start_translate(run_dir, "--beam", "2", "--nbest", "2", stdin=terminal)
    os.close(terminal)
    out = process.stdout.fileno()
    try:
        for number, line in enumerate(["black sun", "white moon star"]):
            os.write(controller, line.encode() + b"\n")
            rows = read_lines(out, 2)
            want = translator.translate_nbest([line], beam=2, nbest=2)[0]
            assert [r.split("\t")[0] for r in rows] == [str(number)] * 2
            assert [r.split("\t")[2] for r in rows] == [text for text, _ in want]
        os.write(controller, b"\x04")  # Ctrl-D: end of input
        assert process.wait(timeout=30) == 0
        assert "each line as it is entered" in process.stderr.read().decode()
    finally:
        process.kill()
        os.close(controller)


def test_translate_interactive_refuses_an_input_file(run_dir, capsys):
    from aiayn import cli

    assert cli.main(["translate", str(run_dir), "--interactive", "-i", "file.txt"]) == 2
    assert capsys.readouterr().err.strip() == \
        "aiayn: error: --interactive reads stdin line by line; drop -i/--input"


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


def test_continuous_batching_is_refused_for_an_engine_that_decodes_whole_batches(run_dir,
                                                                                 tmp_path):
    pytest.importorskip("ctranslate2")
    from aiayn.export.command import export_run

    export_run(run_dir, "ctranslate2", tmp_path / "ct2")
    with pytest.raises(AiaynError, match="--batching continuous needs aiayn's own model: the "
                                         "ctranslate2 engine decodes a batch to its end"):
        ModelService.from_run(tmp_path / "ct2", engine="ctranslate2", batching="continuous")
    with pytest.raises(AiaynError, match="--batching must be one of continuous, pass"):
        ModelService.from_run(run_dir, batching="steps")
