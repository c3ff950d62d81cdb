"""Drafts that run ahead priced (runtime/ahead.py): the bound and the exit the drafter runs at, chosen from its
replay on measured traces and this machine's costs, against verify, lookup and full depth.

The replay (`replay_ahead`) is the runtime's rule on a trace of one (prompt, full-depth answer) pair: at each answer
position i the exit's top-1 probability p_i and whether its token is the answer's next (runtime/ahead.py `traces`).
A cycle starting at i drafts while the run's product p_i ... p_{i+k-1} stays >= the bound (at most `block`), then the
token at i + k runs to the final layer and checks the k drafts: the leading correct ones (a) are kept, and the pass
emits the full model's token after them, so the cycle emits a + 1 tokens and the next starts at i + a + 1. At the
trace's end (the answer's last token: its stop token, or the run's --max-new-tokens) a cycle whose drafts are right up
to that token emits those a alone: the run stops there, its closing pass checks them and emits nothing
(runtime/runner.py `_settled`), so every trace's cycles emit exactly its length, what a run decodes. On the
accepted path the exit's states are the full model's (the layers up to the exit hold every position's exact K/V), so
the replay is the run's, but for how long a run goes on past its first wrong draft (the trace's probabilities there
are the answer's; the run's follow the wrong token): that tail's cost only, never the tokens.

Priced per cycle with the cost model's pieces (plan/paid.py `exit_paid`, `check_excess`):

    k drafts:      k x (the step to the exit + its decision + one more position in every later segment and the head)
    the check:     the full-depth step + its decision (none where the block forced it) + the wide pass's excess at k
    ms per token:  sum over cycles / sum over cycles of their tokens (a + 1; a for the closing one above)

The choice maximises the predicted speedup over `BOUNDS` at every exit traced; it runs (`AheadChoice.on`) only when
its interval's low end (the costs' timing and a bootstrap over the traced prompts, combined) clears 1 + MIN_GAIN.
The plan's entry (`plan_ahead`: export prices calibration's traces, contracts/calibration.py AheadTraces, at the
exits that can draft) stands beside the plan's other lossless defaults (verify, lookup or full depth) in plan/choose.py
`lossless_default`: the higher low end wins (`lossless_pick` for a drafter priced elsewhere, bench's replay). A run
prices the entry again at its own length (`ahead_at_length`, plan/length.py): the same exit and bound on the traces
cut there, its interval and `on` recomputed as export computed them.

What this module does not do: measure the traces or run anything (runtime/ahead.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from eectl.contracts.calibration import AheadTraces
from eectl.contracts.plan import AHEAD, LEVEL, MIN_GAIN, VERIFY_BLOCK, AheadChoice, Costs, Plan, Prediction
from eectl.plan.intervals import Replicates, combined, unit_interval
from eectl.plan.paid import exit_paid
from eectl.plan.verify import check_excess

__all__ = ["AHEAD", "BOUNDS", "AheadChoice", "Cycle", "ahead_at_length", "ahead_choice", "choose_ahead", "plan_ahead"]
# the bounds priced: a product of top-1 probabilities (1 drafts only what the exit is sure of)
BOUNDS = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.15, 0.1, 0.05, 0.02)

Trace = tuple[list[float], list[bool]]  # per answer position: the exit's top-1 probability, its token right


class Cycle(NamedTuple):
    """One check pass and the drafts before it: k + 1 passes."""

    drafts: int  # k
    kept: int  # a: the leading right drafts
    tokens: int  # emitted: a + 1, or a where the drafts are right up to the trace's end (no check token)


def replay_ahead(probs: Sequence[float], right: Sequence[bool], bound: float, block: int = VERIFY_BLOCK) -> list[Cycle]:
    """The cycles the run-ahead drafter takes along one trace (module docstring): their tokens add up to its
    length."""
    n, i, out = len(probs), 0, []
    while i < n:
        run, k = 1.0, 0
        while k < block and i + k < n and run * probs[i + k] >= bound:
            run *= probs[i + k]
            k += 1
        a = next((j for j in range(k) if not right[i + j]), k)
        # a = k = n - i: the drafts reach the answer's last token, where the run stops (its closing pass emits nothing)
        out.append(Cycle(k, a, min(a + 1, n - i)))
        i += a + 1
    return out


def _cycles(traces: Sequence[Trace], bound: float, block: int) -> list[list[Cycle]]:
    return [replay_ahead(p, r, bound, block) for p, r in traces]


def price(
    costs: Costs, boundaries: Sequence[int], layer: int, cycles: Sequence[Sequence[Cycle]], block: int
) -> Prediction:
    """The drafter at exit `layer` over these cycles (per prompt), by the costs (module docstring)."""
    bound = costs.bound_exits
    base = costs.baseline_ms()
    full = base if bound else costs.full_step_ms
    over = costs.overhead_per_segment(bound)
    decision = costs.candidates_ms[str(layer)]
    draft = exit_paid(costs, boundaries, "verify", layer, over) + decision
    check = check_excess(costs, boundaries, [(layer, 1.0, None)])
    ms = tokens = steps = 0.0
    drafted = 0
    for k, _, emitted in (c for per in cycles for c in per):
        ms += k * draft + full + (decision if k < block else 0.0) + (check(k) if check is not None and k else 0.0)
        tokens += emitted
        steps += k + 1
        drafted += k
    if tokens == 0:
        return Prediction(
            policy="verify", exits=[layer], ms_per_token=base, full_ms=base, speedup=1.0, decision_ms=0.0, exit_rate=0.0
        )
    per_token = ms / tokens
    return Prediction(
        policy="verify",
        exits=[layer],
        ms_per_token=per_token,
        full_ms=base,
        speedup=base / per_token,
        decision_ms=decision * steps / tokens,
        exit_rate=drafted / steps,
        lost_per_step=(steps - tokens) / steps,
    )


def choose_ahead(
    costs: Costs,
    boundaries: Sequence[int],
    traces: Mapping[int, Sequence[Trace]],
    block: int = VERIFY_BLOCK,
    min_gain: float = MIN_GAIN,
    level: float = LEVEL,
) -> AheadChoice | None:
    """The fastest (exit, bound) over BOUNDS at the exits traced that the costs price (None: none), with its
    interval; `on` where its low end clears 1 + min_gain."""
    priced = [
        (price(costs, boundaries, layer, _cycles(tr, b, block), block), layer, b)
        for layer, tr in traces.items()
        if str(layer) in costs.candidates_ms and layer in boundaries[:-1]
        for b in BOUNDS
    ]
    if not priced:
        return None
    _, layer, b = max(priced, key=lambda x: x[0].speedup)
    return ahead_choice(costs, boundaries, layer, traces[layer], b, block, min_gain, level)


def ahead_choice(
    costs: Costs,
    boundaries: Sequence[int],
    layer: int,
    traces: Sequence[Trace],
    bound: float,
    block: int = VERIFY_BLOCK,
    min_gain: float = MIN_GAIN,
    level: float = LEVEL,
) -> AheadChoice:
    """The drafter at exit `layer` and `bound` priced on these traces, with its interval (the costs' timing and a
    bootstrap over the traced prompts) and its cycles' drafts, kept drafts and kept share by position."""
    per_prompt = _cycles(list(traces), bound, block)  # replayed once: the resamples below draw whole prompts
    pred = price(costs, boundaries, layer, per_prompt, block)
    timing = Replicates.of(costs).interval(
        pred.speedup, lambda c: price(c, boundaries, layer, per_prompt, block).speedup, level
    )
    sample = unit_interval(
        pred.speedup,
        len(per_prompt),
        lambda picks: price(costs, boundaries, layer, [per_prompt[i] for i in picks], block).speedup,
        level,
    )
    span = combined(pred.speedup, timing, sample)
    if span is not None:
        pred = pred.model_copy(update={"interval": span, "timing": timing})
    cycles = [c for per in per_prompt for c in per]
    reached = [sum(1 for c in cycles if c.drafts > m) for m in range(block)]
    kept = [sum(1 for c in cycles if c.kept > m) for m in range(block)]
    return AheadChoice(
        exit=layer,
        bound=bound,
        prediction=pred,
        on=pred.low() >= 1.0 + min_gain,
        drafts=sum(c.drafts for c in cycles) / max(len(cycles), 1),
        accepted=sum(c.kept for c in cycles) / max(len(cycles), 1),
        by_position=[round(kept[m] / reached[m], 4) for m in range(block) if reached[m]],
    )


