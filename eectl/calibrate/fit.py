"""Calibration's fit: sequential thresholds on the calibration split replayed on the held-out split, and the menu
of exit subsets (each fitted at the target and at verify's precisions) that export's cost model chooses from.

The statistics (lambda*, Clopper-Pearson, the sequential rule) are eectl.exits.thresholds'; this module turns them into
the calibration file's per-exit and overall numbers.

What this module does not do: measure signals (exits/measure.py) or read and write files.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from eectl.contracts.calibration import ExitResult, OverallStats, SplitStats
from eectl.contracts.gates import GATE, Gate
from eectl.contracts.plan import MAX_SUBSET, VERIFY_PRECISIONS, ExitOption, Option
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
    correct = meas.correct[:, mask]
    n, num_exits, L = int(mask.sum()), len(meas.exits), meas.num_layers
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
    layers = torch.tensor([*meas.exits, L], dtype=torch.float64)[taken]
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


MIN_JUDGE_TOKENS = 500  # held-out generated tokens needed to judge the menu on them alone


def options_judge(meas: Measurements, holdout: float) -> torch.Tensor:
    """The tokens the menu's coverage is measured on: the held-out GENERATED tokens when there are enough (what
    `eectl run` decodes; teacher-forced text exits several times less often), else all held-out tokens, else all."""
    held = meas.heldout_mask(holdout)
    generated = held & (meas.source == SOURCES.index("generated"))
    if int(generated.sum()) >= MIN_JUDGE_TOKENS:
        return generated
    return held if bool(held.any()) else ~held


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
    (kind "verify", point estimates: verify is lossless, its threshold only trades drafts for rollbacks), with the
    coverage and precision per exit on `options_judge`'s tokens. Options where an exit never exits are left out
    (a smaller subset without it is on the menu and is cheaper).

    With gates (`meas.gate_logits` and `gate_keep`), every option also comes gated (`_gated_option`): the cost
    model weighs the decisions a gate skips against the exits it loses."""
    from itertools import combinations

    held = meas.heldout_mask(holdout)
    calib = ~held
    judge = options_judge(meas, holdout)
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
                out.append(_option(sub, list(subset), kind, q, level, thresholds, judge))
                if gated:
                    assert gate_keep is not None
                    option = _gated_option(meas, list(subset), kind, q, level, thresholds, calib, judge, gate_keep)
                    if option is not None:
                        out.append(option)
    return out


def _option(
    sub: Measurements,
    subset: list[int],
    kind: str,
    q: float,
    level: float | None,
    thresholds: list[dict[str, float]],
    judge: torch.Tensor,
    gate_ok: torch.Tensor | None = None,
    gammas: list[float] | None = None,
) -> Option:
    """An option as evaluated on the judged tokens; with `gate_ok` [E', N] (the gates' thresholds `gammas`, recorded
    beside the criteria's), each exit's share of those tokens whose decision runs there (`decided`) and, of those,
    picks the candidates there (`picked`)."""
    per_exit, overall = evaluate(sub, thresholds, judge)
    recorded = thresholds if gammas is None else [{**t, GATE: g} for t, g in zip(thresholds, gammas, strict=True)]
    decided: list[float | None] = [None] * len(subset)
    picked: list[float | None] = [None] * len(subset)
    taken = assign_exits(sub.values, thresholds)[judge]
    correct = sub.correct[:, judge]
    n = max(1, int(judge.sum()))
    # per exit, the judged tokens' flags whose counts per unit the option records: exited, exited and right, and
    # (gated) decided there, picked there
    flags: list[torch.Tensor] = []
    before = torch.zeros_like(taken, dtype=torch.bool)
    for i in range(len(subset)):
        runs = picks = torch.zeros_like(before)
        if gate_ok is not None:
            ok = gate_ok[i, judge]
            runs = (taken >= i) & ok
            picks = runs & ~before
            decided[i], picked[i] = int(runs.sum()) / n, int(picks.sum()) / n
            before = before | ok
        flags += [taken == i, (taken == i) & correct[i], runs, picks]
    return Option(
        exits=subset,
        kind=kind,
        target=q,
        confidence=level,
        per_exit=[
            ExitOption(
                layer=layer,
                thresholds=t,
                coverage=st.coverage,
                precision=st.precision,
                decided=d,
                picked=p,
            )
            for layer, t, st, d, p in zip(subset, recorded, per_exit, decided, picked, strict=True)
        ],
        agreement=overall.agreement,
        units=unit_counts(sub.source[judge] * (int(sub.unit.max()) + 1) + sub.unit[judge], flags),
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
    ungated: list[dict[str, float]],
    calib: torch.Tensor,
    judge: torch.Tensor,
    keep: float,
) -> Option | None:
    """The option with gates: each exit's gate threshold keeps `keep` of the calibration tokens the ungated
    option's decision passes there; the thresholds are then refitted on what the gated run sees (candidates picked at
    the first exit whose gate passes: `Measurements.restrict(gate_ok=...)`), so the option's precision is the gated
    run's. None when an exit then never exits."""
    assert meas.gate_logits is not None
    logits = meas.gate_logits[[meas.exits.index(e) for e in subset]]  # [E', N]
    taken = assign_exits(meas.restrict(subset).values, ungated)
    gammas = [gate_threshold(logits[i][calib & (taken == i)], keep) for i in range(len(subset))]
    gate_ok = torch.stack([logits[i] >= g for i, g in enumerate(gammas)])
    sub = meas.restrict(subset, gate_ok)
    thresholds = fit_thresholds(sub.values, sub.correct, q, level, calib)
    if any(all(math.isinf(v) for v in t.values()) for t in thresholds):
        return None
    return _option(sub, subset, kind, q, level, thresholds, judge, gate_ok, gammas)
