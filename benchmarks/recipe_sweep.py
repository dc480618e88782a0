"""Recipe sweep: train recipes for a fixed budget of training tokens, report dev BLEU.

Sample efficiency (BLEU per training token) does not depend on the device, so recipes for
the CPU presets are searched here on whatever is fastest (a GPU when there is one), and the
winner's token budget is then converted to CPU minutes with the CPU's tokens/s. Each recipe
is a JSON object of overrides of ``DEFAULT`` below; the results are JSON lines.

    python benchmarks/recipe_sweep.py recipes.json --out results.jsonl [--device cuda]

recipes.json: ``[{"budget": 2e6, "norm_first": true, "peak": 1.5e-3, "max_tokens": 1024}, ...]``.
Schedules: "eq3" (the paper's, peaking at ``peak`` after ``warmup`` steps) and "linear"
(aiayn.training.optim.linear_decay over the token budget). Validation: greedy decoding of the whole
dev split at ``evals`` evenly spaced points of the budget; BLEU as `aiayn evaluate` scores it.
The results in benchmarks/results/recipe_sweep_h100.jsonl came from this loop (bf16, H100).
Several sweeps can share one GPU: the models are small, so run one process per recipe list.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from aiayn.config import ModelConfig
from aiayn.data.batching import TokenBatchSampler, collate
from aiayn.data.prepared import encode_split, load_prepared
from aiayn.evaluation.metrics import score
from aiayn.inference.search import greedy_decode
from aiayn.model import Transformer
from aiayn.training.optim import learning_rate, linear_decay

DEFAULT = dict(data="data/bible-eng-spa", d_model=256, n_heads=4, d_ff=1024, enc=3, dec=3,
               dropout=0.1, norm_first=False, tie="all", emb_init="xavier", max_tokens=2048,
               peak=1e-3, warmup=400, schedule="eq3", budget=2.0e6, ls=0.1, clip=1.0,
               beta2=0.98, seed=1, bf16=True, evals=2)


def lr_at(r: dict, step: int, fraction: float) -> float:
    """The learning rate of update ``step`` with ``fraction`` of the token budget used."""
    if r["schedule"] == "eq3":  # scaled so that the peak (at step == warmup) is r["peak"]
        scale = r["peak"] * (r["d_model"] * r["warmup"]) ** 0.5
        return learning_rate(step, r["d_model"], r["warmup"], scale)
    if r["schedule"] == "linear":
        return linear_decay(step, r["warmup"], r["peak"], fraction)
    raise ValueError(f"unknown schedule {r['schedule']!r}")


def run(r: dict, device: torch.device, cache: dict) -> dict:
    torch.manual_seed(r["seed"])
    if r["data"] not in cache:
        prepared = load_prepared(r["data"])
        train, _ = encode_split(prepared.train, prepared.tokenizers, 256, "drop")
        dev, _ = encode_split(prepared.dev, prepared.tokenizers, 256, "truncate")
        cache[r["data"]] = (prepared, train, dev)
    prepared, train, dev = cache[r["data"]]
    tok = prepared.tokenizers
    cfg = ModelConfig(src_vocab_size=tok.src_vocab_size, tgt_vocab_size=tok.tgt_vocab_size,
                      d_model=r["d_model"], n_heads=r["n_heads"], d_ff=r["d_ff"],
                      n_encoder_layers=r["enc"], n_decoder_layers=r["dec"],
                      dropout=r["dropout"], max_len=256, norm_first=r["norm_first"],
                      tie_embeddings=r["tie"], embedding_init=r["emb_init"])
    model = Transformer(cfg).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.0, betas=(0.9, r["beta2"]), eps=1e-9,
                                 fused=device.type in ("cpu", "cuda"))
    sampler = TokenBatchSampler([len(e.src) for e in train], [len(e.tgt) for e in train],
                                r["max_tokens"], shuffle=True, seed=r["seed"])
    budget = r["budget"]
    eval_at = [budget * (i + 1) / r["evals"] for i in range(r["evals"])]
    seen = step = 0
    curve = []
    start = time.perf_counter()
    batches = iter(sampler)  # the sampler moves on to the next epoch by itself
    model.train()
    while seen < budget:
        positions = next(batches, None)
        if positions is None:
            batches = iter(sampler)
            positions = next(batches)
        batch = collate([train[i] for i in positions]).to(device)
        step += 1
        for group in optimizer.param_groups:
            group["lr"] = lr_at(r, step, seen / budget)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=r["bf16"]):
            # the summed loss as aiayn.training.loop computes it (Transformer.forward with targets)
            loss = model(batch.src, batch.tgt_in, batch.tgt_out, label_smoothing=r["ls"])
        (loss / batch.n_tokens).backward()
        if r["clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), r["clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seen += batch.n_tokens
        if eval_at and seen >= eval_at[0]:
            eval_at.pop(0)
            curve.append(evaluate(model, dev, prepared, device, r["bf16"], seen, step))
            model.train()
    return dict(r, steps=step, seconds=time.perf_counter() - start, curve=curve,
                bleu=curve[-1]["bleu"], params=model.num_parameters())


@torch.no_grad()
def evaluate(model, dev, prepared, device, bf16: bool, seen: int, step: int) -> dict:
    """Dev NLL (teacher forcing) and greedy BLEU/chrF of the whole dev split."""
    model.eval()
    hyps = [""] * len(dev)
    order = sorted(range(len(dev)), key=lambda i: len(dev[i].src))
    nll = tokens = 0.0
    for s in range(0, len(order), 128):
        chunk = order[s:s + 128]
        batch = collate([dev[i] for i in chunk]).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            nll += model(batch.src, batch.tgt_in, batch.tgt_out).item()
            ids = greedy_decode(model, batch.src)
        tokens += batch.n_tokens
        for i, text in zip(chunk, prepared.tokenizers.decode_tgt(ids), strict=True):
            hyps[i] = text
    scores = score(hyps, [prepared.dev[e.index][1] for e in dev])
    return {"tokens": seen, "step": step, "bleu": round(scores.bleu, 2),
            "chrf": round(scores.chrf, 2), "nll": round(nll / tokens, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipes", help="JSON file: a list of override objects")
    parser.add_argument("--out", required=True, help="JSON lines, one result per recipe")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-seconds", type=float, default=float("inf"),
                        help="start no recipe after this many seconds")
    args = parser.parse_args()
    device = torch.device(args.device)
    with open(args.recipes, encoding="utf-8") as fh:
        recipes = json.load(fh)
    cache: dict = {}
    began = time.time()
    for i, overrides in enumerate(recipes):
        if time.time() - began > args.max_seconds:
            print(f"time is up: {len(recipes) - i} recipe(s) not run")
            break
        result = run(dict(DEFAULT, **overrides), device, cache)
        with open(args.out, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(result) + "\n")
        print(f"[{i}] {overrides} -> dev BLEU {result['bleu']} after {result['steps']} steps "
              f"({result['seconds']:.0f} s); curve {[c['bleu'] for c in result['curve']]}",
              flush=True)


if __name__ == "__main__":
    main()
