"""A stage's time split into named phases, each with the budget size it scales with (or FIXED).

Stage functions fill one (`Phases.time` around a phase, `Phases.add` for a time measured already) and hang it on
their result; the pipeline's verdict (pipeline/verdict.py) scales each sized phase to the next budget's size and
keeps the rest of the stage's time as it is. The size names are contracts/budgets.py's SIZES.

What this module does not do: know a budget's sizes, or print.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

FIXED = "fixed"  # a phase that takes the same time in every budget (loading a model, creating sessions, warm-ups)


@dataclass
class Phase:
    seconds: float
    size: str  # contracts/budgets.py SIZES name, or FIXED


@dataclass
class Phases:
    phases: dict[str, Phase] = field(default_factory=dict)
    reused: str = ""  # why the phases miss work a fresh run does (e.g. a state cache that was there); "" if none

    @contextmanager
    def time(self, name: str, size: str = FIXED) -> Iterator[None]:
        """Add the block's wall time to phase `name`."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0, size)

    def add(self, name: str, seconds: float, size: str = FIXED) -> None:
        """`seconds` more of phase `name` (a phase keeps the size it was first added with)."""
        phase = self.phases.setdefault(name, Phase(0.0, size))
        phase.seconds += seconds

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases.values())

    def describe(self) -> str:
        """One line: each phase's seconds and its size."""
        return ", ".join(f"{name} {p.seconds:.1f} s ({p.size})" for name, p in self.phases.items())
