# critic.py — the value model of PPO with GAE (`--algo.estimator gae`): its config, its value head, the values it
# gives before a step, and its own optimizer step on the clipped value loss.
#
# Owns: CriticConfig (`--critic.*`) and its rules, ValueHead, Critic (an actor.Actor whose LM head is a scalar value
# head: the same loading, FSDP2 shards, precision, micro-batches, MoE route replay and checkpoints, its own AdamW),
# and when the actor is frozen for the critic's warm-up.
# Never does: compute advantages or returns (algo.gae_advantages), train the policy, or push weights to an engine.
# Invariant kept: 3 (forward consistency) for the values as for the logprobs: the critic runs the rows the engine
# sampled, each at its recorded MoE routes (r3.replay_routes, through the backward too), in the actor's precision.
# Why a value head on the policy's own architecture and weights (Molt's choice, and PPO-for-LLMs' usual one), not a
# separate small model: its features start from what the policy knows about the text, it reads the same tokenizer's
# ids, and an MoE policy's recorded routes apply to it layer for layer, so no second model family needs checking.
# Tensor convention: per-token arrays are [B, T] aligned to tokens like logprobs: values[b, t] is V of the state
# BEFORE token t (the hidden state at t - 1, the one that predicts t), 0 at position 0 and on padding.
import contextlib
import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

import actor
import algo
import invariants
from engines import r3
from trainer import recompute

CRITIC_FOLDER = "critic"   # a checkpoint's critic: a complete actor-style checkpoint in this subfolder


@dataclass
class CriticConfig:
    lr: float = 1e-5               # the critic's AdamW learning rate (constant; its own optimizer)
    weight_decay: float = 0.0      # the critic's decoupled AdamW weight decay
    max_grad_norm: float = 1.0     # global L2 norm the critic's gradient is clipped to
    value_clip: float = 0.2        # PPO value clip: V moves at most this far from the step's old values (0 = off)
    freeze_actor_steps: int = 0    # warm-up: the first N RL steps train the critic alone (actor frozen, no push)


def validate_critic(cfg: CriticConfig, estimator: str, steps: int) -> None:
    """Refuse a critic setting that would train silently wrong or be ignored. Raises ValueError naming the fix."""
    if cfg != CriticConfig() and estimator != "gae":
        changed = [f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(CriticConfig(), f.name)]
        raise ValueError(f"critic.{', critic.'.join(changed)} set, but estimator {estimator!r} has no critic: only "
                         f"'gae' builds one; set --algo.estimator gae, or leave the critic's settings alone")
    if not cfg.lr > 0:
        raise ValueError(f"critic.lr must be > 0, got {cfg.lr}")
    if cfg.weight_decay < 0 or not cfg.max_grad_norm > 0:
        raise ValueError(f"critic.weight_decay must be >= 0 and critic.max_grad_norm > 0, got {cfg.weight_decay} and "
                         f"{cfg.max_grad_norm}")
    if not 0.0 <= cfg.value_clip < math.inf:
        raise ValueError(f"critic.value_clip must be >= 0 (0 = off) and finite, got {cfg.value_clip}; PPO's usual "
                         f"choice is 0.2 (in the reward's units)")
    if cfg.freeze_actor_steps < 0 or (cfg.freeze_actor_steps and cfg.freeze_actor_steps >= steps):
        raise ValueError(f"critic.freeze_actor_steps must be in [0, run.steps) = [0, {steps}), got "
                         f"{cfg.freeze_actor_steps}: at run.steps or more the actor never trains; warm the critic up "
                         f"for fewer steps, or run more")


def actor_frozen(cfg: CriticConfig, step: int) -> bool:
    """Whether RL step `step` (0-based) trains the critic alone: its warm-up, before the actor learns from values
    that are still the initial head's noise."""
    return step < cfg.freeze_actor_steps


