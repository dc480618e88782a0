"""Speed of aiayn's Transformer against torch.nn.Transformer, measured in one process.

What it measures, per model config (``configs/small.yaml``, ``configs/base.yaml``):

1. Training-step throughput, in real target tokens per second: forward, label-smoothed
   cross-entropy (0.1, pad ignored; aiayn's own loss for aiayn, ``F.cross_entropy`` for the
   reference), backward, Adam step, on the same length-bucketed
   token-budget batches, for ``aiayn.Transformer`` and for a reference built from
   ``torch.nn.Transformer`` (batch_first, post-norm, same sizes) with the same embeddings
   (x sqrt(d_model) + sinusoids) and generator, given its masks the way its documentation
   and the tutorials pass them.
2. The same step under ``torch.autocast("cpu", dtype=torch.bfloat16)``, for both.
3. Model FLOP utilisation (MFU) of every training row: matmul FLOPs of the step (formula in
   ``training_flops``) per second, divided by the FLOP/s of a large square matmul of the
   same dtype timed in the same repetitions.
4. Greedy decoding of exactly 100 tokens with ``aiayn.inference.search.decode_greedy``, batch 1 and
   32, with the KV cache against re-running the whole prefix at every step
   (``use_cache=False``, what the tutorials do).

All contenders of one config are interleaved within every repetition; the table reports
medians and the ratios aiayn / reference, which is what this benchmark claims (the
machine is shared, absolute numbers move with its load). On a busy machine use
``--threads 1``: with two OpenMP threads, every small op waits for a descheduled thread.

    python benchmarks/speed.py                 # small and base (docs/results.md#training-speed)
    python benchmarks/speed.py --quick         # smoke test of every path, about a minute
    python benchmarks/speed.py --configs small --reps 7 --threads 1
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402  (benchmarks/ is not a package)
    REPO,
    Batch,
    add_threads_option,
    bucket,
    device_description,
    interleave,
    load_average,
    make_batch,
    markdown_table,
    note_load,
    padding_fraction,
    paired_ratios,
    representative,
    script_parser,
    sentence_lengths,
    set_threads,
    spread,
    typical_total,
)

from aiayn.config import ModelConfig, load_config  # noqa: E402
from aiayn.data.tokenizer import EOS_ID, PAD_ID  # noqa: E402
from aiayn.inference.search import decode_greedy  # noqa: E402
from aiayn.inference.settings import Search  # noqa: E402
from aiayn.inspect.reference import TorchReference, copy_weights, max_logit_difference  # noqa: E402
from aiayn.model import Transformer  # noqa: E402

LABEL_SMOOTHING = 0.1
DECODE_STEPS = 100
CORPUS_PAIRS = 100_000  # sentence pairs whose lengths are bucketed (a real corpus' size)
PEAK_N = 2048  # side of the square matmul that measures the achievable FLOP/s


@dataclass
class Plan:
    """How much of one config to run: batches, token budget and repetitions.

    The base model's step is ~8x the small one's, so it gets a smaller token budget and
    fewer repetitions to keep the whole run within ~10-15 minutes on 2 cores.
    """

    max_tokens: int  # token budget of one training batch
    n_batches: int  # training batches per repetition (quantiles of the length-sorted list)
    train_reps: int
    decode_reps: int
    decode_batches: tuple[int, ...] = (1, 32)


PLANS = {
    "small": Plan(max_tokens=4096, n_batches=3, train_reps=3, decode_reps=2),
    "base": Plan(max_tokens=2048, n_batches=2, train_reps=3, decode_reps=1),
}
# A smoke test of every code path in about a minute: small batches, one repetition.
QUICK = Plan(max_tokens=1024, n_batches=2, train_reps=1, decode_reps=1, decode_batches=(1, 8))


# --------------------------------------------------------------------------- the reference
# aiayn.inspect.reference.TorchReference: torch.nn.Transformer between aiayn's embeddings and
# generator, given aiayn's weights by copy_weights (and checked to agree) before timing.


# --------------------------------------------------------------------------- training


def training_flops(cfg: ModelConfig, B: int, S: int, T: int) -> float:
    """Matmul FLOPs of one training step on a padded (B, S) -> (B, T) batch.

    forward = encoder + decoder + generator, with N = 2 * (multiply-adds):
      encoder, per layer:  2*B*S*(4d^2 + 2*d*d_ff)          Q/K/V/O projections, FFN
                         + 4*B*S^2*d                          Q K^T and A V
      decoder, per layer:  2*B*T*(6d^2 + 2*d*d_ff)          self Q/K/V/O, cross Q/O, FFN
                         + 2*B*S*2d^2                         cross K/V of the memory
                         + 4*B*T^2*d + 4*B*T*S*d              self and cross attention
      generator:           2*B*T*d*V
    training step = 3 x forward (the backward pass costs twice the forward: gradients of
    the activations and of the weights), i.e. the usual 6 x params-in-matmuls x tokens plus
    the attention terms. Causal attention is counted in full (T^2), as dense kernels run it;
    embedding lookups, softmax, LayerNorm and the optimizer are not matmuls and not counted.
    Shapes are the padded ones: the work the kernels are given.
    """
    d, f, V = cfg.d_model, cfg.d_ff, cfg.tgt_vocab_size
    enc = cfg.n_encoder_layers * (2 * B * S * (4 * d * d + 2 * d * f) + 4 * B * S * S * d)
    dec = cfg.n_decoder_layers * (
        2 * B * T * (6 * d * d + 2 * d * f) + 2 * B * S * 2 * d * d
        + 4 * B * T * T * d + 4 * B * T * S * d
    )
    gen = 2 * B * T * d * V
    return 3.0 * (enc + dec + gen)


def torch_loss(model: nn.Module, batch: Batch, smoothing: float = LABEL_SMOOTHING) -> Tensor:
    """The summed label-smoothed cross-entropy a user of torch.nn writes: the reference's
    loss, from the model's (B, T, V) logits."""
    logits = model(batch.src, batch.tgt_in)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch.tgt_out.reshape(-1),
                           ignore_index=PAD_ID, label_smoothing=smoothing, reduction="sum")


