"""What an exit computes, below any signal: the exit head module, the logits backends' interface, the exit's
state, its prediction and its score, and the arithmetic the signals share.

`CandidateSource` is the interface of a candidate source; the sources and their registry are exits/candidates.py.
What this module does not do: name signals (signals.py) or pick candidates (exits/candidates.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from eectl.errors import UsageError

if TYPE_CHECKING:
    from eectl.models.adapters import Adapter


DEFAULT_TOP_K = 64


# An exit's tensors: torch tensors in calibrate (TorchExitLogits, ExitHead modules), numpy arrays in the runner (the
# ONNX exit graphs' outputs as they are: no conversion, no per-op dispatch on its one-token decisions).
Array = Any


# The probe's scalar features, in this order: the local softmax's prob and margin (every probe reads them), then
# transforms a linear first layer cannot form (an MLP probe reads all six): log p and log(1 - p) resolve the
# confident end, where prob is within 1e-3 of 1 for most exiting tokens. p is clipped to [PROB_CLIP, 1 - PROB_CLIP]
# for the logs. A probe reads the first F of them (F = its w_scalar rows): a logistic probe fitted before the MLP
# probes reads two.
PROBE_SCALARS = ("prob", "margin", "log_prob", "log_rest", "margin_sq", "prob_margin")


PROB_CLIP = 1e-6


def probe_scalars(prob: Any, margin: Any, n: int) -> np.ndarray:
    """[N] prob, [N] margin -> [N, n] float32: the first n of PROBE_SCALARS (decision_nodes builds the same)."""
    f32 = np.float32
    p = np.asarray(prob, f32).reshape(-1, 1)
    m = np.asarray(margin, f32).reshape(-1, 1)
    cols = [p, m]
    if n > 2:
        pc = np.clip(p, f32(PROB_CLIP), f32(1 - PROB_CLIP))
        cols += [np.log(pc), np.log(f32(1) - pc), m * m, p * m]
    return np.concatenate(cols[:n], axis=1)


@dataclass
class Probe:
    """The `learned` signal's exit test at one exit, fitted by eectl.exits.probe on the head's training tokens to
    predict
    "the exit's top-1 is the final layer's": a small MLP (or a logistic regression) whose output logit is the score
    (monotone in its probability, so no sigmoid):

        a = z @ w_state + f @ w_scalar + b                          [N, D]
        score = relu(a) @ w_out + b_out    (MLP: D hidden units)     or   a[:, 0]  (logistic: w_out None, D = 1)

    z [H] the exit's normed state (the final norm's output: the vector the exit multiplies with the LM-head rows),
    f the first F of PROBE_SCALARS (`probe_scalars`, from the local softmax over the K candidates). The features'
    standardisation is folded into the weights when fitted. Cost: (H + F + 1) * D multiply-adds per token (D = 32:
    18.7K, 0.5% of a SmolLM2 decoder layer), nothing beside the K LM-head rows."""

    w_state: np.ndarray  # [H, D] float32
    w_scalar: np.ndarray  # [F, D] float32
    b: np.ndarray  # [D] float32
    w_out: np.ndarray | None = None  # [D] float32; None: logistic (D = 1, the first layer is the score)
    b_out: float = 0.0

    @property
    def hidden(self) -> int:
        """Hidden units (0: a logistic regression)."""
        return 0 if self.w_out is None else int(self.w_state.shape[1])

    def score(self, z: Any, prob: Any, margin: Any) -> Any:
        """[N, H], [N], [N] -> [N] float32 (tensors in, a tensor out; arrays in, an array out). The one formula:
        numpy's, as `signals` (the runner decides one token at a time; calibrate's tensors go through it too)."""
        if isinstance(z, torch.Tensor):  # on the host (numpy's formula), the result back on z's device
            host = [t.detach().float().cpu().numpy() if isinstance(t, torch.Tensor) else t for t in (z, prob, margin)]
            out = self.score(host[0], np.asarray(host[1]), np.asarray(host[2]))
            return torch.from_numpy(out).to(z.device)
        zz = np.asarray(z, dtype=np.float32)
        f = probe_scalars(prob, margin, self.w_scalar.shape[0])
        a = (zz @ self.w_state + f @ self.w_scalar) + self.b
        if self.w_out is None:
            return a[:, 0]
        return np.maximum(a, np.float32(0)) @ self.w_out + np.float32(self.b_out)

    def tensors(self) -> dict[str, np.ndarray]:
        """The heads file's tensors (keys after `probe.exit_{l}.`), float32."""
        out = {"w_state": self.w_state, "w_scalar": self.w_scalar, "b": self.b}
        if self.w_out is not None:
            out |= {"w_out": self.w_out, "b_out": np.array([self.b_out], np.float32)}
        return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}

    @classmethod
    def of(cls, t: dict[str, np.ndarray]) -> Probe:
        """The inverse of `tensors`; also reads heads files written before MLP probes (`weight` [H] and `coef`
        [3] = w_prob, w_margin, bias: a logistic probe on prob and margin)."""
        t = {k: np.asarray(v, np.float32) for k, v in t.items()}
        if "weight" in t:
            c = t["coef"].reshape(-1)
            return cls(t["weight"].reshape(-1, 1), c[:2].reshape(2, 1), c[2:3])
        w_out = t.get("w_out")
        b_out = float(t["b_out"].reshape(-1)[0]) if w_out is not None else 0.0
        return cls(t["w_state"], t["w_scalar"], t["b"].reshape(-1), None if w_out is None else w_out.reshape(-1), b_out)


