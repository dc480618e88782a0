"""The documentation tells the truth about the repository it stands in.

- The generated pages (configuration, command line, results, the module map and the
  signatures of the interfaces page) are what docs/generate.py writes from the code and
  benchmarks/results/ today.
- Every relative link, #anchor, backticked repository path and cited section title in the
  README, docs/, benchmarks/*.md, configs/ and src/ resolves.
- Every `aiayn ...` command line in the code blocks of the README and docs is accepted by
  the real parser.
- The README's own-data quick start runs end to end, from the README's own text.
- Every figure of the README's results table is in its results file.
- The README stays short, and the project speaks of itself (no work-diary words, no commit
  hashes) in the README, docs, configs, src and tests.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import toy_tsv

from aiayn.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MARKDOWN = sorted([README, ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md",
                   ROOT / "benchmarks" / "peers" / "README.md", *(ROOT / "docs").glob("*.md")])
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
SOURCES = sorted((ROOT / "src").rglob("*.py"))
# Top-level entries a backticked path may start with to count as a repository path.
TOP = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")} | {".ci"}
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
README_BUDGET = 14 * 1024  # bytes
FIRST_OWN_DATA_COMMAND_WITHIN = 3584  # bytes from the README's start


def _spec(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = _spec("generate", ROOT / "docs" / "generate.py")


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def prose(text: str) -> str:
    """Markdown without its fenced code blocks (links and paths there are not links)."""
    return FENCE.sub("", text)


def code_blocks(text: str) -> list[str]:
    return [m.group(0).split("\n", 1)[1].rsplit("\n", 1)[0] for m in FENCE.finditer(text)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: links reduced to their text, lower case, everything
    but letters, digits, spaces, hyphens and underscores dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(path: Path) -> list[str]:
    return [m.group(2).strip() for m in re.finditer(r"^(#{1,6})\s+(.+?)\s*#*$",
                                                    prose(path.read_text(encoding="utf-8")), re.M)]


def anchors(path: Path) -> set[str]:
    """Every #anchor of a Markdown file, duplicates numbered as GitHub does."""
    seen: dict[str, int] = {}
    result = set()
    for heading in headings(path):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        result.add(base if n == 0 else f"{base}-{n}")
    text = path.read_text(encoding="utf-8")
    result |= set(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    return result


def _target_problem(source: Path, target: str, base: Path) -> str | None:
    """Why a link target (a path relative to ``base``, maybe with #anchor) does not
    resolve, or None."""
    path_part, _, anchor = target.partition("#")
    resolved = (base / path_part).resolve() if path_part else source
    if not resolved.exists():
        return f"{rel(source)}: {target}: no such file"
    if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
        return f"{rel(source)}: {target}: no heading with the anchor #{anchor}"
    return None


def test_generated_pages_are_current():
    assert generate.main(["--check"]) == 0, "docs/*.md generated pages are stale: run `make docs`"


def test_interfaces_signatures_are_the_codes_and_a_stale_one_is_caught(tmp_path, monkeypatch,
                                                                        capsys):
    """Each SIGNATURES block of docs/interfaces.md is inspect.signature of what INTERFACES
    lists: a hand edit of one (a signature that no longer matches) makes the check fail."""
    page = (ROOT / "docs" / "interfaces.md").read_text(encoding="utf-8")
    assert generate.interfaces_page(page) == page
    for names in generate.INTERFACES.values():
        for name in names:
            shown = rf"^\s*(class|def|@\w+ def) ({name.split('.')[-2]}\.)?{name.split('.')[-1]}[(:]"
            assert re.search(shown, page, re.M), f"docs/interfaces.md leaves out {name}"
    line = next(x for x in page.splitlines() if x.startswith("def load_run("))
    stale = page.replace(line, "def load_run(run_dir, weights='last', device='cpu')")
    assert generate.interfaces_page(stale) == page  # drawn anew from the code
    for path in (ROOT / "docs").glob("*.md"):  # the docs with that one edit
        shutil.copy(path, tmp_path)
    (tmp_path / "interfaces.md").write_text(stale, encoding="utf-8")
    monkeypatch.setattr(generate, "DOCS", tmp_path)
    assert generate.main(["--check"]) == 1
    assert capsys.readouterr().err == "docs/interfaces.md not current: run `make docs`\n"


def test_a_name_the_interfaces_page_lists_and_the_code_lost_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(generate.INTERFACES, "engines",
                        ["aiayn.inference.ct2.NoSuchEngine", "aiayn.inference.gone.Engine"])
    with pytest.raises(SystemExit, match=r"^docs/generate.py: INTERFACES\['engines'\] names "
                       r"aiayn.inference.ct2.NoSuchEngine, which the code no longer has "
                       r"\(aiayn.inference.ct2 has no 'NoSuchEngine'\)") as raised:
        generate.interfaces_page()
    assert "\n" not in str(raised.value)
    monkeypatch.setitem(generate.INTERFACES, "engines", ["aiayn.inference.gone.Engine"])
    with pytest.raises(SystemExit, match="names aiayn.inference.gone.Engine, which the code no "
                                         "longer has \\(aiayn.inference has no 'gone'\\)"):
        generate.interfaces_page()
    # The other pages are still checked (written, without --check), the failure said last.
    assert generate.main(["--check"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "docs/generate.py: INTERFACES['engines'] names aiayn.inference.gone.Engine")
    monkeypatch.setitem(generate.INTERFACES, "no-such-block", [])
    with pytest.raises(SystemExit, match="has no SIGNATURES no-such-block block"):
        generate.interfaces_page()


def test_configuration_page_covers_every_setting_with_its_meaning():
    from aiayn import config

    page = generate.configuration_page()
    for section, klass in config.SECTIONS.items():
        docs = generate.field_docs(klass)
        for name in (f.name for f in dataclasses.fields(klass)):
            assert docs.get(name), f"{klass.__name__}.{name} has no docstring"
            assert f"`{section}.{name}`" in page
    assert "[0, 0.999]" in page  # model.dropout's range, from config.RANGES


def test_cli_page_covers_every_subcommand_and_option():
    page = generate.cli_page()
    for name, (parser, _) in generate.subcommands().items():
        assert f"## aiayn {name}" in page
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"aiayn {name}: {action.dest} has no help text"
            for option in action.option_strings:
                assert f"`{option}" in page or f", {option}" in page, (name, option)


def test_links_and_anchors_resolve():
    problems = []
    for path in MARKDOWN:
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)",
                                 prose(path.read_text(encoding="utf-8"))):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            problem = _target_problem(path, target, path.parent)
            if problem:
                problems.append(problem)
    assert not problems, "\n".join(problems)


