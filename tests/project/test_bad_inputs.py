"""Bad inputs and faults, through the real command line (a process per case: forked from
one that has imported aiayn, tests/forked_cli.py, or a fresh one where the case needs its own
environment or must be killed).

Every case must end with: a non-zero exit (or the documented graceful result), exactly
one line on stderr that starts with "aiayn: error:", names the setting or path, and
holds no traceback; and every file of the run and data directories byte-identical
before and after. The faults that need a hook inside the process (a full disk, a kill
during a save) run in-process at the end.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from forked_cli import ForkedCLIs
from helpers import snapshot, toy_tsv

from aiayn import cli
from aiayn.runs import checkpoint
from aiayn.runs.checkpoint import load_train_state
from aiayn.util import io
from aiayn.util.lock import locked

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
WORDS = "the a red blue cat dog sun sea big small house tree eats sees and old".split()


def fresh_aiayn(*args: str, stdin: bytes | None = None, env: dict | None = None,
                cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiayn", *map(str, args)], input=stdin,
                          capture_output=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, "PYTHONWARNINGS": "default", **(env or {})})


@pytest.fixture(scope="module")
def aiayn():
    """`python -m aiayn ARGS` run as ``subprocess.run`` would (``stdin``, ``cwd``,
    ``timeout``), in a process forked from one that has imported aiayn; with ``env``, in a
    fresh process under that environment."""
    servers = ForkedCLIs(env={**os.environ, "PYTHONWARNINGS": "default"}, cwd=ROOT)

    def run(*args, stdin: bytes | None = None, env: dict | None = None, cwd: Path = ROOT,
            timeout: float = 120) -> subprocess.CompletedProcess:
        if env is not None:
            return fresh_aiayn(*args, stdin=stdin, env=env, cwd=cwd, timeout=timeout)
        return servers.run(*args, stdin=stdin, cwd=cwd, timeout=timeout)

    yield run
    servers.close()


def one_error_line(result: subprocess.CompletedProcess) -> str:
    err = result.stderr.decode("utf-8")
    assert "Traceback" not in err, err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("aiayn: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """A prepared data directory and a tiny trained run (8 steps, saved at 4 and 8)."""
    root = tmp_path_factory.mktemp("bad-inputs")
    corpus = toy_tsv(root / "pairs.tsv", WORDS, lengths=(2, 8), copy=True)
    data, run = root / "data", root / "run"
    settings = ["--set", "data.tokenizer=wordlevel", "--set", "data.dev_fraction=0.05",
                "--set", "data.test_fraction=0.05"]
    assert cli.main(["prepare", "--corpus", f"tsv:{corpus}", "--config", str(TINY),
                     "--out", str(data), *settings]) == 0
    assert cli.main(["train", "--config", str(TINY), "--data", str(data), "--out", str(run),
                     "--set", "train.max_steps=8", "--set", "train.save_every=4",
                     "--set", "train.eval_every=4", "--set", "train.keep_checkpoints=2"]) == 0
    return {"root": root, "data": data, "run": run, "corpus": corpus}


def copy_run(world, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(world["run"], run)
    return run


# Each case: (id, arguments (RUN, DATA, TMP, CORPUS are placeholders), what the error line
# must contain, set-up of TMP before the command (or None)).
def _empty_config(tmp: Path) -> None:
    (tmp / "empty.yaml").write_text("# nothing here\n", encoding="utf-8")


def _bad_beta(tmp: Path) -> None:
    (tmp / "beta.yaml").write_text(TINY.read_text() + "  adam_beta1: 1.5\n", encoding="utf-8")


def _a_file(tmp: Path) -> None:
    (tmp / "file").write_text("not a directory\n", encoding="utf-8")


def _a_dir(tmp: Path) -> None:
    (tmp / "dir").mkdir()


def _a_picture_dir(tmp: Path) -> None:
    (tmp / "dir.png").mkdir()


def _sentences(tmp: Path) -> None:
    (tmp / "in.txt").write_text("the red cat\n", encoding="utf-8")


def _sentences_and_link(tmp: Path) -> None:
    _sentences(tmp)
    (tmp / "link.txt").symlink_to(tmp / "in.txt")


def _pairs(tmp: Path) -> None:
    (tmp / "pairs.tsv").write_text("the red cat\tel gato rojo\n", encoding="utf-8")


CASES = [
    # 0. argument errors: one line and a pointer to --help, not the whole usage
    ("evaluate --split nosuch", ["evaluate", "RUN", "--split", "nosuch"],
     "argument --split: invalid choice: 'nosuch' (choose from 'test', 'dev') "
     "(see `aiayn evaluate --help`)", None),
    ("export --to onnx", ["export", "RUN", "--to", "onnx", "--out", "TMP/x"],
     "argument --to: invalid choice: 'onnx'", None),
    ("an unknown option", ["translate", "RUN", "--bem", "4"],
     "unrecognized arguments: --bem 4 (see `aiayn translate --help`)", None),
    ("an unknown option before the command", ["--verbose", "translate", "RUN"],
     "unrecognized arguments: --verbose (before the command; see `aiayn --help`)", None),
    ("a sentence given to translate", ["translate", "RUN", "The Lord is my shepherd."],
     "unrecognized arguments: The Lord is my shepherd.; translate reads its sentences from "
     "stdin or -i FILE", None),
    ("a number that is not", ["translate", "RUN", "--beam", "four"],
     "argument --beam: invalid int value: 'four' (see `aiayn translate --help`)", None),
    # 1. what used to end in a traceback
    ("translate -i DIR", ["translate", "RUN", "-i", "TMP/dir"], "-i TMP/dir: is a directory",
     _a_dir),
    ("translate -o DIR", ["translate", "RUN", "-i", "TMP/in.txt", "-o", "TMP"],
     "-o TMP: is a directory", _sentences),
    ("evaluate -o DIR", ["evaluate", "RUN", "-o", "TMP"], "-o TMP: is a directory", None),
    ("evaluate -o X.json", ["evaluate", "RUN", "-o", "TMP/hyp.json"],
     "-o TMP/hyp.json: the scores are written to the output's name with .json", None),
    # an output that is a directory, refused before the work (not by the rename at its end)
    ("average -o DIR", ["average", "RUN", "-o", "TMP"], "-o TMP: is a directory, not a file",
     None),
    ("plot -o DIR.png", ["plot", "RUN", "-o", "TMP/dir.png"],
     "-o TMP/dir.png: is a directory, not a file", _a_picture_dir),
    ("plot --pe -o DIR.png", ["plot", "--pe", "-o", "TMP/dir.png"],
     "-o TMP/dir.png: is a directory, not a file", _a_picture_dir),
    ("trace --png DIR.png", ["trace", "--config", str(TINY), "--png", "TMP/dir.png"],
     "--png TMP/dir.png: is a directory, not a file", _a_picture_dir),
    ("attention -o FILE", ["attention", "RUN", "the red cat", "-o", "TMP/file"],
     "-o TMP/file: exists and is not a directory", _a_file),
    # an output that is the input would replace the text being read
    ("translate -o IN", ["translate", "RUN", "-i", "TMP/in.txt", "-o", "TMP/in.txt"],
     "-o TMP/in.txt: is the file -i reads", _sentences),
    ("translate -o a link to IN", ["translate", "RUN", "-i", "TMP/in.txt", "-o", "TMP/link.txt"],
     "-o TMP/link.txt: is the file -i reads", _sentences_and_link),
    ("score -o IN", ["score", "RUN", "-i", "TMP/pairs.tsv", "-o", "TMP/pairs.tsv"],
     "-o TMP/pairs.tsv: is the file -i reads", _pairs),
    ("train --out FILE", ["train", "--config", str(TINY), "--data", "DATA", "--out", "TMP/file"],
     "--out TMP/file: exists and is not a directory", _a_file),
    ("prepare --out FILE", ["prepare", "--corpus", "tsv:CORPUS", "--out", "TMP/file"],
     "--out TMP/file: exists and is not a directory", _a_file),
    ("adam_beta1 out of range", ["train", "--config", "TMP/beta.yaml", "--data", "DATA",
                                 "--out", "TMP/new"],
     "train.adam_beta1 must be in [0, 0.9999], got 1.5", _bad_beta),
    ("trace --depth -1", ["trace", "--config", str(TINY), "--depth", "-1"],
     "--depth must be at least 0", None),
    ("trace --batch-size 0", ["trace", "--config", str(TINY), "--batch-size", "0"],
     "--batch-size must be at least 1", None),
    ("plot --pe --positions 0", ["plot", "--pe", "--positions", "0", "-o", "TMP/pe.png"],
     "--positions must be at least 2", None),
    ("plot --pe --positions 1", ["plot", "--pe", "--positions", "1", "-o", "TMP/pe.png"],
     "--positions must be at least 2, got 1", None),
    ("plot --pe --d-model 3", ["plot", "--pe", "--d-model", "3", "-o", "TMP/pe.png"],
     "--d-model must be even and at least 2", None),
    # 2. nonsense that used to be accepted
    ("negative lr_scale", ["train", "--config", str(TINY), "--data", "DATA", "--out", "TMP/new",
                           "--set", "train.lr_scale=-1"],
     "train.lr_scale must be in (0, inf), got -1", None),
    # the flag's one range, not train.max_minutes' [0, inf) (its 0 is no time limit)
    ("--max-minutes -1", ["train", "--config", str(TINY), "--data", "DATA", "--out", "TMP/new",
                          "--max-minutes", "-1"],
     "--max-minutes -1: a time budget must be in (0, inf) minutes; for no time limit", None),
    ("--max-minutes nan", ["train", "--config", str(TINY), "--data", "DATA", "--out", "TMP/new",
                           "--max-minutes", "nan"],
     "--max-minutes nan: a time budget must be in (0, inf) minutes", None),
    ("resume --max-minutes nan", ["train", "--resume", "RUN", "--max-minutes", "nan"],
     "--max-minutes nan: a time budget must be in (0, inf) minutes", None),
    ("evaluate --max-tokens 0", ["evaluate", "RUN", "--max-tokens", "0"],
     "--max-tokens must be between 1 and", None),
    ("translate --max-tokens huge", ["translate", "RUN", "-i", "TMP/in.txt", "--max-tokens",
                                     "10000000000000"], "--max-tokens must be between 1 and",
     _sentences),
    ("empty config file", ["train", "--config", "TMP/empty.yaml", "--data", "DATA", "--out",
                           "TMP/new"], "TMP/empty.yaml: the config file is empty", _empty_config),
    ("dropout 1", ["train", "--config", str(TINY), "--data", "DATA", "--out", "TMP/new",
                   "--set", "model.dropout=1.0"], "model.dropout must be in [0, 0.999]", None),
    ("warmup 0", ["train", "--config", str(TINY), "--data", "DATA", "--out", "TMP/new",
                  "--set", "train.warmup_steps=0"], "train.warmup_steps must be in [1, inf)", None),
    ("decode.beam 0", ["train", "--config", str(TINY), "--data", "DATA", "--out", "TMP/new",
                       "--set", "decode.beam=0"], "decode.beam must be in [1, 64], got 0", None),
    ("keep_steps with a step 0", ["train", "--config", str(TINY), "--data", "DATA", "--out",
                                  "TMP/new", "--set", "train.keep_steps=[0, 5]"],
     "train.keep_steps must be a list of distinct steps, each an integer >= 1", None),
    ("a float where an integer goes", ["train", "--config", str(TINY), "--data", "DATA", "--out",
                                       "TMP/new", "--set", "train.max_steps=1.5"],
     "train.max_steps: expected int, got 1.5", None),
    ("evaluate --limit -1", ["evaluate", "RUN", "--limit", "-1"], "--limit must be 0", None),
    ("--alpha -1", ["translate", "RUN", "-i", "TMP/in.txt", "--alpha", "-1"],
     "--alpha must be in [0, 10], got -1", _sentences),
    ("--nbest 0", ["translate", "RUN", "-i", "TMP/in.txt", "--nbest", "0"],
     "--nbest must be between 1 and the beam", _sentences),
    ("average --last 0", ["average", "RUN", "--last", "0", "-o", "TMP/avg.safetensors"],
     "--last must be at least 1", None),
    ("plot --pe --set an unknown key", ["plot", "--pe", "--set", "unknown.key=1", "-o",
                                        "TMP/pe.png"],
     "--set 'unknown.key=1': unknown section 'unknown'", None),
    ("plot --pe --set a known setting", ["plot", "--pe", "--set", "model.d_model=256", "-o",
                                         "TMP/pe.png"],
     "--set goes with --schedule CONFIG", None),
    # an option the engine would ignore: an export decodes its own weights
    ("translate --engine ctranslate2 --weights", ["translate", "RUN", "-i", "TMP/in.txt",
                                                  "--engine", "ctranslate2", "--weights", "last"],
     "--weights last: a CTranslate2 export decodes the weights it was written with", _sentences),
    # a tokenizer setting --tokenizer-from keeps, named by its flag whatever its range
    ("prepare --tokenizer-from --vocab-size -1", ["prepare", "--tokenizer-from", "RUN",
                                                  "--vocab-size", "-1", "--corpus", "tsv:CORPUS",
                                                  "--out", "TMP/new"],
     "--vocab-size: data.vocab_size: the run RUN's tokenizer has", None),
    # 3. what would overwrite
    ("train --out over a run", ["train", "--config", str(TINY), "--data", "DATA", "--out", "RUN"],
     "RUN already holds a run; continue it with `aiayn train --resume RUN`", None),
    ("train --out over other files", ["train", "--config", str(TINY), "--data", "DATA", "--out",
                                      "TMP"], "--out TMP: not empty (holds in.txt)", _sentences),
    ("prepare --out over prepared data", ["prepare", "--corpus", "tsv:CORPUS", "--out", "DATA"],
     "--out DATA: not empty", None),
    ("--resume with --force", ["train", "--resume", "RUN", "--force"], "drop --config/--out/--force",
     None),
    # 6. limits
    ("--beam 100000", ["translate", "RUN", "-i", "TMP/in.txt", "--beam", "100000"],
     "--beam must be at most", _sentences),
    # attention has no --decode-tokens: its budget is named in words
    ("attention --beam 9000", ["attention", "RUN", "the red cat", "--beam", "9000", "-o",
                               "TMP/att"], "for this model and the decoding budget", None),
    ("hf: a local file that does not exist", ["prepare", "--corpus", "hf:./no/such.tsv", "--out",
                                              "TMP/new"], "hf:./no/such.tsv: no such file", None),
    ("tsv: a file that does not exist", ["prepare", "--corpus", "tsv:TMP/none.tsv", "--out",
                                         "TMP/new"], "TMP/none.tsv", None),
    # other error paths
    ("translate: no run directory", ["translate", "TMP/none", "-i", "TMP/in.txt"],
     "run directory not found: TMP/none", _sentences),
    ("translate: a weights file for the run", ["translate", "RUN/best.safetensors", "-i",
                                               "TMP/in.txt"],
     "RUN/best.safetensors: is a file, not a run directory", _sentences),
    ("evaluate: no run directory", ["evaluate", "TMP/none"], "run directory not found: TMP/none",
     None),
    ("info: no run directory", ["info", "TMP/none"], "run directory not found: TMP/none", None),
    ("translate: -i missing", ["translate", "RUN", "-i", "TMP/none.txt"],
     "-i TMP/none.txt: input file not found", None),
    ("translate --resume without -o", ["translate", "RUN", "-i", "TMP/in.txt", "--resume"],
     "--resume continues an interrupted `-i IN -o OUT` run; give the same -i and -o",
     _sentences),
    ("translate --resume with nothing to resume", ["translate", "RUN", "-i", "TMP/in.txt",
                                                   "-o", "TMP/out.txt", "--resume"],
     "--resume: nothing to resume for -o TMP/out.txt (no TMP/out.txt.partial)", _sentences),
    ("translate: weights that do not exist", ["translate", "RUN", "-i", "TMP/in.txt", "--weights",
                                              "best"], "no weights 'best'", None),
    ("a setting that does not exist", ["train", "--config", str(TINY), "--data", "DATA", "--out",
                                       "TMP/new", "--set", "train.lr=1"],
     "unknown setting train.lr", None),
    ("a config that is not YAML", ["train", "--config", "TMP/in.txt", "--data", "DATA", "--out",
                                   "TMP/new"], "TMP/in.txt: expected a mapping", _sentences),
    ("train: no data directory", ["train", "--config", str(TINY), "--data", "TMP/none", "--out",
                                  "TMP/new"], "TMP/none: prepared data directory not found", None),
    ("resume: no run directory", ["train", "--resume", "TMP/none"],
     "--resume TMP/none: run directory not found", None),
]


@pytest.fixture(scope="module")
def outcomes(aiayn, world, tmp_path_factory) -> dict[str, tuple]:
    """Every case of CASES run once, two at a time (each a process of its own, forked), each
    in its own temporary directory: {case id: (result, filled expectation,
    temp dir unchanged?)}; and the shared run and data directories unchanged by all."""
    before_world = snapshot(world["root"], folders=True)

    def run_case(case):
        name, args, expected, setup = case
        tmp = tmp_path_factory.mktemp("case")
        places = {"RUN": str(world["run"]), "DATA": str(world["data"]), "TMP": str(tmp),
                  "CORPUS": str(world["corpus"])}
        if name == "translate: weights that do not exist":
            run = copy_run(world, tmp / "copy")
            (run / "best.safetensors").unlink()
            places["RUN"] = str(run)
        if setup is not None:
            setup(tmp)

        def fill(text: str) -> str:
            for key, value in places.items():
                text = text.replace(key, value)
            return text

        before = snapshot(tmp, folders=True)
        result = aiayn(*[fill(a) for a in args], stdin=b"the red cat\n")
        return name, (result, fill(expected), snapshot(tmp, folders=True) == before)

    with ThreadPoolExecutor(max_workers=2) as pool:
        done = dict(pool.map(run_case, CASES))
    assert snapshot(world["root"], folders=True) == before_world, "a bad input changed the shared run or data"
    return done


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_a_bad_input_is_one_line_and_changes_no_file(name, outcomes):
    result, expected, unchanged = outcomes[name]
    line = one_error_line(result)
    assert result.returncode == 2
    assert expected in line
    assert unchanged


# ---------------------------------------------------------------- the run's state
def test_weights_of_a_config_edited_after_training_are_refused(aiayn, world, tmp_path):
    run = copy_run(world, tmp_path)
    config = run / "config.yaml"
    config.write_text(config.read_text().replace("n_heads: 4", "n_heads: 8"), encoding="utf-8")
    before = snapshot(run, folders=True)
    result = aiayn("translate", run, stdin=b"the red cat\n")
    assert "model.n_heads=4 but the config says model.n_heads=8" in one_error_line(result)
    assert snapshot(run, folders=True) == before


def test_nan_weights_are_refused_not_translated_to_empty_lines(aiayn, world, tmp_path):
    run = copy_run(world, tmp_path)
    tensors = checkpoint.read_weights(run / "best.safetensors")
    name = sorted(tensors)[0]
    tensors[name].fill_(float("nan"))
    from safetensors.torch import save_file

    save_file(tensors, str(run / "best.safetensors"),
              metadata=checkpoint.read_metadata(run / "best.safetensors"))
    result = aiayn("translate", run, stdin=b"the red cat\n")
    assert f"{name} holds NaN" in one_error_line(result) and result.stdout == b""


def test_no_weights_best_names_the_step_checkpoints_that_exist(aiayn, world, tmp_path):
    run = copy_run(world, tmp_path)
    for name in ("best.safetensors", "last.safetensors"):
        (run / name).unlink()
    line = one_error_line(aiayn("translate", run, stdin=b"the red cat\n"))
    assert "available: checkpoints/step_0000008, checkpoints/step_0000004 (" in line
    assert "--weights" in line
    # what the line offers is what --weights takes, inside the run, with or without the suffix
    for name in ("checkpoints/step_0000008", "checkpoints/step_0000008.safetensors"):
        result = aiayn("translate", run, "--weights", name, stdin=b"the red cat\n")
        assert result.returncode == 0 and result.stdout.count(b"\n") == 1, result.stderr.decode()


def test_a_failed_resume_leaves_config_yaml_as_it_was(aiayn, world, tmp_path):
    run = copy_run(world, tmp_path)
    (run / "train_state.pt").write_bytes(b"not a torch file")
    before = snapshot(run, folders=True)
    result = aiayn("train", "--resume", run, "--set", "train.max_steps=99")
    assert "train_state.pt: cannot read training state" in one_error_line(result)
    assert snapshot(run, folders=True) == before


def test_weights_without_a_train_state_name_the_ways_on(aiayn, world, tmp_path):
    run = copy_run(world, tmp_path)
    (run / "train_state.pt").unlink()
    before = snapshot(run, folders=True)
    line = one_error_line(aiayn("train", "--resume", run))
    assert "no train_state.pt" in line and f"--init-from {run}" in line and "--force" in line
    assert snapshot(run, folders=True) == before


def test_a_run_that_crashed_before_its_first_save_resumes_from_step_0(aiayn, world, tmp_path):
    run = copy_run(world, tmp_path)
    for path in [*run.glob("*.safetensors"), run / "train_state.pt"]:
        path.unlink()
    shutil.rmtree(run / "checkpoints")
    (run / ".last.safetensors.x1.tmp").write_bytes(b"half a file")  # an interrupted save
    result = aiayn("train", "--resume", run, "--set", "train.max_steps=4")
    assert result.returncode == 0, result.stderr.decode()
    assert load_train_state(run / "train_state.pt")["step"] == 4
    assert not list(run.rglob(".*.tmp"))
    steps = [json.loads(line)["step"] for line in
             (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    assert steps == sorted(steps) and max(steps) == 4  # one run's log, not two


def start_train(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "aiayn", "train", *map(str, args)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_a_start_killed_before_config_yaml_names_its_way_on(aiayn, world, tmp_path):
    """`aiayn train` killed in its first moments leaves a directory without config.yaml
    (empty, or with the tokenizer copy): --resume names the command that starts it again,
    changes no file, and that command works."""
    for leftovers in ([], ["tokenizer", "data_dir.txt"]):
        run = tmp_path / f"run{len(leftovers)}"
        run.mkdir()
        for name in leftovers:
            shutil.copytree(world["run"] / name, run / name) if name == "tokenizer" else \
                shutil.copy(world["run"] / name, run / name)
        before = snapshot(run, folders=True)
        line = one_error_line(aiayn("train", "--resume", run))
        assert f"{run}: holds no run to resume (no config.yaml" in line
        assert f"--out {run}" in line and ("--force" in line) == bool(leftovers)
        assert snapshot(run, folders=True) == before
        again = ["--config", TINY, "--data", world["data"], "--out", run,
                 *(["--force"] if leftovers else []), "--set", "train.max_steps=2"]
        result = aiayn("train", *again)
        assert result.returncode == 0, result.stderr.decode()
        assert load_train_state(run / "train_state.pt")["step"] == 2


def test_resume_refuses_an_export_and_changes_nothing_in_it(aiayn, world, tmp_path):
    """`train --resume` given an export (which a CTranslate2 export's config.yaml makes
    look like a run) names what it is and where it came from, and writes nothing into it:
    it trained a new model inside the export."""
    for target in ("ctranslate2", "hf"):
        export = tmp_path / target
        export.mkdir()
        (export / "aiayn_export.json").write_text(
            json.dumps({"target": target, "run_dir": "runs/demo", "weights": "best"}))
        if target == "ctranslate2":
            shutil.copy(world["run"] / "config.yaml", export / "config.yaml")
        before = snapshot(export, folders=True)
        line = one_error_line(aiayn("train", "--resume", export, "--data", world["data"]))
        assert f"{export}: a " in line and "export of run runs/demo" in line
        assert "need the run directory it came from" in line
        assert snapshot(export, folders=True) == before


def test_a_real_kill_in_the_first_moments_leaves_a_way_on(aiayn, world, tmp_path):
    run = tmp_path / "run"
    proc = start_train("--config", TINY, "--data", world["data"], "--out", run)
    deadline = time.time() + 60
    while not run.exists() and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    result = aiayn("train", "--resume", run, "--set", "train.max_steps=2")
    if (run / "config.yaml").exists():  # killed after the run was created: it resumes
        assert result.returncode == 0, result.stderr.decode()
    else:
        line = one_error_line(result)
        command = line.split("`aiayn train ")[1].split("`")[0]
        assert command.startswith("--config FILE --data DIR --out ")
        force = ["--force"] if "--force" in command else []
        result = aiayn("train", "--config", TINY, "--data", world["data"], "--out", run,
                       *force, "--set", "train.max_steps=2")
        assert result.returncode == 0, result.stderr.decode()
    assert load_train_state(run / "train_state.pt")["step"] == 2


def test_kills_at_random_moments_then_resumes_end_on_the_uninterrupted_weights(aiayn, world,
                                                                                tmp_path):
    """SIGKILL at three random moments of a one-thread run, each followed by --resume: the
    final weights equal an uninterrupted run's bit for bit."""
    import random

    from helpers import assert_equal_weights, weights

    settings = ["--set", "train.max_steps=40", "--set", "train.save_every=5",
                "--set", "train.eval_every=20", "--set", "train.log_every=5"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    result = aiayn("train", "--config", TINY, "--data", world["data"], "--out", straight,
                   *settings)
    assert result.returncode == 0, result.stderr.decode()
    rng = random.Random(7)
    args = ["--config", TINY, "--data", world["data"], "--out", killed, *settings]
    kills, saved = 0, []  # the step each killed process had saved beyond the one before
    moments = []  # what happened, for the message of a failure
    for _ in range(3):
        before = saved[-1] if saved else 0
        proc = start_train(*args)
        deadline = time.time() + 60
        while proc.poll() is None and time.time() < deadline and not (
                (killed / "train_state.pt").exists()
                and load_train_state(killed / "train_state.pt")["step"] > before):
            time.sleep(0.01)
        delay = rng.uniform(0.0, 0.3)
        time.sleep(delay)  # a moment between saves, or during one
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
        saved.append(load_train_state(killed / "train_state.pt")["step"])
        moments.append(f"{'killed' if proc.returncode < 0 else 'ended'} {delay:.3f} s after "
                       f"a save beyond step {before}, resumed at step {saved[-1]}")
        args = ["--resume", killed]
    assert kills >= 2 and saved == sorted(saved) and saved[0] < 40  # really interrupted
    result = aiayn("train", "--resume", killed)
    assert result.returncode == 0, result.stderr.decode()
    assert load_train_state(killed / "train_state.pt")["step"] == 40
    assert_equal_weights(weights(killed), weights(straight), "; ".join(moments))


# `aiayn train` that SIGKILLs itself at one moment of a save: FUNCTION of aiayn.training.loop (a
# writer of the save) is about to be called for the step STEP (the file name NAME, if given).
KILLED_IN_A_SAVE = """
import os, signal, sys
import aiayn.training.loop as train
from aiayn import cli
function, step, name = sys.argv[1:4]
write = getattr(train, function)
def write_or_die(what, path, **kwargs):
    if path.name.startswith(name) and str(train_step(what, kwargs)) == step:
        os.kill(os.getpid(), signal.SIGKILL)
    return write(what, path, **kwargs)
def train_step(what, kwargs):
    return what["step"] if isinstance(what, dict) else kwargs["metadata"]["step"]
setattr(train, function, write_or_die)
sys.exit(cli.main(sys.argv[4:]))
"""


def killed_in_a_save(function: str, step: int, name: str, *args) -> int:
    """Run `aiayn train ARGS` until it is about to write NAME with FUNCTION at STEP (then it
    is killed); returns its exit status."""
    done = subprocess.run([sys.executable, "-c", KILLED_IN_A_SAVE, function, str(step), name,
                           "train", *map(str, args)], cwd=ROOT, capture_output=True, timeout=120)
    return done.returncode


# The settings of world["run"], whose weights an interrupted run must end on.
WORLD_RUN = ["--set", "train.max_steps=8", "--set", "train.save_every=4", "--set",
             "train.eval_every=4", "--set", "train.keep_checkpoints=2"]


def test_a_kill_in_the_final_save_before_last_safetensors_is_finished_by_the_resume(
        aiayn, world, tmp_path):
    """Killed after the final save's train_state.pt, before its last.safetensors: the resume
    has no step left to train, and still leaves the final weights in last.safetensors (not
    those of the save before), as an uninterrupted run does."""
    from helpers import assert_equal_weights, weights

    run = tmp_path / "run"
    status = killed_in_a_save("save_weights", 8, "last.safetensors", "--config", TINY,
                              "--data", world["data"], "--out", run, *WORLD_RUN)
    assert status == -signal.SIGKILL
    assert load_train_state(run / "train_state.pt")["step"] == 8
    assert checkpoint.read_metadata(run / "last.safetensors")["step"] == "4"  # the kill's mark
    result = aiayn("train", "--resume", run)
    assert result.returncode == 0, result.stderr.decode()
    assert checkpoint.read_metadata(run / "last.safetensors")["step"] == "8"
    assert_equal_weights(weights(run), weights(world["run"]))


def test_a_kill_in_the_first_save_before_its_train_state_starts_the_run_over(aiayn, world,
                                                                             tmp_path):
    """Killed in the first save after its step checkpoint (and a validation's best weights)
    but before train_state.pt: nothing was saved to resume from, so --resume starts the run
    again, as for a kill before the first save, and ends on the uninterrupted run's weights."""
    from helpers import assert_equal_weights, weights

    run = tmp_path / "run"
    status = killed_in_a_save("save_train_state", 4, "train_state.pt", "--config", TINY,
                              "--data", world["data"], "--out", run, *WORLD_RUN)
    assert status == -signal.SIGKILL
    assert not (run / "train_state.pt").exists() and not (run / "last.safetensors").exists()
    assert (run / "checkpoints" / "step_0000004.safetensors").exists()
    assert (run / "best.safetensors").exists()
    result = aiayn("train", "--resume", run)
    assert result.returncode == 0, result.stderr.decode()
    assert load_train_state(run / "train_state.pt")["step"] == 8
    assert_equal_weights(weights(run), weights(world["run"]))


def test_train_force_replaces_the_run_files_and_nothing_else(aiayn, world, tmp_path):
    run = copy_run(world, tmp_path)
    (run / "notes.txt").write_text("mine\n", encoding="utf-8")
    result = aiayn("train", "--config", TINY, "--data", world["data"], "--out", run, "--force",
                   "--set", "train.max_steps=2", "--set", "train.save_every=2")
    assert result.returncode == 0, result.stderr.decode()
    assert load_train_state(run / "train_state.pt")["step"] == 2
    assert not (run / "checkpoints" / "step_0000008.safetensors").exists()
    assert (run / "notes.txt").read_text(encoding="utf-8") == "mine\n"


# ---------------------------------------------------------------- one writer
def saving_train(world, run: Path) -> subprocess.Popen:
    """`aiayn train` of a long run in a process of its own (stderr piped), once it has saved
    its first checkpoint (train_state.pt, every 5 steps). It starts with SIGINT at its
    default however the suite was started: a shell's background job (`make test &`) ignores
    SIGINT, a child inherits that, and Python then never raises KeyboardInterrupt."""
    inherited = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "aiayn", "train", "--config", str(TINY), "--data",
             str(world["data"]), "--out", str(run), "--set", "train.max_steps=100000",
             "--set", "train.save_every=5", "--set", "train.eval_every=100000",
             "--set", "train.cpu_threads=1"], cwd=ROOT, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE)
    finally:
        signal.signal(signal.SIGINT, inherited)
    deadline = time.time() + 60
    while not (run / "train_state.pt").exists() and time.time() < deadline:
        time.sleep(0.2)
    return process


