"""aiayn on one CUDA GPU: the training step's MFU against nn.Transformer and a matmul peak
measured in the same run, the `aiayn train` loop against its own step, and decoding speed
on the Bible test verses.

Sections (``--sections``, all by default):

- ``step``: a training step (forward, label-smoothed cross-entropy, backward, fused Adam)
  under bf16 autocast, for aiayn eager, aiayn under ``torch.compile`` (as
  ``train.compile: true`` runs it) and ``torch.nn.Transformer`` with aiayn's embeddings and
  generator (``aiayn.inspect.reference``), and aiayn eager under fp16 autocast with a
  gradient scaler (``train.precision: fp16``, a GPU without bf16), on the same
  length-bucketed batches of ``--step-tokens`` target tokens; model FLOP utilisation =
  ``speed.training_flops`` per second over the FLOP/s of an 8192^3 bf16 matmul timed in the
  same repetitions.
- ``loop``: ``aiayn.training.loop.Trainer.run`` on the prepared data with the base model's shape
  for ``--loop-seconds``, once collating each batch after the step before (the CPU's way)
  and once collating it while the GPU computes (the GPU's way); its steady tokens/s against
  the same Trainer's ``train_step`` on batches collated beforehand, and the seconds until
  the loop first runs at 90% of its steady speed.
- ``decode``: beam 4 (alpha 0.6) and greedy over the test verses with the run's model
  (``--run``, the demo) and with the base-shaped model the loop trained, through the
  ``Translator`` as `aiayn evaluate` runs it (one ``Search`` value): in fp32 with the
  8,192-token batches of a CPU and with the device's default budget, and in bf16 with the
  device's default budget, with and without SDPA's cuDNN backend; each setting's share of
  translations equal to the first's.
- ``profile``: torch.profiler over a base training step and the demo's beam-4 decoding of
  the test verses in fp32 and in bf16: the kernels that take the GPU's time, and the GPU's
  busy share of the wall time.

    python benchmarks/gpu.py --data data/bible-eng-spa --run runs/demo --out gpu.json
    python benchmarks/gpu.py --device cpu --quick --data ... --run ...   # every path, a CPU

Beside ``--out`` each section's figures are also written alone (gpu.step.json, ...), so a
session cut short keeps what it measured. benchmarks/gpu_session.sh runs the sections a GPU
session measures, each within its time; tests/project/test_benchmark_scripts.py runs every
section with ``--device cpu --quick`` on a tiny run, so the script cannot fall behind the
package's names.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402  (benchmarks/ is not a package)
    REPO,
    bucket,
    interleave,
    make_batch,
    representative,
    sentence_lengths,
    typical_total,
)
from speed import aiayn_loss, torch_loss, training_flops, training_steps  # noqa: E402

from aiayn.config import load_config  # noqa: E402
from aiayn.data.prepared import load_prepared  # noqa: E402
from aiayn.inference.settings import Search  # noqa: E402
from aiayn.inference.translator import Translator  # noqa: E402
from aiayn.inspect.reference import TorchReference, copy_weights  # noqa: E402
from aiayn.model import Transformer  # noqa: E402
from aiayn.runs.directory import load_run  # noqa: E402
from aiayn.training import loop as train_module  # noqa: E402
from aiayn.training.distributed import setup_distributed  # noqa: E402
from aiayn.training.optim import new_scaler  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe(device: torch.device) -> dict:
    """The device, driver and software the figures were taken with."""
    info = {"torch": torch.__version__, "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, sms=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info["driver"] = "unknown"
    return info


def matmul_peak(device: torch.device, n: int) -> float:
    """FLOP/s of an (n x n) @ (n x n) bf16 matmul: the median of 10 after 3 warm-ups."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    times = []
    for i in range(13):
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        if i >= 3:
            times.append(time.perf_counter() - start)
    return 2.0 * n**3 / statistics.median(times)


