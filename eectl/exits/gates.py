"""Exit gates: a linear test on an exit's input state that decides whether the exit's decision runs at all.

A decision costs its memory traffic whether or not the token exits: the exit head's weights, the candidate
source's rows, the K exact LM-head rows, all evicted by the segment that ran just before (#11: 0.2-0.4 ms a
decision in decode on the default model, most of it bytes). A gate reads only the state the decision would read
(H multiply-adds, nothing else) and skips the decision where it predicts the decision would not pass:

    gate logit = w . h + b          (h: the exit's input state [H], float32 arithmetic)
    the decision runs   iff   gate logit >= the option's gate threshold  (thresholds[exit]["gate"])

The weights are a logistic regression fitted by calibrate, per exit, on the calibration split: features the states
(standardised for the fit, folded back into w and b), label "this exit alone passes this token" (its own candidates,
the thresholds a one-exit option fits at the target; its top-1 agreeing with the final layer where that exit never
passes). The threshold is fitted per menu option (calibrate/fit.py): the lowest value that keeps `keep` of the
tokens that option's decision passes at that exit (calibration split). A gated option's thresholds are then refitted
on what the gated run sees, so its precision guarantee covers the gate.

What a gate changes besides the time: an exit whose gate fails picks no candidates, so the candidates (signals that
score a Top-K) are picked at the first exit whose gate passes, and every later exit scores those
(`Measurements.restrict` with `gate_ok`: the replay; runtime/chain.py and runner.py: the run).

What this module does not do: choose thresholds (calibrate/fit.py) or run anything but the gate's arithmetic.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from eectl.contracts.gates import GATE, Gate
from eectl.errors import UsageError

L2 = 1e-3  # ridge on the standardised weights (the fit's only regularisation)
MAX_ITER = 200  # LBFGS iterations (a logistic fit on a few thousand states converges well within this)


def gate_logits(h: Any, weight: np.ndarray, bias: float) -> Any:
    """h [..., H] (numpy or torch) -> logits [...]: a float32 dot product plus the bias, calibrate's (torch) and the
    runner's (numpy) alike. Float32, not 64: in decode the host op runs on caches the segment just evicted, where
    numpy's float64 conversion and product took ~85 us against ~44 us (default model, measured). The two libraries
    may sum in different orders, so a logit can differ by float32 rounding (~1e-6 relative): a gate decision can
    differ only for a logit within that of its threshold, as a probe score's can (exits/signals.py)."""
    if isinstance(h, torch.Tensor):
        return (h.float() @ torch.from_numpy(weight)).double() + bias
    return float(np.dot(h, weight)) + bias if h.ndim == 1 else np.asarray(h, np.float32) @ weight + bias


def gate_open(gate: tuple[np.ndarray, float, float] | None, h: np.ndarray) -> bool:
    """Whether one token's decision runs: no gate (an ungated exit), or its logit on h [H] reaches the threshold."""
    if gate is None:
        return True
    weight, bias, threshold = gate
    return bool(gate_logits(h.reshape(-1), weight, bias) >= threshold)


def fit_gate(states: torch.Tensor, labels: torch.Tensor) -> Gate:
    """A logistic regression of labels [N] on states [N, H] (standardised for the fit; the result on raw states)."""
    x = states.double()
    mu = x.mean(0)
    sd = x.std(0) + 1e-6
    xs = (x - mu) / sd
    y = labels.double()
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=MAX_ITER, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(xs @ w + b, y) + L2 * (w * w).sum()
        loss.backward()
        return loss

    if bool(y.any()) and not bool(y.all()):
        opt.step(closure)
    with torch.no_grad():
        raw = w / sd
        bias = b - (raw * mu).sum()
    return Gate(weight=[float(v) for v in raw], bias=float(bias))


def gate_threshold(logits: torch.Tensor, keep: float) -> float:
    """The highest threshold that keeps at least `keep` of these logits (the passing tokens'): -inf for none."""
    if logits.numel() == 0:
        return float("-inf")
    ordered = torch.sort(logits.double()).values
    drop = int(np.floor((1.0 - keep) * logits.numel() + 1e-9))  # tokens below the threshold, at most 1 - keep
    return float(ordered[min(drop, logits.numel() - 1)])  # ties with it pass too (>=): never fewer kept


def active_gates(
    gates: dict[str, Gate] | None, thresholds: dict[int, dict[str, float]]
) -> dict[int, tuple[np.ndarray, float, float]]:
    """The gates a run uses: exit layer -> (weight, bias, threshold) for each active exit whose thresholds hold a
    gate; UsageError when the artifact has no gate there."""
    out: dict[int, tuple[np.ndarray, float, float]] = {}
    for layer, t in thresholds.items():
        if GATE not in t:
            continue
        gate = (gates or {}).get(str(layer))
        if gate is None:
            raise UsageError(
                f"exit {layer} has a gate threshold but the artifact has no gate there",
                hint="export with a calibration that fitted gates, or drop the gate threshold",
            )
        out[layer] = (*gate.arrays(), float(t[GATE]))
    return out
