"""Exits chosen by what they save: a cost model of one decode step, and the choice of active exits per policy.

Inputs are two measurements of the artifact, both model-agnostic:
- the calibrated **options** (calibrate_fit.py): for a subset of exits and a precision target, the per-exit thresholds
  and the held-out share of all tokens that exit at each exit (`coverage`) and their agreement with the final layer
  (`precision`): what a run with exactly those exits active sees (Top-K candidates picked at the subset's first exit);
- the measured **costs** (costs.py): milliseconds per graph call on the runner's provider and thread count.

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
    verify:       a wrong draft (1 - precision_i) is rolled back with the drafts after it (r / (1 - r) of them on
                  average, r = the exit rate): time per accepted token = time per step / (1 - lost tokens per step)

The choice maximises predicted speed: for copy and defer over the options fitted at the fidelity target, for
verify (lossless) over the options fitted at any precision of a grid (there the threshold is a speed knob). `copy` is
never the default: its approximate K/V change later tokens in a way calibration does not measure.

A configuration is activated only when the LOW end of its predicted speedup's 90% interval clears 1 + MIN_GAIN;
otherwise the policy runs at full depth. The interval comes from the costs' per-round samples (`Costs.samples_ms`):
a paired bootstrap over timing rounds. A replicate draws R rounds with replacement out of the R measured, takes
each graph's median over them (as the point estimate does over all rounds) and predicts again; the interval is the
5th-95th percentile of the replicates' speedups. Resampling whole rounds keeps what one round shares (the load of
the moment falls on every graph timed in it, the full step included), so it cancels in a speedup as it does in the
point estimate, and only the round-to-round disagreement widens the interval. The replicates are drawn with a
fixed seed: the same costs always give the same plan. Costs without samples (artifacts exported before the
intervals) are taken as exact: the interval is the point, and the choice is the point estimate's, as it was.

What this module does not do: measure (costs.py, calibrate.py) or run anything; it is pure arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

MIN_GAIN = 0.03  # the low end of a configuration's predicted speedup must be >= 1 + MIN_GAIN for it to be chosen
LEVEL = 0.90  # the predicted speedup's interval: 5th to 95th percentile of the bootstrap replicates
RESAMPLES = 200  # bootstrap replicates of the costs (the percentiles move by < 0.005x between seeds at 200)
INTERVAL_TOP = 8  # per policy, the options with the highest point estimates get an interval (the rest cannot win)
PLAN_POLICIES = ("copy", "defer", "verify")
# predicted (bench's check of the model) but never planned: like copy, the river's approximate K/V change later
# tokens in a way calibration does not measure. `river-exit` is the river predicting at the exit.
RIVER_POLICIES = ("river", "river-exit")
# policies whose one-row greedy exit steps run on the bound chain (runtime/chain.py): an exited token needs only its
# state; the river's int4 copies run per call
BOUND_POLICIES = ("defer", "verify", "copy")
MAX_SUBSET = 3  # exits per option: each active exit adds a decision, and subsets grow as 2^E
VERIFY_PRECISIONS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)  # verify's speed knob: thresholds fitted at these


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ExitOption(_M):
    layer: int
    thresholds: dict[str, float]  # criterion -> exit when value >= it
    coverage: float  # held-out share of ALL tokens that exit here
    precision: float | None  # held-out agreement with the final top-1 among them (None: none exited)
    # gated options (thresholds hold a "gate": eectl.gates): held-out share of ALL tokens whose decision runs here,
    # and of those, the share that picks the candidates here (no earlier gate passed). None: ungated, every token
    # reaching the exit decides there, the first exit picking
    decided: float | None = None
    picked: float | None = None


class Option(_M):
    """One calibrated configuration: these exits active, with thresholds fitted at `target`."""

    exits: list[int]
    kind: str  # "target": fitted at the calibration's fidelity target (copy, defer); "verify": a speed knob
    target: float
    confidence: float | None
    per_exit: list[ExitOption]
    agreement: float  # held-out agreement over all tokens (exit or not)

    @property
    def exit_rate(self) -> float:
        return sum(x.coverage for x in self.per_exit)

    def thresholds(self) -> dict[int, dict[str, float]]:
        return {x.layer: dict(x.thresholds) for x in self.per_exit}

    @property
    def gated(self) -> bool:
        return any(x.decided is not None for x in self.per_exit)


class Costs(_M):
    """Milliseconds per call, medians of short repeated runs at decode shape (one token, `past` positions)."""

    provider: str
    threads: int
    past: int  # KV positions already in the cache when timed
    repeats: int
    embed_ms: float
    segment_ms: list[float]  # per segment: one position
    segment_extra_ms: list[float]  # per segment: one more position (two minus one)
    kv_ms: list[float]  # per segment: its K/V-only graph on one position (copy)
    final_head_ms: float  # the exact full LM head at the final layer, one row
    final_head_extra_ms: float  # one more row (verify checks drafts there)
    candidates_ms: dict[str, float]  # exit layer -> the candidate source + signal, one token (first active exit)
    local_ms: dict[str, float]  # exit layer -> the local K-row exit + signal, one token (later active exits)
    full_step_ms: float  # one full-depth decode step through the runner (all of the above + Python)
    # full depth as the runner runs it when no exit is active (runtime/chain.py: every call bound once), the
    # baseline a configuration must beat; None (artifacts before the chain, or no chain): full_step_ms
    chain_step_ms: float | None = None
    # exit layer -> its block head's graph on one position (block exits only): paid by every token reaching the exit
    block_ms: dict[str, float] = Field(default_factory=dict)
    # exit layer -> its gate's test on one state (eectl.gates, host arithmetic right after the segment): paid by every
    # token reaching a gated exit. Empty: costs timed before gates (their gates then cost nothing here)
    gate_ms: dict[str, float] = Field(default_factory=dict)
    candidate_source: str = "full"
    # river artifacts (`export --river`): per segment its int4 copy on one position (None: no copy), and the final
    # head the river's end asks (its quantized copy where the artifact has one)
    river_ms: list[float | None] | None = None
    river_head_ms: float | None = None
    # signals that decide without an LM head (cosine): exit layer -> the exit's full head, which an exiting token's
    # own prediction then costs (None: the decision already carries the prediction, e.g. Top-K candidates)
    exit_predict_ms: dict[str, float] | None = None
    # one-row greedy exit steps run on the bound chain (runtime/chain.py) and the decisions above were timed there:
    # a step pays the chain's per-call overhead, a token that meets pending positions (defer's and verify's flush)
    # included (wide calls). False: every exit step pays the general path (older artifacts)
    bound_exits: bool = False
    # each timed figure above by its path (`full_step_ms`, `segment_ms.2`, `candidates_ms.8`), its milliseconds in
    # every timing round, rounds aligned across graphs (round r of every graph ran in the same pass): each figure is
    # the median of its list. What the predicted speedups' intervals are resampled from (`resamples`). None:
    # artifacts exported before the intervals (medians only), planned as exact
    samples_ms: dict[str, list[float]] | None = None

    def rounds(self) -> int:
        return min((len(v) for v in self.samples_ms.values()), default=0) if self.samples_ms else 0

    def with_values(self, values: dict[str, float]) -> Costs:
        """A copy with the figures at these paths replaced (the samples shared, not copied)."""
        update: dict[str, object] = {}
        for path, v in values.items():
            name, _, key = path.partition(".")
            if not key:
                update[name] = v
                continue
            held = update.get(name)
            if held is None:
                old = getattr(self, name)
                held = list(old) if isinstance(old, list) else dict(old)
                update[name] = held
            if isinstance(held, list):
                held[int(key)] = v
            else:
                assert isinstance(held, dict)
                held[key] = v
        return self.model_copy(update=update)

    def resamples(self, n: int = RESAMPLES, seed: int = 0) -> list[Costs]:
        """`n` bootstrap replicates: each redraws the timing rounds with replacement (whole rounds, every graph
        together) and takes each figure's median over them. [] without samples."""
        if not self.samples_ms or self.rounds() < 2:
            return []
        keys = sorted(self.samples_ms)
        r = self.rounds()
        times = np.array([self.samples_ms[k][:r] for k in keys])  # [G, R]
        draws = np.random.default_rng(seed).integers(0, r, size=(n, r))  # [n, R]: one row of rounds per replicate
        medians = np.median(times[:, draws], axis=2)  # [G, n]
        return [self.with_values(dict(zip(keys, medians[:, b].tolist(), strict=True))) for b in range(n)]

    def block_layers(self, num_layers: int) -> dict[str, float]:
        """Each block head's measured cost per token in decoder-layer units (its ms over a segment layer's mean)."""
        per_layer = sum(self.segment_ms) / max(1, num_layers)
        return {k: round(v / per_layer, 3) for k, v in self.block_ms.items()} if per_layer > 0 else {}

    def baseline_ms(self) -> float:
        """A full-depth token as `eectl run` decodes it with no exit active: what every speedup is against."""
        return self.chain_step_ms if self.chain_step_ms is not None else self.full_step_ms

    def overhead_per_segment(self, bound: bool = False) -> float:
        """The runner's per-step cost outside the timed graphs, spread over the segment calls: on the general path,
        or (`bound`) on the bound chain."""
        parts = self.embed_ms + sum(self.segment_ms) + self.final_head_ms
        step = self.baseline_ms() if bound else self.full_step_ms
        return max(0.0, step - parts) / max(1, len(self.segment_ms))


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


