"""ONNX graphs built directly from a model's weights: embedding, segments, exits, candidate sources.

The decoder is cut at the exit points into segments, each one ONNX graph:

    input_ids -> [embed] -> hidden -> [segment 0: layers 0..e1) -> hidden -> [segment 1: e1..e2) -> ... -> hidden
                                                 |                                 |                     |
                                              [exit e1]                         [exit e2]            [final head]

A segment layer is  RMSNorm -> QKV MatMul -> (q/k norm) -> GroupQueryAttention (rotary inside, packed QKV, past and
present KV share one buffer, written in place) -> O MatMul -> residual + RMSNorm -> gate/up MatMul -> act -> down
MatMul -> residual, with each "residual + RMSNorm" one SkipSimplifiedLayerNormalization (the MLP's residual is added
by the next layer's input norm, or by one Add at the segment's end), the fused ops onnxruntime-genai's graphs use.
One graph serves prefill, one-token decode and multi-token chunks on top of a past (batch, sequence and past length
dynamic). Each segment also gets a K/V-only graph (the `copy` policy). Exit graphs (optional trained head, final
norm, LM head, Top-K, greedy token) take the LM-head weight, stored transposed [H, V], as an input, so the artifact
stores it once (weights/*.npy) and every exit session binds the same array.

Weights live outside the protobuf: every graph is saved as `<graph>.onnx` (structure, a few KB) plus
`<graph>.onnx.data` (its initializers, ONNX external data, each tensor aligned for memory mapping), so no graph meets
protobuf's 2 GB limit, and graphs are built and written one at a time: peak memory is the model plus one graph.

Why built from the weights rather than exported by torch.onnx: GroupQueryAttention with a shared KV buffer avoids
concatenating the cache each token, the cost that dominates decode at long context (numbers in the issue notes).

This module holds the builder, the layers, the segments and the embedding, and writes a graph (`save_graph`); the exit
graphs are export/exit_graphs.py, the candidate graphs export/candidate_graphs.py.

What this module does not do: write the artifact or its manifest (export/exporter.py), or compare graphs with PyTorch
(export/validation.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import set_external_data

from eectl import __version__
from eectl.contracts.manifest import GraphIO
from eectl.models.adapters import Adapter
from eectl.models.parts import LayerWeights

OPSET = 21
IR_VERSION = 10
DTYPES = {"fp32": (TensorProto.FLOAT, np.float32), "fp16": (TensorProto.FLOAT16, np.float16)}
# Initializers of at least this many bytes go to the graph's external data file; smaller ones (shapes, scalars)
# stay inline. Offsets of tensors of at least EXTERNAL_ALIGN_MIN_BYTES are aligned to 64 KiB, the largest mmap
# allocation granularity ORT checks for; smaller ones (int4 scales and zero points, norms) are read, not mapped, and
# packed tightly: aligning each of an int4 artifact's ~600 small tensors added 26 MB (12%) of padding.
EXTERNAL_MIN_BYTES = 1024
EXTERNAL_ALIGN = 1 << 16
EXTERNAL_ALIGN_MIN_BYTES = 1 << 20  # onnx's own align_threshold


class _Builder:
    """A small helper over onnx.helper: unique names, initializers in the artifact dtype."""

    def __init__(self, dtype: str) -> None:
        self.elem, self.np_dtype = DTYPES[dtype]
        self.nodes: list[onnx.NodeProto] = []
        # (name, array) until model(): arrays are often views of the torch weights, and each becomes a TensorProto
        # only as it is moved into the model, so a graph's weights are held about once, not once per proto copy
        self.inits: list[tuple[str, np.ndarray]] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._renames: list[tuple[str, str]] = []  # (value, graph output name), applied by model()
        self._n = 0

    def fresh(self, base: str) -> str:
        self._n += 1
        return f"{base}_{self._n}"

    def const(self, name: str, value: Any, float_type: bool = True, scalar: bool = False) -> str:
        arr = value.detach().float().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        if float_type:
            arr = arr.astype(self.np_dtype, copy=False)
        # a scalar is stored as shape [1], as np.ascontiguousarray made it before (the graphs broadcast either way),
        # unless asked for as one (Pad's value, MatMulInteger's zero point)
        self.inits.append((name, arr.reshape(1) if arr.ndim == 0 and not scalar else arr))
        return name

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs: Any) -> Any:
        outs = [self.fresh(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, domain=domain or None, **attrs))
        return outs[0] if n_out == 1 else outs

    def input(self, name: str, elem: int | None, shape: list[Any]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, self.elem if elem is None else elem, shape))
        return name

    def output(self, src: str, name: str, elem: int | None, shape: list[Any]) -> None:
        """Graph output `name` is the value `src` (named so at model(): no Identity node where a node makes it)."""
        self._renames.append((src, name))
        self.outputs.append(helper.make_tensor_value_info(name, self.elem if elem is None else elem, shape))

    def _name_outputs(self) -> None:
        """Give each output's producing node the output's name (every reader follows), so the graph has no Identity
        node per output: each node of a one-token exit decision costs ~1 us after a segment evicted the caches. A
        value that is a graph input or initializer, or an output already, keeps an Identity."""
        producer = {out: node for node in self.nodes for out in node.output}
        taken = {i.name for i in self.inputs} | {name for name, _ in self.inits}
        for src, name in self._renames:
            node = producer.pop(src, None)
            if node is None or src in taken:
                self.nodes.append(helper.make_node("Identity", [src], [name]))
                continue
            for n in self.nodes:
                n.input[:] = [name if v == src else v for v in n.input]
                n.output[:] = [name if v == src else v for v in n.output]
            producer[name] = node
            taken.add(name)

    def model(self, name: str) -> onnx.ModelProto:
        """The model, with the initializers added last, one at a time, straight into its graph.

        make_graph and make_model each copy the initializers they are given (protobuf messages are copied, never
        moved, on append and CopyFrom), which held a segment's weights three times at once. Each tensor's bytes
        are instead written once, into the model's own proto, and the builder's array is dropped right after.
        """
        self._name_outputs()
        graph = helper.make_graph(self.nodes, name, self.inputs, self.outputs)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)],
            producer_name="eectl",
            producer_version=__version__,
        )
        model.ir_version = IR_VERSION
        pending, self.inits = self.inits, []
        pending.reverse()
        while pending:
            init_name, arr = pending.pop()
            tensor = model.graph.initializer.add()
            if arr.dtype.kind in "biuf":  # numpy_helper.from_array's fields, without its intermediate proto
                tensor.dims.extend(arr.shape)
                tensor.name = init_name
                tensor.data_type = helper.np_dtype_to_tensor_dtype(arr.dtype)
                raw = numpy_helper.tobytes_little_endian(arr)
                del arr  # the array (often the builder's own copy, e.g. a concatenated MLP) before protobuf's copy
                tensor.raw_data = raw
                del raw
            else:  # strings, packed sub-byte types: from_array's own handling
                tensor.CopyFrom(numpy_helper.from_array(arr, init_name))
                del arr
        return model


PAD_ROWS = "pad.rows"  # the segment graphs' switch between padding every MatMul's rows and attention only


class _RowPad:
    """A one-row call's positions plus one zero position after them (`export --exact-wide`): through the whole
    segment, or through its attention only, as the initializer `PAD_ROWS` ([1] or [0]) says.

    ONNX Runtime's CPU kernels may compute one position with other code than several: GroupQueryAttention takes a
    matrix-vector product for one new position, and MatMulNBits at accuracy level 4 (int8 activations) takes another
    kernel for one row than for several on AVX2 CPUs (on AVX-512 ones the same), as MatMulNBits at level 0 does
    everywhere. So a position's numbers differ in the last bits between a one-position decode step and a wide pass
    (prefill, verify's check of drafts, defer's pending positions), and int8 activations turn such differences into
    other tokens. With one zero position appended to the segment's input (`PAD_ROWS` 1, the graph's own value), a
    single row's call runs every MatMul on at least two rows and attention on at least two positions, and each real
    position's output is bit for bit the same whatever the width of its call, on every CPU (tests/test_exact_wide.py;
    measured: several rows of MatMulNBits compute each row as two rows do, on AVX2 and AVX-512). Where this CPU's
    MatMulNBits computes one row as two, padding attention only is enough and cheaper (a runtime sets `PAD_ROWS` to 0
    when it creates the sessions: runtime/sessions.py): the zero position is appended to Q/K/V and cut from the
    attention output. The zero position's K/V land in the slot after the call's new positions, never counted as
    filled and overwritten by the row's next position; its outputs are cut off. A call with no such slot free (in
    the buffer or the rotary tables), or of several rows (GQA takes several positions per row only one row at a
    time; several rows are several MatMul rows already), runs unpadded. The real positions' K/V are the same either
    way where the kernels compute one row as two: GQA writes them before attending, and causal attention never
    reads a later position.
    """

    def __init__(self, b: _Builder, hidden: str, past_key: str, positions: int, width: int) -> None:
        rows = b.op("Shape", [hidden], start=0, end=1)
        self.sequence = b.op("Shape", [hidden], start=1, end=2)
        self.zero = b.const("pad.zero", np.array([0], np.int64), False)
        self.axis = b.const("pad.axis", np.array([1], np.int64), False)
        total = b.op("Cast", ["total_sequence_length"], to=TensorProto.INT64)
        # one row, and room for the zero position: a free slot in the buffer and a row in the rotary tables
        fits = b.op("Less", [total, b.op("Shape", [past_key], start=2, end=3)])
        fits = b.op(
            "And", [fits, b.op("Less", [total, b.const("pad.positions", np.array([positions], np.int64), False)])]
        )
        one_row = b.op("Equal", [rows, b.const("pad.one", np.array([1], np.int64), False)])
        count = b.op("Cast", [b.op("And", [one_row, fits])], to=TensorProto.INT64)  # [1]: 1 or 0, attention's
        # the stream's zero positions: 0 or count. Min, not Mul: ORT's optimizer drops a Mul by a constant 1 before a
        # session's own value of the switch (SessionOptions.add_initializer) would reach it
        streamed = b.op("Min", [count, b.const(PAD_ROWS, np.array([1], np.int64), False)])
        count32 = b.op("Cast", [count], to=TensorProto.INT32)
        self.seqlens_k = b.op("Add", ["seqlens_k", count32])
        self.total = b.op("Add", ["total_sequence_length", b.op("Squeeze", [count32])])
        self._rows, self._more = rows, b.op("Sub", [count, streamed])  # zero positions attention adds: 0 or 1
        self._attended = b.op("Add", [self.sequence, streamed])  # the stream's positions
        self.hidden = b.op("Concat", [hidden, self._zeros(b, streamed, width, "stream")], axis=1)  # [B, S + n, W]
        self.width = width
        self._extra: dict[int, str] = {}

    def _zeros(self, b: _Builder, count: str, width: int, name: str) -> str:
        dims = b.op("Concat", [self._rows, count, b.const(f"pad.{name}", np.array([width], np.int64), False)], axis=0)
        return b.op("ConstantOfShape", [dims], value=helper.make_tensor("z", b.elem, [1], [0]))

    def extend(self, b: _Builder, x: str, width: int) -> str:
        """Q, K or V [B, S + n, width] with the zero positions attention adds after the stream's (none where the
        stream is padded already)."""
        if not x:  # GQA's packed QKV: no separate k or v
            return x
        if width not in self._extra:
            self._extra[width] = self._zeros(b, self._more, width, f"width{width}")
        return b.op("Concat", [x, self._extra[width]], axis=1)

    def cut_attention(self, b: _Builder, attn: str) -> str:
        """An attention output's stream positions: [B, S + count, N] -> [B, S + n, N]."""
        return b.op("Slice", [attn, self.zero, self._attended, self.axis])

    def cut(self, b: _Builder, x: str) -> str:
        """The real positions of a stream: [B, S + n, W] -> [B, S, W]."""
        return b.op("Slice", [x, self.zero, self.sequence, self.axis])

    def cut_states(self, b: _Builder, states: str, blocks: int) -> str:
        """The real positions of `blocks` streams concatenated along positions: [B, blocks * (S + n), W] ->
        [B, blocks * S, W]."""
        split = b.op("Reshape", [states, b.const("pad.blocks", np.array([0, blocks, -1, self.width], np.int64), False)])
        real = b.op("Slice", [split, self.zero, self.sequence, b.const("pad.axis2", np.array([2], np.int64), False)])
        return b.op("Reshape", [real, b.const("pad.flat", np.array([0, -1, self.width], np.int64), False)])


