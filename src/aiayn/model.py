"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), one block per class.

Reading order follows the paper (section numbers in brackets):

    TokenEmbedding        [3.4]  token ids -> vectors, scaled by sqrt(d_model)
    PositionalEncoding    [3.5]  + sinusoids, then dropout
    MultiHeadAttention    [3.2]  softmax(QK^T / sqrt(d_k)) V, h heads in parallel
    FeedForward           [3.3]  max(0, x W1 + b1) W2 + b2
    SublayerConnection    [5.4]  LayerNorm(x + Dropout(Sublayer(x)))  (or pre-norm)
    EncoderLayer, DecoderLayer, Encoder, Decoder   [3.1]
    Generator             [3.4]  hidden -> vocabulary logits
    Transformer                  encode / decode / generator / forward

Shapes: B batch, S source length, T target length, d d_model, H heads, d_k = d / H.
Masks are boolean; in attention, True means "this key may be attended to". Padding masks
passed by callers follow PyTorch's key_padding_mask convention: True marks a pad token.
Targets are right-padded, so the causal mask alone keeps real target positions from
seeing target padding.

Over 500 lines so that the whole model reads top to bottom in one file, every block of the
paper in its own class. This file depends on torch alone, as do the decoder's KV cache (``cache.py``) and the
label-smoothed loss (``loss.py``) beside it: ``cfg`` is any object with the fields of
``aiayn.config.ModelConfig``, and ``aiayn export --to hf`` ships the three beside the weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import KVCache, append_positions, fold_beams, unfold_beams
from .loss import label_smoothed_loss

# The output layer's product x W^T + b: F.linear, or another with the same values up to
# rounding that the caller chose for its machine (aiayn.inference.kernels) and passes in.
OutputKernel = Callable[[Tensor, Tensor, Tensor | None], Tensor]


class TokenEmbedding(nn.Module):
    """Learned embeddings multiplied by sqrt(d_model) (paper, 3.4)."""

    def __init__(self, vocab_size: int, d_model: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.scale = math.sqrt(d_model)

    def forward(self, ids: Tensor) -> Tensor:  # (B, L) -> (B, L, d)
        return self.embedding(ids) * self.scale


def sinusoid_table(max_len: int, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)),  PE(pos, 2i+1) = cos(pos / 10000^(2i/d))  (3.5)."""
    position = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)  # (L, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (d/2,)
    angle = position / torch.pow(10000.0, two_i / d_model)  # (L, d/2)
    table = torch.zeros(max_len, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    return table.float()


class PositionalEncoding(nn.Module):
    """Adds the fixed sinusoidal table to the embeddings, then dropout (3.5, 5.4)."""

    def __init__(self, d_model: int, max_len: int, dropout: float):
        super().__init__()
        self.max_len, self.dropout = max_len, nn.Dropout(dropout)
        # Not persistent: it is a formula, not a weight, so checkpoints stay free of it.
        self.register_buffer("table", sinusoid_table(max_len, d_model), persistent=False)

    def forward(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:  # (B, L, d) -> (B, L, d)
        """``offset``: the position of x's first column, or (B,) one per row (a cache's
        ``positions()``, which the searches' limits keep below max_len: a check would wait)."""
        if isinstance(offset, Tensor):
            positions = offset[:, None] + torch.arange(x.size(1), device=x.device)  # (B, L)
            return self.dropout(x + self.table[positions])
        end = offset + x.size(1)
        if end > self.max_len:
            raise ValueError(f"sequence of {end} positions is longer than model.max_len={self.max_len}")
        return self.dropout(x + self.table[offset:end])


