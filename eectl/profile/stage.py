"""The profile stage as one library call: a recipe and a request in, the suite (plot and report written) out.

What `eectl profile` and the pipeline both run. A request's None fields take the recipe's values; the caller has
set up the thread pools (cli.app.set_threads) and prints the result. What this module does not do: print results.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from eectl.contracts.recipe import Recipe, pick
from eectl.errors import UsageError
from eectl.output import Output
from eectl.output_checks import check_outputs, input_file
from eectl.phases import Phases
from eectl.profile.suite import Suite


@dataclass
class ProfileRequest:
    models: list[str | None] = dataclasses.field(default_factory=list)  # [] : the recipe's model
    data: str | None = None  # workloads: a source, or name=path,...; None: the recipe's data
    field: str | None = None  # the .jsonl field (None: the recipe's, else detected)
    tokens: int | None = None  # per workload; None: the recipe's profile.tokens, else data.tokens
    alpha: float | None = None
    similarity: str | None = None
    plot: Path | None = None  # PNG: per-layer curves (one model and workload) or the comparison
    report: Path | None = None  # markdown comparison (JSON beside it)
    lens_dtype: str = "fp32"
    cache: bool = True  # reuse results for the same model, data and settings
    recipe_file: Path | None = None  # the recipe's file: an input no output may land on
    threads: int | None = None  # the thread count set up by the caller (reported)
    device: str = "auto"  # the torch device (auto: a CUDA GPU when torch sees one, else the CPU)


@dataclass
class ProfileRun:
    suite: Suite
    plot: Path | None  # written where asked
    report: Path | None
    lens_dtype: str
    threads: int | None
    device: str = "cpu"  # where the models ran (models/device.py's name)
    phases: Phases = dataclasses.field(default_factory=Phases)  # where the time went (eectl/phases.py)


def profile(recipe: Recipe, req: ProfileRequest, out: Output) -> ProfileRun:
    """Every model of the request on every workload; the plot and the report written where asked."""
    from eectl.data import load_text_data
    from eectl.models.device import device_name, resolve_device
    from eectl.profile.lens import LENS_DTYPES, check_options
    from eectl.profile.report import parse_workloads, plot_comparison, write_report
    from eectl.profile.report import plot as plot_profile
    from eectl.profile.suite import profile_suite

    r = recipe
    a, sim = pick(req.alpha, r.profile.alpha), pick(req.similarity, r.profile.similarity)
    n_tokens = pick(req.tokens, r.profile.tokens or r.data.tokens)
    check_options(a, sim)
    if n_tokens <= 0:
        raise UsageError(f"--tokens must be positive, got {n_tokens}")
    if req.lens_dtype not in LENS_DTYPES:
        raise UsageError(f"--lens-dtype must be one of {', '.join(LENS_DTYPES)}, got '{req.lens_dtype}'")
    plot, report = req.plot, req.report
    for path, suffix in ((plot, ".png"), (report, ".md")):
        if path is not None and path.suffix.lower() != suffix:
            raise UsageError(f"--{'plot' if suffix == '.png' else 'report'} must name a {suffix} file, got {path}")
    device = device_name(resolve_device(req.device))  # a missing GPU refused before any model loads
    workloads_spec = parse_workloads(pick(req.data, r.data.source))
    ins = [("--data", input_file(src)) for _, src in workloads_spec] + [("--recipe", input_file(req.recipe_file))]
    twin = [report.with_suffix(".json")] if report is not None else []
    check_outputs([("--plot", plot, []), ("--report", report, twin)], ins)
    workloads = [(name, load_text_data(src, pick(req.field, r.data.field))) for name, src in workloads_spec]
    specs: list[str | None] = list(req.models) if req.models else [r.model]
    out.log(
        f"profiling {len(specs)} model(s) x {len(workloads)} workload(s) on {n_tokens} tokens each, "
        f"on {device}, {req.threads} threads, logit lens in {req.lens_dtype}"
    )
    with out.progress("profile", total=n_tokens * len(specs) * len(workloads)) as bar:
        suite = profile_suite(
            specs,
            workloads,
            n_tokens,
            a,
            sim,
            lens_dtype=req.lens_dtype,
            use_cache=req.cache,
            on_chunk=lambda n: bar.advance(n),
            log=out.log,
            device=req.device,
        )
    # the logit lens over the tokens (profile/lens.py's wall_s); loading the models and writing are the rest
    phases = Phases()
    phases.add("logit lens", sum(e.result.wall_s for e in suite.entries if not e.result.cached), "profile_tokens")
    if any(e.result.cached for e in suite.entries):
        phases.reused = "a profile was read from the cache"
    with phases.time("plot and report"):
        if plot is not None:
            if len(suite.entries) == 1:
                plot_profile(suite.entries[0].result, str(plot))
            else:
                plot_comparison(suite, plot)
        if report is not None:
            write_report(suite, report, plot)
    return ProfileRun(suite, plot, report, req.lens_dtype, req.threads, device, phases)
