"""What one row's step asks of a graph call on the general path, typed: the runner's `_row_step` yields these and
`_steps` answers them, gathering the rows that ask for the same call into one batched call.

    Segment(s, x)            -> (out, layer_in, block states or None, the exit's input: a block head's output, else out)
    Segment(s, x, states)    -> the same, with the segment's block states (signals that read them: cosine-min)
    Segment(s, x, ride)      -> the same, or None where no other row needs segment s now (the rider's state waits)
    Decision(layer, ask)     -> (the score where the row exits, else None; its index; its candidates)
    FinalToken(h)            -> the final head's greedy token (the in-graph argmax: only the token leaves the graph)
    FinalLogits(h)           -> the final head's logits [1, V]

`position` places an ask in one pass (segment s -> 2s, the exit after it -> 2s + 1, the final head last, the
greedy asks before the others), so a row only ever asks later in the pass than the call being answered.
What this module does not do: run a call (the runner does, through segment_rows.py, decide.py and the runtime).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eectl.runtime.exit_logits import Decide


@dataclass(frozen=True)
class Segment:
    """Segment `at` on the hidden states `x` of this row's positions."""

    at: int
    x: Any
    states: bool = False  # also its block states (the exit after it reads them)
    ride: bool = False  # an exited token's deferred state, run only where other rows need the segment anyway


@dataclass(frozen=True)
class Decision:
    """The exit test at `layer` for this row's token."""

    layer: int
    ask: Decide


@dataclass(frozen=True)
class FinalToken:
    """The final head's greedy token for the state `hidden` [1, H]."""

    hidden: Any


@dataclass(frozen=True)
class FinalLogits:
    """The final head's logits for the state `hidden` [1, H] (sampling, teacher-forced scoring)."""

    hidden: Any


Ask = Segment | Decision | FinalToken | FinalLogits


def position(ask: Ask, segment_of_layer: dict[int, int], segments: int) -> int:
    """Where `ask` sits in one pass over `segments` segments (see the module's docstring)."""
    if isinstance(ask, Segment):
        return 2 * ask.at
    if isinstance(ask, Decision):
        return 2 * segment_of_layer[ask.layer] + 1
    return 2 * segments + isinstance(ask, FinalLogits)
