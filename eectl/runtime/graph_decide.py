"""Exit decisions made inside the exit graphs (exits.decision_nodes), for the rows of a step: `GraphDecisions`.

An artifact's exit graphs end in the decision nodes: given the thresholds as an input, a graph outputs whether each
row passes (`passed` [N]) and its token (`exit_token` [N]) beside the candidates it picked or scored. Where the run's
signal is computed there (`Signal.in_graph`: the candidate softmax, its margin, the learned probe) every greedy step
decides this way — the bound chain's one-row steps (runtime/chain.py, which binds these graphs on its own buffers)
and the runner's other steps (a batch's rows, teacher-forced scoring) through `GraphDecisions` — so one arithmetic
decides a token whichever way its step runs, and it is the arithmetic export checked against calibrate's torch
decision. The first active exit a token tests picks its candidates (the artifact's candidate graph, else the exit's
own Top-K); a later exit scores those candidates with its local graph.

What this module does not do: run segments or choose the exit's token under sampling (the runner picks from the
candidates' logits), or decide signals the graphs do not compute (the cosines, the full-vocabulary softmax:
decide.py scores those on the host).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from eectl.exits.signals import Signal, graph_thresholds
from eectl.runtime.ort import DeviceView, Graph, _ort
from eectl.runtime.placement import Placement
from eectl.runtime.sessions import ArtifactRuntime


def picker_graph(rt: ArtifactRuntime, layer: int) -> tuple[Graph, str]:
    """The graph that picks a token's candidates at `layer`, and its name in the binding plan: the artifact's
    candidate source graph where it has one, else the exit's full graph (its Top-K)."""
    g = rt.candidate_graphs.get(layer)
    return (g, "candidates") if g is not None else (rt.full_graphs[layer], "exit_full")


def decides_in_graph(rt: ArtifactRuntime, exits: list[int], signal: Signal) -> bool:
    """Whether the exit graphs at these exits decide `signal`: a signal the decision nodes compute, graphs exported
    with them (`passed`; older artifacts decide on the host), and the probe's score where the signal reads one."""
    if not exits or not signal.in_graph:
        return False
    graphs = [picker_graph(rt, exits[0])[0], *(rt.local_graphs[e] for e in exits[1:])]
    graphs += [picker_graph(rt, e)[0] for e in exits[1:]]  # a gated run may pick at any exit
    if signal.needs_probe and not all("score" in g.io.outputs for g in graphs):
        return False
    return all("passed" in g.io.outputs for g in graphs)


def declared(g: Graph) -> dict[str, list[Any]]:
    """The input shapes graph `g`'s session declares, by ORT name (an input with a default is an overridable
    initializer to ORT, not among get_inputs())."""
    session = g.session
    return {i.name: i.shape for i in [*session.get_inputs(), *session.get_overridable_initializers()]}


def thresholds_input(g: Graph, signal: Signal, thresholds: dict[str, float]) -> np.ndarray:
    """Graph `g`'s thresholds input for `signal`, of the length the graph declares: [2] without a probe (every
    artifact exported before probes), [3] with one."""
    return graph_thresholds(signal, thresholds, int(declared(g)[g.name("thresholds")][0]))


@dataclass
class Decided:
    """One decision call's rows: whether each passes [N], its token [N] (a vocabulary id), the candidates it picked
    or scored [N, K] (a device value on a device-resident run: what a later exit scores stays there) and their
    logits [N, K] (None on a device-resident run: never read). Host arrays are copies: the bound buffers are the
    next call's."""

    passed: np.ndarray
    token: np.ndarray
    candidates: Any
    logits: np.ndarray | None


