"""Exit heads trained from a state cache (eectl.heads.state_cache): no base pass in the loop, so several designs and
losses train from one computation of the frozen model, and the step is bound by the heads rather than the LM head.
The configuration is heads/config.py's TrainConfig, the one the on-the-fly trainer (heads/train.py) takes: its
cache fields (loss, tail samples, block init, ...) apply here, its on-the-fly ones (ce_weight, chunk_len) do not.

One step reads `batch_tokens` measured positions (TokenStream over the cache's training sequences, a function of
(seed, step) only: resumable, and bit-identical on the CPU for a seed) and computes, for all exits at once,

    loss "exact": KL(p_final || q_exit) over the full vocabulary (p_final = softmax of the cached final state)
    loss "topk":  the teacher's top-k + tail-bucket KL (heads.topk_tail_kl): |S| + tail_samples LM-head rows

Block heads (design "block") read the sequence: each piece of a batch runs the block over its sequence's prefix and
keeps the measured rows. The report (held-out split of the cache) is heads_report.evaluate's, with the exact teacher.

What this module does not do: compute the base's states (head_data), or write other formats than heads.save_heads.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eectl.contracts.heads import HeadCost, HeadsMeta, sidecar_path
from eectl.data import TokenStream
from eectl.errors import EectlError, UsageError
from eectl.exits.base import ExitHead
from eectl.exits.candidates import DEFAULT_CANDIDATES, make_source
from eectl.exits.candidates import DEFAULT_SHORTLIST as CANDIDATE_SHORTLIST
from eectl.exits.designs import (
    DESIGNS,
    SEQUENCE_DESIGNS,
    BlockHead,
    HeadStack,
    build_heads,
    check_trained,
    head_cost,
    head_width,
    load_heads,
    save_heads,
)
from eectl.exits.probe import ProbeConfig, ProbeFit, fit_probes
from eectl.heads.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint
from eectl.heads.config import TrainConfig, TrainResult
from eectl.heads.losses import TeacherTopK, topk_tail_kl
from eectl.heads.report import ChunkPass, EvalResult, evaluate, final_kl, heads_meta
from eectl.heads.run_setup import KLLog, lr_at
from eectl.heads.state_cache import StateCache
from eectl.models.adapters import Adapter
from eectl.models.device import device_name, resolve_device, to_device
from eectl.phases import FIXED, Phases


def make_stack(adapter: Adapter, config: TrainConfig) -> HeadStack:
    """The heads of `config.design` at its exits, at their initial values (seeded)."""
    hidden = adapter.dims.hidden_size
    if config.design in DESIGNS:
        return build_heads(config.design, hidden, config.exits, config.rank, config.seed)
    L = adapter.num_layers
    # "next": a copy of the layer the token would run next (index l is decoder layer l + 1)
    heads: dict[int, nn.Module] = {
        layer: BlockHead(adapter, layer if config.block_init == "next" else L - 1, config.block_init == "identity")
        for layer in sorted(config.exits)
    }
    return HeadStack(heads)


def _cached_passes(
    adapter: Adapter, cache: StateCache, split: str, exits: list[int], sources: tuple[str, ...], limit: int
) -> Iterator[ChunkPass]:
    """Held-out sequences of the cache as evaluate() reads them (the exact teacher from the cached final state):
    the first sequences of each source, about `limit` tokens in all, each source in its share of the split."""
    total = max(1, cache.tokens(split))
    chosen = []
    for source in sources:
        budget, got = limit * cache.tokens(split, source) / total, 0
        for entry in cache.split(split, (source,)):
            if got >= budget:
                break
            chosen.append(entry)
            got += entry.tokens
    dev = adapter.device
    for entry in chosen:
        seq = cache.load(entry)
        first = seq.first_measured
        logp = F.log_softmax(adapter.logits(seq.final[first:].to(dev).float()), dim=-1)
        probs = logp.exp()
        context = {layer: seq.states[layer].to(dev) for layer in exits}
        yield ChunkPass(
            states={layer: context[layer][first:].float() for layer in exits},
            probs=probs,
            entropy=-(probs * logp).sum(-1),
            next_ids=torch.full((probs.shape[0],), -100, dtype=torch.long, device=dev),
            context=context,
            measured=torch.arange(first, first + probs.shape[0], device=dev),
        )


def train_cached(
    loaded: Any,
    cache: StateCache,
    config: TrainConfig,
    out: Path,
    resume: Path | None = None,
    on_step: Callable[[int, int, dict[int, float]], None] | None = None,
    log: Callable[[str], None] | None = None,
    phases: Phases | None = None,
) -> TrainResult:
    """Train `config.design` heads from the cache; write `out` (+ .json) and `<out>.ckpt`; report on the held split.

    Moves the model to `config.device`; the cache stays on the host and each step's rows go to the device (the
    index arithmetic is done on the host). `on_step(step, tokens_so_far, kl_per_exit)` after every optimiser step,
    with the latest KL on the host (`KLLog`: up to 15 steps old). The result's phases are `phases` (a new one if
    None) with training, probes and the held-out report added (eectl/phases.py)."""
    say = log or (lambda _m: None)
    phases = phases if phases is not None else Phases()
    adapter = loaded.adapter
    config.exits = sorted(config.exits)
    config.check_cache(cache)
    exits = config.exits
    device = resolve_device(config.device)
    model = loaded.model.eval().requires_grad_(False).to(device)
    t_train = time.perf_counter()  # the training phase: its set-up (the cache's shortlist) and its steps
    entries = cache.split("train", config.sources)
    if not entries:
        raise UsageError(f"the state cache has no training sequences from {config.sources}")
    stream = TokenStream([e.tokens for e in entries], config.batch_tokens, config.seed)
    identity = {**config.identity(from_cache=True), "base_sha256": loaded.source.sha256, "cache": cache.identity}
    torch.manual_seed(config.seed)
    stack = make_stack(adapter, config).to(device)
    optimizer = torch.optim.AdamW(stack.parameters(), lr=config.lr, weight_decay=0.0)
    ckpt = checkpoint_path(out)
    step, history = _resumed(resume, identity, stack, optimizer)
    if resume is not None:
        say(f"resumed from {resume} at step {step}/{config.steps}")
    kl_log = KLLog(history)
    lens = ExitHead(adapter)
    shortlist = cache.frequent_tokens(entries, config.shortlist) if config.shortlist > 0 else None

    start, train_s, steps_from = time.perf_counter(), 0.0, step
    stack.train()
    while step < config.steps:
        t0 = time.perf_counter()
        total, kl = _cached_loss(adapter, lens, cache, entries, stream, stack, config, step, shortlist)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config.steps, config.lr)
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        optimizer.step()
        step += 1
        kl_log.add(kl)  # every 16th step waits for the device here: inside the timed step
        train_s += time.perf_counter() - t0
        if step % config.save_every == 0 or step == config.steps:
            kl_log.flush()  # the checkpoint keeps the history
            save_checkpoint(ckpt, identity, stack, optimizer, step=step, history=history, rng={}, scaler=None)
        if on_step is not None:
            on_step(step, step * config.batch_tokens, kl_log.last(exits))
    kl_log.flush()
    phases.add("train heads", time.perf_counter() - t_train, "train_steps" if steps_from == 0 else FIXED)
    if steps_from > 0:
        phases.reused = f"training resumed at step {steps_from}"
    stack.eval()
    if any(p.requires_grad for p in model.parameters()):
        raise EectlError("internal: a base model parameter was unfrozen during training")
    check_trained(stack, step)
    with phases.time("probes", "probe_tokens"):
        probe_fit = _cached_probes(adapter, cache, config, stack, say)
    with phases.time("held-out report"):
        report = _held_report(adapter, cache, config, stack, say)
    meta = _cached_meta(loaded, cache, config, stream, stack, history, report, train_s)
    meta.probe = None if probe_fit is None else probe_fit.meta()
    result = TrainResult(meta, out, sidecar_path(out), ckpt, phases=phases)
    result.wall_s = time.perf_counter() - start
    meta.training["wall_s"] = round(result.wall_s, 2)
    with phases.time("write heads"):
        save_heads(stack, meta, out)
    return result


def _resumed(
    resume: Path | None, identity: dict[str, Any], stack: HeadStack, optimizer: torch.optim.Optimizer
) -> tuple[int, list[list[float]]]:
    """The step and KL history to continue from: a checkpoint's (its heads and optimiser state loaded into `stack`
    and `optimizer`; refused unless it was written for `identity`), else a fresh start."""
    if resume is None:
        return 0, []
    state = load_checkpoint(resume, identity)
    stack.load_state_dict(state["heads"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"]), [list(h) for h in state["history"]]


def _cached_probes(
    adapter: Adapter, cache: StateCache, config: TrainConfig, stack: HeadStack, say: Callable[[str], None]
) -> ProbeFit | None:
    """The learned signal's probes from the cache (None for a sequence design: a block head reads the sequence, and
    there are no per-token probe features for it yet)."""
    if config.design in SEQUENCE_DESIGNS:
        return None
    probe = ProbeConfig(tokens=config.probe_tokens, seed=config.seed, top_k=config.top_k)
    say(f"fitting exit probes (the learned signal) on up to {probe.tokens} training tokens")
    heads = {layer: stack.head(layer) for layer in config.exits}
    return fit_cached_probes(adapter, cache, heads, probe)


def _held_report(
    adapter: Adapter, cache: StateCache, config: TrainConfig, stack: HeadStack, say: Callable[[str], None]
) -> dict[str, EvalResult]:
    """Before (logit lens) and after (heads) on about `config.eval_tokens` tokens of the cache's held-out split."""
    exits = config.exits
    say(f"evaluating on about {config.eval_tokens} tokens of the cache's held-out split")
    return evaluate(
        adapter,
        {"before": dict.fromkeys(exits), "after": {layer: stack.head(layer) for layer in exits}},
        [],
        0,
        config.top_k,
        config.target,
        passes=_cached_passes(adapter, cache, "held", exits, ("text", "gen"), config.eval_tokens),
    )


