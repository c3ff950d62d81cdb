"""bench's reported speed intervals (issue #29): the interval a reading uses, widened by the run's A/A reach, and
compared artifacts run on mirrored runtimes. Synthetic timing streams driven through the real timed phase and the
bench's own statistic; no clocks, no models."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

from eectl.evaluate import bench
from eectl.evaluate.results import AA, BenchOptions
from eectl.evaluate.stats import ratio_estimate, speed_reading, widened
from eectl.evaluate.timing import _Run, _timed
from tests.test_bench_stats import _machine

NAMES = ["full", AA, "copy", "defer", "verify"]  # copy and defer identical to full depth; verify 1.25x faster


class _Sim:
    """timing.Configurations on a simulated clock, with what bench._result reads of Configs. A step of `name` on
    `instance` costs costs[name] ms x the machine's slowdown at that moment (bursts, warm-up drift) x `position`'s
    factor for (name, instance) x a carry-over (a step right after verify's costs 4% more: an order effect) x 3%
    jitter."""

    def __init__(self, costs, tokens, slowdown, rng, reps, stepped=True, instances=1, position=None):
        self.opts = BenchOptions(configs=list(costs), reps=reps)
        self.costs, self.tokens, self.slowdown, self.rng = costs, tokens, slowdown, rng
        self.stepped, self.instances = stepped, instances
        self.position = position or (lambda name, instance: 1.0)
        self.now, self.last = 0.0, ""
        self.configs: dict = {}
        self.peers: dict = {}  # Configs' --peer runtimes: none here
        self.rt = types.SimpleNamespace(manifest=types.SimpleNamespace(num_layers=30))
        self.ran: list[tuple[str, int]] = []
        self.forgot: list[int] = []  # the runs before each `forget_prompts` call

    def forget_prompts(self):
        self.forgot.append(len(self.ran))

    def steps(self, name):
        return self.stepped

    def tick(self, n):
        pass

    def once(self, name, prompt_ids, on_step=None, instance=0):
        self.ran.append((name, instance))
        self.now += 0.1  # the settle pause, or the hand-over between threads
        lat = []
        for _ in range(self.tokens):
            carry = 1.04 if self.last == "verify" and name != "verify" else 1.0
            dt = self.costs[name] / 1000 * self.slowdown(self.now) * carry * self.position(name, instance)
            dt *= self.rng.lognormal(0, 0.03)
            self.now += dt
            lat.append(dt)
            self.last = name
            if on_step is not None:
                on_step(0, [])
        s = sum(lat)
        n = self.tokens
        return _Run(lat, [0.01], [[0] * n], [30] * n, 0.0, decode_tokens=n, decode_wall_s=s, per_prompt=[(s, n)])


def _bench_rows(configs, reps, prompts=5):
    """The timed phase and the bench's rows (speed columns, verdict, readings) of a simulated run."""
    t = _timed(configs, list(configs.costs), [[1]] * prompts, range(reps), None)
    verdict, resolution, _ = bench._noise(t)
    rows = {n: bench._result(n, t, configs, None, None, verdict) for n in configs.costs}
    bench._readings(list(rows.values()), verdict, resolution)
    return t, verdict, resolution, rows


def _excludes_one(ci):
    return ci is not None and not ci[0] <= 1.0 <= ci[1]


def test_an_identical_configurations_reported_interval_never_excludes_one_under_load():
    """The main job's budget (5 prompts x 32 tokens x 2 repetitions, configurations taking turns step by step) under
    bursts of other work (0.5-3 s at 1.6-2x, 30-50% duty), a warm-up drift (+30% decaying over 20 s) and an order
    effect (a step after verify's costs 4% more): the paired bootstrap interval of copy or defer (both identical to
    full depth) excludes 1.0 in several conclusive runs, as in the loaded runs of docs/results/2026-12-03-bench.md,
    and the old bench reported exactly that interval; the reported interval now is the one the reading uses (widened
    by the A/A reach), so it never excludes 1.0 for them, excludes it exactly when the reading says faster or
    slower, and verify (1.25x) still reads faster."""
    costs = {n: 30.0 for n in NAMES} | {"verify": 24.0}
    sampling_wrong = conclusive = 0
    for seed in range(6):
        slowdown = _machine(np.random.default_rng(seed), 600.0, drift=0.3)
        configs = _Sim(costs, 32, slowdown, np.random.default_rng(seed + 100), 2)
        t, verdict, resolution, rows = _bench_rows(configs, 2)
        if verdict != "conclusive":
            continue
        conclusive += 1
        base = t.array("full") + t.array(AA)
        for name in ("copy", "defer"):
            _, sampling = bench._paired(base, t.array(name))  # what the old bench reported as the interval
            sampling_wrong += _excludes_one(sampling)
            assert not _excludes_one(rows[name].speedup_vs_full_ci), (seed, name, rows[name].speedup_vs_full_ci)
            assert rows[name].reading.startswith("no difference"), (seed, name, rows[name].reading)
        for name in ("copy", "defer", "verify"):
            r = rows[name]
            assert _excludes_one(r.speedup_vs_full_ci) == (r.reading in ("faster", "slower")), (seed, name)
            assert r.speedup_vs_full_ci == pytest.approx(
                (r.speedup_vs_full_sampling_ci[0] - resolution, r.speedup_vs_full_sampling_ci[1] + resolution)
            )
        assert rows["verify"].reading == "faster", seed
        assert rows[AA].speedup_vs_full_ci == rows[AA].speedup_vs_full_sampling_ci  # the A/A row: its own
    assert conclusive >= 5
    assert sampling_wrong >= 2, sampling_wrong  # the old reported interval excluded 1.0 for identical ones


def test_the_widened_interval_excludes_one_exactly_when_the_reading_says_faster_or_slower():
    assert widened((0.972, 0.996), 0.023) == pytest.approx((0.949, 1.019))
    assert widened((0.98, 1.01), None) == (0.98, 1.01) and widened(None, 0.01) is None
    assert widened((0.98, 1.01), math.inf) == (0.98, 1.01)  # no finite reach: the raw interval
    rng = np.random.default_rng(0)
    for _ in range(2000):
        lo = float(rng.uniform(0.9, 1.1))
        ci = (lo, lo + float(rng.uniform(0, 0.05)))
        res = round(float(rng.uniform(0, 0.03)), 4)
        wide = widened(ci, res)
        assert wide is not None
        assert (not wide[0] <= 1.0 <= wide[1]) == (speed_reading(ci, res) in ("faster", "slower")), (ci, res)


def test_the_report_and_the_verdict_show_the_widened_interval_and_say_what_it_is():
    from eectl.evaluate.report import markdown, summary
    from eectl.evaluate.results import BenchResult, ConfigResult
    from eectl.pipeline.verdict import _buys

    def row(name, speed, ci, sampling, reading=""):
        return ConfigResult(
            name, 30.0, (29.0, 31.0), 33.3, 33.3, 10.0, 100.0, speedup_vs_full=speed, speedup_vs_full_ci=ci,
            speedup_vs_full_sampling_ci=sampling, verdict="conclusive", reading=reading,
        )  # fmt: skip

    def result(resolution, copy_ci):
        rows = [
            row("full", 1.0, None, None),
            row(AA, 1.007, (0.977, 1.017), (0.977, 1.017)),
            row("copy", 0.984, copy_ci, (0.972, 0.996), f"no difference beyond +-{0.023:.1%}"),
        ]
        return BenchResult(
            "art", "m", "cpu", 2, 5, 32, 2, 1, "learned", [], {}, rows, [], None, default="copy",
            verdict="conclusive", resolution=resolution,
        )  # fmt: skip

    wide = result(0.023, (0.949, 1.019))
    md, console = markdown(wide, {}), summary(wide)
    for text in (md, console):
        assert "vs full [95% CI +- A/A reach]" in text and "0.98x [0.95, 1.02]" in text
        assert "0.98x [0.97, 1.00]" not in text  # the sampling interval is not the reported one
    assert "widened on both sides by the A/A control's reach from 1 (this run: +-2.3%" in md
    assert "`speedup_vs_full_sampling_ci`" in md and "1.01x [0.98, 1.02]" in md  # the A/A row: its own
    raw = result(None, (0.972, 0.996))
    assert "not widened by an A/A reach" in markdown(raw, {}) and "vs full [95% CI]" in summary(raw)
    doc = wide.to_dict()
    line = _buys(doc)
    assert line.startswith("buys: the default (copy) 0.98x [0.95, 1.02] full depth") and "widened by the A/A" in line


def _positions(compared):
    """(artifact, instance) -> creation position, from the order Configs creates runtimes in."""
    from eectl.evaluate.configs import creation_order

    return {key: k for k, key in enumerate(creation_order(compared))}


@pytest.mark.parametrize(("prompts", "reps"), [(5, 2), (3, 1)])
def test_mirrored_runtimes_cancel_a_creation_order_effect_on_a_compared_aa_pair(prompts, reps):
    """A runtime created at position k steps (1 + 0.05 k) times slower (the issue's 1.05x per position, direction
    immaterial). `same` is the artifact compared with itself (an A/A pair of runtimes): with one instance each (the
    old scheme: full at position 0, same at 1) bench's statistic reads it 1.05x apart; with mirrored instances
    alternating block by block (full 0 and 3, same 1 and 2) it reads 1 within 0.01, also when the blocks split
    unevenly between the instances (3 blocks: 2 and 1)."""
    costs = {"full": 30.0, AA: 30.0, "same": 30.0}
    read = {}
    for instances in (1, 2):
        pos = _positions(["same"] if instances == 2 else [])
        pos.setdefault(("same", 0), 1)  # the old scheme: one compared runtime, created after the artifact's
        configs = _Sim(
            costs, 32, lambda now: 1.0, np.random.default_rng(0), reps, stepped=False, instances=instances,
            position=lambda name, i, pos=pos: 1 + 0.05 * pos["same" if name == "same" else "full", i],
        )  # fmt: skip
        t, _, _, rows = _bench_rows(configs, reps, prompts)
        read[instances] = rows["same"].speedup_vs_full
        assert rows[AA].speedup_vs_full == pytest.approx(1.0, abs=0.02)
        if instances == 2:  # every block: all configurations on one instance, alternating block by block
            assert t.instances == [[(r + b) % 2 for b in range(prompts)] for r in range(reps)]
            ran = [i for _, i in configs.ran[3 * 2 :]]  # after the warm-up (each configuration on each instance)
            assert ran == [t.instances[r][b] for r in range(reps) for b in range(prompts) for _ in range(3)]
            base = t.array("full")[..., :2] + t.array(AA)[..., :2]
            naive = ratio_estimate(bench.block_ratios(base, t.array("same")[..., :2]))
    assert read[1] == pytest.approx(1 / 1.05, abs=0.01)  # the old scheme: the creation order's 1.05x
    assert read[2] == pytest.approx(1.0, abs=0.01)
    if prompts * reps % 2:  # an odd number of blocks: one median of all falls on one instance's side
        assert abs(naive - 1.0) > 0.03


def test_every_repetition_meets_its_prompts_for_the_first_time():
    """The runners forget their cached prompts at the start of every repetition (after the warm-up too), so a
    repetition's first token is not timed on a prompt its runner still holds from the last repetition."""
    sim = _Sim({n: 10.0 for n in NAMES}, 4, lambda t: 1.0, np.random.default_rng(0), 3)
    _timed(sim, NAMES, [[1]] * 2, range(3), None)
    warm = len(NAMES)  # one warm-up prompt per configuration
    per_rep = len(NAMES) * 2  # every configuration on each of the 2 blocks
    assert sim.forgot == [warm + r * per_rep for r in range(3)]
