#!/usr/bin/env bash
# bench/h200_38.sh — the rollout against raw vLLM, and tracerl against TRL at the sizes people train, on one H200.
#
# Runs PARTs in order, each under a time cap and all under one deadline (BUDGET_S, default 590 s: one command of a
# 10-minute limit), writing each part's JSON and log under $OUT and, at the end, $OUT/summary.json with the figures
# that matter from each. A part that would not get its minimum time is skipped (and says so in the summary); a vs-trl
# part stops its own sides at its cap, so its summary is always written.
#
# The machine has its own torch, CUDA and transformers; vLLM and Ray arrive as wheels unpacked under /tmp/site, TRL
# under /tmp/trl-site (tracerl's process never sees it), and SmolLM2's tokenizer folder under $TOKENIZER (default
# /tmp/smollm2; the random-weight shapes borrow it: bench/shapes.py). Model folders are made once under /tmp/shapes,
# the vs-trl work folders are /tmp/PART: on a machine still warm, a second command reuses both, and its sides
# add up with the first command's in one summary per size.
#
#   OUT=/tmp/out [BUDGET_S=590] [SIDES=tracerl,trl-vllm-nogc] bash bench/h200_38.sh [PART...]
#     profile-135m   bench/rollout_profile.py at SmolLM2-135M's shape (32 prompts x 8 samples x 256 tokens), ~3-4 min
#     profile-1.7b   the same at the Qwen3-1.7B shape, ~4 min
#     vs-trl-0.6b    bench/vs_trl.py --preset h200-qwen3-0.6b: tracerl, TRL without and with gradient checkpointing
#                    (3 RL steps each, every reply 256 tokens), ~5-6 min
#     vs-trl-1.7b    the same at Qwen3-1.7B, ~6-7 min
#     vs-trl-4b      the same at Qwen3-4B, ~8-9 min
#     vs-trl-8b      the same at Qwen3-8B (what fits: full fine-tuning is expected to run out of memory)
#     mbt-0.6b       tracerl's side of vs-trl-0.6b alone, its micro-batches auto-sized (0), then capped at 8,192 and
#                    16,384 tokens (--actor.micro_batch_tokens): what its memory peak buys in speed, ~2.5 min each
#   With no PART: all but vs-trl-8b, in the order above (more than one command holds: the deadline cuts the rest).
#   Two commands that fit: `profile-135m profile-1.7b` then `vs-trl-0.6b`; or SIDES to split a size's three sides.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the folder the results go to}
TOKENIZER=${TOKENIZER:-/tmp/smollm2}
BUDGET_S=${BUDGET_S:-590}
SIDES=${SIDES:-}
SHAPES=/tmp/shapes
KEEP_S=25                              # kept at the end for the summary
mkdir -p "$OUT" "$SHAPES"
export PYTHONPATH=/tmp/site VLLM_USE_V2_MODEL_RUNNER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn \
  VLLM_USE_FLASHINFER_SAMPLER=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false
# one set of compile caches for every part (vLLM's, inductor's, Triton's): a part loads what an earlier one compiled for
# the same model and engine settings (the 1.7B profile's engine for the 1.7B pair's tracerl side, TRL's first side for
# its second), so later parts start sooner; seconds per step and per round are unaffected
CACHES=/tmp/bench-caches
export VLLM_CACHE_ROOT=$CACHES/vllm TORCHINDUCTOR_CACHE_DIR=$CACHES/inductor TRITON_CACHE_DIR=$CACHES/triton
START=$SECONDS
PARTS=("$@")
[ ${#PARTS[@]} -gt 0 ] || PARTS=(profile-135m profile-1.7b vs-trl-0.6b vs-trl-1.7b vs-trl-4b)

# ---- what the machine must have, checked before any device time goes ------------------------------------------------
fail() { echo "h200_38: $*" >&2; exit 2; }
command -v nvidia-smi >/dev/null || fail "no nvidia-smi: this script needs the GPU machine"
python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || fail "torch sees no CUDA GPU"
python3 -c "import vllm" 2>/dev/null || fail "vLLM does not import with PYTHONPATH=/tmp/site (unpack its wheels there)"
PYTHONPATH=/tmp/trl-site:/tmp/site python3 -c "import trl" 2>/dev/null \
  || fail "TRL does not import from /tmp/trl-site (docs/vs-trl.md: unpack its four wheels there)"
[ -f "$TOKENIZER/tokenizer.json" ] && [ -f "$TOKENIZER/config.json" ] \
  || fail "no tokenizer folder at $TOKENIZER (SmolLM2's: tokenizer.json and config.json; set TOKENIZER)"
for part in "${PARTS[@]}"; do
  case "$part" in profile-135m|profile-1.7b|vs-trl-0.6b|vs-trl-1.7b|vs-trl-4b|vs-trl-8b|mbt-0.6b) ;;
    *) fail "unknown part $part" ;; esac
done
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader > "$OUT/gpu-before.txt"

# ---- parts ------------------------------------------------------------------------------------------------------
: > "$OUT/parts.jsonl"
record() {  # record NAME STATUS SECONDS
  echo "{\"part\": \"$1\", \"status\": \"$2\", \"seconds\": $3}" >> "$OUT/parts.jsonl"
  echo "$1: $2 in $3 s"
}

cap_for() {  # cap_for CAP: the part's cap, cut to what is left of the budget
  local left=$((BUDGET_S - (SECONDS - START) - KEEP_S))
  echo $(( $1 < left ? $1 : left ))
}

