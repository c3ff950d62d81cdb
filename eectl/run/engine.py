"""Continuous batching on one artifact: requests join the running batch at its next step and leave it when done.

One worker thread owns the runners and steps them (ONNX Runtime's sessions are used from it alone); callers on any
thread `submit` a `Job` and get its confirmed tokens after every step (`Job.on_step`) and its end (`Job.on_done`),
both called on the worker thread. A job waits in a bounded queue (`QueueFull` past it) until a slot of the batch is
free; the runner seats it at the next step (runtime/feed.py), prefilling its prompt while the others decode. A job
cancelled (`Job.cancel`: a client gone, a stop string seen) leaves its slot at the next step.

Sampling is a row's (`Sampling`: temperature, top-p, seed; runtime/sampling.py `RowSampling`): a seated job's row
picks its tokens with its own settings and generator, seeded by the job's `seed`, else by a seed drawn from the
engine's generator (seeded by the run options' `seed`) as the row is seated; so a seeded request gets the same
tokens alone or beside any others. The engine resolves two configurations as `eectl run` resolves its options
(run/generate.py `runner_for`), for the batch size it runs: a greedy one and a sampling one (the same for every
temperature and top-p: sampling refuses what is greedy only, e.g. verify's check). The plan prices one row, so with
more than one slot the plan's default would run full depth (contracts/plan.py `batch_note`); where that default is
lossless (drafts from the context, verify's exits), the engine prices it at every batch size up to its slots instead
(plan/batch.py: full depth's batched steps timed when the greedy runner is made) and the greedy runner switches
between the plan's configuration and full depth before each step, by the rows the step holds (runtime/slots.py
`Switch`). A policy asked for explicitly runs at every batch size (as `eectl run --batch-size N --policy NAME` does).

One runner steps a batch, and its configuration serves every row in it. Jobs are seated first come, first served,
whatever their setting: a sampled job joins the greedy runner's batch (`_shares`) where
- the greedy runner switches and the sampling configuration is full depth (always so with more than one slot when
  the plan chooses): a step that holds a sampled row runs full depth, after a step with no exit deciding where a
  greedy row has drafts or deferred states to settle; greedy-only steps run what the switch prices; or
- the two configurations are one (full depth; a policy asked for) with its states on the host: every step runs it,
  each row picking its token with its own setting (a greedy row the graphs' argmax).
Either way each greedy row's tokens are the ones it gets alone (a lossless configuration's are full depth's), and
each sampled row's are those of its own configuration with its own generator. Elsewhere (one slot under a greedy-only
plan default, where sampling runs full depth; exits whose states stay on a device) a job of the other configuration
waits at the queue's head until the batch drains, then that configuration's runner steps the next batch; with one
slot this is first come, first served anyway.

The run stage (run/stage.py: `eectl run`, the pipeline) queues its prompts here with `slots` = --batch-size; the
Python API (eectl/api) and the server (eectl/serve) queue their requests as they come.

What this module does not do: tokenise or detokenise (run/stage.py, api/model.py), or speak HTTP (eectl/serve).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from eectl.contracts.recipe import MAX_SEED
from eectl.errors import EectlError, UsageError
from eectl.plan.batch import BatchPrices, batch_prices, time_full, widths
from eectl.run.generate import RunOptions, runner_for
from eectl.runtime.feed import Feed
from eectl.runtime.policies import POLICIES
from eectl.runtime.runner import Runner
from eectl.runtime.sampling import RowSampling
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.slots import Switch
from eectl.runtime.state import Generation, RowState, RunConfig


class QueueFull(EectlError):
    exit_code = 75  # EX_TEMPFAIL: try again later


class Stopped(EectlError):
    exit_code = 75


@dataclass(frozen=True)
class Sampling:
    """A job's sampling: its row picks with these settings and its own generator (`Engine._row_sampling`)."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None  # the row's generator's seed; None: one drawn from the engine's as the row is seated

    @property
    def sampled(self) -> bool:
        return self.temperature > 0


