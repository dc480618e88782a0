"""aiayn.training.stream: what a training run reads (the parts not covered through the loop)."""

from __future__ import annotations

import pytest
from helpers import write_prepared

from aiayn.config import Config
from aiayn.errors import AiaynError
from aiayn.training.distributed import Dist
from aiayn.training.stream import load_data


def test_train_curriculum_reaches_the_sampler_and_is_said_in_one_line(tmp_path):
    data = write_prepared(tmp_path / "data")
    lines: list[str] = []
    config = Config().override(["train.curriculum=length", "train.curriculum_start=0.25",
                                "train.max_tokens=64", "model.max_len=32"]).validate()
    first = load_data(data, config, Dist(), log=lines.append).sampler
    assert first.curriculum_start == 0.25
    assert [line for line in lines if line.startswith("curriculum:")] == [
        "curriculum: the first pass from its narrowest batches up (train.curriculum length: "
        "its first steps draw among the narrowest 25%, its last among all), the others shuffled"]
    order = [tuple(b) for b in first]
    plain = load_data(data, Config().override(["train.max_tokens=64", "model.max_len=32"]).validate(), Dist(),
                      log=lines.append).sampler
    assert plain.curriculum_start is None and [tuple(b) for b in plain] != order
    for bad, setting in (("train.curriculum=short", "train.curriculum"),
                         ("train.curriculum_start=0", "train.curriculum_start")):
        with pytest.raises(AiaynError, match=setting):
            Config().override([bad]).validate()