# --------------------------------------------------------------------------- step
def bench_step(name: str, device: torch.device, max_tokens: int, n_batches: int, reps: int,
               compile_: bool, peak_n: int, backend: str = "inductor") -> dict:
    """aiayn eager / compiled and nn.Transformer, one training step each batch, interleaved."""
    cfg = load_config(REPO / "configs" / f"{name}.yaml").model
    # The config's shape; nn.Transformer has neither QK-norm nor a restricted output layer.
    cfg.qk_norm, cfg.output_vocab = False, "all"
    groups = bucket(sentence_lengths(100_000, max_len=cfg.max_len, seed=0), max_tokens)
    batches = []
    for i, group in enumerate(representative(groups, n_batches)):
        b = make_batch(group, cfg.tgt_vocab_size, seed=i)
        b.src, b.tgt_in, b.tgt_out = (t.to(device) for t in (b.src, b.tgt_in, b.tgt_out))
        batches.append(b)
    torch.manual_seed(0)
    ours = Transformer(cfg).to(device)
    ref = TorchReference(cfg, matched_dropout=True).to(device)
    copy_weights(ours, ref)
    k = len(batches)
    a = torch.randn(peak_n, peak_n, device=device, dtype=torch.bfloat16)

    def peak() -> None:
        a @ a
        sync(device)

    fp16_model = Transformer(cfg).to(device)
    fp16_model.load_state_dict(ours.state_dict())
    fp16 = Fp16Steps(fp16_model, batches)
    contenders = {
        "aiayn": training_steps(ours, batches, bf16=True, loss_fn=aiayn_loss),
        "nn.Transformer": training_steps(ref, batches, bf16=True, loss_fn=torch_loss),
        "aiayn fp16": fp16.steps,
        "peak": [peak] * k,
    }
    compile_s = None
    if compile_:
        compiled = torch.compile(ours, dynamic=True, backend=backend)
        steps = training_steps(compiled, batches, bf16=True, loss_fn=aiayn_loss)
        start = time.perf_counter()
        for s in steps:  # compile (and any recompile) before timing
            s()
        compile_s = time.perf_counter() - start
        contenders["aiayn compiled"] = steps
    times = interleave(contenders, reps=reps, warmup=1)
    total = {n: typical_total(runs) for n, runs in times.items()}
    peak_flops = k * 2.0 * peak_n**3 / total["peak"]
    flops = sum(training_flops(cfg, *b.shape) for b in batches)
    tokens = sum(b.n_tokens for b in batches)
    row = {"config": name, "batches": ", ".join("{}x{}->{}".format(*b.shape) for b in batches),
           "tokens_per_batch": tokens / k, "peak_tflops": peak_flops / 1e12,
           "compile_s": compile_s}
    for n in contenders:
        if n == "peak":
            continue
        row[n] = {"tokens_per_s": tokens / total[n], "mfu": flops / total[n] / peak_flops,
                  "ms_per_step": 1e3 * total[n] / k}
    row["ratio_vs_reference"] = total["nn.Transformer"] / total["aiayn"]
    row["aiayn fp16"].update(skipped_steps=fp16.skipped, final_scale=fp16.scaler.get_scale(),
                             steps=fp16.count)
    if compile_:
        row["compiled_ratio_vs_reference"] = total["nn.Transformer"] / total["aiayn compiled"]
    return row


class Fp16Steps:
    """One callable per batch, each a training step as ``train.precision: fp16`` runs it
    (``aiayn.training.loop.train_step``'s order): float16 autocast, the scaled loss's
    backward, unscale, clip, an Adam update unless the gradients overflowed, the scaler's
    update; the skips are counted."""

    def __init__(self, model: Transformer, batches: list) -> None:
        device = next(model.parameters()).device
        self.optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98),
                                          eps=1e-9, fused=True)
        self.scaler = new_scaler(device)
        self.skipped = self.count = 0

        def step(batch) -> None:
            model.train()
            self.optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.float16):
                loss = aiayn_loss(model, batch) / batch.n_tokens
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.count += 1
            self.skipped += int(not torch.isfinite(norm))

        self.steps = [lambda b=batch: step(b) for batch in batches]


