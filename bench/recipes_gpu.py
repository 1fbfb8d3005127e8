# bench/recipes_gpu.py — every recipe's GPU default at its real shape, one `train.py` run each, with seconds per step
# and peak memory, into one JSON summary.
#
# What: geo3k (Qwen2.5-VL-3B, images, the python tool), tool_use (Qwen2.5-1.5B-Instruct), code_exec
# (Qwen2.5-Coder-1.5B-Instruct), judge (Qwen2.5-0.5B-Instruct judged by Qwen2.5-7B-Instruct on the same GPU) and
# distill (Qwen3-0.6B from Qwen3-1.7B): the models each recipe's GPU defaults name, read from the recipe itself.
# How:
#   1. No hub is reachable, so each model is built with RANDOM weights from its published config.json, the values
#      typed in below (SHAPES), and saved in bf16 safetensors with a Qwen-vocabulary tokenizer: Qwen's own 151,643
#      byte-level BPE ranks (`qwen.tiktoken`, shipped in the PyPI package `dashscope`), converted by transformers'
#      TikTokenConverter, with Qwen2.5's and Qwen3's added tokens at their ids (151643..151668) and the project's
#      ChatML template (data.CHATML_TEMPLATE) in place of each model's own. The VL model also gets Qwen2.5-VL's image
#      processor settings. Built once, on the GPU (`torch.device`), and kept under --work.
#   2. Each folder is also laid out as the Hugging Face hub cache would hold it under its hub id (HF_HUB_CACHE in
#      --work, HF_HUB_OFFLINE=1), so a model no flag names (the judge's 7B) resolves as it would for a user who
#      has downloaded it.
#   3. Per recipe, a subprocess runs train.py's main exactly as
#        python train.py --recipe NAME --model DIR [--run.ref_model DIR] --run.steps 3
#      with no other flag: with CUDA present the recipe picks its GPU defaults (models.gpu_defaults), as a user's
#      run does. A recipe that runs model code gets the sandbox this machine has; protections it lacks are accepted by name (TRACERL_SANDBOX_ACCEPT) and recorded in the summary.
#   4. Recorded per recipe: seconds per step and its phases (OUT/metrics.jsonl), start-up phases and time to the
#      first step (the run's own "tracerl: ... N s" lines), the final checkpoint's size and time, peak GPU memory of
#      the whole device (nvidia-smi polled every 0.5 s: the engine core and the judge are other processes, so
#      torch.cuda.max_memory_allocated would miss them), peak host RSS, and on failure the log's tail. The
#      checkpoint is deleted after each run (a 3B actor's fp32 weights and AdamW state are ~36 GB).
#   `--tiny` runs the same pipeline at tiny shapes of the same architectures (2 layers, hidden 64, the real
#   vocabulary) on a CPU, where the recipes take their CPU defaults; it exists to test this script.
#
#   python bench/recipes_gpu.py [--recipes geo3k tool_use code_exec judge distill] [--work /tmp/tracerl-recipes]
#                               [--out recipes-gpu.json] [--timeout 540] [--budget 570] [--tiny]
#   python bench/recipes_gpu.py --build-only ...       # build the models only (a machine's first minutes)
#   python bench/recipes_gpu.py --write-tokenizer      # here: the tokenizer folder to carry, .carry/qwen-tokenizer
import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import data  # noqa: E402
import models  # noqa: E402

TOKENIZER_CARRY = os.path.join(ROOT, ".carry", "qwen-tokenizer")
ALL_RECIPES = ("geo3k", "tool_use", "code_exec", "judge", "distill")

# ---- the published architectures (each model's config.json on the hub, typed in) ----

_QWEN = dict(bos_token_id=151643, eos_token_id=151645, pad_token_id=151643, hidden_act="silu", rms_norm_eps=1e-6,
             rope_theta=1e6, attention_dropout=0.0, initializer_range=0.02)
_QWEN25 = dict(_QWEN, model_type="qwen2", max_position_embeddings=32768, sliding_window=32768,
               use_sliding_window=False)
