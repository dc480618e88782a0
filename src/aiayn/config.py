"""Configuration as plain dataclasses, loaded from and saved to YAML.

A config file has four sections, one per dataclass::

    model:  {d_model: 256, n_heads: 4, ...}
    data:   {corpus: "bible:eng-spa", vocab_size: 8000, ...}
    train:  {warmup_steps: 4000, max_tokens: 4096, ...}
    decode: {beam: 4, alpha: 0.6}

Every section is optional (its defaults apply). Unknown keys and impossible values are
refused with a message that names the setting and the file. Values can be overridden from
the command line with ``--set section.key=value`` (the value is parsed as YAML).

At over 500 lines this module stays one file on purpose: every key, its default, its
meaning and its allowed range (``RANGES``, ``CHOICES``) stand in one place, the one that
docs/configuration.md is generated from; split by section, a check that spans sections
(``train.max_tokens`` against ``model.max_len``, ``decode.alignment_layer`` against the
model's layers) would have no home.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from aiayn.errors import AiaynError
from aiayn.util.io import atomic_write_text

TIE_CHOICES = ("none", "decoder", "all")
EMBEDDING_INITS = ("normal", "xavier")
OUTPUT_VOCABS = ("all", "targets")
# model.qk_norm_cross_query: the span a cross-attention query is RMS-normalised over.
CROSS_QUERY_NORMS = ("heads", "whole")
SCHEDULES = ("eq3", "linear")
BEST_METRICS = ("bleu", "chrf", "loss")  # see aiayn.training.early_stopping
# train.precision: "auto" chooses per device (aiayn.util.device.resolve_precision).
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
OPTIMIZERS = ("adam", "muon")
CURRICULA = ("none", "length")  # train.curriculum (aiayn.data.batching.length_curriculum)
# train.bf16 (true | false | auto), the setting's name before train.precision: config files,
# saved runs' config.yaml and --set still give it; ``precision_of_bf16`` alone maps it.
BF16_TO_PRECISION = {"true": "bf16", "false": "fp32", "auto": "auto"}
# sacreBLEU tokenizers aiayn offers (spm/flores download a model; left out).
BLEU_TOKENIZERS = ("auto", "13a", "intl", "zh", "ja-mecab", "ko-mecab", "char", "none")
# data.src_lang / data.tgt_lang: "auto" or a language code (en, zh, pt-BR, zh_Hant).
LANG_PATTERN = re.compile(r"auto|[a-z]{2,3}([-_][A-Za-z0-9]{1,8})*")

INF = math.inf
# The allowed range of every numeric setting: (low, high, low excluded?). Integers are
# checked to be integers, floats to be finite; booleans are never numbers here.
RANGES: dict[str, dict[str, tuple[float, float, bool]]] = {
    "model": {
        "src_vocab_size": (1, INF, False), "tgt_vocab_size": (1, INF, False),
        "d_model": (1, INF, False), "n_heads": (1, INF, False), "d_ff": (1, INF, False),
        "n_encoder_layers": (1, INF, False), "n_decoder_layers": (1, INF, False),
        "max_len": (2, INF, False),  # BOS/EOS plus one token
        "dropout": (0.0, 0.999, False), "attention_dropout": (0.0, 0.999, False),
        "pad_id": (0, INF, False),
    },
    "data": {
        "vocab_size": (5, INF, False),  # the 4 special tokens and at least one more
        "min_frequency": (1, INF, False),
        "dev_fraction": (0.0, 1.0, True), "test_fraction": (0.0, 1.0, True),
        "split_seed": (0, INF, False), "max_words": (1, INF, False),
        "max_length_ratio": (1.0, INF, False), "held_out_max": (1, INF, False),
        "tokenizer_max_pairs": (1, INF, False),
    },
    "train": {
        "seed": (0, INF, False), "max_tokens": (1, INF, False), "grad_accum": (1, INF, False),
        "lr_scale": (0.0, INF, True), "peak_lr": (0.0, INF, True),
        "warmup_steps": (1, INF, False),
        "adam_beta1": (0.0, 0.9999, False), "adam_beta2": (0.0, 0.9999999, False),
        "adam_eps": (0.0, 1.0, True), "weight_decay": (0.0, 1.0, False),
        "muon_lr_ratio": (0.0, INF, True), "curriculum_start": (0.0, 1.0, True),
        "label_smoothing": (0.0, 0.999, False), "clip_norm": (0.0, INF, False),
        "max_steps": (1, INF, False), "max_epochs": (1, INF, False),
        "max_minutes": (0.0, INF, False), "eval_every": (1, INF, False),
        "eval_max_sentences": (0, INF, False), "eval_beam": (1, 64, False),
        "save_every": (1, INF, False), "keep_checkpoints": (1, INF, False),
        "log_every": (1, INF, False), "num_samples": (0, INF, False),
        "cpu_threads": (0, 4096, False), "patience": (0, INF, False),
    },
    "decode": {"beam": (1, 64, False), "alpha": (0.0, 10.0, False),
               "no_repeat_ngram": (0, 64, False),
               "max_len_a": (0.0, 10.0, False), "max_len_b": (0, 4096, False),
               "alignment_layer": (-4096, 4096, False)},  # one of the decoder's: validate
    # Not a config section: the settings of random sampling instead of the search
    # (`aiayn translate --sample`, a request's "sample"; aiayn.inference.settings.Sampling).
    "sample": {"temperature": (0.0, 100.0, True), "top_k": (0, INF, False),
               "top_p": (0.0, 1.0, True), "seed": (0, 2 ** 63 - 1, False)},
}
# Settings that may also be "auto": the trainer chooses them from the passes over the data its
# budget makes (aiayn.training.plan.choose_regularisation); until then they count as 0.
AUTO = "auto"
AUTO_SETTINGS = {("model", "dropout"), ("train", "label_smoothing")}
CHOICES: dict[str, dict[str, tuple[str, ...]]] = {
    "model": {"tie_embeddings": TIE_CHOICES, "embedding_init": EMBEDDING_INITS,
              "output_vocab": OUTPUT_VOCABS, "qk_norm_cross_query": CROSS_QUERY_NORMS},
    "data": {"tokenizer": ("bpe", "wordlevel"), "long_policy": ("drop", "truncate"),
             "bleu_tokenize": BLEU_TOKENIZERS},
    "train": {"schedule": SCHEDULES, "precision": PRECISIONS, "best_metric": BEST_METRICS,
              "optimizer": OPTIMIZERS, "curriculum": CURRICULA},
}


def check_setting(where: str, key: str, value: Any) -> None:
    """One value for the numeric setting ``key`` ("train.max_minutes") checked against its
    range, the error naming ``where`` it came from (a command-line flag)."""
    section, name = key.split(".")
    _check_range(f"{where}: {key}", value, *RANGES[section][name])


def _check_range(where: str, value: Any, low: float, high: float, open_low: bool) -> None:
    """One numeric setting: an int where the default is one, finite, within [low, high]
    (or (low, high] when ``open_low``)."""
    integer = isinstance(low, int) and not isinstance(low, bool)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            integer and not isinstance(value, int)):
        raise AiaynError(f"{where} must be {'an integer' if integer else 'a number'}, "
                         f"got {value!r}")
    low_text = f"{'(' if open_low else '['}{low:g}"
    high_text = "inf)" if high == INF else f"{high:g}]"
    if not math.isfinite(value) or value < low or value > high or (open_low and value == low):
        raise AiaynError(f"{where} must be in {low_text}, {high_text}, got {value!r}")


@dataclass
class ModelConfig:
    """Sizes of the Transformer (paper, Table 3; "base" is 512/8/2048/6+6).

    Each field's docstring is its line on docs/configuration.md (docs/generate.py)."""

    src_vocab_size: int = 8000
    """Source vocabulary size; aiayn train fills it in from the prepared tokenizer."""
    tgt_vocab_size: int = 8000
    """Target vocabulary size; aiayn train fills it in from the prepared tokenizer."""
    d_model: int = 512
    """Width of every sub-layer's output (paper, 3.1)."""
    n_heads: int = 8
    """Attention heads h; d_model must be divisible by it (paper, 3.2.2)."""
    d_ff: int = 2048
    """Inner width of the position-wise feed-forward network (paper, 3.3)."""
    n_encoder_layers: int = 6
    """Encoder layers N (paper, 3.1)."""
    n_decoder_layers: int = 6
    """Decoder layers N (paper, 3.1)."""
    dropout: float | str = 0.1
    """P_drop on each sub-layer output and on the embedding + position sums (paper, 5.4);
    "auto": 0 for a budget of few passes over the data, 0.1 for more (train.label_smoothing)."""
    attention_dropout: float = 0.0
    """Dropout on the attention weights (not in the paper; tensor2tensor and torch.nn have it)."""
    max_len: int = 256
    """Longest sequence the model accepts, in tokens, BOS and EOS included."""
    norm_first: bool = False
    """False: post-norm, LayerNorm(x + Sublayer(x)) as in the paper; true: pre-norm,
    x + Sublayer(LayerNorm(x)), stable at higher peak rates."""
    tie_embeddings: str = "decoder"
    """"decoder": the target embedding is the output layer's weight (paper, 3.4); "all": the
    source embedding too (needs data.joint_vocab); "none": untied."""
    embedding_init: str = "normal"
    """"normal": token embeddings ~ N(0, d_model^-0.5) as in tensor2tensor, as large as the
    positional encoding after the sqrt(d_model) scale; "xavier": as the tutorials."""
    qk_norm: bool = False
    """RMS-normalise each head's queries and keys (learnt gain per dimension) before
    Q K^T / sqrt(d_k) (QK-norm; Henry et al. 2020, Wortsman et al. 2023; not in the paper):
    bounded attention logits, so high peak rates do not stall."""
    qk_norm_cross: bool = True
    """With qk_norm: also in encoder-decoder attention (true), or in self-attention only
    (false)."""
    qk_norm_cross_query: str = "heads"
    """With qk_norm and qk_norm_cross: encoder-decoder attention's query is RMS-normalised
    over each head's d_k features ("heads", as its keys and self-attention) or over all of
    d_model at once, with a gain of d_model ("whole"), as CTranslate2 computes it, so such a
    model can be exported there (docs/export.md)."""
    output_vocab: str = "all"
    """Which pieces the output layer scores (not in the paper): "all" of the target
    vocabulary, or only the "targets": the pieces that occur in the training targets, found by
    aiayn train and saved with the weights (a joint vocabulary's other-language pieces can
    never be right)."""
    pad_id: int = 0
    """Id of [PAD]; aiayn's tokenizers always put it at 0."""


