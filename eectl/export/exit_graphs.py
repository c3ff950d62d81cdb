"""The exit graphs: after an exit's layer, (a trained head, inlined) -> final norm -> LM head -> logits, the same
math as exits.ExitHead, with the exit's decision inside the graph (exits.decision_nodes).

Two per exit: `full` (the transposed LM head [H, V], Top-K and the greedy token) and `local` (the exact logits of
K given candidates, gathered from the row-major LM head [V, H]); both tables are graph inputs, so the artifact
stores them once and every exit session binds the same arrays.

What this module does not do: build the layers, the embedding or save a graph (export/graphs.py, whose `_Builder`
and `_rms` it uses), or pick the candidates (export/candidate_graphs.py).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, numpy_helper

from eectl.contracts.manifest import GraphIO
from eectl.exits.base import Probe, probe_of
from eectl.exits.signals import GRAPH_CRITERIA, SOFTMAX_CRITERIA, decision_nodes
from eectl.export.graphs import _Builder, _rms
from eectl.models.adapters import Adapter


def _head_prefix(b: _Builder, hidden: str, head: torch.nn.Module | None, hidden_size: int, name: str) -> str:
    """Inline a trained head (hidden [N, H] -> [N, H]) exported by torch.onnx into this graph, or pass through."""
    if head is None:
        return hidden
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "head.onnx"
        example = torch.zeros(2, hidden_size, dtype=torch.float32)
        module = head.float().eval()
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                module,
                (example,),
                str(path),
                dynamo=False,
                opset_version=17,
                input_names=["h"],
                output_names=["y"],
                dynamic_axes={"h": {0: "n"}, "y": {0: "n"}},
            )
        sub = onnx.load(str(path))
    rename = {"h": hidden, "y": b.fresh(f"{name}.out")}

    def mapped(n: str) -> str:
        if n in rename:
            return rename[n]
        if n == "":
            return n
        return f"{name}.{n}"

    for init in sub.graph.initializer:
        arr = numpy_helper.to_array(init)
        if arr.dtype in (np.float32, np.float64):
            arr = arr.astype(b.np_dtype)
        b.inits.append((mapped(init.name), arr))
    for node in sub.graph.node:
        new = onnx.NodeProto()
        new.CopyFrom(node)
        del new.input[:]
        del new.output[:]
        new.input.extend(mapped(n) for n in node.input)
        new.output.extend(mapped(n) for n in node.output)
        new.name = mapped(node.name) if node.name else ""
        if new.op_type == "Constant" and b.np_dtype == np.float16:
            for attr in new.attribute:
                if attr.name == "value" and attr.t.data_type == TensorProto.FLOAT:
                    attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float16)))
        b.nodes.append(new)
    return rename["y"]


def _decision(
    b: _Builder,
    logits: str,
    ids: str | None,
    inputs: dict[str, Any],
    outputs: dict[str, Any],
    probe: tuple[str, Probe] | None = None,
) -> None:
    """The exit's decision inside its graph (exits.decision_nodes): a `thresholds` input [2] float32 ([3] with the
    exit's probe: the learned signal's score is the third criterion), whose default [inf, ...] (an initializer:
    callers that do not bind it never pass) keeps the graph's other uses as they were, and the outputs `passed` [N]
    bool and `exit_token` [N] int64 (the token it would emit), and with a probe `score` [N] float32 (the runner's
    host path reads it: the score's one computation at run time)."""
    size = len(GRAPH_CRITERIA) if probe is not None else SOFTMAX_CRITERIA
    thresholds = b.input("thresholds", TensorProto.FLOAT, [size])
    b.const(thresholds, np.full(size, np.inf, np.float32), False)
    passed, token, score = decision_nodes(b, logits, ids, thresholds, probe)
    b.output(passed, "passed", TensorProto.BOOL, ["n"])
    b.output(token, "exit_token", TensorProto.INT64, ["n"])
    inputs["thresholds"] = "thresholds"
    outputs.update(passed="passed", exit_token="exit_token")
    if score is not None:
        b.output(score, "score", TensorProto.FLOAT, ["n"])
        outputs["score"] = "score"


def _probe(normed: str, head: torch.nn.Module | None) -> tuple[str, Probe] | None:
    """The exit's probe (the learned signal) over the graph's normed state, where its head carries one."""
    probe = probe_of(head)
    return None if probe is None else (normed, probe)


def build_exit(
    adapter: Adapter, layer: int, dtype: str, local: bool, head: torch.nn.Module | None = None
) -> tuple[onnx.ModelProto, GraphIO]:
    """Exit graph after `layer`: (head) -> final norm -> LM head rows -> logits, the same math as ExitHead.

    The LM head is a shared table stored twice (export._write_shared_weights): transposed, [H, V], for the full
    graph's MatMul (one token: a matrix-vector product that streams the table once), and row-major, [V, H], for the
    local graph, which gathers its K candidates' rows (`_candidate_logits`).
    The full graph also outputs the greedy token (ArgMax, first index on ties as torch): when the runner needs
    nothing else it copies only that out, with k = 1 for the Top-K (sessions.greedy_token).
    """
    dims = adapter.dims
    b = _Builder(dtype)
    hidden = b.input("hidden_states", None, ["n", dims.hidden_size])
    norm_w, eps = adapter.final_norm_weight()
    x = _head_prefix(b, hidden, head, dims.hidden_size, f"exit_{layer}.head")
    normed = _rms(b, x, norm_w, eps, "final_norm")
    softcap = getattr(adapter.config, "final_logit_softcapping", None)
    bias = getattr(adapter.lm_head, "bias", None)

    def cap(t: str) -> str:
        if not softcap:
            return t
        c = b.const(b.fresh("softcap"), np.array(softcap, np.float32))
        return b.op("Mul", [b.op("Tanh", [b.op("Div", [t, c])]), c])

    suffix = "local" if local else "full"
    inputs: dict[str, str | list[str]] = {"hidden": "hidden_states"}
    if local:
        cand = b.input("candidates", TensorProto.INT64, ["n", "k"])
        inputs["rows"] = _ROWS
        logits, _ = _candidate_logits(b, adapter, normed, cand)
        logits = cap(logits)
        b.output(logits, "candidate_logits", None, ["n", "k"])
        inputs["candidates"] = "candidates"
        outputs: dict[str, str | list[str]] = {"candidate_logits": "candidate_logits"}
        _decision(b, logits, cand, inputs, outputs, _probe(normed, head))
    else:
        inputs["weight"] = b.input("lm_head_weight", None, [dims.hidden_size, dims.vocab_size])  # stored [H, V]
        b.input("top_k", TensorProto.INT64, [1])
        logits = b.op("MatMul", [normed, "lm_head_weight"])  # [N, H] @ [H, V]
        if bias is not None:
            logits = b.op("Add", [logits, b.const("lm_head_bias", bias.detach())])
        logits = cap(logits)
        values, indices = b.op("TopK", [logits, "top_k"], 2, axis=-1, largest=1, sorted=1)
        b.output(logits, "logits", None, ["n", dims.vocab_size])
        b.output(indices, "candidates", TensorProto.INT64, ["n", "k"])
        b.output(values, "candidate_logits", None, ["n", "k"])
        b.output(b.op("ArgMax", [logits], axis=-1, keepdims=0), "token", TensorProto.INT64, ["n"])
        inputs["top_k"] = "top_k"
        outputs = {
            "logits": "logits",
            "candidates": "candidates",
            "candidate_logits": "candidate_logits",
            "token": "token",
        }
        if layer < dims.num_layers:  # an exit's first decision under the full Top-K source: over its K best
            _decision(b, values, indices, inputs, outputs, _probe(normed, head))
    io = GraphIO(file=f"exit_{layer:03d}_{suffix}.onnx", inputs=inputs, outputs=outputs)
    return b.model(f"exit_{layer}_{suffix}"), io


_ROWS = "lm_head_rows"  # the graph input bound to the shared row-major LM head (manifest.LM_HEAD_ROWS)


def _candidate_logits(b: _Builder, adapter: Adapter, normed: str, cand: str) -> tuple[str, str]:
    """The exact logits of K candidates [N, K]: their rows of the row-major LM head (input `lm_head_rows`, [V, H]),
    gathered (K contiguous rows), times the normed state; plus their bias entries where the head has a bias. Also
    the gathered rows [N, K, H].

    The table's first dimension is declared symbolic: a local exit after the first can be bound to the K rows the
    first exit gathered ([K, H], candidates 0..K-1: runtime/chain.py), which it then reads contiguously instead of
    gathering K scattered rows of the V-row table again (~30 us per decision after a segment, measured)."""
    dims = adapter.dims
    b.input(_ROWS, None, ["rows", dims.hidden_size])
    rows = b.op("Gather", [_ROWS, cand], axis=0)  # [N, K, H]
    q = b.op("Unsqueeze", [normed, b.const("axis2", np.array([2], np.int64), False)])  # [N, H, 1]
    logits = b.op("Squeeze", [b.op("MatMul", [rows, q]), "axis2"])  # [N, K, H] @ [N, H, 1] -> [N, K]
    bias = getattr(adapter.lm_head, "bias", None)
    if bias is not None:
        logits = b.op("Add", [logits, b.op("Gather", [b.const("lm_head_bias", bias.detach()), cand], axis=0)])
    return logits, rows
