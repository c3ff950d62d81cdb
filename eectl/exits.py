"""Exit heads and exit signals: the ONE definition of what an exit computes, how confident it is, and whether a
token leaves there.

An exit after layer l maps that layer's hidden state to a prediction: an optional trained head (heads.py) into the
input space of the frozen final norm + LM head, then either

- the full vocabulary (`full`): all V logits, or
- the local vocabulary (`local`): only K candidate rows of the LM head are scored (cheap: K << V).

`ExitHead` is a torch module; export turns exactly these methods into the exit graphs. Where the logits come from
is an `ExitLogits` backend: `TorchExitLogits` (ExitHead modules: calibrate, the heads report) or the ONNX exit
graphs (`eectl.runtime.runner.OrtExitLogits`). Every caller scores exits through one path:

    scoring = ExitScoring(SIGNALS[name], backend, top_k)     # one per token batch, exits visited in order
    score = scoring.score(layer, hidden, layer_input)         # values {criterion: [N]}, lazy prediction
    passes(score.values, thresholds)                          # [N] bool: every criterion >= its threshold
    score.prediction().token                                  # the exit's top-1 (vocabulary ids)

so calibrate, `eectl train-heads`' report and `eectl run` compute the same numbers and apply the same test.

Registries (each addition is one entry):

- `SIGNALS`: a `Signal` names its criteria, whether it scores the local vocabulary (needs candidates) and whether
  it needs the input of the last layer before the exit, and computes its values in `measure`. To add one, write a
  `Signal` subclass (or reuse one with other criteria) and `register_signal(...)` it below; calibrate, export's
  manifest, run and bench pick it up by name. A signal that needs more than the exit state and the last layer's
  input adds that state to `ExitState` and to what the segment graphs output (export.py) and the runner passes in,
  as `cosine-min` (River-LLM's minimum cosine over every block of a segment) does with `ExitState.blocks` (the
  segments' `layer_states` output at run time, `Capture` of every layer in calibrate).
- `CANDIDATE_SOURCES` (eectl/candidates.py): how the K candidates of the local vocabulary are picked at the first
  exit a token reaches (FlexEE: Top-K of one full LM-head projection; a frequency shortlist; an int8 LM head). A
  source gets the backend, the exit and its state and returns candidate ids and their logits [N, K]; later exits
  score those rows with `local`. To add one, subclass `CandidateSource` there, `register_candidates(...)` it, and
  pass its name as `ExitScoring(..., source=name)` (calibrate and run take the same name, so thresholds mean the
  same thing).

What this module does not do: pick candidates (candidates.py), fit thresholds (thresholds.py), train heads
(heads.py), or run ONNX Runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from eectl.candidates import CANDIDATE_SOURCES, CandidateSource, FirstExitTopK
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
    """The `learned` signal's exit test at one exit, fitted by eectl.probe on the head's training tokens to predict
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
        if isinstance(z, torch.Tensor):
            out = self.score(z.detach().float().numpy(), np.asarray(prob), np.asarray(margin))
            return torch.from_numpy(out)
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
    if isinstance(logits, torch.Tensor):
        ids = None if candidates is None else candidates.numpy()
        out = signals(logits.detach().float().numpy(), ids)
        return ExitSignals(*(torch.from_numpy(np.ascontiguousarray(x)) for x in (out.token, out.prob, out.margin)))
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


# ---------------------------------------------------------------------------------------------------------------
# Where logits come from (how candidates are picked: candidates.py)
# ---------------------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------------------
# Signals
# ---------------------------------------------------------------------------------------------------------------


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


class Signal:
    """An exit signal: its criteria (a token exits when every value is >= its threshold) and how it is measured."""

    name: str = ""
    criteria: tuple[str, ...] = ()
    needs_candidates: bool = False  # scores the local vocabulary: the first exit picks candidates
    needs_layer_input: bool = False  # reads ExitState.layer_input
    needs_blocks: bool = False  # reads ExitState.blocks (segment graphs output them as `layer_states`)
    torch_math: bool = False  # measures with torch ops (the runner runs them on one torch thread beside ORT's pool)
    in_graph: bool = False  # its test is `decision_nodes` over the local logits (the exit graphs decide it)
    needs_probe: bool = False  # reads the exit's Probe (heads fitted with probes; exit graphs with a `score` output)

    def __init__(self, name: str, criteria: tuple[str, ...]) -> None:
        self.name, self.criteria = name, criteria

    def measure(self, scoring: ExitScoring, layer: int, state: ExitState) -> ExitScore:
        raise NotImplementedError

    def passes(self, values: dict[str, Array], thresholds: dict[str, float]) -> Array:
        return passes(values, {c: thresholds[c] for c in self.criteria})


