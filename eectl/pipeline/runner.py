"""Every stage of the worked example from one recipe, by calling each stage's library function in turn.

profile -> train-heads -> calibrate -> export -> run -> bench, each with the recipe's settings and the plan's paths
(pipeline/steps.py), reusing the heads, the calibration and the artifact when their inputs are unchanged
(pipeline/cache.py). The caller sets up the thread pools (cli.app.set_threads) and sees each stage through `Hooks`;
what this module does not do: parse flags or print results (cli/cmd_pipeline.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eectl.contracts.recipe import Recipe, load_recipe
from eectl.output import Output
from eectl.phases import Phases
from eectl.pipeline.steps import Plan, check_bench_configs, plan


@dataclass
class Hooks:
    """What the caller sees while the stages run; every hook is optional."""

    start: Callable[[int, int, str], None] | None = None  # (index, count, stage), before a stage
    done: Callable[[str, Any], None] | None = None  # (stage, its result), after a stage that ran
    text: Callable[[int, str], None] | None = None  # the run stage's answer so far (prompt index, text)


@dataclass
class StageRun:
    stage: str
    seconds: float
    work: str  # "ran", "ran (...)" or "cached: ..." (pipeline/cache.py)
    result: Any = None  # the stage function's result; None when its output was reused
    phases: Phases | None = None  # where the stage's time went (its result's; None: not split, or reused)

    def __post_init__(self) -> None:
        if self.phases is None and isinstance(getattr(self.result, "phases", None), Phases):
            self.phases = self.result.phases


@dataclass
class PipelineResult:
    plan: Plan
    stages: list[StageRun] = field(default_factory=list)
    verdict: str = ""  # the bench's verdict in one line ("" without a bench report)
    lines: list[str] = field(default_factory=list)  # the pipeline's verdict (pipeline/verdict.py)

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.stages)


def run_pipeline(
    recipe_file: Path,
    prompt: str,
    out: Output,
    *,
    cache: bool = True,
    threads: int | None = None,
    folder: Path = Path("artifacts"),
    hooks: Hooks | None = None,
    budget: str | None = None,
) -> PipelineResult:
    """Run every stage from the recipe at `recipe_file` (the stages read it: its path is an input no output may
    land on) at `budget` (None: the recipe's own sizes or budget); `threads` is the count the caller set up,
    `prompt` the run stage's sample prompt. Data too small for the budget is refused before any stage runs."""
    from eectl.pipeline.cache import PipelineCache

    hooks = hooks or Hooks()
    recipe = load_recipe(recipe_file, budget)
    check_bench_configs(recipe)  # bench runs last: its configurations checked before the first stage
    p = plan(recipe, folder)
    check_data(recipe, out)
    stages = _Stages(recipe, recipe_file, p, prompt, cache, threads, out, hooks)
    reuse = PipelineCache(recipe, p, enabled=cache)
    done = PipelineResult(p)
    for i, stage in enumerate(p.stages):
        if hooks.start is not None:
            hooks.start(i, len(p.stages), stage)
        t0 = time.perf_counter()
        how, result = reuse.restore(stage), None
        if how is None:
            result = stages.run(stage)
            how = reuse.store(stage)
            if hooks.done is not None:
                hooks.done(stage, result)
        else:
            out.log(how)
        done.stages.append(StageRun(stage, time.perf_counter() - t0, how, result))
    done.verdict = bench_verdict(p.report.with_suffix(".json"))
    if "bench" in p.stages:
        from eectl.pipeline.verdict import verdict

        done.lines = verdict(recipe, p.report, p.artifact, p.calibration, done.stages)
    return done


@dataclass
class _Stages:
    """Each stage's request from the recipe and the plan, and the call into its package."""

    recipe: Recipe
    recipe_file: Path
    plan: Plan
    prompt: str
    cache: bool
    threads: int | None
    out: Output
    hooks: Hooks

    def run(self, stage: str) -> Any:
        calls: dict[str, Callable[[], Any]] = {
            "profile": self._profile,
            "train-heads": self._train_heads,
            "calibrate": self._calibrate,
            "export": self._export,
            "run": self._run,
            "bench": self._bench,
        }
        return calls[stage]()

    def _profile(self) -> Any:
        from eectl.profile.stage import ProfileRequest, profile

        req = ProfileRequest(plot=self.plan.profile_plot, cache=self.cache, recipe_file=self.recipe_file)
        req.threads = self.threads
        return profile(self.recipe, req, self.out)

    def _train_heads(self) -> Any:
        from eectl.heads.stage import HeadsRequest, train_heads

        req = HeadsRequest(out=self.plan.heads, recipe_file=self.recipe_file, threads=self.threads)
        return train_heads(self.recipe, req, self.out)

    def _calibrate(self) -> Any:
        from eectl.calibrate.stage import CalibrateRequest, calibrate

        p = self.plan
        req = CalibrateRequest(heads=p.heads, out=p.calibration, recipe_file=self.recipe_file, threads=self.threads)
        return calibrate(self.recipe, req, self.out)

    def _export(self) -> Any:
        from eectl.export.exporter import ExportOptions
        from eectl.export.quantize import Int4Options
        from eectl.export.stage import ExportRequest, export

        p, r = self.plan, self.recipe
        spec = r.int4.model_dump()
        exact_wide = spec.pop("exact_wide")
        exact_wide = exact_wide if r.weights == "int4" else False  # None: auto (ExportOptions.pads)
        int4 = Int4Options(**{**spec, "keep_layers": tuple(spec["keep_layers"])})
        # the plan's folder is the pipeline's own: replaced
        options = ExportOptions(exits=[], force=True, weights=r.weights, int4=int4, cost_seconds=r.export.cost_seconds)
        options.exact_wide = exact_wide
        req = ExportRequest(out=p.artifact, calibration=p.calibration, heads=p.heads, options=options)
        req.threads = self.threads
        return export(self.recipe, req, self.out)

    def _run(self) -> Any:
        from eectl.run.generate import RunOptions
        from eectl.run.stage import RunRequest, run

        req = RunRequest(str(self.plan.artifact), [self.prompt], options=RunOptions(max_new_tokens=64))
        req.threads = self.threads
        return run(self.recipe, req, self.out, on_text=self.hooks.text)

    def _bench(self) -> Any:
        from eectl.evaluate.stage import BenchRequest, bench

        p = self.plan
        req = BenchRequest(str(p.artifact), report=p.report, recipe_file=self.recipe_file, threads=self.threads)
        req.offset = bench_offset(self.recipe)
        if self.recipe.bench.peer:  # llama.cpp on the same GGUF beside eectl's rows, where it is installed
            from eectl.evaluate.peers import default_peers
            from eectl.models import resolve_source
            from eectl.models.gguf_blocks import gguf_file

            req.options.peers = default_peers(gguf_file(resolve_source(self.recipe.model)))
            req.configs = bench_configs(self.recipe, req.options.peers)
        return bench(self.recipe, req, self.out)


def bench_configs(recipe: Recipe, peers: dict[str, str]) -> list[str] | None:
    """The pipeline bench's configurations: the recipe's (None), plus `hf` where a peer runs beside an artifact that
    is not fp32: the peer's and the artifact's fidelity to the fp32 model are read against transformers' greedy
    tokens on the checkpoint then (evaluate/fidelity.py fp32_fidelity; an fp32 artifact is its own reference)."""
    listed = list(recipe.bench.configs)
    if not peers or recipe.weights == "fp32" or "hf" in listed:
        return None
    return [*listed, "hf"]


def bench_offset(recipe: Recipe) -> int:
    """The bench's prompts are the data's last ones: the state cache holds the last records out of training, and
    calibration reads the data from its start, so the bench measures prompts that neither saw (on data large
    enough for both)."""
    from eectl.data import load_text_data

    n = len(load_text_data(recipe.data.source, recipe.data.field).prompts)
    return max(0, n - recipe.bench.prompts)


def check_data(recipe: Recipe, out: Output) -> None:
    """A recipe whose heads train from a state cache: refused at once (one DataError line) when its data cannot fill
    the cache, before minutes of other stages."""
    if recipe.heads.cache is None:
        return
    from eectl.data import load_text_data
    from eectl.heads.supply import check_supply
    from eectl.models.loading import load_tokenizer

    text = load_text_data(recipe.data.source, recipe.data.field)
    s = check_supply(load_tokenizer(recipe.model, log=out), text, recipe)
    out.log(
        f"budget {recipe.budget or '-'}: {recipe.heads.tokens} state-cache tokens ({s.prompts_needed}+ of "
        f"{s.prompts} prompts continued), {recipe.data.tokens} calibration tokens, bench {recipe.bench.prompts} "
        f"prompts x {recipe.bench.max_new_tokens} tokens x {recipe.bench.reps} reps"
    )


def bench_verdict(path: Path) -> str:
    """The bench's verdict in one line, from the JSON twin of its report ("" when there is none)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    default = next((c for c in doc.get("configs", []) if c.get("name") == doc.get("default")), None)
    if default is None or default.get("speedup_vs_full") is None:
        return f"bench verdict: {doc.get('verdict', '-')}"
    lo, hi = default.get("speedup_vs_full_ci") or (None, None)
    ci = f" [{lo:.2f}, {hi:.2f}]" if lo is not None else ""
    speed = f"{default['speedup_vs_full']:.2f}x{ci}"
    return f"bench verdict: {doc.get('verdict', '-')}; the default ({default['name']}) {speed} full depth"
