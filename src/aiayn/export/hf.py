"""`aiayn export --to hf`: a MarianMTModel directory, or aiayn's own model code beside its
weights where Marian cannot express the model (pre-norm, QK-norm); see ``aiayn.export.base``
for the mapping.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor

from aiayn.config import DecodeConfig, ModelConfig
from aiayn.data.tokenizer import BOS, BOS_ID, EOS, EOS_ID, PAD, PAD_ID, UNK, Tokenizers
from aiayn.errors import AiaynError
from aiayn.export.base import check_target_can_express, output_bias
from aiayn.model import Transformer, dropout_rate
from aiayn.util.extras import require
from aiayn.util.io import atomic_write_text


def check_one_vocabulary(tokenizers: Tokenizers, where: str) -> None:
    """A Transformers tokenizer holds one vocabulary: the run's must be joint."""
    if not tokenizers.joint:
        raise AiaynError(f"{where}: --to hf needs a joint vocabulary (data.joint_vocab: true): "
                         "a Transformers tokenizer holds one; --to ctranslate2 takes two")


def residual_permutation(d_model: int) -> Tensor:
    """perm[k] = the aiayn feature that is Marian's feature k: the sines [0, 2, 4, ...],
    then the cosines [1, 3, 5, ...] (see the module docstring)."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def marian_config(cfg: ModelConfig) -> dict:
    """MarianConfig fields for an aiayn post-norm model."""
    shared = cfg.tie_embeddings == "all"
    return {
        "architectures": ["MarianMTModel"],
        "vocab_size": cfg.src_vocab_size,
        "decoder_vocab_size": cfg.tgt_vocab_size,
        "share_encoder_decoder_embeddings": shared,
        "tie_word_embeddings": cfg.tie_embeddings in ("decoder", "all"),
        "d_model": cfg.d_model,
        "encoder_layers": cfg.n_encoder_layers,
        "decoder_layers": cfg.n_decoder_layers,
        "encoder_attention_heads": cfg.n_heads,
        "decoder_attention_heads": cfg.n_heads,
        "encoder_ffn_dim": cfg.d_ff,
        "decoder_ffn_dim": cfg.d_ff,
        "activation_function": "relu",  # FFN(x) = max(0, x W1 + b1) W2 + b2  (3.3)
        "scale_embedding": True,  # embeddings * sqrt(d_model)  (3.4)
        "max_position_embeddings": cfg.max_len,
        "dropout": dropout_rate(cfg),
        "attention_dropout": cfg.attention_dropout,
        "activation_dropout": 0.0,
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "decoder_start_token_id": BOS_ID,  # aiayn's decoder input starts with [BOS]
        "forced_eos_token_id": None,  # aiayn ends a hypothesis at the length limit as it is
    }


def generation_config(cfg: ModelConfig, decode: DecodeConfig | None = None) -> dict:
    """Generation defaults that decode as aiayn does (bar the length-penalty formula), with
    the run's search (its config's decode section; default the paper's beam 4, alpha 0.6)."""
    decode = decode or DecodeConfig()
    return {
        "decoder_start_token_id": BOS_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "forced_eos_token_id": None,
        "num_beams": decode.beam,
        # alpha, in Transformers' length**alpha form, and a sentence done with `beam`
        # finished hypotheses: beam settings, which Transformers refuses for greedy search
        **({"length_penalty": decode.alpha, "early_stopping": True} if decode.beam > 1 else {}),
        # the repetition guard: Transformers' own no_repeat_ngram_size
        **({"no_repeat_ngram_size": decode.no_repeat_ngram} if decode.no_repeat_ngram else {}),
        "max_length": cfg.max_len,  # [BOS] + tokens fits the model's positions
        # [PAD] and [BOS] are never generated, and the rest renormalized as aiayn does.
        "suppress_tokens": [PAD_ID, BOS_ID],
        "renormalize_logits": True,
    }


