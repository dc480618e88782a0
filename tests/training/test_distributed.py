"""The device's precision (train.precision, and train.bf16 its older name). (CPU threads:
tests/util/test_threads.py.)"""

from __future__ import annotations

import pytest
import torch

from aiayn.config import Config
from aiayn.errors import AiaynError
from aiayn.util.device import prefer_bf16, resolve_bf16, resolve_precision


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
    with pytest.raises(AiaynError, match=r"train.bf16 \(now train.precision.*\) must be one "
                       "of auto, true, false, got 'maybe'"):
        Config().override(["train.bf16=maybe"]).validate()
    with pytest.raises(ValueError, match="must be resolved first"):
        _ = Config().train.use_bf16
    assert Config().override(["train.bf16=true"]).train.use_bf16


def test_precision_forces_or_chooses_per_device(monkeypatch):
    cpu = torch.device("cpu")
    for forced in ("fp32", "bf16", "fp16"):
        assert resolve_precision(forced, cpu) == (forced, f"train.precision={forced}")
    assert resolve_precision("auto", torch.device("mps"))[0] == "fp32"
    # A CPU: the probe's bf16, else fp32 (never fp16, which no CPU runs fast).
    import aiayn.util.device

    for fast, expected in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(aiayn.util.device, "prefer_bf16", lambda fp32, bf16, f=fast: f)
        assert resolve_precision("auto", cpu)[0] == expected
    # A GPU: bf16 where it has it, else fp16 with the scaler.
    for has_bf16, expected in ((True, "bf16"), (False, "fp16")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda h=has_bf16: h)
        use, why = resolve_precision("auto", torch.device("cuda"))
        assert use == expected and why.startswith("auto: this GPU")


def test_the_older_bf16_key_reads_as_precision_in_files_sets_and_saved_runs(tmp_path):
    """train.bf16 (true / false / auto, YAML booleans too) is train.precision bf16 / fp32 /
    auto wherever a config comes from; a config written now holds precision alone."""
    from aiayn.config import load_config, save_config

    for value, precision in ((True, "bf16"), (False, "fp32"), ("true", "bf16"),
                             ("false", "fp32"), ("auto", "auto")):
        assert Config.from_dict({"train": {"bf16": value}}).train.precision == precision
        assert Config().override([f"train.bf16={str(value).lower()}"]).train.precision == precision
    old = tmp_path / "config.yaml"  # a run directory's config.yaml from before the rename
    old.write_text("train:\n  bf16: 'true'\n  max_steps: 7\n", encoding="utf-8")
    config = load_config(old)
    assert (config.train.precision, config.train.max_steps) == ("bf16", 7)
    save_config(config, tmp_path / "again.yaml")
    text = (tmp_path / "again.yaml").read_text(encoding="utf-8")
    assert "precision: bf16" in text and "bf16:" not in text.replace("precision: bf16", "")
    with pytest.raises(AiaynError, match="bf16 .* and precision .* disagree"):
        Config.from_dict({"train": {"bf16": True, "precision": "fp16"}})
    assert Config.from_dict({"train": {"bf16": True, "precision": "bf16"}}).train.use_bf16
    with pytest.raises(AiaynError, match="train.precision must be one of auto, fp32, bf16, fp16"):
        Config().override(["train.precision=fp8"]).validate()
    fp16 = Config().override(["train.precision=fp16"]).train
    assert fp16.use_fp16 and not fp16.use_bf16 and fp16.bf16 == "false"


def test_code_written_before_the_rename_still_runs():
    """Notebooks and scripts build TrainConfig(bf16=...), replace(t, bf16=...), and set or
    read t.bf16: all of them mean train.precision."""
    from dataclasses import replace

    from aiayn.config import TrainConfig

    t = TrainConfig(bf16="false", seed=3)
    assert (t.precision, t.seed) == ("fp32", 3)
    assert replace(t, bf16="true").precision == "bf16" and replace(t, bf16="auto").bf16 == "auto"
    t.bf16 = True
    assert t.precision == "bf16" and t.bf16 == "true"