@dataclass
class DataConfig:
    """Where sentence pairs come from and how they become token ids."""

    corpus: str = "bible:eng-spa"
    """Corpus spec: bible:..., hf:NAME[:CONFIG], tsv:PATH, jsonl:PATH or parallel:SRC,TGT
    (docs/data.md); one line per corpus for several, each with options weight=, src=, tgt=
    (docs/data.md#several-corpora-and-directions); aiayn prepare --corpus overrides it."""
    tokenizer: str = "bpe"
    """"bpe" or "wordlevel" (as the tutorials)."""
    vocab_size: int = 8000
    """Vocabulary size the tokenizer is trained to (per side unless joint_vocab), the 256
    byte pieces of byte_fallback included."""
    joint_vocab: bool = True
    """One vocabulary for both sides (needed by model.tie_embeddings: all and by export --to hf)."""
    min_frequency: int = 2
    """Fewest occurrences a piece needs to enter the vocabulary."""
    long_policy: str = "drop"
    """A pair longer than model.max_len is "drop"ped or "truncate"d, counted before training."""
    dev_fraction: float = 0.01
    """Share of pairs held out as dev when the corpus has no dev split."""
    test_fraction: float = 0.01
    """Share of pairs held out as test when the corpus has no test split."""
    held_out_max: int = 3000
    """At most this many pairs held out for each of dev and test (validation stays quick)."""
    split_seed: int = 1234
    """Seed of the random held-out split."""
    tokenizer_max_pairs: int = 200_000
    """The tokenizer learns from at most this many train pairs, spread evenly over the split
    (its time grows with the text; the vocabulary hardly changes past a few 100k pairs)."""
    byte_fallback: bool = True
    """BPE with a vocab_size of 1024 or more: the last 256 pieces are bytes, so a character
    the tokenizer never saw is spelt in its UTF-8 bytes, not [UNK], and any text round-trips
    (docs/data.md#languages); false (and smaller vocabularies): unseen characters are [UNK]."""
    max_words: int = 150
    """Pairs with a side longer than this many words are dropped (in scripts without spaces,
    characters count as shares of a word: 1.5 Han, 3 kana, 4 Thai letters make one)."""
    max_length_ratio: float = 3.0
    """Pairs whose one side is this many times longer than the other (in words, counted as
    for max_words) are dropped."""
    src_lang: str = "auto"
    """Language of the source side, e.g. en, zh, ja: "auto" takes it from the corpus spec
    (bible:eng-spa, hf:NAME:en-zh), else from the script of the text (docs/data.md#languages)."""
    tgt_lang: str = "auto"
    """Language of the target side, as src_lang; it chooses BLEU's tokenizer."""
    bleu_tokenize: str = "auto"
    """sacreBLEU tokenizer of BLEU: "auto" follows tgt_lang (zh: "zh"; ja: "ja-mecab" where
    mecab-python3 and ipadic are installed, else "char"; th, lo, km, my: "char"; else
    "13a"), or one of 13a, intl, zh, ja-mecab, ko-mecab, char, none. A run's setting, when
    not auto, overrides its prepared data's."""
    src_field: str = "src"
    """Source field of jsonl:PATH rows (and of hf: rows without a translation dict)."""
    tgt_field: str = "tgt"
    """Target field of jsonl:PATH rows (and of hf: rows without a translation dict)."""


