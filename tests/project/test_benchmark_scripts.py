"""The benchmark scripts still start: each one's --help runs (its imports resolve, its options
parse), and every aiayn name a script uses exists (read from its source, so a name used only
in a section that --help never reaches counts too: benchmarks/gpu.py once read and patched
search functions the translator no longer had, and died after spending its GPU time on the
sections before). benchmarks/gpu.py's sections run here on the CPU with tiny sizes, and so do
the scripts that once broke where --help could not see it (time_to_bleu.py importing a name
that had moved; server_cost.py and serve_screenshot.py building serve_load's options by hand
without a newer one; speed.py and bf16_shapes.py after the searches' and the regularisation's
settings changed); benchmarks/README.md measures with them all."""

import ast
import importlib
import json
import math
import re
import runpy
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p for p in [*BENCHMARKS.glob("*.py"), *BENCHMARKS.glob("*/*.py")]
                 if 'if __name__ == "__main__":' in p.read_text(encoding="utf-8"))


def test_the_scripts_are_found():
    names = {p.name for p in SCRIPTS}
    assert {"time_to_bleu.py", "threads.py", "step_cost.py", "run.py"} <= names
    assert "common.py" not in names  # a library of the scripts, not one itself


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_help_runs(script, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(script.parent))  # as `python benchmarks/X.py` would
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out


def test_time_to_bleu_plots_one_panel_with_tokens_only(tmp_path, monkeypatch, capsys):
    """plot --tokens-only draws BLEU against tokens alone: one panel, half the width."""
    from PIL import Image

    curve = tmp_path / "run.json"
    curve.write_text('{"label": "a", "curve": [{"step": 1, "minutes": 1.0, "tokens": 1000000, '
                     '"bleu": 5.0, "chrf": 20.0, "n_sentences": 10}, {"step": 2, "minutes": '
                     '2.0, "tokens": 2000000, "bleu": 9.0, "chrf": 30.0, "n_sentences": 10}]}',
                     encoding="utf-8")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    widths = {}
    for name, extra in (("both", []), ("tokens", ["--tokens-only"])):
        out = tmp_path / f"{name}.png"
        monkeypatch.setattr(sys, "argv", ["time_to_bleu.py", "plot", str(curve), "-o", str(out),
                                          *extra])
        runpy.run_path(str(BENCHMARKS / "time_to_bleu.py"), run_name="__main__")
        with Image.open(out) as image:
            widths[name] = image.width
    assert widths["tokens"] < 0.7 * widths["both"]
    assert '"bleu": 9.0' in capsys.readouterr().out


