"""aiayn side by side with its peers, JoeyNMT 2.3.0 and OpenNMT-py 3.5.1: all three train on
the same prepared split for the same minutes with the closest recipe to configs/demo.yaml,
decode the test split with the same search, and are scored by the same function.

    benchmarks/peers/setup.sh                 # the peers' virtual environments, once
    .venv/bin/python benchmarks/peers/run.py --minutes 12 --data data/bible-eng-spa \\
        --out benchmarks/results/peers/

Per toolkit: write its config, train for exactly the budget (counted from its first
update), count updates and real target tokens, decode the test split (beam 4, alpha 0.6)
timing the command, score the detokenised output against test.jsonl's references with
sacreBLEU (BLEU and chrF, defaults), add a row to OUT/results.json and rewrite
OUT/table.md. A toolkit that fails gets a one-line error and a failed row; the others go on.
What differs between the three recipes: benchmarks/peers/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import unicodedata
from dataclasses import asdict, dataclass, field
from pathlib import Path

import sacrebleu
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TOOLKITS = ("joeynmt", "opennmt", "aiayn", "aiayn-fp32")
DEFAULT_TOOLKITS = "joeynmt,opennmt,aiayn"
# aiayn-fp32: aiayn with bf16 autocast off (configs/demo.yaml says bf16: auto, which takes
# bf16 where this CPU runs it faster; both peers train in fp32 on a CPU).
AIAYN_OVERRIDES = {"aiayn": [], "aiayn-fp32": ["train.bf16=false"]}
VENV_OF = {"joeynmt": "joeynmt", "opennmt": "opennmt"}
SRC, TGT = "src", "tgt"  # suffixes of the exported text files
SPM_SPECIALS = ("<unk>", "<pad>", "<s>", "</s>")  # ids 0-3 of the SentencePiece model
# The lines after which a peer's first update begins; its budget is counted from there.
FIRST_UPDATE_MARK = {"joeynmt": "EPOCH 1", "opennmt": "PEERS-FIRST-UPDATE"}
TOTALS_MARK = "PEERS-TOTALS"  # printed by in_venv.py onmt-train, as the line above
STARTUP_LIMIT_S = 1800  # a peer that has not begun training by then has failed
SHUTDOWN_LIMIT_S = 600  # for the final checkpoint after the stop signal
HUGE = 100_000_000  # "never": steps, epochs, validation intervals


class PeerError(Exception):
    """A toolkit failed; the message is one line."""


@dataclass(frozen=True)
class Recipe:
    """The settings of configs/demo.yaml that the peers' configs are written from."""

    d_model: int = 256
    n_heads: int = 4
    d_ff: int = 512
    encoder_layers: int = 2
    decoder_layers: int = 2
    dropout: float = 0.0
    label_smoothing: float = 0.0
    max_tokens: int = 1024
    warmup_steps: int = 200
    peak_lr: float = 2.5e-3
    adam_betas: tuple[float, float] = (0.9, 0.98)
    clip_norm: float = 1.0
    vocab_size: int = 8000  # of each vocabulary
    joint_vocab: bool = True  # one vocabulary for both sides, all embeddings tied; else two,
    # the target embedding tied to the output projection (aiayn's tie_embeddings: decoder)
    seed: int = 1
    beam: int = 4
    alpha: float = 0.6
    decode_max_tokens: int = 8192  # aiayn evaluate's batch budget: padded source tokens x beam

    @property
    def decode_batch_tokens(self) -> int:
        """The peers count a decoding batch in source tokens, without the beam."""
        return self.decode_max_tokens // self.beam


def recipe_from_config(path: Path, sets: list[str] | None = None) -> Recipe:
    """The recipe of aiayn's config at ``path`` with ``sets`` (``--set`` overrides) applied.
    The demo's "auto" dropout and label smoothing are 0 here: what aiayn chooses for the
    ~2 passes of 12 minutes on a 2-core CPU, where the peers are compared (``--set`` them for
    a longer budget)."""
    from aiayn.config import load_config, rate

    c = load_config(path, sets or [])
    m, d, t = c.model, c.data, c.train
    return Recipe(d_model=m.d_model, n_heads=m.n_heads, d_ff=m.d_ff,
                  encoder_layers=m.n_encoder_layers, decoder_layers=m.n_decoder_layers,
                  dropout=rate(m.dropout), label_smoothing=rate(t.label_smoothing), max_tokens=t.max_tokens,
                  warmup_steps=t.warmup_steps, peak_lr=t.peak_lr,
                  adam_betas=(t.adam_beta1, t.adam_beta2), clip_norm=t.clip_norm,
                  vocab_size=d.vocab_size, joint_vocab=d.joint_vocab, seed=t.seed)