shape() {  # shape NAME: bench/shapes.py's random-weight folder of NAME (made once), its path on stdout
  python3 bench/shapes.py "$1" "$SHAPES/shape-$1" --tokenizer "$TOKENIZER" 2>>"$OUT/shapes.log" >/dev/null \
    && echo "$SHAPES/shape-$1"
}

profile() {  # profile PART SHAPE CAP: the rollout profile; it leaves out the rounds its budget cannot hold
  local cap start=$SECONDS model
  cap=$(cap_for "$3")
  if [ "$cap" -lt 150 ]; then record "$1" "skipped: ${cap} s left" 0; return; fi
  if ! model=$(shape "$2"); then record "$1" "failed: no $2 folder (see shapes.log)" $((SECONDS - start)); return; fi
  timeout --kill-after=20 $((cap - (SECONDS - start))) python3 bench/rollout_profile.py --preset h200 \
    --model "$model" --budget-s $((cap - (SECONDS - start) - 20)) --out "$OUT/$1.json" >"$OUT/$1.log" 2>&1
  record "$1" "exit $?" $((SECONDS - start))
}

vs_trl() {  # vs_trl PART SIZE CAP [FLAG=VALUE...]: bench/vs_trl.py's h200-qwen3-SIZE preset in /tmp/PART, its sides
            # stopped at the cap; FLAG=VALUEs go to tracerl's train.py, and its side then runs alone
  local part=$1 size=$2 cap start=$SECONDS work=/tmp/$1 sides=$SIDES set=()
  cap=$(cap_for "$3"); shift 3
  for flag in "$@"; do set+=(--tracerl-set "$flag"); sides=tracerl; done
  if [ "$cap" -lt 120 ]; then record "$part" "skipped: ${cap} s left" 0; return; fi
  mkdir -p "$OUT/$part"
  timeout --kill-after=30 "$cap" python3 bench/vs_trl.py --preset "h200-qwen3-$size" --tokenizer "$TOKENIZER" \
    --shapes-dir "$SHAPES" --trl-python python3 --trl-pythonpath /tmp/trl-site --caches shared --cache-dir "$CACHES" \
    --budget-s $((cap - 15)) --out "$work" --json "$OUT/$part.json" ${sides:+--sides "$sides"} "${set[@]}" \
    >"$OUT/$part.log" 2>&1
  local code=$?
  cp "$work"/*.log "$work"/*.json "$OUT/$part/" 2>/dev/null
  cp "$work"/tracerl/metrics.jsonl "$OUT/$part/tracerl-metrics.jsonl" 2>/dev/null
  record "$part" "exit $code" $((SECONDS - start))
}

for part in "${PARTS[@]}"; do
  case "$part" in
    profile-135m) profile "$part" smollm2-135m 300 ;;
    profile-1.7b) profile "$part" qwen3-1.7b 330 ;;
    vs-trl-0.6b) vs_trl "$part" 0.6b 480 ;;
    vs-trl-1.7b) vs_trl "$part" 1.7b 540 ;;
    vs-trl-4b) vs_trl "$part" 4b 580 ;;
    vs-trl-8b) vs_trl "$part" 8b 580 ;;
    mbt-0.6b) for tokens in 0 8192 16384; do
                vs_trl "vs-trl-0.6b-mbt$tokens" 0.6b 200 "actor.micro_batch_tokens=$tokens"; done ;;
  esac
done

# ---- the summary: each part's figures that matter -----------------------------------------------------------------
COMMIT=$(git rev-parse HEAD 2>/dev/null || echo "${COMMIT:-unknown}") python3 - "$OUT" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
summary = {"commit": os.environ.get("COMMIT", ""),
           "parts": [json.loads(line) for line in open(os.path.join(out, "parts.jsonl"))]}
for path in sorted(glob.glob(os.path.join(out, "profile-*.json"))):
    d = json.load(open(path))
    tracerl = d.get("phases_instrumented_round", {}).get("tracerl", {})
    summary[os.path.basename(path)[:-5]] = {key: d.get(key) for key in (
        "model", "rounds_run", "fixed_lengths", "median_s", "tokens_per_s", "tracerl_over_raw",
        "tracerl_over_raw_per_round_median", "within_5pct_of_raw_n")} | {
        "tracerl_timeline_s": tracerl.get("timeline_s"), "limits": d.get("limits")}
for path in sorted(glob.glob(os.path.join(out, "vs-trl-*.json"))):
    d = json.load(open(path))
    sides = {}
    for side in d.get("fits", {}):
        r = d[side]
        if "s_per_step" not in r:
            sides[side] = {"error": r["error"], "out_of_memory": r.get("out_of_memory")}
            continue
        limits = (r.get("limits") or {}).get("phases", {})
        sides[side] = {"s_per_step": r["s_per_step"], "phases": r["phases"],
                       "peak_gpu_memory_mib": r.get("peak_gpu_memory_mib"),
                       "trainer_peak_reserved_gib": r.get("trainer_peak_reserved_gib"),
                       "every_reply_full_length": r.get("every_reply_full_length"),
                       "x_bound": {phase: v["x_bound"] for phase, v in limits.items()}}
    summary[os.path.basename(path)[:-5]] = {"model": d.get("model"), "fits": d.get("fits"),
                                            "ratios": d.get("ratios"), "sides": sides}
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
print(json.dumps(summary, indent=1))
EOF
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader > "$OUT/gpu-after.txt"
echo "h200_38: $((SECONDS - START)) s in all; $OUT/summary.json"
