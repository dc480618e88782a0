"""The notebooks of docs/ (the walkthrough, the ablations): run them, and know when their
committed outputs are older than the code.

A notebook is committed with its outputs (figures as PNG), so it reads on GitHub without
running. Those outputs are only as current as the code that made them, so
``make notebook`` (``python docs/notebook.py``) executes each top to bottom in place and records
a fingerprint in its metadata: the SHA-256 of its code cells, of the code of every
``aiayn`` module they import, directly or through other aiayn modules (the module's syntax
tree without its docstrings, so an edit of prose, comments or layout leaves the outputs
current), and of constraints.txt (the versions it ran with). tests/project/test_notebook.py
compares the recorded fingerprint with the current one; only where they differ does it
execute a copy (every check cell asserts) and compare the text outputs of the cells tagged
``deterministic`` (shapes, parameter counts, ...) with the committed ones: a current
fingerprint means the committed outputs are what this very code gave when `make notebook`
executed it, so running it again would prove nothing new. It also writes the figure of the
cell tagged ``figure:NAME`` to ``docs/NAME.png`` (the README shows it).

    python docs/notebook.py                          # execute all in place, save figures
    python docs/notebook.py docs/ablations.ipynb     # one of them
    python docs/notebook.py --check                  # exit 1 (one line) when any is stale
"""

from __future__ import annotations

import argparse
import ast
import base64
import hashlib
import sys
from pathlib import Path

import nbformat

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
NOTEBOOK = DOCS / "walkthrough.ipynb"
NOTEBOOKS = (NOTEBOOK, DOCS / "ablations.ipynb")
PACKAGE = ROOT / "src" / "aiayn"
DETERMINISTIC = "deterministic"  # the tag of cells whose text outputs are the same on every machine
FIGURE = "figure:"  # a tag "figure:NAME": this cell's PNG output is docs/NAME.png
TIMEOUT_S = 600  # per cell
STARTUP_S = 300  # for the kernel to start (nbclient's 60 s can pass on a machine that is busy)


def read(path: Path = NOTEBOOK) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def stale_message(path: Path = NOTEBOOK) -> str:
    return f"{path.relative_to(ROOT)} is stale: run `make notebook`"


def code_sources(nb: nbformat.NotebookNode) -> list[str]:
    return [cell.source for cell in nb.cells if cell.cell_type == "code"]


def imported_modules(nb: nbformat.NotebookNode) -> list[str]:
    """The ``aiayn`` modules the code cells import (``aiayn`` itself, ``aiayn.model``, ...),
    found by parsing the cells (IPython's ``%`` and ``!`` lines left out)."""
    names: set[str] = set()
    for source in code_sources(nb):
        python = "\n".join(line for line in source.splitlines()
                           if not line.lstrip().startswith(("%", "!")))
        for node in ast.walk(ast.parse(python)):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
                # `from aiayn import model` imports the module aiayn.model
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return sorted(name for name in names
                  if name.split(".")[0] == "aiayn" and module_file(name) is not None)


