"""Training: the loop, validation at intervals, checkpoints, exact resume, DDP.

The file reads top to bottom in the order a run happens:

    train_step                               grad accumulation, clipping, one Adam update
    train / Trainer                          set-up (or resume), then the loop: step, log,
                                             validate (aiayn.evaluation.evaluate), save, stop

What it builds on: aiayn.training.stream (the data, the model it sets, the batch stream),
aiayn.training.optim (Adam, the schedule, the loss), aiayn.training.distributed (ranks,
collectives, RNG state), aiayn.runs.directory (the run directory and its metrics log),
aiayn.evaluation.evaluate (dev loss and BLEU through the Translator), aiayn.runs.checkpoint
(files), aiayn.inference.kernels (the output layer's product, which the Trainer holds and
passes to every forward pass and to its validation).

Loss normalisation: every update divides the summed token losses by the number of real
target tokens in the whole update (all micro-batches of all ranks), so K ranks with one
micro-batch each compute the same gradient as one process accumulating K micro-batches.

Exact resume: the train state holds the optimizer, the step (the schedule is a pure
function of it), the RNG states of every rank and every rank's sampler position, so
``--resume`` continues with the same batches and the same dropout masks.

The file is over the house's 500 lines for the Trainer alone (~330): its set-up, loop,
validation, saves and resume share one state (model, optimizer, stream, progress, the
probes' choices), which pieces in other files would pass back and forth.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from warnings import warn

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from aiayn.config import Config, save_config
from aiayn.data.batching import length_multiple
from aiayn.errors import AiaynError
from aiayn.evaluation.evaluate import validate
from aiayn.inference.kernels import choose_output_kernel, output_kernel, output_kernel_name
from aiayn.model import OutputKernel
from aiayn.runs.checkpoint import (
    STATE_VERSION,
    load_train_state,
    load_weights,
    read_metadata,
    save_train_state,
    save_weights,
)
from aiayn.runs.directory import (
    build_model,
    prune_step_checkpoints,
    step_checkpoint_path,
)
from aiayn.runs.metrics import MetricsLog
from aiayn.training.admission import RunStart, check_run_request, run_dir_held, run_size
from aiayn.training.distributed import (
    Dist,
    all_reduce_sum,
    gather_objects,
    lost_a_rank,
    max_over_ranks,
    on_main,
    rng_state,
    set_rng_state,
    set_seed,
    setup_distributed,
    wrap_for_training,
)
from aiayn.training.early_stopping import BestTracker
from aiayn.training.optim import (
    MIN_LOSS_SCALE,
    build_optimizer,
    new_scaler,
    schedule_lr,
    set_learning_rate,
)
from aiayn.training.plan import (
    BudgetPlan,
    choose_regularisation,
    clearly_across,
    has_auto_regularisation,
    step_limit_passes,
)
from aiayn.training.stream import (
    BatchStream,
    collates_ahead,
    load_data,
    resolve_config,
    restrict_outputs,
)
from aiayn.util.device import autocast_dtype, machine_kind, resolve_precision
from aiayn.util.io import check_room
from aiayn.util.lock import locked
from aiayn.util.progress import log
from aiayn.util.threads import ThreadTuner


# ---------------------------------------------------------------- one optimizer update
@dataclass
class StepResult:
    loss: float  # label-smoothed loss per real target token, over all ranks
    n_tokens: int  # real target tokens in the update, over all ranks
    grad_norm: float
    lr: float
    skipped: bool = False  # fp16: the scaled gradients overflowed; no update, scale lowered
    scale: float | None = None  # fp16: the gradient scaler's scale after this step


def train_step(
    model: nn.Module,
    ddp: nn.Module | None,
    optimizer: torch.optim.Optimizer,
    micro_batches: list,
    step: int,
    config: Config,
    world: Dist,
    elapsed_s: float = 0.0,
    prefetch: Callable[[], object] | None = None,
    kernel: OutputKernel | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> StepResult:
    """One Adam update over ``micro_batches`` (gradient accumulation), normalised by the
    global count of real target tokens. Does not update the weights when the loss or the
    gradient is not finite (the caller stops the run). ``prefetch`` is called once the
    backward passes are queued, before the first wait for the device (the next batch is
    collated while a GPU computes this one). ``kernel``: the output layer's product
    (aiayn.inference.kernels; None: F.linear). ``scaler``: train.precision fp16's gradient
    scaler (``new_scaler``): the loss is scaled before backward and the gradients unscaled
    before clipping; gradients that overflowed (a finite loss, a non-finite norm) skip the
    update (``StepResult.skipped``) and lower the scale, as ``GradScaler.step`` does."""
    t = config.train
    local_tokens = sum(b.n_tokens for b in micro_batches)
    n_tokens = local_tokens if not world.enabled else int(all_reduce_sum(
        torch.tensor([float(local_tokens)], device=world.device), world).item())
    # DDP averages gradients over ranks; * world_size turns that average into a sum.
    scale = world.world_size / n_tokens
    dtype = autocast_dtype(t.precision)
    autocast = torch.autocast(world.device.type, dtype=dtype or torch.bfloat16,
                              enabled=dtype is not None)
    loss_sum = torch.zeros((), device=world.device)
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        sync = ddp.no_sync() if ddp is not None and not last else nullcontext()
        with sync:
            with autocast:  # the loss itself is computed in fp32
                loss = model(batch.src, batch.tgt_in, batch.tgt_out, t.label_smoothing, kernel)
            part = loss * scale
            (scaler.scale(part) if scaler is not None else part).backward()
        loss_sum += loss.detach()
    if prefetch is not None:
        prefetch()
    loss_per_token = all_reduce_sum(loss_sum, world).item() / n_tokens
    if scaler is not None:
        scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = t.clip_norm if t.clip_norm > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    lr = schedule_lr(step, config, elapsed_s)
    if math.isfinite(loss_per_token) and math.isfinite(grad_norm):
        set_learning_rate(optimizer, lr)
        optimizer.step()  # the gradients are unscaled and finite: GradScaler.step's update
    optimizer.zero_grad(set_to_none=True)
    if scaler is None:
        return StepResult(loss_per_token, n_tokens, grad_norm, lr)
    scaler.update()  # halves the scale after an overflow (unscale_ recorded it), else grows it
    skipped = math.isfinite(loss_per_token) and not math.isfinite(grad_norm)
    return StepResult(loss_per_token, n_tokens, grad_norm, lr, skipped, scaler.get_scale())



# ---------------------------------------------------------------- the run
@dataclass
class Progress:
    """What the loop knows besides the weights and the optimizer."""

    step: int = 0  # optimizer updates done
    best: BestTracker = field(default_factory=BestTracker)  # train.best_metric, train.patience
    elapsed_s: float = 0.0  # training wall time over all sessions of this run
    tokens: int = 0  # real target tokens trained on, over all ranks and sessions
    saved_step: int = 0
    skipped: int = 0  # fp16: updates skipped for overflowing gradients, over all sessions


def train(
    config: Config | None,
    data_dir: str | Path | None,
    run_dir: str | Path,
    resume: bool = False,
    overrides: list[str] | None = None,
    device: str | None = None,
    force: bool = False,
    init_from: str | Path | None = None,
) -> dict[str, Any]:
    """Train a model (or resume the run in ``run_dir``); returns the final dev record.

    New run: ``config`` and ``data_dir`` are required; ``run_dir`` must be new or empty
    (``force``: replace the run files in it). Resume: the run's config.yaml with
    ``overrides`` (train.* and decode.* only) and its data_dir.txt (unless ``data_dir`` is given).
    Everything is checked before anything is written; the run directory is locked for the
    whole run (a second ``aiayn train`` on it is refused) and the data directory shared.
    ``init_from="RUN_DIR[:WEIGHTS]"``: a new run that starts from that run's weights, on
    data encoded with its tokenizers (``config`` may be None: that run's config with
    ``overrides``), see aiayn.training.transfer::

        train(None, "data/kjv-spa", "runs/ft", init_from="runs/web:best",
              overrides=["train.max_steps=2000", "train.patience=3"])
    """
    check_run_request(resume, init_from, config is not None, data_dir,
                      None if resume else run_dir, force)
    world = setup_distributed(device)
    run_dir = Path(run_dir)
    try:
        with ExitStack() as hold:
            # One writer per run directory (aiayn.util.lock), and no `prepare --force` under a
            # run reading the data; rank 0 holds both, and a refusal stops every rank.
            on_main(lambda: hold.enter_context(run_dir_held(run_dir, resume, force)), world)
            trainer = Trainer(config, data_dir, run_dir, resume, overrides or [], world, force,
                              init_from)
            on_main(lambda: hold.enter_context(
                locked(trainer.data_dir, "aiayn train", shared=True)), world)
            try:
                result = trainer.run()
            finally:
                trainer.metrics.close()
        if world.enabled:  # no rank tears gloo down while another still talks to it (SIGABRT)
            dist.barrier()
        return result
    except RuntimeError as exc:
        if not (world.enabled and lost_a_rank(exc)):
            raise
        raise AiaynError(
            f"rank {world.rank} of {world.world_size}: another process of the run stopped "
            f"({str(exc).splitlines()[0][:160]}); see its own output for why, then go on from "
            f"the last save with `torchrun --nproc_per_node {world.world_size} -m aiayn train "
            f"--resume {run_dir}`") from None
    finally:
        if world.enabled and dist.is_initialized():
            dist.destroy_process_group()


class Trainer:
    """One training run: ``__init__`` sets everything up (data, model, optimizer, the saved
    state on resume), ``run`` is the loop; ``run_validation`` and ``save`` are what it does at
    intervals. Every rank builds its own Trainer; rank 0 alone writes files."""

    def __init__(self, config: Config | None, data_dir: str | Path | None, run_dir: Path,
                 resume: bool, overrides: list[str], world: Dist, force: bool = False,
                 init_from: str | Path | None = None):
        self.world, self.run_dir = world, run_dir
        self.log = log if world.is_main else (lambda *a, **k: None)
        start = RunStart.choose(config, data_dir, run_dir, resume, overrides, init_from, self.log)
        self.data_dir = start.data_dir
        set_seed(start.config.train.seed)  # every rank builds the same initial weights
        self.data = load_data(start.data_dir, start.config, world, self.log)
        # What config.yaml holds: the vocabulary sizes of the data, train.precision as set
        # ("auto" stays "auto", so a resume on another machine chooses again).
        stored = resolve_config(start.config, self.data.tokenizers, start.data_dir)
        saved = load_train_state(run_dir / "train_state.pt") if start.continues else None
        # Timing probes choose the precision ("auto") and the output layer's kernel; a resume
        # on the same kind of machine keeps the run's choices (a probe can come out otherwise
        # in another process: a busy machine, two close timings), and every rank takes rank 0's.
        kept = kept_choices(saved, world.device)
        if stored.train.precision == "auto" and "precision" in kept:
            self.precision = kept["precision"]
            why_precision = "auto: kept from the run's start on this machine"
        else:
            self.precision, why_precision = resolve_precision(stored.train.precision,
                                                              world.device)
        self.precision, why_precision = gather_objects((self.precision, why_precision), world)[0]
        # What runs: the same with the precision chosen for this device (TrainConfig.use_bf16),
        # and dropout and label smoothing chosen by the passes the budget makes where "auto"
        # (known now under a step limit, once the speed is measured under a time budget).
        steps_per_pass = len(self.data.sampler) / stored.train.grad_accum
        auto = has_auto_regularisation(stored)
        passes = step_limit_passes(stored, steps_per_pass)  # None: a time budget's, not yet
        if passes is not None:  # known now: config.yaml says what was chosen
            stored = choose_regularisation(stored, passes)[0]
        self.stored = stored  # "auto" until a time budget's speed is measured (regularise)
        self.auto = stored if auto and passes is None else None  # what regularise chooses from
        self.settled = False  # a projection after the first has chosen (regularise)
        self.config, why_regularisation = choose_regularisation(
            replace(stored, train=replace(stored.train, precision=self.precision)), passes)
        self.scaler = new_scaler(world.device) if self.precision == "fp16" else None
        t = self.config.train
        self.threads = ThreadTuner(t.cpu_threads or torch.get_num_threads(),
                                   adaptive=t.cpu_threads == 0 and world.device.type == "cpu")
        self.model = build_model(self.config, world.device)
        if start.init is not None:
            start.init.load_into(self.model)
            self.log(f"init: weights {start.init.weights} (fresh optimizer and schedule)")
        if self.model.generator.restricted and not start.continues:  # a resume loads them
            restrict_outputs(self.model, self.data.train, self.log)
        self.optimizer = build_optimizer(self.model, self.config)
        self.stream = BatchStream(self.data, self.config.model.pad_id, world.device,
                                  t.max_epochs, length_multiple(self.precision != "fp32"))
        self.prefetch = collates_ahead(world.device)
        self.progress = Progress(best=BestTracker(t.best_metric, t.patience))
        rng = self.restore(saved) if saved is not None else None
        if "output_kernel" in kept and kept.get("precision") == self.precision:
            kernel = output_kernel(kept["output_kernel"])
            why_output = (f"output layer: {output_kernel_name(kernel)} (kept from the run's "
                          "start on this machine)")
        else:
            kernel, why_output = choose_output_kernel(self.model.generator, t.max_tokens,
                                                      enabled=self.precision == "fp32")
        chosen, why_output = gather_objects((output_kernel_name(kernel), why_output), world)[0]
        self.kernel = output_kernel(chosen)  # the output layer's product: rank 0's choice
        kept_ahead = sum(s > self.progress.step for s in t.keep_steps)
        on_main(lambda: check_room(run_dir, run_size(self.model, t.keep_checkpoints,
                                                     start.continues, kept_ahead),
                                   "the run"), world)
        # Everything is checked and loaded: only now is the run directory written.
        on_main(lambda: start.record(run_dir, stored, overrides, self.progress.step, force), world)
        if start.continues:
            on_main(self.finish_saved_step, world)
        if world.rank > 0 and rng is None:
            torch.manual_seed(t.seed + 7919 * world.rank)  # own dropout masks on each rank
        self.ddp, self.train_model = wrap_for_training(self.model, t.compile, world)
        if rng is not None:
            set_rng_state(rng)  # last: nothing above may draw from the restored streams
        m = self.config.model
        self.log(f"model: {self.model.num_parameters() / 1e6:.2f}M parameters, d_model "
                 f"{m.d_model}, {m.n_encoder_layers}+{m.n_decoder_layers} layers, vocab "
                 f"{m.src_vocab_size}/{m.tgt_vocab_size}; device {world.device}, "
                 f"{world.world_size} rank(s), compile {t.compile}; precision {self.precision} "
                 f"({why_precision}); {torch.get_num_threads()} CPU thread(s)"
                 f"{' (adaptive)' if self.threads.enabled else ''}; schedule {t.schedule}; "
                 f"{why_output}")
        self.metrics = MetricsLog(run_dir, world.is_main, self.progress.step if resume else None)
        # The budget it runs to, and the passes over the data that makes (aiayn.training.plan).
        self.plan = BudgetPlan(stored, steps_per_pass, self.progress.step,
                               self.progress.elapsed_s, self.log,
                               warn if world.is_main else (lambda line: None))
        self.plan.start_lines()
        if auto:
            self.log(why_regularisation)

    def run(self) -> dict[str, Any]:
        """Steps until train.max_steps, max_epochs or max_minutes; then a last validation (as
        the others: train.eval_max_sentences) and the final checkpoint. Returns the last dev
        record and why it stopped."""
        t, progress, stream = self.config.train, self.progress, self.stream
        start = time.perf_counter()
        budget_s = t.max_minutes * 60 if t.max_minutes > 0 else math.inf
        elapsed_before = progress.elapsed_s
        # Under a time budget the step limit is usually far away: show a count, not a fake ETA.
        bar = tqdm(total=None if budget_s < math.inf else t.max_steps, initial=progress.step,
                   desc="train", unit="step", disable=not self.world.is_main,
                   dynamic_ncols=True, mininterval=1 if sys.stderr.isatty() else 30)
        window_loss = window_tokens = 0.0
        window_start = time.perf_counter()
        last_eval: dict[str, Any] | None = None
        last_eval_step = -1
        stop_reason = "max_steps"
        self.model.train()
        try:
            while progress.step < t.max_steps:
                micro = [stream.next() for _ in range(t.grad_accum)]
                if any(batch is None for batch in micro):  # the last epoch is done
                    stop_reason = f"max_epochs ({t.max_epochs})"
                    break
                step_start = time.perf_counter()
                result = train_step(self.train_model, self.ddp, self.optimizer, micro,
                                    progress.step + 1, self.config, self.world, progress.elapsed_s,
                                    prefetch=stream.prefetch if self.prefetch else None,
                                    kernel=self.kernel, scaler=self.scaler)
                self.threads.observe(time.perf_counter() - step_start, result.n_tokens,
                                     shape=tuple((*b.src.shape, *b.tgt_in.shape) for b in micro))
                if result.skipped and result.scale >= MIN_LOSS_SCALE:
                    # fp16 overflow: no update, so the step (and the schedule, a function of
                    # it) stays; the batch is spent, as in fairseq.
                    progress.skipped += 1
                    bar.set_postfix(self.postfix(result, tokens_per_s=0.0), refresh=False)
                    continue
                if not (math.isfinite(result.loss) and math.isfinite(result.grad_norm)):
                    raise AiaynError(non_finite_message(result, progress, self.run_dir, self.config))
                progress.step += 1
                progress.tokens += result.n_tokens
                progress.elapsed_s = max_over_ranks(elapsed_before + time.perf_counter() - start,
                                                    self.world)
                passes = self.plan.observe(progress.step, progress.elapsed_s)
                if passes is not None and self.auto is not None:
                    self.regularise(passes)
                window_loss += result.loss * result.n_tokens
                window_tokens += result.n_tokens
                tokens_per_s = window_tokens / max(time.perf_counter() - window_start, 1e-9)
                bar.update(1)
                bar.set_postfix(self.postfix(result, tokens_per_s), refresh=False)
                if progress.step % t.log_every == 0:
                    self.metrics.write({
                        "kind": "train", "step": progress.step, "epoch": stream.epoch,
                        "loss": window_loss / window_tokens, "lr": result.lr,
                        "tokens_per_s": tokens_per_s, "elapsed_s": progress.elapsed_s,
                        "tokens": progress.tokens, "grad_norm": result.grad_norm,
                        "threads": torch.get_num_threads(),
                        "tuner_excess_s": self.threads.trial_excess_s, **self.scaler_fields()})
                    window_loss = window_tokens = 0.0
                    window_start = time.perf_counter()
                # The budget is the run's: all sessions (a resume continues it), as the
                # linear schedule counts it; elapsed_s is already the same on every rank.
                out_of_time = progress.elapsed_s >= budget_s
                finishing = out_of_time or progress.step >= t.max_steps
                if progress.step % t.eval_every == 0 and not finishing:
                    full = t.eval_max_sentences == 0
                    last_eval = self.run_validation(full)
                    last_eval_step = progress.step
                    window_start = time.perf_counter()  # evaluation time is not training time
                if progress.step % t.save_every == 0 and not finishing:
                    self.save()
                    window_start = time.perf_counter()
                elif progress.step in t.keep_steps and not finishing:
                    self.save_kept()
                    window_start = time.perf_counter()
                if progress.best.should_stop:
                    stop_reason = progress.best.stop_reason()
                    break
                if out_of_time:
                    stop_reason = f"max_minutes ({t.max_minutes:g})"
                    break
            # The end: the validation of the run (the same bounded subset; the whole dev
            # split is `aiayn evaluate`'s), then the final checkpoint.
            if last_eval_step != progress.step and progress.step > 0:
                last_eval = self.run_validation(full=t.eval_max_sentences == 0)
            if progress.saved_step != progress.step:
                self.save()
        finally:
            bar.close()
        self.log(f"stopped at step {progress.step} (epoch {stream.epoch}) after "
                 f"{progress.elapsed_s / 60:.1f} min of training: {stop_reason}; best "
                 f"{progress.best.describe()} (best.safetensors)")
        return {**(last_eval or {}), "step": progress.step, "epoch": stream.epoch,
                "stop_reason": stop_reason, **progress.best.record_fields(),
                "elapsed_s": progress.elapsed_s}

    def regularise(self, passes: float) -> None:
        """Set the "auto" dropout and label smoothing for the passes the time budget makes,
        from the next step on, and write them into config.yaml (a resume keeps the last
        choice). The first projection's choice holds only until the next: the first
        half-minute is the least like the rest (warm-up, thread trials, the curriculum's
        narrowest batches first). After that a choice changes only for passes clearly across
        a line (``plan.clearly_across``). A change of the label smoothing changes what the
        dev loss measures, so the best by loss is chosen afresh from the next validation."""
        was = (self.config.model.dropout, self.config.train.label_smoothing)
        chosen, line = choose_regularisation(self.auto, passes, ran_with=was[0])
        m, t = chosen.model, chosen.train
        first = has_auto_regularisation(self.stored)  # nothing chosen yet
        holds = not first and ((m.dropout, t.label_smoothing) == was
                               or (self.settled and not clearly_across(passes, was[0])))
        self.settled = not first
        if holds:
            return
        self.stored = chosen
        self.config = replace(self.config, model=replace(self.config.model, dropout=m.dropout),
                              train=replace(self.config.train, label_smoothing=t.label_smoothing))
        self.model.set_dropout(m.dropout)
        on_main(lambda: save_config(self.stored, self.run_dir / "config.yaml"), self.world)
        self.log(line)
        best = self.progress.best
        if t.label_smoothing != was[1] and best.metric == "loss" and best.value is not None:
            best.forget()
            self.log(f"best: the dev loss now counts label smoothing {t.label_smoothing:g}; the "
                     "best weights are chosen afresh from the next validation")

    def postfix(self, result: StepResult, tokens_per_s: float) -> dict[str, str]:
        """The progress line's figures; in fp16 the scale and the updates skipped too."""
        shown = {"loss": f"{result.loss:.3f}", "lr": f"{result.lr:.2e}",
                 "tok_s": f"{tokens_per_s:,.0f}", "epoch": str(self.stream.epoch),
                 "best": self.progress.best.short()}
        if self.scaler is not None:
            shown.update(scale=f"{result.scale:g}", skipped=str(self.progress.skipped))
        return shown

    def scaler_fields(self) -> dict[str, Any]:
        """metrics.jsonl's train record in fp16: the scale and the updates skipped so far."""
        if self.scaler is None:
            return {}
        return {"loss_scale": self.scaler.get_scale(), "skipped_steps": self.progress.skipped}

    def run_validation(self, full: bool) -> dict | None:
        """Rank 0 validates (aiayn.evaluation.evaluate.validate; the others wait), logs, prints
        samples and keeps best.safetensors."""
        world, progress, log = self.world, self.progress, self.log
        record = None
        if world.is_main:
            began = time.perf_counter()
            with torch.random.fork_rng(devices=[world.device] if world.device.type == "cuda" else []):
                scored = replace(self.config, data=replace(
                    self.config.data, bleu_tokenize=self.data.bleu_tokenize))
                result = validate(self.model, self.data.tokenizers, self.data.dev,
                                  self.data.dev_pairs, scored, world.device, full, self.kernel)
            best = progress.best
            improved = best.update(progress.step, result)
            if improved:
                save_weights(self.model, self.run_dir / "best.safetensors",
                             metadata={"step": str(progress.step), "best_metric": best.metric,
                                       "best_value": repr(best.value)})
            record = {"kind": "dev", "step": progress.step, **result,
                      "elapsed_s": progress.elapsed_s, "tokens": progress.tokens,
                      "eval_s": time.perf_counter() - began, **best.record_fields()}
            self.metrics.write(record)
            whole = full or result["n_sentences"] >= len(self.data.dev_pairs)
            what = "whole dev" if whole else "dev subset"
            log(f"step {progress.step}: dev loss {result['dev_loss']:.3f}  BLEU "
                f"{result['bleu']:.2f}  chrF {result['chrf']:.2f}  ({what}, "
                f"{result['n_sentences']} sentences, {record['eval_s']:.0f}s)"
                f"{'  *best*' if improved else ''}  [{result['bleu_signature']}]"
                f"; best {best.describe()}{best.patience_note()}")
            for sample in result["samples"]:
                log(f"  src: {sample['src']}\n  ref: {sample['ref']}\n  hyp: {sample['hyp']}")
        if world.enabled:
            dist.barrier()
            bests = gather_objects(progress.best.state_dict(), world)
            progress.best.load_state_dict(bests[0])
        return record

    def save(self) -> None:
        """Save weights and train state. Every rank takes part (RNG and sampler states are
        gathered); rank 0 writes.

        Order: the step's own weights file, then train_state.pt naming it, then last.safetensors,
        then pruning of old step files. A kill between any two writes leaves a train state whose
        weights file exists and matches it (or, in the first save, no train state: the run
        starts over, aiayn.runs.directory.resume_point), and the resume writes last.safetensors when
        the kill came before it (:meth:`finish_saved_step`). A failed write (a full disk:
        aiayn.util.io.DiskError) removes the step's weights file again unless train_state.pt
        already names it, so the last good save stays what a resume continues from, and
        nothing half-made stays.
        """
        world, run_dir, config, progress = self.world, self.run_dir, self.config, self.progress
        rngs = gather_objects(rng_state(), world)
        streams = gather_objects(self.stream.state_dict(), world)
        if not world.is_main:
            return
        step = progress.step
        meta = {"step": str(step)}
        weights = step_checkpoint_path(run_dir, step)
        existed = weights.exists()
        try:
            save_weights(self.model, weights, metadata=meta)
            self._save_state(weights, rngs, streams)
        except BaseException:
            if not existed:
                weights.unlink(missing_ok=True)
            raise
        save_weights(self.model, run_dir / "last.safetensors", metadata=meta)
        prune_step_checkpoints(run_dir, config.train.keep_checkpoints, config.train.keep_steps)
        progress.saved_step = step

    def finish_saved_step(self) -> None:
        """On resume, write what :meth:`save` writes after train_state.pt when a kill cut the
        save short there: last.safetensors holds the saved step (the weights just loaded, which
        the train state names). Otherwise a run killed in its final save would keep the step
        before in last.safetensors for good: its resume has no step left to save. (Pruning
        waits for the next save, which writes the newest step file first.)"""
        step, last = self.progress.step, self.run_dir / "last.safetensors"
        try:
            saved = read_metadata(last).get("step") if last.is_file() else None
        except AiaynError:  # unreadable: written again below
            saved = None
        if saved != str(step):
            save_weights(self.model, last, metadata={"step": str(step)})
            self.log(f"resume: last.safetensors held {f'step {saved}' if saved else 'no step'}; "
                     f"rewritten with step {step}, which the save before the interruption had "
                     "not finished")

    def save_kept(self) -> None:
        """The weights of a step of train.keep_steps between saves: the step file alone (no
        train state, nothing pruned), so the run's course and its resume are unchanged; a
        resume that reaches the step again rewrites the same weights."""
        if self.world.is_main:
            save_weights(self.model, step_checkpoint_path(self.run_dir, self.progress.step),
                         metadata={"step": str(self.progress.step)})

    def _save_state(self, weights: Path, rngs: list, streams: list) -> None:
        """train_state.pt naming ``weights`` (written just before by :meth:`save`), with
        every rank's RNG and sampler states."""
        world, run_dir, config, progress = self.world, self.run_dir, self.config, self.progress
        step = progress.step
        state = {
            "version": STATE_VERSION,
            "step": step,
            "epoch": self.stream.epoch,
            "weights": str(weights.relative_to(run_dir)),
            "optimizer": self.optimizer.state_dict(),
            "schedule": {"formula": config.train.schedule, "d_model": config.model.d_model,
                         "warmup": config.train.warmup_steps, "scale": config.train.lr_scale,
                         "peak": config.train.peak_lr, "step": step},
            "rng": rngs,
            "stream": streams,
            "world_size": world.world_size,
            "best": progress.best.state_dict(),
            "elapsed_s": progress.elapsed_s,
            "tokens": progress.tokens,
            "choices": {"machine": machine_kind(world.device), "precision": self.precision,
                        "output_kernel": output_kernel_name(self.kernel)},
            "skipped": progress.skipped,
        }
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        save_train_state(state, run_dir / "train_state.pt")

    def restore(self, state: dict) -> dict:
        """Load what :meth:`save` wrote (``state``: its train_state.pt); returns this rank's
        RNG state (set it last, after everything else that draws random numbers)."""
        world, run_dir, stream = self.world, self.run_dir, self.stream
        if state.get("version") != STATE_VERSION:
            raise AiaynError(f"{run_dir}/train_state.pt: unknown version {state.get('version')!r}")
        weights = run_dir / state["weights"]
        if not weights.is_file():
            raise AiaynError(
                f"{run_dir}/train_state.pt names {weights}, which is gone, so the run cannot be "
                f"resumed exactly; start a new run from its other weights with `aiayn train "
                f"--init-from {run_dir}:last --data DIR --out NEW_RUN`, or start it over with "
                f"`aiayn train --config {run_dir / 'config.yaml'} --data DIR --out {run_dir} "
                "--force`")
        load_weights(self.model, weights)
        # Loaded on the CPU; load_state_dict moves each state tensor to its parameter's device.
        self.optimizer.load_state_dict(state["optimizer"])
        if state["world_size"] == world.world_size:
            stream.load_state_dict(state["stream"][world.rank])
            rng = state["rng"][world.rank]
        else:
            # Another number of ranks shards the data differently: start the saved epoch over.
            epoch = int(state["stream"][0]["epoch"])
            self.log(f"resume: the run had {state['world_size']} rank(s), this one has "
                     f"{world.world_size}; epoch {epoch} starts over and dropout masks differ "
                     "(not an exact resume)")
            stream.restart_epoch(epoch)
            rng = state["rng"][0]
        best = self.progress.best
        saved_best = state.get("best") or {  # train states written before train.best_metric
            "metric": "bleu", "step": state.get("best_step", 0),
            "value": state["best_bleu"] if state.get("best_bleu", -1.0) >= 0 else None}
        if not best.load_state_dict(saved_best):
            self.log(f"resume: train.best_metric is now {best.metric!r} (was "
                     f"{saved_best.get('metric')!r}); the best weights are chosen afresh")
        self.progress = Progress(step=int(state["step"]), best=best,
                                 elapsed_s=float(state["elapsed_s"]),
                                 tokens=int(state.get("tokens", 0)), saved_step=int(state["step"]),
                                 skipped=int(state.get("skipped", 0)))
        if self.scaler is not None and state.get("scaler"):  # else a fresh scale (fp16 now)
            self.scaler.load_state_dict(state["scaler"])
        if best.should_stop:  # it had stopped for patience: refuse, before anything is written
            raise AiaynError(f"{run_dir} stopped early at step {self.progress.step} "
                             f"({best.stop_reason()}; best {best.describe()}); to train on, "
                             "resume with a larger "
                             "--set train.patience (or 0)")
        self.log(f"resumed {run_dir} at step {self.progress.step}, epoch {stream.epoch}")
        return rng