def _rms(b: _Builder, x: str, weight: torch.Tensor, eps: float, name: str) -> str:
    return b.op("SimplifiedLayerNormalization", [x, b.const(name, weight)], axis=-1, epsilon=eps)


def _add_rms(b: _Builder, x: str, delta: str | None, weight: torch.Tensor, eps: float, name: str) -> tuple[str, str]:
    """RMSNorm(x + delta) and the sum x + delta, as one SkipSimplifiedLayerNormalization (the residual add and the
    next norm read the stream once; ORT does not fuse the pair itself when the sum has other consumers)."""
    if delta is None:
        return _rms(b, x, weight, eps, name), x
    normed, total = b.fresh("skip_norm"), b.fresh("residual")
    b.nodes.append(
        helper.make_node(
            "SkipSimplifiedLayerNormalization",
            [x, delta, b.const(name, weight)],
            [normed, "", "", total],
            domain="com.microsoft",
            epsilon=eps,
        )
    )
    return normed, total


def _linear(b: _Builder, x: str, weights: list[torch.Tensor], biases: list[torch.Tensor | None], name: str) -> str:
    """x @ concat(weights).T (+ concat(biases)): one MatMul for several projections."""
    w = torch.cat([wt.T for wt in weights], dim=1)  # [in, out], one copy (big models: memory is the limit)
    y = b.op("MatMul", [x, b.const(name, w)])
    if any(bias is not None for bias in biases):
        full = torch.cat(
            [bias if bias is not None else torch.zeros(wt.shape[0]) for wt, bias in zip(weights, biases, strict=True)]
        )
        y = b.op("Add", [y, b.const(name + ".bias", full)])
    return y


