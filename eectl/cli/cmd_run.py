"""`eectl run`: options, the call into run/stage.py (the run stage), streamed text and per-prompt speed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from eectl.cli.app import JsonOpt, MaxRiskOpt, RecipeOpt, ThreadsOpt, command, set_threads
from eectl.cli.weights import BudgetOpt, MmapOpt, PlaceOpt, weight_options
from eectl.contracts.names import SIGNAL_SPECS
from eectl.contracts.plan import DRAFT_MEMORY, MAX_NGRAM
from eectl.contracts.recipe import load_recipe, pick
from eectl.errors import UsageError
from eectl.output import Output

if TYPE_CHECKING:
    from eectl.run.stage import RunResult

ArtifactOpt = Annotated[str, typer.Argument(help="Artifact folder from eectl export.")]
PromptOpt = Annotated[str | None, typer.Argument(help="The prompt; - reads it from stdin (or use --prompt-file).")]
PromptFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--prompt-file",
        "-f",
        help=".jsonl (prompt/question/text) or one prompt per line; - is stdin.",
        rich_help_panel="Input",
    ),
]
ExitsOpt = Annotated[
    str | None, typer.Option(help="Active exits, e.g. 12,20; 'none' for full depth.", rich_help_panel="Exits")
]
PolicyOpt = Annotated[
    str | None,
    typer.Option(
        help="KV of skipped layers: defer, copy, verify (lossless), ...; lookup: full depth with drafts from "
        "the context; default: the artifact's plan.",
        rich_help_panel="Exits",
    ),
]
RiverPredictOpt = Annotated[
    str,
    typer.Option(help="river: the token from the river's end (final head) or from the exit.", rich_help_panel="Exits"),
]
ThresholdsOpt = Annotated[
    str | None, typer.Option(help="0.9, or 12:0.9,20:0.8 (default: the calibration).", rich_help_panel="Exits")
]
ThresholdScaleOpt = Annotated[float, typer.Option(help="Multiply every threshold by this.", rich_help_panel="Exits")]
SignalOpt = Annotated[
    str | None,
    typer.Option(
        help=f"Exit signal: {', '.join(SIGNAL_SPECS)} (default: the calibration's, else topk-prob).",
        rich_help_panel="Exits",
    ),
]
TopKOpt = Annotated[
    int | None,
    typer.Option("--top-k", help="Local vocabulary size (default: the manifest's).", rich_help_panel="Exits"),
]
PromptDraftsOpt = Annotated[
    int | None,
    typer.Option(
        help="verify: up to N drafts per step from n-gram matches in the prompt and answer, checked in the same "
        "deep pass (0: off; default: the artifact's plan).",
        rich_help_panel="Exits",
    ),
]
DraftAheadOpt = Annotated[
    float,
    typer.Option(
        help="verify: the first of --exits drafts ahead while the product of its top-1 probabilities over the run "
        "stays >= this bound (0: off; eectl bench --policies ahead prices it).",
        rich_help_panel="Exits",
    ),
]
DraftNgramOpt = Annotated[
    int,
    typer.Option(help="Drafts from the context: the longest suffix matched, in tokens.", rich_help_panel="Exits"),
]
DraftMemoryOpt = Annotated[
    int,
    typer.Option(
        help="Drafts from the context: where a row's own context has no match, drafts come from the requests "
        "finished before it (an n-gram table of their latest TOKENS tokens, prompts and answers; 0: off).",
        metavar="TOKENS",
        rich_help_panel="Exits",
    ),
]
MaxNewTokensOpt = Annotated[
    int, typer.Option("--max-new-tokens", "-n", help="Tokens to generate per prompt.", rich_help_panel="Sampling")
]
TemperatureOpt = Annotated[float, typer.Option(help="0 = greedy.", rich_help_panel="Sampling")]
TopPOpt = Annotated[float, typer.Option(help="Nucleus sampling mass.", rich_help_panel="Sampling")]
SeedOpt = Annotated[int, typer.Option(help="Sampling seed.", rich_help_panel="Sampling")]
BatchSizeOpt = Annotated[
    int,
    typer.Option(
        help="Prompts decoded together; a finished one's slot takes the next. The plan prices one row: a batch runs "
        "full depth unless --policy asks for more.",
        rich_help_panel="Input",
    ),
]
ProviderOpt = Annotated[str, typer.Option(help="auto, cuda or cpu.", rich_help_panel="Runtime")]
ChatOpt = Annotated[
    bool,
    typer.Option(
        "--chat",
        help="Talk to the model: one turn per line on stdin, the KV cache kept across turns (Ctrl-C ends a reply, "
        "Ctrl-D the conversation).",
        rich_help_panel="Input",
        metavar="",
    ),
]
RawOpt = Annotated[
    bool,
    typer.Option("--raw", help="Send the prompt as is (no chat template).", rich_help_panel="Input", metavar=""),
]
ProfileCostsOpt = Annotated[
    bool,
    typer.Option(
        "--profile-costs",
        help="Re-measure the graph costs on this machine and re-plan the exits first.",
        rich_help_panel="Exits",
        metavar="",
    ),
]
ExactHeadOpt = Annotated[
    bool,
    typer.Option(
        "--exact-head",
        help="The full LM head at every greedy step instead of the artifact's certified head (which gives the same "
        "tokens for less).",
        rich_help_panel="Runtime",
        metavar="",
    ),
]
CostSamplesOpt = Annotated[
    bool,
    typer.Option(
        "--cost-samples",
        help="With --json: the costs' per-round timings too (what the plan's intervals are drawn from).",
        rich_help_panel="Common",
        metavar="",
    ),
]


@command()
def run(
    artifact: ArtifactOpt,
    prompt: PromptOpt = None,
    prompt_file: PromptFileOpt = None,
    exits: ExitsOpt = None,
    policy: PolicyOpt = None,
    river_predict: RiverPredictOpt = "end",
    thresholds: ThresholdsOpt = None,
    threshold_scale: ThresholdScaleOpt = 1.0,
    signal: SignalOpt = None,
    top_k: TopKOpt = None,
    prompt_drafts: PromptDraftsOpt = None,
    draft_ngram: DraftNgramOpt = MAX_NGRAM,
    draft_memory: DraftMemoryOpt = DRAFT_MEMORY,
    draft_ahead: DraftAheadOpt = 0.0,
    max_new_tokens: MaxNewTokensOpt = 128,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    seed: SeedOpt = 0,
    batch_size: BatchSizeOpt = 1,
    provider: ProviderOpt = "auto",
    exact_head: ExactHeadOpt = False,
    chat: ChatOpt = False,
    raw: RawOpt = False,
    profile_costs: ProfileCostsOpt = False,
    max_risk: MaxRiskOpt = None,
    mmap_weights: MmapOpt = False,
    memory_budget: BudgetOpt = None,
    place: PlaceOpt = None,
    cost_samples: CostSamplesOpt = False,
    recipe: RecipeOpt = None,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Generate with ONNX Runtime, choosing exits at run time and keeping the skipped layers' KV correct."""
    from eectl.run.generate import RunOptions
    from eectl.run.stage import RunRequest
    from eectl.run.stage import run as run_stage

    out = Output(json_out)
    if chat and (prompt is not None or prompt_file is not None):
        raise UsageError("--chat reads its turns from stdin: give no prompt argument or --prompt-file")
    if not chat and (prompt is None) == (prompt_file is None):
        raise UsageError("give one prompt argument or --prompt-file (or --chat)")
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    r = load_recipe(recipe)
    n_threads = set_threads(threads, r)
    prompts = [] if chat else _prompts(prompt, prompt_file)
    opts = RunOptions(
        exits=exits,
        policy=pick(policy, r.kv_policy),  # what --chat runs; the run stage picks the same from its request
        river_predict=river_predict,
        thresholds=thresholds,
        threshold_scale=threshold_scale,
        signal=signal,
        top_k=top_k,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        raw=raw,
        provider=provider,
        threads=n_threads,
        profile_costs=profile_costs,
        max_risk=max_risk,
        prompt_drafts=prompt_drafts,
        draft_ngram=draft_ngram,
        draft_memory=draft_memory,
        draft_ahead=draft_ahead,
        weights=weight_options(mmap_weights, memory_budget, place),
        exact_head=exact_head,
    )
    if chat:
        _chat(out, artifact, opts)
        return
    req = RunRequest(artifact, prompts, policy=policy, batch_size=batch_size, options=opts, threads=n_threads)
    done = run_stage(r, req, out, on_text=streamer(out, prompts, batch_size))
    print_run(out, done, cost_samples)