class HeadNorm(nn.RMSNorm):
    """x / rms(x) * g over the last dim (QK-norm: a head's d_k, or a whole query's d_model), in fp32
    and back to x's dtype: under bf16 autocast RMSNorm's fused kernel needs input and gain of one dtype."""

    def __init__(self, features: int):
        super().__init__(features, eps=1e-5)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.float()).to(x.dtype)


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1..head_h) W^O,  head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V      (paper, eq. 1, section 3.2)

    Self-attention projects Q, K and V with one fused matrix; cross-attention projects Q
    from the decoder and K, V (fused) from the encoder memory. The fast path calls
    ``F.scaled_dot_product_attention``; ``need_weights=True`` computes the same thing
    explicitly and also returns the (B, H, T_q, T_k) attention weights.

    ``qk_norm`` (not in the paper; ModelConfig.qk_norm) RMS-normalises every head's query
    and key before the product, so no logit exceeds sqrt(d_k) times the learnt gains.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, cross: bool = False,
                 qk_norm: bool = False, whole_query: bool = False):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.d_model, self.n_heads, self.d_k = d_model, n_heads, d_model // n_heads
        self.cross, self.dropout = cross, dropout
        if cross:
            self.q_proj = nn.Linear(d_model, d_model)
            self.kv_proj = nn.Linear(d_model, 2 * d_model)
        else:
            self.qkv_proj = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        # QK-norm (ModelConfig.qk_norm): q_i / rms(q_i) * g, the same for k, per head. whole_query
        # (cross only; qk_norm_cross_query): q / rms(q) * g over all d_model at once, as CTranslate2.
        self.whole_query = whole_query and cross
        self.q_norm = HeadNorm(d_model if self.whole_query else self.d_k) if qk_norm else nn.Identity()
        self.k_norm = HeadNorm(self.d_k) if qk_norm else nn.Identity()
        self.record_weights = False  # set by capture_attention(): keep the last weights
        self.last_weights: Tensor | None = None

    def _heads(self, x: Tensor) -> Tensor:  # (B, L, d) -> (B, H, L, d_k)
        B, L, _ = x.shape
        return x.view(B, L, self.n_heads, self.d_k).transpose(1, 2)

    def forward(self, x: Tensor, memory: Tensor | None = None, mask: Tensor | None = None,
                is_causal: bool = False, cache: dict[str, Tensor] | None = None,
                need_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """x: (B, T_q, d) queries; memory: (B, S, d) for cross-attention.

        mask: bool, broadcastable to (B, H, T_q, T_k), True = may attend.
        is_causal: query i may attend to keys <= i (only without a cache prefix).
        cache: a dict this layer owns during incremental decoding. Self-attention appends
        the new K/V to it; cross-attention fills it once from ``memory`` and reuses it.
        """
        if self.cross:
            q = self.q_proj(x)
            q = self._heads(self.q_norm(q)) if self.whole_query else self.q_norm(self._heads(q))
            if cache is not None and "k" in cache:
                k, v = cache["k"], cache["v"]  # memory's K/V, computed at the first step
            elif memory is None:
                raise ValueError("cross-attention needs the encoder memory")
            else:
                k, v = self.memory_kv(memory)
                if cache is not None:
                    cache["k"], cache["v"] = k, v
        else:
            q, k, v = self.self_qkv(x)
            if cache is not None:  # K/V of earlier positions, grown one step at a time
                k, v = append_positions(cache, k, v)

        out, weights = self.attend(q, k, v, mask, is_causal, need_weights or self.record_weights)
        if self.record_weights:
            self.last_weights = weights.detach()
        return (self.concat(out), weights) if need_weights else self.concat(out)

    def self_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Self-attention's Q, K, V of x, (B, H, T, d_k) each, Q and K normed (a cache keeps K so)."""
        q, k, v = (self._heads(t) for t in self.qkv_proj(x).chunk(3, dim=-1))
        return self.q_norm(q), self.k_norm(k), v

    def concat(self, heads: Tensor) -> Tensor:
        """Concat(head_1..head_h) W^O: (B, H, T, d_k) -> (B, T, d)."""
        B, _, T, _ = heads.shape
        return self.out_proj(heads.transpose(1, 2).reshape(B, T, self.d_model))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
               need_weights: bool) -> tuple[Tensor, Tensor | None]:
        """Attention(Q, K, V): (B, H, T_q, d_k) queries, (B', H, T_k, d_k) keys and values (B' = B /
        g where g beams share a memory: cache.py) -> (B, H, T_q, d_k), weights or None."""
        p, rows = self.dropout if self.training else 0.0, q.size(0)
        if rows != k.size(0):
            q = fold_beams(q, k.size(0))
        if need_weights or explicit_is_faster(q, k):
            out, weights = explicit_attention(q, k, v, mask, is_causal, p)
        else:
            out, weights = F.scaled_dot_product_attention(q, k, v, mask, p, is_causal), None
        if rows != out.size(0):
            out = unfold_beams(out, rows)
            weights = None if weights is None else unfold_beams(weights, rows)
        return out, weights

    def memory_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Cross-attention's K and V of the encoder memory, (B, H, S, d_k) each."""
        k, v = (self._heads(t) for t in self.kv_proj(memory).chunk(2, dim=-1))
        return self.k_norm(k), v