# ---------------------------------------------------------------- data for the peers
def read_pairs(path: Path) -> list[tuple[str, str]]:
    with path.open(encoding="utf-8") as f:
        return [(r["src"], r["tgt"]) for r in map(json.loads, f)]


def export_split(pairs: list[tuple[str, str]], prefix: Path) -> None:
    """PREFIX.src and PREFIX.tgt, one NFC sentence a line (aiayn's tokenizer applies NFC)."""
    for side, suffix in enumerate((SRC, TGT)):
        lines = [unicodedata.normalize("NFC", pair[side]) for pair in pairs]
        bad = [i for i, line in enumerate(lines) if not line.strip() or len(line.splitlines()) != 1]
        if bad:
            raise PeerError(f"{prefix}.{suffix}: sentence {bad[0]} is empty or spans lines")
        Path(f"{prefix}.{suffix}").write_text("".join(s + "\n" for s in lines), encoding="utf-8")


def vocab_pieces(spm_vocab: Path) -> list[str]:
    """The pieces of a SentencePiece .vocab file (piece TAB score), specials left out: each
    peer puts its own specials first."""
    pieces = [line.split("\t")[0] for line in spm_vocab.read_text(encoding="utf-8").splitlines()]
    return [p for p in pieces if p not in SPM_SPECIALS]


# ---------------------------------------------------------------- configs
def joey_config(r: Recipe, data: Path, model_dir: Path, vocabs: dict[str, Path],
                spm_models: dict[str, Path], decode: bool = False) -> dict:
    """JoeyNMT 2.3.0 config. ``vocabs``, ``spm_models``: the vocabulary file and the
    SentencePiece model of each side (SRC, TGT; the same files for a joint vocabulary).
    ``decode``: for `joeynmt test` of the test split only (no dev set, so that only the test
    split is translated)."""

    def side(lang: str) -> dict:
        return {"lang": lang, "level": "bpe", "voc_file": str(vocabs[lang]),
                "tokenizer_type": "sentencepiece",
                "tokenizer_cfg": {"model_file": str(spm_models[lang])}, "lowercase": False,
                "normalize": False}
    stack = {"type": "transformer", "num_layers": None, "num_heads": r.n_heads,
             "embeddings": {"embedding_dim": r.d_model, "scale": True, "dropout": r.dropout},
             "hidden_size": r.d_model, "ff_size": r.d_ff, "dropout": r.dropout,
             "layer_norm": "pre", "activation": "relu"}
    data_cfg = {"train": str(data / "train"), "dev": str(data / "dev"),
                "test": str(data / "test"), "dataset_type": "plain",
                "src": side(SRC), "trg": side(TGT)}
    testing = {"beam_size": r.beam, "beam_alpha": r.alpha,
               "batch_size": r.decode_batch_tokens, "batch_type": "token",
               "eval_metrics": ["bleu", "chrf"], "sacrebleu_cfg": {"tokenize": "13a"}}
    if decode:
        del data_cfg["train"], data_cfg["dev"]
        testing["load_model"] = str(model_dir / "latest.ckpt")
    return {
        "name": "peers-joeynmt",
        "model_dir": str(model_dir),
        "use_cuda": False,
        "random_seed": r.seed,
        "data": data_cfg,
        "training": {
            "optimizer": "adam", "adam_betas": list(r.adam_betas),
            # Noam, scaled to peak at r.peak_lr, as OpenNMT-py's. (JoeyNMT 2.3.0's
            # "warmupinversesquareroot" cannot: its TrainConfig drops learning_rate_peak,
            # so that schedule peaks at learning_rate, which here is the first update's rate.)
            "scheduling": "noam", "learning_rate_factor": noam_scale(r),
            "learning_rate_warmup": r.warmup_steps,
            # the first update runs at this rate, before the scheduler first sets one
            "learning_rate": r.peak_lr / r.warmup_steps,
            "learning_rate_min": 1.0e-8,  # not read by noam; a floor for the other schedules
            "clip_grad_norm": r.clip_norm, "weight_decay": 0.0,
            "loss": "crossentropy", "label_smoothing": r.label_smoothing,
            "normalization": "tokens",
            "batch_size": r.max_tokens, "batch_type": "token", "batch_multiplier": 1,
            "shuffle": True, "epochs": HUGE, "updates": HUGE,
            "logging_freq": 100, "validation_freq": HUGE, "keep_best_ckpts": 1,
            "early_stopping_metric": "loss", "overwrite": True, "num_workers": 0,
        },
        "testing": testing,
        "model": {
            "initializer": "xavier_uniform", "init_gain": 1.0, "bias_initializer": "zeros",
            "embed_initializer": "normal", "embed_init_weight": r.d_model**-0.5,
            "tied_embeddings": r.joint_vocab, "tied_softmax": True,
            "encoder": {**stack, "num_layers": r.encoder_layers},
            "decoder": {**stack, "num_layers": r.decoder_layers},
        },
    }


