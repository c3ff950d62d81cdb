"""What a step costs whose token exits at an exit, by the cost model's pieces and the policy's spec: the segments up to
the exit, its prediction, and what the later segments charge it (plan/choose.py `predict`, plan/ahead.py `price`).

What this module does not do: price a configuration's decisions or cycles (plan/choose.py, plan/verify.py,
plan/ahead.py), or measure (plan/costs.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from eectl.contracts.names import KV_CALLS, POLICY_SPECS, RIVER_CALLS, PolicySpec
from eectl.contracts.plan import RIVER_EXIT, Costs
from eectl.plan.verify import segment_of


def river_ms(costs: Costs, segment: int) -> float:
    ms = None if costs.river_ms is None else costs.river_ms[segment]
    if ms is None:
        raise ValueError(f"no river timing for segment {segment}: the costs were measured without river copies")
    return ms


def exit_paid(costs: Costs, boundaries: Sequence[int], policy: str, layer: int, over: float) -> float:
    """The ms of a step whose token exits at `layer`: the segments up to it, the exit's prediction, and what the
    policy's spec (`contracts/names.py` POLICY_SPECS) says the later segments cost it: K/V-only calls (copy), the
    int4 copies (river), or one more position in a later pass (defer, verify; a draft also one more row of the
    final head that checks it)."""
    spec = policy_spec(policy)
    s = segment_of(boundaries, layer)
    paid = costs.embed_ms + sum(costs.segment_ms[: s + 1]) + over * (s + 1)
    river_end = spec.later == RIVER_CALLS and policy != RIVER_EXIT  # the river's end predicts instead of the exit
    if costs.exit_predict_ms is not None and not river_end:
        paid += costs.exit_predict_ms[str(layer)]
    later = range(s + 1, len(boundaries))
    if spec.later == KV_CALLS:
        paid += sum(costs.kv_ms[t] for t in later) + over * len(later)
    elif spec.later == RIVER_CALLS:  # the exited token flows on through the int4 copies
        paid += sum(river_ms(costs, t) for t in later) + over * len(later)
        if river_end:
            paid += costs.river_head_ms if costs.river_head_ms is not None else costs.final_head_ms
    else:  # the exited state rides along with a later step through every later segment
        paid += sum(costs.segment_extra_ms[t] for t in later)
        if spec.checks_drafts:
            paid += costs.final_head_extra_ms
    return paid


def policy_spec(policy: str) -> PolicySpec:
    """A policy's spec; `river-exit` (the river predicting at the exit, a run option) is the river's."""
    name = "river" if policy == RIVER_EXIT else policy
    if name not in POLICY_SPECS:
        raise ValueError(f"the cost model has no spec for the policy '{policy}'")
    return POLICY_SPECS[name]