@dataclass
class TrainConfig:
    """Optimisation (paper, 5.3-5.4), batching, evaluation and checkpointing."""

    seed: int = 1
    """Seeds Python, NumPy and torch: the same command gives the same weights on a CPU with
    a fixed cpu_threads."""
    max_tokens: int = 4096
    """Token budget of one batch: sentences x the longer side, padding included."""
    grad_accum: int = 1
    """Micro-batches accumulated into one optimizer update."""
    curriculum: str = "none"
    """The order of the first pass over the training batches: "none", shuffled as every
    pass; "length", a competence curriculum (Platanios et al. 2019): the pass's step p of n
    draws among its unused batches of the narrowest c(p) = min(1, sqrt(s^2 + (1 - s^2) p /
    n)), s = curriculum_start, so it starts on short sentences and ends with the longest;
    later passes are shuffled (docs/findings.md#a-length-curriculum)."""
    curriculum_start: float = 0.1
    """The share of the batches, the narrowest, a "length" curriculum starts on, in (0, 1]."""
    schedule: str = "eq3"
    """"eq3": lr = lr_scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (paper,
    eq. 3); "linear": warm up to peak_lr, then fall linearly to 0 at the end of the budget
    (max_steps, or max_minutes of training when that comes first)."""
    lr_scale: float = 1.0
    """Factor on eq. 3's rate (schedule eq3 only)."""
    peak_lr: float = 1e-3
    """The rate reached at the end of the warm-up (schedule linear only)."""
    warmup_steps: int = 4000
    """Steps of the warm-up (paper, 5.3: 4000)."""
    optimizer: str = "adam"
    """"adam" (paper, 5.3); "muon": Muon for the encoder's and decoder's weight matrices,
    Adam for the embeddings, biases and norm gains (aiayn.training.optim.Muon)."""
    muon_lr_ratio: float = 1.0
    """Muon's rate over the schedule's (optimizer muon only; Adam's stays the schedule's)."""
    adam_beta1: float = 0.9
    """Adam's beta1 (paper, 5.3)."""
    adam_beta2: float = 0.98
    """Adam's beta2 (paper, 5.3)."""
    adam_eps: float = 1e-9
    """Adam's epsilon (paper, 5.3)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW style; not in the paper)."""
    label_smoothing: float | str = 0.1
    """epsilon_ls of the label-smoothed cross-entropy (paper, 5.4); "auto": chosen with
    model.dropout from the passes over the training data the budget makes: none up to 4
    passes, 0.05 up to 5.5, 0.1 beyond (docs/training.md#regularisation-by-the-budget)."""
    clip_norm: float = 1.0
    """Gradient norm clipping threshold; 0 disables clipping."""
    max_steps: int = 100_000
    """Stop after this many optimizer steps."""
    max_epochs: int = 1000
    """Stop after this many passes over the training batches."""
    max_minutes: float = 0.0
    """Stop when the run has trained this long over all its training sessions, validations
    included (0: no time budget); the final validation and save follow."""
    eval_every: int = 1000
    """Optimizer steps between validations (dev loss, BLEU, chrF, samples)."""
    eval_max_sentences: int = 0
    """Dev sentences a validation decodes, a fixed subset spread over the split (0: all)."""
    eval_beam: int = 1
    """Beam of the validation's decoding (1: greedy)."""
    save_every: int = 1000
    """Optimizer steps between checkpoints."""
    keep_checkpoints: int = 5
    """Step checkpoints kept for aiayn average."""
    keep_steps: list[int] = field(default_factory=list)
    """Steps whose weights are also saved (checkpoints/step_*.safetensors, weights only) and
    never pruned, e.g. [100, 200, 400]: the early steps, where `aiayn attention --steps`
    shows the attention learning to align, outlive keep_checkpoints."""
    best_metric: str = "bleu"
    """What best.safetensors is best by: dev "bleu" or "chrf" on the validation subset, or
    the dev "loss" over the whole dev split."""
    patience: int = 0
    """Stop after this many validations in a row without a better best_metric (0: never)."""
    log_every: int = 50
    """Optimizer steps between lines of metrics.jsonl and TensorBoard scalars."""
    precision: str = "auto"
    """The arithmetic of training's forward and backward passes: "fp32"; "bf16" (bfloat16
    autocast); "fp16" (float16 autocast with a gradient scaler: a step whose gradients
    overflow is skipped and the scale lowered); "auto": bf16 on a GPU that supports it, else
    fp16 on a GPU; on a CPU bf16 where its matrix product beats fp32 in a probe (AVX512-BF16
    or AMX, not AVX2 alone), else fp32. The older train.bf16 (true / false / auto) still
    reads as bf16 / fp32 / auto."""
    compile: bool = False
    """Wrap the model in torch.compile (on a CPU the first steps take minutes)."""
    num_samples: int = 3
    """Sample translations printed and logged at each validation."""
    cpu_threads: int = 0
    """CPU threads: 0 adapts (all cores, or 1 while another process makes that slower);
    N is exactly N (bit-for-bit repeatable runs)."""

    @property
    def use_bf16(self) -> bool:
        """bf16 autocast, once resolved: the trainer replaces "auto" by the precision it
        chose for its device (aiayn.util.device.resolve_precision) before anything runs."""
        return self._resolved() == "bf16"

    @property
    def use_fp16(self) -> bool:
        """fp16 autocast with a gradient scaler, once resolved (as ``use_bf16``)."""
        return self._resolved() == "fp16"

    def _resolved(self) -> str:
        if self.precision == "auto":
            raise ValueError("train.precision='auto' must be resolved first "
                             "(aiayn.util.device.resolve_precision)")
        return self.precision

    @property
    def bf16(self) -> str:
        """The older setting's value for this precision: "true" (bf16), "auto", else "false"."""
        return {"bf16": "true", "auto": "auto"}.get(self.precision, "false")

    @bf16.setter
    def bf16(self, value: str | bool) -> None:
        self.precision = precision_of_bf16(value, "train.bf16")


