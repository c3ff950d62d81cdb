"""Exit decisions' inputs at run time: `OrtExitLogits`, the exits' logits from the artifact's ONNX exit graphs (the
backend `eectl.exits.signals.ExitScoring` scores through), and `Decide`, what one row asks an exit test.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from eectl.exits.base import CandidateSource, no_probe_error
from eectl.runtime.placement import HOST, Placement
from eectl.runtime.sessions import ArtifactRuntime


class OrtExitLogits:
    """`eectl.exits.signals.ExitLogits` on the artifact's exit graphs: numpy in and out of ONNX Runtime, and numpy into
    the signal's math (exits.signals): a decision is one token, where torch's per-op dispatch cost more than the math.

    The full graph computes its Top-K in-graph (TopK), so a first-exit candidate pick costs no extra pass. `place`:
    the run's (runtime/placement.py): a device-resident run's hidden rows stay on the device, its reads recorded."""

    def __init__(self, rt: ArtifactRuntime, place: Placement = HOST) -> None:
        self.rt = rt
        self.place = place

    def full(self, layer: int, hidden: np.ndarray) -> np.ndarray:
        return self.rt.exit_full(layer, hidden, 2, place=self.place)[0]

    def full_topk(self, layer: int, hidden: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        _, cand, cand_logits = self.rt.exit_full(layer, hidden, k, place=self.place)
        return cand, cand_logits

    def local(self, layer: int, hidden: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        return self.rt.exit_local(layer, hidden, candidates, place=self.place)

    def candidates(
        self, source: CandidateSource, layer: int, hidden: np.ndarray, k: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """The artifact's candidate graph at this exit (export built it from `source`'s torch code)."""
        return self.rt.exit_candidates(layer, hidden, k, place=self.place)

    def probe_score(self, layer: int, hidden: np.ndarray, prob: np.ndarray, margin: np.ndarray) -> np.ndarray:
        """The exit graph's own `score` output of the call that just returned these rows' local logits (the graph
        computes it from the same logits: exits.decision_nodes mirrors Probe.score)."""
        score = self.rt.exit_scores.get(layer)
        if score is None or score.shape[0] != np.shape(prob)[0]:
            raise no_probe_error([layer])
        return score


@contextmanager
def _one_torch_thread() -> Iterator[None]:
    """For signals with torch math (the cosines; the softmax signals are numpy): the math is tiny, and with torch's
    own pool awake beside ONNX Runtime's spinning one it took ~6 ms per call on 2 cores (measured), on one thread
    microseconds."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@dataclass
class Decide:
    """A row's request for an exit test: its token's state after the exit's layer [H], the last layer's input [H]
    (the cosine signal), the candidates an earlier exit picked for it ([1, K] or None), and the segment's block
    boundaries [n + 1, H] (cosine-min) or None."""

    hidden: np.ndarray
    layer_input: np.ndarray
    candidates: Any = None
    blocks: np.ndarray | None = None