def _head_norm(b: _Builder, x: str, weight: torch.Tensor, eps: float, heads: int, head_dim: int, name: str) -> str:
    """RMSNorm over each head of a [B, S, heads * D] projection (Qwen3 / Gemma3 q_norm and k_norm)."""
    split = b.op("Reshape", [x, b.const(name + ".shape4", np.array([0, 0, heads, head_dim], np.int64), False)])
    normed = _rms(b, split, weight, eps, name)
    return b.op("Reshape", [normed, b.const(name + ".shape3", np.array([0, 0, heads * head_dim], np.int64), False)])


def _layer(
    b: _Builder,
    x: str,
    delta: str | None,
    w: LayerWeights,
    names: dict[str, str],
    dims: Any,
    rope: dict[str, tuple[str, str]],
    kv_only: bool,
    pad: _RowPad | None = None,
) -> tuple[str, str | None, str, str, str]:
    """One decoder layer on the residual stream x + delta (delta: an addend not yet added, or None).

    Returns (x_out, delta_out, layer_input, present_key, present_value): the stream after the layer is
    x_out + delta_out, the MLP's output is left unadded so that the next layer's input norm adds it (one
    SkipSimplifiedLayerNormalization); layer_input is this layer's materialised input stream.
    """
    i, nh, nkv, d = w.index, dims.num_heads, dims.num_kv_heads, dims.head_dim
    p = f"layers.{i}"
    h, x = _add_rms(b, x, delta, w.input_norm, w.eps, f"{p}.input_norm")
    layer_input = x
    qkv = _linear(b, h, [w.q, w.k, w.v], [w.q_bias, w.k_bias, w.v_bias], f"{p}.qkv")
    q, k, v = qkv, "", ""  # packed [B, S, (nh + 2 nkv) D]: GroupQueryAttention splits it itself
    w_q = (nh + 2 * nkv) * d
    if w.q_norm is not None and w.k_norm is not None:  # per-head norms need q and k apart
        q, k, v = b.op(
            "Split",
            [qkv, b.const(f"{p}.qkv.split", np.array([nh * d, nkv * d, nkv * d], np.int64), False)],
            3,
            axis=-1,
        )
        w_q = nh * d
        q = _head_norm(b, q, w.q_norm, w.eps, nh, d, f"{p}.q_norm")
        k = _head_norm(b, k, w.k_norm, w.eps, nkv, d, f"{p}.k_norm")
    cos, sin = rope[w.layer_type]
    attrs: dict[str, Any] = dict(num_heads=nh, kv_num_heads=nkv, scale=w.scale, do_rotary=1)
    if w.sliding_window is not None:
        attrs["local_window_size"] = int(w.sliding_window)
    if w.softcap:
        attrs["softcap"] = float(w.softcap)
    lengths = ["seqlens_k", "total_sequence_length"] if pad is None else [pad.seqlens_k, pad.total]
    if pad is not None:
        q, k, v = (pad.extend(b, t, width) for t, width in ((q, w_q), (k, nkv * d), (v, nkv * d)))
    attn, present_k, present_v = b.op(
        "GroupQueryAttention",
        [q, k, v, names["past_key"], names["past_value"], *lengths, cos, sin],
        3,
        domain="com.microsoft",
        **attrs,
    )
    if pad is not None:
        attn = pad.cut_attention(b, attn)
    if kv_only:
        return x, None, layer_input, present_k, present_v
    o = _linear(b, attn, [w.o], [w.o_bias], f"{p}.o")
    if w.pre_feedforward_norm is not None and w.post_feedforward_norm is not None:  # Gemma's sandwich norms
        o = _rms(b, o, w.post_attention_norm, w.eps, f"{p}.post_attention_norm")
        h, x = _add_rms(b, x, o, w.pre_feedforward_norm, w.eps, f"{p}.pre_feedforward_norm")
    else:
        h, x = _add_rms(b, x, o, w.post_attention_norm, w.eps, f"{p}.post_attention_norm")
    inter = w.gate.shape[0]
    gu = _linear(b, h, [w.gate, w.up], [None, None], f"{p}.gate_up")
    gate, up = b.op("Split", [gu, b.const(f"{p}.gate_up.split", np.array([inter, inter], np.int64), False)], 2, axis=-1)
    if w.activation == "silu":
        act = b.op("Mul", [gate, b.op("Sigmoid", [gate])])
    else:
        act = b.op("Gelu", [gate], approximate="tanh")
    down = _linear(b, b.op("Mul", [act, up]), [w.down], [None], f"{p}.down")
    if w.post_feedforward_norm is not None:
        down = _rms(b, down, w.post_feedforward_norm, w.eps, f"{p}.post_feedforward_norm")
    return x, down, layer_input, present_k, present_v


