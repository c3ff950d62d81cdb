"""The artifact's shared tables (the LM head, the embedding: `Manifest.shared_weights`), as the graphs take them.

`load_weight`: a table mapped from its .npy file and checked against the manifest; on the CPU EP the graphs read the
mapped pages in place. `row_embedding`: where the embedding is the LM head's table, token ids gathered from the
row-major copy of it. `PackedHeads`: exit heads with their LM head table packed once, for final-head calls over
several rows. A full exit graph takes the shared table as a graph input, and ONNX Runtime packs an input matrix
again on every call with more than one row: on the default model at 2 threads, 9 rows took 14 ms that way and 5.8
ms packed (one row 3.2 ms either way, so one row keeps the shared graph). A packed head is a session of the same
graph with the table turned into an initializer, which ORT packs once when the session is created. Created on first
use (verify checking several positions at once, a bound chain of several rows); it holds a packed copy of the table
(~the table's size) for the rest of the run.

What this module does not do: bind tables to calls (sessions.ArtifactRuntime.weight_feeds/bind_weights) or decide
when a call uses a packed head (ArtifactRuntime.greedy_token: several rows, not the river's head; DecodeChain: a
span of several rows).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from eectl.contracts.artifact_files import SharedWeight, check_weight
from eectl.contracts.manifest import LM_HEAD_ROWS, GraphIO, Manifest
from eectl.errors import ArtifactError
from eectl.files import confined
from eectl.runtime.ort import CheckedSession, Graph, _ort, session_options


def load_weight(folder: Path, key: str, weight: SharedWeight, device: str) -> Any:
    """Shared table `key` of the artifact in `folder`: mapped host memory on the CPU EP, else a copy on `device`.
    Checked against the manifest as read_manifest checks it (`check_weight`: dtype, shape, order; its finiteness
    there, with the hashes)."""
    arr = check_weight(folder, key, weight)
    if device == "cpu":
        return arr  # .npy data is C-contiguous; ORT reads it in place
    return _ort().OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arr), device, 0)


def row_embedding(folder: Path, m: Manifest, options: Any, device: str) -> Graph | None:
    """The exported embedding graph with its column gather of the [H, V] LM head table (Gather on axis 1, then a
    Transpose) turned into a row gather of the row-major copy (`LM_HEAD_ROWS`, [V, H]), on the CPU EP where the
    embedding is the LM head's own table (tied weights) and the artifact holds that copy; None elsewhere. What follows
    the gather (Gemma's embedding scale) stays the graph's. Each token's H values came from H rows one table row (196
    KB on the default model) apart: a 16-row step's embedding took 0.66 ms that way, 0.06 ms gathering rows
    (docs/results/2026-12-07-int4-batched-step.md); a gather copies, so the states are the same. Inputs `input_ids`
    and `rows` (bound from the shared tables by `ArtifactRuntime.bind_weights`), output `hidden`."""
    shared = m.shared_weights
    embed, head, rows = shared.get("embed"), shared.get("lm_head"), shared.get(LM_HEAD_ROWS)
    weight = m.embedding.inputs.get("weight")
    if device != "cpu" or embed is None or head is None or rows is None or not isinstance(weight, str):
        return None
    if embed.file != head.file or rows.transposed or rows.dtype != embed.dtype:
        return None
    import onnx
    from onnx import helper

    model = onnx.load(str(confined(folder, m.embedding.file, ArtifactError)))
    g = model.graph
    gathers = [n for n in g.node if n.op_type == "Gather" and n.input[0] == weight]
    after = [n for n in g.node if gathers and list(n.input) == [gathers[0].output[0]]]
    if len(gathers) != 1 or len(after) != 1 or after[0].op_type != "Transpose":
        return None  # not the column gather export writes for a tied table
    gather, transpose = gathers[0], after[0]
    if next((helper.get_attribute_value(a) for a in gather.attribute if a.name == "axis"), 0) != 1:
        return None
    row_gather = helper.make_node("Gather", ["rows", gather.input[1]], [transpose.output[0]], axis=0)
    nodes = [row_gather if n is gather else n for n in g.node if n is not transpose]
    del g.node[:]
    g.node.extend(nodes)
    (table,) = [i for i in g.input if i.name == weight]
    table.name = "rows"
    dims = table.type.tensor_type.shape.dim
    dims[0].dim_value, dims[1].dim_value = int(rows.shape[0]), int(rows.shape[1])
    file = "embedding gathering LM head rows (in memory)"
    cpu = ["CPUExecutionProvider"]
    session = _ort().InferenceSession(model.SerializeToString(), sess_options=options, providers=cpu)
    inputs = {**{k: v for k, v in m.embedding.inputs.items() if k != "weight"}, "rows": "rows"}
    io = m.embedding.model_copy(update={"file": file, "inputs": inputs})
    return Graph(io, CheckedSession(session, file), device)


class PackedHeads:
    """Per exit layer, its full head with the LM head table as an initializer, or None where that does not apply
    (a device provider, a quantized head, no in-graph argmax)."""

    def __init__(self, folder: Path, threads: int | None) -> None:
        self.folder = folder
        self.threads = threads
        self._sessions: dict[int, Any] = {}  # exit layer -> its packed head (or None)
        self._tables: list[Any] = []  # ORT reads each table from these values: they must outlive the sessions

    def get(self, layer: int, g: Graph, feeds: dict[str, Any], device: str) -> Any:
        """Exit `layer`'s packed head: `g` its full graph, `feeds` the shared tables it takes by input name."""
        if layer in self._sessions:
            return self._sessions[layer]
        sess = None
        if device == "cpu" and len(feeds) == 1 and "token" in g.io.outputs:
            name, table = next(iter(feeds.items()))
            if table.dtype == np.float32:
                sess = self._session(g.io, name, table)
        self._sessions[layer] = sess
        return sess

    def _session(self, io: GraphIO, name: str, table: np.ndarray) -> Any:
        """A session of graph `io` with its input `name` turned into an initializer whose data is `table`, handed
        to ORT as it is (an external initializer: not copied into the model)."""
        import onnx

        path = confined(self.folder, io.file, ArtifactError)
        model = onnx.load(str(path), load_external_data=True)  # the graph's own small weights inline
        model.graph.input.remove(next(i for i in model.graph.input if i.name == name))
        init = onnx.TensorProto(name=name, data_type=onnx.TensorProto.FLOAT, dims=list(table.shape))
        init.data_location = onnx.TensorProto.EXTERNAL
        init.external_data.add(key="location", value="supplied-when-the-session-is-created")
        model.graph.initializer.append(init)
        so = session_options(self.threads)
        value = _ort().OrtValue.ortvalue_from_numpy(np.ascontiguousarray(table))
        self._tables.append(value)
        so.add_external_initializers([name], [value])
        return _ort().InferenceSession(model.SerializeToString(), sess_options=so, providers=["CPUExecutionProvider"])
