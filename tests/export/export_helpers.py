"""What the export tests share (tests/export/): random run directories with every weight
perturbed, a trained run of two directions (``tagged_run``), Transformers' loading code as
a user writes it, and one-line errors. Hub access stays off: every load reads the local
directory."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it

import random
from importlib.util import find_spec
from pathlib import Path

import helpers
import pytest
import torch
from helpers import random_sentence

from aiayn.config import Config, DataConfig, ModelConfig, load_config, save_config
from aiayn.data.batching import pad
from aiayn.data.tokenizer import train_tokenizers
from aiayn.model import Transformer
from aiayn.runs.checkpoint import save_weights
from aiayn.runs.directory import load_run

needs_hf = pytest.mark.skipif(find_spec("transformers") is None,
                              reason="pip install 'aiayn[export]'")
needs_ct2 = pytest.mark.skipif(find_spec("ctranslate2") is None,
                               reason="pip install 'aiayn[export]'")

TEXTS = ["¡Hola, señor! ¿Cómo estás?", "The Lord is my shepherd.", "red green, blue; sun moon",
         "In the beginning God created the heavens and the earth.", "Él dijo: «Sí.»"]


def random_run(root: Path, name: str, tie: str = "all", norm_first: bool = False,
               joint: bool = True, qk_norm: bool = False, output_vocab: str = "all",
               qk_norm_cross: bool = True, qk_norm_cross_query: str = "heads") -> Path:
    """A run directory holding a random model (every parameter perturbed) and a BPE
    tokenizer over sentences with punctuation and accents."""
    pairs = [(s, s[::-1]) for s in TEXTS] * 4
    data = DataConfig(vocab_size=120, min_frequency=1, joint_vocab=joint)
    tokenizers = train_tokenizers(pairs, data)
    cfg = ModelConfig(src_vocab_size=tokenizers.src_vocab_size,
                      tgt_vocab_size=tokenizers.tgt_vocab_size, d_model=32, n_heads=4,
                      d_ff=48, n_encoder_layers=2, n_decoder_layers=1, dropout=0.1,
                      max_len=64, tie_embeddings=tie, norm_first=norm_first, qk_norm=qk_norm,
                      qk_norm_cross=qk_norm_cross, qk_norm_cross_query=qk_norm_cross_query,
                      output_vocab=output_vocab)
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    if output_vocab == "targets":  # as aiayn train: the target side's pieces and [EOS]
        seen = {i for ids in tokenizers.encode_tgt([t for _, t in pairs]) for i in ids[1:]}
        model.generator.set_outputs(torch.tensor(sorted(seen)))
    run = root / name
    run.mkdir()
    save_config(Config(model=cfg, data=data).validate(), run / "config.yaml")
    tokenizers.save(run / "tokenizer")
    save_weights(model, run / "best.safetensors")
    return run


LANGUAGES = ("es", "fr")  # tagged_run's target languages: es copies, fr reverses the words
SENTENCES = [random_sentence(random.Random(i)) for i in range(12)]  # what it translates


def tagged_run(root: Path) -> Path:
    """helpers.tagged_run with a BPE tokenizer (TEXTS split into pieces), trained about
    twenty seconds, until it copies random sentences into es and reverses their words into
    fr (all of 200 unseen ones on one thread; 400 steps got two thirds)."""
    rng = random.Random(0)
    corpora = {}
    for lang in LANGUAGES:
        sentences = [random_sentence(rng) for _ in range(1000)]
        targets = [s if lang == "es" else " ".join(reversed(s.split())) for s in sentences]
        corpora[lang] = root / f"{lang}.tsv"
        corpora[lang].write_text("".join(f"{s}\t{t}\n" for s, t in zip(sentences, targets)),
                                 encoding="utf-8")
    return helpers.tagged_run(root, corpora, DataConfig(vocab_size=120, min_frequency=1),
                              steps=1200, max_len=32, n_encoder_layers=2, tie_embeddings="decoder")


def teacher_forced(run: Path):
    """aiayn's model, its tokenizers, and a padded batch of TEXTS."""
    _, model, tokenizers = load_run(run)
    src = pad(tokenizers.encode_src(TEXTS))
    tgt = pad(tokenizers.encode_tgt([t[::-1] for t in TEXTS]))
    return model, tokenizers, src, tgt


def load_hf(out: Path, remote_code: bool = False):
    """The loading code a user writes; ``remote_code``: trust the folder's own model code."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    model = AutoModelForSeq2SeqLM.from_pretrained(out, local_files_only=True,
                                                  trust_remote_code=remote_code).eval()
    return model, AutoTokenizer.from_pretrained(out, local_files_only=True,
                                                trust_remote_code=remote_code)


def preset_switches(path: Path) -> dict:
    """The architecture switches of a preset in configs/, for a tiny model built alike."""
    cfg = load_config(path).model
    return {"tie": cfg.tie_embeddings, "norm_first": cfg.norm_first, "qk_norm": cfg.qk_norm,
            "qk_norm_cross": cfg.qk_norm_cross, "qk_norm_cross_query": cfg.qk_norm_cross_query,
            "output_vocab": cfg.output_vocab}


PRESETS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def strip_all(rows: list[list[int]]) -> list[list[int]]:
    return [strip(row) for row in rows]


def strip(row: list[int]) -> list[int]:
    """Generated ids without the start token, the end token and padding."""
    ids = row[1:]
    return ids[: ids.index(3)] if 3 in ids else [i for i in ids if i != 0]


def one_line_error(code: int, err: str, *words: str) -> bool:
    return (code == 2 and err.startswith("aiayn: error: ") and err.count("\n") == 1
            and all(w in err for w in words))
