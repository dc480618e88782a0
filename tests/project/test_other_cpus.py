"""The numerics tests again on the kernels of an AVX2-only CPU.

PyTorch, oneDNN and MKL pick their kernels by the CPU's instruction set, and kernels for
other instruction sets round differently. A test that compares two computations exactly
passes only where one kernel computes both sides; on a CPU with AVX512 or AMX this re-runs
the tests of the model, the searches, the kernels and the optimiser with the AVX2 kernels
that the suite's oldest machines run, so an exactness that holds on one kind of CPU alone
fails here, before it fails on another machine (docs/troubleshooting.md#tests-on-other-cpus).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT

pytestmark = pytest.mark.slow  # a pytest process per CPU kind

# The variables each library reads for its highest instruction set (oneDNN: two names).
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
NUMERICS = ["tests/model/test_model.py", "tests/inference/test_search.py", "tests/inference/test_kernels.py",
            "tests/training/test_optim.py"]


def test_avx2_kernels_are_what_the_variables_choose():
    env = {**os.environ, **AVX2_ONLY}
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.stdout.strip() in ("AVX2", "DEFAULT"), result.stderr  # never above AVX2


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT"),
                    reason="this CPU runs the AVX2 kernels already: the suite is that run")
def test_the_numerics_tests_pass_on_avx2_kernels():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *NUMERICS],
        cwd=ROOT, env={**os.environ, **AVX2_ONLY}, capture_output=True, text=True,
        timeout=900)
    assert result.returncode == 0, result.stdout[-4000:]
