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
  renormalized log-probabilities); for CTranslate2, ``aiayn.inference.ct2`` passes them as
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
(``aiayn.inference.search``); with alpha 0 the searches agree token for token. Their output length
limit is one number per call, not aiayn's per sentence (decode.max_len_a x source length +
decode.max_len_b).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor

from aiayn.config import Config, ModelConfig
from aiayn.errors import AiaynError
from aiayn.model import Transformer
from aiayn.runs.checkpoint import tensors_size, unique_state_dict
from aiayn.runs.directory import copy_tokenizer

CT2_POSITIONS = 1024  # CTranslate2's default max_input_length


# ---------------------------------------------------------------- the command


def export_size(model: Transformer, run_dir: Path) -> int:
    """About what an export writes: the float32 weights and the tokenizer files."""
    tokenizer = sum(p.stat().st_size for p in (run_dir / "tokenizer").rglob("*") if p.is_file())
    return tensors_size(unique_state_dict(model)) + tokenizer


# An absolute path inside a text (a corpus spec "tsv:/home/me/corpus.tsv", a description
# "tab-separated pairs from /home/me/..."): from a slash (or a drive letter) after a start,
# a space, a colon, a comma or a quote, to the next space, comma or quote.
_ABSOLUTE_PATH = re.compile(r"(?:(?<=^)|(?<=[\s:,'\"`(]))(?:[A-Za-z]:)?[/\\~][^\s,'\"`)]*")


def without_local_paths(text: str) -> str:
    """``text`` with each absolute path replaced by its file name: what an export writes is
    meant to leave this machine (a hub page), and a local path tells where the trainer's files
    are and often the user's name; the file name still says which file it was."""
    return _ABSOLUTE_PATH.sub(lambda m: re.split(r"[/\\]", m.group(0).rstrip("/\\"))[-1],
                              text)


def write_aiayn_side(config: Config, run_dir: Path, out: Path) -> None:
    """What `aiayn translate/evaluate --engine ctranslate2` read beside the model: the
    config (max_len, the search) and the tokenizer. Not the run's data_dir.txt: an export
    is meant to leave this machine, and that file is a local path (evaluate takes --data)."""
    from aiayn.config import save_config

    data = replace(config.data, corpus=without_local_paths(config.data.corpus))
    save_config(replace(config, data=data), out / "config.yaml")
    copy_tokenizer(run_dir / "tokenizer", out / "tokenizer")


def check_target_can_express(cfg: ModelConfig, to: str, where: str) -> None:
    """Refuse what ``to`` cannot compute exactly. Transformers takes every model (Marian, or
    aiayn's own code); CTranslate2 (4.8) RMS-normalises the query of encoder-decoder
    attention over all of d_model, not per head (its self-attention and the keys it
    normalises per head, as aiayn), so it takes QK-norm there only with
    model.qk_norm_cross_query "whole", which computes the same."""
    if to == "ctranslate2" and cfg.qk_norm and cfg.qk_norm_cross \
            and cfg.qk_norm_cross_query != "whole":
        raise AiaynError(
            f"{where}: a model with QK-norm of each head's query in encoder-decoder attention "
            f"(model.qk_norm_cross_query: {cfg.qk_norm_cross_query}) cannot be exported --to "
            "ctranslate2 (CTranslate2 4.8 normalises the whole query of that attention, not "
            "each head, so its translations would differ); export it --to hf, translate it "
            "with aiayn itself, or train with --set model.qk_norm_cross_query=whole (as "
            "CTranslate2 computes it)")


def output_bias(model: Transformer) -> Tensor | None:
    """The output layer's bias that scores as a restricted generator does: 0 for the pieces
    it may output, -inf for the rest (their probability is 0, so the softmax's normaliser
    and every other log-probability stay as they are); None for a generator of every piece."""
    generator = model.generator
    if not generator.restricted:
        return None
    bias = torch.full((generator.proj.out_features,), float("-inf"))
    return bias.masked_fill(generator.output_mask.cpu(), 0.0)