def test_the_scripts_on_a_run_read_its_options_alike(monkeypatch):
    """engines.py, threads.py and decode.py take a run, its sentences and the search through
    benchmarks/common.py, so one option means one thing with one default in all three."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    parsed = {}
    for name in ("engines.py", "threads.py", "decode.py"):
        parse_args = runpy.run_path(str(BENCHMARKS / name))["parse_args"]
        parsed[name] = vars(parse_args(["--run-dir", "runs/x", "--beam", "2"]))
    shared = ("run_dir", "weights", "beam", "decode_tokens", "repeats")
    assert parsed["engines.py"]["split"] == parsed["threads.py"]["split"] == "test"
    assert {n: {k: a[k] for k in shared} for n, a in parsed.items() if n != "decode.py"} == {
        n: {"run_dir": "runs/x", "weights": "best", "beam": 2, "decode_tokens": 8192, "repeats": 2}
        for n in ("engines.py", "threads.py")}
    assert parsed["decode.py"]["run_dir"] == "runs/x" and parsed["decode.py"]["beam"] == 2


def test_print_table_writes_what_it_prints_as_json(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import common

    out = tmp_path / "table.json"
    common.print_table(["engine", "sentences/s"], [["aiayn", "12.5"], ["other", "3.0"]],
                       "10 test sentences of runs/x", str(out))
    printed = capsys.readouterr().out
    record = json.loads(out.read_text(encoding="utf-8"))
    assert record["headers"] == ["engine", "sentences/s"]
    assert record["rows"] == [["aiayn", "12.5"], ["other", "3.0"]]
    assert record["conditions"] in printed and "| aiayn | 12.5 |" in printed
    assert record["device"]  # the machine the figures were measured on


def test_step_cost_prices_a_recipe_whose_regularisation_is_auto(tmp_path, monkeypatch, capsys):
    """step_cost.py's own default, configs/demo.yaml, says dropout and label smoothing "auto":
    numbers only once a run knows its passes. The script takes them as a run of --passes
    would (none given: 0, as a timed run starts) and a variant's own value stays its own; a
    variant's optimizer is the one aiayn train builds for it."""
    import yaml

    config = yaml.safe_load((BENCHMARKS.parent / "configs" / "demo.yaml").read_text())
    config["model"].update(d_model=32, n_heads=2, d_ff=64, n_encoder_layers=1,
                           n_decoder_layers=1)
    config["data"]["vocab_size"] = 300
    config["model"]["max_len"] = 64
    config["train"]["max_tokens"] = 128
    assert config["model"]["dropout"] == config["train"]["label_smoothing"] == "auto"
    path = tmp_path / "tiny-auto.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    main = runpy.run_path(str(BENCHMARKS / "step_cost.py"))["main"]
    for passes, chosen in ((None, "dropout 0, label smoothing 0"),
                           (6.0, "dropout 0.1, label smoothing 0.1")):
        argv = ["--config", str(path), "--batches", "1", "--reps", "1", "--output-pieces", "200",
                "--variant", "drop=model.dropout=0.3", "--variant", "muon=train.optimizer=muon",
                "--mfu"]
        assert main(argv + ([] if passes is None else ["--passes", str(passes)])) == 0
        printed = capsys.readouterr().out
        assert f"regularisation: {chosen}" in printed
        assert "| recipe |" in printed and "| drop |" in printed and "| muon |" in printed
        assert re.search(r"\| MFU \(peak [\d,]+ GFLOP/s\) \|", printed)
        assert re.search(r"\| recipe \|.*\| \d+% \|", printed)