def noam_scale(r: Recipe) -> float:
    """OpenNMT's learning_rate for decay_method noam, lr = scale * d^-0.5 *
    min(step^-0.5, step * warmup^-1.5), that peaks at r.peak_lr on step r.warmup_steps."""
    return r.peak_lr * (r.d_model * r.warmup_steps) ** 0.5


def onmt_config(r: Recipe, data: Path, run_dir: Path, vocabs: dict[str, Path],
                spm_models: dict[str, Path], n_train: int) -> dict:
    """OpenNMT-py 3.5.1 training config (onmt_train -config). Its bucket (the examples it
    reads, transforms and sorts by length before cutting batches) is one epoch, ``n_train``
    examples: the default, 262,144, would read and tokenise train ~9 times before its
    first update, and sort the same as one epoch does."""
    return {
        "save_data": str(run_dir / "data"),
        "src_vocab": str(vocabs[SRC]), "tgt_vocab": str(vocabs[TGT]),
        "share_vocab": r.joint_vocab,
        "src_vocab_size": r.vocab_size, "tgt_vocab_size": r.vocab_size,
        "data": {"corpus_1": {"path_src": str(data / f"train.{SRC}"),
                              "path_tgt": str(data / f"train.{TGT}"),
                              "transforms": ["sentencepiece"], "weight": 1}},
        "bucket_size": n_train,
        "src_subword_model": str(spm_models[SRC]), "tgt_subword_model": str(spm_models[TGT]),
        "src_subword_nbest": 1, "src_subword_alpha": 0.0,
        "tgt_subword_nbest": 1, "tgt_subword_alpha": 0.0,
        "save_model": str(run_dir / "model"),
        "save_checkpoint_steps": 0,  # only the final save (in_venv.py stops the loop)
        "log_file": str(run_dir / "train.log"),
        "seed": r.seed, "world_size": 1, "gpu_ranks": [], "num_workers": 0,
        "train_steps": HUGE, "valid_steps": HUGE, "report_every": 100,
        "model_task": "seq2seq", "model_dtype": "fp32",
        "encoder_type": "transformer", "decoder_type": "transformer",
        "enc_layers": r.encoder_layers, "dec_layers": r.decoder_layers, "heads": r.n_heads,
        "hidden_size": r.d_model, "word_vec_size": r.d_model, "transformer_ff": r.d_ff,
        "position_encoding": True, "max_relative_positions": 0,
        "pos_ffn_activation_fn": "relu", "layer_norm": "standard", "norm_eps": 1e-5,
        "add_qkvbias": True, "add_ffnbias": True,
        "share_embeddings": r.joint_vocab, "share_decoder_embeddings": True,
        "dropout": [r.dropout], "attention_dropout": [r.dropout], "dropout_steps": [0],
        "param_init": 0.0, "param_init_glorot": True,
        "optim": "adam", "adam_beta1": r.adam_betas[0], "adam_beta2": r.adam_betas[1],
        "learning_rate": noam_scale(r), "decay_method": "noam", "warmup_steps": r.warmup_steps,
        "max_grad_norm": r.clip_norm, "label_smoothing": r.label_smoothing,
        "batch_type": "tokens", "batch_size": r.max_tokens, "batch_size_multiple": 1,
        "normalization": "tokens", "accum_count": [1], "accum_steps": [0],
    }


def onmt_translate_args(r: Recipe, checkpoint: Path, src: Path, output: Path,
                        spm_models: dict[str, Path]) -> list[str]:
    return ["-model", str(checkpoint), "-src", str(src), "-output", str(output),
            "-beam_size", str(r.beam), "-length_penalty", "wu", "-alpha", str(r.alpha),
            "-max_length", "256", "-max_length_ratio", "1.5",
            "-batch_size", str(r.decode_batch_tokens), "-batch_type", "tokens",
            "-transforms", "sentencepiece", "-src_subword_model", str(spm_models[SRC]),
            "-tgt_subword_model", str(spm_models[TGT]), "-gpu", "-1", "-report_time"]