def _taking_bf16(init):
    """TrainConfig's constructor (and so ``dataclasses.replace``) also taking the older
    ``bf16=`` ("true" / "false" / "auto": it sets the precision), as notebooks and scripts
    written before train.precision pass it."""
    @functools.wraps(init)
    def __init__(self, *args, bf16: str | bool | None = None, **kwargs) -> None:
        if bf16 is not None:  # given by name, it says the precision (replace passes both)
            kwargs["precision"] = precision_of_bf16(bf16, "train.bf16")
        init(self, *args, **kwargs)

    return __init__


TrainConfig.__init__ = _taking_bf16(TrainConfig.__init__)  # type: ignore[method-assign]


def rate(value: float | str) -> float:
    """A dropout or label-smoothing setting as the rate in force: "auto" counts as 0 until the
    trainer chooses (aiayn.training.plan.choose_regularisation)."""
    return 0.0 if value == AUTO else float(value)


def precision_of_bf16(value: Any, where: str) -> str:
    """train.precision for a value of the older train.bf16 (true | false | auto)."""
    key = str(value).lower() if isinstance(value, bool) else value
    if key not in BF16_TO_PRECISION:
        raise AiaynError(f"{where} (now train.precision: {', '.join(PRECISIONS)}) must be "
                         f"one of auto, true, false, got {value!r}")
    return BF16_TO_PRECISION[key]


