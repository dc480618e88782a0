"""The device's precision (train.bf16: auto). (CPU threads: tests/util/test_threads.py.)"""

from __future__ import annotations

import pytest
import torch

from aiayn.config import Config
from aiayn.errors import AiaynError
from aiayn.util.device import prefer_bf16, resolve_bf16


def test_bf16_auto_takes_bf16_only_where_it_is_clearly_faster():
    assert prefer_bf16(fp32_seconds=2.0e-3, bf16_seconds=1.0e-3)  # AVX512-BF16: ~2x
    assert not prefer_bf16(fp32_seconds=1.0e-3, bf16_seconds=80e-3)  # AVX2 emulation: ~80x
    assert not prefer_bf16(fp32_seconds=1.0e-3, bf16_seconds=0.95e-3)  # a tie keeps fp32


def test_resolve_bf16_forces_or_probes():
    cpu = torch.device("cpu")
    assert resolve_bf16("true", cpu) == (True, "train.bf16=true")
    assert resolve_bf16("false", cpu) == (False, "train.bf16=false")
    use, why = resolve_bf16("auto", cpu)
    assert isinstance(use, bool) and why.startswith("auto: a probe matmul took")


def test_bf16_setting_accepts_yaml_booleans_and_auto_and_refuses_the_rest():
    assert Config.from_dict({"train": {"bf16": True}}).train.bf16 == "true"
    assert Config.from_dict({"train": {"bf16": False}}).train.bf16 == "false"
    assert Config().train.bf16 == "auto"
    with pytest.raises(AiaynError, match="train.bf16 must be one of auto, true, false"):
        Config().override(["train.bf16=maybe"]).validate()
    with pytest.raises(ValueError, match="must be resolved first"):
        _ = Config().train.use_bf16
    assert Config().override(["train.bf16=true"]).train.use_bf16
