"""KV policies: what happens to the layers a token skipped when it exits early.

The layers after an exit still owe later tokens their K/V. A policy is one class with five hooks a decode step
calls during one token's pass over the segments (chain_rows.py `rows_step`, for one row or a batch):

    may_exit(row)                       before the pass: may this token exit at all?
    predict(row, kv, s, out) -> (logits, ids)?  the token exited after segment s: logits [V] (ids None) or [K]
                                        with their vocabulary ids to pick it from instead of the exit's own
                                        prediction (river: the river's end), or None; `predicts()` says
                                        beforehand whether it will (the chain then samples nothing at the exit)
    on_exit(row, kv, s, out, token)     the token exited after segment s with state `out` [1, 1, H]
    on_final(row, kv, out) -> token?    the pass reached the final layer; a token replaces the model's (rollback)
    unchecked(row) -> bool              generation wants to stop: is there work a final pass must still check?

The hooks that run graphs on the pass's states (predict, on_final) take the run's `place` (runtime/placement.py):
where its states live and its record of host reads, which belong to the run, not to the shared runtime.

The built-in policies:

- `copy`:   the skipped segments' K/V-only graphs project the exit hidden state into their caches (approximate).
- `defer`:  the exit hidden state waits at the boundary ("pending"); the next token that runs those segments
            carries it along as an extra position, so its K/V are exactly the full model's for that state.
- `verify`: like defer, but exited tokens are drafts: when a pass reaches the final layer, the final logits of
            the pending positions check the drafts; the first wrong draft and everything after it are rolled back
            by resetting the length counters, and the full model's token is emitted instead. Output == full depth.
            With `RunConfig.draft_ahead` its first exit drafts ahead by its running confidence (runtime/ahead.py).
- `river`:  River-LLM's exit river: the exited token flows on through int4 copies of the remaining segments
            (`export --river`), which write its K/V into the same buffers in place (no pending positions, nothing
            recomputed, no rollback; the K/V are approximate). Its token comes from the river's end (final norm +
            LM head, `river_predict="end"`) or from the exit itself (`"exit"`: the river then only writes K/V).

Invariant (defer/verify): segment s holds K/V for positions [0, filled_s), filled_0 >= filled_1 >= ...;
pending[s] holds the hidden states at segment s's input for positions [filled_s, filled_{s-1}).

To add a policy: add its name to `eectl.contracts.names.POLICY_SPECS` (recipes, manifests and calibration files
are validated against it without importing this module), subclass `KVPolicy`, implement `on_exit` (and any other
hook), state its behaviour in its class variables, and decorate it with `@register_policy`; the CLI, the manifest's
list and bench take the names from `POLICIES`. What the runtime needs to know of a policy beyond its hooks it reads
from the class, never from its name or its base class: `pending_states`, `checks_drafts`, `checks_at_final` (the
step) and `fragment` / `plan_fragment` (its part of the binding plan, runtime/binding.py, the description of a
device step that the GPU checks compare with what a run reads: a policy without one has no such check). The cost
model (`eectl.plan.choose.predict`) prices a policy from its `POLICY_SPECS` entry (`later`, `checks_drafts`); the
plan chooses among `eectl.contracts.plan.PLAN_POLICIES`.

What this module does not do: decide exits (runner.py, exits/signals.py) or build graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from eectl.contracts.names import POLICY_SPECS
from eectl.errors import UsageError
from eectl.runtime.ahead import ahead_token, check_ahead
from eectl.runtime.blocks import active_block, run_block
from eectl.runtime.device_ops import concat
from eectl.runtime.placement import HOST, Placement

Prediction = tuple[np.ndarray, np.ndarray | None]  # logits [V] (ids None) or [K] with their vocabulary ids [K]

if TYPE_CHECKING:
    from eectl.runtime.kv import KVBuffers
    from eectl.runtime.sessions import ArtifactRuntime
    from eectl.runtime.state import RowState, RunConfig


@dataclass(frozen=True)
class PlanFragment:
    """A policy's part of the device binding plan (runtime/binding.py `BindingPlan`): what one step runs beyond what
    every policy runs (the embedding, the segments with their block heads, the exit tests, the final head).
    Graph kinds are the plan's `KINDS` keys."""

    pending: bool = False  # `concat`: deferred positions join in front of each segment that starts at an exit
    # an exited token runs each later segment as this graph, and an active block head after it as the second
    # (copy: ("kv_segment", "block_kv"), its K/V only; river: ("river_segment", "block"), the int4 copies)
    after_exit: tuple[str, str] | None = None
    # then this head on the last of those segments' output gives the token (river: "river_head", the exit
    # "exit_full" where the artifact has none), and the exit's own head is not asked
    end_head: str | None = None
    # a pass reaching the final layer with drafts scores every flushed position with the final head in one call
    # (`exit_full`, its argmax to the host): the check is the final head, the last position's argmax the token
    draft_check: bool = False
    # passes with no exit test at all (`may_exit` false: verify's full block of drafts) and, in the step that ends
    # generation, one after an exited token's pass (`unchecked` work: the closing check, Runner._settled)
    forced_pass: bool = False


