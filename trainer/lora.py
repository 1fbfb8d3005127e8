# trainer/lora.py — LoRA adapters on the policy: which layers take one, how they are added (PEFT), what travels to an engine.
#
# Owns: `LoraSpec` (rank and alpha: the record the actor and every engine build from), `adapted_modules` (which
# linears take an adapter), `add_lora` (PEFT's adapter layers injected there in place, the base frozen), `adapter_state` (the adapter's tensors: all
# a weight push carries) and `write_peft_folder` (the adapter in PEFT's file format: what vLLM loads and what a
# checkpoint hands a user).
# Never: trains, samples or decides versions (the actor, the engines and router.Router do).
#
# LoRA (Hu et al. 2021, arXiv 2106.09685): a frozen linear W gets a trainable low-rank path,
#     y = W x + (alpha / r) * B (A x),   A: [r, in] (random), B: [out, r] (zeros at the start),
# so at version 0 the adapted model is exactly the base model (B = 0) and only A and B ever change.
# Invariant 3 (forward consistency): the trainer and the embedded engine run PEFT's same layer, unmerged; vLLM serves
# the adapter unmerged too (its LoRA layers add the low-rank path to the frozen base output), so neither end folds
# alpha / r * B A into W, whose rounding would differ from the trainer's (bf16 above all).
# What is adapted: every nn.Linear of the language model's decoder layers (attention and dense MLP projections). Not
# the embeddings or the output head (a tied head is the embedding), not a vision tower, not an MoE router (a router
# trained through an adapter changes routes that vLLM would not serve the same way) and not MoE experts (fused 3-D
# weights, not linears): an MoE base keeps its routers and experts frozen and its routes replayed (engines/r3.py) as ever.
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from torch import nn

import models
from engines import r3

ADAPTER_MARK = ".lora_"          # in every state_dict key of an adapter tensor (lora_A / lora_B), in no base key


@dataclass(frozen=True)
class LoraSpec:
    """The adapter every party builds: rank r and alpha (updates scaled by alpha / r). The adapted modules follow
    from the model (adapted_modules), so the trainer's copy and an engine's name the same ones."""
    rank: int
    alpha: float

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def adapted_modules(model: nn.Module) -> list[str]:
    """The full names of the linears LoRA adapts: every nn.Linear inside the language model's decoder layers, less MoE
    routers (see the header). Raises if there is none."""
    routers = set(r3.moe_routers(model))
    layers = models.language_model_layers(model)
    inside = {id(sub) for layer in layers for sub in layer.modules()}
    names = [name for name, module in model.named_modules()
             if id(module) in inside and isinstance(module, nn.Linear) and module not in routers]
    if not names:
        raise ValueError(f"{type(model).__name__} has no linear layer in its language model's decoder layers for "
                         f"LoRA to adapt")
    return names


def add_lora(model: nn.Module, spec: LoraSpec) -> nn.Module:
    """Freeze `model` and inject PEFT's LoRA layers into its adapted_modules, in place (the model keeps its class, so every
    forward of trainer/recompute.py and rollout.py runs unchanged). Dropout 0: the trainer and the engine compute the same
    function (invariant 3). Returns the model."""
    from peft import LoraConfig, inject_adapter_in_model
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0, bias="none",
                        target_modules=adapted_modules(model))
    inject_adapter_in_model(config, model)
    for name, parameter in model.named_parameters():     # fp32 master weights whatever the base's dtype
        if ADAPTER_MARK in name:
            parameter.data = parameter.data.float()
    return model


def adapter_keys(model: nn.Module) -> list[str]:
    """The state_dict keys of the adapter's tensors ([] for a model without LoRA)."""
    return [name for name in model.state_dict() if ADAPTER_MARK in name]


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the model's own state_dict keys (PEFT's, e.g. `...q_proj.lora_A.default.weight`):
    what a weight push carries when the policy trains LoRA."""
    return {name: tensor for name, tensor in model.state_dict().items() if ADAPTER_MARK in name}


def is_adapter_state(state: dict[str, torch.Tensor]) -> bool:
    return bool(state) and all(ADAPTER_MARK in name for name in state)


def write_peft_folder(state: dict[str, torch.Tensor], spec: LoraSpec, path: str) -> None:
    """The adapter as PEFT saves one (adapter_config.json, adapter_model.safetensors with `base_model.model.`
    names): vLLM's LoRARequest loads it, and peft.PeftModel.from_pretrained(base, path) takes it back. Each
    tensor keeps its dtype."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    tensors = {"base_model.model." + name.replace(".default.", "."): tensor.detach().cpu().contiguous()
               for name, tensor in state.items()}
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": 0.0, "bias": "none",
              "target_modules": sorted({name.split(ADAPTER_MARK)[0].rsplit(".", 1)[-1] for name in state}),
              "fan_in_fan_out": False, "use_rslora": False, "modules_to_save": None, "task_type": "CAUSAL_LM"}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=1)
