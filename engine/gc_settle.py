"""Garbage-collector settling at the end of a model's initialize() (torch-free: text steps use it too)."""

import gc


def settle_garbage_collector() -> None:
    """Collect once, then move every object alive now out of the collector's reach.

    Loading torch and transformers leaves millions of long-lived objects; without this, the first
    full collection after READY walks all of them (tens of ms) inside some unlucky request.
    """
    gc.collect()
    gc.freeze()
