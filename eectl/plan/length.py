"""The plan for a run of a given length (`--max-new-tokens`): calibration judges exits and replays drafts on
continuations of one length, and both pay differently early and late in an answer (the default model on 24 GSM8K
answers: 51% of positions 0-15 exit at verify's [8], ~26% of positions 16-63; drafts from the context 1.08 tokens a
step over 16 tokens, 1.28 over 64). `eectl run` and `eectl bench` price the plan's choices at their own length: each
chosen option on its first `tokens` positions (`Option.at_length`), lookup on its replay cut there
(`LookupStats.at_length`), verify drafting ahead on calibration's traces cut there (`AheadTraces.at_length`,
plan/ahead.py `ahead_at_length`: its interval and `on` recomputed), and the default chosen again between them by
plan/choose.py's rule, with what stays undecided at the line (`Plan.unresolved`). The exits each policy runs, and
the drafter's exit and bound, stay the plan's; only their prices, the default and what is undecided move.
Calibration files without the drafter's traces leave its entry as exported.

What this module does not do: choose exits (plan/choose.py) or time anything (plan/costs.py).
"""

from __future__ import annotations

from typing import Any

from eectl.contracts.plan import AHEAD, LOOKUP, Choice, Plan
from eectl.plan.ahead import ahead_at_length
from eectl.plan.choose import lossless_default, predict_option
from eectl.plan.lookup import lookup_at_length


def plan_for_run(m: Any, tokens: int) -> Plan | None:
    """The manifest's plan priced for a run of at most `tokens` generated tokens; the plan itself where nothing
    changes (calibration files written before blocks, cuts and the drafter's traces, or no costs). A certified or
    inexact default stays."""
    plan, costs, cal = m.plan, m.costs, m.calibration
    if plan is None or costs is None:
        return plan
    boundaries = [s.layers[1] for s in m.segments]
    choices = {name: _priced(c, costs, boundaries, tokens) for name, c in plan.choices.items()}
    lookup = plan.lookup
    if lookup is not None and cal is not None and cal.lookup is not None:
        lookup = lookup_at_length(plan, costs, cal.lookup, tokens)
    ahead = plan.ahead
    if ahead is not None and cal is not None and cal.ahead is not None:
        ahead = ahead_at_length(plan, costs, boundaries, cal.ahead, tokens)
    if all(choices[n] is plan.choices[n] for n in choices) and lookup is plan.lookup and ahead is plan.ahead:
        return plan
    new = plan.model_copy(update={"choices": choices, "lookup": lookup, "ahead": ahead, "tokens": tokens})
    if plan.default in (LOOKUP, AHEAD, "verify", "full") and not plan.inexact:
        new.default = lossless_default(new)  # plan/choose.py's rule, on the prices at this length
    new.unresolved = new.undecided()  # an interval that straddles the line at one length may not at another
    return new


def _priced(choice: Choice, costs: Any, boundaries: list[int], tokens: int) -> Choice:
    """A choice's prediction on its option's first `tokens` positions, its interval moved by the same ratio."""
    if choice.option is None or not choice.exits:
        return choice
    option = choice.option.at_length(tokens)
    if option is choice.option:
        return choice
    pred = predict_option(costs, boundaries, choice.policy, option)
    ratio = pred.speedup / choice.prediction.speedup if choice.prediction.speedup else 1.0

    def moved(span: tuple[float, float] | None) -> tuple[float, float] | None:
        return None if span is None else (span[0] * ratio, span[1] * ratio)

    old = choice.prediction
    pred = pred.model_copy(update={"interval": moved(old.interval), "timing": moved(old.timing)})
    return choice.model_copy(update={"prediction": pred, "best": pred})
