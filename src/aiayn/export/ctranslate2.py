"""`aiayn export --to ctranslate2`: a CTranslate2 TransformerSpec from aiayn's weights (see
``aiayn.export.base`` for what is mapped and why), written by CTranslate2's own converter.
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from aiayn.data.tokenizer import BOS, EOS, UNK, Tokenizers
from aiayn.export.base import CT2_POSITIONS, output_bias
from aiayn.model import Transformer, sinusoid_table
from aiayn.util.extras import require


# ---------------------------------------------------------------- CTranslate2
def ctranslate2_spec(model: Transformer, tokenizers: Tokenizers):
    """A CTranslate2 TransformerSpec holding the model's weights (post- or pre-norm)."""
    require("ctranslate2", "--to ctranslate2")
    from ctranslate2.specs import common_spec, transformer_spec

    cfg = model.cfg
    shape = dict(pre_norm=cfg.norm_first, activation=common_spec.Activation.RELU,
                 qk_norm=cfg.qk_norm)
    spec = transformer_spec.TransformerSpec(
        transformer_spec.TransformerEncoderSpec(cfg.n_encoder_layers, cfg.n_heads, **shape),
        transformer_spec.TransformerDecoderSpec(cfg.n_decoder_layers, cfg.n_heads, **shape))

    def array(t: Tensor):
        return t.detach().float().cpu().numpy()

    def linear(spec_, module) -> None:
        spec_.weight = array(module.weight)
        if module.bias is not None:
            spec_.bias = array(module.bias)

    def norm(spec_, ln) -> None:
        spec_.gamma, spec_.beta = array(ln.weight), array(ln.bias)

    def qk_norms(attention_spec, attention) -> None:
        """QK-norm: RMS with a learnt gain, as aiayn's HeadNorm. CTranslate2 normalises keys
        per head (a d_k gain), and queries per head in self-attention but over all of d_model
        in encoder-decoder attention: aiayn's qk_norm_cross_query "whole", whose gain is d_model
        long (check_target_can_express refuses "heads" there)."""
        attention_spec.q_norm.gamma = array(attention.q_norm.weight)
        attention_spec.k_norm.gamma = array(attention.k_norm.weight)

    # CTranslate2 takes the positional table itself: aiayn's interleaved one, unpermuted.
    # Its translate_batch reads up to 1024 source and 256 target positions by default; the
    # sinusoids are defined at any position (3.5), so the table covers those too and a
    # plain call does not fail on a long input. aiayn's engine keeps to max_len.
    table = array(sinusoid_table(max(cfg.max_len, CT2_POSITIONS), cfg.d_model))
    encoder, decoder = spec.encoder, spec.decoder
    encoder.embeddings[0].weight = array(model.src_embed.embedding.weight)
    decoder.embeddings.weight = array(model.tgt_embed.embedding.weight)
    encoder.scale_embeddings = decoder.scale_embeddings = True  # x sqrt(d_model)  (3.4)
    encoder.position_encodings.encodings = table
    decoder.position_encodings.encodings = table
    for layer_spec, layer in zip(encoder.layer, model.encoder.layers, strict=True):
        linear(layer_spec.self_attention.linear[0], layer.self_attn.qkv_proj)  # fused [Q; K; V]
        linear(layer_spec.self_attention.linear[1], layer.self_attn.out_proj)
        norm(layer_spec.self_attention.layer_norm, layer.sublayer1.norm)
        if cfg.qk_norm:
            qk_norms(layer_spec.self_attention, layer.self_attn)
        linear(layer_spec.ffn.linear_0, layer.feed_forward.linear1)
        linear(layer_spec.ffn.linear_1, layer.feed_forward.linear2)
        norm(layer_spec.ffn.layer_norm, layer.sublayer2.norm)
    for layer_spec, layer in zip(decoder.layer, model.decoder.layers, strict=True):
        linear(layer_spec.self_attention.linear[0], layer.self_attn.qkv_proj)
        linear(layer_spec.self_attention.linear[1], layer.self_attn.out_proj)
        norm(layer_spec.self_attention.layer_norm, layer.sublayer1.norm)
        if cfg.qk_norm:
            qk_norms(layer_spec.self_attention, layer.self_attn)
        if cfg.qk_norm and cfg.qk_norm_cross:
            qk_norms(layer_spec.attention, layer.cross_attn)
        elif cfg.qk_norm:  # QK-norm in self-attention only
            del layer_spec.attention.q_norm, layer_spec.attention.k_norm
        linear(layer_spec.attention.linear[0], layer.cross_attn.q_proj)
        linear(layer_spec.attention.linear[1], layer.cross_attn.kv_proj)  # fused [K; V]
        linear(layer_spec.attention.linear[2], layer.cross_attn.out_proj)
        norm(layer_spec.attention.layer_norm, layer.sublayer2.norm)
        linear(layer_spec.ffn.linear_0, layer.feed_forward.linear1)
        linear(layer_spec.ffn.linear_1, layer.feed_forward.linear2)
        norm(layer_spec.ffn.layer_norm, layer.sublayer3.norm)
    if cfg.norm_first:  # pre-norm ends each stack with a LayerNorm
        norm(encoder.layer_norm, model.encoder.norm)
        norm(decoder.layer_norm, model.decoder.norm)
    decoder.projection.weight = array(model.generator.proj.weight)
    bias = output_bias(model)
    if bias is not None:  # the paper's layer has none (3.4); a restricted one excludes pieces
        decoder.projection.bias = array(bias)

    spec.config.unk_token, spec.config.bos_token, spec.config.eos_token = UNK, BOS, EOS
    spec.config.decoder_start_token = BOS
    spec.config.add_source_eos = True  # source ids are tokens + [EOS]
    spec.config.layer_norm_epsilon = 1e-5  # nn.LayerNorm's
    spec.register_source_vocabulary(vocabulary(tokenizers.src))
    spec.register_target_vocabulary(vocabulary(tokenizers.tgt))
    return spec


def vocabulary(tok) -> list[str]:
    """Token strings in id order."""
    return [tok.id_to_token(i) for i in range(tok.get_vocab_size())]


def write_ctranslate2(model: Transformer, tokenizers: Tokenizers, out: Path,
                      quantization: str | None) -> None:
    """model.bin, config.json and the vocabularies, through CTranslate2's own Converter."""
    ctranslate2 = require("ctranslate2", "--to ctranslate2")

    class AiaynConverter(ctranslate2.converters.Converter):
        def _load(self):
            return ctranslate2_spec(model, tokenizers)

    # Converter.convert validates the spec, quantizes, and writes; out exists (empty).
    AiaynConverter().convert(str(out), quantization=quantization, force=True)