# ---------------------------------------------------------------- logs
def find_mark(text: str, mark: str) -> dict | None:
    """The JSON after the last ``mark`` in ``text``."""
    lines = [line for line in text.splitlines() if line.startswith(mark)]
    return json.loads(lines[-1][len(mark):]) if lines else None


def number_after(text: str, prefix: str) -> float | None:
    """The number right after the last ``prefix`` in ``text`` (e.g. "Generation took ")."""
    at = text.rfind(prefix)
    if at < 0:
        return None
    digits = ""
    for ch in text[at + len(prefix):].lstrip():
        if not (ch.isdigit() or ch == "."):
            break
        digits += ch
    return float(digits) if digits else None


def last_lines(path: Path, n: int = 3) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    return " | ".join(lines[-n:])[-400:]


# ---------------------------------------------------------------- processes
def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               PYTHONUNBUFFERED="1",
               # torch >= 2.6 loads weights only by default; both peers pickle their options
               TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
    return env


def run_command(cmd: list[str], log: Path, env: dict[str, str], what: str) -> float:
    """Run to the end with stdout+stderr in ``log``; returns its wall-clock seconds."""
    began = time.perf_counter()
    with log.open("w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
    if rc != 0:
        raise PeerError(f"{what} exited with status {rc}: {last_lines(log)} (log: {log})")
    return time.perf_counter() - began


def train_for(cmd: list[str], log: Path, env: dict[str, str], mark: str, seconds: float,
              stop_signal: int) -> dict:
    """Start ``cmd``; when ``mark`` appears in its output (its first update is next), let it
    train ``seconds``, then send ``stop_signal`` and wait for it to save and exit.
    Returns the startup and training seconds and the time it took to stop."""
    began = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                preexec_fn=default_sigint)
        try:
            first_update = wait_for_mark(proc, log, mark, began)
            deadline = first_update + seconds
            while proc.poll() is None and time.perf_counter() < deadline:
                time.sleep(min(0.05, max(0.0, deadline - time.perf_counter())))
            if proc.poll() is not None:
                raise PeerError(f"stopped by itself after {time.perf_counter() - first_update:.0f} s "
                                f"of training: {last_lines(log)} (log: {log})")
            proc.send_signal(stop_signal)
            stopped = time.perf_counter()
            rc = proc.wait(timeout=SHUTDOWN_LIMIT_S)
        except BaseException:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            raise
    if rc != 0:
        raise PeerError(f"exited with status {rc} after the stop signal: {last_lines(log)} (log: {log})")
    return {"startup_s": first_update - began, "train_s": stopped - first_update,
            "stop_to_exit_s": time.perf_counter() - stopped}


def default_sigint() -> None:
    """In the child before it starts: SIGINT back to its default. A shell starts background
    jobs with SIGINT ignored, and a Python that starts so ignores it too (no
    KeyboardInterrupt), which would leave JoeyNMT running past its budget."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for_mark(proc: subprocess.Popen, log: Path, mark: str, began: float) -> float:
    """The time ``mark`` first appears in ``log``, read as it grows."""
    with log.open(errors="replace") as f:
        seen = ""
        while True:
            chunk = f.read()
            seen = seen[-len(mark):] + chunk if chunk else seen
            if mark in seen:
                return time.perf_counter()
            if proc.poll() is not None:
                raise PeerError(f"exited (status {proc.returncode}) before training: "
                                f"{last_lines(log)} (log: {log})")
            if time.perf_counter() - began > STARTUP_LIMIT_S:
                raise PeerError(f"had not started training after {STARTUP_LIMIT_S} s (log: {log})")
            time.sleep(0.05)


# ---------------------------------------------------------------- scoring
def score(hypotheses: list[str], references: list[str]) -> dict:
    """sacreBLEU corpus BLEU and chrF with their defaults (13a tokenisation), as aiayn scores."""
    if len(hypotheses) != len(references):
        raise PeerError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    return {"bleu": bleu.corpus_score(hypotheses, [references]).score,
            "chrf": chrf.corpus_score(hypotheses, [references]).score,
            "bleu_signature": str(bleu.get_signature()),
            "chrf_signature": str(chrf.get_signature())}


def read_lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n")[:-1]


# ---------------------------------------------------------------- the toolkits
@dataclass
class Setup:
    recipe: Recipe
    data: Path  # aiayn's prepared directory
    text: Path  # the exported plain text and the SentencePiece model
    out: Path
    venvs: Path
    minutes: float
    threads: int
    aiayn_config: Path
    aiayn_weights: str
    test_limit: int  # decode only the first N test sentences (0: all), for smoke runs
    epoch_tokens: dict  # target tokens of one pass over train: {"aiayn", "sentencepiece"}
    config_sets: list[str] = field(default_factory=list)  # --set overrides of aiayn_config

    def _per_side(self, stem: str, suffix: str) -> dict[str, Path]:
        if self.recipe.joint_vocab:
            return {SRC: self.text / f"{stem}{suffix}", TGT: self.text / f"{stem}{suffix}"}
        return {side: self.text / f"{stem}.{side}{suffix}" for side in (SRC, TGT)}

    @property
    def spm_models(self) -> dict[str, Path]:
        """The SentencePiece model of each side (one file for a joint vocabulary)."""
        return self._per_side("spm", ".model")

    @property
    def vocabs(self) -> dict[str, Path]:
        """The peers' vocabulary file of each side (pieces without the specials)."""
        return self._per_side("vocab", ".txt")

    def python(self, toolkit: str) -> Path:
        return self.venvs / VENV_OF[toolkit] / "bin" / "python"

    def env(self) -> dict[str, str]:
        return child_env(self.threads)


