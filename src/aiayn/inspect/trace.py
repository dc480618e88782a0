"""A forward-pass walk-through: every module, in the order it runs, with its output shape.

``aiayn trace`` prints this table for one batch so a learner can follow a sentence from
token ids through embeddings, each layer's sub-layers, to the vocabulary logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from aiayn.config import Config
from aiayn.data.prepared import sample_batch
from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from aiayn.model import Transformer


@dataclass
class TraceRow:
    name: str  # qualified module name, e.g. "encoder.layers.0.sublayer1"
    kind: str  # class name
    depth: int  # how deeply nested the call is (callers enclose callees)
    shape: tuple[int, ...] | None  # output shape (first tensor of the output)
    params: int  # parameters owned by the module and its children (shared ones counted once)


def _first_tensor(output) -> Tensor | None:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    return None


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@torch.no_grad()
def trace_forward(model: Transformer, src: Tensor, tgt: Tensor) -> list[TraceRow]:
    """Run ``model(src, tgt)`` once in eval mode and record each module call in order."""
    rows: list[TraceRow] = []
    stack: list[TraceRow] = []  # calls still running: the depth of the next one
    handles = []

    def pre_hook(name: str):
        def hook(mod, args):
            row = TraceRow(name, type(mod).__name__, len(stack), None, _param_count(mod))
            rows.append(row)
            stack.append(row)
        return hook

    def post_hook(mod, args, output):
        row = stack.pop()
        tensor = _first_tensor(output)
        row.shape = tuple(tensor.shape) if tensor is not None else None

    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Identity, nn.Dropout)):
            continue
        handles.append(module.register_forward_pre_hook(pre_hook(name)))
        handles.append(module.register_forward_hook(post_hook))
    was_training = model.training
    model.eval()
    try:
        model(src, tgt)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    rows[0].name = "Transformer"
    return rows


def format_trace(rows: list[TraceRow], src: Tensor, tgt: Tensor, max_depth: int = 99) -> str:
    """The trace as an aligned text table (indentation shows nesting)."""
    lines = [
        f"input  src ids {tuple(src.shape)}  (batch, source length)",
        f"input  tgt ids {tuple(tgt.shape)}  (batch, target length)",
        "",
    ]
    labels = []
    for row in rows:
        if row.depth > max_depth:
            continue
        parts = row.name.split(".")
        # "encoder.layers.0" reads better as "layers.0" than as "0"
        short = ".".join(parts[-2:]) if parts[-1].isdigit() else parts[-1]
        label = f"{'  ' * row.depth}{short} ({row.kind})"
        shape = "x".join(str(s) for s in row.shape) if row.shape else "-"
        labels.append((label, shape, f"{row.params:,}"))
    w1 = max(len(a) for a, _, _ in labels)
    w2 = max(len(b) for _, b, _ in labels)
    w3 = max(len(c) for _, _, c in labels)
    lines.append(f"{'module':<{w1}}  {'output':>{w2}}  {'params':>{w3}}")
    lines.append("-" * (w1 + w2 + w3 + 4))
    lines += [f"{a:<{w1}}  {b:>{w2}}  {c:>{w3}}" for a, b, c in labels]
    return "\n".join(lines)


def trace_batch(config: Config, data_dir: str | Path | None = None, batch_size: int = 2
                ) -> tuple[Tensor, Tensor]:
    """(src, decoder input) to trace: the first dev sentences of ``data_dir``, else random
    ids of decreasing lengths (so some padding shows), drawn from torch's global RNG."""
    if data_dir:
        batch = sample_batch(data_dir, config, batch_size)
        return batch.src, batch.tgt_in
    m = config.model
    B = max(1, batch_size)
    src_lens = [max(2, min(m.max_len, 12 - 3 * i)) for i in range(B)]
    tgt_lens = [max(2, min(m.max_len, 10 - 2 * i)) for i in range(B)]
    src = torch.full((B, max(src_lens)), PAD_ID)
    tgt = torch.full((B, max(tgt_lens)), PAD_ID)
    for i in range(B):
        src[i, : src_lens[i]] = torch.randint(4, m.src_vocab_size, (src_lens[i],))
        src[i, src_lens[i] - 1] = EOS_ID
        tgt[i, : tgt_lens[i]] = torch.randint(4, m.tgt_vocab_size, (tgt_lens[i],))
        tgt[i, 0] = BOS_ID
    return src, tgt
