"""Exit heads and exit signals: the ONE definition of what an exit computes, how confident it is, and whether a
token leaves there.

An exit after layer l maps that layer's hidden state to a prediction: an optional trained head (heads/train.py) into the
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
  input adds that state to `ExitState` and to what the segment graphs output (export/exporter.py) and the runner passes
  in, as `cosine-min` (River-LLM's minimum cosine over every block of a segment) does with `ExitState.blocks` (the
  segments' `layer_states` output at run time, `Capture` of every layer in calibrate).
- `CANDIDATE_SOURCES` (eectl/candidates.py): how the K candidates of the local vocabulary are picked at the first
  exit a token reaches (FlexEE: Top-K of one full LM-head projection; a frequency shortlist; an int8 LM head). A
  source gets the backend, the exit and its state and returns candidate ids and their logits [N, K]; later exits
  score those rows with `local`. To add one, subclass `CandidateSource` there, `register_candidates(...)` it, and
  pass its name as `ExitScoring(..., source=name)` (calibrate and run take the same name, so thresholds mean the
  same thing).

What this module does not do: pick candidates (exits/candidates.py), fit thresholds (exits/thresholds.py), train heads
(heads/train.py), or run ONNX Runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import nn

from eectl.contracts.names import SIGNAL_SPECS, SignalSpec
from eectl.errors import UsageError
from eectl.exits.base import (
    DEFAULT_TOP_K,
    PROB_CLIP,
    Array,
    CandidateSource,
    ExitLogits,
    ExitScore,
    ExitState,
    Prediction,
    Probe,
    min_transition_cosine,
    passes,
    probe_of,
    signals,
    transition_cosine,
)
from eectl.exits.candidates import CANDIDATE_SOURCES, FirstExitTopK

if TYPE_CHECKING:
    pass


# ---------------------------------------------------------------------------------------------------------------
# Where logits come from (how candidates are picked: exits/candidates.py)
# ---------------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------------
# Signals
# ---------------------------------------------------------------------------------------------------------------


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
    spec = SIGNAL_SPECS.get(signal.name)
    if spec is None or spec != SignalSpec(signal.criteria, signal.needs_candidates):
        raise TypeError(f"signal '{signal.name}' does not match its entry in eectl.contracts.names.SIGNAL_SPECS")
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