# ---------------------------------------------------------------------------------------------------------------
# The decision inside an exit graph: a softmax signal's test as ONNX nodes (export appends them to the exit graphs)
# ---------------------------------------------------------------------------------------------------------------
#
# The runner's bound path (runtime/chain.py) reads two scalars per decision, whether the token passes and its candidate
# token, instead of K logits and numpy math. The nodes are `signals` + `passes` op for op: float32 logits, m = max, e =
# exp(z - m), prob = 1 / sum(e), margin = prob - exp(z2 - m) / sum(e) (z2 the second largest logit), pass = prob >=
# t_prob and margin >= t_margin; the token is the first argmax, as numpy's. With a probe (the `learned` signal), a third
# value: the probe's score (`Probe.score`, op for op: its MLP or logistic regression over z, the graph's normed state,
# and the softmax's scalars; the weights constants of the graph). The thresholds are one graph input [2], or [3] in a
# graph with a probe, in `GRAPH_CRITERIA` order; a criterion the signal does not test gets -inf (always met). An exit
# graph without a probe is exactly what it was before probes (its thresholds [2]), so artifacts exported before run as
# they did: the runner reads the declared length (`graph_thresholds`). Summation order and exp may differ from numpy's
# by float32 rounding: values agree within ~1e-6 (tests), so a decision can differ only for a value within that of its
# threshold.

GRAPH_CRITERIA = ("prob", "margin", "score")
SOFTMAX_CRITERIA = 2  # the thresholds' length in a graph without a probe (every artifact exported before probes)


class OpBuilder(Protocol):
    """What the decision nodes need of export's graph builder (export_graphs._Builder)."""

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs: Any) -> Any: ...

    def const(self, name: str, value: Any, float_type: bool = True, scalar: bool = False) -> str: ...

    def fresh(self, base: str) -> str: ...

    elem: Any  # the graph's activations' element type (onnx TensorProto.DataType: the artifact dtype's)


def graph_thresholds(signal: Signal, thresholds: dict[str, float], size: int = len(GRAPH_CRITERIA)) -> np.ndarray:
    """The thresholds input [size] float32 of an exit graph's decision for `signal`'s criteria (`size`: the length
    the graph declares, 2 without a probe, 3 with one)."""
    names = GRAPH_CRITERIA[:size]
    missing = [c for c in signal.criteria if c not in names]
    if missing:
        raise UsageError(
            f"this artifact's exit graphs do not compute the {missing[0]} criterion of --signal {signal.name}",
            hint="export it with heads that carry probes (eectl train-heads --probe-only)",
        )
    return np.array([thresholds[c] if c in signal.criteria else -np.inf for c in names], dtype=np.float32)


