"""The fast tier (`make test-fast`) leaves out what tests/conftest.py calls slow: a renamed
fixture must not carry its costly tests into the edit-run loop unnoticed."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import SLOW_FIXTURES

TESTS = Path(__file__).resolve().parents[1]


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

