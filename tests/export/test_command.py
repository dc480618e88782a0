"""`aiayn export` (aiayn.export.command): both targets keep the run's search, and every
refusal (a directory in use, no weights, a model a target cannot hold, a library
missing) is one line."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
from export_helpers import needs_ct2, needs_hf, one_line_error, random_run
from helpers import run_cli

from aiayn.config import DecodeConfig, load_config, save_config
from aiayn.export.command import export_run
from aiayn.export.modelcard import CARD_FILE, model_card
from aiayn.inference.search import Search
from aiayn.inference.translator import Translator
from aiayn.runs.directory import load_run


@needs_hf
@needs_ct2
def test_both_exports_keep_the_runs_search(tmp_path):
    """A run whose config's decode says beam 3, alpha 1.5: Transformers' generation defaults
    and the CTranslate2 directory's Translator both search so."""
    run = random_run(tmp_path, "run")
    config = load_run(run)[0]
    save_config(dataclasses.replace(config, decode=DecodeConfig(beam=3, alpha=1.5,
                                                                no_repeat_ngram=3)),
                run / "config.yaml")
    export_run(run, "hf", tmp_path / "hf")
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert (generation["num_beams"], generation["length_penalty"]) == (3, 1.5)
    assert generation["no_repeat_ngram_size"] == 3
    export_run(run, "ctranslate2", tmp_path / "ct2")
    theirs = Translator.from_pretrained(tmp_path / "ct2", engine="ctranslate2")
    assert theirs.resolve() == Search(3, 1.5, 3)
    # Each export carries its model card, which says the same search.
    for to, out in (("hf", "hf"), ("ctranslate2", "ct2")):
        card = (tmp_path / out / CARD_FILE).read_text(encoding="utf-8")
        assert card == model_card(run, to)
        assert "searches with beam 3 and length penalty alpha 1.5" in card
        assert "same 3 pieces in a row twice" in card  # the run's guard
    # greedy (beam 1): Transformers refuses beam-only settings beside it, so none are written
    save_config(dataclasses.replace(config, decode=DecodeConfig(beam=1, alpha=1.5)),
                run / "config.yaml")
    export_run(run, "hf", tmp_path / "hf1")
    generation = json.loads((tmp_path / "hf1" / "generation_config.json").read_text())
    assert generation.get("num_beams", 1) == 1 and "length_penalty" not in generation


# ---------------------------------------------------------------- refusals, one line each
@pytest.mark.parametrize("to", ["hf", "ctranslate2"])
def test_export_into_a_non_empty_directory_is_refused(run_dir, tmp_path, capsys, to):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine\n")
    code, _, err = run_cli(["export", str(run_dir), "--to", to, str(out)], capsys)
    assert one_line_error(code, err, str(out), "not an empty directory")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "mine\n"


