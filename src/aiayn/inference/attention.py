"""Attention maps of one translation: every layer and head, or the cross-attention of one
layer for many sentences (word alignments). ``capture_attention`` switches the model's
attention modules to the explicit product that keeps its weights (aiayn.model), only
inside its block.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from aiayn.data.batching import pad
from aiayn.data.tokenizer import BOS_ID
from aiayn.errors import AiaynError
from aiayn.model import Transformer
from aiayn.util.device import parameter_device


@dataclass
class SentenceAttention:
    """One sentence's translation and every attention map of a teacher-forced pass over it."""

    source: str
    translation: str
    src_tokens: list[str]  # the encoder's input tokens (keys of encoder and cross attention)
    tgt_tokens: list[str]  # the decoder's input tokens, [BOS] + hypothesis
    maps: dict[str, list[np.ndarray]]  # kind -> one (H, T_q, T_k) array per layer


@torch.no_grad()
def sentence_attention(model, tokenizers, sentence: str, hypothesis: Sequence[int]
                       ) -> SentenceAttention:
    """Run ``model`` teacher-forced on ``sentence`` -> [BOS] + ``hypothesis`` (target ids
    without BOS/EOS, e.g. from beam search) and record the attention weights of every
    layer (explicit-weights path, eval mode: no dropout)."""
    src_ids = tokenizers.encode_src([sentence])[0]
    tgt_ids = [BOS_ID, *hypothesis]  # the decoder inputs that produced the hypothesis
    src_tokens = list(tokenizers.src_tokens(sentence))
    if len(src_tokens) != len(src_ids):
        raise AiaynError(f"the tokenizer gives {len(src_tokens)} source token strings for "
                         f"{len(src_ids)} source ids")
    tgt_tokens = [tokenizers.tgt_id_to_token(i) for i in tgt_ids]
    max_len = model.cfg.max_len
    if len(src_ids) > max_len or len(tgt_ids) > max_len:
        raise AiaynError(f"the sentence ({len(src_ids)} tokens) or its translation "
                         f"({len(tgt_ids)}) is longer than the model's max_len={max_len}")
    translation = tokenizers.decode_tgt([list(hypothesis)])[0]
    device = parameter_device(model)
    src = torch.tensor([src_ids], dtype=torch.long, device=device)
    tgt = torch.tensor([tgt_ids], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        with capture_attention(model) as maps:
            model(src, tgt)
    finally:
        model.train(was_training)
    arrays = {kind: [m[0].float().cpu().numpy() for m in layer_maps]
              for kind, layer_maps in maps.items()}
    return SentenceAttention(sentence, translation, src_tokens, tgt_tokens, arrays)


@torch.no_grad()
def cross_attention(model: Transformer, sources: Sequence[list[int]],
                    targets: Sequence[Sequence[int]], layer: int) -> list[np.ndarray]:
    """The cross-attention of decoder layer ``layer`` (from 0), its heads averaged, in a
    teacher-forced pass over each source (ids, EOS included) and [BOS] + target: one
    (len(target), len(source)) array per pair, row j being the step that produced target
    token j (the row of the [EOS] it then produced is left out)."""
    device = parameter_device(model)
    src = pad(list(sources)).to(device)
    # The decoder input that produced the target: [BOS] + target, cut at max_len.
    tgt = pad([[BOS_ID, *t][:model.cfg.max_len] for t in targets]).to(device)
    was_training = model.training
    model.eval()
    try:
        with capture_attention(model, only={"cross": [layer]}) as maps:
            model.decode(tgt, model.encode(src), model.src_pad_mask(src))
    finally:
        model.train(was_training)
    weights = maps["cross"][0].float().mean(dim=1).cpu().numpy()  # (B, T, S): heads averaged
    return [weights[b, :len(t), :len(s)] for b, (s, t) in enumerate(zip(sources, targets,
                                                                         strict=True))]


@contextmanager
def capture_attention(model: Transformer, only: dict[str, list[int]] | None = None
                      ) -> Iterator[dict[str, list[Tensor]]]:
    """Record every attention map of the forward passes run inside the block.

    Yields a dict filled on exit from the block's last forward pass:
    ``{"encoder": [...], "decoder_self": [...], "cross": [...]}``, one (B, H, T_q, T_k)
    tensor per layer; rows are queries, columns are keys. ``only``: record just these
    layers (indices from 0) of these kinds, e.g. ``{"cross": [-1]}`` (the others keep the
    fused kernel and are left out of the dict's lists).
    """
    groups = {
        "encoder": [layer.self_attn for layer in model.encoder.layers],
        "decoder_self": [layer.self_attn for layer in model.decoder.layers],
        "cross": [layer.cross_attn for layer in model.decoder.layers],
    }
    if only is not None:
        groups = {kind: [groups[kind][i] for i in layers] for kind, layers in only.items()}
    maps: dict[str, list[Tensor]] = {name: [] for name in groups}
    for modules in groups.values():
        for m in modules:
            m.record_weights, m.last_weights = True, None
    try:
        yield maps
    finally:
        for name, modules in groups.items():
            for m in modules:
                if m.last_weights is not None:
                    maps[name].append(m.last_weights)
                m.record_weights, m.last_weights = False, None
