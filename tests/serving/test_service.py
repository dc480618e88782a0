"""The loaded model and its answers (aiayn.serving.service): step checkpoints loaded when
asked, /info's record of the run, the CTranslate2 engine served, a service that imports
without a web library, and a model of several target languages served (a request's "to";
aiayn.data.directions), on helpers.tagged_run's model: into xx each sentence's words
reversed in upper case, into yy copied.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'aiayn[serve]'")
from fastapi.testclient import TestClient  # noqa: E402
from serve_helpers import (  # noqa: E402
    MIXED,
    assert_clean_error,
    assert_same_answer,
    expected_answer,
    send_while_held,
)

import aiayn  # noqa: E402
from aiayn.config import load_config, save_config  # noqa: E402
from aiayn.errors import AiaynError  # noqa: E402
from aiayn.inference.translator import Translator  # noqa: E402
from aiayn.runs.checkpoint import (  # noqa: E402
    STATE_VERSION,
    read_metadata,
    save_train_state,
    save_weights,
)
from aiayn.runs.directory import load_run  # noqa: E402
from aiayn.serving.app import create_app  # noqa: E402
from aiayn.serving.service import ModelService, ServeLimits, serve_info  # noqa: E402


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


# ---------------------------------------------------------------- engines

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


# ---------------------------------------------------------------- no web library

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


# ---------------------------------------------------------------- several directions
TAGGED_SENTENCES = ["sun red", "", "green blue black", "white"]
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


@pytest.mark.slow  # a model is trained for the module
def test_info_lists_the_target_languages(tagged_client, client):
    assert tagged_client.get("/info").json()["targets"] == ["xx", "yy"]
    assert client.get("/info").json()["targets"] == []  # one direction: no "to"


@pytest.mark.slow  # a model is trained for the module
@pytest.mark.parametrize("to", ["xx", "yy"])
def test_a_request_with_to_is_the_translator_toward_that_language(tagged_client,
                                                                  tagged_translator, to):
    body = {"text": TAGGED_SENTENCES, "to": to, "beam": 3, "nbest": 2}
    answer = tagged_client.post("/translate", json=body)
    assert answer.status_code == 200, answer.text
    assert_same_answer(answer.json(), alone(tagged_translator, body), [])
    toward = tagged_translator.toward(to)
    assert answer.json()["translations"] == toward.translate(
        TAGGED_SENTENCES, toward.resolve(beam=3))
    # the word alignments leave the tag out: they link the sentence's own words
    aligned = tagged_client.post("/translate", json={**body, "alignments": True}).json()
    want = toward.translate_aligned(TAGGED_SENTENCES, toward.resolve(beam=3))
    assert aligned["alignments"] == [[list(p) for p in links] for _, links in want]


@pytest.mark.slow  # a model is trained for the module
def test_the_directions_differ(tagged_client):
    answers = {to: tagged_client.post("/translate", json={"text": "green blue", "to": to,
                                                          "beam": 1}).json()["translations"]
               for to in ("xx", "yy")}
    assert answers["xx"] != answers["yy"]  # (trained: into xx reversed in upper case)


def mixed_bodies() -> list[tuple[dict, None]]:
    """Requests of both directions and one search, for ``send_while_held``."""
    texts = [["sun red", "white"], ["green blue black"], ["black", "", "red red sun"],
             ["blue white"], ["sun"]]
    return [({"text": text, "to": "xy"[i % 2] * 2, "beam": 2, "nbest": 2}, None)
            for i, text in enumerate(texts)]


def answer_both_directions_as_alone(service: ModelService, translator: Translator) -> int:
    """Send ``mixed_bodies`` at once while the model is held (all queue) and check each
    answer is ``translator``'s alone into its "to"; how many requests were sent."""
    requests = mixed_bodies()
    responses = send_while_held(service, TestClient(create_app(service)), requests,
                                queued=len(requests))
    for (body, _), response in zip(requests, responses, strict=True):
        assert response.status_code == 200, response.text
        assert_same_answer(response.json(), alone(translator, body), [])
    return len(requests)


@pytest.mark.slow  # a model is trained for the module
def test_requests_of_both_directions_share_one_search_and_answer_as_alone(tagged_run_dir,
                                                                          tagged_translator):
    service = ModelService.from_run(tagged_run_dir, lanes="threads")
    try:
        count = answer_both_directions_as_alone(service, tagged_translator)
        # one search took them all: the direction is only the sources' first id
        assert service.stats()["pass_requests"] == {str(count): 1}
    finally:
        service.close()


