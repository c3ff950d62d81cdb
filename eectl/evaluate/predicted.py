"""What the plan and the cost model predict for a benchmarked configuration: the plan's predicted speedup (and, for
copy/defer, the agreement a continuation keeps), and the cost model's speedup at the exits the run realized.

What this module does not do: time anything (evaluate/timing.py) or choose (plan/choose.py).
"""

from __future__ import annotations

from typing import Any

from eectl.contracts.gates import GATE
from eectl.contracts.plan import RIVER_EXIT
from eectl.evaluate.results import ConfigResult
from eectl.evaluate.timing import _Run
from eectl.runtime.state import RunConfig


def predictions(res: ConfigResult, cfg: RunConfig, m: Any, reps: list[_Run], priced: Any = None) -> None:
    """The plan's predicted speedup for this configuration (`priced`: its own price, a Prediction, where the plan
    does not hold it: the drafter running ahead), and the cost model at the exits this run realized."""
    from eectl.contracts.plan import RIVER_POLICIES
    from eectl.plan.choose import predict, sequence_agreement

    res.exits = list(cfg.exits)
    res.gated = any(GATE in cfg.thresholds.get(e, {}) for e in cfg.exits)
    res.note = cfg.note
    if priced is not None:
        res.predicted_speedup, res.predicted_interval = priced.speedup, priced.interval
        return
    if cfg.prompt_drafts:  # drafts from the context: the plan prices them at full depth only (its lookup entry)
        lookup = m.plan.lookup if m.plan is not None else None
        if lookup is not None and not cfg.exits:
            res.predicted_speedup, res.predicted_interval = lookup.prediction.speedup, lookup.prediction.interval
        return
    if m.plan is not None and cfg.certified and m.plan.certified is not None:
        res.predicted_speedup = m.plan.certified.prediction.speedup
        res.predicted_interval = m.plan.certified.prediction.interval
    elif m.plan is not None and cfg.planned:
        choice = m.plan.choices.get(cfg.policy)
        active = choice is not None and bool(cfg.exits)
        res.predicted_speedup = choice.prediction.speedup if choice is not None and active else 1.0
        res.predicted_interval = choice.prediction.interval if choice is not None and active else None
        if active and choice is not None and choice.option is not None and choice.option.kind == "target":
            # copy/defer change the tokens: the option's per-token disagreement, compounded over a continuation
            res.predicted_agreement = sequence_agreement(1.0 - choice.option.agreement, cfg.max_new_tokens)
            res.predicted_step_agreement = choice.option.agreement
    if m.costs is None:
        return
    boundaries = [s.layers[1] for s in m.segments]
    emitted = sum(len(r.exit_layers) for r in reps)
    rejected = sum(r.rejected for r in reps)
    steps = emitted + rejected
    if not cfg.exits or steps == 0:
        res.model_speedup = 1.0
        return
    counts = {e: sum(r.exit_layers.count(e) for r in reps) for e in cfg.exits}
    exited = sum(counts.values())
    # rolled-back drafts exited too (at layers no longer recorded): spread them like the accepted ones
    per_exit = [(e, (c + (rejected * c / exited if exited else 0.0)) / steps, None) for e, c in sorted(counts.items())]
    lost = rejected / steps if cfg.policy == "verify" else None
    policy = RIVER_EXIT if cfg.policy == "river" and cfg.river_predict == "exit" else cfg.policy
    if policy in RIVER_POLICIES and m.costs.river_ms is None:
        return  # costs measured before river copies were timed: no model for them
    runs = None
    if res.gated:  # the decisions the run made
        decided = {e: sum(r.decided.get(e, 0) for r in reps) for e in cfg.exits}
        picked = {e: sum(r.picked.get(e, 0) for r in reps) for e in cfg.exits}
        runs = [(decided[e] / steps, picked[e] / steps) for e in sorted(cfg.exits)]
    res.model_speedup = predict(m.costs, boundaries, policy, per_exit, lost_rate=lost, runs=runs).speedup


def lookup_model(cfg: RunConfig, m: Any, ids: list[list[int]], answers: list[list[int]]) -> float | None:
    """Full depth with drafts from the context: what the plan's price (plan/choose.py `predict_lookup`) says of
    the drafts replayed on this run's answers (its output is full depth's), with the manifest's costs; in the
    prompts' order with the run's memory of earlier answers (RunConfig.draft_memory), as a repetition drafts."""
    if m.costs is None:
        return None
    from eectl.plan.lookup import predict_lookup
    from eectl.runtime.drafts import lookup_stats

    pairs = list(zip(ids, answers, strict=True))
    stats = lookup_stats(
        pairs, cfg.prompt_drafts, cfg.stop_ids, cfg.draft_ngram, min_draft=cfg.draft_min, memory=cfg.draft_memory
    )
    pred = predict_lookup(m.costs, stats)
    return None if pred is None else pred.speedup


def run_default(plan: Any, batch_size: int) -> tuple[str, str]:
    """What `eectl run` does with no policy at this batch size (`Plan.default_for`), and the plan's line for the
    bench's report. ("", "") without a plan."""
    if plan is None:
        return "", ""
    batched = plan.batch_note(batch_size)
    return plan.default_for(batch_size), f"{plan.summary()}; {batched}" if batched else plan.summary()


# how far full depth's decode may read from the step the costs were timed at before the report says the machine ran
# in another state: prompts of other lengths than the costs' past move it a few percent (the default model: ~8% more
# at a past of 1,000 than at 128), while a shared host's busy phases moved it 30-57% (2026-12-05: a one-position step
# timed at 12.9 ms at export, decoded at 8.2 ms in a bench an hour later)
CONDITIONS_BAND = 0.15


def conditions(
    costs: Any, full_ms: float, prompts: list[list[int]], answers: list[list[int]], batch_size: int
) -> dict[str, Any] | None:
    """Full depth's decode in this bench against the full-depth step the plan was priced with (`Costs.baseline_ms`:
    one row, at the costs' past). The costs' relative prices move with the machine's state, not only its speed: other
    work contending for memory bandwidth slows a one-position step (memory-bound) far more than a wide pass
    (verify's checks, drafts from the context), so a plan priced in one state mispredicts the other's speedups. None
    without costs or at a batch size above one (the costs are one row's). `note`: a sentence where the two differ by
    more than CONDITIONS_BAND (with the mean past of the bench's steps: `prompts` and their `answers`)."""
    if costs is None or batch_size != 1 or full_ms <= 0 or not prompts:
        return None
    past = sum(len(p) for p in prompts) / len(prompts) + sum(len(a) for a in answers) / max(1, len(answers)) / 2
    priced = float(costs.baseline_ms())
    ratio = full_ms / priced
    out: dict[str, Any] = {"priced_ms": round(priced, 4), "here_ms": round(full_ms, 4), "ratio": round(ratio, 4)}
    if abs(ratio - 1.0) > CONDITIONS_BAND:
        word = "slower" if ratio > 1 else "faster"
        out["note"] = (
            f"full depth decoded at {full_ms:.1f} ms a token here against {priced:.1f} ms when the costs were timed "
            f"({ratio:.2f}x: {word}; a past of {costs.past} there, ~{past:.0f} here): the machine ran in another "
            "state, and the plan's relative prices (a wide pass against a one-position step) move with it, so its "
            "predictions may not hold here; `--profile-costs` re-prices in this run"
        )
    return out
