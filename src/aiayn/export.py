"""Take a trained model elsewhere: Hugging Face Transformers (Marian) and CTranslate2.

    aiayn export RUN_DIR --to hf OUT_DIR            # MarianMTModel, or aiayn's model.py + fast tokenizer
    aiayn export RUN_DIR --to ctranslate2 OUT_DIR   # CTranslate2 model (+ --quantization)

Both are exact: the exported model computes the same function as aiayn's (a test compares
logits and decoded tokens). What had to be mapped, and how:

- **Positional encoding layout (Marian).** aiayn's sinusoid table interleaves the two
  functions, column 2i = sin and 2i+1 = cos of the same frequency (paper, 3.5); Marian's
  table (``MarianSinusoidalPositionalEmbedding``) puts all sines first and all cosines
  after: [sin | cos]. The frequencies are the same, so Marian's column k is aiayn's column
  ``perm[k]`` with ``perm = [0, 2, 4, ..., 1, 3, 5, ...]``. Permuting the d_model axis of
  *every* vector in the residual stream by ``perm`` changes nothing the model computes:
  the embeddings are permuted like the table they are added to; each Linear that reads the
  stream (Q/K/V, cross-attention K/V from the memory, W1, the generator) has its input
  columns permuted, so it sees the same sums in another order; each Linear that writes the
  stream (W^O, W2) has its output rows and bias permuted; LayerNorm's mean and variance do
  not depend on the order, and its gain and bias are permuted with the features. The
  attention heads live in the projected space, which is not permuted. CTranslate2 instead
  takes the table itself, so it gets aiayn's table and no permutation.
- **Decoder start token.** aiayn starts the decoder with [BOS] (id 2); Marian models
  usually start with the pad token: ``decoder_start_token_id`` = 2 (and CTranslate2's
  ``decoder_start_token`` = "[BOS]").
- **Final-logits bias.** aiayn's generator has no bias: Marian's ``final_logits_bias``
  buffer is all zeros, CTranslate2's projection has no bias. A restricted generator
  (``model.output_vocab: targets``) gives the pieces it never scores logit -inf; both
  targets get a bias of -inf there and 0 elsewhere (``output_bias``), which leaves every
  other log-probability as it is.
- **Tied embeddings.** ``tie_embeddings: all`` is Marian's shared embedding
  (``share_encoder_decoder_embeddings`` + ``tie_word_embeddings``); ``decoder`` ties the
  target embedding to the output projection only; ``none`` ties nothing.
- **Embedding scale, activation, LayerNorm epsilon.** x * sqrt(d_model) is
  ``scale_embedding: true``; the feed-forward uses ReLU (3.3); ``nn.LayerNorm``'s
  epsilon is 1e-5, as Marian's, and set explicitly for CTranslate2.
- **Tokens that are never generated.** aiayn's search never emits [PAD] or [BOS] (their
  logits are -inf before the softmax). The Transformers generation config says the same
  with ``suppress_tokens`` and ``renormalize_logits`` (so beam scores are the same
  renormalized log-probabilities); for CTranslate2, ``aiayn.ct2_engine`` passes them as
  ``suppress_sequences``.
- **Pre-norm, QK-norm.** Marian is post-norm only: Transformers' MarianConfig has no
  ``normalize_before`` option (and the pre-norm relatives, MBart and M2M100, add an
  embedding LayerNorm or use other sinusoid frequencies) and no QK-norm, so ``--to hf``
  writes such a model as aiayn's own: ``model.py`` copied verbatim, ``hf_model.py`` (the
  Transformers interface) and ``auto_map`` in config.json (``trust_remote_code``).
  CTranslate2's TransformerSpec has ``pre_norm``: both kinds export there. Its QK-norm
  (4.8) normalises each head's queries and keys in self-attention and each head's keys in
  encoder-decoder attention, but the encoder-decoder queries over all of d_model (a
  per-head gain is read past its end): a QK-norm model is refused.
- **Tokenizer.** Marian's own tokenizer is SentencePiece; the export writes a fast
  tokenizer instead: aiayn's `tokenizers` JSON with a post-processor that appends [EOS]
  (source ids are tokens + [EOS], labels are tokens + [EOS]; the decoder input is the
  labels shifted right behind ``decoder_start_token_id``, i.e. aiayn's [BOS] + tokens).
  A Transformers tokenizer holds one vocabulary, so ``--to hf`` needs a joint vocabulary.

What differs and cannot be mapped: Transformers and CTranslate2 divide a beam hypothesis's
log-probability by length**alpha, not by GNMT's ((5 + length) / 6)**alpha as aiayn does
(``aiayn.decode``); with alpha 0 the searches agree token for token. Their output length
limit is one number per call, not aiayn's "source length + 50" per sentence.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor

from aiayn.checkpoint import tensors_size, unique_state_dict
from aiayn.config import Config, DecodeConfig, ModelConfig, load_config
from aiayn.errors import AiaynError
from aiayn.io import atomic_directory, atomic_write_text, check_room, check_writable_dir
from aiayn.model import Transformer, sinusoid_table
from aiayn.modelcard import CARD_FILE, model_card
from aiayn.rundir import copy_tokenizer, load_run
from aiayn.tokenizer import BOS, BOS_ID, EOS, EOS_ID, PAD, PAD_ID, UNK, Tokenizers

TARGETS = ("hf", "ctranslate2")
# CTranslate2's weight types (its Converter's --quantization); none keeps float32.
QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16",
                 "bfloat16", "float32")
CT2_POSITIONS = 1024  # CTranslate2's default max_input_length
INSTALL_HINT = "pip install 'aiayn[export]'"
EXPORT_INFO = "aiayn_export.json"  # what was exported from where (both targets)


def require(module: str, purpose: str):
    """Import an optional library or say in one line what to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise AiaynError(f"{purpose} needs the Python package {module!r}, which is not "
                         f"installed: {INSTALL_HINT}") from None


