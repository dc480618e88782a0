"""Attention over training: the same translation's maps under the weights of each saved step
(`aiayn attention --steps`, serve's step slider), with the models of those steps loaded
when first asked for and a few kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aiayn.errors import AiaynError
from aiayn.inference.settings import Search
from aiayn.inference.translator import Translator
from aiayn.model import Transformer
from aiayn.runs.checkpoint import load_weights
from aiayn.runs.directory import step_weights
from aiayn.runs.metrics import read_metrics

# ---------------------------------------------------------------- attention capture


# ---------------------------------------------------------------- attention over training
class CheckpointModels:
    """Models holding the weights of a run's checkpoints, each loaded when first asked for
    and kept for the ``size`` most recently used. They are models of their own, never the
    one that translates: a server keeps answering with its weights meanwhile."""

    def __init__(self, cfg, size: int = 3):
        self.cfg, self.size = cfg, max(1, size)
        self._models: dict[Path, Transformer] = {}

    def get(self, path: str | Path) -> Transformer:
        path = Path(path)
        model = self._models.pop(path, None)
        if model is None:
            if len(self._models) >= self.size:
                del self._models[next(iter(self._models))]  # the least recently used
            model = Transformer(self.cfg)
            load_weights(model, path)
            model.eval()
        self._models[path] = model  # now the most recently used
        return model


@dataclass
class StepAttention:
    """One sentence's cross-attention in one decoder layer at each saved step of a run, all
    over the same target (teacher-forced), so that every panel has the same axes."""

    source: str
    translation: str  # the target every checkpoint is given
    src_tokens: list[str]  # columns (keys)
    tgt_tokens: list[str]  # rows (queries): [BOS] + the target
    layer: int  # the decoder layer, from 0
    n_layers: int
    steps: list[int | None]  # per checkpoint; None: last.safetensors without a step
    files: list[Path]
    maps: list[np.ndarray]  # per checkpoint: (heads, T_q, T_k)
    bleu: list[float | None]  # the dev BLEU metrics.jsonl has at that step


def check_layer(layer: int | None, n_layers: int) -> int:
    """--layer (from 1; None: the last) as an index from 0, or an AiaynError."""
    if layer is None:
        return n_layers - 1
    if not 1 <= layer <= n_layers:
        raise AiaynError(f"--layer must be between 1 and {n_layers} (the model's decoder "
                         f"layers), got {layer}")
    return layer - 1


def attention_over_steps(run_dir: str | Path, sentence: str, target: str | None = None,
                         layer: int | None = None, weights: str | Path = "best",
                         search: Search | None = None,
                         progress: Callable[[int], object] | None = None,
                         to: str | None = None) -> StepAttention:
    """The cross-attention of ``sentence`` at each of the run's saved steps (``step_weights``:
    its step checkpoints and last.safetensors), in step order. The target is the same in
    every checkpoint: ``target`` if given, else the translation by ``weights`` with
    ``search`` (``Translator.resolve``; None: the run's). ``layer``: the decoder layer, from
    1 (None: the last). ``progress(1)`` is called after each checkpoint. ``to``: the target
    language of a model of several (``Translator``)."""
    if not sentence.strip():
        raise AiaynError("the sentence to translate is empty")
    saved = step_weights(run_dir)  # before loading anything: a run without them says so
    translator = Translator.from_pretrained(run_dir, weights=weights, to=to)
    translator.check_direction()
    n_layers = translator.model.cfg.n_decoder_layers
    index = check_layer(layer, n_layers)
    if search is not None:
        translator.check(search)  # what this model can hold
    hypothesis = translator.target_ids(sentence, target, search)
    models = CheckpointModels(translator.model.cfg, size=1)
    maps, first = [], None
    for _, path in saved:
        att = translator.attention_of(models.get(path), sentence, hypothesis)
        first = first or att
        maps.append(att.maps["cross"][index])
        if progress is not None:
            progress(1)
    bleu = {r["step"]: r.get("bleu") for r in read_metrics(run_dir, missing_ok=True)
            if r["kind"] == "dev"}
    steps = [step for step, _ in saved]
    return StepAttention(sentence, first.translation, first.src_tokens, first.tgt_tokens,
                         index, n_layers, steps, [path for _, path in saved], maps,
                         [bleu.get(step) for step in steps])


