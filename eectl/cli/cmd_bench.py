"""`eectl bench`: options, the call into evaluate/stage.py (the bench stage), the side-by-side table and report."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from eectl.cli.app import BudgetNameOpt, JsonOpt, MaxRiskOpt, RecipeOpt, ThreadsOpt, command, set_threads
from eectl.cli.weights import BudgetOpt, MmapOpt, PlaceOpt, weight_options
from eectl.contracts.names import SIGNAL_SPECS
from eectl.contracts.plan import DRAFT_MEMORY
from eectl.contracts.recipe import load_recipe
from eectl.errors import UsageError
from eectl.output import Output

if TYPE_CHECKING:
    from eectl.evaluate.stage import BenchRun


ArtifactOpt = Annotated[str, typer.Argument(help="Artifact folder from eectl export.")]
DataOpt = Annotated[
    str | None,
    typer.Option(help="Prompts: .jsonl (GSM8K question/answer...), text, or built-in.", rich_help_panel="Workload"),
]
PromptsOpt = Annotated[int | None, typer.Option(help="Number of prompts (default: 10).", rich_help_panel="Workload")]
OffsetOpt = Annotated[
    int,
    typer.Option(
        help="Skip this many of the data's prompts (keep bench prompts out of calibration's).",
        rich_help_panel="Workload",
    ),
]
MaxNewTokensOpt = Annotated[
    int | None, typer.Option(help="Tokens generated per prompt (default: 64).", rich_help_panel="Workload")
]
PoliciesOpt = Annotated[
    str | None,
    typer.Option(
        help="hf, full, KV policy names, lookup, verify+lookup, ahead (default: hf, full and the policies).",
        rich_help_panel="Configurations",
    ),
]
RepsOpt = Annotated[
    int | None,
    typer.Option(help="Interleaved repetitions after the warm-up (default: 3).", rich_help_panel="Workload"),
]
ExitsOpt = Annotated[
    str | None,
    typer.Option(help="Active exits of the early-exit configurations, e.g. 24.", rich_help_panel="Configurations"),
]
SignalOpt = Annotated[
    str | None,
    typer.Option(
        help=f"Exit signal: {', '.join(SIGNAL_SPECS)} (default: the calibration's).",
        rich_help_panel="Configurations",
    ),
]
ThresholdsOpt = Annotated[
    str | None,
    typer.Option(help="0.9, or 12:0.9,20:0.8 (default: the calibration).", rich_help_panel="Configurations"),
]
ThresholdScaleOpt = Annotated[
    float, typer.Option(help="Multiply every threshold by this.", rich_help_panel="Configurations")
]
SweepOpt = Annotated[
    str | None,
    typer.Option(
        help="Threshold scales for the agreement/speedup curve ('' for none; 0.9,1.0,1.1).",
        rich_help_panel="Configurations",
    ),
]
PplTokensOpt = Annotated[
    int | None,
    typer.Option(
        help="Held-out tokens for teacher-forced perplexity (0: skip; default 1024).", rich_help_panel="Workload"
    ),
]
ReportOpt = Annotated[
    Path | None, typer.Option(help="Markdown report path (PNG plots and JSON beside it).", rich_help_panel="Output")
]
ProviderOpt = Annotated[str, typer.Option(help="auto, cuda or cpu.", rich_help_panel="Configurations")]
RawOpt = Annotated[bool, typer.Option("--raw", help="No chat template.", rich_help_panel="Workload", metavar="")]
BatchSizeOpt = Annotated[
    int,
    typer.Option(
        help="Prompts per batch for eectl configurations (throughput next to per-row latency).",
        rich_help_panel="Workload",
    ),
]
ProfileCostsOpt = Annotated[
    bool,
    typer.Option(
        "--profile-costs",
        help="Re-measure the graph costs on this machine and re-plan the exits first.",
        rich_help_panel="Configurations",
        metavar="",
    ),
]
PromptDraftsOpt = Annotated[
    int | None,
    typer.Option(
        help="lookup, verify+lookup: drafts per step from n-gram matches in the context (default: the artifact's "
        "plan's, else 12).",
        rich_help_panel="Configurations",
    ),
]
DraftMemoryOpt = Annotated[
    int,
    typer.Option(
        help="lookup, verify+lookup: drafts from the requests each configuration finished earlier in the repetition "
        "(an n-gram table of their latest TOKENS tokens; 0: off; emptied where a repetition starts).",
        metavar="TOKENS",
        rich_help_panel="Configurations",
    ),
]
DraftAheadOpt = Annotated[
    float | None,
    typer.Option(
        help="ahead: pin the drafter's bound on its running confidence (default: the bound its price picks).",
        rich_help_panel="Configurations",
    ),
]
AheadPromptsOpt = Annotated[
    int,
    typer.Option(
        help="ahead: prompts its drafter is replayed on to be priced, the data's before --offset (else after the "
        "bench's), never timed.",
        rich_help_panel="Configurations",
    ),
]
CompareOpt = Annotated[
    str | None,
    typer.Option(
        help="Other artifacts at full depth, as configurations: int4=PATH[,NAME=PATH].",
        rich_help_panel="Configurations",
    ),
]
PeerOpt = Annotated[
    str | None,
    typer.Option(
        help="Other runtimes as configurations: llama.cpp=FILE.gguf runs llama.cpp greedy on the same prompt ids, "
        "token budget and threads, as rows llama.cpp and llama.cpp+lookup (its prompt lookup); needs "
        "pip install 'eectl[llamacpp]'.",
        rich_help_panel="Configurations",
    ),
]


@command()
def bench(
    artifact: ArtifactOpt,
    data: DataOpt = None,
    prompts: PromptsOpt = None,
    offset: OffsetOpt = 0,
    max_new_tokens: MaxNewTokensOpt = None,
    policies: PoliciesOpt = None,
    reps: RepsOpt = None,
    exits: ExitsOpt = None,
    signal: SignalOpt = None,
    thresholds: ThresholdsOpt = None,
    threshold_scale: ThresholdScaleOpt = 1.0,
    sweep: SweepOpt = None,
    ppl_tokens: PplTokensOpt = None,
    report: ReportOpt = None,
    provider: ProviderOpt = "auto",
    raw: RawOpt = False,
    batch_size: BatchSizeOpt = 1,
    profile_costs: ProfileCostsOpt = False,
    max_risk: MaxRiskOpt = None,
    mmap_weights: MmapOpt = False,
    memory_budget: BudgetOpt = None,
    place: PlaceOpt = None,
    prompt_drafts: PromptDraftsOpt = None,
    draft_memory: DraftMemoryOpt = DRAFT_MEMORY,
    draft_ahead: DraftAheadOpt = None,
    ahead_prompts: AheadPromptsOpt = 8,
    compare: CompareOpt = None,
    peer: PeerOpt = None,
    recipe: RecipeOpt = None,
    budget: BudgetNameOpt = None,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Speed and fidelity against full depth (and transformers generate), side by side, in one run."""
    from eectl.evaluate.peers import check_peers, parse_peers
    from eectl.evaluate.results import BenchOptions
    from eectl.evaluate.stage import BenchRequest
    from eectl.evaluate.stage import bench as run_bench

    out = Output(json_out)
    r = load_recipe(recipe, budget)
    try:
        scales = None if sweep is None else [float(x) for x in sweep.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--sweep must be comma-separated numbers, got '{sweep}'") from None
    pairs = [c.split("=", 1) for c in (compare or "").split(",") if c.strip()]
    if any(len(p) != 2 or not p[0].strip() or not p[1].strip() for p in pairs):
        raise UsageError(f"--compare must be NAME=PATH[,NAME=PATH], got '{compare}'")
    names = [p[0].strip() for p in pairs]
    if twice := sorted({n for n in names if names.count(n) > 1}):  # the last path won, silently
        raise UsageError(f"--compare names {', '.join(twice)} more than once, got '{compare}'")
    peers = parse_peers(peer)
    check_peers(peers)  # the extra installed and the files there, before the artifact loads
    options = BenchOptions(
        compare={k.strip(): v.strip() for k, v in pairs},
        peers=peers,
        exits=exits,
        signal=signal,
        thresholds=thresholds,
        threshold_scale=threshold_scale,
        provider=provider,
        raw=raw,
        batch_size=batch_size,
        profile_costs=profile_costs,
        max_risk=max_risk,
        prompt_drafts=prompt_drafts,
        draft_memory=draft_memory,
        draft_ahead=draft_ahead,
        ahead_replay=ahead_prompts,
        weights=weight_options(mmap_weights, memory_budget, place),
    )
    listed = None if policies is None else [c.strip() for c in policies.split(",") if c.strip()]
    req = BenchRequest(
        artifact, data, prompts, offset, max_new_tokens, reps, listed, scales, ppl_tokens, report, options, recipe
    )
    req.threads = set_threads(threads, r)
    print_bench(out, run_bench(r, req, out))


def print_bench(out: Output, done: BenchRun) -> None:
    """What `eectl bench` prints: the side-by-side summary and where the report landed (JSON with --json)."""
    from eectl.evaluate.report import summary

    out.json({**done.result.to_dict(), "report": [str(f) for f in done.files]})
    if not out.json_mode:
        out.out.print(summary(done.result), markup=False, highlight=False)
        if done.files:
            out.line(f"report: {done.files[0]} (plots and JSON beside it)")
