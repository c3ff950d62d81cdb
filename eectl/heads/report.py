"""The heads' report: before (logit lens) and after (heads) on held-out tokens, and heads.json built from it.

`evaluate` runs the frozen base once per held-out chunk (`base_pass`) or reads prepared passes (a state cache's,
heads/cached.py), and scores every exit as the runner does: agreement with the final layer, KL, and the coverage at
the target precision for the full-vocabulary and the Top-K probability. `heads_meta` assembles heads.json the same
way for every trainer (heads/train.py, heads/cached.py).

What this module does not do: train heads or write files.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eectl.contracts.heads import HeadDims, HeadsMeta
from eectl.errors import DataError
from eectl.exits.base import DEFAULT_TOP_K, ExitHead, TorchExitLogits
from eectl.exits.signals import SIGNALS, ExitScoring
from eectl.exits.thresholds import threshold_for_precision
from eectl.heads.config import TrainConfig
from eectl.models.adapters import Adapter, Capture


@dataclass
class ExitMetrics:
    layer: int
    tokens: int
    agreement: float  # top-1 == final top-1
    kl: float  # KL(final || exit), nats, mean over tokens
    coverage_full: float  # share of tokens exiting at `target` precision, full-vocabulary top-1 probability
    threshold_full: float
    coverage_topk: float  # same with the top-k local-vocabulary probability (candidates from the first exit)
    threshold_topk: float


@dataclass
class EvalResult:
    tokens: int
    exits: list[ExitMetrics]
    oracle_mean_layers: float  # exit at the first exit whose top-1 equals the final one
    sequential_mean_layers: float  # exit at the first exit whose full-vocab prob passes its threshold (in-sample)
    sequential_agreement: float  # agreement of the tokens produced that way with the final layer


@dataclass
class ChunkPass:
    states: dict[int, torch.Tensor]  # exit layer -> [T, H] hidden states after that layer
    probs: torch.Tensor  # [T, V] final-layer distribution (teacher), float32
    entropy: torch.Tensor  # [T] its entropy, nats
    next_ids: torch.Tensor  # [T] next token id, -100 where the chunk ends
    # sequence designs (block) read every position of the sequence: states of all S positions, and which of
    # them are the T measured ones (None: `states` is all there is)
    context: dict[int, torch.Tensor] | None = None  # exit layer -> [S, H]
    measured: torch.Tensor | None = None  # [T] indices into S


@torch.no_grad()
def base_pass(adapter: Adapter, ids: torch.Tensor, exits: list[int], skip_first: int) -> ChunkPass:
    """The frozen base on one chunk [1, S]: exit states and the teacher distribution at the measured positions."""
    keep = Capture(set(exits), select=lambda h: h[0, skip_first:])
    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    final = adapter.forward_layers(adapter.embed(ids), positions, 0, adapter.num_layers, None, capture=keep)
    states = keep.states
    logp = F.log_softmax(adapter.logits(final[0, skip_first:]).float(), dim=-1)  # [T, V]
    probs = logp.exp()
    entropy = -(probs * logp).sum(-1)
    next_ids = torch.full((logp.shape[0],), -100, dtype=torch.long, device=ids.device)
    next_ids[:-1] = ids[0, skip_first + 1 :]
    return ChunkPass(states, probs, entropy, next_ids)


@torch.no_grad()
def evaluate(
    adapter: Adapter,
    variants: dict[str, dict[int, nn.Module | None]],
    chunks: list[torch.Tensor],
    skip_first: int,
    top_k: int = DEFAULT_TOP_K,
    target: float = 0.99,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    passes: Iterable[ChunkPass] | None = None,
) -> dict[str, EvalResult]:
    """Per exit and per variant (a name -> {exit layer: head or None for the logit lens}): agreement with the final
    layer, KL, and the coverage at `target` precision that FlexEE's lambda* gives on these tokens, for the
    full-vocabulary top-1 probability and for the top-k local vocabulary (candidates: top-k of the first exit's full
    logits, as the runner picks them). The base runs once per chunk for all variants.
    """
    L = adapter.num_layers
    exits = sorted(next(iter(variants.values())))
    device = adapter.device
    acc: dict[str, dict[str, list[torch.Tensor]]] = {
        v: {k: [] for k in ("agree", "kl", "conf", "conf_topk", "correct_topk")} for v in variants
    }
    # a sequence head (block) is applied to the whole sequence first; its exit then scores like the logit lens
    exit_logits = {
        name: TorchExitLogits(
            {layer: ExitHead(adapter, None if getattr(h, "sequence", False) else h) for layer, h in heads.items()}
        )
        for name, heads in variants.items()
    }
    local_prob = SIGNALS["topk-prob"]

    def base_passes() -> Iterator[ChunkPass]:
        for ids in chunks:
            with autocast():
                yield base_pass(adapter, ids.to(device), exits, skip_first)

    n = 0
    for run in passes if passes is not None else base_passes():
        top_final = run.probs.argmax(-1)
        logp_final = run.probs.clamp_min(1e-38).log()
        n += top_final.shape[0]
        for name, backend in exit_logits.items():
            agree, kl, conf, conf_k, corr_k = [], [], [], [], []
            scoring = ExitScoring(local_prob, backend, min(top_k, adapter.dims.vocab_size))  # the runner's Top-K rule
            for layer in exits:
                h = run.states[layer]
                raw = variants[name][layer]
                if getattr(raw, "sequence", False):  # a block reads the whole sequence at its exit
                    assert raw is not None and run.context is not None and run.measured is not None
                    with autocast():
                        h = raw(run.context[layer].float())[run.measured]
                with autocast():
                    logits = backend.full(layer, h).float()
                    local = scoring.score(layer, h)
                logq = F.log_softmax(logits, dim=-1)
                agree.append(logq.argmax(-1) == top_final)
                kl.append((run.probs * (logp_final - logq)).sum(-1).double())
                conf.append(logq.max(-1).values.exp())
                conf_k.append(local.values["prob"])
                corr_k.append(local.prediction().token == top_final)
            for key, vals in (
                ("agree", agree),
                ("kl", kl),
                ("conf", conf),
                ("conf_topk", conf_k),
                ("correct_topk", corr_k),
            ):
                acc[name][key].append(torch.stack(vals).cpu())  # [E, T]
    if n == 0:
        raise DataError("no held-out tokens to evaluate on")
    return {name: _summarise(acc[name], exits, n, L, target) for name in variants}


def _summarise(acc: dict[str, list[torch.Tensor]], exits: list[int], n: int, L: int, target: float) -> EvalResult:
    """One variant's per-chunk [E, T] results -> per-exit metrics and the oracle / sequential mean layers."""
    a = {k: torch.cat(v, dim=1) for k, v in acc.items()}  # [E, N]
    metrics = []
    thresholds = []
    for e, layer in enumerate(exits):
        full = threshold_for_precision(a["conf"][e], a["agree"][e], target)
        topk = threshold_for_precision(a["conf_topk"][e], a["correct_topk"][e], target)
        thresholds.append(full.threshold)
        metrics.append(
            ExitMetrics(
                layer=layer,
                tokens=n,
                agreement=float(a["agree"][e].double().mean()),
                kl=float(a["kl"][e].mean()),
                coverage_full=full.coverage,
                threshold_full=full.threshold,
                coverage_topk=topk.coverage,
                threshold_topk=topk.threshold,
            )
        )
    layers = torch.tensor(exits + [L], dtype=torch.float64)
    ones = torch.ones(1, n, dtype=torch.bool)
    oracle = torch.cat([a["agree"], ones]).double().argmax(0)  # first True: the first exit that agrees
    passes = torch.cat([a["conf"] >= torch.tensor(thresholds)[:, None], ones]).double().argmax(0)
    taken_agree = torch.cat([a["agree"], ones]).gather(0, passes[None])[0]
    return EvalResult(
        tokens=n,
        exits=metrics,
        oracle_mean_layers=float(layers[oracle].mean()),
        sequential_mean_layers=float(layers[passes].mean()),
        sequential_agreement=float(taken_agree.double().mean()),
    )