def decision_nodes(
    b: OpBuilder, logits: str, ids: str | None, thresholds: str, probe: tuple[str, Probe] | None = None
) -> tuple[str, str, str | None]:
    """Append the softmax decision over `logits` [N, K] (vocabulary ids [N, K], or None: logits over the whole
    vocabulary) with `thresholds` [2] float32 ([3] with `probe`: (the normed state [N, H], its Probe)); returns
    (passed [N] bool, token [N] int64, the probe's score [N] float32 or None)."""
    from onnx import TensorProto

    def ints(name: str, *v: int) -> str:
        return b.const(b.fresh(name), np.array(v, np.int64), False)

    def f32(name: str, v: Any) -> str:
        return b.const(b.fresh(name), np.asarray(v, np.float32), False)

    last = ints("last_axis", -1)
    as_float = b.elem == TensorProto.FLOAT  # float32 activations need no Cast
    # a one-token decision's cost is what a decoder segment has just evicted from the caches: its weights' bytes
    # first, then ~1 us a node and 27-65 us a session call (measured after a segment on 2 threads), so the test is
    # built from as few nodes as its exact arithmetic allows
    z = logits if as_float else b.op("Cast", [logits], to=TensorProto.FLOAT)
    # the top two as numpy finds them: ties to the lower index; a -inf column after the K so that K = 1 has a second
    # (margin = prob there)
    minus_inf = b.const(b.fresh("minus_inf"), np.array(-np.inf, np.float32), False, scalar=True)
    padded = b.op("Pad", [z, ints("pad_last", 0, 0, 0, 1), minus_inf])  # [N, K + 1]
    top, top_idx = b.op("TopK", [padded, ints("two", 2)], 2, axis=-1, largest=1, sorted=1)  # [N, 2]
    m, second = b.op("Split", [top], 2, axis=-1, num_outputs=2)  # [N, 1] each
    total = b.op("ReduceSum", [b.op("Exp", [b.op("Sub", [z, m])]), last], keepdims=1)
    prob = b.op("Reciprocal", [total])
    margin = b.op("Sub", [prob, b.op("Div", [b.op("Exp", [b.op("Sub", [second, m])]), total])])
    columns = [prob, margin]
    score = None
    if probe is not None:  # Probe.score: [z, f] @ [w_state; w_scalar] + b, then relu @ w_out + b_out: [N, 1]
        state, p = probe
        feats = [prob, margin]
        if p.w_scalar.shape[0] > 2:  # probe_scalars
            pc = b.op("Clip", [prob, f32("prob_lo", PROB_CLIP), f32("prob_hi", 1 - PROB_CLIP)])
            rest = b.op("Sub", [f32("one", 1.0), pc])
            feats += [
                b.op("Log", [pc]),
                b.op("Log", [rest]),
                b.op("Mul", [margin, margin]),
                b.op("Mul", [prob, margin]),
            ]
        zf = state if as_float else b.op("Cast", [state], to=TensorProto.FLOAT)
        x = b.op("Concat", [zf, *feats[: p.w_scalar.shape[0]]], axis=-1)  # [N, H + F]
        w = np.concatenate([p.w_state, p.w_scalar], axis=0)
        score = b.op("Gemm", [x, f32("probe_w", w), f32("probe_b", p.b)])  # [N, D]; the logistic's: D = 1
        if p.w_out is not None:
            score = b.op(
                "Gemm", [b.op("Relu", [score]), f32("probe_w_out", p.w_out[:, None]), f32("probe_b_out", [p.b_out])]
            )
        columns.append(score)
    values = b.op("Concat", columns, axis=-1)  # [N, 2 or 3], GRAPH_CRITERIA order
    met = b.op("GreaterOrEqual", [values, thresholds])  # a NaN value never passes
    passed = b.op("ReduceMin", [met, last], keepdims=0)  # [N] bool: every criterion
    idx = b.op("Gather", [top_idx, ints("first", 0)], axis=1)  # [N, 1]: the top-1's column
    token = b.op("Squeeze", [idx if ids is None else b.op("GatherElements", [ids, idx], axis=1), last])  # [N]
    return passed, token, None if score is None else b.op("Squeeze", [score, last])


class LocalSoftmax(Signal):
    """Top-1 probability / top-1 minus top-2 margin of a softmax over the K candidates (FlexEE's Top-K local
    vocabulary)."""

    needs_candidates = True
    in_graph = True  # the decision nodes above compute its test inside the exit graphs

    def measure(self, scoring: ExitScoring, layer: int, state: ExitState) -> ExitScore:
        ids, logits = scoring.local_logits(layer, state)
        s = signals(logits, ids)
        pred = Prediction(logits, ids, s.token)
        return ExitScore({c: getattr(s, c) for c in self.criteria}, lambda: pred, pred)


class LearnedScore(Signal):
    """The exit's probe (`Probe`, fitted by `eectl train-heads`) over its normed state and the local softmax's prob
    and margin: the same candidates and local logits as topk-prob, one more dot product. The score comes from the
    backend (`ExitLogits.probe_score`: the head's probe in torch, the exit graph's `score` output at run time)."""

    needs_candidates = True
    in_graph = True  # decision_nodes computes the score inside exit graphs exported with a probe
    needs_probe = True

    def measure(self, scoring: ExitScoring, layer: int, state: ExitState) -> ExitScore:
        ids, logits = scoring.local_logits(layer, state)
        s = signals(logits, ids)
        pred = Prediction(logits, ids, s.token)
        score = scoring.logits.probe_score(layer, state.hidden, s.prob, s.margin)
        return ExitScore({"score": score}, lambda: pred, pred)


class FullSoftmax(Signal):
    """The same over the whole vocabulary (a full LM-head projection at every exit)."""

    def measure(self, scoring: ExitScoring, layer: int, state: ExitState) -> ExitScore:
        logits = scoring.logits.full(layer, state.hidden)
        s = signals(logits)
        pred = Prediction(logits, None, s.token)
        return ExitScore({c: getattr(s, c) for c in self.criteria}, lambda: pred, pred)


