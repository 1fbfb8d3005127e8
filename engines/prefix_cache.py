# engines/prefix_cache.py — the embedded engine's store of finished rows' KV, for the prompts that start with their ids.
#
# Owns: `PrefixCache`, the keys and values (per layer) of rows that finished, kept so that a later prompt which
# starts with the same ids prefills only what follows them (rollout.EmbeddedEngine._prefill). An agent's turn is
# its last turn's prompt, the reply, then a tool result: every position up to the reply's end was computed the turn
# before, and a coding harness sends 20-50K such tokens every turn. vLLM does the same with its prefix cache.
#
# Keyed by the ids themselves, by the longest common prefix (as vLLM's block hashes key its cache by content), not
# by a session id. A position's KV is a function of the ids up to it and of the weights, nothing else; so any prompt
# that agrees with an entry on its first k ids may take those k positions: the session's next turn, a turn whose
# agent rewrote its context after the system prompt (the ledger seals, yet the system prompt's KV still serves),
# another session with the same system prompt and tools. A session id would promise nothing about the ids (an agent
# may rewrite its history under the same id), so it would still need this check, and it would need the Router to
# pass engine internals down: the Router stays an engine-agnostic placer whose stickiness makes the hits likely.
# Keeps invariant 2 (a token is sampled from the weights of its recorded version): an entry records the version of
# the weights that computed it and is handed out only at that version, and the engine drops every entry whenever it
# loads weights (even at an unchanged version number: the weights changed), so no KV an older policy wrote ever
# conditions a token stamped with a newer one. Only text rows are kept: a vision model's positions (M-RoPE) and
# image features are computed over the whole prompt (models.vision_inputs), so its engine keeps nothing.
# Bounded: a byte budget over the tensors held, least recently used out first; an entry that a new one extends is
# dropped at once (the new one covers it), so a session's turns hold one entry, not one per turn.
# Never: computes anything of the model, or decides what a row samples.
from __future__ import annotations

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
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._entries)

    def drop(self) -> None:
        """Forget every entry (new weights: what they hold is the old policy's)."""
        self._entries.clear()
        self.nbytes = 0

    def lookup(self, ids: list[int], version: int) -> tuple[Entry | None, int]:
        """The entry computed at `version` that shares the longest common prefix with `ids`, and that length (None,
        0 when none shares a first id). The caller may take positions 0..length-1 of its KV."""
        query = torch.tensor(ids, dtype=torch.long)
        best, best_key, length = None, None, 0
        for key, entry in self._entries.items():
            if entry.version != version:
                continue
            common = _common_prefix(entry.ids, query)
            if common > length:
                best, best_key, length = entry, key, common
        if best is not None:
            self._entries.move_to_end(best_key)
        return best, length

    def keep(self, ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor], routes: np.ndarray | None,
             version: int) -> None:
        """Hold a finished row's KV for positions 0..len(ids)-1. Entries of another version go (they can never
        serve again: versions only grow), so do entries whose ids this one extends; a row that an entry already
        covers, or larger than the whole budget, is not kept."""
        nbytes = sum(t.nbytes for t in keys + values) + 8 * len(ids) + (routes.nbytes if routes is not None else 0)
        if not ids or nbytes > self.budget_bytes:
            return
        new = torch.tensor(ids, dtype=torch.long)
        for key, entry in list(self._entries.items()):
            common = _common_prefix(entry.ids, new) if entry.version == version else -1
            if common == len(new):            # an entry holds all of it already (and perhaps more)
                self._entries.move_to_end(key)
                return
            if entry.version != version or common == len(entry.ids):
                self._remove(key)
        self._entries[self._next_id] = Entry(new, keys, values, routes, version, nbytes)
        self._next_id += 1
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
