"""constraints.txt, the exact versions `make venv` installs, fits pyproject.toml: every
dependency (extras included) is pinned, each pin lies within its range, and every range has
an upper bound, so neither a `make` user nor a `pip install` user gets a next major version
nobody tested."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

requirements = pytest.importorskip("packaging.requirements")
utils = pytest.importorskip("packaging.utils")

ROOT = Path(__file__).resolve().parents[2]


def declared() -> list:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    lines = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        lines += extra
    return [requirements.Requirement(line) for line in lines]


def pins() -> dict[str, str]:
    found = {}
    for number, line in enumerate((ROOT / "constraints.txt").read_text().splitlines(), 1):
        line = line.split("#")[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==([^\s;+]+)", line)
        assert match, f"constraints.txt, line {number}: not NAME==VERSION: {line!r}"
        found[utils.canonicalize_name(match.group(1))] = match.group(2)
    return found


def test_every_dependency_is_pinned_within_its_range():
    pinned = pins()
    for requirement in declared():
        name = utils.canonicalize_name(requirement.name)
        assert name in pinned, f"{requirement.name} is not pinned in constraints.txt"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (
            f"constraints.txt pins {requirement.name}=={pinned[name]}, outside "
            f"pyproject.toml's {requirement.specifier}")


def test_every_range_stops_below_a_next_version():
    unbounded = [str(r) for r in declared()
                 if not any(s.operator in ("<", "<=", "==", "~=") for s in r.specifier)]
    assert not unbounded, f"ranges without an upper bound: {unbounded}"


def test_the_range_check_can_fail():
    requirement = requirements.Requirement("transformers>=5,<6")
    assert not requirement.specifier.contains("6.0.0")
    assert requirement.specifier.contains("5.24.0")
