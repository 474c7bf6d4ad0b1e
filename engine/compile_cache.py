"""Where torch.compile's artifacts live between restarts, and the warmup's compile stage.

The compiled decode step (`ModelRunner.compile_decode`) persists through inductor's own on-disk
caches: TORCHINDUCTOR_CACHE_DIR points at a directory keyed by everything that may change the
generated code or make it wrong to reuse: the Triton model name and version, the model fingerprint
(config.json, sequence limit, dtype, KV layout), the checkpoint's tensor layout (safetensors
headers: names, shapes, dtypes), the slot count, the torch version and the device (GPU name and
compute capability). Inside, inductor's FX-graph and AOTAutograd caches are content-addressed on top
of that, so a changed graph never hits stale code either. A new model version therefore starts in
a new directory; old directories are left for the operator to delete.

    <compile_cache_dir>/<model>-v<version>-<key>/
        key.json        what the key was built from (for people; never read back)
        inductor/       TORCHINDUCTOR_CACHE_DIR: FX graphs, AOTAutograd entries, compiled kernels
        artifacts.bin   torch.compiler.save_cache_artifacts(): the same entries as one portable
                        file; hot-loaded only when inductor/ is empty (a fresh volume or image
                        that shipped just this file). It does not carry the compiled C++ kernels,
                        so that start pays the C++ compiler again (measured on the CPU: 11 s vs
                        20 s cold vs 1.8 s with inductor/ kept).

TORCHINDUCTOR_CACHE_DIR is process-wide: one engine per process (Triton's Python backend runs one
stub process per model instance) owns it. On the CPU, inductor compiles in-process
(compile_threads=1, unless TORCHINDUCTOR_COMPILE_THREADS is set): see compile_decode_buckets.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

KEY_FORMAT = 1
_COUNTERS = {
    "fxgraph_hit": ("inductor", "fxgraph_cache_hit"),
    "fxgraph_miss": ("inductor", "fxgraph_cache_miss"),
    "fxgraph_bypass": ("inductor", "fxgraph_cache_bypass"),
    "aot_hit": ("aot_autograd", "autograd_cache_hit"),
    "aot_miss": ("aot_autograd", "autograd_cache_miss"),
    "aot_bypass": ("aot_autograd", "autograd_cache_bypass"),
}


@dataclass(frozen=True)
class CompileCache:
    path: Path
    key: dict

    @property
    def inductor_dir(self) -> Path:
        return self.path / "inductor"

    @property
    def artifacts_path(self) -> Path:
        return self.path / "artifacts.bin"


def checkpoint_layout_digest(model_dir: Path) -> str:
    """Digest of the checkpoint's tensor layout: each safetensors file's header (names, dtypes,
    shapes, offsets) and every weight file's name and size. Reads a few KB, never the weights:
    compiled code takes the weights as inputs (inductor's freezing is off), so only their layout
    can make it stale."""
    digest = hashlib.sha256()
    for path in sorted(model_dir.iterdir()):
        if path.suffix not in (".safetensors", ".bin", ".pt", ".pth"):
            continue
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
        if path.suffix == ".safetensors":
            with path.open("rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                digest.update(handle.read(min(length, 64 << 20)))
    return digest.hexdigest()[:16]


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"cuda:{torch.cuda.get_device_name(index)}:sm{major}{minor}"
    return device.type


def compile_cache_for(
    root: str | Path,
    model_name: str,
    model_version: str,
    fingerprint: str,
    model_dir: Path,
    slots: int,
    device: torch.device,
) -> CompileCache:
    key = {
        "format": KEY_FORMAT,
        "model": model_name,
        "version": model_version or "0",
        "fingerprint": fingerprint,
        "checkpoint_layout": checkpoint_layout_digest(model_dir),
        "slots": slots,
        "torch": torch.__version__,
        "device": device_description(device),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{model_name}-v{key['version']}")
    return CompileCache(Path(root) / f"{name}-{digest}", key)


def cache_counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {name: int(counters[group][counter]) for name, (group, counter) in _COUNTERS.items()}


def check_trusted(cache: CompileCache) -> None:
    """Raise PermissionError unless the cache directory is this user's (or root's) and no one else may
    write it. What it holds is code the engine runs (inductor's pickled FX-graph entries, compiled .so
    kernels, artifacts.bin hot-loaded into them), and the default lives in /tmp, where any local user
    can create it first. Group-writable is allowed (a volume shared through a group, e.g. fsGroup);
    world-writable only for compile_cache_dir itself with the sticky bit (as /tmp), since then the
    keyed directory below, checked too, can only be its owner's."""
    uid = os.geteuid()
    root = cache.path.parent
    for path in (root, cache.path, cache.inductor_dir, cache.artifacts_path):
        try:
            info = path.stat()
        except FileNotFoundError:
            continue
        if info.st_uid not in (uid, 0):
            raise PermissionError(
                f"compile_cache_dir: {path} belongs to uid {info.st_uid}, not this process's ({uid}); "
                "not trusted, compiling without the cache"
            )
        sticky_root = path == root and info.st_mode & stat.S_ISVTX
        if info.st_mode & stat.S_IWOTH and not sticky_root:
            raise PermissionError(
                f"compile_cache_dir: {path} is writable by every user (mode {stat.S_IMODE(info.st_mode):o}); "
                "not trusted, compiling without the cache"
            )