class Prediction(_M):
    policy: str
    exits: list[int]
    ms_per_token: float
    full_ms: float
    speedup: float  # full_ms / ms_per_token
    decision_ms: float  # expected decision time per token
    exit_rate: float
    lost_per_step: float = 0.0  # verify: tokens rolled back per step
    # the speedup's LEVEL interval (bootstrap over the costs' timing rounds); None: not computed, or costs without
    # samples (then the point is all there is)
    interval: tuple[float, float] | None = None

    def low(self) -> float:
        return self.interval[0] if self.interval is not None else self.speedup

    def high(self) -> float:
        return self.interval[1] if self.interval is not None else self.speedup

    def describe(self) -> str:
        """`1.06x [1.04, 1.08]`, or `1.06x (point estimate: no cost spread)`."""
        if self.interval is None:
            return f"{self.speedup:.3f}x (point estimate: no cost spread recorded)"
        return f"{self.speedup:.3f}x [{self.interval[0]:.3f}, {self.interval[1]:.3f}]"


class Choice(_M):
    policy: str
    exits: list[int]  # [] = full depth
    thresholds: dict[str, dict[str, float]]  # exit layer (str, JSON keys) -> criterion -> threshold
    option: Option | None
    prediction: Prediction  # of what runs: the option, or full depth when no option pays
    best: Prediction | None = None  # the best option's prediction, chosen or not


