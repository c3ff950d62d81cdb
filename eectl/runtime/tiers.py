"""Where segment weights live: mapped from their files, a memory budget whose slow tier is read from the file again
each time a token reaches it, and segments placed on providers of their own.

ONNX Runtime's CPU EP memory-maps an external initializer whose offset is 64 KiB-aligned (export/graphs.py aligns
every tensor >= 1 MiB), but prepacking copies a MatMul's weight into a packed heap buffer at load and unmaps the
file: a session keeps its weights as file pages only with prepacking off (`session.disable_prepacking`). Measured
(docs/results/2026-12-02-offload.md): packed, a 16 MiB graph's weights are 16 MiB of anonymous memory and no
mapping; unpacked, four private read-only mappings of the .data file, paged in on the first call. Tensors below
1 MiB (int4 scales, norms) are packed tightly, not aligned: ORT reads them into the heap.

A memory budget keeps at most SIZE of segment weights resident:

    segments   0 ........ i | i+1 ............ n-1
    tier       fast (packed, or mapped)      | slow (mapped: read from the file by each call, released after it)

The fast tier is the longest prefix of segments whose weights fit SIZE; its sessions are today's (packed: measured
faster than mapped), unless --mmap-weights maps them too. The slow tier's sessions are mapped (prepacking off) and
wrapped (`TierSession`): before a call, madvise(MADV_WILLNEED) starts the read of its mapped ranges; after it,
madvise(MADV_DONTNEED) drops them from this process and posix_fadvise(POSIX_FADV_DONTNEED) from the page cache, so
the next call reads them from the file again, and a token that exits before a slow segment reads none of it. While a
slow segment runs its pages are resident too: the peak is the budget plus the largest slow segment. Every call (the
bound chain's, one row or a batch, prompts and checks alike) goes through the wrapped session, so all pay the same
traffic. Bytes read are counted per call from /proc/self/io (read_bytes) and from mincore (pages resident just before
the release).

What this module does not do: choose exits, know policies, or allocate KV buffers (KV stays on the runtime's device,
so a placement may not leave it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eectl.errors import ArtifactError, UsageError
from eectl.files import confined
from eectl.runtime.ort import PROVIDERS, resolve_provider, session_options

if TYPE_CHECKING:
    from eectl.runtime.sessions import ArtifactRuntime

MADV_WILLNEED = 3
MADV_DONTNEED = 4
PAGE = mmap.PAGESIZE
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(%|[KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+))?\s*:\s*([A-Za-z0-9_]+)\s*$")


# --- options ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightOptions:
    """run/bench's weight options: `mmap` maps every segment (prepacking off), `budget` ("200M", "50%") keeps at most
    that much resident (implies mapping), `place` ("0-3:cuda,4-5:cpu") puts segment ranges on providers."""

    mmap: bool = False
    budget: str | None = None
    place: str | None = None

    @property
    def active(self) -> bool:
        return self.mmap or self.budget is not None or self.place is not None

    def check(self) -> None:
        """The checks that need no artifact (run before it loads)."""
        if self.budget is not None:
            parse_size(self.budget, None)
        if self.place is not None:
            parse_place(self.place, None)


def parse_size(text: str, total: int | None) -> int:
    """'200M', '1.5G', '300MB', '123456' (bytes; K/M/G/T are powers of 1024) or '50%' of `total` -> bytes.
    With total None only the form is checked (a percentage returns 0)."""
    m = _SIZE.match(text)
    if m is None:
        raise UsageError(f"--memory-budget: cannot read the size '{text}' (e.g. 200M, 1.5G, 50%)")
    value, unit = float(m.group(1)), m.group(2).upper()
    if unit == "%":
        if not 0 < value <= 100:
            raise UsageError(f"--memory-budget: a percentage must be in (0, 100], got '{text}'")
        return 0 if total is None else int(total * value / 100)
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise UsageError(f"--memory-budget must be positive, got '{text}'")
    return size


def parse_place(text: str, segments: int | None) -> dict[int, str]:
    """'0-3:cuda,4-5:cpu' -> {segment: provider}; segments a range does not name stay on the runtime's provider. With
    `segments` None only the form and the provider names are checked."""
    out: dict[int, str] = {}
    for part in text.split(","):
        m = _RANGE.match(part)
        if m is None:
            raise UsageError(
                f"--place: cannot read '{part.strip()}' (e.g. 0-3:cuda,4-5:cpu: segment ranges : provider)"
            )
        lo, hi, provider = int(m.group(1)), int(m.group(2) or m.group(1)), m.group(3).lower()
        if provider not in PROVIDERS:
            raise UsageError(f"--place: unknown provider '{provider}' (one of {', '.join(PROVIDERS)})")
        if hi < lo:
            raise UsageError(f"--place: the range {lo}-{hi} is empty")
        if segments is not None and hi >= segments:
            raise UsageError(f"--place: the range {lo}-{hi} leaves the artifact's segments 0-{segments - 1}")
        for s in range(lo, hi + 1):
            if s in out:
                raise UsageError(f"--place: segment {s} is placed twice")
            out[s] = provider
    return out


# --- the kernel calls ------------------------------------------------------------------------------------------------
_libc: Any = None


def _c() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    return _libc


def file_mappings(path: Path) -> list[tuple[int, int, int]]:
    """This process's mappings of file `path` as (start, end, file offset), from /proc/self/maps (matched by device
    and inode, so a link or a renamed folder still matches)."""
    st = os.stat(path)
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 5 or parts[4] != str(st.st_ino):
                continue
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            if os.makedev(major, minor) == st.st_dev:
                start, end = (int(x, 16) for x in parts[0].split("-"))
                out.append((start, end, int(parts[2], 16)))
    return out


def external_tensors(path: Path) -> list[tuple[int, int]]:
    """(offset, length) in the .data file of each external initializer of the graph at `path` (read without its
    data: the graph protos are small)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    out = []
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            out.append((int(info.get("offset", 0)), int(info["length"])))
    return out