# ---------------------------------------------------------------- names that rot
def module_or_none(name: str) -> ModuleType | None:
    """aiayn's module ``name``, or None where there is none (a missing module of aiayn's; an
    error inside it, or an optional package it needs, is not a name of the script's)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (exc.name == name or name.startswith(exc.name + ".")):
            return None
        pytest.skip(f"{name} needs {exc.name}, not installed here")


def has_name(module: ModuleType, attr: str) -> bool:
    """``module.attr`` exists: an attribute, or a submodule of a package."""
    if hasattr(module, attr):
        return True
    return hasattr(module, "__path__") and module_or_none(f"{module.__name__}.{attr}") is not None


def missing_aiayn_names(source: str) -> list[str]:
    """The aiayn names ``source`` uses that do not exist: modules of ``import aiayn...`` and
    ``from aiayn... import``, the names imported, and attributes read or written on a name
    bound to an aiayn module (``from aiayn.training import loop as train``; ``train.X``), to
    any depth while the attribute is a module. Names are taken per file, not per scope."""
    tree = ast.parse(source)
    modules: dict[str, ModuleType] = {}  # a name in the script -> the aiayn module it is
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "aiayn":
                    continue
                module = module_or_none(alias.name)
                if module is None:
                    missing.append(f"import {alias.name}")
                elif alias.asname:
                    modules[alias.asname] = module
                else:
                    modules["aiayn"] = module_or_none("aiayn")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == "aiayn":
            module = module_or_none(node.module)
            if module is None:
                missing.append(f"from {node.module} import ...")
                continue
            for alias in node.names:
                if not has_name(module, alias.name):
                    missing.append(f"from {node.module} import {alias.name}")
                    continue
                value = getattr(module, alias.name, None) or module_or_none(
                    f"{node.module}.{alias.name}")
                if isinstance(value, ModuleType):
                    modules[alias.asname or alias.name] = value
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain = []  # root.a.b -> ["b", "a"], root
        value: ast.expr = node
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if not (isinstance(value, ast.Name) and value.id in modules):
            continue
        obj: object = modules[value.id]
        path = value.id
        for attr in reversed(chain):
            if not isinstance(obj, ModuleType):
                break
            if not has_name(obj, attr):
                missing.append(f"{path}.{attr} ({obj.__name__})")
                break
            obj = getattr(obj, attr, None) or module_or_none(f"{obj.__name__}.{attr}")
            path += f".{attr}"
    return sorted(set(missing))


ALL_SCRIPTS = sorted([*BENCHMARKS.glob("*.py"), *BENCHMARKS.glob("*/*.py")])


@pytest.mark.parametrize("script", ALL_SCRIPTS, ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_every_aiayn_name_a_benchmark_uses_exists(script):
    assert missing_aiayn_names(script.read_text(encoding="utf-8")) == []


def test_a_name_that_is_gone_is_found_wherever_the_script_uses_it():
    """The check itself: names read, patched or imported that aiayn does not have."""
    gone = missing_aiayn_names(
        "import aiayn.inference.nowhere\n"
        "from aiayn.inference import translator as translator_module\n"
        "from aiayn.training import loop as train_module, nothing_here\n"
        "from aiayn.inference.translator import Translator, greedy_decode\n"
        "import aiayn.model as m\n"
        "def bench():\n"
        "    keep = (translator_module.beam_search, translator_module.Translator)\n"
        "    train_module.collates_ahead = lambda device: True\n"  # there: no complaint
        "    train_module.greedy_decode = None\n"
        "    return m.Transformer, m.TransformerXL, aiayn.inference.search.decode_beam\n")
    assert gone == sorted([
        "import aiayn.inference.nowhere",
        "from aiayn.training import nothing_here",
        "from aiayn.inference.translator import greedy_decode",
        "translator_module.beam_search (aiayn.inference.translator)",
        "train_module.greedy_decode (aiayn.training.loop)",
        "m.TransformerXL (aiayn.model)",
    ])
    # A bare `import aiayn.X` binds aiayn, whose submodules are then checked too.
    assert missing_aiayn_names("import aiayn.model\naiayn.modle.Transformer\n") == [
        "aiayn.modle (aiayn)"]


# ---------------------------------------------------------------- gpu.py on the CPU
@pytest.mark.slow
def test_the_gpu_session_runs_every_section_on_the_cpu(run_dir, tmp_path):
    """benchmarks/gpu_session.sh --quick (benchmarks/gpu.py --device cpu --quick) on a tiny
    run and its data: each section (step with fp16, loop, decode, profile) runs and leaves
    its own JSON, the profile tables and the log in OUT."""
    import os
    import subprocess

    out = tmp_path / "out"
    data = (run_dir / "data_dir.txt").read_text(encoding="utf-8").strip()
    env = {**os.environ, "DATA": data, "RUN": str(run_dir), "OUT": str(out),
           "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(BENCHMARKS / "gpu_session.sh"), "--quick"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu.decode.json", "gpu.loop.json", "gpu.profile.json", "gpu.step.json",
        "profile_decode.txt", "profile_decode_bf16.txt", "profile_step.txt", "session.log"]
    result = {s: json.loads((out / f"gpu.{s}.json").read_text(encoding="utf-8"))[s]
              for s in ("step", "loop", "decode", "profile")}
    step = result["step"][0]
    for name in ("aiayn", "nn.Transformer", "aiayn fp16"):
        assert step[name]["tokens_per_s"] > 0
    assert step["aiayn fp16"]["steps"] >= 3 and step["aiayn fp16"]["skipped_steps"] >= 0
    loop = result["loop"][0]
    assert loop["steps"] > 0 and loop["collate_ahead"] and loop["precision"] in ("fp32", "bf16")
    settings = {(r["model"], r["beam"], r["setting"]) for r in result["decode"]}
    assert len(settings) == 3 * 4  # demo beam 4 and greedy, the loop's model beam 4
    assert all(r["sentences_per_s"] > 0 and 0 <= r["same_as_first_setting"] <= 1
               for r in result["decode"])
    assert set(result["profile"]) == {"decode_demo_beam4", "decode_demo_beam4_bf16",
                                      "train_step_base"}
    assert "aten::" in (out / "profile_decode_bf16.txt").read_text(encoding="utf-8")


# ---------------------------------------------------------------- translate_file.py, quick
def test_translate_file_times_the_command_against_one_batch(run_dir, tmp_path, monkeypatch,
                                                            capsys):
    """benchmarks/translate_file.py at a small size (enough lines that the tiny model's work
    stands out of the noise of the command's start, which a few lines do not: then the
    rate is left out, not made up): the command's and the batch's lines/s, their ratio, and
    the row with its conditions as JSON."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    main = runpy.run_path(str(BENCHMARKS / "translate_file.py"))["main"]
    out = tmp_path / "row.json"
    # 30,000 lines: ~2.5 s of the tiny model's work, well above the start's noise of ~0.5 s
    # on a loaded 2-core machine (8,000 lines, ~0.7 s, fell within it there).
    rows = main(["--run-dir", str(run_dir), "--lines", "30000", "--chunk-lines", "10000", "30000",
                 "--repeats", "1", "--json", str(out)])
    record = json.loads(out.read_text(encoding="utf-8"))
    assert record["rows"] == [{**row, "conditions": "30000-lines-beam1"} for row in rows]
    assert [row["chunk_lines"] for row in rows] == [10000, 30000]
    assert {"title", "order", "about", "columns"} <= set(record)  # a results-page table
    row = rows[-1]
    assert row["command_lines_per_s"] > 0 and row["batch_lines_per_s"] > 0
    # The ratio is kept to 3 decimals and the rates to 1: at a tiny, loaded size the ratio
    # can be ~0.01, where its own rounding alone is several percent.
    assert row["ratio"] == pytest.approx(row["command_lines_per_s"] / row["batch_lines_per_s"],
                                         rel=0.02, abs=5e-4)
    assert 0.9 <= row["same_lines"] <= 1  # greedy: the same lines but a float's rare flip
    assert {"command", "commit", "cpu", "torch", "load", "date"} <= set(
        record["conditions"]["30000-lines-beam1"])
    assert "ratio" in capsys.readouterr().out