def aiayn_loss(model: Transformer, batch: Batch, smoothing: float = LABEL_SMOOTHING,
               kernel=None) -> Tensor:
    """The same loss as aiayn trains with: ``Transformer.forward`` given the targets
    (the softmax kept for backward, aiayn.loss.SmoothedCrossEntropy), the output layer's
    product by ``kernel`` (aiayn.inference.kernels; None: F.linear)."""
    return model(batch.src, batch.tgt_in, batch.tgt_out, smoothing, kernel)


def training_steps(model: nn.Module, batches: list[Batch], bf16: bool,
                   loss_fn: Callable[[nn.Module, Batch], Tensor] = aiayn_loss,
                   optimizer: torch.optim.Optimizer | None = None,
                   ) -> list[Callable[[], float]]:
    """One callable per batch, each running one training step on it; they share an optimizer.

    The step: zero grads, forward and label-smoothed cross-entropy per real target token
    (``loss_fn``: aiayn's own for aiayn's models, ``torch_loss`` for the reference; under
    bf16 autocast when asked), backward, an update by ``optimizer``; by default Adam(0.9,
    0.98, 1e-9) -- the paper's optimiser, with the fused kernel as
    ``aiayn.training.optim.build_optimizer`` makes it.
    """
    if optimizer is None:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9,
                                     fused=True)
    device_type = next(model.parameters()).device.type

    def step(batch: Batch) -> float:
        model.train()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(model, batch) / batch.n_tokens
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    return [lambda b=batch: step(b) for batch in batches]


