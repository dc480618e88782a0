"""``aiayn doctor RUN_DIR``: what can silently break a run, checked one piece at a time.

Each check gives one plain line, ``ok`` or ``FAIL`` with what to do about it::

    ok    config      config.yaml: d_model 256, 3+3 layers, vocabulary 8000/8000
    ok    weights     best.safetensors (step 4500), last.safetensors (step 4534), ...: all finite
    FAIL  tokenizer   ... has 7999 tokens but the weights' src embedding has 8000 rows; fix: ...

The checks, in order (a check that needs what an earlier one found missing is skipped):

1. ``config``: RUN_DIR/config.yaml exists and is valid.
2. ``weights``: best/last and the step checkpoints are readable and hold only finite numbers.
3. ``shapes``: every weights file has exactly the tensors and shapes config.yaml describes.
4. ``tokenizer``: RUN_DIR/tokenizer loads, with the special-token ids the model expects
   ([PAD]=0, [UNK]=1, [BOS]=2, [EOS]=3), and its vocabulary sizes are the config's and the
   embeddings' rows.
5. ``data``: the prepared data (``--data``, else data_dir.txt) exists and is encoded with
   the run's tokenizers (the same files, by SHA-256; see aiayn.training.transfer).
6. ``round-trip``: a few dev sentences come back unchanged from encode + decode.
7. ``translate``: three dev sentences translated greedily with the weights, and their BLEU.
8. ``validation``: the validation metrics.jsonl logged for the step best.safetensors holds
   (and for last.safetensors' step, when one was logged there) run again on those weights
   (aiayn.evaluation.evaluate.validate: the same dev pairs and search) gives the logged dev loss and
   BLEU, so the log and the choice of best describe the weights the run kept.
9. ``resume``: train_state.pt loads, names weights that exist, and its optimizer state fits
   the model, so ``aiayn train --resume RUN_DIR`` can continue.

A run that a live ``aiayn train`` holds (aiayn.util.lock) is still being written: the
checks that compare its files with each other (validation, resume) are skipped with a line
naming the holder, and the others run on what is there.

From Python::

    report = aiayn.doctor("runs/s60")          # or aiayn.inspect.doctor.doctor(...)
    print(report)                              # the lines above
    report.ok                                  # True when every check passed

At a little over 500 lines it stays one file: the nine checks run in order, each on what
the ones before it found, and read as one list.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from aiayn.config import Config, load_config
from aiayn.data.prepared import TOKENIZER_DIR, load_prepared, read_split
from aiayn.data.tokenizer import SPECIAL_TOKENS, UNK_ID, Tokenizers, tokenizer_fingerprint
from aiayn.errors import AiaynError
from aiayn.evaluation.evaluate import dev_loss, eval_subset, validate
from aiayn.evaluation.metrics import score
from aiayn.inference.translator import Translator
from aiayn.model import Transformer
from aiayn.runs.checkpoint import (
    STATE_VERSION,
    check_architecture,
    load_state,
    load_train_state,
    read_metadata,
    read_weights,
)
from aiayn.runs.directory import list_step_checkpoints, resolve_weights
from aiayn.runs.metrics import read_metrics
from aiayn.training.transfer import describe_tokenizer
from aiayn.util.lock import in_use

CHECK_NAMES = ("config", "weights", "shapes", "tokenizer", "data", "round-trip", "translate",
               "validation", "resume")
ROUND_TRIP_SENTENCES = 5
# What a live `aiayn train` rewrites under each check that compares files with each other.
BUSY_SKIPS = {"validation": "the weights and metrics.jsonl",
              "resume": "train_state.pt and the step checkpoints"}
# How far a fresh validation of the same weights may land from the logged one. The dev loss
# is a mean over every dev token, and another process may compute it with other kernels than
# the run did: another thread count, the oneDNN output product (aiayn.inference.kernels), a GPU, bf16
# autocast on another CPU. Measured on an AVX2 CPU: 3e-9 relative between those kernels and
# thread counts in fp32, 6e-5 between bf16 autocast and fp32 (a tiny model); weights other
# than the logged ones move it by percents (1-4% where a run logged a stale output layer's
# figures). So 0.1% relative or 0.002 absolute, whichever is larger.
LOSS_TOLERANCE = {"rel_tol": 1e-3, "abs_tol": 2e-3}
# BLEU: the same search (aiayn.evaluation.evaluate.validate decodes in fp32) on the same weights gives
# the same hypotheses, but where two candidates tie within rounding; one hypothesis that
# changes among a validation's 100 sentences moves corpus BLEU by a few tenths at most.
BLEU_TOLERANCE = 0.5
# The tensors whose first dimension is a vocabulary size, by side.
EMBEDDINGS = {"src": ("src_embed.embedding.weight",),
              "tgt": ("tgt_embed.embedding.weight", "generator.proj.weight")}


@dataclass
class Check:
    """One check's outcome: ``ok`` True / False, or None when it could not run."""

    name: str
    ok: bool | None
    detail: str
    fix: str = ""
    notes: list[str] = field(default_factory=list)  # further lines (translations)

    def lines(self) -> list[str]:
        status = {True: "ok", False: "FAIL", None: "skip"}[self.ok]
        fix = f"; fix: {self.fix}" if self.fix and self.ok is False else ""
        detail = _clip(" ".join(self.detail.split()), 400)  # one line, whatever raised
        return [f"{status:<5} {self.name:<11} {detail}{fix}"] + [
            f"{'':17} {note}" for note in self.notes]