_QWEN3 = dict(_QWEN, model_type="qwen3", max_position_embeddings=40960, head_dim=128, attention_bias=False,
              max_window_layers=28, use_sliding_window=False)
_QWEN25_1_5B = dict(_QWEN25, vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                    num_attention_heads=12, num_key_value_heads=2, max_window_layers=21, tie_word_embeddings=True)
SHAPES = {
    "Qwen/Qwen2.5-0.5B-Instruct": dict(_QWEN25, vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                       max_window_layers=21, tie_word_embeddings=True),
    "Qwen/Qwen2.5-1.5B-Instruct": _QWEN25_1_5B,
    "Qwen/Qwen2.5-Coder-1.5B-Instruct": _QWEN25_1_5B,        # the same architecture as the 1.5B instruct model
    "Qwen/Qwen2.5-7B-Instruct": dict(_QWEN25, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                     num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                     max_window_layers=28, tie_word_embeddings=False),
    "Qwen/Qwen3-0.6B": dict(_QWEN3, vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                            num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                            tie_word_embeddings=True),
    "Qwen/Qwen3-1.7B": dict(_QWEN3, vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                            num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                            tie_word_embeddings=True),
    "Qwen/Qwen2.5-VL-3B-Instruct": dict(
        model_type="qwen2_5_vl", tie_word_embeddings=True, image_token_id=151655, video_token_id=151656,
        vision_start_token_id=151652, vision_end_token_id=151653,
        text_config=dict({k: v for k, v in _QWEN25.items() if k != "model_type"}, vocab_size=151936, hidden_size=2048,
                         intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                         num_key_value_heads=2, max_position_embeddings=128000, max_window_layers=70,
                         tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31], in_channels=3, hidden_act="silu",
                           tokens_per_second=2)),
}
# Qwen2.5-VL's preprocessor_config.json (the PIL backend, as models.load_image_processor reads it)
VL_PROCESSOR = dict(min_pixels=3136, max_pixels=12845056, patch_size=14, merge_size=2, temporal_patch_size=2)
INSTRUCT_EOS = [151645, 151643]       # generation_config.json of the instruct models: <|im_end|>, <|endoftext|>


def tiny_shape(config: dict) -> dict:
    """The same architecture at 2 layers and hidden 64 (the vocabulary kept, so the tokenizer still fits)."""
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_window_layers=2)
    if config["model_type"] == "qwen2_5_vl":
        text = dict(config["text_config"], **small, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                                     "mrope_section": [2, 3, 3]})
        vision = dict(config["vision_config"], depth=2, hidden_size=32, intermediate_size=64, num_heads=4,
                      out_hidden_size=64, fullatt_block_indexes=[1])
        return dict(config, text_config=text, vision_config=vision)
    return dict(config, **small, **({"head_dim": 16} if "head_dim" in config else {}))


# ---- the tokenizer: Qwen's vocabulary ----

# Qwen2's pre-tokenizer: as cl100k but one digit per piece
QWEN_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
# the added tokens from 151643 on, in id order: Qwen2.5's 22 (special ones first, then the plain-text markers),
# then Qwen3's four (plain text)
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_PLAIN = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
              "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def _qwen_tiktoken() -> str | None:
    import importlib.util
    spec = importlib.util.find_spec("dashscope")         # located, not imported (its __init__ needs its deps)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "resources", "qwen.tiktoken")
        if os.path.exists(path):
            return path
    return None