def renamed_setting(section: str, name: str, value: Any, where: str) -> tuple[str, Any]:
    """A setting under its current name: train.bf16 becomes train.precision (its value
    mapped by ``precision_of_bf16``); every other setting stays as it is."""
    if section == "train" and name == "bf16":
        return "precision", precision_of_bf16(value, f"{where}.bf16")
    return name, value


@dataclass
class DecodeConfig:
    """The search a trained run decodes with when nobody says otherwise: `aiayn translate`,
    `evaluate` and `serve` without --beam/--alpha (or a request without them), and the
    generation defaults of `aiayn export --to hf`. The paper (6.1): beam 4, length penalty
    alpha 0.6. Each of the two left out of a command takes its value here (`--beam 4` on a
    run with alpha 1.0 searches with beam 4, alpha 1.0). It changes no weights, so a run's
    config.yaml may be edited after training; during training only validations with
    train.eval_beam > 1 read it (their alpha)."""

    beam: int = 4
    """Beam size of the run's search (paper, 6.1: 4); 1 is greedy."""
    alpha: float = 0.6
    """Length penalty alpha of the run's search, lp(Y) = ((5 + |Y|) / 6)^alpha (paper, 6.1: 0.6)."""
    no_repeat_ngram: int = 0
    """Repetition guard: no translation holds the same n-gram of pieces twice (a piece that
    would complete one already there is never chosen; CTranslate2's no_repeat_ngram_size);
    0: off, as the paper. `--no-repeat-ngram N` overrides it."""
    max_len_a: float = 1.0
    """Length limit, per sentence: at most floor(max_len_a x source length) + max_len_b new
    tokens, the source counted with its EOS, never past model.max_len (the paper, 6.1:
    "input length + 50", a = 1 and b = 50). CTranslate2 takes one limit per batch: it decodes
    up to the longest sentence's and cuts each sentence at its own."""
    max_len_b: int = 50
    """The constant of the length limit (see max_len_a)."""
    alignment_layer: int = 0
    """The decoder layer whose cross-attention (its heads averaged) gives the word alignments
    of `aiayn translate --alignments` and serve's "alignments": from 1, or counted back from
    the last with -1 (the last), -2...; 0: the layer below the last (the only one of a
    one-layer decoder), which aligned hand-aligned Bible verses best on the demo model
    (docs/translating.md#word-alignments)."""


