# The physical bounds of bench/limits.py against what a model and torch count: a shape's parameters are the model's
# own (less its norms), one forward's FLOPs are torch's FlopCounterMode's, and a decode step is bound by the bytes it
# reads (the weights and the KV cache) until the rows' products outweigh them.
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

import models
from bench import limits, shapes


def test_a_shapes_parameters_are_the_models_own_less_its_norms(tmp_path):
    for name, vocab in (("qwen3-0.6b", 151936), ("qwen3-8b", 151936), ("smollm2-135m", 49152)):
        config_class, fields = shapes.SHAPES[name]
        config = config_class(vocab_size=vocab, **fields)
        config.save_pretrained(tmp_path / name)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
        shape = limits.Shape.of(str(tmp_path / name))
        assert shape.params == sum(p.numel() for p in model.parameters()) - norms, name
    assert round(limits.Shape.of(str(tmp_path / "qwen3-0.6b")).body / 1e9, 2) == 0.44   # Qwen3-0.6B's card: 0.44B
                                                                                        # outside the embedding


def test_one_forward_counts_torchs_flops():
    """One row, a prompt of P and a reply of L: torch counts the head at every position and attention over every
    (query, key) pair; the bound counts the head where a reply token is predicted and causal attention only."""
    model = models.tiny_model("qwen3", head_dim=32)
    model.set_attn_implementation("eager")       # attention as two matrix products torch counts (its CPU sdpa: not)
    folder = models.tiny_model_dir("qwen3", head_dim=32)
    shape = limits.Shape.of(folder)
    P, L = 6, 5
    ids = torch.arange(3, 3 + P + L).unsqueeze(0)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=ids)
    s = P + L
    head_at_prompt = 2 * shape.vocab * shape.hidden * P
    full_attention = shape.attention_flops(s * s) - shape.attention_flops(s * (s + 1) / 2)
    assert counter.get_total_flops() == limits.forward_flops(shape, [P], 1, L) + head_at_prompt + full_attention


def test_a_decode_step_is_bound_by_its_bytes_until_the_rows_products_outweigh_them():
    shape = limits.Shape(layers=28, hidden=1024, intermediate=3072, heads=16, kv_heads=8, head_dim=128, vocab=151936,
                         tied=True)

    def one_step(rows: int, P: int) -> float:     # the bound of a 2-token reply less its prefill: one decode step
        prompts = [P] * rows
        prefill = max((limits.forward_flops(shape, prompts, 1, 0) + 2 * shape.vocab * shape.hidden * rows)
                      / limits.BF16_FLOPS, (2 * shape.params + shape.kv_bytes * P * rows) / limits.HBM_BYTES_PER_S)
        return limits.generation_bound_s(shape, prompts, 1, 2) - prefill
    # one row: the 1.2 GB of bf16 weights and its KV cache, read at 4.8 TB/s
    assert abs(one_step(1, 100) - (2 * shape.params + shape.kv_bytes * 101) / limits.HBM_BYTES_PER_S) < 1e-12
    # 1,024 rows of short context: 2 x 0.6e9 x 1,024 FLOPs at 790 TFLOP/s (1.5 ms) outweigh 1.4 GB read (0.3 ms)
    by_products = (2 * shape.params * 1024 + shape.attention_flops(1024 * 2)) / limits.BF16_FLOPS
    assert abs(one_step(1024, 1) - by_products) < 1e-12
    # ... and 100 tokens of context each add 11.9 GB of KV cache: bytes again
    assert abs(one_step(1024, 100) - (2 * shape.params + shape.kv_bytes * 101 * 1024) / limits.HBM_BYTES_PER_S) < 1e-12
