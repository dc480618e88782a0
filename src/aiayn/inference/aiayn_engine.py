"""aiayn's own engine: ``AiaynEngine``, the ``Engine`` (``aiayn.inference.engine``) over
aiayn's Transformer and its searches (``aiayn.inference.search``), several batches at once on
CPU streams (``aiayn.util.threads``).
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch

from aiayn.data.batching import pad
from aiayn.errors import AiaynError, SettingError
from aiayn.inference.budget import (
    decode_bytes_per_token,
    default_decode_tokens,
    memory_bytes,
)
from aiayn.inference.engine import Engine
from aiayn.inference.int8 import int8_decoding
from aiayn.inference.kernels import choose_output_kernel
from aiayn.inference.search import decode_beam, decode_greedy
from aiayn.inference.settings import Search
from aiayn.inference.steps import Hypothesis, unwritable
from aiayn.model import OutputKernel, Transformer
from aiayn.util.device import parameter_device

# Rows of a decoding step the output layer's kernel is chosen for (aiayn.inference.kernels): a beam
# of 4-6 over the ~50 sentences of an 8,192-token batch.
DECODE_PROBE_ROWS = 256


class AiaynEngine(Engine):
    """aiayn's own search (``aiayn.inference.search``) over a Transformer, several batches at
    once, each on one CPU thread (``aiayn.util.threads``)."""

    name = "aiayn"
    continuous = True
    own_model = True

    def __init__(self, model: Transformer, device: str | torch.device | None = None,
                 bf16: bool = False, streams: int | None = None, threads_per_stream: int = 1,
                 kernel: OutputKernel | None = None, int8: bool = False):
        """``bf16``: decode under bfloat16 autocast (as training validates under train.precision bf16).
        ``streams``: batches decoded at once (None: ``default_streams``, as many as torch
        has threads when decoding starts); ``threads_per_stream`` > 1 only to measure the
        barriers that one thread avoids. ``kernel``: the output layer's product
        (``aiayn.inference.kernels``: a Trainer's choice for its model); None: chosen here.
        ``int8``: the decoder's and the output layer's products in int8 (``aiayn.inference.int8``;
        a CPU, not with ``bf16``), computed by a copy of ``model``'s decoder that shares its
        other weights; ``model``'s weights must then stay as they are while it decodes."""
        self.device = torch.device(device) if device is not None else parameter_device(model)
        self.model = model.to(self.device).eval()
        self.kernel = kernel  # the searches compute with it; the model keeps none
        self.int8 = int8
        if int8:
            if bf16:
                raise AiaynError("int8 and bf16 decoding exclude each other: choose one")
            self.model, self.kernel = int8_decoding(self.model)
        elif kernel is None:  # not chosen yet (a Trainer chooses for its own)
            self.kernel = choose_output_kernel(model.generator, DECODE_PROBE_ROWS,
                                               enabled=not bf16)[0]
        self.max_len, self.tgt_vocab_size = model.cfg.max_len, model.cfg.tgt_vocab_size
        self.bf16 = bf16
        self.streams, self.threads_per_stream = streams, threads_per_stream

    @classmethod
    def load(cls, run_dir: str | Path, weights: str | Path = "best",
             device: str | torch.device | None = None, **options):
        """A run directory's engine, tokenizers and config (``load_run``)."""
        from aiayn.runs.directory import load_run  # an export is refused there, named

        config, model, tokenizers = load_run(run_dir, weights)
        return cls(model, device or "cpu", **options), tokenizers, config

    def unwritable(self, ids: list[int]) -> list[int]:
        """The output layer's own answer (``aiayn.inference.steps.unwritable``)."""
        return unwritable(self.model, ids)

    def default_budget(self) -> int:
        return default_decode_tokens(self.model.cfg, self.device)

    def check_budget(self, decode_tokens: int) -> None:
        """At most what half of the device's memory holds (``decode_bytes_per_token``)."""
        per_token = decode_bytes_per_token(self.model.cfg)
        limit = memory_bytes(self.device) // 2 // per_token
        where = "the GPU's free memory" if self.device.type == "cuda" else "this machine's memory"
        if not 1 <= decode_tokens <= limit:
            raise SettingError("{decode_tokens} must be between 1 and {limit} for this model "
                               "(half of {where} at {per_token} bytes per padded token), got "
                               "{got}", limit=limit, where=where, per_token=per_token,
                               got=decode_tokens)

    @torch.inference_mode()
    def search(self, sources: list[list[int]], search: Search, greedy_ok: bool = False,
               prefixes: list[list[int]] | None = None) -> list[list[Hypothesis]]:
        """On a stream's thread: grad mode and autocast are per thread, so both are set here."""
        src = pad(sources).to(self.device)
        autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if self.bf16
                    else nullcontext())
        with autocast:
            if greedy_ok and search.greedy:
                return [[Hypothesis(ids, 0.0)] for ids in decode_greedy(
                    self.model, src, search, kernel=self.kernel, prefixes=prefixes)]
            return decode_beam(self.model, src, search, kernel=self.kernel, prefixes=prefixes)
