"""`eectl serve`: options, `eectl.api.load`, and the OpenAI-compatible server (eectl/serve/app.py) until SIGTERM."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from eectl.cli.app import MaxRiskOpt, RecipeOpt, ThreadsOpt, command, set_threads
from eectl.cli.cmd_run import (
    ArtifactOpt,
    DraftMemoryOpt,
    DraftNgramOpt,
    ExactHeadOpt,
    ExitsOpt,
    PolicyOpt,
    PromptDraftsOpt,
    ProviderOpt,
    SignalOpt,
    ThresholdScaleOpt,
    ThresholdsOpt,
    TopKOpt,
    TopPOpt,
)
from eectl.cli.weights import BudgetOpt, MmapOpt, PlaceOpt, weight_options
from eectl.contracts.plan import DRAFT_MEMORY, MAX_NGRAM
from eectl.contracts.recipe import load_recipe, pick
from eectl.errors import UsageError
from eectl.output import Output

DEFAULT_PORT = 8000

HostOpt = Annotated[
    str, typer.Option(help="Address to listen on (0.0.0.0: every interface).", rich_help_panel="Server")
]
PortOpt = Annotated[int, typer.Option(help="Port to listen on.", rich_help_panel="Server")]
MaxBatchOpt = Annotated[
    int,
    typer.Option(
        help="Requests decoded together: a new one joins at the next step, a finished one leaves. A lossless plan "
        "default (lookup, verify) runs while the step's rows are few enough for it to pay (priced per batch size at "
        "start), full depth while they are not; --policy NAME runs one at every size.",
        rich_help_panel="Server",
    ),
]
MaxQueueOpt = Annotated[
    int, typer.Option(help="Requests waiting for a free slot; past it, 429.", rich_help_panel="Server")
]
ContextOpt = Annotated[
    int | None,
    typer.Option(
        help="Positions per request, prompt and answer (default: 2048 or the model's, the smaller).",
        rich_help_panel="Server",
    ),
]
MaxPrefillsOpt = Annotated[
    int,
    typer.Option(
        help="New requests whose prompts are prefilled per step while others decode (the first ones get their first "
        "token sooner); 0: every free slot at once.",
        rich_help_panel="Server",
    ),
]
NameOpt = Annotated[
    str | None,
    typer.Option(
        "--name", help="The model id /v1/models lists (default: the artifact's folder name).", rich_help_panel="Server"
    ),
]
MaxTokensOpt = Annotated[
    int,
    typer.Option(
        "--max-new-tokens",
        "-n",
        help="Tokens per answer where a request gives no max_tokens.",
        rich_help_panel="Sampling",
    ),
]
TemperatureOpt = Annotated[
    float, typer.Option(help="Where a request gives none (0 = greedy).", rich_help_panel="Sampling")
]
SeedOpt = Annotated[
    int,
    typer.Option(
        help="Seeds the server's generator: a sampled request that sends no seed samples with one drawn from it as "
        "it is seated, first come, first served (a server started with the same seed answers the same requests, "
        "arriving in the same order, alike); a request's own seed is used as sent; greedy requests draw none.",
        rich_help_panel="Sampling",
    ),
]


@command()
def serve(
    artifact: ArtifactOpt,
    host: HostOpt = "127.0.0.1",
    port: PortOpt = DEFAULT_PORT,
    max_batch: MaxBatchOpt = 4,
    max_queue: MaxQueueOpt = 64,
    context: ContextOpt = None,
    max_prefills: MaxPrefillsOpt = 1,
    name: NameOpt = None,
    exits: ExitsOpt = None,
    policy: PolicyOpt = None,
    thresholds: ThresholdsOpt = None,
    threshold_scale: ThresholdScaleOpt = 1.0,
    signal: SignalOpt = None,
    top_k: TopKOpt = None,
    prompt_drafts: PromptDraftsOpt = None,
    draft_ngram: DraftNgramOpt = MAX_NGRAM,
    draft_memory: DraftMemoryOpt = DRAFT_MEMORY,
    max_new_tokens: MaxTokensOpt = 128,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    seed: SeedOpt = 0,
    provider: ProviderOpt = "auto",
    exact_head: ExactHeadOpt = False,
    max_risk: MaxRiskOpt = None,
    mmap_weights: MmapOpt = False,
    memory_budget: BudgetOpt = None,
    place: PlaceOpt = None,
    recipe: RecipeOpt = None,
    threads: ThreadsOpt = None,
) -> None:
    """An OpenAI-compatible server on an artifact: /v1/chat/completions, /v1/completions, /v1/models, /health."""
    from eectl.api import load
    from eectl.serve.app import run_server

    out = Output(False)
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {port}")
    if max_prefills < 0:
        raise UsageError(f"--max-prefills must be >= 0, got {max_prefills}")
    if context is not None and context < 2:
        raise UsageError(f"--context must be >= 2, got {context}")
    r = load_recipe(recipe)
    n_threads = set_threads(threads, r)
    out.log(f"loading {artifact}")
    model = load(
        artifact,
        max_batch=max_batch,
        max_queue=max_queue,
        context=context,
        max_prefills=max_prefills or None,
        warn=out.warn,
        note=out.log,
        exits=exits,
        policy=pick(policy, r.kv_policy),
        thresholds=thresholds,
        threshold_scale=threshold_scale,
        signal=signal,
        top_k=top_k,
        prompt_drafts=prompt_drafts,
        draft_ngram=draft_ngram,
        draft_memory=draft_memory,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        provider=provider,
        threads=n_threads,
        max_risk=max_risk,
        weights=weight_options(mmap_weights, memory_budget, place),
        exact_head=exact_head,
    )
    run_server(model, host, port, name, on_ready=lambda url: out.log(_serving(model, name, url, max_batch)))
    out.log("stopped")


def _serving(model: Any, name: str | None, url: str, max_batch: int) -> str:
    """The line the server logs once it listens."""
    config, rt = model.config, model.runtime
    ran = f"{config['policy']} at exits {config['exits']}" if config["exits"] else "full depth"
    return (
        f"serving {name or model.name} at {url} ({ran}, batch of up to {max_batch}, {rt.provider}, {rt.threads} "
        "threads); SIGTERM or Ctrl-C stops it"
    )
