"""Fitting the `learned` exit signal's probes (exits.Probe): per exit, a small MLP (or a logistic regression) on the
exit's normed state and its local softmax's prob and margin (and transforms of them: exits.PROBE_SCALARS),
predicting "the exit's top-1 over its K candidates is the final layer's top-1".

Both trainers call `fit_probes` after their heads are trained (heads/train.py on its chunk passes, heads/cached.py on
its cached sequences), and `eectl train-heads --probe-only` fits probes onto an existing heads file: every caller hands
over (exit states, teacher top-1) samples of its own training tokens. Features are measured as the runner measures
them (exits.ExitScoring on the head's ExitHead, the given candidate source), each token's at an exit on the
candidates of an exit drawn among it and the earlier ones (the runner's first active exit, whichever the plan makes
it): the probe then means the same at whichever exits run.

Fit (`fit_probe`): features standardised; the logistic regression by Adam (`steps` minibatches of `batch`), the MLP
(`hidden` ReLU units) by AdamW with a cosine schedule (`mlp_steps` of `mlp_batch`), both on the tokens left after a
`validation` share is held out, and the one that lets more held-out tokens exit at calibrate's precisions is kept (per
exit: an MLP overfits a few thousand tokens and ranks better on 10^5). Minibatches and initial weights come from a
generator seeded with `seed` (deterministic on the CPU); the standardisation is folded into the saved weights. The
features are measured and the probes fitted on the device of the states handed over (the heads' device); the fitted
weights come back to the host once per probe.

What this module does not do: train heads, pick thresholds (calibrate fits the score's threshold like any
criterion's), or write files (head_designs.save_heads stores the probes beside the heads).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from eectl.contracts.heads import ProbeMeta
from eectl.exits.base import (
    DEFAULT_TOP_K,
    PROBE_SCALARS,
    CandidateSource,
    ExitHead,
    ExitState,
    Probe,
    TorchExitLogits,
    attach_probe,
    probe_of,
    probe_scalars,
    signals,
)
from eectl.exits.signals import ExitScoring, get_signal

PROBE_FEATURES = ("normed", *PROBE_SCALARS)  # the heads file's meta names them: what a Probe's weights may read


@dataclass
class ProbeConfig:
    tokens: int = 131072  # training tokens sampled (the first ones the caller hands over)
    hidden: int = 32  # the MLP probe's hidden units (0: the logistic regression only)
    validation: float = 0.1  # share of the tokens held out to choose between the MLP and the logistic regression
    min_validation: int = 1000  # fewer held-out tokens than this cannot judge the confident tail: logistic only
    steps: int = 400  # the logistic regression's
    batch: int = 8192
    lr: float = 3e-3
    weight_decay: float = 1e-4
    mlp_steps: int = 3000  # the MLP's (cosine-decayed learning rate)
    mlp_batch: int = 4096
    mlp_lr: float = 2e-3
    mlp_weight_decay: float = 1e-3
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
    # per exit: the probe kept ("mlp" or "logistic") and both fits' tail coverage on the validation tokens
    chosen: dict[str, str] = field(default_factory=dict)
    validation: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def meta(self, **extra: Any) -> ProbeMeta:
        """The heads file's `probe` metadata (typed: a reader refuses anything else)."""
        return ProbeMeta.model_validate({**self.to_dict(), **extra})


