"""What each graph of an artifact costs on the machine at hand: the cost model's input (plan.py).

Every graph is called through the runtime the runner uses (ArtifactRuntime: the same sessions, IO binding and thread
pool), at decode shape: one token on top of `past` positions of KV cache, and one more position where the defer and
verify policies carry pending states along; each block exit head's graph on one position. Each figure is the median
of `repeats` calls after `warmup` calls, in rounds that call every graph once (so each graph meets the CPU caches a
decode step leaves it). The decisions are timed with the signal computation the runner does after the graph
(`exits.signals`); a cosine signal's decision reads only block states, and the LM head at the exit is timed apart
(`exit_predict_ms`: what an exiting token's own prediction costs, which a river predicting at its end never asks
for). Where the runner decides on the bound chain (runtime/chain.py), the decisions are timed as it makes them
there instead: the bound exit graph deciding in-graph, two scalars read (`Costs.bound_exits`). The full-depth step
is timed through the runner itself, so whatever Python adds per step is in the model too.

What this module does not do: predict or choose (plan.py); it only measures.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np

from eectl.exits import ExitScoring, FullSoftmax, Signal, get_signal, signals
from eectl.plan import Costs
from eectl.runtime.blocks import run_block
from eectl.runtime.chain import DecodeChain, chain_exits_supported
from eectl.runtime.runner import OrtExitLogits, RowState, RunConfig, Runner
from eectl.runtime.sessions import ArtifactRuntime, KVBuffers

DEFAULT_PAST = 128
DEFAULT_REPEATS = 15
FULL_STEPS = 16  # room kept in the cache beyond `past`


def _interleaved_ms(calls: dict[str, Callable[[], object]], repeats: int, warmup: int) -> dict[str, float]:
    """Median ms of each call, timed in rounds that call every graph once: as in a decode step, the other graphs
    evict a small graph's weights from the CPU caches between two of its calls (timing one graph in a loop would
    find them cached and underestimate it)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(warmup + repeats):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: 1000 * statistics.median(ts) for name, ts in times.items()}


def measure_costs(
    rt: ArtifactRuntime,
    past: int = DEFAULT_PAST,
    repeats: int = DEFAULT_REPEATS,
    warmup: int = 3,
    top_k: int | None = None,
    signal: str = "topk-prob",
    seed: int = 0,
) -> Costs:
    m = rt.manifest
    dims = m.dims
    k = top_k or m.top_k
    L = m.num_layers
    past = max(1, min(past, m.max_positions - FULL_STEPS - 4))
    rng = np.random.default_rng(seed)
    h1 = rng.standard_normal((1, 1, dims["hidden_size"])).astype(rt.np_dtype)
    h2 = rng.standard_normal((1, 2, dims["hidden_size"])).astype(rt.np_dtype)
    kv = rt.new_kv(1, past + 4)

    def segment(i: int, h: np.ndarray, kv_only: bool = False, river: bool = False) -> Callable[[], object]:
        lo, hi = m.segments[i].layers

        def call() -> object:
            kv.filled[0, lo:hi] = past
            return rt.run_segment(i, h, kv, 0, kv_only=kv_only, river=river)

        return call

    # the full-depth step is timed in the same rounds as the graphs, so load from other processes inflates both
    # alike and the runner's own overhead (step minus graphs) stays what it is
    calls: dict[str, Callable[[], object]] = {
        "step": full_step_call(rt, past, seed),
        **({"chain": chain} if (chain := chain_step_call(rt, past)) is not None else {}),
        "embed": lambda: rt.embed(np.array([[1]], dtype=np.int64)),
    }
    for i in range(len(m.segments)):
        calls[f"seg1.{i}"] = segment(i, h1)
        calls[f"seg2.{i}"] = segment(i, h2)
        calls[f"kv.{i}"] = segment(i, h1, kv_only=True)
        if i in rt.river_segments:  # `export --river`: the int4 copy the river runs instead
            calls[f"river.{i}"] = segment(i, h1, river=True)
    row1, row2 = h1[0], h2[0]
    calls["head1"] = lambda: rt.exit_full(L, row1, k)
    calls["head2"] = lambda: rt.exit_full(L, row2, k)
    if L in rt.river_heads:
        calls["river_head"] = lambda: rt.exit_full(L, row1, k, river=True)
    sig = get_signal(signal)
    state_only = _exit_calls(calls, rt, sig, kv, h1, past, k)
    bound = _bound_exit_calls(calls, rt, sig, h1, past, k)  # replaces the decisions the bound chain makes
    t = _interleaved_ms(calls, repeats, warmup)
    n = len(m.segments)
    seg1 = [t[f"seg1.{i}"] for i in range(n)]
    seg2 = [t[f"seg2.{i}"] for i in range(n)]
    kv_ms = [t[f"kv.{i}"] for i in range(n)]
    embed, head1, head2 = t["embed"], t["head1"], t["head2"]
    cand_ms = {str(layer): t[f"cand.{layer}"] for layer in m.exit_layers}
    local_ms = {str(layer): t[f"local.{layer}"] for layer in m.exit_layers}
    return Costs(
        provider=rt.provider,
        threads=rt.threads,
        past=past,
        repeats=repeats,
        embed_ms=embed,
        segment_ms=seg1,
        segment_extra_ms=[max(0.0, b - a) for a, b in zip(seg1, seg2, strict=True)],
        kv_ms=kv_ms,
        final_head_ms=head1,
        final_head_extra_ms=max(0.0, head2 - head1),
        candidates_ms=cand_ms,
        local_ms=local_ms,
        full_step_ms=t["step"],
        chain_step_ms=t.get("chain"),
        bound_exits=bound,
        block_ms={str(layer): t[f"block.{layer}"] for layer in m.exit_layers if layer in rt.block_graphs},
        candidate_source=str(m.candidate_source.get("name", "full")),
        exit_predict_ms={str(e): t[f"predict.{e}"] for e in m.exit_layers} if state_only else None,
        river_ms=[t.get(f"river.{i}") for i in range(n)] if rt.river_segments else None,
        river_head_ms=t.get("river_head"),
    )