class KVPolicy:
    name: ClassVar[str]
    lossless: ClassVar[bool] = False  # output equals full depth by construction
    greedy_only: ClassVar[bool] = False
    scores_text: ClassVar[bool] = True  # supports teacher-forced scoring (Runner.score)
    # every position ends with the full model's states and K/V (what it skipped is computed later from its exact
    # state), so teacher-forced scoring is one full-depth pass with the exits deciding on it (runtime/scoring.py)
    exact_states: ClassVar[bool] = False
    needs_river_copies: ClassVar[bool] = False  # runs the int4 segment copies of `export --river`
    # exited states wait as pending positions (RowState.pending) that later passes carry: in a batch they may ride
    # along in the deeper calls other rows need anyway (chain_rows.py `_riders`)
    pending_states: ClassVar[bool] = False
    # the final pass checks every unchecked draft in st.drafts and rolls back at the first wrong one (verify): drafts
    # from the context (runtime/drafts.py) are checked by it too
    checks_drafts: ClassVar[bool] = False
    # on_final checks the states that reach the final layer (verify's drafts): pending states stop riding along in a
    # batch before the final segment, so the final pass sees them (chain_rows.py `_riders`)
    checks_at_final: ClassVar[bool] = False
    # its part of the binding plan (runtime/binding.py), the description of a device step; None: no such plan
    fragment: ClassVar[PlanFragment | None] = None

    def __init__(self, rt: ArtifactRuntime, config: RunConfig) -> None:
        self.rt = rt
        self.cfg = config
        self.num_layers = rt.manifest.num_layers
        self.num_segments = len(rt.manifest.segments)

    @classmethod
    def check(cls, config: RunConfig) -> None:
        """Raise UsageError for run options this policy cannot honour."""
        if cls.greedy_only and config.temperature > 0:
            raise UsageError(f"the {cls.name} policy is greedy only (it reproduces full-depth greedy output)")
        if config.draft_ahead and not cls.checks_drafts:
            raise UsageError(f"--draft-ahead drafts for verify's check, not under the {cls.name} policy")

    @classmethod
    def plan_fragment(cls, river_predict: str = "end") -> PlanFragment | None:
        """Its part of the binding plan for a run (`river_predict`: the run's RunConfig.river_predict, which only the
        river's plan depends on): `fragment` unless the class says otherwise."""
        return cls.fragment

    def may_exit(self, st: RowState) -> bool:
        return True

    def ahead(self, layer: int) -> bool:
        """Whether the decision at exit `layer` is a run-ahead drafter's (`ahead_token`) instead of the exit's test."""
        return False

    def ahead_token(self, st: RowState, layer: int, hidden: np.ndarray) -> int | None:
        raise NotImplementedError

    def predict(
        self, row: int, st: RowState, kv: KVBuffers, s: int, out: Any, *, place: Placement = HOST
    ) -> Prediction | None:
        return None

    def predicts(self) -> bool:
        """Whether `predict` gives an exited token's prediction (then the exit's own is not asked for)."""
        return False

    def on_exit(self, row: int, st: RowState, kv: KVBuffers, s: int, out: np.ndarray, token: int) -> None:
        raise NotImplementedError

    def on_final(self, row: int, st: RowState, kv: KVBuffers, out: Any, *, place: Placement = HOST) -> int | None:
        return None

    def unchecked(self, st: RowState) -> bool:
        return False