# ---------------------------------------------------------------- the command
def export_run(run_dir: str | Path, to: str, out_dir: str | Path, weights: str | Path = "best",
               quantization: str | None = None) -> Path:
    """Write the run's model for ``to`` ("hf" or "ctranslate2") into a new ``out_dir``.

    Refused, with nothing written: an unknown target or quantization, an ``out_dir`` that
    exists and is not empty, a missing library, a run without weights, a model the target
    cannot express. The directory appears whole or not at all (written beside it, then
    renamed).
    """
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if to not in TARGETS:
        raise AiaynError(f"--to must be one of {', '.join(TARGETS)}, got {to!r}")
    if quantization is not None and to != "ctranslate2":
        raise AiaynError("--quantization applies to --to ctranslate2 only")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise AiaynError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, "
                         f"got {quantization!r}")
    check_writable_dir(out_dir, "OUT_DIR")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise AiaynError(f"OUT_DIR {out_dir}: exists and is not an empty directory; export "
                         "into a new one")
    require("transformers" if to == "hf" else "ctranslate2", f"--to {to}")
    config_path = run_dir / "config.yaml"
    if config_path.is_file():  # refuse before reading any weights
        check_target_can_express(load_config(config_path).model, to, str(run_dir))
    config, model, tokenizers = load_run(run_dir, weights)
    if to == "hf":
        check_one_vocabulary(tokenizers, str(run_dir))
    need = export_size(model, run_dir)
    check_room(out_dir, need, "the export")
    with atomic_directory(out_dir, need, "the export") as tmp:
        if to == "hf":
            write_hf(model, tokenizers, tmp, config.decode)
        else:
            write_ctranslate2(model, tokenizers, tmp, quantization)
            write_aiayn_side(config, run_dir, tmp)
        info = {"format": 1, "target": to, "run_dir": str(run_dir.resolve()),
                "weights": str(weights), "quantization": quantization}
        atomic_write_text(tmp / EXPORT_INFO, json.dumps(info, indent=2) + "\n")
        card = model_card(run_dir, to, weights, quantization, marian=is_marian(model.cfg))
        atomic_write_text(tmp / CARD_FILE, card)
    return out_dir


