"""Fitting the `learned` exit signal's probes (exits.Probe): per exit, a logistic regression on the exit's normed
state and its local softmax's prob and margin, predicting "the exit's top-1 over its K candidates is the final
layer's top-1".

Both trainers call `fit_probes` after their heads are trained (heads.py on its chunk passes, heads_cached.py on its
cached sequences), and `eectl train-heads --probe-only` fits probes onto an existing heads file: every caller hands
over (exit states, teacher top-1) samples of its own training tokens. Features are measured as the runner measures
them (exits.ExitScoring on the head's ExitHead, the given candidate source), each exit scored as if it were the
first active one (its own K candidates): the probe then means the same at whichever exits run.

Fit: features standardised, Adam (lr 3e-3, weight decay 1e-4), `steps` minibatches of `batch` tokens drawn by a
generator seeded with `seed` (deterministic on the CPU); the standardisation is folded into the saved weights.

What this module does not do: train heads, pick thresholds (calibrate fits the score's threshold like any
criterion's), or write files (head_designs.save_heads stores the probes beside the heads).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn

from eectl.candidates import CandidateSource
from eectl.exits import (
    DEFAULT_TOP_K,
    ExitHead,
    ExitScoring,
    ExitState,
    Probe,
    TorchExitLogits,
    attach_probe,
    get_signal,
    probe_of,
    signals,
)

PROBE_FEATURES = ("normed", "prob", "margin")  # the heads file's meta names them: what a Probe's weights read


@dataclass
class ProbeConfig:
    tokens: int = 32768  # training tokens sampled (the first ones the caller hands over)
    steps: int = 400
    batch: int = 8192
    lr: float = 3e-3
    weight_decay: float = 1e-4
    seed: int = 0
    top_k: int = DEFAULT_TOP_K


@dataclass
class ProbeFit:
    """What `fit_probes` did, for the heads file's meta (`probe`) and the command's report."""

    features: list[str]
    top_k: int
    candidates: dict[str, object]
    tokens: int
    agreement: dict[str, float]  # per exit: the share of training tokens whose label is 1
    train_s: float
    config: dict[str, object]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@torch.no_grad()
def probe_features(
    exit_heads: dict[int, ExitHead],
    states: dict[int, torch.Tensor],
    teacher: torch.Tensor,
    source: CandidateSource,
    k: int,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per exit: (features [T, 2 + H] = prob, margin, z; labels [T] bool) of T tokens' states after the exit's layer
    and the final layer's top-1 `teacher` [T]."""
    out = {}
    signal = get_signal("topk-prob")  # the candidates and local logits of the topk-* signals (and of `learned`)
    for layer, head in exit_heads.items():
        h = states[layer].float()
        scoring = ExitScoring(signal, TorchExitLogits(exit_heads), k, source)  # each exit as the first active one
        ids, logits = scoring.local_logits(layer, ExitState(h))
        s = signals(logits, ids)
        z = head.normed(h).float()
        x = torch.cat([s.prob[:, None].float(), s.margin[:, None].float(), z], dim=1)
        out[layer] = (x, s.token == teacher)
    return out


def fit_probe(x: torch.Tensor, y: torch.Tensor, config: ProbeConfig) -> Probe:
    """A logistic regression on features x [T, 2 + H] (prob, margin, z), labels y [T]; standardisation folded in."""
    g = torch.Generator().manual_seed(config.seed)
    mu, sd = x.mean(0), x.std(0) + 1e-6
    xn = (x - mu) / sd
    w = torch.zeros(x.shape[1], requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=config.lr, weight_decay=config.weight_decay)
    yf = y.float()
    n = len(yf)
    for _ in range(config.steps):
        pick = torch.randint(0, n, (min(config.batch, n),), generator=g)
        loss = nn.functional.binary_cross_entropy_with_logits(xn[pick] @ w + b, yf[pick])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        wf = w / sd  # sum w_i (x_i - mu_i) / sd_i + b = sum (w_i / sd_i) x_i + (b - sum w_i mu_i / sd_i)
        bias = b - (wf * mu).sum()
    coef = torch.stack([wf[0], wf[1], bias[0]]).numpy()
    return Probe.of(wf[2:].numpy(), coef)


def fit_probes(
    heads: dict[int, nn.Module],
    exit_heads: dict[int, ExitHead],
    samples: Iterable[tuple[dict[int, torch.Tensor], torch.Tensor]],
    source: CandidateSource,
    config: ProbeConfig,
    on_tokens: Callable[[int], None] | None = None,
) -> ProbeFit:
    """Fit a probe per exit of `exit_heads` on the first `config.tokens` tokens of `samples` ((exit states [T, H] by
    layer, the final layer's top-1 [T]) per piece), attach each to its head module in `heads` (so save_heads
    stores it and every later reader of the heads gets it), and describe the fit."""
    start = time.perf_counter()
    xs: dict[int, list[torch.Tensor]] = {layer: [] for layer in exit_heads}
    ys: dict[int, list[torch.Tensor]] = {layer: [] for layer in exit_heads}
    got = 0
    for states, teacher in samples:
        take = min(len(teacher), config.tokens - got)
        if take <= 0:
            break
        cut = {layer: v[:take] for layer, v in states.items()}
        feats = probe_features(exit_heads, cut, teacher[:take], source, config.top_k)
        for layer, (x, y) in feats.items():
            xs[layer].append(x)
            ys[layer].append(y)
        got += take
        if on_tokens is not None:
            on_tokens(take)
    if got == 0:
        raise ValueError("no tokens to fit the probes on")
    agreement = {}  # by exit, in layer order
    for layer in sorted(exit_heads):
        x, y = torch.cat(xs.pop(layer)), torch.cat(ys.pop(layer))
        probe = fit_probe(x, y, config)
        attach_probe(heads[layer], probe)
        exit_heads[layer].probe = probe
        agreement[str(layer)] = round(float(y.float().mean()), 4)
    return ProbeFit(
        features=list(PROBE_FEATURES),
        top_k=config.top_k,
        candidates=source.describe(),
        tokens=got,
        agreement=agreement,
        train_s=round(time.perf_counter() - start, 2),
        config={k: v for k, v in asdict(config).items() if k != "top_k"},
    )


def probe_tensors(heads: dict[int, nn.Module]) -> dict[str, torch.Tensor]:
    """The heads file's probe tensors: `probe.exit_{l}.weight` [H] and `probe.exit_{l}.coef` [3] (w_prob, w_margin,
    bias), float32, for every head that carries a probe."""
    out = {}
    for layer, head in heads.items():
        p = probe_of(head)
        if p is not None:
            out[f"probe.exit_{layer}.weight"] = torch.from_numpy(np.ascontiguousarray(p.weight, np.float32))
            out[f"probe.exit_{layer}.coef"] = torch.from_numpy(p.coef())
    return out


def attach_probe_tensors(heads: dict[int, nn.Module], tensors: dict[str, torch.Tensor]) -> None:
    """The inverse of `probe_tensors`: attach each stored probe to its head (tensors: the file's probe.* keys)."""
    for layer, head in heads.items():
        w, c = tensors.get(f"probe.exit_{layer}.weight"), tensors.get(f"probe.exit_{layer}.coef")
        if w is not None and c is not None:
            attach_probe(head, Probe.of(w.float().numpy(), c.float().numpy()))