class Plan(_M):
    """What export (or `eectl run --profile-costs`) chose, per policy, and the default configuration."""

    default: str  # a policy name, or "full"
    min_gain: float = MIN_GAIN
    choices: dict[str, Choice] = Field(default_factory=dict)  # policy -> its best option (full depth if none pays)
    level: float = LEVEL  # the predictions' intervals (plans before them: their point estimates decided)

    def line(self) -> str:
        """The rule, in words: `the low end of its 90% interval >= 1.03x`."""
        return f"the low end of its {self.level:.0%} interval >= {1 + self.min_gain:.2f}x full depth"

    def summary(self) -> str:
        """One line for run and bench."""
        if self.default == "full":
            bests = [c.best for p, c in self.choices.items() if c.best is not None and p != "copy"]
            top = max(bests, key=lambda b: b.speedup, default=None)
            tail = f" (best: {top.policy} at exits {top.exits}, {top.describe()})" if top is not None else ""
            return f"plan: no exit configuration has {self.line()}{tail}; the default is full depth"
        c = self.choices[self.default]
        gated = " (gated)" if c.option is not None and c.option.gated else ""
        return (
            f"plan: {c.policy} at exits {c.exits}{gated}, predicted {c.prediction.describe()} full depth "
            f"({self.level:.0%} interval; decisions {c.prediction.decision_ms:.2f} ms/token)"
        )

    def undecided(self) -> list[str]:
        """Policies whose choice more timing could change: none chosen, yet the best option's interval reaches
        the line (its high end >= 1 + min_gain while its low end is below)."""
        return [
            p
            for p, c in self.choices.items()
            if not c.exits and c.best is not None and c.best.high() >= 1.0 + self.min_gain
        ]


def _river_ms(costs: Costs, segment: int) -> float:
    ms = None if costs.river_ms is None else costs.river_ms[segment]
    if ms is None:
        raise ValueError(f"no river timing for segment {segment}: the costs were measured without river copies")
    return ms