def resident_bytes(ranges: Sequence[tuple[int, int]]) -> int:
    """Bytes of these mapped ranges whose pages are in memory (mincore: the page cache's view, whether or not this
    process's page tables still hold them)."""
    libc, total = _c(), 0
    for start, end in ranges:
        n = (end - start + PAGE - 1) // PAGE
        vec = (ctypes.c_ubyte * n)()
        if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        total += (n - bytes(vec).count(0)) * PAGE  # bit 0 is the only one mincore sets
    return total


def _madvise(ranges: Sequence[tuple[int, int]], advice: int) -> None:
    libc = _c()
    for start, end in ranges:
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice) != 0:
            raise OSError(ctypes.get_errno(), "madvise failed")


def io_read_bytes() -> int:
    """Bytes this process has caused to be read from storage (/proc/self/io read_bytes; 0 where it is not kept)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def memory_status() -> dict[str, int]:
    """This process's resident memory (bytes): VmRSS, RssAnon (heap: packed weights, KV), RssFile (mapped files)."""
    keys = {"VmRSS": "rss", "RssAnon": "rss_anon", "RssFile": "rss_file", "VmHWM": "rss_peak"}
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in keys:
                out[keys[key]] = int(line.split()[1]) * 1024
    return out


# --- mapped weights --------------------------------------------------------------------------------------------------
@dataclass
class MappedFile:
    """One graph's .data file: its size when mapped (checked before each call: touching a page past a shrunk file's
    end would kill the process with SIGBUS), and the ranges ORT mapped."""

    path: Path
    size: int
    ranges: list[tuple[int, int]]  # [start, end) addresses
    tensor_bytes: int  # the external initializers' bytes
    unmapped: int  # of those, the bytes in no mapping (ORT read them into the heap)
    fd: int = -1

    @property
    def mapped(self) -> int:
        return sum(end - start for start, end in self.ranges)

    def check(self) -> None:
        now = os.fstat(self.fd).st_size
        if now < self.size:
            raise ArtifactError(
                f"the weights file {self.path.name} shrank under its mapping ({self.size} -> {now} bytes)",
                hint="the artifact was changed while it ran: export it again",
            )

    def release(self) -> None:
        _madvise(self.ranges, MADV_DONTNEED)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)


@dataclass
class SegmentWeights:
    index: int
    provider: str
    data_bytes: int  # the segment graph's weights (its external initializers)
    files: list[MappedFile] = field(default_factory=list)  # [graph, kv graph, river], those with data, where mapped
    slow: bool = False

    @property
    def mapped(self) -> int:
        """The segment graph's mapped bytes (whole pages): what a call of a slow segment reads from the file."""
        return self.files[0].mapped if self.files else 0

    @property
    def unmapped(self) -> int:
        """The segment graph's weights ORT read into the heap instead (tensors whose offsets are not aligned)."""
        return self.files[0].unmapped if self.files else self.data_bytes


@dataclass
class TierCounters:
    calls: dict[int, int] = field(default_factory=dict)  # slow segment -> calls of its sessions
    read_bytes: int = 0  # /proc/self/io read_bytes during slow calls
    paged_bytes: int = 0  # mincore: slow-tier bytes resident just before each release


