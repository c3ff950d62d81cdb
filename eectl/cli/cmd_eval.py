"""`eectl eval`: options, the call into evaluate/lmeval.py (lm-evaluation-harness), the scores table."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Annotated

import typer

from eectl.cli.app import JsonOpt, ThreadsOpt, command, set_threads
from eectl.contracts.names import SIGNAL_SPECS
from eectl.contracts.recipe import load_recipe
from eectl.errors import UsageError
from eectl.evaluate.lmeval_stats import DEFAULT_BATCH
from eectl.output import Output


@command("eval")
def eval_(
    artifact: Annotated[str, typer.Argument(help="Artifact folder from eectl export.")],
    tasks: Annotated[
        str, typer.Option(help="Offline lm-eval tasks: eectl_gsm8k, eectl_gsm8k_loglik, eectl_humaneval.")
    ] = "eectl_gsm8k",
    configs: Annotated[
        str, typer.Option(help="full, copy, defer, verify, lookup (the artifact), hf (lm-eval's own hf model).")
    ] = "full,defer",
    gsm8k: Annotated[Path | None, typer.Option(help="GSM8K-format .jsonl for the eectl_gsm8k* tasks.")] = None,
    limit: Annotated[int | None, typer.Option(help="Documents per task (the first N).")] = None,
    num_fewshot: Annotated[int | None, typer.Option(help="Few-shot examples (default: the task's, 0).")] = None,
    max_gen_toks: Annotated[int | None, typer.Option(help="Generation budget per document (task default).")] = None,
    exits: Annotated[str | None, typer.Option(help="Active exits of the early-exit configs, e.g. 20,24.")] = None,
    thresholds: Annotated[str | None, typer.Option(help="0.9, or 12:0.9,20:0.8 (default: the calibration).")] = None,
    threshold_scale: Annotated[float, typer.Option(help="Multiply every threshold by this.")] = 1.0,
    signal: Annotated[
        str | None, typer.Option(help=f"Exit signal: {', '.join(SIGNAL_SPECS)} (default: the calibration's).")
    ] = None,
    allow_code_execution: Annotated[
        bool,
        typer.Option(
            "--allow-code-execution",
            help="Let eectl_humaneval run the generated code (in a subprocess) to score it.",
            metavar="",
        ),
    ] = False,
    batch_size: Annotated[
        int, typer.Option(help="loglikelihood texts scored per pass (padded; hf keeps lm-eval's 1).", min=1, max=1024)
    ] = DEFAULT_BATCH,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """lm-evaluation-harness tasks on an artifact, per policy, with deltas against full depth (offline tasks)."""

    from eectl.evaluate.lmeval import EvalOptions, markdown, run_eval

    out = Output(json_out)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks read local files; never reach for a hub
    n_threads = set_threads(threads, load_recipe(None))
    opts = EvalOptions(
        tasks=[t.strip() for t in tasks.split(",") if t.strip()],
        configs=[c.strip() for c in configs.split(",") if c.strip()],
        exits=exits,
        thresholds=thresholds,
        threshold_scale=threshold_scale,
        signal=signal,
        limit=limit,
        num_fewshot=num_fewshot,
        max_gen_toks=max_gen_toks,
        gsm8k_path=str(gsm8k) if gsm8k is not None else None,
        allow_code_execution=allow_code_execution,
        threads=n_threads,
        batch_size=batch_size,
    )
    for name, given in (("--tasks", opts.tasks), ("--configs", opts.configs)):
        if not given:
            raise UsageError(f"{name} names nothing")
        if twice := sorted({x for x in given if given.count(x) > 1}):  # it ran (and printed) the same thing twice
            raise UsageError(f"{name} names {', '.join(twice)} more than once")
    if limit is not None and limit < 1:
        raise UsageError(f"--limit must be >= 1, got {limit}")
    if max_gen_toks is not None and max_gen_toks < 1:  # 0 ran the task's default budget, a negative one ran too
        raise UsageError(f"--max-gen-toks must be >= 1, got {max_gen_toks}")
    if num_fewshot is not None and num_fewshot < 0:
        raise UsageError(f"--num-fewshot must be >= 0, got {num_fewshot}")
    scores, settings = run_eval(artifact, opts, log=out.log)
    out.json({"artifact": artifact, "threads": n_threads, **settings, "scores": [_row(s) for s in scores]})
    if not out.json_mode:
        out.out.print(markdown(scores), markup=False, highlight=False)
        if "hf" in settings:  # what the hf row is compared against, and whether that was checked
            out.out.print(f"\n{settings['hf']['note']}", markup=False, highlight=False)


def _row(s: object) -> dict[str, object]:
    """A ConfigScores as JSON: its fields, the request counts as an object with the throughputs."""
    row = dict(vars(s))
    stats = row.get("stats")
    if stats is not None:
        rates = {"scoring_tps": stats.scoring_tps, "generation_tps": stats.generation_tps}
        row["stats"] = {**dataclasses.asdict(stats), **rates}
    return row