def prepare_text(s: Setup, toolkits: list[str]) -> int:
    """Export the splits for the peers and train SentencePiece BPE on train (one joint model
    on both sides, or one per side, as the recipe's vocabulary); returns the target tokens of
    one epoch in its pieces (with EOS)."""
    s.text.mkdir(parents=True, exist_ok=True)
    for split in ("train", "dev", "test"):
        pairs = read_pairs(s.data / f"{split}.jsonl")
        if split == "test" and s.test_limit:
            pairs = pairs[:s.test_limit]
        export_split(pairs, s.text / split)
    venv = next((t for t in toolkits if s.python(t).exists()), None)
    if venv is None:
        raise PeerError(f"no virtual environment of {', '.join(toolkits)} in {s.venvs}: "
                        "run benchmarks/peers/setup.sh")
    trainings = ({SRC: [SRC, TGT]} if s.recipe.joint_vocab else {SRC: [SRC], TGT: [TGT]})
    for side, texts in trainings.items():
        prefix = str(s.spm_models[side]).removesuffix(".model")  # spm or spm.SIDE
        run_command([str(s.python(venv)), str(HERE / "in_venv.py"), "spm-train",
                     "--prefix", prefix, "--vocab-size", str(s.recipe.vocab_size),
                     "--threads", str(s.threads), *(str(s.text / f"train.{t}") for t in texts)],
                    Path(f"{prefix}.log"), s.env(), "SentencePiece training")
        pieces = vocab_pieces(Path(f"{prefix}.vocab"))
        s.vocabs[side].write_text("".join(p + "\n" for p in pieces), encoding="utf-8")
    count_log = s.text / "count.log"
    run_command([str(s.python(venv)), str(HERE / "in_venv.py"), "spm-count", str(s.spm_models[TGT]),
                 str(s.text / f"train.{TGT}")], count_log, s.env(), "counting train tokens")
    return int(read_lines(count_log)[-1])


def aiayn_epoch_tokens(data: Path) -> int | None:
    """Target tokens of one epoch in aiayn's tokens (with EOS), from prepare's stats.json."""
    try:
        stats = json.loads((data / "stats.json").read_text())
        return stats["tokens"]["train"]["tgt"] + stats["splits"]["train"]
    except (OSError, ValueError, KeyError):
        return None


def check_venv(s: Setup, toolkit: str) -> None:
    if not s.python(toolkit).exists():
        raise PeerError(f"no virtual environment at {s.python(toolkit).parent.parent}: "
                        "run benchmarks/peers/setup.sh")