def write_tokenizer(folder: str) -> str:
    """Qwen's BPE (dashscope's qwen.tiktoken) as a fast tokenizer with Qwen2.5/Qwen3's added tokens at their ids,
    pad <|endoftext|>, eos <|im_end|> and data.CHATML_TEMPLATE; saved to `folder`. Returns where the ranks came
    from."""
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter
    ranks = _qwen_tiktoken()
    if ranks is None:
        raise FileNotFoundError("no qwen.tiktoken: `pip install --no-deps dashscope` (it ships Qwen's BPE ranks), or "
                                f"carry a folder written by `python bench/recipes_gpu.py --write-tokenizer` to "
                                f"{TOKENIZER_CARRY}")
    core = TikTokenConverter(vocab_file=ranks, pattern=QWEN_PATTERN).converted()
    core.normalizer = normalizers.NFC()
    core.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL]
                    + [AddedToken(t, special=False, normalized=False) for t in QWEN_PLAIN])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|endoftext|>", eos_token="<|im_end|>")
    ids = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|image_pad|>", "</think>"])
    if ids != [151643, 151655, 151668] or tokenizer.encode("Hello world!") != [9707, 1879, 0]:
        raise RuntimeError(f"the converted tokenizer is not Qwen's: added ids {ids}, 'Hello world!' -> "
                           f"{tokenizer.encode('Hello world!')} (Qwen: [9707, 1879, 0])")
    tokenizer.chat_template = data.CHATML_TEMPLATE
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)
    return ranks


def qwen_tokenizer(work: str) -> tuple[str, str]:
    """(folder of the Qwen-vocabulary tokenizer, where it came from): the carried folder, else one converted here."""
    if os.path.exists(os.path.join(TOKENIZER_CARRY, "tokenizer.json")):
        return TOKENIZER_CARRY, f"carried folder {TOKENIZER_CARRY}"
    folder = os.path.join(work, "qwen-tokenizer")
    if not os.path.exists(os.path.join(folder, "tokenizer.json")):
        return folder, f"converted from {write_tokenizer(folder)}"
    return folder, f"converted earlier, {folder}"


# ---- random-weight model folders, laid out as the hub cache holds them ----

def snapshot_dir(hub_cache: str, hub_id: str, config: dict, salt: str = "") -> str:
    """hub_cache/models--ORG--NAME/snapshots/REV (REV: a hash of the config and `salt`), with refs/main naming REV.
    Two names with one architecture get one REV, and share one folder (ensure_model)."""
    repo = os.path.join(hub_cache, "models--" + hub_id.replace("/", "--"))
    revision = hashlib.sha1((json.dumps(config, sort_keys=True) + salt).encode()).hexdigest()
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(revision)
    return os.path.join(repo, "snapshots", revision)