class GraphDecisions:
    """The exit graphs deciding for rows' host states [N, H], each graph bound once per row count (the runtime's
    kept bindings, sessions.ArtifactRuntime._bound): a call copies the rows (and the candidates a later exit scores)
    in, runs the graph and copies out the four small outputs."""

    def __init__(self, rt: ArtifactRuntime, signal: Signal, thresholds: dict[int, dict[str, float]], k: int) -> None:
        self.rt, self.k = rt, k
        self._top_k = np.array([k], np.int64)  # bound by pointer on device-resident calls: lives as long as this
        self._thresholds: dict[tuple[int, bool], np.ndarray] = {}
        for layer, values in thresholds.items():
            self._thresholds[(layer, True)] = thresholds_input(picker_graph(rt, layer)[0], signal, values)
            self._thresholds[(layer, False)] = thresholds_input(rt.local_graphs[layer], signal, values)

    def __call__(self, layer: int, hidden: np.ndarray, candidates: np.ndarray | None) -> Decided:
        """Decide at `layer` for the rows of `hidden` [N, H]: picking their candidates (`candidates` None) or
        scoring the candidates [N, K] an earlier exit picked for them."""
        rt, k, dt = self.rt, self.k, self.rt.np_dtype
        n, picking = hidden.shape[0], candidates is None
        g, kind = picker_graph(rt, layer) if picking else (rt.local_graphs[layer], "exit_local")
        thresholds = self._thresholds[(layer, picking)]
        inputs: dict[str, tuple[tuple[int, ...], Any]] = {
            "hidden": (hidden.shape, dt),
            "thresholds": (thresholds.shape, np.float32),
        }
        small: dict[str, np.ndarray] = {"thresholds": thresholds}
        if picking:
            inputs["top_k"] = ((1,), np.int64)
        else:
            assert candidates is not None
            inputs["candidates"] = ((n, k), np.int64)
            small["candidates"] = candidates
        shapes = {
            "passed": ((n,), np.bool_),
            "exit_token": ((n,), np.int64),
            "candidates": ((n, k), np.int64),
            "candidate_logits": ((n, k), dt),
            "score": ((n,), np.float32),
            "logits": ((n, rt.manifest.dims["vocab_size"]), dt),
            "token": ((n,), np.int64),
            "candidate_rows": ((n, k, rt.manifest.dims["hidden_size"]), dt),
        }
        # every output the graph has is bound (ORT writes them all); a later exit's candidates are its input
        outputs = {key: shape for key, shape in shapes.items() if key in g.io.outputs}
        b = rt._bound(f"decide-{kind}", layer, g, inputs, outputs)
        rt._run_bound(g, b, hidden, **small)
        out = b.outputs
        picked = out["candidates"].copy() if picking else np.array(candidates, np.int64)
        return Decided(out["passed"].copy(), out["exit_token"].copy(), picked, out["candidate_logits"].copy())

    def decide(self, layer: int, hidden: Any, candidates: Any, place: Placement) -> Decided:
        """The decision where the run's states live: `on_device` for a device-resident run, else on host arrays."""
        if place.device:
            return self.on_device(layer, hidden, candidates, place)
        kind = picker_graph(self.rt, layer)[1] if candidates is None else "exit_local"
        place.read((kind, layer, "passed"))  # a flag and a token per row, as the chain's bound decisions read
        place.read((kind, layer, "exit_token"))
        return self(layer, np.asarray(hidden), candidates)

    def on_device(self, layer: int, hidden: Any, candidates: Any, place: Placement) -> Decided:
        """`__call__` for a device-resident run's rows (`hidden` a DeviceView [N, H]): the candidates stay on the
        device (a later exit takes them as they are), the logits are never read; `passed` and `exit_token` (one
        scalar each per row) are the host reads, recorded in `place`."""
        rt, picking = self.rt, candidates is None
        g, kind = picker_graph(rt, layer) if picking else (rt.local_graphs[layer], "exit_local")
        call = rt._call(f"resident-decide-{kind}", layer, g, "lm_head")
        n = hidden.shape[0]
        rt._bind_array(call.io, g.name("hidden"), hidden)
        rt._bind_array(call.io, g.name("thresholds"), self._thresholds[(layer, picking)])
        if picking:
            rt._bind_array(call.io, g.name("top_k"), self._top_k)
            value = _ort().OrtValue.ortvalue_from_shape_and_type([n, self.k], np.int64, rt.device, 0)
            call.io.bind_ortvalue_output(g.name("candidates"), value)
            candidates = DeviceView.of(value)
        else:
            rt._bind_array(call.io, g.name("candidates"), candidates)
        for key in ("candidate_logits", "score", "logits", "token", "candidate_rows"):  # computed, never read
            if key in g.io.outputs:
                call.io.bind_output(g.name(key), rt.device)
        passed = rt._read(call.io, g.name("passed"), (n,), np.bool_, (kind, layer, "passed"), place)
        token = rt._read(call.io, g.name("exit_token"), (n,), np.int64, (kind, layer, "exit_token"), place)
        g.session.run_with_iobinding(call.io)
        return Decided(passed, token, candidates, None)
