"""The fast tier (`make test-fast`) leaves out what tests/conftest.py calls slow: a renamed
fixture must not carry its costly tests into the edit-run loop unnoticed."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# tests/conftest.py by its path: ``import conftest`` finds whichever conftest.py pytest loaded
# last (tests/serving/ has one of its own).
_spec = importlib.util.spec_from_file_location("tests_conftest", TESTS / "conftest.py")
_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)
SLOW_FIXTURES = _conftest.SLOW_FIXTURES


def fixtures_defined() -> set[str]:
    names = set()
    for path in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and any(
                    "fixture" in ast.unparse(d) for d in node.decorator_list):
                names.add(node.name)
    return names


def test_every_slow_fixture_is_a_fixture_of_the_suite():
    assert SLOW_FIXTURES <= fixtures_defined(), SLOW_FIXTURES - fixtures_defined()