# The probe travels with its head module (it was fitted on that head's outputs): every place that gets a heads dict
# (calibrate, export, validation) gets the probes with it. A plain attribute, not a submodule: the head's state dict
# (its tensors in the heads file) stays exactly as before.
PROBE_ATTR = "exit_probe"


def probe_of(head: nn.Module | None) -> Probe | None:
    return None if head is None else getattr(head, PROBE_ATTR, None)


def attach_probe(head: nn.Module, probe: Probe | None) -> None:
    object.__setattr__(head, PROBE_ATTR, probe)


class ExitHead(nn.Module):
    """Optional trained head + the frozen final norm and LM head of the base model."""

    def __init__(self, adapter: Adapter, head: nn.Module | None = None) -> None:
        super().__init__()
        self.head = head
        self.norm = adapter.norm
        self.lm_head_weight: torch.Tensor = adapter.lm_head.weight  # [V, H], shared with the base model, frozen
        bias = getattr(adapter.lm_head, "bias", None)
        self.lm_head_bias = bias
        self.softcap = getattr(adapter.config, "final_logit_softcapping", None)
        self.probe = probe_of(head)  # the learned exit test fitted on this head's outputs (None: none fitted)

    def normed(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden if self.head is None else self.head(hidden)
        return self.norm(x)

    def cap(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.tanh(logits / self.softcap) * self.softcap if self.softcap else logits

    def full(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] logits."""
        logits = F.linear(self.normed(hidden), self.lm_head_weight, self.lm_head_bias)
        return self.cap(logits)

    def local(self, hidden: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """[N, H], candidate ids [N, K] -> [N, K] logits of just those rows of the LM head."""
        rows = self.lm_head_weight[candidates]  # [N, K, H]
        logits = torch.einsum("nh,nkh->nk", self.normed(hidden), rows)
        if self.lm_head_bias is not None:
            logits = logits + self.lm_head_bias[candidates]
        return self.cap(logits)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.full(hidden)


def topk_candidates(full_logits: torch.Tensor, k: int) -> torch.Tensor:
    """[N, V] -> [N, K] ids of the K largest logits, best first (the token's local vocabulary)."""
    return torch.topk(full_logits, k, dim=-1).indices


@dataclass
class ExitSignals:
    """Tensors when the logits were torch tensors (calibrate), numpy arrays when they were arrays (the runner)."""

    token: Any  # [N] predicted token id (full vocabulary id)
    prob: Any  # [N] top-1 probability over the scored vocabulary
    margin: Any  # [N] top-1 minus top-2 probability


def signals(logits: Any, candidates: Any = None) -> ExitSignals:
    """Top-1 token, probability and top-1/top-2 margin of a softmax over `logits` [N, K or V].

    With `candidates` [N, K], logits are local and the token is mapped back to its vocabulary id. The one formula
    is numpy's: the runner decides one token at a time, where each torch op's dispatch (~10 us) costs more than its
    math, so calibrate's tensors go through the same numpy code (and come back as tensors) rather than a twin.
    """
    if isinstance(logits, torch.Tensor):  # a device's tensors: one copy to the host and back per call (a batch)
        ids = None if candidates is None else candidates.cpu().numpy()
        out = signals(logits.detach().float().cpu().numpy(), ids)
        back = (torch.from_numpy(np.ascontiguousarray(x)).to(logits.device) for x in (out.token, out.prob, out.margin))
        return ExitSignals(*back)
    z = np.asarray(logits, dtype=np.float32)  # [N, K]
    rows = np.arange(z.shape[0])
    idx = z.argmax(-1)
    e = np.exp(z - z.max(-1, keepdims=True))  # the top-1 term is exp(0) = 1
    total = e.sum(-1)
    prob = 1.0 / total
    e[rows, idx] = 0.0  # the top-1 out: the largest left is the top-2 (equal to it on a tie: margin 0)
    margin = prob - e.max(-1) / total
    token = idx if candidates is None else np.asarray(candidates)[rows, idx]
    return ExitSignals(token=token.astype(np.int64, copy=False), prob=prob, margin=margin)


def transition_cosine(h_in: torch.Tensor, h_out: torch.Tensor) -> torch.Tensor:
    """River-LLM's state transition: cos(input, output) of a decoder layer, [..., H] -> [...]."""
    return F.cosine_similarity(h_in.float(), h_out.float(), dim=-1)


def min_transition_cosine(blocks: torch.Tensor) -> torch.Tensor:
    """River-LLM's exit test over a segment: blocks [n + 1, ..., H], the residual stream before the first block and
    after each one -> [...] the minimum over the n blocks of cos(input, output)."""
    return transition_cosine(blocks[:-1], blocks[1:]).min(dim=0).values


def passes(values: dict[str, Any], thresholds: dict[str, float]) -> Any:
    """[N] bool (a tensor or an array, as the values): every criterion's value >= its threshold (a threshold of inf
    never passes: "never exits")."""
    ok: Any = None
    for c, t in thresholds.items():
        here = values[c] >= t
        ok = here if ok is None else ok & here
    assert ok is not None, "an exit test needs at least one criterion"
    return ok


class ExitLogits(Protocol):
    """An exit's logits for hidden states [N, H] at the exit after `layer` (torch modules or ONNX graphs)."""

    def full(self, layer: int, hidden: Array) -> Array:
        """[N, V] logits over the whole vocabulary."""
        ...

    def full_topk(self, layer: int, hidden: Array, k: int) -> tuple[Array, Array]:
        """The K best of the full logits: ids [N, K] and their logits [N, K], best first."""
        ...

    def local(self, layer: int, hidden: Array, candidates: Array) -> Array:
        """[N, K] logits of the candidate rows only."""
        ...

    def candidates(self, source: CandidateSource, layer: int, hidden: Array, k: int) -> tuple[Array, Array]:
        """A candidate source's K candidates and their exact logits [N, K] (its torch code, or its exit graph)."""
        ...

    def probe_score(self, layer: int, hidden: Array, prob: Array, margin: Array) -> Array:
        """[N] the exit's probe score (`Probe.score`) for the rows whose local logits this backend just computed at
        `layer` (prob, margin: their softmax's)."""
        ...


class TorchExitLogits:
    """ExitLogits from ExitHead modules (exit layer -> head). The last full projection is kept, so a caller that
    needs the full logits and a Top-K pick at the same exit pays for one projection."""

    def __init__(self, heads: dict[int, ExitHead]) -> None:
        self.heads = heads
        self._last: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def full(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        if self._last is not None and self._last[0] == layer and self._last[1] is hidden:
            return self._last[2]
        logits = self.heads[layer].full(hidden)
        self._last = (layer, hidden, logits)
        return logits

    def full_topk(self, layer: int, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        full = self.full(layer, hidden)
        ids = topk_candidates(full, k)
        return ids, full.gather(-1, ids)

    def local(self, layer: int, hidden: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        return self.heads[layer].local(hidden, candidates)

    def candidates(
        self, source: CandidateSource, layer: int, hidden: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return source.torch_pick(self.heads[layer], hidden, k)

    def probe_score(self, layer: int, hidden: torch.Tensor, prob: Any, margin: Any) -> torch.Tensor:
        head = self.heads[layer]
        if head.probe is None:
            raise no_probe_error([layer])
        with torch.no_grad():
            return head.probe.score(head.normed(hidden), prob, margin)


def no_probe_error(layers: list[int]) -> UsageError:
    """The one message for `--signal learned` without probes (heads files written before probes, or no heads)."""
    return UsageError(
        f"--signal learned needs exit probes, and exit{'s' if len(layers) > 1 else ''} "
        f"{', '.join(map(str, layers))} ha{'ve' if len(layers) > 1 else 's'} none",
        hint="fit them onto the heads: eectl train-heads --probe-only --heads FILE --cache DIR "
        "(and calibrate/export with those heads)",
    )


@dataclass
class ExitState:
    """What an exit sees of a token batch: the state after the exit's layer and, for signals that ask for it, the
    input of the last layer before the exit."""

    hidden: Array  # [N, H]
    layer_input: Array | None = None  # [N, H]
    blocks: Array | None = None  # [n + 1, N, H]: every block boundary of the segment that ends at the exit


@dataclass
class Prediction:
    logits: Array  # [N, K] local or [N, V] full: what a token is picked (or sampled) from
    ids: Array | None = None  # [N, K] vocabulary ids of local logits; None for the full vocabulary
    top1: Array | None = None  # [N] when the signal already knows it

    @property
    def token(self) -> Array:
        """[N] the top-1 vocabulary id."""
        if self.top1 is not None:
            return self.top1
        idx = self.logits.argmax(-1)
        if self.ids is None:
            return idx
        if isinstance(self.ids, torch.Tensor):
            return self.ids.gather(1, idx[:, None])[:, 0]
        return self.ids[np.arange(len(idx)), idx]


@dataclass
class ExitScore:
    values: dict[str, Array]  # criterion -> [N]
    predict: Callable[[], Prediction]  # computed on demand: a cosine exit projects the LM head only when it exits
    _prediction: Prediction | None = field(default=None, repr=False)

    def prediction(self) -> Prediction:
        if self._prediction is None:
            self._prediction = self.predict()
        return self._prediction


class CandidateSource:
    """Picks a token's K candidates (its local vocabulary) at the first exit it reaches.

    A source with its own computation (a shortlist, an int8 head) defines it once in torch (`torch_pick`, on the
    exit's ExitHead: calibrate) and export builds the same computation as the exit's candidate graph (the runner);
    the backend chooses (`ExitLogits.candidates`). Sources that carry data (the shortlist's ids, the int8 weights)
    are instances made per model by `make_source`; the registry holds their names. Every source picks each row of a
    batch as it would pick the row alone, so the runner picks for all rows of a batch in one call."""

    name = ""

    def pick(
        self, logits: ExitLogits, layer: int, state: ExitState, k: int
    ) -> tuple[Array, Array]:  # ids [N, K], their logits at this exit [N, K]
        return logits.candidates(self, layer, state.hidden, k)

    def torch_pick(self, head: ExitHead, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def describe(self) -> dict[str, object]:
        return {"name": self.name}
