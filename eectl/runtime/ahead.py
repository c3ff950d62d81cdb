"""Drafts that run ahead: verify's drafter at one shallow exit, drafting while its own running confidence holds.

Plain verify drafts a token only where an exit's calibrated test passes, so a run of drafts ends at the first token
the exit would not emit on its own. With `RunConfig.draft_ahead` (a bound b in (0, 1]) the first active exit drafts
instead by the product of its top-1 probabilities over the run: a token's pass reaching that exit takes the exit's
top-1 (over the K candidates of the artifact's candidate source, the `topk-prob` signal) with probability p, and
exits as a draft while P * p >= b, P the product over the drafts the run already made (1 at a run's start); the
first token below the bound goes on to the final layer and checks the run in one wide pass (policies.py
`Verify.on_final`: the accepted prefix kept, the rest rolled back). The draft length so follows the drafter's own
confidence: long where its tokens are sure, one or none where they are not. Each draft token is fed back through the
segments up to the exit only (its deferred state waits there); output equals full depth's whatever was drafted.

The exit's gate and calibrated thresholds are not asked: the bound is the plan's (plan/ahead.py), priced from the
exit's measured acceptance by position and this machine's costs. `traces` measures what that pricing replays: per
position of a (prompt, full-depth answer) pair, the exit's top-1 probability and whether its token is the answer's,
read with the run's own graphs (the states after one prompt call through the segments up to the exit).

What this module does not do: check drafts (policies.py) or price them (plan/ahead.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from eectl.errors import UsageError

if TYPE_CHECKING:
    from eectl.runtime.sessions import ArtifactRuntime
    from eectl.runtime.state import RowState, RunConfig


def top1(logits: np.ndarray) -> tuple[int, float]:
    """(column of the largest, its softmax probability) of candidate logits [K]."""
    z = np.asarray(logits, dtype=np.float64).reshape(-1)
    i = int(np.argmax(z))
    return i, float(1.0 / np.exp(z - z[i]).sum())


def check_ahead(config: RunConfig) -> None:
    """UsageError for a run-ahead setting verify cannot honour (no bound: nothing to check)."""
    bound = config.draft_ahead
    if bound == 0.0:
        return
    if not 0.0 < bound <= 1.0:
        raise UsageError(f"--draft-ahead must be in (0, 1] (0 turns it off), got {bound}")
    if not config.exits:
        raise UsageError("--draft-ahead drafts at an active exit: give --exits")


def ahead_token(rt: ArtifactRuntime, config: RunConfig, st: RowState, layer: int, hidden: np.ndarray) -> int | None:
    """The run-ahead decision for a row at its drafting exit (`hidden` [1, H], what the exit reads): the exit's
    top-1 token where the run's product of top-1 probabilities with this one stays >= the bound (the product kept in
    `st.ahead`), else None (the token goes on to the final layer, which checks the run; the product starts again)."""
    cand, logits = rt.exit_candidates(layer, hidden, config.top_k)
    i, p = top1(logits[0])
    run = st.ahead * p
    if run >= config.draft_ahead:
        st.ahead = run
        return int(cand[0, i])
    st.ahead = 1.0
    return None


def traces(
    rt: ArtifactRuntime, layer: int, pairs: Sequence[tuple[list[int], list[int]]], top_k: int
) -> list[tuple[list[float], list[bool]]]:
    """Per (prompt, greedy full-depth answer) pair: for each answer token a[i] but the last, the drafting exit's top-1
    probability at a[i]'s position and whether its token is a[i + 1] (what a draft made there would be checked
    against). The states come from one prompt call over prompt + answer through the segments up to the exit."""
    if layer not in rt.segment_of_layer or rt.manifest.exit_at(layer).block is not None:
        raise UsageError(f"exit {layer} cannot draft ahead: it must end a segment and have no block head")
    last = rt.segment_of_layer[layer]
    out: list[tuple[list[float], list[bool]]] = []
    for prompt, answer in pairs:
        if len(answer) < 2:
            out.append(([], []))
            continue
        ids = [*prompt, *answer[:-1]]
        kv = rt.new_kv(1, len(ids))
        h = np.asarray(rt.embed(np.array([ids], dtype=np.int64)))
        for s in range(last + 1):
            h = np.array(rt.run_segment(s, h, kv, row=0)[0], copy=True)
        at = h[0, len(prompt) :]  # a[0] is fed at position len(prompt); its state predicts a[1]
        cand, logits = rt.exit_candidates(layer, np.ascontiguousarray(at), top_k)
        probs, right = [], []
        for j in range(at.shape[0]):
            i, p = top1(logits[j])
            probs.append(p)
            right.append(int(cand[j, i]) == answer[j + 1])
        out.append((probs, right))
    return out
