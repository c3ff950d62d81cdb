"""One segment for the rows of a general-path step that reach it (runtime/runner.py `Runner._steps`): one batched
call for the rows with one position (runtime/batch.py), a padded call for prompts of several lengths, single-row
calls for the rest, then the block exit head after it where the active exit there has one (runtime/blocks.py).

What this module does not do: decide exits or call the KV policy's hooks (runner.py), or bind graphs itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from eectl.runtime.batch import BatchKV, join_rows, prefill_runs, run_prefill, run_rows
from eectl.runtime.blocks import run_block, run_block_rows
from eectl.runtime.kv import KVBuffers
from eectl.runtime.placement import Placement
from eectl.runtime.sessions import ArtifactRuntime


def segment_rows(
    rt: ArtifactRuntime,
    s: int,
    xs: dict[int, np.ndarray],
    kv: KVBuffers,
    states: set[int] | frozenset[int],
    place: Placement,
    pad: bool,
    block: int | None,
) -> dict[int, Any]:
    """Segment s for the rows in xs (hidden [1, S, H] each): one batched call for the rows with one position
    (when the buffers are a batch's), single-row calls on their views for the others (GQA takes several new
    positions on a past for one row at a time). Per row: (hidden out, last layer input, the segment's block
    boundaries [n + 1, S, H] for rows in `states` else None, the exit's input): the exit's input is the block
    head's output where the active exit after s has one (run on the same positions), else hidden out."""
    ones = [r for r, x in xs.items() if x.shape[1] == 1]
    answers: dict[int, Any] = {}
    # device-resident states (place.device) come back for the call's span of rows only: row r at r - first
    first = min(ones) if place.device and ones else 0
    if isinstance(kv, BatchKV) and len(ones) > 1:
        hidden, active = join_rows(rt, {r: xs[r] for r in ones}, kv.rows)
        result = run_rows(rt, s, hidden, kv, active, states=bool(states & set(ones)), place=place)
        assert result is not None
        for r in ones:
            i = r - first
            answers[r] = tuple(
                part[i : i + 1] if k < 2 else part[i].reshape(part.shape[1], 1, part.shape[2])
                for k, part in enumerate(result)
            )
            if r not in states:
                answers[r] = answers[r][:2]
    if isinstance(kv, BatchKV) and pad and not place.device:  # the padded call takes host prompts
        lo, hi = rt.manifest.segments[s].layers
        several = [r for r, x in xs.items() if x.shape[1] > 1 and r not in states]
        for run in prefill_runs(kv, several, lo, hi):
            if len(run) > 1:
                answers.update(run_prefill(rt, s, {r: xs[r] for r in run}, kv))
    for r, x in xs.items():
        if r not in answers:
            answers[r] = rt.run_segment(s, x, kv, r, states=r in states, place=place)
    exit_in: dict[int, np.ndarray] = {}
    if block is not None and isinstance(kv, BatchKV) and len(ones) > 1:  # the block batched as its segment was
        hidden, active = join_rows(rt, {r: answers[r][0] for r in ones}, kv.rows)
        out = run_block_rows(rt, block, hidden, kv, active, place=place)
        exit_in = {r: out[r - first : r - first + 1] for r in ones}
    for r, a in answers.items():
        if r not in exit_in:
            own = a[0] if block is None else run_block(rt, block, a[0], kv, r, place=place)
            assert own is not None
            exit_in[r] = own
        answers[r] = (a[0], a[1], a[2] if len(a) > 2 else None, exit_in[r])
    return answers
