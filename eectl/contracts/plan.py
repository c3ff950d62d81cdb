"""The plan's types: calibrated options, measured costs, predictions and the chosen plan (the manifest's
`plan` and `costs`; the calibration file's `options`).

What this module does not do: predict or choose (eectl.plan.choose) or measure (eectl.plan.costs).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from eectl.contracts.certificate import CERTIFIED
from eectl.contracts.options import Option

MIN_GAIN = 0.03  # the low end of a configuration's predicted speedup must be >= 1 + MIN_GAIN for it to be chosen


LEVEL = 0.90  # the predicted speedup's interval: 5th to 95th percentile of the bootstrap replicates


RESAMPLES = 200  # bootstrap replicates of the costs (the percentiles move by < 0.005x between seeds at 200)


# timing batches (plan/costs.py) a plan needs before export or `--profile-costs` call it decided: the interval over
# batches (plan/choose.py) knows the batch-to-batch spread only from several, and two give t(1) = 6.3 standard errors
MIN_BATCHES = 3


INTERVAL_TOP = 8  # per policy, the options with the highest point estimates get an interval (the rest cannot win)
# verify's drafts from the context (runtime/drafts.py): drafts per step by default, and the most a run may ask
DEFAULT_DRAFTS = 12
MAX_DRAFTS = 64
MAX_NGRAM = 5  # the longest suffix of the context matched (measured: runtime/drafts.py)
DRAFT_MEMORY = 32_768  # earlier answers' tokens searched for drafts where a run has them (runtime/drafts.py)
MAX_DRAFT_NGRAM = 32
LOOKUP = "lookup"  # the plan's name for full depth with drafts from the context (a default beside the policies)
AHEAD = "ahead"  # the plan's name for verify drafting ahead at one exit (runtime/ahead.py; a default beside them)


PLAN_POLICIES = ("copy", "defer", "verify")


# predicted (bench's check of the model) but never planned: like copy, the river's approximate K/V change later
# tokens in a way calibration does not measure. `river-exit` is the river predicting at the exit.
RIVER_EXIT = "river-exit"  # the river policy predicting at the exit instead of the river's end (a run option)
RIVER_POLICIES = ("river", RIVER_EXIT)


MAX_SUBSET = 3  # exits per option: each active exit adds a decision, and subsets grow as 2^E


VERIFY_BLOCK = 8  # verify: at most this many drafts wait unchecked; then a forced full-depth pass checks them
VERIFY_PRECISIONS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)  # verify's speed knob: thresholds fitted at these


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


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
    # the certified head (export/certified_head.py), one row, and the share of export validation's final states it
    # did not pass (those run the full head too); None: the artifact has none
    certified_head_ms: float | None = None
    certified_miss: float | None = None
    # rows (a wide pass's positions, 2 and more) -> the full head as verify's check runs it over them, and the
    # certified head; empty: not timed (the full head then costs one more row's extra each, the certified head as one)
    head_rows_ms: dict[str, float] = Field(default_factory=dict)
    certified_rows_ms: dict[str, float] = Field(default_factory=dict)
    # bytes of segment weights kept resident when these were timed (run/bench --memory-budget: the slow tier's
    # segments timed cold, reading their weights from the file as a run does); None: every segment resident
    memory_budget: int | None = None
    candidates_ms: dict[str, float]  # exit layer -> the candidate source + signal, one token (first active exit)
    local_ms: dict[str, float]  # exit layer -> the local K-row exit + signal, one token (later active exits)
    full_step_ms: float  # one full-depth decode step through the runner (all of the above + Python)
    # full depth as the runner runs it when no exit is active (runtime/chain.py: every call bound once), the
    # baseline a configuration must beat; None (artifacts before the chain, or no chain): full_step_ms
    chain_step_ms: float | None = None
    # exit layer -> its block head's graph on one position (block exits only): paid by every token reaching the exit
    block_ms: dict[str, float] = Field(default_factory=dict)
    # exit layer -> its gate's test on one state (eectl.exits.gates, host arithmetic right after the segment): paid by
    # every
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
    # one-row exit steps run on the bound chain (runtime/chain.py), the decisions above timed as it makes them (in
    # the exit graphs, or on the host for signals they do not compute): a step pays the chain's per-call overhead, a
    # token that meets pending positions (defer's and verify's flush) included (wide calls). False: costs timed
    # before 2026-12-05, when exit steps ran per call (a path since deleted): they are priced as they were timed
    bound_exits: bool = False
    # each timed figure above by its path (`full_step_ms`, `segment_ms.2`, `candidates_ms.8`), its milliseconds in
    # every timing round, rounds aligned across graphs (round r of every graph ran in the same pass): each figure is
    # the median of its list. What the predicted speedups' intervals are resampled from (`resamples`). None:
    # artifacts exported before the intervals (medians only), planned as exact
    samples_ms: dict[str, list[float]] | None = None
    # pass width (positions) -> a full-depth pass over that many positions on the bound chain: a step carrying
    # drafts from the context (runtime/drafts.py), its drafts embedded first. Empty: costs timed before them
    wide_ms: dict[str, float] = Field(default_factory=dict)
    # the wide passes were timed with the full head (a deterministic call: the certified head's pass or miss on the
    # timing's random contexts is not decode's), and `wide_head_ms` swaps decode's greedy head in for it. False:
    # timed with the certified head (older artifacts), used as timed
    wide_full_head: bool = False
    # rounds per timing batch: the rounds were timed in passes of this many (plan/costs.py), batch b holding rounds
    # b*n to (b+1)*n - 1, and the plan's intervals are over batches (plan/choose.py). None: costs timed before
    # batches, their rounds resampled one by one
    batch_rounds: int | None = None
    seconds: float | None = None  # the timing's wall time, re-timing included (None: not recorded)

    def rounds(self) -> int:
        return min((len(v) for v in self.samples_ms.values()), default=0) if self.samples_ms else 0

    def batch_count(self) -> int:
        """Full timing batches (one for costs timed before batches)."""
        r = self.rounds()
        return r // self.batch_rounds if self.batch_rounds else min(r, 1)

    def batches(self) -> list[Costs]:
        """Each full timing batch's costs, in the order timed: every figure the median of that batch's rounds.
        [] with fewer than two batches."""
        n, b = self.batch_rounds, self.batch_count()
        if not n or b < 2 or not self.samples_ms:
            return []
        keys = sorted(self.samples_ms)
        times = np.array([self.samples_ms[k][: b * n] for k in keys]).reshape(len(keys), b, n)  # [G, B, n]
        medians = np.median(times, axis=2)  # [G, B]
        return [self.with_values(dict(zip(keys, medians[:, i].tolist(), strict=True))) for i in range(b)]

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
        """A full-depth token as `eectl run` decodes it with no exit active: what every speedup is against (both
        steps are timed with the full head; the certified head, where there is one, in its place: `head_ms`)."""
        step = self.chain_step_ms if self.chain_step_ms is not None else self.full_step_ms
        return step + self.head_ms() - self.final_head_ms

    def head_ms(self) -> float:
        """The greedy final head as the chain runs it: the certified head, and the full head where it misses."""
        return self.greedy_head_ms(1)

    def greedy_head_ms(self, rows: int) -> float:
        """The greedy final head over `rows` rows as decode runs it (one row: the chain's; several: verify's check of
        drafts): the certified head, and the full head over every row where any row misses (each row missing
        independently at `certified_miss`); the full head alone where the artifact has no certified head."""
        full = self.full_head_ms(rows)
        if self.certified_head_ms is None:
            return full
        miss = 1.0 if self.certified_miss is None else self.certified_miss
        certified = _rows_ms(self.certified_head_ms, self.certified_rows_ms, rows, 0.0)
        return certified + (1.0 - (1.0 - miss) ** rows) * full

    def full_head_ms(self, rows: int) -> float:
        """The full head's greedy token over `rows` rows (the table packed for several): timed at a wide pass's
        widths where it was (`head_rows_ms`, interpolated), else one more row's extra each."""
        return _rows_ms(self.final_head_ms, self.head_rows_ms, rows, self.final_head_extra_ms)

    def wide_head_ms(self, rows: int) -> float:
        """What `wide_ms` at `rows` positions holds beyond decode's greedy head: 0 where the wide passes were timed
        with it, else the full head's cost over decode's (`wide_full_head`)."""
        return self.full_head_ms(rows) - self.greedy_head_ms(rows) if self.wide_full_head else 0.0

    def overhead_per_segment(self, bound: bool = False) -> float:
        """The runner's per-step cost outside the timed graphs, spread over the segment calls: as costs timed before
        the chain took exit steps priced it (per call), or (`bound`) on the bound chain."""
        parts = self.embed_ms + sum(self.segment_ms) + self.final_head_ms
        step = self.baseline_ms() if bound else self.full_step_ms
        return max(0.0, step - parts) / max(1, len(self.segment_ms))


