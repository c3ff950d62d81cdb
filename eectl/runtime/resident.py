"""Exit decisions on device-resident states: what an exit test reads on the host when the states stay on the device.

The runner's host path scores an exit through `eectl.exits.signals.ExitScoring` on numpy arrays. With the binding plan
executed (a device-resident run's `Placement`: hidden states, KV and full logits stay device values between graphs), the
softmax signals over Top-K candidates work unchanged (the exit graphs' K ids and K logits are read, the full logits
stay on the device: sessions.ArtifactRuntime._resident_exit). The other signals read one scalar per row instead of
a full row of logits or hidden states, computed by the device pieces (runtime/device_ops.py):

- full-vocabulary softmax (full-prob, full-margin): the exit graph's Top-2 logits and the log-sum-exp of the full
  logits: p1 = exp(l1 - lse), margin = p1 - exp(l2 - lse) (the host path's `exits.signals` over V logits, reduced on
  the device);
- cosine: the transition cosine of the exit's last layer; cosine-min: the minimum over the segment's blocks. The
  exit's own prediction (its Top-K, K ids and logits) is computed only for a token that exits.

Values equal the host path's up to float rounding order (float32 math in both).

What this module does not do: run segments, pick tokens or apply policies (runner.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from eectl.exits.base import ExitScore, Prediction
from eectl.exits.signals import Signal
from eectl.runtime.device_ops import concat
from eectl.runtime.ort import DeviceView
from eectl.runtime.placement import Placement
from eectl.runtime.sessions import ArtifactRuntime


def last_positions(rt: ArtifactRuntime, blocks: Any) -> Any:
    """blocks [n + 1, S, H] -> [n + 1, H], every block boundary's last position (blocks[:, -1])."""
    if isinstance(blocks, np.ndarray):
        return blocks[:, -1]
    n1, s, h = blocks.shape
    if s == 1:
        return blocks.reshape(n1, h)
    return DeviceView.of(rt.ops.last(blocks, np.full(n1, s - 1, np.int64)))


def _read(place: Placement, op: str, layer: int, value: np.ndarray) -> np.ndarray:
    place.read((op, layer, "logsumexp" if op == "logsumexp" else "cosine"))
    return value


def score(
    rt: ArtifactRuntime,
    place: Placement,
    signal: Signal,
    layer: int,
    hidden: Any,
    layer_input: Any,
    blocks: list[Any],
    top_k: int,
) -> ExitScore:
    """A non-candidate signal's exit test for N rows on a device-resident run's states (`place`, which records
    what is read): hidden [N, H], layer_input [N, H] (cosine), blocks: per row [n + 1, H] (cosine-min)."""

    def exit_topk() -> Prediction:  # the token the exit would emit: its Top-K, read only when a row exits
        _, cand, cand_logits = rt.exit_full(layer, hidden, top_k, place=place)
        return Prediction(cand_logits, cand)

    if signal.needs_blocks:
        n1, h = blocks[0].shape
        states = concat(rt, blocks, 0).reshape(len(blocks), n1, h)  # [N, n + 1, H]
        cos = _read(place, "cosine_min", layer, rt.ops.cosine_min(states))
        return ExitScore({"cosine": cos}, exit_topk)
    if signal.needs_layer_input:
        cos = _read(place, "cosine", layer, rt.ops.cosine(layer_input, hidden))
        return ExitScore({"cosine": cos}, exit_topk)
    logits, cand, cand_logits = rt.exit_full(layer, hidden, 2, place=place)
    lse = _read(place, "logsumexp", layer, rt.ops.logsumexp(logits))
    top = np.exp(cand_logits.astype(np.float32) - lse[:, None])  # [N, 2]: the top-1 and top-2 probabilities
    values = {"prob": top[:, 0], "margin": top[:, 0] - top[:, 1]}
    pred = Prediction(cand_logits, cand, cand[:, 0])
    return ExitScore({c: values[c] for c in signal.criteria}, lambda: pred, pred)