def build_segment(
    adapter: Adapter,
    lo: int,
    hi: int,
    dtype: str,
    max_positions: int,
    kv_only: bool = False,
    exact_wide: bool = False,
) -> tuple[onnx.ModelProto, GraphIO]:
    """Layers [lo, hi) as one graph; `exact_wide`: one-row calls run with one zero position after theirs (`_RowPad`)."""
    dims = adapter.dims
    b = _Builder(dtype)
    hidden = b.input("hidden_states", None, ["batch", "sequence", dims.hidden_size])
    b.input("seqlens_k", TensorProto.INT32, ["batch"])
    b.input("total_sequence_length", TensorProto.INT32, [])
    pads = exact_wide and not kv_only
    rope: dict[str, tuple[str, str]] = {}
    # a padded call's zero position after the model's last one needs a row of its own: every call of a runtime
    # that allocates the pad slot (runtime/kv.py) fits, the last position's included
    for kind, (cos, sin) in adapter.rotary_tables(max_positions + int(pads)).items():
        rope[kind] = (b.const(f"rope.{kind}.cos", cos), b.const(f"rope.{kind}.sin", sin))
    kv_shape = ["batch", dims.num_kv_heads, "max_sequence", dims.head_dim]
    names = {k: [] for k in ("past_key", "past_value", "present_key", "present_value")}  # type: dict[str, list[str]]
    for i in range(lo, hi):
        names["past_key"].append(b.input(f"past_key_values.{i}.key", None, kv_shape))
        names["past_value"].append(b.input(f"past_key_values.{i}.value", None, kv_shape))
    pad = _RowPad(b, hidden, names["past_key"][0], max_positions + 1, dims.hidden_size) if pads else None
    x, delta = (hidden if pad is None else pad.hidden), None
    layer_input = x
    boundaries = []  # the residual stream before each layer (materialised as its input), then after the last
    for j, i in enumerate(range(lo, hi)):
        x, delta, layer_input, pk, pv = _layer(
            b,
            x,
            delta,
            adapter.layer_weights(i),
            {"past_key": names["past_key"][j], "past_value": names["past_value"][j]},
            dims,
            rope,
            kv_only,
            pad,
        )
        boundaries.append(layer_input)
        for kind, src in (("key", pk), ("value", pv)):
            name = f"present.{i}.{kind}"
            b.output(src, name, None, kv_shape)
            names[f"present_{kind}"].append(name)
    outputs: dict[str, str | list[str]] = {"present_key": names["present_key"], "present_value": names["present_value"]}
    if not kv_only:
        if delta is not None:  # the last layer's MLP output, not yet added to the stream
            x = b.op("Add", [x, delta])
        # [B, (n_layers + 1) * S, H]: one Concat (no per-layer ops) so a signal can read every block's transition
        # (River's minimum cosine over a segment's blocks); the runner binds it only when its signal needs it
        states = b.op("Concat", [*boundaries, x], axis=1)
        if pad is not None:
            x, layer_input, states = pad.cut(b, x), pad.cut(b, layer_input), pad.cut_states(b, states, hi - lo + 1)
        b.output(x, "hidden_states_out", None, ["batch", "sequence", dims.hidden_size])
        b.output(layer_input, "last_layer_input", None, ["batch", "sequence", dims.hidden_size])
        outputs.update(hidden_out="hidden_states_out", layer_input="last_layer_input")
        b.output(states, "layer_states", None, ["batch", "states", dims.hidden_size])
        outputs["layer_states"] = "layer_states"
    kind = "kv" if kv_only else "segment"
    file = f"{kind}_{lo:03d}_{hi:03d}.onnx"
    io = GraphIO(
        file=file,
        inputs={
            "hidden": "hidden_states",
            "seqlens_k": "seqlens_k",
            "total_sequence_length": "total_sequence_length",
            "past_key": names["past_key"],
            "past_value": names["past_value"],
        },
        outputs=outputs,
    )
    return b.model(f"{kind}_{lo}_{hi}"), io