def piecewise(points: dict[int, float], at: Sequence[int]) -> list[float]:
    """Timings at counts (rows, positions) `points`, read at each of `at`: linear between them, beyond the largest
    its last slope, below the smallest the smallest's (sorted once for all of `at`)."""
    known = sorted(points.items())
    xs, ys = [x for x, _ in known], [y for _, y in known]
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
    return [float(np.interp(x, xs, ys)) if x <= xs[-1] else ys[-1] + slope * (x - xs[-1]) for x in at]


def _rows_ms(one: float, timed: dict[str, float], rows: int, extra: float) -> float:
    """A head's ms over `rows` rows: `one` at one row, `piecewise` over the row counts `timed`; without timings,
    `extra` per row beyond the first."""
    if not timed:
        return one + (rows - 1) * extra
    return piecewise({1: one, **{int(r): v for r, v in timed.items()}}, [rows])[0]


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
    # where `interval` also spans what the calibration sample leaves open (which units it holds: plan/intervals.py),
    # the timing's own interval: what more timing could narrow (None: `interval` is the timing's alone)
    timing: tuple[float, float] | None = None

    def timing_span(self) -> tuple[float, float]:
        """The interval more timing could narrow (the point where none was computed)."""
        return self.timing if self.timing is not None else (self.low(), self.high())

    def straddles(self, line: float) -> bool:
        """Whether more timing could move this prediction across `line`: its timing interval straddles it."""
        lo, hi = self.timing_span()
        return lo < line <= hi

    def low(self) -> float:
        return self.interval[0] if self.interval is not None else self.speedup

    def high(self) -> float:
        return self.interval[1] if self.interval is not None else self.speedup

    def describe(self) -> str:
        """`1.06x [1.04, 1.08]`, or `1.06x (point estimate: no cost spread)`."""
        if self.interval is None:
            return f"{self.speedup:.3f}x (point estimate: no cost spread recorded)"
        return f"{self.speedup:.3f}x [{self.interval[0]:.3f}, {self.interval[1]:.3f}]"