class TransitionCosine(Signal):
    """River-LLM's state transition: cos(input, output) of the last decoder layer before the exit; the token is the
    exit's full-vocabulary top-1, projected only when asked for."""

    needs_layer_input = True
    torch_math = True

    def measure(self, scoring: ExitScoring, layer: int, state: ExitState) -> ExitScore:
        assert state.layer_input is not None, "the cosine signal needs the last layer's input"
        cos = transition_cosine(torch.as_tensor(state.layer_input), torch.as_tensor(state.hidden))
        return ExitScore({"cosine": cos}, lambda: Prediction(scoring.logits.full(layer, state.hidden)))


class MinTransitionCosine(Signal):
    """River-LLM's exit test: the minimum over the segment's blocks (those since the previous exit) of cos(block
    input, block output); the token is the exit's full-vocabulary top-1, projected only when asked for (a river
    that predicts at its end never asks)."""

    needs_blocks = True
    torch_math = True

    def measure(self, scoring: ExitScoring, layer: int, state: ExitState) -> ExitScore:
        assert state.blocks is not None, "the cosine-min signal needs the segment's block states"
        cos = min_transition_cosine(torch.as_tensor(state.blocks))
        return ExitScore({"cosine": cos}, lambda: Prediction(scoring.logits.full(layer, state.hidden)))


SIGNALS: dict[str, Signal] = {}


def register_signal(signal: Signal) -> Signal:
    SIGNALS[signal.name] = signal
    return signal


register_signal(LocalSoftmax("topk-prob", ("prob",)))
register_signal(LocalSoftmax("topk-margin", ("margin",)))
register_signal(LocalSoftmax("topk-prob+margin", ("prob", "margin")))
register_signal(LearnedScore("learned", ("score",)))
register_signal(FullSoftmax("full-prob", ("prob",)))
register_signal(FullSoftmax("full-margin", ("margin",)))
register_signal(TransitionCosine("cosine", ("cosine",)))
register_signal(MinTransitionCosine("cosine-min", ("cosine",)))
DEFAULT_SIGNAL = "topk-prob"
# The default when every exit's head carries a probe (measured in the README, calibrate: more tokens exit at the same
# held-out precision than with `topk-prob` through the same heads); DEFAULT_SIGNAL otherwise.
DEFAULT_SIGNAL_WITH_PROBES = "learned"


def choose_signal(named: str | None, heads: dict[int, nn.Module] | None, exits: list[int]) -> str:
    """The signal calibrate measures: the one named (--signal, else the recipe's), or, when none is, the probes'
    where every exit's head carries one, DEFAULT_SIGNAL otherwise."""
    if named is not None:
        return named
    if heads and all(probe_of(heads.get(e)) is not None for e in exits):
        return DEFAULT_SIGNAL_WITH_PROBES
    return DEFAULT_SIGNAL


def get_signal(name: str) -> Signal:
    if name not in SIGNALS:
        raise UsageError(f"--signal must be one of {', '.join(SIGNALS)}, got '{name}'")
    return SIGNALS[name]


class ExitScoring:
    """Scores one batch of tokens at its exits, visited in ascending order; remembers the candidates the first
    exit picked for the later ones (the one place the "Top-K at the first exit, local rows after" rule lives)."""

    def __init__(
        self,
        signal: Signal,
        logits: ExitLogits,
        top_k: int = DEFAULT_TOP_K,
        source: str | CandidateSource = FirstExitTopK.name,
    ) -> None:
        self.signal = signal
        self.logits = logits
        self.top_k = top_k
        self.source = CANDIDATE_SOURCES[source] if isinstance(source, str) else source
        self.candidates: Array | None = None  # [N, K], once the first exit picked them

    def local_logits(self, layer: int, state: ExitState) -> tuple[Array, Array]:
        """(candidate ids [N, K], their logits at this exit [N, K])."""
        if self.candidates is None:
            self.candidates, logits = self.source.pick(self.logits, layer, state, self.top_k)
            return self.candidates, logits
        return self.candidates, self.logits.local(layer, state.hidden, self.candidates)

    def score(
        self,
        layer: int,
        hidden: Array,
        layer_input: Array | None = None,
        blocks: Array | None = None,
    ) -> ExitScore:
        return self.signal.measure(self, layer, ExitState(hidden, layer_input, blocks))
