#!/usr/bin/env bash
# Creates the peers' virtual environments for benchmarks/peers/run.py, idempotently:
#   .venvs/joeynmt  JoeyNMT 2.3.0
#   .venvs/opennmt  OpenNMT-py 3.5.1
# torch==2.13.0 (the CPU build aiayn uses) goes in first and constraints.txt holds it there.
# JoeyNMT asks for torch>=1.12, which that satisfies: it installs with all its declared
# requirements (and one it forgets). OpenNMT-py 3.5.1 asks for torch<2.3: it installs with
# --no-deps, then its other declared requirements explicitly (the list below, copied from
# its metadata).
# Each venv's `pip freeze` goes to .venvs/NAME.freeze.txt.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
VENVS=${PEERS_VENVS:-$HERE/.venvs}
PYTHON=${PYTHON:-python3}
CONSTRAINTS=$HERE/constraints.txt
TORCH=torch==2.13.0
# JoeyNMT calls SentencePieceProcessor.SetVocabulary, which 0.2.3 (the newest) no longer
# has; 0.2.0 does. Both peers get the same release (run.py trains the model in either).
SENTENCEPIECE=sentencepiece==0.2.0

OPENNMT_REQUIREMENTS=(
  configargparse 'ctranslate2>=4,<5' 'tensorboard>=2.3' flask waitress 'pyonmttok>=1.37,<2'
  pyyaml sacrebleu rapidfuzz pyahocorasick fasttext-wheel spacy six
)

# new_venv NAME: the venv with torch in it; returns 1 when it is already complete.
new_venv() {
  local dir=$VENVS/$1
  if [ -f "$dir/.installed" ] && [ "$dir/.installed" -nt "$0" ]; then
    echo "$1: $dir is installed"
    return 1
  fi
  rm -rf "$dir"
  "$PYTHON" -m venv "$dir"
  "$dir/bin/python" -m pip install --quiet "$TORCH"
}

# finish NAME: record what ended up installed and mark the venv complete.
finish() {
  local dir=$VENVS/$1
  "$dir/bin/python" -m pip check || echo "$1: pip check reports the conflicts above (expected: the peer's torch pin)"
  "$dir/bin/python" -m pip freeze --all > "$VENVS/$1.freeze.txt"
  touch "$dir/.installed"
  echo "$1: installed in $dir ($(du -sh "$dir" | cut -f1))"
}

mkdir -p "$VENVS"

if new_venv joeynmt; then
  # joeynmt/helpers.py imports importlib_metadata, which JoeyNMT 2.3.0 does not declare.
  "$VENVS/joeynmt/bin/python" -m pip install --quiet -c "$CONSTRAINTS" joeynmt==2.3.0 \
    "$SENTENCEPIECE" importlib-metadata
  finish joeynmt
fi

if new_venv opennmt; then
  "$VENVS/opennmt/bin/python" -m pip install --quiet --no-deps OpenNMT-py==3.5.1
  "$VENVS/opennmt/bin/python" -m pip install --quiet -c "$CONSTRAINTS" \
    "${OPENNMT_REQUIREMENTS[@]}" "$SENTENCEPIECE"
  finish opennmt
fi