def cached_probe_samples(
    cache: StateCache,
    exits: list[int],
    sources: tuple[str, ...] = ("text", "gen"),
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> Iterator[tuple[dict[int, torch.Tensor], torch.Tensor]]:
    """The probes' samples from the cache's training split: (exit states [M, H], the final layer's top-1 [M]) per
    sequence, its measured positions, on `device`, in an order seeded by `seed` (teacher-forced and generated
    sequences mixed, as the runner sees both)."""
    entries = cache.split("train", sources)
    order = torch.randperm(len(entries), generator=torch.Generator().manual_seed(seed)).tolist()
    for i in order:
        seq = cache.load(entries[i])
        first = seq.first_measured
        states = {layer: seq.states[layer][first:].to(device).float() for layer in exits}
        yield states, seq.teacher_ids[:, 0].to(device)


def fit_cached_probes(
    adapter: Adapter,
    cache: StateCache,
    heads: dict[int, nn.Module],
    config: ProbeConfig,
    on_tokens: Callable[[int], None] | None = None,
) -> ProbeFit:
    """Fit the learned signal's probes onto `heads` (attached to them) from the cache's training sequences, with the
    cache's frequency shortlist in the runner's default candidate source."""
    exits = sorted(heads)
    ids = cache.frequent_tokens(cache.split("train"), CANDIDATE_SHORTLIST)
    shortlist = make_source(DEFAULT_CANDIDATES, adapter.lm_head.weight, ids)
    exit_heads = {layer: ExitHead(adapter, heads[layer].to(adapter.device)).eval() for layer in exits}
    samples = cached_probe_samples(cache, exits, seed=config.seed, device=adapter.device)
    return fit_probes(heads, exit_heads, samples, shortlist, config, on_tokens)


def add_probes(
    loaded: Any,
    heads_path: Path,
    cache: StateCache,
    out: Path,
    config: ProbeConfig,
    on_tokens: Callable[[int], None] | None = None,
) -> ProbeFit:
    """`eectl train-heads --probe-only`: fit the learned signal's probes onto an existing heads file (probes it
    already has are replaced) from the cache's training sequences, and write heads + probes to `out` (atomically;
    it may be `heads_path`)."""
    head_set = load_heads(heads_path, loaded)
    if head_set.meta.design in SEQUENCE_DESIGNS:
        raise UsageError("probes for block heads are not supported yet (they read the sequence, not one token)")
    missing = sorted(set(head_set.exits) - set(cache.layers))
    if missing:
        raise UsageError(f"the state cache has no states for exits {missing}", hint=f"it has {cache.layers}")
    fit = fit_cached_probes(loaded.adapter, cache, head_set.heads, config, on_tokens)
    meta = head_set.meta.model_copy(update={"probe": fit.meta(cache=cache.identity)})
    save_heads(HeadStack(head_set.heads), meta, out)
    return fit


def _cached_loss(
    adapter: Adapter,
    lens: ExitHead,
    cache: StateCache,
    entries: list[Any],
    stream: TokenStream,
    stack: HeadStack,
    config: TrainConfig,
    step: int,
    shortlist: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's batch through every exit's head: (the loss summed over exits, KL per exit [E], detached)."""
    exits = config.exits
    sequence = config.design in SEQUENCE_DESIGNS
    autocast: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if config.precision == "bf16":
        autocast = torch.autocast(lens.lm_head_weight.device.type, dtype=torch.bfloat16)
    mapped_parts: dict[int, list[torch.Tensor]] = {layer: [] for layer in exits}
    teachers, finals = [], []
    dev = lens.lm_head_weight.device
    with autocast:
        for i, a, b in stream.batch(step):
            seq = cache.load(entries[i])  # on the host; only this piece's rows go to the device
            lo, hi = seq.first_measured + a, seq.first_measured + b  # the piece's positions in the sequence
            # the teacher stays on the host: topk_tail_kl does its index arithmetic there (rows measured only)
            teachers.append(TeacherTopK(seq.teacher_ids[a:b], seq.teacher_logp[a:b]))
            if config.loss == "exact":
                finals.append(to_device(seq.final[lo:hi], dev))
            for layer in exits:
                head = stack.head(layer)
                if sequence:  # the block sees the prefix of the sequence up to the piece's last row
                    mapped_parts[layer].append(head(to_device(seq.states[layer][:hi], dev).float())[lo:])
                else:
                    mapped_parts[layer].append(head(to_device(seq.states[layer][lo:hi], dev).float()))
        mapped = torch.stack([torch.cat(mapped_parts[layer]) for layer in exits])  # [E, B, H]
        teacher = TeacherTopK.cat(teachers)
        if config.loss == "topk":
            g = torch.Generator().manual_seed(config.seed * 1_000_003 + step)  # resumable: a function of step
            soft_ce, kl = topk_tail_kl(lens, mapped, teacher, config.tail_samples, g, shortlist)
        else:
            with torch.no_grad():
                logp = F.log_softmax(adapter.logits(torch.cat(finals).float()), dim=-1)
                probs = logp.exp()
                entropy = -(probs * logp).sum(-1).mean()
            logits = lens.full(mapped.flatten(0, 1)).float().view(len(exits), -1, probs.shape[-1])
            soft_ce = torch.stack([F.cross_entropy(logits[e], probs) for e in range(len(exits))])
            kl = soft_ce.detach() - entropy
        total = soft_ce.sum()
    return total, kl


def _cached_meta(
    loaded: Any,
    cache: StateCache,
    config: TrainConfig,
    stream: TokenStream,
    stack: HeadStack,
    history: list[list[float]],
    report: dict[str, EvalResult],
    train_s: float,
) -> HeadsMeta:
    """heads.json for heads trained from a state cache (heads.heads_meta plus the cache, loss and block fields)."""
    adapter = loaded.adapter
    exits = config.exits
    sequence = config.design in SEQUENCE_DESIGNS
    cost = design_cost(adapter, config.design, config.rank)
    return heads_meta(
        loaded,
        config,
        exits,
        report,
        width=None if sequence else head_width(config.design, config.rank, adapter.dims.hidden_size),
        head_cost=HeadCost(
            params=int(cost["params"]), macs_per_token=int(cost["macs_per_token"]), layers=cost["layers"]
        ),
        data={
            "state_cache": cache.describe(),
            "sources": list(config.sources),
            "train_tokens": stream.per_epoch,
            "epochs": round(stream.epochs(config.steps), 4),
        },
        training={
            "steps": config.steps,
            "lr": config.lr,
            "batch_tokens": config.batch_tokens,
            "tokens": config.steps * config.batch_tokens,
            "loss": config.loss,
            "teacher_k": cache.identity["spec"]["teacher_k"],
            "tail_samples": config.tail_samples,
            "shortlist": config.shortlist,
            "precision": config.precision,
            "device": device_name(loaded.adapter.device),
            "seed": config.seed,
            "threads": torch.get_num_threads(),
            "train_s": round(train_s, 2),
            "tokens_per_s": round(config.steps * config.batch_tokens / max(train_s, 1e-9), 1),
            "final_kl": final_kl(history, exits, 20),
        },
        block_init=config.block_init if sequence else None,
        block_layers={str(layer): stack.head(layer).init_layer for layer in exits} if sequence else None,
    )


def layer_macs(adapter: Adapter) -> int:
    """Multiply-adds per token of one decoder layer's projections (attention scores not counted)."""
    d = adapter.dims
    kv = d.num_kv_heads * d.head_dim
    return d.hidden_size * (2 * d.num_heads * d.head_dim + 2 * kv) + 3 * d.hidden_size * d.intermediate_size


def design_cost(adapter: Adapter, design: str, rank: int | None) -> dict[str, float]:
    """Per exit: parameters, multiply-adds per token, and that in decoder-layer units (a block is one layer)."""
    per_layer = layer_macs(adapter)
    if design in SEQUENCE_DESIGNS:
        return {"params": per_layer + 2 * adapter.dims.hidden_size, "macs_per_token": per_layer, "layers": 1.0}
    c = head_cost(design, rank, adapter.dims.hidden_size)
    return {**c, "layers": c["macs_per_token"] / per_layer}
