"""`eectl pipeline`: the worked example, each stage's command in turn from one recipe (the plan: pipeline/steps.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from eectl.cli.app import ThreadsOpt, command, set_threads
from eectl.cli.cmd_bench import bench
from eectl.cli.cmd_calibrate import calibrate
from eectl.cli.cmd_export import export
from eectl.cli.cmd_profile import profile
from eectl.cli.cmd_run import run
from eectl.cli.cmd_train_heads import train_heads
from eectl.contracts.recipe import load_recipe
from eectl.output import Output


@command()
def pipeline(
    recipe: Annotated[Path, typer.Option("--recipe", help="The recipe that drives every stage.")] = Path(
        "recipes/smollm2-135m-instruct.yaml"
    ),
    prompt: Annotated[str, typer.Option(help="The sample prompt for the run stage.")] = "What is 12 * 7?",
    cache: Annotated[
        bool,
        typer.Option(
            help="Reuse profile, heads, calibration and artifact when their inputs are unchanged.", metavar=""
        ),
    ] = True,
    model: Annotated[
        str | None, typer.Option(help="Use this checkpoint instead of the recipe's model (e.g. a local copy).")
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", help="Check the recipe against the model and print the plan; run nothing.", metavar=""
        ),
    ] = False,
    threads: ThreadsOpt = None,
) -> None:
    """The worked example: profile, train-heads, calibrate, export, run and bench from one recipe."""
    from eectl.pipeline.steps import with_model

    if model is None:
        _pipeline(recipe, prompt, cache, dry_run, threads)
        return
    with with_model(recipe, model) as copy:  # every stage reads the recipe: one that names this model (removed after)
        _pipeline(copy, prompt, cache, dry_run, threads)


def _pipeline(recipe: Path, prompt: str, cache: bool, dry_run: bool, threads: int | None) -> None:
    import time

    from eectl.pipeline.cache import PipelineCache
    from eectl.pipeline.steps import dry_run as check_recipe
    from eectl.pipeline.steps import plan

    out = Output()
    if dry_run:
        set_threads(threads, load_recipe(recipe))
        d = check_recipe(load_recipe(recipe))
        out.table(
            f"{d.recipe}: {d.model['name']} ({d.family}, {d.num_layers} layers), exits {d.exits}",
            ["stage", "would run"],
            d.stages,
        )
        out.line(f"dry run: the recipe fits the model; data {d.data['name']} ({d.data['records']} records)")
        return
    p = plan(recipe, prompt, threads)
    commands: dict[str, Callable[..., None]] = {
        "profile": profile,
        "train-heads": train_heads,
        "calibrate": calibrate,
        "export": export,
        "run": run,
        "bench": bench,
    }
    reuse = PipelineCache(load_recipe(recipe), p, enabled=cache)
    times: list[tuple[str, float, str]] = []
    for i, (stage, kwargs) in enumerate(p.steps):
        out.err.rule(f"[bold]{i + 1}/{len(p.steps)} eectl {stage}[/bold]")
        t0 = time.perf_counter()
        how = reuse.restore(stage)
        if how is None:
            commands[stage](**({**kwargs, "cache": cache} if stage == "profile" else kwargs))
            how = reuse.store(stage)
        else:
            out.log(how)
        times.append((stage, time.perf_counter() - t0, how))
    out.err.rule("[bold]done[/bold]")
    out.table(
        "stage times",
        ["stage", "seconds", "work"],
        [*[(s, f"{t:.1f}", how) for s, t, how in times], ("total", f"{sum(t for _, t, _ in times):.1f}", "")],
    )
    out.line(f"artifact: {p.artifact}\nbench report: {p.report}\nprofile plot: {p.profile_plot}")
    verdict = _bench_verdict(p.report.with_suffix(".json"))
    if verdict:
        out.line(verdict)


def _bench_verdict(path: Path) -> str:
    """The bench's verdict in one line, from the JSON twin of its report ("" when there is none)."""
    import json

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
