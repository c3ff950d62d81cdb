"""The run stage as one library call: a recipe and a request in, the generations over an artifact out.

What `eectl run` and the pipeline both run (run/generate.py resolves the options against the artifact; run/engine.py,
the engine the Python API and the server step their requests on, generates). A request's None fields take the
recipe's values; the caller has set up the thread pools (cli.app.set_threads). What this module does not do: print
(cli/cmd_run.py `print_run`), or --chat (run/chat.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from eectl.contracts.recipe import Recipe, pick
from eectl.errors import UsageError
from eectl.output import Output
from eectl.run.generate import RunOptions, RunReport
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig


@dataclass
class RunRequest:
    artifact: str  # the artifact folder from eectl export
    prompts: list[str]
    policy: str | None = None  # None: the recipe's kv_policy (None there too: the artifact's plan chooses)
    batch_size: int = 1  # slots decoded together: a finished row's slot takes the next prompt
    # everything else RunOptions holds (exits, thresholds, signal, sampling, provider, weights, ...); its policy and
    # threads are set from the fields here
    options: RunOptions = dataclasses.field(default_factory=RunOptions)
    threads: int | None = None  # the thread count set up by the caller


@dataclass
class RunResult:
    artifact: str  # as the request named it
    runtime: ArtifactRuntime  # the artifact's, as it ran (its manifest's plan re-chosen where the options asked)
    config: RunConfig  # what the options resolved to: policy, exits, thresholds, signal, the plan's note
    reports: list[RunReport]  # one per prompt, in the request's order
    batch_size: int
    seconds: float = 0.0  # the generate call's wall time (every prompt, every slot)


def run(recipe: Recipe, req: RunRequest, out: Output, on_text: Callable[[int, str], None] | None = None) -> RunResult:
    """Generate for every prompt of the request. `on_text(prompt_index, confirmed_text)` streams each answer as it
    settles; how the configuration was chosen (the plan's line) is logged on `out`, warnings about the options
    (e.g. thresholds used outside what they were calibrated for) warned there."""
    from eectl.data import encode_prompt
    from eectl.run.engine import Engine
    from eectl.run.generate import check_options, open_artifact

    if req.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {req.batch_size}")
    opts = dataclasses.replace(
        req.options, policy=pick(req.policy, recipe.kv_policy), threads=req.threads, batch_size=req.batch_size
    )
    check_options(opts)  # an option's error before the progress line, not after it
    n = len(req.prompts)
    out.log(f"loading {req.artifact} ({n} prompt{'s' if n > 1 else ''})")
    rt, tok = open_artifact(req.artifact, opts, out.log)
    prompts = [encode_prompt(tok, p, opts.raw) for p in req.prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UsageError("empty prompt")
    longest, m = max(len(p) for p in prompts), rt.manifest
    need = longest + opts.max_new_tokens + 1
    if need > m.max_positions:
        raise UsageError(
            f"prompt of {longest} tokens + {opts.max_new_tokens} new tokens exceeds the maximum context of "
            f"{m.max_positions}"
        )
    # batch_size slots over all prompts, on the engine the API and the server share (run/engine.py): a finished
    # row's slot takes the next prompt
    engine = Engine(rt, opts, slots=min(req.batch_size, n), context=need, queue=n, warn=out.warn, note=out.log)
    stream = None
    if on_text is not None:

        def stream(i: int, confirmed: list[int], cb: Callable = on_text) -> None:
            cb(i, tok.decode(confirmed, skip_special_tokens=True))

    t0 = time.perf_counter()
    try:
        gens = engine.generate(prompts, opts.max_new_tokens, on_step=stream)
    finally:
        engine.stop()
    seconds = time.perf_counter() - t0
    reports = [
        RunReport(p, tok.decode(g.token_ids, skip_special_tokens=True), g, m.num_layers)
        for p, g in zip(req.prompts, gens, strict=True)
    ]
    return RunResult(req.artifact, rt, engine.config(), reports, req.batch_size, seconds)
