"""The binding plan: for each graph call of one generated token, where every input and output is bound.

On the CUDA EP the expensive values — hidden states [N, S, H], KV buffers, full logits [N, V] — must stay on the
device between graphs (bound to device OrtValues and handed from one graph to the next); only what the exit decision
reads crosses to the host: K candidate ids and scores, or one scalar per row. On the CPU EP every binding is host
memory and the calls are the same: one plan, one code path, only the device differs.

    ids (host, [N, S]) -> embed -> hidden (device) -> segment 0 -> hidden (device) -> ... -> segment n
                                                          |                                     |
                                             exit graph: K ids + K scores (host)    final head: K ids + scores (host)
                                             (full logits stay on the device)       (Top-K on the device; argmax = id 0)

The plan is data (`Call`s of `Binding`s, named by the manifest's graph keys), built from the manifest and a run
configuration, so the rule "no hidden state or full logits reach the host per token" is checked on any machine by
inspecting the plan (tests/test_binding.py), GPU or not.

Device-side pieces the plan relies on beyond the exported graphs' current outputs (the runner's CUDA path must
provide them, e.g. as tiny in-memory graphs or extra graph outputs; the plan names them so they are not forgotten):
`last` (the last position's hidden state [N, H] of a segment output), `concat` (deferred positions joined in front of
a segment's input, the `defer`/`verify` pending states), `logsumexp` (full-vocabulary probability from the Top-K
logits: p1 = exp(l1 - lse)), `cosine` (the transition cosine of a segment's last layer, one scalar per row) and
`cosine_min` (the minimum transition cosine over a segment's block states, `layer_states`, one scalar per row).
The `river` policy's exited token runs the int4 river copies of the later segments (`river_segment`, the segment's
bindings) and, predicting at the river's end, the final head (`river_head` where the artifact quantized it). Block
exit heads (`block`: one decoder layer with its own KV, runtime/blocks.py) run after their segment while their exit
is active, and `block_kv` fills a skipped block's KV under copy; an artifact with a candidate source graph
(shortlist, int8) picks the first exit's candidates with it (`candidates`). What a policy adds to the calls every
policy makes (the pending `concat`, the graphs after an exit, the river's end head, verify's draft check and forced
passes) is its class's `PlanFragment` (runtime/policies.py): the plan never asks a policy's name or base class.

Who executes it: the bound chain (runtime/chain.py) for full-depth greedy steps, one row or a batch (bound
calls, the states in device buffers, only the tokens read on the host), and the runner itself for steps with
active exits (a device-resident run's `Placement`, runtime/placement.py: every state output a DeviceView). Both
record each host read in the run's placement, which tests compare with this plan per step (`Runner.step_reads`).
Where the exit graphs compute the signal they decide, on every executor (runtime/graph_decide.py): a decision reads
`passed` and `exit_token` per row instead of the K scores, the candidates staying where the graphs run; the chain's
one-row exit steps (CPU EP) read a little less (the plan with `chain`: tests/test_runner.py compares them).

What this module does not do: create sessions or run graphs (sessions.py), or decide exits (runner.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from eectl.contracts.manifest import GraphIO, Manifest
from eectl.errors import UsageError
from eectl.exits.signals import get_signal
from eectl.runtime.policies import KVPolicy, PlanFragment, policy_class

# What a bound value is, by its size per token; the rule is about the first three.
HIDDEN, KV, LOGITS = "hidden", "kv", "logits"
IDS, CANDIDATES, SCORES, SCALAR, WEIGHT = "ids", "candidates", "scores", "scalar", "weight"
PER_TOKEN_HOST_ALLOWED = (IDS, CANDIDATES, SCORES, SCALAR)  # O(K) values per row at most

# Graph kind -> io key -> (kind of value, whether it is an output). Keys are the manifest's GraphIO keys; the
# device-side helpers (last, concat, logsumexp, cosine) use the keys named here.
KINDS: dict[str, dict[str, tuple[str, bool]]] = {
    "embed": {"input_ids": (IDS, False), "weight": (WEIGHT, False), "hidden": (HIDDEN, True)},
    "segment": {
        "hidden": (HIDDEN, False),
        "seqlens_k": (SCALAR, False),
        "total_sequence_length": (SCALAR, False),
        "past_key": (KV, False),
        "past_value": (KV, False),
        "present_key": (KV, True),
        "present_value": (KV, True),
        "hidden_out": (HIDDEN, True),
        "layer_input": (HIDDEN, True),
        "layer_states": (HIDDEN, True),  # every block boundary (cosine-min), artifacts that have the output
    },
    "kv_segment": {
        "hidden": (HIDDEN, False),
        "seqlens_k": (SCALAR, False),
        "total_sequence_length": (SCALAR, False),
        "past_key": (KV, False),
        "past_value": (KV, False),
        "present_key": (KV, True),
        "present_value": (KV, True),
    },
    "exit_full": {
        "hidden": (HIDDEN, False),
        "weight": (WEIGHT, False),
        "top_k": (SCALAR, False),
        "logits": (LOGITS, True),
        "candidates": (CANDIDATES, True),
        "candidate_logits": (SCORES, True),
        "token": (SCALAR, True),  # the in-graph argmax (artifacts exported since the greedy token output)
        **(
            DECISION := {  # the exit decision in the graph (exits.decision_nodes; artifacts exported since it)
                "thresholds": (SCALAR, False),
                "passed": (SCALAR, True),
                "exit_token": (SCALAR, True),
                "score": (SCALAR, True),  # the learned signal's probe score (graphs exported with a probe)
            }
        ),
    },
    "exit_local": {
        "hidden": (HIDDEN, False),
        "weight": (WEIGHT, False),  # artifacts before the row-major table: the [H, V] head, K columns gathered
        "rows": (WEIGHT, False),
        "candidates": (CANDIDATES, False),
        "candidate_logits": (SCORES, True),
        **DECISION,
    },
    "candidates": {  # the artifact's candidate source graph (shortlist, int8) at the first active exit
        "hidden": (HIDDEN, False),
        "weight": (WEIGHT, False),
        "rows": (WEIGHT, False),
        "top_k": (SCALAR, False),
        "candidates": (CANDIDATES, True),
        "candidate_logits": (SCORES, True),
        "candidate_rows": (HIDDEN, True),  # the K exact rows gathered (artifacts exported since chain.py reads them)
        **DECISION,
    },
    "last": {"hidden": (HIDDEN, False), "hidden_out": (HIDDEN, True)},
    "concat": {"pending": (HIDDEN, False), "hidden": (HIDDEN, False), "hidden_out": (HIDDEN, True)},
    "logsumexp": {"logits": (LOGITS, False), "logsumexp": (SCALAR, True)},
    "cosine": {"layer_input": (HIDDEN, False), "hidden_out": (HIDDEN, False), "cosine": (SCALAR, True)},
    "cosine_min": {"layer_states": (HIDDEN, False), "cosine": (SCALAR, True)},
}
KINDS["river_segment"] = KINDS["segment"]  # the int4 copy has the segment's names
# a block exit head (runtime/blocks.py): one decoder layer with its own KV after its segment; `at` is the exit layer
KINDS["block"] = {k: v for k, v in KINDS["segment"].items() if k not in ("layer_input", "layer_states")}
KINDS["block_kv"] = KINDS["kv_segment"]  # copy: the skipped token's state into the block's KV
KINDS["river_head"] = KINDS["exit_full"]  # the final head with its own quantized table (no weight input)

# Graph kind -> the manifest's entry for that graph at `at` (None where the artifact has none); the device helpers
# have no entry
EXPORTED: dict[str, Callable[[Manifest, int], GraphIO | None]] = {
    "embed": lambda m, at: m.embedding,
    "segment": lambda m, at: m.segments[at].graph,
    "kv_segment": lambda m, at: m.segments[at].kv_graph,
    "exit_full": lambda m, at: m.exit_at(at).full,
    "exit_local": lambda m, at: m.exit_at(at).local,
    "river_segment": lambda m, at: m.segments[at].river,
    "river_head": lambda m, at: m.exit_at(at).river,
    "candidates": lambda m, at: m.exit_at(at).candidates,
    "block": lambda m, at: _block(m, at).graph,
    "block_kv": lambda m, at: _block(m, at).kv_graph,
}


@dataclass(frozen=True)
class Binding:
    key: str  # the manifest's io key
    kind: str  # HIDDEN, KV, LOGITS, ...
    output: bool
    device: str  # "cuda" | "cpu": where the bound memory lives

    @property
    def host_read(self) -> bool:
        """An output the runner reads as a numpy array (on the CUDA EP: a copy from the device)."""
        return self.output and self.device == "cpu"


@dataclass(frozen=True)
class Call:
    graph: str  # a KINDS key
    at: int  # the segment index, or the exit layer for exit graphs (-1 for embed)
    bindings: tuple[Binding, ...]

    def binding(self, key: str) -> Binding:
        return next(b for b in self.bindings if b.key == key)


@dataclass
class BindingPlan:
    """Binding rules of one artifact under one provider and run configuration."""

    manifest: Manifest
    provider: str  # "cuda" | "cpu"
    exits: list[int]  # active exit layers
    signal: str = "topk-prob"
    policy: str = "defer"
    sampling: bool = False  # temperature > 0: a full-vocabulary pick samples from V logits, which go to the host
    river_predict: str = "end"  # river: the token from the river's end or from the exit itself
    # the steps described are the bound chain's one-row exit steps (CPU EP), not the runner's: with decisions in the
    # graphs, the chain reads the exiting decision's `exit_token` only, and where a later exit scores the K rows the
    # first gathered, its token is a column of the first exit's candidates, which it then reads too
    chain: bool = False
    device: str = field(init=False)
    _policy: type[KVPolicy] = field(init=False)
    _fragment: PlanFragment = field(init=False)  # the policy's part (runtime/policies.py)

    def __post_init__(self) -> None:
        if self.provider not in ("cuda", "cpu"):
            raise UsageError(f"binding plan for an unknown provider '{self.provider}'")
        self._signal = get_signal(self.signal)
        self._policy = policy_class(self.policy)
        fragment = self._policy.plan_fragment(self.river_predict)
        if fragment is None:
            raise UsageError(f"no binding plan for the {self.policy} policy (its class gives no plan fragment)")
        named = [*(fragment.after_exit or ()), *([fragment.end_head] if fragment.end_head else [])]
        if any(g not in KINDS for g in named):
            raise TypeError(f"the {self.policy} policy's plan fragment names a graph the plan does not know: {named}")
        self._fragment = fragment
        if self._policy.needs_river_copies and any(s.river is None for s in self.manifest.segments[1:]):
            raise UsageError("this artifact has no int4 river copies", hint="export it with --river")
        self.device = "cuda" if self.provider == "cuda" else "cpu"
        self._segment_end = [s.layers[1] for s in self.manifest.segments]
        self._graph_decides = self._decides_in_graph()

    # --- the one rule --------------------------------------------------------------------------------------------
    def _io(self, graph: str, at: int) -> set[str] | None:
        """The keys an exported graph has (None for the device helpers, which take all of theirs)."""
        io = EXPORTED.get(graph)
        if io is None:
            return None
        graph_io = io(self.manifest, at)
        assert graph_io is not None, f"the artifact has no {graph} graph at {at}"
        return set(graph_io.inputs) | set(graph_io.outputs)

    def _call(self, graph: str, at: int, host_outputs: tuple[str, ...] = ()) -> Call:
        """Bind every key of `graph`: ids and scalars in from the host, outputs the decision reads to the host,
        everything else (hidden states, KV, logits, weights) in the provider's memory."""
        binds = []
        present = self._io(graph, at)
        for key, (kind, output) in KINDS[graph].items():
            if present is not None and key not in present:
                continue
            if output:
                device = "cpu" if key in host_outputs else self.device
            else:
                device = "cpu" if kind in (IDS, SCALAR) else self.device
            binds.append(Binding(key, kind, output, device))
        return Call(graph, at, tuple(binds))

    # --- one token ------------------------------------------------------------------------------------------------
    def token(
        self, exit_at: int | None = None, pending: bool = False, drafts: bool = False, tests: bool = True
    ) -> list[Call]:
        """The calls for one generated token (after the prefill) that exits after layer `exit_at` (None: full depth).

        pending: deferred positions ride along into the deep segments (a fragment with `pending`: defer, verify);
        drafts: the final pass checks drafts (a fragment with `draft_check`, verify: the final head scores every
        flushed position in one call and each one's Top-1 comes back, the last one's the token); tests: False for a
        forced full-depth pass, which tests no exit.
        """
        L = self.manifest.num_layers
        f = self._fragment
        if exit_at is not None and exit_at not in self.exits:
            raise UsageError(f"exit {exit_at} is not active (active: {self.exits})")
        if exit_at is not None and not tests:
            raise UsageError(f"a pass that tests no exit cannot exit at {exit_at}")
        calls = [self._call("embed", -1)]
        first_exit = True
        for s, end in enumerate(self._segment_end):
            starts_at_exit = s > 0 and self._segment_end[s - 1] in self.exits
            if pending and starts_at_exit and f.pending:
                calls.append(self._call("concat", s))  # the states that exited before this segment ride along
            calls.append(self._call("segment", s))
            calls += self._block_after(end, "block")  # its exit's block head runs on what the segment ran on
            if end == L:
                if (
                    drafts and f.draft_check
                ):  # each flushed position's argmax checks a draft; the last one's is the token
                    has_token = "token" in self.manifest.exit_at(L).full.outputs
                    calls.append(self._call("exit_full", L, ("token",) if has_token else ("candidates",)))
                    return calls
                calls.append(self._call("last", s))
                calls.append(self._final(L))
                return calls
            if end not in self.exits or not tests:
                continue
            calls.append(self._call("last", s))
            if self._graph_decides:
                calls += self._graph_decision(end, first_exit, exit_at)
            else:
                calls += self._decision(end, first_exit, exiting=end == exit_at)
            first_exit = False
            if end == exit_at:
                return calls + self._after_exit(s)
        raise AssertionError("unreachable: the last segment ends at the final layer")

    def _after_exit(self, s: int) -> list[Call]:
        """What the policy runs for a token that exited after segment s (its fragment's `after_exit`, `end_head`)."""
        f, L = self._fragment, self.manifest.num_layers
        calls: list[Call] = []
        if f.after_exit is not None:  # e.g. copy's K/V projections, the river's int4 copies
            graph, block = f.after_exit
            for t in range(s + 1, len(self._segment_end)):
                calls += [self._call(graph, t), *self._block_after(self._segment_end[t], block)]
        if f.end_head is not None:  # the token from the head on the last segment's output (the river's end)
            head = f.end_head if EXPORTED[f.end_head](self.manifest, L) is not None else "exit_full"
            calls.append(self._call("last", len(self._segment_end) - 1))
            calls.append(self._final(L, head))
        return calls

    def _block_after(self, end: int, graph: str) -> list[Call]:
        """The block head's call after a segment ending at an active exit that has one (none at the final layer)."""
        if end in self.exits and end < self.manifest.num_layers and self.manifest.exit_at(end).block is not None:
            return [self._call(graph, end)]
        return []

    def _decision(self, layer: int, first: bool, exiting: bool) -> list[Call]:
        """The exit test after `layer`: what it runs and which of its outputs come to the host."""
        sig = self._signal
        calls: list[Call] = []
        picked: tuple[str, ...] = ("candidates", "candidate_logits")  # the token (id 0 under greedy) and the K scores
        if self.sampling and exiting:
            picked = (*picked, "logits")
        probe = ("score",) if sig.needs_probe else ()  # the learned signal reads the graph's score too
        if sig.needs_candidates:  # even sampling draws from the K candidates here (the runner's rule)
            if first:  # the artifact's candidate graph where it has one, else the exit's own Top-K
                calls.append(self._call(self._picker(layer), layer, ("candidates", "candidate_logits", *probe)))
            else:
                calls.append(self._call("exit_local", layer, ("candidate_logits", *probe)))
        elif not (sig.needs_layer_input or sig.needs_blocks):  # the full vocabulary's softmax
            calls.append(self._call("exit_full", layer, picked))
            calls.append(self._call("logsumexp", layer, ("logsumexp",)))
        else:  # cosine, cosine-min: one scalar decides; the exit head runs only for a token that exits here
            helper = "cosine_min" if sig.needs_blocks else "cosine"
            calls.append(self._call(helper, layer, ("cosine",)))
            if exiting and self._fragment.end_head is None:  # a river predicting at its end never asks the exit's head
                calls.append(self._call("exit_full", layer, picked))
        return calls

    def _decides_in_graph(self) -> bool:
        """The exit graphs decide (exits.decision_nodes: every executor, runtime/graph_decide.py) for signals the
        decision nodes compute, in exit graphs that output `passed`; greedy steps only (sampling picks from the K
        candidates' logits on the host)."""
        if not (self._signal.in_graph and self.exits) or self.sampling:
            return False
        first = self.exits[0]
        graphs = [self._picker(first), *("exit_local" for _ in self.exits[1:])]
        return all("passed" in (self._io(g, e) or set()) for g, e in zip(graphs, self.exits, strict=True))

    def _picker(self, layer: int) -> str:
        """The graph that picks the candidates at `layer`: the artifact's candidate source, else the exit's own."""
        return "candidates" if self.manifest.exit_at(layer).candidates is not None else "exit_full"

    def _graph_decision(self, layer: int, first: bool, exit_at: int | None) -> list[Call]:
        """The exit test at `layer` decided in its graph: `passed` and `exit_token` to the host (one scalar each per
        row), the candidates staying where the graphs run for a later exit. On the bound chain (`chain`) `exit_token`
        only where the token exits here, and a later exit scores the first's candidates on the K rows the first
        gathered (`candidate_rows`) where the artifact outputs them: its token is then a column of those
        candidates, which the host reads too."""
        if not self.chain:
            return [self._call(self._picker(layer) if first else "exit_local", layer, ("passed", "exit_token"))]
        exiting = layer == exit_at
        if first:
            host: tuple[str, ...] = ("passed", "exit_token") if exiting else ("passed",)
            picker = self._picker(layer)
            gathers = "candidate_rows" in (self._io(picker, layer) or set())
            later = exit_at is not None and exit_at != layer and "rows" in (self._io("exit_local", exit_at) or set())
            if gathers and later:  # the later exit's token names one of these
                host = (*host, "candidates")
            return [self._call(picker, layer, host)]
        return [self._call("exit_local", layer, ("passed", "exit_token") if exiting else ("passed",))]

    def _final(self, L: int, graph: str = "exit_full") -> Call:
        """The final head: sampling reads the V logits; greedy reads the in-graph argmax (one id per row), or, in an
        artifact without that output, the Top-K (its first id)."""
        if self.sampling:
            return self._call(graph, L, ("logits",))
        exit_point = self.manifest.exit_at(L)
        head = exit_point.river if graph == "river_head" else exit_point.full
        assert head is not None
        if "token" in head.outputs:
            return self._call(graph, L, ("token",))
        return self._call(graph, L, ("candidates", "candidate_logits"))

    # --- checks ---------------------------------------------------------------------------------------------------
    def scenarios(self) -> list[list[Call]]:
        """Every shape a decode step's calls can take under this plan (a step: what the runner runs for its rows
        between two `on_step`s, `Runner.step_reads`; the prompt's is full depth with no exit test): full depth and
        each exit, with and without deferred positions, and what the policy's fragment adds: the draft check; the
        forced full-depth pass with no exit test, alone and after an exited token's pass (the closing check)."""
        f = self._fragment
        out = []
        for exit_at in [None, *self.exits]:
            for pending in (False, True):
                out.append(self.token(exit_at, pending))
        if f.draft_check:
            out.append(self.token(None, pending=True, drafts=True))
        if f.forced_pass:
            forced = self.token(None, pending=True, drafts=f.draft_check, tests=False)
            out.append(forced)
            out += [self.token(exit_at, pending=True) + forced for exit_at in self.exits]
        return out

    def host_copies(self, calls: list[Call]) -> list[tuple[Call, Binding]]:
        """Outputs that cross from the device to the host (none on the CPU EP: its memory is the host's)."""
        if self.device == "cpu":
            return []
        return [(c, b) for c in calls for b in c.bindings if b.host_read]


def _block(m: Manifest, layer: int) -> Any:
    block = m.exit_at(layer).block
    assert block is not None, f"the exit at {layer} has no block head"
    return block


def plan_for(
    manifest: Manifest,
    provider: str,
    exits: list[int],
    signal: str = "topk-prob",
    policy: str = "defer",
    temperature: float = 0.0,
    river_predict: str = "end",
    chain: bool = False,
) -> BindingPlan:
    return BindingPlan(
        manifest,
        provider,
        sorted(exits),
        signal,
        policy,
        sampling=temperature > 0,
        river_predict=river_predict,
        chain=chain,
    )