class LookupStats(_M):
    """Drafts from the context replayed on calibration's greedy full-depth continuations (runtime/drafts.py
    `replay`): the steps verify with those drafts takes to emit them, exactly (its output is those continuations)."""

    max_draft: int
    max_ngram: int
    prompts: int
    tokens: int  # decode tokens (each continuation's first token comes from the prefill)
    steps: dict[str, int]  # pass width (positions) -> decode steps of that width (1: no drafts)
    drafted: int
    accepted: int
    # each prompt's own (decode tokens, steps by width), in order: what the plan's interval over prompts resamples
    # (empty in calibration files written before it: the interval is then the costs' timing alone)
    per_prompt: list[tuple[int, dict[str, int]]] = Field(default_factory=list)
    min_draft: int = 1  # runs shorter than this were not proposed (runtime/drafts.py `PromptLookup.min_draft`)
    # the same replay with other run lengths: longer shortest runs (min_draft 2, 3, ...) and shorter longest runs
    # (max_draft 4, 8: runtime/drafts.py LONGEST_RUNS); the plan prices each against the costs and keeps the fastest
    shortest: list[LookupStats] = Field(default_factory=list)
    # the same replay on the continuations cut at shorter lengths (CUT_LENGTHS), ascending: what a run of that
    # --max-new-tokens takes (`at_length`; none in calibration files written before them)
    cuts: list[LookupStats] = Field(default_factory=list)
    length: int = 0  # a cut's length in generated tokens (0: the continuations as calibration generated them)

    def per_token(self) -> float:
        """Tokens emitted per decode step."""
        n = sum(self.steps.values())
        return self.tokens / n if n else 1.0

    @staticmethod
    def pool(prompts: Sequence[tuple[int, dict[str, int]]]) -> tuple[int, dict[str, int]]:
        """Prompts' (decode tokens, steps by width) added up."""
        steps: dict[str, int] = {}
        for _, by_width in prompts:
            for w, k in by_width.items():
                steps[w] = steps.get(w, 0) + k
        return sum(n for n, _ in prompts), steps

    def at_length(self, tokens: int) -> LookupStats:
        """The stats of a run that generates at most `tokens` tokens (its --max-new-tokens): the longest cut no
        longer than that (the shortest where none is), else these. Drafts from the context pay more the longer an
        answer runs (the default model, 24 GSM8K prompts: 1.08 tokens a step over 16 tokens, 1.19 over 32, 1.28 over
        64, 1.42 over 128), so a run between two cuts is priced at the shorter: on the safe side."""
        if not self.cuts or tokens >= max((n + 1 for n, _ in self.per_prompt), default=0):
            return self
        fit = [c for c in self.cuts if c.length <= tokens]
        cut = fit[-1] if fit else self.cuts[0]
        return cut.model_copy(update={"shortest": [s.at_length(tokens) for s in self.shortest]})

    def of_prompts(self, picks: Sequence[int]) -> LookupStats:
        """The stats of the prompts at these indices of `per_prompt` (repeats count again: a bootstrap resample)."""
        tokens, steps = self.pool([self.per_prompt[i] for i in picks])
        update = {"prompts": len(picks), "tokens": tokens, "steps": steps, "per_prompt": [], "shortest": [], "cuts": []}
        return self.model_copy(update=update)