def has_entries(cache: CompileCache) -> bool:
    """Whether an earlier start left inductor entries in the keyed directory."""
    return cache.inductor_dir.is_dir() and any(cache.inductor_dir.iterdir())


def activate(cache: CompileCache) -> bool:
    """Point inductor at the keyed directory; hot-load artifacts.bin when that directory holds no
    cache yet. Returns whether artifacts were loaded. PermissionError (nothing activated) for a
    directory another user controls (`check_trusted`)."""
    from torch._inductor.utils import clear_caches

    check_trusted(cache)
    had_entries = has_entries(cache)
    cache.inductor_dir.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache.inductor_dir.resolve())
    clear_caches()  # paths derived from the old directory are memoized
    key_file = cache.path / "key.json"
    if not key_file.exists():
        key_file.write_text(json.dumps(cache.key, indent=2) + "\n", encoding="utf-8")
    if had_entries or not cache.artifacts_path.exists():
        return False
    return torch.compiler.load_cache_artifacts(cache.artifacts_path.read_bytes()) is not None


def set_aside(cache: CompileCache) -> Path:
    """Move a cache directory that failed a compile out of the key's way (kept for the operator to
    look at and delete, like old versions' directories); the next `activate` starts it empty."""
    aside = cache.path.with_name(f"{cache.path.name}.failed-{os.getpid()}-{time.time_ns()}")
    os.replace(cache.path, aside)
    return aside


def save_artifacts(cache: CompileCache) -> int:
    """Write this process's compile artifacts as one file (atomically); returns its size in bytes."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return 0
    data = saved[0]
    partial = cache.artifacts_path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_bytes(data)
    os.replace(partial, cache.artifacts_path)
    return len(data)


def compile_decode_buckets(
    runner,
    cache: CompileCache,
    order: Sequence[int],
    deadline: float,
    failures: list[dict],
    clock: Callable[[], float] = time.perf_counter,
) -> dict:
    """The warmup's compile stage: compile the decode step per KV bucket (in `order`, most-used
    first) until `deadline`. The first failure ends the stage (the cause, e.g. no C++ compiler, would
    fail every bucket): it is appended to `failures` and every bucket not compiled stays eager.
    Returns the report's `compile` section: what compiled, what stayed eager, and the cache facts
    (artifacts hot-loaded, FX-graph/AOTAutograd cache hits and misses of this stage)."""
    info: dict = {
        "enabled": True,
        "cache_dir": str(cache.path),
        "artifacts_loaded": False,
        "artifacts_saved_bytes": 0,
        "compiled_buckets": [],
        "eager_buckets": [],
    }
    if runner.device.type == "cpu" and "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        # Inductor's worker pool (subprocesses that import torch) gains nothing on a warm cache and
        # keeps the cores busy right after READY, where serving runs on the same cores: measured on
        # the 2-core CPU machine, decode steps of up to 13 ms instead of 2.5 ms in the first seconds.
        from torch._inductor import config as inductor_config

        inductor_config.compile_threads = 1
    before = cache_counters()
    active = reused = False
    try:
        reused = has_entries(cache)
        info["artifacts_loaded"] = activate(cache)
        active = True
    except Exception as exc:  # an unreadable (or untrusted) cache costs a cold compile, never the load
        failures.append({"stage": "compile:cache", "error": f"{type(exc).__name__}: {exc}"})
    failed = False
    for bucket in order:
        if failed or clock() >= deadline:
            info["eager_buckets"].append(bucket)
            continue
        try:
            runner.compile_decode(bucket)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"[:2000]
            if active and (reused or info["artifacts_loaded"]) and "cache_set_aside" not in info:
                # what an earlier start left may be what failed: a kernel a killed link (model-load
                # timeout) or a full disk left truncated, which inductor only checks exists and would
                # load on every start. Set the directory aside and compile this bucket anew, once.
                try:
                    info["cache_set_aside"] = str(set_aside(cache))
                    failures.append({"stage": "compile:cache", "error": f"{error}; cache set aside"})
                    activate(cache)
                    runner.compile_decode(bucket)
                except Exception as retry_exc:
                    error = f"{type(retry_exc).__name__}: {retry_exc}"[:2000]
                else:
                    info["compiled_buckets"].append(bucket)
                    continue
            failures.append({"stage": f"compile:{bucket}", "error": error})
            info["eager_buckets"].append(bucket)
            failed = True
            continue
        info["compiled_buckets"].append(bucket)
    after = cache_counters()
    delta = {name: after[name] - before[name] for name in after}
    info["cache"] = delta
    if delta["fxgraph_miss"] or delta["aot_miss"]:
        info["outcome"] = "partial" if delta["fxgraph_hit"] or delta["aot_hit"] else "miss"
    elif delta["fxgraph_hit"] or delta["aot_hit"]:
        info["outcome"] = "hit"
    else:  # nothing looked up: dynamo reused code compiled earlier in this process, or nothing compiled
        info["outcome"] = "in_process" if info["compiled_buckets"] else "none"
    if active and (delta["fxgraph_miss"] or delta["aot_miss"]):
        try:
            info["artifacts_saved_bytes"] = save_artifacts(cache)
        except Exception as exc:
            failures.append({"stage": "compile:save", "error": f"{type(exc).__name__}: {exc}"})
    return info
