"""The plan's default priced at every batch size a server runs: where the plan's lossless configuration (drafts from the
context, verify's exits) is faster than batched full depth, and where it is not (`BatchPrices`).

The plan prices one row. In a batch, rows share every graph call: full depth's step over b rows costs far less than b
one-row steps (its weights are read once a step), while a row's drafts run their own wide calls beside the batched one
and an exit saves a segment only where every row of the batch has exited. So the gain shrinks as the batch grows
(the default model at 16 rows: lookup 0.54x, verify 0.80x batched full depth: docs/results/2026-12-04-prompts.md).

Inputs: the plan's one-row prediction and what it was priced on (the manifest's costs: the wide passes `wide_ms`, the
segments; calibration's replay of drafts from the context; the chosen option's exit shares), and full depth's batched
step at each batch size, timed on this machine when the engine starts (`time_full`; the manifest times one row only).
Every one-row figure is moved to the engine's machine state by the ratio of the one-row step timed now to the one the
costs timed (`scale`). Per step of b rows (F(b): the batched full-depth step):

    full depth:  b tokens in F(b)
    lookup:      each row drafts in a step with probability q (calibration's replay: the share of steps wider than
                 one position), its wide pass W (the costs' wide passes, weighted by the replay's widths) beside the
                 batched call the others share: (1 - q^b) F(b) + b q W for b t tokens (t: tokens per step)
    exits:       segment s runs where any row reaches it (1 - (1 - r_s)^b, r_s the share of a row's tokens reaching
                 it), the embedding, the head and the step's overhead always; each row pays its decisions and its
                 exited tokens' flushes and checks (one-row figures): F(b) [fixed + sum_s seg_s (1 - (1 - r_s)^b)]
                 + b X for b (1 - lost) tokens

A policy's speedup at b rows is the model's at b over the model's at one row, times the plan's one-row prediction: at
one row the price is the plan's own. The batch runs the plan's configuration at b rows where that speedup clears the
plan's line (1 + MIN_GAIN), else full depth (runtime/slots.py `Switch`: the runner changes configuration between
steps as rows join and leave). The model errs toward full depth: a drafted row's wide pass is charged whole, the
batched call at F(b) whoever rides in it, decisions per row.

What this module does not do: switch configurations (runtime/slots.py) or decide which runner a setting has
(run/engine.py).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from eectl.contracts.certificate import CERTIFIED
from eectl.contracts.plan import AHEAD, LOOKUP, Choice, Costs, LookupStats, Plan, piecewise
from eectl.plan.lookup import wide_steps
from eectl.plan.verify import segment_of
from eectl.runtime.batch import new_batch_kv
from eectl.runtime.chain import DecodeChain
from eectl.runtime.placement import HOST
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig

ROUNDS = 5  # timing rounds of the batched steps at engine start (each batch size once a round, interleaved)
PAST = 128  # positions each row holds when timed (the manifest's costs time one row at the same)


@dataclass
class BatchPrices:
    """The plan's default (`default`) at each batch size 1..max_batch: its predicted speedup over batched full depth
    (`speedups`), priced on full depth's batched steps timed here (`full_ms`: rows -> ms a step)."""

    default: str
    line: float  # the plan's: the configuration runs at b rows where its speedup there is at least this
    speedups: dict[int, float]
    full_ms: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0  # the timing's wall time

    def pays(self, rows: int) -> bool:
        return self.speedups.get(rows, 0.0) >= self.line

    def rows(self) -> list[int]:
        """The batch sizes where the plan's configuration runs."""
        return [b for b in sorted(self.speedups) if self.pays(b)]

    def describe(self) -> str:
        at = ", ".join(f"{b}: {s:.2f}x" for b, s in sorted(self.speedups.items()) if b in _shown(self.speedups))
        runs = self.rows()
        where = f"at {_spans(runs)} row{'' if runs == [1] else 's'}" if runs else "at no batch size"
        return (
            f"batch prices ({self.default} against batched full depth, {at}): the {self.default} configuration runs "
            f"{where}, full depth otherwise (batched steps timed in {self.seconds:.1f} s)"
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "default": self.default,
            "line": self.line,
            "plan_rows": self.rows(),
            "speedups": {str(b): round(s, 4) for b, s in sorted(self.speedups.items())},
            "full_ms": {str(b): round(v, 3) for b, v in sorted(self.full_ms.items())},
        }


def _shown(speedups: dict[int, float]) -> set[int]:
    n = max(speedups)
    return {b for b in speedups if b & (b - 1) == 0 or b == n}  # powers of two and the largest