def _exit_calls(
    calls: dict[str, Callable[[], object]],
    rt: ArtifactRuntime,
    sig: Signal,
    kv: KVBuffers,
    h1: np.ndarray,
    past: int,
    k: int,
) -> bool:
    """Add each exit's decision calls (first active exit, later exits, block head, own prediction) to `calls`, as
    the runner makes them; return whether the signal decides on states alone (no LM head: the cosine signals)."""
    m = rt.manifest
    row1 = h1[0]
    topk = sig.needs_candidates
    state_only = not topk and not isinstance(sig, FullSoftmax)  # cosine signals: no LM head to decide
    hidden_t = row1.astype(np.float32)
    for layer in m.exit_layers:

        def first(layer: int = layer) -> object:
            if not topk:
                if state_only:
                    return _state_decision(sig, rt, layer, hidden_t, k)
                logits, _, _ = rt.exit_full(layer, row1, k)
                return signals(logits)
            cand, cand_logits = rt.exit_candidates(layer, row1, k)
            return signals(cand_logits, cand)

        cand = rt.exit_candidates(layer, row1, k)[0]

        def later(layer: int = layer, cand: np.ndarray = cand) -> object:
            if not topk:
                return first(layer)
            return signals(rt.exit_local(layer, row1, cand), cand)

        calls[f"cand.{layer}"] = first
        calls[f"local.{layer}"] = later
        if layer in rt.block_graphs:
            calls[f"block.{layer}"] = block_call(rt, kv, layer, h1, past)
        if state_only:  # an exiting token's own token then costs the exit's LM head (not for a river's end)

            def predict(layer: int = layer) -> object:
                return rt.exit_full(layer, row1, k)

            calls[f"predict.{layer}"] = predict
    return state_only


