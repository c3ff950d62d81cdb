"""Bench's `ahead` configuration: verify drafting ahead (runtime/ahead.py) at the exit and bound of the plan's entry
(`Plan.ahead`, priced at export on calibration's traces and again at the bench's --max-new-tokens by plan/length.py),
or, for a plan without one (calibrated before the traces), at those plan/ahead.py picks from a replay on prompts the
bench does not time (`BenchOptions.ahead_prompts`: the data's prompts before --offset, else after the bench's window),
with the artifact's costs; `--draft-ahead` pins the bound (at the replay's exit).

The replay prompts' full-depth answers are generated here (greedy, the bench's token budget), every exit that ends a
segment and has no block head is traced on them, and the choice is priced against the plan's lossless default
(verify, lookup or full depth: `lossless_pick`). Where the drafter does not pay, the configuration runs full depth
(as a policy the plan cleared nothing for does), with the reason in its note.

What this module does not do: time anything (evaluate/timing.py) or price (plan/ahead.py).
"""

from __future__ import annotations

import math
from dataclasses import replace

from eectl.contracts.plan import Prediction
from eectl.data import encode_prompt
from eectl.errors import UsageError
from eectl.evaluate.results import BenchOptions
from eectl.exits.signals import SIGNALS
from eectl.plan.ahead import AheadChoice, ahead_choice, choose_ahead
from eectl.plan.choose import lossless_pick
from eectl.run.generate import RunOptions, load_tokenizer, resolve_config
from eectl.runtime.ahead import traces
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig


def ahead_config(
    rt: ArtifactRuntime, opts: BenchOptions, stop: tuple[int, ...]
) -> tuple[RunConfig, Prediction | None, AheadChoice | None]:
    """The configuration's RunConfig, its predicted speedup, and the plan's choice (None where nothing is priced)."""
    m = rt.manifest
    if m.costs is None:
        raise UsageError("the ahead configuration is priced with the artifact's costs: this artifact has none")
    base = RunOptions(exits="none", max_new_tokens=opts.max_new_tokens, provider=opts.provider)
    full = replace(resolve_config(rt, base, stop), prompt_drafts=0)
    plan = m.plan
    if plan is not None and plan.ahead is not None and opts.draft_ahead is None:  # priced at the bench's length
        return _run(full, plan.ahead, f"the plan's {plan.ahead.describe()}; the plan's default: {plan.default}")
    if not opts.ahead_prompts:
        raise UsageError("the ahead configuration replays its drafter on prompts the bench does not time: none left")
    tok = load_tokenizer(rt)
    ids = [encode_prompt(tok, p, opts.raw) for p in opts.ahead_prompts]
    pairs = list(zip(ids, (g.token_ids for g in Runner(rt, full).generate(ids)), strict=True))
    boundaries = [s.layers[1] for s in m.segments]
    layers = [e for e in boundaries[:-1] if e in rt.full_graphs and m.exit_at(e).block is None]
    k = full.top_k
    traced = {e: traces(rt, e, pairs, k) for e in layers}
    choice = choose_ahead(m.costs, boundaries, traced, full.verify_block)
    if choice is None:
        return replace(full, note="drafts ahead: no exit the costs price; full depth"), None, None
    if opts.draft_ahead is not None:  # pinned: the chosen exit at this bound, priced as it is, run whatever it costs
        pinned = ahead_choice(
            m.costs, boundaries, choice.exit, traced[choice.exit], opts.draft_ahead, full.verify_block
        )
        choice = pinned.model_copy(update={"on": True})
    pick = lossless_pick(m.plan, choice) if m.plan is not None else "ahead"
    pinned_note = "pinned by --draft-ahead: " if opts.draft_ahead is not None else ""
    note = f"{pinned_note}{choice.describe()}; the plan's lossless pick: {pick}; replayed on {len(pairs)} prompts"
    return _run(full, choice, note)


def _run(full: RunConfig, choice: AheadChoice, note: str) -> tuple[RunConfig, Prediction | None, AheadChoice]:
    """The drafter's RunConfig where it runs (`on`), else full depth; its predicted speedup (1 at full depth)."""
    if not choice.on:
        return (
            replace(full, note=f"{note}; full depth"),
            Prediction(
                policy="verify", exits=[], ms_per_token=1.0, full_ms=1.0, speedup=1.0, decision_ms=0.0, exit_rate=0.0
            ),
            choice,
        )
    # the exit's own test is never asked (the drafter decides): its thresholds stand at never
    never = {choice.exit: dict.fromkeys(SIGNALS[full.signal].criteria, math.inf)}
    cfg = replace(full, exits=[choice.exit], thresholds=never, policy="verify", draft_ahead=choice.bound, note=note)
    return cfg, choice.prediction, choice
