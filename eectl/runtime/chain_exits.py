"""An active exit's decision bound after its segment on a one-row chain (runtime/chain.py): `bind_exit`.

The decision graph reads the exit's input state where the chain's segment (or block head) wrote it, decides inside the
graph (exits.decision_nodes: the thresholds bound once as an input) and writes whether the token passes and its token
to host scalars; the first exit's candidates land in a buffer the later exits' local graphs read (their exact LM-head
rows too, on the host, as the later exits' table).

What this module does not do: run a decision, or decide for several rows (chain_rows.py does both).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from eectl.exits.signals import Signal
from eectl.runtime.chain_parts import BoundExit
from eectl.runtime.graph_decide import declared, picker_graph, thresholds_input
from eectl.runtime.placement import Read


def bind_exit(
    chain: Any, layer: int, picker: int | None, signal: Signal, thresholds: dict[str, float], k: int
) -> BoundExit:
    """Bind the decision at `layer`: with no `picker`, it picks candidates (the artifact's candidate graph, or
    the full graph's Top-K); else it scores the candidates exit `picker` picked (the local graph); both decide
    in the graph."""
    rt, H, dtype = chain.rt, chain.rt.manifest.dims["hidden_size"], chain.rt.np_dtype
    first = picker is None
    g, kind = picker_graph(rt, layer) if first else (rt.local_graphs[layer], "exit_local")  # kind: the plan's name
    io = g.session.io_binding()  # not in chain.calls: an exit runs only when the step asks for it
    rt._bind_array(io, g.name("hidden"), chain._view(chain.exit_input(rt.segment_of_layer[layer]), (1, H), dtype))
    rt._bind_array(io, g.name("thresholds"), chain._host(thresholds_input(g, signal, thresholds)))
    ids, ids_from = None, None
    if picker is None:
        rt.bind_weights(io, g)
        candidates, rows = chain._buffer((1, k), np.int64), None
        rt._bind_array(io, g.name("top_k"), chain._host(np.array([k], np.int64)))
        rt._bind_array(io, g.name("candidates"), candidates, output=True)
        if "candidate_rows" in g.io.outputs and not chain.device:  # the later exits read these K rows
            rows = chain._buffer((1, k, H), dtype)
            rt._bind_array(io, g.name("candidate_rows"), rows, output=True)
        if "logits" in g.io.outputs:  # the full graph: its logits and greedy token are scratch
            V = rt.manifest.dims["vocab_size"]
            rt._bind_array(io, g.name("logits"), chain._buffer((1, V), dtype), output=True)
            rt._bind_array(io, g.name("token"), chain._buffer((1,), np.int64), output=True)
        chain.picked[layer] = (candidates, rows)
    else:
        candidates, rows = chain.picked[picker]
        if rows is not None and "rows" in g.io.inputs and isinstance(declared(g)[g.name("rows")][0], str):
            # the picker's K rows as this graph's table, its candidates 0..K-1: the same rows, read contiguously
            # instead of gathered from the V-row table again; the graph's token is then a column of the candidates
            rt._bind_array(io, g.name("rows"), rows.reshape(k, H))
            rt._bind_array(io, g.name("candidates"), chain._host(np.arange(k, dtype=np.int64)[None]))
            ids, ids_from = candidates, (picker_graph(rt, picker)[1], picker, "candidates")
        else:
            rt.bind_weights(io, g)
            rt._bind_array(io, g.name("candidates"), candidates)
    logits = chain._buffer((1, k), dtype)
    rt._bind_array(io, g.name("candidate_logits"), logits, output=True)
    passed, token = chain._host(np.zeros(1, bool)), chain._host(np.zeros(1, np.int64))
    rt._bind_array(io, g.name("passed"), passed, output=True)
    rt._bind_array(io, g.name("exit_token"), token, output=True)
    # the candidates' vocabulary ids: what this decision picked, or what the picker picked for it to score
    picked_by = layer if picker is None else picker
    cands_from: Read = (picker_graph(rt, picked_by)[1], picked_by, "candidates")
    return BoundExit(
        layer, g.session, io, passed, token, ids, kind, ids_from, logits, chain.picked[picked_by][0], cands_from
    )
