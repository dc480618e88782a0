#!/usr/bin/env bash
# One GPU session's measurements, in well under 8 minutes on an H100 or H200: the bf16
# matmul peak; the base model's training step eager, under torch.compile and in fp16 with
# the gradient scaler, with MFU against that peak and nn.Transformer beside it; the
# `aiayn train` loop against its own step; the demo's decoding, beam 4 and greedy, in fp32
# and bf16 (translations compared); profiles of a base step and of fp32 and bf16 decoding.
#
#   DATA=data/bible-eng-spa RUN=runs/demo OUT=out bash benchmarks/gpu_session.sh
#   DATA=... RUN=... OUT=... bash benchmarks/gpu_session.sh --quick   # every path, a CPU
#
# DATA: a directory `aiayn prepare --corpus bible:eng-spa` wrote; RUN: the demo's run
# directory (`make demo`); both travel with the working tree to a machine that cannot
# prepare or download them. OUT receives one JSON per section (gpu.step.json, gpu.loop.json,
# gpu.decode.json, gpu.profile.json), the three profile tables and the log: eight files,
# copied there even when the session is cut short. PYTHON: the interpreter (python3).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DATA:=data/bible-eng-spa}" "${RUN:=runs/demo}" "${OUT:?set OUT to the results folder}"
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
work=$(mktemp -d)
mkdir -p "$OUT"
keep() { cp "$work"/gpu.*.json "$work"/profile_*.txt "$work"/session.log "$OUT"/ 2>/dev/null || true; }
trap keep EXIT

if [[ "${1:-}" == "--quick" ]]; then
  # The same sections on the CPU at tiny sizes (the suite runs this; torch.compile's
  # tracing left out: seconds on two cores).
  args=(--device cpu --quick --loop-runs 1 --compile-configs "")
else
  # ~1 min step (compile included), ~1.5 min loop (45 s and its set-up and validation),
  # ~2 min decoding (bf16 beam 4 ran at 73 sentences/s), ~1 min profiles.
  args=(--device cuda --configs base --compile-configs base --loop-seconds 45 --loop-runs 1)
fi
"$PYTHON" benchmarks/gpu.py --data "$DATA" --run "$RUN" --out "$work/gpu.json" "${args[@]}" \
  2>&1 | tee "$work/session.log"