def alignment_layer_rule(layers: int) -> str:
    """What decode.alignment_layer may be for a decoder of ``layers`` layers."""
    return (f"decode.alignment_layer must be a decoder layer, 1 to {layers} or -1 (the last) "
            f"to -{layers}, or 0 (the layer below the last)")


def alignment_layer_index(layer: int, layers: int) -> int:
    """decode.alignment_layer (checked) as an index from 0: 0 is the layer below the last
    (the only one of a one-layer decoder), -1 the last."""
    if abs(layer) > layers:
        raise AiaynError(f"{alignment_layer_rule(layers)}, got {layer}")
    if layer == 0:
        return max(layers - 2, 0)
    return layer - 1 if layer > 0 else layers + layer


SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig,
            "decode": DecodeConfig}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def validate(self, source: str = "config") -> Config:
        """Refuse every value out of its range (``RANGES``) or that cannot build a model,
        naming the setting, the value and what is allowed."""
        for section in SECTIONS:
            for name, (low, high, open_low) in RANGES[section].items():
                if (section, name) in AUTO_SETTINGS and getattr(getattr(self, section),
                                                                name) == AUTO:
                    continue
                _check_range(f"{source}: {section}.{name}", getattr(getattr(self, section), name),
                             low, high, open_low)
        for section, rules in CHOICES.items():
            for name, allowed in rules.items():
                value = getattr(getattr(self, section), name)
                if value not in allowed:
                    raise AiaynError(f"{source}: {section}.{name} must be one of "
                                     f"{', '.join(allowed)}, got {value!r}")
        m, t = self.model, self.train
        if m.d_model % m.n_heads:
            raise AiaynError(
                f"{source}: model.d_model ({m.d_model}) must be divisible by "
                f"model.n_heads ({m.n_heads})"
            )
        if m.tie_embeddings == "all" and m.src_vocab_size != m.tgt_vocab_size:
            raise AiaynError(
                f"{source}: model.tie_embeddings='all' needs one shared vocabulary, but "
                f"src_vocab_size={m.src_vocab_size} and tgt_vocab_size={m.tgt_vocab_size}"
            )
        if not m.pad_id < min(m.src_vocab_size, m.tgt_vocab_size):
            raise AiaynError(f"{source}: model.pad_id {m.pad_id} is outside the vocabulary")
        if abs(self.decode.alignment_layer) > m.n_decoder_layers:
            raise AiaynError(f"{source}: {alignment_layer_rule(m.n_decoder_layers)}, got "
                             f"{self.decode.alignment_layer}")
        for side in ("src_lang", "tgt_lang"):
            if not LANG_PATTERN.fullmatch(getattr(self.data, side)):
                raise AiaynError(f"{source}: data.{side} must be auto or a language code such "
                                 f"as en, zh, ja, pt-BR, got {getattr(self.data, side)!r}")
        if self.data.dev_fraction + self.data.test_fraction >= 1:
            raise AiaynError(f"{source}: data.dev_fraction + data.test_fraction must be below 1 "
                             f"(something must be left to train on), got "
                             f"{self.data.dev_fraction} + {self.data.test_fraction}")
        if not (isinstance(t.keep_steps, list) and all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in t.keep_steps)
                and len(set(t.keep_steps)) == len(t.keep_steps)):
            raise AiaynError(f"{source}: train.keep_steps must be a list of distinct steps, "
                             f"each an integer >= 1 (e.g. [100, 200, 400]), got {t.keep_steps!r}")
        if t.max_tokens < m.max_len:
            raise AiaynError(
                f"{source}: train.max_tokens ({t.max_tokens}) is smaller than model.max_len "
                f"({m.max_len}): the longest sentence would not fit in a batch"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None, source: str = "config") -> Config:
        raw = raw or {}
        if not isinstance(raw, dict):
            raise AiaynError(f"{source}: expected a mapping with sections "
                             f"{', '.join(SECTIONS)}")
        unknown = set(raw) - set(SECTIONS)
        if unknown:
            raise AiaynError(
                f"{source}: unknown section(s) {', '.join(sorted(unknown))}; "
                f"expected {', '.join(SECTIONS)}"
            )
        built = {}
        for name, klass in SECTIONS.items():
            built[name] = _build_section(klass, raw.get(name) or {}, f"{source}: {name}")
        return cls(**built)

    def override(self, assignments: list[str], source: str = "--set") -> Config:
        """Apply ``section.key=value`` strings (values parsed as YAML)."""
        raw = self.to_dict()
        for item in assignments:
            key, sep, value = item.partition("=")
            section, dot, name = key.strip().partition(".")
            if not sep or not dot:
                raise AiaynError(f"{source} {item!r}: expected section.key=value, e.g. train.max_steps=100")
            if section not in raw:
                raise AiaynError(f"{source} {item!r}: unknown section {section!r} "
                                 f"({', '.join(SECTIONS)})")
            old_name = name
            if (section, name) == ("train", "bf16"):
                name = "precision"  # the older name (renamed_setting maps its value below)
            if name not in raw[section]:
                raise AiaynError(
                    f"{source} {item!r}: unknown setting {section}.{name}; known: "
                    f"{', '.join(raw[section])}"
                )
            try:
                parsed = yaml.safe_load(value)
            except yaml.YAMLError as exc:
                raise AiaynError(f"{source} {item!r}: value is not valid YAML ({exc})") from None
            raw[section][name] = renamed_setting(section, old_name, parsed, f"{source} {section}")[1]
        return Config.from_dict(raw, source)


