"""The token a row emits from logits: greedy, or temperature / top-p sampling (the runner's one way to pick)."""

from __future__ import annotations

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
