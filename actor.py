# actor.py — the single trainable policy: load, FSDP2, micro-batches, train step, weight export, checkpoints.
#
# Owns: the policy model (or its LoRA adapter over a frozen base: trainer/lora.py), its AdamW optimizer and LR schedule,
# the policy version (= optimizer steps taken), the micro-batches of a step, one optimizer step over a whole
# TrainBatch, the weight export for the engine and atomic checkpoints.
# Never does: compute rewards or advantages, sample tokens, talk to an engine, decide correction math itself, or
# compute a logprob itself (trainer/recompute.py: the forward through the processed distribution).
# Invariants kept:
#   3 (forward consistency): the recompute and the loss forward alike are trainer/recompute.py's (gradients through the live
#     logits), with the model in eval mode for recompute AND training (no dropout/jitter differences), no autocast
#     in fp32, and MoE routes replayed through the forward and the backward (r3.replay_routes). A prompt that a
#     micro-batch's rows share by their ids is computed once (recompute.shared_prefixes), its logprobs and gradients
#     the unshared forward's to fp32 round-off.
#   2 (policy version): the version gate, the rollout gates and the train/infer IS weights come from
#     invariants.apply_correction, over whole rollouts (the rows of a rollout share a micro-batch); this module
#     applies them (what they reject leaves the mask) and weighs each token by algo.loss_weights over the step's
#     GLOBAL counts, by one of two paths (see "one optimizer step" below).
# Names: invariants.py's glossary (a row is a segment; pi_prox, `prox_logprobs`, is the proximal policy).
# Tensor convention: per-token arrays are [B, T] aligned to tokens, position 0 never trainable, right padding.
import contextlib
import functools
import math
import os
import shutil
from dataclasses import asdict, dataclass, field

import psutil
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

import algo
import invariants
import models
from engines import r3
from trainer import centering, lora
from trainer import recompute

CHECKPOINT_MARKER = "ACTOR_CHECKPOINT_COMPLETE"  # written last: a folder without it was cut off mid-save
CHECKPOINT_STATE = "actor_state.pt"              # model + optimizer + scheduler + version (full, unsharded)
RUN_STATE = "run_state.pt"                       # the training loop's own state (train.py), for an exact resume
LORA_ADAPTER = "adapter"                         # under LoRA: the adapter in PEFT's format (lora.write_peft_folder)
# token means reported by algo.policy_loss
POLICY_LOSS_METRICS = ("clip_frac", "dual_clip_frac", "approx_kl", "ratio_mean")
# the counts of invariants.gate_rollouts and the means of invariants.correction_weights, summed over a step: every
# rank sums the same keys in the same order, also a rank whose micro-batches were all fillers
GATE_COUNTS = ("drop_stale", "drop_ratio_band", "drop_divergence", "drop_veto", "kept")
IS_METRICS = ("is_masked_frac", "is_clipped_frac", "mismatch_abs_log_ratio", "mismatch_k3_kl")
STEP_SUMS = ("loss", "entropy", "kl_ref", "prefix_tokens_saved", "r3_unreplayed_tokens", "trainable_tokens",
             "gated_tokens", "rollouts", "staleness", "logprob_diff", *POLICY_LOSS_METRICS,
             *(f"gate/{k}" for k in GATE_COUNTS), *(f"is/{k}" for k in IS_METRICS))
STEP_MAXES = ("staleness_max", "logprob_diff_max")


@dataclass
class StepReport:
    """What one optimizer step did, overall and to each token of this rank's rows ([B, T] / [B], on CPU). train_step
    fills it one micro-batch at a time (write) and sets its metrics when the step ends (done)."""
    loss_contribution: Tensor   # token_loss * weight: the token's exact share of the step's loss (0 if not trained)
    is_weights: Tensor          # the detached IS weight its loss was multiplied by (1 off the trainable tokens)
    kept: Tensor                # bool [B]: the row's rollout passed the rollout gates
    staleness: Tensor           # long [B]: trainer version - the oldest version of the row's rollout (policy versions)
    mask: Tensor                # the final loss mask: trainable, in a kept rollout, not rejected by the IS mask
    prox_logprobs: Tensor       # the proximal logprobs the step used: given, or from its own forward
    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def empty(cls, shape: torch.Size) -> "StepReport":
        return cls(loss_contribution=torch.zeros(shape), is_weights=torch.ones(shape),
                   kept=torch.zeros(shape[0], dtype=torch.bool), staleness=torch.zeros(shape[0], dtype=torch.long),
                   mask=torch.zeros(shape), prox_logprobs=torch.zeros(shape))

    def write(self, rows: Tensor | slice, width: int, **values: Tensor) -> None:
        for name, value in values.items():
            target = getattr(self, name)
            if target.dim() == 2:
                target[rows, :width] = value.to(target.dtype).cpu()
            else:
                target[rows] = value.to(target.dtype).cpu()

    def done(self, metrics: dict[str, float]) -> "StepReport":
        self.metrics = metrics
        return self


@dataclass
class _Step:
    """One train_step under way: its inputs, what it did to each token so far (report), and its figures summed and
    maxed over the micro-batches (every rank holds the same keys, in the same order). `weights` are the tokens'
    final loss weights when the proximal logprobs were given (known before any backward); None when each
    micro-batch's own forward gives them, and the global counts are known only after the last backward."""
    batch: invariants.TrainBatch
    algo_cfg: algo.AlgoConfig
    correction_cfg: invariants.CorrectionConfig
    trainer_version: int
    ref_logprobs: Tensor | None
    token_budget: int | None
    report: StepReport
    kl_coef: float
    weights: Tensor | None = None
    global_tokens: float = 0.0     # kept tokens of the step over every rank, once known
    global_rollouts: float = 0.0   # kept rollouts of the step over every rank, once known
    global_groups: float = 0.0     # kept prompt groups of the step over every rank, once known
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_SUMS, 0.0))
    maxes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_MAXES, 0.0))


# ---- config ----

