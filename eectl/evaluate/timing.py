"""The bench's timed phase: the block schedule (every configuration on one block of prompts before the next), the
configurations of a block stepped in turn (one decode step each, round after round), under --compare the runtime
instance all configurations of a block run on (alternating block by block: `block_instance`), the runs it records,
the other processes' CPU load, and the noise gate on the A/A control.

What this module does not do: build the configurations or summarise them (bench.py), or compute statistics
(stats.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from eectl.evaluate.results import AA, BenchOptions
from eectl.evaluate.stats import (
    AA_BAND,
    balanced_orders,
    block_ratios,
    noise_verdict,
    per_prompt_totals,
    ratio_ci,
    seconds_per_token,
)


def _rss_mb() -> float:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        import os

        return pages * os.sysconf("SC_PAGE_SIZE") / 1e6
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Configurations(Protocol):
    """What the timed phase runs (configs.Configs): one configuration over some prompts, and progress."""

    opts: BenchOptions
    instances: int  # instances of every configuration: 1, or 2 under --compare (configs.Configs: mirrored runtimes)

    def once(
        self, name: str, prompt_ids: list[list[int]], on_step: OnStep | None = None, instance: int = 0
    ) -> _Run: ...

    def steps(self, name: str) -> bool:
        """Whether `name` calls `on_step` after each decode step, so it can take turns with the others (`_turns`)."""
        ...

    def tick(self, n: int) -> None: ...

    def forget_prompts(self) -> None:
        """Every runner feeds its next prompts whole (`Runner.forget_prompts`)."""
        ...


OnStep = Callable[[int, list[int]], None]  # Runner.generate's on_step(prompt index, confirmed tokens)


@dataclass
class _Run:
    latencies: list[float]  # decode latencies (first token excluded), seconds
    ttfts: list[float]
    generations: list[list[int]]
    exit_layers: list[int]
    decide_s: float
    drafted: int = 0
    rejected: int = 0
    prompt_drafted: int = 0  # drafts from the context (runtime/drafts.py) and those accepted
    prompt_accepted: int = 0
    decode_tokens: int = 0  # over all rows
    decode_wall_s: float = 0.0  # wall time of the decode steps (a batch's rows share each step)
    decided: dict[int, int] = field(default_factory=dict)  # exit layer -> decisions run there (gates skip some)
    picked: dict[int, int] = field(default_factory=dict)  # exit layer -> decisions that picked candidates there
    per_prompt: list[tuple[float, int]] = field(default_factory=list)  # (decode seconds, decode tokens) per prompt

    def add(self, other: _Run) -> None:
        """Append another block's run of the same configuration (prompts stay in order)."""
        self.latencies += other.latencies
        self.ttfts += other.ttfts
        self.generations += other.generations
        self.exit_layers += other.exit_layers
        self.decide_s += other.decide_s
        self.drafted += other.drafted
        self.rejected += other.rejected
        self.prompt_drafted += other.prompt_drafted
        self.prompt_accepted += other.prompt_accepted
        self.decode_tokens += other.decode_tokens
        self.decode_wall_s += other.decode_wall_s
        for mine, theirs in ((self.decided, other.decided), (self.picked, other.picked)):
            for layer, n in theirs.items():
                mine[layer] = mine.get(layer, 0) + n
        self.per_prompt += other.per_prompt


def _gate_reps(reps: int) -> int:
    """The most repetitions the noise gate adds (NOISE_BUDGET of the first phase's time, one repetition each)."""
    return int(NOISE_BUDGET * reps)


# Pause before each timed configuration: the previous one's worker threads (ORT's spinning pool, torch's OpenMP
# threads after `hf`) keep spinning for a while after their last call, and whoever runs next would pay for it.
SETTLE_S = 0.1


NOISE_BUDGET = 1.0  # the noise gate may spend up to this share of the timed phase again on more repetitions


def block_schedule(order: list[str], blocks: int, reps: range) -> list[tuple[int, int, list[str]]]:
    """(repetition, block, configuration order) in run order: every configuration runs on block b of repetition r
    before any runs on the next block, so a configuration and the baseline it is compared with ran seconds apart.
    The orders are a Williams design's, in turn over the blocks (each configuration in every position and after
    every other equally often over a cycle of len(balanced_orders(order)) blocks)."""
    orders = balanced_orders(order)
    out = []
    for r in reps:
        for b in range(blocks):
            out.append((r, b, orders[(r * blocks + b) % len(orders)]))
    return out