# --------------------------------------------------------------------------- loop
def loop_config(data_dir: Path, max_tokens: int, seconds: float, quick: bool):
    """The base model's shape on the prepared data: the loop timed as `aiayn train` runs it
    (no validation or saving inside the window; lr warm-up kept short so the model that the
    decode section reads has learnt to stop)."""
    config = load_config(REPO / "configs" / ("tiny.yaml" if quick else "base.yaml"))
    t = config.train
    t.max_tokens, t.precision, t.max_minutes = max_tokens, "auto", seconds / 60
    t.eval_every = t.save_every = 10**6
    t.eval_max_sentences, t.log_every, t.warmup_steps = 50, 5, 800
    return config


def bench_loop(data_dir: Path, device: torch.device, max_tokens: int, seconds: float,
               ahead: bool, quick: bool) -> tuple[dict, Transformer, object]:
    """One Trainer: its loop for ``seconds`` (collating ahead or not), then its train_step
    alone on 12 batches collated beforehand (after one untimed pass over them)."""
    config = loop_config(data_dir, max_tokens, seconds, quick)
    world = setup_distributed(str(device.type))
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        trainer = train_module.Trainer(config, data_dir, run_dir, False, [], world)
        trainer.prefetch = ahead  # the device's choice (stream.collates_ahead) either way
        began = time.perf_counter()
        trainer.run()
        wall = time.perf_counter() - began
        trainer.metrics.close()
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    train = [r for r in records if r["kind"] == "train"]
    steady = statistics.median(r["tokens_per_s"] for r in train[len(train) // 2:])
    reached = next((r["elapsed_s"] for r in train if r["tokens_per_s"] >= 0.9 * steady), None)
    first_minute = [r for r in train if r["elapsed_s"] <= 60]
    # The step alone, on batches collated beforehand.
    batches = [trainer.stream.next() for _ in range(12)]
    step = trainer.progress.step

    def run_steps() -> float:
        sync(device)
        start = time.perf_counter()
        for i, b in enumerate(batches):
            train_module.train_step(trainer.train_model, trainer.ddp, trainer.optimizer, [b],
                                    step + i + 1, trainer.config, world, kernel=trainer.kernel,
                                    scaler=trainer.scaler)
        sync(device)
        return time.perf_counter() - start

    run_steps()
    step_s = min(run_steps() for _ in range(2))
    step_tps = sum(b.n_tokens for b in batches) / step_s
    row = {"collate_ahead": ahead, "steps": trainer.progress.step, "wall_s": wall,
           "loop_tokens_per_s": steady, "step_tokens_per_s": step_tps,
           "loop_vs_step": steady / step_tps, "seconds_to_90pct": reached,
           "first_minute_tokens_per_s": (first_minute[-1]["tokens"] / first_minute[-1]["elapsed_s"]
                                         if first_minute else None),
           "parameters_m": trainer.model.num_parameters() / 1e6,
           "precision": trainer.precision}
    return row, trainer.model, trainer.data.tokenizers


# --------------------------------------------------------------------------- decode
# (label, bf16, decoding budget: None for the device's default, cuDNN's attention allowed).
# The last row asks whether SDPA's cuDNN backend (bf16/fp16 only, preferred on Hopper, a
# graph built per new shape, and decoding's shapes change every step) is what makes bf16
# decoding many times slower than fp32 on an H100.
DECODE_SETTINGS = (("fp32, 8,192-token batches (a CPU's)", False, 8192, True),
                   ("fp32, device default batches", False, None, True),
                   ("bf16, device default batches", True, None, True),
                   ("bf16, device default batches, no cuDNN attention", True, None, False))


@contextmanager
def cudnn_attention(enabled: bool):
    """SDPA's cuDNN backend on or off (a process-wide switch), put back afterwards."""
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(enabled)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


def bench_decode(label: str, model: Transformer, tokenizers, sources: list[str],
                 device: torch.device, beams: tuple[int, ...]) -> list:
    """Sentences/s of the Translator over ``sources``, for each search and setting."""
    rows = []
    for beam in beams:
        search = Search(beam=beam, alpha=0.6)
        outputs = {}
        for name, bf16, budget, cudnn in DECODE_SETTINGS:
            t = Translator(model, tokenizers, decode_tokens=budget, device=device, bf16=bf16)
            with cudnn_attention(cudnn):
                t.translate(sources[:32], search=search)  # warm-up
                sync(device)
                start = time.perf_counter()
                out = t.translate(sources, search=search)
                sync(device)
                seconds = time.perf_counter() - start
            outputs[name] = out
            words = sum(len(o.split()) for o in out) / len(out)
            rows.append({"model": label, "beam": beam, "setting": name,
                         "decode_tokens": t.decode_tokens, "sentences": len(sources),
                         "seconds": seconds, "sentences_per_s": len(sources) / seconds,
                         "mean_output_words": words})
            print(f"  decode {label} beam {beam} [{name}]: {len(sources) / seconds:,.0f} "
                  f"sentences/s (budget {t.decode_tokens})", flush=True)
        first = next(iter(outputs.values()))
        for name, out in outputs.items():
            same = sum(a == b for a, b in zip(first, out, strict=True)) / len(first)
            for r in rows:
                if r["beam"] == beam and r["setting"] == name and r["model"] == label:
                    r["same_as_first_setting"] = same
    return rows


# --------------------------------------------------------------------------- profile
def profile(fn, device: torch.device, path: Path, rows: int = 15) -> dict:
    """Run ``fn`` twice (warm), then once under torch.profiler; write the kernel table."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    sync(device)
    start = time.perf_counter()
    with torch_profile(activities=activities) as prof:
        fn()
        sync(device)
    wall = time.perf_counter() - start
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=rows)
    path.write_text(table)
    # The device's own rows alone, as torch's table totals them: an operator's row holds its
    # kernels' time too, so a sum over every row counts each kernel twice.
    device_us = sum(e.self_device_time_total for e in prof.key_averages()
                    if e.device_type == DeviceType.CUDA and not e.is_user_annotation)
    return {"wall_s": wall, "device_busy_s": device_us / 1e6,
            "device_busy_share": device_us / 1e6 / wall if wall else None, "table": str(path)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True, help="a prepared directory (Bible)")
    p.add_argument("--run", type=Path, required=True, help="a run directory (the demo's)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--sections", default="step,loop,decode,profile")
    p.add_argument("--configs", default="demo,small,base", help="step section's model shapes")
    p.add_argument("--step-tokens", type=int, default=25_000)
    p.add_argument("--loop-seconds", type=float, default=45.0)
    p.add_argument("--loop-runs", type=int, choices=(1, 2), default=2,
                   help="2: the loop without and with collating ahead; 1: with only")
    p.add_argument("--compile-configs", default="base",
                   help="configs whose step is also timed under torch.compile ('' for none; "
                        "with --quick the tiny one unless '')")
    p.add_argument("--out", type=Path, default=Path("gpu.json"))
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks every path")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    sections = set(args.sections.split(","))
    out_dir = args.out.parent
    result: dict = {"device": describe(device), "date": time.strftime("%Y-%m-%d"),
                    "command": " ".join(sys.argv)}
    print(json.dumps(result["device"]), flush=True)
    peak_n = 256 if args.quick else 8192
    began = time.perf_counter()

    def save(section: str | None = None) -> None:
        args.out.write_text(json.dumps(result, indent=1))
        if section is not None:  # the section alone, beside --out (gpu.step.json, ...)
            alone = {k: result[k] for k in ("device", "date", "command") if k in result}
            alone.update({k: v for k, v in result.items() if k in (section, f"{section}_error")
                          or (section == "step" and k == "peak_bf16_tflops")})
            args.out.with_name(f"{args.out.stem}.{section}.json").write_text(
                json.dumps(alone, indent=1))

    # What the decode and profile sections read, loaded first: a run or data that did not
    # travel fails here in seconds, not after the step and loop sections spent their minutes.
    if "decode" in sections or "profile" in sections:
        _, demo_model, demo_tokenizers = load_run(args.run, "best")
        demo_model.to(device).eval()
        pairs = load_prepared(args.data).split("test")
        sources = [src for src, _ in pairs][:40 if args.quick else None]
    loop_model: dict = {}  # the loop section's model, which the decode section decodes too

    def step_section() -> None:
        result["peak_bf16_tflops"] = matmul_peak(device, peak_n) / 1e12
        result["step"] = []
        for name in ["tiny"] if args.quick else args.configs.split(","):
            row = bench_step(name, device, 512 if args.quick else args.step_tokens,
                             2 if args.quick else 3, 1 if args.quick else 5,
                             name in args.compile_configs.split(",")
                             or (args.quick and args.compile_configs != ""), peak_n,
                             # quick on a CPU: dynamo's tracing without minutes of C++ builds
                             "eager" if args.quick and device.type == "cpu" else "inductor")
            result["step"].append(row)
            print(f"  step {name}: " + ", ".join(
                f"{n} {row[n]['tokens_per_s']:,.0f} tok/s MFU {100 * row[n]['mfu']:.0f}%"
                for n in ("aiayn", "aiayn compiled", "nn.Transformer") if n in row)
                + f"; aiayn/ref {row['ratio_vs_reference']:.2f} "
                f"[{time.perf_counter() - began:.0f}s]", flush=True)
            save("step")

    def loop_section() -> None:
        result["loop"] = []
        for ahead in (False, True)[2 - args.loop_runs:]:
            row, model, tokenizers = bench_loop(
                args.data, device, 2048 if args.quick else args.step_tokens,
                2 if args.quick else args.loop_seconds, ahead, args.quick)
            loop_model.update(model=model, tokenizers=tokenizers)
            result["loop"].append(row)
            print(f"  loop (collate ahead {ahead}): {row['loop_tokens_per_s']:,.0f} tok/s = "
                  f"{100 * row['loop_vs_step']:.0f}% of its step; 90% after "
                  f"{row['seconds_to_90pct']} s [{time.perf_counter() - began:.0f}s]", flush=True)
            save("loop")

    def decode_section() -> None:
        result["decode"] = bench_decode("demo", demo_model, demo_tokenizers, sources, device,
                                        (4, 1))
        save("decode")
        if loop_model:
            result["decode"] += bench_decode("base-shaped (loop)", loop_model["model"].eval(),
                                             loop_model["tokenizers"], sources, device, (4,))
            save("decode")

    def profile_section() -> None:
        result["profile"] = {}
        for suffix, bf16 in (("", False), ("_bf16", True)):  # bf16: where its time goes
            t = Translator(demo_model, demo_tokenizers, device=device, bf16=bf16)
            result["profile"][f"decode_demo_beam4{suffix}"] = profile(
                lambda t=t: t.translate(sources, search=Search(beam=4, alpha=0.6)), device,
                out_dir / f"profile_decode{suffix}.txt")
            save("profile")
        cfg = load_config(REPO / "configs" / ("tiny.yaml" if args.quick else "base.yaml")).model
        groups = bucket(sentence_lengths(100_000, max_len=cfg.max_len, seed=0),
                        1024 if args.quick else args.step_tokens)
        b = make_batch(representative(groups, 1)[0], cfg.tgt_vocab_size)
        b.src, b.tgt_in, b.tgt_out = (x.to(device) for x in (b.src, b.tgt_in, b.tgt_out))
        model = Transformer(cfg).to(device)
        step = training_steps(model, [b], bf16=True)[0]
        result["profile"]["train_step_base"] = profile(step, device, out_dir / "profile_step.txt")
        save("profile")

    # One section's failure is its own: what it measured and its traceback are saved, and
    # the sections after it still run (a GPU session has no minutes for a second start).
    failed = []
    for name, section in (("step", step_section), ("loop", loop_section),
                          ("decode", decode_section), ("profile", profile_section)):
        if name not in sections:
            continue
        try:
            section()
        except Exception:
            failed.append(name)
            result[f"{name}_error"] = traceback.format_exc()
            print(f"  {name} failed [{time.perf_counter() - began:.0f}s]:\n"
                  f"{result[f'{name}_error']}", flush=True)
            save(name)
    result["seconds"] = time.perf_counter() - began
    save()
    print(json.dumps({k: v for k, v in result.items() if k != "device"}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