def module_closure(names: list[str]) -> list[str]:
    """``names`` and every aiayn module they import, at the top or inside a function, and the
    modules those import, to the end: all the aiayn code a notebook's outputs can depend on."""
    seen: set[str] = set()
    todo = [name for name in names if module_file(name) is not None]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        for parent in (".".join(parts[:k]) for k in range(1, len(parts))):
            todo.append(parent)  # importing aiayn.x.y runs aiayn/__init__ and aiayn/x/__init__
        path = module_file(name)
        package = parts if path.name == "__init__.py" else parts[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                # `from .cache import KVCache` in aiayn/model.py is aiayn.cache (model.py
                # imports its siblings relatively so that an export can ship them)
                base = ".".join([*package[:len(package) - node.level + 1], *(
                    [node.module] if node.module else [])]) if node.level else node.module
                found = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            todo.extend(f for f in found
                        if f.split(".")[0] == "aiayn" and module_file(f) is not None)
    return sorted(seen)


def module_file(name: str) -> Path | None:
    """src/aiayn/x.py for ``aiayn.x`` (``__init__.py`` for a package), None if no module."""
    base = ROOT / "src" / Path(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def code_of(source: str) -> str:
    """A module's code alone: its syntax tree with every docstring removed, dumped without
    positions. Comments, docstrings, blank lines and line breaks change nothing here, so
    they leave a notebook's outputs current; any change to what runs does not."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def fingerprint(nb: nbformat.NotebookNode) -> str:
    """SHA-256 of the code cells, of the code of every aiayn module they reach
    (``module_closure``) and of constraints.txt: what the outputs depend on (markdown cells,
    outputs and the modules' prose are left out)."""
    digest = hashlib.sha256()
    for source in code_sources(nb):
        digest.update(b"cell\0" + source.encode() + b"\0")
    digest.update(b"constraints\0" + (ROOT / "constraints.txt").read_bytes() + b"\0")
    for name in module_closure(imported_modules(nb)):
        path = module_file(name)
        digest.update(f"module\0{path.relative_to(ROOT).as_posix()}\0".encode())
        digest.update(code_of(path.read_text(encoding="utf-8")).encode() + b"\0")
    return digest.hexdigest()


def recorded_fingerprint(nb: nbformat.NotebookNode) -> str | None:
    return nb.metadata.get("aiayn", {}).get("fingerprint")


def execute(nb: nbformat.NotebookNode, cwd: Path = DOCS) -> nbformat.NotebookNode:
    """Run every cell in order in a fresh kernel whose working directory is ``cwd``; raises
    ``nbclient.exceptions.CellExecutionError`` (naming the cell) at the first that fails."""
    from nbclient import NotebookClient  # only where the notebook runs

    NotebookClient(nb, timeout=TIMEOUT_S, startup_timeout=STARTUP_S, kernel_name="python3",
                   record_timing=False, resources={"metadata": {"path": str(cwd)}}).execute()
    return nb


def texts(cell: nbformat.NotebookNode) -> list[str]:
    """A code cell's text outputs: what it printed (consecutive prints as one, however the
    kernel happened to split them into messages) and the text/plain of what it showed."""
    out: list[str] = []
    stream = None  # the stream of the last output, if it was one
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            if output.name == stream:
                out[-1] += output.text
            else:
                out.append(f"{output.name}: {output.text}")
            stream = output.name
            continue
        stream = None
        if output.output_type in ("execute_result", "display_data"):
            out.append(output.data.get("text/plain", ""))
        elif output.output_type == "error":
            out.append(f"error: {output.ename}: {output.evalue}")
    return out


def deterministic_texts(nb: nbformat.NotebookNode) -> list[list[str]]:
    """The text outputs of the cells tagged ``deterministic``, in order."""
    return [texts(cell) for cell in nb.cells
            if cell.cell_type == "code" and DETERMINISTIC in cell.metadata.get("tags", [])]


def figures(nb: nbformat.NotebookNode) -> dict[str, bytes]:
    """NAME -> the PNG shown by the cell tagged ``figure:NAME`` (its last one)."""
    found = {}
    for cell in nb.cells:
        for tag in cell.metadata.get("tags", []):
            if tag.startswith(FIGURE):
                pngs = [o.data["image/png"] for o in cell.get("outputs", [])
                        if "image/png" in o.get("data", {})]
                if pngs:
                    found[tag.removeprefix(FIGURE)] = base64.b64decode(pngs[-1])
    return found


def update(path: Path = NOTEBOOK) -> None:
    """``make notebook``: execute in place, record the fingerprint, write the tagged figures."""
    nb = read(path)
    execute(nb)
    nb.metadata["aiayn"] = {"fingerprint": fingerprint(nb),
                            "modules": module_closure(imported_modules(nb))}
    nbformat.write(nb, path)
    for name, png in figures(nb).items():
        (DOCS / f"{name}.png").write_bytes(png)
        print(f"wrote docs/{name}.png")
    print(f"executed {path.relative_to(ROOT)}; fingerprint {recorded_fingerprint(nb)[:12]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="only say whether the committed outputs are stale (exit 1 if so)")
    parser.add_argument("notebooks", nargs="*", type=Path, metavar="NOTEBOOK",
                        help="the notebooks to run or check (default: all of docs/)")
    args = parser.parse_args(argv)
    paths = [path.resolve() for path in args.notebooks] or list(NOTEBOOKS)
    if args.check:
        stale = [path for path in paths
                 if recorded_fingerprint(nb := read(path)) != fingerprint(nb)]
        for path in stale:
            print(stale_message(path), file=sys.stderr)
        if not stale:
            print(", ".join(str(path.relative_to(ROOT)) for path in paths), "current")
        return 1 if stale else 0
    for path in paths:
        update(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
