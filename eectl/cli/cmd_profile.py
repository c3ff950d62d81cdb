"""`eectl profile`: options, the call into profile/stage.py, the report."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from eectl.cli.app import BudgetNameOpt, JsonOpt, RecipeOpt, ThreadsOpt, command, set_threads
from eectl.contracts.recipe import load_recipe
from eectl.output import Output

if TYPE_CHECKING:
    from eectl.profile.stage import ProfileRun

ModelsArg = Annotated[
    list[str] | None,
    typer.Argument(help="One or more HF model folders / .gguf files; nothing for the built-in SmolLM2-135M-Instruct."),
]


@command()
def profile(
    models: ModelsArg = None,
    data: Annotated[
        str | None,
        typer.Option(help="Workloads: text file, .jsonl or built-in (humaneval); several as name=path,humaneval,..."),
    ] = None,
    field: Annotated[str | None, typer.Option(help="The .jsonl field to read (detected by default).")] = None,
    tokens: Annotated[int | None, typer.Option(help="Tokens of text to measure per workload (default: 20000).")] = None,
    alpha: Annotated[float | None, typer.Option(help="EAS weight of similarity vs depth saved, in [0, 1].")] = None,
    similarity: Annotated[str | None, typer.Option(help="EAS similarity: top1 (agreement) or js (1 - JS).")] = None,
    plot: Annotated[
        Path | None, typer.Option(help="PNG: per-layer curves (one model and workload) or the comparison.")
    ] = None,
    report: Annotated[Path | None, typer.Option(help="Write the comparison as markdown (and JSON beside it).")] = None,
    lens_dtype: Annotated[
        str, typer.Option(help="fp32 (the reference) or bf16 for the logit lens's LM-head matmuls.")
    ] = "fp32",
    cache: Annotated[
        bool, typer.Option(help="Reuse results for the same model, data and settings.", metavar="")
    ] = True,
    device: Annotated[
        str,
        typer.Option(
            help="Torch device: auto (a CUDA GPU when torch sees one, else the CPU), cpu or cuda.",
            rich_help_panel="Common",
        ),
    ] = "auto",
    recipe: RecipeOpt = None,
    budget: BudgetNameOpt = None,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Per-layer agreement with the final layer, state transitions, oracle exits and the EAS of checkpoints:
    one model on one workload, or a comparison of several models x workloads with bootstrap CIs."""
    from eectl.profile.stage import ProfileRequest
    from eectl.profile.stage import profile as run_profile

    out = Output(json_out)
    r = load_recipe(recipe, budget)
    req = ProfileRequest(
        list(models or []), data, field, tokens, alpha, similarity, plot, report, lens_dtype, cache, recipe
    )
    req.device = device
    req.threads = set_threads(threads, r)
    print_suite(out, run_profile(r, req, out))


def print_suite(out: Output, req: ProfileRun) -> None:
    """What `eectl profile` prints of a suite: one model's table and lines, or the comparison; JSON with --json."""
    from eectl.profile.report import markdown_table

    suite = req.suite
    single = len(suite.entries) == 1
    out.json(suite.entries[0].result.to_dict() if single else suite.to_dict())
    if single:
        _print_profile(out, suite.entries[0].result, req.plot)
    elif not out.json_mode:
        out.out.print(markdown_table(suite), markup=False, highlight=False)
        out.line(
            f"{suite.settings['bootstrap']['resamples']} bootstrap resamples of chunks of "  # type: ignore[index]
            f"{suite.settings['chunk_len']} tokens; lens {req.lens_dtype}; {req.device}, {req.threads} threads"
        )
        if req.plot is not None:
            out.line(f"plot: {req.plot}")
    if req.report is not None:
        out.line(f"report: {req.report}")


def _print_profile(out: Output, result: object, plot: Path | None) -> None:
    from eectl.profile.lens import ProfileResult

    assert isinstance(result, ProfileResult)
    rows = [
        (
            s.layer,
            f"{s.top1_agreement:.3f}",
            f"{s.kl:.3f}",
            "-" if s.js_similarity is None else f"{s.js_similarity:.3f}",
            f"{s.transition_cosine:.3f}",
            f"{s.oracle_exits / result.tokens:.1%}",
            f"{s.eas_term:.3f}",
        )
        for s in result.layers
    ]
    out.table(
        f"{result.model.get('name')}: {result.tokens} tokens of {result.data.get('name')}",
        ["layer", "top-1 agree", "KL(final||l)", "1-JS", "transition cos", "oracle exits", "EAS term"],
        rows,
    )
    ci = result.ci

    def iv(key: str, spec: str, scale: float = 1.0) -> str:
        lo, hi = ci.get(key, [math.nan, math.nan])
        return f"(95% CI {format(lo * scale, spec)}-{format(hi * scale, spec)})"

    out.line(
        f"EAS {result.eas:.3f} {iv(f'eas@{result.alpha}', '.3f')} (similarity={result.similarity}, "
        f"alpha={result.alpha}; at alpha 0.3/0.5/0.7: "
        + "/".join(f"{v:.3f}" for v in result.eas_by_alpha.values())
        + f"); oracle skip ratio {result.oracle_skip_ratio:.1%} {iv('oracle_skip_ratio', '.1f', 100)}, speedup "
        f"bound {result.oracle_speedup_bound:.2f}x {iv('oracle_speedup_bound', '.2f')}; agreement >= 0.5 from "
        f"layer {result.agreement_layers.get('0.5')}, >= 0.9 from layer {result.agreement_layers.get('0.9')}"
    )
    out.line(
        f"CIs: percentile bootstrap over {result.chunks} chunks of text; "
        + (
            f"from the cache (measured in {result.wall_s:.1f}s on {result.device}, {result.threads} threads)"
            if result.cached
            else f"{result.wall_s:.1f}s on {result.device}, {result.threads} threads, lens {result.lens_dtype}, "
            f"peak RSS {result.peak_rss_mb:.0f} MB"
        )
    )
    out.line(f"verdict: {result.verdict}")
    if plot is not None:
        out.line(f"plot: {plot}")
