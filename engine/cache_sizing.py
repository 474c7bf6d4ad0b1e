"""How many blocks L1 (device) and L2 (pinned host memory) get, and whether they fit.

Operators size caches in bytes ("give the prefix cache 20 GiB of the H200"), not in blocks whose size
depends on the model, so `prefix_cache_memory` / `l2_cache_memory` take a memory size and override the
block counts. Either way the pools are checked against what is free before they are allocated: an L1
larger than the device's free memory would fail `initialize` with a bare CUDA out-of-memory error, and
pinned host memory beyond what the host (or the container's cgroup) has left gets the stub OOM-killed
or the host swapping, both far from the parameter that caused them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_SIZE = re.compile(r"^\s*(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
GIB = 2**30

DEVICE_RESERVE_SHARE = 0.1  # of the device memory free before L1: activations, CUDA graphs, fragmentation
DEVICE_RESERVE_MIN = GIB // 2
HOST_SHARE = 0.8  # of the host memory available: the rest is the process's own and its neighbours'


def parse_memory(key: str, value: str) -> int:
    """Bytes in a size such as `8GiB`, `512MiB`, `24Gi`, `2GB`, `1.5G` or `1048576` (0 or empty: not set).
    KiB/MiB/GiB/TiB (and Kubernetes' Ki/Mi/Gi/Ti) are powers of 1024, KB/MB/GB/TB (and K/M/G/T) of 1000."""
    if not value.strip():
        return 0
    match = _SIZE.match(value)
    if match is None:
        raise ValueError(
            f"parameter {key}={value!r} is not a memory size; use e.g. 8GiB, 512MiB, 2GB or a byte count"
        )
    unit = (match["unit"] or "").lower()
    scale = 1024 ** ("kmgt".index(unit[0]) + 1) if "i" in unit else _UNITS[unit[:1]]
    size = float(match["number"]) * scale
    if not size < 2**63:  # 400 nines read as a float are infinity, which int() refuses
        raise ValueError(f"parameter {key}={value!r} is too large a memory size")
    return int(size)


def human(size: int) -> str:
    return f"{size / GIB:.2f} GiB" if size >= GIB else f"{size / 2**20:.1f} MiB"


@dataclass(frozen=True)
class TierSizes:
    l1_blocks: int
    l2_blocks: int
    block_bytes: int

    @property
    def l2_host_bytes(self) -> int:
        """Exact: a pinned L2 is registered in place (engine.pinned_memory), never rounded up."""
        return self.l2_blocks * self.block_bytes

    def describe(self) -> str:
        return (
            f"L1 {self.l1_blocks} blocks ({human(self.l1_blocks * self.block_bytes)}), "
            f"L2 {self.l2_blocks} blocks ({human(self.l2_host_bytes)}), {human(self.block_bytes)} a block"
        )


@dataclass(frozen=True)
class CacheRequest:
    """The configured sizes: a memory size (bytes, 0: not set) wins over a block count."""

    l1_blocks: int
    l2_blocks: int
    l1_memory: int = 0
    l2_memory: int = 0

    def blocks(self, block_bytes: int) -> tuple[int, int]:
        l1 = self.l1_memory // block_bytes if self.l1_memory else self.l1_blocks
        l2 = self.l2_memory // block_bytes if self.l2_memory else self.l2_blocks
        return max(0, l1), max(0, l2)


def plan_tiers(
    request: CacheRequest,
    block_bytes: int,
    on_device: bool,
    device_free: int | None,
    host_available: int | None,
) -> TierSizes:
    """The block counts of both tiers, or ValueError naming the parameter that does not fit and what is
    free. `on_device`: L1 lives in device memory (else in host memory, beside L2). None: not known,
    not checked."""
    l1, l2 = request.blocks(block_bytes)
    for name, memory, blocks in (("prefix_cache_memory", request.l1_memory, l1),
                                 ("l2_cache_memory", request.l2_memory, l2)):  # fmt: skip
        if memory and blocks == 0:
            raise ValueError(
                f"{name}={human(memory)} holds no block of {human(block_bytes)}; raise it, or unset it "
                f"and set {name.replace('_memory', '_blocks')}=0 "
                "to turn that tier off"
            )
    if l1 == 0:  # no prefix cache: L2, which holds what L1 evicts, is never allocated either
        l2 = 0
    sizes = TierSizes(l1, l2, block_bytes)
    l1_bytes = l1 * block_bytes
    if l1 and on_device and device_free is not None:
        reserve = max(DEVICE_RESERVE_MIN, int(DEVICE_RESERVE_SHARE * device_free))
        if l1_bytes > device_free - reserve:
            raise ValueError(
                f"the prefix cache's L1 ({l1} blocks, {human(l1_bytes)}) does not fit: {human(device_free)} "
                f"of device memory is free after the weights and KV slots, and {human(reserve)} of it is "
                "kept for activations and CUDA graphs; lower prefix_cache_memory (LLM_PREFIX_CACHE_MEMORY) "
                "or prefix_cache_blocks"
            )
    host_bytes = sizes.l2_host_bytes + (0 if on_device else l1_bytes)
    if host_available is not None and host_bytes > HOST_SHARE * host_available:
        what = "L2" if on_device else "L1 and L2"
        raise ValueError(
            f"the prefix cache's {what} ({human(host_bytes)} of host memory) does not fit: "
            f"{human(host_available)} is available to this process (the host's or its cgroup's limit, "
            f"whichever is lower) and at most {HOST_SHARE:.0%} of it is given to caches"
            + "; lower l2_cache_memory (LLM_L2_CACHE_MEMORY) or l2_cache_blocks"
            + ("" if on_device else ", or prefix_cache_memory / prefix_cache_blocks")
        )
    return sizes


def host_available_bytes(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Memory this process can still take: the host's MemAvailable, capped by the cgroup's limit less its
    working set (a container's limit is invisible in /proc/meminfo). None when neither can be read."""
    candidates = []
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                candidates.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file, stat_file, inactive in (
        ("memory.max", "memory.current", "memory.stat", "inactive_file"),  # cgroup v2
        (  # cgroup v1
            "memory/memory.limit_in_bytes",
            "memory/memory.usage_in_bytes",
            "memory/memory.stat",
            "total_inactive_file",
        ),
    ):
        try:
            limit = (cgroup / limit_file).read_text().strip()
            usage = int((cgroup / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit():  # v2 says "max" when unlimited (v1 a huge number, which min() ignores)
            working_set = usage - min(usage, _stat(cgroup / stat_file, inactive))
            candidates.append(max(0, int(limit) - working_set))
        break
    return min(candidates) if candidates else None


def _stat(path: Path, name: str) -> int:
    """One counter of a cgroup's memory.stat, 0 when unreadable. The usage counts the page cache, and its
    inactive file pages (the weights just read from disk, say) are reclaimed before the limit is hit: the
    working set, as the kubelet evicts by, leaves them out."""
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0