class ValueHead(nn.Linear):
    """hidden -> one scalar, computed in fp32 whatever the model's compute precision (a bf16 value of a return near
    1 carries ~4e-3 of round-off, the size of the TD errors it should resolve). Its weight starts at the model's
    initializer_range, not at 1/(hidden+1), which starved the backbone of gradient (Molt's fix)."""
    computes_in_fp32 = True     # actor.Actor._shard: sharded on its own with an fp32 mixed-precision policy

    def __init__(self, hidden: int, std: float):
        super().__init__(hidden, 1)
        nn.init.normal_(self.weight, std=std)
        nn.init.zeros_(self.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        dtype = torch.promote_types(hidden.dtype, torch.float32)      # fp32, or fp64 for a float64 model
        with torch.autocast(hidden.device.type, enabled=False):
            return F.linear(hidden.to(dtype), self.weight.to(dtype), self.bias.to(dtype))


class Critic(actor.Actor):
    """The value model: the policy's architecture and initial weights with a ValueHead for its LM head, trained by
    the actor's machinery (config fields of actor.ActorConfig for precision, micro-batches, compile and activation
    checkpointing; its own lr, weight decay and clip from CriticConfig; never LoRA: the head and every weight
    learn). Collective under FSDP2 like the actor: call every method on all ranks, each with its own rows."""

    def __init__(self, model_path: str, actor_cfg: actor.ActorConfig, cfg: CriticConfig, total_steps: int,
                 seed: int = 0):
        self.critic_cfg = cfg
        machinery = dataclasses.replace(actor_cfg, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                        max_grad_norm=cfg.max_grad_norm, lr_schedule="constant", warmup_steps=0,
                                        lora_rank=0)
        super().__init__(model_path, machinery, total_steps, seed)

    def _load_model(self, model_path: str, dtype: torch.dtype) -> nn.Module:
        model = super()._load_model(model_path, dtype)
        text = model.config.get_text_config()
        model.set_output_embeddings(ValueHead(text.hidden_size, getattr(text, "initializer_range", 0.02)))
        # the head is the critic's own: nothing may tie it back to the input embedding
        model.config.tie_word_embeddings = text.tie_word_embeddings = False
        return model

    def warm_up(self) -> None:
        """A compiled critic compiles in its first steps (warm_up's batches are the LM head's)."""

    def _values(self, input_ids: Tensor, attention_mask: Tensor, images: list) -> Tensor:
        """[B, T] V of the state before each token (module header), from one forward whose output head is the value
        head, over right-padded rows (a sharded VLM's image-less rows get recompute.with_blank_image's image)."""
        width = input_ids.shape[1]
        ids, mask, images = recompute.with_blank_image(self.model, input_ids, attention_mask, images)
        with self._compute():
            out = self.model(input_ids=ids, attention_mask=None, use_cache=False,
                             **recompute.forward_inputs(self.model, ids, mask, images)).logits[:, :width, 0]
        return F.pad(out[:, :-1], (1, 0)) * attention_mask     # [B, T]: the value before token t (fp32 or fp64)

    @torch.no_grad()
    def compute_values(self, batch: invariants.TrainBatch) -> Tensor:
        """The critic's values on this rank's rows, [B, T] fp32 on CPU, MoE routes replayed (the old values of a
        step: GAE's V and the value clip's centre)."""
        actor._check_right_padded(batch.attention_mask)
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for rows in self._micro_batches(batch):
            if rows is None:
                self._filler_forward()
                continue
            input_ids, attention_mask, routes, images, _, width = self._rows(batch, rows)
            with r3.replay_routes(self.model, routes) if routes is not None else contextlib.nullcontext():
                out[rows, :width] = self._values(input_ids, attention_mask, images).cpu()
        return out

    def train_step(self, batch: invariants.TrainBatch, returns: Tensor, old_values: Tensor) -> dict[str, float]:
        """ONE optimizer step of the critic over this rank's rows: the clipped value loss (algo.value_loss) on
        every sampled token, a token mean over the step's GLOBAL count (all micro-batches, all ranks: FSDP2 sums the
        rank gradients, actor.Actor._shard). returns, old_values: [B, T] from algo.gae_advantages and
        compute_values. Returns the step's metrics (critic/*)."""
        actor._check_right_padded(batch.attention_mask)
        if returns.shape != batch.input_ids.shape or old_values.shape != batch.input_ids.shape:
            raise ValueError(f"returns and old_values must be [B,T]={tuple(batch.input_ids.shape)} aligned to tokens, "
                             f"got {tuple(returns.shape)} and {tuple(old_values.shape)}")
        self.optimizer.zero_grad(set_to_none=True)
        tokens = self._reduce([float(batch.loss_mask.sum())])[0]
        sums = dict.fromkeys(("loss", "value_clip_frac", "values", "returns", "abs_error"), 0.0)
        for rows in self._micro_batches(batch):
            if rows is None:
                self._filler_forward().backward()
                continue
            input_ids, attention_mask, routes, images, _, width = self._rows(batch, rows)
            cut = functools.partial(self._cut, rows=rows, width=width)
            mask, target, old = cut(batch.loss_mask), cut(returns).float(), cut(old_values).float()
            # routes stay replayed through the backward (an activation-checkpointed recompute would route live)
            with r3.replay_routes(self.model, routes) if routes is not None else contextlib.nullcontext():
                values = self._values(input_ids, attention_mask, images)
                token_loss, metrics = algo.value_loss(values, old, target, mask, self.critic_cfg.value_clip)
                loss = token_loss.sum() / max(tokens, 1.0)
                loss.backward()      # also with no sampled token: under FSDP2 every rank runs every backward
            kept = float(mask.sum())
            sums["loss"] += float(loss.detach())
            sums["value_clip_frac"] += metrics["value_clip_frac"] * kept
            sums["values"] += float((values.detach() * mask).sum())
            sums["returns"] += float((target * mask).sum())
            sums["abs_error"] += float(((values.detach() - target).abs() * mask).sum())
        total = dict(zip(sums, self._reduce(list(sums.values()))))
        if tokens == 0:
            self.optimizer.zero_grad(set_to_none=True)
            return {"critic/skipped": 1.0, "critic/version": float(self.version)}
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        grad_norm = float(grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm)
        skipped = not math.isfinite(grad_norm)       # a NaN/inf gradient would poison AdamW's moments
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.scheduler.step()
            self.version += 1
        return {"critic/value_loss": total["loss"], "critic/grad_norm": grad_norm, "critic/skipped": float(skipped),
                "critic/value_clip_frac": total["value_clip_frac"] / tokens,
                "critic/values_mean": total["values"] / tokens, "critic/returns_mean": total["returns"] / tokens,
                "critic/abs_error": total["abs_error"] / tokens, "critic/version": float(self.version)}

    def export_weights(self, device: torch.device | str = "cpu") -> dict[str, Tensor]:
        raise NotImplementedError("the critic's weights never go to an engine; save_checkpoint keeps them")
