"""The notebooks of docs/ run top to bottom, and the outputs committed with them are current.

A notebook is committed with its outputs so that it reads on GitHub without running;
docs/notebook.py (`make notebook`) executes it in place and records a fingerprint of its code
cells, of the aiayn modules they reach and of constraints.txt. Here the recorded fingerprint
must be the current one; the outputs (no error, no stderr, the figures, the cells tagged
``deterministic``: shapes, parameter counts, the schedule's values, ...) are checked as
committed where it is, and where it is not a copy of each runs again in a fresh kernel (every
check cell asserts) and must print what was committed: a minute on one core for the
walkthrough, three for the ablations (eleven toy trainings).
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("docs_notebook", ROOT / "docs" / "notebook.py")
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


# Per notebook: the figures it writes to docs/, and how many cells at least are tagged
# deterministic (a notebook that lost its tags would otherwise compare nothing).
EXPECTED = {"walkthrough": ({"walkthrough_reversal"}, 8),
            "ablations": ({"ablations_attention_forming"}, 2)}


@pytest.fixture(scope="module", params=tool.NOTEBOOKS, ids=lambda path: path.stem)
def notebook(request) -> Path:
    return request.param


@pytest.fixture(scope="module")
def committed(notebook):
    return tool.read(notebook)


@pytest.fixture(scope="module")
def executed(committed, tmp_path_factory):
    """The notebook as executing its code gives it. Where the recorded fingerprint is current,
    that is the committed notebook: `make notebook` executed this very code (cells, the aiayn
    modules they reach, constraints.txt) and raises at a failing cell, so its outputs are
    checked as they stand. Otherwise a copy runs again top to bottom, outputs replaced, in an
    empty directory (it writes nothing, and must need nothing but the package)."""
    if tool.recorded_fingerprint(committed) == tool.fingerprint(committed):
        return committed
    nb = copy.deepcopy(committed)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    return tool.execute(nb, cwd=tmp_path_factory.mktemp("notebook"))


def test_every_notebook_is_run_and_checked():
    assert {path.stem for path in tool.NOTEBOOKS} == set(EXPECTED)
    assert {path.stem for path in (ROOT / "docs").glob("*.ipynb")} == set(EXPECTED)


def test_committed_outputs_are_not_stale(notebook, committed):
    assert tool.recorded_fingerprint(committed) == tool.fingerprint(committed), \
        tool.stale_message(notebook)


def test_fingerprint_covers_the_code_cells_and_the_imported_modules():
    committed = tool.read(tool.NOTEBOOK)
    modules = tool.imported_modules(committed)
    for name in ("aiayn.model", "aiayn.inspect.trace", "aiayn.training.optim", "aiayn.inference.search",
                 "aiayn.inspect.reference"):
        assert name in modules
    assert "aiayn.training.toy" in tool.imported_modules(tool.read(tool.DOCS / "ablations.ipynb"))
    # ...and what those import in turn: the model's KV cache is imported by aiayn.model, not
    # by a cell, and its code changes what the cells print all the same.
    assert "aiayn.cache" not in modules and "aiayn.cache" in tool.module_closure(modules)
    changed = copy.deepcopy(committed)
    cell = next(c for c in changed.cells if c.cell_type == "code")
    cell.source += "\n"
    assert tool.fingerprint(changed) != tool.fingerprint(committed)
    changed = copy.deepcopy(committed)
    next(c for c in changed.cells if c.cell_type == "markdown").source += " more prose"
    assert tool.fingerprint(changed) == tool.fingerprint(committed)  # prose changes no output


def test_a_modules_prose_leaves_the_outputs_current_and_its_code_does_not():
    source = (tool.PACKAGE / "model.py").read_text(encoding="utf-8")
    assert '"""' in source and "# " in source  # it has prose to change
    reworded = (source.replace('"""', '"""Reworded. ', 1)  # the module's docstring
                .replace("# ", "# reworded: ")  # every comment
                .replace("\n\n\n", "\n\n\n\n"))  # the layout
    assert tool.code_of(reworded) == tool.code_of(source)
    changed_code = source.replace("math.sqrt", "math.sqrt(1.0) * math.sqrt", 1)
    assert changed_code != source
    assert tool.code_of(changed_code) != tool.code_of(source)


def test_committed_figure_files_are_the_notebooks(notebook, committed):
    pictures = tool.figures(committed)
    assert set(pictures) == EXPECTED[notebook.stem][0]
    for name, png in pictures.items():
        assert (ROOT / "docs" / f"{name}.png").read_bytes() == png, tool.stale_message(notebook)


def test_notebook_runs_top_to_bottom(notebook, executed):
    # execute() raised at a failing cell (an assert); nothing printed to stderr either
    for cell in executed.cells:
        for output in cell.get("outputs", []):
            assert output.output_type != "error"
            assert not (output.output_type == "stream" and output.name == "stderr"), output.text
    for name in EXPECTED[notebook.stem][0]:
        assert tool.figures(executed)[name].startswith(b"\x89PNG")


def test_deterministic_outputs_match_the_committed_ones(notebook, committed, executed):
    fresh = tool.deterministic_texts(executed)
    stored = tool.deterministic_texts(committed)
    assert len(fresh) == len(stored) >= EXPECTED[notebook.stem][1]
    for i, (new, old) in enumerate(zip(fresh, stored)):
        assert new == old, (f"deterministic cell {i} prints something else now; "
                            f"{tool.stale_message(notebook)}")
