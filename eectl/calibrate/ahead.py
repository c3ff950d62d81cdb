"""Calibration's traces of verify drafting ahead (runtime/ahead.py), for the plan to price (plan/ahead.py).

On each greedy full-depth continuation calibration generated, at every exit without a block head: at each generated
token a[i] but the last, the exit's top-1 over the K candidates its candidate source picks there (the candidates
picked at that exit, as the drafter picks them) with its softmax probability p_i, and whether that token is a[i + 1].
These are the numbers `runtime/ahead.py traces` reads from the artifact's graphs (the state at a[i]'s position, after
the layers up to the exit, all with full depth's K/V), here from the states the continuations' generation kept: no
second pass. Calibration runs before export, so which exits end a segment is the plan's to check.

What this module does not do: price the drafter (plan/ahead.py) or run an artifact (runtime/ahead.py).
"""

from __future__ import annotations

import torch

from eectl.contracts.calibration import AheadTraces
from eectl.exits.base import ExitState, TorchExitLogits
from eectl.exits.generation import Continuation
from eectl.exits.measure import ExitScorer

DIGITS = 4  # the traces' probabilities, rounded: a bound's product moves by < 1e-3 over a run of eight drafts


@torch.no_grad()
def ahead_traces(scorer: ExitScorer, conts: list[Continuation]) -> AheadTraces:
    """Per exit of `scorer` without a block head, per continuation: the signed top-1 probabilities
    (contracts/calibration.py AheadTraces). The continuations were generated keeping `scorer`'s states
    (`generation_keep`: the positions that predict the generated tokens)."""
    logits = TorchExitLogits(scorer.heads)
    signed: dict[str, list[list[float]]] = {}
    for layer in scorer.exits:
        if layer in scorer.sequence_heads:  # a block head's exit cannot draft ahead
            continue
        per: list[list[float]] = []
        for c in conts:
            if c.states is None or len(c.generated) < 2:
                per.append([])
                continue
            h = c.states[layer][1:]  # [n - 1, H]: row j + 1 is a[j]'s position, whose next token is a[j + 1]
            cand, z = scorer.source.pick(logits, layer, ExitState(h), scorer.top_k)
            probs = torch.softmax(z.double(), dim=-1)
            p, i = probs.max(dim=-1)
            token = cand.gather(-1, i[:, None])[:, 0].cpu()
            right = token == torch.tensor(c.generated[1:], dtype=token.dtype)
            kept = p.clamp(min=10.0**-DIGITS).cpu().tolist()
            per.append([round(x if ok else -x, DIGITS) for x, ok in zip(kept, right.tolist(), strict=True)])
        signed[str(layer)] = per
    return AheadTraces(top_k=scorer.top_k, signed=signed)