def explicit_is_faster(q: Tensor, k: Tensor) -> bool:
    """Training under bf16 autocast on a CPU, SDPA's fused backward is slower than the
    explicit product: 1.29x faster steps for small (docs/findings.md#bf16-on-a-cpu). It keeps
    (B, H, T, T) weights for backward, hence the limit of 256 keys."""
    return q.is_cpu and q.dtype == torch.bfloat16 and torch.is_grad_enabled() and k.size(-2) <= 256


def explicit_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, dropout_p: float
) -> tuple[Tensor, Tensor]:
    """softmax(Q K^T / sqrt(d_k)) V written out, returning the weights too (eq. 1)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, H, T_q, T_k)
    if is_causal:
        mask = causal_mask(q.size(-2), k.size(-2), q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    weights = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    return weights @ v, weights


def causal_mask(n_queries: int, n_keys: int, device: torch.device | None = None) -> Tensor:
    """(T_q, T_k) bool; query i (the last n_queries of n_keys positions) sees keys <= its position."""
    offset = n_keys - n_queries
    return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril(diagonal=offset)


def padding_mask(pad: Tensor) -> Tensor:
    """(B, S) True-at-pad -> (B, 1, 1, S) True-may-attend, broadcast over heads and queries."""
    return ~pad[:, None, None, :]


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2, applied at each position alike (3.3)."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff)
        self.linear2 = nn.Linear(d_ff, d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear2(F.relu(self.linear1(x)))


def dropout_rate(cfg) -> float:
    """``cfg.dropout``; "auto" is 0 until a trainer chooses (``Transformer.set_dropout``)."""
    return 0.0 if isinstance(cfg.dropout, str) else float(cfg.dropout)


class SublayerConnection(nn.Module):
    """Residual connection with layer normalisation and dropout (3.1, 5.4).

    post-norm (paper):  LayerNorm(x + Dropout(Sublayer(x)))
    pre-norm (option):  x + Dropout(Sublayer(LayerNorm(x)))
    """

    def __init__(self, d_model: int, dropout: float, norm_first: bool):
        super().__init__()
        self.norm, self.dropout, self.norm_first = nn.LayerNorm(d_model), nn.Dropout(dropout), norm_first

    def forward(self, x: Tensor, sublayer) -> Tensor:
        if self.norm_first:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class EncoderLayer(nn.Module):
    """Self-attention, then feed-forward, each wrapped in a SublayerConnection (3.1)."""

    def __init__(self, cfg):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout,
                                            qk_norm=cfg.qk_norm)
        self.feed_forward = FeedForward(cfg.d_model, cfg.d_ff)
        self.sublayer1, self.sublayer2 = (
            SublayerConnection(cfg.d_model, dropout_rate(cfg), cfg.norm_first) for _ in range(2))

    def forward(self, x: Tensor, src_mask: Tensor | None) -> Tensor:
        x = self.sublayer1(x, lambda h: self.self_attn(h, mask=src_mask))
        return self.sublayer2(x, self.feed_forward)


class DecoderLayer(nn.Module):
    """Masked self-attention, encoder-decoder attention, feed-forward (3.1)."""

    def __init__(self, cfg):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout,
                                            qk_norm=cfg.qk_norm)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout,
                                             cross=True, qk_norm=cfg.qk_norm and cfg.qk_norm_cross,
                                             whole_query=cfg.qk_norm_cross_query == "whole")
        self.feed_forward = FeedForward(cfg.d_model, cfg.d_ff)
        self.sublayer1, self.sublayer2, self.sublayer3 = (
            SublayerConnection(cfg.d_model, dropout_rate(cfg), cfg.norm_first) for _ in range(3))

    def forward(self, x: Tensor, memory: Tensor, src_mask: Tensor | None, self_mask: Tensor | None,
                is_causal: bool, cache: dict[str, dict[str, Tensor]] | None = None) -> Tensor:
        self_cache, cross_cache = (None, None) if cache is None else (cache["self"], cache["cross"])
        x = self.sublayer1(x, lambda h: self.self_attn(h, mask=self_mask, is_causal=is_causal,
                                                       cache=self_cache))
        x = self.sublayer2(x, lambda h: self.cross_attn(h, memory, mask=src_mask, cache=cross_cache))
        return self.sublayer3(x, self.feed_forward)


class Encoder(nn.Module):
    """N identical layers; pre-norm adds a final LayerNorm (post-norm already ends in one)."""

    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers))
        self.norm = nn.LayerNorm(cfg.d_model) if cfg.norm_first else nn.Identity()

    def forward(self, x: Tensor, src_mask: Tensor | None) -> Tensor:
        for layer in self.layers:
            x = layer(x, src_mask)
        return self.norm(x)


class Decoder(nn.Module):
    """N identical layers over the target prefix and the encoder memory."""

    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_decoder_layers))
        self.norm = nn.LayerNorm(cfg.d_model) if cfg.norm_first else nn.Identity()

    def forward(self, x: Tensor, memory: Tensor, src_mask: Tensor | None,
                cache: KVCache | None = None) -> Tensor:
        T = x.size(1)
        past = cache.length if cache is not None else 0
        if cache is not None and (cache.start is not None or (past and T > 1)):
            self_mask, is_causal = cache.self_mask(T, x.device), False  # after a cached prefix
        else:  # no prefix: the fused causal kernel; one new query sees every cached key
            self_mask, is_causal = None, T > 1
        for i, layer in enumerate(self.layers):
            layer_cache = cache.layers[i] if cache is not None else None
            x = layer(x, memory, src_mask, self_mask, is_causal, layer_cache)
        if cache is not None:
            cache.length = past + T
        return self.norm(x)


class Generator(nn.Module):
    """Linear projection of the decoder output to vocabulary logits (3.4).

    With ``restricted`` (ModelConfig.output_vocab: "targets") it scores only the pieces of
    ``output_mask`` (``set_outputs``: the training targets', saved with the weights); the
    others get logit -inf. ``forward`` returns logits over the whole vocabulary (as exports
    and `aiayn trace` see them); the loss and the searches take the cheaper
    ``output_logits`` (column j is piece ``output_ids[j]``; labels by ``output_positions``).
    """

    IGNORE = -100  # output_positions of padding, and of labels the model cannot output

    def __init__(self, d_model: int, vocab_size: int, restricted: bool = False):
        super().__init__()
        self.proj = nn.Linear(d_model, vocab_size, bias=False)
        self.restricted = restricted
        self.register_buffer("output_mask", torch.ones(vocab_size, dtype=torch.bool),
                             persistent=restricted)
        # Derived from output_mask (after set_outputs and after loading weights): the ids
        # of the allowed pieces, and each id's position among them (IGNORE if not allowed).
        self.register_buffer("output_ids", torch.arange(vocab_size), persistent=False)
        self.register_buffer("positions", torch.arange(vocab_size), persistent=False)
        self.register_load_state_dict_post_hook(lambda module, _: module._index())

    def set_outputs(self, ids: Tensor) -> None:
        """Allow exactly the pieces ``ids`` (a restricted generator only)."""
        if not self.restricted:
            raise ValueError("set_outputs needs a generator built with restricted=True")
        self.output_mask.zero_()
        self.output_mask[ids] = True
        self._index()

    def _index(self) -> None:
        self.output_ids = self.output_mask.nonzero().squeeze(1)
        positions = torch.full_like(self.positions, self.IGNORE)
        positions[self.output_ids] = torch.arange(len(self.output_ids), device=positions.device)
        self.positions = positions

    def forward(self, hidden: Tensor) -> Tensor:  # (B, T, d) -> (B, T, V)
        logits = self.output_logits(hidden)
        if not self.restricted:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.proj.out_features), float("-inf"))
        return full.index_copy_(-1, self.output_ids, logits)

    def output_logits(self, hidden: Tensor, rows: tuple[Tensor, Tensor | None] | None = None,
                      kernel: OutputKernel | None = None) -> Tensor:
        """(B, T, d) -> (B, T, V_out): the allowed pieces' logits, in ``output_ids``' order.
        ``rows``: ``allowed_rows()`` kept by a caller with unchanged weights (a search's
        steps); None selects them now. ``kernel``: an ``OutputKernel``; None: ``F.linear``."""
        kernel = kernel or F.linear
        if rows is None and not self.restricted and kernel is F.linear:
            return self.proj(hidden)  # the module itself, so that hooks (aiayn trace) see it
        weight, bias = self.allowed_rows() if rows is None else rows
        return kernel(hidden, weight, bias)

    def allowed_rows(self, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor | None]:
        """The weight (and bias) rows of the allowed pieces as they are now, cast to
        ``dtype`` if given: a search selects them once for all its steps; the model keeps no
        copy, which an in-place optimizer step (fused Adam) would leave stale."""
        weight, bias = self.proj.weight, self.proj.bias
        if self.restricted:
            weight = weight.index_select(0, self.output_ids)
            bias = None if bias is None else bias.index_select(0, self.output_ids)
        if dtype is None:
            return weight, bias
        return weight.to(dtype), None if bias is None else bias.to(dtype)

    def output_positions(self, labels: Tensor, pad_id: int) -> Tensor:
        """Token ids -> their positions in ``output_logits``; padding and pieces the model
        cannot output -> IGNORE (the loss leaves them out)."""
        if not self.restricted:
            return labels.masked_fill(labels.eq(pad_id), self.IGNORE)
        return self.positions[labels].masked_fill(labels.eq(pad_id), self.IGNORE)


class Transformer(nn.Module):
    """Encoder-decoder Transformer (Figure 1 of the paper)."""

    indirect_cache = False  # KVCache(indirect=...) of new_cache

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.src_embed = TokenEmbedding(cfg.src_vocab_size, cfg.d_model)
        self.tgt_embed = TokenEmbedding(cfg.tgt_vocab_size, cfg.d_model)
        self.src_pos = PositionalEncoding(cfg.d_model, cfg.max_len, dropout_rate(cfg))
        self.tgt_pos = PositionalEncoding(cfg.d_model, cfg.max_len, dropout_rate(cfg))
        self.encoder, self.decoder = Encoder(cfg), Decoder(cfg)
        self.generator = Generator(cfg.d_model, cfg.tgt_vocab_size, restricted=cfg.output_vocab == "targets")
        self.reset_parameters()
        self.tie_weights()

    def reset_parameters(self) -> None:
        """Token embeddings ~ N(0, d_model^-0.5) as tensor2tensor draws them (after the
        sqrt(d_model) scale of 3.4 a token's vector has unit variance, like the sinusoids
        added to it), Xavier-uniform for every other matrix, zeros for biases; LayerNorm
        stays (1, 0). The tutorials' Xavier embeddings (``model.embedding_init: xavier``) are
        4x smaller than the positions and learn far less: docs/findings.md#initialisation."""
        for name, p in self.named_parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        if self.cfg.embedding_init == "normal":
            for embed in (self.src_embed, self.tgt_embed):
                nn.init.normal_(embed.embedding.weight, mean=0.0, std=self.cfg.d_model**-0.5)

    def set_dropout(self, p: float) -> None:
        """P_drop of the embedding sums and sub-layer outputs (5.4): "auto"'s, once chosen."""
        for dropout in [m for m in self.modules() if isinstance(m, nn.Dropout)]:
            dropout.p = p  # attention's is a float of its own (model.attention_dropout)

    def tie_weights(self) -> None:
        """Share the embedding matrices with the pre-softmax projection (3.4)."""
        if self.cfg.tie_embeddings in ("decoder", "all"):
            self.generator.proj.weight = self.tgt_embed.embedding.weight
        if self.cfg.tie_embeddings == "all":
            self.src_embed.embedding.weight = self.tgt_embed.embedding.weight

    def _check_ids(self, ids: Tensor, name: str) -> None:
        if ids.dim() != 2 or ids.dtype not in (torch.long, torch.int32, torch.int64):
            raise ValueError(f"{name} must be a (batch, length) integer tensor, got "
                             f"{tuple(ids.shape)} {ids.dtype}")

    def src_pad_mask(self, src: Tensor) -> Tensor:
        return src.eq(self.cfg.pad_id)

    def encode(self, src: Tensor, src_pad: Tensor | None = None) -> Tensor:
        """(B, S) source ids -> (B, S, d) memory. src_pad: (B, S), True at padding."""
        self._check_ids(src, "src")
        if src_pad is None:
            src_pad = self.src_pad_mask(src)
        x = self.src_pos(self.src_embed(src))
        return self.encoder(x, padding_mask(src_pad))

    def decode(self, tgt: Tensor, memory: Tensor, src_pad: Tensor,
               cache: KVCache | None = None) -> Tensor:
        """(B, T) target ids (only the new ones when a cache holds the prefix) -> (B, T, d).
        memory (B', S, d), src_pad (B', S): B' = B, or B / beam for a beam's sentence-major rows."""
        self._check_ids(tgt, "tgt")
        offset = cache.positions() if cache is not None else 0
        x = self.tgt_pos(self.tgt_embed(tgt), offset=offset)
        return self.decoder(x, memory, padding_mask(src_pad), cache)

    def encoded_cache(self, src: Tensor, src_pad: Tensor | None = None) -> KVCache:
        """``new_cache(encode(src, src_pad))``: a cache whose cross-attention K/V are those of
        ``src``'s memory (sentences joining a running search), the memory not kept."""
        return self.new_cache(self.encode(src, src_pad))

    def new_cache(self, memory: Tensor | None = None) -> KVCache:
        """An empty decoding cache (``indirect_cache``: aiayn.inference.int8's decoder reads one); with
        ``memory`` its cross-attention K/V computed now, not at the first step (to ``join`` one)."""
        cache = KVCache(len(self.decoder.layers), indirect=self.indirect_cache, positions=self.cfg.max_len)
        if memory is not None:
            for layer, layer_cache in zip(self.decoder.layers, cache.layers, strict=True):
                k, v = layer.cross_attn.memory_kv(memory)
                layer_cache["cross"].update(k=k, v=v)
        return cache

    def forward(self, src: Tensor, tgt: Tensor, targets: Tensor | None = None,
                label_smoothing: float = 0.0, kernel: OutputKernel | None = None) -> Tensor:
        """Teacher forcing: (B, S) source, (B, T) decoder input -> (B, T, V) logits.

        With ``targets`` ((B, T) ids, the decoder input shifted by one): the summed
        label-smoothed cross-entropy over the real target tokens instead (paper, 5.4; the
        caller divides by their count), from ``Generator.output_logits`` with ``kernel``.
        """
        src_pad = self.src_pad_mask(src)
        memory = self.encode(src, src_pad)
        hidden = self.decode(tgt, memory, src_pad)
        if targets is None:
            return self.generator(hidden)
        return label_smoothed_loss(self.generator.output_logits(hidden, kernel=kernel),
                                   self.generator.output_positions(targets, self.cfg.pad_id),
                                   label_smoothing, Generator.IGNORE)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
