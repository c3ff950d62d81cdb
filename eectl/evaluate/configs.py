"""The bench's configurations: every configuration's Runner (full depth, its A/A copy, each policy, drafts from the
context, the certified setting, other artifacts under --compare) and transformers' generate for `hf`, built once
per run, and one timed pass of one configuration over prompts (`Configs.once`), which evaluate/timing.py calls.

What this module does not do: time, order or repeat the passes (evaluate/timing.py), or turn them into speed and
fidelity figures (evaluate/bench.py, evaluate/stats.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from eectl.contracts.certificate import CERTIFIED
from eectl.errors import UsageError
from eectl.evaluate.memory import MemoryMeter
from eectl.evaluate.predicted import RIVER_EXIT
from eectl.evaluate.results import AA, LOOKUP, LOOKUP_CONFIGS, BenchOptions
from eectl.evaluate.timing import OnStep, _Run
from eectl.run.generate import RunOptions, resolve_config
from eectl.runtime.policies import POLICIES
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import Generation, RunConfig


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


class Configs:
    """Every configuration's runner (and transformers' generate for `hf`), and one timed pass over prompts."""

    def __init__(
        self,
        rt: ArtifactRuntime,
        opts: BenchOptions,
        stop: tuple[int, ...],
        tick: Callable[[int], None] | None = None,
    ) -> None:
        self.rt, self.opts, self.stop = rt, opts, stop
        self.tick = tick or (lambda n: None)  # progress: one unit per prompt generated and per perplexity pass
        self.runners: dict[str, Runner] = {}
        self.memory = MemoryMeter(rt)  # slow-tier traffic per configuration, under --memory-budget
        base = RunOptions(exits="none", max_new_tokens=opts.max_new_tokens, provider=opts.provider)
        self.runners["full"] = Runner(rt, resolve_config(rt, base, stop))
        self.runners[AA] = Runner(rt, resolve_config(rt, base, stop))  # the A/A control: the same, run again
        self.exits: list[int] = []
        self.thresholds: dict[int, dict[str, float]] = {}
        self.signal = ""
        self.configs: dict[str, RunConfig] = {}
        for policy in [c for c in opts.configs if c in POLICIES or c == RIVER_EXIT]:
            cfg = resolve_config(rt, self.early_options(policy, 1.0), stop)
            self.runners[policy] = Runner(rt, cfg)
            self.configs[policy] = cfg
            if cfg.exits or not self.exits:
                self.exits, self.thresholds, self.signal = cfg.exits, cfg.thresholds, cfg.signal
        for name in [c for c in opts.configs if c in LOOKUP_CONFIGS]:  # drafts from the context, checked by verify
            early = self.early_options("verify", 1.0)
            lookup = RunOptions(policy=LOOKUP, max_new_tokens=opts.max_new_tokens, provider=opts.provider)
            chosen = lookup if name == LOOKUP else early
            chosen.prompt_drafts = opts.prompt_drafts
            cfg = resolve_config(rt, chosen, stop)
            self.runners[name] = Runner(rt, cfg)
            self.configs[name] = cfg
        cert = rt.manifest.certificate
        if CERTIFIED in opts.configs:  # the sequence certificate's setting, as it was certified
            if cert is None or not cert.certified:
                raise UsageError(
                    "the certified configuration needs a certificate", hint="calibrate --guarantee sequence"
                )
            self.configs[CERTIFIED] = RunConfig(
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
            self.runners[CERTIFIED] = Runner(rt, self.configs[CERTIFIED])
        for name, path in opts.compare.items():  # other artifacts (int4 ...) at full depth, one thread pool
            other = ArtifactRuntime(path, provider=opts.provider, threads=opts.threads)
            if other.manifest.model.get("sha256") != rt.manifest.model.get("sha256"):
                raise UsageError(f"--compare {name}: {path} was exported from another model")
            self.runners[name] = Runner(other, resolve_config(other, base, stop))
        m = rt.manifest
        spec = m.model.get("spec") if m.model.get("kind") != "default" else None
        self.hf = _HF(spec, opts.max_new_tokens) if "hf" in opts.configs else None

    def early_options(self, policy: str, scale: float) -> RunOptions:
        o = self.opts
        return RunOptions(
            exits=o.exits,
            signal=o.signal,
            policy="river" if policy == RIVER_EXIT else policy,
            river_predict="exit" if policy == RIVER_EXIT else "end",
            thresholds=o.thresholds,
            threshold_scale=o.threshold_scale * scale,
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

    def once(self, name: str, prompt_ids: list[list[int]], on_step: OnStep | None = None) -> _Run:
        run = _Run([], [], [], [], 0.0)
        if name == "hf":  # one prompt at a time
            assert self.hf is not None
            for p in prompt_ids:
                new, ttft, lat = self.hf.run(p, self.stop)
                run.generations.append(new)
                run.ttfts.append(ttft)
                run.latencies.extend(lat)
                run.per_prompt.append((sum(lat), len(lat)))
                run.decode_tokens += len(lat)
                run.decode_wall_s += sum(lat)
                self.tick(1)
            return run
        b = self.opts.batch_size
        for i in range(0, len(prompt_ids), b):
            self.memory.start()
            gens: list[Generation] = self.runners[name].generate(prompt_ids[i : i + b], on_step=on_step)
            self.memory.stop(name, gens)
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
