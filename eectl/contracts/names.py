"""The names that the files between stages use for exit signals, KV policies, candidate sources and model families,
written once as data.

A calibration file names its signal and criteria, a recipe or a manifest names KV policies; validating them must
not import torch or ONNX Runtime, so the names live here and the registries that implement them
(`eectl.exits.signals.SIGNALS`, `eectl.runtime.policies.POLICIES`) refuse at import to register a name that is not
here or that disagrees with its entry. To add a signal or a policy: add its entry here, then its class there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SignalSpec:
    criteria: tuple[str, ...]  # a token exits when every criterion's value is >= its threshold
    needs_candidates: bool  # scores the local vocabulary: the first exit picks candidates


SIGNAL_SPECS: dict[str, SignalSpec] = {
    "topk-prob": SignalSpec(("prob",), True),
    "topk-margin": SignalSpec(("margin",), True),
    "topk-prob+margin": SignalSpec(("prob", "margin"), True),
    "learned": SignalSpec(("score",), True),
    "full-prob": SignalSpec(("prob",), False),
    "full-margin": SignalSpec(("margin",), False),
    "cosine": SignalSpec(("cosine",), False),
    "cosine-min": SignalSpec(("cosine",), False),
}


# The values a criterion takes (signals.py computes them): a threshold outside them is an exit that never fires (above)
# or always does (below), so a threshold given or scaled there is refused. Criteria not listed (the learned probe's
# `score`, a gate's logit) are unbounded.
CRITERION_RANGES: dict[str, tuple[float, float]] = {
    "prob": (0.0, 1.0),  # a softmax probability
    "margin": (0.0, 1.0),  # top-1 minus top-2 probability
    "cosine": (-1.0, 1.0),  # a cosine similarity
}


def threshold_problem(criterion: str, value: float) -> str | None:
    """Why `value` cannot be a threshold of `criterion` (not finite, outside its range), or None. Infinity is
    calibration's "never exits" and is not given here: callers pass the values a user or a scale set."""
    if not math.isfinite(value):
        return f"{criterion} threshold {value} is not a finite number"
    lo, hi = CRITERION_RANGES.get(criterion, (-math.inf, math.inf))
    if not lo <= value <= hi:
        why = "could never fire" if value > hi else "would always fire"
        return f"{criterion} threshold {value:g} is outside [{lo:g}, {hi:g}]: the exit {why}"
    return None


# How the first active exit picks the K candidates (eectl.exits.candidates.CANDIDATE_SOURCES registers these names;
# a manifest's `candidate_source.name`). The shortlists carry their token ids.
CANDIDATE_SOURCE_NAMES = ("first-exit-topk", "shortlist", "int8", "shortlist-int8")
SHORTLISTS = ("shortlist", "shortlist-int8")

# Model families (eectl.models.adapters registers an adapter for each) and the Hugging Face model_type each reads: a
# manifest's `family` and `model.model_type`, a recipe's `family`.
FAMILIES: dict[str, tuple[str, ...]] = {
    "llama": ("llama",),
    "mistral": ("mistral",),
    "qwen2": ("qwen2",),
    "qwen3": ("qwen3",),
    "gemma3_text": ("gemma3_text",),
}


# What the segments after a token's exit cost it (the cost model's term, plan/choose.py): their K/V-only graphs
# (KV_CALLS), one more position each in a later pass that carries its state along (RIDE), or their int4 copies
# (RIVER_CALLS).
KV_CALLS, RIDE, RIVER_CALLS = "kv-calls", "ride", "river-calls"


@dataclass(frozen=True)
class PolicySpec:
    needs_river_copies: bool = False  # runs the int4 segment copies that `export --river` adds
    later: str = RIDE  # what the segments after an exit cost an exited token (KV_CALLS, RIDE, RIVER_CALLS)
    # exited tokens are drafts that a later full-depth pass checks, one more row of the final head each, and rolls
    # back when wrong: priced by its cycles (plan/verify.py verify_cycle)
    checks_drafts: bool = False


POLICY_SPECS: dict[str, PolicySpec] = {
    "copy": PolicySpec(later=KV_CALLS),
    "defer": PolicySpec(),
    "verify": PolicySpec(checks_drafts=True),
    "river": PolicySpec(needs_river_copies=True, later=RIVER_CALLS),
}


def default_policies() -> list[str]:
    """The policies every artifact supports (river needs the copies `export --river` adds): bench's default set."""
    return [n for n, p in POLICY_SPECS.items() if not p.needs_river_copies]
