"""`eectl train-heads`: options, the call into heads/train.py (or, from a state cache, heads/state_cache.py and
heads/cached.py), the
before/after report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from eectl.cli.app import JsonOpt, ModelArg, RecipeOpt, ThreadsOpt, command, set_threads
from eectl.contracts.layers import default_exits, parse_layers
from eectl.contracts.recipe import Recipe, load_recipe, pick
from eectl.errors import UsageError
from eectl.files import check_folder_option, check_outputs, existing_file, input_file
from eectl.output import Output


@command("train-heads")
def train_heads(
    model: ModelArg = None,
    data: Annotated[
        str | None, typer.Option(help="Text file, .jsonl, or built-in name (humaneval).", rich_help_panel="Data")
    ] = None,
    field: Annotated[
        str | None, typer.Option(help="The .jsonl field to read (detected by default).", rich_help_panel="Data")
    ] = None,
    exits: Annotated[
        str | None,
        typer.Option(help="Exit after these layers, comma-separated, e.g. 8,12,16.", rich_help_panel="Heads"),
    ] = None,
    steps: Annotated[
        int | None, typer.Option(help="Optimiser steps (default: the recipe's, 500).", rich_help_panel="Training")
    ] = None,
    design: Annotated[
        str | None,
        typer.Option(help="residual-linear, low-rank, mlp, or block (block: from a --cache).", rich_help_panel="Heads"),
    ] = None,
    rank: Annotated[
        int | None,
        typer.Option(help="Rank of low-rank heads (64) or width of mlp heads (H/2).", rich_help_panel="Heads"),
    ] = None,
    lr: Annotated[
        float | None,
        typer.Option(help="Peak learning rate (AdamW; warm-up, cosine decay).", rich_help_panel="Training"),
    ] = None,
    batch_tokens: Annotated[int, typer.Option(help="Tokens per step (per process).", rich_help_panel="Training")] = 32,
    ce_weight: Annotated[
        float, typer.Option(help="Weight of next-token cross-entropy added to the KL.", rich_help_panel="Training")
    ] = 0.0,
    eval_tokens: Annotated[
        int | None,
        typer.Option(
            help="Held-out tokens (the data's last records) for the report (default: 4096).", rich_help_panel="Data"
        ),
    ] = None,
    seed: Annotated[
        int, typer.Option(help="Seed of head initialisation and data order.", rich_help_panel="Training")
    ] = 0,
    save_every: Annotated[
        int, typer.Option(help="Write the checkpoint (.ckpt.safetensors) every N steps.", rich_help_panel="Training")
    ] = 100,
    resume: Annotated[
        Path | None, typer.Option(help="Continue from this checkpoint (.ckpt.safetensors).", rich_help_panel="Training")
    ] = None,
    device: Annotated[str, typer.Option(help="cpu, or cuda (mixed precision).", rich_help_panel="Training")] = "cpu",
    out_path: Annotated[
        Path | None,
        typer.Option(
            "--out", help="heads .safetensors (default: artifacts/<model>-heads.safetensors).", rich_help_panel="Output"
        ),
    ] = None,
    cache: Annotated[
        Path | None,
        typer.Option(
            help="State cache folder: the base runs once into it, heads train from it.", rich_help_panel="State cache"
        ),
    ] = None,
    tokens: Annotated[
        int | None,
        typer.Option(
            help="With --cache: training tokens (default: the recipe's, 16384).", rich_help_panel="State cache"
        ),
    ] = None,
    gen_share: Annotated[
        float | None,
        typer.Option(help="With --cache: share of generated tokens (default: 0.25).", rich_help_panel="State cache"),
    ] = None,
    loss: Annotated[
        str | None,
        typer.Option(help="With --cache: topk (teacher top-k + tail) or exact.", rich_help_panel="State cache"),
    ] = None,
    block_init: Annotated[
        str, typer.Option(help="block design: last, next or identity.", rich_help_panel="Heads")
    ] = "last",
    probe_only: Annotated[
        bool,
        typer.Option(
            "--probe-only",
            help="Only fit the learned signal's probes onto --heads (from --cache), write --out.",
            rich_help_panel="Probes",
            metavar="",
        ),
    ] = False,
    heads: Annotated[
        Path | None,
        typer.Option(help="With --probe-only: the heads file to fit probes onto.", rich_help_panel="Probes"),
    ] = None,
    probe_tokens: Annotated[
        int | None,
        typer.Option(help="Training tokens the probes are fitted on (default: 131072).", rich_help_panel="Probes"),
    ] = None,
    probe_hidden: Annotated[
        int | None,
        typer.Option(
            help="Hidden units of the MLP probe, kept per exit where it beats a logistic one (default: 32; 0: never).",
            rich_help_panel="Probes",
        ),
    ] = None,
    recipe: RecipeOpt = None,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Light exit heads trained against the frozen model's own final layer (KL), reported before and after."""
    import time

    from eectl.data import load_text_data
    from eectl.exits.designs import SEQUENCE_DESIGNS
    from eectl.heads.checkpoint import check_checkpoint
    from eectl.heads.train import TrainConfig, resolve_device
    from eectl.heads.train import train_heads as train
    from eectl.models import load_model

    out = Output(json_out)
    r = load_recipe(recipe)
    cache_dir = cache or (Path(r.heads.cache) if r.heads.cache else None)
    check_folder_option(cache_dir, "--cache")  # a file there: FileExistsError at the mkdir, after the model loaded
    if out_path is not None and out_path.suffix != ".safetensors":  # all three ways below write a heads file there
        raise UsageError(f"--out must name a .safetensors file, got {out_path}")
    ins = [("--data", input_file(pick(data, r.data.source))), ("--resume", resume), ("--heads", heads)]
    ins.append(("--recipe", input_file(recipe)))
    # every way below writes --out and its sidecars: none may land on an input or inside the state cache it reads
    check_outputs([("--out", out_path, _heads_sidecars(out_path))], ins, [("--cache", cache_dir)])
    if probe_only:
        _probe_only(out, r, model, heads, cache_dir, out_path, probe_tokens, probe_hidden, seed, threads)
        return
    if cache_dir is not None or pick(design, r.heads.design) in SEQUENCE_DESIGNS:  # those train from a cache only
        _train_heads_cached(
            out,
            r,
            model=model,
            data=data,
            field=field,
            exits=exits,
            design=design,
            rank=rank,
            lr=lr,
            seed=seed,
            save_every=save_every,
            resume=resume,
            out_path=out_path,
            cache_dir=cache_dir,
            tokens=tokens,
            gen_share=gen_share,
            loss=loss,
            block_init=block_init,
            eval_tokens=pick(eval_tokens, r.heads.eval_tokens),
            threads=threads,
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
    if resume is not None:
        check_checkpoint(resume)
    resolve_device(device)
    n_threads = set_threads(threads, r)
    text = load_text_data(pick(data, r.data.source), pick(field, r.data.field))
    out.log(f"loading {pick(model, r.model) or 'the default model (SmolLM2-135M-Instruct)'}")
    loaded = load_model(pick(model, r.model), log=out)
    config.exits = config.exits or default_exits(loaded.adapter.num_layers)
    config.check(loaded.adapter.num_layers)
    path = out_path or Path("artifacts") / f"{loaded.source.name}-heads.safetensors"
    check_outputs([("--out", path, _heads_sidecars(path))], ins, [("--cache", cache)])
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


def _heads_sidecars(path: Path | None) -> list[Path]:
    """What train-heads writes beside its heads file: the metadata JSON and the resumable checkpoint."""
    from eectl.contracts.heads import sidecar_path
    from eectl.heads.checkpoint import checkpoint_path

    return [] if path is None else [sidecar_path(path), checkpoint_path(path)]


def _train_heads_cached(
    out: Output,
    r: Recipe,
    *,
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
    from eectl.heads.cached import CachedConfig, train_cached
    from eectl.heads.state_cache import CacheSpec
    from eectl.heads.state_cache_build import build_cache
    from eectl.models import load_model

    n_threads = set_threads(threads, r)
    text = load_text_data(pick(data, r.data.source), pick(field, r.data.field))
    loaded = load_model(pick(model, r.model), log=out)
    layers = pick(parse_layers(exits), r.exits or []) or default_exits(loaded.adapter.num_layers)
    n = pick(tokens, r.heads.tokens)
    spec = CacheSpec.for_budget(layers, n, pick(gen_share, r.heads.gen_share), eval_tokens)
    folder = cache_dir or Path("artifacts") / f"{loaded.source.name}-states"
    path = out_path or Path("artifacts") / f"{loaded.source.name}-heads.safetensors"
    check_outputs([("--out", path, _heads_sidecars(path))], [], [("--cache", folder)])  # before the cache is built
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


def _probe_only(
    out: Output,
    r: Recipe,
    model: str | None,
    heads: Path | None,
    cache_dir: Path | None,
    out_path: Path | None,
    probe_tokens: int | None,
    probe_hidden: int | None,
    seed: int,
    threads: int | None,
) -> None:
    """train-heads --probe-only: the probes fitted onto an existing heads file, from a state cache."""
    from eectl.exits.probe import ProbeConfig
    from eectl.heads.cached import add_probes
    from eectl.heads.state_cache import open_cache
    from eectl.models import load_model

    if heads is None or cache_dir is None:
        raise UsageError("--probe-only needs --heads FILE and --cache DIR (the state cache the probes read)")
    existing_file(heads, "heads", UsageError)
    target = out_path or heads
    if target.suffix != ".safetensors":
        raise UsageError(f"--out must name a .safetensors file, got {target}")
    cache = open_cache(cache_dir)
    given = {"tokens": probe_tokens, "hidden": probe_hidden}
    config = ProbeConfig(seed=seed, top_k=r.top_k, **{k: v for k, v in given.items() if v is not None})
    if config.tokens < 1:
        raise UsageError("--probe-tokens must be positive")
    if config.hidden < 0:
        raise UsageError("--probe-hidden must be >= 0")
    n_threads = set_threads(threads, r)
    loaded = load_model(pick(model, r.model), log=out)
    out.log(f"fitting exit probes onto {heads} from {config.tokens} tokens of {cache_dir}, {n_threads} threads")
    with out.progress("probes", total=config.tokens) as bar:
        fit = add_probes(loaded, heads, cache, target, config, on_tokens=lambda n: bar.advance(n))
    out.json({"heads": str(target), "probe": fit.to_dict()})
    out.log(
        f"probes for exits {', '.join(fit.agreement)} fitted on {fit.tokens} tokens in {fit.train_s:.1f} s "
        f"(label rate {' '.join(f'{k}:{v:.3f}' for k, v in fit.agreement.items())}; kept "
        f"{' '.join(f'{k}:{v}' for k, v in fit.chosen.items())}); wrote {target}"
    )


def _print_heads(out: Output, result: object) -> None:
    from eectl.heads.report import iter_report
    from eectl.heads.train import TrainResult

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