def run_joeynmt(s: Setup, work: Path) -> dict:
    check_venv(s, "joeynmt")
    r, py = s.recipe, str(s.python("joeynmt"))
    model_dir = work / "model"
    args = (r, s.text, model_dir, s.vocabs, s.spm_models)
    (work / "train.yaml").write_text(yaml.safe_dump(joey_config(*args)), encoding="utf-8")
    (work / "test.yaml").write_text(yaml.safe_dump(joey_config(*args, decode=True)), encoding="utf-8")
    timing = train_for([py, "-m", "joeynmt", "train", str(work / "train.yaml"), "--skip-test"],
                       work / "train.out", s.env(), FIRST_UPDATE_MARK["joeynmt"],
                       60 * s.minutes, signal.SIGINT)
    counts_log = work / "stats.out"
    run_command([py, str(HERE / "in_venv.py"), "joey-stats", str(model_dir / "latest.ckpt")],
                counts_log, s.env(), "reading the checkpoint")
    counts = json.loads(read_lines(counts_log)[-1])
    decode_s = run_command([py, "-m", "joeynmt", "test", str(work / "test.yaml"),
                            "-o", str(work / "hyp")], work / "test.out", s.env(), "joeynmt test")
    search_s = number_after((work / "test.out").read_text(errors="replace"), "Generation took")
    return {**counts, **timing, "decode_s": decode_s, "search_s": search_s,
            "hypotheses": str(work / "hyp.test"), "weights": "last (latest.ckpt)"}


def run_opennmt(s: Setup, work: Path) -> dict:
    check_venv(s, "opennmt")
    r, py = s.recipe, str(s.python("opennmt"))
    n_train = len(read_lines(s.text / f"train.{SRC}"))
    config = onmt_config(r, s.text, work, s.vocabs, s.spm_models, n_train)
    (work / "train.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    timing = train_for([py, str(HERE / "in_venv.py"), "onmt-train", str(work / "train.yaml")],
                       work / "train.out", s.env(), FIRST_UPDATE_MARK["opennmt"],
                       60 * s.minutes, signal.SIGUSR1)
    counts = find_mark((work / "train.out").read_text(errors="replace"), TOTALS_MARK)
    if counts is None:
        raise PeerError(f"no {TOTALS_MARK} line in {work / 'train.out'}")
    checkpoint = work / f"model_step_{counts['updates']}.pt"
    if not checkpoint.is_file():
        raise PeerError(f"no checkpoint {checkpoint}")
    hyp = work / "hyp.test"
    # its own module, not the onmt_translate script, whose first line names the venv's
    # python by the path it was installed at (a moved venv would lose it)
    decode_s = run_command([py, "-m", "onmt.bin.translate", *onmt_translate_args(
        r, checkpoint, s.text / f"test.{SRC}", hyp, s.spm_models)],
        work / "test.out", s.env(), "onmt_translate")
    search_s = number_after((work / "test.out").read_text(errors="replace"),
                            "Total translation time (s):")
    return {**counts, **timing, "decode_s": decode_s, "search_s": search_s,
            "hypotheses": str(hyp), "weights": f"last ({checkpoint.name})"}


def aiayn_precision(train_log: str) -> tuple[str, str]:
    """What `aiayn train` says it chose ("...; precision bf16 (reason); ...", or in logs
    from before train.precision "...; bf16 True (reason); ..."): "fp32", "bf16" or "fp16",
    and the reason it gives."""
    said_as = {"; precision ": {p: p for p in ("fp32", "bf16", "fp16")},
               "; bf16 ": {"True": "bf16", "False": "fp32"}}
    marker = next((m for m in said_as if m in train_log), None)
    if marker is None:
        return "unknown", ""
    said = train_log[train_log.find(marker) + len(marker):].split("; ")[0].strip()
    choice, _, reason = said.partition(" ")
    if reason.startswith("(") and reason.endswith(")"):
        reason = reason[1:-1]
    return said_as[marker].get(choice, "unknown"), reason


def aiayn_counts(records: list[dict]) -> dict:
    """Updates, target tokens and training seconds from a run's metrics.jsonl records, and
    the seconds its validations took: those inside the budget (every train.eval_every
    updates) and the final whole-dev one that `aiayn train` adds after it (the last)."""
    last = max(records, key=lambda rec: (rec["step"], rec["elapsed_s"]))
    dev = [rec.get("eval_s", 0.0) for rec in records if rec["kind"] == "dev"]
    return {"updates": last["step"], "target_tokens": last["tokens"], "train_s": last["elapsed_s"],
            "validation_s": sum(dev[:-1]), "final_validation_s": dev[-1] if dev else None}


