"""The certified final head at run time (export/certified_head.py): one call per greedy final head, whose tokens
are the full head's argmax wherever a row passes; the caller runs the full head for the rows that do not (a bound
chain over several rows: over those rows alone, chain.py `_missed`; elsewhere over the call).

Bound once: on the bound chain its input is the chain's last hop (the final segment's output); elsewhere
(`ArtifactRuntime.greedy_token`: verify's check of several positions) a buffer per row count
the rows are copied into. Its outputs are two small host arrays. Only the CPU EP loads the graph
(`ArtifactRuntime.certified_head`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from eectl.runtime.placement import Placement


@dataclass
class CertifiedHead:
    """The certified head bound to a chain's hidden buffer [rows, H]: `passed` and `token` per row after `run`."""

    session: Any
    io: Any
    passed: np.ndarray  # [rows] bool
    token: np.ndarray  # [rows] int64
    layer: int
    steps: list[int] = field(default_factory=lambda: [0, 0])  # greedy heads: certified, then the full head's

    @classmethod
    def bind(cls, rt: Any, hidden: Any, rows: int) -> CertifiedHead | None:
        """Bound to `hidden` [rows, H] (the chain's buffer the full head reads, or a runtime's own), or None where
        the runtime (an ArtifactRuntime: this module sits below it) has no certified head."""
        g = rt.certified_head
        if g is None:
            return None
        io = g.session.io_binding()
        rt._bind_array(io, g.name("hidden"), hidden)
        rt.bind_weights(io, g)
        passed, token = np.zeros(rows, bool), np.zeros(rows, np.int64)
        rt._bind_array(io, g.name("passed"), passed, output=True)
        rt._bind_array(io, g.name("token"), token, output=True)
        return cls(g.session, io, passed, token, rt.manifest.num_layers)

    def run(self, place: Placement, rows: Any = slice(None)) -> bool:
        """Run it; whether every row in `rows` (positions in the span) passed, so `token` holds their tokens. What
        it reads is recorded in `place`."""
        self.session.run_with_iobinding(self.io)
        place.read(("head_certified", self.layer, "passed"))
        if not self.passed[rows].all():
            self.steps[1] += 1
            return False
        place.read(("head_certified", self.layer, "token"))
        self.steps[0] += 1
        return True