@dataclass(eq=False)
class Job:
    """One request: its prompt ids, budget and sampling; what it is told after each step and at its end."""

    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    # the row's confirmed generated tokens after each step (worker thread)
    on_step: Callable[[list[int]], None] | None = None
    # at its end (worker thread): what it generated (None where it never ran a step) and the error that ended it
    on_done: Callable[[Generation | None, BaseException | None], None] | None = None
    cancelled: bool = False
    engine: Engine | None = field(default=None, repr=False)

    def cancel(self) -> None:
        """Leave the batch at its next step (or the queue now); on_done is still called once."""
        self.cancelled = True
        if self.engine is not None:
            self.engine.wake()

    def _done(self, gen: Generation | None, error: BaseException | None) -> None:
        if self.on_done is not None:
            self.on_done(gen, error)


class Engine:
    """The worker thread stepping `slots` rows with room for `context` positions each; at most `queue` jobs
    waiting. `opts`: the run options (their sampling: the default setting; their seed: the engine's generator's),
    resolved for greedy and sampled rows on `rt`.

    `admit`: at most this many new rows seated per step while others decode (None: every free slot). On the CPU EP
    each new prompt is prefilled on its own in the step that seats it, so 16 requests arriving together all waited
    for 16 prefills before anyone's first token (SmolLM2, 2 threads: 12 s); one a step gives the first arrivals
    theirs after one prefill, while the rows already seated go on decoding between the prefills."""

    def __init__(
        self,
        rt: ArtifactRuntime,
        opts: RunOptions,
        slots: int = 1,
        context: int = 2048,
        queue: int = 64,
        admit: int | None = None,
        warn: Callable[[str], None] | None = None,
        note: Callable[[str], None] | None = None,
        switch: bool = True,
    ) -> None:
        if slots < 1:
            raise UsageError(f"--max-batch must be >= 1, got {slots}")
        if queue < 1:
            raise UsageError(f"--max-queue must be >= 1, got {queue}")
        if admit is not None and admit < 1:
            raise UsageError(f"--max-prefills must be >= 1, got {admit}")
        self.rt, self.slots, self.queue_limit, self.admit = rt, slots, queue, admit
        self.context = min(context, rt.manifest.max_positions)
        # the batch size the configuration is resolved for: the slots, or more where the caller asks (`eectl run
        # --batch-size 8` on 3 prompts steps 3 rows, resolved as a batch of 8 as before)
        self.opts = dataclasses.replace(opts, batch_size=max(opts.batch_size, slots))
        self.default = Sampling(opts.temperature, opts.top_p)
        # `switch`: a lossless plan's default runs where it is priced faster at the rows a step holds (`_switching`)
        self.switching = switch and slots > 1
        self.prices: BatchPrices | None = None  # what the plan's default was priced at each batch size
        # full depth's batched steps timed at engine start (plan/batch.py `time_full`): rows -> ms, rows -> whether
        # the certified head is the faster there, the seconds it took; None: not timed (one slot)
        self.timed: tuple[dict[int, float], dict[int, bool], float] | None = None
        # the greedy (False) and sampling (True) configurations' runners, each made on first use
        self._runners: dict[bool, tuple[RunConfig, Runner]] = {}
        self._shared = False  # sampled jobs join the greedy runner's batch (`_shares`)
        self._seeds = np.random.default_rng(opts.seed)  # sampled rows' seeds where their job gives none
        self._pending: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self.running = 0  # jobs seated in the batch now
        self.steps = 0  # batch steps taken
        self._runner(self.default, warn, note)  # the default setting's errors at load, not at the first request
        self._thread = threading.Thread(target=self._work, name="eectl-engine", daemon=True)
        self._thread.start()

    # --- callers' side ----------------------------------------------------------------------------------------------
    def config(self, sampling: Sampling | None = None) -> RunConfig:
        """What a setting's rows run (the default's unless given): policy, exits, thresholds, the plan's note."""
        return self._runner(sampling or self.default)[0]

    def batching(self) -> dict[str, Any] | None:
        """Where the greedy runner switches configurations: the plan's prices per batch size and the steps each
        configuration ran (runtime/slots.py `Switch.counts`: full depth's include the steps sampled rows were in);
        None where it runs one configuration (or is not made)."""
        greedy = self._runners.get(False)
        if self.prices is None or greedy is None or greedy[1].switch is None:
            return None
        return {**self.prices.to_dict(), "steps": dict(greedy[1].switch.counts)}

    def check(self, job: Job) -> None:
        """A job's own errors, before it queues: an empty prompt, a budget below 1, past the context, a sampling
        setting its configuration refuses (e.g. sampling with verify asked for)."""
        if not job.prompt:
            raise UsageError("empty prompt")
        if job.max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be >= 1, got {job.max_new_tokens}")
        need = len(job.prompt) + job.max_new_tokens + 1
        if need > self.context:
            raise UsageError(
                f"a prompt of {len(job.prompt)} tokens + {job.max_new_tokens} new tokens exceeds the context of "
                f"{self.context}"
            )
        self._runner(job.sampling)

    def submit(self, job: Job) -> Job:
        """Queue `job` (checked first: `check`); QueueFull where `queue` jobs wait already beyond the batch's free
        slots, Stopped after `stop`."""
        self.check(job)
        job.engine = self
        with self._cond:
            if self._stopping:
                raise Stopped("the server is shutting down")
            waiting = len(self._pending) - (self.slots - self.running)  # beyond the slots free at the next step
            if waiting >= self.queue_limit:
                raise QueueFull(f"{waiting} requests wait already for a slot (--max-queue {self.queue_limit})")
            self._pending.append(job)
            self._cond.notify_all()
        return job

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, on_step: Callable[[int, list[int]], None] | None = None
    ) -> list[Generation]:
        """Every prompt queued at once, in order (seated as `Runner.generate` seats them: a finished row's slot takes
        the next), with the default sampling, each prompt's generator seeded by the options' seed (`eectl run --seed`:
        a prompt's tokens the ones it gets alone), and waited for: the run stage's call. `on_step(prompt_index,
        confirmed)` as in `Runner.generate` (on the worker thread). Interrupted while waiting, every job is
        cancelled before the interrupt goes on."""
        finished = threading.Semaphore(0)
        gens: list[Generation | None] = [None] * len(prompts)
        errors: list[BaseException] = []

        def ended(i: int, gen: Generation | None, error: BaseException | None) -> None:
            gens[i] = gen
            if error is not None:
                errors.append(error)
            finished.release()

        jobs = []
        sampling = dataclasses.replace(self.default, seed=self.opts.seed)  # each prompt's own: its tokens alone
        for i, ids in enumerate(prompts):
            step = None if on_step is None else functools.partial(on_step, i)
            jobs.append(Job(ids, max_new_tokens, sampling, on_step=step, on_done=functools.partial(ended, i)))
        try:
            for job in jobs:
                self.submit(job)
            for _ in jobs:
                finished.acquire()
        except BaseException:
            for job in jobs:
                job.cancel()
            raise
        if errors:
            raise errors[0]
        assert all(g is not None for g in gens)
        return [g for g in gens if g is not None]

    @property
    def waiting(self) -> int:
        return len(self._pending)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def stop(self, timeout: float | None = None) -> None:
        """Cancel every job (waiting ones end at once, seated ones at the next step) and end the worker."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)

    # --- the worker -------------------------------------------------------------------------------------------------
    def _runner(
        self,
        sampling: Sampling,
        warn: Callable[[str], None] | None = None,
        note: Callable[[str], None] | None = None,
    ) -> tuple[RunConfig, Runner]:
        """The configuration and runner of a setting's kind (greedy or sampled), made on first use."""
        with self._cond:
            got = self._runners.get(sampling.sampled)
            if got is None:
                opts = dataclasses.replace(self.opts, temperature=sampling.temperature, top_p=sampling.top_p)
                got = self._switching(opts, warn, note) or runner_for(self.rt, opts, warn, note)
                self._heads(got[1])
                self._runners[sampling.sampled] = got
                greedy, sampled = self._runners.get(False), self._runners.get(True)
                self._shared = greedy is not None and sampled is not None and _shares(greedy, sampled[0])
            return got

    def _home(self, sampling: Sampling) -> Runner:
        """The runner whose batch a job of this setting joins: the greedy runner's where sampled rows share it."""
        with self._cond:
            got = self._runner(sampling)
            return self._runners[False][1] if sampling.sampled and self._shared else got[1]

    def _row_sampling(self, sampling: Sampling) -> RowSampling:
        """A seated job's row's own sampling: its generator seeded by the job's seed, else (a sampled row) by one drawn
        from the engine's generator, in the order rows are seated (on the worker thread)."""
        seed = sampling.seed
        if seed is None and sampling.sampled:
            seed = int(self._seeds.integers(MAX_SEED))
        return RowSampling(sampling.temperature, sampling.top_p, np.random.default_rng(seed or 0))

    def _switching(
        self, opts: RunOptions, warn: Callable[[str], None] | None, note: Callable[[str], None] | None
    ) -> tuple[RunConfig, Runner] | None:
        """The plan's one-row configuration with a switch to full depth (runtime/slots.py `Switch`) at the batch sizes
        where it is priced slower (plan/batch.py), where the plan's default is lossless and this engine batches; None
        elsewhere (one slot, a policy asked for, sampling, a lossy or no default: `runner_for` decides)."""
        m = self.rt.manifest
        if not self.switching or m.plan is None or m.costs is None or opts.policy or opts.prompt_drafts is not None:
            return None
        one = dataclasses.replace(opts, batch_size=1)
        config = runner_for(self.rt, one)[0]  # asked quietly: where it does not switch, `runner_for` tells
        lossless = config.policy in POLICIES and POLICIES[config.policy].lossless
        if not (config.planned and lossless and (config.exits or config.prompt_drafts)):
            return None
        config, runner = runner_for(self.rt, one, warn)
        full = runner_for(self.rt, dataclasses.replace(opts, policy="full"))[1]
        if self.prices is None:
            full_ms, _, seconds = self._timing(config.certified_head)
            self.prices = batch_prices(self.rt, config, self.slots, opts.max_new_tokens, full_ms, seconds)
        runner.switch = Switch(full, self.prices.pays)
        config.note = "; ".join(x for x in (config.note, self.prices.describe()) if x)
        if note is not None:
            note(config.note)
        return config, runner

    def _timing(self, certified_head: bool) -> tuple[dict[int, float], dict[int, bool], float]:
        """Full depth's batched steps at the batch sizes this engine runs (plan/batch.py `time_full`), timed once."""
        if self.timed is None:
            t0 = time.perf_counter()
            full_ms, heads = time_full(self.rt, widths(self.slots), certified_head=certified_head)
            self.timed = full_ms, heads, time.perf_counter() - t0
        return self.timed

    def _heads(self, runner: Runner) -> None:
        """A greedy batch's chains take the certified head only at the row counts where it is the faster
        (`time_full`): its 8-bit ranking costs more per row than the full head's memory-bound fp32 one in a large
        batch (a row it cannot prove runs the full head over the rows it missed: chain.py `_missed`)."""
        cfg = runner.cfg
        if self.slots < 2 or not cfg.certified_head or cfg.temperature > 0 or self.rt.certified_head is None:
            return
        heads = self._timing(True)[1]
        for r in (runner, runner.switch.full if runner.switch is not None else None):
            if r is not None:
                r.heads = dict(heads)

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    break
                sampling = self._pending[0].sampling
            runner = self._home(sampling)
            with self._cond:
                others = [got[1] for got in self._runners.values() if got[1] is not runner]
            for other in others:  # one configuration's buffers in memory at a time
                _release(other)
            feed = _Jobs(self, runner)
            try:
                runner.run_feed(feed, self.slots, self.context, on_step=feed.step)
            except BaseException as exc:  # a step failed: its jobs end with the error, the engine goes on
                _release(runner)  # the buffers' state is unknown: the next batch allocates new ones
                feed.fail(exc)
        with self._cond:
            left, self._pending = list(self._pending), deque()
        for job in left:
            job._done(None, Stopped("the server is shutting down"))