def build_model(folder: str, config: dict, tokenizer_dir: str, device: str) -> float:
    """Random weights of `config` (transformers' own init, run on `device`), saved in bf16 with the tokenizer (and a
    VL model's image processor) to `folder`, atomically. Returns seconds."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
    from transformers import Qwen2VLImageProcessorPil
    t0 = time.time()
    spec = dict(config)
    hf_config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    vision = "vision_config" in config
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with torch.device(device):
        model = auto.from_config(hf_config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = INSTRUCT_EOS
    model.generation_config.pad_token_id = 151643
    model.save_pretrained(tmp)
    del model
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp)
    if vision:
        Qwen2VLImageProcessorPil(**VL_PROCESSOR).save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    os.rename(tmp, folder)
    if device == "cuda":
        torch.cuda.empty_cache()
    return time.time() - t0


def ensure_model(hub_cache: str, hub_id: str, tokenizer_dir: str, tiny: bool, built: dict) -> str:
    """The snapshot folder of `hub_id` (built if missing); its build time goes into `built`."""
    if hub_id not in SHAPES:
        raise KeyError(f"the recipe names {hub_id!r}, whose architecture this script does not know; add its "
                       f"config.json values to SHAPES")
    config = tiny_shape(SHAPES[hub_id]) if tiny else SHAPES[hub_id]
    # tiny shapes of different models coincide: each keeps its own weights (a teacher unlike its student)
    folder = snapshot_dir(hub_cache, hub_id, config, salt=hub_id if tiny else "")
    same = [d for d in glob.glob(os.path.join(hub_cache, "models--*", "snapshots", os.path.basename(folder)))
            if d != folder and os.path.exists(os.path.join(d, "config.json"))]
    if same and not os.path.exists(folder):     # another name of the same architecture: share its folder
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        os.symlink(same[0], folder)
    if not os.path.exists(os.path.join(folder, "config.json")):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        built[hub_id] = {"seconds": round(build_model(folder, config, tokenizer_dir, device), 1),
                         "gb": round(_folder_bytes(folder) / 1e9, 2)}
    from huggingface_hub import snapshot_download
    found = snapshot_download(hub_id, cache_dir=hub_cache, local_files_only=True)   # as resolve_model will
    if os.path.realpath(found) != os.path.realpath(folder):
        raise RuntimeError(f"the hub cache resolves {hub_id} to {found}, not to the folder built for it ({folder})")
    return folder


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


# ---- what each recipe's GPU defaults name ----

def recipe_models(name: str) -> dict:
    """{"model": hub id, "ref_model": hub id or "", "others": [hub ids the recipe names elsewhere, e.g. its judge]}
    read from the recipe module with its GPU defaults on."""
    import train
    real = models.gpu_defaults
    models.gpu_defaults = lambda: True
    try:
        recipe = train.load_recipe(name)
    finally:
        models.gpu_defaults = real
    defaults = recipe.DEFAULTS
    model, ref = defaults["run.model"], defaults.get("run.ref_model", "")
    others = sorted({v for v in vars(recipe).values() if isinstance(v, str) and v in SHAPES} - {model, ref})
    return {"model": model, "ref_model": ref, "others": others, "runs_model_code": train.runs_model_code(recipe)}


# ---- one train.py run ----

# train.py's main, and the process's peak RSS written at exit
SHIM = """
import atexit, json, os, resource, runpy, sys
sys.path.insert(0, os.getcwd())
def _rss():
    mib = lambda usage: resource.getrusage(usage).ru_maxrss / 1024
    with open(os.environ["TRACERL_BENCH_RSS"], "w") as f:
        json.dump({"self_mib": mib(resource.RUSAGE_SELF), "children_mib": mib(resource.RUSAGE_CHILDREN)}, f)
