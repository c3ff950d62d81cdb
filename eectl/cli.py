"""The typer app: wiring only. Each command parses options, merges them over --recipe, calls one library
function and prints. Domain errors are mapped to one line and an exit code here, once (traceback with EECTL_DEBUG=1).
"""

from __future__ import annotations

import functools
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from eectl import __version__
from eectl.errors import EectlError, UsageError
from eectl.files import check_output_file
from eectl.output import Output
from eectl.quantize import DEFAULT_MIN_AGREEMENT
from eectl.recipe import Recipe, default_exits, load_recipe, parse_layers, pick

app = typer.Typer(
    name="eectl",
    help="Early-exit LLM inference: profile, calibrate, train heads, export to ONNX, run, bench.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

RecipeOpt = Annotated[Path | None, typer.Option("--recipe", help="Recipe YAML (recipes/*.yaml); options override it.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout; progress off.")]
ThreadsOpt = Annotated[int | None, typer.Option("--threads", help="CPU threads (default: one per core).")]
ModelArg = Annotated[
    str | None,
    typer.Argument(help="HF model folder, .gguf file, or nothing for the built-in SmolLM2-135M-Instruct."),
]


def _mapped(fn: Callable[..., None]) -> Callable[..., None]:
    """Map domain errors to one line on stderr and the error's exit code (traceback with EECTL_DEBUG=1)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except EectlError as exc:
            if os.environ.get("EECTL_DEBUG"):
                raise
            hint = f" ({exc.hint})" if exc.hint else ""
            print(f"error: {exc.message}{hint}", file=sys.stderr)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            # Typer turns KeyboardInterrupt into a silent exit 130 before main() could see it: say it here.
            print("interrupted", file=sys.stderr)
            raise typer.Exit(130) from None

    return wrapper


def command(name: str | None = None) -> Callable[[Callable[..., None]], Callable[..., None]]:
    def register(fn: Callable[..., None]) -> Callable[..., None]:
        app.command(name)(_mapped(fn))
        return fn

    return register


def _version(value: bool) -> None:
    if value:
        print(f"eectl {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Show version.")] = False,
) -> None:
    """eectl turns a decoder-only LLM checkpoint into an exit-enabled artifact and measures what it buys."""


def _threads(requested: int | None, recipe: Recipe) -> int:
    """One thread count for torch and ONNX Runtime's global pool (default: one per core), reported by commands."""
    import torch

    from eectl.runtime.sessions import init_ort

    n = pick(requested, recipe.threads)
    if n is not None and n < 1:
        raise UsageError(f"--threads must be >= 1, got {n}")
    n = init_ort(n)
    torch.set_num_threads(n)
    return n


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
    tokens: Annotated[int | None, typer.Option(help="Tokens of text to measure per workload (default 20000).")] = None,
    alpha: Annotated[float | None, typer.Option(help="EAS weight of similarity vs depth saved, in [0, 1].")] = None,
    similarity: Annotated[str | None, typer.Option(help="EAS similarity: top1 (agreement) or js (1 - JS).")] = None,
    plot: Annotated[
        Path | None, typer.Option(help="PNG: per-layer curves (one model and workload) or the comparison.")
    ] = None,
    report: Annotated[Path | None, typer.Option(help="Write the comparison as markdown (and JSON beside it).")] = None,
    lens_dtype: Annotated[
        str, typer.Option(help="fp32 (the reference) or bf16 for the logit lens's LM-head matmuls.")
    ] = "fp32",
    cache: Annotated[bool, typer.Option(help="Reuse results for the same model, data and settings.")] = True,
    recipe: RecipeOpt = None,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Per-layer agreement with the final layer, state transitions, oracle exits and the EAS of checkpoints:
    one model on one workload, or a comparison of several models x workloads with bootstrap CIs."""
    from eectl.data import load_text_data
    from eectl.profile import (
        LENS_DTYPES,
        check_options,
        markdown_table,
        parse_workloads,
        plot_comparison,
        profile_suite,
    )
    from eectl.profile import plot as plot_profile

    out = Output(json_out)
    r = load_recipe(recipe)
    a, sim = pick(alpha, r.profile.alpha), pick(similarity, r.profile.similarity)
    n_tokens = pick(tokens, r.profile.tokens or r.data.tokens)
    check_options(a, sim)
    if n_tokens <= 0:
        raise UsageError(f"--tokens must be positive, got {n_tokens}")
    if lens_dtype not in LENS_DTYPES:
        raise UsageError(f"--lens-dtype must be one of {', '.join(LENS_DTYPES)}, got '{lens_dtype}'")
    for path, suffix in ((plot, ".png"), (report, ".md")):
        if path is not None and path.suffix.lower() != suffix:
            raise UsageError(f"--{'plot' if suffix == '.png' else 'report'} must name a {suffix} file, got {path}")
    for path, option in ((plot, "--plot"), (report, "--report")):
        if path is not None:
            check_output_file(path, option)
    n_threads = _threads(threads, r)
    workloads = [
        (name, load_text_data(src, pick(field, r.data.field)))
        for name, src in parse_workloads(pick(data, r.data.source))
    ]
    specs: list[str | None] = list(models) if models else [r.model]
    out.log(
        f"profiling {len(specs)} model(s) x {len(workloads)} workload(s) on {n_tokens} tokens each, "
        f"{n_threads} threads, logit lens in {lens_dtype}"
    )
    with out.progress("profile", total=n_tokens * len(specs) * len(workloads)) as bar:
        suite = profile_suite(
            specs,
            workloads,
            n_tokens,
            a,
            sim,
            lens_dtype=lens_dtype,
            use_cache=cache,
            on_chunk=lambda n: bar.advance(n),
            log=out.log,
        )
    single = len(suite.entries) == 1
    if plot is not None:
        if single:
            plot_profile(suite.entries[0].result, str(plot))
        else:
            plot_comparison(suite, plot)
    table = markdown_table(suite)
    if report is not None:
        from eectl.profile import write_report

        write_report(suite, report, plot)
    out.json(suite.entries[0].result.to_dict() if single else suite.to_dict())
    if single:
        _print_profile(out, suite.entries[0].result, plot)
    elif not out.json_mode:
        out.out.print(table, markup=False, highlight=False)
        out.line(
            f"{suite.settings['bootstrap']['resamples']} bootstrap resamples of chunks of "  # type: ignore[index]
            f"{suite.settings['chunk_len']} tokens; lens {lens_dtype}; {n_threads} threads"
        )
        if plot is not None:
            out.line(f"plot: {plot}")
    if report is not None:
        out.line(f"report: {report}")


def _print_profile(out: Output, result: object, plot: Path | None) -> None:
    from eectl.profile import ProfileResult

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
            f"from the cache (measured in {result.wall_s:.1f}s on {result.threads} threads)"
            if result.cached
            else f"{result.wall_s:.1f}s on {result.threads} threads, lens {result.lens_dtype}, "
            f"peak RSS {result.peak_rss_mb:.0f} MB"
        )
    )
    out.line(f"verdict: {result.verdict}")
    if plot is not None:
        out.line(f"plot: {plot}")


@command()
def calibrate(
    model: ModelArg = None,
    data: Annotated[str | None, typer.Option(help="Text file, .jsonl, or built-in name (humaneval).")] = None,
    field: Annotated[str | None, typer.Option(help="The .jsonl field to read (detected by default).")] = None,
    tokens: Annotated[
        int | None, typer.Option(help="Tokens to measure, teacher-forced and generated together (default 20000).")
    ] = None,
    target: Annotated[
        float | None, typer.Option(help="Agreement with the final layer's top-1 among exiting tokens, in (0, 1].")
    ] = None,
    exits: Annotated[str | None, typer.Option(help="Exit after these layers, comma-separated, e.g. 8,12,16.")] = None,
    signal: Annotated[
        str | None,
        typer.Option(help="Exit signal, a name in eectl.exits.SIGNALS (topk-prob, full-prob, cosine, ...)."),
    ] = None,
    top_k: Annotated[int | None, typer.Option(help="Local vocabulary size of the topk-* signals.")] = None,
    heads: Annotated[Path | None, typer.Option(help="Trained exit heads (heads.safetensors): exits use them.")] = None,
    confidence: Annotated[
        float,
        typer.Option(
            help="Require the Clopper-Pearson lower bound at this level to reach --target (0: point estimate)."
        ),
    ] = 0.95,
    candidates: Annotated[
        str, typer.Option(help="Candidate source at the first exit: shortlist, int8 or first-exit-topk.")
    ] = "shortlist",
    shortlist: Annotated[
        int, typer.Option(help="Rows of the frequency-ranked shortlist (--candidates shortlist).")
    ] = 4096,
    compare: Annotated[
        str, typer.Option(help="Other candidate sources to measure on the same tokens, e.g. int8,full (report).")
    ] = "",
    holdout: Annotated[float, typer.Option(help="Share of chunks and prompts held out to check the thresholds.")] = 0.2,
    gen_share: Annotated[
        float, typer.Option(help="Share of the tokens taken from the model's own greedy continuations of prompts.")
    ] = 0.25,
    gen_tokens: Annotated[int, typer.Option(help="Continuation length per prompt (at most; EOS ends it).")] = 64,
    raw: Annotated[
        bool, typer.Option(help="Continue prompts as is, without the chat template (eectl run --raw).")
    ] = False,
    out_path: Annotated[
        Path | None, typer.Option("--out", help="Where to write it (default artifacts/<model>-calibration.json).")
    ] = None,
    recipe: RecipeOpt = None,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Per-exit thresholds so that exits agree with the full model at a stated rate (sequential, held-out checked)."""
    from eectl.calibrate import CalibrateOptions, calibrate_model, check_options
    from eectl.calibration_file import write_calibration
    from eectl.data import load_text_data
    from eectl.models import load_model

    out = Output(json_out)
    r = load_recipe(recipe)
    opts = CalibrateOptions(
        exits=pick(parse_layers(exits), r.exits or []),
        signal=pick(signal, r.signal),
        target=pick(target, r.target),
        top_k=pick(top_k, r.top_k),
        tokens=pick(tokens, r.data.tokens),
        confidence=None if confidence == 0 else confidence,
        candidates=candidates,
        shortlist=shortlist,
        compare=[c.strip() for c in compare.split(",") if c.strip()],
        holdout=holdout,
        gen_share=gen_share,
        gen_tokens=gen_tokens,
        raw=raw,
    )
    check_options(opts)
    if heads is not None and not heads.is_file():
        raise UsageError(f"heads not found: {heads}", hint="train them with eectl train-heads")
    if out_path is not None:
        check_output_file(out_path, "--out")
    n_threads = _threads(threads, r)
    text = load_text_data(pick(data, r.data.source), pick(field, r.data.field))
    out.log(f"loading {pick(model, r.model) or 'the default model (SmolLM2-135M-Instruct)'}")
    loaded = load_model(pick(model, r.model), log=out)
    opts.exits = opts.exits or default_exits(loaded.adapter.num_layers)
    check_options(opts, loaded.adapter.num_layers, loaded.adapter.dims.vocab_size)
    head_modules = None
    if heads is not None:
        from eectl.head_designs import load_heads

        head_modules = dict(load_heads(heads, loaded).heads)  # checks the heads were trained on this checkpoint
    path = out_path or Path("artifacts") / f"{loaded.source.name}-calibration.json"
    out.log(
        f"calibrating exits {opts.exits} on {opts.tokens} tokens of {text.name} ({opts.text_tokens} teacher-forced, "
        f"{opts.generated_tokens} generated), signal {opts.signal}, target {opts.target}, {n_threads} threads"
    )
    with out.progress("calibrate", total=opts.tokens) as bar:
        result = calibrate_model(loaded, text, opts, head_modules, heads, on_tokens=lambda n: bar.advance(n))
    write_calibration(result, path)
    out.json(result.to_dict())
    _print_calibration(out, result, path)


def _print_calibration(out: Output, result: object, path: Path) -> None:
    from eectl.calibration_file import Calibration, SplitStats

    assert isinstance(result, Calibration)

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    def prec(s: SplitStats | None) -> str:
        return num(None if s is None else s.precision)

    bound = result.confidence is not None
    rows = []
    for x in result.exits:
        thr = "never" if x.never else ", ".join(f"{c} >= {v:.4g}" for c, v in x.thresholds.items())
        c, h = x.calibration, x.heldout
        row = [x.layer, thr + (" (head)" if x.head else ""), c.reached, pct(c.coverage), prec(c)]
        if bound:
            row.append(num(c.lower_bound))
        row += [pct(h.coverage if h else None), prec(h)]
        rows.append(row)
    columns = ["exit", "threshold", "reached", "coverage", "precision"]
    columns += [f"CP bound {result.confidence:.0%}"] if bound else []
    columns += ["held-out cov.", "held-out agree"]
    d = result.data
    out.table(
        f"{result.model.name}: {result.signal}"
        + (f" (K={result.top_k})" if result.top_k else "")
        + f", target {result.target}: {d.calibration_tokens} calibration + {d.heldout_tokens} held-out tokens",
        columns,
        rows,
    )
    for name, s in (("calibration", result.calibration), ("held-out", result.heldout)):
        if s is not None:
            out.line(
                f"{name}: {s.exit_rate:.1%} of {s.tokens} tokens exit early (agreement {num(s.precision)} among "
                f"them, {s.agreement:.4f} overall); mean executed layers {s.mean_layers:.2f} of "
                f"{result.model.num_layers}, speedup bound {s.speedup_bound:.3f}x"
            )
    for name, s in result.heldout_by_source.items():
        out.line(f"  held-out {name}: {s.tokens} tokens, exit {s.exit_rate:.1%}, agreement {num(s.precision)}")
    out.line(
        f"data: {d.tokens} tokens of {d.name}: {d.teacher_forced_tokens} teacher-forced, {d.generated_tokens} "
        f"generated ({d.prompts_used} prompts{' in the chat template' if d.chat_template else ''} x up to "
        f"{d.gen_tokens_per_prompt}); {result.wall_s:.1f}s on "
        f"{result.threads} threads ({result.seconds_per_10k_tokens:.1f}s per 10,000 tokens)"
    )
    cand = result.candidates
    if cand is not None:
        size = f" ({cand.size} rows" if cand.size else ""
        hit = f", {cand.heldout_hit_rate:.1%} of held-out tokens inside)" if cand.heldout_hit_rate is not None else ""
        out.line(f"candidates: {cand.name}{size}{hit or (')' if size else '')}; {len(result.options)} menu options")
    for name, comp in result.compared.items():
        held = comp.heldout or comp.calibration
        out.line(
            f"compared, candidates {name}: held-out exit rate {held.exit_rate:.1%}, agreement "
            f"{num(held.precision)} among them, mean executed layers {held.mean_layers:.2f} "
            f"({len(comp.options)} menu options)"
        )
    for x in result.exits:
        if x.note:
            out.line(f"exit {x.layer}: {x.note}")
    out.line(f"written: {path}")


@command("train-heads")
def train_heads(
    model: ModelArg = None,
    data: Annotated[str | None, typer.Option(help="Text file, .jsonl, or built-in name (humaneval).")] = None,
    field: Annotated[str | None, typer.Option(help="The .jsonl field to read (detected by default).")] = None,
    exits: Annotated[str | None, typer.Option(help="Exit after these layers, comma-separated, e.g. 8,12,16.")] = None,
    steps: Annotated[int | None, typer.Option(help="Optimiser steps (default: the recipe's, 500).")] = None,
    design: Annotated[str | None, typer.Option(help="residual-linear, low-rank or mlp.")] = None,
    rank: Annotated[int | None, typer.Option(help="Rank of low-rank heads (64) or width of mlp heads (H/2).")] = None,
    lr: Annotated[float | None, typer.Option(help="Peak learning rate (AdamW; warm-up, cosine decay).")] = None,
    batch_tokens: Annotated[int, typer.Option(help="Tokens per step (per process).")] = 32,
    ce_weight: Annotated[float, typer.Option(help="Weight of next-token cross-entropy added to the KL.")] = 0.0,
    eval_tokens: Annotated[
        int | None, typer.Option(help="Held-out tokens (the data's last records) for the report (default 4096).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of head initialisation and data order.")] = 0,
    save_every: Annotated[int, typer.Option(help="Write the checkpoint (.ckpt.safetensors) every N steps.")] = 100,
    resume: Annotated[Path | None, typer.Option(help="Continue from this checkpoint (.ckpt.safetensors).")] = None,
    device: Annotated[str, typer.Option(help="cpu, or cuda (mixed precision).")] = "cpu",
    out_path: Annotated[
        Path | None, typer.Option("--out", help="heads .safetensors (default artifacts/<model>-heads.safetensors).")
    ] = None,
    cache: Annotated[
        Path | None, typer.Option(help="State cache folder: the base runs once into it, heads train from it.")
    ] = None,
    tokens: Annotated[int | None, typer.Option(help="With --cache: training tokens (recipe: 16384).")] = None,
    gen_share: Annotated[float | None, typer.Option(help="With --cache: share of generated tokens (0.25).")] = None,
    loss: Annotated[str | None, typer.Option(help="With --cache: topk (teacher top-k + tail) or exact.")] = None,
    block_init: Annotated[str, typer.Option(help="block design: last, next or identity.")] = "last",
    recipe: RecipeOpt = None,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Light exit heads trained against the frozen model's own final layer (KL), reported before and after."""
    import time

    from eectl.data import load_text_data
    from eectl.head_checkpoint import check_checkpoint
    from eectl.heads import TrainConfig, resolve_device
    from eectl.heads import train_heads as train
    from eectl.models import load_model

    out = Output(json_out)
    r = load_recipe(recipe)
    cache_dir = cache or (Path(r.heads.cache) if r.heads.cache else None)
    if cache_dir is not None or pick(design, r.heads.design) == "block":
        _train_heads_cached(
            out,
            r,
            model,
            data,
            field,
            exits,
            design,
            rank,
            lr,
            seed,
            save_every,
            resume,
            out_path,
            cache_dir,
            tokens,
            gen_share,
            loss,
            block_init,
            pick(eval_tokens, r.heads.eval_tokens),
            threads,
        )
        return
    config = TrainConfig(
        exits=pick(parse_layers(exits), r.exits or []),
        design=pick(design, r.heads.design),
        rank=pick(rank, r.heads.rank),
        steps=pick(steps, r.heads.steps),
        lr=pick(lr, r.heads.lr),
        batch_tokens=batch_tokens,
        seed=seed,
        ce_weight=ce_weight,
        eval_tokens=pick(eval_tokens, r.heads.eval_tokens),
        save_every=save_every,
        device=device,
        top_k=r.top_k,
        target=r.target,
    )
    config.check()  # before the model loads (no exits yet: the model's default_exits)
    if out_path is not None and out_path.suffix != ".safetensors":
        raise UsageError(f"--out must name a .safetensors file, got {out_path}")
    if out_path is not None:
        check_output_file(out_path, "--out")
    if resume is not None:
        check_checkpoint(resume)
    resolve_device(device)
    n_threads = _threads(threads, r)
    text = load_text_data(pick(data, r.data.source), pick(field, r.data.field))
    out.log(f"loading {pick(model, r.model) or 'the default model (SmolLM2-135M-Instruct)'}")
    loaded = load_model(pick(model, r.model), log=out)
    config.exits = config.exits or default_exits(loaded.adapter.num_layers)
    config.check(loaded.adapter.num_layers)
    path = out_path or Path("artifacts") / f"{loaded.source.name}-heads.safetensors"
    out.log(
        f"training {config.design} heads at exits {sorted(config.exits)} for {config.steps} steps of "
        f"{config.batch_tokens} tokens of {text.name}, {device}, {n_threads} threads"
    )
    with out.progress("train-heads", total=config.steps) as bar:
        shown: list[int] = []  # a resumed run starts the bar at its checkpoint's step
        t0 = time.perf_counter()

        def on_step(step: int, kl: dict[int, float]) -> None:
            if not shown:
                shown.append(step - 1)
            rate = (step - shown[0]) * config.batch_tokens / max(time.perf_counter() - t0, 1e-9)
            info = f"{rate:.0f} tokens/s, KL " + " ".join(f"{layer}:{v:.2f}" for layer, v in kl.items())
            bar.advance(step - shown[-1], info=info)
            shown.append(step)

        result = train(loaded, text, config, path, resume, on_step=on_step, log=out.log)
    if not result.main:
        return
    out.json(result.to_dict())
    _print_heads(out, result)


def _train_heads_cached(
    out: Output,
    r: Recipe,
    model: str | None,
    data: str | None,
    field: str | None,
    exits: str | None,
    design: str | None,
    rank: int | None,
    lr: float | None,
    seed: int,
    save_every: int,
    resume: Path | None,
    out_path: Path | None,
    cache_dir: Path | None,
    tokens: int | None,
    gen_share: float | None,
    loss: str | None,
    block_init: str,
    eval_tokens: int,
    threads: int | None,
) -> None:
    """train-heads from a state cache: build (or reuse, or extend) it, then train from it with progress and ETA."""
    import time

    from eectl.data import load_text_data
    from eectl.head_data import CacheSpec, build_cache
    from eectl.heads_cached import CachedConfig, train_cached
    from eectl.models import load_model

    n_threads = _threads(threads, r)
    text = load_text_data(pick(data, r.data.source), pick(field, r.data.field))
    loaded = load_model(pick(model, r.model), log=out)
    layers = pick(parse_layers(exits), r.exits or []) or default_exits(loaded.adapter.num_layers)
    n = pick(tokens, r.heads.tokens)
    share = pick(gen_share, r.heads.gen_share)
    n_gen = round(n * share)
    spec = CacheSpec(
        layers=layers,
        text_tokens=n - n_gen,
        gen_tokens=n_gen,
        eval_text_tokens=eval_tokens,
        eval_gen_tokens=round(eval_tokens * share),
    )
    folder = cache_dir or Path("artifacts") / f"{loaded.source.name}-states"
    total = spec.text_tokens + spec.gen_tokens + spec.eval_text_tokens + spec.eval_gen_tokens
    with out.progress("base states", total=total) as bar:
        start = time.perf_counter()
        done = [0]

        def on_tokens(k: int) -> None:
            done[0] += k
            bar.advance(k, info=f"{done[0] / max(time.perf_counter() - start, 1e-9):.0f} tokens/s")

        state_cache = build_cache(loaded, text, spec, folder, on_tokens, out.log)
    batch = 256
    config = CachedConfig(
        exits=layers,
        design=pick(design, r.heads.design),
        rank=pick(rank, r.heads.rank),
        block_init=block_init,
        steps=max(1, n // batch),
        lr=pick(lr, r.heads.lr),
        batch_tokens=batch,
        seed=seed,
        loss=pick(loss, r.heads.loss),
        save_every=save_every,
        eval_tokens=eval_tokens,
        top_k=r.top_k,
        target=r.target,
    )
    path = out_path or Path("artifacts") / f"{loaded.source.name}-heads.safetensors"
    out.log(
        f"training {config.design} heads at exits {layers}: {config.steps} steps of {batch} tokens from {folder} "
        f"({config.loss} loss), {n_threads} threads"
    )
    with out.progress("train-heads", total=config.steps) as bar:
        shown: list[int] = []  # steps seen (a resumed run starts at its checkpoint's step)
        t0 = time.perf_counter()

        def on_step(step: int, seen: int, kl: dict[int, float]) -> None:
            if not shown:
                shown.append(step - 1)
            rate = (step - shown[0]) * batch / max(time.perf_counter() - t0, 1e-9)
            info = f"{rate:.0f} tokens/s, KL " + " ".join(f"{k}:{v:.2f}" for k, v in kl.items())
            bar.advance(step - shown[-1], info=info)
            shown.append(step)

        result = train_cached(loaded, state_cache, config, path, resume, on_step, out.log)
    out.json(result.to_dict())
    _print_heads(out, result)


def _print_heads(out: Output, result: object) -> None:
    from eectl.heads import TrainResult, iter_report

    assert isinstance(result, TrainResult) and result.meta is not None
    meta = result.meta
    rows = [
        (
            b["layer"],
            f"{b['agreement']:.3f} -> {a['agreement']:.3f}",
            f"{b['kl']:.3f} -> {a['kl']:.3f}",
            f"{b['coverage_full']:.1%} -> {a['coverage_full']:.1%}",
            f"{b['coverage_topk']:.1%} -> {a['coverage_topk']:.1%}",
        )
        for b, a in iter_report(meta)
    ]
    rep, t = meta.report, meta.training
    out.table(
        f"{meta.base_model['name']}: {meta.design} heads, {rep['tokens']} held-out tokens, before -> after",
        [
            "exit",
            "top-1 agree",
            "KL(final||exit)",
            f"coverage @{rep['target_precision']} (full)",
            f"coverage @{rep['target_precision']} (top-{rep['top_k']})",
        ],
        rows,
    )
    L = meta.dimensions.num_layers
    for name in ("before", "after"):
        s = rep[name]
        out.line(
            f"{name}: oracle exit mean layers {s['oracle_mean_layers']:.2f} of {L}; exits at the thresholds above "
            f"(full-vocab, in-sample): mean layers {s['sequential_mean_layers']:.2f}, "
            f"agreement {s['sequential_agreement']:.4f}"
        )
    cost = meta.head_cost
    out.line(
        f"{t['steps']} steps x {t['batch_tokens']} tokens ({meta.data['epochs']} epochs of "
        f"{meta.data['train_tokens']} tokens), {t['precision']} on {t['device']}; {cost.params} params per "
        f"head; {t['wall_s']:.1f}s ({t['train_s']:.1f}s training) on {t['threads']} threads"
    )
    out.line(f"written: {result.out} and {result.sidecar}; checkpoint {result.checkpoint}")


@command()
def export(
    model: ModelArg = None,
    exits: Annotated[str | None, typer.Option(help="Exit after these layers, e.g. 8,12,16,20,24.")] = None,
    out: Annotated[Path | None, typer.Option(help="Artifact folder (default artifacts/<model-name>).")] = None,
    calibration: Annotated[Path | None, typer.Option(help="calibration.json from eectl calibrate.")] = None,
    heads: Annotated[Path | None, typer.Option(help="heads.safetensors from eectl train-heads.")] = None,
    dtype: Annotated[str, typer.Option(help="fp32, or fp16 for GPU deployment.")] = "fp32",
    top_k: Annotated[int | None, typer.Option("--top-k", help="Default local vocabulary size.")] = None,
    candidates: Annotated[
        str | None,
        typer.Option(help="Candidate source: shortlist, int8, first-exit-topk (default: the calibration's)."),
    ] = None,
    force: Annotated[bool, typer.Option(help="Replace an existing artifact.")] = False,
    weights: Annotated[str, typer.Option(help="fp32, or int4: weight-only MatMulNBits segment graphs.")] = "fp32",
    river: Annotated[bool, typer.Option(help="Add int4 copies of the segments after the first exit.")] = False,
    int4_block_size: Annotated[int, typer.Option(help="int4: input channels per scale.")] = 32,
    int4_symmetric: Annotated[bool, typer.Option(help="int4: no zero points.")] = False,
    int4_accuracy_level: Annotated[int, typer.Option(help="int4: MatMulNBits compute, 0 fp32 .. 4 int8.")] = 4,
    int4_algorithm: Annotated[str, typer.Option(help="int4: rtn (ORT's default) or hqq.")] = "rtn",
    int4_keep_layers: Annotated[str | None, typer.Option(help="int4: decoder layers left in fp32, e.g. 0,29.")] = None,
    lm_head: Annotated[str, typer.Option(help="int4: the final LM head in fp32, int8 or int4.")] = "fp32",
    min_agreement: Annotated[
        float, typer.Option(help="int4: fail below this greedy agreement with PyTorch at the final exit.")
    ] = DEFAULT_MIN_AGREEMENT,
    recipe: RecipeOpt = None,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Segmented ONNX graphs cut at the exit points, exit heads and a manifest, validated against PyTorch."""
    from eectl.calibration_file import read_calibration
    from eectl.export import ExportOptions, check_options, choose_exits, describe, export_artifact
    from eectl.models import load_model, resolve_source
    from eectl.quantize import Int4Options

    int4 = Int4Options(
        block_size=int4_block_size,
        symmetric=int4_symmetric,
        accuracy_level=int4_accuracy_level,
        algorithm=int4_algorithm,
        lm_head=lm_head,
        keep_layers=tuple(sorted(set(parse_layers(int4_keep_layers, "--int4-keep-layers") or []))),
        min_agreement=min_agreement,
    )

    out_ = Output(json_out)
    r = load_recipe(recipe)
    requested = parse_layers(exits)
    cal = read_calibration(calibration) if calibration is not None else None
    if heads is not None and not heads.is_file():
        raise UsageError(f"heads not found: {heads}", hint="train them with eectl train-heads")
    # Everything that needs no model is checked before the seconds-long load.
    folder = out or Path("artifacts") / resolve_source(pick(model, r.model)).name
    options = ExportOptions(
        exits=requested or [],
        dtype=dtype,
        top_k=pick(top_k, r.top_k),
        force=force,
        weights=weights,
        int4=int4,
        river=river,
        candidates=candidates,
    )
    check_options(options, folder)
    n_threads = _threads(threads, r)
    loaded = load_model(pick(model, r.model), log=out_)
    head_modules, heads_meta = None, None
    if heads is not None:
        from eectl.head_designs import load_heads

        head_set = load_heads(heads, loaded)  # checks they were trained on this checkpoint
        head_modules, heads_meta = head_set.heads, head_set.meta
    exit_layers = choose_exits(loaded.adapter.num_layers, requested, cal, head_modules, r.exits)
    options.exits = exit_layers
    out_.log(f"exporting {loaded.source.name} with exits {exit_layers} to {folder} ({dtype}, {n_threads} threads)")
    manifest = export_artifact(loaded, folder, options, head_modules, heads_meta, cal, log=out_)
    summary = describe(manifest, folder)
    out_.json(summary)
    v = manifest.validation
    out_.table(
        f"{folder}: validation ({v.get('dtype')}, prefill {v.get('prompt_tokens')} + {v.get('decode_steps')} steps)",
        ["exit after layer", "max abs logit diff", "local logits diff", "greedy mismatches"],
        [
            (k, f"{d:.2e}", f"{v['max_abs_local_logit_diff'][k]:.2e}", v["greedy_token_mismatches"][k])
            for k, d in v.get("max_abs_logit_diff", {}).items()
        ],
    )
    for part in (v, v.get("river") or {}):
        if "greedy_agreement" in part:
            agree = part["greedy_agreement"][str(manifest.num_layers)]
            out_.line(
                f"{part['graphs']} graphs: greedy agreement with PyTorch {agree:.1%} (floor {part['min_agreement']})"
            )
    out_.line(
        f"artifact: {folder} ({summary['size_mb']} MB, {len(manifest.segments)} segments, "
        f"exported and validated in {v.get('export_seconds')} s, peak RSS {v.get('peak_rss_mb')} MB)"
    )
    if manifest.plan is not None:
        out_.line(manifest.plan.summary())


@command()
def run(
    artifact: Annotated[str, typer.Argument(help="Artifact folder from eectl export.")],
    prompt: Annotated[str | None, typer.Argument(help="The prompt (or use --prompt-file).")] = None,
    prompt_file: Annotated[
        Path | None, typer.Option(help=".jsonl (prompt/question/text) or one prompt per line.")
    ] = None,
    exits: Annotated[str | None, typer.Option(help="Active exits, e.g. 12,20; 'none' for full depth.")] = None,
    policy: Annotated[
        str | None,
        typer.Option(help="KV of skipped layers: defer, copy, verify (lossless), ...; default: the artifact's plan."),
    ] = None,
    river_predict: Annotated[
        str, typer.Option(help="river: the token from the river's end (final head) or from the exit.")
    ] = "end",
    thresholds: Annotated[str | None, typer.Option(help="0.9, or 12:0.9,20:0.8 (default: the calibration).")] = None,
    threshold_scale: Annotated[float, typer.Option(help="Multiply every threshold by this.")] = 1.0,
    signal: Annotated[
        str | None, typer.Option(help="Exit signal (default: the calibration's, else topk-prob).")
    ] = None,
    top_k: Annotated[
        int | None, typer.Option("--top-k", help="Local vocabulary size (default: the manifest's).")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    batch_size: Annotated[int, typer.Option(help="Prompts per batch (each row decides its own exits).")] = 1,
    provider: Annotated[str, typer.Option(help="auto, cuda or cpu.")] = "auto",
    raw: Annotated[bool, typer.Option(help="Send the prompt as is (no chat template).")] = False,
    profile_costs: Annotated[
        bool, typer.Option(help="Re-measure the graph costs on this machine and re-plan the exits first.")
    ] = False,
    recipe: RecipeOpt = None,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Generate with ONNX Runtime, choosing exits at run time and keeping the skipped layers' KV correct."""
    from eectl.runtime.generate import RunOptions, read_prompts, run_prompts

    out = Output(json_out)
    if (prompt is None) == (prompt_file is None):
        raise UsageError("give one prompt argument or --prompt-file")
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    r = load_recipe(recipe)
    n_threads = _threads(threads, r)
    prompts = [prompt] if prompt is not None else read_prompts(str(prompt_file))
    opts = RunOptions(
        exits=exits,
        policy=pick(policy, r.kv_policy),
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
    )
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

    rt, config, reports = run_prompts(artifact, prompts, opts, batch_size, on_text=stream, warn=out.warn)
    L = rt.manifest.num_layers
    out.json(
        {
            "artifact": str(artifact),
            "provider": rt.provider,
            "threads": rt.threads,
            "policy": config.policy,
            "signal": config.signal,
            "exits": config.exits,
            "thresholds": {str(k): v for k, v in config.thresholds.items()},
            "plan": config.note,
            "costs": None if rt.manifest.costs is None else rt.manifest.costs.model_dump(),
            "results": [rep.to_dict() for rep in reports],
        }
    )
    if not out.json_mode:
        if batch_size > 1:
            for rep in reports:
                out.out.print(f"\n[bold]> {rep.prompt}[/bold]\n{rep.text}", highlight=False)
        out.line("")
        for rep in reports:
            g = rep.generation
            out.log(
                f"{len(g.token_ids)} tokens, {g.tokens_per_s:.1f} tokens/s, first token {g.ttft_s * 1000:.0f} ms, "
                f"mean executed layers {g.mean_layers(L):.1f}/{L} ({config.policy}, exits {config.exits or 'none'}, "
                f"{rt.provider}, {rt.threads} threads)"
            )


@command()
def bench(
    artifact: Annotated[str, typer.Argument(help="Artifact folder from eectl export.")],
    data: Annotated[
        str | None, typer.Option(help="Prompts: .jsonl (GSM8K question/answer...), text, or built-in.")
    ] = None,
    prompts: Annotated[int | None, typer.Option(help="Number of prompts (default 10).")] = None,
    offset: Annotated[
        int, typer.Option(help="Skip this many of the data's prompts (keep bench prompts out of calibration's).")
    ] = 0,
    max_new_tokens: Annotated[int | None, typer.Option(help="Tokens generated per prompt (default 64).")] = None,
    policies: Annotated[str | None, typer.Option(help="hf, full and KV policy names (default: all of them).")] = None,
    reps: Annotated[int | None, typer.Option(help="Interleaved repetitions after the warm-up (default 3).")] = None,
    exits: Annotated[str | None, typer.Option(help="Active exits of the early-exit configurations, e.g. 24.")] = None,
    signal: Annotated[str | None, typer.Option(help="Exit signal (default: the calibration's).")] = None,
    thresholds: Annotated[str | None, typer.Option(help="0.9, or 12:0.9,20:0.8 (default: the calibration).")] = None,
    threshold_scale: Annotated[float, typer.Option(help="Multiply every threshold by this.")] = 1.0,
    sweep: Annotated[
        str | None, typer.Option(help="Threshold scales for the agreement/speedup curve ('' for none; 0.9,1.0,1.1).")
    ] = None,
    ppl_tokens: Annotated[
        int | None, typer.Option(help="Held-out tokens for teacher-forced perplexity (0: skip; default 1024).")
    ] = None,
    report: Annotated[Path | None, typer.Option(help="Markdown report path (PNG plots and JSON beside it).")] = None,
    provider: Annotated[str, typer.Option(help="auto, cuda or cpu.")] = "cpu",
    raw: Annotated[bool, typer.Option(help="No chat template.")] = False,
    batch_size: Annotated[
        int, typer.Option(help="Prompts per batch for eectl configurations (throughput next to per-row latency).")
    ] = 1,
    profile_costs: Annotated[
        bool, typer.Option(help="Re-measure the graph costs on this machine and re-plan the exits first.")
    ] = False,
    compare: Annotated[
        str | None, typer.Option(help="Other artifacts at full depth, as configurations: int4=PATH[,NAME=PATH].")
    ] = None,
    recipe: RecipeOpt = None,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Speed and fidelity against full depth (and transformers generate), side by side, in one run."""
    from eectl.bench import (
        BenchOptions,
        bench_units,
        gsm8k_answers,
        heldout_texts,
        markdown,
        run_bench,
        write_report,
    )
    from eectl.data import load_text_data

    out = Output(json_out)
    r = load_recipe(recipe)
    if report is not None:
        check_output_file(report, "--report")
    n_threads = _threads(threads, r)
    text = load_text_data(pick(data, r.data.source), r.data.field)
    configs = pick(policies, ",".join(r.bench.configs))
    try:
        scales = [float(x) for x in (sweep.split(",") if sweep is not None else r.bench.sweep) if str(x).strip()]
    except ValueError:
        raise UsageError(f"--sweep must be comma-separated numbers, got '{sweep}'") from None
    if offset < 0 or offset >= len(text.prompts):
        raise UsageError(f"--offset must be in 0..{len(text.prompts) - 1}, got {offset}")
    n = min(pick(prompts, r.bench.prompts), len(text.prompts) - offset)
    window = slice(offset, offset + n)
    answers = gsm8k_answers(text.texts[window])
    ppl_tokens = pick(ppl_tokens, r.bench.ppl_tokens)
    heldout = heldout_texts(text.texts) if ppl_tokens > 0 else None
    pairs = [c.split("=", 1) for c in (compare or "").split(",") if c.strip()]
    if any(len(p) != 2 or not p[0].strip() or not p[1].strip() for p in pairs):
        raise UsageError(f"--compare must be NAME=PATH[,NAME=PATH], got '{compare}'")
    compared = {k.strip(): v.strip() for k, v in pairs}
    listed = [c.strip() for c in configs.split(",") if c.strip()]
    opts = BenchOptions(
        configs=listed + [c for c in compared if c not in listed],
        compare=compared,
        prompts=n,
        max_new_tokens=pick(max_new_tokens, r.bench.max_new_tokens),
        reps=pick(reps, r.bench.reps),
        exits=exits,
        signal=signal,
        thresholds=thresholds,
        threshold_scale=threshold_scale,
        sweep=scales,
        ppl_tokens=ppl_tokens,
        provider=provider,
        threads=n_threads,
        raw=raw,
        batch_size=batch_size,
        profile_costs=profile_costs,
    )
    with out.progress("bench", total=bench_units(opts, n)) as bar:
        result = run_bench(artifact, text.prompts[window], opts, heldout, answers, log=out, progress=bar.advance)
    files = write_report(result, report) if report is not None else []
    out.json({**result.to_dict(), "report": [str(f) for f in files]})
    if not out.json_mode:
        out.out.print(markdown(result, {}), markup=False, highlight=False)
        if files:
            out.line(f"report: {files[0]} (plots and JSON beside it)")


@command()
def pipeline(
    recipe: Annotated[Path, typer.Option("--recipe", help="The recipe that drives every stage.")] = Path(
        "recipes/smollm2-135m-instruct.yaml"
    ),
    prompt: Annotated[str, typer.Option(help="The sample prompt for the run stage.")] = "What is 12 * 7?",
    cache: Annotated[
        bool, typer.Option(help="Reuse profile, heads, calibration and artifact when their inputs are unchanged.")
    ] = True,
    model: Annotated[
        str | None, typer.Option(help="Use this checkpoint instead of the recipe's model (e.g. a local copy).")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Check the recipe against the model and print the plan; run nothing.")
    ] = False,
    threads: ThreadsOpt = None,
) -> None:
    """The worked example: profile, train-heads, calibrate, export, run and bench from one recipe."""
    import time

    from eectl.cache import PipelineCache
    from eectl.pipeline import dry_run as check_recipe
    from eectl.pipeline import plan, with_model

    out = Output()
    if model is not None:  # every stage reads the recipe: give them one that names this model
        recipe = with_model(recipe, model)
    if dry_run:
        _threads(threads, load_recipe(recipe))
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


@command("eval")
def eval_(
    artifact: Annotated[str, typer.Argument(help="Artifact folder from eectl export.")],
    tasks: Annotated[
        str, typer.Option(help="Offline lm-eval tasks: eectl_gsm8k, eectl_gsm8k_loglik, eectl_humaneval.")
    ] = "eectl_gsm8k",
    configs: Annotated[
        str, typer.Option(help="full, copy, defer, verify (the artifact), hf (lm-eval's own hf model).")
    ] = "full,defer",
    gsm8k: Annotated[Path | None, typer.Option(help="GSM8K-format .jsonl for the eectl_gsm8k* tasks.")] = None,
    limit: Annotated[int | None, typer.Option(help="Documents per task (the first N).")] = None,
    num_fewshot: Annotated[int | None, typer.Option(help="Few-shot examples (default: the task's, 0).")] = None,
    max_gen_toks: Annotated[int | None, typer.Option(help="Generation budget per document (task default).")] = None,
    exits: Annotated[str | None, typer.Option(help="Active exits of the early-exit configs, e.g. 20,24.")] = None,
    thresholds: Annotated[str | None, typer.Option(help="0.9, or 12:0.9,20:0.8 (default: the calibration).")] = None,
    threshold_scale: Annotated[float, typer.Option(help="Multiply every threshold by this.")] = 1.0,
    signal: Annotated[str | None, typer.Option(help="Exit signal (default: the calibration's).")] = None,
    allow_code_execution: Annotated[
        bool, typer.Option(help="Let eectl_humaneval run the generated code (in a subprocess) to score it.")
    ] = False,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """lm-evaluation-harness tasks on an artifact, per policy, with deltas against full depth (offline tasks)."""
    import os

    from eectl.lmeval import EvalOptions, markdown, run_eval

    out = Output(json_out)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks read local files; never reach for a hub
    n_threads = _threads(threads, load_recipe(None))
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
    )
    if limit is not None and limit < 1:
        raise UsageError(f"--limit must be >= 1, got {limit}")
    scores, settings = run_eval(artifact, opts, log=out.log)
    out.json({"artifact": artifact, "threads": n_threads, **settings, "scores": [vars(s) for s in scores]})
    if not out.json_mode:
        out.out.print(markdown(scores), markup=False, highlight=False)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