def streamer(out: Output, prompts: list[str], batch_size: int) -> Callable[[int, str], None]:
    """The answers streamed on stdout as they grow, each under its prompt when there are several (a batch prints
    its answers at the end; nothing in JSON mode)."""
    shown: dict[int, int] = {}

    def stream(index: int, text: str) -> None:
        if out.json_mode or batch_size > 1:
            return
        if index not in shown:
            shown[index] = 0
            if len(prompts) > 1:
                out.out.print(f"\n[bold]> {prompts[index]}[/bold]")
        out.out.print(text[shown[index] :], end="", markup=False, highlight=False)
        shown[index] = len(text)

    return stream


def print_run(out: Output, done: RunResult, samples: bool = False) -> None:
    """What `eectl run` prints after the streamed text: with --json the document, else the batch's answers and one
    line of speed per prompt (stderr). `samples`: the costs' per-round timings in the document (--cost-samples)."""
    rt, config, reports = done.runtime, done.config, done.reports
    L = rt.manifest.num_layers
    out.json(
        {
            "artifact": str(done.artifact),
            "provider": rt.provider,
            "threads": rt.threads,
            "policy": config.policy,
            "signal": config.signal,
            "exits": config.exits,
            "thresholds": {str(k): v for k, v in config.thresholds.items()},
            "note": config.note,
            "plan": _plan_json(rt.manifest, config),
            "certificate": rt.manifest.certificate.describe()
            if config.certified and rt.manifest.certificate is not None
            else None,
            "costs": _costs_json(rt.manifest, samples),
            "results": [rep.to_dict() for rep in reports],
            "batch": _batch_json(done) if done.batch_size > 1 else None,
            "memory": _memory(out, rt, reports),
        }
    )
    if out.json_mode:
        return
    if done.batch_size > 1:
        for rep in reports:
            out.out.print(f"\n[bold]> {rep.prompt}[/bold]\n{rep.text}", highlight=False)
    out.line("")
    for rep in reports:
        g = rep.generation
        ran = f"{config.policy} at exits {config.exits}" if config.exits else "full depth"
        drafts = f", {g.drafted} drafts, {g.rejected_drafts} rolled back" if g.drafted else ""
        if g.prompt_drafted:
            drafts += f", {g.prompt_accepted}/{g.prompt_drafted} drafts from the context accepted"
        # a row of a batch shares every call with the others: its own rate is no measure against one row's
        against = _against_full(rt.manifest, g.tokens_per_s) if done.batch_size == 1 else ""
        out.log(
            f"{len(g.token_ids)} tokens, {g.tokens_per_s:.1f} tokens/s{against}, first "
            f"token {g.ttft_s * 1000:.0f} ms, mean executed layers {g.mean_layers(L):.1f}/{L} ({ran}{drafts}, "
            f"{rt.provider}, {rt.threads} threads)"
        )
    if done.batch_size > 1 and done.seconds > 0:
        b = _batch_json(done)
        out.log(
            f"batch of {done.batch_size}: {b['tokens']} tokens in {b['seconds']:.1f} s, {b['tokens_per_s']:.1f} "
            "tokens/s in all, prompts included"
        )


