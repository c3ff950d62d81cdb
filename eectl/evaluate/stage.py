"""The bench stage as one library call: a recipe and a request in, the benchmark run (and its report files) out.

What `eectl bench` and the pipeline both run (evaluate/bench.py does the work, evaluate/report.py writes the
report). A request's None fields take the recipe's values; the caller has set up the thread pools
(cli.app.set_threads). What this module does not do: print.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from eectl.contracts.recipe import Recipe, pick
from eectl.errors import UsageError
from eectl.evaluate.results import BenchOptions, BenchResult
from eectl.output import Output
from eectl.output_checks import check_outputs, input_file
from eectl.phases import Phases


@dataclass
class BenchRequest:
    artifact: str
    data: str | None = None  # None: the recipe's
    prompts: int | None = None  # None: the recipe's (at most the data's prompts after `offset`)
    offset: int = 0  # skip this many of the data's prompts
    max_new_tokens: int | None = None
    reps: int | None = None
    configs: list[str] | None = None  # None: the recipe's; configurations of `compare` are added
    sweep: list[float] | None = None  # None: the recipe's
    ppl_tokens: int | None = None
    report: Path | None = None  # markdown (PNG plots and JSON beside it)
    # everything else BenchOptions holds (exits, signal, thresholds, provider, weights, compare, ...); its configs,
    # prompts, max_new_tokens, reps, sweep, ppl_tokens and threads are set from the fields above
    options: BenchOptions = dataclasses.field(default_factory=BenchOptions)
    recipe_file: Path | None = None  # the recipe's file: an input no output may land on
    threads: int | None = None  # the thread count set up by the caller


@dataclass
class BenchRun:
    result: BenchResult
    files: list[Path]  # the report's files, the markdown first ([] without a report)
    phases: Phases = dataclasses.field(default_factory=Phases)  # where the time went (eectl/phases.py)


def bench(recipe: Recipe, req: BenchRequest, out: Output) -> BenchRun:
    """The configurations benchmarked interleaved on the request's window of prompts; the report written."""
    from eectl.contracts.manifest import read_manifest
    from eectl.data import gsm8k_answers, load_text_data
    from eectl.evaluate.bench import add_artifact_configs, bench_units, heldout_texts, run_bench
    from eectl.evaluate.report import report_files, write_report

    r = recipe
    if req.report is not None:  # the markdown, its JSON twin and plots (evaluate/report.py write_report)
        others = [("--compare", Path(p)) for p in req.options.compare.values()]
        ins = [("--data", input_file(pick(req.data, r.data.source))), ("--recipe", input_file(req.recipe_file))]
        ins += [("--peer", Path(p)) for p in req.options.peers.values()]
        check_outputs(
            [("--report", req.report, report_files(req.report))], ins, [("ARTIFACT", Path(req.artifact)), *others]
        )
    text = load_text_data(pick(req.data, r.data.source), r.data.field)
    if req.offset < 0 or req.offset >= len(text.prompts):
        raise UsageError(f"--offset must be in 0..{len(text.prompts) - 1}, got {req.offset}")
    n = min(pick(req.prompts, r.bench.prompts), len(text.prompts) - req.offset)
    window = slice(req.offset, req.offset + n)
    ppl_tokens = pick(req.ppl_tokens, r.bench.ppl_tokens)
    from eectl.evaluate.peers import peer_specs

    listed = pick(req.configs, list(r.bench.configs))
    added = [*req.options.compare, *(p.name for p in peer_specs(req.options.peers))]  # run whatever --policies lists
    opts = dataclasses.replace(
        req.options,
        configs=listed + [c for c in added if c not in listed],
        prompts=n,
        max_new_tokens=pick(req.max_new_tokens, r.bench.max_new_tokens),
        reps=pick(req.reps, r.bench.reps),
        sweep=pick(req.sweep, list(r.bench.sweep)),
        ppl_tokens=ppl_tokens,
        threads=req.threads,
        ahead_prompts=_replayed(text.prompts, window, req.options.ahead_replay),
    )
    heldout = heldout_texts(text.texts) if ppl_tokens > 0 else None
    answers = gsm8k_answers(text.texts[window])
    add_artifact_configs(opts, read_manifest(req.artifact, verify_hashes=False))  # counted in the progress total
    phases = Phases()
    with out.progress("bench", total=bench_units(opts, n)) as bar:
        result = run_bench(
            req.artifact, text.prompts[window], opts, heldout, answers, log=out, progress=bar.advance, phases=phases
        )
    with phases.time("report"):
        files = write_report(result, req.report) if req.report is not None else []
    return BenchRun(result, files, phases)


def _replayed(prompts: list[str], window: slice, n: int) -> list[str]:
    """The ahead configuration's replay prompts (evaluate/ahead.py): the n before the bench's window, else the n
    after it; never one the bench times."""
    if n < 1:
        raise UsageError(f"--ahead-prompts must be >= 1, got {n}")
    before, after = prompts[: window.start], prompts[window.stop :]
    return before[-n:] if before else after[:n]
