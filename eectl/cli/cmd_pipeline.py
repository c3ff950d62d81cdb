"""`eectl pipeline`: the worked example from one recipe (pipeline/runner.py runs the stages); each stage's result
printed as its own command prints it, then the stage table and the bench's verdict."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from eectl.cli.app import BudgetNameOpt, ThreadsOpt, command, set_threads
from eectl.cli.cmd_run import streamer
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
    data: Annotated[
        str | None,
        typer.Option(help="Use this data instead of the recipe's: a .jsonl, a text file, or humaneval."),
    ] = None,
    weights: Annotated[
        str | None,
        typer.Option(help="fp32 or int4 (heads and thresholds fitted against the int4 model) instead of the recipe's."),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", help="Check the recipe against the model and print the plan; run nothing.", metavar=""
        ),
    ] = False,
    budget: BudgetNameOpt = None,
    threads: ThreadsOpt = None,
) -> None:
    """The worked example: profile, train-heads, calibrate, export, run and bench from one recipe."""
    from eectl.pipeline.steps import with_changes

    if model is None and data is None and weights is None:
        _pipeline(recipe, prompt, cache, dry_run, threads, budget)
        return
    with with_changes(recipe, model, data, weights) as copy:  # every stage reads this copy (removed after)
        _pipeline(copy, prompt, cache, dry_run, threads, budget)


def _pipeline(recipe: Path, prompt: str, cache: bool, dry_run: bool, threads: int | None, budget: str | None) -> None:
    from eectl.pipeline.runner import Hooks, run_pipeline

    out = Output()
    n_threads = set_threads(threads, load_recipe(recipe, budget))
    if dry_run:
        _print_dry_run(out, recipe, budget)
        return

    def start(i: int, count: int, stage: str) -> None:
        out.err.rule(f"[bold]{i + 1}/{count} eectl {stage}[/bold]")

    hooks = Hooks(start, _printer(out), streamer(out, [prompt], 1))
    done = run_pipeline(recipe, prompt, out, cache=cache, threads=n_threads, hooks=hooks, budget=budget)
    out.err.rule("[bold]done[/bold]")
    rows = [(s.stage, f"{s.seconds:.1f}", s.work) for s in done.stages]
    out.table("stage times", ["stage", "seconds", "work"], [*rows, ("total", f"{done.seconds:.1f}", "")])
    for s in done.stages:  # where each stage's time went, with what it scales with (eectl/phases.py)
        if s.phases is not None and s.phases.phases:
            rest = s.seconds - s.phases.seconds
            out.line(f"{s.stage} phases: {s.phases.describe()}, the rest {rest:.1f} s (fixed)")
    p = done.plan
    out.line(f"artifact: {p.artifact}\nbench report: {p.report}\nprofile plot: {p.profile_plot}")
    if done.verdict:
        out.line(done.verdict)
    if done.lines:
        out.err.rule("[bold]verdict[/bold]")
        for line in done.lines:
            out.line(line)


def _print_dry_run(out: Output, recipe: Path, budget: str | None) -> None:
    from eectl.pipeline.steps import dry_run as check_recipe

    d = check_recipe(load_recipe(recipe, budget))
    out.table(
        f"{d.recipe}: {d.model['name']} ({d.family}, {d.num_layers} layers), exits {d.exits}",
        ["stage", "would run"],
        d.stages,
    )
    out.line(f"dry run: the recipe fits the model; data {d.data['name']} ({d.data['records']} records)")


def _printer(out: Output) -> Callable[[str, Any], None]:
    """Each stage's result printed as its own command prints it."""
    from eectl.cli.cmd_bench import print_bench
    from eectl.cli.cmd_calibrate import print_calibration
    from eectl.cli.cmd_export import print_export
    from eectl.cli.cmd_profile import print_suite
    from eectl.cli.cmd_run import print_run
    from eectl.cli.cmd_train_heads import print_heads

    def show(stage: str, result: Any) -> None:
        if stage == "profile":
            print_suite(out, result)
        elif stage == "train-heads":
            print_heads(out, result)
        elif stage == "calibrate":
            print_calibration(out, result.calibration, result.path)
        elif stage == "export":
            print_export(out, result)
        elif stage == "run":
            print_run(out, result)
        else:
            print_bench(out, result)

    return show
