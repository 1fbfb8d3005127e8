# bench/limits.py — the physical lower bound of each phase of an RL step on one H200, next to what it took.
#
# A phase's bound is the time it would take if the device ran it at its peak: the bytes it must move over HBM (or the
# host link) at full bandwidth, or the FLOPs it must compute at the bf16 dense peak, whichever is longer. The GPU
# benches (bench/vs_trl.py, bench/rollout_profile.py) write each measured phase beside its bound and the ratio
# (measured / bound: 1 is the limit). Dense decoder models only (the benches' shapes); the work counted is the least
# a phase must do for the math recipe's batch: G prompt groups of `samples` rows, each row a prompt of P tokens and a
# reply of L.
#
# Constants, NVIDIA H200 SXM:
HBM_BYTES_PER_S = 4.8e12     # HBM3e bandwidth (datasheet)
BF16_FLOPS = 790e12          # dense bf16 matrix products, as measured on the lent H200 (bench/gpu.py; datasheet 989)
HOST_BYTES_PER_S = 64e9      # PCIe Gen5 x16, one direction: a sleeping engine's weights to host memory and back
# Per-parameter bytes: weights computed in bf16 (2 bytes) by the engine; the trainer keeps fp32 master weights with
# AdamW's two fp32 moments (both sides: tracerl's actor, and TRL, which loads a model in fp32 and autocasts to bf16).
ENGINE_BYTES = 2
ADAMW_BYTES = 28             # one AdamW step reads the fp32 weight, gradient, m and v (16) and writes weight, m, v (12)
PUSH_BYTES = 6               # a weight push reads the fp32 master weight (4) and writes the engine's bf16 copy (2)
#
# Formulas (a FLOP is a multiply or an add: a product of [n, k] x [k, m] is 2nkm):
#   forward      F = 2 x body x T  +  2 x V x H x (rows x L)  +  attention
#                where T = the distinct tokens, each group's prompt once (vLLM's prefix cache and tracerl's
#                shared-prompt forward both compute it once) plus every reply, body = the decoder layers' matrix
#                parameters, V x H the output head at each position that predicts a reply token, and attention =
#                4 x layers x q_dim x (keys each query sees), summed over the distinct tokens (QK^T and AV, causal)
#   train        3 x F (forward and backward, no recomputed activations) + optimizer steps x ADAMW_BYTES x N / HBM
#   recompute    F over the rows whose pi_prox takes a forward of its own (tracerl: the later minibatches; TRL: all)
#   generation   a prefill of the distinct prompt tokens, then L - 1 decode steps; each step s of R rows is bound by
#                max(bytes / HBM, FLOPs / peak): bytes = the engine's weights (ENGINE_BYTES x N) + every row's KV cache
#                so far (kv_bytes x (P + s) per row), FLOPs = 2 x (body + V x H) x R + attention over each row's context
#   weight push  PUSH_BYTES x N / HBM
#   sleep, wake  the engine's weights to the host and back: 2 x ENGINE_BYTES x N / HOST
# N counts every parameter (a tied embedding once), kv_bytes = 2 (K and V) x layers x kv_heads x head_dim x 2 bytes.
import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """What the bounds need of a dense decoder's config.json."""
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def of(cls, model_dir: str) -> "Shape":
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
        config = config.get("text_config", config)
        if config.get("num_experts") or config.get("num_local_experts"):
            raise ValueError(f"{model_dir} is an MoE model; these bounds count dense decoder layers only")
        heads = config["num_attention_heads"]
        return cls(config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"], heads,
                   config.get("num_key_value_heads") or heads, config.get("head_dim") or config["hidden_size"] // heads,
                   config["vocab_size"], bool(config.get("tie_word_embeddings", False)))

    @property
    def body(self) -> int:
        """The decoder layers' matrix parameters: q, k, v, o and the gated MLP's three."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.layers * (self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate)

    @property
    def params(self) -> int:
        """Every parameter but the norms' (a tied embedding counted once)."""
        return self.body + self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def kv_bytes(self) -> int:
        """KV cache bytes per token, bf16."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    def attention_flops(self, keys: float) -> float:
        """QK^T and AV of one query over `keys` keys, every layer."""
        return 4 * self.layers * self.heads * self.head_dim * keys


def forward_flops(shape: Shape, prompt_lens: list[int], samples: int, reply_len: float) -> float:
    """F of the header: one forward over the distinct tokens of groups whose prompts have `prompt_lens` tokens, each
    with `samples` replies of `reply_len` tokens."""
    rows, L = len(prompt_lens) * samples, reply_len
    tokens = sum(prompt_lens) + rows * L
    # a prompt's query i sees i + 1 keys; a reply's token j sees P + j + 1
    attention = sum(shape.attention_flops(P * (P + 1) / 2) + samples * shape.attention_flops(L * P + L * (L + 1) / 2)
                    for P in prompt_lens)
    return 2 * shape.body * tokens + 2 * shape.vocab * shape.hidden * rows * L + attention


def generation_bound_s(shape: Shape, prompt_lens: list[int], samples: int, reply_len: float) -> float:
    """The prefill's compute bound, then every decode step's bound (the header)."""
    rows, L = len(prompt_lens) * samples, int(round(reply_len))
    prefill_flops = forward_flops(shape, prompt_lens, 1, 0) + 2 * shape.vocab * shape.hidden * rows
    prefill = max(prefill_flops / BF16_FLOPS, (ENGINE_BYTES * shape.params + shape.kv_bytes * sum(prompt_lens))
                  / HBM_BYTES_PER_S)
    weights = ENGINE_BYTES * shape.params
    context = samples * sum(prompt_lens)              # keys summed over the rows at the first decode step
    total = prefill
    for _ in range(1, L):
        context += rows
        step_bytes = weights + shape.kv_bytes * context
        step_flops = 2 * (shape.body + shape.vocab * shape.hidden) * rows + shape.attention_flops(context)
        total += max(step_bytes / HBM_BYTES_PER_S, step_flops / BF16_FLOPS)
    return total


def phase_bounds(shape: Shape, prompt_lens: list[int], samples: int, reply_len: float, optimizer_steps: int,
                 recomputed_fraction: float) -> dict[str, float]:
    """Seconds per phase at the device's peak for one RL step: `prompt_lens` of the step's groups, `reply_len` the
    mean reply, `recomputed_fraction` of the rows taking a forward of their own for pi_prox."""
    forward = forward_flops(shape, prompt_lens, samples, reply_len)
    return {"rollout": generation_bound_s(shape, prompt_lens, samples, reply_len),
            "recompute": recomputed_fraction * forward / BF16_FLOPS,
            "train": 3 * forward / BF16_FLOPS + optimizer_steps * ADAMW_BYTES * shape.params / HBM_BYTES_PER_S,
            "weight_push": PUSH_BYTES * shape.params / HBM_BYTES_PER_S,
            "sleep_wake": 2 * ENGINE_BYTES * shape.params / HOST_BYTES_PER_S}


def beside(measured: dict[str, float], bounds: dict[str, float]) -> dict[str, dict[str, float]]:
    """Each measured phase that has a bound: its seconds, the bound's, and measured / bound."""
    return {name: {"s": measured[name], "bound_s": bounds[name],
                   "x_bound": measured[name] / bounds[name] if bounds[name] > 0 else float("nan")}
            for name in bounds if name in measured}


CONSTANTS = {"device": "NVIDIA H200 SXM", "hbm_bytes_per_s": HBM_BYTES_PER_S, "bf16_flops": BF16_FLOPS,
             "host_bytes_per_s": HOST_BYTES_PER_S, "engine_bytes_per_param": ENGINE_BYTES,
             "adamw_bytes_per_param": ADAMW_BYTES, "push_bytes_per_param": PUSH_BYTES,
             "formulas": "bench/limits.py's header"}