atexit.register(_rss)
sys.argv = ["train.py"] + sys.argv[1:]
runpy.run_path("train.py", run_name="__main__")
"""


class GPUMemory:
    """Device-wide used memory (MiB), polled every 0.5 s by `nvidia-smi -lms 500`; the peak while running."""

    def __init__(self):
        self.peak = self.baseline = None
        self.proc = None
        if torch.cuda.is_available() and shutil.which("nvidia-smi"):
            self.baseline = self._used_now()
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                          "-lms", "500"], stdout=subprocess.PIPE, text=True)
            threading.Thread(target=self._read, daemon=True).start()

    @staticmethod
    def _used_now() -> float:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True).stdout
        return float(out.split()[0])

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                used = float(line.split()[0])
            except (ValueError, IndexError):
                continue
            self.peak = used if self.peak is None else max(self.peak, used)

    def stop(self) -> dict:
        if self.proc is None:
            return {"peak_gpu_mib": None, "why": "no CUDA device or no nvidia-smi"}
        self.proc.terminate()
        self.proc.wait()
        return {"peak_gpu_mib": self.peak, "gpu_mib_before": self.baseline}


PHASE = re.compile(r"tracerl: (.+?) \.\.\. ?([0-9.]+) s$")
STEP = re.compile(r"^step +(\d+)/")


def run_recipe(name: str, argv: list[str], env: dict, timeout: float, logs: str) -> dict:
    """Run train.py (through SHIM) for one recipe; parse its output and metrics. Never raises for the run's failure."""
    log_path = os.path.join(logs, f"{name}.log")
    rss_path = os.path.join(logs, f"{name}.rss.json")
    if os.path.exists(rss_path):          # an earlier run's: a run killed at its timeout writes none
        os.remove(rss_path)
    env = dict(env, TRACERL_BENCH_RSS=rss_path)
    memory = GPUMemory()
    t0 = time.time()
    stamps: list[tuple[float, str]] = []      # (seconds since start, line) of every output line
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", SHIM, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, 9))
        timer.start()
        for line in proc.stdout:
            log.write(line)
            log.flush()
            stamps.append((time.time() - t0, line.rstrip("\n")))
        rc = proc.wait()
        timer.cancel()
    wall = time.time() - t0
    result = {"command": "python train.py " + " ".join(argv), "rc": rc, "wall_s": round(wall, 1),
              "timed_out": wall >= timeout, **memory.stop()}
    if os.path.exists(rss_path):
        with open(rss_path) as f:
            result["peak_rss_mib"] = json.load(f)
    text = [line for _, line in stamps]
    result["startup_phases_s"] = {m.group(1)[:90]: float(m.group(2)) for line in text for m in [PHASE.search(line)]
                                  if m}
    first_step = next((t for t, line in stamps if STEP.match(line)), None)
    last_step = next((t for t, line in reversed(stamps) if STEP.match(line)), None)
    out = next((m.group(1) for line in text for m in [re.search(r"run folder (\S+)$", line)] if m), None)
    result["run_folder"] = out
    result.update(read_metrics(out))
    if first_step is not None and result.get("per_step", {}).get("time/step_s"):
        # from the process's start to the first step's start: imports, models, engine start-up
        result["startup_s"] = round(first_step - result["per_step"]["time/step_s"][0], 1)
    if out and os.path.exists(os.path.join(out, "metrics.jsonl")):
        shutil.copy(os.path.join(out, "metrics.jsonl"), os.path.join(logs, f"{name}.metrics.jsonl"))
    checkpoint = os.path.join(out, "checkpoints") if out else None
    if checkpoint and os.path.isdir(checkpoint):
        result["checkpoint_gb"] = round(_folder_bytes(checkpoint) / 1e9, 2)
        if last_step is not None:      # from the last step's line to exit: the final checkpoint, then shutdown
            result["last_step_to_exit_s"] = round(wall - last_step, 1)
        shutil.rmtree(checkpoint, ignore_errors=True)
    result["ok"] = rc == 0 and result.get("steps") == 3
    if not result["ok"]:
        result["error_tail"] = "\n".join(text[-60:])[-4000:]
    return result


METRICS = ("time/step_s", "time/rollout_s", "time/recompute_s", "time/train_s", "time/weight_push_s",
           "rollout/sampled_tokens", "rollout/response_length", "rollout/turns", "perf/tokens_per_s",
           "mismatch/logprob_diff_mean", "rollout/reward")


def read_metrics(out: str | None) -> dict:
    path = os.path.join(out, "metrics.jsonl") if out else ""
    if not os.path.exists(path):
        return {"steps": 0}
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    per_step = {key: [float(f"{r[key]:.4g}") for r in rows if key in r] for key in METRICS}
    steady = [r["time/step_s"] for r in rows[1:] if "time/step_s" in r]   # the first step carries compile/warm-up
    return {"steps": len(rows), "per_step": per_step,
            "step_s_after_first": round(sum(steady) / len(steady), 2) if steady else None}


# ---- the whole bench ----

