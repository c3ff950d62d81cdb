"""`eectl train-heads` on the fly: per-token exit heads trained against the frozen model's own final layer, the
model computing the training states in the loop (a state cache is the other source: heads/cached.py; both take
heads/config.py's TrainConfig, which refuses a sequence design or a cache folder here).

The head designs and the heads file live in exits/designs.py; this module trains them and reports.

One training step, all exits in one pass (the base runs once per chunk of text, under no_grad):

    ids --embed--> layers 1..L (frozen) --final norm + LM head--> p_final  (teacher, [T, V])
                     | on_layer keeps h_l after each exit layer l
                     v
                   head_l (trainable) --final norm + LM head (frozen)--> q_l ;  loss = sum_l KL(p_final || q_l)
                                                                                  (+ w * next-token CE)

The base weights are frozen and never written: only head parameters are given to the optimiser. Data order is a
function of (seed, step) only, so a run resumed from a checkpoint reads the same tokens as an uninterrupted one
and, on the CPU, ends with bit-identical heads. Under `torchrun` / `accelerate launch` (WORLD_SIZE > 1) each rank
trains on its own shard of the chunks and the heads are wrapped in DistributedDataParallel.

Output: a heads file (head_designs.save_heads); `head_designs.load_heads` reads it back for calibrate and export.
The before/after report and heads.json's metadata are heads/report.py's; the run's rank, device, precision, LR schedule
and RNG state heads/run_setup.py's.

What this module does not do: choose exit thresholds (calibrate), build ONNX graphs (export), load checkpoints.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eectl.contracts.heads import HeadCost, HeadsMeta, sidecar_path
from eectl.data import TokenStream, count_tokens, split_records
from eectl.errors import DataError, EectlError, UsageError
from eectl.exits.base import ExitHead
from eectl.exits.candidates import DEFAULT_CANDIDATES, DEFAULT_SHORTLIST, frequency_shortlist, make_source
from eectl.exits.designs import HeadStack, build_heads, check_trained, head_cost, head_width, save_heads
from eectl.exits.probe import ProbeConfig, ProbeFit, fit_probes
from eectl.heads.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint
from eectl.heads.config import TrainConfig, TrainResult
from eectl.heads.report import ChunkPass, EvalResult, base_pass, evaluate, final_kl, heads_meta
from eectl.heads.run_setup import Dist, KLLog, amp_dtype, dist_from_env, lr_at, rng_state, set_rng_state
from eectl.models.adapters import Adapter
from eectl.models.device import device_name, resolve_device, to_device

# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------


def _lr_at(step: int, config: TrainConfig) -> float:
    return lr_at(step, config.steps, config.lr)


@dataclass
class _TrainData:
    chunks: list[torch.Tensor]  # this rank's training chunks [1, S]
    stream: TokenStream
    train: Any  # TextData: the records before the held-out ones
    held: Any  # TextData: the held-out records at the end
    train_tokens: int  # measured training tokens over all ranks
    skip_first: int  # positions not measured at each chunk's start (BOS)


def _training_data(loaded: Any, data: Any, config: TrainConfig, dist: Dist) -> _TrainData:
    """Held-out records at the end; training chunks from the start, sharded over ranks, in a seeded stream."""
    from eectl.data import token_chunks

    tok = loaded.tokenizer
    skip_first = 1 if getattr(tok, "bos_token_id", None) is not None else 0
    train_data, held_data = split_records(tok, data, config.eval_tokens)
    body = config.chunk_len - skip_first  # measured tokens per chunk
    need = math.ceil(config.steps * config.batch_tokens / body) * body * dist.world  # whole chunks on every rank
    n_train = count_tokens(tok, train_data, need)
    all_chunks = token_chunks(tok, train_data, n_train, config.chunk_len) if n_train > 0 else []
    if len(all_chunks) < dist.world:
        raise DataError(f"{data.name} leaves too few training tokens ({n_train}) after the held-out part")
    all_chunks = all_chunks[: len(all_chunks) - len(all_chunks) % dist.world]  # the same number on every rank
    n_train = sum(c.shape[1] - skip_first for c in all_chunks)
    chunks = all_chunks[dist.rank :: dist.world]
    stream = TokenStream([c.shape[1] - skip_first for c in chunks], config.batch_tokens, config.seed)
    return _TrainData(chunks, stream, train_data, held_data, n_train, skip_first)


@dataclass
class _Trainer:
    """The heads, what trains them (DDP-wrapped across ranks), the optimiser state and the run so far."""

    stack: HeadStack
    module: nn.Module  # `stack`, or DistributedDataParallel(stack)
    optimizer: torch.optim.Optimizer
    scaler: Any  # torch.amp.GradScaler for fp16 autocast, else None
    step: int = 0
    history: list[list[float]] = field(default_factory=list)  # per step, KL per exit


def _make_trainer(
    config: TrainConfig,
    hidden: int,
    exits: list[int],
    device: torch.device,
    amp: torch.dtype | None,
    dist: Dist,
    resume: Path | None,
    identity: dict[str, Any],
    say: Callable[[str], None],
) -> _Trainer:
    """Heads, optimiser, (multi-process) DDP, and the state of a resumed checkpoint."""
    torch.manual_seed(config.seed)
    stack = build_heads(config.design, hidden, exits, config.rank, config.seed).to(device)
    module: nn.Module = stack
    if dist.world > 1:
        import torch.distributed as tdist
        from torch.nn.parallel import DistributedDataParallel

        if not tdist.is_initialized():
            tdist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        module = DistributedDataParallel(stack, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(stack.parameters(), lr=config.lr, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cuda") if amp == torch.float16 else None
    trainer = _Trainer(stack, module, optimizer, scaler)
    if resume is not None:
        state = load_checkpoint(resume, identity)
        stack.load_state_dict(state["heads"])
        optimizer.load_state_dict(state["optimizer"])
        trainer.step = int(state["step"])
        trainer.history = [list(h) for h in state["history"]]
        set_rng_state(state["rng"], device)
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        say(f"resumed from {resume} at step {trainer.step}/{config.steps}")
    return trainer


def _train_loop(
    adapter: Adapter,
    td: _TrainData,
    tr: _Trainer,
    config: TrainConfig,
    exits: list[int],
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
    save: Callable[[], None],
    on_step: Callable[[int, dict[int, float]], None] | None,
) -> None:
    """Optimiser steps until config.steps: KL(final || exit) over every exit in one pass; `save` checkpoints."""
    lens = ExitHead(adapter)  # frozen final norm + LM head; ExitHead(adapter, head).full(h) == lens.full(head(h))
    cache: OrderedDict[int, ChunkPass] = OrderedDict()

    def chunk_pass(c: int) -> ChunkPass:
        if c not in cache:
            with autocast():
                cache[c] = base_pass(adapter, to_device(td.chunks[c], device), exits, td.skip_first)
            while len(cache) > 2:
                cache.popitem(last=False)
        return cache[c]

    kl_log = KLLog(tr.history)
    tr.stack.train()
    while tr.step < config.steps:
        pieces = [(chunk_pass(c), a, b) for c, a, b in td.stream.batch(tr.step)]
        states = {layer: torch.cat([p.states[layer][a:b] for p, a, b in pieces]) for layer in exits}
        probs = torch.cat([p.probs[a:b] for p, a, b in pieces])
        entropy = torch.cat([p.entropy[a:b] for p, a, b in pieces]).mean()
        next_ids = torch.cat([p.next_ids[a:b] for p, a, b in pieces])
        for group in tr.optimizer.param_groups:
            group["lr"] = _lr_at(tr.step, config)
        with autocast():
            mapped = tr.module({layer: s.float() for layer, s in states.items()})
            # All exits through the LM head in one matmul: on a CPU, reading the [V, H] weight dominates small batches.
            logits = lens.full(torch.cat([mapped[layer] for layer in exits])).float()
            logits = logits.view(len(exits), -1, logits.shape[-1])  # [E, B, V]
            labelled = (next_ids >= 0).sum().clamp_min(1)  # the CE's mean over labelled rows, without a host read
            losses, kls = [], []
            for e in range(len(exits)):
                soft_ce = F.cross_entropy(logits[e], probs)  # -sum p log q; KL(p || q) = this - H(p)
                loss = soft_ce
                if config.ce_weight > 0:
                    ce = F.cross_entropy(logits[e], next_ids, ignore_index=-100, reduction="sum") / labelled
                    loss = loss + config.ce_weight * ce
                losses.append(loss)
                kls.append(soft_ce.detach() - entropy)
            total = torch.stack(losses).sum()
        tr.optimizer.zero_grad(set_to_none=True)
        if tr.scaler is not None:
            tr.scaler.scale(total).backward()
            tr.scaler.step(tr.optimizer)
            tr.scaler.update()
        else:
            total.backward()
            tr.optimizer.step()
        tr.step += 1
        kl_log.add(torch.stack(kls))
        if tr.step % config.save_every == 0 or tr.step == config.steps:
            kl_log.flush()  # the checkpoint keeps the history
        save()
        if on_step is not None:
            on_step(tr.step, kl_log.last(exits))
    kl_log.flush()
    tr.stack.eval()


def _fit_probes(
    adapter: Adapter,
    td: _TrainData,
    stack: HeadStack,
    exits: list[int],
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
    config: ProbeConfig,
) -> ProbeFit:
    """The learned signal's probes from the training chunks (one more base pass over them, in order), with the
    chunks' frequency shortlist in the runner's default candidate source."""
    heads = {layer: stack.head(layer) for layer in exits}
    vocab = adapter.dims.vocab_size
    ids = frequency_shortlist(torch.cat([c[0] for c in td.chunks]), DEFAULT_SHORTLIST, vocab)
    source = make_source(DEFAULT_CANDIDATES, adapter.lm_head.weight, ids)
    exit_heads = {layer: ExitHead(adapter, heads[layer]).eval() for layer in exits}

    def samples() -> Iterator[tuple[dict[int, torch.Tensor], torch.Tensor]]:
        for chunk in td.chunks:
            with autocast():
                p = base_pass(adapter, chunk.to(device), exits, td.skip_first)
            yield {layer: s.float() for layer, s in p.states.items()}, p.probs.argmax(-1)  # fitted on the device

    return fit_probes(heads, exit_heads, samples(), source, config)


def _metadata(
    loaded: Any,
    data: Any,
    config: TrainConfig,
    exits: list[int],
    td: _TrainData,
    tr: _Trainer,
    report: dict[str, EvalResult],
    device: torch.device,
    amp: torch.dtype | None,
    world: int,
    train_s: float,
) -> HeadsMeta:
    """What heads.json says: design, dimensions, base model, data, training and the held-out report."""
    hidden = loaded.adapter.dims.hidden_size
    return heads_meta(
        loaded,
        config,
        exits,
        report,
        report_notes={
            "signals": (
                "coverage_full: exit's full-vocabulary top-1 probability; coverage_topk: its probability over the "
                "top-k local vocabulary picked at the first exit; coverage = share of held-out tokens at or above "
                "the lowest threshold whose exits agree with the final layer at the target precision"
            )
        },
        width=head_width(config.design, config.rank, hidden),
        head_cost=HeadCost(**head_cost(config.design, config.rank, hidden)),
        data={
            **data.to_dict(),
            "train_records_available": len(td.train.texts),
            "train_tokens": td.train_tokens,
            "epochs": round(td.stream.epochs(config.steps), 4),
            "held_out_records": len(td.held.texts),
            "held_out_tokens": config.eval_tokens,
            "chunk_len": config.chunk_len,
            "held_out": "the last records of the data; training reads the records before them",
        },
        training={
            "steps": config.steps,
            "lr": config.lr,
            "schedule": "linear warm-up 5%, cosine to 10%",
            "batch_tokens": config.batch_tokens,
            "ce_weight": config.ce_weight,
            "seed": config.seed,
            "device": device_name(device),
            "precision": "fp32" if amp is None else f"autocast {str(amp).removeprefix('torch.')}",
            "world_size": world,
            "threads": torch.get_num_threads(),
            "train_s": round(train_s, 2),
            "final_kl": final_kl(tr.history, exits, 50),
        },
    )


def train_heads(
    loaded: Any,
    data: Any,
    config: TrainConfig,
    out: Path,
    resume: Path | None = None,
    on_step: Callable[[int, dict[int, float]], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> TrainResult:
    """The stage as a library call: a LoadedModel, TextData and a TrainConfig in; heads on disk and a report out.

    Moves the model to `config.device`. Writes `out` (.safetensors) and its .json sidecar, and a checkpoint
    (checkpoint_path(out)) every `config.save_every` steps and at the end. `on_step(step, kl_per_exit)` is
    called after each optimiser step (1-based), on the main rank only, with the latest KL on the host (`KLLog`:
    brought over every 16 steps and at checkpoints, so up to 15 steps old; empty before the first block).
    """
    from eectl.data import TextData
    from eectl.models.loading import LoadedModel

    assert isinstance(loaded, LoadedModel) and isinstance(data, TextData)
    say = log or (lambda _msg: None)
    adapter = loaded.adapter
    config.check(adapter.num_layers)
    if out.suffix != ".safetensors":
        raise UsageError(f"--out must name a .safetensors file, got {out}")
    dist = dist_from_env()
    device = resolve_device(config.device, dist.local_rank)
    amp = amp_dtype(device)
    exits = sorted(config.exits)
    ckpt = checkpoint_path(out)
    start = time.perf_counter()

    # The base: frozen, eval, never handed to the optimiser.
    model = loaded.model
    model.eval().requires_grad_(False).to(device)
    td = _training_data(loaded, data, config, dist)
    identity = _identity(loaded, data, config, exits, td, dist)
    tr = _make_trainer(config, adapter.dims.hidden_size, exits, device, amp, dist, resume, identity, say)
    if any(p.requires_grad for p in model.parameters()):
        raise EectlError("internal: a base model parameter requires grad")
    autocast = _autocast(device, amp)

    def save() -> None:
        if dist.main and (tr.step % config.save_every == 0 or tr.step == config.steps):
            scaler = tr.scaler.state_dict() if tr.scaler is not None else None
            rng = rng_state(device)
            save_checkpoint(
                ckpt, identity, tr.stack, tr.optimizer, step=tr.step, history=tr.history, rng=rng, scaler=scaler
            )

    _train_loop(adapter, td, tr, config, exits, device, autocast, save, on_step if dist.main else None)
    train_s = time.perf_counter() - start
    if any(p.requires_grad for p in model.parameters()):
        raise EectlError("internal: a base model parameter was unfrozen during training")
    check_trained(tr.stack, tr.step)
    probe_fit = None
    if dist.main:
        say(f"fitting exit probes (the learned signal) on up to {ProbeConfig().tokens} training tokens")
        probes = ProbeConfig(seed=config.seed, top_k=config.top_k)
        probe_fit = _fit_probes(adapter, td, tr.stack, exits, device, autocast, probes)

    result = TrainResult(None, out, sidecar_path(out), ckpt, main=dist.main)
    if dist.world > 1 and not dist.main:
        _end_ranks()  # wait for the main rank's evaluation and files
        result.wall_s = time.perf_counter() - start
        return result
    report = _held_out_report(loaded, config, exits, td, tr, autocast, say)
    meta = _metadata(loaded, data, config, exits, td, tr, report, device, amp, dist.world, train_s)
    meta.probe = None if probe_fit is None else probe_fit.meta()
    result.wall_s = time.perf_counter() - start
    meta.training["wall_s"] = round(result.wall_s, 2)  # training + held-out evaluation
    save_heads(tr.stack, meta, out)
    result.meta = meta
    if dist.world > 1:
        _end_ranks()
    return result


def _identity(
    loaded: Any, data: Any, config: TrainConfig, exits: list[int], td: _TrainData, dist: Dist
) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: the configuration, exits, base model, data and world size."""
    return {
        **config.identity(from_cache=False),
        "exits": exits,
        "base_sha256": loaded.source.sha256,
        "data": data.name,
        "train_tokens": td.train_tokens,
        "world_size": dist.world,
    }


