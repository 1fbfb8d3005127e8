# engines/prefix_cache.py — the embedded engine's store of finished rows' KV, for the prompts that start with their ids.
#
# Owns: `PrefixCache`, the keys and values (per layer) of rows that finished, kept so that a later prompt which
# starts with the same ids prefills only what follows them (rollout.EmbeddedEngine._prefill). An agent's turn is
# its last turn's prompt, the reply, then a tool result: every position up to the reply's end was computed the turn
# before, and a coding harness sends 20-50K such tokens every turn. vLLM does the same with its prefix cache.
#
# Keyed by a salt, then by the ids (the longest common prefix). A hit is visible to the client: every wire reports
# the cached count (usage.prompt_tokens_details.cached_tokens and its kin), so a prompt that matched another session's
# entry would tell its sender that somebody sent those ids: a probe that appends each candidate secret to a shared
# system prompt reads which one was cached (another session's PIN, its sampled reply). So the rule, which
# vllm_engine.py follows with vLLM's per-request cache_salt:
#   a lookup matches only entries written under a salt the request carries (SamplingParams.cache_salt, given_salt);
#   cache_salt is its rollout's own: a secret made where the rollout starts (a ChatSession, an EnvRunner episode),
#     never derived from an id a client names; a finished row (prompt and reply) is kept under it, so only the same
#     rollout's later turns take its KV;
#   given_salt is set only on a request whose prompt is, id for id, the prompt the trainer gave its prompt group (the
#     rendered task: no id a client sent or the model sampled): the group's salt. Under it the engine keeps the
#     prompt's positions alone, never a sampled one, so the samples of one group share the task prompt's KV (each
#     of them was given those ids: sharing them tells nothing) and nothing after it;
#   "" is the salt of callers without sessions (benches, a judge, tests): they share among themselves only.
# A shared forward follows the same rule: rows with the same ids in one prefill (a group's samples, arriving
# together) are forwarded once, taking from the cache only under the salts they all carry.
# Keeps invariant 2 (a token is sampled from the weights of its recorded version): an entry records the version of
# the weights that computed it and is handed out only at that version, and the engine drops every entry whenever it
# loads weights (even at an unchanged version number: the weights changed), so no KV an older policy wrote ever
# conditions a token stamped with a newer one. Only text rows are kept: a vision model's positions (M-RoPE) and
# image features are computed over the whole prompt (models.vision_inputs), so its engine keeps nothing.
# Bounded: a byte budget over the tensors held, least recently used out first; an entry that a new one under the same
# salt extends is dropped at once (the new one covers it), so a session's turns hold one entry, not one per turn.
# Never: computes anything of the model, or decides what a row samples.
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Entry:
    """One finished row's KV: the positions it forwarded (its prompt and sampled ids, less the last sampled id,
    which no forward has fed yet)."""
    ids: torch.Tensor                  # [n] long, on the CPU: the ids at positions 0..n-1
    keys: list[torch.Tensor]           # per layer [kv_heads, n, head_dim], on the model's device
    values: list[torch.Tensor]         # per layer [kv_heads, n, head_dim]
    routes: np.ndarray | None          # int16 [n, layers, top_k]: an MoE's experts at those positions; else None
    version: int                       # the weights that computed every tensor above
    salt: str                          # the only requests it serves are those carrying this salt (the header)
    nbytes: int


class PrefixCache:
    """Finished rows' KV under a byte budget (0: keep nothing), least recently used first out. Used only under the
    engine's step lock (its decoding thread's lookups and keeps, a weight load's drop), so they never race."""

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"the prefix cache's budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.nbytes = 0
        self._entries: OrderedDict[int, Entry] = OrderedDict()   # insertion id -> entry, least recent first
        self._ids = itertools.count()                             # the next entry's insertion id

    def __len__(self) -> int:
        return len(self._entries)

    def drop(self) -> None:
        """Forget every entry (new weights: what they hold is the old policy's)."""
        self._entries.clear()
        self.nbytes = 0

    def lookup(self, ids: list[int], version: int, salts: tuple[str, ...] = ("",)) -> tuple[Entry | None, int]:
        """The entry computed at `version`, written under one of `salts`, that shares the longest common prefix with
        `ids`, and that length (None, 0 when none shares a first id). The caller may take positions 0..length-1."""
        query = torch.tensor(ids, dtype=torch.long)
        best, best_key, length = None, None, 0
        for key, entry in self._entries.items():
            if entry.version != version or entry.salt not in salts:
                continue
            common = _common_prefix(entry.ids, query)
            if common > length:
                best, best_key, length = entry, key, common
        if best is not None:
            self._entries.move_to_end(best_key)
        return best, length

    def keep(self, ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor], routes: np.ndarray | None,
             version: int, salt: str = "") -> None:
        """Hold a finished row's KV for positions 0..len(ids)-1 under `salt`. Entries of another version go (they can
        never serve again: versions only grow), so do entries of this salt whose ids this one extends; a row that an
        entry of this salt already covers, or larger than the whole budget, is not kept."""
        nbytes = sum(t.nbytes for t in keys + values) + 8 * len(ids) + (routes.nbytes if routes is not None else 0)
        if not ids or nbytes > self.budget_bytes:
            return
        new = torch.tensor(ids, dtype=torch.long)
        for key, entry in list(self._entries.items()):
            common = _common_prefix(entry.ids, new) if entry.version == version and entry.salt == salt else -1
            if common == len(new):            # an entry holds all of it already (and perhaps more)
                self._entries.move_to_end(key)
                return
            if entry.version != version or common == len(entry.ids):
                self._remove(key)
        self._entries[next(self._ids)] = Entry(new, keys, values, routes, version, salt, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.budget_bytes:
            self._remove(next(iter(self._entries)))

    def _remove(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes


def stacked_prefixes(reused: list[tuple[Entry | None, int]], past: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the keys and values [rows, kv_heads, past, head_dim] a prefill starts from: row b's reused
    positions (reused[b] = (entry, k): the entry's first k) at its right end, zeros before them (the engine masks
    those out). [] when no row reuses a position."""
    held = [(b, entry, k) for b, (entry, k) in enumerate(reused) if k]
    layers = []
    for layer in range(len(held[0][1].keys) if held else 0):
        stacked = []
        for name in ("keys", "values"):
            like = getattr(held[0][1], name)[layer]
            t = like.new_zeros(len(reused), like.shape[0], past, like.shape[-1])
            for b, entry, k in held:
                t[b, :, past - k:] = getattr(entry, name)[layer][:, :k]
            stacked.append(t)
        layers.append((stacked[0], stacked[1]))
    return layers


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many first ids two id tensors share."""
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0, 0]) if len(differ) else n