@dataclass
class DoctorReport:
    """All checks of one run directory; ``ok`` when none failed."""

    run_dir: Path
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return all(check.ok is not False for check in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [check for check in self.checks if check.ok is False]

    def lines(self) -> list[str]:
        lines = [line for check in self.checks for line in check.lines()]
        verdict = ("all checks passed" if self.ok else
                   f"{len(self.failed)} check(s) failed: "
                   + ", ".join(check.name for check in self.failed))
        return lines + [f"{self.run_dir}: {verdict}"]

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _clip(text: str, width: int = 100) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _same_samples(logged: dict[str, Any], fresh: dict[str, Any]) -> bool:
    """Whether a validation again decoded the dev pairs a logged one did, as far as its
    logged samples (their source and reference; not the hypothesis) show."""
    pairs = [[(s.get("src"), s.get("ref")) for s in r.get("samples", [])] for r in (logged, fresh)]
    return len(pairs[0]) != len(pairs[1]) or pairs[0] == pairs[1]  # train.num_samples changed


class _Skip(Exception):
    """A check that cannot run because an earlier one found its input missing."""


def doctor(run_dir: str | Path, data_dir: str | Path | None = None,
           weights: str | Path = "best", sentences: int = 3) -> DoctorReport:
    """Check a run directory (see the module docstring); never raises for a broken run.

    ``data_dir``: the prepared data to check against (default: the run's data_dir.txt);
    ``weights``: the weights to translate with (best, falling back to last);
    ``sentences``: how many dev sentences to translate."""
    return _Doctor(Path(run_dir), data_dir, weights, sentences).run()


class _Doctor:
    """The checks in order, sharing what the earlier ones loaded."""

    def __init__(self, run_dir: Path, data_dir, weights, sentences: int):
        self.run_dir, self.data_arg, self.weights_arg = run_dir, data_dir, weights
        self.sentences = sentences
        self.config: Config | None = None
        self.tensors: dict[Path, dict[str, torch.Tensor]] = {}  # readable weights files
        self.non_finite: set[Path] = set()  # readable, but holding NaN or infinities
        self.fitting: list[Path] = []  # those whose shapes fit the config
        self.tokenizers: Tokenizers | None = None
        self.data_dir: Path | None = None  # the prepared data, once it proved the run's
        self.dev: list[tuple[str, str]] | None = None

    def run(self) -> DoctorReport:
        checks = [self.check_config()]
        if not self.run_dir.is_dir():  # one failure, not one per missing file
            return DoctorReport(self.run_dir, checks + [
                Check(name, None, "needs the run directory") for name in CHECK_NAMES[1:]])
        methods = (self.check_weights, self.check_shapes, self.check_tokenizer,
                   self.check_data, self.check_round_trip, self.check_translation,
                   self.check_validation, self.check_train_state)
        # A run still training rewrites its weights, log and train state while they are read:
        # what compares them (validation, resume) would report a moving target as broken.
        busy = in_use(self.run_dir)
        for name, method in zip(CHECK_NAMES[1:], methods, strict=True):
            if busy and name in BUSY_SKIPS:
                checks.append(Check(name, None, f"not checked: {self.run_dir} is in use by "
                                    f"{busy}, which rewrites {BUSY_SKIPS[name]} as it trains; "
                                    "run `aiayn doctor` again when it has finished"))
                continue
            try:
                checks.append(method())
            except _Skip as why:
                checks.append(Check(name, None, str(why)))
            except AiaynError as exc:  # anything else a broken file can raise
                checks.append(Check(name, False, str(exc), "see the message"))
        return DoctorReport(self.run_dir, checks)

    def _name(self, path: Path) -> str:
        return str(path.relative_to(self.run_dir)) if path.is_relative_to(self.run_dir) \
            else str(path)

    # ------------------------------------------------------------ 1. config
    def check_config(self) -> Check:
        if not self.run_dir.is_dir():
            return Check("config", False, f"{self.run_dir}: no such directory",
                         "give the directory `aiayn train --out` wrote")
        try:
            self.config = load_config(self.run_dir / "config.yaml")
        except AiaynError as exc:
            return Check("config", False, str(exc),
                         "restore RUN_DIR/config.yaml: the config the run was trained with "
                         "(aiayn train writes it, with the tokenizer's vocabulary sizes)")
        m = self.config.model
        return Check("config", True, f"config.yaml: d_model {m.d_model}, {m.n_heads} heads, "
                     f"d_ff {m.d_ff}, {m.n_encoder_layers}+{m.n_decoder_layers} layers, "
                     f"vocabulary {m.src_vocab_size}/{m.tgt_vocab_size}")

    # ------------------------------------------------------------ 2. weights
    def weight_files(self) -> list[Path]:
        named = [self.run_dir / f"{n}.safetensors" for n in ("best", "last")]
        return [p for p in named if p.is_file()] + list_step_checkpoints(self.run_dir)

    def check_weights(self) -> Check:
        files = self.weight_files()
        if not files:
            return Check("weights", False, "no best.safetensors, last.safetensors or "
                         "checkpoints/step_*.safetensors",
                         "train (or resume) the run until it saves (train.save_every)")
        problems, described = [], []
        for path in files:
            try:
                tensors = read_weights(path)
            except AiaynError as exc:
                problems.append(str(exc))
                continue
            self.tensors[path] = tensors
            bad = {name: int((~torch.isfinite(t)).sum()) for name, t in tensors.items()
                   if t.is_floating_point() and not torch.isfinite(t).all()}
            if bad:
                self.non_finite.add(path)
                first = next(iter(bad))
                problems.append(f"{self._name(path)}: {sum(bad.values())} non-finite values "
                                f"in {len(bad)} tensors (first: {first})")
            described.append(self._name(path))
        if problems:
            return Check("weights", False, "; ".join(problems),
                         "use other weights (--weights last, or a step checkpoint), or "
                         "resume from the last good save with a lower train.lr_scale")
        return Check("weights", True, f"{', '.join(described)}: readable, all finite")

    # ------------------------------------------------------------ 3. shapes
    def check_shapes(self) -> Check:
        if self.config is None or not self.tensors:
            raise _Skip("needs config.yaml and readable weights")
        model = Transformer(self.config.model)
        problems = []
        for path, tensors in self.tensors.items():
            try:
                check_architecture(model, path)  # what shapes cannot tell (heads, norm, ...)
                load_state(model, tensors, self._name(path))
                self.fitting.append(path)
            except AiaynError as exc:
                problems.append(str(exc))
        if problems:
            more = f" (and {len(problems) - 1} more files)" if len(problems) > 1 else ""
            return Check("shapes", False, problems[0] + more,
                         "config.yaml does not describe these weights: restore the config "
                         "the run was trained with")
        return Check("shapes", True, f"every tensor fits config.yaml "
                     f"({model.num_parameters():,} parameters)")

    # ------------------------------------------------------------ 4. tokenizer
    def check_tokenizer(self) -> Check:
        directory = self.run_dir / "tokenizer"
        fix = ("copy the tokenizer/ of the prepared data the run was trained on: "
               f"`cp -r DATA/tokenizer {directory}`")
        try:
            self.tokenizers = Tokenizers.load(directory)
        except AiaynError as exc:
            return Check("tokenizer", False, str(exc), fix)
        sizes = {"src": self.tokenizers.src_vocab_size, "tgt": self.tokenizers.tgt_vocab_size}
        problems = []
        for side, size in sizes.items():
            if self.config is not None:
                want = getattr(self.config.model, f"{side}_vocab_size")
                if want != size:
                    problems.append(f"the {side} tokenizer has {size} tokens, config.yaml's "
                                    f"model.{side}_vocab_size is {want}")
            for path, tensors in self.tensors.items():
                for name in EMBEDDINGS[side]:
                    if name in tensors and tensors[name].shape[0] != size:
                        problems.append(f"the {side} tokenizer has {size} tokens, "
                                        f"{self._name(path)}'s {name} has "
                                        f"{tensors[name].shape[0]} rows")
        if problems:
            self.tokenizers = None
            return Check("tokenizer", False, "; ".join(dict.fromkeys(problems)), fix)
        specials = ", ".join(f"{t}={i}" for i, t in enumerate(SPECIAL_TOKENS))
        vocab = (f"joint vocabulary of {sizes['src']}" if self.tokenizers.joint else
                 f"vocabularies of {sizes['src']}/{sizes['tgt']}")
        return Check("tokenizer", True, f"{self.tokenizers.kind}, {vocab} (= the embeddings); "
                     f"{specials}")

    # ------------------------------------------------------------ 5. data
    def check_data(self) -> Check:
        named_by = self.run_dir / "data_dir.txt"
        try:
            data_dir = Path(self.data_arg) if self.data_arg else Path(
                named_by.read_text(encoding="utf-8").strip())
        except OSError:
            return Check("data", False, f"{self.run_dir}: no data_dir.txt naming the prepared "
                         "data", "give the prepared data with --data DIR")
        if not data_dir.is_dir():
            where = ("named by --data" if self.data_arg else
                     f"the path comes from {named_by}, written when the run was trained")
            return Check("data", False, f"{data_dir}: prepared data directory not found "
                         f"({where})", "if the data moved, give it with --data DIR"
                         + ("" if self.data_arg else ", which overrides data_dir.txt")
                         + "; or prepare it again: `aiayn prepare --tokenizer-from "
                         f"{self.run_dir} --corpus SPEC --out {data_dir}`")
        try:
            self.dev = read_split(data_dir / "dev.jsonl")
        except AiaynError as exc:
            return Check("data", False, str(exc), "prepare the data again (aiayn prepare)")
        run_tok, data_tok = self.run_dir / "tokenizer", data_dir / TOKENIZER_DIR
        try:
            same = tokenizer_fingerprint(run_tok) == tokenizer_fingerprint(data_tok)
        except AiaynError as exc:
            return Check("data", False, str(exc), "prepare the data again (aiayn prepare)")
        if not same:
            self.dev = None  # its sentences say nothing about this run's tokenizer
            return Check("data", False, f"{data_dir} is encoded with another tokenizer "
                         f"({describe_tokenizer(data_tok)}) than the run's "
                         f"({describe_tokenizer(run_tok)})",
                         "point --data at the data this run was trained on, or prepare the "
                         f"corpus with the run's tokenizer: `aiayn prepare --tokenizer-from "
                         f"{self.run_dir} --corpus SPEC --out DIR`")
        self.data_dir = data_dir
        return Check("data", True, f"{data_dir}: {len(self.dev)} dev pairs, the same "
                     f"tokenizer (sha256 {tokenizer_fingerprint(run_tok)[:12]})")

    # ------------------------------------------------------------ 6. round-trip
    def check_round_trip(self) -> Check:
        if self.tokenizers is None or not self.dev:
            raise _Skip("needs the run's tokenizer and dev sentences encoded with it")
        tok = self.tokenizers
        chosen = [self.dev[i] for i in eval_subset(len(self.dev), ROUND_TRIP_SENTENCES)]
        texts = [s for s, _ in chosen] + [t for _, t in chosen]
        ids = tok.encode_src([s for s, _ in chosen]) + tok.encode_tgt([t for _, t in chosen])
        back = tok.decode_src(ids[:len(chosen)]) + tok.decode_tgt(ids[len(chosen):])
        wrong = [(text, out, seq.count(UNK_ID)) for text, out, seq in zip(texts, back, ids,
                                                                         strict=True)
                 if text != out]
        if wrong:
            text, out, unk = wrong[0]
            return Check("round-trip", False, f"{len(wrong)} of {len(texts)} dev sentences "
                         f"change through encode + decode, e.g. {text[:60]!r} -> "
                         f"{out[:60]!r} ({unk} [UNK])",
                         "train the tokenizer on text that covers these characters "
                         "(aiayn prepare), or accept them as [UNK]")
        return Check("round-trip", True, f"{len(texts)} dev sentences (both sides) come back "
                     "unchanged from encode + decode")

    # ------------------------------------------------------------ 7. translate
    def check_translation(self) -> Check:
        if self.config is None or self.tokenizers is None or not self.dev or not self.fitting:
            raise _Skip("needs fitting weights, the tokenizer and dev sentences")
        path = None
        for name in [self.weights_arg] + (["last"] if self.weights_arg == "best" else []):
            try:
                path = resolve_weights(self.run_dir, name)
                break
            except AiaynError as exc:
                error = str(exc)
        if path is None:
            return Check("translate", False, error, "choose weights with --weights")
        if path not in self.tensors:
            raise _Skip(f"{self._name(path)} is not among the readable weights")
        model = Transformer(self.config.model)
        load_state(model, self.tensors[path], str(path))
        chosen = [self.dev[i] for i in eval_subset(len(self.dev), self.sentences)]
        translator = Translator(model.eval(), self.tokenizers, device="cpu")
        hyps = translator.translate([s for s, _ in chosen], translator.resolve(beam=1))
        scores = score(hyps, [t for _, t in chosen])
        notes = []
        for (src, ref), hyp in zip(chosen, hyps, strict=True):
            notes += [f"{what}: {_clip(text)}" for what, text in (("src", src), ("ref", ref),
                                                                   ("hyp", hyp))]
        return Check("translate", True, f"{self._name(path)}, greedy, {len(chosen)} dev "
                     f"sentences: BLEU {scores.bleu:.2f}, chrF {scores.chrf:.2f}", notes=notes)

    # ------------------------------------------------------------ 8. validation
    def check_validation(self) -> Check:
        if (self.config is None or self.tokenizers is None or not self.dev
                or self.data_dir is None or not self.fitting):
            raise _Skip("needs fitting weights, the tokenizer and the run's prepared data")
        try:
            with warnings.catch_warnings():  # a last line cut short is left out: nothing to say
                warnings.simplefilter("ignore")
                records = [r for r in read_metrics(self.run_dir, missing_ok=True)
                           if r["kind"] == "dev"]
        except AiaynError as exc:
            return Check("validation", False, str(exc),
                         "repair or delete the line named (aiayn plot, info and --resume "
                         "refuse it too)")
        if not records:
            raise _Skip("metrics.jsonl logs no validation")
        targets = self._validated_weights(records)
        if not targets:
            raise _Skip("neither best.safetensors nor last.safetensors holds the weights of "
                        "a step metrics.jsonl logs a validation of")
        try:
            prepared = load_prepared(self.data_dir, log=lambda *_: None)
            dev, dev_pairs = prepared.validation_split(self.config.model.max_len)
            tokenize = prepared.bleu_tokenize(self.config.data.bleu_tokenize)
        except AiaynError as exc:  # not the dev split a validation reads: nothing to compare
            raise _Skip(str(exc)) from None
        agree, disagree = [], []
        for path, step, logged in targets:
            fresh = self._validate_again(path, logged, dev, dev_pairs, tokenize)
            if not _same_samples(logged, fresh):  # --data, or data prepared again since
                raise _Skip(f"the dev split of {self.data_dir} is not the one the run "
                            f"validated on (the sample sentences metrics.jsonl logged at step "
                            f"{step} differ); give the run's data with --data")
            name = f"{self._name(path)} (step {step})"
            wrong = [f"logged {what} {logged[key]:{form}}, its weights give {fresh[key]:{form}}"
                     for key, what, form, close in (
                         ("dev_loss", "dev loss", ".3f",
                          lambda a, b: math.isclose(a, b, **LOSS_TOLERANCE)),
                         ("bleu", "BLEU", ".2f", lambda a, b: abs(a - b) <= BLEU_TOLERANCE))
                     if key in logged and not close(logged[key], fresh[key])]
            if wrong:
                disagree.append(f"{name}: {', '.join(wrong)}")
            else:
                agree.append(f"{name}: dev loss {fresh['dev_loss']:.3f}, BLEU "
                             f"{fresh['bleu']:.2f}")
        t = self.config.train
        search = "greedy" if t.eval_beam == 1 else f"beam {t.eval_beam}"
        if disagree:
            return Check("validation", False, "; ".join(disagree) + ", so metrics.jsonl "
                         "does not describe these weights",
                         "trust neither the logged dev figures nor the best step chosen from "
                         f"them: score the weights with `aiayn evaluate {self.run_dir} --split "
                         "dev --weights best` (last, or a step checkpoint, to compare them); "
                         "runs with model.output_vocab: targets validated by an aiayn before "
                         "the fix of its stale output layer show this")
        return Check("validation", True, "; ".join(agree) + f": as metrics.jsonl logged them "
                     f"(validated again: the loss over {len(dev)} dev pairs, BLEU over "
                     f"{targets[0][2].get('n_sentences', len(dev))} of them, {search})")

    def _validated_weights(self, records: list[dict[str, Any]]
                           ) -> list[tuple[Path, int, dict[str, Any]]]:
        """(file, step, that step's dev record) of best and last, each step once, where the
        file fits and is finite and metrics.jsonl logs a validation at its step."""
        # The last record of a step: a resumed run logs the steps after its checkpoint again.
        by_step = {r["step"]: r for r in records}
        targets = []
        for name in ("best", "last"):
            path = self.run_dir / f"{name}.safetensors"
            if path not in self.fitting or path in self.non_finite:
                continue
            step = read_metadata(path).get("step", "")
            if not step.isdigit() or int(step) not in by_step:
                continue
            if all(int(step) != done for _, done, _ in targets):
                targets.append((path, int(step), by_step[int(step)]))
        return targets

    def _validate_again(self, path: Path, logged: dict[str, Any], dev: list,
                        dev_pairs: list[tuple[str, str]], tokenize: str) -> dict[str, Any]:
        """aiayn.evaluation.evaluate.validate of these weights on CPU, over the dev pairs the logged
        validation decoded (its n_sentences, spread over the split as eval_max_sentences
        spreads them), with the run's train.eval_beam and decode.alpha."""
        model = Transformer(self.config.model)
        load_state(model, self.tensors[path], str(path))
        t = self.config.train
        # The dev loss runs under the run's bf16 autocast (fp16 runs validate in fp32). "auto"
        # chose per machine, and the run may have trained on another: fp32 first, then bf16
        # when fp32 does not match.
        precisions = {"fp32": ["fp32"], "bf16": ["bf16"], "fp16": ["fp32"]}.get(
            t.precision, ["fp32", "bf16"])
        config = replace(self.config, train=replace(
            t, precision=precisions[0],
            eval_max_sentences=int(logged.get("n_sentences", t.eval_max_sentences))),
            data=replace(self.config.data, bleu_tokenize=tokenize))
        cpu = torch.device("cpu")
        fresh = validate(model, self.tokenizers, dev, dev_pairs, config, cpu, full=False)
        if "dev_loss" in logged and not math.isclose(logged["dev_loss"], fresh["dev_loss"],
                                                     **LOSS_TOLERANCE):
            for precision in precisions[1:]:
                other = replace(config, train=replace(config.train, precision=precision))
                loss = dev_loss(model.eval(), dev, other, cpu)[0]
                if math.isclose(logged["dev_loss"], loss, **LOSS_TOLERANCE):
                    fresh["dev_loss"] = loss
        return fresh

    # ------------------------------------------------------------ 9. resume
    def check_train_state(self) -> Check:
        path = self.run_dir / "train_state.pt"
        fix = ("this run cannot be resumed; start a new one from its weights: `aiayn train "
               f"--init-from {self.run_dir}:last --data DATA --out NEW_RUN`")
        try:
            state = load_train_state(path)
        except AiaynError as exc:
            return Check("resume", False, str(exc), fix)
        if state.get("version") != STATE_VERSION:
            return Check("resume", False, f"{path}: version {state.get('version')!r}, this "
                         f"aiayn reads {STATE_VERSION}", fix)
        if self.config is None:
            raise _Skip("needs config.yaml")
        weights = self.run_dir / str(state.get("weights", ""))
        if not weights.is_file():
            return Check("resume", False, f"{path} names {weights}, which does not exist", fix)
        if weights not in self.fitting:
            raise _Skip(f"the weights it names ({self._name(weights)}) are unreadable or do "
                        "not fit config.yaml (see above)")
        model = Transformer(self.config.model)
        params = list(model.parameters())
        saved = state.get("optimizer", {}).get("state", {})
        if len(saved) != len(params) or any(
                saved[i]["exp_avg"].shape != p.shape for i, p in enumerate(params)
                if i in saved):
            return Check("resume", False, f"{path}: the optimizer state holds "
                         f"{len(saved)} tensors that do not fit the model's {len(params)} "
                         "parameters", fix)
        return Check("resume", True, f"train_state.pt: step {state['step']}, epoch "
                     f"{state.get('epoch')}, weights {state['weights']}; "
                     "`aiayn train --resume` can continue it")