def _segment_of(boundaries: Sequence[int], layer: int) -> int:
    """Index of the segment that ends at `layer` (boundaries: each segment's end layer, in order)."""
    return list(boundaries).index(layer)


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
    bound = costs.bound_exits and policy in BOUND_POLICIES
    over = costs.overhead_per_segment(bound)
    # a token that passes every exit: the general per-call path, plus its decisions; on the bound chain, the
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
    n_seg = len(boundaries)
    step = decision
    rate = 0.0
    for layer, cov, _ in per_exit:
        s = _segment_of(boundaries, layer)
        paid = costs.embed_ms + sum(costs.segment_ms[: s + 1]) + over * (s + 1)
        if costs.exit_predict_ms is not None and policy != "river":  # the river's end predicts instead
            paid += costs.exit_predict_ms[str(layer)]
        later = range(s + 1, n_seg)
        if policy == "copy":
            paid += sum(costs.kv_ms[t] for t in later) + over * len(later)
        elif policy in RIVER_POLICIES:  # the exited token flows on through the int4 copies
            paid += sum(_river_ms(costs, t) for t in later) + over * len(later)
            if policy == "river":
                paid += costs.river_head_ms if costs.river_head_ms is not None else costs.final_head_ms
        else:  # defer, verify: the exited state rides along with a later step through every later segment
            paid += sum(costs.segment_extra_ms[t] for t in later)
            if policy == "verify":
                paid += costs.final_head_extra_ms
        step += cov * paid
        rate += cov
    step += max(0.0, 1.0 - rate) * full
    lost = 0.0
    if policy == "verify":
        if lost_rate is not None:
            lost = lost_rate
        else:
            chain = 1.0 + (rate / (1.0 - rate) if rate < 1.0 else 0.0)
            lost = sum(cov * (1.0 - (p if p is not None else 1.0)) for _, cov, p in per_exit) * chain
        lost = min(lost, 0.95)
    per_token = step / (1.0 - lost)
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
    pred: Prediction, replicates: Sequence[Costs], boundaries: Sequence[int], option: Option, level: float = LEVEL
) -> Prediction:
    """`pred` with its speedup's interval over the cost replicates (`Costs.resamples`); unchanged without them."""
    if not replicates:
        return pred
    speedups = [predict_option(c, boundaries, pred.policy, option).speedup for c in replicates]
    tail = (1.0 - level) / 2
    lo, hi = np.quantile(speedups, [tail, 1.0 - tail])
    return pred.model_copy(update={"interval": (round(float(lo), 4), round(float(hi), 4))})


def choose(
    costs: Costs,
    boundaries: Sequence[int],
    options: Sequence[Option],
    min_gain: float = MIN_GAIN,
    level: float = LEVEL,
) -> Plan:
    """Per policy, the fastest predicted option among those whose speedup's interval clears 1 + min_gain at its
    low end (full depth when none does), and the default: the faster of defer and verify, or full depth."""
    replicates = costs.resamples()
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
        # intervals for the top few by point estimate only (each costs RESAMPLES predictions): an option further
        # down would need a much narrower interval than all of those for its low end alone to clear the line
        top = [(with_interval(p, replicates, boundaries, o, level), o) for p, o in ranked[:INTERVAL_TOP]]
        clear = [(p, o) for p, o in top if p.low() >= 1.0 + min_gain]
        best: tuple[Prediction, Option] | None = max(clear or top, key=lambda po: po[0].speedup, default=None)
        if clear and best is not None:
            pred, opt = best
            thresholds = {str(k): v for k, v in opt.thresholds().items()}
            choices[policy] = Choice(
                policy=policy, exits=opt.exits, thresholds=thresholds, option=opt, prediction=pred, best=pred
            )
        else:
            choices[policy] = Choice(
                policy=policy,
                exits=[],
                thresholds={},
                option=None,
                prediction=predict(costs, boundaries, policy, []),
                best=None if best is None else best[0],
            )
    active = [p for p in ("defer", "verify") if choices[p].exits]
    default = max(active, key=lambda p: choices[p].prediction.speedup) if active else "full"
    return Plan(default=default, min_gain=min_gain, choices=choices, level=level)


def plan_manifest(manifest: object, costs: Costs) -> Plan:
    """Choose for an artifact (a Manifest) with these costs, from its calibration's menu."""
    from eectl.manifest import Manifest

    assert isinstance(manifest, Manifest)
    boundaries = [s.layers[1] for s in manifest.segments]
    options = manifest.calibration.options if manifest.calibration is not None else []
    return choose(costs, boundaries, options)