def test_a_second_train_on_a_run_is_refused_and_the_first_resumes_exactly(aiayn, world, tmp_path):
    run = tmp_path / "run"
    first = saving_train(world, run)
    try:
        assert (run / "train_state.pt").exists()
        attempts = [("train", "--resume", run),
                    ("train", "--config", TINY, "--data", world["data"], "--out", run, "--force"),
                    ("prepare", "--corpus", f"tsv:{world['corpus']}", "--out", world["data"],
                     "--force")]
        with ThreadPoolExecutor(max_workers=3) as pool:
            second, again, prepare = pool.map(lambda args: aiayn(*args), attempts)
        line = one_error_line(second)
        assert f"{run} is in use by pid {first.pid} (aiayn train)" in line
        assert "is in use by pid" in one_error_line(again)
        assert "is in use" in one_error_line(prepare)  # the run reads it
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    step = load_train_state(run / "train_state.pt")["step"]
    result = aiayn("train", "--resume", run, "--set", f"train.max_steps={step + 3}")
    assert result.returncode == 0, result.stderr.decode()
    assert load_train_state(run / "train_state.pt")["step"] == step + 3


def test_ctrl_c_in_train_names_the_resume_and_its_step(world, tmp_path):
    run = tmp_path / "run"
    first = saving_train(world, run)
    try:
        assert (run / "train_state.pt").exists()
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=60)
    finally:
        first.kill()
    assert first.returncode == 130, err.decode()
    lines = [line for line in err.decode().replace("\r", "\n").splitlines()
             if line.startswith("aiayn:")]
    step = load_train_state(run / "train_state.pt")["step"]
    assert lines == [f"aiayn: interrupted; `aiayn train --resume {run}` goes on from step "
                     f"{step}, its last checkpoint"], err.decode()