def _inline_code(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", prose(text))


def _repository_path(candidate: str) -> bool:
    """`src/aiayn/model.py`, `configs/*.yaml`: a path under a top-level entry of the
    repository (runs/ and data/ are the user's, and templates with {...} are not paths)."""
    first = candidate.split("/")[0]
    return ("/" in candidate and first in TOP - {"runs", "data"}
            and not re.search(r"[\s{}<>]", candidate))


def _placeholder(candidate: str) -> bool:
    """`benchmarks/results/peers/OUT`: a part in capitals stands for a name the user picks."""
    return any(re.fullmatch(r"[A-Z][A-Z0-9_]*", part) for part in candidate.split("/"))


def test_backticked_repository_paths_exist():
    problems = []
    for path in MARKDOWN:
        for candidate in _inline_code(path.read_text(encoding="utf-8")):
            candidate = candidate.split("#")[0].rstrip(":,")
            if not _repository_path(candidate):
                continue
            exists = list(ROOT.glob(candidate)) if "*" in candidate else (ROOT / candidate).exists()
            if not exists and not _placeholder(candidate):
                problems.append(f"{rel(path)}: `{candidate}` does not exist")
    assert not problems, "\n".join(problems)


def _flat(path: Path) -> str:
    """A file's text with comment markers at line starts removed and whitespace folded,
    so a reference broken over two comment lines reads as one."""
    text = re.sub(r"\n[ \t]*#+[ \t]?", " ", path.read_text(encoding="utf-8"))
    return " ".join(text.split())


def test_references_from_configs_and_code_resolve():
    problems = []
    pattern = re.compile(r"\b((?:docs|benchmarks|configs|src|tests)/[\w./\-]*[\w/])(#[\w\-]+)?")
    for path in [*CONFIGS, *SOURCES]:
        for target, anchor in pattern.findall(_flat(path)):
            if "*" in target:
                continue
            problem = _target_problem(path, target + anchor, ROOT)
            if problem:
                problems.append(problem)
    assert not problems, "\n".join(problems)


def test_cited_section_titles_exist():
    """`FILE.md, "Title"` names a heading of FILE.md (a bold paragraph cannot be linked)."""
    problems = []
    cite = re.compile(r"([\w./\-]+\.md)(?:#[\w\-]+)?,?\s+[\"“]([^\"”]+)[\"”]")
    for path in [*MARKDOWN, *CONFIGS, *SOURCES]:
        for target, title in cite.findall(_flat(path)):
            cited = next((c for c in ((path.parent / target), ROOT / target) if c.is_file()), None)
            if cited is None:
                problems.append(f"{rel(path)}: cites {target}, which does not exist")
            elif title.replace("`", "").lower() not in {
                    h.replace("`", "").lower() for h in headings(cited)}:
                problems.append(f"{rel(path)}: {target} has no section titled {title!r}")
    assert not problems, "\n".join(problems)


def _command_lines(text: str) -> list[str]:
    """The shell lines of a Markdown text's code blocks, continuation lines joined."""
    lines = []
    for block in code_blocks(text):
        lines += block.replace("\\\n", " ").splitlines()
    return lines


def _aiayn_argvs(line: str) -> list[list[str]]:
    """The argument lists given to `aiayn` on one shell line (`aiayn ...`,
    `.venv/bin/aiayn ...`, `python -m aiayn ...`, `torchrun ... -m aiayn ...`), each
    command of a pipe or list separately."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return []
    argvs, segment = [], []
    for word in [*words, "|"]:
        if word not in ("|", "||", "&&", ";", "&"):
            segment.append(word)
            continue
        while segment and re.match(r"^\w+=", segment[0]):
            segment.pop(0)
        if segment and segment[0].split("/")[-1] == "aiayn":
            argvs.append(segment[1:])
        elif "-m" in segment and segment[segment.index("-m") + 1:][:1] == ["aiayn"]:
            argvs.append(segment[segment.index("-m") + 2:])
        segment = []
    return argvs


def test_command_lines_in_readme_and_docs_parse():
    parser = build_parser()
    problems, checked = [], 0
    # docs/cli.md is the parser's own description (its usage lines are templates).
    for path in (p for p in MARKDOWN if p.name != "cli.md"):
        for line in _command_lines(path.read_text(encoding="utf-8")):
            for argv in _aiayn_argvs(line):
                checked += 1
                try:
                    parser.parse_args(argv)
                except SystemExit as stop:
                    if stop.code:  # `aiayn --help` exits 0
                        problems.append(f"{rel(path)}: {line.strip()}")
    assert checked > 40  # the check found the commands it is there for
    assert not problems, "the parser rejects:\n" + "\n".join(problems)


def test_command_line_finder_finds_commands_and_skips_the_rest():
    assert _aiayn_argvs('echo "Hi." | aiayn translate runs/x  # the run\'s search') == [
        ["translate", "runs/x"]]
    assert _aiayn_argvs("torchrun --nproc_per_node 2 -m aiayn train --out r") == [
        ["train", "--out", "r"]]
    assert _aiayn_argvs("make demo") == []


def own_data_block() -> str:
    text = README.read_text(encoding="utf-8")
    match = re.search(r"<!-- own-data -->\s*```bash\n(.*?)```", text, re.S)
    assert match, "README.md: the own-data quick start block (after <!-- own-data -->) is missing"
    return match.group(1)


def test_readme_budget_and_first_own_data_command():
    data = README.read_bytes()
    assert len(data) <= README_BUDGET, f"README.md is {len(data)} bytes (budget {README_BUDGET})"
    first = own_data_block().splitlines()[0].encode("utf-8")
    assert data.index(first) <= FIRST_OWN_DATA_COMMAND_WITHIN


@pytest.mark.slow  # processes of their own
def test_own_data_quick_start_runs_as_the_readme_shows_it(tmp_path):
    """The README's commands, word for word, on a small TSV with the preset tiny for the
    README's (the only substitution; by name, so they run from any folder), in a fresh
    directory that holds no configs/."""
    block = own_data_block()
    commands = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert [c.split()[1] for c in commands if c.startswith("aiayn")] == [
        "prepare", "train", "translate", "evaluate"] and "| aiayn translate" in block
    corpus = re.search(r"--corpus tsv:(\S+)", block).group(1)
    (tmp_path / Path(corpus).parent).mkdir(parents=True, exist_ok=True)
    words = ["red", "green", "blue", "cat", "dog", "sees", "the", "a"]
    toy_tsv(tmp_path / corpus, words)
    inputs = re.search(r"aiayn translate \S+ -i (\S+) -o (\S+)", block)
    assert inputs, "the quick start has no file example"
    (tmp_path / inputs.group(1)).write_text("red cat\nthe dog sees\n", encoding="utf-8")
    presets = set(re.findall(r"--config (\S+)", block))
    assert presets and not any("/" in p for p in presets), "name the preset, not a path"
    script = block
    for preset in presets:
        script = script.replace(f"--config {preset}", "--config tiny")
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "aiayn").exists():
        pytest.skip("the aiayn console script is not installed beside this Python")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    run = next(p for p in (tmp_path / "runs").iterdir())
    assert (run / "best.safetensors").is_file() and (run / "config.yaml").is_file()
    translations = [line for line in done.stdout.splitlines() if line.strip()]
    assert translations, "aiayn translate printed nothing"
    assert len((tmp_path / inputs.group(2)).read_text(encoding="utf-8").splitlines()) == 2
    assert "BLEU" in done.stdout + done.stderr  # aiayn evaluate's report


def _table_after(text: str, heading: str) -> list[list[str]]:
    section = text.split(heading, 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    return [row for row in cells[2:] if row]  # header and rule


def test_readme_results_table_figures_are_in_the_results_files():
    text = README.read_text(encoding="utf-8")
    rows = _table_after(text, "## What to expect")
    assert len(rows) >= 4
    sources = []
    for name in ("demo.json", "peers.json"):
        table = json.loads((ROOT / "benchmarks" / "results" / name).read_text(encoding="utf-8"))
        sources += [generate._number(v) for row in table["rows"] for v in row.values()]
        sources += [json.dumps(table["conditions"], ensure_ascii=False)]
        sources += [str(v) for row in table["rows"] for v in row.values()]
    def numbers(text: str) -> list[float]:  # "2,305" and 2305, "19.80" and 19.8 are one figure
        return [float(n.replace(",", "")) for n in re.findall(r"\d[\d,]*(?:\.\d+)?", text)]

    known = set(numbers(" ".join(sources)))
    missing = [(row[0], number) for row in rows for cell in row
               for number in numbers(re.sub(r"\[[^\]]*\]\([^)]*\)", "", cell))
               if number not in known]
    assert not missing, f"README figures not in benchmarks/results/demo.json or peers.json: {missing}"


DIARY = re.compile(r"\bsessions?\s+\d+|\bsession\s+\d+\s+of\b|\bissues?\s*#\s*\d+|\bissue\s+\d+",
                   re.I)


def _history_files() -> list[Path]:
    files = [p for p in MARKDOWN if p.name != "CHANGELOG.md"]
    files += [*CONFIGS, *(ROOT / "src").rglob("*.*"), *(ROOT / "tests").glob("*.py"),
              ROOT / "docs" / "generate.py", ROOT / "docs" / "notebook.py"]
    return [p for p in files if p.suffix in {".md", ".py", ".yaml", ".js", ".html", ".css"}]


def test_the_project_speaks_of_itself():
    """No work-session or issue numbers, and no commit of this repository named, in the
    README, docs, configs, src or tests (history lives in git and CHANGELOG.md)."""
    problems = []
    hexes: dict[str, list[str]] = {}
    for path in _history_files():
        text = path.read_text(encoding="utf-8")
        problems += [f"{rel(path)}: {m.group(0)!r}" for m in DIARY.finditer(text)]
        for token in set(re.findall(r"\b[0-9a-f]{7,40}\b", text)):
            if re.search(r"[a-f]", token) and re.search(r"\d", token):
                hexes.setdefault(token, []).append(rel(path))
    if hexes and shutil.which("git") and (ROOT / ".git").exists():
        answer = subprocess.run(["git", "cat-file", "--batch-check"], cwd=ROOT, text=True,
                                input="".join(f"{t}^{{commit}}\n" for t in hexes),
                                capture_output=True).stdout.splitlines()
        problems += [f"{', '.join(hexes[t])}: names commit {t}"
                     for t, line in zip(hexes, answer) if not line.endswith("missing")]
    assert not problems, "\n".join(problems)


def test_the_history_check_can_fail():
    # The words are built here so that this file does not hold them.
    assert DIARY.search("as " + "Session" + " 12 of the issue found")
    assert DIARY.search("see " + "issue" + " #27")
    assert not DIARY.search("over all its training sessions")


def _defined(tree: ast.AST) -> dict[str, ast.AST]:
    """The names a module (or class) body defines: functions, classes, assignments, imports."""
    names: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            names.update({t.id: node for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
    return names


def dotted_name_problem(name: str) -> str | None:
    """Why ``aiayn.x.y.z`` names no module, or no attribute of one (read from the source,
    not imported: a module's optional dependencies need not be installed); None if it does."""
    files = generate.module_files()
    parts = name.split(".")
    cut = max(i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in files)
    module, rest = ".".join(parts[:cut]), parts[cut:]
    scope: ast.AST = ast.parse(files[module].read_text(encoding="utf-8"))
    for depth, attr in enumerate(rest):
        defined = _defined(scope)
        if attr not in defined and depth == 0 and "__getattr__" in defined:
            # names a module loads on first use (aiayn.Translator): ask the module itself
            if hasattr(importlib.import_module(module), attr):
                return None
        if attr not in defined:
            where = ".".join([module, *rest[:depth]])
            return f"{where} has no {attr!r}" + (" (no such module either)" if depth == 0 else "")
        scope = defined[attr]
        if not isinstance(scope, ast.ClassDef):  # a function's or a value's own attributes
            break
    return None


def test_dotted_name_checker_finds_what_is_gone():
    assert dotted_name_problem("aiayn.data.corpora.CorpusStream") is None
    assert dotted_name_problem("aiayn.inference.translator.Translator.from_pretrained") is None
    assert dotted_name_problem("aiayn.data.tokenizer") is None
    assert "no 'decode'" in dotted_name_problem("aiayn.decode.beam_search")
    assert "no 'nope'" in dotted_name_problem("aiayn.inference.translator.Translator.nope")


def test_backticked_aiayn_names_resolve():
    """Every `aiayn.x.y` in the README and docs (outside CHANGELOG.md, which keeps the names of
    its time) is a module of the package, or a name one defines."""
    problems = []
    for path in (p for p in MARKDOWN if p.name != "CHANGELOG.md"):
        for code in _inline_code(path.read_text(encoding="utf-8")):
            for name in re.findall(r"(?<![\w./-])aiayn(?:\.\w+)+", code):
                problem = dotted_name_problem(name)
                if problem:
                    problems.append(f"{rel(path)}: `{name}`: {problem}")
    assert not problems, "\n".join(problems)


def test_module_map_lists_every_module_and_orders_the_parts_bottom_up():
    page = generate.module_map()
    for path in generate.module_files().values():
        assert f"(../{rel(path)})" in page, f"the map leaves out {rel(path)}"
    # A cycle starts at the part with the fewest imports above it, and the map names the
    # import that runs against the order; a part outside the cycle waits for it.
    assert generate.bottom_up({"a": {"b"}, "b": {"a", "c"}, "c": set(), "d": {"a"}}) == [
        "c", "a", "b", "d"]
    assert generate.first_sentence("Prepare: a spec becomes a folder::\n\n    x") == (
        "Prepare: a spec becomes a folder.")
    assert generate.first_sentence("One. Two.") == "One."