def marian_state_dict(model: Transformer) -> dict[str, Tensor]:
    """aiayn's weights under MarianMTModel's names, the residual axis permuted."""
    cfg = model.cfg
    perm = residual_permutation(cfg.d_model)

    def reads(w: Tensor) -> Tensor:  # (out, d) reads the stream: permute its input columns
        return w[:, perm]

    def writes(w: Tensor) -> Tensor:  # (d, in) or (d,) writes the stream: permute its rows
        return w[perm]

    out: dict[str, Tensor] = {}

    def attention(prefix: str, attn, cross: bool) -> None:
        if cross:
            q_w, q_b = attn.q_proj.weight, attn.q_proj.bias
            (k_w, v_w), (k_b, v_b) = attn.kv_proj.weight.chunk(2), attn.kv_proj.bias.chunk(2)
        else:  # the fused projection's rows are [Q; K; V], each d rows, heads in order
            (q_w, k_w, v_w), (q_b, k_b, v_b) = (attn.qkv_proj.weight.chunk(3),
                                                attn.qkv_proj.bias.chunk(3))
        for name, w, b in (("q", q_w, q_b), ("k", k_w, k_b), ("v", v_w, v_b)):
            out[f"{prefix}.{name}_proj.weight"] = reads(w)
            out[f"{prefix}.{name}_proj.bias"] = b
        out[f"{prefix}.out_proj.weight"] = writes(attn.out_proj.weight)
        out[f"{prefix}.out_proj.bias"] = writes(attn.out_proj.bias)

    def norm(prefix: str, ln) -> None:
        out[f"{prefix}.weight"], out[f"{prefix}.bias"] = writes(ln.weight), writes(ln.bias)

    def feed_forward(prefix: str, ff) -> None:
        out[f"{prefix}.fc1.weight"], out[f"{prefix}.fc1.bias"] = reads(ff.linear1.weight), ff.linear1.bias
        out[f"{prefix}.fc2.weight"], out[f"{prefix}.fc2.bias"] = (writes(ff.linear2.weight),
                                                                  writes(ff.linear2.bias))

    for i, layer in enumerate(model.encoder.layers):
        p = f"model.encoder.layers.{i}"
        attention(f"{p}.self_attn", layer.self_attn, cross=False)
        norm(f"{p}.self_attn_layer_norm", layer.sublayer1.norm)
        feed_forward(p, layer.feed_forward)
        norm(f"{p}.final_layer_norm", layer.sublayer2.norm)
    for i, layer in enumerate(model.decoder.layers):
        p = f"model.decoder.layers.{i}"
        attention(f"{p}.self_attn", layer.self_attn, cross=False)
        norm(f"{p}.self_attn_layer_norm", layer.sublayer1.norm)
        attention(f"{p}.encoder_attn", layer.cross_attn, cross=True)
        norm(f"{p}.encoder_attn_layer_norm", layer.sublayer2.norm)
        feed_forward(p, layer.feed_forward)
        norm(f"{p}.final_layer_norm", layer.sublayer3.norm)

    # An embedding row is a vector of the stream; the generator reads the stream.
    src = reads(model.src_embed.embedding.weight)
    tgt = reads(model.tgt_embed.embedding.weight)
    out["model.encoder.embed_tokens.weight"] = src
    out["model.decoder.embed_tokens.weight"] = tgt
    if cfg.tie_embeddings == "all":
        out["model.shared.weight"] = src
    out["lm_head.weight"] = reads(model.generator.proj.weight)
    bias = output_bias(model)  # the paper's layer has none (3.4)
    out["final_logits_bias"] = (torch.zeros(cfg.tgt_vocab_size) if bias is None else bias)[None]
    return {name: t.detach().float().contiguous() for name, t in out.items()}