POLICIES: dict[str, type[KVPolicy]] = {}


def register_policy(cls: type[KVPolicy]) -> type[KVPolicy]:
    spec = POLICY_SPECS.get(cls.name)
    if spec is None or (spec.needs_river_copies, spec.checks_drafts) != (cls.needs_river_copies, cls.checks_drafts):
        raise TypeError(f"policy '{cls.name}' does not match its entry in eectl.contracts.names.POLICY_SPECS")
    POLICIES[cls.name] = cls
    return cls


def policy_class(name: str) -> type[KVPolicy]:
    if name not in POLICIES:
        raise UsageError(f"--policy must be one of {', '.join(POLICIES)}, got '{name}'")
    return POLICIES[name]


@register_policy
class Copy(KVPolicy):
    """The skipped segments' K/V-only graphs project the exit state into their caches (approximate K/V)."""

    name = "copy"
    fragment = PlanFragment(after_exit=("kv_segment", "block_kv"))

    def on_exit(self, row: int, st: RowState, kv: KVBuffers, s: int, out: np.ndarray, token: int) -> None:
        # no pending positions under copy: `out` is this token's exit state
        for t in range(s + 1, self.num_segments):
            self.rt.run_segment(t, out, kv, row, kv_only=True)
            block = active_block(self.rt, self.cfg.exits, t)
            if block is not None:  # a later active block head's own KV gets the same stand-in state
                run_block(self.rt, block, out, kv, row, kv_only=True)


@register_policy
class Defer(KVPolicy):
    """The exit state waits at the boundary; the next deep pass computes the skipped layers' exact K/V."""

    name = "defer"
    pending_states = True
    exact_states = True
    fragment = PlanFragment(pending=True)

    def on_exit(self, row: int, st: RowState, kv: KVBuffers, s: int, out: np.ndarray, token: int) -> None:
        prev = st.pending[s + 1]
        st.pending[s + 1] = out if prev is None else concat(self.rt, [prev, out], 1)


