"""``torch.nn.Transformer`` holding aiayn's weights: the same function from PyTorch's layers.

aiayn writes every block itself (aiayn.model); PyTorch ships the same architecture as
``torch.nn.Transformer``. Given the same weights, the two must compute the same logits, and
this module is how that is checked, in one place for the three that check it: the model's
test (tests/model/test_model.py), the speed benchmark (benchmarks/speed.py, which also times
both) and the walk-through notebook (docs/walkthrough.ipynb).

    TorchReference         aiayn's embeddings and generator around an nn.Transformer
    copy_weights           aiayn's weights into a TorchReference, layer by layer
    max_logit_difference   the largest |logit difference| of the two, in eval mode

How the weights map: aiayn fuses the self-attention Q/K/V projections into one matrix as
``nn.MultiheadAttention`` does (``in_proj_weight``); cross-attention keeps Q apart from the
fused K/V (K and V come from the encoder memory), so the two are stacked. nn.Transformer
ends both stacks in a LayerNorm even in post-norm, where the paper (and aiayn) has none:
``TorchReference`` removes them there and copies aiayn's final norms in pre-norm.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.model import Generator, PositionalEncoding, TokenEmbedding, Transformer, dropout_rate

# What nn.Transformer says about itself when called as its documentation calls it (a float
# causal mask beside boolean padding masks; in eval mode, its nested-tensor fast path):
# nothing about the function it computes.
NN_TRANSFORMER_NOTES = (
    "Support for mismatched key_padding_mask and attn_mask is deprecated",
    "The PyTorch API of nested tensors is in prototype stage",
)


class TorchReference(nn.Module):
    """torch.nn.Transformer between aiayn's embeddings and generator, as a user builds it.

    With ``matched_dropout`` the attention-weight dropout and the dropout inside the
    feed-forward block, which nn.Transformer applies with the same p and the paper does
    not, follow aiayn's config instead (``attention_dropout``, none), so both models do the
    same work in training too; without it nn.Transformer keeps its own placement. (In eval
    mode there is no dropout, and the two compute one function either way.)
    """

    def __init__(self, cfg: ModelConfig, matched_dropout: bool = True):
        super().__init__()
        self.cfg = cfg
        self.src_embed = TokenEmbedding(cfg.src_vocab_size, cfg.d_model)
        self.tgt_embed = TokenEmbedding(cfg.tgt_vocab_size, cfg.d_model)
        self.src_pos = PositionalEncoding(cfg.d_model, cfg.max_len, dropout_rate(cfg))
        self.tgt_pos = PositionalEncoding(cfg.d_model, cfg.max_len, dropout_rate(cfg))
        self.transformer = nn.Transformer(
            d_model=cfg.d_model, nhead=cfg.n_heads, num_encoder_layers=cfg.n_encoder_layers,
            num_decoder_layers=cfg.n_decoder_layers, dim_feedforward=cfg.d_ff,
            dropout=dropout_rate(cfg), batch_first=True, norm_first=cfg.norm_first,
        )
        if not cfg.norm_first:
            self.transformer.encoder.norm = None
            self.transformer.decoder.norm = None
        if matched_dropout:
            for layer in self.transformer.encoder.layers:
                layer.self_attn.dropout = cfg.attention_dropout
                layer.dropout = nn.Identity()
            for layer in self.transformer.decoder.layers:
                layer.self_attn.dropout = cfg.attention_dropout
                layer.multihead_attn.dropout = cfg.attention_dropout
                layer.dropout = nn.Identity()
        self.generator = Generator(cfg.d_model, cfg.tgt_vocab_size)
        if cfg.tie_embeddings in ("decoder", "all"):
            self.generator.proj.weight = self.tgt_embed.embedding.weight
        if cfg.tie_embeddings == "all":
            self.src_embed.embedding.weight = self.tgt_embed.embedding.weight

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        """(B, S) source, (B, T) decoder input -> (B, T, V) logits, masks as the docs pass them."""
        src_pad = src.eq(self.cfg.pad_id)
        tgt_pad = tgt.eq(self.cfg.pad_id)
        tgt_mask = nn.Transformer.generate_square_subsequent_mask(tgt.size(1), device=tgt.device)
        hidden = self.transformer(
            self.src_pos(self.src_embed(src)), self.tgt_pos(self.tgt_embed(tgt)),
            tgt_mask=tgt_mask, src_key_padding_mask=src_pad,
            tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad,
        )
        return self.generator(hidden)


@torch.no_grad()
def copy_weights(ours: Transformer, ref: TorchReference) -> None:
    """Give ``ref`` the weights of ``ours``, so that both compute one function."""
    ref.src_embed.load_state_dict(ours.src_embed.state_dict())
    ref.tgt_embed.load_state_dict(ours.tgt_embed.state_dict())
    ref.generator.load_state_dict(ours.generator.state_dict())
    pairs = [(a, b, False) for a, b in zip(ours.encoder.layers, ref.transformer.encoder.layers,
                                          strict=True)]
    pairs += [(a, b, True) for a, b in zip(ours.decoder.layers, ref.transformer.decoder.layers,
                                          strict=True)]
    for a, b, is_decoder in pairs:
        b.self_attn.in_proj_weight.copy_(a.self_attn.qkv_proj.weight)
        b.self_attn.in_proj_bias.copy_(a.self_attn.qkv_proj.bias)
        b.self_attn.out_proj.load_state_dict(a.self_attn.out_proj.state_dict())
        b.linear1.load_state_dict(a.feed_forward.linear1.state_dict())
        b.linear2.load_state_dict(a.feed_forward.linear2.state_dict())
        b.norm1.load_state_dict(a.sublayer1.norm.state_dict())
        b.norm2.load_state_dict(a.sublayer2.norm.state_dict())
        if is_decoder:
            cross = a.cross_attn
            b.multihead_attn.in_proj_weight.copy_(
                torch.cat([cross.q_proj.weight, cross.kv_proj.weight]))
            b.multihead_attn.in_proj_bias.copy_(torch.cat([cross.q_proj.bias, cross.kv_proj.bias]))
            b.multihead_attn.out_proj.load_state_dict(cross.out_proj.state_dict())
            b.norm3.load_state_dict(a.sublayer3.norm.state_dict())
    if ours.cfg.norm_first:  # pre-norm: both stacks end in a LayerNorm
        ref.transformer.encoder.norm.load_state_dict(ours.encoder.norm.state_dict())
        ref.transformer.decoder.norm.load_state_dict(ours.decoder.norm.state_dict())


@torch.no_grad()
def max_logit_difference(ours: Transformer, ref: TorchReference, src: Tensor, tgt: Tensor
                         ) -> float:
    """Largest |logit difference| of the two on a (B, S) source and (B, T) decoder input, at
    the real (non-pad) target positions, both in eval mode (their modes are restored)."""
    was_training = ours.training, ref.training
    ours.eval(), ref.eval()
    try:
        real = tgt.ne(ours.cfg.pad_id)
        with warnings.catch_warnings():  # nn.Transformer's notes on its own internals
            for message in NN_TRANSFORMER_NOTES:
                warnings.filterwarnings("ignore", message=message, category=UserWarning)
            return float((ours(src, tgt)[real] - ref(src, tgt)[real]).abs().max())
    finally:
        ours.train(was_training[0]), ref.train(was_training[1])