def _against_full(m: Any, tokens_per_s: float) -> str:
    """A decode rate against the artifact's measured full-depth step (its costs), as ' (1.12x the artifact's measured
    full depth, 14.2 ms/token)'; '' without costs or decode steps. One run on a shared machine: an indication only."""
    if m.costs is None or tokens_per_s <= 0:
        return ""
    full = m.costs.baseline_ms()
    ratio = full * tokens_per_s / 1000.0
    return f" ({ratio:.2f}x the artifact's measured full depth, {full:.1f} ms/token)"


def _batch_json(done: RunResult) -> dict[str, Any]:
    """A batch's whole run: every prompt's tokens over the generate call's wall time (the prompts' prefill included:
    in a batch, one row's rate is no measure of the whole)."""
    tokens = sum(len(rep.generation.token_ids) for rep in done.reports)
    rate = tokens / done.seconds if done.seconds > 0 else 0.0
    return {"size": done.batch_size, "tokens": tokens, "seconds": done.seconds, "tokens_per_s": rate}


def _memory(out: Output, rt: Any, reports: list[Any]) -> dict[str, Any] | None:
    """The weights' tiers and resident memory (runtime/tiers.py), where --mmap-weights/--memory-budget/--place ran;
    logged on stderr too."""
    if rt.tiers is None:
        return None
    gens = [rep.generation for rep in reports]
    layers = [layer for g in gens for layer in g.exit_layers]
    doc: dict[str, Any] = rt.tiers.report(layers, [t for g in gens for t in g.latencies_s])
    mapped = doc["mapped_weight_resident_bytes"] / 1e6
    line = f"resident {doc['rss'] / 1e6:.0f} MB, mapped weights resident {mapped:.0f} MB"
    if doc["slow_segments"]:
        ratio = doc["measured_over_predicted"]
        line += (
            f"; slow tier read {doc['slow_bytes_per_token_measured'] / 1e6:.1f} MB/token (predicted "
            f"{doc['slow_bytes_per_token_predicted'] / 1e6:.1f}" + (f", {ratio:.2f}x)" if ratio else ")")
        )
    out.log(line)
    return doc


