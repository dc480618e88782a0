"""The pip-only path of docs/install.md, as a user without Debian, make or apt-get takes it:
build the wheel (`python -m build`), check its metadata (`twine check`), install it into a
fresh venv (torch's CPU wheel first, then the wheel within constraints.txt), and run own
data through `aiayn prepare`, `train` and `translate` from there."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from cjk_corpus import write_tsv

from aiayn.inference.native import cpu_supported

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"  # the CPU build, first: a bare torch requirement pulls CUDA's


def run(*args, cwd: Path, env: dict | None = None, stdin: str | None = None) -> str:
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, input=stdin,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{' '.join(map(str, args))}\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.mark.slow  # two to three minutes: torch and the dependencies unpacked into a venv
def test_the_wheel_installs_with_pip_alone_and_takes_own_data(tmp_path):
    # What the sdist holds: built from a copy, so the checkout gets no build/ or egg-info.
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "src", "configs"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(ROOT / name, tree / name, **({"ignore": shutil.ignore_patterns(
            "__pycache__", "*.egg-info")} if (ROOT / name).is_dir() else {}))
    run(sys.executable, "-m", "build", "--wheel", "--outdir", tmp_path / "dist", tree, cwd=tree)
    wheels = list((tmp_path / "dist").glob("aiayn-*.whl"))
    assert len(wheels) == 1
    assert "PASSED" in run(sys.executable, "-m", "twine", "check", wheels[0], cwd=tmp_path)
    # Every subpackage and the page's files travel (pyproject.toml lists them one by one).
    inside = set(zipfile.ZipFile(wheels[0]).namelist())
    wanted = {p.relative_to(ROOT / "src").as_posix() for p in (ROOT / "src" / "aiayn").rglob("*")
              if p.is_file() and p.suffix in (".py", ".html", ".js", ".css", ".c")
              and "__pycache__" not in p.parts}
    assert wanted - inside == set()

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    bin_dir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bin_dir / "python"
    # Nothing of this checkout on the path: the venv's own aiayn, or none.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    pip = [python, "-m", "pip", "install", "--quiet", "--no-compile"]
    run(*pip, TORCH, cwd=tmp_path, env=env)
    run(*pip, wheels[0], "-c", ROOT / "constraints.txt", cwd=tmp_path, env=env)
    where = run(python, "-c", "import aiayn; print(aiayn.__file__)", cwd=tmp_path, env=env)
    assert Path(where.strip()).is_relative_to(venv)

    # Own data in the README's commands, with a preset by name (no configs/ folder here).
    aiayn = bin_dir / "aiayn"
    corpus = write_tsv(tmp_path / "pairs.tsv", "zh")
    out = run(aiayn, "prepare", "--corpus", f"tsv:{corpus}", "--out", "data/mine",
              cwd=tmp_path, env=env)
    assert "kept 384, dropped 0" in out
    run(aiayn, "train", "--config", "tiny", "--data", "data/mine", "--out", "runs/mine",
        "--set", "train.max_steps=10", "--set", "train.eval_every=10", cwd=tmp_path, env=env)
    assert (tmp_path / "runs" / "mine" / "best.safetensors").is_file()
    translated = run(aiayn, "translate", "runs/mine", "--beam", "1", cwd=tmp_path, env=env,
                     stdin="I read a book.\n")
    assert len(translated.splitlines()) == 1
    if cpu_supported():  # int8's C source travels in the wheel and builds where it lands
        translated = run(aiayn, "translate", "runs/mine", "--beam", "1", "--int8", cwd=tmp_path,
                         env={**env, "XDG_CACHE_HOME": str(tmp_path / "cache")},
                         stdin="I read a book.\n")
        assert len(translated.splitlines()) == 1
        assert list((tmp_path / "cache" / "aiayn").glob("aiayn-native-*.so"))
