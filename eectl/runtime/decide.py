"""The exit test at run time, for several rows' tokens at once: `ExitTest`.

Where the exit graphs compute the run's signal, the graphs decide (runtime/graph_decide.py, one call for the rows),
on host states and on a device-resident run's (`Placement.device`: one flag and one token per row read) alike.
Other signals are scored through `eectl.exits.signals.ExitScoring` on the ONNX exit graphs' outputs
(`OrtExitLogits`): the same code calibrate runs in torch, so a calibrated threshold means the same thing here; on a
device-resident run's states the Top-K ones on the K ids and logits the exit graphs read out, the others on one
scalar per row (runtime/resident.py).
A gated exit (eectl.exits.gates) runs the test only where the gate on the exit's state opens.

What this module does not do: run segments, pick tokens or apply policies (runner.py).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from eectl.exits.base import CandidateSource, ExitScore, Prediction
from eectl.exits.signals import ExitScoring, Signal
from eectl.runtime import resident
from eectl.runtime.device_ops import concat, stack
from eectl.runtime.exit_logits import Decide, OrtExitLogits, _one_torch_thread
from eectl.runtime.graph_decide import GraphDecisions, decides_in_graph
from eectl.runtime.placement import Placement
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig

Answer = tuple[ExitScore | None, int, Any]  # (the score when the row exits, else None; its index; its candidates)


@dataclass
class ExitTest:
    """A run's exit test: its signal and thresholds (`cfg`) and candidate source."""

    rt: ArtifactRuntime
    signal: Signal
    cfg: RunConfig
    source: CandidateSource
    # the exit graphs decide where they compute the run's signal (runtime/graph_decide.py), else None
    graph: GraphDecisions | None = field(init=False)

    def __post_init__(self) -> None:
        exits = list(self.cfg.exits)
        in_graph = decides_in_graph(self.rt, exits, self.signal)
        active = {e: self.cfg.thresholds[e] for e in exits}  # the run's exits only (the checked ones)
        self.graph = GraphDecisions(self.rt, self.signal, active, self.cfg.top_k) if in_graph else None

    def rows(self, layer: int, asks: dict[int, Decide], place: Placement) -> dict[int, Answer]:
        """Exit test at `layer` for several rows' current tokens at once (one exit graph call for all of them);
        per row: (the score when it exits, else None; the row's index in it; its candidates for later exits)."""
        picking = {r: a for r, a in asks.items() if a.candidates is None}
        if picking and len(picking) < len(asks):  # gated: some rows picked candidates earlier, some pick them here
            split = self.rows(layer, picking, place)
            split.update(self.rows(layer, {r: a for r, a in asks.items() if r not in picking}, place))
            return split
        rows = sorted(asks)
        hidden = stack(self.rt, [asks[r].hidden for r in rows])  # [N, H]
        if self.graph is not None:
            return self._in_graph(layer, rows, hidden, asks, place)
        layer_input = block_states = None
        if self.signal.needs_layer_input:
            layer_input = stack(self.rt, [asks[r].layer_input for r in rows])
        if self.signal.needs_blocks and not place.device:  # [n + 1, N, H]
            block_states = np.stack([np.asarray(asks[r].blocks) for r in rows], axis=1)
        scoring = ExitScoring(self.signal, OrtExitLogits(self.rt, place), self.cfg.top_k, self.source)
        if asks[rows[0]].candidates is not None:  # rows at one exit passed the same earlier exits
            scoring.candidates = np.concatenate([asks[r].candidates for r in rows])
        if place.device and not self.signal.needs_candidates:  # one scalar per row read (runtime/resident.py)
            blocks = [asks[r].blocks for r in rows]
            score = resident.score(self.rt, place, self.signal, layer, hidden, layer_input, blocks, self.cfg.top_k)
            passed = self.signal.passes(score.values, self.cfg.thresholds[layer])
        else:
            with _one_torch_thread() if self.signal.torch_math else nullcontext():
                score = scoring.score(layer, hidden, layer_input, block_states)
                passed = self.signal.passes(score.values, self.cfg.thresholds[layer])
        answers: dict[int, Answer] = {}
        for i, r in enumerate(rows):
            cands = None if scoring.candidates is None else scoring.candidates[i : i + 1]
            answers[r] = (score if bool(passed[i]) else None, i, cands)
        return answers

    def _in_graph(
        self, layer: int, rows: list[int], hidden: Any, asks: dict[int, Decide], place: Placement
    ) -> dict[int, Answer]:
        """The exit graph decides for the rows (one call; runtime/graph_decide.py); an exiting row's score predicts
        from the candidates' logits (`top1`: the graph's own greedy token, all a device-resident run reads)."""
        graph = self.graph
        assert graph is not None
        picked = asks[rows[0]].candidates
        given = None if picked is None else concat(self.rt, [asks[r].candidates for r in rows], 0)
        got = graph.decide(layer, hidden, given, place)
        score = ExitScore({}, lambda: Prediction(got.logits, got.candidates, got.token))
        return {r: (score if bool(got.passed[i]) else None, i, got.candidates[i : i + 1]) for i, r in enumerate(rows)}
