"""The train-heads stage as one library call: a recipe and a request in, trained heads (or probes) written and their
result out.

What `eectl train-heads` and the pipeline both run: one TrainConfig (heads/config.py) built from the request and the
recipe, trained from where its states come from: the model on the fly (heads/train.py, per-token designs) or a state
cache, built or reused first (heads/state_cache_build.py, heads/cached.py; every design); or only the learned
signal's probes onto an existing heads file. A request's None fields take the recipe's values; the caller has set up
the thread pools (cli.app.set_threads). What this module does not do: print results.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eectl.contracts.layers import default_exits
from eectl.contracts.recipe import Recipe, pick
from eectl.errors import UsageError
from eectl.files import existing_file
from eectl.heads.config import CACHED_BATCH_TOKENS, DEFAULT_BATCH_TOKENS, TrainConfig, TrainResult
from eectl.output import Output
from eectl.output_checks import check_folder_option, check_outputs, input_file


@dataclass
class HeadsRequest:
    model: str | None = None  # None: the recipe's
    data: str | None = None
    field: str | None = None
    exits: list[int] | None = None  # None: the recipe's, else the model's default_exits
    steps: int | None = None
    design: str | None = None
    rank: int | None = None
    lr: float | None = None
    batch_tokens: int | None = None  # None: the recipe's heads.batch_tokens, else 32 per token, 256 from a cache
    ce_weight: float = 0.0
    eval_tokens: int | None = None
    seed: int = 0
    save_every: int = 100
    resume: Path | None = None
    device: str = "auto"  # auto: a CUDA GPU when torch sees one, else the CPU (models/device.py)
    out: Path | None = None  # None: artifacts/<model>-heads.safetensors
    cache: Path | None = None  # the state cache folder (None: the recipe's heads.cache)
    tokens: int | None = None  # with a state cache: training tokens
    gen_share: float | None = None
    loss: str | None = None
    block_init: str = "last"
    probe_only: bool = False  # only fit the learned signal's probes onto `heads`, from the state cache
    heads: Path | None = None
    probe_tokens: int | None = None
    probe_hidden: int | None = None
    recipe_file: Path | None = None  # the recipe's file: an input no output may land on
    threads: int | None = None  # the thread count set up by the caller (reported)


@dataclass
class ProbesResult:
    out: Path  # the heads file written with the probes
    fit: Any  # heads.cached's probe fit (agreement, chosen, tokens, train_s)


def train_heads(recipe: Recipe, req: HeadsRequest, out: Output) -> TrainResult | ProbesResult:
    """Heads trained (or, with probe_only, probes fitted) and written; every output checked first against every
    input and the state cache it reads."""
    r = recipe
    cache_dir = req.cache or (Path(r.heads.cache) if r.heads.cache else None)
    check_folder_option(cache_dir, "--cache")  # a file there: FileExistsError at the mkdir, after the model loaded
    if req.out is not None and req.out.suffix != ".safetensors":  # all three ways below write a heads file there
        raise UsageError(f"--out must name a .safetensors file, got {req.out}")
    # every way below writes --out and its sidecars: none may land on an input or inside the state cache it reads
    check_outputs([("--out", req.out, heads_sidecars(req.out))], _inputs(r, req), [("--cache", cache_dir)])
    if req.probe_only:
        _unread(req, "--probe-only")
        return _probe_only(r, req, cache_dir, out)
    config = _config(r, req, cache_dir)
    _unread(req, "a state cache" if config.from_cache else "on the fly")
    if config.from_cache:  # a cache folder given, or a sequence design (they train from a cache only)
        return _train_cached(r, req, config, out)
    return _train_per_token(r, req, config, out)


# The options each way of training does not read (request field -> its option): given, each was dropped, silently.
# On the fly: the state cache's and the probes' (probes are fitted from a cache); from a cache: --steps (its steps are
# --tokens over --batch-tokens), --ce-weight, --probe-hidden (--probe-only's); --probe-only: every training option.
_UNREAD = {
    "on the fly": ("tokens", "gen_share", "loss", "block_init", "probe_tokens", "probe_hidden", "heads"),
    "a state cache": ("steps", "ce_weight", "probe_hidden", "heads"),
    "--probe-only": (
        *("exits", "steps", "design", "rank", "lr", "batch_tokens", "ce_weight", "eval_tokens", "save_every"),
        *("resume", "tokens", "gen_share", "loss", "block_init"),
    ),
}


def _unread(req: HeadsRequest, way: str) -> None:
    """Refuse an option that training `way` does not read, given (set away from the request's default)."""
    default = HeadsRequest()
    for name in _UNREAD[way]:
        if getattr(req, name) != getattr(default, name):
            flag = f"--{name.replace('_', '-')}"
            hint = "from a state cache, the steps are --tokens / --batch-tokens" if name == "steps" else f"drop {flag}"
            raise UsageError(f"{flag} is not read when train-heads {_WAYS[way]}", hint=hint)


_WAYS = {
    "on the fly": "trains on the fly (no --cache)",
    "a state cache": "trains from a state cache",
    "--probe-only": "fits probes only (--probe-only)",
}


def heads_sidecars(path: Path | None) -> list[Path]:
    """What train-heads writes beside its heads file: the metadata JSON and the resumable checkpoint."""
    from eectl.contracts.heads import sidecar_path
    from eectl.heads.checkpoint import checkpoint_path

    return [] if path is None else [sidecar_path(path), checkpoint_path(path)]


def _inputs(r: Recipe, req: HeadsRequest) -> list[tuple[str, Path | None]]:
    ins = [("--data", input_file(pick(req.data, r.data.source))), ("--resume", req.resume), ("--heads", req.heads)]
    return [*ins, ("--recipe", input_file(req.recipe_file))]


def _config(r: Recipe, req: HeadsRequest, cache_dir: Path | None) -> TrainConfig:
    """The run's one configuration: the request's values, else the recipe's. From a state cache the batch's default
    is larger, and the steps are the training tokens (--tokens, heads.tokens) over the batch."""
    config = TrainConfig(
        exits=pick(req.exits, r.exits or []),
        design=pick(req.design, r.heads.design),
        rank=pick(req.rank, r.heads.rank),
        steps=pick(req.steps, r.heads.steps),
        lr=pick(req.lr, r.heads.lr),
        seed=req.seed,
        eval_tokens=pick(req.eval_tokens, r.heads.eval_tokens),
        save_every=req.save_every,
        device=req.device,
        top_k=r.top_k,
        target=r.target,
        ce_weight=req.ce_weight,
        cache=cache_dir,
        block_init=req.block_init,
        loss=pick(req.loss, r.heads.loss),
        probe_tokens=pick(req.probe_tokens, r.heads.probe_tokens),
    )
    batch = pick(req.batch_tokens, r.heads.batch_tokens)
    if config.from_cache:
        config.batch_tokens = batch or CACHED_BATCH_TOKENS
        config.steps = max(1, pick(req.tokens, r.heads.tokens) // config.batch_tokens)
    else:
        config.batch_tokens = batch or DEFAULT_BATCH_TOKENS
    return config


def _train_per_token(r: Recipe, req: HeadsRequest, config: TrainConfig, out: Output) -> TrainResult:
    """Per-token designs trained on the fly from the frozen model's own final layer."""
    from eectl.data import load_text_data
    from eectl.heads.checkpoint import check_checkpoint
    from eectl.heads.train import train_heads as train
    from eectl.models import load_model
    from eectl.models.device import device_name, resolve_device

    config.check()  # before the model loads (no exits yet: the model's default_exits)
    if req.resume is not None:
        check_checkpoint(req.resume)
    device = device_name(resolve_device(req.device))  # a missing GPU refused before the model loads
    text = load_text_data(pick(req.data, r.data.source), pick(req.field, r.data.field))
    out.log(f"loading {pick(req.model, r.model) or 'the default model (SmolLM2-135M-Instruct)'}")
    loaded = load_model(pick(req.model, r.model), log=out, int4=r.int4_twin())
    config.exits = config.exits or default_exits(loaded.adapter.num_layers)
    config.check(loaded.adapter.num_layers)
    path = req.out or Path("artifacts") / f"{loaded.source.name}-heads.safetensors"
    check_outputs([("--out", path, heads_sidecars(path))], _inputs(r, req), [("--cache", req.cache)])
    out.log(
        f"training {config.design} heads at exits {sorted(config.exits)} for {config.steps} steps of "
        f"{config.batch_tokens} tokens of {text.name}, on {device}, {req.threads} threads"
    )
    with out.progress("train-heads", total=config.steps) as bar:
        on_step = _on_step(bar, config.batch_tokens)
        return train(loaded, text, config, path, req.resume, on_step=on_step, log=out.log)


def _on_step(bar: Any, batch: int) -> Any:
    """The progress bar's advance per optimiser step: tokens/s and each exit's KL (a resumed run starts the bar at
    its checkpoint's step)."""
    shown: list[int] = []
    t0 = time.perf_counter()

    def on_step(step: int, kl: dict[int, float]) -> None:
        if not shown:
            shown.append(step - 1)
        rate = (step - shown[0]) * batch / max(time.perf_counter() - t0, 1e-9)
        info = f"{rate:.0f} tokens/s, KL " + " ".join(f"{layer}:{v:.2f}" for layer, v in kl.items())
        bar.advance(step - shown[-1], info=info)
        shown.append(step)

    return on_step


def _train_cached(r: Recipe, req: HeadsRequest, config: TrainConfig, out: Output) -> TrainResult:
    """Heads from a state cache: build (or reuse, or extend) it, then train from it with progress and ETA."""
    from eectl.data import load_text_data
    from eectl.heads.cached import train_cached
    from eectl.heads.state_cache import CacheSpec
    from eectl.heads.state_cache_build import build_cache
    from eectl.models import load_model
    from eectl.models.device import device_name, resolve_device
    from eectl.phases import Phases

    phases = Phases()
    device = resolve_device(config.device)  # a missing GPU refused before the model loads
    with phases.time("load data and model"):
        text = load_text_data(pick(req.data, r.data.source), pick(req.field, r.data.field))
        loaded = load_model(pick(req.model, r.model), log=out, int4=r.int4_twin())
        loaded.model.to(device)  # the cache is built there too
    config.exits = config.exits or default_exits(loaded.adapter.num_layers)
    n = pick(req.tokens, r.heads.tokens)
    spec = CacheSpec.for_budget(config.exits, n, pick(req.gen_share, r.heads.gen_share), config.eval_tokens)
    config.cache = folder = config.cache or Path("artifacts") / f"{loaded.source.name}-states"
    path = req.out or Path("artifacts") / f"{loaded.source.name}-heads.safetensors"
    check_outputs([("--out", path, heads_sidecars(path))], [], [("--cache", folder)])  # before the cache is built
    total = spec.text_tokens + spec.gen_tokens + spec.eval_text_tokens + spec.eval_gen_tokens
    with out.progress("base states", total=total) as bar:
        start = time.perf_counter()
        done = [0]

        def on_tokens(k: int) -> None:
            done[0] += k
            bar.advance(k, info=f"{done[0] / max(time.perf_counter() - start, 1e-9):.0f} tokens/s")

        state_cache = build_cache(loaded, text, spec, folder, on_tokens, out.log, phases)
    batch = config.batch_tokens
    out.log(
        f"training {config.design} heads at exits {config.exits}: {config.steps} steps of {batch} tokens from "
        f"{folder} ({config.loss} loss), on {device_name(device)}, {req.threads} threads"
    )
    with out.progress("train-heads", total=config.steps) as bar:
        on_step = _on_step(bar, batch)
        return train_cached(
            loaded, state_cache, config, path, req.resume, lambda s, _, kl: on_step(s, kl), out.log, phases
        )


def _probe_only(r: Recipe, req: HeadsRequest, cache_dir: Path | None, out: Output) -> ProbesResult:
    """The probes fitted onto an existing heads file, from a state cache."""
    from eectl.exits.probe import ProbeConfig
    from eectl.heads.cached import add_probes
    from eectl.heads.state_cache import open_cache
    from eectl.models import load_model
    from eectl.models.device import device_name, resolve_device

    heads = req.heads
    if heads is None or cache_dir is None:
        raise UsageError("--probe-only needs --heads FILE and --cache DIR (the state cache the probes read)")
    existing_file(heads, "heads", UsageError)
    target = req.out or heads
    if target.suffix != ".safetensors":
        raise UsageError(f"--out must name a .safetensors file, got {target}")
    cache = open_cache(cache_dir)
    given = {"tokens": req.probe_tokens, "hidden": req.probe_hidden}
    config = ProbeConfig(seed=req.seed, top_k=r.top_k, **{k: v for k, v in given.items() if v is not None})
    if config.tokens < 1:
        raise UsageError("--probe-tokens must be positive")
    if config.hidden < 0:
        raise UsageError("--probe-hidden must be >= 0")
    device = resolve_device(req.device)
    loaded = load_model(pick(req.model, r.model), log=out, int4=r.int4_twin())
    loaded.model.to(device)
    out.log(
        f"fitting exit probes onto {heads} from {config.tokens} tokens of {cache_dir}, on {device_name(device)}, "
        f"{req.threads} threads"
    )
    with out.progress("probes", total=config.tokens) as bar:
        fit = add_probes(loaded, heads, cache, target, config, on_tokens=lambda n: bar.advance(n))
    return ProbesResult(target, fit)
