#!/usr/bin/env bash
# bench/h200.sh — the GPU measurements of LoRA and of the rollout's speed, run on one GPU machine in two commands.
#
# The machine has its own torch, CUDA and transformers; vLLM, Ray, PEFT and TRL arrive as wheels unpacked under
# /tmp/site (tracerl's side) and /tmp/trl-site (TRL's side), and SmolLM2's tokenizer folder under $TOKENIZER (the
# random-weight shapes borrow it: bench/shapes.py). Each part writes its JSON and its log under $OUT.
#
#   OUT=/tmp/out bash bench/h200.sh PART...   each PART in turn (each command a machine runs stays under 10 minutes):
#     gpu-lora-tests          tests/test_gpu.py's LoRA tests (vLLM serving the adapter the trainer recomputes)
#     lora-push-8b            bench/lora_push.py at the Qwen3-8B shape, rank 16
#     rollout-profile-135m    bench/rollout_profile.py at SmolLM2-135M's shape, the math recipe's step (32 x 8 x 256)
#     rollout-profile-1.7b    the same at the Qwen3-1.7B shape
#     vs-trl-lora-8b          LoRA at the 8B shape: tracerl against TRL + PEFT + colocated vLLM (bench/vs_trl.py)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the folder the results go to}
TOKENIZER=${TOKENIZER:-/tmp/smollm2}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site VLLM_USE_V2_MODEL_RUNNER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn VLLM_USE_FLASHINFER_SAMPLER=0 \
  RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

part() {   # part NAME SECONDS command...: the command's output in $OUT/NAME.log, its exit status on one line
  local name=$1 cap=$2 start=$SECONDS
  shift 2
  timeout "$cap" "$@" >"$OUT/$name.log" 2>&1
  echo "$name: exit $? in $((SECONDS - start)) s"
}

shape() {  # shape NAME: a random-weight folder of bench/shapes.py's NAME, made once
  [ -f "/tmp/$1/config.json" ] || python3 bench/shapes.py "$1" "/tmp/$1" --tokenizer "$TOKENIZER" >/dev/null
  echo "/tmp/$1"
}

smollm2_shape() {  # SmolLM2-135M's architecture, random weights, its own tokenizer
  [ -f /tmp/smollm2-shape/config.json ] || python3 -c "
import sys, shutil, glob; sys.path.insert(0, 'bench')
from gpu import smollm2_shape_dir
smollm2_shape_dir('/tmp/smollm2-shape')
for f in glob.glob('$TOKENIZER/*token*') + glob.glob('$TOKENIZER/chat_template.jinja'): shutil.copy(f, '/tmp/smollm2-shape')
" >/dev/null 2>&1
  echo /tmp/smollm2-shape
}

for name in "$@"; do
  case "$name" in
    gpu-lora-tests) part "$name" 300 python3 -m pytest -x -q -s tests/test_gpu.py -k lora ;;
    lora-push-8b) part "$name" 360 python3 bench/lora_push.py --model "$(shape qwen3-8b)" --rank 16 \
      --out "$OUT/$name.json" ;;
    rollout-profile-135m) part "$name" 240 python3 bench/rollout_profile.py --model "$(smollm2_shape)" \
      --out "$OUT/$name.json" ;;
    rollout-profile-1.7b) part "$name" 240 python3 bench/rollout_profile.py --model "$(shape qwen3-1.7b)" \
      --out "$OUT/$name.json" ;;
    vs-trl-lora-8b) part "$name" 480 python3 bench/vs_trl.py --preset h200-lora --lora-rank 16 --steps 3 \
      --model "$(shape qwen3-8b)" --trl-python python3 --trl-pythonpath /tmp/trl-site --out /tmp/vs-trl-lora \
      --json "$OUT/$name.json"
      cp /tmp/vs-trl-lora/*.log "$OUT/" 2>/dev/null ;;
    *) echo "unknown part $name" >&2; exit 2 ;;
  esac
done
