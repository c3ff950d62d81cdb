"""The token a row emits from logits: greedy, or temperature / top-p sampling (`pick_token`), with the run's settings
and generator or a row's own (`RowSampling`: a request's, so its tokens do not depend on the rows beside it)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def pick_token(
    logits: np.ndarray, ids: np.ndarray | None, temperature: float, top_p: float, rng: np.random.Generator
) -> int:
    """Greedy (temperature <= 0) or temperature/top-p sampling over logits [V], or [K] with their vocabulary ids."""
    if temperature <= 0:
        i = int(np.argmax(logits))
    else:
        z = logits.astype(np.float64) / temperature
        p = np.exp(z - z.max())
        p /= p.sum()
        order = np.argsort(-p)
        keep = np.cumsum(p[order]) - p[order] < top_p
        keep[0] = True
        q = np.zeros_like(p)
        q[order[keep]] = p[order[keep]]
        i = int(rng.choice(len(q), p=q / q.sum()))
    return int(ids[i]) if ids is not None else i


@dataclass
class RowSampling:
    """One row's own sampling (an engine's request): its temperature (<= 0: greedy), top-p and generator. A row that
    has one draws only from its own generator, so a seeded request gets the same tokens alone or in any batch; a row
    without one follows the run's settings and the runner's generator (`Runner.generate`'s rows, in row order)."""

    temperature: float
    top_p: float
    rng: np.random.Generator

    @property
    def sampled(self) -> bool:
        return self.temperature > 0

    def pick(self, logits: np.ndarray, ids: np.ndarray | None = None) -> int:
        return pick_token(logits, ids, self.temperature, self.top_p, self.rng)
