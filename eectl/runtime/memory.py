"""The memory a run may still take, and the one check before a KV cache is allocated on the host.

A KV cache is, per layer, keys and values of [rows, kv_heads, positions, head_dim]: for a real model and a long
context that is gigabytes. numpy's zeros only reserve it (the pages are committed as the run writes them), so a cache
that does not fit fails late: numpy's ArrayMemoryError at best, the OOM killer with no message at worst (a 600 MB
memory cgroup). `check_kv` refuses it first, in one line, against what the machine and the process's memory cgroup
leave: MemAvailable from /proc/meminfo, and the cgroup's limit minus its usage plus its page cache (reclaimable; the
mapped weights are page cache too), cgroup v2 (memory.max, memory.current) or v1 (memory.limit_in_bytes, ...).

What this module does not do: device memory (a cache on a GPU is ONNX Runtime's allocation and fails there), or
reserve anything: memory another process takes after the check is not counted.
"""

from __future__ import annotations

import math
from pathlib import Path

from eectl.contracts.manifest import Manifest
from eectl.errors import UsageError

MEMINFO = Path("/proc/meminfo")
PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a huge number (v2 writes "max")
# (limit file, usage file, memory.stat keys of its page cache) for cgroup v2, then v1
_CGROUP_FILES = (
    ("memory.max", "memory.current", ("active_file", "inactive_file")),
    ("memory.limit_in_bytes", "memory.usage_in_bytes", ("total_active_file", "total_inactive_file")),
)


def available_bytes() -> tuple[int, str] | None:
    """(bytes this process may still take, where that figure comes from), the smaller of MemAvailable and the
    memory cgroup's room; None when neither can be read (no /proc: the check is skipped)."""
    found = [x for x in (_meminfo(), _cgroup()) if x is not None]
    return min(found) if found else None


def _meminfo() -> tuple[int, str] | None:
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_folders() -> list[Path]:
    """The process's memory cgroup folders to try: its own path (v2 `0::/path`, v1 `N:memory:/path`), then the
    mount's root (a container sees its own cgroup there)."""
    folders: list[Path] = []
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        rel = path.strip().lstrip("/")
        if controllers == "":
            folders.append(CGROUP_ROOT / rel)
        elif "memory" in controllers.split(","):
            folders.append(CGROUP_ROOT / "memory" / rel)
    return [*folders, CGROUP_ROOT, CGROUP_ROOT / "memory"]


def _cgroup() -> tuple[int, str] | None:
    for folder in _cgroup_folders():
        for limit_file, usage_file, cache_keys in _CGROUP_FILES:
            limit, usage = _read_int(folder / limit_file), _read_int(folder / usage_file)
            if usage is None or not (folder / limit_file).is_file():
                continue
            if limit is None or limit >= _UNLIMITED:
                return None  # "max": the cgroup sets no limit
            stat = _stat(folder / "memory.stat")
            cache = sum(stat.get(k, 0) for k in cache_keys)
            return max(0, limit - usage + cache), f"the memory cgroup's {limit_file} ({_size(limit)})"
    return None


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _stat(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if value.strip().isdigit():
                out[key] = int(value)
    except OSError:
        pass
    return out


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def kv_bytes(m: Manifest, rows: int, positions: int, itemsize: int) -> int:
    """Keys and values of every KV slot (decoder layers, block exit heads) for `rows` x `positions`."""
    return 2 * m.kv_slots * rows * m.kv.num_kv_heads * positions * m.kv.head_dim * itemsize


def mapped_weight_bytes(m: Manifest, itemsize: int) -> int:
    """The shared weight tables the runtime maps from the artifact (a file named twice, a tied table, once)."""
    shapes = {w.file: w.shape for w in m.shared_weights.values()}
    return sum(math.prod(shape) * itemsize for shape in shapes.values())


def check_kv(m: Manifest, rows: int, max_len: int, capacity: int, itemsize: int, host: bool) -> None:
    """The one check before a KV cache of `rows` x `capacity` positions is allocated for a run of at most `max_len`
    positions: within the model's context (the caller sizes it to what the run can reach), and, on the host, the
    cache plus the mapped weights within the memory available now. UsageError (one line) otherwise, before anything
    is allocated."""
    if max_len > m.max_positions:
        raise UsageError(f"context of {max_len} tokens exceeds the model's maximum of {m.max_positions}")
    if not host:
        return
    available = available_bytes()
    if available is None:
        return
    room, source = available
    kv, weights = kv_bytes(m, rows, capacity, itemsize), mapped_weight_bytes(m, itemsize)
    if kv + weights > room:
        raise UsageError(
            f"the KV cache of {rows} row(s) x {capacity} positions needs {_size(kv)} and the mapped weights "
            f"{_size(weights)}, but only {_size(room)} of memory is available ({source})",
            hint="lower --max-new-tokens, the prompt's length or --batch-size, or free memory",
        )