@register_policy
class Verify(Defer):
    """Defer, with exited tokens as drafts that the next final-depth pass checks (and rolls back when wrong)."""

    name = "verify"
    lossless = True
    checks_drafts = True
    checks_at_final = True
    greedy_only = True
    scores_text = False
    fragment = PlanFragment(pending=True, draft_check=True, forced_pass=True)

    @classmethod
    def check(cls, config: RunConfig) -> None:
        super().check(config)
        check_ahead(config)

    def may_exit(self, st: RowState) -> bool:
        return len(st.drafts) < self.cfg.verify_block  # then a forced full-depth pass checks them

    def ahead(self, layer: int) -> bool:
        """Whether the decision at `layer` is the run-ahead drafter's (runtime/ahead.py): its first active exit."""
        return self.cfg.draft_ahead > 0.0 and layer == self.cfg.exits[0]

    def ahead_token(self, st: RowState, layer: int, hidden: np.ndarray) -> int | None:
        """The drafter's token for a row at its exit (hidden [1, H]), or None: the token goes on and checks the run."""
        return ahead_token(self.rt, self.cfg, st, layer, hidden)

    def on_exit(self, row: int, st: RowState, kv: KVBuffers, s: int, out: np.ndarray, token: int) -> None:
        super().on_exit(row, st, kv, s, out, token)
        st.drafts.append((len(st.tokens), token))
        st.drafted += 1

    def unchecked(self, st: RowState) -> bool:
        return bool(st.drafts)

    def on_final(self, row: int, st: RowState, kv: KVBuffers, out: Any, *, place: Placement = HOST) -> int | None:
        """Check the drafts against the final states of the flushed positions; roll back at the first wrong one.

        out[0, j] is the final state of position base + j and predicts the token at base + j + 1. With drafts, one
        final head call over every position checks them and gives the token after the last (returned, counted at
        the final layer): the head's weights are read once per step, however many drafts it checks.
        """
        st.ahead = 1.0  # a run of drafts ends at the pass that checks it
        if not st.drafts:
            return None
        base = int(kv.filled[row, self.num_layers - 1]) - out.shape[1]
        drafts = dict(st.drafts)
        st.drafts = []
        assert out.shape[1] >= 2, "drafts are positions before the step's own token"
        # greedy: only tokens leave the graph (the certified head's where the run uses it and every position passes)
        full_pred = self.rt.greedy_token(self.num_layers, out[0], place=place, certified=self.cfg.certified_head)
        for j in range(out.shape[1] - 1):
            pos = base + j + 1
            if pos in drafts and drafts[pos] != int(full_pred[j]):
                st.rejected += len(st.tokens) - pos
                st.discard(pos)  # the discarded steps' time stays in the row's latencies
                kv.rollback(row, pos)  # every slot: the block exit heads' KV too
                st.pending = [None] * len(st.pending)
                st.exit_layers.append(self.num_layers)
                return int(full_pred[j])
        st.exit_layers.append(self.num_layers)
        return int(full_pred[-1])


RIVER_PREDICT = ("end", "exit")


@register_policy
class River(KVPolicy):
    """The exited token flows through the int4 copies of the remaining segments, which write its K/V in place."""

    name = "river"
    needs_river_copies = True

    def __init__(self, rt: ArtifactRuntime, config: RunConfig) -> None:
        super().__init__(rt, config)
        if any(i not in rt.river_segments for i in range(1, self.num_segments)):
            raise UsageError("this artifact has no int4 river copies", hint="export it with --river")

    @classmethod
    def check(cls, config: RunConfig) -> None:
        super().check(config)
        if config.river_predict not in RIVER_PREDICT:
            raise UsageError(f"--river-predict must be end or exit, got '{config.river_predict}'")

    @classmethod
    def plan_fragment(cls, river_predict: str = "end") -> PlanFragment | None:
        # the token flows on through the int4 copies; predicting at the river's end, their last output gives it
        return PlanFragment(
            after_exit=("river_segment", "block"), end_head="river_head" if river_predict == "end" else None
        )

    def predict(
        self, row: int, st: RowState, kv: KVBuffers, s: int, out: Any, *, place: Placement = HOST
    ) -> Prediction | None:
        h = out  # [1, 1, H]: no pending positions under river, `out` is this token's exit state
        for t in range(s + 1, self.num_segments):
            h, _ = self.rt.run_segment(t, h, kv, row, river=True, place=place)
            block = active_block(self.rt, self.cfg.exits, t)
            if block is not None:  # a later active block head's KV: the block runs on the river's state there
                run_block(self.rt, block, h, kv, row, place=place)
        if self.cfg.river_predict != "end":
            return None
        if place.device:  # the river's end on the device: its greedy token is the one value read
            token = self.rt.greedy_token(self.num_layers, h[0, -1:], river=True, place=place)
            return np.zeros(1, np.float32), token[:1]
        logits, _, _ = self.rt.exit_full(self.num_layers, h[0, -1:], self.cfg.top_k, river=True)
        return logits[0], None

    def predicts(self) -> bool:
        return self.cfg.river_predict == "end"

    def on_exit(self, row: int, st: RowState, kv: KVBuffers, s: int, out: np.ndarray, token: int) -> None:
        pass  # predict() already wrote the token's K/V through the river