def _build_section(klass, values: dict[str, Any], where: str):
    if not isinstance(values, dict):
        raise AiaynError(f"{where}: expected a mapping, got {type(values).__name__}")
    known = {f.name: f for f in fields(klass)}
    if klass is TrainConfig and "bf16" in values:  # the older name of train.precision
        values = dict(values)
        _, precision = renamed_setting("train", "bf16", values.pop("bf16"), where)
        if values.setdefault("precision", precision) != precision:
            raise AiaynError(f"{where}: bf16 ({precision}) and precision "
                             f"({values['precision']!r}) disagree; keep precision alone")
    unknown = set(values) - set(known)
    if unknown:
        raise AiaynError(
            f"{where}: unknown setting(s) {', '.join(sorted(unknown))}; known: {', '.join(known)}"
        )
    default = klass()
    kwargs = {}
    section = next(key for key, k in SECTIONS.items() if k is klass)
    for name, value in values.items():
        if (section, name) in AUTO_SETTINGS and value == AUTO:
            kwargs[name] = value
            continue
        expected = type(getattr(default, name))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if expected is float and isinstance(value, str):
            # YAML 1.1 (PyYAML) reads "1e-9" without a dot as a string, not a number.
            try:
                value = float(value)
            except ValueError:
                pass
        if expected is not type(value):
            raise AiaynError(
                f"{where}.{name}: expected {expected.__name__}, got {value!r} ({type(value).__name__})"
            )
        kwargs[name] = value
    return dataclasses.replace(default, **kwargs)