def test_prepare_force_replaces_prepared_data_only_when_not_in_use(aiayn, world, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(world["data"], data)
    with locked(data, "aiayn train", shared=True):  # as a training run holds it
        before = snapshot(data, folders=True)
        result = aiayn("prepare", "--corpus", f"tsv:{world['corpus']}", "--out", data, "--force",
                       "--set", "data.tokenizer=wordlevel")
        assert "is in use" in one_error_line(result)
        assert snapshot(data, folders=True) == before
    result = aiayn("prepare", "--corpus", f"tsv:{world['corpus']}", "--out", data, "--force",
                   "--set", "data.tokenizer=wordlevel", "--set", "data.split_seed=7")
    assert result.returncode == 0, result.stderr.decode()
    assert json.loads((data / "stats.json").read_text())["data_config"]["split_seed"] == 7
    assert not (data / ".staging.tmp").exists() and not (data / ".lock").exists()


def test_a_kill_during_prepare_leaves_the_old_prepared_data(aiayn, world, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(world["data"], data)
    before = snapshot(data, folders=True)
    big = toy_tsv(tmp_path / "big.tsv", WORDS, n=200_000, seed=1,
                  lengths=(2, 8), copy=True)
    proc = subprocess.Popen([sys.executable, "-m", "aiayn", "prepare", "--corpus", f"tsv:{big}",
                             "--out", str(data), "--force"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not (data / ".staging.tmp").exists() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    leftover = {k: v for k, v in snapshot(data, folders=True).items()
                if ".staging.tmp" not in k and Path(k).name != ".lock"}
    assert leftover == before
    # The next prepare cleans what the killed one left.
    result = aiayn("prepare", "--corpus", f"tsv:{world['corpus']}", "--out", data, "--force",
                   "--set", "data.tokenizer=wordlevel")
    assert result.returncode == 0, result.stderr.decode()
    assert not (data / ".staging.tmp").exists()


# ---------------------------------------------------------------- line I/O
def test_one_line_in_one_line_out_for_any_unicode(aiayn, world, tmp_path):
    separators = ["\u2028", "\u2029", "\u0085", "\x0c", "\x0b", "\x1c", "\x1d", "\x1e", "\r"]
    lines = [f"the red{sep}cat" for sep in separators] + ["", "the dog\r"]
    data = "\ufeff" + "\n".join(lines) + "\n"
    result = aiayn("translate", world["run"], "--beam", "1", stdin=data.encode("utf-8"),
                   env={"LANG": "C", "LC_ALL": "C", "PYTHONIOENCODING": "ascii",
                        "PYTHONUTF8": "0"})
    assert result.returncode == 0, result.stderr.decode()
    out = result.stdout.decode("utf-8").split("\n")
    assert out[-1] == "" and len(out) - 1 == len(lines)
    assert out[len(separators)] == ""  # the empty line stays empty
    # The BOM is not part of the first sentence: it translates as the same text without it.
    plain = aiayn("translate", world["run"], "--beam", "1",
                  stdin=lines[0].encode("utf-8") + b"\n")
    assert plain.stdout.decode("utf-8").split("\n")[0] == out[0]


def test_translations_are_written_as_utf8_under_an_ascii_locale(aiayn, world, tmp_path):
    result = aiayn("translate", world["run"], "--beam", "1", stdin="the café\n".encode(),
                   env={"LANG": "C", "LC_ALL": "C", "PYTHONIOENCODING": "ascii",
                        "PYTHONUTF8": "0"})
    assert result.returncode == 0 and b"Traceback" not in result.stderr
    result.stdout.decode("utf-8")  # valid UTF-8 whatever the locale


def test_an_over_long_sentence_is_one_warning_line(aiayn, world, tmp_path):
    result = aiayn("translate", world["run"], "--beam", "1",
                   stdin=(" ".join(["cat"] * 200) + "\n").encode("utf-8"))
    assert result.returncode == 0
    err = [line for line in result.stderr.decode().splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("aiayn: warning:") and "truncated" in err[0]


# ---------------------------------------------------------------- faults inside the process
def test_a_full_disk_during_a_checkpoint_save_is_one_line_and_the_last_one_loads(
        world, tmp_path, monkeypatch, capsys):
    run = copy_run(world, tmp_path)
    real_save = checkpoint.save_file

    def full(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)  # half written, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    monkeypatch.setattr(checkpoint, "save_file", full)
    code = cli.main(["train", "--resume", str(run), "--set", "train.max_steps=12"])
    monkeypatch.undo()
    err = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines()
           if line.startswith("aiayn:")]
    step_file = run / "checkpoints" / "step_0000012.safetensors"
    assert code == 2 and len(err) == 1
    # the first write of step 12 is the new best (the last validation), then the checkpoint
    assert err[0].startswith(f"aiayn: error: no space left on {run / 'best.safetensors'}: the "
                             "weights file needs ~")
    assert f"`aiayn train --resume {run}` goes on from the last good checkpoint" in err[0]
    assert not list(run.rglob(".*.tmp")) and not step_file.exists()
    state = load_train_state(run / "train_state.pt")
    assert state["step"] == 8  # the previous checkpoint, whole
    assert cli.main(["translate", str(run), "-i", str(_write(tmp_path / "in.txt")),
                     "-o", str(tmp_path / "out.txt"), "--weights", "last"]) == 0


def _write(path: Path) -> Path:
    path.write_text("the red cat\n", encoding="utf-8")
    return path


def test_temp_files_of_an_interrupted_write_are_removed_by_atomic_path(tmp_path, monkeypatch):
    target = tmp_path / "file.txt"
    monkeypatch.setattr(io.os, "replace", lambda *a: (_ for _ in ()).throw(OSError("kill")))
    with pytest.raises(OSError):
        io.atomic_write_text(target, "x")
    assert list(tmp_path.iterdir()) == []


def test_out_of_memory_in_decoding_names_max_tokens(world, tmp_path, monkeypatch, capsys):
    from aiayn.inference import aiayn_engine

    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1")

    monkeypatch.setattr(aiayn_engine, "decode_beam", no_memory)
    code = cli.main(["translate", str(world["run"]), "-i", str(_write(tmp_path / "in.txt")),
                     "--beam", "2", "--max-tokens", "512"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "out of memory decoding a batch of 1 sentence(s) x beam 2" in err[0]
    assert "smaller --max-tokens (now 512)" in err[0]


def test_out_of_memory_in_training_is_one_line_and_keeps_the_checkpoint(
        world, tmp_path, monkeypatch, capsys):
    from aiayn.training import loop as train

    run = copy_run(world, tmp_path)
    before = checkpoint.read_weights(run / "last.safetensors")

    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1")

    monkeypatch.setattr(train, "train_step", no_memory)
    code = cli.main(["train", "--resume", str(run), "--set", "train.max_steps=12"])
    err = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines()
           if line.startswith("aiayn:")]
    assert code == 2 and len(err) == 1 and "out of memory" in err[0]
    assert "train.max_tokens" in err[0]
    after = checkpoint.read_weights(run / "last.safetensors")
    assert all(bool((before[k] == after[k]).all()) for k in before)
    assert load_train_state(run / "train_state.pt")["step"] == 8


def test_ctrl_c_before_the_first_checkpoint_says_the_run_starts_again_from_step_0(tmp_path):
    """The line after Ctrl-C names the command that goes on; with no train state saved yet
    it starts again, and step snapshots (weights to look at) are no point to go on from."""
    from argparse import Namespace

    from aiayn.cli import _way_on

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("model: {}\n", encoding="utf-8")
    args = Namespace(command="train", resume=None, out=str(run))
    assert _way_on(args) == (f"; `aiayn train --resume {run}` starts it again from step 0 (no "
                             "checkpoint to go on from was saved yet)")
    (run / "checkpoints" / "step_0000050.safetensors").write_bytes(b"")
    assert "checkpoints/step_*.safetensors are weights to look at, not a point to go on " \
           "from" in _way_on(args)
