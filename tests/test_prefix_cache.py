# The prefix cache's store on its own: which entry a prompt gets, what it is refused, what stays under the budget.
# The engine's use of it (parity with a full prefill, weight updates) is tested in tests/test_rollout.py.
import pytest
import torch

from engines.prefix_cache import PrefixCache, stacked_prefixes

LAYERS, HEADS, DIM = 2, 2, 4


def kv(n: int, fill: float = 1.0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Keys and values of n positions, per layer; position p of layer l holds fill * (100 * l + p)."""
    per_layer = [fill * (100 * layer + torch.arange(n, dtype=torch.float32))[None, :, None].expand(HEADS, n, DIM)
                 for layer in range(LAYERS)]
    return [t.clone() for t in per_layer], [-t.clone() for t in per_layer]


def entry_bytes(n: int) -> int:
    return 2 * LAYERS * HEADS * n * DIM * 4 + 8 * n


def test_a_prompt_gets_the_entry_it_shares_the_most_first_ids_with():
    cache = PrefixCache(10**6)
    cache.keep([1, 2, 3, 4, 5], *kv(5), None, version=0)
    cache.keep([1, 2, 9, 9, 9, 9, 9], *kv(7, 2.0), None, version=0)
    entry, shared = cache.lookup([1, 2, 3, 4, 7, 7], version=0)
    assert shared == 4 and entry.ids.tolist() == [1, 2, 3, 4, 5]
    entry, shared = cache.lookup([1, 2, 9, 9], version=0)       # a prompt shorter than the entry: all of it
    assert shared == 4 and entry.ids.tolist()[:3] == [1, 2, 9]
    assert cache.lookup([8, 1, 2], version=0) == (None, 0)     # nothing shares the first id


def test_an_entry_of_another_version_is_never_handed_out_and_goes_when_a_new_version_keeps():
    cache = PrefixCache(10**6)
    cache.keep([1, 2, 3], *kv(3), None, version=0)
    assert cache.lookup([1, 2, 3, 4], version=1) == (None, 0)
    assert cache.lookup([1, 2, 3, 4], version=0)[1] == 3       # armed: at its own version it serves
    cache.keep([5, 6], *kv(2), None, version=1)
    assert len(cache) == 1 and cache.nbytes == entry_bytes(2)
    cache.drop()
    assert (len(cache), cache.nbytes) == (0, 0) and cache.lookup([5, 6, 7], version=1) == (None, 0)


def test_an_entry_a_new_one_extends_is_replaced_and_one_already_covered_is_not_kept():
    cache = PrefixCache(10**6)
    cache.keep([1, 2, 3], *kv(3), None, version=0)
    cache.keep([1, 2, 3, 4, 5], *kv(5), None, version=0)      # the session's next turn
    assert len(cache) == 1 and cache.nbytes == entry_bytes(5)
    cache.keep([1, 2, 3, 4], *kv(4), None, version=0)         # covered by the entry held
    cache.keep([1, 2, 7], *kv(3), None, version=0)            # diverges: an entry of its own
    assert len(cache) == 2 and cache.nbytes == entry_bytes(5) + entry_bytes(3)


def test_the_budget_holds_by_dropping_the_least_recently_used_and_refusing_what_cannot_fit():
    cache = PrefixCache(3 * entry_bytes(4))
    for first in (10, 20, 30):
        cache.keep([first, 1, 2, 3], *kv(4), None, version=0)
    assert cache.lookup([10, 1, 9], version=0)[1] == 2          # 10's entry used: 20's is now the oldest
    cache.keep([40, 1, 2, 3], *kv(4), None, version=0)
    assert len(cache) == 3 and cache.nbytes <= cache.budget_bytes
    assert cache.lookup([20, 1], version=0) == (None, 0)
    assert all(cache.lookup([first, 1], version=0)[1] == 2 for first in (10, 30, 40))
    cache.keep(list(range(50, 70)), *kv(20), None, version=0)  # over the whole budget: not kept, nothing dropped
    assert len(cache) == 3 and cache.lookup([50], version=0) == (None, 0)
    nothing = PrefixCache(0)
    nothing.keep([1, 2], *kv(2), None, version=0)
    assert len(nothing) == 0
    with pytest.raises(ValueError, match=">= 0 bytes"):
        PrefixCache(-1)


def test_a_prefill_starts_from_each_rows_reused_positions_at_the_right_end():
    cache = PrefixCache(10**6)
    cache.keep([1, 2, 3, 4, 5], *kv(5), None, version=0)
    cache.keep([7, 8, 9], *kv(3, 2.0), None, version=0)
    long, _ = cache.lookup([1, 2, 3, 4, 5, 6], version=0)
    short, _ = cache.lookup([7, 8, 6], version=0)
    layers = stacked_prefixes([(long, 4), (None, 0), (short, 2)], past=4)
    assert len(layers) == LAYERS
    keys, values = layers[1]
    assert keys.shape == (3, HEADS, 4, DIM) and torch.equal(values, -keys)
    assert keys[0, 0, :, 0].tolist() == [100, 101, 102, 103]        # the long entry's first 4 positions
    assert keys[1].abs().sum() == 0                                  # a row that reuses nothing: all padding
    assert keys[2, 0, :, 0].tolist() == [0, 0, 200, 202]            # 2 positions, left-padded with zeros
    assert stacked_prefixes([(None, 0), (None, 0)], past=0) == []