def sandbox_acceptance() -> dict:
    """What this machine's sandbox gives a call (agents/sandbox.py probes it for real), in a fresh process."""
    probe = ("import json; from agents import sandbox; i = sandbox.isolation(); "
             "print(json.dumps({'missing': i.missing, 'summary': str(i)}))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"missing": {}, "summary": f"probe failed: {done.stderr[-500:]}"}


def main() -> None:
    parser = argparse.ArgumentParser(description="every recipe's GPU default at its real shape (random weights)")
    parser.add_argument("--recipes", nargs="+", default=list(ALL_RECIPES), choices=ALL_RECIPES)
    parser.add_argument("--work", default="/tmp/tracerl-recipes", help="model folders and the hub cache (not $OUT)")
    parser.add_argument("--out", default="recipes-gpu.json")
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds one recipe's run may take")
    parser.add_argument("--budget", type=float, default=0.0, help="seconds for the whole command (0 = no limit): "
                        "each run's timeout is cut to what is left, and a recipe is not started with under 60 s left")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes of the same architectures (CPU test)")
    parser.add_argument("--write-tokenizer", action="store_true", help=f"write {TOKENIZER_CARRY} and exit")
    parser.add_argument("--build-only", action="store_true", help="build the recipes' models under --work, run none")
    args = parser.parse_args()
    if args.write_tokenizer:
        print(f"wrote {TOKENIZER_CARRY} from {write_tokenizer(TOKENIZER_CARRY)}")
        return
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("the real shapes need a CUDA GPU; use --tiny to test this script on a CPU")
    work = os.path.abspath(args.work) + ("-tiny" if args.tiny else "")
    hub_cache, logs = os.path.join(work, "hub"), os.path.join(os.path.dirname(os.path.abspath(args.out)),
                                                                "recipes-gpu-logs")
    os.makedirs(logs, exist_ok=True)
    tokenizer_dir, tokenizer_source = qwen_tokenizer(work)
    summary = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "shapes": "tiny (2 layers, hidden 64)" if args.tiny else "published",
               "weights": "random (transformers' init), bf16 safetensors",
               "tokenizer": f"Qwen's BPE vocabulary ({tokenizer_source}), Qwen2.5/Qwen3 added tokens, the project's "
                            f"ChatML template in place of each model's own",
               "built": {}, "recipes": {}}
    try:
        import vllm
        summary["vllm"] = vllm.__version__
    except ImportError:
        summary["vllm"] = None
    sandbox = sandbox_acceptance()
    summary["sandbox"] = sandbox
    env = dict(os.environ, HF_HUB_CACHE=hub_cache, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)

    started = time.time()
    for name in args.recipes:
        entry: dict = {}
        summary["recipes"][name] = entry
        left = args.budget - (time.time() - started) if args.budget else args.timeout
        if left < 60:
            entry.update(ok=False, error=f"not run: {left:.0f} s of the --budget left")
            continue
        try:
            names = recipe_models(name)
            entry["models"] = names
            folders = {key: ensure_model(hub_cache, names[key], tokenizer_dir, args.tiny, summary["built"])
                       for key in ("model", "ref_model") if names[key]}
            for other in names["others"]:          # named by no flag: resolved through the hub cache
                ensure_model(hub_cache, other, tokenizer_dir, args.tiny, summary["built"])
            if args.build_only:
                entry.update(ok=True, built_only=True)
                save()
                continue
        except Exception as error:  # noqa: BLE001 - one recipe's failure still leaves the others' figures
            entry.update(ok=False, error=f"building its models: {type(error).__name__}: {error}"[:3000])
            save()
            continue
        argv = ["--recipe", name, "--model", folders["model"]]
        if "ref_model" in folders:
            argv += ["--run.ref_model", folders["ref_model"]]
        argv += ["--run.steps", "3"]
        run_env = dict(env)
        if names["runs_model_code"] and sandbox["missing"]:
            run_env["TRACERL_SANDBOX_ACCEPT"] = ",".join(sandbox["missing"])
            entry["sandbox_accepted"] = sandbox["missing"]
        entry["disk_free_gb_before"] = round(shutil.disk_usage(work).free / 1e9, 1)
        print(f"== {name}: python train.py {' '.join(argv)}", flush=True)
        left = args.budget - (time.time() - started) if args.budget else args.timeout
        entry.update(run_recipe(name, argv, run_env, min(args.timeout, left), logs))
        print(f"== {name}: ok={entry['ok']} steps={entry.get('steps')} step_s={entry.get('per_step', {}).get('time/step_s')}"
              f" peak_gpu_mib={entry.get('peak_gpu_mib')} wall={entry['wall_s']} s", flush=True)
        save()
    save()
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
