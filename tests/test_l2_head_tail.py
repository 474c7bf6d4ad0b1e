"""A demotion that mixes a block L2 already holds (the chain's head, demoted and promoted before) with a new
one (its tail) re-ticked the new block after the whole run: the tail's use became newer than the head's,
against the run's aging order (tail first). After the lookup that promotes the chain (a use of each, tail
first), L2's LRU-K victim is the head, not the tail: L2 drops the head and keeps a tail no lookup can reach
(docs/INTERNALS.md: "L2 never drops a head and keeps a tail no lookup can reach")."""

from __future__ import annotations

import torch

from engine.l2_pool import HostBlockPool


def test_a_chain_demoted_tail_first_then_promoted_ages_tail_first_in_l2():
    pool = HostBlockPool(4, (2, 3), torch.float32, pin=False, k=2)
    source = torch.stack([torch.full((2, 3), float(row)) for row in range(4)])
    head, tail = b"head", b"tail"
    # an earlier one-block prompt left the head in L2 (demoted from L1, one use)
    pool.put_many([head], source, rows=[0], oldest_first=[head])
    # the head came back to L1 (a lookup) and a longer prompt stored the tail; L1 evicts the chain, tail
    # first: the head is a block L2 holds, the tail a new one
    pool.take_run([head])
    pool.put_many([head, tail], source, rows=[0, 1], oldest_first=[tail, head])
    # a lookup promotes the chain again: L2 keeps its copies, each used once more, tail first
    assert len(pool.take_run([head, tail])) == 2
    assert pool.victim() == tail, (
        f"L2 would evict the head first (ranks: head {pool.rank(head)}, tail {pool.rank(tail)}), "
        "keeping a tail no lookup can reach"
    )