def run_aiayn(s: Setup, work: Path, overrides: list[str]) -> dict:
    run_dir = work / "run"
    aiayn = [sys.executable, "-m", "aiayn"]
    sets = [f"train.cpu_threads={s.threads}", *s.config_sets, *overrides]
    train_s = run_command([*aiayn, "train", "--config", str(s.aiayn_config), "--data", str(s.data),
                           "--out", str(run_dir), "--max-minutes", str(s.minutes),
                           *[arg for item in sets for arg in ("--set", item)]],
                          work / "train.out", s.env(), "aiayn train")
    counts = aiayn_counts([json.loads(line) for line in read_lines(run_dir / "metrics.jsonl")])
    hyp = work / "hyp.test"
    decode_s = run_command([*aiayn, "evaluate", str(run_dir), "--split", "test",
                            "--weights", s.aiayn_weights, "--beam", str(s.recipe.beam),
                            "--alpha", str(s.recipe.alpha), "-o", str(hyp),
                            "--limit", str(s.test_limit)],
                           work / "test.out", s.env(), "aiayn evaluate")
    summary = json.loads(hyp.with_suffix(".json").read_text())
    precision, why = aiayn_precision((work / "train.out").read_text(errors="replace"))
    return {**counts, "command_s": train_s, "decode_s": decode_s, "search_s": summary["seconds"],
            "hypotheses": str(hyp), "weights": s.aiayn_weights,
            "precision": precision, "precision_reason": why, "overrides": sets}


def run_toolkit(s: Setup, toolkit: str, references: list[str]) -> dict:
    work = s.out / toolkit
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    if toolkit in AIAYN_OVERRIDES:
        row = run_aiayn(s, work, AIAYN_OVERRIDES[toolkit])
    else:
        row = {"joeynmt": run_joeynmt, "opennmt": run_opennmt}[toolkit](s, work)
        row["precision"] = "fp32"
    row.update(score(read_lines(Path(row["hypotheses"])), references))
    row["tokens_per_s"] = row["target_tokens"] / row["train_s"]
    epoch = s.epoch_tokens.get("aiayn" if toolkit in AIAYN_OVERRIDES else "sentencepiece")
    row["epochs"] = row["target_tokens"] / epoch if epoch else None
    return row


