"""bench's memory section (#32): per configuration, under the run's weight setting (runtime/tiers.py), the slow
tier's weight bytes read per token, measured (/proc/self/io, mincore) and predicted from the exit histogram, their
agreement, and the resident memory after the run.

What this module does not do: time anything (bench.py's interleaved design does) or choose the tiers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import Generation

AGREEMENT = 0.15  # measured and predicted bytes per token agree within this share (the target)


@dataclass
class _Tally:
    tokens: int = 0
    read_bytes: int = 0
    paged_bytes: int = 0
    predicted: int = 0


@dataclass
class MemoryMeter:
    """Counts a runtime's slow-tier traffic per configuration across the interleaved repetitions."""

    rt: ArtifactRuntime
    tallies: dict[str, _Tally] = field(default_factory=dict)

    def start(self, rt: ArtifactRuntime | None = None) -> None:
        """Before a pass on `rt` (default: the meter's; bench --compare's second runtime of the artifact has tiers of
        its own, under the same setting)."""
        tiers = (rt or self.rt).tiers
        if tiers is not None:
            tiers.reset()

    def stop(self, name: str, gens: list[Generation], rt: ArtifactRuntime | None = None) -> None:
        tiers = (rt or self.rt).tiers
        if tiers is None:
            return
        t = self.tallies.setdefault(name, _Tally())
        c = tiers.counters
        t.read_bytes += c.read_bytes
        t.paged_bytes += c.paged_bytes
        for g in gens:
            t.tokens += len(g.token_ids)
            t.predicted += tiers.predicted_bytes(g.exit_layers, g.latencies_s)
        tiers.reset()

    def section(self) -> dict[str, Any] | None:
        """The JSON section: the tiers, and one row per configuration (MB per token; measured / predicted)."""
        tiers = self.rt.tiers
        if tiers is None:
            return None
        rows = {}
        for name, t in self.tallies.items():
            n = max(t.tokens, 1)
            measured = t.read_bytes or t.paged_bytes  # a file system that does not count reads: mincore's
            ratio = measured / t.predicted if t.predicted else None
            rows[name] = {
                "tokens": t.tokens,
                "slow_mb_per_token_measured": measured / n / 1e6,
                "slow_mb_per_token_mincore": t.paged_bytes / n / 1e6,
                "slow_mb_per_token_predicted": t.predicted / n / 1e6,
                "measured_over_predicted": ratio,
                "agree": None if ratio is None else abs(ratio - 1) <= AGREEMENT,
            }
        report = tiers.report([])
        keep = ("mapped", "budget_bytes", "weight_bytes", "fast_segments", "slow_segments", "slow_weight_bytes")
        return {
            "tiers": tiers.describe(),
            **{k: report[k] for k in keep},
            "resident": tiers.resident(),
            "configs": rows,
        }

    def lines(self) -> list[str]:
        """The section as console lines (bench's log)."""
        doc = self.section()
        if doc is None:
            return []
        res = doc["resident"]
        out = [
            f"{doc['tiers']}; resident {res['rss'] / 1e6:.0f} MB, mapped weights resident "
            f"{res['mapped_weight_resident_bytes'] / 1e6:.0f} MB"
        ]
        for name, r in doc["configs"].items():
            ratio = r["measured_over_predicted"]
            out.append(
                f"  {name}: slow tier {r['slow_mb_per_token_measured']:.1f} MB/token read, predicted "
                f"{r['slow_mb_per_token_predicted']:.1f}" + (f" ({ratio:.2f}x)" if ratio is not None else "")
            )
        return out
