"""The bench's configurations: every configuration's Runner (full depth, its A/A copy, each policy, drafts from the
context, the certified setting, other artifacts under --compare), transformers' generate for `hf` and the peers
(llama.cpp: evaluate/peers.py, opened by bench.py), built once
per run (twice, on a mirrored second set of runtimes, under --compare: `Configs`), and one timed pass of one
configuration over prompts (`Configs.once`), which evaluate/timing.py calls; which configurations run exactly full
depth (`Configs.at_full_depth`: not timed again, their row full depth's, `as_full_depth`), and the threshold sweep.

What this module does not do: time, order or repeat the passes (evaluate/timing.py), or turn them into speed and
fidelity figures (evaluate/bench.py, evaluate/stats.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from eectl.contracts.certificate import CERTIFIED
from eectl.contracts.plan import Prediction, plan_drafts
from eectl.errors import UsageError
from eectl.evaluate.ahead import ahead_config
from eectl.evaluate.memory import MemoryMeter
from eectl.evaluate.peers import LlamaCppPeer
from eectl.evaluate.predicted import RIVER_EXIT
from eectl.evaluate.results import AA, AHEAD, EXACT_HEAD, LOOKUP, LOOKUP_CONFIGS, BenchOptions, ConfigResult
from eectl.evaluate.stats import agreement, per_prompt_totals, speed_ratio
from eectl.evaluate.timing import OnStep, _Run
from eectl.run.generate import RunOptions, resolve_config, uncalibrated_note
from eectl.runtime.policies import POLICIES
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import Generation, RunConfig
from eectl.runtime.tiers import load_tiers


class _HF:
    """transformers' greedy generate with per-token timestamps (a streamer), on the same prompt ids."""

    def __init__(self, spec: str | None, max_new_tokens: int) -> None:
        from eectl.models import load_model

        self.loaded = load_model(spec)
        self.max_new_tokens = max_new_tokens

    def run(self, prompt: list[int], stop: tuple[int, ...]) -> tuple[list[int], float, list[float]]:
        import torch

        times: list[float] = []

        class Stamp:
            def put(self, value: Any) -> None:
                times.append(time.perf_counter())

            def end(self) -> None:
                pass

        start = time.perf_counter()
        with torch.no_grad():
            out = self.loaded.model.generate(
                torch.tensor([prompt]),
                max_new_tokens=self.max_new_tokens,
                do_sample=False,
                eos_token_id=list(stop) or None,
                pad_token_id=stop[0] if stop else 0,
                streamer=Stamp(),
            )
        new = out[0, len(prompt) :].tolist()
        stamps = times[1:]  # the first put() is the prompt
        ttft = stamps[0] - start if stamps else 0.0
        lat = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        return new, ttft, lat


def open_runtime(artifact: str | Path, opts: BenchOptions) -> ArtifactRuntime:
    """The benchmarked artifact's runtime under the run's provider, threads and weight setting (runtime/tiers.py):
    run_bench's, and its second under --compare."""
    rt = ArtifactRuntime(artifact, provider=opts.provider, threads=opts.threads, lazy_segments=opts.weights.active)
    if opts.weights.active:  # every configuration under the same weight setting
        load_tiers(rt, opts.weights)
    return rt


def creation_order(compared: list[str]) -> list[tuple[str, int]]:
    """(artifact, instance) in the order bench creates runtimes, this artifact named `full`: one runtime without
    --compare; with it the mirror full, c1 .. ck, ck .. c1, full (instance 0 the first of each artifact's two), in
    which every artifact's two creation positions have the same mean, (2k + 1) / 2."""
    if not compared:
        return [("full", 0)]
    return [("full", 0), *((c, 0) for c in compared), *((c, 1) for c in reversed(compared)), ("full", 1)]


