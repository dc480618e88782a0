"""The pure helpers of benchmarks/peers/run.py (the side-by-side with JoeyNMT and OpenNMT-py):
the configs it writes from the recipe, the vocabulary, log parsing, scoring and the table.
Neither peer is needed; the benchmark itself is not run here."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

RUN_PY = Path(__file__).resolve().parents[2] / "benchmarks" / "peers" / "run.py"
JOINT = {"src": Path("/t/vocab.txt"), "tgt": Path("/t/vocab.txt")}
SPM = {"src": Path("/t/spm.model"), "tgt": Path("/t/spm.model")}


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("peers_run", RUN_PY)
    module = importlib.util.module_from_spec(spec)
    sys.modules["peers_run"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules["peers_run"]


def test_recipe_is_demo_yaml(peers):
    assert peers.recipe_from_config(RUN_PY.parents[2] / "configs" / "demo.yaml") == peers.Recipe()


def test_set_overrides_reach_every_toolkit(peers, tmp_path, monkeypatch):
    """run.py --set changes the recipe the peers' configs are written from and is passed on
    to aiayn train, so all three train the same overridden recipe."""
    demo = RUN_PY.parents[2] / "configs" / "demo.yaml"
    sets = ["train.peak_lr=1.5e-3", "model.n_encoder_layers=3"]
    r = peers.recipe_from_config(demo, sets)
    assert (r.peak_lr, r.encoder_layers) == (1.5e-3, 3)
    assert peers.recipe_from_config(demo, []) == peers.Recipe()
    c = peers.joey_config(r, Path("/t"), Path("/m"), JOINT, SPM)
    assert c["training"]["learning_rate"] == pytest.approx(1.5e-3 / 200)
    s = peers.Setup(recipe=r, data=tmp_path, text=Path("/t"), out=tmp_path, venvs=tmp_path,
                    minutes=1, threads=1, aiayn_config=demo, aiayn_weights="last",
                    test_limit=0, epoch_tokens={}, config_sets=sets)
    commands = []

    def stop_at_train(command, *args):
        commands.append(command)
        raise peers.PeerError("stop here")

    monkeypatch.setattr(peers, "run_command", stop_at_train)
    with pytest.raises(peers.PeerError):
        peers.run_aiayn(s, tmp_path, ["train.bf16=false"])
    train = commands[0]
    given = [train[i + 1] for i, arg in enumerate(train) if arg == "--set"]
    assert given == ["train.cpu_threads=1", *sets, "train.bf16=false"]


def test_joey_config_follows_the_recipe(peers):
    r = peers.Recipe()
    c = peers.joey_config(r, Path("/t"), Path("/m"), JOINT, SPM)
    t, m = c["training"], c["model"]
    assert t["scheduling"] == "noam" and t["learning_rate_warmup"] == 200
    assert t["learning_rate_factor"] * 256 ** -0.5 * 200 ** -0.5 == pytest.approx(2.5e-3)
    assert t["learning_rate"] == pytest.approx(2.5e-3 / 200)  # the first update warms up too
    assert t["learning_rate_min"] < t["learning_rate"]
    assert t["adam_betas"] == [0.9, 0.98] and t["clip_grad_norm"] == 1.0
    assert (t["batch_size"], t["batch_type"], t["normalization"]) == (1024, "token", "tokens")
    assert t["validation_freq"] % t["logging_freq"] == 0  # JoeyNMT refuses it otherwise
    for stack in (m["encoder"], m["decoder"]):
        assert (stack["num_layers"], stack["num_heads"], stack["hidden_size"], stack["ff_size"]) == (
            2, 4, 256, 512)
        assert stack["layer_norm"] == "pre" and stack["dropout"] == 0.0
    assert m["tied_embeddings"] and m["tied_softmax"]
    assert m["embed_init_weight"] == pytest.approx(256**-0.5)
    assert (c["testing"]["beam_size"], c["testing"]["beam_alpha"]) == (4, 0.6)
    assert c["testing"]["batch_size"] == 2048  # aiayn's 8192 counts the beam, JoeyNMT's not
    assert "train" in c["data"] and "load_model" not in c["testing"]
    decode = peers.joey_config(r, Path("/t"), Path("/m"), JOINT, SPM, decode=True)
    assert "dev" not in decode["data"] and decode["data"]["test"] == "/t/test"
    assert decode["testing"]["load_model"] == "/m/latest.ckpt"


def test_onmt_noam_peaks_at_the_recipe_rate(peers):
    r = peers.Recipe()
    c = peers.onmt_config(r, Path("/t"), Path("/w"), JOINT, SPM, 29417)

    def noam(step):  # OpenNMT-py's decay_method noam, times its learning_rate
        return c["learning_rate"] * 256**-0.5 * min(step**-0.5, step * 200**-1.5)

    assert noam(200) == pytest.approx(2.5e-3)
    assert noam(1) == pytest.approx(2.5e-3 / 200)
    assert max(noam(s) for s in range(1, 2000)) == pytest.approx(2.5e-3)
    assert (c["enc_layers"], c["dec_layers"], c["heads"], c["hidden_size"], c["transformer_ff"]) == (
        2, 2, 4, 256, 512)
    assert c["share_embeddings"] and c["share_decoder_embeddings"]
    assert c["save_checkpoint_steps"] == 0 and c["data"]["corpus_1"]["path_src"] == "/t/train.src"
    assert c["bucket_size"] == 29417
    args = peers.onmt_translate_args(r, Path("/w/m.pt"), Path("/t/test.src"), Path("/w/h"), SPM)
    assert args[args.index("-alpha") + 1] == "0.6" and args[args.index("-length_penalty") + 1] == "wu"


def test_separate_vocabularies_reach_both_peers(peers, tmp_path):
    """A recipe with one vocabulary per side: one SentencePiece model and vocabulary file per
    side, source embeddings not shared, the target embedding still tied to the output."""
    r = peers.Recipe(joint_vocab=False, vocab_size=5300)
    s = peers.Setup(recipe=r, data=tmp_path, text=Path("/t"), out=tmp_path, venvs=tmp_path,
                    minutes=1, threads=1, aiayn_config=tmp_path, aiayn_weights="best",
                    test_limit=0, epoch_tokens={})
    assert s.spm_models == {"src": Path("/t/spm.src.model"), "tgt": Path("/t/spm.tgt.model")}
    assert s.vocabs == {"src": Path("/t/vocab.src.txt"), "tgt": Path("/t/vocab.tgt.txt")}
    joey = peers.joey_config(r, Path("/t"), Path("/m"), s.vocabs, s.spm_models)
    assert joey["data"]["src"]["voc_file"] == "/t/vocab.src.txt"
    assert joey["data"]["trg"]["tokenizer_cfg"]["model_file"] == "/t/spm.tgt.model"
    assert not joey["model"]["tied_embeddings"] and joey["model"]["tied_softmax"]
    onmt = peers.onmt_config(r, Path("/t"), Path("/w"), s.vocabs, s.spm_models, 10)
    assert (onmt["src_vocab"], onmt["tgt_vocab"]) == ("/t/vocab.src.txt", "/t/vocab.tgt.txt")
    assert not onmt["share_vocab"] and not onmt["share_embeddings"]
    assert onmt["share_decoder_embeddings"] and onmt["tgt_vocab_size"] == 5300
    args = peers.onmt_translate_args(r, Path("/w/m.pt"), Path("/t/test.src"), Path("/w/h"),
                                     s.spm_models)
    assert args[args.index("-tgt_subword_model") + 1] == "/t/spm.tgt.model"
    joint = peers.Setup(**{**s.__dict__, "recipe": peers.Recipe()})
    assert joint.spm_models == SPM and joint.vocabs == JOINT


def test_vocab_pieces_leave_out_the_specials(peers, tmp_path):
    vocab = tmp_path / "spm.vocab"
    vocab.write_text("<unk>\t0\n<pad>\t0\n<s>\t0\n</s>\t0\n▁de\t-0\n▁la\t-1\ná\t-2\n", encoding="utf-8")
    assert peers.vocab_pieces(vocab) == ["▁de", "▁la", "á"]


def test_export_split_refuses_broken_lines(peers, tmp_path):
    peers.export_split([("a\u0301b", "c")], tmp_path / "x")
    assert (tmp_path / "x.src").read_text(encoding="utf-8") == "\u00e1b\n"  # NFC
    with pytest.raises(peers.PeerError, match="spans lines"):
        peers.export_split([("a\u2028b", "c")], tmp_path / "y")


def test_log_parsing(peers):
    log = "x\nPEERS-TOTALS {\"updates\": 3}\nPEERS-TOTALS {\"updates\": 7, \"target_tokens\": 9}\n"
    assert peers.find_mark(log, "PEERS-TOTALS") == {"updates": 7, "target_tokens": 9}
    assert peers.find_mark("nothing", "PEERS-TOTALS") is None
    assert peers.number_after("a Generation took 12.5[sec].", "Generation took") == 12.5
    assert peers.number_after("[2024] INFO Total translation time (s): 31.0\n",
                              "Total translation time (s):") == 31.0
    assert peers.number_after("none", "Generation took") is None


def test_aiayn_precision(peers):
    log = ("model: 7.58M parameters; device cpu, 1 rank(s), compile False; bf16 False (auto: a "
           "probe matmul took 0.9 ms in fp32 and 49.0 ms in bf16 on this CPU (AVX2)); 2 CPU "
           "thread(s); schedule linear")
    precision, why = peers.aiayn_precision(log)
    assert precision == "fp32" and why.startswith("auto: a probe matmul") and why.endswith("(AVX2)")
    assert peers.aiayn_precision("; bf16 True (forced); 1 CPU thread(s)") == ("bf16", "forced")
    assert peers.aiayn_precision("compile False; precision fp16 (auto: this GPU has no "
                                 "bfloat16, so float16 with a gradient scaler); 1 CPU "
                                 "thread(s)") == (
        "fp16", "auto: this GPU has no bfloat16, so float16 with a gradient scaler")
    assert peers.aiayn_precision("nothing") == ("unknown", "")


def test_aiayn_counts(peers):
    records = [{"kind": "train", "step": 10, "elapsed_s": 5.0, "tokens": 900},
               {"kind": "dev", "step": 400, "elapsed_s": 200.0, "tokens": 4e5, "eval_s": 6.0},
               {"kind": "train", "step": 410, "elapsed_s": 206.0, "tokens": 410_000},
               {"kind": "dev", "step": 412, "elapsed_s": 207.0, "tokens": 412_000, "eval_s": 20.0}]
    assert peers.aiayn_counts(records) == {"updates": 412, "target_tokens": 412_000, "train_s": 207.0,
                                           "validation_s": 6.0, "final_validation_s": 20.0}


def test_score_and_table(peers):
    s = peers.score(["the cat sat on the mat"], ["the cat sat on the mat"])
    assert s["bleu"] == pytest.approx(100) and s["chrf"] == pytest.approx(100)
    assert "tok:13a" in s["bleu_signature"]
    with pytest.raises(peers.PeerError):
        peers.score(["a"], ["a", "b"])
    rows = [{"toolkit": "aiayn", "updates": 1700, "target_tokens": 1_500_000, "tokens_per_s": 2083.3,
             "bleu": 18.91, "chrf": 45.0, "decode_s": 50.04, "precision": "fp32", "epochs": 1.6,
             "search_s": None, "startup_s": 3.0, "weights": "last"},
            {"toolkit": "joeynmt", "error": "exited with status 1: a | b"}]
    table = peers.results_table(rows, 12)
    assert "| aiayn | 1,700 | 1,500,000 | 2,083 | 18.91 | 45.00 | 50.0 |" in table
    assert "| joeynmt | failed: exited with status 1: a / b |" in table
    assert "| aiayn | fp32 | 882 | 1.60 | - | 3 | last |" in table


def test_rerun_keeps_rows_of_the_same_recipe_only(peers, tmp_path):
    """--only reruns keep the other toolkits' rows when budget, data, test sentences and
    --set overrides are the same; rows of another recipe are dropped."""
    path = tmp_path / "results.json"
    meta = {"minutes": 12, "data": "/d", "test_limit": 0, "config_sets": []}
    path.write_text(json.dumps({**meta, "rows": [{"toolkit": "joeynmt"}]}))
    assert peers.load_rows(path, meta) == [{"toolkit": "joeynmt"}]
    assert peers.load_rows(path, {**meta, "config_sets": ["train.peak_lr=1.5e-3"]}) == []
    legacy = {k: v for k, v in meta.items() if k != "config_sets"}  # before --set existed
    path.write_text(json.dumps({**legacy, "rows": [{"toolkit": "opennmt"}]}))
    assert peers.load_rows(path, meta) == [{"toolkit": "opennmt"}]


def test_bad_set_is_one_line_and_writes_nothing(peers, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        peers.main(["--only", "aiayn", "--set", "train.nope=1", "--out", str(out)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "error: --set 'train.nope=1': unknown setting train.nope" in err.strip().splitlines()[-1]
    assert not out.exists()
