"""Calibration's fit: sequential thresholds on the calibration split replayed on the held-out split, and the menu
of exit subsets (each fitted at the target and at verify's precisions) that export's cost model chooses from.

The statistics (lambda*, Clopper-Pearson, the sequential rule) are eectl.exits.thresholds'; this module turns them into
the calibration file's per-exit and overall numbers.

What this module does not do: measure signals (exits/measure.py) or read and write files.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

import torch

from eectl.contracts.calibration import ExitResult, OverallStats, SplitStats
from eectl.contracts.gates import GATE, Gate
from eectl.contracts.options import POSITION_BLOCK, ExitOption, Option
from eectl.contracts.plan import MAX_SUBSET, VERIFY_PRECISIONS
from eectl.errors import DataError
from eectl.exits.base import passes
from eectl.exits.gates import fit_gate, gate_logits, gate_threshold
from eectl.exits.measure import SOURCES, Measurements
from eectl.exits.thresholds import assign_exits, clopper_pearson_lower, fit_thresholds, min_tokens_for


def _rate(num: int, den: int) -> float | None:
    return num / den if den else None


def evaluate(
    meas: Measurements, thresholds: list[dict[str, float]], mask: torch.Tensor, level: float | None = None
) -> tuple[list[SplitStats], OverallStats]:
    """Replay the sequential rule on the masked tokens: per-exit and overall numbers."""
    taken = assign_exits(meas.values, thresholds)[mask]
    return split_stats(taken, meas.correct[:, mask], meas.exits, meas.num_layers, level)


def split_stats(
    taken: torch.Tensor, correct: torch.Tensor, exits: Sequence[int], L: int, level: float | None = None
) -> tuple[list[SplitStats], OverallStats]:
    """Per-exit and overall numbers of tokens that took these exits (`taken` [N], len(exits) for none) with this
    correctness [E, N]."""
    n, num_exits = int(taken.numel()), len(exits)
    per_exit: list[SplitStats] = []
    hits_all = exited_all = 0
    for e in range(num_exits):
        here = taken == e
        exited, hits = int(here.sum()), int((here & correct[e]).sum())
        hits_all, exited_all = hits_all + hits, exited_all + exited
        bound = None if level is None or not exited else float(clopper_pearson_lower(hits, exited, level))
        per_exit.append(
            SplitStats(
                reached=int((taken >= e).sum()),
                exited=exited,
                coverage=exited / n if n else 0.0,
                precision=_rate(hits, exited),
                lower_bound=bound,
            )
        )
    layers = torch.tensor([*exits, L], dtype=torch.float64)[taken]
    mean_layers = float(layers.mean()) if n else float(L)
    overall = OverallStats(
        tokens=n,
        exited=exited_all,
        exit_rate=exited_all / n if n else 0.0,
        precision=_rate(hits_all, exited_all),
        agreement=(n - exited_all + hits_all) / n if n else 1.0,
        mean_layers=mean_layers,
        speedup_bound=L / mean_layers,
    )
    return per_exit, overall


@dataclass
class Fit:
    thresholds: list[dict[str, float]]
    exits: list[ExitResult]
    calibration: OverallStats
    heldout: OverallStats | None
    heldout_by_source: dict[str, OverallStats]


def fit(
    meas: Measurements,
    target: float,
    confidence: float | None = None,
    holdout: float = 0.2,
    heads: Sequence[int] = (),
) -> Fit:
    """Fit on the calibration split, replay on the held-out split; DataError when the split is too small."""
    held = meas.heldout_mask(holdout)
    calib = ~held
    n_calib = int(calib.sum())
    if n_calib == 0:
        raise DataError("no calibration tokens", hint="raise --tokens")
    need = min_tokens_for(target, confidence) if confidence is not None else 1
    if n_calib < need:
        raise DataError(
            f"data too small for the requested guarantee: precision >= {target} at confidence {confidence} needs "
            f"at least {need} calibration tokens, got {n_calib}",
            hint="raise --tokens, lower --target or --confidence",
        )
    thresholds = fit_thresholds(meas.values, meas.correct, target, confidence, calib)
    cal_exits, cal_overall = evaluate(meas, thresholds, calib, confidence)
    held_exits: list[SplitStats | None] = [None] * len(meas.exits)
    held_overall = None
    by_source: dict[str, OverallStats] = {}
    if bool(held.any()):
        got, held_overall = evaluate(meas, thresholds, held, confidence)
        held_exits = list(got)
        for s, name in enumerate(SOURCES):
            part = held & (meas.source == s)
            if bool(part.any()):
                by_source[name] = evaluate(meas, thresholds, part)[1]
    exits: list[ExitResult] = []
    for e, layer in enumerate(meas.exits):
        thr = thresholds[e]
        note = None
        if all(math.isinf(t) for t in thr.values()):
            reached = cal_exits[e].reached
            if confidence is not None and reached < need:
                note = f"never exits: {reached} tokens reach it, the guarantee needs at least {need}"
            else:
                note = "never exits: no threshold reaches the target"
        exits.append(
            ExitResult(
                layer=layer,
                head=layer in heads,
                thresholds=thr,
                calibration=cal_exits[e],
                heldout=held_exits[e],
                note=note,
            )
        )
    return Fit(thresholds, exits, cal_overall, held_overall, by_source)


MIN_JUDGE_TOKENS = 500  # generated tokens needed to judge the menu on them alone
OPTION_FOLDS = 5  # the menu is judged out of fold: each unit on thresholds fitted without its fold


def options_judge(meas: Measurements) -> torch.Tensor:
    """The tokens the menu's coverage and precision are judged on (each out of fold: `unit_folds`): the GENERATED
    tokens when there are enough (what `eectl run` decodes; teacher-forced text exits several times less often, and
    is right at other rates), else every token."""
    generated = meas.source == SOURCES.index("generated")
    if int(generated.sum()) >= MIN_JUDGE_TOKENS:
        return generated
    return torch.ones(meas.n, dtype=torch.bool)


def unit_folds(meas: Measurements, folds: int = OPTION_FOLDS, seed: int = 0) -> torch.Tensor:
    """[N] long: each token's fold, its unit's (a teacher-forced chunk or a prompt's continuation). Each source's units
    are dealt to the folds in a seeded shuffled order, so a fold is no run of neighbouring units (a dataset's order
    can run from easy items to hard ones) and each fold holds about as many units of each source."""
    fold = torch.zeros(meas.n, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    for s in range(len(SOURCES)):
        mine = meas.source == s
        units = torch.unique(meas.unit[mine])
        if not units.numel():
            continue
        shuffled = units[torch.randperm(units.numel(), generator=g)]
        lookup = torch.zeros(int(units.max()) + 1, dtype=torch.long)
        lookup[shuffled] = torch.arange(units.numel()) % folds
        fold[mine] = lookup[meas.unit[mine]]
    return fold


# one fold's fit, given its training tokens: per token [N] the exit taken (E' for none), the correctness [E', N] the
# run fitted so would see, and (gated) the gates' verdicts [E', N]
Fitted = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def out_of_fold(fit_one: Callable[[torch.Tensor], Fitted], folds: torch.Tensor) -> Fitted:
    """Each token's exit, correctness and gates as fitted without its fold (`fit_one(training mask)` per fold): the
    menu's numbers on every unit, none judged on thresholds fitted on itself. One fold: fitted on everything."""
    k = int(folds.max()) + 1
    if k < 2:
        return fit_one(torch.ones_like(folds, dtype=torch.bool))
    taken = correct = ok = None
    for f in range(k):
        mine = folds == f
        t, c, g = fit_one(~mine)
        taken = t.clone() if taken is None else torch.where(mine, t, taken)
        correct = c.clone() if correct is None else torch.where(mine, c, correct)
        if g is not None:
            ok = g.clone() if ok is None else torch.where(mine, g, ok)
    assert taken is not None and correct is not None
    return taken, correct, ok


def fit_gates(
    meas: Measurements, target: float, confidence: float | None, holdout: float
) -> tuple[dict[int, Gate], Measurements]:
    """Each exit's gate (eectl.exits.gates), fitted on the calibration split's kept states (`meas.hidden`), labelled
    "this exit alone passes the token" (its own candidates, its one-exit thresholds at the target; where it never
    passes, "its top-1 agrees with the final layer"); and `meas` with the gates' logits (`gate_logits`) and without
    the states."""
    assert meas.hidden is not None, "gates need the exits' states: measure with keep_states"
    calib = ~meas.heldout_mask(holdout)
    gates: dict[int, Gate] = {}
    logits = []
    for i, layer in enumerate(meas.exits):
        one = meas.restrict([layer])
        values = {c: v[0] for c, v in one.values.items()}
        thr = fit_thresholds(one.values, one.correct, target, confidence, calib)[0]
        label = one.correct[0] if all(math.isinf(t) for t in thr.values()) else passes(values, thr)
        gate = fit_gate(meas.hidden[i][calib], label[calib])
        gates[layer] = gate
        logits.append(gate_logits(meas.hidden[i], *gate.arrays()))
    return gates, replace(meas, hidden=None, gate_logits=torch.stack(logits))


def fit_options(
    meas: Measurements,
    target: float,
    confidence: float | None,
    holdout: float,
    max_subset: int = MAX_SUBSET,
    gate_keep: float | None = None,
) -> list[Option]:
    """The menu for the cost model (plan/choose.py): every subset of up to `max_subset` exits, fitted sequentially on
    the calibration split at the fidelity target (kind "target", with `confidence`) and at each of verify's precisions
    (kind "verify", point estimates: verify is lossless, its threshold only trades drafts for rollbacks): those are
    the thresholds a run uses. Its coverage and precision per exit are judged on `options_judge`'s tokens of every
    unit, out of fold (`out_of_fold`: each unit on the same procedure fitted without its fold, OPTION_FOLDS folds of
    units): a held-out split of a few prompts judged the menu on those few alone, and a run's prompts can exit and be
    right at quite other rates (measured: precision 0.88 on the 5 held-out prompts of 24, 0.70 over all 24). Options
    where an exit never exits are left out (a smaller subset without it is on the menu and is cheaper).

    With gates (`meas.gate_logits` and `gate_keep`), every option also comes gated (`_gated_option`): the cost
    model weighs the decisions a gate skips against the exits it loses."""
    from itertools import combinations

    calib = ~meas.heldout_mask(holdout)
    judge = options_judge(meas)
    folds = unit_folds(meas)
    fits: list[tuple[str, float, float | None]] = [("target", target, confidence)]
    fits += [("verify", q, None) for q in VERIFY_PRECISIONS]
    gated = meas.gate_logits is not None and gate_keep is not None and gate_keep > 0
    out: list[Option] = []
    for size in range(1, min(max_subset, len(meas.exits)) + 1):
        for subset in combinations(meas.exits, size):
            sub = meas.restrict(subset)
            for kind, q, level in fits:
                thresholds = fit_thresholds(sub.values, sub.correct, q, level, calib)
                if any(all(math.isinf(v) for v in t.values()) for t in thresholds):
                    continue

                judged = out_of_fold(partial(_ungated_fit, sub, q, level), folds)
                out.append(_option(meas, list(subset), kind, q, level, thresholds, judge, judged))
                if gated:
                    assert gate_keep is not None
                    option = _gated_option(meas, list(subset), kind, q, level, calib, judge, folds, gate_keep)
                    if option is not None:
                        out.append(option)
    return out


def _ungated_fit(sub: Measurements, q: float, level: float | None, train: torch.Tensor) -> Fitted:
    """The sequential thresholds fitted on the `train` tokens, replayed on every token."""
    taken = assign_exits(sub.values, fit_thresholds(sub.values, sub.correct, q, level, train))
    return taken, sub.correct, None


def _option(
    meas: Measurements,
    subset: list[int],
    kind: str,
    q: float,
    level: float | None,
    thresholds: list[dict[str, float]],
    judge: torch.Tensor,
    judged: Fitted,
    gammas: list[float] | None = None,
) -> Option:
    """An option with the thresholds a run uses (`thresholds`, and the gates' `gammas` recorded beside the
    criteria's), judged on the `judge` tokens by `judged` (each token's exit, correctness and gates, out of fold):
    each exit's coverage and precision, and with gates the share of those tokens whose decision runs there
    (`decided`) and, of those, picks the candidates there (`picked`); the counts per unit besides."""
    taken, correct, gate_ok = (None if x is None else x[..., judge] for x in judged)
    assert taken is not None and correct is not None
    n = max(1, int(judge.sum()))
    recorded = thresholds if gammas is None else [{**t, GATE: g} for t, g in zip(thresholds, gammas, strict=True)]
    stats, overall = split_stats(taken, correct, subset, meas.num_layers)
    # per exit, the judged tokens' flags: exited, exited and right, and (gated) decided there, picked there
    flags: list[torch.Tensor] = []
    before = torch.zeros_like(taken, dtype=torch.bool)
    per_exit = []
    for i, (layer, t, st) in enumerate(zip(subset, recorded, stats, strict=True)):
        runs = picks = torch.zeros_like(before)
        if gate_ok is not None:
            runs = (taken >= i) & gate_ok[i]
            picks = runs & ~before
            before = before | gate_ok[i]
        flags += [taken == i, (taken == i) & correct[i], runs, picks]
        per_exit.append(
            ExitOption(
                layer=layer,
                thresholds=t,
                coverage=st.coverage,
                precision=st.precision,
                decided=None if gate_ok is None else int(runs.sum()) / n,
                picked=None if gate_ok is None else int(picks.sum()) / n,
            )
        )
    return Option(
        exits=subset,
        kind=kind,
        target=q,
        confidence=level,
        per_exit=per_exit,
        agreement=overall.agreement,
        units=Option.units_text(unit_counts(meas.source[judge] * (int(meas.unit.max()) + 1) + meas.unit[judge], flags)),
        blocks=Option.units_text(unit_counts(meas.positions()[judge] // POSITION_BLOCK, flags)),
    )


def unit_counts(unit: torch.Tensor, flags: list[torch.Tensor]) -> list[list[int]]:
    """Per distinct id in `unit` [N] (in ascending order): [tokens, then each flag's count] of its tokens."""
    ids, index = torch.unique(unit, return_inverse=True)
    cols = [torch.ones_like(unit), *(f.long() for f in flags)]
    counts = torch.zeros((ids.numel(), len(cols)), dtype=torch.long)
    for j, c in enumerate(cols):
        counts[:, j].index_add_(0, index, c)
    return counts.tolist()


def _gated_option(
    meas: Measurements,
    subset: list[int],
    kind: str,
    q: float,
    level: float | None,
    calib: torch.Tensor,
    judge: torch.Tensor,
    folds: torch.Tensor,
    keep: float,
) -> Option | None:
    """The option with gates: each exit's gate threshold keeps `keep` of the training tokens the ungated option's
    decision passes there; the thresholds are then refitted on what the gated run sees (candidates picked at the
    first exit whose gate passes: `Measurements.restrict(gate_ok=...)`), so the option's precision is the gated
    run's. Fitted so on the calibration split for the run, and per fold for judging it. None when an exit then
    never exits."""
    assert meas.gate_logits is not None
    logits = meas.gate_logits[[meas.exits.index(e) for e in subset]]  # [E', N]
    plain = meas.restrict(subset)

    def gated(train: torch.Tensor) -> tuple[list[dict[str, float]], list[float], Measurements, torch.Tensor]:
        taken = assign_exits(plain.values, fit_thresholds(plain.values, plain.correct, q, level, train))
        gammas = [gate_threshold(logits[i][train & (taken == i)], keep) for i in range(len(subset))]
        gate_ok = torch.stack([logits[i] >= g for i, g in enumerate(gammas)])
        sub = meas.restrict(subset, gate_ok)
        return fit_thresholds(sub.values, sub.correct, q, level, train), gammas, sub, gate_ok

    thresholds, gammas, _, _ = gated(calib)
    if any(all(math.isinf(v) for v in t.values()) for t in thresholds):
        return None

    def fold_fit(train: torch.Tensor) -> Fitted:
        thr, _, sub, gate_ok = gated(train)
        return assign_exits(sub.values, thr), sub.correct, gate_ok

    return _option(meas, subset, kind, q, level, thresholds, judge, out_of_fold(fold_fit, folds), gammas)