def hf_tokenizer(tokenizers: Tokenizers, max_len: int):
    """A Transformers fast tokenizer over aiayn's joint `tokenizers` model, appending
    [EOS] as aiayn does, decoding without clean-up (aiayn's Metaspace decoder is exact).
    A model of several directions keeps its tags (``<2es>``) as special tokens: the
    tokenizer JSON already never splits them, and naming them (``extra_special_tokens``)
    lists them to the user and drops them in ``decode(skip_special_tokens=True)``."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(tokenizers.src.to_str())
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS}", pair=f"$A $B {EOS}", special_tokens=[(EOS, EOS_ID)])
    tags = list(tokenizers.tags.values())
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, unk_token=UNK, bos_token=BOS, eos_token=EOS,
        model_max_length=max_len, padding_side="right", clean_up_tokenization_spaces=False,
        **({"extra_special_tokens": tags} if tags else {}))


def is_marian(cfg: ModelConfig) -> bool:
    """Whether Transformers' own Marian computes this model: post-norm, no QK-norm (the
    others ship aiayn's model.py and load with trust_remote_code)."""
    return not cfg.norm_first and not cfg.qk_norm


def write_hf(model: Transformer, tokenizers: Tokenizers, out: Path,
             decode: DecodeConfig | None = None) -> None:
    """config.json, generation_config.json (searching with ``decode``), model.safetensors,
    tokenizer.json (+ config); beside them, for a model Marian cannot express, aiayn's
    model.py and the wrapper hf_model.py that config.json's auto_map names."""
    transformers = require("transformers", "--to hf")
    cfg = model.cfg
    check_target_can_express(cfg, "hf", "this model")
    check_one_vocabulary(tokenizers, "this model")
    if not is_marian(cfg):
        write_hf_aiayn(model, tokenizers, out, decode)
        return
    marian = transformers.MarianMTModel(transformers.MarianConfig(**marian_config(cfg)))
    missing, unexpected = marian.load_state_dict(marian_state_dict(model), strict=False)
    # The positional tables are computed by Marian itself, never stored.
    missing = [k for k in missing if not k.endswith("embed_positions.weight")]
    if missing or unexpected:  # a bug in the mapping, not a user error
        raise RuntimeError(f"Marian mapping incomplete: missing {missing}, unexpected {unexpected}")
    marian.generation_config = transformers.GenerationConfig(
        **generation_config(cfg, decode))
    with _quiet_transformers(transformers):
        marian.eval().save_pretrained(out)
        hf_tokenizer(tokenizers, cfg.max_len).save_pretrained(out)


HF_CODE = ("model.py", "cache.py", "loss.py", "hf_model.py")  # aiayn's files an export ships, verbatim


def write_hf_aiayn(model: Transformer, tokenizers: Tokenizers, out: Path,
                   decode: DecodeConfig | None = None) -> None:
    """aiayn's own Transformer as a Transformers model: its code (HF_CODE, copied from this
    package) beside its weights, config.json naming the classes in ``auto_map``."""
    transformers = require("transformers", "--to hf")
    from aiayn import hf_model

    cfg = model.cfg
    config = hf_model.AiaynConfig(
        aiayn=dataclasses.asdict(cfg), architectures=["AiaynForConditionalGeneration"],
        auto_map={"AutoConfig": "hf_model.AiaynConfig",
                  "AutoModelForSeq2SeqLM": "hf_model.AiaynForConditionalGeneration"},
        pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        decoder_start_token_id=BOS_ID, tie_word_embeddings=cfg.tie_embeddings != "none")
    wrapper = hf_model.AiaynForConditionalGeneration(config)
    wrapper.model.load_state_dict(model.state_dict())
    wrapper.generation_config = transformers.GenerationConfig(**generation_config(cfg, decode))
    with _quiet_transformers(transformers):
        wrapper.eval().save_pretrained(out)
        hf_tokenizer(tokenizers, cfg.max_len).save_pretrained(out)
    here = Path(hf_model.__file__).parent
    for name in HF_CODE:
        atomic_write_text(out / name, (here / name).read_text(encoding="utf-8"))


@contextmanager
def _quiet_transformers(transformers) -> Iterator[None]:
    """No progress bars from Transformers while it writes (the command prints one line)."""
    hf_logging = transformers.utils.logging
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()
