"""Redis-backed stores: traffic statistics for warmup planning (later: KV snapshots, response caches)."""
