"""The exit test at run time, for several rows' tokens at once: `ExitTest`.

On host states the signal is scored through `eectl.exits.signals.ExitScoring` on the ONNX exit graphs
(`OrtExitLogits`): the same code calibrate runs in torch, so a calibrated threshold means the same thing here. On a
device-resident run's states (`Placement.device`) the Top-K candidate signals score the same way, on the K ids and
logits the exit graphs read out, and the other signals read one scalar per row (runtime/resident.py). A gated exit
(eectl.exits.gates) runs the test only where the gate on the exit's state opens.

What this module does not do: run segments, pick tokens or apply policies (runner.py).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np

from eectl.exits.base import CandidateSource, ExitScore
from eectl.exits.gates import gate_open
from eectl.exits.signals import ExitScoring, Signal
from eectl.runtime import resident
from eectl.runtime.device_ops import stack
from eectl.runtime.exit_logits import Decide, OrtExitLogits, _one_torch_thread
from eectl.runtime.placement import Placement
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RowState, RunConfig

Answer = tuple[ExitScore | None, int, Any]  # (the score when the row exits, else None; its index; its candidates)


@dataclass
class ExitTest:
    """A run's exit test: its signal and thresholds (`cfg`) and candidate source."""

    rt: ArtifactRuntime
    signal: Signal
    cfg: RunConfig
    source: CandidateSource

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

    def gate_opens(self, gate: Any, st: RowState, layer: int, exit_in: Any, place: Placement) -> bool:
        """Whether the decision at `layer` runs for this row's token: `gate` the run's gate there (`Runner.gates`;
        None: it does). A device-resident state is read to the host for it ([H]: one more read, recorded in
        `place`)."""
        if gate is None:
            return True
        t0 = time.perf_counter()
        h = exit_in[0, -1]
        if not isinstance(h, np.ndarray):
            H = self.rt.manifest.dims["hidden_size"]
            h = self.rt.ops.last(exit_in[0, -1:].reshape(1, 1, H), np.zeros(1, np.int64), on_device=False)
            place.read(("gate", layer, "hidden"))
        opened = gate_open(gate, np.asarray(h))
        st.decide_s += time.perf_counter() - t0
        return opened