class Configs:
    """Every configuration's runner (and transformers' generate for `hf`), and one timed pass over prompts.

    Under --compare every configuration has two instances (`instances` 2), each on its own runtimes, created in a
    mirrored order (`created`): this artifact's runtime (run_bench's), each compared artifact's in order, the
    compared ones again in reverse, this artifact's again:

        position:   0      1 .. k          k+1 .. 2k        2k+1
        runtime:    main   c1 .. ck        ck .. c1         main
        instance:   0      0               1                1

    so every artifact's two runtimes sit at the same mean creation position. The timed phase runs all configurations
    of a block on the same instance and alternates the instance block by block (timing._timed), so a paired ratio
    compares runtimes of like positions and a creation-order effect (docs/results/2026-12-03-bench.md: a runtime
    created later read 1.05x per position) cancels between the instances (stats.ratio_estimate's per-instance
    medians). Without --compare there is one instance and one runtime per artifact."""

    def __init__(
        self,
        rt: ArtifactRuntime,
        opts: BenchOptions,
        stop: tuple[int, ...],
        tick: Callable[[int], None] | None = None,
        peers: dict[str, LlamaCppPeer] | None = None,
    ) -> None:
        self.rt, self.opts, self.stop = rt, opts, stop
        # configuration -> another runtime on the same prompt ids (one instance each, run apart like `hf`)
        self.peers: dict[str, LlamaCppPeer] = peers or {}
        self.tick = tick or (lambda n: None)  # progress: one unit per prompt generated and per perplexity pass
        self.memory = MemoryMeter(rt)  # slow-tier traffic per configuration, under --memory-budget
        self.exits: list[int] = []
        self.thresholds: dict[int, dict[str, float]] = {}
        self.signal = ""
        self.priced: dict[str, Prediction | None] = {}  # configuration -> its price where not the plan's (ahead)
        self.configs: dict[str, RunConfig] = self._resolve(rt)
        # the runtimes in the order they were created: (artifact, instance), this artifact's named `full`
        self.created: list[tuple[str, int]] = [("full", 0)]
        runtimes = {("full", 0): rt}
        for key in creation_order(list(opts.compare))[1:]:
            name = key[0]
            runtimes[key] = self._main_again(rt) if name == "full" else self._compared(name, opts.compare[name])
            self.created.append(key)
        self.instances = 2 if opts.compare else 1
        self.sets: list[dict[str, Runner]] = [  # per instance: configuration -> Runner
            self._runners(runtimes["full", i], {name: runtimes[name, i] for name in opts.compare})
            for i in range(self.instances)
        ]
        self.runners = self.sets[0]  # what runs outside the timed phase (perplexity, sweep, step agreement)
        m = rt.manifest
        spec = m.model.get("spec") if m.model.get("kind") != "default" else None
        self.hf = _HF(spec, opts.max_new_tokens) if "hf" in opts.configs else None

    def _resolve(self, rt: ArtifactRuntime) -> dict[str, RunConfig]:
        """The RunConfig of every configuration but full depth's (the same for both instances: one manifest)."""
        opts, stop = self.opts, self.stop
        configs: dict[str, RunConfig] = {}
        for policy in [c for c in opts.configs if c in POLICIES or c == RIVER_EXIT]:
            cfg = self._early(rt, self.early_options(policy, 1.0))
            configs[policy] = cfg
            if cfg.exits or not self.exits:
                self.exits, self.thresholds, self.signal = cfg.exits, cfg.thresholds, cfg.signal
        for name in [c for c in opts.configs if c in LOOKUP_CONFIGS]:  # drafts from the context, checked by verify
            early = self.early_options("verify", 1.0)
            lookup = RunOptions(policy=LOOKUP, max_new_tokens=opts.max_new_tokens, provider=opts.provider)
            chosen = lookup if name == LOOKUP else early
            chosen.prompt_drafts, chosen.draft_memory = opts.prompt_drafts, opts.draft_memory
            if name != LOOKUP and chosen.prompt_drafts is None:  # lookup's own resolution takes the plan's drafts
                chosen.prompt_drafts = plan_drafts(rt.manifest.plan)
            configs[name] = resolve_config(rt, chosen, stop) if name == LOOKUP else self._early(rt, chosen)
        if AHEAD in opts.configs:  # verify drafting ahead at the plan's bound, priced on a replay (evaluate/ahead.py)
            configs[AHEAD], self.priced[AHEAD], _ = ahead_config(rt, opts, stop)
        if EXACT_HEAD in opts.configs:  # full depth without the certified head (export/certified_head.py)
            full = self._full(rt)
            configs[EXACT_HEAD] = replace(full, certified_head=False, note="full depth, the full LM head every step")
        cert = rt.manifest.certificate
        if CERTIFIED in opts.configs:  # the sequence certificate's setting, as it was certified
            if cert is None or not cert.certified:
                raise UsageError(
                    "the certified configuration needs a certificate", hint="calibrate --guarantee sequence"
                )
            configs[CERTIFIED] = RunConfig(
                exits=cert.exits,
                thresholds=cert.thresholds(),
                policy=cert.policy,
                signal=cert.signal,
                top_k=cert.top_k,
                max_new_tokens=opts.max_new_tokens,
                stop_ids=stop,
                note="the setting of the sequence certificate below",
                certified=True,
            )
        return configs

    def _early(self, rt: ArtifactRuntime, options: RunOptions) -> RunConfig:
        """An early-exit configuration's RunConfig; on an artifact exported without calibration, where neither
        --exits nor --thresholds asked for exits, full depth with the reason (as `eectl run` does), not a refusal."""
        if rt.manifest.calibration is None and options.exits is None and options.thresholds is None:
            return replace(self._full(rt), note=uncalibrated_note(True))
        return resolve_config(rt, options, self.stop)

    def _full(self, rt: ArtifactRuntime) -> RunConfig:
        base = RunOptions(exits="none", max_new_tokens=self.opts.max_new_tokens, provider=self.opts.provider)
        return resolve_config(rt, base, self.stop)

    def _compared(self, name: str, path: str) -> ArtifactRuntime:
        """Another artifact's runtime (int4 ...), at full depth, in the one thread pool."""
        other = ArtifactRuntime(path, provider=self.opts.provider, threads=self.opts.threads)
        if other.manifest.model.get("sha256") != self.rt.manifest.model.get("sha256"):
            raise UsageError(f"--compare {name}: {path} was exported from another model")
        return other

    def _main_again(self, rt: ArtifactRuntime) -> ArtifactRuntime:
        """This artifact's second runtime (--compare), under the same weight setting and the plan run_bench chose
        (choose_plan may have re-planned in memory): one manifest for both."""
        again = open_runtime(rt.folder, self.opts)
        again.manifest = rt.manifest
        return again

    def _runners(self, rt: ArtifactRuntime, compared: dict[str, ArtifactRuntime]) -> dict[str, Runner]:
        """One instance's runners: full depth, its A/A copy and every configuration on `rt`, each compared artifact
        on its runtime."""
        full = self._full(rt)
        runners = {"full": Runner(rt, full), AA: Runner(rt, full)}  # the A/A control: the same, run again
        runners.update({name: Runner(rt, cfg) for name, cfg in self.configs.items()})
        runners.update({name: Runner(other, self._full(other)) for name, other in compared.items()})
        return runners

    def at_full_depth(self) -> list[str]:
        """The configurations that run exactly what full depth runs (no active exit, no drafts: a plan that cleared
        nothing for a policy), which the timed phase need not time again: their speed is full depth's."""
        return [
            n
            for n, cfg in self.configs.items()
            if not cfg.exits and not cfg.prompt_drafts and not cfg.certified and cfg.certified_head
        ]

    def _apart(self, name: str, prompt: list[int]) -> tuple[list[int], float, list[float]]:
        """One prompt through transformers' generate or a peer: tokens, time to the first, later tokens' latencies."""
        if name == "hf":
            assert self.hf is not None
            return self.hf.run(prompt, self.stop)
        g = self.peers[name].generate(prompt, self.opts.max_new_tokens, self.stop)
        return g.token_ids, g.ttft_s, g.latencies_s

    def early_options(self, policy: str, scale: float) -> RunOptions:
        o = self.opts
        return RunOptions(
            exits=o.exits,
            signal=o.signal,
            policy="river" if policy == RIVER_EXIT else policy,
            river_predict="exit" if policy == RIVER_EXIT else "end",
            thresholds=o.thresholds,
            threshold_scale=o.threshold_scale,
            sweep_scale=scale,
            max_new_tokens=o.max_new_tokens,
            provider=o.provider,
        )

    def steps(self, name: str) -> bool:
        """eectl's configurations take turns step by step (timing._turns) on the CPU EP without a weight setting.
        Their Runners share the runtime but not where their states live (each run's own `Placement`,
        runtime/placement.py), so device-resident ones could step too; off the CPU EP turns are neither tested nor
        measured yet, and under a weight setting the runners would share one runtime's slow-tier counters."""
        rt = self.runners[name].rt if name in self.runners else None
        return rt is not None and rt.device == "cpu" and not self.opts.weights.active

    def forget_prompts(self) -> None:
        for runners in self.sets:
            for runner in runners.values():
                runner.forget_prompts()
        for peer in self.peers.values():
            peer.forget_prompts()

    def once(self, name: str, prompt_ids: list[list[int]], on_step: OnStep | None = None, instance: int = 0) -> _Run:
        """One pass of `name` over the prompts on its `instance` (0, or 1 under --compare); hf and peers have one."""
        run = _Run([], [], [], [], 0.0)
        if name == "hf" or name in self.peers:  # one prompt at a time
            for p in prompt_ids:
                new, ttft, lat = self._apart(name, p)
                run.generations.append(new)
                run.ttfts.append(ttft)
                run.latencies.extend(lat)
                run.per_prompt.append((sum(lat), len(lat)))
                run.decode_tokens += len(lat)
                run.decode_wall_s += sum(lat)
                self.tick(1)
            return run
        b = self.opts.batch_size
        runner = self.sets[instance][name]
        for i in range(0, len(prompt_ids), b):
            self.memory.start(runner.rt)
            gens: list[Generation] = runner.generate(prompt_ids[i : i + b], on_step=on_step)
            self.memory.stop(name, gens, runner.rt)
            for g in gens:
                run.generations.append(g.token_ids)
                run.ttfts.append(g.ttft_s)
                run.latencies.extend(g.latencies_s[1:])
                run.exit_layers.extend(g.exit_layers[1:])
                run.decide_s += g.decide_s
                for layer, n in g.decided.items():
                    run.decided[layer] = run.decided.get(layer, 0) + n
                for layer, n in g.picked.items():
                    run.picked[layer] = run.picked.get(layer, 0) + n
                run.drafted += g.drafted
                run.rejected += g.rejected_drafts
                run.prompt_drafted += g.prompt_drafted
                run.prompt_accepted += g.prompt_accepted
                # a row's own decode time (its steps' wall time, shared with the other rows) and tokens
                run.per_prompt.append((sum(g.latencies_s[1:]), len(g.latencies_s) - 1))
                run.decode_tokens += len(g.latencies_s) - 1
            # the rows step together: the longest-running row was live in every decode step of the batch
            run.decode_wall_s += max(sum(g.latencies_s[1:]) for g in gens)
            self.tick(len(gens))
        return run