def _spans(rows: list[int]) -> str:
    """[1, 2, 3, 5] -> '1-3, 5'."""
    out, start = [], rows[0]
    for a, b in zip(rows, [*rows[1:], None], strict=True):
        if b != a + 1:
            out.append(str(a) if a == start else f"{start}-{a}")
            start = b if b is not None else start
    return ", ".join(out)


def widths(max_batch: int) -> list[int]:
    """The batch sizes timed: powers of two below `max_batch`, and it (the steps between are interpolated)."""
    out = [1 << i for i in range(max(1, max_batch).bit_length()) if 1 << i < max_batch]
    return [*out, max_batch]


def time_full(
    rt: ArtifactRuntime, sizes: Sequence[int], certified_head: bool = True, rounds: int = ROUNDS, past: int = PAST
) -> tuple[dict[int, float], dict[int, bool]]:
    """Full depth's decode step over b rows (each row at `past` positions) for each b of `sizes`, on the bound chain as
    a batch runs it with the full head: ms, the median of `rounds` rounds (every size once a round, after one untimed
    round). Where the artifact has a certified head and `certified_head`, its call over b rows and the full head's
    are timed too, right after each step, and a step with it priced: the step, less the full head, plus the certified
    head, plus the full head over one row for each row it misses (export validation's miss rate per row: the timing's
    random ids give states it cannot prove; a batch runs the full head over the rows it missed alone:
    chain.py `_missed`). Returns each size's faster step and whether that is the certified head's. It ranks the
    vocabulary in 8 bits (runtime/certified_head.py): far cheaper than the full head for one row, but its int8
    kernel's cost grows with the rows where the full head's fp32 one is memory-bound."""
    kv = new_batch_kv(rt, max(sizes), past + 2)
    chains = {b: DecodeChain(rt, kv, 0, rows=b, certified_head=False) for b in sizes}
    bound = {b: DecodeChain(rt, kv, 0, rows=b) for b in sizes} if certified_head else {}  # holds their buffers
    heads = {b: c.certified for b, c in bound.items() if c.certified is not None}
    ids = np.random.default_rng(0).integers(1, rt.manifest.dims["vocab_size"], size=max(sizes)).tolist()
    times: dict[tuple[str, int], list[float]] = {(k, b): [] for b in sizes for k in ("step", "full", "certified")}
    times["missed", 1] = []

    def timed(key: tuple[str, int], r: int, t0: float) -> None:
        if r:
            times[key].append((time.perf_counter() - t0) * 1000.0)

    L = rt.manifest.num_layers
    for r in range(rounds + 1):
        for b, chain in chains.items():
            kv.filled[:b] = past  # every round decodes the same position
            t0 = time.perf_counter()
            chain.step({i: ids[i] for i in range(b)})
            timed(("step", b), r, t0)
            session, io = chain.calls[-1]  # the full head again, on the states the step left
            t0 = time.perf_counter()
            session.run_with_iobinding(io)
            timed(("full", b), r, t0)
            if b in heads:
                t0 = time.perf_counter()
                heads[b].run(HOST)
                timed(("certified", b), r, t0)
        last = chains[max(sizes)].hops[-1]
        if heads and isinstance(last, np.ndarray):  # one missed row's full head, as a batch runs it (chain.py _missed)
            t0 = time.perf_counter()
            rt.greedy_token(L, last.reshape(max(sizes), -1)[:1])
            timed(("missed", 1), r, t0)
    ms = {k: float(statistics.median(v)) for k, v in times.items() if v}
    miss = _miss(rt)
    best, certified = {}, {}
    for b in sizes:
        step = ms["step", b]
        missed = b * miss * (ms["full", b] if b == 1 else ms.get(("missed", 1), ms["full", b]))
        with_it = step - ms["full", b] + ms.get(("certified", b), 0.0) + missed
        certified[b] = b in heads and with_it < step
        best[b] = with_it if certified[b] else step
    return best, certified


def _miss(rt: ArtifactRuntime) -> float:
    """The certified head's miss rate per row: the costs' (export validation's), else 0 (where the runner takes it)."""
    from eectl.plan.costs import certified_miss

    m = rt.manifest
    got = m.costs.certified_miss if m.costs is not None else None
    got = certified_miss(m) if got is None else got
    return 0.0 if got is None else float(got)