def build_embedding(adapter: Adapter, dtype: str, transposed: bool) -> tuple[onnx.ModelProto, GraphIO]:
    """input_ids -> hidden states, gathering rows of the embedding table, or its columns where the table is the
    tied LM head stored transposed ([H, V], see _write_artifact)."""
    dims = adapter.dims
    b = _Builder(dtype)
    ids = b.input("input_ids", TensorProto.INT64, ["batch", "sequence"])
    if transposed:
        weight = b.input("embed_weight", None, [dims.hidden_size, dims.vocab_size])
        h = b.op("Transpose", [b.op("Gather", [weight, ids], axis=1)], perm=[1, 2, 0])  # [H, B, S] -> [B, S, H]
    else:
        weight = b.input("embed_weight", None, [dims.vocab_size, dims.hidden_size])
        h = b.op("Gather", [weight, ids], axis=0)
    scale = adapter.embed_scale()
    if scale != 1.0:
        h = b.op("Mul", [h, b.const("embed_scale", np.array(scale, np.float32))])
    b.output(h, "hidden_states", None, ["batch", "sequence", dims.hidden_size])
    io = GraphIO(
        file="embed.onnx",
        inputs={"input_ids": "input_ids", "weight": "embed_weight"},
        outputs={"hidden": "hidden_states"},
    )
    return b.model("embed"), io


def save_graph(model: onnx.ModelProto, io: GraphIO, folder: Path) -> GraphIO:
    """Write `io.file` with its large initializers moved to `io.file + '.data'` (ONNX external data).

    Each tensor's bytes are written and dropped from the proto one at a time, so the proto that is finally
    serialised is small whatever the model's size. Returns io with `data` naming the weights file (None when the
    graph has no large initializer, e.g. the embedding graph, whose table is bound at run time).
    """
    data_name = io.file + ".data"
    offset = 0
    with open(folder / data_name, "wb") as f:
        for tensor in model.graph.initializer:
            if len(tensor.raw_data) < EXTERNAL_MIN_BYTES:
                continue
            size = len(tensor.raw_data)
            if size >= EXTERNAL_ALIGN_MIN_BYTES:
                offset = -(-offset // EXTERNAL_ALIGN) * EXTERNAL_ALIGN
            f.seek(offset)
            f.write(tensor.raw_data)
            set_external_data(tensor, data_name, offset, size)
            tensor.ClearField("raw_data")
            offset += size
    if offset == 0:
        (folder / data_name).unlink()
        data = None
    else:
        data = data_name
    onnx.save(model, str(folder / io.file))
    return io.model_copy(update={"data": data})