class LookupChoice(_M):
    """The plan's verdict on drafts from the context at full depth (`eectl run --prompt-drafts`)."""

    drafts: int  # drafts per step (RunConfig.prompt_drafts) when on
    prediction: Prediction  # policy "lookup": full depth with the drafts, priced by plan/choose.py predict_lookup
    on: bool  # the prediction's interval clears the plan's line
    tokens_per_step: float  # on calibration's continuations
    min_draft: int = 1  # the shortest run of drafts proposed (RunConfig.draft_min): the fastest the costs allow


class AheadChoice(_M):
    """The plan's verdict on verify drafting ahead (plan/ahead.py, runtime/ahead.py): the exit that drafts, the bound
    on the product of its top-1 probabilities, the prediction on calibration's answers; `on` where its interval's low
    end clears the plan's line. `drafts`, `accepted`: per check pass, the mean drafts and kept drafts;
    `by_position[m]`: of the cycles that drafted m + 1 or more, the share that kept draft m + 1."""

    exit: int  # an exit that ends a segment before the final layer and has no block head (checked with the manifest)
    bound: float = Field(gt=0.0, le=1.0)  # RunConfig.draft_ahead
    prediction: Prediction
    on: bool
    drafts: float = 0.0
    accepted: float = 0.0
    by_position: list[float] = Field(default_factory=list)

    def describe(self) -> str:
        state = "on" if self.on else "off (below the line)"
        return (
            f"drafts ahead at exit {self.exit}, bound {self.bound}: {self.prediction.describe()} predicted, {state}; "
            f"{self.drafts:.2f} drafts and {self.accepted:.2f} kept per check"
        )


class Choice(_M):
    policy: str
    exits: list[int]  # [] = full depth
    thresholds: dict[str, dict[str, float]]  # exit layer (str, JSON keys) -> criterion -> threshold
    option: Option | None
    prediction: Prediction  # of what runs: the option, or full depth when no option pays
    best: Prediction | None = None  # the best option's prediction, chosen or not
    # an option's interval still straddled the line (its low end below, its high end at or above it, and above the
    # chosen option's low end): more timing could change this choice. It runs what cleared the line (full depth
    # when nothing did): the conservative side
    undecided: bool = False