@dataclass
class _Timing:
    """What the timed phase measured: per configuration its runs (one _Run per repetition, blocks in prompt order)
    and per (repetition, block) its decode seconds, tokens and wall time [R, B, 3]; RSS after its runs."""

    runs: dict[str, list[_Run]]
    blocks: dict[str, list[list[tuple[float, int, float]]]]
    rss: dict[str, float]
    load: list[float] = field(default_factory=list)  # other processes' CPU use (cores) during each timed repetition
    # per repetition, per block: the instance every configuration ran it on (`block_instance`)
    instances: list[list[int]] = field(default_factory=list)
    paired_instances: bool = False  # whether the configurations alternated between two instances (--compare)
    warmup_s: float = 0.0  # the warm-up before the first repetition (one prompt per configuration and instance)

    def array(self, name: str) -> np.ndarray:
        return np.array(self.blocks[name], dtype=np.float64)

    def strata(self) -> np.ndarray | None:
        """[R, B] instance indices for the paired statistic (stats.ratio_ci), None with one instance."""
        return np.array(self.instances, dtype=np.int64) if self.paired_instances else None


def block_instance(rep: int, block: int, instances: int) -> int:
    """The instance every configuration runs (repetition, block) on: alternating block by block, and shifted by one
    each repetition, so with two instances every block of prompts runs on both over two repetitions."""
    return (rep + block) % instances


def _cpu_ticks() -> tuple[int, int, int] | None:
    """(all CPU ticks, busy ticks, this process's ticks) from /proc; None where /proc is not there."""
    try:
        cpu = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        mine = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    idle = cpu[3] + (cpu[4] if len(cpu) > 4 else 0)
    return sum(cpu), sum(cpu) - idle, int(mine[11]) + int(mine[12])  # utime + stime


def _other_load(before: tuple[int, int, int] | None, after: tuple[int, int, int] | None) -> float | None:
    """Cores other processes kept busy on average between two readings."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    cores = os.cpu_count() or 1
    others = (after[1] - before[1]) - (after[2] - before[2])
    return max(0.0, cores * others / (after[0] - before[0]))


def _timed(
    configs: Configurations,
    order: list[str],
    ids: list[list[int]],
    reps: range,
    log: Any,
    timing: _Timing | None = None,
) -> _Timing:
    """Repetitions `reps` over blocks of prompts (a batch each; one prompt at batch size 1), every configuration on a
    block before the next block (`block_schedule`); a warm-up of one prompt each first when starting fresh."""
    b = configs.opts.batch_size
    block_ids = [ids[i : i + b] for i in range(0, len(ids), b)]
    if timing is None:
        t0 = time.perf_counter()
        for instance in range(configs.instances):
            for name in order:
                configs.once(name, ids[:1], instance=instance)
        timing = _Timing({n: [] for n in order}, {n: [] for n in order}, {}, paired_instances=configs.instances > 1)
        timing.warmup_s = time.perf_counter() - t0
        if log is not None:
            log.log(
                f"warm-up, then {len(reps)} repetitions of {', '.join(order)}, interleaved on each of "
                f"{len(block_ids)} block(s) of {b} prompt(s){_stepped_note(configs, order)}"
                + (f", alternating between {configs.instances} runtime instances" if configs.instances > 1 else "")
            )
    rep_start: dict[int, tuple[int, int, int] | None] = {}
    for r, blk, names in block_schedule(order, len(block_ids), reps):
        if blk == 0:
            configs.forget_prompts()  # a repetition meets its prompts for the first time, as a run of them does
            rep_start[r] = _cpu_ticks()
            for name in order:
                timing.runs[name].append(_Run([], [], [], [], 0.0))
                timing.blocks[name].append([])
            timing.instances.append([])
        instance = block_instance(r, blk, configs.instances)
        timing.instances[-1].append(instance)
        for unit in _units(configs, names):
            time.sleep(SETTLE_S)
            done = (
                _turns(configs, unit, block_ids[blk], instance)
                if len(unit) > 1
                else {unit[0]: configs.once(unit[0], block_ids[blk], instance=instance)}
            )
            for name in unit:
                run = done[name]
                timing.runs[name][-1].add(run)
                timing.blocks[name][-1].append(
                    (sum(s for s, _ in run.per_prompt), run.decode_tokens, run.decode_wall_s)
                )
                timing.rss[name] = _rss_mb()
        if blk == len(block_ids) - 1:
            load = _other_load(rep_start[r], _cpu_ticks())
            if load is not None:
                timing.load.append(load)
            if log is not None:
                ms = {n: 1000 * seconds_per_token(per_prompt_totals([timing.runs[n][-1].per_prompt])) for n in order}
                extra = f" (other processes: {load:.2f} cores)" if load is not None else ""
                log.log(f"  rep {r + 1}{extra}: " + ", ".join(f"{n} {v:.1f}" for n, v in ms.items()) + " ms/token")
    return timing


def _units(configs: Configurations, names: list[str]) -> list[list[str]]:
    """A block's run order as units: the configurations that step (`Configurations.steps`) take turns as one unit,
    at the position of the first of them; each other configuration (transformers' `hf`) runs alone at its own."""
    stepped = [n for n in names if configs.steps(n)]
    units: list[list[str]] = []
    for n in names:
        if n not in stepped:
            units.append([n])
        elif n == stepped[0]:
            units.append(stepped)
    return units


def _stepped_note(configs: Configurations, order: list[str]) -> str:
    stepped = [n for n in order if configs.steps(n)]
    return f", {', '.join(stepped)} taking turns step by step" if len(stepped) > 1 else ""


class _Turns:
    """One configuration's decode runs at a time; after each decode step it hands the turn to the next live one.

    Each configuration generates in a thread of its own, but only the thread whose turn it is runs: a burst of other
    work on the machine then falls on every configuration's steps alike (they lie milliseconds apart), instead of on
    whichever ran its whole block at that moment. A step's latency is measured inside Runner.generate before
    `on_step` runs, so the waiting here is in no configuration's time."""

    def __init__(self, order: list[str]) -> None:
        self.live = list(order)
        self.turn: str | None = order[0]
        self.cond = threading.Condition()

    def wait(self, name: str) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.turn == name)

    def hand_on(self, name: str, finished: bool = False) -> None:
        with self.cond:
            i = self.live.index(name)
            following = self.live[i + 1 :] + self.live[:i]
            if finished:
                self.live.remove(name)
            self.turn = following[0] if following else (None if finished else name)
            self.cond.notify_all()
        if not finished:
            self.wait(name)