def kept_choices(state: dict | None, device: torch.device) -> dict[str, Any]:
    """The probes' choices a train state recorded ("precision", "output_kernel"), when it
    was written on this kind of machine (aiayn.util.device.machine_kind); otherwise none.
    A train state written before train.precision holds "bf16" (a bool) instead."""
    choices = dict((state or {}).get("choices") or {})
    if choices.get("machine") != machine_kind(device):
        return {}
    if "bf16" in choices and "precision" not in choices:
        choices["precision"] = "bf16" if choices["bf16"] else "fp32"
    return {key: choices[key] for key in ("precision", "output_kernel") if key in choices}


def non_finite_message(result: StepResult, progress: Progress, run_dir: Path,
                       config: Config) -> str:
    """One line that says what happened, what was kept and the command to go on with."""
    what = f"loss {result.loss}" if not math.isfinite(result.loss) else \
        f"gradient norm {result.grad_norm}"
    t = config.train
    knob, value = ("peak_lr", t.peak_lr) if t.schedule == "linear" else ("lr_scale", t.lr_scale)
    lower = f"--set train.{knob}={value / 2:g}"
    if progress.saved_step:
        kept = (f"the last good checkpoint is step {progress.saved_step} "
                f"({run_dir / 'last.safetensors'}); go on from it with a lower learning rate: "
                f"`aiayn train --resume {run_dir} {lower}`")
    else:
        kept = (f"no checkpoint had been saved yet; start over with a lower learning rate: "
                f"`aiayn train --resume {run_dir} {lower}`")
    return (f"training stopped at step {progress.step + 1}: non-finite {what} (weights not "
            f"updated); {kept} (or a longer train.warmup_steps, a smaller train.clip_norm)")
