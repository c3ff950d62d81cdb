"""What the bound chain's steps (chain_steps.py, chain_rows.py) read of the runner that drives them: `Runner`, a
protocol runner.Runner meets (it imports those modules, so they cannot import it).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from eectl.contracts.manifest import Manifest
from eectl.exits.signals import Signal
from eectl.runtime.chain_parts import Pick
from eectl.runtime.decide import ExitTest
from eectl.runtime.exit_logits import Decide
from eectl.runtime.placement import Placement
from eectl.runtime.policies import KVPolicy
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RowState, RunConfig


class Runner(Protocol):
    """What the chain's steps read of the runner (runner.Runner, which imports the modules that step)."""

    rt: ArtifactRuntime
    m: Manifest
    cfg: RunConfig
    exit_test: ExitTest
    policy: KVPolicy
    signal: Signal
    exits: list[int]
    gates: dict[int, Any]
    L: int
    place: Placement  # the generate call's: the chain's steps record their host reads there
    heads: dict[int, bool]  # rows -> whether a chain over that many rows takes the certified head

    def _resident_wanted(self) -> bool: ...

    def _on_device(self) -> bool: ...

    def _pad(self) -> bool: ...

    def samples(self, st: RowState) -> bool: ...

    def row_pick(self, st: RowState) -> Pick | None: ...

    @staticmethod
    def _forced(st: RowState, logits: np.ndarray) -> int: ...

    def _pick(self, logits: np.ndarray, ids: np.ndarray | None = None, st: RowState | None = None) -> int: ...

    def _decide_rows(self, layer: int, asks: dict[int, Decide]) -> dict[int, tuple[Any, int, Any]]: ...

    def _pick_score(self, score: Any, i: int, st: RowState) -> int: ...
