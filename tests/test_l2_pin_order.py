"""L2's pin room for a warmed template is spent tail first (L1 evicts tails first, one at a time under
small stores), so with less room than the template's demoted part, L2 pins a tail whose head it later
drops: a pinned block no lookup can reach, never evicted, its pin room lost for good.
(found in review, 2026-12-07)"""

from __future__ import annotations

from engine.l2_pool import HostBlockPool
from engine.prefix_cache import PrefixCache
from tests.test_prefix_cache_random import BLOCK, SlotRunner
from tests.test_prefix_cache_random import serve as prefill_and_store


def test_l2_never_pins_a_warmed_tail_whose_head_it_does_not_keep():
    runner = SlotRunner()
    cache = PrefixCache(runner, 4, BLOCK, "fp")  # L1 pin room: 2
    cache.l2 = HostBlockPool(2, tuple(cache.pool.shape[1:]), cache.pool.dtype, pin=False)  # L2 pin room: 1
    template = list(range(1, 10))  # four full blocks of 2 before its last token
    keys = cache.chain_keys(template, "t")
    assert len(keys) == 4
    prefill_and_store(cache, runner, template, "t", pin=True)  # as the warmup's prefill_template
    assert [key in cache.pinned for key in keys] == [True, True, False, False]
    for start in range(100, 400, 10):  # one-off prompts of one block each: L1 evicts one block a store
        prefill_and_store(cache, runner, [start, start + 1, start + 2], "t")
    l2_pinned = [key in cache.l2.pinned for key in keys]
    held = [key in cache.index or key in cache.l2 for key in keys]
    reachable = 0
    while reachable < len(held) and held[reachable]:
        reachable += 1
    stranded = [i for i, pinned in enumerate(l2_pinned) if pinned and i > reachable]
    assert not stranded, (
        f"L2 pins template blocks {stranded} behind a block it no longer holds (held {held}, L2 pinned "
        f"{l2_pinned}): unreachable and never evicted"
    )
    # the room should have gone head first: the template's third block stays reusable
    assert len(prefill_and_store(cache, runner, template, "t")) >= 3