def plan_ahead(
    manifest: Any, costs: Costs, traced: AheadTraces, min_gain: float = MIN_GAIN, level: float = LEVEL
) -> AheadChoice | None:
    """The plan's entry for an artifact (a Manifest) with these costs: `choose_ahead` over calibration's traces at
    the exits that can draft (each ends a segment before the final layer and has no block head); None where none
    is traced there or the costs price none."""
    boundaries = [s.layers[1] for s in manifest.segments]
    blocks = {e.layer for e in manifest.exits if e.block is not None}
    usable = {e: traced.traces(e) for e in boundaries[:-1] if e not in blocks and traced.signed.get(str(e))}
    return choose_ahead(costs, boundaries, usable, VERIFY_BLOCK, min_gain, level) if usable else None


def ahead_at_length(
    plan: Plan, costs: Costs, boundaries: Sequence[int], traced: AheadTraces, tokens: int
) -> AheadChoice | None:
    """The plan's drafter entry priced for a run of at most `tokens` generated tokens: its exit and bound kept, on
    calibration's traces cut there (`AheadTraces.at_length`), by `ahead_choice` as export priced it (the interval
    over the costs' timing and the traced prompts, `on` by the plan's line). The plan's own entry where the length
    cuts nothing, or its exit holds no traces or no cost."""
    entry = plan.ahead
    if entry is None:
        return None
    cut = traced.at_length(tokens)
    at_exit = cut.traces(entry.exit)
    if cut is traced or not at_exit or str(entry.exit) not in costs.candidates_ms:
        return entry
    return ahead_choice(costs, boundaries, entry.exit, at_exit, entry.bound, VERIFY_BLOCK, plan.min_gain, plan.level)