# ---------------------------------------------------------------- server_cost.py, quick
def test_server_cost_prices_each_kind_of_request_against_health(run_dir, tmp_path, monkeypatch):
    """benchmarks/server_cost.py end to end on the tiny run: it starts the server as
    serve_load.py does (a server option added there needs nothing here) and prices three
    kinds of request against GET /health."""
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    main = runpy.run_path(str(BENCHMARKS / "server_cost.py"))["main"]
    out = tmp_path / "cost.json"
    main([str(run_dir), "--requests", "150", "--repeats", "1", "--clients", "2",
          "--json", str(out)])
    rows = json.loads(out.read_text(encoding="utf-8"))["rows"]
    assert [row[0] for row in rows] == ["GET /health", "POST /translate 'Amen.'",
                                        "POST /translate, a test verse"]
    assert all(float(row[1]) >= 0 and float(row[3]) > 0 for row in rows)
    assert rows[0][2] in ("1.00x", "n/a (/health took under a clock tick)")


# ---------------------------------------------------------------- lane_steps.py, quick
def test_lane_steps_splits_a_steps_python_by_kind_of_step(run_dir, tmp_path, monkeypatch):
    """benchmarks/lane_steps.py end to end on the tiny run with int8: a row a size, with the
    kernels' share and the microseconds of Python at a quiet step and at a step at a change
    (a sentence ending at it, or one joined or ended just before it)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    main = runpy.run_path(str(BENCHMARKS / "lane_steps.py"))["main"]
    out = tmp_path / "lanes.json"
    main(["--run-dir", str(run_dir), "--int8", "--limit", "12", "--sizes", "1,3", "--repeats",
          "1", "--json", str(out)])
    record = json.loads(out.read_text(encoding="utf-8"))
    assert record["headers"][6:8] == ["us of Python a quiet step", "a step at a change"]
    rows = record["rows"]
    assert [row[0] for row in rows] == ["1", "3"]
    for row in rows:
        assert row[3].endswith("%") and float(row[7]) > 0 and float(row[6]) >= 0


# ---------------------------------------------------------------- kernel_ab.py, quick
def test_kernel_ab_compares_the_kernels_of_two_revisions_in_one_process(run_dir, tmp_path,
                                                                        monkeypatch, capsys):
    """benchmarks/kernel_ab.py against this checkout's own revision: both libraries decode
    the same translations and a ratio per size comes out (near 1 here, but a tiny model's
    passes are too short to hold it to that); a revision git does not know is one line."""
    from aiayn.inference import native

    if not native.cpu_supported():
        pytest.skip("int8 decoding needs AVX2")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    main = runpy.run_path(str(BENCHMARKS / "kernel_ab.py"))["main"]
    out = tmp_path / "ab.json"
    main(["--run-dir", str(run_dir), "--against", "HEAD", "--sizes", "1,4", "--limit", "12",
          "--pairs", "2", "--json", str(out)])
    record = json.loads(out.read_text(encoding="utf-8"))
    assert [row[0] for row in record["rows"]] == ["1", "4"]
    assert all(row[4] == "yes" and float(row[1]) > 0 for row in record["rows"])
    assert "against those of HEAD" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--against no-such-rev: git cannot show"):
        main(["--run-dir", str(run_dir), "--against", "no-such-rev", "--limit", "2"])


# ---------------------------------------------------------------- serve_load.py's clients
def _stub_translator(close_every: int):
    """An HTTP/1.1 server whose POST /translate answers {"translations": [TEXT upper-cased]}
    (500 for "FAIL"), and closes a kept connection after every ``close_every``-th answer
    without saying so, as a server does with an idle one; counts its connections."""
    import http.server
    import threading

    connections = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self):
            super().setup()
            connections.append(self.client_address)
            self.answered = 0

        def do_POST(self):
            text = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["text"][0]
            body = json.dumps({"translations": [text.upper()]}).encode()
            self.send_response(500 if text == "fail" else 200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.answered += 1
            if self.answered % close_every == 0:
                self.close_connection = True

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, connections


@pytest.mark.parametrize("keep_alive", [True, False], ids=["kept", "new"])
def test_serve_load_clients_read_every_answer_in_order(monkeypatch, keep_alive):
    """The load test's clients (one thread for all of them) give each sentence its own
    answer, in the order sent; a kept connection the server closed is opened anew and the
    request sent again, not lost; a non-200 answer is a lost one (None)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    serve_load = importlib.import_module("serve_load")
    server, connections = _stub_translator(close_every=3)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        sentences = [f"sentence {i}" for i in range(40)] + ["fail", "last"]
        answers, latencies, wall = serve_load.load(url, sentences, 4, 4, 0.6, keep_alive)
    finally:
        server.shutdown()
        server.server_close()
    assert answers == [s.upper() for s in sentences[:40]] + [None, "LAST"]
    assert len(latencies) == len(sentences) and all(0 < s <= wall for s in latencies)
    if keep_alive:  # 3 requests a connection before the server closes it (a client's last fewer)
        assert math.ceil(len(sentences) / 3) <= len(connections) <= len(sentences) / 3 + 4
    else:
        assert len(connections) == len(sentences)


