"""The house rules of src/aiayn, as its docstrings state them: each package's ``__init__``
names every module of the package and says in a "May import:" line (as each top-level
module that has one does) which parts of aiayn its modules may import; the model's files
depend on torch alone; a module over ~500 lines says why in its docstring.
docs/architecture.md is drawn from the same facts. And the tests follow the rooms: each
file under tests/PACKAGE/ is named after the module it tests."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
# Test files under tests/PACKAGE/ named after no module, each with what it tests instead.
# tests/project/ tests the project as a whole and has no rule.
NOT_A_MODULE = {
    "serving/test_server.py": "the app under uvicorn, and `aiayn serve` as a process",
    "serving/test_page.py": "the page (aiayn/serving/static/) in a real Chromium",
}
TORCH_ALONE = ("model", "cache", "loss")  # what an export with aiayn's own code ships
MAX_LINES = 500


def _generate():
    """docs/generate.py, whose reading of the package (modules, their imports, their rules)
    draws docs/architecture.md's map: the rules are checked on the same facts."""
    spec = importlib.util.spec_from_file_location("generate", ROOT / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = _generate()
PACKAGE = generate.PACKAGE
module_name, aiayn_imports, allowed = generate.module_name, generate.aiayn_imports, generate.may_import
modules = generate.module_files


def rule_for(name: str) -> tuple[str, list[str]] | None:
    """The rule ``name`` follows: its own docstring's (top-level modules), else its package's."""
    mods = modules()
    owner = name if name.count(".") == 1 and name in mods else ".".join(name.split(".")[:2])
    rule = allowed(ast.get_docstring(ast.parse(mods[owner].read_text(encoding="utf-8"))))
    return None if rule is None else (owner, rule)


def test_every_package_states_what_it_owns_and_may_import():
    for name, path in modules().items():
        if path.name == "__init__.py" and name != "aiayn":
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
            assert doc and allowed(doc) is not None, f"{name}/__init__.py has no 'May import:' line"


def modules_named(docstring: str) -> set[str]:
    """The words inside a docstring's parentheses: where a package's docstring names its
    modules ("the loop (loop), Adam and the schedule (optim)")."""
    return {w for inside in re.findall(r"\(([^()]*)\)", docstring) for w in re.findall(r"\w+", inside)}


def test_every_package_docstring_names_each_of_its_modules():
    missing = []
    for name, path in modules().items():
        if path.name == "__init__.py" and name != "aiayn":
            named = modules_named(ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))))
            missing += [f"{path.relative_to(ROOT)} does not name ({sub.rpartition('.')[2]})"
                        for sub in modules() if sub.rpartition(".")[0] == name
                        and sub.rpartition(".")[2] not in named]
    assert missing == [], "\n".join(missing)
    assert modules_named("the loop (loop), the schedule (optim; and: early_stopping)") == {
        "loop", "optim", "and", "early_stopping"}


def misnamed_tests(tests: Path, package: Path, allowed: dict[str, str]) -> list[str]:
    """The test files under ``tests`` that no module of ``package`` names: under tests/PART/
    (PART a package of it, or a module at its top) each file is test_MODULE.py for a module
    of that part, or listed in ``allowed``; tests/project/ is the project's own."""
    wrong = []
    for path in sorted(tests.rglob("test_*.py")):
        where = path.relative_to(tests).as_posix()
        part = path.relative_to(tests).parts[0]
        if part == "project" or where in allowed:
            continue
        if (package / part / "__init__.py").exists():
            names = {p.stem for p in (package / part).glob("*.py")} - {"__init__"}
        else:
            names = {part} if (package / f"{part}.py").exists() else set()
        if path.parent != tests / part or path.stem.removeprefix("test_") not in names:
            wrong.append(f"tests/{where}")
    return wrong


def test_each_test_file_is_named_after_the_module_it_tests(tmp_path):
    assert misnamed_tests(TESTS, PACKAGE, NOT_A_MODULE) == [], (
        "name it test_MODULE.py after a module of its package (or list it in NOT_A_MODULE)")
    assert all((TESTS / where).exists() for where in NOT_A_MODULE), "NOT_A_MODULE names a gone file"
    # A file named after a module that was renamed, or after none, is caught.
    for where in ("training/test_loop.py", "training/test_train.py", "model/test_model.py",
                  "model/test_other.py", "nowhere/test_x.py", "project/test_anything.py"):
        (tmp_path / "tests" / where).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "tests" / where).touch()
    for module in ("training/__init__.py", "training/loop.py", "model.py"):
        (tmp_path / "aiayn" / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "aiayn" / module).touch()
    assert misnamed_tests(tmp_path / "tests", tmp_path / "aiayn", {}) == [
        "tests/model/test_other.py", "tests/nowhere/test_x.py", "tests/training/test_train.py"]


def test_imports_follow_the_rules_the_docstrings_state():
    broken = []
    for name, path in modules().items():
        rule = rule_for(name)
        if rule is None:
            continue
        owner, may = rule
        for target in aiayn_imports(path):
            inside = target == owner or target.startswith(owner + ".")
            if not inside and not any(target == m or target.startswith(m + ".") for m in may):
                broken.append(f"{name} imports {target} (rule of {owner}: {', '.join(may) or 'nothing'})")
    assert broken == []


def test_the_rules_admit_no_cycle_between_packages():
    graph: dict[str, set[str]] = {}
    for name in modules():
        rule = rule_for(name)
        if rule is not None:
            graph[rule[0]] = {m if m in modules() and m.count(".") == 1 else ".".join(m.split(".")[:2])
                              for m in rule[1]}
    seen: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        assert node not in path, f"cycle: {' -> '.join([*path, node])}"
        if seen.get(node):
            return
        for nxt in graph.get(node, ()):
            visit(nxt, [*path, node])
        seen[node] = 1

    for node in graph:
        visit(node, [])


def test_the_model_files_depend_on_torch_alone():
    stdlib = set(sys.stdlib_module_names)
    for name in TORCH_ALONE:
        tree = ast.parse((PACKAGE / f"{name}.py").read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.module in TORCH_ALONE, f"{name}.py imports .{node.module}"
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                roots = ([a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import)
                         else [(node.module or "").split(".")[0]])
                for root in roots:
                    assert root in stdlib or root == "torch", f"{name}.py imports {root}"


@pytest.mark.parametrize("name", sorted(modules()))
def test_a_module_over_500_lines_says_why(name):
    path = modules()[name]
    lines = len(path.read_text(encoding="utf-8").splitlines())
    if lines > MAX_LINES:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        assert "500" in doc, f"{name}: {lines} lines and no word in its docstring on why"


def test_no_module_imports_another_in_a_circle():
    """Between aiayn's modules, counting the imports inside functions (a late import only
    hides a circle): a base module that names its own subclasses, or two halves of one
    module cut apart, show up here as a cycle."""
    edges = {name: targets & modules().keys() for name, targets in generate.module_edges().items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1 or node in edges.get(node, ()):
                cycles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    assert cycles == [], "modules that import each other: " + "; ".join(" <-> ".join(c)
                                                                         for c in cycles)


def test_no_module_imports_a_private_name_from_another():
    """A name with a leading underscore belongs to its module: what another module needs
    is made public where it lives (or moved where both can reach it)."""
    crossed = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "")
                                                     .split(".")[0] == "aiayn"):
                crossed += [f"{name} imports {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")]
    assert crossed == []