@pytest.mark.slow  # a model is trained for the module
def test_lanes_in_processes_answer_both_directions_as_alone(tagged_run_dir, tagged_translator):
    translator = Translator.from_pretrained(tagged_run_dir, streams=2)
    config = load_config(tagged_run_dir / "config.yaml")
    service = ModelService(translator, config,
                           serve_info(tagged_run_dir, "best", config, translator),
                           lanes="processes")
    try:
        assert service.stats()["lanes"] == 2 and service.batcher.lane_kind == "processes"
        answer_both_directions_as_alone(service, tagged_translator)
    finally:
        service.close()


@pytest.mark.slow  # a model is trained for the module
@pytest.mark.parametrize("path", ["/translate", "/attention", "/next"])
def test_a_missing_or_unknown_to_is_a_422_of_one_line(tagged_client, path):
    assert_clean_error(tagged_client.post(path, json={"text": "sun red"}), 422,
                       f'this model {CHOICES}: say which with --to (Python: to=; serve: "to")')
    assert_clean_error(tagged_client.post(path, json={"text": "sun red", "to": "zz"}), 422,
                       f"this model does not translate into 'zz'; it {CHOICES}")
    assert_clean_error(tagged_client.post(path, json={"text": "sun red", "to": 3}), 422,
                       "body.to")


@pytest.mark.slow  # a model is trained for the module
def test_a_request_of_empty_lines_still_needs_to(tagged_client):
    assert_clean_error(tagged_client.post("/translate", json={"text": ["", " "]}), 422, CHOICES)


@pytest.mark.slow  # a model is trained for the module
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


@pytest.mark.slow  # a model is trained for the module
def test_a_one_direction_model_refuses_to_and_answers_as_before(client, translator):
    for path in ("/translate", "/attention", "/next"):
        assert_clean_error(client.post(path, json={"text": "red sun", "to": "xx"}), 422,
                           "this model translates in one direction and has no direction tags")
    answer = client.post("/translate", json={"text": ["red sun", "blue"], "beam": 2}).json()
    assert answer["translations"] == translator.translate(["red sun", "blue"],
                                                          translator.resolve(beam=2))


def test_answer_waits_for_the_model_or_the_client_hanging_up_whichever_comes_first():
    """``answer``: a result that comes first is returned and the wait for the client ends
    with it; a client that hangs up first cancels the request (ClientGone); a wait on the
    client that fails leaves the request to be answered. ``hung_up`` reads past body
    messages to the disconnect."""
    import asyncio
    from concurrent.futures import Future

    from aiayn.serving.batcher import ClientGone
    from aiayn.serving.service import answer, hung_up

    async def scenario(client_leaves: bool):
        left = asyncio.Event()
        messages = [{"type": "http.request", "body": b"", "more_body": False}]
        waited = []

        async def receive() -> dict:
            if messages:
                return messages.pop()
            waited.append(True)
            await left.wait()
            return {"type": "http.disconnect"}

        future: Future = Future()
        waiting = asyncio.ensure_future(answer(future, lambda: hung_up(receive)))
        await asyncio.sleep(0.01)
        assert not waiting.done() and waited == [True]  # past the body, waiting on both
        if client_leaves:
            left.set()
            with pytest.raises(ClientGone):
                await waiting
            assert future.cancelled()
        else:
            future.set_result("answered")
            assert await waiting == "answered"
            await asyncio.sleep(0)
            assert not messages and not left.is_set()
        return [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]

    assert asyncio.run(scenario(client_leaves=True)) == []
    assert asyncio.run(scenario(client_leaves=False)) == []  # the wait for the client ended

    async def unwatchable():  # a receive that fails: the request is still answered
        async def broken() -> None:
            raise RuntimeError("no receive here")

        future: Future = Future()
        waiting = asyncio.ensure_future(answer(future, broken))
        await asyncio.sleep(0.01)
        assert not waiting.done() and not future.cancelled()
        future.set_result("answered")
        return await waiting

    assert asyncio.run(unwatchable()) == "answered"

    async def stopped():  # the request itself cancelled (the server stopping): no ClientGone
        async def never() -> None:
            await asyncio.Event().wait()

        future: Future = Future()
        waiting = asyncio.ensure_future(answer(future, never))
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.sleep(0)
        assert future.cancelled()  # a job still waiting is never decoded
        return [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]

    assert asyncio.run(stopped()) == []  # and the wait on the client ended with it