class _Jobs(Feed):
    """The engine's queue as a runner's feed (runtime/feed.py): jobs taken in order while the queue's head joins this
    runner's batch (`Engine._home`: every job, where sampled rows share the greedy runner's); cancelled jobs
    dropped."""

    _keys = itertools.count()

    def __init__(self, engine: Engine, runner: Runner) -> None:
        super().__init__()
        self.engine, self.runner = engine, runner
        self.jobs: dict[int, Job] = {}
        self.admitted = 0  # rows seated since the last step (`Engine.admit`)

    def _head(self) -> Job | None:
        """The queue's first job not cancelled (cancelled ones end here), if it joins this feed's runner."""
        e = self.engine
        with e._cond:
            while e._pending and e._pending[0].cancelled:
                e._pending.popleft()._done(None, None)
            if e._stopping or not e._pending or e._home(e._pending[0].sampling) is not self.runner:
                return None
            return e._pending[0]

    def waiting(self) -> bool:
        return self._head() is not None

    def take(self) -> int | None:
        if self.jobs and self.engine.admit is not None and self.admitted >= self.engine.admit:
            return None  # enough prompts prefill in this step; the rest join at the next ones
        job = self._head()
        if job is None:
            return None
        self.admitted += 1
        with self.engine._cond:
            self.engine._pending.popleft()
        key = next(self._keys)
        row_sampling = self.engine._row_sampling(job.sampling)
        self.rows[key] = self.runner.new_row(job.prompt, job.max_new_tokens, row_sampling)
        self.jobs[key] = job
        self.engine.running = len(self.jobs)
        return key

    def dropped(self, key: int) -> bool:
        job = self.jobs[key]
        if not (job.cancelled or self.engine._stopping):
            return False
        self._end(key, None)
        return True

    def wait(self) -> bool:
        e = self.engine
        with e._cond:
            while not e._pending and not e._stopping:
                e._cond.wait()
        return self.waiting()

    def stepped(self) -> None:
        self.engine.steps += 1
        self.admitted = 0

    def step(self, key: int, confirmed: list[int]) -> None:
        job = self.jobs[key]
        if job.on_step is not None:
            job.on_step(confirmed)
        if self.rows[key].done:
            self._end(key, None)

    def _end(self, key: int, error: BaseException | None) -> None:
        st, job = self.rows.pop(key), self.jobs.pop(key)
        self.engine.running = len(self.jobs)
        job._done(_generation(st), error)

    def fail(self, error: BaseException) -> None:
        """A step failed: its seated jobs end with the error. Where none was seated (the batch's buffers were refused
        before the first step: memory, context), the waiting jobs of this runner's batch end with it, else the worker
        would try them again and again."""
        seated = list(self.jobs)
        for key in seated:
            self._end(key, error)
        if seated:
            return
        e = self.engine
        with e._cond:
            mine = [job for job in e._pending if e._home(job.sampling) is self.runner]
            e._pending = deque(job for job in e._pending if e._home(job.sampling) is not self.runner)
        for job in mine:
            job._done(None, error)