@needs_ct2
def test_export_into_an_empty_directory_fills_it(run_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    code, _, _ = run_cli(["export", str(run_dir), "--to", "ctranslate2", str(out)], capsys)
    assert code == 0 and (out / "model.bin").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary left behind


@pytest.mark.parametrize("to", ["hf", "ctranslate2"])
def test_a_run_without_weights_is_one_line(run_dir, tmp_path, capsys, to):
    if find_spec("transformers" if to == "hf" else "ctranslate2") is None:
        pytest.skip("the missing library is reported first")
    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.yaml", "data_dir.txt"):
        (run / name).write_bytes((run_dir / name).read_bytes())
    load_run(run_dir)[2].save(run / "tokenizer")
    code, _, err = run_cli(["export", str(run), "--to", to, str(tmp_path / "out")], capsys)
    assert one_line_error(code, err, "holds no weights")
    assert not (tmp_path / "out").exists()


@needs_ct2
def test_a_qk_norm_run_is_refused_for_ctranslate2_in_one_line(tmp_path, capsys):
    """CTranslate2 4.8 RMS-normalises the query of encoder-decoder attention over all of
    d_model, not per head: refused before any weights are read, nothing written."""
    run = random_run(tmp_path, "run", norm_first=True, qk_norm=True)
    (run / "best.safetensors").unlink()  # the refusal comes from config.yaml alone
    code, _, err = run_cli(["export", str(run), "--to", "ctranslate2", str(tmp_path / "out")],
                           capsys)
    assert one_line_error(code, err, "model.qk_norm_cross_query: heads", "--to ctranslate2",
                          "each head", "--set model.qk_norm_cross_query=whole")
    assert not (tmp_path / "out").exists()


@needs_hf
def test_separate_vocabularies_are_refused_for_transformers_in_one_line(tmp_path, capsys):
    run = random_run(tmp_path, "run", tie="decoder", joint=False)
    code, _, err = run_cli(["export", str(run), "--to", "hf", str(tmp_path / "out")], capsys)
    assert one_line_error(code, err, "joint vocabulary")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("to, library", [("hf", "transformers"), ("ctranslate2", "ctranslate2")])
def test_a_missing_library_says_what_to_install(run_dir, tmp_path, capsys, monkeypatch,
                                                 to, library):
    monkeypatch.setitem(sys.modules, library, None)  # import now raises ImportError
    code, _, err = run_cli(["export", str(run_dir), "--to", to, str(tmp_path / "out")], capsys)
    assert one_line_error(code, err, library, "pip install 'aiayn[export]'")
    assert not (tmp_path / "out").exists()


def test_quantization_is_for_ctranslate2_only(run_dir, tmp_path, capsys):
    code, _, err = run_cli(["export", str(run_dir), "--to", "hf", str(tmp_path / "out"),
                            "--quantization", "int8"], capsys)
    assert one_line_error(code, err, "--quantization", "ctranslate2")


@needs_ct2
def test_the_engines_name_the_directory_they_need(run_dir, tmp_path, capsys):
    out = tmp_path / "ct2"
    export_run(run_dir, "ctranslate2", out)
    code, _, err = run_cli(["evaluate", str(out)], capsys)
    assert one_line_error(code, err, "--engine ctranslate2")
    code, _, err = run_cli(["evaluate", str(run_dir), "--engine", "ctranslate2"], capsys)
    assert one_line_error(code, err, "model.bin", "aiayn export")


# ---------------------------------------------------------------- what leaves the machine
@needs_hf
@needs_ct2
def test_an_export_holds_no_local_path_and_every_file_is_readable_by_all(run_dir, tmp_path):
    """An export is meant to be published (its card becomes a hub page): no file it writes
    names the run, the prepared data, the corpus files or the home folder; and every file
    has the umask's mode (0644 under 022), the weights too, so a service user can read them."""
    run = tmp_path / "home-of-the-run" / "mine"
    shutil.copytree(run_dir, run)
    data_dir = Path((run / "data_dir.txt").read_text(encoding="utf-8").strip())
    config = load_config(run / "config.yaml")
    config.data.corpus = f"tsv:{data_dir}.corpus/{{split}}.tsv"  # as the data was prepared
    save_config(config, run / "config.yaml")
    local = {str(run), str(run.resolve()), str(data_dir), str(data_dir.resolve()),
             str(data_dir.parent), str(tmp_path)}
    if Path.home() != Path("/"):
        local.add(str(Path.home()))
    weights = shutil.copy(run / "best.safetensors", tmp_path / "mine.safetensors")
    local.add(str(weights))
    old = os.umask(0o022)
    try:
        outs = [export_run(run, "hf", tmp_path / "hf"),
                export_run(run, "ctranslate2", tmp_path / "ct2", weights=weights)]
    finally:
        os.umask(old)
    for out in outs:
        files = [p for p in out.rglob("*") if p.is_file()]
        assert {"README.md", "aiayn_export.json"} <= {p.name for p in files}
        for path in files:
            assert oct(path.stat().st_mode & 0o777) == oct(0o644), path
            data = path.read_bytes()
            leaks = [where for where in local if where.encode() in data]
            assert not leaks, f"{path.relative_to(out)} names {leaks}"


@needs_ct2
def test_an_export_names_what_a_killed_export_left_beside_it_and_deletes_nothing(tmp_path, capsys):
    """A kill -9 leaves the temporary directory an export was writing (nothing can clean up
    after it); the next export into that OUT_DIR says so in one line naming it, and leaves it
    (another export may still be writing it)."""
    run = random_run(tmp_path, "run")
    left = tmp_path / "out" / ".ct2.k1x2.tmp"
    left.mkdir(parents=True)
    (left / "model.bin").write_bytes(b"half")
    other = tmp_path / "out" / ".ct20.k1x2.tmp"  # another OUT_DIR's, not named
    other.mkdir()
    export_run(run, "ctranslate2", tmp_path / "out" / "ct2")
    out = capsys.readouterr().out
    assert f"note: {left} is what an export to {tmp_path / 'out' / 'ct2'} left" in out
    assert str(other) not in out
    assert left.is_dir() and (tmp_path / "out" / "ct2" / "model.bin").is_file()