def _plan_json(m: Any, config: Any) -> dict[str, Any] | None:
    """The plan as fields: its default, whether this run follows it, and the prediction for what runs."""
    plan = m.plan
    if plan is None:
        return None
    pred = None
    if config.certified and plan.certified is not None:
        pred = plan.certified.prediction
    elif config.prompt_drafts and not config.exits and plan.lookup is not None:
        pred = plan.lookup.prediction
    elif config.planned and config.draft_ahead and plan.ahead is not None:
        pred = plan.ahead.prediction
    elif config.planned and config.policy in plan.choices and config.exits:
        pred = plan.choices[config.policy].prediction
    return {
        "default": plan.default,
        "followed": bool(config.planned or config.certified),
        "line": plan.line(),
        "summary": plan.summary(),
        "predicted_speedup": None if pred is None else pred.speedup,
        "predicted_interval": None if pred is None else pred.interval,
        "predicted_ms_per_token": None if pred is None else pred.ms_per_token,
        "full_ms_per_token": None if pred is None else pred.full_ms,
    }


def _costs_json(m: Any, samples: bool) -> dict[str, Any] | None:
    """The artifact's measured costs (medians); the per-round samples only when asked for (--cost-samples)."""
    if m.costs is None:
        return None
    doc: dict[str, Any] = m.costs.model_dump()
    if not samples:
        doc.pop("samples_ms", None)
    return doc


def _prompts(prompt: str | None, prompt_file: Path | None) -> list[str]:
    """The prompt argument (- reads stdin as one prompt), or --prompt-file's prompts (- reads one per stdin line)."""
    from eectl.files import text_lines
    from eectl.run.generate import read_prompts
    from eectl.stdin import argument_text, read_stdin

    if prompt == "-":
        prompt = read_stdin().strip()  # as from a file: UTF-8 whatever the locale, no byte-order mark
        if not prompt:
            raise UsageError("the prompt read from stdin is empty")
    elif prompt is not None:
        prompt = argument_text(prompt)  # its bytes as UTF-8, whatever the locale (a C locale decoded them as ASCII)
    if prompt is not None:
        return [prompt]
    if str(prompt_file) == "-":  # one prompt per line, as read_prompts reads a text file
        prompts = [line for line in text_lines(read_stdin()) if line.strip()]
        if not prompts:
            raise UsageError("no prompts on stdin")
        return prompts
    return read_prompts(str(prompt_file))


def _chat(out: Output, artifact: str, opts: Any) -> None:
    """The conversation loop of --chat: "> " on stderr before each turn, the reply streamed on stdout."""
    from eectl.run.chat import chat
    from eectl.run.generate import check_options
    from eectl.stdin import read_line, stdin_stream

    def read() -> str | None:
        out.err.print("> ", end="")
        return read_line()  # UTF-8 whatever the locale; a byte-order mark from a piped file is no part of the turn

    def write(text: str) -> None:
        if not out.json_mode:
            out.out.print(text, end="", markup=False, highlight=False)

    check_options(opts)  # an option's error before the progress line, not after it
    stdin_stream()  # closed (0<&-): one line before the artifact loads
    out.log(f"loading {artifact} (chat: one turn per line, Ctrl-D to end)")
    rt, reports, reused = chat(artifact, opts, read, write, warn=out.warn, note=out.log)
    out.json(
        {
            "artifact": str(artifact),
            "provider": rt.provider,
            "threads": rt.threads,
            "turns": [{**rep.to_dict(), "cached_input_tokens": n} for rep, n in zip(reports, reused, strict=True)],
        }
    )
    L = rt.manifest.num_layers
    for i, (rep, n) in enumerate(zip(reports, reused, strict=True), 1):
        g = rep.generation
        out.log(
            f"turn {i}: {len(g.token_ids)} tokens, {g.tokens_per_s:.1f} tokens/s, {n} input tokens from the cache, "
            f"mean executed layers {g.mean_layers(L):.1f}/{L}"
        )