class Plan(_M):
    """What export (or `eectl run --profile-costs`) chose, per policy, and the default configuration."""

    default: str  # a lossless policy name (verify), "full", LOOKUP (full depth with drafts from the context), or
    # CERTIFIED (a lossy setting, only with a sequence certificate: `certified` below)
    min_gain: float = MIN_GAIN
    choices: dict[str, Choice] = Field(default_factory=dict)  # policy -> its best option (full depth if none pays)
    lookup: LookupChoice | None = None  # drafts from the context (None: not measured at calibration or export)
    ahead: AheadChoice | None = None  # verify drafting ahead (None: not traced at calibration, or no exit can draft)
    level: float = LEVEL  # the predictions' intervals (plans before them: their point estimates decided)
    # the sequence certificate's setting (calibrate --guarantee sequence), priced with its measured exit shares;
    # None without a certificate that covers the user's risk
    certified: Choice | None = None
    # what the costs left undecided when the plan was made (`undecided()`: policies, LOOKUP, CERTIFIED): the timing
    # budget ran out with an interval still straddling the line, and each runs its conservative choice
    unresolved: list[str] = Field(default_factory=list)
    # why a wide pass (drafts checked together) may give other tokens than one-row full depth on this artifact, so
    # that no draft configuration is lossless and none is the default ("": wide and one-row passes agree)
    inexact: str = ""
    # the answers' length the plan was priced for (plan/length.py: a run's --max-new-tokens); None: calibration's
    # continuations', as export made it
    tokens: int | None = None

    def default_for(self, batch_size: int) -> str:
        """The default `eectl run` follows at this batch size: the plan prices one row, so a batch runs full depth
        (the default model at 16 rows: lookup 0.54x, verify 0.80x batched full depth)."""
        return self.default if batch_size <= 1 else "full"

    def batch_note(self, batch_size: int) -> str:
        """Why a batch of this size does not follow the default, in words ("" where it does)."""
        if self.default_for(batch_size) == self.default:
            return ""
        return f"the default ({self.default}) is priced for one row; a batch of {batch_size} runs full depth"

    def line(self) -> str:
        """The rule, in words: `the low end of its 90% interval >= 1.03x`."""
        return f"the low end of its {self.level:.0%} interval >= {1 + self.min_gain:.2f}x full depth"

    def summary(self) -> str:
        """One line for run and bench."""
        priced = "" if self.tokens is None else f"; priced for answers of up to {self.tokens} tokens"
        return self._chosen() + priced + self._unresolved_note()

    def _unresolved_note(self) -> str:
        if not self.unresolved:
            return ""
        return (
            f"; undecided at the line when the timing budget ran out: {', '.join(self.unresolved)} "
            "(each runs only what cleared it)"
        )

    def _chosen(self) -> str:
        if self.default == LOOKUP and self.lookup is not None:
            return (
                f"plan: full depth with up to {self.lookup.drafts} drafts per step from the context (lossless), "
                f"predicted {self.lookup.prediction.describe()} full depth ({self.level:.0%} interval over "
                f"calibration's prompts and the costs' timing; "
                f"{self.lookup.tokens_per_step:.2f} tokens per step on calibration's answers)"
            )
        if self.default == AHEAD and self.ahead is not None:
            a = self.ahead
            return (
                f"plan: verify drafting ahead at exit {a.exit} while the product of its top-1 probabilities stays >= "
                f"{a.bound} (lossless), predicted {a.prediction.describe()} full depth ({self.level:.0%} interval over "
                f"calibration's prompts and the costs' timing; {a.drafts:.2f} drafts and {a.accepted:.2f} kept per "
                "check on calibration's answers)"
            )
        if self.default == CERTIFIED and self.certified is not None:
            c = self.certified
            return (
                f"plan: {c.policy} at exits {c.exits} as certified (its sequence certificate), predicted "
                f"{c.prediction.describe()} full depth ({self.level:.0%} interval)"
            )
        if self.default == "full" and self.inexact:
            return f"plan: full depth: {self.inexact}"
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
        """What more timing could change: the policies whose choice is undecided (`Choice.undecided`), and drafts
        from the context or the certified setting when their interval straddles the line."""
        line = 1.0 + self.min_gain
        out = [p for p, c in self.choices.items() if c.undecided]
        for name, pred in (
            (LOOKUP, None if self.lookup is None else self.lookup.prediction),
            (AHEAD, None if self.ahead is None else self.ahead.prediction),
            (CERTIFIED, None if self.certified is None else self.certified.prediction),
        ):
            if pred is not None and pred.straddles(line):
                out.append(name)
        return out

    def ahead_problem(self, exit_layers: Sequence[int], block_exits: Sequence[int]) -> str | None:
        """Why the drafter's entry cannot run on an artifact with these exits (before the final layer, each ending a
        segment) and these block-head exits, in one line naming the field; None where it can (or there is none)."""
        a = self.ahead
        if a is None:
            return "plan.default is ahead, but plan.ahead holds no entry" if self.default == AHEAD else None
        if a.exit not in exit_layers:
            return f"plan.ahead.exit {a.exit} is no exit ending a segment before the final layer {list(exit_layers)}"
        if a.exit in block_exits:
            return f"plan.ahead.exit {a.exit} has a block head (a drafting exit has none)"
        return None


def plan_drafts(plan: Plan | None) -> int:
    """The drafts per step from the context a run proposes without --prompt-drafts: the plan's lookup entry's (the
    run length its costs price fastest), else DEFAULT_DRAFTS."""
    return plan.lookup.drafts if plan is not None and plan.lookup is not None else DEFAULT_DRAFTS
