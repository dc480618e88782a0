"""Decoding: batched greedy search over the model's KV cache (beam search: see below).

Source ids are ``tokens + [EOS]``; a hypothesis starts with BOS and ends at EOS.
Decoding stops at ``max_len_a * S + max_len_b`` new tokens (the paper: input length + 50),
and never past the model's ``max_len`` positions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aiayn.model import Transformer
from aiayn.tokenizer import BOS_ID, EOS_ID


def output_limit(model: Transformer, src_pad: Tensor, max_len_b: int = 50) -> int:
    """Most new tokens to generate for this batch: longest source + max_len_b, within max_len."""
    src_len = int((~src_pad).sum(dim=1).max())
    return max(1, min(src_len + max_len_b, model.cfg.max_len - 1))


@torch.no_grad()
def greedy_decode(
    model: Transformer,
    src: Tensor,
    max_len_b: int = 50,
    use_cache: bool = True,
) -> list[list[int]]:
    """Batched greedy search. src: (B, S) padded ids. Returns token ids without BOS/EOS.

    With ``use_cache=False`` the whole prefix is re-run through the decoder at every step,
    as the tutorials do; it gives the same tokens and exists to measure the cache's gain.
    """
    src_pad = model.src_pad_mask(src)
    memory = model.encode(src, src_pad)
    B = src.size(0)
    limit = output_limit(model, src_pad, max_len_b)
    cache = model.new_cache() if use_cache else None
    tokens = torch.full((B, 1), BOS_ID, dtype=torch.long, device=src.device)
    finished = torch.zeros(B, dtype=torch.bool, device=src.device)
    for _ in range(limit):
        step_input = tokens[:, -1:] if use_cache else tokens
        hidden = model.decode(step_input, memory, src_pad, cache)
        logits = model.generator(hidden[:, -1])  # (B, V)
        next_token = logits.argmax(dim=-1)
        next_token = next_token.masked_fill(finished, EOS_ID)
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        finished |= next_token.eq(EOS_ID)
        if bool(finished.all()):
            break
    return [strip_special(row) for row in tokens[:, 1:].tolist()]


def strip_special(ids: list[int]) -> list[int]:
    """Cut a hypothesis at its first EOS."""
    return ids[: ids.index(EOS_ID)] if EOS_ID in ids else ids