def _bound_exit_calls(
    calls: dict[str, Callable[[], object]], rt: ArtifactRuntime, sig: Signal, h1: np.ndarray, past: int, k: int
) -> bool:
    """Where the runner decides exits on the bound chain (runtime/chain.py: one row, greedy, the decision inside
    the exit graph), time each exit's decision as that chain makes it: its bound graph call and the two scalars it
    reads. Each exit as the first active one (its candidates picked) and as a later one (scoring the candidates an
    earlier exit bound). Returns whether it did (False: the artifact's exit graphs cannot decide in-graph, or the
    signal is not one they decide)."""
    m = rt.manifest
    exits = list(m.exit_layers)
    if "chain" not in calls or not chain_exits_supported(rt, exits, sig):
        return False
    never = {c: float("inf") for c in sig.criteria}  # thresholds do not change the graph's work

    def decision(chain: DecodeChain, layer: int) -> Callable[[], object]:
        s = rt.segment_of_layer[layer]
        if isinstance(chain.hops[s + 1], np.ndarray):  # the exit reads its segment's output buffer
            chain.hops[s + 1][...] = h1
        ex = chain.exits[s]

        def call(chain: DecodeChain = chain) -> object:  # the chain owns the buffers bound: it must stay alive
            ex.session.run_with_iobinding(ex.io)
            return bool(ex.passed[0]), int(ex.token[0])

        return call

    for layer in exits:
        alone = DecodeChain(rt, rt.new_kv(1, past + 4), 0, {layer: never}, sig, k)
        calls[f"cand.{layer}"] = decision(alone, layer)
        if layer > exits[0]:  # as a later exit, scoring the candidates the first exit bound (picked once here)
            pair = DecodeChain(rt, rt.new_kv(1, past + 4), 0, {exits[0]: never, layer: never}, sig, k)
            decision(pair, exits[0])()
            calls[f"local.{layer}"] = decision(pair, layer)
    return True


def block_call(rt: ArtifactRuntime, kv: KVBuffers, layer: int, h: np.ndarray, past: int) -> Callable[[], object]:
    """The block exit head at `layer` on one position on top of `past` (its segment holding the same positions)."""
    slot = rt.manifest.exit_at(layer).block.kv_slot  # type: ignore[union-attr]

    def call() -> object:
        kv.filled[0, slot] = past
        kv.filled[0, layer - 1] = past + 1
        return run_block(rt, layer, h, kv, 0)

    return call


def _state_decision(sig: Signal, rt: ArtifactRuntime, layer: int, hidden: np.ndarray, k: int) -> object:
    """A cosine signal's decision as the runner makes it (numpy in): the signal over the exit's block states, no LM
    head."""
    lo, hi = rt.manifest.segments[rt.segment_of_layer[layer]].layers
    blocks = np.repeat(hidden[None], hi - lo + 1, axis=0)  # [n + 1, N, H]: the segment's block boundaries
    scoring = ExitScoring(sig, OrtExitLogits(rt), k)
    return scoring.score(layer, hidden[None], hidden[None], blocks).values


def chain_step_call(rt: ArtifactRuntime, past: int) -> Callable[[], object] | None:
    """One full-depth greedy step through the bound decode chain (runtime/chain.py), the path `eectl run` takes for
    one row with no exit active, on top of `past` cached positions; None where the artifact cannot chain."""
    m = rt.manifest
    if "token" not in rt.full_graphs[m.num_layers].io.outputs or any(g.session is None for g in rt.segments):
        return None
    kv = rt.new_kv(1, past + 4)
    chain = DecodeChain(rt, kv, 0)

    def call() -> object:
        kv.filled[0, : m.num_layers] = past  # rewind: every call decodes the same position
        return chain.step(1)

    return call


def full_step_call(rt: ArtifactRuntime, past: int, seed: int = 0) -> Callable[[], object]:
    """One full-depth decode step through the runner (`Runner._step`, the path `eectl run` takes), on top of a
    `past`-token prompt (random ids) prefilled once; each call rewinds the cache and steps again."""
    m = rt.manifest
    prompt = np.random.default_rng(seed).integers(0, m.dims["vocab_size"], size=past).tolist()
    runner = Runner(rt, RunConfig(exits=[], thresholds={}, max_new_tokens=FULL_STEPS + 1, stop_ids=()))
    kv = rt.new_kv(1, past + 4)
    st = RowState(list(prompt), past, [None] * len(m.segments))
    nxt = runner._step(0, st, kv, st.tokens)  # prefill

    def call() -> object:
        kv.filled[0, :] = past
        st.exit_layers.clear()
        return runner._step(0, st, kv, [nxt])

    return call
