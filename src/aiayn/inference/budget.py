"""How much a decoding pass may hold: the decoding budget, ``decode_tokens``, in padded
source tokens x beam (`aiayn translate|evaluate|serve --decode-tokens`),
from the device's memory and the model's size, and how a budget is shared among parallel
CPU streams. (Not training's budget, train.max_tokens: tokens of a training batch.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aiayn.util.device import physical_memory


def decode_bytes_per_token(cfg) -> int:
    """Memory one padded source token of a decoding batch can hold, in fp32 bytes: the
    encoder output and every decoder layer's cross-attention keys and values ((1 + 2L) d),
    the self-attention cache of a translation up to twice the source's length (4 L d per
    source token) and one row of logits over the target vocabulary (V, for a 1-token
    source at worst)."""
    layers, d = cfg.n_decoder_layers, cfg.d_model
    return 4 * ((1 + 6 * layers) * d + cfg.tgt_vocab_size)


def memory_bytes(device: torch.device | None = None) -> int:
    """The memory a decoding pass on ``device`` can use: a GPU's free memory, else this
    machine's physical memory."""
    if device is not None and device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return physical_memory()


CPU_DECODE_TOKENS = 8192  # a CPU's default batch budget: larger batches decode no faster there


GPU_DECODE_TOKENS = 1 << 18  # a GPU's largest default: the 690 test verses x beam 4 in one batch


def default_decode_tokens(cfg, device: torch.device) -> int:
    """The batch budget ``decode_tokens=None`` means on ``device``.

    A CPU decodes no faster in larger batches than 8,192 padded source tokens x beam. A GPU
    launches the same kernels for a batch of 10 sentences as for 1,000, and a step of the
    demo's model is launch-bound far below that: its decoding speed grows with the batch
    until the memory runs out (docs/findings.md#decoding-on-a-gpu). So there the budget is
    what a quarter of the free GPU memory holds (``decode_bytes_per_token``), up to 2**18.
    """
    if device.type != "cuda":
        return CPU_DECODE_TOKENS
    fits = memory_bytes(device) // 4 // decode_bytes_per_token(cfg)
    return max(CPU_DECODE_TOKENS, min(GPU_DECODE_TOKENS, fits))


def stream_budget(widths: Sequence[int], decode_tokens: int, copies: int, streams: int) -> int:
    """The batch budget for decoding sentences of these widths on ``streams`` streams:
    ``decode_tokens``, or less when they would not fill a batch per stream, so that a few
    sentences (a short file, the requests a server gathered) are cut into about one batch
    per stream and decode on every core rather than on one."""
    if streams <= 1 or len(widths) < 2:
        return decode_tokens
    per_stream = -(-len(widths) // streams)
    return max(1, min(decode_tokens, max(widths) * per_stream * copies))
