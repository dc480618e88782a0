#!/usr/bin/env bash
# One GPU session's measurements, about 7 minutes on an H100 or H200 (the base step's
# torch.compile alone took 132 s on an H100): the bf16 matmul peak; the base model's training
# step eager, under torch.compile and in fp16 with the gradient scaler, with MFU against that
# peak and nn.Transformer beside it; the `aiayn train` loop against its own step; the demo's
# decoding, beam 4 and greedy, in fp32 and bf16 (translations compared); profiles of a base
# step and of fp32 and bf16 decoding.
#
#   DATA=data/bible-eng-spa RUN=.gpu/run OUT=out bash benchmarks/gpu_session.sh
#   DATA=... RUN=... OUT=... bash benchmarks/gpu_session.sh --quick   # every path, a CPU
#
# DATA: a directory `aiayn prepare --corpus bible:eng-spa` wrote; RUN: the demo's run
# directory (`make demo`), or the part of it that is read: config.yaml, tokenizer/ and
# best.safetensors. A device machine cannot prepare or download them, and what travels there
# is capped (64 MiB for the device tool of this project: runs/demo with its checkpoints is
# ~250 MB), so carry the data (~13 MB) and that part (~19 MB):
#   mkdir -p .gpu/run && cp -r runs/demo/{config.yaml,tokenizer,best.safetensors} .gpu/run/
#   (.gpu/ is ignored by git; carry: data/bible-eng-spa and .gpu/run)
# OUT receives one JSON per section (gpu.step.json, gpu.loop.json, gpu.decode.json,
# gpu.profile.json; a section that fails saves its traceback there and the next ones run),
# the three profile tables and the log: eight files, copied there every 10 s as they are
# written and at the end, so a session killed at its limit keeps what it measured.
# PYTHON: the interpreter (python3).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DATA:=data/bible-eng-spa}" "${RUN:=runs/demo}" "${OUT:?set OUT to the results folder}"
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
work=$(mktemp -d)
mkdir -p "$OUT"
keep() { cp "$work"/gpu.*.json "$work"/profile_*.txt "$work"/session.log "$OUT"/ 2>/dev/null || true; }
(while sleep 10; do keep; done) >/dev/null 2>&1 &  # a kill at the limit runs no trap
copier=$!
trap 'kill $copier 2>/dev/null; keep' EXIT

if [[ "${1:-}" == "--quick" ]]; then
  # The same sections on the CPU at tiny sizes (the suite runs this; torch.compile's
  # tracing left out: seconds on two cores).
  args=(--device cpu --quick --loop-runs 1 --compile-configs "")
else
  # ~2.5 min step (compile included), ~1.2 min loop (45 s and its set-up and validation),
  # ~1.5 min decoding (bf16 beam 4 ran at 73-90 sentences/s), ~1 min profiles.
  args=(--device cuda --configs base --compile-configs base --loop-seconds 45 --loop-runs 1)
fi
"$PYTHON" benchmarks/gpu.py --data "$DATA" --run "$RUN" --out "$work/gpu.json" "${args[@]}" \
  2>&1 | tee "$work/session.log"