def price(
    plan: Plan,
    costs: Costs,
    boundaries: Sequence[int],
    full_ms: dict[int, float],
    max_batch: int,
    lookup: LookupStats | None = None,
    exits: Sequence[int] = (),
) -> dict[int, float]:
    """The plan's default's speedup over batched full depth at each batch size 1..max_batch (`full_ms`: batched
    full-depth steps timed here, rows -> ms; `lookup`: calibration's replay of drafts from the context at the run's
    length, for LOOKUP; `exits`: the configuration's exits, for an exit policy). One row: the plan's prediction; a
    default it cannot price in a batch (no replay, no option): full depth's at every size above one."""
    full = {b: v for b, v in zip(range(1, max_batch + 1), piecewise(full_ms, range(1, max_batch + 1)), strict=True)}
    scale = full[1] / costs.baseline_ms() if costs.baseline_ms() > 0 else 1.0
    if plan.default == LOOKUP and plan.lookup is not None:
        one = plan.lookup.prediction.speedup
        model = _lookup_model(costs, lookup, full, scale) if lookup is not None else None
    elif plan.default == AHEAD and plan.ahead is not None:  # one row as the plan priced it; no batch model of it
        one, model = plan.ahead.prediction.speedup, None
    else:
        choice = _choice(plan)
        one = choice.prediction.speedup if choice is not None else 1.0
        model = _exits_model(plan, costs, boundaries, full, scale, exits)
    if model is None:
        return {b: one if b == 1 else 0.0 for b in full}
    return {b: one * model[b] / model[1] for b in full}


def _choice(plan: Plan) -> Choice | None:
    """The plan's default's choice: a policy's, or the certified setting's."""
    return plan.certified if plan.default == CERTIFIED else plan.choices.get(plan.default)


def _lookup_model(costs: Costs, stats: LookupStats, full: dict[int, float], scale: float) -> dict[int, float] | None:
    steps = {int(w): n for w, n in stats.steps.items()}
    total = sum(steps.values())
    wide = {w: n for w, n in steps.items() if w > 1}
    if not total or stats.tokens <= 0:
        return None
    ms = wide_steps(costs, sorted(wide)) if wide else []
    if ms is None:
        return None
    q = sum(wide.values()) / total  # a row's share of steps that carry drafts
    w = sum(wide[k] * v for k, v in zip(sorted(wide), ms, strict=True)) / max(1, sum(wide.values())) * scale
    per_step = stats.tokens / total
    return {b: per_step * f / ((1.0 - q**b) * f + b * q * w) for b, f in full.items()}


def _exits_model(
    plan: Plan,
    costs: Costs,
    boundaries: Sequence[int],
    full: dict[int, float],
    scale: float,
    exits: Sequence[int],
) -> dict[int, float] | None:
    choice = _choice(plan)
    if choice is None or choice.option is None or not exits:
        return None
    per_exit = [x for x in choice.option.per_exit if x.layer in exits]
    base = costs.baseline_ms()
    n = len(costs.segment_ms)
    reach = [1.0] * n  # a row's share of tokens that reach segment s
    extra = choice.prediction.decision_ms  # each row's own: its decisions, its exited tokens' flushes and checks
    for x in per_exit:
        s = segment_of(boundaries, x.layer)
        for t in range(s + 1, n):
            reach[t] -= x.coverage
        extra += x.coverage * (sum(costs.segment_extra_ms[s + 1 :]) + costs.final_head_extra_ms)
    shares = [ms / base for ms in costs.segment_ms]
    fixed = max(0.0, 1.0 - sum(shares))  # the embedding, the head, the step's overhead: every step
    kept = 1.0 - min(0.95, choice.prediction.lost_per_step)
    out = {}
    for b, f in full.items():
        runs = fixed + sum(sh * (1.0 - (1.0 - max(0.0, r)) ** b) for sh, r in zip(shares, reach, strict=True))
        out[b] = kept * f / (f * runs + b * extra * scale)
    return out if all(math.isfinite(v) and v > 0 for v in out.values()) else None


def batch_prices(
    rt: ArtifactRuntime, config: RunConfig, max_batch: int, tokens: int, full_ms: dict[int, float], seconds: float
) -> BatchPrices:
    """The plan's default (`config`: its one-row configuration, as the run resolved it) priced at each batch size
    1..max_batch for answers of up to `tokens` tokens, on full depth's batched steps timed here (`time_full`: `full_ms`
    in `seconds`); the rest from the manifest (its costs, the plan, calibration's replay of drafts from the context at
    that length)."""
    m = rt.manifest
    plan, costs = m.plan, m.costs
    assert plan is not None and costs is not None
    stats = None
    cal = m.calibration
    if plan.default == LOOKUP and cal is not None and cal.lookup is not None:
        cut = cal.lookup.at_length(tokens)
        shortest = plan.lookup.min_draft if plan.lookup is not None else 1
        stats = next((v for v in [cut, *cut.shortest] if v.min_draft == shortest), cut)
    boundaries = [s.layers[1] for s in m.segments]
    speedups = price(plan, costs, boundaries, full_ms, max_batch, stats, config.exits)
    return BatchPrices(plan.default, 1.0 + plan.min_gain, speedups, full_ms, round(seconds, 2))