# inductor compiles a big micro-batch's layers apart from a small one's: it guards positions <= 4096 in its C++ code
# and, on a GPU, positions x hidden >= 5 * 2**20 for Triton's mix-order reduction (an RMSNorm backward's two sums
# in one kernel). Warm-up batches were all small, so step 1 on an H200 compiled again: 7.4 s of train against 0.5
BIG_MICRO_BATCH = (4096, 5 * 2**20)     # (positions, positions x hidden elements) a warm-up batch passes

LR_SCHEDULES = ("constant", "cosine")
# fp32: every op in fp32, the exact mode (the engine's logprobs are recomputed to ~1e-6; the parity tests use it).
# bf16: matrix products in bf16 (torch.autocast on one process; FSDP2's MixedPrecisionPolicy when sharded), with
# fp32 master weights, fp32 AdamW state, fp32 gradient reduction, and logits upcast to fp32 before the
# temperature; what remains of the train/infer mismatch is what the IS correction and the gates are for.
PRECISIONS = ("auto", "fp32", "bf16")
COMPILE_MODES = ("auto", "true", "false")
MEMORY_SHARE = 0.6                # of the memory free at the step (the GPU's, or a CPU's RAM) auto micro-batches fill
MICRO_BATCH_TOKENS_RANGE = (2048, 65536)   # auto token caps are kept inside this range


@dataclass
class ActorConfig:
    lr: float = 1e-5                           # peak AdamW learning rate
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW (beta1, beta2)
    weight_decay: float = 0.0                  # decoupled AdamW weight decay
    max_grad_norm: float = 1.0                 # global L2 norm the gradient is clipped to, over all ranks
    lr_schedule: str = "constant"              # one of LR_SCHEDULES, applied after warmup
    warmup_steps: int = 0                      # optimizer steps of linear warmup from lr/warmup_steps to lr
    min_lr_ratio: float = 0.1                  # cosine ends at lr * min_lr_ratio on the last step
    micro_batch_size: int = 0                  # rows per forward/backward (0 = no cap)
    micro_batch_tokens: int = 0                # rows x longest row (0 = auto: from the GPU's memory or the RAM free)
    precision: str = "auto"                    # fp32 | bf16 | auto (bf16 on a GPU, fp32 on a CPU); see PRECISIONS
    activation_checkpointing: bool = False     # recompute each decoder layer in backward (memory for compute)
    compile: str = "auto"                      # torch.compile each decoder layer: true | false | auto (on a GPU)
    lora_rank: int = 0                         # train LoRA adapters of this rank, the base frozen (0 = every weight)
    lora_alpha: float = 32.0                   # LoRA's alpha: an adapter's update is scaled by lora_alpha / lora_rank


def validate_actor(cfg: ActorConfig) -> None:
    """Refuse settings that would train wrong or not at all. Raises ValueError naming the fix."""
    if not cfg.lr > 0:
        raise ValueError(f"lr must be > 0, got {cfg.lr}")
    if len(cfg.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {cfg.betas}; the usual choice is (0.9, 0.999)")
    if cfg.weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {cfg.weight_decay}")
    if not cfg.max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0, got {cfg.max_grad_norm}; use a large value to clip rarely")
    if cfg.lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr_schedule {cfg.lr_schedule!r}; expected one of {LR_SCHEDULES}")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    if cfg.micro_batch_size < 0:
        raise ValueError(f"micro_batch_size must be >= 1, or 0 for auto, got {cfg.micro_batch_size}")
    if cfg.micro_batch_tokens < 0:
        raise ValueError(f"micro_batch_tokens must be >= 1, or 0 for auto, got {cfg.micro_batch_tokens}")
    if cfg.compile not in COMPILE_MODES:
        raise ValueError(f"unknown compile {cfg.compile!r}; expected one of {COMPILE_MODES}")
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"unknown precision {cfg.precision!r}; expected one of {PRECISIONS}")
    if cfg.warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {cfg.warmup_steps}")
    if cfg.lora_rank < 0:
        raise ValueError(f"lora_rank must be >= 1 to train LoRA adapters, or 0 to train every weight, got "
                         f"{cfg.lora_rank}")
    if cfg.lora_rank and not cfg.lora_alpha > 0:
        raise ValueError(f"lora_alpha must be > 0, got {cfg.lora_alpha}; the usual choice is twice lora_rank")


def lora_spec(cfg: ActorConfig) -> lora.LoraSpec | None:
    """The adapter the actor trains, for the engines to build the same one (None: full fine-tuning)."""
    return lora.LoraSpec(cfg.lora_rank, cfg.lora_alpha) if cfg.lora_rank else None