class TierSession:
    """A segment's ORT session with the tier's work around each call: the files' sizes checked (every mapped
    session), and for the slow tier the read started before and the pages released after."""

    def __init__(self, session: Any, file: MappedFile, tiers: WeightTiers, segment: int, slow: bool) -> None:
        self._session = session
        self._file = file
        self._tiers = tiers
        self._segment = segment
        self._slow = slow

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    def _around(self, call: Any) -> Any:
        f = self._file
        f.check()
        if not self._slow:
            return call()
        c = self._tiers.counters
        before = io_read_bytes()
        _madvise(f.ranges, MADV_WILLNEED)  # the read starts here (counted from here)
        out = call()
        c.read_bytes += io_read_bytes() - before
        c.paged_bytes += resident_bytes(f.ranges)
        c.calls[self._segment] = c.calls.get(self._segment, 0) + 1
        f.release()
        return out

    def run_with_iobinding(self, *args: Any, **kwargs: Any) -> Any:
        return self._around(lambda: self._session.run_with_iobinding(*args, **kwargs))

    def run(self, *args: Any, **kwargs: Any) -> Any:
        return self._around(lambda: self._session.run(*args, **kwargs))


class WeightTiers:
    """The segments' weights of one runtime: mapped or not, fast or slow, on which provider; the counters."""

    def __init__(self, rt: ArtifactRuntime, opts: WeightOptions) -> None:
        self.rt = rt
        self.opts = opts
        n = len(rt.manifest.segments)
        self.place = parse_place(opts.place, n) if opts.place else {}
        for provider in set(self.place.values()):
            resolve_provider(provider, rt.manifest.dtype)  # usable here, or one line
            if PROVIDERS[provider].device != rt.device:
                raise UsageError(
                    f"--place: segments on {provider} would need their KV on {PROVIDERS[provider].device}, but this "
                    f"runtime keeps every layer's KV on {rt.device}",
                    hint=f"place segments only on providers of the {rt.device} device, or use --provider {provider}",
                )
        self.mapped = opts.mmap  # every segment mapped; under a budget the slow tier always is
        self.segments = [SegmentWeights(i, self.place.get(i, rt.provider), self._data_bytes(i)) for i in range(n)]
        self.total = sum(s.data_bytes for s in self.segments)
        self.budget = parse_size(opts.budget, self.total) if opts.budget is not None else None
        self.counters = TierCounters()
        self._fds: list[int] = []
        self._split()  # before any session: a budget too small fails before the artifact's weights load
        for s in self.segments:
            self._load(s)
            if s.slow:
                for f in s.files:
                    # dirty pages (an artifact just exported) cannot leave the page cache until written back
                    os.fsync(f.fd)
                    f.release()  # what loading touched

    def _data_bytes(self, index: int) -> int:
        io = self.rt.manifest.segments[index].graph
        return sum(n for _, n in external_tensors(confined(self.rt.folder, io.file, ArtifactError))) if io.data else 0

    def _load(self, seg: SegmentWeights) -> None:
        """Create segment `seg`'s sessions (graph, K/V-only graph, river copy) on its provider, mapped if asked."""
        rt = self.rt
        so = rt.segment_options(session_options(rt.threads))
        mapped = self.mapped or seg.slow
        if mapped:
            so.add_session_config_entry("session.disable_prepacking", "1")
        providers = PROVIDERS[seg.provider].ort_providers
        for g in rt._segment_graphs(seg.index):
            if g.session is not None:
                continue
            path = confined(rt.folder, g.io.data, ArtifactError) if g.io.data else None
            before = set(file_mappings(path)) if path is not None else set()
            session = rt._session(g.io, so, providers)
            if path is None or not mapped:
                g.session = session
                continue
            file = self._mapped_file(path, before, confined(rt.folder, g.io.file, ArtifactError))
            seg.files.append(file)
            g.session = TierSession(session, file, self, seg.index, slow=seg.slow)

    def _mapped_file(self, path: Path, before: set[tuple[int, int, int]], graph: Path) -> MappedFile:
        """The mappings the new session made of its .data file, and which of its tensors they hold."""
        fd = os.open(path, os.O_RDONLY)
        self._fds.append(fd)
        maps = sorted(set(file_mappings(path)) - before)
        spans = [(off, off + end - start) for start, end, off in maps]  # file ranges mapped
        tensors = external_tensors(graph)
        unmapped = sum(n for o, n in tensors if not any(a <= o and o + n <= b for a, b in spans))
        ranges = [(start, end) for start, end, _ in maps]
        return MappedFile(path, os.fstat(fd).st_size, ranges, sum(n for _, n in tensors), unmapped, fd)

    def _split(self) -> None:
        """The fast tier: the longest prefix of segments whose weights fit the budget (kept as today: packed, unless
        --mmap-weights maps them too); the rest is slow, mapped, its sessions releasing their pages after each call."""
        if self.budget is None:
            return
        used, fast = 0, 0
        for s in self.segments:
            if used + s.data_bytes > self.budget:
                break
            used += s.data_bytes
            fast += 1
        if fast == 0:
            raise UsageError(
                f"--memory-budget {self.opts.budget} ({_mb(self.budget)}) is smaller than one segment: segment 0's "
                f"weights are {_mb(self.segments[0].data_bytes)}",
                hint=f"the segments' weights are {_mb(self.total)} in all",
            )
        for s in self.segments[fast:]:
            s.slow = True

    # --- reports -------------------------------------------------------------------------------------------------
    @property
    def slow(self) -> list[SegmentWeights]:
        return [s for s in self.segments if s.slow]

    def reset(self) -> None:
        self.counters = TierCounters()

    def reach_bytes(self, layer: int) -> int:
        """Slow-tier bytes a token that exits after `layer` read: the slow segments it ran (lo < layer)."""
        m = self.rt.manifest
        return sum(s.mapped for s in self.slow if m.segments[s.index].layers[0] < layer)

    def predicted_bytes(self, exit_layers: Sequence[int], latencies: Sequence[float] | None = None) -> int:
        """Slow-tier bytes the exit histogram implies: per emitted token that had a pass of its own, the slow segments
        that pass reached (the first token's prefill reaches every one). A token with no latency of its own (a draft
        from the context, checked in the pass of the token after it) reads nothing; positions a policy carries deeper
        later (defer, verify) ride in those passes; rejected drafts' passes are not in the histogram."""
        own = [True] * len(exit_layers) if latencies is None else [t > 0 for t in latencies]
        return sum(self.reach_bytes(layer) for layer, mine in zip(exit_layers, own, strict=True) if mine)

    def resident(self) -> dict[str, int]:
        """Resident memory now: the process's, and the mapped segment weights' (mincore)."""
        files = [f for s in self.segments for f in s.files]
        return {
            **memory_status(),
            "mapped_weight_bytes": sum(f.mapped for f in files),
            "mapped_weight_resident_bytes": resident_bytes([r for f in files for r in f.ranges]),
        }

    def report(self, exit_layers: Sequence[int], latencies: Sequence[float] | None = None) -> dict[str, Any]:
        """The memory section of `run --json` for the tokens whose exit layers (and latencies) are given."""
        tokens = max(len(exit_layers), 1)
        c = self.counters
        predicted = self.predicted_bytes(exit_layers, latencies)
        measured = c.read_bytes or c.paged_bytes  # a file system that does not count reads: mincore's
        return {
            "mapped": self.mapped,  # every segment (--mmap-weights); the slow tier always is
            "budget_bytes": self.budget,
            "weight_bytes": self.total,
            "unmapped_weight_bytes": sum(s.unmapped for s in self.segments),
            "fast_segments": [s.index for s in self.segments if not s.slow],
            "slow_segments": [s.index for s in self.slow],
            "slow_weight_bytes": sum(s.mapped for s in self.slow),
            "placement": {str(s.index): s.provider for s in self.segments},
            "tokens": len(exit_layers),
            "slow_calls": {str(k): v for k, v in sorted(c.calls.items())},
            "slow_read_bytes": c.read_bytes,
            "slow_paged_bytes": c.paged_bytes,
            "slow_bytes_per_token_measured": measured / tokens,
            "slow_bytes_per_token_predicted": predicted / tokens,
            "measured_over_predicted": measured / predicted if predicted else None,
            **self.resident(),
        }

    def describe(self) -> str:
        if self.budget is None:
            return f"segment weights mapped ({_mb(self.total)}, prepacking off)" if self.mapped else "placed"
        slow = self.slow
        heap = sum(s.unmapped for s in slow)
        return (
            f"memory budget {_mb(self.budget)} of {_mb(self.total)} segment weights: segments "
            f"{[s.index for s in self.segments if not s.slow]} resident ({'mapped' if self.mapped else 'packed'}), "
            f"{[s.index for s in slow]} read from the file per token that reaches them "
            f"({_mb(sum(s.mapped for s in slow))})"
            + (f"; {_mb(heap)} of the slow tier is not aligned for mapping and stays in memory" if heap else "")
        )

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def load_tiers(rt: ArtifactRuntime, opts: WeightOptions) -> WeightTiers:
    """Create the segments' sessions of `rt` (loaded with lazy_segments) as `opts` asks; kept on rt.tiers."""
    tiers = WeightTiers(rt, opts)
    rt.tiers = tiers
    return tiers
