"""The river policy's K/V against full depth's on one prompt: what bench reports beside river's speed."""

from __future__ import annotations

from typing import Any

import numpy as np

from eectl.runtime.runner import Runner


def river_kv_cosine(runner: Runner, prompt: list[int]) -> dict[str, Any]:
    """River's K/V against the exact K/V of the same tokens, per layer.

    Generates once with `runner` (the river policy), then recomputes the cache for the same token sequence at full
    depth in fp32 (one prefill pass: exact K/V). Per layer, the cosine between the river's and the exact K (and V)
    vector [H_kv * D] of each position the river wrote there (the positions whose token exited at or before that
    layer), averaged; plus the same over every generated position (the non-exited ones drift too: their attention
    read approximate K/V).
    """
    rt = runner.rt
    g = runner.generate([prompt])[0]
    kv = runner.last_kv
    assert kv is not None
    n = int(kv.filled[0, : rt.manifest.num_layers].min())  # the decoder layers (block exit heads' slots follow)
    exact = rt.new_kv(1, n + 1)
    seq = [*prompt, *g.token_ids][:n]
    h = rt.embed(np.array([seq], dtype=np.int64))
    for s in range(len(rt.manifest.segments)):
        h, _ = rt.run_segment(s, h, exact, 0)
    L = rt.manifest.num_layers
    start = len(prompt)  # position of the first generated token; decode step j processes position start - 1 + j
    layers_of = {start - 1 + j: e for j, e in enumerate(g.exit_layers) if j >= 1 and start - 1 + j < n}

    def cos(a: Any, b: Any) -> np.ndarray:  # [1, H_kv, T, D] x2 -> [T]
        x = np.asarray(a)[0].transpose(1, 0, 2).reshape(a.shape[2], -1).astype(np.float64)
        y = np.asarray(b)[0].transpose(1, 0, 2).reshape(b.shape[2], -1).astype(np.float64)
        return (x * y).sum(-1) / (np.linalg.norm(x, axis=-1) * np.linalg.norm(y, axis=-1) + 1e-12)

    per_layer = []
    gen = np.arange(start, n)
    for i in range(L):
        ck = cos(kv.keys[0][i][:, :, :n], exact.keys[0][i][:, :, :n])
        cv = cos(kv.values[0][i][:, :, :n], exact.values[0][i][:, :, :n])
        river = np.array([p for p, e in layers_of.items() if e <= i], dtype=np.int64)
        per_layer.append(
            {
                "layer": i,
                "river_positions": int(river.size),
                "key_cosine_river": float(ck[river].mean()) if river.size else None,
                "value_cosine_river": float(cv[river].mean()) if river.size else None,
                "key_cosine_generated": float(ck[gen].mean()) if gen.size else None,
                "value_cosine_generated": float(cv[gen].mean()) if gen.size else None,
            }
        )
    river_values = [v for r in per_layer for v in (r["key_cosine_river"], r["value_cosine_river"]) if v is not None]
    return {
        "tokens": len(g.token_ids),
        "exited": sum(1 for e in g.exit_layers[1:] if e < L),
        "min_river_cosine": min(river_values) if river_values else None,
        "mean_river_cosine": float(np.mean(river_values)) if river_values else None,
        "layers": per_layer,
    }
