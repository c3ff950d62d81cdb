"""Exits chosen by what they save: a cost model of one decode step, and the choice of active exits per policy.

Inputs are two measurements of the artifact, both model-agnostic:
- the calibrated **options** (calibrate/fit.py): for a subset of exits and a precision target, the per-exit thresholds
  and the held-out share of all tokens that exit at each exit (`coverage`) and their agreement with the final layer
  (`precision`): what a run with exactly those exits active sees (Top-K candidates picked at the subset's first exit);
- the measured **costs** (plan/costs.py): milliseconds per graph call on the runner's provider and thread count.

Per-token time of an option under a policy (exit a_1 < ... < a_m active, c_i the coverage at a_i, c_0 = 1 - sum c_i):

    exit at a_i:  embed + segments up to a_i + decisions at a_1..a_i + policy extra_i
    no exit:      the full-depth step (measured) + decisions at a_1..a_m
    decisions:    the candidate source at a_1, a local K-row exit at a_2.. (each with its signal computation);
                  a cosine signal reads block states only, and an exiting token then pays the exit's LM head;
                  plus a block head's graph where the exit has one (it runs for every token reaching the exit)
    extra_i:      copy: the K/V-only graphs of the segments after a_i
                  defer, verify: one more position in every later segment (the pending state rides along)
                  verify: one more row in the final head (the draft is checked there)
    river:        the int4 copies of the segments after a_i (one position each) and, predicting at the river's
                  end, the final head (`river-exit` predicts at the exit: no final head)
    verify:       drafts are checked in cycles: K drafts (P(K >= m) = r^m, r the exit rate, at most VERIFY_BLOCK),
                  then the full-depth pass that checks them emits the full model's token after the leading correct
                  ones (`verify_cycle`): time per emitted token = time per cycle / tokens per cycle

The choice maximises predicted speed: for copy and defer over the options fitted at the fidelity target, for
verify (lossless) over the options fitted at any precision of a grid (there the threshold is a speed knob). `copy` is
never the default: its approximate K/V change later tokens in a way calibration does not measure.

Drafts from the context (`lookup`) are priced in plan/lookup.py, verify drafting ahead at one exit (`ahead`) in
plan/ahead.py from calibration's traces; the plan makes either the default when its interval clears the line and its
low end is above the exit configurations' and the other's (`lossless_default`).

The default is lossless (verify, lookup, ahead, or full depth): copy and defer change the tokens, and a per-token target
says little of how much a whole answer changes (0.99 per token compounds to 77-90% of 48-token answers unchanged).
A lossy setting is the default only with a sequence certificate (calibrate --guarantee sequence) at the user's
risk (`max_risk`, run/bench --max-risk; by default the certificate's own delta): its setting is priced with the
exit shares its certification measured and wins when it clears the line and beats the lossless choice.
`run --policy defer` still runs the per-token calibrated defer choice: asked for, not chosen.

A configuration is activated only when the LOW end of its predicted speedup's 90% interval clears 1 + MIN_GAIN;
otherwise the policy runs at full depth. The interval comes from the costs' per-round samples (`Costs.samples_ms`),
timed in batches of rounds (plan/costs.py): each batch's figures (its rounds' medians) predict the speedup once, and
the interval is the point estimate (every round's medians) +- t(level, B - 1) standard errors of those B batch
predictions (batch means: the standard interval for the mean of a correlated series). Rounds alone do not do: the
rounds of one pass share the machine's state of those seconds, and an interval resampled from them was half to a
third as wide as the spread between passes (the default model, one process, idle: verify [8] read 1.037x [1.032,
1.040] in one pass and 1.009x-1.018x in four others). A batch predicts from all its graphs' figures together, so
the load of the moment, which falls on every graph timed in it (the full step included), cancels in its speedup as
it does in the point estimate. Costs with a single batch (or timed before batches) get the earlier interval: a paired
bootstrap over rounds (a replicate draws R rounds with replacement and takes each graph's median), drawn with a fixed
seed. Costs without samples (artifacts exported before the intervals) are taken as exact: the interval is the point.

Options calibrated with their units' counts (`Option.units`: per teacher-forced chunk or prompt continuation
judged) also carry what the calibration sample leaves open: the speedup predicted from bootstrap resamples of those
units (plan/intervals.py `unit_interval`), whose interval is combined with the timing's (half-widths in
quadrature). A menu judged on a few prompts whose exit rates differ from prompt to prompt then activates an option
only when it clears the line however those prompts were drawn. Only the timing's interval (`Prediction.timing`)
makes a choice undecided: more timing cannot narrow the sample.

Export and `--profile-costs` time batches until the plan is decided (`settled`): at least MIN_BATCHES batches, and
no interval that could change a choice straddling the line; when the time budget runs out first, each undecided
choice runs what cleared the line (full depth, drafts off) and the plan records it (`Plan.unresolved`). The same
costs always give the same plan.

What this module does not do: measure (plan/costs.py, calibrate/calibrator.py) or run anything; it is pure arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from eectl.contracts.certificate import CERTIFIED, Certificate
from eectl.contracts.plan import (
    AHEAD,
    INTERVAL_TOP,
    LEVEL,
    LOOKUP,
    MIN_BATCHES,
    MIN_GAIN,
    PLAN_POLICIES,
    AheadChoice,
    Choice,
    Costs,
    LookupChoice,
    Option,
    Plan,
    Prediction,
)
from eectl.plan.ahead import plan_ahead
from eectl.plan.intervals import Replicates, combined, unit_interval
from eectl.plan.lookup import choose_lookup
from eectl.plan.paid import exit_paid, policy_spec
from eectl.plan.verify import check_excess, expected_check, verify_cycle


def sequence_agreement(disagreement: float, new_tokens: int) -> float:
    """Expected position-wise agreement with full depth of `new_tokens` generated under copy or defer, when each
    token disagrees with the full model's independently with probability `disagreement` (an option's held-out
    1 - agreement on generated tokens) and the first disagreement ends agreement (the continuations part there):
    the mean over positions i = 1..L of (1 - h)^i = (1 - h)(1 - (1 - h)^L) / (h L).

    Calibration bounds the per-token rate; a sequence compounds it (h = 0.3% over 48 tokens: 0.93). Errors that
    cluster in a few prompts part fewer continuations than independent ones, so this errs low; continuations that
    meet again after parting make it err low too."""
    h, n = float(disagreement), int(new_tokens)
    if n <= 0 or h <= 0.0:
        return 1.0
    if h >= 1.0:
        return 0.0
    keep = 1.0 - h
    return keep * (1.0 - keep**n) / (h * n)


def predict(
    costs: Costs,
    boundaries: Sequence[int],
    policy: str,
    per_exit: Sequence[tuple[int, float, float | None]],
    lost_rate: float | None = None,
    runs: Sequence[tuple[float, float]] | None = None,
) -> Prediction:
    """Expected ms per emitted token for active exits (layer, coverage, precision), ascending by layer.

    `boundaries` are the artifact's segment end layers (the last = L). `lost_rate` (verify) overrides the tokens
    lost per step that precisions imply (bench passes its measured rate). `runs` (gated options): per exit, the
    share of all tokens whose decision runs there and the share that picks the candidates there; without it every
    token reaching an exit decides there, the first exit picking.
    """
    base = costs.baseline_ms()  # full depth with no exit active (the bound chain where the runner has one)
    bound = costs.bound_exits  # one-row exit steps on the bound chain, every policy's
    over = costs.overhead_per_segment(bound)
    # a token that passes every exit: older costs' per-call step, plus its decisions; on the bound chain, the
    # chain's step (the pending positions it carries along are charged to the tokens that left them: extra_i)
    full = base if bound else costs.full_step_ms
    exits = [layer for layer, _, _ in per_exit]
    if not exits:
        return Prediction(
            policy=policy, exits=[], ms_per_token=base, full_ms=base, speedup=1.0, decision_ms=0.0, exit_rate=0.0
        )
    reach = 1.0
    shares: list[tuple[float, float]] = []  # per exit: (decides there as a later exit, picks there)
    for i, (_, cov, _) in enumerate(per_exit):
        shares.append((0.0 if i == 0 else reach, reach if i == 0 else 0.0))
        reach -= cov
    if runs is not None:
        shares = [(d - p, p) for d, p in runs]
    # the expected decision time per token: each exit's decisions at the share of tokens making them there (a block
    # head runs for every token reaching its exit, gate or not)
    decision = 0.0
    reach = 1.0
    for (layer, cov, _), (local, pick) in zip(per_exit, shares, strict=True):
        decision += local * costs.local_ms[str(layer)] + pick * costs.candidates_ms[str(layer)]
        decision += reach * costs.block_ms.get(str(layer), 0.0)
        if runs is not None:  # gated: every token reaching the exit tests its gate
            decision += reach * costs.gate_ms.get(str(layer), 0.0)
        reach -= cov
    paid = 0.0  # the exiting tokens' share of a step's time
    rate = 0.0
    for layer, cov, _ in per_exit:
        paid += cov * exit_paid(costs, boundaries, policy, layer, over)
        rate += cov
    lost = 0.0
    checks = policy_spec(policy).checks_drafts
    check = check_excess(costs, boundaries, per_exit) if checks else None
    if checks and lost_rate is None:  # drafts checked in cycles (`verify_cycle`)
        precision = sum(cov * (1.0 if p is None else p) for _, cov, p in per_exit) / rate if rate > 0 else 1.0
        draft = paid / rate if rate > 0 else 0.0
        per_token, lost = verify_cycle(min(rate, 1.0), precision, draft, decision, full, check=check)
    else:
        if checks:  # measured: the tokens rolled back per step of a run
            lost = min(float(lost_rate or 0.0), 0.95)
        # verify's check passes: one a cycle, a cycle ending at each step that does not exit
        checked = max(0.0, 1.0 - rate) * expected_check(min(rate, 1.0), check) if check is not None else 0.0
        per_token = (decision + paid + max(0.0, 1.0 - rate) * full + checked) / (1.0 - lost)
    return Prediction(
        policy=policy,
        exits=exits,
        ms_per_token=per_token,
        full_ms=base,
        speedup=base / per_token,
        decision_ms=decision / (1.0 - lost),
        exit_rate=rate,
        lost_per_step=lost,
    )


def predict_option(costs: Costs, boundaries: Sequence[int], policy: str, option: Option) -> Prediction:
    runs = None
    if option.gated:
        runs = [(x.decided or 0.0, x.picked or 0.0) for x in option.per_exit]
    return predict(costs, boundaries, policy, [(x.layer, x.coverage, x.precision) for x in option.per_exit], runs=runs)


def _usable(costs: Costs, boundaries: Sequence[int], opt: Option) -> bool:
    inner = {str(b) for b in boundaries[:-1]}
    pickers = opt.exits if opt.gated else opt.exits[:1]  # gated: any exit may pick the candidates
    return (
        bool(opt.exits)
        and all(str(e) in inner and str(e) in costs.local_ms for e in opt.exits)
        and all(str(e) in costs.candidates_ms for e in pickers)
    )


def with_interval(
    pred: Prediction,
    replicates: Replicates,
    boundaries: Sequence[int],
    option: Option,
    level: float = LEVEL,
    costs: Costs | None = None,
) -> Prediction:
    """`pred` (the option's prediction) with its speedup's interval: over the costs' `replicates` (timing), and,
    where the option records its units and `costs` are given, over the calibration sample too (a bootstrap over its
    units: plan/intervals.py `unit_interval`), the two combined; unchanged without either."""
    timing = replicates.interval(
        pred.speedup, lambda c: predict_option(c, boundaries, pred.policy, option).speedup, level
    )
    sample = None
    if costs is not None and option.units:
        rows = option.unit_rows()
        sample = unit_interval(
            pred.speedup,
            len(rows),
            lambda picks: predict_option(costs, boundaries, pred.policy, option.resampled(picks, rows)).speedup,
            level,
        )
    if sample is None:
        return pred if timing is None else pred.model_copy(update={"interval": timing})
    timing = timing or (pred.speedup, pred.speedup)  # costs without samples: timing adds no spread
    return pred.model_copy(update={"interval": combined(pred.speedup, timing, sample), "timing": timing})


def choose(
    costs: Costs,
    boundaries: Sequence[int],
    options: Sequence[Option],
    min_gain: float = MIN_GAIN,
    level: float = LEVEL,
) -> Plan:
    """Per policy, the fastest predicted option among those whose speedup's interval clears 1 + min_gain at its
    low end (full depth when none does), and the default: verify's choice (lossless), or full depth. A policy is
    undecided when an option's interval straddles the line and reaches above the chosen one's low end."""
    line = 1.0 + min_gain
    replicates = Replicates.of(costs)
    choices: dict[str, Choice] = {}
    for policy in PLAN_POLICIES:
        kind = "verify" if policy == "verify" else "target"
        ranked = sorted(
            (
                (predict_option(costs, boundaries, policy, opt), opt)
                for opt in options
                if opt.kind == kind and _usable(costs, boundaries, opt)
            ),
            key=lambda po: -po[0].speedup,
        )
        # intervals for the top few by point estimate only (each costs a prediction per replicate): an option further
        # down would need a much narrower interval than all of those for its low end alone to clear the line
        top = [(with_interval(p, replicates, boundaries, o, level, costs), o) for p, o in ranked[:INTERVAL_TOP]]
        clear = [(p, o) for p, o in top if p.low() >= line]
        best: tuple[Prediction, Option] | None = max(clear or top, key=lambda po: po[0].speedup, default=None)
        floor = best[0].low() if clear and best is not None else -np.inf  # what an undecided option must beat
        # undecided: more timing could change the choice (the calibration sample's spread it cannot narrow)
        undecided = any(p.straddles(line) and p.timing_span()[1] > floor for p, _ in top)
        if clear and best is not None:
            pred, opt = best
            thresholds = {str(k): v for k, v in opt.thresholds().items()}
            choices[policy] = Choice(
                policy=policy,
                exits=opt.exits,
                thresholds=thresholds,
                option=opt,
                prediction=pred,
                best=pred,
                undecided=undecided,
            )
        else:
            choices[policy] = Choice(
                policy=policy,
                exits=[],
                thresholds={},
                option=None,
                prediction=predict(costs, boundaries, policy, []),
                best=None if best is None else best[0],
                undecided=undecided,
            )
    # the default is lossless: copy and defer change the tokens, and per-token calibration does not say by how much
    # a whole answer changes; a lossy setting becomes the default only with a sequence certificate (plan_manifest)
    default = "verify" if choices["verify"].exits else "full"
    plan = Plan(default=default, min_gain=min_gain, choices=choices, level=level)
    plan.unresolved = plan.undecided()
    return plan


def choose_certified(costs: Costs, boundaries: Sequence[int], cert: Certificate, level: float = LEVEL) -> Choice | None:
    """The certificate's setting priced by the cost model with the exit shares its certification measured (every
    exit deciding on the same signal, candidates at the first), with its interval over the costs' timing;
    None when it cannot be priced (nothing certified, no shares recorded, an exit the costs lack)."""
    setting = cert.setting()
    if setting is None or setting.exit_shares is None or cert.policy not in PLAN_POLICIES:
        return None
    inner = {str(b) for b in boundaries[:-1]}
    if not all(str(e) in inner and str(e) in costs.local_ms for e in cert.exits):
        return None
    if str(cert.exits[0]) not in costs.candidates_ms:
        return None
    per_exit = [(e, setting.exit_shares.get(str(e), 0.0), None) for e in sorted(cert.exits)]
    pred = predict(costs, boundaries, cert.policy, per_exit)
    span = Replicates.of(costs).interval(
        pred.speedup, lambda c: predict(c, boundaries, cert.policy, per_exit).speedup, level
    )
    if span is not None:
        pred = pred.model_copy(update={"interval": span})
    thresholds = {str(k): v for k, v in cert.thresholds().items()}
    return Choice(
        policy=cert.policy, exits=list(cert.exits), thresholds=thresholds, option=None, prediction=pred, best=pred
    )


def plan_manifest(manifest: object, costs: Costs, max_risk: float | None = None) -> Plan:
    """Choose for an artifact (a Manifest) with these costs, from its calibration's menu; the default is the
    fastest of the lossless choices (verify, lookup) and, when the manifest's sequence certificate covers
    `max_risk` (None: its own delta; 0: lossless only), the certified setting."""
    from eectl.contracts.manifest import Manifest

    assert isinstance(manifest, Manifest)
    boundaries = [s.layers[1] for s in manifest.segments]
    cal = manifest.calibration
    options = cal.options if cal is not None else []
    plan = choose(costs, boundaries, options)
    if cal is not None and "verify" in manifest.kv_policies:  # drafts checked by verify's deep pass
        if cal.lookup is not None:
            plan.lookup = choose_lookup(costs, cal.lookup, plan.min_gain, plan.level)
        if cal.ahead is not None:
            plan.ahead = plan_ahead(manifest, costs, cal.ahead, plan.min_gain, plan.level)
        plan.default = lossless_default(plan)
    cert = manifest.certificate
    if cert is not None and cert.covers(max_risk) and cert.policy in manifest.kv_policies:
        plan.certified = choose_certified(costs, boundaries, cert, plan.level)
        c = plan.certified
        if (
            c is not None
            and c.prediction.low() >= 1.0 + plan.min_gain
            and c.prediction.speedup > _default_speedup(plan)
        ):
            plan.default = CERTIFIED
    plan.inexact = wide_inexact(manifest)
    if plan.inexact and plan.default in ("verify", LOOKUP, AHEAD):
        plan.default = "full"
    plan.unresolved = plan.undecided()
    return plan


def wide_inexact(manifest: object) -> str:
    """Why drafts checked in one wide pass are not lossless on this artifact ("" when they are): int4 segments
    whose MatMulNBits compute with int8 activations (accuracy level 4; levels 2-3 compute in half precision) turn
    the last-bit differences between ONNX Runtime's one-position and several-position attention into other tokens
    (measured on the default model at level 4: lookup's tokens differed from int4 full depth on 2 of 3 HumanEval
    prompts). Unless export padded one-row calls (`--exact-wide`, manifest `kv.pad`) and its validation found a
    wide pass equal to one-position steps bit for bit (runtime/wide_check.py)."""
    from eectl.contracts.manifest import Manifest
    from eectl.runtime.wide_check import relies_on_exact_wide

    assert isinstance(manifest, Manifest)
    q = manifest.quantization
    if q is None or not relies_on_exact_wide(manifest):
        return ""
    check = manifest.validation.get("wide_exact") or {}
    if manifest.kv.pad and check.get("exact"):
        return ""
    why = (
        "export's check found a wide pass differing from one-position steps"
        if manifest.kv.pad and check
        else "export with --exact-wide for lossless drafts"
        if not manifest.kv.pad
        else "export's validation did not check them"
    )
    return (
        f"int4 segments at accuracy level {q.accuracy_level} check drafts in wide passes whose numbers differ from "
        f"one-row full depth, so verify and lookup are not lossless here ({why})"
    )


def settled(costs: Costs, plan: Plan) -> bool:
    """Whether timing may stop (plan/costs.py `measure_costs`'s `decided`): at least MIN_BATCHES batches, and
    nothing in `plan` (made from `costs`) undecided."""
    return costs.batch_count() >= MIN_BATCHES and not plan.undecided()


def lossless_default(plan: Plan) -> str:
    """The default among the lossless configurations: verify's choice where its interval clears the line, else full
    depth; then drafts from the context, then verify drafting ahead (plan/ahead.py), each where it is on and the low
    end of its interval is above the best so far.

    The low ends, not the points: near a tie the more certain gain wins, and a tie does not flip with the timing's
    noise (the default model's standard artifact, exported twice: lookup 1.159x [1.132, 1.188] against verify
    1.154x [1.141, 1.167] made lookup the default by its point; on held-out prompts verify ran 1.19x, lookup 1.13x)."""
    verify = plan.choices.get("verify")
    runs_verify = verify is not None and bool(verify.exits) and verify.prediction.low() >= 1.0 + plan.min_gain
    best, low = ("verify", verify.prediction.low()) if runs_verify and verify is not None else ("full", 1.0)
    drafters: tuple[tuple[str, LookupChoice | AheadChoice | None], ...] = ((LOOKUP, plan.lookup), (AHEAD, plan.ahead))
    for name, drafter in drafters:
        if drafter is not None and drafter.on and drafter.prediction.low() > low:
            best, low = name, drafter.prediction.low()
    return best


def _default_speedup(plan: Plan) -> float:
    if plan.default == LOOKUP and plan.lookup is not None:
        return plan.lookup.prediction.speedup
    if plan.default == AHEAD and plan.ahead is not None:
        return plan.ahead.prediction.speedup
    chosen = plan.choices.get(plan.default)
    return chosen.prediction.speedup if chosen is not None and chosen.exits else 1.0


def lossless_pick(plan: Plan, ahead: AheadChoice | None) -> str:
    """Among the plan's lossless default (verify, lookup, full or the plan's own drafter) and this drafter: the
    higher low end of the predicted speedup, the drafter only where it runs (`on`): `lossless_default` with this
    drafter in the plan's place. A certified lossy default stays."""
    if plan.default not in ("full", "verify", LOOKUP, AHEAD):  # a certified lossy setting, the user's risk
        return plan.default
    return lossless_default(plan.model_copy(update={"ahead": ahead}))