def _shares(greedy: tuple[RunConfig, Runner], sampled: RunConfig) -> bool:
    """Whether sampled rows step in the greedy runner's batch (the module's rule): its switch runs full depth for them
    where the sampling configuration is full depth, or the two are one configuration with its states on the host."""
    config, runner = greedy
    if runner.switch is not None:
        return not sampled.exits and not sampled.prompt_drafts
    how = ("temperature", "top_p", "seed", "note", "planned", "certified")  # how it picks and was chosen, not runs
    same = dataclasses.replace(sampled, **{k: getattr(config, k) for k in how}) == config
    return same and not runner._on_device()


def _release(runner: Runner) -> None:
    """Drop a runner's kept buffers (and its switch's full-depth view of them)."""
    runner._kept = None
    if runner.switch is not None:
        runner.switch.full._kept = None


def _generation(st: RowState) -> Generation | None:
    """What a row generated so far (None before its first token)."""
    return st.generation() if st.latencies else None


def describe(config: RunConfig) -> dict[str, Any]:
    """A configuration as fields (what /health and `Model.config` report)."""
    return {
        "policy": config.policy,
        "exits": list(config.exits),
        "signal": config.signal,
        "prompt_drafts": config.prompt_drafts,
        "draft_ahead": config.draft_ahead,
        "note": config.note,
    }
