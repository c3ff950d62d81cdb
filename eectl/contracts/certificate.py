"""A sequence-level certificate (`eectl calibrate --guarantee sequence`): the schema calibration.json and the manifest
carry, and the sentence `run` and `bench` print.

What this module does not do: compute it (calibrate/guarantee.py has the test, calibrate/sequence.py the losses).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

RISKS = ("first", "share", "exact-match")
CERTIFIED = "certified"  # run --policy / bench configuration name of the certified setting


def parse_risk(spec: str) -> tuple[str, int | None]:
    """'first:N' | 'share:N' | 'exact-match' -> (kind, N); ValueError with the choices otherwise."""
    kind, _, n = spec.partition(":")
    if kind == "exact-match" and not n:
        return kind, None
    if kind in ("first", "share") and n.isdigit() and 1 <= int(n) <= 1_000_000:
        return kind, int(n)
    raise ValueError(f"--risk must be first:N, share:N (N >= 1 tokens) or exact-match, got '{spec}'")


def describe_risk(spec: str) -> str:
    kind, n = parse_risk(spec)
    if kind == "first":
        return f"P(answer differs from full depth in its first {n} tokens)"
    if kind == "share":
        return f"E[share of the first {n} tokens that differ from full depth]"
    return "P(final answer wrong: 1 - GSM8K exact match)"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SettingTest(_Model):
    """One grid setting the fixed sequence reached: its threshold, empirical risk, p-value, and what it ran."""

    threshold: float
    risk: float
    p_value: float
    rejected: bool  # H: risk > delta rejected at epsilon (the sequence goes on)
    mean_layers: float  # over the generated tokens of every prompt
    # per exit layer (str, JSON keys): the share of the generated tokens emitted there (the plan prices the setting
    # with them); None in certificates written before the plan consulted them
    exit_shares: dict[str, float] | None = None


class Certificate(_Model):
    guarantee: Literal["sequence"] = "sequence"
    policy: str
    exits: list[int]
    signal: str
    criteria: list[str]
    top_k: int
    threshold: float | None  # the certified setting: every criterion >= it at every exit; None: nothing certified
    risk: str  # first:N | share:N | exact-match
    delta: float = Field(gt=0.0, lt=1.0)
    epsilon: float = Field(gt=0.0, lt=1.0)
    bound: str  # binomial | hoeffding-bentkus
    prompts: int
    max_new_tokens: int
    empirical_risk: float | None  # at the certified setting
    upper_bound: float | None  # its (1 - epsilon) upper confidence bound on the risk
    prompts_needed: int | None  # prompts that would certify the setting after it (the one that failed), if any
    prompts_for_half_delta: int | None  # prompts that would certify the certified setting at delta / 2, if any
    tested: list[SettingTest]
    data: str
    wall_s: float
    threads: int

    @property
    def certified(self) -> bool:
        return self.threshold is not None

    def thresholds(self) -> dict[int, dict[str, float]]:
        """The certified setting as run thresholds (exit -> criterion -> value); inf everywhere if none."""
        t = math.inf if self.threshold is None else self.threshold
        return {e: dict.fromkeys(self.criteria, t) for e in self.exits}

    def setting(self) -> SettingTest | None:
        """The grid setting that was certified (its measurements), None if nothing was."""
        return next((t for t in self.tested if t.rejected and t.threshold == self.threshold), None)

    def covers(self, max_risk: float | None) -> bool:
        """Whether the certified setting may be a plan's default for a user who accepts a risk of at most
        `max_risk` (None: the certificate's own delta, the one its author asked for)."""
        return self.certified and (max_risk is None or self.delta <= max_risk)

    def describe(self) -> str:
        """One sentence: "defer at exits [12, 24] (topk-prob >= 0.9): P(...) <= 0.10 at 95% confidence, 400 prompts"."""
        conf = f"{1 - self.epsilon:.0%} confidence"
        where = f"{self.policy} at exits {self.exits}"
        if self.threshold is None:
            return f"{where}: nothing certified at delta {self.delta:g} ({conf}, {self.prompts} prompts)"
        return (
            f"{where} ({self.signal} >= {self.threshold:g}): {describe_risk(self.risk)} <= {self.delta:g} at {conf}, "
            f"{self.prompts} prompts (empirical {self.empirical_risk:.3f}, bound {self.upper_bound:.3f}, {self.bound})"
        )

    def matches(
        self,
        policy: str,
        exits: list[int],
        signal: str,
        thresholds: dict[int, dict[str, float]],
        top_k: int | None = None,
    ) -> bool:
        """Whether a run configuration is the certified one (the certificate speaks for it)."""
        if self.threshold is None or policy != self.policy or list(exits) != self.exits or signal != self.signal:
            return False
        if top_k is not None and top_k != self.top_k:
            return False
        return thresholds == self.thresholds()
