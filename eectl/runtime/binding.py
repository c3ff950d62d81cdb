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
(shortlist, int8) picks the first exit's candidates with it (`candidates`).

Who executes it: the bound chain (runtime/chain.py) for full-depth greedy steps, one row or a batch (bound
calls, the states in device buffers, only the tokens read on the host), and the runner itself for steps with
active exits (a device-resident run's `Placement`, runtime/placement.py: every state output a DeviceView, each host
read recorded in the placement, which tests compare with this plan per step: `Runner.step_reads`).

What this module does not do: create sessions or run graphs (sessions.py), or decide exits (runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eectl.contracts.manifest import Manifest
from eectl.errors import UsageError
from eectl.exits.signals import get_signal
from eectl.runtime.policies import Copy, Defer, KVPolicy, River, Verify, policy_class

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
    device: str = field(init=False)
    _policy: type[KVPolicy] = field(init=False)

    def __post_init__(self) -> None:
        if self.provider not in ("cuda", "cpu"):
            raise UsageError(f"binding plan for an unknown provider '{self.provider}'")
        self._signal = get_signal(self.signal)
        self._policy = policy_class(self.policy)
        if not issubclass(self._policy, (Copy, Defer, River)):
            raise UsageError(f"no binding plan for the {self.policy} policy yet")
        if issubclass(self._policy, River) and any(s.river is None for s in self.manifest.segments[1:]):
            raise UsageError("this artifact has no int4 river copies", hint="export it with --river")
        self.device = "cuda" if self.provider == "cuda" else "cpu"
        self._segment_end = [s.layers[1] for s in self.manifest.segments]

    # --- the one rule --------------------------------------------------------------------------------------------
    def _io(self, graph: str, at: int) -> set[str] | None:
        """The keys an exported graph has (None for the device helpers, which take all of theirs)."""
        m = self.manifest
        io = {
            "embed": lambda: m.embedding,
            "segment": lambda: m.segments[at].graph,
            "kv_segment": lambda: m.segments[at].kv_graph,
            "exit_full": lambda: m.exit_at(at).full,
            "exit_local": lambda: m.exit_at(at).local,
            "river_segment": lambda: m.segments[at].river,
            "river_head": lambda: m.exit_at(at).river,
            "candidates": lambda: m.exit_at(at).candidates,
            "block": lambda: _block(m, at).graph,
            "block_kv": lambda: _block(m, at).kv_graph,
        }.get(graph)
        if io is None:
            return None
        graph_io = io()
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
    def token(self, exit_at: int | None = None, pending: bool = False, drafts: bool = False) -> list[Call]:
        """The calls for one generated token (after the prefill) that exits after layer `exit_at` (None: full depth).

        pending: deferred positions ride along into the deep segments (defer/verify); drafts: under verify, the
        final pass checks drafts (the final head scores every flushed position; each one's Top-1 comes back).
        """
        L = self.manifest.num_layers
        if exit_at is not None and exit_at not in self.exits:
            raise UsageError(f"exit {exit_at} is not active (active: {self.exits})")
        calls = [self._call("embed", -1)]
        first_exit = True
        for s, end in enumerate(self._segment_end):
            starts_at_exit = s > 0 and self._segment_end[s - 1] in self.exits
            if pending and starts_at_exit and issubclass(self._policy, Defer):
                calls.append(self._call("concat", s))  # the states that exited before this segment ride along
            calls.append(self._call("segment", s))
            calls += self._block_after(end, "block")  # its exit's block head runs on what the segment ran on
            if end == L:
                if drafts and issubclass(self._policy, Verify):  # each flushed position's argmax checks a draft
                    has_token = "token" in self.manifest.exit_at(L).full.outputs
                    calls.append(self._call("exit_full", L, ("token",) if has_token else ("candidates",)))
                calls.append(self._call("last", s))
                calls.append(self._final(L))
                return calls
            if end not in self.exits:
                continue
            calls.append(self._call("last", s))
            calls += self._decision(end, first_exit, exiting=end == exit_at)
            first_exit = False
            if end == exit_at:
                if issubclass(self._policy, Copy):
                    for t in range(s + 1, len(self._segment_end)):
                        calls += [self._call("kv_segment", t), *self._block_after(self._segment_end[t], "block_kv")]
                if issubclass(self._policy, River):  # the token flows on through the int4 copies
                    for t in range(s + 1, len(self._segment_end)):
                        calls += [self._call("river_segment", t), *self._block_after(self._segment_end[t], "block")]
                    if self._river_end:
                        calls.append(self._call("last", len(self._segment_end) - 1))
                        river = self.manifest.exit_at(L).river is not None
                        calls.append(self._final(L, "river_head" if river else "exit_full"))
                return calls
        raise AssertionError("unreachable: the last segment ends at the final layer")

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
                source = "candidates" if self.manifest.exit_at(layer).candidates is not None else "exit_full"
                calls.append(self._call(source, layer, ("candidates", "candidate_logits", *probe)))
            else:
                calls.append(self._call("exit_local", layer, ("candidate_logits", *probe)))
        elif not (sig.needs_layer_input or sig.needs_blocks):  # the full vocabulary's softmax
            calls.append(self._call("exit_full", layer, picked))
            calls.append(self._call("logsumexp", layer, ("logsumexp",)))
        else:  # cosine, cosine-min: one scalar decides; the exit head runs only for a token that exits here
            helper = "cosine_min" if sig.needs_blocks else "cosine"
            calls.append(self._call(helper, layer, ("cosine",)))
            if exiting and not self._river_end:  # a river predicting at its end never asks the exit's head
                calls.append(self._call("exit_full", layer, picked))
        return calls

    @property
    def _river_end(self) -> bool:
        return issubclass(self._policy, River) and self.river_predict == "end"

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
        """Every shape a generated token's calls can take under this plan: full depth and each exit, with and
        without deferred positions, and verify's draft check."""
        out = []
        for exit_at in [None, *self.exits]:
            for pending in (False, True):
                out.append(self.token(exit_at, pending))
        if issubclass(self._policy, Verify):
            out.append(self.token(None, pending=True, drafts=True))
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
) -> BindingPlan:
    return BindingPlan(
        manifest, provider, sorted(exits), signal, policy, sampling=temperature > 0, river_predict=river_predict
    )