def test_serve_load_clients_count_every_request_lost_when_the_server_is_gone(monkeypatch):
    """A server that is not there: every request counts lost (None), however many there
    are (each failed send takes the next job in a loop, not a deeper call)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    serve_load = importlib.import_module("serve_load")
    url = f"http://127.0.0.1:{serve_load.free_port()}"  # nothing listens there
    sentences = [f"sentence {i}" for i in range(3000)]  # > Python's recursion limit
    answers, latencies, _ = serve_load.load(url, sentences, 4, 4, 0.6)
    assert answers == [None] * len(sentences) and len(latencies) == len(sentences)


# ---------------------------------------------------------------- the scripts that had rotted
def test_speed_decodes_exactly_its_steps_with_the_cache_and_without(monkeypatch, capsys):
    """benchmarks/speed.py's decoding half (its training half takes a minute): greedy search
    with EOS forbidden (an output kernel) runs exactly its 100 tokens a sentence at any
    source length, the cache and recomputing giving the same tokens (the script checks the
    lengths and stops otherwise)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    main = runpy.run_path(str(BENCHMARKS / "speed.py"))["main"]
    main(["--quick", "--skip-train", "--threads", "1", "--decode-reps", "1"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| small |")]
    assert len(rows) == 2 and all(line.rstrip().endswith("| 100% |") for line in rows)
    assert "Training step" not in out  # no empty table for the half that did not run


def test_speed_times_a_training_step_against_nn_transformer(monkeypatch, capsys):
    """benchmarks/speed.py's training half on the tiny config: aiayn's step and
    nn.Transformer's, in fp32 and bf16, a positive rate each; a config too short for the
    decoding half's 100 steps is one line that says to skip it."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    main = runpy.run_path(str(BENCHMARKS / "speed.py"))["main"]
    main(["--quick", "--configs", "tiny", "--skip-decode", "--threads", "1", "--reps", "1"])
    out = capsys.readouterr().out
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| tiny |")]
    assert [r[2].strip() for r in rows] == ["fp32", "bf16"]
    assert all(float(r[4].replace(",", "")) > 0 and float(r[5].replace(",", "")) > 0
               for r in rows)
    assert "Greedy decoding" not in out
    with pytest.raises(SystemExit):
        main(["--quick", "--configs", "tiny", "--skip-train"])
    assert "holds fewer than the 100 decoding steps; add --skip-decode" in capsys.readouterr().err


@pytest.mark.slow
def test_bf16_shapes_trains_the_demo_preset_in_both_arms(tmp_path):
    """benchmarks/bf16_shapes.py end to end (fp32, which every CPU runs at speed): each arm
    trains the demo preset, its "auto" regularisation resolved as a run resolves it, in a
    process of its own, and the padded arm's ratio is printed."""
    import subprocess

    from helpers import write_prepared

    data = write_prepared(tmp_path / "data")
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bf16_shapes.py"), "--data", str(data),
                           "--steps", "2", "--reps", "1", "--multiple", "8", "--precision", "fp32",
                           "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert re.search(r"padded to 8: [\d,]+ tok/s, \d+\.\d\dx", done.stdout), done.stdout


@pytest.mark.slow
def test_serve_screenshot_starts_the_server_as_serve_load_does(run_dir, tmp_path):
    """benchmarks/serve_screenshot.py on the tiny run: it starts the server from serve_load's
    own options (a server option added there needs nothing here), translates on the page in
    Chromium and saves the page as a PNG."""
    import shutil
    import subprocess

    pytest.importorskip("selenium", reason="selenium is not installed")
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    if not ((shutil.which("chromium") or shutil.which("chromium-browser"))
            and shutil.which("chromedriver")):
        pytest.skip("Chromium is missing: apt-get install chromium chromium-driver")
    png = tmp_path / "serve.png"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "serve_screenshot.py"), str(run_dir),
                           "-o", str(png), "--sentence", "a b c", "--layer", "1", "--head", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "translation:" in done.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_gpu_section_that_fails_leaves_its_traceback_and_the_next_sections_run(
        run_dir, tmp_path, monkeypatch):
    """benchmarks/gpu.py: a section that raises saves its traceback in its own JSON and the
    sections after it still run (a GPU session has no time for a second start); the status
    says something failed. A run that is not there fails before any section starts."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    main = runpy.run_path(str(BENCHMARKS / "gpu.py"))["main"]

    def boom(*args, **kwargs):
        raise RuntimeError("the loop broke")

    monkeypatch.setitem(main.__globals__, "bench_loop", boom)
    data = (run_dir / "data_dir.txt").read_text(encoding="utf-8").strip()
    out = tmp_path / "gpu.json"
    common = ["--data", data, "--device", "cpu", "--quick", "--out", str(out)]
    assert main([*common, "--run", str(run_dir), "--sections", "loop,decode"]) == 1
    loop = json.loads((tmp_path / "gpu.loop.json").read_text(encoding="utf-8"))
    assert "RuntimeError: the loop broke" in loop["loop_error"]
    decode = json.loads((tmp_path / "gpu.decode.json").read_text(encoding="utf-8"))["decode"]
    assert decode and all(r["sentences_per_s"] > 0 for r in decode)
    from aiayn.errors import AiaynError

    with pytest.raises(AiaynError, match="run directory not found"):
        main([*common, "--run", str(tmp_path / "gone"), "--sections", "step,decode"])
    assert not (tmp_path / "gpu.step.json").exists()
