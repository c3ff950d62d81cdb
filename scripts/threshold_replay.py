"""#13: is calibrate's held-out precision miss the threshold search or the data? (reads `heads_table.py menu --save`)

    python scripts/threshold_replay.py meas.pt

Per exit alone (its own candidates), thresholds fitted at 0.99 with 95% confidence on the fit half (all tokens,
or generated only) two ways: calibrate's search (`threshold_with_bound`: the lowest threshold whose prefix bound
clears the target) and a fixed-sequence test (from the highest threshold down, stop at the first failing prefix,
which keeps the family-wise guarantee); each replayed on the fit half and the held-out half.
"""

from __future__ import annotations

import sys

import torch

from eectl.exits.measure import SOURCES
from eectl.exits.thresholds import binomial_upper_tail, min_tokens_for, threshold_with_bound


def fixed_sequence(conf: torch.Tensor, correct: torch.Tensor, target: float, level: float) -> float:
    order = torch.argsort(conf, descending=True)
    hits, v = correct[order].long().cumsum(0), conf[order]
    best, i = float("inf"), min_tokens_for(target, level) - 1
    while i < len(order):
        if i + 1 < len(order) and v[i + 1] == v[i]:  # only whole ties form a prefix
            i += 1
            continue
        if float(binomial_upper_tail(hits[i : i + 1], torch.tensor([i + 1]), target)[0]) > 1 - level:
            break
        best, i = float(v[i]), i + 1
    return best


def main() -> None:
    meas = torch.load(sys.argv[1], weights_only=False)
    held = meas.heldout_mask(0.5)
    fit_mask = ~held
    gen = meas.source == SOURCES.index("generated")
    for layer in meas.exits:
        sub = meas.restrict([layer])
        conf, corr = sub.values["prob"][0], sub.correct[0]
        for name, m_fit, m_eval in (("all", fit_mask, held), ("generated", fit_mask & gen, held & gen)):
            row = f"exit {layer}, fit on {name}:"
            for how, t in (
                ("search", threshold_with_bound(conf[m_fit], corr[m_fit], 0.99, 0.95).threshold),
                ("fixed-sequence", fixed_sequence(conf[m_fit], corr[m_fit], 0.99, 0.95)),
            ):
                for split, m in (("fit", m_fit), ("held-out", m_eval)):
                    sel = m & (conf >= t)
                    k, h = int(sel.sum()), int((sel & corr).sum())
                    row += f" {how}/{split} coverage {k / max(1, int(m.sum())):.3f} precision {h / max(k, 1):.4f};"
            print(row)


if __name__ == "__main__":
    main()
