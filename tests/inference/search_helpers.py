"""Small models and sources for the search tests (test_search.py, test_steps.py)."""

from __future__ import annotations

import torch
from torch import nn

from aiayn.config import ModelConfig
from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from aiayn.inference.steps import NEVER_GENERATED
from aiayn.model import Transformer


def tiny_model(vocab: int = 24, eos_bias: float = 4.0, sharpness: float = 3.0,
               max_len: int = 32, seed: int = 0) -> Transformer:
    """A random model in eval mode whose generator is sharpened and biased towards EOS, so
    that sentences end at different lengths and the searches have real choices to make."""
    torch.manual_seed(seed)
    cfg = ModelConfig(src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=16, n_heads=2,
                      d_ff=32, n_encoder_layers=2, n_decoder_layers=2, dropout=0.0,
                      max_len=max_len, tie_embeddings="none",
                      embedding_init="xavier")  # the draws these tests were tuned on
    model = Transformer(cfg).eval()
    proj = nn.Linear(cfg.d_model, vocab, bias=True)
    with torch.no_grad():
        proj.weight.copy_(model.generator.proj.weight * sharpness)
        proj.bias.zero_()
        proj.bias[EOS_ID] = eos_bias
    model.generator.proj = proj
    return model


def random_sources(lengths: list[int], vocab: int, seed: int = 1) -> torch.Tensor:
    """Right-padded (B, S) source ids: random tokens, then EOS."""
    g = torch.Generator().manual_seed(seed)
    src = torch.full((len(lengths), max(lengths)), PAD_ID)
    for i, n in enumerate(lengths):
        src[i, : n - 1] = torch.randint(4, vocab, (n - 1,), generator=g)
        src[i, n - 1] = EOS_ID
    return src


def sequence_log_probs(model: Transformer, src: torch.Tensor, hyps: list[list[int]],
                       ended: list[bool]) -> torch.Tensor:
    """log P(hyp | src) by one teacher-forced forward pass (no cache), with PAD and BOS
    excluded from the distribution as the searches do; ``ended`` adds the final EOS."""
    targets = [h + [EOS_ID] if e else h for h, e in zip(hyps, ended)]
    T = max(len(t) for t in targets)
    tgt_in = torch.full((len(targets), T), PAD_ID)
    for i, t in enumerate(targets):
        tgt_in[i, : len(t)] = torch.tensor([BOS_ID] + t[:-1])
    with torch.no_grad():
        logits = model(src.expand(len(targets), -1), tgt_in).float()
    logits[..., list(NEVER_GENERATED)] = float("-inf")
    log_probs = torch.log_softmax(logits, dim=-1)
    totals = []
    for i, t in enumerate(targets):
        steps = log_probs[i, torch.arange(len(t)), torch.tensor(t)]
        totals.append(steps.sum())
    return torch.stack(totals)