def export_size(model: Transformer, run_dir: Path) -> int:
    """About what an export writes: the float32 weights and the tokenizer files."""
    tokenizer = sum(p.stat().st_size for p in (run_dir / "tokenizer").rglob("*") if p.is_file())
    return tensors_size(unique_state_dict(model)) + tokenizer


def write_aiayn_side(config: Config, run_dir: Path, out: Path) -> None:
    """What `aiayn translate/evaluate --engine ctranslate2` read beside the model: the
    config (max_len, the search), the tokenizer, and the prepared data the run was trained on."""
    from aiayn.config import save_config

    save_config(config, out / "config.yaml")
    copy_tokenizer(run_dir / "tokenizer", out / "tokenizer")
    if (run_dir / "data_dir.txt").is_file():
        atomic_write_text(out / "data_dir.txt",
                          (run_dir / "data_dir.txt").read_text(encoding="utf-8"))


def check_target_can_express(cfg: ModelConfig, to: str, where: str) -> None:
    """Refuse what ``to`` cannot compute exactly. Transformers takes every model (Marian, or
    aiayn's own code); CTranslate2 (4.8) RMS-normalises the query of encoder-decoder
    attention over all of d_model, not per head as aiayn's QK-norm does (its self-attention
    and the keys it normalises per head, as aiayn)."""
    if to == "ctranslate2" and cfg.qk_norm and cfg.qk_norm_cross:
        raise AiaynError(
            f"{where}: a model with QK-norm in encoder-decoder attention (model.qk_norm: true, "
            "model.qk_norm_cross: true) cannot be exported --to ctranslate2 (CTranslate2 4.8 "
            "normalises the whole query of that attention, not each head, so its translations "
            "would differ); export it --to hf, translate it with aiayn itself, or train with "
            "--set model.qk_norm_cross=false (QK-norm in self-attention only)")


def output_bias(model: Transformer) -> Tensor | None:
    """The output layer's bias that scores as a restricted generator does: 0 for the pieces
    it may output, -inf for the rest (their probability is 0, so the softmax's normaliser
    and every other log-probability stay as they are); None for a generator of every piece."""
    generator = model.generator
    if not generator.restricted:
        return None
    bias = torch.full((generator.proj.out_features,), float("-inf"))
    return bias.masked_fill(generator.output_mask.cpu(), 0.0)


# ---------------------------------------------------------------- Hugging Face (Marian)


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
        "dropout": cfg.dropout,
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
    [EOS] as aiayn does, decoding without clean-up (aiayn's Metaspace decoder is exact)."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(tokenizers.src.to_str())
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS}", pair=f"$A $B {EOS}", special_tokens=[(EOS, EOS_ID)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, unk_token=UNK, bos_token=BOS, eos_token=EOS,
        model_max_length=max_len, padding_side="right", clean_up_tokenization_spaces=False)


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


HF_CODE = ("model.py", "hf_model.py")  # aiayn's files an export ships, verbatim


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

    def head_norms(attention_spec, attention) -> None:
        """QK-norm of self-attention: per head, RMS, a d_k gain, as aiayn's HeadNorm."""
        if cfg.qk_norm:
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
        head_norms(layer_spec.self_attention, layer.self_attn)
        linear(layer_spec.ffn.linear_0, layer.feed_forward.linear1)
        linear(layer_spec.ffn.linear_1, layer.feed_forward.linear2)
        norm(layer_spec.ffn.layer_norm, layer.sublayer2.norm)
    for layer_spec, layer in zip(decoder.layer, model.decoder.layers, strict=True):
        linear(layer_spec.self_attention.linear[0], layer.self_attn.qkv_proj)
        linear(layer_spec.self_attention.linear[1], layer.self_attn.out_proj)
        norm(layer_spec.self_attention.layer_norm, layer.sublayer1.norm)
        head_norms(layer_spec.self_attention, layer.self_attn)
        if cfg.qk_norm:  # none in encoder-decoder attention (check_target_can_express)
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