def lr_factor(step: int, cfg: ActorConfig, total_steps: int) -> float:
    """Multiplier of cfg.lr at 0-based optimizer step `step`: linear warmup (step+1)/warmup_steps, then constant
    or cosine from 1 down to min_lr_ratio at total_steps (SGDR, Loshchilov & Hutter 1608.03983, no restarts)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# ---- model facts ----

def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _check_right_padded(attention_mask: Tensor) -> None:
    if (attention_mask[:, 1:] > attention_mask[:, :-1]).any():
        raise ValueError("training batches must be RIGHT-padded (attention_mask 1...1 0...0 per row); "
                         "build them with invariants.build_batch")


# ---- the actor ----

class Actor:
    """The policy under training. Under torch.distributed with world size > 1 each rank holds a FSDP2 shard and
    passes ITS OWN rows of the step's batch; every method is then collective (call it on all ranks)."""

    def __init__(self, model_path: str, cfg: ActorConfig, total_steps: int, seed: int = 0):
        validate_actor(cfg)
        if total_steps < 1 or cfg.warmup_steps > total_steps:
            raise ValueError(f"total_steps (optimizer steps of the run) must be >= 1 and >= warmup_steps="
                             f"{cfg.warmup_steps}, got {total_steps}")
        self.cfg, self.total_steps = cfg, total_steps
        torch.manual_seed(seed)
        self.world_size = dist.get_world_size() if _is_distributed() else 1
        self.rank = dist.get_rank() if _is_distributed() else 0
        self.device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available()
                       else torch.device("cpu"))
        # fp32 master weights always; the compute is fp32 (exact: no autocast, which would also run the MoE
        # routers in bf16 and flip expert choices away from the engine's) or bf16 (PRECISIONS)
        self.precision = cfg.precision if cfg.precision != "auto" else \
            ("bf16" if self.device.type == "cuda" else "fp32")
        # LoRA (trainer/lora.py): the base is frozen, so it needs no fp32 master copy: in bf16 it is held in bf16, the dtype
        # autocast would cast it to for every product anyway (the adapter stays fp32, its master weights)
        self.lora = lora_spec(cfg)
        base_dtype = torch.bfloat16 if self.lora and self.precision == "bf16" else torch.float32
        self.model = self._load_model(model_path, base_dtype).to(self.device).eval()
        self.is_moe = bool(r3.moe_routers(self.model))
        if self.lora:
            lora.add_lora(self.model, self.lora)
        # compiling fuses each layer's norms and activations: 1.7x the eager step at the 0.6B shape on an H200
        # (bench/gpu.py), paid in warm_up (or else the first steps); on a CPU it would add minutes of compile
        self.compiled = cfg.compile == "true" or (cfg.compile == "auto" and self.device.type == "cuda")
        # The language model's layers only: a VLM's vision block splits its attention by image (transformers' sdpa
        # path takes each image's, or window's, length as a Python list), so torch._dynamo compiled it again for
        # every new count of images and windows, past its recompile limit of 8 in geo3k's step 2
        if self.compiled:          # in place: parameter names, hooks and the state dict stay the module's own
            for layer in models.language_model_layers(self.model):
                layer.compile()
        if cfg.activation_checkpointing:
            self._checkpoint_layers()
        if self.world_size > 1:
            self._shard()
        trainable = [p for p in self.model.parameters() if p.requires_grad]    # the adapter alone under LoRA
        self.optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, betas=tuple(cfg.betas),
                                           weight_decay=cfg.weight_decay,
                                           fused=self.world_size == 1)   # CPU too: 0.10 s a step, not 0.39 (135M)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           lambda step: lr_factor(step, cfg, total_steps))
        self.version = 0  # optimizer steps taken = version of the current weights

    def _load_model(self, model_path: str, dtype: torch.dtype) -> torch.nn.Module:
        """The trained model as the folder holds it (critic.Critic puts a value head in place of its LM head)."""
        return models.load_model(model_path, dtype=dtype)

    def warm_up(self) -> None:
        """Compile now what the first steps would (no-op unless compiled): a train forward and backward and a
        no-grad recompute over right-padded batches of 2, 3, 3, 1 and N rows (torch._dynamo makes rows and length
        dynamic at the second, and specializes one row), the third a real step's micro-batch in small: its wanted
        positions span recompute.LOGPROB_CHUNK chunks past recompute.KEPT_LOGITS, so the head runs checkpointed chunks
        that are views of a longer tensor (a guard of their own: else the first step compiles the head again); the
        last as many positions as a big micro-batch (BIG_MICRO_BATCH), capped as a step's. Weights, optimizer and
        RNG stay."""
        if not self.compiled:
            return
        text, draw = self.model.config.get_text_config(), torch.Generator().manual_seed(0)
        vocab = text.vocab_size
        # the third's rows: 1.5x the wanted positions of a chunk or of KEPT_LOGITS (at a vocabulary of 8K or more)
        chunk, kept = recompute.LOGPROB_CHUNK, recompute.KEPT_LOGITS
        wide = min(max(chunk, kept // vocab), 4 * chunk) // 2 + 28
        positions, elements = BIG_MICRO_BATCH
        big = max(positions, elements // text.hidden_size if self.device.type == "cuda" else 0) + 1
        big = min(big, self._micro_batch_limits()[1] or big)
        rows_big = max(3, math.ceil(big / (models.position_limit(self.model.config) // 2)))
        shapes = ((2, 48), (3, 80), (3, wide), (1, 64), (rows_big, max(math.ceil(big / rows_big), 16 * rows_big) + 16))
        for rows, length in shapes:
            segments = []
            for r, n in enumerate(range(length, length - 16 * rows, -16)):   # right-padded rows of unlike lengths
                sampled = [t >= 12 for t in range(n)]
                segments.append(invariants.Segment(
                    f"warm-up {r}", f"warm-up {r}", 0, torch.randint(vocab, (n,), generator=draw).tolist(), sampled,
                    [0.0] * n, [0 if s else -1 for s in sampled],
                    [invariants.Sampling(0.7) if s else invariants.UNSAMPLED for s in sampled]))
            batch = invariants.build_batch(segments, [1.0] * rows, pad_id=0)
            input_ids, attention_mask, _, images, sampling, _ = self._rows(batch, torch.arange(rows))
            with self._compute():
                recompute.forward_logprobs(self.model, input_ids, attention_mask, images=images, with_entropy=True,
                                           **sampling)[0].sum().backward()
            with torch.no_grad(), self._compute():
                recompute.sequence_logprobs(self.model, input_ids, attention_mask, images=images, **sampling)
        self.optimizer.zero_grad(set_to_none=True)   # (no empty_cache: vLLM fails if memory is freed as it profiles)

    def _checkpoint_layers(self) -> None:
        """Keep only each decoder layer's input in forward and recompute the layer in backward. torch's wrapper,
        not transformers' own switch, which acts only in train mode (the model stays in eval mode). MoE routes
        stay replayed in the recompute: train_step keeps replay_routes open through backward."""
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
        layers = set(models.decoder_layers(self.model))
        apply_activation_checkpointing(
            self.model, check_fn=lambda module: module in layers,
            checkpoint_wrapper_fn=lambda layer: checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT))

    def _shard(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        # bf16: all-gather bf16 copies of the fp32 shards for compute, reduce-scatter gradients in fp32
        mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if self.precision == "bf16" else MixedPrecisionPolicy()
        for layer in models.decoder_layers(self.model):
            fully_shard(layer, mesh=mesh, mp_policy=mixed)
        for module in self.model.modules():   # a module that computes in fp32 (a critic's value head) in fp32 shards
            if getattr(module, "computes_in_fp32", False):
                fully_shard(module, mesh=mesh, mp_policy=MixedPrecisionPolicy())
        fully_shard(self.model, mesh=mesh, mp_policy=mixed)
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                # SUM the rank gradients instead of FSDP's mean: each rank's loss (or, in a step that takes its
                # proximal logprobs from its own forward, its summed gradient) is divided by the GLOBAL
                # denominators, so the sum is the global token-mean gradient (prime-rl #2562).
                # Divide factor 1 alone asks for PREMUL_SUM, which gloo refuses; force_sum makes it a plain SUM.
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)

    def _compute(self):
        """The forward's precision: autocast to bf16 on one process (FSDP2 casts the sharded model itself)."""
        if self.precision == "bf16" and self.world_size == 1:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -- collectives that degrade to no-ops on one process --

    def _reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        if self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def _micro_batch_limits(self) -> tuple[int, int]:
        """(rows, padded tokens) per micro-batch; 0 = no cap. Auto: no row cap, and as many tokens as MEMORY_SHARE of
        the memory free now holds at the model's activation cost per token (Korthikanti et al. 2205.05198, 34h bytes
        per layer at 16 bits; here 16 h + 8 intermediate values a layer, at the compute's bytes), measured at each
        step: on a GPU when an engine sharing it is asleep, on a CPU the RAM available (one 16-row micro-batch, not
        two of 8, took a 135M CPU train step from 6.5 to 6.0 s: fewer dense [V, H] tied-embedding gradients)."""
        rows, tokens = self.cfg.micro_batch_size, self.cfg.micro_batch_tokens
        if not tokens:
            text = self.model.config.get_text_config()
            width = 2 if self.precision == "bf16" else 4
            intermediate = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
            per_token = text.num_hidden_layers * (16 * text.hidden_size + 8 * intermediate) * width
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            else:
                free = psutil.virtual_memory().available
            tokens = min(max(int(MEMORY_SHARE * free / per_token), MICRO_BATCH_TOKENS_RANGE[0]),
                         MICRO_BATCH_TOKENS_RANGE[1])
            tokens = int(self._reduce([tokens], dist.ReduceOp.MIN)[0])
        return rows, tokens

    def _micro_batches(self, batch: invariants.TrainBatch, whole_groups: bool = False) -> list[Tensor | None]:
        """Row indices of this rank's micro-batches: whole rollouts (GSPO's rollout ratio and the rollout gates need
        all of a rollout's rows in one forward; with `whole_groups`, whole prompt groups: an aggregation over groups,
        algo.GROUP_AGGREGATIONS, weighs a token by its group's kept tokens), the rollouts of one prompt together
        (recompute.shared_prefixes computes it once), longest first so that rows of like length share a micro-batch and
        little padding is computed, at most _micro_batch_limits() rows and padded tokens (rows x longest row) unless
        one rollout (group) alone is larger; padded
        with None up to the most any rank has: FSDP2 runs collectives in every forward/backward, so a rank that ran
        fewer would leave the others waiting in a collective forever."""
        lengths = batch.attention_mask.sum(-1).tolist()
        rollouts: dict[str, list[int]] = {}     # the rows no micro-batch may split: a rollout's, or a group's
        for b, unit in enumerate(batch.group_ids if whole_groups else batch.rollout_ids):
            rollouts.setdefault(unit, []).append(b)
        # rollouts that may share a prefix (the same ids up to their first row's recompute.prefix_limits) form a unit,
        # kept in one micro-batch when it fits in one (else split into whole rollouts): units longest first, and
        # within a unit its rollouts longest first
        limits = recompute.prefix_limits(recompute.wanted_positions(batch.loss_mask, batch.runs), batch.attention_mask)
        units: dict[tuple, list[list[int]]] = {}
        for rows in rollouts.values():
            units.setdefault(tuple(batch.input_ids[rows[0], :limits[rows[0]]].tolist()), []).append(rows)
        longest = lambda rows: max(lengths[b] for b in rows)  # noqa: E731
        size, tokens = self._micro_batch_limits()
        fits = lambda count, width: not ((size and count > size) or (tokens and count * width > tokens))  # noqa: E731
        groups, current, width = [], [], 0
        for unit in sorted(units.values(), key=lambda unit: -max(map(longest, unit))):
            unit = sorted(unit, key=lambda rows: -longest(rows))
            whole = [b for rows in unit for b in rows]
            for rows in [whole] if fits(len(whole), longest(whole)) else unit:
                grown = max(width, longest(rows))
                if current and not fits(len(current) + len(rows), grown):
                    groups.append(current)                    # these rows start the next micro-batch
                    current, grown = [], longest(rows)
                current, width = current + rows, grown
        if current:
            groups.append(current)
        most = int(self._reduce([len(groups)], dist.ReduceOp.MAX)[0])
        return [torch.tensor(sorted(rows)) for rows in groups] + [None] * (most - len(groups))

    def _filler_forward(self) -> Tensor:
        """A forward that keeps this rank in step with the others when it has no rows left; returns 0 * logits."""
        ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        ids, mask, images = recompute.with_blank_image(self.model, ids, torch.ones_like(ids), None)
        with self._compute():
            return self.model(input_ids=ids, attention_mask=mask, use_cache=False,
                              **recompute.forward_inputs(self.model, ids, mask, images)).logits.float().sum() * 0.0

    def _cut(self, t: Tensor, rows: Tensor, width: int) -> Tensor:
        return t[rows, :width].to(self.device)

    def _rows(self, batch: invariants.TrainBatch,
              rows: Tensor) -> tuple[Tensor, Tensor, Tensor | None, list, dict, int]:
        """input_ids, attention_mask, routes, images and the per-token sampling of `rows` (with the wanted
        positions), cut to their longest row (right padding), and that width."""
        width = max(int(batch.attention_mask[rows].sum(-1).max()), 1)
        routes = self._cut(batch.routes, rows, width) if batch.routes is not None else None
        sampling = {name: self._cut(getattr(batch, name), rows, width) for name in invariants.SAMPLING_TENSORS}
        sampling["runs"] = [batch.runs[b] for b in rows.tolist()]
        sampling["positions"] = recompute.wanted_positions(self._cut(batch.loss_mask, rows, width), sampling["runs"])
        input_ids = self._cut(batch.input_ids, rows, width)
        attention_mask = self._cut(batch.attention_mask, rows, width)
        # the prefixes a micro-batch's rows share are computed once, except where that cannot be exact: routes
        # replayed (R3 replays each row's own recorded routes, and a shared prefix would carry one row's),
        # checkpointed layers (their recompute in backward would append to the KV cache a second time), compiled
        # layers (the cache's layer index makes each layer a graph of its own: past torch._dynamo's recompile limit
        # of 8 the other layers run eager), and FSDP2 (its collectives run in every forward call; the calls of a
        # shared forward depend on the rows, so ranks could make different numbers of calls and wait forever).
        # actor/prefix_tokens_saved reads 0 then.
        if routes is None and not (self.cfg.activation_checkpointing or self.compiled) and self.world_size == 1:
            sampling["prefixes"] = recompute.shared_prefixes(input_ids, attention_mask, sampling["positions"])
        return input_ids, attention_mask, routes, [batch.images[b] for b in rows.tolist()], sampling, width

    # -- logprob recompute (the proximal policy pi_prox, or a reference or teacher model) --

    @torch.no_grad()
    def recompute_logprobs(self, batch: invariants.TrainBatch, model: torch.nn.Module | None = None) -> Tensor:
        """Logprobs of the current weights on this rank's rows, [B,T] fp32 on CPU, each wanted token (trainable, or
        in an adjusted run; 0.0 elsewhere) at its own recorded sampling (TrainBatch.temperature/top_p/top_k/min_p and
        runs), with MoE routes replayed. `model`: a frozen reference or teacher on this device instead, in the same
        precision and micro-batches (no routes: it has none of its own to replay)."""
        own = model is None
        model = self.model if own else model
        _check_right_padded(batch.attention_mask)
        batch_size, length = batch.input_ids.shape
        out = torch.zeros((batch_size, length), dtype=torch.float32)
        for rows in self._micro_batches(batch):
            if rows is None:
                self._filler_forward()
                continue
            input_ids, attention_mask, routes, images, sampling, width = self._rows(batch, rows)
            with self._compute():
                out[rows, :width] = recompute.sequence_logprobs(model, input_ids, attention_mask,
                                                                routes=routes if own else None, images=images,
                                                                **sampling).cpu()
        return out

    # -- one optimizer step --
    # A step has two ways to its loss weights, by where its proximal logprobs (pi_prox) come from:
    #   recomputed (prox_logprobs given: a later minibatch of the batch): invariant 2 runs on the whole step first
    #     (_correct_whole_step), so the global counts, hence every token's final algo.loss_weights, are known before
    #     the first backward;
    #   own forward (prox_logprobs None: the batch's first minibatch, whose weights ARE the proximal ones): each
    #     micro-batch's forward gives its pi_prox, invariant 2 runs on it there (every gate is per rollout or per
    #     token, and a micro-batch holds whole rollouts, whole groups where the loss weighs a token by its group's
    #     kept tokens), its tokens are weighed by algo.loss_numerators, and the
    #     summed gradient is divided by algo.loss_denominator once the last micro-batch has given the global counts
    #     (_divide_by_global_counts; the gradient is linear in the weights).
    # Both give the same update as one backward over the whole step (tests/test_actor.py).

    def train_step(self, batch: invariants.TrainBatch, prox_logprobs: Tensor | None, algo_cfg: algo.AlgoConfig,
                   correction_cfg: invariants.CorrectionConfig, trainer_version: int,
                   ref_logprobs: Tensor | None = None, token_budget: int | None = None) -> "StepReport":
        """ONE optimizer step over this rank's rows of the step's batch (all micro-batches, all ranks).
        prox_logprobs: [B,T] recomputed with the weights of `trainer_version` (the proximal policy), or None when
        those weights are the current ones (the batch's first optimizer step): each micro-batch's own forward then
        gives them, detached, and the separate recompute pass is saved. That is exact, not an approximation: the
        proximal logprobs ARE these weights' logprobs, the PPO ratio is 1 with the policy gradient as its gradient,
        and the gates and the mismatch metrics see the numbers a recompute gives.
        ref_logprobs: [B,T] of the reference model, needed when the KL is a loss term (algo.kl_loss_coef > 0).
        token_budget: Dr.GRPO's constant (most sampled tokens a rollout can hold), for seq_mean_token_sum_norm.
        The rows of a rollout must be on one rank. Returns the step's metrics and what the step did to each token
        (StepReport.prox_logprobs: the proximal logprobs used). Gradients of the step stay on the parameters until
        the next call (zeroed at the start)."""
        step = self._start_step(batch, prox_logprobs, algo_cfg, correction_cfg, trainer_version, ref_logprobs,
                                token_budget)
        self.optimizer.zero_grad(set_to_none=True)
        if prox_logprobs is not None and not self._correct_whole_step(step, prox_logprobs):
            return step.report.done(self._step_metrics(step, 0.0, skipped=True))   # nothing kept, on any rank
        for rows in self._micro_batches(batch, algo_cfg.loss_agg in algo.GROUP_AGGREGATIONS):
            if rows is None:
                self._filler_forward().backward()
            else:
                self._micro_batch_backward(step, rows)
        if prox_logprobs is None and not self._divide_by_global_counts(step):
            self.optimizer.zero_grad(set_to_none=True)
            return step.report.done(self._step_metrics(step, 0.0, skipped=True))
        return self._optimizer_step(step)

    def _start_step(self, batch: invariants.TrainBatch, prox_logprobs: Tensor | None, algo_cfg: algo.AlgoConfig,
                    correction_cfg: invariants.CorrectionConfig, trainer_version: int, ref_logprobs: Tensor | None,
                    token_budget: int | None) -> _Step:
        """Refuse a step that cannot be taken as asked; else its empty _Step."""
        _check_right_padded(batch.attention_mask)
        if prox_logprobs is None and trainer_version != self.version:
            raise ValueError(f"prox_logprobs=None means the proximal policy is the current weights (version "
                             f"{self.version}), but trainer_version is {trainer_version}; pass recompute_logprobs "
                             f"of the batch taken at version {trainer_version}")
        if prox_logprobs is not None and prox_logprobs.shape != batch.input_ids.shape:
            raise ValueError(f"prox_logprobs must be [B,T]={tuple(batch.input_ids.shape)} aligned to tokens, "
                             f"got {tuple(prox_logprobs.shape)}; use recompute_logprobs(batch)")
        kl_coef = algo.kl_loss_coef(algo_cfg)
        if kl_coef > 0 and ref_logprobs is None:
            raise ValueError(f"kl_coef={algo_cfg.kl_coef} adds a KL loss term but ref_logprobs is None; pass the "
                             f"reference model's logprobs, or set kl_coef=0")
        return _Step(batch, algo_cfg, correction_cfg, trainer_version, ref_logprobs, token_budget,
                     StepReport.empty(batch.input_ids.shape), kl_coef)

    def _correct_whole_step(self, step: _Step, prox_logprobs: Tensor) -> bool:
        """Recomputed path: invariant 2 on this rank's rows, the global counts, and every token's final loss weight
        (step.weights). False if the gates left no token on any rank (no update then)."""
        batch = step.batch
        rollout_index = invariants.rollout_index(batch.rollout_ids)
        correction = self._correct(step, prox_logprobs.float(), batch.behavior_logprobs.float(),
                                   batch.loss_mask.float(), batch.policy_versions, rollout_index)
        step.report.write(slice(None), batch.input_ids.shape[1], prox_logprobs=prox_logprobs,
                          is_weights=correction.is_weights, mask=correction.mask, kept=correction.keep,
                          staleness=correction.staleness)
        group_index = invariants.rollout_index(batch.group_ids)
        step.global_tokens, step.global_rollouts, step.global_groups = self._global_counts(
            correction.mask, rollout_index, group_index)
        if step.global_tokens == 0:
            return False
        step.weights = algo.loss_weights(correction.mask, step.algo_cfg.loss_agg, step.global_tokens,
                                         step.global_rollouts, step.token_budget, rollout_index, group_index,
                                         step.global_groups)
        return True

    def _micro_batch_backward(self, step: _Step, rows: Tensor) -> None:
        """Forward with grad over some whole rollouts, their policy loss (plus the KL to the reference, not
        IS-weighted) weighed per token, backward; what it did goes into step.report and step.sums. The report is
        filled in place: recomputed, it is complete already; own forward, this micro-batch's correction writes its
        rows before any use, so no micro-batch reads another's unfilled rows."""
        batch, cfg = step.batch, step.algo_cfg
        input_ids, attention_mask, routes, images, sampling, width = self._rows(batch, rows)
        cut = functools.partial(self._cut, rows=rows, width=width)
        loss_mask, advantages = cut(batch.loss_mask), cut(batch.advantages).float()
        rollout_index = invariants.rollout_index([batch.rollout_ids[b] for b in rows.tolist()]).to(self.device)
        group_index = invariants.rollout_index([batch.group_ids[b] for b in rows.tolist()]).to(self.device)
        step.sums["r3_unreplayed_tokens"] += self._unreplayed_tokens(routes, loss_mask)
        # MoE routes stay replayed through the backward too (an activation-checkpointed recompute would otherwise
        # route live and disagree with the forward)
        replay = r3.replay_routes(self.model, routes) if routes is not None else contextlib.nullcontext()
        with replay:
            heads = cut(centering.batch_heads(batch, cfg.score_centering)) if cfg.score_centering else None
            with self._compute():
                logprobs, entropy, head_logprobs = recompute.forward_logprobs(
                    self.model, input_ids, attention_mask, images=images, with_entropy=True, candidates=heads,
                    **sampling)
            if step.weights is None:      # own forward: these logprobs, detached, are the proximal ones
                prox = logprobs.detach().float()
                correction = self._correct(step, prox, cut(batch.behavior_logprobs).float(), loss_mask.float(),
                                           cut(batch.policy_versions), rollout_index)
                step.report.write(rows, width, prox_logprobs=prox, is_weights=correction.is_weights,
                                  mask=correction.mask, kept=correction.keep, staleness=correction.staleness)
                is_weights, mask = correction.is_weights, correction.mask
                weights = algo.loss_numerators(mask, cfg.loss_agg, step.token_budget, rollout_index, group_index)
            else:
                prox, is_weights, mask = (cut(t) for t in (step.report.prox_logprobs, step.report.is_weights,
                                                           step.report.mask))
                weights = cut(step.weights)
            if cfg.score_centering:
                token_loss, loss_metrics = centering.centered_policy_loss(
                    logprobs, head_logprobs, cut(batch.top_behavior_logprobs).float(), prox, advantages, mask)
            else:
                token_loss, loss_metrics = algo.policy_loss(logprobs, prox, advantages, mask, cfg,
                                                            is_weights=is_weights, rollout_index=rollout_index)
            if step.kl_coef > 0:  # KL to the reference as a loss term, not IS-weighted
                kl = algo.kl_divergence(logprobs, cut(step.ref_logprobs).float(), cfg.kl_estimator) * mask
                token_loss = token_loss + step.kl_coef * kl
                step.sums["kl_ref"] += float(kl.detach().sum())
            token_share = token_loss * weights      # each token's share of the step's loss
            loss = token_share.sum()
            loss.backward()       # also with nothing kept: under FSDP2 every rank runs every backward
        step.report.write(rows, width, loss_contribution=token_share.detach())
        kept_tokens = float(mask.sum())
        step.sums["prefix_tokens_saved"] += sampling["prefixes"].saved if sampling.get("prefixes") else 0.0
        step.sums["loss"] += float(loss.detach())
        step.sums["entropy"] += float((entropy * mask).sum())
        for name in POLICY_LOSS_METRICS:  # per-micro-batch token means -> token-weighted sums
            step.sums[name] += loss_metrics[name] * kept_tokens

    def _unreplayed_tokens(self, routes: Tensor | None, loss_mask: Tensor) -> float:
        """Trainable tokens whose predicting position has a layer with no recorded route: the live router chose
        there (invariant 3 holds only where routes were recorded). No routes at all on an MoE model: every one
        (vLLM reports none for a request kept across a weight update: bench/fp32_parity.py on an H200)."""
        unrouted = ((routes[:, :-1] < 0).flatten(2).any(-1) if routes is not None else
                    torch.full_like(loss_mask[:, 1:], self.is_moe, dtype=torch.bool))
        return float((unrouted & (loss_mask[:, 1:] > 0)).sum())

    def _divide_by_global_counts(self, step: _Step) -> bool:
        """Own-forward path, after the last backward: the global counts of the step, known now, divide the summed
        gradient, the tokens' shares and the loss once. False if the gates left no token on any rank."""
        step.global_tokens, step.global_rollouts, step.global_groups = self._global_counts(
            step.report.mask, invariants.rollout_index(step.batch.rollout_ids),
            invariants.rollout_index(step.batch.group_ids))
        if step.global_tokens == 0:
            return False
        denominator = algo.loss_denominator(step.algo_cfg.loss_agg, step.global_tokens, step.global_rollouts,
                                            step.global_groups)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.div_(denominator)
        step.report.loss_contribution /= denominator
        step.sums["loss"] /= denominator
        return True

    def _optimizer_step(self, step: _Step) -> StepReport:
        """Clip the global gradient norm, step, advance the schedule and the version; a NaN/inf gradient skips the
        update instead (it would poison AdamW's moments)."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        grad_norm = float(grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm)
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            step.report.loss_contribution.zero_()
            return step.report.done(self._step_metrics(step, grad_norm, skipped=True))
        metrics = self._step_metrics(step, grad_norm, skipped=False)
        self.optimizer.step()
        self.scheduler.step()
        self.version += 1
        metrics["actor/version"] = float(self.version)
        return step.report.done(metrics)

    def _global_counts(self, mask: Tensor, rollout_index: Tensor, group_index: Tensor) -> tuple[float, float, float]:
        """Kept tokens, rollouts and groups of the step over every rank (rollouts are rank-local, and so are groups
        wherever a loss counts them: runtime.TrainerGroup deals them whole then, so counts add up)."""
        mask = mask.cpu()
        return tuple(self._reduce([float(mask.sum()), float(invariants.count_rollouts(mask, rollout_index)),
                                   float(invariants.count_rollouts(mask, group_index))]))

    @staticmethod
    def _correct(step: _Step, prox_logprobs: Tensor, behavior_logprobs: Tensor, loss_mask: Tensor, versions: Tensor,
                 rollout_index: Tensor) -> invariants.Correction:
        """invariants.apply_correction on some whole rollouts (the version gate: staleness <= max_staleness, both in
        policy versions; the veto and seq/geo band gates; the IS weights pi_prox / mu per token, each against its
        own behavior logprob, detached; the rejection rule), adding its figures to the step's sums and maxima."""
        correction = invariants.apply_correction(prox_logprobs, behavior_logprobs, loss_mask, versions,
                                                 step.trainer_version, step.correction_cfg, rollout_index)
        diff = ((prox_logprobs - behavior_logprobs) * loss_mask).abs()   # train/infer mismatch before correcting
        trainable_rows = loss_mask.sum(-1) > 0
        rollout_staleness = {int(i): float(s) for i, s, t in zip(rollout_index, correction.staleness, trainable_rows)
                             if t}
        gated_tokens = float((loss_mask * correction.keep.to(loss_mask.dtype).unsqueeze(-1)).sum())
        additions = {"trainable_tokens": float(loss_mask.sum()), "gated_tokens": gated_tokens,
                     "rollouts": float(len(rollout_staleness)), "staleness": sum(rollout_staleness.values()),
                     "logprob_diff": float(diff.sum()),
                     **{f"gate/{k}": float(v) for k, v in correction.gate_counts.items()},
                     # the invariants' IS metrics are means over these gated tokens: weight them back into sums
                     **{f"is/{k}": float(v) * gated_tokens for k, v in correction.is_metrics.items()}}
        for name, value in additions.items():
            step.sums[name] += value
        step.maxes["staleness_max"] = max(step.maxes["staleness_max"], max(rollout_staleness.values(), default=0.0))
        step.maxes["logprob_diff_max"] = max(step.maxes["logprob_diff_max"], float(diff.max()) if diff.numel() else 0.0)
        return correction

    # -- step metrics (summed over micro-batches and ranks, then divided by global counts) --

    def _step_metrics(self, step: _Step, grad_norm: float, skipped: bool) -> dict[str, float]:
        total = dict(zip(step.sums, self._reduce(list(step.sums.values()))))
        top = dict(zip(step.maxes, self._reduce(list(step.maxes.values()), dist.ReduceOp.MAX)))
        kept = max(step.global_tokens, 1.0)
        metrics = {"actor/loss": total["loss"], "actor/grad_norm": grad_norm,
                   "actor/bf16": float(self.precision == "bf16"),    # which precision this run's actor computed in
                   "actor/lr": self.scheduler.get_last_lr()[0], "actor/skipped": float(skipped),
                   "actor/version": float(self.version),
                   "actor/kept_tokens": step.global_tokens, "actor/kept_rollouts": step.global_rollouts,
                   "actor/entropy": total["entropy"] / kept, "actor/kl_ref": total["kl_ref"] / kept,
                   # token positions the forward did not compute: prompts shared by a micro-batch's rows, run once
                   "actor/prefix_tokens_saved": total["prefix_tokens_saved"],
                   "actor/r3_unreplayed_tokens": total["r3_unreplayed_tokens"],   # MoE: trained on live routes
                   **{f"actor/{name}": total[name] / kept for name in POLICY_LOSS_METRICS},
                   "actor/staleness_mean": total["staleness"] / max(total["rollouts"], 1.0),   # per rollout
                   "actor/staleness_max": top["staleness_max"],
                   "actor/logprob_diff_mean": total["logprob_diff"] / max(total["trainable_tokens"], 1.0),
                   "actor/logprob_diff_max": top["logprob_diff_max"]}
        metrics.update({k: v for k, v in total.items() if k.startswith("gate/")})
        metrics.update({k: v / max(total["gated_tokens"], 1.0) for k, v in total.items() if k.startswith("is/")})
        return metrics

    # -- weights out --

    @torch.no_grad()
    def export_weights(self, device: torch.device | str = "cpu") -> dict[str, Tensor]:
        """Full (unsharded) weights for the engine, copied to `device` (the CPU, or the GPU an engine shares with
        the actor, where the copy never crosses PCIe), or under LoRA the adapter's tensors alone: EVERY state_dict entry (a refit that filters by name can
        silently ship a handful of a model's parameters), each in its own dtype (an fp32 router or norm cast to bf16
        changes the engine's model), minus the tied output embedding by its exact key (models.tied_output_key).
        Collective under FSDP2; every rank gets the full dict."""
        skip, full = models.tied_output_key(self.model), lambda t: t.full_tensor() if isinstance(t, DTensor) else t
        # under LoRA the engines hold the frozen base already: a push is the adapter alone (lora.adapter_state)
        state = lora.adapter_state(self.model) if self.lora else self.model.state_dict()
        return {name: full(value).detach().to(device, copy=True) for name, value in state.items() if name != skip}

    # -- checkpoints --

    def save_checkpoint(self, path: str, run_state: dict | None = None) -> None:
        """Write model, optimizer, scheduler, version and RNG states to `path` atomically: everything goes to
        `path`.tmp, the marker is written last, then the folder is renamed into place (replacing an old one).
        `run_state`: what the training loop needs to continue exactly (its step, the engines' sampler streams,
        Python's RNG), saved beside the actor's own state and handed back by load_checkpoint."""
        # under LoRA the frozen base is the model folder's: only the adapter and its optimizer state are saved
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=bool(self.lora))
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=options)
        if self.lora:      # (a tied head is reported beside the trainable tensors all the same)
            model_state = {name: t for name, t in model_state.items() if lora.ADAPTER_MARK in name}
        path = os.path.normpath(path)
        tmp = path + ".tmp"
        if self.rank == 0:        # the folder and the shared state first; then every rank's RNG streams
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            torch.save({"model": model_state, "optimizer": optimizer_state, "scheduler": self.scheduler.state_dict(),
                        "version": self.version, "world_size": self.world_size,
                        "lora": asdict(self.lora) if self.lora else None},
                       os.path.join(tmp, CHECKPOINT_STATE))
            if self.lora:     # the adapter as PEFT saves one too, for use outside tracerl (PeftModel, vLLM)
                lora.write_peft_folder(model_state, self.lora, os.path.join(tmp, LORA_ADAPTER))
            torch.save(run_state or {}, os.path.join(tmp, RUN_STATE))
        self._barrier()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        torch.save({"cpu": torch.get_rng_state(), "cuda": cuda_rng}, os.path.join(tmp, f"rng_rank{self.rank}.pt"))
        self._barrier()
        if self.rank == 0:
            with open(os.path.join(tmp, CHECKPOINT_MARKER), "w") as f:
                f.write(f"version {self.version}\n")
            shutil.rmtree(path, ignore_errors=True)
            os.rename(tmp, path)
        self._barrier()

    def load_checkpoint(self, path: str) -> dict:
        """Restore a folder written by save_checkpoint (any world size; RNG states when the rank's file exists).
        Returns the run_state it was saved with ({} if none)."""
        if not os.path.exists(os.path.join(path, CHECKPOINT_MARKER)):
            raise FileNotFoundError(
                f"{path!r} is not a complete actor checkpoint: the marker file {CHECKPOINT_MARKER} is missing, so the "
                f"save was interrupted or the folder is something else. Resume from an earlier complete checkpoint.")
        state = torch.load(os.path.join(path, CHECKPOINT_STATE), map_location="cpu", weights_only=True)
        saved_lora = state.get("lora")
        if saved_lora != (asdict(self.lora) if self.lora else None):
            raise ValueError(f"{path!r} was saved with LoRA {saved_lora} but this actor trains LoRA "
                             f"{asdict(self.lora) if self.lora else None}; resume with the same "
                             f"--actor.lora_rank and --actor.lora_alpha")
        if self.lora and sorted(state["model"]) != sorted(lora.adapter_keys(self.model)):
            raise ValueError(f"{path!r} holds another adapter than this model's ({len(state['model'])} tensors, "
                             f"{len(lora.adapter_keys(self.model))} expected)")
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=StateDictOptions(full_state_dict=True, strict=not self.lora))
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = state["version"]
        rng_file = os.path.join(path, f"rng_rank{self.rank}.pt")
        if os.path.exists(rng_file):
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if rng["cuda"] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        run_state = os.path.join(path, RUN_STATE)
        return torch.load(run_state, weights_only=True) if os.path.exists(run_state) else {}

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