def preset_path(name: str) -> Path | None:
    """The preset ``name`` (demo, tiny, bible-60, small, base, ...): configs/*.yaml of a
    checkout, or the copy an installed wheel carries in aiayn/presets/."""
    if not name or any(c in name for c in "/\\.:"):
        return None
    package = Path(__file__).resolve().parent
    for folder in (package / "presets", package.parents[1] / "configs"):
        if (folder / f"{name}.yaml").is_file():
            return folder / f"{name}.yaml"
    return None


def preset_names() -> list[str]:
    package = Path(__file__).resolve().parent
    for folder in (package / "presets", package.parents[1] / "configs"):
        if folder.is_dir():
            return sorted(p.stem for p in folder.glob("*.yaml"))
    return []


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read a YAML (or JSON) config file, or a preset by name (``preset_path``: ``demo``
    where there is no configs/ folder, as after ``pip install``), apply overrides, validate."""
    path = Path(path)
    if not path.is_file() and preset_path(str(path)) is not None:
        path = preset_path(str(path))
    if not path.is_file():
        presets = ", ".join(preset_names())
        raise AiaynError(f"config file not found: {path}"
                         + (f" (or give a preset by name: {presets})" if presets else ""))
    try:
        text = path.read_text(encoding="utf-8")
        raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AiaynError(f"{path}: not a valid config file ({str(exc).splitlines()[0]})") from None
    if raw is None:
        raise AiaynError(f"{path}: the config file is empty; give at least one of its sections "
                         f"({', '.join(SECTIONS)}), e.g. copy configs/demo.yaml")
    config = Config.from_dict(raw, str(path))
    if overrides:
        config = config.override(overrides)
    return validate_given(config, str(path), overrides or [])


def validate_given(config: Config, source: str, overrides: list[str]) -> Config:
    """``config.validate(source)``, where ``config`` is ``source``'s settings with
    ``overrides`` (``--set KEY=VALUE``) applied: a value refused because of a setting an
    override gave is blamed on that ``--set``, not on the file, which may not hold it."""
    try:
        return config.validate(source)
    except AiaynError as exc:
        message = str(exc)
        given = [item for item in overrides if re.search(
            rf"(?<![\w.]){re.escape(item.partition('=')[0].strip())}(?![\w])", message)]
        if not given or not message.startswith(f"{source}: "):
            raise
        blamed = ", ".join(f"--set {item}" for item in given)
        raise AiaynError(f"{blamed}: {message.removeprefix(f'{source}: ')}") from None


def save_config(config: Config, path: str | Path) -> None:
    """Write the config as YAML (``.yaml``) or JSON (``.json``), atomically."""
    path = Path(path)
    if path.suffix == ".json":
        text = json.dumps(config.to_dict(), indent=2) + "\n"
    else:
        text = yaml.safe_dump(config.to_dict(), sort_keys=False)
    atomic_write_text(path, text)