def _autocast(device: torch.device, amp: torch.dtype | None) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """A context for the forward passes: autocast to `amp` under mixed precision, else a null context (fp32)."""

    def autocast() -> contextlib.AbstractContextManager[Any]:
        if amp is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=amp)

    return autocast


def _held_out_report(
    loaded: Any,
    config: TrainConfig,
    exits: list[int],
    td: _TrainData,
    tr: _Trainer,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
    say: Callable[[str], None],
) -> dict[str, EvalResult]:
    """Report on held-out data, before (logit lens) and after (heads), in one pass of the base."""
    from eectl.data import token_chunks

    held_chunks = token_chunks(loaded.tokenizer, td.held, config.eval_tokens, config.chunk_len)
    say(f"evaluating on {config.eval_tokens} held-out tokens ({len(td.held.texts)} records at the end of the data)")
    return evaluate(
        loaded.adapter,
        {"before": dict.fromkeys(exits), "after": {layer: tr.stack.head(layer) for layer in exits}},
        held_chunks,
        td.skip_first,
        config.top_k,
        config.target,
        autocast,
    )


def _end_ranks() -> None:
    """A multi-process run's end on every rank: wait for the others, then leave the process group."""
    import torch.distributed as tdist

    tdist.barrier()
    tdist.destroy_process_group()
