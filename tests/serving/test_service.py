"""The loaded model and its answers (aiayn.serving.service): step checkpoints loaded when
asked, /info's record of the run, the CTranslate2 engine served, and a service that
imports without a web library.
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
from aiayn.config import save_config  # noqa: E402
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
from aiayn.serving.service import ModelService, ServeLimits  # noqa: E402


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