def as_full_depth(full: ConfigResult, name: str, cfg: RunConfig) -> ConfigResult:
    """The row of a configuration that runs exactly full depth (`Configs.at_full_depth`): full depth's figures under
    its name, its plan's note, marked as not timed apart (`timed_as`)."""
    return replace(
        full,
        name=name,
        note=cfg.note,
        timed_as="full",
        reading="full depth (not timed apart)",
        predicted_speedup=1.0,
        step_agreement=1.0,
        exit_histogram=dict(full.exit_histogram),
        blocks=[],
    )


def threshold_sweep(configs: Configs, ids: list[list[int]], full_tokens: list[list[int]]) -> list[dict[str, Any]]:
    """The early-exit policy (river, else defer, if benchmarked) at each threshold scale, each against a full-depth
    run."""
    early = [c for c in configs.opts.configs if c in POLICIES or c == RIVER_EXIT]
    if not early or not configs.opts.sweep:
        return []
    policy = next((p for p in ("river", "defer") if p in early), early[0])
    L = configs.rt.manifest.num_layers
    out: list[dict[str, Any]] = []
    for scale in configs.opts.sweep:
        configs.runners["_sweep"] = Runner(
            configs.rt, resolve_config(configs.rt, configs.early_options(policy, scale), configs.stop)
        )
        full_run = configs.once("full", ids)
        sr = configs.once("_sweep", ids)
        agree, exact, _ = agreement(sr.generations, full_tokens)
        ratio = speed_ratio(per_prompt_totals([full_run.per_prompt]), per_prompt_totals([sr.per_prompt]))
        out.append(
            {
                "scale": scale,
                "policy": policy,
                "speedup": ratio if math.isfinite(ratio) else 0.0,
                "token_agreement": agree or 0.0,
                "exact_match": exact or 0.0,
                "mean_layers": float(np.mean(sr.exit_layers)) if sr.exit_layers else float(L),
            }
        )
    return out
