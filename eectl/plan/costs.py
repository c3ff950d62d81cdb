"""What each graph of an artifact costs on the machine at hand: the cost model's input (plan/choose.py).

Every graph is called through the runtime the runner uses (ArtifactRuntime: the same sessions, IO binding and thread
pool), at decode shape: one token on top of `past` positions of KV cache, and one more position where the defer and
verify policies carry pending states along; each block exit head's graph on one position. Each figure is the median
of `repeats` calls after `warmup` calls, in rounds that call every graph once (so each graph meets the CPU caches a
decode step leaves it; an exit's decision right after its segment's call, as in decode: `after_segments`); every
round's figure is kept (`Costs.samples_ms`). The rounds are timed in batches of `repeats` (`Costs.batch_rounds`):
the plan's intervals are over batches (plan/choose.py), and export and `--profile-costs` time more batches while
the plan is undecided, within a time budget (`measure_costs`'s `decided`, `retime`). The
decisions are timed with the signal computation the runner does after the graph (`exits.signals`); a cosine
signal's decision reads only block states, and the LM head at the exit is timed apart (`exit_predict_ms`: what an
exiting token's own prediction costs, which a river predicting at its end never asks for). Where the runner
decides on the bound chain (runtime/chain.py), the decisions are timed as it makes them there instead: the bound
exit graph deciding in-graph, two scalars read (`Costs.bound_exits`). The full-depth step is timed on the bound
chain, as every step of the runner runs, so what the chain adds per step is in the model too.

What this module does not do: predict or choose (plan/choose.py); it only measures.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np

from eectl.contracts.manifest import Manifest
from eectl.contracts.plan import Costs
from eectl.exits.base import signals
from eectl.exits.gates import gate_open
from eectl.exits.signals import ExitScoring, FullSoftmax, Signal, get_signal
from eectl.plan.step_calls import (
    FULL_STEPS,
    WIDE_WIDTHS,
    certified_call,
    chain_step_call,
    head_rows_calls,
    wide_step_calls,
)
from eectl.runtime.blocks import run_block
from eectl.runtime.chain import DecodeChain, chain_exits_supported
from eectl.runtime.exit_logits import OrtExitLogits
from eectl.runtime.graph_decide import decides_in_graph
from eectl.runtime.sessions import ArtifactRuntime, KVBuffers

DEFAULT_PAST = 128
DEFAULT_REPEATS = 15  # rounds per batch
# the time budget of the timing (every batch, the first included) while the plan is undecided (plan/choose.py
# `settled`: an interval straddling the line; the first MIN_BATCHES batches are timed whatever the budget, or a
# loaded machine's slow first batch would leave a plan decided on one), at export and `eectl run/bench
# --profile-costs` (run/generate.py `replan`) alike. A batch takes ~7 s on the default model at 2 threads (every
# graph of 5 exits and 5 draft widths, 15 times): 8 batches in 60 s, where 30 s gave 4 and left verify [8] at
# ~1.055x deciding in 2 runs of 5. The interval narrows as one over the square root of the batches, and its t
# quantile falls from 2.9 at 3 batches to 1.9 at 8
RETIME_BUDGET_S = 60.0
MAX_BATCHES = 12  # and at most this many batches, whatever the budget (tiny models time a batch in milliseconds)


Call = Callable[[], object]
# a graph call to time, or (what runs right before it in a decode step, untimed; the call timed)
Timed = Call | tuple[Call, Call]


def _time_rounds(calls: dict[str, Timed], repeats: int, warmup: int, times: dict[str, list[float]]) -> None:
    """Append each call's ms in `repeats` rounds (after `warmup` untimed ones) to `times`, every graph once per
    round: as in a decode step, the other graphs evict a small graph's weights from the CPU caches between two of
    its calls (timing one graph in a loop would find them cached and underestimate it), and round r of every graph
    meets the same load of the moment (the plan's bootstrap resamples whole rounds: plan/choose.py). A call given with
    its prelude (an exit's decision: its segment) runs right after it, as in decode."""
    for r in range(warmup + repeats):
        for name, timed in calls.items():
            if isinstance(timed, tuple):
                prelude, fn = timed
                prelude()
            else:
                fn = timed
            t0 = time.perf_counter()
            fn()
            if r >= warmup:
                times[name].append(round(1000 * (time.perf_counter() - t0), 4))


def measure_costs(
    rt: ArtifactRuntime,
    past: int = DEFAULT_PAST,
    repeats: int = DEFAULT_REPEATS,
    warmup: int = 3,
    top_k: int | None = None,
    signal: str = "topk-prob",
    seed: int = 0,
    decided: Callable[[Costs], bool] | None = None,
    budget_s: float = RETIME_BUDGET_S,
    min_batches: int = 1,
) -> Costs:
    """Time every graph in `min_batches` batches of `repeats` rounds. With `decided` (the plan's question: are the
    costs precise enough for its choice?), time more batches until it says yes or the budget is spent (`retime`)."""
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
            kv.seek(0, past, lo, hi)
            return rt.run_segment(i, h, kv, 0, kv_only=kv_only, river=river)

        return call

    # the full-depth step is timed in the same rounds as the graphs, so load from other processes inflates both
    # alike and the runner's own overhead (step minus graphs) stays what it is
    calls: dict[str, Callable[[], object]] = {
        "step": chain_step_call(rt, past),
        **wide_step_calls(rt, past),
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
    # verify checks its drafts with the final head over several rows as decode runs it (greedy_token: the table
    # packed once for several rows, only the tokens leave the graph); timing exit_full on two rows instead charged
    # the unpacked two-row MatMul (~8 ms on the default model against ~0.9 ms packed) and priced verify far too low
    calls["greedy1"] = lambda: rt.greedy_token(L, row1)
    if rt.certified_head is not None:
        calls["certified"] = certified_call(rt, row1)
    calls["greedy2"] = lambda: rt.greedy_token(L, row2)
    heads = head_rows_calls(rt, rng) if "wide.1" in calls else {}  # the heads over a wide pass's rows
    calls.update(heads)
    if L in rt.river_heads:
        calls["river_head"] = lambda: rt.exit_full(L, row1, k, river=True)
    sig = get_signal(signal)
    state_only = _exit_calls(calls, rt, sig, kv, h1, past, k)
    _bound_exit_calls(calls, rt, sig, h1, past, k)  # replaces the decisions the exit graphs make on the chain
    # one-row exit steps on the bound chain (runtime/chain_steps.py `chain_for`: host buffers on the CPU EP, device
    # buffers on a device), its decisions in the exit graphs (timed so just above) or on the host
    bound = chain_exits_supported(rt, list(m.exit_layers), sig)
    timed = after_segments(calls, rt)
    last = calls[f"seg1.{len(m.segments) - 1}"]
    for name in heads:  # right after the final segment, as decode runs them: the certified head's int8 table fits
        timed[name] = (last, calls[name])  # a large cache, where back to back calls found it
    times: dict[str, list[float]] = {name: [] for name in calls}

    def batch() -> Costs:
        first = not times["step"]  # later batches: one untimed round (the plan's arithmetic ran in between)
        _time_rounds(timed, repeats, warmup if first else 1, times)
        return _costs(rt, times, past, state_only, bound, repeats)

    return retime(batch, decided, budget_s, min_batches=min_batches)


def retime(
    batch: Callable[[], Costs],
    decided: Callable[[Costs], bool] | None,
    budget_s: float,
    max_batches: int = MAX_BATCHES,
    min_batches: int = 1,
) -> Costs:
    """Time `min_batches` batches whatever the budget (`batch`: time one more, return the costs of all so far),
    then more while `decided` says no, at most `max_batches` in all, beginning a batch only when it is expected (as
    long as the last one) to end within `budget_s` seconds of the start. The costs record the seconds taken."""
    start = time.perf_counter()
    costs = batch()
    last = time.perf_counter() - start
    while costs.batch_count() < max_batches:
        began = time.perf_counter()
        enough = costs.batch_count() >= min_batches
        if enough and (decided is None or began - start + last > budget_s or decided(costs)):
            break
        costs = batch()
        last = time.perf_counter() - began
    return costs.model_copy(update={"seconds": round(time.perf_counter() - start, 2)})


def after_segments(calls: dict[str, Call], rt: ArtifactRuntime) -> dict[str, Timed]:
    """Each exit's calls (decision as first or later exit, block head, own prediction) timed right after its
    segment's one-position call, as a decode step makes them: the segment streams its layers' weights through the
    caches first. Timed after one another instead, the decisions found each other's code and state cached and read
    ~1.3x low (default model: 0.50 ms per token predicted, 0.65 ms realized in the bench)."""
    out: dict[str, Timed] = dict(calls)
    for layer in rt.manifest.exit_layers:
        segment = calls[f"seg1.{rt.segment_of_layer[layer]}"]
        for kind in ("cand", "local", "block", "predict", "gate"):
            name = f"{kind}.{layer}"
            if name in calls:
                out[name] = (segment, calls[name])
    return out


def _costs(
    rt: ArtifactRuntime, times: dict[str, list[float]], past: int, state_only: bool, bound: bool, batch_rounds: int
) -> Costs:
    """The Costs of these timing rounds: each figure the median of its per-round samples (kept, by the figure's
    path, in `samples_ms`); the one-more-position figures are per-round differences (paired within a round)."""
    m = rt.manifest
    n = len(m.segments)
    extra = {f"segment_extra_ms.{i}": _minus(times[f"seg2.{i}"], times[f"seg1.{i}"]) for i in range(n)}
    samples: dict[str, list[float]] = {
        "full_step_ms": times["step"],  # every step runs on the chain: one figure for both
        "chain_step_ms": times["step"],
        "embed_ms": times["embed"],
        **{f"segment_ms.{i}": times[f"seg1.{i}"] for i in range(n)},
        **extra,
        **{f"kv_ms.{i}": times[f"kv.{i}"] for i in range(n)},
        "final_head_ms": times["head1"],
        "final_head_extra_ms": _minus(times["greedy2"], times["greedy1"]),
        **({"certified_head_ms": times["certified"]} if "certified" in times else {}),
        **{f"head_rows_ms.{w}": times[f"greedy.{w}"] for w in WIDE_WIDTHS if f"greedy.{w}" in times},
        **{f"certified_rows_ms.{w}": times[f"certified.{w}"] for w in WIDE_WIDTHS if f"certified.{w}" in times},
        **{f"candidates_ms.{e}": times[f"cand.{e}"] for e in m.exit_layers},
        **{f"local_ms.{e}": times[f"local.{e}"] for e in m.exit_layers},
        **{f"gate_ms.{e}": times[f"gate.{e}"] for e in m.exit_layers if f"gate.{e}" in times},
        **{f"block_ms.{e}": times[f"block.{e}"] for e in m.exit_layers if e in rt.block_graphs},
        **({f"exit_predict_ms.{e}": times[f"predict.{e}"] for e in m.exit_layers} if state_only else {}),
        **{f"river_ms.{i}": times[f"river.{i}"] for i in range(n) if f"river.{i}" in times},
        **({"river_head_ms": times["river_head"]} if "river_head" in times else {}),
        **{f"wide_ms.{w}": times[f"wide.{w}"] for w in (1, *WIDE_WIDTHS) if f"wide.{w}" in times},
    }
    med = {path: float(statistics.median(v)) for path, v in samples.items()}

    def per(prefix: str, keys: list[str]) -> dict[str, float]:
        return {k: med[f"{prefix}.{k}"] for k in keys if f"{prefix}.{k}" in med}

    exits = [str(e) for e in m.exit_layers]
    costs = Costs(
        provider=rt.provider,
        threads=rt.threads,
        past=past,
        repeats=len(times["step"]),
        embed_ms=med["embed_ms"],
        segment_ms=[med[f"segment_ms.{i}"] for i in range(n)],
        segment_extra_ms=[med[f"segment_extra_ms.{i}"] for i in range(n)],
        kv_ms=[med[f"kv_ms.{i}"] for i in range(n)],
        final_head_ms=med["final_head_ms"],
        final_head_extra_ms=med["final_head_extra_ms"],
        certified_head_ms=med.get("certified_head_ms"),
        certified_miss=certified_miss(m) if "certified_head_ms" in med else None,
        head_rows_ms=per("head_rows_ms", [str(w) for w in WIDE_WIDTHS]),
        certified_rows_ms=per("certified_rows_ms", [str(w) for w in WIDE_WIDTHS]),
        candidates_ms=per("candidates_ms", exits),
        local_ms=per("local_ms", exits),
        gate_ms=per("gate_ms", exits),
        full_step_ms=med["full_step_ms"],
        chain_step_ms=med.get("chain_step_ms"),
        bound_exits=bound,
        block_ms=per("block_ms", exits),
        candidate_source=str(m.candidate_source.get("name", "full")),
        exit_predict_ms=per("exit_predict_ms", exits) if state_only else None,
        river_ms=[med.get(f"river_ms.{i}") for i in range(n)] if rt.river_segments else None,
        river_head_ms=med.get("river_head_ms"),
        wide_ms=per("wide_ms", [str(w) for w in (1, *WIDE_WIDTHS)]),
        wide_full_head=any(k.startswith("wide_ms.") for k in med),  # wide_step_calls: the full head
        samples_ms={path: list(v) for path, v in samples.items()},
        batch_rounds=batch_rounds,
    )
    return costs


def _minus(a: list[float], b: list[float]) -> list[float]:
    """Per round, a - b (at least 0): what one more position or row costs, within one round's load."""
    return [round(max(0.0, x - y), 4) for x, y in zip(a, b, strict=True)]


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
        calls[f"gate.{layer}"] = _gate_call(rt, layer, row1)
        if layer in rt.block_graphs:
            calls[f"block.{layer}"] = block_call(rt, kv, layer, h1, past)
        if state_only:  # an exiting token's own token then costs the exit's LM head (not for a river's end)

            def predict(layer: int = layer) -> object:
                return rt.exit_full(layer, row1, k)

            calls[f"predict.{layer}"] = predict
    return state_only


def _gate_call(rt: ArtifactRuntime, layer: int, hidden: np.ndarray) -> Callable[[], object]:
    """The exit's gate test on one state (eectl.exits.gates: host arithmetic), as the runner makes it: the calibration's
    gate where there is one, else one of the same size (its cost does not depend on the values)."""
    cal = rt.manifest.calibration
    gate = cal.gates.get(str(layer)) if cal is not None else None
    weight, bias = gate.arrays() if gate is not None else (np.ones(hidden.shape[-1], np.float32), 0.0)
    test = (weight, bias, 0.0)
    state = hidden.reshape(1, 1, -1)  # the chain's hop buffer's shape

    def call() -> object:
        return gate_open(test, state)

    return call


def _bound_exit_calls(
    calls: dict[str, Callable[[], object]], rt: ArtifactRuntime, sig: Signal, h1: np.ndarray, past: int, k: int
) -> None:
    """Where the runner decides exits on the bound chain (runtime/chain.py: one row, greedy, the decision inside
    the exit graph), time each exit's decision as that chain makes it: its bound graph call and the two scalars it
    reads. Each exit as the first active one (its candidates picked) and as a later one (scoring the candidates an
    earlier exit bound). Nothing where the artifact's exit graphs cannot decide in-graph or the signal is not one
    they decide: the host decides those on the chain, timed as `_exit_calls` times them."""
    m = rt.manifest
    exits = list(m.exit_layers)
    if not decides_in_graph(rt, exits, sig):
        return  # the host decides these exits on the chain
    never = {c: float("inf") for c in sig.criteria}  # thresholds do not change the graph's work

    def decision(chain: DecodeChain, layer: int) -> Callable[[], object]:
        s = rt.segment_of_layer[layer]
        if isinstance(chain.exit_input(s), np.ndarray):  # the exit reads its segment's (or block head's) output
            chain.exit_input(s)[...] = h1
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


def block_call(rt: ArtifactRuntime, kv: KVBuffers, layer: int, h: np.ndarray, past: int) -> Callable[[], object]:
    """The block exit head at `layer` on one position on top of `past` (its segment holding the same positions)."""
    slot = rt.manifest.exit_at(layer).block.kv_slot  # type: ignore[union-attr]

    def call() -> object:
        kv.seek(0, past, slot, slot + 1)
        kv.seek(0, past + 1, layer - 1, layer)
        return run_block(rt, layer, h, kv, 0)

    return call


def _state_decision(sig: Signal, rt: ArtifactRuntime, layer: int, hidden: np.ndarray, k: int) -> object:
    """A cosine signal's decision as the runner makes it (numpy in): the signal over the exit's block states, no LM
    head."""
    lo, hi = rt.manifest.segments[rt.segment_of_layer[layer]].layers
    blocks = np.repeat(hidden[None], hi - lo + 1, axis=0)  # [n + 1, N, H]: the segment's block boundaries
    scoring = ExitScoring(sig, OrtExitLogits(rt), k)
    return scoring.score(layer, hidden[None], hidden[None], blocks).values


def certified_miss(m: Manifest) -> float | None:
    """The share of export validation's final states the certified head did not pass (None: not validated)."""
    counts = (m.validation or {}).get("certified_head") or {}
    return 1.0 - counts["passed"] / counts["positions"] if counts.get("positions") else None