def _current_cpu() -> int | None:
    """The CPU the calling thread last ran on (/proc/thread-self/stat field 39), None where it cannot be read."""
    try:
        return int(Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return None


def _home_cpu() -> set[int] | None:
    """The one CPU every stepping thread of a block runs on: the one the bench's own thread is on (where the single
    thread of an ordinary run would call ONNX Runtime), or the first CPU this process may use; None where threads
    cannot be pinned (no sched_setaffinity)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    allowed = os.sched_getaffinity(0)
    cpu = _current_cpu()
    return {cpu if cpu in allowed else min(allowed)}


def _pin(cpus: set[int] | None) -> None:
    if cpus is not None:
        with contextlib.suppress(OSError):  # a cpuset that changed under us: run unpinned
            os.sched_setaffinity(0, cpus)  # 0: the calling thread only (Linux)


def _turns(configs: Configurations, unit: list[str], block: list[list[int]], instance: int = 0) -> dict[str, _Run]:
    """Every configuration of `unit` on `block` (on its `instance`), one decode step each in turn (in `unit`'s
    order), round after round until all are done.

    Every stepping thread is pinned to one CPU, the bench thread's (`_home_cpu`); ONNX Runtime's pool threads stay
    free to run anywhere. Unpinned, a thread handed the turn is woken wherever the scheduler chooses; about one
    block in four it woke on the core where the pool's worker was spinning and its steps took 2-3x as long until it
    moved (default model, 2 threads, 2 cores: per-block means of identical configurations up to 15% apart, steps of
    50-80 ms among 20 ms ones), which is noise that falls on one configuration and not on the others. Pinned, the
    same configurations' per-block means lay within a few percent, and the median step was unchanged (22.6 ms
    pinned, 22.8 ms unpinned, in one run)."""
    turns = _Turns(unit)
    done: dict[str, _Run] = {}
    failed: list[BaseException] = []
    home = _home_cpu()

    def generate(name: str) -> None:
        _pin(home)
        turns.wait(name)
        try:
            done[name] = configs.once(name, block, on_step=lambda i, confirmed: turns.hand_on(name), instance=instance)
        except BaseException as exc:  # re-raised in the caller's thread
            failed.append(exc)
        finally:
            turns.hand_on(name, finished=True)

    threads = [threading.Thread(target=generate, args=(n,), daemon=True) for n in unit]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise failed[0]
    return done


def _aa_interval(timing: _Timing) -> tuple[tuple[float, float], int]:
    ratios = block_ratios(timing.array("full")[..., :2], timing.array(AA)[..., :2])
    return ratio_ci(ratios, instances=timing.strata()), int(np.isfinite(ratios).sum())


def _gated(configs: Configurations, order: list[str], ids: list[list[int]], opts: BenchOptions, log: Any) -> _Timing:
    """The timed phase and its noise gate: while the A/A control's interval leaves AA_BAND, more repetitions run,
    until it is inside or the extra time would pass NOISE_BUDGET of the first phase's."""
    t0 = time.perf_counter()
    timing = _timed(configs, order, ids, range(opts.reps), log)
    first = time.perf_counter() - t0
    per_rep = first / opts.reps
    spent = 0.0
    extra = 0
    while extra < _gate_reps(opts.reps) and spent + per_rep <= NOISE_BUDGET * first:
        ci, n = _aa_interval(timing)
        if noise_verdict(ci, n) == "conclusive":
            break
        extra += 1
        if log is not None:
            log.log(f"  A/A reads [{ci[0]:.3f}, {ci[1]:.3f}], outside {list(AA_BAND)}: one more repetition")
        t1 = time.perf_counter()
        n = len(timing.runs["full"])
        _timed(configs, order, ids, range(n, n + 1), log, timing)
        spent += time.perf_counter() - t1
    skipped = opts.reps + _gate_reps(opts.reps) - len(timing.runs["full"])
    configs.tick(max(0, skipped) * len(order) * len(ids))  # the gate's repetitions that did not run
    return timing