@torch.no_grad()
def probe_features(
    exit_heads: dict[int, ExitHead],
    states: dict[int, torch.Tensor],
    teacher: torch.Tensor,
    source: CandidateSource,
    k: int,
    generator: torch.Generator | None = None,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per exit: (features [T, 2 + H] = prob, margin, z; labels [T] bool) of T tokens' states after the exit's layer
    and the final layer's top-1 `teacher` [T].

    Whose candidates: the runner scores every exit on the K candidates of the first active exit, and which exit that
    is depends on the plan (any exit at or before this one). With `generator`, each token's candidates come from an
    exit drawn uniformly among those (seeded), so the probe learns the softmax scalars of every case it will see (an
    exit's own candidates are its sharpest; an earlier exit's, picked from a worse state, flatten or miss its top-1);
    without, every exit scores its own."""
    out = {}
    signal = get_signal("topk-prob")  # the candidates and local logits of the topk-* signals (and of `learned`)
    backend = TorchExitLogits(exit_heads)
    exits = sorted(exit_heads)
    picked: dict[int, torch.Tensor] = {}
    for layer in exits:
        h = states[layer].float()
        scoring = ExitScoring(signal, backend, k, source)  # this exit as the first active one
        ids, logits = scoring.local_logits(layer, ExitState(h))
        picked[layer] = ids
        if generator is not None and layer != exits[0]:
            earlier = [e for e in exits if e <= layer]
            draw = torch.randint(0, len(earlier), (len(h),), generator=generator).to(h.device)
            ids = torch.stack([picked[e] for e in earlier])[draw, torch.arange(len(h), device=h.device)]  # [T, K]
            logits = backend.local(layer, h, ids)
        s = signals(logits, ids)
        z = exit_heads[layer].normed(h).float()
        x = torch.cat([s.prob[:, None].float(), s.margin[:, None].float(), z], dim=1)
        out[layer] = (x, s.token == teacher)
    return out


def _inputs(x: torch.Tensor, n_scalars: int) -> torch.Tensor:
    """Features [T, 2 + H] (prob, margin, z) -> the probe's inputs [T, H + F]: z, then the first F PROBE_SCALARS."""
    host = x[:, :2].cpu().numpy()  # the scalars' transforms are numpy's (the runner's formula): once per fit
    f = torch.from_numpy(probe_scalars(host[:, 0], host[:, 1], n_scalars)).to(x.device)
    return torch.cat([x[:, 2:], f], dim=1)


def _standardised(x: torch.Tensor, n_scalars: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The probe's inputs (`_inputs`) standardised: (inputs [T, H + F] standardised, their mean, their std)."""
    u = _inputs(x, n_scalars)
    mu, sd = u.mean(0), u.std(0) + 1e-6
    return (u - mu) / sd, mu, sd


def _draws(g: torch.Generator, device: torch.device) -> torch.Generator:
    """The minibatches' generator on the data's device: `g` itself on the CPU (the fits stay bit-identical there),
    else a generator there seeded from `g` (indices drawn where the data is: no step waits on a copy from the host)."""
    if device.type == "cpu":
        return g
    return torch.Generator(device).manual_seed(int(torch.randint(0, 2**62, (1,), generator=g)))


def _fit_logistic(x: torch.Tensor, y: torch.Tensor, config: ProbeConfig, g: torch.Generator) -> Probe:
    """A logistic regression on z and prob, margin (Adam on minibatches); standardisation folded."""
    un, mu, sd = _standardised(x, 2)
    w = torch.zeros(un.shape[1], device=un.device, requires_grad=True)
    b = torch.zeros(1, device=un.device, requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=config.lr, weight_decay=config.weight_decay)
    yf, n, draws = y.float(), len(y), _draws(g, un.device)
    for _ in range(config.steps):
        pick = torch.randint(0, n, (min(config.batch, n),), generator=draws, device=un.device)
        loss = nn.functional.binary_cross_entropy_with_logits(un[pick] @ w + b, yf[pick])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        wf = w / sd  # sum w_i (u_i - mu_i) / sd_i + b = sum (w_i / sd_i) u_i + (b - sum w_i mu_i / sd_i)
        bias = b - (wf * mu).sum()
    h = x.shape[1] - 2
    wf, bias = wf.cpu(), bias.detach().cpu()
    return Probe(wf[:h, None].numpy(), wf[h:, None].numpy(), bias.numpy().astype(np.float32))


def _fit_mlp(x: torch.Tensor, y: torch.Tensor, config: ProbeConfig, g: torch.Generator) -> Probe:
    """One hidden ReLU layer of `config.hidden` units on z and every PROBE_SCALARS; standardisation folded into the
    first layer. Weights drawn from `g` (deterministic for the seed)."""
    un, mu, sd = _standardised(x, len(PROBE_SCALARS))
    d, width = config.hidden, un.shape[1]
    dev = un.device  # drawn on the host from `g` (the same weights on every device), trained on x's device
    w1 = (torch.randn(width, d, generator=g) / width**0.5).to(dev).requires_grad_()
    b1 = torch.zeros(d, device=dev, requires_grad=True)
    w2 = (torch.randn(d, generator=g) / d**0.5).to(dev).requires_grad_()
    b2 = torch.zeros(1, device=dev, requires_grad=True)
    params = [w1, b1, w2, b2]
    opt = torch.optim.AdamW(params, lr=config.mlp_lr, weight_decay=config.mlp_weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, config.mlp_steps)
    yf, n, draws = y.float(), len(y), _draws(g, dev)
    for _ in range(config.mlp_steps):
        pick = torch.randint(0, n, (min(config.mlp_batch, n),), generator=draws, device=dev)
        out = torch.relu(un[pick] @ w1 + b1) @ w2 + b2
        loss = nn.functional.binary_cross_entropy_with_logits(out, yf[pick])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    with torch.no_grad():
        wf = w1 / sd[:, None]  # (u - mu) / sd @ w1 + b1 = u @ (w1 / sd) + (b1 - mu @ (w1 / sd))
        bias = b1 - mu @ wf
    h = x.shape[1] - 2
    wf, bias, w2, b2 = (t.detach().cpu() for t in (wf, bias, w2, b2))
    return Probe(wf[:h].numpy(), wf[h:].numpy(), bias.numpy(), w2.numpy(), float(b2))


TAIL_PRECISIONS = (0.95, 0.98, 0.99)  # the precisions calibrate's targets ask of exiting tokens


def tail_coverage(score: np.ndarray, y: torch.Tensor, precisions: tuple[float, ...] = TAIL_PRECISIONS) -> float:
    """Mean over `precisions` of the largest share of tokens that, taken from the highest score down, keep that
    precision: how many tokens a threshold on this score lets exit at a target (the bulk of uncertain tokens, which
    the log loss weighs most, never exits)."""
    order = np.argsort(-score, kind="stable")
    hits = y.cpu().numpy()[order].astype(np.float64)
    prec = np.cumsum(hits) / np.arange(1, len(hits) + 1)
    out = []
    for p in precisions:
        ok = np.nonzero(prec >= p)[0]
        out.append(0.0 if ok.size == 0 else (ok[-1] + 1) / len(hits))
    return float(np.mean(out))


def fit_probe(x: torch.Tensor, y: torch.Tensor, config: ProbeConfig) -> tuple[Probe, str, dict[str, float]]:
    """A probe on features x [T, 2 + H] (prob, margin, z), labels y [T]: (the probe, "mlp" or "logistic", each
    fit's `tail_coverage` on the validation tokens).

    With `config.hidden` > 0 and enough tokens, a seeded `config.validation` share of them is held out; the MLP and
    the logistic regression are fitted on the rest and the one whose score lets more held-out tokens exit at
    calibrate's precisions is kept (an MLP on a few thousand tokens overfits; on 10^5 it ranks exits better: README,
    calibrate; the log loss cannot tell them apart, its bulk never exits). Otherwise the logistic regression on every
    token."""
    g = torch.Generator().manual_seed(config.seed)
    n_val = int(len(y) * config.validation) if config.hidden > 0 else 0
    if n_val < max(1, config.min_validation):
        return _fit_logistic(x, y, config, g), "logistic", {}
    order = torch.randperm(len(y), generator=g)
    fit, val = order[n_val:], order[:n_val]
    fits = {"logistic": _fit_logistic(x[fit], y[fit], config, g), "mlp": _fit_mlp(x[fit], y[fit], config, g)}
    xv = x[val].cpu().numpy()
    cover = {name: round(tail_coverage(p.score(xv[:, 2:], xv[:, 0], xv[:, 1]), y[val]), 5) for name, p in fits.items()}
    kind = max(cover, key=lambda k: (cover[k], k == "logistic"))  # a tie keeps the cheaper logistic
    return fits[kind], kind, cover


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
    draw = torch.Generator().manual_seed(config.seed)  # whose candidates each token's features score (probe_features)
    for states, teacher in samples:
        take = min(len(teacher), config.tokens - got)
        if take <= 0:
            break
        cut = {layer: v[:take] for layer, v in states.items()}
        feats = probe_features(exit_heads, cut, teacher[:take], source, config.top_k, draw)
        for layer, (x, y) in feats.items():
            xs[layer].append(x)
            ys[layer].append(y)
        got += take
        if on_tokens is not None:
            on_tokens(take)
    if got == 0:
        raise ValueError("no tokens to fit the probes on")
    agreement, chosen, cover = {}, {}, {}  # by exit, in layer order
    for layer in sorted(exit_heads):
        x, y = torch.cat(xs.pop(layer)), torch.cat(ys.pop(layer))
        probe, kind, coverage = fit_probe(x, y, config)
        attach_probe(heads[layer], probe)
        exit_heads[layer].probe = probe
        agreement[str(layer)] = round(float(y.float().mean()), 4)
        chosen[str(layer)], cover[str(layer)] = kind, coverage
    return ProbeFit(
        features=list(PROBE_FEATURES),
        top_k=config.top_k,
        candidates=source.describe(),
        tokens=got,
        agreement=agreement,
        train_s=round(time.perf_counter() - start, 2),
        config={k: v for k, v in asdict(config).items() if k != "top_k"},
        chosen=chosen,
        validation=cover,
    )


def probe_tensors(heads: dict[int, nn.Module]) -> dict[str, torch.Tensor]:
    """The heads file's probe tensors: `probe.exit_{l}.<name>` for `Probe.tensors`' names, float32, for every head
    that carries a probe."""
    out: dict[str, torch.Tensor] = {}
    for layer, head in heads.items():
        p = probe_of(head)
        if p is not None:
            out |= {f"probe.exit_{layer}.{k}": torch.from_numpy(v) for k, v in p.tensors().items()}
    return out


def attach_probe_tensors(heads: dict[int, nn.Module], tensors: dict[str, torch.Tensor], hidden: int) -> None:
    """The inverse of `probe_tensors`: attach each stored probe to its head (tensors: the file's probe.* keys; files
    written before MLP probes store `weight` and `coef`, read as the logistic probe they are).

    Raises ValueError (one line) for tensors that are no probe of these heads: a key of another layer or of no
    layer, a missing tensor, shapes that do not fit the hidden size `hidden` ([H, D], [F, D], [D]), NaN or inf."""
    by_layer: dict[int, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _PROBE_KEY.match(key)
        if m is None:
            raise ValueError(f"unknown probe tensor {key!r}")
        by_layer.setdefault(int(m[1]), {})[m[2]] = value.float().numpy()
    others = sorted(set(by_layer) - set(heads))
    if others:
        raise ValueError(f"probe tensors for layers {others} that are not its exits {sorted(heads)}")
    for layer, mine in sorted(by_layer.items()):
        try:
            probe = Probe.of(mine)
        except KeyError as exc:
            raise ValueError(f"probe at exit {layer}: no tensor {exc}") from None
        except ValueError as exc:
            raise ValueError(f"probe at exit {layer}: {exc}") from None
        wrong = _shape_fault(probe, hidden)
        if wrong:
            raise ValueError(f"probe at exit {layer}: {wrong}")
        attach_probe(heads[layer], probe)


_PROBE_KEY = re.compile(r"^probe\.exit_(\d+)\.(\w+)$")


def _shape_fault(p: Probe, hidden: int) -> str | None:
    """What is wrong with a stored probe's arrays for hidden size `hidden` (None: nothing)."""
    shapes = {"w_state": p.w_state.shape, "w_scalar": p.w_scalar.shape, "b": p.b.shape}
    if p.w_out is not None:
        shapes["w_out"] = p.w_out.shape
    d = p.w_state.shape[1] if p.w_state.ndim == 2 else 0
    fits = (
        p.w_state.shape == (hidden, d)
        and d >= 1
        and p.w_scalar.ndim == 2
        and 1 <= p.w_scalar.shape[0] <= len(PROBE_SCALARS)
        and p.w_scalar.shape[1] == d
        and p.b.shape == (d,)
        and (p.w_out.shape == (d,) if p.w_out is not None else d == 1)
    )
    if not fits:
        listed = ", ".join(f"{k} {list(v)}" for k, v in shapes.items())
        return f"{listed} do not fit a probe on hidden size {hidden}"
    arrays = [p.w_state, p.w_scalar, p.b, *([] if p.w_out is None else [p.w_out])]
    if not all(np.isfinite(a).all() for a in arrays) or not math.isfinite(p.b_out):
        return "non-finite weights (NaN or infinity)"
    return None