def heads_meta(
    loaded: Any,
    config: TrainConfig,
    exits: list[int],
    report: dict[str, EvalResult],
    report_notes: dict[str, str] | None = None,
    **fields: Any,
) -> HeadsMeta:
    """heads.json as every trainer fills it: design, dimensions, base model, steps, seed and the held-out report
    (before/after, with `report_notes`), plus the trainer's own `fields` (width, head_cost, data, training, ...)."""
    adapter = loaded.adapter
    dims = adapter.dims
    return HeadsMeta(
        exits=exits,
        design=config.design,
        rank=config.rank,
        dimensions=HeadDims(num_layers=dims.num_layers, hidden_size=dims.hidden_size, vocab_size=dims.vocab_size),
        base_model={**loaded.source.to_dict(), "family": adapter.family},
        steps=config.steps,
        seed=config.seed,
        report={
            "tokens": report["after"].tokens,
            "target_precision": config.target,
            "top_k": config.top_k,
            **(report_notes or {}),
            "before": asdict(report["before"]),
            "after": asdict(report["after"]),
        },
        **fields,
    )


def final_kl(history: list[list[float]], exits: list[int], last: int) -> dict[str, float]:
    """KL per exit averaged over the last `last` steps (the end of the loss curve, not one noisy step)."""
    tail = history[-max(1, min(last, len(history))) :]
    return {str(layer): sum(h[e] for h in tail) / len(tail) for e, layer in enumerate(exits)}


def iter_report(meta: HeadsMeta) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(before, after) metrics per exit from a heads.json report."""
    report = meta.report
    yield from zip(report["before"]["exits"], report["after"]["exits"], strict=True)