def matmul_peak(dtype: torch.dtype, n: int = PEAK_N) -> tuple[Callable[[], None], float]:
    """A callable doing one (n x n) @ (n x n) matmul of ``dtype``, and its FLOPs."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return (lambda: a @ b), 2.0 * n**3


@dataclass
class TrainingRow:
    config: str
    precision: str
    ours_tps: float  # real target tokens per second (median)
    ref_tps: float
    ratio: float  # reference time / aiayn time (common.typical_total of each)
    ours_mfu: float
    ref_mfu: float
    peak: float  # FLOP/s of the matmul of this precision (median)
    spread: str  # half-range of the per-repetition ratios
    vs_fp32: str = "-"  # bf16 rows: speed-up over fp32 of aiayn / of the reference


def bench_training(
    name: str, cfg: ModelConfig, batches: list[Batch], reps: int, matched_dropout: bool,
) -> list[TrainingRow]:
    """fp32 and bf16 steps of both models plus both matmul peaks, interleaved in each rep."""
    torch.manual_seed(0)
    ours = Transformer(cfg)
    ref = TorchReference(cfg, matched_dropout=matched_dropout)
    copy_weights(ours, ref)
    diff = max_logit_difference(ours, ref, batches[0].src, batches[0].tgt_in)
    print(f"  same function: max |logit difference| aiayn vs reference (eval) = {diff:.1e}")
    if matched_dropout and diff > 1e-3:
        raise SystemExit(f"reference and aiayn disagree ({diff:.2e}): the comparison is void")

    tokens = sum(b.n_tokens for b in batches)
    flops = sum(training_flops(cfg, *b.shape) for b in batches)
    peak32, peak32_flops = matmul_peak(torch.float32)
    peak16, peak16_flops = matmul_peak(torch.bfloat16)
    k = len(batches)
    contenders = {  # each a list of k items: interleaved batch by batch (common.interleave)
        "aiayn fp32": training_steps(ours, batches, bf16=False),
        "ref fp32": training_steps(ref, batches, bf16=False, loss_fn=torch_loss),
        "peak fp32": [peak32] * k,
        "aiayn bf16": training_steps(ours, batches, bf16=True),
        "ref bf16": training_steps(ref, batches, bf16=True, loss_fn=torch_loss),
        "peak bf16": [peak16] * k,
    }
    times = interleave(contenders, reps=reps, warmup=1)

    total = {name: typical_total(runs) for name, runs in times.items()}
    rows = []
    for precision, peak_flops in (("fp32", peak32_flops), ("bf16", peak16_flops)):
        t_ours, t_ref = total[f"aiayn {precision}"], total[f"ref {precision}"]
        peak = k * peak_flops / total[f"peak {precision}"]
        rows.append(TrainingRow(
            config=name, precision=precision,
            ours_tps=tokens / t_ours, ref_tps=tokens / t_ref, ratio=t_ref / t_ours,
            ours_mfu=flops / t_ours / peak, ref_mfu=flops / t_ref / peak, peak=peak,
            spread=spread(paired_ratios(times[f"ref {precision}"], times[f"aiayn {precision}"])),
        ))
    gain = {m: total[f"{m} fp32"] / total[f"{m} bf16"] for m in ("aiayn", "ref")}
    rows[1].vs_fp32 = f"{gain['aiayn']:.1f}x / {gain['ref']:.1f}x"
    return rows


# --------------------------------------------------------------------------- decoding


def no_eos(hidden: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """An output kernel (``aiayn.model.OutputKernel``) whose EOS logit is -inf: greedy search
    runs to its length limit."""
    logits = F.linear(hidden, weight, bias)
    logits[..., EOS_ID] = float("-inf")
    return logits


def decoding_sources(cfg: ModelConfig, batch_size: int, length: int = 30, seed: int = 1) -> Tensor:
    """(B, S) source ids, every sentence ``length`` tokens long (EOS included)."""
    return make_batch([(length, length)] * batch_size, cfg.src_vocab_size, seed=seed).src


@dataclass
class DecodingRow:
    config: str
    batch: int
    cache_s: float  # median seconds for 100 tokens per sentence
    recompute_s: float
    speedup: float  # recompute / cache
    agree: float  # fraction of generated tokens identical between the two
    spread: str


def decoding_run(model: Transformer, src: Tensor, steps: int, use_cache: bool,
                 outputs: dict[str, list[list[int]]], key: str) -> Callable[[], None]:
    """A callable running greedy search for exactly ``steps`` tokens a sentence (EOS
    forbidden, the limit the same for every source length: max_len_a 0), keeping its
    output under ``outputs[key]``."""
    search = Search(1, max_len_a=0, max_len_b=steps)

    def run() -> None:
        with torch.inference_mode():
            outputs[key] = decode_greedy(model, src, search, use_cache, no_eos)

    return run


def bench_decoding(name: str, cfg: ModelConfig, batch_sizes: tuple[int, ...],
                   reps: int) -> list[DecodingRow]:
    """Greedy search for exactly DECODE_STEPS tokens, KV cache vs full-prefix recompute."""
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    rows = []
    for batch_size in batch_sizes:
        src = decoding_sources(cfg, batch_size)
        outputs: dict[str, list[list[int]]] = {}
        # Warm-up: a few steps each, so first-call costs (oneDNN primitives) are not timed.
        decoding_run(model, src, 5, True, {}, "warm")()
        decoding_run(model, src, 5, False, {}, "warm")()
        times = interleave(
            {"cache": decoding_run(model, src, DECODE_STEPS, True, outputs, "cache"),
             "recompute": decoding_run(model, src, DECODE_STEPS, False, outputs, "recompute")},
            reps=reps, warmup=0)
        lengths = {len(ids) for key in outputs for ids in outputs[key]}
        if lengths != {DECODE_STEPS}:
            raise SystemExit(f"greedy search produced lengths {lengths}, not {DECODE_STEPS}")
        same = sum(a == b for x, y in zip(outputs["cache"], outputs["recompute"], strict=True)
                   for a, b in zip(x, y, strict=True))
        t_cache, t_full = typical_total(times["cache"]), typical_total(times["recompute"])
        rows.append(DecodingRow(
            config=name, batch=batch_size, cache_s=t_cache, recompute_s=t_full,
            speedup=t_full / t_cache, agree=same / (batch_size * DECODE_STEPS),
            spread=spread(paired_ratios(times["recompute"], times["cache"])),
        ))
        print(f"  decode batch {batch_size}: cache {rows[-1].cache_s:.2f}s, "
              f"recompute {rows[-1].recompute_s:.2f}s")
    return rows


# --------------------------------------------------------------------------- report


def report(plans: dict[str, Plan], train_rows: list[TrainingRow],
           decode_rows: list[DecodingRow], shapes: dict[str, str], load: str) -> str:
    train_table = markdown_table(
        ["config", "precision", "batches (B x S -> T)", "aiayn tok/s", "nn.Transformer tok/s",
         "ratio aiayn/ref", "aiayn MFU", "ref MFU", "matmul peak GFLOP/s",
         "bf16 speed-up aiayn / ref"],
        [[r.config, r.precision, shapes[r.config], f"{r.ours_tps:,.0f}", f"{r.ref_tps:,.0f}",
          f"**{r.ratio:.2f}** ({r.spread})", f"{100 * r.ours_mfu:.0f}%",
          f"{100 * r.ref_mfu:.0f}%", f"{r.peak / 1e9:,.0f}", r.vs_fp32] for r in train_rows],
    )
    decode_table = markdown_table(
        ["config", "batch", "KV cache (s)", "recompute (s)", "cache tok/s", "recompute tok/s",
         "speed-up cache/recompute", "same tokens"],
        [[r.config, str(r.batch), f"{r.cache_s:.2f}", f"{r.recompute_s:.2f}",
          f"{r.batch * DECODE_STEPS / r.cache_s:,.0f}",
          f"{r.batch * DECODE_STEPS / r.recompute_s:,.0f}",
          f"**{r.speedup:.1f}x** ({r.spread})", f"{100 * r.agree:.0f}%"] for r in decode_rows],
    )
    reps = ", ".join(f"{n}: {p.train_reps} training / {p.decode_reps} decoding reps, "
                     f"{p.n_batches} batches of <= {p.max_tokens} tokens"
                     for n, p in plans.items())
    training = (
        f"Training step (forward, label-smoothed CE, backward, Adam), real target tokens/s: "
        f"per batch the median over repetitions, summed over the batches; ratio = reference "
        f"time / aiayn time (± half-range of the per-repetition ratios). {reps}.\n\n"
        f"{train_table}\n\n")
    decoding = (
        f"Greedy decoding of exactly {DECODE_STEPS} tokens per sentence (aiayn.inference.search."
        f"decode_greedy, EOS forbidden), fp32, medians; speed-up = recompute time / KV-cache "
        f"time.\n\n{decode_table}\n")
    return (f"Device: {device_description()}. Load average (1 min): {load}.\n\n"
            + (training if train_rows else "") + (decoding if decode_rows else ""))


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 2 batches of <= 1024 tokens, 1 rep, decoding batch 1 "
                             "and 8, of the small config unless --configs names others")
    parser.add_argument("--configs",
                        help="comma-separated config names from configs/ (default small,base)")
    parser.add_argument("--reps", type=int, default=0,
                        help="training repetitions per config (default: per-config plan)")
    parser.add_argument("--decode-reps", type=int, default=0,
                        help="decoding repetitions (default: per-config plan)")
    parser.add_argument("--reference-dropout", choices=("matched", "default"), default="matched",
                        help="matched: nn.Transformer drops out where aiayn does (default); "
                             "default: nn.Transformer's own (also attention weights and FFN)")
    add_threads_option(parser, 0, "torch intra-op threads (default: torch's choice, one per core)")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-train", action="store_true")
    args = parser.parse_args(argv)

    configs = args.configs or ("small" if args.quick else "small,base")
    names = [n.strip() for n in configs.split(",") if n.strip()]
    for n in names:
        if not (REPO / "configs" / f"{n}.yaml").is_file():
            parser.error(f"no config configs/{n}.yaml")
        max_len = load_config(REPO / "configs" / f"{n}.yaml").model.max_len
        if not args.skip_decode and max_len <= DECODE_STEPS:  # BOS + the steps must fit
            parser.error(f"configs/{n}.yaml: model.max_len {max_len} holds fewer than the "
                         f"{DECODE_STEPS} decoding steps; add --skip-decode")
    plans: dict[str, Plan] = {}
    for n in names:
        plan = QUICK if args.quick else PLANS.get(n, PLANS["base"])
        plans[n] = Plan(plan.max_tokens, plan.n_batches, args.reps or plan.train_reps,
                        args.decode_reps or plan.decode_reps, plan.decode_batches)

    set_threads(args.threads)
    print(f"Device: {device_description()}")
    load_before = note_load()
    start, cpu_start = time.perf_counter(), time.process_time()
    train_rows: list[TrainingRow] = []
    decode_rows: list[DecodingRow] = []
    shapes: dict[str, str] = {}
    for name, plan in plans.items():
        path = REPO / "configs" / f"{name}.yaml"
        cfg = load_config(path).model
        print(f"[{name}] {path.relative_to(REPO)}: d={cfg.d_model} h={cfg.n_heads} "
              f"d_ff={cfg.d_ff} layers={cfg.n_encoder_layers}+{cfg.n_decoder_layers} "
              f"V={cfg.tgt_vocab_size}", flush=True)
        groups = bucket(sentence_lengths(CORPUS_PAIRS, max_len=cfg.max_len, seed=0),
                        plan.max_tokens)
        batches = [make_batch(g, cfg.tgt_vocab_size, seed=i)
                   for i, g in enumerate(representative(groups, plan.n_batches))]
        shapes[name] = ", ".join("{}x{}->{}".format(*b.shape) for b in batches)
        print(f"  {len(groups)} batches of <= {plan.max_tokens} tokens from {CORPUS_PAIRS:,} "
              f"pairs, {100 * padding_fraction(groups):.1f}% padding; timing {shapes[name]} "
              f"({100 * padding_fraction(representative(groups, plan.n_batches)):.1f}% padding)",
              flush=True)
        if not args.skip_train:
            train_rows += bench_training(name, cfg, batches, plan.train_reps,
                                         matched_dropout=args.reference_dropout == "matched")
            for r in train_rows[-2:]:
                print(f"  train {r.precision}: aiayn {r.ours_tps:,.0f} tok/s, "
                      f"ref {r.ref_tps:,.0f} tok/s, ratio {r.ratio:.2f}", flush=True)
        if not args.skip_decode:
            decode_rows += bench_decoding(name, cfg, plan.decode_batches, plan.decode_reps)
        print(f"  [{time.perf_counter() - start:.0f}s elapsed]", flush=True)

    wall = time.perf_counter() - start
    share = (time.process_time() - cpu_start) / (wall * torch.get_num_threads())
    load = (f"{load_before:.1f} before, {load_average():.1f} after; this process used "
            f"{100 * share:.0f}% of {torch.get_num_threads()} threads x wall time")
    print()
    print(report(plans, train_rows, decode_rows, shapes, load))
    print(f"total {time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