# ---------------------------------------------------------------- results
def results_table(rows: list[dict], minutes: float, test_limit: int = 0) -> str:
    split = f"The first {test_limit} sentences of the test split" if test_limit else "Test split"
    lines = [f"{split}, {minutes:g} training minutes each (from the first update), "
             "beam 4, alpha 0.6, sacreBLEU on detokenised output.", "",
             "| toolkit | updates | target tokens | tokens/s | test BLEU | chrF | decode seconds |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        if "error" in row:
            error = row["error"][:200].replace("|", "/")
            lines.append(f"| {row['toolkit']} | failed: {error} | | | | | |")
            continue
        lines.append(f"| {row['toolkit']} | {row['updates']:,} | {row['target_tokens']:,} | "
                     f"{row['tokens_per_s']:,.0f} | {row['bleu']:.2f} | {row['chrf']:.2f} | "
                     f"{row['decode_s']:.1f} |")
    lines += ["", "Details: tokens are real target tokens (EOS included) in each toolkit's own "
              "pieces; epochs = those over one pass of train in the same pieces; decode seconds "
              "= the whole decoding command (start-up and model loading included), search = the "
              "toolkit's own timing of the search; startup = from the command to the first "
              "update (outside the budget).", "",
              "| toolkit | precision | tokens/update | epochs | search seconds | startup seconds "
              "| decodes |",
              "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for row in rows:
        if "error" not in row:
            lines.append(
                f"| {row['toolkit']} | {row['precision']} | "
                f"{row['target_tokens'] / max(row['updates'], 1):,.0f} | "
                f"{_maybe(row.get('epochs'), '.2f')} | {_maybe(row.get('search_s'), '.1f')} | "
                f"{_maybe(row.get('startup_s'), '.0f')} | {row['weights']} |")
    return "\n".join(lines) + "\n"


def _maybe(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def load_rows(path: Path, meta: dict) -> list[dict]:
    """Rows of an earlier results.json with the same budget, data, test sentences and --set
    overrides (a rerun of one toolkit keeps the others); none otherwise."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    old.setdefault("config_sets", [])  # a results.json without the key has no overrides
    if any(old.get(key) != meta[key] for key in ("minutes", "data", "test_limit", "config_sets")):
        return []
    return old.get("rows", [])


def installed_versions(venvs: Path) -> dict[str, list[str]]:
    """Key lines of each venv's `pip freeze` (setup.sh wrote them)."""
    keys = ("torch==", "joeynmt==", "opennmt-py==", "sentencepiece==", "sacrebleu==",
            "ctranslate2==", "pyonmttok==", "numpy==")
    versions = {}
    for freeze in sorted(venvs.glob("*.freeze.txt")):
        lines = freeze.read_text().splitlines()
        versions[freeze.name.removesuffix(".freeze.txt")] = [
            line for line in lines if line.lower().startswith(keys)]
    return versions


def write_results(out: Path, meta: dict, rows: list[dict]) -> None:
    order = {t: i for i, t in enumerate(TOOLKITS)}
    rows = sorted(rows, key=lambda row: order.get(row["toolkit"], len(order)))
    (out / "results.json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    (out / "table.md").write_text(results_table(rows, meta["minutes"], meta["test_limit"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=12.0, help="training budget of each toolkit")
    p.add_argument("--only", default=DEFAULT_TOOLKITS,
                   help=f"comma-separated, some of {', '.join(TOOLKITS)} (default {DEFAULT_TOOLKITS})")
    p.add_argument("--data", type=Path, default=REPO / "data/bible-eng-spa",
                   help="aiayn's prepared directory (aiayn prepare --corpus bible:eng-spa ...)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/peers")
    p.add_argument("--config", type=Path, default=REPO / "configs/demo.yaml",
                   help="aiayn's config; the peers' recipes are written from it")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting of --config for all toolkits, as aiayn train "
                        "--set does (repeatable), e.g. train.peak_lr=1.5e-3")
    p.add_argument("--venvs", type=Path, default=HERE / ".venvs")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--aiayn-weights", default="last",
                   help="weights aiayn decodes: last (as the peers) or best")
    p.add_argument("--test-limit", type=int, default=0,
                   help="decode only the first N test sentences (0: all; for smoke runs)")
    args = p.parse_args(argv)
    toolkits = [t.strip() for t in args.only.split(",") if t.strip()]
    unknown = sorted(set(toolkits) - set(TOOLKITS))
    if unknown or not toolkits:
        p.error(f"--only takes some of {', '.join(TOOLKITS)}; got {args.only!r}")
    data, out = args.data.resolve(), args.out.resolve()
    from aiayn.errors import AiaynError

    try:  # a bad --config or --set: one line, before anything is written
        recipe = recipe_from_config(args.config, args.sets)
    except AiaynError as exc:
        p.error(str(exc))
    out.mkdir(parents=True, exist_ok=True)
    # table.md and results.json are the results; the rest (checkpoints, text) stays out of git
    (out / ".gitignore").write_text("".join(f"/{name}/\n" for name in ("text", *TOOLKITS)))
    s = Setup(recipe=recipe, data=data, text=out / "text", out=out,
              venvs=args.venvs.resolve(), minutes=args.minutes, threads=args.threads,
              aiayn_config=args.config.resolve(), aiayn_weights=args.aiayn_weights,
              test_limit=max(0, args.test_limit), epoch_tokens={"aiayn": aiayn_epoch_tokens(data)},
              config_sets=args.sets)
    references = [tgt for _, tgt in read_pairs(data / "test.jsonl")]
    references = references[:s.test_limit] if s.test_limit else references
    meta = {"minutes": args.minutes, "data": str(data), "test_limit": s.test_limit,
            "threads": args.threads, "config_sets": args.sets,
            "recipe": asdict(s.recipe), "installed": installed_versions(s.venvs),
            "epoch_target_tokens": s.epoch_tokens}
    rows = [row for row in load_rows(out / "results.json", meta) if row["toolkit"] not in toolkits]
    peers = [t for t in toolkits if t in VENV_OF]
    if peers:
        try:
            s.epoch_tokens["sentencepiece"] = prepare_text(s, peers)
        except (PeerError, OSError) as exc:
            for t in peers:
                print(f"{t}: failed: preparing the text: {exc}", file=sys.stderr)
                rows.append({"toolkit": t, "error": f"preparing the text: {exc}"})
            toolkits = [t for t in toolkits if t not in peers]
    for toolkit in toolkits:
        print(f"{toolkit}: training {args.minutes:g} minutes ...", flush=True)
        try:
            row = {"toolkit": toolkit, **run_toolkit(s, toolkit, references)}
            print(f"{toolkit}: {row['updates']} updates, BLEU {row['bleu']:.2f}, "
                  f"chrF {row['chrf']:.2f}, decode {row['decode_s']:.1f} s", flush=True)
        except Exception as exc:  # one line, and the other toolkits still run
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            print(f"{toolkit}: failed: {message}", file=sys.stderr, flush=True)
            row = {"toolkit": toolkit, "error": message}
        rows.append(row)
        write_results(out, meta, rows)
    write_results(out, meta, rows)
    print(f"wrote {out / 'table.md'}")
    return 0 if all("error" not in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
