"""Checkpoints: atomic writes survive an interrupted save, loading never unpickles code,
step checkpoints are pruned by step number."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import tiny_model

from aiayn.errors import AiaynError
from aiayn.runs.checkpoint import load_train_state, load_weights, save_train_state, save_weights
from aiayn.runs.directory import list_step_checkpoints, prune_step_checkpoints, step_checkpoint_path
from aiayn.util import io


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def interrupt_rename(monkeypatch) -> None:
    """Make the rename step of every atomic write fail, as a kill between temp and rename."""

    def boom(src, dst):
        raise OSError("simulated crash between the temp write and the rename")

    monkeypatch.setattr(io.os, "replace", boom)


def test_interrupted_weights_save_leaves_the_old_file_loadable(tmp_path, monkeypatch):
    path = tmp_path / "last.safetensors"
    old, new = tiny_model(1), tiny_model(2)
    save_weights(old, path)
    interrupt_rename(monkeypatch)
    with pytest.raises(OSError, match="simulated crash"):
        save_weights(new, path)
    monkeypatch.undo()
    loaded = tiny_model(3)
    load_weights(loaded, path)
    assert_same_weights(loaded, old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.safetensors"]  # no temp left


def test_interrupted_train_state_save_leaves_the_old_state_loadable(tmp_path, monkeypatch):
    path = tmp_path / "train_state.pt"
    save_train_state({"step": 5, "rng": torch.arange(3), "nested": [1, 2.5, "x"]}, path)
    interrupt_rename(monkeypatch)
    with pytest.raises(OSError):
        save_train_state({"step": 10}, path)
    monkeypatch.undo()
    state = load_train_state(path)
    assert state["step"] == 5 and state["nested"] == [1, 2.5, "x"]
    assert torch.equal(state["rng"], torch.arange(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train_state.pt"]


class NotPlainData:
    """An arbitrary class: a weights_only load must refuse to rebuild it."""

    def __reduce__(self):
        return (os.getcwd, ())


def test_a_ctrl_c_during_the_train_state_save_comes_after_the_whole_file(tmp_path, monkeypatch):
    """Ctrl-C inside one of torch.save's writes to a Python file would be a RuntimeError
    ("unexpected pos ..."), not the KeyboardInterrupt that names the resume: it is held
    until train_state.pt is written, then raised."""
    import signal

    path = tmp_path / "train_state.pt"
    state = {"step": 7, "weights": torch.arange(100_000, dtype=torch.float32)}
    real_save, writes = torch.save, []

    def save_with_ctrl_c(obj, fh):  # a Ctrl-C from the keyboard at the first write
        def write(data):
            if not writes:
                signal.raise_signal(signal.SIGINT)
            writes.append(len(data))
            return fh.write(data)

        return real_save(obj, type("File", (), {"write": staticmethod(write),
                                                "flush": fh.flush})())

    monkeypatch.setattr(torch, "save", save_with_ctrl_c)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            save_train_state(state, path)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(writes) > 1  # held: torch.save went on to the end
    loaded = load_train_state(path)
    assert loaded["step"] == 7 and torch.equal(loaded["weights"], state["weights"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train_state.pt"]


def test_train_state_loading_refuses_arbitrary_objects(tmp_path):
    path = tmp_path / "train_state.pt"
    torch.save({"step": 1, "payload": NotPlainData()}, path)
    with pytest.raises(AiaynError, match="cannot read training state"):
        load_train_state(path)


def test_truncated_weights_file_is_a_clear_error(tmp_path):
    path = tmp_path / "w.safetensors"
    save_weights(tiny_model(1), path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(AiaynError, match="not a readable safetensors file"):
        load_weights(tiny_model(1), path)


def test_step_checkpoints_are_listed_and_pruned_by_step_number(tmp_path):
    for step in (5, 100, 20, 1000, 7):
        path = step_checkpoint_path(tmp_path, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    assert step_checkpoint_path(tmp_path, 20).name == "step_0000020.safetensors"
    assert [p.name for p in list_step_checkpoints(tmp_path)] == [
        "step_0000005.safetensors", "step_0000007.safetensors", "step_0000020.safetensors",
        "step_0000100.safetensors", "step_0001000.safetensors"]
    removed = prune_step_checkpoints(tmp_path, keep=2)
    assert [p.name for p in removed] == [
        "step_0000005.safetensors", "step_0000007.safetensors", "step_0000020.safetensors"]
    assert [p.name for p in list_step_checkpoints(tmp_path)] == [
        "step_0000100.safetensors", "step_0001000.safetensors"]
    assert list_step_checkpoints(tmp_path / "nowhere") == []
